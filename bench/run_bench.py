"""Kernel microbenchmarks (docs/design.md §8): ``python -m hcache bench``.

Every kernel family is timed on realistic shapes: a Nemotron-H-like hybrid (4 attention layers
of 8 KV heads × 128, 24 Mamba-2 layers) and a Gemma-like heterogeneous model (sliding layers of
head dim 256, full layers of head dim 512), at decode and prefill sizes. On a GPU each case is
the median of many runs after warm-up, timed with CUDA events, and reported as µs, effective GB/s
(bytes that must move, read + written), the ratio to a plain device-to-device copy of the same
bytes measured in the same run, and the speed-up over the obvious CuPy alternative (a per-layer
loop of fancy-indexed copies). On the CPU the same cases run, scaled down, on the NumPy reference
path, and the report says so. Results go to ``bench/results/<date>_<device>.json`` (and a PNG
plot when matplotlib is present).
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from hcache import ops
from hcache.device import resolve_device
from hcache.ops.tables import KVGroup, SlotSet

RESULTS = Path(__file__).resolve().parent / "results"


class Timer:
    """Median wall time of ``fn`` in µs: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, xp, repeat: int, warmup: int = 3):
        self.xp, self.repeat, self.warmup = xp, repeat, warmup

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        if self.xp is np:
            for _ in range(self.repeat):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        else:
            start, end = self.xp.cuda.Event(), self.xp.cuda.Event()
            for _ in range(self.repeat):
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(self.xp.cuda.get_elapsed_time(start, end) * 1e3)
        return statistics.median(times)


