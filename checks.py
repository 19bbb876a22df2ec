"""checks.py -- the commands a user reaches for when a run must be trusted: "is this machine and
engine fit to train", "which experiment is this", "does resume really reproduce my run", "did that
episode really happen".

Stage owned: none of training. This file is the top of the import chain (codec <- farm <- ladder
<- ppo_clash <- checks) and re-uses, never re-implements, what the stages below it define: the
identity recipe (ppo_clash.compute_identity), the resume of `python ppo_clash.py --resume`, the env
that farm.py builds from a run's config.

    python checks.py doctor [--profile P | --config F]    the start-up gates; design 3.8
    python checks.py identity [--profile P | --config F | RUN_DIR] [--diff RUN_A RUN_B]
    python checks.py verify-resume [--script S] [--profile P]   smoke by default; design 8.3
    python checks.py replay RUN_DIR --episode N [--all]   re-simulate episodes.jsonl records
    python checks.py replay FILE [--episode N]           re-simulate a battle `play --save` wrote
    python checks.py play --blue PLAYER --red PLAYER [--run RUN_DIR] [--seed S] [--every K]
                          [--save F] [--viewer]           watch one battle; design 7.5
    python checks.py bench [--script S] [--profile P] [--iterations N] [--write]   this machine's
                          budget; design 1.2
    python checks.py learn [--script S] [--profile P] [--game-steps G] [--seeds N] [--config F] [--write]
                          [--resume RUN]  the learning benchmark: train, then the yardstick on v0
                          and the champion; --resume RUN continues a stopped one; docs/learning.md
    --script S: learn, bench and verify-resume train S, a fork of ppo_clash.py beside this file
    python checks.py export --checkpoint runs/<id>/checkpoints/<step> --out models/experiments/<name>
                          a checkpoint's actor as a snapshot folder, as the gate writes one


Reads:  a run directory: config.json, identity.json, metrics.jsonl, episodes.jsonl,
        ladder/games.jsonl, ladder/eval_env.json, ladder/snapshots/, checkpoints/*/manifest.json
        (play reads a checkpoint's files too). verify-resume trains into a scratch folder of its
        own (--work-dir; removed afterwards unless --keep).
Writes: nothing in any run directory it is pointed at, but `export`'s snapshot into its run's
        archive (ladder/snapshots/, which only grows); `play --save F` writes F; `learn` trains a
        new run under --runs-dir, or continues one (--resume); the yardstick's games go to its log;
        with --write it appends to docs/learning.md; `export` writes --out.
Exit codes: 0 pass, 1 a check failed (a divergence, a differing field), 2 bad input (a missing
run directory, an episode index out of range, a corrupt file), one line naming the thing, no
traceback.

Where to start reading: each command is one section, its cmd_* function last in it; the CLI's
dataclasses and main() are at the bottom.
  1. Shared readers       a run's files, read with their name in every error
  2. identity             the RunIdentity and run_id, as training computes them (design 2.3)
  3. verify-resume        a straight run against a stopped-and-resumed one (design 8.3, 2.4)
  4. replay               an EpisodeRecord re-simulated from its seed and played actions (design 3.1)
  5. doctor               the start-up gates training runs, printed (design 3.8)
  6. play                 one battle between two players, watched and saved (design 7.5, 2.2)
  7. bench                the profile's parts timed alone, beside its real iterations (design 1.2)
  8. learn                the learning benchmark: a budget of training, then the yardstick
  9. export               a checkpoint's actor as a snapshot folder, as the gate writes one
 10. CLI
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Callable, NamedTuple, Optional, Sequence, Union

if __name__ == "__main__":   # one module object whether run as a script or imported (as ladder.py does)
    sys.modules["checks"] = sys.modules[__name__]

import msgspec
import numpy as np
import torch
import tyro

import codec
import farm
import ladder
import ppo_clash as P

ROOT = Path(P.__file__).resolve().parent
# P is the training script. learn, bench and verify-resume take --script: a fork of ppo_clash.py
# beside this file (cp ppo_clash.py ppo_myidea.py), which main() loads and binds to P before the
# command runs (use_script), so every P.train, P.Args and P.set_up below is the fork's own and the
# tools measure the fork, not the file it was copied from.


# --- 1. Shared readers ----------------------------------------------------------------------------
# Every reader names the file (and the line) it could not use and what to do about it; the CLI
# turns a CheckError into one line on stderr and exit 2.


class CheckError(ValueError):
    """Bad input to a check: names the file or field and the remedy. Exit 2."""


def use_script(name: str) -> None:
    """Bind P to the training script `name`, a file beside checks.py, loaded as ladder.py loads the
    script a snapshot names (ladder.training_script): one module under its own name, so a run's
    snapshots, its gates and the yardstick play the fork's network with the fork's code."""
    global P
    if name == Path(P.__file__).name:
        return
    path = ROOT / name
    if Path(name).name != name or path.suffix != ".py" or not path.is_file():
        raise CheckError(f"--script {name}: not a .py file beside checks.py in {ROOT}; a fork is a copy "
                         f"of ppo_clash.py there (cp ppo_clash.py ppo_myidea.py; --script ppo_myidea.py)")
    try:
        P = ladder.training_script(name)
    except ladder.CliError as e:
        raise CheckError(f"--script {name}: {e}") from None


def script_name() -> str:
    """The training script the command runs (ppo_clash.py, or the fork --script named)."""
    return Path(P.__file__).name


def run_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise CheckError(f"{p}: no such run directory (a run lives at <runs_dir>/<run_name>-<run_id>/)")
    return p


def read_json(path: Path) -> Any:
    if not path.exists():
        raise CheckError(f"{path}: missing; every run directory has it from its first iteration "
                         "(was the run made by ppo_clash.py?)")
    try:
        return json.loads(path.read_bytes())
    except ValueError as e:
        raise CheckError(f"{path}: not valid JSON ({e}); restore it from a copy") from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One dict a line; an empty or absent file is an empty list (a run before its first episode)."""
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError as e:
            raise CheckError(f"{path}: line {n} is not JSON ({e}); the file is corrupt") from None
        if not isinstance(row, dict):
            raise CheckError(f"{path}: line {n} is not a JSON object")
        rows.append(row)
    return rows


def run_args(run: Path) -> P.Args:
    """The run's own config.json, resolved the way `ppo_clash.py --resume` resolves it."""
    path = run / "config.json"
    read_json(path)   # a missing or corrupt file is named before the config loader sees it
    try:
        return P.load_config_file(path)
    except P.ConfigError as e:
        raise CheckError(str(e)) from None


# --- 2. identity (design 2.3) ---------------------------------------------------------------------
# The identity is computed by ppo_clash.compute_identity, the call open_run makes, so the run_id
# printed here is the one a run started with these arguments would get.


def compute_identity(args: P.Args) -> tuple[P.RunIdentity, str]:
    identity = P.compute_identity(args, P.read_env(args))
    return identity, P.run_id(identity)


def run_identity(run: Path) -> dict[str, Any]:
    """A run's identity.json, checked to be a RunIdentity (so a hand-edited file is refused)."""
    doc = read_json(run / "identity.json")
    try:
        msgspec.convert(doc, P.RunIdentity)
    except msgspec.ValidationError as e:
        raise CheckError(f"{run / 'identity.json'}: not a RunIdentity ({e})") from None
    return doc


def identity_of_run(run: Path) -> tuple[dict[str, Any], str]:
    doc = run_identity(run)
    return doc, P.run_id(msgspec.convert(doc, P.RunIdentity))


def identity_diff_lines(a: Path, b: Path) -> list[str]:
    """Every field that differs between two runs' identity.json, as 'path: a -> b', one a line."""
    return P.dict_diff(run_identity(a), run_identity(b))


def cmd_identity(cmd: "Identity") -> int:
    if cmd.diff is not None:
        a, b = (run_dir(x) for x in cmd.diff)
        lines = identity_diff_lines(a, b)
        (_, ida), (_, idb) = identity_of_run(a), identity_of_run(b)
        print(f"run_id {ida} ({a}) vs {idb} ({b}): {len(lines)} field(s) differ")
        for line in lines:
            print(line)
        return 0
    given = [x for x in (cmd.run, cmd.profile, cmd.config) if x is not None]
    if len(given) > 1:
        raise CheckError("identity takes one of RUN_DIR, --profile or --config")
    if cmd.run is not None:
        run = run_dir(cmd.run)
        doc, rid = identity_of_run(run)
        print(msgspec.json.format(P.canonical_json(doc)).decode())
        note = "" if run.name.endswith(rid) else f"   (the directory is named {run.name}: renamed?)"
        print(f"run_id {rid}{note}")
        return 0
    argv = ["--config", cmd.config] if cmd.config is not None else ["--profile", cmd.profile or "laptop"]
    if cmd.config is not None and not Path(cmd.config).exists():
        raise CheckError(f"{cmd.config}: no such config file")
    identity, rid = compute_identity(P.parse_args(argv))
    print(msgspec.json.format(P.canonical_json(identity)).decode())
    print(f"run_id {rid}")
    return 0


# --- 3. verify-resume (design 8.3, 2.4) -----------------------------------------------------------
# Design 8.3 as a command on the user's machine and profile. Three directories under a scratch
# folder:
#   a/  the straight run: four iterations, a checkpoint after the second and the fourth;
#   b/  the same configuration stopped at the second iteration, so its directory is the run as it
#       stood at that checkpoint, made by the code that writes it rather than by cutting a's
#       files back (the ladder's files would each need their own rule). Its rows 1-2 must equal
#       a's; then a's own iteration-2 checkpoint is copied over b's and resumed;
#   the resume: `python ppo_clash.py --resume b --checkpoint <a's iteration-2 checkpoint>` in a
#       fresh process, which runs iterations 3-4. On smoke, battles last ~100 decisions (T = 43), so
#       the split finds them mid-episode and some finish in iteration 3.
# Battles are played whole: the checkpoint finds them mid-episode, and the resume re-simulates each
# to where it stood (design 3.9), so the promise of design 2.4 item 3 holds at any iteration
# boundary. Then a and b are compared
# file by file, row by row, field by field: metrics.jsonl (wall-clock keys aside), every
# checkpoint's state_digest, episodes.jsonl, ladder/games.jsonl (its "wall" stamp aside).

SPLIT, TOTAL = 2, 4
WALL_CLOCK = P.NONDETERMINISTIC + ("ladder/gate_seconds_frac", "ladder/probe_seconds_frac")
_ABSENT = "<absent>"


def resume_flags(profile: str, config: str | None, runs_dir: Path) -> list[str]:
    """The profile (with the --config change merged over it) and a checkpoint every SPLIT
    iterations; the limit sits at TOTAL iterations, so the resumed process stops where the
    straight run did."""
    chosen = ["--profile", profile] + (["--config", config] if config else [])
    env = P.read_env(P.parse_args(chosen))
    return chosen + ["--runs-dir", str(runs_dir),
                     "--checkpoint.every-env-steps", str(SPLIT * env.T * env.n_battles),
                     "--timestep-limit", str(TOTAL * env.T * env.learner_rows)]


