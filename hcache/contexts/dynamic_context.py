"""The cache-owning part of a serving context for hybrid models with prefix caching (docs/design.md
§6).

:class:`DynamicInferenceContext` owns the paged KV pool and its :class:`KVBlockAllocator`, the live
per-request Mamba states, the :class:`MambaSlotAllocator`, request rows and block tables, and the
prefix match. An engine drives it one step at a time::

    plan = ctx.add_request(rid, prompt)        # or ctx.extend_request(rid, new_tokens)
    ...                                        # schedule more requests
    targets = ctx.snapshot_targets()           # boundary states the model must emit
    # forward: for each plan compute plan.tokens (positions plan.start..plan.end-1) from the
    # live Mamba state mamba_*_states[:, plan.mamba_slot]; write K/V with ctx.write_kv; write
    # the state after `offset` computed tokens into intermediate_*_out[:, scratch_index]
    ctx.commit_step()                          # register blocks, keep Mamba snapshots, tick
    ctx.release_requests([rid])

The prefix-match policy (what is matched, skipped and snapshotted) is described and implemented
in :mod:`hcache.contexts.prefix_match`; the per-request records and the request table live in
:mod:`hcache.contexts.requests`.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import as_int, int_shape
from ..device import resolve_device, stream_scope
from ..dtypes import resolve_dtype, storage_dtype
from ..errors import CacheCapacityError
from ..ops.tables import SlotSet
from .block_hashing import compute_block_hashes
from .kv_block_allocator import KVBlockAllocator
from .mamba_slot_allocator import MambaSlotAllocator
from .paged_kv_pool import PagedKVPool
from .prefix_match import PrefixMatchMixin
from .requests import PrefixCacheStats, RequestTableMixin, StepPlan, _Request

__all__ = ["DynamicInferenceContext", "StepPlan", "PrefixCacheStats"]


class DynamicInferenceContext(RequestTableMixin, PrefixMatchMixin):
    """Paged KV pool, live Mamba states, Mamba state cache, request rows and prefix matching.

    Parameters
    ----------
    kv_layer_configs : sequence of KVLayerConfig
        One per attention layer.
    num_blocks, block_size_tokens : int
        Paged pool size (blocks shared by all layers) and tokens per block.
    max_requests, max_blocks_per_request : int
        Request rows and block-table width (the longest sequence is
        ``max_blocks_per_request * block_size_tokens`` tokens).
    num_mamba_layers : int
        0 for an attention-only model.
    conv_states_shape, ssm_states_shape : tuple of int
        Per-request Mamba state shapes (ignored without Mamba layers).
    kv_dtype, conv_states_dtype, ssm_states_dtype : str or dtype
    mamba_cache_slots : int
        Durable Mamba cache slots; 0 disables state caching (KV blocks are still shared).
    mamba_chunk_size : int, optional
        Granularity at which the model can emit mid-prefill states (default
        ``block_size_tokens``); must divide ``block_size_tokens``.
    enable_prefix_caching : bool
    eviction_policy : {"lru", "ref_zero"}
    max_step_tokens : int, optional
        Most tokens one :meth:`write_kv` call may carry (default: every row's full length).
    device : None, "cpu", "cuda" or "cuda:N"

    Attributes
    ----------
    kv_pool : PagedKVPool
    kv_block_allocator : KVBlockAllocator
    mamba_slot_allocator : MambaSlotAllocator or None
    mamba_conv_states, mamba_ssm_states : arrays [num_mamba_layers, max_requests, *shape]
        Live per-request states (views for the model).
    request_to_kv_block_ids : int32 [max_requests, max_blocks_per_request]
        Host block table; -1 = none.
    request_to_mamba_state_idx : int32 [max_requests]
        Host map request row -> live Mamba slot; -1 = none.
    stats : PrefixCacheStats
        Totals over every request ever added.

    Notes
    -----
    The context owns all state; the request queries (:meth:`request_stats`,
    :meth:`block_ids`, ...) come from :class:`~hcache.contexts.requests.RequestTableMixin` and
    the prefix-match policy (:meth:`snapshot_targets`, :meth:`shares_pending_blocks`) from
    :class:`~hcache.contexts.prefix_match.PrefixMatchMixin`.
    """

    def __init__(self, *, kv_layer_configs, num_blocks, block_size_tokens, max_requests,
                 max_blocks_per_request, num_mamba_layers=0, conv_states_shape=(1,),
                 ssm_states_shape=(1,), kv_dtype="float16", conv_states_dtype="float16",
                 ssm_states_dtype="float32", mamba_cache_slots=0, mamba_chunk_size=None,
                 enable_prefix_caching=True, eviction_policy="lru", max_step_tokens=None,
                 device=None):
        self.device = resolve_device(device)
        xp = self.xp = self.device.xp
        self.block_size_tokens = as_int("block_size_tokens", block_size_tokens, 1)
        self.max_requests = as_int("max_requests", max_requests, 1)
        self.max_blocks_per_request = as_int("max_blocks_per_request", max_blocks_per_request, 1)
        self.num_mamba_layers = as_int("num_mamba_layers", num_mamba_layers)
        self.mamba_chunk_size = as_int("mamba_chunk_size", block_size_tokens
                                     if mamba_chunk_size is None else mamba_chunk_size, 1)
        if self.block_size_tokens % self.mamba_chunk_size:
            raise ValueError(f"mamba_chunk_size: expected a divisor of block_size_tokens "
                             f"{self.block_size_tokens}, got {self.mamba_chunk_size}")
        slots = as_int("mamba_cache_slots", mamba_cache_slots)
        self.max_sequence_length = self.max_blocks_per_request * self.block_size_tokens
        self.max_step_tokens = as_int("max_step_tokens", self.max_requests
                                    * self.max_sequence_length if max_step_tokens is None
                                    else max_step_tokens, 1)
        self.kv_pool = PagedKVPool(list(kv_layer_configs), num_blocks, self.block_size_tokens,
                                   kv_dtype, device=self.device)
        self.kv_block_allocator = KVBlockAllocator(
            num_blocks, enable_prefix_caching=enable_prefix_caching,
            eviction_policy=eviction_policy)
        conv_shape = int_shape("conv_states_shape", conv_states_shape)
        ssm_shape = int_shape("ssm_states_shape", ssm_states_shape)
        L, R = self.num_mamba_layers, self.max_requests
        conv_dt = storage_dtype(resolve_dtype(conv_states_dtype, "conv_states_dtype"), xp)
        ssm_dt = storage_dtype(resolve_dtype(ssm_states_dtype, "ssm_states_dtype"), xp)
        with self.device.scope():
            self.mamba_conv_states = xp.zeros((L, R, *conv_shape), dtype=conv_dt)
            self.mamba_ssm_states = xp.zeros((L, R, *ssm_shape), dtype=ssm_dt)
            # Staging for write_kv index arrays, so steps allocate no device memory.
            self._table_dev = xp.full((R, self.max_blocks_per_request), -1, dtype=np.int32)
            self._offsets_dev = xp.zeros(R + 1, dtype=np.int32)
            self._positions_dev = xp.zeros(self.max_step_tokens, dtype=np.int32)
            if L:
                zeros_conv = xp.zeros((L, 1, *conv_shape), dtype=conv_dt)
                zeros_ssm = xp.zeros((L, 1, *ssm_shape), dtype=ssm_dt)
                self._zero_live = SlotSet(
                    [(zeros_conv[i], self.mamba_conv_states[i]) for i in range(L)]
                    + [(zeros_ssm[i], self.mamba_ssm_states[i]) for i in range(L)])
                self._zero_idx = xp.zeros(1, dtype=np.int32)
                self._live_idx = xp.zeros(1, dtype=np.int32)
        self.request_to_kv_block_ids = np.full((R, self.max_blocks_per_request), -1, np.int32)
        self.request_to_mamba_state_idx = np.full(R, -1, dtype=np.int32)
        self._free_rows = list(range(R - 1, -1, -1))         # pop() -> lowest row first
        self._free_live_slots = list(range(R))               # pop() -> highest slot first
        self._requests: dict[object, _Request] = {}
        self.mamba_slot_allocator = None
        if L and slots and enable_prefix_caching:
            self.mamba_slot_allocator = MambaSlotAllocator(
                self, slots, L, conv_shape, ssm_shape, conv_states_dtype, ssm_states_dtype)
        self.stats = PrefixCacheStats()

    # --- queries --------------------------------------------------------------------------------

    @property
    def prefix_caching_enabled(self) -> bool:
        return self.kv_block_allocator.enable_prefix_caching

    @property
    def prefix_cache_lru_clock(self) -> int:
        return self.kv_block_allocator.clock

    # --- commands -------------------------------------------------------------------------------

    def add_request(self, request_id, tokens, *, stream=None) -> StepPlan:
        """Admit a request and schedule its prompt (minus the cached prefix) for this step.

        Pins the matched KV blocks, allocates the rest, takes a row and a live Mamba slot,
        restores the deepest cached Mamba state (or zeroes the slot) and records which block
        boundaries to snapshot.

        Raises
        ------
        ValueError
            ``request_id`` is already active, ``tokens`` is empty, too long or not 1-D.
        TypeError
            ``tokens`` are not integers.
        CacheCapacityError
            No free row, or not enough KV blocks even after eviction. Nothing changes.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id: expected a new id, got active {request_id!r}")
        toks = self._tokens("tokens", tokens)
        if not len(toks) or len(toks) > self.max_sequence_length:
            raise ValueError(f"tokens: expected 1..{self.max_sequence_length} tokens, "
                             f"got {len(toks)}")
        kv, bs = self.kv_block_allocator, self.block_size_tokens
        hashes = compute_block_hashes(toks, bs) if self.prefix_caching_enabled else []
        matched, depths = self._match(hashes)
        skip = self._skip(len(toks), matched, depths)
        total_blocks = -(-len(toks) // bs)
        num_new = total_blocks - len(matched)
        if not self._free_rows:
            raise CacheCapacityError(f"requests: all {self.max_requests} rows are in use",
                                     required=1, available=0)
        # Pinning takes the matched blocks that eviction could reclaim out of the pool; a cached
        # matched block with an in-use descendant was never reclaimable, so it costs nothing.
        # (Ancestors of matched blocks are matched blocks, so nothing else becomes pinned.)
        pinned = int(np.count_nonzero(
            kv._evictable_mask()[np.asarray(matched, dtype=np.int64)]))
        if not kv.is_memory_available(num_new, pinned):
            available = kv.get_allocatable_count() - pinned
            raise CacheCapacityError(f"KV blocks: {num_new} required, {available} allocatable",
                                     required=num_new, available=available)
        kv.retain_memory_blocks(matched)
        new = kv.allocate_memory_blocks(num_new)
        if new is None:  # unreachable: availability was checked with the pins accounted for
            kv.release_memory_blocks(matched)
            raise CacheCapacityError("KV blocks: allocation failed after pinning",
                                     required=num_new, available=kv.get_allocatable_count())
        r = _Request(request_id, self._free_rows.pop(), self._free_live_slots.pop(), toks,
                     len(toks), list(matched) + new.tolist(), list(hashes))
        r.kv_cached = len(matched) * bs
        r.registered = len(matched)
        r.computed = skip
        self._install(r)
        restored = matched[skip // bs - 1] if skip and self.num_mamba_layers else -1
        self._init_live_state(r, restored, stream)
        r.stats = PrefixCacheStats(
            requests=1, prompt_tokens=len(toks), skipped_tokens=skip,
            kv_hit_blocks=len(matched), kv_miss_blocks=len(hashes) - len(matched),
            mamba_hits=int(restored >= 0))
        self.stats.add(r.stats)
        return self._schedule(r, len(toks), len(matched), skip, restored)

    def extend_request(self, request_id, tokens) -> StepPlan:
        """Append ``tokens`` (a sampled token, or a continuation) and schedule them.

        Raises
        ------
        ValueError
            Unknown request, the request already has a step scheduled, ``tokens`` is empty or
            not 1-D, or the sequence would exceed the block table.
        TypeError
            ``tokens`` are not integers, or ``request_id`` is not hashable.
        CacheCapacityError
            Not enough KV blocks even after eviction. Nothing changes.
        """
        r = self._get(request_id)
        if r.pending_end >= 0:
            raise ValueError(f"request_id: expected a request without a scheduled step, "
                             f"got {request_id!r}")
        toks = self._tokens("tokens", tokens)
        total = len(r.tokens) + len(toks)
        if not len(toks) or total > self.max_sequence_length:
            raise ValueError(f"tokens: expected 1..{self.max_sequence_length - len(r.tokens)} "
                             f"tokens, got {len(toks)}")
        kv = self.kv_block_allocator
        num_new = -(-total // self.block_size_tokens) - len(r.blocks)
        if not kv.is_memory_available(num_new):
            raise CacheCapacityError(f"KV blocks: {num_new} required, "
                                     f"{kv.get_allocatable_count()} allocatable",
                                     required=num_new, available=kv.get_allocatable_count())
        if num_new:
            r.blocks += kv.allocate_memory_blocks(num_new).tolist()
        r.tokens = r.tokens + toks
        self._install(r)
        return self._schedule(r, total, 0, 0, -1)

    def _init_live_state(self, r: _Request, restored: int, stream) -> None:
        if not self.num_mamba_layers:
            return
        if restored >= 0:
            self.mamba_slot_allocator.restore_to_live(r.row, restored, stream=stream)
            return
        with stream_scope(stream, self.device), self.device.scope():
            if self.xp is np:
                dst = np.asarray([r.live_slot], dtype=np.int32)
                ops.slot_copy(self._zero_live, np.zeros(1, np.int32), dst)
            else:
                self._live_idx.fill(r.live_slot)
                ops.slot_copy(self._zero_live, self._zero_idx, self._live_idx, stream=stream)

    def write_kv(self, request_ids, k, v, *, layer=None, stream=None) -> None:
        """Write the K/V rows of the scheduled tokens of ``request_ids`` into the paged pool.

        Parameters
        ----------
        request_ids : sequence
            Requests with a scheduled step; their tokens are concatenated in this order.
        k, v : arrays [total_tokens, H_i, D_i], or lists of them (one per layer)
            As in :meth:`PagedKVPool.write`. Rows of positions held by shared (matched) blocks
            are skipped: those blocks already hold them.
        layer : int, optional
            Write one attention layer (else every layer, one launch per head-dim group).

        Raises
        ------
        ValueError
            Unknown request, a request without a scheduled step, or too many tokens.
        """
        reqs = [self._get(rid) for rid in request_ids]
        if any(r.pending_end < 0 for r in reqs):
            raise ValueError("request_ids: expected requests with a scheduled step")
        lengths = [r.pending_end - r.computed for r in reqs]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        if offsets[-1] > self.max_step_tokens:
            raise ValueError(f"request_ids: expected at most {self.max_step_tokens} tokens, "
                             f"got {int(offsets[-1])}")
        positions = np.concatenate([np.arange(r.computed, r.pending_end) for r in reqs]
                                   + [np.zeros(0, np.int64)]).astype(np.int32)
        cached = np.concatenate([np.full(n, r.kv_cached) for r, n in zip(reqs, lengths,
                                                                          strict=True)]
                                + [np.zeros(0, np.int64)])
        positions[positions < cached] = -1
        table = self.request_to_kv_block_ids[[r.row for r in reqs]]
        n, b = len(positions), len(reqs)
        if self.xp is not np:
            with stream_scope(stream, self.device), self.device.scope():
                current = self.xp.cuda.get_current_stream()
                self._positions_dev[:n].set(positions, stream=current)
                self._offsets_dev[:b + 1].set(offsets, stream=current)
                self._table_dev[:b].set(np.ascontiguousarray(table), stream=current)
            positions, offsets, table = (self._positions_dev[:n], self._offsets_dev[:b + 1],
                                         self._table_dev[:b])
        self.kv_pool.write(k, v, block_table=table, layer=layer, seq_offsets=offsets,
                           batch=b, positions=positions, stream=stream)

    def commit_step(self, *, stream=None) -> dict:
        """Finish the step: mark scheduled tokens computed, register the hashes of blocks they
        completed, keep the step's Mamba boundary states, and advance the LRU clock.

        Call after the forward pass (KV written, live and scratch states final).

        Returns
        -------
        dict
            ``registered_blocks`` and ``stored_states`` of this step.
        """
        kv = self.kv_block_allocator
        ids, hashes, parents = self._finish_pending_steps()
        if ids:
            kv.register_kv_block_hashes(ids, hashes, parents)
        stored = 0
        if self.mamba_slot_allocator is not None:
            stored = self.mamba_slot_allocator.commit_intermediate_states(stream=stream)
            self.stats.stored_states += stored
        self.step()
        return {"registered_blocks": len(ids), "stored_states": stored}

    def step(self) -> int:
        """Advance the LRU clock by one step; returns the new clock."""
        return self.kv_block_allocator.advance_clock()

    def release_requests(self, request_ids) -> None:
        """Release requests: drop their block references (registered blocks stay cached under
        LRU), free their rows and live Mamba slots, and forget any scheduled step.

        Raises ``ValueError`` (nothing changes) when an id is not active.
        """
        reqs = [self._get(rid) for rid in dict.fromkeys(request_ids)]
        if not reqs:
            return
        self.kv_block_allocator.release_memory_blocks(
            np.concatenate([np.asarray(r.blocks, np.int64) for r in reqs]))
        rows = [r.row for r in reqs]
        self.request_to_kv_block_ids[rows] = -1
        self.request_to_mamba_state_idx[rows] = -1
        if self.mamba_slot_allocator is not None:
            self.mamba_slot_allocator._clear_intermediate_state(rows)
        for r in reqs:
            self._free_rows.append(r.row)
            self._free_live_slots.append(r.live_slot)
            del self._requests[r.request_id]

    def reset(self) -> None:
        """Drop every request, cached block and cached state; zero the counters."""
        for rid in list(self._requests):
            self.release_requests([rid])
        self.kv_block_allocator.reset()
        if self.mamba_slot_allocator is not None:
            self.mamba_slot_allocator.reset()
        self._free_rows = list(range(self.max_requests - 1, -1, -1))
        self._free_live_slots = list(range(self.max_requests))
        self.stats = PrefixCacheStats()
