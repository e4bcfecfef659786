"""One home for argument checks: ints, indices, host integer arrays, device index arrays.

Every check raises ``TypeError`` (wrong type), ``ValueError`` (wrong value or shape) or
``IndexError`` (an index out of range) with the message ``"<name>: expected X, got Y"``, where
``name`` is what the caller passed, and returns the value in the form the caller keeps (a Python
``int`` or a host ``int64`` array). Checks never mutate anything, so a method that runs all of
its checks before its first mutation changes nothing when one fails.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Set
from itertools import repeat

import numpy as np

from .runtime.arrays import host_array as _import_host
from .runtime.arrays import on_device

__all__ = ["INT32_MIN", "INT32_MAX", "as_int", "check_int", "check_index", "host_ints",
           "index_array", "block_id_array", "hash_array", "int_shape", "int32_array",
           "exact_int", "token_counts", "token_list", "host_array", "is_array",
           "scalar_scale"]

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1   # the C ``int`` of the kernels, int32 lengths
_INT64_MAX = np.iinfo(np.int64).max
_PLAIN_INT = {int}   # the type of an exact Python int (a bool is not one)


def _exact_int(name: str, value) -> int:
    # operator.index, not int(): a float (or a 0-d float array) must not be truncated.
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def as_int(name: str, value, minimum: int = 0) -> int:
    """``value`` as an int in ``[minimum, 2**63 - 1]`` (sizes, counts, config fields)."""
    if type(value) is int and minimum <= value <= _INT64_MAX:
        return value   # a plain int in range: nothing to convert
    value = _exact_int(name, value)
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    if value > _INT64_MAX:   # no size, count or byte budget is larger (NumPy would overflow)
        raise ValueError(f"{name}: expected an int <= 2**63 - 1, got {value}")
    return value


def check_int(name: str, value, lo: int = INT32_MIN, hi: int = INT32_MAX) -> int:
    """``value`` as an int in ``[lo, hi]`` (by default the range of a C ``int``)."""
    if type(value) is int and lo <= value <= hi:
        return value   # a plain int in range: nothing to convert
    value = _exact_int(name, value)
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value}")
    return value


def check_index(name: str, value, size: int) -> int:
    """``value`` as an index in ``[0, size)``: ``TypeError`` unless an int, else ``IndexError``."""
    if type(value) is int and 0 <= value < size:
        return value   # a plain int in range: nothing to convert
    value = _exact_int(name, value)
    if not 0 <= value < size:
        raise IndexError(f"{name}: expected an index in [0, {size}), got {value}")
    return value


_ARRAY_PROTOCOLS = ("__dlpack__", "__array__", "__array_interface__", "__array_struct__",
                    "__cuda_array_interface__")


def is_array(values) -> bool:
    """True for an array of any library (NumPy, JAX, CuPy, an object with an array protocol):
    what :func:`host_array` imports rather than reads as a Python sequence."""
    return isinstance(values, np.ndarray) or hasattr(values, "__dlpack__") \
        or hasattr(values, "__array__") or hasattr(values, "__array_interface__") \
        or hasattr(values, "__array_struct__") or hasattr(values, "__cuda_array_interface__")


def refuse_unordered(name: str, values) -> None:
    """Refuse a set, a frozenset or a mapping where a sequence of ints is due: iterating one
    gives its members in an order of its own (a set) or its keys (a mapping), never the
    values the caller meant, and a set drops repeats.

    Raises
    ------
    TypeError
        ``values`` is a set or a mapping.
    """
    if isinstance(values, (Set, Mapping)):
        raise TypeError(f"{name}: expected a sequence of ints (a list, a tuple or an array), "
                        f"got {type(values).__name__}, which has no order of entries")


def host_array(name: str, values) -> np.ndarray:
    """``values`` as a NumPy array: the one host coercion of integer arguments.

    A NumPy array is returned as it is; an array of any other library (``__dlpack__``,
    ``__array__``, ``__array_interface__``, JAX) through :func:`hcache.arrays.host_array`,
    without a copy where its producer allows; a flat sequence (a list, a tuple, a range, a
    generator) through ``np.asarray``.

    Raises
    ------
    TypeError
        Device memory ("expected host integers, got device memory"), an array NumPy cannot
        import, a string, a scalar, a set or a mapping (:func:`refuse_unordered`), a nested or
        ragged sequence, or a bool entry of a sequence (which ``np.asarray`` would read as 0
        or 1).
    ValueError
        A Python int of a sequence beyond int64.
    """
    if isinstance(values, np.ndarray):
        return values
    if type(values) is list or type(values) is tuple:
        pass        # ordered, flat or not: no array protocol, string or set to refuse
    elif is_array(values):
        if on_device(values):
            raise TypeError(f"{name}: expected host integers, got device memory "
                            f"({type(values).__name__})")
        return _import_host(name, values)
    elif isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name}: expected a 1-D sequence of ints, got {type(values).__name__}")
    else:
        refuse_unordered(name, values)
        values = list(values)          # a generator, a range
    if any(map(isinstance, values, repeat((bool, np.bool_)))):
        i = next(i for i, v in enumerate(values) if isinstance(v, (bool, np.bool_)))
        raise TypeError(f"{name}[{i}]: expected an int, got bool")
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError, OverflowError):   # ragged or nested
        raise TypeError(f"{name}: expected a 1-D sequence of ints, got {values!r:.60}") \
            from None
    if arr.dtype.kind in "fO" and arr.ndim == 1 and all(map(isinstance, values, repeat(int))):
        # Python ints beyond int64 (and uint64) make a float or object array: say which.
        i = next((i for i, v in enumerate(values) if not -(2**63) <= v < 2**63), None)
        if i is not None:
            raise ValueError(f"{name}[{i}]: expected an int64 value in [-2**63, 2**63), "
                             f"got {values[i]}")
    return arr


def host_ints(name: str, values, length: int | None = None) -> np.ndarray:
    """Host integers (a sequence or a NumPy array) as a 1-D ``int64`` array.

    Raises
    ------
    TypeError
        Not integers (floats, bools, a device array).
    ValueError
        Not 1-D, not ``length`` entries, or a ``uint64`` value that int64 cannot hold.
    """
    if (type(values) is list or type(values) is tuple) and set(map(type, values)) <= _PLAIN_INT:
        try:   # plain Python ints: one conversion (one beyond int64 takes the full path)
            arr = np.array(values, dtype=np.int64)
        except OverflowError:
            pass
        else:
            if length is not None and arr.shape[0] != length:
                raise ValueError(f"{name}: expected {length} entries, got {arr.shape[0]}")
            return arr
    arr = host_array(name, values)
    if arr.size == 0 and arr.dtype == np.float64:  # np.asarray([]) is float64
        arr = arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise ValueError(f"{name}: expected {length} entries, got {arr.shape[0]}")
    big = np.flatnonzero(arr > _INT64_MAX) if arr.dtype == np.uint64 else ()
    if len(big):   # would wrap to a negative int64 (2**64 - 1 would read as -1)
        raise ValueError(f"{name}[{big[0]}]: expected a value below 2**63, got {arr[big[0]]}")
    return arr.astype(np.int64)


def index_array(name: str, values, upper: int, *, distinct: bool = False) -> np.ndarray:
    """``values`` as host ``int64 [n]``, every entry in ``[0, upper)`` (and no entry twice
    when ``distinct``: a ``ValueError``)."""
    arr = host_array(name, values)
    if arr.size == 0 and arr.ndim == 1:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.dtype == np.uint64 and (arr > _INT64_MAX).any():
        raise IndexError(f"{name}: expected indices in [0, {upper}), got {arr.max()}")
    arr = arr.astype(np.int64)
    bad = (arr < 0) | (arr >= upper)
    if np.count_nonzero(bad):
        raise IndexError(f"{name}: expected indices in [0, {upper}), got {int(arr[bad][0])}")
    if distinct and len(arr) > 1:
        first = np.unique(arr, return_index=True)[1]
        if len(first) != len(arr):
            i = int(np.setdiff1d(np.arange(len(arr)), first)[0])
            raise ValueError(f"{name}[{i}]: expected distinct indices, got {arr[i]} again")
    return arr


def block_id_array(name: str, ids, num_blocks: int, *, padding: bool = False) -> np.ndarray:
    """Block ids as host ``int64 [n]`` in ``[0, num_blocks)`` (``-1`` too if ``padding``)."""
    arr = host_array(name, ids)
    if arr.size == 0 and arr.ndim == 1:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":     # bool is not an integer kind here
        raise TypeError(f"{name}: expected integer block ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.dtype == np.uint64 and (arr > _INT64_MAX).any():
        raise IndexError(f"{name}: expected block ids in [0, {num_blocks}), got {arr.max()}")
    arr = arr.astype(np.int64)
    bad = (arr < (-1 if padding else 0)) | (arr >= num_blocks)
    if np.count_nonzero(bad):
        raise IndexError(f"{name}: expected block ids in [0, {num_blocks}), "
                         f"got {int(arr[bad][0])}")
    return arr


def hash_array(name: str, values, length: int) -> np.ndarray:
    """Block hashes as host ``int64 [length]``."""
    arr = host_array(name, values)
    if arr.size == 0 and arr.ndim == 1:
        arr = np.zeros(0, dtype=np.int64)
    elif arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected int64 hashes, got dtype {arr.dtype}")
    elif arr.dtype == np.uint64 and bool((arr > _INT64_MAX).any()):
        raise ValueError(f"{name}: expected int64 hashes (below 2**63), got {arr.max()}")
    if arr.ndim != 1 or arr.shape[0] != length:
        raise ValueError(f"{name}: expected {length} values (one per block id), "
                         f"got shape {arr.shape}")
    return arr.astype(np.int64)


def int_shape(name: str, shape) -> tuple[int, ...]:
    """A shape of positive ints as a tuple, of at most ``2**63 - 1`` elements (an array's
    size is an int64)."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"{name}: expected a tuple of ints, got {type(shape).__name__}")
    refuse_unordered(name, shape)
    out = tuple(as_int(f"{name}[{i}]", s, 1) for i, s in enumerate(shape))
    if math.prod(out) > _INT64_MAX:
        raise ValueError(f"{name}: expected at most {_INT64_MAX} elements, got shape {out}")
    return out


