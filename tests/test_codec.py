"""Tests for codec.py on RustEngine observations from real battles (design 3.3, 1.2).

Every width-sensitive check runs on two geometries: the default SpatialObsBuilder and one
with Reveal(enemy_spell_aim=True), which adds a spatial plane. A third, card_identity=True,
exercises the card_ids region. No width, plane count or offset is written here as a literal:
each is read from the environment's space or layout.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

import codec

ROOT = Path(__file__).resolve().parents[1]

GEOMETRIES = {
    "default": {},
    "spell_aim": {"reveal": "enemy_spell_aim"},
    "card_ids": {"card_identity": True},
}


def _builder_kwargs(kind: str) -> dict:
    from royalegym import Reveal

    kw = dict(GEOMETRIES[kind])
    if kw.get("reveal") == "enemy_spell_aim":
        kw["reveal"] = Reveal(enemy_spell_aim=True)
    return kw


def _play(kind: str, battles: int = 4, decisions: int = 60, seed: int = 11):
    """Random legal play (a card in about one decision in five), returning the vec env and a
    list of batched observations, one per decision: battles * 2 * decisions rows in all."""
    from royalegym import ClashSelfPlayVecEnv, RustEngine, SpatialObsBuilder
    from royalegym.env import EnvFactory

    factory = EnvFactory(engine=RustEngine, obs_builder=(SpatialObsBuilder, _builder_kwargs(kind)))
    vec = ClashSelfPlayVecEnv(battles, factory, viser=None)
    obs, _ = vec.reset(seed=seed)
    rng = np.random.Generator(np.random.PCG64(seed))
    out = [obs]
    for _ in range(decisions - 1):
        acts = []
        for row in obs["action_mask"]:
            legal = np.flatnonzero(row)
            acts.append(int(rng.choice(legal)) if (len(legal) > 1 and rng.random() < 0.2) else 0)
        obs, *_ = vec.step(np.asarray(acts))
        out.append(obs)
    return vec, out


@pytest.fixture(scope="module", params=["default", "spell_aim"])
def played(request):
    vec, sample = _play(request.param)
    layout = vec.envs[0].obs_builder.spatial_layout()
    table = codec.decide_table(vec.single_observation_space, layout, sample)
    return request.param, vec, layout, sample, table


def _pack_all(table, sample):
    packer = codec.Packer(table)
    n = sample[0]["spatial"].shape[0]
    out = np.zeros((n * len(sample), table.row_bytes), dtype=np.uint8)
    for i, obs in enumerate(sample):
        packer.pack(obs, out, i * n)
    return packer, out


def _cat(sample, key):
    return np.concatenate([o[key] for o in sample], axis=0)


def _unpack_all(table, sample, out, k=None):
    statics = torch.from_numpy(codec.static_planes(table, sample[0]))
    n = sample[0]["spatial"].shape[0]
    seat = torch.arange(n).remainder(2).repeat(len(sample))
    return codec.unpack(table, torch.from_numpy(out), statics, seat)


# --- the rule --------------------------------------------------------------------------


def test_two_geometries_really_differ(played):
    """The second geometry exists to move the plane count; if it stopped doing so the suite
    would silently test one geometry twice."""
    kind, vec, layout, _, table = played
    S = vec.single_observation_space["spatial"].shape[0]
    assert len(table.plane) == S == len(layout)
    other_vec, _ = _play("spell_aim" if kind == "default" else "default", battles=1, decisions=1)
    assert other_vec.single_observation_space["spatial"].shape[0] != S


def test_row_bytes_equals_the_spec_formula(played):
    """design 1.2: row_bytes = H*W*((S - s - f)*1 + f*2) + 2*V + ceil(A/8), with s and f counted
    here independently of the codec: s from the declaration, f from the sample (the non-static
    planes that are not integer-valued, or whose declared bound exceeds a byte)."""
    _, vec, layout, sample, table = played
    space = vec.single_observation_space
    S, H, W = space["spatial"].shape
    V = space["vector"].shape[0]
    A = space["action_mask"].shape[0]
    s = sum(1 for _, static in layout if static)
    sp = _cat(sample, "spatial")
    high = space["spatial"].high.reshape(S, -1).max(axis=1)
    f = sum(
        1
        for i, (_, static) in enumerate(layout)
        if not static and (high[i] > 255 or not np.all(sp[:, i] == np.rint(sp[:, i])))
    )
    assert f >= 1, "the hit-point planes should be float16 on a real battle sample"
    assert table.row_bytes == H * W * ((S - s - f) * 1 + f * 2) + 2 * V + math.ceil(A / 8)
    # and the rows are really that long
    _, out = _pack_all(table, sample[:2])
    assert out.shape[1] == table.row_bytes


def test_declared_static_plane_is_not_stored_and_constant_plane_is(played):
    _, vec, layout, sample, table = played
    declared = [i for i, (_, static) in enumerate(layout) if static]
    assert declared, "the default builder declares the water and no-deploy planes static"
    assert list(table.static_index) == declared
    for i in declared:
        assert i not in table.uint8_index and i not in table.f16_index
    # A plane that never changed over the sample but is NOT declared static stays stored:
    # existence is decided from the declaration, never from a sample (a tower that never fell).
    sp = _cat(sample, "spatial")
    constant = [i for i, (_, st) in enumerate(layout) if not st and np.all(sp[:, i] == sp[0, i])]
    assert constant, "expected at least one never-changing non-static plane in a short sample"
    for i in constant:
        assert table.plane[i][1] in ("uint8", "float16")


def test_uint8_planes_and_mask_round_trip_bit_exact(played):
    _, _, _, sample, table = played
    packer, out = _pack_all(table, sample)
    assert packer.clipped == 0 and packer.rounded == 0
    dec = _unpack_all(table, sample, out)
    sp = _cat(sample, "spatial")
    u8 = list(table.uint8_index)
    assert len(u8) > 0
    assert np.array_equal(dec.spatial.numpy()[:, u8], sp[:, u8])
    assert np.array_equal(dec.mask.numpy(), _cat(sample, "action_mask") != 0)
    # the static planes come back too (scattered from the per-seat copy)
    st = list(table.static_index)
    assert np.array_equal(dec.spatial.numpy()[:, st], sp[:, st])


def test_float16_parts_within_2_to_the_minus_10_relative(played):
    _, _, _, sample, table = played
    _, out = _pack_all(table, sample)
    dec = _unpack_all(table, sample, out)
    tol = lambda x: 2.0**-10 * np.abs(x) + 2.0**-24  # fp16 subnormal spacing near 0
    f16 = list(table.f16_index)
    sp = _cat(sample, "spatial")[:, f16]
    assert np.any(sp != 0), "the hit-point planes should carry values"
    assert np.all(np.abs(dec.spatial.numpy()[:, f16] - sp) <= tol(sp))
    vec = _cat(sample, "vector")
    assert np.all(np.abs(dec.vector.numpy() - vec) <= tol(vec))


def test_mask_planes_rebuilt_equal_the_env_bit_for_bit(played):
    _, _, _, sample, table = played
    _, out = _pack_all(table, sample)
    dec = _unpack_all(table, sample, out)
    env_planes = _cat(sample, "mask_planes")
    assert env_planes.any(), "no legal deploy on any sampled state: the comparison would be vacuous"
    assert np.array_equal(dec.mask_planes.numpy(), env_planes.astype(np.float32))


def test_frame_stack_gather_and_frame_validity(played):
    """A (B, k, row_bytes) gather unpacks to the k frames' planes concatenated oldest first,
    the newest frame's vector and mask; an invalid frame is zeroed."""
    _, _, _, sample, table = played
    _, out = _pack_all(table, sample)
    n = sample[0]["spatial"].shape[0]
    statics = torch.from_numpy(codec.static_planes(table, sample[0]))
    seat = torch.arange(n).remainder(2)
    raw = torch.from_numpy(out).view(len(sample), n, -1)
    stacked = torch.stack([raw[5], raw[6]], dim=1)  # (n, 2, rb): frame 5 older, frame 6 newer
    dec = codec.unpack(table, stacked, statics, seat)
    one5 = codec.unpack(table, raw[5], statics, seat)
    one6 = codec.unpack(table, raw[6], statics, seat)
    S = table.spatial_shape[0]
    assert dec.spatial.shape[1] == 2 * S
    assert torch.equal(dec.spatial[:, :S], one5.spatial) and torch.equal(dec.spatial[:, S:], one6.spatial)
    assert torch.equal(dec.mask_planes, torch.cat([one5.mask_planes, one6.mask_planes], dim=1))
    assert torch.equal(dec.vector, one6.vector) and torch.equal(dec.mask, one6.mask)
    valid = torch.ones(n, 2, dtype=torch.bool)
    valid[0, 0] = False
    dec = codec.unpack(table, stacked, statics, seat, frame_valid=valid)
    assert torch.count_nonzero(dec.spatial[0, :S]) == 0 and torch.count_nonzero(dec.mask_planes[0, :4]) == 0
    assert torch.equal(dec.spatial[1, :S], one5.spatial[1])


