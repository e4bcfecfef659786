"""``write_kv`` of the contiguous-slot managers (docs/design.md §4.9): ``HybridCacheManager``
(decoder layers), ``LinearKVCache`` and ``KVCacheManager`` (attention indices).

Oracles: rows placed by hand (``cache[slot, kv, :, position] = row``) at each slot's committed
length or at explicit positions, ml_dtypes for the FP8 quantization (``clip(x / scale)``
cast), and the byte-for-byte state before a refused call. Every test runs on the cpu device
(the NumPy reference) and on the real kernels through the host emulation (``emu``), where the
launches are counted: one per head-dim group.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hcache.config.caches import (
    HybridCacheConfig,
    KVCacheConfig,
    KVLayerConfig,
    LayerType,
    LinearCacheConfig,
    MambaCacheConfig,
)
from hcache.dtypes import fp8_max, fp8_scales
from hcache.slots.hybrid import HybridCacheManager
from hcache.slots.kv import KVCacheManager
from hcache.slots.linear import LinearKVCache

A, M, N = LayerType.ATTENTION, LayerType.MAMBA, LayerType.NONE
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
BF16 = np.dtype(ml_dtypes.bfloat16)
S = 8


def hybrid(dtype="float16", batch=3):
    """Decoder layers M, A(2x8), N, A(1x36), A shared with 1, A(3x8), M: attention indices
    0, 1, 2 at decoder layers 1, 3, 5; groups by head dim {8: [0, 2], 36: [1]}."""
    kv = KVCacheConfig(batch, S, [KVLayerConfig(2, 8), KVLayerConfig(1, 36),
                                  KVLayerConfig(3, 8)], dtype)
    mamba = MambaCacheConfig(2, batch, 1, 2, 2, 2, 2)
    return HybridCacheManager(HybridCacheConfig([M, A, N, A, A, A, M], kv, mamba, batch,
                                                kv_sharing={4: 1}), device="cpu")


OWNERS = (1, 3, 5)   # decoder layers of attention indices 0, 1, 2


def linear(dtype="float16", batch=3):
    return LinearKVCache(LinearCacheConfig(2, batch, S, 2, 16, dtype=dtype), device="cpu")


def rows(shape, dtype, seed):
    """Random values of a float dtype, or random bytes of any other."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt in (np.float32, np.float16, BF16):
        return (rng.standard_normal(shape) * 3).astype(dt)
    return rng.integers(0, 256, size=shape + (dt.itemsize,), dtype=np.uint8).view(dt) \
        .reshape(shape)


def expected(before, placements, k, v):
    """``before`` with row ``t`` of ``k`` / ``v`` at ``(slot, position)`` for each placement."""
    out = before.copy()
    for t, (slot, pos) in enumerate(placements):
        if slot is not None:
            out[slot, 0, :, pos], out[slot, 1, :, pos] = k[t], v[t]
    return out


# --- where the rows land --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e5m2", "int8"])
def test_uniform_write_lands_at_committed_lengths(backend, dtype):
    """Uniform ``[batch, 2, H, D]`` rows of the cache dtype, one decoder layer: slot b gets
    them at lengths[b], lengths[b] + 1; nothing else changes, lengths neither."""
    m = hybrid(dtype)
    m.reset_for_new_sequences([0, 5, 2])
    cache = m.get_combined_kv_cache(5)
    before = cache.copy()
    k, v = rows((3, 2, 3, 8), dtype, 1), rows((3, 2, 3, 8), dtype, 2)
    m.write_kv(5, k, v)
    place = [(b, L + t) for b, L in enumerate([0, 5, 2]) for t in range(2)]
    want = expected(before, place, k.reshape(6, 3, 8), v.reshape(6, 3, 8))
    np.testing.assert_array_equal(cache.view(np.uint8), want.view(np.uint8))
    assert m.get_kv_cache_lengths().tolist() == [0, 5, 2]
    if backend is not None:
        assert [name for name, _, _ in backend.launches] == ["hc_kv_write"]


