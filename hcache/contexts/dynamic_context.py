"""The cache-owning part of a serving context for hybrid models, prefix caching (docs/design.md §6).

:class:`DynamicInferenceContext` owns the paged KV pool and its :class:`KVBlockAllocator`, the live
per-request Mamba states, the :class:`MambaSlotAllocator`, request rows and block tables, and the
prefix match. An engine drives it one step at a time::

    plan = ctx.add_request(rid, prompt)        # or ctx.extend_request(rid, new_tokens)
    plans = ctx.extend_requests(rids, tokens)  # a decode batch: one token each, one call
    targets = ctx.snapshot_targets()           # boundary states the model must emit
    # forward: for each plan compute plan.tokens (positions plan.start..plan.end-1) from the
    # live Mamba state mamba_*_states[:, plan.mamba_slot]; write K/V with ctx.write_kv; write
    # the state after `offset` computed tokens into intermediate_*_out[:, scratch_index]
    ctx.commit_step()                          # register blocks, keep Mamba snapshots, tick
    ctx.release_requests([rid])

Collaborators: the request table (:class:`~.requests.RequestTable`: per-row tokens, counters,
block hashes, live slots, host block tables; a step is vectorised over rows), the scheduler
(:class:`~.step_scheduler.StepScheduler`, with the prefix-match policy of :mod:`~.prefix_match`),
the live Mamba states (:class:`~.live_states.LiveMambaStates`), the step's KV writes
(:class:`~.step_kv_writer.StepKVWriter`), with ``num_local_blocks`` the sliding-window layers'
block space (:class:`~.window_blocks.WindowBlocks`), the invariants of the whole
(:mod:`~.context_invariants`). Copies: see :mod:`hcache._copying`.
"""

from __future__ import annotations

import numpy as np

from .._checks import as_int
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..config.layers import kv_layer_list
from ..config.sizing import context_states_nbytes
from ..dtypes import resolve_dtype, storage_dtype
from ..runtime.device import resolve_device, settle, stream_handle
from .block_hashing import compute_block_hashes
from .block_registration import BlockRegistration
from .context_configs import ContextConstructors
from .context_invariants import broken_context_invariants
from .context_views import ContextViews
from .draft_commit import commit_draft
from .kv_block_allocator import KVBlockAllocator
from .live_states import LiveMambaStates
from .mamba_slot_allocator import MambaSlotAllocator
from .mamba_state_copies import state_shapes
from .paged_kv_pool import PagedKVPool
from .requests import RequestTable
from .step_kv_writer import StepKVWriter
from .step_plans import BatchStepPlan, PrefixCacheStats, StepPlan
from .step_scheduler import StepScheduler
from .token_batches import batch_tokens, id_list, token_array
from .window_blocks import WindowBlocks

__all__ = ["DynamicInferenceContext", "StepPlan", "BatchStepPlan", "PrefixCacheStats"]


