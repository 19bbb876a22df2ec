"""checks.py -- the commands a user reaches for when a run must be trusted: "is this machine and
engine fit to train", "which experiment is this", "does resume really reproduce my run", "did that
episode really happen".

Stage owned: none of training. This file is the top of the import chain (codec <- farm <- ladder
<- ppo_clash <- checks) and re-uses, never re-implements, what the stages below it define: the
identity recipe (ppo_clash.compute_identity), the resume of `python ppo_clash.py --resume`, the env
that farm.py builds from a run's config.

    python checks.py doctor [--profile P | --config F]    the start-up gates; design 3.8
    python checks.py identity [--profile P | --config F | RUN_DIR] [--diff RUN_A RUN_B]
    python checks.py verify-resume [--profile P]          smoke by default; design 8.3
    python checks.py replay RUN_DIR --episode N [--all]   re-simulate episodes.jsonl records

Not built yet: `bench` (this machine's throughput budget for a profile, design 1.2) and `play`
(watch one battle). The CLI lists only the commands that exist.

Reads:  a run directory: config.json, identity.json, metrics.jsonl, episodes.jsonl,
        ladder/games.jsonl, checkpoints/*/manifest.json. verify-resume trains into a scratch
        folder of its own (--work-dir; removed afterwards unless --keep).
Writes: nothing in any run directory it is pointed at.
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
  6. CLI
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any, Callable, NamedTuple, Optional, Sequence, Union

if __name__ == "__main__":   # one module object whether run as a script or imported (as ladder.py does)
    sys.modules["checks"] = sys.modules[__name__]

import msgspec
import numpy as np
import tyro

import codec
import farm
import ppo_clash as P

ROOT = Path(P.__file__).resolve().parent


# --- 1. Shared readers ----------------------------------------------------------------------------
# Every reader names the file (and the line) it could not use and what to do about it; the CLI
# turns a CheckError into one line on stderr and exit 2.


class CheckError(ValueError):
    """Bad input to a check: names the file or field and the remedy. Exit 2."""


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
#   a/  the straight run: six iterations, a checkpoint after the third and the sixth;
#   b/  the same configuration stopped at the third iteration, so its directory is the run as it
#       stood at that checkpoint, made by the code that writes it rather than by cutting a's
#       files back (the ladder's files would each need their own rule). Its rows 1-3 must equal
#       a's; then a's own iteration-3 checkpoint is copied over b's and resumed;
#   the resume: `python ppo_clash.py --resume b --checkpoint <a's iteration-3 checkpoint>` in a
#       fresh process, which runs iterations 4-6.
# Episodes are truncated after T decisions (obs.max_steps = T), so every battle is at an episode
# boundary at every iteration end, the promise of design 2.4 item 3. Then a and b are compared
# file by file, row by row, field by field: metrics.jsonl (wall-clock keys aside), every
# checkpoint's state_digest, episodes.jsonl, ladder/games.jsonl (its "wall" stamp aside).

SPLIT, TOTAL = 3, 6
WALL_CLOCK = P.NONDETERMINISTIC + ("ladder/gate_seconds_frac", "ladder/probe_seconds_frac")
_ABSENT = "<absent>"


def resume_flags(profile: str, runs_dir: Path) -> list[str]:
    """The profile with episodes cut at T decisions and a checkpoint every SPLIT iterations; the
    limit sits at TOTAL iterations, so the resumed process stops where the straight run did."""
    env = P.read_env(P.profile_args(profile))
    return ["--profile", profile, "--runs-dir", str(runs_dir), "--obs.max-steps", str(env.T),
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
    for n, (ra, rb) in enumerate(zip(rows_a, rows_b), 1):
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


def make_resumed_pair(profile: str, work: Path, say: Callable[[str], None] = print) -> tuple[Path, Path]:
    """Train the straight run and the stopped one, then resume the stopped one from the straight
    run's iteration-SPLIT checkpoint in a fresh process. Returns (straight, resumed) run dirs."""
    flags_a, flags_b = resume_flags(profile, work / "a"), resume_flags(profile, work / "b")
    say(f"straight run: {TOTAL} iterations of --profile {profile}, a checkpoint every {SPLIT}")
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
    say(f"resume: python ppo_clash.py --resume {b} --checkpoint {ck_b}   (a fresh process)")
    proc = subprocess.run([sys.executable, str(ROOT / "ppo_clash.py"), "--resume", str(b), "--checkpoint", str(ck_b)],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ResumeFailed(f"the resumed process exited with {proc.returncode}: {tail}")
    return a, b


def verify_resume(profile: str, work: Path, say: Callable[[str], None] = print) -> str | None:
    """The whole check: the first difference (file, row, field, both values), or None for PASS."""
    try:
        a, b = make_resumed_pair(profile, work, say)
    except ResumeFailed as e:
        return str(e)
    return compare_runs(a, b)


def cmd_verify_resume(cmd: "VerifyResume") -> int:
    work = Path(cmd.work_dir) if cmd.work_dir else Path(tempfile.mkdtemp(prefix="verify-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        raise CheckError(f"{work}: not empty; verify-resume trains two runs there (pass an empty or new --work-dir)")
    try:
        found = verify_resume(cmd.profile, work)
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
# index (farm._RunningEpisodes); with the run's env spec that re-simulates it exactly
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
    dec = msgspec.json.Decoder(farm.EpisodeRecord)
    out = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        try:
            out.append(dec.decode(line))
        except msgspec.DecodeError as e:
            raise CheckError(f"{path}: line {n} is not an EpisodeRecord ({e}); the file is corrupt") from None
    return out


class ReplayEnv:
    """The run's training env and its gamma per decision: built once, reset per record."""

    def __init__(self, run: Path, records: Sequence[farm.EpisodeRecord]) -> None:
        self.args = run_args(run)
        env = P.read_env(self.args)
        want = run_identity(run)["env_spec_digest"]
        if farm.env_value_digest(env.spec) != want:
            raise CheckError(f"{run / 'config.json'} builds an env with env_spec_digest "
                             f"{farm.env_value_digest(env.spec)[:16]}, identity.json says {want[:16]}: this "
                             "code's env is not the run's (check out the commit the run was trained with)")
        self.env = farm.env_factory(env.spec)()
        self.T, self.n_battles = env.T, env.n_battles
        self.lengths: dict[tuple[int, int], int] = {}   # (battle, ordinal) -> episode_steps
        self.seats: dict[tuple[int, int, int], list[farm.EpisodeRecord]] = {}   # both seats' records of a battle
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
            i = next((j for j, (x, y) in enumerate(zip(mine, theirs)) if list(x) != list(y)),
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


def replay_record(renv: ReplayEnv, rec: farm.EpisodeRecord) -> Replayed:
    """Re-simulate one record: its seed, both seats' played actions, its gammas; compare."""
    from royalegym.action import NOOP
    env, me = renv.env, SEATS[rec.seat]
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
        setter = getattr(env.reward_fn, "set_gamma", None)
        if setter is not None:
            setter(gammas[step])          # what the farm's worker forwards before each step
        obs, rew, term, trunc, info = env.step(acts)
        ret += float(np.float32(rew[me]))  # the worker's running float64 sum of float32 rewards
        deploy = int(info[me]["deploy_status"])
        cards, illegal = cards + (deploy == 0), illegal + (1 <= deploy <= 11)
        ended = bool(term[me] or trunc[me])
        early = (Divergence(step, "cards_played", rec.cards_played, f"{cards} by this step") if cards > rec.cards_played
                 else Divergence(step, "illegal_commands", rec.illegal_commands, f"{illegal} by this step")
                 if illegal > rec.illegal_commands
                 else Divergence(step, "episode_steps", rec.episode_steps, f"ended after {step + 1}")
                 if ended and step < rec.episode_steps - 1 else None)
        if early:
            return Replayed([], early)
    last = rec.episode_steps - 1
    if not ended:
        return Replayed([], Divergence(last, "episode_steps", rec.episode_steps, "still running"))
    fields = _final_fields(rec, info[me], cards, illegal, ret)
    first = next((Divergence(last, f, a, b) for f, a, b in fields if not _same(a, b)), None)
    return Replayed(fields, first)


def _final_fields(rec: farm.EpisodeRecord, fin: dict[str, Any], cards: int, illegal: int,
                  ret: float) -> list[tuple[str, Any, Any]]:
    """(field, record, replay) for everything the record states about how the episode ended."""
    terms = {k.split("/", 1)[1]: float(v) for k, v in fin.items() if k.startswith("reward_sum/")}
    out: list[tuple[str, Any, Any]] = [(f, getattr(rec, f), type(getattr(rec, f))(fin[f])) for f in (
        "episode_steps", "episode_ticks", "own_crowns", "enemy_crowns", "own_tower_hp_frac",
        "enemy_tower_hp_frac", "elixir_leak_steps")]
    out += [("winner", rec.winner, int(fin.get("winner", -1))), ("outcome", rec.outcome, int(fin.get("outcome", 0))),
            ("cards_played", rec.cards_played, cards), ("illegal_commands", rec.illegal_commands, illegal),
            ("undiscounted_return", rec.undiscounted_return, ret)]
    out += [(f"reward_terms.{k}", rec.reward_terms.get(k, _ABSENT), terms.get(k, _ABSENT))
            for k in sorted(set(rec.reward_terms) | set(terms))]
    return out


def describe(i: int, rec: farm.EpisodeRecord) -> str:
    return (f"episode {i}: battle {rec.battle} ordinal {rec.ordinal} seat {rec.seat} ({SEATS[rec.seat]}), "
            f"{rec.policy_id} vs {rec.opponent_id}, seed {rec.episode_seed}, {rec.episode_steps} steps, "
            f"{len(rec.played)} played actions (both seats)")


def cmd_replay(cmd: "Replay") -> int:
    run = run_dir(cmd.run)
    records = read_records(run)
    if not cmd.all and cmd.episode is None:
        raise CheckError("replay needs --episode N (0-based, a line of episodes.jsonl) or --all")
    if not records:
        raise CheckError(f"{run / 'episodes.jsonl'} holds no records yet: nothing to replay")
    if not cmd.all and not 0 <= cmd.episode < len(records):
        raise CheckError(f"--episode {cmd.episode} is out of range: {run / 'episodes.jsonl'} holds "
                         f"{len(records)} records (0..{len(records) - 1})")
    if any(r.eval_index >= 0 for r in records):
        raise CheckError(f"{run / 'episodes.jsonl'} holds evaluation episodes (eval_index >= 0): they are "
                         "played on ladder/eval_env.json, which replay does not rebuild")
    renv = ReplayEnv(run, records)
    if not cmd.all:
        rec = records[cmd.episode]
        res = replay_record(renv, rec)
        print(describe(cmd.episode, rec))
        print(f"  {'field':<40} {'record':>24} {'replay':>24}")
        for f, a, b in res.fields:
            print(f"  {f:<40} {a!r:>24} {b!r:>24}  {'ok' if _same(a, b) else 'DIFFERS'}")
        print(f"DIVERGES at {res.divergence}" if res.divergence else "MATCH: every field equal")
        if res.divergence is not None and res.divergence.step == rec.episode_steps - 1:
            print("  (a record states how its episode ended, not each step, so a divergence earlier in the "
                  "battle first shows at its last step)")
        return 1 if res.divergence else 0
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


# --- 6. CLI ---------------------------------------------------------------------------------------
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
    """Prove resume on this machine (design 8.3): six iterations straight, against three, a
    checkpoint, and three more in a fresh process; compared file, row and field."""
    profile: str = "smoke"
    """the profile to prove (episodes are cut at T decisions so checkpoints fall on episode ends)"""
    work_dir: Optional[str] = None
    """an empty folder for the two runs (default: a new temporary one)"""
    keep: bool = False
    """keep the two runs afterwards, to look at a failure"""


@dataclasses.dataclass(kw_only=True)
class Replay:
    """Re-simulate episodes from episodes.jsonl (their seed and both seats' played actions) and
    compare each with its record; exit 1 at the first divergence, naming the step and field."""
    run: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR")]
    """the run directory"""
    episode: Optional[int] = None
    """the record to replay: its 0-based line in episodes.jsonl"""
    all: bool = False
    """replay every record and report how many match"""


COMMANDS: dict[type, Callable[[Any], int]] = {Doctor: cmd_doctor, Identity: cmd_identity,
                                              VerifyResume: cmd_verify_resume, Replay: cmd_replay}


def main(argv: Sequence[str] | None = None) -> int:
    cmd = tyro.cli(Union[Doctor, Identity, VerifyResume, Replay], args=argv, prog="checks.py",   # type: ignore[arg-type]
                   description="Checks of a clash-ppo run: doctor, identity, verify-resume, replay.")
    try:
        return COMMANDS[type(cmd)](cmd)
    except (CheckError, P.ConfigError, P.CheckpointFormatError, P.ArchMismatch) as exc:
        name = "".join("-" + c.lower() if c.isupper() else c for c in type(cmd).__name__).lstrip("-")
        print(f"checks.py {name}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
