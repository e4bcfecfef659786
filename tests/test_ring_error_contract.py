"""Regressions the error-contract fuzzer found on issue 14's ring buffers and local block spaces:
each bad argument raises naming the caller's argument, and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from hcache import KVCacheConfig, KVCacheManager, KVLayerConfig, PagedKVPool
from hcache.rings import ring_start

LAYERS = [KVLayerConfig(2, 4, 2), KVLayerConfig(1, 8)]   # local (window 2), full


def _pool():
    pool = PagedKVPool(LAYERS, 6, 2, device="cpu", num_local_blocks=4)
    rng = np.random.default_rng(0)
    for a in pool.layers:
        a[...] = rng.standard_normal(a.shape).astype(a.dtype)
    return pool


def _rows(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((4, lc.num_kv_heads, lc.head_dim)).astype(np.float16)
            for lc in LAYERS]


@pytest.mark.parametrize(("tables", "match"), [
    # the full table is refused after the local group could have been written
    ({"block_table": np.array([[0, 1], [2, 3]], np.int64)}, "block_table: expected dtype int32"),
    ({"local_block_table": np.array([[0, 1], [2, 3]], np.float32)},
     "local_block_table: expected dtype int32"),
    ({"local_block_table": np.array([[0, 1]], np.int32)},
     "local_block_table: expected 2 rows"),
])
def test_a_bad_table_of_a_write_to_both_block_spaces_changes_nothing(tables, match):
    pool = _pool()
    before = [a.copy() for a in pool.layers]
    args = dict(block_table=np.array([[0, 1], [2, 3]], np.int32),
                local_block_table=np.array([[-1, 3], [0, -1]], np.int32), uniform_tokens=2)
    args.update(tables)
    with pytest.raises((TypeError, ValueError), match=match):
        pool.write_kv(_rows(), _rows(1), **args)
    assert all(np.array_equal(a, b) for a, b in zip(pool.layers, before, strict=True))
    # The valid call writes both spaces: row 1's position 1 (token 3) is local block 0, offset
    # 1 (row 0's local column is -1: skipped); row 0's position 1 is full block 0, offset 1.
    pool.write_kv(_rows(), _rows(1), block_table=np.array([[0, 1], [2, 3]], np.int32),
                  local_block_table=np.array([[-1, 3], [0, -1]], np.int32), uniform_tokens=2)
    assert np.array_equal(pool.layers[0][0, 0, :, 1], _rows()[0][3])
    assert np.array_equal(pool.layers[0][3], before[0][3])
    assert np.array_equal(pool.layers[1][0, 1, :, 1], _rows(1)[1][1])


@pytest.mark.parametrize("local", [1, "yes", 1.5, None, [True]])
def test_copy_blocks_local_must_be_a_bool(local):
    pool = _pool()
    before = [a.copy() for a in pool.layers]
    with pytest.raises(TypeError, match="local: expected a bool"):
        pool.copy_blocks([0], [1], local=local)
    assert all(np.array_equal(a, b) for a, b in zip(pool.layers, before, strict=True))
    pool.copy_blocks([0], [1], local=np.bool_(True))
    assert np.array_equal(pool.layers[0][1], pool.layers[0][0])
    assert np.array_equal(pool.layers[1], before[1])      # the full space is untouched


@pytest.mark.parametrize(("lengths", "window", "error", "match"), [
    (-1, 3, ValueError, "lengths: expected a length >= 0"),
    ([4, -2], 3, ValueError, "lengths: expected lengths >= 0"),
    (np.array([1.0]), 3, TypeError, "lengths: expected an int or an int array"),
    ([True], 3, TypeError, r"lengths\[0\]: expected an int"),
    (5, -1, ValueError, r"window: expected an int in \[0, 2147483647\]"),
    (5, 2**31, ValueError, r"window: expected an int in \[0, 2147483647\]"),   # int32 ring
    (5, 2**63, ValueError, r"window: expected an int in \[0, 2147483647\]"),
    (5, 2.0, TypeError, "window: expected an int"),
])
def test_ring_start_names_a_bad_argument(lengths, window, error, match):
    with pytest.raises(error, match=match):
        ring_start(lengths, window)


def test_ring_start_values():
    # Entry of the oldest token: length % W once the ring has wrapped, else 0.
    assert [ring_start(n, 3) for n in (0, 2, 3, 4, 7)] == [0, 0, 0, 1, 1]
    assert ring_start(9, 0) == 0
    assert ring_start([0, 3, 4, 8], 3, device="cpu").tolist() == [0, 0, 1, 2]


def test_restore_of_a_ring_capture_with_a_wrong_sequence_length_changes_nothing():
    cfg = KVCacheConfig(2, 6, (KVLayerConfig(1, 4, 3), KVLayerConfig(1, 4, 4)), "float32",
                        ring_windows=True)
    m = KVCacheManager(cfg, device="cpu")
    rng = np.random.default_rng(0)
    for i in range(2):
        c = m.get_combined_kv_cache(i)
        c[...] = rng.standard_normal(c.shape).astype(np.float32)
    saved = m.capture_kv_cache(0, sequence_length=5)   # both rings full: 3 and 4 entries
    before = [m.get_combined_kv_cache(i).copy() for i in range(2)]
    for bad, error in ((3, ValueError), (7, ValueError), (None, ValueError), (5.0, TypeError),
                       (True, TypeError)):
        with pytest.raises(error, match=r"^(sequence_length|saved)"):
            m.restore_kv_cache(saved, 1, sequence_length=bad)
        assert all(np.array_equal(m.get_combined_kv_cache(i), before[i]) for i in range(2))
    m.restore_kv_cache(saved, 1, sequence_length=5)
    for i in range(2):
        assert np.array_equal(m.get_combined_kv_cache(i)[1], before[i][0])
