r"""In-process comparison of the serving loop at two pool sizes (issue 24: the step cost must not
depend on the pool): this checkout's ``hcache.bench.host_serving`` at pool x1 and at pool xK,
the same seeded workload, steps interleaved with alternating order, thread CPU time per call.
``python bench/ab/pool_scale_inprocess.py BLOCK [K] [STEPS]`` prints one JSON line: medians and
means of each and the median per-step ratio xK / x1 of the decode step, ``add_request`` and
``release``.
"""

import json
import sys

from interleaved import interleaved_steps, summary

import hcache.bench.host_serving as serving


class Ctx:
    device, quick = "cpu", True


def main(block: int, scale: int, steps: int) -> dict:
    small, large = (serving._Server(Ctx, block, s, seed=block) for s in (1, scale))
    times = interleaved_steps(small, large, steps)
    return {"block": block, "scale": scale, "steps": steps,
            "pool_blocks": [s.context.kv_block_allocator.num_blocks for s in (small, large)],
            **summary(times, ("x1", f"x{scale}"))}


if __name__ == "__main__":
    args = [int(x) for x in sys.argv[1:]]
    print(json.dumps(main(args[0], args[1] if len(args) > 1 else 4,
                          args[2] if len(args) > 2 else 200)))
