"""Batched per-layer KV writes (kernels/kv_write.cu, docs/design.md §3.2, §3.7). Ops:
:func:`kv_write` (``hc_kv_write``: rows of bytes) and :func:`kv_write_fp8` (``hc_kv_write_fp8``:
float rows quantized into an FP8 cache on the way)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._checks import check_int, int32_array, scalar_scale
from ..dtypes import resolve_dtype
from ..runtime.device import array_module_of, data_pointer
from . import _loader
from . import reference as ref
from ._launch import (
    BLOCK,
    WARP,
    CupyLauncher,
    check_status,
    cuda_device,
    f32,
    grid_x,
    i32,
    i64,
    launcher,
    ptr,
    upload_table,
    warps_per_token,
)
from .write_plan import KVWritePlan

__all__ = ["kv_write", "kv_write_fp8"]

_FP8_CODES = {np.dtype(ml_dtypes.float8_e4m3fn): 0, np.dtype(ml_dtypes.float8_e5m2): 1}
_SRC_CODES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(ml_dtypes.bfloat16): 2}
_UINT_OF_SIZE = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def _check_rows(kind, j, a, group, layer, num_tokens, xp, dtypes):
    heads = group.num_kv_heads[layer]
    name = f"{kind}[{j}]"
    if type(a) is not xp.ndarray and array_module_of(a) is not xp:
        raise TypeError(f"{name}: expected a {xp.__name__} array, got {type(a).__name__}")
    if a.shape != (num_tokens, heads, group.head_dim):
        want = (num_tokens, heads, group.head_dim)
        raise ValueError(f"{name}: expected shape {want}, got {tuple(a.shape)}")
    if a.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, "
                         f"got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")


def _check_index_arrays(xp, batch, num_tokens, seq_offsets, cache_lengths, positions,
                        row_to_slot, block_table, status):
    """The index arrays of a write (each optional): int32, C-contiguous, long enough."""
    if seq_offsets is not None:
        int32_array("seq_offsets", seq_offsets, xp, min_len=batch + 1)
    if cache_lengths is not None:
        int32_array("cache_lengths", cache_lengths, xp, min_len=batch)
    if positions is not None:
        int32_array("positions", positions, xp, min_len=num_tokens)
    if row_to_slot is not None:
        int32_array("row_to_slot", row_to_slot, xp, min_len=batch)
    if block_table is not None:
        int32_array("block_table", block_table, xp, min_len=batch, ndim=2)
    if status is not None:
        check_status(status, xp)


def _check_write(group, k, v, layers, seq_offsets, uniform_tokens, batch, cache_lengths,
                 positions, row_to_slot, block_table, status, dtypes):
    """Every check of a write; returns ``(launched group positions, ks, vs, num_tokens,
    uniform_tokens, batch)``."""
    xp = group.xp
    latent = group.components == 1
    if v is None and not latent:
        raise ValueError("v: expected V rows (the group's caches have a V plane), got None")
    if layers is None:
        launched = list(range(group.num_layers))
        ks = list(k)
        vs = [None] * len(ks) if latent and v is None else list(v)
        if len(ks) != group.num_layers or len(vs) != group.num_layers:
            raise ValueError(f"k, v: expected {group.num_layers} arrays each, "
                             f"got {len(ks)} and {len(vs)}")
    else:
        if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)):
            raise TypeError(f"layers: expected an int or None, got {type(layers).__name__}")
        if not 0 <= int(layers) < group.num_layers:
            raise IndexError(f"layers: expected a group position in [0, {group.num_layers}), "
                             f"got {int(layers)}")
        launched = [int(layers)]
        ks, vs = [k], [v]
    num_tokens = int(ks[0].shape[0]) if getattr(ks[0], "ndim", 0) else 0
    for j, li in enumerate(launched):
        _check_rows("k", j, ks[j], group, li, num_tokens, xp, dtypes)
        if latent:
            if vs[j] is not None:
                raise ValueError(f"v[{j}]: expected None (a latent cache has no V), "
                                 f"got {type(vs[j]).__name__}")
        else:
            _check_rows("v", j, vs[j], group, li, num_tokens, xp, dtypes)
    uniform_tokens = check_int("uniform_tokens", uniform_tokens, 0)
    int32_array("seq_offsets", seq_offsets, xp)
    if batch is None:
        batch = (int(seq_offsets.shape[0]) - 1 if seq_offsets is not None
                 else (num_tokens // uniform_tokens if uniform_tokens > 0 else 0))
    batch = check_int("batch", batch)
    if batch < 0:
        raise ValueError(f"batch: expected >= 0, got {batch}")
    if seq_offsets is None and uniform_tokens <= 0:
        raise ValueError("seq_offsets: expected seq_offsets or uniform_tokens > 0 (rows of the "
                         f"tokens), got neither (uniform_tokens={uniform_tokens})")
    _check_index_arrays(xp, batch, num_tokens, seq_offsets, cache_lengths, positions,
                        row_to_slot, block_table, status)
    return launched, ks, vs, num_tokens, uniform_tokens, batch


def _sources(run, group, layers, ks, vs):
    """``(srcs, k_ptr, v_ptr, layer_offset)``: the per-layer pointer table (uploaded into the
    group's scratch) for every layer, the two pointers for one."""
    if layers is None:
        table = np.array([[data_pointer(a), 0 if b is None else data_pointer(b)]
                          for a, b in zip(ks, vs)], dtype=np.uint64)
        upload_table(run, group, table)
        return group.scratch_infos, np.uint64(0), np.uint64(0), 0
    return None, ptr(ks[0]), ptr(vs[0]), int(layers)


def kv_write(group, k, v, *, layers=None, seq_offsets=None, uniform_tokens=0, batch=None,
             cache_lengths=None, positions=None, row_to_slot=None, block_table=None,
             status=None, stream=None, backend=None):
    """Write new tokens' K and V into the caches of ``group`` (one launch).

    Parameters
    ----------
    group : KVGroup
        HND caches ``[num_slots, C, H_l, S, D]`` (contiguous slots; with ``block_table`` a paged
        pool whose ``S`` is the block size) or NHD caches ``[num_slots, C, S, H, D]``; ``C =
        group.components``.
    k, v : arrays ``[num_tokens, H_l, D]``
        One layer's new rows when ``layers`` is an int; else lists, one per layer of the group.
        A latent group (``C == 1``) takes its rows as ``k`` and ``v=None`` (or a list of None).
    layers : int or None
        The group position of the one layer to write; ``None`` writes every layer.
    seq_offsets : int32 [batch + 1], optional
        Ragged rows: token ``t`` belongs to row ``b`` when ``seq_offsets[b] <= t <
        seq_offsets[b+1]``; tokens past ``seq_offsets[batch]`` are padding.
    uniform_tokens : int
        Without ``seq_offsets``: every row has this many tokens (``b = t // uniform_tokens``).
    batch : int, optional
        Number of rows (default ``len(seq_offsets) - 1`` or ``num_tokens // uniform_tokens``).
    cache_lengths : int32 [batch], optional
        Row ``b``'s first token goes to position ``cache_lengths[b]`` (default 0).
    positions : int32 [num_tokens], optional
        Explicit positions (override ``cache_lengths``); -1 marks padding.
    row_to_slot : int32 [batch], optional
        Slot of each row for contiguous caches (default ``b``); -1 skips the row.
    block_table : int32 [batch, max_blocks_per_seq], optional
        Paged pools: position ``p`` of row ``b`` lives in block ``block_table[b, p // S]`` at
        ``p % S``; -1 skips.
    status : int32 [1], optional
        Incremented once per token skipped for being out of range (padding is not counted).
        With ``layers=None`` the first layer's ranges decide what is counted.

    No two tokens may land on the same (slot, position): on the GPU their order is unspecified.

    Raises
    ------
    ValueError, TypeError
        A shape, dtype or array module does not match the group; ``v`` given for a latent
        group, or missing for a K/V group.
    """
    step = (seq_offsets, uniform_tokens, batch, cache_lengths, positions, row_to_slot,
            block_table, status, stream)
    plan = group.write_plan
    if plan is not None and backend is None and plan.same_step(step) \
            and plan.launch(k, v, layers):
        return   # the step's arguments as planned, the rows checked
    launched, ks, vs, num_tokens, uniform_tokens, batch = _check_write(
        group, k, v, layers, seq_offsets, uniform_tokens, batch, cache_lengths, positions,
        row_to_slot, block_table, status, (group.dtype,))
    run = launcher(group.xp, backend, stream, group.device_layer_infos)
    if run is None:
        return ref.kv_write(group, k, v, layers=layers, seq_offsets=seq_offsets,
                            uniform_tokens=uniform_tokens, batch=batch,
                            cache_lengths=cache_lengths, positions=positions,
                            row_to_slot=row_to_slot, block_table=block_table, status=status)
    if num_tokens == 0:
        return
    launch = _launch_rows(run, "hc_kv_write", group, layers, ks, vs, launched, group.row_bytes,
                          (seq_offsets, uniform_tokens, batch, num_tokens, cache_lengths,
                           positions, row_to_slot, block_table), (), status)
    if isinstance(run, CupyLauncher):
        _plan(group, run, step, num_tokens, None if layers is None else int(layers), *launch)


def _plan(group, run, step, num_tokens, layers, grid, head, body):
    """Keep the step's validated arguments on ``group`` for the next layers' writes."""
    plan = group.write_plan
    if plan is None or not plan.same_step(step) or plan.num_tokens != num_tokens \
            or plan.body != body:
        kernel = _loader.get_function("kv_write", "hc_kv_write", run.device)
        plan = group.write_plan = KVWritePlan(group, kernel, cuda_device(run.device), step,
                                              num_tokens, head, body)
    plan.grids[layers] = grid


def _launch_rows(run, kernel, group, layers, ks, vs, launched, row_bytes, rows, extra, status):
    """Launch ``kernel`` of ``kv_write.cu`` over the rows of ``launched`` layers: the argument
    list both write kernels share (layer table, sources, row mapping, strides), with ``extra``
    (the quantizing kernel's codes and scales) between the row width and the strides. A token's
    rows (one per component and head, ``row_bytes`` each) are shared by
    :func:`~hcache.ops._launch.warps_per_token` warps; ``paged`` says
    explicitly that ``block_table`` is given (an empty table may have a null pointer)."""
    seq_offsets, uniform_tokens, batch, num_tokens, cache_lengths, positions, row_to_slot, \
        block_table = rows
    srcs, k_ptr, v_ptr, offset = _sources(run, group, layers, ks, vs)
    max_blocks = int(block_table.shape[1]) if block_table is not None else 0
    parts = warps_per_token(num_tokens, group.components * group.max_kv_heads, row_bytes)
    grid = (grid_x(num_tokens * parts * WARP), len(launched), 1)
    slot_s, kv_s, head_s, tok_s = group.byte_strides
    head = (ptr(group.device_layer_infos),)
    body = (ptr(seq_offsets), i32(uniform_tokens), i32(batch), i32(num_tokens), i32(parts),
            ptr(cache_lengths), ptr(positions), ptr(row_to_slot), ptr(block_table),
            i32(max_blocks), i32(block_table is not None), i32(group.num_slots),
            i32(group.components), i32(row_bytes),
            *extra,
            i64(slot_s), i64(kv_s), i64(head_s), i64(tok_s), ptr(status))
    run.launch("kv_write", kernel, grid, (BLOCK, 1, 1),
               (*head, i32(offset), ptr(srcs), k_ptr, v_ptr, *body))
    return grid, head, body   # what a plan of the step keeps (KVWritePlan)


def _fp8_dtypes(group, fp8_dtype, src_dtype, k):
    """``(fp8 dtype, source dtype, dtypes the rows may have)`` of a quantizing write."""
    fp8 = resolve_dtype(fp8_dtype, "fp8_dtype") if fp8_dtype is not None else group.dtype
    if fp8 not in _FP8_CODES:
        raise ValueError(f"fp8_dtype: expected float8_e4m3fn or float8_e5m2, got {fp8}")
    if group.dtype not in (fp8, np.dtype(np.uint8)):
        raise ValueError(f"group: expected {fp8} caches (or their uint8 storage), "
                         f"got {group.dtype}")
    if src_dtype is None:
        first = k[0] if isinstance(k, (list, tuple)) and k else k
        src_dtype = getattr(first, "dtype", None)
        if src_dtype is None:
            raise TypeError(f"k: expected a {group.xp.__name__} array (or a list of them), "
                            f"got {type(first).__name__}")
    src = resolve_dtype(src_dtype, "src_dtype")
    if src not in _SRC_CODES:
        raise ValueError(f"src_dtype: expected float32, float16 or bfloat16, got {src}")
    return fp8, src, (src, _UINT_OF_SIZE[src.itemsize])


def _scale_args(name, scale, group, launched):
    """``(pointer, layer stride, head stride, value)`` of ``k_scale`` / ``v_scale``: a float
    (every layer and head), a float32 ``[rows]`` (per layer) or ``[rows, heads]`` (per head)
    array whose row ``group.layer_indices[p]`` serves group position ``p``."""
    xp = group.xp
    value = scalar_scale(name, scale)
    if value is not None:
        return np.uint64(0), 0, 0, value
    if type(scale) is not xp.ndarray and array_module_of(scale) is not xp:
        raise TypeError(f"{name}: expected a float or a {xp.__name__} float32 array, "
                        f"got {type(scale).__name__}")
    if scale.dtype != np.float32 or scale.ndim not in (1, 2) or not scale.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous float32 [rows] or [rows, heads] "
                         f"array, got {scale.dtype} {tuple(scale.shape)}")
    rows = max(group.layer_indices[p] for p in launched) + 1
    heads = max(group.num_kv_heads[p] for p in launched)
    if scale.shape[0] < rows or (scale.ndim == 2 and scale.shape[1] < heads):
        want = f"[>= {rows}]" if scale.ndim == 1 else f"[>= {rows}, >= {heads}]"
        raise ValueError(f"{name}: expected a scale table {want} (rows: the group's "
                         f"layer_indices), got {tuple(scale.shape)}")
    strides = (1, 0) if scale.ndim == 1 else (int(scale.shape[1]), 1)
    return ptr(scale), strides[0], strides[1], 0.0


