"""A serving step's completed blocks, registered at once on Python lists (docs/design.md §6.8,
issue 24).

With an empty backlog, :meth:`~.block_registration.BlockRegistration.commit` registers a small
step's completed blocks at once: the prompt blocks (hashed at admission) first, then the others,
hashed now. A serving step completes a few dozen blocks, where each NumPy call on a tiny array
costs more than the Python work on its items, so :func:`register_step` does the usual such step
(prompt rows, and rows that complete one block each, hashed through the block before it) on
lists, with one hashing pass and one registration. It declines any other step, changing nothing,
and the general path does it (``tests/test_step_registration.py`` runs both side by side).
"""

from __future__ import annotations

import numpy as np

__all__ = ["register_step"]


def register_step(requests, kv_block_allocator, rows, ends, limit) -> int | None:
    """Register the blocks that the step of ``rows`` completed, as the general path would with
    an empty backlog: in that order, a hash held before or earlier in the step left to its
    holder (the block stays private), every row's ``registered`` advanced.

    Parameters
    ----------
    requests : RequestTable
    kv_block_allocator : KVBlockAllocator
    rows, ends : int64 [n]
        The step's rows, ascending, and their computed tokens after it (before it: at most
        their registered blocks', the backlog being empty).
    limit : int or None
        The most blocks a step may hash now; a step with more queues them (the general path).

    Returns
    -------
    int or None
        How many blocks it registered; None (nothing changed) for a step it leaves to the
        general path.
    """
    bs = requests.block_size
    upto = ends // bs
    first = requests.registered[rows]
    grew = (upto > first).nonzero()[0]
    if not len(grew):
        return 0
    rows, first, upto = rows[grew], first[grew], upto[grew]
    first_l, upto_l, hashed_l = first.tolist(), upto.tolist(), requests.hashed[rows].tolist()
    now, later = [], []     # prompt rows (hashed), rows completing their next block
    if hashed_l == first_l and upto_l == [f + 1 for f in first_l]:
        later = first_l     # (all)
    else:
        for i, (f, h, u) in enumerate(zip(first_l, hashed_l, upto_l)):
            if h >= u:
                now.append(i)
            elif h == f == u - 1:
                later.append(i)
            else:
                return None
    if limit is not None and len(later) > limit:
        return None
    table, chained = requests.request_to_kv_block_ids, requests.hashes
    ids, hashes, parents = [], [], []
    for i in now:
        r, f, u = int(rows[i]), first_l[i], upto_l[i]
        ids += table[r, f:u].tolist()
        if f:
            listed = chained[r, f - 1:u].tolist()
            hashes += listed[1:]
            parents += listed[:-1]
        else:
            hashes += chained[r, :u].tolist()
            parents += [0] + hashes[len(hashes) - u:-1]
    if later:
        if now:
            later = np.array(later)
            lrows, cols, first_l = rows[later], first[later], first[later].tolist()
        else:
            lrows, cols = rows, first
        ids += table[lrows, cols].tolist()
        listed, roots = requests.hash_next(lrows, cols)     # roots: the previous blocks'
        hashes += listed
        parents += roots if all(first_l) else [p if c else 0 for p, c in zip(roots, first_l)]
    registered = kv_block_allocator._register_listed(ids, hashes, parents)
    requests.registered[rows] = upto
    return registered
