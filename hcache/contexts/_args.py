"""Argument checks shared by the prefix-cache modules of :mod:`hcache.contexts`.

Each helper validates one caller-supplied value and returns it in the host form the allocators
keep (Python ``int`` or a NumPy ``int64`` array), raising ``TypeError`` / ``ValueError`` /
``IndexError`` with a ``"<name>: expected X, got Y"`` message before anything is mutated.
"""

from __future__ import annotations

import numpy as np

from ..config.caches import _int

_MAX_HASH = np.iinfo(np.int64).max


def _index(name: str, value, upper: int) -> int:
    value = _int(name, value, minimum=-(2**63))  # the type check (bools and floats refused)
    if not 0 <= value < upper:
        raise IndexError(f"{name}: expected an index in [0, {upper}), got {value}")
    return value


def _index_array(name: str, values, upper: int) -> np.ndarray:
    """``values`` as int64 ``[n]``, every entry in ``[0, upper)``."""
    arr = values if isinstance(values, np.ndarray) else np.asarray(list(values))
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = (arr < 0) | (arr >= upper)
    if bad.any():
        raise IndexError(f"{name}: expected indices in [0, {upper}), got {int(arr[bad][0])}")
    return arr


def _host(array) -> np.ndarray:
    """A host view of a context array (NumPy expected; a CuPy array is copied, synchronously)."""
    return array if isinstance(array, np.ndarray) else np.asarray(
        array.get() if hasattr(array, "get") else array)


def _shape(name: str, shape) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"{name}: expected a tuple of ints, got {type(shape).__name__}")
    return tuple(_int(f"{name}[{i}]", s, 1) for i, s in enumerate(shape))


def _as_ids(name: str, ids, num_blocks: int, *, padding: bool = False) -> np.ndarray:
    """Host ``int64 [n]`` copy of ``ids`` (-1 allowed as padding if ``padding``); raises
    TypeError/ValueError/IndexError."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected integer block ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    arr = arr.astype(np.int64)
    bad = (arr < (-1 if padding else 0)) | (arr >= num_blocks)
    if bad.any():
        raise IndexError(f"{name}: expected block ids in [0, {num_blocks}), "
                         f"got {int(arr[bad][0])}")
    return arr


def _as_int64(name: str, values, length: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        arr = np.zeros(0, dtype=np.int64)
    elif arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer) \
            or (arr.dtype == np.uint64 and bool((arr > _MAX_HASH).any())):
        raise TypeError(f"{name}: expected int64 hashes, got dtype {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] != length:
        raise ValueError(f"{name}: expected {length} values (one per block id), "
                         f"got shape {arr.shape}")
    return arr.astype(np.int64)
