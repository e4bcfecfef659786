"""The block space of the sliding-window layers of a :class:`DynamicInferenceContext`
(docs/design.md §6.7).

With a local block space, the pool's sliding-window layers (``sliding_window`` set) live in their
own blocks, handed out by their own :class:`KVBlockAllocator` and addressed by their own block
table; the full-attention layers keep the context's. Column ``j`` of a request (positions ``[j ·
bs, (j + 1) · bs)``) is allocated in both spaces while a query can read it, and in the local
space it is released as soon as no later query can: a query at position ``q`` reads keys ``>= q -
W + 1`` (``W`` the largest window of the local layers), so once ``computed`` tokens are done,
columns below ``first_needed(computed) = max(0, (computed - W + 1) // bs)`` are released and
their table entries become -1 (a write skips them). Released blocks that were registered stay
cached under LRU, matchable until evicted. They are registered without parent hashes: the full
space's LRU keeps a cached block while a descendant is in use (its prefix is still matchable),
which here would pin every block that left the window of a live request; a chained hash
identifies its whole prefix anyway, so a window lookup needs no parent link.

A prefix hit needs, in the local space, only the columns in the window before the hit point:
``[first_needed(skip), matched)``. When those are not all cached the match is shortened until
they are (down to no match, which always works); the Mamba restore rules are the full match's,
applied to the shortened match.
"""

from __future__ import annotations

import numpy as np

from ..errors import CacheCapacityError
from .kv_block_allocator import KVBlockAllocator
from .token_batches import ragged_columns

__all__ = ["WindowBlocks"]


