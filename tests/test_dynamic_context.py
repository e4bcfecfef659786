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

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hcache.config.caches import KVLayerConfig
from hcache.contexts import (
    DynamicInferenceContext,
    MambaSlotAllocator,
    PagedKVPool,
    compute_block_hashes,
)
from hcache.contexts.backlog_duplicates import PendingParents
from hcache.errors import CacheCapacityError

# --- helpers -------------------------------------------------------------------------------

def make_ctx(num_blocks, *, bs=2, mamba=0, slots=0, rows=4, max_blocks=8, policy="lru", **kw):
    return DynamicInferenceContext(
        kv_layer_configs=[KVLayerConfig(1, 4)], num_blocks=num_blocks, block_size_tokens=bs,
        max_requests=rows, max_blocks_per_request=max_blocks, num_mamba_layers=mamba,
        conv_states_shape=(2,), ssm_states_shape=(3,), mamba_cache_slots=slots,
        eviction_policy=policy, device="cpu", **kw)


def state(ctx):
    # With the registration backlog caught up: a refused call may catch it up (it changes no
    # outcome: docs/design.md §6.8), so states compare after catching up.
    ctx.register_completed_blocks()
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
    ctx.register_completed_blocks()     # Y2 may still wait in the registration backlog
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


# --- extend_requests: one call for a batch, the same as a loop of extend_request ------------

