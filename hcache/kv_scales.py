"""Argument checks of quantizing K/V writes shared by the writers that keep no scale table:
:meth:`ContinuousBatchingKVCacheCollection.write_kv
<hcache.continuous.collection.ContinuousBatchingKVCacheCollection.write_kv>` and
:meth:`PagedKVPool.write_kv <hcache.contexts.paged_kv_pool.PagedKVPool.write_kv>`
(docs/design.md §3.7, §4.9).

A write into an FP8 cache takes rows of the cache's storage dtype (bytes, copied as they are)
or float32 / float16 / bfloat16 rows quantized as ``fp8(x / scale)``; a scale is a float, or a
float32 device table ``[num_layers]`` (per layer) or ``[num_layers, >= heads]`` (per head)
whose row is the writer's layer label. A write into any other cache takes no scale.
"""

from __future__ import annotations

import numpy as np

from ._checks import scalar_scale
from .dtypes import is_fp8, resolve_dtype, storage_dtype
from .runtime.arrays import as_array

__all__ = ["FLOAT_ROWS", "check_scale", "source_dtype"]

FLOAT_ROWS = tuple(resolve_dtype(n) for n in ("float32", "float16", "bfloat16"))


def source_dtype(name: str, dtype, cache_dtype, xp):
    """The float dtype of a quantizing write of rows of ``dtype``, or None for a plain write
    (rows of the cache dtype or its storage dtype).

    Raises
    ------
    ValueError
        ``dtype`` is neither the cache's nor (FP8 caches) a float the write quantizes.
    """
    cache_dtype = resolve_dtype(cache_dtype)
    if dtype in (cache_dtype, storage_dtype(cache_dtype, xp)):
        return None
    if is_fp8(cache_dtype):
        for d in FLOAT_ROWS:
            if dtype in (d, storage_dtype(d, xp)) and dtype != np.uint8:
                return d
        raise ValueError(f"{name}: expected dtype {cache_dtype}, float32, float16 or bfloat16 "
                         f"(quantized), got {dtype}")
    raise ValueError(f"{name}: expected dtype {cache_dtype}, got {dtype}")


def check_scale(name: str, scale, quantize: bool, device, num_layers: int, heads: int,
                stream=None):
    """``scale`` of a write checked: None (1.0) or a float (finite, > 0, as float32) or a
    C-contiguous float32 array of ``device`` (any array library, see
    :func:`hcache.arrays.as_array`; a foreign table orders ``stream``, the write's, after its
    producer) ``[num_layers]`` / ``[num_layers, >= heads]``; returns the value to pass to
    :func:`hcache.ops.kv_write_fp8`. A write that does not quantize (``quantize`` false) takes
    only None.

    Raises
    ------
    ValueError
        A scale for a plain write, a non-finite or non-positive float, a table of the wrong
        dtype, shape or contiguity, or a table on another device than ``device`` (a kernel
        launched there could not read it).
    TypeError
        A bool, or not an array of ``device``'s memory.
    """
    if not quantize:
        if scale is not None:
            raise ValueError(f"{name}: expected None (scales apply to float rows written "
                             f"into an FP8 cache), got {type(scale).__name__}")
        return None
    if scale is None:
        return 1.0
    value = scalar_scale(name, scale)
    if value is not None:
        return value
    scale = as_array(name, scale, device, stream)
    ok = scale.dtype == np.float32 and scale.ndim in (1, 2) and scale.flags.c_contiguous \
        and scale.shape[0] == num_layers and (scale.ndim == 1 or scale.shape[1] >= heads)
    if not ok:
        raise ValueError(f"{name}: expected a C-contiguous float32 array [{num_layers}] (per "
                         f"layer) or [{num_layers}, >= {heads}] (per head), got "
                         f"{scale.dtype} {list(scale.shape)}")
    return scale
