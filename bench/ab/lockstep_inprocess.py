"""In-process A/B of the lockstep host rows of ``python -m hcache bench --host``: an older hcache
imported as ``hcache_base`` (see serving_inprocess.py) and this checkout's, runs alternated case
by case. ``HCACHE_BASE=/tmp/ab python bench/ab/lockstep_inprocess.py [PAIRS]`` prints one JSON
line per case: the median and mean step of each run.
"""

import json
import os
import sys

sys.path.insert(0, os.environ.get("HCACHE_BASE", "/tmp/ab"))
import hcache_base.bench.host as base  # noqa: E402

import hcache.bench.host as this  # noqa: E402


class Ctx:
    device, quick = "cpu", False


CASES = (("decode b256 len64", lambda m: m._context_decode(Ctx, 5, 256, 64)),
         ("decode b256 len960", lambda m: m._context_decode(Ctx, 5, 256, 960)),
         ("decode b16 len64", lambda m: m._context_decode(Ctx, 5, 16, 64)),
         ("add_request", lambda m: m._add_request(Ctx, 5)))

if __name__ == "__main__":
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for name, run in CASES:
        rows = [(run(base), run(this)) for _ in range(pairs)]
        print(json.dumps({"case": name, "base_us": [b["us"] for b, _ in rows],
                          "main_us": [a["us"] for _, a in rows],
                          "base_mean": [b["mean_us"] for b, _ in rows],
                          "main_mean": [a["mean_us"] for _, a in rows]}))
