"""The scenarios of ``test_jax_gpu.py`` on the asynchronous emulated device (tests/emu_device.py),
so their hcache side runs in CI: a JAX array on a GPU is a foreign device array with both
``__cuda_array_interface__`` and ``__dlpack__`` whose producer (JAX's stream) may still be
running; here it is a device array whose write is still queued on a producer stream, seen
through one protocol (``test_interop_emulated.Interface`` / ``DLPackOnly``). JAX's import of a
cache on hcache's stream is ``DLPackOnly(dlpack_view(cache), hcache_stream)`` imported on a
consumer stream (JAX's). What the emulated device cannot stand for: JAX itself (its
``__cuda_array_interface__`` / ``__dlpack__`` on a real GPU, ``jit``, XLA's streams); those run
in the gpu tier only.

Oracles: the host bytes placed by hand in the cache layouts, the same call with native arrays,
and the emulated device's counters (host syncs) and pointers.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_interop_emulated import WRAPS, DLPackOnly, pending

import hcache
from hcache.arrays import as_array
from hcache.continuous.manager import ContinuousBatchingKVCacheManager, KVCacheStaticParams
from hcache.device import data_pointer, resolve_device
from hcache.dtypes import dlpack_view

from helpers import host

pytestmark = pytest.mark.emulated

DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8"]


def hybrid(dtype):
    kv = hcache.KVCacheConfig(2, 8, [hcache.KVLayerConfig(2, 16)], dtype)
    cfg = hcache.HybridCacheConfig(["attention", "mamba"], kv,
                                   hcache.MambaCacheConfig(1, 2, 2, 4, 8, 8, 4), 2)
    return hcache.HybridCacheManager(cfg, device="cuda")


def rows(dtype, shape, rng):
    """Random rows of ``dtype`` (bytes for integer dtypes: every value exact)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 256, shape, dtype=np.uint8).view(dtype).reshape(shape)
    return rng.uniform(-4, 4, shape).astype(np.float32).astype(dtype)


def as_bytes(a):
    return np.ascontiguousarray(a).view(np.uint8)


class JaxLike(DLPackOnly):
    """A JAX GPU array's two protocols: DLPack (ordered on the device) and an array interface
    without a ``stream`` entry whose producer has to finish first (reading it counts as a host
    sync here) and whose typestr cannot say bfloat16 or float8."""

    def __init__(self, array, stream):
        super().__init__(array, stream)
        self._rt = array._rt

    @property
    def __cuda_array_interface__(self):
        self._rt.counters["syncs"] += 1
        self._rt.synchronize()
        iface = dict(self._a.__cuda_array_interface__)
        iface.pop("stream", None)
        return {**iface, "version": 2}


WRAPS = {**WRAPS, "jax-like": JaxLike}


def foreign(rt, wrap, values, keep):
    """``values`` as a foreign device array whose write is still queued on its producer."""
    array, producer = pending(rt, values)
    keep.append(array)
    return WRAPS[wrap](array, producer)


# the array interface has no typestr for bfloat16 or float8: an interface-only producer
# writes those caches only where the runtime stores them as their storage type (README)
TYPED_BY_INTERFACE = ["float32", "float16", "int8"]


@pytest.mark.parametrize("dtype,wrap", [(d, w) for d in DTYPES for w in sorted(WRAPS)
                                        if w != "interface" or d in TYPED_BY_INTERFACE])
