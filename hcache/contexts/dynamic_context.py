"""The cache-owning part of a serving context for hybrid models with prefix caching (SPEC §6).

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

Prefix-match policy (the references' lessons applied):

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import ops
from ..configs import _int
from ..device import resolve_device, stream_scope
from ..dtypes import resolve_dtype, storage_dtype
from ..errors import CacheCapacityError
from ..layout import SlotSet
from .block_hashing import compute_block_hashes
from .kv_block_allocator import KVBlockAllocator
from .mamba_slot_allocator import MambaSlotAllocator, _shape
from .paged_kv_pool import PagedKVPool

__all__ = ["DynamicInferenceContext", "StepPlan", "PrefixCacheStats"]


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, per request or in total."""

    requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0      # tokens scheduled for computation (prefill and extensions)
    skipped_tokens: int = 0       # prompt tokens restored instead of computed
    kv_hit_blocks: int = 0        # complete prompt blocks found in the KV map
    kv_miss_blocks: int = 0       # complete prompt blocks not found
    mamba_hits: int = 0           # requests that restored a cached Mamba state
    stored_states: int = 0        # Mamba states committed to the cache (totals only)

    def add(self, other: PrefixCacheStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class StepPlan:
    """What the engine computes for one request in the current step.

    Attributes
    ----------
    request_id : hashable
    row : int
        Request row (index of ``request_to_kv_block_ids`` and the intermediate tracking).
    mamba_slot : int
        Live Mamba slot: the state before ``start`` is ``mamba_*_states[:, mamba_slot]``.
    start, end : int
        Positions ``[start, end)`` to compute; ``tokens`` are the request's tokens there.
    tokens : numpy.ndarray of int64 [end - start]
    block_ids : numpy.ndarray of int32 [ceil(end / block_size)]
        The request's blocks (position ``p`` lives in ``block_ids[p // block_size]``).
    skip_tokens : int
        Prompt tokens restored from the cache (first step only).
    num_matched_blocks : int
        Complete prompt blocks shared from the KV cache (first step only).
    restored_block : int
        KV block whose Mamba state was restored, or -1 (zeroed, or continued).
    """

    request_id: object
    row: int
    mamba_slot: int
    start: int
    end: int
    tokens: np.ndarray
    block_ids: np.ndarray
    skip_tokens: int = 0
    num_matched_blocks: int = 0
    restored_block: int = -1


@dataclass
class _Request:
    request_id: object
    row: int
    live_slot: int
    tokens: list
    prompt_length: int
    blocks: list
    hashes: list                  # hashes of the complete blocks of `tokens` computed so far
    computed: int = 0             # tokens whose KV and Mamba state are final
    kv_cached: int = 0            # positions below this live in shared (matched) blocks
    registered: int = 0           # leading blocks whose hashes are registered
    pending_end: int = -1         # end of the scheduled step, or -1
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    @property
    def finished_chunk_token_count(self) -> int:
        return self.computed


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
        self.block_size_tokens = _int("block_size_tokens", block_size_tokens, 1)
        self.max_requests = _int("max_requests", max_requests, 1)
        self.max_blocks_per_request = _int("max_blocks_per_request", max_blocks_per_request, 1)
        self.num_mamba_layers = _int("num_mamba_layers", num_mamba_layers)
        self.mamba_chunk_size = _int("mamba_chunk_size", mamba_chunk_size or block_size_tokens,
                                     1)
        if self.block_size_tokens % self.mamba_chunk_size:
            raise ValueError(f"mamba_chunk_size: expected a divisor of block_size_tokens "
                             f"{self.block_size_tokens}, got {self.mamba_chunk_size}")
        slots = _int("mamba_cache_slots", mamba_cache_slots)
        self.max_sequence_length = self.max_blocks_per_request * self.block_size_tokens
        self.max_step_tokens = _int("max_step_tokens", max_step_tokens or
                                    self.max_requests * self.max_sequence_length, 1)
        self.kv_pool = PagedKVPool(list(kv_layer_configs), num_blocks, self.block_size_tokens,
                                   kv_dtype, device=self.device)
        self.kv_block_allocator = KVBlockAllocator(
            num_blocks, enable_prefix_caching=enable_prefix_caching,
            eviction_policy=eviction_policy)
        conv_shape = _shape("conv_states_shape", conv_states_shape)
        ssm_shape = _shape("ssm_states_shape", ssm_states_shape)
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

    @property
    def num_active_requests(self) -> int:
        return len(self._requests)

    @property
    def request_ids(self) -> list:
        return list(self._requests)

    def request_stats(self, request_id) -> PrefixCacheStats:
        """Counters of one live request (a copy)."""
        return PrefixCacheStats(**vars(self._get(request_id).stats))

    def block_ids(self, request_id) -> np.ndarray:
        """The request's block-table row, ``int32 [num_blocks]`` (a copy)."""
        r = self._get(request_id)
        return np.asarray(r.blocks, dtype=np.int32)

    def num_computed_tokens(self, request_id) -> int:
        return self._get(request_id).computed

    def mamba_slot(self, request_id) -> int:
        """The request's live Mamba slot."""
        return self._get(request_id).live_slot

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

    def _get(self, request_id) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise KeyError(f"request_id: expected an active request, got {request_id!r}") \
                from None

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

    # --- commands -------------------------------------------------------------------------------

    def add_request(self, request_id, tokens, *, stream=None) -> StepPlan:
        """Admit a request and schedule its prompt (minus the cached prefix) for this step.

        Pins the matched KV blocks, allocates the rest, takes a row and a live Mamba slot,
        restores the deepest cached Mamba state (or zeroes the slot) and records which block
        boundaries to snapshot.

        Raises
        ------
        ValueError
            ``request_id`` is already active, ``tokens`` is empty or too long.
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
        refs = kv.block_ref_counts[np.asarray(matched, dtype=np.int64)]
        if not kv.is_memory_available(num_new, int(np.count_nonzero(refs == 0))):
            raise CacheCapacityError(f"KV blocks: {num_new} required, "
                                     f"{kv.get_allocatable_count()} allocatable",
                                     required=num_new, available=kv.get_allocatable_count())
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
        KeyError
            Unknown request.
        ValueError
            The request already has a step scheduled, ``tokens`` is empty, or the sequence
            would exceed the block table.
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

    def _tokens(self, name, tokens) -> list:
        arr = np.asarray(tokens)
        if arr.size == 0:
            return []
        if arr.ndim != 1 or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name}: expected a 1-D sequence of ints, got {arr.dtype} "
                            f"{arr.shape}")
        return arr.astype(np.int64).tolist()

    def _install(self, r: _Request) -> None:
        self.request_to_kv_block_ids[r.row] = -1
        self.request_to_kv_block_ids[r.row, :len(r.blocks)] = r.blocks
        self.request_to_mamba_state_idx[r.row] = r.live_slot
        self._requests[r.request_id] = r

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
        KeyError, ValueError
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

        Raises ``KeyError`` (nothing changes) when an id is not active.
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


@dataclass(frozen=True)
class _Chunk:
    """The request view :meth:`MambaSlotAllocator.compute_and_store_offsets` reads."""

    prompt_length: int
    finished_chunk_token_count: int
