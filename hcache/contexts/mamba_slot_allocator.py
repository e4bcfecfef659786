"""Durable Mamba states keyed by KV block id: the Mamba half of hybrid prefix caching
(docs/design.md §6).

A cached state describes the recurrent (SSM) and conv state of every Mamba layer *after* the last
token of one KV block, so a request whose prompt matches that block's chained hash can restore it
and skip the prefix. Three kinds of state memory are involved:

- live per-request states, owned by the context: ``[num_mamba_layers, max_requests, *shape]``;
- durable cache slots, owned here: ``conv_states`` / ``ssm_states``
  ``[num_mamba_layers, max_slots, *shape]``;
- per-step scratch, owned here: ``intermediate_conv_out`` / ``intermediate_ssm_out``
  ``[num_mamba_layers, MAX_INTERMEDIATE_OFFSETS_PER_REQUEST * max_requests, *shape]``, which the
  model fills with mid-prefill states that ``commit_intermediate_states`` then keeps.

Invariants (checked by :meth:`MambaSlotAllocator.check_invariants`):

- ``block_to_slot`` / ``slot_to_block`` are inverse partial maps; every slot is either on the
  free stack or owned by exactly one block.
- The Mamba map ``hash_to_block_id`` is a subset of the KV allocator's map (same block ids), and
  every block in it owns a slot. KV deregistration cascades here through the observer that the
  constructor subscribes, so a recycled block id never carries a stale state.
- A slot is evictable only while its KV block's ref count is 0, so pinning a matched block
  (retain) before allocating also protects its Mamba state.

Host bookkeeping is NumPy; every copy of states is one :func:`hcache.ops.slot_copy` launch over
all Mamba layers (conv and SSM together), with index arrays staged in buffers allocated here.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import as_int, check_index, index_array, int_shape
from ..device import Device, array_module_of, stream_scope
from ..dtypes import resolve_dtype, storage_dtype
from ..errors import CacheCapacityError
from ..ops.tables import SlotSet
from ._invariants import check_mamba_slot_allocator
from .mamba_hash_map import MambaHashMapMixin
from .mamba_intermediate import MAX_INTERMEDIATE_OFFSETS_PER_REQUEST, MambaIntermediateMixin
from .mamba_state_copies import MambaStateCopyMixin

__all__ = ["MAX_INTERMEDIATE_OFFSETS_PER_REQUEST", "MambaSlotCapacityError",
           "MambaSlotAllocator"]



class MambaSlotCapacityError(CacheCapacityError):
    """Not enough free plus evictable Mamba cache slots for a batch; nothing was changed.

    Attributes
    ----------
    required : int
        New slots the batch needed.
    available : int
        Free slots plus slots that could have been evicted.
    """

    def __init__(self, required: int, available: int, message: str | None = None):
        super().__init__(message or f"Mamba cache slots: {required} required, {available} "
                         "available (free + evictable)", required=int(required),
                         available=int(available))


class MambaSlotAllocator(MambaHashMapMixin, MambaIntermediateMixin, MambaStateCopyMixin):
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
    conv_states_shape, ssm_states_shape : tuple of int
        Per-slot shapes (without the layer and slot axes).
    conv_states_dtype, ssm_states_dtype : str or dtype
        One of the docs/design.md §2 dtypes; must match the live states' storage dtype.

    Raises
    ------
    TypeError, ValueError
        An argument or a live state array does not fit the description above.

    Notes
    -----
    Slot allocation, LRU eviction and the copy primitive live here; the other methods come
    from mixins: the Mamba hash map (:meth:`register_block_hashes_batch`,
    :meth:`invalidate_block`, :meth:`on_kv_blocks_deregistered`) from
    :class:`~hcache.contexts.mamba_hash_map.MambaHashMapMixin`, the intermediate states
    (:meth:`compute_and_store_offsets`, :meth:`commit_intermediate_states`, ...) from
    :class:`~hcache.contexts.mamba_intermediate.MambaIntermediateMixin` and store/restore from
    :class:`~hcache.contexts.mamba_state_copies.MambaStateCopyMixin`.
    """

    def __init__(self, context, max_slots, num_mamba_layers, conv_states_shape,
                 ssm_states_shape, conv_states_dtype, ssm_states_dtype):
        self.context = context
        self.max_slots = as_int("max_slots", max_slots, 1)
        self.num_mamba_layers = as_int("num_mamba_layers", num_mamba_layers, 1)
        self.conv_states_shape = int_shape("conv_states_shape", conv_states_shape)
        self.ssm_states_shape = int_shape("ssm_states_shape", ssm_states_shape)
        kv = context.kv_block_allocator
        self.num_blocks = int(len(kv.block_ref_counts))
        live_conv, live_ssm = context.mamba_conv_states, context.mamba_ssm_states
        xp = array_module_of(live_conv)
        conv_dt = storage_dtype(resolve_dtype(conv_states_dtype, "conv_states_dtype"), xp)
        ssm_dt = storage_dtype(resolve_dtype(ssm_states_dtype, "ssm_states_dtype"), xp)
        self.max_requests = self._check_live("context.mamba_conv_states", live_conv, xp,
                                             self.conv_states_shape, conv_dt, None)
        self._check_live("context.mamba_ssm_states", live_ssm, xp, self.ssm_states_shape,
                         ssm_dt, self.max_requests)
        self.xp = xp
        self.device = Device("cuda", live_conv.device.id) if xp is not np else Device("cpu")
        L, R, S = self.num_mamba_layers, self.max_requests, self.max_slots
        with self.device.scope():
            self.conv_states = xp.zeros((L, S, *self.conv_states_shape), dtype=conv_dt)
            self.ssm_states = xp.zeros((L, S, *self.ssm_states_shape), dtype=ssm_dt)
            self._init_intermediate(conv_dt, ssm_dt)   # scratch outputs and their tracking
            # Staged index arrays: lanes (src, dst) for two launches per call. Every launch
            # writes distinct destination slots, so no call needs more than this many pairs.
            self._lane_capacity = max(S, R, self.max_intermediate_count)
            self._idx_dev = xp.full((4, self._lane_capacity), -1, dtype=np.int32)
            # One SlotSet per copy direction, covering conv and SSM of every layer: each copy
            # is a single slot_copy launch.
            layers = range(L)
            self._live_to_cache = SlotSet(
                [(live_conv[i], self.conv_states[i]) for i in layers]
                + [(live_ssm[i], self.ssm_states[i]) for i in layers])
            self._cache_to_live = SlotSet(
                [(self.conv_states[i], live_conv[i]) for i in layers]
                + [(self.ssm_states[i], live_ssm[i]) for i in layers])
        self.block_to_slot = np.full(self.num_blocks, -1, dtype=np.int32)
        self.slot_to_block = np.full(S, -1, dtype=np.int32)
        self.free_slots = np.arange(S - 1, -1, -1, dtype=np.int32)  # top = free_count - 1
        self.free_count = S
        self.hash_to_block_id: dict[int, int] = {}
        self._block_hash = np.full(self.num_blocks, -1, dtype=np.int64)  # Mamba-map hash
        kv.add_blocks_deregistered_observer(self.on_kv_blocks_deregistered)

    def _check_live(self, name, live, xp, shape, dtype, rows):
        want = (self.num_mamba_layers, rows, *shape)
        if array_module_of(live) is not xp:
            raise TypeError(f"{name}: expected a {xp.__name__} array, got {type(live).__name__}")
        if live.ndim != len(want) or live.shape[0] != want[0] or live.shape[2:] != want[2:] \
                or (rows is not None and live.shape[1] != rows) or live.shape[1] < 1:
            raise ValueError(f"{name}: expected shape [{want[0]}, max_requests, "
                             f"{', '.join(map(str, shape))}], got {tuple(live.shape)}")
        if live.dtype != dtype:
            raise ValueError(f"{name}: expected dtype {dtype}, got {live.dtype}")
        if not live.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous array")
        return int(live.shape[1])

    # --- queries --------------------------------------------------------------------------------

    @property
    def _kv(self):
        return self.context.kv_block_allocator

    @property
    def num_used_slots(self) -> int:
        """Slots owned by a block."""
        return self.max_slots - self.free_count

    @property
    def num_cached_states(self) -> int:
        """Blocks whose state is reachable through the Mamba hash map."""
        return len(self.hash_to_block_id)

    @property
    def evictable_count(self) -> int:
        """Owned slots whose KV block has ref count 0."""
        return int(len(self._evictable_block_ids()))

    def get_slot(self, block_id) -> int:
        """The cache slot of KV block ``block_id``, or -1. Raises ``IndexError`` out of range."""
        return int(self.block_to_slot[check_index("block_id", block_id, self.num_blocks)])

    def has_state(self, block_id) -> bool:
        """Whether KV block ``block_id`` owns a cache slot (its state has been stored)."""
        return self.get_slot(block_id) >= 0

    def can_allocate_slots(self, block_ids) -> bool:
        """Whether :meth:`allocate_slots_batch` would succeed for ``block_ids``."""
        new, available = self._slot_demand(index_array("block_ids", block_ids,
                                                        self.num_blocks))
        return len(new) <= available

    def _evictable_block_ids(self, exclude=None) -> np.ndarray:
        owned = self.slot_to_block[self.slot_to_block >= 0].astype(np.int64)
        refs = np.asarray(self._kv.block_ref_counts)[owned]
        candidates = owned[refs == 0]
        if exclude is not None and len(exclude):
            candidates = candidates[~np.isin(candidates, exclude)]
        return candidates

    def _slot_demand(self, ids: np.ndarray):
        """Blocks of ``ids`` needing a new slot (first-seen order) and the slots available to
        them: free ones plus evictable ones not in ``ids`` (whose slots are being returned)."""
        missing = ids[self.block_to_slot[ids] < 0]
        uniq, first = np.unique(missing, return_index=True)
        new = uniq[np.argsort(first)]
        available = self.free_count
        if len(new) > self.free_count:
            available += len(self._evictable_block_ids(exclude=ids))
        return new, available

    # --- slot allocation ------------------------------------------------------------------------

    def allocate_slots_batch(self, block_ids) -> list[int]:
        """Give every block of ``block_ids`` a cache slot, evicting LRU slots if necessary.

        Blocks that already own a slot keep it; a repeated id gets one slot for all occurrences.
        Atomic: either every block gets a slot or nothing changes.

        Parameters
        ----------
        block_ids : sequence of int
            KV block ids in ``[0, num_blocks)``.

        Returns
        -------
        list of int
            The slot of each entry of ``block_ids``.

        Raises
        ------
        IndexError
            A block id is out of range.
        MambaSlotCapacityError
            Free plus evictable slots (other than those of ``block_ids``) are too few.
        """
        ids = index_array("block_ids", block_ids, self.num_blocks)
        new, available = self._slot_demand(ids)
        if len(new) > available:
            raise MambaSlotCapacityError(len(new), available)
        if len(new):
            take = min(len(new), self.free_count)
            slots = self.free_slots[self.free_count - take:self.free_count][::-1].copy()
            self.free_count -= take
            if take < len(new):
                evicted = self._evict_lru_slots_batch(len(new) - take, exclude=ids)
                slots = np.concatenate([slots, np.asarray(evicted, dtype=np.int32)])
            self.block_to_slot[new] = slots
            self.slot_to_block[slots] = new
        return self.block_to_slot[ids].tolist()

    def _evict_lru_slots_batch(self, num_needed, *, exclude=None) -> list[int]:
        """Take the slots of the ``num_needed`` least recently used evictable blocks.

        Victims are blocks with a slot whose KV ref count is 0, oldest KV timestamp first, ties
        by block id (under either eviction policy), never a block of ``exclude``. Their mappings
        and Mamba hashes are dropped (the KV blocks stay registered). The slots are **not**
        returned to the free stack: the caller takes ownership.

        Raises
        ------
        MambaSlotCapacityError
            Fewer than ``num_needed`` candidates; nothing changes.
        """
        n = as_int("num_needed", num_needed)
        if n == 0:
            return []
        candidates = self._evictable_block_ids(exclude)
        if len(candidates) < n:
            raise MambaSlotCapacityError(n, len(candidates))
        stamps = getattr(self._kv, "block_timestamps", None)
        stamps = (np.zeros(len(candidates), dtype=np.int64) if stamps is None
                  else np.asarray(stamps)[candidates])
        victims = candidates[np.lexsort((candidates, stamps))[:n]]
        slots = self.block_to_slot[victims].copy()
        self.block_to_slot[victims] = -1
        self.slot_to_block[slots] = -1
        self._drop_hashes(victims)
        return slots.tolist()

    # --- state copies ---------------------------------------------------------------------------

    def _copy(self, slotset, src, dst, lane, stream):
        """One ``slot_copy`` launch of ``slotset`` for host index arrays ``src`` -> ``dst``."""
        src32 = np.ascontiguousarray(src, dtype=np.int32)
        dst32 = np.ascontiguousarray(dst, dtype=np.int32)
        n = len(src32)
        if n == 0:
            return
        with stream_scope(stream, self.device), self.device.scope():
            if self.xp is np:
                s, d = src32, dst32
            else:
                current = self.xp.cuda.get_current_stream()
                s, d = self._idx_dev[2 * lane, :n], self._idx_dev[2 * lane + 1, :n]
                s.set(src32, stream=current)
                d.set(dst32, stream=current)
            ops.slot_copy(slotset, s, d, stream=stream)

    # --- lifecycle ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every cached state: mappings, free stack, Mamba map, tracking; zero the cache
        and scratch (device fills, no allocation)."""
        self.block_to_slot.fill(-1)
        self.slot_to_block.fill(-1)
        self.free_slots[:] = np.arange(self.max_slots - 1, -1, -1, dtype=np.int32)
        self.free_count = self.max_slots
        self.hash_to_block_id.clear()
        self._block_hash.fill(-1)
        with self.device.scope():
            for a in (self.conv_states, self.ssm_states, self.intermediate_conv_out,
                      self.intermediate_ssm_out):
                a.fill(0)
        self._clear_intermediate_state()

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` listing every broken invariant (see the module docstring)."""
        check_mamba_slot_allocator(self)
