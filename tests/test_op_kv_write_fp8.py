"""``kv_write_fp8`` of the ``kv_write`` family (kernels/kv_write.cu, hcache/ops/kv_write.py):
float32 / float16 / bfloat16 K/V rows quantized into float8_e4m3fn / float8_e5m2 caches.

Oracles: ``ml_dtypes`` (the cast of ``clip(float32(x) / scale, -max, max)``, computed here, not
through the reference), hand-computed bytes (ties, saturation, NaN, subnormals), the
token-by-token model of ``tests/test_op_kv_write.py`` fed with oracle-quantized rows, and the
NumPy reference for the kernel. The kernel runs on the host emulation of the real ``.cu``
(``emu``, ``emu-reverse``) and on CuPy (``gpu`` tier), between canary bytes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_op_kv_write import _naive_write, _write_state, write_cases

from hcache import ops
from hcache.ops.tables import KVGroup

from kernel_cases import (
    BACKENDS,
    HEAD_DIMS,
    WITH_REFERENCE,
    Arena,
    as_bytes,
    kernel_env,
    on,
    twins,
)

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = (E4M3, E5M2)
SRC = (np.dtype(np.float32), np.dtype(np.float16), BF16)
FMAX = {E4M3: 448.0, E5M2: 57344.0}
MANT = {E4M3: 3, E5M2: 2}
BIAS = {E4M3: 7, E5M2: 15}


def oracle(x, scale, fp8):
    """ml_dtypes' cast of ``clip(float32(x) / float32(scale), -max, max)``."""
    fmax = np.float32(FMAX[fp8])
    with np.errstate(all="ignore"):   # NaN / Inf inputs are the point
        q = np.clip(x.astype(np.float32) / np.asarray(scale, np.float32), -fmax, fmax)
        return q.astype(fp8)


def _one_layer(xp, fp8, tokens, heads, dim):
    """A one-slot HND cache that takes ``tokens`` rows at positions ``0..tokens-1``."""
    cache = xp.zeros((1, 2, heads, tokens, dim), np.uint8).view(fp8) if xp is np else \
        xp.zeros((1, 2, heads, tokens, dim), np.uint8)
    return cache, KVGroup([cache])


def _write_rows(kind, fp8, k, v, k_scale=1.0, v_scale=1.0, src_dtype=None):
    """Write ``k``/``v`` ``[tokens, H, D]`` at positions ``0..tokens-1`` of one slot; return
    the K and V planes as host bytes ``[tokens, H, D]``."""
    xp, backend = kernel_env(kind)
    tokens, heads, dim = k.shape
    cache, group = _one_layer(xp, fp8, tokens, heads, dim)
    ops.kv_write_fp8(group, on(xp, k), on(xp, v), layers=0, uniform_tokens=tokens, batch=1,
                     k_scale=k_scale, v_scale=v_scale, fp8_dtype=fp8, src_dtype=src_dtype,
                     backend=backend)
    planes = as_bytes(cache).reshape(2, heads, tokens, dim)
    return planes[0].transpose(1, 0, 2), planes[1].transpose(1, 0, 2)


# --- every float16 / bfloat16 value, and float32 specials: the kernel against ml_dtypes --------

def _f32_specials():
    """float32 values around every rounding decision of both formats: each format's
    representable values, the midpoints between neighbours (ties), one float32 ulp either
    side, the saturation limits, zeros, subnormals of both float32 and the formats, Inf and
    NaNs with payloads."""
    vals = []
    for fp8 in FP8:
        grid = np.arange(256, dtype=np.uint8).view(fp8).astype(np.float32)
        grid = np.unique(grid[np.isfinite(grid)])
        mids = (grid[:-1].astype(np.float64) + grid[1:]) / 2
        vals += [grid, mids.astype(np.float32), np.float32(FMAX[fp8]) * np.float32(1.0625)]
    base = np.concatenate([np.ravel(v) for v in vals]).astype(np.float32)
    ulp_up = np.nextafter(base, np.float32(np.inf))
    ulp_down = np.nextafter(base, np.float32(-np.inf))
    bits = np.array([0, 1, 0x7fffff, 0x800000, 0x7f7fffff, 0x7f800000, 0x7f800001, 0x7fc00000,
                     0x7fffffff, 0x7fa00005], np.uint32)
    raw = bits.view(np.float32)
    with np.errstate(all="ignore"):
        out = np.concatenate([base, ulp_up, ulp_down, raw, [1e30, 1e-30, 3e-39]]).astype(
            np.float32)
    return np.concatenate([out, -out])


