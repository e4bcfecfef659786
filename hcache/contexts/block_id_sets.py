"""Multisets of the small block-id arrays of one step, for a fraction of ``np.unique``'s cost
(about 20 µs a call on the CI machine, mostly Python; a step has a few dozen ids)."""

from __future__ import annotations

import numpy as np

__all__ = ["counted"]


def counted(ids: np.ndarray):
    """``np.unique(ids, return_counts=True)`` (counts int64)."""
    ordered = ids.copy()        # (np.sort's and np.ones' Python wrappers cost more than this)
    ordered.sort()
    if len(ordered) < 2:
        return ordered, np.ones(len(ordered), np.int64)
    first = np.empty(len(ordered), bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = first.nonzero()[0]
    if len(starts) == len(ordered):      # no repeat (a request's blocks)
        return ordered, np.ones(len(ordered), np.int64)
    ends = np.empty_like(starts)
    ends[:-1], ends[-1] = starts[1:], len(ordered)
    return ordered[starts], ends - starts

