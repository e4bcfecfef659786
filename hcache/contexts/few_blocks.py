"""A serving step's few KV blocks, element by element (docs/design.md §8, issue 24): the victims
of one leaf peel deregistered, the blocks of one allocation handed out, the blocks of one
finished request released.

A NumPy call on an array of one or two elements costs more than Python scalar reads and writes
(through the owners' memoryviews, :mod:`.scalar_views`), so
:class:`~hcache.contexts.KVBlockAllocator` takes these paths up to a few dozen blocks and its
NumPy paths beyond them (the oracles of tests/test_listed_eviction.py): the same free stack, ref
counts, timestamps, forest and leaves. Functions of the allocator ``kv``, passed in.
"""

from __future__ import annotations

import numpy as np

from .block_observers import notify

__all__ = ["deregister_peeled", "hand_out", "hand_out_stack", "release_one_each"]


def deregister_peeled(kv, victims: list) -> set:
    """Unregister and free the ``victims`` of a committed peel, in order (cached: ref count 0,
    out of the leaves, and the parents they leave childless are leaves already: see
    :meth:`EvictableLeaves.peel`); their timestamps drop to 0 and they go on the free stack.
    Returns their former hashes."""
    hashes, _ = kv._forest.unlink_listed(victims)
    stamps = kv._scalars.stamps
    for b in victims:
        stamps[b] = 0
    kv._free.push(victims)
    return hashes


def hand_out(kv, block_ids: list) -> None:
    """Blocks just popped off the free stack: ref count 1, timestamp = the clock."""
    refs, stamps, clock = kv._scalars.refs, kv._scalars.stamps, kv._clock
    for b in block_ids:
        refs[b] = 1
        stamps[b] = clock


def hand_out_stack(kv, deregistered: tuple, counts: list | None, top: int) -> np.ndarray:
    """Finish an allocation that empties the free stack, ``top`` blocks of which were free
    before its eviction pushed the victims: hand out the stack as ``kv._free.pop`` (``counts``
    None) or ``pop_per_request`` would, then tell the observers ``deregistered`` (what
    ``kv._deregister`` returned). Returns the ids (int32)."""
    listed = kv._free.pop_all_listed(counts, top)
    hand_out(kv, listed)
    notify(kv._observers, *deregistered)
    return np.array(listed, np.int32)


def release_one_each(kv, block_ids: list) -> list:
    """Drop one reference of each of distinct held ``block_ids`` (prefix caching under lru):
    a block reaching 0 is freed when unregistered and joins the leaves when registered and
    childless. Returns the blocks that reached 0, in the order given."""
    refs, zero = kv._scalars.refs, []
    for b in block_ids:
        held = refs[b]
        refs[b] = held - 1
        if held == 1:
            zero.append(b)
    if zero:
        forest = kv._forest
        hashes = forest._scalars.hashes
        kv._free.push([b for b in zero if hashes[b] == -1])
        children = forest._scalars.child_counts
        kv._leaves.add_listed([b for b in zero if hashes[b] != -1 and not children[b]],
                              kv._scalars.stamps)
    return zero
