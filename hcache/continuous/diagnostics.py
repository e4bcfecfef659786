"""Diagnostics of :class:`~hcache.continuous.manager.ContinuousBatchingKVCacheManager`.

:meth:`check_invariants` cross-checks the manager's redundant bookkeeping, all under its lock:

- every block is either on the free heap or held by exactly one live sequence;
- live seq_ids are those of ``cache_lengths``, each below the id counter, each length within
  ``[0, max_seq_len]``;
- a batch in flight names distinct live sequences, its host and device ``lookup_table`` /
  ``cache_lengths`` agree with their blocks and committed lengths, and it has an owner thread
  (and there is no owner without a batch).

:meth:`memory_report` sums the buffers and the occupancy. The manager inherits
:class:`ContinuousBatchingDiagnosticsMixin`.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import dtype_name

__all__ = ["ContinuousBatchingDiagnosticsMixin"]


class ContinuousBatchingDiagnosticsMixin:
    """Invariant checks and the memory report of ``ContinuousBatchingKVCacheManager``.

    Relies on the manager's lock ``_cond``, ``_block_of``, ``_lengths``, ``_free``,
    ``_next_id``, ``_inflight`` / ``_inflight_owner``, ``_num_blocks``, ``_max_seq_len``,
    ``_dtype``, ``_device``, ``blocks_buf`` and the index buffers ``_dev_lookup`` /
    ``_dev_lengths``.
    """

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` listing every broken bookkeeping invariant.

        Synchronizes the device on cuda (reads the in-flight index buffers back).
        """
        with self._cond:
            p: list[str] = []
            live = list(self._block_of.values())
            free, total = self._free, self._num_blocks
            if set(self._block_of) != set(self._lengths):
                p.append("live seq_ids of blocks and of cache_lengths differ")
            if len(set(live)) != len(live):
                p.append(f"a block is held by two live sequences: {sorted(live)}")
            if len(set(free)) != len(free):
                p.append(f"a block is free twice: {sorted(free)}")
            if set(free) & set(live):
                p.append(f"blocks both free and live: {sorted(set(free) & set(live))}")
            if len(free) + len(live) != total or set(free) | set(live) != set(range(total)):
                p.append(f"free ({len(free)}) + live ({len(live)}) blocks do not make the "
                         f"{total} blocks")
            if any(free[(i - 1) // 2] > free[i] for i in range(1, len(free))):
                p.append("the free list is not a heap")
            bad = {s: n for s, n in self._lengths.items() if not 0 <= n <= self._max_seq_len}
            if bad:
                p.append(f"lengths outside [0, {self._max_seq_len}]: {bad}")
            if any(not 0 <= s < self._next_id for s in self._block_of):
                p.append("a live seq_id was never handed out")
            coll = self._inflight
            if coll is not None:
                p.extend(self._inflight_problems(coll))
            elif self._inflight_owner is not None:
                p.append("an in-flight owner without a batch in flight")
            if p:
                raise RuntimeError("ContinuousBatchingKVCacheManager: broken invariants:\n- "
                                   + "\n- ".join(p))

    def _inflight_problems(self, coll) -> list[str]:
        ids, p = coll.seq_ids, []
        if any(s not in self._block_of for s in ids) or len(set(ids)) != len(ids):
            return [f"in-flight batch {list(ids)} holds dead or repeated seq_ids"]
        if [self._block_of[s] for s in ids] != list(coll.blocks):
            p.append("in-flight blocks differ from the live sequences' blocks")
        if [self._lengths[s] for s in ids] != list(coll.host_cache_lengths):
            p.append("in-flight lengths differ from the committed lengths")
        dev = [a if isinstance(a, np.ndarray) else a.get()
               for a in (coll.lookup_table, coll.cache_lengths)]
        if dev[0].tolist() != list(coll.blocks) or dev[1].tolist() != list(
                coll.host_cache_lengths):
            p.append("device lookup_table/cache_lengths differ from the batch")
        if self._inflight_owner is None:
            p.append("a batch in flight without an owner thread")
        return p

    def memory_report(self) -> dict:
        """Sizes in bytes and occupancy: ``blocks_buf_bytes``, ``index_buffer_bytes``,
        ``total_bytes``, ``bytes_per_block``, ``bytes_per_token`` (K and V, all layers),
        ``num_blocks``, ``free_blocks``, ``live_sequences``, ``committed_tokens``,
        ``capacity_tokens``, ``token_utilization``, ``dtype``, ``device``."""
        with self._cond:
            per_block = int(self.blocks_buf.nbytes) // self._num_blocks
            committed = sum(self._lengths.values())
            capacity = self._num_blocks * self._max_seq_len
            index = int(self._dev_lookup.nbytes + self._dev_lengths.nbytes)
            return {"device": str(self._device), "dtype": dtype_name(self._dtype),
                    "blocks_buf_bytes": int(self.blocks_buf.nbytes),
                    "index_buffer_bytes": index,
                    "total_bytes": int(self.blocks_buf.nbytes) + index,
                    "bytes_per_block": per_block,
                    "bytes_per_token": per_block // self._max_seq_len,
                    "num_blocks": self._num_blocks, "free_blocks": len(self._free),
                    "live_sequences": len(self._block_of), "committed_tokens": committed,
                    "capacity_tokens": capacity, "token_utilization": committed / capacity}
