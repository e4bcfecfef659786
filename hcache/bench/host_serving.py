"""Host overhead of a prefix-caching server's steady state (the headline rows of
``python -m hcache bench --host``; docs/design.md §8, issue 24).

Workload (batch 256, 4 Mamba layers of small states, one tiny attention layer): prompts uniform
in 32..1536 tokens, half of them opening with one shared 256-token system prefix (the whole
prompt is that prefix's head when shorter); outputs uniform in 32..768 tokens; every step the
requests that produced their output are released and as many new ones admitted, then the others
decode one token (``extend_requests`` + ``commit_step``). Before the timed window the pool is
filled with cached blocks (filler requests admitted and released) and the loop runs untimed until
its lengths are mixed, so the timed steps allocate from a full pool: ``evicting_share`` is the
share of timed steps whose allocations evicted. ``pool`` is the number of KV blocks, enough for
every row at full length (x1) or four times that (x4): the step cost must not depend on it.

Times are thread CPU time (``time.thread_time_ns``); every run starts fresh from the same seed,
so step ``i`` is the same work in every run, and a step's time is its median over the runs. Rows:
``serving decode`` (one step: ``us`` median, ``mean_us``, ``worst_us``), ``serving add_request``
(per admitted request, prefix match and allocation included) and ``serving release`` (per
released request).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import numpy as np

from hcache.config import KVLayerConfig
from hcache.contexts import DynamicInferenceContext

BATCH = 256
PROMPT = (32, 1536)
OUTPUT = (32, 768)
SYSTEM_PREFIX = 256
WARM_STEPS = 300
TIMED_STEPS = 200
DECODE_GOALS = (150.0, 250.0)     # median, mean (µs)
ADD_GOAL = 200.0
ROUNDS = 5          # fresh runs of the full bench; a step's time is its median over them
CALL_STEPS = 20     # steps after the last run whose Python-level calls are counted


def run(ctx) -> list[dict]:
    """The serving rows; ``--quick``: one run of fewer steps, pool x1. Otherwise
    :data:`ROUNDS` fresh runs (at most; the timer's repeats where fewer), pool x1 and x4: a
    run is hundreds of steps, so a GPU timer's 200 repeats would take most of an hour (the
    GPU run of 2026-11-27 ran its quick bench at full length: quick was guessed from the
    repeats)."""
    rounds, scales = ((1, (1,)) if ctx.quick else
                      (min(ctx.timer.repeat, ROUNDS), (1, 4)))
    steps = (40, 20) if ctx.quick else (WARM_STEPS, TIMED_STEPS)
    rows = []
    for block in (16, 256):
        for scale in scales:
            rows += _serving(ctx, rounds, block, scale, *steps)
    return rows


class _Workload:
    """The request stream of one run: a seeded generator of prompts and output lengths."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.system = self.rng.integers(0, 50_000, SYSTEM_PREFIX)
        self.next_id = 0

    def request(self):
        n = int(self.rng.integers(PROMPT[0], PROMPT[1] + 1))
        prompt = self.rng.integers(0, 50_000, n)
        if self.rng.random() < 0.5:
            k = min(n, SYSTEM_PREFIX)
            prompt[:k] = self.system[:k]
        out = int(self.rng.integers(OUTPUT[0], OUTPUT[1] + 1))
        self.next_id += 1
        return self.next_id, prompt, out


