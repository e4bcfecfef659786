"""Host overhead per decode step (``python -m hcache bench --host``; docs/design.md §8).

What an engine pays on the host, every step, for the caches' bookkeeping: no kernel can win
this back. Cases (batch 256 unless named otherwise):

* ``serving ...`` (the headline, :mod:`hcache.bench.host_serving`): a prefix-caching server's
  steady state, arrivals and finishes every step over a pool full of cached blocks, block 16 and
  256, at 1x and 4x the pool (thread CPU time);

* ``hybrid commit``: ``HybridCacheManager.commit_sequence_length(1)`` of a 52-layer
  Nemotron-H layout;
* ``continuous fetch+step``: ``ContinuousBatchingKVCacheManager.fetch`` + ``step`` of a decode
  batch;
* ``hybrid continuous fetch+step``: the same cycle on ``ContinuousBatchingHybridCacheManager``
  of the 52-layer Nemotron-H layout, and ``+ write_states``: with a state write of every Mamba
  layer (both kinds, one launch) in each step;
* ``context decode``: ``DynamicInferenceContext.extend_requests`` (one token per request) +
  ``commit_step``, block size 16, over two block periods after 1.5 untimed: the median step,
  the mean, and the worst step (where every request completes a block, or the steps after it
  that register those blocks); its scaling with the sequence length and the batch size;
* ``context verify``: speculative decoding on the same context, ``extend_requests`` of 4
  tokens per request + ``commit_draft`` (1..4 kept, spread over the batch: rejected blocks
  released, snapshots and the live-state scatter from ``ContextDraftStates``), against the
  same extensions committed whole by ``commit_step``;
* ``context add_request``: admitting one new request (prompt of 64 tokens) next to 255 others;
* ``mamba register``: ``MambaSlotAllocator.register_block_hashes_batch`` of 4 blocks, against
  the same call shaped as Megatron-LM's (the allocator forwards to its registry, which builds a
  dict of the pairs and updates its map with it, no validation); a plain inline dict update of
  the pairs is reported too (``plain_dict_us``);
* ``cpu kv_write``: the cpu backend's decode-size write of 64 sequences, against
  ``numpy.copyto`` of the same bytes into the same cache positions (``vs_copyto``; the rows of
  one token lie 64 KiB apart in an HND cache, which bounds both), and, for scale, against a
  copy of as many bytes between two packed buffers (``vs_packed_copyto``).

Noise. Every case runs ``rounds`` times; a step's time is the median over the rounds of that
step (so a periodic cost such as a block boundary stays, and a one-off preemption of the shared
machine does not), and the garbage collector is off while timing. Rows report the median step
(``us``), the mean (``mean_us``), the worst step (``worst_us``) and the goal of the issue that
set it (``goal_us``), all in µs.
"""

from __future__ import annotations

import gc
import statistics
import time

import numpy as np

from hcache.bench import host_serving
from hcache.config import HybridCacheConfig, KVLayerConfig
from hcache.contexts import ContextDraftStates, DynamicInferenceContext
from hcache.continuous.hybrid_manager import ContinuousBatchingHybridCacheManager
from hcache.continuous.manager import ContinuousBatchingKVCacheManager, KVCacheStaticParams
from hcache.ops import kv_write
from hcache.ops.tables import KVGroup
from hcache.slots.hybrid import HybridCacheManager

FAMILY = "host"

BATCH = 256
BLOCK = 16


def run(ctx) -> list[dict]:
    rounds = ctx.timer.repeat
    rows = host_serving.run(ctx)     # the headline: a prefix-caching server's steady state
    rows += [_hybrid_commit(ctx, rounds), _continuous_step(ctx, rounds)]
    rows += _hybrid_continuous_steps(ctx, rounds)
    for prompt in (64, 512, 960):
        rows.append(_context_decode(ctx, rounds, BATCH, prompt))
    for batch in (16, 64):
        rows.append(_context_decode(ctx, rounds, batch, 64))
    rows.append(_context_verify(ctx, rounds))
    rows += [_add_request(ctx, rounds), _mamba_register(ctx, rounds), _cpu_kv_write(rounds)]
    return rows


