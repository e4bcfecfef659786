"""Prompt-cache capture and restore (kernels/kv_capture.cu, docs/design.md §3.5).

One kernel, ``hc_kv_capture``, copies the first tokens of one slot of every layer of a group to
or from compact per-layer tensors ``[C, H_l, n, D]`` (``C = group.components``: 2 for K and V,
1 for a latent cache; its ``to_cache`` argument is the direction). Ops:
:func:`kv_capture` (cache -> tensors) and :func:`kv_restore` (tensors -> cache) check the slot
and the length first; :func:`kv_prefix_copy` launches the kernel unchecked, either direction,
and counts what the kernel skips in ``status``.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_int
from ..device import array_module_of, data_pointer
from . import reference as ref
from ._launch import (
    BLOCK,
    check_status,
    grid_z,
    i32,
    launcher,
    ptr,
    upload_table,
)
from .tables import pack_kv_layer_infos

__all__ = ["kv_capture", "kv_restore", "kv_prefix_copy"]


def kv_capture(group, slot, num_tokens, out, *, stream=None, backend=None):
    """Copy tokens ``[0, num_tokens)`` of ``slot`` of every layer into ``out`` (list of
    ``[C, H_l, num_tokens, D]``), one launch. Raises ``IndexError`` / ``ValueError`` before
    touching anything."""
    _check_slot_and_length(group, slot, num_tokens)
    for j, t in enumerate(out):
        if t.ndim == 4 and t.shape[2] != num_tokens:
            raise ValueError(f"out[{j}]: expected {num_tokens} tokens, got {t.shape[2]}")
    slot, num_tokens = int(slot), int(num_tokens)
    run = _checked_launcher(group, out, None, stream, backend)
    if run is None:
        return ref.kv_capture(group, slot, num_tokens, out)
    _launch(run, group, slot, num_tokens, out, False, None)


def kv_restore(group, saved, slot, *, stream=None, backend=None):
    """Copy every ``saved[l]`` (``[C, H_l, n, D]``, one ``n`` for all) into tokens ``[0, n)``
    of ``slot`` of layer ``l``, one launch. Validates everything before touching anything."""
    if len(saved) != group.num_layers:
        raise ValueError(f"saved: expected {group.num_layers} tensors, got {len(saved)}")
    lengths = {int(t.shape[2]) for t in saved if t.ndim == 4}
    if len(lengths) > 1:
        raise ValueError(f"saved: expected one token count for every layer, got {sorted(lengths)}")
    n = lengths.pop() if lengths else 0
    _check_slot_and_length(group, slot, n)
    slot = int(slot)
    run = _checked_launcher(group, saved, None, stream, backend)
    if run is None:
        return ref.kv_restore(group, saved, slot)
    _launch(run, group, slot, n, saved, True, None)


def kv_prefix_copy(group, slot, num_tokens, compact, *, to_cache, status=None, stream=None,
                   backend=None):
    """Copy tokens ``[0, num_tokens)`` of ``slot`` of every layer of ``group`` to or from
    ``compact`` (one ``[C, H_l, n, D]`` tensor per layer, ``n >= num_tokens``), one launch.
    The slot and the length are not checked: a layer the kernel cannot copy is skipped and
    counted in ``status[0]``. Prefer :func:`kv_capture` / :func:`kv_restore`.
    """
    slot = check_int("slot", slot)
    num_tokens = check_int("num_tokens", num_tokens)
    run = _checked_launcher(group, compact, status, stream, backend)
    if run is None:
        return ref.kv_prefix_copy(group, slot, num_tokens, compact, to_cache=to_cache,
                                  status=status)
    _launch(run, group, slot, num_tokens, compact, to_cache, status)


def _check_slot_and_length(group, slot, num_tokens):
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
        raise TypeError(f"slot: expected an int, got {type(slot).__name__}")
    if not 0 <= int(slot) < group.num_slots:
        raise IndexError(f"slot: expected a slot in [0, {group.num_slots}), got {int(slot)}")
    cap = min(group.max_seq_lens)
    if not 0 <= int(num_tokens) <= cap:
        raise ValueError(f"num_tokens: expected a length in [0, {cap}], got {int(num_tokens)}")


def _checked_launcher(group, compact, status, stream, backend):
    """Check what every op of the family shares (an HND group, one C-contiguous
    ``[C, H_l, n, D]`` tensor of the group's dtype and module per layer, ``status``); return
    the launcher (``None``: the NumPy reference)."""
    xp = group.xp
    if group.layout != "HND":
        raise ValueError("group: expected an HND group, got NHD")
    if len(compact) != group.num_layers:
        raise ValueError(f"compact: expected {group.num_layers} tensors, got {len(compact)}")
    for j, (t, heads) in enumerate(zip(compact, group.num_kv_heads)):
        if array_module_of(t) is not xp:
            raise TypeError(f"compact[{j}]: expected a {xp.__name__} array, "
                            f"got {type(t).__name__}")
        c = group.components
        if t.ndim != 4 or t.shape[0] != c or t.shape[1] != heads \
                or t.shape[3] != group.head_dim:
            raise ValueError(f"compact[{j}]: expected shape [{c}, {heads}, n, {group.head_dim}], "
                             f"got {tuple(t.shape)}")
        if t.dtype != group.dtype:
            raise ValueError(f"compact[{j}]: expected dtype {group.dtype}, got {t.dtype}")
        if not t.flags.c_contiguous:
            raise ValueError(f"compact[{j}]: expected a C-contiguous array")
    check_status(status, xp)
    return launcher(xp, backend, stream)


def _launch(run, group, slot, num_tokens, compact, to_cache, status):
    """Upload the compact tensors' table and launch ``hc_kv_capture`` (nothing for 0 tokens)."""
    if num_tokens == 0:
        return
    table = pack_kv_layer_infos([data_pointer(t) for t in compact],
                                [int(t.shape[1]) for t in compact],
                                [int(t.shape[2]) for t in compact])
    upload_table(run, group, table)
    grid = (group.components * group.max_kv_heads, group.num_layers,
            grid_z(num_tokens * group.row_bytes))
    run.launch("kv_capture", "hc_kv_capture", grid, (BLOCK, 1, 1),
               (ptr(group.device_layer_infos), ptr(group.scratch_infos), i32(slot),
                i32(num_tokens), i32(group.components), i32(group.row_bytes),
                i32(group.num_slots), i32(1 if to_cache else 0), ptr(status)))
