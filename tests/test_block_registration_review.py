"""A second reader's checks of the registration backlog (hcache/contexts/block_registration.py,
docs/design.md §6.8, issue 11).

Each test drives a context that registers at once (``registration_budget=None``) and one that
lags as far as it may (budget 1) through the same calls and compares what a caller can see:
plans, refusals, counters, free/cached/allocatable block counts, and, after catching up, the
hash maps. Hand-worked block counts are in the comments. Three tests pin divergences this review
found (since fixed); the rest pin behaviour found correct.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_block_registration import registered_hashes, tokens_of
from test_dynamic_context import check_all, make_ctx, state

from hcache import KVLayerConfig
from hcache.contexts import DynamicInferenceContext, compute_block_hashes
from hcache.errors import CacheCapacityError

BUDGETS = (None, 1)


def attempt(call):
    try:
        return call()
    except (ValueError, CacheCapacityError) as exc:
        return type(exc).__name__


# --- findings ------------------------------------------------------------------------------


def test_a_backlog_duplicate_does_not_pin_the_parent_it_will_never_link_to():
    # bs 2, 8 blocks. A and B admit [1, 2, 3, 4] in one step: A's two blocks are registered,
    # B's are private duplicates. A decodes 5, 6 (block [5, 6] registered: commit 3 queues
    # it, commit 5 drains it), then B decodes 5, 6: B's block 2 completes at commit 5, a
    # duplicate of A's, so at once it stays private. A is released: its 3 blocks are cached
    # and, with nothing used below them, all evictable: 2 free + 3 = 5 allocatable, enough
    # for C's 5 blocks. Lagging, B's block 2 is still queued and pending_parents pins A's
    # block 1 (the block under the hash of B's block 1) and its ancestor A's block 0.
    outcomes = []
    for budget in BUDGETS:
        ctx = make_ctx(8, bs=2, registration_budget=budget)
        ctx.add_request("A", [1, 2, 3, 4])
        ctx.add_request("B", [1, 2, 3, 4])
        ctx.commit_step()
        for rid in ("A", "B"):
            for t in (5, 6):
                ctx.extend_request(rid, [t])
                ctx.commit_step()
        ctx.release_requests(["A"])
        kv = ctx.kv_block_allocator
        got = [kv.get_allocatable_count(), kv.get_evictable_block_count()]
        got.append(attempt(lambda c=ctx: c.add_request("C", [9] * 10).num_matched_blocks))
        check_all(ctx)
        outcomes.append(got)
    assert outcomes[0] == [5, 3, 0]
    assert outcomes[1] == outcomes[0]


def test_a_duplicate_awaiting_state_does_not_evict_a_cached_state():
    # 3 slots. Z [7, 7] leaves a cached state (slot 1, ref 0). P [1, 2, 3] keeps the state of
    # [1, 2] (slot 2); Q [1, 2, 3] matches it. P and Q decode 4 together: at once only P's
    # [3, 4] state is new (Q's block stays private), slot 3. Lagging, both are kept awaiting
    # their hash: 2 slots, so Z's cached state is evicted for Q's, which settles unreachable.
    outcomes = []
    for budget in BUDGETS:
        ctx = make_ctx(16, bs=2, mamba=1, slots=3, rows=4, max_blocks=4,
                       registration_budget=budget)
        ctx.add_request("Z", [7, 7])
        ctx.commit_step()
        ctx.release_requests(["Z"])
        ctx.add_request("P", [1, 2, 3])
        ctx.commit_step()
        ctx.add_request("Q", [1, 2, 3])
        ctx.commit_step()
        ctx.extend_requests(["P", "Q"], np.array([4, 4]))
        ctx.commit_step()
        ctx.register_completed_blocks()
        plan = ctx.add_request("Y", [7, 7, 8])
        check_all(ctx)
        outcomes.append((plan.skip_tokens, ctx.request_stats("Y").mamba_hits))
    assert outcomes[0] == (2, 1)
    assert outcomes[1] == outcomes[0]


def test_stored_states_count_reachable_states_as_registering_at_once():
    # P and Q hold [1, 2, 3] (Q shares P's block 0); both decode 4 at one step. At once: P's
    # [3, 4] state is stored, Q's block is a private duplicate, skipped: 1. Lagging: both are
    # kept awaiting and count nothing yet; when they settle, P's becomes reachable (counted)
    # and Q's slot is freed, so the totals agree once caught up.
    got = []
    for budget in BUDGETS:
        ctx = make_ctx(16, bs=2, mamba=1, slots=16, rows=2, max_blocks=4,
                       registration_budget=budget)
        ctx.add_request("P", [1, 2, 3])
        ctx.commit_step()
        ctx.add_request("Q", [1, 2, 3])
        ctx.commit_step()
        ctx.extend_requests(["P", "Q"], np.array([4, 4]))
        stored = ctx.commit_step()["stored_states"]
        ctx.register_completed_blocks()
        got.append((stored, ctx.stats.stored_states, ctx.mamba_slot_allocator.num_used_slots,
                    ctx.mamba_slot_allocator.num_cached_states))
        check_all(ctx)
    assert got[0][0] == 1 and got[1][0] == 0          # lagging: counted once reachable
    assert got[1][1:] == got[0][1:]


# --- flush(rows) and partial drains, by hand ---------------------------------------------------


def test_releasing_a_row_drains_through_its_last_entry_only():
    # bs 2, budget 1. r0, r1 admit 2-token prompts (registered at commit 1). r0 alone decodes
    # 5, 6: its block 1 completes at commit 3 (entry E1 = [r0]); r1 alone decodes 7, 8: its
    # block 1 completes at commit 5 (E2 = [r1]); commit 4 does nothing (E1 too young), commit
    # 5 hashes E1, commit 6 registers it. r0 decodes 9, 10: commit 7 completes its block 2
    # (E3 = [r0]) and hashes E2. So after commit 7 the queue is [E2 (hashed), E3].
    ctx = make_ctx(32, bs=2, rows=2, max_blocks=8, registration_budget=1)
    ctx.add_request("r0", [1, 2])
    ctx.add_request("r1", [3, 4])
    got = [ctx.commit_step()["registered_blocks"]]
    for rid, toks in (("r0", (5, 6)), ("r1", (7, 8)), ("r0", (9, 10))):
        for t in toks:
            ctx.extend_request(rid, [t])
            got.append(ctx.commit_step()["registered_blocks"])
    assert got == [2, 0, 0, 0, 0, 1, 0]
    reg = ctx._registration
    assert reg.queued == 2
    assert [e[0].tolist() for e in reg._queue] == [[1], [0]]
    # Releasing r1 drains through E2 only; releasing r0 drains E3.
    ctx.release_requests(["r1"])
    assert reg.queued == 1 and registered_hashes(ctx, "r0")[2] is None
    ctx.release_requests(["r0"])
    assert reg.queued == 0
    kv = ctx.kv_block_allocator
    want = compute_block_hashes([1, 2, 5, 6, 9, 10], 2) + compute_block_hashes([3, 4, 7, 8], 2)
    assert set(kv.kv_hash_to_block_id) == set(want) and kv.num_cached_blocks == 5
    check_all(ctx)


def test_a_split_front_entry_and_a_flush_of_one_of_its_rows():
    # 4 rows in lock step (bs 2, 2-token prompts): commit 3 queues E3 = rows 0..3 (block 1),
    # commit 5 hashes its row 0 (1 block: max(1, ceil(4 / 8))) and queues E5 = rows 0..3
    # (block 2). Releasing row 3 flushes through the last entry holding it, E5: everything.
    ctx = make_ctx(64, bs=2, rows=4, max_blocks=8, registration_budget=1)
    ids = ["a", "b", "c", "d"]
    for i, rid in enumerate(ids):
        ctx.add_request(rid, [100 + i, 200 + i])
    ctx.commit_step()
    for s in range(4):
        ctx.extend_requests(ids, np.array([10 * s + i for i in range(4)]))
        ctx.commit_step()
    reg = ctx._registration
    assert [e[0].tolist() for e in reg._queue] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert reg.queued == 8
    ctx.release_requests(["d"])
    assert reg.queued == 0 and not reg.deferred.any()
    for rid in ids[:3]:
        assert registered_hashes(ctx, rid) == compute_block_hashes(tokens_of(ctx, rid), 2)
    check_all(ctx)


# --- contexts where the backlog must not exist ---------------------------------------------


def window_ctx(budget):
    layers = [KVLayerConfig(1, 8), KVLayerConfig(2, 4, 6)]     # full, local (window 6)
    return DynamicInferenceContext(kv_layer_configs=layers, num_blocks=32, block_size_tokens=4,
                                   max_requests=4, max_blocks_per_request=16,
                                   kv_dtype="float32", num_local_blocks=12, device="cpu",
                                   registration_budget=budget)


def test_a_sliding_window_context_registers_every_block_at_its_commit():
    # Budget 1 is ignored with a local block space: each commit registers what it completed,
    # in both spaces, as budget None does.
    runs = []
    for budget in BUDGETS:
        ctx = window_ctx(budget)
        assert ctx._registration.budget is None
        toks = list(range(1, 30))
        ctx.add_request("A", toks[:10])
        got = [ctx.commit_step()["registered_blocks"]]
        ctx.add_request("B", toks[:9])               # matches A's 2 blocks
        ctx.extend_requests(["A"], [toks[10:13]])     # A completes block 2
        got.append(ctx.commit_step()["registered_blocks"])
        for t in toks[13:21]:                         # A completes blocks 3, 4 (decode)
            ctx.extend_requests(["A", "B"], np.array([t, t]))
            got.append(ctx.commit_step()["registered_blocks"])
            assert ctx._registration.queued == 0
        local = ctx.window_blocks.allocator
        runs.append((got, dict(ctx.kv_block_allocator.kv_hash_to_block_id),
                     dict(local.kv_hash_to_block_id), local.num_free_blocks,
                     ctx.local_block_ids("A").tolist()))
        check_all(ctx)
    assert runs[0][0][:2] == [2, 1]
    # A's 5 blocks; B's 2 matched ones and its [9, 14, 15, 16], [17, 18, 19, 20].
    assert sum(runs[0][0]) == len(runs[0][1]) == 5 + 2
    assert runs[1] == runs[0]


def test_without_prefix_caching_there_is_no_backlog():
    runs = []
    for budget in BUDGETS:
        ctx = make_ctx(12, bs=2, mamba=1, slots=4, registration_budget=budget,
                       enable_prefix_caching=False)
        ctx.add_request("a", [1, 2, 3])
        ctx.add_request("b", [1, 2, 3])
        got = [ctx.commit_step()["registered_blocks"]]
        for t in range(5):
            ctx.extend_requests(["a", "b"], np.array([t, t]))
            got.append(ctx.commit_step()["registered_blocks"])
        assert ctx._registration.queued == 0 and not ctx._registration.deferred.any()
        assert ctx.register_completed_blocks() == 0
        assert ctx.shares_pending_blocks([1, 2, 3, 0]) is False
        check_all(ctx)
        ctx.release_requests(["a"])
        runs.append((got, ctx.kv_block_allocator.num_free_blocks,
                     ctx.add_request("c", [1, 2, 3, 0, 1]).skip_tokens))
    assert runs[0] == ([0] * 6, 12 - 4, 0)
    assert runs[1] == runs[0]


# --- reset, exact repeats, chunked prefill, early hashing -----------------------------------


def lock_step_registered(ctx, ids, steps):
    got = []
    for s in range(steps):
        ctx.extend_requests(ids, np.array([10 * s + i for i in range(len(ids))]))
        got.append(ctx.commit_step()["registered_blocks"])
    return got


def test_reset_forgets_the_backlog_and_the_awaiting_states():
    ids = ["a", "b", "c"]
    fresh = make_ctx(40, bs=2, mamba=1, slots=40, rows=3, max_blocks=12, registration_budget=1)
    ctx = make_ctx(40, bs=2, mamba=1, slots=40, rows=3, max_blocks=12, registration_budget=1)
    for c in (ctx, fresh):
        for i, rid in enumerate(ids):
            c.add_request(rid, [50 + i])
        c.commit_step()
    lock_step_registered(ctx, ids, 7)
    reg = ctx._registration
    assert reg.queued > 0 and ctx.mamba_slot_allocator._hashes.awaiting.any()
    ctx.reset()
    assert reg.queued == 0 and not reg._queue and not reg.deferred.any() and not reg._dropped
    assert not ctx.mamba_slot_allocator._hashes.awaiting.any()
    assert ctx.kv_block_allocator.kv_hash_to_block_id == {}
    check_all(ctx)
    # After reset the context behaves as a new one (same commits, same drain counts).
    for i, rid in enumerate(ids):
        ctx.add_request(rid, [50 + i])
    ctx.commit_step()
    assert lock_step_registered(ctx, ids, 9) == lock_step_registered(fresh, ids, 9)
    assert state(ctx) == state(fresh)
    check_all(ctx)


def test_an_exact_repeat_of_a_row_with_a_backlog_matches_as_at_once():
    # X = [1..4] then decode 5..8 (bs 2): its block 3 is queued. Y repeats all 8 tokens: it
    # matches 4 blocks (the backlog's catching up first) and backs off one block to recompute
    # the last one (restore at 6 tokens).
    outcomes = []
    for budget in BUDGETS:
        ctx = make_ctx(32, bs=2, mamba=1, slots=16, rows=4, max_blocks=8,
                       registration_budget=budget)
        ctx.add_request("X", [1, 2, 3, 4])
        ctx.commit_step()
        for t in (5, 6, 7, 8):
            ctx.extend_request("X", [t])
            ctx.commit_step()
        plan = ctx.add_request("Y", [1, 2, 3, 4, 5, 6, 7, 8])
        check_all(ctx)
        got = [plan.skip_tokens, plan.num_matched_blocks, vars(ctx.request_stats("Y"))]
        ctx.commit_step()
        ctx.extend_requests(["X", "Y"], np.array([9, 9]))
        ctx.commit_step()
        ctx.extend_requests(["X", "Y"], np.array([0, 0]))   # both complete [9, 0]
        ctx.commit_step()
        ctx.register_completed_blocks()
        got.append(sorted(ctx.kv_block_allocator.kv_hash_to_block_id))
        got.append(ctx.kv_block_allocator.num_free_blocks)
        check_all(ctx)
        outcomes.append(got)
    assert outcomes[0][:2] == [6, 4]
    assert outcomes[1] == outcomes[0]


def test_chunked_prefill_and_shares_pending_blocks_agree_with_at_once():
    # A long prompt arrives in chunks (multi-token extensions) while another row decodes; a
    # third request asks shares_pending_blocks about the chunk in flight, then is admitted
    # behind it and hits the chunk's blocks.
    outcomes = []
    for budget in BUDGETS:
        ctx = make_ctx(40, bs=2, mamba=1, slots=40, rows=4, max_blocks=12,
                       registration_budget=budget)
        prompt = list(range(1, 17))
        ctx.add_request("L", prompt[:3])
        ctx.add_request("D", [40, 41])
        ctx.commit_step()
        got = []
        for lo, hi in ((3, 7), (7, 12), (12, 16)):
            ctx.extend_requests(["L", "D"], [prompt[lo:hi], [lo]])
            got.append(ctx.shares_pending_blocks(prompt[:hi]))
            got.append(ctx.shares_pending_blocks(prompt[:lo]))
            ctx.commit_step()
            plan = ctx.add_request(f"F{lo}", prompt[:hi] + [99])
            got.append((plan.skip_tokens, plan.num_matched_blocks, plan.restored_block >= 0))
            ctx.commit_step()
            ctx.release_requests([f"F{lo}"])
            check_all(ctx)
        ctx.register_completed_blocks()
        got.append(sorted(ctx.kv_block_allocator.kv_hash_to_block_id))
        got.append(sorted(ctx.mamba_slot_allocator.hash_to_block_id))
        outcomes.append(got)
    # The chunk [3, 7) completes blocks 1..2: pending, then hit (3 blocks) by F3.
    assert outcomes[0][:2] == [True, False] and outcomes[0][2][1:] == (3, True)
    assert outcomes[1] == outcomes[0]


def test_blocks_hashed_early_by_eviction_chain_on_to_the_same_hashes():
    # Eviction reads pending_parents, which hashes backlog rows' blocks before they are
    # drained (hash_through); the drain then continues with hash_next from the digest it
    # left. Query the evictable count between every decode step: the hashes must still be
    # those of the whole sequences, and everything matches the at-once context.
    runs = []
    for budget in BUDGETS:
        ctx = make_ctx(48, bs=2, mamba=1, slots=48, rows=3, max_blocks=14,
                       registration_budget=budget)
        ctx.add_request("old", [7, 7, 7, 7])
        ctx.commit_step()
        ctx.release_requests(["old"])                 # cached: eviction has work
        ids = ["a", "b", "c"]
        for i, rid in enumerate(ids):
            ctx.add_request(rid, [i, i, i])
        ctx.commit_step()
        counts = []
        for s in range(18):
            ctx.extend_requests(ids, np.array([(s * 7 + i) % 5 for i in range(3)]))
            counts.append(ctx.kv_block_allocator.get_evictable_block_count())
            ctx.commit_step()
            counts.append(ctx.kv_block_allocator.get_evictable_block_count())
            check_all(ctx)
        ctx.register_completed_blocks()
        for rid in ids:
            assert registered_hashes(ctx, rid) == compute_block_hashes(tokens_of(ctx, rid), 2)
        runs.append((counts, state(ctx)[5]))
    assert runs[1] == runs[0]


def test_a_refused_extension_changes_nothing_but_the_catching_up():
    # The pool is full; the extension asks for more blocks than eviction can give. The
    # lagging context hashes backlog blocks for pending_parents while deciding: after
    # catching up, its state equals the eager context's, before and after the refusal.
    states = []
    for budget in BUDGETS:
        ctx = make_ctx(7, bs=2, mamba=1, slots=8, rows=3, max_blocks=8,
                       registration_budget=budget)
        ctx.add_request("a", [1, 2, 3])
        ctx.add_request("b", [4, 5, 6])
        ctx.commit_step()
        ctx.extend_requests(["a", "b"], np.array([0, 0]))
        ctx.commit_step()
        before = state(ctx)
        with pytest.raises(CacheCapacityError):
            ctx.extend_requests(["a", "b"], [[1, 2, 3, 4], [1, 2, 3, 4]])
        assert state(ctx) == before
        check_all(ctx)
        states.append(before)
    assert states[1][5] == states[0][5] and states[1][1:3] == states[0][1:3]


# --- a seeded differential: more rows, block size 1..3, reset, shares, both policies --------

STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6], [1, 2, 3, 4, 7, 7, 1, 2]]
CONFIGS = {
    # (blocks, bs, slots, rows, policy, compare_allocatable)
    "ref_zero under pressure": (10, 2, 40, 5, "ref_zero", True),
    "lru, bs 3, pressure": (9, 3, 40, 4, "lru", False),     # allocatable: see finding 1
    "lru, roomy": (200, 1, 100, 5, "lru", True),
}


def admit(ctx, rid, toks):
    p = ctx.add_request(rid, toks)
    return (p.row, p.skip_tokens, p.num_matched_blocks, p.restored_block >= 0,
            vars(ctx.request_stats(rid)))


def differential_run(name, seed):
    blocks, bs, slots, rows, policy, cmp_alloc = CONFIGS[name]
    rng = random.Random(seed)
    a, b = (make_ctx(blocks, bs=bs, mamba=1, slots=slots, rows=rows, max_blocks=24 // bs,
                     policy=policy, registration_budget=budget) for budget in BUDGETS)
    next_id = 0

    def both(method, *args):
        got = [attempt(lambda c=c: method(c, *args)) for c in (a, b)]
        assert got[0] == got[1], (name, seed, method.__name__, args)

    for _ in range(50):
        op = rng.choice(["add", "add", "ext", "ext", "ext", "commit", "rel", "shares", "catch",
                         "reset"])
        live, t = a.request_ids, a._requests
        ready = [r for r in live if t.pending_end[t.row(r)] < 0]
        if op in ("add", "shares"):
            base = tokens_of(a, rng.choice(live)) if live and rng.random() < .5 \
                else rng.choice(STEMS)
            toks = base[:rng.randint(1, len(base))] + [rng.randint(0, 3)
                                                         for _ in range(rng.randint(0, 3))]
            if op == "shares":
                both(DynamicInferenceContext.shares_pending_blocks, toks)
            else:
                both(admit, next_id, toks)
                next_id += 1
        elif op == "ext" and ready:
            ids = ready if rng.random() < .7 else rng.sample(ready, rng.randint(1, len(ready)))
            toks = [[rng.randint(0, 3) for _ in range(rng.randint(1, 4))] for _ in ids] \
                if rng.random() < .3 else np.array([rng.randint(0, 3) for _ in ids])
            both(lambda c, i, k: c.extend_requests(i, k).ends.tolist(), ids, toks)
            if rng.random() < .8:
                a.commit_step(), b.commit_step()
        elif op == "commit":
            a.commit_step(), b.commit_step()
        elif op == "rel" and live:
            both(DynamicInferenceContext.release_requests,
                 rng.sample(live, min(len(live), rng.randint(1, 2))))
        elif op == "catch":
            a.register_completed_blocks(), b.register_completed_blocks()
            assert set(a.kv_block_allocator.kv_hash_to_block_id) \
                == set(b.kv_block_allocator.kv_hash_to_block_id)
            assert set(a.mamba_slot_allocator.hash_to_block_id) \
                == set(b.mamba_slot_allocator.hash_to_block_id)
        elif op == "reset" and rng.random() < .3:
            a.reset(), b.reset()
        ka, kb = a.kv_block_allocator, b.kv_block_allocator
        assert (ka.num_free_blocks, ka.num_cached_blocks) \
            == (kb.num_free_blocks, kb.num_cached_blocks)
        if cmp_alloc:
            assert ka.get_allocatable_count() == kb.get_allocatable_count()
        check_all(a)
        check_all(b)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_seeded_differential(name):
    for seed in range(16):
        differential_run(name, seed)
