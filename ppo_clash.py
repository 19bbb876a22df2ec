"""ppo_clash.py -- the learner: self-play PPO on the farm's rectangle of experience, and the run
it leaves on disk. The file to read to learn the method, and the file to fork for an ablation.

Stage owned: everything after collection. farm.py fills a rectangle of T cycles x R slots with
packed observation rows and scalar columns (design 1.1); this file turns it into a better policy,
and ladder.py says, with an error bar, whether it is one.

    python ppo_clash.py --profile smoke            three tiny iterations, about ten seconds
    python ppo_clash.py --profile cpu              a 2-4 core machine without a GPU
    python ppo_clash.py --profile laptop           the default; wants CUDA
    python ppo_clash.py --resume runs/<dir> [--checkpoint DIR] [--allow-identity-drift]
    torchrun --nproc-per-node N ppo_clash.py --profile P   N ranks, a farm each (design 3.10)

Reads:  the env's own spaces and layouts (farm.preflight, NetGeometry); codec.Obs minibatches;
        farm's name-addressed seeding; ladder's matchmaker, pool, gate, rater and probe.
Writes: <runs_dir>/<run_name>-<run_id>/: config.json, identity.json, metrics.jsonl (one row an
        iteration), episodes.jsonl, alarms.jsonl (a resume moves rows written after its checkpoint
        to <log>.after-iteration-<k>), warm.json after a warm start, bundles/<iteration>/ on a halt,
        checkpoints/<env_steps:012d>/ (safetensors and JSON with a sha256 manifest), and, through
        ladder.py, ladder/ (eval seeds, snapshots, pool, gates, ratings, games.jsonl). Nothing
        pickled. Section references ("design 6.3") are to docs/design.md.

How to read it. Sections 1-7 are the method and section 8 is the loop that runs it; a reader who
stops after the loop has read the whole method. Below one marked line, sections 9-12 are the run's
machinery, which a fork of the method need not touch. Sections 1-8 reach it through these names
alone (a test holds the list to the code):
  Comm, SOLO        torchrun's ranks (section 9): the update sums its counts, gradients and
                    statistics over them; SOLO, one process, sums nothing
  Run               the run's directory (section 9): collection reports its progress and dead
                    workers to it, and the loop saves, halts and stops through it
  EnvFacts          the engine's and the codec's digests, which Env carries for the identity
  set_up            what the loop builds once, in order (section 9)
  record_iteration  the loop's step 7: the row, the episodes and the alarms written, and what
                    happens next (section 11)
  NetPlayer         a network as a ladder player (section 12): a DAgger round's student plays as one

The sections:
  1. Arguments and profiles        what can be set, and the presets (start with Args)
  2. Geometry, read off the env    every width the network needs, never a literal
  3. The masked distribution       where a mask meets a logit; the factored head's three stages
  4. Networks                      two trunks, a policy head (pointer or factored), a value head
  5. GAE and return scaling        advantages over the rectangle in one backward scan
  6. The PPO update                ppo_update, the loop's one call: epochs, batches, minibatches;
                                   minibatch_loss, the loss in one place; forced rows, the ratio
                                   invariant
  7. Iteration invariants          what must hold before a batch is trained on
  8. The loop                      _train(): plan and collect -> critic pass -> advantages ->
                                   update -> ladder step -> record
  9. The run                       the arguments read and checked (--config, the command line,
                                   the rules); torchrun's ranks (Comm); run_id and why a resume
                                   may refuse; the start-up gates; the run directory; train(),
                                   the entry point, and set_up
 10. Checkpoints                   atomic, hashed, resumable byte for byte
 11. Metrics, alarms and sinks     the row's schema, the alarm table, the console
 12. Snapshots and the ladder      snapshots written and played; NETS, the networks handed to
                                   ladder.LadderLoop, the ladder's side of the loop

To fork for an ablation: copy this file to a new name (cp ppo_clash.py ppo_myidea.py) and edit the
copy; codec.py, farm.py and ladder.py stay shared. The usual places:
  advantages    gae / smdp_gae (section 5), called by advantages() (section 8, step 4)
  head          PointerHead / FactoredHead and HEADS (section 4); the mask meets the logits in
                MaskedCategorical (section 3)
  trunk         Trunk and ResBlock (section 4)
  loss          minibatch_loss (section 6), the one function the loop's ppo_update calls for it:
                its Minibatch carries every column a loss reads (old log-prob and value, advantage,
                return, masks, n_legal), and the row's statistics read the loss's own parts, so a
                clipped value loss or another clip range is an edit of minibatch_loss alone
  a new metric  put the key in the row (metric_row, section 11, or the update's dict) and give it
                a SCHEMA entry (section 11): the run refuses a key without one at its first row
  a new setting a field in the Args tree (section 1); every ppo, advantage and net field is in
                the run's identity already
What keeps the fork honest needs no edit: its run_id hashes its own code by file name, its
architecture digest is read off the network it builds (arch_description), its run folder and the
commands it prints (a resume, a halt's bundle) name the fork's file, and checks.py's learn, bench
and verify-resume measure it (--script ppo_myidea.py).
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import errno
import functools
import hashlib
import importlib.util
import io
import itertools
import json
import math
import os
import platform
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, NamedTuple, NoReturn, Sequence

import msgspec
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from royalegym.protocol import DECK_SIZE, ShuffleMode

import codec
import farm
import ladder
from farm import derive_generator, derive_int  # design 2.2: one definition of the seeding rule

# The script that is running, by its file name: a fork copied to another name prints its own name
# in every command it tells the user to run (a resume, a halt's bundle).
SCRIPT = Path(__file__).name


# --- 1. Arguments and profiles (design 1.2, 1.3) ---------------------------------------------------
# One tyro dataclass tree; each field's docstring is its --help and says why the default is what
# it is. Defaults are the laptop column of design 1.2; the other profiles are functions that change
# only numbers. `--profile` picks one, every field stays overridable, `--config run.json` loads
# one, and a misspelt key or flag is refused naming the nearest valid one (read and checked in
# section 9).


class ConfigError(ValueError):
    """A configuration that cannot run: names the field and the remedy."""


# Schedules are written in env steps (design 1.3), so a profile's anneal means the same game time
# whatever the batch geometry. One dataclass with a kind, so tyro exposes it as plain flags.
@dataclass
class Schedule:
    kind: Literal["constant", "linear", "geometric"] = "constant"
    """constant: start forever; linear / geometric: start -> end over over_env_steps, then end."""
    start: float = 0.0
    """the value at env step 0"""
    end: float = 0.0
    """the value from over_env_steps on (ignored by constant)"""
    over_env_steps: float = 1.0
    """game-steps the anneal takes"""

    def value(self, env_steps: float) -> float:
        if self.kind == "constant":
            return float(self.start)
        f = min(max(env_steps / max(self.over_env_steps, 1.0), 0.0), 1.0)
        if self.kind == "linear":
            return float(self.start + (self.end - self.start) * f)
        if self.start <= 0 or self.end <= 0:
            raise ConfigError(f"a geometric schedule needs positive start and end, "
                              f"got {self.start}, {self.end}")
        return float(self.start * (self.end / self.start) ** f)


@dataclass
class ObsArgs:
    frame_stack: int = 1
    """cycles stacked (k). The observation carries positions and no motion; stacking is a gather of
    buffer rows and adds S + hand_size input channels per extra frame. 1 until a run shows more buys
    something"""
    decision_ms: int = 500
    """game time per decision (10 ticks). Part of the env, so of env_spec_digest"""
    reveal: tuple[str, ...] = ()
    """royalegym Reveal flags to turn on (e.g. enemy_spell_aim). Empty is the fair observation"""
    max_steps: int = 0
    """0 plays whole battles; N > 0 truncates every episode after N decisions (a StepLimit
    truncation in the env spec). How the resume test puts every episode end on an iteration boundary"""


@dataclass
class RewardArgs:
    """The potential shaping's weights against the terminal +-1 (design 4). Part of the env, so of
    env_spec_digest; a weight at its default leaves the env spec as it was (every run id holds)."""
    crown: float = farm.REWARD_WEIGHTS["crown"]
    """Phi = crown difference / 3"""
    tower_hp: float = farm.REWARD_WEIGHTS["tower_hp"]
    """Phi = mean tower hit-point fraction, own minus enemy"""
    elixir: float = farm.REWARD_WEIGHTS["elixir"]
    """Phi = committed elixir (bar plus priced units on the board), own minus enemy, / 10"""


@dataclass
class WarmArgs:
    """A warm start by behaviour cloning (docs/learning.md section 3): before PPO's first iteration
    the actor imitates a scripted rung on that rung's own choices, so v0, the policy training
    starts from, is the clone. Off by default, on under --profile cpu (a clone of defend kept by a
    teacher); a fresh run only (a resume has its weights). Under net.placement_cell a rung's tile is
    cloned as its cell (placement_action)."""
    rung: str = ""
    """the player to imitate: scripted:<name> (farm.SCRIPTED_NAMES), or lookahead:<base>[,...], a
    privileged teacher (farm.py section 6b); empty: no warm start"""
    battles: int = 64
    """battles the rung plays against itself; every choice row of both seats is cloned"""
    epochs: int = 4
    """passes of cross-entropy over those rows"""
    lr: float = 1e-3
    """the cloning's own Adam learning rate (PPO's optimizers start fresh after it)"""
    dagger_rounds: int = 0
    """rounds of DAgger after the clone: the clone plays dagger_battles battles against itself, the
    rung labels every choice row it met with what the rung would play there, and the actor is fitted
    again on every round's rows. A clone that learned only the rung's own states is lost where it
    strays from them; a lookahead rung reads what the clone cannot see, so it strays"""
    dagger_battles: int = 32
    """battles a DAgger round plays"""
    workers: int = 1
    """processes the warm start's battles play on (its rows are the same for any count)"""
    soft_targets: float = 0.0
    """0: the clone learns the rung's choice. T > 0: a lookahead rung's candidates weighted by
    softmax(score / T) (its scores are the potential reward's units: 0.005 is one elixir), so
    candidates it finds equal share the mass and the clone keeps entropy for PPO to spend"""
    critic_iterations: int = 0
    """PPO's first iterations step the critic only, so the clone plays on unchanged until a critic
    fitted to its own play judges it (an untrained critic's advantages are noise at full weight:
    explained variance -0.1 at the first iteration, 0.6 by the seventh [M: docs/learning.md S3])"""
    teacher_kl: Schedule = field(default_factory=Schedule)
    """the clone kept as a teacher: the actor's loss adds this weight times KL(clone || actor) on
    the choice rows, the clone being v0's snapshot (design 5.4). PPO from a clone without it pulled
    the clone apart and ended below it (docs/learning.md 3.3); annealed, PPO starts where the clone
    is and is let go by the end. 0 (the default): no teacher"""


def teacher_on(w: WarmArgs) -> bool:
    """Whether the run keeps its clone as a teacher: the teacher_kl schedule is ever above 0."""
    t = w.teacher_kl
    return t.start > 0 or (t.kind != "constant" and t.end > 0)


@dataclass
class RolloutArgs:
    source: Literal["process", "inline"] = "process"
    """inline is the semantic reference and runs the fast tests; process is the farm of workers"""
    workers: int = 3
    """worker processes (K). The learner is the bottleneck, so more workers buy little (design 1.2)"""
    games_per_worker: int = 32
    """battles per worker (M): 3 x 32 = 96 battles, 192 slots at the laptop profile"""
    shards_per_worker: int = 2
    """vec envs per worker, alternated so a worker steps one while the parent infers on the other"""
    spin_us: int = 100
    """microseconds to spin before sleeping on a round's semaphore (design 3.4)"""
    round_timeout_s: float = 30.0
    """every wait has a timeout; a worker that runs past it is killed and failed (kind "timeout"),
    never a block (design 3.7)"""
    restart_failed_workers: bool = True
    """restart a worker that died, raised or hung, on its next generation, and keep its cells of
    the iteration in flight dead (never trained on); false stops the run naming the worker and its
    traceback file (design 3.7)"""
    max_restarts_per_worker: int = 3
    """a fourth failure of one worker in the run (a resume included) stops it rather than silently
    degrading throughput"""
    launch_delay_s: float = 0.5
    """seconds between launching one worker and the next; they then start up side by side (each
    RustEngine construction decodes its data files)"""
    eval_workers: int = 2
    """processes of the gate's own farm, built at gate time and closed after (design 7.1)"""
    eval_games_per_worker: int = 24
    """battles per evaluation worker"""


@dataclass
class NetArgs:
    channels: int = 64
    """C: about 430 k parameters per network at 4 blocks (design 5.1)"""
    blocks: int = 4
    """N residual blocks"""
    norm_groups: int = 8
    """GroupNorm groups (must divide channels); never BatchNorm, which computes a different function
    at rollout"""
    vector_embed: int = 32
    """E: the scalar vector broadcast over the board, so elixir can modulate every tile"""
    value_hidden: int = 256
    """the value MLP's hidden width"""
    coord_conv: bool = True
    """two coordinate planes: the arena is not translation-invariant (own half, river, bridges, towers)"""
    separate_trunks: bool = True
    """actor and critic trunks apart: the mask and entropy bonus never touch the critic, structurally"""
    global_pool: bool = False
    """after the residual blocks, every tile's features plus a linear map of the board's mean and max
    features (design 5.1): a tile's logit then reads the whole board, not only the tiles its
    convolutions reach (13 x 13 at 2 blocks). Zero-initialised, so v0 is the network without it"""
    noop_bias: float = 0.0
    """added to the pointer head's no-op logit. 0: a near-uniform start is self-limiting (design 5.4)"""
    policy_head: Literal["pointer", "factored"] = "pointer"
    """pointer: one softmax over the no-op and every (card, tile). factored: the same flat
    log-probabilities in three stages, wait or act, then which card or button, then which tile
    (design 5.1)"""
    placement_cell: tuple[int, int] = (1, 1)
    """a card is placed by cell, not by tile: the board falls into cells of this many tile rows x
    columns, and the policy chooses among one legal tile a cell, the one nearest its centre
    (placement_mask, design 5.5). (1, 1): every legal tile. The env's action is unchanged, so replay,
    the ladder and the stored log-probs read it as they read any other"""
    factored_act_init: float = 0.1
    """the factored head's P(act) at initialisation, its gate's bias; a starting value, not a shape"""
    autocast_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """bf16 keeps fp32's exponent range, so finfo.min masking is safe and no GradScaler is needed"""
    device: str = "cuda"
    """the learner's device; a profile that wants cuda on a machine without it stops, naming --profile cpu"""


@dataclass
class LrBackoffArgs:
    kl_threshold: float = 0.02
    """kl above this, for patience iterations in a row, halves both learning rates"""
    patience: int = 3
    """consecutive breaching iterations before the backoff fires"""
    factor: float = 0.5
    """multiplier applied to both learning rates"""
    lr_min: float = 2e-5
    """floor under both learning rates"""


@dataclass
class PPOArgs:
    n_epochs: int = 3
    """passes over each iteration's samples; watch clip fraction across epochs"""
    timesteps_per_iteration: int = 32768
    """learner transitions per iteration: the compute budget and episode arithmetic agree on it"""
    batch_size: int = 4096
    """samples per optimizer step: 24 steps an iteration at the laptop profile"""
    minibatch_size: int = 256
    """samples per forward, a pure memory knob: gradients accumulate n/N with one step per batch"""
    clip_range: float = 0.2
    """the PPO paper's"""
    dual_clip_c: float = 3.0
    """floor c*A for negative advantages: a rarely sampled action's ratio can be enormous"""
    vf_coef: float = 1.0
    """separate networks and optimizers, so this only scales the critic's effective learning rate"""
    ent_coef: Schedule = field(default_factory=lambda: Schedule("linear", 0.01, 0.003, 30e6))
    """entropy bonus; exploration matters less as the pool strengthens"""
    ent_coef_noop: Schedule = field(default_factory=lambda: Schedule("linear", 0.02, 0.0, 10e6))
    """play/wait entropy bonus, a warm-start guard that anneals to 0 (a healthy policy waits ~94%)"""
    entropy_coef_stages: tuple[float, float, float] | None = None
    """(gate, candidate, tile): one coefficient on each term of the entropy's chain-rule split, wait or
    act, which card given act, which tile given the card (design 6.3), in place of ent_coef; off (None),
    ent_coef is on the whole entropy"""
    max_grad_norm: float = 0.5
    """applied to the actor and critic parameter sets separately"""
    lr_actor: float = 2e-4
    """the community moved down from 3e-4 for long runs"""
    lr_critic: float = 2e-4
    """the critic's own optimizer"""
    adam_eps: float = 1e-8
    """NOT the PPO paper's 1e-5: below eps Adam is SGD at lr/eps, and the actor's tiny gradients do not
    move it (design 6.5; docs/running.md section 6)"""
    lr_backoff: LrBackoffArgs = field(default_factory=LrBackoffArgs)
    """the four-line guard against a blow-up (design 6.3)"""
    advantage_standardization: bool = True
    """once per iteration over the cells that reach the update, before any split"""
    critic_chunk: int = 1024
    """rows per chunk of the whole-iteration critic pass (an unchunked pass is a memory spike)"""
    debug_assert_iterations: int = 10
    """mask asserts and the ratio invariant run for this many iterations from a run's start"""
    check_ratio_invariant_every: int = 50
    """and every this many iterations thereafter"""
    ratio_atol_fp32: float = 1e-4
    """ratio invariant tolerance with autocast off (design 6.4)"""
    ratio_atol_bf16: float = 2e-2
    """under bf16 autocast: the rollout and update forwards differ at the 1e-2 level"""
    forced_rows: Literal["all", "critic_only", "critic_only_choice_mean", "smdp"] = "critic_only"
    """what the update does with one-legal-action rows (design 6.5). critic_only is exact (a forced row
    gives the actor zero gradient) and skips their actor compute; smdp also folds them into the
    transitions between a slot's choice cells, so the critic runs on the choice cells and a sample
    (design 6.6); both need net.separate_trunks"""


@dataclass
class AdvantageArgs:
    gamma: Schedule = field(default_factory=lambda: Schedule("geometric", 0.997, 0.999, 20e6))
    """discount, annealed in env steps; 0.99 would discount the win to 0.027 by the end of regulation"""
    gae_lambda: float = 0.99
    """credit horizon 1/(1-gamma*lambda) = 91 steps, 45.5 s: deploy -> push -> tower. The most
    leveraged number"""
    standardize_rewards: bool = True
    """divide by the running std of returns: gamma near 1 inflates returns about tenfold"""
    reward_clip: float = 10.0
    """standard deviations"""


_GATE = ladder.GateConfig()  # the gate's defaults live in ladder.py


@dataclass
class GateArgs:
    """The gate's sizes (design 7.4). The defaults are ladder.GateConfig's, read from it, so the
    numbers have one home; profiles shrink them for machines that cannot afford 2,200 battles."""
    champion_games: int = _GATE.champion_games
    """500 seeds x 2 side assignments"""
    champion_lower_bound: float = _GATE.champion_lower_bound
    """Wilson lower bound on the score rate a candidate must clear (about 35 Elo)"""
    anchor_games: int = _GATE.anchor_games
    """battles per anchor"""
    anchor_tolerance_pp: float = _GATE.anchor_tolerance_pp
    """percentage points an anchor score may fall"""
    stratified_snapshots: int = _GATE.stratified_snapshots
    """older snapshots the candidate also plays"""
    stratified_games: int = _GATE.stratified_games
    """battles each"""
    bootstrap_resamples: int = _GATE.bootstrap_resamples
    """for the paired interval"""
    sequential_battles: int = _GATE.sequential_battles
    """0: condition (1) plays its champion_games at once. N: in looks of N battles (the same games,
    in the same order), stopped at the first look where it is settled: promoted once a 99% Wilson
    bound clears the bar, discarded once the bar is out of reach (ladder.sequential_settled; its
    error rates beside the fixed design's: docs/ladder.md section 4)"""


@dataclass(frozen=True)
class SeedSnapshot:
    """A frozen actor from outside the run (a shipped model, a clone of a rung), in the pool from
    the first iteration as seed:<name> (design 7.3)."""
    name: str
    """the pool calls it seed:<name>: unique, without ':'"""
    path: str
    """a snapshot folder (spec.json and actor.safetensors): models/<name>/ or a run's
    ladder/snapshots/<id>/. Copied into the run at start, so not in the identity"""
    sha256: str
    """sha256 of its actor.safetensors (spec.json's actor_sha256): the weights the run was meant to meet"""
    weight: float = 1.0
    """a multiplier on its draw weight, after PFSP's shape and floor"""


SHUFFLES = tuple(m.name.lower() for m in ShuffleMode)
"""How a battle orders the decks it deals: royalegym's ShuffleMode, by name."""


@dataclass
class SeatDecks:
    """One deck trained where the learner sits (design 7.3): empty, the env deals as it always did."""
    deck: tuple[str, ...] = ()
    """the learner's deck: a deck's count (8) of distinct card names of the engine's catalogue
    (engine.cards()). A mirror battle deals it to both seats; a pool or scripted battle to the learner's seat,
    which is then fixed per battle (even battles blue, odd red)"""
    field: tuple[tuple[str, ...], ...] = ()
    """the decks the opponent of a pool or scripted battle draws from, one a battle, uniformly;
    empty: a random deck a battle"""
    shuffle: str = "independent"
    """how a pool or scripted battle shuffles its two decks: none, independent or mirrored (a
    mirror battle always mirrors)"""


@dataclass
class LadderArgs:
    mix: tuple[float, float, float] = (0.50, 0.35, 0.15)
    """mirror / pool / scripted share of training battles"""
    max_resident_opponents: int = 2
    """snapshots held in memory: at most four batched forwards per shard-round"""
    pfsp_power: float = 2.0
    """exponent of PFSP's "hard" weighting: training wants opponents that still beat the learner
    (design 7.3)"""
    pfsp_uniform_floor: float = 0.2
    """the anti-forgetting guard"""
    candidate_every_env_steps: int = 4_000_000
    """game-steps between gate attempts, about 5% of wall clock in gates"""
    floor_admit_every_env_steps: int = 50_000_000
    """a plateau cannot starve the pool"""
    pool_working_size: int = 48
    """snapshots sampled from"""
    eval_seed_count: int = 500
    """the frozen evaluation seed set"""
    refit_every_iterations: int = 10
    """ratings refit cadence"""
    probe_every_iterations: int = 0
    """0 is off: a probe plays real battles in the parent (design 7.9)"""
    probe_games: int = 40
    """battles per rung, paired"""
    probe_opponents: tuple[str, ...] = ladder.PROBE_RUNGS
    """the scripted rungs the probe plays (design 7.9): any of farm.SCRIPTED_NAMES as scripted:<name>;
    noop and random_legal also publish ladder/score_vs_noop and _random_legal"""
    scripted_opponents: tuple[str, ...] = ("scripted:noop", "scripted:random_legal")
    """who the scripted share trains against, drawn uniformly per episode"""
    gate: GateArgs = field(default_factory=GateArgs)
    """the gate's numbers (design 7.4)"""
    release_mode: str = "stochastic"
    """how a snapshot or the probed learner picks its action in evaluation (design 7.5): stochastic
    (sampled from its own stream), argmax (the most probable legal action) or
    plugin:<module>:<function> (your decode, decode_fn). One mode per run (it is in the identity):
    rating both variants would double the pool for no decision value"""
    opponent_mode: str = "stochastic"
    """how a pool snapshot picks its action in TRAINING battles, the same three kinds; the learner's
    own seats always sample. Training battles are not rated, so it is not in the ladder context"""
    seed_snapshots: tuple[SeedSnapshot, ...] = ()
    """frozen actors the pool holds from the first iteration as seed:<name>, never evicted (design
    7.3); with any, v0 is the first champion but not drawn in training. Set in a --config file"""
    seat_decks: SeatDecks = field(default_factory=SeatDecks)
    """one deck trained where the learner sits, and its opponents' (training battles only: the
    gate, the probe and the yardstick deal as the env does)"""


@dataclass
class CheckpointArgs:
    every_env_steps: int = 2_000_000
    """game-steps between checkpoints"""
    keep: int = 10
    """checkpoints kept (pruned by the manifest index). Not in the identity"""


@dataclass
class MetricsArgs:
    console_full: bool = False
    """after the compact block, print every key of the row grouped by prefix (run/, time/, ppo/,
    ...): for reading a key the block leaves out without opening metrics.jsonl. Not in the identity"""
    wandb: bool = False
    """mirror rows to Weights & Biases (optional extra). Not in the identity"""
    wandb_project: str = "clash-ppo"
    """the wandb project"""
    tensorboard: bool = False
    """write every numeric key of the row to <run>/tb/ at its game-step count, for `tensorboard
    --logdir runs` (optional extra [tb]). Not in the identity"""
    viser: bool = True
    """serve the viewer's learning-status datagram (nothing is sent before a hello)"""
    image_every: int = 50
    """every this many iterations, that iteration's learner plays as one board of counts per card,
    <run>/heatmaps/<iteration>.npz (design 9.2; 0: never). Not in the identity"""


@dataclass
class AlarmArgs:
    kl_high: float = 0.05
    """warn when ppo/kl exceeds this for 3 iterations (the backoff should already be acting)"""
    kl_dead: float = 1e-5
    """warn when ppo/kl stays under this for 10 iterations: nothing is moving"""
    clip_pinned: float = 0.5
    """halt when clip fraction exceeds this for 3 iterations: mask disagreement or lr far too high"""
    noop_collapse: float = 8.0
    """warn when the learner's cards per match stays under this for 5 iterations (~22 is healthy)"""
    noop_collapse_severe: float = 3.0
    """halt under this for 5 iterations"""
    noop_entropy_floor: float = 0.02
    """warn when the choice-row play/wait entropy stays under this for 5 iterations"""
    ev_negative_patience: int = 50
    """iterations of negative explained variance before a warning"""
    ratio_invariant_multiple: float = 5.0
    """halt when ratio_max_abs_dev exceeds this multiple of the ratio tolerance"""


@dataclass
class DeterminismArgs:
    tier: Literal["run_exact", "throughput"] = "run_exact"
    """run_exact: deterministic kernels, bit-identical metric rows on the same device class (design 2.1)"""
    torch_threads: int = 1
    """thread count changes CPU float reduction order"""
    inference_threads: int = 1
    """torch threads of the parent's forwards while workers step: collection, gates and probes (the
    update keeps torch_threads). One leaves the workers their cores: on the 2-core machine the
    cpu profile's collection took 2.6-2.8 s on one thread against 3.3-4.7 s on two [M: docs/
    throughput.md]. Like torch_threads it changes the forwards' last bits"""


@dataclass
class DoctorArgs:
    ram_budget_mb: int = 6500
    """start-up refuses a configuration whose projected RAM ledger exceeds this (design 3.8 step 9)"""
    run_mask_disagreement_gate: bool = True
    """compare the mask with the engine's deploy rules over every action at a played state (step 5)"""
    vram_headroom_mb: int = 256
    """device memory one minibatch must leave free (CUDA only); 0 turns the gate off"""


@dataclass
class Args:
    """Self-play PPO for Clash Royale. --profile NAME picks the preset (laptop, workstation,
    many_core, cpu, smoke) and every flag below overrides one field; --config run.json loads a
    config (a run's own config.json is one); --resume runs/<dir> [--checkpoint DIR]
    [--allow-identity-drift] continues a run. An unknown flag or key is refused by name."""

    profile: str = "laptop"
    """which preset the defaults came from: laptop, workstation, many_core, cpu, smoke"""
    run_name: str = Path(__file__).stem
    """cosmetic: the run folder is <runs_dir>/<run_name>-<run_id>, by default the script's name
    (ppo_clash, or a fork's: CleanRL's exp_name). Not in the identity"""
    runs_dir: str = "runs"
    """where run folders live. Not in the identity"""
    master_seed: int = 20260921
    """every random stream derives from this by name (design 2.2). In the identity"""
    timestep_limit: int = 100_000_000
    """learner transitions to train for"""
    game_step_limit: int = 0
    """game-steps to train for, the warm start's battles included (its warm.json's game_steps): the
    run stops at the first iteration boundary at or past it, as a learning budget is written
    (docs/learning.md). 0: none. Not in the identity"""
    obs: ObsArgs = field(default_factory=ObsArgs)
    reward: RewardArgs = field(default_factory=RewardArgs)
    warm: WarmArgs = field(default_factory=WarmArgs)
    rollout: RolloutArgs = field(default_factory=RolloutArgs)
    net: NetArgs = field(default_factory=NetArgs)
    ppo: PPOArgs = field(default_factory=PPOArgs)
    advantage: AdvantageArgs = field(default_factory=AdvantageArgs)
    ladder: LadderArgs = field(default_factory=LadderArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    metrics: MetricsArgs = field(default_factory=MetricsArgs)
    alarms: AlarmArgs = field(default_factory=AlarmArgs)
    determinism: DeterminismArgs = field(default_factory=DeterminismArgs)
    doctor: DoctorArgs = field(default_factory=DoctorArgs)


def _set(args: Args, path: str, value: Any) -> None:
    *head, last = path.split(".")
    obj = args
    for h in head:
        obj = getattr(obj, h)
    if not hasattr(obj, last):
        raise KeyError(path)
    setattr(obj, last, value)


def _nearest(key: str, valid: Sequence[str]) -> str:
    m = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f" (did you mean {m[0]!r}?)" if m else ""


def flag(path: str) -> str:
    """A field as the command line spells it: ppo.lr_backoff.kl_threshold -> --ppo.lr-backoff.kl-threshold."""
    return "--" + path.replace("_", "-")


def profile_args(name: str) -> Args:
    """The presets. Only numbers change between them (design 1.2)."""
    a = Args(profile=name)
    if name == "laptop":
        return a
    if name in ("workstation", "many_core"):
        big = name == "many_core"
        for k, v in {"rollout.workers": 24 if big else 12, "rollout.games_per_worker": 64,
                     "ppo.timesteps_per_iteration": 262144 if big else 131072,
                     "net.channels": 128 if big else 96, "net.blocks": 12 if big else 8,
                     "ppo.batch_size": 32768 if big else 16384, "ppo.minibatch_size": 8192 if big else 2048,
                     "ladder.candidate_every_env_steps": 2_000_000}.items():
            _set(a, k, v)
        return a
    if name in ("cpu", "smoke"):
        # The cpu numbers are the ones that made the actor move on a 2-core machine: about 24
        # optimizer steps an iteration, adam_eps 1e-8, lr_actor 1.5e-3, a C=16 N=2 network on two
        # torch threads (collection and update run in series, so the worker's core is free while
        # the parent updates). gae_lambda 0.98 puts the credit horizon at 21.8 s [A: 0.5 s / (1 -
        # 0.997 x 0.98)], under the SCHEMA's band, on purpose. cpu learns at the choice points
        # (smdp, design 6.6): its update is about 0.24x critic_only's, and batches of 96 of its
        # rows give the actor critic_only's steps at the start [A: 3 epochs x ~770 rows / 96]; at
        # 1M it beat critic_only's weights head to head (docs/learning.md 3.3). smoke keeps
        # critic_only, whose every row the fast tests count. What was tried: docs/running.md 6.
        # cpu starts from a clone of defend (the rung that does best on this env) kept by a
        # teacher whose weight anneals 1 -> 0 over 1M game-steps: at 1M it beat the smdp run head
        # to head, 0.546 [0.509, 0.583], and it is models/cpu (docs/learning.md 3.6 R2). The
        # cloning plays about 26,000 game-steps of the budget [M] before iteration 1.
        smoke = name == "smoke"
        for k, v in {"net.device": "cpu", "net.autocast_dtype": "float32",
                     "net.channels": 8 if smoke else 16, "net.blocks": 1 if smoke else 2,
                     "net.norm_groups": 4, "net.vector_embed": 8 if smoke else 16,
                     "net.value_hidden": 32 if smoke else 128,
                     "determinism.torch_threads": 1 if smoke else 2,
                     "rollout.source": "inline" if smoke else "process",
                     # cpu: two workers of one shard, and the gate on both cores, the parent's
                     # forwards on one thread (determinism.inference_threads): the iteration 4.3-4.4 s
                     # against 4.5-4.6 on one worker of two shards, a gate's battles 1.4x the engine
                     # against 1.8-2.2x [M, docs/throughput.md, issue 48]
                     "rollout.workers": 1 if smoke else 2, "rollout.games_per_worker": 4 if smoke else 8,
                     "rollout.shards_per_worker": 1,
                     "rollout.eval_workers": 1 if smoke else 2,
                     "rollout.eval_games_per_worker": 4 if smoke else 8,
                     "ppo.timesteps_per_iteration": 256 if smoke else 4096,
                     "ppo.forced_rows": "critic_only" if smoke else "smdp",
                     "ppo.batch_size": 64 if smoke else 96, "ppo.minibatch_size": 64 if smoke else 96,
                     "ppo.lr_actor": 5e-4 if smoke else 1.5e-3,
                     "advantage.gae_lambda": 0.99 if smoke else 0.98, "ppo.lr_critic": 5e-4,
                     "ppo.adam_eps": 1e-8,
                     "ppo.ent_coef": Schedule("constant", 0.003, 0.003, 1.0),
                     "ppo.ent_coef_noop": Schedule("linear", 0.02, 0.0, 2e6),
                     "ppo.critic_chunk": 512,
                     # a gate every ~8-10 minutes of cpu training [A: 2,736 game-steps an iteration,
                     # 73 iterations at 5.1 s, then the gate's 2-3.5 min, M: docs/learning.md 3.8];
                     # at n=600 Wilson's bound clears 0.52 from an observed 0.56 [A, design 7.7]
                     # (docs/running.md section 6).
                     # smoke gates only when asked.
                     "ladder.candidate_every_env_steps": 200_000,
                     "ladder.floor_admit_every_env_steps": 100_000_000 if smoke else 2_000_000,
                     "ladder.probe_every_iterations": 0 if smoke else 40,
                     "ladder.probe_games": 8 if smoke else 40,
                     # the yardstick's rungs a reader knows: random_legal, and push and patient, strong
                     # in royalegym's own round robin (docs/ladder.md section 7)
                     "ladder.probe_opponents": ladder.PROBE_RUNGS if smoke else
                     ("scripted:random_legal", "scripted:push", "scripted:patient"),
                     # the gate's power against a slow learner [A, docs/learning.md 3.3]: n=600 promotes
                     # a candidate scoring 0.57 against its champion 7 times in 10 (n=200: 3 in 10). The
                     # anchor condition's 15 pp is sized to its 40 battles [A: 0.39 / sqrt(20) = 0.087,
                     # the sd of a paired difference over 20 seeds, 0.39 a seed M], so an equal candidate
                     # fails it 4% of the time (2 pp: 41%) and one 25 pp worse 87% (docs/running.md 6).
                     "ladder.eval_seed_count": 8 if smoke else 300,
                     "ladder.gate": GateArgs(champion_games=16 if smoke else 600,
                                             anchor_games=8 if smoke else 40,
                                             anchor_tolerance_pp=_GATE.anchor_tolerance_pp if smoke else 15.0,
                                             stratified_snapshots=1 if smoke else 2,
                                             stratified_games=4 if smoke else 20,
                                             bootstrap_resamples=200 if smoke else 2000,
                                             sequential_battles=0 if smoke else 100),
                     "checkpoint.every_env_steps": 2_000 if smoke else 100_000,
                     "timestep_limit": 3 * 256 if smoke else 100_000_000}.items():
            _set(a, k, v)
        if not smoke:
            a.warm = WarmArgs(rung="scripted:defend", critic_iterations=4,
                              teacher_kl=Schedule("linear", 1.0, 0.0, 1e6))
        return a
    raise ConfigError(f"--profile {name!r}: unknown profile; must be one of {', '.join(PROFILES)}"
                      + _nearest(name, PROFILES))


PROFILES = ("laptop", "workstation", "many_core", "cpu", "smoke")


def ratio_atol(args: Args) -> float:
    return args.ppo.ratio_atol_bf16 if args.net.autocast_dtype == "bfloat16" else args.ppo.ratio_atol_fp32


# --- 2. Geometry, read off the env -------------------------------------------------------------
# The network is built from this small description and from nothing else, so a plane added
# upstream changes the stem's width without an edit here (design 5.1: "never a literal").

# The vector fields the pointer head reads, by the env's own names (design 5.1), so a renamed
# field fails at start-up, naming itself.
HAND_CARDS, HAND_COST, HAND_AFFORDABLE = "own_hand_cards", "own_hand_cost", "own_hand_affordable"
OWN_ELIXIR = "own_elixir"   # read for env/mean_elixir_at_decision only; a builder without it omits the key
CLOCK = "clock"   # read by Bot alone: its first entry, regular time left, is 1.0 at an episode's
                  # first observation

# Width of the per-tile card-identity embedding (design 5.1): a module constant, not a config
# field, so runs without card identity keep their arch_digest.
CARD_ID_EMBED = 8


class NetGeometry(msgspec.Struct, frozen=True):
    """What the network needs to know about the env, every number read off its spaces."""

    spatial_shape: tuple[int, int, int]          # (S, H, W) per frame
    vector_layout: tuple[tuple[str, int], ...]   # (field, width) in order; sum = V
    n_actions: int                               # A = 1 + P*H*W + NB
    hand_size: int                               # P
    tiles: tuple[int, int]                       # (H, W): the board the pointer head tiles
    frame_stack: int = 1                         # k
    mask_planes: bool = True                     # whether obs carries (k*P, H, W) mask planes
    card_id_channels: int = 0                    # per frame, 0 without card identity
    card_id_vocab: int = 0                       # the card_ids Box's high + 1

    @property
    def vector_size(self) -> int:
        return sum(w for _, w in self.vector_layout)

    @property
    def n_buttons(self) -> int:
        """Ability buttons after the grid (design 5.1: A = G + NB). 0 on today's env."""
        return self.n_actions - 1 - self.hand_size * self.tiles[0] * self.tiles[1]

    def field(self, name: str) -> slice:
        """The slice of the flat vector the env declared for `name`; raise naming it if absent."""
        off = 0
        for key, width in self.vector_layout:
            if key == name:
                return slice(off, off + width)
            off += width
        raise ConfigError(
            f"the env's vector_layout has no field {name!r}, which the pointer head reads "
            f"(fields: {[k for k, _ in self.vector_layout][:12]}...). The obs builder changed; "
            f"update HAND_* in ppo_clash.py section 2 to its new names.")

    def card_vocab(self) -> int:
        """K: card ids including "empty", from the one-hot width of the hand field."""
        width = self.field(HAND_CARDS).stop - self.field(HAND_CARDS).start
        if width % self.hand_size:
            raise ConfigError(f"{HAND_CARDS} is {width} wide, not a multiple of hand_size {self.hand_size}")
        return width // self.hand_size


def geometry_from_env(obs_space: Any, builder: Any, frame_stack: int = 1) -> NetGeometry:
    """Read the geometry off a vec env's single_observation_space and its obs builder."""
    sp = obs_space["spatial"].shape
    A = int(obs_space["action_mask"].shape[0])
    layout = tuple((f.key, int(f.size)) for f in builder.vector_layout())
    V = int(obs_space["vector"].shape[0])
    if sum(w for _, w in layout) != V:
        raise ConfigError(f"vector_layout sums to {sum(w for _, w in layout)} "
                          f"but the obs space's vector is {V}")
    has_planes = "mask_planes" in obs_space.spaces
    if has_planes:
        P = int(obs_space["mask_planes"].shape[0])
    else:  # the hand's cost field has one entry per hand slot
        P = dict(layout)[HAND_COST]
    ids = obs_space.spaces.get("card_ids")
    geo = NetGeometry(
        spatial_shape=(int(sp[0]), int(sp[1]), int(sp[2])), vector_layout=layout, n_actions=A,
        hand_size=P, tiles=(int(sp[1]), int(sp[2])), frame_stack=int(frame_stack),
        mask_planes=has_planes,
        card_id_channels=0 if ids is None else int(ids.shape[0]),
        card_id_vocab=0 if ids is None else int(np.max(ids.high)) + 1)
    if geo.n_buttons < 0:
        raise ConfigError(f"action space {A} is smaller than 1 + hand*tiles = {1 + P * sp[1] * sp[2]}")
    for name in (HAND_CARDS, HAND_COST, HAND_AFFORDABLE):
        geo.field(name)  # fail now, naming the field, not halfway through a run (design 5.1)
    return geo


# --- 3. The masked distribution (design 5.3) -----------------------------------------------------
# Where a mask meets a logit (and factored_log_probs, which reads the mask for its candidates).
# Mask BEFORE the softmax with finfo.min (never -inf, whose 0 * -inf is NaN in the entropy);
# logits are float32 so the masking and log_softmax are exact.


def p_log_p(logp: torch.Tensor) -> torch.Tensor:
    """p log p for p given by its log. An impossible card's log is near finfo.min, which times a
    coefficient overflows in the backward (inf x 0 = NaN): clamped where exp is 0 anyway."""
    logp = logp.clamp_min(-1e4)
    return logp.exp() * logp


class MaskedCategorical:
    def __init__(self, logits: torch.Tensor, mask: torch.Tensor, check_noop: bool = True) -> None:
        if logits.dtype != torch.float32:
            raise TypeError(f"MaskedCategorical needs float32 logits (design 5.2), got {logits.dtype}")
        if mask.dtype != torch.bool or mask.shape != logits.shape:
            raise TypeError(f"mask must be bool of shape {tuple(logits.shape)}, "
                            f"got {mask.dtype} {tuple(mask.shape)}")
        if check_noop:
            refuse_clear_noop(mask)
        self.mask = mask
        self.logp = torch.log_softmax(logits.masked_fill(~mask, torch.finfo(torch.float32).min), -1)

    def sample(self, u: torch.Tensor) -> torch.Tensor:
        """Inverse CDF on caller-supplied uniforms (B,): a sampled action is a pure function of
        (master_seed, iteration, cycle, slot), independent of batch composition (design 2.2). With
        right=True an illegal action's zero-width interval can never be selected."""
        cdf = self.logp.exp().cumsum(-1)
        cdf = cdf / cdf[..., -1:].clamp_min(1e-30)
        idx = torch.searchsorted(cdf, u.to(cdf.dtype).unsqueeze(-1).clamp(0.0, 1.0 - 1e-7), right=True)
        return idx.squeeze(-1).clamp_(max=cdf.shape[-1] - 1)

    def mode(self) -> torch.Tensor:
        return self.logp.argmax(-1)  # of the masked, normalised log-probs: never illegal

    def log_prob(self, a: torch.Tensor) -> torch.Tensor:
        return self.logp.gather(-1, a.long().unsqueeze(-1)).squeeze(-1)

    def entropy(self) -> torch.Tensor:
        p = self.logp.exp()
        return -(p * torch.where(self.mask, self.logp, torch.zeros_like(self.logp))).sum(-1)

    def entropy_split(self, slots: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The entropy's chain rule over the layout [no-op, (slot, tile) x slots x tiles, buttons]
        (design 6.3): H = H(wait or act) + P(act) H(card | act) + P(act) H(tile | card, act), the
        three (B,) terms in that order; they sum to entropy() on either head. An illegal entry's p
        is exactly 0 and adds 0; a card or act probability is summed from the masked log-probs and
        taken through p_log_p, whose clamp keeps a zero one's gradient finite."""
        B = self.logp.shape[0]
        lp = torch.where(self.mask, self.logp, torch.zeros_like(self.logp))
        plogp = lp.exp() * lp
        grid = 1 + slots * tiles
        tile_lp = self.logp[:, 1:grid].reshape(B, slots, tiles)
        # log P(card); a button is one
        card_lp = torch.cat([torch.logsumexp(tile_lp, -1), self.logp[:, grid:]], -1)
        act_lp = torch.logsumexp(card_lp, -1)   # log P(act)
        gate = -(plogp[:, 0] + p_log_p(act_lp))
        candidate = -p_log_p(card_lp).sum(-1) + p_log_p(act_lp)
        tile = -plogp[:, 1:grid].sum(-1) + p_log_p(card_lp[:, :slots]).sum(-1)
        return gate, candidate, tile

    def noop_entropy(self) -> torch.Tensor:
        """Binary entropy of play vs wait, bounded by ln 2 = 0.693 nats."""
        p = self.logp[:, 0].exp().clamp(1e-7, 1 - 1e-7)
        return -(p * p.log() + (1 - p) * (1 - p).log())

    def n_legal(self) -> torch.Tensor:
        return self.mask.sum(-1)


# How a frozen player turns its distribution into an action (design 7.5): ladder.release_mode for
# the snapshots and the probed learner in evaluation, ladder.opponent_mode for the pool's seats in
# training battles. The learner's own seats always sample: PPO's ratio needs the behaviour policy.
# (the distribution, its rows' vector (B, V) float32, their uniforms (B,) float32) -> (B,) int64 actions
Decode = Callable[[MaskedCategorical, torch.Tensor, torch.Tensor], torch.Tensor]


def sample_decode(d: MaskedCategorical, vector: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return d.sample(u)


def argmax_decode(d: MaskedCategorical, vector: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return d.mode()


def decode_fn(mode: str, path: str) -> Decode:
    """The Decode a mode names; path: the config field that named it, for the error. "stochastic"
    samples at the seat's uniform, "argmax" takes the most probable legal action, and
    "plugin:<module>:<function>" calls your function as fn(logp, mask, vector, u): copies of the
    rows' masked log-probs (B, A) and mask (B, A), their decoded observation vector (B, V) and
    the seat's uniforms (B,), so a plugin that draws stays a function of the master seed (design
    2.2). It returns one legal action a row; anything else stops the run, naming the row."""
    if mode == "stochastic":
        return sample_decode
    if mode == "argmax":
        return argmax_decode
    kind, module, name = (mode.split(":") + ["", ""])[:3]
    if kind != "plugin" or not module or not name or mode.count(":") != 2:
        raise ConfigError(f"{flag(path)} {mode!r}: must be stochastic, argmax or plugin:<module>:<function>")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{flag(path)} {mode!r}: cannot load {module}.{name} ({e}); the module must import "
                          f"from where you run (the repository root is on the path)") from None
    if not callable(fn):
        raise ConfigError(f"{flag(path)} {mode!r}: {module}.{name} is not a function")

    def plugin(d: MaskedCategorical, vector: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        a = torch.as_tensor(fn(d.logp.clone(), d.mask.clone(), vector, u))
        n, A = d.mask.shape
        bad = ("" if a.shape == (n,) and not a.is_floating_point()
               else f"returned {a.dtype} of shape {tuple(a.shape)}")
        if not bad:
            a = a.to(device=d.mask.device, dtype=torch.int64)
            ok = (a >= 0) & (a < A)
            ok &= d.mask.gather(1, a.clamp(0, A - 1).unsqueeze(-1)).squeeze(-1)
            if not bool(ok.all()):
                r = int(torch.nonzero(~ok)[0])
                bad = f"chose action {int(a[r])} on row {r}, which its mask forbids"
        if bad:
            raise ConfigError(f"{flag(path)} {mode!r} {bad}: a decode returns one legal action (int) "
                              f"for each of the {n} rows")
        return a
    return plugin


def plugin_files(*modes: str) -> list[Path]:
    """The source files of the plugins these modes name, for the run's user_code (design 2.4): a
    new body of a decode is another player."""
    out = []
    for m in modes:
        if m.startswith("plugin:"):
            spec = importlib.util.find_spec(m.split(":")[1])
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                out.append(Path(spec.origin))
    return out


def factored_log_probs(gate: torch.Tensor, choices: torch.Tensor, tiles: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """The factored head's three stages as one (B, A) row of flat log-probabilities in the env's
    encoding [no-op, (slot, tile) in C order, buttons], all float32 (design 5.1):
      p(no-op)          = 1 - sigmoid(gate)
      p(slot s, tile t) = sigmoid(gate) * softmax(choices over candidates)[s]
                          * softmax(tiles[s] over its legal tiles)[t]
      p(button b)       = sigmoid(gate) * softmax(choices over candidates)[P + b]
    gate (B,), choices (B, P + NB), tiles (B, P, H*W). A slot is a candidate when any of its tiles
    is legal, a button when it is; a row without a candidate waits at log-prob exactly 0. The
    legal entries sum to one, so MaskedCategorical's log_softmax over them gives them back; an
    illegal entry is 0 here and masked there, and takes no gradient."""
    B, P, HW = tiles.shape
    fmin = torch.finfo(torch.float32).min
    tile_ok = mask[:, 1:1 + P * HW].reshape(B, P, HW)
    choice_ok = torch.cat([tile_ok.any(-1), mask[:, 1 + P * HW:]], -1)
    acts = choice_ok.any(-1)
    wait = torch.where(acts, F.logsigmoid(-gate), torch.zeros_like(gate))
    play = (F.logsigmoid(gate)[:, None]
            + torch.log_softmax(choices.masked_fill(~choice_ok, fmin), -1).masked_fill(~choice_ok, 0.0))
    tile_lp = torch.log_softmax(tiles.masked_fill(~tile_ok, fmin), -1).masked_fill(~tile_ok, 0.0)
    return torch.cat([wait[:, None], (play[:, :P, None] + tile_lp).reshape(B, -1), play[:, P:]],
                     -1).masked_fill(~mask, 0.0)


def refuse_clear_noop(mask: torch.Tensor) -> None:
    """The no-op is always legal, so a row without it is a bug upstream: refused by row number."""
    if not bool(mask[:, 0].all()):
        rows = torch.nonzero(~mask[:, 0]).flatten()[:16].tolist()
        raise ValueError(f"mask[NOOP] must be True (royalegym action.py sets it always); "
                         f"rows {rows} have it clear")


def forced_rows(mask: np.ndarray) -> np.ndarray:
    """(B,) bool, on the host: the rows whose mask allows the no-op alone (design 6.5's forced rows).
    Whatever the logits, such a row's action is the no-op at log-prob exactly 0 and p(no-op)
    exactly 1 (a log-softmax over one entry is 0), so acting writes those without a forward
    (design 3.6). Decided from the host's copy of the mask (codec.host_mask), so acting on a GPU
    learns which rows to run without waiting on the device. A clear no-op bit is refused here."""
    refuse_clear_noop(torch.from_numpy(mask))
    return mask[:, 0] & ~mask[:, 1:].any(-1)


# --- 4. Networks (design 5.1, 5.2, 5.4) ----------------------------------------------------------
# Two trunks of identical shape (actor, critic), separate weights by default, so "the mask and
# the entropy bonus never touch the critic" is structural rather than a discipline.
# GroupNorm, never BatchNorm: BatchNorm is a different function at rollout (small batch) than at
# update, which would break the stored-log-prob contract (design 5.2).


def torch_generator(master_seed: int, path: str, device: str = "cpu") -> torch.Generator:
    """A torch generator seeded by name (design 2.2), e.g. "torch/init". Never the global one."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_int(master_seed, path))
    return g


def _conv_gn(cin: int, cout: int, groups: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(groups, cout)]


class ResBlock(nn.Module):
    def __init__(self, c: int, groups: int) -> None:
        super().__init__()
        self.a = nn.Sequential(*_conv_gn(c, c, groups), nn.ReLU(), *_conv_gn(c, c, groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.a(x))


def board_pool(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, 2C): each channel's mean and max over the board."""
    return torch.cat([x.mean((2, 3)), x.amax((2, 3))], 1)


def legal_frac(mask: torch.Tensor, geo: NetGeometry) -> torch.Tensor:
    """(B, P): the mean of each hand slot's slice of the mask; the critic's view of legality."""
    H, W = geo.tiles
    P = geo.hand_size
    return mask[:, 1:1 + P * H * W].reshape(-1, P, H * W).float().mean(-1)


class Rows(NamedTuple):
    """The rows a subset forward computes: `idx`, ascending, of a batch of `n` (actor_rows), on
    the batch's device. The observation a subset forward reads holds those rows alone."""
    idx: torch.Tensor
    n: int


def at_batch_shape(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                   rows: Rows | None) -> torch.Tensor:
    """layer(x), where x holds rows.idx of a batch of rows.n, computed at the whole batch's shape
    (the other rows zero) and those rows returned. A CPU gemm's result for a row depends on the
    batch's row count and the row's place in it (MKL picks its kernel by shape), never on the
    other rows' values, so this is the whole batch's Linear bit for bit [M: docs/throughput.md];
    the zero rows are cheap next to the convolutions. rows None: layer(x)."""
    if rows is None:
        return layer(x)
    full = x.new_zeros((rows.n, *x.shape[1:]))
    full[rows.idx] = x
    return layer(full)[rows.idx]


def host_index(idx: np.ndarray, dev: torch.device) -> torch.Tensor:
    """Host indices as an index tensor on `dev`. A copy from pageable host memory makes the host
    wait for every kernel already queued on the stream (the CUDA runtime's rule for pageable
    transfers), so on CUDA the indices go through pinned memory, non_blocking, and the forward's
    kernels queue behind the unpack's without a wait."""
    t = torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def actor_rows(forced: np.ndarray) -> np.ndarray:
    """The rows the actor runs on when acting, on the host: every row with a choice, ascending.
    A lone choice row in a batch of more rides with one forced row: PyTorch runs a one-row 3x3
    convolution of at most 20,480 input values on its native CPU path rather than oneDNN, whose
    sums differ in the last bit [M: docs/throughput.md], so the actor never runs on one row where
    the whole batch had more."""
    idx = np.flatnonzero(~forced)
    if idx.size == 1 and forced.size > 1:
        idx = np.sort(np.append(idx, np.flatnonzero(forced)[0]))
    return idx


def embedding(n: int, dim: int, padding_idx: int | None = None) -> nn.Embedding:
    """nn.Embedding, whose own N(0, 1) fill is skipped on the meta device (parameter_count,
    arch_description): there it runs through a Python decomposition whose first call imports
    torch's compiler, 1.7 s of CPU a process [M] (design 5.6)."""
    e = nn.Embedding.from_pretrained(torch.empty(n, dim), freeze=False, padding_idx=padding_idx)
    if not e.weight.is_meta:
        e.reset_parameters()
    return e


def edge_taps(H: int, W: int) -> torch.Tensor:
    """(3, 3, H, W): 1 where a 3x3 zero-padded convolution's tap (i, j) at tile (y, x) lands on
    the board. A plane constant over the board meets kernel w there as sum_ij w[i, j] * taps."""
    d = torch.arange(3) - 1
    on_y = ((torch.arange(H)[None] + d[:, None]) >= 0) & ((torch.arange(H)[None] + d[:, None]) < H)
    on_x = ((torch.arange(W)[None] + d[:, None]) >= 0) & ((torch.arange(W)[None] + d[:, None]) < W)
    return (on_y[:, None, :, None] & on_x[None, :, None, :]).float()


class Trunk(nn.Module):
    """cat[spatial, mask_planes, coords, broadcast vector embedding, card-id embedding]
    -> Conv3x3 GN ReLU -> N residual blocks [-> + Linear(mean, max) ReLU: net.global_pool]
    ->  (B, C, H, W).

    The stem is that one convolution, computed in parts: the board's own planes
    (and card-id embeddings) through the convolution, the coordinate planes and the broadcast
    vector embedding, constant over the board, as maps from their kernels' edge sums
    (edge_taps, stem_conv). The same function to float rounding; the convolution reads k*(S+P) channels
    rather than k*(S+P) + 2 + E, and the backward forms no gradient for its input, which the
    broadcast embedding, the one input that needs one, made it form for every channel. It was
    the update's largest single cost [M: docs/throughput.md]."""

    def __init__(self, geo: NetGeometry, net: "NetArgs") -> None:
        super().__init__()
        S, H, W = geo.spatial_shape
        k, P, NB = geo.frame_stack, geo.hand_size, geo.n_buttons
        self.geo, self.coord_conv = geo, net.coord_conv
        self.vemb = nn.Linear(geo.vector_size + NB, net.vector_embed)
        in_ch = k * (S + P) + (2 if net.coord_conv else 0) + net.vector_embed
        if geo.card_id_channels:
            self.card_ids = embedding(geo.card_id_vocab, CARD_ID_EMBED, padding_idx=0)
            in_ch += k * geo.card_id_channels * CARD_ID_EMBED
        with torch.device("cpu"):   # data: on the meta device stack and arange would import torch's compiler
            ys = torch.linspace(0.0, 1.0, H).view(H, 1).expand(H, W)
            xs = torch.linspace(0.0, 1.0, W).view(1, W).expand(H, W)
            self.register_buffer("coords", torch.stack([ys, xs]), persistent=False)
            self.register_buffer("taps", edge_taps(H, W), persistent=False)
        self.n_board = k * (S + P)      # the stem kernel's input channels, in parts' order
        self.stem = nn.Sequential(*_conv_gn(in_ch, net.channels, net.norm_groups), nn.ReLU())
        self.body = nn.Sequential(*[ResBlock(net.channels, net.norm_groups) for _ in range(net.blocks)])
        self.glob = nn.Linear(2 * net.channels, net.channels) if net.global_pool else None
        self.in_channels = in_ch

    def forward(self, obs: Any, rows: Rows | None = None) -> torch.Tensor:
        """rows: obs holds rows.idx of a batch of rows.n; bit for bit what the whole batch gives them."""
        geo = self.geo
        H, W = geo.tiles
        G = 1 + geo.hand_size * H * W
        vin = obs.vector
        if geo.n_buttons:  # the ability buttons' readiness rides with the vector (design 5.1)
            vin = torch.cat([vin, obs.mask[:, G:G + geo.n_buttons].to(vin.dtype)], -1)
        # at the batch's shape: a matmul's rows depend on it (at_batch_shape)
        vmap = at_batch_shape(lambda v: self.vector_map(self.vemb(v)), vin, rows)
        B = obs.vector.shape[0]
        planes = obs.mask_planes
        if planes is None:  # derived from the mask: a reshape of bytes the row already carries
            if geo.frame_stack != 1:
                raise ValueError("frame_stack > 1 needs stacked mask_planes from codec.unpack; got None")
            planes = obs.mask[:, 1:G].reshape(B, geo.hand_size, H, W).float()
        parts = [obs.spatial, planes.to(obs.spatial.dtype)]
        if geo.card_id_channels:
            e = self.card_ids(obs.card_ids)                      # (B, k*c, H, W, 8)
            parts.append(e.permute(0, 1, 4, 2, 3).reshape(B, -1, H, W).to(obs.spatial.dtype))
        _, norm, relu = self.stem
        x = self.body(relu(norm(self.stem_conv(torch.cat(parts, 1), vmap))))
        if self.glob is None:
            return x
        g = at_batch_shape(self.glob, board_pool(x), rows)
        return F.relu(x + g[:, :, None, None])

    def _kernel(self, part: str) -> torch.Tensor:
        """The stem kernel's slice for one part of cat[board, coords, vector, card ids]."""
        w, nb = self.stem[0].weight, self.n_board
        nc = nb + (2 if self.coord_conv else 0)
        ne = nc + self.vemb.out_features
        return {"board": w[:, :nb], "coords": w[:, nb:nc], "vector": w[:, nc:ne], "card_ids": w[:, ne:]}[part]

    def vector_map(self, v: torch.Tensor) -> torch.Tensor:
        """(B, E) -> (B, C, H, W): the stem convolution of v broadcast over the board, as one
        matmul with the vector kernel's edge sums."""
        H, W = self.geo.tiles
        w = self._kernel("vector")
        sums = torch.einsum("oeij,ijyx->eoyx", w, self.taps.to(w.dtype))
        return (v @ sums.reshape(v.shape[-1], -1).to(v.dtype)).view(-1, w.shape[0], H, W)

    def stem_conv(self, planes: torch.Tensor, vmap: torch.Tensor) -> torch.Tensor:
        """The stem convolution of the whole input, from planes = cat[board, card ids] and
        vmap = vector_map(v): planes convolved, plus the coordinates' and the vector's maps."""
        w = self._kernel("board")
        if self.geo.card_id_channels:
            w = torch.cat([w, self._kernel("card_ids")], 1)
        x = F.conv2d(planes, w, self.stem[0].bias, padding=1)
        if self.coord_conv:
            x = x + F.conv2d(self.coords.to(x.dtype).unsqueeze(0), self._kernel("coords"), None, padding=1)
        return x + vmap.to(x.dtype)


class CardQueries(nn.Module):
    """What both policy heads share: each hand slot's query, from its card's embedding, cost and
    affordability (q, and the slot bias qb), and the per-tile features fp it meets, an inner
    product over sqrt(C) with every tile (design 5.1)."""

    def __init__(self, geo: NetGeometry, net: "NetArgs") -> None:
        super().__init__()
        C = net.channels
        self.geo = geo
        self.cards_at, self.cost_at, self.afford_at = (geo.field(HAND_CARDS), geo.field(HAND_COST),
                                                       geo.field(HAND_AFFORDABLE))
        self.K = geo.card_vocab()
        self.fp = nn.Sequential(*_conv_gn(C, C, net.norm_groups), nn.ReLU())
        self.card = embedding(self.K, C)
        self.q = nn.Linear(C + 2, C)
        self.qb = nn.Linear(C + 2, 1)
        self.scale = C ** -0.5          # logit_scale "rsqrt_c"

    def queries(self, x: torch.Tensor, vector: torch.Tensor, rows: Rows | None) -> tuple[torch.Tensor, ...]:
        """(q_in, q, tiles, pooled) of x's rows, whose vector rows `vector` is: the slots' query
        inputs (B, P, C+2) and queries (B, P, C), the tiles' inner products (B, P, H, W) and the
        board's mean and max features (B, 2C)."""
        B, P = x.shape[0], self.geo.hand_size
        fp = self.fp(x)
        card_id = vector[:, self.cards_at].reshape(B, P, self.K).argmax(-1)
        q_in = torch.cat([self.card(card_id), vector[:, self.cost_at, None], vector[:, self.afford_at, None]],
                         -1).to(fp.dtype)
        q = at_batch_shape(self.q, q_in, rows)
        tiles = torch.einsum("bcyx,bkc->bkyx", fp, q) * self.scale
        return q_in, q, tiles, board_pool(fp)


class PointerHead(CardQueries):
    """logits = [noop, (P, H, W) tiles, buttons]: a card-conditioned inner product with every
    tile plus the slot's bias, one softmax over all of them and the no-op (design 5.1). The head's
    shape is royalegym's encode(slot, x, y) = 1 + slot*H*W + y*W + x."""

    def __init__(self, geo: NetGeometry, net: "NetArgs") -> None:
        super().__init__(geo, net)
        C = net.channels
        self.noop = nn.Linear(2 * C, 1)
        self.buttons = nn.Linear(2 * C, geo.n_buttons) if geo.n_buttons else None
        self.noop_bias = float(net.noop_bias)

    def forward(self, x: torch.Tensor, vector: torch.Tensor, mask: torch.Tensor,
                rows: Rows | None = None) -> torch.Tensor:
        """x, vector: the trunk's rows and their vectors, rows.idx of a batch of rows.n (None: all). The
        mask is not read: the logits are masked in MaskedCategorical (FactoredHead reads it)."""
        q_in, _, tiles, pooled = self.queries(x, vector, rows)
        tiles = tiles + at_batch_shape(self.qb, q_in, rows)[..., None]
        parts = [at_batch_shape(self.noop, pooled, rows).float() + self.noop_bias,
                 tiles.reshape(x.shape[0], -1).float()]
        if self.buttons is not None:
            parts.append(at_batch_shape(self.buttons, pooled, rows).float())
        return torch.cat(parts, -1)  # float32 always (design 5.2)


class FactoredHead(CardQueries):
    """factored_log_probs from three stages (design 5.1): the gate, act against wait, on the pooled
    board; each slot's card query against a projection of the pooled board, plus the slot's
    bias, and the buttons on the pooled board, for which card or button; the card query's inner
    product with every tile, for where. Under the pointer head a card's share of the probability
    grows with its count of legal tiles, and the no-op starts at one over the legal count; here
    the card is chosen before its tiles are counted, and waiting starts at 1 - factored_act_init."""

    def __init__(self, geo: NetGeometry, net: "NetArgs") -> None:
        super().__init__(geo, net)
        C = net.channels
        self.board = nn.Linear(2 * C, C)
        self.gate = nn.Linear(2 * C, 1)
        self.buttons = nn.Linear(2 * C, geo.n_buttons) if geo.n_buttons else None

    def forward(self, x: torch.Tensor, vector: torch.Tensor, mask: torch.Tensor,
                rows: Rows | None = None) -> torch.Tensor:
        """x, vector, mask: the trunk's rows, rows.idx of a batch of rows.n (None: all)."""
        q_in, q, tiles, pooled = self.queries(x, vector, rows)
        slots = (torch.einsum("bc,bkc->bk", at_batch_shape(self.board, pooled, rows), q) * self.scale
                 + at_batch_shape(self.qb, q_in, rows)[..., 0])
        choices = [slots.float()]
        if self.buttons is not None:
            choices.append(at_batch_shape(self.buttons, pooled, rows).float())
        gate = at_batch_shape(self.gate, pooled, rows)[:, 0].float()
        return factored_log_probs(gate, torch.cat(choices, -1), tiles.flatten(2).float(), mask)


@functools.lru_cache(maxsize=8)
def _placement_rank(H: int, W: int, kh: int, kw: int) -> np.ndarray:
    """(Hc, Wc, kh*kw) float32: each tile's order of preference within its cell, by squared
    distance from the centre of the cell's tiles (a last cell cut by the board edge is centred on
    what it holds), ties to the lower index; padding beyond the board is never chosen (inf)."""
    Hc, Wc = -(-H // kh), -(-W // kw)
    rank = np.full((Hc, Wc, kh * kw), np.inf, np.float32)
    for cy in range(Hc):
        for cx in range(Wc):
            ys, xs = range(cy * kh, min((cy + 1) * kh, H)), range(cx * kw, min((cx + 1) * kw, W))
            my, mx = (ys[0] + ys[-1]) / 2, (xs[0] + xs[-1]) / 2
            for i, y in enumerate(range(cy * kh, (cy + 1) * kh)):
                for j, x in enumerate(range(cx * kw, (cx + 1) * kw)):
                    if y < H and x < W:
                        rank[cy, cx, i * kw + j] = (y - my) ** 2 + (x - mx) ** 2
    order = np.argsort(rank, axis=-1, kind="stable")            # equal distances: the lower index first
    out = np.empty_like(rank)
    np.put_along_axis(out, order, np.arange(kh * kw, dtype=np.float32)[None, None], axis=-1)
    return np.where(np.isinf(rank), np.inf, out)


def placement_mask(mask: torch.Tensor, geo: NetGeometry, cell: tuple[int, int]) -> torch.Tensor:
    """net.placement_cell (design 5.5): the (B, A) mask with each (card, cell)'s legal tiles
    thinned to one, its most preferred (_placement_rank); the no-op and the buttons as they were.
    A function of the mask alone, so acting, the update, the ladder and Bot all read one
    distribution, and the action is still the env's tile."""
    kh, kw = cell
    if (kh, kw) == (1, 1):
        return mask
    B, P, (H, W) = mask.shape[0], geo.hand_size, geo.tiles
    Hc, Wc, G = -(-H // kh), -(-W // kw), 1 + P * H * W
    grid = F.pad(mask[:, 1:G].reshape(B, P, H, W), (0, Wc * kw - W, 0, Hc * kh - H))
    cells = grid.reshape(B, P, Hc, kh, Wc, kw).transpose(3, 4).reshape(B, P, Hc, Wc, kh * kw)
    rank = torch.as_tensor(_placement_rank(H, W, kh, kw), device=mask.device)
    pick = torch.where(cells, rank, torch.inf).argmin(-1, keepdim=True)
    keep = torch.zeros_like(cells).scatter_(-1, pick, cells.any(-1, keepdim=True))
    tiles = keep.reshape(B, P, Hc, Wc, kh, kw).transpose(3, 4).reshape(B, P, Hc * kh, Wc * kw)[:, :, :H, :W]
    return torch.cat([mask[:, :1], tiles.reshape(B, -1), mask[:, G:]], -1)


def placement_action(kept: torch.Tensor, action: torch.Tensor, geo: NetGeometry,
                     cell: tuple[int, int]) -> torch.Tensor:
    """The action the head chooses for a legal env action under net.placement_cell: a tile becomes
    the tile placement_mask kept in its (card, cell), the no-op and the buttons stay. kept: the
    thinned mask (the policy's own, MaskedCategorical.mask). How a warm start clones a rung whose
    tile the thinned mask drops (the rung's cell is its choice)."""
    kh, kw = cell
    if (kh, kw) == (1, 1):
        return action
    P, (H, W), A = geo.hand_size, geo.tiles, kept.shape[1]
    Hc, Wc = -(-H // kh), -(-W // kw)
    i = torch.arange(A, device=kept.device)
    card, y, x = (i - 1) // (H * W), (i - 1) % (H * W) // W, (i - 1) % W
    on_board = (i >= 1) & (i < 1 + P * H * W)
    cell_id = torch.where(on_board, (card * Hc + y // kh) * Wc + x // kw, -1 - i)   # no-op, buttons: alone
    same = cell_id[None, :] == cell_id[action][:, None]
    return (kept & same).int().argmax(-1)


HEADS = {"pointer": PointerHead, "factored": FactoredHead}
"""--net.policy-head: both write (B, A) float32 in the env's encoding, which MaskedCategorical reads."""


class ValueHead(nn.Module):
    def __init__(self, geo: NetGeometry, net: "NetArgs") -> None:
        super().__init__()
        C = net.channels
        self.geo = geo
        self.vfeat = nn.Linear(geo.vector_size, net.vector_embed)
        self.mlp = nn.Sequential(nn.Linear(2 * C + net.vector_embed + geo.hand_size, net.value_hidden),
                                 nn.ReLU(), nn.Linear(net.value_hidden, 1))

    def forward(self, x: torch.Tensor, obs: Any) -> torch.Tensor:
        pooled = board_pool(x)
        feat = torch.cat([pooled, self.vfeat(obs.vector).to(pooled.dtype),
                          legal_frac(obs.mask, self.geo).to(pooled.dtype)], 1)
        return self.mlp(feat).squeeze(-1).float()


class Acted(NamedTuple):
    """What acting on a batch gives: (B,) actions, their log-probs and p(no-op), and how many rows
    the actor ran on (the rest were forced rows, written without a forward)."""
    action: torch.Tensor
    log_prob: torch.Tensor
    p_noop: torch.Tensor
    forwarded: int


class ActorCritic(nn.Module):
    def __init__(self, geo: NetGeometry, net: "NetArgs", master_seed: int) -> None:
        super().__init__()
        if net.channels % net.norm_groups:
            raise ConfigError(f"net.channels {net.channels} is not divisible by "
                              f"net.norm_groups {net.norm_groups}")
        self.geo, self.net = geo, net
        self.actor_trunk = Trunk(geo, net)
        self.critic_trunk = Trunk(geo, net) if net.separate_trunks else None
        self.policy = HEADS[net.policy_head](geo, net)
        self.value_head = ValueHead(geo, net)
        self.autocast = net.autocast_dtype
        if not next(self.parameters()).is_meta:   # shapes alone (parameter_count): nothing to draw
            init_weights(self, torch_generator(master_seed, "torch/init"))

    def actor_parameters(self) -> list[nn.Parameter]:
        return list(self.actor_trunk.parameters()) + list(self.policy.parameters())

    def critic_parameters(self) -> list[nn.Parameter]:
        """Disjoint from actor_parameters. Under a shared trunk the trunk is the actor's (its
        value gradient still reaches it through the one backward)."""
        trunk = list(self.critic_trunk.parameters()) if self.critic_trunk is not None else []
        return trunk + list(self.value_head.parameters())

    def _ctx(self, device_type: str):
        on = self.autocast == "bfloat16"
        return torch.autocast(device_type, dtype=torch.bfloat16, enabled=on)

    def policy_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The actions the policy chooses among: the env's mask, thinned to a tile a cell under
        net.placement_cell. The trunk still reads the full mask as input."""
        return placement_mask(mask, self.geo, tuple(self.net.placement_cell))

    def logits(self, obs: Any, rows: Rows | None = None) -> torch.Tensor:
        with self._ctx(obs.vector.device.type):
            return self.policy(self.actor_trunk(obs, rows), obs.vector, self.policy_mask(obs.mask),
                               rows).float()

    def value(self, obs: Any) -> torch.Tensor:
        with self._ctx(obs.vector.device.type):
            trunk = self.critic_trunk if self.critic_trunk is not None else self.actor_trunk
            return self.value_head(trunk(obs), obs).float()

    def dist(self, obs: Any, check_noop: bool = True, rows: Rows | None = None) -> MaskedCategorical:
        """rows: obs holds rows.idx of a batch of rows.n (a subset forward, at_batch_shape)."""
        return MaskedCategorical(self.logits(obs, rows), self.policy_mask(obs.mask), check_noop=check_noop)

    @torch.no_grad()
    def act_and_hold(self, obs_of: Callable[[np.ndarray], Any], u: torch.Tensor, forced: np.ndarray,
                     decode: Decode = sample_decode) -> Acted:
        """Rollout inference: actions from the caller's uniforms, their log-probs to store, and
        each row's p(no-op), the rollout's own hold probability (design 9.2's policy/rollout_hold_*,
        measured on the policy that chose, not the one the update moved). obs_of(idx): the
        codec.Obs of the batch's rows idx (ascending); forced: forced_rows of the host's mask. A
        forced row is neither unpacked nor forwarded: the no-op, log-prob 0, p(no-op) 1, exactly
        what its forward would give. The actor runs on the other rows alone (actor_rows), bit for
        bit what the whole batch's forward gives them (design 3.6). Every index is decided on the
        host and copied to the device without a wait (host_index). decode: how a frozen player
        picks (decode_fn); the learner's seats keep the sample."""
        n = len(forced)
        if not forced.any():   # forced_rows has refused a clear no-op bit already
            obs = obs_of(np.arange(n))
            d = self.dist(obs, check_noop=False)
            a = decode(d, obs.vector, u)
            return Acted(a, d.log_prob(a), d.logp[:, 0].exp(), len(a))
        dev = u.device
        a = torch.zeros(n, dtype=torch.int64, device=dev)
        lp = torch.zeros(n, dtype=torch.float32, device=dev)
        p0 = torch.ones(n, dtype=torch.float32, device=dev)
        idx = actor_rows(forced)
        if idx.size == 0:
            return Acted(a, lp, p0, 0)
        rows, obs = Rows(host_index(idx, dev), n), obs_of(idx)
        d = self.dist(obs, check_noop=False, rows=rows)
        ar = decode(d, obs.vector, u[rows.idx])
        keep = np.flatnonzero(~forced[idx])    # a forced row that rode along keeps its exact values
        at, keep_t = host_index(idx[keep], dev), host_index(keep, dev)
        a[at], lp[at], p0[at] = ar[keep_t], d.log_prob(ar)[keep_t], d.logp[keep_t, 0].exp()
        return Acted(a, lp, p0, len(idx))


def init_weights(model: ActorCritic, gen: torch.Generator) -> None:
    """design 5.4: orthogonal, gain sqrt(2) on hidden convs/linears, 0.01 on the policy head's
    linears (the pointer's q, qb, no-op and buttons; the factored head's q, qb, board, gate and
    buttons), 1.0 on the value head's last linear, zero biases but the factored gate's, which is
    the log-odds of net.factored_act_init; embeddings N(0, 0.02); the trunks' global-pool linears
    zero, drawing nothing, so every other weight and v0's function are the network's without it.
    Every draw from the torch/init generator: weights = f(master_seed)."""
    head = model.policy
    small = {id(m) for m in head.modules() if isinstance(m, nn.Linear)}
    last_value = model.value_head.mlp[-1]
    zero = {id(t.glob) for t in (model.actor_trunk, model.critic_trunk)
            if t is not None and t.glob is not None}
    for m in model.modules():
        if id(m) in zero:
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.Conv2d, nn.Linear)):
            gain = 0.01 if id(m) in small else 1.0 if m is last_value else math.sqrt(2.0)
            nn.init.orthogonal_(m.weight, gain=gain, generator=gen)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02, generator=gen)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
    if isinstance(head, FactoredHead):
        p = model.net.factored_act_init
        nn.init.constant_(head.gate.bias, math.log(p / (1 - p)))


# --- 5. GAE and reward scaling (design 6.1, 6.2) -------------------------------------------------


def gae(rewards: torch.Tensor, values: torch.Tensor, final_values: torch.Tensor, terminated: torch.Tensor,
        truncated: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised over slots: one backward loop of T steps over (R,) vectors.

    rewards, final_values, terminated, truncated: (T, R); values: (T+1, R), row T the bootstrap.
    A terminated cell bootstraps from 0, a truncated one from final_value (the critic on
    final_obs), any other cell from values[t+1] -- the true next observation, because SAME_STEP
    autoreset only replaces a row whose episode ended. ~ended breaks the recursion at every end,
    terminated or truncated (terminated alone would leak the next episode's advantage back
    across a truncation). Returns (advantages, returns), both (T, R)."""
    T = rewards.shape[0]
    ended = terminated | truncated
    zeros = torch.zeros_like(final_values)
    boot = torch.where(terminated, zeros, torch.where(truncated, final_values, values[1:]))
    adv = torch.zeros_like(rewards[0])
    out = torch.empty_like(rewards)
    for t in reversed(range(T)):
        delta = rewards[t] + gamma * boot[t] - values[t]
        adv = delta + gamma * lam * (~ended[t]).to(rewards.dtype) * adv
        out[t] = adv
    return out, out + values[:T]


def smdp_gae(rewards: torch.Tensor, values: torch.Tensor, final_values: torch.Tensor,
             terminated: torch.Tensor, truncated: torch.Tensor, choice: torch.Tensor, gamma: float,
             lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over decisions rather than ticks (design 6.6): one backward loop of T steps over (R,)
    vectors, the same arguments as gae() plus choice (T, R), the cells whose mask offered more
    than the no-op.

    A transition runs from a choice cell to its slot's next choice cell k ticks later (or to its
    episode's end, or to row T), carrying R = sum_{j<k} gamma^j r, a discount gamma^k and a trace
    lambda^k: A = R + gamma^k V(next) - V + (gamma lambda)^k A(next). An end inside it bootstraps
    as gae() does (0 on termination, gamma^k V(final observation) on truncation), the edge from
    gamma^(T - t) V(row T) with no advantage behind it. A forced cell's value is never read.
    Both exponents are needed: a per-decision gamma would pay the policy for slowing its own
    clock (dumping elixir lengthens a stretch), and a per-decision lambda would triple the credit
    horizon.

    Two carries hold what a transition meets at cell t + 1: `head`, the part discounted by gamma
    (V(t + 1) at a choice cell, else that cell's own reward sum and bootstrap), and `tail`, the
    part discounted by gamma*lambda (A(t + 1) at a choice cell, else that cell's own tail). With
    every cell a choice it is gae() operation for operation, so bit for bit. Returns
    (advantages, targets), both (T, R): the advantage at choice cells (0 elsewhere); the target
    at every cell, A + V at a choice cell and, at a forced one, the lambda-return of the
    transition from it to the next choice cell, which never reads its own value (the critic's
    target on its forced sample)."""
    T = rewards.shape[0]
    ended = terminated | truncated
    zeros = torch.zeros_like(final_values)
    end_boot = torch.where(terminated, zeros, final_values)
    head, tail = values[T], torch.zeros_like(rewards[0])
    adv, target = torch.empty_like(rewards), torch.empty_like(rewards)
    for t in reversed(range(T)):
        s = rewards[t] + gamma * torch.where(ended[t], end_boot[t], head)
        p = gamma * lam * (~ended[t]).to(rewards.dtype) * tail
        a = s - values[t] + p
        adv[t] = torch.where(choice[t], a, 0.0)
        target[t] = torch.where(choice[t], a + values[t], s + p)
        head = torch.where(choice[t], values[t], s)
        tail = torch.where(choice[t], a, p)
    return adv, target


def discounted_return_per_episode(rewards: np.ndarray, ended: np.ndarray, gamma: float) -> np.ndarray:
    """(T, R) return-to-go of the raw rewards, G_t = r_t + gamma * G_{t+1}, cut at each episode
    end (the discount_cumsum of the references), within this iteration: an episode still running
    at cycle T contributes its partial sum, with no bootstrap, since this only sets a scale.
    Backward, not the forward running sum: under the potential reward the forward sum is the
    shaping's small drift plus one terminal +-1 an episode, so its std sits near 0.05 and a
    terminal reward divided by it hit reward_clip on 0.15-0.48% of cells [M, --profile cpu]; the
    return-to-go carries the terminal reward over the whole episode, the magnitude the scale is
    meant to measure (0 cells clipped on the same run)."""
    out = np.empty_like(rewards, dtype=np.float64)
    run = np.zeros(rewards.shape[1], dtype=np.float64)
    for t in range(rewards.shape[0] - 1, -1, -1):
        run = rewards[t] + gamma * np.where(ended[t], 0.0, run)
        out[t] = run
    return out


class WelfordReturnScaler:
    """Divide rewards by the running std of raw discounted returns (n-1 variance), then clip.
    The mean is never subtracted: that would change the sign structure of a zero-sum reward.
    The (mean, count, m2) triple is checkpointed (design 6.2)."""

    def __init__(self, standardize: bool = True, reward_clip: float = 10.0) -> None:
        self.standardize, self.reward_clip = standardize, reward_clip
        self.mean, self.count, self.m2 = 0.0, 0, 0.0

    def update(self, x: np.ndarray, comm: Comm | None = None) -> None:
        """Chan et al.'s parallel merge of a batch into the running triple, in float64. Under
        torchrun every rank's batch is merged, in rank order, so every rank holds the same triple."""
        x = np.asarray(x, dtype=np.float64).ravel()
        mine = (x.size, float(x.mean()), float(((x - x.mean()) ** 2).sum())) if x.size else (0, 0.0, 0.0)
        if comm is None or not comm.on:
            self._merge(*mine)
            return
        import torch.distributed as dist
        t = torch.tensor(mine, dtype=torch.float64, device=comm.device)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        for n_b, mean_b, m2_b in (q.tolist() for q in parts):
            self._merge(int(n_b), mean_b, m2_b)

    def _merge(self, n_b: int, mean_b: float, m2_b: float) -> None:
        if n_b == 0:
            return
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += m2_b + delta * delta * self.count * n_b / n
        self.count = n

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0

    def scale(self, rewards: np.ndarray) -> tuple[np.ndarray, float]:
        """(scaled and clipped rewards, fraction of cells clipped)."""
        s = self.std if (self.standardize and self.count > 1) else 1.0
        scaled = np.asarray(rewards, dtype=np.float64) / max(s, 1e-8)
        clipped = np.clip(scaled, -self.reward_clip, self.reward_clip)
        return clipped.astype(np.float32), float((clipped != scaled).mean()) if scaled.size else 0.0

    def state(self) -> dict[str, Any]:
        return {"mean": self.mean, "count": self.count, "m2": self.m2}

    def load_state(self, d: dict[str, Any]) -> None:
        self.mean, self.count, self.m2 = float(d["mean"]), int(d["count"]), float(d["m2"])


def standardize_advantages(adv: np.ndarray, cells: np.ndarray, comm: Comm | None = None) -> np.ndarray:
    """Once per iteration, over the cells that reach the update (design 6.3): every trainable
    cell, or under critic_only_choice_mean the choice cells alone (design 6.5); under torchrun
    over every rank's cells, from their summed count, sum and sum of squares (float64)."""
    a = adv[cells]
    if comm is None or not comm.on:
        return (adv - a.mean()) / (a.std(ddof=1) + 1e-8)
    a64 = a.astype(np.float64)
    n, tot, sq = comm.sum_(torch.tensor([a64.size, a64.sum(), (a64 * a64).sum()], dtype=torch.float64,
                                        device=comm.device)).tolist()
    mean = tot / n
    std = math.sqrt(max(sq - n * mean * mean, 0.0) / max(n - 1, 1))
    return ((adv - mean) / (std + 1e-8)).astype(adv.dtype)


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    var = float(returns.var()) if returns.numel() > 1 else 0.0
    return 1.0 - float((returns - values).var()) / max(var, 1e-8) if returns.numel() > 1 else float("nan")


def credit_horizon_seconds(decision_ms: int, gamma: float, lam: float) -> float:
    return decision_ms / 1000.0 / (1.0 - gamma * lam)


# --- 6. The PPO update (design 6.3, 6.4, 6.5) ---------------------------------------------------
# The update reads its samples through a two-method seam, UpdateData (n, n_legal, gather(idx)),
# so the rectangle buffer and the tests feed it the same way. Minibatches never drop a sample:
# the last batch is smaller and weighted by its true size, and gradients accumulate as sums
# divided by the BATCH's count with one optimizer step per batch, which makes minibatch_size a
# pure memory knob (a test holds the accumulated gradient to the full-batch one).

FORCED_ROWS = ("all", "critic_only", "critic_only_choice_mean", "smdp")
CHOICE_MEAN = ("critic_only_choice_mean", "smdp")   # the actor's terms divided by the choice count


class Minibatch(NamedTuple):
    """Everything a PPO loss reads of its rows, together from the rollout to minibatch_loss: a loss
    variant (a clipped value loss, a changed clip) edits minibatch_loss alone. The rows' masks are
    obs.mask; a row's kind is n_legal (1: a forced row, design 6.5)."""
    obs: Any                 # codec.Obs on the device
    action: torch.Tensor     # (n,) int64
    log_prob: torch.Tensor   # (n,) float32, stored at rollout
    value: torch.Tensor      # (n,) float32, the critic pass's value before the update (scaled returns)
    adv: torch.Tensor        # (n,) float32, standardised once per iteration
    ret: torch.Tensor        # (n,) float32
    n_legal: torch.Tensor    # (n,) int64: the stored mask-count column (design 6.5)


def obs_rows(obs: Any, sel: torch.Tensor) -> Any:
    """Rows `sel` of a codec.Obs (a NamedTuple; None fields stay None)."""
    return type(obs)._make(None if x is None else x[sel] for x in obs)


def unpacked(obs: Any) -> Callable[[np.ndarray], Any]:
    """act_and_hold's obs_of over a batch already unpacked: its rows idx."""
    return lambda idx: obs_rows(obs, torch.as_tensor(idx, device=obs.vector.device))


def ppo_update(ac: ActorCritic, opt_actor: Adam, opt_critic: Adam,
               data: Any, ppo: "PPOArgs", *, ent_coef: float, ent_coef_noop: float, master_seed: int,
               iteration: int, debug: bool, check_ratio: bool, ratio_atol: float, comm: Comm | None = None,
               actor_steps: bool = True, teacher: tuple[ActorCritic, float] | None = None) -> dict[str, Any]:
    """The update, called by the loop (section 8, step 5): n_epochs passes over data's rows in
    batches of ppo.batch_size (the last one smaller, never dropped). A batch's gradient is summed
    minibatch by minibatch from minibatch_loss, then one optimizer step (optimizer_step). Before any
    step, the ratio invariant (design 6.4). The epoch's permutation is
    ppo/minibatch/iteration/{i}/epoch/{e} (design 2.2). actor_steps False (WarmArgs.critic_iterations)
    steps the critic alone; teacher: (the clone, its weight), see minibatch_loss; debug: the mask
    asserts of design 5.3 on every minibatch. Returns the row's ppo/ keys (UpdateStats.row), with
    time/update, the ten worst ratios ("outliers", for a halt's bundle) and the update's rows."""
    t0, comm = time.perf_counter(), SOLO if comm is None else comm
    stats = UpdateStats(ac, ppo)
    # every rank runs as many batches as the fullest one, an emptier rank's extra batches adding
    # zero gradient, so no collective waits on a rank that has stopped calling it
    n_batches = int(comm.most(-(-data.n // ppo.batch_size)))
    with unfilled_empty_tensors():
        for e in range(ppo.n_epochs):
            perm = derive_generator(master_seed,
                                    f"ppo/minibatch/iteration/{iteration}/epoch/{e}").permutation(data.n)
            if e == 0:   # the worst rank's: its alarm halts
                stats.ratio_dev = comm.most(ratio_invariant(ac, data, perm, ppo.minibatch_size, check_ratio,
                                                            ratio_atol, stats.outliers))
            for b in range(n_batches):
                opt_actor.zero_grad()
                opt_critic.zero_grad()
                order, scale = batch_rows(data, perm[b * ppo.batch_size:(b + 1) * ppo.batch_size], ppo, comm)
                stats.batch(scale)
                for s in range(0, len(order), ppo.minibatch_size):
                    # sorted inside the minibatch (locality for the gather; a sum does not care), so
                    # data.gather returns rows in idx's order and labels line up with rows
                    idx = np.sort(order[s:s + ppo.minibatch_size])
                    m = data.gather(idx)
                    if debug:
                        _debug_checks(m, data, idx)
                    n_choice = int((data.n_legal[idx] > 1).sum())   # counted on the host: no sync
                    n_actor = len(idx) if ppo.forced_rows == "all" else n_choice
                    loss, parts = minibatch_loss(ac, m, n_actor, ppo, scale, ent_coef, ent_coef_noop,
                                                 teacher, debug)
                    loss.backward()
                    stats.minibatch(parts, e, n_choice)
                stats.step(*optimizer_step(ac, opt_actor, opt_critic, ppo, comm, actor_steps,
                                           f"iteration {iteration} epoch {e} batch {b}"))
    stats.reduce(comm)
    return {**stats.row(teacher is not None), "time/update": time.perf_counter() - t0,
            "outliers": stats.outliers, "update_rows": comm.counts(data.n)[0]}


def ratio_invariant(ac: ActorCritic, data: Any, perm0: np.ndarray, minibatch_size: int, check: bool,
                    atol: float, outliers: list[dict[str, Any]] | None = None) -> float:
    """design 6.4 / 3.3, measured before any optimizer step: on the first minibatch_size CHOICE rows
    of epoch 0's permutation (a forced row's ratio is exactly 1 and says nothing), every ratio
    must be 1 to atol. Measured in its own no-grad forward rather than inside the first batch:
    under critic_only a first batch can hold no choice row, and by the time a later batch's actor
    runs Adam's momentum has already moved it [M: 3.5e-4 on the smoke profile's iteration 2].
    `outliers`, when given, is filled with the ten worst samples (design 9.4's bundle), worst first:
    their label, (cycle, slot) where the data is a rectangle (RectData), ratio and |ratio - 1|."""
    first = perm0[data.n_legal[perm0] > 1][:minibatch_size]
    if first.size == 0:
        return 0.0
    idx = np.sort(first)
    m = data.gather(idx)
    with torch.no_grad():
        ratio = torch.exp(ac.dist(m.obs, check_noop=False).log_prob(m.action) - m.log_prob)
        dev = (ratio - 1).abs()
    worst = float(dev.max())
    if outliers is not None:
        top = torch.argsort(dev, descending=True, stable=True)[:10].cpu().numpy()
        for j, lab in zip(top, data.label(idx[top]), strict=True):
            o: dict[str, Any] = {"sample": lab, "ratio": float(ratio[j]), "abs_dev": float(dev[j])}
            if hasattr(data, "t") and hasattr(data, "r"):
                o["cycle"], o["slot"] = int(data.t[idx[j]]), int(data.r[idx[j]])
            outliers.append(o)
    if check and not worst <= atol:
        rows = idx[torch.argsort(dev, descending=True)[:10].cpu().numpy()]
        raise RatioInvariantError(
            f"ratio invariant broken: max |ratio - 1| = {worst:.3g} > ratio_atol {atol:g} on the first "
            f"minibatch of choice rows, before any step. Worst samples: {data.label(rows)}. Check, in "
            f"order: (1) the rollout and update masks agree, (2) the codec table is the one the rows "
            f"were packed with, (3) the weights that acted are the weights being updated (design 3.3, 6.4).")
    return worst


class Scale(NamedTuple):
    """A batch's divisors (design 6.5's table): the critic's terms are divided by every row of the
    batch, the actor's by every row too (all, critic_only) or by the batch's choice rows
    (critic_only_choice_mean, smdp). Under torchrun both are the global batch's, every rank's rows
    together (Comm)."""
    rows: int
    choice: int
    actor: int


def batch_rows(data: Any, bidx: np.ndarray, ppo: "PPOArgs", comm: Comm) -> tuple[np.ndarray, Scale]:
    """A batch's rows in the order its minibatches take them, and its Scale. Under every value of
    forced_rows but all the choice rows come first (a stable partition), so the actor runs on whole
    minibatches of choice rows and skips the forced rows' minibatches."""
    choice = data.n_legal[bidx] > 1
    order = bidx if ppo.forced_rows == "all" else np.concatenate([bidx[choice], bidx[~choice]])
    rows, n_choice = comm.counts(int(len(bidx)), int(choice.sum()))
    return order, Scale(rows, n_choice, max(n_choice, 1) if ppo.forced_rows in CHOICE_MEAN else rows)


def _debug_checks(m: Minibatch, data: Any, idx: np.ndarray) -> None:
    """The two mask asserts of design 5.3 and the n_legal column check of design 6.5, debug iterations."""
    legal = m.obs.mask.gather(-1, m.action.unsqueeze(-1)).squeeze(-1)
    if not bool(legal.all()):
        bad = np.asarray(idx)[(~legal).cpu().numpy()][:10]
        raise StoredActionIllegal(f"stored actions illegal under their stored masks at {data.label(bad)}: "
                                  f"the rollout and update masks disagree "
                                  f"(a mask bug, not a learning problem)")
    if not bool(torch.isfinite(m.log_prob).all()):
        bad = np.asarray(idx)[(~torch.isfinite(m.log_prob)).cpu().numpy()][:10]
        raise NonFiniteLogProb(f"stored log-probs not finite at {data.label(bad)}")
    cnt = m.obs.mask.sum(-1)
    if not bool((cnt == m.n_legal).all()):
        bad = np.asarray(idx)[(cnt != m.n_legal).cpu().numpy()][:10]
        raise MaskCountMismatch(f"n_legal column disagrees with the unpacked mask at {data.label(bad)}: the "
                                f"minibatch gather put one row's count beside another row's observation")


class LossParts(NamedTuple):
    """What a minibatch's loss was made of, kept for UpdateStats, which reads them without grad and
    recomputes nothing, so a changed loss reports its own clip fractions and value loss. The actor's
    fields are None when the minibatch held no row the actor runs on."""
    sq: torch.Tensor                  # (n,) the critic's loss a row (squared error unless a fork changes it)
    sel: torch.Tensor | None          # (n,) bool: the actor's rows (None: every row, forced_rows=all)
    adv_all: torch.Tensor             # (n,) every row's advantage (a forced row's surrogate, ratio 1)
    dist: MaskedCategorical | None    # the actor's distribution on its rows
    ratio: torch.Tensor | None        # (a,) pi / pi_old on the actor's rows
    adv: torch.Tensor | None          # (a,) their advantages
    n_legal: torch.Tensor | None      # (a,) their legal-action counts
    surrogate: "Surrogate | None"     # (a,) the clipped surrogate, and which rows it clipped
    entropy: torch.Tensor | None      # (a,) the policy's entropy
    noop_entropy: torch.Tensor | None  # (a,) the play-or-wait entropy
    stages: tuple[torch.Tensor, ...] | None   # (a,) x 3: entropy by stage (entropy_coef_stages)
    kl_teacher: torch.Tensor | None   # (a,) KL(clone || actor), when a teacher is kept


def minibatch_loss(ac: ActorCritic, m: Minibatch, n_actor: int, ppo: "PPOArgs", scale: Scale,
                   ent_coef: float, ent_coef_noop: float, teacher: tuple[ActorCritic, float] | None,
                   check_noop: bool) -> tuple[torch.Tensor, LossParts]:
    """The PPO loss of one minibatch, the method in one place (design 6.3, 6.5). The critic: the
    squared error of every row, over scale.rows. The actor, on its n_actor rows (every row under
    forced_rows=all, else the choice rows; a forced row's ratio is 1 and carries no gradient): the
    clipped surrogate, the entropy bonus (whole, or by stage) and the play-or-wait entropy bonus,
    plus teacher's weight x KL(clone || actor) when a clone is kept (WarmArgs.teacher_kl), summed
    over its rows and divided by scale.actor. Summed over a batch's minibatches the backward calls
    give the batch's gradient exactly (a test holds it to the whole batch's)."""
    sq = (ac.value(m.obs) - m.ret) ** 2
    loss = ppo.vf_coef * sq.sum() / scale.rows
    sel = None if ppo.forced_rows == "all" else m.n_legal > 1
    if not n_actor:
        return loss, LossParts(sq, sel, m.adv, *[None] * 9)
    rows = (lambda x: x) if sel is None else (lambda x: x[sel])
    obs = m.obs if sel is None else obs_rows(m.obs, sel)
    dist = ac.dist(obs, check_noop=check_noop)
    ratio = torch.exp(dist.log_prob(rows(m.action)) - rows(m.log_prob))
    surr = clipped_surrogate(ratio, rows(m.adv), ppo.clip_range, ppo.dual_clip_c)
    entropy, noop_entropy = dist.entropy(), dist.noop_entropy()
    stages = None
    if ppo.entropy_coef_stages is None:
        bonus = ent_coef * entropy
    else:
        stages = dist.entropy_split(ac.geo.hand_size, ac.geo.tiles[0] * ac.geo.tiles[1])
        bonus = sum(c * h for c, h in zip(ppo.entropy_coef_stages, stages, strict=True))
    loss = loss + (-surr.obj.sum() - bonus.sum() - ent_coef_noop * noop_entropy.sum()) / scale.actor
    kl_teacher = None
    if teacher is not None:
        kl_teacher = teacher_kl(teacher[0], obs, dist)
        loss = loss + teacher[1] * kl_teacher.sum() / scale.actor
    return loss, LossParts(sq, sel, m.adv, dist, ratio, rows(m.adv), rows(m.n_legal), surr, entropy,
                           noop_entropy, stages, kl_teacher)


class Surrogate(NamedTuple):
    obj: torch.Tensor       # (a,) the per-row objective, to be maximised
    clipped: torch.Tensor   # (a,) bool: the ratio lay outside [1 - clip, 1 + clip] (ppo/clip_fraction)
    dual: torch.Tensor      # (a,) bool: the dual clip's floor bound (ppo/dual_clip_fraction)


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip_range: float,
                      dual_clip_c: float) -> Surrogate:
    """Per-sample PPO objective L_i (to be maximised). For A < 0 the plain min does not bound
    the loss below, and in a masked space of thousands of actions a rarely sampled action's ratio can be
    enormous, so the dual clip floors it at c * A (design 6.3). It says which rows each clip bound,
    at the range it was given, for the row's clip fractions."""
    surr = torch.min(ratio * adv, ratio.clamp(1 - clip_range, 1 + clip_range) * adv)
    dual = (adv < 0) & (dual_clip_c * adv > surr)
    return Surrogate(torch.where(adv < 0, torch.max(surr, dual_clip_c * adv), surr),
                     (ratio - 1).abs() > clip_range, dual)


def teacher_kl(teacher: ActorCritic, obs: Any, dist: MaskedCategorical) -> torch.Tensor:
    """(n,) KL(teacher || actor) over each row's legal actions: the clone's log-probs carry no
    gradient, the actor's do, so the term pulls the actor toward the clone where the clone is sure
    and leaves it free where the clone spreads (forward KL, as kickstarting distils a teacher)."""
    with torch.no_grad():
        t = teacher.dist(obs, check_noop=False).logp
    return (t.exp() * torch.where(dist.mask, t - dist.logp, torch.zeros_like(t))).sum(-1)


def optimizer_step(ac: ActorCritic, opt_actor: Adam, opt_critic: Adam,
                   ppo: "PPOArgs", comm: Comm, actor_steps: bool,
                   where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One step from a batch's summed gradient: summed over the ranks, each optimizer's clipped on
    its own, refused when not finite (the weights stay intact), then a step of each (the critic's
    alone when not actor_steps). Returns the pre-clip gradient norms."""
    pa, pc = ac.actor_parameters(), ac.critic_parameters()
    _ensure_grads(pa)
    _ensure_grads(pc)
    comm.grads(pa + pc)
    gna = nn.utils.clip_grad_norm_(pa, ppo.max_grad_norm)   # returns the PRE-clip norm
    gnc = nn.utils.clip_grad_norm_(pc, ppo.max_grad_norm)
    if not bool(torch.isfinite(gna) & torch.isfinite(gnc)):  # one sync per optimizer step
        raise NonFiniteGradient(f"non-finite gradient at {where}: actor norm {float(gna)}, "
                                f"critic norm {float(gnc)}")
    if actor_steps:
        opt_actor.step()
    opt_critic.step()
    return gna.detach(), gnc.detach()


def _ensure_grads(params: Sequence[nn.Parameter]) -> None:
    """A batch with no choice row gives the actor a ZERO gradient rather than none, so Adam takes
    the same momentum step it takes under forced_rows=all (design 6.5)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


class UpdateStats:
    """The update's diagnostics, apart from its loss: summed as device tensors without grad and read
    back once at the end (a per-minibatch .item() would put a device sync between every backward
    and the next forward), then made into the row's ppo/ keys (design 9.2's table)."""

    KEYS = ("value_sq", "kl", "clip", "dual", "entropy", "entropy_norm", "noop_entropy", "policy_obj_choice",
            "policy_obj_all", "entropy_gate", "entropy_candidate", "entropy_tile", "p_act", "kl_teacher")

    def __init__(self, ac: ActorCritic, ppo: "PPOArgs") -> None:
        self.ppo = ppo
        self.params = (ac.actor_parameters(), ac.critic_parameters())
        self.before = tuple(_flat(p) for p in self.params)   # for the update's magnitude
        self.s: dict[str, torch.Tensor | float] = {}
        self.epoch_kl = [0.0] * ppo.n_epochs
        self.epoch_clip = [0.0] * ppo.n_epochs
        self.epoch_n = [0.0] * ppo.n_epochs
        self.ratio_dev = 0.0
        self.outliers: list[dict[str, Any]] = []
        self.grad_norms: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self.actor_rows = self.actor_forwards = self.rows = self.choice_rows = self.steps = 0

    def add(self, key: str, v: torch.Tensor | float) -> None:
        self.s[key] = self.s.get(key, 0.0) + v

    def batch(self, scale: Scale) -> None:
        self.rows += scale.rows
        self.choice_rows += scale.choice

    @torch.no_grad()
    def minibatch(self, p: LossParts, epoch: int, n_choice: int) -> None:
        """One minibatch's sums; the kl, clip and entropy means are over choice rows only."""
        self.add("value_sq", p.sq.sum())
        if p.ratio is not None:
            self.actor_rows += len(p.ratio)
            self.actor_forwards += 1
            chf = (p.n_legal > 1).to(torch.float32)
            kl = (((p.ratio - 1) - torch.log(p.ratio)) * chf).sum()
            clip = (p.surrogate.clipped.to(torch.float32) * chf).sum()
            self.add("kl", kl)
            self.add("clip", clip)
            self.add("dual", (p.surrogate.dual.to(torch.float32) * chf).sum())
            self.add("entropy", (p.entropy * chf).sum())
            self.add("entropy_norm",
                     (p.entropy / torch.log(p.dist.n_legal().clamp_min(2).to(torch.float32)) * chf).sum())
            self.add("noop_entropy", (p.noop_entropy * chf).sum())
            if p.kl_teacher is not None:
                self.add("kl_teacher", (p.kl_teacher * chf).sum())
            if p.stages is not None:
                for key, h in zip(("entropy_gate", "entropy_candidate", "entropy_tile"), p.stages,
                                  strict=True):
                    self.add(key, (h * chf).sum())
                self.add("p_act", ((1.0 - p.dist.logp[:, 0].exp()) * chf).sum())
            self.add("policy_obj_choice", (p.surrogate.obj * chf).sum())
            self.add("policy_obj_all", p.surrogate.obj.sum())
            self.epoch_kl[epoch] = self.epoch_kl[epoch] + kl
            self.epoch_clip[epoch] = self.epoch_clip[epoch] + clip
        if p.sel is not None:   # the skipped forced rows' constant surrogate, added back (ratio is 1)
            self.add("policy_obj_all", (p.adv_all * (~p.sel).to(p.adv_all.dtype)).sum())
        self.epoch_n[epoch] += n_choice

    def step(self, grad_norm_actor: torch.Tensor, grad_norm_critic: torch.Tensor) -> None:
        self.grad_norms[0].append(grad_norm_actor)
        self.grad_norms[1].append(grad_norm_critic)
        self.steps += 1

    def reduce(self, comm: Comm) -> None:
        """The rank-local sums summed over the ranks (rows and choice_rows already are: they are
        the global batches' counts), so every rank reads the same kl for the lr backoff."""
        if not comm.on:
            return
        n = len(self.epoch_kl)
        local = [float(self.s.get(k, 0.0)) for k in self.KEYS] + [float(x) for x in self.epoch_kl] + \
            [float(x) for x in self.epoch_clip] + [float(x) for x in self.epoch_n] + \
            [self.actor_rows, self.actor_forwards]
        tot = comm.sum_(torch.tensor(local, dtype=torch.float64, device=comm.device)).tolist()
        self.s = dict(zip(self.KEYS, tot, strict=False))
        k = len(self.KEYS)
        self.epoch_kl, self.epoch_clip, self.epoch_n = (tot[k:k + n], tot[k + n:k + 2 * n],
                                                        tot[k + 2 * n:k + 3 * n])
        self.actor_rows, self.actor_forwards = int(tot[-2]), int(tot[-1])

    def row(self, teacher: bool) -> dict[str, float]:
        """The ppo/ keys: losses per row, policy statistics per choice row, counts, norms."""
        s = {k: float(v) for k, v in self.s.items()}
        nc, n = max(self.choice_rows, 1), max(self.rows, 1)
        ga, gc = (torch.stack(g) for g in self.grad_norms)
        out = {
            "ppo/policy_loss": -s.get("policy_obj_all", 0.0) / n,
            "ppo/policy_loss_choice": -s.get("policy_obj_choice", 0.0) / nc,
            "ppo/value_loss": s.get("value_sq", 0.0) / n,
            "ppo/entropy": s.get("entropy", 0.0) / nc,
            "ppo/entropy_normalised": s.get("entropy_norm", 0.0) / nc,
            "ppo/noop_entropy": s.get("noop_entropy", 0.0) / nc,
            "ppo/kl": s.get("kl", 0.0) / nc,
            "ppo/clip_fraction": s.get("clip", 0.0) / nc,
            "ppo/dual_clip_fraction": s.get("dual", 0.0) / nc,
            "ppo/forced_frac": 1.0 - self.choice_rows / n,
            "ppo/actor_rows": float(self.actor_rows),
            "ppo/actor_forwards": float(self.actor_forwards),
            "ppo/optimizer_steps": float(self.steps),
            "ppo/actor_rows_seen": float(self.rows),
            "ppo/ratio_max_abs_dev": float(self.ratio_dev),
            "ppo/grad_norm_actor": float(ga.mean()), "ppo/grad_norm_actor_max": float(ga.max()),
            "ppo/grad_norm_critic": float(gc.mean()), "ppo/grad_norm_critic_max": float(gc.max()),
            "ppo/update_magnitude_actor": float((_flat(self.params[0]) - self.before[0]).norm()),
            "ppo/update_magnitude_critic": float((_flat(self.params[1]) - self.before[1]).norm()),
        }
        if teacher:
            out["ppo/kl_teacher"] = s.get("kl_teacher", 0.0) / nc
        if self.ppo.entropy_coef_stages is not None:   # what the stages' coefficients act on, choice rows
            out.update({f"ppo/{k}": s.get(k, 0.0) / nc
                        for k in ("entropy_gate", "entropy_candidate", "entropy_tile", "p_act")})
        for e in range(self.ppo.n_epochs):
            ne = max(self.epoch_n[e], 1)
            out[f"ppo/kl_epoch{e}"] = float(self.epoch_kl[e]) / ne
            out[f"ppo/clip_fraction_epoch{e}"] = float(self.epoch_clip[e]) / ne
        return out


def _flat(params: Sequence[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


@contextlib.contextmanager
def unfilled_empty_tensors() -> Iterator[None]:
    """Under deterministic algorithms torch fills every new empty tensor with NaN, so that a
    kernel reading memory it never wrote shows it. No kernel of the update does: a smoke run
    without the fill writes the filled run's bytes (a differential test). The fill was a tenth
    of the update's time on the cpu profile [M: docs/throughput.md]. Restored on exit."""
    was = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was


class Adam:
    """Adam (Kingma and Ba, 2015) as torch.optim.Adam computes it with betas (0.9, 0.999) and no
    weight decay: the operations of its multi-tensor form in their order (on the CPU, its
    single-tensor form's, tensor by tensor), so the same bits, and its state_dict, so a checkpoint
    written by either loads in the other. Ours because torch's imports torch's compiler at its
    first use, about 2 s of CPU at every process that trains [M], and nothing here compiles
    (design 6.3; test_adam_takes_torch_s_steps_bit_for_bit)."""

    # torch.optim.Adam's options as its state_dict writes them: a checkpoint's param group and the
    # state digest carry them, so they stay verbatim; only lr and eps are ever set here.
    OPTIONS = {"betas": (0.9, 0.999), "weight_decay": 0, "amsgrad": False, "maximize": False,
               "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": False}

    def __init__(self, params: Iterable[nn.Parameter], lr: float, eps: float) -> None:
        self.params = list(params)
        self.param_groups = [{"lr": lr, "eps": eps, **self.OPTIONS, "params": self.params}]
        self.state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}   # from a parameter's first gradient

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        g = self.param_groups[0]
        (b1, b2), lr, eps = g["betas"], g["lr"], g["eps"]
        params = [p for p in self.params if p.grad is not None]
        for p in params:
            if p not in self.state:
                self.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
        grads = [p.grad for p in params]
        steps, m, v = ([self.state[p][k] for p in params] for k in ("step", "exp_avg", "exp_avg_sq"))
        torch._foreach_add_(steps, 1)
        torch._foreach_lerp_(m, grads, 1 - b1)              # m = b1 m + (1 - b1) g
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, 1 - b2)    # v = b2 v + (1 - b2) g^2
        t = [s.item() for s in steps]
        denom = torch._foreach_sqrt(v)                      # sqrt(v / (1 - b2^t)) + eps
        torch._foreach_div_(denom, [(1 - b2 ** n) ** 0.5 for n in t])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, m, denom, [(lr / (1 - b1 ** n)) * -1 for n in t])

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: the state by parameter index, the group's options and its indices."""
        index = {id(p): i for i, p in enumerate(self.params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"state": {index[id(p)]: dict(st) for p, st in self.state.items()},
                "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        (group,) = sd["param_groups"]
        if list(group["params"]) != list(range(len(self.params))):
            raise ValueError(f"an optimizer state for {len(group['params'])} parameters, this network has "
                             f"{len(self.params)}")
        self.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        self.state = {self.params[int(i)]: {k: t if k == "step" else t.to(self.params[int(i)])
                                            for k, t in st.items()} for i, st in sd["state"].items()}


def make_optimizers(ac: ActorCritic, ppo: "PPOArgs") -> tuple[Adam, Adam]:
    """Separate Adam for actor and critic (design 6.3): disjoint parameter sets, own lr each."""
    return (Adam(ac.actor_parameters(), lr=ppo.lr_actor, eps=ppo.adam_eps),
            Adam(ac.critic_parameters(), lr=ppo.lr_critic, eps=ppo.adam_eps))


class RatioInvariantError(AssertionError):
    """design 6.4 / 3.3: at epoch 0, minibatch 0, before any step, every ratio must be 1."""


class StoredActionIllegal(AssertionError):
    """A stored action is not legal under its stored mask (design 5.3's first assert)."""


class NonFiniteLogProb(AssertionError):
    """A stored or recomputed log-prob is not finite (design 5.3's second assert)."""


class MaskCountMismatch(AssertionError):
    """The stored n_legal column disagrees with the minibatch's unpacked mask (design 6.5)."""


class NonFiniteGradient(FloatingPointError):
    """A loss or gradient went non-finite; the step is refused so the weights stay intact."""


class LrBackoff:
    """If kl > kl_threshold for `patience` consecutive iterations, multiply both learning rates
    by factor (floored at lr_min), reset the counter, and report the event (design 6.3). The
    counter and the current rates are checkpointed."""

    def __init__(self, cfg: "LrBackoffArgs", lr_actor: float, lr_critic: float) -> None:
        self.cfg, self.lr_actor, self.lr_critic, self.count = cfg, lr_actor, lr_critic, 0

    def observe(self, kl: float) -> bool:
        self.count = self.count + 1 if kl > self.cfg.kl_threshold else 0
        if self.count < self.cfg.patience:
            return False
        self.count = 0
        self.lr_actor = max(self.lr_actor * self.cfg.factor, self.cfg.lr_min)
        self.lr_critic = max(self.lr_critic * self.cfg.factor, self.cfg.lr_min)
        return True

    def apply(self, opt_actor: Adam, opt_critic: Adam) -> None:
        for g in opt_actor.param_groups:
            g["lr"] = self.lr_actor
        for g in opt_critic.param_groups:
            g["lr"] = self.lr_critic

    def state(self) -> dict[str, Any]:
        return {"count": self.count, "lr_actor": self.lr_actor, "lr_critic": self.lr_critic}

    def load_state(self, d: dict[str, Any]) -> None:
        self.count, self.lr_actor, self.lr_critic = (int(d["count"]), float(d["lr_actor"]),
                                                     float(d["lr_critic"]))


# --- 7. Iteration invariants (design 10.1) -------------------------------------------------------
# Judged on what collection wrote, before anything learns from it: a refused batch is never
# trained on. Each raises a named exception carrying the offending slot and cycle.


class IterationInvariantError(AssertionError):
    """Base of the design 10.1 invariants."""


class RoundsMissing(IterationInvariantError): ...
class TrainableRowsShort(IterationInvariantError): ...
class DeployRefused(IterationInvariantError): ...
class EpisodesUnpaired(IterationInvariantError): ...
class MixtureDrifted(IterationInvariantError): ...
class AssignmentInsideEpisode(IterationInvariantError): ...
class ForcedRowInconsistent(IterationInvariantError): ...


def _cells(mask: np.ndarray, n: int = 10) -> str:
    t, r = np.nonzero(mask)
    return ", ".join(f"(cycle {a}, slot {b})"
                     for a, b in zip(t[:n].tolist(), r[:n].tolist(), strict=True)) + \
        (f" and {len(t) - n} more" if len(t) > n else "")


def check_iteration(*, rounds: int, expected_rounds: int, trainable: np.ndarray, timesteps_per_iteration: int,
                    log_prob: np.ndarray, action_legal: np.ndarray, deploy_status: np.ndarray,
                    episode_end: np.ndarray, group: np.ndarray, discarded_rows_frac: float,
                    expected_discarded_frac: float, action: np.ndarray, n_legal: np.ndarray) -> None:
    """Every array is (T, R) in cycle-major order; slot 2g is battle g's blue seat, 2g+1 red."""
    if rounds != expected_rounds:
        raise RoundsMissing(f"{rounds} rounds collected, expected T * shards_per_worker = {expected_rounds}")
    if trainable.sum() < 0.98 * timesteps_per_iteration:
        raise TrainableRowsShort(f"{int(trainable.sum())} trainable cells, under 98% of "
                                 f"ppo.timesteps_per_iteration {timesteps_per_iteration}: workers died "
                                 "or the mixture starves the learner")
    bad = trainable & ~np.isfinite(log_prob)
    if bad.any():
        raise NonFiniteLogProb(f"non-finite stored log-prob at {_cells(bad)}")
    bad = trainable & ~action_legal
    if bad.any():
        raise StoredActionIllegal(f"stored action illegal under its stored mask at {_cells(bad)}")
    bad = trainable & (deploy_status > 0)
    if bad.any():
        raise DeployRefused(f"the engine refused a deploy the mask allowed at {_cells(bad)}")
    blue, red = episode_end[:, 0::2], episode_end[:, 1::2]
    if blue.shape != red.shape or (blue != red).any():
        g = np.zeros_like(episode_end, dtype=bool)
        g[:, 0::2] = blue != red
        raise EpisodesUnpaired(f"a battle's two seats ended episodes on different cycles at {_cells(g)}")
    if abs(discarded_rows_frac - expected_discarded_frac) >= 0.05:
        raise MixtureDrifted(f"discarded_rows_frac {discarded_rows_frac:.3f} "
                             f"vs {expected_discarded_frac:.3f} expected from ladder.mix: "
                             "the matchmaker is not drawing the configured mixture")
    changed = np.zeros_like(group, dtype=bool)
    # a worker's death turns its cells dead mid-episode: not a change of policy (design 3.7)
    changed[1:] = (group[1:] != group[:-1]) & ~episode_end[:-1].astype(bool) & (group[1:] != farm.GROUP_DEAD)
    if changed.any():
        raise AssignmentInsideEpisode(f"a slot's policy group changed mid-episode at {_cells(changed)}")
    forced = trainable & (n_legal == 1)
    bad = forced & ((log_prob != 0.0) | (action != 0))
    if bad.any():
        raise ForcedRowInconsistent(f"forced cells (one legal action) must store log-prob exactly 0.0 "
                                    f"and the no-op (design 6.5); not so at {_cells(bad)}")


# --- 8. The loop (design 10.1) ---------------------------------------------------------------------
# _train() reads top to bottom: set up once, then per iteration plan and collect -> critic pass ->
# invariants -> advantages -> update -> ladder step -> record. Each step of the method is a named
# call defined below it; the run's own steps (set_up, record_iteration and the Run's methods) are
# section 9's and 11's. What lives across iterations sits in two small structures, the Learner (what
# learns) and the Run (the directory and what is written into it). train() (section 9), the entry
# point, checks the arguments, joins torchrun's ranks and calls _train.


def _train(args: Args, max_iterations: int | None, quiet: bool, resume: Path | None, allow_drift: bool,
           comm: Comm) -> Path:
    t_start = time.perf_counter()
    # -- set up, once: the env read, the network, the gates, the run directory, the ladder, the farm --
    env, learner, run, ladder_loop, opening, source, view = set_up(args, quiet, resume, allow_drift, t_start,
                                                                    comm)
    first = learner.iteration
    run.announce(env)
    try:
        while (learner.timesteps < args.timestep_limit and not over_budget(args, learner)
               and (max_iterations is None or learner.iteration < max_iterations)):
            iteration, t_it = learner.iteration, time.perf_counter()
            run.iteration = iteration + 1                # as its row will number it, whatever the phase
            schedule = learner.schedule_values(args)     # gamma and entropy coefficients at this env step
            # 0. a worker that died since the last round (during the update) is restarted before the
            #    plan, so the iteration does not lose its rows (design 3.7)
            source.check_workers()
            found = tend_workers(source, run, source.drain_failures(), before_plan=True)
            # 1. plan and collect. A battle mid-episode keeps its assignment (design 3.6); what the
            #    boundary held is kept so an emergency save can return to it (design 10.3)
            ordinals, in_flight = [int(x) for x in source.ordinals], source.in_flight()
            plan = ladder_loop.plan(iteration, source.ordinals,
                                    opening if iteration == first else source.assignment)
            view.new_iteration(renumber=iteration > first)
            source.begin_iteration(plan)
            run.boundary = Boundary(ordinals, ladder_loop.state(list(plan.assignment)),
                                    [int(g) for g in source.generation], in_flight)
            run.phase = "collect"
            rollout = collect(source, view, learner.model, ladder_loop, env, run, iteration, first,
                              schedule["gamma"], t_it)
            rollout.failures = found + rollout.failures
            # 2. each cell's legality, then the critic on the cells the advantages read
            critic = critic_pass(learner.model, view, source, rollout, env, args.ppo, iteration)
            # 3. judged on what collection wrote, before anything learns from it (design 10.1)
            check_rollout(rollout, critic, env, args)
            # 4. advantages: scale the rewards, one GAE scan, standardise once (design 6.1, 6.2)
            run.phase = "learn"   # the scaler, the weights and the optimizers change from here on
            # every rank's trainable cells: the learner's ticks, which timesteps count (smdp too); under
            # smdp the update trains on fewer rows, the choice cells and the critic's sample (update_rows)
            n_rows = comm.counts(int(rollout.trainable.sum()))[0]
            if not n_rows:   # every learner cell lost to dead workers (design 3.7)
                advantage, update = no_update(rollout)
            else:
                advantage = advantages(learner.scaler, rollout, critic, schedule["gamma"], args, comm)
                # 5. the PPO update over the update's rows (under smdp the choice cells and the
                #    critic's sample, design 6.6), then the kl backoff (design 6.3)
                data = update_rows(view, rollout, critic, advantage)
                debug = iteration < args.ppo.debug_assert_iterations   # the mask asserts (design 5.3)
                update = ppo_update(
                    learner.model, learner.opt_a, learner.opt_c, data, args.ppo,
                    ent_coef=schedule["ent_coef"], ent_coef_noop=schedule["ent_coef_noop"],
                    master_seed=args.master_seed, iteration=iteration, debug=debug,
                    # the ratio invariant on its cadence (design 6.4)
                    check_ratio=debug or iteration % args.ppo.check_ratio_invariant_every == 0,
                    ratio_atol=ratio_atol(args), comm=comm,
                    # the critic alone for the warm start's first iterations, then the clone kept as
                    # a teacher at its scheduled weight (WarmArgs)
                    actor_steps=iteration >= args.warm.critic_iterations,
                    teacher=None if learner.teacher is None else (learner.teacher, schedule["teacher_kl"]))
                update["run/lr_backoff"] = learner.back_off(update["ppo/kl"])
            # under torchrun every rank now holds the same weights, or the run stops naming the rank;
            # rank 0, the one voice, takes every rank's episodes for the ladder and the row (design 3.10)
            comm.same_weights(learner)
            rollout.episodes = comm.every_episode(rollout.episodes, env.n_battles)
            learner.advance(schedule, env, n_rows, update)
            verdict = None
            if comm.voice:
                # 6. the ladder's share: train results, gate, floor admit, refit, probe (design 7),
                #    its forwards on inference threads, as collection's: its workers keep their cores
                with torch_threads(args.determinism.inference_threads):
                    ladder_row = ladder_step(ladder_loop, learner, rollout.episodes, env, args, quiet)
                # 7. record: the row, the episodes, the alarms; then what happens next (a Verdict): a
                #    halt saves and stops, a checkpoint on its cadence, a stop asked for (design 9, 8)
                verdict = record_iteration(args, env, learner, run, ladder_loop, rollout, critic, advantage,
                                           update, ladder_row, quiet)
            verdict = comm.share(verdict)   # every rank acts on rank 0's decisions
            ladder_loop.follow(verdict.pool)
            run.halt_if_asked(learner, source, ladder_loop, verdict.halts, update["outliers"])
            if verdict.save:
                run.timed_save(learner, boundary_now(source, ladder_loop))
            if verdict.stop:
                run.say_stopped(learner)   # where it stopped, and the resume command
                break
        run.save_at_limit(learner, boundary_now(source, ladder_loop))   # the limit: saved on the way out
    except (Exception, KeyboardInterrupt) as exc:   # KeyboardInterrupt is named: it is not an Exception
        run.crashed(learner, source, ladder_loop, exc)   # an emergency save where it can; raises
    finally:
        source.close()
        run.close()
    return run.path


# The process-wide torch settings the loop and the warm start change, and put back.

@contextlib.contextmanager
def process_settings_kept() -> Iterator[None]:
    """Put the process-wide torch settings apply_determinism changes back on the way out, so a
    caller in the same process (a test, checks.py) keeps its own."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())
    try:
        yield
    finally:
        deterministic_kernels(saved[0])
        torch.set_num_threads(saved[1])


def deterministic_kernels(on: bool) -> None:
    """torch's deterministic-kernels flag (design 2.1), set as torch.use_deterministic_algorithms
    sets it, less that function's import of torch._inductor to mark its compiler deterministic
    too: 1.6-1.8 s of CPU at every process's start [M: docs/throughput.md, issue 49] for a compiler
    this project never runs (a fork that compiles calls the public function)."""
    torch._C._set_deterministic_algorithms(on, warn_only=False)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads at n inside, put back after: the parent's forwards while its
    workers step run on determinism.inference_threads, the update on torch_threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@dataclass
class Env:
    """What the run is built on, read once at start-up off a built and reset env (design 3.8)."""
    spec: Any                 # farm.EnvSpec: what every worker builds
    table: Any                # codec.CodecTable decided from the obs space
    statics: torch.Tensor     # the static planes of the board, on the device
    geo: NetGeometry
    facts: EnvFacts           # what the identity needs from the env and the codec
    device: torch.device
    n_battles: int
    R: int                    # slots: two seats a battle
    T: int                    # cycles an iteration
    learner_rows: int         # learner seats a cycle
    n_shards: int             # shard-rounds a cycle: workers x shards_per_worker
    seed: int                 # the master seed of this rank's battles, acting and matchmaking
    world: int = 1            # ranks: under torchrun each collects T x n_battles game-steps an iteration
    rank: int = 0             # this process's rank (0: the one voice)
    backend: str = ""         # the process group's ("gloo", "nccl"); "" for one process
    mask_disagreements: int = 0   # the start-up gate's count of mask-vs-engine disagreements
    vram_needed_mb: float | None = None   # step 12's one-minibatch peak plus the headroom (CUDA)
    card_names: tuple[str, ...] = ()   # the engine's catalogue by card id, which the hand one-hot indexes

    @property
    def game_steps(self) -> int:
        """Game-steps an iteration, every rank's battles together: what the schedules, cadences
        and the budget count (design 1.3)."""
        return self.T * self.n_battles * self.world


# The warm start (WarmArgs, design 5.4): the rung plays itself, both seats' choice rows (more
# than one legal action) are packed with the run's codec table, and the actor is fitted to the
# rung's actions by cross-entropy. Its battles and permutations draw from streams of their own
# (warm/...), so the clone is a function of the master seed and the arguments (design 2.2).

class Cloned(NamedTuple):
    rows: np.ndarray      # uint8 (n, row_bytes): the choice rows, packed as the rollout packs them
    seats: np.ndarray     # int64 (n,): 0 blue, 1 red (which static planes unpack scatters in)
    actions: np.ndarray   # int64 (n,): what the rung chose, or would have chosen (a DAgger round)
    game_steps: int       # decisions of every battle played, forced ones included
    search_steps: int = 0   # game-steps a lookahead rung's scratch battles played, apart from those
    order: np.ndarray | None = None   # (n, 2): each row's decision index and global slot, which
    #                                   sort the rows of several processes as one process has them
    tried: np.ndarray | None = None   # int64 (n, K): the rung's candidates at the row (-1: none), a
    #                                   lookahead's every candidate, a scripted rung's its action
    scores: np.ndarray | None = None  # float32 (n, K): their scores (the lookahead's), for soft targets


Weights = dict[str, np.ndarray]
"""A network's state_dict as arrays: how a DAgger round's student reaches the processes it plays in."""


def clone_rows(args: Args, env: Env, round_: int = 0, student: Weights | None = None) -> Cloned:
    """One round of the warm start's battles, one episode each, on the run's env, spread over
    args.warm.workers processes (the rows in battle order, the same for any count). Round 0: the
    rung against itself, args.warm.battles of them. A DAgger round (student: the network's weights as
    arrays, which a spawned process receives whole): the student against itself,
    args.warm.dagger_battles of them, each of its choice rows labelled with what the rung plays there."""
    n = args.warm.battles if round_ == 0 else args.warm.dagger_battles
    chunks = [c for c in np.array_split(np.arange(n), max(1, min(args.warm.workers, n))) if c.size]
    job = functools.partial(labelled_battles, args, env.spec, env.table, env.geo, round_, student)
    if len(chunks) == 1:
        parts = [job(chunks[0])]
    else:   # spawned: a forked child would inherit the parent's torch threads and farm segments
        import concurrent.futures
        import multiprocessing
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=spawn) as ex:
            parts = list(ex.map(job, chunks))
    if not any(len(p.actions) for p in parts):
        raise ConfigError(f"--warm.rung {args.warm.rung}: {n} battles of round {round_} gave no choice row "
                          "to clone")
    order = np.concatenate([p.order for p in parts])
    keep = np.lexsort((order[:, 1], order[:, 0]))      # decision-major, slots ascending
    rows, seats, actions, tried, scores = (np.concatenate([getattr(p, f) for p in parts])[keep]
                                           for f in ("rows", "seats", "actions", "tried", "scores"))
    return Cloned(rows, seats, actions, sum(p.game_steps for p in parts), sum(p.search_steps for p in parts),
                  order[keep], tried, scores)


def labelled_battles(args: Args, spec: Any, table: Any, geo: NetGeometry, round_: int,
                     student: Weights | None, battles: np.ndarray) -> Cloned:
    """clone_rows' battles `battles` (consecutive), in this process on one torch thread. Battle g
    resets from warm/battle/{g}/ordinal/0 (round 0) or warm/round/{r}/battle/{g}, the rung of slot
    i = 2g + seat draws from warm/slot/{i} (round 0) or warm/round/{r}/slot/{i}, the student from
    warm/round/{r}/student/{i}; the student acts on its battle's two seats at once, so its batches
    never depend on the others."""
    from royalegym.action import NOOP
    seed, g0, n = args.master_seed, int(battles[0]), len(battles)
    tag = "warm" if round_ == 0 else f"warm/round/{round_}"
    vec = farm.build_vec(spec, n, autoreset_seed_fn=lambda g, k: derive_int(
        seed, f"warm/battle/{g0 + g}/ordinal/{k}" if round_ == 0 else f"{tag}/battle/{g0 + g}"))
    scratch = functools.cache(lambda: farm.scratch_env(spec))   # a lookahead's, one for all
    rung = [farm.worker_player(args.warm.rung, scratch) for _ in range(2 * n)]
    for i, p in enumerate(rung):
        if isinstance(p, farm.LookaheadPlayer):
            p.bind(vec.envs[i // 2], i % 2)
    rngs = [derive_generator(seed, f"{tag}/slot/{2 * g0 + i}") for i in range(2 * n)]
    net = None if student is None else student_player(student, geo, args, table)
    urngs = [derive_generator(seed, f"{tag}/student/{2 * g0 + i}") for i in range(2 * n)]
    packer, buf = codec.Packer(table), np.zeros((2 * n, table.row_bytes), np.uint8)
    K = len(farm.parse_lookahead(args.warm.rung).candidates) if args.warm.rung.startswith(farm.LOOKAHEAD) \
        else 1
    obs, _ = vec.reset()
    # rows, labels, decision index, slot, candidates, their scores
    live, steps, out = np.ones(n, bool), 0, ([], [], [], [], [], [])
    with process_settings_kept():
        torch.set_num_threads(1)
        for k in itertools.count():
            if not live.any():
                break
            choice = np.repeat(live, 2) & (np.asarray(obs["action_mask"]).sum(-1) > 1)
            one = [{key: v[i] for key, v in obs.items()} for i in range(2 * n)]
            label = np.array([rung[i].act(one[i], obs["action_mask"][i], rngs[i])
                              if (choice[i] if net is not None else live[i // 2]) else NOOP
                              for i in range(2 * n)], np.int64)
            acts = label if net is None else np.concatenate([
                net({key: v[2 * b: 2 * b + 2] for key, v in obs.items()},
                    np.array([urngs[2 * b].random(), urngs[2 * b + 1].random()]))
                if live[b] else np.full(2, NOOP) for b in range(n)]).astype(np.int64)
            if choice.any():
                packer.pack(obs, buf, 0)
                out[0].append(buf[choice].copy())
                out[1].append(label[choice])
                out[2].append(np.full(int(choice.sum()), k))
                out[3].append(2 * g0 + np.flatnonzero(choice))
                tried = [candidates(rung[i], int(label[i]), K) for i in np.flatnonzero(choice)]
                out[4].append(np.stack([t[0] for t in tried]))
                out[5].append(np.stack([t[1] for t in tried]))
            steps += int(live.sum())
            obs, _, term, trunc, _ = vec.step(acts)
            live &= ~(term | trunc)[0::2]   # a battle's first episode only: the vec env resets it
    vec.close()
    search = sum(p.steps for p in rung if isinstance(p, farm.LookaheadPlayer))
    if not out[0]:
        return Cloned(np.zeros((0, table.row_bytes), np.uint8), *(np.zeros(0, np.int64),) * 2, steps, search,
                      np.zeros((0, 2), np.int64), np.zeros((0, K), np.int64), np.zeros((0, K), np.float32))
    slot = np.concatenate(out[3])
    return Cloned(np.concatenate(out[0]), slot % 2, np.concatenate(out[1]), steps, search,
                  np.stack([np.concatenate(out[2]), slot], 1), np.concatenate(out[4]), np.concatenate(out[5]))


def candidates(player: Any, label: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """What the rung weighed at its last act, padded to K: a lookahead's candidates and scores
    (farm.LookaheadPlayer.last), a scripted rung's action alone (score 0)."""
    tried, scores = player.last if isinstance(player, farm.LookaheadPlayer) else ([label], [0.0])
    a, s = np.full(K, -1, np.int64), np.full(K, -np.inf, np.float32)
    a[:len(tried)], s[:len(tried)] = tried, scores
    return a, s


def student_player(student: Weights, geo: NetGeometry, args: Args, table: Any) -> NetPlayer:
    """A DAgger round's student: the network's weights as arrays in a network of the run's
    geometry and net section, sampling its actions (NetPlayer) on the cpu."""
    model = ActorCritic(geo, args.net, args.master_seed)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in student.items()})
    return NetPlayer(model.eval(), table, "cpu")


def warm_start(args: Args, env: Env, model: ActorCritic, quiet: bool) -> dict[str, Any]:
    """Fit the actor to the rung's choices (cross-entropy, its own Adam, the PPO minibatch size and
    gradient clip), then for each DAgger round to the rung's labels of the clone's own battles too
    (the rows aggregated); returns, for warm.json and the console line, the rows and game-steps of
    every round (a lookahead's scratch game-steps apart), the loss and the clone's agreement with
    the rung (its most probable action is the rung's) on every row before and after, and its wall
    clock."""
    t0 = time.perf_counter()
    opt = Adam(model.actor_parameters(), lr=args.warm.lr, eps=args.ppo.adam_eps)
    gen = torch_generator(args.master_seed, "warm/permutation")
    def progress(r: int) -> None:   # a lookahead's round takes minutes: say where it is
        if not quiet:
            c = rounds[-1]
            print(f"warm start: round {r} of {args.warm.dagger_rounds} ({'the rung' if r == 0 else 'DAgger'}"
                  f"): {len(c.actions):,} rows, {c.game_steps:,} game-steps, {c.search_steps:,} scratch "
                  f"game-steps, {time.perf_counter() - t0:.0f} s so far", flush=True)

    rounds = [clone_rows(args, env)]
    progress(0)
    before = fit_clone(args, env, model, rounds, opt, gen)
    for r in range(1, args.warm.dagger_rounds + 1):
        student = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        rounds.append(clone_rows(args, env, r, student))
        progress(r)
        fit_clone(args, env, model, rounds, opt, gen)
    after = fit_clone(args, env, model, rounds, None, gen)   # <run>/warm.json keeps these (set_up)
    out = {"rows": sum(len(c.actions) for c in rounds), "game_steps": sum(c.game_steps for c in rounds),
           "search_game_steps": sum(c.search_steps for c in rounds),
           "rounds": [{"rows": len(c.actions), "game_steps": c.game_steps} for c in rounds],
           "loss_before": before[0], "loss_after": after[0],
           "agree_before": before[1], "agree_after": after[1],
           "seconds": time.perf_counter() - t0}
    if not quiet:
        dagger = f", {args.warm.dagger_rounds} DAgger rounds" if args.warm.dagger_rounds else ""
        print(f"warm start: {args.warm.rung} cloned from {out['rows']:,} choice rows of {args.warm.battles} "
              f"battles{dagger} ({out['game_steps']:,} game-steps), {args.warm.epochs} epochs: "
              f"cross-entropy {before[0]:.3f} -> {after[0]:.3f}, "
              f"agreement with the rung {before[1]:.3f} -> {after[1]:.3f}", flush=True)
    return out


def fit_clone(args: Args, env: Env, model: ActorCritic, rounds: Sequence[Cloned],
              opt: Adam | None, gen: torch.Generator) -> tuple[float, float]:
    """args.warm.epochs passes of cross-entropy over every round's rows (opt None: none): against the
    rung's choice, or under warm.soft_targets against its candidates weighted by softmax(score /
    soft_targets); returns the loss (against the choice) and the agreement on them all before the
    passes."""
    rows, seats, actions, tried, scores = (np.concatenate([getattr(c, f) for c in rounds])
                                           for f in ("rows", "seats", "actions", "tried", "scores"))
    dev, n, mb = env.device, len(actions), args.ppo.minibatch_size
    cell = tuple(model.net.placement_cell)
    soft = soft_targets(scores, args.warm.soft_targets) if args.warm.soft_targets > 0 else None
    tried = np.where(tried >= 0, tried, actions[:, None])       # a padded candidate weighs 0

    def batch(idx: np.ndarray) -> tuple[MaskedCategorical, torch.Tensor]:
        o = codec.unpack(env.table, torch.as_tensor(rows[idx], device=dev), env.statics,
                         torch.as_tensor(seats[idx], device=dev))
        d, a = model.dist(o), torch.as_tensor(actions[idx], device=dev)
        return d, placement_action(d.mask, a, model.geo, cell)

    def soft_loss(d: MaskedCategorical, idx: np.ndarray) -> torch.Tensor:
        cand = torch.as_tensor(tried[idx], device=dev)
        cand = torch.stack([placement_action(d.mask, cand[:, k], model.geo, cell)
                            for k in range(cand.shape[1])], 1)
        return -(torch.as_tensor(soft[idx], device=dev) * d.logp.gather(1, cand)).sum(1).mean()

    loss = agree = 0.0
    with torch.no_grad():
        for i in range(0, n, mb):
            d, a = batch(np.arange(i, min(i + mb, n)))
            loss -= float(d.log_prob(a).sum())
            agree += float((d.mode() == a).sum())
    for _ in range(args.warm.epochs if opt is not None else 0):
        perm = torch.randperm(n, generator=gen).numpy()
        for i in range(0, n, mb):
            d, a = batch(perm[i:i + mb])
            step = -d.log_prob(a).mean() if soft is None else soft_loss(d, perm[i:i + mb])
            opt.zero_grad()
            step.backward()
            nn.utils.clip_grad_norm_(model.actor_parameters(), args.ppo.max_grad_norm)
            opt.step()
    return loss / n, agree / n


def soft_targets(scores: np.ndarray, temperature: float) -> np.ndarray:
    """(n, K) float32: each row's candidates weighted by softmax(score / temperature), a padded one
    (score -inf) 0: tied candidates share the mass the rung's own tie-break gave one of them."""
    z = (scores - scores.max(1, keepdims=True)) / temperature
    w = np.exp(z, where=np.isfinite(z), out=np.zeros_like(z))
    return (w / w.sum(1, keepdims=True)).astype(np.float32)


def warm_game_steps(run: Path) -> int:
    """The game-steps a run's warm start played (its warm.json; 0 without one)."""
    f = run / "warm.json"
    return int(json.loads(f.read_bytes()).get("game_steps", 0)) if f.exists() else 0


def over_budget(args: Args, learner: "Learner") -> bool:
    """args.game_step_limit reached: the warm start's game-steps and the iterations' together."""
    return bool(args.game_step_limit) and learner.warm_steps + learner.env_steps >= args.game_step_limit


class Learner:
    """Everything that learns, and what a checkpoint restores of it (design 8): the network, the
    actor's and the critic's optimizers, the return scaler, the lr backoff, and the positions:
    iterations, game-steps, learner timesteps, optimizer steps, and the schedule values the last
    iteration used (None until an iteration completes in this process)."""

    def __init__(self, args: Args, env: Env, comm: Comm | None = None) -> None:
        self.comm = SOLO if comm is None else comm   # the ranks the update sums over (design 3.10)
        self.model = ActorCritic(env.geo, args.net, args.master_seed).to(env.device)
        self.opt_a, self.opt_c = make_optimizers(self.model, args.ppo)
        self.scaler = WelfordReturnScaler(args.advantage.standardize_rewards, args.advantage.reward_clip)
        self.backoff = LrBackoff(args.ppo.lr_backoff, args.ppo.lr_actor, args.ppo.lr_critic)
        self.iteration = self.env_steps = self.timesteps = self.updates = 0
        self.sched: dict[str, float] | None = None
        self.teacher: ActorCritic | None = None   # WarmArgs.teacher_kl's clone, set_up loads it from v0
        self.warm_steps = 0                       # the warm start's game-steps (game_step_limit counts them)

    def schedule_values(self, args: Args) -> dict[str, float]:
        """The schedules read at this env step (design 1.3: schedules are written in game-steps)."""
        teacher = {"teacher_kl": args.warm.teacher_kl.value(self.env_steps)} if teacher_on(args.warm) else {}
        return {"gamma": args.advantage.gamma.value(self.env_steps),
                "ent_coef": args.ppo.ent_coef.value(self.env_steps),
                "ent_coef_noop": args.ppo.ent_coef_noop.value(self.env_steps), **teacher}

    def update_knobs(self, sched: dict[str, float], args: Args) -> dict[str, Any]:
        """ppo_update's settings at this iteration: the schedules' coefficients, the mask asserts
        on the first debug_assert_iterations and the ratio invariant on its cadence (design 6.4),
        the critic alone for warm.critic_iterations, the teacher at its scheduled weight."""
        p, it = args.ppo, self.iteration
        debug = it < p.debug_assert_iterations
        return dict(ent_coef=sched["ent_coef"], ent_coef_noop=sched["ent_coef_noop"],
                    master_seed=args.master_seed, iteration=it, debug=debug,
                    check_ratio=debug or it % p.check_ratio_invariant_every == 0, ratio_atol=ratio_atol(args),
                    comm=self.comm, actor_steps=it >= args.warm.critic_iterations,
                    teacher=None if self.teacher is None else (self.teacher, sched["teacher_kl"]))

    def back_off(self, kl: float) -> bool:
        """The kl backoff after an update (design 6.3): True when it lowered both learning rates."""
        fired = self.backoff.observe(kl)
        if fired:
            self.backoff.apply(self.opt_a, self.opt_c)
        return fired

    def advance(self, sched: dict[str, float], env: Env, trainable_rows: int, upd: dict[str, Any]) -> None:
        """The positions after an iteration's update; trainable_rows: every rank's."""
        self.iteration += 1
        self.env_steps += env.game_steps
        self.timesteps += trainable_rows
        self.updates += int(upd["ppo/optimizer_steps"])
        self.sched = dict(sched)

    def positions(self) -> dict[str, Any]:
        """The schedule positions a checkpoint stores and state_digest hashes (design 2.4); the
        checkpoint's side of the Learner is section 10's (learner_state, restore_learner)."""
        return {**(self.sched or {}), "backoff": self.backoff.state(), "iteration": self.iteration,
                "env_steps": self.env_steps, "timesteps": self.timesteps, "updates": self.updates}


class Boundary(NamedTuple):
    """Where collection stood at an iteration boundary: each battle's episode ordinal, the
    ladder's state, each worker's generation (a restart's, design 3.7: the scripted seats' seed
    paths carry it) and each battle's episode so far (farm.InFlight: its actions and gammas, which
    a resume re-simulates, design 3.9). A checkpoint stores it beside the learner; a resume
    starts from it."""
    ordinals: list[int]
    ladder: dict[str, Any]
    generations: list[int] | None = None
    in_flight: list[Any] | None = None


def boundary_now(source: Any, lad: ladder.LadderLoop) -> Boundary:
    """The boundary the farm and the ladder stand on now (between iterations)."""
    return Boundary([int(x) for x in source.ordinals], lad.state(list(source.assignment)),
                    [int(g) for g in source.generation], source.in_flight())


def frame_stack_rows(t: np.ndarray, k: int) -> np.ndarray:
    """(n,) cycles -> (n, k) rectangle rows, oldest..newest: cycle c's observation is row c+k-1,
    so the stack of cycle t is rows t .. t+k-1 (design 1.1: stacking is a gather, not a copy)."""
    return t[:, None] + np.arange(k)[None, :]


def frame_valid(last_start: np.ndarray, t: np.ndarray, r: np.ndarray, k: int,
                owner_t: np.ndarray | None = None) -> np.ndarray:
    """(n, k) bool: frame j of cell (t, r) is the cycle t-k+1+j; it is live only if it belongs to
    the episode that owns the stack, i.e. that cycle is not before the episode's first cycle.
    last_start[c + k - 1, r] is the first cycle of the episode running at cycle c. The owner is
    the episode running at t, except for a final observation: its stack sits at cycle ft + 1 but
    belongs to the episode that ended out of cycle ft (owner_t = ft), whereas row ft + k already
    holds the next episode's start, which would kill its history."""
    own = t if owner_t is None else owner_t
    cyc = t[:, None] - (k - 1) + np.arange(k)[None, :]
    return cyc >= last_start[own + k - 1, r][:, None]


class RectView:
    """The farm's rectangle as observations: cell (t, r)'s frame stack, decoded with codec.unpack
    on the learner's device. It keeps what lives across iterations: for frame liveness,
    last_start[c + k - 1, r], the first cycle of the episode running at cycle c; for the engine
    tick count, each battle's tick at the last cycle collected."""

    def __init__(self, rect: np.ndarray, env: Env, k: int) -> None:
        self.rect, self.table, self.statics, self.k, self.device = rect, env.table, env.statics, k, env.device
        self.last_start = np.zeros((env.T + k, env.R), np.int64)
        self.T = env.T
        self.prev_tick = np.zeros(env.n_battles, np.int64)

    def new_iteration(self, renumber: bool) -> None:
        """Cycles renumber at an iteration boundary: the last cycle (T) is cycle 0 now."""
        if renumber:
            k, T = self.k, self.T
            self.last_start[:k] = self.last_start[T:T + k] - T

    def resume(self, in_flight: Sequence[Any]) -> None:
        """A resume's battles mid-episode (farm.InFlight, design 3.9): an episode n decisions old at
        cycle 0 started at cycle -n, so its frames from before that are dead, as in the unbroken run."""
        for f in in_flight:
            self.last_start[:self.k, 2 * f.battle: 2 * f.battle + 2] = -len(f.actions)

    def mark_round(self, t: int, slots: np.ndarray, new_episode: np.ndarray) -> None:
        k = self.k
        prev = self.last_start[t + k - 2 if t + k - 2 >= 0 else k - 1, slots]   # k = 1, t = 0: resume's
        self.last_start[t + k - 1, slots] = np.where(new_episode, t, prev)

    def engine_ticks(self, tick: np.ndarray, valid: np.ndarray) -> int:
        """Engine ticks the battles advanced this iteration: each battle's tick after cycle t less
        its tick before it (0 when cycle t starts an episode: a reset is tick 0), seat-0 columns.
        prev_tick is not checkpointed, so a resumed run's first row counts its battles' ticks from
        their episode starts: one high reading, under throughput/ where the clock lives."""
        k, T = self.k, self.T
        tick = tick[:, 0::2].astype(np.int64)
        starts = self.last_start[k - 1:T + k - 1, 0::2] == np.arange(T)[:, None]
        before = np.where(starts, 0, np.vstack([self.prev_tick[None], tick[:-1]]))
        self.prev_tick = tick[-1].copy()
        return int(np.clip(np.where(valid[:, 0::2], tick - before, 0), 0, None).sum())

    def forced(self, t: int, r: np.ndarray) -> np.ndarray:
        """forced_rows of slots r at cycle t, read from the host's rectangle (codec.host_mask):
        cycle t's observation is row t+k-1 (frame_stack_rows)."""
        return forced_rows(codec.host_mask(self.table, self.rect[t + self.k - 1, r]))

    def vector(self, t: int, r: np.ndarray) -> np.ndarray:
        """The observation vectors of slots r at cycle t, on the host (codec.host_vector)."""
        return codec.host_vector(self.table, self.rect[t + self.k - 1, r])

    def obs_of(self, t: int, r: np.ndarray) -> Callable[[np.ndarray], Any]:
        """act_and_hold's obs_of over slots r at cycle t: rows idx of them, unpacked on the device."""
        return lambda idx: self.obs(np.full(idx.size, t), r[idx])

    def obs(self, t: np.ndarray, r: np.ndarray) -> Any:
        rows = self.rect[frame_stack_rows(t, self.k), r[:, None]]          # (n, k, row_bytes)
        fv = (torch.as_tensor(frame_valid(self.last_start, t, r, self.k), device=self.device)
              if self.k > 1 else None)
        return codec.unpack(self.table, torch.as_tensor(rows, device=self.device), self.statics,
                            torch.as_tensor(r % 2, device=self.device), fv)


# 1. Plan and collect.

@dataclass
class Rollout:
    """One iteration's rectangle as the parent saw it: what each (cycle, slot) cell did, and the
    farm's scalar columns (rewards, flags, ticks). (T, R) arrays, cycle-major; slot 2g is battle
    g's blue seat, 2g + 1 its red seat."""
    action: np.ndarray
    log_prob: np.ndarray
    p_noop: np.ndarray        # the rollout's p(no-op) on learner cells
    card: np.ndarray          # the card id a learner play used, -1 otherwise
    elixir: np.ndarray        # the learner's own elixir at the cell
    group: np.ndarray         # who acted: farm.GROUP_LEARNER, a resident snapshot's group, or scripted
    rounds: int = 0
    engine_ticks: int = 0
    t_collect: float = 0.0
    t_inference: float = 0.0
    rows_forward: int = 0     # rows the parent's actors ran on (learner and pool seats)
    rows_skipped: int = 0     # forced rows acted without a forward (forced_rows)
    scalars: Any = None
    stats: dict[str, Any] = field(default_factory=dict)
    failures: list[Any] = field(default_factory=list)
    episodes: list[Any] = field(default_factory=list)

    @classmethod
    def empty(cls, T: int, R: int) -> Rollout:
        return cls(action=np.zeros((T, R), np.int64), log_prob=np.zeros((T, R), np.float32),
                   p_noop=np.zeros((T, R), np.float32), card=np.full((T, R), -1, np.int64),
                   elixir=np.zeros((T, R), np.float32), group=np.full((T, R), farm.GROUP_DEAD, np.int8))

    @property
    def valid(self) -> np.ndarray:
        return (self.scalars["flags"] & farm.F_VALID) != 0

    @property
    def terminated(self) -> np.ndarray:
        return ((self.scalars["flags"] & farm.F_TERMINATED) != 0) | ~self.valid

    @property
    def truncated(self) -> np.ndarray:
        return ((self.scalars["flags"] & farm.F_TRUNCATED) != 0) & self.valid

    @property
    def trainable(self) -> np.ndarray:
        return (self.group == farm.GROUP_LEARNER) & self.valid


def collect(source: Any, view: RectView, model: ActorCritic, lad: ladder.LadderLoop, env: Env, run: Run,
            iteration: int, first: int, gamma: float, t_it: float) -> Rollout:
    """T + 1 cycles of rounds (design 3.6). Every round, the parent acts for the seats the workers
    cannot: each resident snapshot's seats, then the learner's, each in one batched forward in
    ascending slot order on the cycle's name-addressed uniforms (design 2.2), so an action is a
    function of (seed, iteration, cycle, slot) alone. Cycle T is the bootstrap row: read, not acted."""
    T, R = env.T, env.R
    roll = Rollout.empty(T, R)
    with torch_threads(run.args.determinism.inference_threads):   # the workers keep their cores
        for t in range(T + 1):
            run.between_cycles(iteration + 1, t, T, roll.rounds, time.perf_counter() - t_it)
            u = torch.as_tensor(
                derive_generator(env.seed, f"act/iteration/{iteration}/cycle/{t}").random(R),
                dtype=torch.float32, device=env.device)
            for _ in range(env.n_shards):
                rnd = source.next_round()
                if t > 0 or iteration == first:   # later iterations carried cycle 0 over in new_iteration
                    view.mark_round(t, rnd.slots, rnd.new_episode)
                elif rnd.new_episode.any():        # but a restarted worker's battles reset at cycle 0
                    view.mark_round(t, rnd.slots[rnd.new_episode], rnd.new_episode[rnd.new_episode])
                if t == T:
                    continue
                t0 = time.perf_counter()
                acts = act_round(rnd, t, u, view, model, lad, env.geo, roll)
                roll.t_inference += time.perf_counter() - t0
                source.submit(acts, gamma)
                roll.rounds += 1
    roll.t_collect = time.perf_counter() - t_it
    # design 3.7: the iteration completes with a failed worker's cells dead; the worker restarts
    # at the next begin_iteration, so the counters are read after tend_workers asked for it
    roll.failures = tend_workers(source, run, source.drain_failures())
    roll.stats = source.stats()   # the farm's counters (design 3.7, 9.2)
    roll.scalars, roll.episodes = source.scalars, source.episodes
    roll.engine_ticks = view.engine_ticks(roll.scalars["tick"], roll.valid)
    return roll


class WorkerFailed(RuntimeError):
    """A rollout worker failed and is not restarted (restarts off, or past the limit): names the
    worker and the file holding its traceback (design 3.7)."""


def tend_workers(source: Any, run: Run, failures: list[Any], before_plan: bool = False) -> list[Any]:
    """Design 3.7: each failure's message (the child's traceback, or what the parent saw) is
    appended to <run>/worker-<w>-generation-<g>.txt, and the worker is restarted on its next
    generation, rejoining at the next begin_iteration. With restarts off, or once a worker has
    had max_restarts_per_worker, the run stops instead (WorkerFailed, through the crash path).
    before_plan: found between iterations (died during the update), so no cell was lost.
    Returns the failures, for the row's count."""
    r = run.args.rollout
    for w in sorted({f.worker for f in failures}):
        g, mine = int(source.generation[w]), [f for f in failures if f.worker == w]
        path = run.path / f"{f'rank-{run.rank}-' if run.rank else ''}worker-{w}-generation-{g}.txt"
        with path.open("a") as fh:
            for f in mine:
                fh.write(f"--- {ladder.utc_now()} worker {w} generation {g}, shard {f.shard}, "
                         f"cycle {f.cycle}: {f.kind}\n{f.message.rstrip()}\n")
        why = "restarts are off (--rollout.no-restart-failed-workers)"
        if r.restart_failed_workers:
            try:
                source.restart(w)   # the farm holds the limit (max_restarts_per_worker) and refuses past it
                if not run.quiet:   # the worker_failures alarm points the reader at this line
                    lost = "before this iteration's plan, no cell lost" if before_plan else \
                        "its cells this iteration dropped"
                    print(f"{f'rank {run.rank} ' if run.rank else ''}worker {w} (generation {g}) failed "
                          f"({mine[0].kind}, shard {mine[0].shard}, cycle {mine[0].cycle}): "
                          f"restarted as generation {g + 1}, {lost}; what it said is in {path}",
                          flush=True)
                continue
            except farm.FarmError as e:
                why = f"it cannot be restarted: {e} (--rollout.max-restarts-per-worker)"
        raise WorkerFailed(f"rollout worker {w} (generation {g}) failed ({mine[0].kind}) and {why}; "
                           f"its traceback is in {path}")
    return failures


def decision_facts(v: np.ndarray, a: np.ndarray, geo: NetGeometry) -> tuple[np.ndarray, np.ndarray | None]:
    """Per acted row, from its vector v (float32, the host's copy of the one the pointer head
    resolves its hand from) and action a: the card id the played hand slot held (-1 for the no-op
    or a button) and the row's own elixir (None when the env declares no own_elixir field):
    rollout_policy_metrics' card and elixir."""
    hw, P = geo.tiles[0] * geo.tiles[1], geo.hand_size
    play = (a >= 1) & (a < 1 + P * hw)
    ids = v[:, geo.field(HAND_CARDS)].reshape(len(a), P, -1).argmax(-1)
    card = np.where(play, ids[np.arange(len(a)), np.clip((a - 1) // hw, 0, P - 1)], -1)
    elixir = v[:, geo.field(OWN_ELIXIR)][:, 0] if OWN_ELIXIR in dict(geo.vector_layout) else None
    return card, elixir


def act_round(rnd: Any, t: int, u: torch.Tensor, view: RectView, model: ActorCritic, lad: ladder.LadderLoop,
              geo: NetGeometry, roll: Rollout) -> np.ndarray:
    """One shard-round's actions. Pool seats: one forward per resident group, groups ascending,
    not trainable and so no log-prob. Learner seats: sample, and store what the update needs.
    Either way a forced row takes no forward (ActorCritic.act_and_hold, design 3.6)."""
    sl = rnd.slots
    acts = np.zeros(len(sl), np.int64)
    roll.group[t, sl] = rnd.group
    for g in sorted({int(x) for x in rnd.group if x >= 0}):
        prow = np.flatnonzero(rnd.group == g)
        ps = sl[prow].astype(np.int64)
        with torch.inference_mode():
            out = lad.policy(g).act_and_hold(view.obs_of(t, ps), u[ps], view.forced(t, ps),
                                             lad.opponent_decode)
        acts[prow] = out.action.cpu().numpy()
        roll.rows_forward += out.forwarded
        roll.rows_skipped += prow.size - out.forwarded
        roll.action[t, ps] = acts[prow]
    rows = np.flatnonzero(rnd.group == farm.GROUP_LEARNER)   # ascending slot order
    if rows.size:
        ss = sl[rows].astype(np.int64)
        a, lp, p0, fwd = model.act_and_hold(view.obs_of(t, ss), u[ss], view.forced(t, ss))
        roll.rows_forward += fwd
        roll.rows_skipped += rows.size - fwd
        cd, el = decision_facts(view.vector(t, ss), a.cpu().numpy(), geo)
        roll.card[t, ss] = cd
        if el is not None:
            roll.elixir[t, ss] = el
        roll.p_noop[t, ss] = p0.cpu().numpy()
        acts[rows] = a.cpu().numpy()
        roll.action[t, ss] = acts[rows]
        roll.log_prob[t, ss] = lp.cpu().numpy()
    return acts


# 2. The critic pass.

class Critic(NamedTuple):
    values: np.ndarray        # (T + 1, R): row T is the bootstrap; 0 where the critic did not run (smdp)
    final_values: np.ndarray  # (T, R): the critic on a truncated episode's final observation
    n_legal: np.ndarray       # (T, R): legal actions under the stored mask (1: a forced cell)
    legal: np.ndarray         # (T, R): the stored action is legal under the stored mask
    seconds: float
    rows: int                 # observations the critic ran on, finals included
    sample: np.ndarray | None = None    # smdp: (T, R) the forced cells the critic trains on
    heldout: np.ndarray | None = None   # smdp: (T, R) forced cells it is only measured on


def critic_pass(model: ActorCritic, view: RectView, source: Any, roll: Rollout, env: Env, ppo: PPOArgs,
                iteration: int) -> Critic:
    """The critic on the cells whose value the advantages read, in chunks (an unchunked pass is a
    memory spike): every cell and the bootstrap row, or under smdp the choice cells, the forced
    sample, the held-out sample, row T and the truncation finals of the learner's slots (design
    6.6). Each cell's legal-action count and whether its stored action was legal come first, from
    the host's rectangle, for the invariants and the forced-row split (design 6.5, 10.1)."""
    t0 = time.perf_counter()
    T, R, k, chunk = env.T, env.R, view.k, ppo.critic_chunk
    n_legal, legal = host_legality(view, roll.action, chunk)
    need, finals_at, sample, heldout = np.ones((T + 1, R), bool), np.ones((T, R), bool), None, None
    if ppo.forced_rows == "smdp":
        choice, sample, heldout = smdp_cells(roll.trainable, n_legal, env.seed, iteration)
        need[:T], need[T], finals_at = choice | sample | heldout, roll.trainable[T - 1], roll.trainable
    tt, rr = np.nonzero(need)   # cycle-major, as the rectangle is laid out
    values = np.zeros((T + 1, R), np.float32)
    finals = [(ft, fr, raw) for (ft, fr), raw in sorted(source.finals.items()) if finals_at[ft, fr]]
    with torch.no_grad():
        for s in range(0, tt.size, chunk):
            values[tt[s:s + chunk], rr[s:s + chunk]] = model.value(
                view.obs(tt[s:s + chunk], rr[s:s + chunk])).cpu().numpy()
        final_values = values[1:].copy()      # truncated without a final obs
        for ft, fr, raw in finals:
            rows = source.rect[frame_stack_rows(np.array([ft + 1]), k)[0], fr].copy()
            rows[-1] = raw
            fv = (torch.as_tensor(frame_valid(view.last_start, np.array([ft + 1]), np.array([fr]), k,
                                              np.array([ft])), device=env.device) if k > 1 else None)
            fo = codec.unpack(env.table, torch.as_tensor(rows[None], device=env.device), env.statics,
                              torch.as_tensor([fr % 2], device=env.device), fv)
            final_values[ft, fr] = float(model.value(fo)[0])
    return Critic(values, final_values, n_legal, legal, time.perf_counter() - t0, int(tt.size) + len(finals),
                  sample, heldout)


def host_legality(view: RectView, action: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(n_legal, legal), both (T, R): each cell's legal-action count and whether its stored
    action is legal under its stored mask, read from the host's rectangle (codec.host_mask, the
    bits unpack decodes), a chunk of cycles at a time: no device round trip, and under smdp the
    forced split is known before the critic runs."""
    T, R = action.shape
    n_legal, legal = np.zeros((T, R), np.int64), np.zeros((T, R), bool)
    step = max(1, chunk // R)
    for t in range(0, T, step):
        # cycle t's newest frame: row t + k - 1
        rows = view.rect[view.k - 1 + t: view.k - 1 + min(t + step, T)]
        mask = codec.host_mask(view.table, rows.reshape(-1, rows.shape[-1])).reshape(len(rows), R, -1)
        n_legal[t:t + len(rows)] = mask.sum(-1)
        legal[t:t + len(rows)] = np.take_along_axis(mask, action[t:t + len(rows), :, None], -1)[..., 0]
    return n_legal, legal


def smdp_cells(trainable: np.ndarray, n_legal: np.ndarray, seed: int,
               iteration: int) -> tuple[np.ndarray, ...]:
    """(choice, sample, heldout), each (T, R) bool (design 6.6). The critic trains on the choice
    cells and on a uniform sample of the forced cells of equal count; V(row T) and the finals are
    read at forced states most of the time, so a critic fitted on choice cells alone would be
    asked about states it never saw. A held-out sample of half that count measures it there
    (ppo/explained_variance_forced_heldout). Both from one permutation of the forced cells, drawn
    from a stream named by the iteration, so a resume draws the same cells."""
    choice = trainable & (n_legal > 1)
    ft, fr = np.nonzero(trainable & (n_legal == 1))
    n_s = min(ft.size, int(choice.sum()))
    n_h = min(ft.size - n_s, n_s // 2)
    perm = derive_generator(seed, f"ppo/smdp/forced_sample/iteration/{iteration}").permutation(ft.size)
    sample, heldout = np.zeros_like(choice), np.zeros_like(choice)
    sample[ft[perm[:n_s]], fr[perm[:n_s]]] = True
    heldout[ft[perm[n_s:n_s + n_h]], fr[perm[n_s:n_s + n_h]]] = True
    return choice, sample, heldout


# 3. The invariants.

def check_rollout(roll: Rollout, crit: Critic, env: Env, args: Args) -> None:
    """check_iteration (section 7) on this iteration. A worker that died leaves its cells invalid,
    so after a failure the row count and the mixture are judged on what did arrive."""
    trainable, valid = roll.trainable, roll.valid
    discarded = 1 - trainable.sum() / max(valid.sum(), 1)
    check_iteration(rounds=roll.rounds, expected_rounds=env.T * env.n_shards, trainable=trainable,
                    timesteps_per_iteration=0 if roll.failures else args.ppo.timesteps_per_iteration,
                    log_prob=roll.log_prob, action_legal=crit.legal,
                    deploy_status=roll.scalars["deploy_status"], episode_end=roll.scalars["episode_end"] != 0,
                    group=roll.group, discarded_rows_frac=discarded,
                    expected_discarded_frac=discarded if roll.failures else 1 - env.learner_rows / env.R,
                    action=roll.action, n_legal=crit.n_legal)


# 4. Advantages.

class Advantages(NamedTuple):
    adv: np.ndarray           # (T, R), standardised over the cells that reach the update
    ret: np.ndarray           # (T, R) GAE returns: the critic's targets
    stats: dict[str, Any]     # the choice cells' advantage before standardising, their explained variance
    explained_variance: float
    reward_clip_frac: float
    seconds: float


def advantages(scaler: WelfordReturnScaler, roll: Rollout, crit: Critic, gamma: float, args: Args,
               comm: Comm | None = None) -> Advantages:
    """Rewards divided by the running std of raw returns (design 6.2), GAE in one backward scan
    over the rectangle (design 6.1; under smdp over decisions, design 6.6), then one
    standardisation over the cells the actor reads: every trainable cell, or under
    critic_only_choice_mean and smdp the choice cells alone (design 6.5). Under torchrun the
    scaler and the standardisation read every rank's cells (design 3.10); the row's statistics
    (explained variance, the choice cells' advantage) are this rank's."""
    t0, comm = time.perf_counter(), SOLO if comm is None else comm
    T = roll.action.shape[0]
    trainable = roll.trainable
    choice = trainable & (crit.n_legal > 1)
    rewards = np.where(roll.valid, roll.scalars["reward"], 0.0).astype(np.float64)
    scaler.update(discounted_return_per_episode(rewards, roll.terminated | roll.truncated, gamma)[trainable],
                  comm)
    rew_scaled, reward_clip_frac = scaler.scale(rewards)
    vals_t = torch.as_tensor(crit.values, dtype=torch.float32)
    scan = (torch.as_tensor(rew_scaled), vals_t, torch.as_tensor(crit.final_values),
            torch.as_tensor(roll.terminated), torch.as_tensor(roll.truncated))
    if args.ppo.forced_rows == "smdp":
        adv, ret = smdp_gae(*scan, torch.as_tensor(choice), gamma, args.advantage.gae_lambda)
        fitted = choice | crit.sample   # the cells whose value the critic ran on and trains on
    else:
        adv, ret = gae(*scan, gamma, args.advantage.gae_lambda)
        fitted = trainable
    ev_on = lambda cells: explained_variance(vals_t[:T][torch.as_tensor(cells)], ret[torch.as_tensor(cells)])
    adv_np = adv.numpy()
    pre = adv_np[choice]
    stats = {"ppo/advantage_std_choice_pre_norm": float(pre.std(ddof=1)) if pre.size > 1 else None,
             "ppo/advantage_mean_choice": float(pre.mean()) if pre.size else None,
             "ppo/explained_variance_choice": ev_on(choice) if pre.size > 1 else None}
    if crit.heldout is not None:
        stats["ppo/explained_variance_forced_heldout"] = (ev_on(crit.heldout) if crit.heldout.sum() > 1
                                                          else None)
    cells = choice if args.ppo.forced_rows in CHOICE_MEAN else trainable
    if args.ppo.advantage_standardization and comm.counts(int(cells.sum()))[0] > 1:
        adv_np = standardize_advantages(adv_np, cells, comm)
    return Advantages(adv_np, ret.numpy(), stats, ev_on(fitted), reward_clip_frac, time.perf_counter() - t0)


# 5. The update.

def no_update(roll: Rollout) -> tuple[Advantages, dict[str, Any]]:
    """An iteration whose learner cells were all lost to dead workers (design 3.7): nothing to
    scale or learn from, so the scaler and the weights stay as they were and the row says so
    with ppo/optimizer_steps 0 and no loss keys."""
    zero = np.zeros(roll.action.shape, np.float32)
    adv = Advantages(zero, zero, {"ppo/advantage_std_choice_pre_norm": None,
                                  "ppo/advantage_mean_choice": None,
                                  "ppo/explained_variance_choice": None}, None, 0.0, 0.0)
    return adv, {"ppo/optimizer_steps": 0.0, "ppo/actor_rows_seen": 0.0, "run/lr_backoff": False,
                 "time/update": 0.0, "outliers": [], "update_rows": 0}


def update_rows(view: RectView, roll: Rollout, crit: Critic, adv: Advantages) -> RectData:
    """The rows ppo_update (section 6) trains on: the trainable cells, or under smdp the choice
    cells and the critic's sample of the forced ones (design 6.6), with every Minibatch column."""
    cells = roll.trainable if crit.sample is None else (roll.trainable & (crit.n_legal > 1)) | crit.sample
    ct, cr = np.nonzero(cells)
    return RectData(view, ct, cr, {"action": roll.action[ct, cr].astype(np.int64),
                                   "log_prob": roll.log_prob[ct, cr].astype(np.float32),
                                   "value": crit.values[ct, cr].astype(np.float32),
                                   "adv": adv.adv[ct, cr].astype(np.float32),
                                   "ret": adv.ret[ct, cr].astype(np.float32),
                                   "n_legal": crit.n_legal[ct, cr].astype(np.int64)})


class RectData:
    """UpdateData over the rectangle (section 6's two-method seam): one minibatch's rows, with
    their frame stacks, decoded on the learner's device, beside the columns the update reads (one
    a Minibatch field, named as it is)."""

    def __init__(self, view: RectView, cells_t: np.ndarray, cells_r: np.ndarray,
                 cols: dict[str, np.ndarray]) -> None:
        self.view, self.t, self.r = view, cells_t, cells_r
        self.n = int(len(cells_t))
        self.cols = {name: torch.as_tensor(cols[name], device=view.device) for name in Minibatch._fields[1:]}
        self.n_legal = cols["n_legal"]

    def gather(self, idx: np.ndarray) -> Minibatch:
        i = torch.as_tensor(idx, device=self.view.device)
        return Minibatch(self.view.obs(self.t[idx], self.r[idx]), **{k: c[i] for k, c in self.cols.items()})

    def label(self, idx: Sequence[int]) -> list[str]:
        return [f"(cycle {int(self.t[i])}, slot {int(self.r[i])})" for i in idx]


# 6. The ladder step.

def crossed(last: int, step: int, every: int) -> bool:
    """A multiple of `every` game-steps lies in (last, step]: a cadence falls on fixed marks
    (design 7.4), so it does not drift by each gate's rounding up to a whole iteration, and a
    1,000,000-step run with a 200,000 cadence gates its last iteration."""
    every = max(every, 1)
    return step // every > last // every


def ladder_step(lad: ladder.LadderLoop, learner: Learner, episodes: list[Any], env: Env, args: Args,
                quiet: bool) -> dict[str, Any]:
    """The ladder's work after an update, in this order (design 10.1): the kind="train" results,
    the gate on its cadence, a floor admit, a refit, the probe; returns the row's ladder keys that
    this iteration produced (the gate's and the probe's time, the probe's scores, role counts)."""
    L, step = args.ladder, learner.env_steps
    lad.record_train(episodes, learner.iteration, step)
    row: dict[str, Any] = {}
    if crossed(lad.last_candidate_step, step, L.candidate_every_env_steps):
        t0 = time.perf_counter()
        dec = lad.gate(learner.model, learner.iteration, step, env.facts.action_digest)
        row["time/gate"] = time.perf_counter() - t0
        if not quiet:
            print(f"gate {dec.candidate} vs {dec.champion}: {dec.outcome}"
                  + (f" (failed: {', '.join(dec.failed)})" if dec.failed else ""), flush=True)
    if crossed(lad.last_floor_step, step, L.floor_admit_every_env_steps):
        lad.floor(learner.model, step, env.facts.action_digest)
    if L.refit_every_iterations and learner.iteration % L.refit_every_iterations == 0:
        lad.refit()
    if L.probe_every_iterations and learner.iteration % L.probe_every_iterations == 0:
        row.update(lad.probe(learner.model, learner.iteration, step))
    ended = {(e.battle, e.ordinal): e for e in episodes}
    row.update(ladder.role_count_metrics(
        [farm.Assignment(battle=b, ordinal=o, role={"mirror": farm.ROLE_MIRROR, "pool": farm.ROLE_POOL}.get(
            e.bucket, farm.ROLE_SCRIPTED), opponent_id=None, group=(-1, -1), learner_seat=-1)
         for (b, o), e in sorted(ended.items())], lad.job_roles))
    return row


# 7. Record: the halt, the control file and the checkpoint cadence.

# ======================================================================================================
# Below this line, the run's machinery: the arguments read and checked, torchrun's ranks, the run's
# identity and directory, checkpoints, metrics and alarms, snapshots. A fork that changes the method
# (sections 1-8) need not touch it; what it must know of it is in the header ("To fork").
# ======================================================================================================


# --- 9. The run: its arguments, its ranks, its identity, its start-up gates, its directory (design 1.3,
#        2.3, 3.8, 3.10, 9) ------------------------------------------------------------------------
# The arguments, read and checked: a --config file, the command line, the rules between fields.


def field_paths(cls: type = Args, prefix: str = "") -> list[str]:
    """Every leaf of the tree as a dotted path, e.g. ppo.lr_backoff.patience."""
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t) and t is not Schedule:
            out += field_paths(t, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """cls's field types, resolved once a process: the annotations are strings (from __future__),
    and evaluating them again for every flag was half of parse_args [M: docs/throughput.md]. Read
    only: every caller shares the dict."""
    import typing
    return typing.get_type_hints(cls, globalns=globals())


def apply_dict(obj: Any, d: dict[str, Any], where: str = "") -> None:
    """Merge a JSON object into a dataclass tree in place, refusing an unknown key by name."""
    hints = _hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in d.items():
        path = f"{where}{key}"
        if key not in names:
            raise ConfigError(f"unknown config field {path!r}"
                              + _nearest(key, names).replace("'", "'" + where, 1)
                              + f"; valid fields of {where.rstrip('.') or 'the top level'}: "
                                f"{', '.join(names)}")
        t = hints[key]
        if dataclasses.is_dataclass(t):
            if not isinstance(value, dict):
                raise ConfigError(f"config field {path!r} must be an object, got {value!r}")
            apply_dict(getattr(obj, key), value, path + ".")
        else:
            try:
                setattr(obj, key, msgspec.convert(value, type=t, strict=False))
            except msgspec.ValidationError as e:
                raise ConfigError(f"config field {path!r}: {e}") from None


def config_json(args: Args) -> bytes:
    """Canonical JSON of the resolved config: what config.json holds and what is hashed."""
    return canonical_json(args)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A --config file's JSON object; anything else is refused naming the file, and for JSON that
    does not parse, the line and column, so the message is the remedy (design 1.3)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror}); pass a JSON file such as a run's "
                          "config.json") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--config {path}: line {e.lineno}, column {e.colno}: not valid JSON ({e.msg}); "
                          "fix that line (a trailing comma or a comment is the usual cause)") from None
    if not isinstance(d, dict):
        raise ConfigError(f"--config {path}: holds a JSON {type(d).__name__}, not an object of fields")
    return d


def load_config_file(path: str | Path, base: Args | None = None) -> Args:
    d = read_config_file(path)
    prof = d.get("profile", base.profile if base else "laptop")
    args = base if base is not None else profile_args(prof)
    try:
        apply_dict(args, d)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return args


CONFIG_FILE_ONLY = {"ladder.seed_snapshots": "a JSON list of {name, path, sha256, weight}"}
"""Fields a flag cannot spell (a list of records): a --config file sets them."""


def _cli_flags() -> dict[str, str]:
    """--flag spelling -> dotted path, for every leaf (tyro writes underscores as dashes)."""
    out = {}
    for p in field_paths():
        if p in CONFIG_FILE_ONLY:
            continue
        leaf_is_schedule = False
        out["--" + p.replace("_", "-")] = p
        out["--" + p] = p
        t: Any = Args
        for part in p.split("."):
            t = _hints(t)[part]
        if t is Schedule:
            leaf_is_schedule = True
        if leaf_is_schedule:
            for f in dataclasses.fields(Schedule):
                out["--" + (p + "." + f.name).replace("_", "-")] = p + "." + f.name
                out["--" + p + "." + f.name] = p + "." + f.name
        if t is bool:
            out["--" + p.replace("_", "-").rsplit(".", 1)[0] + "." + "no-"
                + p.rsplit(".", 1)[-1].replace("_", "-")
                if "." in p else "--no-" + p.replace("_", "-")] = p
    return out


def parse_args(argv: Sequence[str] | None = None) -> Args:
    """--profile NAME picks the preset, --config FILE merges a JSON over it, then every other
    flag overrides a field. An unknown flag is refused naming the nearest valid one."""
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    profile, config = None, None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, val = tok.partition("=")
        if name in ("--profile", "--config"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                val, i = argv[i + 1], i + 1
            if name == "--profile":
                profile = val
            else:
                config = val
        else:
            rest.append(tok)
        i += 1
    flags = _cli_flags()
    for tok in rest:
        if tok.startswith("--") and tok not in ("--help", "-h"):
            name = tok.split("=", 1)[0]
            if name not in flags:
                for path, shape in CONFIG_FILE_ONLY.items():
                    if name.startswith(flag(path)) or name.startswith("--" + path):
                        raise ConfigError(f"{name}: {path} is set in a --config file ({shape}), "
                                          "not by a flag")
                raise ConfigError(f"unknown argument {name!r}"
                                  + _nearest(name, list(flags) + ["--profile", "--config"]))
    if profile is None:  # a config file names its own profile; the flag wins over it
        profile = read_config_file(config).get("profile", "laptop") if config else "laptop"
    base = profile_args(profile)
    if config is not None:
        base = load_config_file(config, base)
        base.profile = profile
    args = tyro.cli(Args, default=base, args=rest, config=ladder.TYRO_CONFIG)
    check_consistency(args)
    return args


def field_value(args: Args, path: str) -> Any:
    obj: Any = args
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def game_rules(args: Args) -> list[tuple[str, bool, str]]:
    """config_rules' share for the game the learner meets first: the observation, the reward's
    weights and the warm start."""
    o, w = args.obs, args.warm
    return [
        ("obs.frame_stack", o.frame_stack >= 1, "be >= 1"),
        ("obs.decision_ms", o.decision_ms >= 1, "be >= 1 (game milliseconds per decision)"),
        ("obs.reveal", set(o.reveal) <= {"enemy_spell_aim"},
         "name only enemy_spell_aim (the flag read_env wires)"),
        ("obs.max_steps", o.max_steps >= 0, "be >= 0 (0 plays whole battles)"),
        *[(f"reward.{k}", math.isfinite(x) and x >= 0, "be finite and >= 0 (a shaping weight)")
          for k, x in dataclasses.asdict(args.reward).items()],
        ("warm.rung", not w.rung or worker_player_ok(w.rung),
         f"be empty, scripted:<name> (a name of {', '.join(farm.SCRIPTED_NAMES)}) or "
         "lookahead:<base>[,vs=<rung>][,h=<decisions>][,c=<rung>+...] (farm.py section 6b)"),
        ("warm.rung", not w.rung or o.frame_stack == 1,
         "be empty under --obs.frame-stack above 1 (the cloned rows are single frames)"),
        ("warm.battles", w.battles >= 1, "be >= 1"),
        ("warm.dagger_rounds", w.dagger_rounds >= 0, "be >= 0"),
        ("warm.dagger_battles", w.dagger_battles >= 1, "be >= 1"),
        ("warm.workers", w.workers >= 1, "be >= 1 (processes the warm start's battles play on)"),
        ("warm.soft_targets", w.soft_targets >= 0, "be >= 0 (0: the rung's choice alone)"),
        ("warm.epochs", w.epochs >= 1, "be >= 1"),
        ("warm.lr", w.lr > 0, "be > 0"),
        ("warm.critic_iterations", w.critic_iterations >= 0, "be >= 0"),
        ("warm.critic_iterations", not w.critic_iterations or bool(w.rung),
         "be 0 without --warm.rung (no warm start: --warm.rung '' --warm.critic-iterations 0 "
         "--warm.teacher-kl.start 0)"),
        ("warm.teacher_kl.start", w.teacher_kl.start >= 0 and w.teacher_kl.end >= 0,
         "be >= 0 (start and end)"),
        ("warm.teacher_kl.start", not teacher_on(w) or bool(w.rung),
         "be 0 without --warm.rung: the teacher is the clone (no warm start: --warm.rung '' "
         "--warm.critic-iterations 0 --warm.teacher-kl.start 0)"),
        ("warm.teacher_kl.over_env_steps", w.teacher_kl.over_env_steps > 0, "be > 0"),
    ]


def worker_player_ok(player: str) -> bool:
    """Whether `player` names a scripted rung or a lookahead setting farm.py can play."""
    try:
        farm.check_worker_player(player)
    except ValueError:
        return False
    return player.startswith(farm.WORKER_PLAYERS)


def one_folder_name(name: str) -> bool:
    """The run folder is <runs_dir>/<run_name>-<run_id>: a name must be one path component, so it
    can neither climb out of --runs-dir nor make a folder the file system refuses (NAME_MAX is 255
    bytes, less "-<run_id>" and a side folder's suffix: 128 [A]). isprintable first, so that encode
    cannot raise (an undecodable argv byte is a surrogate, not printable)."""
    return (name.isprintable() and 0 < len(name.encode()) <= 128
            and not any(s in name for s in ("/", "\\", "..")))


def config_rules(args: Args) -> list[tuple[str, bool, str]]:
    """Every size, count, fraction and divisibility the code relies on, one rule a line: (field,
    holds, what it must be). All in one place (the game's share in game_rules) so a bad value stops
    before a run directory exists (design 1.3); each `holds` guards its own arithmetic, so one bad
    value never raises in another's."""
    r, n, p, A, L = args.rollout, args.net, args.ppo, args.advantage, args.ladder
    battles = r.workers * r.games_per_worker
    # one cycle's learner seats: every battle's learner seat plus the second seat of a mirror battle
    seats = battles + ladder.role_counts(L.mix, battles)[0] if mix_ok(L) and battles >= 1 else 1
    pos, nonneg, frac = "be > 0", "be >= 0", "be in [0, 1]"
    return [
        ("run_name", one_folder_name(args.run_name),
         "be one folder name: 1 to 128 bytes of printable characters, "
         "without '/', '\\' or '..' (the run folder is <runs_dir>/<run_name>-<run_id>)"),
        ("master_seed", 0 <= args.master_seed < 2 ** 63, "be in [0, 2**63): every stream derives from it"),
        ("timestep_limit", args.timestep_limit >= 1, "be >= 1"),
        ("game_step_limit", args.game_step_limit >= 0, "be >= 0 (0: no game-step budget)"),
        ("metrics.image_every", args.metrics.image_every >= 0, "be >= 0 (0: no heatmaps)"),
        *game_rules(args),
        ("rollout.workers", r.workers >= 1, "be >= 1"),
        ("rollout.games_per_worker", r.games_per_worker >= 1, "be >= 1"),
        ("rollout.shards_per_worker", r.shards_per_worker >= 1, "be >= 1"),
        ("rollout.games_per_worker", r.shards_per_worker < 1 or r.games_per_worker % r.shards_per_worker == 0,
         f"be a multiple of --rollout.shards-per-worker = {r.shards_per_worker} "
         "(each shard holds the same battles)"),
        ("rollout.spin_us", r.spin_us >= 0, nonneg),
        ("rollout.round_timeout_s", 0 < r.round_timeout_s < math.inf,
         "be > 0 and finite (inf: no hang detection)"),
        ("rollout.max_restarts_per_worker", r.max_restarts_per_worker >= 0, nonneg),
        ("rollout.launch_delay_s", 0 <= r.launch_delay_s < math.inf, "be >= 0 and finite"),
        ("rollout.eval_workers", r.eval_workers >= 1, "be >= 1"),
        ("rollout.eval_games_per_worker", r.eval_games_per_worker >= 1, "be >= 1"),
        ("net.channels", n.channels >= 1, "be >= 1"),
        ("net.blocks", n.blocks >= 0, nonneg),
        ("net.norm_groups", n.norm_groups >= 1 and n.channels % n.norm_groups == 0,
         f"be >= 1 and divide --net.channels = {n.channels} (GroupNorm splits the channels evenly)"),
        ("net.vector_embed", n.vector_embed >= 1, "be >= 1"),
        ("net.value_hidden", n.value_hidden >= 1, "be >= 1"),
        ("net.noop_bias", math.isfinite(n.noop_bias), "be finite"),
        ("net.noop_bias", n.policy_head == "pointer" or n.noop_bias == 0,
         "be 0 under --net.policy-head factored, which has no no-op logit "
         "(--net.factored-act-init sets its P(act))"),
        ("net.factored_act_init", 0 < n.factored_act_init < 1, "be in (0, 1): a probability"),
        ("net.placement_cell", min(n.placement_cell) >= 1,
         "be two counts >= 1: tile rows and columns a cell"),
        ("net.device", n.device.split(":")[0] in ("cpu", "cuda", "mps"), "be cpu, cuda, cuda:N or mps"),
        ("ppo.n_epochs", p.n_epochs >= 1, "be >= 1"),
        ("ppo.timesteps_per_iteration", p.timesteps_per_iteration >= seats,
         f"be at least one cycle's learner seats ({seats} from --rollout.workers x "
         "--rollout.games-per-worker and --ladder.mix): an iteration collects whole cycles"),
        ("ppo.batch_size", p.batch_size >= 1, "be >= 1"),
        ("ppo.minibatch_size", 1 <= p.minibatch_size <= p.batch_size,
         f"be in [1, --ppo.batch-size = {p.batch_size}]"),
        ("ppo.clip_range", 0 < p.clip_range < 1, "be in (0, 1)"),
        ("ppo.dual_clip_c", p.dual_clip_c > 1,
         "be > 1: the floor c * A must lie below the clipped objective"),
        ("ppo.vf_coef", p.vf_coef > 0, pos),
        ("ppo.ent_coef.start", p.ent_coef.start >= 0, nonneg),
        ("ppo.ent_coef.end", p.ent_coef.end >= 0 and (p.ent_coef.kind != "geometric"
                                                      or min(p.ent_coef.start, p.ent_coef.end) > 0),
         "be >= 0, and start and end > 0 under a geometric schedule"),
        ("ppo.ent_coef.over_env_steps", p.ent_coef.over_env_steps > 0, pos),
        ("ppo.ent_coef_noop.start", p.ent_coef_noop.start >= 0, nonneg),
        ("ppo.ent_coef_noop.end", p.ent_coef_noop.end >= 0 and (
            p.ent_coef_noop.kind != "geometric" or min(p.ent_coef_noop.start, p.ent_coef_noop.end) > 0),
         "be >= 0, and start and end > 0 under a geometric schedule"),
        ("ppo.ent_coef_noop.over_env_steps", p.ent_coef_noop.over_env_steps > 0, pos),
        ("ppo.entropy_coef_stages", p.entropy_coef_stages is None or len(p.entropy_coef_stages) == 3 and all(
            math.isfinite(c) and c >= 0 for c in p.entropy_coef_stages), "be three finite numbers >= 0"),
        ("ppo.max_grad_norm", p.max_grad_norm > 0, pos),
        ("ppo.lr_actor", p.lr_actor > 0, pos),
        ("ppo.lr_critic", p.lr_critic > 0, pos),
        ("ppo.adam_eps", p.adam_eps > 0, pos),
        ("ppo.lr_backoff.kl_threshold", p.lr_backoff.kl_threshold > 0, pos),
        ("ppo.lr_backoff.patience", p.lr_backoff.patience >= 1, "be >= 1"),
        ("ppo.lr_backoff.factor", 0 < p.lr_backoff.factor <= 1, "be in (0, 1]"),
        ("ppo.lr_backoff.lr_min", p.lr_backoff.lr_min >= 0, nonneg),
        ("ppo.critic_chunk", p.critic_chunk >= 1, "be >= 1"),
        ("ppo.debug_assert_iterations", p.debug_assert_iterations >= 0, nonneg),
        ("ppo.check_ratio_invariant_every", p.check_ratio_invariant_every >= 1, "be >= 1 (iterations apart)"),
        ("ppo.ratio_atol_fp32", p.ratio_atol_fp32 > 0, pos),
        ("ppo.ratio_atol_bf16", p.ratio_atol_bf16 > 0, pos),
        ("ppo.forced_rows", p.forced_rows == "all" or n.separate_trunks,
         "be all under --net.no-separate-trunks: one trunk's critic forward IS the actor's (design 6.5)"),
        ("advantage.gamma.start", 0 < A.gamma.start <= 1, "be in (0, 1]"),
        ("advantage.gamma.end", 0 < A.gamma.end <= 1, "be in (0, 1]"),
        ("advantage.gamma.over_env_steps", A.gamma.over_env_steps > 0, pos),
        ("advantage.gae_lambda", 0 <= A.gae_lambda <= 1, frac),
        ("advantage.reward_clip", A.reward_clip > 0, pos),
        *ladder_rules(args),
        ("checkpoint.every_env_steps", args.checkpoint.every_env_steps >= 1, "be >= 1"),
        ("checkpoint.keep", args.checkpoint.keep >= 1, "be >= 1"),
        ("alarms.ev_negative_patience", args.alarms.ev_negative_patience >= 1, "be >= 1"),
        ("determinism.torch_threads", args.determinism.torch_threads >= 1, "be >= 1"),
        ("determinism.inference_threads", args.determinism.inference_threads >= 1, "be >= 1"),
        ("doctor.ram_budget_mb", args.doctor.ram_budget_mb >= 1, "be >= 1"),
        ("doctor.vram_headroom_mb", args.doctor.vram_headroom_mb >= 0, "be >= 0 (0 turns the gate off)"),
    ]


def mix_ok(L: LadderArgs) -> bool:
    return len(L.mix) == 3 and min(L.mix) >= 0 and abs(sum(L.mix) - 1.0) <= 1e-9


def ladder_rules(args: Args) -> list[tuple[str, bool, str]]:
    """config_rules' ladder share: the matchmaker's mix and players, the cadences, and the gate's
    and probe's battle counts, each paired over the frozen eval seeds."""
    L, G = args.ladder, args.ladder.gate
    twice = 2 * L.eval_seed_count
    paired = (f"be even, at least 2 and at most 2 x --ladder.eval-seed-count = {twice} "
              "(a seed plays from both sides)")
    nonneg, frac = "be >= 0", "be in [0, 1]"
    return [
        ("ladder.mix", len(L.mix) == 3 and min(L.mix) >= 0,
         "be three shares (mirror pool scripted), each >= 0"),
        ("ladder.mix", mix_ok(L), "sum to 1"),
        ("ladder.max_resident_opponents", 0 <= L.max_resident_opponents <= 63,
         "be in [0, 63]: old and new residents share 127 int8 group ids"),
        ("ladder.pfsp_power", L.pfsp_power >= 0, nonneg),
        ("ladder.pfsp_uniform_floor", 0 <= L.pfsp_uniform_floor <= 1, frac),
        ("ladder.candidate_every_env_steps", L.candidate_every_env_steps >= 1, "be >= 1"),
        ("ladder.floor_admit_every_env_steps", L.floor_admit_every_env_steps >= 1, "be >= 1"),
        ("ladder.pool_working_size", L.pool_working_size >= 1, "be >= 1"),
        ("ladder.eval_seed_count", L.eval_seed_count >= 1, "be >= 1"),
        ("ladder.refit_every_iterations", L.refit_every_iterations >= 0, "be >= 0 (0 is off)"),
        ("ladder.probe_every_iterations", L.probe_every_iterations >= 0, "be >= 0 (0 is off)"),
        ("ladder.probe_games", L.probe_games % 2 == 0 and 2 <= L.probe_games <= twice, paired),
        ("ladder.scripted_opponents", all(s.startswith("scripted:") and s[9:] in farm.SCRIPTED_NAMES
                                          for s in L.scripted_opponents),
         f"name scripted:<name> players, <name> one of {', '.join(farm.SCRIPTED_NAMES)}"),
        ("ladder.probe_opponents", bool(L.probe_opponents) and all(
            s.startswith("scripted:") and s[9:] in farm.SCRIPTED_NAMES for s in L.probe_opponents),
         f"name at least one scripted:<name> rung, <name> one of {', '.join(farm.SCRIPTED_NAMES)}"),
        ("ladder.scripted_opponents", bool(L.scripted_opponents) or tuple(L.mix) == (1.0, 0.0, 0.0),
         "name a player unless --ladder.mix is all mirror (a pool battle with nothing resident plays one)"),
        ("ladder.gate.champion_games", G.champion_games % 2 == 0 and 2 <= G.champion_games <= twice, paired),
        ("ladder.gate.champion_lower_bound", 0 < G.champion_lower_bound < 1, "be in (0, 1)"),
        ("ladder.gate.anchor_games", G.anchor_games % 2 == 0 and 2 <= G.anchor_games <= twice, paired),
        ("ladder.gate.anchor_tolerance_pp", 0 <= G.anchor_tolerance_pp <= 100,
         "be in [0, 100] percentage points"),
        ("ladder.gate.stratified_snapshots", G.stratified_snapshots >= 0, nonneg),
        ("ladder.gate.stratified_games", G.stratified_games % 2 == 0 and 2 <= G.stratified_games <= twice,
         paired),
        ("ladder.gate.bootstrap_resamples", G.bootstrap_resamples >= 1, "be >= 1"),
        ("ladder.gate.sequential_battles", G.sequential_battles == 0 or (
            G.sequential_battles % 2 == 0 and 2 <= G.sequential_battles <= G.champion_games),
         "be 0 (no looks) or an even count of at most ladder.gate.champion_games (each seed from both "
         "sides)"),
    ]


def check_consistency(args: Args) -> None:
    """Refuse the first broken rule of config_rules as one line: the field as the command line
    spells it, its value, and what it must be (the remedy). main turns it into exit 2."""
    for path, holds, rule in config_rules(args):
        if not holds:
            value = field_value(args, path)
            shown = (" ".join(map(str, value)) or "(none)") if isinstance(value, tuple) else repr(value)
            raise ConfigError(f"{flag(path)} {shown}: must {rule}")
    for path in ("ladder.release_mode", "ladder.opponent_mode"):   # a plugin is imported now, not mid-run
        decode_fn(field_value(args, path), path)
    check_seed_snapshots(args.ladder.seed_snapshots)
    check_seat_decks(args.ladder.seat_decks)


def check_seat_decks(sd: SeatDecks) -> None:
    """Each deck DECK_SIZE distinct names (the catalogue is read at start, deal_check); a field
    or a shuffle needs a deck to go with."""
    for where, deck in seat_deck_names(sd):
        if len(deck) != DECK_SIZE or len(set(deck)) != DECK_SIZE:
            raise ConfigError(f"{where} {' '.join(deck) or '(none)'}: "
                              f"must be {DECK_SIZE} distinct card names")
    if not sd.deck and (sd.field or sd.shuffle != "independent"):
        raise ConfigError("ladder.seat_decks.field and .shuffle: must come with ladder.seat_decks.deck, "
                          "the deck they are dealt against")
    if sd.shuffle not in SHUFFLES:
        raise ConfigError(f"--ladder.seat-decks.shuffle {sd.shuffle!r}: must be one of {', '.join(SHUFFLES)}")


def seat_deck_names(sd: SeatDecks) -> list[tuple[str, tuple[str, ...]]]:
    """(the field's name, the deck) for the deck, if any, and each field deck."""
    named = [(f"ladder.seat_decks.field[{i}]", d) for i, d in enumerate(sd.field)]
    return [("ladder.seat_decks.deck", sd.deck), *named] if sd.deck else named


def seat_deals(sd: SeatDecks, roles: np.ndarray) -> list[dict[str, Any]] | None:
    """Per battle, the royalegym DeckCurriculumStateMutator that deals it (farm.FarmConfig.deals):
    a mirror battle the deck to both seats in one order; any other the deck to the learner's seat,
    battle % 2 (ladder.MatchConfig.fixed_seats), and a field deck (or a random one) to the other.
    None without a deck: the env's own dealer."""
    if not sd.deck:
        return None
    field_decks = [list(d) for d in sd.field] or None
    return [{"deck": list(sd.deck), "p": 1.0, "mirror_p": 1.0} if int(role) == farm.ROLE_MIRROR else
            {"deck": list(sd.deck), "p": 1.0, "mirror_p": 0.0, "seat": ("blue", "red")[b % 2],
             "pool": field_decks, "shuffle": int(ShuffleMode[sd.shuffle.upper()])}
            for b, role in enumerate(roles)]


def deal_check(sd: SeatDecks, cards: Sequence[Any]) -> None:
    """Every name of ladder.seat_decks in the engine's catalogue, before the run exists (royalegym
    resolves them again at each battle's first reset)."""
    from royalegym.state_mutator import deck_ids
    for where, deck in seat_deck_names(sd):
        try:
            deck_ids(deck, cards, where)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_seed_snapshots(seeds: Sequence[SeedSnapshot]) -> None:
    """The seeds' own rules (their folders are read later, check_seeds): one line naming the entry."""
    for i, sd in enumerate(seeds):
        at = f"ladder.seed_snapshots[{i}]"
        if re.fullmatch(r"[A-Za-z0-9_.-]+", sd.name) is None:   # a player id, a path segment, a stream name
            raise ConfigError(f"{at}.name {sd.name!r}: must be letters, digits, '_', '.' or '-' (the pool "
                              f"calls it seed:<name>)")
        if sd.name in [x.name for x in seeds[:i]]:
            raise ConfigError(f"{at}.name {sd.name!r}: must be unique; an earlier entry has it")
        if re.fullmatch("[0-9a-f]{64}", sd.sha256) is None:
            raise ConfigError(f"{at}.sha256 {sd.sha256!r}: must be 64 lowercase hex digits (the folder's "
                              f"spec.json holds it as actor_sha256)")
        if not (math.isfinite(sd.weight) and sd.weight > 0):
            raise ConfigError(f"{at}.weight {sd.weight!r}: must be a positive number")


def resolve_device(args: Args) -> torch.device:
    """A profile that wants CUDA on a machine without it stops with a message, not a traceback."""
    if args.net.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"profile {args.profile!r} wants net.device={args.net.device} but this machine "
                          "has no CUDA device: run with --profile cpu "
                          "(or --net.device cpu --net.autocast-dtype float32)")
    return torch.device(args.net.device)


# torchrun's ranks (design 3.10): what the update sums over, and how the ranks start and stay equal.


class Comm:
    """The ranks of a torchrun job, and what the learner sums over them (design 3.10). Each rank
    collects its own battles and holds its own rows; every count a loss is divided by, every
    gradient and every statistic a decision reads is summed over the ranks before it is used, so
    one optimizer step of N ranks is the step one process would take on their rows together and
    the weights stay identical on every rank. Rank 0 is the run's one voice. One process (SOLO,
    no process group) sums nothing and adds no operation: its bytes are what they always were."""

    def __init__(self, device: torch.device | str = "cpu", on: bool = False, rank: int = 0, world: int = 1,
                 backend: str = "") -> None:
        self.device, self.on, self.rank, self.world, self.backend = (torch.device(device), on, rank, world,
                                                                     backend)

    @property
    def voice(self) -> bool:
        """Rank 0: the one that writes the run directory, the console and the sinks."""
        return self.rank == 0

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (float64 stays float64)."""
        if self.on:
            import torch.distributed as dist
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def counts(self, *n: int) -> list[int]:
        if not self.on:
            return list(n)
        return [int(v) for v in self.sum_(torch.tensor(n, dtype=torch.int64, device=self.device)).tolist()]

    def most(self, x: float) -> float:
        """The largest x over the ranks (float64; an int comes back exact)."""
        if not self.on:
            return x
        import torch.distributed as dist
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def grads(self, params: Sequence[nn.Parameter]) -> None:
        """Every parameter's .grad summed over the ranks: one flattened all-reduce a step."""
        if not self.on:
            return
        flat = self.sum_(torch.cat([q.grad.reshape(-1) for q in params]))
        i = 0
        for q in params:
            q.grad.copy_(flat[i:i + q.grad.numel()].view_as(q.grad))
            i += q.grad.numel()

    def share(self, obj: Any) -> Any:
        """Rank 0's obj, on every rank (its decisions: the run directory, the pool, stop and save)."""
        if not self.on:
            return obj
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def everyone(self, obj: Any) -> list[Any]:
        """Every rank's obj, in rank order, on every rank."""
        if not self.on:
            return [obj]
        import torch.distributed as dist
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def same_weights(self, learner: Learner) -> None:
        """Every rank's state_digest (weights, optimizer moments, scaler, positions) equal after the
        update, checked every iteration: summed gradients and statistics keep them equal, and this
        says so rather than trusting it (design 3.10)."""
        if not self.on:
            return
        digests = self.everyone(learner_digest(learner))
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        if bad:
            raise RanksDiverged(f"after iteration {learner.iteration + 1}'s update rank(s) {bad} hold "
                                f"state_digest {[digests[r][:16] for r in bad]}, rank 0 {digests[0][:16]}: "
                                "the ranks' learners diverged (a reduction missed, or a rank-local "
                                "decision); the last checkpoint resumes")

    def every_episode(self, episodes: list[Any], n_battles: int) -> list[Any]:
        """Rank 0 gets every rank's finished episodes, in rank order, each battle numbered in the job
        (rank r's battle b is battle r x n_battles + b), so episodes.jsonl reads as one farm's; the
        other ranks keep none (they write nothing)."""
        if not self.on:
            return episodes
        got = self.everyone(episodes)
        if not self.voice:
            return []
        return [msgspec.structs.replace(e, battle=e.battle + r * n_battles)
                for r, eps in enumerate(got) for e in eps]


SOLO = Comm()
"""The one-process Comm: what every caller outside torchrun gets."""


def open_comm(args: Args) -> Comm:
    """Under torchrun (it sets LOCAL_RANK, RANK, WORLD_SIZE and the rendezvous) join its process
    group: NCCL on CUDA, gloo on CPU, each rank on one device, cuda:LOCAL_RANK. A plain
    `python ppo_clash.py` gets SOLO and touches nothing of torch.distributed (design 3.10)."""
    if "LOCAL_RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return SOLO
    if args.net.device not in ("cpu", "cuda"):
        raise ConfigError(f"--net.device {args.net.device}: under torchrun each rank takes its own device; "
                          "use cuda (rank r gets cuda:LOCAL_RANK) or cpu")
    import torch.distributed as dist
    cuda = resolve_device(args).type == "cuda"
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)   # "cuda" means this rank's device from here on
    backend = "nccl" if cuda else "gloo"
    # the longest any rank waits is rank 0's gate on its evaluation farm (about 4 minutes on the cpu
    # profile [M: docs/running.md section 6]); NCCL's own default, 10 minutes, would end the job
    # during a larger profile's gate. A failed rank does not wait this out: torchrun stops the rest.
    import datetime
    dist.init_process_group(backend, timeout=datetime.timedelta(hours=1))
    return Comm(torch.device("cuda", local) if cuda else "cpu", True, dist.get_rank(), dist.get_world_size(),
                backend)


def close_comm(comm: Comm) -> None:
    if comm.on:
        import torch.distributed as dist
        dist.destroy_process_group()


class RanksDiverged(RuntimeError):
    """Two torchrun ranks hold different learners after an update: names the ranks and the iteration."""


# The run's identity.
# run_id = sha256 of the identity's canonical JSON, first 16 hex. Included even though they look
# cosmetic, because each changes the byte stream: master_seed, workers, games_per_worker,
# shards_per_worker, timesteps_per_iteration, determinism tier, device kind, and the code itself.
# Excluded, recorded only, because none can change a number: run_name, runs_dir, wandb and
# console settings, checkpoint.keep, alarm thresholds. The identity is built from the sections
# that change numbers, so an excluded field cannot leak in.

IDENTITY_FORMAT = 2


def canonical_json(obj: Any) -> bytes:
    """The hashed form of anything we record: msgspec JSON with sorted keys (design 2.3)."""
    return msgspec.json.encode(obj, order="deterministic")


def canonical_json_ordered(fields: dict[str, Any]) -> bytes:
    """canonical_json of a dataclass's fields given as a dict in field order (a dict would be sorted)."""
    return b"{" + b",".join(msgspec.json.encode(k) + b":" + canonical_json(v)
                            for k, v in fields.items()) + b"}"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dict_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Every leaf that differs between two nested dicts, as 'path: old -> new'. The config, the
    identity and the architecture are all compared with it, so every refusal names fields alike."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += dict_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


class EngineBuild(msgspec.Struct, frozen=True):
    engine_class: str
    calibration_digest: str
    build_digest: str
    catalogue_sha256: str
    path_search: str | None
    stale_build_differences: list[str]
    binary_sha256: str = "not recorded"


class RunIdentity(msgspec.Struct, frozen=True, omit_defaults=True):
    format_version: int
    harness_version: str                 # this project
    harness_git: str
    royalegym_version: str
    royalegym_git: str
    engine_build: EngineBuild
    env_spec_digest: str
    obs_digest: str
    action_digest: str
    frame_stack: int
    arch_digest: str
    codec_version: int
    codec_table_digest: str
    algo_digest: str
    rollout_digest: str
    ladder_digest: str
    master_seed: int
    determinism_tier: str
    torch_version: str
    device_kind: str
    user_code: dict[str, str] | None = None
    world_size: int = 1        # torchrun's ranks (design 3.10); one process leaves both out of the id
    backend: str = ""


class EnvFacts(msgspec.Struct, frozen=True):
    """What the identity needs from the env and the codec; farm/codec supply it at start-up."""
    engine_build: EngineBuild
    env_spec_digest: str
    obs_digest: str
    action_digest: str
    codec_version: int
    codec_table_digest: str
    royalegym_version: str
    royalegym_git: str = "not recorded"


def engine_build_from_config(cfg: dict[str, Any], engine_class: str) -> EngineBuild:
    """From ClashParallelEnv.config(): the engine's own digests and binary hash, never a second
    opinion computed here (design 2.3)."""
    params = cfg.get("engine", {}).get("params", {}) if isinstance(cfg.get("engine"), dict) else {}
    cards = params.get("cards") or []
    return EngineBuild(engine_class=engine_class, calibration_digest=str(cfg.get("calibration_digest")),
                       build_digest=str(cfg.get("build_digest")),
                       catalogue_sha256=sha256_hex(canonical_json(cards)),
                       path_search=(None if params.get("path_search") is None
                                    else str(params.get("path_search"))),
                       stale_build_differences=[],
                       binary_sha256=str(params.get("engine_binary_sha256", "not stated")))


def device_kind(device: torch.device | str) -> str:
    d = torch.device(device)
    if d.type == "cuda":
        i = d.index or 0
        cap = torch.cuda.get_device_capability(i)
        return f"cuda:{torch.cuda.get_device_name(i)}:sm_{cap[0]}{cap[1]}"
    return f"{d.type}:{platform.machine()}"


def code_tokens(source: bytes) -> bytes:
    """A script's code as its token stream: comments, blank lines, line breaks inside brackets,
    indentation widths and docstrings (a string that is a whole statement) are not code."""
    import tokenize
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING)
    toks = [t for t in tokenize.tokenize(io.BytesIO(source).readline) if t.type not in skip]
    starts = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    out, i = [], 0
    while i < len(toks):
        t = toks[i]
        if (t.type == tokenize.STRING and (i == 0 or toks[i - 1].type in starts)
                and i + 1 < len(toks) and toks[i + 1].type == tokenize.NEWLINE):
            i += 2   # a docstring and the end of its line
            continue
        out.append(tokenize.tok_name[t.type] if t.type in starts
                   else f"{tokenize.tok_name[t.type]} {t.string}")
        i += 1
    return "\n".join(out).encode()


def user_code_digest(entry: Path | str | None = None, extra: Sequence[Path] = ()) -> dict[str, str]:
    """The code that runs, by file name: the entry script (this file by default, whatever its name,
    so a fork is identified as itself), the files in `extra` (a decode plugin's module), and every
    project script they import, followed through their own imports. Hashed as tokens
    (code_tokens): a comment edit keeps run_id, a code edit moves it."""
    todo = [Path(__file__ if entry is None else entry).resolve(), *(Path(p).resolve() for p in extra)]
    out: dict[str, str] = {}
    while todo:
        p = todo.pop()
        if p.name in out:
            continue
        out[p.name], imported = script_digest(p.read_bytes(), str(p))
        todo += [p.parent / f"{n}.py" for n in imported if (p.parent / f"{n}.py").exists()]
    return dict(sorted(out.items()))


@functools.lru_cache(maxsize=32)
def script_digest(src: bytes, filename: str) -> tuple[str, tuple[str, ...]]:
    """One script's code_tokens hash and the top-level modules it imports: a pure function of its
    bytes, so a process that opens several runs (verify-resume, a test session) tokenizes each
    script once (0.5 s for the four a run imports [M])."""
    imported = []
    for node in ast.walk(ast.parse(src, filename=filename)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        imported += [n.split(".")[0] for n in names]
    return sha256_hex(code_tokens(src)), tuple(imported)


# NetArgs fields that do not shape the network: the precision belongs to the algorithm (algo_digest),
# the device to the machine, and the factored gate's initial bias is a starting value.
NOT_ARCHITECTURE = ("autocast_dtype", "device", "factored_act_init")


def arch_description(geo: NetGeometry, net: "NetArgs") -> dict[str, Any]:
    """What arch_digest covers, read off the network these settings build: the geometry, every
    NetArgs field that shapes the forward, and every module and tensor by name, class and shape.
    Nothing is listed by hand, so a fork that adds a block, widens a layer or swaps a module moves
    the digest (and the snapshot and checkpoint checks that trust it) without an edit here."""
    return json.loads(_arch_json(canonical_json(geo), canonical_json(dataclasses.asdict(net))))


@functools.lru_cache(maxsize=64)
def _arch_json(geo_json: bytes, net_json: bytes) -> bytes:
    """arch_description for one (geometry, settings), built once on the meta device: shapes and
    names only, no memory and no initialisation cost."""
    geo, net = msgspec.json.decode(geo_json, type=NetGeometry), msgspec.json.decode(net_json, type=NetArgs)
    with torch.device("meta"):
        model = ActorCritic(geo, net, 0)
    return canonical_json({
        "geometry": msgspec.to_builtins(geo),
        "net": {k: v for k, v in dataclasses.asdict(net).items() if k not in NOT_ARCHITECTURE},
        "modules": [f"{name} {type(m).__name__}" for name, m in model.named_modules() if name],
        "tensors": [f"{name} {list(t.shape)}" for name, t in model.state_dict().items()]})


def arch_digest(geo: NetGeometry, net: "NetArgs") -> str:
    return sha256_hex(canonical_json(arch_description(geo, net)))


def algo_digest(args: Args) -> str:
    """PPO, GAE and schedule config, the precision (autocast changes every number), and the
    starting points arch_digest leaves out: the warm start, the factored head's P(act)."""
    # each only when on: every earlier run id holds
    w = args.warm
    # a lookahead rung by its canonical id: every setting, whatever the defaults become
    warm = {"warm": msgspec.Raw(canonical_json_ordered(
        {f.name: farm.canonical_player(w.rung) if f.name == "rung" else getattr(w, f.name)
         for f in dataclasses.fields(w) if f.name != "teacher_kl" or teacher_on(w)}))} if w.rung else {}
    act = {"factored_act_init": args.net.factored_act_init} if args.net.policy_head == "factored" else {}
    ppo: Any = args.ppo
    if ppo.entropy_coef_stages is None:   # the section's fields in their own order, less that one
        ppo = msgspec.Raw(canonical_json_ordered({f.name: getattr(ppo, f.name)
                                                  for f in dataclasses.fields(ppo)
                                                  if f.name != "entropy_coef_stages"}))
    return sha256_hex(canonical_json({"ppo": ppo, "advantage": args.advantage,
                                      "autocast_dtype": args.net.autocast_dtype, **warm, **act}))


def rollout_digest(args: Args, T: int, R: int) -> str:
    r = args.rollout
    # rollout.source is left out: inline and process collect byte-identical rows (farm's test)
    return sha256_hex(canonical_json({"workers": r.workers, "games_per_worker": r.games_per_worker,
                                      "shards_per_worker": r.shards_per_worker, "T": T, "R": R}))


def ladder_digest(args: Args, eval_seed_set_sha: str) -> str:
    # the fields added since the first runs only when set, so every earlier run id holds: the
    # section's fields in their own order, as canonical_json writes a dataclass, less those. A
    # seed's path is where one machine keeps it: its name, weights and weight are the player
    L = args.ladder
    later = {"opponent_mode": "stochastic", "seed_snapshots": (), "seat_decks": SeatDecks()}
    lad = {f.name: getattr(L, f.name) for f in dataclasses.fields(L)
           if f.name not in later or getattr(L, f.name) != later[f.name]}
    if not L.gate.sequential_battles:   # the gate's section as it was, less the later field at 0
        lad["gate"] = msgspec.Raw(canonical_json_ordered({f.name: getattr(L.gate, f.name)
                                                          for f in dataclasses.fields(L.gate)
                                                          if f.name != "sequential_battles"}))
    if L.seed_snapshots:
        lad["seed_snapshots"] = [{"name": sd.name, "sha256": sd.sha256, "weight": sd.weight}
                                 for sd in L.seed_snapshots]
    return sha256_hex(canonical_json({"ladder": msgspec.Raw(canonical_json_ordered(lad)),
                                      "eval_seed_set_sha": eval_seed_set_sha}))


def make_identity(args: Args, facts: EnvFacts, *, arch: str, T: int, R: int, device: torch.device | str,
                  eval_seed_set_sha: str = "", user_code: dict[str, str] | None = None, world_size: int = 1,
                  backend: str = "") -> RunIdentity:
    return RunIdentity(
        format_version=IDENTITY_FORMAT, harness_version="clash-ppo 0.1.0", harness_git="not recorded",
        royalegym_version=facts.royalegym_version, royalegym_git=facts.royalegym_git,
        engine_build=facts.engine_build, env_spec_digest=facts.env_spec_digest, obs_digest=facts.obs_digest,
        action_digest=facts.action_digest, frame_stack=args.obs.frame_stack, arch_digest=arch,
        codec_version=facts.codec_version, codec_table_digest=facts.codec_table_digest,
        algo_digest=algo_digest(args), rollout_digest=rollout_digest(args, T, R),
        ladder_digest=ladder_digest(args, eval_seed_set_sha), master_seed=args.master_seed,
        determinism_tier=args.determinism.tier, torch_version=str(torch.__version__),
        device_kind=device_kind(device), user_code=user_code, world_size=world_size, backend=backend)


def run_id(identity: RunIdentity) -> str:
    return sha256_hex(canonical_json(identity))[:16]


def identity_diff(a: RunIdentity, b: RunIdentity) -> list[str]:
    """Every differing field, named (a resume refuses on any, design 2.4); a field left out of the
    id at its default (world_size 1) is compared at that default."""
    def full(x: RunIdentity) -> dict[str, Any]:
        d = msgspec.to_builtins(x)
        return {f: d.get(f, getattr(x, f)) for f in x.__struct_fields__}
    return dict_diff(full(a), full(b))


def compute_identity(args: Args, env: Env) -> RunIdentity:
    """The identity a run with these arguments on this env gets (what open_run records and
    `checks.py identity` prints). The frozen evaluation seed set is drawn from the master seed
    alone, so its sha enters ladder_digest before the run directory exists."""
    seed_sha = ladder.draw_eval_seeds(args.master_seed, args.ladder.eval_seed_count).sha256
    return make_identity(args, env.facts, arch=arch_digest(env.geo, args.net), T=env.T, R=env.R,
                         device=env.device, eval_seed_set_sha=seed_sha,
                         user_code=user_code_digest(extra=plugin_files(args.ladder.release_mode,
                                                                       args.ladder.opponent_mode)),
                         world_size=env.world, backend=env.backend)


# Start-up gates (design 3.8): what must hold of this engine and this configuration before a run
# may start. Training runs them at start (startup_gates in _train) and `python checks.py doctor`
# prints them; one implementation. Steps 1-4 happen in read_env, which raises naming the step.

class StartupGateFailed(ConfigError):
    """A start-up gate refused the run: names the gate, what it saw and the remedy."""


def stale_build_refusal(exc: RuntimeError) -> StartupGateFailed | None:
    """Gate 1's refusal for a RustEngine that would not construct because its compiled build and
    the calibration ledger differ (royalegym's own check says so), in the engine's words with the
    rebuild command; None for any other error, which is raised as it was."""
    from royalegym.rust_engine import default_calibration, stale_build_differences
    if not stale_build_differences(default_calibration()):
        return None
    words = "; ".join(line.strip() for line in str(exc).splitlines())   # the engine's, on one line
    return StartupGateFailed(f"start-up gate 1 (engine built and reset) failed: {words}. Rebuild the engine: "
                             "pip install --force-reinstall 'royalegym[sim]' (in a RoyaleSim checkout, "
                             "`maturin develop --release`)")


class Gate(NamedTuple):
    step: int               # design 3.8's step number
    name: str
    ok: bool | None         # None: skipped, and detail says why
    detail: str
    remedy: str = ""
    value: float | None = None   # a reading the rows keep (step 12: health/vram_needed_mb)


# Resident memory a process costs, for the RAM ledger [M, this project's 2-core machine,
# docs/throughput.md]: a worker holding a vec env (its base, and per battle), the parent's torch.
WORKER_BASE_MB, WORKER_PER_BATTLE_MB, TORCH_MB = 93.0, 6.9, 505.0
DOCTOR_STATES = 1000        # seat-states sampled for the no-op gate, at least one after game over


class SampledBattles(NamedTuple):
    states: int             # seat-states seen
    noop_missing: int       # of them, with mask[NOOP] clear
    game_over: int          # of them, after the battle ended
    planes_mismatch: int    # of them, whose mask_planes are not the mask's grid reshaped
    disagreements: list[tuple[int, int, int]] | None   # mask vs engine at a played state, both teams
    parser: Any


def sample_battles(args: Args, env: Env) -> SampledBattles:
    """Whole battles of the evaluation env (no step cap, so they end in a game over), both seats
    playing a random legal card a third of the time, until DOCTOR_STATES seat-states are seen.
    Each battle's seed and actions are name-addressed (doctor/battle/{i}), so the gate is exact."""
    return _sampled_battles(msgspec.json.encode(ladder.eval_env_spec(env.spec)), args.master_seed,
                            args.doctor.run_mask_disagreement_gate)


@functools.lru_cache(maxsize=4)
def _sampled_battles(spec_json: bytes, master_seed: int, disagreement_gate: bool) -> SampledBattles:
    """sample_battles, a pure function of these: a process that starts several runs
    (verify-resume, a test session) plays the battles once, 1.4-1.7 s of CPU a start on a 2-core
    machine [M, docs/throughput.md]."""
    from royalegym.action import BLUE, NOOP, RED, mask_disagreements
    e = farm.env_factory(msgspec.json.decode(spec_json, type=farm.EnvFactorySpec))()
    states = missing = over = planes = 0
    disagree: list[tuple[int, int, int]] | None = None
    i = 0
    while states < DOCTOR_STATES or not over:
        rng = derive_generator(master_seed, f"doctor/battle/{i}")
        obs, _ = e.reset(seed=derive_int(master_seed, f"doctor/battle/{i}/seed"))
        for step in range(10**6):
            masks = {a: np.asarray(obs[a]["action_mask"]).astype(bool) for a in obs}
            done = step > 0 and not e.agents
            for a, m in masks.items():
                states, missing, over = states + 1, missing + int(not m[NOOP]), over + int(done)
                if "mask_planes" in obs[a]:   # (hand, H, W): the mask's grid after the no-op, reshaped
                    mp = np.asarray(obs[a]["mask_planes"]).astype(bool)
                    planes += int(not np.array_equal(mp, m[1:1 + mp.size].reshape(mp.shape)))
            if done:
                break
            if disagree is None and step == 50 and disagreement_gate:
                st = e.engine.state()
                disagree = [d for team in (BLUE, RED)
                            for d in mask_disagreements(e.engine, e.action_parser, st, team)]
            obs, *_ = e.step({a: int(rng.choice(np.flatnonzero(m))) if rng.random() < 1 / 3 else NOOP
                              for a, m in masks.items()})
        i += 1
    parser = e.action_parser
    e.close()
    return SampledBattles(states, missing, over, planes, disagree, parser)


def ram_ledger(args: Args, env: Env, params: int) -> list[tuple[str, float, str]]:
    """(term, MB, source) of the run's projected resident memory (design 3.8 step 9), for a
    network of `params` parameters."""
    r, k = args.rollout, args.obs.frame_stack
    worker = lambda battles: WORKER_BASE_MB + WORKER_PER_BATTLE_MB * battles
    return [("rectangle (T + k) x R x row_bytes", (env.T + k) * env.R * env.table.row_bytes / 2**20, "[A]"),
            ("scalar columns T x R", env.T * env.R * farm.SCALAR_DTYPE.itemsize / 2**20, "[A]"),
            ("parent torch", TORCH_MB, "[M]"),
            ("weights, gradients, Adam moments: 4 x 4 B a parameter", 16 * params / 2**20, "[A]"),
            (f"{r.workers} workers x {r.games_per_worker} battles", r.workers * worker(r.games_per_worker),
             "[M]"),
            (f"at a gate: {r.eval_workers} eval workers x {r.eval_games_per_worker} battles",
             r.eval_workers * worker(r.eval_games_per_worker), "[M]"),
            # a seed: int64 8 B drawn, a Python int 32 B and its list slot 8 B, about 21 B of JSON
            (f"{args.ladder.eval_seed_count} eval seeds x 69 B", args.ladder.eval_seed_count * 69 / 2**20,
             "[A]")]


def ram_gate(args: Args, env: Env, params: float) -> Gate:
    """Step 9: the RAM ledger within doctor.ram_budget_mb. set_up checks it before the network
    exists, on parameter_count, so no size the machine cannot hold is ever allocated."""
    ledger = ram_ledger(args, env, params)
    total = sum(mb for _, mb, _ in ledger)
    return Gate(9, "RAM ledger within doctor.ram_budget_mb", total <= args.doctor.ram_budget_mb,
                f"{total:,.0f} MB projected of {args.doctor.ram_budget_mb:,} MB: "
                + "; ".join(f"{t} {mb:,.0f} {src}" for t, mb, src in ledger),
                "lower the field behind the largest term (rollout.workers, rollout.games_per_worker, net.*, "
                "ladder.eval_seed_count), or raise --doctor.ram-budget-mb")


def parameter_count(args: Args, env: Env) -> float:
    """The network's parameters, counted on torch's meta device (shapes, no storage); inf for a
    network whose byte count a tensor cannot even represent (torch says "overflowed")."""
    try:
        with torch.device("meta"):
            return float(sum(p.numel()
                             for p in ActorCritic(env.geo, args.net, args.master_seed).parameters()))
    except RuntimeError as e:
        if "overflow" not in str(e):
            raise
        return math.inf


def startup_gates(args: Args, env: Env, model: ActorCritic) -> tuple[list[Gate], int]:
    """Design 3.8's gates in order for the run's network, and the mask-vs-engine disagreement
    count (the row's health/mask_disagreements). Raises nothing: check_gates refuses on the first
    failure."""
    eb, geo = env.facts.engine_build, env.geo
    fields = ", ".join(f"{n}[{geo.field(n).start}:{geo.field(n).stop}]"
                       for n in (HAND_CARDS, HAND_COST, HAND_AFFORDABLE))
    gates = [Gate(1, "engine built and reset", True, f"{eb.engine_class}, binary {eb.binary_sha256[:12]}"),
             Gate(2, "the env's config read once", True, f"calibration {eb.calibration_digest[:12]}, build "
                  f"{eb.build_digest[:12]}, env {env.facts.env_spec_digest[:12]}"),
             Gate(3, "codec table from the env's spaces", True, f"{env.table.row_bytes} bytes a row, "
                  f"digest {env.table.digest()[:12]}"),
             Gate(4, "pointer head's vector fields by name", True, fields)]
    s = sample_battles(args, env)
    n_dis = len(s.disagreements or [])
    gates.append(Gate(5, "mask agrees with the engine at a played state, both teams",
                      None if s.disagreements is None else n_dis == 0,
                      "skipped (doctor.run_mask_disagreement_gate false)" if s.disagreements is None
                      else f"{n_dis} disagreements"
                      + (f", first (action, mask, engine status): {s.disagreements[:4]}" if n_dis else ""),
                      "the observation's mask and the engine's deploy rules differ: "
                      "report it against royalegym"))
    gates.append(Gate(6, "mask[NOOP] on sampled states", s.noop_missing == 0 and s.game_over > 0,
                      f"{s.states} states ({s.game_over} after game over), "
                      f"{s.noop_missing} without the no-op",
                      "the masking scheme needs the no-op always legal: report it against royalegym"))
    H, W = geo.tiles
    bad = [(p, x, y) for p in range(geo.hand_size) for y in range(H) for x in range(W)
           if s.parser.encode(p, x, y) != 1 + p * H * W + y * W + x]
    gates.append(Gate(7, "action layout: encode(slot, x, y) = 1 + slot*H*W + y*W + x",
                      not bad and not s.planes_mismatch,
                      f"{geo.hand_size * H * W} actions, {len(bad)} off the layout"
                      + (f" (first {bad[:3]})" if bad else "") + "; "
                      f"{s.planes_mismatch} states whose mask_planes differ from the mask",
                      "the pointer head's tiles would name the wrong actions: "
                      "update PointerHead to the parser"))
    gates.append(Gate(8, "engine build recorded in the identity", True,
                      f"catalogue {eb.catalogue_sha256[:12]}"))
    gates.append(ram_gate(args, env, sum(p.numel() for p in model.parameters())))
    gates.append(vram_gate(args, env, model))
    return gates, n_dis


def vram_gate(args: Args, env: Env, model: ActorCritic) -> Gate:
    """One minibatch's forward and backward at the profile's minibatch_size must leave
    doctor.vram_headroom_mb of device memory free (CUDA only)."""
    name = "device memory after one minibatch"
    if env.device.type != "cuda" or args.doctor.vram_headroom_mb <= 0:
        why = "no CUDA device" if env.device.type != "cuda" else "doctor.vram_headroom_mb is 0"
        return Gate(12, name, None, f"skipped ({why})")
    n, k = args.ppo.minibatch_size, args.obs.frame_stack
    rows = torch.zeros((n, k, env.table.row_bytes), dtype=torch.uint8, device=env.device)
    obs = codec.unpack(env.table, rows, env.statics, torch.arange(n, device=env.device) % 2, None)
    free0, _ = torch.cuda.mem_get_info(env.device)
    torch.cuda.reset_peak_memory_stats(env.device)
    base = torch.cuda.memory_allocated(env.device)
    mask = torch.zeros_like(obs.mask)
    mask[:, 0] = True   # a zero row decodes to no legal action; the no-op keeps the distribution defined
    (model.value(obs).sum() + MaskedCategorical(model.logits(obs), mask).entropy().sum()).backward()
    model.zero_grad(set_to_none=True)   # the probe's gradients are not the update's
    peak_mb = (torch.cuda.max_memory_allocated(env.device) - base) / 2**20
    left = free0 / 2**20 - peak_mb
    return Gate(12, name, left >= args.doctor.vram_headroom_mb,
                f"{peak_mb:,.0f} MB peak, {left:,.0f} MB left of the {free0 / 2**20:,.0f} MB free",
                "lower ppo.minibatch_size (a pure memory knob), or --doctor.vram-headroom-mb",
                peak_mb + args.doctor.vram_headroom_mb)


def check_gates(gates: list[Gate]) -> None:
    """Refuse on the first failing gate, naming it and the remedy."""
    for g in gates:
        if g.ok is False:
            raise StartupGateFailed(f"start-up gate {g.step} ({g.name}) failed: {g.detail}. {g.remedy}")


def gate_lines(gates: list[Gate]) -> list[str]:
    return [f"  {g.step:>2}. {g.name}: {'ok, ' if g.ok else '' if g.ok is None else 'FAILED, '}{g.detail}"
            for g in gates]


def run_startup_gates(args: Args, env: Env, model: ActorCritic, quiet: bool) -> None:
    """Training's start: the gates, printed unless quiet, refused on the first failure; what the
    rows carry of them goes on env (the mask disagreement count, step 12's vram_needed_mb)."""
    gates, n_dis = startup_gates(args, env, model)
    if not quiet:
        print("start-up gates (design 3.8):\n" + "\n".join(gate_lines(gates)))
    check_gates(gates)
    env.mask_disagreements = n_dis
    env.vram_needed_mb = next((g.value for g in gates if g.step == 12), None)


class IdentityMismatch(ValueError):
    """A resume whose identity differs from the checkpoint's: every differing field is named."""


def config_diff(saved: dict[str, Any], args: Args) -> list[str]:
    """The config fields a resume changes, both sides in their JSON form: the manifest's config
    went through JSON, so a tuple there is a list, and a list against a tuple is no difference."""
    return dict_diff(json.loads(canonical_json(saved)), json.loads(config_json(args)))


# The run's append-only logs, relative to the run directory. A checkpoint records how many lines
# of each it covers (Manifest.rows); a resume moves what was written after that aside (cut_back),
# so every iteration and every battle is in each log once (design 2.4, 8.1).
RUN_LOGS = ("metrics.jsonl", "episodes.jsonl", "alarms.jsonl", "ladder/games.jsonl")


def count_lines(path: Path) -> int:
    """Complete lines: a last line a crash tore (no newline) is not one."""
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def written_by(rel: str, iteration: int, ordinals: Sequence[int]) -> Any:
    """For a checkpoint that records no row counts: whether a row of log `rel` was written by the
    time the checkpoint was, read off the row. An episode was if its ordinal is below its battle's
    ordinal in the checkpoint (the episode each battle was playing); the rest carry an iteration."""
    if rel == "episodes.jsonl":
        return lambda row: row["ordinal"] < ordinals[row["battle"]]
    key = "run/iteration" if rel == "metrics.jsonl" else "iteration"
    return lambda row: row[key] <= iteration


def _row_holds(line: bytes, test: Any) -> bool:
    """test(row) for a complete JSON line; a torn or undecodable line holds nothing."""
    try:
        return line.endswith(b"\n") and bool(test(json.loads(line)))
    except (ValueError, KeyError, IndexError, TypeError):
        return False


def move_after(path: Path, keep: int | None, covered: Any, stays: Any, side: Path) -> tuple[int, int]:
    """Keep the first `keep` lines of `path` (None: the leading lines `covered` holds for) and move
    every later line to `side`, except those `stays` holds for, which stay in order. The side file
    is written and fsynced before the log is cut, so a crash between leaves a row twice, never
    none. The cut holds the log's writer lock: `ladder.py eval|gate` may be appending games to
    this run. Returns (lines kept at the head, lines moved)."""
    if not path.exists():
        return 0, 0
    with open(path, "rb+") as f:
        ladder.lock_file(f)
        head, pos = 0, 0
        while keep is None or head < keep:
            line = f.readline()
            if not line.endswith(b"\n") or (keep is None and not _row_holds(line, covered)):
                break
            head, pos = head + 1, pos + len(line)
        f.seek(pos)
        tail = f.read().splitlines(keepends=True)
        hold = [stays is not None and _row_holds(x, stays) for x in tail]
        kept, moved = ([x for x, h in zip(tail, hold, strict=True) if h],
                       [x for x, h in zip(tail, hold, strict=True) if not h])
        if moved:
            ladder.write_atomic(side, b"".join(moved))
            f.seek(pos)
            f.truncate()
            f.write(b"".join(kept))
            f.flush()
            os.fsync(f.fileno())
    return head, len(moved)


def cut_back(run: Path, man: Manifest, ordinals: Sequence[int]) -> list[str]:
    """Put each run log back to what checkpoint `man` covers before the resumed run appends to it
    (design 2.4): the rows after it move to <log>.after-iteration-<k> beside the log (.2, .3, ...
    when a resume from that iteration already made one), never deleted. A game of iteration -1
    stays: `ladder.py eval|gate` played it, and no resumed run plays it again. The rater's cache,
    ladder/aggregate.json, is rebuilt from the cut log. Returns one line per log for the console."""
    k, out = man.iteration, []
    for rel in RUN_LOGS:
        p = run / rel
        side, n = p.with_name(f"{p.name}.after-iteration-{k}"), 1
        while side.exists():
            n += 1
            side = p.with_name(f"{p.name}.after-iteration-{k}.{n}")
        keep = (man.rows or {}).get(rel)   # None: an older checkpoint, cut by what the rows say
        how = "" if keep is not None else " (by iteration: the checkpoint records no row count)"
        stays = (lambda row: row["iteration"] < 0) if rel == "ladder/games.jsonl" else None
        head, moved = move_after(p, keep, written_by(rel, k, ordinals), stays, side)
        line = (f"resume: {rel}: moved {moved} row(s) written after iteration {k} "
                f"to {side.relative_to(run)}{how}"
                if moved else f"resume: {rel}: no row after iteration {k}{how}")
        if keep is not None and head < keep:
            line += f"; it holds {head} of the {keep} rows the checkpoint covers (lost before this resume)"
        out.append(line)
    ladder.ResultLog(run).rebuild_cache()
    return out


def open_run(args: Args, env: Env, learner: Learner, resume: Path | None, allow_drift: bool, quiet: bool,
             t_start: float) -> Run:
    """The run's identity (design 2.3) and its directory. A new run writes config.json and
    identity.json. A resume (design 2.4) refuses an identity that differs from the checkpoint's,
    naming every field, unless allowed (drift.json then records what changed), prints every
    config difference the identity excludes, restores the learner, and then cuts the run's logs
    back to what the checkpoint covers (cut_back), saying per log how many rows it moved."""
    identity = compute_identity(args, env)
    if resume is None:
        rid = run_id(identity)
        path = Path(args.runs_dir) / f"{args.run_name}-{rid}"
        if path.exists():   # the same identity, run before: never written over (design 2.3)
            set_aside_unsaved(path)
        path.mkdir(parents=True)
        lock = hold_run(path)
        (path / "config.json").write_bytes(config_json(args))
        (path / "identity.json").write_bytes(msgspec.json.format(canonical_json(identity)))
        return Run(args, path, identity, rid, quiet, t_start, lock=lock)
    path = Path(resume).parent.parent
    lock = hold_run(path)   # before anything below writes (drift.json, the logs' cut)
    try:
        return _resume_run(args, env, learner, path, Path(resume), identity, allow_drift, quiet, t_start,
                           lock)
    except BaseException:
        lock.close()
        raise


def _resume_run(args: Args, env: Env, learner: Learner, path: Path, resume: Path, identity: RunIdentity,
                allow_drift: bool, quiet: bool, t_start: float, lock: Any) -> Run:
    """open_run's resume (design 2.4), the run's training lock held."""
    man, files = read_checkpoint(Path(resume))
    diff = identity_diff(msgspec.convert(man.identity, RunIdentity), identity)
    ranks = [d for d in diff if d.startswith(("world_size:", "backend:"))]
    if ranks:   # a checkpoint holds one farm a rank: no drift flag can give a rank its battles (design 3.10)
        raise IdentityMismatch(
            f"refusing to resume {resume}: {'; '.join(ranks)}. A checkpoint resumes with the world size "
            f"and backend it was saved with, even under --allow-identity-drift: "
            f"{resume_command(path, msgspec.convert(man.identity, RunIdentity).world_size)}")
    if diff and not allow_drift:
        raise IdentityMismatch(f"refusing to resume {resume}: the identity differs in {len(diff)} field(s): "
                               + "; ".join(diff) + ". Undo the change, or pass --allow-identity-drift "
                               "(writes drift.json and marks every later row).")
    if diff:
        (path / "drift.json").write_bytes(canonical_json({"checkpoint": str(resume), "differences": diff}))
    for line in config_diff(man.config, args):   # the excluded fields: printed, allowed
        print(f"resume: config differs from the checkpoint's: {line}")
    restore_learner(learner, files)
    if not quiet:
        print(f"resumed {resume} at iteration {learner.iteration}; state_digest {man.state_digest[:16]}")
    saved = saved_boundary(files, 0)
    # after every refusal above: a refused resume moves nothing
    for line in set_aside_damaged(path) + cut_back(path, man, saved["start_ordinals"]):
        print(line)
    return Run(args, path, identity, man.run_id, quiet, t_start, drifted=(path / "drift.json").exists(),
               last_saved=learner.env_steps, lock=lock, **saved)


def free_side(path: Path, tag: str) -> Path:
    """Where `path` is set aside, beside it: <name><tag>, or <name>-2<tag>, -3, ... when taken."""
    side, n = path.with_name(path.name + tag), 1
    while side.exists():
        n += 1
        side = path.with_name(f"{path.name}-{n}{tag}")
    return side


def set_aside_unsaved(path: Path) -> None:
    """The same command again, for the run folder it already made. One with a checkpoint is never
    touched: refused, naming the resume command. One that stopped before its first checkpoint (a
    crash, a kill -9) holds nothing a resume can start from, so it is moved aside whole, kept, to
    <path>.no-checkpoint (free_side), and the run starts again from its start; one
    still training is refused by hold_run, whose lock a live run holds."""
    if latest_checkpoint(path) is not None:
        raise ConfigError(f"{path} exists: a run with this identity was started before. Continue it with "
                          f"python {SCRIPT} --resume {path}, or start another with a new --run-name "
                          "or --master-seed")
    lock = hold_run(path)
    side = free_side(path, ".no-checkpoint")
    try:
        path.rename(side)
    finally:
        lock.close()
    print(f"{path} holds no checkpoint a resume can start from (it stopped before its first): moved to "
          f"{side.name}, and the run starts again from its start")


def check_writable(path: Path, name: str) -> None:
    """`path` must be a folder this process can write in, or one it can make: its nearest existing
    folder (itself or an ancestor) is a folder, not a file, and writable (os.access says no on a
    read-only mount, root included). Read only: nothing is made here."""
    try:
        there = next(q for q in (path.absolute(), *path.absolute().parents) if q.exists())
        if not there.is_dir():
            raise ConfigError(f"{name} {path}: {there} is a file, not a folder; "
                              "pass a folder (made if absent)")
        if not os.access(there, os.W_OK | os.X_OK):
            raise ConfigError(f"{name} {path}: {there} is not writable (a read-only disk, or another user's "
                              "folder); pass a folder you can write in")
    except OSError as e:   # a name the file system refuses to look up (too long, say)
        raise ConfigError(f"{name} {path}: cannot be looked up ({e.strerror}); pass another folder") from None


# A disk that takes no more writes, anywhere in a run: full, over a quota, or mounted read-only.
DISK_FAULTS = {errno.ENOSPC: "is full", errno.EDQUOT: "is over its quota", errno.EROFS: "is read-only"}


def disk_fault(exc: BaseException | None, where: Path | str) -> str | None:
    """The remedy when `exc`, or an exception it came from, is a disk that takes no more writes
    (DISK_FAULTS), naming the file it failed on (`where`, the run folder, when the error does not
    name one: a write to a file already open); None for any other exception."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in DISK_FAULTS:
            return (f"the disk holding {exc.filename or where} {DISK_FAULTS[exc.errno]}: free space on it "
                    "(or remount it writable), or move the run to a disk with room")
        exc = exc.__cause__ or exc.__context__
    return None


class StopSignals:
    """Ctrl-C and SIGTERM as the control file's quit (design 10.3): the first asks the loop to
    checkpoint and stop at the end of the iteration in flight (`asked` reads "q" from then on);
    a second stops now, as a KeyboardInterrupt, through the emergency path. The farm's workers
    ignore SIGINT, so a terminal's Ctrl-C reaches the parent alone. Signals can be caught only
    on the main thread; elsewhere (a run started from a thread) nothing is installed."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.asked, self.saved = "", {}
        if threading.current_thread() is threading.main_thread():
            self.saved = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = "q"
        print(f"\n{signal.Signals(signum).name}: checkpoint and stop at the end of this iteration; "
              "send it again to stop now", file=sys.stderr, flush=True)

    def restore(self) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        self.saved = {}


class RunCrashed(RuntimeError):
    """The loop stopped on an exception or a second Ctrl-C: one line for the person (what, where,
    the traceback's file, the resume command); the original is its __cause__."""

    def __init__(self, line: str, interrupted: bool) -> None:
        super().__init__(line)
        self.interrupted = interrupted


def emergency_save(run: Run, learner: Learner, source: Any, lad: ladder.LadderLoop,
                   exc: BaseException) -> Path | None:
    """On a crash or a second Ctrl-C (design 10.3): only a learner on an iteration boundary can be
    resumed, so save while collecting (the learner is still the last boundary's, and so is the
    saved boundary) or after the row, never halfway through an update. The save must not hide
    the original failure. Returns the checkpoint written, or None."""
    if (isinstance(exc, AlarmHalt) or learner.sched is None or run.phase == "learn"
            or run.last_saved == learner.env_steps):
        return None
    if disk_fault(exc, run.path):   # the write would fail too, leaving a .partial: the last checkpoint stands
        return None
    if learner.comm.on:   # every rank's farm would have to answer, and a failed rank cannot (design 3.10)
        return None
    try:
        return save_checkpoint(run, learner,
                               run.boundary if run.phase == "collect" else boundary_now(source, lad))
    except Exception as e2:
        print(f"emergency checkpoint failed: {e2!r}", file=sys.stderr)
        return None


def crash_line(run: Run, learner: Learner, exc: BaseException, saved: Path | None) -> str:
    """The full traceback appended to <run>/crash-iteration-<k>.txt (k the iteration in flight,
    numbered as its row: a gate after iteration k's update is k's, not k + 1's; appended, so a
    second crash there loses nothing), and the one line that names it."""
    k, comm = run.iteration or learner.iteration + 1, learner.comm
    path = run.path / (f"crash-iteration-{k}-rank-{comm.rank}.txt" if comm.on else f"crash-iteration-{k}.txt")
    try:
        with path.open("a") as f:
            f.write(f"--- {ladder.utc_now()} iteration {k}, phase {run.phase}\n"
                    + "".join(traceback.format_exception(exc)))
        told = f"full traceback in {path}"
    except OSError as e:   # the disk that failed the run fails this too: the line is all there is
        told = f"no traceback written ({path}: {e.strerror})"
    what = "interrupted (a second Ctrl-C)" if isinstance(exc, KeyboardInterrupt) else "crashed"
    said = "; ".join(x for x in [(str(exc).strip().splitlines() or [""])[0], disk_fault(exc, run.path)] if x)
    last = saved or latest_checkpoint(run.path)
    kept = (None if last is None else f"emergency checkpoint {last}" if saved
            else f"the last checkpoint is {last}")
    resume = (f"{kept}; resume: {resume_command(run.path, comm.world)}" if kept else
              f"no checkpoint yet: the same command, or {resume_command(run.path, comm.world)}, "
              "starts it again from its start")
    return (f"{f'rank {comm.rank} ' if comm.on else ''}{what} in iteration {k} ({run.phase}): "
            f"{type(exc).__name__}{': ' + said if said else ''}; {told}; {resume}")


def hold_run(path: Path) -> Any:
    """The run's training lock, an exclusive flock on <run>/train.lock held by the process that
    trains the run (rank 0 under torchrun) and released when it ends, however it ends (a SIGKILL
    included: the OS drops the lock with the process). A second trainer, a --resume of a run that
    is still training, is refused before it writes: two processes appending to one run's logs
    interleave their rows (design 2.4 item 6). The file names the holder for that refusal."""
    f = open(path / "train.lock", "a+")
    if not ladder.lock_file(f, wait=False):
        f.seek(0)
        holder = f.read().strip() or "a process"
        f.close()
        raise ConfigError(f"{path} is being trained by {holder}: stop it first "
                          f"(`echo q > {path / 'control'}` stops it at its iteration's end, "
                          "with a checkpoint), then resume it")
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {platform.node()}")
    f.flush()
    return f


def resume_command(run: Path, world: int) -> str:
    """The command that continues a run: under torchrun with its own world size (design 3.10)."""
    launch = f"torchrun --nproc-per-node {world}" if world > 1 else "python"
    return f"{launch} {SCRIPT} --resume {run}"


def rank_file(name: str, rank: int) -> str:
    """Where rank r's part of the boundary lies in a checkpoint: rank 0's at its one-process name,
    rank r's under rank-<r>/ (design 3.10)."""
    return name if rank == 0 else f"rank-{rank}/{name}"


def saved_boundary(files: dict[str, bytes], rank: int) -> dict[str, Any]:
    """A rank's farm and matchmaker as its checkpoint left them: the Run's start_* arguments."""
    rollout = json.loads(files[rank_file("rollout/state.json", rank)])
    ladder_state = files.get(rank_file("ladder/state.json", rank))
    return {"start_ordinals": rollout["ordinals"],
            "start_generations": rollout.get("generations"),   # absent: generation 0
            # absent (an older checkpoint): its battles start their episodes again
            "start_in_flight": msgspec.json.decode(
                files.get(rank_file("rollout/in_flight.json", rank), b"[]"), type=list[farm.InFlight]),
            "ladder_saved": json.loads(ladder_state) if ladder_state is not None else None}


def follow_run(args: Args, env: Env, learner: Learner, path: Path, rid: str, voice_identity: RunIdentity,
               resume: Path | None, quiet: bool, t_start: float, rank: int) -> Run:
    """A torchrun rank other than 0 (design 3.10): the run rank 0 opened (rank 0 has refused a
    resume whose identity differs, world size included), written by rank 0 alone. Its own
    identity must be rank 0's (the same code, packages and device kind on every node). A resume
    restores this rank's learner, the same as every rank's, and its own farm and matchmaker."""
    identity = compute_identity(args, env)
    diff = identity_diff(voice_identity, identity)
    if diff:
        raise IdentityMismatch(f"rank {rank} is not running what rank 0 runs: {'; '.join(diff)}; "
                               "every node needs the same code, packages and device kind")
    if resume is None:
        return Run(args, path, identity, rid, quiet, t_start, rank=rank)
    _, files = read_checkpoint(Path(resume))
    restore_learner(learner, files)
    return Run(args, path, identity, rid, quiet, t_start, rank=rank, last_saved=learner.env_steps,
               **saved_boundary(files, rank))


class Run:
    """The run's directory and what is written into it while training (design 9): the metrics,
    episodes and alarms files, the sinks, the alarm set and the tails a halt's bundle reads; and
    where the loop stands, for an emergency save: its phase and the boundary it started from."""

    def __init__(self, args: Args, path: Path, identity: RunIdentity, rid: str, quiet: bool, t_start: float,
                 *, drifted: bool = False, start_ordinals: list[int] | None = None,
                 ladder_saved: dict[str, Any] | None = None, last_saved: int = -1,
                 start_generations: list[int] | None = None, start_in_flight: list[Any] | None = None,
                 rank: int = 0, lock: Any = None) -> None:
        self.args, self.path, self.identity, self.rid, self.quiet, self.t_start = \
            args, path, identity, rid, quiet, t_start
        self.drifted, self.start_ordinals, self.ladder_saved, self.last_saved = \
            drifted, start_ordinals, ladder_saved, last_saved
        self.start_generations, self.start_in_flight = start_generations, start_in_flight
        # a torchrun rank other than 0 opens no file and no sink: rank 0 writes the run (design 3.10)
        self.rank, self.voice = rank, rank == 0
        self.lock = lock   # hold_run's file: the run is this process's to write until close()
        voice = self.voice
        self.files = {name: open(path / f"{name}.jsonl", "ab") for name in ("metrics", "episodes", "alarms")
                      if voice}
        # lines in each log, kept as rows are written, so a checkpoint records what it covers without
        # rereading the logs (design 8.1)
        self.lines = {name: count_lines(path / f"{name}.jsonl") for name in self.files}
        self.alarms = AlarmSet(alarm_table(args))
        self.viser = ViserSink.from_env() if args.metrics.viser and voice else None
        self.wandb = (WandbSink(args.metrics.wandb_project, path, json.loads(config_json(args)),
                                msgspec.to_builtins(identity)) if args.metrics.wandb and voice else None)
        self.tb = TensorBoardSink(path) if args.metrics.tensorboard and voice else None
        self.tail: list[dict[str, Any]] = []      # the last fifty rows
        self.ep_tail: list[Any] = []              # the last twenty EpisodeRecords
        self.alarm_rows: list[dict[str, Any]] = []   # this iteration's alarms
        if self.lines.get("metrics"):
            # a resume: the rows on disk are the checkpoint's (cut_back ran), so replaying them
            # gives each alarm the patience count the unbroken run had, and a halt's bundle its tail
            rows = [json.loads(x) for x in (path / "metrics.jsonl").read_bytes().splitlines()]
            for row in rows:
                self.alarms.evaluate(row)
            self.tail = rows[-50:]
        self.phase, self.boundary = "boundary", Boundary([], {})
        self.iteration = 0   # the iteration the loop is in, numbered as its row will be (crash_line)
        self.stop: StopSignals | None = None   # installed when the loop starts (announce)
        self.progress = not quiet and voice and sys.stdout.isatty()   # a log file gets no progress lines
        # time/iteration runs row to row, so the checkpoint written after a row lands in the next
        # row's split (t_ckpt)
        self.t_row, self.t_ckpt = time.perf_counter(), 0.0

    def announce(self, env: Env) -> None:
        a = self.args
        if not self.quiet and self.voice:
            horizon = credit_horizon_seconds(a.obs.decision_ms, a.advantage.gamma.value(0),
                                             a.advantage.gae_lambda)
            print(f"run {self.path}  T={env.T} R={env.R} learner_rows={env.learner_rows} device={env.device} "
                  f"credit_horizon={horizon:.1f}s")
        self.stop = StopSignals()   # from here on a signal is a request, not an exit
        self.t_row = time.perf_counter()

    def between_cycles(self, iteration: int, t: int, T: int, rounds: int, seconds: float) -> None:
        """A pause the control file asks for (a "c" or "q" waits for the boundary); a person's
        progress line, overwritten in place; and the viewer's hello answered."""
        if self.voice:
            wait_while_paused(self.path / "control", self.quiet)
        if self.progress and t % max(T // 20, 1) == 0:
            print("\r" + progress_line(iteration, t, T, rounds, seconds), end="", flush=True)
        if self.viser is not None:
            self.viser.pump()

    def record(self, row: dict[str, Any], episodes: Sequence[Any]) -> list[tuple[Alarm, float]]:
        """The row and the episodes to disk and the sinks, then the alarms: after the row is on
        disk, so a halt checkpoints the learner the row describes."""
        check_row_schema(row)
        self.files["metrics"].write(msgspec.json.encode(row) + b"\n")
        self.files["metrics"].flush()
        self.files["episodes"].write(b"".join(msgspec.json.encode(e) + b"\n" for e in episodes))
        self.files["episodes"].flush()
        first_line = self.lines["episodes"]   # episodes[0]'s 0-based line in episodes.jsonl
        self.lines["metrics"] += 1
        self.lines["episodes"] += len(episodes)
        if self.viser is not None:
            self.viser.write(row, self.path.name)
        if self.wandb is not None:
            self.wandb.write(row)
        if self.tb is not None:
            self.tb.write(row)
        if self.progress:
            print("\r\x1b[K", end="")   # clear the progress line before the block
        self.t_row, self.t_ckpt = self.t_row + row["time/iteration"], 0.0
        self.tail = (self.tail + [row])[-50:]
        self.ep_tail = (self.ep_tail + list(episodes))[-20:]
        fired = self.alarms.evaluate(row)
        it = row["run/iteration"]
        self.alarm_rows = alarm_rows(it, fired, episodes, first_line)
        if not self.quiet:
            print(console_block(row, fired, full=self.args.metrics.console_full), flush=True)
            for (a, v), ar in zip(fired, self.alarm_rows, strict=True):
                print(f"ALARM {a.severity} {a.name}: {a.key} = {v:.4g} {a.op} {a.threshold:g} -- {a.meaning}")
                if ar.get("winning_episodes"):
                    n = ar["winning_episodes"][0]
                    print(f"  winning episodes (lines of episodes.jsonl): {ar['winning_episodes']}; "
                          f"watch one: python checks.py replay {self.path} --episode {n} "
                          f"--trace episode-{n}.msgpack")
        self.files["alarms"].write(b"".join(msgspec.json.encode(x) + b"\n" for x in self.alarm_rows))
        self.files["alarms"].flush()
        self.lines["alarms"] += len(self.alarm_rows)
        return fired

    def rows_covered(self) -> dict[str, int]:
        """The lines of each run log a checkpoint saved now covers (Manifest.rows). games.jsonl is
        counted on disk: `ladder.py eval|gate` may append to it too."""
        return {**{f"{name}.jsonl": n for name, n in self.lines.items()},
                "ladder/games.jsonl": count_lines(ladder.ResultLog(self.path).path)}

    def halt_if_asked(self, learner: Learner, source: Any, lad: ladder.LadderLoop,
                      halts: list[tuple[Alarm, float]], outliers: list[dict[str, Any]]) -> None:
        """A halting alarm stops the run after its row is on disk, with a checkpoint of the learner
        the row describes and a diagnostic bundle beside it (design 9.4)."""
        if not halts:
            return
        ck = save_checkpoint(self, learner, boundary_now(source, lad))
        (alarm, value), it = halts[0], learner.iteration
        if not self.voice:
            raise AlarmHalt(f"halted at iteration {it} by {alarm.name}: rank 0 says why")
        bundle = write_bundle(self.path, it, alarm, value, self.tail, ck, self.args, self.identity,
                              episodes=self.ep_tail, alarm_rows=self.alarm_rows, ratio_outliers=outliers,
                              episode_lines=self.lines["episodes"])
        raise AlarmHalt(f"halted at iteration {it} by {alarm.name} ({alarm.key} = {value:.4g}); checkpoint "
                        f"{ck}; bundle {bundle}; resume: {resume_command(self.path, learner.comm.world)} "
                        f"--checkpoint {ck}")

    def crashed(self, learner: Learner, source: Any, lad: ladder.LadderLoop, exc: BaseException) -> NoReturn:
        """The loop's exception, raised on: a halt as it is (its own row, checkpoint and bundle, design
        9.4); anything else, after an emergency save where one can be made, as RunCrashed, the one line
        that names it (crash_line), from the original."""
        saved = emergency_save(self, learner, source, lad, exc)
        if isinstance(exc, AlarmHalt):
            raise exc
        raise RunCrashed(crash_line(self, learner, exc, saved), isinstance(exc, KeyboardInterrupt)) from exc

    def save_at_limit(self, learner: Learner, boundary: Boundary) -> None:
        """The loop's end at its limit: a checkpoint on the way out unless the last save holds it."""
        if self.last_saved != learner.env_steps:
            save_checkpoint(self, learner, boundary)

    def timed_save(self, learner: Learner, boundary: Boundary) -> None:
        """A checkpoint on the cadence, then pruning; its time goes into the next row."""
        t0 = time.perf_counter()
        save_checkpoint(self, learner, boundary)
        if self.voice:
            prune_checkpoints(self.path, self.args.checkpoint.keep)
        self.t_ckpt = time.perf_counter() - t0

    def say_stopped(self, learner: Learner) -> None:
        if not self.voice:
            return
        print(f"stopped after iteration {learner.iteration} as asked, "
              f"checkpoint {latest_checkpoint(self.path)}; "
              f"resume: {resume_command(self.path, learner.comm.world)}", file=sys.stderr)

    def close(self) -> None:
        if self.stop is not None:
            self.stop.restore()
        for f in self.files.values():
            # record() flushes each row, so a close writes nothing but what a failed write left in
            # the buffer: on a full disk that fails again, and the crash line already says why
            with contextlib.suppress(OSError):
                f.close()
        if self.viser is not None:
            self.viser.close()
        if self.wandb is not None:
            self.wandb.close()
        if self.tb is not None:
            self.tb.close()
        if self.lock is not None:   # last: every log above is closed
            self.lock.close()


# The run's start. train() is the entry point: the arguments held to the rules, the disk checked,
# torchrun's ranks joined, then the loop (_train, section 8). set_up builds, once and in order, what
# the loop reads: the env, the Learner, the start-up gates, the warm start, the Run, the ladder and
# the farm.

def train(args: Args, *, max_iterations: int | None = None, quiet: bool = False, resume: Path | None = None,
          allow_identity_drift: bool = False) -> Path:
    """Train until args.timestep_limit learner transitions (or max_iterations); return the run
    directory. With `resume` (a checkpoint folder) the run continues in its own directory: the
    identity must equal the checkpoint's field for field (design 2.4), and the learner, the RNG,
    the farm's episode ordinals and the ladder are restored. The process-wide determinism settings
    are put back on the way out, so a caller in the same process (a test, checks.py) keeps its own."""
    check_consistency(args)   # design 1.3: an Args built in code is held to the rules the command line is
    # where the run will write, before the start-up gates' seconds: a file, or a read-only disk, in its way
    check_writable(Path(resume).parent.parent if resume else Path(args.runs_dir),
                   "--resume" if resume else "--runs-dir")
    comm = open_comm(args)    # torchrun's ranks, or SOLO (design 3.10)
    try:
        with process_settings_kept():
            path = _train(args, max_iterations, quiet, resume, allow_identity_drift, comm)
        if comm.on:   # no rank tears gloo down while a peer's last exchange with it is in flight
            import torch.distributed as dist
            dist.barrier()
        return path
    finally:
        close_comm(comm)


class Setup(NamedTuple):
    """What train() builds once, before its first iteration, and the loop reads."""
    env: Env
    learner: Learner
    run: Run
    lad: ladder.LadderLoop
    opening: list[Any] | None    # the farm's opening assignment table (a resume's), else None
    source: Any                  # the farm: farm.ProcessFarm or farm.InlineFarm
    view: RectView


def set_up(args: Args, quiet: bool, resume: Path | None = None, allow_drift: bool = False,
           t_start: float | None = None, comm: Comm | None = None) -> Setup:
    """Everything train() does once, in order (design 10.1); checks.py bench builds its rig with it.
    Under torchrun rank 0 opens the run and its ladder first; the other ranks then follow it."""
    comm = SOLO if comm is None else comm
    apply_determinism(args)                   # design 2.1: before the first tensor exists
    stale = farm.stale_segments_line(farm.remove_stale_segments())   # a dead run's shared memory (design 3.7)
    if stale and not quiet and comm.voice:
        print(stale, flush=True)
    env = read_env(args, comm)                # geometry, codec table and T x R, read off a reset env
    check_gates([ram_gate(args, env, parameter_count(args, env))])  # design 3.8 step 9, before any allocation
    learner = Learner(args, env, comm)        # the network, its optimizers, scaler, backoff, positions
    # before any long step
    seeds = check_seeds(args, env, learner.model) if comm.voice and resume is None else []
    run_startup_gates(args, env, learner.model, quiet or not comm.voice)   # design 3.8
    # a warm start (WarmArgs) makes v0 the clone of a scripted rung; every rank clones alike
    cloned = (warm_start(args, env, learner.model, quiet or not comm.voice)
              if resume is None and args.warm.rung else None)
    t0 = time.perf_counter() if t_start is None else t_start
    if comm.voice:
        run = open_run(args, env, learner, resume, allow_drift, quiet, t0)    # identity; a resume restores
    else:
        path, rid, identity, shared = comm.share(None)   # after rank 0 wrote the run, its seeds and v0
        run = follow_run(args, env, learner, Path(path), rid, identity, resume, quiet, t0, comm.rank)
    try:   # from here a failure closes the run's files and lets go of its training lock
        learner.warm_steps = int(cloned["game_steps"]) if cloned is not None else warm_game_steps(run.path)
        if comm.voice:
            if cloned is not None:
                (run.path / "warm.json").write_bytes(msgspec.json.format(canonical_json(cloned)))
            lad = ladder.LadderLoop(args, NETS, run.path, run.rid, args.master_seed, env.n_battles, env.spec,
                                    env.table, env.device, env.seed)
            # v0 and the seeds, or the checkpoint's pool
            opening = start_ladder(lad, run, learner, env, seeds)
            comm.share((str(run.path), run.rid, run.identity, lad.shared()))
        else:
            lad = ladder.LadderLoop(args, NETS, run.path, run.rid, args.master_seed, env.n_battles, env.spec,
                                    env.table, env.device, env.seed, voice=False)
            opening = lad.load(run.ladder_saved) if run.ladder_saved is not None else None
            lad.follow(shared)
        lad.join(comm)
        # v0's snapshot, the clone in fp16: a fresh run, a resume, every rank alike
        if teacher_on(args.warm):
            v0 = lad.store.load(lad.pool.snapshot_id(lad.pool.v0))
            learner.teacher = actor_from_snapshot(*v0, env.device)
            learner.teacher.requires_grad_(False)
        source = open_farm(args, env, run.start_ordinals, lad.assign, lad.mm.roles, run.start_generations,
                           run.start_in_flight)
    except BaseException:
        run.close()
        raise
    view = RectView(source.rect, env, args.obs.frame_stack)
    view.resume(run.start_in_flight or [])   # the battles the farm re-simulated are mid-episode
    return Setup(env, learner, run, lad, opening, source, view)


def apply_determinism(args: Args) -> None:
    """Determinism tier run_exact (design 2.1): deterministic kernels, no tf32, fixed thread count."""
    torch.set_num_threads(args.determinism.torch_threads)
    if args.determinism.tier == "run_exact":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        deterministic_kernels(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def read_env(args: Args, comm: Comm | None = None) -> Env:
    """Build one env, reset it, and read off it everything the run needs: the codec table, the
    network's geometry, the engine's digests; then size the rectangle (T cycles of R slots) so an
    iteration holds ppo.timesteps_per_iteration learner rows (a rank's: the profile's rollout
    numbers are per rank). Under torchrun rank r's battles, acting uniforms and matchmaking draw
    from master seed derive_int(master_seed, "rank/{r}"): the rank is in every stream's path, so
    no two ranks play the same battle (design 3.10)."""
    comm = SOLO if comm is None else comm
    device = resolve_device(args)
    k, seed = args.obs.frame_stack, args.master_seed
    spec = farm.default_env_spec(reveal_spell_aim="enemy_spell_aim" in args.obs.reveal,
                                 max_steps=args.obs.max_steps or None, reward=reward_spec(args.reward))
    spec = msgspec.structs.replace(spec, decision_ms=args.obs.decision_ms)
    try:
        env_spec, table, statics, geo, eng_cfg, cards = env_reading(msgspec.json.encode(spec), k, seed)
    except RuntimeError as e:   # design 3.8 step 1: a stale engine build refuses here, before cycle 0
        refusal = stale_build_refusal(e)
        if refusal is None:
            raise
        raise refusal from e
    deal_check(args.ladder.seat_decks, cards)
    n_battles = args.rollout.workers * args.rollout.games_per_worker
    # sizing only: the learner's row count follows from the roles, not from the pool
    mm = ladder.Matchmaker(seed, n_battles, ladder.match_config(args.ladder))
    learner_rows = ladder.learner_rows(mm.plan(0, [0] * n_battles, ladder.Pool(), None))
    facts = EnvFacts(engine_build=engine_build_from_config(eng_cfg, "RustEngine"),
                     env_spec_digest=env_spec.env_value_digest, obs_digest=env_spec.obs_digest,
                     action_digest=sha256_hex(canonical_json({"n_actions": geo.n_actions, "tiles": geo.tiles,
                                                              "hand_size": geo.hand_size})),
                     codec_version=codec.CODEC_VERSION, codec_table_digest=table.digest(),
                     royalegym_version=_pkg_version("royalegym"))
    return Env(spec=spec, table=table, statics=torch.tensor(statics, device=device), geo=geo, facts=facts,
               device=device, n_battles=n_battles, R=2 * n_battles,
               T=-(-args.ppo.timesteps_per_iteration // learner_rows), learner_rows=learner_rows,
               n_shards=args.rollout.workers * args.rollout.shards_per_worker,
               seed=derive_int(seed, f"rank/{comm.rank}") if comm.on else seed, world=comm.world,
               rank=comm.rank, backend=comm.backend, card_names=tuple(c.name for c in cards))


class EnvReading(NamedTuple):
    env_spec: Any              # farm.EnvSpec, read off the preflight's env
    table: Any                 # codec.CodecTable decided from its sample
    statics: np.ndarray        # a reset env's static planes (read-only: every run copies them)
    geo: NetGeometry
    engine_config: dict[str, Any]
    cards: tuple[Any, ...]     # the engine's catalogue, by card id


@functools.lru_cache(maxsize=4)
def env_reading(spec_json: bytes, frame_stack: int, master_seed: int) -> EnvReading:
    """What read_env reads off built envs (the preflight, then one reset env). A pure function of
    the env's spec, the frame stack and the seed, so a process that reads the env more than once
    (checks.py learn before its run, verify-resume, a test session) builds these envs once: 1.0-1.1 s
    of CPU a read on a 2-core machine [M, docs/throughput.md]. Like ladder._eval_preflight for the
    evaluation env."""
    spec = msgspec.json.decode(spec_json, type=farm.EnvFactorySpec)
    env_spec, table = farm.preflight(spec, frame_stack=frame_stack, master_seed=master_seed)
    vec = farm.build_vec(spec, 1)
    obs0, _ = vec.reset(seed=0)
    statics = codec.static_planes(table, obs0)
    statics.setflags(write=False)
    geo = geometry_from_env(vec.single_observation_space, vec.envs[0].obs_builder, frame_stack)
    reading = EnvReading(env_spec, table, statics, geo, vec.envs[0].config(),
                         tuple(sorted(vec.envs[0].engine.cards(), key=lambda c: c.card_id)))
    vec.close()
    return reading


def reward_spec(reward: RewardArgs) -> farm.ComponentSpec | None:
    """The env's reward with the weights that differ from farm.REWARD_WEIGHTS (None: the default
    reward, so a run at the defaults keeps its env spec, and its id)."""
    kw = {k: w for k, w in dataclasses.asdict(reward).items() if w != farm.REWARD_WEIGHTS[k]}
    return farm.ComponentSpec("farm.default_potential_reward", kw) if kw else None


def start_ladder(lad: ladder.LadderLoop, run: Run, learner: Learner, env: Env,
                 seeds: Sequence[Any]) -> list[Any] | None:
    """A resumed run restores the pool and returns the saved assignment table (the farm's opening
    plan). A new run admits v0, the initial actor, as the first champion, so the pool and the
    gauge exist from the first iteration (design 7.4), and its seed snapshots (`seeds`: their
    specs, check_seeds)."""
    if run.ladder_saved is not None:
        return lad.load(run.ladder_saved)
    # with seed snapshots the training pool is theirs (design 7.3): v0 is the champion, not drawn
    lad.admit(lad.snapshot(learner.model, learner.env_steps, env.facts.action_digest), learner.env_steps,
              promote=True, sample=not seeds)
    lad.admit_seeds(seeds)
    return None


def check_seeds(args: Args, env: Env, model: ActorCritic) -> list[Any]:
    """design 7.3: each of ladder.seed_snapshots read before the run directory exists, so a wrong
    one stops with nothing written: its weights must hash to the sha256 the config pins and its
    spec carry this run's arch, observation (the evaluation env's) and codec table digests.
    Returns their specs, in order."""
    if not args.ladder.seed_snapshots:
        return []
    es, _, _ = ladder._eval_preflight(msgspec.json.encode(ladder.eval_env_spec(env.spec)), args.master_seed)
    expect = {"arch_digest": arch_digest(model.geo, model.net), "obs_digest": es.obs_digest,
              "codec_table_digest": env.table.digest()}
    specs = []
    for i, sd in enumerate(args.ladder.seed_snapshots):
        try:
            specs.append(ladder.check_seed(f"ladder.seed_snapshots[{i}] (seed:{sd.name})", sd.path, sd.sha256,
                                           expect))
        except ladder.SnapshotMismatch as e:
            raise ConfigError(str(e)) from None
    return specs


def open_farm(args: Args, env: Env, start_ordinals: list[int] | None, assign: Any, roles: np.ndarray,
              start_generations: list[int] | None = None, start_in_flight: list[Any] | None = None) -> Any:
    """The farm of workers (process) or its byte-identical reference (inline), T cycles deep;
    roles: the battles' (the matchmaker's), which seat_deals deals by."""
    r = args.rollout
    cfg = farm.FarmConfig(env=env.spec, master_seed=env.seed, workers=r.workers,
                          shards_per_worker=r.shards_per_worker, games_per_worker=r.games_per_worker,
                          cycles=env.T, frame_stack=args.obs.frame_stack, spin_us=r.spin_us,
                          round_timeout_s=r.round_timeout_s, launch_delay_s=r.launch_delay_s,
                          max_restarts_per_worker=r.max_restarts_per_worker,
                          viewer=r.source == "process" and args.metrics.viser and env.rank == 0,
                          start_ordinals=start_ordinals,
                          start_generations=start_generations, start_in_flight=start_in_flight or None,
                          deals=seat_deals(args.ladder.seat_decks, roles))
    return (farm.InlineFarm if r.source == "inline" else farm.ProcessFarm)(cfg, env.table, assign)


def _pkg_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


# --- 10. Checkpoints (design 8) -----------------------------------------------------------------
# Atomic: every file goes into <dir>.partial/, is fsynced, and the manifest (a sha256 per file)
# is written last; then one os.replace makes it the checkpoint. A crash mid-write leaves the
# previous checkpoint intact and the partial obviously named. Tensors are safetensors; every
# other thing is JSON. Optimizer state is split into its tensors (safetensors) and its scalars
# and param groups (JSON), so nothing we write is a pickle.

CHECKPOINT_FORMAT = 1


class CheckpointFormatError(ValueError):
    """A checkpoint that cannot be trusted: names the file and what is wrong with it."""


class Manifest(msgspec.Struct):
    format_version: int
    run_id: str
    run_name: str
    identity: dict[str, Any]
    config: dict[str, Any]
    config_hash: str
    iteration: int
    cumulative_env_steps: int
    cumulative_timesteps: int
    cumulative_model_updates: int
    wall_seconds: float
    created_unix_ns: int
    state_digest: str
    component_versions: dict[str, int]
    files: dict[str, str]
    rows: dict[str, int] | None = None   # lines of each RUN_LOGS file it covers; None: not recorded


def save_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save
    return save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def load_tensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load
    return load(data)


def optimizer_files(opt: Adam) -> tuple[bytes, bytes]:
    """(safetensors of every state tensor, JSON of param groups and non-tensor state)."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v
            else:
                scalars[f"{pid}.{k}"] = v
    meta = {"param_groups": sd["param_groups"], "scalars": scalars, "state_ids": sorted(sd["state"])}
    return save_tensors(tensors), canonical_json(meta)


def load_optimizer(opt: Adam, tensor_bytes: bytes, meta_bytes: bytes) -> None:
    tensors, meta = load_tensors(tensor_bytes), json.loads(meta_bytes)
    state: dict[int, dict[str, Any]] = {int(i): {} for i in meta["state_ids"]}
    for key, v in tensors.items():
        pid, k = key.split(".", 1)
        state[int(pid)][k] = v
    for key, v in meta["scalars"].items():
        pid, k = key.split(".", 1)
        state[int(pid)][k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def write_checkpoint(final_dir: Path, files: dict[str, bytes], manifest_fields: dict[str, Any]) -> Manifest:
    """Write `files` (relative path -> bytes) and a manifest hashing each, atomically."""
    final_dir = Path(final_dir)
    partial = final_dir.with_name(final_dir.name + ".partial")
    if partial.exists():
        import shutil
        shutil.rmtree(partial)
    hashes = {}
    for rel, data in sorted(files.items()):
        ladder.write_atomic(partial / rel, data)
        hashes[rel] = sha256_hex(data)
    man = Manifest(format_version=CHECKPOINT_FORMAT, files=hashes, **manifest_fields)
    ladder.write_atomic(partial / "manifest.json", msgspec.json.format(canonical_json(man)))
    if final_dir.exists():
        raise CheckpointFormatError(f"{final_dir} already exists; a checkpoint is never overwritten")
    os.replace(partial, final_dir)
    return man


def read_manifest(ckpt_dir: Path) -> Manifest:
    """A checkpoint's manifest.json, decoded; CheckpointFormatError naming the file when it is
    missing or damaged (a truncated write, an edit). The one reader of a manifest."""
    mp = ckpt_dir / "manifest.json"
    if not mp.exists():
        raise CheckpointFormatError(f"{mp} is missing: not a checkpoint, or a write that never finished")
    try:
        return msgspec.json.decode(mp.read_bytes(), type=Manifest)
    except msgspec.DecodeError as e:
        raise CheckpointFormatError(f"{mp} does not decode: {e}") from None


def read_checkpoint(ckpt_dir: Path) -> tuple[Manifest, dict[str, bytes]]:
    """Verify every hash, raising CheckpointFormatError naming the first mismatch (design 8.1)."""
    ckpt_dir = Path(ckpt_dir)
    man, mp = read_manifest(ckpt_dir), ckpt_dir / "manifest.json"
    if man.format_version > CHECKPOINT_FORMAT:
        raise CheckpointFormatError(f"{mp} has format_version {man.format_version}; "
                                    f"this code reads up to {CHECKPOINT_FORMAT}")
    out = {}
    for rel, want in sorted(man.files.items()):
        p = ckpt_dir / rel
        if not p.exists():
            raise CheckpointFormatError(f"{p} is listed in the manifest but missing")
        data = p.read_bytes()
        got = sha256_hex(data)
        if got != want:
            raise CheckpointFormatError(f"{p}: sha256 {got[:16]}... does not match the manifest's "
                                        f"{want[:16]}...; the file changed after it was written. "
                                        f"Resume an earlier checkpoint.")
        out[rel] = data
    return man, out


def state_digest(ac: ActorCritic, optimizers: Sequence[Adam], scaler: WelfordReturnScaler,
                 schedule_positions: dict[str, Any]) -> str:
    """sha256 over, in this fixed order: actor tensors (name-sorted), critic tensors, each
    optimizer's numeric state leaves, the Welford triple, the schedule positions (design 2.4)."""
    h = hashlib.sha256()
    sd = ac.state_dict()
    actor_keys = sorted(k for k in sd if k.startswith(("actor_trunk.", "policy.")))
    critic_keys = sorted(k for k in sd if k not in set(actor_keys))
    for k in actor_keys + critic_keys:
        h.update(k.encode() + b"\0" + sd[k].detach().cpu().contiguous().numpy().tobytes())
    for opt in optimizers:
        st = opt.state_dict()
        for pid in sorted(st["state"]):
            for k in sorted(st["state"][pid]):
                v = st["state"][pid][k]
                h.update(f"{pid}.{k}".encode() + (v.detach().cpu().contiguous().numpy().tobytes()
                                                   if torch.is_tensor(v) else canonical_json(v)))
        h.update(canonical_json([{k: v for k, v in g.items() if k != "params"} for g in st["param_groups"]]))
    h.update(canonical_json(scaler.state()))
    h.update(canonical_json(schedule_positions))
    return h.hexdigest()


class RngState(msgspec.Struct):
    master_seed: int
    torch_cpu: str
    torch_cuda: list[str]
    iteration: int


def capture_rng(master_seed: int, iteration: int) -> RngState:
    """The global torch generators are still captured although nothing here draws from them
    (every draw is name-addressed): a library call that does draw would otherwise break resume
    silently. Python's `random` and numpy's global state are never used (a test scans for it),
    and the minibatch generator is re-derived by name each epoch, so neither needs storing."""
    cuda = ([s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
            if torch.cuda.is_available() else [])
    return RngState(master_seed=master_seed, torch_cpu=torch.get_rng_state().numpy().tobytes().hex(),
                    torch_cuda=cuda, iteration=iteration)


def restore_rng(st: RngState) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(bytes.fromhex(st.torch_cpu)), dtype=torch.uint8))
    if st.torch_cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(bytes.fromhex(s)), dtype=torch.uint8)
                                      for s in st.torch_cuda])


def learner_files(ac: ActorCritic, opt_actor: Adam, opt_critic: Adam,
                  scaler: WelfordReturnScaler, schedules: dict[str, Any], rng: RngState,
                  misc: dict[str, Any]) -> dict[str, bytes]:
    """The learner's share of a checkpoint, in design 8.1's folders."""
    sd = ac.state_dict()
    actor = {k: v for k, v in sd.items() if k.startswith(("actor_trunk.", "policy."))}
    critic = {k: v for k, v in sd.items() if k not in actor}
    oa, oam = optimizer_files(opt_actor)
    oc, ocm = optimizer_files(opt_critic)
    return {
        "actor_critic/actor.safetensors": save_tensors(actor),
        "actor_critic/critic.safetensors": save_tensors(critic),
        "actor_critic/arch.json": canonical_json(arch_description(ac.geo, ac.net)),
        "optimizers/actor_adam.safetensors": oa, "optimizers/actor_adam.json": oam,
        "optimizers/critic_adam.safetensors": oc, "optimizers/critic_adam.json": ocm,
        "optimizers/misc.json": canonical_json(misc),
        "schedules/state.json": canonical_json(schedules),
        "advantage/welford.json": canonical_json(scaler.state()),
        "rng/rng.json": canonical_json(rng),
    }


def load_learner(files: dict[str, bytes], ac: ActorCritic, opt_actor: Adam,
                 opt_critic: Adam,
                 scaler: WelfordReturnScaler) -> tuple[dict[str, Any], RngState, dict[str, Any]]:
    """Inverse of learner_files; refuses a different architecture by name before touching weights.
    Returns (schedule positions, RNG state, misc)."""
    check_arch(json.loads(files["actor_critic/arch.json"]), ac, "actor_critic/arch.json")
    sd = {**load_tensors(files["actor_critic/actor.safetensors"]),
          **load_tensors(files["actor_critic/critic.safetensors"])}
    ac.load_state_dict(sd, strict=True)
    load_optimizer(opt_actor, files["optimizers/actor_adam.safetensors"], files["optimizers/actor_adam.json"])
    load_optimizer(opt_critic, files["optimizers/critic_adam.safetensors"],
                   files["optimizers/critic_adam.json"])
    scaler.load_state(json.loads(files["advantage/welford.json"]))
    rng = msgspec.json.decode(files["rng/rng.json"], type=RngState)
    return json.loads(files["schedules/state.json"]), rng, json.loads(files["optimizers/misc.json"])


class ArchMismatch(ValueError):
    """A load whose saved architecture differs from the model's, named field by field."""


def check_arch(saved: dict[str, Any], model: ActorCritic, what: str) -> None:
    """Refuse weights written by another architecture before touching the model, naming each field."""
    diffs = dict_diff(json.loads(canonical_json(saved)),
                      json.loads(canonical_json(arch_description(model.geo, model.net))))
    if diffs:
        raise ArchMismatch(f"{what} was written by a different architecture (saved -> this model): "
                           f"{'; '.join(diffs)}. "
                           f"Build the network with the saved config, or start a new run.")


def learner_digest(learner: Learner) -> str:
    """state_digest of everything the Learner holds (design 2.4)."""
    return state_digest(learner.model, [learner.opt_a, learner.opt_c], learner.scaler, learner.positions())


def learner_state(learner: Learner, master_seed: int) -> dict[str, bytes]:
    """The Learner as a checkpoint's files (learner_files), its RNG at this iteration included."""
    return learner_files(learner.model, learner.opt_a, learner.opt_c, learner.scaler, learner.positions(),
                         capture_rng(master_seed, learner.iteration),
                         {"cumulative_model_updates": learner.updates})


def restore_learner(learner: Learner, files: dict[str, bytes]) -> None:
    """The inverse of learner_state: weights, moments, scaler, backoff, RNG and the counters."""
    pos, rng, _ = load_learner(files, learner.model, learner.opt_a, learner.opt_c, learner.scaler)
    learner.backoff.load_state(pos["backoff"])
    learner.backoff.apply(learner.opt_a, learner.opt_c)
    restore_rng(rng)
    learner.iteration, learner.env_steps = int(pos["iteration"]), int(pos["env_steps"])
    learner.timesteps, learner.updates = int(pos["timesteps"]), int(pos["updates"])


def save_checkpoint(run: Run, learner: Learner, boundary: Boundary) -> Path:
    """The learner and the boundary it stands on, atomically, under the env step it reached
    (design 8.1). A resumed run that reaches a step the original saved must reach it with the same
    learner: the existing checkpoint is kept and the two state_digests compared."""
    args = run.args
    files = learner_state(learner, args.master_seed)
    # every rank's farm and matchmaker (design 3.10): one process's is rank 0's alone
    for r, b in enumerate(learner.comm.everyone(boundary)):
        files[rank_file("rollout/state.json", r)] = canonical_json({"ordinals": [int(x) for x in b.ordinals],
                                                                    "generations": b.generations})
        files[rank_file("rollout/in_flight.json", r)] = canonical_json(b.in_flight or [])   # design 3.9
        # matchmaker, pool, ratings, residents
        files[rank_file("ladder/state.json", r)] = canonical_json(b.ladder)
    d = run.path / "checkpoints" / f"{learner.env_steps:012d}"
    digest = learner_digest(learner)
    run.last_saved = learner.env_steps
    if not run.voice:
        return d
    # a damaged one was set aside at the resume (set_aside_damaged); read_manifest names any other
    if d.exists():
        old = read_manifest(d).state_digest
        if old != digest:
            raise CheckpointFormatError(f"{d} exists with state_digest {old[:16]} but this run reached "
                                        f"that step with {digest[:16]}: the resume did not reproduce the run")
        return d
    write_checkpoint(d, files, dict(
        run_id=run.rid, run_name=args.run_name, identity=msgspec.to_builtins(run.identity),
        config=msgspec.to_builtins(args), config_hash=sha256_hex(config_json(args)),
        iteration=learner.iteration,
        cumulative_env_steps=learner.env_steps, cumulative_timesteps=learner.timesteps,
        cumulative_model_updates=learner.updates, wall_seconds=time.perf_counter() - run.t_start,
        created_unix_ns=time.time_ns(), state_digest=digest,
        component_versions={"learner": 1, "rollout": 2, "ladder": 1}, rows=run.rows_covered()))
    return d


def scan_checkpoints(run: Path) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
    """A run's checkpoint folders: (env steps, folder) for each whose manifest decodes, fewest steps
    first, and (folder, why) for each whose manifest is missing or damaged. A stray file, a
    .partial a crash left mid-write and a folder set aside as .damaged are neither (design 8.1)."""
    sound, damaged = [], []
    for d in (run / "checkpoints").glob("*"):
        if d.is_dir() and not d.name.endswith((".partial", ".damaged")):
            try:
                sound.append((read_manifest(d).cumulative_env_steps, d))
            except CheckpointFormatError as e:
                damaged.append((d, str(e)))
    return sorted(sound), sorted(damaged)


def latest_checkpoint(run: Path) -> Path | None:
    """The sound checkpoint with the most env steps, by its manifest (scan_checkpoints)."""
    sound = scan_checkpoints(run)[0]
    return sound[-1][1] if sound else None


def set_aside_damaged(run: Path) -> list[str]:
    """At a resume, the run's training lock held: each checkpoint whose manifest is missing or
    damaged is renamed <step>.damaged (kept, never read again: a resumed run that reaches its step
    writes a sound one there). One line each, naming it and why, for the console."""
    out = []
    for d, why in scan_checkpoints(run)[1]:
        side = free_side(d, ".damaged")
        d.rename(side)
        out.append(f"resume: skipped the damaged checkpoint {d} ({why}); set aside as {side.name}")
    return out


def prune_checkpoints(run: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` sound checkpoints by their manifests' env steps; strays, .partial and
    damaged folders are left alone, and a failed removal is reported, never raised (the run goes on)."""
    import shutil
    found = scan_checkpoints(run)[0]
    removed = []
    for _, d in found[:max(len(found) - max(keep, 1), 0)]:
        try:
            shutil.rmtree(d)
            removed.append(d)
        except OSError as e:
            print(f"warning: could not prune {d}: {e}", file=sys.stderr)
    return removed


# --- 11. Metrics, alarms and sinks (design 9) ----------------------------------------------
# One flat row per iteration. The schema is the single source of truth: key -> (unit, description,
# healthy range or None, conditional). The run refuses a row key it does not list
# (check_row_schema), and a test holds every unconditional key to being emitted, so the
# documentation and the code cannot drift. A conditional key whose population is empty (no episode
# ended, say) is never 0: the first env/ and policy/ keys are written as null, every key added
# since is absent (design 7.9's rule).

SCHEMA: dict[str, tuple[str, str, tuple[float, float] | None, bool]] = {
    "run/iteration": ("count", "iterations completed", None, False),
    "run/cumulative_timesteps": ("timesteps", "learner transitions trained on", None, False),
    "run/cumulative_env_steps": ("game-steps", "battle decisions stepped (cadences count these)",
                                 None, False),
    "run/cumulative_updates": ("steps", "optimizer steps taken", None, False),
    "run/world_size": ("ranks", "torchrun's ranks, each collecting its own battles "
                       "(1: one process; design 3.10)", None, False),
    "run/wall_seconds": ("s", "since the process started (wall clock)", None, False),
    "run/gamma": ("", "the discount this iteration (schedule)", None, False),
    "run/gae_lambda": ("", "GAE lambda", None, False),
    "run/credit_horizon_seconds": ("s", "decision_ms / (1 - gamma * lambda)", (40.0, 50.0), False),
    "run/ent_coef": ("", "entropy coefficient this iteration (schedule; "
                     "unread under ppo.entropy_coef_stages)", None, False),
    "run/teacher_kl": ("", "the teacher's KL weight this iteration (warm.teacher_kl's schedule)", None, True),
    "run/ent_coef_noop": ("", "play/wait entropy coefficient this iteration (schedule)", None, False),
    "run/lr_actor": ("", "actor learning rate after any backoff", None, False),
    "run/lr_critic": ("", "critic learning rate after any backoff", None, False),
    "run/lr_backoff": ("bool", "the kl backoff fired this iteration", None, False),
    "run/determinism_tier": ("", "run_exact or throughput (design 2.1)", None, False),
    "run/resumed_with_drift": ("bool", "resumed under --allow-identity-drift", None, False),
    "run/state_digest": ("sha256", "the whole learner: weights, optimizers, scaler, schedules (design 2.4)",
                         None, False),
    "time/iteration": ("s", "wall clock of the iteration", None, False),
    "time/collection": ("s", "rounds from the farm, inference included", None, False),
    "time/critic_pass": ("s", "the cells' legality and the critic pass (every cell, or smdp's)", None, False),
    "time/gae": ("s", "reward scaling, GAE, advantage standardisation", None, False),
    "time/update": ("s", "the PPO update", None, False),
    "throughput/collected_steps_per_second": ("game-steps/s", "env steps over collection time", None, False),
    "ppo/policy_loss": ("", "surrogate over every row, skipped forced rows added back (design 6.5)",
                        None, False),
    "ppo/policy_loss_choice": ("", "surrogate over choice rows: what choice_mean optimises", None, False),
    "ppo/value_loss": ("", "mean squared error against the returns", None, False),
    "ppo/entropy": ("nats", "masked-categorical entropy, choice rows", None, False),
    "ppo/entropy_normalised": ("", "entropy / log(legal actions the policy chooses among), choice rows",
                               None, False),
    "ppo/noop_entropy": ("nats", "play/wait entropy, choice rows", (0.02, 0.7), False),
    "ppo/kl_teacher": ("nats", "KL(clone || actor), choice rows (warm.teacher_kl)", None, True),
    "ppo/entropy_gate": ("nats", "the entropy's wait-or-act term, choice rows (ppo.entropy_coef_stages)",
                         None, True),
    "ppo/entropy_candidate": ("nats", "P(act) x H(card | act), choice rows (ppo.entropy_coef_stages)",
                              None, True),
    "ppo/entropy_tile": ("nats", "P(act) x H(tile | card, act), choice rows (ppo.entropy_coef_stages)",
                         None, True),
    "ppo/p_act": ("", "the learner's probability of acting, choice rows (ppo.entropy_coef_stages)",
                  None, True),
    "ppo/kl": ("nats", "Schulman k3, choice rows; lr_backoff reads it", (0.003, 0.02), False),
    "ppo/clip_fraction": ("", "|ratio - 1| > clip_range, choice rows", (0.05, 0.2), False),
    "ppo/dual_clip_fraction": ("", "the dual clip bound, choice rows", None, False),
    "ppo/forced_frac": ("", "rows through the update with one legal action (smdp: its forced sample)",
                        None, False),
    "ppo/actor_rows": ("rows", "rows the actor ran on, all epochs", None, False),
    "ppo/actor_forwards": ("count", "actor minibatch forwards, all epochs", None, False),
    "ppo/optimizer_steps": ("count", "one per batch, nothing dropped", None, False),
    "ppo/actor_rows_seen": ("rows", "rows through the update, all epochs (critic and actor)", None, False),
    "ppo/ratio_max_abs_dev": ("", "max |ratio - 1| before any step (design 6.4)", None, False),
    "ppo/grad_norm_actor": ("", "pre-clip, mean over steps", None, False),
    "ppo/grad_norm_actor_max": ("", "pre-clip, max over steps", None, False),
    "ppo/grad_norm_critic": ("", "pre-clip, mean over steps", None, False),
    "ppo/grad_norm_critic_max": ("", "pre-clip, max over steps", None, False),
    "ppo/update_magnitude_actor": ("", "|| theta_after - theta_before ||", None, False),
    "ppo/update_magnitude_critic": ("", "|| theta_after - theta_before ||", None, False),
    "ppo/kl_epoch*": ("nats", "kl per epoch; epoch 3 > 2x epoch 1 says lower n_epochs", None, False),
    "ppo/clip_fraction_epoch*": ("", "clip fraction per epoch", None, False),
    "ppo/explained_variance": ("", "1 - Var(G - V) / Var(G) over the cells the critic trains on",
                               (0.0, 1.0), False),
    "ppo/explained_variance_choice": ("", "the same over trainable choice cells (design 6.5)", None, True),
    "ppo/explained_variance_forced_heldout": ("", "the same over forced cells it never trains on "
                                              "(smdp, design 6.6)", None, True),
    "ppo/advantage_std_choice_pre_norm": ("", "advantage std over choice cells before standardising",
                                          None, True),
    "ppo/advantage_mean_choice": ("", "advantage mean over choice cells before standardising", None, True),
    "ppo/reward_clip_frac": ("", "cells whose scaled reward hit reward_clip; exactly 0 when healthy",
                             (0.0, 0.0), False),
    "health/illegal_action_rate": ("", "trainable actions illegal under their stored mask; exactly 0",
                                   (0.0, 0.0), False),
    "health/worker_failures": ("count", "worker failures this iteration", (0.0, 0.0), False),
    "health/mask_disagreements": ("count", "actions where the mask and the engine disagreed at the start-up "
                                  "gate (design 3.8 step 5); a run starts only at 0", (0.0, 0.0), False),
    "env/episodes_completed": ("count", "seat-episodes that ended this iteration", None, False),
    "env/episode_steps_mean": ("decisions", "learner seats' episode length", None, True),
    "env/crowns_for": ("crowns", "learner seats' crowns per episode", None, True),
    "env/crowns_against": ("crowns", "opponents' crowns per learner episode", None, True),
    "env/draw_rate": ("", "learner seats' episodes that ended drawn", (0.0, 0.5), True),
    "env/elixir_count_exact_frac": ("", "episode-seats whose count of the opponent's elixir stayed "
                                    "exact (a plain metric: a battle dealt a farm.ELIXIR_UNCOUNTABLE "
                                    "card goes inexact; the cpu runs' median row 0.82)", None, True),
    "env/elixir_count_exact_frac_countable": ("", "the same over built (not scripted) seats whose decks "
                                              "hold no farm.ELIXIR_UNCOUNTABLE card; exactly 1",
                                              (1.0, 1.0), True),
    "policy/legal_actions_mean": ("actions", "legal actions per trainable cell", None, True),
    "health/buffer_fill_frac": ("", "valid cells over T x R: exactly 1 in a healthy rectangle",
                                (1.0, 1.0), False),
    # the farm's own counters (farm.stats, design 3.3, 3.7): run totals for the health keys
    "health/obs_codec_clipped": ("count", "uint8 values clipped by the codec, run total: "
                                 "non-zero is a bug report against a declared bound", (0.0, 0.0), False),
    "health/obs_codec_rounded": ("count", "non-integral values rounded into a uint8 plane, run total: "
                                 "the table's sample was unrepresentative", (0.0, 0.0), False),
    "health/worker_restarts": ("count", "rollout worker restarts, run total", (0.0, 0.0), False),
    "health/rows_dropped_dead_worker": ("cells", "(cycle, slot) cells lost to a dead worker this iteration",
                                        (0.0, 0.0), False),
    "time/env": ("s", "the workers' vec.step time summed over shard-rounds (worker CPU, "
                 "can exceed collection with several workers)", None, False),
    "time/codec": ("s", "the workers' codec.pack time summed over shard-rounds", None, False),
    "throughput/parent_wait_frac": ("", "share of collection the parent was blocked on workers "
                                    "that had not published", None, False),
    "throughput/boundary_mb_per_second": ("MB/s", "bytes the workers wrote across the process boundary per "
                                          "second of collection", None, False),
    "health/samples_unused_frac": ("", "trainable samples the update never saw: exactly 0",
                                   (0.0, 0.0), False),
    "policy/cards_per_match": ("cards", "learner seats' cards per finished episode (about 22 healthy)",
                               (8.0, 40.0), True),
    "policy/noop_rate": ("", "trainable actions that were the no-op", None, True),
    "env/win_rate_vs_scripted": ("", "learner seats' win share against scripted opponents", None, True),
    # the ladder (design 9.2, 7.8, 7.9): absent, never 0, while undefined (no fit, no gate, no probe)
    "ladder/rating/*": ("Elo", "fitted rating per pool member and the anchor (scripted:noop = 0)",
                        None, True),
    "ladder/rating_se/*": ("Elo", "its standard error (inverse observed Fisher information)", None, True),
    "ladder/rating_ci95_lo/*": ("Elo", "rating - 1.96 se", None, True),
    "ladder/rating_ci95_hi/*": ("Elo", "rating + 1.96 se", None, True),
    "ladder/champion_id": ("", "the current champion (v0 until a gate promotes)", None, True),
    "ladder/champion_step": ("game-steps", "the champion's env step", None, True),
    "ladder/pool_size": ("count", "admitted snapshots (v0 included)", None, False),
    "ladder/sampler_size": ("count", "members the matchmaker may draw (after eviction)", None, False),
    "ladder/gate_attempts": ("count", "candidates gated so far", None, False),
    "ladder/gate_passes": ("count", "candidates admitted (promoted or as a cycle)", None, False),
    "ladder/gate_observed_rate": ("", "the last gate's score against the champion", None, True),
    "ladder/gate_lower_bound": ("", "its Wilson 95% lower bound (passes at >= 0.52)", None, True),
    "ladder/gate_failed_condition": ("", "the last gate's failed conditions, comma separated", None, True),
    "ladder/gate_seconds_frac": ("", "wall clock spent in gates since the process started", None, False),
    "ladder/transitivity_residual": ("", "pairs whose score contradicts the fit by > 2 se (> 0.1: "
                                     "scalar rating lies)", (0.0, 0.1), True),
    "ladder/paired_rho": ("", "the last gate's correlation of a seed's two sides", None, True),
    "ladder/draw_rate_eval": ("", "draws among evaluation games", None, True),
    "ladder/eval_games_total": ("count", "kind=eval games in the fit", None, True),
    "ladder/evictions": ("count", "members evicted from the sampler (hall of fame)", None, False),
    "ladder/pfsp_effective": ("bool", "1: the plan's PFSP used a rated stand-in; 0: uniform fallback",
                              None, False),
    "ladder/pfsp_learner_step": ("game-steps", "the stand-in's env step", None, True),
    "ladder/probe_seconds_frac": ("", "wall clock spent in probes since the process started", None, False),
    "ladder/role_counts/*": ("episodes", "training battle episodes that ended, by what they played",
                             None, False),
    "ladder/score_vs_noop": ("", "probe: the live policy's score against scripted:noop", None, True),
    "ladder/score_vs_random_legal": ("", "probe: against scripted:random_legal", None, True),
    "ladder/score_vs/*": ("", "probe: score against a rung", None, True),
    "ladder/score_vs_n/*": ("seeds", "probe: seeds played (each from both sides)", None, True),
    "ladder/score_vs_ci95_lo/*": ("", "probe: bootstrap 95% interval over seeds, low end", None, True),
    "ladder/score_vs_ci95_hi/*": ("", "probe: high end", None, True),
    "time/probe": ("s", "the probe this iteration", None, True),
    "time/gate": ("s", "the gate this iteration", None, True),
    # time/ and throughput/ are wall clock (the resume test skips them); every other key is a pure
    # function of the run
    "time/inference": ("s", "the parent's batched forwards while collecting (learner and pool seats); "
                       "inside time/collection", None, False),
    "time/checkpoint": ("s", "checkpoint writing since the previous row (a save follows its own row, "
                        "so it is counted in the next)", None, False),
    "time/residual": ("s", "time/iteration less collection, critic_pass, gae, update, gate, "
                      "probe and checkpoint", None, False),
    "throughput/overall_steps_per_second": ("game-steps/s", "env steps over time/iteration: "
                                            "what the run really makes", None, False),
    "throughput/engine_ticks_per_second": ("ticks/s", "engine ticks advanced by the battles "
                                           "(the tick scalar's per-cycle deltas) over collection time",
                                           None, False),
    "throughput/discarded_rows_frac": ("", "valid cells that are not trainable (opponent seats): "
                                       "(n_battles - mirror) / (2 n_battles) by construction (design 7.3)",
                                       None, False),
    "throughput/inference_ms_per_round": ("ms", "time/inference per shard-round", None, False),
    # how the work was done, not what the run computed: counted with the clock, so a build that
    # skips forward rows compares equal to one that does not
    "throughput/inference_rows_forward": ("rows", "rows the parent's actors ran on while collecting "
                                          "(learner and pool seats)", None, False),
    "throughput/inference_rows_skipped": ("rows", "forced rows acted without a forward: "
                                          "the no-op at log-prob 0 (design 3.6)", None, False),
    "throughput/critic_rows": ("rows", "observations the critic pass ran on, truncation finals included "
                               "(smdp: its choice, sampled and held-out cells; design 6.6)", None, False),
    "policy/forced_noop_frac": ("", "learner rollout cells with exactly one legal action "
                                "(zero policy gradient); read against ppo/forced_frac", None, True),
    "policy/rollout_choice_frac": ("", "learner rollout cells with more than the no-op legal: "
                                   "1 - forced_noop_frac", None, True),
    "policy/legal_actions_p05": ("actions", "legal actions per learner cell, 5th percentile", None, True),
    "policy/legal_actions_p50": ("actions", "median", None, True),
    "policy/legal_actions_p95": ("actions", "95th percentile", None, True),
    "env/episode_steps_p05": ("decisions", "learner seats' episode length, 5th percentile", None, True),
    "env/episode_steps_p50": ("decisions", "median", None, True),
    "env/episode_steps_p95": ("decisions", "95th percentile", None, True),
    "env/crown_diff": ("crowns", "learner seats' crowns less the opponent's, per episode", None, True),
    "env/tower_hp_frac_end_own": ("", "learner seats' own tower hp fraction at the episode's end",
                                  None, True),
    "env/tower_hp_frac_end_enemy": ("", "the opponent's tower hp fraction at the episode's end", None, True),
    "env/win_rate_by_seat": ("", "blue's score (win 1, draw 0.5) in mirror battles, "
                             "where both seats are the learner: near 0.5", (0.45, 0.55), True),
    "env/win_rate_by_seat_ci95_lo": ("", "its Wilson 95% interval over the mirror episodes, low end "
                                     "(seat_bias reads it)", None, True),
    "env/win_rate_by_seat_ci95_hi": ("", "high end", None, True),
    "env/elixir_leak_frac": ("", "learner seats' decisions at full elixir "
                             "(elixir_leak_steps / episode_steps), per episode", None, True),
    "env/episode_steps_at_cap_frac": ("", "learner episodes that reached obs.max_steps; "
                                      "absent when no cap is set", None, True),
    "policy/rollout_hold_rate": ("", "the rollout's p(no-op) on learner cells that had a choice", None, True),
    "policy/rollout_hold_lift": ("", "p(no-op) x n_legal on those cells: 1.0 is a policy that learnt nothing "
                                 "about waiting; no band earned yet", None, True),
    "policy/tile_top1_share": ("", "the learner's card plays on its single most used tile "
                               "(tile_spam reads it)", (0.0, 0.25), True),
    "policy/tile_entropy": ("nats", "entropy of the learner's played-tile histogram; "
                            "ln(H*W) is every tile equally", None, True),
    "policy/card_plays/*": ("", "a card's share of the learner's plays this iteration, by catalogue name",
                            None, True),
    "policy/card_tile_top10_share": ("", "the learner's plays on its ten most used (card, tile) pairs "
                                     "(artefact_exploit reads it)", (0.0, 0.5), True),
    "env/mean_elixir_at_decision": ("bar", "the learner's own elixir at its choice cells, "
                                    "as a fraction of the bar (own_elixir)", None, True),
    "env/frac_elixir_above_99": ("", "the learner's choice cells with elixir at 0.99 of the bar or more "
                                 "(about to leak)", None, True),
    "ladder/elo_readout": ("Elo", "sequential Elo (k=32) of 'learner' over its kind=train games "
                           "(design 7.2 layer 1; never the gate)", None, True),
    "ladder/rating_above_v0": ("Elo", "the champion's fitted rating less v0's "
                               "(the learner itself is never fitted, design 7.9)", None, True),
    "ladder/gate_consecutive_discards": ("count", "gates discarded in a row since the last admission "
                                         "(gate_starved reads it)", None, False),
    "env/reward_terms/*": ("reward", "learner seats' per-episode sum of a weighted term, signed mean "
                           "(terminal: the objective)", None, True),
    "env/reward_terms_abs/*": ("reward", "the mean of each learner seat's |per-episode sum| of that term",
                               None, True),
    "env/reward_terms_step_abs/*": ("reward", "the mean of each learner seat's per-episode sum "
                                    "of |that term| over its steps: how loud it is", None, True),
    "env/reward_shaping_abs": ("reward", "sum of reward_terms_abs over every term but terminal "
                               "(shaping_dominates reads it)", None, True),
    "env/reward_terminal_abs": ("reward", "reward_terms_abs/terminal (0 when no term is filed as terminal)",
                                None, True),
    "health/rss_peak_mb": ("MB", "the process's peak resident memory (getrusage); "
                           "machine-dependent like time/", None, False),
    # the device-memory regime, on a CUDA device only (device_memory)
    "health/vram_peak_mb": ("MB", "the iteration's peak allocated device memory", None, True),
    "health/vram_reserved_mb": ("MB", "device memory torch's allocator holds", None, True),
    "health/vram_inactive_split_mb": ("MB", "reserved but unusable between split blocks (fragmentation)",
                                      None, True),
    "health/vram_driver_free_mb": ("MB", "free device memory as the driver reports it "
                                   "(vram_spilling reads it)", None, True),
    "health/vram_available_mb": ("MB", "driver free plus what this process reserves", None, True),
    "health/vram_alloc_retries": ("count", "allocations that had to free the cache and retry, run total",
                                  None, True),
    "health/vram_needed_mb": ("MB", "one minibatch's peak measured at start-up plus doctor.vram_headroom_mb",
                              None, True),
}


class SchemaError(ValueError):
    """A metric row key with no SCHEMA entry: the row would carry a number nobody documented."""


def check_row_schema(row: dict[str, Any]) -> None:
    """Refuse a row key that SCHEMA does not cover (its own entry or a "prefix/*" pattern's). The
    run itself checks, not only a test, so a fork that adds a metric and forgets its entry stops at
    its first row, naming the key and where the entry goes."""
    patterns = tuple(k[:-1] for k in SCHEMA if k.endswith("*"))
    unknown = sorted(k for k in row if k not in SCHEMA and not k.startswith(patterns))
    if unknown:
        raise SchemaError(f"metric row key(s) {', '.join(unknown)} have no SCHEMA entry: "
                          f"add (unit, description, healthy range or None, conditional) "
                          f"for each to SCHEMA in {SCRIPT}, section 11")

# Keys whose value depends on the machine or the clock rather than the run: the resume test
# compares every other key byte for byte (design 2.4, 8.3).
NONDETERMINISTIC = ("time/", "throughput/", "run/wall_seconds", "health/rss_peak_mb", "health/vram_")


def episode_metrics(eps: Sequence[Any], cap: int = 0) -> dict[str, float]:
    """The env/ keys read off this iteration's EpisodeRecords (farm.EpisodeRecord). The learner's
    own seats are the population (design 9.3: a mean over every seat could not see the learner
    collapse); win_rate_by_seat is blue's score in mirror battles, where both seats are the learner,
    so 0.5 is exact by symmetry and a deviation is the seat, not the opponent. A key whose
    population is empty is absent, never 0. cap is obs.max_steps (0: no cap, no at_cap key)."""
    mine = [e for e in eps if e.policy_id == "learner"]
    m: dict[str, float] = {}
    if mine:
        steps = np.array([e.episode_steps for e in mine], np.float64)
        for q in (5, 50, 95):
            m[f"env/episode_steps_p{q:02d}"] = float(np.percentile(steps, q))
        m["env/crown_diff"] = float(np.mean([e.own_crowns - e.enemy_crowns for e in mine]))
        m["env/tower_hp_frac_end_own"] = float(np.mean([e.own_tower_hp_frac for e in mine]))
        m["env/tower_hp_frac_end_enemy"] = float(np.mean([e.enemy_tower_hp_frac for e in mine]))
        m["env/elixir_leak_frac"] = float(np.mean([e.elixir_leak_steps / max(e.episode_steps, 1)
                                                   for e in mine]))
        if cap > 0:
            m["env/episode_steps_at_cap_frac"] = float(np.mean(steps >= cap))
        # design 4 / 9.2: each weighted term's per-episode sum, signed and as a magnitude, over the
        # learner's seats. A term missing from a record counts 0 for it (sorted: the row's key order
        # is a function of the run, which the resume test compares). shaping_abs sums the magnitude
        # of every term but the objective (farm.TERMINAL_REWARD_TERM); shaping_dominates reads it.
        # A potential's sum telescopes, so how LOUD a term is is its step_abs: sum |F_t|.
        names = sorted({k for e in mine for k in e.reward_terms})
        for n in names:
            v = np.array([e.reward_terms.get(n, 0.0) for e in mine], np.float64)
            m[f"env/reward_terms/{n}"] = float(v.mean())
            m[f"env/reward_terms_abs/{n}"] = float(np.abs(v).mean())
        for n in sorted({k for e in mine for k in e.reward_terms_step_abs}):
            m[f"env/reward_terms_step_abs/{n}"] = float(np.mean([e.reward_terms_step_abs.get(n, 0.0)
                                                                 for e in mine]))
        if names:
            m["env/reward_shaping_abs"] = float(sum(m[f"env/reward_terms_abs/{n}"] for n in names
                                                    if n != farm.TERMINAL_REWARD_TERM))
            m["env/reward_terminal_abs"] = m.get(f"env/reward_terms_abs/{farm.TERMINAL_REWARD_TERM}", 0.0)
    blue = [{0: 1.0, 2: 0.5, 1: 0.0}[e.winner] for e in eps
            if e.bucket == "mirror" and e.seat == 0 and e.winner in (0, 1, 2)]
    if blue:
        p = float(np.mean(blue))
        m["env/win_rate_by_seat"] = p
        m["env/win_rate_by_seat_ci95_lo"], m["env/win_rate_by_seat_ci95_hi"] = \
            ladder.wilson_interval(p, len(blue))
    return m


def countable_elixir_episodes(eps: Sequence[Any]) -> list[Any]:
    """The seat-episodes elixir_count_inexact judges: built seats (a scripted seat is built mask-only,
    so its count never moves and its True says nothing) whose battle's decks hold no
    farm.ELIXIR_UNCOUNTABLE card. On those royalegym's enemy-elixir count is exact unless something
    is wrong (0 of 5175 inexact over two cpu runs; docs/running.md)."""
    return [e for e in eps if not e.elixir_uncountable and not e.policy_id.startswith("scripted:")]


def rollout_policy_metrics(action: np.ndarray, n_legal: np.ndarray, p_noop: np.ndarray, geo: NetGeometry,
                           card: np.ndarray | None = None, elixir: np.ndarray | None = None,
                           card_names: Sequence[str] = ()) -> dict[str, float]:
    """policy/ and env/ keys of the learner's rollout cells (1-D arrays, one entry a cell). Hold:
    over the cells that had a choice (n_legal > 1), p(no-op) as the rollout's forward gave it, and
    its lift over that cell's uniform baseline 1/n_legal (1.0: nothing learnt about when to wait;
    design 9.2). Tiles: over the cells that played a card, from royalegym's encoding a = 1 +
    slot*H*W + y*W + x (PointerHead): the share on the single most used board tile, the entropy of
    the tile histogram (nats; ln(H*W) is every tile equally), and with `card` (the card id the
    played slot held, -1 where none) the share of the ten most used (card, tile) pairs (the
    artefact_exploit alarm: a real meta is not that concentrated), and each played card's share of
    the plays, by its name in `card_names` (policy/card_plays/<name>). `elixir`: the cell's own elixir
    as the env declares it (own_elixir, a fraction of the bar), read at the choice cells: its mean
    and the share at 0.99 of the bar or more (elixir about to leak). Absent when the population is."""
    m: dict[str, float] = {}
    choice = n_legal > 1
    if choice.any():
        m["policy/rollout_hold_rate"] = float(p_noop[choice].mean())
        m["policy/rollout_hold_lift"] = float((p_noop[choice] * n_legal[choice]).mean())
        if elixir is not None:
            m["env/mean_elixir_at_decision"] = float(elixir[choice].mean())
            m["env/frac_elixir_above_99"] = float((elixir[choice] >= 0.99).mean())
    hw = geo.tiles[0] * geo.tiles[1]
    play = (action >= 1) & (action < 1 + geo.hand_size * hw)
    if play.any():
        tiles = (action[play] - 1) % hw
        counts = np.bincount(tiles, minlength=hw)
        m["policy/tile_top1_share"] = float(counts.max() / play.sum())
        q = counts[counts > 0] / play.sum()
        m["policy/tile_entropy"] = float(-(q * np.log(q)).sum())
        if card is not None:
            _, pair_counts = np.unique(np.stack([card[play], tiles]), axis=1, return_counts=True)
            m["policy/card_tile_top10_share"] = float(np.sort(pair_counts)[::-1][:10].sum() / play.sum())
            ids, n = np.unique(card[play], return_counts=True)
            m.update({f"policy/card_plays/{card_name(card_names, i)}": float(k / play.sum())
                      for i, k in zip(ids, n, strict=True)})
    return m


def card_name(card_names: Sequence[str], card_id: int) -> str:
    """A card by its catalogue name; by its id where the catalogue is not known."""
    return card_names[card_id] if 0 <= card_id < len(card_names) else f"card_{card_id}"


def play_heatmaps(action: np.ndarray, card: np.ndarray, geo: NetGeometry,
                  card_names: Sequence[str]) -> dict[str, np.ndarray]:
    """The learner's plays (1-D cells, as rollout_policy_metrics reads them) as one (H, W) board
    of counts per card played: row y, column x of royalegym's a = 1 + slot*H*W + y*W + x."""
    H, W = geo.tiles
    play = (action >= 1) & (action < 1 + geo.hand_size * H * W) & (card >= 0)
    tiles = (action[play] - 1) % (H * W)
    out = {}
    for i in np.unique(card[play]):
        out[card_name(card_names, int(i))] = np.bincount(tiles[card[play] == i],
                                                         minlength=H * W).reshape(H, W)
    return out


def save_play_heatmaps(run: Path, iteration: int, roll: Rollout, env: Env, every: int) -> Path | None:
    """design 9.2's play heatmap per card: on every `every`-th iteration (metrics.image_every, 0
    never), that iteration's learner plays to <run>/heatmaps/<iteration>.npz, one (H, W) int array
    per card name. That iteration's alone, so a resumed run writes the same file."""
    if every <= 0 or iteration % every:
        return None
    t = roll.trainable
    maps = play_heatmaps(roll.action[t], roll.card[t], env.geo, env.card_names)
    buf = io.BytesIO()
    np.savez_compressed(buf, **maps)
    path = run / "heatmaps" / f"{iteration:06d}.npz"
    ladder.write_atomic(path, buf.getvalue())
    return path


def device_memory(device: torch.device, needed_mb: float | None) -> dict[str, float]:
    """The device-memory regime at the iteration's end (design 9.2; CUDA only, else nothing): which
    memory a slowing update is in. The driver's free memory is the one vram_spilling reads; a
    process that holds its allocation cannot tell an outsider's squeeze from its own use any other
    way. The peak is this iteration's (reset here)."""
    if device.type != "cuda":
        return {}
    mb = 2.0 ** 20
    free, _ = torch.cuda.mem_get_info(device)
    st = torch.cuda.memory_stats(device)
    reserved = torch.cuda.memory_reserved(device)
    out = {"health/vram_peak_mb": torch.cuda.max_memory_allocated(device) / mb,
           "health/vram_reserved_mb": reserved / mb,
           "health/vram_inactive_split_mb": st.get("inactive_split_bytes.all.current", 0) / mb,
           "health/vram_driver_free_mb": free / mb, "health/vram_available_mb": (free + reserved) / mb,
           "health/vram_alloc_retries": float(st.get("num_alloc_retries", 0))}
    if needed_mb is not None:
        out["health/vram_needed_mb"] = needed_mb
    torch.cuda.reset_peak_memory_stats(device)
    return out


VRAM_FULL_MB = 128.0   # driver-free device memory under which a card counts as full (vram_spilling)


class VramSpilling:
    """vram_spilling's predicate (design 9.3): time/update at least twice the best this run has had
    in the same actor state (an update with no actor forward, a warm start's critic-only one, is
    much cheaper and keeps a best of its own) while the driver says under 128 MB is free. A busy
    machine slows an update 1.4-1.7x, a spill to host memory about 4x [the specification's M]. The
    best is a running minimum over earlier rows, so a slow row cannot raise its own bar. A row
    without a CUDA reading is no evidence (None). Its state comes back on a resume, as every
    alarm's does, from the rows replayed."""

    def __init__(self) -> None:
        self.best: dict[bool, float] = {}

    def __call__(self, row: dict[str, Any]) -> bool | None:
        t, free = row.get("time/update"), row.get("health/vram_driver_free_mb")
        if t is None or free is None:
            return None
        actor = row.get("ppo/actor_forwards", 1.0) > 0
        best = self.best.get(actor)
        self.best[actor] = t if best is None else min(best, t)
        return best is not None and t >= 2 * best and free < VRAM_FULL_MB


def rss_peak_mb() -> float:
    """Peak resident set of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


class AlarmHalt(RuntimeError):
    """A halting alarm fired; the run wrote its row, a checkpoint and a bundle before raising."""


@dataclass
class Alarm:
    """Fires when its predicate holds on `patience` consecutive rows. The predicate is `key op
    threshold`; op "rose" compares the key with its value on the previous row (a run total that
    went up); `test`, when given, replaces the comparison with a function of the whole row for
    predicates over several keys, and returns None when a key it needs is absent. `reads` are
    the keys halt.json shows the recent values of (default: the key)."""
    name: str
    key: str
    op: Literal[">", "<", "rose"]
    threshold: float
    patience: int
    severity: Literal["warn", "halt"]
    meaning: str
    test: Any = None
    reads: tuple[str, ...] = ()


def _seat_bias(row: dict[str, Any]) -> bool | None:
    lo, hi = row.get("env/win_rate_by_seat_ci95_lo"), row.get("env/win_rate_by_seat_ci95_hi")
    return None if lo is None or hi is None else (hi < 0.45 or lo > 0.55)


def _draw_equilibrium(row: dict[str, Any]) -> bool | None:
    d, cap = row.get("env/draw_rate"), row.get("env/episode_steps_at_cap_frac")
    return None if d is None or cap is None else (d > 0.5 and cap > 0.8)


def _gate_starved(row: dict[str, Any]) -> bool | None:
    # an event: only a row that gated can say it, so a starving run warns once per gate, not every row
    return None if "time/gate" not in row else row.get("ladder/gate_consecutive_discards", 0) >= 5


def _shaping_dominates(row: dict[str, Any]) -> bool | None:
    sh, te = row.get("env/reward_shaping_abs"), row.get("env/reward_terminal_abs")
    return None if sh is None or te is None else sh > te


def alarm_table(args: Args) -> list[Alarm]:
    """design 9.3's table, the keys this row carries. Thresholds are config (excluded from the
    identity: an alarm can stop a run, never change a number); patience and severity are not.
    Not here: capacity_ratio (no honest rollout_capacity_ratio without lag-1 collection, which is
    not built: design 10.1). artefact_exploit warns and names five winning
    episodes (alarm_rows) rather than writing their traces, which checks.py writes."""
    al = args.alarms
    return [
        Alarm("illegal_actions", "health/illegal_action_rate", ">", 0.0, 1, "halt",
              "a mask bug or a wrong action encoding"),
        Alarm("ratio_invariant", "ppo/ratio_max_abs_dev", ">", al.ratio_invariant_multiple * ratio_atol(args),
              1, "halt", "a mask, codec or weight-version mismatch (design 6.4)"),
        Alarm("clip_pinned", "ppo/clip_fraction", ">", al.clip_pinned, 3, "halt",
              "mask disagreement, or lr far too high"),
        Alarm("kl_high", "ppo/kl", ">", al.kl_high, 3, "warn", "the backoff should already be acting"),
        Alarm("kl_dead", "ppo/kl", "<", al.kl_dead, 10, "warn",
              "nothing is moving: entropy, lr, or a frozen head"),
        Alarm("ev_negative", "ppo/explained_variance", "<", 0.0, al.ev_negative_patience, "warn",
              "the likeliest cause of a plateau"),
        Alarm("noop_collapse", "policy/cards_per_match", "<", al.noop_collapse, 5, "warn",
              "about 22 is healthy"),
        Alarm("noop_collapse_severe", "policy/cards_per_match", "<", al.noop_collapse_severe, 5, "halt",
              "the policy stopped playing"),
        Alarm("noop_entropy_floor", "ppo/noop_entropy", "<", al.noop_entropy_floor, 5, "warn",
              "the leading indicator of no-op collapse"),
        Alarm("reward_clipped", "ppo/reward_clip_frac", ">", 0.0, 1, "warn",
              "a clipped step breaks the potential shaping's telescoping"),
        Alarm("buffer_overflow", "health/buffer_fill_frac", ">", 1.0, 1, "halt",
              "a rectangle cell written twice: an invariant is broken"),
        Alarm("obs_codec_clipped", "health/obs_codec_clipped", ">", 0.0, 1, "warn",
              "a uint8 plane exceeded its declared bound and was clipped (design 3.3): "
              "report it against the builder"),
        Alarm("elixir_count_inexact", "env/elixir_count_exact_frac_countable", "<", 1.0, 1, "warn",
              "the enemy-elixir count went wrong in a battle without an Elixir Golem, Elixir "
              "Collector or Merge Maiden: a missed play or press, a deck repeating a card, or an "
              "engine whose elixir law is not calibration.json's; read identity.json engine_build first"),
        Alarm("worker_failures", "health/worker_restarts", "rose", 0.0, 1, "warn",
              "a rollout worker died and was restarted (the failure line says whether cells were dropped)"),
        Alarm("worker_failures_persistent", "health/worker_restarts", "rose", 0.0, 3, "halt",
              "workers died on three iterations running: the environment or the machine is failing, "
              "not one battle"),
        Alarm("seat_bias", "env/win_rate_by_seat", "<", 0.0, 3, "warn",
              "blue's mirror score's 95% interval excludes 0.45-0.55: "
              "an unseeded reset, a reward asymmetry or a mirror bug",
              test=_seat_bias, reads=("env/win_rate_by_seat", "env/win_rate_by_seat_ci95_lo",
                                      "env/win_rate_by_seat_ci95_hi")),
        Alarm("draw_equilibrium", "env/draw_rate", ">", 0.5, 5, "warn",
              "draw_rate > 0.5 and episode_steps_at_cap_frac > 0.8: the turtle equilibrium",
              test=_draw_equilibrium, reads=("env/draw_rate", "env/episode_steps_at_cap_frac")),
        Alarm("gate_starved", "ladder/gate_consecutive_discards", ">", 4.0, 1, "warn",
              "five gates in a row discarded: the plateau signal, stated as an event", test=_gate_starved),
        Alarm("transitivity", "ladder/transitivity_residual", ">", 0.10, 3, "warn",
              "the scalar rating is lying"),
        Alarm("shaping_dominates", "env/reward_shaping_abs", ">", 0.0, 5, "warn",
              "shaping outweighs the objective: under a potential reward a term stopped telescoping "
              "(design 9.3)",
              test=_shaping_dominates, reads=("env/reward_shaping_abs", "env/reward_terminal_abs")),
        Alarm("tile_spam", "policy/tile_top1_share", ">", 0.25, 5, "warn",
              "a quarter of the learner's plays on one tile"),
        Alarm("artefact_exploit", "policy/card_tile_top10_share", ">", 0.5, 5, "warn",
              "half the learner's plays on ten (card, tile) pairs: a real meta is not that concentrated"),
        Alarm("vram_spilling", "health/vram_driver_free_mb", "<", VRAM_FULL_MB, 3, "warn",
              "the update is twice as slow as this run's best on a card the driver says is full: memory "
              "backed by the host over PCIe (lower ppo.minibatch_size, or free the card)",
              test=VramSpilling(), reads=("time/update", "health/vram_driver_free_mb")),
    ]


class AlarmSet:
    """Each alarm fires when its predicate holds for `patience` consecutive iterations; a row
    without the key (a conditional metric with no population) resets nothing and counts nothing.
    A non-finite value of any numeric key is the `nonfinite` halt."""

    def __init__(self, alarms: list[Alarm]) -> None:
        self.alarms = alarms
        self.count = {a.name: 0 for a in alarms}
        self.prev: dict[str, Any] = {}   # the previous row's value per key, for op "rose"

    def evaluate(self, row: dict[str, Any]) -> list[tuple[Alarm, float]]:
        fired = []
        for k, v in row.items():
            if isinstance(v, float) and not math.isfinite(v):
                fired.append((Alarm("nonfinite", k, ">", 0.0, 1, "halt",
                                    "a loss, gradient or metric went non-finite"), v))
        for a in self.alarms:
            v = row.get(a.key)
            if a.test is not None:
                hit = a.test(row)
            elif v is None:
                hit = None
            elif a.op == "rose":
                p = self.prev.get(a.key)
                hit = p is not None and v > p
            else:
                hit = v > a.threshold if a.op == ">" else v < a.threshold
            if hit is None:
                continue
            self.count[a.name] = self.count[a.name] + 1 if hit else 0
            if hit and self.count[a.name] >= a.patience:
                fired.append((a, float(v) if isinstance(v, (int, float)) else float("nan")))
        for a in self.alarms:
            if a.key in row:
                self.prev[a.key] = row[a.key]
        return fired


def alarm_rows(iteration: int, fired: list[tuple[Alarm, float]], episodes: Sequence[Any],
               first_line: int) -> list[dict[str, Any]]:
    """alarms.jsonl's rows for the alarms a row fired. artefact_exploit's also names up to five of
    the iteration's learner wins by their 0-based line in episodes.jsonl (first_line is episodes[0]'s):
    design 9.3 asks for their traces, which `checks.py replay --trace` writes (the learner cannot:
    checks.py imports this file, not the other way)."""
    out = []
    for a, v in fired:
        r = {"iteration": iteration, "alarm": a.name, "metric": a.key, "value": v, "threshold": a.threshold,
             "severity": a.severity}
        if a.name == "artefact_exploit":
            r["winning_episodes"] = [first_line + i for i, e in enumerate(episodes)
                                     if e.policy_id == "learner" and e.winner == e.seat][:5]
        out.append(r)
    return out


def write_bundle(run: Path, iteration: int, alarm: Alarm, value: float, rows: list[dict[str, Any]],
                 checkpoint: Path, args: Args, identity: RunIdentity, episodes: Sequence[Any] = (),
                 alarm_rows: Sequence[dict[str, Any]] = (), ratio_outliers: Sequence[dict[str, Any]] = (),
                 episode_lines: int = 0) -> Path:
    """design 9.4: everything needed to judge whether the stop was real, in one folder: halt.json
    (the alarm, its threshold, the last five values of every key it reads, the state_digest, the
    checkpoint and the resume command), the last fifty rows, this iteration's alarm rows, the last
    twenty EpisodeRecords, the resolved config and the identity, and ratio_outliers.json: the
    halting iteration's ten worst |ratio - 1| on the first minibatch of choice rows before any
    step, with their (cycle, slot) (ratio_invariant fills them). Not written here: a re-simulated
    trace of an episode, which checks.py writes (this file cannot import it); halt.json's "trace"
    is the command that writes the newest recorded episode's (episode_lines: the lines of
    episodes.jsonl; None when there are none)."""
    b = run / "bundles" / str(iteration)
    b.mkdir(parents=True, exist_ok=True)
    reads = alarm.reads or (alarm.key,)
    recent = {k: [r.get(k) for r in rows[-5:]] for k in reads}
    halt = {"alarm": alarm.name, "metric": alarm.key,
            "predicate": f"{alarm.key} {alarm.op} {alarm.threshold}",
            "threshold": alarm.threshold, "patience": alarm.patience, "value": value,
            "last_values": recent[alarm.key] if alarm.key in recent else recent[reads[0]], "recent": recent,
            "meaning": alarm.meaning, "iteration": iteration, "checkpoint": str(checkpoint),
            "state_digest": rows[-1].get("run/state_digest") if rows else None,
            "resume": f"python {SCRIPT} --resume {run} --checkpoint {checkpoint}",
            "trace": (f"python checks.py replay {run} --episode {episode_lines - 1} --trace "
                      f"{b / f'episode-{episode_lines - 1}.msgpack'}" if episode_lines else None)}
    (b / "halt.json").write_bytes(msgspec.json.format(canonical_json(halt)))
    (b / "metrics_tail.jsonl").write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in rows[-50:]))
    (b / "alarms.jsonl").write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in alarm_rows))
    (b / "episodes_tail.jsonl").write_bytes(b"".join(msgspec.json.encode(e) + b"\n"
                                                     for e in list(episodes)[-20:]))
    (b / "ratio_outliers.json").write_bytes(msgspec.json.format(msgspec.json.encode(list(ratio_outliers))))
    (b / "config.json").write_bytes(config_json(args))
    (b / "identity.json").write_bytes(canonical_json(identity))
    return b


class WandbSink:
    """Rows mirrored to Weights & Biases (design 9.1), the optional extra `clash-ppo[wandb]`.

    wandb is imported here and only when --metrics.wandb is set, so a run without it never loads
    it. The wandb run id is the run directory's name (<run_name>-<run_id>): a resumed run writes
    into the same directory, so it continues the same wandb run (resume="allow") with nothing
    extra to checkpoint. Only numbers are logged (a bool as 0/1); strings such as
    run/state_digest stay in metrics.jsonl, which remains the record of the run."""

    def __init__(self, project: str, run: Path, config: dict[str, Any], identity: dict[str, Any],
                 module: Any = None) -> None:
        if module is None:
            try:
                import importlib

                module = importlib.import_module("wandb")
            except ImportError as e:
                raise ConfigError(
                    "--metrics.wandb needs the optional wandb extra: pip install 'clash-ppo[wandb]' "
                    f"(or pip install wandb); or run without --metrics.wandb ({e})") from None
        self._run = module.init(project=project, id=run.name, name=run.name, resume="allow",
                                dir=str(run), config={"config": config, "identity": identity})

    def write(self, row: dict[str, Any]) -> None:
        nums = {k: float(v) for k, v in row.items()
                if isinstance(v, (int, float)) and math.isfinite(float(v))}
        self._run.log(nums, step=int(row["run/iteration"]))

    def close(self) -> None:
        self._run.finish()


class TensorBoardSink:
    """Rows mirrored to TensorBoard event files under <run>/tb/ (design 9.1), the optional extra
    `clash-ppo[tb]`, imported only when --metrics.tensorboard is set. Every finite number of the
    row is a scalar tagged with its key at the row's run/cumulative_env_steps, the axis the
    schedules and the ladder use, so `tensorboard --logdir runs` lines runs up by game-steps. A
    resumed run purges the events at or after its first new step: the rows after the checkpoint
    were moved aside (design 2.4), and their events go with them."""

    def __init__(self, run: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError("--metrics.tensorboard needs the optional tensorboard extra: "
                              f"pip install 'clash-ppo[tb]' (or pip install tensorboard); "
                              f"or run without it ({e})") from None
        metrics = run / "metrics.jsonl"
        last = metrics.read_bytes().splitlines()[-1] if metrics.exists() and metrics.stat().st_size else b""
        purge = json.loads(last)["run/cumulative_env_steps"] + 1 if last else None
        self.writer = SummaryWriter(log_dir=str(run / "tb"), purge_step=purge)

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["run/cumulative_env_steps"])
        for k, v in row.items():
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                self.writer.add_scalar(k, float(v), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class ViserSink:
    """The viewer's learning-status datagram (design 9.1), about eighty lines of socket and msgpack;
    royaleviser is never imported (the viewer watches the learner, not the reverse). Binds the
    learning port (ROYALEVISER's state port + 1), sends NOTHING until a b"royaleviser 1" hello
    arrives, counts a viewer attached while a hello came within 3 s, re-sends the last status on
    a fresh hello, and sends one whole {"learning": {...}} map per iteration (the viewer replaces
    rather than merges). A detached run costs one clock read and one non-blocking recv a call."""

    HELLO = b"royaleviser 1"
    ATTACHED_S = 3.0

    def __init__(self, host: str, port: int) -> None:
        import socket
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.sock.setblocking(False)
        self.peer: Any = None
        self.last_hello = -math.inf
        self.last: bytes | None = None

    @classmethod
    def from_env(cls) -> "ViserSink | None":
        spec = os.environ.get("ROYALEVISER", "")
        if not spec:
            return None
        host, _, port = spec.rpartition(":")
        return cls(host or "127.0.0.1", int(port) + 1)

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    @property
    def attached(self) -> bool:
        import time
        return time.monotonic() - self.last_hello < self.ATTACHED_S

    def pump(self) -> None:
        import time
        while True:
            try:
                data, addr = self.sock.recvfrom(64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:   # e.g. a Windows ICMP reset from a viewer that went away
                continue
            if data.strip() == self.HELLO:
                fresh = not self.attached or addr != self.peer
                self.peer, self.last_hello = addr, time.monotonic()
                if fresh and self.last is not None:
                    self._send(self.last)

    def write(self, row: dict[str, Any], run_name: str) -> None:
        self.last = msgspec.msgpack.encode({"learning": learning_status(row, run_name)})
        self.pump()
        if self.attached:
            self._send(self.last)

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendto(data, self.peer)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


def learning_status(row: dict[str, Any], run_name: str) -> dict[str, Any]:
    """A metric row under royaleviser.model.Learning's fixed field names; None renders as a dash."""
    g = row.get
    return {"run": run_name, "iteration": g("run/iteration"), "policy_loss": g("ppo/policy_loss"),
            "value_loss": g("ppo/value_loss"), "entropy": g("ppo/entropy"), "kl": g("ppo/kl"),
            "clip_frac": g("ppo/clip_fraction"), "explained_var": g("ppo/explained_variance"),
            "grad_norm": g("ppo/grad_norm_actor"), "learning_rate": g("run/lr_actor"),
            "env_steps_per_s": g("throughput/collected_steps_per_second"),
            "engine_ticks_per_s": g("throughput/engine_ticks_per_second"),
            "episode_ticks": None, "crowns_per_episode": g("env/crowns_for"), "towers_per_episode": None,
            "illegal_rate": g("health/illegal_action_rate"), "elixir_wasted": g("env/elixir_leak_frac"),
            "elo": g("ladder/elo_readout"), "win_rate": g("env/win_rate_vs_scripted"),
            "pool_size": g("ladder/pool_size"), "games_vs_pool": None,
            "extra": {"cards_per_match":
                      g("policy/cards_per_match") if g("policy/cards_per_match") is not None else "-",
                      "forced_frac": g("ppo/forced_frac"),
                      "gate": g("ladder/gate_failed_condition") if g("ladder/gate_attempts") else "none yet"}}


def metric_row(args: Args, env: Env, learner: Learner, run: Run, lad: ladder.LadderLoop, roll: Rollout,
               crit: Critic, adv: Advantages, upd: dict[str, Any], lad_row: dict[str, Any]) -> dict[str, Any]:
    """The iteration's one flat row (design 9.2); every key is in SCHEMA. time/iteration runs from
    the previous row to this one, so a checkpoint written after a row is counted in the next."""
    T, trainable, valid, mine = (env.T, roll.trainable, roll.valid,
                                 [e for e in roll.episodes if e.policy_id == "learner"])
    nl, n_train = crit.n_legal[trainable], max(int(trainable.sum()), 1)
    pol: dict[str, Any] = {}
    if nl.size:
        pol = {"policy/forced_noop_frac": float((nl == 1).mean()),
               "policy/rollout_choice_frac": float((nl > 1).mean()),
               **{f"policy/legal_actions_p{q:02d}": float(np.percentile(nl, q)) for q in (5, 50, 95)}}
    pol.update(rollout_policy_metrics(roll.action[trainable], nl, roll.p_noop[trainable], env.geo,
                                      card=roll.card[trainable],
                                      elixir=(roll.elixir[trainable]
                                              if OWN_ELIXIR in dict(env.geo.vector_layout) else None),
                                      card_names=env.card_names))
    t_now = time.perf_counter()
    t_iter = t_now - run.t_row
    parts = (roll.t_collect + crit.seconds + adv.seconds + upd["time/update"] + run.t_ckpt
             + lad_row.get("time/gate", 0.0) + lad_row.get("time/probe", 0.0))
    gamma, lam, fst = learner.sched["gamma"], args.advantage.gae_lambda, roll.stats
    mean = lambda xs: float(np.mean(xs)) if xs else None   # an absent population: null
    return {
        "run/iteration": learner.iteration, "run/cumulative_timesteps": learner.timesteps,
        "run/world_size": env.world,
        "run/cumulative_env_steps": learner.env_steps, "run/cumulative_updates": learner.updates,
        "run/wall_seconds": time.perf_counter() - run.t_start, "run/gamma": gamma, "run/gae_lambda": lam,
        "run/credit_horizon_seconds": credit_horizon_seconds(args.obs.decision_ms, gamma, lam),
        "run/ent_coef": learner.sched["ent_coef"], "run/ent_coef_noop": learner.sched["ent_coef_noop"],
        **({"run/teacher_kl": learner.sched["teacher_kl"]} if "teacher_kl" in learner.sched else {}),
        "run/lr_actor": learner.backoff.lr_actor, "run/lr_critic": learner.backoff.lr_critic,
        "run/lr_backoff": upd["run/lr_backoff"], "run/determinism_tier": args.determinism.tier,
        "run/resumed_with_drift": run.drifted, "run/state_digest": learner_digest(learner),
        "time/iteration": t_iter, "time/collection": roll.t_collect, "time/inference": roll.t_inference,
        "time/checkpoint": run.t_ckpt, "time/residual": t_iter - parts,
        "throughput/overall_steps_per_second": env.game_steps / max(t_iter, 1e-9),
        "throughput/engine_ticks_per_second": roll.engine_ticks / max(roll.t_collect, 1e-9),
        "throughput/discarded_rows_frac": 1.0 - float(trainable.sum()) / max(int(valid.sum()), 1),
        "throughput/inference_ms_per_round": 1e3 * roll.t_inference / max(roll.rounds, 1),
        "throughput/inference_rows_forward": roll.rows_forward,
        "throughput/inference_rows_skipped": roll.rows_skipped,
        "health/rss_peak_mb": rss_peak_mb(), **device_memory(env.device, env.vram_needed_mb), **pol,
        **episode_metrics(roll.episodes, args.obs.max_steps),
        "time/critic_pass": crit.seconds, "throughput/critic_rows": crit.rows, "time/gae": adv.seconds,
        "time/update": upd["time/update"],
        "throughput/collected_steps_per_second": env.game_steps / max(roll.t_collect, 1e-9),
        "ppo/explained_variance": adv.explained_variance, "ppo/reward_clip_frac": adv.reward_clip_frac,
        "health/worker_failures": len(roll.failures), "health/mask_disagreements": env.mask_disagreements,
        "health/illegal_action_rate": float((~crit.legal & trainable).sum()) / n_train,
        "env/episodes_completed": len(roll.episodes),
        "env/episode_steps_mean": mean([e.episode_steps for e in mine]),
        "env/crowns_for": mean([e.own_crowns for e in mine]),
        "env/crowns_against": mean([e.enemy_crowns for e in mine]),
        "env/draw_rate": mean([e.winner == 2 for e in mine]),
        "env/elixir_count_exact_frac": mean([e.elixir_count_exact for e in roll.episodes]),
        "env/elixir_count_exact_frac_countable": mean([e.elixir_count_exact
                                                       for e in countable_elixir_episodes(roll.episodes)]),
        "policy/legal_actions_mean": float(nl.mean()) if trainable.any() else None,
        "health/buffer_fill_frac": float(valid.sum()) / (T * env.R),
        "health/obs_codec_clipped": fst["obs_codec_clipped"],
        "health/obs_codec_rounded": fst["obs_codec_rounded"],
        "health/worker_restarts": fst["worker_restarts"],
        "health/rows_dropped_dead_worker": fst["rows_dropped_dead_worker"],
        "time/env": fst["env_ms"] / 1e3, "time/codec": fst["codec_ms"] / 1e3,
        "throughput/parent_wait_frac": fst["parent_wait_frac"],
        "throughput/boundary_mb_per_second": fst["bytes_out"] / 1e6 / max(roll.t_collect, 1e-9),
        "health/samples_unused_frac":
            1.0 - upd["ppo/actor_rows_seen"] / max(upd["update_rows"] * args.ppo.n_epochs, 1),
        "policy/cards_per_match": mean([e.cards_played for e in mine]),
        "policy/noop_rate": float((roll.action[trainable] == 0).mean()) if trainable.any() else None,
        "env/win_rate_vs_scripted": mean([e.outcome > 0 for e in mine if e.bucket == "scripted"]),
        **adv.stats, **{k: v for k, v in upd.items() if k.startswith("ppo/")},
        **lad.keys(time.perf_counter() - run.t_start), **lad_row,
    }


def record_iteration(args: Args, env: Env, learner: Learner, run: Run, lad: ladder.LadderLoop, roll: Rollout,
                     crit: Critic, adv: Advantages, update: dict[str, Any], ladder_row: dict[str, Any],
                     quiet: bool) -> Verdict:
    """The loop's step 7, on rank 0: the iteration's row (metric_row), its episodes and the alarms
    the row fires written (Run.record), the play heatmaps on their cadence, then what happens next:
    a halting alarm's, else the control file's or a stop signal's word, and whether a checkpoint is
    due (checkpoint_due)."""
    row = metric_row(args, env, learner, run, lad, roll, crit, adv, update, ladder_row)
    run.phase = "boundary"
    halts = [(a, v) for a, v in run.record(row, roll.episodes) if a.severity == "halt"]
    save_play_heatmaps(run.path, learner.iteration, roll, env, args.metrics.image_every)
    ctl = "" if halts else read_control(run.path, quiet) or run.stop.asked   # Ctrl-C, SIGTERM: "q"
    return Verdict(halts, checkpoint_due(learner, env, args, ctl, ladder_row), ctl == "q", lad.shared())


class Verdict(NamedTuple):
    """What rank 0 decided at the end of an iteration, which every rank then acts on (design 3.10):
    the halting alarms that fired, whether to checkpoint, whether to stop, and the ladder's pool
    and ratings (ladder.LadderLoop.shared). One process decides and acts on it in the same place."""
    halts: list[tuple[Alarm, float]]
    save: bool
    stop: bool
    pool: Any


def control_letter(f: Path) -> str:
    """The first letter of <run>/control, "" when there is none (a person may remove it any time)."""
    try:
        return f.read_text().strip()[:1]
    except FileNotFoundError:
        return ""


def wait_while_paused(f: Path, quiet: bool) -> str:
    """Block while <run>/control says "p" (checked every second); return what it says then. Called
    every cycle of collection as well as at the boundary, so a pause frees the machine within a
    round; its seconds land in that iteration's time/iteration (design 10.3)."""
    cmd = control_letter(f)
    if cmd == "p" and not quiet:
        print(f"\npaused: edit or remove {f} to continue", flush=True)
    while cmd == "p":
        time.sleep(1.0)
        cmd = control_letter(f)
    return cmd


def read_control(run: Path, quiet: bool) -> str:
    """Read <run>/control at the iteration boundary (the only point a resume can start from):
    "c" checkpoint now, "q" checkpoint and quit, "p" pause until the file says otherwise. The file
    is removed once acted on. A "c" or "q" written mid-iteration waits here, for the iteration's
    end; a "p" is also obeyed between cycles (Run.between_cycles)."""
    f = run / "control"
    cmd = wait_while_paused(f, quiet)
    f.unlink(missing_ok=True)
    return cmd


def checkpoint_due(learner: Learner, env: Env, args: Args, ctl: str, lad_row: dict[str, Any]) -> bool:
    """On the every_env_steps cadence, when the control file asks, and after every gate whatever it
    decided (design 7.4), so a candidate's learner can always be resumed."""
    every, step = max(args.checkpoint.every_env_steps, 1), learner.env_steps
    return step // every > (step - env.game_steps) // every or ctl in ("c", "q") or "time/gate" in lad_row


def progress_line(iteration: int, t: int, T: int, rounds: int, seconds: float) -> str:
    """The one line a person sees while collecting (rewritten in place with \\r on a tty)."""
    return f"  it {iteration} collecting cycle {t}/{T}  {rounds / max(seconds, 1e-9):.1f} rounds/s"


def _fmt(v: Any, fmt: str = "{:.3g}") -> str:
    if v is None:
        return "-"
    if not isinstance(v, float):   # counts, flags and names as they are
        return str(v)
    return fmt.format(v)


def console_block(row: dict[str, Any], fired: Sequence[tuple[Alarm, float]] = (), full: bool = False) -> str:
    """The compact block a person watches each iteration: two dozen numbers on labelled lines. An
    absent key prints as "-" (the console never indexes a fixed key list into a crash, design 9.1).
    With full=True (--metrics.console-full) every key follows, grouped by prefix."""
    g = row.get

    def f(k: str, fmt: str = "{:.3g}") -> str:
        return _fmt(g(k), fmt)

    lines = [f"it {f('run/iteration')}  timesteps {f('run/cumulative_timesteps')}  env_steps "
             f"{f('run/cumulative_env_steps')}  wall {f('run/wall_seconds', '{:.0f}')}s",
             f"  speed   {f('throughput/collected_steps_per_second', '{:.0f}')} env/s collecting, "
             f"{f('throughput/overall_steps_per_second', '{:.0f}')} overall, "
             f"{f('throughput/inference_ms_per_round', '{:.2f}')} ms inference/round   "
             # the parts time/residual is taken from, so the line adds up to the iteration
             f"time {f('time/iteration', '{:.1f}')}s = collect {f('time/collection', '{:.1f}')} "
             f"(inference {f('time/inference', '{:.1f}')}) + critic {f('time/critic_pass', '{:.1f}')} "
             f"+ gae {f('time/gae', '{:.1f}')} + update {f('time/update', '{:.1f}')} "
             f"+ gate {f('time/gate', '{:.1f}')} "
             f"+ probe {f('time/probe', '{:.1f}')} + ckpt {f('time/checkpoint', '{:.1f}')} "
             f"+ other {f('time/residual', '{:.1f}')}",
             f"  learn   policy_loss {f('ppo/policy_loss')} value_loss {f('ppo/value_loss')} "
             f"kl {f('ppo/kl')} clip {f('ppo/clip_fraction', '{:.3f}')} "
             f"ev {f('ppo/explained_variance', '{:.2f}')} "
             f"H_norm {f('ppo/entropy_normalised', '{:.3f}')} forced {f('ppo/forced_frac', '{:.2f}')}",
             f"  play    cards/match {f('policy/cards_per_match', '{:.1f}')} win_vs_scripted "
             f"{f('env/win_rate_vs_scripted', '{:.2f}')} blue_mirror {f('env/win_rate_by_seat', '{:.2f}')} "
             f"draw {f('env/draw_rate', '{:.2f}')} episodes {f('env/episodes_completed')} "
             f"illegal {f('health/illegal_action_rate')}"]
    champ = g("ladder/champion_id")
    if champ is not None:
        r, se = g(f"ladder/rating/{champ}"), g(f"ladder/rating_se/{champ}")
        rating = "-" if r is None else f"{r:.0f} +- {se:.0f}" if se is not None else f"{r:.0f}"
        gate = ("none yet" if not g("ladder/gate_attempts")
                else (g("ladder/gate_failed_condition") or "passed"))
        lines.append(f"  ladder  champion {champ} rating {rating} "
                     f"above_v0 {f('ladder/rating_above_v0', '{:.0f}')} "
                     f"elo_readout {f('ladder/elo_readout', '{:.0f}')} pool {f('ladder/pool_size')} "
                     f"last gate {gate}")
    if fired:
        lines.append("  alarms  " + "  ".join(f"{a.name}({a.severity})" for a, _ in fired))
    if full:
        groups: dict[str, list[str]] = {}
        for k, v in row.items():
            grp, _, name = k.partition("/")
            groups.setdefault(grp, []).append(f"{name}={_fmt(v, '{:.4g}')}")
        lines += [f"  [{grp}] " + "  ".join(items) for grp, items in groups.items()]
    return "\n".join(lines)


# --- 12. Snapshots and the ladder's players (design 7.6, 7.3, 3.2) ------------------------------
# A snapshot is the ACTOR alone (actor trunk + policy head), fp16 in safetensors, with a
# ladder.SnapshotSpec naming the arch/obs/codec digests it was built for. Two ways it plays:
#   - in training (pool seats, group >= 0), from the rectangle's packed rows exactly like the
#     learner's rows (codec.unpack of the same rows), one batched forward per group;
#   - in evaluation (ladder.EvalRunner), from raw env observations: packed with the run's codec
#     table and unpacked again, so it sees exactly what it saw as the learner (codec's
#     pack(unpack_numpy(x)) == x, farm.py section 4). The static planes are taken from the
#     observation's own rows (the ActFn is not told the seat), which is what static_planes holds.

ACTOR_PREFIXES = ("actor_trunk.", "policy.")
"""The state-dict keys a snapshot keeps: what acting needs. The critic never plays."""


def actor_tensors(model: ActorCritic) -> dict[str, np.ndarray]:
    """The actor's tensors as float32 numpy (SnapshotStore.save stores floats as fp16)."""
    return {k: (v.detach().to("cpu").numpy() if not v.is_floating_point()
                else v.detach().to("cpu", torch.float32).numpy())
            for k, v in model.state_dict().items() if k.startswith(ACTOR_PREFIXES)}


def write_snapshot(run: Path, model: ActorCritic, *, obs_digest: str, action_digest: str,
                   codec_table_digest: str, step: int, context: str, run_id_: str) -> str:
    """Store the live actor under ladder/snapshots/<sha16>/; returns the pool id "snap:<sha16>".
    obs_digest is the EVALUATION env's (frame_stack 1), which EvalRunner.check_pair compares."""
    geo, net = model.geo, model.net
    spec = ladder.SnapshotSpec(
        arch_digest=arch_digest(geo, net), obs_digest=obs_digest, action_digest=action_digest,
        codec_version=codec.CODEC_VERSION, codec_table_digest=codec_table_digest, frame_stack=geo.frame_stack,
        num_cards=geo.card_vocab(), vector_size=geo.vector_size, step=int(step), context=context,
        run_id=run_id_, arch={"geometry": msgspec.to_builtins(geo), "net": dataclasses.asdict(net)},
        builder=msgspec.UNSET if SCRIPT == ladder.DEFAULT_BUILDER else SCRIPT)
    return ladder.snapshot_player_id(ladder.SnapshotStore(run).save(actor_tensors(model), spec))


def actor_from_snapshot(spec: Any, tensors: dict[str, np.ndarray], device: torch.device | str) -> ActorCritic:
    """Build the network spec.arch describes and load its actor (fp16 -> float32). The rebuilt
    arch_digest must equal the spec's, else refused naming both (a builder that drifted)."""
    geo = msgspec.convert(spec.arch["geometry"], NetGeometry)
    net = msgspec.convert(spec.arch["net"], NetArgs)
    if arch_digest(geo, net) != spec.arch_digest:
        raise ladder.SnapshotMismatch(f"snapshot arch_digest is {spec.arch_digest} but its arch rebuilds to "
                                      f"{arch_digest(geo, net)}: "
                                      f"{SCRIPT}'s network changed since it was saved")
    model = ActorCritic(geo, net, 0)
    want = {k for k in model.state_dict() if k.startswith(ACTOR_PREFIXES)}
    if want != set(tensors):
        raise ladder.SnapshotMismatch(f"snapshot tensors differ from the actor's: "
                                      f"missing {sorted(want - set(tensors))[:4]}, "
                                      f"unexpected {sorted(set(tensors) - want)[:4]}")
    sd = model.state_dict()
    model.load_state_dict({**sd, **{k: torch.as_tensor(np.asarray(v)).to(sd[k].dtype)
                                    for k, v in tensors.items()}})
    return model.to(device).eval()


class NetPlayer:
    """A network as a ladder player. Called, a ladder.ActFn over raw env observations: pack with the
    run's codec table, unpack, and pick each row's action as release_mode says (decode_fn) from
    the caller's uniforms (one per seat, from that seat's own stream). act_rows does the same from
    rows already packed with that table (ladder.RowsAct: the evaluation farm's rectangle), so a
    forced row is neither unpacked nor forwarded, and nothing is packed twice."""

    def __init__(self, model: ActorCritic, table: Any, device: torch.device | str,
                 release_mode: str = "stochastic") -> None:
        self.model, self.table, self.device = model, table, device
        self.decode = decode_fn(release_mode, "ladder.release_mode")
        self.packer = codec.Packer(table)

    def __call__(self, obs: dict[str, np.ndarray], u: np.ndarray) -> np.ndarray:
        rows = np.zeros((int(np.asarray(u).shape[0]), self.table.row_bytes), np.uint8)
        self.packer.pack(obs, rows, 0)
        return self.act_rows(rows, np.asarray(obs["spatial"])[:, list(self.table.static_index)], u)

    def act_rows(self, rows: np.ndarray, statics: np.ndarray, u: np.ndarray) -> np.ndarray:
        """rows: uint8 (B, row_bytes); statics: (B, s, H, W), each row's static planes (its seat's)."""
        dev = self.device
        st = torch.as_tensor(np.asarray(statics, np.float32), device=dev)

        def obs_of(idx: np.ndarray) -> Any:
            return codec.unpack(self.table, torch.as_tensor(rows[idx], device=dev), st[idx],
                                torch.arange(idx.size, device=dev), None)
        ut = torch.as_tensor(np.asarray(u), dtype=torch.float32, device=dev)
        forced = forced_rows(codec.host_mask(self.table, rows))
        with torch.inference_mode():   # forced rows: neither unpacked nor forwarded
            a = self.model.act_and_hold(obs_of, ut, forced, self.decode)
        return a.action.cpu().numpy()


def run_codec_table(run: Path) -> Any:
    """The codec table of a run's evaluation env (ladder/eval_env.json), as EvalRunner decides it."""
    env, _ = ladder.read_run_env(run)
    seed = (int(json.loads((run / "config.json").read_bytes()).get("master_seed", 0))
            if (run / "config.json").exists() else 0)
    return ladder._eval_preflight(msgspec.json.encode(ladder.eval_env_spec(env)), seed)[1]


def snapshot_policy_builder(run_dir: str | Path | None, device: str = "cpu", table: Any = None,
                            release_mode: str | None = None, store: Any = None) -> Any:
    """ladder.PolicyBuilder for a run: snapshot_id -> act(obs_batch, uniforms) -> actions. The
    snapshot is loaded from <run>/ladder/snapshots/<id>/ (or `store`: a ladder.SnapshotStore, which
    may also know snapshot folders such as a shipped model's) and refused (by field) if its codec
    table is not the run's. `table`: the training run's own (in-process), or the evaluation env's;
    else read off the run. release_mode: None reads the run's config.json (ladder.release_mode,
    "stochastic" if absent). Without a run (run_dir None), table and store are given."""
    run = Path(run_dir) if run_dir is not None else None
    if release_mode is None:
        cfg = json.loads((run / "config.json").read_bytes()) if run and (run / "config.json").exists() else {}
        release_mode = str((cfg.get("ladder") or {}).get("release_mode", "stochastic"))
    tab = table if table is not None else run_codec_table(run)
    store = store or ladder.SnapshotStore(run)

    def build(snapshot_id: str) -> Any:
        spec, tensors = store.load(snapshot_id, {"codec_table_digest": tab.digest()})
        return NetPlayer(actor_from_snapshot(spec, tensors, device), tab, device, release_mode)
    return build


def checkpoint_policy_act(ckpt_dir: str | Path, device: str = "cpu", table: Any = None,
                          obs_digest: str | None = None, release_mode: str | None = None) -> Any:
    """A ladder.ActFn over raw env observations from a checkpoint's actor (runs/<id>/checkpoints/
    <step>/), as snapshot_policy_builder makes one from a snapshot, for a player that was never
    snapshotted (`checks.py play checkpoint:<dir>`). Every file is verified against the manifest
    (read_checkpoint), the network is rebuilt from the saved arch.json and the run's net section
    and refused by field if they disagree (check_arch), and the actor is refused, naming both
    values, unless it saw what the evaluation env shows: one frame (frame_stack 1, as
    EvalPlayers.check_pair asks of a snapshot), the run's codec table (`table`: the evaluation
    env's, read off the run, directory two levels up, when None), and, given `obs_digest`, the
    evaluation env's observation. release_mode: None reads the run's ladder.release_mode."""
    ckpt = Path(ckpt_dir)
    model, man = actor_from_checkpoint(ckpt)
    tab = table if table is not None else run_codec_table(ckpt.parent.parent)
    for name, need in ([("codec_table_digest", tab.digest())]
                       + ([("obs_digest", obs_digest)] if obs_digest else [])):
        have = man.identity.get(name)
        if have != need:
            raise ladder.SnapshotMismatch(f"{ckpt}: the run trained with {name} {have}, the evaluation env "
                                          f"has {need}: the actor would see another observation; refused")
    if release_mode is None:
        release_mode = str((man.config.get("ladder") or {}).get("release_mode", "stochastic"))
    return NetPlayer(model.to(device).eval(), tab, device, release_mode)


def actor_from_checkpoint(ckpt: Path) -> tuple[ActorCritic, Manifest]:
    """A checkpoint's network on the cpu, its actor loaded, and its manifest: every file verified
    against the manifest (read_checkpoint), the network rebuilt from the saved arch.json and the
    run's net section and refused by field if they disagree (check_arch), frame_stack 1 only."""
    man, files = read_checkpoint(ckpt)
    arch_path = ckpt / "actor_critic" / "arch.json"
    saved = json.loads(files["actor_critic/arch.json"])
    geo = msgspec.convert(saved["geometry"], NetGeometry)
    if geo.frame_stack != 1:
        raise ladder.SnapshotMismatch(
            f"{ckpt}: frame_stack is {geo.frame_stack}; a player is handed one frame per decision, "
            f"so a stacked network cannot play yet (frame_stack 1 only)")
    model = ActorCritic(geo, msgspec.convert(man.config["net"], NetArgs), 0)
    check_arch(saved, model, str(arch_path))
    actor = load_tensors(files["actor_critic/actor.safetensors"])
    want = {k for k in model.state_dict() if k.startswith(ACTOR_PREFIXES)}
    if set(actor) != want:
        raise CheckpointFormatError(f"{ckpt / 'actor_critic/actor.safetensors'}: holds other tensors "
                                    f"than the actor's (missing {sorted(want - set(actor))[:4]}, unexpected "
                                    f"{sorted(set(actor) - want)[:4]})")
    model.load_state_dict({**model.state_dict(), **actor})
    return model, man


class Bot:
    """A trained snapshot as a royalegym Opponent: `act(obs, mask, rng) -> int` for one seat, so
    `royalegym.evaluate.evaluate`, `play_battle` and any tournament written against royalegym play
    it as they play a scripted bot, and measure it with their own evaluator (README, "Your bot in
    royalegym").

        bot = Bot("models/cpu-pointer")            # or runs/<id>/ladder/snapshots/<sha16>
        action = bot.act(obs["blue"], obs["blue"]["action_mask"], np.random.default_rng(0))

    folder: a shipped model (the snapshot's spec.json and actor.safetensors beside its run's
    eval_env.json, as the README ships one) or a run's ladder/snapshots/<id>/ (the run's
    ladder/eval_env.json two levels up). Before it acts, a run's snapshot is checked against its
    folder's name, the weights against spec.json (SnapshotStore.load), and the codec table the
    evaluation env decides against the one the snapshot was trained on. Each observation's spaces
    are checked against the snapshot's geometry, naming the field.

    It acts as the ladder's players do (NetPlayer): the observation packed with the codec table
    and unpacked again, which is what it saw as a learner; the mask given is the mask obeyed; a
    decision with only the no-op legal is the no-op without a forward; any other draws one
    uniform from `rng` and decodes it by release_mode ("stochastic", as the ladder plays, unless
    asked otherwise), so a seeded call reproduces. A frame-stacked snapshot keeps its own stack
    and starts a fresh one at each episode's first observation (its clock reads the full regular
    time), so one Bot plays one seat at a time; a single-frame one holds no state between calls."""

    def __init__(self, folder: str | Path, device: str = "cpu", release_mode: str = "stochastic") -> None:
        folder = Path(folder)
        store = ladder.SnapshotStore(None)
        sid = store.add_folder(folder)                      # FileNotFoundError: not a snapshot folder
        if folder.parent.name == "snapshots" and folder.name != sid:
            raise ladder.SnapshotMismatch(f"{folder / 'spec.json'} does not hash to its folder name ({sid}); "
                                          f"the spec was edited after it was saved")
        env_json = next((p for p in (folder / "eval_env.json", folder.parent.parent / "eval_env.json")
                         if p.is_file()), None)
        if env_json is None:
            raise FileNotFoundError(f"{folder}: no eval_env.json beside it (a shipped model) or two levels "
                                    f"up (a run's ladder/snapshots/<id>/): "
                                    f"copy the run's ladder/eval_env.json in, as the README ships a model")
        _, self.table, _ = ladder._eval_preflight(env_json.read_bytes(), 0)
        spec, tensors = store.load(sid, {"codec_table_digest": self.table.digest()})
        self.folder, self.spec, self.device = folder, spec, torch.device(device)
        self.model = actor_from_snapshot(spec, tensors, self.device)
        self.geo = self.model.geo
        self.decode = decode_fn(release_mode, "release_mode")
        self.packer = codec.Packer(self.table)
        self.statics_index = list(self.table.static_index)
        self.clock = self.geo.field(CLOCK).start if CLOCK in dict(self.geo.vector_layout) else None
        if self.geo.frame_stack > 1 and self.clock is None:
            raise ladder.SnapshotMismatch(f"{folder}: a frame-stacked snapshot needs the observation's clock "
                                          f"to see an episode start, and its vector_layout has none")
        self.frames = np.zeros((1, self.geo.frame_stack, self.table.row_bytes), np.uint8)
        self.live = np.zeros((1, self.geo.frame_stack), bool)

    def reset(self) -> None:
        """Forget the frame stack: the next observation is an episode's first (act sees that by itself)."""
        self.frames[:] = 0
        self.live[:] = False

    def observe(self, obs: dict[str, np.ndarray], mask: np.ndarray) -> Any:
        """This decision's codec.Obs (a batch of one): the observation checked, packed with `mask` as its
        action mask, pushed onto the frame stack, and unpacked. Call once a decision: it advances the
        stack."""
        self._check(obs, mask)
        if self.clock is not None and self.geo.frame_stack > 1 and obs["vector"][self.clock] == 1.0:
            # the clock reads the full regular time at tick 0 only
            self.reset()
        self.frames[0, :-1], self.live[0, :-1] = self.frames[0, 1:].copy(), self.live[0, 1:].copy()
        one = {k: np.asarray(v)[None] for k, v in obs.items()}
        one["action_mask"] = np.asarray(mask, bool)[None]
        self.packer.pack(one, self.frames[0], self.geo.frame_stack - 1)
        self.live[0, -1] = True
        statics = torch.as_tensor(one["spatial"][:, self.statics_index].astype(np.float32),
                                  device=self.device)
        fv = torch.as_tensor(self.live, device=self.device) if self.geo.frame_stack > 1 else None
        return codec.unpack(self.table, torch.as_tensor(self.frames, device=self.device), statics,
                            torch.zeros(1, dtype=torch.int64, device=self.device), fv)

    def act(self, obs: dict[str, np.ndarray], mask: np.ndarray, rng: np.random.Generator) -> int:
        """royalegym's Opponent.act: one seat's action, legal under `mask`."""
        o = self.observe(obs, mask)
        u = torch.tensor([rng.random()], dtype=torch.float32, device=self.device)
        with torch.inference_mode():
            acted = self.model.act_and_hold(unpacked(o), u, forced_rows(np.asarray(mask, bool)[None]),
                                            self.decode)
        return int(acted.action[0])

    def _check(self, obs: dict[str, np.ndarray], mask: np.ndarray) -> None:
        """The observation's spaces against the snapshot's, one line naming the field that differs."""
        want = {"spatial": tuple(self.geo.spatial_shape), "vector": (self.geo.vector_size,),
                "action_mask": (self.geo.n_actions,)}
        have = {"spatial": np.shape(obs.get("spatial")), "vector": np.shape(obs.get("vector")),
                "action_mask": np.shape(mask)}
        for key in want:
            if have[key] != want[key]:
                raise ladder.SnapshotMismatch(
                    f"{self.folder}: the observation's {key} has shape {have[key]}, the snapshot was trained "
                    f"on {want[key]} (spec.json arch.geometry): play it on the env of its eval_env.json")


# What the ladder's side of the loop (ladder.LadderLoop) asks of this script's networks: it never
# imports the script (the direction codec <- farm <- ladder <- ppo_clash holds), it is handed these.
NETS = ladder.LearnerNets(load=actor_from_snapshot, write=write_snapshot, players=snapshot_policy_builder,
                          act=NetPlayer, decode=decode_fn)


def main(argv: Sequence[str] | None = None) -> int:
    """`python ppo_clash.py --profile cpu [--field value ...]` trains; `--resume runs/<dir>
    [--checkpoint DIR] [--allow-identity-drift] [--field value ...]` continues a run from its
    latest checkpoint (or the one named), with the run's own config.json under any flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    resume = ckpt = None
    drift = False
    rest: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, val = argv[i].partition("=")
        if name in ("--resume", "--checkpoint"):
            if not eq:
                i += 1
                val = argv[i] if i < len(argv) else ""
            resume, ckpt = (val, ckpt) if name == "--resume" else (resume, val)
        elif name == "--allow-identity-drift":
            drift = True
        else:
            rest.append(argv[i])
        i += 1
    try:
        for name, val, like in (("--resume", resume, "runs/<dir>"),
                                ("--checkpoint", ckpt, "runs/<dir>/checkpoints/<step>")):
            if val == "":   # Path("") is the current folder: never what was meant
                raise ConfigError(f"{name} needs a value, such as {name} {like}")
        if resume is not None:
            ck = Path(ckpt) if ckpt else latest_checkpoint(Path(resume))
            if ck is None and not (Path(resume) / "config.json").exists():
                raise ConfigError(f"{resume} has no checkpoint to resume "
                                  f"(looked in {Path(resume) / 'checkpoints'}) "
                                  "and no config.json to start it again from: "
                                  "start it with the command that made it")
            args = parse_args(["--config", str(Path(resume) / "config.json"), *rest])
            if ck is None:   # it stopped before its first checkpoint: start it again, in its own folder
                args.runs_dir = str(Path(resume).parent)
        else:
            ck = None
            args = parse_args(rest)
        resolve_device(args)
        train(args, resume=ck, allow_identity_drift=drift)
    except (ConfigError, ladder.LadderSetupChanged, IdentityMismatch, CheckpointFormatError,
            ArchMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except AlarmHalt as e:
        print(f"HALT: {e}", file=sys.stderr)
        return 3
    except RunCrashed as e:   # one line; the traceback is in the run directory (design 10.3)
        print(f"error: {e}", file=sys.stderr)
        return 130 if e.interrupted else 1
    except OSError as e:   # a full or read-only disk while the run is set up (the loop's are RunCrashed)
        fault = disk_fault(e, "the run folder")
        if fault is None:
            raise
        print(f"error: {e}; {fault}; then run the same command again", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
