"""Mid-prefill Mamba snapshots: which block boundaries to keep and where the model writes them
(docs/design.md §6).

A prefill chunk can end between the block boundaries whose states a later request would like to
restore. For each request row, :meth:`IntermediateStates.plan` chooses which boundaries fall
inside the chunk; the model writes the state after each of them into the scratch outputs
``conv_out`` / ``ssm_out``
``[num_mamba_layers, MAX_INTERMEDIATE_OFFSETS_PER_REQUEST * max_requests, *shape]``, and
:meth:`MambaSlotAllocator.commit_intermediate_states` then copies them into durable cache slots
(together with the live end-of-chunk state when the prompt is block-aligned, the "EOS" entry).

Invariants of the per-row tracking (host NumPy, ``[max_requests, K]`` with ``K =
MAX_INTERMEDIATE_OFFSETS_PER_REQUEST``; checked by :meth:`IntermediateStates.broken_invariants`):

- row ``r`` has ``counts[r]`` pending entries, packed at the front of ``offsets[r]`` /
  ``block_ids[r]`` (the rest are 0 / -1);
- ``eos_block_ids[r]`` is the block whose live state is kept at commit, or -1;
- ``pending`` is True whenever some row has a pending entry or an EOS entry, so a step without
  snapshots costs no work, and the rows holding entries are noted while they are few
  (:class:`~.mamba_entry_rows.EntryRows`), so a step's few entries cost no scan of every row.
"""

from __future__ import annotations

import numpy as np

from .._checks import as_int, host_ints
from ..runtime.device import launch_scope, stream_handle, to_host, upload_ints, zeros
from ..runtime.stream_order import StreamOrder
from .mamba_entry_rows import EntryRows
from .mamba_plan_checks import checked_batch, prompt_length

__all__ = ["MAX_INTERMEDIATE_OFFSETS_PER_REQUEST", "IntermediateStates"]

MAX_INTERMEDIATE_OFFSETS_PER_REQUEST = 3
_K = MAX_INTERMEDIATE_OFFSETS_PER_REQUEST


_PLAIN_INT = {int}
_NO_EXTRA = np.zeros(0, np.int64)


