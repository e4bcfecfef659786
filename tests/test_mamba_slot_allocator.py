"""Unit tests of MambaSlotAllocator (docs/design.md §6), driven by a real KVBlockAllocator and a
stand-in
context that holds only the attributes the allocator may read.

Oracles: hand-computed slot/eviction orders, NumPy copies of the live and scratch arrays, and the
Megatron-LM worked examples for intermediate offsets.
"""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from hcache import ops
from hcache.contexts import (
    MAX_INTERMEDIATE_OFFSETS_PER_REQUEST,
    KVBlockAllocator,
    MambaSlotAllocator,
    MambaSlotCapacityError,
)
from hcache.device import resolve_device
from hcache.errors import CacheCapacityError

import helpers
from helpers import host

DEVICES = helpers.DEVICES
L, R = 3, 4
CONV, SSM = (3, 2), (2, 5)


def xp_of(device):
    return resolve_device(device).xp



def make(device="cpu", *, num_blocks=16, max_slots=4, policy="lru", bs=4, chunk=2,
         conv_dtype="float16", ssm_dtype="float32"):
    """A stand-in context, its KV allocator and a MambaSlotAllocator over them."""
    xp = xp_of(device)
    rng = np.random.default_rng(0)
    kv = KVBlockAllocator(num_blocks, eviction_policy=policy)
    cdt, sdt = np.dtype(getattr(ml_dtypes, conv_dtype, None) or conv_dtype), np.dtype(ssm_dtype)
    ctx = SimpleNamespace(
        kv_block_allocator=kv,
        mamba_conv_states=xp.asarray(rng.integers(0, 100, (L, R, *CONV)).astype(cdt)),
        mamba_ssm_states=xp.asarray(rng.integers(0, 100, (L, R, *SSM)).astype(sdt)),
        request_to_mamba_state_idx=np.array([2, 0, 3, -1], dtype=np.int32),
        block_size_tokens=bs, mamba_chunk_size=chunk,
        request_to_kv_block_ids=np.full((R, 8), -1, dtype=np.int32))
    alloc = MambaSlotAllocator(ctx, max_slots, L, CONV, SSM, conv_dtype, ssm_dtype)
    return ctx, kv, alloc


def registered_blocks(kv, n, *, salt=0, release=False):
    """Allocate ``n`` KV blocks and register them as one hash chain; optionally release them
    (under lru they stay cached with ref count 0)."""
    ids = kv.allocate_memory_blocks(n)
    hashes = [1000 * (salt + 1) + i for i in range(n)]
    kv.register_kv_block_hashes(ids, hashes, [0] + hashes[:-1])
    if release:
        kv.release_memory_blocks(ids)
    return ids.tolist(), hashes


def snapshot(alloc):
    return (alloc.block_to_slot.copy(), alloc.slot_to_block.copy(), alloc.free_count,
            alloc.free_slots.copy(), dict(alloc.hash_to_block_id), alloc._block_hash.copy(),
            host(alloc.conv_states).copy(), host(alloc.ssm_states).copy())


def assert_unchanged(before, alloc):
    after = snapshot(alloc)
    for a, b in zip(before, after, strict=True):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
        else:
            assert a == b


# --- construction -------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_construction_follows_live_states(device):
    ctx, kv, alloc = make(device, max_slots=5)
    xp = xp_of(device)
    assert MAX_INTERMEDIATE_OFFSETS_PER_REQUEST == 3
    assert isinstance(alloc.conv_states, xp.ndarray)
    assert alloc.conv_states.shape == (L, 5, *CONV) and alloc.ssm_states.shape == (L, 5, *SSM)
    assert alloc.conv_states.dtype == ctx.mamba_conv_states.dtype
    assert alloc.ssm_states.dtype == np.float32
    assert alloc.intermediate_conv_out.shape == (L, 3 * R, *CONV)
    assert alloc.intermediate_ssm_out.shape == (L, 3 * R, *SSM)
    assert alloc.block_to_slot.shape == (16,) and (alloc.block_to_slot == -1).all()
    assert alloc.slot_to_block.shape == (5,) and alloc.free_count == 5
    assert alloc.hash_to_block_id == {}
    alloc.check_invariants()


def test_constructor_rejects_bad_arguments():
    ctx, _, _ = make()
    with pytest.raises(ValueError, match="max_slots"):
        MambaSlotAllocator(ctx, 0, L, CONV, SSM, "float16", "float32")
    with pytest.raises(TypeError, match="num_mamba_layers"):
        MambaSlotAllocator(ctx, 2, 1.5, CONV, SSM, "float16", "float32")
    with pytest.raises(ValueError, match="mamba_conv_states"):
        MambaSlotAllocator(ctx, 2, L, (3, 3), SSM, "float16", "float32")
    with pytest.raises(ValueError, match="mamba_ssm_states"):
        MambaSlotAllocator(ctx, 2, L, CONV, (5, 2), "float16", "float32")
    with pytest.raises(ValueError, match="mamba_conv_states"):
        MambaSlotAllocator(ctx, 2, L + 1, CONV, SSM, "float16", "float32")
    with pytest.raises(ValueError, match="dtype"):
        MambaSlotAllocator(ctx, 2, L, CONV, SSM, "float16", "bfloat16")
    with pytest.raises(ValueError, match="ssm_states_dtype"):
        MambaSlotAllocator(ctx, 2, L, CONV, SSM, "float16", "float64")


