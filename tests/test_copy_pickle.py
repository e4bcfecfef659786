"""``copy`` and ``pickle`` of the objects that own cache memory (hcache/_copying.py, issue 12):
``copy.copy`` is refused (a shallow copy would share buffers and bookkeeping, which would
diverge), ``copy.deepcopy`` gives an independent object with the same contents (refused for
the continuous-batching manager and its batches, shared between threads), pickling is refused.

Oracles: the snapshot of everything an object reaches (tests/error_contract_kinds.py): a deep
copy's equals the original's, no array of the copy shares memory with one of the original, and
a command on the copy leaves the original's snapshot unchanged.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from error_contract_cases import (
    make_alloc,
    make_cb,
    make_ctx,
    make_hybrid,
    make_kv,
    make_linear,
    make_mamba,
    make_msa,
    make_pool,
)
from error_contract_kinds import first_difference, snapshot

DEEP = {
    "KVCacheManager": (make_kv, lambda m: m.write_kv(0, *2 * [np.ones((3, 1, 2, 4), np.float16)],
                                                     positions=[[0]] * 3)),
    "MambaCacheManager": (make_mamba, lambda m: m.clear_slot(0)),
    "HybridCacheManager": (make_hybrid, lambda m: m.commit_sequence_length(1)),
    "LinearKVCache": (make_linear, lambda m: m.commit_sequence_length(1)),
    "PagedKVPool": (make_pool, lambda p: p.copy_blocks([0], [5])),
    "KVBlockAllocator": (make_alloc, lambda a: a.allocate_memory_blocks(2)),
    "MambaSlotAllocator": (make_msa, lambda m: m.reset()),
    "DynamicInferenceContext": (make_ctx(), lambda c: c.release_requests(["a"])),
}
REFUSED_DEEP = {"ContinuousBatchingKVCacheManager": make_cb(),
                "ContinuousBatchingKVCacheCollection": make_cb(fetched=True)}
ALL = {**{k: v[0] for k, v in DEEP.items()}, **REFUSED_DEEP}


def _arrays(root):
    """Every NumPy array reachable from ``root`` (as the snapshot walks it)."""
    found, seen, stack = [], set(), [root]
    while stack:
        x = stack.pop()
        if id(x) in seen or isinstance(x, (type, type(np), str, bytes, int, float)):
            continue
        seen.add(id(x))
        if isinstance(x, np.ndarray):
            found.append(x)
        elif isinstance(x, dict):
            stack += list(x.values())
        elif isinstance(x, (list, tuple, set)):
            stack += list(x)
        elif hasattr(x, "__dict__"):
            stack += list(vars(x).values())
    return found


@pytest.mark.parametrize("name", sorted(ALL))
def test_shallow_copy_and_pickle_are_refused_with_a_reason(name):
    _, obj = ALL[name]()
    with pytest.raises(TypeError, match=rf"^copy\.copy\({name}\): a shallow copy would share"):
        copy.copy(obj)
    with pytest.raises(TypeError, match=rf"^pickle\({name}\): its caches are device memory"):
        pickle.dumps(obj)


@pytest.mark.parametrize("name", sorted(REFUSED_DEEP))
def test_continuous_batching_refuses_deepcopy(name):
    root, obj = REFUSED_DEEP[name]()
    before = snapshot(root)
    with pytest.raises(TypeError, match=rf"^copy\.deepcopy\({name}\): it is shared between "
                                        r"threads"):
        copy.deepcopy(obj)
    assert first_difference(before, snapshot(root)) is None


@pytest.mark.parametrize("name", sorted(DEEP))
def test_deepcopy_is_an_independent_object_with_the_same_contents(name):
    make, command = DEEP[name]
    _, obj = make()
    clone = copy.deepcopy(obj)
    assert type(clone) is type(obj) and clone is not obj
    original = snapshot(obj)
    assert first_difference(original, snapshot(clone)) is None
    ours = _arrays(obj)
    assert ours, "the object owns no array: the test would not test anything"
    for a in _arrays(clone):
        assert not any(np.shares_memory(a, b) for b in ours)
    command(clone)
    assert first_difference(original, snapshot(clone)) is not None   # the command did work
    assert first_difference(original, snapshot(obj)) is None
