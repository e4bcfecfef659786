"""``kv_capture`` (kernels/kv_capture.cu): copy a slot's first tokens out of every attention
layer (``kv_capture``; ``kv_restore`` is the same kernel the other way).

Case: half of a 4096-token slot of each model, one launch per head-dim group. Baseline:
per-layer sliced copies.
"""

from __future__ import annotations

from hcache import ops

from ._common import DTYPE, BenchContext, Model, kv_groups, models

FAMILY = "kv_capture"


def run(ctx: BenchContext) -> list[dict]:
    return [_case(ctx, model) for model in models(ctx.scale)]


def _case(ctx: BenchContext, model: Model) -> dict:
    xp = ctx.xp
    slots, seq = 16 // ctx.scale or 1, 4096 // ctx.scale
    groups = kv_groups(xp, model, slots, seq)
    n_tok = seq // 2
    outs = [[xp.empty(a.shape[1:3] + (n_tok, a.shape[4]), DTYPE) for a in layers]
            for _, layers in groups]
    nbytes = 2 * sum(int(o.nbytes) for os_ in outs for o in os_)

    def capture():
        for (group, _), out in zip(groups, outs):
            ops.kv_capture(group, 0, n_tok, out)

    def naive():
        for (_, layers), out in zip(groups, outs):
            for layer, t in zip(layers, out):
                t[...] = layer[0, :, :, :n_tok]

    return ctx.measure(model.name, f"{n_tok} tokens", capture, nbytes, naive, len(groups))
