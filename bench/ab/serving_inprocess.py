r"""In-process A/B of the serving loop (issue 24): an older hcache imported as ``hcache_base``
beside this checkout's, the same seeded workload (hcache/bench/host_serving.py), steps
interleaved with alternating order, thread CPU time per call. Whole-bench runs on a shared
machine move 1.5-2x between runs; interleaving in one process cancels that drift.

Make the base package once, e.g. for commit C::

    git worktree add /tmp/base C && mkdir /tmp/ab && cp -r /tmp/base/hcache /tmp/ab/hcache_base
    grep -rl "hcache\." /tmp/ab/hcache_base | xargs sed -i -E \
        -e 's/\b(from|import) hcache\./\1 hcache_base./g' \
        -e 's/\bfrom hcache import/from hcache_base import/g'

then ``HCACHE_BASE=/tmp/ab python bench/ab/serving_inprocess.py BLOCK SCALE [STEPS]`` prints one
JSON line: medians, means and the median per-step ratio (this checkout / base) of the decode
step, ``add_request`` and ``release``.
"""

import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.environ.get("HCACHE_BASE", "/tmp/ab"))
import hcache_base.bench.host_serving as base  # noqa: E402

import hcache.bench.host_serving as this  # noqa: E402


class Ctx:
    device, quick = "cpu", True


def main(block: int, scale: int, steps: int) -> dict:
    old, new = (m._Server(Ctx, block, scale, seed=block) for m in (base, this))
    for _ in range(300):
        old.step()
        new.step()
    times = {k: ([], []) for k in ("decode", "add", "release")}
    gc.collect()
    gc.disable()
    for i in range(steps):
        out = {}
        for server in ((new, old) if i % 2 else (old, new)):
            out[server] = server.step(time.thread_time_ns)
        for j, server in enumerate((old, new)):
            decode, adds, releases = out[server]
            times["decode"][j].append(decode / 1e3)
            times["add"][j].extend(x / 1e3 for x in adds)
            times["release"][j].extend(x / 1e3 for x in releases)
    gc.enable()
    row = {"block": block, "scale": scale, "steps": steps}
    for name, (b, a) in times.items():
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        row[name] = {"base_median": round(statistics.median(b), 1),
                     "main_median": round(statistics.median(a), 1),
                     "base_mean": round(statistics.fmean(b), 1),
                     "main_mean": round(statistics.fmean(a), 1),
                     "median_ratio": round(statistics.median(ratios), 3), "n": len(a)}
    return row


if __name__ == "__main__":
    args = [int(x) for x in sys.argv[1:]]
    print(json.dumps(main(args[0], args[1], args[2] if len(args) > 2 else 200)))
