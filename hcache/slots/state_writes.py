"""Batched writes of recurrent and conv states into slots (``write_states``, docs/design.md
§4.11): rows -> slots for every Mamba layer or one, one :func:`hcache.ops.slot_copy` launch.

A :class:`StateWriter` belongs to a :class:`~hcache.slots.mamba.MambaCacheManager`. Its index
buffers (``rows = arange(max_batch)``, ``zeros``, the staged ``slots``) and the descriptor tables
of the one-layer forms are allocated at construction; the every-layer forms reuse the manager's
capture and restore tables (each call rebinds the table it uses, in place). A call uploads the
slots and the table through the staging ring and launches once: no allocation, no sync.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import check_index, index_array
from ..ops.tables import SlotSet
from ..runtime.arrays import as_array, on_device
from ..runtime.device import launch_scope, upload_ints

__all__ = ["StateWriter", "STATE_KINDS"]

STATE_KINDS = ("recurrent", "conv")


class StateWriter:
    """The ``write_states`` of one Mamba manager (its layers are Mamba indices).

    Parameters
    ----------
    device : Device
    views : dict ``{"recurrent": tuple, "conv": tuple}``
        Per layer the slot-major state views ``[max_batch, *slot_shape]`` (empty for a kind the
        layers do not have).
    max_batch : int
    every_layer_sets : dict
        ``{("recurrent",): SlotSet, ("conv",): SlotSet, ("recurrent", "conv"): SlotSet}`` over
        every layer (the manager's capture and restore tables), for the kinds that exist.

    Notes
    -----
    Allocates on the current device and stream: the manager calls it inside its construction's
    :func:`~hcache.device.launch_scope`.
    """

    def __init__(self, device, views, max_batch: int, every_layer_sets):
        xp = device.xp
        self._device, self._views, self._max_batch = device, views, int(max_batch)
        self._rows = xp.zeros(self._max_batch, dtype=np.int32)
        upload_ints(self._rows, np.arange(self._max_batch))
        self._zeros = xp.zeros(self._max_batch, dtype=np.int32)
        self._slots = xp.zeros(self._max_batch, dtype=np.int32)
        self._sets = {("all", kinds): s for kinds, s in every_layer_sets.items()}
        kinds = tuple(k for k in STATE_KINDS if views[k])
        if kinds:   # the one-layer forms: layer 0's views, rebound to the written layer
            forms = [(k,) for k in kinds] + ([kinds] if len(kinds) == 2 else [])
            for form in forms:
                self._sets[("one", form)] = SlotSet([(views[k][0], views[k][0]) for k in form])
        self._one_layer_tables = [s for (scope, _), s in self._sets.items() if scope == "one"]

    @property
    def nbytes(self) -> int:
        """Device bytes of the index buffers and the one-layer descriptor tables."""
        return int(self._rows.nbytes + self._zeros.nbytes + self._slots.nbytes
                   + sum(s.device_infos.nbytes for s in self._one_layer_tables))

    @property
    def num_layers(self) -> int:
        return max(len(v) for v in self._views.values())

    def write(self, layer, states: dict, slots, stream) -> None:
        """Row ``i`` of each given state -> slot ``slots[i]`` (``None``: slot ``i``), every
        layer (``layer`` None: lists per layer) or one; see
        :meth:`~hcache.slots.mamba.MambaCacheManager.write_states`."""
        L = self.num_layers
        layers = list(range(L)) if layer is None else [check_index("layer", layer, L)]
        pairs, n = [], None
        given = [k for k in STATE_KINDS if states[k] is not None]
        if not given:
            raise ValueError("recurrent: expected states to write (recurrent, conv or both), "
                             "got None for both")
        for kind in given:
            views = self._views[kind]
            if not views:
                raise ValueError(f"{kind}: expected None (the layers have no {kind} state), "
                                 f"got {type(states[kind]).__name__}")
            arrays = self._per_layer(kind, states[kind], layer, L)
            for j, (value, dst_layer) in enumerate(zip(arrays, layers, strict=True)):
                where = kind if layer is not None else f"{kind}[{j}]"
                rows = self._check_rows(where, value, views[dst_layer], n, stream)
                n = rows.shape[0]
                pairs.append((rows, views[dst_layer]))
        if n > self._max_batch:
            raise ValueError(f"{given[0]}: expected at most {self._max_batch} rows, got {n}")
        slot_index = self._check_slots(slots, n, stream)
        table = self._sets[("all" if layer is None else "one", tuple(given))]
        with launch_scope(self._device, stream):
            if n == 0:
                return
            table.rebind(pairs, stream=stream)
            if isinstance(slot_index, np.ndarray):
                upload_ints(self._slots, slot_index)
                slot_index = self._slots
            ops.slot_copy(table, self._rows[:n], slot_index, stream=stream)

    def broadcast(self, saved: dict, slots: np.ndarray, stream) -> None:
        """Slot 0 of every saved state (``[1, *slot_shape]`` per layer) -> every slot of
        ``slots`` (host, distinct, checked), every layer, one launch."""
        given = tuple(k for k in STATE_KINDS if saved.get(k))
        n = len(slots)
        with launch_scope(self._device, stream):
            if not given or n == 0:
                return
            table = self._sets[("all", given)]
            table.rebind([(t, v) for k in given for t, v in zip(saved[k], self._views[k],
                                                                  strict=True)], stream=stream)
            upload_ints(self._slots, slots)
            ops.slot_copy(table, self._zeros[:n], self._slots, stream=stream)

    # --- checks -------------------------------------------------------------------------

    @staticmethod
    def _per_layer(kind, value, layer, num_layers) -> list:
        if layer is not None:
            return [value]
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise TypeError(f"{kind}: expected a list of {num_layers} arrays (layer=None: one "
                            f"per Mamba layer), got {type(value).__name__}")
        if len(value) != num_layers:
            raise ValueError(f"{kind}: expected {num_layers} arrays (one per Mamba layer), "
                             f"got {len(value)}")
        return list(value)

    def _check_rows(self, where, value, view, n, stream):
        rows = as_array(where, value, self._device, stream)
        slot_shape = tuple(view.shape[1:])
        if rows.ndim != 1 + len(slot_shape) or tuple(rows.shape[1:]) != slot_shape:
            raise ValueError(f"{where}: expected shape [rows, {', '.join(map(str, slot_shape))}]"
                             f", got {tuple(rows.shape)}")
        if n is not None and rows.shape[0] != n:
            raise ValueError(f"{where}: expected {n} rows (as the first array), "
                             f"got {rows.shape[0]}")
        if rows.dtype != view.dtype:
            raise ValueError(f"{where}: expected dtype {view.dtype}, got {rows.dtype}")
        if not rows.flags.c_contiguous:
            raise ValueError(f"{where}: expected a C-contiguous array")
        return rows

    def _check_slots(self, slots, n, stream):
        """Host slots -> checked int64 ``[n]``; a device int32 array -> itself (unchecked:
        the kernel skips out-of-range slots); ``None`` -> ``arange(n)``."""
        if slots is None:
            return np.arange(n)
        if self._device.is_cuda and on_device(slots):
            index = as_array("slots", slots, self._device, stream)
            if index.dtype != np.int32 or index.ndim != 1 or index.shape[0] != n \
                    or not index.flags.c_contiguous:
                raise ValueError(f"slots: expected a C-contiguous int32 array of shape ({n},), "
                                 f"got {index.dtype}{tuple(index.shape)}")
            return index
        index = index_array("slots", slots, self._max_batch, distinct=True)
        if len(index) != n:
            raise ValueError(f"slots: expected {n} slots (one per row), got {len(index)}")
        return index
