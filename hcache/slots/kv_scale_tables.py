"""The FP8 scale tables of a :class:`~hcache.slots.kv_writes.KVWriter` (docs/design.md §4.9).

An FP8 cache keeps one scale per attention layer and KV head for K and for V (float32 tables
``[num_layers, max_kv_heads]``, 1.0 at construction): the scale the layer's latest write
divided by, which an attention kernel multiplies back (``x ~= q * scale``). A scale argument is
checked completely before any table changes, and recording one is a device copy (or fill) into
the tables, never an allocation.
"""

from __future__ import annotations

import math

import numpy as np

from ..runtime.arrays import as_array

__all__ = ["KVScaleTables"]


class KVScaleTables:
    """The K and V scale tables of an FP8 writer's caches.

    Parameters
    ----------
    device : Device
    caches : sequence of arrays ``[max_batch, C_a, H_a, S, D_a]``
        The writer's caches (their head counts size the tables).

    Attributes
    ----------
    tables : (array, array)
        ``(k_scales, v_scales)``, float32 ``[num_layers, max_kv_heads]`` on ``device``.

    Notes
    -----
    Allocates on the current device and stream (inside the manager's construction scope).
    """

    def __init__(self, device, caches):
        xp = device.xp
        self._device, self._caches = device, tuple(caches)
        heads = max((int(c.shape[2]) for c in caches), default=0)
        self.tables = (xp.ones((len(caches), heads), dtype=np.float32),
                       xp.ones((len(caches), heads), dtype=np.float32))
        self._recorded = [[1.0] * len(caches), [1.0] * len(caches)]  # host floats, or None

    @property
    def nbytes(self) -> int:
        return int(self.tables[0].nbytes + self.tables[1].nbytes)

    def check(self, name, scale, layers, stream=None):
        """A scale argument for attention layers ``layers`` as ``None`` (the recorded tables),
        a float or a device table (an array of any library on this device,
        :func:`hcache.arrays.as_array`: a foreign one orders ``stream`` after its producer).

        Raises
        ------
        TypeError
            Not a float, a bool, or not an array of this device's memory.
        ValueError
            A float that is not finite and > 0, or a table not float32 ``[num_layers]`` or
            ``[num_layers, >= max heads of layers]``, or on another device.
        """
        if scale is None:
            return None
        if isinstance(scale, (bool, np.bool_)):
            raise TypeError(f"{name}: expected a float or a float32 array, got bool")
        if isinstance(scale, (int, float, np.integer, np.floating)):
            value = float(np.float32(scale))
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a finite scale > 0 (as float32), "
                                 f"got {scale}")
            return value
        n = len(self._caches)
        scale = as_array(name, scale, self._device, stream)
        heads = max((int(self._caches[a].shape[2]) for a in layers), default=0)
        ok = scale.dtype == np.float32 and scale.ndim in (1, 2) \
            and scale.shape[0] == n and (scale.ndim == 1 or scale.shape[1] >= heads)
        if not ok:
            raise ValueError(f"{name}: expected a float32 array [{n}] (per layer) or [{n}, >= "
                             f"{heads}] (per head), got {scale.dtype} {list(scale.shape)}")
        return scale

    def record(self, kv: int, scale, layers) -> None:
        """Copy a checked scale into the table rows of ``layers`` (``kv`` 0: K, 1: V; device
        order, no allocation); a float equal to the one recorded last is not copied again."""
        if scale is None:
            return
        table, memo = self.tables[kv], self._recorded[kv]
        if isinstance(scale, float):
            todo = [a for a in layers if memo[a] != scale]
            if len(todo) == len(self._caches):
                table.fill(scale)
            else:
                for a in todo:
                    table[a].fill(scale)
            for a in todo:
                memo[a] = scale
            return
        width = min(table.shape[1], scale.shape[1]) if scale.ndim == 2 else table.shape[1]
        rows = slice(layers[0], layers[0] + 1) if len(layers) == 1 else slice(None)
        src = scale[rows, :width] if scale.ndim == 2 else scale[rows, None]
        table[rows, :width] = src
        for a in layers:
            memo[a] = None
