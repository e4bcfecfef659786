"""The ``kv_write`` family (kernels/kv_write.cu, hcache/ops/kv_write.py): ``kv_write``.

Oracles: the NumPy reference (:mod:`hcache.ops.reference`) must give the kernel's bytes and
status count; both must match a naive token-by-token model of ``kernels/kv_write.cu`` (ragged
rows, explicit positions, paged block tables, NHD views). The kernel runs on the host emulation
of the real ``.cu`` (``emu``, ``emu-reverse``) and on CuPy (``gpu`` tier); every array sits
between canary bytes, which must survive. The quantizing write ``kv_write_fp8`` of the same
family is tested in ``tests/test_op_kv_write_fp8.py`` (on these cases and models).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hcache import ops
from hcache.dtypes import DTYPE_NAMES, resolve_dtype
from hcache.ops._launch import warps_per_token
from hcache.ops.tables import KVGroup

from helpers import host
from kernel_cases import (
    BACKENDS,
    HEAD_DIMS,
    WITH_REFERENCE,
    Arena,
    as_bytes,
    assert_same_bytes,
    dtypes,
    int32_on,
    kernel_env,
    misaligns,
    on,
    twins,
)

INT32_MAX = 2**31 - 1

# --- random cases: the kernel against the reference and a naive model ------------------------


@st.composite
def write_cases(draw, modes=("ragged", "positions", "paged", "nhd", "decode"), components=(2,)):
    """A write of ``components`` (2: K and V; 1: a latent cache, rows in ``k`` only)."""
    mode = draw(st.sampled_from(modes))
    layout = "NHD" if mode == "nhd" else "HND"
    if mode == "decode":
        layout = draw(st.sampled_from(["HND", "NHD"]))
    dtype = draw(dtypes)
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    seq = draw(st.integers(1, 6))
    slots = draw(st.integers(1, 5))
    batch = draw(st.integers(0, 4))
    counts = draw(st.lists(st.integers(0, 4), min_size=batch, max_size=batch))
    pad = draw(st.integers(0, 3))
    heads = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    if layout == "NHD":
        heads = [heads[0]] * len(heads)
    if mode == "nhd":
        counts = [draw(st.integers(0, 3))] * batch
        pad = 0
    if mode == "decode":   # one token per row (the reference's fast paths), then padding
        counts = [1] * batch
    tokens = sum(counts) + pad
    lengths = draw(st.lists(st.integers(0, seq + 1), min_size=batch, max_size=batch))
    if draw(st.booleans()):   # one length for every row: the strided fast path
        lengths = [draw(st.integers(0, seq + 1))] * batch
    rows = list(draw(st.permutations(list(range(slots)) + [-1] * batch))[:batch])
    hostile = draw(st.integers(0, 3)) == 0
    if hostile and batch:  # out-of-range slots / positions must be skipped and counted
        rows[draw(st.integers(0, batch - 1))] = draw(st.sampled_from([slots, slots + 7, -5]))
        lengths[draw(st.integers(0, batch - 1))] = draw(st.sampled_from([-1, -3, seq, 2**31 - 1]))
    positions = draw(st.lists(st.integers(-1, seq - 1), min_size=tokens, max_size=tokens))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    for b in range(batch):  # one token per (row, position): duplicates would race on a GPU
        seen = set()
        for t in range(offsets[b], offsets[b + 1]):
            if positions[t] in seen:
                positions[t] = -1
            seen.add(positions[t])
    if hostile and tokens:
        positions[draw(st.integers(0, tokens - 1))] = draw(st.sampled_from([seq, -9]))
    width = draw(st.integers(1, 3))
    table = list(draw(st.permutations(list(range(slots)) + [-1] * batch * width))
                 [:batch * width])
    if hostile and table:
        table[draw(st.integers(0, len(table) - 1))] = draw(st.sampled_from([slots, -4]))
    # decode: mostly in range (the reference's fast paths), rows to slots by identity and/or
    # no cache_lengths (position 0) sometimes
    identity = no_lengths = False
    if mode == "decode":
        if draw(st.integers(0, 3)):
            batch = min(batch, slots)
            counts = [1] * batch
            tokens = batch + pad
            rows = list(draw(st.permutations(range(slots)))[:batch])
            lengths = [draw(st.integers(0, seq - 1))] * batch
            if draw(st.booleans()):
                lengths = draw(st.lists(st.integers(0, seq - 1), min_size=batch,
                                        max_size=batch))
            positions = [0] * tokens
        identity = draw(st.booleans())
        if identity:
            rows = list(range(batch))
        no_lengths = draw(st.integers(0, 3)) == 0
        if no_lengths:
            lengths = [0] * batch
    return dict(mode=mode, dtype=dtype, head_dim=head_dim, seq=seq, slots=slots, batch=batch,
                components=draw(st.sampled_from(components)),
                identity=identity, no_lengths=no_lengths, layout=layout,
                counts=counts, tokens=tokens, heads=heads, lengths=lengths, rows=rows,
                positions=positions, width=width, table=table,
                single=draw(st.booleans()), layer=draw(st.integers(0, len(heads) - 1)),
                misalign=draw(misaligns), seed=draw(st.integers(0, 2**32 - 1)))


def _write_state(arena, c, *, labels=None, rows_of=None):
    """The caches (``keep``: the buffers to compare), K/V rows, keyword arguments and status of
    case ``c``; ``labels`` are the group's layer_indices, ``rows_of(arena, shape)`` makes a
    K/V row array (default: random bytes of the cache dtype)."""
    dt, d, s, comps = c["dtype"], c["head_dim"], c["seq"], c["components"]
    mis = c["misalign"] * dt.itemsize
    if c["layout"] == "NHD":
        buf = arena.array((c["slots"], comps, len(c["heads"]), s, c["heads"][0], d), dt,
                          misalign=mis)
        layers = [buf[:, :, i] for i in range(len(c["heads"]))]
        group, keep = KVGroup(layers, layout="NHD", layer_indices=labels), [buf]
    else:
        layers = [arena.array((c["slots"], comps, h, s, d), dt, misalign=mis)
                  for h in c["heads"]]
        group, keep = KVGroup(layers, layer_indices=labels), layers
    if rows_of is None:
        def rows_of(arena, shape):
            return arena.array(shape, dt)
    k = [rows_of(arena, (c["tokens"], h, d)) for h in c["heads"]]
    v = [rows_of(arena, (c["tokens"], h, d)) if comps == 2 else None for h in c["heads"]]
    offsets = arena.int32(np.concatenate([[0], np.cumsum(c["counts"])]).astype(np.int32))
    kwargs = dict(batch=c["batch"], cache_lengths=arena.int32(c["lengths"]))
    if c["mode"] == "decode":
        kwargs["uniform_tokens"] = 1
        if c["no_lengths"]:
            del kwargs["cache_lengths"]
        if not c["identity"]:
            kwargs["row_to_slot"] = arena.int32(c["rows"])
    elif c["mode"] == "nhd":
        kwargs.update(uniform_tokens=max(c["counts"][0] if c["counts"] else 1, 1),
                      row_to_slot=arena.int32(c["rows"]))
    else:
        kwargs["seq_offsets"] = offsets
    if c["mode"] == "ragged":
        kwargs["row_to_slot"] = arena.int32(c["rows"])
    elif c["mode"] == "positions":
        kwargs["positions"] = arena.int32(c["positions"])
        kwargs["row_to_slot"] = arena.int32(c["rows"])
    elif c["mode"] == "paged":
        kwargs["block_table"] = arena.int32(c["table"], (c["batch"], c["width"]))
    status = arena.array((1,), np.int32, fill="zeros")
    return group, keep, k, v, kwargs, status


def _naive_write(c, layers, k, v, layout):
    """Token-by-token model of kernels/kv_write.cu (V only when there is a V plane); returns
    the number of reported tokens."""
    out = [a.copy() for a in layers]
    offsets = np.concatenate([[0], np.cumsum(c["counts"])])
    reported = 0
    for t in range(c["tokens"]):
        rows = [b for b in range(c["batch"]) if offsets[b] <= t < offsets[b + 1]]
        if not rows:  # padding
            continue
        b = rows[0]
        if c["mode"] == "positions":
            pos = c["positions"][t]
        else:
            pos = c["lengths"][b] + t - offsets[b]
        if pos == -1:
            continue
        if pos < 0:
            reported += 1
            continue
        for j, (layer, cap) in enumerate(zip(out, [c["seq"]] * len(out))):
            if c["mode"] == "paged":
                col = pos // cap
                if col >= c["width"]:
                    bad = True
                    slot = None
                else:
                    slot, p, bad = c["table"][b * c["width"] + col], pos % cap, False
            else:
                slot, p, bad = c["rows"][b], pos, False
            if not bad and slot == -1:
                continue
            if bad or not (0 <= slot < c["slots"]) or p >= cap:
                reported += j == 0
                continue
            planes = [k[j]] if c["components"] == 1 else [k[j], v[j]]
            for kv, rows in enumerate(planes):
                if layout == "HND":
                    layer[slot, kv, :, p] = rows[t]
                else:
                    layer[slot, kv, p] = rows[t]
    return out, reported


@pytest.mark.parametrize("kind", BACKENDS)
@given(c=write_cases())
def test_kv_write_matches_reference_and_model(kind, c):
    """Random ragged / positions / paged / NHD writes, one layer or all: the kernel's caches and
    status equal the reference's, which equal the token-by-token model's."""
    xp, backend = kernel_env(kind)
    ref_arena, k_arena = twins(c["seed"], xp)
    rg, rkeep, rk, rv, rkw, rstatus = _write_state(ref_arena, c)
    kg, kkeep, kk, kv, kkw, kstatus = _write_state(k_arena, c)
    single = c["single"]
    if single:
        li = c["layer"]
        args_r = (rk[li], rv[li])
        args_k = (kk[li], kv[li])
    else:
        args_r, args_k = (rk, rv), (kk, kv)
    layers_before = [a.copy() for a in rg.layers]
    ks = [rk[c["layer"]]] if single else rk
    vs = [rv[c["layer"]]] if single else rv
    picked = [layers_before[c["layer"]]] if single else layers_before
    expected, reported = _naive_write(c, picked, ks, vs, rg.layout)
    layers = c["layer"] if single else None
    ops.kv_write(rg, *args_r, layers=layers, status=rstatus, **rkw)
    ops.kv_write(kg, *args_k, layers=layers, status=kstatus, backend=backend, **kkw)
    for r, k in zip(rkeep, kkeep):
        assert_same_bytes(r, k)
    assert int(rstatus[0]) == int(kstatus[0])
    if c["tokens"]:
        got = [rg.layers[c["layer"]]] if single else rg.layers
        for e, g in zip(expected, got):
            assert_same_bytes(e, g)
        assert int(rstatus[0]) == reported
    k_arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@given(c=write_cases(modes=("decode",)))
def test_kv_write_decode_matches_reference_and_model(kind, c):
    """Decode-shaped writes (one token per row at ``cache_lengths``, rows to slots by
    ``row_to_slot`` or identity, HND and NHD, one length for all rows or not, sometimes out of
    range): the kernel, the reference (whose fast paths these are) and the token-by-token model
    agree."""
    test_kv_write_matches_reference_and_model.hypothesis.inner_test(kind, c)


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=60)
@given(c=write_cases(components=(1,)))
def test_kv_write_latent_matches_reference_and_model(kind, c):
    """Latent caches (one component: ``[slots, 1, H, S, D]``, rows in ``k``, ``v`` None) in
    every mode, HND and NHD, one layer or all: the kernel writes exactly the latent rows where
    the reference and the token-by-token model put them, and never outside the buffers."""
    test_kv_write_matches_reference_and_model.hypothesis.inner_test(kind, c)


@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_kv_write_latent_takes_no_v_and_kv_groups_need_one(kind):
    """A latent group refuses V rows, a K/V group refuses ``v=None``; ``v=None`` for every
    layer of a latent group is the list of Nones."""
    xp, backend = kernel_env(kind)
    latent = [xp.zeros((2, 1, 1, 4, 8), np.float16) for _ in range(2)]
    paired = xp.zeros((2, 2, 1, 4, 8), np.float16)
    rows = xp.ones((1, 1, 8), np.float16)
    kw = dict(uniform_tokens=1, batch=1, backend=backend)
    with pytest.raises(ValueError, match=r"v\[0\]: expected None"):
        ops.kv_write(KVGroup(latent), rows, rows, layers=0, **kw)
    with pytest.raises(ValueError, match=r"v: expected V rows"):
        ops.kv_write(KVGroup([paired]), rows, None, layers=0, **kw)
    with pytest.raises(ValueError, match=r"v: expected V rows"):
        ops.kv_write(KVGroup([paired]), [rows], None, **kw)
    assert not any(host(a).any() for a in latent + [paired])
    ops.kv_write(KVGroup(latent), [rows, 2 * rows], None, **kw)
    for j, a in enumerate(latent):
        want = np.zeros((2, 1, 1, 4, 8), np.float16)
        want[0, 0, 0, 0] = j + 1
        np.testing.assert_array_equal(host(a), want)


@st.composite
def unsorted_offsets(draw):
    batch = draw(st.integers(1, 6))
    return dict(offsets=draw(st.lists(st.integers(-2, 12), min_size=batch + 1,
                                      max_size=batch + 1)),
                tokens=draw(st.integers(1, 12)),
                lengths=draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch)),
                seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=30)
@given(c=unsorted_offsets())
def test_kv_write_unsorted_seq_offsets_match_the_reference(kind, c):
    """Unsorted (unchecked, device-side) seq_offsets: the kernel's bytes and status equal the
    reference's, which follows the kernel's binary search step for step."""
    # seq_offsets are device data the wrapper cannot check; the reference used searchsorted,
    # whose answer on unsorted offsets differs from the kernel's binary search.
    xp, backend = kernel_env(kind)
    batch = len(c["lengths"])
    rng = np.random.default_rng(c["seed"])
    k = rng.integers(1, 256, (c["tokens"], 2, 4), dtype=np.uint8)
    v = rng.integers(1, 256, (c["tokens"], 2, 4), dtype=np.uint8)
    out = []
    for mod, be in ((np, None), (xp, backend)):
        arena = Arena(np.random.default_rng(c["seed"]), mod)
        layer = arena.array((batch, 2, 2, 16, 4), np.uint8, fill="zeros")
        status = arena.array((1,), np.int32, fill="zeros")
        ops.kv_write(KVGroup([layer]), on(mod, k), on(mod, v), layers=0,
                     seq_offsets=int32_on(mod, c["offsets"]),
                     cache_lengths=int32_on(mod, c["lengths"]), status=status, backend=be)
        arena.check_canaries()
        out.append((as_bytes(layer), int(as_bytes(status).view(np.int32)[0])))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    assert out[0][1] == out[1][1]


# --- every dtype x the head dims the issue names: the kernel against a fixed model -----------

@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("head_dim", (8, 36, 80, 96, 512))
def test_ragged_write_with_padding(kind, dtype, head_dim):
    """Ragged rows with an empty row, a row without a slot, padding and an overflowing token:
    the kernel's caches and status equal the hand-written expected writes."""
    # Rows of 3, 0 and 2 tokens plus 2 padding tokens; row 1 has no slot (-1); the last token
    # of row 2 would land past max_seq_len and must be skipped and counted.
    xp, backend = kernel_env(kind)
    dt = resolve_dtype(dtype)
    arena = Arena(np.random.default_rng(head_dim + 1), xp)
    layers = [arena.array((4, 2, h, 6, head_dim), dt) for h in (1, 3)]
    k = [arena.array((7, h, head_dim), dt) for h in (1, 3)]
    v = [arena.array((7, h, head_dim), dt) for h in (1, 3)]
    offsets = arena.int32([0, 3, 3, 5])
    starts = arena.int32([1, 0, 5])
    rows = arena.int32([2, -1, 0])
    status = arena.array((1,), np.int32, fill="zeros")
    before = [host(a).copy() for a in layers]
    ops.kv_write(KVGroup(layers), k, v, seq_offsets=offsets, cache_lengths=starts,
                 row_to_slot=rows, status=status, backend=backend)
    for layer, b, kk, vv in zip(layers, before, k, v):
        want = b.copy()
        kk, vv = host(kk), host(vv)
        for t, (slot, pos) in enumerate([(2, 1), (2, 2), (2, 3)]):
            want[slot, 0, :, pos] = kk[t]
            want[slot, 1, :, pos] = vv[t]
        want[0, 0, :, 5] = kk[3]
        want[0, 1, :, 5] = vv[3]
        assert np.array_equal(as_bytes(layer), as_bytes(want))
    assert int(host(status)[0]) == 1
    arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("head_dim", (8, 36, 80, 96, 512))
