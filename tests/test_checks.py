"""Tests for checks.py: doctor, identity, verify-resume, replay, play and bench (issue 10's Tests
paragraph). The fast tests compute identities off a real env and exercise the comparison, the
bench's arithmetic and the errors on small planted files; the slow ones train smoke runs and
check the commands on them."""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Union

import msgspec
import pytest

import checks
import farm
import ppo_clash as P

# the smdp experiment's change (docs/learning.md), which verify-resume proves resumes exactly
SMDP = Path(checks.__file__).parent / "docs" / "experiments" / "smdp.json"


def run_main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = checks.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def write_identity_run(path: Path, args: P.Args) -> Path:
    """A run directory holding identity.json exactly as ppo_clash.open_run writes it."""
    identity, rid = checks.compute_identity(args)
    run = path / f"{args.run_name}-{rid}"
    run.mkdir(parents=True)
    (run / "identity.json").write_bytes(msgspec.json.format(P.canonical_json(identity)))
    return run


def a_record(**kw) -> farm.EpisodeRecord:
    base = dict(slot=0, worker=0, shard=0, battle=0, seat=0, ordinal=0,
                episode_seed_path="env/battle/0/ordinal/0", episode_seed=1, policy_id="learner",
                opponent_id="scripted:noop", bucket="scripted",
                episode_steps=3, episode_ticks=30, own_crowns=0, enemy_crowns=0, own_tower_hp_frac=1.0,
                enemy_tower_hp_frac=1.0, elixir_leak_steps=0, elixir_count_exact=True, winner=-1, outcome=0,
                cards_played=0, illegal_commands=0, undiscounted_return=0.0, reward_terms={}, played=())
    base.update(kw)
    return farm.EpisodeRecord(**base)


# --- the CLI and the errors -------------------------------------------------------------------------


def test_the_cli_lists_exactly_the_built_commands():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        checks.main(["--help"])
    built = ["doctor", "identity", "verify-resume", "replay", "play", "bench", "learn", "export"]
    usage = re.match(r"usage: checks\.py \[-h\] \{([a-z,-]+)\}\n", out.getvalue())   # the choices, in order
    assert usage is not None and usage.group(1).split(",") == built, out.getvalue()[:200]
    dispatched = [re.sub(r"(?<!^)(?=[A-Z])", "-", t.__name__).lower() for t in checks.COMMANDS]
    assert dispatched == built                        # every listed command runs, and no other
    assert "Not built yet" not in checks.__doc__


def test_bad_input_exits_2_with_one_line_naming_the_thing(tmp_path):
    code, _, err = run_main("identity", str(tmp_path / "absent"))
    assert code == 2 and "absent: no such run directory" in err and "Traceback" not in err
    code, _, err = run_main("replay", str(tmp_path / "absent"), "--episode", "0")
    assert code == 2 and "no such run directory" in err
    run = tmp_path / "run"
    run.mkdir()
    code, _, err = run_main("replay", str(run), "--episode", "0")
    assert code == 2 and "episodes.jsonl: missing" in err
    (run / "episodes.jsonl").write_bytes(msgspec.json.encode(a_record()) + b"\n" + b'{"slot": 1\n')
    code, _, err = run_main("replay", str(run), "--episode", "0")
    assert code == 2 and "episodes.jsonl: line 2 is not an EpisodeRecord" in err
    (run / "episodes.jsonl").write_bytes(msgspec.json.encode(a_record()) + b"\n" + b'{"slot": 1')
    assert checks.read_records(run) == [a_record()]     # a live run's unfinished last line: left out
    code, _, err = run_main("replay", str(run), "--episode", "3")
    assert code == 2 and "--episode 3 is out of range" in err and "holds 1 records (0..0)" in err
    code, _, err = run_main("replay", str(run))
    assert code == 2 and "--episode N" in err
    (run / "identity.json").write_text("{not json")
    code, _, err = run_main("identity", str(run))
    assert code == 2 and "identity.json: not valid JSON" in err
    (run / "identity.json").write_text('{"master_seed": 1}')
    code, _, err = run_main("identity", str(run))
    assert code == 2 and "identity.json: not a RunIdentity" in err
    code, _, err = run_main("identity", "--config", str(tmp_path / "nope.json"))
    assert code == 2 and "nope.json: no such config file" in err


# --- identity -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_runs_differing_only_in_run_name_have_one_run_id_and_lr_actor_moves_only_algo_digest(tmp_path):
    """Computed the way open_run computes it; --diff names exactly the field that moved."""
    smoke = ["--profile", "smoke", "--runs-dir", str(tmp_path)]
    a = write_identity_run(tmp_path / "a", P.parse_args(smoke + ["--run-name", "first"]))
    b = write_identity_run(tmp_path / "b", P.parse_args(smoke + ["--run-name", "second"]))
    assert a.name.split("-")[-1] == b.name.split("-")[-1]
    assert (a / "identity.json").read_bytes() == (b / "identity.json").read_bytes()
    c = write_identity_run(tmp_path / "c", P.parse_args(smoke + ["--ppo.lr-actor", "0.001"]))
    code, out, _ = run_main("identity", "--diff", str(a), str(c))
    lines = out.splitlines()
    assert code == 0 and "1 field(s) differ" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("algo_digest: '")
    code, out, _ = run_main("identity", str(a))
    assert code == 0 and out.splitlines()[-1] == f"run_id {a.name.split('-')[-1]}"
    assert json.loads("\n".join(out.splitlines()[:-1])) == json.loads((a / "identity.json").read_text())


# --- verify-resume: the comparison on planted files ----------------------------------------------


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_comparison_skips_wall_clock_and_names_file_row_and_field(tmp_path):
    rows = [{"run/iteration": i, "ppo/kl": 0.1 * i, "time/iteration": 1.0, "ladder/gate_seconds_frac": 0.0,
             "health/nan": float("nan")} for i in range(1, 4)]
    games = [{"a": "x", "b": "y", "wall": "2001"}]
    for d in ("a", "b"):
        _write_rows(tmp_path / d / "metrics.jsonl", rows)
        _write_rows(tmp_path / d / "episodes.jsonl", [{"slot": 0}])
        _write_rows(tmp_path / d / "ladder" / "games.jsonl", games)
    b = tmp_path / "b"
    _write_rows(b / "metrics.jsonl",
                [dict(r, **{"time/iteration": 9.0, "ladder/gate_seconds_frac": 0.5}) for r in rows])
    _write_rows(b / "ladder" / "games.jsonl", [dict(games[0], wall="2002")])
    assert checks.compare_runs(tmp_path / "a", b) is None
    _write_rows(b / "metrics.jsonl", rows[:2] + [dict(rows[2], **{"ppo/kl": 7.0})])
    assert checks.compare_runs(tmp_path / "a", b) == \
        "metrics.jsonl: row 3, field 'ppo/kl': straight run 0.30000000000000004, resumed run 7.0"
    _write_rows(b / "metrics.jsonl", rows[:2])
    assert checks.compare_runs(tmp_path / "a", b).startswith(
        "metrics.jsonl: row 3: the straight run has 3 rows")
    _write_rows(b / "metrics.jsonl", rows)
    _write_rows(b / "ladder" / "games.jsonl", [dict(games[0], b="z")])
    assert checks.compare_runs(tmp_path / "a", b) == \
        "ladder/games.jsonl: row 1, field 'b': straight run 'y', resumed run 'z'"


# --- slow: on real smoke runs ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """A smoke run of three iterations: whole battles spanning iterations, so replay must apply
    each iteration's gamma; both seats of each finished battle recorded."""
    runs = tmp_path_factory.mktemp("smoke")
    return P.train(P.parse_args(["--profile", "smoke", "--runs-dir", str(runs)]), quiet=True)


