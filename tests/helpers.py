"""Small helpers shared by the test modules (array module agnostic)."""

from __future__ import annotations

import numpy as np


def host(a) -> np.ndarray:
    """A host copy of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") else np.array(a)


def put(dst, values) -> None:
    """``dst[...] = values`` with host ``values``, whatever ``dst``'s array module."""
    if hasattr(dst, "get"):
        import cupy

        dst[...] = cupy.asarray(values)
    else:
        dst[...] = values
