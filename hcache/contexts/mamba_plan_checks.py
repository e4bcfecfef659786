"""Argument checks of the Mamba boundary planning (:class:`~.mamba_intermediate.IntermediateStates`:
``plan``'s request object, ``plan_batch``'s arrays)."""

from __future__ import annotations

import numpy as np

from .._checks import host_ints, index_array

__all__ = ["checked_batch", "prompt_length"]


def prompt_length(req) -> int:
    """``req.prompt_length``, else ``len(req.prompt_tokens)``."""
    if hasattr(req, "prompt_length"):
        return int(req.prompt_length)
    if hasattr(req, "prompt_tokens"):
        return len(req.prompt_tokens)
    raise TypeError(f"req: expected an object with prompt_length or prompt_tokens, "
                    f"got {type(req).__name__}")


def checked_batch(rows, chunk_starts, seq_lens, boundaries, eos_columns, table_shape):
    """The arguments of :meth:`IntermediateStates.plan_batch` as int64 arrays, checked
    against a block table of ``table_shape``: distinct rows in range, one start, length and
    EOS column (in ``[-1, width)``) per row, starts and lengths >= 0, boundaries ``[n, m]``."""
    rows = index_array("rows", rows, table_shape[0])
    n = len(rows)
    seen = np.zeros(table_shape[0], bool)   # a mark per row: cheaper than sorting for unique
    seen[rows] = True
    if np.count_nonzero(seen) != n:
        raise ValueError(f"rows: expected distinct rows, got {rows.tolist()}")
    out = [rows]
    for name, values, lo, hi in (("chunk_starts", chunk_starts, 0, None),
                                 ("seq_lens", seq_lens, 0, None),
                                 ("eos_columns", eos_columns, -1, table_shape[1] - 1)):
        arr = host_ints(name, values, n)
        if n and (arr.min() < lo or (hi is not None and arr.max() > hi)):
            bad = np.flatnonzero((arr < lo) | (arr > hi if hi is not None else False))
            raise ValueError(f"{name}[{bad[0]}]: expected a value in [{lo}, "
                             f"{'inf' if hi is None else hi}], got {arr[bad[0]]}")
        out.append(arr)
    if boundaries is not None:
        try:
            arr = np.asarray(boundaries)
        except ValueError:
            raise TypeError("boundaries: expected an int array [n, m], got a ragged "
                            "sequence") from None
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"boundaries: expected integers, got dtype {arr.dtype}")
        if arr.ndim != 2 or arr.shape[0] != n:
            raise ValueError(f"boundaries: expected shape [{n}, m], got {arr.shape}")
        boundaries = arr.astype(np.int64)
    return out[0], out[1], out[2], boundaries, out[3]