@pytest.mark.slow
def test_replay_matches_every_episode_of_a_smoke_run(smoke_run):
    code, out, err = run_main("replay", str(smoke_run), "--all")
    n = len((smoke_run / "episodes.jsonl").read_text().splitlines())
    assert code == 0, out + err
    assert n >= 2 and out.splitlines()[-1] == f"{n} of {n} records match"
    code, out, _ = run_main("replay", str(smoke_run), "--episode", "0")
    assert code == 0 and "MATCH: every field equal" in out and "reward_terms.terminal" in out
    assert "reward_terms_step_abs.CommittedElixirPotential" in out


@pytest.mark.slow
def test_replay_names_an_edited_step_abs_and_passes_a_record_from_before_it_existed(smoke_run, tmp_path):
    def louder(r):
        r["reward_terms_step_abs"]["CommittedElixirPotential"] += 0.5

    code, out, _ = run_main("replay", str(_edited_copy(smoke_run, tmp_path / "louder", {0: louder})),
                            "--episode", "0")
    assert code == 1 and "reward_terms_step_abs.CommittedElixirPotential: record" in out, out
    def old(r):
        r.pop("reward_terms_step_abs")
        r.pop("trajectory_digest")

    code, out, _ = run_main("replay", str(_edited_copy(smoke_run, tmp_path / "old", {0: old})),
                            "--episode", "0")
    assert code == 0 and "MATCH" in out and "reward_terms_step_abs" not in out and \
        "trajectory_digest" not in out, out


@pytest.mark.slow
def test_replay_holds_the_trajectory_digest_even_when_both_seats_records_are_edited_alike(
        smoke_run, tmp_path):
    """The gap the twin check leaves (one edit made to both records of a battle) is closed by the
    chain of engine states: both records' digest edited, replay names the field."""
    recs = [json.loads(x) for x in (smoke_run / "episodes.jsonl").read_text().splitlines()]
    (twin,) = [j for j, r in enumerate(recs)
               if j and (r["battle"], r["ordinal"]) == (recs[0]["battle"], recs[0]["ordinal"])]
    assert len(recs[0]["trajectory_digest"]) == 16 and \
        recs[0]["trajectory_digest"] == recs[twin]["trajectory_digest"]

    def other(r):
        r["trajectory_digest"] = "0" * 16

    code, out, _ = run_main("replay", str(_edited_copy(smoke_run, tmp_path / "d", {0: other, twin: other})),
                            "--episode", "0")
    assert code == 1 and \
        f"trajectory_digest: record '{'0' * 16}', replay '{recs[0]['trajectory_digest']}'" in out, out


@pytest.mark.slow
def test_replay_writes_a_trace_that_verifies_and_holds_the_records_battle(smoke_run, tmp_path, monkeypatch):
    """--trace: the replayed battle as a royalegym trace, its commands the record's played actions,
    its result the record's; none written when the replay diverges; a verify failure exits 1."""
    from royalegym.replay import load_trace, verify_trace
    recs = [json.loads(x) for x in (smoke_run / "episodes.jsonl").read_text().splitlines()]
    i = max(range(len(recs)), key=lambda j: len(recs[j]["played"]))
    rec = recs[i]
    for name in ("t.msgpack", "new/folder/t.json"):      # a missing folder is made, as play --save does
        code, out, _ = run_main("replay", str(smoke_run), "--episode", str(i), "--trace",
                                str(tmp_path / name))
        assert code == 0 and "verify_trace: identical on a fresh engine" in out, out
        trace = load_trace(tmp_path / name)
        assert sum(len(s.commands) for s in trace.steps) == len(rec["played"]) > 0
        assert len(trace.steps) == rec["episode_steps"] and trace.result.winner == rec["winner"]
        crowns = [rec["own_crowns"], rec["enemy_crowns"]]
        assert trace.result.crowns == (crowns if rec["seat"] == 0 else crowns[::-1])
        assert verify_trace(trace, checks.ReplayEnv(smoke_run, []).make().engine) == []
    edited = _edited_copy(smoke_run, tmp_path / "edited", {i: change})
    code, out, _ = run_main("replay", str(edited), "--episode", str(i), "--trace",
                            str(tmp_path / "e.msgpack"))
    assert code == 1 and "no trace written: the replay diverged" in out and \
        not (tmp_path / "e.msgpack").exists()
    monkeypatch.setattr("royalegym.replay.verify_trace",
                        lambda trace, engine: ["tick 3: hash a != recorded b"])
    code, out, _ = run_main("replay", str(smoke_run), "--episode", str(i), "--trace",
                            str(tmp_path / "v.msgpack"))
    assert code == 1 and \
        "verify_trace FAILS on a fresh engine (1 divergences), the first: tick 3: hash a" in out
    code, _, err = run_main("replay", str(smoke_run), "--all", "--trace", str(tmp_path / "a.msgpack"))
    assert code == 2 and "--trace writes one battle: give --episode N instead of --all" in err
    monkeypatch.undo()
    blocked = tmp_path / "t.msgpack" / "x.msgpack"     # under a file: no folder can be made there
    code, _, err = run_main("replay", str(smoke_run), "--episode", str(i), "--trace", str(blocked))
    assert code == 2 and err.count("\n") == 1 and f"--trace {blocked}: cannot be written (" in err, err


@pytest.mark.slow
def test_a_halt_bundles_trace_command_writes_the_newest_episodes_verified_trace(tmp_path):
    """halt.json's "trace" is a command that works: it traces episodes.jsonl's last record (an
    iteration four times smoke's, so that battles end before the halt at its end)."""
    args = P.parse_args(["--profile", "smoke", "--runs-dir", str(tmp_path),
                         "--alarms.ratio-invariant-multiple", "-1", "--ppo.timesteps-per-iteration", "1024"])
    with pytest.raises(P.AlarmHalt):
        P.train(args, quiet=True)
    (run,) = tmp_path.iterdir()
    cmd = json.loads((run / "bundles" / "1" / "halt.json").read_text())["trace"].split()
    n = len((run / "episodes.jsonl").read_text().splitlines())
    assert cmd[:5] == ["python", "checks.py", "replay", str(run), "--episode"] and cmd[5] == str(n - 1)
    code, out, _ = run_main(*cmd[2:])
    assert code == 0 and "verify_trace: identical on a fresh engine" in out and Path(cmd[-1]).stat().st_size


