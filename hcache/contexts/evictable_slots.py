"""The Mamba cache slots that eviction may take, in LRU order (docs/design.md §6.4, issue 24).

A slot is *evictable* while its block's KV ref count is 0; victims are the oldest by the block's
KV timestamp, ties by block id. :class:`EvictableSlots` answers "the ``n`` oldest evictable
blocks, other than these" in O((n + stale entries) log entries), whatever the number of slots,
where a scan of every slot cost O(slots) per call.

It is a binary heap of ints ``timestamp << 31 | block`` (blocks < 2^31: the order of
``(timestamp, block)`` pairs, compared faster) with lazy deletion. An entry is live while its
block owns a slot, has ref count 0 and still has that timestamp (a block's timestamp changes
only when it is allocated or retained, which makes its ref count positive). The pool pushes an
entry when a block with ref count 0 gets a slot, and the KV allocator reports the blocks whose
ref count drops to 0 (:meth:`KVBlockAllocator.add_released_observer`), so every evictable block
has a live entry (:meth:`broken_invariants`); stale entries are dropped when met, and the heap is
rebuilt from the slots' owners when it outgrows twice their number.
"""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["EvictableSlots"]

# The heap is rebuilt when it outgrows twice its size after the last rebuild plus this many
# entries, so stale entries cost O(1) amortised each.
_SLACK = 1024
_SHIFT = 31
_BLOCK = (1 << _SHIFT) - 1


class EvictableSlots:
    """Live entries for every evictable block of a Mamba slot pool, oldest first."""

    def __init__(self):
        self._heap: list[int] = []
        self._limit = _SLACK

    def reset(self) -> None:
        """No entries (no block owns a slot)."""
        self._heap.clear()
        self._limit = _SLACK

    def push(self, block_ids, timestamps) -> None:
        """Enter ``block_ids`` (int64 array or list of ints; evictable now, or not: an entry is
        checked when met) with their ``timestamps`` (None: all 0)."""
        if not len(block_ids):
            return
        stamps = [0] * len(block_ids) if timestamps is None else timestamps[block_ids].tolist()
        push, heap = heapq.heappush, self._heap
        for t, b in zip(stamps, block_ids if type(block_ids) is list else block_ids.tolist()):
            push(heap, t << _SHIFT | b)

    def oldest(self, n: int, owned, ref_counts: np.ndarray, timestamps,
               exclude=frozenset()) -> list[int]:
        """The ``n`` oldest evictable blocks not in ``exclude`` (fewer if there are fewer),
        oldest first, given ``owned`` (by block, truthy where it owns a slot); reads only (the
        live entries met are kept, stale ones dropped)."""
        return self._pop_oldest(n, owned, ref_counts, timestamps, exclude, True)

    def take_oldest(self, n: int, owned, ref_counts: np.ndarray, timestamps,
                    exclude=frozenset()) -> list[int]:
        """:meth:`oldest`, for a caller that evicts every block it returns (the heap drops
        their entries, which would go stale)."""
        return self._pop_oldest(n, owned, ref_counts, timestamps, exclude, False)

    def _pop_oldest(self, n, owned, ref_counts, timestamps, exclude, keep_out) -> list[int]:
        heap, pop = self._heap, heapq.heappop
        owns, refs = owned.__getitem__, ref_counts.item
        stamp = (lambda b: 0) if timestamps is None else timestamps.item
        out: list[int] = []
        kept: list[int] = []    # live entries met, back on the heap after the walk
        seen: set = set()
        while heap and len(out) < n:
            entry = pop(heap)
            b = entry & _BLOCK
            if b in seen or not owns(b) or refs(b) != 0 or stamp(b) != entry >> _SHIFT:
                continue        # stale, or a repeat of a live entry met already
            seen.add(b)
            if b in exclude:
                kept.append(entry)
            else:
                out.append(b)
                if keep_out:
                    kept.append(entry)
        for entry in kept:
            heapq.heappush(heap, entry)
        return out

    def rebuild_if_large(self, owners_of, timestamps) -> None:
        """Rebuild from ``owners_of()`` (every block owning a slot, a scan: a superset of the
        evictable ones) when stale entries made the heap outgrow its limit, so it holds at
        most about twice the slots."""
        if len(self._heap) <= self._limit:
            return
        blocks = owners_of()
        stamps = [0] * len(blocks) if timestamps is None else timestamps[blocks].tolist()
        self._heap = [t << _SHIFT | b for t, b in zip(stamps, blocks.tolist())]
        heapq.heapify(self._heap)
        self._limit = 2 * len(self._heap) + _SLACK

    def broken_invariants(self, evictable: np.ndarray, timestamps) -> list[str]:
        """Every broken invariant given the evictable blocks (int64); reads only."""
        stamp = (lambda b: 0) if timestamps is None else (lambda b: int(timestamps[b]))
        live = {e & _BLOCK for e in self._heap if stamp(e & _BLOCK) == e >> _SHIFT}
        missing = set(evictable.tolist()) - live
        return [f"evictable blocks without a live heap entry: {sorted(missing)[:8]}"] \
            if missing else []
