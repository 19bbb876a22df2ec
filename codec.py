"""codec.py -- the observation codec: how one seat's observation is stored as one buffer row.

Stage owned: the first stage of the data path. A rollout worker calls `Packer.pack` to quantise
the observations its vec env just returned and write them straight into their final resting
place, a row of the shared-memory experience rectangle (design 3.3). The learner calls `unpack`
on the device to turn stored rows back into float tensors; the policy always acts on
unpack(pack(obs)), never on the raw float32 (design 3.3), so the stored bytes are exactly the
input that produced each stored log-prob.

Reads:  the environment's observation space, its ObsBuilder.spatial_layout(), and a sample of
        real observations (to decide storage), then batched observation dicts.
Writes: nothing on disk. Rows of `row_bytes` uint8 into a caller-owned array.

Where to start reading: the row layout below, then `Packer.pack` (section 3, what a worker
writes) and `unpack` (section 4, what the learner reads); `decide_table` (section 2) says how
each plane's storage is chosen.

Design sections (docs/design.md): 3.3 (the codec rule and its notes: quantise in the worker, act
on the decoded bytes, the mask travels with the transition, bit-packed; CodecTable, ObsCodec),
1.2 (row_bytes arithmetic).

Import rule: this module imports numpy and msgspec at the top and torch only inside `unpack`,
so a worker that packs never loads torch (design 3.2; tests/test_codec.py asserts it in a fresh
interpreter).

Row layout (all little-endian), regions in this order:
    uint8 planes   n_u8  * H*W  B    the planes that are small non-negative integers, exact
    float16 planes n_f16 * H*W*2 B   everything else that is stored (the hit-point planes)
    vector         V * 2 B           float16; the builder clips it to [0, 1]
    action mask    ceil(A / 8) B     bit-packed, LSB first (np.packbits bitorder="little")
    card_ids       prod(ids) B       uint8, only when the builder emits card identity
Not stored: the planes spatial_layout() declares static (held once per seat, `static_planes`)
and mask_planes (rebuilt at unpack from the stored mask: they are action_mask[1:] reshaped).
"""

from __future__ import annotations

import hashlib
import importlib
import math
import sys
from typing import Any, NamedTuple, Sequence

import msgspec
import numpy as np

# --- 1. Constants -------------------------------------------------------------------------

CODEC_VERSION = 1
"""The rule's version. The TABLE is decided per run from the space; this number changes only
when the rule (the row layout or the storage decisions) changes. Recorded in the run identity
beside the table digest (design 2.3)."""

KNOWN_KEYS = ("spatial", "vector", "action_mask", "mask_planes", "card_ids")
"""Every observation key the codec knows how to store. Any other key is refused at
decide_table, by name: reading the keys it knows and silently dropping the rest would throw
away a new builder feature before the network ever saw it (design 3.3)."""


UINT8_MAX = 255

assert sys.byteorder == "little", "the row layout is little-endian; unpack views bytes as float16"


# --- 2. The table (design 3.3) ------------------------------------------------------------


class CodecTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """How each observation key is stored, decided once per run from the space and a sample.

    Logged, hashed into the run identity (codec_table_digest) and written into every snapshot's
    spec.json: two runs whose tables differ are not comparable, and the digest is what says so.
    The geometry fields make the table self-contained, so pack and unpack need nothing else."""

    plane: tuple[tuple[str, str, float], ...]  # per spatial plane: (name, storage, divisor)
    spatial_shape: tuple[int, int, int]  # (S, H, W), read from the space
    vector_size: int  # V
    n_actions: int  # A, the width of action_mask
    mask_planes_shape: tuple[int, int, int] | None = None  # (hand, tiles_y, tiles_x) if emitted
    ids_shape: tuple[int, int, int] | None = None  # card_ids (planes, H, W) if emitted
    vector: str = "float16"
    mask: str = "bitpack"
    ids: str | None = None  # "uint8" when card_ids is stored; absent from the encoding otherwise

    # Plane indices per storage, in layout order. Derived, so they are not fields.
    @property
    def uint8_index(self) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.plane) if p[1] == "uint8")

    @property
    def f16_index(self) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.plane) if p[1] == "float16")

    @property
    def static_index(self) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.plane) if p[1] == "static")

    @property
    def cells(self) -> int:
        return self.spatial_shape[1] * self.spatial_shape[2]

    @property
    def mask_bytes(self) -> int:
        return math.ceil(self.n_actions / 8)

    @property
    def ids_bytes(self) -> int:
        return 0 if self.ids_shape is None else int(np.prod(self.ids_shape))

    @property
    def offsets(self) -> dict[str, tuple[int, int]]:
        """(start, stop) byte offsets of each region within a row, in row order."""
        sizes = [
            ("uint8", len(self.uint8_index) * self.cells),
            ("float16", len(self.f16_index) * self.cells * 2),
            ("vector", self.vector_size * 2),
            ("mask", self.mask_bytes),
            ("card_ids", self.ids_bytes),
        ]
        out, at = {}, 0
        for name, size in sizes:
            out[name] = (at, at + size)
            at += size
        return out

    @property
    def row_bytes(self) -> int:
        """design 1.2: H*W*((S - s - f)*1 + f*2) + 2*V + ceil(A/8), plus the card_ids region."""
        return self.offsets["card_ids"][1]

    def canonical_json(self) -> bytes:
        return msgspec.json.encode(self, order="deterministic")

    def digest(self) -> str:
        """sha256 of the canonical JSON: the codec_table_digest of the run identity."""
        return hashlib.sha256(self.canonical_json()).hexdigest()


def env_row_bytes(obs_space: Any) -> int:
    """Bytes of one seat's observation as the environment hands it over (every key, its dtype).

    The denominator of the codec's compression ratio (design 1.2's float_row)."""
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in obs_space.spaces.values())


def _as_batches(sample: Any) -> list[dict[str, np.ndarray]]:
    if isinstance(sample, dict):
        return [sample]
    return list(sample)


