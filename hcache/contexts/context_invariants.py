"""The invariants a :class:`~hcache.contexts.dynamic_context.DynamicInferenceContext` and its
collaborators must agree on (docs/design.md §6.5), recounted from scratch: for tests and
debugging, never on a step's path.

Each collaborator states its own invariants (``broken_invariants`` / ``check_invariants``);
what is checked here besides is their agreement: every active request holds one reference on
each block of its block-table row.
"""

from __future__ import annotations

import numpy as np

__all__ = ["broken_context_invariants"]


def broken_context_invariants(requests, kv_block_allocator, mamba_slot_allocator) -> list[str]:
    """Every broken invariant of ``requests`` (a :class:`RequestTable`; it rehashes every
    request), ``kv_block_allocator``, ``mamba_slot_allocator`` (or None) and of their agreement,
    one message each; empty when all hold."""
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
