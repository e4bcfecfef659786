"""The invariants a :class:`~hcache.contexts.dynamic_context.DynamicInferenceContext` and its
collaborators must agree on (docs/design.md §6.5), recounted from scratch: for tests and
debugging, never on a step's path.

Each collaborator states its own invariants (the request table, the KV block allocator, the
local block space of sliding-window layers, the Mamba slot allocator: ``broken_invariants`` /
``check_invariants``); what is checked here besides is their agreement: every active request
holds one reference on each block of its block-table row.
"""

from __future__ import annotations

import numpy as np

__all__ = ["broken_context_invariants"]


def broken_context_invariants(requests, kv_block_allocator, window_blocks=None,
                              mamba_slot_allocator=None, registration=None) -> list[str]:
    """Every broken invariant of the collaborators and of their agreement, one message each;
    empty when all hold.

    Parameters
    ----------
    requests : RequestTable
        It rehashes every request.
    kv_block_allocator : KVBlockAllocator
    window_blocks : WindowBlocks or None
        The local block space, when the pool has one.
    mamba_slot_allocator : MambaSlotAllocator or None
    registration : BlockRegistration or None
        The registration backlog; its deferred blocks are the only ones whose Mamba states
        await a hash.

    Returns
    -------
    list of str
    """
    problems = requests.broken_invariants()
    if (requests.parked & (requests.pending_end < 0)).any():
        problems.append("a row parked for a transfer has no scheduled step")
    held = np.zeros(kv_block_allocator.num_blocks, np.int64)
    for rid in requests.ids:
        np.add.at(held, requests.blocks(requests.row(rid)), 1)
    if (held > kv_block_allocator.block_ref_counts).any():
        problems.append("a request holds a block without a reference")
    if (held < kv_block_allocator.block_ref_counts).any():
        problems.append("a block keeps a reference no request holds (a leak)")
    if window_blocks is not None:
        problems += window_blocks.broken_invariants(requests)
    if registration is not None:
        problems += registration.broken_invariants()
        awaiting = getattr(getattr(mamba_slot_allocator, "_hashes", None), "awaiting", None)
        if awaiting is not None and (awaiting & ~registration.deferred).any():
            problems.append("a Mamba state awaits the hash of a block not in the backlog")
    for owner in (kv_block_allocator, mamba_slot_allocator):
        try:
            if owner is not None:
                owner.check_invariants()
        except RuntimeError as exc:
            problems.append(str(exc))
    return problems
