"""The registered KV blocks: their prefix hashes, the hash map and the parent forest (docs/design.md
§6); the leaf-peeling eviction order over it is kept by
:class:`~hcache.contexts.evictable_leaves.EvictableLeaves`.

A registered block holds a positive hash; ``hash_to_block`` is the inverse of ``hashes`` on
registered blocks. Registered blocks form a forest through their parent links: a block's parent
is the block that held its parent hash when it was registered. Invariants (checked by
:meth:`BlockForest.broken_invariants`):

- a parent link always points at a registered block, and links point backwards in registration
  order, so the forest is acyclic; ``child_counts`` counts each block's registered children;
- eviction removes leaves only (oldest timestamp first, ties by block id), so a cached block's
  ancestors stay cached and a prefix match scanned along a hash chain never meets a hole;
- a cached block with an in-use descendant is not evictable (peeling cannot reach it);
- unlinking a block orphans its registered children, so no link dangles; ``dangling`` marks
  the registered roots whose chain continues a predecessor (``num_dangling`` counts them).

Ref counts and timestamps belong to :class:`~hcache.contexts.KVBlockAllocator`, which passes
them in where the forest needs them.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from .block_id_sets import counted
from .forest_invariants import broken_forest_invariants
from .scalar_views import ScalarViews

__all__ = ["BlockForest"]

# Up to this many ids, unlink works element by element (cheaper than NumPy calls on tiny arrays).
_SCALAR = 8
# link_new links up to this many entries one by one, through kept memoryviews: a step's decoded
# blocks and its admitted prompts' (~40-100 each at block 16) cost less so than in arrays
# (same-process A/B at block 16: steps with an admission 0.96x against 24).
_FEW_LINKS = 128


class BlockForest:
    """Hashes, hash map and parent forest of the registered blocks among ``num_blocks``.

    Attributes
    ----------
    hashes : int64 [num_blocks]
        Hash of each block; -1 = unregistered.
    hash_to_block : dict[int, int]
        Registered hash -> block id.
    parent_ids : int32 [num_blocks]
        Registered parent of each registered block; -1 = none.
    parent_hashes : int64 [num_blocks]
        Hash of that parent; 0 = no parent.
    child_counts : int32 [num_blocks]
        Number of registered blocks whose parent is this block.
    dangling : bool [num_blocks], num_dangling : int
        Registered roots whose chain has a predecessor (a parent hash no block held when they
        linked, or an unlinked parent): a chain can be registered below its own head.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.hashes = np.empty(num_blocks, dtype=np.int64)
        self.hash_to_block: dict[int, int] = {}
        self.parent_ids = np.empty(num_blocks, dtype=np.int32)
        self.parent_hashes = np.empty(num_blocks, dtype=np.int64)
        self.child_counts = np.empty(num_blocks, dtype=np.int32)
        self.dangling = np.empty(num_blocks, dtype=bool)
        self._scalars = ScalarViews(hashes=self.hashes, parent_ids=self.parent_ids,
                                    parent_hashes=self.parent_hashes,
                                    child_counts=self.child_counts, dangling=self.dangling)
        self.reset()

    def reset(self) -> None:
        """Unregister every block."""
        self.hashes.fill(-1)
        self.hash_to_block.clear()
        self.parent_ids.fill(-1)
        self.parent_hashes.fill(0)
        self.child_counts.fill(0)
        self.dangling.fill(False)
        self.num_dangling = 0

    @property
    def registered(self) -> np.ndarray:
        """``bool [num_blocks]``: blocks holding a hash."""
        return self.hashes != -1

    # --- registration -------------------------------------------------------------------

    def plan_registration(self, block_ids: np.ndarray, hashes: np.ndarray,
                          parent_hashes: np.ndarray, ref_counts: np.ndarray):
        """Validate a registration batch and return the blocks it registers.

        Parameters
        ----------
        block_ids, hashes, parent_hashes : int64 [n]
            Checked ids in range, and int64 hashes (0 parent hash = no parent).
        ref_counts : int32 [num_blocks]
            The allocator's ref counts: a block to register must be in use.

        Returns
        -------
        (int64 [m], int64 [m], int64 [m])
            Block ids, hashes and parent hashes of the unregistered blocks, first occurrence
            first; blocks already holding the same hash are left out.

        Raises
        ------
        ValueError
            A hash is not positive, a registered block would get a different hash, a block is
            free, a block gets two hashes, or a hash is held by another block.
        """
        if (hashes <= 0).any():
            raise ValueError(f"hashes: expected positive hashes, "
                             f"got {int(hashes[hashes <= 0][0])}")
        current = self.hashes[block_ids]
        clash = (current != -1) & (current != hashes)
        if clash.any():
            i = int(np.argmax(clash))
            raise ValueError(f"block_ids: expected block {int(block_ids[i])} re-registered under "
                             f"its hash {int(current[i])}, got a different hash {int(hashes[i])}")
        free = (current == -1) & (ref_counts[block_ids] == 0)
        if free.any():
            raise ValueError(f"block_ids: expected blocks in use, got free block "
                             f"{int(block_ids[free][0])}")
        new = current == -1
        ids, hs, ps = block_ids[new], hashes[new], parent_hashes[new]
        ids_list, hs_list = ids.tolist(), hs.tolist()
        if len(set(ids_list)) < len(ids_list) or len(set(hs_list)) < len(hs_list):
            return self._plan_repeats(ids_list, hs_list, ps.tolist())
        # Every block is unregistered, so a hash already in the map is another block's.
        held = self.hash_to_block.keys() & hs_list
        if held:
            h = next(h for h in hs_list if h in held)
            raise ValueError(f"hashes: expected hash {h} to be free, got it held by block "
                             f"{self.hash_to_block[h]} while registering block "
                             f"{ids_list[hs_list.index(h)]}")
        return ids, hs, ps

    def _plan_repeats(self, ids: list, hashes: list, parents: list):
        """:meth:`plan_registration` of unregistered blocks some of which, or some of whose
        hashes, repeat: a repeated pair counts once, any other repeat is an error."""
        pending: dict[int, tuple[int, int]] = {}   # block -> (hash, parent hash), first seen
        claimed: dict[int, int] = {}               # hash -> block
        for b, h, p in zip(ids, hashes, parents, strict=True):
            if pending.setdefault(b, (h, p))[0] != h:
                raise ValueError(f"hashes: expected one hash for block {b}, "
                                 f"got {pending[b][0]} and {h}")
            holder = claimed.setdefault(h, self.hash_to_block.get(h, b))
            if holder != b:
                raise ValueError(f"hashes: expected hash {h} to be free, got it held by block "
                                 f"{holder} while registering block {b}")
        return (np.fromiter(pending, np.int64, len(pending)),
                np.array([h for h, _ in pending.values()], np.int64).reshape(-1),
                np.array([p for _, p in pending.values()], np.int64).reshape(-1))

    def link(self, block_ids: np.ndarray, hashes: np.ndarray, parent_hashes: np.ndarray,
             likely_parents: np.ndarray | None = None) -> None:
        """Register distinct unregistered ``block_ids`` under distinct free ``hashes`` (a
        :meth:`plan_registration` result) and link each to its parent: the block holding its
        parent hash before this call or earlier in the batch (0, or any other, means none).
        ``likely_parents`` (int64 block ids, optional) are checked guesses of the parents (a
        row's previous block, registered or the batch's previous entry): only the others are
        looked up by hash."""
        n = len(block_ids)
        if n == 0:
            return
        hs_list = hashes.tolist()
        if likely_parents is None:
            parents = np.fromiter(map(self.hash_to_block.get, parent_hashes.tolist(),
                                      repeat(-1)), np.int64, n)
        else:
            found = self.hashes[likely_parents] == parent_hashes     # registered before
            previous_entry = (likely_parents[1:] == block_ids[:-1]) \
                & (hashes[:-1] == parent_hashes[1:])                   # or just before it here
            found[1:] |= previous_entry
            parents = np.where(found, likely_parents, -1)
        unresolved = ((parents < 0) & (parent_hashes > 0)).nonzero()[0]
        if len(unresolved) and likely_parents is not None:
            parents[unresolved] = np.fromiter(map(self.hash_to_block.get,
                                                  parent_hashes[unresolved].tolist(), repeat(-1)),
                                              np.int64, len(unresolved))
            unresolved = unresolved[parents[unresolved] < 0]
        if len(unresolved):
            # A parent earlier in the batch; parents resolve backwards in registration order
            # only, so the forest stays acyclic.
            position = dict(zip(hs_list, range(n)))
            earlier = np.fromiter(map(position.get, parent_hashes[unresolved].tolist(),
                                      repeat(n)), np.int64, len(unresolved))
            back = earlier < unresolved
            parents[unresolved[back]] = block_ids[earlier[back]]
            unresolved = unresolved[~back]
        if len(unresolved):     # parent hashes no block holds: dangling roots
            self.dangling[block_ids[unresolved]] = True
            self.num_dangling += len(unresolved)
        self.hash_to_block.update(zip(hs_list, block_ids.tolist()))
        self.hashes[block_ids] = hashes
        has_parent = parents >= 0
        self.parent_ids[block_ids] = parents
        self.parent_hashes[block_ids] = np.where(has_parent, parent_hashes, 0)
        linked, counts = counted(parents[has_parent])     # siblings in the batch count each
        self.child_counts[linked] += counts.astype(np.int32)

    def link_new(self, block_ids: list, hashes: list, parent_hashes: list):
        """:meth:`link` of lists, for the few blocks of a serving step, leaving out each entry
        whose hash a block holds (before this call or earlier in the lists: the first holder
        keeps it, the others stay private). ``block_ids``: distinct unregistered blocks.
        Returns how many it registered and the parents that gained a child, a parent once per
        child in entry order (int64; a list of int for up to ``_FEW_LINKS`` entries)."""
        if len(block_ids) <= _FEW_LINKS:
            return self._link_few(block_ids, hashes, parent_hashes)
        held = self.hash_to_block
        # The first holder keeps a hash: each entry claims its hash unless held (one lookup).
        holders = list(map(held.setdefault, hashes, block_ids))
        if holders == block_ids:      # every hash new (the usual step)
            ids, hs, phs = block_ids, hashes, parent_hashes
        else:
            kept = [i for i, (b, h) in enumerate(zip(block_ids, holders)) if b == h]
            if not kept:
                return 0, np.zeros(0, np.int64)
            ids, hs, phs = ([x[i] for i in kept] for x in (block_ids, hashes, parent_hashes))
        # A parent held before this call, or by an earlier entry (links point backwards only):
        # the previous entry when it holds the parent hash (a prompt's chain), else by hash.
        parents = [ids[i - 1] if i and ph == hs[i - 1] else -2 for i, ph in enumerate(phs)]
        looked = [i for i, p in enumerate(parents) if p == -2]
        every = len(looked) == len(parents)
        found = list(map(held.get, phs if every else [phs[i] for i in looked], repeat(-1)))
        if not set(found).isdisjoint(ids):
            at = dict(zip(ids, range(len(ids))))
            found = [-1 if at.get(p, -1) >= i else p for i, p in zip(looked, found)]
        if every:
            parents = found
        else:
            for i, p in zip(looked, found):
                parents[i] = p
        distinct = set(parents)
        at = np.array(ids, np.int64)
        self.hashes[at] = hs
        self.parent_ids[at] = parents
        linked, orphans = np.array(parents, np.int64), -1 in parents
        if orphans:
            orphan = linked < 0
            phs = np.array(phs, np.int64)
            dangling = at[orphan & (phs > 0)]
            phs[orphan] = 0
            self.dangling[dangling] = True
            self.num_dangling += len(dangling)
            linked = linked[~orphan]
        self.parent_hashes[at] = phs
        if len(distinct) - orphans == len(linked):
            self.child_counts[linked] += 1
        else:       # siblings count each
            np.add.at(self.child_counts, linked, 1)
        return len(ids), linked

    def _link_few(self, block_ids: list, hashes: list, parent_hashes: list):
        """:meth:`link_new` entry by entry: each looks its parent up before it claims its hash
        (a parent held before this call or by an earlier entry, as links point backwards)."""
        held, linked, skipped = self.hash_to_block, [], 0
        views = self._scalars
        own, parent_ids, parents_held, counts = (views.hashes, views.parent_ids,
                                                 views.parent_hashes, views.child_counts)
        for b, h, ph in zip(block_ids, hashes, parent_hashes):
            p = held.get(ph, -1)
            if held.setdefault(h, b) != b:
                skipped += 1
                continue        # held: the block stays private
            own[b], parent_ids[b] = h, p
            if p >= 0:
                parents_held[b] = ph
                counts[p] += 1
                linked.append(p)
            else:
                parents_held[b] = 0
                if ph > 0:
                    views.dangling[b] = True
                    self.num_dangling += 1
        return len(block_ids) - skipped, linked

    def unlink(self, block_ids: np.ndarray) -> tuple[set, np.ndarray]:
        """Unregister unique registered ``block_ids``, orphaning their children; returns their
        former hashes and the registered blocks they left childless (int64, ascending)."""
        if len(block_ids) <= _SCALAR:
            return self._unlink_scalar(block_ids)
        hashes = self.hashes[block_ids].tolist()
        for h in hashes:
            del self.hash_to_block[h]
        parents = self.parent_ids[block_ids]
        parents, lost = counted(parents[parents >= 0].astype(np.int64))
        self.child_counts[parents] -= lost.astype(np.int32)
        # Children outside the batch exist only under a block still counting some: a peel
        # unlinks whole subtrees, so the scan of every link is for other deregistrations.
        if self.num_dangling or np.count_nonzero(self.child_counts[block_ids]):
            self._orphan(block_ids)
        self.parent_ids[block_ids] = -1
        self.parent_hashes[block_ids] = 0
        self.child_counts[block_ids] = 0
        self.hashes[block_ids] = -1
        return set(hashes), parents[(self.hashes[parents] != -1)
                                    & (self.child_counts[parents] == 0)]

    def _unlink_scalar(self, block_ids: np.ndarray) -> tuple[set, np.ndarray]:
        """:meth:`unlink` of a few blocks, element by element."""
        gone, childless = self.unlink_listed(block_ids.tolist())
        return gone, np.array(childless, np.int64)

    def unlink_listed(self, block_ids: list) -> tuple[set, list]:
        """:meth:`unlink` of a list of ids, element by element in one pass (for the few victims
        of a serving step): their former hashes, and the registered blocks they left childless
        (ascending, a list)."""
        views, mapped = self._scalars, self.hash_to_block
        hashes, parents, counts = views.hashes, views.parent_ids, views.child_counts
        parent_hashes = views.parent_hashes
        dangling = views.dangling if self.num_dangling else None
        batch, gone, childless = set(block_ids), set(), []
        inside = counted_children = 0       # links within the batch; children its blocks count
        for b in block_ids:
            h = hashes[b]
            del mapped[h]
            gone.add(h)
            p = parents[b]
            if p in batch:      # (a parent in the batch keeps its count: it is zeroed whole)
                inside += 1
            elif p >= 0:        # (registered: a link points at a registered block)
                left = counts[p] - 1
                counts[p] = left
                if not left:
                    childless.append(p)
            counted_children += counts[b]
            hashes[b] = parents[b] = -1
            parent_hashes[b] = counts[b] = 0
            if dangling is not None and dangling[b]:
                dangling[b] = 0
                self.num_dangling -= 1
        if counted_children != inside:      # children outside the batch: orphans now
            self._orphan_children(np.array(block_ids, np.int64))
        if len(childless) > 1:
            childless.sort()
        return gone, childless

    def _orphan(self, block_ids: np.ndarray) -> None:
        """Cut the links of the children of ``block_ids`` outside them (a peel unlinks whole
        subtrees: these are other deregistrations), making them dangling roots; the blocks
        themselves stop dangling."""
        if np.count_nonzero(self.child_counts[block_ids]):
            self._orphan_children(block_ids)
        if self.num_dangling:
            gone = self.dangling[block_ids]
            self.dangling[block_ids] = False
            self.num_dangling -= int(np.count_nonzero(gone))

    def _orphan_children(self, block_ids: np.ndarray) -> None:
        """Make the blocks linked to ``block_ids`` dangling roots."""
        orphans = np.isin(self.parent_ids, block_ids)
        self.parent_ids[orphans] = -1
        self.parent_hashes[orphans] = 0
        self.dangling[orphans] = True       # linked until now: not dangling before
        self.num_dangling += int(np.count_nonzero(orphans))

    # --- eviction order -----------------------------------------------------------------

    def evictable_mask(self, ref_counts: np.ndarray, pinned=None) -> np.ndarray:
        """``bool [num_blocks]``: cached blocks (registered, ref count 0) with no used
        descendant, exactly the blocks leaf peeling can reach. ``pinned`` (int64, optional):
        registered blocks that also count as parents of used blocks (of blocks whose
        registration is deferred)."""
        registered = self.registered
        used = ref_counts > 0
        cached = registered & ~used
        if not cached.any():
            return np.zeros(self.num_blocks, dtype=bool)
        blocked = np.zeros(self.num_blocks, dtype=bool)
        parents = self.parent_ids[registered & used]
        if pinned is not None and len(pinned):
            parents = np.concatenate([parents, pinned])
        # Walk up from used blocks through cached ancestors only; a request normally holds its
        # whole chain, so this loop usually stops after one round.
        while parents.size:
            parents = parents[parents >= 0]
            parents = np.unique(parents[cached[parents] & ~blocked[parents]])
            blocked[parents] = True
            parents = self.parent_ids[parents]
        return cached & ~blocked

    # --- checks -------------------------------------------------------------------------

    def broken_invariants(self) -> list[str]:
        """Every broken invariant of the hashes, the hash map and the forest (see the module
        docstring); empty when all hold. Reads only (:mod:`~.forest_invariants`)."""
        return broken_forest_invariants(self)
