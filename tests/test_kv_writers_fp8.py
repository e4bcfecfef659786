"""``write_kv`` of the K/V writers that keep no scale table (docs/design.md §3.7, §4.9):
``ContinuousBatchingKVCacheCollection.write_kv`` (and MAX's ``write``), ``PagedKVPool.write_kv``
(and its ``write`` alias) and ``DynamicInferenceContext.write_kv``.

Oracles: rows placed by hand at each row's committed length / block-table position, ml_dtypes
for the FP8 quantization (``clip(float32(x) / scale)`` cast, bit for bit), and the complete state
before a refused call. Every test runs on the cpu device (the NumPy reference) and on the real
kernels through the host emulation (``emu``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hcache.config.caches import KVLayerConfig
from hcache.contexts import DynamicInferenceContext, PagedKVPool
from hcache.continuous.manager import ContinuousBatchingKVCacheManager, KVCacheStaticParams

FP8S = ["float8_e4m3fn", "float8_e5m2"]
SRCS = ["float32", "float16", "bfloat16"]
H, D, LAYERS, S = 2, 8, 3, 8


def oracle(x, scale, fp8):
    fp8 = np.dtype(getattr(ml_dtypes, fp8))
    fmax = np.float32(float(ml_dtypes.finfo(fp8).max))
    with np.errstate(all="ignore"):
        q = np.clip(x.astype(np.float32) / np.asarray(scale, np.float32), -fmax, fmax)
        return q.astype(fp8)


def float_rows(shape, src, seed):
    """Float rows with magnitudes past both formats' max once divided by the scales below,
    a few exact zeros, NaN and +-Inf."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 40.0).astype(np.float32)
    flat = x.reshape(-1)
    flat[:4] = [0.0, np.nan, np.inf, -np.inf]
    flat[4] = 1e30
    with np.errstate(over="ignore"):   # 1e30 is +Inf in float16
        return x.astype(np.dtype(getattr(ml_dtypes, src, None) or src))


def scale_arg(kind, layers, heads, seed):
    """``(argument, host [layers, heads] table it means)`` for a float, per-layer or per-head
    scale."""
    rng = np.random.default_rng(seed)
    if kind == "float":
        return 0.0625, np.full((layers, heads), 0.0625, np.float32)
    if kind == "layer":
        t = rng.uniform(0.01, 0.2, layers).astype(np.float32)
        return t, np.repeat(t[:, None], heads, 1)
    t = rng.uniform(0.01, 0.2, (layers, heads + 1)).astype(np.float32)   # wider than needed
    return t, t[:, :heads]


def u8(a):
    return np.ascontiguousarray(a).view(np.uint8)


# --- ContinuousBatchingKVCacheCollection -------------------------------------------------------

def continuous(dtype, n=4):
    m = ContinuousBatchingKVCacheManager(dtype, KVCacheStaticParams(H, D), n, S, LAYERS,
                                         device="cpu")
    a, b, c = m.claim(3)
    m.step([2], m.fetch([a]))        # seq a holds 2 tokens
    return m, m.fetch([c, a, b])     # rows: c (0), a (2), b (0)


def cb_state(m):
    store = m._store
    return (m.cache_lengths, m.num_free_blocks, m.in_flight, u8(m.blocks_buf).tobytes(),
            u8(store.seq_offsets).tobytes(), u8(store.cache_lengths).tobytes(),
            u8(store.lookup_table).tobytes())


@pytest.mark.parametrize("fp8", FP8S)
@pytest.mark.parametrize("src", SRCS)
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("kind", ["float", "layer", "head"])
def test_continuous_write_kv_quantizes(backend, fp8, src, ragged, kind):
    m, coll = continuous(fp8)
    counts = [2, 1, 3] if ragged else [2, 2, 2]
    shape = (sum(counts), H, D) if ragged else (3, 2, H, D)
    k, v = float_rows(shape, src, 1), float_rows(shape, src, 2)
    ks, kt = scale_arg(kind, LAYERS, H, 3)
    vs, vt = scale_arg(kind, LAYERS, H, 4)
    expected = m.blocks_buf.copy()
    layer = 1
    kr, vr = (k, v) if ragged else (k.reshape(-1, H, D), v.reshape(-1, H, D))
    t0 = 0
    for i, (block, length) in enumerate(zip(coll.blocks, coll.host_cache_lengths)):
        for t in range(counts[i]):
            for kv, (rows, table) in enumerate(((kr, kt), (vr, vt))):
                expected[block, kv, layer, length + t] = oracle(rows[t0 + t], table[layer][:, None],
                                                                fp8)
        t0 += counts[i]
    before = len(backend.launches) if backend is not None else 0
    coll.write_kv(layer, k, v, seq_lengths=counts if ragged else None, k_scale=ks, v_scale=vs)
    assert np.array_equal(u8(m.blocks_buf), u8(expected))
    if backend is not None:
        assert len(backend.launches) == before + 1


