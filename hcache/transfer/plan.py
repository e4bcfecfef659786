"""Which bytes move where: matching the units of two slot layouts and merging them into few
transfer descriptors (docs/design.md, "Transfer between engines")."""

from __future__ import annotations

import numpy as np

from .layout import check_compatible, slot_units

__all__ = ["plan_pull", "plan_push", "merge_ranges"]


def merge_ranges(local, remote, nbytes, *, merge: bool = True) -> np.ndarray:
    """Merge pairs of ranges that continue each other on both sides.

    Parameters
    ----------
    local, remote, nbytes : sequences of int, length n
        Pair ``i`` moves ``nbytes[i]`` bytes between ``local[i]`` and ``remote[i]``.

    Returns
    -------
    numpy.ndarray int64 [m, 3]
        Rows ``(local, remote, nbytes)``, sorted by ``local``, ``m <= n``; pair ``i + 1``
        joins pair ``i`` exactly when both of its addresses start where pair ``i``'s end
        (never with ``merge=False``: one row per pair, the baseline of the bench).
    """
    rows = np.array([local, remote, nbytes], dtype=np.int64).T.reshape(-1, 3)
    rows = rows[rows[:, 2] > 0]
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    if len(rows) < 2 or not merge:
        return rows
    joins = ((rows[1:, 0] == rows[:-1, 0] + rows[:-1, 2])
             & (rows[1:, 1] == rows[:-1, 1] + rows[:-1, 2]))
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    sizes = np.add.reduceat(rows[:, 2], starts)
    return np.stack([rows[starts, 0], rows[starts, 1], sizes], axis=1)


def _pairs(local_units, remote_units, keys, merge=True):
    local, remote, nbytes = [], [], []
    for key in keys:
        (la, ln), (ra, rn) = local_units[key], remote_units[key]
        if ln != rn:
            raise ValueError(f"layout: expected {ln} bytes for {key}, got {rn} on the peer "
                             f"(head or state shapes differ)")
        local.append(la)
        remote.append(ra)
        nbytes.append(ln)
    return merge_ranges(local, remote, nbytes, merge=merge)


def plan_pull(local: dict, slot: int, sources: list, length: int, *, merge=True) -> list:
    """Descriptors that fill ``slot`` of layout ``local`` from ``sources``.

    Parameters
    ----------
    local : dict
        This side's layout (:func:`~hcache.transfer.layout.describe_manager`).
    slot, length : int
    sources : list of (peer, layout, slot)
        Every rank of the sending side (any TP degree); each unit comes from the first
        source that holds it.
    merge : bool
        Merge contiguous units (:func:`merge_ranges`).

    Returns
    -------
    list of (peer, rows)
        ``rows`` as :func:`merge_ranges` (local = destination); one entry per source that
        provides something.

    Raises
    ------
    ValueError
        Layouts that differ (:func:`check_compatible`), or a unit no source holds (the
        sources do not cover every head of this rank).
    """
    mine = slot_units(local, slot, length)
    todo, plan = dict.fromkeys(mine), []
    for peer, layout, their_slot in sources:
        check_compatible(local, layout, length)
        theirs = slot_units(layout, their_slot, length)
        keys = [k for k in todo if k in theirs]
        for k in keys:
            del todo[k]
        if keys:
            plan.append((peer, _pairs(mine, theirs, keys, merge)))
    if todo:
        raise ValueError(f"sources: expected every unit of this rank, got none holding "
                         f"{next(iter(todo))} (and {len(todo) - 1} more)")
    return plan


def plan_push(local: dict, slot: int, targets: list, length: int) -> list:
    """Descriptors that write ``slot`` of ``local`` into ``targets`` (list of ``(peer,
    layout, slot)``): every unit of a target that this side holds (a target unit this rank
    lacks is another rank's to push). Returns ``(peer, rows)`` like :func:`plan_pull`
    (local = source). Raises ``ValueError`` for layouts that differ."""
    mine = slot_units(local, slot, length)
    plan = []
    for peer, layout, their_slot in targets:
        check_compatible(local, layout, length)
        theirs = slot_units(layout, their_slot, length)
        keys = [k for k in theirs if k in mine]
        if keys:
            plan.append((peer, _pairs(mine, theirs, keys)))
    return plan
