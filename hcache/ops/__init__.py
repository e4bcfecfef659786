"""Typed launch wrappers, one per kernel (docs/design.md §3).

Each wrapper validates its arrays (shape, dtype, array module, contiguity), casts every scalar to
the C type of the kernel's parameter, computes the grid in one visible place and launches on the
given stream. On NumPy arrays with no explicit ``backend`` the call goes to the NumPy reference
(:mod:`hcache.ops.reference`), which is the ``cpu`` backend; the signatures are the same.

``backend`` is anything with ``launch(family, name, grid, block, args)`` (and ``upload``): the
CuPy launcher (:class:`CupyLauncher`), or the host emulation of the test suite, which runs the
same ``.cu`` through g++. The argument tuples are identical for both: ``numpy`` scalars
(``int32``, ``int64``, ``uint64`` for pointers; 0 is a null pointer).

None of these functions synchronizes the device or allocates device memory. Kernels launch on
the current CUDA device (the managers make theirs current around every call).
"""

from __future__ import annotations

from ._launch import BLOCK, CupyLauncher, host_backend
from .compact import compaction_plan, kv_compact, slots_compact
from .kv_capture import kv_capture, kv_prefix_copy, kv_restore
from .kv_write import kv_write
from .reference import compaction_plan_size
from .slot_copy import lengths_add, slot_copy

__all__ = ["BLOCK", "compaction_plan_size", "compaction_plan", "kv_compact", "slots_compact",
           "slot_copy", "kv_write", "kv_capture", "kv_restore", "kv_prefix_copy", "lengths_add",
           "CupyLauncher", "host_backend"]
