"""``python -m hcache demo`` (docs/design.md §7): a small hybrid model served by hcache, checked
exactly.

A random-weight Nemotron-H-style model (:mod:`hcache.demo.model`; its math runs in NumPy on the
host, its caches live on the device, bound to it by :mod:`hcache.demo.adapters`) generates
greedily in three parts:

1. :class:`~hcache.slots.hybrid.HybridCacheManager`: a shared system prompt prefilled in
   slot 0 and captured (KV, recurrent and conv states), restored into every slot of a batch,
   ragged prefill, batch decode, and eviction of finished requests by ``compact_batch`` with
   "fill the holes from the end" mappings (non-monotone: hcache takes any injective mapping).
2. :class:`~hcache.continuous.hybrid_manager.ContinuousBatchingHybridCacheManager`: requests
   admitted while others decode (claim -> fetch / write_kv / write_states / step -> release),
   prompts and decode tokens in one batch; each sequence's block holds its K/V of every attention
   layer and its recurrent and conv states of every Mamba layer, on the device.
3. :class:`~hcache.contexts.DynamicInferenceContext`: prefix caching over a shared system
   prompt and a multi-turn follow-up, against the same workload with prefix caching off.

Every generated token, and the logits it came from, must equal (bit for bit) an uncached
reference run that recomputes each request from scratch with no hcache object
(:func:`hcache.demo.model.reference_logits`).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from ..config.caches import HybridCacheConfig
from ..contexts import DynamicInferenceContext
from ..continuous.hybrid_manager import ContinuousBatchingHybridCacheManager
from ..runtime.device import resolve_device
from ..slots.hybrid import HybridCacheManager
from .adapters import HybridBlockCache, PagedCache, SlotCache, host
from .model import TinyHybridModel, reference_logits

__all__ = ["run_demo", "NEMOTRON_H_CONFIG"]

F32 = np.float32
NEMOTRON_H_CONFIG = {
    "model_type": "nemotron_h", "hybrid_override_pattern": "M*M-*M", "hidden_size": 32,
    "vocab_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 4, "n_groups": 1,
    "conv_kernel": 4}


def _nbytes(arrays) -> int:
    return sum(int(a.nbytes) for a in arrays)


class _Checker:
    """Compares generated tokens and their logits with the uncached reference run."""

    def __init__(self, model):
        self.model, self.tokens, self.problems = model, 0, []

    def check(self, part, name, context, generated, logits):
        ref = reference_logits(self.model, list(context) + list(generated[:-1]))
        ref = ref[len(context) - 1:]
        self.tokens += len(generated)
        for j, (tok, row) in enumerate(zip(generated, logits, strict=True)):
            want = int(np.argmax(ref[j]))
            if tok != want or row.tobytes() != ref[j].tobytes():
                diff = float(np.abs(row - ref[j]).max())
                what = (f"is {tok}, the uncached reference gives {want}" if tok != want else
                        f"({tok}) has logits off the uncached reference by up to {diff:.3g}")
                self.fail(f"MISMATCH {part} {name}: generated token {j} {what}")
                return

    def fail(self, message):
        self.problems.append(message)
        print(f"  {message}")


# --- part 1: HybridCacheManager --------------------------------------------------------------

def _fill_holes(done):
    """Mapping that keeps survivors below the new batch in place and moves the ones above it
    into the holes (usually non-monotone)."""
    new = done.count(False)
    holes = [i for i in range(new) if done[i]]
    movers = [i for i in range(new, len(done)) if not done[i]]
    mapping = [-1 if d else i for i, d in enumerate(done)]
    for src, dst in zip(movers, holes, strict=True):
        mapping[src] = dst
    return mapping


def _part1(model, config, device, check, rng):
    print("Part 1 - HybridCacheManager: captured system prompt, batch decode, eviction")
    mgr = HybridCacheManager(config, device=device)
    system = rng.integers(0, model.vocab_size, 12).tolist()
    mgr.reset_for_new_sequences([0])
    model.forward([system], [0], SlotCache(mgr, model, 1))
    mgr.commit_sequence_length(len(system))
    kv = mgr.capture_kv_cache(0, len(system))
    rec, conv = mgr.capture_recurrent_states(0), mgr.capture_conv_states(0)
    print(f"  system prompt: {len(system)} tokens prefilled in slot 0; captured KV "
          f"{_nbytes(kv)} B ({len(kv)} layers), recurrent {_nbytes(rec)} B + conv "
          f"{_nbytes(conv)} B ({len(rec)} Mamba layers)")
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in (5, 3, 7, 4)]
    budgets, n = [7, 2, 5, 4], len(prompts)
    for b in range(n):
        mgr.restore_kv_cache(kv, b)
        mgr.restore_mamba_states(rec, conv, b)
    mgr.reset_for_new_sequences([len(system)] * n)
    logits = model.forward(prompts, [len(system)] * n, SlotCache(mgr, model, n))
    mgr.commit_sequence_length(np.array([len(p) for p in prompts]))
    lengths = [len(system) + len(p) for p in prompts]
    print(f"  restored into slots 0..{n - 1}, reset_for_new_sequences([{len(system)}] * {n}), "
          f"prefilled {'/'.join(str(len(p)) for p in prompts)} own tokens: lengths {lengths}")
    slots, gen, rows = list(range(n)), [[] for _ in range(n)], [[] for _ in range(n)]
    steps = compactions = non_monotone = 0
    while True:
        for s, r in enumerate(slots):
            gen[r].append(int(np.argmax(logits[s][-1])))
            rows[r].append(logits[s][-1])
        done = [len(gen[r]) == budgets[r] for r in slots]
        if any(done):
            mapping, old = _fill_holes(done), len(slots)
            mgr.compact_batch(mapping, old, done.count(False))
            moves = [f"r{slots[i]} slot {i}->{j}" for i, j in enumerate(mapping)
                     if j not in (i, -1)]
            kept = [j for j in mapping if j >= 0]
            compactions += 1
            non_monotone += kept != sorted(kept)
            new_slots, new_lengths = [0] * len(kept), [0] * len(kept)
            for i, j in enumerate(mapping):
                if j >= 0:
                    new_slots[j], new_lengths[j] = slots[i], lengths[i]
            finished = ", ".join(f"r{slots[i]}" for i in range(old) if done[i])
            slots, lengths = new_slots, new_lengths
            device_lengths = host(mgr.get_kv_cache_lengths()).tolist()
            print(f"  step {steps}: {finished} finished -> compact_batch({mapping}, {old}, "
                  f"{len(slots)}){': ' + ', '.join(moves) if moves else ''}; "
                  f"lengths {device_lengths}")
            if device_lengths != lengths:
                check.fail(f"MISMATCH part 1: device lengths {device_lengths}, expected {lengths}")
        if not slots:
            break
        logits = model.forward([[gen[r][-1]] for r in slots], lengths,
                               SlotCache(mgr, model, len(slots)))
        mgr.commit_sequence_length(1)
        lengths = [k + 1 for k in lengths]
        steps += 1
    for r in range(n):
        check.check("part 1", f"r{r}", system + prompts[r], gen[r], rows[r])
    print(f"  {n} requests, {sum(map(len, gen))} tokens in {steps} decode steps; {compactions} "
          f"compactions ({non_monotone} non-monotone)")


# --- part 2: ContinuousBatchingHybridCacheManager ------------------------------------------

def _part2(model, device, check, rng):
    print("Part 2 - ContinuousBatchingHybridCacheManager: requests admitted while others decode\n"
          "  (one block per sequence: its K/V of every attention layer and its recurrent and\n"
          "  conv states of every Mamba layer, in device pools)")
    mgr = ContinuousBatchingHybridCacheManager.from_hf_config(
        NEMOTRON_H_CONFIG, max_batch_size=3, max_seq_len=48, kv_dtype="float32", device=device)
    queue = deque((f"q{i}", rng.integers(0, model.vocab_size, p).tolist(), g)
                  for i, (p, g) in enumerate(zip((6, 9, 4, 7, 5, 8), (5, 2, 6, 3, 4, 3))))
    n_req, live, it, tokens, reused = len(queue), {}, 0, 0, 0
    used = set()
    while queue or live:
        admitted = []
        while queue and mgr.can_claim(1):
            name, prompt, budget = queue.popleft()
            sid = mgr.claim(1)[0]      # its states are zeroed on the device
            block = mgr.block_of(sid)
            reused += block in used
            used.add(block)
            live[sid] = dict(name=name, prompt=prompt, budget=budget, pending=prompt, gen=[],
                             rows=[])
            admitted.append(f"{name}->seq {sid} (block {block})")
        ids = list(live)
        coll = mgr.fetch(ids)
        chunks = [live[s]["pending"] for s in ids]
        logits = model.forward(chunks, list(coll.host_cache_lengths),
                               HybridBlockCache(coll, model))
        mgr.step([len(c) for c in chunks], coll)
        released = []
        for sid, out in zip(ids, logits, strict=True):
            r = live[sid]
            r["gen"].append(int(np.argmax(out[-1])))
            r["rows"].append(out[-1])
            r["pending"] = r["gen"][-1:]
            if len(r["gen"]) == r["budget"]:
                released.append(f"{r['name']} (seq {sid}, block {mgr.block_of(sid)})")
                mgr.release(sid)
                del live[sid]
                tokens += len(r["gen"])
                check.check("part 2", r["name"], r["prompt"], r["gen"], r["rows"])
        if admitted or released:
            what = ["claim " + ", ".join(admitted)] if admitted else []
            what.append(f"fetch/write_kv/write_states/step {len(ids)} "
                        f"row{'s' * (len(ids) > 1)} with valid lengths {[len(c) for c in chunks]}")
            what += ["release " + ", ".join(released)] if released else []
            print(f"  batch {it}: " + "; ".join(what))
        it += 1
    report = mgr.memory_report()
    print(f"  {n_req} requests, {tokens} tokens in {it} batches through {mgr.num_blocks} blocks "
          f"of {report['bytes_per_block']} B (K/V {report['kv_cache'] // mgr.num_blocks} B, "
          f"states {(report['recurrent'] + report['conv']) // mgr.num_blocks} B); {reused} "
          f"claims reused a released block's state slots; {mgr.num_free_blocks} free at the end")


# --- part 3: prefix caching with DynamicInferenceContext ------------------------------------

def _serve(ctx, model, waves, check, part):
    results = {}
    for wave in waves:
        prompts = {rid: p(results) if callable(p) else p for rid, p, _ in wave}
        budgets = {rid: g for rid, _, g in wave}
        gen, rows = {rid: [] for rid in budgets}, {rid: [] for rid in budgets}
        plans = [ctx.add_request(rid, prompts[rid]) for rid in budgets]
        while plans:
            logits = model.forward([p.tokens.tolist() for p in plans], [p.start for p in plans],
                                   PagedCache(ctx, plans))
            ctx.commit_step()
            for p, out in zip(plans, logits, strict=True):
                gen[p.request_id].append(int(np.argmax(out[-1])))
                rows[p.request_id].append(out[-1])
            plans = [ctx.extend_request(rid, gen[rid][-1:]) for rid in budgets
                     if len(gen[rid]) < budgets[rid]]
        for rid in budgets:
            results[rid] = dict(prompt=prompts[rid], gen=gen[rid], stats=ctx.request_stats(rid))
            check.check(part, rid, prompts[rid], gen[rid], rows[rid])
        ctx.release_requests(list(budgets))
    return results


def _part3(model, config, device, check, rng):
    print("Part 3 - DynamicInferenceContext: prefix caching (shared system prompt, multi-turn)\n"
          "  (32 KV blocks of 4 tokens, 8 Mamba cache slots; the same waves run again without "
          "prefix caching)")
    contexts = [DynamicInferenceContext(
        kv_layer_configs=config.kv.layer_configs, num_blocks=32, block_size_tokens=4,
        max_requests=4, max_blocks_per_request=12, num_mamba_layers=len(model.mamba_layers),
        conv_states_shape=(model.conv_dim, model.conv_kernel),
        ssm_states_shape=(model.m_heads, model.m_head_dim, model.state), kv_dtype="float32",
        conv_states_dtype="float32", ssm_states_dtype="float32", mamba_cache_slots=8,
        mamba_chunk_size=1, enable_prefix_caching=caching, device=device)
        for caching in (True, False)]
    system = rng.integers(0, model.vocab_size, 12).tolist()
    q = [rng.integers(0, model.vocab_size, n).tolist() for n in (4, 5, 2, 3)]
    waves = [[("a", system + q[0], 4)],
             [("b", system + q[1], 3), ("c", system + q[2], 3)],
             [("a-turn2", lambda r: r["a"]["prompt"] + r["a"]["gen"] + q[3], 3),
              ("b-repeat", system + q[1], 2)]]
    cached = _serve(contexts[0], model, waves, check, "part 3")
    _serve(contexts[1], model, waves, check, "part 3 (no prefix caching)")
    for rid, res in cached.items():
        st = res["stats"]
        print(f"  {rid:<8} prompt {st.prompt_tokens:>2} tokens: KV blocks hit "
              f"{st.kv_hit_blocks}/{st.kv_hit_blocks + st.kv_miss_blocks}, Mamba state "
              f"{'restored' if st.mamba_hits else 'not cached'}, {st.skipped_tokens:>2} skipped, "
              f"{st.prompt_tokens - st.skipped_tokens:>2} computed")
    on, off = contexts[0].stats, contexts[1].stats
    print(f"  computed {on.computed_tokens} tokens vs {off.computed_tokens} without prefix "
          f"caching ({on.skipped_tokens} skipped); KV blocks {on.kv_hit_blocks} hits / "
          f"{on.kv_miss_blocks} misses; {on.mamba_hits} Mamba restores, {on.stored_states} "
          f"states stored")


def run_demo(device=None) -> int:
    """Serve the demo model on ``device`` (default: cuda when usable, else cpu), print what the
    caches did and compare every generated token with the uncached reference run.

    Returns
    -------
    int
        0 when everything matches, 1 otherwise (each mismatch is printed).
    """
    t0 = time.perf_counter()
    dev = resolve_device(device)
    config = HybridCacheConfig.from_hf_config(NEMOTRON_H_CONFIG, max_batch_size=4,
                                              max_sequence_length=64, kv_dtype="float32")
    model = TinyHybridModel(config, vocab_size=NEMOTRON_H_CONFIG["vocab_size"],
                            hidden_size=NEMOTRON_H_CONFIG["hidden_size"],
                            num_q_heads=NEMOTRON_H_CONFIG["num_attention_heads"], seed=0)
    m = config.mamba
    print(f"hcache demo on {dev}: Nemotron-H-style pattern "
          f"{NEMOTRON_H_CONFIG['hybrid_override_pattern']!r} "
          f"({', '.join(f'{i} {k}' for i, k in enumerate(model.kinds))}), hidden 32, vocab 64, "
          f"random weights, greedy decoding; model math in NumPy on the host")
    print(f"  caches (float32): KV [{model.kv_heads} heads x {model.head_dim}] per attention "
          f"layer; Mamba state {list(m.recurrent_state_shape)} + conv "
          f"{list(m.conv_state_shape)} per Mamba layer")
    check = _Checker(model)
    rng = np.random.default_rng(1)
    _part1(model, config, dev, check, rng)
    _part2(model, dev, check, rng)
    _part3(model, config, dev, check, rng)
    seconds = time.perf_counter() - t0
    if check.problems:
        print(f"demo: FAILED, {len(check.problems)} mismatch(es) against the uncached reference "
              f"run ({check.tokens} generated tokens checked, {seconds:.1f} s)")
        return 1
    print(f"demo: all {check.tokens} generated tokens match the uncached reference run "
          f"(bit-identical logits; {seconds:.1f} s)")
    return 0
