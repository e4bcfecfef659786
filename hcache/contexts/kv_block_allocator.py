"""Block ids of a paged KV pool: free stack, ref counts, prefix hashes and LRU (SPEC §6).

Every block is in exactly one of three states:

* **free**: on the free stack, ref count 0, unregistered (hash -1);
* **used**: ref count > 0, registered or not;
* **cached**: ref count 0 and registered (``"lru"`` policy only), off the free stack until
  evicted under pressure.

Registered blocks form a forest through their parent hashes: a block's parent is the block that
held its parent hash when it was registered. LRU eviction peels leaves (oldest timestamp first,
ties by block id), so a cached block's ancestors stay cached and a prefix match scanned from the
end of a hash chain is valid. Deregistering a block orphans its registered children, so a parent
link always points at a registered block and the forest stays acyclic.

All bookkeeping lives on the host in NumPy arrays.
"""

from __future__ import annotations

import heapq
import logging

import numpy as np

from ..configs import _int

__all__ = ["KVBlockAllocator", "EVICTION_POLICIES"]

EVICTION_POLICIES = ("lru", "ref_zero")
_MAX_HASH = np.iinfo(np.int64).max
_log = logging.getLogger(__name__)


def _as_ids(name: str, ids, num_blocks: int) -> np.ndarray:
    """Host ``int64 [n]`` copy of ``ids``; raises TypeError/ValueError/IndexError."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected integer block ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    arr = arr.astype(np.int64)
    bad = (arr < 0) | (arr >= num_blocks)
    if bad.any():
        raise IndexError(f"{name}: expected block ids in [0, {num_blocks}), "
                         f"got {int(arr[bad][0])}")
    return arr


def _as_int64(name: str, values, length: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        arr = np.zeros(0, dtype=np.int64)
    elif arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer) \
            or (arr.dtype == np.uint64 and bool((arr > _MAX_HASH).any())):
        raise TypeError(f"{name}: expected int64 hashes, got dtype {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] != length:
        raise ValueError(f"{name}: expected {length} values (one per block id), "
                         f"got shape {arr.shape}")
    return arr.astype(np.int64)


class KVBlockAllocator:
    """Block ids ``0..num_blocks-1`` of a paged KV pool, with prefix-cache bookkeeping.

    Parameters
    ----------
    num_blocks : int
        Pool size (>= 1).
    enable_prefix_caching : bool
        When False, hashes are never recorded and a block whose ref count drops to 0 is freed.
    eviction_policy : {"lru", "ref_zero"}
        ``"ref_zero"``: a block whose ref count drops to 0 is deregistered and freed at once.
        ``"lru"``: a registered block whose ref count drops to 0 stays cached (matchable) until
        :meth:`evict_lru_blocks` reclaims it under pressure.

    Attributes
    ----------
    block_hashes : int64 [num_blocks]
        Hash of each block; -1 = unregistered.
    block_ref_counts : int32 [num_blocks]
        Number of holders (block-table entries) of each block.
    block_timestamps : int64 [num_blocks]
        :attr:`clock` at the block's last allocation or retain (0 when free).
    block_parent_hashes : int64 [num_blocks]
        Hash of the registered parent of each registered block; 0 = no parent.
    block_parent_ids : int32 [num_blocks]
        Block id of that parent; -1 = none.
    block_child_counts : int32 [num_blocks]
        Number of registered blocks whose parent is this block.
    kv_hash_to_block_id : dict[int, int]
        Registered hash -> block id (the inverse of ``block_hashes`` on registered blocks).

    Notes
    -----
    Read the public arrays, do not write them; they are mutated in place by the methods.
    Observers added with :meth:`add_blocks_deregistered_observer` are called as
    ``fn(block_ids: list[int], hashes: set[int])`` once per deregistration batch (``block_ids``
    in eviction order for LRU, ascending for ``"ref_zero"`` releases), after every state change
    of the call that deregistered them has been committed (so a block evicted by an allocation
    may already be handed out again); an observer that raises is logged and does not stop the
    others.
    """

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True,
                 eviction_policy: str = "lru"):
        n = _int("num_blocks", num_blocks, 1)
        if not isinstance(enable_prefix_caching, (bool, np.bool_)):
            raise TypeError(f"enable_prefix_caching: expected a bool, "
                            f"got {type(enable_prefix_caching).__name__}")
        if not isinstance(eviction_policy, str):
            raise TypeError(f"eviction_policy: expected a str, "
                            f"got {type(eviction_policy).__name__}")
        if eviction_policy.lower() not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy: expected one of {EVICTION_POLICIES}, "
                             f"got {eviction_policy!r}")
        self._num_blocks = n
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.eviction_policy = eviction_policy.lower()
        self._free_stack = np.empty(n, dtype=np.int32)
        self._free_top = 0
        self.block_hashes = np.empty(n, dtype=np.int64)
        self.block_ref_counts = np.empty(n, dtype=np.int32)
        self.block_timestamps = np.empty(n, dtype=np.int64)
        self.block_parent_hashes = np.empty(n, dtype=np.int64)
        self.block_parent_ids = np.empty(n, dtype=np.int32)
        self.block_child_counts = np.empty(n, dtype=np.int32)
        self.kv_hash_to_block_id: dict[int, int] = {}
        self._observers: list = []
        self.reset()

    # --- derived values -----------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def clock(self) -> int:
        """The LRU clock; stamps allocations and retains."""
        return self._clock

    @property
    def caches_released_blocks(self) -> bool:
        """True when registered blocks survive a ref count of 0 (caching on, policy lru)."""
        return self.enable_prefix_caching and self.eviction_policy == "lru"

    @property
    def num_free_blocks(self) -> int:
        return self._free_top

    @property
    def num_used_blocks(self) -> int:
        return int(np.count_nonzero(self.block_ref_counts > 0))

    @property
    def num_cached_blocks(self) -> int:
        return int(np.count_nonzero((self.block_ref_counts == 0) & (self.block_hashes != -1)))

    @property
    def free_block_ids(self) -> np.ndarray:
        """Copy of the free stack, ``int32 [num_free_blocks]``, bottom first."""
        return self._free_stack[: self._free_top].copy()

    # --- queries ------------------------------------------------------------------------

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

    def get_evictable_block_count(self) -> int:
        """Number of cached blocks that :meth:`evict_lru_blocks` can reclaim (0 unless the
        policy is lru). Equals the number of cached blocks unless a cached block has an
        in-use descendant."""
        return int(np.count_nonzero(self._evictable_mask()))

    def get_allocatable_count(self) -> int:
        """Free blocks plus, under lru, evictable cached blocks."""
        if not self.caches_released_blocks:
            return self._free_top
        return self._free_top + self.get_evictable_block_count()

    def is_memory_available(self, n: int, potential_matched_count: int = 0) -> bool:
        """Whether :meth:`allocate_memory_blocks` ``(n)`` would succeed after pinning
        ``potential_matched_count`` prefix-matched cached blocks (which then cannot be evicted
        to supply fresh blocks)."""
        n = _int("n", n)
        potential_matched_count = _int("potential_matched_count", potential_matched_count)
        if self._free_top >= n:
            return True
        return self.get_allocatable_count() - potential_matched_count >= n

    # --- commands -----------------------------------------------------------------------

    def advance_clock(self, steps: int = 1) -> int:
        """Advance the LRU clock by ``steps`` (the context does this once per step); returns
        the new value."""
        self._clock += _int("steps", steps)
        return self._clock

    def add_blocks_deregistered_observer(self, fn) -> None:
        """Call ``fn(block_ids: list[int], hashes: set[int])`` after each deregistration batch."""
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        self._observers.append(fn)

    def allocate_memory_blocks(self, n: int) -> np.ndarray | None:
        """Pop ``n`` free blocks (ref count 1, timestamp = clock), evicting cached blocks under
        lru when the free stack is short.

        Returns
        -------
        numpy.ndarray of int32 [n] or None
            A new array of distinct block ids, or None (and nothing changed) when fewer than
            ``n`` blocks can be made free.

        Raises
        ------
        TypeError, ValueError
            ``n`` is not an int >= 0.
        """
        n = _int("n", n)
        short = n - self._free_top
        evicted = None
        if short > 0:
            if not self.caches_released_blocks:
                return None
            evicted = self._peel_lru(short)
            if evicted is None:
                return None
            pending = self._deregister(evicted)
        top = self._free_top - n
        ids = self._free_stack[top: self._free_top][::-1].copy()
        self._free_top = top
        self.block_ref_counts[ids] = 1
        self.block_timestamps[ids] = self._clock
        if evicted is not None:
            self._notify(*pending)
        return ids

    def retain_memory_blocks(self, block_ids) -> None:
        """Add one reference per occurrence of each id (used or cached blocks) and refresh
        their timestamps; a cached block becomes used.

        Raises
        ------
        IndexError
            An id is out of range.
        ValueError
            An id is a free block (nothing changes).
        """
        ids = _as_ids("block_ids", block_ids, self._num_blocks)
        free = (self.block_ref_counts[ids] == 0) & (self.block_hashes[ids] == -1)
        if free.any():
            raise ValueError(f"block_ids: expected allocated or cached blocks, got free block "
                             f"{int(ids[free][0])}")
        uniq, counts = np.unique(ids, return_counts=True)
        self.block_ref_counts[uniq] += counts.astype(np.int32)
        self.block_timestamps[uniq] = self._clock

    def release_memory_blocks(self, block_ids) -> None:
        """Drop one reference per occurrence of each id. Blocks reaching 0 are freed when
        unregistered, deregistered and freed under ``"ref_zero"``, and stay cached under
        ``"lru"``.

        Raises
        ------
        IndexError
            An id is out of range.
        ValueError
            A ref count would drop below 0 (nothing changes).
        """
        ids = _as_ids("block_ids", block_ids, self._num_blocks)
        uniq, counts = np.unique(ids, return_counts=True)
        after = self.block_ref_counts[uniq].astype(np.int64) - counts
        if (after < 0).any():
            bad = int(uniq[after < 0][0])
            raise ValueError(f"block_ids: expected at most {int(self.block_ref_counts[bad])} "
                             f"releases of block {bad}, got "
                             f"{int(counts[after < 0][0])}")
        self.block_ref_counts[uniq] = after.astype(np.int32)
        zero = uniq[after == 0]
        registered = self.block_hashes[zero] != -1
        self._push_free(zero[~registered])
        if not self.caches_released_blocks and registered.any():
            self._notify(*self._deregister(zero[registered]))

    def register_kv_block_hashes(self, block_ids, hashes, parent_hashes=None) -> None:
        """Record the prefix hash of each block (a batch, applied whole or not at all).

        Parameters
        ----------
        block_ids : sequence of int [n]
            Used blocks, or cached blocks re-registered under their own hash.
        hashes : sequence of int [n]
            Positive int64 hashes (see :func:`~hcache.contexts.compute_block_hashes`).
        parent_hashes : sequence of int [n], optional
            The hash of each block's predecessor in its chain; 0, or a hash registered neither
            before this call nor earlier in this batch, means no parent.

        Notes
        -----
        Entries whose block already holds the same hash are skipped (their parent is kept).
        Ref counts never change. With prefix caching disabled the call validates and records
        nothing.

        Raises
        ------
        IndexError
            A block id is out of range.
        TypeError, ValueError
            Lengths differ, a hash is not positive, a registered block would get a different
            hash, a hash is held by another block, or a block is free (nothing changes).
        """
        ids = _as_ids("block_ids", block_ids, self._num_blocks)
        hs = _as_int64("hashes", hashes, ids.shape[0])
        ps = (np.zeros_like(hs) if parent_hashes is None
              else _as_int64("parent_hashes", parent_hashes, ids.shape[0]))
        if (hs <= 0).any():
            raise ValueError(f"hashes: expected positive hashes, got {int(hs[hs <= 0][0])}")
        current = self.block_hashes[ids]
        clash = (current != -1) & (current != hs)
        if clash.any():
            i = int(np.argmax(clash))
            raise ValueError(f"block_ids: expected block {int(ids[i])} re-registered under its "
                             f"hash {int(current[i])}, got a different hash {int(hs[i])}")
        free = (current == -1) & (self.block_ref_counts[ids] == 0)
        if free.any():
            raise ValueError(f"block_ids: expected blocks in use, got free block "
                             f"{int(ids[free][0])}")
        new = current == -1
        pending: dict[int, tuple[int, int]] = {}   # block -> (hash, parent hash), first seen
        claimed: dict[int, int] = {}               # hash -> block
        for b, h, p in zip(ids[new].tolist(), hs[new].tolist(), ps[new].tolist(), strict=True):
            if pending.setdefault(b, (h, p))[0] != h:
                raise ValueError(f"hashes: expected one hash for block {b}, "
                                 f"got {pending[b][0]} and {h}")
            holder = claimed.setdefault(h, self.kv_hash_to_block_id.get(h, b))
            if holder != b:
                raise ValueError(f"hashes: expected hash {h} to be free, got it held by block "
                                 f"{holder} while registering block {b}")
        if not self.enable_prefix_caching or not pending:
            return
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

    def evict_lru_blocks(self, n: int) -> bool:
        """Deregister and free ``n`` cached blocks, peeling leaves oldest first (ties by id).

        Returns
        -------
        bool
            True when ``n`` blocks were evicted; False (nothing changed) when fewer than ``n``
            are evictable.
        """
        n = _int("n", n)
        if n == 0:
            return True
        victims = self._peel_lru(n) if self.caches_released_blocks else None
        if victims is None:
            return False
        self._notify(*self._deregister(victims))
        return True

    def reset(self) -> None:
        """Free every block, clear hashes, ref counts, timestamps and the clock. Observers are
        kept and not called (owners of derived state reset it themselves)."""
        n = self._num_blocks
        # Bottom-to-top n-1..0, so a fresh pool hands out ids 0, 1, 2, ...
        self._free_stack[:] = np.arange(n - 1, -1, -1, dtype=np.int32)
        self._free_top = n
        self.block_hashes.fill(-1)
        self.block_ref_counts.fill(0)
        self.block_timestamps.fill(0)
        self.block_parent_hashes.fill(0)
        self.block_parent_ids.fill(-1)
        self.block_child_counts.fill(0)
        self.kv_hash_to_block_id.clear()
        self._clock = 0

    # --- internals ----------------------------------------------------------------------

    def _push_free(self, ids: np.ndarray) -> None:
        k = ids.shape[0]
        self._free_stack[self._free_top: self._free_top + k] = ids
        self._free_top += k

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

    def _notify(self, block_ids: list, hashes: set) -> None:
        for fn in list(self._observers):
            try:
                fn(list(block_ids), set(hashes))
            except Exception:  # noqa: BLE001 - observers must not break the allocator
                _log.exception("blocks-deregistered observer %r failed", fn)

    # --- checks -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Verify the bookkeeping; raise RuntimeError listing every broken invariant."""
        errors: list[str] = []
        n = self._num_blocks
        hashes, refs = self.block_hashes, self.block_ref_counts
        if not 0 <= self._free_top <= n:
            errors.append(f"free stack top {self._free_top} outside [0, {n}]")
        stack = self._free_stack[: max(0, min(self._free_top, n))].astype(np.int64)
        in_range = (stack >= 0) & (stack < n)
        if not in_range.all():
            errors.append(f"free stack holds out-of-range ids {stack[~in_range].tolist()}")
        stack = stack[in_range]
        is_free = np.zeros(n, dtype=bool)
        is_free[stack] = True
        if np.unique(stack).shape[0] != stack.shape[0]:
            errors.append("free stack holds duplicate ids")
        if (refs < 0).any():
            errors.append(f"negative ref counts at {np.flatnonzero(refs < 0).tolist()}")
        registered, used = hashes != -1, refs > 0
        cached = registered & ~used
        bad_free = is_free & (registered | used)
        if bad_free.any():
            errors.append(f"free blocks registered or in use: {np.flatnonzero(bad_free).tolist()}")
        lost = ~is_free & ~registered & ~used
        if lost.any():
            errors.append(f"unregistered ref-0 blocks off the free stack: "
                          f"{np.flatnonzero(lost).tolist()}")
        total = int(is_free.sum()) + int(used.sum()) + int(cached.sum())
        if total != n:
            errors.append(f"free + used + cached = {total}, expected {n}")
        if not self.caches_released_blocks and cached.any():
            errors.append(f"cached blocks under policy {self.eviction_policy} / caching "
                          f"{self.enable_prefix_caching}: {np.flatnonzero(cached).tolist()}")
        if not self.enable_prefix_caching and registered.any():
            errors.append("registered blocks with prefix caching disabled")
        if (hashes[registered] <= 0).any() or (hashes[~registered] != -1).any():
            errors.append("hashes must be positive or -1")
        if len(self.kv_hash_to_block_id) != int(registered.sum()):
            errors.append(f"hash map has {len(self.kv_hash_to_block_id)} entries, "
                          f"{int(registered.sum())} blocks are registered")
        for h, b in self.kv_hash_to_block_id.items():
            if not 0 <= b < n or int(hashes[b]) != h:
                errors.append(f"hash map entry {h} -> {b} disagrees with block_hashes")
        self._check_forest(errors, registered)
        if (self.block_timestamps[registered | used] > self._clock).any():
            errors.append("timestamps ahead of the clock")
        if errors:
            raise RuntimeError("KVBlockAllocator invariants broken:\n  " + "\n  ".join(errors))

    def _check_forest(self, errors: list, registered: np.ndarray) -> None:
        n = self._num_blocks
        pid, phash = self.block_parent_ids.astype(np.int64), self.block_parent_hashes
        if ((pid < -1) | (pid >= n)).any():
            errors.append("parent ids out of range")
            return
        if (pid[~registered] != -1).any() or (phash[~registered] != 0).any() \
                or (self.block_child_counts[~registered] != 0).any():
            errors.append("unregistered blocks with a parent or children")
        linked = registered & (pid >= 0)
        if not registered[pid[linked]].all():
            errors.append("a registered block's parent hash is no longer registered")
        if (phash[linked] != self.block_hashes[pid[linked]]).any() \
                or (phash[registered & (pid < 0)] != 0).any():
            errors.append("block_parent_hashes disagree with block_parent_ids")
        counts = np.bincount(pid[linked], minlength=n)
        if (counts != self.block_child_counts).any():
            errors.append("block_child_counts disagree with the parent links")
        up = np.where(linked, pid, -1)
        for _ in range(max(1, n.bit_length())):
            up = np.where(up >= 0, up[np.maximum(up, 0)], -1)
        if (up >= 0).any():
            errors.append("the parent links contain a cycle")
