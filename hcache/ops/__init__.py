"""Typed launch wrappers, one per op (docs/design.md §3).

One name per op, from the kernel to the benchmark: kernel ``hc_<op>`` in
``kernels/<family>.cu``, wrapper ``<op>`` in ``hcache/ops/<family>.py``, NumPy reference
``<op>`` in :mod:`hcache.ops.reference`, tests in ``tests/test_op_<family>.py``, benchmark in
``hcache.bench.<family>``. The families and their ops:

============  ==================================================  ===============================
family        ops                                                 what they do
============  ==================================================  ===============================
kv_write      ``kv_write``, ``kv_write_fp8``                      new tokens' K/V into the caches
                                                                  (``kv_write_fp8``: quantized)
compact       ``compaction_plan``, ``kv_compact``,                in-place batch compaction
              ``slots_compact``
slot_copy     ``slot_copy``                                       whole slots across tensor pairs
kv_capture    ``kv_capture``, ``kv_restore`` (``kv_prefix_copy``  a slot's first tokens to or
              launches the same kernel unchecked)                 from compact tensors
lengths       ``lengths_add``                                     all-or-nothing length commits
draft_accept  ``draft_accept``, ``draft_lengths``                 speculative decoding: the
                                                                  accepted draft state into the
                                                                  live state, lengths by the
                                                                  kept tokens
============  ==================================================  ===============================

Each wrapper validates its arrays (shape, dtype, array module, contiguity), casts every scalar to
the C type of the kernel's parameter, computes the grid in one visible place and launches on the
given stream. Its parameters are those of its reference, then the launch-only keywords
``stream=None, backend=None``. On NumPy arrays with no explicit ``backend`` the call goes to the
NumPy reference, which is the ``cpu`` backend.

``backend`` is anything with ``launch(family, name, grid, block, args)``: the
CuPy launcher (:class:`CupyLauncher`), or the host emulation of the test suite, which runs the
same ``.cu`` through g++. The argument tuples are identical for both: ``numpy`` scalars
(``int32``, ``int64``, ``uint64`` for pointers; 0 is a null pointer).

The descriptor tables the kernels read (:class:`~hcache.ops.tables.KVGroup`,
:class:`~hcache.ops.tables.SlotSet`) and the compaction plan's format live in
:mod:`hcache.ops.tables`; :mod:`hcache.ops._loader` compiles the kernels through the device
boundary (:mod:`hcache._cuda`).

None of these functions synchronizes the device or allocates device memory. Kernels launch on
the device that owns the op's arrays (its table, plan or lengths), whatever device is current,
on ``stream`` (a stream of that device; ``None``: that device's current stream).
"""

from __future__ import annotations

from ._launch import BLOCK, CupyLauncher, host_backend, host_runs_reference
from .compact import compaction_plan, kv_compact, slots_compact
from .draft_accept import draft_accept, draft_lengths
from .kv_capture import kv_capture, kv_prefix_copy, kv_restore
from .kv_write import kv_write, kv_write_fp8
from .lengths import lengths_add
from .slot_copy import slot_copy
from .tables import compaction_plan_size

__all__ = ["BLOCK", "compaction_plan_size", "compaction_plan", "kv_compact", "slots_compact",
           "slot_copy", "kv_write", "kv_write_fp8", "kv_capture", "kv_restore", "kv_prefix_copy",
           "lengths_add", "draft_accept", "draft_lengths", "CupyLauncher", "host_backend",
           "host_runs_reference"]
