"""One step's K/V writes into the paged KV pool, through the requests' block-table rows
(docs/design.md §6).

The scheduled tokens of a step's requests are written with one :meth:`PagedKVPool.write_kv` call:
row ``b`` carries positions ``[computed, pending_end)`` of its request. Positions held by shared
(prefix-matched) blocks, below the request's ``kv_cached``, are passed as -1 and skipped, so no
write lands in a block another request reads. The index arrays are staged in buffers allocated
once, so steps allocate no device memory.
"""

from __future__ import annotations

import numpy as np

from ..runtime.device import launch_scope, stream_handle, upload_ints
from .token_batches import ragged_columns

__all__ = ["StepKVWriter"]


class StepKVWriter:
    """Writes the scheduled tokens' K/V of up to ``max_requests`` requests and
    ``max_step_tokens`` tokens per call into ``kv_pool``.

    Parameters
    ----------
    kv_pool : PagedKVPool
    max_requests, max_blocks_per_request, max_step_tokens : int
    window : WindowBlocks, optional
        The local block space: its table addresses the pool's sliding-window layers.
    """

    def __init__(self, kv_pool, max_requests: int, max_blocks_per_request: int,
                 max_step_tokens: int, window=None):
        self.kv_pool, self.max_step_tokens, self.window = kv_pool, max_step_tokens, window
        device, xp = kv_pool.device, kv_pool.xp
        with device.scope():
            self._table_dev = xp.full((max_requests, max_blocks_per_request), -1,
                                      dtype=np.int32)
            self._offsets_dev = xp.zeros(max_requests + 1, dtype=np.int32)
            self._positions_dev = xp.zeros(max_step_tokens, dtype=np.int32)
            self._local_dev = (None if window is None else
                               xp.full((max_requests, max_blocks_per_request), -1, np.int32))

    def write(self, requests, rows: np.ndarray, k, v=None, *, layer=None, k_scale=None,
              v_scale=None, stream=None) -> None:
        """Write the K/V rows of the scheduled tokens of request ``rows`` (concatenated in
        order). Everything is checked before the index arrays are staged.

        Parameters
        ----------
        requests : RequestTable
            Its ``computed``, ``pending_end``, ``kv_cached`` and block table.
        rows : int64 [b]
            Rows with a scheduled step.
        k, v, layer, k_scale, v_scale, stream
            As in :meth:`PagedKVPool.write_kv`.

        Raises
        ------
        ValueError
            A request without a scheduled step, more than ``max_step_tokens`` tokens; else as
            :meth:`PagedKVPool.write_kv`.
        TypeError
            As :meth:`PagedKVPool.write_kv`.
        """
        if (requests.pending_end[rows] < 0).any() or requests.parked[rows].any():
            raise ValueError("request_ids: expected requests with a scheduled step (not one a "
                             "transfer fills)")
        stream_handle(stream)
        starts = requests.computed[rows]
        lengths = requests.pending_end[rows] - starts
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if offsets[-1] > self.max_step_tokens:
            raise ValueError(f"request_ids: expected at most {self.max_step_tokens} tokens, "
                             f"got {int(offsets[-1])}")
        # Every layer carries exactly the step's tokens: a short k would leave stale bytes in
        # positions that commit_step registers and other requests then reuse.
        with launch_scope(self.kv_pool.device, stream):   # foreign arrays: after producers
            checked = self.kv_pool.check_write(k, v, layer=layer, k_scale=k_scale,
                                               v_scale=v_scale, num_tokens=int(offsets[-1]))
        which, positions = ragged_columns(starts, lengths)
        positions[positions < requests.kv_cached[rows][which]] = -1
        table = requests.request_to_kv_block_ids[rows]
        n, b = len(positions), len(rows)
        with launch_scope(self.kv_pool.device, stream, self.kv_pool.order):
            upload_ints(self._positions_dev, positions)
            upload_ints(self._offsets_dev, offsets)
            upload_ints(self._table_dev, table)
            local = None
            if self.window is not None:
                upload_ints(self._local_dev, self.window.table[rows])
                local = self._local_dev[:b]
        self.kv_pool.launch_write(checked, block_table=self._table_dev[:b],
                                  seq_offsets=self._offsets_dev[:b + 1], batch=b,
                                  positions=self._positions_dev[:n], stream=stream,
                                  local_block_table=local)