def test_paged_write_through_block_table(kind, dtype, head_dim):
    """Writes through a block table, one column past the pool: the kernel's pool and status
    equal the hand-written expected writes."""
    xp, backend = kernel_env(kind)
    dt = resolve_dtype(dtype)
    arena = Arena(np.random.default_rng(head_dim + 2), xp)
    pool = arena.array((5, 2, 2, 2, head_dim), dt)  # 5 blocks of 2 tokens
    k = arena.array((4, 2, head_dim), dt)
    v = arena.array((4, 2, head_dim), dt)
    offsets = arena.int32([0, 3, 4])
    starts = arena.int32([1, 2])
    table = arena.array((2, 2), np.int32)
    table[...] = on(xp, np.array([[4, 1], [0, 9]], np.int32))
    status = arena.array((1,), np.int32, fill="zeros")
    before = host(pool).copy()
    ops.kv_write(KVGroup([pool]), k, v, layers=0, seq_offsets=offsets, cache_lengths=starts,
                 block_table=table, status=status, backend=backend)
    want = before.copy()
    kk, vv = host(k), host(v)
    # row 0: positions 1, 2, 3 -> (block 4, 1), (block 1, 0), (block 1, 1);
    # row 1: position 2 -> column 1 -> block 9, out of range: skipped and counted.
    for t, (blk, off) in enumerate([(4, 1), (1, 0), (1, 1)]):
        want[blk, 0, :, off] = kk[t]
        want[blk, 1, :, off] = vv[t]
    assert np.array_equal(as_bytes(pool), as_bytes(want))
    assert int(host(status)[0]) == 1
    arena.check_canaries()


