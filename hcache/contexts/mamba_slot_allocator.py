"""Durable Mamba states keyed by KV block id: the Mamba half of hybrid prefix caching (SPEC §6).

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

import operator

import numpy as np

from .. import ops
from ..configs import _int
from ..device import Device, array_module_of, stream_scope
from ..dtypes import resolve_dtype, storage_dtype
from ..errors import CacheCapacityError
from ..layout import SlotSet

__all__ = ["MAX_INTERMEDIATE_OFFSETS_PER_REQUEST", "MambaSlotCapacityError",
           "MambaSlotAllocator"]

MAX_INTERMEDIATE_OFFSETS_PER_REQUEST = 3
_K = MAX_INTERMEDIATE_OFFSETS_PER_REQUEST


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


def _index(name: str, value, upper: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value < upper:
        raise IndexError(f"{name}: expected an index in [0, {upper}), got {value}")
    return value


def _index_array(name: str, values, upper: int) -> np.ndarray:
    """``values`` as int64 ``[n]``, every entry in ``[0, upper)``."""
    arr = values if isinstance(values, np.ndarray) else np.asarray(list(values))
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = (arr < 0) | (arr >= upper)
    if bad.any():
        raise IndexError(f"{name}: expected indices in [0, {upper}), got {int(arr[bad][0])}")
    return arr


def _host(array) -> np.ndarray:
    """A host view of a context array (NumPy expected; a CuPy array is copied, synchronously)."""
    return array if isinstance(array, np.ndarray) else np.asarray(
        array.get() if hasattr(array, "get") else array)


def _shape(name: str, shape) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"{name}: expected a tuple of ints, got {type(shape).__name__}")
    return tuple(_int(f"{name}[{i}]", s, 1) for i, s in enumerate(shape))


def _prompt_length(req) -> int:
    if hasattr(req, "prompt_length"):
        return int(req.prompt_length)
    if hasattr(req, "prompt_tokens"):
        return len(req.prompt_tokens)
    raise TypeError(f"req: expected an object with prompt_length or prompt_tokens, "
                    f"got {type(req).__name__}")


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
    conv_states_shape, ssm_states_shape : tuple of int
        Per-slot shapes (without the layer and slot axes).
    conv_states_dtype, ssm_states_dtype : str or dtype
        One of the SPEC §2 dtypes; must match the live states' storage dtype.

    Raises
    ------
    TypeError, ValueError
        An argument or a live state array does not fit the description above.
    """

    def __init__(self, context, max_slots, num_mamba_layers, conv_states_shape,
                 ssm_states_shape, conv_states_dtype, ssm_states_dtype):
        self.context = context
        self.max_slots = _int("max_slots", max_slots, 1)
        self.num_mamba_layers = _int("num_mamba_layers", num_mamba_layers, 1)
        self.conv_states_shape = _shape("conv_states_shape", conv_states_shape)
        self.ssm_states_shape = _shape("ssm_states_shape", ssm_states_shape)
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
        self.max_intermediate_count = _K * R
        with self.device.scope():
            self.conv_states = xp.zeros((L, S, *self.conv_states_shape), dtype=conv_dt)
            self.ssm_states = xp.zeros((L, S, *self.ssm_states_shape), dtype=ssm_dt)
            self.intermediate_conv_out = xp.zeros(
                (L, self.max_intermediate_count, *self.conv_states_shape), dtype=conv_dt)
            self.intermediate_ssm_out = xp.zeros(
                (L, self.max_intermediate_count, *self.ssm_states_shape), dtype=ssm_dt)
            # Staged index arrays: lanes (src, dst) for two launches per call. Every launch
            # writes distinct destination slots, so no call needs more than this many pairs.
            self._lane_capacity = max(S, R, self.max_intermediate_count)
            self._idx_dev = xp.full((4, self._lane_capacity), -1, dtype=np.int32)
            self._offsets_dev = xp.zeros((R, _K), dtype=np.int32)
            self._counts_dev = xp.zeros((R,), dtype=np.int32)
            # One SlotSet per copy direction, covering conv and SSM of every layer: each copy
            # is a single slot_copy launch.
            layers = range(L)
            self._live_to_cache = SlotSet(
                [(live_conv[i], self.conv_states[i]) for i in layers]
                + [(live_ssm[i], self.ssm_states[i]) for i in layers])
            self._cache_to_live = SlotSet(
                [(self.conv_states[i], live_conv[i]) for i in layers]
                + [(self.ssm_states[i], live_ssm[i]) for i in layers])
            self._scratch_to_cache = SlotSet(
                [(self.intermediate_conv_out[i], self.conv_states[i]) for i in layers]
                + [(self.intermediate_ssm_out[i], self.ssm_states[i]) for i in layers])
        self.block_to_slot = np.full(self.num_blocks, -1, dtype=np.int32)
        self.slot_to_block = np.full(S, -1, dtype=np.int32)
        self.free_slots = np.arange(S - 1, -1, -1, dtype=np.int32)  # top = free_count - 1
        self.free_count = S
        self.hash_to_block_id: dict[int, int] = {}
        self._block_hash = np.full(self.num_blocks, -1, dtype=np.int64)  # Mamba-map hash
        self._intermediate_offsets = np.zeros((R, _K), dtype=np.int32)
        self._intermediate_block_ids = np.full((R, _K), -1, dtype=np.int32)
        self._intermediate_counts = np.zeros(R, dtype=np.int32)
        self._eos_cache_block_id = np.full(R, -1, dtype=np.int32)
        self._has_intermediates = False
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
        return int(self.block_to_slot[_index("block_id", block_id, self.num_blocks)])

    def has_state(self, block_id) -> bool:
        """Whether KV block ``block_id`` owns a cache slot (its state has been stored)."""
        return self.get_slot(block_id) >= 0

    def can_allocate_slots(self, block_ids) -> bool:
        """Whether :meth:`allocate_slots_batch` would succeed for ``block_ids``."""
        new, available = self._slot_demand(_index_array("block_ids", block_ids,
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
        ids = _index_array("block_ids", block_ids, self.num_blocks)
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
        n = _int("num_needed", num_needed)
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

    def _drop_hashes(self, block_ids: np.ndarray) -> None:
        hashes = self._block_hash[block_ids]
        for h in hashes[hashes > 0].tolist():
            self.hash_to_block_id.pop(h, None)
        self._block_hash[block_ids] = -1

    def invalidate_block(self, block_id) -> None:
        """Free the slot of ``block_id`` (if any) and drop its hash from the Mamba map.

        Raises ``IndexError`` when ``block_id`` is out of range.
        """
        self._invalidate_blocks_batch([_index("block_id", block_id, self.num_blocks)])

    def _invalidate_blocks_batch(self, block_ids_list) -> None:
        """Vectorised :meth:`invalidate_block`; blocks without a slot are skipped."""
        ids = np.unique(_index_array("block_ids_list", block_ids_list, self.num_blocks))
        if not len(ids):
            return
        slots = self.block_to_slot[ids]
        owned = slots >= 0
        blocks, slots = ids[owned], slots[owned]
        self.block_to_slot[blocks] = -1
        self.slot_to_block[slots] = -1
        self.free_slots[self.free_count:self.free_count + len(slots)] = slots
        self.free_count += len(slots)
        self._drop_hashes(ids)

    def on_kv_blocks_deregistered(self, block_ids_list, hashes_to_delete) -> None:
        """Observer of the KV allocator: a deregistered block loses its slot and Mamba hash.

        Parameters
        ----------
        block_ids_list : list of int
            Deregistered KV block ids (their ids may be reused at once).
        hashes_to_delete : set of int
            Their former hashes; any Mamba-map entry under one of them is dropped too.
        """
        self._invalidate_blocks_batch(block_ids_list)
        for h in hashes_to_delete or ():
            block = self.hash_to_block_id.pop(int(h), None)
            if block is not None:
                self._block_hash[block] = -1

    def register_block_hashes_batch(self, block_ids, hashes) -> None:
        """Make the states of ``block_ids`` reachable under their KV ``hashes``.

        Entries with ``hash <= 0`` (an unregistered KV block) are skipped; re-registering the
        same pair is a no-op.

        Raises
        ------
        IndexError
            A block id is out of range.
        ValueError
            Lengths differ, a block owns no slot, or a hash is not the KV allocator's hash of
            that block (the Mamba map must stay a subset of the KV map). Nothing changes.
        """
        ids = _index_array("block_ids", block_ids, self.num_blocks)
        hs = np.asarray(list(hashes), dtype=np.int64).reshape(-1)
        if hs.shape != ids.shape:
            raise ValueError(f"hashes: expected {len(ids)} hashes, got {len(hs)}")
        keep = hs > 0
        ids, hs = ids[keep], hs[keep]
        no_slot = ids[self.block_to_slot[ids] < 0]
        if len(no_slot):
            raise ValueError(f"block_ids: expected blocks owning a slot, got {int(no_slot[0])}")
        kv_map = self._kv.kv_hash_to_block_id
        for b, h in zip(ids.tolist(), hs.tolist(), strict=True):
            if kv_map.get(h) != b or self.hash_to_block_id.get(h, b) != b \
                    or self._block_hash[b] not in (-1, h):
                raise ValueError(f"hashes: expected the KV hash of block {b}, got {h}")
        for b, h in zip(ids.tolist(), hs.tolist(), strict=True):
            self.hash_to_block_id[h] = b
        self._block_hash[ids] = hs

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

    def _live_slots(self, rows: np.ndarray) -> np.ndarray:
        live = _host(self.context.request_to_mamba_state_idx)[rows].astype(np.int64)
        bad = (live < 0) | (live >= self.max_requests)
        if bad.any():
            raise ValueError(f"request_indices: expected requests with a live Mamba slot, "
                             f"got request {int(rows[bad][0])} -> {int(live[bad][0])}")
        return live

    def _rows(self, name, values) -> np.ndarray:
        table = self.context.request_to_mamba_state_idx
        return _index_array(name, values, len(table))

    def store_from_tensors(self, block_id, layer_idx, ssm_state, conv_state, *,
                           stream=None) -> None:
        """Write one layer's states into the slot of ``block_id`` (mainly for tests).

        ``ssm_state`` / ``conv_state`` have the per-slot shapes and storage dtypes; an array of
        another module is converted (an allocation). Raises ``IndexError`` (block or layer out
        of range), ``ValueError`` (block owns no slot, or shape/dtype mismatch).
        """
        slot = self.get_slot(block_id)
        layer = _index("layer_idx", layer_idx, self.num_mamba_layers)
        if slot < 0:
            raise ValueError(f"block_id: expected a block owning a slot, got {int(block_id)}")
        for name, value, cache in (("ssm_state", ssm_state, self.ssm_states),
                                   ("conv_state", conv_state, self.conv_states)):
            if tuple(value.shape) != cache.shape[2:] or value.dtype != cache.dtype:
                raise ValueError(f"{name}: expected {cache.dtype}{cache.shape[2:]}, "
                                 f"got {value.dtype}{tuple(value.shape)}")
        with stream_scope(stream, self.device), self.device.scope():
            self.ssm_states[layer, slot] = self.xp.asarray(ssm_state)
            self.conv_states[layer, slot] = self.xp.asarray(conv_state)

    def store_from_live_batch(self, slots, request_indices, *, stream=None) -> None:
        """Copy every layer's live state of each request into the paired cache slot (one launch).

        Raises ``IndexError`` (slot or row out of range) or ``ValueError`` (lengths differ, a
        slot repeats or is free, a request has no live slot); nothing is copied then.
        """
        dst = _index_array("slots", slots, self.max_slots)
        rows = self._rows("request_indices", request_indices)
        if len(dst) != len(rows):
            raise ValueError(f"request_indices: expected {len(dst)} rows, got {len(rows)}")
        if len(np.unique(dst)) != len(dst):
            raise ValueError("slots: expected distinct slots, got a repeated slot")
        free = dst[self.slot_to_block[dst] < 0]
        if len(free):
            raise ValueError(f"slots: expected slots owned by a block, got free slot "
                             f"{int(free[0])}")
        self._copy(self._live_to_cache, self._live_slots(rows), dst, 0, stream)

    def restore_to_live(self, request_idx, block_id, *, stream=None) -> bool:
        """Copy every layer's cached state of ``block_id`` into the request's live slot.

        Returns False (and copies nothing) when the block owns no slot. Raises ``IndexError``
        (row or block out of range) or ``ValueError`` (the request has no live slot).
        """
        return bool(self.restore_to_live_batch([request_idx], [block_id], stream=stream)[0])

    def restore_to_live_batch(self, request_indices, block_ids, *, stream=None) -> list[bool]:
        """Batched :meth:`restore_to_live`: one launch for every request that has a state.

        Returns, per entry, whether it was restored. The requests' live slots must differ.
        """
        rows = self._rows("request_indices", request_indices)
        ids = _index_array("block_ids", block_ids, self.num_blocks)
        if len(ids) != len(rows):
            raise ValueError(f"block_ids: expected {len(rows)} blocks, got {len(ids)}")
        live = self._live_slots(rows)
        if len(np.unique(live)) != len(live):
            raise ValueError("request_indices: expected distinct live slots, got a repeat")
        src = self.block_to_slot[ids]
        found = src >= 0
        self._copy(self._cache_to_live, src[found], live[found], 0, stream)
        return found.tolist()

    # --- intermediate states --------------------------------------------------------------------

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
        row = _index("current_id", current_id, self.max_requests)
        bs, align = int(self.context.block_size_tokens), int(self.context.mamba_chunk_size)
        finished = int(getattr(req, "finished_chunk_token_count", 0))
        prompt_len = _prompt_length(req)
        skip = _int("skip_tokens", skip_tokens)
        chunk = _int("prefill_chunk_length", prefill_chunk_length)
        matched = _int("num_matched_blocks", num_matched_blocks)
        required = _int("overall_required_blocks", overall_required_blocks)
        if skip >= chunk:
            raise ValueError(f"skip_tokens: expected fewer than {chunk} tokens, got {skip}")
        table = _host(self.context.request_to_kv_block_ids)[row]
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
        start = _int("prefill_start", prefill_start)
        count = self.max_requests - start if prefill_count is None \
            else _int("prefill_count", prefill_count)
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
        src = _index_array("src_offsets", src_offsets, self.max_intermediate_count)
        dst = _index_array("slots", slots, self.max_slots)
        if len(src) != len(dst):
            raise ValueError(f"slots: expected {len(src)} slots, got {len(dst)}")
        if len(np.unique(dst)) != len(dst):
            raise ValueError("slots: expected distinct slots, got a repeated slot")
        self._copy(self._scratch_to_cache, src, dst, 1, stream)

    def _clear_intermediate_state(self, rows=None) -> None:
        """Forget the pending offsets and EOS entries of ``rows`` (default: every row)."""
        sel = slice(None) if rows is None else _index_array("rows", rows, self.max_requests)
        self._intermediate_offsets[sel] = 0
        self._intermediate_block_ids[sel] = -1
        self._intermediate_counts[sel] = 0
        self._eos_cache_block_id[sel] = -1
        self._has_intermediates = bool(self._intermediate_counts.any()
                                       or (self._eos_cache_block_id >= 0).any())

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
        problems = []
        free = self.free_slots[:self.free_count].astype(np.int64)
        if not 0 <= self.free_count <= self.max_slots:
            problems.append(f"free_count {self.free_count} outside [0, {self.max_slots}]")
        elif len(np.unique(free)) != len(free) or (self.slot_to_block[free] >= 0).any():
            problems.append("free stack holds a repeated or owned slot")
        owned_slots = np.nonzero(self.slot_to_block >= 0)[0]
        if self.free_count + len(owned_slots) != self.max_slots:
            problems.append(f"free {self.free_count} + owned {len(owned_slots)} != "
                            f"max_slots {self.max_slots}")
        blocks = np.nonzero(self.block_to_slot >= 0)[0]
        slots = self.block_to_slot[blocks]
        if len(np.unique(slots)) != len(slots):
            problems.append("a slot is owned by two blocks")
        if len(blocks) != len(owned_slots) or (self.slot_to_block[slots] != blocks).any():
            problems.append("block_to_slot and slot_to_block are not inverse")
        kv_map = self._kv.kv_hash_to_block_id
        for h, b in self.hash_to_block_id.items():
            if kv_map.get(h) != b:
                problems.append(f"Mamba hash {h} -> block {b} is not in the KV map")
            if self.block_to_slot[b] < 0:
                problems.append(f"Mamba hash {h} -> block {b}, which owns no slot")
            if self._block_hash[b] != h:
                problems.append(f"block {b} records Mamba hash {self._block_hash[b]}, not {h}")
        if int((self._block_hash > 0).sum()) != len(self.hash_to_block_id):
            problems.append("per-block Mamba hashes disagree with the Mamba map")
        if problems:
            raise RuntimeError("MambaSlotAllocator invariants broken: " + "; ".join(problems))
