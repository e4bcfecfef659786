"""What ``copy`` and ``pickle`` do with the objects that own cache memory (docs/design.md §9).

* ``copy.copy`` is refused: a shallow copy would share the buffers and the mutable bookkeeping
  (free lists, lengths, maps) with the original, and the two would silently diverge.
* ``copy.deepcopy`` gives an independent object: new buffers on the same device holding the
  same bytes, its own bookkeeping; array modules are shared, not copied. Objects shared
  between threads with a batch in flight (continuous batching) refuse it too.
* ``pickle`` is refused: the buffers are device memory that kernels, views and exported
  pointers address; another process builds its own object from the config (configs pickle).

Each class assigns these functions as its ``__copy__`` / ``__deepcopy__`` / ``__reduce_ex__``.
"""

from __future__ import annotations

import copy
import sys

import numpy as np

__all__ = ["refuse_copy", "refuse_deepcopy", "refuse_pickle", "deepcopy_sharing_modules"]


def refuse_copy(self):
    """``__copy__``: raises ``TypeError`` (see the module docstring)."""
    name = type(self).__name__
    raise TypeError(f"copy.copy({name}): a shallow copy would share the caches and the "
                    f"bookkeeping of the original and the two would diverge; use "
                    f"copy.deepcopy for an independent copy, or build a new {name}")


def refuse_deepcopy(self, memo=None):
    """``__deepcopy__`` of an object shared between threads: raises ``TypeError``."""
    name = type(self).__name__
    raise TypeError(f"copy.deepcopy({name}): it is shared between threads with one batch in "
                    f"flight and cannot be copied; build a new {name} with the same "
                    f"arguments and move sequences with claim/fetch/write")


def refuse_pickle(self, protocol=None):
    """``__reduce_ex__``: raises ``TypeError`` (see the module docstring)."""
    name = type(self).__name__
    raise TypeError(f"pickle({name}): its caches are device memory that kernels and views "
                    f"address and cannot travel to another process; pickle its config and "
                    f"build a new {name} there (copy.deepcopy copies it in this process)")


def deepcopy_sharing_modules(self, memo):
    """``__deepcopy__``: a copy with its own buffers and bookkeeping (same device, same
    bytes); NumPy and CuPy, referenced as array modules, are shared."""
    memo.setdefault(id(np), np)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        memo.setdefault(id(cupy), cupy)
    cls = type(self)
    new = cls.__new__(cls)
    memo[id(self)] = new
    new.__dict__.update(copy.deepcopy(vars(self), memo))
    return new
