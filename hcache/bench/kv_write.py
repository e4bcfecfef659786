"""``kv_write`` (kernels/kv_write.cu): append the K/V of a batch to the attention caches.

Cases: decode (64 sequences × 1 token) and prefill (4 sequences × 2048 tokens) of each model,
one launch per head-dim group. Baseline: per-layer fancy-indexed stores of K and V.
"""

from __future__ import annotations

import numpy as np

from hcache import ops

from ._common import DTYPE, BenchContext, Model, kv_groups, models

FAMILY = "kv_write"


def run(ctx: BenchContext) -> list[dict]:
    s = ctx.scale
    return [_case(ctx, model, case, batch, tokens) for model in models(s)
            for case, batch, tokens in (("decode", 64 // s, 1), ("prefill", 4, 2048 // s))]


def _case(ctx: BenchContext, model: Model, case: str, batch: int, tokens: int) -> dict:
    xp = ctx.xp
    seq = max(4096 // ctx.scale, tokens)
    groups = kv_groups(xp, model, batch, seq)
    t = batch * tokens
    offsets = xp.asarray(np.arange(batch + 1, dtype=np.int32) * tokens)
    lengths = xp.zeros(batch, np.int32)
    srcs = [([xp.ones((t, a.shape[2], a.shape[4]), DTYPE) for a in layers],
             [xp.ones((t, a.shape[2], a.shape[4]), DTYPE) for a in layers])
            for _, layers in groups]
    nbytes = 2 * sum(int(k.nbytes) + int(v.nbytes) for ks, vs in srcs for k, v in zip(ks, vs))

    def write():
        for (group, _), (k, v) in zip(groups, srcs):
            ops.kv_write(group, k, v, seq_offsets=offsets, cache_lengths=lengths)

    slot_idx = xp.asarray(np.repeat(np.arange(batch), tokens).astype(np.int64))
    pos_idx = xp.asarray(np.tile(np.arange(tokens), batch).astype(np.int64))

    def naive():
        for (_, layers), (k, v) in zip(groups, srcs):
            for layer, kk, vv in zip(layers, k, v):
                layer[slot_idx, 0, :, pos_idx] = kk
                layer[slot_idx, 1, :, pos_idx] = vv

    return ctx.measure(model.name, f"{case} b{batch}x{tokens}", write, nbytes, naive,
                       len(groups))
