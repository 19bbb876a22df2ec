"""Tests for farm.py: seeding, the env description, the potential reward, the byte layout, the
round protocol on real RustEngine battles, the transition alignment, and (slow) ProcessFarm
against InlineFarm byte for byte plus worker hygiene. Geometry is kept tiny: few battles and a
StepLimit truncation, so episodes end inside an iteration."""
from __future__ import annotations

import collections
import os
import re
import struct
import threading
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

import farm

MASTER = 7


# --- helpers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def short_env():
    """The default env with a 20-decision truncation (the first ~8 decisions are a deploy
    lockout on RustEngine, so 20 leaves room for plays)."""
    spec = farm.default_env_spec(max_steps=20)
    env_spec, table = farm.preflight(spec, frame_stack=2, master_seed=MASTER)
    return spec, env_spec, table


def mixed_assign(b: int, k: int) -> farm.Assignment:
    """Odd battles scripted (random_legal / push alternating by ordinal, learner seat
    alternating), even battles mirror."""
    if b % 2 == 0:
        return farm.mirror_assignment(b, k)
    name = ("random_legal", "push")[k % 2]
    return farm.scripted_assignment(b, k, name, learner_seat=(b // 2 + k) % 2)


def opening_plan(cfg: farm.FarmConfig, assign=mixed_assign, iteration: int = 0) -> farm.SlotPlan:
    return farm.SlotPlan(iteration, cfg.n_battles, cfg.n_slots,
                         tuple(assign(b, 0) for b in range(cfg.n_battles)), ())


def legal_actions(f, rnd, table, rng, noop_prob=0.6):
    """Random legal actions read from the packed mask in the rectangle, as a learner would."""
    a0, a1 = table.offsets["mask"]
    rows = f.rect[rnd.cycle + f.k - 1, rnd.slots]
    masks = np.unpackbits(rows[:, a0:a1], axis=1, bitorder="little")[:, : table.n_actions]
    out = np.zeros(len(rnd.slots), np.int64)
    for i, m in enumerate(masks):
        legal = np.flatnonzero(m[1:]) + 1
        if legal.size and rng.random() >= noop_prob:
            out[i] = legal[rng.integers(legal.size)]
    return out


def drive(f, cfg, table, iterations, gamma=0.99, assign=mixed_assign, log=None, first=0, opening=None):
    """Run whole iterations, numbered from `first` (the actions are a function of the number);
    the first opens on `opening` (an assignment table: a resume's), else on the farm's current
    assignments, or at iteration 0 on assign's ordinal-0 table.
    Returns per-iteration copies of rect, scalars, finals, episodes, ordinals, first_obs."""
    out = []
    for it in range(first, first + iterations):
        held = opening if it == first and opening is not None else tuple(f.assignment) if it > 0 else None
        plan = farm.SlotPlan(it, cfg.n_battles, cfg.n_slots, tuple(held), ()) if held is not None \
            else opening_plan(cfg, assign)
        f.begin_iteration(plan)
        g = gamma(it) if callable(gamma) else gamma
        for c in range(cfg.cycles + 1):
            for j in range(cfg.n_shards):
                rnd = f.next_round(60)
                assert rnd.cycle == c and rnd.shard == j
                if log is not None:
                    log.append(rnd)
                if c < cfg.cycles:
                    rng = farm.derive_generator(MASTER, f"test/act/{it}/{c}/{j}")
                    acts = legal_actions(f, rnd, table, rng)
                    acts[rnd.group == farm.GROUP_SCRIPTED] = 0   # the worker fills these
                    f.submit(acts, g)
        out.append(dict(rect=f.rect.copy(), scalars=f.scalars.copy(), finals=dict(f.finals),
                        episodes=list(f.episodes), ordinals=f.ordinals.copy(),
                        first_obs=f.first_obs.copy()))
    return out


# --- 1. seeding (design 2.2) ------------------------------------------------------------------

def test_seeding_values_are_pinned():
    # pinned on 2026-11-29; a change here changes every stream of every run: deliberate only
    assert farm.derive_int(0, "env/battle/0/ordinal/0") == 596280080632173225
    assert farm.derive_int(12345, "act/iteration/3/cycle/7") == 779483573715172525
    g = farm.derive_generator(7, "ppo/minibatch/iteration/1/epoch/2")
    assert g.integers(0, 2**31, 3).tolist() == [467091564, 1961974959, 461906828]
    assert farm.derive_seedseq(1, "x").generate_state(2).tolist() == [860593039, 1304462745]


def test_seeding_is_addressed_by_name_not_order():
    a = farm.derive_int(3, "env/battle/5/ordinal/2")
    farm.derive_int(3, "a/new/consumer")        # a new stream cannot perturb an existing one
    assert farm.derive_int(3, "env/battle/5/ordinal/2") == a
    assert farm.derive_int(3, "env/battle/5/ordinal/3") != a
    assert farm.derive_int(4, "env/battle/5/ordinal/2") != a
    assert 0 <= a < 2**63


def test_assignment_and_plan_are_spec_structs():
    a = farm.Assignment(battle=1, ordinal=2, role=2, opponent_id="scripted:push",
                        group=(-1, -2), learner_seat=0)
    plan = farm.SlotPlan(iteration=0, n_battles=1, n_slots=2, assignment=(a,),
                         resident_snapshots=())
    back = msgspec.json.decode(msgspec.json.encode(plan), type=farm.SlotPlan)
    assert back == plan and back.assignment[0].group == (-1, -2)
    assert farm.Assignment.__struct_fields__ == (
        "battle", "ordinal", "role", "opponent_id", "group", "learner_seat")


# --- 2. the env description -------------------------------------------------------------------

def test_env_value_digest_hashes_by_value():
    base = farm.default_env_spec(max_steps=20)
    spelled = msgspec.structs.replace(
        base, truncation=[farm.ComponentSpec("royalegym.done_condition.StepLimitCondition",
                                             {"max_steps": 20.0})],
        state_mutator=farm.ComponentSpec("royalegym.state_mutator.DefaultStateMutator",
                                         {"decks": None}))
    assert farm.env_value_digest(base) == farm.env_value_digest(spelled)
    assert base.digest() != spelled.digest()          # the spelling digest sees the difference
    other = farm.default_env_spec(max_steps=21)
    assert farm.env_value_digest(other) != farm.env_value_digest(base)
    weights = msgspec.structs.replace(
        base, reward_fn=farm.ComponentSpec("farm.default_potential_reward", {"elixir": 0.06}))
    assert farm.env_value_digest(weights) != farm.env_value_digest(base)
    revealed = farm.default_env_spec(max_steps=20, reveal_spell_aim=True)
    assert farm.env_value_digest(revealed) != farm.env_value_digest(base)


def test_component_allow_list_refuses_other_modules():
    with pytest.raises(ValueError, match="'os.system' is not on the allow-list"):
        farm.resolve_class("os.system")
    assert farm.resolve_class("collections.OrderedDict", ["collections"]) is collections.OrderedDict
    bad = msgspec.structs.replace(farm.default_env_spec(),
                                  reward_fn=farm.ComponentSpec("subprocess.Popen"))
    with pytest.raises(ValueError, match="subprocess.Popen"):
        farm.env_factory(bad)


def test_a_process_asks_the_engine_where_its_card_table_comes_from_once():
    """Every RustEngine construction asks; the answer is fixed once the extension is loaded, so
    after farm's import the engine answers once a process, and the same answer every time."""
    import royalesim
    from royalegym.rust_engine import embedded_card_table
    ask = royalesim.card_table_source
    before = ask.cache_info()
    farm.build_vec(farm.default_env_spec(max_steps=20), 3)
    after = ask.cache_info()
    asked = lambda info: info.hits + info.misses
    assert after.misses == 1 and asked(after) >= asked(before) + 3    # one engine a battle
    assert ask() == ask.__wrapped__()
    assert (embedded_card_table() is not None) == (ask() == "embedded")


@pytest.mark.parametrize("spell_aim", [False, True])
def test_env_spec_is_read_off_the_env(spell_aim):
    spec = farm.default_env_spec(max_steps=20, reveal_spell_aim=spell_aim)
    env = farm.env_factory(spec)()
    env.reset(seed=0)
    es = farm.read_env_spec(spec, env, frame_stack=2)
    space = env.observation_space("blue")
    assert es.spatial_shape == space["spatial"].shape
    assert es.vector_size == space["vector"].shape[0]
    assert es.n_actions == env.action_space("blue").n
    assert es.obs_space["action_mask"].shape == space["action_mask"].shape
    assert len(es.obs_space["spatial"].low) == space["spatial"].shape[0]      # per channel
    assert [n for n, _, _ in es.vector_layout] == [f.key for f in env.obs_builder.vector_layout()]
    assert sum(s for _, _, s in es.vector_layout) == es.vector_size
    assert es.spatial_layout == tuple(env.obs_builder.spatial_layout())
    assert es.decision_ticks == -(-es.decision_ms // es.tick_ms)
    assert es.engine_binary == env.config()["engine"]["params"]["engine_binary_sha256"]
    assert es.engine_build_digest == env.config()["build_digest"]
    assert es.tiles == (space["mask_planes"].shape[1], space["mask_planes"].shape[2])
    assert es.env_value_digest == farm.env_value_digest(spec)
    assert msgspec.json.decode(msgspec.json.encode(es), type=farm.EnvSpec) == es
    # the reveal moves the plane count and the obs digest
    if spell_aim:
        plain_env = farm.env_factory(farm.default_env_spec(max_steps=20))()
        plain_env.reset(seed=0)
        plain = farm.read_env_spec(farm.default_env_spec(max_steps=20), plain_env, 2)
        assert es.spatial_shape[0] == plain.spatial_shape[0] + 1
        assert es.obs_digest != plain.obs_digest


# --- 3. the potential reward (design 4) -------------------------------------------------------

def _play(env, steps, seed):
    from royalegym.selfplay import RandomLegalOpponent
    opp, rng = RandomLegalOpponent(0.5), farm.derive_generator(seed, "test/reward")
    obs, _ = env.reset(seed=seed)
    for _ in range(steps):
        prev = env.battle_state
        acts = {a: opp.act({}, obs[a]["action_mask"], rng) for a in ("blue", "red")}
        obs, rew, term, trunc, _ = env.step(acts)
        yield prev, env.battle_state, rew
        if term["blue"] or trunc["blue"]:
            return


def test_each_potential_term_is_gamma_phi_next_minus_phi_on_real_transitions():
    spec = farm.default_env_spec(max_steps=60)
    env = farm.env_factory(spec)()
    rf = env.reward_fn
    assert isinstance(rf, farm.PotentialCombinedReward)
    rf.set_gamma(0.9)
    assert all(t.gamma == 0.9 for t, _ in rf.terms if isinstance(t, farm.PotentialReward))
    moved = 0
    for prev, state, rew in _play(env, 60, seed=3):
        for team in (0, 1):
            got = rf.terms_for(team)
            for term, w in rf.terms[1:]:
                want = w * (0.9 * term.phi(state, team) - term.phi(prev, team))
                assert got[type(term).__name__] == pytest.approx(float(want), abs=1e-12)
                moved += got[type(term).__name__] != 0
        # exactly antisymmetric between the seats, term by term
        for name, v in rf.terms_for(0).items():
            assert v == -rf.terms_for(1)[name], name
        assert rew["blue"] == -rew["red"]
    assert moved > 0, "no shaping term moved in 60 decisions; the check saw nothing"
    assert set(rf.terms_for(0)) == {"terminal", "PotentialCrownReward", "PotentialTowerHPReward",
                                    "CommittedElixirPotential"}


def test_the_elixir_potential_is_the_exact_fraction_sum_of_the_bar_and_the_priced_board():
    """CommittedElixirPotential counts in integer units of 1 / lcm(1000, every card's count); its
    Phi must be exactly the Fraction its definition writes out, on real states of both teams,
    and it must pay gamma * Phi(s') - Phi(s) from the Phi it kept for s (one read a step)."""
    from fractions import Fraction

    from royalegym.protocol import EntityKind
    env = farm.env_factory(farm.default_env_spec(max_steps=80))()
    term = next(t for t, _ in env.reward_fn.terms if isinstance(t, farm.CommittedElixirPotential))
    price = {c.card_id: (Fraction(c.elixir, max(1, c.count)), (c.hitpoints, c.radius, c.flying))
             for c in env.engine.cards()}

    def written_out(state, team):
        side = lambda t: Fraction(state.players[t].elixir_milli, 1000) + sum(
            (price[e.card_id][0] for e in state.entities
             if e.team == t and e.kind not in (EntityKind.KING_TOWER, EntityKind.PRINCESS_TOWER)
             and e.card_id in price and price[e.card_id][1] == (e.max_hp, e.radius, e.flying)), Fraction(0))
        return (side(team) - side(1 - team)) / Fraction(10.0)

    units = 0
    for prev, state, _ in _play(env, 80, seed=5):
        for team in (0, 1):
            assert term.potential(state, team) == written_out(state, team)
            assert term.get_reward(team, prev, state, []) == float(
                term.gamma * written_out(state, team) - written_out(prev, team)) or state.game_over
        units += sum(e.kind not in (EntityKind.KING_TOWER, EntityKind.PRINCESS_TOWER) for e in state.entities)
    assert units > 0, "no unit was on the board in 80 decisions; the board's sum was never checked"


def test_a_step_reads_each_potential_once_a_team_the_step_before_s_phi_kept():
    """PotentialReward keeps the last Phi it read: the env's step reads Phi(s) back (its prev is
    the state the step before read as s') and Phi(s') anew, one potential a team a step."""
    env = farm.env_factory(farm.default_env_spec(max_steps=40))()
    terms = [t for t, _ in env.reward_fn.terms if isinstance(t, farm.PotentialReward)]
    reads = {id(t): 0 for t in terms}
    for t in terms:
        real = t.potential

        def counted(state, team, _real=real, _t=t):
            reads[id(_t)] += 1
            return _real(state, team)
        t.potential = counted
    live = sum(not state.game_over for _, state, _ in _play(env, 40, seed=9))
    assert live > 10
    # each team: the reset state once, then one new state a live step
    assert set(reads.values()) == {2 * (1 + live)}, reads


def test_a_potential_is_zero_once_the_battle_is_over():
    p = SimpleNamespace(crowns=1, tower_hp=[100, 50, 0], tower_max_hp=[100, 100, 100],
                        elixir_milli=3000)
    q = SimpleNamespace(crowns=0, tower_hp=[100, 100, 100], tower_max_hp=[100, 100, 100],
                        elixir_milli=7000)
    live = SimpleNamespace(game_over=False, players=[p, q], entities=[])
    over = SimpleNamespace(game_over=True, players=[p, q], entities=[])
    for term in (farm.PotentialCrownReward(), farm.PotentialTowerHPReward(),
                 farm.CommittedElixirPotential()):
        term._value, term._row = {}, {}
        term.set_gamma(0.97)
        assert term.phi(over, 0) == 0 and term.phi(live, 0) != 0
        # into game over the term pays -Phi(s) only; on a live state gamma*Phi(s') - Phi(s)
        assert term.get_reward(0, live, over, []) == pytest.approx(-float(term.phi(live, 0)))
        assert term.get_reward(0, live, live, []) == pytest.approx(-0.03 * float(term.phi(live, 0)))
    assert farm.CommittedElixirPotential().potential(live, 0) == pytest.approx((3 - 7) / 10)


@pytest.mark.parametrize("kind", ["inline", pytest.param("process", marks=pytest.mark.slow)])
def test_the_schedule_s_gamma_reaches_the_reward_during_collection(kind):
    spec = farm.default_env_spec(max_steps=20, reward=farm.ComponentSpec("farm.probe_reward"))
    _, table = farm.preflight(spec, master_seed=MASTER, sample_steps=2)
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, games_per_worker=1, cycles=6,
                          viewer=False)
    F = farm.InlineFarm if kind == "inline" else farm.ProcessFarm
    f = F(cfg, table, farm.mirror_assignment)
    try:
        res = drive(f, cfg, table, 2, gamma=lambda it: (0.9, 0.95)[it],
                    assign=farm.mirror_assignment)
    finally:
        f.close()
    for it, g in enumerate((0.9, 0.95)):
        assert np.all(res[it]["scalars"]["reward"] == np.float32(g - 1.0)), it


def _loudness(elixir: float, steps: int = 60) -> tuple[dict, dict, dict]:
    """One seat's step_abs after `steps` random legal decisions of both seats, then the same
    right after a reset (still the ended episode's) and after the next episode's first step."""
    from royalegym.action import NOOP
    spec = farm.default_env_spec(reward=farm.ComponentSpec("farm.default_potential_reward",
                                                           {"elixir": elixir}))
    env = farm.env_factory(spec)()
    farm.set_env_gamma(env, 0.99)
    rng = np.random.default_rng(3)
    obs, _ = env.reset(seed=11)
    for _ in range(steps):
        acts = {}
        for seat in ("blue", "red"):
            legal = np.flatnonzero(obs[seat]["action_mask"])
            acts[seat] = int(rng.choice(legal)) if rng.random() < 0.3 else NOOP
        obs, *_ = env.step(acts)
    ended = farm.episode_step_abs(env, 1)
    env.reset(seed=12)
    kept = farm.episode_step_abs(env, 1)
    env.step({"blue": NOOP, "red": NOOP})
    return ended, kept, farm.episode_step_abs(env, 1)


def test_a_term_s_loudness_is_linear_in_its_weight_and_kept_until_the_next_episode_steps():
    """design 9.2: sum |F_t| per term. Doubling the elixir weight doubles its term's loudness
    exactly (the same battle: the weight changes no action) and leaves the others'."""
    one, kept, fresh = _loudness(0.05)
    two, _, _ = _loudness(0.10)
    assert one["CommittedElixirPotential"] > 0.0 and one["terminal"] == 0.0
    assert two["CommittedElixirPotential"] == 2 * one["CommittedElixirPotential"]
    assert {k: v for k, v in two.items() if k != "CommittedElixirPotential"} == \
        {k: v for k, v in one.items() if k != "CommittedElixirPotential"}
    assert kept == one                                        # readable after the autoreset
    assert fresh != one and fresh["CommittedElixirPotential"] < one["CommittedElixirPotential"]


def _digested_battle(seed: int, change_first_play: bool = False) -> tuple[str, list[int], str]:
    """A battle to its end under a TrajectoryDigest, both seats random legal (the first play moved
    to another legal action if asked): its digest, the engine hashes seen at the reset and after
    each decision, and the digest read after the next reset."""
    from royalegym.action import NOOP
    env = farm.env_factory(farm.default_env_spec())()
    env.recorder = farm.TrajectoryDigest()
    rng = np.random.default_rng(5)
    obs, _ = env.reset(seed=seed)
    hashes, done, changed = [int(env.engine.state_hash())], False, not change_first_play
    while not done:
        acts = {}
        for seat in ("blue", "red"):
            legal = np.flatnonzero(obs[seat]["action_mask"])
            acts[seat] = int(rng.choice(legal)) if rng.random() < 0.2 else NOOP
            if not changed and acts[seat] != NOOP and len(legal) > 2:
                acts[seat], changed = int(next(a for a in legal if a not in (NOOP, acts[seat]))), True
        obs, _, term, trunc, _ = env.step(acts)
        hashes.append(int(env.engine.state_hash()))
        done = term["blue"] or trunc["blue"]
    digest = env.recorder.digest
    env.reset(seed=seed + 1)
    return digest, hashes, env.recorder.digest


def test_the_trajectory_digest_chains_every_decisions_engine_state_and_is_kept_past_the_reset():
    import hashlib
    digest, hashes, kept = _digested_battle(21)
    h = hashlib.blake2b(digest_size=8)
    for x in hashes:
        h.update(x.to_bytes(8, "little"))
    assert len(hashes) > 50 and digest == h.hexdigest() and kept == digest    # readable after the autoreset
    assert _digested_battle(21)[0] == digest                                   # a function of the battle
    assert _digested_battle(21, change_first_play=True)[0] != digest           # one tile moved: another chain


def test_the_trajectory_digest_says_whether_a_deck_holds_a_card_the_elixir_count_cannot_follow():
    """Noted at the reset from the engine's decks, published at the episode's end, kept past the next
    reset like the digest; every name in ELIXIR_UNCOUNTABLE is a card of the catalogue."""
    env = farm.env_factory(farm.default_env_spec())()
    env.recorder = farm.TrajectoryDigest()
    ids = {c.card_id for c in env.engine.cards() if c.name in farm.ELIXIR_UNCOUNTABLE}
    assert len(ids) == len(farm.ELIXIR_UNCOUNTABLE)
    seen = set()
    for seed in range(40):
        env.reset(seed=seed)
        held = any(c in ids for p in env.battle_state.players for c in p.deck)
        env.recorder.end(env.engine)
        assert env.recorder.elixir_uncountable == held
        seen.add(held)
    assert seen == {True, False}


# --- 4. the byte layout (design 3.4) ----------------------------------------------------------

def test_layout_golden_record():
    # The contract a Rust worker implements: any change here is a LAYOUT_VERSION bump.
    assert farm.LAYOUT_VERSION == 4
    assert (farm.HEADER_BYTES, farm.CONTROL_BYTES, farm.ERROR_BYTES, farm.SCALAR_BYTES,
            farm.ACTION_BYTES, farm.ASSIGN_BYTES, farm.STATS_BYTES,
            farm.PLAN_BYTES) == (128, 64, 512, 32, 2, 4, 64, 24)
    assert (farm.CMD_STEP, farm.CMD_CLOSE, farm.CMD_PLAN, farm.CMD_SPACES, farm.CMD_REPLAN) == (1, 2, 3, 4, 5)
    assert {n: farm.PLAN_DTYPE.fields[n][1] for n in farm.PLAN_DTYPE.names} == {
        "role": 0, "group": 1, "opponent_ix": 2, "learner_seat": 3, "pad": 4, "seed": 8,
        "ordinal": 16}
    assert {n: farm.ASSIGN_DTYPE.fields[n][1] for n in farm.ASSIGN_DTYPE.names} == {
        "group": 0, "opponent_ix": 1, "learner_seat": 2, "present": 3}
    assert {n: farm.STATS_DTYPE.fields[n][1] for n in farm.STATS_DTYPE.names} == {
        "codec_ns": 0, "bytes_out": 8, "clipped": 16, "rounded": 24, "pad": 32}
    assert {n: farm.SCALAR_DTYPE.fields[n][1] for n in farm.SCALAR_DTYPE.names} == {
        "reward": 0, "group": 4, "flags": 5, "deploy_status": 6, "episode_end": 7, "tick": 8,
        "episode_steps": 12, "cards_played": 16, "elixir_leak": 18, "pad": 20}
    assert {n: farm.CONTROL_DTYPE.fields[n][1] for n in farm.CONTROL_DTYPE.names} == {
        "state": 0, "n_slots": 4, "cycle": 8, "err_code": 16, "err_len": 20, "t_env_ns": 24,
        "cmd_seq": 32, "pub_seq": 40, "cmd_kind": 48, "cmd_flags": 50, "cmd_row": 52, "gamma": 56}
    assert farm.shard_layout(4, 100) == {
        "control": (0, 64), "error": (64, 512), "scalars": (576, 128), "finals": (704, 400),
        "actions": (1104, 8), "assign": (1112, 16), "episodes": (1128, 65536),
        "stats": (66664, 64), "total": (0, 66728)}
    # the plan area follows the shard blocks: shard s's n entries at plan_offset + s * n * 24
    assert farm.plan_offset(4, 2, 100) == 4096 + 2 * 66728
    assert farm.segment_b_bytes(4, 2, 100) == 4096 + 2 * 66728 + 2 * 4 * 24
    seg = bytearray(farm.segment_b_bytes(4, 2, 100))
    io1 = farm.shard_io(seg, 4, 2, 100, 1)
    io1.plan[2] = (2, -2, 5, 1, bytes(4), 2**63 + 3, 9)
    off = 4096 + 2 * 66728 + (4 + 2) * 24
    assert bytes(seg[off: off + 24]) == struct.pack("<bbbb4xQq", 2, -2, 5, 1, 2**63 + 3, 9)
    io1.control["cmd_kind"] = farm.CMD_PLAN
    assert struct.unpack_from("<H", seg, 4096 + 66728 + 48)[0] == 3
    assert farm.segment_a_bytes(16, 2, 8, 100) == 128 + 18 * 8 * 100
    buf = bytearray(farm.segment_a_bytes(3, 2, 4, 10))
    farm.write_header(buf, 3, 2, 4, 10)
    import codec
    assert bytes(buf[:40]) == b"CLASHRLB" + struct.pack(
        "<IIIIIIQ", 4, codec.CODEC_VERSION, 3, 2, 4, 10, 128)
    assert bytes(buf[40:128]) == bytes(88)
    rect = farm.rect_view(buf, 3, 2, 4, 10)
    rect[1, 2, 3] = 9                                  # index(t, r) = t * R + r
    assert buf[128 + (1 * 4 + 2) * 10 + 3] == 9


# --- 5. the round protocol and the alignment on real battles ----------------------------------

@pytest.fixture(scope="module")
def inline_run(short_env):
    spec, _, table = short_env
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, shards_per_worker=2,
                          games_per_worker=4, cycles=24, frame_stack=2, viewer=False,
                          scripted_mask_only=False)     # full builds: the reference for mask-only
    f = farm.InlineFarm(cfg, table, mixed_assign)
    log = []
    try:
        res = drive(f, cfg, table, 2, log=log)
    finally:
        f.close()
    return cfg, table, res, log


def test_a_farm_s_battles_reuse_the_engines_a_closed_farm_handed_back(short_env, monkeypatch):
    """farm.close_vec / spare_or_new_engine: a closed farm hands its engines back and the next farm
    of the process on the same engine spec plays on them (in the other order: battle 0 on the last
    battle's engine, every engine handed back mid-episode), every byte, record and ordinal what the
    farm on new engines played, since reset starts a battle from nothing. The preflight neither
    takes a spare nor keeps its engines, and an env on another engine spec builds its own."""
    spec, _, table = short_env
    monkeypatch.setattr(farm, "_SPARE_ENGINES", {})
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, shards_per_worker=2,
                          games_per_worker=4, cycles=24, frame_stack=2, viewer=False)
    engines = lambda f: [e.engine for r in f._runners for e in r.vec.envs]
    runs, used = [], []
    for _ in range(2):
        f = farm.InlineFarm(cfg, table, mixed_assign)
        try:
            used.append(engines(f))
            runs.append(drive(f, cfg, table, 2))
        finally:
            f.close()
    assert len({id(e) for e in used[0]}) == cfg.n_battles
    assert [id(e) for e in used[1]] == [id(e) for e in reversed(used[0])]
    a, b = runs
    assert sum(len(x["episodes"]) for x in a) > cfg.n_battles           # battles played past an episode
    for x, y in zip(a, b, strict=True):
        assert x["rect"].tobytes() == y["rect"].tobytes() and x["scalars"].tobytes() == y["scalars"].tobytes()
        assert all(x["finals"][k].tobytes() == y["finals"][k].tobytes() for k in x["finals"] | y["finals"])
        assert msgspec.json.encode(x["episodes"]) == msgspec.json.encode(y["episodes"])
        assert x["ordinals"].tobytes() == y["ordinals"].tobytes()
    spares = farm._SPARE_ENGINES[farm._engine_key(spec)]
    before = [id(e) for e in spares]
    farm.preflight(spec, frame_stack=2, master_seed=MASTER)
    assert [id(e) for e in spares] == before == [id(e) for e in used[1]]
    delayed = farm.ComponentSpec(spec.engine.cls, {"command_delay_ticks": 0})   # its own key
    other = msgspec.structs.replace(spec, engine=delayed)
    vec = farm.build_vec(other, 1, spare_engines=True)
    assert all(vec.envs[0].engine is not e for e in spares)
    farm.close_vec(vec, other)
    farm.close_vec(vec, other)                                           # closing twice hands back once
    assert len(farm._SPARE_ENGINES[farm._engine_key(other)]) == 1


