r"""In-process comparison of the serving loop at two pool sizes (issue 24: the step cost must not
depend on the pool): this checkout's ``hcache.bench.host_serving`` at pool x1 and at pool xK,
the same seeded workload, steps interleaved with alternating order, thread CPU time per call.
``python bench/ab/pool_scale_inprocess.py BLOCK [K] [STEPS]`` prints one JSON line: medians and
means of each and the median per-step ratio xK / x1 of the decode step, ``add_request`` and
``release``.
"""

import gc
import json
import statistics
import sys
import time

import hcache.bench.host_serving as serving


class Ctx:
    device, quick = "cpu", True


def main(block: int, scale: int, steps: int) -> dict:
    small, large = (serving._Server(Ctx, block, s, seed=block) for s in (1, scale))
    for _ in range(300):
        small.step()
        large.step()
    times = {k: ([], []) for k in ("decode", "add", "release")}
    gc.collect()
    gc.disable()
    for i in range(steps):
        out = {}
        for server in ((large, small) if i % 2 else (small, large)):
            out[server] = server.step(time.thread_time_ns)
        for j, server in enumerate((small, large)):
            decode, adds, releases = out[server]
            times["decode"][j].append(decode / 1e3)
            times["add"][j].extend(x / 1e3 for x in adds)
            times["release"][j].extend(x / 1e3 for x in releases)
    gc.enable()
    row = {"block": block, "scale": scale, "steps": steps,
           "pool_blocks": [s.context.kv_block_allocator.num_blocks for s in (small, large)]}
    for name, (a, b) in times.items():
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        row[name] = {"x1_median": round(statistics.median(a), 1),
                     f"x{scale}_median": round(statistics.median(b), 1),
                     "x1_mean": round(statistics.fmean(a), 1),
                     f"x{scale}_mean": round(statistics.fmean(b), 1),
                     "median_ratio": round(statistics.median(ratios), 3), "n": len(a)}
    return row


if __name__ == "__main__":
    args = [int(x) for x in sys.argv[1:]]
    print(json.dumps(main(args[0], args[1] if len(args) > 1 else 4,
                          args[2] if len(args) > 2 else 200)))
