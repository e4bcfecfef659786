"""The memoryviews the eviction bookkeeping keeps beside its arrays (hcache/contexts/
scalar_views.py, issue 24, seventh pass), and the shortcuts of that pass.

Oracles: the arrays themselves (a view must alias its owner's array, a copy's its copy's, and
read and write what the array holds); a pop loop over every hash (the Mamba hash map's early
exit); the allocator's NumPy paths (``kv_block_allocator._LISTED`` / ``_FEW`` set to nothing)
on a copy made in the middle of a run (a view left on the original's arrays would write there).
"""

from __future__ import annotations

import copy
import pickle

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from test_decode_fast_paths import forest_state
from test_listed_eviction import general_paths

from hcache.contexts import KVBlockAllocator
from hcache.contexts.block_forest import BlockForest
from hcache.contexts.evictable_leaves import EvictableLeaves
from hcache.contexts.free_block_stack import FreeBlockStack
from hcache.contexts.mamba_hash_map import MambaHashMap
from hcache.contexts.mamba_slot_pool import MambaSlotPool

CLONES = [copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))]


def owners_of(a: KVBlockAllocator) -> list:
    return [a, a._forest, a._leaves, a._free]


def views_of(obj) -> dict:
    """``name -> (view, array)`` of the views ``obj`` keeps; each array is one of the owner's
    own attributes (not a detached copy)."""
    views = obj._scalars
    owned = {id(v) for v in vars(obj).values() if isinstance(v, np.ndarray)}
    out = {}
    for name, array in zip(views._names, views, strict=True):
        assert id(array) in owned, (type(obj).__name__, name)
        out[name] = getattr(views, name), array
    return out


def assert_views_alias(obj) -> None:
    for name, (m, array) in views_of(obj).items():
        assert m.obj is array, (type(obj).__name__, name)
        assert m.nbytes == array.nbytes
        assert [int(x) for x in m.tolist()] == array.reshape(-1).astype(np.int64).tolist()


@pytest.mark.parametrize("clone", CLONES, ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("make", [BlockForest, EvictableLeaves, FreeBlockStack,
                                  KVBlockAllocator, lambda n: MambaSlotPool(n, 4)])
def test_a_copy_views_its_own_arrays(make, clone):
    """Every view aliases its object's array, in a fresh object and in a copy (deep copy or
    pickle), and a write through the copy's view reaches the copy's array only."""
    obj = make(6)
    assert_views_alias(obj)
    twin = clone(obj)
    assert_views_alias(twin)
    theirs = views_of(twin)
    for name, (_, array) in views_of(obj).items():
        before = array.copy()
        theirs[name][0][3] = 1
        assert int(theirs[name][1][3]) == 1
        assert np.array_equal(array, before)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_copy_made_mid_run_evicts_as_the_numpy_paths(data):
    """An allocator filled with cached chains, deep-copied (or pickled) at a random point: the
    copy, on the element-by-element paths, and the original, on the NumPy paths, then take the
    same victims, hand out the same ids and end in the same state; views alias after reset."""
    a = KVBlockAllocator(24)
    seen = ([], [])
    next_hash = 1
    for _ in range(data.draw(st.integers(1, 5), label="chains")):
        ids = a.allocate_memory_blocks(data.draw(st.integers(1, 6), label="length"))
        if ids is None:
            break
        hs = list(range(next_hash, next_hash + len(ids)))
        next_hash += len(ids)
        a.register_kv_block_hashes(ids, hs, [0] + hs[:-1])
        a.advance_clock(data.draw(st.integers(0, 2), label="ticks"))
        a.release_memory_blocks(ids)
    b = data.draw(st.sampled_from(CLONES), label="clone")(a)
    for x, log in zip((a, b), seen, strict=True):
        x.add_blocks_deregistered_observer(lambda ids, hs, g=log: g.append((ids, hs)))
    for _ in range(data.draw(st.integers(1, 4), label="allocations")):
        n = data.draw(st.integers(0, 12), label="n")
        counts = data.draw(st.one_of(st.none(), st.just([1] * n)), label="counts")
        with general_paths():
            want = a.allocate_memory_blocks(n) if counts is None \
                else a.allocate_memory_blocks_per_request(counts)
        got = b.allocate_memory_blocks(n) if counts is None \
            else b.allocate_memory_blocks_per_request(counts)
        assert (None if got is None else got.tolist()) == \
            (None if want is None else want.tolist())
        assert seen[0] == seen[1]
        for x, y in ((a.free_block_ids, b.free_block_ids), (a.block_ref_counts,
                     b.block_ref_counts), (a.block_timestamps, b.block_timestamps),
                     (a._leaves.member, b._leaves.member)):
            assert x.tolist() == y.tolist()
        assert forest_state(a._forest) == forest_state(b._forest)
        b.check_invariants()
    b.reset()
    for obj in owners_of(b):
        assert_views_alias(obj)


@given(st.lists(st.integers(1, 40), unique=True, max_size=12),
       st.one_of(st.none(), st.sets(st.integers(1, 60), max_size=10),
                 st.lists(st.integers(1, 60), max_size=10)))
def test_drop_hashes_drops_what_a_pop_of_each_drops(mapped, hashes):
    """Whether or not a hash is in the map (the early exit when none is): the map a pop of
    every hash leaves."""
    m = MambaHashMap({}, bytearray(4), 4)
    m.hash_to_block_id.update({h: h % 4 for h in mapped})
    want = dict(m.hash_to_block_id)
    for h in hashes or ():
        want.pop(h, None)
    m.drop_hashes(hashes)
    assert m.hash_to_block_id == want


def test_views_of_empty_and_foreign_arrays():
    """A zero-size array of any shape is viewed (empty), as an owner's may be; an array in the
    other byte order is refused (its elements would read wrongly), naming it."""
    from hcache.contexts.requests import RequestTable
    from hcache.contexts.scalar_views import ScalarViews

    views = ScalarViews(grid=np.zeros((0, 4), np.int64), flat=np.zeros(0, np.int32))
    assert len(views.grid) == 0 and len(views.flat) == 0
    assert RequestTable(4, 0, 16, hashing=True)._scalars.table.nbytes == 0
    with pytest.raises(ValueError, match="swapped: expected an array in native byte order"):
        ScalarViews(swapped=np.zeros(3, np.dtype(np.int64).newbyteorder()))
