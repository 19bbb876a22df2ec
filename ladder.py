"""ladder.py -- the ladder: "is the new policy better?" as a claim with an error bar (design 7).

Stage owned: everything between a frozen snapshot and a decision about it, kept apart from
training (design 7.1). The result log every rated battle is appended to, the batch rating fitted
to that log (design 7.2), the matchmaker that lays the self-play mixture over the battles of an
iteration (design 7.3), the promotion gate (design 7.4) and the statistics it rests on (design
7.7), the paired evaluation that plays its battles (design 7.5), the content-addressed snapshot
store and hall-of-fame eviction (design 7.6), the ladder's metric keys (design 7.8, 9.2) and the
probe of the live policy (design 7.9).

Reads (all under runs/<id>/ladder/):
    games.jsonl                 the append-only result log (section 2), the source of truth
    eval_seeds.json             the frozen evaluation seed set (section 4)
    snapshots/<id>/             actor.safetensors (fp16) + spec.json (section 6)
    pool.json, eval_env.json    the pool as last admitted, the evaluation env (sections 7, 11)
Writes (same folder):
    games.jsonl, aggregate.json (a derived cache that always equals a rebuild of the log)
    gates/<candidate>.json      one GateDecision per candidate (section 5)
    ratings.json                the latest RatingTable (written by the trainer's refit)
    eval_seeds.json, snapshots/<id>/, pool.json, eval_env.json
`plot` writes one picture, runs/<id>/strength.png unless told otherwise (several runs: --out),
and nothing else.
Nothing is pickled: JSON (msgspec) and safetensors only. Never a checkpoint or a metric file.

Where to start reading: GameResult and ResultLog (section 2), the one record everything else
reads; then fit_ratings (section 3) and WilsonGate.evaluate (section 5), the two consumers of
that log; then EvalRunner.play (section 10), which produces it.

Evaluation (section 10) plays real RustEngine battles: EvalRunner(train_env_spec, seeds, ...)
strips the training env's truncation, builds its own farm at its first comparison (farm.py's
evaluation mode: InlineFarm, or a ProcessFarm of `workers` processes), replans it for the next
ones and closes it with the runner (a gate's, a probe's, a yardstick's), plays each frozen
seed from both sides and appends kind="eval" (or "probe") GameResults; it is the gate's
`play(a, b, n_battles) -> list[GameResult]`.
The training loop drives all of this through LadderLoop (section 12): the matchmaker's plan, the
gate on the candidate cadence, floor admits, refits and the probe.

Import rule: codec <- farm <- ladder. This module never imports torch, so
`python ladder.py rate runs/<id>` and a scripted-vs-scripted `eval` work on a machine without it
(tests/test_ladder.py runs them with torch made unimportable). A network is built by what the
caller passes in (policy_builder; LadderLoop's LearnerNets), never by an import of a script above
this one. The CLI plays a snap: player with the script its snapshot names as its builder
(ppo_clash.py, or a fork), loaded from beside this file as a plugin is (snapshot_builder).

CLI (section 13):
    python ladder.py rate runs/<id> [--context CTX]          the fitted table (torch-free)
    python ladder.py plot runs/<id> [--out FILE.png]         strength over training (section 11;
                                                             matplotlib, the [plot] extra)
    python ladder.py plot RUN RUN ... --out FILE.png [--labels A B ...]
                                                             several runs' learning signals
    python ladder.py eval --run runs/<id> --a ID --b ID [--seeds N]
                                                             a paired comparison, appended
    python ladder.py gate --run runs/<id> --candidate ID [--champion ID]
                                                             the WilsonGate, its decision file
    python ladder.py yardstick --run runs/<id> [--snapshot ID] [--seeds N] [--master-seed S] [--json]
    python ladder.py yardstick --snapshot models/<name> --master-seed S [--seeds N] [--json]
                                                             a snapshot (or a shipped snapshot
                                                             folder) against every scripted rung
"""

import collections
import dataclasses
import datetime
import functools
import hashlib
import importlib.util
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

# so ppo_clash's `import ladder` finds this module instead of running the file twice
if __name__ == "__main__":
    sys.modules["ladder"] = sys.modules[__name__]

import msgspec
import numpy as np
import tyro

import codec
import farm
from farm import (
    GROUP_LEARNER,
    GROUP_SCRIPTED,
    ROLE_MIRROR,
    ROLE_POOL,
    ROLE_SCRIPTED,
    Assignment,
    EnvFactorySpec,
    SlotPlan,
    derive_generator,
)

# --- 1. Names and constants ---------------------------------------------------------------------

ANCHOR = "scripted:noop"
"""The rating gauge (design 7.2, rater.anchor): pinned at 0 Elo. A scripted anchor exists from the
first game, before any snapshot does, and its strength never changes."""

GATE_ANCHORS = ("scripted:noop", "scripted:random_legal")
"""The gate's anchors (design 7.4, condition 2). They do not move with ladder.scripted_opponents."""

KINDS = ("eval", "train", "probe")
"""The three cuts of games.jsonl (design 7.6). Only "eval" is fitted: "train" is PFSP-selected
(biased towards hard matchups) and "probe" names a one-moment player (design 7.9)."""

SIDES = ("blue", "red")
SCORES = (0.0, 0.5, 1.0)

ELO_PER_NAT = 400.0 / math.log(10.0)
"""[A] q = 10 ** (r / 400) = exp(r * ln(10) / 400), so one nat of log-strength is 173.7 Elo."""
C = 1.0 / ELO_PER_NAT

PRIOR_SD = 400.0          # rater.prior_sd: weakly informative, keeps a player with no losses finite
MIN_DRAW_RATE = 0.02      # rater.draws falls back to "half_win" under this measured draw rate
RESIDUAL_MIN_GAMES = 30   # design 7.8: pairs with at least 30 games enter the residual
Z95 = 1.96
# a sequential gate's bound before its cap: a two-sided 99% one (sequential_settled), 2.576
Z_EARLY = statistics.NormalDist().inv_cdf(0.995)

ROLE_NAMES = {ROLE_MIRROR: "mirror", ROLE_POOL: "pool", ROLE_SCRIPTED: "scripted"}


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves the old file or the new one, never half of
    either: the parent folders are made, the bytes go to the sibling `<name>.partial`, are flushed
    and fsynced, and that file is renamed over `path` (os.replace, atomic on one filesystem).
    Every file the ladder writes goes through it; a writer that assembles a folder (a snapshot, a
    checkpoint) writes each file with it, then renames the folder into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_pretty(obj: Any) -> bytes:
    return msgspec.json.format(msgspec.json.encode(obj), indent=2) + b"\n"


def ladder_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "ladder"


# --- 2. The result log (design 7.6) ---------------------------------------------------------------
# One line per battle, appended and never rewritten. The aggregate table is a cache derived from
# it; the log is the truth. Draws are stored as draws (score 0.5), never folded into "wins":
# five wins and five losses and ten draws carry different variance (design 7.1).

class GameResult(msgspec.Struct, frozen=True):
    """One battle. score_a is a's score (1 win, 0.5 draw, 0 loss); side_a is the seat a held."""
    a: str
    b: str
    score_a: float
    seed_index: int          # index into the frozen eval seed set; -1 where none (train games)
    side_a: str              # "blue" | "red"
    context: str             # sha256(env, obs builder, deck protocol, engine build)[:16]
    kind: str                # "eval" | "train" | "probe"
    run_id: str
    iteration: int
    wall: str                # ISO-8601 UTC


def check_game(g: GameResult) -> None:
    """Refuse a malformed record before it reaches the log, naming the field."""
    if g.score_a not in SCORES:
        raise ValueError(f"GameResult.score_a={g.score_a!r} for {g.a} vs {g.b}: must be 0, 0.5 or 1")
    if g.side_a not in SIDES:
        raise ValueError(f"GameResult.side_a={g.side_a!r} for {g.a} vs {g.b}: must be blue or red")
    if g.kind not in KINDS:
        raise ValueError(f"GameResult.kind={g.kind!r} for {g.a} vs {g.b}: must be one of {KINDS}")
    if g.a == g.b:
        raise ValueError(f"GameResult.a == GameResult.b == {g.a!r}: a player cannot be rated against itself")
    if not g.context:
        raise ValueError(f"GameResult.context is empty for {g.a} vs {g.b}: every result names its context")


class Aggregate(msgspec.Struct):
    """The derived cache: per (context, kind, a, b) with a < b, [wins of a, draws, wins of b].
    `lines` is how many complete log lines it covers, so a stale cache is detected and rebuilt."""
    lines: int = 0
    cells: dict[str, list[int]] = {}


def _cell_key(g: GameResult) -> tuple[str, int]:
    """The canonical cell and which column a's score lands in (0 a wins, 1 draw, 2 b wins)."""
    lo, hi = (g.a, g.b) if g.a < g.b else (g.b, g.a)
    s = g.score_a if g.a == lo else 1.0 - g.score_a
    col = 0 if s == 1.0 else (1 if s == 0.5 else 2)
    return f"{g.context}\t{g.kind}\t{lo}\t{hi}", col


def rebuild_aggregate(games: Sequence[GameResult]) -> Aggregate:
    cells: dict[str, list[int]] = {}
    for g in games:
        key, col = _cell_key(g)
        cells.setdefault(key, [0, 0, 0])[col] += 1
    return Aggregate(lines=len(games), cells=dict(sorted(cells.items())))


def lock_file(f: Any, wait: bool = True) -> bool:
    """An exclusive advisory lock on an open file, held until it is closed: every writer of a run
    log takes it (ResultLog.append, a resume's cut), and the trainer holds a run's train.lock
    (ppo_clash.hold_run). With wait False, False when another open file holds it. fcntl is POSIX;
    where it is absent (Windows) a single writer per run is the caller's to keep."""
    try:
        import fcntl
    except ImportError:
        return True
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def read_log(path: Path, decode: Callable[[bytes], Any], what: str) -> tuple[list[Any], bytes]:
    """A run log's lines decoded, and its torn last line (b"" when the file ends with a newline).
    Logs are appended a line at a time, so a run killed mid-write, or one read while it trains,
    may end in an unfinished line: it is left out. A bad line anywhere else is corruption, refused
    by file and line number."""
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()
    out = []
    for lineno, line in enumerate(lines, 1):
        try:
            out.append(decode(line))
        except msgspec.DecodeError as e:
            raise ValueError(f"{path}: line {lineno} is not {what} ({e}); only the last line may be torn "
                             "(a crash's, or a live run's being written), so this is corruption: restore the "
                             "file from a copy") from None
    return out, tail


class LogRead(msgspec.Struct):
    games: list[GameResult]
    torn_tail: bytes | None    # the bytes of a torn last line, ignored; None when the log is clean


class ResultLog:
    """runs/<id>/ladder/games.jsonl and its aggregate.json cache.

    Writes are append + flush + os.fsync per batch, so a crash truncates at most the last line.
    The reader ignores (and reports) a last line without its newline; a bad line anywhere else is
    corruption and is refused by file and line number. Before appending, a torn tail is cut off,
    so a new record never glues onto half of an old one."""

    def __init__(self, run_dir: str | Path):
        self.dir = ladder_dir(run_dir)
        self.path = self.dir / "games.jsonl"
        self.aggregate_path = self.dir / "aggregate.json"
        self.last_repair: bytes | None = None

    def read(self) -> LogRead:
        if not self.path.exists():
            return LogRead(games=[], torn_tail=None)
        games, tail = read_log(self.path, msgspec.json.Decoder(GameResult).decode, "a GameResult")
        return LogRead(games=games, torn_tail=tail if tail else None)

    def _cut_torn_tail(self) -> None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with open(self.path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) == b"\n":
                return
            f.seek(0)
            data = f.read()
            keep = data.rfind(b"\n") + 1
            self.last_repair = data[keep:]
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())

    def append(self, games: Sequence[GameResult]) -> None:
        """Append one batch: validate all, write all, flush, fsync once, then update the cache.
        The whole append holds an exclusive lock on games.jsonl (flock, where the OS has it),
        because `ladder.py eval|gate` append to the log of a run that is training: two writers
        must not interleave a tail repair, a batch or a cache rewrite."""
        for g in games:
            check_game(g)
        if not games:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        enc = msgspec.json.Encoder()
        payload = b"".join(enc.encode(g) + b"\n" for g in games)
        with open(self.path, "ab") as f:
            lock_file(f)
            self._cut_torn_tail()
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
            # The cache: increment when it covers exactly the lines before this batch, else
            # rebuild (a crash between the log write and the cache write leaves it a batch behind).
            agg = self._load_cache()
            n_before = self._count_lines() - len(games)
            if agg is None or agg.lines != n_before:
                agg = rebuild_aggregate(self.read().games)
            else:
                for g in games:
                    key, col = _cell_key(g)
                    agg.cells.setdefault(key, [0, 0, 0])[col] += 1
                agg.cells = dict(sorted(agg.cells.items()))
                agg.lines += len(games)
            write_atomic(self.aggregate_path, msgspec.json.encode(agg))
            # the lock is released when f closes

    def rebuild_cache(self) -> None:
        """Rewrite ladder/aggregate.json from the log, under the writers' lock (a resume's cut)."""
        if not self.path.exists():
            return
        with open(self.path, "ab") as f:
            lock_file(f)
            write_atomic(self.aggregate_path, msgspec.json.encode(rebuild_aggregate(self.read().games)))

    def _count_lines(self) -> int:
        return self.path.read_bytes().count(b"\n") if self.path.exists() else 0

    def _load_cache(self) -> Aggregate | None:
        if not self.aggregate_path.exists():
            return None
        try:
            return msgspec.json.decode(self.aggregate_path.read_bytes(), type=Aggregate)
        except msgspec.DecodeError:
            return None

    def aggregate(self) -> Aggregate:
        """The cache if it covers the whole log, else a rebuild (never a stale table)."""
        agg = self._load_cache()
        if agg is not None and agg.lines == self._count_lines():
            return agg
        return rebuild_aggregate(self.read().games)


def contexts_of(games: Sequence[GameResult]) -> list[str]:
    return sorted({g.context for g in games})


def eval_view(games: Sequence[GameResult], context: str | None = None,
              kind: str = "eval") -> tuple[str | None, list[GameResult]]:
    """The games of one kind in ONE context. Contexts are never pooled (design 7.6): a policy shown
    the opponent's hand and one that was not are different kinds of player. With context=None the
    view must hold a single context, else this refuses and names them."""
    games = [g for g in games if g.kind == kind]
    ctxs = contexts_of(games)
    if context is None:
        if len(ctxs) > 1:
            raise ValueError(f"the {kind} games hold {len(ctxs)} contexts {ctxs}: results from different "
                             f"contexts are never pooled; choose one (rate --context CTX)")
        return (ctxs[0] if ctxs else None), games
    return context, [g for g in games if g.context == context]


# --- 3. Rating: Bradley-Terry-Davidson, MAP, Newton (design 7.2, 7.8) ----------------------------
# With d = (r_i - r_j) / 173.7 and nu the draw parameter, the Davidson model reads
#     P(i wins) = e^(d/2) / D,   P(draw) = nu / D,   P(j wins) = e^(-d/2) / D,
#     D = e^(d/2) + e^(-d/2) + nu,
# which is design 7.2's q-form divided through by sqrt(q_i q_j). log D is a log-sum-exp of linear
# functions of (d, log nu), so the negative log-likelihood is convex in (ratings, log nu) and the
# prior adds a positive diagonal: Newton with a backtracking line search converges from zero.
# The games enter only through integer counts per sorted pair, which is why the fit is a pure
# function of the multiset of games: the same games in any order give bit-identical numbers.

class PairCounts(msgspec.Struct):
    ids: list[str]            # sorted
    i: list[int]              # index of the lower id of each pair
    j: list[int]
    wins_i: list[int]
    draws: list[int]
    wins_j: list[int]


def pair_counts(games: Sequence[GameResult], anchor: str = ANCHOR) -> PairCounts:
    ids = sorted({g.a for g in games} | {g.b for g in games} | {anchor})
    index = {p: k for k, p in enumerate(ids)}
    cells: dict[tuple[int, int], list[int]] = {}
    for g in games:
        key, col = _cell_key(g)
        _, _, lo, hi = key.split("\t")
        cells.setdefault((index[lo], index[hi]), [0, 0, 0])[col] += 1
    keys = sorted(cells)
    return PairCounts(ids=ids, i=[k[0] for k in keys], j=[k[1] for k in keys],
                      wins_i=[cells[k][0] for k in keys], draws=[cells[k][1] for k in keys],
                      wins_j=[cells[k][2] for k in keys])


class RatingTable(msgspec.Struct, frozen=True):
    """A fit's output (design 7.2 RatingTable, plus what the dashboard and gate read)."""
    rating: dict[str, float]          # Elo, anchor at exactly 0
    se: dict[str, float]              # sqrt of the inverse observed Fisher information's diagonal
    anchor: str
    draws: str                        # "davidson" | "half_win": the model actually fitted
    draw_fallback: bool               # davidson was asked for, the draw rate was under 2%
    draw_nu: float | None             # Davidson's nu; None under half_win
    draw_rate: float
    n_games: dict[str, int]
    n_total: int
    transitivity_residual: float | None   # None when no pair has RESIDUAL_MIN_GAMES games
    residual_pairs: int
    converged: bool
    iterations: int
    context: str | None
    ids: list[str]                    # row/column order of cov
    cov: list[list[float]]            # Elo^2; the anchor's row and column are 0

    def se_diff(self, a: str, b: str) -> float:
        """SE of r_a - r_b from the 2x2 block of the covariance, never the two marginals summed."""
        k = {p: n for n, p in enumerate(self.ids)}
        ia, ib = k[a], k[b]
        v = self.cov[ia][ia] + self.cov[ib][ib] - 2.0 * self.cov[ia][ib]
        return math.sqrt(max(v, 0.0))

    def predict(self, a: str, b: str) -> float:
        """P(a scores against b), a draw counting 0.5, from the fitted model."""
        for p in (a, b):
            if p not in self.rating:
                raise KeyError(f"{p!r} is not in the fitted rating table (context {self.context}): "
                               f"it has no eval games yet; refit after it has played")
        return float(_outcome_probs((self.rating[a] - self.rating[b]) * C, self.draw_nu)[3])


def _outcome_probs(d: float | np.ndarray, nu: float | None):
    """(P win, P draw, P loss, expected score) for log-strength difference d."""
    if nu is None:
        pw = 1.0 / (1.0 + np.exp(-d))
        return pw, 0.0 * pw, 1.0 - pw, pw
    eta = math.log(nu)
    log_d = np.logaddexp(np.logaddexp(d / 2.0, -d / 2.0), eta)
    pw, pl, pd = np.exp(d / 2.0 - log_d), np.exp(-d / 2.0 - log_d), np.exp(eta - log_d)
    return pw, pd, pl, pw + pd / 2.0


