"""The loop the serving A/B scripts of this folder share: two serving loops
(``hcache.bench.host_serving._Server`` of two checkouts, or of two pool sizes) warmed, then
stepped alternately, first one first then the other, thread CPU time per call."""

import gc
import statistics
import time

WARM_STEPS = 300


def interleaved_steps(first, second, steps: int) -> dict:
    """``{"decode" | "add" | "release": ([µs of first], [µs of second])}`` over ``steps``
    steps after :data:`WARM_STEPS` untimed ones (``add`` / ``release``: per request)."""
    for _ in range(WARM_STEPS):
        first.step()
        second.step()
    times = {k: ([], []) for k in ("decode", "add", "release")}
    gc.collect()
    gc.disable()
    try:
        for i in range(steps):
            out = {}
            for server in ((second, first) if i % 2 else (first, second)):
                out[server] = server.step(time.thread_time_ns)
            for j, server in enumerate((first, second)):
                decode, adds, releases = out[server]
                times["decode"][j].append(decode / 1e3)
                times["add"][j].extend(x / 1e3 for x in adds)
                times["release"][j].extend(x / 1e3 for x in releases)
    finally:
        gc.enable()
    return times


def summary(times: dict, labels: tuple) -> dict:
    """Per call kind: the medians and means of both, labelled, and the median per-step ratio
    second / first."""
    row = {}
    for name, (a, b) in times.items():
        row[name] = {f"{labels[0]}_median": round(statistics.median(a), 1),
                     f"{labels[1]}_median": round(statistics.median(b), 1),
                     f"{labels[0]}_mean": round(statistics.fmean(a), 1),
                     f"{labels[1]}_mean": round(statistics.fmean(b), 1),
                     "median_ratio": round(statistics.median(
                         y / x for x, y in zip(a, b, strict=True)), 3), "n": len(a)}
    return row
