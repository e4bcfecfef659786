"""Slot copies across a set of tensors (kernels/slot_copy.cu, docs/design.md §3.4). Op:
:func:`slot_copy` (``hc_slot_copy``)."""

from __future__ import annotations

from .._checks import int32_array
from . import reference as ref
from ._launch import (
    BLOCK,
    MAX_GRID_X,
    ceil_div,
    check_status,
    i32,
    launcher,
    ptr,
)

__all__ = ["slot_copy"]


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
    run = launcher(xp, backend, stream, slots.device_infos)
    if run is None:
        return ref.slot_copy(slots, src_idx[:n], dst_idx[:n], status=status)
    if n == 0:
        return
    # a block per tile of 4 * BLOCK chunks of one pair
    grid = (min(MAX_GRID_X, n * max(1, ceil_div(slots.max_slot_bytes, 16 * 4 * BLOCK))),
            slots.num_tensors, 1)
    run.launch("slot_copy", "hc_slot_copy", grid, (BLOCK, 1, 1),
               (ptr(slots.device_infos), ptr(src_idx), ptr(dst_idx), i32(n),
                ptr(status)))