def _nll_terms(x: np.ndarray, free: np.ndarray, n_ids: int, pc: dict[str, np.ndarray],
               davidson: bool, prior_sd: float):
    """Negative log-posterior, its gradient and Hessian over the free parameters
    (the non-anchor ratings in Elo, then log nu under Davidson)."""
    F = len(free)
    r = np.zeros(n_ids)
    r[free] = x[:F]
    Is, J, W, T, L = pc["i"], pc["j"], pc["w"], pc["t"], pc["l"]
    N = W + T + L
    d = (r[Is] - r[J]) * C
    if davidson:
        eta = x[F]
        log_d = np.logaddexp(np.logaddexp(d / 2.0, -d / 2.0), eta)
        pw, pl, pd = np.exp(d / 2.0 - log_d), np.exp(-d / 2.0 - log_d), np.exp(eta - log_d)
        nll = -np.sum((W - L) * d / 2.0 + T * eta - N * log_d)
        g_d = -(W - L) / 2.0 + N * (pw - pl) / 2.0
        g_e = np.sum(-T + N * pd)
        h_dd = N * ((pw + pl) / 4.0 - (pw - pl) ** 2 / 4.0)
        h_de = -N * pd * (pw - pl) / 2.0
        h_ee = np.sum(N * (pd - pd * pd))
    else:
        S = W + T / 2.0
        log_p, log_q = -np.logaddexp(0.0, -d), -np.logaddexp(0.0, d)
        p = np.exp(log_p)
        nll = -np.sum(S * log_p + (N - S) * log_q)
        g_d = N * p - S
        h_dd = N * p * (1.0 - p)
    # Chain rule to the full rating vector: dd/dr_i = C, dd/dr_j = -C.
    g = np.zeros(n_ids)
    np.add.at(g, Is, C * g_d)
    np.add.at(g, J, -C * g_d)
    H = np.zeros((n_ids, n_ids))
    np.add.at(H, (Is, Is), C * C * h_dd)
    np.add.at(H, (J, J), C * C * h_dd)
    np.add.at(H, (Is, J), -C * C * h_dd)
    np.add.at(H, (J, Is), -C * C * h_dd)
    rf = x[:F]
    nll += np.sum(rf * rf) / (2.0 * prior_sd ** 2)
    n_par = F + (1 if davidson else 0)
    G = np.zeros(n_par)
    G[:F] = g[free] + rf / prior_sd ** 2
    Hf = np.zeros((n_par, n_par))
    Hf[:F, :F] = H[np.ix_(free, free)] + np.eye(F) / prior_sd ** 2
    if davidson:
        he = np.zeros(n_ids)
        np.add.at(he, Is, C * h_de)
        np.add.at(he, J, -C * h_de)
        G[F] = g_e
        Hf[:F, F] = Hf[F, :F] = he[free]
        Hf[F, F] = h_ee
    return float(nll), G, Hf


def fit_pair_counts(pc: PairCounts, anchor: str = ANCHOR, prior_sd: float = PRIOR_SD,
                    draws: str = "davidson", context: str | None = None,
                    max_iter: int = 100, tol_elo: float = 1e-7) -> RatingTable:
    """The MAP fit. `draws` is the configured rater.draws; under MIN_DRAW_RATE measured draws a
    Davidson request falls back to half_win and the table records that it did."""
    if draws not in ("davidson", "half_win"):
        raise ValueError(f"rater.draws={draws!r}: must be 'davidson' or 'half_win'")
    ids = pc.ids
    n_ids = len(ids)
    arr = {"i": np.asarray(pc.i, dtype=np.int64), "j": np.asarray(pc.j, dtype=np.int64),
           "w": np.asarray(pc.wins_i, dtype=np.float64), "t": np.asarray(pc.draws, dtype=np.float64),
           "l": np.asarray(pc.wins_j, dtype=np.float64)}
    n_total = int(arr["w"].sum() + arr["t"].sum() + arr["l"].sum())
    draw_rate = float(arr["t"].sum() / n_total) if n_total else 0.0
    fallback = draws == "davidson" and draw_rate < MIN_DRAW_RATE
    davidson = draws == "davidson" and not fallback
    free = np.array([k for k, p in enumerate(ids) if p != anchor], dtype=np.int64)
    F = len(free)
    x = np.zeros(F + (1 if davidson else 0))
    if davidson:
        x[F] = math.log(2.0 * draw_rate / (1.0 - draw_rate))   # nu at equal strengths [A]
    converged, it = False, 0
    nll, G, H = _nll_terms(x, free, n_ids, arr, davidson, prior_sd)
    for it in range(1, max_iter + 1):   # noqa: B007 (it is read after the loop: iterations=it)
        step = np.linalg.solve(H, G)
        t = 1.0
        while True:   # backtracking: Newton from zero can overshoot on lopsided records
            x_new = x - t * step
            nll_new, G_new, H_new = _nll_terms(x_new, free, n_ids, arr, davidson, prior_sd)
            if nll_new <= nll + 1e-12 * abs(nll) or t < 1e-6:
                break
            t *= 0.5
        x, nll, G, H = x_new, nll_new, G_new, H_new
        if np.max(np.abs(t * step), initial=0.0) < tol_elo:
            converged = True
            break
    cov_f = np.linalg.inv(H)
    cov = np.zeros((n_ids, n_ids))
    cov[np.ix_(free, free)] = cov_f[:F, :F]
    rating = {p: 0.0 for p in ids}
    for k, idx in enumerate(free):
        rating[ids[idx]] = float(x[k])
    se = {p: float(math.sqrt(max(cov[k, k], 0.0))) for k, p in enumerate(ids)}
    n_games = {p: 0 for p in ids}
    for i, j, w, t_, l_ in zip(pc.i, pc.j, pc.wins_i, pc.draws, pc.wins_j, strict=True):
        n_games[ids[i]] += w + t_ + l_
        n_games[ids[j]] += w + t_ + l_
    table = RatingTable(
        rating=rating, se=se, anchor=anchor, draws="davidson" if davidson else "half_win",
        draw_fallback=fallback, draw_nu=float(math.exp(x[F])) if davidson else None,
        draw_rate=draw_rate, n_games=n_games, n_total=n_total, transitivity_residual=None,
        residual_pairs=0, converged=converged, iterations=it, context=context, ids=list(ids),
        cov=cov.tolist())
    resid, n_pairs = transitivity_residual(table, pc)
    return msgspec.structs.replace(table, transitivity_residual=resid, residual_pairs=n_pairs)


def fit_ratings(games: Sequence[GameResult], anchor: str = ANCHOR, prior_sd: float = PRIOR_SD,
                draws: str = "davidson") -> RatingTable:
    """The authoritative rating (design 7.2): a pure function of a ONE-context set of eval games."""
    ctxs = contexts_of(games)
    if len(ctxs) > 1:
        raise ValueError(f"fit_ratings got games from {len(ctxs)} contexts {ctxs}: contexts are never "
                         f"pooled; filter with eval_view(games, context)")
    kinds = sorted({g.kind for g in games} - {"eval"})
    if kinds:
        raise ValueError(f"fit_ratings got {kinds} games: the fit reads kind='eval' only (design 7.5, "
                         f"11.9); filter with eval_view")
    return fit_pair_counts(pair_counts(games, anchor), anchor, prior_sd, draws,
                           context=ctxs[0] if ctxs else None)


def transitivity_residual(table: RatingTable, pc: PairCounts) -> tuple[float | None, int]:
    """Design 7.8: the fraction of head-to-head pairs with >= 30 games whose observed score rate
    contradicts the fit by more than two standard errors. The SE combines the pair's sampling
    SE under the model and the fit's own SE of the prediction (delta method on the 2x2 block).
    Above ~10% a scalar rating is not a meaningful summary of the population."""
    k = {p: n for n, p in enumerate(table.ids)}
    order = np.array([k[p] for p in pc.ids], dtype=np.int64)       # pc's ids in the table's order
    r = np.array([table.rating[p] for p in pc.ids])
    cov = np.asarray(table.cov)[np.ix_(order, order)]
    Is, J = np.asarray(pc.i, dtype=np.int64), np.asarray(pc.j, dtype=np.int64)
    W, T, Lo = (np.asarray(v, dtype=np.float64) for v in (pc.wins_i, pc.draws, pc.wins_j))
    N = W + T + Lo
    sel = N >= RESIDUAL_MIN_GAMES
    if not sel.any():
        return None, 0
    Is, J, W, T, N = Is[sel], J[sel], W[sel], T[sel], N[sel]
    pw, pd, pl, p = _outcome_probs((r[Is] - r[J]) * C, table.draw_nu)
    var_game = pw + pd / 4.0 - p * p
    slope = p * (1.0 - p) if table.draw_nu is None else pw / 2.0 - (pw - pl) / 2.0 * p
    var_diff = np.maximum(cov[Is, Is] + cov[J, J] - 2.0 * cov[Is, J], 0.0)
    se = np.sqrt(var_game / N + (slope * C) ** 2 * var_diff)
    bad = int(np.sum(np.abs((W + T / 2.0) / N - p) > 2.0 * se))
    return float(bad / len(N)), int(len(N))


class EloReadout:
    """Layer 1 (design 7.2): zero-sum logistic Elo at k = 32 for the dashboard between refits.
    Order-dependent and never the gate."""

    def __init__(self, k_factor: float = 32.0):
        self.k = k_factor
        self.rating: dict[str, float] = {}

    def update(self, a: str, b: str, score_a: float) -> None:
        ra, rb = self.rating.get(a, 0.0), self.rating.get(b, 0.0)
        expected = 1.0 / (1.0 + 10.0 ** ((rb - ra) / 400.0))
        delta = self.k * (score_a - expected)
        self.rating[a], self.rating[b] = ra + delta, rb - delta


def write_ratings(run_dir: str | Path, table: RatingTable) -> Path:
    path = ladder_dir(run_dir) / "ratings.json"
    write_atomic(path, _json_pretty(table))
    return path


# --- 4. The statistics: Wilson, paired scores, bootstrap, rho (design 7.5, 7.7) -------------------

