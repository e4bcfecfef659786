"""A serving step's few KV blocks, element by element (docs/design.md §8, issue 24): the victims
of one leaf peel deregistered, the blocks of one finished request released.

A NumPy call on an array of one or two elements costs more than Python scalar reads (``.item``)
and writes, so :class:`~hcache.contexts.KVBlockAllocator` takes these paths up to a few dozen
blocks and its NumPy paths beyond them (the oracles of tests/test_listed_eviction.py): the same
free stack, ref counts, timestamps, forest and leaves. Functions of the allocator's parts,
passed in.
"""

from __future__ import annotations

__all__ = ["deregister_peeled", "release_one_each"]


def deregister_peeled(victims: list, forest, free, timestamps) -> set:
    """Unregister and free the ``victims`` of a committed peel, in order (cached: ref count 0,
    out of the leaves, and the parents they leave childless are leaves already: see
    :meth:`EvictableLeaves.peel`); their timestamps drop to 0. Returns their former hashes."""
    hashes, _ = forest.unlink_listed(victims)
    for b in victims:
        timestamps[b] = 0
    free.push(victims)
    return hashes


def release_one_each(block_ids: list, ref_counts, forest, free, leaves, timestamps) -> list:
    """Drop one reference of each of distinct held ``block_ids`` (prefix caching under lru):
    a block reaching 0 is freed when unregistered and joins the leaves when registered and
    childless. Returns the blocks that reached 0, in the order given."""
    zero = []
    for b, held in zip(block_ids, map(ref_counts.item, block_ids)):
        ref_counts[b] = held - 1
        if held == 1:
            zero.append(b)
    if zero:
        hashes = list(map(forest.hashes.item, zero))     # -1: unregistered
        free.push([b for b, h in zip(zero, hashes) if h == -1])
        children = forest.child_counts.item
        leaves.add_listed([b for b, h in zip(zero, hashes) if h != -1 and not children(b)],
                          timestamps)
    return zero
