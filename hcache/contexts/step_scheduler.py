"""Admission and extension of the requests of a
:class:`~hcache.contexts.DynamicInferenceContext` (docs/design.md §6).

:class:`StepScheduler` schedules one step of work per request over the context's
:class:`~hcache.contexts.requests.RequestTable`: for a new request, the prefix match (the
policy of :mod:`hcache.contexts.prefix_match`), pinning and allocation of KV blocks, the
Mamba restore or zeroing and the snapshot plan; for a batch of extended requests, the same
checks and updates vectorised over the batch. Every method checks all it needs (arguments,
rows, capacity) before its first change, so a refused call changes nothing.
"""

from __future__ import annotations

import numpy as np

from ..errors import CacheCapacityError
from .block_hashing import block_keys, cache_salt, chain_root, prompt_block_hashes
from .prefix_match import match_prefix, restore_depth_tokens
from .step_plans import BatchStepPlan, PrefixCacheStats, StepPlan

__all__ = ["StepScheduler"]

_PLAIN_ROOT = chain_root(None)     # the root of every unsalted chain
_NO_HASHES = np.zeros(0, np.int64)


class StepScheduler:
    """Schedules steps of the requests of ``requests``.

    Parameters
    ----------
    requests : RequestTable
    kv_block_allocator : KVBlockAllocator
    mamba_slot_allocator : MambaSlotAllocator or None
    live_states : LiveMambaStates
    num_mamba_layers : int
    window : WindowBlocks, optional
        The local block space of the sliding-window layers (docs/design.md §6.7).
    registration : BlockRegistration, optional
        The registration backlog, caught up before a prefix match (docs/design.md §6.8).
    """

    def __init__(self, requests, kv_block_allocator, mamba_slot_allocator, live_states,
                 num_mamba_layers: int, window=None, registration=None):
        self.requests, self.kv, self.window = requests, kv_block_allocator, window
        self.registration = registration
        self.mamba, self.live, self.num_mamba_layers = (mamba_slot_allocator, live_states,
                                                        num_mamba_layers)
        self.block_size = requests.block_size
        self.max_sequence_length = requests.max_sequence_length

    def admit(self, request_id, tokens: np.ndarray, *, stream=None, salt=None, extra_keys=None):
        """Admit a new request with checked ``tokens`` (1-D int64, 1..max_sequence_length of
        them) and schedule its prompt minus the restored prefix; its blocks hash under ``salt``
        and ``extra_keys`` (docs/design.md §6.1).

        Returns
        -------
        (StepPlan, PrefixCacheStats)
            The plan and the request's counters (its computed tokens included; the row's own,
            not a copy: read only).

        Raises
        ------
        TypeError, IndexError
            ``salt`` is not bytes or str, ``extra_keys`` not a mapping of block indices of the
            prompt to keys. Nothing changes.
        CacheCapacityError
            No free row, or not enough KV blocks even after eviction. Nothing changes.
        """
        requests, kv, bs, mamba = self.requests, self.kv, self.block_size, self.mamba
        n = len(tokens)
        if salt is None and extra_keys is None:     # the plain chain (Megatron-LM's)
            keys, root = None, _PLAIN_ROOT
        else:
            salt = cache_salt("salt", salt)
            keys = block_keys("extra_keys", extra_keys, -(-n // bs))
            root = chain_root(salt)
        hashes, digest = (prompt_block_hashes(root, tokens, bs, keys) if requests.hashing
                          else (_NO_HASHES, root))
        if self.registration is not None:
            self.registration.flush_for_prompt(hashes)
        listed = hashes.tolist()
        matched, depths = match_prefix(listed, kv.kv_hash_to_block_id,
                                       None if mamba is None else mamba.hash_to_block_id)
        has_mamba = self.num_mamba_layers > 0

        def skip_of(m):
            return restore_depth_tokens(n, matched[:m], [d for d in depths if d <= m], bs,
                                        prefix_caching=requests.hashing, has_mamba=has_mamba)

        skip = skip_of(len(matched))
        if self.window is not None:   # the local layers' window must be cached too
            m, skip, lo, local_ids = self.window.plan_admit(listed, matched, skip_of)
            matched = matched[:m]
        num_matched, num_blocks = len(matched), -(-n // bs)
        num_new = num_blocks - num_matched
        if not requests.has_free_row:
            raise CacheCapacityError(f"requests: all {requests.max_requests} rows are in use",
                                     required=1, available=0)
        # Pinning takes the matched blocks that eviction could reclaim out of the pool; a cached
        # matched block with an in-use descendant was never reclaimable, so it costs nothing.
        # (Ancestors of matched blocks are matched blocks, so nothing else becomes pinned.)
        # Without a local block space to check too, the allocation is the check (it changes
        # nothing when it fails); the matched blocks are kept from eviction as if pinned first.
        # The matched ids come from the hash map: registered, distinct, in range (unchecked).
        new = None
        if self.window is None:
            new = kv._allocate(num_new, matched)
        if new is None and not kv.can_allocate_memory_blocks(num_new, matched):
            pinned = kv.get_evictable_block_count(matched) if matched else 0
            available = kv.get_allocatable_count() - pinned
            raise CacheCapacityError(f"KV blocks: {num_new} required, {available} allocatable",
                                     required=num_new, available=available)
        if self.window is not None:
            self.window.check_admit(local_ids, num_new)
            new = kv._allocate(num_new, matched)
        if matched:
            kv._retain_distinct(np.array(matched, np.int64))
        restored = matched[skip // bs - 1] if skip and has_mamba else -1
        stats = PrefixCacheStats(     # (the row's computed tokens are read off its length)
            requests=1, prompt_tokens=n, computed_tokens=n - skip, skipped_tokens=skip,
            kv_hit_blocks=num_matched, kv_miss_blocks=len(hashes) - num_matched,
            mamba_hits=int(restored >= 0))
        row = requests.admit(request_id, tokens, matched, new, hashes, digest,
                             kv_cached=num_matched * bs, registered=num_matched, computed=skip,
                             stats=stats, salt=salt, keys=keys)
        if self.window is not None:
            self.window.admit(row, lo, local_ids, num_new)
        slot = int(requests.request_to_mamba_state_idx[row])
        if restored >= 0:
            mamba.restore_to_live(row, restored, stream=stream)
        elif has_mamba:
            self.live.zero(slot, stream=stream)
        requests.schedule(row, n)
        if mamba is not None:
            # Beyond the reference's three candidates, also keep the boundary one block before
            # the last one: the back-off point of an exact repeat of this block-aligned prefix.
            mamba._plan_prompt(row, skip, n, num_matched, num_blocks, n // bs * bs - bs)
        blocks = requests.request_to_kv_block_ids[row, :num_blocks].copy()
        plan = StepPlan(request_id, row, slot, skip, n, tokens[skip:].copy(), blocks, skip,
                        num_matched, restored)
        return plan, stats

    def extend(self, ids: list, rows: np.ndarray, flat: np.ndarray, counts, *,
               single: bool) -> BatchStepPlan:
        """Append ``counts[i]`` tokens of ``flat`` (one each when ``counts`` is None) to the
        distinct active ``rows`` of requests ``ids`` and schedule them.

        ``single`` names the arguments as ``extend_request`` does (``request_id``,
        ``tokens``), else by entry (``request_ids[i]``, ``tokens[i]``).

        Raises
        ------
        ValueError
            A request has a step scheduled, or gets no token or too many.
        CacheCapacityError
            Not enough KV blocks even after eviction. Nothing changes.
        """
        requests, kv, bs = self.requests, self.kv, self.block_size
        scheduled = requests.pending_end[rows]
        if len(rows) and scheduled[scheduled.argmax()] >= 0:     # (argmax: no Python wrapper)
            i = int(np.argmax(scheduled >= 0))
            raise ValueError(f"{'request_id' if single else f'request_ids[{i}]'}: expected a "
                             f"request without a scheduled step, got {ids[i]!r}")
        # No step is scheduled, so computed == lengths and num_blocks == ceil(lengths / bs).
        starts = requests.lengths[rows]
        ends = starts + (1 if counts is None else counts)
        if len(rows) and (ends[ends.argmax()] > self.max_sequence_length
                          or (counts is not None and counts.min() < 1)):
            i = int(np.argmax((ends > self.max_sequence_length) | (ends == starts)))
            raise ValueError(f"{'tokens' if single else f'tokens[{i}]'}: expected "
                             f"1..{self.max_sequence_length - starts[i]} tokens, "
                             f"got {ends[i] - starts[i]}")
        if counts is None:
            phase = starts % bs
            need = phase == 0       # the token opens a block (a 0/1 mask)
        else:
            need = -(-ends // bs) - requests.num_blocks[rows]
        total = int(np.count_nonzero(need)) if counts is None else int(need.sum())
        new = None
        if total:
            # Without a local block space to check too, the allocation is the check (a refused
            # one changes nothing); with eviction it hands out what a loop of extend_request
            # would get, in one call.
            if self.window is None:
                new = self._allocate(need, total)
            if new is None if self.window is None else not kv.is_memory_available(total):
                available = kv.get_allocatable_count()
                raise CacheCapacityError(f"KV blocks: {total} required, {available} allocatable",
                                         required=total, available=available)
        if self.window is not None:
            self.window.check_extend(total)
        if total:
            if new is None:
                new = self._allocate(need, total)
            requests.add_blocks(rows, need, new)
            if self.window is not None:
                self.window.extend(rows, need, total)
        closing = None
        if counts is None:
            closing = phase == bs - 1     # the token closes a block
            if not np.count_nonzero(closing):
                closing = False           # (no row does)
        requests.append(rows, flat, counts, starts, ends)
        requests.schedule(rows, ends)
        if self.mamba is not None:
            self._plan_snapshots(rows, starts, ends, counts, closing)
        if counts is None:
            offsets = np.arange(len(rows) + 1)
        else:
            offsets = np.zeros(len(rows) + 1, np.int64)
            np.cumsum(counts, out=offsets[1:])
        return BatchStepPlan(ids, rows, requests.request_to_mamba_state_idx[rows], starts, ends,
                             offsets, flat.copy(),
                             requests.request_to_kv_block_ids.take(rows, axis=0))

    def _allocate(self, need: np.ndarray, total: int):
        """``need[i]`` new blocks per row, ``total`` in all, or None (nothing changed)."""
        kv = self.kv
        if kv.num_free_blocks >= total:
            return kv._allocate(total, ())
        # (a bool need is a 0/1 mask: one block for each row it marks)
        return kv._allocate(total, (), [1] * total if need.dtype == np.bool_
                            else need[need > 0].tolist())

    def _plan_snapshots(self, rows, starts, ends, counts, closing) -> None:
        """Ask the Mamba slot allocator for the boundary states of the extension chunks
        ``[starts, ends)`` of ``rows``: the candidates of an admission with nothing matched
        (``ceil(start / bs)``, the last block boundary, the start of the last block, the one
        before the last boundary) and the EOS entry of a chunk that ends on a boundary."""
        bs = self.block_size
        if closing is False:
            return      # one token each, none on a boundary: no snapshot (rows are clear)
        if closing is not None:     # one token each: the closing rows' EOS entries only
            at, table = closing.nonzero()[0], self.requests.request_to_kv_block_ids
            if len(at) > 4:
                rows = rows[at]
                self.mamba._plan_eos(rows, table[rows, ends[at] // bs - 1])
                return
            # a few: element by element, through the request table's kept view
            rows, width, cells = rows[at].tolist(), table.shape[1], self.requests._scalars.table
            self.mamba._plan_eos(rows, [cells[r * width + e // bs - 1]
                                        for r, e in zip(rows, ends[at].tolist())])
            return
        eos = ends % bs == 0
        single = counts is None or counts.max() == 1
        if single and not np.count_nonzero(eos):
            return
        bounds = None
        if not single:
            last = ends // bs * bs
            bounds = np.stack([-(-starts // bs) * bs, last, (-(-ends // bs) - 1) * bs,
                               last - bs], axis=1)
        self.mamba.compute_and_store_offsets_batch(rows, starts, ends - starts, bounds,
                                                   np.where(eos, ends // bs - 1, -1))
