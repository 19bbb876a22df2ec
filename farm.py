"""farm.py -- experience collection: seeding, the environment description, the potential reward,
scripted opponents, the shared-memory byte layout, the worker loop, ProcessFarm and InlineFarm.

Stage owned: everything between "the learner has actions" and "the learner has the next packed
observations". K worker processes each own `shards_per_worker` ClashSelfPlayVecEnvs (design 1.1);
a worker steps one shard, packs every slot's observation with codec.Packer straight into the
shared-memory rectangle (design 3.3), writes that round's scalars into its own control segment
and releases a semaphore. InlineFarm runs the same ShardRunner code in one process and is the
reference: ProcessFarm must match it byte for byte (tests/test_farm.py, design 3.4).

Reads:  an EnvFactorySpec (JSON), a codec.CodecTable, a master seed. Writes: nothing on disk.
Never imports torch (design 3.2; tests/test_farm.py asserts it inside a worker).

Where to start reading: the API below; then section 9, ShardRunner.step (one STEP, in the
worker), and section 10, _FarmCore.next_round and submit (the same round, from the parent);
section 7 is the byte layout between the two. Sections 1-6 are what both sides share: seeding,
assignments, the env description, the reward, the scripted players and the evaluation mode.

Design sections (docs/design.md): 3.1 (EnvSpec, Assignment, SlotPlan, EpisodeRecord,
WorkerFailure), 2.2 (seeding), 2.3 (env value digest, engine binary), 3.2 (process model), 3.4
(byte layout), 3.5 (worker loop), 3.6 (round protocol), 3.7 (failure, timeouts, restart), 3.8
steps 1-3 and 11 (what the farm reads off the env), 4 (potential reward), 1.1 "transition
alignment" (each transition's reward, flags and final observation on the row of its action).

THE API THE LEARNER DRIVES (InlineFarm and ProcessFarm take the same arguments and behave the
same; ProcessFarm additionally takes env_spec= to refuse a worker on other spaces or binary):

    env_spec, table = preflight(env_factory_spec, frame_stack=k, master_seed=s)
    farm = ProcessFarm(FarmConfig(env=env_factory_spec, master_seed=s, workers=K,
                                  shards_per_worker=S, games_per_worker=M, cycles=T,
                                  frame_stack=k, start_ordinals=<from a checkpoint or None>),
                       table, assign_fn, env_spec=env_spec)
    farm.rect        uint8 (T + k, R, row_bytes), shared memory. Cycle t's observation of slot r
                     is rect[t + k - 1, r]; rows 0..k-2 are the previous iteration's last frames
                     (begin_iteration copies rows T..T+k-1 to 0..k-1, so cycle T becomes cycle 0)
    farm.first_obs   bool (T + k, R), aligned with rect: that row starts an episode. Frame
                     q - i of the observation at row q is live iff none of rows q-i+1..q does
    farm.scalars     SCALAR_DTYPE (T, R). Row t holds what the ACTION at cycle t caused: reward,
                     flags (F_TERMINATED, F_TRUNCATED, F_VALID, F_FINAL), deploy_status, tick,
                     episode_end (0 none, 1 win, 2 loss, 3 draw, 4 ended with no winner),
                     episode_steps, cards_played, elixir_leak, and the group that acted. This is
                     the transition alignment (design 1.1): the learner reads row t's
                     reward and done flags as the transition out of row t, as GAE expects.
    farm.finals      {(t, r): uint8[row_bytes]}: the packed final observation of each truncated
                     transition, at the row of the action that caused it (for the bootstrap)
    farm.episodes    EpisodeRecords finished this iteration, in round order
    farm.ordinals    int64 (n_battles,): reset ordinal of the episode each battle is playing;
                     checkpoint it, restore through FarmConfig.start_ordinals
    farm.assignment  the Assignment each battle is playing; farm.generation, farm.restarts
                     (checkpoint the generations, restore through FarmConfig.start_generations)
    farm.in_flight() [InFlight]: each battle mid-episode, its actions and gammas so far; checkpoint
                     it, restore through FarmConfig.start_in_flight: the first PLAN re-simulates
                     those battles to where they stood (design 3.9)

    for each iteration i:
        farm.begin_iteration(plan)           # SlotPlan. Iteration 0: the opening table. Later:
                                             # must equal farm.assignment (design 3.6), else raises.
                                             # Writes the plan area (farm.plan_table(), PLAN_DTYPE
                                             # per slot) and sends every shard PLAN; returns once
                                             # each worker applied it (design 3.4, 3.5)
        for cycle t in 0..T, for shard j in 0..J-1 (this order; J = K * S):
            rnd = farm.next_round(timeout_s) # RolloutRound, see the class
            if t < T:
                farm.submit(actions, gamma)  # actions for rnd.slots (scripted seats ignored,
                                             # the worker fills them); gamma = the schedule's
    rnd.cycle, rnd.shard, rnd.slots (int32, ascending), rnd.obs_rows, rnd.group (routing, new
    assignments folded in), rnd.new_episode, rnd.row (= cycle - 1, the row the scalars below
    belong to; -1 at cycle 0), rnd.reward/terminated/truncated/valid/deploy_status/tick/
    episode_end (views of farm.scalars[rnd.row, rnd.slots]), rnd.episodes, rnd.ended_battles,
    rnd.timings["env_ms"].
    farm.drain_failures() -> [WorkerFailure]   # a dead worker's slots arrive valid=False,
    farm.restart(w)                            # group -3; restart rejoins at begin_iteration
    farm.check_workers()                       # between iterations: a process that ended is a
                                               # failure now (drain it, restart it); a training
                                               # farm's hang is one too (kind "timeout")
    farm.close()                               # idempotent, registered atexit
    farm.spaces(w) -> dict                     # SPACES: worker w re-reads its spaces and engine
                                               # binary without stepping (the handshake report);
                                               # between iterations; refused on a mismatch
    farm.stats (or farm.stats())               # this iteration's env_ms, wait_ms, codec_ms,
                                               # parent_wait_frac, bytes_out,
                                               # rows_dropped_dead_worker; run totals
                                               # worker_restarts, obs_codec_clipped/_rounded

THE EVALUATION MODE (design 7.5, 7.1; ladder.EvalRunner drives it). FarmConfig(eval_plan=[EvalEpisode
(seed, seed_path, players=(blue, red), streams=(blue, red)), ...]) and assign_fn=None: episode i
joins the queue of shard i % J, and each battle plays the next one of its shard's queue at every
reset (section 6), reset with the episode's own seed; "scripted:<name>" seats are
played in the worker from derive_generator(master_seed, streams[seat]) (two different scripted
players on one battle are fine), every other seat has group -1 and is acted by the parent; a
battle whose episodes are done stops (GROUP_IDLE, no records) and farm.eval_done turns True.
    farm.begin_iteration(farm.eval_slot_plan(i)); farm.eval_index -> plan index per battle (-1 idle)
    unpack_numpy(table, rows, statics, seats, env_spec.obs_space) -> the env's observation keys
    make_scripted(name) -> a royalegym opponent (SCRIPTED_NAMES)
FarmConfig(scripted_mask_only=True), the default, builds a training scripted seat's observations mask-only
(royalegym set_mask_only) from the one after its assignment arrives: the learner's rows, the
scalars and the records are unchanged (tested); bench_mask_only() measures what it saves.

The assignment protocol (design 3.6): assign_fn(battle, ordinal) -> Assignment is called by the
parent inside next_round for every battle whose episode ended on that round (ascending battle
order), its groups are folded into rnd.group, and the worker is told on that round's submit (the
STEP's assign entries); the iteration's opening table reaches it by PLAN at begin_iteration
(which also carries an assignment drawn on the previous iteration's last round, cycle T, which
has no submit). The byte layout a worker in another language implements: section 7.
Without an assign_fn the caller passes submit(actions, gamma, assignments=[...]) with exactly one
Assignment (ordinal = farm.ordinals[b]) per battle in rnd.ended_battles. The worker never draws.

bench_farm(...) -> dict measures the farm against the direct loop; `python farm.py mask-only`
runs bench_mask_only(), `python farm.py replay` bench_replay() (a resume's re-simulation).
Their numbers, dated, are in docs/throughput.md.
"""
from __future__ import annotations

import atexit
import collections
import hashlib
import importlib
import inspect
import json
import math
import os
import re
import signal
import struct
import sys
import threading
import time
import traceback
from fractions import Fraction
from typing import Any, Callable

import msgspec
import numpy as np

import codec

# --- 1. Name-addressed seeding (design 2.2) -------------------------------------------------------
# Every random stream is addressed by a path string, never by spawn order (design 2.2): adding a
# new consumer of randomness cannot perturb an existing stream. The three functions are exactly
# design 2.2's; tests/test_farm.py pins their values so a change is deliberate.

def derive_seedseq(master_seed: int, path: str) -> np.random.SeedSequence:
    digest = hashlib.blake2b(path.encode("utf-8"), digest_size=16).digest()
    return np.random.SeedSequence(entropy=master_seed, spawn_key=struct.unpack("<4I", digest))


def derive_generator(master_seed: int, path: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(derive_seedseq(master_seed, path)))


def derive_int(master_seed: int, path: str) -> int:
    """A reproducible 63-bit integer, for env seeds."""
    w = derive_seedseq(master_seed, path).generate_state(2, dtype=np.uint32).astype(np.uint64)
    return int((w[0] | (w[1] << np.uint64(32))) >> np.uint64(1))


# --- 2. Assignments (design 3.1) ------------------------------------------------------------------

ROLE_MIRROR, ROLE_POOL, ROLE_SCRIPTED = 0, 1, 2
GROUP_LEARNER, GROUP_SCRIPTED, GROUP_DEAD = -1, -2, -3


class Assignment(msgspec.Struct, frozen=True):
    """What one battle's next episode is. Drawn by the matchmaker at the battle's own episode
    boundary, from match/battle/{b}/ordinal/{k}: a pure function of the master seed, the battle
    index and the reset ordinal."""
    battle: int
    ordinal: int                            # reset ordinal this assignment takes effect on
    role: int                               # 0 mirror, 1 pool, 2 scripted
    opponent_id: str | None                 # "snap:<id>", "seed:<name>", "scripted:<name>", None: mirror
    group: tuple[int, int]                  # per seat: -1 learner, 0..P-1 resident snapshot,
                                            #           -2 scripted (worker-side), -3 dead
    learner_seat: int                       # 0 blue, 1 red; -1 for mirror (both)


class SlotPlan(msgspec.Struct, frozen=True):
    """The iteration's opening assignment table: what every battle plays at the moment the
    iteration begins. Assignments change only at a battle's own episode boundary."""
    iteration: int
    n_battles: int
    n_slots: int                            # 2 * n_battles
    assignment: tuple[Assignment, ...]      # one per battle, in battle order
    resident_snapshots: tuple[str, ...]     # the snapshots group ids 0.. index (the farm names a seat by
                                            # its assignment's opponent_id; the loop acts by this table)


