"""Which blocks of a registration backlog will stay private (docs/design.md §6.8).

A block in the backlog (:mod:`~hcache.contexts.block_registration`) is not hashed yet, so whether
registering it will find its hash taken (a duplicate, which stays private, links to nothing and
keeps no Mamba state) is unknown until it is hashed. Eviction and a Mamba slot shortage need to
know it at once; these functions find the blocks that could be duplicates without hashing the
others, then hash and classify those. Functions of explicit inputs (the caller's tables).
"""

from __future__ import annotations

import numpy as np

from .token_batches import ragged_columns

__all__ = ["PendingParents", "entangled_rows", "backlog_blocks", "mark_rows_of", "prune_dropped"]

_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False


class PendingParents:
    """What :attr:`KVBlockAllocator.pending_parents` calls: ``registration.pending_parents()``
    (a shared empty array, read only, while nothing is queued); its :meth:`deregistering` is the
    allocator's ``deregistering``. A copy of the allocator (``copy.deepcopy``, pickle) keeps a
    snapshot of them, detached from the context."""

    def __init__(self, registration=None, snapshot=None):
        self._registration, self._snapshot = registration, snapshot

    def __call__(self) -> np.ndarray:
        registration = self._registration
        if registration is None:
            return self._snapshot
        return registration.pending_parents() if registration.queued else _NONE

    def deregistering(self, block_ids) -> None:
        """``registration.deregistering`` of ``block_ids`` (a list or int64), while queued."""
        registration = self._registration
        if registration is not None and registration.queued:
            registration.deregistering(np.asarray(block_ids, dtype=np.int64))

    def __reduce__(self):
        return (PendingParents, (None, self()))


def mark_rows_of(block_ids: np.ndarray, requests, forest, marked: np.ndarray,
                 scratch: np.ndarray) -> None:
    """Before registered ``block_ids`` (int64, links intact in ``forest``) are deregistered,
    mark in ``marked`` (``bool [max_requests]``) every backlog row a block of which their
    hashes could make private (a duplicate of a block dropped after it completed).

    Without a dangling root, a registered block duplicating a backlog block of a row descends
    from that row's last registered block ``L`` (its chain of parents holds the row's hashes
    down to ``L``'s), so ``L`` keeps a child while any such block is registered (the row is
    entangled) and loses one at the drop that ends it: the rows whose ``L`` is a parent of a
    block of ``block_ids`` are marked. With a dangling root in the forest, every backlog row.
    ``scratch`` (``bool [num_blocks]``, all False) is used and left all False.
    """
    done = requests.registered
    rows = np.flatnonzero(done < requests.computed // requests.block_size)
    if forest.num_dangling:
        marked[rows] = True
        return
    parents = forest.parent_ids[block_ids]
    parents = parents[parents >= 0]
    k = done[rows]
    rows, k = rows[k > 0], k[k > 0]
    if len(parents) and len(rows):
        scratch[parents] = True
        marked[rows[scratch[requests.request_to_kv_block_ids[rows, k - 1]]]] = True
        scratch[parents] = False


def entangled_rows(requests, kv_block_allocator, dropped: bool, limit: int,
                   marked=None) -> np.ndarray:
    """``bool [max_requests]``: the backlog rows whose blocks could duplicate another block.

    A backlog block duplicates one only if its row's last registered block is not its own
    registered block (private, or none yet), is shared, or has a registered child (from a row
    with the same prefix), or if another such row has the same prefix through its own last
    registered block, or if a hash was deregistered meanwhile: ``dropped`` (then every backlog
    row, as when more than ``limit`` rows qualify), or the rows of ``marked`` (``bool
    [max_requests]``, :func:`mark_rows_of`; cleared here for rows without a backlog).
    """
    kv, done = kv_block_allocator, requests.registered
    out = done < requests.computed // requests.block_size
    if marked is not None:
        marked &= out
    if dropped or not out.any():
        return out
    rows = np.flatnonzero(out)
    k = done[rows]
    last = np.maximum(k - 1, 0)
    blocks, hashes = requests.request_to_kv_block_ids[rows, last], requests.hashes[rows, last]
    odd = (k == 0) | (kv.block_hashes[blocks] != hashes) \
        | (kv.block_ref_counts[blocks] > 1) | (kv.block_child_counts[blocks] > 0)
    if marked is not None:
        odd |= marked[rows]
    if np.count_nonzero(odd) > limit:
        return out
    ends = np.flatnonzero(odd & (k > 0))    # rows sharing a prefix with one: [odd, row]
    if len(ends):
        c = np.minimum(k, k[ends, None]) - 1
        same = requests.hashes[rows, c] == requests.hashes[rows[ends, None], c]
        odd |= (k > 0) & same.any(axis=0)
    out[rows[~odd]] = False
    return out


def backlog_blocks(queue, requests, kv_hash_to_block_id: dict, dropped: dict,
                   entangled: np.ndarray):
    """The blocks of the ``entangled`` rows in the backlog ``queue``, hashed now.

    Parameters
    ----------
    queue : iterable of (rows, upto, counts or None, commit)
        The backlog's entries, in registration order.
    requests : RequestTable
        Its rows are hashed through their entries (each block once).
    kv_hash_to_block_id : dict
    dropped : dict[int, int]
        Hash -> the commit count when it was last deregistered.
    entangled : bool [max_requests]
        The rows to consider (:func:`entangled_rows`); any other backlog block will register,
        and its predecessor is its row's own used block.

    Returns
    -------
    (int64 [m], int64 [m], int64 [m], int64 [m], bool [m])
        ``rows``, ``columns``, ``blocks``, ``hashes`` and ``private``: a duplicate of a
        registered block, of an earlier backlog block, or of a block dropped since it completed.
    """
    parts = []
    for rows, upto, counts, commit in queue:
        keep = entangled[rows]
        if not keep.all():
            rows, upto = rows[keep], upto[keep]
            counts = None if counts is None else counts[keep]
        if not len(rows):
            continue
        requests.hash_through(rows, upto)
        if counts is None:
            owners, cols = rows, upto - 1
        else:
            which, cols = ragged_columns(upto - counts, counts)
            owners = rows[which]
        parts.append((owners, cols, np.full(len(cols), commit)))
    if not parts:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty, empty, np.zeros(0, bool)
    owners, cols, commits = (np.concatenate(x) for x in zip(*parts))
    hashes = requests.hashes[owners, cols]
    listed, seen = hashes.tolist(), {}
    private = np.fromiter((h in kv_hash_to_block_id or seen.setdefault(h, i) != i
                           or dropped.get(h, -1) >= c
                           for i, (h, c) in enumerate(zip(listed, commits.tolist()))),
                          bool, len(listed))
    blocks = requests.request_to_kv_block_ids[owners, cols].astype(np.int64)
    return owners, cols, blocks, hashes, private


def prune_dropped(log, dropped: dict, oldest: int) -> None:
    """Forget the hashes last deregistered before commit ``oldest``, the oldest queued entry's:
    a drop counts only for blocks that completed at or before it, and no block queued now or
    later completed earlier (tested against ``prune_dropped=False``).

    Parameters
    ----------
    log : deque of (int, list of int)
        ``(commit count, hashes)`` of each deregistration, oldest first; pruned in place.
    dropped : dict[int, int]
        Hash -> the commit count when it was last deregistered; pruned in place.
    oldest : int
    """
    while log and log[0][0] < oldest:
        commit, hashes = log.popleft()
        for h in hashes:
            if dropped.get(h) == commit:     # not deregistered again since
                del dropped[h]
