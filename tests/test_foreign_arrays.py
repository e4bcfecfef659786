"""Arrays of any library as inputs (docs/design.md §2, "Foreign arrays"), on the cpu device.

Tokens, K/V rows, states, scale tables and index arrays may come from any array library: an
object with ``__dlpack__`` (+ ``__dlpack_device__``), ``__array_interface__`` or ``__array__``
is viewed as a NumPy array without a copy; device memory, non-arrays and arrays NumPy cannot
import are a ``TypeError`` naming the argument. The test objects below expose exactly one
protocol each (no NumPy subclass, no CuPy), so each protocol path is taken on its own. Oracle:
the same call with plain NumPy arrays on a second manager, byte for byte.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from test_write_kv import linear, rows

from hcache import (
    ContinuousBatchingKVCacheManager,
    KVCacheStaticParams,
    PagedKVPool,
    compute_block_hashes,
)
from hcache._checks import host_array as checked_host_array
from hcache.arrays import as_array, host_array
from hcache.config.caches import KVCacheConfig, KVLayerConfig, MambaCacheConfig
from hcache.device import resolve_device
from hcache.slots.kv import KVCacheManager
from hcache.slots.mamba import MambaCacheManager

from helpers import DEVICES


class DLPackOnly:
    """Only the DLPack protocol (what a CuPy-less library hands out)."""

    def __init__(self, a, device=(1, 0)):
        self._a, self._device = a, device

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._device


class ArrayOnly:
    """Only ``__array__`` (a lazily converted container)."""

    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        return self._a


class InterfaceOnly:
    """Only the array interface (a raw host buffer and its layout)."""

    def __init__(self, a):
        self._a = a
        self.__array_interface__ = a.__array_interface__


class CudaInterfaceOnly:
    """Device memory by the CUDA array interface (never dereferenced on cpu)."""

    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False),
                                "version": 3}


WRAPPERS = [DLPackOnly, ArrayOnly, InterfaceOnly]


def _jax_wrapper():
    """JAX arrays in host memory: these tests hand them to ``cpu`` managers, and on a machine
    with a GPU, JAX's default device is the GPU (hcache rightly refuses device memory there)."""
    jax = pytest.importorskip("jax")
    cpu = jax.devices("cpu")[0]
    return lambda a: jax.device_put(a, cpu)


WRAP_IDS = ["dlpack", "array", "interface"]
ALL_WRAPPERS = [*(pytest.param(w, id=i) for w, i in zip(WRAPPERS, WRAP_IDS)),
                pytest.param("jax", id="jax")]


def wrapper(kind):
    return _jax_wrapper() if kind == "jax" else kind


# --- the coercion itself -----------------------------------------------------------------------

@pytest.mark.parametrize("wrap", WRAPPERS, ids=WRAP_IDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "int64", "uint8"])
def test_host_array_views_each_protocol_without_a_copy(wrap, dtype):
    a = np.arange(24).astype(dtype).reshape(2, 3, 4)
    view = host_array("x", wrap(a))
    assert isinstance(view, np.ndarray) and np.shares_memory(view, a)
    assert view.shape == a.shape and view.dtype == a.dtype and np.array_equal(view, a)
    assert as_array("x", wrap(a), resolve_device("cpu")) is not None


def test_a_numpy_array_is_returned_as_it_is():
    a = np.zeros(3)
    assert host_array("x", a) is a and as_array("x", a, resolve_device("cpu")) is a


@pytest.mark.parametrize("bad, why", [
    ([1.0, 2.0], "got list"), (None, "got NoneType"), (1.5, "got float"), ("ab", "got str"),
    (DLPackOnly(np.zeros(2, np.float32), device=(2, 0)), "got device memory"),
    (CudaInterfaceOnly(), "got device memory"),
    (ArrayOnly(np.array([object()])), "dtype object"),
])
def test_what_is_not_a_host_array_is_a_type_error_naming_the_argument(bad, why):
    with pytest.raises(TypeError, match=f"k: expected a numpy array.*{why}"):
        host_array("k", bad)


