"""The explicit positions of a batched K/V write (docs/design.md §4.9): the checks
:class:`~hcache.slots.kv_writes.KVWriter` makes before staging host positions.

A host position is ``-1`` (the token is skipped) or in ``[0, max_sequence_length)``; live
positions are distinct within each sequence, and, for every ring window ``W`` among the written
layers, distinct modulo ``W`` among the last ``W`` tokens of each sequence (the tokens that land
in a ring, docs/design.md §3.9): two of them on one ring entry would race in one launch. Device
positions are not read (the kernels skip and count what is out of range).
"""

from __future__ import annotations

import numpy as np

from .._checks import host_array, is_array
from ..runtime.arrays import as_array, on_device

__all__ = ["check_positions"]


def check_positions(positions, lead, batch, counts, max_len, windows, device, stream=None):
    """Host positions checked and flattened, or a device array as it is.

    Parameters
    ----------
    positions : None, host ints shaped ``lead`` (a sequence, or an array of any library), or
        an int32 device array (on a cuda device; any library ``hcache.arrays.as_array`` imports)
    lead : tuple of int
        The leading axes of the write's ``k``: ``(batch, new_tokens)`` or ``(total_tokens,)``.
    batch : int
        Sequences (rows) of the write.
    counts : int or int array [batch]
        Tokens per row (one int for a uniform write).
    max_len : int
        ``max_sequence_length``.
    windows : sequence of int
        The distinct ring windows (> 0) of the written layers.
    device : Device
        The caches' device.
    stream : stream, optional
        The write's stream: a foreign device array is imported ordered on it.

    Returns
    -------
    None, int64 numpy array [prod(lead)], or the device array flattened

    Raises
    ------
    TypeError
        Host positions that are not integers, or not an array of a library NumPy (or, on
        device, ``device``) can import.
    ValueError
        A wrong shape or dtype, a position out of range, a repeated position in a row, or two
        landing tokens of a row on one entry of a ring.
    """
    if positions is None:
        return None
    if device.xp is not np and on_device(positions):   # device data: not read
        positions = as_array("positions", positions, device, stream)
        if positions.dtype != np.int32 or tuple(positions.shape) != lead \
                or not positions.flags.c_contiguous:
            raise ValueError(f"positions: expected a C-contiguous int32 array of shape "
                             f"{list(lead)}, got {positions.dtype} {list(positions.shape)}")
        return positions.reshape(-1)
    if is_array(positions):   # an array of any library, without a copy
        pos = host_array("positions", positions)
    else:
        try:
            pos = np.asarray(positions)
        except (ValueError, TypeError, OverflowError):   # ragged
            raise TypeError(f"positions: expected integers shaped {list(lead)}, got a "
                            "ragged sequence") from None
        if isinstance(positions, (list, tuple)) and pos.dtype.kind in "iu" and any(
                isinstance(v, bool) for v in np.asarray(positions, dtype=object).ravel()):
            raise TypeError("positions: expected integers, got a bool entry")
    if pos.dtype == np.bool_ or not np.issubdtype(pos.dtype, np.integer):
        raise TypeError(f"positions: expected integers, got dtype {pos.dtype}")
    if tuple(pos.shape) != lead:
        raise ValueError(f"positions: expected shape {list(lead)}, got {list(pos.shape)}")
    flat = pos.reshape(-1).astype(np.int64)
    bad = np.flatnonzero((flat < -1) | (flat >= max_len))
    if bad.size:
        raise ValueError(f"positions[{int(bad[0])}]: expected a position in [-1, {max_len}) "
                         f"(-1 skips the token), got {int(flat[bad[0]])}")
    rows = np.repeat(np.arange(batch, dtype=np.int64), counts)
    live = flat >= 0
    keys = rows[live] * max_len + flat[live]
    if np.unique(keys).size != keys.size:
        raise ValueError("positions: expected distinct positions within each sequence, "
                         "got a repeated one")
    if windows:
        per_row = np.broadcast_to(np.asarray(counts, np.int64), (batch,))
        row_len = np.repeat(per_row, per_row)
        index = np.arange(flat.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
        for w in windows:   # the tokens that land in a ring must hit distinct entries
            lands = live & (row_len - index <= w)
            keys = rows[lands] * w + flat[lands] % w
            if np.unique(keys).size != keys.size:
                raise ValueError(f"positions: expected positions distinct modulo {w} (a ring "
                                 f"window) among the last {w} tokens of each sequence, got a "
                                 f"repeated entry")
    return flat
