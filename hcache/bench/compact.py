"""``compact`` (kernels/compact.cu): drop finished sequences and close the gaps of a batch.

Case: 32 slots of which a random 3/4 are kept (lengths 1/8 to 1/2 of 4096 tokens), each model:
``compaction_plan`` (one launch), ``kv_compact`` (one per head-dim group) and ``slots_compact``
(one, for the Mamba states and the lengths). Baseline: per-layer fancy-indexed copies of whole
slots.
"""

from __future__ import annotations

import numpy as np

from hcache import ops
from hcache.ops.tables import SlotSet

from ._common import BenchContext, Model, kv_groups, mamba_states, models

FAMILY = "compact"


def run(ctx: BenchContext) -> list[dict]:
    rng = np.random.default_rng(0)
    return [_case(ctx, model, rng) for model in models(ctx.scale)]


def _case(ctx: BenchContext, model: Model, rng) -> dict:
    xp = ctx.xp
    slots, seq = 32 // ctx.scale, 4096 // ctx.scale
    groups = kv_groups(xp, model, slots, seq)
    lens_host = rng.integers(seq // 8, seq // 2, slots).astype(np.int32)
    keep = np.sort(rng.choice(slots, slots * 3 // 4, replace=False))
    mapping_host = np.full(slots, -1, np.int32)
    mapping_host[keep] = np.arange(len(keep))
    moved = [o for o in keep if mapping_host[o] != o]
    states = mamba_states(xp, model.mamba, slots) if model.mamba else []
    lengths = xp.asarray(lens_host)
    work = xp.asarray(lens_host)
    mapping = xp.asarray(mapping_host)
    plan = xp.zeros(ops.compaction_plan_size(slots), np.int32)
    slotset = SlotSet([(s, s) for s in states] + [(work, work)])
    # A moved slot's first lengths[old] tokens of K and V (of the latent plane), read + written.
    kv_bytes = sum(2 * model.components * int(lens_host[o]) * int(a[0, 0, :, 0].nbytes)
                   for _, layers in groups for a in layers for o in moved)
    st_bytes = 2 * len(moved) * sum(int(s[0].nbytes) for s in states)

    def compact():
        work[...] = lengths  # reset so every run moves the same bytes (a 128-byte copy)
        ops.compaction_plan(mapping, slots, len(keep), plan, lengths=work)
        for group, _ in groups:
            ops.kv_compact(group, plan, work)
        ops.slots_compact(slotset, plan)

    old_idx = xp.asarray(keep.astype(np.int64))
    new_idx = xp.asarray(mapping_host[keep].astype(np.int64))

    def naive():
        for _, layers in groups:
            for layer in layers:
                layer[new_idx] = layer[old_idx]
        for s in states:
            s[new_idx] = s[old_idx]

    return ctx.measure(model.name, f"{slots}->{len(keep)} slots", compact, kv_bytes + st_bytes,
                       naive, len(groups) + 2)