def test_semantics_on_real_battles(inline_run):
    cfg, table, res, log = inline_run
    for it in res:
        sc = it["scalars"]
        done = (sc["flags"] & (farm.F_TERMINATED | farm.F_TRUNCATED)) != 0
        # episodes end in pairs: both seats of a battle on the same row
        assert np.array_equal(done[:, 0::2], done[:, 1::2])
        # deploy_status is never a rejection under legal actions (1..11 = a mask bug)
        ds = sc["deploy_status"]
        assert not np.any((ds >= 1) & (ds <= 11))
        assert np.any(ds == 0), "no card was played; the check saw nothing"
        assert np.all(sc["flags"] & farm.F_VALID)
        # rewards antisymmetric on mirror battles (even battles are mirror)
        mirror = [s for s in range(cfg.n_slots) if (s // 2) % 2 == 0]
        r = sc["reward"][:, mirror]
        assert np.array_equal(r[:, 0::2], -r[:, 1::2])
        assert np.any(r != 0)
        # the terminal scalars match what the worker counted, on the row of the ending action
        for e in it["episodes"]:
            rows = np.flatnonzero(done[:, e.slot])
            row = [t for t in rows if sc["episode_steps"][t, e.slot] == e.episode_steps]
            assert row, e
            assert sc["cards_played"][row[0], e.slot] == e.cards_played
            assert sc["elixir_leak"][row[0], e.slot] == e.elixir_leak_steps
            assert e.illegal_commands == 0
            assert e.episode_seed == farm.derive_int(MASTER, e.episode_seed_path)
            assert e.episode_seed_path == f"env/battle/{e.battle}/ordinal/{e.ordinal}"
        # every truncated cell has its final observation, keyed by the action's row
        tr = np.argwhere(sc["flags"] & farm.F_TRUNCATED)
        assert {(int(t), int(s)) for t, s in tr} == set(it["finals"])
    scripted = [e for it in res for e in it["episodes"]
                if e.bucket == "scripted" and e.policy_id.startswith("scripted:")]
    assert scripted and any(seat == e.seat for e in scripted for _, seat, _ in e.played), \
        "no scripted seat ever played a card: the worker did not fill the scripted actions"
    played = [e for it in res for e in it["episodes"] if e.played]
    assert played and all(seat in (0, 1) and a > 0 for e in played for _, seat, a in e.played)
    pairs = {}
    for it in res:
        for e in it["episodes"]:
            pairs.setdefault((e.battle, e.ordinal), []).append(e.seat)
    assert all(sorted(v) == [0, 1] for v in pairs.values())


def test_the_workers_layout_changes_no_byte_but_the_records_worker_and_shard(short_env, inline_run):
    """Two workers of one shard each host the battles one worker of two shards does (slot ranges
    by global shard), with the scripted seats drawing from streams named by their global slot: the
    rectangle, scalars, finals and episodes are the same bytes, the records' worker and shard aside
    (random_legal draws, so a stream named by its worker would show)."""
    spec, _, table = short_env
    one = inline_run[0]
    two = msgspec.structs.replace(one, workers=2, shards_per_worker=1, games_per_worker=2)
    f = farm.InlineFarm(two, table, mixed_assign)
    try:
        b = drive(f, two, table, 2)
    finally:
        f.close()
    a = inline_run[2]
    for x, y in zip(a, b, strict=True):
        assert x["rect"].tobytes() == y["rect"].tobytes() and x["scalars"].tobytes() == y["scalars"].tobytes()
        assert all(x["finals"][k].tobytes() == y["finals"][k].tobytes() for k in x["finals"])
        strip = [[msgspec.structs.replace(e, worker=0, shard=0) for e in z["episodes"]] for z in (x, y)]
        assert msgspec.json.encode(strip[0]) == msgspec.json.encode(strip[1])
    assert {e.worker for x in b for e in x["episodes"]} == {0, 1}
    assert any(e.policy_id == "scripted:random_legal" and e.played for x in a for e in x["episodes"])


def test_a_battle_played_to_game_over_reports_its_result():
    """Push (scripted, red) against a learner that never plays: the battle ends by game over,
    and the codes, the terminal term and the records agree on who won."""
    spec = farm.default_env_spec(max_steps=900)
    _, table = farm.preflight(spec, master_seed=1, sample_steps=2)
    cfg = farm.FarmConfig(env=spec, master_seed=1, workers=1, games_per_worker=1, cycles=400,
                          viewer=False)
    A = lambda b, k: farm.scripted_assignment(b, k, "push", learner_seat=0)
    f = farm.InlineFarm(cfg, table, A)
    try:
        f.begin_iteration(farm.SlotPlan(0, 1, 2, (A(0, 0),), ()))
        for _ in range(cfg.cycles):
            rnd = f.next_round(30)
            if rnd.episodes:
                break
            f.submit(np.zeros(2, np.int64), 0.99)
    finally:
        f.close()
    assert rnd.episodes, "push did not win within 400 decisions"
    row = rnd.row
    assert rnd.terminated.all() and not rnd.truncated.any()
    assert rnd.episode_end.tolist() == [farm.END_LOSS, farm.END_WIN]
    blue, red = sorted(rnd.episodes, key=lambda e: e.seat)
    assert (blue.winner, blue.outcome, red.outcome) == (1, -1, 1)
    assert red.enemy_crowns == 0 and red.own_crowns > 0
    assert (blue.policy_id, blue.opponent_id, red.policy_id) == ("learner", "scripted:push",
                                                                  "scripted:push")
    assert blue.reward_terms["terminal"] == -1.0 and red.reward_terms["terminal"] == 1.0
    # how loud each term was (design 9.2): the objective pays once, so its sum |F_t| is |F_T|;
    # a shaping term's is at least its signed sum's magnitude, and push's plays moved elixir
    for e in (blue, red):
        assert e.reward_terms_step_abs["terminal"] == 1.0
        assert sorted(e.reward_terms_step_abs) == sorted(e.reward_terms)
        assert all(e.reward_terms_step_abs[k] >= abs(v) for k, v in e.reward_terms.items())
    assert (red.reward_terms_step_abs["CommittedElixirPotential"]
            > abs(red.reward_terms["CommittedElixirPotential"]))
    assert blue.undiscounted_return == -red.undiscounted_return
    assert blue.episode_steps == row + 1 and blue.cards_played == 0 and red.cards_played > 0
    assert (row, 1) not in f.finals            # a terminated transition needs no bootstrap


def test_a_battle_s_assignment_changes_only_after_its_episode_ended(inline_run):
    cfg, _, _, log = inline_run
    last_group, ended_since = {}, {}
    for rnd in log:
        for i, s in enumerate(rnd.slots):
            s = int(s)
            if rnd.row >= 0 and (rnd.terminated[i] or rnd.truncated[i]):
                ended_since[s] = True
            g = int(rnd.group[i])
            if s in last_group and last_group[s] != g:
                assert ended_since.get(s), f"slot {s} changed group mid-episode at cycle {rnd.cycle}"
                ended_since[s] = False
            last_group[s] = g
    # the mixture really did reassign: scripted seats moved with learner_seat
    assert any(int(g) == farm.GROUP_SCRIPTED for rnd in log for g in rnd.group)
    changes = sum(1 for a, b in zip(log, log[cfg.n_shards:], strict=False)
                  if not np.array_equal(a.group, b.group))
    assert changes > 0


def test_deals_replace_each_battles_dealer_and_deal_every_episode(short_env):
    """FarmConfig.deals (ladder.seat_decks): battle b's env deals by its own royalegym
    DeckCurriculumStateMutator, on the first reset and on every autoreset after it."""
    spec, _, table = short_env
    deck = ["Knight", "Archer", "Giant", "Musketeer", "Fireball", "Arrows", "MiniPekka", "Valkyrie"]
    field = ["Goblins", "Pekka", "Minions", "Balloon", "Witch", "Barbarians", "Golem", "Skeletons"]
    deals = [{"deck": deck, "p": 1.0, "mirror_p": 1.0},
             {"deck": deck, "p": 1.0, "mirror_p": 0.0, "seat": "red", "pool": [field], "shuffle": 1}]
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, shards_per_worker=1, games_per_worker=2,
                          cycles=25, viewer=False, deals=deals)
    with pytest.raises(ValueError, match="deals has 1 entries; the farm has 2 battles"):
        msgspec.structs.replace(cfg, deals=deals[:1]).check()
    f = farm.InlineFarm(cfg, table, mixed_assign)
    try:
        vec = f._runners[0].vec
        names = {c.card_id: c.name for c in vec.envs[0].engine.cards()}
        hands: list[set[str]] = [set() for _ in range(4)]    # every card seen in hand, per (battle, team)
        f.begin_iteration(opening_plan(cfg))
        for c in range(cfg.cycles + 1):
            f.next_round(10)
            for b, e in enumerate(vec.envs):
                for p in e.battle_state.players:
                    hands[2 * b + p.team] |= {names[i] for i in p.hand if i in names}
            if c < cfg.cycles:
                f.submit(np.zeros(4, np.int64), 0.99)
        assert vec.episode_ordinals == (2, 2)       # the 20-decision episodes ended: a second deal each
        # a hand is drawn from its deck: the mirror battle holds the deck on both seats, the other
        # the deck on red and the field deck on blue (a random deck would not fit in either)
        assert [h <= set(d) for h, d in zip(hands, (deck, deck, field, deck), strict=True)] == [True] * 4
        assert all(len(h) >= 5 for h in hands)      # more than an opening hand of 4 was seen
    finally:
        f.close()


def test_the_plan_command_seats_the_opening_table_and_refuses_an_out_of_step_plan(short_env):
    """design 3.4, 3.5: begin_iteration writes the plan area and sends PLAN; the worker is seated
    before the first STEP, whose assign entries then carry nothing; a battle that reset on the
    iteration's last round is seated by the next PLAN; a plan for another ordinal, or one that
    reseats a battle mid-episode, is refused naming the slot."""
    spec, _, table = short_env
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, shards_per_worker=1,
                          games_per_worker=2, cycles=20, frame_stack=2, viewer=False)
    f = farm.InlineFarm(cfg, table, mixed_assign)
    try:
        r, io = f._runners[0], f._io(0)
        assert (r.asg_ordinal == -1).all()
        f.begin_iteration(opening_plan(cfg))
        want = np.array([g for b in range(2) for g in mixed_assign(b, 0).group], np.int8)
        assert io.plan["group"].tolist() == r.group.tolist() == want.tolist()
        assert io.plan["seed"].tolist() == [farm.derive_int(MASTER, f"env/battle/{b}/ordinal/0")
                                            for b in (0, 0, 1, 1)]
        assert io.plan["opponent_ix"][2:].tolist().count(farm.SCRIPTED_NAMES.index("random_legal")) == 1
        assert r.scripted[2 + (1 - mixed_assign(1, 0).learner_seat)] is not None
        assert io.plan.tobytes() == f.plan_table().tobytes()
        rnd = f.next_round(10)
        f.submit(np.zeros(4, np.int64), 0.99)
        assert not io.assign["present"].any()          # the plan delivered the opening table
        # play to the iteration's end: 20 decisions truncate at cycle 20 (the last round), so
        # the next episodes start there and their seats reach the worker by the next PLAN
        for c in range(1, cfg.cycles + 1):
            rnd = f.next_round(10)
            if c < cfg.cycles:
                f.submit(np.zeros(4, np.int64), 0.99)
        assert rnd.ended_battles.tolist() == [0, 1] and (r.asg_ordinal == 0).all()
        f.begin_iteration(farm.SlotPlan(1, 2, 4, tuple(f.assignment), ()))
        assert (r.asg_ordinal == 1).all() and io.plan["ordinal"].tolist() == [1, 1, 1, 1]
        want = np.array([g for b in range(2) for g in mixed_assign(b, 1).group], np.int8)
        assert r.group.tolist() == want.tolist()
        bad = f.plan_table()
        bad["ordinal"][2:] = 5
        with pytest.raises(farm.FarmError, match=r"worker 0 shard 0 slot 2: the plan is for "
                                                 r"ordinal 5 .* out of step"):
            r.apply_slot_plan(bad, f.rect[:f.k])
        bad = f.plan_table()
        bad["group"][0:2] = farm.GROUP_SCRIPTED
        with pytest.raises(farm.FarmError, match=r"slot 0: the plan seats groups \[-2, -2\] .*mid-episode"):
            r.apply_slot_plan(bad, f.rect[:f.k])
        assert f.spaces(0)["spaces"] == farm.spaces_signature(
            r.vec.single_observation_space, r.vec.single_action_space.n)
    finally:
        f.close()