def _edited_copy(run: Path, dst: Path, edits: dict[int, Any]) -> Path:
    shutil.copytree(run, dst)
    recs = [json.loads(x) for x in (dst / "episodes.jsonl").read_text().splitlines()]
    for i, edit in edits.items():
        edit(recs[i])
    (dst / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return dst


def change(r):
    r["played"][1][2] += 1


def remove(r):
    r["played"] = []


@pytest.mark.slow
def test_replay_fails_naming_the_step_on_a_changed_or_removed_played_action(smoke_run, tmp_path):
    """One record edited: its played list disagrees with the other seat's record of the battle
    at the edited step. Both records edited alike: the simulation itself diverges (removed
    actions never reach the recorded result). A no-op written into played is refused at its step.
    Neither can pass: each edited record, and its twin, is counted as not matching."""
    recs = [json.loads(x) for x in (smoke_run / "episodes.jsonl").read_text().splitlines()]
    i = max(range(len(recs)), key=lambda j: len(recs[j]["played"]))
    (twin,) = [j for j, r in enumerate(recs)
               if j != i and (r["battle"], r["ordinal"]) == (recs[i]["battle"], recs[i]["ordinal"])]
    played = recs[i]["played"]
    assert len(played) >= 2
    last = recs[i]["episode_steps"] - 1
    cases = [("changed", {i: change},
              f"DIVERGES at step {played[1][0]}: played[1]: record {[*played[1][:2], played[1][2] + 1]}"),
             ("removed", {i: remove},
              f"DIVERGES at step {played[0][0]}: played[0]: record '<absent>', replay '{played[0]}"),
             ("removed_both", {i: remove, twin: remove}, f"DIVERGES at step {last}: "),
             ("noop", {i: lambda r: r["played"][0].__setitem__(2, 0)},
              f"DIVERGES at step {played[0][0]}: played[0]: record {[*played[0][:2], 0]}, "
              "replay 'a no-op is never recorded'")]
    for name, edits, want in cases:
        run = _edited_copy(smoke_run, tmp_path / name, edits)
        code, out, _ = run_main("replay", str(run), "--episode", str(i))
        assert code == 1 and want in out, (name, out)
        code, out, _ = run_main("replay", str(run), "--all")
        assert code == 1 and out.splitlines()[-1] == f"{len(recs) - 2} of {len(recs)} records match", \
            (name, out)


@pytest.mark.slow
def test_identity_of_a_run_is_its_name_and_recomputes_from_its_config(smoke_run):
    rid = smoke_run.name.split("-")[-1]
    code, out, _ = run_main("identity", str(smoke_run))
    assert code == 0 and out.splitlines()[-1] == f"run_id {rid}"
    code, out, _ = run_main("identity", "--config", str(smoke_run / "config.json"))
    assert code == 0 and out.splitlines()[-1] == f"run_id {rid}"


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """`checks.py verify-resume` (smoke, under forced_rows smdp: its forced sample is drawn per
    iteration, so a resume must draw the same cells) through the CLI, its runs kept for the
    planted test. Resume under critic_only is proven by tests/test_ppo_clash.py's kill -9 test."""
    work = tmp_path_factory.mktemp("verify") / "work"
    code, out, err = run_main("verify-resume", "--config", str(SMDP), "--work-dir", str(work), "--keep")
    return code, out + err, work


@pytest.mark.slow
def test_verify_resume_passes_on_smoke(verified):
    code, out, work = verified
    assert code == 0, out
    assert out.splitlines()[-1].startswith("PASS: rows 1-4 of metrics.jsonl equal")
    (b,) = (work / "b").iterdir()
    rows = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert [r["run/iteration"] for r in rows] == [1, 2, 3, 4]
    assert json.loads((b / "config.json").read_text())["ppo"]["forced_rows"] == "smdp"
    # whole battles: the split's checkpoint found them mid-episode, and they finished after it
    split = sorted((b / "checkpoints").iterdir())[0]
    assert json.loads((split / "rollout" / "in_flight.json").read_text())
    assert sum(r["env/episodes_completed"] for r in rows[checks.SPLIT:]) > 0


@pytest.mark.slow
def test_verify_resume_reports_a_planted_difference_after_the_resume(verified, tmp_path):
    _, _, work = verified
    (a,) = (work / "a").iterdir()
    (b0,) = (work / "b").iterdir()
    b = tmp_path / "b"
    shutil.copytree(b0, b)
    rows = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    was = rows[3]["ppo/kl"]
    rows[3]["ppo/kl"] = was + 1.0
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert checks.compare_runs(a, b) == \
        f"metrics.jsonl: row 4, field 'ppo/kl': straight run {was!r}, resumed run {was + 1.0!r}"
    shutil.rmtree(b)
    shutil.copytree(b0, b)
    eps = [json.loads(x) for x in (b / "episodes.jsonl").read_text().splitlines()]
    eps[-1]["own_crowns"] += 1
    (b / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eps))
    found = checks.compare_runs(a, b)
    assert found.startswith(f"episodes.jsonl: row {len(eps)}, field 'own_crowns': straight run ")


# --- doctor (design 3.8) ----------------------------------------------------------------------------


def _config(tmp_path, name, **fields):
    """A config file: the smoke profile with dotted fields set."""
    args = P.profile_args("smoke")
    for path, value in fields.items():
        P._set(args, path, value)
    f = tmp_path / f"{name}.json"
    f.write_bytes(P.config_json(args))
    return f


@pytest.mark.slow
@pytest.mark.parametrize("reveal", [(), ("enemy_spell_aim",)])
def test_doctor_passes_on_both_geometries(tmp_path, reveal):
    """The default observation and the spell-aim one (one plane more): every gate passes, each is
    printed with its number, and step 10 names the run_id training would get."""
    code, out, err = run_main("doctor", "--config", str(_config(tmp_path, "c", **{"obs.reveal": reveal})))
    assert code == 0, err
    for step in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10):
        assert re.search(rf"^\s*{step}\. .*: ok, ", out, re.M), (step, out)
    assert "0 disagreements" in out and "0 without the no-op" in out and "all gates pass" in out
    assert re.search(r"\(\d+ after game over\)", out) and "(0 after game over)" not in out


@pytest.mark.slow
def test_doctor_fails_naming_the_gate_planted_to_fail(tmp_path, monkeypatch):
    """A mask that disagrees with the engine fails gate 5, a RAM budget of 1 MB fails gate 9: exit
    2, one line naming the gate and its remedy; training refuses the same way (one implementation)."""
    import royalegym.action
    code, _, err = run_main("doctor", "--config",
                            str(_config(tmp_path, "ram", **{"doctor.ram_budget_mb": 1})))
    assert code == 2 and "start-up gate 9 (RAM ledger within doctor.ram_budget_mb) failed" in err
    assert "raise --doctor.ram-budget-mb" in err and "Traceback" not in err
    monkeypatch.setattr(royalegym.action, "mask_disagreements",
                        lambda engine, parser, state, team: [(7, 1, 3)])
    # the battles are played once a process (ppo_clash._sampled_battles): this one plays its own
    monkeypatch.setattr(P, "_sampled_battles", P._sampled_battles.__wrapped__)
    code, _, err = run_main("doctor", "--profile", "smoke")
    assert code == 2 and "start-up gate 5 (mask agrees with the engine" in err and "2 disagreements" in err
    with pytest.raises(P.StartupGateFailed, match="start-up gate 5"):
        P.train(P.parse_args(["--profile", "smoke", "--runs-dir", str(tmp_path / "runs")]), quiet=True)
    assert not (tmp_path / "runs").exists()   # refused before the run directory was made


def test_doctor_names_the_rebuild_command_for_a_stale_engine_build(monkeypatch):
    """Design 3.8 step 1: a RustEngine whose build differs from the calibration ledger refuses to
    construct; doctor (and training, through read_env) re-raise it as gate 1 with the rebuild
    command, in the engine's own words. Any other error from the engine is left as it was."""
    import royalegym.rust_engine
    monkeypatch.setattr(royalegym.rust_engine, "stale_build_differences",
                        lambda calibration, arena_path=None: ["elixir.REGEN_TICKS: built 56, ledger 57"])
    monkeypatch.setattr(P, "env_reading", P.env_reading.__wrapped__)   # read once a process: read again
    code, _, err = run_main("doctor", "--profile", "smoke")
    assert code == 2 and "start-up gate 1 (engine built and reset) failed" in err, err
    assert "royalesim was built against different data" in err and "elixir.REGEN_TICKS" in err
    assert "pip install --force-reinstall 'royalegym[sim]'" in err and err.count("\n") == 1 and \
        "Traceback" not in err
    monkeypatch.undo()
    assert P.stale_build_refusal(RuntimeError("something else")) is None


# --- play: one battle, watched, saved, replayed ------------------------------------------------------


