"""Mid-prefill Mamba snapshots: which block boundaries to keep and how they become cached states.

A prefill chunk can end between the block boundaries whose states a later request would like to
restore. For each request row the context asks :meth:`compute_and_store_offsets` which boundaries
fall inside the chunk; the model writes the state after each of them into the scratch outputs
``intermediate_conv_out`` / ``intermediate_ssm_out``
``[num_mamba_layers, MAX_INTERMEDIATE_OFFSETS_PER_REQUEST * max_requests, *shape]``, and
:meth:`commit_intermediate_states` then copies them into durable cache slots (together with the
live end-of-chunk state when the prompt is block-aligned, the "EOS" entry).

Invariants of the per-row tracking (host NumPy, ``[max_requests, K]`` with ``K =
MAX_INTERMEDIATE_OFFSETS_PER_REQUEST``):

- row ``r`` has ``_intermediate_counts[r]`` pending entries, packed at the front of
  ``_intermediate_offsets[r]`` / ``_intermediate_block_ids[r]`` (the rest are 0 / -1);
- ``_eos_cache_block_id[r]`` is the block whose live state is kept at commit, or -1;
- ``_has_intermediates`` is True whenever some row has a pending entry or an EOS entry, so a
  step without snapshots costs no work.

:class:`MambaIntermediateMixin` holds this machinery; :class:`MambaSlotAllocator` inherits it.
"""

from __future__ import annotations

import operator

import numpy as np

from .._checks import as_int, check_index, index_array
from ..device import stream_scope, to_host
from ..ops.tables import SlotSet

__all__ = ["MAX_INTERMEDIATE_OFFSETS_PER_REQUEST", "MambaIntermediateMixin"]

MAX_INTERMEDIATE_OFFSETS_PER_REQUEST = 3
_K = MAX_INTERMEDIATE_OFFSETS_PER_REQUEST


def _prompt_length(req) -> int:
    if hasattr(req, "prompt_length"):
        return int(req.prompt_length)
    if hasattr(req, "prompt_tokens"):
        return len(req.prompt_tokens)
    raise TypeError(f"req: expected an object with prompt_length or prompt_tokens, "
                    f"got {type(req).__name__}")


