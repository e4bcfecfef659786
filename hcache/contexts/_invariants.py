"""Consistency checks of the prefix-cache allocators' host bookkeeping (docs/design.md §6).

The allocators' ``check_invariants`` methods delegate here. Each check reads every piece of
redundant bookkeeping (free stacks, inverse maps, hash maps, per-block mirrors, parent links)
and cross-checks it, collecting every broken invariant into one ``RuntimeError`` so that a
failing property test reports the whole picture. Checks never mutate the allocator.
"""

from __future__ import annotations

import numpy as np

__all__ = ["check_kv_block_allocator", "check_mamba_slot_allocator"]


def check_kv_block_allocator(alloc) -> None:
    """Verify a ``KVBlockAllocator``'s bookkeeping; raise RuntimeError listing every broken
    invariant (see the docstring of :mod:`hcache.contexts.kv_block_allocator`)."""
    errors: list[str] = []
    n = alloc._num_blocks
    hashes, refs = alloc.block_hashes, alloc.block_ref_counts
    if not 0 <= alloc._free_top <= n:
        errors.append(f"free stack top {alloc._free_top} outside [0, {n}]")
    stack = alloc._free_stack[: max(0, min(alloc._free_top, n))].astype(np.int64)
    in_range = (stack >= 0) & (stack < n)
    if not in_range.all():
        errors.append(f"free stack holds out-of-range ids {stack[~in_range].tolist()}")
    stack = stack[in_range]
    is_free = np.zeros(n, dtype=bool)
    is_free[stack] = True
    if np.unique(stack).shape[0] != stack.shape[0]:
        errors.append("free stack holds duplicate ids")
    if (refs < 0).any():
        errors.append(f"negative ref counts at {np.flatnonzero(refs < 0).tolist()}")
    registered, used = hashes != -1, refs > 0
    cached = registered & ~used
    bad_free = is_free & (registered | used)
    if bad_free.any():
        errors.append(f"free blocks registered or in use: {np.flatnonzero(bad_free).tolist()}")
    lost = ~is_free & ~registered & ~used
    if lost.any():
        errors.append(f"unregistered ref-0 blocks off the free stack: "
                      f"{np.flatnonzero(lost).tolist()}")
    total = int(is_free.sum()) + int(used.sum()) + int(cached.sum())
    if total != n:
        errors.append(f"free + used + cached = {total}, expected {n}")
    if not alloc.caches_released_blocks and cached.any():
        errors.append(f"cached blocks under policy {alloc.eviction_policy} / caching "
                      f"{alloc.enable_prefix_caching}: {np.flatnonzero(cached).tolist()}")
    if not alloc.enable_prefix_caching and registered.any():
        errors.append("registered blocks with prefix caching disabled")
    if (hashes[registered] <= 0).any() or (hashes[~registered] != -1).any():
        errors.append("hashes must be positive or -1")
    if len(alloc.kv_hash_to_block_id) != int(registered.sum()):
        errors.append(f"hash map has {len(alloc.kv_hash_to_block_id)} entries, "
                      f"{int(registered.sum())} blocks are registered")
    for h, b in alloc.kv_hash_to_block_id.items():
        if not 0 <= b < n or int(hashes[b]) != h:
            errors.append(f"hash map entry {h} -> {b} disagrees with block_hashes")
    _check_forest(alloc, errors, registered)
    if (alloc.block_timestamps[registered | used] > alloc._clock).any():
        errors.append("timestamps ahead of the clock")
    if errors:
        raise RuntimeError("KVBlockAllocator invariants broken:\n  " + "\n  ".join(errors))



def _check_forest(alloc, errors: list, registered: np.ndarray) -> None:
    """Append to ``errors`` every broken invariant of the parent forest of registered
    blocks: links only between registered blocks, parent hashes and child counts agreeing
    with the links, and no cycle."""
    n = alloc._num_blocks
    pid, phash = alloc.block_parent_ids.astype(np.int64), alloc.block_parent_hashes
    if ((pid < -1) | (pid >= n)).any():
        errors.append("parent ids out of range")
        return
    if (pid[~registered] != -1).any() or (phash[~registered] != 0).any() \
            or (alloc.block_child_counts[~registered] != 0).any():
        errors.append("unregistered blocks with a parent or children")
    linked = registered & (pid >= 0)
    if not registered[pid[linked]].all():
        errors.append("a registered block's parent hash is no longer registered")
    if (phash[linked] != alloc.block_hashes[pid[linked]]).any() \
            or (phash[registered & (pid < 0)] != 0).any():
        errors.append("block_parent_hashes disagree with block_parent_ids")
    counts = np.bincount(pid[linked], minlength=n)
    if (counts != alloc.block_child_counts).any():
        errors.append("block_child_counts disagree with the parent links")
    up = np.where(linked, pid, -1)
    for _ in range(max(1, n.bit_length())):
        up = np.where(up >= 0, up[np.maximum(up, 0)], -1)
    if (up >= 0).any():
        errors.append("the parent links contain a cycle")


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
