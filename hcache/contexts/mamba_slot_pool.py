"""The Mamba cache slots and their owners: a free stack and a block <-> slot map with LRU
eviction (docs/design.md §6).

Slots ``0..max_slots-1`` of the durable Mamba state cache are owned by KV blocks. Invariants
(checked by :meth:`MambaSlotPool.broken_invariants`):

- ``block_to_slot`` / ``slot_to_block`` are inverse partial maps;
- every slot is either on the free stack (``free_slots[:free_count]``, top last) or owned by
  exactly one block;
- a slot is evictable only while its KV block's ref count is 0, so pinning a matched block
  (retain) before allocating also protects its Mamba state;
- ``owned`` flags the blocks owning a slot (a mirror of ``block_to_slot >= 0`` in a
  ``bytearray``, for per-block lookups in pure Python).

KV ref counts and timestamps belong to the KV allocator; they are passed in where needed.
"""

from __future__ import annotations

import numpy as np

from ..errors import CacheCapacityError
from .evictable_slots import EvictableSlots
from .scalar_views import ScalarViews

__all__ = ["MambaSlotCapacityError", "MambaSlotPool"]

_NO_BLOCKS = np.zeros(0, dtype=np.int64)
_NO_BLOCKS.flags.writeable = False
_LISTED = 32    # slots of deregistered blocks released one by one, up to this many


class MambaSlotCapacityError(CacheCapacityError):
    """Not enough free plus evictable Mamba cache slots for a batch; nothing was changed.

    Attributes
    ----------
    required : int
        New slots the batch needed.
    available : int
        Free slots plus slots that could have been evicted.
    """

    def __init__(self, required: int, available: int, message: str | None = None):
        super().__init__(message or f"Mamba cache slots: {required} required, {available} "
                         "available (free + evictable)", required=int(required),
                         available=int(available))