def test_alignment_the_return_sums_exactly_the_episode_s_own_rows(inline_run):
    """The transition alignment (design 1.1): a transition's reward and flags sit on the row of
    the action that caused it. With a 20-decision truncation and every battle starting at cycle
    0, episode k of every battle occupies rows [20k, 20k+20) of the run; its end flag is on row
    20k+19."""
    cfg, _, res, _ = inline_run
    T = cfg.cycles
    rew = np.concatenate([it["scalars"]["reward"] for it in res])       # run rows
    flags = np.concatenate([it["scalars"]["flags"] for it in res])
    ends = np.flatnonzero(flags[:, 0] & farm.F_TRUNCATED)
    assert ends.tolist() == [19, 39], ends
    episodes = [e for it in res for e in it["episodes"]]
    for e in episodes:
        start = 20 * e.ordinal
        rows = rew[start: start + 20, e.slot]
        total = 0.0
        for x in rows:                   # the worker's order: a running float64 sum
            total += float(x)
        assert e.undiscounted_return == total, (e.slot, e.ordinal)
        assert e.episode_steps == 20
    assert len(episodes) == 2 * cfg.n_slots
    assert any(e.undiscounted_return != 0 for e in episodes)
    # the old convention put the end flag on the row of the arriving observation (20, 40) and
    # lost the transition arriving at row T; here row T-1 of every iteration is filled
    for it in res:
        assert np.all(it["scalars"]["flags"][T - 1] & farm.F_VALID)
        assert np.all(it["scalars"]["tick"][T - 1] > 0)


