"""Stateful test: KVBlockAllocator against a plain-Python model of the reference semantics.

The model keeps dicts and sets and recomputes everything from definitions (no NumPy): which
cached blocks are evictable, the leaf-peel order by (timestamp, id), parent resolution and
orphaning, the rejection rules of registration, retain and release. Every rule, rejected calls
included, is followed by ``check_invariants()`` and a full comparison with the model.
"""

from __future__ import annotations

import heapq

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hcache.contexts import KVBlockAllocator

N = 6
HASHES = st.integers(1, 10)


class Model:
    def __init__(self, n, policy, caching):
        self.n, self.policy, self.caching = n, policy, caching
        self.reset()

    def reset(self):
        self.ref = [0] * self.n
        self.hash = {}      # block -> hash
        self.parent = {}    # registered block -> parent block or None
        self.ts = [0] * self.n
        self.clock = 0

    @property
    def keeps_cached(self):
        return self.caching and self.policy == "lru"

    def is_free(self, b):
        return self.ref[b] == 0 and b not in self.hash

    def free(self):
        return {b for b in range(self.n) if self.is_free(b)}

    def cached(self):
        return {b for b in self.hash if self.ref[b] == 0}

    def evictable(self):
        if not self.keeps_cached:
            return set()
        blocked = set()
        for b in self.hash:
            if self.ref[b] > 0:
                p = self.parent[b]
                while p is not None and self.ref[p] == 0 and p not in blocked:
                    blocked.add(p)
                    p = self.parent[p]
        return self.cached() - blocked

    def peel(self, k):
        ev = self.evictable()
        if len(ev) < k:
            return None
        kids = {b: 0 for b in self.hash}
        for b in self.hash:
            if self.parent[b] is not None:
                kids[self.parent[b]] += 1
        heap = [(self.ts[b], b) for b in ev if kids[b] == 0]
        heapq.heapify(heap)
        out = []
        while len(out) < k:
            _, b = heapq.heappop(heap)
            out.append(b)
            p = self.parent[b]
            if p is not None:
                kids[p] -= 1
                if kids[p] == 0 and p in ev:
                    heapq.heappush(heap, (self.ts[p], p))
        return out

    def deregister(self, blocks):
        hashes = {self.hash.pop(b) for b in blocks}
        for b in blocks:
            del self.parent[b]
            self.ref[b] = 0
            self.ts[b] = 0
        for c, p in self.parent.items():
            if p in blocks:
                self.parent[c] = None
        return hashes

    def block_of(self, h):
        return next((b for b, hh in self.hash.items() if hh == h), None)


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "lru", "ref_zero"]),
                caching=st.sampled_from([True, True, True, False]))
    def setup(self, policy, caching):
        self.a = KVBlockAllocator(N, enable_prefix_caching=caching, eviction_policy=policy)
        self.m = Model(N, policy, caching)
        self.calls = []
        self.requests = []   # block lists, each holding one reference per entry
        self.next_hash = 100
        self.a.add_blocks_deregistered_observer(lambda ids, hs: self.calls.append((ids, hs)))

    # --- helpers ----------------------------------------------------------------------------

    def snapshot(self):
        a = self.a
        return (a.free_block_ids.tolist(), a.block_hashes.tolist(), a.block_ref_counts.tolist(),
                a.block_timestamps.tolist(), a.block_parent_ids.tolist(),
                dict(a.kv_hash_to_block_id), a.clock)

    def expect_rejected(self, exc, fn, *args):
        before = self.snapshot()
        try:
            fn(*args)
        except exc:
            pass
        else:
            raise AssertionError(f"{fn.__name__}{args} should have raised {exc.__name__}")
        assert self.snapshot() == before
        assert self.calls == []

    def take_calls(self):
        calls, self.calls = self.calls, []
        return calls

    def allocate(self, n):
        """Allocate through the allocator and the model; the new ids, or None."""
        m = self.m
        free = m.free()
        victims = []
        if len(free) < n:
            victims = m.peel(n - len(free)) if m.keeps_cached else None
        expect_ok = len(free) >= n or victims is not None
        assert self.a.is_memory_available(n) == expect_ok
        got = self.a.allocate_memory_blocks(n)
        if not expect_ok:
            assert got is None and self.take_calls() == []
            return None
        got = got.tolist()
        assert len(set(got)) == n and set(got) <= free | set(victims)
        if victims:
            event("allocation evicted cached blocks")
            # Short by k: every free block plus the k peeled ones are handed out.
            assert set(got) == free | set(victims)
            assert self.take_calls() == [(victims, m.deregister(victims))]
        assert self.take_calls() == []
        for b in got:
            m.ref[b], m.ts[b] = 1, m.clock
        return got

    def retain(self, ids):
        m = self.m
        if any(m.is_free(b) for b in ids):
            self.expect_rejected(ValueError, self.a.retain_memory_blocks, ids)
            return False
        self.a.retain_memory_blocks(ids)
        for b in ids:
            m.ref[b] += 1
            m.ts[b] = m.clock
        return True

    def release(self, ids):
        m = self.m
        counts = {b: ids.count(b) for b in ids}
        if any(m.ref[b] < c for b, c in counts.items()):
            event("release rejected")
            self.expect_rejected(ValueError, self.a.release_memory_blocks, ids)
            return
        self.a.release_memory_blocks(ids)
        dropped = []
        for b, c in counts.items():
            m.ref[b] -= c
            if m.ref[b] == 0 and b in m.hash and not m.keeps_cached:
                dropped.append(b)
        if dropped:
            event("release deregistered blocks")
            dropped.sort()
            assert self.take_calls() == [(dropped, m.deregister(dropped))]
        assert self.take_calls() == []

    def register(self, ids, hs, ps):
        m = self.m
        if self.rejects_registration(ids, hs):
            event("registration rejected")
            self.expect_rejected(ValueError, self.a.register_kv_block_hashes, ids, hs, ps)
            return
        self.a.register_kv_block_hashes(ids, hs, ps)
        event("registration accepted")
        if not m.caching:
            return
        for b, h, p in zip(ids, hs, ps or [0] * len(ids), strict=True):
            if b in m.hash:
                continue   # idempotent (or registered earlier in this batch)
            m.parent[b] = m.block_of(p) if p > 0 else None
            m.hash[b] = h

    def rejects_registration(self, ids, hs):
        m = self.m
        want = {}
        for b, h in zip(ids, hs, strict=True):
            if (b in m.hash and m.hash[b] != h) or m.is_free(b) or want.setdefault(b, h) != h:
                return True
        owners = {}
        for b, h in want.items():
            holder = m.block_of(h)
            if (holder is not None and holder != b) or owners.setdefault(h, b) != b:
                return True
        return False

    def chain_to(self, b):
        chain = [b]
        while self.m.parent[chain[-1]] is not None:
            chain.append(self.m.parent[chain[-1]])
        return chain[::-1]

    # --- rules: the life of requests --------------------------------------------------------

    @rule(data=st.data())
    def admit(self, data):
        """add_request: pin a cached chain (prefix hit), allocate new blocks, register the
        completed ones as a continuation of the chain. Often a running request finishes first
        (continuous batching), so the pool cycles through cached blocks and LRU eviction."""
        m = self.m
        # Booleans shrink to False, so the common paths are the False branches.
        if self.requests and not data.draw(st.booleans(), label="no finish"):
            self.release(self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1))))
        hit = []
        if m.hash and not data.draw(st.booleans(), label="no hit"):
            hit = self.chain_to(data.draw(st.sampled_from(sorted(m.hash)), label="hit block"))
            self.retain(hit)
        n = data.draw(st.integers(1, len(m.free()) + len(m.evictable()) + 1), label="n")
        got = self.allocate(n)
        if got is None:
            if hit:
                self.release(hit)   # undo the pin, as the context does
            return
        if not data.draw(st.booleans(), label="no registration"):
            k = data.draw(st.integers(1, len(got)), label="completed")
            if data.draw(st.booleans(), label="colliding hashes"):
                hs = data.draw(st.lists(HASHES, min_size=k, max_size=k, unique=True))
            else:
                hs = list(range(self.next_hash, self.next_hash + k))
                self.next_hash += k
            first = m.hash[hit[-1]] if hit else 0
            flat = data.draw(st.booleans(), label="unchained")   # equal-timestamp leaves
            self.register(got[:k], hs, [0] * k if flat else [first, *hs[:-1]])
        self.requests.append(hit + got)
        if data.draw(st.booleans(), label="end of step"):
            self.advance_clock(1)

    @rule(data=st.data())
    def finish(self, data):
        """A request ends: its references go in one call (rejected if a stray release already
        dropped one of them)."""
        if self.requests:
            self.release(self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1))))

    @rule(steps=st.integers(0, 3))
    def advance_clock(self, steps):
        assert self.a.advance_clock(steps) == self.m.clock + steps
        self.m.clock += steps

    # --- rules: direct and erroneous calls --------------------------------------------------

    @rule(data=st.data())
    def stray_release(self, data):
        """Arbitrary ids with duplicates, often more than held (rejected)."""
        live = [b for b in range(N) if not self.m.is_free(b)]
        pick = st.sampled_from(live) if live else st.integers(0, N - 1)
        self.release(data.draw(st.lists(pick, max_size=5)))

    @rule(data=st.data())
    def stray_retain(self, data):
        live = [b for b in range(N) if not self.m.is_free(b)]
        pick = st.sampled_from(live) if live and data.draw(st.booleans()) \
            else st.integers(0, N - 1)
        ids = data.draw(st.lists(pick, max_size=4))
        if self.retain(ids) and ids:
            self.requests.append(ids)

    @rule(data=st.data())
    def stray_register(self, data):
        """Arbitrary batches over mostly live blocks and colliding hashes."""
        live = [b for b in range(N) if not self.m.is_free(b)]
        k = data.draw(st.integers(1, 4))
        pick = st.sampled_from(live) if live and data.draw(st.booleans()) \
            else st.integers(0, N - 1)
        ids = data.draw(st.lists(pick, min_size=k, max_size=k))
        hs = data.draw(st.lists(HASHES, min_size=k, max_size=k))
        ps = data.draw(st.none() | st.lists(st.integers(0, 10), min_size=k, max_size=k))
        self.register(ids, hs, ps)

    @rule(data=st.data())
    def evict(self, data):
        m = self.m
        assert self.a.get_evictable_block_count() == len(m.evictable())
        assert self.a.get_allocatable_count() == len(m.free()) + len(m.evictable())
        matched = data.draw(st.integers(0, 3))
        n = data.draw(st.integers(1, len(m.evictable()) + 1))
        allocatable = len(m.free()) + len(m.evictable())
        assert self.a.is_memory_available(n, matched) == (
            len(m.free()) >= n or allocatable - matched >= n)
        victims = m.peel(n)
        assert self.a.evict_lru_blocks(n) == (victims is not None)
        if victims:
            event(f"evicted {len(victims)}, a chain: "
                  f"{any(m.parent[b] is not None for b in victims)}")
            assert self.take_calls() == [(victims, m.deregister(victims))]
        assert self.take_calls() == []

    @rule(dice=st.integers(0, 7))
    def reset(self, dice):
        if dice != 7:
            return   # keep resets rare (hypothesis favours small values)
        self.a.reset()
        self.m.reset()
        self.requests = []
        assert self.take_calls() == []

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "a"):
            return
        a, m = self.a, self.m
        a.check_invariants()
        assert a.block_ref_counts.tolist() == m.ref
        assert {b: h for b, h in enumerate(a.block_hashes.tolist()) if h != -1} == m.hash
        assert a.kv_hash_to_block_id == {h: b for b, h in m.hash.items()}
        assert set(a.free_block_ids.tolist()) == m.free()
        parents = a.block_parent_ids.tolist()
        assert {b: (None if parents[b] < 0 else parents[b]) for b in m.hash} == m.parent
        live = [b for b in range(N) if not m.is_free(b)]
        assert [int(a.block_timestamps[b]) for b in live] == [m.ts[b] for b in live]
        assert a.clock == m.clock
        assert (a.num_free_blocks, a.num_used_blocks, a.num_cached_blocks) == (
            len(m.free()), sum(r > 0 for r in m.ref), len(m.cached()))


AllocatorMachine.TestCase.settings = settings(stateful_step_count=30)
TestAllocatorMachine = AllocatorMachine.TestCase
