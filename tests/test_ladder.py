"""tests/test_ladder.py -- the ladder: result log, rating fit, statistics, gate, snapshots,
eviction, matchmaking and the torch-free `rate` CLI (design 7, issue 5's Tests paragraph).

Every synthetic data set is drawn from np.random.default_rng(seed) with a fixed seed, so each
test is deterministic; the thresholds are statistical bounds sized from the model, stated inline.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

import ladder as L
from farm import GROUP_LEARNER, GROUP_SCRIPTED, ROLE_MIRROR, ROLE_POOL, ROLE_SCRIPTED

ROOT = Path(__file__).resolve().parent.parent
TRUE = {"scripted:noop": 0.0, "p1": -150.0, "p2": 80.0, "p3": 200.0, "p4": 350.0, "p5": -60.0}


# --- helpers ---------------------------------------------------------------------------------------

def sim_counts(rng, n_per_pair, true=TRUE, nu=0.3) -> L.PairCounts:
    """Round-robin counts drawn from the Davidson model itself."""
    ids = sorted(true)
    Is, J, W, T, Lo = [], [], [], [], []
    for i in range(len(ids)):
        for j in range(i + 1, len(ids)):
            pw, pd, pl, _ = L._outcome_probs((true[ids[i]] - true[ids[j]]) * L.C, nu)
            w, t, lo = rng.multinomial(n_per_pair, [pw, pd, pl])
            Is.append(i)
            J.append(j)
            W.append(int(w))
            T.append(int(t))
            Lo.append(int(lo))
    return L.PairCounts(ids=ids, i=Is, j=J, wins_i=W, draws=T, wins_j=Lo)


def game(a, b, s, seed=0, side="blue", ctx="ctx0", kind="eval"):
    return L.GameResult(a=a, b=b, score_a=s, seed_index=seed, side_a=side, context=ctx, kind=kind,
                        run_id="run", iteration=1, wall="2026-11-29T00:00:00Z")


def sim_games(rng, n_per_pair, true=TRUE, nu=0.3, ctx="ctx0") -> list[L.GameResult]:
    ids = sorted(true)
    out = []
    for i in range(len(ids)):
        for j in range(i + 1, len(ids)):
            pw, pd, _, _ = L._outcome_probs((true[ids[i]] - true[ids[j]]) * L.C, nu)
            u = rng.random(n_per_pair)
            for k, x in enumerate(u):
                s = 1.0 if x < pw else (0.5 if x < pw + pd else 0.0)
                # record half of them the other way round: the fit must not care
                if k % 2:
                    out.append(game(ids[j], ids[i], 1.0 - s, seed=k // 2, side="red", ctx=ctx))
                else:
                    out.append(game(ids[i], ids[j], s, seed=k // 2, side="blue", ctx=ctx))
    return out


# --- 1. The result log -------------------------------------------------------------------------------

def test_aggregate_cache_equals_rebuild(tmp_path):
    log = L.ResultLog(tmp_path)
    rng = np.random.default_rng(0)
    g = sim_games(rng, 20)
    for s in range(0, len(g), 37):
        log.append(g[s:s + 37])
    cached = msgspec.json.decode((tmp_path / "ladder" / "aggregate.json").read_bytes(), type=L.Aggregate)
    rebuilt = L.rebuild_aggregate(log.read().games)
    assert cached == rebuilt
    assert cached.lines == len(g) == len(log.read().games)
    # the counts are right: p4 (strongest) vs p1 (weakest) cell sums to the 20 games played
    key = "ctx0\teval\tp1\tp4"
    assert sum(cached.cells[key]) == 20
    # a stale cache (a crash between the log write and the cache write) is rebuilt, not trusted
    (tmp_path / "ladder" / "aggregate.json").write_bytes(msgspec.json.encode(L.Aggregate(lines=3)))
    assert log.aggregate() == rebuilt
    log.append([game("p1", "p2", 1.0)])
    assert log.aggregate() == L.rebuild_aggregate(log.read().games)


APPENDER = """
import sys, ladder as L
log = L.ResultLog(sys.argv[1])
for k in range(40):
    log.append([L.GameResult(a=sys.argv[2], b="scripted:noop", score_a=1.0, seed_index=k, side_a=side,
                             context="c", kind="eval", run_id="r", iteration=k, wall="w")
                for side in L.SIDES])