class InFlight(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One battle's running episode as the parent drove it (design 3.9): its reset ordinal and,
    per decision so far, the action the parent submitted for each seat (a scripted seat's is
    ignored: on replay its player acts again, from the same generator, on the same observation)
    and the gamma that step was taken under (the potential reward reads it). A checkpoint stores
    one per battle that is mid-episode; a resume re-simulates each from its reset to where it
    stood. The engine is deterministic, so the state it reaches is the state that was left."""
    battle: int
    ordinal: int
    actions: list[tuple[int, int]]          # (blue, red) per decision, in order
    gammas: list[float]                     # one per decision


# --- 3. The environment description (design 1.3 EnvFactorySpec, 2.3 env value digest) -------------
# An EnvFactorySpec is data that arrives from a config file and later from a checkpoint;
# importlib on an arbitrary string is a code-execution surface, so only allow-listed modules may
# be named.

PROJECT_MODULES = ("farm", "codec", "ladder", "ppo_clash", "checks")


class ComponentSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One env component: a dotted class (or factory function) path and JSON kwargs. A kwarg
    value that is itself {"cls": ..., "kwargs": {...}} is built as a nested component (that is
    how Reveal(enemy_spell_aim=True) reaches SpatialObsBuilder)."""
    cls: str
    kwargs: dict[str, Any] = {}


class EnvFactorySpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The JSON-able environment: sent to workers, recorded in checkpoints, hashed by value."""
    engine: ComponentSpec
    obs_builder: ComponentSpec
    action_parser: ComponentSpec
    reward_fn: ComponentSpec
    state_mutator: ComponentSpec
    termination: list[ComponentSpec]
    truncation: list[ComponentSpec] = []
    decision_ms: int = 500
    extra_component_modules: list[str] = []   # allow-list additions; not part of the value digest

    def digest(self) -> str:
        """sha256 of the spelling (display only; identity uses env_value_digest)."""
        return hashlib.sha256(msgspec.json.encode(self, order="deterministic")).hexdigest()


def _allowed(path: str, extra: list[str] | tuple[str, ...]) -> bool:
    mod = path.rsplit(".", 1)[0]
    if mod == "royalegym" or mod.startswith("royalegym."):
        return True
    return any(mod == m or mod.startswith(m + ".") for m in (*PROJECT_MODULES, *extra))


def resolve_class(path: str, extra: list[str] | tuple[str, ...] = ()) -> Any:
    """The class (or factory) a ComponentSpec names, if the allow-list admits it."""
    if not _allowed(path, extra):
        raise ValueError(
            f"component {path!r} is not on the allow-list (royalegym.*, {', '.join(PROJECT_MODULES)}"
            f"{', ' + ', '.join(extra) if extra else ''}); add its module to "
            "EnvFactorySpec.extra_component_modules if you mean it")
    mod, name = path.rsplit(".", 1)
    try:
        obj = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"component {path!r} does not import: {exc}") from exc
    return obj


def _is_component(v: Any) -> bool:
    return isinstance(v, dict) and "cls" in v and set(v) <= {"cls", "kwargs"}


def _build_kwargs(kwargs: dict[str, Any], extra) -> dict[str, Any]:
    out = {}
    for k, v in kwargs.items():
        if _is_component(v):
            out[k] = resolve_class(v["cls"], extra)(**_build_kwargs(v.get("kwargs", {}), extra))
        else:
            out[k] = v
    return out


def _factory_entry(c: ComponentSpec, extra) -> tuple[Any, dict[str, Any]]:
    return resolve_class(c.cls, extra), _build_kwargs(c.kwargs, extra)


def _ask_the_engine_once() -> None:
    """royalegym's RustEngine asks the compiled engine where its card table comes from at every
    construction, and the engine takes about 0.08 s to answer, a third of a construction's
    cost [M: docs/throughput.md, "Building an engine"]. The answer ("embedded", or the file
    it was built to read) is fixed once the extension is loaded, so from this module's import on
    a process asks once, however many battles it builds."""
    import functools

    import royalesim
    ask = getattr(royalesim, "card_table_source", None)   # an older build has no such question
    if callable(ask) and not hasattr(ask, "cache_info"):
        royalesim.card_table_source = functools.cache(ask)


_ask_the_engine_once()

# Engines an in-process farm handed back when it closed (InlineFarm._stop_worker), by engine spec,
# for the next farm of this process. A RustEngine costs about 0.2 s to build, royalegym's checks
# of its data [M: docs/throughput.md, "Spare engines"], and reset() starts its battle from nothing
# (its seed and setup; no state of an earlier battle survives it), which every farm already relies
# on when a battle's engine plays its next episode: the bytes of an episode do not depend on what
# its engine played before (test_a_farm_s_battles_reuse_the_engines_a_closed_farm_handed_back).
# Only farms hand back and take, so a process keeps no more engines than its largest farm had (an
# engine is about 5 MB [M]); every other env (the preflight, so the start-up gates and the doctor,
# a warm start's battles) builds its own and frees it, and a failed worker's engines are dropped.
_SPARE_ENGINES: dict[bytes, list[Any]] = {}


def _engine_key(spec: EnvFactorySpec) -> bytes:
    return msgspec.json.encode([spec.engine, spec.extra_component_modules], order="deterministic")


def spare_or_new_engine(key: bytes, cls: Any, **kwargs: Any) -> Any:
    """A farm battle's engine (env_factory with spare_engines): a spare handed back under the
    same engine spec, else a new one."""
    spare = _SPARE_ENGINES.get(key)
    return spare.pop() if spare else cls(**kwargs)


def close_vec(vec: Any, spec: EnvFactorySpec) -> None:
    """Close a farm shard's vec env (build_vec(spec, ..., spare_engines=True)) and hand its engines
    back for this process's next farm. Closing twice hands back nothing twice (two battles on one
    engine would share it)."""
    if vec.closed:
        return
    vec.close()
    _SPARE_ENGINES.setdefault(_engine_key(spec), []).extend(e.engine for e in vec.envs)


def env_factory(spec: EnvFactorySpec, *, spare_engines: bool = False) -> Any:
    """The spec as royalegym's picklable EnvFactory recipe (one place assembles an env); with
    spare_engines, its engines are spares this process was handed back where it has them."""
    import functools

    from royalegym.done_condition import AnyCondition
    from royalegym.env import EnvFactory
    x = spec.extra_component_modules
    engine, engine_kw = _factory_entry(spec.engine, x)
    if spare_engines:
        engine = functools.partial(spare_or_new_engine, _engine_key(spec), engine)
    parts: dict[str, Any] = {
        "engine": (engine, engine_kw),
        "obs_builder": _factory_entry(spec.obs_builder, x),
        "action_parser": _factory_entry(spec.action_parser, x),
        "reward_fn": _factory_entry(spec.reward_fn, x),
        "state_mutator": _factory_entry(spec.state_mutator, x),
    }
    for key, conds in (("termination_cond", spec.termination), ("truncation_cond", spec.truncation)):
        if len(conds) == 1:
            parts[key] = _factory_entry(conds[0], x)
        elif len(conds) > 1:
            # AnyCondition takes built conditions; they pickle (plain classes), so EnvFactory's
            # check still passes.
            built = [cls(**kw) for cls, kw in (_factory_entry(c, x) for c in conds)]
            parts[key] = (AnyCondition, {"conditions": built})
    return EnvFactory(**parts, decision_ms=spec.decision_ms)


def build_vec(spec: EnvFactorySpec, num_games: int, *, viser: Any = None,
              autoreset_seed_fn: Callable[[int, int], int] | None = None, spare_engines: bool = False) -> Any:
    """The vec env every worker, replay and play steps: each battle's env carries a
    TrajectoryDigest from before its first reset (a record's trajectory_digest). A farm's shards
    build theirs with spare_engines, and close them with close_vec."""
    from royalegym.env import ClashSelfPlayVecEnv
    vec = ClashSelfPlayVecEnv(num_games, env_factory(spec, spare_engines=spare_engines), viser=viser,
                              autoreset_seed_fn=autoreset_seed_fn)
    for e in vec.envs:
        e.recorder = TrajectoryDigest()
    return vec


def _value(v: Any, extra) -> Any:
    """A kwarg value as the identity sees it: numbers as floats, a bool stays a bool, a nested
    component by value, any other object through msgspec.to_builtins or by its type name."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, (int, float, np.integer, np.floating)):
        return float(v)
    if _is_component(v):
        return _component_value(ComponentSpec(v["cls"], v.get("kwargs", {})), extra)
    if isinstance(v, (list, tuple)):
        return [_value(e, extra) for e in v]
    if isinstance(v, dict):
        return {str(k): _value(e, extra) for k, e in v.items()}
    try:
        return _value(msgspec.to_builtins(v), extra)
    except (TypeError, msgspec.EncodeError):
        return f"<{type(v).__module__}.{type(v).__qualname__}>"


def _component_value(c: ComponentSpec, extra) -> dict[str, Any]:
    obj = resolve_class(c.cls, extra)
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            bound = sig.bind(**c.kwargs)
        except TypeError as exc:
            raise ValueError(f"component {c.cls}: kwargs {sorted(c.kwargs)} do not fit its "
                             f"signature {sig}: {exc}") from exc
        bound.apply_defaults()
        kw = dict(bound.arguments)
    else:
        kw = dict(c.kwargs)
    return {"cls": c.cls, "kwargs": {k: _value(v, extra) for k, v in sorted(kw.items())}}


def env_value_digest(spec: EnvFactorySpec) -> str:
    """sha256 over each component's kwargs bound to its real signature, defaults applied,
    numbers as floats (design 2.3): {} and the defaults written out hash alike, 1 and 1.0 too."""
    x = spec.extra_component_modules
    doc = {
        "engine": _component_value(spec.engine, x),
        "obs_builder": _component_value(spec.obs_builder, x),
        "action_parser": _component_value(spec.action_parser, x),
        "reward_fn": _component_value(spec.reward_fn, x),
        "state_mutator": _component_value(spec.state_mutator, x),
        "termination": [_component_value(c, x) for c in spec.termination],
        "truncation": [_component_value(c, x) for c in spec.truncation],
        "decision_ms": float(spec.decision_ms),
    }
    return hashlib.sha256(msgspec.json.encode(doc, order="deterministic")).hexdigest()


def default_env_spec(*, reveal_spell_aim: bool = False, max_steps: int | None = None,
                     reward: ComponentSpec | None = None) -> EnvFactorySpec:
    """RustEngine, SpatialObsBuilder, TileActionParser, the potential reward, a full battle
    (plus a StepLimit truncation when max_steps is given: how tests keep episodes short)."""
    ob_kwargs: dict[str, Any] = {}
    if reveal_spell_aim:
        ob_kwargs["reveal"] = {"cls": "royalegym.obs.Reveal", "kwargs": {"enemy_spell_aim": True}}
    trunc = [] if max_steps is None else [
        ComponentSpec("royalegym.done_condition.StepLimitCondition", {"max_steps": max_steps})]
    return EnvFactorySpec(
        engine=ComponentSpec("royalegym.rust_engine.RustEngine"),
        obs_builder=ComponentSpec("royalegym.obs.SpatialObsBuilder", ob_kwargs),
        action_parser=ComponentSpec("royalegym.action.TileActionParser"),
        reward_fn=reward or ComponentSpec("farm.default_potential_reward"),
        state_mutator=ComponentSpec("royalegym.state_mutator.DefaultStateMutator"),
        termination=[ComponentSpec("royalegym.done_condition.GameOverCondition")],
        truncation=trunc,
    )


# --- 4. EnvSpec, read off a built and reset env (design 3.1, 3.8 steps 1-3) -----------------------

class ObsKeySpec(msgspec.Struct, frozen=True):
    shape: tuple[int, ...]
    dtype: str
    low: tuple[float, ...]                  # per channel for a 3-D key, length 1 otherwise
    high: tuple[float, ...]


class EnvSpec(msgspec.Struct, frozen=True):
    num_cards: int
    obs_space: dict[str, ObsKeySpec]
    vector_layout: tuple[tuple[str, int, int], ...]   # (name, offset, size)
    spatial_layout: tuple[tuple[str, bool], ...]      # (name, static)
    frame_stack: int
    vector_size: int
    spatial_shape: tuple[int, int, int]
    n_actions: int
    hand_size: int
    tiles: tuple[int, int]                  # (tiles_y, tiles_x)
    decision_ms: int
    tick_ms: int
    decision_ticks: int
    regular_ticks: int
    overtime_ticks: int
    engine_build_digest: str
    engine_binary: str                      # config()["engine"]["params"]["engine_binary_sha256"]
    calibration_digest: str
    config_digest: str                      # sha256 of ClashParallelEnv.config(), canonical JSON
    obs_digest: str
    env_value_digest: str
    env_factory: EnvFactorySpec


def _key_spec(space: Any) -> ObsKeySpec:
    low, high = np.asarray(space.low, dtype=np.float64), np.asarray(space.high, dtype=np.float64)
    if low.ndim == 3:
        lo = tuple(float(low[c].min()) for c in range(low.shape[0]))
        hi = tuple(float(high[c].max()) for c in range(high.shape[0]))
    else:
        lo, hi = (float(low.min()),), (float(high.max()),)
    return ObsKeySpec(tuple(int(d) for d in space.shape), np.dtype(space.dtype).name, lo, hi)


def engine_binary(config: dict[str, Any]) -> str:
    """design 2.3's one rule: the binary hash the engine states in its own config, else
    "not stated" (an engine with no compiled file)."""
    params = ((config.get("engine") or {}).get("params") or {})
    return str(params.get("engine_binary_sha256", "not stated"))


def spaces_signature(obs_space: Any, n_actions: int) -> str:
    """sha256 over every observation key's shape, dtype and bounds and the action count: what a
    worker's handshake must agree on with the parent (design 3.8)."""
    return _sig_from_keyspecs({k: _key_spec(s) for k, s in obs_space.spaces.items()}, n_actions)


def _sig_from_keyspecs(obs_space: dict[str, ObsKeySpec], n_actions: int) -> str:
    doc = {k: msgspec.to_builtins(v) for k, v in obs_space.items()}
    doc["__n_actions__"] = int(n_actions)
    return hashlib.sha256(msgspec.json.encode(doc, order="deterministic")).hexdigest()


def handshake_problems(report: dict[str, Any], expect: "EnvSpec") -> list[str]:
    """Where a worker's handshake (or SPACES answer) disagrees with the parent's EnvSpec: its
    spaces' signature and its engine binary (design 3.5)."""
    problems = []
    got, want = report["spaces"], _sig_from_keyspecs(expect.obs_space, expect.n_actions)
    if got != want:
        problems.append(f"observation/action spaces {got[:16]} != parent's {want[:16]}")
    if report["engine_binary"] != expect.engine_binary:
        problems.append(f"engine binary {report['engine_binary']} != the identity's "
                        f"{expect.engine_binary} (was the engine rebuilt?)")
    return problems


def read_env_spec(spec: EnvFactorySpec, env: Any, frame_stack: int) -> EnvSpec:
    """Every field read from `env`, a ClashParallelEnv that has been reset (a fresh env reports
    decision_ticks = 1 until its first reset, design 3.8 step 1)."""
    if env.battle_state is None:
        raise ValueError("read_env_spec needs an env that has been reset")
    space = env.observation_space("blue")
    obs_space = {k: _key_spec(s) for k, s in space.spaces.items()}
    if "spatial" not in obs_space or "vector" not in obs_space:
        raise ValueError(f"the observation space has keys {sorted(obs_space)}; the farm needs "
                         "'spatial' and 'vector' (a SpatialObsBuilder)")
    ob = env.obs_builder
    vl, off = [], 0
    for f in ob.vector_layout():
        vl.append((f.key, off, int(f.size)))
        off += int(f.size)
    if off != obs_space["vector"].shape[0]:
        raise ValueError(f"vector_layout sums to {off} but the vector key is "
                         f"{obs_space['vector'].shape[0]} wide")
    sl = tuple((str(n), bool(s)) for n, s in ob.spatial_layout())
    cfg = env.config()
    state = env.battle_state
    cal = env.calibration
    tick_ms = int(state.tick_ms)
    arena = env.engine.arena()
    n_actions = int(env.action_space("blue").n)
    mp = obs_space.get("mask_planes")
    from royalegym.protocol import HAND_SIZE
    hand = int(mp.shape[0]) if mp is not None else int(HAND_SIZE)
    ob_comp = msgspec.to_builtins(spec.obs_builder)
    num_cards = len(env.engine.cards())
    obs_doc = {"obs_space": msgspec.to_builtins(obs_space), "vector_layout": vl,
               "spatial_layout": sl, "frame_stack": frame_stack, "n_actions": n_actions,
               "num_cards": num_cards, "obs_builder": ob_comp,
               "obs_builder_config": cfg.get("obs_builder")}
    obs_digest = hashlib.sha256(msgspec.json.encode(obs_doc, order="deterministic")).hexdigest()
    sp = obs_space["spatial"].shape
    return EnvSpec(
        num_cards=num_cards, obs_space=obs_space, vector_layout=tuple(vl), spatial_layout=sl,
        frame_stack=int(frame_stack), vector_size=obs_space["vector"].shape[0],
        spatial_shape=(sp[0], sp[1], sp[2]), n_actions=n_actions, hand_size=hand,
        tiles=(int(arena.tiles_y), int(arena.tiles_x)), decision_ms=int(cfg["decision_ms"]),
        tick_ms=tick_ms, decision_ticks=int(cfg["decision_ticks"]),
        regular_ticks=-(-cal.int("match.REGULAR_TIME_S") * 1000 // tick_ms),
        overtime_ticks=-(-cal.int("match.OVERTIME_S") * 1000 // tick_ms),
        engine_build_digest=str(cfg.get("build_digest")), engine_binary=engine_binary(cfg),
        calibration_digest=str(cfg.get("calibration_digest")),
        config_digest=hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest(),
        obs_digest=obs_digest, env_value_digest=env_value_digest(spec), env_factory=spec)


def preflight(spec: EnvFactorySpec, *, frame_stack: int = 1, master_seed: int = 0,
              sample_steps: int = 32, out: dict[str, Any] | None = None,
              ) -> tuple[EnvSpec, "codec.CodecTable"]:
    """Build one 2-battle vec env, reset it, read the EnvSpec and decide the codec table from a
    sample of random-legal play (stream "preflight/sample"). The table is decided ONCE here and
    handed to every worker, so all of them pack with the same table. With `out`, also
    out["statics"] = codec.static_planes(table, first observation) (what unpack_numpy needs)."""
    from royalegym.selfplay import RandomLegalOpponent
    vec = build_vec(spec, 2, autoreset_seed_fn=lambda g, k: derive_int(master_seed,
                                                                        f"preflight/battle/{g}/ordinal/{k}"))
    obs, _ = vec.reset()
    env_spec = read_env_spec(spec, vec.envs[0], frame_stack)
    rng = derive_generator(master_seed, "preflight/sample")
    opp = RandomLegalOpponent(0.5)
    sample = [obs]
    for _ in range(sample_steps):
        acts = np.array([opp.act({}, obs["action_mask"][i], rng) for i in range(vec.num_envs)])
        obs, *_ = vec.step(acts)
        sample.append(obs)
    table = codec.decide_table(vec.single_observation_space, env_spec.spatial_layout, sample)
    if out is not None:
        out["statics"] = codec.static_planes(table, sample[0])
    vec.close()
    return env_spec, table


def unpack_numpy(table: Any, rows: np.ndarray, statics: np.ndarray, seats: np.ndarray,
                 obs_space: dict[str, ObsKeySpec]) -> dict[str, np.ndarray]:
    """Packed rows back to the env's observation keys, in numpy, for a parent that acts without
    torch (the evaluation runner hands these to its policies). The inverse of codec.Packer.pack:
    uint8 planes exactly (raw values, no divisor: this is the env's own observation, not the
    network's input), float16 planes and the vector as their fp16 values, the statics per seat,
    the mask bit-unpacked and mask_planes = mask[1:] reshaped (design 3.3). pack(unpack_numpy(x))
    equals x byte for byte, so a network that packs and unpacks itself sees what the learner sees."""
    rows = np.ascontiguousarray(rows)
    B = rows.shape[0]
    S, H, W = table.spatial_shape
    off = table.offsets
    sp = np.zeros((B, S, H, W), np.dtype(obs_space["spatial"].dtype))
    u8, f16, st = list(table.uint8_index), list(table.f16_index), list(table.static_index)
    if u8:
        a, b = off["uint8"]
        sp[:, u8] = rows[:, a:b].reshape(B, len(u8), H, W)
    if f16:
        a, b = off["float16"]
        sp[:, f16] = np.ascontiguousarray(rows[:, a:b]).view("<f2").reshape(B, len(f16), H, W)
    if st:
        sp[:, st] = statics[np.asarray(seats, np.intp)]
    a, b = off["vector"]
    out = {"spatial": sp,
           "vector": np.ascontiguousarray(rows[:, a:b]).view("<f2").astype(obs_space["vector"].dtype)}
    a, b = off["mask"]
    mask = np.unpackbits(rows[:, a:b], axis=1, bitorder="little")[:, : table.n_actions]
    out["action_mask"] = mask.astype(obs_space["action_mask"].dtype)
    if table.mask_planes_shape is not None:
        out["mask_planes"] = mask[:, 1:].reshape(B, *table.mask_planes_shape).astype(
            obs_space["mask_planes"].dtype)
    if table.ids_shape is not None:
        a, b = off["card_ids"]
        out["card_ids"] = rows[:, a:b].reshape(B, *table.ids_shape).astype(obs_space["card_ids"].dtype)
    return out


# --- 5. The potential-based reward (design 4) -----------------------------------------------------
# Each shaping term pays gamma * Phi(s') - Phi(s), with Phi(s') = 0 once the battle is over (a
# truncated battle keeps the position's potential: the learner bootstraps from it). gamma comes
# from the schedule: every submit carries it and the runner forwards it to every term through
# PotentialCombinedReward.set_gamma, so the reward and the learner's GAE use one number.

from royalegym.protocol import EntityKind  # noqa: E402
from royalegym.reward import CombinedReward, RewardFunction, WinLossReward  # noqa: E402

TERMINAL_REWARD_TERM = "terminal"
TOWERS = (EntityKind.KING_TOWER, EntityKind.PRINCESS_TOWER)   # not units: the elixir board skips them


class PotentialReward(RewardFunction):
    """gamma * Phi(s') - Phi(s); subclasses define potential(state, team). The env hands a step
    the state object it handed the step before as `prev`, so each team's last Phi is kept beside
    the state it was read off (held, so compared by identity): a step reads Phi(s) back and one new
    Phi(s'), rather than two. Phi is a pure function of the state, so the reward is the same number."""

    def __init__(self) -> None:
        self.gamma = 1.0
        self._last: dict[int, tuple[Any, Any]] = {}

    def set_gamma(self, gamma: float) -> None:
        self.gamma = float(gamma)

    def potential(self, state: Any, team: int) -> Any:
        raise NotImplementedError

    def phi(self, state: Any, team: int) -> Any:
        last = self._last.get(team)
        if last is not None and last[0] is state:
            return last[1]
        value = 0 if state.game_over else self.potential(state, team)
        self._last[team] = (state, value)
        return value

    def get_reward(self, team, prev, state, results) -> float:
        before = self.phi(prev, team)   # first: the Phi kept is prev's, read as the step before's s'
        return float(self.gamma * self.phi(state, team) - before)


class PotentialCrownReward(PotentialReward):
    """Phi = (own_crowns - foe_crowns) / 3."""

    def potential(self, state, team):
        return (state.players[team].crowns - state.players[1 - team].crowns) / 3.0


class PotentialTowerHPReward(PotentialReward):
    """Phi = (sum_s own_hp/own_max - sum_s foe_hp/foe_max) / 3 (the mean tower fraction,
    royalegym.env.tower_hp_frac, so what is logged and what is optimised are one number)."""

    @staticmethod
    def _side(p) -> float:
        return sum(max(0, p.tower_hp[s]) / max(1, p.tower_max_hp[s]) for s in range(len(p.tower_hp)))

    def potential(self, state, team):
        return (self._side(state.players[team]) - self._side(state.players[1 - team])) / 3.0


class CommittedElixirPotential(PotentialReward):
    """Phi = ((own_bar + own_board) - (foe_bar + foe_board)) / scale, exact Fractions: bar is
    elixir_milli / 1000, board the sum of Fraction(card.elixir, card.count) over that player's
    live non-tower entities whose (max_hp, radius, flying) match their card's row (the rule of
    royalegym's ElixirTradeReward: a unit the catalogue does not price is worth zero). Exact, so
    the seat-mirror antisymmetry is checkable (a float sum gives +-1.1e-19, design 4)."""

    def __init__(self, scale: float = 10.0) -> None:
        super().__init__()
        self.scale = scale
        self._value: dict[int, int] = {}
        self._row: dict[int, tuple[int, int, bool]] = {}
        self._unit = 1000   # the denominator every price and the bar are counted in

    def config(self) -> dict[str, object]:
        return {"scale": self.scale}

    def bind(self, engine) -> None:
        """Each card's price elixir / count as an integer count of 1 / _unit, _unit a multiple of
        every count and of the bar's 1000, so the board's sum is integer additions and the
        potential one Fraction at the end: the same exact number the Fraction sum gives."""
        cards = engine.cards()
        self._unit = math.lcm(1000, *(max(1, c.count) for c in cards))
        self._value = {c.card_id: c.elixir * (self._unit // max(1, c.count)) for c in cards}
        self._row = {c.card_id: (c.hitpoints, c.radius, c.flying) for c in cards}

    def _board(self, state, team) -> int:
        """The team's live priced units, in 1 / _unit."""
        row, value = self._row, self._value
        return sum(value[e.card_id] for e in state.entities
                   if e.team == team and e.kind not in TOWERS
                   and row.get(e.card_id) == (e.max_hp, e.radius, e.flying))

    def potential(self, state, team):
        bar = self._unit // 1000
        own = state.players[team].elixir_milli * bar + self._board(state, team)
        foe = state.players[1 - team].elixir_milli * bar + self._board(state, 1 - team)
        return Fraction(own - foe, self._unit) / Fraction(self.scale)


class GammaProbeReward(PotentialReward):
    """Phi = 1 everywhere (0 once over): pays exactly gamma - 1 a step. A probe for the test
    that the schedule's gamma reaches the reward during collection (design 4)."""

    def potential(self, state, team):
        return 1.0


class PotentialCombinedReward(CombinedReward):
    """royalegym's CombinedReward with gamma forwarded to every term that takes one, and the
    objective (term index `terminal`) filed under TERMINAL_REWARD_TERM so a class rename cannot
    move the shaping alarm's arithmetic (design 4)."""

    def __init__(self, terms, terminal: int = 0) -> None:
        super().__init__(terms)
        self.terminal = terminal
        # design 9.2: each seat's sum of |F_t| per term over its episode, how LOUD a term is (a
        # potential's signed sum telescopes to almost nothing, whatever its weight). Kept past the
        # episode's end until the next episode's first step, so the worker reads it after the vec
        # env's autoreset and a replay after its last step (episode_step_abs).
        self.step_abs: dict[int, dict[str, float]] = {}
        self._new_episode = True

    def set_gamma(self, gamma: float) -> None:
        for t, _ in self.terms:
            setter = getattr(t, "set_gamma", None)
            if callable(setter):
                setter(gamma)

    def config(self) -> dict[str, object]:
        return {**super().config(), "terminal": self.terminal}

    def reset(self, state) -> None:
        super().reset(state)
        self._new_episode = True

    def get_reward(self, team, prev, state, results) -> float:
        if self._new_episode:
            self.step_abs, self._new_episode = {}, False
        total = 0.0
        breakdown: dict[str, float] = {}
        self.last_terms[team] = breakdown
        loud = self.step_abs.setdefault(team, {})
        for i, (t, w) in enumerate(self.terms):
            v = w * t.get_reward(team, prev, state, results)
            name = TERMINAL_REWARD_TERM if i == self.terminal else type(t).__name__
            breakdown[name] = v
            loud[name] = loud.get(name, 0.0) + abs(v)
            total += v
        return total


def episode_step_abs(env: Any, seat: int) -> dict[str, float]:
    """Seat `seat`'s episode just ended, term by term: sum |F_t| (PotentialCombinedReward.step_abs);
    {} for a reward that keeps none (a user's own)."""
    from royalegym.env import AGENT_TEAM, AGENTS
    sums = getattr(env.reward_fn, "step_abs", None)
    return dict(sums.get(AGENT_TEAM[AGENTS[seat]], {})) if sums is not None else {}


# The cards whose elixir royalegym's count of a bar (obs.py MatchMemory, the observation's
# enemy_elixir slot) does not follow: it pays each play at the catalogue's CardInfo.elixir and
# regenerates, and the engine also pays the opponent 1 / 0.5 / 0.5 as each Elixir Golem piece dies
# (ManaOnDeathForOpponent), pays an Elixir Collector's owner 1 every 13 s (ManaCollectAmount; its
# data also has ManaOnDeath), and charges a Merge Maiden played under 6 elixir 3, not 6
# (spell.variant). A battle holding one goes inexact for good once the card acts (royalegym
# 0.1.25 on royalesim 0.1.42, two cpu runs: 1573 of 2314 built seat-episodes with one went
# inexact, 0 of 5175 without one; docs/running.md, elixir_count_inexact). By CardInfo.name.
ELIXIR_UNCOUNTABLE = frozenset({"ElixirGolem", "Elixir Collector", "MergeMaiden"})


class TrajectoryDigest:
    """A royalegym recorder (the env's duck-typed `recorder` hook) that keeps no frames: a chain
    hash of the engine's state_hash at the episode's reset and after each decision, read as
    `digest` once the episode has ended (kept until the next one ends, so a worker reads it after
    the vec env's SAME_STEP autoreset). An edit to a recorded battle that ends it with the same
    statistics still moves a state on its way, so replay compares the chain (checks.py). About
    4 us of engine hashing a decision [M: RustEngine.state_hash, this 2-core machine]. It asks for
    no per-tick frames, so the env keeps its one-call step; a recorder of those (a trace) beside
    it is checks.py's Recorders. It also notes at the reset whether either deck holds a card of
    ELIXIR_UNCOUNTABLE, read as `elixir_uncountable` beside `digest` (an EpisodeRecord field)."""
    frame_every_tick = False

    def __init__(self) -> None:
        self.digest = ""
        self.elixir_uncountable = False
        self._engine: Any = None
        self._h: Any = None
        self._uncountable_ids: frozenset[int] | None = None
        self._uncountable_now = False

    def begin(self, engine: Any, seed: int, init: Any) -> None:
        self._engine, self._h = engine, hashlib.blake2b(digest_size=8)
        self._h.update(int(engine.state_hash()).to_bytes(8, "little"))
        if self._uncountable_ids is None:
            self._uncountable_ids = frozenset(c.card_id for c in engine.cards()
                                              if c.name in ELIXIR_UNCOUNTABLE)
        held = self._uncountable_ids
        self._uncountable_now = any(c in held for p in engine.state().players for c in p.deck)

    def record_frame(self, engine: Any) -> None:
        pass   # once per tick or per decision depending on who watches; record_step is once per decision

    def record_step(self, tick: int, ticks: int, commands: Any, results: Any) -> None:
        self._h.update(int(self._engine.state_hash()).to_bytes(8, "little"))

    def end(self, engine: Any) -> None:
        self.digest = self._h.hexdigest()
        self.elixir_uncountable = self._uncountable_now


def set_env_gamma(env: Any, gamma: float) -> None:
    """The schedule's gamma reaches an env's reward, if it takes one (design 4): what a worker
    forwards before each step, and what every re-simulation of a step must forward too."""
    setter = getattr(env.reward_fn, "set_gamma", None)
    if callable(setter):
        setter(gamma)


# The shaping terms' weights against the terminal +-1 (ppo_clash's --reward.* flags read them here).
# A princess tower taken pays crown/3 + tower_hp/3 over the steps it falls in [A: Phi's units above].
# At these weights the shaping is about as LOUD as the objective: sum |F_t| a learner seat an episode
# elixir 0.59, crown 0.20, tower hp 0.16 against the terminal's 1.0 [M: a cpu run's
# env/reward_terms_step_abs, design 4]; its signed sums telescope to ~5% of it (reward_shaping_abs).
REWARD_WEIGHTS = {"crown": 0.2, "tower_hp": 0.1, "elixir": 0.05}


def default_potential_reward(*, crown: float = REWARD_WEIGHTS["crown"],
                             tower_hp: float = REWARD_WEIGHTS["tower_hp"],
                             elixir: float = REWARD_WEIGHTS["elixir"]) -> PotentialCombinedReward:
    for name, w in (("crown", crown), ("tower_hp", tower_hp), ("elixir", elixir)):
        if not (np.isfinite(w) and w >= 0):
            raise ValueError(f"default_potential_reward({name}={w}): a weight must be finite and >= 0")
    return PotentialCombinedReward([
        (WinLossReward(draw=0.0), 1.0),            # royalegym's; the objective
        (PotentialCrownReward(), crown),
        (PotentialTowerHPReward(), tower_hp),
        (CommittedElixirPotential(scale=10.0), elixir),
    ])


def probe_reward() -> PotentialCombinedReward:
    """The terminal term plus the gamma probe: what the gamma-reaches-the-reward test runs."""
    return PotentialCombinedReward([(WinLossReward(draw=0.0), 1.0), (GammaProbeReward(), 1.0)])


# --- 6. Scripted opponents (design 3.5): run in the worker, numpy only ----------------------------
# opponent_ix in an assignment indexes this table; each scripted slot draws from its own
# generator, scripted/slot/{r}/gen/{g}, re-derived at the start of every episode with the battle's
# ordinal appended (/ordinal/{k}). Why per episode: a slot-long stream continues across episodes,
# so its position at a checkpoint is state that lives only in the worker, and a resumed run (which
# restarts every battle from its episode's reset and replays it, design 3.9) would replay the
# stream from its start. Addressed by the episode, the stream is a pure function of names a
# checkpoint already holds (tests/test_ppo_clash.py, the run stopped between two gates;
# docs/determinism.md section 2). Why not by worker: the slot (global) names it already, so how
# the battles are spread over workers changes no game (tests/test_farm.py).


def scripted_stream(slot: int, gen: int, ordinal: int) -> str:
    """The derive path of a scripted seat's generator for one episode (design 2.2's per-slot name
    plus the episode's ordinal; g the restart generation of the worker hosting the slot)."""
    return f"scripted/slot/{slot}/gen/{gen}/ordinal/{ordinal}"


def make_scripted(name: str) -> Any:
    """A fresh royalegym opponent for a SCRIPTED_NAMES entry (it keeps per-episode state, so one
    per seat per episode). Its act(obs, mask, rng) reads only legality (mask_planes / the mask)."""
    if name not in SCRIPTED_NAMES:
        raise ValueError(f"unknown scripted player {name!r}; farm.SCRIPTED_NAMES = {SCRIPTED_NAMES}")
    from royalegym import opponents as o
    from royalegym.selfplay import NoopOpponent, RandomLegalOpponent
    table = {
        "noop": NoopOpponent, "random_legal": lambda: RandomLegalOpponent(0.9),
        "random": lambda: RandomLegalOpponent(0.7), "first-affordable": o.FirstAffordableOpponent,
        "defend": o.DefendOpponent, "push": o.PushOpponent,
        "patient": lambda: o.PatientOpponent(ready=3),
    }
    return table[name]()


SCRIPTED_NAMES = ("noop", "random_legal", "random", "first-affordable", "defend", "push", "patient")
"""noop, random_legal(0.9), then royalegym.opponents.ladder()'s rungs after noop, by its names."""


def scripted_assignment(battle: int, ordinal: int, name: str, learner_seat: int) -> Assignment:
    """A scripted battle: the learner on one seat, `name` (SCRIPTED_NAMES) on the other."""
    g = [GROUP_LEARNER, GROUP_LEARNER]
    g[1 - learner_seat] = GROUP_SCRIPTED
    return Assignment(battle, ordinal, ROLE_SCRIPTED, f"scripted:{name}", (g[0], g[1]), learner_seat)


def mirror_assignment(battle: int, ordinal: int) -> Assignment:
    return Assignment(battle, ordinal, ROLE_MIRROR, None, (GROUP_LEARNER, GROUP_LEARNER), -1)


# --- 6b. The lookahead player (design 7.11): a rung stronger than the scripted ones -----------------
# The rollout algorithm over a portfolio of scripted rungs. At a choice point (more than one legal
# action) it snapshots the live battle, and for each candidate action (the proposal of each rung in
# its portfolio, the no-op among them) it plays the battle on in a scratch env for `horizon`
# decisions: its own seat plays the candidate, then its base rung; the other seat plays a fixed
# model rung throughout (several models: one scratch battle each, their scores summed). It keeps
# the candidate whose position at the horizon scores best. A tie keeps the earliest candidate in
# c's order; by default the base rung's proposal comes first, so where the search tells nothing
# apart it plays as its base rung does (the rollout algorithm's improvement over its base).
#
# What it sees that a seat's observation does not: the engine's whole state (ClashParallelEnv
# .snapshot()), so the opponent's hand, exact elixir and card cycle, every unit's hit points, and
# the engine's own random draws in the next `horizon` decisions. It is privileged, and every table
# that measures it says so; a network distilled from it sees only its observation. It never reads
# whom it plays: the other seat's model is its own fixed rung, whoever sits there.
#
# Deterministic: the scratch battles start from the snapshot (the engine's state, its generator
# included), the rungs read only legality, and the one draw a choice point takes from the seat's
# own generator seeds every candidate's continuation alike (common random numbers for rungs that
# draw). Replay, resume and the evaluation's paired seeds hold as for any scripted seat.
#
# The name is the whole setting, so the ladder's results and a warm start's identity carry it:
#     lookahead:<base>[,vs=<rung>+...][,h=<decisions>][,c=<rung>+<rung>+...]
# canonical (lookahead_id) with every field written, c in its order (the order ties are broken in).

LOOKAHEAD = "lookahead:"
WORKER_PLAYERS = ("scripted:", LOOKAHEAD)
"""Player id prefixes played inside the workers, from their seat's generator (group -2)."""


class LookaheadSpec(msgspec.Struct, frozen=True):
    base: str                               # its own seat's rung after the first decision
    vs: tuple[str, ...]                     # the other seat's rung(s): a scratch battle each
    horizon: int                            # decisions played on from the choice point
    candidates: tuple[str, ...]             # rungs whose proposals are tried; a tie keeps the first


LOOKAHEAD_DEFAULTS = {"vs": "defend", "h": 20}
"""The chosen setting's fields (docs/ladder.md section 13: the table it was chosen from)."""
LOOKAHEAD_PORTFOLIO = ("noop", "first-affordable", "defend", "push", "patient")
"""The default candidates after the base (c unset): the no-op and each deterministic rung's proposal."""


def parse_lookahead(player: str) -> LookaheadSpec:
    """`lookahead:<base>[,vs=..][,h=..][,c=a+b+..]` as a LookaheadSpec; ValueError naming the part."""
    if not player.startswith(LOOKAHEAD):
        raise ValueError(f"{player!r}: a lookahead player is named lookahead:<base>[,vs=<rung>][,h=<n>]"
                         f"[,c=<rung>+<rung>...]")
    base, *parts = player.removeprefix(LOOKAHEAD).split(",")
    kw: dict[str, str] = {}
    for p in parts:
        k, eq, v = p.partition("=")
        if not eq or k not in ("vs", "h", "c") or k in kw:
            raise ValueError(f"{player!r}: {p!r} is not one of vs=<rung>, h=<decisions>, c=<rung>+<rung>... "
                             "(each at most once)")
        kw[k] = v
    h = kw.get("h", str(LOOKAHEAD_DEFAULTS["h"]))
    if not h.isdigit() or int(h) < 1:
        raise ValueError(f"{player!r}: h={h} must be a whole number of decisions >= 1")
    candidates = tuple(dict.fromkeys(kw["c"].split("+") if "c" in kw else (base, *LOOKAHEAD_PORTFOLIO)))
    vs = tuple(kw.get("vs", str(LOOKAHEAD_DEFAULTS["vs"])).split("+"))
    spec = LookaheadSpec(base, vs, int(h), candidates)
    for what, name in (("base", base), *(("vs", v) for v in vs), *(("c", c) for c in candidates)):
        if name not in SCRIPTED_NAMES:
            raise ValueError(f"{player!r}: {what} {name!r} is not a scripted rung; farm.SCRIPTED_NAMES = "
                             f"{SCRIPTED_NAMES}")
    if "noop" not in candidates or base not in candidates:
        raise ValueError(f"{player!r}: c= must include noop and the base, {base} (waiting and the base's own "
                         "play are always candidates)")
    return spec


def lookahead_id(spec: LookaheadSpec) -> str:
    """The canonical player id: every field written, so a default changing cannot rename a result."""
    return (f"{LOOKAHEAD}{spec.base},vs={'+'.join(spec.vs)},h={spec.horizon},"
            f"c={'+'.join(spec.candidates)}")


def canonical_player(player: str) -> str:
    """A lookahead id in its canonical form (lookahead:defend -> every field); any other id as it is."""
    return lookahead_id(parse_lookahead(player)) if player.startswith(LOOKAHEAD) else player


def check_worker_player(player: str) -> None:
    """ValueError naming the player unless it is scripted:<name> (SCRIPTED_NAMES) or a lookahead id."""
    if player.startswith(LOOKAHEAD):
        parse_lookahead(player)
    elif player.removeprefix("scripted:") not in SCRIPTED_NAMES:
        raise ValueError(f"{player}: unknown scripted player; farm.SCRIPTED_NAMES = "
                         f"{', '.join(SCRIPTED_NAMES)}")


def scratch_env(spec: EnvFactorySpec) -> Any:
    """The env a lookahead plays its candidates on: the live one's, less its reward (the player
    scores the position itself: the potential reward computed every scratch step was an eighth of
    its time [M: cProfile, docs/ladder.md section 13]) and its truncation (the horizon is its own)."""
    return env_factory(msgspec.structs.replace(
        spec, reward_fn=ComponentSpec("royalegym.reward.WinLossReward"), truncation=[]))()


def worker_player(player: str, scratch: Callable[[], Any]) -> Any:
    """A fresh player for one seat's episode: scripted:<name> or lookahead:... (bound to its live
    battle with .bind(env, seat) before it acts). scratch() returns the scratch env a lookahead plays
    its candidates in, built like the live one (one per shard, shared: seats act one at a time)."""
    if player.startswith(LOOKAHEAD):
        return LookaheadPlayer(parse_lookahead(player), scratch())
    check_worker_player(player)
    return make_scripted(player.removeprefix("scripted:"))


class LookaheadPlayer:
    """One seat's lookahead (section 6b). act(obs, mask, rng) as a scripted rung's, once bound to
    the live battle. Counts, for its episode's record, the choice points it searched and the
    game-steps its scratch battles played."""

    def __init__(self, spec: LookaheadSpec, scratch: Any) -> None:
        self.spec, self.scratch = spec, scratch
        self.base = make_scripted(spec.base)
        self.models = [make_scripted(v) for v in spec.vs]
        self.proposers = [make_scripted(c) for c in spec.candidates]
        elixir = CommittedElixirPotential()
        elixir.bind(scratch.engine)
        self.terms = ((PotentialCrownReward(), REWARD_WEIGHTS["crown"]),
                      (PotentialTowerHPReward(), REWARD_WEIGHTS["tower_hp"]),
                      (elixir, REWARD_WEIGHTS["elixir"]))
        self.env: Any = None
        self.seat = -1
        self.choices = self.steps = 0
        self.last: tuple[list[int], list[float]] = ([], [])   # the last act's candidates and scores

    def bind(self, env: Any, seat: int) -> None:
        """The live battle this seat plays (a ClashParallelEnv; it must build both seats' full
        observations, which snapshot() needs) and which seat it is."""
        self.env, self.seat = env, seat

    def act(self, obs: dict[str, Any], mask: np.ndarray, rng: np.random.Generator) -> int:
        proposals = [int(p.act(obs, mask, rng)) for p in self.proposers]
        tried = list(dict.fromkeys(proposals))
        if len(tried) == 1:
            self.last = (tried, [0.0])
            return tried[0]
        try:
            snap = self.env.snapshot()
        except ValueError as exc:
            raise ValueError(f"{lookahead_id(self.spec)} on seat {self.seat}: the live battle cannot be "
                             f"snapshotted ({exc}); a lookahead seat's battle builds both seats' full "
                             "observations") from None
        self.choices += 1
        seed = int(rng.integers(2**62))
        scores = [sum(self._play_on(snap, a, m, np.random.default_rng(seed)) for m in self.models)
                  for a in tried]
        self.last = (tried, scores)
        return tried[int(np.argmax(scores))]       # the first of the best: the base's on a tie

    def _play_on(self, snap: Any, first: int, model: Any, rng: np.random.Generator) -> float:
        """The battle played on from `snap` for the horizon, `first` then the base on this seat,
        `model` on the other; its score for this seat at the end."""
        from royalegym.env import AGENTS
        me, them = AGENTS[self.seat], AGENTS[1 - self.seat]
        obs, _ = self.scratch.reset(options={"snapshot": snap, "mask_only": AGENTS})
        for k in range(self.spec.horizon):
            mine = first if k == 0 else self.base.act(obs[me], obs[me]["action_mask"], rng)
            acts = {me: mine, them: model.act(obs[them], obs[them]["action_mask"], rng)}
            obs, _, term, trunc, _ = self.scratch.step(acts)
            self.steps += 1
            if term[me] or trunc[me]:
                break
        return self.score(self.scratch.battle_state, self.seat)

    def score(self, state: Any, team: int) -> float:
        """+-1 (0 a draw) once the battle is over; before, the potential reward's terms at their
        default weights (section 5): crowns, towers' hit points, committed elixir, own minus foe."""
        if state.game_over:
            return 1.0 if state.winner == team else -1.0 if state.winner == 1 - team else 0.0
        return sum(w * float(t.potential(state, team)) for t, w in self.terms)


# The evaluation mode (design 7.5, 7.1): a farm built for a gate and closed after it. What it plays
# is fixed in advance, as data (it crosses to spawned workers inside FarmConfig, and a next
# comparison's by farm.replan: CMD_REPLAN, section 7): a list of EvalEpisodes. Shard j (of J) owns
# the episodes i with i % J == j, as a queue in plan order: at the reset its battles take the first
# ones in ascending battle order, and whenever battles end an episode, they take the next ones,
# again in ascending battle order. Each episode's seed, seats and scripted streams come from its
# EvalEpisode alone, so its result does not depend on which battle hosted it, on B, on the number of
# workers or on what else was live. A battle that finds its shard's queue empty STOPS: its seats
# become GROUP_IDLE, the worker plays no-ops there (mask-only observations, no records), and
# farm.eval_done turns True when every battle stopped. With one battle per episode every battle
# plays exactly one episode and then stops.
#   The seed of a new episode is consumed INSIDE vec.step (the autoreset), before the parent has
# seen the old episode end. So the worker pops its queue itself (autoreset_seed_fn), and the
# parent replays the same rule on the ends it reads (same shard, same ascending order) to know
# which episode each battle now plays; every EpisodeRecord carries its eval_index, which checks
# it. Why queues and not a static "episode i on battle i % B" (which would need no replay): with
# a static hosting a battle that drew short episodes idles while the slowest battle finishes its
# share, stepping no-op matches; with the queues only the last episode of each shard leaves an
# idle tail. ~7.5 s for 40 episodes on 8 inline battles [M], docs/throughput.md.

GROUP_IDLE = -4                          # a stopped evaluation battle: nobody acts, nothing counts


class EvalEpisode(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One evaluation episode. players[seat]: "scripted:<name>" (played in the worker, from the
    generator derive_generator(master_seed, streams[seat])) or any other id (acted by the parent,
    which addresses that seat's uniforms by the same streams[seat]). The episode resets with
    `seed`; seed_path is recorded on its EpisodeRecords."""
    seed: int
    seed_path: str
    players: tuple[str, str]                # (blue, red)
    streams: tuple[str, str]                # per seat: the name of its acting stream


def eval_queue(n_plan: int, n_shards: int, shard: int) -> list[int]:
    """The plan indices shard j plays, in order (see above)."""
    return list(range(shard, n_plan, n_shards))


def _eval_idle_seed(master_seed: int, battle: int, ordinal: int) -> int:
    return derive_int(master_seed, f"eval/idle/battle/{battle}/ordinal/{ordinal}")


# --- 7. The byte layout (design 3.4): the cross-language contract ---------------------------------
# Everything a worker in another language (a Rust worker) must implement is here; every offset
# is computed from the EnvSpec and FarmConfig, none is a literal of the env:
#   row_bytes = codec.CodecTable (decided from EnvSpec.obs_space).row_bytes; T = cycles;
#   k = frame_stack; R = n_slots = 2 * workers * games_per_worker; S = shards_per_worker;
#   n = 2 * games_per_worker / S slots per shard. Global shard j = w * S + s holds battles
#   j * n/2 .. (j+1) * n/2 - 1 and slots j * n .. (j+1) * n - 1 (slot = 2 * battle + seat,
#   seat 0 blue, 1 red); "local slot i" below is slot j * n + i. All integers little-endian.
#
# Segment names carry the creating process's pid (<pid>) and its farm count (<n>); a new farm
# removes those of a pid that is gone (remove_stale_segments, section 12).
# Segment A "rlb-<pid>-<n>" (one per farm; the parent creates it, workers write rows):
#   0     header HEADER_DTYPE, 128 B: magic "CLASHRLB" | layout_version u32 | codec_version u32 |
#         cycles u32 | frame_stack u32 | n_slots u32 | row_bytes u32 | obs_offset u64 (= 128) | pad
#   128   the rectangle, (T + k) * R * row_bytes: row (q, r) at 128 + (q * R + r) * row_bytes;
#         cycle t's observation of slot r is row q = t + k - 1 (rows 0..k-2: previous frames).
# Segment B "rlc-<pid>-<n>-<w>" (one per worker; offsets from segment_b_bytes / shard_layout):
#   0     handshake, HANDSHAKE_BYTES: u32 length, then a JSON report (worker_report: "spaces"
#         signature, "engine_binary", "threads", "torch_loaded", "pid"), written at start-up
#         and again on SPACES; the length is written last.
#   4096 + s * shard_layout(n, row_bytes)["total"]: shard s's block, its regions in order:
#     control  CONTROL_DTYPE 64 B. Child -> parent: state u32 (ST_*), n_slots u32, cycle i64
#              (the cycle just published), err_code u32 (ERR_*), err_len u32, t_env_ns u64 (this
#              round's vec.step), pub_seq u64 (= the cmd_seq answered). Parent -> child: cmd_seq
#              u64 (written LAST), cmd_kind u16 (CMD_*), cmd_flags u16 (0), cmd_row u32 (STEP:
#              the rect row to write, cycle + k - 1), gamma f64 (STEP: the schedule's gamma).
#     error    512 B   the child's traceback, utf-8, its last 512 bytes; err_len says how many
#     scalars  n * 32 B SCALAR_DTYPE per local slot: the transition the last STEP's action made
#     finals   n * row_bytes (pad 8): local slot i's packed final observation, valid where
#              scalars.flags has F_FINAL (a truncated transition: the bootstrap's observation)
#     actions  n * 2 B (pad 8): i16 per local slot, parent -> child (scripted seats ignored)
#     assign   n * 4 B (pad 8): ASSIGN_DTYPE per local slot, parent -> child; present = 1 only
#              for the slots of battles whose episode started on the previous round (design 3.6)
#     episodes n * EPISODE_BYTES_PER_SLOT: u32 length + a msgspec JSON list, one object per seat
#              whose episode ended on this round (the EpisodeRecord fields the worker counts;
#              the parent adds policy_id, opponent_id, bucket)
#     stats    STATS_DTYPE 64 B: codec_ns, bytes_out (this round), clipped, rounded (cumulative)
#   plan_offset(n, S, row_bytes) = 4096 + S * block: the plan area, S * n * 24 B, PLAN_DTYPE per
#     slot of the worker (shard s's n entries at + s * n * 24): the iteration's opening table.
# Segment P "rlp-<pid>-<n>-<w>" (an evaluation farm's, one per worker, from just before CMD_REPLAN
#   until every worker is ready again, or the replan failed; the parent creates and unlinks it):
#   u32 length, then the msgspec JSON of a Replan {"eval_plan": [EvalEpisode...], "ordinals": [[k
#   per battle] per shard]}.
#
# Signalling, per (worker, shard): two semaphores, obs_ready (child -> parent) and
# actions_ready (parent -> child); each released once per command or answer, after the word.
# The parent writes a command's data, then cmd_kind (and cmd_row, gamma), then cmd_seq += 1,
# then releases actions_ready. The child answers by writing its data, then pub_seq = cmd_seq,
# then releasing obs_ready. The commands (design 3.5's STEP | PLAN | SPACES | REPLAN | CLOSE;
# SET_STATE and DEFER are not built):
#   start-up (no command): reset every battle (seeds env/battle/{b}/ordinal/{k}), pack the
#     first observations into rect row k - 1, zero scalars (flags F_VALID, group), episodes
#     length 0, stats, write the handshake, then state = ST_READY on every shard.
#   CMD_STEP   read assign (present entries) and actions, fill scripted seats, step the vec env,
#     write scalars, finals, episodes, stats, t_env_ns and rect row cmd_row for the shard's
#     slots; cycle = cmd_row - (k - 1); answer.
#   CMD_PLAN   (begin_iteration, to every shard in order, before the iteration's first STEP)
#     apply the shard's plan entries: seat every battle whose seats the worker does not hold
#     for its running episode; check every entry's ordinal and seed against the worker's own
#     and refuse a mid-episode reseat (FarmError: out of step). A resumed farm's first PLAN then
#     re-simulates the battles FarmConfig.start_in_flight names and packs each one's last k
#     observations into rect rows 0..k-1 (design 3.9); answer. Otherwise nothing is stepped.
#   CMD_SPACES (ProcessFarm.spaces(w), between iterations, on the worker's first shard) re-read
#     spaces and engine binary off the live env, rewrite the handshake; answer. Nothing stepped.
#   CMD_REPLAN (an evaluation farm's next comparison, on the worker's first shard, once every
#     command before it is answered; the parent has set state = ST_STARTING on every shard) read
#     segment P, pub_seq = cmd_seq, close the battles' envs keeping their engines, then start-up
#     again on the new plan and ordinals, on those engines; no obs_ready (the parent waits for
#     ST_READY, as at start-up).
#   CMD_CLOSE  state = ST_CLOSED on every shard and exit; no pub_seq (the parent joins).
# An exception in the child: error text, err_code = ERR_EXCEPTION, state = ST_FAILED on every
# shard, obs_ready released on every shard, exit 1. A hard crash writes nothing: the parent
# sees a dead process with state != ST_FAILED (WorkerFailure kind "crash"); ERR_CRASH
# (err_code 2) is reserved for a worker that can report one and is not written.
#
# Choices in this layout, and why (design 3.4): one buffer per shard, not two parities
# (rollout.overlap is refused at start-up, so a second parity would never be written); the plan
# area follows the shard blocks, one per worker, its entries carrying learner_seat in byte 3 and
# the episode's reset ordinal in the stride's last 8 bytes, so the worker checks it is in step;
# finals are indexed by the slot within the shard (n_trunc_max = n: every slot can truncate on
# one round); an EpisodeRecord crosses the boundary once per finished episode, in the episode
# area (design 3.5); a 64-byte stats block ends each shard's block: what the round cost the
# worker (codec ns, bytes written) and the packer's cumulative clip/round counters
# (health/obs_codec_clipped, design 3.3).

LAYOUT_VERSION = 4                      # 2: the stats block; 3: the plan area, CMD_PLAN/SPACES; 4: CMD_REPLAN
MAGIC = b"CLASHRLB"
HEADER_BYTES = 128
HANDSHAKE_BYTES = 4096
CONTROL_BYTES = 64
ERROR_BYTES = 512
SCALAR_BYTES = 32
ACTION_BYTES = 2
ASSIGN_BYTES = 4
EPISODE_BYTES_PER_SLOT = 16384
STATS_BYTES = 64
PLAN_BYTES = 24

HEADER_DTYPE = np.dtype({
    "names": ["magic", "layout_version", "codec_version", "cycles", "frame_stack", "n_slots",
              "row_bytes", "obs_offset", "pad"],
    "formats": ["S8", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u8", "V88"],
    "offsets": [0, 8, 12, 16, 20, 24, 28, 32, 40], "itemsize": HEADER_BYTES})

CONTROL_DTYPE = np.dtype({
    # state/cycle/n_slots/err_code/err_len/t_env_ns/pub_seq child -> parent; cmd_* parent -> child.
    "names": ["state", "n_slots", "cycle", "err_code", "err_len", "t_env_ns", "cmd_seq", "pub_seq",
              "cmd_kind", "cmd_flags", "cmd_row", "gamma"],
    "formats": ["<u4", "<u4", "<i8", "<u4", "<u4", "<u8", "<u8", "<u8", "<u2", "<u2", "<u4", "<f8"],
    "offsets": [0, 4, 8, 16, 20, 24, 32, 40, 48, 50, 52, 56], "itemsize": CONTROL_BYTES})

SCALAR_DTYPE = np.dtype({
    # every byte is a named field (pad included) so a copy moves all 32 and rows compare bytewise
    "names": ["reward", "group", "flags", "deploy_status", "episode_end", "tick", "episode_steps",
              "cards_played", "elixir_leak", "pad"],
    "formats": ["<f4", "i1", "u1", "i1", "i1", "<i4", "<i4", "<i2", "<i2", "V12"],
    "offsets": [0, 4, 5, 6, 7, 8, 12, 16, 18, 20], "itemsize": SCALAR_BYTES})

STATS_DTYPE = np.dtype({
    # child -> parent, rewritten every round. codec_ns, bytes_out: this round's; clipped, rounded:
    # the shard's Packer counters since the worker (this generation) started.
    "names": ["codec_ns", "bytes_out", "clipped", "rounded", "pad"],
    "formats": ["<u8", "<u8", "<u8", "<u8", "V32"],
    "offsets": [0, 8, 16, 24, 32], "itemsize": STATS_BYTES})

ASSIGN_DTYPE = np.dtype({
    "names": ["group", "opponent_ix", "learner_seat", "present"],
    "formats": ["i1", "i1", "i1", "u1"], "offsets": [0, 1, 2, 3], "itemsize": ASSIGN_BYTES})

PLAN_DTYPE = np.dtype({
    # One entry per slot of the iteration's opening table, a 24 B stride (design 3.4): role,
    # group, opponent_ix; learner_seat (the assign entry carries it too); seed = the episode seed
    # of the episode the slot's battle is playing (training: derive_int(master_seed,
    # "env/battle/{b}/ordinal/{k}"); evaluation: EvalEpisode.seed), as u64; ordinal = that
    # episode's reset ordinal k, in the stride's last 8 bytes. The worker checks seed and ordinal
    # against its own (out of step -> FarmError).
    "names": ["role", "group", "opponent_ix", "learner_seat", "pad", "seed", "ordinal"],
    "formats": ["i1", "i1", "i1", "i1", "V4", "<u8", "<i8"],
    "offsets": [0, 1, 2, 3, 4, 8, 16], "itemsize": PLAN_BYTES})

# scalars.flags bits
F_TERMINATED, F_TRUNCATED, F_VALID, F_FINAL = 1, 2, 4, 8
# episode_end: 0 none, 1 win, 2 loss, 3 draw (design 3.1), 4 ended with no winner (a truncation,
# or a termination condition that does not end the game, e.g. FirstCrownCondition)
END_NONE, END_WIN, END_LOSS, END_DRAW, END_NO_RESULT = 0, 1, 2, 3, 4
# control.state
ST_STARTING, ST_READY, ST_FAILED, ST_CLOSED = 0, 1, 2, 3
# control.cmd_kind (parent -> child; see the command table above)
CMD_STEP, CMD_CLOSE, CMD_PLAN, CMD_SPACES, CMD_REPLAN = 1, 2, 3, 4, 5
# control.err_code (design 3.4)
ERR_NONE, ERR_EXCEPTION, ERR_CRASH = 0, 1, 2
STACK_SIGNAL = getattr(signal, "SIGUSR1", None)   # POSIX only; elsewhere a hang's file has no stack
STACK_WAIT_S = 1.0   # how long a parent waits for a hung worker's stack before it kills it

assert HEADER_DTYPE.itemsize == HEADER_BYTES and CONTROL_DTYPE.itemsize == CONTROL_BYTES
assert SCALAR_DTYPE.itemsize == SCALAR_BYTES and ASSIGN_DTYPE.itemsize == ASSIGN_BYTES
assert STATS_DTYPE.itemsize == STATS_BYTES and PLAN_DTYPE.itemsize == PLAN_BYTES


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def shard_layout(n: int, row_bytes: int) -> dict[str, tuple[int, int]]:
    """(offset, size) of each region of one shard's block in segment B, relative to the block."""
    sizes = [("control", CONTROL_BYTES), ("error", ERROR_BYTES), ("scalars", n * SCALAR_BYTES),
             ("finals", _pad8(n * row_bytes)), ("actions", _pad8(n * ACTION_BYTES)),
             ("assign", _pad8(n * ASSIGN_BYTES)), ("episodes", n * EPISODE_BYTES_PER_SLOT),
             ("stats", STATS_BYTES)]
    out, off = {}, 0
    for name, size in sizes:
        out[name] = (off, size)
        off += size
    out["total"] = (0, off)
    return out


def plan_offset(n: int, shards: int, row_bytes: int) -> int:
    """Offset of the worker's plan area in segment B: after the handshake and every shard block.
    Shard s's n entries start at plan_offset + s * n * PLAN_BYTES (its slots, ascending)."""
    return HANDSHAKE_BYTES + shards * shard_layout(n, row_bytes)["total"][1]


def segment_b_bytes(n: int, shards: int, row_bytes: int) -> int:
    return plan_offset(n, shards, row_bytes) + shards * n * PLAN_BYTES


def shard_io(buf: Any, n: int, shards: int, row_bytes: int, s: int) -> "ShardIO":
    """The views of shard s's block in a worker's segment B, its plan entries included."""
    lay = shard_layout(n, row_bytes)["total"][1]
    return ShardIO(buf, HANDSHAKE_BYTES + s * lay, n, row_bytes,
                   plan_base=plan_offset(n, shards, row_bytes) + s * n * PLAN_BYTES)


def segment_a_bytes(cycles: int, frame_stack: int, n_slots: int, row_bytes: int) -> int:
    return HEADER_BYTES + (cycles + frame_stack) * n_slots * row_bytes


class ShardIO:
    """numpy views of one shard's block in segment B (shared memory or, inline, a bytearray)."""

    def __init__(self, buf: Any, base: int, n: int, row_bytes: int,
                 plan_base: int | None = None) -> None:
        lay = shard_layout(n, row_bytes)

        def view(name, dtype, count):
            off, _ = lay[name]
            return np.ndarray((count,), dtype=dtype, buffer=buf, offset=base + off)
        self.control = view("control", CONTROL_DTYPE, 1)
        self.error = view("error", np.uint8, ERROR_BYTES)
        self.scalars = view("scalars", SCALAR_DTYPE, n)
        self.finals = view("finals", np.uint8, n * row_bytes).reshape(n, row_bytes)
        self.actions = view("actions", "<i2", n)
        self.assign = view("assign", ASSIGN_DTYPE, n)
        self.episodes = view("episodes", np.uint8, n * EPISODE_BYTES_PER_SLOT)
        self.stats = view("stats", STATS_DTYPE, 1)
        # the shard's entries of the worker's plan area (None when built without plan_base)
        self.plan = (None if plan_base is None else
                     np.ndarray((n,), dtype=PLAN_DTYPE, buffer=buf, offset=plan_base))

    def write_text(self, text: str) -> None:
        raw = text.encode("utf-8")[-(ERROR_BYTES):]
        self.error[: len(raw)] = np.frombuffer(raw, np.uint8)
        self.control["err_len"] = len(raw)

    def read_text(self) -> str:
        n = int(self.control["err_len"][0])
        return bytes(self.error[:n]).decode("utf-8", "replace")


def write_header(buf: Any, cycles: int, frame_stack: int, n_slots: int, row_bytes: int) -> None:
    h = np.ndarray((1,), HEADER_DTYPE, buffer=buf, offset=0)
    h[0] = (MAGIC, LAYOUT_VERSION, codec.CODEC_VERSION, cycles, frame_stack, n_slots, row_bytes,
            HEADER_BYTES, bytes(88))


def rect_view(buf: Any, cycles: int, frame_stack: int, n_slots: int, row_bytes: int) -> np.ndarray:
    return np.ndarray((cycles + frame_stack, n_slots, row_bytes), np.uint8, buffer=buf,
                      offset=HEADER_BYTES)


def write_episodes(io: ShardIO, records: list[dict[str, Any]], where: str) -> int:
    """The episode area: u32 length, then the records as one msgspec JSON list (length 0 when
    there are none). Returns the bytes written."""
    raw = msgspec.json.encode(records) if records else b""
    if len(raw) + 4 > io.episodes.size:
        raise FarmError(f"{where}: {len(raw)} bytes of episode records exceed the "
                        f"{io.episodes.size}-byte area; raise EPISODE_BYTES_PER_SLOT")
    io.episodes[:4] = np.frombuffer(struct.pack("<I", len(raw)), np.uint8)
    if raw:
        io.episodes[4:4 + len(raw)] = np.frombuffer(raw, np.uint8)
    return len(raw) + 4


def framed(buf: Any) -> bytes:
    """What a u32 length says follows it: the episode area, the handshake, segment P."""
    n = struct.unpack_from("<I", buf, 0)[0]
    return bytes(buf[4:4 + n])


def read_episodes(io: ShardIO) -> list[dict[str, Any]]:
    raw = framed(io.episodes)
    return msgspec.json.decode(raw) if raw else []


class Replan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """CMD_REPLAN's message, in the worker's segment P: the evaluation farm's next plan and the
    reset ordinals of the worker's shards' battles (as a new farm would start them)."""
    eval_plan: list[EvalEpisode]
    ordinals: list[list[int]]


def read_replan(seg_b: str) -> Replan:
    """The worker's side of CMD_REPLAN: its segment P ("rlp-", named as its segment B)."""
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(name="rlp" + seg_b[3:])
    try:
        return msgspec.json.decode(framed(shm.buf), type=Replan)
    finally:
        shm.close()


# --- 8. Records and configuration (design 3.1) ----------------------------------------------------

class EpisodeRecord(msgspec.Struct, frozen=True):
    """One seat's finished episode. The terminal statistics are copied out of final_info; the
    rest the worker counted. episode_seed and played make the episode re-simulable: reset a
    ClashParallelEnv built from the same EnvFactorySpec with seed=episode_seed and replay
    `played` ((decision index, seat, action) for every non-no-op action of BOTH seats)."""
    slot: int
    worker: int
    shard: int
    battle: int
    seat: int
    ordinal: int
    episode_seed_path: str
    episode_seed: int
    policy_id: str                          # "learner" | "snap:<id>" | "scripted:<name>"
    opponent_id: str
    bucket: str                             # "mirror" | "pool" | "scripted"
    episode_steps: int
    episode_ticks: int
    own_crowns: int
    enemy_crowns: int
    own_tower_hp_frac: float
    enemy_tower_hp_frac: float
    elixir_leak_steps: int
    elixir_count_exact: bool
    winner: int                             # -1 none, 0 blue, 1 red, 2 draw
    outcome: int                            # +1 win, 0 draw/none, -1 loss
    cards_played: int
    illegal_commands: int
    undiscounted_return: float
    reward_terms: dict[str, float]
    played: tuple[tuple[int, int, int], ...]
    eval_index: int = -1                    # the evaluation mode: the EvalEpisode played; else -1
    reward_terms_step_abs: dict[str, float] = {}   # each term's sum |F_t| ({}: a reward keeping none)
    trajectory_digest: str = ""             # TrajectoryDigest: the engine's states, chained
                                            # ("": older record)
    elixir_uncountable: bool = False        # a deck held an ELIXIR_UNCOUNTABLE card (False: older record)
    lookahead_choices: int = 0              # a lookahead seat (section 6b): choice points it searched
    lookahead_steps: int = 0                # ... and the game-steps its scratch battles played


class WorkerFailure(msgspec.Struct, frozen=True):
    worker: int
    shard: int
    cycle: int
    kind: str                               # "exception" | "crash" | "timeout" | "protocol"
    message: str                            # the child's traceback, verbatim


def failure_reason(message: str) -> str:
    """A WorkerFailure's message in one line: a traceback's exception (the lines after its last
    frame, joined); a message that ends in a stack (a hang's), the lines before it; else every
    line, joined ("worker 1 died with exit code -9")."""
    raw = [x for x in message.splitlines() if x.strip()]
    lines = [x.strip() for x in raw]
    frames = [i for i, x in enumerate(raw) if x.startswith("  ") or re.search(r'", line \d+, in ', x)]
    if frames:
        lines = lines[frames[-1] + 1:] or lines[:frames[0]] or lines
    return " ".join(lines) or "(it said nothing)"


class FarmError(RuntimeError):
    """A farm refused to start or to continue; the message names the worker and the remedy."""


class WorkerTimeout(FarmError):
    """A wait ran past its timeout; names the worker, shard and cycle and the exit codes."""


class FarmConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    env: EnvFactorySpec
    master_seed: int
    workers: int = 1
    shards_per_worker: int = 1
    games_per_worker: int = 2               # battles per worker, split evenly over its shards
    cycles: int = 16                        # T
    frame_stack: int = 1
    spin_us: int = 200                      # spin before sleeping on a semaphore (design 3.4)
    round_timeout_s: float = 30.0
    join_timeout_s: float = 10.0
    startup_timeout_s: float = 120.0
    launch_delay_s: float = 0.0
    max_restarts_per_worker: int = 3
    viewer: bool = True                     # worker 0's first shard gets viser="env"
    start_ordinals: list[int] | None = None  # per battle; a resume restores them
    start_generations: list[int] | None = None  # per worker; a resume restores them, so a worker
                                            # restarted before the checkpoint keeps its scripted
                                            # seed paths (design 3.7); None: generation 0
    start_in_flight: list[InFlight] | None = None  # a resume's battles that were mid-episode:
                                            # each is re-simulated at the first PLAN (design 3.9)
    debug_fault: str = ""                   # tests only: "raise:<w>:<steps>[:<gen>]",
                                            # "hang:<w>:<steps>[:<gen>]" (gen: that generation only)
    eval_plan: list[EvalEpisode] | None = None  # the evaluation mode (section 6); None: training
    scripted_mask_only: bool = True         # training: a scripted seat's observations mask-only
                                            # (section 9); eval mode always does it. 1.13x
                                            # game-steps/s, all-scripted [M], docs/throughput.md
    deals: list[dict[str, Any]] | None = None  # per battle, the kwargs of the royalegym
                                            # DeckCurriculumStateMutator its env deals with in
                                            # place of the env's own (ladder.seat_decks); None: the env's

    @property
    def games_per_shard(self) -> int:
        return self.games_per_worker // self.shards_per_worker

    @property
    def n_battles(self) -> int:
        return self.workers * self.games_per_worker

    @property
    def n_slots(self) -> int:
        return 2 * self.n_battles

    @property
    def n_shards(self) -> int:
        return self.workers * self.shards_per_worker

    def check(self) -> None:
        if self.games_per_worker % self.shards_per_worker or self.games_per_shard < 1:
            raise ValueError(f"games_per_worker={self.games_per_worker} must be a positive "
                             f"multiple of shards_per_worker={self.shards_per_worker}")
        if self.start_ordinals is not None and len(self.start_ordinals) != self.n_battles:
            raise ValueError(f"start_ordinals has {len(self.start_ordinals)} entries; the farm "
                             f"has {self.n_battles} battles")
        if self.start_generations is not None and len(self.start_generations) != self.workers:
            raise ValueError(f"start_generations has {len(self.start_generations)} entries; the "
                             f"farm has {self.workers} workers")
        for f in self.start_in_flight or ():
            if not 0 <= f.battle < self.n_battles or len(f.actions) != len(f.gammas) or \
                    self.start_ordinals is None or f.ordinal != self.start_ordinals[f.battle]:
                raise ValueError(f"start_in_flight: battle {f.battle} ordinal {f.ordinal} with "
                                 f"{len(f.actions)} actions and {len(f.gammas)} gammas does not fit a farm "
                                 f"of {self.n_battles} battles started at start_ordinals (one gamma per "
                                 "action, the ordinal the battle restarts at)")
        if self.deals is not None and len(self.deals) != self.n_battles:
            raise ValueError(f"deals has {len(self.deals)} entries; the farm has {self.n_battles} battles: "
                             "one deal a battle, in battle order")
        if self.eval_plan is not None:
            if self.start_ordinals is not None:
                raise ValueError("eval_plan with start_ordinals: an evaluation farm starts every "
                                 "battle at ordinal 0 (its shards' queues decide the hosting)")
            for i, e in enumerate(self.eval_plan):
                for seat, p in enumerate(e.players):
                    if p.startswith(WORKER_PLAYERS):
                        try:
                            check_worker_player(p)
                        except ValueError as exc:
                            raise ValueError(f"eval_plan[{i}].players[{seat}]: {exc}") from None


SLEEP_S = 0.05   # the longest a waiting side sleeps on a semaphore before looking again (design 3.4)

def _wait_word(is_new: Callable[[], bool], sem: Any, spin_s: float, sleep_s: float) -> bool:
    """True once is_new() (the control word) says so, having taken the token that announced it.
    Spin for spin_s timed with perf_counter (time.monotonic moves in 15.6 ms steps on Windows),
    then sleep on the semaphore for at most sleep_s. The word is the truth; a wake is not."""
    if is_new():
        sem.acquire(timeout=5.0)                  # the token follows the word; take it
        return True
    end = time.perf_counter() + spin_s
    while time.perf_counter() < end:
        if is_new():
            sem.acquire(timeout=5.0)
            return True
    # a token is released only after its word is written, so a token taken here is a command
    return bool(sem.acquire(timeout=sleep_s))


# --- 9. The shard runner: the worker's loop body (design 3.5), shared by both farms ---------------
# A ShardRunner is one shard's vec env, composed of its Seats (who acts in each slot) and its
# RunningEpisodes (which episode each battle plays and what it has counted); step() is STEP,
# apply_slot_plan() is PLAN.

def _battle_seed(master_seed: int, base: int, game: int, ordinal: int) -> int:
    return derive_int(master_seed, f"env/battle/{base + game}/ordinal/{ordinal}")


class RunningEpisodes:
    """What the worker knows of each running episode of one shard: which one it is (its reset
    ordinal and seed; in the evaluation mode its plan index, popped from the shard's queue when
    the vec env resets the battle) and what it has counted for its EpisodeRecord (per battle
    the decision index and the non-no-op actions of both seats, what re-simulates it; per slot
    the cards played, the illegal commands and the undiscounted return)."""

    def __init__(self, cfg: FarmConfig, w: int, s: int, ordinals: list[int]) -> None:
        import functools
        M = cfg.games_per_shard
        self.cfg, self.w, self.s, self.plan = cfg, w, s, cfg.eval_plan   # plan None: training
        self.battle0 = (w * cfg.shards_per_worker + s) * M
        self.ordinal = np.asarray(ordinals, np.int64)       # of the episode now running
        self.eval_ix = np.full(M, -1, np.int64)             # evaluation: plan index now playing
        if self.plan is not None:
            j = w * cfg.shards_per_worker + s
            self.queue = collections.deque(eval_queue(len(self.plan), cfg.n_shards, j))
        self.seed_fn = (self._eval_seed if self.plan is not None    # the vec env's autoreset_seed_fn
                        else functools.partial(_battle_seed, cfg.master_seed, self.battle0))
        self.ep_step = np.zeros(M, np.int64)                # decision index within the episode
        self.cards = np.zeros(2 * M, np.int64)
        self.illegal = np.zeros(2 * M, np.int64)
        self.ret = np.zeros(2 * M, np.float64)
        self.played: list[list[tuple[int, int, int]]] = [[] for _ in range(M)]

    def _eval_seed(self, game: int, ordinal: int) -> int:
        """autoreset_seed_fn in the evaluation mode (section 6): the vec env calls it for each
        game that starts an episode, in ascending game order, so popping the shard's queue here
        is the rule the parent replays. Returns the episode's own seed (an idle battle's: a named
        filler)."""
        i = self.queue.popleft() if self.queue else -1
        self.eval_ix[game] = i
        if i >= 0:
            return int(self.plan[i].seed)
        return _eval_idle_seed(self.cfg.master_seed, self.battle0 + game, ordinal)

    def seed(self, g: int) -> int:
        """The seed (as u64) of the episode battle g is playing: the plan entry's `seed`."""
        if self.plan is not None:
            i = int(self.eval_ix[g])
            seed = (int(self.plan[i].seed) if i >= 0 else
                    _eval_idle_seed(self.cfg.master_seed, self.battle0 + g, int(self.ordinal[g])))
        else:
            seed = _battle_seed(self.cfg.master_seed, self.battle0, g, int(self.ordinal[g]))
        return seed & 0xFFFF_FFFF_FFFF_FFFF

    def note_actions(self, acts: np.ndarray, noop: int, g0: int = 0) -> None:
        """Before the step: every non-no-op action, as (decision index, seat, action). `acts`
        covers the slots of battles g0, g0 + 1, ... (a replay steps one battle at a time)."""
        for i in np.flatnonzero(acts != noop):
            g = g0 + i // 2
            self.played[g].append((int(self.ep_step[g]), int(i % 2), int(acts[i])))

    def count(self, reward: np.ndarray, deploy: np.ndarray, g0: int = 0) -> None:
        """After the step: deploy_status 0 is a card played, 1..11 an illegal command."""
        sl = slice(2 * g0, 2 * g0 + len(reward))
        self.ep_step[g0: g0 + len(reward) // 2] += 1
        self.ret[sl] += reward
        self.cards[sl] += deploy == 0
        self.illegal[sl] += (deploy >= 1) & (deploy <= 11)

    def record(self, i: int, fin: dict[str, Any], winner: int, outcome: int,
               eval_ix_ended: np.ndarray, envs: list[Any]) -> dict[str, Any]:
        """Slot i's finished episode: every EpisodeRecord field but the three the parent adds
        (policy_id, opponent_id, bucket). envs: the vec env's, battle g's at g. The slot's counters
        restart."""
        g = i // 2
        k = int(self.ordinal[g])
        ev = -1
        if self.plan is not None:
            ev = int(eval_ix_ended[g])
            ep = self.plan[ev]
            seed_path, seed = ep.seed_path, int(ep.seed)
        else:
            seed_path = f"env/battle/{self.battle0 + g}/ordinal/{k}"
            seed = _battle_seed(self.cfg.master_seed, self.battle0, g, k)
        terms = {key.split("/", 1)[1]: float(fin[key][i]) for key in fin
                 if key.startswith("reward_sum/") and fin["_" + key][i]}
        out = {
            "slot": 2 * self.battle0 + int(i), "worker": self.w, "shard": self.s,
            "battle": self.battle0 + g, "seat": int(i % 2), "ordinal": k,
            "episode_seed_path": seed_path, "episode_seed": seed, **_final_info_fields(fin, i),
            "winner": winner, "outcome": outcome, "cards_played": int(self.cards[i]),
            "illegal_commands": int(self.illegal[i]), "undiscounted_return": float(self.ret[i]),
            "reward_terms": terms, "played": self.played[g], "eval_index": ev,
            "reward_terms_step_abs": episode_step_abs(envs[g], i % 2),
            "trajectory_digest": envs[g].recorder.digest,
            "elixir_uncountable": envs[g].recorder.elixir_uncountable,
        }
        self.cards[i] = self.illegal[i] = 0
        self.ret[i] = 0.0
        return out

    def next_episode(self, g: int) -> None:
        """Battle g's vec env has reset it into its next episode."""
        self.ordinal[g] += 1
        self.ep_step[g] = 0
        self.played[g] = []


def transition_deploy_tick(info: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Each slot's deploy_status and tick for the transition just taken. After an autoreset the
    flat info keys hold the NEW episode's reset info; the ended transition's own are in
    final_info."""
    deploy = np.asarray(info["deploy_status"]).astype(np.int64)
    tick = np.asarray(info["tick"]).astype(np.int64)
    fin = info.get("final_info")
    if fin is not None:
        m = np.asarray(info["_final_info"])
        deploy[m] = np.asarray(fin["deploy_status"])[m]
        tick[m] = np.asarray(fin["tick"])[m]
    return deploy, tick


def _final_info_fields(fin: dict[str, Any], i: int) -> dict[str, Any]:
    """The EpisodeRecord fields copied out of slot i's final_info."""
    return {
        "episode_steps": int(fin["episode_steps"][i]),
        "episode_ticks": int(fin["episode_ticks"][i]),
        "own_crowns": int(fin["own_crowns"][i]),
        "enemy_crowns": int(fin["enemy_crowns"][i]),
        "own_tower_hp_frac": float(fin["own_tower_hp_frac"][i]),
        "enemy_tower_hp_frac": float(fin["enemy_tower_hp_frac"][i]),
        "elixir_leak_steps": int(fin["elixir_leak_steps"][i]),
        "elixir_count_exact": bool(fin["elixir_count_exact"][i]),
    }


class Seats:
    """Who acts in each slot of one shard, on the worker's side: its group (learner, resident
    snapshot, scripted, dead, idle), its scripted opponent's index, and for a scripted seat the
    player and the generator of its running episode; per battle, the ordinal its seats were given
    for. Seated from the assign entries and the PLAN command (training) or from the evaluation
    plan. A scripted seat, or a stopped battle's, is built mask-only from its next observation on
    (royalegym set_mask_only): a scripted player reads only legality."""

    def __init__(self, cfg: FarmConfig, vec: Any, w: int, gen: int, slot0: int, n: int) -> None:
        self.cfg, self.vec, self.w, self.gen, self.slot0 = cfg, vec, w, gen, slot0
        self.group = np.full(n, GROUP_LEARNER, np.int8)
        self.opp_ix = np.full(n, -1, np.int8)
        self.asg_ordinal = np.full(n // 2, -1, np.int64)   # the ordinal each battle's seats are for
        self.scripted: list[Any] = [None] * n
        self.rngs: list[Any] = [None] * n                   # set per episode when a seat is seated
        self.idle = np.zeros(n, bool)                       # evaluation: a stopped battle's seats
        self._scratch: Any = None                           # scratch(): a lookahead's, built on use

    def seat(self, present: np.ndarray, group: np.ndarray, opp_ix: np.ndarray,
             ordinal: np.ndarray) -> None:
        """Seat slots `present` (shard-local) from an assign or plan area (group, opponent index)
        for the episodes their battles are running (`ordinal`, per battle)."""
        for i in present:
            self.group[i] = group[i]
            self.opp_ix[i] = opp_ix[i]
            self.scripted[i] = (make_scripted(SCRIPTED_NAMES[self.opp_ix[i]])
                                if self.group[i] == GROUP_SCRIPTED else None)
            self.asg_ordinal[int(i) // 2] = ordinal[int(i) // 2]
            if self.scripted[i] is not None:
                self.rngs[i] = derive_generator(self.cfg.master_seed, scripted_stream(
                    self.slot0 + int(i), self.gen, int(ordinal[int(i) // 2])))
        if self.cfg.scripted_mask_only:
            # An assignment arrives with its episode's first action, after the episode's first
            # observation was built; from the next one on a scripted seat is built mask-only.
            # The env's set lasts until its next reset, which clears it.
            for g in sorted({int(i) // 2 for i in present}):
                skip = [("blue", "red")[seat] for seat in (0, 1) if self.scripted[2 * g + seat] is not None]
                if skip:
                    self.vec.envs[g].set_mask_only(skip)

    def check_repeats(self, g: int, e: np.ndarray, k: int, opponents: bool, where: str) -> None:
        """Battle g's plan entries `e`, for the episode it is running (ordinal k), must repeat what
        its seats hold: the groups and, with `opponents`, the opponent indices."""
        group, opp_ix = self.group[2 * g: 2 * g + 2], self.opp_ix[2 * g: 2 * g + 2]
        if not (np.array_equal(e["group"], group) and
                (not opponents or np.array_equal(e["opponent_ix"], opp_ix))):
            raise FarmError(
                f"{where}: the plan seats groups {e['group'].tolist()} "
                f"opponents {e['opponent_ix'].tolist()} mid-episode (ordinal {k}); the "
                f"worker holds {group.tolist()} {opp_ix.tolist()} (design 3.6: no reassignment "
                "mid-episode)")

    def seat_eval(self, g: int, ep: EvalEpisode | None) -> None:
        """Battle g just reset into an evaluation episode: seat its planned players, or stop the
        battle (ep None: its shard's queue is empty)."""
        env = self.vec.envs[g]
        if ep is None:
            for seat in (0, 1):
                r = 2 * g + seat
                self.group[r], self.scripted[r], self.idle[r] = GROUP_IDLE, None, True
            env.set_mask_only(("blue", "red"))
            return
        skip, searching = [], False
        for seat, (player, stream) in enumerate(zip(ep.players, ep.streams, strict=True)):
            r = 2 * g + seat
            self.idle[r] = False
            if player.startswith(WORKER_PLAYERS):
                self.group[r] = GROUP_SCRIPTED
                self.scripted[r] = worker_player(player, self.scratch)
                self.rngs[r] = derive_generator(self.cfg.master_seed, stream)
                skip.append(("blue", "red")[seat])
                if isinstance(self.scripted[r], LookaheadPlayer):
                    self.scripted[r].bind(env, seat)
                    searching = True
            else:
                self.group[r], self.scripted[r] = GROUP_LEARNER, None
        if skip and not searching:     # a lookahead snapshots the battle: both seats stay full
            env.set_mask_only(skip)

    def scratch(self) -> Any:
        """The shard's scratch env, where its lookahead seats play their candidates on (built once,
        like the live ones)."""
        if self._scratch is None:
            self._scratch = scratch_env(self.cfg.env)
        return self._scratch

    def search_counts(self, r: int) -> dict[str, int]:
        """Slot r's lookahead counters for its episode's record ({} for any other seat)."""
        p = self.scripted[r]
        return ({"lookahead_choices": p.choices, "lookahead_steps": p.steps}
                if isinstance(p, LookaheadPlayer) else {})

    def actions(self, parent_actions: np.ndarray, obs: dict[str, np.ndarray], noop: int,
                first: int = 0) -> np.ndarray:
        """The parent's actions, a no-op on a stopped evaluation battle, and each scripted seat's
        own, drawn from its episode's generator on the seat's current observation. The arrays
        cover the local slots first, first + 1, ... (a replay passes one battle's two)."""
        mine = slice(first, first + len(parent_actions))
        acts = parent_actions.astype(np.int64)
        acts[self.idle[mine]] = noop            # a stopped evaluation battle waits
        for i in np.flatnonzero(self.group[mine] == GROUP_SCRIPTED):
            one = {k: v[i] for k, v in obs.items()}
            r = first + int(i)
            acts[i] = self.scripted[r].act(one, obs["action_mask"][i], self.rngs[r])
        return acts


class ShardRunner:
    """One ClashSelfPlayVecEnv and everything counted about it: the worker's side of one shard.
    numpy only. reset() publishes the first observations, step() is the STEP command,
    apply_slot_plan() the PLAN command. Who acts in each slot is self.seats; which episode each
    battle plays and what it has counted, self.running."""

    def __init__(self, cfg: FarmConfig, table: Any, w: int, s: int, gen: int,
                 ordinals: list[int]) -> None:
        self.cfg, self.w, self.s = cfg, w, s
        M = cfg.games_per_shard
        self.n = 2 * M
        self.slot0 = 2 * (w * cfg.shards_per_worker + s) * M
        self.plan = cfg.eval_plan                           # None: training
        self.running = RunningEpisodes(cfg, w, s, ordinals)
        # design 3.8 step 11: the viewer binds a UDP port a process, so worker 0's first shard alone has it
        viser = "env" if (cfg.viewer and w == 0 and s == 0) else None
        self.vec = build_vec(cfg.env, M, viser=viser, autoreset_seed_fn=self.running.seed_fn,
                             spare_engines=True)
        self.vec.set_episode_ordinals(ordinals)
        if cfg.deals is not None:   # before the first reset, which deals from the episode's seed
            from royalegym.state_mutator import DeckCurriculumStateMutator
            for i, e in enumerate(self.vec.envs):
                e.state_mutator = DeckCurriculumStateMutator(**cfg.deals[self.running.battle0 + i])
        self.packer = codec.Packer(table)
        self.row_bytes = table.row_bytes
        self.seats = Seats(cfg, self.vec, w, gen, self.slot0, self.n)
        self.gamma: float | None = None
        self.obs: dict[str, np.ndarray] | None = None
        self.steps_taken = 0
        # design 3.9: the battles a resume starts mid-episode, re-simulated at the first PLAN (which
        # seats them). A restarted worker's battles moved on to their next ordinal and match none.
        b0 = self.running.battle0
        self.in_flight = {f.battle - b0: f for f in cfg.start_in_flight or ()
                          if b0 <= f.battle < b0 + M and f.ordinal == ordinals[f.battle - b0]}
        fault = cfg.debug_fault.split(":") if cfg.debug_fault else []
        self.fault = (fault[0], int(fault[2])) if (fault and int(fault[1]) == w and s == 0 and
                                                   (len(fault) < 4 or int(fault[3]) == gen)) else None

    # the seats, under the names a reader of one runner looks for
    group = property(lambda self: self.seats.group, doc="int8 (n,): each slot's group")
    scripted = property(lambda self: self.seats.scripted, doc="each slot's scripted player or None")
    asg_ordinal = property(lambda self: self.seats.asg_ordinal, doc="int64 (n/2,): its seats' ordinal")

    def episode_seed(self, g: int) -> int:
        """The seed (as u64) of the episode battle g is playing: the plan entry's `seed`."""
        return self.running.seed(g)

    def reset(self, io: ShardIO, rect_row: np.ndarray) -> None:
        """Start every battle's episode (seeded by name, env/battle/{b}/ordinal/{k}) and publish
        the first observations. reset() gets no seed: every episode, the first included, takes
        its seed from autoreset_seed_fn, so design 2.2's shard path env/worker/{w}/shard/{s}/gen/{g}
        has no consumer here; a restart moves each battle to its next ordinal instead, and the
        generation reaches the scripted opponents' streams."""
        obs, _ = self.vec.reset()
        self.obs = obs
        if self.plan is not None:
            for g in range(self.n // 2):
                self._begin_eval_episode(g)
        t0 = time.perf_counter_ns()
        self.packer.pack(obs, rect_row, self.slot0)
        io.scalars[:] = np.zeros(self.n, SCALAR_DTYPE)
        io.scalars["flags"] = np.where(self.seats.idle, 0, F_VALID).astype(np.uint8)
        io.scalars["group"] = self.seats.group
        io.episodes[:4] = 0
        io.control["t_env_ns"] = 0
        self._write_stats(io, time.perf_counter_ns() - t0, self.n * self.row_bytes)

    def _write_stats(self, io: ShardIO, codec_ns: int, bytes_out: int) -> None:
        io.stats["codec_ns"] = codec_ns
        io.stats["bytes_out"] = bytes_out
        io.stats["clipped"] = self.packer.clipped
        io.stats["rounded"] = getattr(self.packer, "rounded", 0)

    def _begin_eval_episode(self, g: int) -> None:
        """Battle g just reset into an evaluation episode: seat its planned players (or stop it)."""
        i = int(self.running.eval_ix[g])
        self.seats.seat_eval(g, self.plan[i] if i >= 0 else None)

    # -- PLAN -------------------------------------------------------------------------------------
    def apply_slot_plan(self, plan: np.ndarray, frames: np.ndarray) -> None:
        """The PLAN command (design 3.5): the iteration's opening table for this shard's slots
        (PLAN_DTYPE, n entries). A battle whose seats the worker does not hold for its running
        episode yet (a fresh or restarted worker; an episode that started on the previous
        iteration's last round) is seated from it; for every other battle the entry must repeat
        what the worker holds. Ordinal and seed must match the worker's own episode: a plan that
        disagrees means parent and worker are out of step, and that is an error, not a choice.
        A resumed farm's first PLAN then re-simulates the battles it started mid-episode, their
        last k observations into `frames` (rect rows 0..k-1; design 3.9)."""
        where = f"worker {self.w} shard {self.s}"
        ordinal, eval_ix = self.running.ordinal, self.running.eval_ix
        take = []
        for g in range(self.n // 2):
            e = plan[2 * g: 2 * g + 2]
            slot = self.slot0 + 2 * g
            if self.plan is not None:           # evaluation: the worker seats from eval_plan
                idle_p, idle_w = bool((e["group"] == GROUP_IDLE).all()), bool(eval_ix[g] < 0)
                if idle_p != idle_w:
                    raise FarmError(f"{where} slot {slot}: the plan says idle={idle_p}, the worker's "
                                    f"queue says idle={idle_w} (evaluation farm out of step)")
                if idle_w:
                    continue                    # a stopped battle's ordinals are the worker's own
            k = int(e["ordinal"][0])
            if k != int(ordinal[g]) or int(e["seed"][0]) != self.episode_seed(g):
                raise FarmError(
                    f"{where} slot {slot}: the plan is for ordinal {k} seed {int(e['seed'][0])}, "
                    f"the battle plays ordinal {int(ordinal[g])} seed {self.episode_seed(g)}; "
                    "parent and worker are out of step (restart the run from its checkpoint)")
            if self.plan is not None or self.seats.asg_ordinal[g] == k:
                self.seats.check_repeats(g, e, k, self.plan is None, f"{where} slot {slot}")
            else:
                take += [2 * g, 2 * g + 1]
        self.seats.seat(np.asarray(take, np.int64), plan["group"], plan["opponent_ix"], ordinal)
        if self.in_flight:
            self._replay(frames)

    def _replay(self, frames: np.ndarray) -> None:
        """Design 3.9: step each in-flight battle's own env from its reset through the decisions
        the parent logged, under the gammas they were taken with. The scripted seats act again
        (same generator, same observations: the same actions), the episode's counters and its
        `played` list fill as they did, and a decision that ends the episode is an error: the
        log and the engine disagree. Its last k observations are packed into `frames`, newest
        last; older rows, from before the episode, are dead frames the learner zeroes."""
        from royalegym.action import NOOP
        k = frames.shape[0]
        for g, f in sorted(self.in_flight.items()):
            env, two = self.vec.envs[g], slice(2 * g, 2 * g + 2)
            seen = [{key: v[two].copy() for key, v in self.obs.items()}]   # self.obs is rewritten below
            for d, (pair, gamma) in enumerate(zip(f.actions, f.gammas, strict=True)):
                set_env_gamma(env, gamma)
                acts = self.seats.actions(np.asarray(pair), seen[-1], NOOP, first=2 * g)
                self.running.note_actions(acts, NOOP, g0=g)
                obs, rew, term, trunc, info = env.step({"blue": int(acts[0]), "red": int(acts[1])})
                if term["blue"] or trunc["blue"]:
                    raise FarmError(f"worker {self.w} shard {self.s}: battle {f.battle} ordinal {f.ordinal} "
                                    f"ended at logged decision {d} of {len(f.actions)} on replay; the "
                                    "checkpoint's action log and the engine disagree (design 3.9)")
                self.running.count(np.array([rew["blue"], rew["red"]], np.float32),
                                   np.array([info["blue"]["deploy_status"], info["red"]["deploy_status"]],
                                            np.int64), g0=g)
                seen = seen[1 - k:] if k > 1 else []
                seen.append({key: np.stack([obs["blue"][key], obs["red"][key]]).astype(v.dtype)
                             for key, v in self.obs.items()})
            for key, v in self.obs.items():
                v[two] = seen[-1][key]
            for q, one in enumerate(seen):
                self.packer.pack(one, frames[k - len(seen) + q], self.slot0 + 2 * g)
        self.in_flight = {}
        self.gamma = None                       # the next STEP forwards its gamma to every env

    # -- STEP -------------------------------------------------------------------------------------
    def step(self, io: ShardIO, rect_row: np.ndarray, gamma: float) -> None:
        """The STEP command (design 3.5): seat the assignments that arrived, take the actions
        (the parent's; the scripted seats' own), step the vec env (it autoresets ended battles),
        and publish the transition: scalars, finals and episode records in the shard's block,
        the next observations in rect_row, this round's stats."""
        from royalegym.action import NOOP
        self._planted_fault()
        self._apply_assignments(io.assign)
        acts = self.seats.actions(io.actions, self.obs, NOOP)
        self._forward_gamma(gamma)
        acted_group = self.seats.group.copy()
        self.running.note_actions(acts, NOOP)
        eval_ix_ended = self.running.eval_ix.copy()   # the autoreset below pops the next episodes
        t0 = time.perf_counter_ns()
        obs, rew, term, trunc, info = self.vec.step(acts)
        io.control["t_env_ns"] = time.perf_counter_ns() - t0
        deploy, tick = transition_deploy_tick(info)
        self.running.count(rew, deploy)
        sc = np.zeros(self.n, SCALAR_DTYPE)
        sc["reward"] = rew
        sc["group"] = acted_group
        sc["flags"] = (F_TERMINATED * term + F_TRUNCATED * trunc
                       + F_VALID * ~self.seats.idle).astype(np.uint8)
        sc["deploy_status"] = deploy
        sc["tick"] = tick
        done = term | trunc
        records: list[dict[str, Any]] = []
        finals_ns = 0
        if done.any():
            records, finals_ns = self._end_episodes(io, sc, done, trunc, info, eval_ix_ended)
        io.scalars[:] = sc
        record_bytes = write_episodes(io, records, f"worker {self.w} shard {self.s}")
        self._publish(io, rect_row, obs, sc, finals_ns, record_bytes)

    def _apply_assignments(self, assign: np.ndarray) -> None:
        if self.plan is not None:
            return                              # the evaluation mode seats from its plan
        self.seats.seat(np.flatnonzero(assign["present"]), assign["group"], assign["opponent_ix"],
                        self.running.ordinal)

    def _planted_fault(self) -> None:
        """FarmConfig.debug_fault (tests only): raise, or hang, from this shard's Nth step on."""
        self.steps_taken += 1
        if self.fault is not None and self.steps_taken >= self.fault[1]:
            if self.fault[0] == "raise":
                raise RuntimeError(f"planted fault in worker {self.w} at step {self.steps_taken}")
            if self.fault[0] == "hang":
                time.sleep(3600)

    def _forward_gamma(self, gamma: float) -> None:
        """The schedule's gamma reaches every reward term that takes one (design 4)."""
        if gamma != self.gamma:
            for env in self.vec.envs:
                set_env_gamma(env, gamma)
            self.gamma = gamma

    def _end_episodes(self, io: ShardIO, sc: np.ndarray, done: np.ndarray, trunc: np.ndarray,
                      info: dict[str, Any], eval_ix_ended: np.ndarray,
                      ) -> tuple[list[dict[str, Any]], int]:
        """Every slot whose episode ended on this step: its end fields in `sc`, its packed final
        observation if truncated (the bootstrap's, design 6.1), its record; then each ended
        battle moves to its next episode (the vec env already reset it). Returns the records
        and the nanoseconds spent packing finals."""
        fin, fo = info.get("final_info"), info["final_obs"]
        records: list[dict[str, Any]] = []
        pack_finals_ns = 0
        for i in map(int, np.flatnonzero(done)):
            if self.seats.idle[i]:
                continue                        # a stopped evaluation battle reports nothing
            winner = int(fin["winner"][i]) if "winner" in fin and fin["_winner"][i] else -1
            outcome = int(fin["outcome"][i]) if "outcome" in fin and fin["_outcome"][i] else 0
            sc["episode_end"][i] = (END_NO_RESULT if winner == -1 else END_WIN if outcome == 1
                                    else END_LOSS if outcome == -1 else END_DRAW)
            sc["episode_steps"][i] = fin["episode_steps"][i]
            sc["cards_played"][i] = self.running.cards[i]
            sc["elixir_leak"][i] = fin["elixir_leak_steps"][i]
            if trunc[i]:
                one = {k: np.asarray(v)[None] for k, v in fo[i].items()}
                t1 = time.perf_counter_ns()
                self.packer.pack(one, io.finals, int(i))
                pack_finals_ns += time.perf_counter_ns() - t1
                sc["flags"][i] |= F_FINAL
            records.append({**self.running.record(i, fin, winner, outcome, eval_ix_ended, self.vec.envs),
                            **self.seats.search_counts(i)})
        for g in np.flatnonzero(done[0::2]):
            self.running.next_episode(g)
            if self.plan is not None:
                self._begin_eval_episode(int(g))
        return records, pack_finals_ns

    def _publish(self, io: ShardIO, rect_row: np.ndarray, obs: dict[str, np.ndarray],
                 sc: np.ndarray, finals_ns: int, record_bytes: int) -> None:
        """Pack the next observations into the rectangle row; the round's codec time and bytes."""
        t1 = time.perf_counter_ns()
        self.packer.pack(obs, rect_row, self.slot0)
        codec_ns = time.perf_counter_ns() - t1 + finals_ns
        self.obs = obs
        n_final = int(((sc["flags"] & F_FINAL) != 0).sum())
        self._write_stats(io, codec_ns, (self.n + n_final) * self.row_bytes
                          + self.n * SCALAR_BYTES + record_bytes)


# --- 10. The parent side: the round protocol (design 3.6), shared by both farms -------------------
# _FarmCore (at the end) drives the protocol: begin_iteration, next_round, submit. It is composed
# of the parts below, each holding one kind of state: _EvalReplay (the evaluation mode's hosting),
# _AssignmentBook (what every battle plays), _FarmStats (the metrics), _Collection (what the
# learner reads, and how a round's answer is filed into it), _WorkerHealth (failures, restarts).

class RolloutRound:
    """One shard-round. Views, valid until the next next_round for the same shard.

    cycle      the observation cycle: rnd.obs_rows index farm.rect's first axis
    slots      int32[n], ascending; obs at farm.rect[cycle + frame_stack - 1, slots]
    group      int8[n], this round's routing, with the assignments drawn on it folded in
    new_episode bool[n], this cycle's observation is the first of an episode (frame liveness)
    row        cycle - 1: the rectangle row of the ACTION whose consequences the scalars below
               are (-1 on the first round of an iteration: nothing arrived)
    reward, terminated, truncated, valid, deploy_status, tick, episode_end: that transition's
    episodes   EpisodeRecords of episodes that ended on this round
    ended_battles int[n_ended], ascending
    """

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def bucket_of(role: int) -> str:
    return ("mirror", "pool", "scripted")[role]


class _EvalReplay:
    """The evaluation mode's parent side (section 6): which plan episode each (battle, ordinal)
    plays, found by replaying the rule the workers' vec envs follow when they pop their shard's
    queue -- once per (battle, ordinal), at the opening in ascending battle order, then for the
    battles that ended on a round in ascending order."""

    def __init__(self, cfg: FarmConfig) -> None:
        self.cfg = cfg
        n = len(cfg.eval_plan)
        self.queues = [collections.deque(eval_queue(n, cfg.n_shards, j)) for j in range(cfg.n_shards)]
        self.plan_index: dict[tuple[int, int], int] = {}    # (battle, ordinal) -> plan index
        for b in range(cfg.n_battles):                      # the opening, as the workers' resets
            self.assign(b, 0)

    def assign(self, b: int, k: int) -> Assignment:
        """The farm's assign_fn in the evaluation mode."""
        if (b, k) not in self.plan_index:
            q = self.queues[b // self.cfg.games_per_shard]
            self.plan_index[(b, k)] = q.popleft() if q else -1
        i = self.plan_index[(b, k)]
        if i < 0:
            return Assignment(b, k, ROLE_POOL, None, (GROUP_IDLE, GROUP_IDLE), -1)
        ep = self.cfg.eval_plan[i]
        g = tuple(GROUP_SCRIPTED if p.startswith(WORKER_PLAYERS) else GROUP_LEARNER for p in ep.players)
        return Assignment(b, k, ROLE_POOL, f"eval:{i}", (g[0], g[1]), -1)

    def seed(self, b: int, k: int) -> int:
        """The reset seed of battle b's episode k: its plan episode's, or a stopped battle's filler."""
        i = self.plan_index.get((b, k), -1)
        return (int(self.cfg.eval_plan[i].seed) if i >= 0
                else _eval_idle_seed(self.cfg.master_seed, b, k))

    def slot_plan(self, iteration: int, opening: bool, ordinals: np.ndarray,
                  assignment: list[Assignment | None]) -> SlotPlan:
        """The farm's eval_slot_plan: the SlotPlan for begin_iteration in the evaluation mode, the
        opening table before the first iteration, the current assignments after (design 3.6's rule
        holds here too)."""
        table = (tuple(self.assign(b, int(k)) for b, k in enumerate(ordinals)) if opening
                 else tuple(assignment))
        return SlotPlan(iteration, self.cfg.n_battles, self.cfg.n_slots, table, ())

    def index(self, ordinals: np.ndarray) -> np.ndarray:
        """The farm's eval_index: int64 (n_battles,), the eval_plan index each battle is playing
        now, -1 once stopped (the farm's eval_done: every battle stopped)."""
        return np.array([self.plan_index.get((b, int(k)), -1) for b, k in enumerate(ordinals)],
                        np.int64)

    def players(self, a: Assignment, seat: int) -> tuple[str, str]:
        p = self.cfg.eval_plan[int(a.opponent_id.split(":", 1)[1])].players
        return p[seat], p[1 - seat]


class _AssignmentBook:
    """What every battle plays, on the parent's side (design 3.6): the reset ordinal of its
    running episode, that episode's Assignment, the routing it implies per slot (group, scripted
    opponent index), and which slots' assignments the worker has yet to be told. An assignment
    changes only at its battle's own episode boundary: drawn by assign_fn when the parent reads
    the end, or handed to submit by a caller that has none."""

    def __init__(self, cfg: FarmConfig, assign_fn: Callable[[int, int], Assignment] | None,
                 replay: _EvalReplay | None) -> None:
        self.cfg, self.assign_fn, self.replay = cfg, assign_fn, replay
        self.ordinals = np.asarray(cfg.start_ordinals if cfg.start_ordinals is not None
                                   else [0] * cfg.n_battles, np.int64)
        self.assignment: list[Assignment | None] = [None] * cfg.n_battles
        self.group = np.full(cfg.n_slots, GROUP_LEARNER, np.int8)
        self.opp_ix = np.full(cfg.n_slots, -1, np.int8)
        self.unsent = np.zeros(cfg.n_slots, bool)          # to send on the shard's next STEP

    def set(self, a: Assignment) -> None:
        self.assignment[a.battle] = a
        for seat in (0, 1):
            r = 2 * a.battle + seat
            self.group[r] = a.group[seat]
            self.opp_ix[r] = (SCRIPTED_NAMES.index(a.opponent_id.split(":", 1)[1])
                              if a.group[seat] == GROUP_SCRIPTED and self.replay is None
                              else -1)
            self.unsent[r] = True

    def check_shape(self, plan: SlotPlan) -> None:
        if plan.n_battles != self.cfg.n_battles or len(plan.assignment) != plan.n_battles:
            raise ValueError(f"SlotPlan for iteration {plan.iteration} has {plan.n_battles} "
                             f"battles / {len(plan.assignment)} assignments; the farm has "
                             f"{self.cfg.n_battles}")

    def open_iteration(self, plan: SlotPlan) -> None:
        """The iteration's opening table: taken for a battle the book has no assignment for
        yet, otherwise it must repeat the current one."""
        for b, a in enumerate(plan.assignment):
            if a.battle != b:
                raise ValueError(f"SlotPlan.assignment[{b}] is for battle {a.battle}")
            cur = self.assignment[b]
            if cur is None:
                self.set(a)
            elif cur != a:
                raise ValueError(
                    f"SlotPlan for iteration {plan.iteration} gives battle {b} {a}, but it is "
                    f"mid-episode under {cur}; assignments change only at a battle's own episode "
                    "boundary (design 3.6): build the plan from the current assignments")

    def episode_ended(self, b: int) -> None:
        """Battle b moved to its next ordinal; with an assign_fn, its next assignment is drawn."""
        self.ordinals[b] += 1
        if self.assign_fn is not None:
            a = self.assign_fn(b, int(self.ordinals[b]))
            if a.battle != b or a.ordinal != self.ordinals[b]:
                raise ValueError(f"assign_fn({b}, {self.ordinals[b]}) returned {a}")
            self.set(a)

    def take_given(self, assignments: list[Assignment] | tuple[Assignment, ...],
                   ended: list[int], c: int, j: int) -> None:
        """submit's `assignments`: none with an assign_fn; without one, exactly one for every
        battle that ended on the round, for its next ordinal."""
        if self.assign_fn is not None and assignments:
            raise FarmError("submit(assignments=...) on a farm built with an assign_fn: the farm "
                            "already drew them in next_round; pass one or the other")
        if self.assign_fn is None:
            given = {a.battle: a for a in assignments}
            want = set(int(b) for b in ended)
            if set(given) != want:
                raise FarmError(f"submit at cycle {c}, shard {j}: battles {sorted(want)} ended on "
                                f"this round and need an Assignment each; got {sorted(given)}")
            for b in sorted(want):
                a = given[b]
                if a.ordinal != self.ordinals[b]:
                    raise FarmError(f"Assignment for battle {b} has ordinal {a.ordinal}; its next "
                                    f"episode is ordinal {int(self.ordinals[b])}")
                self.set(a)

    def shard_ordinals(self, j: int) -> list[int]:
        """The ordinals of global shard j's battles: what its (re)started worker resets into."""
        b0 = j * self.cfg.games_per_shard
        return [int(x) for x in self.ordinals[b0: b0 + self.cfg.games_per_shard]]

    def abandon(self, sl: slice) -> None:
        """A restarted worker's slots: each battle moves to its next ordinal (its running
        episode is abandoned), its assignment redrawn for it, all to be sent again."""
        self.ordinals[sl.start // 2: sl.stop // 2] += 1
        self.unsent[sl] = True
        if self.assign_fn is not None:
            for b in range(sl.start // 2, sl.stop // 2):
                self.set(self.assign_fn(b, int(self.ordinals[b])))

    def assign_entries(self, sl: slice) -> np.ndarray:
        """ASSIGN_DTYPE for the slots `sl` of a STEP; present where not yet sent, now sent."""
        asg = np.zeros(sl.stop - sl.start, ASSIGN_DTYPE)
        asg["group"] = self.group[sl]
        asg["opponent_ix"] = self.opp_ix[sl]
        asg["learner_seat"] = [self.assignment[b].learner_seat
                               for b in range(sl.start // 2, sl.stop // 2) for _ in (0, 1)]
        asg["present"] = self.unsent[sl]
        self.unsent[sl] = False
        return asg

    def plan_table(self) -> np.ndarray:
        """PLAN_DTYPE (R,) from the current assignments, each entry with its episode's ordinal
        and reset seed (as u64)."""
        out = np.zeros(self.cfg.n_slots, PLAN_DTYPE)
        for b, a in enumerate(self.assignment):
            k = int(self.ordinals[b])
            seed = (self.replay.seed(b, k) if self.replay is not None
                    else derive_int(self.cfg.master_seed, f"env/battle/{b}/ordinal/{k}"))
            for seat in (0, 1):
                r = 2 * b + seat
                out[r]["role"], out[r]["learner_seat"] = a.role, a.learner_seat
                out[r]["group"], out[r]["opponent_ix"] = self.group[r], self.opp_ix[r]
                out[r]["seed"], out[r]["ordinal"] = seed & 0xFFFF_FFFF_FFFF_FFFF, k
        return out

    def policy_ids(self, a: Assignment, seat: int) -> tuple[str, str]:
        """(policy_id, opponent_id) of an episode record: who played the seat and against whom
        (the learner, or the assignment's opponent: a scripted name or a pool member's id)."""
        if self.replay is not None:
            return self.replay.players(a, seat)

        def name(g: int) -> str:
            return "learner" if g == GROUP_LEARNER else str(a.opponent_id)
        return name(a.group[seat]), name(a.group[1 - seat])

    def complete_record(self, raw: dict[str, Any], w: int, j: int) -> EpisodeRecord:
        """A worker's record completed with what only the parent knows (policy, opponent,
        bucket: from the assignment the episode was played under); in the evaluation mode,
        checked against the parent's replay of the shard's queue."""
        if self.replay is not None and \
                raw["eval_index"] != self.replay.plan_index.get((raw["battle"], raw["ordinal"])):
            raise FarmError(
                f"evaluation farm out of step: worker {w} shard {j} reports battle "
                f"{raw['battle']} ordinal {raw['ordinal']} played plan episode "
                f"{raw['eval_index']}, the parent's replay of its queue says "
                f"{self.replay.plan_index.get((raw['battle'], raw['ordinal']))}")
        a = self.assignment[raw["battle"]]
        pol, opp = self.policy_ids(a, raw["seat"])
        raw.update(policy_id=pol, opponent_id=opp, bucket=bucket_of(a.role))
        return msgspec.convert(raw, EpisodeRecord)


class _ActionLog:
    """Design 3.9: each battle's running episode as the parent drove it, so that a checkpoint can
    carry it (in_flight) and a resume re-simulate it. One row per submit: the two seats' actions
    and the gamma. A battle's log starts over when its ordinal moves (its episode ended, or a
    restart abandoned it); a resumed farm starts from the logs it was given."""

    def __init__(self, cfg: FarmConfig) -> None:
        self.M = cfg.games_per_shard
        self.ordinal = np.full(cfg.n_battles, -1, np.int64)
        self.actions: list[list[tuple[int, int]]] = [[] for _ in range(cfg.n_battles)]
        self.gammas: list[list[float]] = [[] for _ in range(cfg.n_battles)]
        for f in cfg.start_in_flight or ():
            self.ordinal[f.battle] = f.ordinal
            self.actions[f.battle], self.gammas[f.battle] = list(map(tuple, f.actions)), list(f.gammas)

    def add(self, j: int, acts: np.ndarray, gamma: float, ordinals: np.ndarray) -> None:
        """Shard j's submit: one decision for each of its battles."""
        for g in range(self.M):
            b = j * self.M + g
            if self.ordinal[b] != ordinals[b]:
                self.ordinal[b], self.actions[b], self.gammas[b] = ordinals[b], [], []
            self.actions[b].append((int(acts[2 * g]), int(acts[2 * g + 1])))
            self.gammas[b].append(gamma)

    def in_flight(self, ordinals: np.ndarray) -> list[InFlight]:
        """Every battle mid-episode at `ordinals`, in battle order (a battle at its reset has none)."""
        return [InFlight(b, int(k), list(self.actions[b]), list(self.gammas[b]))
                for b, k in enumerate(ordinals) if self.ordinal[b] == k and self.actions[b]]


class _Stats(dict):
    """A dict that also answers a call with itself, so that farm.stats[...] and farm.stats()[...]
    both read the metrics: callers use both spellings."""

    def __call__(self) -> "_Stats":
        return self


class _FarmStats:
    """The farm's metrics (design 9.2): this iteration's worker and wait times and bytes, summed
    over shard-rounds, and the run totals a restart must not lose (dropped rows, the packers'
    clip and round counters of every generation)."""

    def __init__(self, n_shards: int) -> None:
        self.rows_dropped_dead_worker_total = 0
        self._clip_last = np.zeros((n_shards, 2), np.int64)   # per shard: clipped, rounded (cumulative)
        self._clip_base = np.zeros(2, np.int64)             # counters of workers since restarted
        self.begin_iteration()

    def begin_iteration(self) -> None:
        self._it = {"env_ms": 0.0, "wait_ms": 0.0, "codec_ms": 0.0, "bytes_out": 0,
                    "rows_dropped_dead_worker": 0}
        self._it_t0 = time.perf_counter()
        self._it_t1: float | None = None

    def end_iteration(self) -> None:
        self._it_t1 = time.perf_counter()

    def waited(self, seconds: float) -> None:
        self._it["wait_ms"] += seconds * 1e3

    def count_round(self, j: int, io: ShardIO) -> None:
        st = io.stats[0]
        self._it["env_ms"] += float(io.control["t_env_ns"][0]) / 1e6
        self._it["codec_ms"] += float(st["codec_ns"]) / 1e6
        self._it["bytes_out"] += int(st["bytes_out"])
        self._clip_last[j] = (int(st["clipped"]), int(st["rounded"]))

    def dropped(self, cells: int) -> None:
        self._it["rows_dropped_dead_worker"] += cells
        self.rows_dropped_dead_worker_total += cells

    def restarted(self, shards: range) -> None:
        for j in shards:
            self._clip_base += self._clip_last[j]              # the dead generation's counts stay
            self._clip_last[j] = 0

    def snapshot(self, restarts: list[int]) -> _Stats:
        """The current (or last finished) iteration's farm metrics, design 3.7 / 9.2:
        env_ms       the workers' vec.step time, summed over every shard-round (worker side)
        codec_ms     the workers' codec.pack time (observations and finals), summed likewise
        wait_ms      the parent's time blocked in next_round waiting for a shard
        parent_wait_frac  wait_ms over the iteration's wall time (begin_iteration to its last
                     round; so far, while it runs): near 1 means the learner starves on the envs
        bytes_out    bytes the workers wrote across the boundary (rows, finals, scalars, records)
        rows_dropped_dead_worker  (cycle, slot) cells lost to a dead worker (design 3.7)
        worker_restarts, obs_codec_clipped, obs_codec_rounded  run totals (health/, design 3.3)"""
        end = self._it_t1 if self._it_t1 is not None else time.perf_counter()
        wall_ms = max((end - self._it_t0) * 1e3, 1e-9)
        clip = self._clip_base + self._clip_last.sum(axis=0)
        return _Stats(
            env_ms=self._it["env_ms"], wait_ms=self._it["wait_ms"], codec_ms=self._it["codec_ms"],
            parent_wait_frac=self._it["wait_ms"] / wall_ms, bytes_out=float(self._it["bytes_out"]),
            rows_dropped_dead_worker=float(self._it["rows_dropped_dead_worker"]),
            worker_restarts=float(sum(restarts)), obs_codec_clipped=float(clip[0]),
            obs_codec_rounded=float(clip[1]))


class _Collection:
    """What the current iteration has collected, in the layout the learner reads (design 1.1),
    and how each shard-round's answer is filed into it (design 3.6):
      first_obs   bool (T + k, R): rect row q holds the FIRST observation of its episode (a
                  reset, an autoreset, a restart). Frame liveness is read here, at the
                  observation's own row (design 1.1's transition alignment): see farm.first_obs
      scalars     SCALAR_DTYPE (T, R): row t is the transition the action at cycle t caused
      finals      {(t, r): row}: the packed final observation of each truncated transition
      episodes    the EpisodeRecords finished this iteration, in round order
      new_episode bool (R,): per slot, the last observation read is the first of an episode
      ended       the battles whose episodes ended on the last round read, ascending
    A record is completed, and an ended battle's next assignment drawn, by the farm's
    _AssignmentBook; each round's costs are counted in its _FarmStats."""

    def __init__(self, cfg: FarmConfig, book: _AssignmentBook, metrics: _FarmStats) -> None:
        self.T, self.k, self.n_shard = cfg.cycles, cfg.frame_stack, 2 * cfg.games_per_shard
        self.book, self.metrics = book, metrics
        self.new_episode = np.ones(cfg.n_slots, bool)
        self.first_obs = np.zeros((self.T + self.k, cfg.n_slots), bool)
        self.first_obs[self.k - 1] = True
        self.scalars = np.zeros((self.T, cfg.n_slots), SCALAR_DTYPE)
        self.finals: dict[tuple[int, int], np.ndarray] = {}
        self.episodes: list[EpisodeRecord] = []
        self.ended: list[int] = []
        # design 3.9: the slots a resume starts mid-episode. Their first publication is not a reset
        # (the first PLAN re-simulated them); for frame liveness, row k-1-n holds such an episode's
        # first observation when it is n < k decisions old
        self.resumed = np.zeros(cfg.n_slots, bool)
        for f in cfg.start_in_flight or ():
            two = slice(2 * f.battle, 2 * f.battle + 2)
            self.resumed[two] = True
            self.first_obs[self.k - 1, two] = False
            if len(f.actions) < self.k:
                self.first_obs[self.k - 1 - len(f.actions), two] = True

    def turn_over(self, rect: np.ndarray) -> None:
        """The last k rows (cycles T-k+1..T) become rows 0..k-1: cycle T is cycle 0 now; the
        previous iteration's scalars, finals and records are dropped."""
        rect[: self.k] = rect[self.T: self.T + self.k]
        self.first_obs[: self.k] = self.first_obs[self.T: self.T + self.k]
        self.first_obs[self.k:] = False
        self.scalars[:] = np.zeros(1, SCALAR_DTYPE)
        self.finals = {}
        self.episodes = []

    def read(self, iteration: int, c: int, j: int, w: int, io: ShardIO | None, dead: bool) -> RolloutRound:
        """File shard j's round at cycle c and return its views. io: the shard's answer, None
        when none arrived (a dead worker; at cycle 0, a reset publication already read)."""
        sl = slice(j * self.n_shard, (j + 1) * self.n_shard)
        self.ended = []
        episodes: list[EpisodeRecord] = []
        if io is None and c > 0 and dead:
            self._file_dead(c - 1, sl)
        elif io is not None and c > 0:
            self.metrics.count_round(j, io)
            episodes = [self.book.complete_record(raw, w, j)
                        for raw in self._file_answer(c, sl, io)]
            self.ended = sorted({e.battle for e in episodes})
            for b in self.ended:                 # ascending battle order; ends come in pairs
                self.book.episode_ended(b)
            self.episodes.extend(episodes)
        elif io is not None:
            self.metrics.count_round(j, io)      # a reset publication: pack cost, bytes
            self.new_episode[sl] = ~self.resumed[sl]   # the reset's first observations; a resumed
            self.first_obs[c + self.k - 1, sl] = ~self.resumed[sl]   # battle's are mid-episode
            self.resumed[sl] = False
        return self._view(iteration, c, j, w, sl, io, dead, episodes)

    def _file_answer(self, c: int, sl: slice, io: ShardIO) -> list[dict[str, Any]]:
        """A STEP answer onto row c - 1: scalars, finals, which observations of cycle c start an
        episode. Returns the episode records as the worker wrote them."""
        row = c - 1
        sc = io.scalars.copy()
        self.scalars[row, sl] = sc
        for i in np.flatnonzero(sc["flags"] & F_FINAL):
            self.finals[(row, sl.start + int(i))] = io.finals[i].copy()
        done = (sc["flags"] & (F_TERMINATED | F_TRUNCATED)) != 0
        self.new_episode[sl] = done
        self.first_obs[c + self.k - 1, sl] = done
        return read_episodes(io)

    def _file_dead(self, row: int, sl: slice) -> None:
        """A dead worker's slots arrive with valid=False rather than not arriving (design 3.1);
        the row before the failure keeps its flags: if its transition completed, truncate_open
        marked it truncated so the learner bootstraps from the observation that exists."""
        sc = np.zeros(self.n_shard, SCALAR_DTYPE)
        sc["group"] = GROUP_DEAD
        self.scalars[row, sl] = sc
        self.metrics.dropped(self.n_shard)       # design 3.7: the lost cells

    def truncate_open(self, row: int, sl: slice) -> None:
        """A worker failed: on `row`, the last transition that completed, every slot still open
        is truncated there so the learner bootstraps from the observation that exists."""
        prev = self.scalars[row, sl]
        open_ = (prev["flags"] & (F_TERMINATED | F_TRUNCATED)) == 0
        prev["flags"][open_] |= F_TRUNCATED
        self.scalars[row, sl] = prev

    def _view(self, iteration: int, c: int, j: int, w: int, sl: slice, io: ShardIO | None,
              dead: bool, episodes: list[EpisodeRecord]) -> RolloutRound:
        row = c - 1
        sc_row = self.scalars[row, sl] if row >= 0 else np.zeros(self.n_shard, SCALAR_DTYPE)
        flags = sc_row["flags"]
        return RolloutRound(
            iteration=iteration, cycle=c, shard=j, worker=w,
            slots=np.arange(sl.start, sl.stop, dtype=np.int32),
            obs_rows=np.full(self.n_shard, c + self.k - 1, np.int32),
            group=self.book.group[sl].copy() if not dead else np.full(self.n_shard, GROUP_DEAD, np.int8),
            new_episode=self.new_episode[sl].copy(), row=row,
            reward=sc_row["reward"], terminated=(flags & F_TERMINATED) != 0,
            truncated=(flags & F_TRUNCATED) != 0, valid=(flags & F_VALID) != 0,
            deploy_status=sc_row["deploy_status"], tick=sc_row["tick"],
            episode_end=sc_row["episode_end"], episodes=episodes,
            ended_battles=np.asarray(self.ended, np.int64), obs_valid=not dead,
            timings={"env_ms": float(io.control["t_env_ns"][0]) / 1e6
                     if io is not None and c > 0 else 0.0})


class _WorkerHealth:
    """The workers as the parent tracks them (design 3.7): which are dead, the failures not yet
    drained, how often each was restarted and its generation (which its scripted opponents'
    seed paths carry), and the restarts due at the next begin_iteration."""

    def __init__(self, cfg: FarmConfig) -> None:
        self.cfg = cfg
        self.generation = list(cfg.start_generations or [0] * cfg.workers)
        self.dead = [False] * cfg.workers
        self.pending: set[int] = set()
        self.failures: list[WorkerFailure] = []

    def fail(self, w: int, j: int, c: int, kind: str, message: str) -> None:
        self.dead[w] = True
        self.failures.append(WorkerFailure(w, j, c, kind, message))

    def drain(self) -> list[WorkerFailure]:
        out, self.failures = self.failures, []
        return out

    @property
    def restarts(self) -> list[int]:
        """Each restart is one generation, so the run's restarts come back with a resume: the limit
        and health/worker_restarts count over the run, as in the run that was never stopped."""
        return list(self.generation)

    def may_restart(self, w: int) -> None:
        if self.cfg.eval_plan is not None:
            raise FarmError(f"restart({w}) on an evaluation farm: close it and play the comparison "
                            "again on a new one")
        if self.restarts[w] >= self.cfg.max_restarts_per_worker:
            raise FarmError(f"worker {w} has been restarted {self.restarts[w]} times; "
                            f"max_restarts_per_worker={self.cfg.max_restarts_per_worker}")

    def request_restart(self, w: int) -> None:
        """After may_restart allowed it."""
        self.generation[w] += 1
        self.pending.add(w)


class _EvalMode:
    """The evaluation mode's side of a farm (section 6; _EvalReplay says what each property is),
    and its next plan: a gate's farm is built at gate time and closed after it (design 7.1), so
    its comparisons play one after the other on the same workers and engines."""

    def eval_slot_plan(self, iteration: int) -> SlotPlan:
        return self._replay.slot_plan(iteration, self.iteration < 0, self.ordinals, self.assignment)

    eval_index = property(lambda self: self._replay.index(self.ordinals))
    eval_done = property(lambda self: bool((self.eval_index < 0).all()))

    def replan(self, plan: list[EvalEpisode]) -> None:
        """Play `plan` next, on the same workers: every battle starts over as a farm built for it
        starts (its first episodes, ordinals, generation), so each episode plays what it plays
        there (tests/test_farm.py). Between comparisons: the last may have ended mid-iteration,
        and the STEPs still out are answered first. Refused on a training farm or a failed one;
        a replan that fails closes the farm."""
        if self.cfg.eval_plan is None or self._closed:
            raise FarmError("replan: only an open evaluation farm (FarmConfig.eval_plan) plays another "
                            "plan")
        if any(self.dead):
            raise FarmError(f"replan: worker {self.dead.index(True)} failed; close this farm and "
                            "build another")
        try:
            self._settle()
            self._begin(msgspec.structs.replace(self.cfg, eval_plan=list(plan)), None)
            self.rect[:] = 0
            self._replan_workers()
        except BaseException:
            self.close()                    # a farm that failed to start over plays nothing more
            raise


class _FarmCore(_EvalMode):
    """The parent's side of the round protocol, shared by both farms: begin_iteration, then per
    shard-round next_round and (below cycle T) submit; worker failure and restart. What the
    learner reads is kept by a _Collection (rect is the subclass's memory), what every battle
    plays by an _AssignmentBook, the metrics by _FarmStats. A subclass moves the bytes: the
    hooks at the end."""

    def __init__(self, cfg: FarmConfig, table: Any,
                 assign_fn: Callable[[int, int], Assignment] | None = None) -> None:
        self.table = table
        self._begin(cfg, assign_fn)
        self._closed = False
        self.rect = np.zeros((0,), np.uint8)                # set by the subclass

    def _begin(self, cfg: FarmConfig, assign_fn: Callable[[int, int], Assignment] | None) -> None:
        """Everything the parent knows of a farm's battles, as a new farm starts them."""
        cfg.check()
        self.cfg = cfg
        self._replay: _EvalReplay | None = None
        if cfg.eval_plan is not None:
            if assign_fn is not None:
                raise ValueError("an evaluation farm (FarmConfig.eval_plan) seats its battles from "
                                 "the plan; pass assign_fn=None")
            self._replay = _EvalReplay(cfg)
            assign_fn = self._replay.assign
        self.T, self.k, self.R = cfg.cycles, cfg.frame_stack, cfg.n_slots
        self.row_bytes = self.table.row_bytes
        self.n_shard = 2 * cfg.games_per_shard
        self.J = cfg.n_shards
        self._book = _AssignmentBook(cfg, assign_fn, self._replay)
        self._log = _ActionLog(cfg)
        self._metrics = _FarmStats(self.J)
        self._collection = _Collection(cfg, self._book, self._metrics)
        self._health = _WorkerHealth(cfg)
        self.iteration = -1
        self._cycle, self._shard, self._await_submit = 0, 0, False
        self._fresh = [True] * self.J                       # shard has an unread reset publication
        self._first_plan = True

    # what the learner reads, kept by the collection and the book (see the module docstring)
    first_obs = property(lambda self: self._collection.first_obs)
    scalars = property(lambda self: self._collection.scalars)
    finals = property(lambda self: self._collection.finals)
    episodes = property(lambda self: self._collection.episodes)
    ordinals = property(lambda self: self._book.ordinals)
    assignment = property(lambda self: self._book.assignment)
    rows_dropped_dead_worker_total = property(lambda self: self._metrics.rows_dropped_dead_worker_total)
    generation = property(lambda self: self._health.generation)
    restarts = property(lambda self: self._health.restarts)
    dead = property(lambda self: self._health.dead)

    def in_flight(self) -> list[InFlight]:
        """Between iterations: every battle mid-episode, as the parent drove it (design 3.9)."""
        return self._log.in_flight(self.ordinals)

    # geometry
    def shard_of(self, j: int) -> tuple[int, int]:
        return divmod(j, self.cfg.shards_per_worker)

    def shard_slots(self, j: int) -> slice:
        return slice(j * self.n_shard, (j + 1) * self.n_shard)

    def _obs_row(self, cycle: int) -> np.ndarray:
        return self.rect[cycle + self.k - 1]

    # the iteration boundary: the PLAN command
    def begin_iteration(self, plan: SlotPlan) -> None:
        if self._closed:
            raise FarmError("begin_iteration on a closed farm")
        self._book.check_shape(plan)
        if self.iteration >= 0 and (self._cycle, self._shard) != (self.T + 1, 0):
            raise FarmError(f"begin_iteration({plan.iteration}) before the previous iteration's "
                            f"rounds were all read (at cycle {self._cycle}, shard {self._shard}); "
                            "read every shard's cycle-T round first")
        self._book.open_iteration(plan)
        self._metrics.begin_iteration()
        if self.iteration >= 0:
            self._collection.turn_over(self.rect)
        self.iteration = plan.iteration
        self._cycle, self._shard, self._await_submit = 0, 0, False
        for w in sorted(self._health.pending):
            self._do_restart(w)
        self._health.pending.clear()
        self._deliver_plan()

    def plan_table(self) -> np.ndarray:
        """PLAN_DTYPE (R,): the opening table as it crosses to the workers, from the farm's own
        assignments (equal to the caller's SlotPlan, except where a restart moved a battle on)."""
        return self._book.plan_table()

    def _deliver_plan(self) -> None:
        """Write the plan area of every live worker and send each of its shards PLAN (design
        3.5), then wait for every answer: the worker has applied it before the iteration's first
        STEP. The assign entries of that first STEP then carry nothing the plan already delivered."""
        table = self.plan_table()
        sent = []
        for j in range(self.J):
            w, _ = self.shard_of(j)
            if self.dead[w]:
                continue
            sl = self.shard_slots(j)
            self._io(j).plan[:] = table[sl]
            self._send_plan(j)
            sent.append(j)
        # a resumed farm's first PLAN re-simulates its in-flight battles (design 3.9): start-up time
        timeout = self.cfg.startup_timeout_s if self.cfg.start_in_flight and self._first_plan else \
            self.cfg.round_timeout_s
        self._first_plan = False
        for j in sent:
            if self.dead[self.shard_of(j)[0]]:
                continue                        # failed on an earlier shard's PLAN: reported once
            if self._await_plan(j, timeout):
                self._book.unsent[self.shard_slots(j)] = False

    # a round: next_round reads it, submit answers it with the STEP command
    def next_round(self, timeout_s: float | None = None) -> RolloutRound:
        """Shard j's round at cycle c, in cycle-major order: wait for its answer, file it (the
        transition on row c - 1, the records, the ended battles' next assignments) and return
        the round's views."""
        if self.iteration < 0:
            raise FarmError("next_round before begin_iteration")
        if self._await_submit:
            raise FarmError(f"next_round twice without submit (cycle {self._cycle}, shard "
                            f"{self._shard}); exactly one submit per round below cycle T")
        if self._cycle > self.T:
            raise FarmError(f"iteration {self.iteration} is complete; call begin_iteration")
        c, j = self._cycle, self._shard
        w, _ = self.shard_of(j)
        arrived = self._await_round(j, c, w, timeout_s)
        self._fresh[j] = False
        rnd = self._collection.read(self.iteration, c, j, w, self._io(j) if arrived else None, self.dead[w])
        if c < self.T:
            self._await_submit = True
        else:
            self._advance()
            if self._cycle > self.T:
                self._metrics.end_iteration()    # the iteration's last round was read
        return rnd

    def _await_round(self, j: int, c: int, w: int, timeout_s: float | None) -> bool:
        """Whether shard j's answer for cycle c arrived: never from a dead worker; at cycle 0,
        only the reset publication of a shard not read since its worker started."""
        if not ((c > 0 or self._fresh[j]) and not self.dead[w]):
            return False
        timeout = self.cfg.round_timeout_s if timeout_s is None else timeout_s
        t_wait = time.perf_counter()
        ok = self._wait(j, c, timeout)
        self._metrics.waited(time.perf_counter() - t_wait)
        return ok

    def _advance(self) -> None:
        self._await_submit = False
        self._shard += 1
        if self._shard == self.J:
            self._shard, self._cycle = 0, self._cycle + 1

    def submit(self, actions: np.ndarray, gamma: float,
               assignments: list[Assignment] | tuple[Assignment, ...] = ()) -> None:
        """Actions for the last round's slots (ascending), the schedule's gamma, and -- only when
        the farm has no assign_fn -- an Assignment for every battle that ended on that round."""
        if not self._await_submit:
            raise FarmError(f"submit without a round to answer (cycle {self._cycle}, shard "
                            f"{self._shard})")
        c, j = self._cycle, self._shard
        w, _ = self.shard_of(j)
        acts = np.asarray(actions)
        if acts.shape != (self.n_shard,):
            raise ValueError(f"submit: {acts.shape} actions for shard {j} at cycle {c}; it has "
                             f"{self.n_shard} slots")
        self._book.take_given(assignments, self._collection.ended, c, j)
        if self.cfg.eval_plan is None:
            self._log.add(j, acts, float(gamma), self.ordinals)
        if not self.dead[w]:
            io = self._io(j)
            io.actions[:] = acts.astype(np.int16)
            io.assign[:] = self._book.assign_entries(self.shard_slots(j))
            self._kick(j, c + 1, float(gamma))
        self._advance()

    # failure and restart (design 3.7)
    def drain_failures(self) -> list[WorkerFailure]:
        return self._health.drain()

    def restart(self, w: int) -> None:
        """Worker w restarts on its next generation's seed paths at the next begin_iteration; its
        running episodes are abandoned (each battle moves to its next ordinal). Ordinals,
        generation and assignments change now, so a checkpoint written before then holds what the
        new worker plays (design 3.7): hence only a dead worker, or any between iterations."""
        self._health.may_restart(w)
        if not self.dead[w] and self.iteration >= 0 and (self._cycle, self._shard) != (self.T + 1, 0):
            raise FarmError(f"restart({w}) of a live worker mid-iteration (cycle {self._cycle}): "
                            "restart it once it failed, or after the cycle-T round was read")
        self._health.request_restart(w)
        self._book.abandon(slice(2 * w * self.cfg.games_per_worker, 2 * (w + 1) * self.cfg.games_per_worker))

    def check_workers(self) -> None:
        """Between iterations: a worker whose process ended (killed during the update) fails now."""
        for w in range(self.cfg.workers):
            gone = None if self.dead[w] else self._exited(w)
            if gone is not None:
                self._fail(w, w * self.cfg.shards_per_worker, 0, *gone)

    def _do_restart(self, w: int) -> None:
        S = self.cfg.shards_per_worker
        self._metrics.restarted(range(w * S, (w + 1) * S))
        self._stop_worker(w)
        self.dead[w] = False
        for j in range(w * S, (w + 1) * S):
            sl = self.shard_slots(j)
            self.rect[:, sl] = 0                 # history from the abandoned episodes
            self.first_obs[:, sl] = False
            self._collection.resumed[sl] = False  # its battles reset into their next episodes
            self._fresh[j] = True
        self._start_worker(w)

    def _fail(self, w: int, j: int, c: int, kind: str, message: str) -> None:
        """Worker w failed answering cycle c: the transition whose action was lost is invalid;
        the one before it (row c - 2) completed and its observation exists (design 3.7)."""
        self._health.fail(w, j, c, kind, message)
        for s in range(self.cfg.shards_per_worker):
            if c - 2 >= 0:
                self._collection.truncate_open(c - 2, self.shard_slots(w * self.cfg.shards_per_worker + s))

    @property
    def stats(self) -> _Stats:
        """The current (or last finished) iteration's farm metrics (_FarmStats.snapshot names
        them); usable as farm.stats[...] and, equally, farm.stats()[...]."""
        return self._metrics.snapshot(self.restarts)

    # subclass hooks
    def _settle(self) -> None: ...                  # every command a worker was sent is answered
    def _replan_workers(self) -> None: ...          # every worker starts over on self.cfg's plan
    def _io(self, j: int) -> ShardIO: ...
    def _send_plan(self, j: int) -> None: ...
    def _await_plan(self, j: int, timeout_s: float) -> bool: ...
    def _kick(self, j: int, cycle: int, gamma: float) -> None: ...
    def _wait(self, j: int, cycle: int, timeout_s: float) -> bool: ...
    def _start_worker(self, w: int) -> None: ...
    def _stop_worker(self, w: int) -> None: ...
    def _exited(self, w: int) -> tuple[str, str] | None: ...   # (kind, message) once w's process ended


# --- 11. InlineFarm: the reference, one process, the same bytes -----------------------------------

class InlineFarm(_FarmCore):
    """The same ShardRunner writing the same layout into process-local buffers; submit steps the
    shard at once. What the fast tests run, and what ProcessFarm must equal byte for byte."""

    def __init__(self, cfg: FarmConfig, table: Any,
                 assign_fn: Callable[[int, int], Assignment] | None = None) -> None:
        super().__init__(cfg, table, assign_fn)
        self._seg_a = bytearray(segment_a_bytes(self.T, self.k, self.R, self.row_bytes))
        write_header(self._seg_a, self.T, self.k, self.R, self.row_bytes)
        self.rect = rect_view(self._seg_a, self.T, self.k, self.R, self.row_bytes)
        self._seg_b: list[bytearray] = []
        self._ios: list[ShardIO] = []
        self._runners: list[ShardRunner | None] = [None] * self.J
        for _ in range(cfg.workers):
            buf = bytearray(segment_b_bytes(self.n_shard, cfg.shards_per_worker, self.row_bytes))
            self._seg_b.append(buf)
            for s in range(cfg.shards_per_worker):
                self._ios.append(shard_io(buf, self.n_shard, cfg.shards_per_worker, self.row_bytes, s))
        for w in range(cfg.workers):
            self._start_worker(w)

    def _start_worker(self, w: int) -> None:
        for s in range(self.cfg.shards_per_worker):
            j = w * self.cfg.shards_per_worker + s
            r = ShardRunner(self.cfg, self.table, w, s, self.generation[w], self._book.shard_ordinals(j))
            r.reset(self._ios[j], self._obs_row(0))
            self._runners[j] = r

    def _stop_worker(self, w: int) -> None:
        # A failed worker's engines are dropped, not handed back: its restart builds new ones, as a
        # restarted process does, whatever state the failure left them in.
        for s in range(self.cfg.shards_per_worker):
            r = self._runners[w * self.cfg.shards_per_worker + s]
            if r is not None and self.dead[w]:
                r.vec.close()
            elif r is not None:
                close_vec(r.vec, self.cfg.env)

    def _settle(self) -> None:
        pass                                # submit steps at once: nothing is ever outstanding

    def _replan_workers(self) -> None:
        for w in range(self.cfg.workers):   # the battles hand their engines on to the next plan's
            self._stop_worker(w)
            self._start_worker(w)

    def _io(self, j: int) -> ShardIO:
        return self._ios[j]

    def _kick(self, j: int, cycle: int, gamma: float) -> None:
        w, _ = self.shard_of(j)
        try:
            self._runners[j].step(self._ios[j], self._obs_row(cycle), gamma)
        except Exception:
            self._fail(w, j, cycle, "exception", traceback.format_exc())

    def _wait(self, j: int, cycle: int, timeout_s: float) -> bool:
        return not self.dead[self.shard_of(j)[0]]

    def _send_plan(self, j: int) -> None:
        try:
            self._runners[j].apply_slot_plan(self._ios[j].plan, self.rect[:self.k])
        except Exception:
            self._fail(self.shard_of(j)[0], j, 0, "exception", traceback.format_exc())

    def _await_plan(self, j: int, timeout_s: float) -> bool:
        return not self.dead[self.shard_of(j)[0]]

    def spaces(self, w: int, timeout_s: float | None = None) -> dict[str, Any]:
        """SPACES, in process: worker w's report re-read off its live env (as ProcessFarm's)."""
        S = self.cfg.shards_per_worker
        return worker_report(self._runners[w * S: (w + 1) * S])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in range(self.cfg.workers):
            self._stop_worker(w)


# --- 12. ProcessFarm: spawn, handshake, semaphores, timeouts, restart, close (design 3.2, 3.7) ----

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


class _SpawnEnv:
    """Around Process.start(): the child's environment gets the thread variables (so they are set
    before the child imports numpy, design 3.2) and the parent's __main__ is hidden, so a learner
    run as `python ppo_clash.py` is not re-imported (with torch) into every worker. Both are
    restored when start() returns; the parent's own torch never sees the variables."""

    def __enter__(self) -> None:
        self._env = {k: os.environ.get(k) for k in THREAD_VARS}
        for k in THREAD_VARS:
            os.environ[k] = "1"
        main = sys.modules.get("__main__")
        self._main = main
        self._saved = {}
        if main is not None:
            for attr in ("__file__", "__spec__"):
                if hasattr(main, attr):
                    self._saved[attr] = getattr(main, attr)
            if hasattr(main, "__file__"):
                del main.__file__
            main.__spec__ = None

    def __exit__(self, *exc: Any) -> None:
        for k, v in self._env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if self._main is not None:
            for attr, v in self._saved.items():
                setattr(self._main, attr, v)
            if "__spec__" not in self._saved:
                del self._main.__spec__


def worker_report(runners: list[ShardRunner]) -> dict[str, Any]:
    """What a worker reports at start-up and on SPACES: its spaces signature and engine binary
    (re-read off the live env), thread variables, whether torch is loaded, its pid."""
    vec = runners[0].vec
    return {
        "spaces": spaces_signature(vec.single_observation_space, vec.single_action_space.n),
        "engine_binary": engine_binary(vec.envs[0].config()),
        "threads": {v: os.environ.get(v) for v in THREAD_VARS},
        "torch_loaded": "torch" in sys.modules, "pid": os.getpid(),
    }


def _write_handshake(hand: np.ndarray, runners: list[ShardRunner]) -> None:
    """u32 length, then the report as JSON utf-8; the length last, so a reader never sees half."""
    raw = json.dumps(worker_report(runners)).encode()
    if len(raw) + 4 > hand.size:
        raise FarmError(f"worker report of {len(raw)} bytes exceeds HANDSHAKE_BYTES={hand.size}")
    hand[:4] = 0
    hand[4:4 + len(raw)] = np.frombuffer(raw, np.uint8)
    hand[:4] = np.frombuffer(struct.pack("<I", len(raw)), np.uint8)


def where_it_stood(pid: int, ios: list[ShardIO]) -> str:
    """Ask a hung worker for its stack (STACK_SIGNAL) and wait up to STACK_WAIT_S for it to land
    in one of its shards' error areas, where a traceback goes (err_len is written after the text,
    so a change means it is whole). One stuck outside Python (inside the engine) cannot answer."""
    if STACK_SIGNAL is None:
        return ""
    before = [int(io.control["err_len"][0]) for io in ios]
    os.kill(pid, STACK_SIGNAL)
    deadline = time.monotonic() + STACK_WAIT_S
    while time.monotonic() < deadline:
        for io, n0 in zip(ios, before, strict=True):
            if int(io.control["err_len"][0]) != n0:
                return "; where it stood (its main thread's stack, innermost last):\n" + io.read_text()
        time.sleep(0.01)
    return f"; it did not say where it stood within {STACK_WAIT_S} s (stuck outside Python?)"


# --- Orphans and stale segments (design 3.7): a worker dies with its parent, however the parent
# dies, and a new farm removes the shared memory a dead process left behind.
# A parent that dies without close() (kill -9, the OOM killer) leaves its workers waiting on their
# semaphores forever, re-parented to PID 1; and they hold multiprocessing's resource tracker open
# (its pipe), so the tracker never reaches the end of its input, where it would unlink the
# segments and semaphores. So each worker arms two guards as it starts: on Linux the parent-death
# signal (prctl PR_SET_PDEATHSIG, SIGKILL; armed only when the worker was started from the
# parent's main thread, since the kernel sends it when the *thread* that started the child ends),
# and everywhere a thread that looks at its parent pid every PARENT_POLL_S and exits once it
# changed (the parent is gone). With the workers gone, the tracker reads the end of its pipe,
# unlinks what the dead parent registered and exits. Should the tracker die too (kill -9 of the
# whole group), the segments stay in /dev/shm: each name carries its creator's pid ("rlb-<pid>-<n>",
# "rlc-<pid>-<n>-<w>"), and remove_stale_segments, run by every new ProcessFarm and at a run's
# start, unlinks those of a pid that no longer runs (a zombie counts as gone) and leaves every
# other name alone. The tracker's semaphores ("sem.mp-<random>") carry no pid and are not touched.

PARENT_POLL_S = 0.2
PR_SET_PDEATHSIG = 1                     # <linux/prctl.h>
SHM_DIR = "/dev/shm"
SEGMENT_NAME = re.compile(r"rl[bcp]-(\d+)-\d+(?:-\d+)?")   # rlb-<pid>-<n>, rlc-/rlp-<pid>-<n>-<w>


def pid_gone(pid: int) -> bool:
    """Whether no process with this pid runs (a zombie, dead but not yet reaped, counts as gone).
    Another user's process is not gone (kill answers EPERM)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def remove_stale_segments(shm_dir: str = SHM_DIR) -> list[tuple[str, int]]:
    """Unlink the farm segments (SEGMENT_NAME) in shm_dir whose creator's pid is gone; returns
    (name, bytes) of each removed. Nothing else is touched; no shm_dir (not Linux): nothing."""
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    removed = []
    for name in names:
        m = SEGMENT_NAME.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid() or not pid_gone(int(m.group(1))):
            continue
        path = os.path.join(shm_dir, name)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except OSError:                  # another process removed it first, or not ours to remove
            continue
        removed.append((name, size))
    return removed


def stale_segments_line(removed: list[tuple[str, int]]) -> str:
    """One console line for what remove_stale_segments removed ("" when nothing)."""
    if not removed:
        return ""
    pids = sorted({int(SEGMENT_NAME.fullmatch(n).group(1)) for n, _ in removed})
    return (f"removed shared memory left by dead process{'es' if len(pids) > 1 else ''} "
            f"{', '.join(map(str, pids))}: "
            + ", ".join(f"{SHM_DIR}/{n} ({b / 1e6:.1f} MB)" for n, b in removed))


def parent_guard() -> tuple[int, bool]:
    """die_with_parent's arguments, read in the parent as it starts a worker: its pid, and whether
    the parent-death signal may be armed (this is the main thread, which ends only with the process)."""
    return os.getpid(), threading.current_thread() is threading.main_thread()


def die_with_parent(parent_pid: int, deathsig: bool) -> None:
    """In a worker, first thing: exit when the parent (parent_pid) is gone. deathsig arms Linux's
    parent-death signal (SIGKILL), which ends the worker even inside the engine; the polling
    thread covers the rest (another OS, a parent thread that started the worker and ended, a
    parent that died before the signal was armed)."""
    if deathsig and sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass                         # the thread below still watches
    if os.getppid() != parent_pid:       # gone before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _worker_entry(cfg_json: bytes, table_json: bytes, w: int, gen: int, ordinals: list[list[int]],
                  seg_a: str, seg_b: str, obs_sems: list[Any], act_sems: list[Any],
                  parent_pid: int, deathsig: bool) -> None:
    """The child. Its environment already carries the thread variables (set at exec by
    _SpawnEnv, before numpy loaded); Ctrl-C is the parent's business; it dies with the parent
    (die_with_parent)."""
    die_with_parent(parent_pid, deathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from multiprocessing import shared_memory
    cfg = msgspec.json.decode(cfg_json, type=FarmConfig)
    table = msgspec.json.decode(table_json, type=codec.CodecTable)
    T, k, R, rb = cfg.cycles, cfg.frame_stack, cfg.n_slots, table.row_bytes
    n = 2 * cfg.games_per_shard
    S = cfg.shards_per_worker
    a = shared_memory.SharedMemory(name=seg_a)
    b = shared_memory.SharedMemory(name=seg_b)
    rect = rect_view(a.buf, T, k, R, rb)
    ios = [shard_io(b.buf, n, S, rb, s) for s in range(S)]
    hand = np.ndarray((HANDSHAKE_BYTES,), np.uint8, buffer=b.buf, offset=0)
    cur = 0

    def where_it_stands(signum: int, frame: Any) -> None:
        """A parent whose wait ran out asks (STACK_SIGNAL) before it kills: this process's stack,
        where a traceback goes, so the failure's file says where it hung (design 3.7)."""
        # its last 512 B: the innermost frames. `ios` is bound from before this handler is installed
        # until the `del` in the finally below, which is all ruff's F821 sees (astral-sh/ruff#9858)
        ios[cur].write_text("".join(traceback.format_stack(frame)))  # noqa: F821 (a false positive: above)

    if STACK_SIGNAL is not None:
        signal.signal(STACK_SIGNAL, where_it_stands)
    try:
        runners = _start_shards(cfg, table, w, gen, ordinals, ios, rect[k - 1], hand)
        seen = [0] * S
        spin_s = cfg.spin_us * 1e-6
        due = 0
        while True:
            # sleep only on the shard whose command is due next; glance at the others
            for s in [due] + [x for x in range(S) if x != due]:
                io = ios[s]
                new = (lambda io=io, s=s: int(io.control["cmd_seq"][0]) != seen[s])
                if s == due:
                    if not _wait_word(new, act_sems[s], spin_s, SLEEP_S):
                        continue
                elif not new():
                    continue
                else:
                    act_sems[s].acquire(timeout=5.0)
                cur = s
                ctl = io.control
                seq = int(ctl["cmd_seq"][0])
                seen[s] = seq
                kind = int(ctl["cmd_kind"][0])
                if kind == CMD_CLOSE:
                    for x in range(S):
                        ios[x].control["state"] = ST_CLOSED
                    return
                if kind == CMD_REPLAN:           # the evaluation farm's next comparison
                    nxt = read_replan(seg_b)
                    for r in runners:
                        close_vec(r.vec, cfg.env)   # their engines, to the new battles
                    cfg = msgspec.structs.replace(cfg, eval_plan=nxt.eval_plan)
                    ctl["pub_seq"] = seq             # answered by state ST_READY, no token
                    runners = _start_shards(cfg, table, w, gen, nxt.ordinals, ios, rect[k - 1], hand)
                    due = 0
                    break
                if kind in (CMD_PLAN, CMD_SPACES):
                    if kind == CMD_PLAN:
                        runners[s].apply_slot_plan(io.plan, rect[:k])
                        due = (s + 1) % S           # PLAN goes to every shard in turn, then STEP
                    else:
                        _write_handshake(hand, runners)
                    ctl["pub_seq"] = seq
                    obs_sems[s].release()
                    break
                if kind != CMD_STEP:
                    raise FarmError(f"worker {w} shard {s}: unknown command kind {kind} "
                                    f"(cmd_seq {seq}); parent and worker disagree on the layout")
                row = int(ctl["cmd_row"][0])
                runners[s].step(io, rect[row], float(ctl["gamma"][0]))
                ctl["cycle"] = row - (k - 1)
                ctl["pub_seq"] = seq
                obs_sems[s].release()
                due = (s + 1) % S
                break
    except BaseException:
        io = ios[cur]
        io.write_text(traceback.format_exc())
        io.control["err_code"] = ERR_EXCEPTION
        for s in range(S):
            ios[s].control["state"] = ST_FAILED
            obs_sems[s].release()
        raise SystemExit(1) from None       # the traceback is already in the shard's error area
    finally:
        del rect, ios, hand
        for shm in (a, b):
            try:
                shm.close()
            except BufferError:
                pass


def _start_shards(cfg: FarmConfig, table: Any, w: int, gen: int, ordinals: list[list[int]],
                  ios: list[ShardIO], first_row: np.ndarray, hand: np.ndarray) -> list[ShardRunner]:
    """A worker's start-up, and its CMD_REPLAN (section 7): build every shard's battles (on the
    engines its last plan handed back, if any), reset them and publish their first observations,
    write the handshake, then state ST_READY on every shard."""
    runners = [ShardRunner(cfg, table, w, s, gen, ordinals[s]) for s in range(len(ios))]
    for s, r in enumerate(runners):
        r.reset(ios[s], first_row)
    _write_handshake(hand, runners)
    for io in ios:
        io.control["state"] = ST_READY
    return runners


def _exit_report(w: int, p: Any, ios: list[ShardIO]) -> tuple[str, str] | None:
    """(kind, message) once worker w's process p has ended: "exception" with the traceback it
    wrote, else "crash" with its exit code; None while it runs."""
    if p is not None and p.is_alive():
        return None
    text = ""
    for io in ios:
        if int(io.control["state"][0]) == ST_FAILED:
            text = io.read_text() or text
    if text:
        return "exception", text
    return "crash", f"worker {w} died with exit code {p.exitcode if p is not None else None}"


class _Segments:
    """A ProcessFarm's shared memory (section 7): segment A (header, rectangle), a segment B a
    worker, and the segment P a worker reads its next plan from at CMD_REPLAN, which lives from
    write_plan until drop_plans. Named after this process and its farm count, so that
    remove_stale_segments can tell a dead process's; close() drops them all once."""

    _count = 0

    def __init__(self, T: int, k: int, R: int, row_bytes: int, workers: int, n_shard: int,
                 S: int) -> None:
        from multiprocessing import shared_memory
        self._new = lambda name, size: shared_memory.SharedMemory(create=True, size=size, name=name)
        remove_stale_segments()             # what a dead process left (its pid is in the name)
        _Segments._count += 1
        self.tag = f"{os.getpid()}-{_Segments._count}"
        self.a = self._new(f"rlb-{self.tag}", segment_a_bytes(T, k, R, row_bytes))
        write_header(self.a.buf, T, k, R, row_bytes)
        self.rect = rect_view(self.a.buf, T, k, R, row_bytes)
        self.rect[:] = 0
        self.b = [self._new(f"rlc-{self.tag}-{w}", segment_b_bytes(n_shard, S, row_bytes))
                  for w in range(workers)]
        self.ios = [shard_io(shm.buf, n_shard, S, row_bytes, s) for shm in self.b for s in range(S)]
        self.plans: list[Any] = []

    def handshake(self, w: int) -> np.ndarray:
        return np.ndarray((HANDSHAKE_BYTES,), np.uint8, buffer=self.b[w].buf, offset=0)

    def write_plan(self, w: int, body: bytes) -> None:
        """Worker w's segment P: u32 length, then the msgspec JSON of a Replan."""
        shm = self._new(f"rlp-{self.tag}-{w}", 4 + len(body))
        shm.buf[:4] = struct.pack("<I", len(body))
        shm.buf[4:4 + len(body)] = body
        self.plans.append(shm)

    def drop_plans(self) -> None:
        self._drop(self.plans)
        self.plans = []

    def close(self) -> None:
        self.rect = np.zeros((0,), np.uint8)
        self.ios = []
        import gc
        gc.collect()                        # the views into the segments, before they close
        self._drop([self.a, *self.b, *self.plans])

    @staticmethod
    def _drop(segments: list[Any]) -> None:
        for shm in segments:
            try:
                shm.close()
            except BufferError:
                pass
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


class ProcessFarm(_FarmCore):
    """K spawned workers writing into shared memory. Same semantics and bytes as InlineFarm."""

    def __init__(self, cfg: FarmConfig, table: Any,
                 assign_fn: Callable[[int, int], Assignment] | None = None,
                 env_spec: EnvSpec | None = None) -> None:
        import multiprocessing as mp
        super().__init__(cfg, table, assign_fn)
        self._ctx = mp.get_context("spawn")
        self._mem = _Segments(self.T, self.k, self.R, self.row_bytes, cfg.workers,
                              self.n_shard, cfg.shards_per_worker)
        self.rect, self._ios = self._mem.rect, self._mem.ios
        self._obs_sems = [self._ctx.Semaphore(0) for _ in range(self.J)]
        self._act_sems = [self._ctx.Semaphore(0) for _ in range(self.J)]
        self._seq = [0] * self.J
        self._unread = [False] * self.J      # a STEP sent whose answer's token is not taken yet
        self._procs: list[Any] = [None] * cfg.workers
        self._deadline = [0.0] * cfg.workers   # each worker's start-up timeout, from its launch
        self.handshakes: list[dict[str, Any]] = [{} for _ in range(cfg.workers)]
        self._expect = env_spec
        atexit.register(self.close)
        try:   # every worker starts up beside the others: its imports and engines are seconds
            for w in range(cfg.workers):
                self._launch(w)
                if cfg.launch_delay_s and w + 1 < cfg.workers:
                    time.sleep(cfg.launch_delay_s)
            for w in range(cfg.workers):
                self._await_start(w)
        except BaseException:
            self.close()
            raise

    def _io(self, j: int) -> ShardIO:
        return self._ios[j]

    def _shards(self, w: int) -> range:
        S = self.cfg.shards_per_worker
        return range(w * S, (w + 1) * S)

    def _start_worker(self, w: int) -> None:
        self._launch(w)
        self._await_start(w)

    def _launch(self, w: int) -> None:
        """Spawn worker w on its generation's seed paths; _await_start(w) waits for its handshake."""
        hand = self._mem.handshake(w)
        hand[:] = 0
        for j in self._shards(w):
            io = self._ios[j]
            io.control[:] = np.zeros(1, CONTROL_DTYPE)
            io.control["n_slots"] = self.n_shard
            self._seq[j] = 0
            self._unread[j] = False
            while self._obs_sems[j].acquire(block=False):   # stale tokens of a dead worker
                pass
            while self._act_sems[j].acquire(block=False):
                pass
        ords = [self._book.shard_ordinals(j) for j in self._shards(w)]
        args = (msgspec.json.encode(self.cfg), msgspec.json.encode(self.table), w, self.generation[w],
                ords, self._mem.a.name, self._mem.b[w].name, [self._obs_sems[j] for j in self._shards(w)],
                [self._act_sems[j] for j in self._shards(w)], *parent_guard())
        p = self._ctx.Process(target=_worker_entry, args=args, name=f"farm-worker-{w}", daemon=True)
        with _SpawnEnv():
            p.start()
        self._procs[w] = p
        self._deadline[w] = time.monotonic() + self.cfg.startup_timeout_s

    def _await_start(self, w: int) -> None:
        """Until every shard of worker w is ready (its envs built and reset), then its handshake is
        checked against the parent's spaces and engine binary; a failure or the start-up timeout
        kills it and raises, naming the worker and its generation."""
        p, deadline, j0 = self._procs[w], self._deadline[w], self._shards(w)[0]
        while True:
            states = [int(self._ios[j].control["state"][0]) for j in self._shards(w)]
            if all(s_ == ST_READY for s_ in states):
                break
            if ST_FAILED in states or not p.is_alive():
                msg = self._ios[j0].read_text() or f"exit code {p.exitcode}"
                for j in self._shards(w):
                    msg = self._ios[j].read_text() or msg
                self._kill(w)
                raise FarmError(f"worker {w} (generation {self.generation[w]}) failed at start-up:\n{msg}")
            if time.monotonic() > deadline:
                self._kill(w)
                raise WorkerTimeout(f"worker {w} did not finish start-up within "
                                    f"{self.cfg.startup_timeout_s} s (startup_timeout_s)")
            time.sleep(0.01)
        self._check_report(w, self._read_handshake(w))

    def _read_handshake(self, w: int) -> dict[str, Any]:
        hand = self._mem.handshake(w)
        report = json.loads(framed(hand))
        self.handshakes[w] = report
        return report

    def _check_report(self, w: int, report: dict[str, Any]) -> None:
        problems = [] if self._expect is None else handshake_problems(report, self._expect)
        if problems:
            self._kill(w)
            raise FarmError(f"worker {w} (generation {self.generation[w]}) refused: "
                            + "; ".join(problems) + ". Stopped; restart the run on one build.")

    def _command(self, j: int, kind: int) -> None:
        ctl = self._ios[j].control
        ctl["cmd_kind"] = kind
        self._seq[j] += 1
        ctl["cmd_seq"] = self._seq[j]         # the word last, then the token
        self._act_sems[j].release()

    def _kick(self, j: int, cycle: int, gamma: float) -> None:
        ctl = self._ios[j].control
        ctl["cmd_row"] = cycle + self.k - 1
        ctl["gamma"] = gamma
        self._command(j, CMD_STEP)
        self._unread[j] = True

    def _send_plan(self, j: int) -> None:
        self._command(j, CMD_PLAN)

    def _settle(self) -> None:
        """The STEPs the last comparison left unread are answered, their tokens taken (the word
        alone is not enough: a worker writes pub_seq just before it releases the token)."""
        for j in range(self.J):
            if self._unread[j] and not self._await_answer(
                    j, self._cycle, self.cfg.round_timeout_s, "its last STEP before the next plan"):
                raise FarmError(f"worker {self.shard_of(j)[0]} failed: {self._health.failures[-1].message}")

    def _replan_workers(self) -> None:
        """CMD_REPLAN to each worker's first shard, its plan in segment P; then its start-up's wait."""
        for w in range(self.cfg.workers):
            shards = self._shards(w)
            self._mem.write_plan(w, msgspec.json.encode(
                Replan(self.cfg.eval_plan, [self._book.shard_ordinals(j) for j in shards])))
            for j in shards:
                self._ios[j].control["state"] = ST_STARTING
            self._command(shards[0], CMD_REPLAN)
            self._deadline[w] = time.monotonic() + self.cfg.startup_timeout_s
        try:
            for w in range(self.cfg.workers):
                self._await_start(w)
        finally:
            self._mem.drop_plans()

    def _await_plan(self, j: int, timeout_s: float) -> bool:
        return self._await_answer(j, 0, timeout_s, "the PLAN command")

    def spaces(self, w: int, timeout_s: float | None = None) -> dict[str, Any]:
        """The SPACES command (design 3.5): worker w re-reads its spaces and engine binary off its
        live env without stepping and answers like the start-up handshake; refused (FarmError,
        the worker is stopped) on a mismatch with env_spec, as at start-up. Only between
        iterations (before the first begin_iteration, or after cycle T was read), when no STEP is
        outstanding on the worker's control words."""
        if self._closed or self.dead[w] or self._procs[w] is None:
            raise FarmError(f"spaces({w}): worker {w} is not running")
        if self.iteration >= 0 and (self._cycle, self._shard) != (self.T + 1, 0):
            raise FarmError(f"spaces({w}) mid-iteration (cycle {self._cycle}, shard {self._shard}): "
                            "a STEP may be outstanding; ask between iterations")
        j = self._shards(w)[0]
        self._command(j, CMD_SPACES)
        timeout = self.cfg.round_timeout_s if timeout_s is None else timeout_s
        if not self._await_answer(j, 0, timeout, "the SPACES command"):
            raise FarmError(f"worker {w} failed answering SPACES: {self._health.failures[-1].message}")
        report = self._read_handshake(w)
        self._check_report(w, report)
        return report

    def _wait(self, j: int, cycle: int, timeout_s: float) -> bool:
        if cycle == 0:
            return True                       # the reset publication, checked at start-up
        return self._await_answer(j, cycle, timeout_s, f"cycle {cycle}")

    def _await_answer(self, j: int, cycle: int, timeout_s: float, what: str) -> bool:
        w, s = self.shard_of(j)
        self._unread[j] = False
        ctl = self._ios[j].control
        deadline = time.monotonic() + timeout_s
        spin_s = self.cfg.spin_us * 1e-6
        new = lambda: int(ctl["pub_seq"][0]) == self._seq[j] or int(ctl["state"][0]) == ST_FAILED
        while not _wait_word(new, self._obs_sems[j], spin_s, SLEEP_S):
            p = self._procs[w]
            if not p.is_alive():
                if int(ctl["state"][0]) == ST_FAILED:
                    break
                self._fail(w, j, cycle, "crash", f"worker {w} died with exit code {p.exitcode}")
                return False
            if time.monotonic() > deadline:
                codes = {i: (q.exitcode if q is not None else None) for i, q in enumerate(self._procs)}
                msg = (f"worker {w} shard {s} (global shard {j}) did not answer {what} within "
                       f"{timeout_s} s (round_timeout_s); alive={p.is_alive()}, exit codes {codes}")
                if self.cfg.eval_plan is not None:
                    raise WorkerTimeout(msg)     # never restarted: its caller rebuilds it
                stack = where_it_stood(self._procs[w].pid, [self._ios[x] for x in self._shards(w)])
                self._kill(w)                    # training: a failure like a crash (design 3.7)
                self._fail(w, j, cycle, "timeout", msg + "; the worker was killed" + stack)
                return False
        if int(ctl["state"][0]) == ST_FAILED or int(ctl["err_code"][0]) != ERR_NONE:
            text = ""
            for jj in self._shards(w):
                text = self._ios[jj].read_text() or text
            self._procs[w].join(timeout=self.cfg.join_timeout_s)
            self._fail(w, j, cycle, "exception", text)
            return False
        return True

    def _exited(self, w: int) -> tuple[str, str] | None:
        return _exit_report(w, self._procs[w], [self._ios[j] for j in self._shards(w)])

    def _kill(self, w: int) -> None:
        p = self._procs[w]
        if p is None:
            return
        p.join(timeout=0.1)
        if p.is_alive():
            p.terminate()
            p.join(timeout=self.cfg.join_timeout_s)
        if p.is_alive():
            p.kill()
            p.join(timeout=self.cfg.join_timeout_s)
        self._procs[w] = None

    def _stop_worker(self, w: int) -> None:
        """Close, join with timeout, then terminate, then kill (design 3.7)."""
        p = self._procs[w]
        if p is None:
            return
        if p.is_alive():
            for j in self._shards(w):
                self._command(j, CMD_CLOSE)
            p.join(timeout=self.cfg.join_timeout_s)
        self._kill(w)

    def close(self) -> None:
        """Idempotent; also registered atexit."""
        if self._closed:
            return
        self._closed = True
        for w in range(self.cfg.workers):
            try:
                self._stop_worker(w)
            except Exception:
                pass
        self.rect = np.zeros((0,), np.uint8)
        self._ios = []
        self._mem.close()
        atexit.unregister(self.close)


# --- 13. The benchmark: farm overhead against the direct loop (docs/throughput.md) ----------------

def _bench_actions(master_seed: int, t: int, masks: np.ndarray, slots: np.ndarray,
                   n_slots: int, noop_prob: float = 0.7) -> np.ndarray:
    """A pure function of (seed, cycle, slot, mask): the same actions in every arm, whichever
    process holds the battle. One uniform pair per slot from bench/cycle/{t}."""
    u = derive_generator(master_seed, f"bench/cycle/{t}").random((n_slots, 2))[slots]
    out = np.zeros(masks.shape[0], np.int64)
    for i in range(masks.shape[0]):
        if u[i, 0] >= noop_prob:
            legal = np.flatnonzero(masks[i, 1:]) + 1
            if legal.size:
                out[i] = legal[int(u[i, 1] * legal.size)]
    return out


def _bench_direct(env: EnvFactorySpec, battles: int, cycles: int, iterations: int,
                  master_seed: int) -> tuple[float, str]:
    import functools
    R = 2 * battles
    vec = build_vec(env, battles, autoreset_seed_fn=functools.partial(_battle_seed, master_seed, 0))
    obs, _ = vec.reset()
    allslots = np.arange(R)
    h = hashlib.sha256()
    for t in range(cycles * (iterations + 1)):
        if t == cycles:                                    # after the warm-up iteration
            t0 = time.perf_counter()
        acts = _bench_actions(master_seed, t, obs["action_mask"], allslots, R)
        if t >= cycles:
            h.update(acts.tobytes())
        obs, *_ = vec.step(acts)
    dt = time.perf_counter() - t0
    vec.close()
    return dt, h.hexdigest()[:16]


def _step_beside(env: EnvFactorySpec, battles: int, master_seed: int, ready: Any, stop: Any) -> None:
    import functools
    vec = build_vec(env, battles, autoreset_seed_fn=functools.partial(_battle_seed, master_seed, 0))
    obs, _ = vec.reset()
    allslots, t = np.arange(2 * battles), 0
    ready.set()
    while not stop.is_set():
        obs, *_ = vec.step(_bench_actions(master_seed, t, obs["action_mask"], allslots, 2 * battles))
        t += 1
    vec.close()


class SteppingBeside:
    """A block timed under the rollout workers' load, without their farm: `workers` spawned
    processes each stepping `battles` battles with _bench_actions from before the block starts
    until it ends (checks.py bench's inference: in the loop the parent's forwards share the
    cores with the workers' stepping). A load, not a farm: they never wait for actions, where a
    real worker idles while the parent acts for its shard (bench starts one fewer for that). A
    process that dies, in the block or before it, is an error naming it."""

    START_S = 300.0   # a process's start and first reset, well over the 7 s it took [M]

    def __init__(self, env: EnvFactorySpec, workers: int, battles: int, master_seed: int) -> None:
        if workers < 0 or battles < 1:
            raise ValueError(f"SteppingBeside(workers={workers}, battles={battles}): workers >= 0 "
                             "and battles >= 1")
        self.args, self.workers, self.procs = (env, battles, master_seed), workers, []

    def __enter__(self) -> "SteppingBeside":
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        try:
            for w in range(self.workers):
                ready = ctx.Event()
                p = ctx.Process(target=_step_beside, args=(*self.args, ready, self.stop), daemon=True)
                with _SpawnEnv():
                    p.start()
                self.procs.append(p)
                deadline = time.monotonic() + self.START_S
                while not ready.wait(0.2):
                    if not p.is_alive() or time.monotonic() > deadline:
                        fate = (f"died (exit code {p.exitcode})" if not p.is_alive()
                                else f"did not step within {self.START_S:.0f} s")
                        raise RuntimeError(f"SteppingBeside: process {w} {fate} before its first step; "
                                           "its traceback, if any, is above")
        except BaseException:
            self._end()
            raise
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        dead = [(w, p.exitcode) for w, p in enumerate(self.procs) if not p.is_alive()]
        self._end()
        if dead and exc_type is None:
            w, code = dead[0]
            raise RuntimeError(f"SteppingBeside: process {w} died in the block (exit code {code}), so "
                               "the block ran beside less load than asked; its traceback is above")

    def _end(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(5)


def _bench_round_actions(f: "_FarmCore", table: Any, rnd: RolloutRound, step: int,
                         master_seed: int) -> np.ndarray:
    """_bench_actions on the masks of the round's packed rows, as a learner reads them."""
    a0, a1 = table.offsets["mask"]
    rows = f.rect[rnd.cycle + f.k - 1, rnd.slots]
    masks = np.unpackbits(rows[:, a0:a1], axis=1, bitorder="little")[:, : table.n_actions]
    return _bench_actions(master_seed, step, masks, rnd.slots, f.R)


def _bench_farm_arm(env: EnvFactorySpec, table: Any, K: int, S: int, battles: int, cycles: int,
                    iterations: int, master_seed: int,
                    assign_fn: Callable[[int, int], Assignment] = mirror_assignment,
                    scripted_mask_only: bool = False) -> tuple[float, float, str]:
    cfg = FarmConfig(env=env, master_seed=master_seed, workers=K, shards_per_worker=S,
                     games_per_worker=battles // K, cycles=cycles, viewer=False,
                     scripted_mask_only=scripted_mask_only)
    f = ProcessFarm(cfg, table, assign_fn)
    h = hashlib.sha256()
    try:
        for it in range(iterations + 1):
            opening = (tuple(f.assignment) if it else
                       tuple(assign_fn(b, 0) for b in range(cfg.n_battles)))
            f.begin_iteration(SlotPlan(it, cfg.n_battles, cfg.n_slots, opening, ()))
            if it == 1:                                    # after the warm-up iteration
                t0, wait = time.perf_counter(), 0.0
            for c in range(cycles + 1):
                for _ in range(cfg.n_shards):
                    w0 = time.perf_counter()
                    rnd = f.next_round()
                    if it >= 1:
                        wait += time.perf_counter() - w0
                    if c < cycles:
                        acts = _bench_round_actions(f, table, rnd, it * cycles + c, master_seed)
                        if it >= 1:
                            h.update(acts.tobytes())
                        f.submit(acts, 0.99)
        dt = time.perf_counter() - t0
    finally:
        f.close()
    return dt, wait / dt, h.hexdigest()[:16]


def bench_farm(env: EnvFactorySpec | None = None, *, battles: int = 16, cycles: int = 64,
               iterations: int = 2,
               arms: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 1), (2, 2)),
               repeats: int = 3, master_seed: int = 0) -> dict[str, Any]:
    """Game-steps per second (one decision of one battle) collected by ProcessFarm per
    (workers, shards_per_worker) arm, against one process stepping ClashSelfPlayVecEnv directly;
    same battles (env/battle/{b}/ordinal/{k} seeds), same actions (_bench_actions reading each
    arm's own masks: the farm's from the packed rows, as a learner would). One warm-up iteration
    per measurement is not timed. The arms are INTERLEAVED `repeats` times (direct, arm 1, arm
    2, ..., direct, ...) because the machine is shared and its load drifts; each arm reports
    every measurement and the median. Equal `actions_digest`s show the arms played the same
    games. The farm also pays codec.pack for every row, which the direct loop does not."""
    env = env or default_env_spec()
    _, table = preflight(env, master_seed=master_seed)
    steps = battles * cycles * iterations
    out: dict[str, Any] = {"battles": battles, "cycles": cycles, "iterations": iterations,
                           "game_steps": steps, "cpus": os.cpu_count(), "repeats": repeats,
                           "loadavg_before": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    runs: dict[str, list[float]] = {}
    extra: dict[str, dict[str, Any]] = {}
    names = ["direct"] + [f"farm_w{K}_s{S}" for K, S in arms if battles % (K * S) == 0]
    for _ in range(repeats):
        dt, digest = _bench_direct(env, battles, cycles, iterations, master_seed)
        runs.setdefault("direct", []).append(steps / dt)
        extra["direct"] = {"actions_digest": digest}
        for K, S in arms:
            if battles % (K * S):
                continue
            dt, wait_frac, digest = _bench_farm_arm(env, table, K, S, battles, cycles,
                                                    iterations, master_seed)
            name = f"farm_w{K}_s{S}"
            runs.setdefault(name, []).append(steps / dt)
            extra[name] = {"actions_digest": digest, "parent_wait_frac": wait_frac}
    base = float(np.median(runs["direct"]))
    for name in names:
        med = float(np.median(runs[name]))
        out[name] = {"game_steps_per_s_median": med, "runs": [round(x, 1) for x in runs[name]],
                     "vs_direct": med / base, **extra[name]}
    out["loadavg_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return out


def _bench_scripted_assign(b: int, k: int) -> Assignment:
    return scripted_assignment(b, k, "random_legal", learner_seat=b % 2)


def bench_mask_only(env: EnvFactorySpec | None = None, *, battles: int = 16, cycles: int = 64,
                    iterations: int = 2, repeats: int = 3, master_seed: int = 0) -> dict[str, Any]:
    """Game-steps per second of one worker whose every battle is learner vs random_legal, with the
    scripted seats' observations built in full and mask-only (FarmConfig.scripted_mask_only),
    interleaved `repeats` times; equal actions digests show both arms saw the same masks (the
    learner-side bytes are identical: tests/test_farm.py proves it)."""
    env = env or default_env_spec()
    _, table = preflight(env, master_seed=master_seed)
    steps = battles * cycles * iterations
    runs: dict[str, list[float]] = {"full": [], "mask_only": []}
    digests: dict[str, str] = {}
    for _ in range(repeats):
        for name, flag in (("full", False), ("mask_only", True)):
            dt, _, digest = _bench_farm_arm(env, table, 1, 1, battles, cycles, iterations,
                                            master_seed, _bench_scripted_assign, flag)
            runs[name].append(steps / dt)
            digests[name] = digest
    med = {k: float(np.median(v)) for k, v in runs.items()}
    return {"battles": battles, "cycles": cycles, "iterations": iterations, "cpus": os.cpu_count(),
            **{k: {"game_steps_per_s_median": med[k], "runs": [round(x, 1) for x in runs[k]],
                   "actions_digest": digests[k]} for k in runs},
            "speedup": med["mask_only"] / med["full"]}


def bench_replay(env: EnvFactorySpec | None = None, *, battles: int = 16, shards: int = 2,
                 cycles: int = 171, iterations: int = 2, master_seed: int = 0) -> dict[str, Any]:
    """What a resume's re-simulation costs (design 3.9), on the cpu profile's geometry by default
    (one worker, 2 shards of 8 battles, T = 171): `iterations` of _bench_actions on a ProcessFarm,
    then the first begin_iteration of a farm resumed from that boundary (its PLAN replays every
    battle in flight) against a fresh farm's."""
    env = env or default_env_spec()
    _, table = preflight(env, master_seed=master_seed)
    cfg = FarmConfig(env=env, master_seed=master_seed, shards_per_worker=shards, games_per_worker=battles,
                     cycles=cycles, viewer=False)
    f = ProcessFarm(cfg, table, mirror_assignment)
    try:
        for it in range(iterations):
            f.begin_iteration(SlotPlan(it, cfg.n_battles, cfg.n_slots, tuple(
                f.assignment if it else [mirror_assignment(b, 0) for b in range(battles)]), ()))
            for c in range(cycles + 1):
                for _ in range(cfg.n_shards):
                    rnd = f.next_round()
                    if c < cycles:
                        f.submit(_bench_round_actions(f, table, rnd, it * cycles + c, master_seed), 0.99)
        held, ordinals, opening = f.in_flight(), f.ordinals.tolist(), tuple(f.assignment)
    finally:
        f.close()
    out: dict[str, Any] = {"battles": battles, "shards": shards, "cycles": cycles, "iterations": iterations,
                           "in_flight_battles": len(held),
                           "in_flight_decisions": sum(len(x.actions) for x in held)}
    for name, c in (("fresh", cfg), ("resumed", msgspec.structs.replace(
            cfg, start_ordinals=ordinals, start_in_flight=held))):
        g = ProcessFarm(c, table, mirror_assignment)
        try:
            t0 = time.perf_counter()
            g.begin_iteration(SlotPlan(iterations, cfg.n_battles, cfg.n_slots, opening, ()))
            out[f"first_plan_s_{name}"] = round(time.perf_counter() - t0, 3)
        finally:
            g.close()
    out["ms_per_decision"] = round(1e3 * (out["first_plan_s_resumed"] - out["first_plan_s_fresh"])
                                   / max(out["in_flight_decisions"], 1), 3)
    return out


if __name__ == "__main__":
    # Through the importable module, not __main__: a spawned worker's target must be found by
    # module name, and _SpawnEnv hides the parent's __main__ from the child.
    import farm as _farm
    if sys.argv[1:] == ["mask-only"]:
        print(json.dumps(_farm.bench_mask_only(), indent=1))
    elif sys.argv[1:] == ["replay"]:
        print(json.dumps(_farm.bench_replay(), indent=1))
    else:
        print(json.dumps(_farm.bench_farm(), indent=1))
