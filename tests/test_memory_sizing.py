"""Memory before allocation (docs/design.md §2, "Memory").

Every config knows the bytes its manager allocates (``nbytes``), equal to the manager's
``memory_report()`` total after construction (oracle: the report, which sums the ``nbytes`` of
the arrays the manager made), latent (MLA) layers counted as one plane and a Mamba state the
layers do not have (LFM2's short convolutions, MiniMax's lightning attention) as 0 bytes; the
sizing helpers give the largest batch or block count for a
byte budget (oracle: ``nbytes`` on both sides of the answer); a layout that does not fit is a
``CacheCapacityError`` before anything is allocated (oracle: ``tracemalloc``, which sees every
NumPy allocation).
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hcache import (
    CacheCapacityError,
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
from hcache.device import resolve_device
from hcache.dtypes import resolve_dtype
from hcache.memory import available_bytes, check_fits

CPU = resolve_device("cpu")
A, M, N = LayerType.ATTENTION, LayerType.MAMBA, LayerType.NONE
DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "int8"]
small = st.integers(1, 4)
head_dims = st.sampled_from([4, 8, 12])
# a window shorter than the sequence makes a ring layer (with ring_windows); longer, unbounded
windows = st.none() | st.integers(1, 6)
# K/V layers and latent (MLA) layers: one head, one plane; either may slide (a latent ring)
layers = st.lists(st.one_of(st.builds(KVLayerConfig, small, head_dims, windows),
                            st.builds(KVLayerConfig, st.just(1), head_dims, windows,
                                      components=st.just(1))), max_size=3)


def kv_configs():
    return st.builds(KVCacheConfig, small, st.integers(1, 6), layers, st.sampled_from(DTYPES),
                     st.booleans())


@st.composite
def state_fields(draw):
    """``(num_heads, head_dim, state_size, conv_dim, conv_kernel)`` of both states, of the
    recurrent state only (lightning attention) or of the conv state only (short convolutions)."""
    recurrent, conv = [draw(small) for _ in range(3)], [draw(small) for _ in range(2)]
    kind = draw(st.sampled_from(["both", "recurrent", "conv"]))
    return tuple((recurrent if kind != "conv" else [0] * 3)
                 + (conv if kind != "recurrent" else [0] * 2))


@st.composite
def mamba_configs(draw, num_layers=None, batch=small):
    n = draw(st.integers(0, 3) if num_layers is None else num_layers)
    return MambaCacheConfig(n, draw(batch), *draw(state_fields()),
                            draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DTYPES)))


@st.composite
def hybrid_configs(draw):
    kv = draw(kv_configs())
    mamba_layers = draw(st.integers(0, 2))
    types = [A] * kv.num_attention_layers + [M] * mamba_layers + [N] * draw(st.integers(0, 1))
    if not types:
        types = [N]
    types = draw(st.permutations(types))
    mamba = draw(mamba_configs(st.just(mamba_layers), st.just(kv.max_batch_size))) \
        if mamba_layers else None
    return HybridCacheConfig(types, kv, mamba, kv.max_batch_size)


@st.composite
def linear_configs(draw):
    m = draw(st.integers(0, 2))
    mamba = list(draw(state_fields())) if m else [0] * 5
    return LinearCacheConfig(draw(st.integers(0, 2)), draw(small), draw(small), draw(small),
                             draw(st.sampled_from([4, 8])), draw(st.sampled_from(DTYPES)), m,
                             *mamba[:3], draw(st.sampled_from(DTYPES)), *mamba[3:],
                             draw(st.sampled_from(DTYPES)))


MANAGERS = [(kv_configs(), KVCacheManager), (mamba_configs(), MambaCacheManager),
            (hybrid_configs(), HybridCacheManager), (linear_configs(), LinearKVCache)]


@pytest.mark.parametrize("configs, manager", MANAGERS, ids=lambda x: getattr(x, "__name__", ""))
@settings(max_examples=25)
@given(data=st.data())
def test_config_nbytes_is_what_the_manager_allocates(configs, manager, data):
    """Ring layouts included (KV and hybrid configs draw ``ring_windows`` and windows on K/V
    and latent layers): a ring layer counts its window (``layer_cache_lengths``)."""
    config = data.draw(configs)
    assert config.nbytes == manager(config, device="cpu").memory_report()["total"]


def test_ring_layers_count_their_window_in_nbytes():
    """By hand: a ring K/V layer and a latent ring hold ``W`` tokens per slot, an unbounded
    layer ``max_sequence_length``; the rest of ``nbytes`` (metadata) does not depend on it."""
    b, s = 2, 64
    lcs = [KVLayerConfig(2, 8, 16), KVLayerConfig(1, 24, 4, components=1), KVLayerConfig(2, 8)]
    ring = KVCacheConfig(b, s, lcs, "float16", ring_windows=True)
    flat = KVCacheConfig(b, s, lcs, "float16")
    assert ring.layer_cache_lengths == (16, 4, 64)
    caches = b * 2 * (2 * 2 * 8 * 16 + 1 * 24 * 4 + 2 * 2 * 8 * 64)
    flat_caches = b * 2 * 64 * (2 * 2 * 8 + 1 * 24 + 2 * 2 * 8)
    assert ring.nbytes - caches == flat.nbytes - flat_caches > 0
    assert ring.nbytes == KVCacheManager(ring, device="cpu").memory_report()["total"]


@settings(max_examples=25)
@given(heads=small, size=small, dtype=st.sampled_from(DTYPES), batch=small,
       seq=st.integers(1, 6), num_layers=small, is_mla=st.booleans(), window=windows)
def test_continuous_batching_bytes_are_known_from_its_arguments(heads, size, dtype, batch, seq,
                                                               num_layers, is_mla, window):
    """With a ``sliding_window`` shorter than ``max_seq_len`` the blocks are rings of it."""
    params = KVCacheStaticParams(1 if is_mla else heads, size, is_mla)
    m = ContinuousBatchingKVCacheManager(dtype, params, batch, seq, num_layers, device="cpu",
                                         sliding_window=window)
    report = m.memory_report()
    assert params.nbytes(dtype, batch, seq, num_layers, sliding_window=window) \
        == report["total_bytes"]
    ring = window is not None and window < seq
    assert report["ring_window"] == (window if ring else 0)
    assert report["blocks_buf_bytes"] == batch * params.components * num_layers \
        * (window if ring else seq) * params.num_heads * size * resolve_dtype(dtype).itemsize


@settings(max_examples=25)
@given(layer_configs=layers, blocks=small, block_size=small, dtype=st.sampled_from(DTYPES),
       local=st.none() | st.integers(1, 6))
def test_paged_pool_bytes_are_known_from_its_arguments(layer_configs, blocks, block_size, dtype,
                                                       local):
    """With ``num_local_blocks`` the sliding-window layers live in the local block space (its
    blocks, its copy table, copy ids of the larger space)."""
    pool = PagedKVPool(layer_configs, blocks, block_size, dtype, device="cpu",
                       num_local_blocks=local)
    assert PagedKVPool.nbytes_for(layer_configs, blocks, block_size, dtype,
                                  num_local_blocks=local) == pool.memory_report()["total_bytes"]
    for lc, layer in zip(layer_configs, pool.layers):
        sliding = local is not None and lc.sliding_window is not None
        assert layer.shape[0] == (local if sliding else blocks)


def test_kv_nbytes_by_hand_counts_one_plane_for_a_latent_layer():
    """A latent (MLA) layer caches one plane, ``max_batch * max_seq * head_dim * itemsize``;
    a K/V layer two. Metadata: the layer tables (52 B per layer: a 24-byte KVLayerInfo row, a
    24-byte pointer scratch row, an int32 label) and write_kv's staging
    (row offsets [b + 1], positions [b], status word, int32)."""
    b, s = 3, 16
    latent = KVCacheConfig(b, s, [KVLayerConfig(1, 576, components=1)], "bfloat16")
    assert latent.nbytes == b * s * 576 * 2 + 52 + (b + 1 + b + 1) * 4
    both = KVCacheConfig(b, s, [KVLayerConfig(1, 576)], "bfloat16")
    assert both.nbytes - latent.nbytes == b * s * 576 * 2


@pytest.mark.parametrize("fields, states", [
    ((0, 0, 0, 16, 4), 16 * 4 * 2),          # short convolutions: a float16 conv state only
    ((2, 4, 4, 0, 0), 2 * 4 * 4 * 4),        # lightning attention: a float32 state only
    ((2, 4, 4, 16, 4), 2 * 4 * 4 * 4 + 16 * 4 * 2),
], ids=["conv-only", "recurrent-only", "both"])
def test_mamba_nbytes_by_hand_counts_an_absent_state_as_zero(fields, states):
    """``layers * slots * (bytes of the states that exist)``, the two slot indices (int32) and
    one descriptor row (32 B) per state tensor in each of the capture and restore tables;
    ``write_states``' three int32 ``[slots]`` indices and its one-layer tables (a row per
    kind, and two more for both kinds together)."""
    n, b = 3, 2
    config = MambaCacheConfig(n, b, *fields, ssm_dtype="float32", conv_dtype="float16")
    kinds = 1 + (0 not in fields)
    one_layer_rows = {1: 1, 2: 4}[kinds]
    assert config.nbytes == n * b * states + 2 * 4 + 2 * kinds * n * 32 \
        + 3 * b * 4 + one_layer_rows * 32
    report = MambaCacheManager(config, device="cpu").memory_report()
    assert report["total"] == config.nbytes
    assert (report["recurrent"] == 0) == (fields[0] == 0)
    assert (report["conv"] == 0) == (fields[3] == 0)


def _published_layouts():
    from test_hf_config_mla import DEEPSEEK_V2_LITE, DEEPSEEK_V3
    from test_hf_families import KIMI_LINEAR_48B, LFM2_1_2B, MINIMAX_M1, MINIMAX_TYPES

    minimax = {**MINIMAX_M1, "num_hidden_layers": 8, "attn_type_list": MINIMAX_TYPES[:8]}
    return {"deepseek-v3": DEEPSEEK_V3, "deepseek-v2-lite": DEEPSEEK_V2_LITE,
            "kimi-linear": KIMI_LINEAR_48B, "lfm2": LFM2_1_2B, "minimax": minimax}


@pytest.mark.parametrize("name", sorted(_published_layouts()))
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_published_latent_and_single_state_layouts_size_as_their_managers(name, kv_dtype):
    """MLA models (every layer one latent plane), Kimi Linear (KDA + MLA), LFM2 (conv-only
    layers) and MiniMax (lightning layers): the config, the manager and the paged pool of the
    same attention layers agree, and the batch size for a budget is the largest that fits."""
    config = HybridCacheConfig.from_hf_config(_published_layouts()[name], max_batch_size=1,
                                              max_sequence_length=8, kv_dtype=kv_dtype)
    report = HybridCacheManager(config, device="cpu").memory_report()
    assert config.nbytes == report["total"]
    layers = config.kv.layer_configs
    item = 2 if kv_dtype == "bfloat16" else 1
    assert report["kv_cache"] == sum(lc.components * lc.num_kv_heads * 8 * lc.head_dim * item
                                     for lc in layers)   # one slot of 8 tokens per layer
    mamba = config.mamba
    assert report["recurrent"] + report["conv"] == (0 if mamba is None else mamba.num_layers * (
        int(np.prod(mamba.recurrent_state_shape)) * np.dtype(mamba.ssm_dtype).itemsize
        + int(np.prod(mamba.conv_state_shape)) * resolve_dtype(mamba.conv_dtype).itemsize))
    pool = PagedKVPool(layers, 3, 4, kv_dtype, device="cpu")
    assert PagedKVPool.nbytes_for(layers, 3, 4, kv_dtype) == pool.memory_report()["total_bytes"]
    b = config.max_batch_size_for(3 * config.nbytes)
    assert config._with_batch(b).nbytes <= 3 * config.nbytes < config._with_batch(b + 1).nbytes


# --- sizing helpers ---------------------------------------------------------------------------

def _configs_by_batch():
    kv = KVCacheConfig(1, 64, [KVLayerConfig(2, 16), KVLayerConfig(4, 8)], "float16")
    mamba = MambaCacheConfig(2, 1, 2, 4, 8, 16, 4)
    return [kv, mamba, HybridCacheConfig([A, M, A, M], kv, mamba, 1),
            LinearCacheConfig(2, 1, 64, 2, 16, num_mamba_layers=1, mamba_num_heads=2,
                              mamba_head_dim=4, ssm_state_size=8, conv_dim=16, conv_kernel=4)]


@pytest.mark.parametrize("config", _configs_by_batch(), ids=type)
@given(budget=st.integers(0, 10**6))
@settings(max_examples=30)
def test_max_batch_size_for_is_the_largest_that_fits(config, budget):
    b = config.max_batch_size_for(budget)
    if b == 0:
        assert _with_batch(config, 1).nbytes > budget
    else:
        assert _with_batch(config, b).nbytes <= budget < _with_batch(config, b + 1).nbytes


def _with_batch(config, b):
    from dataclasses import replace
    if isinstance(config, HybridCacheConfig):
        return HybridCacheConfig(config.layer_types, replace(config.kv, max_batch_size=b),
                                 replace(config.mamba, max_batch_size=b), b)
    return replace(config, max_batch_size=b)


@given(budget=st.integers(0, 10**6), block_size=st.integers(1, 32),
       local=st.none() | st.integers(1, 64))
@settings(max_examples=30)
def test_num_blocks_for_is_the_largest_pool_that_fits(budget, block_size, local):
    """A local block space (a sliding-window layer) stays at ``num_local_blocks``."""
    cfgs = [KVLayerConfig(2, 16), KVLayerConfig(1, 8), KVLayerConfig(1, 8, 16)]

    def size(n):
        return PagedKVPool.nbytes_for(cfgs, n, block_size, "bfloat16", num_local_blocks=local)

    n = PagedKVPool.num_blocks_for(cfgs, block_size, budget, "bfloat16", num_local_blocks=local)
    if n == 0:
        assert size(1) > budget
    else:
        assert size(n) <= budget < size(n + 1)


@given(budget=st.integers(0, 10**6), window=st.none() | st.integers(1, 40))
@settings(max_examples=30)
def test_continuous_max_batch_size_for_is_the_largest_that_fits(budget, window):
    params = KVCacheStaticParams(2, 8)
    n = params.max_batch_size_for(budget, "float16", 32, 2, sliding_window=window)
    assert n == 0 or params.nbytes("float16", n, 32, 2, sliding_window=window) <= budget
    assert params.nbytes("float16", n + 1, 32, 2, sliding_window=window) > budget


@pytest.mark.parametrize("call", [
    lambda b: _configs_by_batch()[0].max_batch_size_for(b),
    lambda b: PagedKVPool.num_blocks_for([KVLayerConfig(1, 8)], 4, b),
    lambda b: KVCacheStaticParams(1, 8).max_batch_size_for(b, "float16", 8, 1),
])
def test_a_budget_is_a_whole_number_of_bytes(call):
    with pytest.raises(TypeError, match="budget: expected an int"):
        call(1.5e6)
    with pytest.raises(ValueError, match="budget: expected an int >= 0"):
        call(-1)


# --- refused before allocation ----------------------------------------------------------------

def test_available_bytes_on_the_cpu_is_a_positive_count():
    avail = available_bytes(CPU)
    assert avail is None or avail > 0
    check_fits("x", 0, CPU)
    if avail is not None:
        with pytest.raises(CacheCapacityError, match=r"x: expected a layout of at most"):
            check_fits("x", avail + 2**40, CPU)


def _too_big_for_memory():
    """Layouts each of whose layers alone fits in the memory available now, but not all of
    them: before the check, NumPy allocated (lazily zeroed) layer after layer."""
    avail = available_bytes(CPU)
    if avail is None:
        pytest.skip("the available memory of this host is unknown")
    per_layer = avail // 3 + 1                      # four of them exceed ``avail``
    seq = per_layer // (2 * 64 * 2) + 1              # [1, 2, 1, seq, 64] float16
    kv = KVCacheConfig(1, seq, [KVLayerConfig(1, 64)] * 4)
    heads = per_layer // (64 * 64 * 4) + 1           # recurrent [1, heads, 64, 64] float32
    mamba = MambaCacheConfig(4, 1, heads, 64, 64, 1, 1)
    return [
        ("config", lambda: KVCacheManager(kv, device="cpu"), kv.nbytes),
        ("config", lambda: MambaCacheManager(mamba, device="cpu"), mamba.nbytes),
        ("config", lambda: HybridCacheManager(
            HybridCacheConfig([A] * 4, kv, None, 1), device="cpu"), None),
        ("config", lambda: LinearKVCache(LinearCacheConfig(4, 1, seq, 1, 64), device="cpu"),
         None),
        ("max_batch_size", lambda: ContinuousBatchingKVCacheManager(
            "float16", KVCacheStaticParams(1, 64), 1, seq, 4, device="cpu"), None),
        ("num_blocks", lambda: PagedKVPool([KVLayerConfig(1, 64)] * 4, 1, seq, device="cpu"),
         None),
        # a small pool, but live Mamba states of four layers that do not fit together
        ("num_blocks", lambda: DynamicInferenceContext(
            kv_layer_configs=[KVLayerConfig(1, 8)], num_blocks=4, block_size_tokens=4,
            max_requests=1, max_blocks_per_request=2, num_mamba_layers=4,
            conv_states_shape=(1,), ssm_states_shape=(heads, 64, 64), device="cpu"), None),
    ]


def test_a_layout_that_does_not_fit_is_refused_before_any_allocation():
    for name, build, nbytes in _too_big_for_memory():
        tracemalloc.start()
        try:
            with pytest.raises(CacheCapacityError, match=f"{name}: expected a layout") as err:
                build()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2**20, f"{name}: {peak} bytes allocated before the refusal"
        assert err.value.required > err.value.available > 0
        assert nbytes is None or err.value.required == nbytes


@pytest.mark.parametrize("build", [
    lambda: KVCacheManager(KVCacheConfig(2**20, 2**20, [KVLayerConfig(64, 256)] * 8),
                           device="cpu"),
    lambda: MambaCacheManager(MambaCacheConfig(64, 2**20, 128, 64, 128, 8192, 4), device="cpu"),
    lambda: ContinuousBatchingKVCacheManager("float32", KVCacheStaticParams(64, 256), 2**20,
                                             2**20, 64, device="cpu"),
    lambda: PagedKVPool([KVLayerConfig(64, 256)] * 8, 2**30, 256, device="cpu"),
])
def test_an_absurd_size_is_a_capacity_error_not_a_memory_error(build):
    if available_bytes(CPU) is None:
        pytest.skip("the available memory of this host is unknown")
    with pytest.raises(CacheCapacityError):
        build()


@pytest.mark.parametrize("local", [None, 3], ids=["one-space", "local-space"])
@pytest.mark.parametrize("slots", [0, 5])
@pytest.mark.parametrize("conv, ssm", [((16, 4), (2, 4, 8)), ((16, 4), None), (None, (2, 4, 8))],
                         ids=["both", "conv-only", "ssm-only"])
def test_context_states_bytes_are_the_context_buffers_besides_the_pool(slots, conv, ssm, local):
    """What a context checks with its pool: the live, cached and snapshot Mamba states (none
    for a state of shape None) and the staging of a step's KV writes, the local block table
    too with ``num_local_blocks`` (oracle: the arrays themselves), with a latent layer and a
    sliding-window layer in the pool."""
    from hcache.config.sizing import context_states_nbytes

    ctx = DynamicInferenceContext(
        kv_layer_configs=[KVLayerConfig(2, 16), KVLayerConfig(1, 24, components=1),
                          KVLayerConfig(2, 16, 8)],
        num_blocks=8, block_size_tokens=4, max_requests=3, max_blocks_per_request=4,
        num_mamba_layers=2, conv_states_shape=conv, ssm_states_shape=ssm,
        mamba_cache_slots=slots, device="cpu", num_local_blocks=local)
    arrays = [ctx.mamba_conv_states, ctx.mamba_ssm_states, ctx._kv_writer._table_dev,
              ctx._kv_writer._offsets_dev, ctx._kv_writer._positions_dev,
              ctx._kv_writer._local_dev]
    assert (ctx._kv_writer._local_dev is None) == (local is None)
    alloc = ctx.mamba_slot_allocator
    if slots:
        arrays += [alloc.conv_states, alloc.ssm_states, alloc.intermediate_conv_out,
                   alloc.intermediate_ssm_out]
    assert (ctx.mamba_conv_states is None) == (conv is None)
    assert (ctx.mamba_ssm_states is None) == (ssm is None)
    assert context_states_nbytes(ctx, slots, conv, ssm, np.float16, np.float32,
                                 local_tables=local is not None) \
        == sum(a.nbytes for a in arrays if a is not None)
    pool = ctx.kv_pool
    assert pool.memory_report()["total_bytes"] == PagedKVPool.nbytes_for(
        pool.layer_configs, pool.num_blocks, pool.block_size, pool.dtype,
        num_local_blocks=local)