def test_play_refuses_bad_players_in_one_line(tmp_path):
    """Bad input names the thing and exits 2 before anything is built: an unknown kind or scripted
    name, a snap: player with no run to read it from, a checkpoint directory that is missing or
    has no manifest, two runs at once; a file replay cannot read is refused the same way."""
    bare = tmp_path / "run" / "checkpoints" / "000000000001"
    bare.mkdir(parents=True)
    half = tmp_path / "models" / "half"     # a snapshot folder without its weights
    half.mkdir(parents=True)
    (half / "spec.json").write_text("{}")
    cases = [((str(half), "scripted:push"),
              "half: not a snapshot folder (it needs spec.json and actor.safetensors)"),
             (("scripted:nope", "scripted:push"),
              "scripted:nope: unknown scripted player; farm.SCRIPTED_NAMES = noop"),
             (("pool:x", "scripted:push"),
              "player 'pool:x': not snap:<id>, seed:<name>, scripted:<name>, lookahead:<base>[,...], "
              "checkpoint:<dir>"),
             (("lookahead:defend,h=0", "scripted:push"),
              "'lookahead:defend,h=0': h=0 must be a whole number"),
             (("snap:0123456789abcdef", "scripted:push"),
              "a snap:<id> or seed:<name> player needs --run RUN_DIR"),
             (("scripted:push", "seed:patient"), "a snap:<id> or seed:<name> player needs --run RUN_DIR"),
             (("scripted:push", f"checkpoint:{tmp_path / 'absent'}"), "absent: no such checkpoint directory"),
             (("scripted:push", f"checkpoint:{bare}"),
              "000000000001/manifest.json is missing: not a checkpoint")]
    for (blue, red), want in cases:
        code, out, err = run_main("play", "--blue", blue, "--red", red)
        assert code == 2 and want in err and err.count("\n") == 1 and out == "", (blue, red, err)
    (tmp_path / "other").mkdir()
    code, _, err = run_main("play", "--blue", f"checkpoint:{bare}", "--red", "scripted:push", "--run",
                            str(tmp_path / "other"))
    assert code == 2 and "manifest.json is missing" in err
    code, _, err = run_main("play", "--blue", "scripted:push", "--red", "scripted:push", "--every", "0")
    assert code == 2 and "--every 0" in err
    full = farm.canonical_player("lookahead:push")
    assert checks.parse_player("lookahead:push") == full != "lookahead:push"
    (tmp_path / "f.json").write_text('{"format": "something else"}')
    code, _, err = run_main("replay", str(tmp_path / "f.json"))
    assert code == 2 and "f.json: not a battle saved by `checks.py play --save`" in err


@pytest.fixture(scope="module")
def saved_battle(smoke_run, tmp_path_factory):
    """scripted:push (blue) against the smoke run's snapshot (red), a view every 10 decisions,
    saved; played twice, so the second file shows a battle is a function of (seed, players)."""
    (sid,) = [p.name for p in (smoke_run / "ladder" / "snapshots").iterdir()]
    folder = tmp_path_factory.mktemp("play")
    runs = []
    for name in ("a.json", "b.json"):
        runs.append(run_main("play", "--blue", "scripted:push", "--red", f"snap:{sid}",
                             "--run", str(smoke_run), "--seed", "3", "--every", "10",
                             "--save", str(folder / name)))
    return runs, folder / "a.json", folder / "b.json", sid


@pytest.mark.slow
def test_play_shows_a_full_battle_saves_it_and_replay_matches(saved_battle, smoke_run):
    (code, out, err), _ = saved_battle[0]
    _, a, b, sid = saved_battle
    assert code == 0, err
    saved = checks.read_saved_battle(a)
    blue, red = saved.records
    assert (blue.policy_id, red.policy_id, blue.seat, red.seat) == ("scripted:push", f"snap:{sid}", 0, 1)
    assert blue.winner in (0, 1, 2) and blue.played == red.played   # one battle, recorded once per seat
    seats = [seat for _, seat, _ in blue.played]
    assert set(seats) == {0, 1}, seats                # a full battle, both seats acted
    for seat, rec in enumerate((blue, red)):          # each card played or refused was a non-no-op action
        assert seats.count(seat) >= rec.cards_played + rec.illegal_commands, (seat, seats.count(seat), rec)
    env, _ = checks.ladder.read_run_env(smoke_run)
    assert saved.env == checks.ladder.eval_env_spec(env) and not saved.env.truncation
    views = re.findall(r"^step (\d+) \((\d+) decisions\), \d+:\d\d\.\d of battle$", out, re.M)
    assert [int(n) for _, n in views] == list(range(10, blue.episode_steps, 10))
    assert len(re.findall(r"^  blue elixir +\d+\.\d  crowns \d  towers king \d+ left \d+ right \d+ ",
                          out, re.M)) == len(views)
    first = blue.played[0]
    assert re.search(rf"^    {checks.SEATS[first[1]]} played: s{first[0]} \w+ at tile \(\d+, \d+\)",
                     out, re.M)
    who = {0: "blue wins", 1: "red wins", 2: "draw"}[blue.winner]
    assert (f"result: {who} (scripted:push blue, snap:{sid} red); "
            f"crowns blue {blue.own_crowns} red {blue.enemy_crowns}") in out
    assert f"{blue.episode_steps} decisions" in out
    assert a.read_bytes() == b.read_bytes()           # same seed, same players: the same battle
    code, out, _ = run_main("replay", str(a))
    assert code == 0, out
    assert out.count("MATCH: every field equal") == 2 and out.splitlines()[-1] == "2 of 2 records match"
    code, out, _ = run_main("replay", str(a), "--episode", "1")
    assert code == 0 and "seat 1 (red)" in out and out.splitlines()[-1] == "1 of 1 records match"
    code, out, _ = run_main("replay", str(a), "--episode", "1", "--trace", str(a.with_suffix(".msgpack")))
    assert code == 0 and "verify_trace: identical on a fresh engine" in out and \
        a.with_suffix(".msgpack").stat().st_size
    code, _, err = run_main("replay", str(a), "--trace", str(a.with_suffix(".msgpack")))
    assert code == 2 and "give --episode 0 (blue's record) or 1 (red's)" in err


@pytest.mark.slow
def test_play_trace_writes_the_battle_it_played_verified(tmp_path):
    """play --trace: the trace is the battle play printed and saved (its length, commands, crowns)."""
    from royalegym.replay import load_trace
    code, out, err = run_main("play", "--blue", "scripted:push", "--red", "scripted:patient", "--seed", "5",
                              "--save", str(tmp_path / "b.json"), "--trace", str(tmp_path / "b.msgpack"))
    assert code == 0 and "verify_trace: identical on a fresh engine" in out, out + err
    assert "replayed from blue's record: every field and the trajectory digest match" in out and \
        "MATCH" not in out
    blue = checks.read_saved_battle(tmp_path / "b.json").records[0]
    trace = load_trace(tmp_path / "b.msgpack")
    assert len(trace.steps) == blue.episode_steps and trace.result.winner == blue.winner
    assert sum(len(s.commands) for s in trace.steps) == len(blue.played) > 0
    assert trace.result.crowns == [blue.own_crowns, blue.enemy_crowns]


@pytest.mark.slow
def test_replay_of_an_edited_saved_battle_fails_naming_the_step(saved_battle, tmp_path):
    """A played action changed, or played removed, in blue's record: replay exits 1 at the step
    of the edit (the red record of the battle disagrees), as for a run's episodes.jsonl."""
    _, a, _, _ = saved_battle
    doc = json.loads(a.read_text())
    played = doc["records"][0]["played"]
    assert len(played) >= 2
    cases = [("changed", change,
              f"DIVERGES at step {played[1][0]}: played[1]: record {[*played[1][:2], played[1][2] + 1]}"),
             ("removed", remove,
              f"DIVERGES at step {played[0][0]}: played[0]: record '<absent>', replay '{played[0]}")]
    for name, edit, want in cases:
        edited = json.loads(a.read_text())
        edit(edited["records"][0])
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps(edited))
        code, out, _ = run_main("replay", str(f))
        assert code == 1 and want in out and out.splitlines()[-1] == "0 of 2 records match", (name, out)
    edited = json.loads(a.read_text())
    edited["env"]["decision_ms"] += 1
    (tmp_path / "env.json").write_text(json.dumps(edited))
    code, _, err = run_main("replay", str(tmp_path / "env.json"))
    assert code == 2 and "env.json: its env hashes to env_value_digest" in err


