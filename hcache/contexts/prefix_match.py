"""The prefix-match policy of :class:`~hcache.contexts.DynamicInferenceContext` (docs/design.md
§6), as functions of explicit inputs.

The policy (the references' lessons applied):

- KV match: the longest prefix of the prompt's complete-block hashes present in the KV map
  (scanned forward, so a broken chain never yields a bad block). Matched blocks are pinned
  (retained) before new blocks are allocated, which also protects their Mamba states.
- Mamba restore: the deepest matched block with a cached state; tokens up to its end are
  skipped. At least one token is always computed: if the whole prompt would be skipped, the
  restore backs off to the deepest earlier block with a state (or to 0). Without Mamba layers the
  skip is ``min(matched tokens, prompt - 1)``; with Mamba layers but no state cache the KV is
  shared but nothing is skipped.
- KV rows of positions already held by matched blocks are not rewritten (no writes into shared
  blocks); block hashes are registered only after the step that computes them (commit), and a
  hash that another block already holds is left to it (concurrent duplicates stay private).
- Mamba snapshots: up to three block boundaries inside each computed range (the KV divergence
  point, the last block boundary, and the one before it, where an exact repeat of the prefix
  backs off to) plus the live state when a step ends on a block boundary, in prefill and in
  decode, so siblings, repeats and multi-turn follow-ups hit. The context asks the Mamba slot
  allocator for them when it schedules a step.
"""

from __future__ import annotations

from .block_hashing import compute_block_hashes

__all__ = ["match_prefix", "restore_depth_tokens", "finish_pending_steps",
           "pending_blocks_overlap"]


def match_prefix(hashes, kv_hash_to_block_id: dict, mamba_hash_to_block_id: dict | None):
    """The longest cached prefix of a prompt and the depths a Mamba state can restore.

    Parameters
    ----------
    hashes : list of int
        Chained hashes of the prompt's complete blocks.
    kv_hash_to_block_id, mamba_hash_to_block_id : dict[int, int]
        The KV and Mamba hash maps (the latter None without a Mamba state cache).

    Returns
    -------
    (list of int, list of int)
        The matched block ids, and the restore depths in blocks: 0 and every ``k + 1`` whose
        matched block ``k`` has a cached Mamba state under its hash.
    """
    matched = []
    for h in hashes:
        b = kv_hash_to_block_id.get(h)
        if b is None:
            break
        matched.append(b)
    depths = [0]
    if mamba_hash_to_block_id is not None:
        depths += [k + 1 for k, h in enumerate(hashes[:len(matched)])
                   if mamba_hash_to_block_id.get(h) == matched[k]]
    return matched, depths


def restore_depth_tokens(num_tokens: int, matched: list, depths: list, block_size: int, *,
                         prefix_caching: bool, has_mamba: bool) -> int:
    """Prompt tokens to skip (restore instead of computing): the deepest usable restore depth,
    leaving at least one token to compute (see the module docstring)."""
    if not prefix_caching or not matched:
        return 0
    if not has_mamba:
        return min(len(matched) * block_size, num_tokens - 1)
    usable = [d for d in depths if d * block_size < num_tokens]   # back-off: compute >= 1 token
    return max(usable) * block_size


def finish_pending_steps(records, kv_hash_to_block_id: dict, block_size: int, *,
                         prefix_caching: bool):
    """Mark every scheduled step of ``records`` computed and collect the blocks it completed
    that are to be registered.

    Parameters
    ----------
    records : sequence of request records, in row order
        Updated in place: ``computed``, ``pending_end``, ``hashes`` and ``registered``.
    kv_hash_to_block_id : dict[int, int]
        The KV hash map (read only).

    Returns
    -------
    (list, list, list)
        ``block_ids``, ``hashes`` and ``parent_hashes`` to register, in row order. A hash
        already in the KV map, or claimed by an earlier row of this commit, is left to the
        block holding it (that block serves matches), so concurrent duplicates stay private.
    """
    bs = block_size
    ids, hashes, parents = [], [], []
    claimed = set()
    for r in records:
        if r.pending_end < 0:
            continue
        r.computed, r.pending_end = r.pending_end, -1
        complete = r.computed // bs
        if not prefix_caching or complete <= r.registered:
            continue
        if len(r.hashes) < complete:
            r.hashes = compute_block_hashes(r.tokens[:complete * bs], bs)
        for j in range(r.registered, complete):
            if r.hashes[j] not in kv_hash_to_block_id and r.hashes[j] not in claimed:
                claimed.add(r.hashes[j])
                ids.append(r.blocks[j])
                hashes.append(r.hashes[j])
                parents.append(r.hashes[j - 1] if j else 0)
        r.registered = complete
    return ids, hashes, parents


def pending_blocks_overlap(wanted: set, records, block_size: int) -> bool:
    """Whether a hash of ``wanted`` belongs to a complete block that a scheduled step of
    ``records`` is computing and that is not registered yet (records' ``hashes`` are extended
    in place as needed)."""
    for r in records:
        if r.pending_end >= 0 and wanted:
            complete = r.pending_end // block_size
            if len(r.hashes) < complete:
                r.hashes = compute_block_hashes(r.tokens[:complete * block_size], block_size)
            if wanted.intersection(r.hashes[r.registered:complete]):
                return True
    return False