"""


def test_two_processes_appending_at_once_lose_nothing_and_the_cache_equals_a_rebuild(tmp_path):
    """`ladder.py eval` appends to the log of a run that is training: two writers at once."""
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(tmp_path), who], cwd=ROOT)
             for who in ("p1", "p2")]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    log = L.ResultLog(tmp_path)
    games = log.read().games
    assert len(games) == 160 and log.read().torn_tail is None
    assert sorted((g.a, g.iteration, g.side_a) for g in games) == sorted(
        (w, k, side) for w in ("p1", "p2") for k in range(40) for side in L.SIDES)
    cache = msgspec.json.decode(log.aggregate_path.read_bytes(), type=L.Aggregate)
    assert cache == L.rebuild_aggregate(games)


def test_torn_last_line_tolerated_reported_and_cut_before_append(tmp_path):
    log = L.ResultLog(tmp_path)
    log.append([game("p1", "p2", 1.0), game("p1", "p2", 0.5)])
    with open(log.path, "ab") as f:
        f.write(b'{"a": "p1", "b": "p2", "sco')          # a crash mid-write
    r = log.read()
    assert len(r.games) == 2 and r.torn_tail == b'{"a": "p1", "b": "p2", "sco'
    log.append([game("p1", "p2", 0.0)])
    r = log.read()
    assert [g.score_a for g in r.games] == [1.0, 0.5, 0.0] and r.torn_tail is None
    assert log.last_repair == b'{"a": "p1", "b": "p2", "sco'
    # corruption anywhere but the last line is refused by file and line number
    lines = log.path.read_bytes().split(b"\n")
    lines[1] = b"garbage"
    log.path.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=r"games.jsonl: line 2 is not a GameResult"):
        log.read()


def test_bad_records_refused_by_field(tmp_path):
    log = L.ResultLog(tmp_path)
    with pytest.raises(ValueError, match="score_a=0.7"):
        log.append([game("p1", "p2", 0.7)])
    with pytest.raises(ValueError, match="kind='rated'"):
        log.append([game("p1", "p2", 1.0, kind="rated")])
    with pytest.raises(ValueError, match="side_a='green'"):
        log.append([game("p1", "p2", 1.0, side="green")])
    assert not log.path.exists()


def test_contexts_never_pooled():
    g = [game("p1", "p2", 1.0, ctx="aaaa"), game("p1", "p2", 0.0, ctx="bbbb")]
    with pytest.raises(ValueError, match=r"2 contexts \['aaaa', 'bbbb'\].*never pooled"):
        L.eval_view(g)
    with pytest.raises(ValueError, match="never pooled"):
        L.fit_ratings(g)
    ctx, view = L.eval_view(g, "bbbb")
    assert ctx == "bbbb" and [x.score_a for x in view] == [0.0]
    # train and probe games are never fitted
    with pytest.raises(ValueError, match=r"\['probe'\] games"):
        L.fit_ratings([game("p1", "p2", 1.0), game("learner@5", "p2", 1.0, kind="probe")])


# --- 2. Rating ----------------------------------------------------------------------------------------

def test_fit_recovers_strengths_within_its_own_se_over_100_seeds():
    """Coverage of the 95% Wald interval over 100 seeds x 5 rated players. [M] 0.938 at 300 games
    per pair (this data); the bound allows the binomial noise of 500 trials (sd ~1%)."""
    hit = tot = 0
    for s in range(100):
        t = L.fit_pair_counts(sim_counts(np.random.default_rng(s), 300))
        assert t.converged and t.iterations < 10
        for p in TRUE:
            if p == L.ANCHOR:
                continue
            hit += abs(t.rating[p] - TRUE[p]) <= 1.96 * t.se[p]
            tot += 1
    assert 0.91 <= hit / tot <= 0.99, hit / tot


def test_fit_within_5_elo_at_n_2000():
    """At 2000 games per pair the mean absolute error is under 5 Elo ([M] 4.2 over these 100
    seeds, with a mean reported SE of 5.6) and no SE exceeds 8."""
    errs = []
    for s in range(100):
        t = L.fit_pair_counts(sim_counts(np.random.default_rng(1000 + s), 2000))
        errs += [abs(t.rating[p] - TRUE[p]) for p in TRUE if p != L.ANCHOR]
        assert max(t.se.values()) < 8.0
    assert np.mean(errs) < 5.0, np.mean(errs)


def test_fit_invariant_to_order_and_id_permutation():
    rng = np.random.default_rng(3)
    g = sim_games(rng, 60)
    t1 = L.fit_ratings(g)
    perm = rng.permutation(len(g))
    t2 = L.fit_ratings([g[i] for i in perm])
    assert msgspec.json.encode(t1) == msgspec.json.encode(t2)          # bit-identical
    # rename every player (the sorted order changes); the anchor keeps its name
    ren = {"p1": "zz", "p2": "aa", "p3": "mm", "p4": "b0", "p5": "yy", L.ANCHOR: L.ANCHOR}
    t3 = L.fit_ratings([msgspec.structs.replace(x, a=ren[x.a], b=ren[x.b]) for x in g])
    for p, q in ren.items():
        assert t3.rating[q] == pytest.approx(t1.rating[p], abs=1e-8)
        assert t3.se[q] == pytest.approx(t1.se[p], abs=1e-8)
    assert t3.draw_nu == pytest.approx(t1.draw_nu, rel=1e-10)


def test_se_shrinks_as_one_over_sqrt_n():
    pc = sim_counts(np.random.default_rng(5), 200)
    pc4 = msgspec.structs.replace(pc, wins_i=[4 * x for x in pc.wins_i], draws=[4 * x for x in pc.draws],
                                  wins_j=[4 * x for x in pc.wins_j])
    t, t4 = L.fit_pair_counts(pc), L.fit_pair_counts(pc4)
    for p in TRUE:
        if p != L.ANCHOR:
            assert t.se[p] / t4.se[p] == pytest.approx(2.0, rel=0.02)


def test_anchor_pinned_exactly_and_se_diff_uses_the_block():
    t = L.fit_pair_counts(sim_counts(np.random.default_rng(7), 300))
    assert t.rating[L.ANCHOR] == 0.0 and t.se[L.ANCHOR] == 0.0
    # another gauge: p4 pinned; differences are gauge-free
    t2 = L.fit_pair_counts(sim_counts(np.random.default_rng(7), 300), anchor="p4")
    assert t2.rating["p4"] == 0.0 and t2.se["p4"] == 0.0
    assert (t2.rating["p3"] - t2.rating["p1"]) == pytest.approx(t.rating["p3"] - t.rating["p1"], abs=0.5)
    # se_diff is the 2x2 block: positively correlated ratings make it smaller than the marginals
    k = {p: n for n, p in enumerate(t.ids)}
    c = np.array(t.cov)
    want = math.sqrt(c[k["p3"], k["p3"]] + c[k["p4"], k["p4"]] - 2 * c[k["p3"], k["p4"]])
    assert t.se_diff("p3", "p4") == pytest.approx(want, rel=1e-12)
    assert t.se_diff("p3", "p4") < 0.9 * math.hypot(t.se["p3"], t.se["p4"])
    assert t.se_diff("p3", L.ANCHOR) == pytest.approx(t.se["p3"], rel=1e-12)


def test_davidson_recovers_a_known_draw_rate():
    """Equal players at nu = 0.5 draw nu / (2 + nu) = 20% of the time [A]."""
    true = {L.ANCHOR: 0.0, "x": 0.0, "y": 0.0}
    t = L.fit_pair_counts(sim_counts(np.random.default_rng(11), 4000, true=true, nu=0.5))
    assert t.draws == "davidson" and not t.draw_fallback
    assert t.draw_nu == pytest.approx(0.5, abs=0.03)
    assert t.draw_rate == pytest.approx(0.2, abs=0.01)
    # and the fitted model's draw probability reproduces the observed rate
    _, pd, _, _ = L._outcome_probs(0.0, t.draw_nu)
    assert pd == pytest.approx(t.draw_rate, abs=0.005)


def test_half_win_fallback_under_2_percent_draws_is_recorded(tmp_path):
    true = {L.ANCHOR: 0.0, "x": 100.0}
    t = L.fit_pair_counts(sim_counts(np.random.default_rng(12), 2000, true=true, nu=0.02))
    assert t.draw_rate < 0.02
    assert (t.draws, t.draw_fallback, t.draw_nu) == ("half_win", True, None)
    assert t.rating["x"] == pytest.approx(100.0, abs=3 * t.se["x"])
    rec = json.loads(L.write_ratings(tmp_path, t).read_text())
    assert rec["draws"] == "half_win" and rec["draw_fallback"] is True
    # at 5% draws Davidson is kept
    t5 = L.fit_pair_counts(sim_counts(np.random.default_rng(12), 2000, true=true, nu=0.12))
    assert t5.draws == "davidson" and not t5.draw_fallback


def test_transitivity_residual_zero_on_transitive_large_on_rock_paper_scissors():
    t = L.fit_pair_counts(sim_counts(np.random.default_rng(13), 400))
    assert t.residual_pairs == 15 and t.transitivity_residual <= 0.1
    # rock beats scissors beats paper beats rock, 80 of 100 each
    ids = [L.ANCHOR, "paper", "rock", "scissors"]
    # pairs (i<j): (paper, rock) paper wins 80; (paper, scissors) scissors wins 80; (rock, scissors) rock 80
    pc = L.PairCounts(ids=ids, i=[1, 1, 2], j=[2, 3, 3], wins_i=[80, 20, 80], draws=[0, 0, 0],
                      wins_j=[20, 80, 20])
    rps = L.fit_pair_counts(pc)
    assert rps.residual_pairs == 3 and rps.transitivity_residual == 1.0
    # fewer than 30 games a pair: no pair qualifies, and the residual says so rather than 0
    small = L.fit_pair_counts(msgspec.structs.replace(pc, wins_i=[8, 2, 8], wins_j=[2, 8, 2]))
    assert small.transitivity_residual is None and small.residual_pairs == 0


def test_elo_readout_is_zero_sum_k32():
    e = L.EloReadout()
    e.update("a", "b", 1.0)
    assert e.rating == {"a": 16.0, "b": -16.0}
    e.update("a", "b", 0.5)
    assert e.rating["a"] + e.rating["b"] == pytest.approx(0.0)
    assert e.rating["a"] < 16.0


# --- 3. Statistics --------------------------------------------------------------------------------------

@pytest.mark.parametrize("p,n,lower", [(0.55, 1000, 0.519), (0.552, 1000, 0.521), (0.575, 1000, 0.544),
                                       (0.55, 400, 0.501)])
def test_wilson_matches_the_gate_numbers(p, n, lower):
    # design 7.7's numbers: the lower bound at the sizes and rates the gate meets
    assert round(L.wilson_interval(p, n)[0], 3) == lower
    assert (L.wilson_interval(p, n)[0] >= 0.52) == (lower >= 0.52)


def test_wilson_at_the_edges():
    # 0 of 10: [0, z^2 / (n + z^2)] = [0, 3.8416 / 13.8416] = [0, 0.27754] [A]; 10 of 10 mirrors it
    lo, hi = L.wilson_interval(0.0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(3.8416 / 13.8416, rel=1e-9)
    assert L.wilson_interval(1.0, 10)[0] == pytest.approx(1 - 3.8416 / 13.8416, rel=1e-9)


def test_paired_scores_collapse_sides_and_swap_symmetrically():
    g = [game("A", "B", 1.0, seed=0, side="blue"), game("B", "A", 0.5, seed=0, side="blue"),   # A red: 0.5
         game("A", "B", 0.0, seed=1, side="red"), game("A", "B", 0.0, seed=1, side="blue"),
         game("A", "B", 1.0, seed=2, side="blue")]                                               # unpaired
    ps = L.paired_scores(g, "A", "B")
    assert ps.seed_index == [0, 1] and ps.blue == [1.0, 0.0] and ps.red == [0.5, 0.0]
    assert ps.x == [0.75, 0.0] and ps.unpaired == 1 and ps.n_battles == 4
    sw = L.paired_scores(g, "B", "A")
    assert sw.x == [1 - v for v in ps.x] and sw.blue == [1 - v for v in ps.red]


def test_bootstrap_covers_a_known_rate_at_its_nominal_level():
    """200 replications of 60 seeds with each side won at 0.6: the 95% percentile interval must
    cover 0.6 between 90% and 99% of the time (binomial sd over 200 trials is 1.5 pp)."""
    cover = 0
    for r in range(200):
        rng = np.random.default_rng(500 + r)
        x = (rng.random(60) < 0.6).astype(float) / 2 + (rng.random(60) < 0.6).astype(float) / 2
        lo, hi = L.bootstrap_interval(x, master_seed=r, comparison_id="cov", resamples=1000)
        cover += lo <= 0.6 <= hi
    assert 0.90 <= cover / 200 <= 0.99, cover
    x = np.arange(20) / 20.0
    assert L.bootstrap_interval(x, 1, "c1") == L.bootstrap_interval(x, 1, "c1")
    assert L.bootstrap_interval(x, 1, "c1") != L.bootstrap_interval(x, 1, "c2")


def test_paired_rho_none_when_undefined_and_measured_otherwise():
    g = [game("A", "B", 1.0, seed=s, side=side) for s in range(5) for side in L.SIDES]
    assert L.paired_rho(L.paired_scores(g, "A", "B")) is None      # every seed decided one way
    g = [game("A", "B", float(s % 2), seed=s, side=side) for s in range(6) for side in L.SIDES]
    assert L.paired_rho(L.paired_scores(g, "A", "B")) == pytest.approx(1.0)


def test_eval_seed_set_drawn_once_frozen_and_verified(tmp_path):
    s = L.load_or_create_eval_seeds(tmp_path, master_seed=7, count=50)
    assert len(set(s.seeds)) == 50 and s.path == "eval/seed_set"
    assert L.load_or_create_eval_seeds(tmp_path, master_seed=7, count=50) == s
    assert L.draw_eval_seeds(8, 50).seeds != s.seeds
    with pytest.raises(ValueError, match="frozen per run"):
        L.load_or_create_eval_seeds(tmp_path, master_seed=7, count=40)
    p = tmp_path / "ladder" / "eval_seeds.json"
    p.write_text(p.read_text().replace(str(s.seeds[0]), str(s.seeds[0] + 1)))
    with pytest.raises(ValueError, match="sha256 does not match"):
        L.load_or_create_eval_seeds(tmp_path, master_seed=7, count=50)


# --- 4. The gate ----------------------------------------------------------------------------------------

class FakeRunner:
    """play(a, b, n): a wins the first wins[(a, b)] of n battles (seed t // 2, side t % 2)."""

    def __init__(self, rates):
        self.rates, self.calls = rates, []

    def __call__(self, a, b, n):
        self.calls.append((a, b, n))
        k = round(self.rates[(a, b)] * n)
        return [game(a, b, 1.0 if t < k else 0.0, seed=t // 2, side=L.SIDES[t % 2]) for t in range(n)]


class SpreadRunner(FakeRunner):
    """play(a, b, n[, first_seed, of]): battle t (seed t // 2, side t % 2) of a comparison is a's win
    iff round(rate * (t + 1)) > round(rate * t): any first n battles win round(rate * n), spread
    evenly, and a look (first_seed, of) is the comparison's battles from seed first_seed."""

    def __call__(self, a, b, n, first_seed=0, of=None):
        self.calls.append((a, b, n))
        r, t0 = self.rates[(a, b)], 2 * first_seed
        return [game(a, b, float(round(r * (t + 1)) - round(r * t)), seed=t // 2, side=L.SIDES[t % 2])
                for t in range(t0, t0 + n)]


def record(a, b, rate, n=200):
    return FakeRunner({(a, b): rate})(a, b, n)


def gate_setup(champ_rate=0.56, noop=(1.0, 1.0), rl=(0.7, 0.7), pool_rate=0.6, pool=True):
    """candidate C, champion K; noop/rl = (candidate's rate, champion's record)."""
    members = [f"snap:m{i}" for i in range(10)] if pool else []
    rates = {("C", "K"): champ_rate, ("C", "scripted:noop"): noop[0], ("C", "scripted:random_legal"): rl[0]}
    rates.update({("C", m): pool_rate for m in members})
    history = record("K", "scripted:noop", noop[1]) + record("K", "scripted:random_legal", rl[1])
    # the fit: K rated 0 vs the members at -70 Elo, so the champion's predicted mean is 0.6 [A]
    games = []
    for _, m in enumerate(members):
        games += [game("K", m, 1.0 if k < 60 else 0.0, seed=k // 2, side=L.SIDES[k % 2]) for k in range(100)]
    games += [game("K", "scripted:noop", 1.0, seed=k // 2, side=L.SIDES[k % 2]) for k in range(10)]
    table = L.fit_ratings(games) if games else None
    gate = L.WilsonGate(L.GateConfig(), master_seed=1, eval_seed_set_sha="f" * 64)
    return gate, FakeRunner(rates), members + ["K", "scripted:noop"], table, history


def test_gate_all_pass_promotes_and_writes_its_decision(tmp_path):
    gate, run, members, table, hist = gate_setup(pool_rate=0.7)
    d, played = gate.evaluate("C", "K", members, table, run, hist)
    assert (d.outcome, d.admit, d.promote, d.cycle, d.failed) == ("admit+promote", True, True, False, [])
    assert d.conditions["champion"].n == 1000 and d.conditions["champion"].observed == pytest.approx(0.56)
    assert len(d.conditions["pool"].members) == 8 and d.conditions["pool"].n == 800
    assert len(played) == 1000 + 2 * 200 + 8 * 100            # 2200 battles, all rating evidence
    path = L.write_gate_decision(tmp_path, d)
    assert path.name == "C.json"
    back = msgspec.json.decode(path.read_bytes(), type=L.GateDecision)
    assert back.outcome == "admit+promote" and back.eval_seed_set_sha == "f" * 64


@pytest.mark.parametrize("rate,passes", [(0.552, True), (0.550, False)])
def test_gate_champion_condition_at_the_table_boundary(rate, passes):
    gate, run, members, table, hist = gate_setup(champ_rate=rate, pool_rate=0.7)
    d, _ = gate.evaluate("C", "K", members, table, run, hist)
    c = d.conditions["champion"]
    assert c.passed is passes and c.n == 1000
    assert round(c.bound, 3) == (0.521 if passes else 0.519)
    assert d.failed == ([] if passes else ["champion"])
    assert d.outcome == ("admit+promote" if passes else "discard")


def test_a_sequential_look_settles_by_a_99_percent_bound_early_and_the_bar_out_of_reach():
    """[A] sequential_settled: 0.70 over 100 clears 0.52 even at 99% (Wilson lower bound 0.572);
    0.40 over 100 cannot reach it in 500 more (at the rate's 95% upper bound 0.498 the final rate is
    0.481, its lower bound 0.441); 0.56 over 100 plays on (its 99% bound 0.431; at its 95% upper
    bound 0.654 the final rate 0.638 would clear the bar); at the cap, the fixed design's verdict."""
    assert L.wilson_interval(0.70, 100, L.Z_EARLY)[0] == pytest.approx(0.572, abs=1e-3)
    assert L.sequential_settled(0.70, 100, 600, 0.52) is True
    assert L.sequential_settled(0.40, 100, 600, 0.52) is False
    assert L.sequential_settled(0.56, 100, 600, 0.52) is None
    assert L.sequential_settled(0.60, 100, 600, 0.52) is None          # 0.60 clears 95%, not 99%
    assert L.wilson_interval(0.60, 100)[0] > 0.5 > L.wilson_interval(0.60, 100, L.Z_EARLY)[0] - 0.03
    for rate in (0.552, 0.550):       # at n = total: exactly the fixed gate's bound (0.521 / 0.519)
        assert L.sequential_settled(rate, 1000, 1000, 0.52) is (rate == 0.552)


@pytest.mark.parametrize("rate", [0.70, 0.40, 0.552])
def test_a_sequential_gate_plays_the_fixed_gates_games_in_looks_and_stops_when_settled(rate):
    """GateConfig.sequential_battles: condition (1)'s battles in looks (first_seed, of), each look
    the fixed comparison's own seeds and streams, stopped at the first settled look; a candidate
    that never settles early plays every battle and gets the fixed verdict."""
    gate, run, members, table, hist = gate_setup(champ_rate=rate, pool_rate=0.7)
    run = SpreadRunner(run.rates)
    fixed, _ = gate.evaluate("C", "K", members, table, run, hist)
    calls = []
    real = run.__call__

    def looked(a, b, n, **part):
        calls.append((a, b, n, part))
        return real(a, b, n, **part)
    seq = L.WilsonGate(L.GateConfig(sequential_battles=100), master_seed=1, eval_seed_set_sha="f" * 64)
    d, played = seq.evaluate("C", "K", members, table, looked, hist)
    looks = [c for c in calls if c[:2] == ("C", "K")]
    assert [c[3] for c in looks] == [{"first_seed": 50 * i, "of": 1000} for i in range(len(looks))]
    c = d.conditions["champion"]
    assert c.n == 100 * len(looks) and d.conditions["pool"].n == fixed.conditions["pool"].n
    want = {0.70: (1, True), 0.40: (1, False), 0.552: (10, True)}[rate]
    assert (len(looks), c.passed) == want and d.promote is c.passed
    if rate == 0.552:
        f = fixed.conditions["champion"]
        assert (c.observed, c.bound) == (f.observed, f.bound)


def test_gate_anchor_regression_fails_alone_and_is_named():
    # 2.5 pp below the champion's record against noop; random_legal exactly 2.0 pp below passes
    gate, run, members, table, hist = gate_setup(noop=(0.90, 0.925), rl=(0.68, 0.70), pool_rate=0.7)
    d, _ = gate.evaluate("C", "K", members, table, run, hist)
    assert d.failed == ["anchor:scripted:noop"] and d.outcome == "discard" and not d.admit
    assert d.conditions["anchor:scripted:noop"].reference == pytest.approx(0.925)
    assert d.conditions["anchor:scripted:random_legal"].passed


def test_gate_pool_collapse_admits_as_cycle():
    gate, run, members, table, hist = gate_setup(pool_rate=0.45)
    d, _ = gate.evaluate("C", "K", members, table, run, hist)
    c = d.conditions["pool"]
    assert c.reference == pytest.approx(0.6, abs=0.01)        # the champion's FITTED prediction
    assert not c.passed and d.failed == ["pool"]
    assert (d.outcome, d.admit, d.promote, d.cycle) == ("admit-as-cycle", True, False, True)


def test_gate_pool_condition_uses_the_fit_for_a_champion_without_games_against_the_eight():
    gate, run, members, table, hist = gate_setup(pool_rate=0.7)
    # re-fit with the champion's games against the members replaced by members-vs-anchor games:
    # the champion has played none of them, yet the fit predicts every pair
    games = [game("K", "scripted:noop", 1.0 if k < 70 else 0.0, seed=k // 2, side=L.SIDES[k % 2])
             for k in range(100)]
    for m in members[:10]:
        games += [game(m, "scripted:noop", 1.0 if k < 50 else 0.0, seed=k // 2, side=L.SIDES[k % 2])
                  for k in range(100)]
    t = L.fit_ratings(games)
    d, _ = gate.evaluate("C", "K", members, t, run, hist)
    c = d.conditions["pool"]
    assert c.passed and not c.skipped and c.n == 800
    assert c.reference == pytest.approx(np.mean([t.predict("K", m) for m in c.members]))
    assert c.reference > 0.55


def test_gate_pool_condition_skipped_without_a_pool_and_champion_plays_anchor_once(tmp_path):
    gate, run, members, table, _ = gate_setup(pool=False)
    run.rates[("K", "scripted:noop")] = 1.0
    run.rates[("K", "scripted:random_legal")] = 0.7
    d, played = gate.evaluate("C", "K", members, table, run, history=[])
    c = d.conditions["pool"]
    assert c.skipped and c.passed and c.n == 0 and "SKIPPED" in c.reason and c.observed is None
    assert d.outcome == "admit+promote"
    back = msgspec.json.decode(L.write_gate_decision(tmp_path, d).read_bytes(), type=L.GateDecision)
    assert back.conditions["pool"] == c
    # no record: the champion played each anchor once, at the same count
    assert ("K", "scripted:noop", 200) in run.calls and ("K", "scripted:random_legal", 200) in run.calls
    assert len(played) == 1000 + 4 * 200


def test_a_seeded_first_gate_predicts_the_champion_against_a_seed_from_the_gate_s_own_games():
    """A seeded run's first gate: no evaluation game yet (no table), v0 the champion, a seed the
    only sampled member. The seed is linked to the champion through the candidate's games, so the
    champion's predicted mean is the fit of every game the gate played (it used to raise)."""
    gate, run, _, _, _ = gate_setup(pool=False, champ_rate=0.6)
    run.rates.update({("K", "scripted:noop"): 1.0, ("K", "scripted:random_legal"): 0.7,
                      ("C", "seed:s"): 0.55})
    d, played = gate.evaluate("C", "K", ["seed:s"], None, run, history=[])
    c = d.conditions["pool"]
    assert not c.skipped and c.members == ["seed:s"] and c.n == 100 and c.observed == pytest.approx(0.55)
    t = L.fit_ratings(played)
    # C beat K: K is weaker
    assert c.reference == pytest.approx(t.predict("K", "seed:s")) and c.reference < 0.55


def test_stratified_sample_spans_the_rating_range():
    gate = L.WilsonGate(L.GateConfig(), master_seed=3, eval_seed_set_sha="")
    members = [f"s{i:02d}" for i in range(32)]
    games = []
    for i, m in enumerate(members):   # member i scores i/32 against the anchor
        k = int(100 * i / 32)
        games += [game(m, "scripted:noop", 1.0 if t < k else 0.0, seed=t // 2, side=L.SIDES[t % 2])
                  for t in range(100)]
    games += [game("K", "scripted:noop", float(t < 50), seed=t // 2, side=L.SIDES[t % 2]) for t in range(100)]
    t = L.fit_ratings(games)
    pick = gate.stratified_sample("C", "K", members + ["K", "scripted:noop"], t)
    order = sorted(members, key=lambda m: t.rating[m])
    strata = [set(order[4 * k:4 * k + 4]) for k in range(8)]
    assert len(pick) == 8 and all(len(st & set(pick)) == 1 for st in strata)


# --- 5. Snapshots ---------------------------------------------------------------------------------------

def snap_spec(**kw):
    base = dict(arch_digest="arch1", obs_digest="obs1", action_digest="act1", codec_version=1,
                codec_table_digest="codec1", frame_stack=1, num_cards=145, vector_size=17, step=4000,
                context="ctx0", run_id="run", arch={"channels": 8})
    base.update(kw)
    return L.SnapshotSpec(**base)


def tensors():
    return {"w": (np.arange(24, dtype=np.float32).reshape(4, 6) / 8.0), "b": np.ones(6, dtype=np.float32)}


def test_snapshot_round_trip_fp16_and_refusals_name_the_field(tmp_path):
    store = L.SnapshotStore(tmp_path)
    sid = store.save(tensors(), snap_spec())
    assert store.ids() == [sid] and len(sid) == 16
    assert store.save(tensors(), snap_spec()) == sid                  # content-addressed
    assert store.save(tensors(), snap_spec(step=8000)) != sid
    expect = {"arch_digest": "arch1", "obs_digest": "obs1", "codec_table_digest": "codec1"}
    spec, t = store.load(sid, expect)
    assert t["w"].dtype == np.float16 and np.array_equal(t["w"], tensors()["w"].astype(np.float16))
    assert spec.step == 4000 and spec.arch == {"channels": 8} and len(spec.actor_sha256) == 64
    for field in L.DIGEST_FIELDS:
        with pytest.raises(L.SnapshotMismatch, match=rf"{sid}: {field} is .* this run's {field} is other"):
            store.load(sid, {**expect, field: "other"})
    # a damaged weights file is refused
    folder = store.root / sid
    blob = bytearray((folder / "actor.safetensors").read_bytes())
    blob[-1] ^= 1
    (folder / "actor.safetensors").write_bytes(bytes(blob))
    with pytest.raises(L.SnapshotMismatch, match="actor_sha256"):
        store.load(sid, expect)


def test_a_snapshot_names_the_script_that_builds_it_only_when_it_is_a_fork(tmp_path):
    """spec.json leaves the builder out for ppo_clash.py, so a ppo_clash.py snapshot's bytes and
    id are what they were before the field existed; a fork's snapshot names the fork. A CLI player is
    built by that script, loaded from beside ladder.py: a name that is not a script's file name, or a
    script that is not there, is one line naming it."""
    store = L.SnapshotStore(tmp_path)
    plain, fork = store.save(tensors(), snap_spec()), store.save(tensors(), snap_spec(builder="ppo_fork.py"))
    assert b"builder" not in (store.root / plain / "spec.json").read_bytes()
    assert store.spec(plain).script() == "ppo_clash.py" and store.spec(fork).script() == "ppo_fork.py"
    assert plain != fork
    with pytest.raises(L.CliError,
                       match=r"trained by ppo_gone.py, which is not beside ladder.py in .*: put the "):
        L.training_script("ppo_gone.py")
    for bad in ("../ppo_clash.py", "ppo_clash", "sub/ppo_clash.py"):
        with pytest.raises(L.CliError,
                           match=rf"names its builder {re.escape(repr(bad))}, not a script's file name"):
            L.training_script(bad)


def test_a_seed_snapshot_is_checked_against_its_pinned_hash_and_the_runs_digests_then_copied_byte_for_byte(
        tmp_path):
    outside = L.SnapshotStore(tmp_path / "elsewhere")
    sid = outside.save(tensors(), snap_spec())
    folder = outside.root / sid
    expect = {"arch_digest": "arch1", "obs_digest": "obs1", "codec_table_digest": "codec1"}
    pinned = outside.spec(sid).actor_sha256
    label = "ladder.seed_snapshots[0] (seed:p)"
    assert L.check_seed(label, folder, pinned, expect).step == 4000
    with pytest.raises(L.SnapshotMismatch,
                       match=rf"seed:p\): .*actor.safetensors has sha256 {pinned}, the config pins 0{{64}}"):
        L.check_seed(label, folder, "0" * 64, expect)
    for field in L.DIGEST_FIELDS:
        with pytest.raises(L.SnapshotMismatch,
                           match=rf"seed:p\): snapshot {sid}: {field} is .* this run's {field} is x"):
            L.check_seed(label, folder, pinned, {**expect, field: "x"})
    with pytest.raises(L.SnapshotMismatch, match=r"seed:p\): .*nowhere: not a snapshot folder"):
        L.check_seed(label, tmp_path / "nowhere", pinned, expect)
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "actor.safetensors").write_bytes((folder / "actor.safetensors").read_bytes())
    (torn / "spec.json").write_text('{"arch_digest": ')
    with pytest.raises(L.SnapshotMismatch, match=r"seed:p\): .*(JSON|truncated)"):
        L.check_seed(label, torn, pinned, expect)
    # the copy is the folder's bytes, so the same id, read from the run from now on
    run = L.SnapshotStore(tmp_path / "run")
    (tmp_path / "run" / "ladder" / "snapshots").mkdir(parents=True)
    assert run.copy_in(folder) == sid and run.folders == {} and run.ids() == [sid]
    for name in ("spec.json", "actor.safetensors"):
        assert (run.root / sid / name).read_bytes() == (folder / name).read_bytes()
    assert run.load(sid, expect)[0] == outside.spec(sid)


def test_a_seed_is_drawn_by_its_weight_times_pfsp_and_resolved_by_the_runs_pool(tmp_path):
    pool, table = _pool_and_table(2)
    pool.admit(L.PoolMember(id="seed:p", step=7, seed=True, snapshot="abc", weight=3.0), promote=False)
    assert pool.v0 == "snap:v0" and pool.champion == "snap:v1"      # a seed is never v0 nor promoted
    assert pool.seeds() == {"seed:p": "abc"} and pool.snapshot_id("seed:p") == "abc"
    assert pool.snapshot_id("snap:v1") == "v1"
    mm = L.Matchmaker(master_seed=1, n_battles=8, cfg=L.MatchConfig(max_resident_opponents=3))
    mm.plan(0, [0] * 8, pool, table)
    w = dict(zip(mm.residents, mm.weights, strict=True))
    # the stand-in is v1 (the newest non-seed); the seed is unrated (p = 0.5), as v1 itself is
    base = L.pfsp_weights([table.predict("snap:v1", "snap:v0"), 0.5, 0.5])
    assert w == pytest.approx({"snap:v0": base[0], "snap:v1": base[1], "seed:p": 3.0 * base[2]})
    # a member kept out of the sampler (v0 beside seeds) is a member, never drawn
    kept = L.Pool()
    kept.admit(L.PoolMember(id="snap:v0", step=0), promote=True, sample=False)
    kept.admit(L.PoolMember(id="seed:p", step=7, seed=True, snapshot="abc"), promote=False)
    assert kept.sampler == ["seed:p"] and kept.champion == kept.v0 == "snap:v0"
    mm.plan(1, [0] * 8, kept, None)
    assert mm.residents == ("seed:p",)
    # an evaluation runner on the run resolves seed:<name> through ladder/pool.json
    L.write_pool(tmp_path, kept)
    built = []
    with runner(tmp_path, policy_builder=lambda sid: built.append(sid) or legal_from_uniforms) as r:
        assert r.players.act("seed:p") is legal_from_uniforms and built == ["abc"]
        with pytest.raises(ValueError, match=r"seed:q: no such seed snapshot in this run's pool "
                                             r"\(its seeds: \['seed:p'\]\)"):
            r.players.act("seed:q")


def test_policy_cache_is_lru(tmp_path):
    store = L.SnapshotStore(tmp_path)
    ids = [store.save(tensors(), snap_spec(step=s)) for s in (1, 2, 3)]
    built = []
    cache = L.LoadedPolicyCache(store, lambda spec, t: built.append(spec.step) or spec.step, capacity=2)
    assert [cache.get(i) for i in (ids[0], ids[1], ids[0], ids[2])] == [1, 2, 1, 3]
    assert list(cache.resident) == [ids[0], ids[2]]                   # ids[1] was least recent
    cache.get(ids[1])
    assert built == [1, 2, 3, 2]


def test_no_written_file_holds_a_pickle_marker(tmp_path):
    """Exercise every writer, then scan every file under the run for pickle's protocol header
    (b'\\x80' + protocol 2..5) and torch's zip container."""
    L.SnapshotStore(tmp_path).save(tensors(), snap_spec())
    log = L.ResultLog(tmp_path)
    log.append(sim_games(np.random.default_rng(0), 4))
    L.write_ratings(tmp_path, L.fit_ratings(log.read().games))
    L.load_or_create_eval_seeds(tmp_path, 1, 10)
    gate, run, members, table, hist = gate_setup(pool_rate=0.7)
    L.write_gate_decision(tmp_path, gate.evaluate("C", "K", members, table, run, hist)[0])
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 7
    for p in files:
        data = p.read_bytes()
        assert not any(bytes([0x80, k]) in data for k in (2, 3, 4, 5)), p
        assert b"PK\x03\x04" not in data, p
        if p.suffix == ".json":
            json.loads(data)


# --- 6. Eviction ----------------------------------------------------------------------------------------

def test_eviction_never_removes_anchors_v0_or_champions_and_prefers_cycles():
    pool = L.Pool()
    pool.admit(L.PoolMember(id="seed:old", step=0, seed=True), promote=False)
    for i in range(20):
        pool.admit(L.PoolMember(id=f"snap:v{i:02d}", step=i, cycle=(i == 11)), promote=i in (0, 5, 13))
    rating = {f"snap:v{i:02d}": 10.0 * i for i in range(20)}
    rating.update({"seed:old": -50.0, L.ANCHOR: 0.0})
    t = L.RatingTable(rating=rating, se={}, anchor=L.ANCHOR, draws="half_win", draw_fallback=False,
                      draw_nu=None, draw_rate=0.0, n_games={}, n_total=0, transitivity_residual=None,
                      residual_pairs=0, converged=True, iterations=1, context=None, ids=[], cov=[])
    evicted = L.hall_of_fame_evict(pool, t, working_size=8)
    assert pool.v0 == "snap:v00" and pool.champion == "snap:v13"
    prot = {"seed:old", "snap:v00", "snap:v05", "snap:v13"}
    assert not prot & set(evicted) and prot <= set(pool.sampler)
    assert len(pool.sampler) == 8 and len(evicted) == 13
    assert "snap:v11" in pool.sampler                       # the cycle-flagged one is kept
    kept = [m for m in pool.sampler if m not in prot]
    assert min(rating[m] for m in kept) <= 40 and max(rating[m] for m in kept) >= 150   # spans
    assert len(pool.members) == 21                          # the archive is untouched
    # a working size below the protected count evicts every unprotected one, never a protected
    L.hall_of_fame_evict(pool, t, working_size=1)
    assert set(pool.sampler) == prot


# --- 7. Matchmaking -------------------------------------------------------------------------------------

MIXES = [(0.5, 0.35, 0.15), (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.3, 0.3, 0.4), (0.1, 0.45, 0.45)]
GEOMETRIES = [1, 2, 3, 7, 10, 96, 193]


def test_role_counts_follow_the_rounding_rule():
    assert L.role_counts((0.5, 0.35, 0.15), 96) == (48, 34, 14)      # design 7.3's laptop split
    assert L.role_counts((0.5, 0.35, 0.15), 1) == (1, 0, 0)          # halves round up
    assert L.role_counts((1.0, 0.0, 0.0), 7) == (7, 0, 0)
    assert L.role_counts((0.1, 0.45, 0.45), 3) == (0, 2, 1)
    with pytest.raises(ValueError, match="ladder.mix"):
        L.role_counts((0.5, 0.5, 0.5), 4)


def test_role_layout_within_one_battle_of_the_mixture_over_seeds_and_geometries():
    for mix in MIXES:
        for n in GEOMETRIES:
            counts = L.role_counts(mix, n)
            assert sum(counts) == n
            assert all(abs(c - m * n) <= 1.0 + 1e-9 for c, m in zip(counts, mix, strict=True)), \
                (mix, n, counts)
            layouts = set()
            for seed in range(30):
                roles = L.role_layout(seed, n, mix)
                assert tuple(int((roles == r).sum()) for r in (0, 1, 2)) == counts
                layouts.add(roles.tobytes())
            if n == 96 and mix == MIXES[0]:
                assert len(layouts) == 30                             # a seeded permutation
                # spread: every contiguous quarter (a worker's block) carries mirror battles
                roles = L.role_layout(0, 96, mix)
                assert all((roles[q * 24:(q + 1) * 24] == ROLE_MIRROR).any() for q in range(4))


def test_pfsp_weights_floored_hard_and_normalised():
    p = np.array([0.99, 0.9, 0.5, 0.1])
    w = L.pfsp_weights(p, power=2.0, uniform_mix=0.0, floor_scale=0.01)
    assert w.sum() == pytest.approx(1.0) and w.min() >= 0.01 / 4 - 1e-15
    assert np.all(np.diff(w) > 0)                                    # harder opponents weigh more
    w2 = L.pfsp_weights(p)
    assert w2.min() >= 0.2 / 4 * 0.99 and w2.sum() == pytest.approx(1.0)
    hard = (1 - p) ** 2 / ((1 - p) ** 2).sum()
    assert np.allclose(w2, 0.01 / 4 + 0.99 * (0.8 * hard + 0.2 / 4))


def _pool_and_table(n=5):
    pool = L.Pool()
    for i in range(n):
        pool.admit(L.PoolMember(id=f"snap:v{i}", step=1000 * i), promote=True)
    games = []
    for i in range(n):
        k = 20 + 15 * i
        games += [game(f"snap:v{i}", L.ANCHOR, 1.0 if t < k else 0.0, seed=t // 2, side=L.SIDES[t % 2])
                  for t in range(100)]
    return pool, L.fit_ratings(games)


def test_assign_is_a_pure_function_and_plan_is_assign_across_the_geometry():
    pool, table = _pool_and_table()
    mm = L.Matchmaker(master_seed=5, n_battles=96)
    plan = mm.plan(iteration=3, ordinals=[b % 4 for b in range(96)], pool=pool, ratings=table)
    assert plan.n_slots == 192 and len(plan.resident_snapshots) <= 2
    for b, a in enumerate(plan.assignment):
        assert a == L.assign(5, mm.roles, mm.cfg.scripted_opponents, b, b % 4, mm.residents, mm.weights)
        assert a == mm.assign(b, b % 4)
    # the same episode meets the same opponent whichever iteration it falls in (same residents)
    again = L.Matchmaker(master_seed=5, n_battles=96)
    again.residents, again.weights = mm.residents, mm.weights
    assert again.assign(40, 2) == mm.assign(40, 2)
    # roles never move with ordinal, pool or ratings; opponents and seats do move with the ordinal
    pool_b = int(np.flatnonzero(mm.roles == ROLE_POOL)[0])
    draws = [mm.assign(pool_b, k) for k in range(40)]
    assert {a.role for a in draws} == {ROLE_POOL}
    assert {a.learner_seat for a in draws} == {0, 1} and len({a.opponent_id for a in draws}) == 2
    assert all(a.group[a.learner_seat] == GROUP_LEARNER and a.group[1 - a.learner_seat] in (0, 1)
               for a in draws)


def test_fixed_seats_put_the_learner_where_its_battle_deals_the_deck_and_draw_the_rest_alike():
    pool, table = _pool_and_table()
    free = L.Matchmaker(master_seed=5, n_battles=12)
    fixed = L.Matchmaker(master_seed=5, n_battles=12, cfg=L.MatchConfig(fixed_seats=True))
    for mm in (free, fixed):
        mm.plan(0, [0] * 12, pool, table)
    seats = {}
    for b in range(12):
        for k in range(8):
            a, f = free.assign(b, k), fixed.assign(b, k)
            assert (a.role, a.opponent_id) == (f.role, f.opponent_id)   # the same opponent: one stream
            if f.role != ROLE_MIRROR:
                assert f.learner_seat == b % 2 and f.group[b % 2] == GROUP_LEARNER
                seats.setdefault(b, set()).add(a.learner_seat)
    assert any(len(v) == 2 for v in seats.values())                      # the free draw does move


def test_every_plan_collects_n_battles_plus_mirror_learner_rows_and_pool_plays_scripted_first():
    for n in GEOMETRIES:
        mirror = L.role_counts(MIXES[0], n)[0]
        mm = L.Matchmaker(master_seed=n, n_battles=n)
        empty = mm.plan(0, [0] * n, L.Pool(), None)                # before the first snapshot
        assert L.learner_rows(empty) == n + mirror
        assert empty.resident_snapshots == () and mm.pfsp_effective == 0
        for a in empty.assignment:
            if mm.roles[a.battle] != ROLE_MIRROR:                 # pool slots play scripted
                assert a.role == ROLE_SCRIPTED and a.opponent_id in mm.cfg.scripted_opponents
                assert GROUP_SCRIPTED in a.group
        pool, table = _pool_and_table()
        full = mm.plan(1, [1] * n, pool, table)
        assert L.learner_rows(full) == n + mirror
        pool_slots = [a for a in full.assignment if mm.roles[a.battle] == ROLE_POOL]
        assert all(a.role == ROLE_POOL and a.opponent_id in full.resident_snapshots for a in pool_slots)


def test_pfsp_uses_the_newest_admitted_snapshot_as_the_learners_stand_in():
    pool, table = _pool_and_table()
    mm = L.Matchmaker(master_seed=1, n_battles=8, cfg=L.MatchConfig(max_resident_opponents=5))
    mm.plan(0, [0] * 8, pool, table)
    assert mm.pfsp_effective == 1 and mm.pfsp_learner_step == 4000
    w = dict(zip(mm.residents, mm.weights, strict=True))
    # v4 is the strongest, so the weakest (v0) is the easiest and weighs least; v4 itself is 0.5
    assert w["snap:v0"] == min(w.values()) and w["snap:v4"] == max(w.values())
    mm.plan(1, [0] * 8, pool, None)                               # no fit yet: uniform, flagged
    assert mm.pfsp_effective == 0 and mm.pfsp_learner_step is None
    assert len(set(mm.weights)) == 1


# --- 7b. The training loop's ladder (LadderLoop), without a run -------------------------------------------


def _loop(**ladder_args):
    """A LadderLoop with only what these tests read: the run's ladder arguments, a pool, no run."""
    from types import SimpleNamespace as NS
    lad = L.LadderLoop.__new__(L.LadderLoop)
    lad.args = NS(ladder=NS(max_resident_opponents=2, **ladder_args))
    lad.slots, lad.pool = [], L.Pool()
    return lad


def test_the_resident_table_keeps_a_live_episodes_group_and_reuses_only_free_slots():
    """Group ids index LadderLoop.slots for the run: a slot is reused only when no live assignment
    and no current resident points at it, so an episode's group means one snapshot to its end."""
    from types import SimpleNamespace
    lad = _loop()
    lad.mm = SimpleNamespace(residents=("snap:a", "snap:b"))
    assert [lad._slot("snap:a", set()), lad._slot("snap:b", set())] == [0, 1]
    assert lad._slot("snap:a", set()) == 0                       # known: same slot
    lad.mm = SimpleNamespace(residents=("snap:c",))
    assert lad._slot("snap:c", {0}) == 1       # slot 0 is live (a mid-episode); slot 1 is free: reused
    assert lad.slots == ["a", "c"]
    lad.mm = SimpleNamespace(residents=("snap:c", "snap:d"))
    assert lad._slot("snap:d", {0}) == 2       # 0 live, 1 resident: appended
    a = L.farm.Assignment(battle=3, ordinal=2, role=ROLE_POOL, opponent_id="snap:d", group=(1, -1),
                          learner_seat=1)
    assert lad.remap(a).group == (2, -1)       # the matchmaker's resident index -> the table's slot
    m = L.farm.Assignment(battle=0, ordinal=0, role=ROLE_MIRROR, opponent_id=None, group=(-1, -1),
                          learner_seat=-1)
    assert lad.remap(m) is m
    # a seed snapshot sits in the table as the snapshot it plays as, and a resident seed's slot is
    # not free: seed:s plays as "e"
    lad.pool.admit(L.PoolMember(id="seed:s", step=9, seed=True, snapshot="e"), promote=False)
    lad.mm = SimpleNamespace(residents=("seed:s",))
    # 0 and 2 were free: first reused
    assert lad._slot("seed:s", set()) == 0 and lad.slots == ["e", "c", "d"]
    lad.mm = SimpleNamespace(residents=("seed:s", "snap:f"))
    assert lad._slot("snap:f", set()) == 1 and lad.slots == ["e", "f", "d"]   # not slot 0: seed:s is resident
    s = L.farm.Assignment(battle=1, ordinal=4, role=ROLE_POOL, opponent_id="seed:s", group=(-1, 1),
                          learner_seat=0)
    assert lad.remap(s).group == (-1, 0)


def test_a_resume_cannot_change_the_seats_deck_or_the_seed_snapshots():
    """What a run fixed at its start a resume cannot change, not even under --allow-identity-drift:
    refused naming the field, as LadderSetupChanged (one line and exit 2 from ppo_clash.py)."""
    from types import SimpleNamespace as NS
    args, cfg, pool = NS(seat_decks=NS(deck=()), seed_snapshots=()), L.MatchConfig(), L.Pool()
    L.refuse_changed_setup(args, cfg, pool)
    args.seed_snapshots = (NS(name="patient"),)
    with pytest.raises(L.LadderSetupChanged,
                       match=r"ladder.seed_snapshots: the checkpoint's pool holds none; seeds are admitted"):
        L.refuse_changed_setup(args, cfg, pool)
    pool.admit(L.PoolMember(id="seed:patient", step=0, seed=True, snapshot="ab"), promote=False)
    L.refuse_changed_setup(args, cfg, pool)
    args.seat_decks = NS(deck=("Knight",) * 8)
    with pytest.raises(L.LadderSetupChanged,
                       match=r"seat_decks.deck: the checkpoint's run was started without one"):
        L.refuse_changed_setup(args, cfg, pool)
    with pytest.raises(L.LadderSetupChanged,
                       match=r"seat_decks.deck: the checkpoint's run was started with one"):
        L.refuse_changed_setup(NS(seat_decks=NS(deck=()), seed_snapshots=()), L.MatchConfig(fixed_seats=True),
                               pool)


# --- 8. The CLI, torch-free ---------------------------------------------------------------------------

# torch made unimportable the way an install without it is: a finder that raises
# ModuleNotFoundError for torch and its submodules. (sys.modules['torch'] = None would also block
# it, but leaves the key in sys.modules, and tyro reads that key as "torch is loaded".)
NO_TORCH = ("import sys, runpy\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r} (blocked by the test)')\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "sys.argv = ['ladder.py'] + sys.argv[1:]\n"
            "runpy.run_path('ladder.py', run_name='__main__')\n")


def run_cli(*args):
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_rate_cli_runs_without_torch_and_prints_the_table(tmp_path):
    log = L.ResultLog(tmp_path)
    log.append(sim_games(np.random.default_rng(2), 60))
    log.append([game("learner@9", "scripted:noop", 1.0, kind="probe")])
    with open(log.path, "ab") as f:
        f.write(b'{"a": "p')
    r = run_cli("rate", str(tmp_path))
    assert r.returncode == 0, r.stderr
    t = L.fit_ratings([g for g in log.read().games if g.kind == "eval"])
    out = r.stdout
    assert f"eval games {15 * 60}" in out and "anchor scripted:noop (pinned at 0)" in out
    assert "torn line" in out and "learner@9" not in out
    row = next(line for line in out.splitlines() if line.startswith("p4 "))
    assert float(row.split()[1]) == pytest.approx(t.rating["p4"], abs=0.05)
    assert f"nu={t.draw_nu:.4f}" in out and "transitivity residual:" in out


def test_rate_cli_prints_the_champion_s_lead_over_v0_with_the_difference_s_own_error(tmp_path):
    """With a pool, `rate` adds the champion's lead over v0 and its error from the 2x2 covariance
    block (se_diff), which is smaller than the marginals summed when the two share games."""
    log = L.ResultLog(tmp_path)
    log.append(sim_games(np.random.default_rng(3), 60))
    pool = L.Pool()
    for pid, promote in (("p1", True), ("p4", True)):
        pool.admit(L.PoolMember(id=pid, step=1), promote=promote)
    L.write_pool(tmp_path, pool)
    r = run_cli("rate", str(tmp_path))
    assert r.returncode == 0, r.stderr
    t = L.fit_ratings(log.read().games)
    d, se = t.rating["p4"] - t.rating["p1"], t.se_diff("p4", "p1")
    assert se < math.hypot(t.se["p4"], t.se["p1"])
    want = f"champion p4 above v0 p1: {d:.1f} +- {se:.1f} (95% [{d - L.Z95 * se:.1f}, {d + L.Z95 * se:.1f}])"
    assert want in r.stdout.splitlines(), r.stdout
    L.write_pool(tmp_path, L.Pool())        # no champion: no line
    assert "above v0" not in run_cli("rate", str(tmp_path)).stdout


def test_rate_cli_on_an_empty_run_says_so_in_one_line_and_exits_1(tmp_path):
    r = run_cli("rate", str(tmp_path))
    assert r.returncode == 1
    assert len(r.stdout.strip().splitlines()) == 1 and "no evaluation games yet" in r.stdout
    r = run_cli("gate", "--run", str(tmp_path), "--candidate", "snap:x")
    assert r.returncode == 2 and "no champion to gate against" in r.stderr
    r = run_cli("rate", str(tmp_path / "nope"))
    assert r.returncode == 2 and f"{tmp_path / 'nope'}: no such directory" in r.stderr
    r = run_cli("gate", "--run", str(tmp_path), "--candidat", "snap:x")   # a typo: tyro names the flag
    assert r.returncode == 2 and "--candidat" in r.stderr and r.stdout == ""


# --- 9. Evaluation helpers and metric keys -----------------------------------------------------------

def test_comparison_seeds_are_the_first_of_the_frozen_set():
    s = L.draw_eval_seeds(1, 500)
    assert L.comparison_seed_indices(s, 40) == list(range(20))
    with pytest.raises(ValueError, match="eval_seed_count"):
        L.comparison_seed_indices(s, 1002)
    with pytest.raises(ValueError, match="even count"):
        L.comparison_seed_indices(s, 41)
    assert L.eval_match_path("gate/C/vs/K", 7, "red") == "eval/match/gate/C/vs/K/7/red"


def test_probe_metrics_publish_seeds_and_interval_and_nothing_for_an_unplayed_rung():
    g = [game("learner@100", "scripted:noop", float(s % 4 != 0), seed=s, side=side, kind="probe")
         for s in range(20) for side in L.SIDES]
    m = L.probe_metrics(g, "learner@100", "scripted:noop", master_seed=1, resamples=2000)
    assert m["ladder/score_vs/scripted:noop"] == pytest.approx(0.75) == m["ladder/score_vs_noop"]
    assert m["ladder/score_vs_n/scripted:noop"] == 20                # seeds, not battles
    assert m["ladder/score_vs_ci95_lo/scripted:noop"] < 0.75 < m["ladder/score_vs_ci95_hi/scripted:noop"]
    assert L.probe_metrics(g, "learner@100", "scripted:random_legal", 1) == {}


def test_ladder_metrics_absent_rather_than_zero_when_undefined():
    m = L.ladder_metrics(None, L.Pool(), L.Matchmaker(0, 4))
    assert m == {"ladder/pool_size": 0, "ladder/sampler_size": 0, "ladder/gate_attempts": 0,
                 "ladder/gate_passes": 0, "ladder/evictions": 0, "ladder/pfsp_effective": 0}
    pool, table = _pool_and_table()
    mm = L.Matchmaker(0, 4)
    mm.plan(0, [0] * 4, pool, table)
    gate, run, members, t2, hist = gate_setup(champ_rate=0.5, pool_rate=0.7)
    d, _ = gate.evaluate("C", "K", members, t2, run, hist)
    m = L.ladder_metrics(table, pool, mm, d, gate_attempts=1)
    assert m["ladder/champion_id"] == "snap:v4" and m["ladder/champion_step"] == 4000
    assert m["ladder/rating/snap:v4"] == table.rating["snap:v4"] and m["ladder/rating/scripted:noop"] == 0.0
    hi = table.rating["snap:v4"] + 1.96 * table.se["snap:v4"]
    assert m["ladder/rating_ci95_hi/snap:v4"] == pytest.approx(hi)
    assert m["ladder/gate_failed_condition"] == "champion" and m["ladder/pfsp_learner_step"] == 4000
    assert m["ladder/paired_rho"] == pytest.approx(1.0)   # FakeRunner decides both sides of a seed alike
    gate, run, members, t2, hist = gate_setup(champ_rate=1.0, pool_rate=0.7)
    d, _ = gate.evaluate("C", "K", members, t2, run, hist)
    m = L.ladder_metrics(table, pool, mm, d, gate_attempts=1)
    assert "ladder/paired_rho" not in m and m["ladder/gate_failed_condition"] == ""   # rho undefined


def test_role_count_metrics_count_what_was_played_and_the_pool_fallback():
    mm = L.Matchmaker(master_seed=2, n_battles=96)
    ended = list(mm.plan(0, [0] * 96, L.Pool(), None).assignment)
    m = L.role_count_metrics(ended, mm.roles)
    assert m == {"ladder/role_counts/mirror": 48, "ladder/role_counts/pool": 0,
                 "ladder/role_counts/scripted": 48, "ladder/role_counts/pool_fallback": 34}


def test_rate_cli_on_an_empty_run_says_when_the_first_gate_is_due(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"ladder": {"candidate_every_env_steps": 2000000,
                                                                  "probe_every_iterations": 5}}))
    r = run_cli("rate", str(tmp_path))
    assert r.returncode == 1 and len(r.stdout.strip().splitlines()) == 1
    assert "first gate is due at env step 2,000,000, the first probe at iteration 5" in r.stdout


def test_a_player_with_no_losses_stays_finite_under_the_prior():
    g = [game("x", L.ANCHOR, 1.0, seed=k, side=L.SIDES[k % 2]) for k in range(50)]
    t = L.fit_ratings(g)
    assert t.converged and 300.0 < t.rating["x"] < 1500.0 and math.isfinite(t.se["x"])
    assert L.fit_ratings([]).rating == {L.ANCHOR: 0.0}


def test_gate_refuses_a_runner_that_returns_no_paired_seeds():
    gate, run, members, table, hist = gate_setup()
    with pytest.raises(ValueError, match=r"play\('C', 'K'\) returned no seed played from both sides"):
        gate.evaluate("C", "K", members, table, lambda a, b, n: [], hist)


def test_pfsp_stays_effective_with_a_candidate_admitted_since_the_last_refit():
    pool, table = _pool_and_table()
    pool.admit(L.PoolMember(id="snap:new", step=100), promote=False)
    mm = L.Matchmaker(master_seed=1, n_battles=8, cfg=L.MatchConfig(max_resident_opponents=6))
    mm.plan(0, [0] * 8, pool, table)
    assert mm.pfsp_effective == 1 and "snap:new" in mm.residents


def test_matchmaker_state_round_trips_through_json():
    pool, table = _pool_and_table()
    mm = L.Matchmaker(master_seed=9, n_battles=10)
    mm.plan(4, [2] * 10, pool, table)
    blob = msgspec.json.encode(mm.state())
    back = L.Matchmaker.from_state(msgspec.json.decode(blob, type=L.MatchmakerState))
    assert [back.assign(b, 7) for b in range(10)] == [mm.assign(b, 7) for b in range(10)]
    assert back.state() == mm.state()
    bad = msgspec.structs.replace(mm.state(), roles=[2] * 10)
    with pytest.raises(ValueError, match="stored roles of 10 battles differ"):
        L.Matchmaker.from_state(bad)


# --- 10. The evaluation runner: real RustEngine battles (design 7.1, 7.5, 7.9) ------------------------
# [M] a full untruncated battle between scripted players takes 0.10-0.16 s here and building an env
# about 0.35 s (docs/ladder.md section 10), so these tests play 2-4 seeds and stay fast.

import farm  # noqa: E402

FIXED_WALL = "2026-11-29T12:00:00Z"
TRAIN_ENV = farm.default_env_spec(max_steps=8)       # truncated like a test's training env


def legal_from_uniforms(obs, u):
    """A numpy stand-in for a network: plays a legal card with probability 0.1 (which one from
    the same uniform), else waits. Deterministic in (mask, u), so any difference in results
    between two runs is a difference in what the runner fed it."""
    mask = obs["action_mask"].astype(bool)
    out = np.zeros(len(u), np.int64)
    for i, x in enumerate(u):
        legal = np.flatnonzero(mask[i, 1:]) + 1
        if legal.size and x < 0.1:
            out[i] = legal[int(x / 0.1 * legal.size)]
    return out


class Recorder:
    """Wraps an act: remembers every call's batch size and uniforms."""

    def __init__(self, act=legal_from_uniforms):
        self.act, self.calls, self.first_obs = act, [], None

    def __call__(self, obs, u):
        self.calls.append(np.array(u))
        if self.first_obs is None:
            self.first_obs = {k: v.copy() for k, v in obs.items()}
        assert set(obs) >= {"spatial", "vector", "action_mask"} and obs["vector"].shape[0] == len(u)
        return self.act(obs, u)


def runner(run_dir=None, seeds=None, **kw):
    kw.setdefault("clock", lambda: FIXED_WALL)
    return L.EvalRunner(TRAIN_ENV, seeds or L.draw_eval_seeds(11, 6), run_dir=run_dir, run_id="r1", **kw)


def files_under(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in Path(d).rglob("*") if p.is_file()}


def test_eval_runner_plays_each_seed_from_both_sides_and_writes_only_the_result_log(tmp_path):
    L.load_or_create_eval_seeds(tmp_path, 11, 6)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "x.bin").write_bytes(b"untouched")
    before = files_under(tmp_path)
    with runner(tmp_path, battles_at_once=3) as r:
        assert r.env_factory_spec.truncation == [] and TRAIN_ENV.truncation     # design 7.5: untruncated
        games = r.play("scripted:random_legal", "scripted:noop", 6)
    assert [(g.seed_index, g.side_a) for g in games] == [(s, side) for s in range(3) for side in L.SIDES]
    assert {(g.a, g.b, g.kind, g.context, g.run_id, g.wall) for g in games} == {
        ("scripted:random_legal", "scripted:noop", "eval", r.context, "r1", FIXED_WALL)}
    ps = L.paired_scores(games, "scripted:random_legal", "scripted:noop")
    assert ps.seed_index == [0, 1, 2] and ps.unpaired == 0 and ps.n_battles == 6
    assert ps.mean == 1.0                        # [M] random_legal beat noop in every battle measured
    after = files_under(tmp_path)
    # no experience recorded: the log and its aggregate cache are the only new files, nothing changed
    assert set(after) - set(before) == {"ladder/games.jsonl", "ladder/aggregate.json"}
    assert all(after[k] == v for k, v in before.items())
    assert L.ResultLog(tmp_path).read().games == games
    assert r.closed and r.farm is None
    with pytest.raises(ValueError, match="after close"):
        r.play("scripted:random_legal", "scripted:noop", 2)


def test_eval_runner_feeds_each_seat_its_own_named_stream_and_plays_full_matches(tmp_path):
    seeds = L.draw_eval_seeds(11, 6)
    live, other = Recorder(), Recorder()
    with runner(None, seeds, battles_at_once=4) as r:
        r.register("learner@5", live)
        r.register("learner@6", other)
        r.play("learner@5", "learner@6", 4, comparison_id="cmp", kind="probe")
        # design 7.1: the runner's farm plays its next comparison, and is closed when one fails
        f = r.farm
        r.register("bad", lambda obs, u: np.ones(len(u), np.int64))    # a card in the deploy lockout
        with pytest.raises(ValueError, match=r"bad: illegal action 1 at eval/seed_set/0 seat blue"):
            r.play("bad", "scripted:noop", 4)
        assert f._closed and r.farm is None                              # closed on the error
        assert f.cfg.eval_plan[0].players[0] == "bad"    # after playing on it: replanned, not rebuilt
    first = live.calls[0]
    assert first.shape == (4,)                   # one batched forward over the four live battles
    # battle (seed, side_a): a sits on side_a, and its uniforms come from that seat's own stream
    want = [L.derive_generator(11, f"eval/match/cmp/{s}/{side}/seat/{side}").random()
            for s in (0, 1) for side in L.SIDES]
    assert first.tolist() == want
    # the pair of a seed starts from ONE position: blue's first observation in (s, blue), where a
    # is blue, equals blue's first observation in (s, red), where b is blue; seeds differ
    for key in live.first_obs:
        a_blue, b_blue = live.first_obs[key], other.first_obs[key]     # rows: (0,b) (0,r) (1,b) (1,r)
        assert np.array_equal(a_blue[0], b_blue[1]) and np.array_equal(a_blue[2], b_blue[3]), key
    assert not np.array_equal(live.first_obs["vector"][0], live.first_obs["vector"][2])
    # untruncated although the training env truncates at 8 decisions: a real match is longer
    assert sum(len(c) for c in live.calls) > 4 * 8 * 4
    for resolved in ("snap:x", "seed:x", "lookahead:defend"):
        with pytest.raises(ValueError, match="scripted:, lookahead:, snap: and seed: ids are resolved"):
            r.register(resolved, live)
    with pytest.raises(ValueError, match="unknown scripted player"):
        runner(None, seeds).play("scripted:nobody", "scripted:noop", 2)


def test_a_comparison_played_in_looks_is_the_whole_comparison_game_for_game():
    """EvalRunner.play(first_seed=, of=): a sequential gate's looks play the whole comparison's own
    seeds, comparison id and acting streams, so its games are the whole comparison's."""
    whole, looks = [], []
    with runner(None, battles_at_once=4) as r:
        whole = r.play("scripted:random_legal", "scripted:random", 4)
        looks = r.play("scripted:random_legal", "scripted:random", 2, of=4) + \
            r.play("scripted:random_legal", "scripted:random", 2, first_seed=1, of=4)
    assert msgspec.json.encode(looks) == msgspec.json.encode(whole)
    assert [g.seed_index for g in looks] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="from seed 5 needs an even count of at most 2 x 1"):
        runner(None).play("scripted:random_legal", "scripted:random", 4, first_seed=5, of=8)


@pytest.mark.slow
def test_eval_runner_replays_a_comparison_byte_for_byte_whatever_the_batching(tmp_path):
    out = []
    for at_once in (1, 4):
        with runner(None, battles_at_once=at_once) as r:
            r.register("learner@7", legal_from_uniforms)
            out.append(r.play("learner@7", "scripted:random", 4, comparison_id="det"))
    assert msgspec.json.encode(out[0]) == msgspec.json.encode(out[1])
    assert len(out[0]) == 4


def _save_snap(store, obs_digest, **kw):
    return store.save(tensors(), snap_spec(obs_digest=obs_digest, **kw))


def test_eval_runner_plays_snapshots_through_the_builder_and_refuses_mismatches_by_name(tmp_path):
    with runner(tmp_path, policy_builder=lambda sid: built.append(sid) or legal_from_uniforms) as r:
        built = []
        store = L.SnapshotStore(tmp_path)
        good = _save_snap(store, r.obs_digest, step=1)
        good2 = _save_snap(store, r.obs_digest, step=2, arch_digest="arch2")   # arch may differ
        games = r.play(f"snap:{good}", f"snap:{good2}", 2)
        assert len(games) == 2 and sorted(built) == sorted([good, good2])
        for field in ("codec_table_digest", "action_digest", "codec_version"):
            other = _save_snap(store, r.obs_digest, step=3,
                               **{field: 7 if field == "codec_version" else "zz"})
            with pytest.raises(L.SnapshotMismatch, match=rf"{good} vs snap:{other} refused: {field} differs"):
                r.play(f"snap:{good}", f"snap:{other}", 2)
        wrong_obs = _save_snap(store, "another-obs", step=4)
        with pytest.raises(L.SnapshotMismatch, match="obs_digest is another-obs but the evaluation env"):
            r.play(f"snap:{wrong_obs}", "scripted:noop", 2)
        stacked = _save_snap(store, r.obs_digest, step=5, frame_stack=2)
        with pytest.raises(L.SnapshotMismatch, match="frame_stack is 2"):
            r.play(f"snap:{stacked}", "scripted:noop", 2)
    # the refusals wrote nothing: only the one good comparison is in the log
    assert len(L.ResultLog(tmp_path).read().games) == 2


@pytest.mark.slow
def test_probe_writes_probe_rows_and_publishes_score_vs_each_rung(tmp_path):
    with runner(tmp_path) as r:
        games, m = L.run_probe(r, legal_from_uniforms, env_steps=12_345, probe_games=4, resamples=500)
        assert "learner@12345" not in r.policies               # a one-moment id, not kept
    assert len(games) == 8 and {g.kind for g in games} == {"probe"}
    assert {g.a for g in games} == {"learner@12345"} and {g.b for g in games} == set(L.PROBE_RUNGS)
    assert L.ResultLog(tmp_path).read().games == games
    for rung in L.PROBE_RUNGS:
        ps = L.paired_scores(games, "learner@12345", rung)
        assert m[f"ladder/score_vs/{rung}"] == ps.mean and m[f"ladder/score_vs_n/{rung}"] == 2
        assert m[f"ladder/score_vs_ci95_lo/{rung}"] <= ps.mean <= m[f"ladder/score_vs_ci95_hi/{rung}"]
    assert m["ladder/score_vs_noop"] == m["ladder/score_vs/scripted:noop"]
    assert m["time/probe"] > 0
    # the fit never reads probe rows (design 7.9)
    with pytest.raises(ValueError, match="reads kind='eval' only"):
        L.fit_ratings(games)


def run_cli_timed(*args, timeout=120):
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_eval_cli_without_torch_appends_games_and_rate_ranks_random_legal_above_noop(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"master_seed": 5, "ladder": {"eval_seed_count": 8}}))
    r = run_cli_timed("eval", "--run", str(tmp_path), "--a", "scripted:random_legal", "--b",
                      "scripted:noop", "--seeds", "2")
    assert r.returncode == 0, r.stderr
    assert "over 2 seeds (4 battles)" in r.stdout and "appended 4 kind=eval games" in r.stdout
    games = L.ResultLog(tmp_path).read().games
    assert len(games) == 4 and {g.kind for g in games} == {"eval"}
    assert L.load_or_create_eval_seeds(tmp_path, 5, 8).seeds == L.draw_eval_seeds(5, 8).seeds
    r = run_cli("rate", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = [line.split()[0] for line in r.stdout.splitlines()
            if line.startswith(("scripted:random_legal ", "scripted:noop "))]
    assert rows == ["scripted:random_legal", "scripted:noop"]   # sorted by rating, highest first
    # a snapshot is played by the script its spec names (ppo_clash.py for a shipped model), which needs
    # torch: without it, one line naming the script and what it could not import
    r = run_cli("eval", "--a", str(ROOT / "models" / "cpu-pointer"), "--b", "scripted:noop", "--seeds", "1",
                "--master-seed", "5")
    assert r.returncode == 2 and "playing a snapshot of ppo_clash.py needs what it imports" in r.stderr
    assert "torch" in r.stderr.splitlines()[-1] and "Traceback" not in r.stderr


def test_eval_and_yardstick_refuse_a_seed_count_they_cannot_play_in_one_line_before_any_battle(
        tmp_path, capsys):
    """--seeds below 1 (0 once meant the default) or above the run's frozen set (it was clipped
    to the set) is refused by name; a --master-seed set is drawn to the size asked."""
    (tmp_path / "config.json").write_text(json.dumps({"master_seed": 5, "ladder": {"eval_seed_count": 8}}))
    pair = ["--run", str(tmp_path), "--a", "scripted:random_legal", "--b", "scripted:noop"]
    for argv, want in ((["eval", *pair, "--seeds", "0"],
                        "--seeds 0: must be at least 1 (each seed is played from both sides)"),
                       (["eval", *pair, "--seeds", "9"], "--seeds 9: the run's frozen set holds 8 seeds "
                        "(ladder.eval_seed_count); pass at most 8, or --master-seed S, "
                        "which draws a set of any size"),
                       (["yardstick", "--snapshot", str(ROOT / "models" / "cpu-pointer"),
                         "--master-seed", "1", "--seeds", "-1"], "--seeds -1: must be at least 1")):
        assert L.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"ladder.py {argv[0]}: ") and want in err[-1], err
    assert not (tmp_path / "ladder" / "games.jsonl").exists()


# ladder.py run as the script __main__ (as `python ladder.py` runs it), then what the process holds.
# A snapshot makes the CLI load the script its spec names (ppo_clash.py for a shipped model), which
# does `import ladder`: that import must find the running module, not execute ladder.py a second
# time beside it.
ONE_COPY = ("import runpy, sys\n"
            "sys.argv = ['ladder.py'] + sys.argv[1:]\n"
            "try:\n"
            "    runpy.run_path('ladder.py', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    print('exit', e.code)\n"
            "assert 'ppo_clash' in sys.modules, 'the CLI did not load ppo_clash'\n"
            "import ppo_clash\n"
            "lad = sys.modules['ladder']\n"
            "copies = {m.EvalRunner for m in list(sys.modules.values())\n"
            "          if isinstance(getattr(m, 'EvalRunner', None), type)}\n"
            "print('name', lad.__name__, 'same', ppo_clash.ladder is lad,\n"
            "      'runner_module', ppo_clash.ladder.EvalRunner.__module__, 'copies', len(copies))\n")


@pytest.mark.slow
def test_the_cli_process_holds_one_ladder_module_when_it_imports_ppo_clash(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"master_seed": 5, "ladder": {"eval_seed_count": 2}}))
    r = subprocess.run([sys.executable, "-c", ONE_COPY, "eval", "--a", str(ROOT / "models" / "cpu-pointer"),
                        "--b", "scripted:noop", "--seeds", "1", "--master-seed", "5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # the shipped model was played (two battles), by ppo_clash.py loaded from beside ladder.py
    assert "exit 0" in r.stdout and "over 1 seeds (2 battles)" in r.stdout, r.stdout + r.stderr[-1000:]
    # the module ppo_clash imported IS the script: its classes were made once, by the __main__ run
    assert "name __main__ same True runner_module __main__ copies 1" in r.stdout, r.stdout


@pytest.mark.slow
def test_gate_cli_plays_every_condition_writes_its_decision_and_never_regates(tmp_path):
    """End to end on scripted players: the WilsonGate with the EvalRunner as its `play`."""
    cfg = {"master_seed": 3, "ladder": {"eval_seed_count": 4,
                                        "gate": {"champion_games": 4, "anchor_games": 4,
                                                 "bootstrap_resamples": 200}}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ("gate", "--run", str(tmp_path), "--candidate", "scripted:push", "--champion", "scripted:patient")
    r = run_cli_timed(*args)
    assert r.returncode == 0, r.stderr
    d = msgspec.json.decode((tmp_path / "ladder" / "gates" / "scripted_push.json").read_bytes(),
                            type=L.GateDecision)
    assert d.champion == "scripted:patient" and d.conditions["pool"].skipped
    assert d.conditions["champion"].n == 4
    games = L.ResultLog(tmp_path).read().games
    # 4 vs the champion, 4 per anchor, and the champion (no record) plays each anchor once: 20
    assert len(games) == 20 and {g.kind for g in games} == {"eval"}
    assert sum(1 for g in games if g.a == "scripted:patient") == 8
    assert f"gate scripted:push vs champion scripted:patient: {d.outcome}" in r.stdout
    r = run_cli_timed(*args)
    assert r.returncode == 2 and "already gated" in r.stderr
    assert len(L.ResultLog(tmp_path).read().games) == 20


def test_the_cli_reads_the_runs_eval_env_seed_set_and_pool_from_its_files(tmp_path):
    assert L.read_run_env(tmp_path)[0] == farm.default_env_spec()          # nothing written yet
    (tmp_path / "config.json").write_text(json.dumps(
        {"master_seed": 9, "obs": {"reveal": ["enemy_spell_aim"], "decision_ms": 250},
         "ladder": {"eval_seed_count": 6, "gate": {"champion_games": 12, "anchor_games": 4}}}))
    spec, where = L.read_run_env(tmp_path)
    assert spec.obs_builder.kwargs == {"reveal": {"cls": "royalegym.obs.Reveal",
                                                  "kwargs": {"enemy_spell_aim": True}}}
    assert spec.decision_ms == 250 and "config.json" in where
    assert L._gate_config(tmp_path) == L.GateConfig(champion_games=12, anchor_games=4)
    L.write_eval_env(tmp_path, farm.default_env_spec(max_steps=8))
    spec, where = L.read_run_env(tmp_path)
    assert spec.truncation == [] and where.endswith("eval_env.json")    # the file wins, untruncated
    s = L.read_run_seeds(tmp_path)                                     # drawn as the run draws it
    assert s == L.draw_eval_seeds(9, 6) and L.read_run_seeds(tmp_path) == s
    assert L.read_pool(tmp_path) is None
    pool = L.Pool()
    pool.admit(L.PoolMember(id="snap:a", step=5), promote=True)
    L.write_pool(tmp_path, pool)
    assert L.read_pool(tmp_path) == pool and L.read_pool(tmp_path).champion == "snap:a"


@pytest.mark.slow
def test_eval_runner_on_a_process_farm_gives_the_inline_farms_results_byte_for_byte(tmp_path):
    """design 7.1: with workers=2 the runner builds a ProcessFarm of two workers at its first
    comparison and plays the next one of the same geometry on it (replanned); the results equal
    the in-process farm's, byte for byte (a parent-acted player and a scripted one, so both paths
    through the farm are covered)."""
    out, stats, searched = [], [], []
    ahead = farm.canonical_player("lookahead:defend,h=2,c=defend+noop")
    for workers in (1, 2):
        with runner(None, battles_at_once=4, workers=workers) as r:
            r.register("learner@9", legal_from_uniforms)
            out.append(r.play("learner@9", "scripted:push", 6, comparison_id="farm-det"))
            first = r.farm
            out.append(r.play("scripted:random_legal", "scripted:patient", 4, comparison_id="farm-det2"))
            assert r.farm is first and not first._closed                 # 4 battles at once, both
            stats.append(r.farm_stats)
            out.append(r.play(ahead, "scripted:push", 2, comparison_id="farm-det3"))   # farm.py 6b
            searched.append(r.searched)
            assert r.last_farm == ("InlineFarm" if workers == 1 else "ProcessFarm")
            assert first._closed and r.farm is not first                 # 2 battles: another farm
        assert r.farm is None                                # closed with the runner
    assert msgspec.json.encode(out[:3]) == msgspec.json.encode(out[3:])
    assert [g.score_a for g in out[0]] and len(out[0]) == 6 and len(out[1]) == 4
    assert stats[1]["env_ms"] > 0 and stats[1]["bytes_out"] > 0
    assert searched[0] == searched[1] and \
        0 < searched[0]["lookahead_choices"] < searched[0]["lookahead_steps"]


# --- 11. The picture ------------------------------------------------------------------------------------

def planted_strength_run(run: Path) -> dict[str, str]:
    """A run directory as training leaves it: four snapshots (their ids' games simulated from
    TRUE's p1..p4), a champion chain, gate decisions, metric rows with probe keys."""
    store = L.SnapshotStore(run)
    ids = {}
    for k, p in enumerate(("p1", "p2", "p3", "p4")):
        sid = store.save({"w": np.full(2, k, np.float16)}, snap_spec(step=1000 * (k + 1)))
        ids[p] = L.snapshot_player_id(sid)
    true = {ids.get(p, p): v for p, v in TRUE.items() if p != "p5"}
    L.ResultLog(run).append(sim_games(np.random.default_rng(3), 20, true=true))
    pool = L.Pool()
    for k, p in enumerate(("p1", "p2", "p3", "p4")):
        pool.admit(L.PoolMember(ids[p], 1000 * (k + 1)), promote=p in ("p1", "p3"))
    L.write_pool(run, pool)
    cond = {"champion": L.ConditionResult(passed=False, n=8, observed=0.5, bound=0.3, reference=0.5)}
    for p, outcome in (("p2", "discard"), ("p3", "admit+promote"), ("p4", "admit-as-cycle")):
        L.write_gate_decision(run, L.GateDecision(
            candidate=ids[p], champion=ids["p1"], outcome=outcome, admit=outcome != "discard",
            promote=outcome == "admit+promote", cycle=outcome == "admit-as-cycle", failed=[], conditions=cond,
            eval_seed_set_sha="x", wall_seconds=1.0, wall="2026-12-01T00:00:00Z"))
    rows = [{"run/iteration": i, "run/cumulative_env_steps": 500 * i, "ppo/kl": 0.01 / i,
             "ppo/clip_fraction": 0.1, "ppo/entropy_normalised": 0.9, "ppo/explained_variance": 0.1 * i,
             "policy/cards_per_match": 10 + i,
             **{k: v for r in ("scripted:noop", "scripted:push") if i % 2 == 0 for k, v in (
                 (f"ladder/score_vs/{r}", 0.5), (f"ladder/score_vs_ci95_lo/{r}", 0.4),
                 (f"ladder/score_vs_ci95_hi/{r}", 0.6), (f"ladder/score_vs_n/{r}", 20))}}
            for i in range(1, 9)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ids


def pixels_near(path: Path, colour: str) -> int:
    """How many of the PNG's pixels lie within 0.1 of an '#rrggbb' colour in every channel."""
    import matplotlib.image
    import numpy as np
    rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255
    return int((np.abs(matplotlib.image.imread(path)[..., :3] - rgb).max(-1) < 0.1).sum())


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_plot_draws_the_strength_of_a_run_without_torch_and_writes_nothing_else(tmp_path):
    """matplotlib is the [plot] extra; `make test` installs it (pyproject's dev + plot)."""
    ids = planted_strength_run(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    r = run_cli("plot", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines() == [f"wrote {tmp_path / 'strength.png'}"]
    assert png_size(tmp_path / "strength.png") == (1260, 900)              # 14 x 10 inches at 90 dpi
    assert (tmp_path / "strength.png").stat().st_size > 30_000             # four panels' worth, not a blank
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != "strength.png"}
    assert after == before
    data = L.read_strength(tmp_path)
    assert data.steps[ids["p3"]] == 3000 and data.champions == [ids["p1"], ids["p3"]]
    assert data.gates == {ids["p2"]: "discard", ids["p3"]: "admit+promote", ids["p4"]: "admit-as-cycle"}
    assert data.table is not None and data.table.rating[ids["p4"]] > data.table.rating[ids["p1"]]
    r = run_cli("plot", str(tmp_path), "--out", str(tmp_path / "pics" / "s.png"))
    assert r.returncode == 0 and png_size(tmp_path / "pics" / "s.png") == (1260, 900)


@pytest.mark.slow
def test_plot_of_several_runs_draws_their_signals_in_one_picture_and_refuses_what_it_cannot_label(tmp_path):
    """The screens' comparison (docs/learning.md 3.2): one picture, named by --out, a line a run."""
    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    planted_strength_run(a)
    b.mkdir(parents=True)
    (b / "metrics.jsonl").write_text(json.dumps({"run/iteration": 1, "run/cumulative_env_steps": 10}) + "\n")
    out = tmp_path / "pics" / "cmp.png"
    r = run_cli("plot", str(a), str(b), "--labels", "S0", "S1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines() == [f"wrote {out}"]
    assert png_size(out) == (1260, 648)                                   # 14 x 7.2 inches at 90 dpi
    # the lines are there, not only the axes: run a's five signals in C0 (~1,000 pixels [M]) and
    # run b's legend handle in C1 (b has one row, so no line: ~26 pixels [M]); an empty grid has neither
    assert pixels_near(out, "#1f77b4") > 500 and pixels_near(out, "#ff7f0e") > 10
    assert not (a / "strength.png").exists() and not (b / "strength.png").exists()
    for argv, message in (
            ((str(a), str(b)),
             "2 runs are drawn into one picture, which belongs to none of them: name it with --out FILE.png"),
            ((str(a), str(b), "--out", str(out), "--labels", "S0"),
             "--labels: 1 labels for 2 runs (one each, in the runs' order)"),
            ((str(a), "--labels", "S0"),
             "--labels names the lines of several runs; one run's picture has none"),
            ((str(a), str(tmp_path / "nope"), "--out", str(out)),
             f"{tmp_path / 'nope'}: no such directory (pass a run directory, runs/<id>)"),
            ((),
             "name a run directory, runs/<id> (or several, to draw their learning signals side by side)")):
        r = run_cli("plot", *argv)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"ladder.py plot: {message}"], \
            (argv, r.stderr)


def test_a_signal_panel_keeps_each_run_in_its_colour_even_when_a_run_lacks_the_key():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [{"run/cumulative_env_steps": 10 * i, "ppo/kl": 0.1 * i} for i in range(1, 4)]
    fig, ax = plt.subplots()
    L._draw_signal(ax, "ppo/kl", "kl",
                   [("a", rows), ("b", [{"run/cumulative_env_steps": 5}]), ("c", rows[:2])], 9)
    assert [line.get_label() for line in ax.lines] == ["a", "b", "c"]
    assert [line.get_color() for line in ax.lines] == ["C0", "C1", "C2"]
    assert list(ax.lines[0].get_xdata()) == [10, 20, 30] and \
        list(ax.lines[0].get_ydata()) == [0.1, 0.2, 0.30000000000000004]
    assert len(ax.lines[1].get_xdata()) == 0 and list(ax.lines[2].get_xdata()) == [10, 20]
    plt.close(fig)


def test_rung_labels_a_few_elo_apart_are_stacked_and_a_rung_off_the_axis_is_named_not_drawn():
    """A real cpu run's top panel: four rungs within 18 Elo printed over each other, and noop at 0
    stretched the axis from the snapshots' 420-770 down to 0; level_labels places them."""
    levels = {"noop": 0.0, "random_legal": 536.7, "random": 595.5, "defend": 595.5, "patient": 604.2,
              "first-affordable": 613.0, "push": 675.3}
    on, off = L.level_labels(levels, 400.0, 800.0)
    assert off == [("noop", 0.0)]
    assert [n for n, _, _ in on] == ["random_legal", "defend", "random", "patient", "first-affordable",
                                     "push"]
    assert all(y == levels[n] for n, y, _ in on)                       # the lines stay at the ratings
    ys = [yl for _, _, yl in on]
    assert ys[0] == 536.7 and ys[-1] == 675.3                           # a label with room stays put
    assert all(b - a >= 0.035 * 400 - 1e-9 for a, b in zip(ys, ys[1:], strict=False))  # 14 Elo apart at least
    assert L.level_labels({}, 0.0, 1.0) == ([], [])


def test_the_rungs_and_the_seeds_are_levels_and_the_run_s_snapshots_are_not():
    games = sim_games(np.random.default_rng(5), 10, true={"scripted:noop": 0.0, "scripted:push": 300.0,
                                                           "seed:cpu-pointer": 450.0, "snap:ab": 400.0})
    t = L.fit_ratings(games)
    assert L.fixed_levels(t) == {"noop": 0.0, "push": t.rating["scripted:push"],
                                 "seed:cpu-pointer": t.rating["seed:cpu-pointer"]}


def test_plot_of_a_run_without_games_says_so_and_without_matplotlib_says_how_to_install_it(tmp_path):
    """A run with rows and no games is drawn and says so; a directory with neither (a mistyped
    path) or, among several runs, one without rows gets one line, exit 1 and no picture."""
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("plot", str(empty))
    assert r.returncode == 1 and r.stdout.strip().splitlines() == [
        f"{empty}: nothing to draw: no metric rows (metrics.jsonl; a run writes its first when "
        "iteration 1 ends) and no evaluation games"] and list(empty.iterdir()) == []
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"run/iteration": 1, "run/cumulative_env_steps": 10,
                                                         "ppo/kl": 0.01})
                                             + "\n" + '{"run/iteration": 2, "run/cumul')
    # a live run's unfinished row: left out
    assert [r["run/iteration"] for r in L.read_metric_rows(tmp_path)] == [1]
    r = run_cli("plot", str(tmp_path), str(empty), "--out", str(tmp_path / "both.png"))
    assert r.returncode == 1 and r.stdout.strip().splitlines() == [
        f"{empty}: nothing to draw: no metric rows (metrics.jsonl; a run writes its first when "
        "iteration 1 ends)"]
    assert not (tmp_path / "both.png").exists()
    r = run_cli("plot", str(tmp_path))
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 2 and \
        lines[0].startswith(f"{tmp_path}: no evaluation games yet")
    assert png_size(tmp_path / "strength.png") == (1260, 900)
    blocked = NO_TORCH.replace("name == 'torch' or name.startswith('torch.')",
                               "name.split('.')[0] in ('torch', 'matplotlib')")
    r = subprocess.run([sys.executable, "-c", blocked, "plot", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "ladder.py plot: plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)"]
    (tmp_path / "metrics.jsonl").write_text('{"run/iteration": 1\n'   # not the last line
                                            '{"run/iteration": 2}\n')
    r = run_cli("plot", str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and \
        f"ladder.py plot: {tmp_path / 'metrics.jsonl'}: line 1 is not a metric row" in r.stderr, r.stderr


def test_eval_of_snapshot_folders_refuses_what_it_cannot_compare_in_one_line(tmp_path, capsys):
    """ladder.py eval without a run: it needs --master-seed (no frozen set), a run's snap:<id>
    needs the run, a path that is not a snapshot folder is named, and two folders whose evaluation
    envs differ are refused (a comparison plays in one env). All before any battle."""
    folders = []
    for name, spec in (("m", "{}"), ("n", "{ }")):
        f = tmp_path / "models" / name
        f.mkdir(parents=True)
        (f / "spec.json").write_text(spec)
        (f / "actor.safetensors").write_bytes(b"")
        (f / "eval_env.json").write_text(f'{{"env": "{name}"}}')
        folders.append(str(f))
    for argv, want in ((["eval", "--a", folders[0], "--b", "scripted:push"],
                        "pass --run RUN (its players on its frozen seeds), "
                        "or --master-seed S with snapshot folders"),
                       (["eval", "--a", "snap:0123abcd", "--b", folders[0], "--master-seed", "1"],
                        "snap:0123abcd: a run's snapshot needs --run RUN; "
                        "without one, pass a snapshot folder"),
                       (["eval", "--a", str(tmp_path / "nope"), "--b", "scripted:push", "--master-seed", "1"],
                        "nope: not a snapshot folder (it needs spec.json and actor.safetensors)"),
                       (["eval", "--a", folders[0], "--b", folders[1], "--master-seed", "1"],
                        f"{folders[0]} and {folders[1]}: their eval_env.json differ")):
        assert L.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("ladder.py eval: ") and want in err and err.count("\n") == 1, err


def test_yardstick_refuses_what_it_cannot_measure_in_one_line(tmp_path, capsys):
    """ladder.py yardstick without a run: a snapshot folder needs --master-seed (no frozen set to
    use), a path that is not a snapshot folder is named, and nothing at all asks for --run."""
    folder = tmp_path / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "spec.json").write_text("{}")
    (folder / "actor.safetensors").write_bytes(b"")
    damaged = tmp_path / "models" / "damaged"      # a truncated spec.json hashes to a new id, so it is read
    shutil.copytree(folder, damaged)
    (damaged / "spec.json").write_text('{"step": 3')
    for argv, want in ((["yardstick", "--snapshot", str(folder)],
                        "without --run has no frozen seed set: pass --master-seed S"),
                       (["yardstick", "--snapshot", str(damaged), "--master-seed", "1"],
                        f"{damaged / 'spec.json'} is not a snapshot spec (Input data was truncated); "
                        "the folder is damaged"),
                       (["yardstick", "--snapshot", str(tmp_path / "nope"), "--master-seed", "1"],
                        "nope: not a snapshot folder (it needs spec.json and actor.safetensors)"),
                       (["yardstick"],
                        "pass --run RUN (its champion, or --snapshot snap:<id>) or --snapshot <folder>")):
        assert L.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("ladder.py yardstick: ") and want in err and err.count("\n") == 1, err
    store = L.SnapshotStore(None)
    sid = store.add_folder(damaged)
    for read in (store.spec, store.load):       # what eval, yardstick and play read a folder by
        with pytest.raises(L.SnapshotMismatch, match=re.escape(f"snapshot {sid}: {damaged / 'spec.json'} "
                                                               "is not a snapshot spec")):
            read(sid)


def test_yardstick_measures_a_lookahead_marks_it_privileged_and_counts_its_search(capsys):
    """farm.py section 6b: a lookahead is a yardstick subject (its canonical id), its rows say
    privileged and carry its search counters; --rungs picks the rungs, a snapshot is refused as
    one, and a scripted subject is never played against itself."""
    short = "lookahead:defend,h=2,c=defend+noop"
    assert L.main(["yardstick", "--snapshot", short, "--rungs", "scripted:noop", "--master-seed", "3",
                   "--seeds", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    (row,) = [json.loads(x) for x in out.splitlines()]
    assert row["snapshot"] == farm.canonical_player(short) and row["rung"] == "scripted:noop"
    assert row["privileged"] is True and row["battles"] == 2 and row["seconds"] > 0
    assert 0 < row["lookahead_choices"] < row["lookahead_steps"] <= 2 * 2 * row["lookahead_choices"]
    assert L.PRIVILEGED_NOTE in err
    line = L.yardstick_line(row, 1)
    assert "ms a searched choice" in line and line.endswith("[privileged]")
    others = [f"scripted:{n}" for n in farm.SCRIPTED_NAMES if n != "push"]
    assert L.yardstick_rungs((), "scripted:push") == others
    full = farm.canonical_player("lookahead:push")
    assert L.yardstick_rungs(("lookahead:push",), "scripted:push") == [full]
    for argv, want in ((["--rungs", str(ROOT / "models" / "cpu")], "a rung is scripted:<name> or lookahead:"),
                       (["--rungs", "lookahead:defend,h=0"], "h=0 must be a whole number"),
                       (["--snapshot", "scripted:nobody"], "unknown scripted player")):
        subject = ["--snapshot", short] if argv[0] != "--snapshot" else []
        argv = ["yardstick", "--master-seed", "3", *subject, *argv]
        assert L.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("ladder.py yardstick: ") and want in err and err.count("\n") == 1, err
    with L.EvalRunner(farm.default_env_spec(), L.draw_eval_seeds(3, 1)) as r, \
            pytest.raises(ValueError, match="by its canonical id"):
        r.play("lookahead:defend", "scripted:noop", 2)