def full_state(ctx):
    """Everything a call could change: allocators, request table (tokens and hashes of live
    rows), Mamba tracking and cache, live states, counters."""
    kv, m, t = ctx.kv_block_allocator, ctx.mamba_slot_allocator, ctx._requests
    out = state(ctx) + [kv.block_parent_hashes.tolist(), kv.block_child_counts.tolist(),
                        vars(ctx.stats).copy(), ctx.mamba_conv_states.tolist(),
                        ctx.mamba_ssm_states.tolist(), list(t._free_rows),
                        list(t._free_live_slots)]
    for rid in ctx.request_ids:
        row = t.row(rid)
        n = int(t.lengths[row])
        out.append((rid, row, t.tokens[row, :n].tolist(), int(t.num_blocks[row]),
                    int(t.pending_end[row]), int(t.kv_cached[row]), int(t.registered[row]),
                    t.hashes[row, :n // ctx.block_size_tokens].tolist(), t.digests[row].tolist(),
                    vars(ctx.request_stats(rid))))
    if m is not None:
        i = m._intermediate
        out += [m.slot_to_block.tolist(), m.free_slots[:m.free_count].tolist(),
                i.offsets.tolist(), i.block_ids.tolist(), i.counts.tolist(),
                i.eos_block_ids.tolist(), i.pending, m.conv_states.tolist(), m.ssm_states.tolist()]
    return out


def twin(ctx):
    """An independent copy for an oracle (array modules are shared, not copied). The classes
    refuse ``copy.deepcopy`` (hcache/_copying.py: on a GPU the copy's pointer tables would
    still address the original); on cpu the NumPy reference reads the arrays themselves, so
    the refusal is lifted while the test copies."""
    owners = (DynamicInferenceContext, PagedKVPool, MambaSlotAllocator)
    saved = {cls: (cls.__deepcopy__, cls.__reduce_ex__) for cls in owners}
    try:
        for cls in owners:
            del cls.__deepcopy__, cls.__reduce_ex__
        new = copy.deepcopy(ctx, {id(np): np})
    finally:
        for cls, (deep, reduce) in saved.items():
            cls.__deepcopy__, cls.__reduce_ex__ = deep, reduce
    # A copied allocator keeps a detached snapshot of its backlog hooks (PendingParents): wire
    # the copy's pinning and drop recording to the copy's registration, as the context does.
    watch = PendingParents(new._registration)
    new.kv_block_allocator.pending_parents = watch
    new.kv_block_allocator.deregistering = watch.deregistering
    return new


def plans_of(plans):
    return [(p.request_id, p.row, p.mamba_slot, p.start, p.end, p.tokens.tolist(),
             p.block_ids.tolist(), p.skip_tokens, p.num_matched_blocks, p.restored_block)
            for p in plans]


def check_all(ctx):
    check(ctx)
    ctx.check_invariants()


def busy_ctx(*, num_blocks=40, bs=4, rows=6, mamba=1, slots=6, prompts=None, commit=True):
    ctx = make_ctx(num_blocks, bs=bs, mamba=mamba, slots=slots, rows=rows, max_blocks=24 // bs)
    prompts = prompts or [[1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 9, 9], [7] * 8, [5, 6]]
    for i, p in enumerate(prompts):
        ctx.add_request(f"r{i}", p)
    if commit:
        ctx.commit_step()
    return ctx


TOKEN_LISTS = st.lists(st.integers(0, 20), min_size=1, max_size=9)


@settings(max_examples=30)
@given(st.data())
def test_extend_requests_equals_a_loop_of_extend_request(data):
    bs = data.draw(st.sampled_from([1, 2, 4]))
    ctx = busy_ctx(slots=data.draw(st.integers(0, 4)), bs=bs,
                   num_blocks=-(-data.draw(st.integers(24, 60)) // bs) + 2)
    for _ in range(data.draw(st.integers(1, 4))):
        ids = data.draw(st.permutations(ctx.request_ids))
        ids = ids[:data.draw(st.integers(1, len(ids)))]
        form = data.draw(st.sampled_from(["one each", "lists", "2-D"]))
        if form == "one each":
            toks = np.array(data.draw(st.lists(st.integers(0, 20), min_size=len(ids),
                                               max_size=len(ids))), dtype=np.int64)
            per = [[int(x)] for x in toks]
        elif form == "lists":
            per = [data.draw(TOKEN_LISTS) for _ in ids]
            toks = per
        else:
            k = data.draw(st.integers(1, 3))
            toks = np.array(data.draw(st.lists(st.integers(0, 20), min_size=k * len(ids),
                                               max_size=k * len(ids)))).reshape(len(ids), k)
            per = toks.tolist()
        loop = twin(ctx)
        try:
            got = list(ctx.extend_requests(ids, toks))
        except (ValueError, CacheCapacityError):
            assert full_state(ctx) == full_state(loop)    # refused: nothing changed
            with pytest.raises((ValueError, CacheCapacityError)):
                for rid, t in zip(ids, per, strict=True):
                    loop.extend_request(rid, t)
            break
        want = [loop.extend_request(rid, t) for rid, t in zip(ids, per, strict=True)]
        assert plans_of(got) == plans_of(want)
        assert full_state(ctx) == full_state(loop)
        assert ctx.snapshot_targets() == loop.snapshot_targets()
        assert ctx.commit_step() == loop.commit_step()
        assert full_state(ctx) == full_state(loop)
        check_all(ctx)


def test_batch_plan_arrays_and_step_plans():
    ctx = busy_ctx()
    plan = ctx.extend_requests(["r2", "r0"], [[8, 9], [6]])
    assert len(plan) == 2 and plan.request_ids == ["r2", "r0"]
    assert plan.starts.tolist() == [8, 5] and plan.ends.tolist() == [10, 6]
    assert plan.token_offsets.tolist() == [0, 2, 3] and plan.tokens.tolist() == [8, 9, 6]
    assert plan.rows.tolist() == [ctx._requests.row("r2"), ctx._requests.row("r0")]
    assert plan.mamba_slots.tolist() == [ctx.mamba_slot("r2"), ctx.mamba_slot("r0")]
    for i, rid in enumerate(plan.request_ids):
        np.testing.assert_array_equal(plan.block_table[i][:len(ctx.block_ids(rid))],
                                      ctx.block_ids(rid))
        p = plan[i]
        assert (p.request_id, p.start, p.end) == (rid, plan.starts[i], plan.ends[i])
        assert p.block_ids.tolist() == ctx.block_ids(rid).tolist()
        assert (p.skip_tokens, p.num_matched_blocks, p.restored_block) == (0, 0, -1)
    assert [p.request_id for p in plan] == ["r2", "r0"] and plan[-1].request_id == "r0"
    with pytest.raises(IndexError):
        plan[2]
    assert len(ctx.extend_requests([], [])) == 0        # an empty batch changes nothing


@pytest.mark.parametrize("case, error, match", [
    ("unknown id", ValueError, r"request_ids\[1\]: expected an active request"),
    ("unhashable id", TypeError, r"request_ids\[1\]: expected a hashable id"),
    ("repeated id", ValueError, "request_ids: expected distinct request ids, got 'r1' twice"),
    ("scheduled step", ValueError, r"request_ids\[1\]: expected a request without a sched"),
    ("too many tokens", ValueError, r"tokens\[1\]: expected 1\.\.17 tokens, got 18"),
    ("no token", ValueError, r"tokens\[1\]: expected at least 1 token, got 0"),
    ("too few tokens", ValueError, "tokens: expected 2 tokens"),
    ("float tokens", TypeError, "tokens"), ("bool token", TypeError, "tokens"),
    ("2-D of the wrong rows", ValueError, "tokens: expected shape"),
    ("out of KV blocks", CacheCapacityError, "KV blocks"),
    ("ids not a sequence", TypeError, "request_ids: expected a sequence")])
def test_refused_batches_change_nothing(case, error, match):
    ctx = busy_ctx(num_blocks=13)
    ctx.add_request("late", [4, 4, 4])                 # a request with a scheduled step
    before = full_state(ctx)
    ids, toks = ["r0", "r1"], np.array([3, 3])
    ids, toks = {"unknown id": (["r0", "nope"], toks), "unhashable id": (["r0", ["x"]], toks),
                 "repeated id": (["r1", "r1"], toks), "scheduled step": (["r0", "late"], toks),
                 "too many tokens": (ids, [[3], [3] * 18]), "no token": (ids, [[3], []]),
                 "too few tokens": (ids, np.array([3])), "float tokens": (ids, [1.5, 2.0]),
                 "bool token": (ids, [3, True]),
                 "2-D of the wrong rows": (ids, np.ones((3, 2), np.int64)),
                 "out of KV blocks": (ids, [[3] * 12, [3] * 12]),
                 "ids not a sequence": (iter(ids), toks)}[case]
    with pytest.raises(error, match=match):
        ctx.extend_requests(ids, toks)
    assert full_state(ctx) == before
    check_all(ctx)


def test_out_of_blocks_refusal_reports_the_batch_need():
    ctx = busy_ctx(num_blocks=13)
    kv = ctx.kv_block_allocator
    with pytest.raises(CacheCapacityError) as info:
        ctx.extend_requests(["r0", "r1"], [[3] * 12, [3] * 16])
    assert (info.value.required, info.value.available) == (7, 6) == (7, kv.num_free_blocks)


def test_extend_request_keeps_its_argument_names():
    ctx = busy_ctx()
    with pytest.raises(ValueError, match="^tokens: expected 1..19 tokens, got 0"):
        ctx.extend_request("r0", [])
    ctx.extend_request("r0", [1])
    with pytest.raises(ValueError, match="^request_id: expected a request without"):
        ctx.extend_request("r0", [1])
    with pytest.raises(ValueError, match="^request_id: expected an active request"):
        ctx.extend_request("nope", [1])


def test_batch_allocates_in_request_order_even_under_eviction():
    # A pool whose free stack is short: the batch evicts cached blocks exactly as the loop does.
    ctx = make_ctx(12, bs=2, mamba=1, slots=3, rows=4, max_blocks=6)
    ctx.add_request("old", [9, 8, 7, 6, 5, 4])
    ctx.commit_step()
    ctx.release_requests(["old"])                       # 3 cached blocks
    for rid, p in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7])):
        ctx.add_request(rid, p)
    ctx.commit_step()
    loop = twin(ctx)
    assert ctx.kv_block_allocator.num_free_blocks < 5
    got = list(ctx.extend_requests(["c", "a", "b"], [[1] * 6, [2, 2, 2], [3, 3]]))
    want = [loop.extend_request(r, t) for r, t in (("c", [1] * 6), ("a", [2, 2, 2]),
                                                   ("b", [3, 3]))]
    assert plans_of(got) == plans_of(want) and full_state(ctx) == full_state(loop)
    assert ctx.kv_block_allocator.num_cached_blocks < 3           # evicted some
    check_all(ctx)


# --- block hashes: computed once, when a block completes ------------------------------------

@settings(max_examples=40)
@given(st.integers(1, 5), st.lists(st.lists(st.integers(-2**63, 2**63 - 1), min_size=1,
                                            max_size=11), min_size=1, max_size=8))
def test_incremental_hashes_equal_hashes_of_the_whole_prefix(bs, chunks):
    """Hashes computed block by block (chained from the parent's digest, across any number of
    extensions and registration batches) are compute_block_hashes of the whole sequence, and
    so are the registered KV hashes."""
    ctx = make_ctx(64, bs=bs, mamba=1, slots=4, rows=2, max_blocks=64 // bs)   # fits the pool
    seq = list(chunks[0])
    ctx.add_request("x", seq)
    ctx.commit_step()
    for chunk in chunks[1:]:
        if len(seq) + len(chunk) > ctx.max_sequence_length:
            break
        ctx.extend_requests(["x"], [chunk])
        seq += chunk
        want = compute_block_hashes(seq, bs)
        ctx.commit_step()
        ctx.register_completed_blocks()    # hashed when registered (docs/design.md §6.8)
        row = ctx._requests.row("x")
        assert ctx._requests.hashes[row, :len(want)].tolist() == want
        kv = ctx.kv_block_allocator
        assert kv.block_hashes[ctx.block_ids("x")[:len(want)]].tolist() == want
        ctx.check_invariants()


# --- stateful: a context driven in batches against a twin driven request by request ----------

STEMS = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 6], [1, 2, 3, 4, 7, 7]]
# Prefix-cache isolation (docs/design.md §6.1): mostly no salt, so that prompts still hit.
SALTS = st.sampled_from([None, None, None, b"t1", "t1", b"t2"])