@pytest.mark.slow
def test_play_refuses_a_missing_or_stacked_snapshot_and_plays_a_checkpoint(smoke_run, tmp_path):
    """A snapshot id the run lacks, and a frame_stack 2 snapshot (which the ladder refuses too),
    exit 2 in one line; a checkpoint: player implies its run and plays."""
    code, _, err = run_main("play", "--blue", "snap:0123456789abcdef", "--red", "scripted:push",
                            "--run", str(smoke_run))
    assert code == 2 and "snapshot 0123456789abcdef: no " in err and "known snapshots" in err and \
        err.count("\n") == 1
    code, _, err = run_main("play", "--blue", "seed:patient", "--red", "scripted:push",
                            "--run", str(smoke_run))
    assert code == 2 and "seed:patient: no such seed snapshot in this run's pool (its seeds: none)" in err
    assert err.count("\n") == 1
    run = tmp_path / smoke_run.name
    shutil.copytree(smoke_run, run)
    store = checks.ladder.SnapshotStore(run)
    (sid,) = store.ids()
    spec, tensors = store.load(sid)
    stacked = store.save(tensors, msgspec.structs.replace(spec, frame_stack=2, actor_sha256=""))
    code, _, err = run_main("play", "--blue", "scripted:push", "--red", f"snap:{stacked}", "--run", str(run))
    assert code == 2 and f"snap:{stacked}: frame_stack is 2" in err and err.count("\n") == 1
    (ck,) = (smoke_run / "checkpoints").iterdir()
    code, out, err = run_main("play", "--blue", f"checkpoint:{ck}", "--red", "scripted:noop",
                              "--every", "1000")
    assert code == 0, err
    assert f"env {smoke_run / 'ladder' / 'eval_env.json'}" in out and \
        out.splitlines()[-1].startswith("result: ")


@pytest.mark.slow
def test_play_viewer_streams_when_royalegym_has_one_and_says_so_when_not(monkeypatch):
    """Scripted against scripted needs no run. With royalegym's viewer publisher the battle is
    streamed (an ephemeral port here: nobody attached, so no pacing); without it, one line says
    so and how to get it, and the battle is still played."""
    monkeypatch.setenv("ROYALEVISER", "127.0.0.1:0")
    code, out, err = run_main("play", "--blue", "scripted:push", "--red", "scripted:defend",
                              "--every", "1000", "--viewer")
    assert code == 0, err
    assert re.search(r"^--viewer: streaming to 127\.0\.0\.1:\d+; watch with python -m royaleviser --stream",
                     out, re.M)
    assert "farm.default_env_spec() (no run)" in out.splitlines()[0] and \
        out.splitlines()[-1].startswith("result: ")
    monkeypatch.setitem(sys.modules, "royalegym.viser", None)   # an import of it now fails
    code, out2, _ = run_main("play", "--blue", "scripted:push", "--red", "scripted:defend",
                             "--every", "1000", "--viewer")
    lines = [x for x in out2.splitlines() if x.startswith("--viewer")]
    assert code == 0 and lines == ["--viewer: this royalegym has no viewer (royalegym.viser); "
                                   "get one with pip install -U 'royalegym[viser]'. Playing without it."]
    assert out2.splitlines()[-1] == out.splitlines()[-1]   # the same battle, watched or not


# --- bench -------------------------------------------------------------------------------------------


def test_bench_predicts_an_iteration_from_its_parts_by_plain_arithmetic():
    """[A] T=10 cycles, 4 battles, 2 shards, R=8: env 40 game-steps at 100/s = 0.4 s; the real
    iterations' 20 forwarded rows at 5 ms = 0.1 s (forced rows take none: not the 20 rounds, not
    the 40 learner cells); their 24 critic rows (smdp's, not the 88 cells) at 0.5 ms = 0.012 s;
    their 30 rows through the update at 2 ms = 0.06 s. Part by part beside the measured medians."""
    env = type("E", (), {"T": 10, "n_battles": 4, "n_shards": 2, "R": 8})()
    fig = lambda part, x: checks.BenchFigure(part, "u", [x - 1, x, x + 1], (0.0, 0.0))
    figs = {f.part: f for f in (fig("process farm (1 worker(s) x 2 shard(s))", 100.0), fig("inference", 5.0),
                                fig("critic pass", 0.5), fig("PPO update", 2.0))}
    p = checks.predict(env, figs, checks.Work(forwarded=20, critic_rows=24, update_rows=30))
    assert p == pytest.approx({"env": 0.4, "inference": 0.1, "critic": 0.012, "update": 0.06})
    assert figs["inference"].median == 5.0
    m = {"iteration": 0.75, "collection": 0.6, "inference": 0.2, "critic_pass": 0.012, "update": 0.06}
    lines = checks.part_lines(p, m)
    assert "| env (collection less inference) | 0.40 | 0.40 | 1.00 |" in lines
    assert "| inference | 0.10 | 0.20 | 2.00 |" in lines and "| iteration | 0.57 | 0.75 | 1.31 |" in lines


def test_bench_predicts_the_real_iterations_at_their_own_row_counts(tmp_path, monkeypatch):
    """real_iterations reads the parts' workload off the real iterations' rows, the first (a
    warm-up) left out: the median rows forwarded, critic rows and rows through the update, not the
    rectangle's. [A] medians 30, 40, 60 at 2, 0.5 and 1 ms: 0.06, 0.02 and 0.06 s."""
    keys = ("throughput/inference_rows_forward", "throughput/critic_rows", "ppo/actor_rows_seen")
    times = {f"time/{k}": 1.0 for k in ("iteration", "collection", "inference", "critic_pass", "update",
                                         "residual")}
    counts = [(999, 999, 999), (10, 40, 70), (30, 20, 60), (50, 60, 50)]
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({**times, **dict(zip(keys, c, strict=True))}) + "\n" for c in counts))
    monkeypatch.setattr(checks.P, "train", lambda *a, **k: tmp_path)
    env = type("E", (), {"T": 10, "n_battles": 4, "n_shards": 2, "R": 8})()
    fig = lambda part, x: checks.BenchFigure(part, "u", [x], (0.0, 0.0))
    figs = {f.part: f for f in (fig("process farm (1 worker(s) x 2 shard(s))", 100.0), fig("inference", 2.0),
                                fig("critic pass", 0.5), fig("PPO update", 1.0))}
    whole = checks.real_iterations(P.profile_args("smoke"), env, figs, 4, tmp_path / "work")
    assert whole.work == checks.Work(forwarded=30, critic_rows=40, update_rows=60)
    assert whole.predicted == pytest.approx({"env": 0.4, "inference": 0.06, "critic": 0.02, "update": 0.06})
    assert len(whole.iterations) == 3


def test_bench_replays_inference_beside_the_workers_that_step_while_the_parent_acts():
    """[A] The cpu profile's 2 workers of 1 shard: while the parent acts for one shard its worker
    waits, so 1 process steps beside; a cycle of 16 battles at 1,000 game-steps/s is 16 ms, 8 ms
    a round of its 2 shards. With 2 shards a worker, every worker steps beside; an inline farm's
    parent steps its own battles: nothing beside, no wait."""
    env = type("E", (), {"n_battles": 16, "n_shards": 2})()
    cpu = P.profile_args("cpu").rollout
    assert checks.replay_load(cpu, env, 1000.0) == (1, pytest.approx(0.008))
    env.n_shards = 4
    two = dataclasses.replace(cpu, shards_per_worker=2)
    assert checks.replay_load(two, env, 1000.0) == (2, pytest.approx(0.004))
    assert checks.replay_load(P.profile_args("smoke").rollout, env, 1000.0) == (0, 0.0)