def test_continuous_write_is_write_kv_with_unit_scales(backend):
    m, coll = continuous("float8_e5m2")
    k = float_rows((3, 1, H, D), "float16", 5)
    coll.write(2, k, -k)
    for i, (block, length) in enumerate(zip(coll.blocks, coll.host_cache_lengths)):
        assert np.array_equal(u8(m.blocks_buf[block, 0, 2, length]),
                              u8(oracle(k[i, 0], 1.0, "float8_e5m2")))
        assert np.array_equal(u8(m.blocks_buf[block, 1, 2, length]),
                              u8(oracle(-k[i, 0], 1.0, "float8_e5m2")))


def test_continuous_write_kv_copies_rows_of_the_cache_dtype(backend):
    m, coll = continuous("float16")
    k = np.arange(3 * H * D, dtype=np.float16).reshape(3, 1, H, D)
    coll.write_kv(0, k, k + 1)
    for i, (block, length) in enumerate(zip(coll.blocks, coll.host_cache_lengths)):
        assert np.array_equal(m.blocks_buf[block, 0, 0, length], k[i, 0])
        assert np.array_equal(m.blocks_buf[block, 1, 0, length], k[i, 0] + 1)


F32 = np.zeros((3, 1, H, D), np.float32)


@pytest.mark.parametrize("dtype, kwargs, exc, match", [
    ("float16", dict(k=F32.astype(np.float16), k_scale=1.0), ValueError, "k_scale: expected None"),
    ("float16", dict(k=F32.astype(np.float16), v_scale=np.ones(LAYERS, np.float32)), ValueError,
     "v_scale: expected None"),
    ("float16", dict(k=F32), ValueError, "k: expected dtype float16, got float32"),
    ("float8_e4m3fn", dict(k=F32.astype(np.float64)), ValueError, "k: expected dtype"),
    ("float8_e4m3fn", dict(k=F32, v=F32.astype(np.float16)), ValueError, "v: expected dtype"),
    ("float8_e4m3fn", dict(k=F32, k_scale=np.ones(LAYERS + 1, np.float32)), ValueError,
     r"k_scale: expected a C-contiguous float32 array \[3\]"),
    ("float8_e4m3fn", dict(k=F32, v_scale=np.ones((LAYERS, H - 1), np.float32)), ValueError,
     r"v_scale: expected .* \[3, >= 2\]"),
    ("float8_e4m3fn", dict(k=F32, k_scale=np.ones(LAYERS, np.float64)), ValueError, "k_scale"),
    ("float8_e4m3fn", dict(k=F32, k_scale=np.ones((LAYERS, 2 * H), np.float32)[:, ::2]),
     ValueError, "k_scale: expected a C-contiguous"),
    ("float8_e4m3fn", dict(k=F32, k_scale=-1.0), ValueError, "k_scale: expected a finite"),
    ("float8_e4m3fn", dict(k=F32, v_scale=float("nan")), ValueError, "v_scale: expected a finite"),
    ("float8_e4m3fn", dict(k=F32, k_scale=True), TypeError, "k_scale: expected a float"),
    ("float8_e4m3fn", dict(k=F32, k_scale=[1.0, 1.0, 1.0]), TypeError, "k_scale"),
    ("float8_e5m2", dict(k=F32, stream="bad"), TypeError, "stream"),
    ("float8_e5m2", dict(k=F32, seq_lengths=[1, 1, 1]), ValueError, "k: expected shape"),
])
def test_continuous_refused_write_changes_nothing(backend, dtype, kwargs, exc, match):
    m, coll = continuous(dtype)
    kwargs = dict(kwargs)
    k = kwargs.pop("k")
    v = kwargs.pop("v", k)
    before = cb_state(m)
    with pytest.raises(exc, match=match):
        coll.write_kv(1, k, v, **kwargs)
    assert cb_state(m) == before


