"""Small helpers shared by the test modules (array module agnostic)."""

from __future__ import annotations

import numpy as np
import pytest

from hcache.device import array_module_of

# The device parameter of the manager tests: NumPy, a real GPU (skipped without one), and the
# asynchronous emulated device (tests/emu_device.py), which runs the CUDA path in CI.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu),
           pytest.param("cuda", marks=pytest.mark.emulated, id="emulated")]


def host(a) -> np.ndarray:
    """A host copy of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") else np.array(a)


def put(dst, values) -> None:
    """``dst[...] = values`` with host ``values``, whatever ``dst``'s array module."""
    if hasattr(dst, "get"):
        dst[...] = array_module_of(dst).asarray(values)
    else:
        dst[...] = values


def randomize(arrays, rng) -> list:
    """Fill each array with random bytes; returns the host byte arrays written."""
    out = []
    for a in arrays:
        u8 = a.view(np.uint8)
        raw = rng.integers(0, 256, size=u8.shape, dtype=np.uint8)
        put(u8, raw)
        out.append(raw)
    return out