@pytest.mark.slow
def test_bench_on_smoke_prints_every_part_and_writes_the_table_dated(tmp_path, monkeypatch):
    doc = tmp_path / "throughput.md"
    doc.write_text("# throughput\n")
    monkeypatch.setattr(checks, "THROUGHPUT_DOC", doc)
    code, out, err = run_main("bench", "--profile", "smoke", "--iterations", "2", "--gate-battles", "2",
                              "--write")
    assert code == 0, err
    table = [line for line in out.splitlines() if line.startswith("| ")]
    parts = [line.split(" | ")[0].lstrip("| ") for line in table[1:]]
    assert parts[:13] == ["engine, one process, nothing else", "process farm (1 worker(s) x 1 shard(s))",
                          "farm / raw loop", "codec.pack", "inference", "critic pass", "PPO update", "gate",
                          "iteration, predicted by the parts", "iteration, measured", "measured / predicted",
                          "iteration / the engine's time for its game-steps", "part"]
    assert parts[13:] == ["env (collection less inference)", "inference", "critic pass", "update",
                          "iteration"]
    gate = table[8].split(" | ")
    assert gate[2] == "x the engine" and float(gate[1]) > 0 and " battles in " in gate[5]
    for line in table[1:8]:                      # every part: REPEATS positive runs, the median among them
        cells = line.split(" | ")
        runs = [float(x) for x in cells[3].split()]
        assert len(runs) == checks.REPEATS and min(runs) > 0 and \
            float(cells[1]) == pytest.approx(sorted(runs)[1], rel=1e-3)
    written = doc.read_text()
    assert written.startswith("# throughput\n\n### bench, ") and \
        "`python checks.py bench --profile smoke`" in written
    assert all(line in written for line in table)
    assert run_main("bench", "--iterations", "1")[0] == 2


# --- learn (docs/learning.md) and a snapshot folder played without its run ------------------------

def _rung_row(rung: str, score: float, lower: float, seeds: int = 50) -> dict[str, Any]:
    return {"snapshot": "snap:x", "rung": rung, "score": score, "lower": lower,
            "upper": min(1.0, score + 0.1), "seeds": seeds, "battles": 2 * seeds, "master_seed": 1}


def test_the_bar_is_judged_rung_by_rung():
    """Issue 14's bar: random_legal >= 0.85 and patient >= 0.60, every other rung beaten, each with
    the lower bound above 0.5 over at least 50 seeds; a table has a row a rung, a column a player."""
    rows = [_rung_row("scripted:random_legal", 0.86, 0.80), _rung_row("scripted:patient", 0.62, 0.49),
            _rung_row("scripted:push", 0.55, 0.51, seeds=49), _rung_row("scripted:noop", 1.0, 1.0)]
    got = checks.bar_verdict(rows)
    assert [x.split(":")[1].split()[0] for x in got] == ["random_legal", "patient", "push", "noop"]
    assert ["NOT" not in x for x in got] == [True, False, False, True]
    assert "lower bound 0.490 against > 0.5" in got[1] and "49 seeds against >= 50" in got[2]
    cmd = checks.Learn(profile="smoke", game_steps=344)
    seconds = {"warm start": 30.0, "training": 1200.0, "gates": 300.0, "probes": 60.0,
               "start-up and saves": 6.0, "yardstick": 204.0}
    lines = checks.learn_lines(cmd, Path("/r"), 2, seconds, {"v0": "snap:a, untrained", "champion": "snap:b"},
                               {"v0": rows, "champion": rows})
    assert lines[2].startswith("Wall clock on ") and " cpus: 30.0 min in all (warm start 30 s, training " \
        "1,200 s, gates 300 s, probes 60 s, start-up and saves 6 s, yardstick 204 s)." in lines[2]
    assert lines[4] == "| rung | v0 (snap:a, untrained) | champion (snap:b) |"
    assert lines[6] == "| scripted:random_legal | 0.860 [0.800, 0.960] | 0.860 [0.800, 0.960] |"
    assert lines[-4:] == [f"- {x}" for x in got]


def test_learn_says_where_its_wall_clock_went_from_the_rows_and_warm_json(tmp_path):
    """learn_seconds: the warm start from warm.json, the gates and probes from the rows' time/ keys,
    training as the iterations less those, the call's rest as start-up."""
    (tmp_path / "warm.json").write_text('{"seconds": 40.0}')
    rows = [{"time/iteration": 10.0}, {"time/iteration": 100.0, "time/gate": 80.0},
            {"time/iteration": 30.0, "time/probe": 15.0}]
    got = checks.learn_seconds(tmp_path, rows, 200.0, 50.0)
    assert got == {"warm start": 40.0, "training": 45.0, "gates": 80.0, "probes": 15.0,
                   "start-up and saves": 20.0, "yardstick": 50.0}
    (tmp_path / "warm.json").unlink()
    assert checks.learn_seconds(tmp_path, rows, 100.0, 0.0)["start-up and saves"] == 0.0


def test_learn_measures_the_last_candidate_only_when_its_gate_discarded_it(tmp_path):
    """A screen's gate may keep v0 champion; the newest candidate (by game-step, not by file name)
    is then measured too, so the table shows what the learner had become. The champion's column
    head gives its snapshot's game-step."""
    import ladder
    ids = {}
    for name, step in (("old", 200), ("new", 300), ("early", 100)):
        spec = msgspec.json.encode(ladder.SnapshotSpec("a", "o", "x", 1, "t", 2, 8, 4, step, "c", "r"))
        sid = hashlib.sha256(spec).hexdigest()[:16]
        (tmp_path / "ladder" / "snapshots" / sid).mkdir(parents=True)
        (tmp_path / "ladder" / "snapshots" / sid / "spec.json").write_bytes(spec)
        ids[name] = "snap:" + sid

    def gate(name: str, outcome: str) -> None:
        ladder.write_gate_decision(tmp_path, ladder.GateDecision(
            ids[name], ids["early"], outcome, outcome != "discard", outcome == "admit+promote", False, [], {},
            "sha", 1.0, "w"))
    pool = ladder.Pool(v0=ids["early"], champion_chain=[ids["early"]])
    assert checks.last_discarded(tmp_path, pool) is None          # no gate yet
    gate("new", "discard")
    gate("old", "admit+promote")
    assert checks.last_discarded(tmp_path, pool) == (ids["new"], 300)
    assert checks.last_discarded(tmp_path, ladder.Pool(v0=ids["early"], champion_chain=[ids["new"]])) is None
    gate("new", "admit-as-cycle")
    assert checks.last_discarded(tmp_path, pool) is None          # admitted: not a discarded candidate
    # the champion's column names its own snapshot's game-step, not the run's end
    assert checks.champion_label(tmp_path, pool, 1000) == f"{ids['early']}: v0 was never displaced"
    promoted = ladder.Pool(v0=ids["early"], champion_chain=[ids["early"], ids["old"]])
    assert checks.champion_label(tmp_path, promoted, 1000) == \
        f"{ids['old']}, its snapshot at 200 game-steps, still the champion at 1,000"


def test_learn_refuses_a_budget_or_seed_count_it_cannot_honour_before_training(tmp_path):
    for flags in (["--game-steps", "0"], ["--seeds", "9"], ["--seeds", "0"]):   # smoke's frozen set holds 8
        code, out, err = run_main("learn", "--profile", "smoke", "--runs-dir", str(tmp_path), *flags)
        assert code == 2 and "ladder.eval_seed_count = 8 (checked before hours of training)" in err, flags
        assert err.count("\n") == 1 and not any(tmp_path.iterdir())