def test_an_episode_re_simulates_from_its_record(short_env, inline_run):
    """episode_seed + played (both seats, non-no-op) are enough to replay an episode exactly:
    the same return, the same final statistics."""
    spec, _, _ = short_env
    cfg, _, res, _ = inline_run
    recs = [e for it in res for e in it["episodes"] if e.seat == 0 and e.played]
    assert recs
    e = max(recs, key=lambda r: len(r.played))
    env = farm.env_factory(spec)()
    env.reset(seed=e.episode_seed)
    env.reward_fn.set_gamma(0.99)                      # drive()'s gamma
    by_step: dict[int, dict[str, int]] = {}
    for step, seat, action in e.played:
        by_step.setdefault(step, {})[("blue", "red")[seat]] = action
    total = 0.0
    for step in range(e.episode_steps):
        acts = {"blue": 0, "red": 0, **by_step.get(step, {})}
        _, rew, term, trunc, info = env.step(acts)
        total += float(np.float32(rew["blue"]))
    assert term["blue"] or trunc["blue"]
    assert total == e.undiscounted_return
    assert info["blue"]["episode_ticks"] == e.episode_ticks
    assert info["blue"]["own_tower_hp_frac"] == e.own_tower_hp_frac


def stack_valid(first_obs: np.ndarray, k: int) -> np.ndarray:
    """The frame-liveness rule farm.first_obs states, written out as the tests' reference. bool
    (rows - k + 1, R, k): for the observation at rect row q = t + k - 1 (cycle t), which of its k
    frames (oldest..newest, rows q-k+1..q) belong to its own episode. Frame q-i is live iff none
    of rows q-i+1..q starts an episode; the newest frame is always live."""
    rows, R = first_obs.shape
    n = rows - k + 1
    out = np.ones((n, R, k), bool)
    for t in range(n):
        q = t + k - 1
        live = np.ones(R, bool)
        for i in range(1, k):                    # frame q - i, walking back
            live &= ~first_obs[q - i + 1]
            out[t, :, k - 1 - i] = live
    return out


def test_frame_liveness_is_read_at_the_observation_s_own_row(inline_run):
    cfg, _, res, log = inline_run
    # every battle's episode 1 starts at run cycle 20 (iteration 0, cycle 20): with k = 2 the
    # older frame of that observation is the previous episode's and must be dead
    k = cfg.frame_stack
    first = np.zeros((cfg.cycles + k, cfg.n_slots), bool)
    for rnd in log[: (cfg.cycles + 1) * cfg.n_shards]:
        first[rnd.cycle + k - 1, rnd.slots] = rnd.new_episode
    assert np.array_equal(first, res[0]["first_obs"])
    sv = stack_valid(first, k)
    assert sv.shape == (cfg.cycles + 1, cfg.n_slots, k)
    assert not sv[20, :, 0].any() and sv[20, :, 1].all()
    assert sv[21].all() and sv[19].all()
    assert not sv[0, :, 0].any()                      # the reset: no history


def test_ordinals_restore_the_episode_stream(short_env, inline_run):
    """A farm started at the ordinals another reached plays the same episodes: its cycle-0
    observations equal the original's first observations of those episodes."""
    spec, _, table = short_env
    cfg0, _, res, _ = inline_run
    assert res[1]["ordinals"].tolist() == [2] * cfg0.n_battles
    cfg = msgspec.structs.replace(cfg0, start_ordinals=[1] * cfg0.n_battles)
    f = farm.InlineFarm(cfg, table, mixed_assign)
    try:
        # the original's episode 1 began at run cycle 20 = iteration 0, cycle 20
        want = res[0]["rect"][20 + cfg.frame_stack - 1]
        assert np.array_equal(f.rect[cfg.frame_stack - 1], want)
        assert f.ordinals.tolist() == [1] * cfg.n_battles
    finally:
        f.close()


@pytest.mark.parametrize("kind, split", [("inline", 2), ("inline", 3),
                                         pytest.param("process", 2, marks=pytest.mark.slow)])
