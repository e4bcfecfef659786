"""``EvictableSlots.take_oldest`` (the lean Mamba commit's victims, issue 24) against
``oldest``: the same blocks in the same order, and after their eviction the same pool, every
evictable block still with a live heap entry."""

import copy

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from test_decode_fast_paths import pool_state, pools


@given(pools(), st.data())
def test_take_oldest_is_oldest_then_evicting_them(case, data):
    pool, refs, stamps, exclude = case
    twin = copy.deepcopy(pool)
    n = data.draw(st.integers(0, len(pool.block_to_slot) + 1))
    excluded = set(exclude.tolist())
    want = twin._evictable.oldest(n, twin.owned, refs, stamps, excluded)
    got = pool._evictable.take_oldest(n, pool.owned, refs, stamps, excluded)
    assert got == want
    assert not excluded.intersection(got)
    for p in (pool, twin):
        p.evict(len(got), refs, stamps, exclude=exclude, candidates=list(got))
    assert pool_state(pool) == pool_state(twin)
    # (the taken slots are the caller's: the heap's own invariant)
    assert pool._evictable.broken_invariants(pool.evictable_blocks(refs), stamps) == []
    # The next victims agree too (the heap lost only the taken blocks' entries).
    rest = data.draw(st.integers(0, 4))
    assert pool._evictable.oldest(rest, pool.owned, refs, stamps) == \
        twin._evictable.oldest(rest, twin.owned, refs, stamps)


def test_take_oldest_hand_computed():
    """Slots of blocks 0-3 released at stamps 5, 1, 1, 0: the LRU order is 3, 1, 2, 0 (ties
    by id); excluding 1, the two oldest are 3 and 2, whose entries go; 1 keeps its entry."""
    from hcache.contexts.mamba_slot_pool import MambaSlotPool

    pool = MambaSlotPool(4, 4)
    refs, stamps = np.zeros(4, np.int32), np.array([5, 1, 1, 0], np.int64)
    pool.allocate(np.arange(4, dtype=np.int64), refs, stamps, distinct=True)
    assert pool._evictable.oldest(4, pool.owned, refs, stamps) == [3, 1, 2, 0]
    assert pool._evictable.take_oldest(2, pool.owned, refs, stamps, {1}) == [3, 2]
    assert pool._evictable.oldest(4, pool.owned, refs, stamps) == [1, 0]
    pool.evict(2, refs, stamps, candidates=[3, 2])
    assert pool._evictable.oldest(4, pool.owned, refs, stamps) == [1, 0]
    assert pool._evictable.broken_invariants(pool.evictable_blocks(refs), stamps) == []
