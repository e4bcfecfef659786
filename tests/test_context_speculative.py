"""Speculative decoding on the prefix-caching context (docs/design.md §6.9):
``DynamicInferenceContext.commit_draft`` with :class:`hcache.ContextDraftStates`.

Oracle: a twin context that only ever writes the accepted tokens (:mod:`context_draft_twins`).
Random accept patterns (0, partial, all ``k``; with and without a bonus token), admissions with
prefix hits, releases, and scheduled-block queries between the extension and the commit, over
many steps, for every layer kind the context supports (attention, latent MLA, sliding-window
layers in one block space and in their own, Mamba with both states, short convolutions, SSM
only, attention only) and several KV and state dtypes, on the cpu device and the emulated one:
after every step both are the same context (:meth:`Twins.compare`). A hypothesis property test
and a stateful machine drive the same pair.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from context_draft_twins import BS, Twins, configs
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import hcache
from hcache.contexts import DynamicInferenceContext, compute_block_hashes
from hcache.errors import CacheCapacityError

import helpers

NAMES = list(configs())
VOCAB = 12      # a small vocabulary: prompts and drafts share blocks often


def plan_key(plan):
    return (plan.start, plan.end, plan.skip_tokens, plan.num_matched_blocks,
            plan.restored_block >= 0)


def admit(tw, rid, prompt):
    """Admit into both; the prefix match (hits, skip, restore) must agree."""
    pd, pt = tw.admit(rid, prompt)
    assert plan_key(pd) == plan_key(pt), rid


def random_prompt(tw, rng, finished):
    """A prompt that often shares a prefix with a live or finished sequence."""
    pool = [t for t in tw.tokens.values()] + finished
    tail = rng.integers(0, VOCAB, int(rng.integers(1, 7))).tolist()
    if pool and rng.random() < 0.7:
        base = pool[int(rng.integers(len(pool)))]
        cut = int(rng.integers(1, len(base) + 1))
        return (base[:cut] + tail)[:tw.draft.max_sequence_length - 8]
    return tail


def verify_step(tw, rng, *, all_or_none=None):
    """One verify step of every request with room: random written counts and accept
    patterns (0, partial, all), a bonus token half of the time, sometimes a query."""
    bonus = bool(rng.integers(2))
    written, accepted = {}, {}
    for rid in list(tw.tokens):
        room = min(tw.k, tw.room(rid))
        if room < 1:
            continue
        w = int(rng.integers(1, room + 1))
        written[rid] = rng.integers(0, VOCAB, w).tolist()
        top = w - int(bonus)
        pattern = all_or_none or rng.choice(["none", "all", "some"])
        accepted[rid] = {"none": 0, "all": top}.get(pattern, int(rng.integers(0, top + 1)))
    query = None
    if rng.random() < 0.3:
        rid = next(iter(written), None)
        query = (tw.tokens[rid] + written[rid]) if rid is not None else [1, 2, 3, 4]
    return tw.verify(written, accepted, bonus=bonus, query=query)


def run_workload(tw, rng, steps):
    finished: list = []
    next_id = 0
    for _ in range(steps):
        r = rng.random()
        free = tw.draft.max_requests - len(tw.tokens)
        if free and (r < 0.25 or not tw.tokens):
            admit(tw, f"r{next_id}", random_prompt(tw, rng, finished))
            next_id += 1
        elif r < 0.33 and tw.tokens:
            rid = list(tw.tokens)[int(rng.integers(len(tw.tokens)))]
            finished.append(list(tw.tokens[rid]))
            tw.release([rid])
        else:
            verify_step(tw, rng)
        tw.compare()
    return finished


@pytest.mark.parametrize("name", NAMES)
def test_random_accept_patterns_equal_a_twin_that_wrote_only_the_kept_tokens(name):
    tw = Twins(name)
    run_workload(tw, np.random.default_rng(NAMES.index(name)), 70)


@pytest.mark.parametrize("device", [d for d in helpers.DEVICES if d != "cpu"])
@pytest.mark.parametrize("name", ["hybrid-f16", "window-blocks-bf16", "conv-only-fp8",
                                  "attention-only-u8"])
def test_random_accept_patterns_on_the_device(name, device):
    """The CUDA path: the emulated device (runs the real kernels), a GPU in the gpu tier."""
    tw = Twins(name, device)
    run_workload(tw, np.random.default_rng(100 + NAMES.index(name)), 30)


@pytest.mark.parametrize("pattern", ["none", "all"])
def test_all_or_nothing_accepts(pattern):
    tw = Twins("hybrid-f16")
    rng = np.random.default_rng(7)
    admit(tw, "a", [1, 2, 3])
    admit(tw, "b", [1, 2, 3, 4, 5, 6, 7])
    for _ in range(12):
        verify_step(tw, rng, all_or_none=pattern)
        tw.compare()


def test_a_block_completed_only_by_rejected_drafts_is_released_not_registered():
    tw = Twins("hybrid-f16")
    admit(tw, "a", [1, 2, 3])                       # 3 tokens: block 0 open
    blocks_before = tw.draft.kv_block_allocator.num_free_blocks
    hashes_before = set(tw.draft.kv_block_allocator.kv_hash_to_block_id)
    # 5 written tokens complete block 0 and open block 1; only 0 accepted.
    out = tw.verify({"a": [4, 5, 6, 7, 8]}, {"a": 0}, query=[1, 2, 3, 4, 5, 6, 7, 8])
    tw.compare()
    assert out["released_blocks"] == 1 and out["rejected_tokens"] == 5
    assert tw.draft.kv_block_allocator.num_free_blocks == blocks_before
    assert set(tw.draft.kv_block_allocator.kv_hash_to_block_id) == hashes_before
    assert tw.draft.num_computed_tokens("a") == 3
    for _ in range(3):     # the next steps register nothing of the rejected block either
        tw.verify({"a": [9]}, {"a": 1})
        tw.compare()
    # The rejected block [1, 2, 3, 4] was never registered: its prompt hits nothing, the
    # accepted one [1, 2, 3, 9] hits.
    admit(tw, "rejected", [1, 2, 3, 4, 5, 6, 7, 8, 1])
    admit(tw, "accepted", [1, 2, 3, 9, 9, 1])
    tw.compare()
    assert tw.draft.request_stats("rejected").kv_hit_blocks == 0
    assert tw.draft.request_stats("accepted").kv_hit_blocks == 1


def test_the_live_state_is_the_state_after_the_last_kept_token():
    tw = Twins("hybrid-f16")
    admit(tw, "a", [5, 6])
    tw.verify({"a": [1, 2, 3, 4]}, {"a": 2}, bonus=True)     # keeps 3 of 4
    tw.compare()
    assert tw.tokens["a"] == [5, 6, 1, 2, 3]


@pytest.mark.emulated
def test_commit_draft_makes_no_host_sync_and_no_allocation_on_the_device(emu_rt):
    """The two launches (snapshot copy, live-state scatter) and commit_step stage their
    host tables through the pinned ring: no sync, no device allocation."""
    tw = Twins("hybrid-f16", "cuda")
    admit(tw, "a", [1, 2, 3])
    admit(tw, "b", [4, 5, 6, 7, 8, 9])
    plan = tw.draft.extend_requests(["a", "b"], [[1, 2, 3, 4, 5], [6, 7, 8]])
    tw.forward(tw.draft, list(plan), drafting=True)
    with pytest.raises(TypeError, match="accepted: expected host integers, got device memory"):
        tw.draft.commit_draft(["a", "b"], tw.draft.xp.asarray(np.array([3, 2], np.int32)),
                              draft_states=tw.states)
    emu_rt.synchronize()
    syncs, allocations = emu_rt.counters["syncs"], emu_rt.counters["allocations"]
    out = tw.draft.commit_draft(["a", "b"], [3, 2], draft_states=tw.states)
    assert emu_rt.counters["syncs"] == syncs
    assert emu_rt.counters["allocations"] == allocations
    assert out["rejected_tokens"] == 3 and tw.draft.num_computed_tokens("a") == 6


@pytest.mark.parametrize("policy", ["lru", "ref_zero"])
def test_under_pool_pressure_only_accepted_blocks_are_ever_registered(policy):
    """A small pool (the verify steps' blocks evict cached ones, extensions are refused):
    every hash ever in the KV and Mamba maps is the hash of a block of accepted tokens of
    some request, and the context stays consistent."""
    kw = dict(configs()["hybrid-f16"], num_blocks=14, mamba_cache_slots=6,
              eviction_policy=policy)
    tw = Twins("hybrid-f16")
    tw.draft = DynamicInferenceContext(**kw, device="cpu")
    tw.states = hcache.ContextDraftStates(tw.draft, tw.k)
    ctx, rng = tw.draft, np.random.default_rng(11)
    accepted_hashes: set = set()
    evicted = refused = 0
    dropped: list = []
    ctx.kv_block_allocator.add_blocks_deregistered_observer(lambda ids, _: dropped.append(ids))
    for step in range(150):
        if len(tw.tokens) < 3 and rng.random() < 0.3:
            prompt = rng.integers(0, 4, int(rng.integers(2, 12))).tolist()
            try:
                plan = ctx.add_request(f"r{step}", prompt)
            except CacheCapacityError:
                refused += 1
                continue
            tw.forward(ctx, [plan])
            ctx.commit_step()
            tw.tokens[f"r{step}"] = prompt
        elif tw.tokens and rng.random() < 0.1:
            rid = list(tw.tokens)[0]
            ctx.release_requests([rid])
            del tw.tokens[rid]
        elif tw.tokens:
            ids = [r for r in tw.tokens if tw.room(r) > 0]
            written = {r: rng.integers(0, 4, int(rng.integers(1, min(tw.k, tw.room(r)) + 1)))
                       .tolist() for r in ids}
            before = len(dropped)
            try:
                plan = ctx.extend_requests(ids, [written[r] for r in ids])
            except CacheCapacityError:
                refused += 1
                ctx.release_requests([ids[0]])
                del tw.tokens[ids[0]]
                continue
            evicted += len(dropped) > before     # the verify step's blocks evicted some
            tw.forward(ctx, list(plan), drafting=True)
            if rng.random() < 0.5:     # hashes the written blocks early
                ctx.shares_pending_blocks(rng.integers(0, 4, 8))
            accepted = [int(rng.integers(0, len(written[r]) + 1)) for r in ids]
            ctx.commit_draft(ids, accepted, draft_states=tw.states)
            for r, a in zip(ids, accepted):
                tw.tokens[r] += written[r][:a]
        for toks in tw.tokens.values():
            accepted_hashes |= set(compute_block_hashes(toks, BS))
        ctx.register_completed_blocks()
        assert set(ctx.kv_block_allocator.kv_hash_to_block_id) <= accepted_hashes
        assert set(ctx.mamba_slot_allocator.hash_to_block_id) <= accepted_hashes
        ctx.check_invariants()
        held = np.concatenate([ctx.block_ids(r) for r in tw.tokens] + [np.zeros(0, np.int32)])
        refs = np.bincount(held, minlength=ctx.kv_block_allocator.block_ref_counts.shape[0])
        assert ctx.kv_block_allocator.block_ref_counts.tolist() == refs.tolist()  # no leak
    assert refused and (evicted or policy == "ref_zero")    # the pool was under pressure


# --- errors: named, and nothing changes -----------------------------------------------------

def _pending(tw):
    tw.draft.extend_requests(["a", "b"], [[1, 2, 3], [4, 5]])


def _snapshot(ctx):
    rq = ctx._requests
    return (rq.lengths.tobytes(), rq.num_blocks.tobytes(), rq.pending_end.tobytes(),
            rq.request_to_kv_block_ids.tobytes(), ctx.kv_block_allocator.num_free_blocks,
            ctx.stats.computed_tokens, np.asarray(ctx.mamba_ssm_states).tobytes())


@pytest.mark.parametrize("call, error, match", [
    (lambda tw: tw.draft.commit_draft(["a"], [0], draft_states=tw.states), ValueError,
     r"request_ids: expected every request with a scheduled step, got none for 'b'"),
    (lambda tw: tw.draft.commit_draft(["a", "b"], [0, 3], draft_states=tw.states), ValueError,
     r"accepted\[1\]: expected a count in \[0, 2\], got 3"),
    (lambda tw: tw.draft.commit_draft(["a", "b"], [0, 2], draft_states=tw.states,
                                      bonus_token=True), ValueError,
     r"accepted\[1\]: expected a count in \[0, 1\], got 2"),
    (lambda tw: tw.draft.commit_draft(["a", "b"], [-1, 0], draft_states=tw.states), ValueError,
     r"accepted\[0\]: expected a count in \[0, 3\], got -1"),
    (lambda tw: tw.draft.commit_draft(["a", "b"], [0.5, 1], draft_states=tw.states),
     TypeError, r"accepted: expected integers"),
    (lambda tw: tw.draft.commit_draft(["a", "b"], [0], draft_states=tw.states), ValueError,
     r"accepted: expected 2 entries, got 1"),
    (lambda tw: tw.draft.commit_draft(["a", "b"], [0, 0]), ValueError,
     r"draft_states: expected this context's ContextDraftStates"),
    (lambda tw: tw.draft.commit_draft(["a", "b"], [0, 0], draft_states=tw.twin), TypeError,
     r"draft_states: expected ContextDraftStates, got DynamicInferenceContext"),
    (lambda tw: tw.draft.commit_draft(["a", "b"], [0, 0],
                                      draft_states=hcache.ContextDraftStates(tw.twin, 4)),
     ValueError, r"draft_states: expected the draft states of this context"),
    (lambda tw: tw.draft.commit_draft(["a", "b"], [0, 0],
                                      draft_states=hcache.ContextDraftStates(tw.draft, 2)),
     ValueError, r"draft_states: expected room for the 3 tokens written for request_ids\[0\]"),
    (lambda tw: tw.draft.commit_draft(["a", "b"], [0, 0], draft_states=tw.states,
                                      bonus_token=1), TypeError,
     r"bonus_token: expected a bool, got int"),
    (lambda tw: tw.draft.commit_draft(["a", "b"], [0, 0], draft_states=tw.states,
                                      stream="s"), TypeError, r"stream"),
    (lambda tw: tw.draft.commit_draft(["a", "a"], [0, 0], draft_states=tw.states), ValueError,
     r"request_ids: expected distinct request ids"),
    (lambda tw: tw.draft.commit_draft(["a", "zz"], [0, 0], draft_states=tw.states),
     ValueError, r"request_ids\[1\]: expected an active request, got 'zz'"),
])
def test_bad_arguments_are_named_and_change_nothing(call, error, match):
    tw = Twins("hybrid-f16")
    admit(tw, "a", [1, 2, 3])
    admit(tw, "b", [1, 2, 3, 4, 5])
    _pending(tw)
    before = _snapshot(tw.draft)
    with pytest.raises(error, match=match):
        call(tw)
    assert _snapshot(tw.draft) == before


def test_a_prompt_step_or_a_request_without_a_step_is_refused():
    tw = Twins("hybrid-f16")
    admit(tw, "a", [1, 2, 3])
    tw.draft.extend_request("a", [4, 5])
    tw.draft.add_request("p", [7, 8, 9])
    with pytest.raises(ValueError, match=r"request_ids\[1\]: expected a request extended by "
                                         r"a verify step, got 'p' with its prompt scheduled"):
        tw.draft.commit_draft(["a", "p"], [0, 0], draft_states=tw.states)
    tw.draft.commit_step()
    tw.draft.extend_request("p", [4])
    with pytest.raises(ValueError, match=r"request_ids\[0\]: expected a request extended by "
                                         r"a verify step, got 'a' with no scheduled step"):
        tw.draft.commit_draft(["a"], [0], draft_states=tw.states)


def test_context_draft_states_arguments():
    ctx = Twins("hybrid-f16").draft
    with pytest.raises(TypeError, match="context: expected a DynamicInferenceContext"):
        hcache.ContextDraftStates(object(), 2)
    with pytest.raises(ValueError, match="max_draft_tokens: expected"):
        hcache.ContextDraftStates(ctx, 0)
    states = hcache.ContextDraftStates(ctx, 3)
    report = states.memory_report()
    assert report["draft_states"] == 3 * (ctx.mamba_conv_states.nbytes
                                          + ctx.mamba_ssm_states.nbytes)
    assert report["total"] == states.nbytes > report["draft_states"]
    assert states.conv_states.shape == (2, 4, 3, 2, 3)
    assert states.ssm_states.shape == (2, 4, 3, 2, 2)


# --- property and stateful tests --------------------------------------------------------------

@settings(max_examples=12, deadline=None)
@given(st.data())
def test_property_any_accept_sequence_equals_the_twin(data):
    name = data.draw(st.sampled_from(["hybrid-f16", "window-blocks-bf16", "conv-only-fp8",
                                      "ssm-only-int8", "no-prefix-caching"]))
    tw = Twins(name, max_draft_tokens=4)
    admit(tw, "a", data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=9)))
    admit(tw, "b", data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=9)))
    for _ in range(data.draw(st.integers(1, 8))):
        bonus = data.draw(st.booleans())
        written, accepted = {}, {}
        for rid in tw.tokens:
            w = data.draw(st.integers(1, min(4, tw.room(rid))))
            written[rid] = data.draw(st.lists(st.integers(0, 5), min_size=w, max_size=w))
            accepted[rid] = data.draw(st.integers(0, w - int(bonus)))
        query = data.draw(st.none() | st.lists(st.integers(0, 5), min_size=4, max_size=12))
        tw.verify(written, accepted, bonus=bonus, query=query)
        tw.compare()
    admit(tw, "c", tw.tokens["a"][:8] + [1])          # a prefix hit on accepted blocks only
    tw.compare()


class SpeculativeContextMachine(RuleBasedStateMachine):
    """Admissions, verify steps with any accept pattern, releases and prefix-hit probes on a
    speculative context and its twin; the invariant is that they are the same context."""

    def __init__(self):
        super().__init__()
        self.tw = Twins("hybrid-f16", max_draft_tokens=3)
        self.next_id = 0
        self.finished: list = []

    @precondition(lambda self: len(self.tw.tokens) < self.tw.draft.max_requests)
    @rule(tokens=st.lists(st.integers(0, 5), min_size=1, max_size=10),
          reuse=st.booleans())
    def admit(self, tokens, reuse):
        pool = list(self.tw.tokens.values()) + self.finished
        prompt = (pool[-1][:8] + tokens[:2]) if reuse and pool else tokens
        admit(self.tw, f"r{self.next_id}", prompt)
        self.next_id += 1

    @precondition(lambda self: self.tw.tokens)
    @rule(data=st.data(), bonus=st.booleans(), query=st.booleans())
    def verify(self, data, bonus, query):
        written, accepted = {}, {}
        for rid in self.tw.tokens:
            if self.tw.room(rid) < 1:
                continue
            w = data.draw(st.integers(1, min(3, self.tw.room(rid))))
            written[rid] = data.draw(st.lists(st.integers(0, 5), min_size=w, max_size=w))
            accepted[rid] = data.draw(st.sampled_from([0, w - int(bonus)])
                                      | st.integers(0, w - int(bonus)))
        q = next(iter(self.tw.tokens.values()))[:8] if query else None
        self.tw.verify(written, accepted, bonus=bonus, query=q)

    @precondition(lambda self: self.tw.tokens)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tw.tokens)))
        self.finished.append(list(self.tw.tokens[rid]))
        self.tw.release([rid])

    @invariant()
    def same_context_as_the_twin(self):
        # (``check_invariants`` is Hypothesis's own name for the runner of these; compare()
        # calls both contexts' check_invariants.)
        self.tw.compare()


SpeculativeContextMachine.TestCase.settings = settings(max_examples=15,
                                                       stateful_step_count=20, deadline=None)
test_speculative_context_machine = SpeculativeContextMachine.TestCase