def test_capacity_error_type():
    err = MambaSlotCapacityError(5, 2)
    assert isinstance(err, CacheCapacityError) and isinstance(err, RuntimeError)
    assert (err.required, err.available) == (5, 2)


# --- allocation and eviction --------------------------------------------------------------------

def test_allocate_gives_a_repeated_block_one_slot_and_keeps_existing_slots():
    _, kv, alloc = make(max_slots=4)
    ids, _ = registered_blocks(kv, 4)
    # Megatron-LM's contract: every occurrence of a repeated id gets the same single slot
    # (its commit_intermediate_states passes repeats); issue 21 item 8.
    assert alloc.can_allocate_slots([ids[3]] * 5)
    (s3, s3_again, s3_third) = alloc.allocate_slots_batch([ids[3], ids[3], ids[3]])
    assert s3 == s3_again == s3_third and alloc.free_count == 3
    alloc.invalidate_block(ids[3])
    assert alloc.free_count == 4
    slots = alloc.allocate_slots_batch([ids[1], ids[0]])
    assert slots[0] != slots[1]
    assert alloc.free_count == 2
    again = alloc.allocate_slots_batch([ids[0], ids[2], ids[1]])
    assert again[0] == slots[1] and again[2] == slots[0]
    assert again[1] not in slots and alloc.free_count == 1
    for b, s in zip([ids[0], ids[1], ids[2]], [slots[1], slots[0], again[1]], strict=True):
        assert alloc.get_slot(b) == s and alloc.slot_to_block[s] == b and alloc.has_state(b)
    assert alloc.get_slot(ids[3]) == -1 and not alloc.has_state(ids[3])
    assert alloc.allocate_slots_batch([]) == []
    alloc.check_invariants()


def test_allocate_is_atomic_when_short():
    _, kv, alloc = make(max_slots=3)
    used, _ = registered_blocks(kv, 3)
    alloc.allocate_slots_batch(used)          # every slot on a ref>0 block: none evictable
    more, _ = registered_blocks(kv, 2, salt=1)
    before = snapshot(alloc)
    assert not alloc.can_allocate_slots([more[0]])
    with pytest.raises(MambaSlotCapacityError) as info:
        alloc.allocate_slots_batch([more[0], more[1]])
    assert (info.value.required, info.value.available) == (2, 0)
    assert_unchanged(before, alloc)
    kv.release_memory_blocks(used[2:])        # one slot becomes evictable
    with pytest.raises(MambaSlotCapacityError) as info:
        alloc.allocate_slots_batch(more)
    assert (info.value.required, info.value.available) == (2, 1)
    assert_unchanged(before, alloc)
    assert alloc.can_allocate_slots([more[0]])
    assert alloc.allocate_slots_batch([more[0]]) == [before[0][used[2]]]
    assert alloc.get_slot(used[2]) == -1
    alloc.check_invariants()


def test_blocks_of_the_batch_are_never_victims():
    _, kv, alloc = make(max_slots=2)
    ids, _ = registered_blocks(kv, 3, release=True)   # all cached, ref 0
    alloc.allocate_slots_batch(ids[:2])
    before = snapshot(alloc)
    # ids[0] and ids[1] are evictable, but ids[0] is part of the batch: only ids[1] can go.
    with pytest.raises(MambaSlotCapacityError):
        alloc.allocate_slots_batch([ids[0], ids[2], 15])
    assert_unchanged(before, alloc)
    slots = alloc.allocate_slots_batch([ids[0], ids[2]])
    assert slots == [before[0][ids[0]], before[0][ids[1]]] and alloc.get_slot(ids[1]) == -1


@pytest.mark.parametrize("policy", ["lru", "ref_zero"])
def test_eviction_order_oldest_timestamp_then_block_id(policy):
    _, kv, alloc = make(max_slots=4, num_blocks=12, policy=policy)
    # Blocks 0..3 stamped at clocks 0, 1, 1, 0 (retain refreshes the stamp), slots for all.
    stamps = [0, 1, 1, 0]
    blocks = kv.allocate_memory_blocks(4).tolist()
    kv.advance_clock()
    kv.retain_memory_blocks(blocks[1:3])
    kv.release_memory_blocks(blocks[1:3])
    assert kv.block_timestamps[blocks].tolist() == stamps
    alloc.allocate_slots_batch(blocks)
    kv.advance_clock()
    pinned = kv.allocate_memory_blocks(4)
    alloc_order = []
    kv.release_memory_blocks(blocks)         # unregistered: ref 0 under both policies
    for n in (1, 1, 2):
        victims_before = alloc.block_to_slot.copy()
        new = pinned[:n].tolist()
        pinned = pinned[n:]
        alloc.allocate_slots_batch(new)
        lost = [b for b in blocks if victims_before[b] >= 0 and alloc.block_to_slot[b] < 0]
        alloc_order += sorted(lost, key=lambda b: (stamps[blocks.index(b)], b))
    # Oldest first (clock 0: blocks 0, 3), ties by block id, then clock 1 (blocks 1, 2).
    assert alloc_order == [blocks[0], blocks[3], blocks[1], blocks[2]]
    alloc.check_invariants()


