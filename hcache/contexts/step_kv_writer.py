"""One step's K/V writes into the paged KV pool, through the requests' block-table rows
(docs/design.md §6).

The scheduled tokens of a step's requests are written with one :meth:`PagedKVPool.write` call:
row ``b`` carries positions ``[computed, pending_end)`` of its request. Positions held by shared
(prefix-matched) blocks, below the request's ``kv_cached``, are passed as -1 and skipped, so no
write lands in a block another request reads. The index arrays are staged in buffers allocated
once, so steps allocate no device memory.
"""

from __future__ import annotations

import numpy as np

from ..device import launch_scope, upload_ints

__all__ = ["StepKVWriter"]


class StepKVWriter:
    """Writes the scheduled tokens' K/V of up to ``max_requests`` requests and
    ``max_step_tokens`` tokens per call into ``kv_pool``.

    Parameters
    ----------
    kv_pool : PagedKVPool
    max_requests, max_blocks_per_request, max_step_tokens : int
    """

    def __init__(self, kv_pool, max_requests: int, max_blocks_per_request: int,
                 max_step_tokens: int):
        self.kv_pool, self.max_step_tokens = kv_pool, max_step_tokens
        device, xp = kv_pool.device, kv_pool.xp
        with device.scope():
            self._table_dev = xp.full((max_requests, max_blocks_per_request), -1,
                                      dtype=np.int32)
            self._offsets_dev = xp.zeros(max_requests + 1, dtype=np.int32)
            self._positions_dev = xp.zeros(max_step_tokens, dtype=np.int32)

    def write(self, records, block_table: np.ndarray, k, v, *, layer=None, stream=None) -> None:
        """Write the K/V rows of the scheduled tokens of ``records`` (concatenated in order).

        Parameters
        ----------
        records : sequence of request records with a scheduled step
            Their ``row``, ``computed``, ``pending_end`` and ``kv_cached``.
        block_table : int32 [max_requests, max_blocks_per_request]
            Host block table (row -> block ids).
        k, v, layer, stream
            As in :meth:`PagedKVPool.write`.

        Raises
        ------
        ValueError
            More than ``max_step_tokens`` tokens; else as :meth:`PagedKVPool.write`.
        """
        lengths = [r.pending_end - r.computed for r in records]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        if offsets[-1] > self.max_step_tokens:
            raise ValueError(f"request_ids: expected at most {self.max_step_tokens} tokens, "
                             f"got {int(offsets[-1])}")
        positions = np.concatenate([np.arange(r.computed, r.pending_end) for r in records]
                                   + [np.zeros(0, np.int64)]).astype(np.int32)
        cached = np.concatenate([np.full(n, r.kv_cached)
                                 for r, n in zip(records, lengths, strict=True)]
                                + [np.zeros(0, np.int64)])
        positions[positions < cached] = -1
        table = block_table[[r.row for r in records]]
        n, b = len(positions), len(records)
        with launch_scope(self.kv_pool.device, stream):
            upload_ints(self._positions_dev, positions)
            upload_ints(self._offsets_dev, offsets)
            upload_ints(self._table_dev, table)
        self.kv_pool.write(k, v, block_table=self._table_dev[:b], layer=layer,
                           seq_offsets=self._offsets_dev[:b + 1], batch=b,
                           positions=self._positions_dev[:n], stream=stream)
