"""``slot_copy`` (kernels/slot_copy.cu): copy whole slots between tensor sets in one launch.

Case: storing the Mamba states of 8 live slots into a 4× larger state cache (the models with
Mamba layers). Baseline: per-tensor fancy-indexed copies.
"""

from __future__ import annotations

import numpy as np

from hcache import ops
from hcache.ops.tables import SlotSet

from ._common import BenchContext, Model, mamba_states, models

FAMILY = "slot_copy"


def run(ctx: BenchContext) -> list[dict]:
    return [_case(ctx, model) for model in models(ctx.scale) if model.mamba]


def _case(ctx: BenchContext, model: Model) -> dict:
    xp = ctx.xp
    slots = 16 // ctx.scale or 1
    live = mamba_states(xp, model.mamba, slots, fill=1.0)
    cache = mamba_states(xp, model.mamba, 4 * slots)
    pairs = min(8, slots)
    src = xp.asarray(np.arange(pairs, dtype=np.int32))
    dst = xp.asarray(np.arange(pairs, dtype=np.int32) * 3)
    slotset = SlotSet(list(zip(live, cache)))
    nbytes = 2 * pairs * sum(int(a[0].nbytes) for a in live)
    s64, d64 = src.astype(np.int64), dst.astype(np.int64)

    def naive():
        for a, c in zip(live, cache):
            c[d64] = a[s64]

    return ctx.measure(model.name, f"mamba store {pairs} slots",
                       lambda: ops.slot_copy(slotset, src, dst), nbytes, naive, 1)
