"""``draft_accept`` (kernels/draft_accept.cu): after a speculative step, scatter the state after
each sequence's last accepted draft token into its live state, for every Mamba layer in one
launch (``draft_accept``), then advance the lengths by the kept tokens (``draft_lengths``).

Case: the Mamba-2 layers of the hybrid model, a batch of 8 sequences with drafts of 4 tokens,
accepted counts ``0..4`` spread over the batch (device data). Bytes: each committing row reads
and writes one slot of every state tensor. Baseline: per-tensor fancy-indexed copies of the
same rows (indices computed once, outside the timing, as an engine could not without a host
read).
"""

from __future__ import annotations

import numpy as np

from hcache import ops
from hcache.ops.tables import SlotSet

from ._common import BenchContext, Model, mamba_states, models

FAMILY = "draft_accept"

DRAFT = 4


def run(ctx: BenchContext) -> list[dict]:
    return [_case(ctx, model) for model in models(ctx.scale) if model.mamba]


def _case(ctx: BenchContext, model: Model) -> dict:
    xp = ctx.xp
    batch = 8
    live = mamba_states(xp, model.mamba, batch)
    drafts = mamba_states(xp, model.mamba, batch * DRAFT, fill=1.0)   # [batch * DRAFT, ...]
    slotset = SlotSet(list(zip(drafts, live)))
    accepted_host = (np.arange(batch) % (DRAFT + 1)).astype(np.int32)
    accepted = xp.asarray(accepted_host)
    rows = np.flatnonzero(accepted_host > 0)
    nbytes = 2 * len(rows) * sum(int(a[0].nbytes) for a in live)
    src = xp.asarray(rows * DRAFT + accepted_host[rows] - 1)
    dst = xp.asarray(rows)

    def scatter():
        ops.draft_accept(slotset, DRAFT, accepted, batch, DRAFT)

    def naive():
        for d, lv in zip(drafts, live):
            lv[dst] = d[src]

    return ctx.measure(model.name, f"accept b{batch} k{DRAFT} {len(live)} states", scatter,
                       nbytes, naive, 1)
