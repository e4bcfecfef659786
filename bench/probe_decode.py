"""Kernel-only time of the decode writes, for Nsight Compute (``bench/gpu_session.sh``, stage
``probe``): each model's decode write (64 sequences x 1 token, every attention layer of a
head-dim group in one launch, plain and FP8) runs a few times eagerly; ``ncu`` reads each
launch's device time, free of host gaps. Without ncu it prints what graph capture of the same
call says (the bench's ``kernel_timing``), so a failed capture is explained.

Run from the repository root: ``python3 bench/probe_decode.py``.
"""

from __future__ import annotations

import sys

import numpy as np

from hcache import ops
from hcache.bench import kv_write
from hcache.bench._common import BenchContext, Timer, kv_groups, models
from hcache.runtime import _cuda
from hcache.runtime.device import resolve_device


def main() -> int:
    dev = resolve_device(sys.argv[1] if len(sys.argv) > 1 else None)
    ctx = BenchContext(dev, Timer(dev.xp, 5, 2), 1 if dev.is_cuda else 16)
    calls = []
    with dev.scope():
        for model in models(ctx.scale)[:2]:
            for fp8 in (False, True):
                calls.append((f"{model.name} decode b64x1{' fp8' if fp8 else ''}",
                              _write(ctx, model, fp8)))
        for name, write in calls:
            for _ in range(3):
                write()
            if dev.is_cuda:
                _cuda.runtime().synchronize_stream()
                _, reason = _cuda.runtime().capture_replay(write)
                print(f"{name}: capture {'ok' if reason is None else reason}", flush=True)
    return 0


def _write(ctx, model, fp8: bool):
    """The bench case's call (kv_write._case / _fp8_case), built the same way."""
    xp, batch, tokens = ctx.xp, 64 // ctx.scale, 1
    seq = max(4096 // ctx.scale, tokens)
    groups = (kv_write._fp8_groups(xp, model, batch, seq) if fp8 else
              kv_groups(xp, model, batch, seq))
    t = batch * tokens
    offsets = xp.asarray(np.arange(batch + 1, dtype=np.int32) * tokens)
    lengths = xp.zeros(batch, np.int32)
    srcs = kv_write._sources(xp, groups, t, np.float16)
    heads = max(h for h, _ in model.attention)
    scales = xp.asarray(np.full((len(model.attention), heads), 0.25, np.float32))
    def write():
        for (group, _), (k, v) in zip(groups, srcs):
            if fp8:
                ops.kv_write_fp8(group, k, v, seq_offsets=offsets, cache_lengths=lengths,
                                 k_scale=scales, v_scale=scales, fp8_dtype=kv_write.FP8)
            else:
                ops.kv_write(group, k, v, seq_offsets=offsets, cache_lengths=lengths)
    return write


if __name__ == "__main__":
    sys.exit(main())
