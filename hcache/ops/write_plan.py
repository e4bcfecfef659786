"""The step plan of :func:`hcache.ops.kv_write` (docs/design.md §8 "Plan once, launch cheaply").

An engine writes K/V layer by layer with the same step arguments (row offsets or uniform
tokens, lengths, positions, slot map, block table, status word, stream) for every layer of a
step. The first write of a step validates them and leaves a :class:`KVWritePlan` on the group:
those arguments (held, so their identities stay theirs) with their shapes, and the kernel
arguments that depend on them only, converted once. A later write whose step arguments are the
very same objects, with the same shapes, checks only its K/V arrays (array type, shape, dtype,
contiguity) and launches with the prebuilt tuple; anything else takes the full path, which
validates everything and plans again. What the plan holds cannot change behind it: the arrays
are the same objects with the same shapes, a dtype or contiguity change makes a new array, and
the group's caches are fixed at construction.
"""

from __future__ import annotations

import numpy as np

from ..runtime import _cuda
from ..runtime.device import launch_scope, stream_handle
from ._launch import BLOCK, upload_table

__all__ = ["KVWritePlan"]

_NULL, _ZERO = np.uint64(0), np.int32(0)


class KVWritePlan:
    """The validated step arguments of a plain K/V write on one group, and its launch.

    Parameters
    ----------
    group : KVGroup
    kernel : kernel handle of ``hc_kv_write`` on the group's device
    device : Device
        The group's device.
    step : tuple
        ``(seq_offsets, uniform_tokens, batch, cache_lengths, positions, row_to_slot,
        block_table, status, stream)`` as the caller passed them (validated).
    num_tokens : int
    head, body : tuple
        The kernel arguments before the layer offset (the layer table) and after the two
        source pointers (the step's own).
    grids : dict
        Group position (or None: every layer) -> launch grid.
    """

    __slots__ = ("group", "kernel", "device", "step", "shapes", "num_tokens", "head", "body",
                 "grids", "table", "scratch")

    def __init__(self, group, kernel, device, step, num_tokens, head, body):
        self.group, self.kernel, self.device, self.step = group, kernel, device, step
        self.scratch = np.uint64(_cuda.runtime().pointer(group.scratch_infos))
        self.shapes = [getattr(a, "shape", None) for a in step]
        self.num_tokens, self.head, self.body = num_tokens, head, body
        self.grids: dict = {}
        self.table = None   # (pointers, host table) last uploaded into the group's scratch

    def same_step(self, step) -> bool:
        """Whether ``step`` is the planned step: the same objects (ints equal), the same
        shapes."""
        for a, b, shape in zip(step, self.step, self.shapes):
            if a is not b and not (type(a) is int and a == b):
                return False
            if shape is not None and a.shape != shape:
                return False
        return True

    def launch(self, k, v, layers) -> bool:
        """Launch the write of ``k`` / ``v`` (one group position ``layers``, or lists for
        every layer when None) if they fit the plan; False (nothing done) when the full path
        must judge them."""
        group = self.group
        grid = self.grids.get(layers)
        if grid is None:
            return False
        rt = _cuda.runtime()
        if layers is None:
            if type(k) is not list and type(k) is not tuple:
                return False
            ks = k
            vs = v if v is not None or group.components == 2 else (None,) * len(k)
            if type(vs) is not list and type(vs) is not tuple:
                return False
            if len(ks) != group.num_layers or len(vs) != group.num_layers:
                return False
            positions = range(len(ks))
        else:
            ks, vs, positions = (k,), (v,), (layers,)
        array, dtype, n, dim = group.xp.ndarray, group.dtype, self.num_tokens, group.head_dim
        latent = group.components == 1
        heads = group.num_kv_heads
        for a, b, p in zip(ks, vs, positions):
            want = (n, heads[p], dim)
            if type(a) is not array or a.shape != want or a.dtype != dtype \
                    or not a.flags.c_contiguous:
                return False
            if latent:
                if b is not None:
                    return False
            elif type(b) is not array or b.shape != want or b.dtype != dtype \
                    or not b.flags.c_contiguous:
                return False
        stream = self.step[-1]
        with launch_scope(self.device, stream):
            if layers is None:
                self._table(rt, ks, vs, stream)
                args = (*self.head, _ZERO, self.scratch, _NULL, _NULL, *self.body)
            else:
                args = (*self.head, np.int32(layers), _NULL, np.uint64(rt.pointer(k)),
                        _NULL if v is None else np.uint64(rt.pointer(v)), *self.body)
            rt.launch(self.kernel, grid, (BLOCK, 1, 1), args)
        return True

    def _table(self, rt, ks, vs, stream) -> None:
        """The pointer table of every layer's sources into the group's scratch: uploaded only
        when a pointer changed since this plan's last upload, another table was uploaded into
        the scratch since, the launch stream is another (with ``stream=None``, the current
        stream changed: that stream is not ordered after the last upload), or a capture runs
        (:func:`upload_table` decides)."""
        group = self.group
        pointers = [(rt.pointer(a), 0 if b is None else rt.pointer(b)) for a, b in zip(ks, vs)]
        last = self.table
        if last is not None and last[0] == pointers and last[1] is not None \
                and group.scratch_host is last[1] and not group.scratch_captured \
                and not rt.is_capturing() and last[1][0] == stream_handle(stream):
            return
        upload_table(self, group, np.array(pointers, dtype=np.uint64))
        self.table = (pointers, group.scratch_host)

    @property
    def stream(self):
        """The step's stream (:func:`upload_table` reads it as a launcher's)."""
        return self.step[-1]