@pytest.mark.parametrize("kind", WITH_REFERENCE)
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("src", ["float16", "bfloat16", "float32"])
def test_every_input_value_matches_ml_dtypes(kind, fp8, src):
    """Every float16 / bfloat16 bit pattern (NaNs with any payload and sign, Infs, subnormals),
    or float32 values around every rounding decision plus random bit patterns, under two
    scales (K and V): the written bytes equal ml_dtypes' cast of clip(x / scale)."""
    rng = np.random.default_rng(7)
    if src == "float32":
        special = _f32_specials()
        rand = rng.integers(0, 2**32, 8192 * 4 - special.size % (8192 * 4), dtype=np.uint64)
        x = np.concatenate([special, rand.astype(np.uint32).view(np.float32)])
        x = np.concatenate([x, np.zeros(-x.size % 1024, np.float32)])
    else:
        x = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.dtype(src))
    x = x.reshape(-1, 4, 256)
    k_scale, v_scale = 1.0, 0.0371
    got_k, got_v = _write_rows(kind, fp8, x, x, k_scale, v_scale)
    np.testing.assert_array_equal(got_k, oracle(x, k_scale, fp8).view(np.uint8))
    np.testing.assert_array_equal(got_v, oracle(x, v_scale, fp8).view(np.uint8))


# --- hand-computed bytes -----------------------------------------------------------------------

E4M3_CASES = [  # (input, scale, byte): exponent bias 7, 3 mantissa bits, max 448 = 0x7e
    (1.0, 1.0, 0x38), (-2.0, 1.0, 0xC0), (3.0, 2.0, 0x3C), (448.0, 1.0, 0x7E),
    (464.0, 1.0, 0x7E),             # would round to 480 (NaN code): saturates
    (1e9, 1.0, 0x7E), (-1e9, 1.0, 0xFE), (np.inf, 1.0, 0x7E), (-np.inf, 1.0, 0xFE),
    (np.nan, 1.0, 0x7F), (-np.nan, 1.0, 0xFF), (0.0, 1.0, 0x00), (-0.0, 1.0, 0x80),
    (2.0**-9, 1.0, 0x01),           # smallest subnormal
    (2.0**-10, 1.0, 0x00),          # half of it: tie, to even (0)
    (3 * 2.0**-10, 1.0, 0x02),      # between 1 and 2 subnormal steps: tie, to even (2)
    (-2.0**-11, 1.0, 0x80),         # rounds to -0
    (1.0625, 1.0, 0x38), (1.1875, 1.0, 0x3A),   # ties between 1, 1.125, 1.25: to even
    (1.0625 + 2.0**-20, 1.0, 0x39),             # just above a tie: up
    (2.0**-6, 1.0, 0x08),           # smallest normal
    (15 * 2.0**-10, 1.0, 0x08),     # 7.5 subnormal steps: tie, to even (8 = smallest normal)
]
E5M2_CASES = [  # exponent bias 15, 2 mantissa bits, max 57344 = 0x7b, Inf 0x7c
    (1.0, 1.0, 0x3C), (-1.5, 1.0, 0xBE), (57344.0, 1.0, 0x7B), (61440.0, 1.0, 0x7B),
    (1e9, 1.0, 0x7B), (np.inf, 1.0, 0x7B), (-np.inf, 1.0, 0xFB), (np.nan, 1.0, 0x7E),
    (-np.nan, 1.0, 0xFE), (-0.0, 1.0, 0x80), (2.0**-16, 1.0, 0x01), (2.0**-17, 1.0, 0x00),
    (3 * 2.0**-17, 1.0, 0x02), (1.125, 1.0, 0x3C), (1.375, 1.0, 0x3E), (2.0**-14, 1.0, 0x04),
    (100.0, 0.5, 0x5A),             # 200 = 1.5625 * 2^7: between 192 (0x5A) and 224; down
]


