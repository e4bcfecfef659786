"""Batched per-layer KV writes (kernels/kv_write.cu, docs/design.md §3.2). Op: :func:`kv_write`
(``hc_kv_write``)."""

from __future__ import annotations

import numpy as np

from .._checks import check_int, int32_array
from ..device import array_module_of, data_pointer
from . import reference as ref
from ._launch import (
    BLOCK,
    ceil_div,
    check_status,
    grid_x,
    i32,
    i64,
    launcher,
    ptr,
    upload_table,
)

__all__ = ["kv_write"]


def _check_rows(kind, j, a, group, layer, num_tokens, xp):
    heads = group.num_kv_heads[layer]
    name = f"{kind}[{j}]"
    if type(a) is not xp.ndarray and array_module_of(a) is not xp:
        raise TypeError(f"{name}: expected a {xp.__name__} array, got {type(a).__name__}")
    if a.shape != (num_tokens, heads, group.head_dim):
        want = (num_tokens, heads, group.head_dim)
        raise ValueError(f"{name}: expected shape {want}, got {tuple(a.shape)}")
    if a.dtype != group.dtype:
        raise ValueError(f"{name}: expected dtype {group.dtype}, got {a.dtype}")
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


def kv_write(group, k, v, *, layers=None, seq_offsets=None, uniform_tokens=0, batch=None,
             cache_lengths=None, positions=None, row_to_slot=None, block_table=None,
             status=None, stream=None, backend=None):
    """Write new tokens' K and V into the caches of ``group`` (one launch).

    Parameters
    ----------
    group : KVGroup
        HND caches ``[num_slots, 2, H_l, S, D]`` (contiguous slots; with ``block_table`` a paged
        pool whose ``S`` is the block size) or NHD caches ``[num_slots, 2, S, H, D]``.
    k, v : arrays ``[num_tokens, H_l, D]``
        One layer's new rows when ``layers`` is an int; else lists, one per layer of the group.
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
        A shape, dtype or array module does not match the group.
    """
    xp = group.xp
    if layers is None:
        positions_in_group = list(range(group.num_layers))
        ks, vs = list(k), list(v)
        if len(ks) != group.num_layers or len(vs) != group.num_layers:
            raise ValueError(f"k, v: expected {group.num_layers} arrays each, "
                             f"got {len(ks)} and {len(vs)}")
    else:
        if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)):
            raise TypeError(f"layers: expected an int or None, got {type(layers).__name__}")
        if not 0 <= int(layers) < group.num_layers:
            raise IndexError(f"layers: expected a group position in [0, {group.num_layers}), "
                             f"got {int(layers)}")
        positions_in_group = [int(layers)]
        ks, vs = [k], [v]
    num_tokens = int(ks[0].shape[0]) if ks[0].ndim else 0
    for j, li in enumerate(positions_in_group):
        _check_rows("k", j, ks[j], group, li, num_tokens, xp)
        _check_rows("v", j, vs[j], group, li, num_tokens, xp)
    uniform_tokens = check_int("uniform_tokens", uniform_tokens)
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
    run = launcher(xp, backend, stream)
    if run is None:
        return ref.kv_write(group, k, v, layers=layers, seq_offsets=seq_offsets,
                            uniform_tokens=uniform_tokens, batch=batch,
                            cache_lengths=cache_lengths, positions=positions,
                            row_to_slot=row_to_slot, block_table=block_table, status=status)
    if num_tokens == 0:
        return
    if layers is None:
        table = np.array([[data_pointer(a), data_pointer(b)] for a, b in zip(ks, vs)],
                         dtype=np.uint64)
        upload_table(run, group, table)
        srcs, k_ptr, v_ptr, offset = group.scratch_infos, np.uint64(0), np.uint64(0), 0
    else:
        srcs, k_ptr, v_ptr, offset = None, ptr(ks[0]), ptr(vs[0]), int(layers)
    max_blocks = int(block_table.shape[1]) if block_table is not None else 0
    heads = max(group.num_kv_heads[i] for i in positions_in_group)
    rows = num_tokens * 2 * heads * ceil_div(group.row_bytes, 16)
    grid = (grid_x(rows), len(positions_in_group), 1)
    slot_s, kv_s, head_s, tok_s = group.byte_strides
    run.launch("kv_write", "hc_kv_write", grid, (BLOCK, 1, 1),
               (ptr(group.device_layer_infos), i32(offset), ptr(srcs), k_ptr, v_ptr,
                ptr(seq_offsets), i32(uniform_tokens), i32(batch), i32(num_tokens),
                ptr(cache_lengths), ptr(positions), ptr(row_to_slot), ptr(block_table),
                i32(max_blocks), i32(group.num_slots), i32(group.row_bytes),
                i64(slot_s), i64(kv_s), i64(head_s), i64(tok_s), ptr(status)))
