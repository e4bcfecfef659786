"""The durable Mamba cache arrays and every copy into or out of them (docs/design.md §6).

The live states ``mamba_conv_states`` / ``mamba_ssm_states``
``[num_mamba_layers, max_requests, *shape]`` belong to the context, which maps a request row to
its live slot through ``request_to_mamba_state_idx``. Storing copies a request's live state (or
a scratch state the model emitted mid-prefill) into a cache slot owned by a block; restoring
copies a block's cached state back into a live slot. Every batch of copies is a single
:func:`hcache.ops.slot_copy` launch over conv and SSM of all Mamba layers, with its index arrays
staged in buffers allocated once (on the host, where the op is its NumPy reference, one
NumPy gather per kind of state over all layers: the op's result for the valid indices the
callers pass), and every call validates all of its arguments before copying anything. A kind
of state the layers do not have (short convolutions have no SSM state, lightning attention no
conv state) has ``None`` for its shape and its arrays, everywhere.
"""

from __future__ import annotations

import copy

import numpy as np

from .. import ops
from .._checks import check_index, index_array, int_shape
from ..ops.tables import SlotSet
from ..runtime.arrays import as_array, host_array, on_device
from ..runtime.device import (
    array_module_of,
    launch_scope,
    stream_handle,
    to_host,
    upload,
    upload_ints,
    zeros,
)
from ..runtime.stream_order import StreamOrder

__all__ = ["MambaStateCopies", "check_live_states", "context_parts", "state_shapes"]

# Host copies of up to this many states go one by one (Python ints), more as one gather.
_FEW = 4


def context_parts(context):
    """``(kv_block_allocator, mamba_conv_states, mamba_ssm_states)`` of a context; raises
    ``TypeError`` naming ``context`` when it lacks one of them."""
    names = ("kv_block_allocator", "mamba_conv_states", "mamba_ssm_states")
    missing = [n for n in names if not hasattr(context, n)]
    if missing:
        raise TypeError(f"context: expected an object with {', '.join(names)}, "
                        f"got {type(context).__name__} without {missing[0]}")
    return tuple(getattr(context, n) for n in names)


def state_shapes(conv_states_shape, ssm_states_shape) -> tuple:
    """The two per-slot state shapes, each a tuple of ints or ``None`` (no such state; not
    both).

    Raises
    ------
    TypeError, ValueError
        A shape that is not a sequence of positive ints, or both ``None``.
    """
    shapes = tuple(None if value is None else int_shape(name, value)
                   for name, value in (("conv_states_shape", conv_states_shape),
                                       ("ssm_states_shape", ssm_states_shape)))
    if shapes == (None, None):
        raise ValueError("ssm_states_shape: expected a shape (conv_states_shape is None: no "
                         "conv state), got None")
    return shapes


def check_live_states(name, live, xp, num_mamba_layers, shape, dtype, rows) -> int | None:
    """Check a live state array ``[num_mamba_layers, rows, *shape]`` of module ``xp`` and
    ``dtype``, C-contiguous (``rows`` None: any >= 1); returns its row count (``rows`` for a
    state that does not exist: ``shape`` and ``live`` both ``None``).

    Raises
    ------
    TypeError
        Another array module.
    ValueError
        Another shape or dtype, not C-contiguous, or an array for a state that does not exist.
    """
    if shape is None or live is None:
        if shape is not None or live is not None:
            want = "None (no such state)" if shape is None else "an array"
            raise ValueError(f"{name}: expected {want}, got {type(live).__name__}")
        return rows
    want = (num_mamba_layers, rows, *shape)
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


