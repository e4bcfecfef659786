r"""In-process A/B of the lockstep context decode row (``context decode b256 lenP`` of
``python -m hcache bench --host``), steps interleaved: an older hcache imported as
``hcache_base`` (see serving_inprocess.py) and this checkout's run the same admitted batch, one
step each in alternating order, thread CPU time. Whole-run alternation
(lockstep_inprocess.py) leaves the machine's drift between the runs; this one cancels it.
``HCACHE_BASE=/tmp/ab python bench/ab/lockstep_steps_inprocess.py [PROMPT] [ROUNDS]`` prints one
JSON line: medians and means of each and the median per-step ratio (this / base).
"""

import gc
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.environ.get("HCACHE_BASE", "/tmp/ab"))
import hcache_base.bench.host as base  # noqa: E402

import hcache.bench.host as this  # noqa: E402


class Ctx:
    device, quick = "cpu", False


def _step(state, tokens) -> int:
    context, ids = state
    t0 = time.thread_time_ns()
    context.extend_requests(ids, tokens)
    context.commit_step()
    return time.thread_time_ns() - t0


def main(prompt: int, rounds: int, batch: int = 256) -> dict:
    tokens = np.arange(batch, dtype=np.int64) + 7
    times = ([], [])
    for r in range(rounds):      # a fresh batch each round: the pool holds two block periods
        states = [m._admitted(Ctx, batch, prompt) for m in (base, this)]
        for _ in range(this.BLOCK + this.BLOCK // 2):       # as the bench's warm-up
            for state in states:
                _step(state, tokens)
        gc.collect()
        gc.disable()
        for i in range(2 * this.BLOCK):
            for j in ((0, 1) if (i + r) % 2 else (1, 0)):
                times[j].append(_step(states[j], tokens) / 1e3)
        gc.enable()
    b, a = times
    return {"case": f"context decode b{batch} len{prompt}", "steps": len(a),
            "base_median": round(statistics.median(b), 1),
            "main_median": round(statistics.median(a), 1),
            "base_mean": round(statistics.fmean(b), 1), "main_mean": round(statistics.fmean(a), 1),
            "median_ratio": round(statistics.median(y / x for x, y in zip(b, a, strict=True)), 3)}


if __name__ == "__main__":
    args = [int(x) for x in sys.argv[1:]]
    print(json.dumps(main(args[0] if args else 64, args[1] if len(args) > 1 else 6)))