# --- the reference against hand-computed caches ----------------------------------------------

def test_kv_write_ragged_rows_at_their_lengths():
    """Reference kv_write of ragged rows against hand-computed K and V rows."""
    cache = np.zeros((2, 2, 1, 4, 1), np.int8)
    k = np.array([[[1]], [[2]], [[3]]], np.int8)
    v = -k
    ops.kv_write(KVGroup([cache]), k, v, layers=0, seq_offsets=np.array([0, 1, 3], np.int32),
                 cache_lengths=np.array([2, 0], np.int32))
    assert cache[0, 0, 0, :, 0].tolist() == [0, 0, 1, 0]
    assert cache[1, 0, 0, :, 0].tolist() == [2, 3, 0, 0]
    assert cache[1, 1, 0, :, 0].tolist() == [-2, -3, 0, 0]


def test_kv_write_counts_overflow_but_not_padding():
    """Reference kv_write: a token past max_seq_len is counted in status, padding is not."""
    cache = np.zeros((1, 2, 1, 2, 1), np.uint8)
    status = np.zeros(1, np.int32)
    k = np.ones((3, 1, 1), np.uint8)
    ops.kv_write(KVGroup([cache]), k, k, layers=0, seq_offsets=np.array([0, 2], np.int32),
                 cache_lengths=np.array([1], np.int32), status=status)
    assert cache[0, 0, 0, :, 0].tolist() == [0, 1]  # second token would be position 2 >= S
    assert status[0] == 1                          # token 2 is padding: not counted


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("lengths, rows, slots", [
    ([2, 2, 2], None, 4),         # one position for every row, slots by identity: strided
    ([2, 2, 2], [3, 0, 1], 4),    # one position, rows to slots: a scatter
    ([0, 3, 1], None, 4),         # distinct positions
    (None, [1, 2, 0], 4),         # no cache_lengths: position 0
    ([2, 4, 1], None, 4),         # position 4 == S: skipped and counted (general path)
    ([2, 2, 2], [0, 4, -1], 4),   # slot 4 out of range (counted), slot -1 skipped
    ([1, 1, 1], None, 2),         # identity past the last slot: row 2 counted
    ([1, 0, 1], None, 2),
])
def test_kv_write_decode_against_hand_values(layout, lengths, rows, slots):
    """Reference decode writes (one token per row, S = 4): every written row and the status
    count equal the hand-computed ones, and nothing else changes."""
    shape = (slots, 2, 2, 4, 3) if layout == "HND" else (slots, 2, 4, 2, 3)
    cache = np.zeros(shape, np.int16)
    k = np.arange(1, 3 * 2 * 3 + 1, dtype=np.int16).reshape(3, 2, 3)   # 3 tokens, 2 heads
    v = -k
    status = np.zeros(1, np.int32)
    kwargs = {}
    if lengths is not None:
        kwargs["cache_lengths"] = np.array(lengths, np.int32)
    if rows is not None:
        kwargs["row_to_slot"] = np.array(rows, np.int32)
    ops.kv_write(KVGroup([cache], layout=layout), k, v, layers=0, uniform_tokens=1, batch=3,
                 status=status, **kwargs)
    want = np.zeros_like(cache)
    counted = 0
    for t in range(3):
        slot = t if rows is None else rows[t]
        pos = 0 if lengths is None else lengths[t]
        if slot == -1:
            continue
        if not (0 <= slot < slots and 0 <= pos < 4):
            counted += 1
            continue
        if layout == "HND":
            want[slot, 0, :, pos], want[slot, 1, :, pos] = k[t], v[t]
        else:
            want[slot, 0, pos], want[slot, 1, pos] = k[t], v[t]
    np.testing.assert_array_equal(cache, want)
    assert int(status[0]) == counted