class IntermediateStates:
    """Scratch outputs and per-row tracking of the boundary states one step keeps.

    Parameters
    ----------
    device : Device
        Where the scratch and its staging live (``xp`` is its array module).
    num_mamba_layers, max_requests : int
    conv_states_shape, ssm_states_shape : tuple of int or None
        Per-state shapes (``None``: the layers have no such state, and no scratch).
    conv_dtype, ssm_dtype : dtype
        Storage dtypes of the states.

    Attributes
    ----------
    conv_out, ssm_out : arrays [num_mamba_layers, max_count, *shape] or None
        Scratch the model writes boundary states into (zero-initialised).
    max_count : int
        ``MAX_INTERMEDIATE_OFFSETS_PER_REQUEST * max_requests``.
    offsets, block_ids : int32 [max_requests, K]
        Per row, the pending offsets (from the chunk start) and the blocks ending there.
    counts : int32 [max_requests]
        Pending entries per row.
    eos_block_ids : int32 [max_requests]
        Per row, the block that keeps the live state at commit, or -1.
    pending : bool
        Whether anything may be pending (a step without snapshots skips all work).
    entry_rows : EntryRows
        The rows that may hold entries, and the step's entries read and cleared by row.
    """

    def __init__(self, device, num_mamba_layers, max_requests, conv_states_shape,
                 ssm_states_shape, conv_dtype, ssm_dtype):
        xp, L, R = device.xp, num_mamba_layers, max_requests
        self.device, self.max_requests, self.max_count = device, R, _K * R
        self.order = StreamOrder()   # its staging buffers: one chain across streams
        with device.scope():
            self.conv_out, self.ssm_out = (
                None if shape is None else zeros(device, (L, self.max_count, *shape), dt)
                for shape, dt in ((conv_states_shape, conv_dtype), (ssm_states_shape, ssm_dtype)))
            # Staging for get_intermediate_gpu_data, so steps allocate no device memory.
            self._offsets_dev = xp.zeros((R, _K), dtype=np.int32)
            self._counts_dev = xp.zeros((R,), dtype=np.int32)
        self.offsets = np.zeros((R, _K), dtype=np.int32)
        self.block_ids = np.full((R, _K), -1, dtype=np.int32)
        self.counts = np.zeros(R, dtype=np.int32)
        self.eos_block_ids = np.full(R, -1, dtype=np.int32)
        self.entry_rows = EntryRows(self.offsets, self.block_ids, self.counts, self.eos_block_ids)

    pending = property(lambda self: self.entry_rows.pending,
                       lambda self, value: self.entry_rows.flag(value),
                       doc="Whether anything may be pending (set by a writer of the arrays).")

    def plan(self, row, req, skip_tokens, prefill_chunk_length, num_matched_blocks,
             matched_block_ids, overall_required_blocks, *, block_table, block_size,
             chunk_size, extra_boundaries=()) -> None:
        """Choose the block boundaries inside this chunk of request row ``row`` whose states
        the model must emit, replacing the row's previous entries.

        Candidates (absolute positions): the KV divergence point (end of the matched blocks),
        the last block boundary of the prompt, and the start of the chunk's last block. An
        offset ``o = position - chunk_start`` (``chunk_start = finished + skip_tokens``) is kept
        when ``0 < o < computed tokens`` and ``o % chunk_size == 0``; its block is the one
        ending at that position in ``block_table[row]``. When this is the prompt's last chunk
        and the prompt is block-aligned, the live end-of-chunk state is kept for the last block
        instead (the "EOS" entry).

        Parameters
        ----------
        row : int
            Checked request row.
        req : object
            ``prompt_length`` (or ``prompt_tokens``) and optionally
            ``finished_chunk_token_count`` (tokens of earlier chunks, default 0).
        skip_tokens, prefill_chunk_length : int
            Tokens skipped by the prefix match, and the chunk length before skipping.
        num_matched_blocks : int
            KV blocks matched from the chunk's first block.
        matched_block_ids : sequence of int
            Their ids (checked against the block table).
        overall_required_blocks : int
            Blocks covering the request through the end of this chunk.
        block_table : int32 [max_requests, max_blocks_per_request]
            Request row -> KV block ids (-1 = none), host or device.
        block_size, chunk_size : int
            Tokens per KV block, and the granularity at which the model can emit states.
        extra_boundaries : sequence of int, optional
            Further absolute block boundaries (multiples of ``block_size``) to snapshot, after
            the three above, within the same filter and the limit of
            ``MAX_INTERMEDIATE_OFFSETS_PER_REQUEST``.

        Raises
        ------
        TypeError
            ``req`` has no prompt length, or an argument is not an int.
        ValueError
            ``skip_tokens >= prefill_chunk_length``, ``matched_block_ids`` disagree with the
            block table, an extra boundary is not a block boundary, or a kept boundary has no
            block. Nothing changes.
        """
        bs, align = block_size, chunk_size
        finished = int(getattr(req, "finished_chunk_token_count", 0))
        prompt_len = prompt_length(req)
        counts = (skip_tokens, prefill_chunk_length, num_matched_blocks, overall_required_blocks)
        if set(map(type, counts)) == _PLAIN_INT and 0 <= min(counts) <= max(counts) < 2**63:
            skip, chunk, matched, required = counts   # plain ints in range: as_int's result
        else:
            skip = as_int("skip_tokens", skip_tokens)
            chunk = as_int("prefill_chunk_length", prefill_chunk_length)
            matched = as_int("num_matched_blocks", num_matched_blocks)
            required = as_int("overall_required_blocks", overall_required_blocks)
        if skip >= chunk:
            raise ValueError(f"skip_tokens: expected fewer than {chunk} tokens, got {skip}")
        table = to_host(block_table)[row]
        first_block = -(-finished // bs)
        matched_ids = host_ints("matched_block_ids", matched_block_ids)
        extra = _NO_EXTRA if type(extra_boundaries) is tuple and not extra_boundaries \
            else host_ints("extra_boundaries", extra_boundaries)
        if len(extra) and np.count_nonzero(extra % bs):     # a state belongs to a block's end
            bad = extra[np.flatnonzero(extra % bs)[0]]
            raise ValueError(f"extra_boundaries: expected multiples of block_size {bs}, "
                             f"got {bad}")
        if table[first_block:first_block + matched].tolist() != matched_ids[:matched].tolist():
            raise ValueError("matched_block_ids: expected the block table's matched blocks")
        boundaries = [(first_block + matched) * bs, (prompt_len // bs) * bs, (required - 1) * bs]
        boundaries += extra.tolist()
        closes = finished + chunk >= prompt_len and prompt_len > 0 and prompt_len % bs == 0
        self._keep(row, table, finished + skip, chunk - skip, boundaries,
                   prompt_len // bs - 1 if closes else -1, bs, align)

    def plan_prompt(self, row: int, table, skip: int, prompt_len: int, matched: int,
                    required: int, extra: int, block_size: int, chunk_size: int) -> None:
        """:meth:`plan` of a whole prompt in one chunk (no earlier chunk), on trusted Python
        ints (an admission's own): ``table`` is the row's host block table, ``extra`` the one
        extra boundary."""
        bs = block_size
        self._keep(row, table, skip, prompt_len - skip,
                   [matched * bs, prompt_len // bs * bs, (required - 1) * bs, extra],
                   prompt_len // bs - 1 if prompt_len % bs == 0 else -1, bs, chunk_size)

    def _keep(self, row, table, chunk_start, seq_len, boundaries, eos_column, bs, align):
        """Replace the entries of ``row``: the first ``K`` distinct ``boundaries`` strictly
        inside ``[chunk_start, chunk_start + seq_len)`` on a multiple of ``align`` from it,
        sorted, and the EOS entry of block-table column ``eos_column`` (-1: none). Raises
        ``ValueError`` (nothing changes) when one has no block in ``table`` (the row's)."""
        kept = {}      # loops, not comprehensions: this runs once per admitted request
        for p in boundaries:
            o = p - chunk_start
            if 0 < o < seq_len and o % align == 0:
                kept[o] = None
        offsets = sorted(list(kept)[:_K])
        columns = [(chunk_start + o) // bs - 1 for o in offsets]
        if eos_column >= 0:
            columns.append(eos_column)
        width = len(table)
        block_ids = [table.item(c) if c < width else -1 for c in columns]
        if block_ids and min(block_ids) < 0:
            raise ValueError(f"request_to_kv_block_ids: expected a block at every boundary "
                             f"of row {row}, got {table[:max(columns) + 1].tolist()}")
        n = len(offsets)
        eos = block_ids[-1] if len(columns) > n else -1
        self.entry_rows.write_row(row, offsets, block_ids[:n], eos)

    def plan_batch(self, rows, chunk_starts, seq_lens, boundaries, eos_columns, *,
                   block_table, block_size, chunk_size) -> None:
        """Vectorised :meth:`plan` of distinct request ``rows`` whose candidates are given.

        Parameters
        ----------
        rows : int64 [n]
            Distinct checked rows.
        chunk_starts, seq_lens : int64 [n]
            First computed position and computed tokens of each row's chunk.
        boundaries : int64 [n, m] or None
            Candidate absolute block boundaries of each row, in :meth:`plan`'s order (kept
            when ``0 < position - chunk_start < seq_len`` and chunk-aligned, first
            ``MAX_INTERMEDIATE_OFFSETS_PER_REQUEST`` distinct ones, then sorted); None when
            no row computes more than one token (no boundary can fall inside).
        eos_columns : int64 [n]
            Block-table column of each row's EOS entry, or -1.
        block_table : int32 [max_requests, max_blocks_per_request]
            Request row -> KV block ids (-1 = none), host or device.
        block_size, chunk_size : int

        Raises
        ------
        ValueError
            A kept boundary or EOS entry has no block. Nothing changes.
        """
        block_table = to_host(block_table)
        rows, chunk_starts, seq_lens, boundaries, eos_columns = checked_batch(
            rows, chunk_starts, seq_lens, boundaries, eos_columns, block_table.shape)
        if boundaries is None:
            counts = None
        else:
            off = boundaries - chunk_starts[:, None]
            valid = (off > 0) & (off < seq_lens[:, None]) & (off % chunk_size == 0)
            for j in range(1, off.shape[1]):       # a repeated candidate counts once
                for i in range(j):
                    valid[:, j] &= ~(valid[:, i] & (off[:, i] == off[:, j]))
            valid &= np.cumsum(valid, axis=1) <= _K
            keyed = np.sort(np.where(valid, off, np.iinfo(np.int64).max), axis=1)
            keyed = np.pad(keyed, ((0, 0), (0, max(0, _K - keyed.shape[1]))))[:, :_K]
            counts = valid.sum(axis=1).astype(np.int32)
            used = np.arange(_K)[None, :] < counts[:, None]
            offsets = np.where(used, keyed, 0)
            cols = np.where(used, (chunk_starts[:, None] + offsets) // block_size - 1, 0)
            blocks = np.where(used, block_table[rows[:, None], cols], -1)
            if (blocks[used] < 0).any():
                raise ValueError("request_to_kv_block_ids: expected a block at every "
                                 "snapshot boundary")
        has_eos = np.flatnonzero(eos_columns >= 0)
        eos = block_table[rows[has_eos], eos_columns[has_eos]]
        if (eos < 0).any():
            raise ValueError("request_to_kv_block_ids: expected a block at every EOS entry")
        if self.pending:     # rows may hold entries of an uncommitted step: replace them
            self.offsets[rows] = 0
            self.block_ids[rows] = -1
            self.counts[rows] = 0
            self.eos_block_ids[rows] = -1
        if counts is not None and counts.any():
            self.offsets[rows] = offsets
            self.block_ids[rows] = blocks
            self.counts[rows] = counts
            self.entry_rows.track(rows.tolist())
        if len(eos):
            self.eos_block_ids[rows[has_eos]] = eos
            self.entry_rows.track(rows[has_eos].tolist())

    def plan_eos(self, rows, block_ids) -> None:
        """:meth:`plan_batch` of one-token chunks that each end on a block boundary: the EOS
        entries ``block_ids`` of distinct checked ``rows`` (lists of Python ints, or int
        arrays), nothing else (entries of an uncommitted step are replaced)."""
        self.entry_rows.write_eos(rows, block_ids)

    def targets(self) -> list[tuple[int, int, int]]:
        """``(request_row, offset, scratch_index)`` of every pending boundary state, packed
        densely in ascending row order, then offset order: the model writes the state after
        ``chunk_start + offset`` tokens of the row into ``*_out[:, scratch_index]``."""
        rows, ks = np.nonzero(np.arange(_K)[None, :] < self.counts[:, None])
        return [(int(r), int(self.offsets[r, k]), i)
                for i, (r, k) in enumerate(zip(rows.tolist(), ks.tolist(), strict=True))]

    def device_data(self, prefill_start=0, prefill_count=None, *, stream=None):
        """Offsets ``int32 [prefill_count, K]`` and counts ``int32 [prefill_count]`` of rows
        ``[prefill_start, prefill_start + prefill_count)`` (default: through the last row), as
        views of staging buffers on the device (overwritten by the next call); ``(None, None)``
        when nothing is pending or the slice is empty.

        Raises
        ------
        TypeError, ValueError
            ``prefill_start`` or ``prefill_count`` is not an int >= 0, or ``stream`` is bad.
        IndexError
            The rows run past ``max_requests``.
        """
        start = as_int("prefill_start", prefill_start)
        if start > self.max_requests:
            raise IndexError(f"prefill_start: expected a row in [0, {self.max_requests}], "
                             f"got {start}")
        count = self.max_requests - start if prefill_count is None \
            else as_int("prefill_count", prefill_count)
        stream_handle(stream)
        if start + count > self.max_requests:
            raise IndexError(f"prefill_count: expected rows within [0, {self.max_requests}), "
                             f"got [{start}, {start + count})")
        if not self.pending or count == 0:
            return None, None
        with launch_scope(self.device, stream, self.order):
            upload_ints(self._offsets_dev, self.offsets[start:start + count])
            upload_ints(self._counts_dev, self.counts[start:start + count])
        return self._offsets_dev[:count], self._counts_dev[:count]

    def collect(self, kv_block_hashes: np.ndarray):
        """``(intermediate_bids, src_offsets, eos_bids, eos_ctx_indices, all_hashes)`` as int64
        arrays, or None when nothing is pending. ``all_hashes`` are the ``kv_block_hashes`` of
        ``intermediate_bids`` then ``eos_bids``; scratch entries are in ascending row order."""
        if not self.pending:
            return None
        if np.count_nonzero(self.counts):
            inter = self.block_ids[np.arange(_K)[None, :] < self.counts[:, None]].astype(np.int64)
        else:       # EOS entries only (decode steps)
            inter = np.zeros(0, np.int64)
        eos_rows = (self.eos_block_ids >= 0).nonzero()[0].astype(np.int64)
        eos = self.eos_block_ids[eos_rows].astype(np.int64)
        if not len(inter) and not len(eos):
            return None
        hashes = np.asarray(kv_block_hashes)[np.concatenate([inter, eos])].astype(np.int64)
        return inter, np.arange(len(inter), dtype=np.int64), eos, eos_rows, hashes

    def entries(self, limit: int):
        """:meth:`collect` as lists: ``(block_ids, eos_rows, num_scratch)``, None when over
        ``limit`` entries may be pending."""
        return self.entry_rows.entries(limit)

    def clear(self, rows=None) -> None:
        """Forget the pending entries of ``rows`` (default: every row). Raises ``IndexError``
        (nothing changes) when a row is out of range."""
        self.entry_rows.clear(rows)

    def reset(self) -> None:
        """Forget every entry and zero the scratch (device fills, no allocation)."""
        with self.device.scope():
            for scratch in (self.conv_out, self.ssm_out):
                if scratch is not None:
                    scratch.fill(0)
        self.clear()

    def broken_invariants(self) -> list[str]:
        """Every broken invariant of the tracking (module docstring); empty when all hold."""
        problems = []
        if ((self.counts < 0) | (self.counts > _K)).any():
            problems.append(f"intermediate counts outside [0, {_K}]")
            return problems
        unused = np.arange(_K)[None, :] >= self.counts[:, None]
        if (self.offsets[unused] != 0).any() or (self.block_ids[unused] != -1).any():
            problems.append("intermediate entries beyond a row's count")
        return problems + self.entry_rows.broken_invariants()
