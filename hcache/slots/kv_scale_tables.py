"""The FP8 scale tables of the contiguous-slot writers (:class:`~hcache.slots.kv_writes.KVWriter`,
docs/design.md §3.7, §4.9): a scale argument checked against the tables, and recorded into them.

A table is float32 ``[num_layers, max_kv_heads]`` on the device, one for K and one for V; row
``a`` holds the scale attention layer ``a``'s latest write divided by. Beside each table a host
list remembers the float recorded last per layer (``None`` after a device table was copied in),
so a write that repeats its float scale copies nothing.
"""

from __future__ import annotations

import math

import numpy as np

from ..device import array_module_of

__all__ = ["check_table_scale", "record_scale"]


def check_table_scale(name: str, scale, xp, num_layers: int, heads: int):
    """A scale argument as ``None`` (keep the recorded tables), a float, or a device table.

    Parameters
    ----------
    name : str
        The caller's argument name, for messages.
    scale : None, float or float32 array [num_layers] or [num_layers, >= heads]
    xp : module
        The caches' array module.
    num_layers, heads : int
        Rows of a table, and the most KV heads of the layers written.

    Raises
    ------
    TypeError
        A bool, or neither a number nor an ``xp`` array.
    ValueError
        A number that is not finite and > 0 as float32; an array of another dtype or shape.
    """
    if scale is None:
        return None
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a float or a float32 array, got bool")
    if isinstance(scale, (int, float, np.integer, np.floating)):
        value = float(np.float32(scale))
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: expected a finite scale > 0 (as float32), got {scale}")
        return value
    if array_module_of(scale) is not xp or not hasattr(scale, "shape"):
        raise TypeError(f"{name}: expected a float or a {xp.__name__} float32 array, "
                        f"got {type(scale).__name__}")
    ok = scale.dtype == np.float32 and scale.ndim in (1, 2) and scale.shape[0] == num_layers \
        and (scale.ndim == 1 or scale.shape[1] >= heads)
    if not ok:
        raise ValueError(f"{name}: expected a float32 array [{num_layers}] (per layer) or "
                         f"[{num_layers}, >= {heads}] (per head), got {scale.dtype} "
                         f"{list(scale.shape)}")
    return scale


def record_scale(table, memo: list, scale, layers: list) -> None:
    """Copy a checked scale into the rows ``layers`` of ``table`` (in device order, no
    allocation), ``memo`` its host record; a float equal to the one recorded last is not
    copied again."""
    if scale is None:
        return
    if isinstance(scale, float):
        todo = [a for a in layers if memo[a] != scale]
        if len(todo) == len(memo):
            table.fill(scale)
        else:
            for a in todo:
                table[a].fill(scale)
        for a in todo:
            memo[a] = scale
        return
    width = min(table.shape[1], scale.shape[1]) if scale.ndim == 2 else table.shape[1]
    rows = slice(layers[0], layers[0] + 1) if len(layers) == 1 else slice(None)
    table[rows, :width] = scale[rows, :width] if scale.ndim == 2 else scale[rows, None]
    for a in layers:
        memo[a] = None