def test_a_dlpack_dtype_numpy_cannot_import_says_why():
    """NumPy's DLPack import has no bfloat16: an object with only ``__dlpack__`` that exports
    bfloat16 is refused (with the importer's reason), one with ``__array__`` too is read
    through it."""

    class BF16Export:
        def __dlpack__(self, **kwargs):
            raise BufferError("bfloat16 has no DLPack equivalent here")

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(TypeError, match="k: expected a numpy array.*bfloat16 has no DLPack"):
        host_array("k", BF16Export())
    a = np.ones(4, ml_dtypes.bfloat16)

    class Both(BF16Export, ArrayOnly):
        pass

    assert np.shares_memory(host_array("k", Both(a)), a)


def test_checked_host_array_reads_sequences_views_arrays_and_refuses_device_memory():
    # The one host coercion of integer arguments: sequences checked, foreign arrays viewed.
    got = checked_host_array("ids", [1, 2])
    assert got.tolist() == [1, 2] and got.dtype.kind == "i"
    a = np.arange(3)
    assert np.shares_memory(checked_host_array("ids", DLPackOnly(a)), a)
    with pytest.raises(TypeError, match="ids: expected host integers, got device memory"):
        checked_host_array("ids", CudaInterfaceOnly())
    with pytest.raises(TypeError, match=r"ids\[1\]: expected an int, got bool"):
        checked_host_array("ids", [1, True])
    with pytest.raises(ValueError, match=r"ids\[0\]: expected an int64 value"):
        checked_host_array("ids", [2**64, 1])


# --- every entry point --------------------------------------------------------------------------

@pytest.mark.parametrize("wrap", ALL_WRAPPERS)
def test_write_kv_and_host_ints_of_the_contiguous_slot_managers(wrap):
    wrap = wrapper(wrap)
    ms = [linear(), linear()]
    lengths = np.array([0, 2, 1], np.int64)
    ms[0].reset_for_new_sequences(lengths)
    ms[1].reset_for_new_sequences(wrap(lengths))
    k = [rows((3, 2, 2, 16), "float16", s) for s in (1, 2)]
    v = [rows((3, 2, 2, 16), "float16", s) for s in (3, 4)]
    ms[0].write_kv(None, k, v)
    ms[1].write_kv(None, [wrap(a) for a in k], [wrap(a) for a in v])
    k1, v1 = k[0][:, :1].copy(), v[0][:, :1].copy()
    ms[0].write_kv(1, k1, v1, positions=np.array([[4], [5], [6]]))
    ms[1].write_kv(1, wrap(k1), wrap(v1), positions=wrap(np.array([[4], [5], [6]])))
    ms[0].commit_sequence_length(np.array([2, 1, 0], np.int32))
    ms[1].commit_sequence_length(wrap(np.array([2, 1, 0], np.int32)))
    assert np.array_equal(ms[0].get_kv_cache_buffer(), ms[1].get_kv_cache_buffer())
    assert ms[0].get_kv_cache_buffer().any()
    assert np.array_equal(ms[0].get_kv_cache_lengths(), ms[1].get_kv_cache_lengths())


@pytest.mark.parametrize("wrap", ALL_WRAPPERS)
def test_restores_take_foreign_tensors(wrap):
    wrap = wrapper(wrap)
    kv = [KVCacheManager(KVCacheConfig(2, 4, [KVLayerConfig(2, 8)], "float32"), device="cpu")
          for _ in range(2)]
    saved = rows((2, 2, 3, 8), "float32", 5)
    kv[0].restore_kv_cache([saved], 1)
    kv[1].restore_kv_cache([wrap(saved)], 1)
    assert np.array_equal(kv[0].get_combined_kv_cache(0), kv[1].get_combined_kv_cache(0))
    mc = MambaCacheConfig(1, 2, 1, 2, 3, 2, 3)
    mm = [MambaCacheManager(mc, device="cpu") for _ in range(2)]
    rec = rows((1, 1, 2, 3), "float32", 6)
    conv = rows((1, 2, 3), "float16", 7)
    mm[0].restore_states([rec], [conv], 1)
    mm[1].restore_states([wrap(rec)], [wrap(conv)], 1)
    for a, b in zip(mm[0].state_tensors, mm[1].state_tensors):
        assert np.array_equal(a, b) and a.any()


