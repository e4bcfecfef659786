"""The invariants of a :class:`~hcache.contexts.block_forest.BlockForest` (see its module
docstring): hashes and the hash map agree, parent links and child counts agree, dangling roots
are counted, no cycle."""

from __future__ import annotations

import numpy as np

__all__ = ["broken_forest_invariants"]


def broken_forest_invariants(forest) -> list[str]:
    """Every broken invariant of the hashes, the hash map and the links of ``forest``; empty
    when all hold. Reads only."""
    errors: list[str] = []
    n, hashes = forest.num_blocks, forest.hashes
    registered = forest.registered
    if (hashes[registered] <= 0).any() or (hashes[~registered] != -1).any():
        errors.append("hashes must be positive or -1")
    if len(forest.hash_to_block) != int(registered.sum()):
        errors.append(f"hash map has {len(forest.hash_to_block)} entries, "
                      f"{int(registered.sum())} blocks are registered")
    for h, b in forest.hash_to_block.items():
        if not 0 <= b < n or int(hashes[b]) != h:
            errors.append(f"hash map entry {h} -> {b} disagrees with block_hashes")
    pid, phash = forest.parent_ids.astype(np.int64), forest.parent_hashes
    if ((pid < -1) | (pid >= n)).any():
        errors.append("parent ids out of range")
        return errors
    if (pid[~registered] != -1).any() or (phash[~registered] != 0).any() \
            or (forest.child_counts[~registered] != 0).any():
        errors.append("unregistered blocks with a parent or children")
    linked = registered & (pid >= 0)
    if not registered[pid[linked]].all():
        errors.append("a registered block's parent hash is no longer registered")
    if (phash[linked] != hashes[pid[linked]]).any() \
            or (phash[registered & (pid < 0)] != 0).any():
        errors.append("block_parent_hashes disagree with block_parent_ids")
    if (forest.dangling & ~(registered & (pid < 0))).any() \
            or forest.num_dangling != int(np.count_nonzero(forest.dangling)):
        errors.append("dangling roots must be registered roots, counted")
    counts = np.bincount(pid[linked], minlength=n)
    if (counts != forest.child_counts).any():
        errors.append("block_child_counts disagree with the parent links")
    up = np.where(linked, pid, -1)
    for _ in range(max(1, n.bit_length())):
        up = np.where(up >= 0, up[np.maximum(up, 0)], -1)
    if (up >= 0).any():
        errors.append("the parent links contain a cycle")
    return errors