def _step_times(rounds: int, steps: int, setup, step) -> list[float]:
    """Per-step µs: ``setup()`` then ``steps`` calls of ``step(i)``, ``rounds`` times; each
    step's time is its median over the rounds. The garbage collector runs before ``setup`` and
    is off from then on: a full collection between the warm-up and the first timed step walks
    every object and leaves the caches cold for that step, a cost no serving step pays."""
    table = np.zeros((rounds, steps))
    for r in range(rounds):
        gc.collect()
        gc.disable()
        try:
            state = setup()
            for i in range(steps):
                t0 = time.perf_counter_ns()
                step(state, i)
                table[r, i] = (time.perf_counter_ns() - t0) / 1e3
        finally:
            gc.enable()
    return [float(x) for x in np.median(table, axis=0)]


def _row(case: str, times: list[float], goal: float | None, **extra) -> dict:
    return {"model": extra.pop("model", "-"), "case": case,
            "us": round(statistics.median(times), 2),
            "mean_us": round(statistics.fmean(times), 2), "worst_us": round(max(times), 2),
            "goal_us": goal, "steps": len(times), **extra}


def _nemotron_52(max_sequence_length: int) -> HybridCacheConfig:
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"   # 52 layers
    return HybridCacheConfig.from_hf_config(
        {"model_type": "nemotron_h", "hybrid_override_pattern": pattern,
         "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 8,
         "mamba_num_heads": 1, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 1,
         "conv_kernel": 4},
        max_batch_size=BATCH, max_sequence_length=max_sequence_length)


def _hybrid_commit(ctx, rounds: int) -> dict:
    cfg = _nemotron_52(4096)
    steps = 200

    def setup():
        cache = HybridCacheManager(cfg, device=ctx.device)
        cache.reset_for_new_sequences(np.zeros(BATCH, np.int32))
        return cache

    times = _step_times(rounds, steps, setup, lambda c, i: c.commit_sequence_length(1))
    return _row("hybrid commit(1) 52 layers", times, 10.0, model="nemotron-h 52L")


def _continuous_step(ctx, rounds: int) -> dict:
    steps = 200
    ones = np.ones(BATCH, np.int32)

    def setup():
        mgr = ContinuousBatchingKVCacheManager(
            "float16", KVCacheStaticParams(num_heads=1, head_size=8), max_batch_size=BATCH,
            max_seq_len=1024, num_layers=2, device=ctx.device)
        return mgr, mgr.claim(BATCH)

    def step(state, i):
        mgr, ids = state
        mgr.step(ones, mgr.fetch(ids))

    times = _step_times(rounds, steps, setup, step)
    return _row("continuous fetch+step", times, 25.0, batch=BATCH)


def _hybrid_continuous_steps(ctx, rounds: int) -> list[dict]:
    steps = 200
    ones = np.ones(BATCH, np.int32)
    cfg = _nemotron_52(1024)

    def setup():
        mgr = ContinuousBatchingHybridCacheManager(cfg, device=ctx.device)
        ids = mgr.claim(BATCH)
        xp = mgr.device.xp
        layers = [i for i, t in enumerate(cfg.layer_types) if t.has_mamba]
        rec = [xp.zeros((BATCH,) + mgr.get_recurrent_state(i).shape[1:],
                        mgr.get_recurrent_state(i).dtype) for i in layers]
        conv = [xp.zeros((BATCH,) + mgr.get_conv_state(i).shape[1:],
                         mgr.get_conv_state(i).dtype) for i in layers]
        return mgr, ids, rec, conv

    def step(state, i):
        mgr, ids = state[:2]
        mgr.step(ones, mgr.fetch(ids))

    def step_with_states(state, i):
        mgr, ids, rec, conv = state
        batch = mgr.fetch(ids)
        batch.write_states(None, rec, conv)
        mgr.step(ones, batch)

    return [_row("hybrid continuous fetch+step 52L", _step_times(rounds, steps, setup, step),
                 25.0, model="nemotron-h 52L", batch=BATCH),
            _row("hybrid continuous fetch+write_states+step 52L",
                 _step_times(rounds, steps, setup, step_with_states), None,
                 model="nemotron-h 52L", batch=BATCH)]


