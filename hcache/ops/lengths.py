"""All-or-nothing sequence-length commits on the device (kernels/lengths.cu, docs/design.md §4).
Op: :func:`lengths_add` (``hc_lengths_add``)."""

from __future__ import annotations

import numpy as np

from .._checks import INT32_MAX, check_int, int32_array
from ..runtime.device import array_module_of
from . import reference as ref
from ._launch import LaunchMemo, check_status, i32, launcher, ptr

__all__ = ["lengths_add"]


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
    if backend is None and _MEMO.launch((lengths, n, increment, max_len, status, stream),
                                        stream):
        return   # the arguments of a checked launch again
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
    run = launcher(xp, backend, stream, lengths)
    if run is None:
        return ref.lengths_add(lengths, n, increment if inc is None else inc[:n], max_len,
                               status=status)
    # one block, a thread per entry up to 1024 (then threads stride)
    threads = min(1024, max(32, -(-n // 32) * 32))
    _MEMO.run(run, (lengths, n, increment, max_len, status, stream), "lengths",
              "hc_lengths_add", (1, 1, 1), (threads, 1, 1),
              (ptr(lengths), i32(n), ptr(inc), i32(scalar), i32(max_len), ptr(status)))


_MEMO = LaunchMemo()