def test_a_single_row_unpacks_like_a_batch(played):
    """B = k = 1 with an odd row_bytes: torch treats the one-row slice as contiguous and keeps its
    odd stride, which float16 views refuse; unpack must not depend on the batch size."""
    _, _, _, sample, table = played
    _, out = _pack_all(table, sample[:1])
    n = sample[0]["spatial"].shape[0]
    statics = torch.from_numpy(codec.static_planes(table, sample[0]))
    raw = torch.from_numpy(out)
    whole = codec.unpack(table, raw, statics, torch.arange(n).remainder(2))
    one = codec.unpack(table, raw[1:2], statics, torch.tensor([1]))
    assert torch.equal(one.spatial[0], whole.spatial[1]) and torch.equal(one.vector[0], whole.vector[1])
    assert torch.equal(one.mask[0], whole.mask[1])


def test_the_host_mask_is_the_env_mask_and_what_unpack_decodes(played):
    """host_mask reads the stored mask on the host, for one frame and for the newest of a stack,
    on both geometries: the env's own action_mask bit for bit, and unpack's Obs.mask."""
    _, _, _, sample, table = played
    _, out = _pack_all(table, sample)
    env_mask = _cat(sample, "action_mask") != 0
    host = codec.host_mask(table, out)
    assert host.dtype == np.bool_ and host.shape == env_mask.shape == (len(out), table.n_actions)
    assert np.array_equal(host, env_mask) and env_mask[:, 1:].any() and not env_mask[:, 1:].all()
    assert np.array_equal(host, _unpack_all(table, sample, out).mask.numpy())
    stacked = np.stack([np.roll(out, 1, axis=0), out], axis=1)        # (B, k=2, row_bytes), newest last
    assert np.array_equal(codec.host_mask(table, stacked), env_mask)


