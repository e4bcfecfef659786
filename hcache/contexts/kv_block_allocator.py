"""Block ids of a paged KV pool: free stack, ref counts, prefix hashes and LRU (docs/design.md §6).

Every block is in exactly one of three states:

* **free**: on the free stack, ref count 0, unregistered (hash -1);
* **used**: ref count > 0, registered or not;
* **cached**: ref count 0 and registered (``"lru"`` policy only), off the free stack until
  evicted under pressure.

The free stack (:mod:`.free_block_stack`) holds exactly the free blocks; cached blocks exist only
under ``"lru"`` with prefix caching on (:mod:`.kv_block_invariants`). The registered blocks are a
:class:`~.block_forest.BlockForest`, their eviction order :class:`~.evictable_leaves.
EvictableLeaves`; all on the host in NumPy arrays.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from .._checks import as_int, block_id_array, check_int, hash_array, host_ints
from .._copying import refuse_copy
from .block_forest import BlockForest
from .block_id_sets import counted
from .block_observers import checked_observer, notify
from .evictable_leaves import EvictableLeaves
from .few_blocks import deregister_peeled, hand_out, hand_out_stack, release_one_each
from .free_block_stack import FreeBlockStack
from .kv_block_invariants import broken_kv_block_invariants
from .scalar_views import ScalarViews

__all__ = ["KVBlockAllocator", "EVICTION_POLICIES"]

EVICTION_POLICIES = ("lru", "ref_zero")
_INT64_MAX = 2**63 - 1
_LISTED, _FEW = 64, 16      # up to this many: victims deregistered, blocks handed out, one by one


class KVBlockAllocator:
    """Block ids ``0..num_blocks-1`` of a paged KV pool, with prefix-cache bookkeeping.

    Parameters
    ----------
    num_blocks : int
        Pool size, in [1, 2**31 - 1] (block ids are int32).
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
    pending_parents, deregistering : callable or None
        Set by an owner that defers registration (docs/design.md §6.8): ``pending_parents()``
        returns the registered parents (int64) of its unregistered used blocks, kept from
        eviction as parents are; ``deregistering(ids)`` is shown the registered blocks (a list
        of ints, or int64) about to be deregistered, their links intact.

    Notes
    -----
    Read the public arrays, do not write them. Observers are called as ``fn(block_ids, hashes)``
    once per deregistration batch (ids in eviction order, ascending under ``"ref_zero"``), after
    the call's state changes (an evicted block may be handed out again); a raise is logged.
    """
    __copy__ = refuse_copy   # deepcopy and pickle copy the host state (hcache/_copying.py)

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True,
                 eviction_policy: str = "lru"):
        n = check_int("num_blocks", num_blocks, 1)   # block ids are int32
        for name, value, kind in (("enable_prefix_caching", enable_prefix_caching, bool),
                                  ("eviction_policy", eviction_policy, str)):
            if not isinstance(value, (kind, np.bool_) if kind is bool else kind):
                raise TypeError(f"{name}: expected a {kind.__name__}, got {type(value).__name__}")
        if eviction_policy.lower() not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy: expected one of {EVICTION_POLICIES}, "
                             f"got {eviction_policy!r}")
        self._num_blocks = n
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.eviction_policy = eviction_policy.lower()
        self._free = FreeBlockStack(n)
        self.block_ref_counts = np.empty(n, dtype=np.int32)
        self.block_timestamps = np.empty(n, dtype=np.int64)
        self._scalars = ScalarViews(refs=self.block_ref_counts, stamps=self.block_timestamps)
        self._forest, self._leaves = BlockForest(n), EvictableLeaves(n)
        self._observers, self._released_observers = [], []     # deregistered, released
        self.pending_parents = self.deregistering = None
        self.reset()

    # --- derived values -----------------------------------------------------------------

    num_blocks = property(attrgetter("_num_blocks"), doc="Blocks in the pool.")
    # Views of the forest's arrays, int [num_blocks] (-1: none), written in place by the methods.
    block_hashes = property(attrgetter("_forest.hashes"), doc="Each block's chained hash.")
    kv_hash_to_block_id = property(attrgetter("_forest.hash_to_block"),
                                   doc="Registered hash -> block id (the prefix-match index).")
    block_parent_hashes = property(attrgetter("_forest.parent_hashes"),
                                   doc="Hash of each registered block's parent.")
    block_parent_ids = property(attrgetter("_forest.parent_ids"), doc="Each block's parent.")
    block_child_counts = property(attrgetter("_forest.child_counts"),
                                  doc="Registered children per block.")
    clock = property(attrgetter("_clock"), doc="The LRU clock; stamps allocations and retains.")

    @property
    def caches_released_blocks(self) -> bool:
        """True when registered blocks survive a ref count of 0 (caching on, policy lru)."""
        return self.enable_prefix_caching and self.eviction_policy == "lru"

    num_free_blocks = property(attrgetter("_free.top"), doc="Blocks on the free stack.")
    _free_top = property(attrgetter("_free.top"), lambda a, top: setattr(a._free, "top", top))
    num_used_blocks = property(lambda self: int(np.count_nonzero(self.block_ref_counts > 0)),
                               doc="Blocks some request holds (ref count > 0).")
    num_cached_blocks = property(lambda self: int(np.count_nonzero(
        (self.block_ref_counts == 0) & (self.block_hashes != -1))),
        doc="Registered blocks no request holds (a prefix match may reuse them).")
    free_block_ids = property(attrgetter("_free.free_block_ids"),
                              doc="Copy of the free stack, int32 [num_free_blocks], bottom first.")

    # --- queries ------------------------------------------------------------------------

    def get_evictable_block_count(self, block_ids=None) -> int:
        """Cached blocks :meth:`evict_lru_blocks` can reclaim (those with no in-use descendant;
        0 unless lru), among ``block_ids`` if given (``IndexError`` for an id out of range)."""
        mask = np.zeros(self._num_blocks, dtype=bool)
        if self.caches_released_blocks:
            pinned = None if self.pending_parents is None else self.pending_parents()
            mask = self._forest.evictable_mask(self.block_ref_counts, pinned)
        if block_ids is not None:
            mask = mask[block_id_array("block_ids", block_ids, self._num_blocks)]
        return int(np.count_nonzero(mask))

    def get_allocatable_count(self) -> int:
        """Free blocks plus, under lru, evictable cached blocks."""
        return self._free.top + (self.caches_released_blocks and self.get_evictable_block_count())

    def is_memory_available(self, n: int, potential_matched_count: int = 0) -> bool:
        """Whether :meth:`allocate_memory_blocks` ``(n)`` would succeed after pinning
        ``potential_matched_count`` prefix-matched evictable blocks (which then cannot supply
        fresh blocks; a block with an in-use descendant is not evictable, not counted)."""
        n, matched = as_int("n", n), as_int("potential_matched_count", potential_matched_count)
        if self._free.top >= n:
            return True
        if matched == 0:
            return self.can_allocate_memory_blocks(n)
        return self.get_allocatable_count() - matched >= n

    def can_allocate_memory_blocks(self, n: int, retained=None) -> bool:
        """Whether :meth:`allocate_memory_blocks` ``(n, retained)`` would succeed, in O(n log
        cached leaves). ``IndexError``: a retained id out of range; ``TypeError`` /
        ``ValueError``: ``n`` is not an int >= 0."""
        n, keep = as_int("n", n), self._kept(retained)
        short = n - self._free.top
        return short <= 0 or (self.caches_released_blocks
                              and self._peel(short, keep, commit=False) is not None)

    # --- commands -----------------------------------------------------------------------

    def advance_clock(self, steps: int = 1) -> int:
        """Advance the LRU clock by ``steps`` (the context does this once per step); returns
        the new value. ``ValueError`` if the clock would leave int64 (the timestamps' type)."""
        self._clock += check_int("steps", steps, 0, _INT64_MAX - self._clock)
        return self._clock

    def add_blocks_deregistered_observer(self, fn) -> None:
        """Call ``fn(block_ids: list[int], hashes: set[int])`` after each deregistration batch."""
        self._observers.append(checked_observer(fn))

    def add_released_observer(self, fn) -> None:
        """Call ``fn(block_ids, block_timestamps)`` (arrays, read only) after each release with
        the blocks (int64, unique) it dropped to ref count 0, and at :meth:`reset` with all."""
        self._released_observers.append(checked_observer(fn))

    def allocate_memory_blocks(self, n: int, retained=None) -> np.ndarray | None:
        """Pop ``n`` free blocks (ref count 1, timestamp = clock), evicting cached blocks under
        lru when the free stack is short; ``retained`` (block ids, optional) are blocks the
        caller retains next: evicted as if retained already (neither they nor their ancestors).
        Returns a new ``int32 [n]`` array of distinct ids, or None (nothing changed) when fewer
        than ``n`` blocks can be made free. Raises ``IndexError`` (a retained id out of range),
        ``TypeError`` / ``ValueError`` (``n`` is not an int >= 0)."""
        return self._allocate(as_int("n", n), self._kept(retained))

    def allocate_memory_blocks_per_request(self, counts) -> np.ndarray | None:
        """``int32 [sum(counts)]``: what consecutive :meth:`allocate_memory_blocks`
        ``(counts[i])`` calls return, concatenated (the same ids, order and victims), with one
        eviction and one observer call; None (nothing changed) when fewer blocks can be made
        free. ``TypeError`` / ``ValueError``: ``counts`` is not a 1-D sequence of ints >= 0."""
        counts = host_ints("counts", counts)
        if len(counts) and counts.min() < 0:
            raise ValueError(f"counts: expected ints >= 0, got {int(counts.min())}")
        return self._allocate(int(counts.sum()), (), counts.tolist())

    def _allocate(self, n: int, keep, counts=None) -> np.ndarray | None:
        top, pending = self._free.top, None
        if n > top:
            evicted = self._peel(n - top, keep) if self.caches_released_blocks else None
            if evicted is None:
                return None
            pending = self._deregister(evicted)     # pushed on the stack, in peel order
            if n <= _LISTED:    # the stack empties, popped as a list
                return hand_out_stack(self, pending, counts, top)
        ids = self._free.pop(n) if pending is None or counts is None \
            else self._free.pop_per_request(counts, top)
        if n <= _FEW:       # (a NumPy write through a few int32 ids costs more)
            hand_out(self, ids.tolist())
        else:
            self.block_ref_counts[ids] = 1
            self.block_timestamps[ids] = self._clock
        if pending is not None:
            notify(self._observers, *pending)
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
        ids = block_id_array("block_ids", block_ids, self._num_blocks)
        free = (self.block_ref_counts[ids] == 0) & (self.block_hashes[ids] == -1)
        if free.any():
            raise ValueError(f"block_ids: expected allocated or cached blocks, got free block "
                             f"{int(ids[free][0])}")
        uniq, counts = counted(ids)
        self.block_ref_counts[uniq] += counts.astype(np.int32)
        self.block_timestamps[uniq] = self._clock
        self._leaves.discard(uniq)

    def _retain_distinct(self, block_ids: np.ndarray) -> None:
        """:meth:`retain_memory_blocks` unchecked: distinct used or cached ids (int64)."""
        self.block_ref_counts[block_ids] += 1
        self.block_timestamps[block_ids] = self._clock
        self._leaves.discard(block_ids)

    def release_memory_blocks(self, block_ids) -> None:
        """Drop one reference per occurrence of each id. Blocks reaching 0 are freed when
        unregistered, deregistered and freed under ``"ref_zero"``, and stay cached under
        ``"lru"``. ``IndexError``: an id out of range; ``ValueError``: a ref count would drop
        below 0 (nothing changes)."""
        ids = block_id_array("block_ids", block_ids, self._num_blocks)
        uniq, counts = counted(ids)
        after = self.block_ref_counts[uniq].astype(np.int64) - counts
        if (after < 0).any():
            bad = int(uniq[after < 0][0])
            raise ValueError(f"block_ids: expected at most {int(self.block_ref_counts[bad])} "
                             f"releases of block {bad}, got "
                             f"{int(counts[after < 0][0])}")
        self._release(uniq, after)

    def _release(self, uniq: np.ndarray, after=None) -> None:
        """Lower the ref counts of distinct held ``uniq`` to ``after`` (default: one less)."""
        if after is None and len(uniq) <= _FEW and self.caches_released_blocks:
            zero = np.array(release_one_each(self, uniq.tolist()), dtype=np.int64)
        else:
            after = self.block_ref_counts[uniq] - 1 if after is None else after
            self.block_ref_counts[uniq] = after
            zero = uniq[after == 0]
            registered = self.block_hashes[zero] != -1
            self._free.push(zero[~registered])
            if not self.caches_released_blocks and registered.any():
                notify(self._observers, *self._deregister(zero[registered]))
            elif self.caches_released_blocks:
                cached = zero[registered]
                self._leaves.add(cached[self._forest.child_counts[cached] == 0],
                                 self.block_timestamps)
        if len(zero):
            notify(self._released_observers, zero, self.block_timestamps)

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
        ids = block_id_array("block_ids", block_ids, self._num_blocks)
        hs = hash_array("hashes", hashes, ids.shape[0])
        ps = np.zeros_like(hs) if parent_hashes is None else \
            hash_array("parent_hashes", parent_hashes, ids.shape[0])
        self._register_new_blocks(*self._forest.plan_registration(ids, hs, ps,
                                                                  self.block_ref_counts))

    def _register_new_blocks(self, block_ids, hashes, parent_hashes, likely_parents=None) -> None:
        """:meth:`register_kv_block_hashes` unchecked (distinct used unregistered blocks, distinct
        new positive hashes; int64 arrays); ``likely_parents``: see :meth:`BlockForest.link`."""
        if self.enable_prefix_caching:      # the parents gained a child: no leaves
            self._forest.link(block_ids, hashes, parent_hashes, likely_parents)
            self._leaves.discard((parents := self._forest.parent_ids[block_ids])[parents >= 0])

    def _register_listed(self, block_ids: list, hashes: list, parent_hashes: list) -> int:
        """:meth:`BlockForest.link_new` (prefix caching on); returns how many it registered."""
        registered, parents = self._forest.link_new(block_ids, hashes, parent_hashes)
        self._leaves.discard(parents)       # they gained a child: no leaves
        return registered

    def evict_lru_blocks(self, n: int) -> bool:
        """Deregister and free ``n`` cached blocks, peeling leaves oldest first (ties by id).
        Returns True when ``n`` blocks were evicted; False (nothing changed) when fewer than
        ``n`` are evictable."""
        n = as_int("n", n)
        if n == 0 or not self.caches_released_blocks:
            return n == 0
        victims = self._peel(n)
        if victims is not None:
            notify(self._observers, *self._deregister(victims))
        return victims is not None

    def reset(self) -> None:
        """Free every block, clear hashes, counts and the clock; observers stay (only release
        observers are called: every block is at ref count 0)."""
        self._free.reset()
        self.block_ref_counts.fill(0)
        self.block_timestamps.fill(0)
        self._forest.reset()
        self._leaves.reset()
        self._clock = 0
        notify(self._released_observers, np.arange(self._num_blocks), self.block_timestamps)

    # --- internals ----------------------------------------------------------------------

    def _kept(self, retained) -> tuple:
        return () if retained is None else tuple(block_id_array(
            "retained", retained, self._num_blocks).tolist())

    def _peel(self, n: int, keep=(), commit: bool = True) -> list | None:
        """The first ``n`` victims (a list) of leaf peeling, keeping ``keep`` and the blocks the
        backlog will link to (:meth:`EvictableLeaves.peel`), or None."""
        pinned = () if self.pending_parents is None else self.pending_parents()
        keep = set(keep).union(pinned.tolist()) if len(pinned) else set(keep) if keep else ()
        forest, views = self._forest._scalars, self._scalars
        return self._leaves.peel(n, forest.parent_ids, forest.child_counts, views.refs,
                                 views.stamps, keep, commit)

    def _deregister(self, ids):
        """Unregister and free unique registered ``ids`` (a peel's list, or int64); returns the
        observer arguments ``(ids_list, hashes_set)``, to pass once the caller's call commits."""
        if self.deregistering is not None:
            self.deregistering(ids)
        if type(ids) is list and len(ids) <= _LISTED:   # a step's few victims: one by one
            return ids, deregister_peeled(self, ids)
        ids = np.asarray(ids, dtype=np.int64)
        hashes, childless = self._forest.unlink(ids)
        self.block_ref_counts[ids] = self.block_timestamps[ids] = 0
        self._free.push(ids)
        if self.caches_released_blocks:     # parents left childless at ref count 0: leaves
            self._leaves.discard(ids)
            if len(childless):
                self._leaves.add(childless[self.block_ref_counts[childless] == 0],
                                 self.block_timestamps)
        return ids.tolist(), hashes

    # --- checks -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Verify the bookkeeping; raise RuntimeError listing every broken invariant (see the
        module docstring). Reads only."""
        errors = broken_kv_block_invariants(self, self._free.ids, self._free.top, self._forest,
                                            self._leaves)
        if errors:
            raise RuntimeError("KVBlockAllocator invariants broken:\n  " + "\n  ".join(errors))
