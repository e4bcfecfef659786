"""Zero-size arguments of every launch (issue 21 item 1).

On a GPU a zero-byte CuPy allocation has the address 0, the same as an absent optional array,
so a kernel that tells "absent" by ``nullptr`` can take an empty table for no table. The
emulated device gives zero-byte allocations the address 0 as CuPy does; each case here runs an
op with freshly allocated empty arrays (not views into a larger buffer, which keep an address)
and compares every byte and the status with the NumPy reference on twin inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from hcache import _cuda, ops
from hcache.ops.tables import KVGroup, compaction_plan_size

from helpers import host

pytestmark = pytest.mark.emulated


def _both(build):
    """Run ``build(xp)`` on NumPy (the reference) and on the emulated device; return both
    results as host arrays."""
    xp = _cuda.runtime().xp
    return ([host(a) for a in build(np)], [host(a) for a in build(xp)])


def _put(xp, a):
    return a if xp is np else xp.asarray(a)


def test_the_emulated_device_gives_zero_byte_arrays_the_null_address():
    from hcache.device import data_pointer

    xp = _cuda.runtime().xp
    assert data_pointer(xp.zeros((3, 0), np.int32)) == 0
    assert data_pointer(xp.empty(0, np.uint8)) == 0
    assert data_pointer(xp.zeros((3, 2), np.int32)[:, :0]) != 0   # a view keeps its address


@pytest.mark.parametrize("table_shape", [(3, 0), (0, 2)])
@pytest.mark.parametrize("fp8", [False, True])
def test_kv_write_with_an_empty_block_table_skips_and_counts_every_token(table_shape, fp8):
    """A table with no columns: every position is past it, nothing written, every token
    counted. No rows (batch 0): every token is outside every row, nothing written, nothing
    counted. The kernel must not write contiguously either way."""
    batch = table_shape[0]

    def build(xp):
        layer = xp.zeros((2, 2, 1, 4, 8), np.uint8 if fp8 else np.float32)
        k = _put(xp, np.ones((3, 1, 8), np.float32))
        status = xp.zeros(1, np.int32)
        write = ops.kv_write_fp8 if fp8 else ops.kv_write
        extra = {"fp8_dtype": "float8_e4m3fn"} if fp8 else {}
        write(KVGroup([layer]), k, k, layers=0, uniform_tokens=1, batch=batch,
              block_table=xp.zeros(table_shape, np.int32), status=status, **extra)
        return layer.view(np.uint8), status

    (ref_cache, ref_status), (cache, status) = _both(build)
    assert int(ref_status[0]) == (3 if batch else 0) and not ref_cache.any()   # the rule
    np.testing.assert_array_equal(cache, ref_cache)
    np.testing.assert_array_equal(status, ref_status)


def test_kv_write_with_no_rows_and_empty_row_arrays_matches_the_reference():
    """batch 0: seq_offsets [0], empty cache_lengths / row_to_slot: every token is outside
    every row."""
    def build(xp):
        layer = xp.zeros((2, 2, 1, 4, 8), np.float32)
        k = _put(xp, np.ones((2, 1, 8), np.float32))
        status = xp.zeros(1, np.int32)
        ops.kv_write(KVGroup([layer]), k, k, layers=0, batch=0,
                     seq_offsets=_put(xp, np.zeros(1, np.int32)),
                     cache_lengths=xp.zeros(0, np.int32), row_to_slot=xp.zeros(0, np.int32),
                     status=status)
        return layer, status

    (ref_cache, ref_status), (cache, status) = _both(build)
    np.testing.assert_array_equal(cache, ref_cache)
    np.testing.assert_array_equal(status, ref_status)


def test_lengths_add_of_nothing_with_an_empty_increment_changes_nothing():
    def build(xp):
        lengths = _put(xp, np.array([3, 4], np.int32))
        status = xp.zeros(1, np.int32)
        ops.lengths_add(lengths, 0, xp.zeros(0, np.int32), 100, status=status)
        return lengths, status

    (ref_lengths, ref_status), (lengths, status) = _both(build)
    np.testing.assert_array_equal(ref_lengths, [3, 4])
    np.testing.assert_array_equal(lengths, ref_lengths)
    np.testing.assert_array_equal(status, ref_status)


@pytest.mark.parametrize("max_batch", [0, 2])
def test_compaction_plan_of_an_empty_batch_matches_the_reference(max_batch):
    def build(xp):
        plan = xp.zeros(compaction_plan_size(max_batch), np.int32)
        ops.compaction_plan(xp.zeros(0, np.int32), 0, 0, plan,
                            lengths=xp.zeros(max_batch, np.int32))
        return (plan,)

    (ref_plan,), (plan,) = _both(build)
    np.testing.assert_array_equal(plan, ref_plan)