@pytest.mark.parametrize("wrap", ALL_WRAPPERS)
def test_continuous_batching_write_takes_foreign_rows(wrap):
    wrap = wrapper(wrap)
    ms = [ContinuousBatchingKVCacheManager("float16", KVCacheStaticParams(2, 8), 2, 6, 2,
                                           device="cpu") for _ in range(2)]
    key, value = rows((2, 3, 2, 8), "float16", 8), rows((2, 3, 2, 8), "float16", 9)
    for m, wrapped in zip(ms, (False, True)):
        coll = m.fetch(m.claim(2))
        w = wrap if wrapped else (lambda a: a)
        coll.write(1, w(key), w(value))
        coll.write_kv(0, w(key[:, :1].copy()), w(value[:, :1].copy()))
        m.step([3, 3], coll)
    assert np.array_equal(ms[0].blocks_buf, ms[1].blocks_buf) and ms[0].blocks_buf.any()


@pytest.mark.parametrize("wrap", ALL_WRAPPERS)
def test_paged_pool_write_takes_foreign_rows_tables_and_scales(wrap):
    wrap = wrapper(wrap)
    pools = [PagedKVPool([KVLayerConfig(2, 8)], 4, 2, "float8_e4m3fn", device="cpu")
             for _ in range(2)]
    k, v = rows((3, 2, 8), "float32", 10), rows((3, 2, 8), "float32", 11)
    table = np.array([[2, 0]], np.int32)
    lengths = np.array([1], np.int32)
    scale = np.full((1,), 0.5, np.float32)
    pools[0].write_kv(k, v, block_table=table, layer=0, uniform_tokens=3, batch=1,
                      cache_lengths=lengths, k_scale=scale, v_scale=2.0)
    pools[1].write_kv(wrap(k), wrap(v), block_table=wrap(table), layer=0, uniform_tokens=3,
                      batch=1, cache_lengths=wrap(lengths), k_scale=wrap(scale), v_scale=2.0)
    pools[1].write_kv([wrap(k)], [wrap(v)], block_table=wrap(table), uniform_tokens=3,
                      batch=1, cache_lengths=wrap(lengths), k_scale=wrap(scale), v_scale=2.0)
    assert pools[0].layers[0].view(np.uint8).any()
    assert np.array_equal(pools[0].layers[0].view(np.uint8), pools[1].layers[0].view(np.uint8))


@pytest.mark.parametrize("wrap", ALL_WRAPPERS)
def test_tokens_and_block_ids_from_any_library(wrap):
    wrap = wrapper(wrap)
    tokens = np.arange(100, 112, dtype=np.int64)
    assert compute_block_hashes(wrap(tokens), 4) == compute_block_hashes(tokens.tolist(), 4)
    from test_mamba_slot_allocator import make, registered_blocks
    _, kv, alloc = make(max_slots=4)
    ids, _ = registered_blocks(kv, 1)
    alloc.allocate_slots_batch(wrap(np.asarray(ids, np.int64)))
    slot = alloc.get_slot(int(ids[0]))
    ssm = rows(alloc.ssm_states.shape[2:], alloc.ssm_states.dtype, 12)
    conv = rows(alloc.conv_states.shape[2:], alloc.conv_states.dtype, 13)
    alloc.store_from_tensors(int(ids[0]), 0, wrap(ssm), wrap(conv))
    assert np.array_equal(alloc.ssm_states[0, slot], ssm)
    assert np.array_equal(alloc.conv_states[0, slot], conv)


def test_a_foreign_array_of_the_wrong_memory_changes_nothing():
    m = linear()
    m.reset_for_new_sequences([0, 0, 0])
    before = m.get_kv_cache_buffer().copy()
    k = rows((3, 1, 2, 16), "float16", 1)
    bad = DLPackOnly(k, device=(2, 0))
    with pytest.raises(TypeError, match=r"v\[1\]: expected a numpy array .*device memory"):
        m.write_kv(None, [k, k], [k, bad])
    assert np.array_equal(before, m.get_kv_cache_buffer())
    with pytest.raises(TypeError, match="positions: expected host integers, got device memory"):
        m.write_kv(0, k, k, positions=CudaInterfaceOnly())



# --- cuda: device memory of any library, host memory refused -----------------------------------