def draw_isolation(data, num_tokens, bs):
    """A salt and, now and then, extra keys on the prompt's blocks (its partial one too)."""
    salt = data.draw(SALTS, label="salt")
    blocks = -(-num_tokens // bs)
    keys = data.draw(st.one_of(st.just({}), st.dictionaries(
        st.integers(0, blocks - 1), st.sampled_from([b"img1", "img1", [b"img2"]]),
        max_size=2)), label="extra_keys")
    return salt, keys


class BatchedVersusLoopedContext(RuleBasedStateMachine):
    """Two copies of a context, one extended with ``extend_requests``, the other with a loop
    of ``extend_request``, through random admissions (salted and keyed now and then),
    batches (unknown, repeated and scheduled ids included), commits and releases: they stay
    identical, every refused batch changes nothing, and both keep their invariants (hashes
    under their salts and keys included)."""

    @initialize(bs=st.sampled_from([1, 2, 3]), blocks=st.integers(5, 20),
                slots=st.integers(0, 3), policy=st.sampled_from(["lru", "ref_zero"]))
    def setup(self, bs, blocks, slots, policy):
        self.ctx = make_ctx(blocks, bs=bs, mamba=1, slots=slots, rows=4, max_blocks=24 // bs,
                            policy=policy)
        self.loop = twin(self.ctx)
        self.next_id = 0

    @rule(data=st.data())
    def add(self, data):
        tokens = data.draw(st.sampled_from(STEMS))[:data.draw(st.integers(1, 6))]
        tokens += data.draw(st.lists(st.integers(0, 3), max_size=3))
        salt, keys = draw_isolation(data, len(tokens), self.ctx.block_size_tokens)
        outcomes = []
        for ctx in (self.ctx, self.loop):
            try:
                outcomes.append(plans_of([ctx.add_request(self.next_id, tokens, salt=salt,
                                                          extra_keys=keys)]))
            except (ValueError, CacheCapacityError) as exc:
                outcomes.append(type(exc))
        assert outcomes[0] == outcomes[1]
        self.next_id += 1

    @rule(data=st.data())
    def extend(self, data):
        if not self.ctx.request_ids:
            with pytest.raises(ValueError, match="active"):
                self.ctx.extend_requests(["nope"], [[1]])
            return
        table = self.ctx._requests
        ready = [r for r in self.ctx.request_ids if table.pending_end[table.row(r)] < 0]
        if not ready:     # an engine would run the step first
            self.commit()
            ready = self.ctx.request_ids
        ids = data.draw(st.lists(st.sampled_from(ready), unique=True, min_size=1)) \
            if ready else []
        if not ids or data.draw(st.integers(0, 9)) == 0:      # a caller mistake, now and then
            ids.insert(data.draw(st.integers(0, len(ids))),
                       data.draw(st.sampled_from(["nope"] + self.ctx.request_ids)))
        per = [data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4)) for _ in ids]
        before = full_state(self.ctx)
        try:
            got = list(self.ctx.extend_requests(ids, per))
        except (ValueError, CacheCapacityError):
            assert full_state(self.ctx) == before
            return
        want = [self.loop.extend_request(rid, t) for rid, t in zip(ids, per, strict=True)]
        assert plans_of(got) == plans_of(want)

    @rule()
    def commit(self):
        assert self.ctx.commit_step() == self.loop.commit_step()

    @rule(data=st.data())
    def release(self, data):
        if self.ctx.request_ids:
            ids = data.draw(st.lists(st.sampled_from(self.ctx.request_ids), min_size=1,
                                     unique=True))
            self.ctx.release_requests(ids)
            self.loop.release_requests(ids)

    @invariant()
    def identical_and_consistent(self):
        if hasattr(self, "ctx"):
            assert full_state(self.ctx) == full_state(self.loop)
            assert self.ctx.snapshot_targets() == self.loop.snapshot_targets()
            check_all(self.ctx)