class MambaIntermediateMixin:
    """Intermediate-state methods of :class:`~hcache.contexts.MambaSlotAllocator`.

    Relies on the allocator's ``context``, ``xp``, ``device``, ``num_mamba_layers``,
    ``max_requests``, ``max_slots``, ``conv_states`` / ``ssm_states`` (and their shapes),
    ``block_to_slot``, ``_block_hash``, ``_kv``, ``_slot_demand``, ``_copy``,
    ``allocate_slots_batch``, ``store_from_live_batch`` and ``register_block_hashes_batch``.
    """

    def _init_intermediate(self, conv_dt, ssm_dt) -> None:
        """Allocate the scratch outputs, their device staging and the per-row tracking.

        Called by the constructor inside the device scope, once ``conv_states`` /
        ``ssm_states`` exist.
        """
        xp, L, R = self.xp, self.num_mamba_layers, self.max_requests
        self.max_intermediate_count = _K * R
        self.intermediate_conv_out = xp.zeros(
            (L, self.max_intermediate_count, *self.conv_states_shape), dtype=conv_dt)
        self.intermediate_ssm_out = xp.zeros(
            (L, self.max_intermediate_count, *self.ssm_states_shape), dtype=ssm_dt)
        self._offsets_dev = xp.zeros((R, _K), dtype=np.int32)
        self._counts_dev = xp.zeros((R,), dtype=np.int32)
        # Scratch -> cache for conv and SSM of every layer: each commit is one slot_copy launch.
        self._scratch_to_cache = SlotSet(
            [(self.intermediate_conv_out[i], self.conv_states[i]) for i in range(L)]
            + [(self.intermediate_ssm_out[i], self.ssm_states[i]) for i in range(L)])
        self._intermediate_offsets = np.zeros((R, _K), dtype=np.int32)
        self._intermediate_block_ids = np.full((R, _K), -1, dtype=np.int32)
        self._intermediate_counts = np.zeros(R, dtype=np.int32)
        self._eos_cache_block_id = np.full(R, -1, dtype=np.int32)
        self._has_intermediates = False

    def compute_and_store_offsets(self, req, current_id, skip_tokens, prefill_chunk_length,
                                  num_matched_blocks, matched_block_ids,
                                  overall_required_blocks, *, extra_boundaries=()) -> None:
        """Choose the block boundaries inside this chunk whose states the model must emit.

        Candidates (absolute positions): the KV divergence point (end of the matched blocks),
        the last block boundary of the prompt, and the start of the chunk's last block. An
        offset ``o = position - chunk_start`` (``chunk_start = finished + skip_tokens``) is kept
        when ``0 < o < computed tokens`` and ``o % mamba_chunk_size == 0``; its block is the one
        ending at that position in ``request_to_kv_block_ids[current_id]``. When this is the
        prompt's last chunk and the prompt is block-aligned, the live end-of-chunk state is
        kept for the last block instead (the "EOS" entry).

        Parameters
        ----------
        req : object
            ``prompt_length`` (or ``prompt_tokens``) and optionally
            ``finished_chunk_token_count`` (tokens of earlier chunks, default 0).
        current_id : int
            Request row.
        skip_tokens, prefill_chunk_length : int
            Tokens skipped by the prefix match, and the chunk length before skipping.
        num_matched_blocks : int
            KV blocks matched from the chunk's first block.
        matched_block_ids : sequence of int
            Their ids (checked against the block table).
        overall_required_blocks : int
            Blocks covering the request through the end of this chunk.
        extra_boundaries : sequence of int, optional
            Further absolute block boundaries to snapshot, after the three above, within the
            same filter and the limit of ``MAX_INTERMEDIATE_OFFSETS_PER_REQUEST``.
        """
        row = check_index("current_id", current_id, self.max_requests)
        bs, align = int(self.context.block_size_tokens), int(self.context.mamba_chunk_size)
        finished = int(getattr(req, "finished_chunk_token_count", 0))
        prompt_len = _prompt_length(req)
        skip = as_int("skip_tokens", skip_tokens)
        chunk = as_int("prefill_chunk_length", prefill_chunk_length)
        matched = as_int("num_matched_blocks", num_matched_blocks)
        required = as_int("overall_required_blocks", overall_required_blocks)
        if skip >= chunk:
            raise ValueError(f"skip_tokens: expected fewer than {chunk} tokens, got {skip}")
        table = to_host(self.context.request_to_kv_block_ids)[row]
        first_block = -(-finished // bs)
        if list(table[first_block:first_block + matched]) != list(matched_block_ids)[:matched]:
            raise ValueError("matched_block_ids: expected the block table's matched blocks")
        chunk_start, seq_len = finished + skip, chunk - skip
        boundaries = [(first_block + matched) * bs, (prompt_len // bs) * bs, (required - 1) * bs]
        boundaries += [operator.index(p) for p in extra_boundaries]
        kept = [p - chunk_start for p in boundaries
                if 0 < p - chunk_start < seq_len and (p - chunk_start) % align == 0]
        offsets = sorted(list(dict.fromkeys(kept))[:_K])
        columns = [(chunk_start + o) // bs - 1 for o in offsets]
        if finished + chunk >= prompt_len and prompt_len > 0 and prompt_len % bs == 0:
            columns.append(prompt_len // bs - 1)  # the EOS entry
        if any(c >= len(table) or table[c] < 0 for c in columns):
            raise ValueError(f"request_to_kv_block_ids: expected a block at every boundary of "
                             f"row {row}, got {table[:max(columns) + 1].tolist()}")
        block_ids = [int(table[c]) for c in columns[:len(offsets)]]
        eos = int(table[columns[-1]]) if len(columns) > len(offsets) else -1
        n = len(offsets)
        self._intermediate_offsets[row] = 0
        self._intermediate_block_ids[row] = -1
        self._intermediate_offsets[row, :n] = offsets
        self._intermediate_block_ids[row, :n] = block_ids
        self._intermediate_counts[row] = n
        self._eos_cache_block_id[row] = eos
        if n or eos >= 0:
            self._has_intermediates = True

    def intermediate_targets(self) -> list[tuple[int, int, int]]:
        """``(request_row, offset, scratch_index)`` of every pending intermediate state.

        Scratch entries are packed densely in ascending row order, then offset order: the
        model writes the state after ``chunk_start + offset`` tokens of that row into
        ``intermediate_*_out[:, scratch_index]``.
        """
        rows, ks = np.nonzero(np.arange(_K)[None, :] < self._intermediate_counts[:, None])
        return [(int(r), int(self._intermediate_offsets[r, k]), i)
                for i, (r, k) in enumerate(zip(rows.tolist(), ks.tolist(), strict=True))]

    def get_intermediate_gpu_data(self, prefill_start=0, prefill_count=None, *, stream=None):
        """Offsets ``int32 [prefill_count, 3]`` and counts ``int32 [prefill_count]`` of request
        rows ``[prefill_start, prefill_start + prefill_count)`` (default: through the last row),
        as views of buffers on the states' device (overwritten by the next call).

        Returns ``(None, None)`` when nothing is pending or the slice is empty.
        """
        start = as_int("prefill_start", prefill_start)
        count = self.max_requests - start if prefill_count is None \
            else as_int("prefill_count", prefill_count)
        if start + count > self.max_requests:
            raise IndexError(f"prefill_count: expected rows within [0, {self.max_requests}), "
                             f"got [{start}, {start + count})")
        if not self._has_intermediates or count == 0:
            return None, None
        offsets = self._intermediate_offsets[start:start + count]
        counts = self._intermediate_counts[start:start + count]
        if self.xp is np:
            self._offsets_dev[:count] = offsets
            self._counts_dev[:count] = counts
        else:
            with stream_scope(stream, self.device), self.device.scope():
                current = self.xp.cuda.get_current_stream()
                self._offsets_dev[:count].set(np.ascontiguousarray(offsets), stream=current)
                self._counts_dev[:count].set(np.ascontiguousarray(counts), stream=current)
        return self._offsets_dev[:count], self._counts_dev[:count]

    def _collect_commit_data(self):
        """``(intermediate_bids, src_offsets, eos_bids, eos_ctx_indices, all_hashes)`` as int64
        arrays, or None when nothing is pending. ``all_hashes`` are the KV hashes of
        ``intermediate_bids`` then ``eos_bids``; scratch entries are in ascending row order."""
        if not self._has_intermediates:
            return None
        valid = np.arange(_K)[None, :] < self._intermediate_counts[:, None]
        inter = self._intermediate_block_ids[valid].astype(np.int64)
        eos_rows = np.nonzero(self._eos_cache_block_id >= 0)[0].astype(np.int64)
        eos = self._eos_cache_block_id[eos_rows].astype(np.int64)
        if not len(inter) and not len(eos):
            return None
        hashes = np.asarray(self._kv.block_hashes)[np.concatenate([inter, eos])].astype(np.int64)
        return inter, np.arange(len(inter), dtype=np.int64), eos, eos_rows, hashes

    def commit_intermediate_states(self, *, stream=None) -> int:
        """Keep this step's boundary states (scratch and EOS) as cached states, then clear the
        per-request tracking. Call after the forward pass and before rows are reordered.

        Best effort: entries whose KV block is unregistered (unreachable), already cached under
        its hash, or repeated are skipped; when slots run short, entries that own a slot plus as
        many new ones as are available are kept. Returns the number of states stored.
        """
        data = self._collect_commit_data()
        if data is None:
            self._clear_intermediate_state()
            return 0
        inter, src, eos, eos_rows, hashes = data
        bids = np.concatenate([inter, eos])
        keep = (hashes > 0) & (self._block_hash[bids] != hashes)
        idx = np.nonzero(keep)[0]
        _, first = np.unique(bids[idx], return_index=True)
        idx = np.sort(idx[first])
        new, available = self._slot_demand(bids[idx])
        if len(new) > available:
            allowed = new[:available]
            idx = idx[(self.block_to_slot[bids[idx]] >= 0) | np.isin(bids[idx], allowed)]
        slots = np.asarray(self.allocate_slots_batch(bids[idx]), dtype=np.int64)
        is_inter = idx < len(inter)
        self._copy_intermediate_to_cache(src[idx[is_inter]], slots[is_inter], stream=stream)
        self.store_from_live_batch(slots[~is_inter], eos_rows[idx[~is_inter] - len(inter)],
                                   stream=stream)
        self.register_block_hashes_batch(bids[idx], hashes[idx])
        self._clear_intermediate_state()
        return int(len(idx))

    def _copy_intermediate_to_cache(self, src_offsets, slots, *, stream=None) -> None:
        """``cache[:, slots[i]] = intermediate_out[:, src_offsets[i]]`` for conv and SSM of
        every layer, one launch. Slots must be distinct."""
        src = index_array("src_offsets", src_offsets, self.max_intermediate_count)
        dst = index_array("slots", slots, self.max_slots)
        if len(src) != len(dst):
            raise ValueError(f"slots: expected {len(src)} slots, got {len(dst)}")
        if len(np.unique(dst)) != len(dst):
            raise ValueError("slots: expected distinct slots, got a repeated slot")
        self._copy(self._scratch_to_cache, src, dst, 1, stream)

    def _clear_intermediate_state(self, rows=None) -> None:
        """Forget the pending offsets and EOS entries of ``rows`` (default: every row)."""
        sel = slice(None) if rows is None else index_array("rows", rows, self.max_requests)
        self._intermediate_offsets[sel] = 0
        self._intermediate_block_ids[sel] = -1
        self._intermediate_counts[sel] = 0
        self._eos_cache_block_id[sel] = -1
        self._has_intermediates = bool(self._intermediate_counts.any()
                                       or (self._eos_cache_block_id >= 0).any())