def test_pending_foreign_inputs_go_into_a_hybrid_manager_without_a_copy_or_a_sync(emu_rt,
                                                                                  dtype, wrap):
    """K/V rows, states, the state slots and the length increments still pending on their
    producers: viewed in place, no host sync, and the call's stream alone reads them in the
    places the layout says (it waited for the producers on the device). ``jax-like`` offers
    both protocols, as a JAX GPU array does: hcache takes DLPack and never reads the
    interface (which here costs a host sync and cannot say bfloat16 or float8)."""
    m = hybrid(dtype)
    cache, state = m.get_combined_kv_cache(0), m.get_recurrent_state(1)
    rng = np.random.default_rng(0)
    k, v = rows(cache.dtype, (2, 3, 2, 16), rng), rows(cache.dtype, (2, 3, 2, 16), rng)
    rec = rows(state.dtype, (1,) + state.shape[1:], rng)
    stream = emu_rt.stream(non_blocking=True)
    m.reset_for_new_sequences([0, 0], stream=stream)
    keep = []
    kf, vf, recf, slots, increments = (foreign(emu_rt, wrap, a, keep) for a in (
        k, v, rec, np.array([1], np.int32), np.array([3, 2], np.int32)))
    syncs = emu_rt.counters["syncs"]
    view = as_array("k", kf, resolve_device("cuda"), stream)
    assert data_pointer(view) == data_pointer(keep[0]), "k was copied"
    m.write_kv(0, kf, vf, stream=stream)
    m.write_states(1, recf, slots=slots, stream=stream)
    m.commit_sequence_length(increments, stream=stream)
    assert emu_rt.counters["syncs"] == syncs, "a pending foreign array cost a host sync"
    with stream:   # this stream alone: it holds the inputs only if it waited for them
        got, states, lengths = host(cache), host(state), host(m.get_kv_cache_lengths())
    assert np.array_equal(as_bytes(got[:, 0, :, :3].transpose(0, 2, 1, 3)), as_bytes(k))
    assert np.array_equal(as_bytes(got[:, 1, :, :3].transpose(0, 2, 1, 3)), as_bytes(v))
    assert not as_bytes(got[:, :, :, 3:]).any()
    assert np.array_equal(as_bytes(states[1:]), as_bytes(rec))
    assert not as_bytes(states[0]).any()
    assert lengths.tolist() == [3, 2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_cache_imported_on_hcaches_stream_is_read_after_its_launches(emu_rt, dtype):
    """An import made before the write shares the cache's memory; the import on hcache's
    stream orders the consumer (JAX's stream) after hcache's launches, with no host sync, and
    the earlier import then reads the write too (same memory)."""
    m = hybrid(dtype)
    cache = m.get_combined_kv_cache(0)
    consumer = emu_rt.stream(non_blocking=True)
    with consumer:
        early = emu_rt.from_dlpack(dlpack_view(cache))
    assert data_pointer(early) == data_pointer(cache)
    assert early.dtype.itemsize == cache.dtype.itemsize
    rng = np.random.default_rng(1)
    k = rows(cache.dtype, (2, 1, 2, 16), rng)
    src = emu_rt.xp.asarray(k)
    emu_rt.synchronize()
    writer = emu_rt.stream(non_blocking=True)
    m.reset_for_new_sequences([0, 0], stream=writer)
    m.write_kv(0, src, src, stream=writer)
    m.commit_sequence_length(1, stream=writer)
    syncs = emu_rt.counters["syncs"]
    with consumer:
        late = emu_rt.from_dlpack(DLPackOnly(dlpack_view(cache), writer))
        lengths = emu_rt.from_dlpack(DLPackOnly(m.get_kv_cache_lengths(), writer))
    assert emu_rt.counters["syncs"] == syncs
    with consumer:
        want = np.stack([k[:, 0], k[:, 0]], axis=1)   # token 0 of K and V: [B, 2, H, D]
        assert np.array_equal(as_bytes(host(late)[:, :, :, 0]), as_bytes(want))
        assert np.array_equal(as_bytes(host(early)[:, :, :, 0]), as_bytes(want))
        assert host(lengths).tolist() == [1, 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_continuous_batching_takes_pending_rows_and_its_tables_go_out(emu_rt, dtype):
    m = ContinuousBatchingKVCacheManager(dtype, KVCacheStaticParams(2, 16), 2, 8, 1,
                                         device="cuda")
    rng = np.random.default_rng(3)
    k = rows(m.blocks_buf.dtype, (2, 2, 2, 16), rng)
    v = rows(m.blocks_buf.dtype, (2, 2, 2, 16), rng)
    stream, consumer = emu_rt.stream(non_blocking=True), emu_rt.stream(non_blocking=True)
    batch = m.fetch(m.claim(2)[::-1], stream=stream)
    keep = []
    kf, vf = foreign(emu_rt, "dlpack", k, keep), foreign(emu_rt, "dlpack", v, keep)
    syncs = emu_rt.counters["syncs"]
    batch.write_kv(0, kf, vf, stream=stream)
    with consumer:
        blocks = emu_rt.from_dlpack(DLPackOnly(dlpack_view(m.blocks_buf), stream))
        table = emu_rt.from_dlpack(DLPackOnly(batch.lookup_table, stream))
        lengths = emu_rt.from_dlpack(DLPackOnly(batch.cache_lengths, stream))
    assert emu_rt.counters["syncs"] == syncs
    assert data_pointer(blocks) == data_pointer(m.blocks_buf)
    assert data_pointer(table) == data_pointer(batch.lookup_table)
    with consumer:
        gathered = host(blocks)[host(table)][:, :, 0, :2]   # [row, K/V, token, H, D]
        assert host(lengths).tolist() == [0, 0]
    assert np.array_equal(as_bytes(gathered[:, 0]), as_bytes(k))
    assert np.array_equal(as_bytes(gathered[:, 1]), as_bytes(v))
    m.step([2, 1], batch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_paged_pool_takes_a_pending_block_table_and_lengths(emu_rt, dtype):
    pools = [hcache.PagedKVPool([hcache.KVLayerConfig(2, 8)], 4, 2, dtype, device="cuda")
             for _ in range(2)]
    rng = np.random.default_rng(4)
    row = pools[0].layers[0].dtype
    k, v = rows(row, (3, 2, 8), rng), rows(row, (3, 2, 8), rng)
    table, lengths = np.array([[2, 0]], np.int32), np.array([1], np.int32)
    xp = emu_rt.xp
    pools[0].write_kv(xp.asarray(k), xp.asarray(v), block_table=xp.asarray(table), layer=0,
                      uniform_tokens=3, batch=1, cache_lengths=xp.asarray(lengths))
    emu_rt.synchronize()
    stream, keep = emu_rt.stream(non_blocking=True), []
    held = [foreign(emu_rt, "dlpack", a, keep) for a in (k, v, table, lengths)]
    syncs = emu_rt.counters["syncs"]
    pools[1].write_kv(held[0], held[1], block_table=held[2], layer=0, uniform_tokens=3,
                      batch=1, cache_lengths=held[3], stream=stream)
    assert emu_rt.counters["syncs"] == syncs, "a pending foreign array cost a host sync"
    with stream:
        want, got = as_bytes(host(pools[0].layers[0])), as_bytes(host(pools[1].layers[0]))
    assert want.any() and np.array_equal(want, got)