def _context(ctx, block: int, scale: int) -> DynamicInferenceContext:
    per_request = -(-(PROMPT[1] + OUTPUT[1]) // block) + 1
    context = DynamicInferenceContext(
        kv_layer_configs=[KVLayerConfig(1, 8)], num_blocks=scale * BATCH * per_request + 16,
        block_size_tokens=block, max_requests=BATCH, max_blocks_per_request=per_request,
        num_mamba_layers=4, ssm_states_shape=(2, 4, 4), conv_states_shape=(16, 4),
        mamba_cache_slots=5 * BATCH, device=ctx.device)
    context.reset()     # touch every page of the caches now (see host._context)
    return context


def _fill(context, rng) -> None:
    """Fill the pool with cached blocks of filler prompts that nothing will match."""
    kv = context.kv_block_allocator
    longest = context.max_sequence_length - OUTPUT[1]
    while kv.num_free_blocks:
        ids = [("filler", i) for i in range(BATCH)]
        added = []
        for rid in ids:
            if kv.num_free_blocks < -(-longest // context.block_size_tokens):
                break
            context.add_request(rid, rng.integers(0, 50_000, longest))
            added.append(rid)
        context.commit_step()
        context.release_requests(added)
        if len(added) < BATCH:
            break


class _Server:
    """One run of the serving loop over a fresh context."""

    def __init__(self, ctx, block: int, scale: int, seed: int):
        self.context = _context(ctx, block, scale)
        self.load = _Workload(seed)
        self.evicted = 0
        self.context.kv_block_allocator.add_blocks_deregistered_observer(self._count)
        _fill(self.context, np.random.default_rng(seed + 1))
        self.left: dict = {}       # request id -> output tokens still to produce
        self.fresh: set = set()    # admitted this step: their prompt is scheduled
        self.token = 7

    def _count(self, block_ids, hashes) -> None:
        self.evicted += len(block_ids)

    def step(self, clock=None) -> tuple[int, list, list]:
        """One serving step; returns (decode ns, add_request ns list, release ns list)."""
        context, clock = self.context, clock or (lambda: 0)
        done = [rid for rid, k in self.left.items() if k == 0]
        releases = []
        for rid in done:
            t0 = clock()
            context.release_requests([rid])
            releases.append(clock() - t0)
            del self.left[rid]
        adds = []
        self.fresh = set()
        while len(self.left) < BATCH:
            rid, prompt, out = self.load.request()
            t0 = clock()
            context.add_request(rid, prompt)
            adds.append(clock() - t0)
            self.left[rid] = out
            self.fresh.add(rid)
        ids = [rid for rid in self.left if rid not in self.fresh]
        self.token = (self.token * 31 + 11) % 50_000
        tokens = np.full(len(ids), self.token, np.int64)
        t0 = clock()
        if ids:
            context.extend_requests(ids, tokens)
        context.commit_step()
        decode = clock() - t0
        for rid in ids:
            self.left[rid] -= 1
        for rid in self.fresh:
            self.left[rid] -= 1     # the prompt step samples the first output token
        return decode, adds, releases


def _serving(ctx, rounds: int, block: int, scale: int, warm_steps: int = WARM_STEPS,
             timed_steps: int = TIMED_STEPS) -> list[dict]:
    decode = np.zeros((rounds, timed_steps))
    adds, releases, evicting, pools = [], [], [], 0
    clock = time.thread_time_ns
    for r in range(rounds):
        gc.collect()
        gc.disable()
        try:
            server = _Server(ctx, block, scale, seed=block)
            pools = server.context.kv_block_allocator.num_blocks
            for _ in range(warm_steps):
                server.step()
            steps_evicting = 0
            for i in range(timed_steps):
                before = server.evicted
                ns, add, rel = server.step(clock)
                decode[r, i] = ns / 1e3
                steps_evicting += server.evicted > before
                adds += [x / 1e3 for x in add]
                releases += [x / 1e3 for x in rel]
            evicting.append(steps_evicting / timed_steps)
        finally:
            gc.enable()
    calls = _calls_per_step(server, 5 if timed_steps < TIMED_STEPS else CALL_STEPS)
    times = [float(x) for x in np.median(decode, axis=0)]
    common = {"model": "4 mamba layers", "batch": BATCH, "block": block, "pool_blocks": pools,
              "pool_scale": scale}
    rows = [
        {**common, "case": f"serving decode block{block} pool x{scale}",
         "us": round(statistics.median(times), 2), "mean_us": round(statistics.fmean(times), 2),
         "worst_us": round(max(times), 2), "goal_us": DECODE_GOALS[0],
         "mean_goal_us": DECODE_GOALS[1], "steps": timed_steps, "rounds": rounds,
         "evicting_share": round(statistics.median(evicting), 3), "clock": "thread_time_ns",
         "python_calls": calls["decode"]},
    ]
    for name, times, goal in (("add_request", adds, ADD_GOAL), ("release", releases, None)):
        if times:       # per admitted / released request, over every run
            rows.append({**common, "case": f"serving {name} block{block} pool x{scale}",
                         "us": round(statistics.median(times), 2),
                         "mean_us": round(statistics.fmean(times), 2),
                         "worst_us": round(max(times), 2), "goal_us": goal, "steps": len(times),
                         "clock": "thread_time_ns", "python_calls": calls[name]})
    return rows


class _CallCounter:
    """A clock for :meth:`_Server.step` that reads the Python-level calls made so far
    (functions and C functions, as ``sys.setprofile`` sees them) while :attr:`profile` is
    installed: a count that the shared machine's speed does not move."""

    def __init__(self):
        self.calls = 0

    def __call__(self) -> int:
        return self.calls - 1       # this call's own event is not the measured code's

    def profile(self, frame, event, arg) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1


def _calls_per_step(server, steps: int) -> dict:
    """Median Python-level calls of a decode step, an ``add_request`` and a
    ``release_requests`` over ``steps`` more steps of ``server``."""
    counter, counts = _CallCounter(), {"decode": [], "add_request": [], "release": []}
    sys.setprofile(counter.profile)
    try:
        for _ in range(steps):
            decode, adds, releases = server.step(counter)
            counts["decode"].append(decode)
            counts["add_request"] += adds
            counts["release"] += releases
    finally:
        sys.setprofile(None)
    return {k: int(statistics.median(v)) if v else None for k, v in counts.items()}
