"""``copy`` and ``pickle`` of the objects that own cache memory (hcache/_copying.py, issue 12):
``copy.copy`` is refused (a shallow copy would share buffers and bookkeeping, which would
diverge), ``copy.deepcopy`` is refused (views and kernel pointer tables would not follow the
copy), pickling is refused; each says why and what to do, and changes nothing.
``KVBlockAllocator`` (host bookkeeping only) refuses ``copy.copy`` alone: its deep copy and its
pickle are independent allocators in the same state.

Oracles: the snapshot of everything an object reaches (tests/error_contract_kinds.py).
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from error_contract_cases import (
    make_cb,
    make_context_draft_states,
    make_ctx,
    make_draft_states,
    make_hcb,
    make_hybrid,
    make_kv,
    make_linear,
    make_mamba,
    make_msa,
    make_pool,
)
from error_contract_kinds import first_difference, snapshot

from hcache import KVBlockAllocator

OWNERS = {"KVCacheManager": make_kv, "MambaCacheManager": make_mamba,
          "HybridCacheManager": make_hybrid, "LinearKVCache": make_linear,
          "DraftStates": make_draft_states,
          "ContextDraftStates": make_context_draft_states,
          "PagedKVPool": make_pool, "MambaSlotAllocator": make_msa,
          "DynamicInferenceContext": make_ctx(),
          "ContinuousBatchingKVCacheManager": make_cb(),
          "ContinuousBatchingKVCacheCollection": make_cb(fetched=True),
          "ContinuousBatchingHybridCacheManager": make_hcb(),
          "ContinuousBatchingHybridCollection": make_hcb(fetched=True)}
REFUSALS = [(copy.copy, r"copy\.copy\({}\): a shallow copy would share the caches"),
            (copy.deepcopy, r"copy\.deepcopy\({}\): its caches are reached through views"),
            (pickle.dumps, r"pickle\({}\): its caches are device memory")]


@pytest.mark.parametrize("name", sorted(OWNERS))
@pytest.mark.parametrize("call, match", REFUSALS, ids=["copy", "deepcopy", "pickle"])
def test_copies_of_cache_owners_are_refused_with_a_reason(name, call, match):
    root, obj = OWNERS[name]()
    before = snapshot(root)
    with pytest.raises(TypeError, match="^" + match.format(name)) as info:
        call(obj)
    assert f"build a new {name}" in str(info.value)
    assert first_difference(before, snapshot(root)) is None


def _allocator():
    a = KVBlockAllocator(8)
    ids = a.allocate_memory_blocks(3)
    a.register_kv_block_hashes(ids[:2], [11, 12], [0, 11])
    a.release_memory_blocks(ids[:1])
    a.advance_clock(2)
    return a


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda a: pickle.loads(pickle.dumps(a))],
                         ids=["deepcopy", "pickle"])
def test_the_block_allocator_copies_deeply_and_pickles(clone):
    a = _allocator()
    with pytest.raises(TypeError, match=r"^copy\.copy\(KVBlockAllocator\)"):
        copy.copy(a)
    b = clone(a)
    original = snapshot(a)
    assert first_difference(original, snapshot(b)) is None
    assert b.allocate_memory_blocks(2).tolist() == a.allocate_memory_blocks(2).tolist()
    b.release_memory_blocks([1])
    b.check_invariants()
    a.check_invariants()
    assert int(a.block_ref_counts[1]) == 1 and int(b.block_ref_counts[1]) == 0
    assert not any(np.shares_memory(x, y) for x in vars(a).values() if isinstance(x, np.ndarray)
                   for y in vars(b).values() if isinstance(y, np.ndarray))


def test_every_public_cache_owner_is_covered():
    """A public class that owns cache memory (it reports it: ``memory_report``) refuses copies:
    a new cache owner must join ``OWNERS``."""
    import inspect

    import hcache

    owners = {n for n in hcache.__all__ if inspect.isclass(getattr(hcache, n))
              and hasattr(getattr(hcache, n), "memory_report")}
    assert owners and owners <= set(OWNERS), sorted(owners - set(OWNERS))