def test_evict_lru_slots_batch_directly():
    _, kv, alloc = make(max_slots=3)
    ids, hashes = registered_blocks(kv, 3)
    slots = alloc.allocate_slots_batch(ids)
    alloc.register_block_hashes_batch(ids, hashes)
    with pytest.raises(MambaSlotCapacityError):
        alloc._evict_lru_slots_batch(1)       # every block is in use
    kv.release_memory_blocks(ids[1:])
    kv.advance_clock()
    kv.retain_memory_blocks([ids[1]])
    kv.release_memory_blocks([ids[1]])       # ids[1] is now younger than ids[2]
    taken = alloc._evict_lru_slots_batch(1)
    assert taken == [slots[2]]
    assert alloc.get_slot(ids[2]) == -1 and hashes[2] not in alloc.hash_to_block_id
    assert kv.block_hashes[ids[2]] == hashes[2]      # the KV block stays registered
    assert alloc.free_count == 0                     # the caller owns the slot
    assert alloc._evict_lru_slots_batch(0) == []


# --- lookup, invalidation, cascade --------------------------------------------------------------

def test_lookups_validate_block_ids():
    _, _, alloc = make(num_blocks=16)
    for bad in (-1, 16, 99):
        with pytest.raises(IndexError, match="block_id"):
            alloc.get_slot(bad)
        with pytest.raises(IndexError):
            alloc.has_state(bad)
        with pytest.raises(IndexError):
            alloc.invalidate_block(bad)
    with pytest.raises(TypeError):
        alloc.get_slot(1.0)
    with pytest.raises(TypeError):
        alloc.get_slot(True)
    with pytest.raises(IndexError):
        alloc.allocate_slots_batch([0, 16])
    assert alloc.free_count == alloc.max_slots


def test_invalidate_block_frees_slot_and_drops_hash():
    _, kv, alloc = make(max_slots=3)
    ids, hashes = registered_blocks(kv, 2)
    slots = alloc.allocate_slots_batch(ids)
    alloc.register_block_hashes_batch(ids, hashes)
    alloc.invalidate_block(ids[0])
    assert alloc.get_slot(ids[0]) == -1 and alloc.free_count == 2
    assert alloc.hash_to_block_id == {hashes[1]: ids[1]}
    assert alloc.free_slots[alloc.free_count - 1] == slots[0]   # back on top of the stack
    alloc.invalidate_block(ids[0])                              # no slot: no-op
    assert alloc.free_count == 2
    alloc._invalidate_blocks_batch([ids[1], ids[1], 7])
    assert alloc.free_count == 3 and alloc.hash_to_block_id == {}
    alloc.check_invariants()


def test_kv_eviction_cascades_to_mamba():
    _, kv, alloc = make(num_blocks=4, max_slots=4)
    ids, hashes = registered_blocks(kv, 3, release=True)   # cached chain
    alloc.allocate_slots_batch(ids)
    alloc.register_block_hashes_batch(ids, hashes)
    kv.allocate_memory_blocks(2)     # 1 free + 1 evicted: the chain's leaf goes
    assert alloc.get_slot(ids[2]) == -1 and hashes[2] not in alloc.hash_to_block_id
    assert alloc.hash_to_block_id == {hashes[0]: ids[0], hashes[1]: ids[1]}
    assert kv.evict_lru_blocks(2)
    assert alloc.hash_to_block_id == {} and alloc.free_count == 4
    alloc.check_invariants()


def test_ref_zero_release_cascades_to_mamba():
    _, kv, alloc = make(policy="ref_zero", max_slots=2)
    ids, hashes = registered_blocks(kv, 2)
    alloc.allocate_slots_batch(ids)
    alloc.register_block_hashes_batch(ids, hashes)
    kv.release_memory_blocks([ids[0]])
    assert alloc.get_slot(ids[0]) == -1 and alloc.hash_to_block_id == {hashes[1]: ids[1]}
    alloc.check_invariants()


def test_observer_direct_call_drops_listed_hashes():
    _, kv, alloc = make()
    ids, hashes = registered_blocks(kv, 2)
    alloc.allocate_slots_batch(ids)
    alloc.register_block_hashes_batch(ids, hashes)
    alloc.on_kv_blocks_deregistered([ids[1]], {hashes[1]})
    assert alloc.hash_to_block_id == {hashes[0]: ids[0]} and alloc.get_slot(ids[1]) == -1


def test_register_block_hashes_validates_against_kv_map():
    _, kv, alloc = make()
    ids, hashes = registered_blocks(kv, 3)
    fresh = kv.allocate_memory_blocks(1).tolist()            # unregistered KV block
    alloc.allocate_slots_batch(ids[:2] + fresh)
    before = snapshot(alloc)
    with pytest.raises(ValueError, match="owning a slot"):
        alloc.register_block_hashes_batch([ids[0], ids[2]], hashes[::2])
    with pytest.raises(ValueError, match="KV hash"):
        alloc.register_block_hashes_batch(ids[:2], [hashes[0], hashes[0]])
    with pytest.raises(ValueError, match="hashes"):
        alloc.register_block_hashes_batch(ids[:2], hashes[:1])
    with pytest.raises(IndexError):
        alloc.register_block_hashes_batch([99], [5])
    assert_unchanged(before, alloc)
    alloc.register_block_hashes_batch(ids[:2] + fresh, [hashes[0], hashes[1], -1])
    alloc.register_block_hashes_batch(ids[:1], hashes[:1])   # idempotent
    assert alloc.hash_to_block_id == {hashes[0]: ids[0], hashes[1]: ids[1]}
    alloc.check_invariants()