class DynamicInferenceContext(ContextConstructors, ContextViews):
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
    conv_states_shape, ssm_states_shape : tuple of int or None
        Per-request state shapes (ignored without Mamba layers); ``None``: no such state.
    kv_dtype, conv_states_dtype, ssm_states_dtype : str or dtype
    mamba_cache_slots : int
        Durable Mamba cache slots; 0 disables state caching (KV blocks are still shared).
    mamba_chunk_size : int, optional
        Granularity of mid-prefill states; divides ``block_size_tokens`` (the default).
    enable_prefix_caching : bool
    eviction_policy : {"lru", "ref_zero"}
    max_step_tokens : int, optional
        Most tokens one :meth:`write_kv` call may carry (default: every row's full length).
    device : None, "cpu", "cuda" or "cuda:N"
    num_local_blocks : int, optional
        Blocks of the sliding-window layers' own space (docs/design.md §6.7); default: none.
    registration_budget : int or None
        Completed blocks a :meth:`commit_step` hashes, or registers (or 1/8 of the waiting ones
        if more); the rest wait, in order, and whatever depends on them catches up first; a
        step whose blocks, with the waiting ones, are at most a quarter of it registers them at
        once (docs/design.md §6.8). None: all at once.

    Attributes
    ----------
    kv_pool : PagedKVPool
    kv_block_allocator : KVBlockAllocator
    window_blocks : WindowBlocks or None (the local block space: ``allocator``, ``table``)
    mamba_slot_allocator : MambaSlotAllocator or None
    mamba_conv_states, mamba_ssm_states : arrays [num_mamba_layers, max_requests, *shape]
        Live per-request states (views for the model); ``None`` for a state with shape None.
    request_to_kv_block_ids : int32 [max_requests, max_blocks_per_request]
        Host block table; -1 = none.
    request_to_mamba_state_idx : int32 [max_requests]
        Host map request row -> live Mamba slot; -1 = none.
    stats : PrefixCacheStats
        Totals over every request ever added.
    """
    __copy__, __deepcopy__, __reduce_ex__ = refuse_copy, refuse_deepcopy, refuse_pickle
    commit_draft = commit_draft   # speculative decoding (draft_commit.py, design §6.9)

    def __init__(self, *, kv_layer_configs, num_blocks, block_size_tokens, max_requests,
                 max_blocks_per_request, num_mamba_layers=0, conv_states_shape=(1,),
                 ssm_states_shape=(1,), kv_dtype="float16", conv_states_dtype="float16",
                 ssm_states_dtype="float32", mamba_cache_slots=0, mamba_chunk_size=None,
                 enable_prefix_caching=True, eviction_policy="lru", max_step_tokens=None,
                 device=None, num_local_blocks=None, registration_budget=128):
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
        budget = None if registration_budget is None \
            else as_int("registration_budget", registration_budget, 1)
        self.max_step_tokens = as_int("max_step_tokens", self.max_requests
                                    * self.max_sequence_length if max_step_tokens is None
                                    else max_step_tokens, 1)
        self.kv_block_allocator = KVBlockAllocator(
            num_blocks, enable_prefix_caching=enable_prefix_caching,
            eviction_policy=eviction_policy)
        caching = self.kv_block_allocator.enable_prefix_caching
        conv_shape, ssm_shape = state_shapes(conv_states_shape, ssm_states_shape)
        L, R = self.num_mamba_layers, self.max_requests
        configs = kv_layer_list("kv_layer_configs", kv_layer_configs)
        conv_dt = storage_dtype(resolve_dtype(conv_states_dtype, "conv_states_dtype"), xp)
        ssm_dt = storage_dtype(resolve_dtype(ssm_states_dtype, "ssm_states_dtype"), xp)
        local = num_local_blocks is not None and any(lc.sliding_window for lc in configs)
        pool = self.kv_pool = PagedKVPool(
            configs, num_blocks, self.block_size_tokens, resolve_dtype(kv_dtype, "kv_dtype"),
            device=self.device, num_local_blocks=num_local_blocks, extra_nbytes=(
                context_states_nbytes(self, slots if caching else 0, conv_shape, ssm_shape,
                                      conv_dt, ssm_dt, local_tables=local)))   # checked together
        blocks = self.window_blocks = WindowBlocks.for_pool(pool, R, self.max_blocks_per_request,
                                                            self.kv_block_allocator)
        self._live = LiveMambaStates(self.device, L, R, conv_shape, ssm_shape, conv_dt, ssm_dt)
        self._requests = RequestTable(R, self.max_blocks_per_request, self.block_size_tokens,
                                      hashing=self.kv_block_allocator.enable_prefix_caching)
        self._kv_writer = StepKVWriter(self.kv_pool, R, self.max_blocks_per_request,
                                       self.max_step_tokens, self.window_blocks)
        self.mamba_slot_allocator = MambaSlotAllocator(
            self, slots, L, conv_shape, ssm_shape, conv_states_dtype, ssm_states_dtype) \
            if L and slots and caching else None
        self._registration = BlockRegistration(self._requests, self.kv_block_allocator, blocks,
                                               self.mamba_slot_allocator, budget, self)
        self._scheduler = StepScheduler(self._requests, self.kv_block_allocator,
                                        self.mamba_slot_allocator, self._live, L, blocks,
                                        self._registration)
        self.stats = PrefixCacheStats()
        settle(self.device)   # the step tables and live states are ready for any stream

    # --- queries --------------------------------------------------------------------------------

    def request_stats(self, request_id) -> PrefixCacheStats:
        """Counters of one live request (a copy)."""
        return self._requests.stats(self._requests.row(request_id))

    def block_ids(self, request_id) -> np.ndarray:
        """The request's block-table row, ``int32 [num_blocks]`` (a copy)."""
        return self._requests.blocks(self._requests.row(request_id))

    def local_block_ids(self, request_id) -> np.ndarray:
        """The request's local block-table row (int32, -1: out of the window; a copy)."""
        row = self._requests.row(request_id)
        return self.window_blocks.row_blocks(row) if self.window_blocks else np.zeros(0, np.int32)

    def num_computed_tokens(self, request_id) -> int:
        """Tokens of the request whose K/V and Mamba states are final (committed steps)."""
        return int(self._requests.computed[self._requests.row(request_id)])

    def mamba_slot(self, request_id) -> int:
        """The request's live Mamba slot."""
        return int(self.request_to_mamba_state_idx[self._requests.row(request_id)])

    def snapshot_targets(self) -> list[tuple[object, int, int]]:
        """``(request_id, offset, scratch_index)``: the state after ``offset`` computed tokens
        (from the plan's ``start``) goes to ``intermediate_*_out[:, scratch_index]``."""
        if self.mamba_slot_allocator is None:
            return []
        id_of = self._requests.id_of
        return [(id_of(row), off, idx)
                for row, off, idx in self.mamba_slot_allocator.intermediate_targets()]

    def shares_pending_blocks(self, tokens, *, salt=None, extra_keys=None) -> bool:
        """Whether a block of ``tokens`` (hashed as :meth:`add_request` would) is computed by a
        scheduled step, not cached yet: a scheduler can defer it one step to hit the cache."""
        return self.prefix_caching_enabled and self._registration.computing_any(
            compute_block_hashes(tokens, self.block_size_tokens, salt=salt, extra_keys=extra_keys))

    # --- commands -------------------------------------------------------------------------------

    def add_request(self, request_id, tokens, *, stream=None, salt=None, extra_keys=None):
        """Admit a request and schedule its prompt (minus the cached prefix) for this step.

        Pins the matched KV blocks, allocates the rest, takes a row and a live Mamba slot, restores
        the deepest cached Mamba state (or zeroes the slot), records which block boundaries to
        snapshot; returns the ``StepPlan``. ``salt`` and ``extra_keys`` isolate it (design §6.1).

        Raises
        ------
        ValueError
            ``request_id`` is already active, ``tokens`` is empty, too long or not 1-D.
        TypeError
            ``request_id`` is not hashable, ``tokens`` are not integers, ``stream`` is not
            a stream, ``salt`` or ``extra_keys`` are of the wrong types.
        IndexError
            ``extra_keys`` names a block the prompt does not have.
        CacheCapacityError
            No free row, or not enough KV blocks even after eviction. Nothing changes.
        """
        try:
            active = request_id in self._requests
        except TypeError:
            raise TypeError(f"request_id: expected a hashable id, "
                            f"got {type(request_id).__name__}") from None
        if active:
            raise ValueError(f"request_id: expected a new id, got active {request_id!r}")
        toks = token_array("tokens", tokens)
        n = len(toks)
        if not n or n > self.max_sequence_length:
            raise ValueError(f"tokens: expected 1..{self.max_sequence_length} tokens, got {n}")
        if stream is not None:
            stream_handle(stream)   # validated before anything changes
        plan, stats = self._scheduler.admit(request_id, toks, stream=stream, salt=salt,
                                            extra_keys=extra_keys)
        self.stats.add(stats)
        return plan

    def extend_request(self, request_id, tokens) -> StepPlan:
        """Append ``tokens`` (a sampled token, or a continuation) and schedule them:
        :meth:`extend_requests` of one request, which raises alike (naming ``request_id`` and
        ``tokens``; ``tokens`` must be 1-D). Nothing changes on a refusal."""
        row = self._requests.row(request_id)
        toks = token_array("tokens", tokens)
        counts = None if len(toks) == 1 else np.array([len(toks)])   # None: one token each
        plan = self._scheduler.extend([request_id], np.array([row]), toks, counts, single=True)
        self.stats.computed_tokens += len(toks)
        return plan[0]

    def extend_requests(self, request_ids, tokens) -> BatchStepPlan:
        """Append new tokens to every request of ``request_ids`` and schedule them, in one
        vectorised call: per request, :meth:`extend_request`. Everything is checked before
        anything changes; new blocks come in the order of ``request_ids`` (with eviction,
        request by request, as a loop of :meth:`extend_request` would).

        Parameters
        ----------
        request_ids : sequence of hashable [n]
            Distinct active requests without a scheduled step.
        tokens : int array [n] or [n, k], sequence of n ints, or sequence of n int sequences
            One token per request (a decode step), ``k`` per request, or a sequence each.

        Returns
        -------
        BatchStepPlan
            The batch's positions, tokens and blocks as arrays; ``plan[i]`` is request ``i``'s
            :class:`StepPlan`.

        Raises
        ------
        TypeError
            An id is not hashable, or ``tokens`` are not integers.
        ValueError
            An unknown or repeated id, a step already scheduled, no token, ``tokens`` of the
            wrong shape, a sequence past the block table (``request_ids[i]`` / ``tokens[i]``).
        CacheCapacityError
            Not enough KV blocks for the batch even after eviction.
        """
        rows = self._requests.rows(request_ids)
        flat, counts = batch_tokens("tokens", tokens, len(rows))
        plan = self._scheduler.extend(id_list("request_ids", request_ids), rows, flat, counts,
                                      single=False)
        self.stats.computed_tokens += len(flat)
        return plan

    def write_kv(self, request_ids, k, v=None, *, layer=None, k_scale=None, v_scale=None,
                 stream=None) -> None:
        """Write the K/V rows of the scheduled tokens of ``request_ids`` into the paged pool.

        Parameters
        ----------
        request_ids : sequence
            Distinct requests with a scheduled step, tokens concatenated in this order.
        k, v : arrays [total_tokens, H_i, D_i], or lists of them (one per layer)
            As in :meth:`PagedKVPool.write_kv` (a latent layer's ``v`` is None); rows of
            positions in shared blocks are skipped.
        layer, k_scale, v_scale : optional
            As in :meth:`PagedKVPool.write_kv` (an FP8 pool quantizes float rows with scales).

        Raises ``ValueError`` / ``TypeError``: unknown request, no scheduled step, too many
        tokens, a layer's ``k`` / ``v`` without exactly the scheduled tokens' rows (checked for
        every layer before anything is staged), else as the pool's.
        """
        rows = self._requests.rows(request_ids)
        self._kv_writer.write(self._requests, rows, k, v, layer=layer, k_scale=k_scale,
                             v_scale=v_scale, stream=stream)

    def commit_step(self, *, stream=None) -> dict:
        """Finish the step: mark scheduled tokens computed, queue the blocks they completed and
        register at most ``registration_budget`` waiting ones (local blocks: all, then release
        those that left the window), keep the step's Mamba boundary states, advance the LRU
        clock. Call after the forward pass (KV written, live and scratch states final); the
        cost is flat in the sequence lengths.

        Returns
        -------
        dict
            ``registered_blocks`` and ``stored_states`` (made reachable) of this step.

        Raises
        ------
        TypeError, ValueError
            ``stream`` is not a stream (nothing changes).
        """
        if stream is not None:
            stream_handle(stream)   # validated before anything changes
        before = self.stats.stored_states   # a backlog block's state counts once reachable
        registered = self._registration.commit(*self._requests.complete_steps())
        if self.mamba_slot_allocator is not None:
            self.stats.stored_states += self.mamba_slot_allocator.commit_intermediate_states(
                stream=stream)
        self.step()
        return {"registered_blocks": registered, "stored_states": self.stats.stored_states - before}

    def register_completed_blocks(self) -> int:
        """Hash and register every computed complete block still waiting (see
        ``registration_budget``), so the hash maps are current; returns how many."""
        return self._registration.flush()

    def step(self) -> int:
        """Advance the LRU clock by one step (both block spaces'); returns the new clock."""
        if self.window_blocks is not None:
            self.window_blocks.allocator.advance_clock()
        return self.kv_block_allocator.advance_clock()

    def release_requests(self, request_ids) -> None:
        """Release requests: drop their block references (registered blocks stay cached under
        LRU), free their rows and live Mamba slots, and forget any scheduled step. Raises
        ``ValueError`` (nothing changes) when an id is not active, repeats or is being filled
        by a transfer (``hcache.transfer.ContextTransferEngine``: cancel its pull)."""
        requests = self._requests
        rows = requests.rows(request_ids).tolist()
        if not rows:
            return
        parked = [row for row in rows if requests.parked[row]]   # a transfer's destination
        if parked:
            raise ValueError(f"request_ids: expected no request a transfer fills (cancel its "
                             f"pull), got {requests.id_of(parked[0])!r}")
        # Their blocks stay cached, registered first; a release that deregisters catches up all
        # (a block duplicating one it drops stays private, as registered at once: §6.8).
        self._registration.flush(rows if self.kv_block_allocator.caches_released_blocks else None)
        if len(rows) == 1:      # a request's blocks are distinct and held: nothing to check
            self.kv_block_allocator._release(requests.blocks(rows[0]).astype(np.int64))
        else:
            self.kv_block_allocator.release_memory_blocks(
                np.concatenate([requests.blocks(row) for row in rows]))
        if self.window_blocks is not None:
            self.window_blocks.release(rows)
        if self.mamba_slot_allocator is not None:
            self.mamba_slot_allocator._clear_intermediate_state(rows)
        requests.release(rows)

    def reset(self) -> None:
        """Drop every request, cached block and cached state; zero the counters."""
        self.release_requests(self._requests.ids)
        for owner in (self.kv_block_allocator, self.window_blocks, self.mamba_slot_allocator):
            if owner is not None:
                owner.reset()
        self._requests.reset()
        self._registration.reset()
        self.stats = PrefixCacheStats()

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` listing every broken invariant of the collaborators and of their
        agreement (:func:`~.context_invariants.broken_context_invariants`; rehashes: for tests)."""
        problems = broken_context_invariants(self._requests, self.kv_block_allocator,
                                             self.window_blocks, self.mamba_slot_allocator,
                                             self._registration)
        if problems:
            raise RuntimeError("DynamicInferenceContext invariants broken: " + "; ".join(problems))