@pytest.mark.parametrize("kind", WITH_REFERENCE)
@pytest.mark.parametrize("fp8, cases", [(E4M3, E4M3_CASES), (E5M2, E5M2_CASES)],
                         ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("src", ["float32", "float16", "bfloat16"])
def test_hand_computed_bytes(kind, fp8, cases, src):
    """Values exactly representable in the source type, against bytes worked out by hand:
    round to nearest even (ties included), saturation of large values and Inf, NaN with its
    sign, signed zeros, subnormals."""
    dt = np.dtype(src)
    with np.errstate(all="ignore"):   # values a float16 cannot hold are left out
        picked = [(x, s, b) for x, s, b in cases
                  if np.isnan(x) or float(np.asarray(x, np.float32).astype(dt)) == x]
    for x, scale, want in picked:
        row = np.full((1, 1, 1), x, np.float32)
        if np.isnan(x):   # keep the NaN's sign bit
            row = np.full((1, 1, 1), np.copysign(np.nan, x), np.float32)
        row = row.astype(dt)
        got_k, got_v = _write_rows(kind, fp8, row, -row, scale, scale)
        assert int(got_k[0, 0, 0]) == want, (x, scale, hex(int(got_k[0, 0, 0])), hex(want))
        assert int(got_v[0, 0, 0]) == want ^ 0x80, (x, scale)   # -x: the sign bit flips


# --- random writes: the kernel against the reference and the token-by-token model ----------

@st.composite
def fp8_cases(draw, components=(2,)):
    c = draw(write_cases(components=components))
    fp8 = draw(st.sampled_from(FP8))
    src = draw(st.sampled_from(SRC))
    c.update(dtype=fp8, src=src, scale_kind=draw(st.sampled_from(["float", "layer", "head"])),
             labels=draw(st.permutations(range(len(c["heads"]) + 2)))[:len(c["heads"])],
             src_misalign=draw(st.sampled_from([0, 1, 2, 3, 5])),
             magnitude=draw(st.sampled_from([1e-3, 1.0, 300.0, 1e5])),
             specials=draw(st.booleans()))
    return c


def _rows_of(c):
    """K/V rows of ``c["src"]``: normal values of ``c["magnitude"]``, some specials, at an
    input misalignment of ``src_misalign`` elements."""
    def make(arena, shape):
        a = arena.array(shape, c["src"], misalign=c["src_misalign"] * c["src"].itemsize)
        vals = arena.rng.standard_normal(shape).astype(np.float32) * np.float32(c["magnitude"])
        if c["specials"] and vals.size:
            flat = vals.reshape(-1)
            picks = arena.rng.integers(0, flat.size, 4)
            flat[picks] = [np.inf, -np.nan, 1e30, -0.0]
        with np.errstate(all="ignore"):   # 1e30 overflows float16: an Inf input
            a[...] = on(arena.xp, vals.astype(c["src"]))
        return a
    return make


def _run_twins(c, xp, backend):
    """Write case ``c`` with the NumPy reference and with ``backend`` on twin caches (the same
    caches, rows and arguments, :func:`test_op_kv_write._write_state`); assert equal bytes,
    status and canaries. Returns the reference's ``(group, k rows, v rows, layers before)``."""
    ref_arena, k_arena = twins(c["seed"], xp)
    rg, rkeep, rk, rv, rkw, rstatus = _write_state(ref_arena, c, labels=c["labels"],
                                                   rows_of=_rows_of(c))
    kg, kkeep, kk, kv, kkw, kstatus = _write_state(k_arena, c, labels=c["labels"],
                                                   rows_of=_rows_of(c))
    before = [a.copy() for a in rg.layers]
    k_scale, v_scale = _scales(c, np)
    dk_scale, dv_scale = _scales(c, xp)
    li = c["layer"]
    layers = li if c["single"] else None
    args_r = (rk[li], rv[li]) if c["single"] else (rk, rv)
    args_k = (kk[li], kv[li]) if c["single"] else (kk, kv)
    ops.kv_write_fp8(rg, *args_r, layers=layers, k_scale=k_scale, v_scale=v_scale,
                     status=rstatus, **rkw)
    ops.kv_write_fp8(kg, *args_k, layers=layers, k_scale=dk_scale, v_scale=dv_scale,
                     status=kstatus, backend=backend, **kkw)
    for r, k in zip(rkeep, kkeep):
        np.testing.assert_array_equal(as_bytes(r), as_bytes(k))
    assert int(rstatus[0]) == int(as_bytes(kstatus).view(np.int32)[0])
    k_arena.check_canaries()
    return rg, rk, rv, before, int(rstatus[0])


def _scales(c, xp):
    rows, heads = len(c["heads"]) + 2, max(c["heads"]) + 1
    rng = np.random.default_rng(c["seed"] % 1000)
    if c["scale_kind"] == "float":
        return 0.75, 2.5
    shape = (rows,) if c["scale_kind"] == "layer" else (rows, heads)
    k = rng.uniform(0.01, 4.0, shape).astype(np.float32)
    v = rng.uniform(0.01, 4.0, shape).astype(np.float32)
    return on(xp, k), on(xp, v)


def _layer_scale(scale, label, heads):
    if not hasattr(scale, "shape"):
        return scale
    scale = np.asarray(scale.get() if hasattr(scale, "get") else scale)
    return scale[label] if scale.ndim == 1 else scale[label, :heads].reshape(1, heads, 1)


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=60)
@given(c=fp8_cases())
def test_kv_write_fp8_matches_reference_and_model(kind, c):
    """Random ragged / positions / paged / NHD / decode writes of either format from any
    source type, scales per call, per layer (rows by non-trivial layer labels) or per head,
    misaligned inputs and caches: the kernel's bytes and status equal the reference's, which
    equal the token-by-token model fed with ml_dtypes-quantized rows."""
    xp, backend = kernel_env(kind)
    rg, rk, rv, before, status = _run_twins(c, xp, backend)
    k_scale, v_scale = _scales(c, np)
    picked = [c["layer"]] if c["single"] else list(range(len(c["heads"])))
    qk = [oracle(rk[j], _layer_scale(k_scale, c["labels"][j], c["heads"][j]), c["dtype"])
          for j in picked]
    qv = [None if rv[j] is None else
          oracle(rv[j], _layer_scale(v_scale, c["labels"][j], c["heads"][j]), c["dtype"])
          for j in picked]
    expected, reported = _naive_write(c, [before[j] for j in picked], qk, qv, rg.layout)
    if c["tokens"]:
        for e, j in zip(expected, picked):
            np.testing.assert_array_equal(as_bytes(e), as_bytes(rg.layers[j]))
        assert status == reported


