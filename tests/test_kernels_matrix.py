"""Every kernel family × every dtype × the head dims the issue names (8, 36, 80, 96, 512),
through the host-compiled ``.cu`` (and CuPy in the ``gpu`` tier), against naive NumPy models.

Deterministic companions of the hypothesis tests in ``test_kernels.py``: each case is fixed, so
a failure names the dtype and head dim that broke.
"""

from __future__ import annotations

import numpy as np
import pytest

from hcache import ops
from hcache.dtypes import DTYPE_NAMES, resolve_dtype
from hcache.ops.tables import KVGroup, SlotSet

from kernel_cases import BACKENDS, Arena, as_bytes, kernel_env

HEAD_DIMS = (8, 36, 80, 96, 512)
matrix = pytest.mark.parametrize("dtype", DTYPE_NAMES)
dims = pytest.mark.parametrize("head_dim", HEAD_DIMS)




def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _i32(arena, values, xp):
    a = arena.array((len(values),), np.int32)
    a[...] = xp.asarray(np.asarray(values, np.int32)) if xp is not np else values
    return a


@pytest.mark.parametrize("kind", BACKENDS)
@matrix
@dims
def test_compaction_with_a_cycle_chains_and_holes(kind, dtype, head_dim):
    # 6 slots: 0->3, 1 evicted, 2->0, 3->2 (cycle 0->3->2->0), 4->1, 5 evicted; new batch 5,
    # so slot 4 is a hole. Lengths differ so each move copies its own prefix.
    xp, backend = kernel_env(kind)
    dt = resolve_dtype(dtype)
    arena = Arena(np.random.default_rng(head_dim), xp)
    layers = [arena.array((6, 2, h, 5, head_dim), dt, misalign=dt.itemsize) for h in (2, 1)]
    state = arena.array((6, 3, 7), dt)
    lengths = _i32(arena, [5, 1, 3, 0, 2, 4], xp)
    mapping = _i32(arena, [3, -1, 0, 2, 1, -1], xp)
    plan = arena.array((ops.compaction_plan_size(6),), np.int32, fill="zeros")
    before_layers = [_host(a).copy() for a in layers]
    before_state = _host(state).copy()
    ops.compaction_plan(mapping, 6, 5, plan, lengths=lengths, backend=backend)
    ops.kv_compact(KVGroup(layers), plan, lengths, backend=backend)
    ops.slots_compact(SlotSet([(state, state), (lengths, lengths)]), plan, backend=backend)
    moves = {0: 3, 2: 0, 3: 2, 4: 1}
    old_len = [5, 1, 3, 0, 2, 4]
    for layer, before in zip(layers, before_layers):
        want = before.copy()
        for old, new in moves.items():
            n = old_len[old]
            want[new, :, :, :n] = before[old, :, :, :n]
        assert np.array_equal(as_bytes(layer), as_bytes(want))
    want_state = before_state.copy()
    for old, new in moves.items():
        want_state[new] = before_state[old]
    want_state[4] = 0
    assert np.array_equal(as_bytes(state), as_bytes(want_state))
    assert _host(lengths).tolist() == [3, 2, 0, 5, 0, 4]
    arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@matrix
@dims
def test_ragged_write_with_padding(kind, dtype, head_dim):
    # Rows of 3, 0 and 2 tokens plus 2 padding tokens; row 1 has no slot (-1); the last token
    # of row 2 would land past max_seq_len and must be skipped and counted.
    xp, backend = kernel_env(kind)
    dt = resolve_dtype(dtype)
    arena = Arena(np.random.default_rng(head_dim + 1), xp)
    layers = [arena.array((4, 2, h, 6, head_dim), dt) for h in (1, 3)]
    k = [arena.array((7, h, head_dim), dt) for h in (1, 3)]
    v = [arena.array((7, h, head_dim), dt) for h in (1, 3)]
    offsets = _i32(arena, [0, 3, 3, 5], xp)
    starts = _i32(arena, [1, 0, 5], xp)
    rows = _i32(arena, [2, -1, 0], xp)
    status = arena.array((1,), np.int32, fill="zeros")
    before = [_host(a).copy() for a in layers]
    ops.kv_write(KVGroup(layers), k, v, seq_offsets=offsets, cache_lengths=starts,
                 row_to_slot=rows, status=status, backend=backend)
    for layer, b, kk, vv in zip(layers, before, k, v):
        want = b.copy()
        kk, vv = _host(kk), _host(vv)
        for t, (slot, pos) in enumerate([(2, 1), (2, 2), (2, 3)]):
            want[slot, 0, :, pos] = kk[t]
            want[slot, 1, :, pos] = vv[t]
        want[0, 0, :, 5] = kk[3]
        want[0, 1, :, 5] = vv[3]
        assert np.array_equal(as_bytes(layer), as_bytes(want))
    assert int(_host(status)[0]) == 1
    arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@matrix
