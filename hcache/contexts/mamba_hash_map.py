"""The Mamba hash map: which cached Mamba states a prefix match can reach (docs/design.md §6).

``hash_to_block_id`` maps a KV block hash to the block whose Mamba state is cached under it,
mirrored per block by ``_block_hash`` (-1 = not in the map). Invariants kept here:

- the Mamba map is a subset of the KV allocator's ``kv_hash_to_block_id`` (same hash, same
  block), and every block in it owns a cache slot;
- when the KV allocator deregisters blocks (eviction, ``"ref_zero"`` release), the observer
  :meth:`on_kv_blocks_deregistered` frees their slots and drops their hashes at once, so a
  recycled block id never carries a stale state.

:class:`MambaHashMapMixin` holds these methods; :class:`MambaSlotAllocator` inherits them.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_index, index_array

__all__ = ["MambaHashMapMixin"]


class MambaHashMapMixin:
    """Registration and invalidation methods of :class:`~hcache.contexts.MambaSlotAllocator`.

    Relies on the allocator's ``num_blocks``, ``block_to_slot`` / ``slot_to_block``, the free
    stack ``free_slots`` / ``free_count``, ``hash_to_block_id``, ``_block_hash`` and ``_kv``.
    """

    def _drop_hashes(self, block_ids: np.ndarray) -> None:
        hashes = self._block_hash[block_ids]
        for h in hashes[hashes > 0].tolist():
            self.hash_to_block_id.pop(h, None)
        self._block_hash[block_ids] = -1

    def invalidate_block(self, block_id) -> None:
        """Free the slot of ``block_id`` (if any) and drop its hash from the Mamba map.

        Raises ``IndexError`` when ``block_id`` is out of range.
        """
        self._invalidate_blocks_batch([check_index("block_id", block_id, self.num_blocks)])

    def _invalidate_blocks_batch(self, block_ids_list) -> None:
        """Vectorised :meth:`invalidate_block`; blocks without a slot are skipped."""
        ids = np.unique(index_array("block_ids_list", block_ids_list, self.num_blocks))
        if not len(ids):
            return
        slots = self.block_to_slot[ids]
        owned = slots >= 0
        blocks, slots = ids[owned], slots[owned]
        self.block_to_slot[blocks] = -1
        self.slot_to_block[slots] = -1
        self.free_slots[self.free_count:self.free_count + len(slots)] = slots
        self.free_count += len(slots)
        self._drop_hashes(ids)

    def on_kv_blocks_deregistered(self, block_ids_list, hashes_to_delete) -> None:
        """Observer of the KV allocator: a deregistered block loses its slot and Mamba hash.

        Parameters
        ----------
        block_ids_list : list of int
            Deregistered KV block ids (their ids may be reused at once).
        hashes_to_delete : set of int
            Their former hashes; any Mamba-map entry under one of them is dropped too.
        """
        self._invalidate_blocks_batch(block_ids_list)
        for h in hashes_to_delete or ():
            block = self.hash_to_block_id.pop(int(h), None)
            if block is not None:
                self._block_hash[block] = -1

    def register_block_hashes_batch(self, block_ids, hashes) -> None:
        """Make the states of ``block_ids`` reachable under their KV ``hashes``.

        Entries with ``hash <= 0`` (an unregistered KV block) are skipped; re-registering the
        same pair is a no-op.

        Raises
        ------
        IndexError
            A block id is out of range.
        ValueError
            Lengths differ, a block owns no slot, or a hash is not the KV allocator's hash of
            that block (the Mamba map must stay a subset of the KV map). Nothing changes.
        """
        ids = index_array("block_ids", block_ids, self.num_blocks)
        hs = np.asarray(list(hashes), dtype=np.int64).reshape(-1)
        if hs.shape != ids.shape:
            raise ValueError(f"hashes: expected {len(ids)} hashes, got {len(hs)}")
        keep = hs > 0
        ids, hs = ids[keep], hs[keep]
        no_slot = ids[self.block_to_slot[ids] < 0]
        if len(no_slot):
            raise ValueError(f"block_ids: expected blocks owning a slot, got {int(no_slot[0])}")
        kv_map = self._kv.kv_hash_to_block_id
        for b, h in zip(ids.tolist(), hs.tolist(), strict=True):
            if kv_map.get(h) != b or self.hash_to_block_id.get(h, b) != b \
                    or self._block_hash[b] not in (-1, h):
                raise ValueError(f"hashes: expected the KV hash of block {b}, got {h}")
        for b, h in zip(ids.tolist(), hs.tolist(), strict=True):
            self.hash_to_block_id[h] = b
        self._block_hash[ids] = hs