def test_the_host_vector_is_what_unpack_decodes_bit_for_bit(played):
    """host_vector reads the stored vector on the host (newest frame of a stack too), on both
    geometries: unpack's Obs.vector, bit for bit, the fp16 rounding of the env's own."""
    _, _, _, sample, table = played
    _, out = _pack_all(table, sample)
    host = codec.host_vector(table, out)
    want = _unpack_all(table, sample, out).vector.numpy()
    assert host.dtype == np.float32 and host.tobytes() == want.tobytes()
    assert np.array_equal(host, _cat(sample, "vector").astype(np.float16).astype(np.float32))
    stacked = np.stack([np.roll(out, 1, axis=0), out], axis=1)
    assert codec.host_vector(table, stacked).tobytes() == want.tobytes()


# --- identity and refusals ---------------------------------------------------------------


def test_table_digest_is_canonical_and_moves_with_the_table(played):
    _, _, _, _, table = played
    again = msgspec.json.decode(table.canonical_json(), type=codec.CodecTable)
    assert again == table and again.digest() == table.digest()
    assert len(table.digest()) == 64
    plane = list(table.plane)
    plane[0] = (plane[0][0], "float16", 1.0)
    changed = msgspec.structs.replace(table, plane=tuple(plane))
    assert changed.digest() != table.digest()
    assert codec.CODEC_VERSION == 1