@dims
def test_paged_write_through_block_table(kind, dtype, head_dim):
    xp, backend = kernel_env(kind)
    dt = resolve_dtype(dtype)
    arena = Arena(np.random.default_rng(head_dim + 2), xp)
    pool = arena.array((5, 2, 2, 2, head_dim), dt)  # 5 blocks of 2 tokens
    k = arena.array((4, 2, head_dim), dt)
    v = arena.array((4, 2, head_dim), dt)
    offsets = _i32(arena, [0, 3, 4], xp)
    starts = _i32(arena, [1, 2], xp)
    table = arena.array((2, 2), np.int32)
    table[...] = xp.asarray(np.array([[4, 1], [0, 9]], np.int32)) if xp is not np else \
        np.array([[4, 1], [0, 9]], np.int32)
    status = arena.array((1,), np.int32, fill="zeros")
    before = _host(pool).copy()
    ops.kv_write(KVGroup([pool]), k, v, layers=0, seq_offsets=offsets, cache_lengths=starts,
                 block_table=table, status=status, backend=backend)
    want = before.copy()
    kk, vv = _host(k), _host(v)
    # row 0: positions 1, 2, 3 -> (block 4, 1), (block 1, 0), (block 1, 1);
    # row 1: position 2 -> column 1 -> block 9, out of range: skipped and counted.
    for t, (blk, off) in enumerate([(4, 1), (1, 0), (1, 1)]):
        want[blk, 0, :, off] = kk[t]
        want[blk, 1, :, off] = vv[t]
    assert np.array_equal(as_bytes(pool), as_bytes(want))
    assert int(_host(status)[0]) == 1
    arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@matrix
@dims
def test_capture_restore_round_trip(kind, dtype, head_dim):
    xp, backend = kernel_env(kind)
    dt = resolve_dtype(dtype)
    arena = Arena(np.random.default_rng(head_dim + 3), xp)
    layers = [arena.array((3, 2, h, 5, head_dim), dt) for h in (2, 1, 3)]
    group = KVGroup(layers)
    saved = [arena.array((2, h, 4, head_dim), dt, fill="zeros") for h in (2, 1, 3)]
    ops.kv_capture(group, 1, 4, saved, backend=backend)
    for layer, s in zip(layers, saved):
        assert np.array_equal(as_bytes(s), as_bytes(_host(layer)[1, :, :, :4]))
    before = [_host(a).copy() for a in layers]
    ops.kv_restore(group, saved, 2, backend=backend)
    for layer, b, s in zip(layers, before, saved):
        want = b.copy()
        want[2, :, :, :4] = _host(s)
        assert np.array_equal(as_bytes(layer), as_bytes(want))
    arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@matrix
def test_slot_copy_between_pools_of_different_sizes(kind, dtype):
    xp, backend = kernel_env(kind)
    dt = resolve_dtype(dtype)
    arena = Arena(np.random.default_rng(7), xp)
    live = [arena.array((3, 4, 5), dt), arena.array((3, 9), dt)]
    cache = [arena.array((6, 4, 5), dt), arena.array((6, 9), dt)]
    src = _i32(arena, [2, 0, -1, 7], xp)
    dst = _i32(arena, [5, 1, 3, 0], xp)
    status = arena.array((1,), np.int32, fill="zeros")
    before = [_host(c).copy() for c in cache]
    ops.slot_copy(SlotSet(list(zip(live, cache))), src, dst, status=status, backend=backend)
    for c, b, lv in zip(cache, before, live):
        want = b.copy()
        want[5] = _host(lv)[2]
        want[1] = _host(lv)[0]
        assert np.array_equal(as_bytes(c), as_bytes(want))
    assert int(_host(status)[0]) == 1  # the pair (7 -> 0) is out of range; (-1 -> 3) is padding
    arena.check_canaries()
