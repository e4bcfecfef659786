"""The ``slot_copy`` family (kernels/slot_copy.cu, hcache/ops/slot_copy.py): ``slot_copy``.

Oracles: the NumPy reference (:mod:`hcache.ops.reference`) must give the kernel's bytes and
status count; both must match a naive pair-by-pair model (padding skipped, out-of-range pairs
skipped and counted once). The kernel runs on the host emulation of the real ``.cu`` (``emu``,
``emu-reverse``) and on CuPy (``gpu`` tier); every array sits between canary bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hcache import ops
from hcache.dtypes import DTYPE_NAMES, resolve_dtype
from hcache.ops.tables import SlotSet

from helpers import host
from kernel_cases import (
    BACKENDS,
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


@st.composite
def slot_copy_cases(draw):
    tensors = draw(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 5),
                                      st.lists(st.integers(1, 6), min_size=0, max_size=3),
                                      dtypes), min_size=1, max_size=3))
    n_src = min(t[0] for t in tensors)
    n_dst = min(t[1] for t in tensors)
    n = draw(st.integers(0, n_dst))
    dst = draw(st.permutations(range(n_dst)))[:n]
    src = draw(st.lists(st.integers(-1, n_src - 1), min_size=n, max_size=n))
    dst = [d if draw(st.integers(0, 6)) else -1 for d in dst]
    if n and draw(st.integers(0, 2)) == 0:
        i = draw(st.integers(0, n - 1))
        (src if draw(st.booleans()) else dst)[i] = draw(st.sampled_from([n_src + n_dst + 3, -7]))
    return dict(tensors=tensors, src=src, dst=dst, misalign=draw(misaligns),
                seed=draw(st.integers(0, 2**32 - 1)))


def _slot_state(arena, c, xp):
    pairs = []
    for ns, nd, shape, dt in c["tensors"]:
        pairs.append((arena.array((ns, *shape), dt, misalign=c["misalign"]),
                      arena.array((nd, *shape), dt)))
    src = arena.array((len(c["src"]),), np.int32)
    dst = arena.array((len(c["dst"]),), np.int32)
    src[...] = on(xp, np.asarray(c["src"], np.int32))
    dst[...] = on(xp, np.asarray(c["dst"], np.int32))
    return pairs, src, dst, arena.array((1,), np.int32, fill="zeros")


@pytest.mark.parametrize("kind", BACKENDS)
@given(c=slot_copy_cases())
def test_slot_copy_matches_reference_and_model(kind, c):
    """Random tensor sets and pairs (padding, out-of-range pairs): the kernel's tensors and
    status equal the reference's, which equal the pair-by-pair model's."""
    xp, backend = kernel_env(kind)
    ref_arena, k_arena = twins(c["seed"], xp)
    rp, rs, rd, rstat = _slot_state(ref_arena, c, np)
    kp, ks, kd, kstat = _slot_state(k_arena, c, xp)
    expected = [d.copy() for _, d in rp]
    bad = 0
    for s, d in zip(c["src"], c["dst"]):
        if s == -1 or d == -1:
            continue
        for j, (src, dst) in enumerate(rp):
            if 0 <= s < src.shape[0] and 0 <= d < dst.shape[0]:
                expected[j][d] = src[s]
            elif j == 0:
                bad += 1
    ops.slot_copy(SlotSet(rp), rs, rd, status=rstat)
    ops.slot_copy(SlotSet(kp), ks, kd, status=kstat, backend=backend)
    for (_, r), (_, k), e in zip(rp, kp, expected):
        assert_same_bytes(r, k)
        assert_same_bytes(e, r)
    assert int(rstat[0]) == int(kstat[0]) == bad
    k_arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_slot_copy_between_pools_of_different_sizes(kind, dtype):
    """Copies from a 3-slot set into a 6-slot set, per dtype, with a padding pair and an
    out-of-range pair: the kernel's tensors and status equal the hand-written expected ones."""
    xp, backend = kernel_env(kind)
    dt = resolve_dtype(dtype)
    arena = Arena(np.random.default_rng(7), xp)
    live = [arena.array((3, 4, 5), dt), arena.array((3, 9), dt)]
    cache = [arena.array((6, 4, 5), dt), arena.array((6, 9), dt)]
    src = arena.int32([2, 0, -1, 7])
    dst = arena.int32([5, 1, 3, 0])
    status = arena.array((1,), np.int32, fill="zeros")
    before = [host(c).copy() for c in cache]
    ops.slot_copy(SlotSet(list(zip(live, cache))), src, dst, status=status, backend=backend)
    for c, b, lv in zip(cache, before, live):
        want = b.copy()
        want[5] = host(lv)[2]
        want[1] = host(lv)[0]
        assert np.array_equal(as_bytes(c), as_bytes(want))
    assert int(host(status)[0]) == 1  # the pair (7 -> 0) is out of range; (-1 -> 3) is padding
    arena.check_canaries()


