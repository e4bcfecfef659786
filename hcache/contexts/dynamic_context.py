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

The context drives its collaborators: the request table
(:class:`~hcache.contexts.requests.RequestTable`: records, rows, live slots and the host block
tables), the live Mamba states (:class:`~hcache.contexts.live_states.LiveMambaStates`), the
step's KV writes (:class:`~hcache.contexts.step_kv_writer.StepKVWriter`) and the
prefix-match policy, functions of explicit inputs described and implemented in
:mod:`hcache.contexts.prefix_match`.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from .._checks import as_int, int_shape, token_list
from ..device import resolve_device, stream_handle
from ..dtypes import resolve_dtype, storage_dtype
from ..errors import CacheCapacityError
from .block_hashing import compute_block_hashes
from .kv_block_allocator import KVBlockAllocator
from .live_states import LiveMambaStates
from .mamba_slot_allocator import MambaSlotAllocator
from .paged_kv_pool import PagedKVPool
from .prefix_match import (
    finish_pending_steps,
    match_prefix,
    pending_blocks_overlap,
    restore_depth_tokens,
)
from .requests import PrefixCacheStats, RequestTable, StepPlan, _Chunk
from .step_kv_writer import StepKVWriter

__all__ = ["DynamicInferenceContext", "StepPlan", "PrefixCacheStats"]