def _same(a: Any, b: Any) -> bool:
    """Equality that holds a NaN equal to itself: a metric can be NaN in both runs."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare_rows(name: str, rows_a: Sequence[dict[str, Any]], rows_b: Sequence[dict[str, Any]],
                 skip: Callable[[str], bool] = lambda k: False) -> str | None:
    """The first difference between two lists of rows, as 'file row N field F: a, b'; None if none."""
    for n, (ra, rb) in enumerate(zip(rows_a, rows_b, strict=False), 1):
        for k in list(ra) + [k for k in rb if k not in ra]:
            va, vb = ra.get(k, _ABSENT), rb.get(k, _ABSENT)
            if not skip(k) and not _same(va, vb):
                return f"{name}: row {n}, field {k!r}: straight run {va!r}, resumed run {vb!r}"
    if len(rows_a) != len(rows_b):
        n = min(len(rows_a), len(rows_b)) + 1
        return (f"{name}: row {n}: the straight run has {len(rows_a)} rows, the resumed run "
                f"{len(rows_b)}")
    return None


def checkpoint_digests(run: Path) -> dict[str, str]:
    return {d.name: read_json(d / "manifest.json")["state_digest"]
            for d in sorted((run / "checkpoints").glob("*")) if (d / "manifest.json").exists()}


def compare_runs(a: Path, b: Path) -> str | None:
    """What verify-resume checks, in this order; the first difference, or None. The rows cover
    run/state_digest of every iteration; the checkpoints' manifests cover the saved learners."""
    found = compare_rows("metrics.jsonl", read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl"),
                         skip=lambda k: k.startswith(WALL_CLOCK))
    if found:
        return found
    da, db = checkpoint_digests(a), checkpoint_digests(b)
    for step in sorted(set(da) | set(db)):
        if da.get(step, _ABSENT) != db.get(step, _ABSENT):
            return (f"checkpoints/{step}/manifest.json: field 'state_digest': straight run "
                    f"{da.get(step, _ABSENT)!r}, resumed run {db.get(step, _ABSENT)!r}")
    found = compare_rows("episodes.jsonl", read_jsonl(a / "episodes.jsonl"), read_jsonl(b / "episodes.jsonl"))
    if found:
        return found
    return compare_rows("ladder/games.jsonl", read_jsonl(a / "ladder" / "games.jsonl"),
                        read_jsonl(b / "ladder" / "games.jsonl"), skip=lambda k: k == "wall")


class ResumeFailed(RuntimeError):
    """The fresh process could not resume or refused what it reached: a failed check, exit 1."""


