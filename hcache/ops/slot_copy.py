"""Slot copies across a set of tensors (kernels/slot_copy.cu) and all-or-nothing device
length commits (kernels/lengths.cu)."""

from __future__ import annotations

import numpy as np

from .._checks import INT32_MAX, check_int, int32_array
from ..device import array_module_of
from . import reference as ref
from ._launch import (
    BLOCK,
    ceil_div,
    check_status,
    grid_x,
    i32,
    launcher,
    ptr,
)


def slot_copy(slots, src_idx, dst_idx, *, status=None, stream=None, backend=None):
    """``dst_t[dst_idx[i]] = src_t[src_idx[i]]`` for every tensor pair of ``slots`` and every
    ``i`` (one launch).

    Parameters
    ----------
    slots : SlotSet
    src_idx, dst_idx : int32 [num_pairs]
        -1 in either marks padding (skipped). Other out-of-range entries are skipped and
        counted in ``status[0]``. No pair may write a slot another pair reads.
    status : int32 [1], optional
        Incremented once per out-of-range pair.
    """
    xp = slots.xp
    int32_array("src_idx", src_idx, xp)
    int32_array("dst_idx", dst_idx, xp, min_len=src_idx.shape[0])
    check_status(status, xp)
    n = int(src_idx.shape[0])
    run = launcher(xp, backend, stream)
    if run is None:
        return ref.slot_copy(slots, src_idx[:n], dst_idx[:n], status=status)
    if n == 0:
        return
    grid = (grid_x(n * ceil_div(slots.max_slot_bytes, 16)), slots.num_tensors, 1)
    run.launch("slot_copy", "hc_slot_copy", grid, (BLOCK, 1, 1),
               (ptr(slots.device_infos), ptr(src_idx), ptr(dst_idx), i32(n),
                ptr(status)))




def lengths_add(lengths, n, increment, max_len, *, status=None, stream=None, backend=None):
    """``lengths[:n] += increment`` on the device, all or nothing.

    Parameters
    ----------
    lengths : int32 [>= n]
    n : int
        In ``[0, len(lengths)]``.
    increment : int (an int32 value), or int32 [n] array of the same module as ``lengths``
    max_len : int
        In ``[0, 2**31 - 1]``. A commit with a negative increment, or one that would take any
        length past ``max_len``, is refused: nothing changes and ``status[0]`` is incremented.

    Raises
    ------
    TypeError, ValueError
        A scalar of the wrong type or out of range, or a bad array (nothing changes).
    """
    xp = array_module_of(lengths)
    int32_array("lengths", lengths, xp)
    n = check_int("n", n, 0, int(lengths.shape[0]))
    max_len = check_int("max_len", max_len, 0, INT32_MAX)
    check_status(status, xp)
    scalar = 0
    inc = None
    if isinstance(increment, (int, np.integer)) and not isinstance(increment, bool):
        scalar = check_int("increment", increment)
    else:
        inc = increment
        int32_array("increment", inc, xp, min_len=n)
    run = launcher(xp, backend, stream)
    if run is None:
        return ref.lengths_add(lengths, n, increment if inc is None else inc[:n], max_len,
                               status=status)
    run.launch("lengths", "hc_lengths_add", (1, 1, 1), (1, 1, 1),
               (ptr(lengths), i32(n), ptr(inc), i32(scalar), i32(max_len), ptr(status)))