class _FewWarps:
    """A backend that launches the kernel with ``warps`` warps in all (grid x = 1): the warps
    stride over the tokens, each taking several (the wrappers size grids for one token per
    warp, so only this reaches the stride)."""

    def __init__(self, inner, warps):
        self.inner, self.warps = inner, warps

    def launch(self, family, name, grid, block, args):
        self.inner.launch(family, name, (1, *grid[1:]), (32 * self.warps, 1, 1), args)


@pytest.mark.emu
@pytest.mark.parametrize("kind", ["emu", "emu-reverse"])
@settings(max_examples=40)
@given(c=write_cases(modes=("ragged", "positions", "paged", "nhd", "decode"),
                     components=(1, 2)),
       warps=st.integers(1, 3))
def test_kv_write_with_fewer_warps_than_tokens_matches_reference(kind, c, warps):
    """One to three warps in the whole launch (every warp then takes several tokens, in every
    mode, latent or K/V): the caches and status equal the reference's and the token-by-token
    model's, as with a warp per token."""
    xp, backend = kernel_env(kind)
    ref_arena, k_arena = twins(c["seed"], xp)
    rg, rkeep, rk, rv, rkw, rstatus = _write_state(ref_arena, c)
    kg, kkeep, kk, kv, kkw, kstatus = _write_state(k_arena, c)
    ops.kv_write(rg, rk, rv, status=rstatus, **rkw)
    ops.kv_write(kg, kk, kv, status=kstatus, backend=_FewWarps(backend, warps), **kkw)
    for r, k in zip(rkeep, kkeep):
        assert_same_bytes(r, k)
    assert int(rstatus[0]) == int(kstatus[0])
    k_arena.check_canaries()


