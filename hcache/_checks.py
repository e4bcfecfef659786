"""Argument checks and launch helpers shared by the batch API and the managers.

Re-exported by :mod:`hcache.slots.batch` (``check_index``, ``check_int``, ``launch_scope``,
``host_ints``), where the managers import them from; kept here so that the batch API and its
compaction mixin (:mod:`hcache.slots.batch_compaction`) can share them without an import cycle.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .device import array_module_of, stream_scope

__all__ = ["check_index", "check_int", "host_ints", "launch_scope", "upload_ints"]

def check_index(name: str, value, size: int) -> int:
    """``value`` as an index in ``[0, size)``; ``TypeError`` unless an int, else ``IndexError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value < size:
        raise IndexError(f"{name}: expected an index in [0, {size}), got {value}")
    return value


def check_int(name: str, value, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]``; ``TypeError`` unless an int, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value}")
    return value


@contextlib.contextmanager
def launch_scope(device, stream):
    """Make ``device`` and ``stream`` current, so that uploads and launches share the stream
    (validates ``stream`` on cpu too)."""
    with device.scope(), stream_scope(stream, device):
        yield


def host_ints(name: str, values, length: int | None = None) -> np.ndarray:
    """Host integers (sequence or NumPy array) as a 1-D ``int64`` array.

    Raises
    ------
    TypeError
        Not integers (floats, bools, a device array).
    ValueError
        Not 1-D, or not ``length`` entries.
    """
    if array_module_of(values) is not np or hasattr(values, "__cuda_array_interface__"):
        raise TypeError(f"{name}: expected host integers, got {type(values).__name__}")
    if isinstance(values, (list, tuple)) and any(isinstance(v, (bool, np.bool_))
                                                 for v in values):
        # np.asarray([1, True]) is an int array: a bool entry would pass as 0 or 1.
        raise TypeError(f"{name}: expected integers, got a bool entry")
    arr = np.asarray(values)
    if arr.size == 0 and arr.dtype == np.float64:  # np.asarray([]) is float64
        arr = arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise ValueError(f"{name}: expected {length} entries, got {arr.shape[0]}")
    big = np.flatnonzero(arr > np.iinfo(np.int64).max) if arr.dtype == np.uint64 else ()
    if len(big):   # would wrap to a negative int64 (2**64 - 1 would read as -1)
        raise ValueError(f"{name}[{big[0]}]: expected a value below 2**63, got {arr[big[0]]}")
    return arr.astype(np.int64)


def upload_ints(dst, host: np.ndarray) -> None:
    """``dst[:len(host)] = host`` as int32, host to device on the current stream."""
    n = host.shape[0]
    if n == 0:
        return
    values = host.astype(np.int32)
    if isinstance(dst, np.ndarray):
        dst[:n] = values
    else:
        dst[:n].set(values)