def test_ragged_write_of_every_layer_one_launch_per_group(backend):
    """``layer=None`` with one ragged array per cache-owning attention layer (2, 0 and 3
    tokens): every layer gets its rows at each slot's length, with one launch per head-dim
    group (2 groups); the shared layer's cache is its owner's."""
    m = hybrid()
    m.reset_for_new_sequences([1, 4, 0])
    counts = [2, 0, 3]
    caches = [m.get_combined_kv_cache(i) for i in OWNERS]
    before = [c.copy() for c in caches]
    ks = [rows((5, c.shape[2], c.shape[4]), "float16", 10 + a) for a, c in enumerate(caches)]
    vs = [rows((5, c.shape[2], c.shape[4]), "float16", 20 + a) for a, c in enumerate(caches)]
    m.write_kv(None, ks, vs, seq_lengths=counts)
    place = [(0, 1), (0, 2), (2, 0), (2, 1), (2, 2)]
    for c, b, k, v in zip(caches, before, ks, vs):
        np.testing.assert_array_equal(c, expected(b, place, k, v))
    if backend is not None:
        assert [name for name, _, _ in backend.launches] == ["hc_kv_write"] * 2


@pytest.mark.parametrize("make", [hybrid, linear], ids=["hybrid", "linear"])
def test_explicit_positions_and_padding(backend, make):
    """Host positions (with -1 padding) instead of the lengths: rows land exactly there."""
    m = make()
    m.reset_for_new_sequences([3, 3])
    layer = 3 if isinstance(m, HybridCacheManager) else 1
    cache = m.get_combined_kv_cache(layer) if isinstance(m, HybridCacheManager) else \
        m.get_combined_kv_cache_for_decoder_layer(layer)
    before = cache.copy()
    shape = (3, cache.shape[2], cache.shape[4])
    k, v = rows(shape, "float16", 3), rows(shape, "float16", 4)
    m.write_kv(layer, k, v, seq_lengths=[2, 1], positions=[7, -1, 0])
    want = expected(before, [(0, 7), (None, None), (1, 0)], k, v)
    np.testing.assert_array_equal(cache, want)


def test_kv_cache_manager_writes_at_explicit_positions(backend):
    """KVCacheManager keeps no lengths: positions are required; rows b -> slots b."""
    m = KVCacheManager(KVCacheConfig(4, S, [KVLayerConfig(2, 8), KVLayerConfig(1, 8)]),
                       device="cpu")
    k, v = rows((2, 1, 1, 8), "float16", 5), rows((2, 1, 1, 8), "float16", 6)
    with pytest.raises(ValueError, match="positions: expected explicit positions"):
        m.write_kv(1, k, v)
    m.write_kv(1, k, v, positions=np.array([[4], [0]]))
    cache = m.get_combined_kv_cache(1)
    np.testing.assert_array_equal(cache[0, :, :, 4], np.stack([k[0, 0], v[0, 0]]))
    np.testing.assert_array_equal(cache[1, :, :, 0], np.stack([k[1, 0], v[1, 0]]))
    assert np.count_nonzero(cache.view(np.uint16)) == np.count_nonzero(
        np.stack([k, v]).view(np.uint16))


# --- FP8: quantize on write ---------------------------------------------------------------------

