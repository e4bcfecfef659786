"""The invariants of a :class:`~hcache.contexts.dynamic_context.DynamicInferenceContext` as a
whole (docs/design.md §6): each part's own (the request table, the KV block allocator, the Mamba
slot allocator) and their agreement, each active request holding one reference on each block of
its table. For tests and debugging: the request table is rehashed, so the cost is linear in the
tokens of every live request.
"""

from __future__ import annotations

import numpy as np

__all__ = ["broken_invariants"]


def broken_invariants(requests, kv_block_allocator, mamba_slot_allocator) -> list[str]:
    """Every broken invariant, one message each (empty when all hold).

    Parameters
    ----------
    requests : RequestTable
    kv_block_allocator : KVBlockAllocator
    mamba_slot_allocator : MambaSlotAllocator or None
        ``None`` when the context caches no Mamba state.
    """
    problems = requests.broken_invariants()
    held = np.zeros(kv_block_allocator.num_blocks, np.int64)
    for rid in requests.ids:
        np.add.at(held, requests.blocks(requests.row(rid)), 1)
    if (held > kv_block_allocator.block_ref_counts).any():
        problems.append("a request holds a block without a reference")
    for owner in (kv_block_allocator, mamba_slot_allocator):
        try:
            if owner is not None:
                owner.check_invariants()
        except RuntimeError as exc:
            problems.append(str(exc))
    return problems
