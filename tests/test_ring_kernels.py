"""Ring-buffer layers in the kernels (docs/design.md §3.9): ``kv_write``, ``kv_write_fp8``,
``kv_capture`` / ``kv_restore`` / ``kv_prefix_copy`` and ``kv_compact`` on head-dim groups that
mix ring layers (``ring_windows[l] = W``, token axis ``W``) with unbounded ones, K/V groups
(two components) and latent MLA groups (one component, ``v=None``) alike.

Oracles: a naive model written here (position ``p`` at ring entry ``p mod W``; only a row's last
``W`` tokens land; a capture of ``n`` tokens is positions ``n - min(n, W) .. n - 1`` in order),
the NumPy reference (which must equal the model), and the real ``.cu`` on the host emulation
(which must equal the reference byte for byte, status words included, with every array between
canary bytes).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hcache import ops
from hcache.ops.tables import KVGroup, compaction_plan_size

from helpers import host
from kernel_cases import (
    BACKENDS,
    HEAD_DIMS,
    assert_same_bytes,
    dtypes,
    injective_mappings,
    kernel_env,
    misaligns,
    on,
    twins,
)


def _layers(arena, c, fill="random"):
    """One cache ``[slots, C, H, S, D]`` per entry of ``c["windows"]`` (0: unbounded, token
    axis ``c["seq"]``), ``C = c["components"]``."""
    return [arena.array((c["slots"], c["components"], h, w or c["seq"], c["head_dim"]),
                        c["dtype"],
                        misalign=c["misalign"] * c["dtype"].itemsize, fill=fill)
            for h, w in zip(c["heads"], c["windows"])]


@st.composite
def group_shapes(draw, max_slots=4):
    seq = draw(st.integers(4, 12))
    n = draw(st.integers(1, 3))
    windows = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=n, max_size=n))
    if not any(windows):
        windows[0] = draw(st.sampled_from([1, 2, 3]))
    return dict(dtype=draw(dtypes), head_dim=draw(st.sampled_from(HEAD_DIMS)), seq=seq,
                slots=draw(st.integers(1, max_slots)),
                heads=draw(st.lists(st.integers(1, 3), min_size=n, max_size=n)),
                windows=windows, components=draw(st.sampled_from([2, 1])),
                misalign=draw(misaligns), seed=draw(st.integers(0, 2**32 - 1)))


# --- kv_write --------------------------------------------------------------------------------

@st.composite
def write_cases(draw):
    c = draw(group_shapes())
    batch = draw(st.integers(1, c["slots"]))
    counts = draw(st.lists(st.integers(0, 8), min_size=batch, max_size=batch))
    c["ragged"] = draw(st.booleans())
    if not c["ragged"]:
        counts = [max(counts[0], 1)] * batch
    c["counts"] = counts
    c["row_to_slot"] = draw(st.permutations(range(c["slots"])))[:batch]
    # starting lengths: unbounded layers need start + count <= seq
    c["starts"] = [draw(st.integers(0, c["seq"] - n)) if n <= c["seq"] else 0 for n in counts]
    c["explicit"] = draw(st.booleans())
    c["pad"] = draw(st.lists(st.booleans(), min_size=sum(counts), max_size=sum(counts)))
    return c


def _write_model(layers, c, k, v):
    """Token ``i`` of row ``b`` (of ``n_b``) at position ``starts[b] + i`` (or -1, skipped)
    lands in a ring of window W only if ``n_b - i <= W``, at entry ``pos mod W`` (a latent
    layer, one component: the ``k`` row only)."""
    t = 0
    for b, n in enumerate(c["counts"]):
        slot = c["row_to_slot"][b]
        for i in range(n):
            pos = c["starts"][b] + i
            if not (c["explicit"] and c["pad"][t]):
                for layer, w, kk, vv in zip(layers, c["windows"], k, v):
                    if w and n - i > w:
                        continue
                    if not w and pos >= c["seq"]:
                        continue
                    layer[slot, 0, :, pos % w if w else pos] = kk[t]
                    if c["components"] == 2:
                        layer[slot, 1, :, pos % w if w else pos] = vv[t]
            t += 1


@pytest.mark.parametrize("kind", BACKENDS)
@given(c=write_cases())
def test_kv_write_into_rings_matches_model(kind, c):
    """Uniform and ragged writes (rows longer than a window included), at committed lengths or
    explicit positions with padding, through a row-to-slot map, K/V or latent: the reference
    equals the model and the kernel equals the reference, status and canaries included."""
    xp, backend = kernel_env(kind)
    ra, ka = twins(c["seed"], xp)
    total = sum(c["counts"])
    offsets = np.concatenate([[0], np.cumsum(c["counts"])]).astype(np.int32)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(c["starts"], c["counts"])]
                               ).astype(np.int32) if total else np.zeros(0, np.int32)
    positions[np.asarray(c["pad"], bool)] = -1

    def run(arena, backend=None):
        layers = _layers(arena, c)
        k = [arena.array((total, h, c["head_dim"]), c["dtype"]) for h in c["heads"]]
        v = ([arena.array((total, h, c["head_dim"]), c["dtype"]) for h in c["heads"]]
             if c["components"] == 2 else None)
        status = arena.array((1,), np.int32, fill="zeros")
        kw = dict(batch=len(c["counts"]), status=status,
                  row_to_slot=arena.int32(c["row_to_slot"]))
        if c["ragged"]:
            kw["seq_offsets"] = arena.int32(offsets)
        else:
            kw["uniform_tokens"] = c["counts"][0]
        if c["explicit"]:
            kw["positions"] = arena.int32(positions)
        else:
            kw["cache_lengths"] = arena.int32(c["starts"])
        before = [host(a) for a in layers]   # a copy, read with .get() on a device
        group = KVGroup(layers, ring_windows=c["windows"])
        ops.kv_write(group, k, v, backend=backend, **kw)
        return layers, k, v, status, before

    rl, rk, rv, rstat, before = run(ra)
    kl, _, _, kstat, _ = run(ka, backend)
    _write_model(before, c, rk, rv or [None] * len(rk))
    for r, m in zip(rl, before):
        assert_same_bytes(m, r)
    for r, k in zip(rl, kl):
        assert_same_bytes(r, k)
    assert int(rstat[0]) == int(np.asarray(on(np, kstat))[0] if xp is np else kstat.get()[0])
    ka.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
def test_kv_write_fp8_into_a_ring(kind):
    """The quantizing write maps tokens as kv_write does: a 7-token row into a 3-token ring
    keeps positions 4..6 at entries 1, 2, 0, quantized as the reference quantizes."""
    xp, backend = kernel_env(kind)
    rng = np.random.default_rng(3)
    cache = np.zeros((1, 2, 2, 3, 16), dtype="float8_e4m3fn")
    k = rng.standard_normal((7, 2, 16)).astype(np.float32)
    v = rng.standard_normal((7, 2, 16)).astype(np.float32)
    group = KVGroup([cache], ring_windows=[3])
    ops.kv_write_fp8(group, [k], [v], uniform_tokens=7, batch=1, k_scale=0.5, v_scale=2.0,
                     backend=backend)
    want_k = ops.reference.quantize_fp8(k[4:], 0.5, cache.dtype)
    want_v = ops.reference.quantize_fp8(v[4:], 2.0, cache.dtype)
    for pos in range(4, 7):
        assert_same_bytes(cache[0, 0, :, pos % 3], want_k[pos - 4])
        assert_same_bytes(cache[0, 1, :, pos % 3], want_v[pos - 4])


def test_ring_skips_old_tokens_before_checking_them():
    """A token overwritten later in its row is padding for a ring (skipped, not counted) even
    with a bad position, while an unbounded layer of the same launch counts... only through the
    first launched layer: here the ring is first, so nothing is counted."""
    ring = np.zeros((1, 2, 1, 2, 4), np.float32)
    flat = np.zeros((1, 2, 1, 8, 4), np.float32)
    k = np.arange(3 * 4, dtype=np.float32).reshape(3, 1, 4)
    status = np.zeros(1, np.int32)
    group = KVGroup([ring, flat], ring_windows=[2, 0])
    ops.kv_write(group, [k, k], [k, k], uniform_tokens=3, batch=1,
                 positions=np.array([-5, 4, 5], np.int32), status=status)
    assert int(status[0]) == 0
    assert np.array_equal(ring[0, 0, 0, 0], k[1, 0]) and np.array_equal(ring[0, 0, 0, 1], k[2, 0])
    assert np.array_equal(flat[0, 0, 0, 4], k[1, 0]) and np.array_equal(flat[0, 0, 0, 5], k[2, 0])


# --- capture / restore -----------------------------------------------------------------------

@st.composite
def capture_cases(draw):
    c = draw(group_shapes())
    c["slot"] = draw(st.integers(0, c["slots"] - 1))
    unbounded = [c["seq"] for w in c["windows"] if not w]
    c["n"] = draw(st.integers(0, min(unbounded) if unbounded else 3 * c["seq"]))
    return c


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("to_cache", [False, True], ids=["capture", "restore"])
@given(c=capture_cases())
def test_capture_restore_on_rings_match_model(kind, to_cache, c):
    """A capture of n tokens gives each ring's last min(n, W) positions in order (compact
    token j = ring entry (n - m + j) mod W); a restore puts them back there; an unbounded
    layer moves tokens [0, n); every component (one plane for a latent group)."""
    xp, backend = kernel_env(kind)
    ra, ka = twins(c["seed"], xp)
    n = c["n"]
    held = [min(n, w) if w else n for w in c["windows"]]

    def state(arena):
        layers = _layers(arena, c)
        compact = [arena.array((c["components"], h, m, c["head_dim"]), c["dtype"])
                   for h, m in zip(c["heads"], held)]
        return layers, compact

    rl, rc = state(ra)
    kl, kc = state(ka)
    exp_l, exp_c = [np.array(a) for a in rl], [np.array(a) for a in rc]
    for layer, saved, w, m in zip(exp_l, exp_c, c["windows"], held):
        entries = [(p % w) if w else p for p in range(n - m, n)]
        for j, e in enumerate(entries):
            if to_cache:
                layer[c["slot"], :, :, e] = saved[:, :, j]
            else:
                saved[:, :, j] = layer[c["slot"], :, :, e]
    for layers, compact, be in ((rl, rc, None), (kl, kc, backend)):
        group = KVGroup(layers, ring_windows=c["windows"])
        if to_cache:
            ops.kv_restore(group, compact, c["slot"], num_tokens=n, backend=be)
        else:
            ops.kv_capture(group, c["slot"], n, compact, backend=be)
    for r, k, e in zip(rl + rc, kl + kc, exp_l + exp_c):
        assert_same_bytes(e, r)
        assert_same_bytes(r, k)
    ka.check_canaries()


def test_restore_reads_the_prefix_length_or_asks_for_it():
    """kv_restore reads n from an unbounded layer or a partly filled ring; with every layer a
    full ring it needs num_tokens; counts that disagree are refused before anything moves."""
    ring = np.zeros((1, 2, 1, 3, 4), np.float32)
    flat = np.zeros((1, 2, 1, 9, 4), np.float32)
    group = KVGroup([ring, flat], ring_windows=[3, 0])
    saved = [np.ones((2, 1, 3, 4), np.float32), np.full((2, 1, 7, 4), 2, np.float32)]
    ops.kv_restore(group, saved, 0)   # n = 7: ring entries 4 % 3, 5 % 3, 6 % 3
    assert (ring[0] == 1).all() and (flat[0, :, :, :7] == 2).all()
    assert (flat[0, :, :, 7:] == 0).all()
    only_ring = KVGroup([ring], ring_windows=[3])
    with pytest.raises(ValueError, match="num_tokens: expected the captured prefix length"):
        ops.kv_restore(only_ring, [saved[0]], 0)
    with pytest.raises(ValueError, match=r"saved\[0\]: expected 2 tokens \(of a 2-token"):
        ops.kv_restore(only_ring, [saved[0]], 0, num_tokens=2)
    with pytest.raises(ValueError, match=r"saved: expected one token count for every layer, "
                                         r"got \[2, 5\]"):
        ops.kv_restore(group, [np.ones((2, 1, 2, 4), np.float32), saved[1][:, :, :5].copy()],
                       0)
    with pytest.raises(ValueError, match=r"saved\[0\]: expected 3 tokens \(of a 5-token"):
        ops.kv_restore(group, [np.ones((2, 1, 2, 4), np.float32), saved[1][:, :, :5].copy()],
                       0, num_tokens=5)
    with pytest.raises(ValueError, match=r"out\[0\]: expected 3 tokens, got 7"):
        ops.kv_capture(group, 0, 7, [saved[1], saved[1]])


# --- compaction ------------------------------------------------------------------------------

@st.composite
def compact_cases(draw):
    max_batch, old, new, mapping = draw(injective_mappings(6))
    c = draw(group_shapes())
    c["slots"] = max_batch
    c.update(old=old, new=new, mapping=mapping)
    unbounded = [c["seq"] for w in c["windows"] if not w]
    top = min(unbounded) if unbounded else 4 * c["seq"]
    c["lengths"] = np.asarray(draw(st.lists(st.integers(0, top), min_size=max_batch,
                                            max_size=max_batch)), np.int32)
    return c


@pytest.mark.parametrize("kind", BACKENDS)
@given(c=compact_cases())
def test_compaction_of_wrapped_rings_matches_model(kind, c):
    """Any injective mapping moves each kept slot's min(length, W) ring entries (all of them
    once wrapped) to the same entries of its new slot: lengths are absolute, so the ring
    order is kept."""
    xp, backend = kernel_env(kind)
    ra, ka = twins(c["seed"], xp)
    rl, kl = _layers(ra, c), _layers(ka, c)
    exp = [np.array(a) for a in rl]
    for old in range(c["old"]):
        new = int(c["mapping"][old])
        if new < 0:
            continue
        for e, src, w in zip(exp, rl, c["windows"]):
            m = min(int(c["lengths"][old]), w or c["seq"])
            e[new, :, :, :m] = src[old, :, :, :m]
    for layers, arena, be in ((rl, ra, None), (kl, ka, backend)):
        plan = arena.array((compaction_plan_size(c["slots"]),), np.int32, fill="zeros")
        lengths = arena.int32(c["lengths"])
        ops.compaction_plan(arena.int32(c["mapping"]) if c["old"] else arena.int32([0]),
                            c["old"], c["new"], plan, lengths=lengths, backend=be)
        ops.kv_compact(KVGroup(layers, ring_windows=c["windows"]), plan, lengths, backend=be)
    for e, r, k in zip(exp, rl, kl):
        assert_same_bytes(e, r)
        assert_same_bytes(r, k)
    ka.check_canaries()
