"""Stateful test: the incrementally kept evictable leaves (hcache/contexts/evictable_leaves.py)
against the full-scan leaf peeling they replace, kept here as the oracle.

``old_peel`` is the eviction rule as the allocator computed it before issue 24: rebuild the
evictable mask over the whole pool (cached blocks with no used or pinned descendant), sort its
childless blocks by (timestamp, id), and peel through a heap. Every eviction-bearing call of the
allocator (``allocate_memory_blocks``, ``allocate_memory_blocks_per_request``,
``evict_lru_blocks``) must take exactly the oracle's victims, in its order; the batch allocation
must hand out what consecutive single allocations give a twin allocator; and the queries
``can_allocate_memory_blocks`` / ``is_memory_available`` must agree with the oracle's counts.
Pins (``pending_parents``, the registration backlog's parents) come and go at random.
"""

from __future__ import annotations

import copy
import heapq
from types import MethodType

import hypothesis.strategies as st
import numpy as np
from hypothesis import event, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_decode_fast_paths import outcome, plan_tuple, random_prompt, random_release, ready_ids
from test_dynamic_context import make_ctx, state

from hcache.contexts import KVBlockAllocator

N = 16


def old_evictable_mask(a: KVBlockAllocator, pinned) -> np.ndarray:
    """The pre-issue-24 full scan: cached blocks without a used or pinned descendant."""
    registered = a.block_hashes != -1
    used = a.block_ref_counts > 0
    cached = registered & ~used
    blocked = np.zeros(a.num_blocks, dtype=bool)
    if not a.caches_released_blocks:
        return blocked
    parents = list(a.block_parent_ids[registered & used].tolist()) + list(pinned)
    while parents:
        p = parents.pop()
        if p >= 0 and cached[p] and not blocked[p]:
            blocked[p] = True
            parents.append(int(a.block_parent_ids[p]))
    return cached & ~blocked


def old_peel(a: KVBlockAllocator, n: int, pinned=(), retained=()):
    """The first ``n`` victims of leaf peeling over the full scan, or None."""
    retained = set(retained)
    evictable = old_evictable_mask(a, list(pinned) + sorted(retained))
    for b in retained:
        evictable[b] = False
    if np.count_nonzero(evictable) < n:
        return None
    ts = a.block_timestamps
    children = a.block_child_counts.copy()
    heap = [(int(ts[b]), int(b)) for b in np.flatnonzero(evictable & (children == 0))]
    heapq.heapify(heap)
    out = []
    while len(out) < n:
        _, b = heapq.heappop(heap)
        out.append(b)
        p = int(a.block_parent_ids[b])
        if p >= 0:
            children[p] -= 1
            if children[p] == 0 and evictable[p]:
                heapq.heappush(heap, (int(ts[p]), p))
    return out


class LeavesMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.a = KVBlockAllocator(N)
        self.pins = np.zeros(0, np.int64)
        self.a.pending_parents = lambda: self.pins
        self.calls = []
        self.a.add_blocks_deregistered_observer(lambda ids, hs: self.calls.append(ids))
        self.requests = []      # lists of block ids, one reference each
        self.next_hash = 1

    def victims(self):
        calls, self.calls = self.calls, []
        return [b for ids in calls for b in ids]

    def chain(self, b):
        out = [b]
        while self.a.block_parent_ids[out[-1]] >= 0:
            out.append(int(self.a.block_parent_ids[out[-1]]))
        return out[::-1]

    @rule(data=st.data())
    def admit(self, data):
        """Match a cached chain (retain), allocate the rest, register a continuation."""
        a = self.a
        hit = []
        registered = np.flatnonzero(a.block_hashes != -1).tolist()
        if registered and data.draw(st.booleans(), label="hit"):
            hit = self.chain(data.draw(st.sampled_from(registered), label="hit block"))
        n = data.draw(st.integers(0, N), label="new blocks")
        expect = len(a.free_block_ids) >= n or old_peel(
            a, n - a.num_free_blocks, self.pins.tolist(), hit) is not None
        assert a.can_allocate_memory_blocks(n, hit) == expect
        if not expect:
            return
        if hit:
            a.retain_memory_blocks(hit)
        oracle = old_peel(a, max(0, n - a.num_free_blocks), self.pins.tolist())
        got = a.allocate_memory_blocks(n)
        assert got is not None
        assert self.victims() == (oracle or [])
        got = got.tolist()
        if got and data.draw(st.booleans(), label="register"):
            k = data.draw(st.integers(1, len(got)), label="completed")
            hs = list(range(self.next_hash, self.next_hash + k))
            self.next_hash += k
            first = int(a.block_hashes[hit[-1]]) if hit else 0
            a.register_kv_block_hashes(got[:k], hs, [first, *hs[:-1]])
        if hit or got:
            self.requests.append(hit + got)

    @rule(data=st.data())
    def extend(self, data):
        """One block each for some requests: the batch allocation against single calls on a
        twin, and against the oracle's victims."""
        a = self.a
        counts = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=5), label="counts")
        twin = copy.deepcopy(a)
        twin.pending_parents = a.pending_parents
        short = sum(counts) - a.num_free_blocks
        oracle = old_peel(a, short, self.pins.tolist()) if short > 0 else []
        got = a.allocate_memory_blocks_per_request(counts)
        if oracle is None:
            assert got is None and self.victims() == []
            return
        assert self.victims() == oracle
        singles = [twin.allocate_memory_blocks(k) for k in counts]
        assert self.victims() == oracle     # the twin shares the observer: the same victims
        assert got.tolist() == np.concatenate(singles).tolist()
        assert np.array_equal(twin.free_block_ids, a.free_block_ids)
        event(f"batch allocation evicted: {short > 0}")
        start = 0
        for k in counts:
            if k:
                self.requests.append(got[start:start + k].tolist())
            start += k

    @rule(data=st.data())
    def finish(self, data):
        if self.requests:
            self.a.release_memory_blocks(
                self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1))))

    @rule(data=st.data())
    def pin(self, data):
        """The backlog's parents change: registered blocks, any state."""
        a = self.a
        registered = np.flatnonzero(a.block_hashes != -1).tolist()
        leaves = np.flatnonzero((a.block_hashes != -1) & (a.block_ref_counts == 0)
                                & (a.block_child_counts == 0)).tolist()
        pool = leaves if leaves and data.draw(st.booleans(), label="a leaf") else registered
        pick = data.draw(st.lists(st.sampled_from(pool), max_size=3)) if pool else []
        self.pins = np.asarray(pick, np.int64)

    @rule(n=st.integers(0, N))
    def evict(self, n):
        a = self.a
        oracle = old_peel(a, n, self.pins.tolist())
        expect = oracle is not None
        assert a.is_memory_available(n + a.num_free_blocks) == expect
        assert a.evict_lru_blocks(n) == expect
        assert self.victims() == (oracle or [])
        if oracle:
            event("evicted")

    @rule(steps=st.integers(0, 2))
    def tick(self, steps):
        self.a.advance_clock(steps)

    @invariant()
    def consistent(self):
        if hasattr(self, "a"):
            self.a.check_invariants()
            assert self.a.get_evictable_block_count() == int(
                old_evictable_mask(self.a, self.pins.tolist()).sum())


TestLeaves = LeavesMachine.TestCase
TestLeaves.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# --- a whole context against one that evicts by the full scan -----------------------------------


def as_full_scan(ctx):
    """``ctx`` whose KV allocator evicts by :func:`old_peel` and allocates a batch request by
    request, as before issue 24 (its incremental leaves are kept but never read)."""
    kv = ctx.kv_block_allocator

    def peel(self, n, keep=(), commit=True):
        pinned = [] if self.pending_parents is None else self.pending_parents().tolist()
        out = old_peel(self, n, pinned, keep)
        return None if out is None else np.asarray(out, dtype=np.int64)

    def per_request(self, counts):
        if not self.is_memory_available(sum(counts)):
            return None
        return np.concatenate([self.allocate_memory_blocks(k) for k in counts])

    kv._peel = MethodType(peel, kv)
    kv.allocate_memory_blocks_per_request = MethodType(per_request, kv)
    return ctx