def oracle(x, scale, fp8):
    fmax = np.float32(float(ml_dtypes.finfo(fp8).max))
    with np.errstate(all="ignore"):
        q = np.clip(x.astype(np.float32) / np.asarray(scale, np.float32), -fmax, fmax)
        return q.astype(fp8)


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("src", ["float32", "float16", "bfloat16"])
def test_fp8_write_quantizes_with_per_head_scales(backend, fp8, src):
    """Float rows into an FP8 cache with per-head scale tables ``[L, H]`` for every layer:
    the bytes are ml_dtypes' cast of clip(x / scale[layer, head]); the tables are recorded
    (get_kv_scales) and dequantize the cache within the format's precision."""
    m = hybrid(fp8)
    m.reset_for_new_sequences([2, 0, 6])
    dt = np.dtype(fp8)
    caches = [m.get_combined_kv_cache(i) for i in OWNERS]
    ks = [rows((3, 1, c.shape[2], c.shape[4]), src, 30 + a) for a, c in enumerate(caches)]
    vs = [rows((3, 1, c.shape[2], c.shape[4]), src, 40 + a) for a, c in enumerate(caches)]
    k_scale = np.array([[0.5, 2.0, 1.0], [0.25, 9.0, 9.0], [1.5, 3.0, 0.125]], np.float32)
    v_scale = np.full(3, 0.75, np.float32)   # per layer
    m.write_kv(None, ks, vs, k_scale=k_scale, v_scale=v_scale)
    if backend is not None:
        assert [name for name, _, _ in backend.launches] == ["hc_kv_write_fp8"] * 2
    for a, (c, k, v) in enumerate(zip(caches, ks, vs)):
        h = c.shape[2]
        for b, pos in enumerate([2, 0, 6]):
            want_k = oracle(k[b, 0], k_scale[a, :h, None], dt)
            want_v = oracle(v[b, 0], v_scale[a], dt)
            np.testing.assert_array_equal(c[b, 0, :, pos].view(np.uint8), want_k.view(np.uint8))
            np.testing.assert_array_equal(c[b, 1, :, pos].view(np.uint8), want_v.view(np.uint8))
    got_k, got_v = m.get_kv_scales()
    np.testing.assert_array_equal(got_k, k_scale)
    np.testing.assert_array_equal(got_v, np.full((3, 3), 0.75, np.float32))
    # dequantized: within half a unit in the last place of the format (relative)
    c, k = caches[0], ks[0]
    back = c[0, 0, :, 2].astype(np.float32) * got_k[0, :2, None]
    exact = k[0, 0].astype(np.float32)
    rel = 2.0 ** -(4 if dt == E4M3 else 3)
    tiny = 2.0 ** (-7 - 3 if dt == E4M3 else -15 - 2) * got_k[0, :2, None]
    assert (np.abs(back - exact) <= np.maximum(np.abs(exact) * rel, tiny) * 1.001).all()


def test_fp8_scales_default_to_the_recorded_ones(backend):
    """No scale: the recorded tables (1.0 at construction, then set_kv_scales, then the
    last float given); a float or a table given to a one-layer write is recorded for that
    layer only."""
    m = linear("float8_e4m3fn")
    m.reset_for_new_sequences([0, 0, 0])
    x = np.full((3, 1, 2, 16), 6.0, np.float32)
    m.write_kv(0, x, x)                                   # scale 1: 6 -> 0x4c
    m.set_kv_scales(2.0, None)
    m.write_kv(1, x, x)                                   # k: 6 / 2 = 3 -> 0x44; v: 6
    m.write_kv(0, x * 0, x * 0, k_scale=4.0, positions=np.ones((3, 1), int))  # at 1
    k_scales, v_scales = m.get_kv_scales()
    assert k_scales.tolist() == [[4.0, 4.0], [2.0, 2.0]] and v_scales.tolist() == [[1, 1]] * 2
    c0 = m.get_combined_kv_cache_for_decoder_layer(0).view(np.uint8)
    c1 = m.get_combined_kv_cache_for_decoder_layer(1).view(np.uint8)
    assert (c0[:, 0, :, 0] == 0x4C).all() and (c0[:, 1, :, 0] == 0x4C).all()
    assert (c1[:, 0, :, 0] == 0x44).all() and (c1[:, 1, :, 0] == 0x4C).all()
    # a table given for a one-layer write is recorded for that layer only
    m.write_kv(1, x, x, v_scale=np.array([5.0, 6.0], np.float32), positions=np.ones((3, 1), int))
    assert m.get_kv_scales()[1].tolist() == [[1.0, 1.0], [6.0, 6.0]]


