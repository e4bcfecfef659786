"""The cached leaves of the block forest in LRU order: where leaf peeling starts (docs/design.md
§6, issue 24).

A *leaf* is a registered block with ref count 0 and no registered child. Leaf peeling (the
eviction rule of :class:`~hcache.contexts.KVBlockAllocator`) repeatedly takes the leaf with the
oldest timestamp (ties by block id) among the leaves that are not pinned, and a parent whose
last child it took becomes a leaf. A cached block with a used descendant never becomes a leaf
(the chain down to the used block keeps a child), and a pinned block's cached ancestors keep
the pinned block as a child, so the peel reaches exactly the evictable blocks.

:class:`EvictableLeaves` keeps the leaves incrementally: the allocator reports every change of
a block's leaf status (ref count to or from 0, a child registered or unregistered) and the set
answers a peel of ``n`` blocks in O(n log leaves), whatever the pool size. The order is a binary
heap of ``(timestamp, block)`` pairs, each one Python int ``timestamp << 31 | block`` (ordered as
the pairs: block ids are below ``2**31``; an int compares faster than a tuple), with lazy
deletion: an entry is live while its block is a member and still has that timestamp (a cached
block's timestamp does not change while it is cached).

Invariants (:meth:`EvictableLeaves.broken_invariants`): ``member`` marks exactly the leaves;
every member has a live heap entry.
"""

from __future__ import annotations

import heapq

import numpy as np

from .scalar_views import ScalarViews

__all__ = ["EvictableLeaves"]

# The heap is rebuilt from the members when it outgrows twice its size after the last rebuild
# plus this many entries, so stale entries cost O(1) amortised each.
_SLACK = 1024
_SHIFT = 31     # a heap entry: timestamp << _SHIFT | block
_BLOCK = (1 << _SHIFT) - 1


class EvictableLeaves:
    """The cached childless registered blocks among ``num_blocks``, oldest first.

    Attributes
    ----------
    member : bool [num_blocks]
        The leaves.
    """

    def __init__(self, num_blocks: int):
        self.member = np.zeros(num_blocks, dtype=bool)
        self._scalars = ScalarViews(member=self.member)
        self._heap: list[int] = []
        self._limit = _SLACK

    def reset(self) -> None:
        """No leaves."""
        self.member.fill(False)
        self._heap.clear()
        self._limit = _SLACK

    def __len__(self) -> int:
        return int(np.count_nonzero(self.member))

    def add(self, block_ids: np.ndarray, timestamps: np.ndarray) -> None:
        """Make ``block_ids`` (leaves, any order; members and repeats allowed) members."""
        ids = block_ids[~self.member[block_ids]]
        if not len(ids):
            return
        self.member[ids] = True
        push, heap = heapq.heappush, self._heap
        for t, b in zip(timestamps[ids].tolist(), ids.tolist()):
            push(heap, t << _SHIFT | b)     # a repeat pushes twice: one is stale once taken
        if len(heap) > self._limit:
            self._rebuild(timestamps)

    def add_listed(self, block_ids: list, timestamps) -> None:
        """:meth:`add` of a list of ids, element by element (a request's few blocks);
        ``timestamps``: the allocator's memoryview (Python ints: a heap entry is one)."""
        member, heap, push = self._scalars.member, self._heap, heapq.heappush
        for b in block_ids:
            if not member[b]:
                member[b] = 1
                push(heap, timestamps[b] << _SHIFT | b)
        if len(heap) > self._limit:
            self._rebuild(timestamps)

    def discard(self, block_ids) -> None:
        """Drop ``block_ids`` (any, repeats allowed; int64, or a list of a step's few): they
        gained a holder or a child."""
        if type(block_ids) is list:
            member = self._scalars.member
            for b in block_ids:
                member[b] = False
        else:
            self.member[block_ids] = False

    def peel(self, n: int, parent_ids, child_counts, ref_counts, timestamps,
             keep=frozenset(), commit: bool = True) -> list | None:
        """The first ``n`` blocks of the leaf-peeling order, or None if fewer can be peeled.

        Parameters
        ----------
        n : int
        parent_ids, child_counts, ref_counts, timestamps : memoryview [num_blocks]
            The forest's links and the allocator's counts (their owners' memoryviews: Python
            ints, so a heap entry is one), read only.
        keep : set of int
            Blocks never taken (pinned or about to be retained); their ancestors stay.
        commit : bool
            True: the returned blocks leave the set (the caller unregisters them) and the
            parents they leave childless join it. False, or on None: nothing changes.
        """
        heap, member = self._heap, self._scalars.member
        pop, push = heapq.heappop, heapq.heappush
        out: list[int] = []         # (their heap entries are timestamps[b] << _SHIFT | b)
        popped: list[int] = []      # the members taken off the heap
        promoted: list[int] = []    # parents made members (pushed) or set aside by the peel
        aside: list[int] = []       # heap entries of kept blocks
        remaining: dict[int, int] = {}      # children left of the parents touched (2 or more)
        # A promoted parent that the next pop would return is taken at once (the chain walk
        # below): it never enters the heap, and is a member only if it ends the peel untaken.
        while len(out) < n:
            if not heap:
                break
            entry = pop(heap)
            b = entry & _BLOCK
            if not member[b] or timestamps[b] != entry >> _SHIFT:
                continue        # stale
            member[b] = 0
            if b in keep:
                aside.append(entry)
                continue
            popped.append(b)
            while True:         # b was just taken off the heap, or promoted ahead of its top
                out.append(b)
                p = parent_ids[b]
                if p < 0:
                    break
                left = child_counts[p]
                if left > 1:
                    left = remaining.get(p, left)
                    if left > 1:
                        remaining[p] = left - 1
                        break
                if ref_counts[p]:
                    break
                entry = timestamps[p] << _SHIFT | p
                if p in keep or len(out) == n or heap and not entry < heap[0]:
                    promoted.append(p)
                    if p in keep:
                        aside.append(entry)
                    else:
                        member[p] = 1
                        push(heap, entry)
                    break
                b = p
        for entry in aside:
            member[entry & _BLOCK] = 1
            push(heap, entry)
        if len(out) < n or not commit:      # as before: the popped members back, no promotion
            for b in popped:
                member[b] = 1
                push(heap, timestamps[b] << _SHIFT | b)
            for p in promoted:
                member[p] = 0
        if len(heap) > self._limit:
            self._rebuild(timestamps)
        return None if len(out) < n else out

    def _rebuild(self, timestamps) -> None:
        ids = np.flatnonzero(self.member)
        stamps = np.asarray(timestamps)[ids].tolist()
        self._heap = [t << _SHIFT | b for t, b in zip(stamps, ids.tolist())]
        heapq.heapify(self._heap)
        self._limit = 2 * len(self._heap) + _SLACK

    def broken_invariants(self, leaves: np.ndarray, timestamps: np.ndarray) -> list[str]:
        """Every broken invariant given the true leaves (``bool [num_blocks]``); reads only."""
        errors = []
        if (self.member != leaves).any():
            errors.append(f"evictable leaves {np.flatnonzero(self.member).tolist()}, expected "
                          f"{np.flatnonzero(leaves).tolist()}")
        pairs = ((entry >> _SHIFT, entry & _BLOCK) for entry in self._heap)
        live = {b for t, b in pairs if self.member[b] and int(timestamps[b]) == t}
        if live != set(np.flatnonzero(self.member).tolist()):
            errors.append("an evictable leaf has no live heap entry")
        return errors