def wilson_interval(p_hat: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval, design 7.7's formula. 55.2% at n = 1000 gives 0.521 (clears 0.52)."""
    if n <= 0:
        raise ValueError(f"wilson_interval: n={n}, needs at least one battle")
    centre = (p_hat + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p_hat * (1 - p_hat) / n + z * z / (4 * n * n))
    return centre - half, centre + half


class PairedScores(msgspec.Struct):
    """a's per-seed scores against b. x_s = (score as blue + score as red) / 2, in
    {0, .25, .5, .75, 1}: the seed, not the battle, is the unit (design 7.5)."""
    a: str
    b: str
    seed_index: list[int]
    blue: list[float]
    red: list[float]
    x: list[float]
    unpaired: int             # seeds played from one side only; excluded

    @property
    def n_battles(self) -> int:
        return 2 * len(self.x)

    @property
    def mean(self) -> float:
        return float(np.mean(self.x)) if self.x else float("nan")


def paired_scores(games: Sequence[GameResult], a: str, b: str) -> PairedScores:
    """Collapse the games between a and b (recorded either way round) to per-seed pairs.
    Repeated battles of one (seed, side) are averaged."""
    acc: dict[int, dict[str, list[float]]] = {}
    for g in games:
        if {g.a, g.b} != {a, b} or g.seed_index < 0:
            continue
        if g.a == a:
            s, side = g.score_a, g.side_a
        else:
            s, side = 1.0 - g.score_a, ("red" if g.side_a == "blue" else "blue")
        acc.setdefault(g.seed_index, {"blue": [], "red": []})[side].append(s)
    seeds, blue, red, unpaired = [], [], [], 0
    for k in sorted(acc):
        if acc[k]["blue"] and acc[k]["red"]:
            seeds.append(k)
            blue.append(float(np.mean(acc[k]["blue"])))
            red.append(float(np.mean(acc[k]["red"])))
        else:
            unpaired += 1
    return PairedScores(a=a, b=b, seed_index=seeds, blue=blue, red=red,
                        x=[(u + v) / 2.0 for u, v in zip(blue, red, strict=True)], unpaired=unpaired)


def bootstrap_interval(x: Sequence[float], master_seed: int, comparison_id: str,
                       resamples: int = 10_000, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap of the mean over seeds, from eval/bootstrap/{comparison_id}."""
    xs = np.asarray(x, dtype=np.float64)
    if xs.size == 0:
        raise ValueError(f"bootstrap_interval({comparison_id}): no paired seeds")
    rng = derive_generator(master_seed, f"eval/bootstrap/{comparison_id}")
    means = np.empty(resamples)
    chunk = max(1, 2_000_000 // xs.size)     # bound memory to ~16 MB of indices at a time
    for s in range(0, resamples, chunk):
        k = min(chunk, resamples - s)
        means[s:s + k] = xs[rng.integers(0, xs.size, size=(k, xs.size))].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def paired_rho(ps: PairedScores) -> float | None:
    """Correlation across seeds between a's score as blue and as red. None when undefined (every
    seed decided one way on a side): 0.0 would read as 'uncorrelated' (design 7.5)."""
    if len(ps.x) < 2:
        return None
    u, v = np.asarray(ps.blue), np.asarray(ps.red)
    if u.std() == 0.0 or v.std() == 0.0:
        return None
    return float(np.corrcoef(u, v)[0, 1])


class EvalSeedSet(msgspec.Struct, frozen=True):
    """The fixed evaluation seed set, drawn once at run start and reused forever (design 7.5)."""
    master_seed: int
    path: str
    seeds: list[int]
    sha256: str


def _seed_sha(seeds: Sequence[int]) -> str:
    return hashlib.sha256(msgspec.json.encode(list(seeds))).hexdigest()


def draw_eval_seeds(master_seed: int, count: int) -> EvalSeedSet:
    rng = derive_generator(master_seed, "eval/seed_set")
    seeds = [int(s) for s in rng.integers(0, 2 ** 63 - 1, size=count, dtype=np.int64)]
    return EvalSeedSet(master_seed=master_seed, path="eval/seed_set", seeds=seeds, sha256=_seed_sha(seeds))


def load_or_create_eval_seeds(run_dir: str | Path, master_seed: int, count: int) -> EvalSeedSet:
    """ladder/eval_seeds.json: written on first call; later calls load it and verify its hash."""
    path = ladder_dir(run_dir) / "eval_seeds.json"
    if path.exists():
        s = msgspec.json.decode(path.read_bytes(), type=EvalSeedSet)
        if _seed_sha(s.seeds) != s.sha256:
            raise ValueError(f"{path}: sha256 does not match its seeds; the frozen set was edited")
        if s.master_seed != master_seed or len(s.seeds) != count:
            raise ValueError(f"{path}: holds master_seed={s.master_seed}, count={len(s.seeds)}, the run "
                             f"asks for master_seed={master_seed}, count={count}: the set is frozen per run")
        return s
    s = draw_eval_seeds(master_seed, count)
    write_atomic(path, _json_pretty(s))
    return s


def comparison_seed_indices(seeds: EvalSeedSet, n_battles: int, first: int = 0) -> list[int]:
    """The seeds a comparison of n_battles plays: the FIRST n_battles / 2 of the frozen set, each
    from both sides, so every comparison of a size plays the same start states (design 7.5, 7.9);
    from seed `first` for a sequential gate's later look."""
    if n_battles % 2 or first + n_battles // 2 > len(seeds.seeds) or n_battles <= 0:
        raise ValueError(f"a comparison of {n_battles} battles from seed {first} needs an even count of at "
                         f"most 2 x {len(seeds.seeds) - first} (ladder.eval_seed_count); got {n_battles}")
    return list(range(first, first + n_battles // 2))


def eval_match_path(comparison_id: str, seed_index: int, side: str) -> str:
    """The name of one evaluation battle's acting stream (design 2.2): eval/match/{cid}/{s}/{side}."""
    return f"eval/match/{comparison_id}/{seed_index}/{side}"


def probe_metrics(games: Sequence[GameResult], learner_id: str, rung: str, master_seed: int,
                  resamples: int = 10_000) -> dict[str, float | int]:
    """Design 7.9's publication for one rung: ladder/score_vs/<rung>, its n in SEEDS (the two
    battles of a seed are correlated) and the 95% bootstrap interval over seeds. The two anchors'
    means also go under ladder/score_vs_noop and ladder/score_vs_random_legal, the short keys the
    metric list names (design 9.2). Nothing for a rung with no paired seeds."""
    ps = paired_scores(games, learner_id, rung)
    if not ps.x:
        return {}
    lo, hi = bootstrap_interval(ps.x, master_seed, f"probe/{learner_id}/vs/{rung}", resamples)
    out: dict[str, float | int] = {
        f"ladder/score_vs/{rung}": ps.mean, f"ladder/score_vs_n/{rung}": len(ps.x),
        f"ladder/score_vs_ci95_lo/{rung}": lo, f"ladder/score_vs_ci95_hi/{rung}": hi}
    if rung in ("scripted:noop", "scripted:random_legal"):
        out[f"ladder/score_vs_{rung.removeprefix('scripted:')}"] = ps.mean
    return out


# --- 5. The gate (design 7.4, 7.7) -------------------------------------------------------------------

class GateConfig(msgspec.Struct, frozen=True):
    champion_games: int = 1000        # 500 seeds x 2 sides
    champion_lower_bound: float = 0.52
    anchor_games: int = 200
    anchor_tolerance_pp: float = 2.0
    stratified_snapshots: int = 8
    stratified_games: int = 100
    bootstrap_resamples: int = 10_000
    anchors: tuple[str, ...] = GATE_ANCHORS
    sequential_battles: int = 0       # > 0: condition (1) in looks of this many battles (design 7.4)


class ConditionResult(msgspec.Struct):
    passed: bool
    n: int                            # battles
    observed: float | None            # None only on a SKIPPED condition (JSON has no NaN)
    bound: float | None
    reference: float | None
    skipped: bool = False
    reason: str = ""
    ci95_lo: float | None = None      # bootstrap over seeds
    ci95_hi: float | None = None
    paired_rho: float | None = None
    members: list[str] = []           # condition 3: the stratified sample


class GateDecision(msgspec.Struct):
    candidate: str
    champion: str
    outcome: str                      # "admit+promote" | "admit-as-cycle" | "discard"
    admit: bool
    promote: bool
    cycle: bool
    failed: list[str]                 # names of failed conditions, in order
    conditions: dict[str, ConditionResult]
    eval_seed_set_sha: str
    wall_seconds: float
    wall: str


PlayFn = Callable[..., list[GameResult]]
"""play(a, b, n_battles): the evaluation runner, injected. It plays n_battles / 2 seeds of the
frozen set from both sides, records nothing for training, and returns the games. EvalRunner is
one, and it has already appended them to games.jsonl: do not append evaluate()'s `played` again.
A sequential gate (GateConfig.sequential_battles) also passes first_seed=s, of=N: those battles of
the comparison of N from seed s, the same games the whole comparison plays there."""


def merge_paired(p: PairedScores, q: PairedScores) -> PairedScores:
    """Two looks of one comparison (other seeds) as one."""
    return PairedScores(a=p.a, b=p.b, seed_index=p.seed_index + q.seed_index, blue=p.blue + q.blue,
                        red=p.red + q.red, x=p.x + q.x, unpaired=p.unpaired + q.unpaired)


def sequential_settled(mean: float, n: int, total: int, bar: float) -> bool | None:
    """A sequential gate's look at condition (1) after n of total battles scoring `mean`: True once
    the Wilson lower bound clears the bar, a 99% bound before the cap (Z_EARLY: looking often at a
    95% one would promote an equal candidate 2.2% of the time, not the fixed design's 0.3% [M,
    docs/ladder.md section 4]); False once the bar is out of reach, the battles left scored even at
    the 95% upper bound of the rate so far leaving the final lower bound under it; None: play on.
    At n == total, the fixed design's verdict."""
    if wilson_interval(mean, n, Z_EARLY if n < total else Z95)[0] >= bar:
        return True
    if n >= total:
        return False
    best = (mean * n + wilson_interval(mean, n)[1] * (total - n)) / total
    return False if wilson_interval(best, total)[0] < bar else None

_PlayPaired = Callable[..., PairedScores]
"""Inside WilsonGate.evaluate: play(a, b, n_battles[, first_seed=, of=]), keep the games, return them
as paired seeds."""


class WilsonGate:
    """Admits candidate C iff (1) the Wilson 95% lower bound of its score rate against the champion
    is >= 0.52; (2) against each anchor it is not more than 2 pp below the champion's RECORD;
    (3) its observed mean against a variance-weighted stratified sample of the pool is at least
    the champion's fitted predicted mean against the same members, less one SE of C's mean.
    (1),(2) pass and (3) fails: admit as a cycle, no promotion. Otherwise fail: discard."""

    def __init__(self, cfg: GateConfig, master_seed: int, eval_seed_set_sha: str):
        self.cfg, self.master_seed, self.seed_sha = cfg, master_seed, eval_seed_set_sha

    def stratified_sample(self, candidate: str, champion: str, pool_members: Sequence[str],
                          ratings: RatingTable | None) -> list[str]:
        """Up to stratified_snapshots members: sorted by fitted rating, split into that many equal
        strata, one drawn per stratum with weight p(1-p) (p the champion's predicted score): the
        most even matchup carries the most information. Draw addressed eval/stratified/{candidate}."""
        rest = sorted(m for m in pool_members
                      if m not in (candidate, champion) and not m.startswith("scripted:"))
        k = self.cfg.stratified_snapshots
        if len(rest) <= k:
            return rest
        rated = ratings.rating if ratings is not None else {}
        rest.sort(key=lambda m: (rated.get(m, 0.0), m))
        rng = derive_generator(self.master_seed, f"eval/stratified/{candidate}")
        out = []
        for stratum in np.array_split(np.arange(len(rest)), k):
            members = [rest[i] for i in stratum]
            w = np.array([_variance_weight(ratings, champion, m) for m in members])
            out.append(members[int(rng.choice(len(members), p=w / w.sum()))])
        return sorted(out)

    def evaluate(self, candidate: str, champion: str, pool_members: Sequence[str],
                 ratings: RatingTable | None, play: PlayFn,
                 history: Sequence[GameResult] = ()) -> tuple[GateDecision, list[GameResult]]:
        """Play every condition's battles (all are rating evidence), decide, return the decision
        and the games played. `history` is the run's eval games, read for the champion's anchor
        record; a champion without one plays the anchor here, once."""
        t0 = time.monotonic()
        history = [g for g in history if g.kind == "eval"]
        played: list[GameResult] = []

        def play_paired(a: str, b: str, n_battles: int, **part: int) -> PairedScores:
            games = play(a, b, n_battles, **part)   # part: first_seed and of, a sequential look
            played.extend(games)
            ps = paired_scores(games, a, b)
            if not ps.x:   # a runner fault must not read as a failed condition
                raise ValueError(f"gate {candidate}: play({a!r}, {b!r}) returned no seed played from "
                                 f"both sides; the evaluation runner is broken")
            return ps

        cond = {"champion": self._champion_condition(candidate, champion, play_paired)}
        for anchor in self.cfg.anchors:
            cond[f"anchor:{anchor}"] = self._anchor_condition(candidate, champion, anchor, history,
                                                              play_paired)
        cond["pool"] = self._pool_condition(candidate, champion, pool_members, ratings, play_paired,
                                            lambda: fit_ratings([*history, *played]))
        return self._decide(candidate, champion, cond, time.monotonic() - t0), played

    def _champion_condition(self, candidate: str, champion: str,
                            play_paired: _PlayPaired) -> ConditionResult:
        """(1) The Wilson 95% lower bound of C's score rate against the champion clears the bar.
        Sequential (cfg.sequential_battles > 0): the champion_games battles in looks of that many,
        the same battles and games as the fixed design's, in its seed order, stopped at the first
        look where the bound settles (sequential_settled): promoted once it clears the bar,
        discarded once the bar is out of reach. Error rates: docs/ladder.md section 4."""
        cfg, total = self.cfg, self.cfg.champion_games
        ps = None
        for first in range(0, total, cfg.sequential_battles or total):
            k = min(cfg.sequential_battles or total, total - first)
            part = (play_paired(candidate, champion, k, first_seed=first // 2, of=total)
                    if cfg.sequential_battles else play_paired(candidate, champion, k))
            ps = part if ps is None else merge_paired(ps, part)
            if sequential_settled(ps.mean, ps.n_battles, total, cfg.champion_lower_bound) is not None:
                break
        lo, _ = wilson_interval(ps.mean, ps.n_battles)
        ci = bootstrap_interval(ps.x, self.master_seed, f"gate/{candidate}/vs/{champion}",
                                cfg.bootstrap_resamples)
        return ConditionResult(
            passed=lo >= cfg.champion_lower_bound, n=ps.n_battles, observed=ps.mean, bound=lo,
            reference=cfg.champion_lower_bound, ci95_lo=ci[0], ci95_hi=ci[1], paired_rho=paired_rho(ps))

    def _anchor_condition(self, candidate: str, champion: str, anchor: str, history: Sequence[GameResult],
                          play_paired: _PlayPaired) -> ConditionResult:
        """(2) No regression against an anchor: C's mean is at most the tolerance below the
        champion's RECORD against it (its eval games against that anchor in `history`)."""
        cfg = self.cfg
        cs = play_paired(candidate, anchor, cfg.anchor_games)
        rec = paired_scores(history, champion, anchor)
        if not rec.x:   # a champion admitted free has no record: it plays the anchor once
            rec = play_paired(champion, anchor, cfg.anchor_games)
        bound = rec.mean - cfg.anchor_tolerance_pp / 100.0
        return ConditionResult(passed=cs.mean >= bound - 1e-12, n=cs.n_battles, observed=cs.mean,
                               bound=bound, reference=rec.mean)

    def _pool_condition(self, candidate: str, champion: str, pool_members: Sequence[str],
                        ratings: RatingTable | None, play_paired: _PlayPaired,
                        refit: Callable[[], RatingTable]) -> ConditionResult:
        """(3) No pool-wide collapse: C's observed mean against the stratified sample is at least
        the champion's fitted predicted mean against the same members, less one SE of C's mean.
        SKIPPED when the pool holds no one besides the champion and the anchors. A player the
        table before the gate does not hold (v0 before a seeded run's first gate, a seed that has
        not played yet) is predicted by `refit`: the fit of every evaluation game so far, this
        gate's included, which links it through the candidate's games (design 7.4)."""
        members = self.stratified_sample(candidate, champion, pool_members, ratings)
        if not members:
            return ConditionResult(
                passed=True, n=0, observed=None, bound=None, reference=None,
                skipped=True, reason="SKIPPED: no pool member besides the champion and the anchors")
        xs, n_b = [], 0
        for m in members:
            ps_m = play_paired(candidate, m, self.cfg.stratified_games)
            xs += ps_m.x
            n_b += ps_m.n_battles
        observed = float(np.mean(xs))
        se = float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else 0.0
        if ratings is None or any(p not in ratings.rating for p in (champion, *members)):
            ratings = refit()
        reference = float(np.mean([ratings.predict(champion, m) for m in members]))
        return ConditionResult(passed=observed >= reference - se, n=n_b, observed=observed,
                               bound=reference - se, reference=reference, members=members)

    def _decide(self, candidate: str, champion: str, cond: dict[str, ConditionResult],
                wall_seconds: float) -> GateDecision:
        """(1) and (2) decide admission; (3) then decides promotion or admission as a cycle."""
        failed = [k for k, c in cond.items() if not c.passed]
        core_ok = all(c.passed for k, c in cond.items() if k != "pool")
        promote = core_ok and cond["pool"].passed
        cycle = core_ok and not cond["pool"].passed
        outcome = "admit+promote" if promote else ("admit-as-cycle" if cycle else "discard")
        return GateDecision(
            candidate=candidate, champion=champion, outcome=outcome, admit=core_ok, promote=promote,
            cycle=cycle, failed=failed, conditions=cond, eval_seed_set_sha=self.seed_sha,
            wall_seconds=wall_seconds, wall=utc_now())


def _variance_weight(ratings: RatingTable | None, champion: str, m: str) -> float:
    if ratings is None or champion not in ratings.rating or m not in ratings.rating:
        return 0.25
    p = ratings.predict(champion, m)
    return max(p * (1.0 - p), 1e-6)


def _file_name(player_id: str) -> str:
    return player_id.replace(":", "_").replace("/", "_")


def write_gate_decision(run_dir: str | Path, decision: GateDecision) -> Path:
    """ladder/gates/<candidate>.json (':' and '/' in the id become '_')."""
    path = ladder_dir(run_dir) / "gates" / f"{_file_name(decision.candidate)}.json"
    write_atomic(path, _json_pretty(decision))
    return path


def read_gate_decisions(run_dir: str | Path) -> list[GateDecision]:
    """Every ladder/gates/<candidate>.json, in file-name order (not the order they were decided)."""
    return [msgspec.json.decode(f.read_bytes(), type=GateDecision)
            for f in sorted((ladder_dir(run_dir) / "gates").glob("*.json"))]


# --- 6. Snapshots: content-addressed, fp16, no pickle (design 7.6) ----------------------------------

DIGEST_FIELDS = ("arch_digest", "obs_digest", "codec_table_digest")
"""A load whose value of one of these differs from the current run's is refused, by field."""


class SnapshotSpec(msgspec.Struct, frozen=True):
    arch_digest: str
    obs_digest: str
    action_digest: str
    codec_version: int
    codec_table_digest: str
    frame_stack: int
    num_cards: int
    vector_size: int
    step: int                          # the learner's cumulative env steps at the snapshot
    context: str
    run_id: str
    arch: dict[str, Any] = {}          # the network builder's arguments
    actor_sha256: str = ""             # sha256 of actor.safetensors; filled by save()
    # the training script whose network plays it, when it is not DEFAULT_BUILDER: a fork's own
    # (training_script). Unset for ppo_clash.py, and an unset field is not written, so its
    # snapshots' bytes, and so their ids, are what they were before the field existed
    builder: Union[str, msgspec.UnsetType] = msgspec.UNSET

    def script(self) -> str:
        """The file name of the script whose network plays this snapshot."""
        return DEFAULT_BUILDER if self.builder is msgspec.UNSET else self.builder


DEFAULT_BUILDER = "ppo_clash.py"


class SnapshotMismatch(ValueError):
    pass


SNAPSHOT_PLAYERS = ("snap:", "seed:")
"""The player ids a network plays: a run's snapshot, and a seed snapshot of its pool (design 7.3)."""


def snapshot_player_id(snapshot_id: str) -> str:
    return f"snap:{snapshot_id}"


def _decode_spec(snapshot_id: str, path: Path, data: bytes) -> SnapshotSpec:
    """spec.json's bytes as a SnapshotSpec. A shipped folder's id is its spec's own hash, so an
    edited or truncated spec.json gets past the hash check and fails here, naming the file."""
    try:
        return msgspec.json.decode(data, type=SnapshotSpec)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SnapshotMismatch(f"snapshot {snapshot_id}: {path} is not a snapshot spec ({e}); "
                               f"the folder is damaged, or not a snapshot") from None


class SnapshotStore:
    """runs/<id>/ladder/snapshots/<sha16>/{actor.safetensors, spec.json}. The folder name is the
    first 16 hex of sha256(spec.json), and spec.json carries the sha256 of the weights file, so
    the name addresses both. Archive everything, never delete (a snapshot is about a megabyte).
    add_folder(path) makes a snapshot folder copied out of its run under another name (a shipped
    model, models/<name>/) known too, by the id its spec.json hashes to; run_dir None: only those."""

    def __init__(self, run_dir: str | Path | None):
        self.root = ladder_dir(run_dir) / "snapshots" if run_dir is not None else None
        self.folders: dict[str, Path] = {}

    def add_folder(self, folder: str | Path) -> str:
        """The snapshot id of a snapshot folder, now readable from this store."""
        folder = Path(folder)
        if not (folder / "spec.json").is_file() or not (folder / "actor.safetensors").is_file():
            raise FileNotFoundError(f"{folder}: not a snapshot folder (it needs spec.json and "
                                    "actor.safetensors)")
        sid = hashlib.sha256((folder / "spec.json").read_bytes()).hexdigest()[:16]
        self.folders[sid] = folder
        return sid

    def copy_in(self, folder: str | Path) -> str:
        """A snapshot folder copied byte for byte into this run's archive (a seed snapshot, design
        7.3): the same bytes hash to the same id, so the copy is the folder's player."""
        sid = self.add_folder(folder)
        final = self.root / sid
        if not final.exists():
            tmp = self.root / f".partial-{sid}"
            for name in ("actor.safetensors", "spec.json"):
                write_atomic(tmp / name, (Path(folder) / name).read_bytes())
            os.replace(tmp, final)
        del self.folders[sid]   # read from the run's copy from now on
        return sid

    def _folder(self, snapshot_id: str) -> Path:
        if snapshot_id in self.folders:
            return self.folders[snapshot_id]
        if self.root is None:
            raise FileNotFoundError(f"snap:{snapshot_id}: no run to read it from, and no snapshot folder "
                                    f"given hashes to that id (known: {sorted(self.folders)})")
        return self.root / snapshot_id

    def save(self, tensors: Mapping[str, np.ndarray], spec: SnapshotSpec) -> str:
        import safetensors.numpy  # torch-free
        arrays = {k: (np.ascontiguousarray(v, dtype=np.float16) if np.issubdtype(v.dtype, np.floating)
                      else np.ascontiguousarray(v)) for k, v in sorted(tensors.items())}
        blob = safetensors.numpy.save(arrays)
        spec = msgspec.structs.replace(spec, actor_sha256=hashlib.sha256(blob).hexdigest())
        spec_bytes = _json_pretty(spec)
        sid = hashlib.sha256(spec_bytes).hexdigest()[:16]
        final = self.root / sid
        if final.exists():
            return sid
        tmp = self.root / f".partial-{sid}"
        for name, data in (("actor.safetensors", blob), ("spec.json", spec_bytes)):
            write_atomic(tmp / name, data)
        os.replace(tmp, final)
        return sid

    def spec(self, snapshot_id: str) -> SnapshotSpec:
        """spec.json alone, verified against the folder name (no weights read): what the
        evaluation runner checks a pairing against before anything is built."""
        path = self._folder(snapshot_id) / "spec.json"
        if not path.is_file():
            raise FileNotFoundError(f"snapshot {snapshot_id}: no {path}; known snapshots: {self.ids()[:8]}")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest()[:16] != snapshot_id:
            raise SnapshotMismatch(f"snapshot {snapshot_id}: {path} does not hash to its folder name; "
                                   f"the spec was edited after it was saved")
        return _decode_spec(snapshot_id, path, data)

    def ids(self) -> list[str]:
        held = [p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")] \
            if self.root is not None and self.root.exists() else []
        return sorted({*held, *self.folders})

    def load(self, snapshot_id: str, expect: Mapping[str, str] | None = None
             ) -> tuple[SnapshotSpec, dict[str, np.ndarray]]:
        """Load and verify. `expect` maps DIGEST_FIELDS to the current run's values."""
        import safetensors.numpy
        folder = self._folder(snapshot_id)
        if not folder.is_dir():
            raise FileNotFoundError(f"snapshot {snapshot_id}: no folder {folder}")
        spec_bytes = (folder / "spec.json").read_bytes()
        if hashlib.sha256(spec_bytes).hexdigest()[:16] != snapshot_id:
            raise SnapshotMismatch(f"snapshot {snapshot_id}: {folder / 'spec.json'} does not hash to its "
                                   f"folder name; the spec was edited after it was saved")
        spec = _decode_spec(snapshot_id, folder / "spec.json", spec_bytes)
        for field, want in (expect or {}).items():
            if field not in DIGEST_FIELDS:
                raise ValueError(f"expect has {field!r}; only {DIGEST_FIELDS} are checked")
            have = getattr(spec, field)
            if have != want:
                raise SnapshotMismatch(
                    f"snapshot {snapshot_id}: {field} is {have} but this run's {field} is {want}; "
                    f"a policy built for another {field.removesuffix('_digest')} cannot play here "
                    f"(refused, not adapted)")
        blob = (folder / "actor.safetensors").read_bytes()
        if hashlib.sha256(blob).hexdigest() != spec.actor_sha256:
            raise SnapshotMismatch(f"snapshot {snapshot_id}: actor_sha256 of {folder / 'actor.safetensors'} "
                                   f"does not match spec.json; the weights file is damaged")
        return spec, safetensors.numpy.load(blob)


def check_seed(label: str, folder: str | Path, sha256: str, expect: Mapping[str, str]) -> SnapshotSpec:
    """A seed snapshot (ladder.seed_snapshots, design 7.3) checked before its run exists: a
    snapshot folder whose weights hash to `sha256` (what the config pins) and whose spec carries the
    run's DIGEST_FIELDS (`expect`). `label` names it in every refusal: "ladder.seed_snapshots[i]
    (seed:<name>)". Returns its spec."""
    store = SnapshotStore(None)
    try:
        sid = store.add_folder(folder)
        spec, _ = store.load(sid, expect)
    except (OSError, SnapshotMismatch, msgspec.DecodeError) as e:   # DecodeError: a spec.json that is not one
        raise SnapshotMismatch(f"{label}: {e}") from None
    if spec.actor_sha256 != sha256:
        raise SnapshotMismatch(f"{label}: {Path(folder) / 'actor.safetensors'} has sha256 "
                               f"{spec.actor_sha256}, the config pins {sha256}; other weights than the "
                               f"ones named (copy the hash from the folder's spec.json, actor_sha256, if "
                               f"this folder is the one you mean)")
    return spec


class LoadedPolicyCache:
    """At most `capacity` (max_resident_opponents + 2) built policies resident, least recently used
    evicted first. `build(spec, tensors)` is the caller's network builder (ppo_clash owns torch)."""

    def __init__(self, store: SnapshotStore, build: Callable[[SnapshotSpec, dict[str, np.ndarray]], Any],
                 capacity: int, expect: Mapping[str, str] | None = None):
        self.store, self.build, self.capacity, self.expect = store, build, capacity, expect
        self.resident: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def get(self, snapshot_id: str) -> Any:
        if snapshot_id in self.resident:
            self.resident.move_to_end(snapshot_id)
            return self.resident[snapshot_id]
        spec, tensors = self.store.load(snapshot_id, self.expect)
        policy = self.build(spec, tensors)
        self.resident[snapshot_id] = policy
        while len(self.resident) > self.capacity:
            self.resident.popitem(last=False)
        return policy


# --- 7. The pool and hall-of-fame eviction (design 7.6) -----------------------------------------------

class PoolMember(msgspec.Struct):
    id: str                    # "snap:<sha16>" or "seed:<name>"
    step: int                  # env steps at the snapshot
    cycle: bool = False        # admitted as a cycle by the gate (a diverse opponent)
    seed: bool = False         # a seed snapshot (never evicted, never v0, never the stand-in)
    snapshot: str = ""         # a seed's snapshot id (a snap: member's id names its own)
    weight: float = 1.0        # a seed's multiplier on its draw weight, after PFSP (design 7.3)


class Pool(msgspec.Struct):
    """Admitted snapshots. `sampler` is the subset the matchmaker may draw; eviction shrinks only
    that. Members, the archive and the log are never touched by eviction."""
    members: list[PoolMember] = []
    sampler: list[str] = []
    champion_chain: list[str] = []   # every champion in order; the last is the current one
    v0: str | None = None            # the first non-seed snapshot admitted

    def admit(self, member: PoolMember, promote: bool, sample: bool = True) -> None:
        """sample False: a member the matchmaker does not draw (v0 beside seed snapshots)."""
        if any(m.id == member.id for m in self.members):
            raise ValueError(f"pool: {member.id} is already a member")
        self.members.append(member)
        if sample:
            self.sampler.append(member.id)
        if self.v0 is None and not member.seed:
            self.v0 = member.id
        if promote:
            self.champion_chain.append(member.id)

    @property
    def champion(self) -> str | None:
        return self.champion_chain[-1] if self.champion_chain else None

    def member(self, pid: str) -> PoolMember:
        for m in self.members:
            if m.id == pid:
                return m
        raise KeyError(f"pool: no member {pid}")

    def seeds(self) -> dict[str, str]:
        """seed:<name> -> the snapshot id it plays as."""
        return {m.id: m.snapshot for m in self.members if m.seed}

    def snapshot_id(self, pid: str) -> str:
        """The snapshot a member plays as: a seed's copy, else the id's own."""
        return self.seeds().get(pid) or pid.removeprefix("snap:")


def write_pool(run_dir: str | Path, pool: Pool) -> Path:
    """ladder/pool.json: the pool as the trainer last admitted it. The trainer writes it after
    every admission; `ladder.py gate` reads it for the champion and the members (and never
    writes it: a CLI gate records a decision, it does not admit into a live run)."""
    path = ladder_dir(run_dir) / "pool.json"
    write_atomic(path, _json_pretty(pool))
    return path


def read_pool(run_dir: str | Path) -> Pool | None:
    path = ladder_dir(run_dir) / "pool.json"
    return msgspec.json.decode(path.read_bytes(), type=Pool) if path.exists() else None


def protected_ids(pool: Pool) -> set[str]:
    """Never evicted: scripted anchors, v0, every champion, seed snapshots."""
    out = set(pool.champion_chain) | {m.id for m in pool.members if m.seed or m.id.startswith("scripted:")}
    if pool.v0 is not None:
        out.add(pool.v0)
    return out


def hall_of_fame_evict(pool: Pool, ratings: RatingTable | None, working_size: int) -> list[str]:
    """Shrink pool.sampler to working_size (pool_working_size), returning who left. The protected
    stay; among the rest keep one per stratum of the fitted rating range (equal-count strata),
    preferring a cycle-flagged member, then the one nearest the stratum's median rating."""
    prot = protected_ids(pool)
    keep_prot = [m for m in pool.sampler if m in prot]
    rest = [m for m in pool.sampler if m not in prot]
    n_keep = max(working_size - len(keep_prot), 0)
    if len(rest) <= n_keep:
        return []
    rated = ratings.rating if ratings is not None else {}
    rest.sort(key=lambda m: (rated.get(m, 0.0), m))
    kept: set[str] = set()
    if n_keep:
        for stratum in np.array_split(np.arange(len(rest)), n_keep):
            members = [rest[i] for i in stratum]
            med = float(np.median([rated.get(m, 0.0) for m in members]))
            members.sort(key=lambda m: (not pool.member(m).cycle, abs(rated.get(m, 0.0) - med), m))
            kept.add(members[0])
    evicted = [m for m in rest if m not in kept]
    pool.sampler = [m for m in pool.sampler if m not in set(evicted)]
    return sorted(evicted)


# --- 8. Matchmaking (design 7.3) ----------------------------------------------------------------------

class MatchConfig(msgspec.Struct, frozen=True):
    mix: tuple[float, float, float] = (0.50, 0.35, 0.15)     # mirror / pool / scripted, in battles
    max_resident_opponents: int = 2
    pfsp_power: float = 2.0
    pfsp_uniform_floor: float = 0.2
    weight_floor_scale: float = 0.01
    scripted_opponents: tuple[str, ...] = ("scripted:noop", "scripted:random_legal")
    fixed_seats: bool = False   # the learner's seat per battle, even blue, odd red (ladder.seat_decks)


DEFAULT_MATCH_CONFIG = MatchConfig()   # frozen, so one shared default instance is safe


def _round_half_up(x: float) -> int:
    # Halves round UP (Python's round(0.5) is 0: a one-battle rectangle would hold no mirror).
    # The 1e-9 absorbs float error such as 0.15 * 10 = 1.5000000000000002 vs 1.4999999999999998.
    return int(math.floor(x + 0.5 + 1e-9))


def role_counts(mix: Sequence[float], n_battles: int) -> tuple[int, int, int]:
    """Design 7.3: mirror = round(mix0 * n); the rest split pool : scripted as mix1 : mix2 with pool
    rounded and scripted the remainder. Sums to n; each within one battle of its exact share."""
    if len(mix) != 3 or min(mix) < 0 or abs(sum(mix) - 1.0) > 1e-6:
        raise ValueError(f"ladder.mix={tuple(mix)}: three non-negative shares summing to 1")
    mirror = min(_round_half_up(mix[0] * n_battles), n_battles)
    rest = n_battles - mirror
    pool = _round_half_up(rest * mix[1] / (mix[1] + mix[2])) if mix[1] + mix[2] > 0 else 0
    return mirror, pool, rest - pool


def role_layout(master_seed: int, n_battles: int, mix: Sequence[float]) -> np.ndarray:
    """Per battle, its role for the whole run: the counts laid over a seeded permutation from
    match/battle/-2/ordinal/{n_battles} (so every worker's block carries every role)."""
    m, p, _ = role_counts(mix, n_battles)
    perm = derive_generator(master_seed, f"match/battle/-2/ordinal/{n_battles}").permutation(n_battles)
    roles = np.full(n_battles, ROLE_SCRIPTED, dtype=np.int8)
    roles[perm[:m]] = ROLE_MIRROR
    roles[perm[m:m + p]] = ROLE_POOL
    return roles


def pfsp_weights(p: Sequence[float], power: float = 2.0, uniform_mix: float = 0.2,
                 floor_scale: float = 0.01) -> np.ndarray:
    """Hard PFSP mixed with uniform and floored. p_k is the learner's predicted score against k;
    hard = (1 - p)^power normalised; w = (1-u) hard + u uniform; then w' = f/M + (1-f) w, so
    every weight is >= f/M exactly and they still sum to 1."""
    p = np.asarray(p, dtype=np.float64)
    M = p.size
    if M == 0:
        return p
    uniform = np.full(M, 1.0 / M)
    hard = (1.0 - p) ** power
    hard = hard / hard.sum() if hard.sum() > 0 else uniform
    w = (1.0 - uniform_mix) * hard + uniform_mix * uniform
    return floor_scale / M + (1.0 - floor_scale) * w


def learner_stand_in(pool: Pool, ratings: RatingTable | None) -> PoolMember | None:
    """The newest admitted, rated, non-seed snapshot stands in for the learner (design 7.3)."""
    if ratings is None:
        return None
    cands = [m for m in pool.members if not m.seed and m.id in ratings.rating]
    return max(cands, key=lambda m: (m.step, m.id)) if cands else None


def assign(master_seed: int, roles: np.ndarray, scripted: Sequence[str], battle: int, ordinal: int,
           residents: Sequence[str], weights: Sequence[float], fixed_seats: bool = False) -> Assignment:
    """What battle `battle`'s episode `ordinal` plays: a pure function of its arguments, drawing
    from match/battle/{battle}/ordinal/{ordinal} (seat first, then the opponent, always both).
    fixed_seats: the learner sits where the battle's deal put its deck (battle % 2), not drawn."""
    rng = derive_generator(master_seed, f"match/battle/{battle}/ordinal/{ordinal}")
    u_seat, u_opp = rng.random(), rng.random()
    role = int(roles[battle])
    if role == ROLE_MIRROR:
        return Assignment(battle=battle, ordinal=ordinal, role=ROLE_MIRROR, opponent_id=None,
                          group=(GROUP_LEARNER, GROUP_LEARNER), learner_seat=-1)
    seat = battle % 2 if fixed_seats else int(u_seat >= 0.5)
    if role == ROLE_POOL and residents:
        cdf = np.cumsum(np.asarray(weights, dtype=np.float64))
        k = min(int(np.searchsorted(cdf, u_opp * cdf[-1], side="right")), len(residents) - 1)
        opp, opp_group = residents[k], k
    else:   # scripted, or a pool slot with nothing resident yet: plays scripted, role says so
        if not scripted:
            raise ValueError(f"battle {battle}: role {ROLE_NAMES[role]} needs ladder.scripted_opponents")
        opp = scripted[min(int(u_opp * len(scripted)), len(scripted) - 1)]
        opp_group, role = GROUP_SCRIPTED, ROLE_SCRIPTED
    group = (GROUP_LEARNER, opp_group) if seat == 0 else (opp_group, GROUP_LEARNER)
    return Assignment(battle=battle, ordinal=ordinal, role=role, opponent_id=opp, group=group,
                      learner_seat=seat)


class MatchmakerState(msgspec.Struct):
    """What a checkpoint holds. The roles are recomputed from (master_seed, n_battles, mix) and
    checked against the stored copy, so a resume under another geometry is refused by name."""
    format_version: int
    master_seed: int
    n_battles: int
    cfg: MatchConfig
    roles: list[int]
    residents: list[str]
    weights: list[float]
    pfsp_effective: int
    pfsp_learner_step: int | None


class Matchmaker:
    """The run's matchmaker: the role layout fixed at construction, the resident set and its PFSP
    weights fixed per iteration by plan(), and assign() for each battle's next episode."""

    FORMAT_VERSION = 2   # design 7.3: format 2 carries n_battles (format 1 is not produced here)

    def __init__(self, master_seed: int, n_battles: int, cfg: MatchConfig = DEFAULT_MATCH_CONFIG):
        self.master_seed, self.n_battles, self.cfg = master_seed, n_battles, cfg
        self.roles = role_layout(master_seed, n_battles, cfg.mix)
        self.residents: tuple[str, ...] = ()
        self.weights: tuple[float, ...] = ()
        self.pfsp_effective = 0
        self.pfsp_learner_step: int | None = None

    def plan(self, iteration: int, ordinals: Sequence[int], pool: Pool,
             ratings: RatingTable | None) -> SlotPlan:
        cands = list(pool.sampler)
        stand = learner_stand_in(pool, ratings)
        if stand is not None and cands:
            # A candidate the fit has not rated yet (admitted since the last refit) reads 0.5:
            # no information about it, and no reason to switch PFSP off for the whole pool.
            p = [0.5 if c == stand.id or c not in ratings.rating else ratings.predict(stand.id, c)
                 for c in cands]
            self.pfsp_effective, self.pfsp_learner_step = 1, stand.step
        else:   # no rated stand-in: the uniform weights the floor mixes in, and it says so
            p = [0.5] * len(cands)   # a constant p makes hard exactly uniform
            self.pfsp_effective, self.pfsp_learner_step = 0, None
        w = pfsp_weights(p, self.cfg.pfsp_power, self.cfg.pfsp_uniform_floor, self.cfg.weight_floor_scale)
        w = w * np.array([pool.member(c).weight for c in cands])   # a seed's multiplier (1 for the rest)
        k = min(self.cfg.max_resident_opponents, len(cands))
        if k:
            rng = derive_generator(self.master_seed, f"match/battle/-1/ordinal/{iteration}")
            pick = rng.choice(len(cands), size=k, replace=False, p=w / w.sum())
            pick = sorted(int(i) for i in pick)
            self.residents = tuple(cands[i] for i in pick)
            self.weights = tuple(float(w[i]) for i in pick)
        else:
            self.residents, self.weights = (), ()
        return SlotPlan(iteration=iteration, n_battles=self.n_battles, n_slots=2 * self.n_battles,
                        assignment=tuple(self.assign(b, int(ordinals[b])) for b in range(self.n_battles)),
                        resident_snapshots=self.residents)

    def assign(self, battle: int, ordinal: int) -> Assignment:
        return assign(self.master_seed, self.roles, self.cfg.scripted_opponents, battle, ordinal,
                      self.residents, self.weights, self.cfg.fixed_seats)

    def state(self) -> MatchmakerState:
        return MatchmakerState(
            format_version=self.FORMAT_VERSION, master_seed=self.master_seed, n_battles=self.n_battles,
            cfg=self.cfg, roles=[int(r) for r in self.roles], residents=list(self.residents),
            weights=list(self.weights), pfsp_effective=self.pfsp_effective,
            pfsp_learner_step=self.pfsp_learner_step)

    @classmethod
    def from_state(cls, st: MatchmakerState) -> "Matchmaker":
        if st.format_version > cls.FORMAT_VERSION:
            raise ValueError(f"matchmaker state format_version={st.format_version} is newer than this "
                             f"code's {cls.FORMAT_VERSION}; update ladder.py to resume it")
        mm = cls(st.master_seed, st.n_battles, st.cfg)
        if [int(r) for r in mm.roles] != st.roles:
            raise ValueError(f"matchmaker state: the stored roles of {st.n_battles} battles differ from "
                             f"the layout master_seed={st.master_seed} and mix={st.cfg.mix} give; the "
                             f"checkpoint belongs to another run or another role rule")
        mm.residents, mm.weights = tuple(st.residents), tuple(st.weights)
        mm.pfsp_effective, mm.pfsp_learner_step = st.pfsp_effective, st.pfsp_learner_step
        return mm


def learner_rows(plan: SlotPlan) -> int:
    """Trainable seats in a plan: one per battle plus one more per mirror battle."""
    return sum(sum(1 for g in a.group if g == GROUP_LEARNER) for a in plan.assignment)


# --- 9. The ladder's metric keys (design 9.2) ---------------------------------------------------------

def ladder_metrics(table: RatingTable | None, pool: Pool, mm: "Matchmaker | None" = None,
                   last_gate: GateDecision | None = None, gate_attempts: int = 0, gate_passes: int = 0,
                   evictions: int = 0) -> dict[str, float | int | str]:
    """The ladder/* keys of one metric row that this module can compute. A key whose value is
    undefined (no fit yet, no gate yet, rho undefined, no stand-in) is ABSENT, never 0 or 0.5:
    those read as measurements (design 7.5, 7.9)."""
    m: dict[str, float | int | str] = {
        "ladder/pool_size": len(pool.members), "ladder/sampler_size": len(pool.sampler),
        "ladder/gate_attempts": gate_attempts, "ladder/gate_passes": gate_passes,
        "ladder/evictions": evictions}
    if pool.champion is not None:
        m["ladder/champion_id"] = pool.champion
        m["ladder/champion_step"] = pool.member(pool.champion).step
    if table is not None:
        for p in sorted({x.id for x in pool.members} | {table.anchor}):
            if p in table.rating:
                r, se = table.rating[p], table.se[p]
                m[f"ladder/rating/{p}"], m[f"ladder/rating_se/{p}"] = r, se
                m[f"ladder/rating_ci95_lo/{p}"], m[f"ladder/rating_ci95_hi/{p}"] = r - Z95 * se, r + Z95 * se
        m["ladder/draw_rate_eval"] = table.draw_rate
        m["ladder/eval_games_total"] = table.n_total
        if table.transitivity_residual is not None:
            m["ladder/transitivity_residual"] = table.transitivity_residual
    if last_gate is not None:
        champ = last_gate.conditions["champion"]
        m["ladder/gate_observed_rate"] = champ.observed
        m["ladder/gate_lower_bound"] = champ.bound
        m["ladder/gate_failed_condition"] = ",".join(last_gate.failed)
        if champ.paired_rho is not None:
            m["ladder/paired_rho"] = champ.paired_rho
    if mm is not None:
        m["ladder/pfsp_effective"] = mm.pfsp_effective
        if mm.pfsp_learner_step is not None:
            m["ladder/pfsp_learner_step"] = mm.pfsp_learner_step
    return m


def role_count_metrics(ended: Sequence[Assignment], roles: np.ndarray) -> dict[str, int]:
    """ladder/role_counts/*: the training episodes that finished this iteration, one per battle
    episode, by what they PLAYED; pool_fallback counts the scripted ones laid out as pool (a pool
    slot plays scripted until the first snapshot is admitted)."""
    out = {f"ladder/role_counts/{name}": 0 for name in ROLE_NAMES.values()}
    out["ladder/role_counts/pool_fallback"] = 0
    for a in ended:
        out[f"ladder/role_counts/{ROLE_NAMES[a.role]}"] += 1
        fell_back = a.role == ROLE_SCRIPTED and roles[a.battle] == ROLE_POOL
        out["ladder/role_counts/pool_fallback"] += int(fell_back)
    return out


# --- 10. Evaluation: paired battles on their own env (design 7.1, 7.5, 7.9) ---------------------
# What plays the games the gate and the probe read. Four separations (design 7.5), each kept here:
#   1. No experience is recorded: the runner keeps no observation, reward or log-prob; it writes
#      GameResult lines to games.jsonl (and the aggregate cache that mirrors them) and nothing else.
#   2. Its own env: the training EnvFactorySpec with every truncation removed -- a full match under
#      real rules, ended by GameOverCondition only. A cut match is scored on crowns mostly not yet
#      taken, so it is nearly always a draw (design 7.5) and would make the rating barely move.
#   3. Its own seeds: battle (seed s, side) resets its env with the FROZEN set's seed s, the same
#      seed for both sides, so the two games of a seed start from the same position (decks and
#      engine seed come from that one number: ClashParallelEnv.reset draws both from it). The
#      acting randomness -- each seat's uniforms, or a scripted seat's generator -- is addressed
#      eval/match/{comparison_id}/{s}/{side}/seat/{blue|red}: one stream per seat of each battle,
#      so an action never depends on which other battles were live in the same batch.
#   4. Its own farm (design 7.1): a runner (a gate's, a probe's, a yardstick's) builds a farm.py
#      farm in its evaluation mode (FarmConfig.eval_plan) at its first comparison, plays each next
#      one on it (farm.replan: the same workers and engines, every battle starting over; a
#      comparison wanting other geometry builds another) and closes it with the runner, or at once
#      on an error: InlineFarm in this process for workers <= 1 (the tests, the CLI by default), a
#      ProcessFarm of rollout.eval_workers processes otherwise. The plan is data: episode k of the
#      comparison is (frozen seed, blue player, red player, the two seats' stream names), hosted by
#      whichever farm battle its shard's queue hands it to (farm.py section 6; the hosting never
#      changes what an episode plays); scripted seats are played inside the workers (mask-only
#      observations, their own named generators), the other seats here, from the packed rows decoded
#      by farm.unpack_numpy, batched per player over the live battles of a round.
# The parts, in the order a comparison uses them: EvalPlayers (who plays: ids to act functions,
# pairings refused), comparison_episodes (the schedule: which seed, which seat, which stream),
# FarmComparison (the play: one comparison's rounds on its farm) and EvalRunner.play (the score:
# one GameResult per battle, appended). Cost: a full scripted battle takes 0.10-0.16 s on a 2-core
# machine (measurements: docs/ladder.md section 11).

ActFn = Callable[[dict[str, np.ndarray], np.ndarray], np.ndarray]
"""A policy: act(obs_batch, uniforms) -> actions. obs_batch holds the env's observation keys
stacked over the B seats it must answer (raw env floats; a network that acts on the codec's
unpack(pack(obs)) does that round trip itself); uniforms is float64 (B,), one draw per seat from
that seat's own stream; the answer is B integer actions, each legal under obs_batch["action_mask"]."""

PolicyBuilder = Callable[[str], ActFn]
"""policy_builder(snapshot_id) -> ActFn, supplied by the caller (ppo_clash owns torch). An ActFn that
also has act_rows(rows, statics, uniforms) -> actions (a RowsAct: rows uint8 (B, row_bytes) packed
with the runner's codec table, statics (B, s, H, W) each row's static planes) is handed the
evaluation farm's packed rows as they are, the same actions as from the observations, without
unpacking them to the env's keys and packing them again (ppo_clash.NetPlayer)."""

PAIR_DIGEST_FIELDS = ("obs_digest", "action_digest", "codec_version", "codec_table_digest")
"""Two snapshots that differ in one of these saw different observations or actions: a game
between them measures the information, not the policy, and is refused by field (design 7.6).
arch_digest may differ: two architectures can play each other."""

PROBE_RUNGS = ("scripted:noop", "scripted:random_legal")
"""ladder.probe_opponents' default (design 7.9): the two anchors, the scale that never drifts."""

DECK_PROTOCOL = "default-state-mutator"
"""The v1 deck protocol named in every context (design 7.3): whatever decks the env's state
mutator deals from the battle's seed (DefaultStateMutator: random decks per seed)."""

EVAL_KINDS = ("eval", "probe")
EVAL_SUMMED_STATS = ("env_ms", "wait_ms", "codec_ms", "bytes_out", "rows_dropped_dead_worker")
"""farm.stats keys that are per iteration; EvalRunner.farm_stats sums them over a comparison."""
EVAL_CYCLES = 64
"""Rounds per iteration of the evaluation farm: only the size of its rectangle (nothing is
trained): (64 + 1) x 2 x battles rows of row_bytes [A]."""
WINNER_SCORE = {1: 1.0, 0: 0.5, -1: 0.0}      # info["outcome"] from a's seat -> score_a


def eval_env_spec(train: EnvFactorySpec) -> EnvFactorySpec:
    """The evaluation env: the training env with every truncation removed (design 7.5). Built from
    the spec as data, never by mutating a live env."""
    return msgspec.structs.replace(train, truncation=[])


def eval_context(env_value: str, obs_digest: str, engine_build_digest: str,
                 deck_protocol: str = DECK_PROTOCOL) -> str:
    """Design 7.6: sha256(env digest + obs builder digest + deck protocol + engine build)[:16].
    env_value is the EVALUATION env's value digest (farm.env_value_digest); obs_digest is read at
    frame_stack 1, because frame stacking is a property of a network, not of the game."""
    return hashlib.sha256((env_value + obs_digest + deck_protocol + engine_build_digest)
                          .encode()).hexdigest()[:16]


def eval_digests(env: EnvFactorySpec, master_seed: int) -> tuple[str, str]:
    """What a snapshot's spec.json records of the env it will be played on: the evaluation env's
    observation digest (at frame_stack 1) and its context (eval_context)."""
    es, _, _ = _eval_preflight(msgspec.json.encode(eval_env_spec(env)), master_seed)
    return es.obs_digest, eval_context(es.env_value_digest, es.obs_digest, es.engine_build_digest)


@functools.lru_cache(maxsize=4)
def _eval_preflight(env_json: bytes, master_seed: int) -> tuple[Any, Any, np.ndarray]:
    """farm.preflight of the evaluation env (EnvSpec, codec table, statics): a pure function of
    the spec and the seed, so runners opened one after another in a process (a gate, a probe,
    the next gate) share one instead of each building envs to read it again (an open costs
    0.4-0.9 s on a 2-core machine: docs/ladder.md section 11)."""
    side: dict[str, Any] = {}
    es, table = farm.preflight(msgspec.json.decode(env_json, type=EnvFactorySpec), frame_stack=1,
                               master_seed=master_seed, out=side)
    side["statics"].setflags(write=False)
    return es, table, side["statics"]


class EvalPlayers:
    """Who plays: each player id resolved to the batched act that answers its seats, and a pairing
    refused when a game between its two players would not measure the policies.

    "scripted:<name>" (farm.SCRIPTED_NAMES) and "lookahead:..." (farm section 6b, canonical) are
    played inside the farm's workers, so their act is None here; "snap:<id>" (ladder/snapshots/<id>)
    is built once by policy_builder(id) and kept, and so is "seed:<name>", a seed snapshot, as the
    snapshot `seeds` (the run's pool) maps it to;
    any other id must have been given to register() (the probe's learner@{step})."""

    def __init__(self, store: SnapshotStore | None, policy_builder: PolicyBuilder | None,
                 seeds: Mapping[str, str] | None = None) -> None:
        self.store, self.policy_builder = store, policy_builder
        self.seeds = dict(seeds or {})
        self.policies: dict[str, ActFn] = {}

    def register(self, player_id: str, act: ActFn) -> None:
        """An ad-hoc player (the probe's learner@{step}); never a scripted:, lookahead:, snap: or
        seed: id."""
        if player_id.startswith((*farm.WORKER_PLAYERS, *SNAPSHOT_PLAYERS)):
            raise ValueError(f"register({player_id!r}): scripted:, lookahead:, snap: and seed: ids are "
                             "resolved, not registered")
        self.policies[player_id] = act

    def snapshot_of(self, player: str) -> str | None:
        """The snapshot id a snap: or seed: player plays as; None for any other player."""
        if player.startswith("snap:"):
            return player.removeprefix("snap:")
        if player.startswith("seed:"):
            if player not in self.seeds:
                raise ValueError(f"{player}: no such seed snapshot in this run's pool (its seeds: "
                                 f"{sorted(self.seeds) or 'none'})")
            return self.seeds[player]
        return None

    def unregister(self, player_id: str) -> None:
        self.policies.pop(player_id, None)

    def snapshot_spec(self, sid: str) -> SnapshotSpec:
        if self.store is None:
            raise ValueError(f"snap:{sid}: the runner has no run_dir, so no snapshot store to read it from")
        return self.store.spec(sid)

    def check_pair(self, a: str, b: str, obs_digest: str) -> None:
        """Refuse a pairing the ladder could not interpret, naming the field and both values.
        obs_digest is the evaluation env's: a snapshot trained on another observation is refused."""
        specs = {p: self.snapshot_spec(sid) for p in (a, b) if (sid := self.snapshot_of(p)) is not None}
        for p, sp in specs.items():
            if sp.frame_stack != 1:
                raise SnapshotMismatch(
                    f"{p}: frame_stack is {sp.frame_stack}; the evaluation runner hands a policy one "
                    f"frame per decision, so a stacked network cannot be evaluated yet (frame_stack 1 only)")
            if sp.obs_digest != obs_digest:
                raise SnapshotMismatch(
                    f"{p}: obs_digest is {sp.obs_digest} but the evaluation env's obs_digest is "
                    f"{obs_digest}: the snapshot was trained on another observation; refused")
        if len(specs) == 2:
            sa, sb = specs[a], specs[b]
            for field in PAIR_DIGEST_FIELDS:
                va, vb = getattr(sa, field), getattr(sb, field)
                if va != vb:
                    raise SnapshotMismatch(
                        f"pairing {a} vs {b} refused: {field} differs ({a} has {va}, {b} has {vb}); "
                        f"a game between them would measure the {field.removesuffix('_digest')}, "
                        f"not the policy")

    def act(self, player: str) -> ActFn | None:
        """The batched act of a parent-acted player (built once), None for one the workers play
        (scripted:<name>, or a lookahead:... in its canonical form, which the result log keeps)."""
        if player.startswith(farm.WORKER_PLAYERS):
            farm.check_worker_player(player)
            if farm.canonical_player(player) != player:
                raise ValueError(f"{player}: name a lookahead player by its canonical id, "
                                 f"{farm.canonical_player(player)} (farm.canonical_player), so its "
                                 "results keep every setting")
            return None
        if player in self.policies:
            return self.policies[player]
        sid = self.snapshot_of(player)
        if sid is not None:
            if self.policy_builder is None:
                raise ValueError(f"{player}: a snapshot needs a policy_builder (ppo_clash builds networks); "
                                 f"the runner was given none")
            self.policies[player] = self.policy_builder(sid)
            return self.policies[player]
        raise ValueError(f"player {player!r}: not scripted:<name>, snap:<id>, seed:<name>, or a registered "
                         f"id {sorted(self.policies)}")


def comparison_episodes(seeds: EvalSeedSet, order: Sequence[tuple[int, str]], a: str, b: str,
                        comparison_id: str) -> list[farm.EvalEpisode]:
    """The schedule of a comparison as data the farm's workers can read: for each (seed index s,
    a's side) of `order`, episode k plays the frozen seed s (the same for both sides, so the pair
    starts from one position), seats a on its side and b on the other, and names each seat's
    acting stream eval/match/{comparison_id}/{s}/{side_a}/seat/{blue|red}."""
    plan = []
    for s, side_a in order:
        players = (a, b) if side_a == "blue" else (b, a)
        base = eval_match_path(comparison_id, s, side_a)
        plan.append(farm.EvalEpisode(
            seed=int(seeds.seeds[s]), seed_path=f"eval/seed_set/{s}", players=players,
            streams=(f"{base}/seat/blue", f"{base}/seat/red")))
    return plan


class FarmComparison:
    """The play: one comparison's episodes on the runner's farm, stepped round by round until
    every episode has a result. Scripted seats are the workers'; every other seat (group -1) is
    answered here by its player's act, one batched call per player per round, each seat drawing
    one uniform per decision from its own stream (so an action never depends on the batching).

    It reads the runner's evaluation env (codec table, statics, observation space, the longest
    legal match) and master seed; what it returns, a's score per episode in plan order, is a pure
    function of the plan and the players."""

    def __init__(self, runner: "EvalRunner", plan: list[farm.EvalEpisode], order: Sequence[tuple[int, str]],
                 a: str, acts: dict[str, ActFn | None], comparison_id: str) -> None:
        self.table, self.statics = runner.table, runner.statics
        self.obs_space, self.max_decisions = runner.env_spec.obs_space, runner.max_decisions
        self.master_seed = runner.seeds.master_seed
        self.plan, self.order, self.a, self.acts, self.cid = plan, order, a, acts, comparison_id
        self.scores: list[float | None] = [None] * len(order)
        self.left = len(order)                      # episodes without a result yet
        self.rngs: dict[tuple[int, int], np.random.Generator] = {}     # (episode, seat) -> its stream
        self.steps: dict[int, int] = {}             # episode -> decisions so far
        self.summed: collections.Counter = collections.Counter()
        self.farm_stats: dict[str, float] = {}
        self.searched: collections.Counter = collections.Counter()   # a's lookahead counters, summed
        self.game_steps = 0                         # decisions of every episode played, summed

    def play(self, f: Any) -> list[float]:
        """Step farm f (in evaluation mode, on this plan) until every episode has a result;
        also sets farm_stats, the farm's stats with the per-iteration ones summed."""
        t0, it = time.perf_counter(), 0
        while self.left:
            if it:
                self.summed.update({k: f.stats[k] for k in EVAL_SUMMED_STATS})
            f.begin_iteration(f.eval_slot_plan(it))
            self._iteration(f)
            it += 1
        st = f.stats
        self.summed.update({k: st[k] for k in EVAL_SUMMED_STATS})
        self.farm_stats = {**st, **self.summed, "parent_wait_frac":
                           self.summed["wait_ms"] / max((time.perf_counter() - t0) * 1e3, 1e-9)}
        return [float(x) for x in self.scores]

    def _iteration(self, f: Any) -> None:
        """One farm iteration, T + 1 cycles of J rounds, left as soon as the last episode ends."""
        for c in range(f.T + 1):
            for _ in range(f.J):
                rnd = f.next_round()
                fails = f.drain_failures()
                if fails:
                    x = fails[0]
                    raise RuntimeError(f"comparison {self.cid}: evaluation worker {x.worker} failed "
                                       f"({x.kind}) at cycle {x.cycle}: {farm.failure_reason(x.message)}"
                                       f"\n{x.message}")   # the first line whole; the worker's text after
                self._score(rnd)
                if not self.left:
                    return
                if c < f.T:
                    f.submit(self._actions(f, rnd), 1.0)

    def _score(self, rnd: Any) -> None:
        """The episodes that ended this round, scored from a's seat."""
        for rec in rnd.episodes:
            i = rec.eval_index
            if self.plan[i].players[rec.seat] != self.a:
                continue
            self.searched.update({"lookahead_choices": rec.lookahead_choices,
                                  "lookahead_steps": rec.lookahead_steps})
            self.game_steps += rec.episode_steps
            if rec.winner < 0 or rec.outcome not in WINNER_SCORE:
                raise RuntimeError(
                    f"comparison {self.cid}: seed {self.order[i][0]} side_a {self.order[i][1]} ended "
                    f"without a result (winner={rec.winner}, outcome={rec.outcome}); "
                    f"the evaluation env must end only by GameOverCondition")
            self.scores[i] = WINNER_SCORE[rec.outcome]
            self.left -= 1

    def _actions(self, f: Any, rnd: Any) -> np.ndarray:
        """This round's actions: every parent-acted seat (group -1) answered by its player, one
        batched call per player (sorted ids, ascending slots), each seat drawing one uniform from
        its own stream. Scripted and stopped seats are the worker's: 0 here."""
        out = np.zeros(len(rnd.slots), np.int64)
        for player, entries in sorted(self._seats_by_player(f, rnd).items()):
            rows = np.array([n_ for n_, _, _ in entries])
            packed, seats = f.rect[rnd.cycle + f.k - 1, rnd.slots[rows]], rnd.slots[rows] % 2
            u = np.empty(len(entries), np.float64)
            for e, (_, i, seat) in enumerate(entries):
                if (i, seat) not in self.rngs:
                    self.rngs[(i, seat)] = derive_generator(self.master_seed, self.plan[i].streams[seat])
                u[e] = self.rngs[(i, seat)].random()
            act = self.acts[player]
            if hasattr(act, "act_rows"):       # RowsAct: the packed rows as they are
                a = act.act_rows(packed, self.statics[seats], u)
            else:
                a = act(farm.unpack_numpy(self.table, packed, self.statics, seats, self.obs_space), u)
            out[rows] = self._checked(player, entries, codec.host_mask(self.table, packed),
                                      np.asarray(a).reshape(-1))
        return out

    def _seats_by_player(self, f: Any, rnd: Any) -> dict[str, list[tuple[int, int, int]]]:
        """player -> [(row in the round, episode, seat)] of the parent-acted seats, counting each
        live episode's decisions (a match longer than twice the longest legal one is a fault)."""
        batched: dict[str, list[tuple[int, int, int]]] = {}
        eval_ix = f.eval_index
        for n_, r in enumerate(rnd.slots.tolist()):
            i = int(eval_ix[r // 2])
            if i < 0:
                continue
            if r % 2 == 0:
                self.steps[i] = self.steps.get(i, 0) + 1
                if self.steps[i] > self.max_decisions:
                    raise RuntimeError(f"comparison {self.cid}: seed {self.plan[i].seed_path} battle {i} ran "
                                       f"{self.steps[i] - 1} decisions, twice a full match; the engine "
                                       f"did not end it")
            if rnd.group[n_] == farm.GROUP_LEARNER:
                batched.setdefault(self.plan[i].players[r % 2], []).append((n_, i, r % 2))
        return batched

    def _checked(self, player: str, entries: list[tuple[int, int, int]], mask: np.ndarray,
                 actions: np.ndarray) -> np.ndarray:
        """A player's answer, refused unless it is one legal action per seat (`mask`: the seats')."""
        if actions.shape != (len(entries),):
            raise ValueError(f"{player}: act returned {actions.shape} actions for {len(entries)} seats")
        legal = mask[np.arange(len(entries)), actions]
        if not legal.all():
            e = int(np.flatnonzero(~legal)[0])
            _, i, seat = entries[e]
            raise ValueError(f"{player}: illegal action {int(actions[e])} at {self.plan[i].seed_path} "
                             f"seat {SIDES[seat]} (comparison battle {i}) decision "
                             f"{self.steps.get(i, 0) - 1}; a policy must mask before sampling")
        return actions


class EvalRunner:
    """Plays paired evaluation battles and appends their results to the run's games.jsonl.

        with EvalRunner(train_env, seeds, run_dir=run, run_id=rid, policy_builder=build) as r:
            games = r.play("snap:ab12...", "scripted:noop", 40)       # 20 seeds x 2 sides
            decision, _ = WilsonGate(...).evaluate(..., play=r, ...)  # r is the gate's `play`

    Player ids: "scripted:<name>", "snap:<id>", "seed:<name>" (a seed snapshot of the run's pool), or
    an id given to register() (see EvalPlayers).
    Everything in a GameResult except `wall` is a pure function of the seed set, the ids, the
    comparison id and the policies: not of battles_at_once, nor of `workers`
    (tests/test_ladder.py replays a comparison both ways).

    battles_at_once: battles the evaluation farm plays at once. workers: its worker processes
    (rollout.eval_workers); <= 1 plays in this process (farm.InlineFarm), more spawns a
    farm.ProcessFarm, built at the first play and replanned for each next one (design 7.1: one
    farm a gate), closed by close(). table: the codec table to pack with (the training run's, when the caller
    has it); None decides one on the evaluation env at open."""

    def __init__(self, env: EnvFactorySpec, seeds: EvalSeedSet, *, run_dir: str | Path | None = None,
                 run_id: str = "", policy_builder: PolicyBuilder | None = None,
                 battles_at_once: int = 8, iteration: int = -1,
                 clock: Callable[[], str] = utc_now, workers: int = 1, table: Any = None,
                 store: SnapshotStore | None = None) -> None:
        if battles_at_once < 1:
            raise ValueError(f"battles_at_once={battles_at_once}: at least one battle")
        self.env_factory_spec = eval_env_spec(env)
        self.seeds, self.run_dir, self.run_id = seeds, run_dir, run_id
        self.battles_at_once = battles_at_once
        self.workers = max(1, int(workers))
        self.iteration, self.clock = iteration, clock
        self.log = ResultLog(run_dir) if run_dir is not None else None
        # store: where snap: players are read (default the run's; a shipped model's folder, unrecorded)
        pool = read_pool(run_dir) if run_dir is not None else None
        self.players = EvalPlayers(store or (SnapshotStore(run_dir) if run_dir is not None else None),
                                   policy_builder, pool.seeds() if pool is not None else None)
        self.farm: Any = None              # the runner's farm, built at its first comparison
        self.obs_digest = self.context = ""
        self.closed = False
        self.comparison_prefix = ""        # prepended to default comparison ids: "gate/<candidate>/"
        self.seconds = 0.0
        self.farm_stats: dict[str, float] = {}     # the last comparison's farm.stats
        self.searched: dict[str, int] = {}         # ... and a's lookahead counters (farm section 6b)
        self.game_steps = 0                        # the battles' decisions, every comparison's (bench)
        self.last_farm = ""                        # its class: "InlineFarm" | "ProcessFarm"
        self._table = table
        self._open()

    # -- what the evaluation env is: read once, at open --
    def _open(self) -> None:
        es, table, statics = _eval_preflight(msgspec.json.encode(self.env_factory_spec),
                                             self.seeds.master_seed)
        self.env_spec, self.statics = es, statics
        self.table = self._table if self._table is not None else table
        self.obs_digest = es.obs_digest
        self.context = eval_context(es.env_value_digest, es.obs_digest, es.engine_build_digest)
        # A full match must end: twice its longest length in decisions is a fault, not a game [A].
        self.max_decisions = 2 * -(-(es.regular_ticks + es.overtime_ticks) // es.decision_ticks)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._drop_farm()

    def _drop_farm(self) -> None:
        if self.farm is not None:
            self.farm.close()
            self.farm = None

    def __enter__(self) -> "EvalRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- players (EvalPlayers) --
    @property
    def policies(self) -> dict[str, ActFn]:
        return self.players.policies

    def register(self, player_id: str, act: ActFn) -> None:
        self.players.register(player_id, act)

    def unregister(self, player_id: str) -> None:
        self.players.unregister(player_id)

    def check_pair(self, a: str, b: str) -> None:
        self.players.check_pair(a, b, self.obs_digest)

    # -- playing: schedule, play, score --
    def play(self, a: str, b: str, n_battles: int, *, comparison_id: str | None = None,
             kind: str = "eval", first_seed: int = 0, of: int | None = None) -> list[GameResult]:
        """n_battles / 2 seeds of the frozen set (the FIRST ones), each from both sides; results
        in (seed, blue, red) order; appended to games.jsonl as one fsynced batch. A sequential
        gate's look: those of a comparison of `of` battles from seed first_seed, which play (the
        comparison id, the seeds, the streams) what the whole comparison plays there."""
        if self.closed:
            raise ValueError("EvalRunner.play after close(): an evaluation farm is built per gate")
        if kind not in EVAL_KINDS:
            raise ValueError(f"EvalRunner.play(kind={kind!r}): evaluation writes {EVAL_KINDS} only")
        if a == b:
            raise ValueError(f"EvalRunner.play({a!r}, {b!r}): a player cannot be rated against itself")
        t0 = time.monotonic()
        cid = comparison_id or f"{self.comparison_prefix}{a}/vs/{b}/n{of or n_battles}"
        indices = comparison_seed_indices(self.seeds, n_battles, first_seed)
        self.check_pair(a, b)
        acts = {p: self.players.act(p) for p in (a, b)}
        order = [(s, side) for s in indices for side in SIDES]
        scores = self._run(order, a, b, acts, cid)
        wall = self.clock()
        games = [GameResult(a=a, b=b, score_a=scores[k], seed_index=s, side_a=side, context=self.context,
                            kind=kind, run_id=self.run_id, iteration=self.iteration, wall=wall)
                 for k, (s, side) in enumerate(order)]
        if self.log is not None:
            self.log.append(games)
        self.seconds += time.monotonic() - t0
        return games

    __call__ = play   # the WilsonGate's `play(a, b, n_battles)`

    def _run(self, order: list[tuple[int, str]], a: str, b: str, acts: dict[str, ActFn | None],
             cid: str) -> list[float]:
        """a's score in each episode of `order`, played on the runner's farm (design 7.1: built
        at the first comparison, closed with the runner, and at once on an error)."""
        plan = comparison_episodes(self.seeds, order, a, b, cid)
        comparison = FarmComparison(self, plan, order, a, acts, cid)
        try:
            f = self._farm_for(plan)
            scores = comparison.play(f)
        except BaseException:
            self._drop_farm()
            raise
        self.farm_stats, self.last_farm = comparison.farm_stats, type(f).__name__
        self.searched = dict(comparison.searched)
        self.game_steps += comparison.game_steps
        return scores

    def _farm_for(self, plan: list[farm.EvalEpisode]) -> Any:
        """The runner's farm, replanned for this comparison (farm.replan: the same workers and
        engines); built anew where the comparison's geometry differs: InlineFarm for workers <= 1,
        else a ProcessFarm of min(workers, battles) processes, battles = min(battles_at_once,
        len(plan)). The geometry decides only which battle hosts which episode (farm section 6:
        per-shard queues), never what an episode plays."""
        n = min(self.battles_at_once, len(plan))
        K = min(self.workers, n)
        per = -(-n // K)
        if self.farm is not None and (self.farm.cfg.workers, self.farm.cfg.games_per_worker) == (K, per):
            self.farm.replan(plan)
            return self.farm
        self._drop_farm()
        self.farm = self._build_farm(plan, K, per)
        return self.farm

    def _build_farm(self, plan: list[farm.EvalEpisode], K: int, per: int) -> Any:
        cfg = farm.FarmConfig(env=self.env_factory_spec, master_seed=self.seeds.master_seed,
                              workers=K, shards_per_worker=1, games_per_worker=per,
                              cycles=EVAL_CYCLES, frame_stack=1, viewer=False, eval_plan=plan)
        if K <= 1:
            return farm.InlineFarm(cfg, self.table)
        return farm.ProcessFarm(cfg, self.table, None, env_spec=self.env_spec)


def run_probe(runner: EvalRunner, learner_act: ActFn, env_steps: int, *,
              rungs: Sequence[str] = PROBE_RUNGS, probe_games: int = 40,
              resamples: int = 10_000) -> tuple[list[GameResult], dict[str, float | int]]:
    """Design 7.9: the live policy, named learner@{env_steps}, against each rung: probe_games
    battles per rung on the first probe_games / 2 frozen seeds, written kind="probe" (the fit
    never reads them), published through probe_metrics. The comparison id carries the step, so
    each probe draws its own action noise over the same start states. Returns the games and the
    metric keys (plus time/probe, the seconds it took)."""
    t0 = time.monotonic()
    lid = f"learner@{int(env_steps)}"
    runner.register(lid, learner_act)
    games: list[GameResult] = []
    metrics: dict[str, float | int] = {}
    try:
        for rung in rungs:
            g = runner.play(lid, rung, probe_games, comparison_id=f"probe/{lid}/vs/{rung}", kind="probe")
            games += g
            metrics.update(probe_metrics(g, lid, rung, runner.seeds.master_seed, resamples))
    finally:
        runner.unregister(lid)
    metrics["time/probe"] = time.monotonic() - t0
    return games, metrics


# --- 11. The picture: strength over training (design 7.8, 7.9, 9.2) ------------------------------
# `python ladder.py plot runs/<id>` draws what the run's files say, read only: the fitted rating
# of every snapshot against the game-steps it was taken at (the ladder's claim, with its 95%
# interval; champions and gate outcomes marked; the scripted players as level lines, the
# yardstick a reader knows), the probe's score per scripted rung against game-steps (the live
# policy), and the learning signals of metrics.jsonl. A live run is drawn as far as it has got.
# matplotlib is the optional extra [plot], imported here only, so `rate` stays dependency-free.

PLOT_SIGNALS = (("ppo/kl", "kl (nats)"), ("ppo/clip_fraction", "clip fraction"),
                ("ppo/entropy_normalised", "normalised entropy"),
                ("ppo/explained_variance", "explained variance"),
                ("policy/cards_per_match", "cards per match"))
"""The learning signals drawn under the strength panels: metric key, axis label (design 9.2)."""
GATE_COLOURS = {"admit+promote": "tab:green", "admit-as-cycle": "tab:orange", "discard": "tab:gray"}


class StrengthData(NamedTuple):
    """What the picture draws, read off a run directory."""
    context: str | None                          # the context rated (the one with the most eval games)
    table: RatingTable | None                    # None before the first evaluation game
    steps: dict[str, int]                        # snapshot player id -> env steps at the snapshot
    champions: list[str]                         # the champion chain, in order
    gates: dict[str, str]                        # candidate player id -> the gate's outcome
    rows: list[dict[str, Any]]                   # metrics.jsonl


def read_strength(run: Path) -> StrengthData:
    """The run's games, snapshots, pool, gate decisions and metric rows; nothing is written."""
    evals = [g for g in ResultLog(run).read().games if g.kind == "eval"]
    ctxs = collections.Counter(g.context for g in evals)
    context = ctxs.most_common(1)[0][0] if ctxs else None
    table = fit_ratings(eval_view(evals, context)[1]) if context else None
    store = SnapshotStore(run)
    steps = {snapshot_player_id(s): store.spec(s).step for s in store.ids()} if store.root.is_dir() else {}
    pool = read_pool(run)
    gates = {d.candidate: d.outcome for d in read_gate_decisions(run)}
    return StrengthData(context, table, steps, pool.champion_chain if pool else [], gates,
                        read_metric_rows(run))


def read_metric_rows(run: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows, one an iteration; none before the first iteration ends."""
    metrics = Path(run) / "metrics.jsonl"
    return read_log(metrics, msgspec.json.decode, "a metric row")[0] if metrics.exists() else []


def draw_strength(data: StrengthData, title: str, out: Path) -> None:
    """One figure: ratings over game-steps, probe scores over game-steps, the learning signals."""
    fig = _pyplot().figure(figsize=(14, 10), constrained_layout=True)
    grid = fig.add_gridspec(3, len(PLOT_SIGNALS), height_ratios=(3, 2, 1.4))
    _draw_ratings(fig.add_subplot(grid[0, :]), data)
    _draw_probe(fig.add_subplot(grid[1, :]), data.rows)
    for i, (key, label) in enumerate(PLOT_SIGNALS):
        _draw_signal(fig.add_subplot(grid[2, i]), key, label, [("", data.rows)], fontsize=9)
    _save(fig, title, out)


def draw_signals(series: Sequence[tuple[str, Sequence[dict[str, Any]]]], title: str, out: Path) -> None:
    """Several runs' learning signals side by side: a panel a signal, a line a run, one colour a
    run in every panel, the legend in the last cell (the screens of docs/learning.md 3.2). The
    runs' ratings are not drawn: each run's table is fitted in its own context, not comparable."""
    cols = 3
    nrows = -(-(len(PLOT_SIGNALS) + 1) // cols)   # the signals, and a cell for the legend
    fig, axes = _pyplot().subplots(nrows, cols, figsize=(14, 3.6 * nrows), constrained_layout=True,
                                   squeeze=False)
    cells = list(axes.flat)
    for ax, (key, label) in zip(cells, PLOT_SIGNALS, strict=False):   # cells outnumber the signals
        _draw_signal(ax, key, label, series, fontsize=10)
        ax.set_xlabel("game-steps", fontsize=8)
    handles, names = cells[0].get_legend_handles_labels()
    for ax in cells[len(PLOT_SIGNALS):]:
        ax.axis("off")
    cells[len(PLOT_SIGNALS)].legend(handles, names, loc="center", fontsize=10)
    _save(fig, title, out)


def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")   # a file, never a window: this runs on servers and in tests
    import matplotlib.pyplot as plt
    return plt


def _save(fig: Any, title: str, out: Path) -> None:
    fig.suptitle(title, fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    _pyplot().close(fig)


def _draw_signal(ax: Any, key: str, label: str, series: Sequence[tuple[str, Sequence[dict[str, Any]]]],
                 fontsize: int) -> None:
    """One metric key against game-steps, a line a (name, rows) series, coloured by its position so
    a run keeps its colour across panels; a run without the key still takes its colour's slot."""
    for i, (name, rows) in enumerate(series):
        pts = [(r["run/cumulative_env_steps"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        ax.plot(*(zip(*pts, strict=True) if pts else ([], [])), lw=0.8, color=f"C{i % 10}", label=name)
    ax.set_title(label, fontsize=fontsize)
    ax.tick_params(labelsize=7)


def _draw_ratings(ax: Any, data: StrengthData) -> None:
    t = data.table
    ax.set_title(f"rating (Elo-scale, anchor {ANCHOR} at 0) with 95% intervals; context {data.context}",
                 fontsize=10)
    ax.set_xlabel("game-steps at the snapshot")
    if t is None:
        ax.text(0.5, 0.5, "no evaluation games yet", ha="center", va="center", transform=ax.transAxes)
        return
    snaps = sorted((data.steps[p], p) for p in t.ids if p in data.steps)
    if snaps:
        x = [s for s, _ in snaps]
        y = [t.rating[p] for _, p in snaps]
        ax.errorbar(x, y, yerr=[Z95 * t.se[p] for _, p in snaps], fmt="o-", ms=4, lw=0.8, capsize=2,
                    color="tab:blue")
        for s, p in snaps:
            if p in data.gates:
                ax.scatter([s], [t.rating[p]], s=90, facecolors="none",
                           edgecolors=GATE_COLOURS.get(data.gates[p], "k"))
        champs = [(data.steps[p], t.rating[p]) for p in data.champions if p in data.steps and p in t.rating]
        if champs:
            ax.scatter(*zip(*champs, strict=True), marker="*", s=160, color="gold", edgecolors="k", zorder=3,
                       label="champion")
    ax.margins(x=0.12)   # room at the right edge for the rungs' labels beside the newest snapshot
    levels = fixed_levels(t)
    if snaps:   # the axis spans the snapshots' intervals, not a rung far below them (noop's 0)
        lo = min(t.rating[p] - Z95 * t.se[p] for _, p in snaps)
        hi = max(t.rating[p] + Z95 * t.se[p] for _, p in snaps)
        pad = 0.1 * max(hi - lo, 1.0)
        ax.set_ylim(lo - pad, hi + pad)
    on, off = level_labels(levels, *ax.get_ylim())
    for name, y, y_label in on:
        ax.axhline(y, ls="--", lw=0.7, color="tab:red", alpha=0.6)
        ax.annotate(f"{name} {y:.0f}", (1.0, y_label), xycoords=("axes fraction", "data"),
                    fontsize=7, color="tab:red", ha="right", va="bottom")
    if off:
        ax.text(0.995, 0.02, "off the scale: " + ", ".join(f"{n} {v:.0f}" for n, v in off),
                transform=ax.transAxes, fontsize=7, color="tab:red", ha="right", va="bottom")
    for outcome, colour in GATE_COLOURS.items():
        ax.scatter([], [], s=90, facecolors="none", edgecolors=colour, label=f"gate: {outcome}")
    ax.legend(fontsize=7, loc="upper left")


def fixed_levels(t: RatingTable) -> dict[str, float]:
    """The players drawn as levels, not points: the scripted rungs by their bare names, and the
    seeds (seed:<name>), frozen actors from outside the run with no game-step of it to stand at."""
    return {p.removeprefix("scripted:"): t.rating[p] for p in t.ids if p.startswith(("scripted:", "seed:"))}


def level_labels(levels: dict[str, float], lo: float, hi: float,
                 gap_frac: float = 0.035) -> tuple[list[tuple[str, float, float]], list[tuple[str, float]]]:
    """Where the levels' labels (fixed_levels) go on a rating axis from lo to hi: (name, rating,
    label y) for each level on the axis, ascending, each label at least gap_frac of the axis above
    the one below it (about a 7-point label's height on the plot's top panel), so levels a few Elo
    apart do not print over each other; and (name, rating) for each level off the axis."""
    gap, on, off, last = gap_frac * (hi - lo), [], [], -math.inf
    for name, y in sorted(levels.items(), key=lambda kv: (kv[1], kv[0])):
        if lo <= y <= hi:
            last = max(y, last + gap)
            on.append((name, y, last))
        else:
            off.append((name, y))
    return on, off


def _draw_probe(ax: Any, rows: Sequence[dict[str, Any]]) -> None:
    ax.set_title("probe: the live policy's score against each scripted rung, 95% bootstrap interval",
                 fontsize=10)
    ax.set_xlabel("game-steps")
    ax.set_ylim(-0.02, 1.02)
    rungs = sorted({k.removeprefix("ladder/score_vs/") for r in rows for k in r
                    if k.startswith("ladder/score_vs/")})
    for rung in rungs:
        pts = [(r["run/cumulative_env_steps"], r[f"ladder/score_vs/{rung}"],
                r[f"ladder/score_vs_ci95_lo/{rung}"], r[f"ladder/score_vs_ci95_hi/{rung}"])
               for r in rows if f"ladder/score_vs/{rung}" in r]
        x, y, lo, hi = (list(c) for c in zip(*pts, strict=True))
        ax.errorbar(x, y, yerr=[[a - b for a, b in zip(y, lo, strict=True)],
                                [b - a for a, b in zip(y, hi, strict=True)]],
                    fmt="o-", ms=3, lw=0.8, capsize=2, label=rung)
    if rungs:
        ax.legend(fontsize=7, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no probe yet (ladder.probe_every_iterations)", ha="center", va="center",
                transform=ax.transAxes)


def cmd_plot(args: Any) -> int:
    runs = [Path(r) for r in args.runs]
    if not runs:
        raise CliError("name a run directory, runs/<id> (or several, to draw their learning signals "
                       "side by side)")
    for run in runs:
        if not run.is_dir():
            raise CliError(f"{run}: no such directory (pass a run directory, runs/<id>)")
    if len(runs) > 1 and args.out is None:
        raise CliError(f"{len(runs)} runs are drawn into one picture, which belongs to none of them: "
                       "name it with --out FILE.png")
    labels = list(args.labels) or [r.name for r in runs]
    if len(runs) == 1 and args.labels:
        raise CliError("--labels names the lines of several runs; one run's picture has none")
    if len(labels) != len(runs):
        raise CliError(f"--labels: {len(labels)} labels for {len(runs)} runs (one each, in the runs' order)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError("plot needs matplotlib: pip install -e '.[plot]' "
                       "(or pip install matplotlib)") from None
    # a path with nothing in it to draw (a typo, runs/ instead of runs/<id>) gets no picture
    empty = "nothing to draw: no metric rows (metrics.jsonl; a run writes its first when iteration 1 ends)"
    if len(runs) > 1:
        series = [(label, read_metric_rows(run)) for label, run in zip(labels, runs, strict=True)]
        for run, (_, rows) in zip(runs, series, strict=True):
            if not rows:
                print(f"{run}: {empty}")
                return 1
        draw_signals(series, f"learning signals of {len(runs)} runs", Path(args.out))
        print(f"wrote {args.out}")
        return 0
    run = runs[0]
    data = read_strength(run)
    if not data.rows and data.table is None:
        print(f"{run}: {empty} and no evaluation games")
        return 1
    out = Path(args.out) if args.out else run / "strength.png"
    draw_strength(data, f"{run.name}: {len(data.rows)} iterations, "
                        f"{data.rows[-1]['run/cumulative_env_steps']:,} game-steps"
                        if data.rows else run.name, out)
    if data.table is None:
        print(f"{run}: no evaluation games yet, so no ratings in the picture; {_first_due(run)}")
    print(f"wrote {out}")
    return 0


# --- 12. The training loop's ladder (design 10.1) -------------------------------------------------------
# What one iteration of training asks of the ladder, in one object the training script drives. The
# script owns torch and its networks, so it hands them in (LearnerNets); this file never imports it.


class LearnerNets(NamedTuple):
    """The training script's network functions, as LadderLoop calls them (ppo_clash.NETS; a fork's
    own, so its snapshots are built and played by its own network)."""
    load: Callable[..., Any]      # (spec, tensors, device) -> a network that acts on the device
    write: Callable[..., str]     # (run, network, *, obs_digest, action_digest, codec_table_digest,
    #                               step, context, run_id_) -> "snap:<sha16>"
    players: Callable[..., PolicyBuilder]   # (run, device, *, table, release_mode) -> PolicyBuilder
    act: Callable[..., ActFn]     # (network, table, device, release_mode) -> ActFn, for the probe
    decode: Callable[..., Any]    # (mode, field) -> how a resident opponent picks its action


class LadderSetupChanged(ValueError):
    """A resume that would change what the ladder fixed at the run's start (its seats' deck, its
    seed snapshots): refused in one line, whatever --allow-identity-drift says."""


def refuse_changed_setup(L: Any, cfg: MatchConfig, pool: Pool) -> None:
    """What a run fixed at its start cannot change at a resume, not even under
    --allow-identity-drift: the seats the battles deal the deck to (the checkpoint's battles and
    its matchmaker's seats, cfg, hold them) and the seeds its pool admitted. L: the ladder arguments
    the run resumes with."""
    if cfg.fixed_seats != bool(L.seat_decks.deck):
        started = "with" if cfg.fixed_seats else "without"
        raise LadderSetupChanged(f"ladder.seat_decks.deck: the checkpoint's run was started {started} "
                                 "one; a run cannot take or drop its deck at a resume (start a new run)")
    held = sorted(pool.seeds())
    if held != sorted(f"seed:{sd.name}" for sd in L.seed_snapshots):
        raise LadderSetupChanged(f"ladder.seed_snapshots: the checkpoint's pool holds {held or 'none'}; "
                                 "seeds are admitted at a run's start only (start a new run)")


def match_config(L: Any) -> MatchConfig:
    """The matchmaker's configuration, from the run's ladder arguments."""
    return MatchConfig(mix=tuple(L.mix), max_resident_opponents=L.max_resident_opponents,
                       pfsp_power=L.pfsp_power, pfsp_uniform_floor=L.pfsp_uniform_floor,
                       scripted_opponents=tuple(L.scripted_opponents),
                       fixed_seats=bool(L.seat_decks.deck))


class LadderLoop:
    """The ladder's side of the training loop (design 10.1): the matchmaker and the pool, the stable
    table of resident snapshots the farm's group ids index, the gate on its cadence, floor admits,
    refits, eviction, the probe, the kind="train" results and the ladder/* keys of the row.

    Why a stable resident table: an Assignment carries its opponent's GROUP id for the whole
    episode, and an episode spans iteration boundaries, while Matchmaker.plan redraws the resident
    set every iteration. So group g means self.slots[g] for the run, a slot is reused only once no
    live assignment points at it, and SlotPlan.resident_snapshots is this table (bare sha16 ids,
    a seed's its copy's: the farm names the seat by the assignment's opponent id)."""

    def __init__(self, args: Any, nets: LearnerNets, run: Path, rid: str, seed: int, n_battles: int,
                 env_spec: Any, table: Any, device: Any, match_seed: int | None = None,
                 voice: bool = True) -> None:
        """seed: the run's master seed (the frozen eval seeds, the gate's draws); match_seed: this
        rank's (Env.seed). voice False: a torchrun rank other than 0, which plans its own battles
        against the pool rank 0 shares after each ladder step (follow) and writes nothing."""
        self.args, self.run, self.rid, self.seed, self.device, self.table = \
            args, run, rid, seed, device, table
        self.env_spec, self.voice, self.nets = env_spec, voice, nets
        L = args.ladder
        self.mm = Matchmaker(seed if match_seed is None else match_seed, n_battles, match_config(L))
        self.pool = Pool()
        self.ratings: RatingTable | None = None
        self.slots: list[str] = []
        self.gate_attempts = self.gate_passes = self.evictions = 0
        self.last_gate: GateDecision | None = None
        self.last_candidate_step = self.last_floor_step = 0
        self.seconds_gate = self.seconds_probe = 0.0
        self.gate_discards_in_a_row = 0
        # design 7.2 layer 1: a sequential Elo over the kind="train" games, for the dashboard between
        # refits. The learner is one player ("learner"), whatever its step; order = episode order
        self.elo = EloReadout()
        # frozen per run: a resumed run keeps its set even under --allow-identity-drift of the seed
        self.seeds = (read_run_seeds(run) if (ladder_dir(run) / "eval_seeds.json").exists()
                      else load_or_create_eval_seeds(run, seed, L.eval_seed_count))
        if voice:
            write_eval_env(run, env_spec)
        self.eval_obs_digest, self.context = eval_digests(env_spec, seed)
        self.log = ResultLog(run)
        self.store = SnapshotStore(run)
        self.cache = LoadedPolicyCache(
            self.store, lambda spec, t: nets.load(spec, t, device), L.max_resident_opponents + 2,
            {"obs_digest": self.eval_obs_digest, "codec_table_digest": table.digest()})
        self.opponent_decode = nets.decode(L.opponent_mode, "ladder.opponent_mode")
        self.gate_cfg = GateConfig(**{k: v for k, v in dataclasses.asdict(L.gate).items()
                                      if k in GateConfig.__struct_fields__})

    # -- snapshots and the pool --
    def snapshot(self, model: Any, step: int, action_digest: str) -> str:
        return self.nets.write(self.run, model, obs_digest=self.eval_obs_digest, action_digest=action_digest,
                               codec_table_digest=self.table.digest(), step=step, context=self.context,
                               run_id_=self.rid)

    def admit(self, pid: str, step: int, promote: bool, cycle: bool = False, sample: bool = True) -> None:
        self.pool.admit(PoolMember(id=pid, step=int(step), cycle=cycle), promote=promote,
                        sample=sample)
        self.evictions += len(hall_of_fame_evict(self.pool, self.ratings,
                                                 self.args.ladder.pool_working_size))
        write_pool(self.run, self.pool)

    def admit_seeds(self, specs: Sequence[Any]) -> None:
        """The seed snapshots, copied byte for byte into the run's archive (so a seed plays from
        the run, whatever becomes of its folder) and admitted as seed:<name>, never promoted."""
        for sd, spec in zip(self.args.ladder.seed_snapshots, specs, strict=True):
            self.pool.admit(PoolMember(id=f"seed:{sd.name}", step=spec.step, seed=True,
                                       snapshot=self.store.copy_in(sd.path), weight=sd.weight),
                            promote=False)
        write_pool(self.run, self.pool)

    # -- the plan --
    def _slot(self, pid: str, live: set[int]) -> int:
        sid = self.pool.snapshot_id(pid)
        if sid in self.slots:
            return self.slots.index(sid)
        resident = {self.pool.snapshot_id(r) for r in self.mm.residents}
        for g, s in enumerate(self.slots):   # reuse a slot nobody resident or playing points at
            if g not in live and s not in resident:
                self.slots[g] = sid
                return g
        if len(self.slots) >= 127:
            raise RuntimeError("resident table is full (127 int8 group ids are live); this cannot happen "
                               f"with max_resident_opponents={self.args.ladder.max_resident_opponents}")
        self.slots.append(sid)
        return len(self.slots) - 1

    def remap(self, a: Any) -> Any:
        """The matchmaker's Assignment with its resident index turned into this table's slot."""
        if a.group[0] >= 0 or a.group[1] >= 0:
            g = self.slots.index(self.pool.snapshot_id(a.opponent_id))
            a = msgspec.structs.replace(a, group=tuple(g if x >= 0 else x for x in a.group))
        return a

    def assign(self, battle: int, ordinal: int) -> Any:
        return self.remap(self.mm.assign(battle, ordinal))

    def plan(self, iteration: int, ordinals: Sequence[int], current: Sequence[Any] | None) -> Any:
        """The iteration's SlotPlan: the matchmaker draws this iteration's residents and weights;
        a battle mid-episode keeps its current assignment (design 3.6), so the table is `current`
        when the farm has one, else the matchmaker's opening table."""
        p = self.mm.plan(iteration, ordinals, self.pool, self.ratings)
        live = {int(g) for a in (current or ()) if a is not None for g in a.group if g >= 0}
        for pid in self.mm.residents:
            self._slot(pid, live)
        table = tuple(current) if current is not None and all(a is not None for a in current) else \
            tuple(self.remap(a) for a in p.assignment)
        return farm.SlotPlan(iteration=iteration, n_battles=p.n_battles, n_slots=p.n_slots, assignment=table,
                             resident_snapshots=tuple(self.slots))

    def policy(self, g: int) -> Any:
        return self.cache.get(self.slots[g])

    # -- results, cadences, metrics --
    def record_train(self, episodes: Sequence[Any], iteration: int, env_steps: int) -> None:
        """kind="train" (never fitted): one result per learner seat of a non-mirror episode."""
        wall = utc_now()
        games = [GameResult(a=f"learner@{env_steps}", b=e.opponent_id,
                            score_a=WINNER_SCORE[int(e.outcome)], seed_index=-1,
                            side_a=SIDES[e.seat], context=self.context, kind="train",
                            run_id=self.rid, iteration=iteration, wall=wall)
                 for e in episodes if e.policy_id == "learner" and e.bucket != "mirror"]
        for gm in games:
            self.elo.update("learner", gm.b, gm.score_a)
        if games:
            self.log.append(games)

    def refit(self) -> None:
        _, view = eval_view(self.log.read().games, self.context)
        self.ratings = fit_ratings(view) if view else None
        if self.ratings is not None:
            write_ratings(self.run, self.ratings)

    def _runner(self, iteration: int) -> Any:
        r = self.args.rollout
        return EvalRunner(self.env_spec, self.seeds, run_dir=self.run, run_id=self.rid,
                          policy_builder=self.nets.players(
                              self.run, str(self.device), table=self.table,
                              release_mode=self.args.ladder.release_mode),
                          battles_at_once=r.eval_workers * r.eval_games_per_worker,
                          iteration=iteration, workers=r.eval_workers, table=self.table)

    def gate(self, model: Any, iteration: int, env_steps: int, action_digest: str) -> Any:
        """design 7.4: snapshot the learner, play the WilsonGate on its own farm, apply the outcome."""
        t0 = time.perf_counter()
        cand = self.snapshot(model, env_steps, action_digest)
        self.refit()   # condition 3 reads the champion's fitted rating
        with self._runner(iteration) as r:
            r.comparison_prefix = f"gate/{cand}/"
            _, history = eval_view(self.log.read().games, r.context)
            dec, _ = WilsonGate(self.gate_cfg, self.seed, self.seeds.sha256).evaluate(
                cand, self.pool.champion, list(self.pool.sampler), self.ratings, r, history)
        write_gate_decision(self.run, dec)
        self.gate_attempts += 1
        self.last_gate = dec
        self.gate_discards_in_a_row = 0 if dec.admit else self.gate_discards_in_a_row + 1
        if dec.admit:
            self.gate_passes += 1
            self.admit(cand, env_steps, promote=dec.promote, cycle=dec.cycle)
        self.last_candidate_step = env_steps
        self.refit()
        self.seconds_gate += time.perf_counter() - t0
        return dec

    def floor(self, model: Any, env_steps: int, action_digest: str) -> None:
        """A plateau cannot starve the pool: a snapshot admitted without the gate (never champion)."""
        pid = self.snapshot(model, env_steps, action_digest)
        if all(m.id != pid for m in self.pool.members):
            self.admit(pid, env_steps, promote=False)
        self.last_floor_step = env_steps

    def probe(self, model: Any, iteration: int, env_steps: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self._runner(iteration) as r:
            _, m = run_probe(r, self.nets.act(model, self.table, self.device,
                                              self.args.ladder.release_mode), env_steps,
                             rungs=self.args.ladder.probe_opponents,
                             probe_games=self.args.ladder.probe_games,
                             resamples=self.args.ladder.gate.bootstrap_resamples)
        self.seconds_probe += time.perf_counter() - t0
        return m

    def keys(self, wall: float) -> dict[str, Any]:
        """The row's ladder/* keys: what ladder.ladder_metrics reads off the pool and the fit, and what
        only the loop knows (the gate's and probe's share of the wall clock, the Elo readout, the
        champion's lead over v0)."""
        m = ladder_metrics(self.ratings, self.pool, self.mm, self.last_gate, self.gate_attempts,
                           self.gate_passes, self.evictions)
        m["ladder/gate_seconds_frac"] = self.seconds_gate / max(wall, 1e-9)
        m["ladder/probe_seconds_frac"] = self.seconds_probe / max(wall, 1e-9)
        m["ladder/gate_consecutive_discards"] = self.gate_discards_in_a_row
        if "learner" in self.elo.rating:
            m["ladder/elo_readout"] = self.elo.rating["learner"]
        champ, v0 = self.pool.champion, self.pool.v0
        if self.ratings is not None and champ in self.ratings.rating and v0 in self.ratings.rating:
            m["ladder/rating_above_v0"] = self.ratings.rating[champ] - self.ratings.rating[v0]
        return m

    def join(self, comm: Any) -> None:
        """job_roles: every rank's battle roles in rank order, as every_episode numbers the battles,
        which rank 0's role counts read (one process: its own)."""
        self.job_roles = np.concatenate([np.asarray(r) for r in comm.everyone(self.mm.roles)])

    def shared(self) -> tuple[Any, Any]:
        """What rank 0's ladder step decided that every rank's matchmaker reads: pool and ratings."""
        return self.pool, self.ratings

    def follow(self, shared: tuple[Any, Any]) -> None:
        self.pool, self.ratings = shared

    # -- the checkpoint --
    def state(self, assignment: Sequence[Any]) -> dict[str, Any]:
        return {"matchmaker": msgspec.to_builtins(self.mm.state()), "pool": msgspec.to_builtins(self.pool),
                "ratings": msgspec.to_builtins(self.ratings) if self.ratings is not None else None,
                "slots": list(self.slots), "assignment": [msgspec.to_builtins(a) for a in assignment],
                "gate_attempts": self.gate_attempts, "gate_passes": self.gate_passes,
                "evictions": self.evictions,
                "last_gate": msgspec.to_builtins(self.last_gate) if self.last_gate is not None else None,
                "last_candidate_step": self.last_candidate_step, "last_floor_step": self.last_floor_step,
                "seconds_gate": self.seconds_gate, "seconds_probe": self.seconds_probe,
                "gate_discards_in_a_row": self.gate_discards_in_a_row,
                "elo": dict(sorted(self.elo.rating.items()))}

    def load(self, st: dict[str, Any]) -> list[Any]:
        """Restore; returns the saved assignment table (the resumed farm's opening plan)."""
        self.mm = Matchmaker.from_state(msgspec.convert(st["matchmaker"], MatchmakerState))
        self.pool = msgspec.convert(st["pool"], Pool)
        refuse_changed_setup(self.args.ladder, self.mm.cfg, self.pool)
        if self.voice:
            # pool.json follows the checkpoint, not admits made after it
            write_pool(self.run, self.pool)
        self.ratings = (msgspec.convert(st["ratings"], RatingTable) if st["ratings"] is not None
                        else None)
        self.slots = list(st["slots"])
        self.gate_attempts, self.gate_passes, self.evictions = \
            st["gate_attempts"], st["gate_passes"], st["evictions"]
        self.last_gate = (msgspec.convert(st["last_gate"], GateDecision) if st["last_gate"] is not None
                          else None)
        self.last_candidate_step, self.last_floor_step = st["last_candidate_step"], st["last_floor_step"]
        self.seconds_gate, self.seconds_probe = st["seconds_gate"], st["seconds_probe"]
        # absent from older checkpoints
        self.gate_discards_in_a_row = int(st.get("gate_discards_in_a_row", 0))
        self.elo.rating = {k: float(v) for k, v in st.get("elo", {}).items()}
        return [msgspec.convert(a, farm.Assignment) for a in st["assignment"]]


# --- 13. CLI --------------------------------------------------------------------------------------

def _format_table(run_dir: str, t: RatingTable, torn: bool, pool: Pool | None = None) -> str:
    lines = [f"run {run_dir}  context {t.context}  eval games {t.n_total}  "
             f"anchor {t.anchor} (pinned at 0)"]
    if torn:
        lines.append("note: games.jsonl ends in a torn line (a crash mid-write); it is ignored")
    lines.append(f"{'id':<32} {'rating':>8} {'se':>7} {'ci95_lo':>8} {'ci95_hi':>8} {'games':>7}")
    for p in sorted(t.ids, key=lambda q: (-t.rating[q], q)):
        r, s = t.rating[p], t.se[p]
        lines.append(f"{p:<32} {r:8.1f} {s:7.1f} {r - Z95 * s:8.1f} {r + Z95 * s:8.1f} {t.n_games[p]:7d}")
    if t.draws == "davidson":
        lines.append(f"draws: davidson nu={t.draw_nu:.4f} (draw rate {100 * t.draw_rate:.1f}%)")
    else:
        why = (f"fallback: draw rate {100 * t.draw_rate:.1f}% < {100 * MIN_DRAW_RATE:.0f}%"
               if t.draw_fallback else "configured")
        lines.append(f"draws: half_win ({why})")
    res = "n/a" if t.transitivity_residual is None else f"{t.transitivity_residual:.3f}"
    lines.append(f"transitivity residual: {res} over {t.residual_pairs} pairs with >= "
                 f"{RESIDUAL_MIN_GAMES} games   (converged={t.converged} in {t.iterations} Newton steps)")
    champ, v0 = (pool.champion, pool.v0) if pool is not None else (None, None)
    if champ in t.rating and v0 in t.rating and champ != v0:
        # the difference's own error, from the 2x2 covariance block: the two ratings are correlated
        # through the games they share, so their marginal errors summed would overstate it
        d, se = t.rating[champ] - t.rating[v0], t.se_diff(champ, v0)
        lines.append(f"champion {champ} above v0 {v0}: {d:.1f} +- {se:.1f} "
                     f"(95% [{d - Z95 * se:.1f}, {d + Z95 * se:.1f}])")
    return "\n".join(lines)


def _first_due(run: Path) -> str:
    """When the first rated games are due, read off the run's config.json where it says."""
    try:
        lad = msgspec.json.decode((run / "config.json").read_bytes()).get("ladder", {})
        due = f"the first gate is due at env step {int(lad['candidate_every_env_steps']):,}"
        if lad.get("probe_every_iterations"):
            due += f", the first probe at iteration {int(lad['probe_every_iterations'])}"
        return due
    except (OSError, msgspec.DecodeError, KeyError, AttributeError, TypeError, ValueError):
        return "ratings appear after the first gate (ladder.candidate_every_env_steps)"


def cmd_rate(args: Any) -> int:
    if not Path(args.run).is_dir():
        raise CliError(f"{args.run}: no such directory (pass a run directory, runs/<id>)")
    log = ResultLog(args.run)
    read = log.read()
    evals = [g for g in read.games if g.kind == "eval"]
    ctxs = [args.context] if args.context else contexts_of(evals)
    if not evals or not any(g.context in ctxs for g in evals):
        print(f"{args.run}: no evaluation games yet in {log.path} ({len(read.games)} other games); "
              f"{_first_due(Path(args.run))}")
        return 1
    out = []
    for ctx in ctxs:
        _, view = eval_view(evals, ctx)
        out.append(_format_table(args.run, fit_ratings(view), read.torn_tail is not None,
                                 read_pool(args.run)))
    print("\n\n".join(out))
    return 0


class CliError(ValueError):
    """A command that cannot run on this run directory; main() prints it and exits 2."""


def _run_config(run: Path) -> dict[str, Any]:
    path = run / "config.json"
    if not path.exists():
        return {}
    doc = msgspec.json.decode(path.read_bytes())
    return doc if isinstance(doc, dict) else {}


def write_eval_env(run_dir: str | Path, train: EnvFactorySpec) -> Path:
    """ladder/eval_env.json: the evaluation env of the run (the training env without truncation),
    written once at run start so `ladder.py eval|gate` play exactly what the run's gates play."""
    path = ladder_dir(run_dir) / "eval_env.json"
    write_atomic(path, _json_pretty(eval_env_spec(train)))
    return path


def read_run_env(run: Path) -> tuple[EnvFactorySpec, str]:
    """The run's evaluation env and where it came from: ladder/eval_env.json, else rebuilt from
    config.json's obs section (reveal flags, decision_ms), else farm.default_env_spec()."""
    path = ladder_dir(run) / "eval_env.json"
    if path.exists():
        return msgspec.json.decode(path.read_bytes(), type=EnvFactorySpec), str(path)
    obs = _run_config(run).get("obs")
    spec = farm.default_env_spec()
    if not isinstance(obs, dict):
        return spec, "farm.default_env_spec() (the run has no ladder/eval_env.json or config.json obs)"
    reveal = [str(f) for f in obs.get("reveal") or ()]
    if reveal:
        kw = {"reveal": {"cls": "royalegym.obs.Reveal", "kwargs": {f: True for f in reveal}}}
        spec = msgspec.structs.replace(spec,
                                       obs_builder=farm.ComponentSpec("royalegym.obs.SpatialObsBuilder", kw))
    spec = msgspec.structs.replace(spec, decision_ms=int(obs.get("decision_ms", spec.decision_ms)))
    return spec, f"{run / 'config.json'} (obs.reveal={reveal}, obs.decision_ms={spec.decision_ms})"


def read_run_seeds(run: Path) -> EvalSeedSet:
    """The run's frozen seed set: ladder/eval_seeds.json (verified), else drawn exactly as the run
    draws it, from config.json's master_seed and ladder.eval_seed_count, and written there."""
    path = ladder_dir(run) / "eval_seeds.json"
    if path.exists():
        s = msgspec.json.decode(path.read_bytes(), type=EvalSeedSet)
        if _seed_sha(s.seeds) != s.sha256:
            raise CliError(f"{path}: sha256 does not match its seeds; the frozen set was edited")
        return s
    cfg = _run_config(run)
    if "master_seed" not in cfg:
        raise CliError(f"{run}: neither {path} nor a config.json with master_seed: no frozen eval seed set "
                       f"to play; is this a run directory?")
    count = int((cfg.get("ladder") or {}).get("eval_seed_count", 500))
    return load_or_create_eval_seeds(run, int(cfg["master_seed"]), count)


def _run_id(run: Path) -> str:
    for name in ("identity.json", "config.json"):
        path = run / name
        if path.exists():
            doc = msgspec.json.decode(path.read_bytes())
            if isinstance(doc, dict) and isinstance(doc.get("run_id"), str):
                return doc["run_id"]
    return run.resolve().name


def snapshot_builder(run: Path | None, device: str, **kw: Any) -> PolicyBuilder:
    """snap: players for a command (this CLI, checks.py play), each built by the script that
    trained it, its spec's builder: that script's snapshot_policy_builder, so a fork's snapshot
    plays with the fork's network. This file imports no script above it; a snapshot names one, as
    a decode mode names its plugin. Only a command that plays a snapshot loads one, and torch with
    it. kw: snapshot_policy_builder's table, store and release_mode."""
    store = kw.get("store") or SnapshotStore(run)
    made: dict[str, PolicyBuilder] = {}

    def build(snapshot_id: str) -> ActFn:
        name = store.spec(snapshot_id).script()
        if name not in made:
            made[name] = training_script(name).snapshot_policy_builder(run, device=device,
                                                                       **{**kw, "store": store})
        return made[name](snapshot_id)
    return build


def training_script(name: str) -> Any:
    """The training script a snapshot names (or checks.py's --script), from this file's folder,
    loaded once as the module of its name (a script already imported, as in a training run's own
    process, is the one used)."""
    path = Path(__file__).resolve().parent / name
    if Path(name).name != name or path.suffix != ".py":
        raise CliError(f"a snapshot names its builder {name!r}, not a script's file name")
    mod = sys.modules.get(path.stem)
    if mod is None:
        if not path.is_file():
            raise CliError(f"a snapshot was trained by {name}, which is not beside ladder.py in "
                           f"{path.parent}: put the script there to play it (scripted players need none)")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException as exc:   # no half-made module stays behind under the script's name
            del sys.modules[path.stem]
            if isinstance(exc, ImportError):
                raise CliError(f"playing a snapshot of {name} needs what it imports ({exc}); scripted "
                               f"players need neither") from None
            raise
    if not callable(getattr(mod, "snapshot_policy_builder", None)):
        raise CliError(f"{name} has no snapshot_policy_builder(run_dir, device='cpu', ...) -> "
                       f"(snapshot_id -> act(obs_batch, uniforms) -> actions): its snapshots cannot be "
                       f"played")
    return mod


def _open_runner(args: Any, players: Sequence[str]) -> EvalRunner:
    run = Path(args.run)
    if not run.is_dir():
        raise CliError(f"--run {run}: no such directory")
    env, where = read_run_env(run)
    print(f"evaluation env from {where}", file=sys.stderr)
    seeds = read_run_seeds(run)
    builder = (snapshot_builder(run, args.device) if any(p.startswith(SNAPSHOT_PLAYERS) for p in players)
               else None)
    return EvalRunner(env, seeds, run_dir=run, run_id=_run_id(run), policy_builder=builder,
                      battles_at_once=args.battles_at_once, workers=_eval_workers(args, run))


def _seeds_asked(args: Any, held: int, default: int) -> int:
    """--seeds as given, refused below 1 or above the seed set (a --master-seed set is drawn to
    its size); not given, `default` up to the set's size."""
    if args.seeds is None:
        return min(default, held)
    if args.seeds < 1:
        raise CliError(f"--seeds {args.seeds}: must be at least 1 (each seed is played from both sides)")
    if args.seeds > held:
        raise CliError(f"--seeds {args.seeds}: the run's frozen set holds {held} seeds "
                       f"(ladder.eval_seed_count); pass at most {held}, or --master-seed S, which draws a "
                       f"set of any size")
    return args.seeds


def _eval_workers(args: Any, run: Path | None) -> int:
    """--eval-workers, else the run's rollout.eval_workers, else 1."""
    if args.eval_workers is not None:
        return args.eval_workers
    rollout = _run_config(run).get("rollout", {}) if run is not None else {}
    return int(rollout.get("eval_workers", 1)) if isinstance(rollout, dict) else 1


def cmd_eval(args: Any) -> int:
    """Play --a against --b on the first --seeds frozen seeds, both sides. Two of a run's players on
    its own seed set: the games are appended to its log. A snapshot folder (a shipped model) on
    either side, or --master-seed S: printed only, as `yardstick` does."""
    run = Path(args.run) if args.run else None
    store = SnapshotStore(run)
    a, b = (_folder_player(p, store) for p in (args.a, args.b))
    recorded = run is not None and not store.folders and args.master_seed is None
    if run is None and args.master_seed is None:
        raise CliError("pass --run RUN (its players on its frozen seeds), or --master-seed S with "
                       "snapshot folders such as models/<name>")
    loose = [p for p in (a, b) if run is None and p.startswith(SNAPSHOT_PLAYERS)
             and p.removeprefix("snap:") not in store.folders]
    if loose:
        raise CliError(f"{loose[0]}: a run's snapshot needs --run RUN; without one, pass a snapshot folder")
    envs = {str(f): (f / "eval_env.json").read_bytes() for f in store.folders.values()
            if (f / "eval_env.json").is_file()}
    if run is None and len(set(envs.values())) > 1:
        raise CliError(f"{' and '.join(sorted(envs))}: their eval_env.json differ; two players are "
                       "compared in one evaluation env")
    n_prior = sum(1 for g in ResultLog(run).read().games if {g.a, g.b} == {a, b}) \
        if recorded and (ladder_dir(run) / "games.jsonl").exists() else 0
    runner = _open_runner(args, (a, b)) if recorded else _runner_for(args, run, (a, b), store, False, print)
    with runner as r:
        n_seeds = _seeds_asked(args, len(r.seeds.seeds), len(r.seeds.seeds))
        # The acting streams are addressed by how many games the pair already has, so a second
        # `eval` of the same pair adds new games rather than replaying the first byte for byte.
        cid = f"cli/{a}/vs/{b}/after/{n_prior}"
        games = r.play(a, b, 2 * n_seeds, comparison_id=cid)
        secs = r.seconds
    ps = paired_scores(games, a, b)
    lo, hi = bootstrap_interval(ps.x, r.seeds.master_seed, f"{cid}/summary", 10_000)
    rho = paired_rho(ps)
    print(f"{a} vs {b}: score {ps.mean:.3f} over {len(ps.x)} seeds ({ps.n_battles} battles), "
          f"95% bootstrap interval [{lo:.3f}, {hi:.3f}], paired_rho "
          f"{'n/a' if rho is None else f'{rho:.3f}'}, context {r.context}")
    print(f"appended {len(games)} kind=eval games to {ResultLog(run).path} in {secs:.1f} s" if recorded else
          f"played {len(games)} battles in {secs:.1f} s on master seed {r.seeds.master_seed}'s seed set; "
          "recorded nowhere (only a run's own players on its frozen set go to its log)")
    return 0


def _gate_config(run: Path) -> GateConfig:
    gate = ((_run_config(run).get("ladder") or {}).get("gate") or {})
    names = {f for f in GateConfig.__struct_fields__ if f != "anchors"}
    return GateConfig(**{k: v for k, v in gate.items() if k in names})


def cmd_gate(args: Any) -> int:
    """The WilsonGate on --candidate against the run's champion (ladder/pool.json or --champion).
    Writes ladder/gates/<candidate>.json and appends every battle; admits nothing into the pool."""
    run = Path(args.run)
    pool = read_pool(run)
    champion = args.champion or (pool.champion if pool is not None else None)
    if champion is None:
        raise CliError(f"{run}: no champion to gate against ({ladder_dir(run) / 'pool.json'} is absent or "
                       f"has no champion yet); pass --champion ID")
    decision_path = ladder_dir(run) / "gates" / f"{_file_name(args.candidate)}.json"
    if decision_path.exists():
        raise CliError(f"{args.candidate} was already gated ({decision_path}); a candidate is evaluated "
                       f"once and a failed one is discarded, not retried (design 7.4)")
    members = list(pool.sampler) if pool is not None else []
    cfg = _gate_config(run)
    with _open_runner(args, (args.candidate, champion, *members)) as r:
        r.comparison_prefix = f"gate/{args.candidate}/"
        _, history = eval_view(ResultLog(run).read().games, r.context)
        ratings = fit_ratings(history) if history else None
        gate = WilsonGate(cfg, r.seeds.master_seed, r.seeds.sha256)
        decision, played = gate.evaluate(args.candidate, champion, members, ratings, r, history)
    path = write_gate_decision(run, decision)
    print(f"gate {args.candidate} vs champion {champion}: {decision.outcome}"
          + (f" (failed: {', '.join(decision.failed)})" if decision.failed else ""))
    for name, c in decision.conditions.items():
        if c.skipped:
            print(f"  {name:<32} {c.reason}")
        else:
            print(f"  {name:<32} n={c.n:<5} observed={c.observed:.3f} bound={c.bound:.3f} "
                  f"{'pass' if c.passed else 'FAIL'}")
    print(f"{len(played)} battles appended to {ResultLog(run).path}; decision in {path}; the pool is "
          f"not changed (a CLI gate admits nothing into a live run)")
    return 0


YARDSTICK_SEEDS = 20
"""yardstick's default seeds a rung: 40 battles, about 25 s a rung on the cpu profile's 2-core
machine [A: 0.58 s a battle, docs/ladder.md section 9]; --seeds for more."""


def cmd_yardstick(args: Any) -> int:
    """A snapshot against every scripted rung, paired on frozen seeds, one line a rung (--json: one
    object a rung on stdout, the rest on stderr). The snapshot: the run's champion by default, a
    run's snap:<id>, or a snapshot folder (a shipped model, models/<name>/). The seeds: the run's
    frozen set, or with --master-seed S a set drawn from S, which nobody tuned on. --release-mode
    plays it by another decode than the run's. Only a run's own snapshot on its own seed set, in its
    own release mode, is appended to its log (kind="eval" games, so `rate` puts the rungs on the
    scale); anything else is printed and recorded nowhere."""
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    run = Path(args.run) if args.run else None
    store = SnapshotStore(run)
    snap = _yardstick_player(args, run, store)
    if run is None and args.master_seed is None:
        raise CliError(f"--snapshot {args.snapshot} without --run has no frozen seed set: "
                       "pass --master-seed S")
    recorded = (run is not None and not store.folders and args.master_seed is None
                and args.release_mode is None)
    prior = (collections.Counter(frozenset((g.a, g.b)) for g in ResultLog(run).read().games) if recorded
             else {})
    rungs = yardstick_rungs(args.rungs, snap)
    say(f"yardstick: {snap} against {'every scripted rung' if not args.rungs else ', '.join(rungs)}, "
        "both sides of each seed" + (f" ({PRIVILEGED_NOTE})" if snap.startswith(farm.LOOKAHEAD) else ""))
    with _runner_for(args, run, (snap, *rungs), store, recorded, say, args.release_mode) as r:
        n_seeds = _seeds_asked(args, len(r.seeds.seeds), YARDSTICK_SEEDS)
        for row in yardstick(r, snap, n_seeds, prior, rungs):
            print(msgspec.json.encode(row).decode() if args.json else yardstick_line(row, r.workers),
                  flush=True)
        secs = r.seconds
    if recorded:
        say(f"appended {len(rungs) * 2 * n_seeds} kind=eval games to {ResultLog(run).path} "
            f"in {secs:.0f} s; `python ladder.py rate {run}` now places the rungs on the same scale")
    else:
        say(f"played {len(rungs) * 2 * n_seeds} battles in {secs:.0f} s on master seed "
            f"{r.seeds.master_seed}'s seed set; recorded nowhere (only a run's own snapshot on its frozen "
            "set, in its own release mode, goes to its log)")
    return 0


PRIVILEGED_NOTE = "privileged: a lookahead reads the engine's whole state (farm.py section 6b)"


def yardstick_rungs(asked: Sequence[str], subject: str) -> list[str]:
    """The rungs a yardstick plays: those asked (scripted:<name> or lookahead:..., canonical), else
    every scripted rung; the subject's own rung is left out (a player is not rated against itself)."""
    rungs = [farm.canonical_player(x) for x in asked] or [f"scripted:{n}" for n in farm.SCRIPTED_NAMES]
    for x in rungs:
        if not x.startswith(farm.WORKER_PLAYERS):
            raise CliError(f"--rungs {x}: a rung is scripted:<name> or lookahead:<base>[,...]; a snapshot "
                           "is measured as --snapshot, or head to head with `ladder.py eval`")
        farm.check_worker_player(x)
    return [x for x in rungs if x != subject]


def yardstick(r: EvalRunner, snap: str, n_seeds: int, prior: Mapping[frozenset[str], int],
              rungs: Sequence[str] = tuple(f"scripted:{n}" for n in farm.SCRIPTED_NAMES),
              ) -> Iterator[dict[str, Any]]:
    """`snap` against each rung on the runner's first n_seeds seeds, both sides: per rung, as it
    finishes, {snapshot, rung, score, lower, upper (95% bootstrap), seeds, battles, master_seed,
    privileged (either side is a lookahead), seconds, and a lookahead subject's lookahead_choices and
    lookahead_steps summed over its battles}. Each comparison is addressed by the games the pair
    already has (`prior`), so a second yardstick adds new acting streams rather than replaying the
    first."""
    for rung in rungs:
        cid = f"yardstick/{snap}/vs/{rung}/after/{prior.get(frozenset((snap, rung)), 0)}"
        t0 = r.seconds
        ps = paired_scores(r.play(snap, rung, 2 * n_seeds, comparison_id=cid), snap, rung)
        lo, hi = bootstrap_interval(ps.x, r.seeds.master_seed, f"{cid}/summary", 10_000)
        yield {"snapshot": snap, "rung": rung, "score": ps.mean, "lower": lo, "upper": hi, "seeds": len(ps.x),
               "battles": ps.n_battles, "master_seed": r.seeds.master_seed,
               "privileged": any(p.startswith(farm.LOOKAHEAD) for p in (snap, rung)),
               "seconds": r.seconds - t0, **(r.searched if snap.startswith(farm.LOOKAHEAD) else {})}


def yardstick_line(row: Mapping[str, Any], workers: int) -> str:
    """One yardstick row as the console prints it; a lookahead subject's with its cost: core-seconds
    (wall x evaluation workers, so an upper bound) a battle and a searched choice point."""
    line = (f"  vs {row['rung']:<26} score {row['score']:.3f}  95% [{row['lower']:.3f}, {row['upper']:.3f}]  "
            f"over {row['seeds']} seeds ({row['battles']} battles)")
    if "lookahead_choices" in row:
        core = row["seconds"] * workers
        line += (f"  {core / row['battles']:.1f} s a battle, "
                 f"{1e3 * core / max(row['lookahead_choices'], 1):.0f} ms a searched choice "
                 f"({row['lookahead_choices'] / row['battles']:.0f} a battle), "
                 f"{row['lookahead_steps'] / row['battles']:,.0f} scratch game-steps a battle")
    return line + ("  [privileged]" if row["privileged"] else "")


def yardstick_run(run: Path, snap: str, n_seeds: int, device: str = "cpu") -> list[dict[str, Any]]:
    """yardstick() of one of a run's snapshots on its frozen seeds, its games appended to its log
    (what `checks.py learn` measures its champion with)."""
    prior = collections.Counter(frozenset((g.a, g.b)) for g in ResultLog(run).read().games)
    args = _Runner(run=str(run), device=device)
    with _open_runner(args, (snap,)) as r:
        return list(yardstick(r, snap, min(n_seeds, len(r.seeds.seeds)), prior))


def _yardstick_player(args: Any, run: Path | None, store: SnapshotStore) -> str:
    """The yardstick's snapshot as snap:<id> (a bare id is one too); a snapshot folder is added to
    `store`."""
    folder = _folder_player(args.snapshot, store) if args.snapshot else None
    if folder is not None and folder != args.snapshot:   # a snapshot folder, or a lookahead's short id
        return folder
    if args.snapshot and args.snapshot.startswith(farm.WORKER_PLAYERS):
        farm.check_worker_player(args.snapshot)
        return args.snapshot
    if run is None:
        raise CliError("pass --run RUN (its champion, or --snapshot snap:<id>) or --snapshot <folder> "
                       "(a snapshot folder, such as a shipped model under models/)")
    pool = read_pool(run)
    snap = args.snapshot or (pool.champion if pool is not None else None)
    if snap is None:
        raise CliError(f"{run}: no champion yet ({ladder_dir(run) / 'pool.json'} is absent or empty); "
                       "pass --snapshot snap:<id>")
    return snap if snap.startswith(SNAPSHOT_PLAYERS) else snapshot_player_id(snap)


def _folder_player(text: str, store: SnapshotStore) -> str:
    """A player named on the command line: a path (a snapshot folder) becomes snap:<id>, added to
    `store`; a lookahead:... its canonical id; anything else (scripted:<name>, snap:<id>,
    seed:<name>) is returned as it is."""
    if os.sep in text or Path(text).is_dir():
        return snapshot_player_id(store.add_folder(text))
    return farm.canonical_player(text)


def _runner_for(args: Any, run: Path | None, players: Sequence[str], store: SnapshotStore, recorded: bool,
                say: Callable[[str], None], release_mode: str | None = None) -> EvalRunner:
    """The run's runner when the games are recorded; otherwise one that logs nothing, on the run's
    env or the folder's (its eval_env.json, else farm.default_env_spec()) and the seeds asked for.
    release_mode: how snapshots act, None for the run's own (recorded games always are)."""
    if recorded:
        return _open_runner(args, players)
    folder = next(iter(store.folders.values()), None)
    if run is not None:
        env, where = read_run_env(run)
    elif folder is not None and (folder / "eval_env.json").is_file():
        env, where = msgspec.json.decode((folder / "eval_env.json").read_bytes(), type=EnvFactorySpec), \
            str(folder / "eval_env.json")
    else:
        env, where = farm.default_env_spec(), "farm.default_env_spec()"
    say(f"evaluation env from {where}")
    count = max(args.seeds or YARDSTICK_SEEDS, 1)
    seeds = draw_eval_seeds(args.master_seed, count) if args.master_seed is not None else read_run_seeds(run)
    r = EvalRunner(env, seeds, store=store, battles_at_once=args.battles_at_once,
                   workers=_eval_workers(args, run))
    pool = read_pool(run) if run is not None else None
    r.players.seeds = pool.seeds() if pool is not None else {}
    if any(p.startswith(SNAPSHOT_PLAYERS) for p in players):
        r.players.policy_builder = snapshot_builder(run, args.device, table=r.table, store=store,
                                                     release_mode=release_mode)
    return r


# The commands as tyro dataclasses (the project's one way to take arguments): each field's
# docstring is its --help. kw_only so that the shared runner fields can come first.

@dataclasses.dataclass(kw_only=True)
class Rate:
    """Fit and print the rating table of a run (torch-free)."""
    run: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN")]
    """the run directory, runs/<id>"""
    context: Optional[str] = None
    """rate one context only (contexts are never pooled); default: every context in the log"""


@dataclasses.dataclass(kw_only=True)
class _Runner:
    run: str
    """the run directory, runs/<id>"""
    battles_at_once: int = 8
    """battles stepped together"""
    eval_workers: Optional[int] = None
    """evaluation farm processes (default: the run's rollout.eval_workers, else 1; <= 1 plays in
    this process)"""
    device: str = "cpu"
    """where snapshot networks run (needs torch)"""


@dataclasses.dataclass(kw_only=True)
class Eval(_Runner):
    """Play a paired comparison between two players on the run's frozen seeds (appended to its
    log), or on a seed set drawn from --master-seed, where snapshot folders can play (printed only)."""
    run: Optional[str] = None
    """the run directory, runs/<id> (optional with --master-seed)"""
    a: str
    """scripted:<name>, lookahead:<base>[,...], snap:<id> or seed:<name> of the run, or a snapshot folder
    such as models/<name>"""
    b: str
    """scripted:<name>, lookahead:<base>[,...], snap:<id> or seed:<name> of the run, or a snapshot folder
    such as models/<name>"""
    seeds: Optional[int] = None
    """seeds to play, each from both sides (default: the whole frozen set, or 20 of a --master-seed set)"""
    master_seed: Optional[int] = None
    """draw the seed set from this master seed instead of the run's frozen set (printed only)"""


@dataclasses.dataclass(kw_only=True)
class Gate(_Runner):
    """Run the promotion gate on a candidate snapshot."""
    candidate: str
    """snap:<id>"""
    champion: Optional[str] = None
    """default: ladder/pool.json's champion"""


@dataclasses.dataclass(kw_only=True)
class Plot:
    """Draw the run's strength over training, or several runs' learning signals side by side
    (torch-free; needs matplotlib, the [plot] extra)."""
    runs: Annotated[tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(metavar="RUN")]
    """the run directory, runs/<id> (a live one is drawn as far as it has got); several: their
    learning signals in one picture"""
    out: Optional[str] = None
    """the picture's path (default: runs/<id>/strength.png; several runs need one)"""
    labels: tuple[str, ...] = ()
    """several runs: a legend label each, in their order (default: the run directories' names)"""


@dataclasses.dataclass(kw_only=True)
class Yardstick(_Runner):
    """A snapshot against every scripted rung on frozen seeds, paired: a run's (appended to its log
    as eval games), or a snapshot folder such as a shipped model (printed only)."""
    run: Optional[str] = None
    """the run directory, runs/<id> (optional with --snapshot <folder>)"""
    snapshot: Optional[str] = None
    """snap:<id> or seed:<name> of the run, a snapshot folder such as models/<name>, or a player the
    workers play, scripted:<name> or lookahead:... (default: the run's champion)"""
    seeds: Optional[int] = None
    """seeds a rung, each from both sides (default 20, or the whole frozen set if smaller)"""
    master_seed: Optional[int] = None
    """draw the seed set from this master seed instead of the run's frozen set (printed only)"""
    json: bool = False
    """one JSON object a rung on stdout (snapshot, rung, score, lower, upper, seeds, battles,
    master_seed); everything else on stderr"""
    release_mode: Optional[str] = None
    """how the snapshot acts: stochastic, argmax or plugin:<module>:<function>, a decode of your own
    (default: the run's ladder.release_mode, else stochastic); given, the games are printed only"""
    rungs: tuple[str, ...] = ()
    """the rungs to play, scripted:<name> or lookahead:<base>[,vs=..,h=..,c=..] (farm.py section 6b:
    privileged, stronger than the scripted ones); default: every scripted rung"""


COMMANDS = {Rate: cmd_rate, Plot: cmd_plot, Eval: cmd_eval, Gate: cmd_gate, Yardstick: cmd_yardstick}

# Every tyro.cli of the project's scripts takes this. Our fields' help is their docstrings; tyro also
# looks for comments, tokenizing each class's source, and on Python 3.12 inspect finds a class's
# source by parsing its whole file: about 0.15 s a class [M], every process, and again and again
# under pytest, where tyro rechecks its cached answers one time in ten [A: tyro's _unsafe_cache].
# No field's help is a comment (a test holds it), so --help is the same without it
# (docs/throughput.md, "Parsing the flags").
TYRO_CONFIG = (tyro.conf.HelptextFromCommentsOff,)


def main(argv: Sequence[str] | None = None) -> int:
    args = tyro.cli(Union[Rate, Plot, Eval, Gate, Yardstick], args=argv, prog="ladder.py",   # type: ignore[arg-type]
                    description="The ladder of a clash-ppo run.", config=TYRO_CONFIG)
    try:
        return COMMANDS[type(args)](args)
    except (ValueError, FileNotFoundError) as exc:   # CliError, SnapshotMismatch: named messages
        print(f"ladder.py {type(args).__name__.lower()}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
