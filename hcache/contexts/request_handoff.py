"""A request of a :class:`~hcache.contexts.DynamicInferenceContext` handed from one engine to
another (docs/design.md §10.1): what the sending side offers, and the receiving side's
admission, completion and abandonment of a request whose caches a transfer fills.

The receiving side admits the request through the normal path (``add_request``: the prefix
match pins the blocks its own cache holds, the rest are allocated, a row and a live Mamba slot
taken) and *parks* its row: the prompt stays scheduled, but no ``commit_step`` completes it,
``write_kv`` and ``release_requests`` refuse it, and its Mamba boundary snapshots are dropped
(the model computes none of them). :func:`complete` makes it live as a prefill step would
(computed through its length, its complete blocks registered); :func:`abandon` zeroes what the
transfer wrote and releases it (its blocks return to the allocator, nothing registered).
"""

from __future__ import annotations

import numpy as np

__all__ = ["offer", "admit_parked", "complete", "abandon", "zero_filled"]


def offer(ctx, request_id):
    """What a context holds of an active request: ``(tokens int64 [n], block_ids int32
    [ceil(n / block_size)], live Mamba slot)``, copies.

    Raises
    ------
    TypeError
        ``request_id`` is not hashable.
    ValueError
        ``request_id`` is not active, has a scheduled step (its caches are not final) or is
        itself being filled by a transfer.
    """
    requests = ctx._requests
    row = requests.row(request_id)
    if requests.pending_end[row] >= 0:
        raise ValueError(f"request_id: expected a request without a scheduled step (call "
                         f"commit_step first), got {request_id!r}")
    n = int(requests.lengths[row])
    return (requests.tokens[row, :n].copy(), requests.blocks(row),
            int(requests.request_to_mamba_state_idx[row]))


def admit_parked(ctx, request_id, tokens, *, salt=None, extra_keys=None):
    """Admit ``request_id`` with ``tokens`` (``ctx.add_request``, which raises alike and
    changes nothing when it refuses) and park its row for a transfer.

    Returns
    -------
    StepPlan
        ``num_matched_blocks`` leading blocks are the receiving side's own cached ones (the
        transfer does not write them); the rest are new.

    Raises
    ------
    ValueError
        The context has a local block space (``num_local_blocks``): its window blocks are not
        transferred (nothing changes).
    """
    if ctx.window_blocks is not None:
        raise ValueError("ctx: expected a context without a local block space, got "
                         "num_local_blocks set (its window blocks are not transferred)")
    plan = ctx.add_request(request_id, tokens, salt=salt, extra_keys=extra_keys)
    if ctx.mamba_slot_allocator is not None:
        ctx.mamba_slot_allocator._clear_intermediate_state([plan.row])
    ctx._requests.parked[plan.row] = True
    return plan


def complete(ctx, request_id) -> int:
    """Make a parked request live: computed through its length and its complete blocks
    registered, as ``commit_step`` does after a prefill step. Returns the blocks registered."""
    requests = ctx._requests
    row = requests.row(request_id)
    before, end = int(requests.computed[row]), int(requests.lengths[row])
    requests.parked[row] = False
    requests.computed[row], requests.pending_end[row] = end, -1
    return ctx._registration.commit(np.array([row]), np.array([before]), np.array([end]))


def zero_filled(ctx, request_id, first_block: int) -> None:
    """Zero what a transfer may have written for a parked request: its blocks from column
    ``first_block`` on (every layer) and its live Mamba states."""
    requests = ctx._requests
    row = requests.row(request_id)
    blocks = requests.blocks(row)[first_block:]
    with ctx.device.scope():
        if len(blocks):
            ids = ctx.xp.asarray(blocks.astype(np.int64))
            for layer in ctx.kv_pool.layers:
                layer[ids] = 0
        slot = int(requests.request_to_mamba_state_idx[row])
        for states in (ctx.mamba_conv_states, ctx.mamba_ssm_states):
            if states is not None and ctx.num_mamba_layers:
                states[:, slot] = 0


def abandon(ctx, request_id) -> None:
    """Release a parked request (its blocks back to the allocator; nothing of it registered,
    since registration follows :func:`complete` only)."""
    ctx._requests.parked[ctx._requests.row(request_id)] = False
    ctx.release_requests([request_id])