@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_slot_copy_counts_bad_pairs_when_the_first_tensor_has_empty_slots(kind):
    """A set whose first tensor has 0-byte slots still counts each out-of-range pair once and
    copies the good pairs of the other tensor (hand-computed); reference and kernel alike."""
    # Tensor 0 counts out-of-range pairs; with 0-byte slots its kernel loop had no work items,
    # so nothing was counted while the reference counted them.
    xp, backend = kernel_env(kind)
    empty = xp.zeros((3, 0), np.float32)
    src = on(xp, np.arange(6, dtype=np.float32).reshape(3, 2))
    dst = xp.zeros((3, 2), np.float32)
    status = xp.zeros(1, np.int32)
    ops.slot_copy(SlotSet([(empty, xp.zeros((3, 0), np.float32)), (src, dst)]),
                  int32_on(xp, [5, 0, -1, 1]), int32_on(xp, [0, 2, 1, 7]), status=status,
                  backend=backend)
    assert int(as_bytes(status).view(np.int32)[0]) == 2      # pairs (5, 0) and (1, 7)
    np.testing.assert_array_equal(as_bytes(dst).view(np.float32).reshape(3, 2),
                                  [[0, 0], [0, 0], [0, 1]])


@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_slot_copy_index_arrays_must_be_arrays(kind):
    """A list as src_idx raises TypeError naming it; reference and kernel alike."""
    # A list used to reach ``a.dtype`` and fail with AttributeError.
    xp, backend = kernel_env(kind)
    state = xp.zeros((2, 3), np.float32)
    with pytest.raises(TypeError, match="src_idx: expected a"):
        ops.slot_copy(SlotSet([(state, state)]), [0], int32_on(xp, [1]), backend=backend)


class _OneSmallBlock:
    """A backend that launches one block of 32 threads (tiles of 128 chunks): the block strides
    over several tiles per pair and over every pair."""

    def __init__(self, inner):
        self.inner = inner

    def launch(self, family, name, grid, block, args):
        self.inner.launch(family, name, (1, *grid[1:]), (32, 1, 1), args)


@pytest.mark.emu
@pytest.mark.parametrize("kind", ["emu", "emu-reverse"])
@settings(max_examples=30)
@given(c=slot_copy_cases(), rows=st.integers(1, 90), seed=st.integers(0, 2**32 - 1))
def test_slot_copy_of_slots_spanning_many_tiles_matches_the_model(kind, c, rows, seed):
    """Slots of up to 90 x 6 elements (several tiles each, a partial last one, every
    alignment) copied by one small block: the bytes equal the pair-by-pair model's."""
    xp, backend = kernel_env(kind)
    c = dict(c, tensors=[(ns, nd, [rows, *shape[:1]] if shape else [rows], dt)
                         for ns, nd, shape, dt in c["tensors"]])
    arena = Arena(np.random.default_rng(seed), xp)
    pairs, src, dst, status = _slot_state(arena, c, xp)
    expected = [d.copy() for _, d in pairs]
    bad = 0
    for s, d in zip(c["src"], c["dst"]):
        if s == -1 or d == -1:
            continue
        for j, (a, b) in enumerate(pairs):
            if 0 <= s < a.shape[0] and 0 <= d < b.shape[0]:
                expected[j][d] = a[s]
            elif j == 0:
                bad += 1
    ops.slot_copy(SlotSet(pairs), src, dst, status=status, backend=_OneSmallBlock(backend))
    for (_, b), e in zip(pairs, expected):
        assert_same_bytes(e, b)
    assert int(status[0]) == bad
    arena.check_canaries()