@pytest.mark.emu
@settings(max_examples=40)
@given(c=fp8_cases(components=(1, 2)), parts=st.integers(1, 9), warps=st.integers(1, 40))
def test_kv_write_fp8_with_several_warps_per_token_matches_reference(c, parts, warps):
    """The quantizing write with a token's rows dealt out to 1-9 warps in launches of 1-40
    warps (test_op_kv_write's _Parts): bytes and status equal the reference's."""
    from test_op_kv_write import _Parts

    xp, backend = kernel_env("emu")
    _run_twins(c, xp, _Parts(backend, parts, warps))


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=40)
@given(c=fp8_cases(components=(1,)))
def test_kv_write_fp8_latent_matches_reference_and_model(kind, c):
    """Quantizing writes into latent caches (one component, ``v`` None, ``k_scale`` only
    used): as the K/V case, kernel = reference = model, canaries intact."""
    test_kv_write_fp8_matches_reference_and_model.hypothesis.inner_test(kind, c)


# --- every head dim the kernel tests use, both formats, every source type --------------------

@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("src", SRC, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_ragged_write_every_head_dim(kind, fp8, src, head_dim):
    """Ragged rows (3, 0 and 2 tokens, padding, a row without a slot, an overflowing token),
    two layers of 1 and 3 heads with per-head scales, inputs one element off 16-byte
    alignment: the kernel's caches and status equal the hand-placed oracle rows."""
    xp, backend = kernel_env(kind)
    arena = Arena(np.random.default_rng(head_dim), xp)
    layers = [arena.array((4, 2, h, 6, head_dim), np.uint8).view(fp8) if xp is np else
              arena.array((4, 2, h, 6, head_dim), np.uint8) for h in (1, 3)]
    rng = np.random.default_rng(head_dim + 7)
    host_k = [(rng.standard_normal((7, h, head_dim)) * 40).astype(src) for h in (1, 3)]
    host_v = [(rng.standard_normal((7, h, head_dim)) * 900).astype(src) for h in (1, 3)]
    k = [arena.array(a.shape, src, misalign=src.itemsize) for a in host_k]
    v = [arena.array(a.shape, src, misalign=src.itemsize) for a in host_v]
    for dst, a in zip(k + v, host_k + host_v):
        dst[...] = on(xp, a)
    scales = np.array([[0.5, 0.25, 2.0], [0.125, 1.0, 3.0]], np.float32)
    status = arena.array((1,), np.int32, fill="zeros")
    before = [as_bytes(a).copy() for a in layers]
    ops.kv_write_fp8(KVGroup(layers), k, v, seq_offsets=arena.int32([0, 3, 3, 5]),
                     cache_lengths=arena.int32([1, 0, 5]), row_to_slot=arena.int32([2, -1, 0]),
                     k_scale=on(xp, scales), v_scale=on(xp, scales[::-1].copy()),
                     fp8_dtype=fp8, status=status, backend=backend)
    for j, (layer, b, kk, vv) in enumerate(zip(layers, before, host_k, host_v)):
        h = kk.shape[1]
        want = b.reshape(4, 2, h, 6, head_dim).copy()
        qk = oracle(kk, scales[j, :h].reshape(1, h, 1), fp8).view(np.uint8)
        qv = oracle(vv, scales[1 - j, :h].reshape(1, h, 1), fp8).view(np.uint8)
        for t, (slot, pos) in enumerate([(2, 1), (2, 2), (2, 3), (0, 5)]):
            want[slot, 0, :, pos], want[slot, 1, :, pos] = qk[t], qv[t]
        np.testing.assert_array_equal(as_bytes(layer), want.reshape(-1))
    assert int(as_bytes(status).view(np.int32)[0]) == 1
    arena.check_canaries()


# --- the round trip is within the format's precision -------------------------------------------

@pytest.mark.parametrize("fp8", FP8, ids=["e4m3fn", "e5m2"])
@given(x=st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=64),
       scale=st.floats(2.0**-10, 2.0**10, width=32))
