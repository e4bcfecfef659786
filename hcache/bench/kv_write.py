"""``kv_write`` (kernels/kv_write.cu): append the K/V of a batch to the attention caches, as
bytes (``kv_write``, float16 caches) and quantized on the way (``kv_write_fp8``: float16 rows
into float8_e4m3fn caches, per-head scale tables).

Cases: decode (64 sequences × 1 token) and prefill (4 sequences × 2048 tokens) of each model,
one launch per head-dim group, the plain write and the quantizing write side by side. Each row
also gives ``in_GBps`` (K/V rows read) and ``out_GBps`` (cache bytes written). Baselines:
per-layer fancy-indexed stores of K and V (plain); for FP8, an unfused quantize (divide, clip
and cast per layer, then a ``kv_write`` of the bytes). CuPy has no float8 cast, so on a GPU
the unfused cast is a float16 cast plus a byte slice, a lower bound of the real one.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from hcache import ops
from hcache.ops.tables import KVGroup

from ._common import DTYPE, BenchContext, Model, kv_groups, models

FAMILY = "kv_write"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def run(ctx: BenchContext) -> list[dict]:
    s = ctx.scale
    return [row for model in models(s)
            for case, batch, tokens in (("decode", 64 // s, 1), ("prefill", 4, 2048 // s))
            for row in (_case(ctx, model, case, batch, tokens),
                        _fp8_case(ctx, model, case, batch, tokens))]


def _sources(xp, groups, t, dtype):
    """Per group, the K rows and the V rows (None for a latent layer) of ``t`` tokens."""
    return [([xp.ones((t, a.shape[2], a.shape[4]), dtype) for a in layers],
             [xp.ones((t, a.shape[2], a.shape[4]), dtype) if a.shape[1] == 2 else None
              for a in layers])
            for _, layers in groups]


def _rows_nbytes(srcs) -> int:
    return sum(int(a.nbytes) for ks, vs in srcs for a in ks + vs if a is not None)


def _with_io(row: dict, in_bytes: int, out_bytes: int) -> dict:
    us = row["us"]
    row.update(in_GBps=round(in_bytes / us / 1e3, 2) if us else None,
               out_GBps=round(out_bytes / us / 1e3, 2) if us else None)
    return row


def _case(ctx: BenchContext, model: Model, case: str, batch: int, tokens: int) -> dict:
    xp = ctx.xp
    seq = max(4096 // ctx.scale, tokens)
    groups = kv_groups(xp, model, batch, seq)
    t = batch * tokens
    offsets = xp.asarray(np.arange(batch + 1, dtype=np.int32) * tokens)
    lengths = xp.zeros(batch, np.int32)
    srcs = _sources(xp, groups, t, DTYPE)
    moved = _rows_nbytes(srcs)

    def write():
        for (group, _), (k, v) in zip(groups, srcs):
            ops.kv_write(group, k, v, seq_offsets=offsets, cache_lengths=lengths)

    slot_idx = xp.asarray(np.repeat(np.arange(batch), tokens).astype(np.int64))
    pos_idx = xp.asarray(np.tile(np.arange(tokens), batch).astype(np.int64))

    def naive():
        for (_, layers), (k, v) in zip(groups, srcs):
            for layer, kk, vv in zip(layers, k, v):
                layer[slot_idx, 0, :, pos_idx] = kk
                if vv is not None:
                    layer[slot_idx, 1, :, pos_idx] = vv

    row = ctx.measure(model.name, f"{case} b{batch}x{tokens}", write, 2 * moved, naive,
                      len(groups))
    return _with_io(row, moved, moved)


def _fp8_case(ctx: BenchContext, model: Model, case: str, batch: int, tokens: int) -> dict:
    xp = ctx.xp
    seq = max(4096 // ctx.scale, tokens)
    groups = _fp8_groups(xp, model, batch, seq)
    t = batch * tokens
    offsets = xp.asarray(np.arange(batch + 1, dtype=np.int32) * tokens)
    lengths = xp.zeros(batch, np.int32)
    srcs = _sources(xp, groups, t, DTYPE)
    heads = max(h for h, _ in model.attention)
    scales = xp.asarray(np.full((len(model.attention), heads), 0.25, np.float32))
    in_bytes = _rows_nbytes(srcs)
    out_bytes = in_bytes // DTYPE().itemsize

    def write():
        for (group, _), (k, v) in zip(groups, srcs):
            ops.kv_write_fp8(group, k, v, seq_offsets=offsets, cache_lengths=lengths,
                             k_scale=scales, v_scale=scales, fp8_dtype=FP8)

    def naive():
        for (group, _), (k, v) in zip(groups, srcs):
            rows = group.layer_indices
            qk = [_quantize(xp, a, scales[r, :a.shape[1], None]) for a, r in zip(k, rows)]
            qv = [None if a is None else _quantize(xp, a, scales[r, :a.shape[1], None])
                  for a, r in zip(v, rows)]
            ops.kv_write(group, qk, qv, seq_offsets=offsets, cache_lengths=lengths)

    row = ctx.measure(model.name, f"{case} b{batch}x{tokens} fp8", write, in_bytes + out_bytes,
                      naive, len(groups))
    return _with_io(row, in_bytes, out_bytes)


def _fp8_groups(xp, model: Model, slots: int, seq: int) -> list:
    """FP8 caches (uint8 storage on CuPy) of ``model``'s attention layers, one ``(KVGroup,
    layers)`` per head dim, labelled with their attention indices (their scale rows)."""
    dtype = FP8 if xp is np else np.uint8
    by_dim: dict[int, list[int]] = {}
    for a, (_, dim) in enumerate(model.attention):
        by_dim.setdefault(dim, []).append(a)
    out = []
    for members in by_dim.values():
        layers = [xp.zeros((slots, model.components, model.attention[a][0], seq,
                            model.attention[a][1]), dtype) for a in members]
        out.append((KVGroup(layers, layer_indices=members), layers))
    return out


def _quantize(xp, a, scale):
    """The unfused quantize of the baseline (see the module docstring)."""
    q = xp.clip(a.astype(np.float32) / scale, -448.0, 448.0)
    if xp is np:
        return q.astype(FP8)
    return xp.ascontiguousarray(q.astype(np.float16).view(np.uint8)[..., 1::2])