def _registered_with_slots():
    _, kv, alloc = make()
    ids, hashes = registered_blocks(kv, 3)
    fresh = kv.allocate_memory_blocks(1).tolist()            # unregistered KV block
    alloc.allocate_slots_batch(ids[:2] + fresh)
    return kv, alloc, ids, hashes, fresh


@pytest.mark.parametrize("form", ["list", "tuple", "array", "numpy ints", "mixed"])
def test_register_lean_and_checked_paths_agree(form):
    # Lists of Python ints take the lean path; every other form the vectorised checks. Both
    # register the same pairs.
    kv, alloc, ids, hashes, _ = _registered_with_slots()
    b, h = ids[:2], hashes[:2]
    args = {"list": (b, h), "tuple": (tuple(b), tuple(h)), "array": (np.array(b), np.array(h)),
            "numpy ints": ([np.int64(x) for x in b], [np.int64(x) for x in h]),
            "mixed": (b, np.array(h))}[form]
    alloc.register_block_hashes_batch(*args)
    assert alloc.hash_to_block_id == {h[0]: b[0], h[1]: b[1]}
    assert all(type(k) is int and type(v) is int for k, v in alloc.hash_to_block_id.items())
    alloc.check_invariants()


@pytest.mark.parametrize("case, error, match", [
    ("bool id", TypeError, "block_ids"), ("float hash", TypeError, "hashes"),
    ("bool hash", TypeError, "hashes"), ("float id", TypeError, "block_ids"),
    ("other block's hash", ValueError, "KV hash"), ("unregistered block", ValueError, "KV hash"),
    ("no slot", ValueError, "owning a slot"), ("out of range", IndexError, "block_ids"),
    ("short hashes", ValueError, "hashes"), ("long hashes", ValueError, "hashes"),
    ("repeated hash", ValueError, "KV hash")])
def test_register_refusals_change_nothing_on_either_path(case, error, match):
    kv, alloc, ids, hashes, fresh = _registered_with_slots()
    alloc.register_block_hashes_batch(ids[:1], hashes[:1])
    before = snapshot(alloc)
    # Each refused batch leads with a registrable pair, so the lean path has begun its scan.
    b, h = [ids[1]], [hashes[1]]
    bad = {"bool id": (b + [True], h + [hashes[0]]),
           "float hash": (b + [ids[0]], h + [float(hashes[0])]),
           "bool hash": (b + [ids[0]], h + [True]),
           "float id": (b + [float(ids[0])], h + [hashes[0]]),
           "other block's hash": (b + [ids[0]], h + [hashes[1]]),
           "unregistered block": (b + fresh, h + [12345]),
           "no slot": (b + [ids[2]], h + [hashes[2]]),
           "out of range": (b + [99], h + [5]),
           "short hashes": (b + [ids[0]], h),
           "long hashes": (b, h + [hashes[0]]),
           "repeated hash": (b + [ids[0]], h + h)}[case]
    with pytest.raises(error, match=match):
        alloc.register_block_hashes_batch(*bad)
    assert_unchanged(before, alloc)