def decide_table(obs_space: Any, spatial_layout: Sequence[tuple[str, bool]], sample: Any) -> CodecTable:
    """Apply the rule of design 3.3 to the space, the declared layout and a sample of real
    observations.

    obs_space: the vec env's single_observation_space (a gymnasium Dict).
    spatial_layout: ObsBuilder.spatial_layout(), ((name, static), ...) per spatial plane.
    sample: a batched observation dict (leading dim n) or a list of them.

    Storage is decided from the sample; EXISTENCE (static or not) only from the declaration.
    A tower plane is constant on any sample where no tower falls, so promoting "unchanged on a
    thousand states" to static would freeze a tower at full health for the rest of the run."""
    spaces = dict(obs_space.spaces)
    unknown = sorted(set(spaces) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(
            f"observation key(s) {unknown} are not known to codec.py (it stores {list(KNOWN_KEYS)}); "
            "storing them needs a codec rule, so extend codec.decide_table rather than let the "
            "network silently lose them"
        )
    for key in ("spatial", "vector", "action_mask"):
        if key not in spaces:
            raise ValueError(f"observation space has no {key!r} key; codec.py needs spatial, vector and "
                             "action_mask")
    batches = _as_batches(sample)
    if not batches or batches[0]["spatial"].shape[0] == 0:
        raise ValueError("decide_table needs a non-empty sample of real observations")
    for b in batches:
        extra = sorted(set(b) - set(spaces))
        if extra:
            raise ValueError(f"sample observation carries key(s) {extra} that the observation space does "
                             "not declare")

    sp = spaces["spatial"]
    S, H, W = (int(x) for x in sp.shape)
    if len(spatial_layout) != S:
        raise ValueError(
            f"spatial_layout() names {len(spatial_layout)} planes but the spatial space has {S}; "
            "the builder's layout and its space disagree"
        )
    high = np.asarray(sp.high, dtype=np.float64).reshape(S, -1).max(axis=1)
    low = np.asarray(sp.low, dtype=np.float64).reshape(S, -1).min(axis=1)
    values = np.concatenate([np.asarray(b["spatial"]) for b in batches], axis=0)  # (n, S, H, W)

    plane: list[tuple[str, str, float]] = []
    for i, (name, static) in enumerate(spatial_layout):
        if static:
            storage = "static"
        else:
            v = values[:, i]
            integral = bool(np.all(v == np.rint(v)))
            fits = high[i] <= UINT8_MAX and low[i] >= 0
            storage = "uint8" if (fits and integral) else "float16"
        plane.append((str(name), storage, 1.0))

    # The static planes are held once per seat; check now that they really are static over the
    # sample (per seat), because scattering a wrong constant plane in would be silent.
    static_idx = [i for i, p in enumerate(plane) if p[1] == "static"]
    for i in static_idx:
        for seat in (0, 1):
            v = values[seat::2, i]
            if len(v) and not np.all(v == v[0]):
                raise ValueError(
                    f"spatial plane {i} {plane[i][0]!r} is declared static by spatial_layout() but changes "
                    f"across the sample for seat {seat}; a static plane is stored once per seat, so the "
                    "builder's declaration is wrong and storing it as static would feed the network a stale "
                    "plane"
                )

    A = int(spaces["action_mask"].shape[0])
    V = int(spaces["vector"].shape[0])
    mask_planes_shape = None
    if "mask_planes" in spaces:
        mp = tuple(int(x) for x in spaces["mask_planes"].shape)
        if int(np.prod(mp)) != A - 1:
            raise ValueError(
                f"mask_planes {mp} has {int(np.prod(mp))} cells but action_mask[1:] has {A - 1}; "
                "the codec rebuilds mask_planes from the stored mask and needs them to agree"
            )
        mask_planes_shape = mp  # type: ignore[assignment]
    ids_shape, ids = None, None
    if "card_ids" in spaces:
        cs = spaces["card_ids"]
        vocab = int(np.asarray(cs.high).max()) + 1
        if vocab > UINT8_MAX + 1:
            raise ValueError(f"card_ids vocabulary {vocab} does not fit a byte; codec.py stores card_ids "
                             "as uint8")
        ids_shape, ids = tuple(int(x) for x in cs.shape), "uint8"
    return CodecTable(
        plane=tuple(plane),
        spatial_shape=(S, H, W),
        vector_size=V,
        n_actions=A,
        mask_planes_shape=mask_planes_shape,  # type: ignore[arg-type]
        ids_shape=ids_shape,  # type: ignore[arg-type]
        ids=ids,
    )


def format_table(table: CodecTable, obs_space: Any | None = None) -> str:
    """The table as `python codec.py` prints it (design 3.8 step 3): one line per plane, then the row."""
    lines = [f"codec v{CODEC_VERSION}  table {table.digest()[:16]}"]
    for i, (name, storage, div) in enumerate(table.plane):
        stored = {"uint8": table.cells, "float16": 2 * table.cells, "static": 0}[storage]
        lines.append(f"  plane {i:2d} {name:<22s} {storage:<8s} /{div:g}  {stored:6d} B")
    off = table.offsets
    lines.append(f"  vector V={table.vector_size:<5d}            float16        "
                 f"{off['vector'][1] - off['vector'][0]:6d} B")
    lines.append(f"  action_mask A={table.n_actions:<5d}       bitpack        {table.mask_bytes:6d} B")
    if table.mask_planes_shape is not None:
        lines.append(f"  mask_planes {table.mask_planes_shape}   derived from the mask     0 B")
    if table.ids_shape is not None:
        lines.append(f"  card_ids {table.ids_shape}        uint8          {table.ids_bytes:6d} B")
    lines.append(f"  row_bytes {table.row_bytes}")
    if obs_space is not None:
        env = env_row_bytes(obs_space)
        lines.append(f"  env hands over {env} B per row: {env / table.row_bytes:.2f}x smaller")
    return "\n".join(lines)


# --- 3. Packing, worker side (numpy only) -------------------------------------------------


def static_planes(table: CodecTable, obs: dict[str, np.ndarray]) -> np.ndarray:
    """The declared-static planes for seat 0 (blue) and seat 1 (red): float32 (2, s, H, W).

    `obs` is a batched vec-env observation whose rows alternate blue, red (ClashSelfPlayVecEnv:
    slot 2g is blue, 2g+1 red). The observation is in the acting player's own frame, so the two
    seats' planes are normally equal; they are kept per seat so that nothing depends on it."""
    sp = np.asarray(obs["spatial"])
    if sp.shape[0] < 2:
        raise ValueError("static_planes needs a batched observation with both seats (at least 2 rows)")
    idx = list(table.static_index)
    return np.ascontiguousarray(sp[0:2][:, idx].astype(np.float32))


class Packer:
    """Quantise batched observations into rows of `table.row_bytes` bytes. numpy only.

    `clipped` counts uint8 values that fell outside [0, 255] and were clipped
    (health/obs_codec_clipped). A plane was admitted to uint8 on its declared bound, so a
    non-zero count is a bug report against the builder's declaration, not a tolerance.
    `rounded` counts values in a uint8 plane that were not whole numbers and were rounded
    (health/obs_codec_rounded): the plane was admitted on a sample that was integral, so this
    too says the decision was made on a sample that did not represent the game."""

    def __init__(self, table: CodecTable):
        self.table = table
        self.clipped = 0
        self.rounded = 0
        self._u8 = np.asarray(table.uint8_index, dtype=np.intp)
        self._f16 = np.asarray(table.f16_index, dtype=np.intp)
        off = table.offsets
        self._o = {k: slice(a, b) for k, (a, b) in off.items()}
        self._keys = {"spatial", "vector", "action_mask"} | (
            {"mask_planes"} if table.mask_planes_shape is not None else set()
        ) | ({"card_ids"} if table.ids_shape is not None else set())

    def pack(self, obs: dict[str, np.ndarray], out: np.ndarray, row: int) -> None:
        """Write obs row i into out[row + i] for every i. `out` is uint8 (rows, row_bytes)."""
        if obs.keys() != self._keys:
            raise ValueError(
                f"observation keys {sorted(obs)} differ from the codec table's {sorted(self._keys)}; "
                "the table was decided on another observation space"
            )
        sp = obs["spatial"]
        n = sp.shape[0]
        dst = out[row : row + n]
        if dst.shape[0] != n:
            raise IndexError(f"rows {row}..{row + n - 1} do not fit in an output of {out.shape[0]} rows")
        if len(self._u8):
            v = sp[:, self._u8].reshape(n, -1)
            lo, hi = v.min(), v.max()
            if lo < 0 or hi > UINT8_MAX:
                bad = (v < 0) | (v > UINT8_MAX)
                self.clipped += int(bad.sum())
                v = np.clip(v, 0, UINT8_MAX)
            r = np.rint(v)
            if not np.array_equal(r, v):
                self.rounded += int((r != v).sum())
            dst[:, self._o["uint8"]] = r  # whole float32 values -> uint8, exact
        if len(self._f16):
            dst[:, self._o["float16"]] = sp[:, self._f16].reshape(n, -1).astype("<f2").view(np.uint8)
        dst[:, self._o["vector"]] = np.asarray(obs["vector"], dtype="<f2").view(np.uint8)
        dst[:, self._o["mask"]] = np.packbits(np.asarray(obs["action_mask"]) != 0, axis=1, bitorder="little")
        if self.table.ids_shape is not None:
            dst[:, self._o["card_ids"]] = np.asarray(obs["card_ids"], dtype=np.uint8).reshape(n, -1)


def host_mask(table: CodecTable, rows: np.ndarray) -> np.ndarray:
    """(B, A) bool, on the host: the action mask of stored rows, (B, row_bytes) or the newest frame
    of (B, k, row_bytes); what `unpack` returns as Obs.mask, read without torch or a device. The
    learner decides from it which rows need the actor before anything reaches the device, so that
    choice costs no device-to-host round trip (design 3.6)."""
    a, b = table.offsets["mask"]
    newest = rows[:, -1] if rows.ndim == 3 else rows
    return np.unpackbits(newest[:, a:b], axis=1, count=table.n_actions, bitorder="little").astype(bool)


def host_vector(table: CodecTable, rows: np.ndarray) -> np.ndarray:
    """(B, V) float32, on the host: the observation vector of stored rows (the newest frame), the
    fp16 values `unpack` returns as Obs.vector, read without torch: what the learner's bookkeeping
    reads of every row, a forced one included, without unpacking it."""
    a, b = table.offsets["vector"]
    newest = rows[:, -1] if rows.ndim == 3 else rows
    return np.ascontiguousarray(newest[:, a:b]).view("<f2").astype(np.float32)


# --- 4. Unpacking, learner side (torch, imported lazily) ----------------------------------


class Obs(NamedTuple):
    """What the networks read (design 5.1's ObsBatch), all on one device."""

    spatial: Any  # (B, k*S, H, W) float32
    mask_planes: Any  # (B, k*hand, tiles_y, tiles_x) float32, or None if the env emits none
    vector: Any  # (B, V) float32, newest frame
    mask: Any  # (B, A) bool, newest frame: the mask that governs this row's action
    card_ids: Any  # (B, k*c, H, W) int64, or None


def _torch() -> Any:
    """torch, imported on first use and only here: the pack path runs in rollout workers, which
    must never load it (design 3.2; tests/test_codec.py checks it in a fresh interpreter)."""
    return importlib.import_module("torch")


def _bytes_as_half(x: Any) -> Any:
    """Reinterpret the last dimension's bytes as float16. A fresh copy, not .contiguous(): a
    slice whose other dimensions have size 1 counts as contiguous to torch and keeps its odd
    stride (row_bytes is odd whenever ceil(A/8) is), and view(float16) refuses that stride."""
    torch = _torch()
    return x.clone(memory_format=torch.contiguous_format).view(torch.float16)


def unpack(table: CodecTable, raw: Any, statics: Any, seat: Any, frame_valid: Any = None) -> Obs:
    """Dequantise stored rows on raw's device.

    raw:         uint8 (B, row_bytes), or (B, k, row_bytes) with frames ordered oldest..newest
                 (the frame-stack gather of design 1.1 is just indexing the rectangle).
    statics:     float32 (2, s, H, W) from `static_planes`, on the same device.
    seat:        int64 (B,), 0 blue / 1 red: which seat's static planes to scatter in.
    frame_valid: optional bool (B, k); False zeroes that frame (history from before the
                 episode began, so a new episode never sees the previous one's board)."""
    torch = _torch()
    if raw.dtype != torch.uint8:
        raise TypeError(f"unpack expects uint8 rows, got {raw.dtype}")
    if raw.dim() == 2:
        raw = raw.unsqueeze(1)
    B, k, rb = raw.shape
    if rb != table.row_bytes:
        raise ValueError(f"rows are {rb} bytes but the codec table's row_bytes is {table.row_bytes}")
    S, H, W = table.spatial_shape
    off = table.offsets
    dev = raw.device

    spatial = torch.empty((B, k, S, H, W), dtype=torch.float32, device=dev)
    u8, f16, st = table.uint8_index, table.f16_index, table.static_index
    if u8:
        a, b = off["uint8"]
        div = torch.tensor([table.plane[i][2] for i in u8], dtype=torch.float32, device=dev)
        spatial[:, :, list(u8)] = (raw[:, :, a:b].reshape(B, k, len(u8), H, W).float()
                                   / div.view(1, 1, -1, 1, 1))
    if f16:
        a, b = off["float16"]
        half = _bytes_as_half(raw[:, :, a:b])
        spatial[:, :, list(f16)] = half.reshape(B, k, len(f16), H, W).float()
    if st:
        spatial[:, :, list(st)] = statics[seat].unsqueeze(1).expand(B, k, len(st), H, W)

    a, b = off["mask"]
    shifts = torch.arange(8, dtype=torch.uint8, device=dev)
    bits = (raw[:, :, a:b].unsqueeze(-1) >> shifts) & 1  # LSB first, as np.packbits(bitorder="little")
    mask_all = bits.reshape(B, k, -1)[:, :, : table.n_actions].bool()  # (B, k, A)

    mask_planes = None
    if table.mask_planes_shape is not None:
        hand, ty, tx = table.mask_planes_shape
        mask_planes = mask_all[:, :, 1:].reshape(B, k, hand, ty, tx).float()

    card_ids = None
    if table.ids_shape is not None:
        a, b = off["card_ids"]
        c = table.ids_shape[0]
        card_ids = raw[:, :, a:b].reshape(B, k, c, H, W).long()

    if frame_valid is not None:
        fv = frame_valid.to(dev).view(B, k, 1, 1, 1)
        spatial = spatial * fv
        if mask_planes is not None:
            mask_planes = mask_planes * fv
        if card_ids is not None:
            card_ids = card_ids * fv

    a, b = off["vector"]
    vector = _bytes_as_half(raw[:, -1, a:b]).float()
    return Obs(
        spatial=spatial.reshape(B, k * S, H, W),
        mask_planes=None if mask_planes is None else mask_planes.reshape(B, -1, *table.mask_planes_shape[1:]),
        vector=vector,
        mask=mask_all[:, -1],
        card_ids=None if card_ids is None else card_ids.reshape(B, -1, H, W),
    )


# --- 5. `python codec.py`: print the table and time the pack --------------------------------


def measure(battles: int = 8, decisions: int = 150, seed: int = 1) -> dict[str, Any]:
    """Play `battles` RustEngine battles with random legal play for `decisions` decisions,
    decide the table on those observations, then time Packer.pack over all of them.

    Returns the table, row bytes, the env's float row and pack microseconds per row. Timed
    after the battles are played, so engine time is not in the number."""
    import time

    from royalegym import ClashSelfPlayVecEnv, RustEngine, SpatialObsBuilder
    from royalegym.env import EnvFactory

    vec = ClashSelfPlayVecEnv(battles, EnvFactory(engine=RustEngine, obs_builder=(SpatialObsBuilder, {})),
                              viser=None)
    obs, _ = vec.reset(seed=seed)
    rng = np.random.Generator(np.random.PCG64(seed))
    sample = [obs]
    for _ in range(decisions - 1):
        acts = [int(rng.choice(np.flatnonzero(m))) if rng.random() < 0.2 else 0 for m in obs["action_mask"]]
        obs, *_ = vec.step(np.asarray(acts))
        sample.append(obs)
    table = decide_table(vec.single_observation_space, vec.envs[0].obs_builder.spatial_layout(), sample)
    packer = Packer(table)
    n = sample[0]["spatial"].shape[0]
    out = np.zeros((n * len(sample), table.row_bytes), dtype=np.uint8)
    t0 = time.perf_counter()
    for i, o in enumerate(sample):
        packer.pack(o, out, i * n)
    seconds = time.perf_counter() - t0
    return {
        "table": table,
        "obs_space": vec.single_observation_space,
        "rows": out.shape[0],
        "row_bytes": table.row_bytes,
        "env_row_bytes": env_row_bytes(vec.single_observation_space),
        "pack_us_per_row": seconds / out.shape[0] * 1e6,
        "clipped": packer.clipped,
    }


if __name__ == "__main__":
    m = measure()
    print(format_table(m["table"], m["obs_space"]))
    print(f"  pack: {m['pack_us_per_row']:.1f} us/row over {m['rows']} rows (batches of 16 rows, numpy)")