def test_a_farm_resumed_mid_episode_plays_what_the_unbroken_farm_played(short_env, kind, split):
    """Design 3.9: iterations of 7 cycles against episodes of 20 decisions. The boundary after 2
    iterations finds every battle 14 decisions into its episode; after 3, 1 decision into its next
    (fewer than k = 2: its reset frame is live and must come back too). A farm started from what a
    checkpoint holds there (ordinals, the in-flight logs, the assignment table) re-simulates those
    battles at its first PLAN (scripted seats acting again, each step under the gamma it was
    logged with: the schedule moved between the iterations) and plays the next 2 iterations byte
    for byte as the unbroken farm did: every live frame of the rectangle, the scalars, the finals,
    the episode records (their `played` lists included). The gamma probe's reward (gamma - 1 a
    step) makes the undiscounted return of each record depend on every logged gamma."""
    _, _, table = short_env
    spec = farm.default_env_spec(max_steps=20, reward=farm.ComponentSpec("farm.probe_reward"))
    Farm = farm.InlineFarm if kind == "inline" else farm.ProcessFarm
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, shards_per_worker=2,
                          games_per_worker=4, cycles=7, frame_stack=2, viewer=False)
    gamma = lambda it: (0.99, 0.95, 0.9, 0.85, 0.85)[it]   # a schedule: the log must carry it
    f = farm.InlineFarm(cfg, table, mixed_assign)
    try:
        drive(f, cfg, table, split, gamma=gamma)
        held = dict(start_ordinals=f.ordinals.tolist(), start_in_flight=f.in_flight())
        opening = tuple(f.assignment)
        straight = drive(f, cfg, table, 2, gamma=gamma, first=split)
    finally:
        f.close()
    logged = [0.99] * 7 + [0.95] * 7 if split == 2 else [0.9]        # decisions 0-13; decision 0 of the next
    assert [(x.battle, x.ordinal, x.gammas) for x in held["start_in_flight"]] == \
        [(b, split - 2, logged) for b in range(cfg.n_battles)]
    back = msgspec.json.decode(msgspec.json.encode(held["start_in_flight"]), type=list[farm.InFlight])
    g = Farm(msgspec.structs.replace(cfg, start_ordinals=held["start_ordinals"], start_in_flight=back),
             table, mixed_assign)
    try:
        resumed = drive(g, cfg, table, 2, gamma=gamma, first=split, opening=opening)
    finally:
        g.close()
    k = cfg.frame_stack
    for a, b in zip(straight, resumed, strict=True):
        live = stack_valid(a["first_obs"], k)          # (T + 1, R, k): frame i of cycle t
        assert np.array_equal(a["first_obs"][k - 1:], b["first_obs"][k - 1:])
        for t in range(cfg.cycles + 1):
            for i in range(k):
                q = t + i
                assert np.array_equal(a["rect"][q][live[t, :, i]], b["rect"][q][live[t, :, i]]), (t, i)
        assert a["scalars"].tobytes() == b["scalars"].tobytes()
        assert a["finals"].keys() == b["finals"].keys()
        assert all(np.array_equal(a["finals"][x], b["finals"][x]) for x in a["finals"])
        assert a["episodes"] == b["episodes"] and a["ordinals"].tolist() == b["ordinals"].tolist()
    ended = [e for r in resumed for e in r["episodes"] if e.ordinal == split - 2]   # each in-flight episode,
    assert len(ended) == (2 * cfg.n_battles if split == 2 else 0)                      # recorded whole
    assert all(e.episode_steps == 20 for e in ended) and all(e.played for e in ended[:1])


def test_a_replay_that_the_engine_does_not_follow_is_refused(short_env):
    """A log longer than the episode can be (20 decisions) ends the episode on replay: the
    first PLAN fails naming the battle, its ordinal and the decision (design 3.9)."""
    spec, _, table = short_env
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, games_per_worker=2, cycles=3,
                          frame_stack=1, viewer=False, start_ordinals=[0, 0],
                          start_in_flight=[farm.InFlight(1, 0, [(0, 0)] * 25, [0.99] * 25)])
    f = farm.InlineFarm(cfg, table, mixed_assign)
    try:
        f.begin_iteration(opening_plan(cfg))
        (fail,) = f.drain_failures()
        assert "battle 1 ordinal 0 ended at logged decision 19 of 25 on replay" in fail.message
    finally:
        f.close()
    with pytest.raises(ValueError, match="battle 1 ordinal 3 with 2 actions and 1 gammas"):
        farm.FarmConfig(env=spec, master_seed=MASTER, games_per_worker=2, start_ordinals=[0, 0],
                        start_in_flight=[farm.InFlight(1, 3, [(0, 0)] * 2, [0.99])]).check()


# --- 6. ProcessFarm (slow) --------------------------------------------------------------------

@pytest.mark.slow
def test_process_farm_matches_inline_byte_for_byte(short_env, monkeypatch):
    """2 workers x 2 shards, mirror + scripted, 30 cycles over two iterations (so the frame
    history copy and the iteration boundary are covered). The workers start up side by side:
    every one is spawned before the farm waits for the first one's handshake."""
    spec, env_spec, table = short_env
    launched_at_first_wait = []
    await_start = farm.ProcessFarm._await_start

    def spy(self, w):
        if w == 0:
            launched_at_first_wait.append([p is not None and p.is_alive() for p in self._procs])
        await_start(self, w)
    monkeypatch.setattr(farm.ProcessFarm, "_await_start", spy)
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=2, shards_per_worker=2,
                          games_per_worker=2, cycles=15, frame_stack=2, viewer=False)
    inline = farm.InlineFarm(cfg, table, mixed_assign)
    try:
        a = drive(inline, cfg, table, 2)
        st_inline = inline.stats
    finally:
        inline.close()
    proc = farm.ProcessFarm(cfg, table, mixed_assign, env_spec=env_spec)
    try:
        # SPACES (design 3.5): re-read without stepping -- the bytes below still match inline's
        rep = proc.spaces(1)
        assert farm.handshake_problems(rep, env_spec) == [] and rep["engine_binary"] == env_spec.engine_binary
        assert rep["pid"] == proc._procs[1].pid
        b = drive(proc, cfg, table, 2)
        assert launched_at_first_wait == [[True, True]]
        assert proc.drain_failures() == []
        assert proc.spaces(0)["pid"] == proc._procs[0].pid     # between iterations, too
        proc._expect = msgspec.structs.replace(env_spec, engine_binary="0000000000000000")
        with pytest.raises(farm.FarmError, match=r"worker 1 \(generation 0\) refused: engine "
                                                 r"binary " + env_spec.engine_binary):
            proc.spaces(1)
        st = proc.stats
        # the same bytes crossed the boundary; the parent really waited on the workers
        assert st["bytes_out"] == st_inline["bytes_out"] > 0
        assert st["wait_ms"] > 0 and 0 < st["parent_wait_frac"] <= 1 and st["env_ms"] > 0
    finally:
        proc.close()
        proc.close()                                   # idempotent
    for x, y in zip(a, b, strict=True):
        assert x["rect"].tobytes() == y["rect"].tobytes()
        assert x["scalars"].tobytes() == y["scalars"].tobytes()
        assert x["finals"].keys() == y["finals"].keys()
        assert all(x["finals"][k].tobytes() == y["finals"][k].tobytes() for k in x["finals"])
        assert msgspec.json.encode(x["episodes"]) == msgspec.json.encode(y["episodes"])
    assert sum(len(x["episodes"]) for x in a) > 0


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        parts = fh.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_worker_hygiene_failure_restart_and_idle(short_env):
    spec, env_spec, table = short_env
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, games_per_worker=1,
                          cycles=4, viewer=False, debug_fault="raise:0:3",
                          max_restarts_per_worker=1)
    f = farm.ProcessFarm(cfg, table, farm.mirror_assignment, env_spec=env_spec)
    try:
        hs = f.handshakes[0]
        assert hs["torch_loaded"] is False
        assert all(hs["threads"][v] == "1" for v in farm.THREAD_VARS)
        # an idle worker (waiting for actions) uses under 10% of a core
        f.begin_iteration(opening_plan(cfg, lambda b, k: farm.mirror_assignment(b, k)))
        rnd = f.next_round(30)
        pid = hs["pid"]
        c0, t0 = _cpu_seconds(pid), time.monotonic()
        time.sleep(1.5)
        assert (_cpu_seconds(pid) - c0) / (time.monotonic() - t0) < 0.10
        # the planted exception (third step) arrives as a WorkerFailure with the traceback
        for _ in range(cfg.cycles):
            f.submit(np.zeros(len(rnd.slots), np.int64), 0.99)
            rnd = f.next_round(30)
        fails = f.drain_failures()
        assert len(fails) == 1 and fails[0].kind == "exception" and fails[0].worker == 0
        assert "planted fault in worker 0" in fails[0].message and "Traceback" in fails[0].message
        assert not rnd.valid.any() and (rnd.group == farm.GROUP_DEAD).all()
        assert f.scalars["flags"][1, 0] & farm.F_TRUNCATED    # bootstrapped where it stopped
        # restart with the next generation; collection continues at the next iteration
        f.restart(0)
        f.begin_iteration(farm.SlotPlan(1, 1, 2, tuple(f.assignment), ()))
        assert f.generation[0] == 1 and f.ordinals.tolist() == [1]
        rnd = f.next_round(30)
        f.submit(np.zeros(2, np.int64), 0.99)
        rnd = f.next_round(30)
        assert rnd.valid.all() and rnd.row == 0
        with pytest.raises(farm.FarmError, match="max_restarts_per_worker=1"):
            f.restart(0)
    finally:
        f.close()


def test_the_restart_limit_counts_over_the_run_a_resume_included(short_env):
    """A resumed farm restores a worker's restarts with its generation (one a restart), so a
    resume does not reset max_restarts_per_worker, and health/worker_restarts reads what the run
    that was never stopped reads."""
    spec, _, table = short_env
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, games_per_worker=1, cycles=4, viewer=False,
                          frame_stack=2, max_restarts_per_worker=3, start_generations=[2])
    f = farm.InlineFarm(cfg, table, farm.mirror_assignment)
    try:
        assert f.stats()["worker_restarts"] == 2.0
        f.restart(0)
        assert f.generation == [3] and f.stats()["worker_restarts"] == 3.0
        with pytest.raises(farm.FarmError,
                           match=r"worker 0 has been restarted 3 times; max_restarts_per_worker=3"):
            f.restart(0)
    finally:
        f.close()


@pytest.mark.slow
def test_a_killed_worker_is_reported_as_a_crash(short_env):
    import signal
    spec, env_spec, table = short_env
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, games_per_worker=1,
                          cycles=4, viewer=False)
    f = farm.ProcessFarm(cfg, table, farm.mirror_assignment, env_spec=env_spec)
    try:
        f.begin_iteration(opening_plan(cfg, lambda b, k: farm.mirror_assignment(b, k)))
        f.next_round(30)
        os.kill(f.handshakes[0]["pid"], signal.SIGKILL)    # the worker this test started
        f.submit(np.zeros(2, np.int64), 0.99)
        rnd = f.next_round(30)
        fails = f.drain_failures()
        assert [(x.worker, x.kind) for x in fails] == [(0, "crash")]
        assert "exit code -9" in fails[0].message
        assert not rnd.valid.any()
    finally:
        f.close()


# A trainer in a child process: a training farm (1 worker) and an evaluation farm (2 workers),
# each a round in; it prints its pid, its workers', its resource tracker's and its segments'
# names, then waits to be killed.
FARM_CHILD = r"""
import json, os, time
from multiprocessing import resource_tracker
import farm
spec = farm.default_env_spec(max_steps=20)
env_spec, table = farm.preflight(spec, frame_stack=1, master_seed=7)
cfg = farm.FarmConfig(env=spec, master_seed=7, workers=1, games_per_worker=1, cycles=4, viewer=False)
train = farm.ProcessFarm(cfg, table, farm.mirror_assignment, env_spec=env_spec)
train.begin_iteration(farm.SlotPlan(0, 1, 2, (farm.mirror_assignment(0, 0),), ()))
train.next_round(30)
plan = [farm.EvalEpisode(seed=1000 + i, seed_path=f"test/seed/{i}",
                         players=("scripted:random_legal", "scripted:push"),
                         streams=(f"s/{i}/blue", f"s/{i}/red")) for i in range(4)]
ecfg = farm.FarmConfig(env=spec, master_seed=7, workers=2, games_per_worker=1, cycles=4, viewer=False,
                       eval_plan=plan, launch_delay_s=0)
ev = farm.ProcessFarm(ecfg, table, env_spec=env_spec)
ev.begin_iteration(ev.eval_slot_plan(0))
ev.next_round(30)
print(json.dumps({"pid": os.getpid(), "workers": [p.pid for f in (train, ev) for p in f._procs],
                  "tracker": resource_tracker._resource_tracker._pid,
                  "segments": [s.name for f in (train, ev) for s in (f._mem.a, *f._mem.b)]}), flush=True)
time.sleep(600)
"""