@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
def test_cuda_views_device_arrays_of_any_protocol(device):
    """On a GPU and on the emulated device: a device array wrapped to expose only DLPack or
    only the CUDA array interface is viewed in place; a NumPy array is refused (using it would
    be a copy)."""
    device = resolve_device(device)
    xp = device.xp

    class CudaInterface:
        def __init__(self, a):
            self._a = a
            self.__cuda_array_interface__ = a.__cuda_array_interface__

    a = xp.arange(12, dtype=np.float32).reshape(3, 4)
    for wrapped in (DLPackOnly(a, device=a.__dlpack_device__()), CudaInterface(a)):
        view = as_array("k", wrapped, device)
        assert isinstance(view, xp.ndarray) and view.data.ptr == a.data.ptr
        assert view.shape == a.shape and view.dtype == a.dtype
    with pytest.raises(TypeError, match=f"k: expected a {xp.__name__} array"):
        as_array("k", np.zeros(3, np.float32), device)


@pytest.mark.parametrize("wrap", ALL_WRAPPERS)
def test_context_takes_tokens_and_request_ids_from_any_library(wrap):
    """The same requests admitted and extended with lists and with foreign arrays get the same
    blocks, hashes and token counts."""
    from hcache import DynamicInferenceContext
    wrap = wrapper(wrap)

    def run(convert):
        ctx = DynamicInferenceContext(
            kv_layer_configs=[KVLayerConfig(1, 4)], num_blocks=16, block_size_tokens=2,
            max_requests=4, max_blocks_per_request=8, device="cpu")
        ctx.add_request(7, convert(np.arange(5, dtype=np.int64)))
        ctx.add_request(8, convert(np.array([0, 1, 2, 3, 9], np.int64)))
        ctx.commit_step()
        ctx.extend_requests(convert(np.array([7, 8], np.int64)),
                            convert(np.array([11, 12], np.int64)))
        ctx.commit_step()
        ctx.release_requests(convert(np.array([8], np.int64)))
        return (np.asarray(ctx.block_ids(7)).tolist(), ctx.num_computed_tokens(7),
                ctx.kv_block_allocator.block_hashes.tolist())

    assert run(wrap) == run(lambda a: a.tolist())


# --- latent (MLA) layers and single-state Mamba layers: None where there is no plane or state ---

LATENT = KVLayerConfig(1, 16, components=1)   # one latent vector per token, no V plane


def _same(wrap):
    return (lambda a: a), wrapper(wrap)


@pytest.mark.parametrize("wrap", ALL_WRAPPERS)
def test_latent_writes_take_foreign_k_beside_v_none(wrap):
    """A latent layer's rows are ``k`` (any library) and its ``v`` None: alone, in a list
    beside foreign V rows of a K/V layer, and for a model of latent layers only (``v``
    omitted). Oracle: the same calls with NumPy arrays."""
    from hcache import HybridCacheConfig, HybridCacheManager, LayerType
    A = LayerType.ATTENTION
    kv = KVCacheConfig(2, 6, [LATENT, KVLayerConfig(2, 8)], "float16")
    k0, k1, v1 = (rows(s, "float16", i) for i, s in
                  enumerate([(2, 1, 1, 16), (2, 1, 2, 8), (2, 1, 2, 8)]))
    latent, positions = rows((2, 2, 1, 16), "float16", 4), np.array([[3, 4], [4, 5]])
    out = []
    for w in _same(wrap):
        m = HybridCacheManager(HybridCacheConfig([A, A], kv, None, 2), device="cpu")
        m.reset_for_new_sequences([0, 0])
        m.write_kv(None, [w(k0), w(k1)], [None, w(v1)])
        m.write_kv(0, w(latent), positions=w(positions))
        only = KVCacheManager(KVCacheConfig(2, 6, [LATENT], "float16"), device="cpu")
        only.write_kv(None, [w(latent)], positions=w(positions))
        out.append([m.get_combined_kv_cache(0), m.get_combined_kv_cache(1),
                    only.get_combined_kv_cache(0)])
    for a, b in zip(*out):
        assert a.any() and np.array_equal(a, b)
    assert np.array_equal(out[1][0][:, 0, 0, 0], k0[:, 0, 0])