class MambaSlotPool:
    """Cache slots ``0..max_slots-1`` owned by KV blocks ``0..num_blocks-1``.

    Attributes
    ----------
    block_to_slot : int32 [num_blocks]
        Slot of each block; -1 = none.
    slot_to_block : int32 [max_slots]
        Block owning each slot; -1 = free.
    free_slots : int32 [max_slots], free_count : int
        The free stack: ``free_slots[:free_count]``, its top last.
    owned : bytearray [num_blocks]
        1 where a block owns a slot (``owned[block]`` is a cheap pure-Python lookup).
    """

    def __init__(self, num_blocks: int, max_slots: int):
        self.max_slots = max_slots
        self.block_to_slot = np.full(num_blocks, -1, dtype=np.int32)
        self.slot_to_block = np.full(max_slots, -1, dtype=np.int32)
        self.free_slots = np.empty(max_slots, dtype=np.int32)
        self.owned = bytearray(num_blocks)
        self._scalars = ScalarViews(block_to_slot=self.block_to_slot,
                                    slot_to_block=self.slot_to_block, free_slots=self.free_slots)
        self._seen = np.zeros(num_blocks, dtype=np.int64)   # scratch of first_occurrences
        self._excluded = np.zeros(num_blocks, dtype=np.bool_)   # scratch of evictable_blocks
        self._evictable = EvictableSlots()
        self.reset()

    @property
    def _owned(self) -> np.ndarray:
        """``owned`` as a writable ``bool`` array (a view, made per use so copies stay whole)."""
        return np.frombuffer(self.owned, dtype=np.bool_)

    def reset(self) -> None:
        """Free every slot (a fresh pool hands out slots 0, 1, 2, ...)."""
        self.block_to_slot.fill(-1)
        self.slot_to_block.fill(-1)
        self.free_slots[:] = np.arange(self.max_slots - 1, -1, -1, dtype=np.int32)
        self.free_count = self.max_slots
        self._owned.fill(False)
        self._evictable.reset()

    def evictable_blocks(self, ref_counts, exclude=None) -> np.ndarray:
        """Blocks owning a slot whose KV ``ref_counts`` are 0, other than those of
        ``exclude``, in slot order (int64)."""
        owned = self.slot_to_block[self.slot_to_block >= 0].astype(np.int64)
        candidates = owned[np.asarray(ref_counts)[owned] == 0]
        if exclude is not None and len(exclude) and len(candidates):
            self._excluded[exclude] = True
            candidates = candidates[~self._excluded[candidates]]
            self._excluded[exclude] = False
        return candidates

    def demand(self, block_ids: np.ndarray, ref_counts, timestamps, *, distinct: bool = False):
        """Blocks of ``block_ids`` (``distinct``: known to hold no repeat) needing a new slot
        (first-seen order), and the slots available to them: free ones plus evictable ones not
        in ``block_ids`` (whose slots are being returned), counted up to what ``new`` needs."""
        new, candidates = self.shortfall(block_ids, ref_counts, timestamps, distinct=distinct)
        return new, self.free_count + (0 if candidates is None else len(candidates))

    def shortfall(self, block_ids: np.ndarray, ref_counts, timestamps, *,
                  distinct: bool = False):
        """:meth:`demand` as ``(new, candidates)``: when the free slots are too few for ``new``,
        the oldest evictable blocks outside ``block_ids`` that make up for them, in LRU order
        (int64; all there are when too few), else None. Pass them on to :meth:`allocate` while
        nothing has changed. Reads only."""
        new = block_ids[self.block_to_slot[block_ids] < 0]
        if not distinct:
            uniq, first = np.unique(new, return_index=True)
            new = uniq[np.argsort(first)]
        if len(new) <= self.free_count:
            return new, None
        return new, self._oldest_evictable(len(new) - self.free_count, ref_counts, timestamps,
                                           block_ids)

    def _oldest_evictable(self, n, ref_counts, timestamps, exclude) -> np.ndarray:
        excluded = frozenset() if exclude is None else frozenset(exclude.tolist())
        return np.array(self._evictable.oldest(n, self.owned, ref_counts, timestamps, excluded),
                        np.int64)

    def released(self, block_ids: np.ndarray, timestamps) -> None:
        """The KV allocator's observer: it dropped ``block_ids`` (int64) to ref count 0, so
        those owning a slot became evictable."""
        self._evictable.push(block_ids[self._owned[block_ids]], timestamps)
        self._evictable.rebuild_if_large(self._owners, timestamps)

    def _owners(self) -> np.ndarray:
        return self.slot_to_block[self.slot_to_block >= 0].astype(np.int64)

    def first_occurrences(self, block_ids: np.ndarray) -> np.ndarray:
        """``bool [n]``: whether each entry of checked ``block_ids`` is its block's first."""
        order = np.arange(len(block_ids))
        self._seen[block_ids[::-1]] = order[::-1]
        return self._seen[block_ids] == order

    def allocate(self, block_ids: np.ndarray, ref_counts, timestamps, *,
                 distinct: bool = False, shortfall=None):
        """Give every block of ``block_ids`` a slot (one per distinct block; owners keep
        theirs), free slots first, then by :meth:`evict`, all or nothing; ``shortfall``: what
        :meth:`shortfall` returned for these blocks (or for a superset whose extra blocks own no
        slot), nothing changed since.

        Returns
        -------
        (numpy.ndarray of int64, numpy.ndarray of int64)
            The slot of each entry of ``block_ids``, and the blocks that lost their slot.

        Raises
        ------
        MambaSlotCapacityError
            Free plus evictable slots (other than those of ``block_ids``) are too few.
        """
        if shortfall is None:
            new, candidates = self.shortfall(block_ids, ref_counts, timestamps, distinct=distinct)
        else:
            new, candidates = block_ids[self.block_to_slot[block_ids] < 0], shortfall[1]
        available = self.free_count + (0 if candidates is None else len(candidates))
        if len(new) > available:
            raise MambaSlotCapacityError(len(new), available)
        victims = _NO_BLOCKS
        if len(new):
            take = min(len(new), self.free_count)
            slots = self.free_slots[self.free_count - take:self.free_count][::-1].copy()
            self.free_count -= take
            if take < len(new):
                evicted, victims = self.evict(len(new) - take, ref_counts, timestamps,
                                              exclude=block_ids, candidates=candidates)
                slots = np.concatenate([slots, evicted])
            self.block_to_slot[new] = slots
            self.slot_to_block[slots] = new
            self._owned[new] = True
            self._evictable.push(new[np.asarray(ref_counts)[new] == 0], timestamps)
            self._evictable.rebuild_if_large(self._owners, timestamps)
        return self.block_to_slot[block_ids].astype(np.int64), victims

    def take_free(self, n: int) -> list:
        """Pop ``n`` (<= :attr:`free_count`) slots off the free stack, top first, as
        :meth:`allocate` does."""
        top, free = self.free_count, self._scalars.free_slots
        if n == 1:
            self.free_count = top - 1
            return [free[top - 1]]
        self.free_count = top - n
        return free[top - n:top].tolist()[::-1]

    def assign(self, new: list, slots: list, ref_counts, timestamps) -> None:
        """:meth:`allocate`'s last step for distinct blocks ``new`` owning no slot (Python
        ints): each takes its slot of ``slots`` (taken off the free stack or evicted)."""
        if len(new) != len(slots):
            raise ValueError(f"slots: expected {len(new)} slots, got {len(slots)}")
        views, owned, refs = self._scalars, self.owned, ref_counts.item
        block_to_slot, slot_to_block = views.block_to_slot, views.slot_to_block
        evictable = []
        for b, s in zip(new, slots):
            block_to_slot[b], slot_to_block[s] = s, b
            owned[b] = 1
            if not refs(b):
                evictable.append(b)
        if evictable:
            self._evictable.push(evictable, timestamps)
            self._evictable.rebuild_if_large(self._owners, timestamps)

    def evict(self, n: int, ref_counts, timestamps, *, exclude=None, candidates=None):
        """Take the slots of the ``n`` least recently used evictable blocks: oldest
        ``timestamps`` first (all 0 when None), ties by block id, never a block of
        ``exclude``. The slots are **not** returned to the free stack. ``candidates``: what
        :meth:`shortfall` gave for that ``exclude`` with nothing changed since (trusted: the
        oldest evictable blocks, at least ``n`` of them unless there are fewer); a list (of
        :meth:`EvictableSlots.oldest`, for a few) is in LRU order already: its first ``n`` go.

        Returns
        -------
        (numpy.ndarray of int32, numpy.ndarray of int64)
            The slots taken and their former blocks (lists of ints for ``candidates`` a list).

        Raises
        ------
        MambaSlotCapacityError
            Fewer than ``n`` candidates; nothing changes.
        """
        if candidates is None:
            candidates = self._oldest_evictable(n, ref_counts, timestamps, exclude)
        if len(candidates) < n:
            raise MambaSlotCapacityError(n, len(candidates))
        if type(candidates) is list:
            return self._evict_listed(candidates[:n])
        victims = candidates[_oldest(candidates, timestamps, n, len(self.block_to_slot))]
        slots = self.block_to_slot[victims].copy()
        self.block_to_slot[victims] = -1
        self.slot_to_block[slots] = -1
        self._owned[victims] = False
        return slots, victims

    def _evict_listed(self, victims: list):
        """:meth:`evict` of the blocks ``victims`` (Python ints), item by item, as lists."""
        views, owned = self._scalars, self.owned
        block_to_slot, slot_to_block = views.block_to_slot, views.slot_to_block
        slots = [block_to_slot[b] for b in victims]
        for b, s in zip(victims, slots):
            block_to_slot[b] = slot_to_block[s] = -1
            owned[b] = 0
        return slots, victims

    def release(self, block_ids: np.ndarray) -> None:
        """Push the slots of unique ``block_ids`` onto the free stack (blocks without one are
        skipped)."""
        if not len(block_ids):
            return
        slots = self.block_to_slot[block_ids]
        owned = slots >= 0
        blocks, slots = block_ids[owned], slots[owned]
        self.block_to_slot[blocks] = -1
        self.slot_to_block[slots] = -1
        self._owned[blocks] = False
        self.free_slots[self.free_count:self.free_count + len(slots)] = slots
        self.free_count += len(slots)

    def release_listed(self, block_ids: list) -> None:
        """:meth:`release` of the slot owners among ``block_ids`` (distinct Python ints, any
        order): a few are pushed one by one, in block order as :meth:`release` pushes them."""
        owned = self.owned
        owners = [b for b in block_ids if owned[b]]
        if len(owners) > _LISTED:
            self.release(np.array(sorted(owners), dtype=np.int64))
            return
        views, top = self._scalars, self.free_count
        to_slot, to_block, free = views.block_to_slot, views.slot_to_block, views.free_slots
        for b in sorted(owners) if len(owners) > 1 else owners:
            slot = to_slot[b]
            to_slot[b] = to_block[slot] = -1
            owned[b] = 0
            free[top] = slot
            top += 1
        self.free_count = top

    def broken_invariants(self, ref_counts=None, timestamps=None) -> list[str]:
        """Every broken invariant of the maps and the free stack, and (given the KV
        ``ref_counts`` and ``timestamps``) of the evictable slots' order; empty when all hold."""
        problems = []
        free = self.free_slots[:self.free_count].astype(np.int64)
        if not 0 <= self.free_count <= self.max_slots:
            problems.append(f"free_count {self.free_count} outside [0, {self.max_slots}]")
        elif len(np.unique(free)) != len(free) or (self.slot_to_block[free] >= 0).any():
            problems.append("free stack holds a repeated or owned slot")
        owned_slots = np.nonzero(self.slot_to_block >= 0)[0]
        if self.free_count + len(owned_slots) != self.max_slots:
            problems.append(f"free {self.free_count} + owned {len(owned_slots)} != "
                            f"max_slots {self.max_slots}")
        blocks = np.nonzero(self.block_to_slot >= 0)[0]
        slots = self.block_to_slot[blocks]
        if len(np.unique(slots)) != len(slots):
            problems.append("a slot is owned by two blocks")
        if len(blocks) != len(owned_slots) or (self.slot_to_block[slots] != blocks).any():
            problems.append("block_to_slot and slot_to_block are not inverse")
        if not np.array_equal(self._owned, self.block_to_slot >= 0):
            problems.append("owned flags disagree with block_to_slot")
        if ref_counts is not None:
            problems += self._evictable.broken_invariants(self.evictable_blocks(ref_counts),
                                                          timestamps)
        return problems


def _oldest(candidates: np.ndarray, timestamps, n: int, num_blocks: int) -> np.ndarray:
    """Positions in ``candidates`` (distinct block ids, int64) of the ``n`` oldest by
    ``timestamps`` (None: all 0), ties by block id, oldest first."""
    if timestamps is None:
        return np.argsort(candidates, kind="stable")[:n]
    stamps = np.asarray(timestamps)[candidates].astype(np.int64)
    if n == 0 or stamps.min() < 0 or stamps.max() >= np.iinfo(np.int64).max // num_blocks - 1:
        return np.lexsort((candidates, stamps))[:n]
    key = stamps * num_blocks + candidates      # one distinct key: (stamp, block) order
    if 2 * n < len(key):
        part = np.argpartition(key, n - 1)[:n]
        return part[np.argsort(key[part])]
    return np.argsort(key)[:n]