def _farm_child(tmp_path):
    """Start FARM_CHILD on this checkout's farm.py; returns (its Popen, what it printed)."""
    import json
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.abspath(farm.__file__))}
    with open(tmp_path / "child.err", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", FARM_CHILD], stdout=subprocess.PIPE, stderr=err,
                                env=env)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        proc.wait()
        pytest.fail(f"the farm child printed nothing: {(tmp_path / 'child.err').read_text()[-3000:]}")
    info = json.loads(line)
    assert info["pid"] == proc.pid and len(info["workers"]) == 3 and info["tracker"] is not None
    return proc, info


def _all_gone_within(pids, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(farm.pid_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return all(farm.pid_gone(p) for p in pids)


@pytest.mark.slow
def test_a_trainer_killed_with_sigkill_leaves_no_worker_tracker_or_segment_behind(tmp_path):
    """Issue 39 item 2: kill -9 of a process holding a training and an evaluation farm. Its three
    workers die with it (the parent-death signal, else the worker's own watch of its parent),
    so multiprocessing's resource tracker reads the end of its pipe, unlinks the dead parent's
    segments and exits: within 5 s nothing of it runs and nothing of it is in /dev/shm. Before,
    the workers were re-parented to PID 1 and waited forever, holding the tracker and the
    segments with them."""
    import signal
    proc, info = _farm_child(tmp_path)
    ours = [*info["workers"], info["tracker"]]
    try:
        assert all(os.path.exists(f"/dev/shm/{n}") for n in info["segments"])
        assert not any(farm.pid_gone(p) for p in ours)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        assert _all_gone_within(ours, 5.0), [p for p in ours if not farm.pid_gone(p)]
        while any(os.path.exists(f"/dev/shm/{n}") for n in info["segments"]) and time.monotonic() < t0 + 5:
            time.sleep(0.05)
        assert not [n for n in info["segments"] if os.path.exists(f"/dev/shm/{n}")]
    finally:
        for p in ours:                                  # processes this test started, by pid
            if not farm.pid_gone(p):
                os.kill(p, signal.SIGKILL)
        for n in info["segments"]:
            if os.path.exists(f"/dev/shm/{n}"):
                os.unlink(f"/dev/shm/{n}")


@pytest.mark.slow
def test_a_new_farm_removes_the_segments_a_dead_process_left_and_leaves_a_live_ones(tmp_path, short_env):
    """Issue 39 item 2: the trainer and its tracker killed together (kill -9 of the process group,
    the OOM killer): the workers still die within 5 s, but nobody unlinks the segments. The next
    ProcessFarm to start removes them (their names carry the dead pid), and leaves a segment of a
    live pid, and a name not of the farm's pattern, alone."""
    import signal
    import subprocess
    proc, info = _farm_child(tmp_path)
    ours = [*info["workers"], info["tracker"]]
    live = subprocess.Popen(["sleep", "60"])            # a live pid that is not this process's
    planted = [f"rlc-{live.pid}-1-0", f"rlb-{proc.pid}-1.keep"]
    try:
        os.kill(info["tracker"], signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _all_gone_within(ours, 5.0), [p for p in ours if not farm.pid_gone(p)]
        left = [n for n in info["segments"] if os.path.exists(f"/dev/shm/{n}")]
        assert left == info["segments"]                 # the tracker died before it could unlink them
        for n in planted:
            with open(f"/dev/shm/{n}", "wb") as fh:
                fh.write(b"\0" * 64)
        spec, env_spec, table = short_env
        cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, games_per_worker=1, cycles=2,
                              viewer=False)
        f = farm.ProcessFarm(cfg, table, farm.mirror_assignment, env_spec=env_spec)
        f.close()
        assert not [n for n in info["segments"] if os.path.exists(f"/dev/shm/{n}")]
        assert all(os.path.exists(f"/dev/shm/{n}") for n in planted)
    finally:
        for p in ours:
            if not farm.pid_gone(p):
                os.kill(p, signal.SIGKILL)
        live.kill()
        live.wait()
        for n in [*planted, *info["segments"]]:
            if os.path.exists(f"/dev/shm/{n}"):
                os.unlink(f"/dev/shm/{n}")


def test_stale_segments_are_those_of_the_farm_s_names_whose_pid_is_gone(tmp_path):
    """remove_stale_segments, on a folder of its own: rlb-<pid>-<n> and rlc-<pid>-<n>-<w> of a
    dead pid go; the same names of a live pid (this process, another), other names and a
    zombie's stay or go as its pid says (a zombie is gone); what went is named with its size."""
    import subprocess
    dead = subprocess.Popen(["true"])
    dead.wait()                                         # reaped: its pid runs no more
    zombie = subprocess.Popen(["true"])                 # not reaped yet: a zombie
    live = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 5
        while not farm.pid_gone(zombie.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        names = {f"rlb-{dead.pid}-1": 100, f"rlc-{dead.pid}-1-0": 30, f"rlc-{zombie.pid}-2-1": 10,
                 f"rlb-{live.pid}-1": 5, f"rlb-{os.getpid()}-1": 5, f"rlb-{dead.pid}-1.x": 5,
                 f"rlx-{dead.pid}-1": 5, f"sem.mp-{dead.pid}": 5, "rlb-0-1": 5}
        for n, size in names.items():
            (tmp_path / n).write_bytes(b"\0" * size)
        removed = farm.remove_stale_segments(str(tmp_path))
        assert removed == sorted([(f"rlb-{dead.pid}-1", 100), (f"rlc-{dead.pid}-1-0", 30),
                                  (f"rlc-{zombie.pid}-2-1", 10)])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - {n for n, _ in removed})
        line = farm.stale_segments_line(removed)
        assert line.startswith("removed shared memory left by dead processes ")
        assert f"/dev/shm/rlb-{dead.pid}-1 (0.0 MB)" in line and "\n" not in line
        assert farm.remove_stale_segments(str(tmp_path)) == [] and farm.stale_segments_line([]) == ""
        assert farm.remove_stale_segments(str(tmp_path / "none")) == []
        assert not farm.pid_gone(live.pid) and not farm.pid_gone(os.getpid()) and not farm.pid_gone(0)
    finally:
        live.kill()
        live.wait()
        zombie.wait()


@pytest.mark.slow
def test_a_worker_on_another_engine_binary_is_refused(short_env):
    spec, env_spec, table = short_env
    other = msgspec.structs.replace(env_spec, engine_binary="0000000000000000")
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, games_per_worker=1,
                          cycles=2, viewer=False)
    with pytest.raises(farm.FarmError, match=r"worker 0 \(generation 0\) refused: engine binary "
                       + env_spec.engine_binary):
        farm.ProcessFarm(cfg, table, farm.mirror_assignment, env_spec=other)


@pytest.mark.slow
def test_a_hung_worker_is_killed_and_failed_in_training_and_raises_in_evaluation(short_env):
    """Design 3.7: a training farm's hung worker is killed at round_timeout_s and reported as a
    WorkerFailure of kind "timeout" (the loop restarts it); an evaluation farm, which is never
    restarted, raises WorkerTimeout naming worker, shard and cycle."""
    spec, env_spec, table = short_env
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, games_per_worker=1,
                          cycles=4, viewer=False, debug_fault="hang:0:1", join_timeout_s=2)
    f = farm.ProcessFarm(cfg, table, farm.mirror_assignment, env_spec=env_spec)
    try:
        f.begin_iteration(opening_plan(cfg, lambda b, k: farm.mirror_assignment(b, k)))
        f.next_round(30)
        f.submit(np.zeros(2, np.int64), 0.99)
        t0 = time.monotonic()
        rnd = f.next_round(1.5)
        assert time.monotonic() - t0 < 5.0 and not rnd.valid.any() and f.dead[0]
        (fail,) = f.drain_failures()
        assert (fail.worker, fail.cycle, fail.kind) == (0, 1, "timeout")
        assert re.search(r"worker 0 shard 0 .* cycle 1 within 1.5 s .*killed", fail.message, re.S)
        # asked before it was killed, the worker said where it hung: the planted sleep
        assert ("the worker was killed; where it stood (its main thread's stack, innermost last):\n"
                in fail.message)
        assert "in _planted_fault\n    time.sleep(3600)" in fail.message, fail.message
    finally:
        t0 = time.monotonic()
        f.close()
        assert time.monotonic() - t0 < 10
    ecfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, games_per_worker=1, cycles=4,
                           viewer=False, debug_fault="hang:0:1", join_timeout_s=2,
                           eval_plan=eval_plan(2))
    e = farm.ProcessFarm(ecfg, table, env_spec=env_spec)
    try:
        e.begin_iteration(e.eval_slot_plan(0))
        e.next_round(30)
        e.submit(np.zeros(2, np.int64), 1.0)
        with pytest.raises(farm.WorkerTimeout, match=r"worker 0 shard 0 .* cycle 1 within 1.5 s"):
            e.next_round(1.5)
    finally:
        e.close()


def test_a_restarted_worker_plays_what_a_resume_from_its_boundary_plays(short_env):
    """Design 3.7, 2.4: restart() moves the ordinals, the generation and the assignments at
    once, so a farm built from what a checkpoint then holds (start_ordinals and
    start_generations) plays the restarted worker's next iteration byte for byte; restart() of
    a live worker mid-iteration is refused. The fault fires in generation 0 only. The failed
    worker's engines are dropped, not handed back: its restart builds new ones."""
    spec, _, table = short_env
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=2, games_per_worker=2, cycles=6,
                          frame_stack=2, viewer=False, debug_fault="raise:1:2:0")
    f = farm.InlineFarm(cfg, table, mixed_assign)
    engines = lambda: [e.engine for r in f._runners[1:] for e in r.vec.envs]   # worker 1's shard
    try:
        drive(f, cfg, table, 1)
        assert [(x.worker, x.kind) for x in f.drain_failures()] == [(1, "exception")]
        ords, failed = f.ordinals.copy(), engines()                # held: no id is reused
        f.restart(1)
        assert f.generation == [0, 1] and f.ordinals.tolist() == [*ords[:2], *(ords[2:] + 1)]
        start = dict(start_ordinals=f.ordinals.tolist(), start_generations=list(f.generation))
        table_after = tuple(f.assignment)
        a = drive(f, cfg, table, 1, first=1, opening=table_after)[0]
        assert f.drain_failures() == [] and a["scalars"]["flags"][:, 4:].all()   # gen 1 is healthy
        spare = farm._SPARE_ENGINES.get(farm._engine_key(spec), [])
        assert not {id(e) for e in failed} & {id(e) for e in engines() + spare}
        f.begin_iteration(farm.SlotPlan(2, cfg.n_battles, cfg.n_slots, tuple(f.assignment), ()))
        f.next_round(30)
        with pytest.raises(farm.FarmError, match=r"restart\(0\) of a live worker mid-iteration"):
            f.restart(0)
    finally:
        f.close()
    g = farm.InlineFarm(msgspec.structs.replace(cfg, **start), table, mixed_assign)
    try:
        b = drive(g, cfg, table, 1, first=1, opening=table_after)[0]
    finally:
        g.close()
    sl = slice(4, 8)                              # worker 1's slots: the restarted generation
    assert a["rect"][:, sl].tobytes() == b["rect"][:, sl].tobytes()
    assert a["scalars"][:, sl].tobytes() == b["scalars"][:, sl].tobytes()


# --- 7. the evaluation mode, the farm's stats, the viewer rule, mask-only scripted seats ------