def _context(ctx, batch: int, prompt: int, room: int = 8):
    kv = [KVLayerConfig(1, 8)]
    blocks = batch * (prompt // BLOCK + room - 4) + 16
    context = DynamicInferenceContext(
        kv_layer_configs=kv, num_blocks=blocks, block_size_tokens=BLOCK,
        max_requests=batch, max_blocks_per_request=prompt // BLOCK + room, num_mamba_layers=4,
        ssm_states_shape=(2, 4, 4), conv_states_shape=(16, 4), mamba_cache_slots=5 * batch,
        device=ctx.device)
    # On cpu the caches come from calloc: a page is committed when first written. A serving
    # process wrote every state slot long before its steady state, so write them all once here
    # (reset zero-fills them) rather than time page faults inside the first boundary steps.
    context.reset()
    return context


def _admitted(ctx, batch: int, prompt: int, admit: int | None = None, room: int = 8):
    """A context for ``batch`` requests with ``admit`` (default all) of them admitted with
    random ``prompt``-token prompts and their prefill committed."""
    context = _context(ctx, batch, prompt, room)
    rng = np.random.default_rng(prompt)
    ids = list(range(batch if admit is None else admit))
    for rid in ids:
        context.add_request(rid, rng.integers(0, 50_000, prompt))
    context.commit_step()
    return context, ids


def _context_decode(ctx, rounds: int, batch: int, prompt: int) -> dict:
    steps = 2 * BLOCK       # two whole block periods, each with its boundary and catch-up
    tokens = np.arange(batch, dtype=np.int64) + 7

    def step(state, i):
        context, ids = state
        context.extend_requests(ids, tokens)
        context.commit_step()

    def warmed_up():
        # A block period and a half untimed: the first boundary after admission pays one-off
        # costs (lazily built views, hash maps growing to their working size), and the timed
        # window (any two whole periods) starts at a quiet step, as the first steps after the
        # harness's garbage collection run cold.
        state = _admitted(ctx, batch, prompt)
        for i in range(BLOCK + BLOCK // 2):
            step(state, i)
        return state

    times = _step_times(rounds, steps, warmed_up, step)
    goal = 100.0 if batch == BATCH and prompt == 64 else None
    return _row(f"context decode b{batch} len{prompt}", times, goal, batch=batch,
                prompt=prompt, worst_goal_us=300.0 if goal else None)


def _context_verify(ctx, rounds: int, batch: int = BATCH, written: int = 4) -> dict:
    """Speculative decoding on the context: ``extend_requests`` of ``written`` tokens per
    request (the bonus token and the drafts) + ``commit_draft`` of accepted counts that cycle
    through 0..written-1 over the batch (kept 1..written); baseline (``extend_commit_us``,
    ``vs_extend_commit``): the same extensions committed whole by ``commit_step``."""
    steps = 2 * BLOCK
    tokens = np.tile(np.arange(written, dtype=np.int64) + 7, (batch, 1))

    def verify(state, i):
        context, ids, drafts = state
        context.extend_requests(ids, tokens)
        context.commit_draft(ids, (np.arange(batch) + i) % written, draft_states=drafts,
                             bonus_token=True)

    def extend(state, i):
        context, ids, _ = state
        context.extend_requests(ids, tokens)
        context.commit_step()

    def warmed_up(step):
        def setup():
            context, ids = _admitted(ctx, batch, 64, room=20)
            state = (context, ids, ContextDraftStates(context, written))
            for i in range(BLOCK // 2):
                step(state, i)
            return state
        return setup

    times = _step_times(rounds, steps, warmed_up(verify), verify)
    base = statistics.median(_step_times(rounds, steps, warmed_up(extend), extend))
    return _row(f"context verify b{batch} k{written}", times, None, batch=batch,
                extend_commit_us=round(base, 2),
                vs_extend_commit=round(statistics.median(times) / base, 2))


def _add_request(ctx, rounds: int) -> dict:
    steps = 16

    def setup():
        context, ids = _admitted(ctx, BATCH, 64, BATCH - steps)
        return context, np.random.default_rng(1)

    def step(state, i):
        context, rng = state
        context.add_request(10_000 + i, rng.integers(0, 50_000, 64))

    times = _step_times(rounds, steps, setup, step)
    return _row("context add_request", times, 100.0, batch=BATCH)


def _mamba_register(ctx, rounds: int) -> dict:
    steps = 64
    n = 4
    context, ids = _admitted(ctx, 64, 4 * BLOCK)
    alloc = context.mamba_slot_allocator
    kv = context.kv_block_allocator
    pairs = []
    for rid in ids:
        for b in context.block_ids(rid)[:n].tolist():
            pairs.append((b, int(kv.block_hashes[b])))
    chunks = [pairs[i:i + n] for i in range(0, len(pairs), n)][:steps]
    for chunk in chunks:
        alloc.allocate_slots_batch([b for b, _ in chunk])
    calls = [([b for b, _ in c], [h for _, h in c]) for c in chunks]
    megatron, table = _MegatronAllocator(), {}

    def plain(block_ids, hashes):
        for b, h in zip(block_ids, hashes):
            if h > 0:
                table[h] = b

    # A call lasts about a microsecond, close to the timer's resolution: time passes of all
    # the calls, the three contenders interleaved within each round (re-registering a pair is
    # the same work as the first time), and report per-call medians over the rounds.
    contenders = {"ours": alloc.register_block_hashes_batch,
                  "megatron": megatron.register_block_hashes_batch, "plain": plain}
    per_call: dict = {name: [] for name in contenders}
    for _ in range(max(rounds, 5) * 4):
        for name, call in contenders.items():
            gc.disable()
            try:
                t0 = time.perf_counter_ns()
                for block_ids, hashes in calls:
                    call(block_ids, hashes)
                per_call[name].append((time.perf_counter_ns() - t0) / 1e3 / len(calls))
            finally:
                gc.enable()
    base = statistics.median(per_call["megatron"])
    return _row(f"mamba register {n} blocks", per_call["ours"], round(base, 3),
                baseline="Megatron-LM's call: allocator method -> registry method -> dict "
                         "comprehension + dict.update, no checks",
                vs_megatron=round(statistics.median(per_call["ours"]) / base, 3),
                plain_dict_us=round(statistics.median(per_call["plain"]), 3))


class _MegatronRegistry:
    """The shape of Megatron-LM's ``PrefixCacheRegistry.register_mamba`` (no checks)."""

    def __init__(self):
        self.mamba_hash_to_block_id = {}

    def register_mamba(self, block_ids, hashes):
        updates = {h: bid for bid, h in zip(block_ids, hashes) if h > 0}
        if updates:
            self.mamba_hash_to_block_id.update(updates)


class _MegatronAllocator:
    """The shape of Megatron-LM's ``MambaSlotAllocator.register_block_hashes_batch``: one call
    forwarded to the registry."""

    def __init__(self):
        self.registry = _MegatronRegistry()

    def register_block_hashes_batch(self, block_ids, hashes):
        if self.registry is not None:       # as Megatron-LM's: the registry is optional
            self.registry.register_mamba(block_ids, hashes)


def _cpu_kv_write(rounds: int) -> dict:
    batch, heads, dim, seq = 64, 8, 128, 256
    layers = [np.empty((batch, 2, heads, seq, dim), np.float16) for _ in range(4)]
    for layer in layers:
        layer.fill(0)          # touch every page now, not inside a timed step
    group = KVGroup(layers)
    k = np.ones((batch, heads, dim), np.float16)
    lengths = np.full(batch, 10, np.int32)
    steps = 64

    def write(state, i):
        kv_write(group, k, k, layers=i % 4, uniform_tokens=1, batch=batch,
                 cache_lengths=lengths)

    def copy_same_bytes(state, i):
        # numpy.copyto of the same bytes from the same source to the same places: each
        # (sequence, head) row lands 64 KiB from the next, which is what bounds this write.
        layer = layers[i % 4]
        np.copyto(layer[:, 0, :, 10, :], k)
        np.copyto(layer[:, 1, :, 10, :], k)

    times = _step_times(rounds, steps, lambda: None, write)
    copy = _step_times(rounds, steps, lambda: None, copy_same_bytes)
    dst = np.empty((2, batch, heads, dim), np.float16)
    src = np.ones_like(dst)
    packed = _step_times(rounds, steps, lambda: None, lambda s, i: np.copyto(dst, src))
    return _row("cpu kv_write decode b64", times, None, model="8x128 fp16",
                vs_copyto=round(statistics.median(copy) / statistics.median(times), 3),
                goal_vs_copyto=0.5,
                vs_packed_copyto=round(statistics.median(packed) / statistics.median(times), 3))