def int32_array(name: str, a, xp, *, min_len: int = 0, ndim: int = 1) -> None:
    """An index array handed to a kernel: an ``xp`` array, int32, ``ndim``-D, at least
    ``min_len`` rows, C-contiguous (``None`` passes: an optional argument)."""
    if a is None:
        return
    if not isinstance(a, xp.ndarray):
        raise TypeError(f"{name}: expected a {xp.__name__} array, got {type(a).__name__}")
    if a.dtype != np.int32:
        raise ValueError(f"{name}: expected dtype int32, got {a.dtype}")
    if a.ndim != ndim or (a.shape[0] if a.ndim else 0) < min_len:
        raise ValueError(f"{name}: expected {ndim}-D with at least {min_len} rows, "
                         f"got shape {tuple(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")


def exact_int(name: str, value) -> int:
    """``value`` as an int of any size (a seq id, whose liveness the caller checks; a count).

    Raises
    ------
    TypeError
        ``value`` is a bool, a float or no int at all.
    """
    return _exact_int(name, value)


def token_counts(values, batch: int, name: str = "valid_lengths") -> list[int]:
    """``values`` as ``batch`` Python ints >= 0 (tokens per batch row).

    Parameters
    ----------
    values : host ints [batch]
        A sequence of ints or a 1-D integer NumPy array (``uint64`` included, read exactly).

    Raises
    ------
    TypeError
        Not a sequence of ints or a 1-D integer array.
    ValueError
        Not ``batch`` entries, or a negative entry.
    """
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu" or values.ndim != 1:
            raise TypeError(f"{name}: expected a 1-D integer array, "
                            f"got {values.dtype} with shape {values.shape}")
        counts = values.tolist()     # exact Python ints (uint64 included)
    elif type(values) is list and set(map(type, values)) <= _PLAIN_INT:
        counts = list(values)   # plain Python ints: exact already, checked as a whole below
    elif isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of int, got {type(values).__name__}")
    else:
        refuse_unordered(name, values)
        counts = [exact_int(f"{name}[{i}]", v) for i, v in enumerate(values)]
    if len(counts) != batch:
        raise ValueError(f"{name}: expected {batch} lengths, got {len(counts)}")
    if counts and min(counts) < 0:
        raise ValueError(f"{name}: expected lengths >= 0, got {counts}")
    return counts


def token_list(name: str, tokens) -> list:
    """``tokens`` (a 1-D integer sequence or array) as a list of Python ints.

    Raises
    ------
    TypeError
        Not integers (or a scalar).
    ValueError
        Not 1-D.
    """
    arr = host_array(name, tokens)
    if arr.size == 0 and arr.ndim == 1:
        return []
    if arr.ndim == 0 or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected a 1-D sequence of ints, got {arr.dtype} "
                        f"{arr.shape}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    return arr.astype(np.int64).tolist()


def scalar_scale(name: str, scale) -> float | None:
    """A scalar FP8 ``scale`` as the float32 value the kernels use, or None when ``scale`` is
    not a scalar (a scale table, checked by the caller).

    Raises
    ------
    TypeError
        ``scale`` is a bool.
    ValueError
        A scalar that is not finite and > 0 as float32.
    """
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a float or a float32 array, got bool")
    if not isinstance(scale, (int, float, np.integer, np.floating)):
        return None
    value = float(np.float32(scale))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a finite scale > 0 (as float32), got {scale}")
    return value