class _Parts:
    """A backend that gives each token ``parts`` warps (the 10th argument, warps_per_token)
    and ``warps`` warps in all (grid x = 1), whatever the wrapper chose: more parts than a
    token has row groups leaves some warps idle, fewer warps than items makes them stride."""

    def __init__(self, inner, parts, warps):
        self.inner, self.parts, self.warps = inner, parts, warps
        self.launched = 0

    def launch(self, family, name, grid, block, args):
        args = list(args)
        assert name in ("hc_kv_write", "hc_kv_write_fp8") and int(args[9]) >= 1
        args[9] = np.int32(self.parts)
        self.launched += 1
        self.inner.launch(family, name, (1, *grid[1:]), (32 * self.warps, 1, 1), tuple(args))


@pytest.mark.emu
@pytest.mark.parametrize("kind", ["emu", "emu-reverse"])
@settings(max_examples=40)
@given(c=write_cases(modes=("ragged", "positions", "paged", "nhd", "decode"),
                     components=(1, 2)),
       parts=st.integers(1, 9), warps=st.integers(1, 40))
def test_kv_write_with_several_warps_per_token_matches_reference(kind, c, parts, warps):
    """A token's rows dealt out to 1-9 warps (the decode launches give a token up to one warp
    per row group), in launches of 1-40 warps: the caches and status equal the reference's
    (a skipped token is counted once, not once per warp)."""
    xp, backend = kernel_env(kind)
    ref_arena, k_arena = twins(c["seed"], xp)
    rg, rkeep, rk, rv, rkw, rstatus = _write_state(ref_arena, c)
    kg, kkeep, kk, kv, kkw, kstatus = _write_state(k_arena, c)
    ops.kv_write(rg, rk, rv, status=rstatus, **rkw)
    spread = _Parts(backend, parts, warps)
    ops.kv_write(kg, kk, kv, status=kstatus, backend=spread, **kkw)
    assert spread.launched >= 1 or c["tokens"] == 0
    for r, k in zip(rkeep, kkeep):
        assert_same_bytes(r, k)
    assert int(rstatus[0]) == int(kstatus[0])
    k_arena.check_canaries()


