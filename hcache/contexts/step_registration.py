"""A serving step's completed blocks, registered at once on Python lists (docs/design.md §6.8,
issue 24).

With an empty backlog, :meth:`~.block_registration.BlockRegistration.commit` registers a small
step's completed blocks at once: the prompt blocks (hashed at admission) first, then the others,
hashed now. A serving step completes a few dozen blocks, where each NumPy call on a tiny array
costs more than the Python work on its items, so :func:`register_step` does the usual such step
(prompt rows, and rows that complete one block each, hashed through the block before it) on
lists, with one hashing pass and one registration. It declines any other step, changing nothing,
and the general path does it (``tests/test_step_registration.py`` runs both side by side).

A step that grows at most :data:`FEW_ROWS` rows (every serving step: 0-3 rows at block 256,
~16 at block 16) is done row by row on Python scalars (:func:`_register_few`: one SHA-256 per
block through :meth:`RequestTable.hash_next_listed`, reads and writes through the table's kept
memoryviews), a lockstep step's hundreds of rows on lists and arrays; both leave the same
hashes, digests, row counts and registrations (tested against each other and against the
general path).
"""

from __future__ import annotations

import numpy as np

__all__ = ["register_step"]

# A step growing at most this many rows is done on Python scalars, row by row: below it a NumPy
# call on the step's few elements costs more than the Python work on them (measured in-process
# against the list path at blocks 16 to 256).
FEW_ROWS = 32
# Up to this many rows, their row, counts and hashed count are read one by one (``.item()``);
# more are gathered (four gathers and lists).
READ_ROWS = 4


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
    if len(grew) <= FEW_ROWS and not requests.has_pending_keys:
        return _register_few(requests, kv_block_allocator, rows, first, upto, grew, limit)
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
        _prompt_blocks(table, chained, int(rows[i]), first_l[i], upto_l[i], ids, hashes, parents)
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


def _register_few(requests, kv_block_allocator, rows, first, upto, grew, limit) -> int | None:
    """:func:`register_step` of the rows ``rows[grew]`` (``first``: their registered blocks,
    ``upto``: their complete blocks after the step) on Python scalars: the same hashes,
    registrations and row counts, in the same order (prompt rows first, then the others), or
    None, having changed nothing, for a step it leaves to the general path."""
    now, later = [], []     # prompt rows (hashed), rows completing their next block
    if len(grew) > READ_ROWS:
        rows, upto = rows[grew], upto[grew]
        rows_l, first_l, upto_l = rows.tolist(), first[grew].tolist(), upto.tolist()
        hashed_l = requests.hashed[rows].tolist()
        if hashed_l == first_l and upto_l == [f + 1 for f in first_l]:     # (decode only)
            later = list(zip(rows_l, first_l))
            grown = ()
        else:
            grown = zip(rows_l, first_l, upto_l, hashed_l)
    else:
        grown = _read(rows, first, upto, grew.tolist(), requests.hashed)
    for r, f, u, h in grown:
        if h >= u:
            now.append((r, f, u))
        elif h == f == u - 1:
            later.append((r, f))
        else:
            return None
    if limit is not None and len(later) > limit:
        return None
    ids, hashes, parents = [], [], []
    for r, f, u in now:
        _prompt_blocks(requests.request_to_kv_block_ids, requests.hashes, r, f, u, ids, hashes,
                       parents)
    if later:
        requests.hash_next_listed(later, ids, hashes, parents)
    registered = requests.registered
    if len(grew) > READ_ROWS:
        registered[rows] = upto
    else:
        for r, _, u in now:
            registered[r] = u
        for r, f in later:
            registered[r] = f + 1
    return kv_block_allocator._register_listed(ids, hashes, parents)


def _prompt_blocks(table, chained, row, first, upto, ids, hashes, parents) -> None:
    """Append to ``ids``, ``hashes`` and ``parents`` the blocks ``[first, upto)`` of ``row``,
    hashed at admission, their hashes and their parents' (a chain root's: 0)."""
    ids += table[row, first:upto].tolist()
    if first:
        listed = chained[row, first - 1:upto].tolist()
        hashes += listed[1:]
        parents += listed[:-1]
    else:
        hashes += chained[row, :upto].tolist()
        parents += [0] + hashes[len(hashes) - upto:-1]


def _read(rows, first, upto, grew: list, hashed) -> list:
    """``(row, first, upto, hashed)`` of each row ``rows[i]``, ``i`` in ``grew``, read one by
    one as Python ints."""
    out = []
    for i in grew:
        r = rows.item(i)
        out.append((r, first.item(i), upto.item(i), hashed.item(r)))
    return out
