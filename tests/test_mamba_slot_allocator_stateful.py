"""Stateful test: a real KVBlockAllocator and a MambaSlotAllocator driven together.

Requests hold hash chains of KV blocks (prefix-matched and pinned like the context does), the
KV pool is small so LRU evictions cascade into the Mamba cache, and Mamba slots are allocated,
stored, registered, restored and invalidated. After every rule, rejected calls included (which
must change nothing), both ``check_invariants()`` run plus independent checks: slot
conservation, ref counts >= 0, every cached block's parent cached, the Mamba map a subset of the
KV map, no slot owned twice, eviction victims in (timestamp, id) order, and every stored state's
bytes unchanged while its block keeps its slot.
"""

from __future__ import annotations

from types import SimpleNamespace

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hcache.contexts import KVBlockAllocator, MambaSlotAllocator, MambaSlotCapacityError

N, SLOTS, R, L = 10, 4, 3, 2
CONV, SSM = (2, 3), (3,)
BLOCKS = st.integers(0, N - 1)


def chain_hash(salt: int, k: int) -> int:
    """Hash of block ``k`` of chain ``salt``: chains of one salt share their prefixes."""
    return salt * 100 + k + 1


class MambaCacheMachine(RuleBasedStateMachine):
    policy = "lru"

    @initialize()
    def setup(self):
        self.kv = KVBlockAllocator(N, eviction_policy=self.policy)
        self.ctx = SimpleNamespace(
            kv_block_allocator=self.kv,
            mamba_conv_states=np.zeros((L, R, *CONV), dtype=np.float16),
            mamba_ssm_states=np.zeros((L, R, *SSM), dtype=np.float32),
            request_to_mamba_state_idx=np.array([1, 2, 0], dtype=np.int32))
        self.alloc = MambaSlotAllocator(self.ctx, SLOTS, L, CONV, SSM, "float16", "float32")
        self.requests: list[list[int]] = []
        self.expected: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.counter = 0

    # --- helpers --------------------------------------------------------------------------------

    def snapshot(self):
        a = self.alloc
        return (a.block_to_slot.copy(), a.slot_to_block.copy(), a.free_count,
                a.free_slots[:a.free_count].copy(), dict(a.hash_to_block_id),
                a.conv_states.copy(), a.ssm_states.copy(), self.kv.block_ref_counts.copy(),
                dict(self.kv.kv_hash_to_block_id))

    def assert_unchanged(self, before):
        for x, y in zip(before, self.snapshot(), strict=True):
            if isinstance(x, np.ndarray):
                np.testing.assert_array_equal(x, y)
            else:
                assert x == y

    def prune(self):
        for b in [b for b in self.expected if self.alloc.block_to_slot[b] < 0]:
            event("a stored state was evicted or invalidated")
            del self.expected[b]

    def owned_blocks(self):
        return np.nonzero(self.alloc.block_to_slot >= 0)[0].tolist()

    # --- KV side --------------------------------------------------------------------------------

    @rule(salt=st.integers(0, 2), n=st.integers(1, 4))
    def add_request(self, salt, n):
        kv = self.kv
        hashes = [chain_hash(salt, k) for k in range(n)]
        matched = []
        for h in hashes:
            if h not in kv.kv_hash_to_block_id:
                break
            matched.append(kv.kv_hash_to_block_id[h])
        pinned_free = int((kv.block_ref_counts[matched] == 0).sum()) if matched else 0
        if not kv.is_memory_available(n - len(matched), pinned_free):
            return
        kv.retain_memory_blocks(matched)
        new = kv.allocate_memory_blocks(n - len(matched))
        assert new is not None
        blocks = matched + new.tolist()
        k0 = len(matched)
        kv.register_kv_block_hashes(new, hashes[k0:], [0 if k == 0 else hashes[k - 1]
                                                       for k in range(k0, n)])
        self.requests.append(blocks)
        self.prune()

    @rule(data=st.data())
    def release_request(self, data):
        if not self.requests:
            return
        i = data.draw(st.integers(0, len(self.requests) - 1))
        self.kv.release_memory_blocks(self.requests.pop(i))
        self.prune()

    @rule(n=st.integers(0, 3))
    def evict_kv(self, n):
        self.kv.evict_lru_blocks(n)
        self.prune()

    @rule()
    def tick(self):
        self.kv.advance_clock()

    # --- Mamba side -----------------------------------------------------------------------------

    @rule(ids=st.lists(BLOCKS, min_size=1, max_size=4))
    def allocate_slots(self, ids):
        self._allocate(ids)

    @rule(data=st.data(), row=st.integers(0, R - 1), value=st.integers(1, 200))
    def snapshot_request(self, data, row, value):
        """What a commit does: slots for some of a request's blocks, live state, hashes."""
        if not self.requests:
            return
        blocks = data.draw(st.sampled_from(self.requests))
        picks = data.draw(st.lists(st.sampled_from(blocks), min_size=1, max_size=2,
                                   unique=True))
        slots = self._allocate(picks)
        if slots is None:
            return
        live = self._set_live(row, value)
        self.alloc.store_from_live_batch(slots[:1], [row])
        self.expected[picks[0]] = live
        self.alloc.register_block_hashes_batch(picks, self.kv.block_hashes[picks])
        assert all(self.alloc.hash_to_block_id[self.kv.block_hashes[b]] == b for b in picks)

    def _set_live(self, row, value):
        live = int(self.ctx.request_to_mamba_state_idx[row])
        self.ctx.mamba_conv_states[:, live] = value + np.arange(np.prod(CONV)).reshape(CONV)
        self.ctx.mamba_ssm_states[:, live] = -value
        return (self.ctx.mamba_conv_states[:, live].copy(),
                self.ctx.mamba_ssm_states[:, live].copy())

    def _allocate(self, ids):
        """Allocate with the outcome predicted first: refusal (nothing changes) or success
        with exactly the oldest (timestamp, id) evictable blocks losing their slots."""
        a, kv = self.alloc, self.kv
        had = {b: int(a.block_to_slot[b]) for b in ids if a.block_to_slot[b] >= 0}
        new = list(dict.fromkeys(b for b in ids if b not in had))
        candidates = sorted((int(kv.block_timestamps[b]), b) for b in self.owned_blocks()
                            if kv.block_ref_counts[b] == 0 and b not in ids)
        short = max(0, len(new) - a.free_count)
        before = self.snapshot()
        if short > len(candidates):
            with pytest.raises(MambaSlotCapacityError) as info:
                a.allocate_slots_batch(ids)
            assert info.value.required == len(new)
            assert info.value.available == a.free_count + len(candidates)
            self.assert_unchanged(before)
            event("slot allocation refused")
            return None
        owned_before = set(self.owned_blocks())
        slots = a.allocate_slots_batch(ids)
        assert all(slots[i] == had[b] for i, b in enumerate(ids) if b in had)
        assert len({s for b, s in zip(ids, slots, strict=True)}) == len(set(ids))
        first = {b: slots[ids.index(b)] for b in ids}     # a repeated id: one slot for all
        assert all(s == first[b] for b, s in zip(ids, slots, strict=True))
        lost = owned_before - set(self.owned_blocks())
        assert lost == {b for _, b in candidates[:short]}
        if lost:
            event("slots evicted for allocation")
        self.prune()
        return slots

    @rule(data=st.data(), row=st.integers(0, R - 1), value=st.integers(1, 200))
    def store_live(self, data, row, value):
        owned = self.owned_blocks()
        if not owned:
            return
        b = data.draw(st.sampled_from(owned))
        live = self._set_live(row, value)
        self.alloc.store_from_live_batch([self.alloc.get_slot(b)], [row])
        self.expected[b] = live

    @rule(data=st.data())
    def register_hashes(self, data):
        owned = self.owned_blocks()
        if not owned:
            return
        picks = data.draw(st.lists(st.sampled_from(owned), min_size=1, max_size=3))
        hashes = [int(self.kv.block_hashes[b]) for b in picks]
        self.alloc.register_block_hashes_batch(picks, hashes)
        for b, h in zip(picks, hashes, strict=True):
            assert (self.alloc.hash_to_block_id.get(h) == b) == (h > 0)

    @rule(data=st.data(), row=st.integers(0, R - 1))
    def restore(self, data, row):
        b = data.draw(st.sampled_from(sorted(self.expected) + self.owned_blocks() + [N - 1]))
        live = int(self.ctx.request_to_mamba_state_idx[row])
        before = self.ctx.mamba_ssm_states.copy()
        restored = self.alloc.restore_to_live(row, b)
        assert restored == (self.alloc.block_to_slot[b] >= 0)
        if not restored:
            np.testing.assert_array_equal(self.ctx.mamba_ssm_states, before)
        elif b in self.expected:
            event("restored a stored state")
            np.testing.assert_array_equal(self.ctx.mamba_conv_states[:, live], self.expected[b][0])
            np.testing.assert_array_equal(self.ctx.mamba_ssm_states[:, live], self.expected[b][1])

    @rule(b=st.integers(-2, N + 1))
    def invalidate(self, b):
        if not 0 <= b < N:
            before = self.snapshot()
            with pytest.raises(IndexError):
                self.alloc.invalidate_block(b)
            self.assert_unchanged(before)
            return
        h = int(self.alloc._block_hash[b])
        self.alloc.invalidate_block(b)
        assert self.alloc.block_to_slot[b] == -1 and h not in self.alloc.hash_to_block_id
        self.prune()

    # --- rejected calls -------------------------------------------------------------------------

    @rule(ids=st.lists(st.integers(-3, N + 3), min_size=1, max_size=3))
    def allocate_out_of_range(self, ids):
        if all(0 <= b < N for b in ids):
            return
        before = self.snapshot()
        with pytest.raises(IndexError):
            self.alloc.allocate_slots_batch(ids)
        self.assert_unchanged(before)

    @rule(data=st.data(), delta=st.integers(1, 50))
    def register_wrong_hash(self, data, delta):
        owned = [b for b in self.owned_blocks() if self.kv.block_hashes[b] > 0]
        if not owned:
            return
        b = data.draw(st.sampled_from(owned))
        before = self.snapshot()
        with pytest.raises(ValueError):
            self.alloc.register_block_hashes_batch([b], [int(self.kv.block_hashes[b]) + delta])
        self.assert_unchanged(before)

    @rule(data=st.data())
    def register_without_slot(self, data):
        registered = [b for b in np.nonzero(self.kv.block_hashes > 0)[0].tolist()
                      if self.alloc.block_to_slot[b] < 0]
        if not registered:
            return
        b = data.draw(st.sampled_from(registered))
        before = self.snapshot()
        with pytest.raises(ValueError):
            self.alloc.register_block_hashes_batch([b], [int(self.kv.block_hashes[b])])
        self.assert_unchanged(before)

    @rule(row=st.integers(0, R - 1))
    def store_into_free_slot(self, row):
        if self.alloc.free_count == 0:
            return
        before = self.snapshot()
        with pytest.raises(ValueError):
            self.alloc.store_from_live_batch([int(self.alloc.free_slots[0])], [row])
        self.assert_unchanged(before)

    # --- invariants -----------------------------------------------------------------------------

    @invariant()
    def invariants_hold(self):
        a, kv = self.alloc, self.kv
        a.check_invariants()
        kv.check_invariants()
        owned = a.block_to_slot[a.block_to_slot >= 0]
        assert len(set(owned.tolist())) == len(owned)                 # no slot owned twice
        assert a.free_count + len(owned) == SLOTS                     # conservation
        assert (kv.block_ref_counts >= 0).all()
        kv_map = kv.kv_hash_to_block_id
        for h, b in kv_map.items():                                  # parent of a cached block
            if h % 100 != 1:                                          # is cached too
                assert h - 1 in kv_map, f"block {b} (hash {h}) lost its parent"
        for h, b in a.hash_to_block_id.items():                       # Mamba map within KV map
            assert kv_map.get(h) == b
        for b, (conv, ssm) in self.expected.items():                  # stored bytes survive
            s = a.block_to_slot[b]
            np.testing.assert_array_equal(a.conv_states[:, s], conv)
            np.testing.assert_array_equal(a.ssm_states[:, s], ssm)


class RefZeroMambaCacheMachine(MambaCacheMachine):
    policy = "ref_zero"


TestMambaCacheLRU = MambaCacheMachine.TestCase
TestMambaCacheLRU.settings = settings(stateful_step_count=30)
TestMambaCacheRefZero = RefZeroMambaCacheMachine.TestCase
TestMambaCacheRefZero.settings = settings(stateful_step_count=30)