def test_unknown_key_is_refused_by_name():
    import gymnasium as gym

    vec, sample = _play("default", battles=1, decisions=3)
    spaces = dict(vec.single_observation_space.spaces)
    spaces["velocity"] = gym.spaces.Box(0, 1, (3,), np.float32)
    with pytest.raises(ValueError, match="'velocity'"):
        codec.decide_table(gym.spaces.Dict(spaces), vec.envs[0].obs_builder.spatial_layout(), sample)


def test_static_declaration_that_varies_is_refused_by_name():
    vec, sample = _play("default", battles=1, decisions=3)
    layout = list(vec.envs[0].obs_builder.spatial_layout())
    i = next(j for j, (_, st) in enumerate(layout) if st)
    planted = [dict(o) for o in sample]
    planted[1]["spatial"] = planted[1]["spatial"].copy()
    planted[1]["spatial"][0, i] += 1.0
    with pytest.raises(ValueError, match=rf"plane {i} '{layout[i][0]}' is declared static"):
        codec.decide_table(vec.single_observation_space, layout, planted)


def test_clip_counter_fires_on_a_planted_out_of_bound_value(played):
    _, _, _, sample, table = played
    obs = {k: v.copy() for k, v in sample[3].items()}
    p = table.uint8_index[0]
    obs["spatial"][1, p, 2, 3] = 300.0
    obs["spatial"][0, p, 0, 0] = 2.5
    packer = codec.Packer(table)
    out = np.zeros((obs["spatial"].shape[0], table.row_bytes), dtype=np.uint8)
    packer.pack(obs, out, 0)
    assert packer.clipped == 1
    assert packer.rounded == 1
    H, W = table.spatial_shape[1:]
    assert out[1, table.offsets["uint8"][0] + 2 * W + 3] == 255


def test_pack_refuses_an_observation_from_another_space(played):
    _, _, _, sample, table = played
    obs = dict(sample[0])
    obs.pop("mask_planes")
    with pytest.raises(ValueError, match="differ from the codec table"):
        codec.Packer(table).pack(obs, np.zeros((8, table.row_bytes), np.uint8), 0)


def test_card_ids_get_their_own_exact_uint8_region():
    vec, sample = _play("card_ids", battles=2, decisions=30)
    layout = vec.envs[0].obs_builder.spatial_layout()
    table = codec.decide_table(vec.single_observation_space, layout, sample)
    ids_space = vec.single_observation_space["card_ids"]
    assert table.ids == "uint8" and table.ids_shape == ids_space.shape
    assert table.offsets["card_ids"][1] - table.offsets["card_ids"][0] == int(np.prod(ids_space.shape))
    _, out = _pack_all(table, sample)
    dec = _unpack_all(table, sample, out)
    ids = _cat(sample, "card_ids")
    assert ids.any()
    assert np.array_equal(dec.card_ids.numpy(), ids.astype(np.int64))
    # without card identity the table has no ids field in its encoding at all
    vec2, sample2 = _play("default", battles=1, decisions=3)
    t2 = codec.decide_table(vec2.single_observation_space, vec2.envs[0].obs_builder.spatial_layout(), sample2)
    assert b'"ids"' not in t2.canonical_json()


def test_packing_never_imports_torch():
    """design 3.2: a worker that packs never loads torch. Run in a fresh interpreter."""
    script = textwrap.dedent(
        """
        import sys, numpy as np
        import codec
        from royalegym import ClashSelfPlayVecEnv, RustEngine, SpatialObsBuilder
        from royalegym.env import EnvFactory
        vec = ClashSelfPlayVecEnv(1, EnvFactory(engine=RustEngine, obs_builder=(SpatialObsBuilder, {})),
                                  viser=None)
        obs, _ = vec.reset(seed=1)
        t = codec.decide_table(vec.single_observation_space, vec.envs[0].obs_builder.spatial_layout(), obs)
        out = np.zeros((2, t.row_bytes), np.uint8)
        codec.Packer(t).pack(obs, out, 0)
        codec.static_planes(t, obs)
        print("torch" in sys.modules, int(out.any()))
        """
    )
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "1"]
