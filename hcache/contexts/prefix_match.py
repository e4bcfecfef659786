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

from functools import partial
from itertools import takewhile
from operator import is_not

import numpy as np

from .token_batches import ragged_columns

__all__ = ["match_prefix", "restore_depth_tokens", "blocks_to_register",
           "pending_blocks_overlap"]

_is_block = partial(is_not, None)     # a hash map's answer: a block id, not None


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
    matched = list(takewhile(_is_block, map(kv_hash_to_block_id.get, hashes)))
    depths = [0]
    if mamba_hash_to_block_id is not None:   # zip stops at the end of the match
        depths += [k for k, (state_block, block) in enumerate(
            zip(map(mamba_hash_to_block_id.get, hashes), matched), 1) if state_block == block]
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


def blocks_to_register(requests, rows, ends, kv_hash_to_block_id: dict):
    """The blocks that the steps of ``rows`` completed, to register at commit.

    Parameters
    ----------
    requests : RequestTable
        Read: ``registered``, the hashes and the block table; ``registered`` of ``rows`` is
        advanced to their complete blocks.
    rows, ends : int64 [n]
        Rows whose step was just computed, ascending, and their computed tokens.
    kv_hash_to_block_id : dict[int, int]
        The KV hash map (read only).

    Returns
    -------
    (int64 [m], int64 [m], int64 [m], int64 [m], int64 [k], int64 [k])
        ``block_ids``, ``hashes``, ``parent_hashes`` (0 = none) and likely parents (the row's
        previous block, a guess for :meth:`BlockForest.link`) to register, in row order then
        block order, then every completed block and its hash (``k >= m``). A hash already
        in the KV map, or claimed by an earlier entry of this commit, is left to the block
        holding it (that block serves matches), so concurrent duplicates stay private.
    """
    bs = requests.block_size
    complete = ends // bs
    done = requests.registered[rows]
    grew = complete > done
    if not np.count_nonzero(grew):
        return (np.zeros(0, np.int64),) * 6
    rows, done, complete = rows[grew], done[grew], complete[grew]
    requests.registered[rows] = complete
    if (complete - done).max() == 1:      # a decode step: one block each
        owners, cols = rows, done
    else:
        which, cols = ragged_columns(done, complete - done)
        owners = rows[which]
    hashes = requests.hashes[owners, cols]
    parents = requests.hashes[owners, cols - 1]
    parents[cols == 0] = 0
    table = requests.request_to_kv_block_ids
    block_ids = table[owners, cols].astype(np.int64)
    likely = table[owners, cols - 1].astype(np.int64)   # column -1: checked, and fails
    listed = hashes.tolist()
    if kv_hash_to_block_id.keys().isdisjoint(listed) and len(set(listed)) == len(listed):
        return block_ids, hashes, parents, likely, block_ids, hashes     # all new
    if kv_hash_to_block_id.keys().isdisjoint(listed):
        keep = np.ones(len(listed), bool)
    else:
        keep = np.fromiter(map(kv_hash_to_block_id.__contains__, listed), bool, len(listed))
        np.logical_not(keep, out=keep)
    if len(set(listed)) != len(listed):      # first occurrence wins
        first = np.zeros(len(listed), bool)
        first[np.unique(hashes, return_index=True)[1]] = True
        keep &= first
    return block_ids[keep], hashes[keep], parents[keep], likely[keep], block_ids, hashes


def pending_blocks_overlap(wanted: set, requests) -> bool:
    """Whether a hash of ``wanted`` belongs to a complete block that a scheduled step of
    ``requests`` (a RequestTable) is computing and that is not registered yet."""
    if not wanted:
        return False
    rows = np.flatnonzero(requests.pending_end >= 0)
    bs = requests.block_size
    for row, done, end in zip(rows.tolist(), requests.registered[rows].tolist(),
                              requests.pending_end[rows].tolist(), strict=True):
        if wanted.intersection(requests.hashes[row, done:end // bs].tolist()):
            return True
    return False
