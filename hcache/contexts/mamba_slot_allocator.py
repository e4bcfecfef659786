"""Durable Mamba states by KV block id: the Mamba half of hybrid prefix caching (docs/design.md §6).

A cached state describes the recurrent (SSM) and conv state of every Mamba layer *after* the last
token of one KV block, so a request whose prompt matches that block's chained hash can restore it
and skip the prefix. Three kinds of state memory are involved:

- live per-request states, owned by the context: ``[num_mamba_layers, max_requests, *shape]``;
- durable cache slots, owned here: ``conv_states`` / ``ssm_states``
  ``[num_mamba_layers, max_slots, *shape]``;
- per-step scratch ``intermediate_conv_out`` / ``intermediate_ssm_out``, which the model fills
  with mid-prefill states that ``commit_intermediate_states`` then keeps.

:class:`MambaSlotAllocator` owns four collaborators and keeps them consistent: the slots
(:class:`~hcache.contexts.mamba_slot_pool.MambaSlotPool`), the Mamba hash map, a subset of the
slots' blocks (:class:`~hcache.contexts.mamba_hash_map.MambaHashMap`), the intermediate states
(:class:`~hcache.contexts.mamba_intermediate.IntermediateStates`) and the cache arrays with
every copy into or out of them (:class:`~hcache.contexts.mamba_state_copies.MambaStateCopies`,
one :func:`hcache.ops.slot_copy` launch per batch); each states and checks its own invariants.
KV deregistration cascades here through the observer that the constructor subscribes, so a
recycled block id never carries a stale state. Host bookkeeping is NumPy.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from .._checks import as_int, check_index, host_ints, index_array
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..dtypes import resolve_dtype, storage_dtype
from ..runtime.device import Device, array_device, array_module_of, settle, stream_handle
from .mamba_commit import commit_general, commit_lean
from .mamba_hash_map import MambaHashMap
from .mamba_intermediate import MAX_INTERMEDIATE_OFFSETS_PER_REQUEST, IntermediateStates
from .mamba_slot_pool import MambaSlotCapacityError, MambaSlotPool
from .mamba_state_copies import MambaStateCopies, check_live_states, context_parts, state_shapes

__all__ = ["MAX_INTERMEDIATE_OFFSETS_PER_REQUEST", "MambaSlotCapacityError", "MambaSlotAllocator"]


class MambaSlotAllocator:
    """Manages the Mamba state cache for prefix caching in hybrid models.

    Parameters
    ----------
    context : object
        Reads ``kv_block_allocator``, ``mamba_conv_states`` / ``mamba_ssm_states`` (live states
        ``[num_mamba_layers, max_requests, *shape]``, C-contiguous; this allocator's arrays
        follow their array module and device), ``request_to_mamba_state_idx`` (host int
        ``[max_requests]``, request row -> live slot), and for the intermediate methods
        ``block_size_tokens``, ``mamba_chunk_size`` and ``request_to_kv_block_ids`` (host int
        ``[max_requests, max_blocks_per_request]``).
    max_slots : int
        Durable cache slots (>= 1).
    num_mamba_layers : int
    conv_states_shape, ssm_states_shape : tuple of int or None (no such state, no arrays)
    conv_states_dtype, ssm_states_dtype : str or dtype
        One of the docs/design.md §2 dtypes; must match the live states' storage dtype.

    Attributes
    ----------
    conv_states, ssm_states, block_to_slot, slot_to_block, free_slots, free_count,
    hash_to_block_id, intermediate_conv_out, intermediate_ssm_out
        The cache slots, the slot pool's maps (:class:`MambaSlotPool`), the Mamba hash map and
        the scratch states: see each property.
    deferred_blocks, private_deferred : bool [num_blocks] and callable, or None
        A deferring context's backlog and its blocks to stay private (docs/design.md §6.8).
    lean_commit : bool
        Whether :meth:`commit_intermediate_states` may take its plain-Python path (True; False
        runs the general one, the oracle, every time).

    Raises
    ------
    TypeError, ValueError
        An argument or a live state array does not fit the description above.
    """

    __copy__, __deepcopy__, __reduce_ex__ = refuse_copy, refuse_deepcopy, refuse_pickle

    def __init__(self, context, max_slots, num_mamba_layers, conv_states_shape,
                 ssm_states_shape, conv_states_dtype, ssm_states_dtype):
        self.context = context
        self.max_slots = as_int("max_slots", max_slots, 1)
        self.num_mamba_layers = as_int("num_mamba_layers", num_mamba_layers, 1)
        self.conv_states_shape, self.ssm_states_shape = state_shapes(conv_states_shape,
                                                                     ssm_states_shape)
        kv, live_conv, live_ssm = context_parts(context)
        self.num_blocks = int(len(kv.block_ref_counts))
        live = live_conv if self.conv_states_shape is not None else live_ssm
        xp = array_module_of(live)
        conv_dt = storage_dtype(resolve_dtype(conv_states_dtype, "conv_states_dtype"), xp)
        ssm_dt = storage_dtype(resolve_dtype(ssm_states_dtype, "ssm_states_dtype"), xp)
        L = self.num_mamba_layers
        rows = check_live_states("context.mamba_conv_states", live_conv, xp, L,
                                 self.conv_states_shape, conv_dt, None)
        self.max_requests = check_live_states("context.mamba_ssm_states", live_ssm, xp, L,
                                              self.ssm_states_shape, ssm_dt, rows)
        self.xp = xp
        self.device = Device("cuda", array_device(live)) if xp is not np else Device("cpu")
        self.deferred_blocks = self.private_deferred = None
        self.lean_commit = True
        self._intermediate = inter = IntermediateStates(
            self.device, self.num_mamba_layers, self.max_requests, self.conv_states_shape,
            self.ssm_states_shape, conv_dt, ssm_dt)
        self.max_intermediate_count = inter.max_count
        self._pool = MambaSlotPool(self.num_blocks, self.max_slots)
        self._hashes = MambaHashMap(kv.kv_hash_to_block_id, self._pool.owned, self.num_blocks)
        self._copies = MambaStateCopies(context, self._pool, self.device, inter.conv_out,
                                        inter.ssm_out, conv_dt, ssm_dt)
        kv.add_blocks_deregistered_observer(self._on_kv_deregistered)
        kv.add_released_observer(self._pool.released)   # both for the KV allocator's lifetime
        settle(self.device)   # the new slots are ready for any stream

    # --- queries --------------------------------------------------------------------------------

    # Views of the collaborators' state (arrays are written in place by the methods).
    conv_states = property(attrgetter("_copies.conv_states"),
                           doc="Cached conv states [num_mamba_layers, max_slots, *shape] or None.")
    ssm_states = property(attrgetter("_copies.ssm_states"), doc="Cached SSM states, alike.")
    block_to_slot = property(attrgetter("_pool.block_to_slot"), doc="Block -> slot, -1: none.")
    slot_to_block = property(attrgetter("_pool.slot_to_block"), doc="Slot -> block, -1: free.")
    free_slots = property(attrgetter("_pool.free_slots"), doc="Free stack: [:free_count].")
    hash_to_block_id = property(attrgetter("_hashes.hash_to_block_id"), doc="Hash -> block.")
    intermediate_conv_out = property(attrgetter("_intermediate.conv_out"), doc="Scratch conv "
                                     "states the model fills, [num_mamba_layers, n, *shape].")
    intermediate_ssm_out = property(attrgetter("_intermediate.ssm_out"),
                                    doc="Scratch SSM states, as intermediate_conv_out.")
    _intermediate_block_ids = property(attrgetter("_intermediate.block_ids"))
    _eos_cache_block_id = property(attrgetter("_intermediate.eos_block_ids"))

    @property
    def _block_hash(self) -> np.ndarray:
        """``int64 [num_blocks]``: the Mamba-map hash of each block, -1 = none (derived)."""
        return self._hashes.block_hashes(self.num_blocks)

    free_count = property(attrgetter("_pool.free_count"),
                          lambda self, value: setattr(self._pool, "free_count", value),
                          doc="Free cache slots (the top of ``free_slots``).")

    _kv = property(attrgetter("context.kv_block_allocator"))

    num_used_slots = property(lambda self: self.max_slots - self.free_count,
                              doc="Slots owned by a block.")

    @property
    def num_cached_states(self) -> int:
        """Blocks whose state is reachable through the Mamba hash map."""
        return len(self._hashes)

    @property
    def evictable_count(self) -> int:
        """Owned slots whose KV block has ref count 0."""
        return int(len(self._pool.evictable_blocks(self._kv.block_ref_counts)))

    def get_slot(self, block_id) -> int:
        """The cache slot of KV block ``block_id``, or -1. Raises ``IndexError`` out of range."""
        return int(self.block_to_slot[check_index("block_id", block_id, self.num_blocks)])

    def has_state(self, block_id) -> bool:
        """Whether KV block ``block_id`` owns a cache slot (its state has been stored)."""
        return self.get_slot(block_id) >= 0

    def can_allocate_slots(self, block_ids) -> bool:
        """Whether :meth:`allocate_slots_batch` would succeed for ``block_ids``."""
        ids = index_array("block_ids", block_ids, self.num_blocks)
        new, available = self._pool.demand(ids, self._kv.block_ref_counts, self._timestamps())
        return len(new) <= available

    # --- slots ----------------------------------------------------------------------------------

    def allocate_slots_batch(self, block_ids) -> list[int]:
        """Give every block of ``block_ids`` (KV block ids in ``[0, num_blocks)``) a cache
        slot, evicting LRU slots if necessary; returns the slot of each entry. Owners keep
        theirs; a repeated id gets one slot for every occurrence (Megatron-LM's contract);
        protection and capacity count distinct ids. All or nothing.

        Raises
        ------
        IndexError
            A block id is out of range.
        MambaSlotCapacityError
            Free plus evictable slots (other than those of ``block_ids``) are too few.
        """
        ids = index_array("block_ids", block_ids, self.num_blocks)
        slots, victims = self._pool.allocate(ids, self._kv.block_ref_counts, self._timestamps())
        self._hashes.drop_blocks(victims, self._kv.block_hashes)
        return slots.tolist()

    def _evict_lru_slots_batch(self, num_needed, *, exclude=None) -> list[int]:
        """Take (not free: the caller owns them) the slots of the ``num_needed`` LRU evictable
        blocks (KV ref count 0, oldest KV timestamp, then lowest id, none of ``exclude``) and drop
        their Mamba hashes. :class:`MambaSlotCapacityError` (nothing changes) if too few."""
        n, ids = as_int("num_needed", num_needed), np.arange(self.num_blocks)
        if n == 0:
            return []
        excluded = None if exclude is None else ids[np.isin(ids, exclude)]  # no id but blocks'
        slots, victims = self._pool.evict(n, self._kv.block_ref_counts, self._timestamps(),
                                          exclude=excluded)
        self._hashes.drop_blocks(victims, self._kv.block_hashes)
        return slots.tolist()

    def _timestamps(self):
        return getattr(self._kv, "block_timestamps", None)

    def invalidate_block(self, block_id) -> None:
        """Free the slot of ``block_id`` (if any), drop its Mamba hash (``IndexError``: range)."""
        self._invalidate_blocks_batch([check_index("block_id", block_id, self.num_blocks)])

    def _invalidate_blocks_batch(self, block_ids_list) -> None:
        """Vectorised :meth:`invalidate_block`; blocks without a slot are skipped."""
        ids = np.unique(index_array("block_ids_list", block_ids_list, self.num_blocks))
        if not len(ids):
            return
        self._hashes.drop_blocks(ids, self._kv.block_hashes)
        self._pool.release(ids)

    def on_kv_blocks_deregistered(self, block_ids_list, hashes_to_delete) -> None:
        """Observer of the KV allocator: deregistered blocks ``block_ids_list`` (ids reusable at
        once) lose their slots and Mamba hashes, and so does any Mamba-map entry under one of
        ``hashes_to_delete`` (their former hashes; a set, as Megatron-LM passes, or a list)."""
        ids = index_array("block_ids_list", block_ids_list, self.num_blocks)
        hashes = host_ints("hashes_to_delete", list(hashes_to_delete)   # a set: order-free
                           if isinstance(hashes_to_delete, (set, frozenset)) else hashes_to_delete)
        self._invalidate_blocks_batch(ids)
        self._hashes.drop_hashes(hashes.tolist())

    def _on_kv_deregistered(self, block_ids: list, hashes: set) -> None:
        """The subscribed observer: :meth:`on_kv_blocks_deregistered` of unregistered ids
        (their slots freed by :meth:`MambaSlotPool.release_listed`)."""
        self._pool.release_listed(block_ids)
        self._hashes.drop_hashes(hashes)

    def register_block_hashes_batch(self, block_ids, hashes) -> None:
        """Make the states of ``block_ids`` reachable under their KV ``hashes`` (entries with
        ``hash <= 0`` are skipped; see :meth:`MambaHashMap.register`). Lists of registrable
        Python ints take a lean path (:meth:`MambaHashMap.register_lists`).

        Raises
        ------
        IndexError
            A block id is out of range.
        TypeError
            An id or hash is not an integer.
        ValueError
            Lengths differ, a block owns no slot, or a hash is not the KV allocator's hash of
            that block (the Mamba map must stay a subset of the KV map). Nothing changes.
        """
        if not self._hashes.register_lists(block_ids, hashes):
            ids = index_array("block_ids", host_ints("block_ids", block_ids), self.num_blocks)
            self._hashes.register(ids, host_ints("hashes", hashes))

    # --- state copies ---------------------------------------------------------------------------

    def store_from_tensors(self, block_id, layer_idx, ssm_state, conv_state, *,
                           stream=None) -> None:
        """Write one Mamba layer's states into the slot of ``block_id`` (mainly for tests):
        per-slot shapes and storage dtypes (another module's array is converted). Raises
        ``IndexError`` (block or layer out of range), ``ValueError`` (no slot, bad shape/dtype)."""
        self._copies.write_layer(block_id, self.get_slot(block_id), layer_idx, ssm_state,
                                 conv_state, stream=stream)

    def store_from_live_batch(self, slots, request_indices, *, stream=None) -> None:
        """Copy every layer's live state of each request into the paired cache slot (one launch).
        Raises ``IndexError`` (slot or row out of range) or ``ValueError`` (lengths differ, a
        slot repeats or is free, a request has no live slot); nothing is copied then."""
        self._copies.store_from_live(slots, request_indices, stream=stream)

    def restore_to_live(self, request_idx, block_id, *, stream=None) -> bool:
        """Copy every layer's cached state of ``block_id`` into the request's live slot; False
        (nothing copied) when the block owns no slot. Raises ``IndexError`` (row or block out
        of range) or ``ValueError`` (the request has no live slot)."""
        row, bid = (check_index("request_idx", request_idx, self.max_requests),
                    check_index("block_id", block_id, self.num_blocks))
        return self._copies.restore_one(row, bid, stream=stream, rows_name="request_idx")

    def restore_to_live_batch(self, request_indices, block_ids, *, stream=None) -> list[bool]:
        """Batched :meth:`restore_to_live` (distinct live slots, one launch); per entry, done?"""
        return self._copies.restore_to_live(request_indices, block_ids, stream=stream)

    # --- intermediate states --------------------------------------------------------------------

    def compute_and_store_offsets(self, req, current_id, skip_tokens, prefill_chunk_length,
                                  num_matched_blocks, matched_block_ids,
                                  overall_required_blocks, *, extra_boundaries=()) -> None:
        """Choose the block boundaries inside this chunk of request row ``current_id`` whose
        states the model must emit; see :meth:`IntermediateStates.plan` (the block table, block
        size and chunk size are the context's). Raises ``IndexError`` for a bad row."""
        row, ctx = check_index("current_id", current_id, self.max_requests), self.context
        self._intermediate.plan(
            row, req, skip_tokens, prefill_chunk_length, num_matched_blocks, matched_block_ids,
            overall_required_blocks, block_table=ctx.request_to_kv_block_ids,
            block_size=int(ctx.block_size_tokens), chunk_size=int(ctx.mamba_chunk_size),
            extra_boundaries=extra_boundaries)

    def compute_and_store_offsets_batch(self, rows, chunk_starts, seq_lens, boundaries,
                                        eos_columns) -> None:
        """:meth:`compute_and_store_offsets` of distinct request ``rows`` at once, with their
        candidate boundaries given; see :meth:`IntermediateStates.plan_batch` (the block table,
        block size and chunk size are the context's)."""
        ctx = self.context
        self._intermediate.plan_batch(
            rows, chunk_starts, seq_lens, boundaries, eos_columns,
            block_table=ctx.request_to_kv_block_ids, block_size=int(ctx.block_size_tokens),
            chunk_size=int(ctx.mamba_chunk_size))

    def _plan_prompt(self, row: int, skip: int, n: int, matched: int, required: int,
                     extra: int) -> None:
        """Unchecked :meth:`compute_and_store_offsets` of an admission's whole prompt (its own
        row and counts, Python ints; one ``extra`` boundary)."""
        ctx = self.context
        self._intermediate.plan_prompt(row, ctx.request_to_kv_block_ids[row], skip, n, matched,
                                       required, extra, ctx.block_size_tokens, ctx.mamba_chunk_size)

    def _plan_eos(self, rows, block_ids) -> None:
        """Unchecked :meth:`compute_and_store_offsets_batch` of a decode step (own rows, and
        the blocks their EOS entries keep: lists of Python ints, or int arrays)."""
        self._intermediate.plan_eos(rows, block_ids)

    def intermediate_targets(self) -> list[tuple[int, int, int]]:
        """:meth:`IntermediateStates.targets`: ``(request_row, offset, scratch_index)``."""
        return self._intermediate.targets()

    def get_intermediate_gpu_data(self, prefill_start=0, prefill_count=None, *, stream=None):
        """Offsets ``int32 [prefill_count, 3]`` and counts ``int32 [prefill_count]`` of request
        rows ``[prefill_start, prefill_start + prefill_count)`` on the states' device, or
        ``(None, None)``; see :meth:`IntermediateStates.device_data`."""
        return self._intermediate.device_data(prefill_start, prefill_count, stream=stream)

    def _collect_commit_data(self):
        """:meth:`IntermediateStates.collect` of the KV hashes, or None (nothing pending)."""
        return self._intermediate.collect(self._kv.block_hashes)

    def commit_intermediate_states(self, *, stream=None) -> int:
        """Keep this step's boundary states (scratch and EOS) as cached states, clear the tracking
        (after the forward pass, before rows are reordered). Best effort: skips entries whose KV
        block is unregistered and not in :attr:`deferred_blocks` (their states await it), cached
        under its hash, or repeated; short of slots, keeps owners and as many new ones as fit.
        Returns the states made reachable (bad ``stream``: ``TypeError``, ``ValueError``).
        A step's few entries take :func:`~.mamba_commit.commit_lean`, any other case (or a
        lean path turned off by :attr:`lean_commit`) :func:`~.mamba_commit.commit_general`."""
        if stream is not None:
            stream_handle(stream)
        done = commit_lean(self, stream) if self.lean_commit else None
        return commit_general(self, stream) if done is None else done

    def _settle_deferred(self, block_ids: np.ndarray, hashes: np.ndarray) -> int:
        """The context registered ``block_ids`` (int64, ``hashes``): awaiting states become
        reachable (returns how many) or free their slot (:meth:`MambaHashMap.settle`)."""
        unreachable, reachable = self._hashes.settle(block_ids, hashes, self._kv.block_hashes,
                                                     self.block_to_slot)
        self._pool.release(unreachable)
        return reachable

    def _copy_intermediate_to_cache(self, src_offsets, slots, *, stream=None) -> None:
        self._copies.scratch_to_cache(src_offsets, slots, stream=stream)   # all layers, 1 launch

    def _clear_intermediate_state(self, rows=None) -> None:
        """Forget the pending offsets and EOS entries of ``rows`` (default: every row)."""
        self._intermediate.clear(rows)

    # --- lifecycle ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every cached state and all tracking; zero cache and scratch (no allocation)."""
        self._pool.reset()
        self._hashes.reset()
        self._copies.zero()
        self._intermediate.reset()

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` listing every broken invariant (see the module docstring)."""
        problems = self._pool.broken_invariants(self._kv.block_ref_counts, self._timestamps())
        problems += self._hashes.broken_invariants(self.block_to_slot)
        problems += self._intermediate.broken_invariants()
        if problems:
            raise RuntimeError("MambaSlotAllocator invariants broken: " + "; ".join(problems))
