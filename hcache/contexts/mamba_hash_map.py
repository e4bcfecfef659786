"""The Mamba hash map: which cached Mamba states a prefix match can reach (docs/design.md §6).

``hash_to_block_id`` maps a KV block hash to the block whose Mamba state is cached under it,
mirrored per block by ``block_hash`` (-1 = not in the map). Invariants (checked by
:meth:`MambaHashMap.broken_invariants`):

- the map is a subset of the KV allocator's ``kv_hash_to_block_id`` (same hash, same block), and
  every block in it owns a cache slot;
- ``block_hash`` and ``hash_to_block_id`` are inverse on the blocks in the map.

:class:`~hcache.contexts.MambaSlotAllocator` owns one and keeps it a subset of its slots: a block
that loses its slot (eviction, invalidation, KV deregistration) is dropped from the map at once,
so a recycled block id never carries a stale state.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MambaHashMap"]


class MambaHashMap:
    """KV hash -> block id of the cached Mamba states, for ``num_blocks`` KV blocks.

    Attributes
    ----------
    hash_to_block_id : dict[int, int]
        KV block hash -> block id whose state is cached under it.
    block_hash : int64 [num_blocks]
        The hash each block is in the map under; -1 = not in the map.
    """

    def __init__(self, num_blocks: int):
        self.hash_to_block_id: dict[int, int] = {}
        self.block_hash = np.full(num_blocks, -1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.hash_to_block_id)

    def reset(self) -> None:
        """Empty the map."""
        self.hash_to_block_id.clear()
        self.block_hash.fill(-1)

    def drop_blocks(self, block_ids: np.ndarray) -> None:
        """Remove the entries of ``block_ids`` (checked ids; blocks not in the map are
        skipped)."""
        hashes = self.block_hash[block_ids]
        for h in hashes[hashes > 0].tolist():
            self.hash_to_block_id.pop(h, None)
        self.block_hash[block_ids] = -1

    def drop_hashes(self, hashes) -> None:
        """Remove the entries under ``hashes`` (hashes not in the map are skipped)."""
        for h in hashes or ():
            block = self.hash_to_block_id.pop(int(h), None)
            if block is not None:
                self.block_hash[block] = -1

    def register(self, block_ids: np.ndarray, hashes, block_to_slot: np.ndarray,
                 kv_hash_to_block_id: dict) -> None:
        """Put ``block_ids`` in the map under their KV ``hashes``, all or nothing.

        Parameters
        ----------
        block_ids : int64 [n]
            Checked block ids.
        hashes : sequence of int [n]
            Entries with ``hash <= 0`` (an unregistered KV block) are skipped; re-registering
            the same pair is a no-op.
        block_to_slot : int32 [num_blocks]
            The allocator's slot of each block (-1 = none).
        kv_hash_to_block_id : dict[int, int]
            The KV allocator's hash map.

        Raises
        ------
        ValueError
            Lengths differ, a block owns no slot, or a hash is not the KV hash of that block
            (or is already in the map under another block). Nothing changes.
        """
        hs = np.asarray(list(hashes), dtype=np.int64).reshape(-1)
        if hs.shape != block_ids.shape:
            raise ValueError(f"hashes: expected {len(block_ids)} hashes, got {len(hs)}")
        keep = hs > 0
        ids, hs = block_ids[keep], hs[keep]
        no_slot = ids[block_to_slot[ids] < 0]
        if len(no_slot):
            raise ValueError(f"block_ids: expected blocks owning a slot, got {int(no_slot[0])}")
        for b, h in zip(ids.tolist(), hs.tolist(), strict=True):
            if kv_hash_to_block_id.get(h) != b or self.hash_to_block_id.get(h, b) != b \
                    or self.block_hash[b] not in (-1, h):
                raise ValueError(f"hashes: expected the KV hash of block {b}, got {h}")
        for b, h in zip(ids.tolist(), hs.tolist(), strict=True):
            self.hash_to_block_id[h] = b
        self.block_hash[ids] = hs

    def broken_invariants(self, block_to_slot: np.ndarray,
                          kv_hash_to_block_id: dict) -> list[str]:
        """Every broken invariant (see the module docstring); empty when all hold."""
        problems = []
        for h, b in self.hash_to_block_id.items():
            if kv_hash_to_block_id.get(h) != b:
                problems.append(f"Mamba hash {h} -> block {b} is not in the KV map")
            if block_to_slot[b] < 0:
                problems.append(f"Mamba hash {h} -> block {b}, which owns no slot")
            if self.block_hash[b] != h:
                problems.append(f"block {b} records Mamba hash {self.block_hash[b]}, not {h}")
        if int((self.block_hash > 0).sum()) != len(self.hash_to_block_id):
            problems.append("per-block Mamba hashes disagree with the Mamba map")
        return problems