def test_warps_per_token_spread_decode_rows_and_leave_prefill_alone():
    """Hand values: 64 decode tokens of 8 heads x 128 float16 (K and V: 16 rows of 256 bytes,
    2 rows per warp pass) get 8 warps each; of 16 heads x 256 (32 rows of 512 bytes, one per
    pass), 32; a 8192-token prefill, 1; a latent row (1 row), 1."""
    assert warps_per_token(64, 16, 256) == 8
    assert warps_per_token(64, 32, 512) == 32
    assert warps_per_token(8192, 16, 256) == 1
    assert warps_per_token(64, 1, 1152) == 1
    assert warps_per_token(0, 4, 32) == 1


class _NullEmptyTable:
    """A backend that passes a null block-table pointer when the table has no columns, as a
    GPU does for an empty array (the 14th and 15th arguments: table, max_blocks_per_seq);
    ``nulled`` counts the launches it changed (a test asserts it, so a change of the
    argument list cannot make this a no-op)."""

    def __init__(self, inner):
        self.inner = inner
        self.nulled = 0

    def launch(self, family, name, grid, block, args):
        args = list(args)
        if int(args[14]) == 0 and int(args[13]) != 0:
            args[13] = np.uint64(0)
            self.nulled += 1
        self.inner.launch(family, name, grid, block, tuple(args))