@pytest.mark.slow
def test_learn_stops_resumes_then_measures_and_a_shipped_folder_is_measured_and_played_without_its_run(
        tmp_path, capsys):
    """`checks.py learn` on smoke for two iterations, stopped after the first (exit 1, nothing
    measured, the command that continues it); the same command again is refused (the run exists),
    --resume without the run's change is refused by field, with it the run finishes: the yardstick's
    table, a row a rung, v0 (never displaced at this budget) measured once, its games appended to the
    run's log. Its snapshot folder copied out as a shipped model (spec.json, actor.safetensors, the
    run's eval_env.json) is then measured by `ladder.py yardstick --snapshot <folder> --master-seed 5
    --json` with no run (one JSON object a rung, on master seed 5's seeds, recorded nowhere),
    compared by `ladder.py eval --a <folder> --master-seed 5` (printed, recorded nowhere) and played
    by `checks.py play`."""
    import ladder
    change = tmp_path / "change.json"    # an experiment's one change, merged over the profile
    change.write_text('{"ppo": {"lr_critic": 0.0004}}')
    flags = ["learn", "--profile", "smoke", "--game-steps", "344", "--seeds", "1",
             "--runs-dir", str(tmp_path / "runs"), "--quiet", "--config", str(change)]
    train = checks.P.train   # a stop after iteration 1 (as Ctrl-C or the control file's q leave it)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checks.P, "train", lambda args, **kw: train(args, **{**kw, "max_iterations": 1}))
        code, out, err = run_main(*flags)
    (run,) = (tmp_path / "runs").iterdir()
    assert code == 1 and "| scripted:" not in out, err[-3000:]
    assert (f"stopped after iteration 1 at 172 of 344 game-steps, so nothing was measured; continue it with "
            f"python checks.py learn --profile smoke --game-steps 344 --seeds 1 --config {change} "
            f"--quiet --resume {run}") in out
    code, out, err = run_main(*flags)                        # the same command again: not trained over
    assert code == 2 and f"{run} exists: this benchmark was started before; continue it with" in err
    code, out, err = run_main(*flags[:-2], "--resume", str(run))   # without the change: refused by field
    assert code == 2 and \
        "this command's config differs from the run's (ppo.lr_critic: 0.0004 -> 0.0005)" in err
    saved = checks.P.latest_checkpoint(run).name
    code, out, err = run_main(*flags, "--resume", str(run))
    assert code == 0, err[-3000:]
    assert f"continuing {run} from {saved}" in out and \
        len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((run / "config.json").read_text())["ppo"]["lr_critic"] == 0.0004
    assert f'the change, --config {change}: {{"ppo":{{"lr_critic":0.0004}}}}' in out
    # the run's id: a committed entry names no machine's path
    assert f"from both sides; run {run.name};" in out
    table = [x for x in out.splitlines() if x.startswith("| scripted:")]
    assert [x.split()[1] for x in table] == [f"scripted:{n}" for n in farm.SCRIPTED_NAMES]
    assert "v0 was never displaced" in out and "2 iterations" in out and "The bar (the champion):" in out
    games = [json.loads(x) for x in (run / "ladder" / "games.jsonl").read_text().splitlines()]
    assert sum(g["kind"] == "eval" and g["iteration"] == -1 for g in games) == 2 * len(table)
    v0 = json.loads((run / "ladder" / "pool.json").read_text())["v0"]
    model = tmp_path / "models" / "smoke-v0"
    shutil.copytree(run / "ladder" / "snapshots" / v0.removeprefix("snap:"), model)
    shutil.copy(run / "ladder" / "eval_env.json", model)
    capsys.readouterr()
    assert ladder.main(["yardstick", "--snapshot", str(model), "--master-seed", "5", "--seeds", "1",
                        "--json"]) == 0
    got = capsys.readouterr()
    objs = [json.loads(x) for x in got.out.splitlines()]
    assert [o["rung"] for o in objs] == [f"scripted:{n}" for n in farm.SCRIPTED_NAMES]
    assert all(o["snapshot"] == v0 and o["master_seed"] == 5 and o["battles"] == 2 and
               o["lower"] <= o["score"] <= o["upper"] for o in objs)
    assert f"evaluation env from {model / 'eval_env.json'}" in got.err and "recorded nowhere" in got.err
    assert len((run / "ladder" / "games.jsonl").read_text().splitlines()) == len(games)
    assert ladder.main(["eval", "--a", str(model), "--b", "scripted:noop", "--master-seed", "5",
                        "--seeds", "2"]) == 0
    got = capsys.readouterr().out
    assert f"{v0} vs scripted:noop: score " in got and "over 2 seeds (4 battles)" in got, got
    assert "played 4 battles" in got and "on master seed 5's seed set; recorded nowhere" in got, got
    assert len((run / "ladder" / "games.jsonl").read_text().splitlines()) == len(games)
    code, out, err = run_main("play", "--blue", str(model), "--red", "scripted:noop", "--every", "1000")
    assert code == 0, err[-3000:]
    assert f"play: blue {v0} vs red scripted:noop" in out and "result: " in out


