"""The K/V rows of a paged write (docs/design.md §6): the checks :class:`PagedKVPool.write_kv`
makes on the arrays of one layer or of every layer, and on its block tables, before anything is
staged.

Rows are ``[num_tokens, H_i, D_i]`` per attention layer, C-contiguous, of one dtype (the first
``k``'s) and one token count; a latent layer (one component) takes its rows in ``k`` and None in
``v``. Arrays of any library are viewed as the pool's array module (``hcache.arrays.as_array``).
"""

from __future__ import annotations

import numpy as np

from .._checks import int32_array
from ..kv_scales import source_dtype
from ..runtime.arrays import as_array

__all__ = ["attention_index", "check_rows", "check_tables"]


def attention_index(num_layers: int, value, name: str = "i") -> int:
    """``value`` as an attention index in ``[0, num_layers)``.

    Raises
    ------
    TypeError
        ``value`` is not an int.
    IndexError
        ``value`` is out of range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not 0 <= int(value) < num_layers:
        raise IndexError(f"{name}: expected a layer in [0, {num_layers}), got {int(value)}")
    return int(value)


def check_rows(configs, device, k, v, layer, dtype, num_tokens=None):
    """The rows of a write, checked.

    Parameters
    ----------
    configs : tuple of KVLayerConfig
        The pool's layers.
    device : Device
    k, v : array ``[num_tokens, H, D]`` (with ``layer``) or lists of one per layer
    layer : int or None
        A checked attention index, or None for every layer.
    dtype : numpy dtype
        The pool's dtype: the first ``k``'s dtype is judged against it (a plain or a quantizing
        write) before any ``v`` is read, so a message names ``k`` first.
    num_tokens : int, optional
        The rows every layer must have (a step's scheduled tokens); None: as many as the
        first ``k``.

    Returns
    -------
    None (no layer to write) or (layer, ks, vs, first)
        ``ks``/``vs`` as given in form (one array, or lists), as the pool's arrays; ``first``
        the first K array (its dtype is the write's).

    Raises
    ------
    TypeError, ValueError
        A wrong count, array type, shape, dtype or layout, or V rows for a latent layer.
    """
    if layer is not None:
        k, v = as_array("k", k, device), _coerce(configs, device, "v", v, layer)
        num_tokens = _check_rows(configs, "k", k, layer, num_tokens, k)
        source_dtype("k", k.dtype, dtype, device.xp)
        _check_v(configs, "v", v, layer, num_tokens, k)
        return layer, k, v, k
    n = len(configs)
    ks = _per_layer(configs, device, "k", k)
    vs = [None] * n if v is None and all(lc.components == 1 for lc in configs) else \
        _per_layer(configs, device, "v", v)
    if not n:
        return None
    num_tokens = _check_rows(configs, "k[0]", ks[0], 0, num_tokens, ks[0])
    source_dtype("k[0]", ks[0].dtype, dtype, device.xp)
    for a in range(n):
        _check_rows(configs, f"k[{a}]", ks[a], a, num_tokens, ks[0])
        _check_v(configs, f"v[{a}]", vs[a], a, num_tokens, ks[0])
    return None, ks, vs, ks[0]


def _per_layer(configs, device, name, arrays) -> list:
    n = len(configs)
    if isinstance(arrays, (list, tuple)) and len(arrays) == n:
        if name == "v":
            return [_coerce(configs, device, f"v[{a}]", t, a) for a, t in enumerate(arrays)]
        return [as_array(f"{name}[{a}]", t, device) for a, t in enumerate(arrays)]
    got = len(arrays) if isinstance(arrays, (list, tuple)) else type(arrays).__name__
    raise ValueError(f"{name}: expected a list of {n} arrays (one per layer), got {got}")


def _coerce(configs, device, name, v, a):
    """V rows as the pool's array; None, and anything given for a latent layer, stay as they
    are for :func:`_check_v` to judge."""
    if v is None or configs[a].components == 1:
        return v
    return as_array(name, v, device)


def _check_v(configs, name, rows, a, num_tokens, first) -> None:
    """V rows of a layer with a V plane, or None for a latent layer."""
    if configs[a].components == 1:
        if rows is not None:
            raise ValueError(f"{name}: expected None (attention layer {a} is a latent cache: "
                             f"its rows go in k), got {type(rows).__name__}")
        return
    if rows is None:
        raise ValueError(f"{name}: expected V rows (attention layer {a} has a V plane), "
                         f"got None")
    _check_rows(configs, name, rows, a, num_tokens, first)


def _check_rows(configs, name, rows, a, num_tokens, first) -> int:
    lc = configs[a]
    n = int(rows.shape[0]) if rows.ndim == 3 else -1
    want = (num_tokens if num_tokens is not None else max(n, 0), lc.num_kv_heads, lc.head_dim)
    if tuple(rows.shape) != want:
        raise ValueError(f"{name}: expected shape {want}, got {tuple(rows.shape)}")
    if rows.dtype != first.dtype:
        raise ValueError(f"{name}: expected dtype {first.dtype} (as the first k), "
                         f"got {rows.dtype}")
    if not rows.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")
    return n


def check_tables(block_table, local_block_table, has_local_space: bool, xp) -> None:
    """The block tables of a write: int32 ``[batch, max_blocks]`` arrays of ``xp``, the local
    one required with a local block space and of the same batch, so that a write launched
    group by group (one table per block space) cannot fail on a table after a first launch.

    Raises
    ------
    TypeError
        A table is None where due, or not an ``xp`` array.
    ValueError
        A wrong dtype, rank or layout, or tables of different batches.
    """
    if block_table is None:
        raise TypeError("block_table: expected an int32 [batch, max_blocks] array, got None")
    if has_local_space and local_block_table is None:
        raise TypeError("local_block_table: expected an int32 [batch, max_blocks] array "
                        "(the pool has a local block space), got None")
    int32_array("block_table", block_table, xp, ndim=2)
    if local_block_table is not None:
        int32_array("local_block_table", local_block_table, xp, ndim=2)
        if local_block_table.shape[0] != block_table.shape[0]:
            raise ValueError(f"local_block_table: expected {block_table.shape[0]} rows (as "
                             f"block_table), got {local_block_table.shape[0]}")