@pytest.mark.emu
def test_kv_write_paged_flag_not_the_table_pointer_says_paged():
    """A [batch, 0] block table whose pointer is null (a GPU's empty array) is still a paged
    write: every token is counted and no contiguous slot is written (the kernel used to read a
    null table as "contiguous caches" and write slot b)."""
    xp, backend = kernel_env("emu")
    layer = np.zeros((3, 2, 1, 4, 8), np.uint8)
    k = np.ones((3, 1, 8), np.uint8)
    status = np.zeros(1, np.int32)
    null_table = _NullEmptyTable(backend)
    ops.kv_write(KVGroup([layer]), k, k, layers=0, uniform_tokens=1,
                 block_table=np.zeros((3, 0), np.int32), status=status, backend=null_table)
    assert null_table.nulled == 1
    assert int(status[0]) == 3
    assert not layer.any()


# --- edge cases and argument checks every path handles alike (reference and kernel) ----------

@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_kv_write_block_table_without_columns_counts_every_token(kind):
    """A [batch, 0] block table: every token is skipped and counted (model: status = tokens,
    cache untouched); reference and kernel alike."""
    # A [batch, 0] block table: every token's block column is past the width (skipped and
    # counted). The reference used to raise IndexError on table[b, -1].
    xp, backend = kernel_env(kind)
    layer = xp.zeros((2, 2, 1, 4, 8), np.uint8)
    k = xp.ones((3, 1, 8), np.uint8)
    status = xp.zeros(1, np.int32)
    ops.kv_write(KVGroup([layer]), k, k, layers=0, uniform_tokens=1,
                 block_table=xp.zeros((3, 0), np.int32), status=status, backend=backend)
    assert int(as_bytes(status).view(np.int32)[0]) == 3
    assert not as_bytes(layer).any()


@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_kv_write_positions_past_int32_use_64_bit_arithmetic(kind):
    """Positions 2**31 - 1 and 2**31 land in the hand-computed blocks and offsets, nothing is
    counted; reference and kernel alike."""
    # cache_lengths[b] + (t - start) overflowed int in the kernel (undefined behaviour; on the
    # GPU it wrapped negative and the token was reported) while the reference wrote it.
    # Paged pool with block size 2**20: position 2**31 - 1 is block column 2047, offset
    # 2**20 - 1; position 2**31 is column 2048, offset 0. Both columns map to block 0.
    xp, backend = kernel_env(kind)
    s = 2**20
    layer = xp.zeros((1, 2, 1, s, 1), np.uint8)
    k = on(xp, np.array([[[5]], [[6]]], np.uint8))
    v = on(xp, np.array([[[7]], [[8]]], np.uint8))
    status = xp.zeros(1, np.int32)
    ops.kv_write(KVGroup([layer]), k, v, layers=0, seq_offsets=int32_on(xp, [0, 2]),
                 cache_lengths=int32_on(xp, [INT32_MAX]),
                 block_table=xp.zeros((1, 2049), np.int32), status=status, backend=backend)
    got = as_bytes(layer).reshape(2, s)
    assert int(as_bytes(status).view(np.int32)[0]) == 0
    assert (got[0, s - 1], got[1, s - 1], got[0, 0], got[1, 0]) == (5, 7, 6, 8)
    assert int(np.count_nonzero(got)) == 4


