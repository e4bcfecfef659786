"""The NumPy reference (the cpu backend) against hand-computed results and naive models."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from hcache import ops
from hcache.ops import reference as ref
from hcache.ops.tables import KVGroup, SlotSet

from kernel_cases import injective_mappings


def _plan(mapping, old, new, max_batch, lengths=None):
    plan = np.zeros(ops.compaction_plan_size(max_batch), np.int32)
    ops.compaction_plan(np.asarray(mapping, np.int32), old, new, plan,
                        lengths=None if lengths is None else np.asarray(lengths, np.int32))
    return plan


def test_plan_of_monotone_mapping_is_ascending_chains_without_scratch():
    # TensorRT-Edge-LLM's buildBatchMapping: survivors 1, 2, 4 of 5 move down in order.
    plan = _plan([-1, 0, 1, -1, 2], 5, 3, 6, lengths=[4, 3, 7, 1, 2, 0])
    assert plan[0] == 0
    assert ref.plan_schedule(plan).tolist() == [[1, 0], [2, 1], [4, 2]]
    assert plan[2] == 7  # longest moved span
    assert ref.TMP not in ref.plan_schedule(plan)


def test_plan_of_swap_saves_one_slot_to_registers():
    plan = _plan([1, 0], 2, 2, 2)
    assert ref.plan_schedule(plan).tolist() == [[0, ref.TMP], [1, 0], [ref.TMP, 1]]


def test_plan_marks_holes_for_clearing_last():
    plan = _plan([2, -1], 2, 3, 4)
    assert ref.plan_schedule(plan).tolist() == [[0, 2], [ref.CLEAR, 0], [ref.CLEAR, 1]]


@pytest.mark.parametrize("mapping,old,new,status,bad", [
    ([0, 0], 2, 2, 1, 1),       # duplicate target
    ([0, 2], 2, 2, 1, 1),       # target >= new_batch
    ([-2, 0], 2, 2, 1, 0),      # below -1
    ([0], 1, 5, 2, -1),         # new_batch > max_batch
])
def test_invalid_plans_are_flagged(mapping, old, new, status, bad):
    plan = _plan(mapping, old, new, 4)
    assert plan[0] == status and plan[3] == bad and plan[1] == 0


@given(case=injective_mappings())
def test_schedule_moves_every_slot_like_a_scratch_copy(case):
    max_batch, old, new, mapping = case
    plan = _plan(mapping, old, new, max_batch)
    slots = list(range(max_batch))  # slot contents are their original labels
    tmp = None
    for src, dst in ref.plan_schedule(plan):
        if dst == ref.TMP:
            tmp = slots[src]
        elif src == ref.TMP:
            slots[dst] = tmp
        elif src == ref.CLEAR:
            slots[dst] = None
        else:
            slots[dst] = slots[src]
    want = list(range(max_batch))
    for o, n in enumerate(mapping):
        if n >= 0:
            want[n] = o
    for j in range(new):
        if j not in mapping:
            want[j] = None
    assert slots == want
    monotone = all(n <= o for o, n in enumerate(mapping) if n >= 0) and \
        list(n for n in mapping if n >= 0) == sorted(n for n in mapping if n >= 0)
    if monotone:
        assert ref.TMP not in ref.plan_schedule(plan)


def test_kv_compact_moves_only_each_slots_own_prefix():
    cache = np.arange(3 * 2 * 1 * 4 * 2, dtype=np.float32).reshape(3, 2, 1, 4, 2)
    lengths = np.array([2, 0, 3], np.int32)
    before = cache.copy()
    plan = _plan([-1, -1, 0], 3, 1, 3, lengths=lengths)
    ops.kv_compact(KVGroup([cache]), plan, lengths)
    want = before.copy()
    want[0, :, :, :3] = before[2, :, :, :3]  # token 3 of slot 0 is stale and stays
    np.testing.assert_array_equal(cache, want)


def test_slots_compact_moves_lengths_and_zeroes_holes():
    lengths = np.array([5, 6, 7], np.int32)
    state = np.arange(6, dtype=np.float16).reshape(3, 2)
    plan = _plan([1, -1, 2], 3, 3, 3)
    ops.slots_compact(SlotSet([(state, state), (lengths, lengths)]), plan)
    assert lengths.tolist() == [0, 5, 7]
    assert state.tolist() == [[0, 0], [0, 1], [4, 5]]


def test_kv_write_ragged_rows_at_their_lengths():
    cache = np.zeros((2, 2, 1, 4, 1), np.int8)
    k = np.array([[[1]], [[2]], [[3]]], np.int8)
    v = -k
    ops.kv_write(KVGroup([cache]), k, v, layers=0, seq_offsets=np.array([0, 1, 3], np.int32),
                 cache_lengths=np.array([2, 0], np.int32))
    assert cache[0, 0, 0, :, 0].tolist() == [0, 0, 1, 0]
    assert cache[1, 0, 0, :, 0].tolist() == [2, 3, 0, 0]
    assert cache[1, 1, 0, :, 0].tolist() == [-2, -3, 0, 0]


def test_kv_write_counts_overflow_but_not_padding():
    cache = np.zeros((1, 2, 1, 2, 1), np.uint8)
    status = np.zeros(1, np.int32)
    k = np.ones((3, 1, 1), np.uint8)
    ops.kv_write(KVGroup([cache]), k, k, layers=0, seq_offsets=np.array([0, 2], np.int32),
                 cache_lengths=np.array([1], np.int32), status=status)
    assert cache[0, 0, 0, :, 0].tolist() == [0, 1]  # second token would be position 2 >= S
    assert status[0] == 1                          # token 2 is padding: not counted


def test_lengths_add_refuses_overflow_whole():
    lengths = np.array([3, 9], np.int32)
    status = np.zeros(1, np.int32)
    ops.lengths_add(lengths, 2, 1, 9, status=status)
    assert lengths.tolist() == [3, 9] and status[0] == 1
    ops.lengths_add(lengths, 2, np.array([2, 0], np.int32), 9, status=status)
    assert lengths.tolist() == [5, 9] and status[0] == 1
    ops.lengths_add(lengths, 2, np.array([1, -1], np.int32), 9, status=status)  # no rollback
    assert lengths.tolist() == [5, 9] and status[0] == 2


def test_wrappers_validate_index_arrays():
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
    with pytest.raises(IndexError, match="slot: expected a slot in"):
        ops.kv_capture(group, 2, 1, [np.zeros((2, 1, 1, 8), np.float16)])
    with pytest.raises(ValueError, match="num_tokens: expected a length in"):
        ops.kv_capture(group, 0, 5, [np.zeros((2, 1, 5, 8), np.float16)])
    with pytest.raises(ValueError, match="saved: expected one token count"):
        ops.kv_restore(KVGroup([cache, cache.copy()]),
                       [np.zeros((2, 1, 1, 8), np.float16), np.zeros((2, 1, 2, 8), np.float16)],
                       0)