TestBatchedVersusLoopedContext = BatchedVersusLoopedContext.TestCase


# --- write_kv row counts (issue 21 item 5) -------------------------------------------------


@pytest.mark.parametrize("rows_given", [2, 4])
@pytest.mark.parametrize("per_layer", [False, True])
def test_write_kv_refuses_rows_other_than_the_steps_tokens_and_changes_nothing(rows_given,
                                                                             per_layer):
    """A step of 3 tokens given 2 rows would leave the third position stale, and commit_step
    would register that block for any later request with the same prefix; 4 rows used to be
    refused only after staging, naming ``positions``. Either is refused naming ``k`` (the
    argument the caller passed), before anything is staged."""
    ctx = DynamicInferenceContext(
        kv_layer_configs=[KVLayerConfig(1, 4), KVLayerConfig(1, 4)], num_blocks=8,
        block_size_tokens=2, max_requests=2, max_blocks_per_request=4, device="cpu")
    ctx.add_request("a", [1, 2, 3])
    staged = [np.array(a, copy=True) for a in (ctx._kv_writer._positions_dev,
                                               ctx._kv_writer._offsets_dev,
                                               ctx._kv_writer._table_dev)]
    before = state(ctx)
    rows = np.ones((rows_given, 1, 4), np.float16)
    if per_layer:
        with pytest.raises(ValueError, match=r"^k: expected shape \(3, 1, 4\)"):
            ctx.write_kv(["a"], rows, rows, layer=1)
    else:
        with pytest.raises(ValueError, match=r"^k\[0\]: expected shape \(3, 1, 4\)"):
            ctx.write_kv(["a"], [rows, rows], [rows, rows])
    assert state(ctx) == before
    for a, b in zip(staged, (ctx._kv_writer._positions_dev, ctx._kv_writer._offsets_dev,
                             ctx._kv_writer._table_dev)):
        np.testing.assert_array_equal(a, b)
    # a later layer short of rows is caught before the first layer is written
    good = np.ones((3, 1, 4), np.float16)
    if not per_layer:
        with pytest.raises(ValueError, match=r"^k\[1\]: expected shape \(3, 1, 4\)"):
            ctx.write_kv(["a"], [good, rows], [good, rows])
        assert state(ctx) == before
    ctx.write_kv(["a"], [good, good], [good, good])     # the right count is accepted