@pytest.mark.parametrize("wrap", ALL_WRAPPERS)
def test_latent_pool_and_mla_continuous_writes_take_foreign_k(wrap):
    table, lengths = np.array([[2, 0]], np.int32), np.array([1], np.int32)
    k0, k1, v1 = (rows((3, h, d), "float32", i) for i, (h, d) in
                  enumerate([(1, 16), (2, 8), (2, 8)]))
    pools, blocks = [], []
    for w in _same(wrap):
        pool = PagedKVPool([LATENT, KVLayerConfig(2, 8)], 4, 2, "float8_e4m3fn", device="cpu")
        args = dict(block_table=w(table), uniform_tokens=3, batch=1, cache_lengths=w(lengths))
        pool.write_kv(w(k0), None, layer=0, k_scale=0.5, **args)
        pool.write_kv([w(k0), w(k1)], [None, w(v1)], k_scale=2.0, v_scale=2.0, **args)
        pools.append(pool)
        m = ContinuousBatchingKVCacheManager("float16", KVCacheStaticParams(1, 16, is_mla=True),
                                             2, 6, 2, device="cpu")
        coll = m.fetch(m.claim(2))
        coll.write_kv(1, w(rows((2, 3, 1, 16), "float16", 7)))
        coll.write(0, w(rows((2, 2, 1, 16), "float16", 8)))
        m.step([3, 3], coll)
        blocks.append(m.blocks_buf)
    for a, b in zip(pools[0].layers, pools[1].layers):
        assert a.view(np.uint8).any() and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert blocks[0].shape[1] == 1 and blocks[0].any()
    assert np.array_equal(blocks[0], blocks[1])


@pytest.mark.parametrize("wrap", ALL_WRAPPERS)
def test_a_foreign_v_for_a_latent_layer_is_refused_and_changes_nothing(wrap):
    wrap = wrapper(wrap)
    m = KVCacheManager(KVCacheConfig(2, 6, [LATENT, KVLayerConfig(2, 8)], "float16"),
                       device="cpu")
    k = rows((2, 1, 1, 16), "float16", 1)
    with pytest.raises(ValueError, match=r"v: expected None \(attention layer 0 is a latent"):
        m.write_kv(0, wrap(k), wrap(k), positions=[[0], [0]])
    with pytest.raises(ValueError, match=r"v\[1\]: expected V rows .* got None"):
        m.write_kv(None, [wrap(k), wrap(rows((2, 1, 2, 8), "float16", 2))], [None, None],
                   positions=[[0], [0]])
    pool = PagedKVPool([LATENT], 4, 2, device="cpu")
    with pytest.raises(ValueError, match=r"v: expected None \(attention layer 0 is a latent"):
        pool.write_kv(wrap(k[:, 0]), wrap(k[:, 0]), layer=0, block_table=np.zeros((1, 1),
                      np.int32), uniform_tokens=2, batch=1, cache_lengths=np.zeros(1, np.int32))
    assert not any(c.any() for c in (m.get_combined_kv_cache(0), m.get_combined_kv_cache(1),
                                     pool.layers[0]))


@pytest.mark.parametrize("wrap", ALL_WRAPPERS)
def test_single_state_layers_restore_and_store_foreign_states(wrap):
    """Conv-only layers (short convolutions): restore takes foreign conv states and no
    recurrent ones; the prefix cache stores a foreign conv state beside ``ssm_state=None``."""
    wrap = wrapper(wrap)
    mm = [MambaCacheManager(MambaCacheConfig(2, 2, 0, 0, 0, 4, 3), device="cpu")
          for _ in range(2)]
    conv = [rows((1, 4, 3), "float16", s) for s in (1, 2)]
    mm[0].restore_states([], conv, 1)
    mm[1].restore_states([], [wrap(c) for c in conv], 1)
    for a, b in zip(mm[0].state_tensors, mm[1].state_tensors):
        assert a.any() and np.array_equal(a, b)
    from hcache import DynamicInferenceContext
    ctx = DynamicInferenceContext(
        kv_layer_configs=[LATENT], num_blocks=8, block_size_tokens=2, max_requests=2,
        max_blocks_per_request=4, num_mamba_layers=1, conv_states_shape=(4, 3),
        ssm_states_shape=None, mamba_cache_slots=2, device="cpu")
    alloc = ctx.mamba_slot_allocator
    block = int(ctx.kv_block_allocator.allocate_memory_blocks(1)[0])
    alloc.allocate_slots_batch([block])
    state = rows((4, 3), "float16", 3)
    alloc.store_from_tensors(block, 0, None, wrap(state))
    assert np.array_equal(alloc.conv_states[0, alloc.get_slot(block)], state)
    with pytest.raises(ValueError, match=r"ssm_state: expected None"):
        alloc.store_from_tensors(block, 0, wrap(rows((1,), "float32", 4)), wrap(state))


