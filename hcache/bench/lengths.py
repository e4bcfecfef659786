"""``lengths`` (kernels/lengths.cu): commit the lengths of a batch after a step, all or nothing.

Cases: the decode-step commit (``+1`` for every sequence) of 64 and 256 sequences, and a ragged
commit (an int32 increment per sequence, as after a chunked-prefill step) of 256 sequences.
One single-thread launch each, so these are latency, not bandwidth, numbers. Baseline: the
obvious CuPy all-or-nothing update without a host round trip (add, check, ``where``).
Lengths do not depend on the model: rows say ``any``.
"""

from __future__ import annotations

import numpy as np

from hcache import ops

from ._common import BenchContext

FAMILY = "lengths"

MAX_LEN = 1 << 30  # far above what the repeated commits reach


def run(ctx: BenchContext) -> list[dict]:
    return [_case(ctx, batch, ragged) for batch, ragged in ((64, False), (256, False),
                                                              (256, True))]


def _case(ctx: BenchContext, batch: int, ragged: bool) -> dict:
    xp = ctx.xp
    rng = np.random.default_rng(batch)
    lengths = xp.asarray(rng.integers(0, 4096, batch).astype(np.int32))
    if ragged:
        increment = xp.asarray(rng.integers(1, 512, batch).astype(np.int32))
        case = f"ragged b{batch} +inc[]"
    else:
        increment = 1
        case = f"decode b{batch} +1"
    # lengths read + written, the increments read.
    nbytes = 2 * int(lengths.nbytes) + (int(increment.nbytes) if ragged else 0)

    def commit():
        ops.lengths_add(lengths, batch, increment, MAX_LEN)

    def naive():
        nxt = lengths + increment
        ok = (nxt <= MAX_LEN).all()
        if ragged:
            ok &= (increment >= 0).all()
        lengths[...] = xp.where(ok, nxt, lengths)

    return ctx.measure("any", case, commit, nbytes, naive, 1)
