"""Prefix-match policy of :class:`~hcache.contexts.DynamicInferenceContext` (docs/design.md §6).

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
  decode, so siblings, repeats and multi-turn follow-ups hit.

:class:`PrefixMatchMixin` holds the match, the skip (restore depth), the snapshot-boundary
choice, the choice of blocks to register at commit and the scheduler hint
:meth:`shares_pending_blocks`; the context inherits it.
"""

from __future__ import annotations

import numpy as np

from .block_hashing import compute_block_hashes
from .requests import StepPlan, _Chunk

__all__ = ["PrefixMatchMixin"]


class PrefixMatchMixin:
    """Prefix-match methods of :class:`~hcache.contexts.DynamicInferenceContext`.

    Relies on the context's ``kv_block_allocator``, ``mamba_slot_allocator`` (or None),
    ``block_size_tokens``, ``num_mamba_layers``, ``prefix_caching_enabled``, ``stats``,
    ``_requests``, ``_get`` and ``_tokens``.
    """

    def snapshot_targets(self) -> list[tuple[object, int, int]]:
        """``(request_id, offset, scratch_index)`` of the boundary states the model must write
        this step: the state after ``offset`` computed tokens (from the plan's ``start``) goes
        to ``mamba_slot_allocator.intermediate_*_out[:, scratch_index]``."""
        if self.mamba_slot_allocator is None:
            return []
        by_row = {r.row: r.request_id for r in self._requests.values()}
        return [(by_row[row], off, idx)
                for row, off, idx in self.mamba_slot_allocator.intermediate_targets()]

    def shares_pending_blocks(self, tokens) -> bool:
        """Whether a complete block of ``tokens`` is being computed by a scheduled step and is
        not cached yet: a scheduler can defer such a request one step to hit the cache."""
        if not self.prefix_caching_enabled:
            return False
        wanted = set(compute_block_hashes(self._tokens("tokens", tokens),
                                          self.block_size_tokens))
        wanted.difference_update(self.kv_block_allocator.kv_hash_to_block_id)
        for r in self._requests.values():
            if r.pending_end >= 0 and wanted:
                complete = r.pending_end // self.block_size_tokens
                if len(r.hashes) < complete:
                    r.hashes = compute_block_hashes(r.tokens[:complete * self.block_size_tokens],
                                                    self.block_size_tokens)
                if wanted.intersection(r.hashes[r.registered:complete]):
                    return True
        return False


    def _match(self, hashes):
        """Matched block ids (longest cached prefix) and the restore depth in blocks."""
        kv_map = self.kv_block_allocator.kv_hash_to_block_id
        matched = []
        for h in hashes:
            b = kv_map.get(h)
            if b is None:
                break
            matched.append(b)
        depths = [0]
        if self.mamba_slot_allocator is not None:
            mamba_map = self.mamba_slot_allocator.hash_to_block_id
            depths += [k + 1 for k, h in enumerate(hashes[:len(matched)])
                       if mamba_map.get(h) == matched[k]]
        return matched, depths

    def _skip(self, num_tokens, matched, depths) -> int:
        bs = self.block_size_tokens
        if not self.prefix_caching_enabled or not matched:
            return 0
        if self.num_mamba_layers == 0:
            return min(len(matched) * bs, num_tokens - 1)
        usable = [d for d in depths if d * bs < num_tokens]   # back-off: compute >= 1 token
        return max(usable) * bs


    def _schedule(self, r, end, matched, skip, restored) -> StepPlan:
        start = r.computed
        r.pending_end = end
        r.stats.computed_tokens += end - start
        self.stats.computed_tokens += end - start
        if self.mamba_slot_allocator is not None:
            # Beyond the reference's three candidates, also keep the boundary one block before
            # the last one: the back-off point of an exact repeat of this block-aligned prefix.
            last = end // self.block_size_tokens * self.block_size_tokens
            self.mamba_slot_allocator.compute_and_store_offsets(
                _Chunk(end, start - skip), r.row, skip, end - start + skip, matched,
                r.blocks[:matched], -(-end // self.block_size_tokens),
                extra_boundaries=(last - self.block_size_tokens,))
        return StepPlan(r.request_id, r.row, r.live_slot, start, end,
                        np.asarray(r.tokens[start:end], dtype=np.int64),
                        np.asarray(r.blocks, dtype=np.int32), skip, matched, restored)

    def _finish_pending_steps(self):
        """Mark every scheduled step computed and collect the blocks it completed that are to
        be registered: ``(block_ids, hashes, parent_hashes)`` lists, in row order.

        A hash already in the KV map, or claimed by an earlier row of this commit, is left to
        the block holding it (that block serves matches), so concurrent duplicates stay private.
        """
        kv, bs = self.kv_block_allocator, self.block_size_tokens
        ids, hashes, parents = [], [], []
        kv_map, claimed = kv.kv_hash_to_block_id, set()
        for r in sorted(self._requests.values(), key=lambda q: q.row):
            if r.pending_end < 0:
                continue
            r.computed, r.pending_end = r.pending_end, -1
            complete = r.computed // bs
            if not self.prefix_caching_enabled or complete <= r.registered:
                continue
            if len(r.hashes) < complete:
                r.hashes = compute_block_hashes(r.tokens[:complete * bs], bs)
            for j in range(r.registered, complete):
                if r.hashes[j] not in kv_map and r.hashes[j] not in claimed:
                    # (a hash held by another block stays there; that block serves matches)
                    claimed.add(r.hashes[j])
                    ids.append(r.blocks[j])
                    hashes.append(r.hashes[j])
                    parents.append(r.hashes[j - 1] if j else 0)
            r.registered = complete
        return ids, hashes, parents