def test_a_twin_stores_mamba_states_in_its_own_cache():
    """``twin`` (a deep copy) is an oracle only if its copies read and write its own arrays:
    a deep copy of a view is a new array, so the copies' views are made again."""
    ctx = make_ctx(40, bs=4, mamba=1, slots=6, rows=4, max_blocks=6)
    ctx.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    live = ctx.mamba_slot("a")
    loop = twin(ctx)
    for c, value in ((ctx, 7), (loop, 5)):
        c.mamba_conv_states[:, live] = value
        c.commit_step()
    for c, value in ((ctx, 7), (loop, 5)):     # the last block's state is the live one
        m = c.mamba_slot_allocator
        slot = int(m.block_to_slot[c.block_ids("a")[-1]])
        assert slot >= 0 and (m.conv_states[:, slot] == value).all()


def test_an_array_id_after_a_cached_batch_is_refused_as_unhashable():
    """The repeated-batch shortcut of the rows lookup compares ids; one that compares
    ambiguously (a NumPy array) falls through to the check that names it."""
    ctx = make_ctx(40, bs=4, rows=4, max_blocks=6)
    ctx.add_request(5, [1, 2, 3])
    ctx.commit_step()
    ctx.extend_requests([5], [5])
    ctx.commit_step()
    before = ctx.num_computed_tokens(5), ctx.block_ids(5).tolist()
    with pytest.raises(TypeError, match=r"request_ids\[0\]: expected a hashable id"):
        ctx.extend_requests([np.array([5, 6])], [6])
    assert (ctx.num_computed_tokens(5), ctx.block_ids(5).tolist()) == before