def run_eval(spec, table, plan, battles, master=MASTER, act=None):
    """Drive an evaluation farm until every battle stopped; returns (records by plan index and
    seat, the farm's stats, the groups seen per round)."""
    cfg = farm.FarmConfig(env=spec, master_seed=master, workers=1, games_per_worker=battles,
                          cycles=48, viewer=False, eval_plan=plan)
    f = farm.InlineFarm(cfg, table)
    recs, groups = {}, []
    try:
        it = 0
        while not f.eval_done:
            f.begin_iteration(f.eval_slot_plan(it))
            for c in range(cfg.cycles + 1):
                rnd = f.next_round(30)
                groups.append(rnd.group.copy())
                for e in rnd.episodes:
                    recs[(e.eval_index, e.seat)] = e
                if c < cfg.cycles:
                    acts = np.zeros(len(rnd.slots), np.int64) if act is None else act(f, rnd)
                    f.submit(acts, 1.0)
            it += 1
            assert it < 30, "the evaluation farm did not stop"
        stats = f.stats
    finally:
        f.close()
    return recs, stats, groups


def eval_plan(n, players=(("scripted:random_legal", "scripted:push"),), stream_tag="s"):
    return [farm.EvalEpisode(seed=1000 + i, seed_path=f"test/seed/{i}", players=players[i % len(players)],
                             streams=(f"{stream_tag}/{i}/blue", f"{stream_tag}/{i}/red")) for i in range(n)]


def test_eval_mode_plays_each_planned_episode_once_whatever_the_number_of_battles(short_env):
    """Two DIFFERENT scripted players on the two seats, the episode's seed and seat streams from
    the plan: an episode's record (seed, actions, result) is the same on 3 battles (one episode
    each, then they stop) as on 2 (battle 0 plays episodes 0 and 2); then the farm stops."""
    _, _, table = short_env
    spec = farm.default_env_spec(max_steps=40)          # short episodes: the mode, not the match
    plan = eval_plan(3, players=(("scripted:random_legal", "scripted:push"),
                                 ("scripted:push", "scripted:random_legal")))
    a, _, groups = run_eval(spec, table, plan, battles=3)
    b, _, _ = run_eval(spec, table, plan, battles=2)
    assert set(a) == set(b) == {(i, s) for i in range(3) for s in (0, 1)}
    for key in a:
        x, y = a[key], b[key]
        assert (x.episode_seed, x.episode_seed_path) == (plan[key[0]].seed, plan[key[0]].seed_path)
        assert (x.policy_id, x.opponent_id) == (plan[key[0]].players[key[1]],
                                                plan[key[0]].players[1 - key[1]])
        assert (x.played, x.winner, x.episode_steps, x.undiscounted_return) == \
               (y.played, y.winner, y.episode_steps, y.undiscounted_return), key
    assert any(seat == 0 for _, seat, _ in a[(0, 0)].played) and \
           any(seat == 1 for _, seat, _ in a[(0, 0)].played), "both scripted seats played"
    assert b[(2, 0)].ordinal == 1                       # on 2 battles, episode 2 is a second one
    assert {a[(i, 0)].battle for i in range(3)} == {0, 1, 2}
    # a stopped battle's seats are GROUP_IDLE until the last episode ends
    assert any((g == farm.GROUP_IDLE).any() for g in groups)
    # the scripted seats draw from their plan's streams: another stream name, another game
    c, _, _ = run_eval(spec, table, eval_plan(1, stream_tag="other"), battles=1)
    assert c[(0, 0)].played != a[(0, 0)].played
    with pytest.raises(ValueError, match="unknown scripted player"):
        farm.FarmConfig(env=spec, master_seed=1, eval_plan=eval_plan(1, (("scripted:nobody", "x"),))).check()
    with pytest.raises(ValueError, match="unknown scripted player"):
        farm.make_scripted("nobody")


def play_plan(f):
    """Rounds until every episode of f's plan has its records, left on that round (the rounds of
    the other shards still out), as ladder.FarmComparison leaves a comparison."""
    recs, it = {}, 0
    while len(recs) < 2 * len(f.cfg.eval_plan):
        f.begin_iteration(f.eval_slot_plan(it))
        for c in range(f.T + 1):
            for _ in range(f.J):
                rnd = f.next_round(30)
                recs.update({(e.eval_index, e.seat): e for e in rnd.episodes})
                if len(recs) == 2 * len(f.cfg.eval_plan):
                    return recs
                if c < f.T:
                    f.submit(np.zeros(len(rnd.slots), np.int64), 1.0)
        it += 1
    return recs


@pytest.mark.parametrize("cls", [farm.InlineFarm, farm.ProcessFarm])
def test_a_replanned_evaluation_farm_plays_what_a_farm_built_for_the_plan_plays(short_env, cls):
    """design 7.1: a gate's comparisons play one after the other on one farm. Plan A is left as a
    comparison leaves it, mid-iteration; replan(B) then plays B byte for byte as a new farm built
    for B does, on the same worker processes (ProcessFarm) or the same engines (InlineFarm)."""
    _, _, table = short_env
    spec = farm.default_env_spec(max_steps=40)
    cfg = lambda plan: farm.FarmConfig(env=spec, master_seed=MASTER, workers=2, games_per_worker=1,
                                       cycles=16, viewer=False, eval_plan=plan, launch_delay_s=0,
                                       startup_timeout_s=60)
    A = eval_plan(3, stream_tag="a")
    B = eval_plan(5, players=(("scripted:random_legal", "scripted:push"),
                              ("scripted:push", "scripted:random_legal")), stream_tag="b")
    new = cls(cfg(B), table)
    try:
        want = play_plan(new)
    finally:
        new.close()
    f = cls(cfg(A), table)
    try:
        first = play_plan(f)
        held = ([p.pid for p in f._procs] if cls is farm.ProcessFarm else
                [id(e.engine) for r in f._runners for e in r.vec.envs])
        if cls is farm.ProcessFarm:   # a worker writes pub_seq, then releases the token: one late
            j = f._unread.index(True)                    # token must still be waited for
            while int(f._ios[j].control["pub_seq"][0]) != f._seq[j]:
                time.sleep(0.01)
            assert f._obs_sems[j].acquire(timeout=5)
            threading.Timer(0.3, f._obs_sems[j].release).start()
        f.replan(B)
        time.sleep(0.5)
        assert cls is farm.InlineFarm or not any(s.acquire(block=False) for s in f._obs_sems)
        got = play_plan(f)
        assert held == ([p.pid for p in f._procs] if cls is farm.ProcessFarm else
                        [id(e.engine) for r in f._runners for e in r.vec.envs])
        f.replan(A)                              # and back: A again, as it played the first time
        again = play_plan(f)
        with pytest.raises(ValueError, match="unknown scripted player"):
            f.replan(eval_plan(1, (("scripted:nobody", "x"),)))
        assert f._closed                         # a replan that failed closed the farm
    finally:
        f.close()
    assert sorted(got) == sorted(want) == [(i, s) for i in range(5) for s in (0, 1)]
    same = lambda x, y: (msgspec.json.encode([x[k] for k in sorted(x)])
                         == msgspec.json.encode([y[k] for k in sorted(y)]))
    assert same(got, want) and same(again, first)
    with pytest.raises(farm.FarmError, match="only an open evaluation farm"):
        f.replan(B)
    train = farm.InlineFarm(farm.FarmConfig(env=spec, master_seed=MASTER, workers=1, games_per_worker=1,
                                            cycles=4, viewer=False), table, mixed_assign)
    try:
        with pytest.raises(farm.FarmError, match="only an open evaluation farm"):
            train.replan(B)
    finally:
        train.close()


@pytest.mark.parametrize("spell_aim", [False, True])
def test_unpack_numpy_inverts_pack_on_real_observations(spell_aim):
    spec = farm.default_env_spec(reveal_spell_aim=spell_aim)
    side = {}
    es, table = farm.preflight(spec, master_seed=2, sample_steps=4, out=side)
    vec = farm.build_vec(spec, 2, autoreset_seed_fn=lambda g, k: 50 + g)
    try:
        obs, _ = vec.reset()
        for _ in range(12):
            obs, *_ = vec.step(np.zeros(4, np.int64))
    finally:
        vec.close()
    rows = np.zeros((4, table.row_bytes), np.uint8)
    codec_packer = __import__("codec").Packer(table)
    codec_packer.pack(obs, rows, 0)
    back = farm.unpack_numpy(table, rows, side["statics"], np.arange(4) % 2, es.obs_space)
    assert set(back) == set(obs)
    for key in obs:
        assert back[key].dtype == obs[key].dtype and back[key].shape == obs[key].shape, key
    again = np.zeros_like(rows)
    codec_packer.pack(back, again, 0)
    assert again.tobytes() == rows.tobytes()                  # pack(unpack(x)) == x, byte for byte
    assert np.array_equal(back["action_mask"], obs["action_mask"])
    u8 = list(table.uint8_index)
    assert np.array_equal(back["spatial"][:, u8], obs["spatial"][:, u8])    # exact, raw values
    assert np.array_equal(back["vector"], obs["vector"].astype(np.float16).astype(np.float32))


def test_stats_count_time_bytes_clips_and_the_dead_worker_s_rows(short_env):
    """stats: env/codec/wait time, bytes written, the packers' clip counter summed over shards
    and kept across a restart, and health/rows_dropped_dead_worker = the cells a dead worker lost."""
    spec, _, table = short_env
    cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=2, games_per_worker=1, cycles=6,
                          viewer=False, debug_fault="raise:0:3")
    f = farm.InlineFarm(cfg, table, farm.mirror_assignment)
    try:
        f.begin_iteration(opening_plan(cfg, farm.mirror_assignment))
        f._runners[1].packer.clipped += 5          # as if worker 1 had clipped five values
        dead_cells = 0
        for c in range(cfg.cycles + 1):
            for _ in range(cfg.n_shards):
                rnd = f.next_round(30)
                if rnd.row >= 0 and (rnd.group == farm.GROUP_DEAD).all() and not rnd.valid.any():
                    dead_cells += len(rnd.slots)
                if c < cfg.cycles:
                    f.submit(np.zeros(len(rnd.slots), np.int64), 0.99)
        st = f.stats()                              # callable, and a dict: f.stats["env_ms"]
        assert isinstance(st, dict) and callable(st) and st() is st   # a call answers the same dict
        assert sorted(st) == sorted(["env_ms", "wait_ms", "codec_ms", "parent_wait_frac", "bytes_out",
                                     "rows_dropped_dead_worker", "worker_restarts", "obs_codec_clipped",
                                     "obs_codec_rounded"])   # the metrics _FarmStats.snapshot names
        assert [x.worker for x in f.drain_failures()] == [0]
        assert dead_cells == 2 * (cfg.cycles - 2) and st["rows_dropped_dead_worker"] == dead_cells
        assert st["env_ms"] > 0 and st["codec_ms"] > 0 and st["wait_ms"] >= 0
        assert 0 <= st["parent_wait_frac"] <= 1
        rb = table.row_bytes
        live_rounds = 1 + cfg.cycles + 1 + 2        # worker 1: reset + 6 steps; worker 0: reset + 2
        assert st["bytes_out"] >= (live_rounds * 2) * rb + (live_rounds - 2) * 2 * farm.SCALAR_BYTES
        assert st["obs_codec_clipped"] == 5 and st["worker_restarts"] == 0
        f.restart(1)                                 # worker 1's generation ends: its count stays
        f.begin_iteration(farm.SlotPlan(1, 2, 4, tuple(f.assignment), ()))
        assert f.stats["rows_dropped_dead_worker"] == 0        # per iteration
        f._runners[1].packer.clipped += 1            # the new generation's own packer
        for _ in range(2 * cfg.n_shards):            # cycles 0 and 1 of both shards
            f.next_round(30)
            f.submit(np.zeros(2, np.int64), 0.99)
        assert f.stats["obs_codec_clipped"] == 6 and f.stats["worker_restarts"] == 1
        assert f.rows_dropped_dead_worker_total == dead_cells + 2
    finally:
        f.close()