def test_round_trip_error_is_bounded_by_the_format(fp8, x, scale):
    """Write then dequantize (``q * scale``): within half a unit in the last place of the
    format (relative 2^-(M+1) for normals, 2^(-bias-M) absolute below the smallest normal),
    plus float32 rounding; values past ``max * scale`` read back as ``+-max * scale``."""
    x = np.asarray(x, np.float32).reshape(-1, 1, 1)
    got, _ = _write_rows("reference", fp8, x, x, scale, scale)
    back = got.view(fp8).astype(np.float64) * np.float32(scale)
    ratio = x.astype(np.float64) / np.float32(scale)
    m, b = MANT[fp8], BIAS[fp8]
    big = np.abs(ratio) > FMAX[fp8]
    np.testing.assert_array_equal(back[big], np.sign(ratio[big]) * FMAX[fp8] * np.float32(scale))
    bound = np.maximum(np.abs(ratio) * 2.0**-(m + 1), 2.0**(-b - m)) * (1 + 2**-20) * scale
    err = np.abs(back - x.astype(np.float64))
    assert (err[~big] <= bound[~big] + np.abs(x[~big]) * 2**-22).all()


# --- argument checks (nothing is written) ------------------------------------------------------

@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_kv_write_fp8_validates_before_writing(kind):
    """Refused: a cache that is not FP8, rows that are not float32/16/bf16, a scale that is
    0, negative, NaN or Inf, a scale table of the wrong dtype or too small for the group's
    labels and heads; each names the argument and leaves the cache as it was."""
    xp, backend = kernel_env(kind)
    cache = xp.zeros((2, 2, 2, 4, 8), np.uint8)
    group = KVGroup([cache], layer_indices=[3])
    k = xp.ones((1, 2, 8), np.float16)

    def write(**kw):
        args = dict(layers=0, uniform_tokens=1, fp8_dtype="float8_e4m3fn", backend=backend)
        args.update(kw)
        kk = args.pop("k", k)
        ops.kv_write_fp8(args.pop("group", group), kk, kk, **args)

    with pytest.raises(ValueError, match="fp8_dtype: expected float8_e4m3fn or float8_e5m2"):
        write(fp8_dtype="float16")
    with pytest.raises(ValueError, match="group: expected float8_e5m2 caches"):
        write(group=KVGroup([xp.zeros((2, 2, 2, 4, 8), np.float16)]), fp8_dtype="float8_e5m2")
    with pytest.raises(ValueError, match="src_dtype: expected float32, float16 or bfloat16"):
        write(k=xp.ones((1, 2, 8), np.int8))
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e-50):
        with pytest.raises(ValueError, match="k_scale: expected a finite scale > 0"):
            write(k_scale=bad)
    with pytest.raises(TypeError, match="v_scale: expected a float"):
        write(v_scale=True)
    with pytest.raises(ValueError, match=r"k_scale: expected a C-contiguous float32"):
        write(k_scale=xp.ones(4, np.float64))
    with pytest.raises(ValueError, match=r"k_scale: expected a scale table \[>= 4\]"):
        write(k_scale=xp.ones(3, np.float32))      # label 3 needs 4 rows
    with pytest.raises(ValueError, match=r"v_scale: expected a scale table \[>= 4, >= 2\]"):
        write(v_scale=xp.ones((4, 1), np.float32))  # 2 heads need 2 columns
    with pytest.raises(ValueError, match=r"k\[0\]: expected shape"):
        write(k=xp.ones((1, 3, 8), np.float16))
    assert not as_bytes(cache).any()


