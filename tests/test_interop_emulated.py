"""Issue 12's interop and sizing on the asynchronous emulated device (tests/emu_device.py), the
CUDA path of docs/design.md §2 run in CI: foreign device arrays (the CUDA array interface and
DLPack) through ``arrays.as_array`` with no host sync and their producers ordered on the device;
every cache buffer allocated by ``device.zeros`` (tracked device memory, aligned, its zero fill
settled by the constructor); DLPack export of the caches; the fit check against the device's
free memory; the device check of FP8 scale tables."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from test_cache_export import exported_buffers
from test_write_kv import rows

from hcache import (
    CacheCapacityError,
    HybridCacheConfig,
    HybridCacheManager,
    KVCacheConfig,
    KVLayerConfig,
    LinearCacheConfig,
    LinearKVCache,
    MambaCacheConfig,
    PagedKVPool,
)
from hcache.arrays import as_array
from hcache.continuous.manager import ContinuousBatchingKVCacheManager, KVCacheStaticParams
from hcache.device import (
    ALIGNMENT,
    cuda_free_bytes,
    data_pointer,
    resolve_device,
    settle,
    zeros,
)
from hcache.dtypes import dlpack_view
from hcache.kv_scales import check_scale
from hcache.slots.kv import KVCacheManager
from hcache.slots.mamba import MambaCacheManager

from helpers import host

pytestmark = pytest.mark.emulated


class Interface:
    """A producer's device array seen only through ``__cuda_array_interface__``, naming the
    stream its pending work is on."""

    def __init__(self, array, stream):
        iface = dict(array.__cuda_array_interface__)
        iface["stream"] = stream.ptr
        self.__cuda_array_interface__ = iface
        self._keep = array


class DLPackOnly:
    """A producer's device array seen only through DLPack; its export orders the producer's
    stream before the consumer's, as a framework tensor's does."""

    def __init__(self, array, stream):
        self._a, self._stream = array, stream

    def __dlpack__(self, stream=None):
        with self._stream:
            return self._a.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


WRAPS = {"interface": Interface, "dlpack": DLPackOnly}


def pending(rt, values):
    """A device copy of host ``values`` whose write is still queued on a fresh non-blocking
    producer stream (the device array holds garbage until that stream runs); ``(array,
    producer)``."""
    values = np.ascontiguousarray(values)
    out = rt.xp.empty(values.shape, values.dtype)
    producer = rt.stream(non_blocking=True)
    with producer:
        out[...] = rt.xp.asarray(values)
    return out, producer


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_foreign_device_arrays_are_viewed_after_their_producer_without_a_host_sync(emu_rt,
                                                                                   wrap):
    dev = resolve_device("cuda")
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    a, producer = pending(emu_rt, values)
    consumer = emu_rt.stream(non_blocking=True)
    syncs = emu_rt.counters["syncs"]
    view = as_array("k", WRAPS[wrap](a, producer), dev, consumer)
    assert emu_rt.counters["syncs"] == syncs, "a foreign array cost a host sync"
    assert data_pointer(view) == data_pointer(a) and view.shape == a.shape
    assert view.dtype == np.float32
    with consumer:   # the consumer stream alone: it reads the values only if it waited
        assert np.array_equal(host(view), values)


def test_foreign_arrays_of_the_wrong_memory_or_device_are_refused(emu_rt):
    dev = resolve_device("cuda")
    with pytest.raises(TypeError, match="k: expected a emulated_cupy array"):
        as_array("k", np.zeros(3, np.float32), dev)
    with emu_rt.device_scope(1):
        other, producer = pending(emu_rt, np.zeros(3, np.float32))
    for wrap in WRAPS.values():
        with pytest.raises(ValueError, match="k: expected an array on cuda:0, got one on cuda:1"):
            as_array("k", wrap(other, producer), dev)
    with pytest.raises(ValueError, match="k: expected an array on cuda:0, got one on cuda:1"):
        as_array("k", other, dev)
    with pytest.raises(TypeError, match="stream"):
        as_array("k", Interface(other, producer), dev, stream="not a stream")


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_restores_and_pool_writes_take_pending_foreign_arrays(emu_rt, wrap):
    """The same calls with native arrays (written and synchronized first) and with foreign
    arrays whose producer has not run yet leave the same bytes, with no host sync."""
    wrap, xp = WRAPS[wrap], emu_rt.xp
    consumer = emu_rt.stream(non_blocking=True)
    kv = [KVCacheManager(KVCacheConfig(2, 4, [KVLayerConfig(2, 8)], "float32"), device="cuda")
          for _ in range(2)]
    mm = [MambaCacheManager(MambaCacheConfig(1, 2, 1, 2, 3, 2, 3), device="cuda")
          for _ in range(2)]
    pools = [PagedKVPool([KVLayerConfig(2, 8)], 4, 2, "float8_e4m3fn", device="cuda")
             for _ in range(2)]
    saved, rec, conv = (rows((2, 2, 3, 8), "float32", 5), rows((1, 1, 2, 3), "float32", 6),
                        rows((1, 2, 3), "float16", 7))
    k, v = rows((3, 2, 8), "float32", 10), rows((3, 2, 8), "float32", 11)
    table, lengths = np.array([[2, 0]], np.int32), np.array([1], np.int32)
    scale = np.full((1,), 0.5, np.float32)
    kv[0].restore_kv_cache([xp.asarray(saved)], 1)
    mm[0].restore_states([xp.asarray(rec)], [xp.asarray(conv)], 1)
    pools[0].write_kv(xp.asarray(k), xp.asarray(v), block_table=xp.asarray(table), layer=0,
                      uniform_tokens=3, batch=1, cache_lengths=xp.asarray(lengths),
                      k_scale=xp.asarray(scale), v_scale=2.0)
    emu_rt.synchronize()
    foreign = {name: wrap(*pending(emu_rt, a)) for name, a in (
        ("saved", saved), ("rec", rec), ("conv", conv), ("k", k), ("v", v), ("table", table),
        ("lengths", lengths), ("scale", scale))}
    syncs = emu_rt.counters["syncs"]
    kv[1].restore_kv_cache([foreign["saved"]], 1, stream=consumer)
    mm[1].restore_states([foreign["rec"]], [foreign["conv"]], 1, stream=consumer)
    pools[1].write_kv(foreign["k"], foreign["v"], block_table=foreign["table"], layer=0,
                      uniform_tokens=3, batch=1, cache_lengths=foreign["lengths"],
                      k_scale=foreign["scale"], v_scale=2.0, stream=consumer)
    assert emu_rt.counters["syncs"] == syncs, "a foreign array cost a host sync"
    with consumer:
        pairs = ([(kv[0].get_combined_kv_cache(0), kv[1].get_combined_kv_cache(0))]
                 + list(zip(mm[0].state_tensors, mm[1].state_tensors))
                 + [(pools[0].layers[0].view(np.uint8), pools[1].layers[0].view(np.uint8))])
        for want, got in pairs:
            assert host(want).any() and np.array_equal(host(want), host(got))


def test_a_scale_table_on_another_device_is_refused_and_changes_nothing(emu_rt):
    """The device check of ``kv_scales.check_scale`` (and of the writers' scale tables): a
    table on cuda:1 for a cache on cuda:0 is a ValueError naming the argument, before any
    launch could read it."""
    with emu_rt.device_scope(1):
        far = emu_rt.xp.full((1,), 0.5, dtype=np.float32)
    dev0 = resolve_device("cuda:0")
    message = "k_scale: expected an array on cuda:0, got one on cuda:1"
    with pytest.raises(ValueError, match=message):
        check_scale("k_scale", far, True, dev0, 1, 2)
    near = emu_rt.xp.full((1,), 0.5, dtype=np.float32)
    assert check_scale("k_scale", near, True, dev0, 1, 2) is near
    pool = PagedKVPool([KVLayerConfig(2, 8)], 4, 2, "float8_e4m3fn", device="cuda:0")
    xp, k = emu_rt.xp, rows((3, 2, 8), "float32", 10)
    before = host(pool.layers[0].view(np.uint8))
    with pytest.raises(ValueError, match=message):
        pool.write_kv(xp.asarray(k), xp.asarray(k), block_table=xp.asarray(
            np.array([[2, 0]], np.int32)), layer=0, uniform_tokens=3, batch=1, k_scale=far)
    assert np.array_equal(before, host(pool.layers[0].view(np.uint8)))
    kvm = KVCacheManager(KVCacheConfig(2, 4, [KVLayerConfig(2, 8)], "float8_e4m3fn"),
                         device="cuda:0")
    kvm.set_kv_scales(k_scale=0.25)
    tables = [host(t) for t in kvm.get_kv_scales()]
    with pytest.raises(ValueError, match=message):
        kvm.set_kv_scales(k_scale=far, v_scale=near)
    assert tables[0][0, 0] == np.float32(0.25)
    assert all(np.array_equal(t, host(u)) for t, u in zip(tables, kvm.get_kv_scales()))


# --- allocation: device.zeros -------------------------------------------------------------------

def test_zeros_is_tracked_device_memory_whose_fill_is_queued_until_settled(emu_rt):
    dev = resolve_device("cuda")
    stream = emu_rt.stream(non_blocking=True)
    allocations = emu_rt.counters["allocations"]
    with stream:
        a = zeros(dev, (3, 5), np.float16)
        assert emu_rt.counters["allocations"] == allocations + 1
        assert emu_rt.lookup(data_pointer(a)) == (0, True)
        assert data_pointer(a) % ALIGNMENT == 0 and a.flags.c_contiguous
        assert (a._v.view(np.uint8) == 0xBE).all(), "the fill ran before anything waited"
        settle(dev)
        assert not a._v.view(np.uint8).any()
    assert a.shape == (3, 5) and a.dtype == np.float16


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn"])
def test_every_cache_buffer_is_aligned_zeroed_and_ready_on_another_stream(emu_rt, dtype):
    """Managers built with a non-blocking stream current: every buffer is live device memory
    of the device, 64-byte aligned, and zero when read from another non-blocking stream (the
    constructors settled their fills); DLPack imports it without a copy."""
    built, reader = emu_rt.stream(non_blocking=True), emu_rt.stream(non_blocking=True)
    with built:
        buffers = exported_buffers(dtype, "cuda")
    assert len(buffers) == 24 + 10 + 12   # + latent and conv-only, + ring and local-block
    with reader:
        for name, a in buffers:
            ptr = data_pointer(a)
            assert emu_rt.lookup(ptr) == (0, True), name
            assert ptr % ALIGNMENT == 0, name
            assert not host(a).view(np.uint8).any(), f"{name}: garbage, its fill not settled"
            imported = emu_rt.from_dlpack(dlpack_view(a))
            assert data_pointer(imported) == ptr and imported.shape == a.shape, name
            assert imported.dtype.itemsize == a.dtype.itemsize, name


def test_a_dlpack_export_orders_the_cache_writer_before_the_importer(emu_rt):
    """A cache written on one stream and exported to a consumer stream: the consumer reads the
    write without any host sync in between (the export records and waits an event)."""
    kvm = KVCacheManager(KVCacheConfig(2, 4, [KVLayerConfig(2, 8)], "float32"), device="cuda")
    saved = rows((2, 2, 3, 8), "float32", 5)
    writer, consumer = emu_rt.stream(non_blocking=True), emu_rt.stream(non_blocking=True)
    src = emu_rt.xp.asarray(saved)
    emu_rt.synchronize()
    kvm.restore_kv_cache([src], 1, stream=writer)
    cache = kvm.get_combined_kv_cache(0)
    syncs = emu_rt.counters["syncs"]
    view = as_array("cache", DLPackOnly(dlpack_view(cache), writer), resolve_device("cuda"),
                    consumer)
    assert emu_rt.counters["syncs"] == syncs
    with consumer:
        assert np.array_equal(host(view)[1, :, :, :3], saved)


# --- memory before allocation -------------------------------------------------------------------

def _sized():
    kv = KVCacheConfig(2, 8, [KVLayerConfig(2, 16), KVLayerConfig(1, 32, components=1)],
                       "bfloat16")
    mamba = MambaCacheConfig(2, 2, 2, 4, 8, 16, 4)
    return [
        (kv.nbytes, lambda: KVCacheManager(kv, device="cuda")),
        (mamba.nbytes, lambda: MambaCacheManager(mamba, device="cuda")),
        (HybridCacheConfig(["attention", "mamba"], KVCacheConfig(
            2, 8, [KVLayerConfig(2, 16)]), MambaCacheConfig(1, 2, 2, 4, 8, 16, 4), 2).nbytes,
         lambda: HybridCacheManager(HybridCacheConfig(["attention", "mamba"], KVCacheConfig(
             2, 8, [KVLayerConfig(2, 16)]), MambaCacheConfig(1, 2, 2, 4, 8, 16, 4), 2),
             device="cuda")),
        (LinearCacheConfig(2, 2, 8, 2, 16).nbytes,
         lambda: LinearKVCache(LinearCacheConfig(2, 2, 8, 2, 16), device="cuda")),
        (KVCacheStaticParams(2, 16).nbytes("float16", 2, 8, 2),
         lambda: ContinuousBatchingKVCacheManager("float16", KVCacheStaticParams(2, 16), 2, 8, 2,
                                                  device="cuda")),
        (PagedKVPool.nbytes_for([KVLayerConfig(2, 16)], 4, 8),
         lambda: PagedKVPool([KVLayerConfig(2, 16)], 4, 8, device="cuda")),
    ]


@pytest.mark.parametrize("case", range(6))
def test_the_known_bytes_are_what_the_device_gives_and_a_layout_too_big_is_refused(emu_rt,
                                                                                   case):
    """``nbytes`` (known before allocating) is the manager's memory report on the device, and
    construction ran its zero fills (settled); with one byte less free than that, construction
    is a CacheCapacityError and allocates nothing; with exactly that free, it succeeds."""
    nbytes, build = _sized()[case]
    dev = resolve_device("cuda")
    built = emu_rt.stream(non_blocking=True)
    with built:
        manager = build()
    assert built.enqueued and built.executed == built.enqueued, "fills left queued"
    report = manager.memory_report()
    assert report.get("total", report.get("total_bytes")) == nbytes
    del manager, report
    gc.collect()
    emu_rt.synchronize()
    live = emu_rt.live_bytes[0]
    emu_rt.capacity = live + nbytes - 1
    assert cuda_free_bytes(dev) == nbytes - 1
    allocations = emu_rt.counters["allocations"]
    with pytest.raises(CacheCapacityError) as info:
        build()
    assert (info.value.required, info.value.available) == (nbytes, nbytes - 1)
    assert emu_rt.counters["allocations"] == allocations, "allocated before refusing"
    emu_rt.capacity = live + nbytes
    build()


def test_a_context_settles_its_fills_and_checks_its_states_with_its_pool(emu_rt):
    from hcache import DynamicInferenceContext
    from hcache.config.sizing import context_states_nbytes

    def build():
        return DynamicInferenceContext(
            kv_layer_configs=[KVLayerConfig(2, 16)], num_blocks=4, block_size_tokens=4,
            max_requests=4, max_blocks_per_request=2, num_mamba_layers=1,
            conv_states_shape=(16, 4), ssm_states_shape=(2, 4, 8), mamba_cache_slots=2,
            device="cuda")

    built = emu_rt.stream(non_blocking=True)
    with built:
        ctx = build()
    assert built.executed == built.enqueued, "the context left its fills queued"
    with emu_rt.stream(non_blocking=True):
        assert not host(ctx.mamba_ssm_states).any() and not host(ctx.kv_pool.layers[0]).any()
    # checked: the pool and the context's states and staging (descriptor tables aside, §2)
    checked = ctx.kv_pool.memory_report()["total_bytes"] + context_states_nbytes(
        ctx, 2, (16, 4), (2, 4, 8), np.float16, np.float32)
    emu_rt.capacity = emu_rt.live_bytes[0] + checked - 1
    allocations = emu_rt.counters["allocations"]
    with pytest.raises(CacheCapacityError) as info:
        build()
    assert (info.value.required, info.value.available) == (checked, checked - 1)
    assert emu_rt.counters["allocations"] == allocations, "allocated before refusing"
