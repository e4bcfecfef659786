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

from .._checks import check_int, int32_array
from ..runtime.device import array_module_of, data_pointer
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
    ``[C, H_l, m_l, D]``, ``C = group.components``), one launch: ``m_l = num_tokens``, or for a
    ring layer of window ``W`` the last ``min(num_tokens, W)`` positions in order
    (``group.held_tokens``). A ring holds the right tokens when ``num_tokens`` is the slot's
    length (or the ring has not wrapped past it). Raises ``IndexError`` / ``ValueError`` before
    touching anything."""
    _check_slot_and_length(group, slot, num_tokens)
    slot, num_tokens = int(slot), int(num_tokens)
    for j, t in enumerate(out):
        m = group.held_tokens(j, num_tokens)
        if getattr(t, "ndim", 0) == 4 and t.shape[2] != m:
            raise ValueError(f"out[{j}]: expected {m} tokens, got {t.shape[2]}")
    run = _checked_launcher(group, out, None, stream, backend)
    if run is None:
        return ref.kv_capture(group, slot, num_tokens, out)
    _launch(run, group, slot, num_tokens, out, False, None)


def kv_restore(group, saved, slot, *, num_tokens=None, more_slots=None, stream=None,
               backend=None):
    """Copy every ``saved[l]`` (``[C, H_l, m_l, D]``, as :func:`kv_capture` gives them for an
    ``n``-token prefix) into ``slot`` of layer ``l``, one launch: tokens ``[0, n)``, or a ring
    layer's last ``min(n, W)`` at their ring entries. ``num_tokens`` is ``n``; by default it is
    read from the tensors (an unbounded layer's count, or a ring's count below its window) and
    required when every layer is a full ring. ``more_slots`` (int32 ``[k]`` of the group's
    array module, read at launch) are further targets of the same launch (one prompt restored
    into ``1 + k`` slots); a target out of range is skipped and counted, as in
    :func:`kv_prefix_copy`. Validates everything else before touching anything."""
    if len(saved) != group.num_layers:
        raise ValueError(f"saved: expected {group.num_layers} tensors, got {len(saved)}")
    n = prefix_length(group, saved, num_tokens, "saved")
    _check_slot_and_length(group, slot, n)
    slot = int(slot)
    if more_slots is not None:
        int32_array("more_slots", more_slots, group.xp)
    run = _checked_launcher(group, saved, None, stream, backend)
    if run is None:
        return ref.kv_restore(group, saved, slot, num_tokens=n, more_slots=more_slots)
    _launch(run, group, slot, n, saved, True, None, more_slots)


def prefix_length(group, saved, num_tokens, name, length_name="num_tokens") -> int:
    """The prefix length ``n`` that per-layer tensors ``saved`` (``[C, H_l, m_l, D]``) hold:
    ``num_tokens`` when given (checked against every ``m_l``), else read from the tensors.

    Raises
    ------
    ValueError
        The token counts disagree, or every layer is a ring holding its full window (then
        ``n`` cannot be read from the tensors and ``num_tokens`` is required).
    """
    counts = [int(t.shape[2]) if getattr(t, "ndim", 0) == 4 else 0 for t in saved]
    if num_tokens is None:
        known = {m for p, m in enumerate(counts)
                 if not group.ring_windows[p] or m < group.ring_windows[p]}
        if len(known) > 1:
            raise ValueError(f"{name}: expected one token count for every layer, "
                             f"got {sorted(known)}")
        if not known:
            if not counts:
                return 0
            raise ValueError(f"{length_name}: expected the captured prefix length (every "
                             f"layer is a full ring buffer), got None")
        n = known.pop()
    else:
        n = check_int(length_name, num_tokens, 0)
    for p, m in enumerate(counts):
        want = group.held_tokens(p, n)
        if m != want:
            raise ValueError(f"{name}[{p}]: expected {want} tokens (of a {n}-token prefix), "
                             f"got {m}")
    return n


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
    cap = min(group.max_tokens(p) for p in range(group.num_layers))
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
    return launcher(xp, backend, stream, group.device_layer_infos)


def _launch(run, group, slot, num_tokens, compact, to_cache, status, more_slots=None):
    """Upload the compact tensors' table and launch ``hc_kv_capture`` (nothing for 0 tokens);
    ``more_slots``: further restore targets, one block group of grid.x each."""
    if num_tokens == 0:
        return
    num_more = 0 if more_slots is None else int(more_slots.shape[0])
    table = pack_kv_layer_infos([data_pointer(t) for t in compact],
                                [int(t.shape[1]) for t in compact],
                                [int(t.shape[2]) for t in compact])
    upload_table(run, group, table)
    held = max(group.held_tokens(p, num_tokens) for p in range(group.num_layers))
    grid = ((1 + num_more) * group.components * group.max_kv_heads, group.num_layers,
            grid_z(held * group.row_bytes))
    run.launch("kv_capture", "hc_kv_capture", grid, (BLOCK, 1, 1),
               (ptr(group.device_layer_infos), ptr(group.scratch_infos), i32(slot),
                i32(num_tokens), i32(group.components), i32(group.row_bytes),
                i32(group.num_slots), i32(1 if to_cache else 0), ptr(status),
                ptr(more_slots if num_more else None), i32(num_more)))
