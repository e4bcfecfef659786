"""DynamicInferenceContext on its own (docs/design.md §6): admission under pressure, caller
mistakes, the smallest pool. ``tests/test_prefix_caching_e2e.py`` drives it end to end.

Oracles: the contract's words ("``CacheCapacityError`` when not enough KV blocks even after
eviction"; a caller mistake raises ``TypeError`` / ``ValueError`` / ``IndexError`` and changes
nothing, and an unknown id is a ``ValueError`` as for the continuous-batching manager of
docs/design.md §5), hand-built pool states, and, for the random admissions, a copy of the KV
allocator on which the pin-then-allocate sequence is replayed directly.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from hcache.config.caches import KVLayerConfig
from hcache.contexts import DynamicInferenceContext, compute_block_hashes
from hcache.errors import CacheCapacityError

# --- helpers -------------------------------------------------------------------------------

def make_ctx(num_blocks, *, bs=2, mamba=0, slots=0, rows=4, max_blocks=8, policy="lru", **kw):
    return DynamicInferenceContext(
        kv_layer_configs=[KVLayerConfig(1, 4)], num_blocks=num_blocks, block_size_tokens=bs,
        max_requests=rows, max_blocks_per_request=max_blocks, num_mamba_layers=mamba,
        conv_states_shape=(2,), ssm_states_shape=(3,), mamba_cache_slots=slots,
        eviction_policy=policy, device="cpu", **kw)


def state(ctx):
    kv, m = ctx.kv_block_allocator, ctx.mamba_slot_allocator
    out = [kv.free_block_ids.tolist(), kv.block_hashes.tolist(), kv.block_ref_counts.tolist(),
           kv.block_timestamps.tolist(), kv.block_parent_ids.tolist(),
           dict(kv.kv_hash_to_block_id), kv.clock, ctx.request_to_kv_block_ids.tolist(),
           ctx.request_to_mamba_state_idx.tolist(), list(ctx.request_ids),
           {rid: (ctx.num_computed_tokens(rid), ctx.block_ids(rid).tolist())
            for rid in ctx.request_ids}]
    if m is not None:
        out += [m.block_to_slot.tolist(), dict(m.hash_to_block_id), m.free_count]
    return out


def check(ctx):
    ctx.kv_block_allocator.check_invariants()
    if ctx.mamba_slot_allocator is not None:
        ctx.mamba_slot_allocator.check_invariants()


def pool_with_blocked_cached_chain():
    """7 blocks of 2 tokens. A and B prefill the same 4 tokens in one step, so A's blocks
    X0, X1 are registered and B's copies stay private; B then completes a third block Y2,
    registered with parent X1. C caches one unrelated block Z. After A and C are released, X0
    and X1 are cached but not evictable (their descendant Y2 is in use), Z is cached and
    evictable, and one block is free."""
    ctx = make_ctx(7)
    ctx.add_request("A", [1, 2, 3, 4])
    ctx.add_request("B", [1, 2, 3, 4])
    ctx.commit_step()
    ctx.extend_request("B", [5, 6])
    ctx.commit_step()
    ctx.add_request("C", [7, 7])
    ctx.commit_step()
    x = ctx.block_ids("A").tolist()
    z = ctx.block_ids("C").tolist()
    y2 = ctx.block_ids("B").tolist()[2]
    ctx.release_requests(["A", "C"])
    kv = ctx.kv_block_allocator
    # The hand-built state the scenario relies on.
    assert kv.block_parent_ids[y2] == x[1] and kv.block_ref_counts[y2] == 1
    assert kv.block_ref_counts[x + z].tolist() == [0, 0, 0]
    assert kv.num_free_blocks == 1 and kv.get_evictable_block_count() == 1
    return ctx, x, z


# --- admission: matched cached blocks that eviction cannot reclaim ---------------------------

def test_admission_counts_only_evictable_matched_blocks_as_lost_to_the_pin():
    ctx, x, z = pool_with_blocked_cached_chain()
    # D matches X0, X1 and needs 2 fresh blocks: the free one plus Z, evicted. Pinning X0, X1
    # costs nothing (eviction could not reclaim them anyway), so the request fits.
    plan = ctx.add_request("D", [1, 2, 3, 4, 9, 9, 9])
    assert plan.num_matched_blocks == 2
    blocks = ctx.block_ids("D").tolist()
    assert blocks[:2] == x and len(set(blocks)) == 4
    assert z[0] in blocks[2:]                       # the evicted cached block, reused
    assert ctx.kv_block_allocator.block_ref_counts[x].tolist() == [1, 1]
    check(ctx)


def test_admission_that_truly_does_not_fit_raises_and_changes_nothing():
    ctx, _, _ = pool_with_blocked_cached_chain()
    before = state(ctx)
    with pytest.raises(CacheCapacityError) as info:
        ctx.add_request("D", [1, 2, 3, 4, 9, 9, 9, 9, 9])    # 2 matched + 3 new > 1 + 1
    assert (info.value.required, info.value.available) == (3, 2)
    assert state(ctx) == before
    check(ctx)


def replay_admission(ctx, tokens):
    """Oracle: on a copy of the KV allocator, pin the blocks the prefix match would share and
    allocate the rest; True when that succeeds."""
    kv = ctx.kv_block_allocator
    observers, kv._observers = kv._observers, []
    try:
        twin = copy.deepcopy(kv)
    finally:
        kv._observers = observers
    matched = []
    for h in compute_block_hashes(tokens, ctx.block_size_tokens):
        if h not in twin.kv_hash_to_block_id:
            break
        matched.append(twin.kv_hash_to_block_id[h])
    twin.retain_memory_blocks(matched)
    need = -(-len(tokens) // ctx.block_size_tokens) - len(matched)
    return twin.allocate_memory_blocks(need) is not None


@pytest.mark.parametrize("seed", range(64))
def test_random_admissions_fail_only_when_pin_and_allocate_would_fail(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3])
    ctx = make_ctx(rng.randint(3, 8), bs=bs, mamba=1, slots=rng.randint(1, 3), rows=3,
                   max_blocks=6, policy=rng.choice(["lru", "ref_zero"]))
    stems = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 6]]
    next_id = 0
    for _ in range(60):
        op = rng.random()
        if op < 0.45 and len(ctx.request_ids) < 3:
            tokens = rng.choice(stems)[:rng.randint(1, 6)] + [rng.randint(0, 3)
                                                              for _ in range(rng.randint(0, 2))]
            if len(tokens) > 6 * bs:
                continue
            fits = replay_admission(ctx, tokens)
            before = state(ctx)
            try:
                ctx.add_request(next_id, tokens)
                next_id += 1
                assert fits
            except CacheCapacityError:
                assert not fits, "refused although pinning and allocating would succeed"
                assert state(ctx) == before
        elif op < 0.65 and ctx.request_ids:
            rid = rng.choice(ctx.request_ids)
            before = state(ctx)
            try:
                ctx.extend_request(rid, [rng.randint(0, 3)])
            except CacheCapacityError:
                assert state(ctx) == before
            except ValueError:              # a step already scheduled, or the table is full
                assert state(ctx) == before
        elif op < 0.85:
            ctx.commit_step()
        elif ctx.request_ids:
            ctx.release_requests(rng.sample(ctx.request_ids, rng.randint(1, len(ctx.request_ids))))
        check(ctx)


# --- unknown request ids are caller mistakes (ValueError), not KeyError ---------------------

def test_unknown_request_ids_raise_value_error_and_change_nothing():
    ctx = make_ctx(8, mamba=1, slots=2)
    ctx.add_request("a", [1, 2, 3])
    ctx.commit_step()
    before = state(ctx)
    calls = [lambda: ctx.extend_request("nope", [1]),
             lambda: ctx.release_requests(["a", "nope"]),
             lambda: ctx.write_kv(["nope"], [], []),
             lambda: ctx.request_stats("nope"),
             lambda: ctx.block_ids("nope"),
             lambda: ctx.num_computed_tokens("nope"),
             lambda: ctx.mamba_slot("nope")]
    for call in calls:
        with pytest.raises(ValueError, match="request_id"):
            call()
        assert state(ctx) == before
    with pytest.raises(TypeError, match="request_id"):
        ctx.block_ids(["unhashable"])
    assert state(ctx) == before
    check(ctx)


# --- caller mistakes in scalar arguments and token shapes ------------------------------------

@pytest.mark.parametrize("name", ["mamba_chunk_size", "max_step_tokens"])
def test_zero_sizes_are_rejected_not_replaced_by_defaults(name):
    with pytest.raises(ValueError, match=name):
        make_ctx(4, mamba=1, slots=1, **{name: 0})
    make_ctx(4, mamba=1, slots=1, **{name: 2})       # a valid value is accepted


def test_token_array_of_the_wrong_shape_is_a_value_error():
    ctx = make_ctx(8)
    ctx.add_request("a", [1, 2])
    ctx.commit_step()
    before = state(ctx)
    with pytest.raises(ValueError, match="tokens"):
        ctx.add_request("b", np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="tokens"):
        ctx.extend_request("a", np.ones((1, 1), dtype=np.int64))
    with pytest.raises(TypeError, match="tokens"):
        ctx.add_request("b", np.ones(3, dtype=np.float32))
    assert state(ctx) == before


# --- the smallest pool (hand-computed expectations) ------------------------------------------

@pytest.mark.parametrize("policy", ["lru", "ref_zero"])
def test_one_block_of_one_token(policy):
    ctx = make_ctx(1, bs=1, mamba=1, slots=1, rows=1, max_blocks=1, policy=policy)
    plan = ctx.add_request("a", [5])
    assert (plan.start, plan.end, plan.block_ids.tolist()) == (0, 1, [0])
    ctx.commit_step()
    with pytest.raises(ValueError, match="tokens"):
        ctx.extend_request("a", [6])                  # the table holds one token
    with pytest.raises(CacheCapacityError, match="rows"):
        ctx.add_request("b", [5])
    ctx.release_requests(["a"])
    cached = 1 if policy == "lru" else 0
    assert ctx.kv_block_allocator.num_cached_blocks == cached
    assert ctx.mamba_slot_allocator.num_cached_states == cached
    # An exact repeat of a one-block prompt matches the block but must still compute a token.
    plan = ctx.add_request("b", [5])
    assert plan.num_matched_blocks == cached and plan.skip_tokens == 0
    assert (plan.start, plan.end) == (0, 1)
    ctx.commit_step()
    ctx.release_requests(["b"])
    # A different prompt evicts the cached block (lru) and its Mamba state with it.
    plan = ctx.add_request("c", [7])
    assert plan.num_matched_blocks == 0 and plan.block_ids.tolist() == [0]
    assert ctx.mamba_slot_allocator.num_cached_states == 0
    check(ctx)