class DynamicInferenceContext:
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
        self._live = LiveMambaStates(self.device, L, R, conv_shape, ssm_shape, conv_dt, ssm_dt)
        self._requests = RequestTable(R, self.max_blocks_per_request)
        self._kv_writer = StepKVWriter(self.kv_pool, R, self.max_blocks_per_request,
                                       self.max_step_tokens)
        self.mamba_slot_allocator = None
        if L and slots and enable_prefix_caching:
            self.mamba_slot_allocator = MambaSlotAllocator(
                self, slots, L, conv_shape, ssm_shape, conv_states_dtype, ssm_states_dtype)
        self.stats = PrefixCacheStats()

    # --- queries --------------------------------------------------------------------------------

    # The collaborators' arrays (see Attributes), written in place by the methods.
    mamba_conv_states = property(attrgetter("_live.conv_states"))
    mamba_ssm_states = property(attrgetter("_live.ssm_states"))
    request_to_kv_block_ids = property(attrgetter("_requests.request_to_kv_block_ids"))
    request_to_mamba_state_idx = property(attrgetter("_requests.request_to_mamba_state_idx"))

    @property
    def prefix_caching_enabled(self) -> bool:
        return self.kv_block_allocator.enable_prefix_caching

    @property
    def prefix_cache_lru_clock(self) -> int:
        return self.kv_block_allocator.clock

    @property
    def num_active_requests(self) -> int:
        return len(self._requests)

    @property
    def request_ids(self) -> list:
        return self._requests.ids

    def request_stats(self, request_id) -> PrefixCacheStats:
        """Counters of one live request (a copy)."""
        return PrefixCacheStats(**vars(self._requests.get(request_id).stats))

    def block_ids(self, request_id) -> np.ndarray:
        """The request's block-table row, ``int32 [num_blocks]`` (a copy)."""
        return np.asarray(self._requests.get(request_id).blocks, dtype=np.int32)

    def num_computed_tokens(self, request_id) -> int:
        return self._requests.get(request_id).computed

    def mamba_slot(self, request_id) -> int:
        """The request's live Mamba slot."""
        return self._requests.get(request_id).live_slot

    def snapshot_targets(self) -> list[tuple[object, int, int]]:
        """``(request_id, offset, scratch_index)`` of the boundary states the model must write
        this step: the state after ``offset`` computed tokens (from the plan's ``start``) goes
        to ``mamba_slot_allocator.intermediate_*_out[:, scratch_index]``."""
        if self.mamba_slot_allocator is None:
            return []
        by_row = {r.row: r.request_id for r in self._requests.records()}
        return [(by_row[row], off, idx)
                for row, off, idx in self.mamba_slot_allocator.intermediate_targets()]

    def shares_pending_blocks(self, tokens) -> bool:
        """Whether a complete block of ``tokens`` is being computed by a scheduled step and is
        not cached yet: a scheduler can defer such a request one step to hit the cache."""
        if not self.prefix_caching_enabled:
            return False
        wanted = set(compute_block_hashes(token_list("tokens", tokens), self.block_size_tokens))
        wanted.difference_update(self.kv_block_allocator.kv_hash_to_block_id)
        return pending_blocks_overlap(wanted, self._requests.records(), self.block_size_tokens)

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
            ``tokens`` are not integers, or ``stream`` is not a stream.
        CacheCapacityError
            No free row, or not enough KV blocks even after eviction. Nothing changes.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id: expected a new id, got active {request_id!r}")
        toks = token_list("tokens", tokens)
        if not len(toks) or len(toks) > self.max_sequence_length:
            raise ValueError(f"tokens: expected 1..{self.max_sequence_length} tokens, "
                             f"got {len(toks)}")
        stream_handle(stream)   # validated before anything changes
        kv, bs = self.kv_block_allocator, self.block_size_tokens
        hashes = compute_block_hashes(toks, bs) if self.prefix_caching_enabled else []
        mamba = self.mamba_slot_allocator
        matched, depths = match_prefix(hashes, kv.kv_hash_to_block_id,
                                       None if mamba is None else mamba.hash_to_block_id)
        skip = restore_depth_tokens(len(toks), matched, depths, bs,
                                    prefix_caching=self.prefix_caching_enabled,
                                    has_mamba=self.num_mamba_layers > 0)
        num_new = -(-len(toks) // bs) - len(matched)
        if not self._requests.has_free_row:
            raise CacheCapacityError(f"requests: all {self.max_requests} rows are in use",
                                     required=1, available=0)
        # Pinning takes the matched blocks that eviction could reclaim out of the pool; a cached
        # matched block with an in-use descendant was never reclaimable, so it costs nothing.
        # (Ancestors of matched blocks are matched blocks, so nothing else becomes pinned.)
        pinned = kv.get_evictable_block_count(matched)
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
        r = self._requests.new_record(request_id, toks, list(matched) + new.tolist(), list(hashes))
        r.kv_cached = len(matched) * bs
        r.registered = len(matched)
        r.computed = skip
        self._requests.install(r)
        restored = matched[skip // bs - 1] if skip and self.num_mamba_layers else -1
        if restored >= 0:
            self.mamba_slot_allocator.restore_to_live(r.row, restored, stream=stream)
        elif self.num_mamba_layers:
            self._live.zero(r.live_slot, stream=stream)
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
        r = self._requests.get(request_id)
        if r.pending_end >= 0:
            raise ValueError(f"request_id: expected a request without a scheduled step, "
                             f"got {request_id!r}")
        toks = token_list("tokens", tokens)
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
        self._requests.install(r)
        return self._schedule(r, total, 0, 0, -1)

    def _schedule(self, r, end, matched, skip, restored) -> StepPlan:
        """Schedule positions ``[r.computed, end)`` of ``r``: count them, ask the Mamba slot
        allocator for the step's snapshot boundaries, and return the plan."""
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
        reqs = [self._requests.get(rid) for rid in request_ids]
        if any(r.pending_end < 0 for r in reqs):
            raise ValueError("request_ids: expected requests with a scheduled step")
        self._kv_writer.write(reqs, self.request_to_kv_block_ids, k, v, layer=layer,
                              stream=stream)

    def commit_step(self, *, stream=None) -> dict:
        """Finish the step: mark scheduled tokens computed, register the hashes of blocks they
        completed, keep the step's Mamba boundary states, and advance the LRU clock.

        Call after the forward pass (KV written, live and scratch states final).

        Returns
        -------
        dict
            ``registered_blocks`` and ``stored_states`` of this step.

        Raises
        ------
        TypeError, ValueError
            ``stream`` is not a stream (nothing changes).
        """
        stream_handle(stream)   # validated before anything changes
        kv = self.kv_block_allocator
        ids, hashes, parents = finish_pending_steps(
            self._requests.in_row_order(), kv.kv_hash_to_block_id, self.block_size_tokens,
            prefix_caching=self.prefix_caching_enabled)
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
        reqs = [self._requests.get(rid) for rid in dict.fromkeys(request_ids)]
        if not reqs:
            return
        self.kv_block_allocator.release_memory_blocks(
            np.concatenate([np.asarray(r.blocks, np.int64) for r in reqs]))
        if self.mamba_slot_allocator is not None:
            self.mamba_slot_allocator._clear_intermediate_state([r.row for r in reqs])
        self._requests.release(reqs)

    def reset(self) -> None:
        """Drop every request, cached block and cached state; zero the counters."""
        for rid in self._requests.ids:
            self.release_requests([rid])
        self.kv_block_allocator.reset()
        if self.mamba_slot_allocator is not None:
            self.mamba_slot_allocator.reset()
        self._requests.reset()
        self.stats = PrefixCacheStats()
