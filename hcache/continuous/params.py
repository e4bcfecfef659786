"""Arguments of the continuous-batching API (docs/design.md §5): the KV head geometry, and the
checks that :mod:`hcache._checks` does not cover: seq ids and per-row token counts are exact
Python ints of any size (a huge count is refused with its value, never wrapped in int64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._checks import as_int, check_int

__all__ = ["KVCacheStaticParams", "exact_int", "token_counts"]


@dataclass(frozen=True)
class KVCacheStaticParams:
    """Per-layer KV geometry: ``num_heads`` KV heads of ``head_size`` elements, both >= 1.

    Raises
    ------
    TypeError, ValueError
        A field is not an int >= 1.
    """

    num_heads: int
    head_size: int

    def __post_init__(self):
        object.__setattr__(self, "num_heads", as_int("num_heads", self.num_heads, 1))
        object.__setattr__(self, "head_size", as_int("head_size", self.head_size, 1))


def exact_int(name: str, value) -> int:
    """``value`` as an int of any size (a seq id, whose liveness the caller checks; a count).

    Raises
    ------
    TypeError
        ``value`` is a bool, a float or no int at all.
    """
    return check_int(name, value, -math.inf, math.inf)


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
    elif isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of int, got {type(values).__name__}")
    else:
        counts = [exact_int(f"{name}[{i}]", v) for i, v in enumerate(values)]
    if len(counts) != batch:
        raise ValueError(f"{name}: expected {batch} lengths, got {len(counts)}")
    if any(v < 0 for v in counts):
        raise ValueError(f"{name}: expected lengths >= 0, got {counts}")
    return counts
