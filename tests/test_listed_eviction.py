"""The element-by-element paths of a serving step's eviction (issue 24, sixth pass) change cost,
not behaviour.

Oracles: the general NumPy paths they stand beside, forced by the thresholds set to nothing
(``kv_block_allocator._LISTED`` / ``_FEW``, ``block_forest._SCALAR``,
``mamba_slot_pool._LISTED``, ``free_block_stack._FEW``): ``BlockForest.unlink`` against
``unlink_listed``; ``MambaSlotPool.release`` of the sorted ids against the Mamba observer's slot
pushes; and twin allocators, and twin contexts, one on each path, driven side by side (victims
and their order, free stack, ids handed out, ref counts, timestamps, forest, leaves, observer
calls, Mamba slots and hashes equal after every operation). Observers that mutate their
arguments check that no observer sees another's changes.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import hypothesis.strategies as st
import numpy as np
from hypothesis import event, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_decode_fast_paths import (
    forest_state,
    outcome,
    pool_state,
    pools,
    snapshot,
    twin_contexts,
    twin_steps,
    unlink_cases,
)

from hcache.contexts import KVBlockAllocator
from hcache.contexts import block_forest as forest_module
from hcache.contexts import free_block_stack as stack_module
from hcache.contexts import kv_block_allocator as allocator_module
from hcache.contexts import mamba_slot_pool as mamba_module
from hcache.contexts.mamba_slot_allocator import MambaSlotAllocator


@contextlib.contextmanager
def general_paths():
    """Every threshold of the element-by-element paths set to nothing: the NumPy paths run."""
    modules = ((allocator_module, "_LISTED"), (allocator_module, "_FEW"),
               (forest_module, "_SCALAR"), (mamba_module, "_LISTED"), (stack_module, "_FEW"))
    saved = [getattr(m, name) for m, name in modules]
    for m, name in modules:
        setattr(m, name, -1)
    try:
        yield
    finally:
        for (m, name), value in zip(modules, saved, strict=True):
            setattr(m, name, value)


# --- BlockForest.unlink_listed ----------------------------------------------------------------

@given(case=unlink_cases())
def test_unlink_listed_equals_the_vectorised_unlink(case):
    """Any registered blocks of any forest (leaves with parents, parents whose children stay:
    orphans, dangling roots before and after), as a list: the same hashes, the same parents
    left childless (ascending), the same forest and dangling roots as the NumPy ``unlink``."""
    f, gone = case
    if not len(gone):
        return
    twin = copy.deepcopy(f)
    hashes, childless = f.unlink_listed(gone.tolist())
    with general_paths():
        want_hashes, want_childless = twin.unlink(gone.copy())
    assert hashes == want_hashes
    assert type(childless) is list and childless == want_childless.tolist()
    assert forest_state(f) == forest_state(twin)
    assert (f.dangling.tolist(), f.num_dangling) == (twin.dangling.tolist(), twin.num_dangling)
    assert f.broken_invariants() == []


# --- the Mamba observer's slot release ------------------------------------------------------


@given(pools(), st.data())
def test_mamba_observer_releases_slots_as_the_pool_does(case, data):
    """Deregistered blocks (owners and not, any order) lose their slots one by one in the
    order ``MambaSlotPool.release`` of the sorted ids pushes them, and their hashes are
    dropped, on either side of the threshold."""
    pool, _, _, _ = case
    nb = len(pool.block_to_slot)
    ids = data.draw(st.lists(st.integers(0, nb - 1), unique=True, max_size=10))
    hashes = set(data.draw(st.lists(st.integers(1, 50), max_size=4)))
    twin = copy.deepcopy(pool)
    dropped = []
    fake = SimpleNamespace(_pool=pool, _hashes=SimpleNamespace(drop_hashes=dropped.append))
    listed, mamba_module._LISTED = mamba_module._LISTED, data.draw(st.sampled_from([-1, 32]))
    try:        # -1: the pool's NumPy release whatever the count
        MambaSlotAllocator._on_kv_deregistered(fake, list(ids), hashes)
    finally:
        mamba_module._LISTED = listed
    twin.release(np.sort(np.array(ids, np.int64)))
    assert pool_state(pool) == pool_state(twin)
    assert dropped == [hashes]
    assert pool.broken_invariants() == []


# --- twin allocators: the listed paths against the general ones -----------------------------

N = 12


class TwinAllocators(RuleBasedStateMachine):
    """Two allocators under the same calls, the second on the general paths; observers that
    clear their arguments run first, so a shared list or set would show."""

    @initialize(policy=st.sampled_from(["lru", "lru", "ref_zero"]))
    def setup(self, policy):
        self.pair = [KVBlockAllocator(N, eviction_policy=policy) for _ in range(2)]
        self.seen = ([], [])
        for a, log in zip(self.pair, self.seen, strict=True):
            a.add_blocks_deregistered_observer(lambda ids, hs: (ids.clear(), hs.clear()))
            a.add_blocks_deregistered_observer(lambda ids, hs, g=log: g.append((ids, hs)))
            a.add_blocks_deregistered_observer(lambda ids, hs: (ids.append(-7), hs.add(-7)))
        self.pins = np.zeros(0, np.int64)
        self.held = []      # block lists, one reference per entry
        self.next_hash = 1

    def both(self, fn):
        got = [outcome(lambda: fn(self.pair[0]))]
        with general_paths():
            got.append(outcome(lambda: fn(self.pair[1])))
        as_lists = [g.tolist() if isinstance(g, np.ndarray) else g for g in got]
        assert as_lists[0] == as_lists[1]
        return got[0]

    @rule(n=st.integers(1, 6))
    def allocate(self, n):
        got = self.both(lambda a: a.allocate_memory_blocks(n))
        if isinstance(got, np.ndarray):
            self.held.append(got.tolist())

    @rule(counts=st.lists(st.integers(0, 3), min_size=1, max_size=4))
    def allocate_per_request(self, counts):
        got = self.both(lambda a: a.allocate_memory_blocks_per_request(counts))
        if isinstance(got, np.ndarray) and len(got):
            self.held.append(got.tolist())

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def register_chain(self, data):
        """A held list registered as one chain (a prompt's blocks), under fresh hashes or a
        parent already registered."""
        blocks = data.draw(st.sampled_from(self.held))
        a = self.pair[0]
        fresh = [b for b in blocks if a.block_hashes[b] == -1]
        if not fresh:
            return
        registered = [h for h in a.kv_hash_to_block_id if h > 0]
        parent = data.draw(st.sampled_from([0] + registered))
        hs = list(range(self.next_hash, self.next_hash + len(fresh)))
        self.next_hash += len(fresh)
        self.both(lambda x: x.register_kv_block_hashes(fresh, hs, [parent] + hs[:-1]))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, len(self.held) - 1))
        blocks = self.held.pop(i)
        self.both(lambda a: a.release_memory_blocks(blocks))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_one_request(self, data):
        """What the context does for one finished request: its distinct held blocks, unchecked
        (element by element up to ``_FEW`` blocks)."""
        i = data.draw(st.integers(0, len(self.held) - 1))
        blocks = np.array(self.held.pop(i), np.int64)
        self.both(lambda a: a._release(blocks.copy()))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def retain_cached(self, data):
        cached = np.flatnonzero((self.pair[0].block_ref_counts == 0)
                                & (self.pair[0].block_hashes != -1)).tolist()
        if cached:
            blocks = data.draw(st.lists(st.sampled_from(cached), unique=True, max_size=3))
            if blocks:
                self.both(lambda a: a.retain_memory_blocks(blocks))
                self.held.append(blocks)

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        self.both(lambda a: a.evict_lru_blocks(n))

    @rule(data=st.data())
    def pin(self, data):
        """Pending parents (a registration backlog's): some registered blocks, or none."""
        registered = np.flatnonzero(self.pair[0].block_hashes != -1).tolist()
        self.pins = np.array(data.draw(st.lists(st.sampled_from(registered), unique=True,
                                                max_size=3)) if registered else [], np.int64)
        for a in self.pair:
            a.pending_parents = lambda: self.pins

    @rule(steps=st.integers(0, 2))
    def tick(self, steps):
        self.both(lambda a: a.advance_clock(steps))

    @invariant()
    def twins_agree(self):
        if not hasattr(self, "pair"):
            return
        a, b = self.pair
        assert self.seen[0] == self.seen[1]
        assert all(ids and -7 not in ids and -7 not in hs for ids, hs in self.seen[0])
        if self.seen[0]:
            event("blocks deregistered")
        self.seen[0].clear()
        self.seen[1].clear()
        for x, y in ((a.free_block_ids, b.free_block_ids), (a.block_ref_counts,
                     b.block_ref_counts), (a.block_timestamps, b.block_timestamps),
                     (a._leaves.member, b._leaves.member),
                     (a._forest.dangling, b._forest.dangling)):
            assert x.tolist() == y.tolist()
        assert forest_state(a._forest) == forest_state(b._forest)
        for x in self.pair:
            x.check_invariants()


TestTwinAllocators = TwinAllocators.TestCase
TestTwinAllocators.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


# --- twin contexts --------------------------------------------------------------------------


def drive_general_twins(seed, steps=60) -> int:
    """A context and one on the general paths side by side through admissions, decode steps,
    commits, releases and catch-ups under KV-block and Mamba-slot pressure; returns the number
    of blocks the first deregistered."""
    rng = np.random.default_rng(seed)
    new, old = twin_contexts(rng)
    evicted = ([], [])
    for c, log in zip((new, old), evicted, strict=True):
        c.kv_block_allocator.add_blocks_deregistered_observer(
            lambda ids, hs, g=log: g.append((list(ids), set(hs))))

    def both(f):
        got = [outcome(lambda: f(new))]
        with general_paths():
            got.append(outcome(lambda: f(old)))
        assert got[0] == got[1]
        assert evicted[0] == evicted[1]
        assert snapshot(new) == snapshot(old)

    twin_steps(rng, new, both, steps)
    for c in (new, old):
        c.check_invariants()
    return sum(len(ids) for ids, _ in evicted[0])


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_context_equals_the_context_on_the_general_paths(seed):
    """Every outcome, every piece of state (Mamba slots and hashes included) and every
    deregistration (victims in order, hashes) equals that of a context on the NumPy paths."""
    event(f"blocks deregistered: {min(drive_general_twins(seed), 5)}+")


def test_the_general_twins_reach_the_listed_paths():
    """The side-by-side runs do deregister through the listed paths, Mamba owners included
    (else they would prove little)."""
    calls = {"listed": 0, "owners": 0}
    unlink, observe = forest_module.BlockForest.unlink_listed, \
        MambaSlotAllocator._on_kv_deregistered

    def counting_unlink(self, ids):
        calls["listed"] += not forest_module._SCALAR < 0
        return unlink(self, ids)

    def counting_observe(self, ids, hashes):
        calls["owners"] += mamba_module._LISTED >= 0 and any(self._pool.owned[b] for b in ids)
        return observe(self, ids, hashes)

    forest_module.BlockForest.unlink_listed = counting_unlink
    MambaSlotAllocator._on_kv_deregistered = counting_observe
    try:
        for seed in range(6):
            drive_general_twins(seed)
    finally:
        forest_module.BlockForest.unlink_listed = unlink
        MambaSlotAllocator._on_kv_deregistered = observe
    assert calls["listed"] and calls["owners"], calls
