"""Unit tests of KVBlockAllocator against the semantics of docs/design.md §6.2."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest

from hcache.contexts import KVBlockAllocator


def snapshot(a: KVBlockAllocator):
    return (a.free_block_ids.tolist(), a.block_hashes.tolist(), a.block_ref_counts.tolist(),
            a.block_timestamps.tolist(), a.block_parent_ids.tolist(),
            a.block_parent_hashes.tolist(), a.block_child_counts.tolist(),
            dict(a.kv_hash_to_block_id), a.clock)


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, ids, hashes):
        self.calls.append((ids, hashes))


def chain(a, n, first_hash, parent=0):
    """Allocate n blocks, register them as a chain of hashes first_hash, first_hash+1, ..."""
    ids = a.allocate_memory_blocks(n)
    hashes = list(range(first_hash, first_hash + n))
    a.register_kv_block_hashes(ids, hashes, [parent] + hashes[:-1])
    return ids.tolist(), hashes


# --- allocation and release ---------------------------------------------------------------

def test_fresh_allocator_hands_out_distinct_blocks_stamped_with_the_clock():
    a = KVBlockAllocator(8)
    assert (a.num_blocks, a.num_free_blocks, a.num_used_blocks, a.num_cached_blocks) == (8, 8, 0, 0)
    a.advance_clock(3)
    ids = a.allocate_memory_blocks(5)
    assert ids.dtype == np.int32 and len(set(ids.tolist())) == 5
    assert set(ids.tolist()) <= set(range(8))
    assert a.block_ref_counts[ids].tolist() == [1] * 5
    assert a.block_timestamps[ids].tolist() == [3] * 5
    assert (a.num_free_blocks, a.num_used_blocks) == (3, 5)
    assert a.allocate_memory_blocks(0).shape == (0,)
    a.check_invariants()


def test_allocation_beyond_capacity_returns_none_and_changes_nothing():
    a = KVBlockAllocator(4)
    a.allocate_memory_blocks(3)
    before = snapshot(a)
    assert a.allocate_memory_blocks(2) is None
    assert snapshot(a) == before
    assert KVBlockAllocator(4).allocate_memory_blocks(5) is None


def test_release_frees_unregistered_blocks_and_counts_duplicates():
    a = KVBlockAllocator(4)
    ids = a.allocate_memory_blocks(2).tolist()
    a.retain_memory_blocks([ids[0], ids[0]])
    assert a.block_ref_counts[ids[0]] == 3
    a.release_memory_blocks([ids[0], ids[0], ids[1]])
    assert a.block_ref_counts[ids].tolist() == [1, 0]
    assert a.num_free_blocks == 3 and ids[1] in a.free_block_ids.tolist()
    a.release_memory_blocks(np.array([ids[0]], dtype=np.int64))
    assert a.num_free_blocks == 4
    a.check_invariants()


def test_release_below_zero_raises_and_changes_nothing():
    a = KVBlockAllocator(4)
    ids = a.allocate_memory_blocks(2).tolist()
    before = snapshot(a)
    with pytest.raises(ValueError, match="block_ids"):
        a.release_memory_blocks([ids[0], ids[1], ids[1]])
    free = a.free_block_ids.tolist()[0]
    with pytest.raises(ValueError):
        a.release_memory_blocks([ids[0], free])
    assert snapshot(a) == before


@pytest.mark.parametrize("method", ["release_memory_blocks", "retain_memory_blocks"])
def test_ids_out_of_range_raise_index_error(method):
    a = KVBlockAllocator(4)
    a.allocate_memory_blocks(2)
    before = snapshot(a)
    for bad in ([4], [-1], [0, 7]):
        with pytest.raises(IndexError, match="block_ids"):
            getattr(a, method)(bad)
    with pytest.raises(TypeError):
        getattr(a, method)([0.5])
    with pytest.raises(ValueError):
        getattr(a, method)([[0]])
    assert snapshot(a) == before


def test_scalar_arguments_are_validated():
    with pytest.raises(ValueError):
        KVBlockAllocator(0)
    with pytest.raises(TypeError):
        KVBlockAllocator(4.0)
    with pytest.raises(ValueError, match="eviction_policy"):
        KVBlockAllocator(4, eviction_policy="fifo")
    with pytest.raises(TypeError):
        KVBlockAllocator(4, enable_prefix_caching="yes")
    a = KVBlockAllocator(4)
    with pytest.raises(ValueError):
        a.allocate_memory_blocks(-1)
    with pytest.raises(TypeError):
        a.allocate_memory_blocks("2")
    with pytest.raises(ValueError):
        a.evict_lru_blocks(-1)
    with pytest.raises(ValueError):
        a.is_memory_available(1, -1)
    with pytest.raises(TypeError):
        a.add_blocks_deregistered_observer(3)


# --- retain and timestamps ----------------------------------------------------------------

def test_retain_refreshes_timestamps_and_rejects_free_blocks():
    a = KVBlockAllocator(4)
    ids = a.allocate_memory_blocks(2).tolist()
    a.advance_clock(5)
    a.retain_memory_blocks([ids[1]])
    assert a.block_timestamps[ids].tolist() == [0, 5]
    assert a.block_ref_counts[ids].tolist() == [1, 2]
    before = snapshot(a)
    with pytest.raises(ValueError, match="free"):
        a.retain_memory_blocks([ids[0], a.free_block_ids.tolist()[0]])
    assert snapshot(a) == before


@pytest.mark.parametrize("seed", range(6))
def test_retain_of_distinct_held_or_cached_ids_unchecked_equals_retain(seed):
    """``_retain_distinct`` (the context's retain of a prefix match: distinct ids the hash map
    holds) changes exactly what ``retain_memory_blocks`` does, leaves and eviction included."""
    rng = np.random.default_rng(seed)
    a = KVBlockAllocator(24)
    ids, _ = chain(a, 10, 100)
    other, _ = chain(a, 4, 200)
    a.advance_clock(3)
    a.release_memory_blocks(ids[4:] + other)        # cached now, some leaves
    a.advance_clock(2)
    pick = rng.permutation(ids + other)[:int(rng.integers(1, 15))]
    twin = copy.deepcopy(a)
    a._retain_distinct(np.array(pick, np.int64))
    twin.retain_memory_blocks(pick)
    assert snapshot(a) == snapshot(twin)
    a.check_invariants()
    n = a.get_allocatable_count()
    assert (a.allocate_memory_blocks(n).tolist() == twin.allocate_memory_blocks(n).tolist())
    assert snapshot(a) == snapshot(twin)


def test_advance_clock_returns_the_new_value():
    a = KVBlockAllocator(2)
    assert a.clock == 0
    assert a.advance_clock() == 1 and a.advance_clock(4) == 5 and a.clock == 5
    with pytest.raises(ValueError):
        a.advance_clock(-1)


# --- policies -----------------------------------------------------------------------------

def test_ref_zero_deregisters_and_frees_at_once():
    a = KVBlockAllocator(4, eviction_policy="ref_zero")
    rec = Recorder()
    a.add_blocks_deregistered_observer(rec)
    ids, hashes = chain(a, 2, 100)
    a.release_memory_blocks([ids[1]])
    assert a.block_hashes[ids[1]] == -1 and 101 not in a.kv_hash_to_block_id
    assert rec.calls == [([ids[1]], {101})]
    assert a.num_free_blocks == 3 and a.num_cached_blocks == 0
    assert a.get_evictable_block_count() == 0 and a.get_allocatable_count() == 3
    a.release_memory_blocks([ids[0]])
    assert rec.calls[-1] == ([ids[0]], {100}) and a.kv_hash_to_block_id == {}
    a.check_invariants()


def test_ref_zero_orphans_children_of_a_deregistered_parent():
    a = KVBlockAllocator(4, eviction_policy="ref_zero")
    ids, _ = chain(a, 2, 100)
    a.release_memory_blocks([ids[0]])
    assert a.block_parent_ids[ids[1]] == -1 and a.block_parent_hashes[ids[1]] == 0
    a.check_invariants()


def test_lru_keeps_released_registered_blocks_cached_and_frees_the_rest():
    a = KVBlockAllocator(5)
    ids, hashes = chain(a, 2, 100)
    tail = a.allocate_memory_blocks(1).tolist()   # a partial block: never registered
    a.release_memory_blocks(ids + tail)
    assert a.num_cached_blocks == 2 and a.num_free_blocks == 3
    assert a.kv_hash_to_block_id == {100: ids[0], 101: ids[1]}
    assert a.get_evictable_block_count() == 2 and a.get_allocatable_count() == 5
    a.retain_memory_blocks(ids)   # a prefix hit pins the cached chain again
    assert a.num_cached_blocks == 0 and a.num_used_blocks == 2
    a.check_invariants()


def test_caching_disabled_records_no_hashes():
    a = KVBlockAllocator(3, enable_prefix_caching=False)
    ids = a.allocate_memory_blocks(2)
    a.register_kv_block_hashes(ids, [5, 6])
    assert a.kv_hash_to_block_id == {} and (a.block_hashes == -1).all()
    with pytest.raises(ValueError):
        a.register_kv_block_hashes(ids, [5])
    a.release_memory_blocks(ids)
    assert a.num_free_blocks == 3
    assert a.evict_lru_blocks(1) is False and a.evict_lru_blocks(0) is True
    a.check_invariants()


# --- LRU eviction -------------------------------------------------------------------------

def test_lru_peels_leaves_so_ancestors_stay_cached():
    a = KVBlockAllocator(3)
    rec = Recorder()
    a.add_blocks_deregistered_observer(rec)
    ids = []
    for _ in range(3):   # chunked prefill: the root is the oldest block
        a.advance_clock()
        ids += a.allocate_memory_blocks(1).tolist()
    a.register_kv_block_hashes(ids, [7, 8, 9], [0, 7, 8])
    a.release_memory_blocks(ids)
    assert a.evict_lru_blocks(1) is True
    assert rec.calls == [([ids[2]], {9})]
    assert set(a.kv_hash_to_block_id) == {7, 8}
    assert a.evict_lru_blocks(2) is True
    assert rec.calls[1] == ([ids[1], ids[0]], {7, 8})
    a.check_invariants()


def test_lru_peel_order_by_subtree_then_timestamp_then_id():
    # Forest: p(ts 1) <- c(ts 5); leaf x(ts 3); leaves y, z with equal timestamps (ts 4).
    a = KVBlockAllocator(6)
    blocks = {}
    for name, ts in (("p", 1), ("x", 3), ("y", 4), ("z", 4), ("c", 5)):
        a.advance_clock(ts - a.clock)
        blocks[name] = int(a.allocate_memory_blocks(1)[0])
    a.register_kv_block_hashes([blocks[k] for k in "pcxyz"], [1, 2, 3, 4, 5], [0, 1, 0, 0, 0])
    a.release_memory_blocks(list(blocks.values()))
    rec = Recorder()
    a.add_blocks_deregistered_observer(rec)
    assert a.evict_lru_blocks(5)
    y, z = sorted([blocks["y"], blocks["z"]])
    # Expected by the leaf-peel rule: x(3), then y/z (4, by id), then c(5), then p freed by c.
    assert rec.calls[0][0] == [blocks["x"], y, z, blocks["c"], blocks["p"]]


def test_evict_more_than_evictable_returns_false_and_changes_nothing():
    a = KVBlockAllocator(4)
    ids, _ = chain(a, 2, 10)
    a.release_memory_blocks(ids)
    before = snapshot(a)
    assert a.evict_lru_blocks(3) is False
    assert snapshot(a) == before
    assert a.evict_lru_blocks(0) is True and snapshot(a) == before


def test_cached_block_with_an_in_use_descendant_is_not_evictable():
    a = KVBlockAllocator(2)
    ids, _ = chain(a, 2, 10)
    a.release_memory_blocks([ids[0]])   # parent cached, child still in use
    assert a.num_cached_blocks == 1 and a.get_evictable_block_count() == 0
    before = snapshot(a)
    assert a.allocate_memory_blocks(1) is None and a.evict_lru_blocks(1) is False
    assert snapshot(a) == before
    a.release_memory_blocks([ids[1]])
    assert a.get_evictable_block_count() == 2


def test_allocation_evicts_under_pressure_and_notifies_once_after_commit():
    a = KVBlockAllocator(4)
    ids, _ = chain(a, 3, 50)
    a.release_memory_blocks(ids)
    seen = []

    def observer(block_ids, hashes):
        a.check_invariants()   # the allocator's state is committed before observers run
        seen.append((block_ids, hashes, a.block_ref_counts[block_ids].tolist()))

    a.add_blocks_deregistered_observer(observer)
    got = a.allocate_memory_blocks(3).tolist()
    # One free block plus the two newest leaves of the chain (ids[2], then ids[1]).
    assert sorted(got) == sorted(set(range(4)) - {ids[0]})
    assert seen == [([ids[2], ids[1]], {51, 52}, [1, 1])]
    assert a.kv_hash_to_block_id == {50: ids[0]}


def test_observers_run_in_order_and_a_raising_one_is_logged(caplog):
    a = KVBlockAllocator(2, eviction_policy="ref_zero")
    order = []

    def boom(ids, hashes):
        order.append("boom")
        raise RuntimeError("observer failure")

    a.add_blocks_deregistered_observer(lambda ids, h: order.append("first"))
    a.add_blocks_deregistered_observer(boom)
    a.add_blocks_deregistered_observer(lambda ids, h: order.append(("last", ids, h)))
    ids, _ = chain(a, 1, 9)
    with caplog.at_level(logging.ERROR, logger="hcache.contexts.kv_block_allocator"):
        a.release_memory_blocks(ids)
    assert order == ["first", "boom", ("last", ids, {9})]
    assert "observer failure" in caplog.text
    a.check_invariants()


def test_a_raising_release_observer_is_logged_after_the_release_is_committed(caplog):
    a = KVBlockAllocator(4)
    seen = []

    def boom(ids, stamps):
        seen.append((ids.tolist(), a.num_free_blocks, a.num_cached_blocks))
        raise RuntimeError("release observer failure")

    a.add_released_observer(boom)
    a.add_released_observer(lambda ids, stamps: seen.append(("next", ids.tolist())))
    ids, _ = chain(a, 2, 9)
    more = a.allocate_memory_blocks(1).tolist()
    with caplog.at_level(logging.ERROR, logger="hcache.contexts.kv_block_allocator"):
        a.release_memory_blocks(ids + more)
    # Called once the release is done: the unregistered block is free, the chain cached.
    assert seen == [(sorted(ids + more), 2, 2), ("next", sorted(ids + more))]
    assert "release observer failure" in caplog.text
    a.check_invariants()


# --- registration -------------------------------------------------------------------------

def test_registration_is_idempotent_and_keeps_the_first_parent():
    a = KVBlockAllocator(4)
    ids, hashes = chain(a, 2, 20)
    before = snapshot(a)
    a.register_kv_block_hashes(ids, hashes, [0, 0])
    a.register_kv_block_hashes([ids[1], ids[1]], [21, 21])
    assert snapshot(a) == before
    assert a.block_parent_ids[ids[1]] == ids[0] and a.block_child_counts[ids[0]] == 1


def test_parents_resolve_to_earlier_blocks_only():
    a = KVBlockAllocator(6)
    ids = a.allocate_memory_blocks(4).tolist()
    # ids[0]'s parent (31) is registered later in the batch: no parent; 99 is unknown.
    a.register_kv_block_hashes(ids, [30, 31, 32, 33], [31, 30, 99, 0])
    assert a.block_parent_ids[ids].tolist() == [-1, ids[0], -1, -1]
    assert a.block_parent_hashes[ids].tolist() == [0, 30, 0, 0]
    more = a.allocate_memory_blocks(1).tolist()
    a.register_kv_block_hashes(more, [34], [32])
    assert a.block_parent_ids[more[0]] == ids[2] and a.block_child_counts[ids[2]] == 1
    a.check_invariants()


def test_siblings_and_a_repeated_pair_in_one_batch():
    a = KVBlockAllocator(8)
    ids = a.allocate_memory_blocks(5).tolist()
    # ids[1], ids[2] are siblings under ids[0] (registered earlier in the batch); ids[3] is a
    # child of ids[2]; the pair (ids[4], 54) is listed twice and counts once.
    a.register_kv_block_hashes([ids[0], ids[1], ids[2], ids[4], ids[3], ids[4]],
                               [50, 51, 52, 54, 53, 54], [0, 50, 50, 53, 52, 53])
    assert a.block_parent_ids[ids].tolist() == [-1, ids[0], ids[0], ids[2], -1]
    assert a.block_child_counts[ids].tolist() == [2, 0, 1, 0, 0]
    assert a.kv_hash_to_block_id == {50: ids[0], 51: ids[1], 52: ids[2], 53: ids[3],
                                     54: ids[4]}
    a.check_invariants()
    more = a.allocate_memory_blocks(3).tolist()     # three siblings, no repeat
    a.register_kv_block_hashes(more, [60, 61, 62], [51, 51, 51])
    assert a.block_child_counts[ids[1]] == 3 and a.block_parent_ids[more].tolist() == [ids[1]] * 3
    a.check_invariants()


@pytest.mark.parametrize("case", ["different_hash", "hash_of_other", "lengths", "parent_lengths",
                                  "free_block", "nonpositive", "two_hashes_one_block",
                                  "one_hash_two_blocks", "out_of_range"])
def test_rejected_registration_changes_nothing(case):
    a = KVBlockAllocator(6)
    ids, _ = chain(a, 2, 40)
    fresh = a.allocate_memory_blocks(2).tolist()
    free = a.free_block_ids.tolist()[0]
    args = {
        "different_hash": ([fresh[0], ids[1]], [60, 99], None),
        "hash_of_other": ([fresh[0], fresh[1]], [60, 40], None),
        "lengths": ([fresh[0], fresh[1]], [60], None),
        "parent_lengths": ([fresh[0]], [60], [0, 0]),
        "free_block": ([fresh[0], free], [60, 61], None),
        "nonpositive": ([fresh[0], fresh[1]], [60, 0], None),
        "two_hashes_one_block": ([fresh[0], fresh[0]], [60, 61], None),
        "one_hash_two_blocks": ([fresh[0], fresh[1]], [60, 60], None),
        "out_of_range": ([fresh[0], 6], [60, 61], None),
    }[case]
    before = snapshot(a)
    with pytest.raises(IndexError if case == "out_of_range" else ValueError):
        a.register_kv_block_hashes(*args)
    assert snapshot(a) == before
    a.check_invariants()


def test_registering_a_cached_block_again_is_allowed_only_with_its_hash():
    a = KVBlockAllocator(3)
    ids, _ = chain(a, 1, 70)
    a.release_memory_blocks(ids)
    a.register_kv_block_hashes(ids, [70])
    with pytest.raises(ValueError):
        a.register_kv_block_hashes(ids, [71])
    assert a.num_cached_blocks == 1


# --- queries and reset --------------------------------------------------------------------

def test_is_memory_available_accounts_for_pinned_matches():
    a = KVBlockAllocator(5)
    ids, _ = chain(a, 3, 80)
    a.release_memory_blocks(ids)   # 2 free, 3 cached
    assert a.is_memory_available(2, potential_matched_count=3)   # fast path: free suffices
    assert a.is_memory_available(5)
    assert a.is_memory_available(4, potential_matched_count=1)
    assert not a.is_memory_available(4, potential_matched_count=2)
    assert not a.is_memory_available(6)
    r = KVBlockAllocator(5, eviction_policy="ref_zero")
    r.allocate_memory_blocks(3)
    assert r.is_memory_available(2) and not r.is_memory_available(3)


def test_reset_clears_everything_but_keeps_observers():
    a = KVBlockAllocator(3)
    rec = Recorder()
    a.add_blocks_deregistered_observer(rec)
    a.advance_clock(4)
    ids, _ = chain(a, 2, 90)
    a.release_memory_blocks(ids[:1] + ids[1:])
    a.reset()
    fresh = KVBlockAllocator(3)
    assert snapshot(a) == snapshot(fresh) and rec.calls == []
    ids, _ = chain(a, 3, 90)
    a.release_memory_blocks(ids)
    a.evict_lru_blocks(1)
    assert rec.calls == [([ids[2]], {92})]


def test_check_invariants_reports_every_broken_invariant():
    a = KVBlockAllocator(4)
    ids, _ = chain(a, 2, 10)
    a.check_invariants()
    a.block_ref_counts[ids[0]] = -1              # negative ref count
    a.kv_hash_to_block_id[999] = ids[1]          # map disagrees with block_hashes
    a.block_child_counts[3] = 2                  # unregistered block with children
    with pytest.raises(RuntimeError) as err:
        a.check_invariants()
    text = str(err.value)
    assert "negative ref counts" in text and "hash map" in text and "children" in text


def test_check_invariants_detects_a_lost_block_and_a_cycle():
    a = KVBlockAllocator(4)
    ids, _ = chain(a, 2, 10)
    a.block_parent_ids[ids[0]] = ids[1]
    a.block_parent_hashes[ids[0]] = 11
    a.block_child_counts[ids[1]] = 1
    a._free_top -= 1                             # a free block falls off the stack
    with pytest.raises(RuntimeError) as err:
        a.check_invariants()
    assert "cycle" in str(err.value) and "off the free stack" in str(err.value)


def test_advance_clock_keeps_the_clock_an_int64():
    """The clock stamps int64 timestamps: a step count that would take it past 2**63 - 1 is
    refused and the clock is unchanged."""
    alloc = KVBlockAllocator(4)
    before = alloc.clock
    with pytest.raises(ValueError, match="steps: expected an int in"):
        alloc.advance_clock(10**30)
    assert alloc.clock == before
    assert alloc.advance_clock(2**63 - 1 - before) == 2**63 - 1