# --- PagedKVPool ---------------------------------------------------------------------------

POOL_LAYERS = [KVLayerConfig(2, 4), KVLayerConfig(1, 8), KVLayerConfig(3, 4)]
TABLE = np.array([[1, 4, -1], [6, 2, 0], [-1, 7, 5]], np.int32)
BS = 4


def pool_expected(pool, layers, ks, vs, kt, vt, offsets, starts, fp8):
    out = [a.copy() for a in pool.layers]
    for a, k, v in zip(layers, ks, vs):
        for b in range(len(starts)):
            for j in range(offsets[b + 1] - offsets[b]):
                pos = starts[b] + j
                block = TABLE[b, pos // BS]
                if block == -1:
                    continue
                heads = pool.layer_configs[a].num_kv_heads
                for kv, (rows, t) in enumerate(((k, kt), (v, vt))):
                    out[a][block, kv, :, pos % BS] = oracle(rows[offsets[b] + j],
                                                            t[a][:heads, None], fp8)
    return out


@pytest.mark.parametrize("fp8", FP8S)
@pytest.mark.parametrize("src", ["float32", "bfloat16"])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("kind", ["float", "layer", "head"])
@pytest.mark.parametrize("one_layer", [False, True])
def test_pool_write_kv_quantizes(backend, fp8, src, ragged, kind, one_layer):
    pool = PagedKVPool(POOL_LAYERS, num_blocks=8, block_size=BS, dtype=fp8, device="cpu")
    counts = [5, 2, 3] if ragged else [3, 3, 3]
    starts = [0, 3, 6] if ragged else [0, 1, 4]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    ks = [float_rows((offsets[-1], lc.num_kv_heads, lc.head_dim), src, 10 + a)
          for a, lc in enumerate(POOL_LAYERS)]
    vs = [float_rows((offsets[-1], lc.num_kv_heads, lc.head_dim), src, 20 + a)
          for a, lc in enumerate(POOL_LAYERS)]
    k_arg, kt = scale_arg(kind, 3, 3, 5)
    v_arg, vt = scale_arg(kind, 3, 3, 6)
    rows = dict(block_table=TABLE, cache_lengths=np.array(starts, np.int32), batch=3)
    rows.update(seq_offsets=offsets) if ragged else rows.update(uniform_tokens=3)
    layers = [1] if one_layer else [0, 1, 2]
    expected = pool_expected(pool, layers, [ks[a] for a in layers], [vs[a] for a in layers],
                             kt, vt, offsets, starts, fp8)
    if one_layer:
        pool.write_kv(ks[1], vs[1], layer=1, k_scale=k_arg, v_scale=v_arg, **rows)
    else:
        pool.write(ks, vs, k_scale=k_arg, v_scale=v_arg, **rows)   # the alias
    for a in range(3):
        assert np.array_equal(u8(pool.layers[a]), u8(expected[a])), f"layer {a}"


def pool_state(pool):
    return [u8(a).tobytes() for a in pool.layers]


@pytest.mark.parametrize("dtype, kwargs, exc, match", [
    ("float16", dict(src="float16", k_scale=2.0), ValueError, "k_scale: expected None"),
    ("float16", dict(src="float32"), ValueError, r"k\[0\]: expected dtype float16, got float32"),
    ("float8_e5m2", dict(src="float32", k_scale=np.ones(2, np.float32)), ValueError,
     r"k_scale: expected .* \[3\] \(per layer\) or \[3, >= 3\]"),
    ("float8_e5m2", dict(src="float32", v_scale=np.ones((3, 2), np.float32)), ValueError,
     "v_scale: expected"),
    ("float8_e5m2", dict(src="float32", k_scale=0.0), ValueError, "k_scale: expected a finite"),
    ("float8_e5m2", dict(src="float32", stream=1.5), TypeError, "stream"),
    ("float8_e4m3fn", dict(src="float32", mixed=True), ValueError, r"v\[1\]: expected dtype"),
])
def test_pool_refused_write_changes_nothing(backend, dtype, kwargs, exc, match):
    pool = PagedKVPool(POOL_LAYERS, num_blocks=8, block_size=BS, dtype=dtype, device="cpu")
    kwargs = dict(kwargs)
    src = kwargs.pop("src")
    ks = [float_rows((3, lc.num_kv_heads, lc.head_dim), src, a)
          for a, lc in enumerate(POOL_LAYERS)]
    vs = list(ks)
    if kwargs.pop("mixed", False):
        vs[1] = float_rows(vs[1].shape, "float16", 9)
    before = pool_state(pool)
    with pytest.raises(exc, match=match):
        pool.write_kv(ks, vs, block_table=TABLE, uniform_tokens=1, batch=3,
                      cache_lengths=np.zeros(3, np.int32), **kwargs)
    assert pool_state(pool) == before


# --- DynamicInferenceContext -----------------------------------------------------------------

def context(dtype):
    ctx = DynamicInferenceContext(
        kv_layer_configs=POOL_LAYERS, num_blocks=16, block_size_tokens=BS, max_requests=4,
        max_blocks_per_request=4, num_mamba_layers=0, conv_states_shape=(2,),
        ssm_states_shape=(3,), mamba_cache_slots=0, kv_dtype=dtype, device="cpu")
    ctx.add_request("a", list(range(6)))
    ctx.add_request("b", list(range(100, 103)))
    return ctx


def ctx_state(ctx):
    kw = ctx._kv_writer
    return pool_state(ctx.kv_pool) + [u8(kw._table_dev).tobytes(), u8(kw._offsets_dev).tobytes(),
                                       u8(kw._positions_dev).tobytes(),
                                       ctx.request_to_kv_block_ids.tolist()]


@pytest.mark.parametrize("fp8", FP8S)
@pytest.mark.parametrize("kind", ["float", "layer", "head"])
@pytest.mark.parametrize("one_layer", [False, True])
def test_context_write_kv_quantizes(backend, fp8, kind, one_layer):
    ctx = context(fp8)
    pool = ctx.kv_pool
    counts = {"a": 6, "b": 3}
    ks = [float_rows((9, lc.num_kv_heads, lc.head_dim), "float16", 30 + a)
          for a, lc in enumerate(POOL_LAYERS)]
    vs = [float_rows((9, lc.num_kv_heads, lc.head_dim), "float16", 40 + a)
          for a, lc in enumerate(POOL_LAYERS)]
    k_arg, kt = scale_arg(kind, 3, 3, 7)
    v_arg, vt = scale_arg(kind, 3, 3, 8)
    expected = [a.copy() for a in pool.layers]
    layers = [2] if one_layer else [0, 1, 2]
    t0 = 0
    for rid in ("b", "a"):
        blocks = ctx.block_ids(rid)
        for pos in range(counts[rid]):
            for a in layers:
                heads = POOL_LAYERS[a].num_kv_heads
                for kv, (rows, t) in enumerate(((ks[a], kt), (vs[a], vt))):
                    expected[a][blocks[pos // BS], kv, :, pos % BS] = oracle(
                        rows[t0 + pos], t[a][:heads, None], fp8)
        t0 += counts[rid]
    if one_layer:
        ctx.write_kv(["b", "a"], ks[2], vs[2], layer=2, k_scale=k_arg, v_scale=v_arg)
    else:
        ctx.write_kv(["b", "a"], ks, vs, k_scale=k_arg, v_scale=v_arg)
    for a in range(3):
        assert np.array_equal(u8(pool.layers[a]), u8(expected[a])), f"layer {a}"


@pytest.mark.parametrize("dtype, kwargs, exc, match", [
    ("float16", dict(k_scale=1.0), ValueError, "k_scale: expected None"),
    ("float8_e4m3fn", dict(v_scale=np.ones((4, 3), np.float32)), ValueError, "v_scale"),
    ("float8_e4m3fn", dict(k_scale=np.ones(3, np.float32), stream="bad"), TypeError, "stream"),
    ("float8_e4m3fn", dict(k_scale=np.float32(-2)), ValueError, "k_scale: expected a finite"),
])
def test_context_refused_write_changes_nothing(backend, dtype, kwargs, exc, match):
    ctx = context(dtype)
    src = "float16"
    ks = [float_rows((9, lc.num_kv_heads, lc.head_dim), src, a)
          for a, lc in enumerate(POOL_LAYERS)]
    before = ctx_state(ctx)
    with pytest.raises(exc, match=match):
        ctx.write_kv(["a", "b"], ks, ks, **kwargs)
    assert ctx_state(ctx) == before