def drive_full_scan_twins(seed) -> int:
    """Run a context and its :func:`as_full_scan` twin side by side; returns the number of
    blocks deregistered."""
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 2, 3]))
    kw = dict(bs=bs, mamba=1, slots=int(rng.integers(2, 7)), rows=int(rng.integers(3, 7)),
              max_blocks=24 // bs, registration_budget=[None, 1, 2][int(rng.integers(3))])
    blocks = int(rng.integers(24 // bs, 48 // bs))    # one or two rows at full length
    new, old = make_ctx(blocks, **kw), as_full_scan(make_ctx(blocks, **kw))
    evictions = ([], [])
    for c, log in zip((new, old), evictions, strict=True):
        c.kv_block_allocator.add_blocks_deregistered_observer(
            lambda ids, hs, g=log: g.extend(ids))

    def settled(c):
        """What does not depend on when the backlog is hashed (the full scan asks for the
        backlog's parents at other times, which hashes it earlier: docs/design.md §6.8)."""
        kv, t = c.kv_block_allocator, c._requests
        return ([a.tolist() for a in (kv.free_block_ids, kv.block_ref_counts,
                                      kv.block_timestamps, t.request_to_kv_block_ids,
                                      t.lengths, t.computed, np.asarray(c.mamba_conv_states),
                                      np.asarray(c.mamba_ssm_states))],
                list(c.request_ids), c.stats.kv_hit_blocks, c.stats.skipped_tokens,
                c.stats.mamba_hits)

    def both(f):
        got = [outcome(lambda c=c: f(c)) for c in (new, old)]
        assert got[0] == got[1]
        assert evictions[0] == evictions[1]     # the same victims, in the same order
        assert settled(new) == settled(old)

    next_id = 0
    for _ in range(120):
        op = rng.integers(10)
        ready = ready_ids(new)
        if op < 2 or not new.request_ids:
            tokens = random_prompt(rng)
            next_id += 1
            both(lambda c, r=next_id, t=tokens: c.add_request(r, t).row)
        elif op < 8 and ready:
            toks = rng.integers(0, 3, len(ready)) if rng.integers(4) else \
                [rng.integers(0, 3, int(rng.integers(1, 4))).tolist() for _ in ready]
            both(lambda c, i=ready, t=toks: plan_tuple(c.extend_requests(i, t)))
            both(lambda c: c.commit_step() and None)
        elif op < 9:
            both(lambda c: c.commit_step() and None)
        else:
            gone = random_release(rng, new.request_ids)
            both(lambda c, g=gone: c.release_requests(g))
    # Caught up, every table and map agrees. Which Mamba slot holds a state may not: the full
    # scan's twin asks for the backlog's parents between per-request allocations, which hashes
    # the backlog at other steps, and registration (so slot release) follows hashing (§6.8).
    a, b = state(new), state(old)
    m = new.mamba_slot_allocator
    if m is not None:
        slotted = [np.flatnonzero(np.asarray(x[11]) >= 0).tolist() for x in (a, b)]
        assert slotted[0] == slotted[1]
        a, b = a[:11] + a[12:], b[:11] + b[12:]
    assert a == b
    for c in (new, old):
        c.check_invariants()
    return len(evictions[0])


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_context_equals_the_full_scan_context(seed):
    """Admissions with shared stems, decode steps, commits and releases under KV-block pressure
    (a pool that fills with cached blocks): every outcome, every piece of state (hit counts
    included) and every live Mamba byte equals that of a context evicting by the full scan."""
    event(f"blocks deregistered: {min(drive_full_scan_twins(seed), 5)}+")


def test_the_full_scan_twins_evict():
    """The side-by-side runs do evict, most of them (else they would prove little)."""
    assert sum(drive_full_scan_twins(seed) > 0 for seed in range(8)) >= 4
