"""Zero-copy JAX access for every cache dtype (issue 25, item 1): the storage array imported
before hcache writes sees the writes, read in and outside ``jit``; the import shares the
cache's memory. Oracle: the cache's own bytes (NumPy) after each write, and the two ways the
issue found that do *not* follow writes (a ``.view`` taken outside ``jit``, a closure)."""

from __future__ import annotations

import numpy as np
import pytest

import hcache
from hcache.device import data_pointer
from hcache.interop.jax import as_cache_dtype, cache_dtype, storage_array

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8"]


def manager(dtype):
    kv = hcache.KVCacheConfig(2, 8, [hcache.KVLayerConfig(2, 16)], dtype)
    cfg = hcache.HybridCacheConfig(["attention", "mamba"], kv,
                                   hcache.MambaCacheConfig(1, 2, 2, 4, 8, 8, 4), 2)
    return hcache.HybridCacheManager(cfg, device="cpu")


def rows(cache, rng):
    """Random cache-dtype K/V rows ``[2, 3, 2, 16]`` (raw bytes for int8, so every value is
    exact; finite floats for the rest)."""
    if cache.dtype == np.int8:
        return rng.integers(-128, 128, (2, 3, 2, 16), dtype=np.int8)
    return rng.uniform(-4, 4, (2, 3, 2, 16)).astype(np.float32).astype(cache.dtype)


def as_bytes(a):
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_storage_array_made_before_a_write_sees_it_in_and_outside_jit(dtype):
    m = manager(dtype)
    cache = m.get_combined_kv_cache(0)
    storage = storage_array(cache)                       # imported once, before any write
    assert storage.unsafe_buffer_pointer() == data_pointer(cache)   # the same memory
    stale_view = as_cache_dtype(storage, dtype)          # outside jit: a snapshot
    frozen = jax.jit(lambda: as_cache_dtype(storage, dtype))   # a closure: a constant

    @jax.jit
    def read(s):                                         # an argument: read at each call
        return as_cache_dtype(s, dtype)

    assert frozen().dtype == cache_dtype(dtype)
    rng = np.random.default_rng(0)
    m.reset_for_new_sequences([0, 0])
    k, v = rows(cache, rng), rows(cache, rng)
    m.write_kv(0, k, v)                                  # hcache writes after the import
    m.commit_sequence_length(3)
    got = read(storage)
    assert got.dtype == cache_dtype(dtype)
    assert np.array_equal(as_bytes(got), as_bytes(cache))               # in jit
    assert np.array_equal(as_bytes(as_cache_dtype(storage, dtype)), as_bytes(cache))  # outside
    assert np.array_equal(as_bytes(np.asarray(got)[:, 0, :, :3].transpose(0, 2, 1, 3)),
                          as_bytes(k))
    # the two ways the issue found that do not follow writes (a reinterpretation outside jit
    # is a snapshot; a closure is a compile-time constant)
    if storage.dtype != cache_dtype(dtype):
        assert not np.array_equal(as_bytes(stale_view), as_bytes(cache))
        assert not np.array_equal(as_bytes(frozen()), as_bytes(cache))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_second_write_is_seen_by_the_same_compiled_step(dtype):
    m = manager(dtype)
    cache = m.get_combined_kv_cache(0)
    storage = storage_array(cache)
    total = jax.jit(lambda s: as_cache_dtype(s, dtype).astype(jnp.float32).sum())
    rng = np.random.default_rng(1)
    m.reset_for_new_sequences([0, 0])
    for step in range(3):
        k = rows(cache, rng)
        k = np.ascontiguousarray(k[:, :1])
        m.write_kv(0, k, k)
        m.commit_sequence_length(1)
        want = np.asarray(cache).astype(np.float32).sum(dtype=np.float64)
        assert float(total(storage)) == pytest.approx(want, rel=1e-5, abs=1e-3), step


def test_states_and_lengths_import_without_a_copy():
    m = manager("bfloat16")
    ssm = m.get_recurrent_state(1)
    s = storage_array(ssm)
    m.write_states(1, np.full((1, 2, 4, 8), 3.0, np.float32), slots=[1])
    assert float(jax.jit(lambda x: x[1].sum())(s)) == 3.0 * 2 * 4 * 8
    m.reset_for_new_sequences([4, 5])
    lengths = storage_array(m.get_kv_cache_lengths())
    m.commit_sequence_length(2)
    assert jax.jit(lambda x: x * 1)(lengths).tolist() == [6, 7]


def test_as_cache_dtype_refuses_another_itemsize():
    s = storage_array(manager("bfloat16").get_combined_kv_cache(0))
    with pytest.raises(ValueError, match="dtype: expected a dtype of 2 bytes"):
        as_cache_dtype(s, "float32")
    with pytest.raises(TypeError, match="array: expected"):
        storage_array([1, 2])