def test_capture_returns_fp8_bytes_and_scales_restore_takes_them(backend):
    """A captured FP8 prompt cache comes with copies of the scale tables; restoring it into
    another manager writes the same bytes and records the same scales."""
    src, dst = hybrid("float8_e5m2"), hybrid("float8_e5m2")
    src.reset_for_new_sequences([0, 0, 0])
    ks = [rows((3, 4, c.shape[2], c.shape[4]), "float16", 50 + a)
          for a, c in enumerate(src.kv_cache_manager._caches)]
    scale = fp8_scales(np.array([[7.0, 3.0, 1.0], [2.0, 2.0, 2.0], [0.0, 5.0, 9.0]]),
                       "float8_e5m2")
    src.write_kv(None, ks, ks, k_scale=scale, v_scale=0.5)
    saved, (k_scales, v_scales) = src.capture_kv_cache(1, 4, with_scales=True)
    assert k_scales is not src.get_kv_scales()[0]
    np.testing.assert_array_equal(k_scales, scale)
    dst.restore_kv_cache(saved, 2, scales=(k_scales, v_scales))
    for i in OWNERS:
        np.testing.assert_array_equal(dst.get_combined_kv_cache(i)[2, :, :, :4].view(np.uint8),
                                      src.get_combined_kv_cache(i)[1, :, :, :4].view(np.uint8))
    np.testing.assert_array_equal(dst.get_kv_scales()[0], scale)
    np.testing.assert_array_equal(dst.get_kv_scales()[1], np.full((3, 3), 0.5, np.float32))


def test_fp8_scales_helper():
    """fp8_scales = amax / fp8_max, 1.0 for amax 0; host amax checked."""
    assert fp8_max("float8_e4m3fn") == 448.0 and fp8_max("float8_e5m2") == 57344.0
    assert fp8_scales(896.0) == 2.0 and fp8_scales(0.0) == 1.0
    got = fp8_scales(np.array([448.0, 0.0, 57344.0]), "float8_e5m2")
    assert got.dtype == np.float32 and got.tolist() == [448 / 57344, 1.0, 1.0]
    with pytest.raises(ValueError, match="amax: expected a finite value >= 0"):
        fp8_scales(-1.0)
    with pytest.raises(ValueError, match="amax: expected finite values >= 0"):
        fp8_scales(np.array([1.0, np.inf]))
    with pytest.raises(ValueError, match="dtype: expected float8_e4m3fn or float8_e5m2"):
        fp8_max("float16")


# --- refused calls change nothing ------------------------------------------------------------

def _state(m):
    caches = [m.get_combined_kv_cache(i).copy() for i in OWNERS]
    scales = [t.copy() for t in m.get_kv_scales()] if m.config.kv.dtype.startswith("float8") \
        else []
    return caches, scales, m.get_kv_cache_lengths().copy()