@pytest.mark.parametrize("seed", range(20))
def test_batched_offsets_equal_one_row_at_a_time(seed):
    """compute_and_store_offsets_batch with an extension's candidates (nothing matched or
    skipped; the boundaries ceil(start / bs), the last boundary, the start of the last block and
    the boundary before the last one) equals compute_and_store_offsets row by row."""
    rng = np.random.default_rng(seed)
    bs, chunk = int(rng.choice([1, 2, 4])), 1
    chunk = int(rng.choice([c for c in (1, 2, 4) if bs % c == 0]))
    ctx_a, _, one = make(bs=bs, chunk=chunk)
    ctx_b, _, batch = make(bs=bs, chunk=chunk)
    rows = rng.permutation(R)[:int(rng.integers(1, R + 1))]
    starts = rng.integers(0, 8 * bs - 1, len(rows))
    ends = np.minimum(starts + rng.integers(1, 3 * bs + 2, len(rows)), 8 * bs)
    for ctx in (ctx_a, ctx_b):
        ctx.request_to_kv_block_ids[:] = np.arange(R * 8).reshape(R, 8)
    for row, s, e in zip(rows.tolist(), starts.tolist(), ends.tolist(), strict=True):
        last = e // bs * bs
        one.compute_and_store_offsets(_req(e, s), row, 0, e - s, 0, [], -(-e // bs),
                                      extra_boundaries=(last - bs,))
    last = ends // bs * bs
    bounds = np.stack([-(-starts // bs) * bs, last, (-(-ends // bs) - 1) * bs, last - bs], 1)
    batch.compute_and_store_offsets_batch(rows.astype(np.int64), starts, ends - starts,
                                          bounds, np.where(ends % bs == 0, ends // bs - 1, -1))
    assert batch.intermediate_targets() == one.intermediate_targets()
    np.testing.assert_array_equal(batch._intermediate_block_ids, one._intermediate_block_ids)
    np.testing.assert_array_equal(batch._eos_cache_block_id, one._eos_cache_block_id)
    if (ends - starts).max() == 1:          # the one-token form needs no candidates
        ctx_c, _, single = make(bs=bs, chunk=chunk)
        ctx_c.request_to_kv_block_ids[:] = ctx_a.request_to_kv_block_ids
        single.compute_and_store_offsets_batch(
            rows.astype(np.int64), starts, ends - starts, None,
            np.where(ends % bs == 0, ends // bs - 1, -1))
        np.testing.assert_array_equal(single._eos_cache_block_id, one._eos_cache_block_id)
        assert single.intermediate_targets() == one.intermediate_targets()


# --- copies -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_store_from_live_and_restore_round_trip(device):
    ctx, kv, alloc = make(device, max_slots=4)
    ids, _ = registered_blocks(kv, 3)
    slots = alloc.allocate_slots_batch(ids)
    live_conv, live_ssm = host(ctx.mamba_conv_states).copy(), host(ctx.mamba_ssm_states).copy()
    # request rows 0, 2 have live slots 2, 3 (request_to_mamba_state_idx = [2, 0, 3, -1])
    alloc.store_from_live_batch([slots[1], slots[0]], [0, 2])
    conv, ssm = host(alloc.conv_states), host(alloc.ssm_states)
    np.testing.assert_array_equal(conv[:, slots[1]], live_conv[:, 2])
    np.testing.assert_array_equal(ssm[:, slots[0]], live_ssm[:, 3])
    assert not host(alloc.ssm_states)[:, slots[2]].any()
    # Restore block ids[0] (holding row 2's state) into row 1 (live slot 0).
    assert alloc.restore_to_live(1, ids[0])
    np.testing.assert_array_equal(host(ctx.mamba_ssm_states)[:, 0], live_ssm[:, 3])
    np.testing.assert_array_equal(host(ctx.mamba_conv_states)[:, 0], live_conv[:, 3])
    np.testing.assert_array_equal(host(ctx.mamba_ssm_states)[:, 1:], live_ssm[:, 1:])
    # A block without a slot restores nothing.
    before = host(ctx.mamba_ssm_states).copy()
    assert not alloc.restore_to_live(1, 9)
    np.testing.assert_array_equal(host(ctx.mamba_ssm_states), before)
    assert alloc.restore_to_live_batch([0, 1], [9, ids[1]]) == [False, True]
    np.testing.assert_array_equal(host(ctx.mamba_ssm_states)[:, 0], live_ssm[:, 2])


def test_copy_validation_changes_nothing():
    ctx, kv, alloc = make()
    ids, _ = registered_blocks(kv, 2)
    slots = alloc.allocate_slots_batch(ids[:1])
    before = snapshot(alloc)
    live = ctx.mamba_ssm_states.copy()
    with pytest.raises(ValueError, match="free slot"):
        alloc.store_from_live_batch([slots[0] + 1], [0])
    with pytest.raises(ValueError, match="distinct"):
        alloc.store_from_live_batch([slots[0], slots[0]], [0, 2])
    with pytest.raises(ValueError, match="live Mamba slot"):
        alloc.store_from_live_batch(slots, [3])               # row 3 has no live slot
    with pytest.raises(IndexError):
        alloc.store_from_live_batch(slots, [4])
    with pytest.raises(IndexError):
        alloc.store_from_live_batch([4], [0])
    with pytest.raises(ValueError):
        alloc.store_from_live_batch(slots, [0, 1])
    with pytest.raises(ValueError, match=r"^request_idx: expected requests with a live Mamba "):
        alloc.restore_to_live(3, ids[0])      # named as the caller's parameter (issue 21.7)
    with pytest.raises(ValueError, match=r"^request_indices: expected requests with a live "):
        alloc.restore_to_live_batch([3], ids[:1])
    with pytest.raises(IndexError):
        alloc.restore_to_live(0, 16)
    with pytest.raises(ValueError, match="distinct live"):
        alloc.restore_to_live_batch([0, 0], ids[:1] * 2)
    assert_unchanged(before, alloc)
    np.testing.assert_array_equal(ctx.mamba_ssm_states, live)


@pytest.mark.parametrize("device", DEVICES)
def test_store_from_tensors(device):
    ctx, kv, alloc = make(device)
    xp = xp_of(device)
    ids, _ = registered_blocks(kv, 2)
    slot = alloc.allocate_slots_batch(ids[:1])[0]
    ssm = xp.arange(10, dtype=np.float32).reshape(SSM)
    conv = xp.full(CONV, 7, dtype=np.float16)
    alloc.store_from_tensors(ids[0], 1, ssm, conv)
    np.testing.assert_array_equal(host(alloc.ssm_states)[1, slot], host(ssm))
    np.testing.assert_array_equal(host(alloc.conv_states)[1, slot], host(conv))
    assert not host(alloc.ssm_states)[[0, 2]].any()
    with pytest.raises(ValueError, match="owning a slot"):
        alloc.store_from_tensors(ids[1], 0, ssm, conv)
    with pytest.raises(IndexError, match="layer_idx"):
        alloc.store_from_tensors(ids[0], L, ssm, conv)
    with pytest.raises(IndexError, match="block_id"):
        alloc.store_from_tensors(-1, 0, ssm, conv)
    with pytest.raises(ValueError, match="ssm_state"):
        alloc.store_from_tensors(ids[0], 0, ssm.reshape(-1), conv)
    with pytest.raises(ValueError, match="conv_state"):
        alloc.store_from_tensors(ids[0], 0, ssm, conv.astype(np.float32))


@pytest.mark.emulated
def test_all_layers_are_one_launch(monkeypatch):
    calls = []
    real = ops.slot_copy

    def spy(slots, src, dst, **kw):
        calls.append((slots.num_tensors, len(src)))
        return real(slots, src, dst, **kw)

    monkeypatch.setattr(ops, "slot_copy", spy)
    _, kv, alloc = make("cuda", max_slots=4)
    ids, hashes = registered_blocks(kv, 3)
    slots = alloc.allocate_slots_batch(ids)
    alloc.store_from_live_batch(slots[:2], [0, 2])
    alloc.restore_to_live_batch([0, 1], ids[:2])
    alloc._copy_intermediate_to_cache([0, 1, 2], slots)
    assert calls == [(2 * L, 2), (2 * L, 2), (2 * L, 3)]



# --- intermediate offsets and commit ------------------------------------------------------------

def _req(prompt_length, finished=0):
    return SimpleNamespace(prompt_length=prompt_length, finished_chunk_token_count=finished)


def test_offsets_megatron_continuation_example():
    # bs 256, prompt 832 tokens (3 blocks + 64), continuation chunk after 512 tokens.
    ctx, _, alloc = make(bs=256, chunk=128)
    ctx.request_to_kv_block_ids[1, :4] = [5, 6, 7, 8]
    alloc.compute_and_store_offsets(_req(832, 512), 1, 0, 320, 0, [], 4)
    assert alloc.intermediate_targets() == [(1, 256, 0)]
    assert alloc._intermediate_block_ids[1, 0] == 7 and alloc._eos_cache_block_id[1] == -1


def test_offsets_first_chunk_candidates_and_eos():
    ctx, _, alloc = make(bs=4, chunk=2)
    ctx.request_to_kv_block_ids[0, :4] = [10, 11, 12, 13]
    ctx.request_to_kv_block_ids[2, :3] = [1, 2, 3]
    # Row 0: 16-token aligned prompt, 1 KV-matched block, nothing skipped: divergence 4,
    # penultimate 12; the last boundary (16) is the prompt end -> EOS from the live state.
    alloc.compute_and_store_offsets(_req(16), 0, 0, 16, 1, [10], 4)
    # Row 2: 10-token prompt, 2 matched blocks, 8 skipped: every candidate is <= 8 -> none.
    alloc.compute_and_store_offsets(_req(10), 2, 8, 10, 2, [1, 2], 3)
    assert alloc.intermediate_targets() == [(0, 4, 0), (0, 12, 1)]
    assert alloc._intermediate_block_ids[0, :2].tolist() == [10, 12]
    assert alloc._eos_cache_block_id.tolist() == [13, -1, -1, -1]
    offsets, counts = alloc.get_intermediate_gpu_data()
    assert counts.tolist() == [2, 0, 0, 0]
    assert offsets[0].tolist() == [4, 12, 0]
    offsets, counts = alloc.get_intermediate_gpu_data(2, 2)
    assert counts.tolist() == [0, 0] and offsets.shape == (2, 3)
    assert alloc.get_intermediate_gpu_data(0, 0) == (None, None)
    with pytest.raises(IndexError):
        alloc.get_intermediate_gpu_data(3, 2)
    # Alignment: with an 8-token chunk granularity neither 4 nor 12 is a chunk boundary.
    ctx.mamba_chunk_size = 8
    alloc.compute_and_store_offsets(_req(16), 0, 0, 16, 1, [10], 4)
    assert alloc.intermediate_targets() == []
    assert alloc._eos_cache_block_id[0] == 13


def test_offsets_extra_boundaries():
    ctx, _, alloc = make(bs=4, chunk=2)
    ctx.request_to_kv_block_ids[0, :4] = [10, 11, 12, 13]
    # 14 tokens: the reference's candidates give only 12; the extra 8 (and a negative or
    # out-of-range one) go through the same filter.
    alloc.compute_and_store_offsets(_req(14), 0, 0, 14, 0, [], 4)
    assert alloc.intermediate_targets() == [(0, 12, 0)]
    alloc.compute_and_store_offsets(_req(14), 0, 0, 14, 0, [], 4, extra_boundaries=(8, -4, 20))
    assert alloc.intermediate_targets() == [(0, 8, 0), (0, 12, 1)]
    assert alloc._intermediate_block_ids[0, :2].tolist() == [11, 12]
    # A boundary inside a block is refused (its state would be kept as the block table's
    # column -1, the row's last block), nothing changed.
    before = alloc.intermediate_targets()
    with pytest.raises(ValueError, match="extra_boundaries: expected multiples of block_size"):
        alloc.compute_and_store_offsets(_req(14), 0, 0, 14, 1, [10], 4, extra_boundaries=(8, 2))
    assert alloc.intermediate_targets() == before
    # Never more than MAX_INTERMEDIATE_OFFSETS_PER_REQUEST offsets: 4, 16, 8 come first.
    ctx.request_to_kv_block_ids[0, :5] = [10, 11, 12, 13, 14]
    alloc.compute_and_store_offsets(_req(18), 0, 0, 18, 1, [10], 5, extra_boundaries=(8, 12))
    assert [t[1] for t in alloc.intermediate_targets()] == [4, 8, 16]


def test_offsets_validation():
    ctx, _, alloc = make(bs=4)
    ctx.request_to_kv_block_ids[0, :2] = [3, 4]
    with pytest.raises(ValueError, match="skip_tokens"):
        alloc.compute_and_store_offsets(_req(8), 0, 8, 8, 2, [3, 4], 2)
    with pytest.raises(ValueError, match="matched_block_ids"):
        alloc.compute_and_store_offsets(_req(8), 0, 0, 8, 1, [4], 2)
    with pytest.raises(ValueError, match="request_to_kv_block_ids"):
        alloc.compute_and_store_offsets(_req(12), 0, 0, 12, 0, [], 3)
    with pytest.raises(IndexError):
        alloc.compute_and_store_offsets(_req(8), R, 0, 8, 0, [], 2)
    with pytest.raises(TypeError, match="req"):
        alloc.compute_and_store_offsets(object(), 0, 0, 8, 0, [], 2)
    assert alloc.get_intermediate_gpu_data() == (None, None)
    assert alloc._collect_commit_data() is None


@pytest.mark.parametrize("device", DEVICES)
def test_commit_intermediate_states(device):
    ctx, kv, alloc = make(device, bs=4, chunk=2, max_slots=4)
    xp = xp_of(device)
    ids, hashes = registered_blocks(kv, 4)
    fresh = kv.allocate_memory_blocks(1).tolist()       # unregistered: must not be kept
    ctx.request_to_kv_block_ids[0, :4] = ids
    ctx.request_to_kv_block_ids[2, :3] = [ids[0], ids[1], fresh[0]]
    alloc.compute_and_store_offsets(_req(16), 0, 0, 16, 1, ids[:1], 4)    # 4, 12 + EOS
    alloc.compute_and_store_offsets(_req(12), 2, 0, 12, 0, [], 3)         # 8 + EOS(fresh)
    targets = alloc.intermediate_targets()
    assert targets == [(0, 4, 0), (0, 12, 1), (2, 8, 2)]
    offsets, counts = alloc.get_intermediate_gpu_data()
    assert isinstance(counts, xp.ndarray) and host(counts).tolist() == [2, 0, 1, 0]
    assert host(offsets)[[0, 2]].tolist() == [[4, 12, 0], [8, 0, 0]]
    rng = np.random.default_rng(1)
    scratch_conv = rng.integers(0, 50, alloc.intermediate_conv_out.shape).astype(np.float16)
    scratch_ssm = rng.random(alloc.intermediate_ssm_out.shape).astype(np.float32)
    alloc.intermediate_conv_out[...] = xp.asarray(scratch_conv)
    alloc.intermediate_ssm_out[...] = xp.asarray(scratch_ssm)
    live_ssm = host(ctx.mamba_ssm_states).copy()
    assert alloc.commit_intermediate_states() == 4
    expect = {ids[0]: ("scratch", 0), ids[2]: ("scratch", 1), ids[1]: ("scratch", 2),
              ids[3]: ("live", 2)}          # row 0's EOS comes from its live slot 2
    assert alloc.hash_to_block_id == {hashes[ids.index(b)]: b for b in expect}
    for b, (kind, i) in expect.items():
        s = alloc.get_slot(b)
        want = scratch_ssm[:, i] if kind == "scratch" else live_ssm[:, i]
        np.testing.assert_array_equal(host(alloc.ssm_states)[:, s], want)
        if kind == "scratch":
            np.testing.assert_array_equal(host(alloc.conv_states)[:, s], scratch_conv[:, i])
    assert alloc.get_slot(fresh[0]) == -1
    assert alloc.intermediate_targets() == [] and alloc._collect_commit_data() is None
    assert alloc.commit_intermediate_states() == 0
    alloc.check_invariants()


def test_commit_is_best_effort_under_slot_pressure():
    ctx, kv, alloc = make(bs=4, chunk=2, max_slots=2)
    ids, hashes = registered_blocks(kv, 4)
    other, _ = registered_blocks(kv, 1, salt=1)
    alloc.allocate_slots_batch([ids[2], other[0]])   # both pinned (ref > 0): not evictable
    ctx.request_to_kv_block_ids[0, :4] = ids
    alloc.compute_and_store_offsets(_req(16), 0, 0, 16, 1, ids[:1], 4)    # 4, 12 + EOS
    assert alloc.commit_intermediate_states() == 1   # only ids[2] (already has a slot)
    assert alloc.hash_to_block_id == {hashes[2]: ids[2]}
    kv.release_memory_blocks(other)                  # other's slot becomes evictable
    alloc.compute_and_store_offsets(_req(16), 0, 0, 16, 1, ids[:1], 4)
    assert alloc.commit_intermediate_states() == 1   # ids[2] already cached; ids[0] gets one
    assert set(alloc.hash_to_block_id.values()) == {ids[0], ids[2]}
    alloc.check_invariants()


def test_copy_intermediate_validation():
    _, kv, alloc = make()
    with pytest.raises(IndexError):
        alloc._copy_intermediate_to_cache([3 * R], [0])
    with pytest.raises(ValueError, match="distinct"):
        alloc._copy_intermediate_to_cache([0, 1], [0, 0])
    with pytest.raises(ValueError):
        alloc._copy_intermediate_to_cache([0, 1], [0])


def test_clear_rows_and_reset():
    ctx, kv, alloc = make(bs=4)
    ids, hashes = registered_blocks(kv, 2)
    ctx.request_to_kv_block_ids[0, :2] = ids
    ctx.request_to_kv_block_ids[1, :2] = ids
    alloc.compute_and_store_offsets(_req(8), 0, 0, 8, 0, [], 2)
    alloc.compute_and_store_offsets(_req(8), 1, 0, 8, 0, [], 2)
    alloc._clear_intermediate_state([0])
    assert [t[0] for t in alloc.intermediate_targets()] == [1]
    alloc._clear_intermediate_state()
    assert alloc._collect_commit_data() is None
    alloc.allocate_slots_batch(ids)
    alloc.register_block_hashes_batch(ids, hashes)
    alloc.store_from_live_batch([alloc.get_slot(ids[0])], [0])
    alloc.reset()
    assert alloc.free_count == alloc.max_slots and alloc.hash_to_block_id == {}
    assert (alloc.block_to_slot == -1).all() and not alloc.ssm_states.any()
    alloc.check_invariants()
    kv.release_memory_blocks(ids)      # the observer survives a reset
    assert kv.evict_lru_blocks(2) and alloc.hash_to_block_id == {}


# --- check_invariants really checks -------------------------------------------------------------

@pytest.mark.parametrize("corrupt", ["double_owner", "not_inverse", "lost_slot", "stale_hash",
                                     "hash_without_slot", "foreign_hash"])
def test_check_invariants_detects_corruption(corrupt):
    _, kv, alloc = make(max_slots=3)
    ids, hashes = registered_blocks(kv, 3)
    slots = alloc.allocate_slots_batch(ids[:2])
    alloc.register_block_hashes_batch(ids[:2], hashes[:2])
    alloc.check_invariants()
    if corrupt == "double_owner":
        alloc.block_to_slot[ids[2]] = slots[0]
    elif corrupt == "not_inverse":
        alloc.slot_to_block[slots[0]] = ids[2]
    elif corrupt == "lost_slot":
        alloc.free_count -= 1
    elif corrupt == "stale_hash":
        kv.release_memory_blocks(ids[1:2])
        kv.kv_hash_to_block_id.pop(hashes[1])       # KV map lost it, Mamba map did not
    elif corrupt == "hash_without_slot":
        alloc.block_to_slot[ids[1]] = -1
        alloc.slot_to_block[slots[1]] = -1
        alloc.free_slots[alloc.free_count] = slots[1]
        alloc.free_count += 1
    elif corrupt == "foreign_hash":
        alloc.hash_to_block_id[hashes[0]] = ids[1]
    with pytest.raises(RuntimeError, match="MambaSlotAllocator invariants"):
        alloc.check_invariants()


def test_commit_intermediate_states_checks_its_stream_with_nothing_to_commit():
    """A bad stream is refused on cpu too, even on a step that stores nothing (it would fail on
    cuda)."""
    _, _, alloc = make(max_slots=4)
    for bad in ("default", -1, 2**64):
        with pytest.raises((TypeError, ValueError), match="stream: expected"):
            alloc.commit_intermediate_states(stream=bad)


def test_a_hash_below_minus_one_is_refused_not_skipped():
    """Only -1 (unregistered) and 0 (no hash) are skipped; any other non-positive value is no
    block hash at all, so the call is refused and nothing changes."""
    _, kv, alloc = make(max_slots=4)
    ids, hashes = registered_blocks(kv, 2)
    alloc.allocate_slots_batch(ids)
    before = snapshot(alloc)
    for bad in ([hashes[0], -5], np.array([hashes[0], -5], np.int64)):
        with pytest.raises(ValueError, match=r"hashes\[1\]: expected a block hash > 0"):
            alloc.register_block_hashes_batch(list(ids) if isinstance(bad, list) else ids, bad)
        assert_unchanged(before, alloc)
    alloc.register_block_hashes_batch(list(ids), [hashes[0], -1])     # -1: skipped
    assert alloc.hash_to_block_id == {hashes[0]: int(ids[0])}


def test_store_from_tensors_names_a_state_that_is_not_an_array():
    _, kv, alloc = make(max_slots=4)
    ids, _ = registered_blocks(kv, 1)
    alloc.allocate_slots_batch(ids)
    before = snapshot(alloc)
    conv = np.zeros(alloc.conv_states.shape[2:], alloc.conv_states.dtype)
    for bad in (None, [0.0], 1.5, "x"):
        with pytest.raises(TypeError, match="ssm_state: expected a numpy array"):
            alloc.store_from_tensors(int(ids[0]), 0, bad, conv)
        assert_unchanged(before, alloc)


def test_a_kv_reset_alone_leaves_the_old_slots_evictable_in_lru_order():
    """``KVBlockAllocator.reset`` without the Mamba allocator's: every block is at ref count 0
    with timestamp 0, so the slots its blocks still own are evictable, lowest block first (the
    slot LRU hears of it through the release observer, as a scan of every slot would see it)."""
    _, kv, alloc = make(num_blocks=16, max_slots=3)
    kv.advance_clock(5)
    ids = kv.allocate_memory_blocks(3)
    alloc.allocate_slots_batch(ids)
    kv.release_memory_blocks(ids)
    kv.reset()
    alloc.check_invariants()
    victims = sorted(ids.tolist())[:2]
    slots = [alloc.get_slot(b) for b in victims]
    assert alloc.allocate_slots_batch([5, 6]) == slots
    assert [alloc.get_slot(b) for b in victims] == [-1, -1]
    alloc.check_invariants()
