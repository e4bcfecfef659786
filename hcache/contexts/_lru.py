"""Leaf-peeling LRU over the forest of registered KV blocks (docs/design.md §6).

Registered blocks form a forest through their parent links (``block_parent_ids``, with
``block_child_counts`` counting each block's registered children). Invariants relied on here:

- a parent link always points at a registered block, and links point backwards in
  registration order, so the forest is acyclic;
- eviction removes leaves only (oldest timestamp first, ties by block id), so a cached block's
  ancestors stay cached and a prefix match scanned along a hash chain never meets a hole;
- a cached block with an in-use descendant is not evictable (peeling cannot reach it).

:class:`LeafPeelingMixin` holds the forest maintenance (linking registered blocks, unlinking
deregistered ones) and the eviction order; :class:`~hcache.contexts.KVBlockAllocator` inherits it.
"""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["LeafPeelingMixin"]


class LeafPeelingMixin:
    """Forest and eviction-order helpers of :class:`~hcache.contexts.KVBlockAllocator`.

    Relies on the allocator's block arrays (``block_hashes``, ``block_ref_counts``,
    ``block_timestamps``, ``block_parent_ids`` / ``block_parent_hashes``,
    ``block_child_counts``), ``kv_hash_to_block_id``, ``caches_released_blocks``,
    ``_num_blocks`` and ``_push_free``.
    """

    def _link_registered(self, pending: dict) -> None:
        """Register validated new blocks and link each to its parent.

        ``pending`` maps block id -> ``(hash, parent hash)`` in batch order; a parent hash that
        is 0 or not registered (before this call or earlier in the batch) means no parent.
        """
        # Parents resolve to blocks registered before this call or earlier in the batch, so
        # every parent link points backwards in registration order (no cycles).
        parent_ids = []
        for b, (h, p) in pending.items():
            parent_ids.append(self.kv_hash_to_block_id.get(p, -1) if p > 0 else -1)
            self.kv_hash_to_block_id[h] = b
        new_ids = np.fromiter(pending, dtype=np.int64, count=len(pending))
        parents = np.asarray(parent_ids, dtype=np.int32)
        self.block_hashes[new_ids] = [h for h, _ in pending.values()]
        has_parent = parents >= 0
        self.block_parent_ids[new_ids] = parents
        self.block_parent_hashes[new_ids] = np.where(
            has_parent, self.block_hashes[np.maximum(parents, 0)], 0)
        np.add.at(self.block_child_counts, parents[has_parent], 1)

    def _evictable_mask(self) -> np.ndarray:
        """Cached blocks with no used descendant: exactly the blocks leaf peeling can reach."""
        registered = self.block_hashes != -1
        used = self.block_ref_counts > 0
        cached = registered & ~used
        if not self.caches_released_blocks or not cached.any():
            return np.zeros(self._num_blocks, dtype=bool)
        blocked = np.zeros(self._num_blocks, dtype=bool)
        parents = self.block_parent_ids[registered & used]
        # Walk up from used blocks through cached ancestors only; a request normally holds its
        # whole chain, so this loop usually stops after one round.
        while parents.size:
            parents = parents[parents >= 0]
            parents = np.unique(parents[cached[parents] & ~blocked[parents]])
            blocked[parents] = True
            parents = self.block_parent_ids[parents]
        return cached & ~blocked

    def _peel_lru(self, n: int) -> np.ndarray | None:
        """The first ``n`` blocks of the leaf-peeling order, or None if fewer are evictable.

        Leaves come from one vectorised sort; only parents freed by the peel go through a heap,
        so the Python loop runs ``n`` times.
        """
        evictable = self._evictable_mask()
        if np.count_nonzero(evictable) < n:
            return None
        ts = self.block_timestamps
        leaves = np.flatnonzero(evictable & (self.block_child_counts == 0))
        leaves = leaves[np.lexsort((leaves, ts[leaves]))].tolist()
        children = self.block_child_counts.copy()
        heap: list[tuple[int, int]] = []
        out: list[int] = []
        i = 0
        while len(out) < n:
            if heap and (i >= len(leaves) or heap[0] < (int(ts[leaves[i]]), leaves[i])):
                b = heapq.heappop(heap)[1]
            else:
                b = leaves[i]
                i += 1
            out.append(b)
            p = int(self.block_parent_ids[b])
            if p >= 0:
                children[p] -= 1
                if children[p] == 0 and evictable[p]:
                    heapq.heappush(heap, (int(ts[p]), p))
        return np.asarray(out, dtype=np.int64)

    def _deregister(self, ids: np.ndarray):
        """Drop the hashes of unique registered ``ids``, free them, and return the observer
        arguments ``(ids_list, hashes_set)``; the caller notifies once its call has committed."""
        hashes = self.block_hashes[ids]
        for h in hashes.tolist():
            del self.kv_hash_to_block_id[h]
        parents = self.block_parent_ids[ids]
        np.subtract.at(self.block_child_counts, parents[parents >= 0], 1)
        orphans = np.isin(self.block_parent_ids, ids)
        self.block_parent_ids[orphans] = -1
        self.block_parent_hashes[orphans] = 0
        self.block_parent_ids[ids] = -1
        self.block_parent_hashes[ids] = 0
        self.block_child_counts[ids] = 0
        self.block_hashes[ids] = -1
        self.block_ref_counts[ids] = 0
        self.block_timestamps[ids] = 0
        self._push_free(ids)
        return ids.tolist(), set(hashes.tolist())