@pytest.mark.parametrize("call, exc, match", [
    (lambda m, k: m.write_kv(0, k, k), ValueError,
     "layer: expected an attention layer, got layer 0"),
    (lambda m, k: m.write_kv(2, k, k), ValueError,
     "layer: expected an attention layer, got layer 2"),
    (lambda m, k: m.write_kv(4, k, k), ValueError, "expected a layer that owns its KV cache"),
    (lambda m, k: m.write_kv(7, k, k), IndexError, "layer: expected an index in"),
    (lambda m, k: m.write_kv(1, k[:2], k[:2]), ValueError, r"k: expected 3 sequences"),
    (lambda m, k: m.write_kv(1, k, k[..., :4]), ValueError, r"v: expected shape"),
    (lambda m, k: m.write_kv(1, k, k.astype(np.float32)), ValueError, "v: expected dtype"),
    (lambda m, k: m.write_kv(1, k, k, k_scale=1.0), ValueError, "k_scale: expected None"),
    (lambda m, k: m.write_kv(1, k.astype(np.float32), k.astype(np.float32)), ValueError,
     "k: expected dtype float16, got float32"),
    (lambda m, k: m.write_kv(1, np.concatenate([k, k[:, :1]], 1),
                             np.concatenate([k, k[:, :1]], 1)), ValueError,
     r"k: expected at most 2 new tokens for slot 1 \(length 6\), got 3"),
    (lambda m, k: m.write_kv(1, k.reshape(6, 2, 8), k.reshape(6, 2, 8), seq_lengths=[1, 2, 2]),
     ValueError, r"k: expected 5 tokens \(the sum of seq_lengths\), got 6"),
    (lambda m, k: m.write_kv(1, k, k, positions=[[0, 1], [2, 2], [0, 1]]), ValueError,
     "positions: expected distinct positions"),
    (lambda m, k: m.write_kv(1, k, k, positions=[[0, 1], [2, 8], [0, 1]]), ValueError,
     r"positions\[3\]: expected a position in \[-1, 8\)"),
    (lambda m, k: m.write_kv(1, k, k, positions=np.zeros((3, 2), np.float32)), TypeError,
     "positions: expected integers"),
    (lambda m, k: m.write_kv(None, [k, k], [k, k]), ValueError,
     r"k: expected a list of 3 arrays"),
    (lambda m, k: m.write_kv(1, k, k, stream="s"), TypeError, "stream: expected"),
    (lambda m, k: m.write_kv(1, list(k), k), TypeError, "k: expected a numpy array"),
])
def test_refused_write_changes_nothing(backend, call, exc, match):
    """Every refusal names its argument and leaves caches, scales and lengths as they were."""
    m = hybrid()
    m.reset_for_new_sequences([0, 6, 1])
    k = rows((3, 2, 2, 8), "float16", 9)
    before = _state(m)
    with pytest.raises(exc, match=match):
        call(m, k)
    after = _state(m)
    for x, y in zip(before[0] + before[1] + [before[2]], after[0] + after[1] + [after[2]]):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(k_scale=0.0), ValueError, "k_scale: expected a finite scale > 0"),
    (dict(v_scale=np.ones(3, np.float64)), ValueError, "v_scale: expected a float32 array"),
    (dict(k_scale=np.ones((3, 2), np.float32)), ValueError, r"\[3, >= 3\] \(per head\)"),
    (dict(k_scale=np.ones(2, np.float32)), ValueError, r"k_scale: expected a float32 array \[3\]"),
])
def test_refused_fp8_write_records_no_scale(backend, kwargs, exc, match):
    """A bad scale is refused before the other scale is recorded or anything is written."""
    m = hybrid("float8_e4m3fn")
    m.reset_for_new_sequences([0, 0, 0])
    x = np.ones((3, 1, 3, 8), np.float16)
    before = _state(m)
    with pytest.raises(exc, match=match):
        m.write_kv(5, x, x, **{"k_scale": 2.0, "v_scale": 2.0, **kwargs})
    after = _state(m)
    for a, b in zip(before[0] + before[1], after[0] + after[1]):
        np.testing.assert_array_equal(a, b)


def test_scales_of_a_cache_that_is_not_fp8_are_refused():
    """get_kv_scales / set_kv_scales / capture with_scales need an FP8 cache."""
    m = hybrid()
    for call in (m.get_kv_scales, lambda: m.set_kv_scales(1.0)):
        with pytest.raises(ValueError, match="kv scales: expected an FP8 cache"):
            call()
    with pytest.raises(ValueError, match="with_scales: expected False for a float16 cache"):
        m.capture_kv_cache(0, 1, with_scales=True)
    assert m.skipped_kv_write_count() == 0


# --- steady state on a GPU ---------------------------------------------------------------------

@pytest.mark.gpu
def test_decode_write_kv_allocates_nothing(own_pool):
    """Decode-step write_kv calls (uniform, ragged, FP8 quantized) allocate no device memory
    after the first one."""
    import cupy

    for dtype, src in (("float16", np.float16), ("float8_e4m3fn", np.float16)):
        m = HybridCacheManager(hybrid(dtype).config, device="cuda")
        m.reset_for_new_sequences([0, 1, 2])
        ks = [cupy.ones((3, 1, c.shape[2], c.shape[4]), src)
              for c in m.kv_cache_manager._caches]
        m.write_kv(None, ks, ks)
        m.write_kv(None, [k.reshape(3, *k.shape[2:]) for k in ks],
                   [k.reshape(3, *k.shape[2:]) for k in ks], seq_lengths=[1, 1, 1])
        cupy.cuda.Device().synchronize()
        pool = own_pool
        used = pool.used_bytes()
        for _ in range(3):
            m.write_kv(None, ks, ks)
            m.write_kv(3, ks[1], ks[1])
            m.write_kv(None, [k.reshape(3, *k.shape[2:]) for k in ks],
                       [k.reshape(3, *k.shape[2:]) for k in ks], seq_lengths=[1, 1, 1])
        cupy.cuda.Device().synchronize()
        assert pool.used_bytes() == used