def kv_write_fp8(group, k, v, *, layers=None, seq_offsets=None, uniform_tokens=0, batch=None,
                 cache_lengths=None, positions=None, row_to_slot=None, block_table=None,
                 k_scale=1.0, v_scale=1.0, fp8_dtype=None, src_dtype=None, status=None,
                 stream=None, backend=None):
    """Quantize new tokens' K and V to FP8 and write them into the caches of ``group`` (one
    launch; docs/design.md §3.7).

    Tokens land exactly where :func:`kv_write` puts them; each element is stored as
    ``fp8(x / scale)``: IEEE float32 division, round to nearest even, saturating (finite
    values past the format's max and +-Inf become +-max), NaN kept as NaN with its sign.
    The bytes equal :func:`hcache.ops.reference.quantize_fp8` (``ml_dtypes`` cast of
    ``clip(float32(x) / scale, -max, max)``) bit for bit.

    Parameters
    ----------
    group : KVGroup
        FP8 caches (``float8_e4m3fn`` / ``float8_e5m2``, or ``uint8`` storage with
        ``fp8_dtype``), HND or NHD, as in :func:`kv_write`.
    k, v : float32, float16 or bfloat16 arrays ``[num_tokens, H_l, D]``, or lists of them
        One layer's rows when ``layers`` is an int, else one per layer of the group;
        C-contiguous. ``v`` is None for a latent group (and ``v_scale`` is then not used). A
        bfloat16 array that the array module cannot type may be given as ``uint16`` with
        ``src_dtype="bfloat16"``.
    layers, seq_offsets, uniform_tokens, batch, cache_lengths, positions, row_to_slot, \
block_table, status
        As in :func:`kv_write`.
    k_scale, v_scale : float, or float32 array ``[rows]`` or ``[rows, heads]``
        A float (finite, > 0; rounded to float32) for every layer and head; or a table on the
        group's device: group position ``p`` uses row ``group.layer_indices[p]`` (per layer),
        and column ``h`` of it for head ``h`` (per head). Table values are device data and are
        not checked: they should be finite and > 0.
    fp8_dtype : str or dtype, optional
        The cache format; default ``group.dtype`` (required for ``uint8`` storage).
    src_dtype : str or dtype, optional
        The rows' float type; default ``k``'s dtype.

    Raises
    ------
    ValueError, TypeError, IndexError
        As :func:`kv_write`; a cache that is not FP8, rows that are not float32 / float16 /
        bfloat16, a scale that is not finite and positive, a scale table of the wrong dtype or
        too small for the group's layer labels and head counts. Nothing is written.
    """
    fp8, src, dtypes = _fp8_dtypes(group, fp8_dtype, src_dtype, k)
    launched, ks, vs, num_tokens, uniform_tokens, batch = _check_write(
        group, k, v, layers, seq_offsets, uniform_tokens, batch, cache_lengths, positions,
        row_to_slot, block_table, status, dtypes)
    k_args = _scale_args("k_scale", k_scale, group, launched)
    v_args = _scale_args("v_scale", v_scale, group, launched)
    run = launcher(group.xp, backend, stream, group.device_layer_infos)
    if run is None:
        return ref.kv_write_fp8(group, k, v, layers=layers, seq_offsets=seq_offsets,
                                uniform_tokens=uniform_tokens, batch=batch,
                                cache_lengths=cache_lengths, positions=positions,
                                row_to_slot=row_to_slot, block_table=block_table,
                                k_scale=k_scale if k_args[0] else k_args[3],
                                v_scale=v_scale if v_args[0] else v_args[3],
                                fp8_dtype=fp8, src_dtype=src, status=status)
    if num_tokens == 0:
        return
    _launch_rows(run, "hc_kv_write_fp8", group, layers, ks, vs, launched, group.head_dim,
                 (seq_offsets, uniform_tokens, batch, num_tokens, cache_lengths, positions,
                  row_to_slot, block_table),
                 (i32(_SRC_CODES[src]), i32(_FP8_CODES[fp8]), ptr(group.device_layer_indices),
                  k_args[0], v_args[0], i32(k_args[1]), i32(k_args[2]), i32(v_args[1]),
                  i32(v_args[2]), f32(k_args[3]), f32(v_args[3])), status)