@pytest.mark.slow
def test_learn_trains_and_measures_the_fork_its_script_names(tmp_path):
    """`checks.py learn --script ppo_myidea.py` trains the fork beside it, not ppo_clash.py: a copy
    with one line of the head changed (a hidden layer before the no-op logit), in a checkout of its
    own. The run's folder is named after the fork, its identity hashes the fork's file, its
    checkpoint holds the fork's network, the yardstick plays the fork's snapshots and the record
    names the fork. A --script that is not beside checks.py is one line, exit 2, before training."""
    for lib in ("codec.py", "farm.py", "ladder.py", "ppo_clash.py", "checks.py"):
        shutil.copy(checks.ROOT / lib, tmp_path / lib)
    src = (checks.ROOT / "ppo_clash.py").read_text()
    old = "        self.noop = nn.Linear(2 * C, 1)\n"
    assert src.count(old) == 1, "the fork's anchor line moved"
    (tmp_path / "ppo_myidea.py").write_text(src.replace(old, "        self.noop = nn.Sequential("
                                            "nn.Linear(2 * C, 2 * C), nn.ReLU(), nn.Linear(2 * C, 1))\n"))
    learn = [sys.executable, "checks.py", "learn", "--profile", "smoke", "--game-steps", "172",
             "--seeds", "1", "--runs-dir", "runs", "--quiet"]
    bad = subprocess.run(learn + ["--script", "ppo_nope.py"], cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode == 2 and not (tmp_path / "runs").exists(), bad.stderr[-2000:]
    assert bad.stderr.startswith("checks.py learn: --script ppo_nope.py: not a .py file beside checks.py")
    done = subprocess.run(learn + ["--script", "ppo_myidea.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("ppo_myidea-learn-smoke-")
    assert sorted(json.loads((run / "identity.json").read_bytes())["user_code"]) == \
        ["codec.py", "farm.py", "ladder.py", "ppo_myidea.py"]
    arch = json.loads((P.latest_checkpoint(run) / "actor_critic" / "arch.json").read_bytes())
    assert "policy.noop.2 Linear" in arch["modules"]
    v0 = json.loads((run / "ladder" / "pool.json").read_text())["v0"].removeprefix("snap:")
    spec = json.loads((run / "ladder" / "snapshots" / v0 / "spec.json").read_bytes())
    assert spec["builder"] == "ppo_myidea.py"
    assert "ppo_myidea.py --profile smoke, master seed the profile default" in done.stdout
    table = [x for x in done.stdout.splitlines() if x.startswith("| scripted:")]
    assert [x.split()[1] for x in table] == [f"scripted:{n}" for n in farm.SCRIPTED_NAMES]


@pytest.mark.slow
def test_learn_counts_the_warm_start_s_battles_in_its_budget(tmp_path):
    """A warm start and PPO from it spend --game-steps together (issue 36, 47): learn gives the run
    the budget as its game_step_limit, and the run stops at the first iteration boundary where the
    warm start's game-steps (warm.json) and the iterations' reach it."""
    cmd = checks.Learn(profile="smoke", game_steps=900, runs_dir=str(tmp_path))
    args = checks.learn_args(cmd)
    assert args.game_step_limit == 900 and P.parse_args(["--profile", "smoke"]).game_step_limit == 0
    args.warm.rung, args.warm.battles, args.obs.max_steps = "scripted:defend", 1, 60
    run = P.train(args, quiet=True)
    warm = P.warm_game_steps(run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    per = rows[0]["run/cumulative_env_steps"]
    assert warm == json.loads((run / "warm.json").read_text())["game_steps"] == 60
    assert len(rows) == -(-(900 - warm) // per) and warm + rows[-1]["run/cumulative_env_steps"] >= 900 > \
        warm + rows[-2]["run/cumulative_env_steps"]
    assert P.over_budget(args, type("L", (), {"warm_steps": warm, "env_steps": 900 - warm})())


# --- export ------------------------------------------------------------------------------------------

GATE_AT_ONCE = ["--ladder.candidate-every-env-steps", "100", "--ladder.gate.champion-games", "4",
                "--ladder.gate.anchor-games", "2", "--ladder.gate.bootstrap-resamples", "50"]


@pytest.mark.slow
def test_export_writes_a_checkpoints_actor_as_the_gate_writes_its_candidate(tmp_path):
    """The final checkpoint of a run whose one iteration gated a candidate: export's folder is that
    candidate's snapshot byte for byte (so the same id, and no new snapshot in the archive), with the
    run's evaluation env beside it; a folder that is not empty, and a directory that is not a
    checkpoint, are one line and exit 2."""
    run = P.train(P.parse_args(["--profile", "smoke", "--runs-dir", str(tmp_path / "runs"), *GATE_AT_ONCE]),
                  quiet=True, max_iterations=1)
    snaps = run / "ladder" / "snapshots"
    held = sorted(p.name for p in snaps.iterdir())
    assert len(held) == 2                                      # v0 and the candidate
    ckpt = P.latest_checkpoint(run)
    code, out, err = run_main("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "m"))
    assert code == 0, err
    m = tmp_path / "m"
    sid = hashlib.sha256((m / "spec.json").read_bytes()).hexdigest()[:16]
    assert sid in held and sorted(p.name for p in snaps.iterdir()) == held
    step = json.loads((m / "spec.json").read_bytes())["step"]
    assert step == P.read_manifest(ckpt).cumulative_env_steps > 0         # the candidate, not v0
    assert (m / "actor.safetensors").read_bytes() == (snaps / sid / "actor.safetensors").read_bytes()
    assert sorted(p.name for p in m.iterdir()) == ["actor.safetensors", "eval_env.json", "spec.json"]
    assert out.startswith(f"snap:{sid}: ")
    code, _, err = run_main("export", "--checkpoint", str(ckpt), "--out", str(m))
    assert code == 2 and "exists and is not an empty folder" in err
    code, _, err = run_main("export", "--checkpoint", str(run), "--out", str(tmp_path / "n"))
    assert code == 2 and "no manifest.json there" in err


# --- the README's commands (issue 49) --------------------------------------------------------------

def readme_commands() -> list[list[str]]:
    """Every command line of the README's bash blocks, split as a shell splits it (comments off, a
    `&&` chain into its commands), its placeholders (<dir>, <step>, ...) given a name."""
    import shlex
    text = (checks.ROOT / "README.md").read_text()
    lines = [x for b in re.findall(r"```bash\n(.*?)```", text, re.S) for x in b.splitlines()]
    cmds: list[list[str]] = []
    for line in lines:
        words = shlex.split(re.sub(r"<(\w+)>", r"x\1", line), comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            cmds.append(words[:cut])
            words = words[cut + 1:]
    return cmds


def test_every_command_in_the_readme_parses_as_its_script_parses_it():
    """A newcomer copies the README's commands, so each must be one its script accepts: make's
    targets exist, a script's flags parse as its own main parses them (ppo_clash.py's profile,
    config and field flags; ladder.py's and checks.py's subcommands), a module imports. The README
    stays short (at most 130 lines), and its python snippet compiles and reads a shipped folder."""
    import importlib.util

    import tyro

    import ladder
    text = (checks.ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 130
    targets = set(re.findall(r"^([\w.-]+):", (checks.ROOT / "Makefile").read_text(), re.M))
    cmds = readme_commands()
    assert len(cmds) >= 20 and {c[1] for c in cmds if c[0] == "python"} >= \
        {"ppo_clash.py", "ladder.py", "checks.py", "-m"}
    for cmd in cmds:
        if cmd[0] == "make":
            assert cmd[1] in targets, cmd
            continue
        assert cmd[0] == "python", cmd
        if cmd[1] == "-m":
            assert importlib.util.find_spec(cmd[2]) is not None, cmd
        elif cmd[1] == "ppo_clash.py":   # main's own flags, then the rest as parse_args reads it
            rest = [w for prev, w in zip(cmd[1:], cmd[2:], strict=False) if "--resume" not in (prev, w)]
            P.parse_args(rest)
        else:
            commands = {"ladder.py": ladder.COMMANDS, "checks.py": checks.COMMANDS}[cmd[1]]
            with contextlib.redirect_stdout(io.StringIO()):
                tyro.cli(Union[tuple(commands)], args=cmd[2:], config=ladder.TYRO_CONFIG)   # type: ignore[arg-type]
    (snippet,) = re.findall(r"```python\n(.*?)```", text, re.S)
    compile(snippet, "README.md", "exec")
    for folder in re.findall(r'"(models/[\w/.-]+?)(?:/eval_env\.json)?"', snippet):
        assert (checks.ROOT / folder).exists(), folder


def attribute_docstrings(source: str) -> dict[tuple[str, str], str]:
    """(class, field) -> the string written on the line after the field, as Python documents it."""
    out = {}
    for cls in (n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)):
        for a, b in itertools.pairwise(cls.body):
            if (isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)):
                out[(cls.name, a.target.id)] = b.value.value
    return out


def test_every_flag_s_help_is_its_field_s_docstring(capsys):
    """ladder.TYRO_CONFIG turns tyro's help read from comments off in every script (it parsed the
    whole file once a class, docs/throughput.md), so a field documented by a comment would show no
    help: every field of ppo_clash's Args tree (the groups aside) and of every ladder.py and
    checks.py command carries a docstring, and ppo_clash.py --help prints each of Args'."""
    import ladder
    with pytest.raises(SystemExit):
        P.parse_args(["--help"])
    shown = " ".join(re.sub("[│╭╮╰╯─]", " ", capsys.readouterr().out).split())
    docs = {m.__name__: attribute_docstrings(Path(m.__file__).read_text()) for m in (P, ladder, checks)}
    for path in P.field_paths():
        if path in P.CONFIG_FILE_ONLY:
            continue
        *head, leaf = path.split(".")
        owner: Any = P.Args
        for part in head:
            owner = P._hints(owner)[part]
        doc = docs["ppo_clash"].get((owner.__name__, leaf))
        assert doc is not None, f"{owner.__name__}.{leaf} ({path}) has no docstring: --help shows none"
        assert " ".join(doc.split()[:8]) in shown, path
    for module, commands in (("ladder", ladder.COMMANDS), ("checks", checks.COMMANDS)):
        for cmd in commands:
            for f in dataclasses.fields(cmd):   # a field of a base class is documented there
                assert any((c.__name__, f.name) in docs[module] for c in cmd.__mro__), \
                    f"{module}.py {cmd.__name__}.{f.name}"