def _models(scale: int):
    """(name, attention layers as (heads, head_dim), mamba (layers, state shape, conv shape))."""
    nemotron = ("nemotron-h-like", [(8, 128)] * 4, (24, (128 // scale, 64, 128 // scale),
                                                     (8192 // scale, 4)))
    gemma = ("gemma-like", [(16, 256)] * 5 + [(4, 512)], None)
    return [nemotron, gemma]


def _groups(xp, layers, slots, seq, dtype):
    by_dim: dict[int, list] = {}
    for heads, dim in layers:
        by_dim.setdefault(dim, []).append(xp.zeros((slots, 2, heads, seq, dim), dtype))
    return [KVGroup(ls) for ls in by_dim.values()]


def _copy_baseline(xp, nbytes, timer):
    """µs of one device-to-device copy moving ``nbytes`` (read + written)."""
    half = max(nbytes // 2, 16)
    src, dst = xp.ones(half, np.uint8), xp.empty(half, np.uint8)
    return timer(lambda: dst.__setitem__(Ellipsis, src))


def _row(family, model, case, us, nbytes, copy_us, naive_us, launches):
    return {"family": family, "model": model, "case": case, "us": round(us, 3),
            "bytes": int(nbytes), "GBps": round(nbytes / us / 1e3, 2) if us else None,
            "vs_copy": round(copy_us / us, 3) if us else None,
            "speedup_vs_naive": round(naive_us / us, 2) if naive_us and us else None,
            "launches": launches}


def bench_writes(xp, timer, scale, rows):
    dtype = np.float16
    for model, layers, _ in _models(scale):
        for case, batch, tokens in (("decode", 64 // scale, 1), ("prefill", 4, 2048 // scale)):
            seq = max(4096 // scale, tokens)
            groups = _groups(xp, layers, batch, seq, dtype)
            t = batch * tokens
            offsets = xp.asarray(np.arange(batch + 1, dtype=np.int32) * tokens)
            lengths = xp.zeros(batch, np.int32)
            srcs = [([xp.ones((t, h, g.head_dim), dtype) for h in g.num_kv_heads],
                     [xp.ones((t, h, g.head_dim), dtype) for h in g.num_kv_heads])
                    for g in groups]
            nbytes = 2 * sum(2 * t * h * g.row_bytes for g in groups for h in g.num_kv_heads)

            def run():
                for g, (k, v) in zip(groups, srcs):
                    ops.kv_write(g, k, v, seq_offsets=offsets, cache_lengths=lengths)

            slot_idx = xp.asarray(np.repeat(np.arange(batch), tokens).astype(np.int64))
            pos_idx = xp.asarray(np.tile(np.arange(tokens), batch).astype(np.int64))

            def naive():
                for g, (k, v) in zip(groups, srcs):
                    for layer, kk, vv in zip(g.layers, k, v):
                        layer[slot_idx, 0, :, pos_idx] = kk
                        layer[slot_idx, 1, :, pos_idx] = vv

            us = timer(run)
            rows.append(_row("kv_write", model, f"{case} b{batch}x{tokens}", us, nbytes,
                             _copy_baseline(xp, nbytes, timer), timer(naive), len(groups)))


def bench_compaction(xp, timer, scale, rows):
    dtype = np.float16
    rng = np.random.default_rng(0)
    for model, layers, mamba in _models(scale):
        slots, seq = 32 // scale, 4096 // scale
        groups = _groups(xp, layers, slots, seq, dtype)
        lens_host = rng.integers(seq // 8, seq // 2, slots).astype(np.int32)
        keep = np.sort(rng.choice(slots, slots * 3 // 4, replace=False))
        mapping_host = np.full(slots, -1, np.int32)
        mapping_host[keep] = np.arange(len(keep))
        moved = [o for o in keep if mapping_host[o] != o]
        states = []
        if mamba:
            n, ssm, conv = mamba
            states = [xp.zeros((slots, *ssm), np.float32) for _ in range(n)] + \
                     [xp.zeros((slots, *conv), dtype) for _ in range(n)]
        lengths = xp.asarray(lens_host)
        work = xp.asarray(lens_host)
        mapping = xp.asarray(mapping_host)
        plan = xp.zeros(ops.compaction_plan_size(slots), np.int32)
        slotset = SlotSet([(s, s) for s in states] + [(work, work)])
        kv_bytes = sum(2 * 2 * h * g.row_bytes * int(lens_host[o])
                       for g in groups for h in g.num_kv_heads for o in moved)
        st_bytes = 2 * len(moved) * sum(int(s[0].nbytes) for s in states)

        def run():
            work[...] = lengths  # reset so every run moves the same bytes (a 128-byte copy)
            ops.compaction_plan(mapping, slots, len(keep), plan, lengths=work)
            for g in groups:
                ops.kv_compact(g, plan, work)
            ops.slots_compact(slotset, plan)

        old_idx = xp.asarray(keep.astype(np.int64))
        new_idx = xp.asarray(mapping_host[keep].astype(np.int64))

        def naive():  # per-layer fancy-indexed copies of whole slots
            for g in groups:
                for layer in g.layers:
                    layer[new_idx] = layer[old_idx]
            for s in states:
                s[new_idx] = s[old_idx]

        us = timer(run)
        nbytes = kv_bytes + st_bytes
        rows.append(_row("compaction", model, f"{slots}->{len(keep)} slots", us, nbytes,
                         _copy_baseline(xp, nbytes, timer), timer(naive), len(groups) + 2))


def bench_slot_copy_and_capture(xp, timer, scale, rows):
    dtype = np.float16
    for model, layers, mamba in _models(scale):
        slots, seq = 16 // scale or 1, 4096 // scale
        if mamba:
            n, ssm, conv = mamba
            live = [xp.ones((slots, *ssm), np.float32) for _ in range(n)] + \
                   [xp.ones((slots, *conv), dtype) for _ in range(n)]
            cache = [xp.zeros((4 * slots, *a.shape[1:]), a.dtype) for a in live]
            pairs = min(8, slots)
            src = xp.asarray(np.arange(pairs, dtype=np.int32))
            dst = xp.asarray(np.arange(pairs, dtype=np.int32) * 3)
            sset = SlotSet(list(zip(live, cache)))
            nbytes = 2 * pairs * sum(int(a[0].nbytes) for a in live)
            s64, d64 = src.astype(np.int64), dst.astype(np.int64)

            def naive():
                for a, c in zip(live, cache):
                    c[d64] = a[s64]

            us = timer(lambda: ops.slot_copy(sset, src, dst))
            rows.append(_row("slot_copy", model, f"mamba store {pairs} slots", us, nbytes,
                             _copy_baseline(xp, nbytes, timer), timer(naive), 1))
        groups = _groups(xp, layers, slots, seq, dtype)
        n_tok = seq // 2
        outs = [[xp.empty((2, h, n_tok, g.head_dim), dtype) for h in g.num_kv_heads]
                for g in groups]
        nbytes = 2 * sum(int(o.nbytes) for os_ in outs for o in os_)

        def capture():
            for g, o in zip(groups, outs):
                ops.kv_capture(g, 0, n_tok, o)

        def naive_capture():
            for g, o in zip(groups, outs):
                for layer, t in zip(g.layers, o):
                    t[...] = layer[0, :, :, :n_tok]

        us = timer(capture)
        rows.append(_row("kv_capture", model, f"{n_tok} tokens", us, nbytes,
                         _copy_baseline(xp, nbytes, timer), timer(naive_capture), len(groups)))


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [f"{r['family']}\n{r['model']}\n{r['case']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    ax.bar(range(len(rows)), [r["GBps"] or 0 for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("effective GB/s (read + written)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(device=None, out_dir=None, quick=False) -> int:
    dev = resolve_device(device)
    xp = dev.xp
    scale = 1 if dev.is_cuda else 16
    repeat = (20 if quick else 200) if dev.is_cuda else (2 if quick else 5)
    timer = Timer(xp, repeat, warmup=1 if not dev.is_cuda else 5)
    rows: list[dict] = []
    with dev.scope():
        bench_writes(xp, timer, scale, rows)
        bench_compaction(xp, timer, scale, rows)
        bench_slot_copy_and_capture(xp, timer, scale, rows)
    if dev.is_cuda:
        props = xp.cuda.runtime.getDeviceProperties(dev.index)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        note = "CUDA kernels, CUDA-event medians"
    else:
        name, note = platform.processor() or "cpu", \
            "CPU: NumPy reference path (the cpu backend), shapes scaled down 16x; not kernel speed"
    print(f"hcache bench on {name} ({dev}): {note}")
    print(f"{'family':<11} {'model':<16} {'case':<24} {'us':>10} {'GB/s':>9} {'xcopy':>7} "
          f"{'xnaive':>7} launches")
    for r in rows:
        print(f"{r['family']:<11} {r['model']:<16} {r['case']:<24} {r['us']:>10.1f} "
              f"{r['GBps'] or 0:>9.1f} {r['vs_copy'] or 0:>7.2f} "
              f"{r['speedup_vs_naive'] or 0:>7.2f} {r['launches']}")
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{_dt.date.today().isoformat()}_{''.join(c if c.isalnum() else '-' for c in name)}"
    path = out / f"{stem}.json"
    path.write_text(json.dumps({"device": name, "backend": str(dev), "note": note,
                                "repeat": repeat, "rows": rows}, indent=1))
    png = _plot(rows, out / f"{stem}.png")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0