def test_bfloat16_as_uint16_storage():
    """bfloat16 rows held as uint16 (how a CuPy without bfloat16 holds them) with
    ``src_dtype="bfloat16"`` write the bytes of the bfloat16 rows."""
    x = (np.arange(-8, 8, dtype=np.float32) * 37.5).astype(BF16).reshape(2, 1, 8)
    want_k, _ = _write_rows("reference", E4M3, x, x, 3.0, 3.0)
    got_k, _ = _write_rows("reference", E4M3, x.view(np.uint16), x.view(np.uint16), 3.0, 3.0,
                           src_dtype="bfloat16")
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(want_k, oracle(x, 3.0, E4M3).view(np.uint8))


@pytest.mark.parametrize("kind", BACKENDS)
def test_scale_rows_follow_the_group_labels(kind):
    """Two layers labelled 2 and 0: layer 0 reads row 2 of the per-layer table, layer 1 row
    0 (values chosen so that each row gives a different byte)."""
    xp, backend = kernel_env(kind)
    caches = [xp.zeros((1, 2, 1, 1, 4), np.uint8) for _ in range(2)]
    group = KVGroup(caches, layer_indices=[2, 0])
    x = on(xp, np.full((1, 1, 4), 8.0, np.float32))
    table = on(xp, np.array([4.0, 1.0, 2.0], np.float32))
    ops.kv_write_fp8(group, [x, x], [x, x], uniform_tokens=1, k_scale=table, v_scale=1.0,
                     fp8_dtype=E4M3, backend=backend)
    # 8 / 2 = 4 -> 0x48; 8 / 4 = 2 -> 0x40; v: 8 -> 0x50
    assert as_bytes(caches[0]).tolist() == [0x48] * 4 + [0x50] * 4
    assert as_bytes(caches[1]).tolist() == [0x40] * 4 + [0x50] * 4