class WindowBlocks:
    """The local block space: its allocator, block table and live column range per row.

    Parameters
    ----------
    num_blocks : int
        Blocks of the space (the pool's ``num_local_blocks``).
    window : int
        The largest window (tokens) of the sliding-window layers.
    block_size, max_requests, max_blocks_per_request : int
    enable_prefix_caching : bool
    eviction_policy : {"lru", "ref_zero"}

    Attributes
    ----------
    allocator : KVBlockAllocator
    table : int32 [max_requests, max_blocks_per_request]
        Host block table of the local layers; -1 outside each row's live columns.
    first, count : int64 [max_requests]
        Live columns of each row are ``[first, count)``; ``count`` equals the request's
        column count in the full space.
    """

    def __init__(self, num_blocks, window: int, block_size: int, max_requests: int,
                 max_blocks_per_request: int, *, enable_prefix_caching: bool,
                 eviction_policy: str):
        self.allocator = KVBlockAllocator(num_blocks, enable_prefix_caching=enable_prefix_caching,
                                          eviction_policy=eviction_policy)
        self.window, self.block_size = int(window), int(block_size)
        self.table = np.full((max_requests, max_blocks_per_request), -1, np.int32)
        self.first = np.zeros(max_requests, np.int64)
        self.count = np.zeros(max_requests, np.int64)

    @classmethod
    def for_pool(cls, pool, max_requests: int, max_blocks_per_request: int, kv_allocator):
        """The local space of ``pool`` (a :class:`PagedKVPool`), with the prefix-caching
        settings of the full space's ``kv_allocator``; None when the pool has none. Its window
        is the largest of the pool's local layers."""
        if not pool.has_local_space:
            return None
        window = max(lc.sliding_window for lc, local in zip(pool.layer_configs,
                                                            pool.local_layers) if local)
        return cls(pool.num_local_blocks, window, pool.block_size, max_requests,
                   max_blocks_per_request, enable_prefix_caching=kv_allocator.enable_prefix_caching,
                   eviction_policy=kv_allocator.eviction_policy)

    def first_needed(self, computed):
        """The first column a query at position ``computed`` or later can read (int or int64
        array)."""
        return np.maximum(0, (computed - self.window + 1) // self.block_size)

    # --- admission ------------------------------------------------------------------------

    def plan_admit(self, hashes: list, matched: list, skip_of) -> tuple:
        """The longest prefix of the full match whose window is cached in the local space.

        Parameters
        ----------
        hashes : list of int
            The prompt's complete-block hashes.
        matched : list of int
            The full space's matched blocks (a prefix of ``hashes``).
        skip_of : callable(int) -> int
            Tokens skipped for a match of the first ``m`` blocks (the Mamba rules).

        Returns
        -------
        (m, skip, lo, local_ids)
            The usable match length, its skip, the first live column and the local blocks of
            columns ``[lo, m)``.
        """
        cached = self.allocator.kv_hash_to_block_id
        for m in range(len(matched), -1, -1):
            skip = skip_of(m)
            lo = int(self.first_needed(skip))
            ids = [cached.get(h) for h in hashes[lo:m]]
            if None not in ids:
                return m, skip, lo, ids
        raise RuntimeError("unreachable: an empty match needs no local block")

    def check_admit(self, local_ids: list, need: int) -> None:
        """Raise ``CacheCapacityError`` unless ``need`` new local blocks fit after pinning
        ``local_ids``; changes nothing."""
        pinned = self.allocator.get_evictable_block_count(local_ids) if local_ids else 0
        if not self.allocator.is_memory_available(need, pinned):
            available = self.allocator.get_allocatable_count() - pinned
            raise CacheCapacityError(f"local KV blocks: {need} required, {available} "
                                     f"allocatable", required=need, available=available)

    def admit(self, row: int, lo: int, local_ids: list, need: int) -> None:
        """Pin ``local_ids`` (columns ``[lo, lo + len)``) and allocate ``need`` more for row
        ``row`` (checked by :meth:`check_admit`)."""
        if local_ids:
            self.allocator.retain_memory_blocks(local_ids)
        new = self.allocator.allocate_memory_blocks(need) if need else np.zeros(0, np.int64)
        m = lo + len(local_ids)
        self.table[row] = -1
        self.table[row, lo:m] = local_ids
        self.table[row, m:m + need] = new
        self.first[row], self.count[row] = lo, m + need

    # --- extension ------------------------------------------------------------------------

    def check_extend(self, total: int) -> None:
        """Raise ``CacheCapacityError`` unless ``total`` local blocks can be allocated."""
        if total and not self.allocator.is_memory_available(total):
            available = self.allocator.get_allocatable_count()
            raise CacheCapacityError(f"local KV blocks: {total} required, {available} "
                                     f"allocatable", required=total, available=available)

    def extend(self, rows: np.ndarray, need: np.ndarray, total: int) -> None:
        """Append ``need[i]`` columns to ``rows[i]`` (a count or a 0/1 mask; ``total`` in all,
        checked by :meth:`check_extend`), in row order, as the full space does."""
        if not total:
            return
        counts = need.astype(np.int64)
        if self.allocator.num_free_blocks >= total:
            new = self.allocator.allocate_memory_blocks(total)
        else:   # eviction: one allocation per request, in order
            new = np.concatenate([self.allocator.allocate_memory_blocks(k)
                                  for k in counts[counts > 0].tolist()])
        which, cols = ragged_columns(self.count[rows], counts)
        self.table[rows[which], cols] = new
        self.count[rows] += counts

    # --- commit and release ---------------------------------------------------------------

    def commit(self, requests, rows: np.ndarray, done: np.ndarray, ends: np.ndarray, *,
               register: bool) -> int:
        """After a step of ``rows`` (``done``: their registered columns before it, ``ends``:
        their computed tokens now): register the local blocks of the columns it completed,
        then release the columns that left the window. Returns the released count."""
        bs = self.block_size
        if register:
            complete = ends // bs
            grew = complete > done
            if grew.any():
                which, cols = ragged_columns(done[grew], complete[grew] - done[grew])
                owners = rows[grew][which]
                hashes = requests.hashes[owners, cols]
                ids = self.table[owners, cols].astype(np.int64)
                cached = self.allocator.kv_hash_to_block_id
                keep = np.fromiter((h not in cached for h in hashes.tolist()), bool,
                                   len(hashes))
                keep &= np.isin(np.arange(len(hashes)),
                                np.unique(hashes, return_index=True)[1])
                if keep.any():   # no parents: an out-of-window block is evictable on its own
                    self.allocator.register_kv_block_hashes(ids[keep], hashes[keep])
        new_first = np.maximum(self.first[rows], np.minimum(self.first_needed(ends),
                                                            self.count[rows]))
        gone = new_first - self.first[rows]
        if not gone.any():
            return 0
        which, cols = ragged_columns(self.first[rows], gone)
        owners = rows[which]
        self.allocator.release_memory_blocks(self.table[owners, cols].astype(np.int64))
        self.table[owners, cols] = -1
        self.first[rows] = new_first
        return int(gone.sum())

    def row_blocks(self, row: int) -> np.ndarray:
        """The row's table entries up to its last column, int32 (a copy; -1: released)."""
        return self.table[row, :self.count[row]].copy()

    def held(self, row: int) -> np.ndarray:
        """The row's live local blocks (columns ``[first, count)``), int32 (a copy)."""
        return self.table[row, self.first[row]:self.count[row]].copy()

    def release(self, rows) -> None:
        """Drop the references of ``rows``' live columns and clear them."""
        held = [self.held(row) for row in rows]
        if held:
            self.allocator.release_memory_blocks(np.concatenate(held).astype(np.int64))
        for row in rows:
            self.table[row] = -1
            self.first[row] = self.count[row] = 0

    def reset(self) -> None:
        self.allocator.reset()
        self.table.fill(-1)
        self.first.fill(0)
        self.count.fill(0)

    def broken_invariants(self, requests) -> list[str]:
        """The local space's broken invariants, against the request table."""
        problems = []
        held = np.zeros(self.allocator.num_blocks, np.int64)
        for row in (requests.row(rid) for rid in requests.ids):
            if self.count[row] != requests.num_blocks[row]:
                problems.append(f"row {row}: {self.count[row]} local columns, "
                                f"{requests.num_blocks[row]} full ones")
            cols = np.arange(self.table.shape[1])
            live = (cols >= self.first[row]) & (cols < self.count[row])
            if (self.table[row, ~live] != -1).any() or (self.table[row, live] < 0).any():
                problems.append(f"row {row}: local table entries outside the live columns")
            np.add.at(held, self.held(row), 1)
        if (held > self.allocator.block_ref_counts).any():
            problems.append("a request holds a local block without a reference")
        try:
            self.allocator.check_invariants()
        except RuntimeError as exc:
            problems.append(str(exc))
        return problems
