"""``transfer`` (hcache.transfer): one request's caches pulled between two engines with NIXL.

Case: a Nemotron-H-like request (4 attention layers of 8 KV heads x 128, 24 Mamba-2 layers)
exported by one engine and pulled by another in the same process (two NIXL agents over UCX;
on the cpu device over loopback, ``UCX_TLS=tcp,cma`` unless set). Wall-clock medians of the
whole ``pull`` (descriptor planning, NIXL transfer, completion polling); the baseline is a
same-run device copy of the same bytes; the naive baseline is the same pull with one
descriptor per unit (KV head row run, Mamba head, conv segment) instead of merged ones. A
second row pulls the same request between two contexts (``DynamicInferenceContext``: paged
blocks, admission and release included). No rows when NIXL is not installed.
"""

from __future__ import annotations

import os
import statistics
import time

from ._common import BenchContext, significant

FAMILY = "transfer"


def _config(scale: int, max_len: int):
    from hcache.config.caches import (
        HybridCacheConfig,
        KVCacheConfig,
        KVLayerConfig,
        LayerType,
        MambaCacheConfig,
    )

    types = ([LayerType.MAMBA] * 6 + [LayerType.ATTENTION]) * 4
    kv = KVCacheConfig(2, max_len, (KVLayerConfig(8, 128),) * 4, dtype="float16")
    mamba = MambaCacheConfig(24, 2, 128 // scale, 64, 128 // scale, 8192 // scale, 4,
                             "float32", "float16")
    return HybridCacheConfig(types, kv, mamba, 2)


def run(ctx: BenchContext) -> list[dict]:
    from hcache.transfer import TransferEngine, nixl_available

    if not nixl_available():
        print("transfer: NIXL not installed (pip install 'hcache[transfer]'): no rows")
        return []
    if not ctx.device.is_cuda:
        os.environ.setdefault("UCX_TLS", "tcp,cma")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from hcache.slots.hybrid import HybridCacheManager

    tokens = 4096 // ctx.scale
    config = _config(ctx.scale, tokens)
    src, dst = HybridCacheManager(config, device=ctx.device), HybridCacheManager(
        config, device=ctx.device)
    rows = []
    with TransferEngine(src, "bench-src") as a, TransferEngine(dst, "bench-dst") as b:
        b.connect(a.metadata)
        a.connect(b.metadata)
        handle = a.export("bench", 1, tokens)
        pending = b.begin_pull(handle, 0)
        pending.wait()
        nbytes = 2 * pending.nbytes          # read + written, like the other rows
        us = _wall_us(ctx, lambda: b.pull(handle, 0))
        naive_us = _wall_us(ctx, lambda: b.pull(handle, 0, merge=False))
        copy_us = ctx.copy_us(nbytes)
        rows.append({"model": "nemotron-h-like",
                     "case": f"pull {tokens} tok {pending.num_descriptors} descs",
                     "us": round(us, 3), "bytes": int(nbytes),
                     "GBps": round(nbytes / us / 1e3, 2) if us else None,
                     "vs_copy": significant(copy_us / us) if us else None,
                     "speedup_vs_naive": significant(naive_us / us) if us else None, "launches": 1,
                     # no kernel: a pull is host-driven (its wall time is host_us); memcpy_us a
                     # same-run copy of the same bytes, as the kernel rows have
                     "kernel_us": None, "host_us": round(us, 3), "memcpy_us": round(copy_us, 3),
                     "kernel_vs_memcpy": None})
    rows.append(_context_row(ctx, config, tokens))
    return rows


def _context_row(ctx: BenchContext, config, tokens: int) -> dict:
    """The same request between two ``DynamicInferenceContext``\\ s (blocks of 64 tokens):
    a whole ``ContextTransferEngine.pull``, admission, transfer and completion, then the
    release that returns its blocks (the receiver's prefix caching is off, so every pull
    moves every block)."""
    from hcache.contexts import DynamicInferenceContext
    from hcache.transfer import ContextTransferEngine

    src, dst = (DynamicInferenceContext.from_config(config, block_size_tokens=64, device=ctx.device,
                                                    enable_prefix_caching=caching)
                for caching in (True, False))
    src.add_request("bench", list(range(tokens)))
    src.commit_step()
    with ContextTransferEngine(src, "bench-ctx-src") as a, \
            ContextTransferEngine(dst, "bench-ctx-dst") as b:
        b.connect(a.metadata)
        a.connect(b.metadata)
        handle = a.export("bench")

        def pull(merge=True):
            pending = b.pull(handle, "r", merge=merge)
            dst.release_requests(["r"])
            return pending

        pending = pull()
        nbytes = 2 * pending.nbytes
        us, naive_us = _wall_us(ctx, pull), _wall_us(ctx, lambda: pull(False))
    copy_us = ctx.copy_us(nbytes)
    return {"model": "nemotron-h-like", "case": f"context pull {tokens} tok "
            f"{pending.num_pulled_blocks} blocks {pending.num_descriptors} descs",
            "us": round(us, 3), "bytes": int(nbytes),
            "GBps": round(nbytes / us / 1e3, 2) if us else None,
            "vs_copy": significant(copy_us / us) if us else None,
            "speedup_vs_naive": significant(naive_us / us) if us else None, "launches": 1,
            "kernel_us": None, "host_us": round(us, 3), "memcpy_us": round(copy_us, 3),
            "kernel_vs_memcpy": None}


def _wall_us(ctx: BenchContext, fn) -> float:
    """Median wall-clock µs of ``fn()`` (a pull waits on the host), after the warmup runs."""
    times = []
    for _ in range(ctx.timer.warmup + ctx.timer.repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times[ctx.timer.warmup:])