# --- ring buffers and local block spaces (sliding-window layers) --------------------------------

@pytest.mark.parametrize("wrap", ALL_WRAPPERS)
def test_ring_inputs_take_foreign_arrays(wrap):
    """A ring layer's writes (explicit positions past the window), the restore of a ring's
    capture (``min(n, W)`` tokens with ``sequence_length``) and ``ring_start`` lengths, each
    from any library, against the same calls with NumPy arrays."""
    same, wrap = _same(wrap)
    cfg = KVCacheConfig(2, 16, [KVLayerConfig(2, 8, 4), KVLayerConfig(1, 8)], "float32",
                        ring_windows=True)
    ms = [KVCacheManager(cfg, device="cpu") for _ in range(2)]
    k, v = rows((2, 6, 2, 8), "float32", 14), rows((2, 6, 2, 8), "float32", 15)
    k1, v1 = rows((2, 6, 1, 8), "float32", 16), rows((2, 6, 1, 8), "float32", 17)
    pos = np.tile(np.arange(3, 9, dtype=np.int64), (2, 1))   # 6 tokens past a window of 4
    for m, w in zip(ms, (same, wrap)):
        m.write_kv(None, [w(k), w(k1)], [w(v), w(v1)], positions=w(pos))
    assert all(np.array_equal(a, b) and a.any() for a, b in zip(
        (ms[0].get_combined_kv_cache(i) for i in range(2)),
        (ms[1].get_combined_kv_cache(i) for i in range(2))))
    saved = ms[0].capture_kv_cache(0, 9)          # the ring's last 4 tokens, in order
    assert saved[0].shape == (2, 2, 4, 8) and saved[1].shape == (2, 1, 9, 8)
    for m, w in zip(ms, (same, wrap)):
        m.restore_kv_cache([w(np.ascontiguousarray(t)) for t in saved], 1, sequence_length=9)
    for i in range(2):
        assert np.array_equal(ms[0].get_combined_kv_cache(i), ms[1].get_combined_kv_cache(i))
    lengths = np.array([3, 9, 16], np.int32)
    assert np.array_equal(ms[1].ring_start(0, wrap(lengths)), [0, 1, 0])
    assert np.array_equal(ms[1].ring_start(1, wrap(lengths)), [0, 0, 0])


@pytest.mark.parametrize("wrap", ALL_WRAPPERS)
def test_local_block_tables_and_ring_blocks_take_foreign_arrays(wrap):
    """A paged pool's local block table and a continuous-batching ring's rows from any
    library, against NumPy."""
    same, wrap = _same(wrap)
    layers = [KVLayerConfig(2, 8), KVLayerConfig(2, 8, 4)]
    pools = [PagedKVPool(layers, 4, 2, "float16", device="cpu", num_local_blocks=3)
             for _ in range(2)]
    k, v = rows((4, 2, 8), "float16", 18), rows((4, 2, 8), "float16", 19)
    table, local = np.array([[2, 0]], np.int32), np.array([[1, 2]], np.int32)
    for pool, w in zip(pools, (same, wrap)):
        pool.write_kv([w(k), w(k)], [w(v), w(v)], block_table=w(table), uniform_tokens=4,
                      batch=1, cache_lengths=w(np.zeros(1, np.int32)),
                      local_block_table=w(local))
    for a, b in zip(pools[0].layers, pools[1].layers):
        assert np.array_equal(a, b) and a.any()
    assert not pools[1].layers[1][0].any()   # local block 0 is not in the local table
    ms = [ContinuousBatchingKVCacheManager("float16", KVCacheStaticParams(2, 8), 2, 12, 1,
                                           device="cpu", sliding_window=4) for _ in range(2)]
    key, value = rows((2, 6, 2, 8), "float16", 20), rows((2, 6, 2, 8), "float16", 21)
    for m, w in zip(ms, (same, wrap)):
        coll = m.fetch(m.claim(2))
        coll.write(0, w(key), w(value))
        m.step([6, 6], coll)
    assert np.array_equal(ms[0].blocks_buf, ms[1].blocks_buf) and ms[0].blocks_buf.any()
    assert np.array_equal(ms[1].ring_start(wrap(np.array([6, 3], np.int32))), [2, 0])