@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_kv_write_scalars_outside_c_int_raise(kind):
    """kv_write with uniform_tokens outside C int (ValueError) or a float batch (TypeError)
    raises before writing; reference and kernel alike."""
    xp, backend = kernel_env(kind)
    cache = np.arange(2 * 2 * 1 * 4 * 8, dtype=np.uint8).reshape(2, 2, 1, 4, 8)
    layer = on(xp, cache.copy())
    group = KVGroup([layer])
    k = xp.ones((2, 1, 8), np.uint8)
    with pytest.raises(ValueError, match="uniform_tokens: expected"):
        ops.kv_write(group, k, k, layers=0, uniform_tokens=2**40, backend=backend)
    with pytest.raises(TypeError, match="batch: expected an int"):
        ops.kv_write(group, k, k, layers=0, uniform_tokens=1, batch=1.0, backend=backend)
    np.testing.assert_array_equal(as_bytes(layer), cache.reshape(-1))


@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_kv_write_index_arrays_must_be_arrays(kind):
    """A list as seq_offsets raises TypeError naming it; reference and kernel alike."""
    # A list used to reach ``a.dtype`` and fail with AttributeError.
    xp, backend = kernel_env(kind)
    layer = xp.zeros((2, 2, 1, 4, 8), np.uint8)
    k = xp.ones((2, 1, 8), np.uint8)
    with pytest.raises(TypeError, match="seq_offsets: expected a"):
        ops.kv_write(KVGroup([layer]), k, k, layers=0, seq_offsets=[0, 2], backend=backend)


def test_kv_write_validates_its_arrays():
    """kv_write refuses int64 index arrays, wrong K/V shapes or dtypes and a group position
    past the group, each with the message that names the argument."""
    cache = np.zeros((2, 2, 1, 4, 8), np.float16)
    k = np.zeros((1, 1, 8), np.float16)
    group = KVGroup([cache])
    with pytest.raises(ValueError, match="seq_offsets: expected dtype int32, got int64"):
        ops.kv_write(group, k, k, layers=0, seq_offsets=np.array([0, 1]))
    with pytest.raises(ValueError, match=r"k\[0\]: expected shape \(1, 1, 8\)"):
        ops.kv_write(group, np.zeros((1, 2, 8), np.float16), k, layers=0, uniform_tokens=1)
    with pytest.raises(ValueError, match="k\\[0\\]: expected dtype float16, got float32"):
        ops.kv_write(group, k.astype(np.float32), k, layers=0, uniform_tokens=1)
    with pytest.raises(IndexError, match="layers: expected a group position in"):
        ops.kv_write(group, k, k, layers=1, uniform_tokens=1)


# --- streams (GPU) -------------------------------------------------------------------------

@pytest.mark.gpu
def test_pointer_table_is_uploaded_again_on_another_current_stream():
    """Two current streams, the first held back by a spin kernel: the write on the second uses
    its own upload of the K/V pointer table (model: every layer holds the new value)."""
    # With stream=None the upload memo was keyed by None, so a call under another current
    # stream skipped the upload and its kernel read the table before the first stream had
    # written it. Stream 1 is held back behind a spin kernel while the table upload is queued
    # on it; stream 2 must not run ahead with the previous table.
    import cupy

    spin = cupy.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) { }
    }''', "spin")
    layers = [cupy.zeros((2, 2, 1, 4, 8), np.float16) for _ in range(2)]
    group = KVGroup(layers)
    old = [cupy.full((1, 1, 8), 1, np.float16) for _ in range(2)]
    new = [cupy.full((1, 1, 8), 2, np.float16) for _ in range(2)]
    offsets = cupy.array([0, 1], np.int32)
    ops.kv_write(group, old, old, seq_offsets=offsets)                 # table of `old`
    cupy.cuda.Device().synchronize()
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with s1:
        spin((1,), (1,), (np.int64(2_000_000_000),))                    # ~1 s
        ops.kv_write(group, new, new, seq_offsets=offsets)             # upload queued on s1
    with s2:
        ops.kv_write(group, new, new, seq_offsets=offsets)
    s2.synchronize()
    got = [float(layer[0, 0, 0, 0, 0].get()) for layer in layers]
    cupy.cuda.Device().synchronize()
    assert got == [2.0, 2.0]