def make_resumed_pair(profile: str, config: str | None, work: Path,
                      say: Callable[[str], None] = print) -> tuple[Path, Path]:
    """Train the straight run and the stopped one, then resume the stopped one from the straight
    run's iteration-SPLIT checkpoint in a fresh process. Returns (straight, resumed) run dirs."""
    flags_a, flags_b = resume_flags(profile, config, work / "a"), resume_flags(profile, config, work / "b")
    say(f"straight run: {TOTAL} iterations of {' '.join(flags_a[:flags_a.index('--runs-dir')])}, "
        f"a checkpoint every {SPLIT}")
    a = P.train(P.parse_args(flags_a), max_iterations=TOTAL, quiet=True)
    say(f"stopped run: the same configuration, stopped after iteration {SPLIT}")
    b = P.train(P.parse_args(flags_b), max_iterations=SPLIT, quiet=True)
    ck_b = P.latest_checkpoint(b)
    ck_a = a / "checkpoints" / ck_b.name if ck_b is not None else None
    if ck_a is None or not (ck_a / "manifest.json").exists():
        raise CheckError(f"{a}: no checkpoint at iteration {SPLIT} (found {sorted(checkpoint_digests(a))}): "
                         "the checkpoint cadence did not land on the split")
    shutil.rmtree(ck_b)
    shutil.copytree(ck_a, ck_b)   # resume from the straight run's own checkpoint
    say(f"resume: python {script_name()} --resume {b} --checkpoint {ck_b}   (a fresh process)")
    proc = subprocess.run([sys.executable, str(ROOT / script_name()), "--resume", str(b),
                           "--checkpoint", str(ck_b)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ResumeFailed(f"the resumed process exited with {proc.returncode}: {tail}")
    return a, b


def verify_resume(profile: str, config: str | None, work: Path,
                  say: Callable[[str], None] = print) -> str | None:
    """The whole check: the first difference (file, row, field, both values), or None for PASS."""
    try:
        a, b = make_resumed_pair(profile, config, work, say)
    except ResumeFailed as e:
        return str(e)
    return compare_runs(a, b)


def cmd_verify_resume(cmd: "VerifyResume") -> int:
    work = Path(cmd.work_dir) if cmd.work_dir else Path(tempfile.mkdtemp(prefix="verify-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        raise CheckError(f"{work}: not empty; verify-resume trains two runs there (pass an empty or new "
                         "--work-dir)")
    try:
        found = verify_resume(cmd.profile, cmd.config, work)
    finally:
        if not cmd.keep:
            shutil.rmtree(work, ignore_errors=True)
    where = f" (runs kept in {work})" if cmd.keep else ""
    if found is None:
        print(f"PASS: rows 1-{TOTAL} of metrics.jsonl equal field for field (wall-clock keys aside), "
              f"run/state_digest and every checkpoint's included; episodes.jsonl and ladder/games.jsonl "
              f"equal{where}")
        return 0
    print(f"FAIL: {found}{where}")
    return 1


# --- 4. replay (design 3.1) -----------------------------------------------------------------------
# An EpisodeRecord carries its seed and every non-no-op action of BOTH seats with its decision
# index (farm.RunningEpisodes); with the run's env spec that re-simulates it exactly
# (tests/test_farm.py holds the farm to it). Built from the run's config.json by ppo_clash.read_env,
# the one recipe training uses, and checked against identity.json's env_spec_digest first.
#
# The potential reward pays gamma * Phi(s') - Phi(s) (design 4), and gamma follows its schedule
# per iteration, so each decision is replayed under the gamma its iteration had: an episode of
# battle b at ordinal k started at the run cycle where its battle's earlier episodes ended.
#
# Replay cannot pass vacuously. The played list is held to the other seat's record of the same
# battle (both carry the battle's list), which names the step of an edit to one record; then the
# record's own counts are bounds checked at every step, and at the end every outcome field is
# compared: an action masked out at its state, a card count overrun, an episode that ends early
# or never, a crown, a tower fraction or a reward sum off by one bit. The step named is the
# first at which the divergence is visible. What stays out of reach: the same edit made to both
# seats' records that happens to leave the battle's end unchanged (a card one tile over); the
# record states how the battle ended, not each step.
#
# A file that `play --save` wrote (section 6) is replayed the same way: it carries both seats'
# records and the EnvFactorySpec the battle was played on, so SavedBattleEnv rebuilds that env
# (checked against the digest the file states) instead of a run's, with the one gamma the
# battle was played under; replay_record, the twin check and the comparison are the same code,
# so an edited file fails exactly as an edited run record does.

SEATS = ("blue", "red")


class Divergence(NamedTuple):
    step: int
    field: str
    record: Any
    replay: Any

    def __str__(self) -> str:
        return f"step {self.step}: {self.field}: record {self.record!r}, replay {self.replay!r}"


class Replayed(NamedTuple):
    fields: list[tuple[str, Any, Any]]   # (field, record, replay) compared at the end
    divergence: Divergence | None


def read_records(run: Path) -> list[farm.EpisodeRecord]:
    path = run / "episodes.jsonl"
    if not path.exists():
        raise CheckError(f"{path}: missing (a run writes it at its first iteration)")
    try:   # a live run's last line may be unfinished: left out
        return ladder.read_log(path, msgspec.json.Decoder(farm.EpisodeRecord).decode, "an EpisodeRecord")[0]
    except ValueError as e:
        raise CheckError(str(e)) from None


class ReplayEnv:
    """The run's training env and its gamma per decision: built once, reset per record, dealt
    as each record's battle was (ladder.seat_decks: `deals`, one a battle; None: the env's own)."""
    deals: list[dict[str, Any]] | None = None

    def __init__(self, run: Path, records: Sequence[farm.EpisodeRecord]) -> None:
        self.args = run_args(run)
        env = P.read_env(self.args)
        want = run_identity(run)["env_spec_digest"]
        if farm.env_value_digest(env.spec) != want:
            raise CheckError(f"{run / 'config.json'} builds an env with env_spec_digest "
                             f"{farm.env_value_digest(env.spec)[:16]}, identity.json says {want[:16]}: this "
                             "code's env is not the run's (check out the commit the run was trained with)")
        self.make = farm.env_factory(env.spec)
        self.env = self.make()
        self.T, self.n_battles = env.T, env.n_battles
        self.deals = P.seat_deals(self.args.ladder.seat_decks,
                                  ladder.role_layout(env.seed, env.n_battles, self.args.ladder.mix))
        self.pair_seats(records)

    def deal(self, rec: farm.EpisodeRecord) -> None:
        """Deal the record's battle as the farm's worker did (farm.FarmConfig.deals)."""
        if self.deals is None:
            return
        if rec.battle >= len(self.deals):
            raise CheckError(f"episode of battle {rec.battle}: this run deals {len(self.deals)} battles a "
                             "rank; a torchrun run's other ranks deal by their own roles, which replay does "
                             "not rebuild")
        from royalegym.state_mutator import DeckCurriculumStateMutator
        self.env.state_mutator = DeckCurriculumStateMutator(**self.deals[rec.battle])

    def pair_seats(self, records: Sequence[farm.EpisodeRecord]) -> None:
        """Index the records by battle, so each can be held against its other seat's."""
        self.lengths: dict[tuple[int, int], int] = {}   # (battle, ordinal) -> episode_steps
        # both seats' records of a battle
        self.seats: dict[tuple[int, int, int], list[farm.EpisodeRecord]] = {}
        for r in records:
            self.lengths.setdefault((r.battle, r.ordinal), r.episode_steps)
            self.seats.setdefault((r.battle, r.ordinal, r.episode_seed), []).append(r)

    def other_seat(self, rec: farm.EpisodeRecord) -> Divergence | None:
        """Both seats of a battle write a record with the same played list (the battle's, both
        seats' actions), so an edit of one record disagrees with its twin at the edited step,
        even where the edited battle would end exactly as the original did."""
        for twin in self.seats.get((rec.battle, rec.ordinal, rec.episode_seed), []):
            if twin.seat == rec.seat or twin.played == rec.played:
                continue
            mine, theirs = list(rec.played), list(twin.played)
            i = next((j for j, (x, y) in enumerate(zip(mine, theirs, strict=False)) if list(x) != list(y)),
                     min(len(mine), len(theirs)))   # else one list is the other's prefix
            steps = [int(e[0]) for e in (mine[i:i + 1] + theirs[i:i + 1])]
            return Divergence(min(steps), f"played[{i}]", list(mine[i]) if i < len(mine) else _ABSENT,
                              f"{list(theirs[i]) if i < len(theirs) else _ABSENT} (the {SEATS[twin.seat]} "
                              "seat record of this battle)")
        return None

    def gammas(self, rec: farm.EpisodeRecord) -> list[float]:
        """The gamma of each of rec's decisions: its iteration's schedule value."""
        g = self.args.advantage.gamma
        if g.kind == "constant":
            return [g.value(0)] * rec.episode_steps
        missing = [k for k in range(rec.ordinal) if (rec.battle, k) not in self.lengths]
        if missing:
            raise CheckError(f"episodes.jsonl has no record of battle {rec.battle} ordinal {missing[0]}, so "
                             f"where ordinal {rec.ordinal} started (and its gamma) is unknown")
        start = sum(self.lengths[(rec.battle, k)] for k in range(rec.ordinal))
        per_iteration = self.T * self.n_battles
        return [g.value((start + s) // self.T * per_iteration) for s in range(rec.episode_steps)]


class SavedBattleEnv(ReplayEnv):
    """A saved battle's env (`play --save F`): the EnvFactorySpec stored in F, checked to hash to
    the env_value_digest F states (else this code builds another env, or F's env was edited), and
    the one gamma the battle was played with. Everything else is ReplayEnv's, so a saved battle is
    checked field for field as a run's record is, twin seat included."""

    def __init__(self, path: Path, saved: "SavedBattle") -> None:
        have = farm.env_value_digest(saved.env)
        if have != saved.env_value_digest:
            raise CheckError(f"{path}: its env hashes to env_value_digest {have[:16]} here, the file says "
                             f"{saved.env_value_digest[:16]}: the env was edited, or this code's components "
                             "differ from the ones it was played with (check out that commit)")
        self.make = farm.env_factory(saved.env)
        self.env = self.make()
        self.gamma = saved.gamma
        self.pair_seats(saved.records)

    def gammas(self, rec: farm.EpisodeRecord) -> list[float]:
        return [self.gamma] * rec.episode_steps


def _played_by_step(rec: farm.EpisodeRecord, noop: int,
                    n_actions: int) -> tuple[dict[int, list[tuple[int, int]]], Divergence | None]:
    """played as {step: [(seat, action)]}, and the first entry no real player could have written."""
    by: dict[int, list[tuple[int, int]]] = {}
    prev = (-1, -1)
    for i, entry in enumerate(rec.played):
        step, seat, action = (int(x) for x in entry)
        bad = ("its step is outside the episode" if not 0 <= step < rec.episode_steps else
               "its seat is not 0 or 1" if seat not in (0, 1) else
               "a no-op is never recorded" if action == noop else
               "its action is outside the action space" if not 0 <= action < n_actions else
               "out of order or repeated" if (step, seat) <= prev else None)
        if bad:
            return by, Divergence(max(step, 0), f"played[{i}]", list(entry), bad)
        prev = (step, seat)
        by.setdefault(step, []).append((seat, action))
    return by, None


class Recorders:
    """Several recorders on one env, which takes one: a trace's ReplayRecorder beside the
    TrajectoryDigest every replay keeps. Per-tick frames if any of them asks."""

    def __init__(self, *recs: Any) -> None:
        self.recs, self.frame_every_tick = recs, any(r.frame_every_tick for r in recs)

    def begin(self, engine: Any, seed: int, init: Any) -> None:
        for r in self.recs:
            r.begin(engine, seed, init)

    def record_frame(self, engine: Any) -> None:
        for r in self.recs:
            r.record_frame(engine)

    def record_step(self, *step: Any) -> None:
        for r in self.recs:
            r.record_step(*step)

    def end(self, engine: Any) -> None:
        for r in self.recs:
            r.end(engine)


def replay_record(renv: ReplayEnv, rec: farm.EpisodeRecord, recorder: Any = None) -> Replayed:
    """Re-simulate one record: its seed, both seats' played actions, its gammas; compare. The
    engine's states are chained as the worker chained them (farm.TrajectoryDigest); `recorder`,
    a trace's, rides beside."""
    digest = farm.TrajectoryDigest()
    renv.env.recorder = digest if recorder is None else Recorders(recorder, digest)
    try:
        return _replay_steps(renv, rec, digest)
    finally:
        renv.env.recorder = None


def _replay_steps(renv: ReplayEnv, rec: farm.EpisodeRecord, digest: farm.TrajectoryDigest) -> Replayed:
    from royalegym.action import NOOP
    env, me = renv.env, SEATS[rec.seat]
    renv.deal(rec)
    obs, _ = env.reset(seed=rec.episode_seed)
    by, bad = _played_by_step(rec, NOOP, int(obs[me]["action_mask"].shape[-1]))
    bad = bad or renv.other_seat(rec)
    if bad:
        return Replayed([], bad)
    gammas, cards, illegal, ret = renv.gammas(rec), 0, 0, 0.0
    ended, info = False, {}
    for step in range(rec.episode_steps):
        acts = {"blue": NOOP, "red": NOOP}
        for seat, action in by.get(step, ()):
            if not obs[SEATS[seat]]["action_mask"][action]:
                return Replayed([], Divergence(step, f"played action {action} of {SEATS[seat]}",
                                               "chosen by its player", "masked out at this state"))
            acts[SEATS[seat]] = action
        farm.set_env_gamma(env, gammas[step])   # what the farm's worker forwards before each step
        obs, rew, term, trunc, info = env.step(acts)
        ret += float(np.float32(rew[me]))  # the worker's running float64 sum of float32 rewards
        deploy = int(info[me]["deploy_status"])
        cards, illegal = cards + (deploy == 0), illegal + (1 <= deploy <= 11)
        ended = bool(term[me] or trunc[me])
        early = (Divergence(step, "cards_played", rec.cards_played, f"{cards} by this step")
                 if cards > rec.cards_played
                 else Divergence(step, "illegal_commands", rec.illegal_commands, f"{illegal} by this step")
                 if illegal > rec.illegal_commands
                 else Divergence(step, "episode_steps", rec.episode_steps, f"ended after {step + 1}")
                 if ended and step < rec.episode_steps - 1 else None)
        if early:
            return Replayed([], early)
    last = rec.episode_steps - 1
    if not ended:
        return Replayed([], Divergence(last, "episode_steps", rec.episode_steps, "still running"))
    fields = _final_fields(rec, info[me], cards, illegal, ret, farm.episode_step_abs(env, rec.seat),
                           digest.digest)
    first = next((Divergence(last, f, a, b) for f, a, b in fields if not _same(a, b)), None)
    return Replayed(fields, first)


def _final_fields(rec: farm.EpisodeRecord, fin: dict[str, Any], cards: int, illegal: int,
                  ret: float, step_abs: dict[str, float], digest: str) -> list[tuple[str, Any, Any]]:
    """(field, record, replay) for everything the record states about how the episode ended. A
    record written before reward_terms_step_abs or trajectory_digest existed has none, and
    nothing to compare."""
    terms = {k.split("/", 1)[1]: float(v) for k, v in fin.items() if k.startswith("reward_sum/")}
    out: list[tuple[str, Any, Any]] = [(f, getattr(rec, f), type(getattr(rec, f))(fin[f])) for f in (
        "episode_steps", "episode_ticks", "own_crowns", "enemy_crowns", "own_tower_hp_frac",
        "enemy_tower_hp_frac", "elixir_leak_steps")]
    out += [("winner", rec.winner, int(fin.get("winner", -1))),
            ("outcome", rec.outcome, int(fin.get("outcome", 0))),
            ("cards_played", rec.cards_played, cards), ("illegal_commands", rec.illegal_commands, illegal),
            ("undiscounted_return", rec.undiscounted_return, ret)]
    out += [(f"reward_terms.{k}", rec.reward_terms.get(k, _ABSENT), terms.get(k, _ABSENT))
            for k in sorted(set(rec.reward_terms) | set(terms))]
    if rec.reward_terms_step_abs:
        out += [(f"reward_terms_step_abs.{k}", rec.reward_terms_step_abs.get(k, _ABSENT),
                 step_abs.get(k, _ABSENT))
                for k in sorted(set(rec.reward_terms_step_abs) | set(step_abs))]
    if rec.trajectory_digest:
        out.append(("trajectory_digest", rec.trajectory_digest, digest))
    return out


def describe(i: int, rec: farm.EpisodeRecord) -> str:
    return (f"episode {i}: battle {rec.battle} ordinal {rec.ordinal} seat {rec.seat} ({SEATS[rec.seat]}), "
            f"{rec.policy_id} vs {rec.opponent_id}, seed {rec.episode_seed}, {rec.episode_steps} steps, "
            f"{len(rec.played)} played actions (both seats)")


def print_replayed(i: int, rec: farm.EpisodeRecord, res: Replayed) -> int:
    """One record against its replay, field by field; 0 on a match, else 1."""
    print(describe(i, rec))
    print(f"  {'field':<40} {'record':>24} {'replay':>24}")
    for f, a, b in res.fields:
        print(f"  {f:<40} {a!r:>24} {b!r:>24}  {'ok' if _same(a, b) else 'DIFFERS'}")
    print(f"DIVERGES at {res.divergence}" if res.divergence else "MATCH: every field equal")
    if res.divergence is not None and res.divergence.step == rec.episode_steps - 1:
        print("  (a record states how its episode ended, not each step, so a divergence earlier in the "
              "battle first shows at its last step)")
    return 1 if res.divergence else 0


def replay_to_trace(renv: ReplayEnv, i: int, rec: farm.EpisodeRecord, path: Path, table: bool = True) -> int:
    """Replay one record as print_replayed does (its field table, or with table False one line),
    with royalegym's recorder on the env, so the battle leaves as a royalegym Trace (a frame
    every engine tick): written to `path` only when the replay matched its record, then
    re-simulated on a fresh engine by royalegym's own verify_trace, which checks every deploy
    status and every frame's state hash. 0 when both hold."""
    from royalegym.replay import ReplayRecorder, save_trace, verify_trace
    recorder = ReplayRecorder(frame_every_tick=True)
    res = replay_record(renv, rec, recorder)
    trace = recorder.trace
    if not table:
        print(f"replayed from {SEATS[rec.seat]}'s record: "
              + (f"DIVERGES at {res.divergence}" if res.divergence
                 else "every field and the trajectory digest match"))
    if (print_replayed(i, rec, res) if table else res.divergence is not None):
        print(f"no trace written: the replay diverged from the record, so {path} would show a battle "
              "that did not happen")
        return 1
    try:   # a new folder is made, as play --save makes one
        path.parent.mkdir(parents=True, exist_ok=True)
        save_trace(trace, path)
    except OSError as e:
        raise CheckError(f"--trace {path}: cannot be written ({e.strerror}); the replay matched, so run it "
                         "again with a path you can write") from None
    problems = verify_trace(trace, renv.make().engine)
    print(f"trace {path}: {len(trace.steps)} steps, {len(trace.frames)} frames, final state hash "
          f"{trace.result.final_hash}")
    if problems:
        print(f"verify_trace FAILS on a fresh engine ({len(problems)} divergences), the first: {problems[0]}")
        return 1
    print("verify_trace: identical on a fresh engine; draw it with "
          f"`python -m royalegym.render {path} -o battle.html`")
    return 0


def replay_saved_battle(path: Path, episode: int | None, trace: Path | None) -> int:
    """`replay F` for a file `play --save F` wrote: both seats' records (or --episode N's), each
    re-simulated on the env stored in F and held against its twin, printed field by field."""
    saved = read_saved_battle(path)
    n = len(saved.records)
    if episode is not None and not 0 <= episode < n:
        raise CheckError(f"--episode {episode} is out of range: {path} holds {n} records (0 blue, 1 red)")
    if trace is not None and episode is None:
        raise CheckError("--trace writes one battle: give --episode 0 (blue's record) or 1 (red's)")
    renv = SavedBattleEnv(path, saved)
    if trace is not None:
        return replay_to_trace(renv, episode, saved.records[episode], trace)
    print(f"saved battle {path}: blue {saved.players[0]} vs red {saved.players[1]}, --seed {saved.seed}, "
          f"env_value_digest {saved.env_value_digest[:16]}")
    chosen = range(n) if episode is None else [episode]
    bad = sum(print_replayed(i, saved.records[i], replay_record(renv, saved.records[i])) for i in chosen)
    print(f"{len(chosen) - bad} of {len(chosen)} records match")
    return 1 if bad else 0


def cmd_replay(cmd: "Replay") -> int:
    if Path(cmd.run).is_file():
        return replay_saved_battle(Path(cmd.run), cmd.episode, cmd.trace)
    run = run_dir(cmd.run)
    records = read_records(run)
    if not cmd.all and cmd.episode is None:
        raise CheckError("replay needs --episode N (0-based, a line of episodes.jsonl) or --all")
    if cmd.all and cmd.trace is not None:
        raise CheckError("--trace writes one battle: give --episode N instead of --all")
    if not records:
        raise CheckError(f"{run / 'episodes.jsonl'} holds no records yet: nothing to replay")
    if not cmd.all and not 0 <= cmd.episode < len(records):
        raise CheckError(f"--episode {cmd.episode} is out of range: {run / 'episodes.jsonl'} holds "
                         f"{len(records)} records (0..{len(records) - 1})")
    if any(r.eval_index >= 0 for r in records):
        raise CheckError(f"{run / 'episodes.jsonl'} holds evaluation episodes (eval_index >= 0): they are "
                         "played on ladder/eval_env.json, which replay does not rebuild")
    renv = ReplayEnv(run, records)
    if cmd.trace is not None:
        return replay_to_trace(renv, cmd.episode, records[cmd.episode], cmd.trace)
    if not cmd.all:
        return print_replayed(cmd.episode, records[cmd.episode], replay_record(renv, records[cmd.episode]))
    bad = 0
    for i, rec in enumerate(records):
        res = replay_record(renv, rec)
        bad += res.divergence is not None
        print(f"{describe(i, rec)}: " + (f"DIVERGES at {res.divergence}" if res.divergence else "match"))
    print(f"{len(records) - bad} of {len(records)} records match")
    return 1 if bad else 0


# --- 5. doctor (design 3.8) ----------------------------------------------------------------------
# The start-up gates training runs (ppo_clash.startup_gates, one implementation), printed one a
# line with their numbers, then step 10: what the run would be.


def cmd_doctor(cmd: "Doctor") -> int:
    if cmd.config is not None and not Path(cmd.config).exists():
        raise CheckError(f"{cmd.config}: no such config file")
    args = P.parse_args(["--config", cmd.config] if cmd.config is not None else ["--profile", cmd.profile])
    env = P.read_env(args)
    gates, _ = P.startup_gates(args, env, P.ActorCritic(env.geo, args.net, args.master_seed).to(env.device))
    a = args.advantage
    horizon = P.credit_horizon_seconds(args.obs.decision_ms, a.gamma.value(0), a.gae_lambda)
    gates.append(P.Gate(10, "what the run would be", True, f"T={env.T} cycles x R={env.R} slots, "
                        f"{env.learner_rows} learner rows a cycle ({env.T * env.learner_rows} an iteration), "
                        f"credit horizon {horizon:.1f} s, run_id {P.run_id(P.compute_identity(args, env))}"))
    print(f"doctor: {'--config ' + cmd.config if cmd.config else '--profile ' + cmd.profile} (design 3.8)")
    print(codec.format_table(env.table))
    print("\n".join(P.gate_lines(sorted(gates, key=lambda g: g.step))))
    P.check_gates(gates)   # the first failure exits 2, naming its gate and remedy
    print("all gates pass")
    return 0


# --- 6. play (design 7.5, 3.1, 2.2) ---------------------------------------------------------------
# One full battle between two players, watched as text, optionally saved so that `replay F`
# re-simulates it. Each choice below re-uses what training and the ladder already do, so what a
# person watches is what a gate would have played:
#   - The env. With a run (--run, or a checkpoint: player's run, two levels above it), the run's
#     evaluation env, ladder/eval_env.json through ladder.read_run_env: what its gates play, ending
#     only at game over (design 7.5: a cut match is scored on crowns not yet taken). Without one,
#     the evaluation env of farm.default_env_spec(): two scripted players need no run.
#   - What that env is (codec table, statics, observation space, the longest legal match) and who
#     plays (snap: built by ppo_clash.snapshot_policy_builder, a pairing refused by field, a
#     frame_stack != 1 snapshot refused) come from a ladder.EvalRunner opened on it. It plays
#     nothing here and writes nothing; it is the object a gate reads the same facts from.
#   - The battle is the evaluation farm's worker with one battle, in this process: farm.build_vec,
#     the worker's RunningEpisodes (it counts the battle and writes both EpisodeRecords, eval
#     mode, plan episode 0) and Seats (it seats the scripted players on their streams, mask-only
#     as the worker does, and steps them); the parent's half is FarmComparison's: a neural seat's
#     raw observation is packed with the run's codec table and unpacked (farm.unpack_numpy), so it
#     sees exactly what it saw in training, and acts on one uniform per decision from its stream.
#   - Seeding (design 2.2): the battle resets with derive_int(--seed, "play/battle") and seat c
#     draws from derive_generator(--seed, "play/seat/<c>"), so a battle is a function of (seed,
#     players) and its record re-simulates from the file alone.
#   - The text view reads the battle by name: the engine's BattleState (elixir_milli, tower_hp by
#     TowerSlot, crowns, tick), the card catalogue's names, the action parser's own decoding of
#     an action; the result line is the blue seat's EpisodeRecord, the numbers replay checks.

PLAY_BATTLE = "play/battle"
PLAY_GAMMA = 1.0   # the evaluation farm's gamma (FarmComparison submits 1.0): the return is undiscounted
PLAYER_KINDS = ("snap:", "seed:", "scripted:", farm.LOOKAHEAD, "checkpoint:")
SAVED_BATTLE_FORMAT = "clash-ppo saved battle 1"


class SavedBattle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What `play --save F` writes (JSON) and `replay F` reads: the battle's two EpisodeRecords
    (blue's, red's) and the env they were played on, as data and as its value digest."""
    format: str                                    # SAVED_BATTLE_FORMAT
    players: tuple[str, str]                       # (blue, red), as given to play
    seed: int                                      # --seed
    gamma: float                                   # forwarded to the reward before every step
    env_value_digest: str                          # farm.env_value_digest(env) when it was played
    env: farm.EnvFactorySpec
    records: tuple[farm.EpisodeRecord, ...]        # (blue's, red's)


def read_saved_battle(path: Path) -> SavedBattle:
    try:
        saved = msgspec.json.decode(path.read_bytes(), type=SavedBattle)
    except msgspec.DecodeError as e:
        raise CheckError(f"{path}: not a battle saved by `checks.py play --save` ({e})") from None
    if saved.format != SAVED_BATTLE_FORMAT:
        raise CheckError(f"{path}: format {saved.format!r}; this code reads {SAVED_BATTLE_FORMAT!r}")
    return saved


def parse_player(p: str) -> str:
    """A player id, refused unless its kind is known and, for scripted: and lookahead:, its setting
    too (a lookahead in its canonical form); or a snapshot folder (spec.json and actor.safetensors,
    such as a shipped model under models/), kept as its path."""
    if (Path(p) / "spec.json").is_file():
        return p
    kind = next((k for k in PLAYER_KINDS if p.startswith(k)), None)
    if kind is None or not p[len(kind):]:
        raise CheckError(f"player {p!r}: not snap:<id>, seed:<name>, scripted:<name>, "
                         "lookahead:<base>[,...], checkpoint:<dir> (a run's runs/<id>/checkpoints/<step>) "
                         "or a snapshot folder (models/<name>)")
    if kind in farm.WORKER_PLAYERS:
        try:
            farm.check_worker_player(p)
        except ValueError as e:
            raise CheckError(str(e)) from None
    return farm.canonical_player(p)


def play_run(players: Sequence[str], run: str | None) -> Path | None:
    """The one run the battle is played in: --run, or the run a checkpoint: player lives in."""
    found: dict[str, Path] = {"--run": run_dir(run)} if run is not None else {}
    for p in players:
        if p.startswith("checkpoint:"):
            ck = Path(p.removeprefix("checkpoint:"))
            if not ck.is_dir():
                raise CheckError(f"{p}: no such checkpoint directory (a run's are "
                                 "runs/<id>/checkpoints/<step>)")
            if not (ck / "manifest.json").is_file():
                raise CheckError(f"{p}: {ck / 'manifest.json'} is missing: not a checkpoint, or one whose "
                                 "write never finished; pick a checkpoint directory that has it")
            found[p] = run_dir(ck.resolve().parent.parent)
    where = {r.resolve() for r in found.values()}
    if len(where) > 1:
        raise CheckError("players from more than one run "
                         f"({', '.join(f'{k}: {v}' for k, v in found.items())}): play takes one run, "
                         "whose evaluation env and codec table both players saw")
    if not where and any(p.startswith(ladder.SNAPSHOT_PLAYERS) for p in players):
        raise CheckError("a snap:<id> or seed:<name> player needs --run RUN_DIR, the run whose ladder "
                         "holds it")
    return next(iter(found.values()), None)


class PlaySetup(NamedTuple):
    runner: Any                      # the ladder.EvalRunner holding the env's facts and the players
    players: tuple[str, str]         # (blue, red)
    acts: dict[str, Any]             # each player's act, None for a scripted one (the worker's)
    where: str                       # where the env came from
    args: P.Args | None              # the run's configuration, None without a run


def open_play(cmd: "Play") -> PlaySetup:
    named = (parse_player(cmd.blue), parse_player(cmd.red))
    run = play_run(named, cmd.run)
    args = run_args(run) if run is not None else None
    store = ladder.SnapshotStore(run)   # a snapshot folder is played as the snap: id it hashes to
    try:
        players = tuple(p if p.startswith(PLAYER_KINDS) else ladder.snapshot_player_id(store.add_folder(p))
                        for p in named)
    except FileNotFoundError as e:
        raise CheckError(str(e)) from None
    shipped = [Path(p) / "eval_env.json" for p in named if (Path(p) / "eval_env.json").is_file()]
    if run is None and shipped:   # a shipped model's folder carries the env it was measured on
        try:
            spec = msgspec.json.decode(shipped[0].read_bytes(), type=farm.EnvFactorySpec)
        except msgspec.DecodeError as e:
            raise CheckError(f"{shipped[0]}: not an environment description ({e})") from None
        where, table_seed = str(shipped[0]), 0
    elif run is None:
        spec, where, table_seed = farm.default_env_spec(), "farm.default_env_spec() (no run)", 0
    else:
        spec, where = ladder.read_run_env(run)
        table_seed = args.master_seed   # the codec table is decided on the run's seed, as its gates do
    runner: Any = None

    def build(sid: str) -> Any:   # the snapshot builder, on the table the runner decided
        return ladder.snapshot_builder(run, cmd.device, table=runner.table, store=store)(sid)
    runner = ladder.EvalRunner(spec, ladder.EvalSeedSet(master_seed=table_seed, path=PLAY_BATTLE,
                                                        seeds=[], sha256=""),
                               run_dir=run, policy_builder=build, store=store)
    try:
        for p in players:
            if p.startswith("checkpoint:") and p not in runner.policies:
                runner.register(p, P.checkpoint_policy_act(p.removeprefix("checkpoint:"), cmd.device,
                                                           table=runner.table, obs_digest=runner.obs_digest))
        runner.check_pair(*players)
        acts = {p: runner.players.act(p) for p in players}
    except (ValueError, FileNotFoundError) as e:   # ladder.SnapshotMismatch, or a seed the pool lacks
        raise CheckError(str(e)) from None
    return PlaySetup(runner, players, acts,
                     f"{where}, without truncation (ladder.eval_env_spec: it ends only at game over)", args)


class BattleView:
    """The compact text view, every `every` decisions: battle time, each side's elixir, crowns
    and towers' HP, and the actions taken since the last view (by whom, at which step: the
    record's decision index, which replay names; card and own-frame tile; a refused one with its
    deploy_status)."""

    def __init__(self, env: Any, players: Sequence[str], every: int, say: Callable[[str], None]) -> None:
        from royalegym.env import AGENT_TEAM
        self.env, self.players, self.every, self.say = env, players, every, say
        self.team = [AGENT_TEAM[c] for c in SEATS]
        self.names = {c.card_id: c.name for c in env.engine.cards()}
        self.plays: list[list[str]] = [[], []]   # per seat, since the last view

    def note(self, step: int, before: Any, acts: np.ndarray, deploy: np.ndarray, noop: int) -> None:
        """Name each seat's non-no-op action of this step, read off the state it was taken in."""
        parser = self.env.action_parser
        for s in (0, 1):
            a = int(acts[s])
            if a == noop:
                continue
            cmd = parser.parse(a, before, self.team[s])
            hand = before.players[self.team[s]].hand
            what = (self.names.get(hand[cmd.hand_slot], f"card #{hand[cmd.hand_slot]}")
                    if cmd.hand_slot < len(hand) else f"ability button {cmd.hand_slot - len(hand)}")
            if cmd.hand_slot < len(hand) and hasattr(parser, "decode"):
                _, x, y = parser.decode(a)
                what += f" at tile ({x}, {y})"
            refused = "" if int(deploy[s]) == 0 else f" (refused, deploy_status {int(deploy[s])})"
            self.plays[s].append(f"s{step} {what}{refused}")

    def played_lines(self) -> list[str]:
        """Each seat's actions since the last view, one line a seat; then they are forgotten."""
        lines = [f"    {SEATS[s]} played: {'; '.join(self.plays[s]) or 'nothing'}" for s in (0, 1)]
        self.plays = [[], []]
        return lines

    def show(self, step: int) -> None:
        from royalegym.protocol import TowerSlot
        st = self.env.battle_state
        t = st.tick * st.tick_ms / 1000.0
        lines = [f"step {step} ({step + 1} decisions), {int(t // 60)}:{t % 60:04.1f} of battle"]
        for s, color in enumerate(SEATS):
            p = st.players[self.team[s]]
            towers = " ".join(f"{slot.name.lower()} {p.tower_hp[slot]}" for slot in TowerSlot)
            lines.append(f"  {color:<4} elixir {p.elixir_milli / 1000:4.1f}  crowns {p.crowns}  "
                         f"towers {towers}   {self.players[s]}")
        self.say("\n".join(lines + self.played_lines()))


def _neural_actions(runner: Any, obs: dict[str, np.ndarray], players: Sequence[str], acts: dict[str, Any],
                    rngs: Sequence[np.random.Generator], step: int) -> np.ndarray:
    """The parent's actions (FarmComparison's path): each neural seat's observation packed with
    the run's codec table, unpacked as the evaluation runner unpacks the rectangle, and answered
    with one uniform from the seat's stream; a scripted seat's entry is the worker's (0 here)."""
    out = np.zeros(len(players), np.int64)
    neural = [s for s, p in enumerate(players) if acts[p] is not None]
    if not neural:
        return out
    rows = np.zeros((len(players), runner.table.row_bytes), np.uint8)
    codec.Packer(runner.table).pack(obs, rows, 0)
    for s in neural:
        seen = farm.unpack_numpy(runner.table, rows[[s]], runner.statics, np.array([s]),
                                 runner.env_spec.obs_space)
        a = int(np.asarray(acts[players[s]](seen, np.array([rngs[s].random()]))).reshape(-1)[0])
        if not obs["action_mask"][s, a]:
            raise RuntimeError(f"{players[s]}: illegal action {a} at decision {step} ({SEATS[s]}); a policy "
                               "must mask before sampling")
        out[s] = a
    return out


def _record(running: Any, envs: list[Any], i: int, fin: dict[str, Any], eval_ix: np.ndarray,
            players: Sequence[str]) -> farm.EpisodeRecord:
    """Slot i's EpisodeRecord as the worker ends an episode (ShardRunner._end_episodes) and the
    parent completes it (the evaluation mode: the plan's players, the pool bucket)."""
    winner = int(fin["winner"][i]) if "winner" in fin and fin["_winner"][i] else -1
    outcome = int(fin["outcome"][i]) if "outcome" in fin and fin["_outcome"][i] else 0
    raw = running.record(i, fin, winner, outcome, eval_ix, envs)
    raw.update(policy_id=players[i], opponent_id=players[1 - i], bucket=farm.bucket_of(farm.ROLE_POOL))
    return msgspec.convert(raw, farm.EpisodeRecord)


def play_battle(runner: Any, players: tuple[str, str], acts: dict[str, Any], seed: int, every: int,
                say: Callable[[str], None] = print, viser: Any = None) -> list[farm.EpisodeRecord]:
    """Play one full battle, showing it every `every` decisions; both seats' EpisodeRecords."""
    from royalegym.action import NOOP
    streams = tuple(f"play/seat/{c}" for c in SEATS)
    ep = farm.EvalEpisode(seed=farm.derive_int(seed, PLAY_BATTLE), seed_path=PLAY_BATTLE, players=players,
                          streams=(streams[0], streams[1]))
    cfg = farm.FarmConfig(env=runner.env_factory_spec, master_seed=seed, games_per_worker=1, cycles=1,
                          viewer=False, eval_plan=[ep])
    cfg.check()
    running = farm.RunningEpisodes(cfg, 0, 0, [0])
    vec = farm.build_vec(cfg.env, 1, viser=viser, autoreset_seed_fn=running.seed_fn)
    try:
        seats = farm.Seats(cfg, vec, 0, 0, 0, 2)
        obs, _ = vec.reset()
        seats.seat_eval(0, ep)
        for env in vec.envs:   # the gamma the evaluation farm's worker forwards (ShardRunner._forward_gamma)
            farm.set_env_gamma(env, PLAY_GAMMA)
        view = BattleView(vec.envs[0], players, every, say)
        rngs = [farm.derive_generator(seed, s) for s in streams]
        pace = time.monotonic()
        for step in range(runner.max_decisions):
            taken = seats.actions(_neural_actions(runner, obs, players, acts, rngs, step), obs, NOOP)
            running.note_actions(taken, NOOP)
            eval_ix, before = running.eval_ix.copy(), vec.envs[0].battle_state
            obs, rew, term, trunc, info = vec.step(taken)
            deploy, _ = farm.transition_deploy_tick(info)
            running.count(rew, deploy)
            view.note(step, before, taken, deploy, NOOP)
            if term[0] or trunc[0]:   # the vec env already reset the battle: the records hold the end
                say(f"step {step}, the last: the battle is over\n" + "\n".join(view.played_lines()))
                return [_record(running, vec.envs, i, info["final_info"], eval_ix, players) for i in (0, 1)]
            if (step + 1) % every == 0:
                view.show(step)
            if viser is not None and viser.attached:   # a watched battle runs at game speed
                pace += runner.env_spec.decision_ms / 1000.0
                time.sleep(max(0.0, pace - time.monotonic()))
            else:
                pace = time.monotonic()
        raise RuntimeError(f"the battle ran {runner.max_decisions} decisions, twice a full match; the "
                           "engine did not end it")
    finally:
        vec.close()


def result_line(rec: farm.EpisodeRecord, tick_ms: int) -> str:
    """The battle's end from the blue seat's record: winner, crowns, towers' HP, length."""
    from royalegym.protocol import Winner
    who = {Winner.BLUE: "blue wins", Winner.RED: "red wins", Winner.DRAW: "draw"}.get(rec.winner, "no result")
    return (f"result: {who} ({rec.policy_id} blue, {rec.opponent_id} red); crowns blue {rec.own_crowns} "
            f"red {rec.enemy_crowns}; tower HP blue {rec.own_tower_hp_frac:.3f} "
            f"red {rec.enemy_tower_hp_frac:.3f} (the mean of each side's three towers' HP fractions); "
            f"{rec.episode_steps} decisions, {rec.episode_ticks * tick_ms / 1000:.1f} s of battle")


def play_viewer(say: Callable[[str], None]) -> Any:
    """royalegym's viewer publisher (royalegym.viser), bound as the ROYALEVISER variable says or
    at its default address; None, said in one line with the remedy, when this royalegym has none."""
    try:
        from royalegym.viser import ViserPublisher
    except ImportError:
        say("--viewer: this royalegym has no viewer (royalegym.viser); get one with "
            "pip install -U 'royalegym[viser]'. Playing without it.")
        return None
    try:
        pub = ViserPublisher.from_env() or ViserPublisher()
    except (OSError, ValueError) as e:
        raise CheckError(f"--viewer: {e}") from None
    host, port = pub.address
    app = ("" if importlib.util.find_spec("royaleviser")
           else " (install it with pip install 'royalegym[viser]')")
    say(f"--viewer: streaming to {host}:{port}; watch with python -m royaleviser --stream "
        f"{host}:{port}{app}. An attached viewer gets the battle at game speed")
    return pub


def cmd_play(cmd: "Play") -> int:
    if cmd.every < 1:
        raise CheckError(f"--every {cmd.every}: a view every K decisions needs K >= 1")
    runner, players, acts, where, args = open_play(cmd)
    print(f"play: blue {players[0]} vs red {players[1]}, --seed {cmd.seed}; env {where}")
    viser = play_viewer(print) if cmd.viewer else None
    try:
        with P.process_settings_kept():
            if args is not None:   # the run's torch threads and kernels (design 2.1), as its gates act
                P.apply_determinism(args)
            records = play_battle(runner, players, acts, cmd.seed, cmd.every, print, viser)
    finally:
        if viser is not None:
            viser.close()
    print(result_line(records[0], runner.env_spec.tick_ms))
    saved = SavedBattle(format=SAVED_BATTLE_FORMAT, players=players, seed=cmd.seed, gamma=PLAY_GAMMA,
                        env_value_digest=farm.env_value_digest(runner.env_factory_spec),
                        env=runner.env_factory_spec, records=tuple(records))
    if cmd.save is not None:
        ladder.write_atomic(Path(cmd.save), msgspec.json.format(msgspec.json.encode(saved), indent=1) + b"\n")
        print(f"saved both seats' records and the env to {cmd.save}; check it: "
              f"python checks.py replay {cmd.save}")
    if cmd.trace is not None:   # the battle re-simulated from blue's record, as `replay F --trace` does
        return replay_to_trace(SavedBattleEnv(Path(cmd.save or "<this battle>"), saved), 0, records[0],
                               cmd.trace, table=False)
    return 0


# --- 7. bench (design 1.2) ------------------------------------------------------------------------
# This machine's budget for a profile, in the units a person sizes a run with. Two halves:
#   the parts, each timed alone and repeated (REPEATS, medians): the engine stepped by one process
#     with nothing else (the raw loop), the same battles collected by the profile's farm (workers x
#     shards, codec.pack included, no inference), codec.pack per row, and, on one real rectangle
#     collected by the profile's own farm and network, the parent's inference per forwarded row, the
#     critic pass per row and the PPO update per row through it (every epoch);
#   the whole: `--iterations` real iterations of the profile (train(), as a user runs it), the first
#     a warm-up, the median of the rest beside what the parts predict for one iteration.
# The prediction is a plain sum: env time at the farm's rate, plus inference, critic and update at
# theirs, each times the real iterations' own count of what it works on (their rows' median
# throughput/inference_rows_forward, throughput/critic_rows and ppo/actor_rows_seen). The rectangle
# is iteration 0's, its battles all starting: it forwarded 0.7x and updated 0.8x the rows a later
# iteration does at the same rates per row [M: docs/throughput.md, "bench part by part"], so its
# own counts would have put the difference on the rates. Collection overlaps the parent's inference
# with the workers' stepping, so a measured iteration may come in under the sum; a measured
# iteration well over it means time goes somewhere the parts do not name (the row's time/residual
# says where to look). The machine is shared and its load drifts, so the load average is printed
# before and after each part.

REPEATS = 3
THROUGHPUT_DOC = ROOT / "docs" / "throughput.md"   # where --write appends the table


class BenchFigure(NamedTuple):
    part: str
    unit: str
    runs: list[float]          # one value per repeat
    load: tuple[float, float]  # 1-minute load average before and after
    note: str = ""

    @property
    def median(self) -> float:
        return float(np.median(self.runs))


def loadavg() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def timed_figure(part: str, unit: str, measure: Callable[[], float], note: str = "") -> BenchFigure:
    """REPEATS calls of measure(), each returning the figure in `unit`, with the load around them."""
    before = loadavg()
    runs = [measure() for _ in range(REPEATS)]
    return BenchFigure(part, unit, runs, (before, loadavg()), note)


def engine_figures(args: P.Args, env: P.Env) -> list[BenchFigure]:
    """The raw loop and the profile's farm over the same battles and actions (farm.bench_farm,
    interleaved repeats), one iteration of T cycles each; their ratio."""
    r = args.rollout
    before = loadavg()
    out = farm.bench_farm(env.spec, battles=env.n_battles, cycles=env.T, iterations=1,
                          arms=((r.workers, r.shards_per_worker),), repeats=REPEATS,
                          master_seed=args.master_seed)
    load = (before, loadavg())
    arm = f"farm_w{r.workers}_s{r.shards_per_worker}"
    raw, farmed = out["direct"]["runs"], out[arm]["runs"]
    return [BenchFigure("engine, one process, nothing else", "game-steps/s", raw, load,
                        f"{env.n_battles} battles x {env.T} cycles"),
            BenchFigure(f"process farm ({r.workers} worker(s) x {r.shards_per_worker} shard(s))",
                        "game-steps/s", farmed, load, "codec.pack included, no inference"),
            BenchFigure("farm / raw loop", "x", [f / d for f, d in zip(farmed, raw, strict=True)], load)]


def codec_figure() -> BenchFigure:
    return timed_figure("codec.pack", "us/row",
                        lambda: float(codec.measure(battles=8, decisions=60)["pack_us_per_row"]),
                        "8 battles x 60 decisions of random legal play")


class Work(NamedTuple):
    """What an iteration's parts work on, the counts their rates are per: the median of the real
    iterations' rows."""
    forwarded: float         # rows the parent's forwards ran on (forced rows take none), pool seats included
    critic_rows: float       # the critic pass's (every cell, or smdp's choice and sampled cells)
    update_rows: float       # rows through the update, every epoch (ppo/actor_rows_seen)


def rig_figures(args: P.Args, env: P.Env, work: Path, gate_battles: int,
                engine_rate: float, farm_rate: float) -> list[BenchFigure]:
    """Inference, critic and update, each timed alone on one real rectangle, as rates per row:
    the profile's farm collects iteration 0 with the profile's v0 (its warm start's clone, where
    it has one), set up as train() sets up (ppo_clash.set_up, a scratch run under `work`), then
    each part is re-run REPEATS times on that rectangle; then a gate's battles (gate_figure). The
    update changes the weights it times; nothing here is kept. engine_rate, farm_rate:
    engine_figures' game-steps/s of the engine alone and of the profile's farm."""
    with P.process_settings_kept():
        s = P.set_up(dataclasses.replace(args, runs_dir=str(work)), quiet=True)
        try:
            parts = _rig_figures(s, args, env, farm_rate)
            return parts + [gate_figure(s, args, env, gate_battles, engine_rate)]
        finally:
            s.source.close()
            s.run.close()


def _rig_figures(s: P.Setup, args: P.Args, env: P.Env, farm_rate: float) -> list[BenchFigure]:
    learner, source, view, lad = s.learner, s.source, s.view, s.lad
    sched = learner.schedule_values(args)
    view.new_iteration(renumber=False)
    source.begin_iteration(lad.plan(0, source.ordinals, s.opening))
    roll = P.collect(source, view, learner.model, lad, env, s.run, 0, 0, sched["gamma"], time.perf_counter())
    crit = P.critic_pass(learner.model, view, source, roll, env, args.ppo, 0)
    adv = P.advantages(learner.scaler, roll, crit, sched["gamma"], args)
    rounds, r = max(roll.rounds, 1), args.rollout
    forwarded = max(roll.rows_forward, 1)
    beside, gap_s = replay_load(r, env, farm_rate)
    with farm.SteppingBeside(env.spec, beside, r.games_per_worker, args.master_seed):
        inference = timed_figure(
            "inference", "ms/forwarded row",
            lambda: 1e3 * replay_inference(roll, view, learner, lad, env, args.determinism.inference_threads,
                                           gap_s) / forwarded,
            f"{forwarded} rows forwarded in {rounds} shard-rounds ({forwarded / rounds:.1f} a round; "
            f"{int(roll.trainable.sum()) / rounds:.1f} learner rows a round, forced rows take no forward), "
            "pool seats included; "
            + (f"beside {beside} process(es) stepping {r.games_per_worker} battles each, as the workers do, "
               f"{1e3 * gap_s:.1f} ms asleep between rounds" if beside
               else "inline farm: nothing beside (the parent steps its battles)"))
    critic = timed_figure("critic pass", "ms/row", lambda: 1e3 * P.critic_pass(
        learner.model, view, source, roll, env, args.ppo, 0).seconds / crit.rows,
        f"{crit.rows} rows a pass ({args.ppo.forced_rows}), chunks of {args.ppo.critic_chunk}")
    update_rows = []   # the update's own count, the same every repeat (one rectangle, one state)

    def update_ms_per_row() -> float:
        seconds, n = timed_update(s, roll, crit, adv, sched, args)
        update_rows.append(n)
        return 1e3 * seconds / max(n, 1)

    update = timed_figure("PPO update", "ms/update row", update_ms_per_row)
    return [inference, critic, update._replace(
        note=f"{update_rows[0]} rows through the update, its {args.ppo.n_epochs} epochs together "
             f"({args.ppo.forced_rows}; {int(roll.trainable.sum())} learner rows)")]


def gate_figure(s: P.Setup, args: P.Args, env: P.Env, battles: int, engine_rate: float) -> BenchFigure:
    """A gate's battles as the loop plays them (ladder.EvalRunner on the profile's evaluation workers
    and battles at once, on the run's frozen seeds): the profile's network against itself as two
    players, `battles` of them, once (a gate is minutes). Its figure is the time over what the
    engine alone, one process, takes for the battles' game-steps at engine_rate (engine_figures'):
    the gate's own 'x the engine'."""
    r = args.rollout
    before = loadavg()
    with P.ladder.EvalRunner(env.spec, P.ladder.read_run_seeds(s.run.path), battles_at_once=r.eval_workers
                             * r.eval_games_per_worker, workers=r.eval_workers, table=env.table) as ev, \
            P.torch_threads(args.determinism.inference_threads):
        for name in ("bench:a", "bench:b"):
            ev.register(name, P.NetPlayer(s.learner.model, env.table, env.device, args.ladder.release_mode))
        ev.play("bench:a", "bench:b", battles, comparison_id="bench/gate")
        seconds, steps = ev.seconds, ev.game_steps
    return BenchFigure("gate", "x the engine", [seconds * engine_rate / steps], (before, loadavg()),
                       f"{battles} battles in {seconds:.1f} s, {steps} game-steps (the engine alone: "
                       f"{steps / engine_rate:.1f} s), {r.eval_workers} evaluation worker(s) x "
                       f"{r.eval_games_per_worker} battles at once")


def timed_update(s: P.Setup, roll: P.Rollout, crit: P.Critic, adv: P.Advantages, sched: dict[str, float],
                 args: P.Args) -> tuple[float, int]:
    """Seconds of one update from the weights that collected the rectangle, and its rows through
    the update (every epoch): each repeat starts from the same learner state (the ratio invariant
    holds the update to it, design 6.4)."""
    learner = s.learner
    before = P.learner_state(learner, args.master_seed)
    rows = P.update_rows(s.view, roll, crit, adv)
    # the update of a steady iteration, which the loop's median is made of: no mask asserts, no
    # ratio check (a run's first iterations and one in ppo.check_ratio_invariant_every have them),
    # both optimizers stepping, the profile's teacher at its scheduled weight
    out = P.ppo_update(
        learner.model, learner.opt_a, learner.opt_c, rows, args.ppo, ent_coef=sched["ent_coef"],
        ent_coef_noop=sched["ent_coef_noop"], master_seed=args.master_seed, iteration=learner.iteration,
        debug=False, check_ratio=False, ratio_atol=P.ratio_atol(args), comm=learner.comm, actor_steps=True,
        teacher=None if learner.teacher is None else (learner.teacher, sched["teacher_kl"]))
    P.restore_learner(learner, before)
    return out["time/update"], int(out["ppo/actor_rows_seen"])


def replay_load(r: P.RolloutArgs, env: Any, farm_rate: float) -> tuple[int, float]:
    """(stepping processes, seconds asleep between rounds) for replay_inference, as in the loop: the
    workers that step while the parent acts for a shard, every worker but that shard's unless a
    worker has another shard to step (a forward alone ran about twice as fast as beside two engine
    processes on a 2-core machine [M: docs/throughput.md]), and the parent waiting between rounds
    for as long as a shard's cycle takes the farm. An inline farm's parent steps its battles
    itself: nothing beside, no wait."""
    if r.source != "process":
        return 0, 0.0
    return r.workers - (r.shards_per_worker == 1), env.n_battles / farm_rate / env.n_shards


def replay_inference(roll: P.Rollout, view: P.RectView, learner: P.Learner, lad: Any, env: P.Env,
                     threads: int, gap_s: float) -> float:
    """Seconds of act_round over the collected rectangle's rounds, the same seats and groups as
    collection had (each shard's slots, in the order the farm served them), on fresh uniforms and
    collection's threads; what collection's time/inference measures. Between
    rounds the parent sleeps gap_s (untimed), as it waits for the next shard in the loop: a
    forward on a core just woken from idle ran 1.5x slower than a hot one [M: docs/throughput.md]."""
    scratch, spent = P.Rollout.empty(env.T, env.R), 0.0
    with P.torch_threads(threads):
        for t in range(env.T):
            u = torch.rand(env.R, generator=torch.Generator().manual_seed(t)).to(env.device)
            for shard in np.array_split(np.arange(env.R), env.n_shards):
                rnd = SimpleNamespace(slots=shard, group=roll.group[t, shard])
                time.sleep(gap_s)
                t0 = time.perf_counter()
                P.act_round(rnd, t, u, view, learner.model, lad, env.geo, scratch)
                spent += time.perf_counter() - t0
    return spent


class Whole(NamedTuple):
    predicted: dict[str, float]    # seconds an iteration, by part, from the parts' medians
    measured: dict[str, float]     # the real iterations' medians of the row's time/ keys
    work: Work                     # the real iterations' medians of what the parts work on
    iterations: list[float]        # time/iteration of every real iteration after the first
    load: tuple[float, float]


def predict(env: Any, figs: dict[str, BenchFigure], work: Work) -> dict[str, float]:
    """Seconds an iteration, by part, from the parts' medians: T x battles game-steps at the farm's
    rate, and the rows forwarded, the critic pass's rows and the rows through the update (the
    profile's forced-rows setting decides all three), each at its rate."""
    farm_rate = next(f for f in figs.values() if f.part.startswith("process farm (")).median
    return {"env": env.T * env.n_battles / farm_rate,
            "inference": work.forwarded * figs["inference"].median / 1e3,
            "critic": work.critic_rows * figs["critic pass"].median / 1e3,
            "update": work.update_rows * figs["PPO update"].median / 1e3}


def real_iterations(args: P.Args, env: P.Env, figs: dict[str, BenchFigure], n: int, work: Path) -> Whole:
    """n iterations of the profile as train() runs them; the first is a warm-up (the farm starting,
    first-call allocations) and is left out of the medians. The parts predict them at their own
    counts (Work)."""
    before = loadavg()
    run = P.train(dataclasses.replace(args, runs_dir=str(work)), max_iterations=n, quiet=True)
    rows = read_jsonl(run / "metrics.jsonl")[1:]
    med = lambda k: float(np.median([r[k] for r in rows]))
    measured = {k: med(f"time/{k}") for k in ("iteration", "collection", "inference", "critic_pass", "update",
                                                "residual")}
    did = Work(med("throughput/inference_rows_forward"), med("throughput/critic_rows"),
               med("ppo/actor_rows_seen"))
    return Whole(predict(env, figs, did), measured, did, [r["time/iteration"] for r in rows],
                 (before, loadavg()))


RATIO_READING = {True: "under 1: collection overlapped the workers' stepping with the parent's inference",
                 False: "over 1: time the parts do not name; the row's time/residual and time/env say where"}


def part_lines(p: dict[str, float], m: dict[str, float]) -> list[str]:
    """The prediction part by part beside what the real iterations measured (medians of the rows'
    time/ keys): the farm's stepping is collection less the parent's inference."""
    pairs = {"env (collection less inference)": (p["env"], m["collection"] - m["inference"]),
             "inference": (p["inference"], m["inference"]), "critic pass": (p["critic"], m["critic_pass"]),
             "update": (p["update"], m["update"]), "iteration": (sum(p.values()), m["iteration"])}
    return ["", "| part | predicted s | measured s | measured / predicted |", "|---|---|---|---|"] + [
        f"| {k} | {a:.2f} | {b:.2f} | {b / a:.2f} |" for k, (a, b) in pairs.items()]


def bench_lines(profile: str, env: P.Env, figs: list[BenchFigure], whole: Whole) -> list[str]:
    """The table, as markdown (it reads on a console too and appends to docs/throughput.md)."""
    p, m = whole.predicted, whole.measured
    ratio = m["iteration"] / sum(p.values())
    engine_s = env.T * env.n_battles / next(f for f in figs if f.part.startswith("engine, one")).median
    script = f"--script {script_name()} " * (script_name() != "ppo_clash.py")
    out = [f"`python checks.py bench {script}--profile {profile}`: {os.cpu_count()} cpus, torch threads "
           f"{torch.get_num_threads()}, device {env.device}; T={env.T} cycles x R={env.R} slots, "
           f"{env.n_battles} battles; medians of {REPEATS} repeats",
           "", "| part | median | unit | repeats | load before/after | note |", "|---|---|---|---|---|---|"]
    for f in figs:
        runs = " ".join(f"{x:.4g}" for x in f.runs)
        out.append(f"| {f.part} | {f.median:.4g} | {f.unit} | {runs} | {f.load[0]:.2f} / {f.load[1]:.2f} "
                   f"| {f.note} |")
    w = whole.work
    parts = " + ".join(f"{k} {v:.2f}" for k, v in p.items()) + (
        f", at the real iterations' {w.forwarded:.0f} rows forwarded, {w.critic_rows:.0f} critic rows and "
        f"{w.update_rows:.0f} update rows")
    its = " ".join(f"{x:.2f}" for x in whole.iterations)
    out += [f"| iteration, predicted by the parts | {sum(p.values()):.2f} | s | | | {parts} |",
            f"| iteration, measured | {m['iteration']:.2f} | s | {its} "
            f"| {whole.load[0]:.2f} / {whole.load[1]:.2f} | collection {m['collection']:.2f} "
            f"(inference {m['inference']:.2f}) + critic {m['critic_pass']:.2f} + update {m['update']:.2f} + "
            f"residual {m['residual']:.2f} |",
            f"| measured / predicted | {ratio:.2f} | x | | | {RATIO_READING[ratio < 1]} |",
            f"| iteration / the engine's time for its game-steps | {m['iteration'] / engine_s:.2f} "
            f"| x the engine | | | {env.T * env.n_battles} game-steps, {engine_s:.2f} s for the engine "
            "alone, one process |"]
    return out + part_lines(p, m)


def cmd_bench(cmd: "Bench") -> int:
    if cmd.iterations < 2:
        raise CheckError(f"--iterations {cmd.iterations}: at least 2 (the first real iteration is a warm-up)")
    args = P.profile_args(cmd.profile)
    P.apply_determinism(args)
    env = P.read_env(args)
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    try:
        print(f"bench {script_name()} --profile {cmd.profile}: the engine and the farm ...", flush=True)
        figs = engine_figures(args, env) + [codec_figure()]
        print(f"bench: inference, critic and update on one collected rectangle; a gate of {cmd.gate_battles} "
              "battles ...", flush=True)
        figs += rig_figures(args, env, work / "parts", cmd.gate_battles, figs[0].median, figs[1].median)
        print(f"bench: {cmd.iterations} real iterations ...", flush=True)
        whole = real_iterations(args, env, {f.part: f for f in figs}, cmd.iterations, work / "whole")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = bench_lines(cmd.profile, env, figs, whole)
    print("\n".join(lines))
    if cmd.write:
        path = THROUGHPUT_DOC
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with path.open("a") as f:
            f.write(f"\n### bench, {stamp}, commit {git_commit()}\n\n" + "\n".join(lines) + "\n")
        print(f"appended to {path}")
    return 0


def git_commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or "(not a git checkout)"


# --- 8. learn (docs/learning.md) -------------------------------------------------------------------
# The learning benchmark as one command: train the profile from its master seed for the protocol's
# game-step budget in a new run directory (as `python ppo_clash.py` would), then the yardstick
# (every scripted rung, paired seeds from the run's frozen set, 95% bootstrap intervals; ladder.py
# yardstick's function) on v0 (the untrained policy, or a warm start's clone) and on the run's
# final champion. The table and the bar's verdict go to stdout; --write appends them, dated, with
# the commit, to docs/learning.md. A stopped benchmark continues with --resume RUN.

LEARNING_DOC = ROOT / "docs" / "learning.md"   # the protocol, and where --write appends
BAR = {"scripted:random_legal": 0.85, "scripted:patient": 0.60}   # issue 14's bar: at least this score
BAR_SEEDS = 50                                  # ... over at least this many paired seeds


def bar_verdict(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The bar, rung by rung: BAR's rungs need their score with the lower bound above 0.5, every
    other rung a lower bound above 0.5 (beaten), all over at least BAR_SEEDS seeds."""
    out = []
    for r in rows:
        need = BAR.get(r["rung"], 0.5)
        ok = r["score"] >= need and r["lower"] > 0.5 and r["seeds"] >= BAR_SEEDS
        out.append(f"{r['rung']}: {'met' if ok else 'NOT met'} (score {r['score']:.3f} against >= "
                   f"{need:.2f}, lower bound {r['lower']:.3f} against > 0.5, {r['seeds']} seeds against "
                   f">= {BAR_SEEDS})")
    return out


def learn_seconds(run: Path, rows: Sequence[dict[str, Any]], train_s: float,
                  yardstick_s: float) -> dict[str, float]:
    """Where the benchmark's wall clock went, in seconds: the warm start (warm.json), the iterations
    without their gates and probes, the gates, the probes (the metric rows, every resume's), the
    rest of the training call this session (start-up: the farm, the startup gates, the final save)
    and the yardstick."""
    warm = read_json(run / "warm.json").get("seconds", 0.0) if (run / "warm.json").exists() else 0.0
    total = lambda k: sum(float(r.get(k, 0.0)) for r in rows)
    gates, probes, its = total("time/gate"), total("time/probe"), total("time/iteration")
    return {"warm start": warm, "training": its - gates - probes, "gates": gates, "probes": probes,
            "start-up and saves": max(train_s - its - warm, 0.0), "yardstick": yardstick_s}


def learn_lines(cmd: "Learn", run: Path, n_iter: int, seconds: dict[str, float], players: dict[str, str],
                rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The benchmark's table: one row a rung, one column a player (score [lower, upper]); the bar
    is judged on the champion's column. Above it, where the wall clock went (learn_seconds)."""
    names = list(players)
    change = (f"; the change, --config {cmd.config}: "
              f"{json.dumps(P.read_config_file(cmd.config), separators=(',', ':'))}" if cmd.config else "")
    parts = ", ".join(f"{k} {v:,.0f} s" for k, v in seconds.items())
    out = [f"{script_name()} --profile {cmd.profile}, master seed "
           f"{cmd.master_seed if cmd.master_seed is not None else 'the profile default'}, "
           f"{cmd.game_steps:,} game-steps ({n_iter} iterations, a warm start's battles included), "
           f"{rows[names[0]][0]['seeds']} seeds a rung from both sides; run {run.name}{change}", "",
           f"Wall clock on {os.cpu_count()} cpus: {sum(seconds.values()) / 60:.1f} min in all ({parts}).", "",
           "| rung | " + " | ".join(f"{n} ({players[n]})" for n in names) + " |",
           "|---|" + "---|" * len(names)]
    for i, r in enumerate(rows[names[0]]):
        out.append(f"| {r['rung']} | " + " | ".join(
            f"{rows[n][i]['score']:.3f} [{rows[n][i]['lower']:.3f}, {rows[n][i]['upper']:.3f}]"
            for n in names) + " |")
    return out + ["", "The bar (the champion):"] + [f"- {x}" for x in bar_verdict(rows["champion"])]


def last_discarded(run: Path, pool: "ladder.Pool") -> tuple[str, int] | None:
    """The newest gated candidate (by its snapshot's game-step) when the gate discarded it, with
    its game-step: what the learner had become, measured even though the champion did not move."""
    store = ladder.SnapshotStore(run)
    steps = sorted((store.spec(d.candidate.removeprefix("snap:")).step, d.candidate, d.outcome)
                   for d in ladder.read_gate_decisions(run))
    if not steps or steps[-1][2] != "discard" or steps[-1][1] in (pool.v0, pool.champion):
        return None
    return steps[-1][1], steps[-1][0]


def champion_label(run: Path, pool: "ladder.Pool", game_steps: int) -> str:
    """The champion's column head: its snapshot's own game-step, which is not the run's end when no
    later candidate passed its gate (the champion of a 1M run can be its 200k snapshot)."""
    if pool.champion == pool.v0:
        return f"{pool.champion}: v0 was never displaced"
    step = ladder.SnapshotStore(run).spec(pool.champion.removeprefix("snap:")).step
    return f"{pool.champion}, its snapshot at {step:,} game-steps, still the champion at {game_steps:,}"


def learn_args(cmd: "Learn") -> P.Args:
    """The run's arguments: the profile, the --config change merged over it, the master seed, and
    the budget as the run's game_step_limit: a warm start's battles (its cloning, its DAgger rounds)
    and the iterations spend it together, the last iteration whole."""
    args = P.parse_args(["--profile", cmd.profile] + (["--config", cmd.config] if cmd.config else []))
    args.runs_dir, args.run_name = cmd.runs_dir, f"{args.run_name}-learn-{cmd.profile}"
    # a battle's game-step gives at most its two seats' learner rows [A], so the row limit never binds
    args.game_step_limit, args.timestep_limit = cmd.game_steps, 2 * cmd.game_steps
    if cmd.master_seed is not None:
        args.master_seed = cmd.master_seed
    return args


def learn_command(cmd: "Learn", run: Path) -> str:
    """The command that continues `run` where its last checkpoint left it: this one, with --resume."""
    flags = ([f"--script {cmd.script}"] * (cmd.script != "ppo_clash.py")
             + [f"--profile {cmd.profile}", f"--game-steps {cmd.game_steps}", f"--seeds {cmd.seeds}"])
    flags += ([f"--master-seed {cmd.master_seed}"] * (cmd.master_seed is not None)
              + [f"--config {cmd.config}"] * bool(cmd.config))
    flags += ["--quiet"] * cmd.quiet + ["--write"] * cmd.write
    return f"python checks.py learn {' '.join(flags)} --resume {run}"


def learn_start(cmd: "Learn", args: P.Args, env: P.Env) -> tuple[Path, Path | None]:
    """Where the benchmark's run lives, and the checkpoint it continues from (None: a new run). A
    benchmark outlasts a session on a small machine (2.5 hours of a 2-core one), so a stopped or
    crashed one continues from its latest checkpoint when the same command is given --resume RUN:
    the command's config must equal the run's, so the table's header still tells the truth."""
    if cmd.resume is None:
        run = Path(args.runs_dir) / f"{args.run_name}-{P.run_id(P.compute_identity(args, env))}"
        if run.exists():   # never trained over; ppo_clash.py's own remedy would skip the yardstick
            raise CheckError(f"{run} exists: this benchmark was started before; continue it with "
                             f"{learn_command(cmd, run)}, or start another with --master-seed or --runs-dir")
        return run, None
    run = run_dir(cmd.resume)
    args.runs_dir = str(run.parent)    # where it lives is not part of what it is
    diff = P.dict_diff(read_json(run / "config.json"), json.loads(P.config_json(args)))
    if diff:
        raise CheckError(f"--resume {run}: this command's config differs from the run's ({'; '.join(diff)}); "
                         f"give the command that started it, with --resume")
    ckpt = P.latest_checkpoint(run)
    if ckpt is None:
        raise CheckError(f"--resume {run}: no checkpoint in {run / 'checkpoints'} to continue from; "
                         f"remove the directory and start the benchmark again")
    return run, ckpt


def cmd_learn(cmd: "Learn") -> int:
    args = learn_args(cmd)
    if cmd.game_steps < 1 or not 1 <= cmd.seeds <= args.ladder.eval_seed_count:
        raise CheckError(f"--game-steps {cmd.game_steps} --seeds {cmd.seeds}: the budget must be at least "
                         f"one game-step, and the seeds 1 to the profile's frozen set, "
                         f"ladder.eval_seed_count = {args.ladder.eval_seed_count} (checked before hours "
                         "of training)")
    env = P.read_env(args)
    run, ckpt = learn_start(cmd, args, env)
    clone = f"the warm start's battles ({args.warm.rung}) and " if args.warm.rung else ""
    print(f"learn: {script_name()} --profile {cmd.profile}, {clone}iterations of {env.T * env.n_battles} "
          f"game-steps until {cmd.game_steps:,} game-steps, then the yardstick"
          + (f"; continuing {run} from {ckpt.name}" if ckpt else ""), flush=True)
    t0 = time.perf_counter()
    try:
        P.train(args, quiet=cmd.quiet, resume=ckpt)
    except (P.AlarmHalt, P.RunCrashed) as e:   # what the training said; the benchmark's own resume
        raise CheckError(f"training stopped before the budget, so nothing was measured: {e}; to finish the "
                         f"benchmark (the training, then the yardstick): {learn_command(cmd, run)}") from None
    rows = read_jsonl(run / "metrics.jsonl")
    n_iter = int(rows[-1]["run/iteration"]) if rows else 0
    spent = P.warm_game_steps(run) + (int(rows[-1]["run/cumulative_env_steps"]) if rows else 0)
    if spent < cmd.game_steps:   # a Ctrl-C or the control file's q: checkpointed and stopped at a boundary
        print(f"learn: stopped after iteration {n_iter} at {spent:,} of {cmd.game_steps:,} game-steps, so "
              f"nothing was measured; continue it with {learn_command(cmd, run)}", flush=True)
        return 1
    train_s, t0 = time.perf_counter() - t0, time.perf_counter()
    pool = ladder.read_pool(run)
    if pool is None or pool.champion is None:
        raise CheckError(f"{run}: no ladder/pool.json champion after training; nothing to measure")
    v0_is = f"the warm start's clone of {args.warm.rung}" if args.warm.rung else "untrained"
    players = {"v0": f"{pool.v0}, {v0_is}",
               "champion": champion_label(run, pool, int(rows[-1]["run/cumulative_env_steps"]))}
    rows_of = {"v0": ladder.yardstick_run(run, pool.v0, cmd.seeds)}
    discarded = last_discarded(run, pool)
    if discarded is not None:   # shown before the champion; the bar is the champion's alone
        players = {"v0": players["v0"],
                   "last candidate": f"{discarded[0]}, discarded by its gate at {discarded[1]:,} game-steps",
                   "champion": players["champion"]}
        rows_of["last candidate"] = ladder.yardstick_run(run, discarded[0], cmd.seeds)
    rows_of["champion"] = (rows_of["v0"] if pool.champion == pool.v0
                           else ladder.yardstick_run(run, pool.champion, cmd.seeds))
    lines = learn_lines(cmd, run, n_iter, learn_seconds(run, rows, train_s, time.perf_counter() - t0),
                        players, rows_of)
    print("\n".join(lines))
    if cmd.write:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with LEARNING_DOC.open("a") as f:
            f.write(f"\n### learn, {stamp}, commit {git_commit()}\n\n" + "\n".join(lines) + "\n")
        print(f"appended to {LEARNING_DOC}")
    return 0


# --- 9. export: a checkpoint's actor as a snapshot folder -----------------------------------------
# A run whose budget ends between two gates has final weights no gate snapshotted; a learning claim
# rests on weights kept in the repository (models/experiments/<name>/), so they are written as the
# gate writes a candidate (ppo_clash.write_snapshot): the same weights at the same step are the same
# id, and the folder plays wherever a shipped model does (ladder.py eval and yardstick, play, Bot).

def export_snapshot(ckpt: Path, out: Path) -> str:
    """Write the checkpoint's actor into its run's snapshot archive, then copy it, with the run's
    evaluation env, to `out` (a new or empty folder). Returns the snapshot's player id."""
    run = ckpt.parent.parent
    if not (ckpt / "manifest.json").is_file():
        raise CheckError(f"--checkpoint {ckpt}: no manifest.json there; give runs/<id>/checkpoints/<step>")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckError(f"--out {out}: exists and is not an empty folder; export writes a new one")
    if not (ladder.ladder_dir(run) / "eval_env.json").is_file():
        raise CheckError(f"{run}: no ladder/eval_env.json, so no evaluation env to name the snapshot by; "
                         f"give a checkpoint of a run that opened its ladder")
    trained_by = sorted(set(P.read_manifest(ckpt).identity.get("user_code") or {})
                        - {"codec.py", "farm.py", "ladder.py"})
    if "ppo_clash.py" not in trained_by:
        raise CheckError(f"{ckpt}: its run was trained by {', '.join(trained_by) or 'no script named'}, not "
                         f"ppo_clash.py; export rebuilds ppo_clash.py's network, so it cannot write a fork's "
                         f"snapshot (the fork's own gate snapshots play as they are)")
    model, man = P.actor_from_checkpoint(ckpt)
    env, _ = ladder.read_run_env(run)
    obs_digest, context = ladder.eval_digests(env, int(man.config["master_seed"]))
    pid = P.write_snapshot(run, model, obs_digest=obs_digest, action_digest=man.identity["action_digest"],
                           codec_table_digest=man.identity["codec_table_digest"],
                           step=man.cumulative_env_steps, context=context, run_id_=man.run_id)
    folder = ladder.ladder_dir(run) / "snapshots" / pid.removeprefix("snap:")
    out.mkdir(parents=True, exist_ok=True)
    for src in (folder / "spec.json", folder / "actor.safetensors", ladder.ladder_dir(run) / "eval_env.json"):
        shutil.copyfile(src, out / src.name)
    return pid


def cmd_export(cmd: "Export") -> int:
    ckpt, out = Path(cmd.checkpoint), Path(cmd.out)
    pid = export_snapshot(ckpt, out)
    print(f"{pid}: {ckpt}'s actor, written to {ckpt.parent.parent / 'ladder' / 'snapshots'} and copied "
          f"to {out}")
    return 0


# --- 10. CLI --------------------------------------------------------------------------------------
# The commands as tyro dataclasses, as in ladder.py: each field's docstring is its --help.


@dataclasses.dataclass(kw_only=True)
class Doctor:
    """Is this machine and engine fit to train this configuration: the start-up gates of design
    3.8, each numbered with its result; exit 2 naming the first that fails and its remedy."""
    profile: str = "cpu"
    """the profile to check (laptop, workstation, many_core, cpu, smoke)"""
    config: Optional[str] = None
    """check this config file instead (a run's config.json is one)"""


@dataclasses.dataclass(kw_only=True)
class Identity:
    """Print the canonical RunIdentity and the run_id it hashes to (design 2.3), computed as
    training computes it; or a run's identity.json; or, with --diff, every differing field."""
    run: Annotated[Optional[str], tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR")] = None
    """a run directory: print its identity.json and run_id"""
    profile: Optional[str] = None
    """compute the identity a run of this profile would have (laptop, workstation, many_core, cpu, smoke)"""
    config: Optional[str] = None
    """compute the identity a run of this config file (a run's config.json is one) would have"""
    diff: Optional[tuple[str, str]] = None
    """RUN_DIR_A RUN_DIR_B: every identity field that differs, one a line"""


@dataclasses.dataclass(kw_only=True)
class VerifyResume:
    """Prove resume on this machine (design 8.3): four iterations straight, against two, a
    checkpoint, and two more in a fresh process; compared file, row and field."""
    script: str = "ppo_clash.py"
    """the training script to run: ppo_clash.py or a fork of it beside checks.py (ppo_myidea.py)"""
    profile: str = "smoke"
    """the profile to prove (battles are played whole: the checkpoint finds them mid-episode)"""
    config: Optional[str] = None
    """a JSON object of fields merged over the profile, as ppo_clash.py --config: prove a fork's or
    an experiment's change resumes exactly (e.g. docs/experiments/smdp.json)"""
    work_dir: Optional[str] = None
    """an empty folder for the two runs (default: a new temporary one)"""
    keep: bool = False
    """keep the two runs afterwards, to look at a failure"""


@dataclasses.dataclass(kw_only=True)
class Replay:
    """Re-simulate episodes from episodes.jsonl, or a battle `play --save` wrote (their seed and
    both seats' played actions), and compare each with its record; exit 1 at the first
    divergence, naming the step and field."""
    run: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR|FILE")]
    """the run directory, or a file written by `play --save` (both its records by default)"""
    episode: Optional[int] = None
    """the record to replay: its 0-based line in episodes.jsonl (in a saved battle: 0 blue, 1 red)"""
    all: bool = False
    """replay every record and report how many match"""
    trace: Optional[Path] = None
    """write the replayed battle (--episode N's) as a royalegym trace, .msgpack or .json, verified
    on a fresh engine; `python -m royalegym.render F -o battle.html` draws it as one web page"""


@dataclasses.dataclass(kw_only=True)
class Play:
    """Watch one full battle between two players on a run's evaluation env: a text view every
    --every decisions and the result; --save F writes it so that `replay F` re-simulates it."""
    blue: str
    """the blue player: snap:<id> (--run's ladder/snapshots), seed:<name> (a seed snapshot of --run's
    pool), scripted:<name>, checkpoint:<dir>
    (runs/<id>/checkpoints/<step>; its run is the directory two levels up), or a snapshot folder
    (a shipped model: models/<name>, played on --run's env, else the default one)"""
    red: str
    """the red player, as --blue"""
    run: Optional[str] = None
    """the run whose evaluation env and snapshots to use (default: a checkpoint: player's run, else
    none, for two scripted players)"""
    seed: int = 0
    """the battle's seed: its start and both seats' streams are derived from it by name"""
    every: int = 20
    """show the battle every K decisions"""
    save: Optional[str] = None
    """write both seats' EpisodeRecords and the env to this file (check it with `replay F`)"""
    viewer: bool = False
    """also stream the battle to royalegym's viewer (RoyaleViser), at game speed while one watches"""
    trace: Optional[Path] = None
    """also write the battle as a royalegym trace (.msgpack or .json), re-simulated from its record and
    verified on a fresh engine; `python -m royalegym.render F -o battle.html` draws it as one web page"""
    device: str = "cpu"
    """where a neural player's network runs"""


@dataclasses.dataclass(kw_only=True)
class Bench:
    """This machine's budget for a profile (design 1.2): the engine, the farm, codec.pack,
    inference, the critic pass and the update, each timed alone (medians of 3, load average
    beside), then real iterations beside the time the parts predict at the iterations' own row
    counts."""
    script: str = "ppo_clash.py"
    """the training script to run: ppo_clash.py or a fork of it beside checks.py (ppo_myidea.py)"""
    profile: str = "cpu"
    """the profile to measure (laptop, workstation, many_core, cpu, smoke)"""
    iterations: int = 4
    """real iterations to run; the first is a warm-up, the median of the rest is reported"""
    gate_battles: int = 120
    """battles of the timed gate (the cpu profile's gate plays 600 champion battles and 120 more)"""
    write: bool = False
    """append the table, dated, with the command and commit, to docs/throughput.md"""


@dataclasses.dataclass(kw_only=True)
class Learn:
    """The learning benchmark (docs/learning.md): train the profile for a game-step budget, then
    the yardstick on v0 and on the final champion; --write appends the table to docs/learning.md.
    A stopped one (exit 1, or a crash) continues with the same command and --resume RUN."""
    script: str = "ppo_clash.py"
    """the training script to run: ppo_clash.py or a fork of it beside checks.py (ppo_myidea.py)"""
    profile: str = "cpu"
    """the profile to train (the protocol's is cpu)"""
    game_steps: int = 1_000_000
    """the budget in game-steps (one decision of one battle), rounded up to whole iterations"""
    seeds: int = BAR_SEEDS
    """yardstick seeds a rung, each from both sides (at most the run's frozen set)"""
    master_seed: Optional[int] = None
    """the run's master seed (default: the profile's)"""
    config: Optional[str] = None
    """a JSON object of fields merged over the profile, as ppo_clash.py --config: an experiment's
    one change (docs/learning.md section 3)"""
    runs_dir: str = "runs"
    """where the benchmark's run directory goes (<script>-learn-<profile>-<run_id>)"""
    quiet: bool = False
    """no per-iteration console"""
    write: bool = False
    """append the table, dated, with the commit, to docs/learning.md"""
    resume: Optional[str] = None
    """RUN: continue a benchmark that stopped (Ctrl-C, the control file's q, a crash) from its latest
    checkpoint, then measure it; the rest of the command must be the one that started it"""


@dataclasses.dataclass(kw_only=True)
class Export:
    """A checkpoint's actor as a snapshot folder (spec.json, actor.safetensors, eval_env.json),
    written as the gate writes a candidate: final weights that no gate snapshotted, kept."""
    checkpoint: str
    """runs/<id>/checkpoints/<step> (its run is the directory two levels up)"""
    out: str
    """the folder to write, new or empty: models/experiments/<name> for a learning claim"""


COMMANDS: dict[type, Callable[[Any], int]] = {Doctor: cmd_doctor, Identity: cmd_identity,
                                              VerifyResume: cmd_verify_resume, Replay: cmd_replay,
                                              Play: cmd_play, Bench: cmd_bench, Learn: cmd_learn,
                                              Export: cmd_export}


def main(argv: Sequence[str] | None = None) -> int:
    cmd = tyro.cli(Union[Doctor, Identity, VerifyResume, Replay, Play, Bench, Learn, Export], args=argv,   # type: ignore[arg-type]
                   prog="checks.py", description="Checks of a clash-ppo run: doctor, identity, "
                   "verify-resume, replay, play, bench, learn, export.", config=ladder.TYRO_CONFIG)
    try:
        if isinstance(cmd, (VerifyResume, Bench, Learn)):
            use_script(cmd.script)
        return COMMANDS[type(cmd)](cmd)
    except (CheckError, P.ConfigError, ladder.LadderSetupChanged, ladder.SnapshotMismatch,
            P.CheckpointFormatError, P.ArchMismatch, P.IdentityMismatch) as exc:
        name = "".join("-" + c.lower() if c.isupper() else c for c in type(cmd).__name__).lstrip("-")
        print(f"checks.py {name}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