def test_only_worker_0_s_first_shard_gets_the_viewer(short_env, monkeypatch):
    """design 3.8 step 11, checked on what build_vec is given (no socket is bound: the recorder
    passes viser=None on)."""
    spec, _, table = short_env
    seen = []
    real = farm.build_vec

    def recording(env, n, *, viser=None, **kw):
        seen.append(viser)
        return real(env, n, viser=None, **kw)
    monkeypatch.setattr(farm, "build_vec", recording)
    for viewer, S, want in ((True, 2, ["env", None, None, None]), (False, 1, [None, None])):
        seen.clear()
        cfg = farm.FarmConfig(env=spec, master_seed=MASTER, workers=2, shards_per_worker=S,
                              games_per_worker=S, cycles=2, viewer=viewer)
        farm.InlineFarm(cfg, table, farm.mirror_assignment).close()
        assert seen == want


def test_scripted_seats_built_mask_only_leave_the_learner_s_bytes_unchanged(short_env, inline_run):
    """FarmConfig.scripted_mask_only: a scripted seat's observations are built mask-only from
    the one after its assignment arrives. Every row a learner acted on, every scalar and every
    episode record is byte-identical to the full build; the scripted rows really were skipped."""
    spec, _, table = short_env
    cfg0, _, res, _ = inline_run
    cfg = msgspec.structs.replace(cfg0, scripted_mask_only=True)
    f = farm.InlineFarm(cfg, table, mixed_assign)
    try:
        res2 = drive(f, cfg, table, 2)
    finally:
        f.close()
    k, T = cfg.frame_stack, cfg.cycles
    a0, a1 = table.offsets["mask"]
    skipped = 0
    for x, y in zip(res, res2, strict=True):
        assert x["scalars"].tobytes() == y["scalars"].tobytes()
        assert msgspec.json.encode(x["episodes"]) == msgspec.json.encode(y["episodes"])
        assert x["finals"].keys() == y["finals"].keys()
        obs_x, obs_y = x["rect"][k - 1: k - 1 + T], y["rect"][k - 1: k - 1 + T]
        learner = x["scalars"]["group"] != farm.GROUP_SCRIPTED
        assert obs_x[learner].tobytes() == obs_y[learner].tobytes()
        assert np.array_equal(obs_x[..., a0:a1], obs_y[..., a0:a1])      # masks always built
        diff = (obs_x != obs_y).any(axis=-1) & ~learner
        skipped += int(diff.sum())
    assert skipped > 0, "no scripted row was built mask-only"


# --- the lookahead player (section 6b) -------------------------------------------------------------

def test_a_lookahead_is_named_by_its_whole_setting_and_a_bad_name_is_refused_by_its_part():
    full = farm.canonical_player("lookahead:push")
    spec = farm.parse_lookahead(full)
    assert full == (f"lookahead:push,vs={farm.LOOKAHEAD_DEFAULTS['vs']},h={farm.LOOKAHEAD_DEFAULTS['h']},"
                    f"c=push+{'+'.join(c for c in farm.LOOKAHEAD_PORTFOLIO if c != 'push')}")
    assert spec.candidates[0] == "push" and "noop" in spec.candidates     # the base is tried first
    assert farm.canonical_player(full) == full and farm.canonical_player("scripted:push") == "scripted:push"
    two = farm.parse_lookahead("lookahead:defend,c=noop+push+defend,h=7,vs=defend+patient")
    assert (two.vs, two.horizon, two.candidates) == (("defend", "patient"), 7, ("noop", "push", "defend"))
    for bad, why in (("lookahead:defend,h=0", "h=0 must be"), ("lookahead:defend,h=x", "h=x must be"),
                     ("lookahead:nobody", "base 'nobody' is not a scripted rung"),
                     ("lookahead:defend,vs=defend+nobody", "vs 'nobody'"),
                     ("lookahead:defend,c=push+noop", "must include noop and the base, defend"),
                     ("lookahead:defend,c=push+defend", "must include noop and the base, defend"),
                     ("lookahead:defend,x=1", "'x=1' is not one of"),
                     ("lookahead:defend,h=3,h=4", "each at most once")):
        with pytest.raises(ValueError, match=re.escape(why)):
            farm.parse_lookahead(bad)
    with pytest.raises(ValueError, match="unknown scripted player"):
        farm.check_worker_player("scripted:nobody")


def _choice_point(spec, seed=21, steps=40):
    """A live battle of defend against push, stepped until defend's seat (blue) has more than one
    distinct candidate; returns the env and blue's observation."""
    from royalegym.env import AGENTS
    env = farm.env_factory(spec)()
    obs, _ = env.reset(seed=seed)
    rungs, rng = [farm.make_scripted("defend"), farm.make_scripted("push")], np.random.default_rng(0)
    proposers = [farm.make_scripted(c) for c in ("defend", "noop", "push")]
    for _ in range(steps):
        o = obs["blue"]
        if len({p.act(o, o["action_mask"], rng) for p in proposers}) > 1:
            return env, o
        obs, *_ = env.step({a: r.act(obs[a], obs[a]["action_mask"], rng)
                            for r, a in zip(rungs, AGENTS, strict=True)})
    raise AssertionError("no choice point in the first steps")


def test_the_lookahead_keeps_the_best_scoring_candidate_and_leaves_the_live_battle_alone():
    """At a choice point each candidate is played on for h decisions (candidate, then the base;
    the model on the other seat) from the live battle's snapshot; the player returns the first
    best by score, deterministically, and the live battle is where it was."""
    from royalegym.env import AGENTS
    spec = farm.default_env_spec()
    live, o = _choice_point(spec)
    name = "lookahead:defend,vs=patient,h=6,c=defend+noop+push"
    p = farm.worker_player(name, lambda: farm.scratch_env(spec))
    p.bind(live, 0)
    before = live.engine.state_hash()
    action = p.act(o, o["action_mask"], np.random.default_rng(5))
    assert live.engine.state_hash() == before and live.snapshot().blob == live.snapshot().blob
    # the same search by hand, in another scratch env
    scratch = farm.env_factory(spec)()
    base, model = farm.make_scripted("defend"), farm.make_scripted("patient")
    rng = np.random.default_rng(0)
    tried = list(dict.fromkeys(farm.make_scripted(c).act(o, o["action_mask"], rng)
                               for c in ("defend", "noop", "push")))
    scores = []
    for a in tried:
        s, _ = scratch.reset(options={"snapshot": live.snapshot()})
        for k in range(6):
            s, *_ = scratch.step({"blue": a if k == 0 else base.act(s["blue"], s["blue"]["action_mask"], rng),
                                  "red": model.act(s["red"], s["red"]["action_mask"], rng)})
        scores.append(p.score(scratch.battle_state, 0))
    assert len(tried) > 1 and action == tried[int(np.argmax(scores))]
    assert (p.choices, p.steps) == (1, 6 * len(tried))
    assert len(set(scores)) > 1, "the candidates' positions differ at the horizon"
    # a fresh player on the same state chooses the same; a mask-only battle cannot be searched
    q = farm.worker_player(name, lambda: farm.scratch_env(spec))
    q.bind(live, 0)
    assert q.act(o, o["action_mask"], np.random.default_rng(6)) == action
    live.set_mask_only(AGENTS)
    with pytest.raises(ValueError, match="cannot be snapshotted"):
        q.act(o, o["action_mask"], np.random.default_rng(6))


def test_the_score_is_the_result_once_over_and_the_potential_terms_before():
    spec = farm.default_env_spec()
    live, _ = _choice_point(spec)
    p = farm.worker_player("lookahead:defend", lambda: farm.scratch_env(spec))
    st = live.battle_state
    want = sum(farm.REWARD_WEIGHTS[k] * float(t.potential(st, 0)) for k, t in (
        ("crown", farm.PotentialCrownReward()), ("tower_hp", farm.PotentialTowerHPReward()),
        ("elixir", p.terms[2][0])))
    assert p.score(st, 0) == pytest.approx(want) and p.score(st, 1) == pytest.approx(-want)
    for winner, blue in ((0, 1.0), (1, -1.0), (2, 0.0)):
        over = msgspec.structs.replace(st, game_over=True, winner=winner)
        assert (p.score(over, 0), p.score(over, 1)) == (blue, -blue if winner != 2 else 0.0)


def test_a_lookahead_seat_plays_in_the_evaluation_farm_whatever_the_hosting(short_env):
    """A lookahead seat is played in the worker like a scripted one, its battle kept unmasked;
    its record counts its searches; the episode is the same on 2 battles as on 1."""
    _, _, table = short_env
    spec = farm.default_env_spec(max_steps=30)
    name = farm.canonical_player("lookahead:defend,h=3,c=defend+noop+push")
    plan = eval_plan(2, players=((name, "scripted:push"), ("scripted:patient", name)))
    a, _, groups = run_eval(spec, table, plan, battles=2)
    b, _, _ = run_eval(spec, table, plan, battles=1)
    for key in a:
        assert (a[key].played, a[key].winner, a[key].lookahead_choices, a[key].lookahead_steps) == \
               (b[key].played, b[key].winner, b[key].lookahead_choices, b[key].lookahead_steps), key
    for i, seat in ((0, 0), (1, 1)):
        r = a[(i, seat)]
        assert r.policy_id == name and 0 < r.lookahead_choices and \
            r.lookahead_choices < r.lookahead_steps <= 3 * 3 * r.lookahead_choices
        assert a[(i, 1 - seat)].lookahead_choices == a[(i, 1 - seat)].lookahead_steps == 0
    assert all(((g == farm.GROUP_SCRIPTED) | (g == farm.GROUP_IDLE)).all() for g in groups)
    with pytest.raises(ValueError, match=r"eval_plan\[0\].players\[0\]: 'lookahead:defend,h=0'"):
        farm.FarmConfig(env=spec, master_seed=1,
                        eval_plan=eval_plan(1, (("lookahead:defend,h=0", "x"),))).check()


def _cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])   # utime + stime, the stat file's 14th and 15th


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads a process's CPU time from /proc")
def test_stepping_beside_keeps_its_processes_stepping_for_the_block_alone():
    """checks.py bench times the parent's inference beside the rollout workers' load: each process
    is stepping its battles once the block starts (its CPU time grows within it) and exits
    cleanly when the block ends; one that dies in the block or before its first step is an error
    naming it, and a size it cannot step is refused."""
    spec = farm.default_env_spec(max_steps=30)
    with farm.SteppingBeside(spec, 2, 1, master_seed=3) as beside:
        before = [_cpu_ticks(p.pid) for p in beside.procs]
        time.sleep(1.0)
        assert all(_cpu_ticks(p.pid) > b for p, b in zip(beside.procs, before, strict=True))
    assert [p.exitcode for p in beside.procs] == [0, 0]
    lost = r"SteppingBeside: process 1 died in the block \(exit code -9\), so the block ran beside less load"
    with pytest.raises(RuntimeError, match=lost), farm.SteppingBeside(spec, 2, 1, master_seed=3) as beside:
        beside.procs[1].kill()
        beside.procs[1].join()
    assert not any(p.is_alive() for p in beside.procs)
    broken = msgspec.structs.replace(spec, reward_fn=farm.ComponentSpec("farm.no_such_reward", {}))
    died = r"SteppingBeside: process 0 died \(exit code 1\) before its first step"
    with pytest.raises(RuntimeError, match=died), farm.SteppingBeside(broken, 1, 1, master_seed=3):
        pass
    with pytest.raises(ValueError, match=r"\(workers=1, battles=0\): workers >= 0 and battles >= 1"):
        farm.SteppingBeside(spec, 1, 0, master_seed=3)
