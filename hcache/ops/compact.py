"""Batch compaction (kernels/compact.cu, docs/design.md §3.3): the plan, KV moves, whole-slot
moves. Ops: :func:`compaction_plan` (``hc_compaction_plan``), :func:`kv_compact`
(``hc_kv_compact``), :func:`slots_compact` (``hc_slots_compact``)."""

from __future__ import annotations

from .._checks import check_int, int32_array
from ..runtime.device import array_module_of, data_pointer
from . import reference as ref
from ._launch import (
    BLOCK,
    LaunchMemo,
    ceil_div,
    check_plan,
    grid_x,
    grid_z,
    i32,
    launcher,
    ptr,
)

PLAN_THREADS = 1024  # the plan kernel's block (and HC_PLAN_NODES)
IN_FLIGHT = 4        # chunks per thread of a copy kernel's tile (HC_COMPACT_IN_FLIGHT)

__all__ = ["compaction_plan", "kv_compact", "slots_compact"]


def compaction_plan(mapping, old_batch, new_batch, plan, *, lengths=None, stream=None,
                    backend=None):
    """Build the in-place move schedule of a batch compaction into ``plan``.

    Parameters
    ----------
    mapping : int32 [>= old_batch]
        ``mapping[old]`` = new slot in ``[0, new_batch)``, or -1 (evicted).
    old_batch, new_batch : int
        Batch sizes, each in ``[0, max_batch]``.
    plan : int32 [compaction_plan_size(max_batch)]
        Written in place: ``plan[0]`` = 0 (valid), 1 (not injective into ``[0, new_batch)``) or
        2 (bad batch sizes); the copy kernels do nothing for an invalid plan.
    lengths : int32 [max_batch], optional
        Current lengths, for the longest moved span (``plan[2]``): :func:`kv_compact` moves
        no token at or past it, so without ``lengths`` it moves no KV data at all.
    """
    key = (plan, mapping, old_batch, new_batch, lengths, stream)
    if backend is None and _PLANS.launch(key, stream):
        return   # the arguments of a checked launch again
    old_batch = check_int("old_batch", old_batch)
    new_batch = check_int("new_batch", new_batch)
    xp = array_module_of(plan)
    max_batch = check_plan(plan, xp)
    int32_array("mapping", mapping, xp, min_len=old_batch)
    int32_array("lengths", lengths, xp, min_len=max_batch)
    run = launcher(xp, backend, stream, plan)
    if run is None:
        return ref.compaction_plan(mapping, old_batch, new_batch, plan, lengths=lengths)
    # one block, a thread per slot (a larger max_batch: the kernel's serial path)
    threads = min(PLAN_THREADS, max(32, ceil_div(max_batch, 32) * 32))
    _PLANS.run(run, key, "compact", "hc_compaction_plan", (1, 1, 1), (threads, 1, 1),
               (ptr(mapping), i32(old_batch), i32(new_batch), i32(max_batch),
                ptr(lengths), ptr(plan)))


def kv_compact(group, plan, lengths, *, stream=None, backend=None):
    """Move the first ``lengths[old]`` tokens of every kept slot of every layer of ``group``
    (one launch), every component (K and V, or a latent cache's one). ``group`` must be HND.
    In place; ``lengths`` are the pre-compaction lengths
    ``int32 [num_slots]`` (the ones the plan was built with: no token at or past the plan's
    longest span ``plan[2]`` moves). The plan must be for at most ``group.num_slots`` slots."""
    key = (group, plan, lengths, stream)
    if backend is None and _KV_MOVES.launch(key, stream):
        return   # the arguments of a checked launch again
    xp = group.xp
    if group.layout != "HND":
        raise ValueError("group: expected an HND group for compaction, got NHD")
    max_batch = check_plan(plan, xp, group.num_slots)
    int32_array("lengths", lengths, xp, min_len=group.num_slots)
    run = launcher(xp, backend, stream, plan)
    if run is None:
        return ref.kv_compact(group, plan, lengths)
    span = max(group.max_seq_lens) * group.row_bytes
    grid = (group.components * group.max_kv_heads, group.num_layers, grid_z(span))
    _KV_MOVES.run(run, key, "compact", "hc_kv_compact", grid, (BLOCK, 1, 1),
                  (ptr(group.device_layer_infos), ptr(plan), i32(max_batch),
                   ptr(lengths), i32(group.components), i32(group.row_bytes),
                   i32(group.num_slots)))


def slots_compact(slots, plan, *, stream=None, backend=None):
    """Move whole slots of every tensor of ``slots`` by the plan (one launch); slots below
    ``new_batch`` that receive nothing are zeroed. In place (each pair is ``(t, t)``); the plan
    must be for at most as many slots as every tensor has."""
    key = (slots, plan, stream)
    if backend is None and _SLOT_MOVES.launch(key, stream):
        return   # the arguments of a checked launch again
    xp = slots.xp
    for i, (s, d) in enumerate(slots.pairs):
        if s is not d and data_pointer(s) != data_pointer(d):
            raise ValueError(f"slots.pairs[{i}]: expected an in-place pair (t, t)")
    max_batch = check_plan(plan, xp, min(int(s.shape[0]) for s, _ in slots.pairs))
    run = launcher(xp, backend, stream, plan)
    if run is None:
        return ref.slots_compact(slots, plan)
    grid = (grid_x(ceil_div(slots.max_slot_bytes, 16 * IN_FLIGHT)), slots.num_tensors, 1)
    _SLOT_MOVES.run(run, key, "compact", "hc_slots_compact", grid, (BLOCK, 1, 1),
                    (ptr(slots.device_infos), ptr(plan), i32(max_batch)))


# The last checked launch of each op (the step plans of docs/design.md §8).
_PLANS, _KV_MOVES, _SLOT_MOVES = LaunchMemo(), LaunchMemo(), LaunchMemo()
