"""The Mamba hash map: which cached Mamba states a prefix match can reach (docs/design.md §6).

``hash_to_block_id`` maps a KV block hash to the block whose Mamba state is cached under it.
Invariants (checked by :meth:`MambaHashMap.broken_invariants`):

- the map is a subset of the KV allocator's ``kv_hash_to_block_id`` (same hash, same block), and
  every block in it owns a cache slot;
- so a block is in the map under its KV hash, ``kv_block_hashes[block]``, or not at all: the KV
  allocator's arrays are the map's per-block index, and no second one is kept.

:class:`~hcache.contexts.MambaSlotAllocator` owns one and keeps it a subset of its slots: a block
that loses its slot (eviction, invalidation, KV deregistration) is dropped from the map at once,
so a recycled block id never carries a stale state. A block ``awaiting`` its hash owns a slot
holding the boundary state of a block whose registration the context deferred
(:mod:`~hcache.contexts.block_registration`); it is not in the map until :meth:`settle`.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

__all__ = ["MambaHashMap"]


class MambaHashMap:
    """KV hash -> block id of the cached Mamba states.

    Parameters
    ----------
    kv_hash_to_block_id : dict[int, int]
        The KV allocator's hash map (the same object for the allocator's lifetime).
    slot_owned : bytearray [num_blocks]
        The slot pool's flags of the blocks owning a slot (the same object for the pool's
        lifetime).
    num_blocks : int

    Attributes
    ----------
    hash_to_block_id : dict[int, int]
        KV block hash -> block id whose state is cached under it.
    awaiting : bool [num_blocks]
        Blocks whose kept state waits for their registration.
    """

    def __init__(self, kv_hash_to_block_id: dict, slot_owned: bytearray, num_blocks: int):
        self.hash_to_block_id: dict[int, int] = {}
        self._kv_map, self._owned = kv_hash_to_block_id, slot_owned
        self.awaiting = np.zeros(num_blocks, bool)
        self._maybe_awaiting = False     # False: no block awaits (True: one may)

    def __len__(self) -> int:
        return len(self.hash_to_block_id)

    def reset(self) -> None:
        """Empty the map."""
        self.hash_to_block_id.clear()
        self.awaiting.fill(False)
        self._maybe_awaiting = False

    def mark_awaiting(self, block_ids: np.ndarray) -> None:
        """Mark checked ``block_ids`` as awaiting their hash."""
        if len(block_ids):
            self.awaiting[block_ids] = True
            self._maybe_awaiting = True

    def has_awaiting(self) -> bool:
        """Whether some block awaits its hash: O(1) while none has since the last answer of
        False, a scan of :attr:`awaiting` otherwise."""
        if self._maybe_awaiting and not self.awaiting.any():
            self._maybe_awaiting = False
        return self._maybe_awaiting

    def settle(self, block_ids: np.ndarray, hashes: np.ndarray, kv_block_hashes: np.ndarray,
               block_to_slot: np.ndarray) -> tuple[np.ndarray, int]:
        """Put the awaiting blocks of ``block_ids`` in the map under their ``hashes`` where the
        KV allocator registered them so and no other state is cached under the hash; returns
        the other awaiting blocks that still own a slot (their states are unreachable) and how
        many entered the map."""
        waiting = self.awaiting[block_ids]
        n = np.count_nonzero(waiting)
        if n == len(waiting):
            blocks, hs = block_ids, hashes
        elif not n:
            return np.zeros(0, np.int64), 0
        else:
            blocks, hs = block_ids[waiting], hashes[waiting]
        self.awaiting[blocks] = False
        owned = block_to_slot[blocks] >= 0
        # The map is a subset of the KV map, where a block holding its hash holds it alone, and
        # an awaiting block is not in the map: so no other state is cached under such a hash.
        ok = owned & (kv_block_hashes[blocks] == hs)
        if np.count_nonzero(ok) == len(ok):
            self.hash_to_block_id.update(zip(hs.tolist(), blocks.tolist()))
            return blocks[:0], len(blocks)
        self.hash_to_block_id.update(zip(hs[ok].tolist(), blocks[ok].tolist()))
        return blocks[owned & ~ok], int(np.count_nonzero(ok))

    def forget_awaiting(self, block_ids: np.ndarray) -> np.ndarray:
        """Unmark the awaiting blocks of ``block_ids`` and return them: their states will never
        be reachable (their blocks stay private)."""
        mine = block_ids[self.awaiting[block_ids]]
        self.awaiting[mine] = False
        return mine

    def block_hashes(self, num_blocks: int) -> np.ndarray:
        """``int64 [num_blocks]``: the hash each block is in the map under, -1 = none."""
        out = np.full(num_blocks, -1, dtype=np.int64)
        out[list(self.hash_to_block_id.values())] = list(self.hash_to_block_id)
        return out

    def drop_blocks(self, block_ids: np.ndarray, kv_block_hashes: np.ndarray) -> None:
        """Remove the entries of checked ``block_ids`` (an array or list; blocks not in the map
        are skipped), found under their ``kv_block_hashes``."""
        m = self.hash_to_block_id
        if m:   # a block is in the map under its KV hash only, and none other is under that hash
            for h in (map(kv_block_hashes.item, block_ids) if type(block_ids) is list
                      else kv_block_hashes[block_ids].tolist()):
                m.pop(h, None)

    def drop_hashes(self, hashes) -> None:
        """Remove the entries under ``hashes`` (a set or list, read twice; hashes not in the
        map are skipped)."""
        m = self.hash_to_block_id
        if not hashes or m.keys().isdisjoint(hashes):   # (usually: few blocks own a slot)
            return
        pop = m.pop
        for h in hashes:
            pop(h, None)

    def cached(self, block_ids: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """``bool [n]``: whether each block is in the map under the paired hash."""
        listed = hashes.tolist()
        if self.hash_to_block_id.keys().isdisjoint(listed):
            return np.zeros(len(listed), bool)
        got = map(self.hash_to_block_id.get, listed, repeat(-1))
        return np.fromiter(got, np.int64, len(listed)) == block_ids

    def register_lists(self, block_ids, hashes) -> bool:
        """Register ``block_ids`` under ``hashes`` when both are lists of Python ints whose
        every pair is registrable (positive hash held by that block in the KV map, a block
        owning a slot); True if done, False (nothing changed) to leave any other call to
        :meth:`register`. A lean path: dict and set lookups only, for short host lists."""
        if type(block_ids) is not list or type(hashes) is not list \
                or len(block_ids) != len(hashes):
            return False
        kv_map, owned, update = self._kv_map, self._owned, {}
        try:
            for b, h in zip(block_ids, hashes):     # b is a KV block id once kv_map[h] == b
                if kv_map[h] != b or not owned[b] or type(b) is not int \
                        or type(h) is not int:
                    return False
                update[h] = b
        except (KeyError, TypeError):       # no KV block holds h, or h is not hashable
            return False
        self.hash_to_block_id.update(update)    # the map's invariants imply no clash
        return True

    def register(self, block_ids: np.ndarray, hashes: np.ndarray) -> None:
        """Put ``block_ids`` in the map under their KV ``hashes``, all or nothing.

        Parameters
        ----------
        block_ids, hashes : int64 [n]
            Checked block ids and int64 hashes. Entries with ``hash <= 0`` (an unregistered
            KV block) are skipped; re-registering the same pair is a no-op.

        Raises
        ------
        ValueError
            Lengths differ, a hash is below -1, a block owns no slot, or a hash is not the KV
            hash of that block (or is already in the map under another block). Nothing changes.
        """
        hs = hashes
        if hs.shape != block_ids.shape:
            raise ValueError(f"hashes: expected {len(block_ids)} hashes, got {len(hs)}")
        if (hs < -1).any():   # -1 (unregistered) and 0 (no hash) are skipped; below is no hash
            i = int(np.argmax(hs < -1))
            raise ValueError(f"hashes[{i}]: expected a block hash > 0, or -1 / 0 (skipped), "
                             f"got {int(hs[i])}")
        keep = hs > 0
        ids, hs = block_ids[keep], hs[keep]
        ids_list, hs_list = ids.tolist(), hs.tolist()
        owned = np.frombuffer(self._owned, dtype=np.bool_)[ids]
        if not owned.all():
            raise ValueError(f"block_ids: expected blocks owning a slot, "
                             f"got {ids_list[int(np.argmin(owned))]}")
        holders = np.fromiter(map(self._kv_map.get, hs_list, repeat(-1)), np.int64, len(hs))
        mamba = np.fromiter(map(self.hash_to_block_id.get, hs_list, ids_list), np.int64,
                            len(hs))
        bad = (holders != ids) | (mamba != ids)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"hashes: expected the KV hash of block {ids_list[i]}, "
                             f"got {hs_list[i]}")
        self.hash_to_block_id.update(zip(hs_list, ids_list))

    def broken_invariants(self, block_to_slot: np.ndarray) -> list[str]:
        """Every broken invariant (see the module docstring); empty when all hold."""
        problems = []
        for h, b in self.hash_to_block_id.items():
            if self._kv_map.get(h) != b:
                problems.append(f"Mamba hash {h} -> block {b} is not in the KV map")
            if block_to_slot[b] < 0:
                problems.append(f"Mamba hash {h} -> block {b}, which owns no slot")
        if len(set(self.hash_to_block_id.values())) != len(self.hash_to_block_id):
            problems.append("a block is in the Mamba map under two hashes")
        if self.awaiting.any() and not self._maybe_awaiting:
            problems.append("blocks await their hash while none is flagged")
        if self.awaiting.any() and set(self.hash_to_block_id.values()).intersection(
                np.flatnonzero(self.awaiting).tolist()):
            problems.append("a block awaiting its hash is in the Mamba map")
        return problems
