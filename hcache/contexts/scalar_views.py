"""Flat memoryviews of an owner's NumPy arrays, for a serving step's element-by-element work
(docs/design.md §8, issue 24).

A step touches a few elements of large host arrays: through a memoryview, reading or writing
one costs about half of ``arr[i]`` / ``arr.item(i)``, but making the view costs as much as a
few accesses, so an owner makes its views once and keeps them. A memoryview can be neither
deep-copied nor pickled: a :class:`ScalarViews` is the tuple of its arrays (what copies and
pickles see), and its views are made again from the arrays of a copy (the owner's copies,
shared through the copy's memo or the pickle's).
"""

from __future__ import annotations

import numpy as np

__all__ = ["ScalarViews"]


class ScalarViews(tuple):
    """The tuple of the keyword arrays, each with a flat memoryview as the attribute of its
    name.

    Element ``(i, j)`` of a 2-D array is item ``i * shape[1] + j``; the arrays named in
    ``raw`` are views of bytes (a row's block of ``n`` bytes is a slice), as ``uint8`` arrays
    always are. Reads give Python scalars.

    Parameters
    ----------
    raw : tuple of str
        Names of the arrays viewed as bytes.
    **arrays : numpy.ndarray
        C-contiguous arrays in native byte order. The owner keeps them and never rebinds
        them (its resets write in place): a caller who assigned a new array to an owner's
        attribute would leave the view writing the old one.
    """

    def __new__(cls, raw: tuple = (), /, **arrays: np.ndarray):
        self = super().__new__(cls, arrays.values())
        self._names, self._raw = tuple(arrays), raw
        for name, array in arrays.items():
            if not array.dtype.isnative:
                raise ValueError(f"{name}: expected an array in native byte order, "
                                 f"got dtype {array.dtype.str}")
            # (a zero-size array of several dimensions is viewed flat: it cannot be cast)
            flat = memoryview(array if array.size else array.reshape(-1)).cast("B")
            if name not in raw and array.dtype != np.uint8:
                flat = flat.cast(array.dtype.char)
            setattr(self, name, flat)
        return self

    def __reduce__(self):
        return _remade, (self._raw, self._names, tuple(self))


def _remade(raw: tuple, names: tuple, arrays: tuple) -> ScalarViews:
    """The views of copied arrays (``copy`` and ``pickle`` call it)."""
    return ScalarViews(raw, **dict(zip(names, arrays)))