@pytest.mark.parametrize("seed", [1, 2, 3, 5])
def test_a_twin_with_a_registration_backlog_follows_the_original(seed):
    """``twin`` is the oracle of many tests: with a backlog (budget 1), its copy records the
    blocks dropped while blocks wait (the drop hook of the copy's allocator) and pins the
    blocks the backlog will link to, as the original does, so both end in the same state."""
    rng = np.random.default_rng(seed)
    ctxs = [make_ctx(14, bs=2, mamba=1, slots=8, rows=4, registration_budget=1)]
    live, next_id = [], 0
    for step in range(60):
        u = rng.random()
        if u < 0.3 or not live:
            kind, arg = 0, (next_id, rng.integers(0, 3, int(rng.integers(1, 9))).tolist())
            next_id += 1
        elif u < 0.8:
            kind, arg = 1, rng.integers(0, 3, len(live)).tolist()
        else:
            kind, arg = 2, live[int(rng.integers(len(live)))]
        done = []
        for c in ctxs:
            try:
                if kind == 0:
                    c.add_request(*arg)
                elif kind == 1:
                    c.extend_requests(live, arg)
                else:
                    c.release_requests([arg])
                done.append(True)
            except (CacheCapacityError, ValueError):     # no room, or a sequence is full
                done.append(False)
            if (c._requests.pending_end >= 0).any():
                c.commit_step()
        assert len(set(done)) == 1
        if done[0] and kind == 0:
            live.append(arg[0])
        elif done[0] and kind == 2:
            live.remove(arg)
        if step == 10:
            ctxs.append(twin(ctxs[0]))
        if len(ctxs) == 2:
            a, b = (c._registration for c in ctxs)
            assert (a._dropped, list(a._drop_log)) == (b._dropped, list(b._drop_log))
    original, copied = ctxs
    assert state(original) == state(copied)
