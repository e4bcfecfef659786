"""Cache buffers handed to other libraries without a copy (docs/design.md §2, "Views").

On the cpu device every cache allocation starts on a 64-byte boundary (``device.zeros``; latent
MLA planes, single-state Mamba layouts, ring buffers and local block spaces included), so
an importer that insists on alignment (JAX) shares it instead of copying; bfloat16 and float8
views leave through DLPack as their storage type (``dtypes.dlpack_view``). Oracles: the
address of each buffer, ``numpy.shares_memory`` and a byte written through the cache seen in
the importer's view.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hcache import (
    ContinuousBatchingKVCacheManager,
    DynamicInferenceContext,
    HybridCacheConfig,
    HybridCacheManager,
    KVCacheConfig,
    KVCacheManager,
    KVCacheStaticParams,
    KVLayerConfig,
    LayerType,
    LinearCacheConfig,
    LinearKVCache,
    MambaCacheConfig,
    MambaCacheManager,
    PagedKVPool,
)
from hcache.device import ALIGNMENT, resolve_device, zeros
from hcache.dtypes import DTYPE_NAMES, dlpack_view, resolve_dtype

A, M = LayerType.ATTENTION, LayerType.MAMBA
CPU = resolve_device("cpu")
# Sizes whose per-layer bytes are multiples of 64, so that per-layer views of one allocation
# (Mamba states, the linear cache) start on a 64-byte boundary as well.
KV_LAYERS = [KVLayerConfig(2, 16), KVLayerConfig(1, 32)]
MAMBA = dict(num_heads=2, head_dim=4, state_size=8, conv_dim=16, conv_kernel=4)
LATENT = KVLayerConfig(1, 32, components=1)   # an MLA layer: one latent plane, no V


def _mamba(num_layers, batch):
    return MambaCacheConfig(num_layers, batch, **MAMBA)


def exported_buffers(dtype, device="cpu"):
    """``(name, array)``: every cache buffer and per-layer view each manager hands out."""
    out = []
    kv = KVCacheManager(KVCacheConfig(2, 8, KV_LAYERS, dtype), device=device)
    out += [(f"kv.layer{i}", kv.get_combined_kv_cache(i)) for i in range(2)]
    mamba = MambaCacheManager(_mamba(2, 2), device=device)
    out += [(f"mamba.state{i}", t) for i, t in enumerate(mamba.state_tensors)]
    hybrid = HybridCacheManager(HybridCacheConfig(
        [A, M, A], KVCacheConfig(2, 8, KV_LAYERS, dtype), _mamba(1, 2), 2), device=device)
    out += [("hybrid.kv0", hybrid.get_combined_kv_cache(0)),
            ("hybrid.kv2", hybrid.get_combined_kv_cache(2)),
            ("hybrid.recurrent1", hybrid.get_recurrent_state(1)),
            ("hybrid.conv1", hybrid.get_conv_state(1))]
    lin = LinearKVCache(LinearCacheConfig(2, 2, 8, 2, 16, dtype=dtype), device=device)
    out += [("linear.buffer", lin.get_kv_cache_buffer())]
    out += [(f"linear.layer{i}", lin.get_combined_kv_cache_for_decoder_layer(i))
            for i in range(2)]
    cb = ContinuousBatchingKVCacheManager(dtype, KVCacheStaticParams(2, 16), 2, 8, 2,
                                          device=device)
    out += [("continuous.blocks_buf", cb.blocks_buf)]
    pool = PagedKVPool(KV_LAYERS, 4, 8, dtype, device=device)
    out += [(f"paged.layer{i}", a) for i, a in enumerate(pool.layers)]
    ctx = DynamicInferenceContext(
        kv_layer_configs=KV_LAYERS, num_blocks=4, block_size_tokens=4, max_requests=4,
        max_blocks_per_request=2, num_mamba_layers=1, conv_states_shape=(16, 4),
        ssm_states_shape=(2, 4, 8), mamba_cache_slots=2, kv_dtype=dtype, device=device)
    alloc = ctx.mamba_slot_allocator
    out += [("context.live_conv", ctx.mamba_conv_states),
            ("context.live_ssm", ctx.mamba_ssm_states),
            ("context.cached_conv", alloc.conv_states), ("context.cached_ssm", alloc.ssm_states),
            ("context.scratch_conv", alloc.intermediate_conv_out),
            ("context.scratch_ssm", alloc.intermediate_ssm_out)]
    out += [(f"context.kv{i}", a) for i, a in enumerate(ctx.kv_pool.layers)]
    return out + latent_and_conv_only_buffers(dtype, device) + ring_buffers(dtype, device)


def latent_and_conv_only_buffers(dtype, device="cpu"):
    """The buffers of latent (MLA) layers (one plane) and of conv-only Mamba layers (no
    recurrent state), which their managers allocate in their own shapes."""
    out = []
    layers = [LATENT, KV_LAYERS[0]]
    kv = KVCacheManager(KVCacheConfig(2, 8, layers, dtype), device=device)
    out += [("latent.kv0", kv.get_combined_kv_cache(0))]
    conv_only = MambaCacheConfig(2, 2, 0, 0, 0, 16, 4)
    out += [(f"conv_only.state{i}", t) for i, t in enumerate(
        MambaCacheManager(conv_only, device=device).state_tensors)]
    hybrid = HybridCacheManager(HybridCacheConfig(
        [A, M, A], KVCacheConfig(2, 8, layers, dtype), MambaCacheConfig(1, 2, 0, 0, 0, 16, 4),
        2), device=device)
    out += [("hybrid.latent0", hybrid.get_combined_kv_cache(0)),
            ("hybrid.conv_only1", hybrid.get_conv_state(1))]
    cb = ContinuousBatchingKVCacheManager(dtype, KVCacheStaticParams(1, 32, is_mla=True), 2, 8,
                                          2, device=device)
    out += [("continuous.mla_blocks_buf", cb.blocks_buf)]
    ctx = DynamicInferenceContext(
        kv_layer_configs=layers, num_blocks=4, block_size_tokens=4, max_requests=4,
        max_blocks_per_request=2, num_mamba_layers=1, conv_states_shape=(16, 4),
        ssm_states_shape=None, mamba_cache_slots=2, kv_dtype=dtype, device=device)
    alloc = ctx.mamba_slot_allocator
    assert ctx.mamba_ssm_states is None and alloc.ssm_states is None
    out += [("conv_context.live_conv", ctx.mamba_conv_states),
            ("conv_context.cached_conv", alloc.conv_states),
            ("conv_context.scratch_conv", alloc.intermediate_conv_out),
            ("conv_context.latent_kv0", ctx.kv_pool.layers[0])]
    return out


def ring_buffers(dtype, device="cpu"):
    """The buffers of sliding-window layers: ring caches (a K/V ring and a latent ring) of
    every manager that keeps them, ring blocks of the continuous-batching manager, and the
    local block space of a paged pool and of a context (``num_local_blocks``)."""
    out = []
    layers = [KVLayerConfig(2, 16, 4), KVLayerConfig(1, 32, 2, components=1), KV_LAYERS[1]]
    rings = KVCacheConfig(2, 8, layers, dtype, ring_windows=True)
    assert rings.layer_ring_windows == (4, 2, 0)
    kv = KVCacheManager(rings, device=device)
    out += [(f"ring.kv{i}", kv.get_combined_kv_cache(i)) for i in range(3)]
    hybrid = HybridCacheManager(HybridCacheConfig([A, M, A, A], rings, _mamba(1, 2), 2),
                                device=device)
    out += [("ring_hybrid.kv0", hybrid.get_combined_kv_cache(0)),
            ("ring_hybrid.latent2", hybrid.get_combined_kv_cache(2))]
    cb = ContinuousBatchingKVCacheManager(dtype, KVCacheStaticParams(2, 16), 2, 8, 2,
                                          device=device, sliding_window=4)
    assert cb.blocks_buf.shape[3] == 4
    out += [("ring_continuous.blocks_buf", cb.blocks_buf)]
    pool = PagedKVPool(layers, 4, 8, dtype, device=device, num_local_blocks=3)
    assert [a.shape[0] for a in pool.layers] == [3, 3, 4]
    out += [(f"local_paged.layer{i}", a) for i, a in enumerate(pool.layers)]
    ctx = DynamicInferenceContext(
        kv_layer_configs=layers, num_blocks=4, block_size_tokens=4, max_requests=4,
        max_blocks_per_request=2, kv_dtype=dtype, device=device, num_local_blocks=3)
    out += [(f"local_context.kv{i}", a) for i, a in enumerate(ctx.kv_pool.layers)]
    return out


DTYPES = ["float16", "bfloat16", "float8_e4m3fn"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_cache_buffer_is_64_byte_aligned(dtype):
    buffers = exported_buffers(dtype)
    assert len(buffers) == 24 + 10 + 12
    assert buffers[34][1].shape == (2, 2, 2, 4, 16)   # a ring of its window, 4 tokens
    assert buffers[24][1].shape == (2, 1, 1, 8, 32)   # the latent layer's one plane
    misaligned = [name for name, a in buffers if a.ctypes.data % ALIGNMENT]
    assert not misaligned


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_imports_every_buffer_through_dlpack_without_a_copy(dtype):
    for name, a in exported_buffers(dtype):
        view = np.from_dlpack(dlpack_view(a))
        assert np.shares_memory(view, a), name
        assert view.shape == a.shape and view.dtype.itemsize == a.dtype.itemsize, name
        if a.dtype in (resolve_dtype("bfloat16"), resolve_dtype("float8_e4m3fn")):
            assert view.dtype == {2: np.uint16, 1: np.uint8}[a.dtype.itemsize], name
        else:
            assert view.dtype == a.dtype, name
        assert a.flags.c_contiguous, name
        a.reshape(-1).view(np.uint8)[-1] = 0x5A   # a byte written through the cache ...
        assert view.reshape(-1).view(np.uint8)[-1] == 0x5A, name   # ... read through the import


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_imports_every_buffer_without_a_copy(dtype):
    jnp = pytest.importorskip("jax.numpy")
    for name, a in exported_buffers(dtype):
        imported = jnp.from_dlpack(dlpack_view(a))
        assert imported.unsafe_buffer_pointer() == a.ctypes.data, f"{name} was copied"
        a.view(np.uint8).reshape(-1)[0] = 0x3C
        assert int(np.asarray(imported).view(np.uint8).reshape(-1)[0]) == 0x3C, name
        if dtype == "bfloat16":   # the importer views the storage type back
            assert imported.view(jnp.bfloat16).dtype == jnp.bfloat16


def test_dlpack_view_keeps_dtypes_dlpack_carries():
    for name in DTYPE_NAMES:
        a = zeros(CPU, (3, 4), resolve_dtype(name))
        v = dlpack_view(a)
        assert np.shares_memory(v, a) and v.shape == a.shape
        if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            assert v.dtype == {2: np.uint16, 1: np.uint8}[a.dtype.itemsize]
        else:
            assert v is a


@given(st.lists(st.integers(0, 7), min_size=0, max_size=4), st.sampled_from(DTYPE_NAMES))
def test_zeros_is_aligned_zeroed_and_c_contiguous(shape, name):
    dtype = resolve_dtype(name)
    a = zeros(CPU, shape, dtype)
    assert a.shape == tuple(shape) and a.dtype == dtype and a.flags.c_contiguous
    assert a.flags.writeable and (a.size == 0 or a.ctypes.data % ALIGNMENT == 0)
    assert not a.reshape(-1).view(np.uint8).any()
    assert a.nbytes == int(np.prod(shape)) * dtype.itemsize
