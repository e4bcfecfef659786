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

import json
import os
import sys

sys.path.insert(0, os.environ.get("HCACHE_BASE", "/tmp/ab"))
import hcache_base.bench.host_serving as base  # noqa: E402
from interleaved import interleaved_steps, summary  # noqa: E402

import hcache.bench.host_serving as this  # noqa: E402


class Ctx:
    device, quick = "cpu", True


def main(block: int, scale: int, steps: int) -> dict:
    old, new = (m._Server(Ctx, block, scale, seed=block) for m in (base, this))
    times = interleaved_steps(old, new, steps)
    return {"block": block, "scale": scale, "steps": steps, **summary(times, ("base", "main"))}


if __name__ == "__main__":
    args = [int(x) for x in sys.argv[1:]]
    print(json.dumps(main(args[0], args[1], args[2] if len(args) > 2 else 200)))
