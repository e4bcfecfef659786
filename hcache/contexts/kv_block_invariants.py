"""The invariants of a :class:`~hcache.contexts.KVBlockAllocator` (see its module docstring):
free stack, ref counts, the three block states, the forest and the evictable leaves."""

from __future__ import annotations

import numpy as np

__all__ = ["broken_kv_block_invariants"]


def broken_kv_block_invariants(a, free_stack, free_top, forest, leaves) -> list[str]:
    """Every broken invariant of allocator ``a`` (its free stack, ``BlockForest`` and
    ``EvictableLeaves`` passed in); empty when all hold. Reads only."""
    errors: list[str] = []
    n, top = a.num_blocks, free_top
    refs = a.block_ref_counts
    if not 0 <= top <= n:
        errors.append(f"free stack top {top} outside [0, {n}]")
    stack = free_stack[: max(0, min(top, n))].astype(np.int64)
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
    registered, used = forest.registered, refs > 0
    cached = registered & ~used
    bad_free = is_free & (registered | used)
    if bad_free.any():
        errors.append(f"free blocks registered or in use: "
                      f"{np.flatnonzero(bad_free).tolist()}")
    lost = ~is_free & ~registered & ~used
    if lost.any():
        errors.append(f"unregistered ref-0 blocks off the free stack: "
                      f"{np.flatnonzero(lost).tolist()}")
    total = int(is_free.sum()) + int(used.sum()) + int(cached.sum())
    if total != n:
        errors.append(f"free + used + cached = {total}, expected {n}")
    if not a.caches_released_blocks and cached.any():
        errors.append(f"cached blocks under policy {a.eviction_policy} / caching "
                      f"{a.enable_prefix_caching}: {np.flatnonzero(cached).tolist()}")
    if not a.enable_prefix_caching and registered.any():
        errors.append("registered blocks with prefix caching disabled")
    errors += forest.broken_invariants()
    truth = cached & (forest.child_counts == 0) if a.caches_released_blocks \
        else np.zeros(n, dtype=bool)
    errors += leaves.broken_invariants(truth, a.block_timestamps)
    if (a.block_timestamps[registered | used] > a.clock).any():
        errors.append("timestamps ahead of the clock")
    return errors
