"""What ``copy`` and ``pickle`` do with the objects that own cache memory (docs/design.md §4.1).

* ``copy.copy`` is refused: a shallow copy would share the buffers and the mutable bookkeeping
  (free lists, lengths, maps) with the original, and the two would silently diverge.
* ``copy.deepcopy`` is refused: the caches are reached through views of larger buffers and
  through the kernels' pointer tables, which a copy would not re-point (on a GPU the copy would
  write into the original's memory). Build a new object with the same arguments (its config)
  and move the contents with its capture/restore or write methods.
* ``pickle`` is refused: device memory cannot travel to another process; pickle the config
  (configs are values) and build the object there.

``KVBlockAllocator``, host bookkeeping only, refuses ``copy.copy`` alone. Each class assigns
these functions as its ``__copy__`` / ``__deepcopy__`` / ``__reduce_ex__``.
"""

from __future__ import annotations

__all__ = ["refuse_copy", "refuse_deepcopy", "refuse_pickle"]


def refuse_copy(self):
    """``__copy__``: raises ``TypeError`` (see the module docstring)."""
    name = type(self).__name__
    raise TypeError(f"copy.copy({name}): a shallow copy would share the caches and the "
                    f"bookkeeping of the original and the two would diverge; build a new "
                    f"{name} with the same arguments")


def refuse_deepcopy(self, memo=None):
    """``__deepcopy__``: raises ``TypeError`` (see the module docstring)."""
    name = type(self).__name__
    raise TypeError(f"copy.deepcopy({name}): its caches are reached through views and kernel "
                    f"pointer tables that a copy would not re-point; build a new {name} with "
                    f"the same arguments and move the contents with its capture/restore or "
                    f"write methods")


def refuse_pickle(self, protocol=None):
    """``__reduce_ex__``: raises ``TypeError`` (see the module docstring)."""
    name = type(self).__name__
    raise TypeError(f"pickle({name}): its caches are device memory that kernels and views "
                    f"address and cannot travel to another process; pickle its config and "
                    f"build a new {name} there")