class MambaStateCopies:
    """Cache slots ``conv_states`` / ``ssm_states`` and the copies between them, the live
    states and the scratch.

    Parameters
    ----------
    context : object
        Holds the live states ``mamba_conv_states`` / ``mamba_ssm_states`` (checked by the
        caller) and ``request_to_mamba_state_idx`` (request row -> live slot, read per call).
    pool : MambaSlotPool
        Which block owns which slot (read per call).
    device : Device
    scratch_conv, scratch_ssm : arrays [num_mamba_layers, max_scratch, *shape]
        The intermediate outputs the model writes.
    conv_dtype, ssm_dtype : dtype
        Storage dtypes.

    Attributes
    ----------
    conv_states, ssm_states : arrays [num_mamba_layers, max_slots, *shape]
        The cache slots (zero-initialised).
    """

    def __init__(self, context, pool, device, scratch_conv, scratch_ssm, conv_dtype, ssm_dtype):
        live_conv, live_ssm = context.mamba_conv_states, context.mamba_ssm_states
        self.context, self._pool, self.device = context, pool, device
        self.order = StreamOrder()   # the staged index lanes: one chain across streams
        live = live_conv if live_conv is not None else live_ssm
        self.num_mamba_layers, self.max_requests = int(live.shape[0]), int(live.shape[1])
        self.max_scratch = int((scratch_conv if scratch_conv is not None
                                else scratch_ssm).shape[1])
        xp, L, S = device.xp, self.num_mamba_layers, pool.max_slots
        with device.scope():
            self.conv_states, self.ssm_states = (
                None if x is None else zeros(device, (L, S, *x.shape[2:]), dt)
                for x, dt in ((live_conv, conv_dtype), (live_ssm, ssm_dtype)))
            # Staged index arrays: lanes (src, dst) for two launches per call. Every launch
            # writes distinct destination slots, so no call needs more than this many pairs.
            self._idx_dev = xp.full((4, max(S, self.max_requests, self.max_scratch)), -1,
                                    dtype=np.int32)
        self._live, self._scratch = (live_conv, live_ssm), (scratch_conv, scratch_ssm)
        self._bind()

    def _bind(self) -> None:
        """Make the views every copy goes through from the state arrays: one SlotSet per copy
        direction (conv and SSM of every Mamba layer: each copy is a single slot_copy launch)
        and, on the host, one gather per kind of state over all layers at once (the op's
        result for the valid, distinct indices every caller passes)."""
        live, scratch, cache = self._live, self._scratch, (self.conv_states, self.ssm_states)
        with self.device.scope():
            self._live_to_cache = self._slot_set(*live, *cache)
            self._cache_to_live = self._slot_set(*cache, *live)
            self._scratch_to_cache = self._slot_set(*scratch, *cache)
        self._whole = {} if self.device.is_cuda else {
            "live_to_cache": _pairs(*live, *cache),
            "cache_to_live": _pairs(*cache, *live),
            "scratch_to_cache": _pairs(*scratch, *cache)}

    def __deepcopy__(self, memo):
        """A copy over copied arrays (the owners refuse deep copies; tests lift that): the
        views are made again from them, since a deep copy of a view is a new array."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        derived = ("_live_to_cache", "_cache_to_live", "_scratch_to_cache", "_whole")
        twin.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()
                              if k not in derived})
        twin._bind()
        return twin

    def _slot_set(self, src_conv, src_ssm, dst_conv, dst_ssm) -> SlotSet:
        mamba_indices = range(self.num_mamba_layers)
        return SlotSet([(src[m], dst[m]) for src, dst in ((src_conv, dst_conv), (src_ssm, dst_ssm))
                        if src is not None for m in mamba_indices])

    def _copy(self, direction: str, src, dst, lane, stream) -> None:
        """One ``slot_copy`` launch of the SlotSet of ``direction`` (``"live_to_cache"``,
        ``"cache_to_live"`` or ``"scratch_to_cache"``) for host index arrays ``src`` ->
        ``dst``, staged in lanes ``2 * lane`` and ``2 * lane + 1`` of the index buffer."""
        n = len(src)
        if n == 0:
            return
        if not self.device.is_cuda:   # host arrays: whole-state gathers (see _bind)
            if stream is not None:
                stream_handle(stream)
            if not ops.host_runs_reference():     # the kernels' host emulation: the op runs
                ops.slot_copy(getattr(self, "_" + direction), np.array(src, np.int32),
                              np.array(dst, np.int32), stream=stream)
                return
            pairs, by_slot = self._whole[direction]
            if n <= _FEW:       # a state at a time: cheaper than a gather's index arrays
                for s, d in zip(src, dst):
                    for src_states, dst_states in by_slot:
                        dst_states[d] = src_states[s]
                return
            src, dst = np.asarray(src, np.intp), np.asarray(dst, np.intp)
            for src_states, dst_states in pairs:
                dst_states[:, dst] = src_states.take(src, axis=1)
            return
        src_dev, dst_dev = self._idx_dev[2 * lane], self._idx_dev[2 * lane + 1]
        with launch_scope(self.device, stream, self.order):
            upload_ints(src_dev, np.asarray(src))
            upload_ints(dst_dev, np.asarray(dst))
            ops.slot_copy(getattr(self, "_" + direction), src_dev[:n], dst_dev[:n], stream=stream)

    def _rows(self, name, values) -> np.ndarray:
        return index_array(name, values, len(self.context.request_to_mamba_state_idx))

    def _live_slots(self, rows: np.ndarray, name: str = "request_indices") -> np.ndarray:
        """The live slot of each of ``rows`` (the caller's argument ``name``)."""
        live = to_host(self.context.request_to_mamba_state_idx)[rows].astype(np.int64)
        bad = (live < 0) | (live >= self.max_requests)
        if bad.any():
            raise _no_live_slot(name, int(rows[bad][0]), int(live[bad][0]))
        return live

    def write_layer(self, block_id, slot, layer_idx, ssm_state, conv_state, *,
                    stream=None) -> None:
        """Write one Mamba layer's states into ``slot``, the slot of ``block_id`` (-1: none).

        Raises
        ------
        IndexError
            ``layer_idx`` is out of range.
        TypeError
            A state is not an array.
        ValueError
            ``slot`` is -1, a state's shape or dtype is not the cache's, or a state the layers
            do not have is not ``None``. Nothing changes.
        """
        mamba_index = check_index("layer_idx", layer_idx, self.num_mamba_layers)
        if slot < 0:
            raise ValueError(f"block_id: expected a block owning a slot, got {int(block_id)}")
        states = []
        for name, value, cache in (("ssm_state", ssm_state, self.ssm_states),
                                   ("conv_state", conv_state, self.conv_states)):
            if cache is None:
                if value is not None:
                    raise ValueError(f"{name}: expected None (the layers have no such state), "
                                     f"got {type(value).__name__}")
                continue
            # device memory of this device (viewed; the call's stream waits for its producer
            # on the device), or host memory (uploaded through the staging ring)
            value = (as_array(name, value, self.device, stream) if on_device(value)
                     else host_array(name, value))
            if tuple(value.shape) != cache.shape[2:] or value.dtype != cache.dtype:
                raise ValueError(f"{name}: expected {cache.dtype}{cache.shape[2:]}, "
                                 f"got {value.dtype}{tuple(value.shape)}")
            states.append((value, cache))
        with launch_scope(self.device, stream, self.order):
            for value, cache in states:
                if isinstance(value, np.ndarray):
                    upload(cache[mamba_index, slot], value)   # pinned, no alloc
                else:   # a device array of this device, ordered after its producer
                    cache[mamba_index, slot] = value

    def store_from_live(self, slots, request_indices, *, stream=None) -> None:
        """``cache[:, slots[i]] = live[:, live slot of request_indices[i]]`` (one launch).

        Raises
        ------
        IndexError
            A slot or row is out of range.
        ValueError
            Lengths differ, a slot repeats or is free, or a request has no live slot. Nothing
            is copied then.
        """
        dst = index_array("slots", slots, self._pool.max_slots)
        rows = self._rows("request_indices", request_indices)
        if len(dst) != len(rows):
            raise ValueError(f"request_indices: expected {len(dst)} rows, got {len(rows)}")
        if len(np.unique(dst)) != len(dst):
            raise ValueError("slots: expected distinct slots, got a repeated slot")
        free = dst[self._pool.slot_to_block[dst] < 0]
        if len(free):
            raise ValueError(f"slots: expected slots owned by a block, got free slot "
                             f"{int(free[0])}")
        self._copy("live_to_cache", self._live_slots(rows), dst, 0, stream)

    def store_live_unchecked(self, slots: np.ndarray, rows: np.ndarray, stream) -> None:
        """:meth:`store_from_live` of arguments the caller built valid (distinct owned slots,
        rows with a live slot)."""
        live = to_host(self.context.request_to_mamba_state_idx)
        live = list(map(live.item, rows)) if len(rows) <= _FEW else live[rows]
        self._copy("live_to_cache", live, slots, 0, stream)

    def restore_to_live(self, request_indices, block_ids, *, stream=None,
                        rows_name: str = "request_indices") -> list[bool]:
        """``live[:, live slot of request_indices[i]] = cache[:, slot of block_ids[i]]`` for
        every block that owns a slot (one launch); returns, per entry, whether it was restored.
        ``rows_name``: the caller's name for ``request_indices``, for the messages.

        Raises
        ------
        IndexError
            A row or block is out of range.
        ValueError
            Lengths differ, a request has no live slot, or two share one. Nothing is copied.
        """
        rows = self._rows("request_indices", request_indices)
        block_to_slot = self._pool.block_to_slot
        ids = index_array("block_ids", block_ids, len(block_to_slot))
        if len(ids) != len(rows):
            raise ValueError(f"block_ids: expected {len(rows)} blocks, got {len(ids)}")
        live = self._live_slots(rows, rows_name)
        if len(np.unique(live)) != len(live):
            raise ValueError(f"{rows_name}: expected distinct live slots, got a repeat")
        src = block_to_slot[ids]
        found = src >= 0
        self._copy("cache_to_live", src[found], live[found], 0, stream)
        return found.tolist()

    def restore_one(self, row: int, block_id: int, *, stream=None,
                    rows_name: str = "request_indices") -> bool:
        """:meth:`restore_to_live` of one checked ``row`` and ``block_id``: the admission's
        restore, with the checks that a single pair needs.

        Raises
        ------
        ValueError
            The request has no live slot. Nothing is copied.
        """
        live = int(to_host(self.context.request_to_mamba_state_idx)[row])
        if not 0 <= live < self.max_requests:
            raise _no_live_slot(rows_name, row, live)
        src = int(self._pool.block_to_slot[block_id])
        if src < 0:
            return False
        self._copy("cache_to_live", (src,), (live,), 0, stream)
        return True

    def scratch_to_cache(self, src_offsets, slots, *, stream=None) -> None:
        """``cache[:, slots[i]] = scratch[:, src_offsets[i]]`` (one launch).

        Raises
        ------
        IndexError
            An offset or slot is out of range.
        ValueError
            Lengths differ, or a slot repeats. Nothing is copied then.
        """
        src = index_array("src_offsets", src_offsets, self.max_scratch)
        dst = index_array("slots", slots, self._pool.max_slots)
        if len(src) != len(dst):
            raise ValueError(f"slots: expected {len(src)} slots, got {len(dst)}")
        if len(np.unique(dst)) != len(dst):
            raise ValueError("slots: expected distinct slots, got a repeated slot")
        self.scratch_to_cache_unchecked(src, dst, stream)

    def scratch_to_cache_unchecked(self, src_offsets: np.ndarray, slots: np.ndarray,
                                   stream) -> None:
        """:meth:`scratch_to_cache` of arguments the caller built valid (offsets in the
        scratch, distinct owned slots)."""
        self._copy("scratch_to_cache", src_offsets, slots, 1, stream)

    def zero(self) -> None:
        """Zero every cache slot (device fills, no allocation)."""
        with self.device.scope():
            for cache in (self.conv_states, self.ssm_states):
                if cache is not None:
                    cache.fill(0)


def _no_live_slot(name: str, row: int, live: int) -> ValueError:
    return ValueError(f"{name}: expected requests with a live Mamba slot, got request {row} -> "
                      f"{live}")


def _pairs(src_conv, src_ssm, dst_conv, dst_ssm) -> tuple:
    """The (source, destination) host state arrays of a copy direction, for the kinds of state
    that exist, as ``[num_mamba_layers, slots]`` arrays of one opaque record per state (views:
    a gather moves whole states, not elements), and the same transposed (a slot's states of
    every layer one row: one state at a time indexes them faster)."""
    pairs = [(_records(src), _records(dst))
             for src, dst in ((src_conv, dst_conv), (src_ssm, dst_ssm)) if src is not None]
    return pairs, [(src.T, dst.T) for src, dst in pairs]


def _records(states):
    """Host ``states [num_mamba_layers, slots, *shape]`` (C-contiguous) as a record view
    ``[num_mamba_layers, slots]``."""
    layers, slots = states.shape[:2]
    record = np.dtype((np.void, states[0, 0].nbytes))
    return states.reshape(layers, slots, -1).view(record).reshape(layers, slots)
