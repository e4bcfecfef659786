"""Consistency checks of the prefix-cache allocators' host bookkeeping (docs/design.md §6).

The allocators' ``check_invariants`` methods delegate here. Each check reads every piece of
redundant bookkeeping (free stacks, inverse maps, hash maps, per-block mirrors, parent links)
and cross-checks it, collecting every broken invariant into one ``RuntimeError`` so that a
failing property test reports the whole picture. Checks never mutate the allocator.
"""

from __future__ import annotations

import numpy as np

__all__ = ["check_mamba_slot_allocator"]


def check_mamba_slot_allocator(alloc) -> None:
    """Raise ``RuntimeError`` listing every broken invariant of a ``MambaSlotAllocator`` (see
    the docstring of :mod:`hcache.contexts.mamba_slot_allocator`)."""
    problems = []
    free = alloc.free_slots[:alloc.free_count].astype(np.int64)
    if not 0 <= alloc.free_count <= alloc.max_slots:
        problems.append(f"free_count {alloc.free_count} outside [0, {alloc.max_slots}]")
    elif len(np.unique(free)) != len(free) or (alloc.slot_to_block[free] >= 0).any():
        problems.append("free stack holds a repeated or owned slot")
    owned_slots = np.nonzero(alloc.slot_to_block >= 0)[0]
    if alloc.free_count + len(owned_slots) != alloc.max_slots:
        problems.append(f"free {alloc.free_count} + owned {len(owned_slots)} != "
                        f"max_slots {alloc.max_slots}")
    blocks = np.nonzero(alloc.block_to_slot >= 0)[0]
    slots = alloc.block_to_slot[blocks]
    if len(np.unique(slots)) != len(slots):
        problems.append("a slot is owned by two blocks")
    if len(blocks) != len(owned_slots) or (alloc.slot_to_block[slots] != blocks).any():
        problems.append("block_to_slot and slot_to_block are not inverse")
    kv_map = alloc._kv.kv_hash_to_block_id
    for h, b in alloc.hash_to_block_id.items():
        if kv_map.get(h) != b:
            problems.append(f"Mamba hash {h} -> block {b} is not in the KV map")
        if alloc.block_to_slot[b] < 0:
            problems.append(f"Mamba hash {h} -> block {b}, which owns no slot")
        if alloc._block_hash[b] != h:
            problems.append(f"block {b} records Mamba hash {alloc._block_hash[b]}, not {h}")
    if int((alloc._block_hash > 0).sum()) != len(alloc.hash_to_block_id):
        problems.append("per-block Mamba hashes disagree with the Mamba map")
    if problems:
        raise RuntimeError("MambaSlotAllocator invariants broken: " + "; ".join(problems))
