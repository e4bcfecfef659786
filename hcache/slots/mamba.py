"""Recurrent (Mamba / state-space / gated delta-net) states of every slot (docs/design.md §4).

One buffer per kind, ``recurrent [L, max_batch, num_heads, head_dim, state_size]`` and
``conv [L, max_batch, conv_dim, conv_kernel]``, zeroed at construction; a kind the layers do not
have (short convolutions have no recurrent state, lightning attention no conv state) has no
buffer, and every copy covers only the kinds that exist. The manager's layers are Mamba indices
(docs/design.md §9): Mamba layer ``m``'s state is the C-contiguous view ``buffer[m]``. Every
multi-layer copy (compaction, capture, restore) is one :func:`hcache.ops` launch over a
:class:`~hcache.ops.tables.SlotSet` of all layers.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import check_index
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..config.caches import MambaCacheConfig
from ..dtypes import storage_dtype
from ..memory import check_fits
from ..ops.tables import SlotSet
from ..runtime.arrays import as_array
from ..runtime.device import launch_scope, resolve_device, settle, zeros
from .state_writes import STATE_KINDS, StateWriter

__all__ = ["MambaCacheManager"]


class MambaCacheManager:
    """Per-layer recurrent and conv states ``[max_batch, ...]``, zeroed at construction.

    Parameters
    ----------
    config : MambaCacheConfig
    stream : stream, optional
        Stream of the construction work (zeroing, descriptor uploads).
    device : None, "cpu", "cuda" or "cuda:N"

    Raises
    ------
    TypeError
        ``config`` is not a :class:`MambaCacheConfig`.
    CacheCapacityError
        The caches do not fit in the memory available on the device
        (``config.nbytes``, :func:`hcache.memory.check_fits`); nothing is allocated.
    """

    __copy__, __deepcopy__, __reduce_ex__ = refuse_copy, refuse_deepcopy, refuse_pickle

    def __init__(self, config, stream=None, *, device=None):
        if not isinstance(config, MambaCacheConfig):
            raise TypeError(f"config: expected MambaCacheConfig, got {type(config).__name__}")
        self._config = config
        self._device = resolve_device(device)
        check_fits("config", config.nbytes, self._device)
        xp = self._device.xp
        n, b = config.num_layers, config.max_batch_size
        with launch_scope(self._device, stream):
            # None: the layers have no state of this kind (nothing allocated, nothing copied).
            self._recurrent = (zeros(self._device, (n, b) + config.recurrent_state_shape,
                                     storage_dtype(config.ssm_dtype, xp))
                               if config.has_recurrent_state else None)
            self._conv = (zeros(self._device, (n, b) + config.conv_state_shape,
                                storage_dtype(config.conv_dtype, xp))
                          if config.has_conv_state else None)
            self._recurrent_views = (tuple(self._recurrent[i] for i in range(n))
                                     if self._recurrent is not None else ())
            self._conv_views = (tuple(self._conv[i] for i in range(n))
                                if self._conv is not None else ())
            self._slot_idx = xp.zeros(1, dtype=np.int32)
            self._zero_idx = xp.zeros(1, dtype=np.int32)
            self._capture_sets = {}
            self._restore_set = None
            if n:
                self._capture_sets = {
                    kind: SlotSet([(v, v) for v in views])
                    for kind, views in (("recurrent", self._recurrent_views),
                                        ("conv", self._conv_views)) if views}
                self._restore_set = SlotSet([(v, v) for v in self.state_tensors])
            every_layer = {(kind,): table for kind, table in self._capture_sets.items()}
            if len(self._capture_sets) == 2:
                every_layer[STATE_KINDS] = self._restore_set
            self._state_writer = StateWriter(
                self._device, {"recurrent": self._recurrent_views, "conv": self._conv_views},
                b, every_layer)
            settle(self._device)

    # --- queries ----------------------------------------------------------------------------

    @property
    def config(self) -> MambaCacheConfig:
        """The layout this manager was built from."""
        return self._config

    @property
    def device(self):
        """The resolved device."""
        return self._device

    @property
    def num_layers(self) -> int:
        """Mamba layers (the manager's layers are Mamba indices)."""
        return self._config.num_layers

    @property
    def state_tensors(self) -> tuple:
        """Every per-layer state view that exists, recurrent then conv (``[max_batch, ...]``
        each)."""
        return self._recurrent_views + self._conv_views

    def get_recurrent_state(self, i):
        """Layer ``i``'s recurrent state, a view ``[max_batch, num_heads, head_dim,
        state_size]`` (``ssm_dtype``).

        Raises
        ------
        IndexError
            ``i`` out of range.
        ValueError
            The layers have no recurrent state (short-convolution layers).
        """
        i = check_index("i", i, self.num_layers)
        if self._recurrent is None:
            raise ValueError(f"i: expected a layer with a recurrent state, got layer {i}, a "
                             f"conv-only layer (short convolution)")
        return self._recurrent_views[i]

    def get_conv_state(self, i):
        """Layer ``i``'s conv state, a view ``[max_batch, conv_dim, conv_kernel]``
        (``conv_dtype``).

        Raises
        ------
        IndexError
            ``i`` out of range.
        ValueError
            The layers have no conv state (lightning-attention layers).
        """
        i = check_index("i", i, self.num_layers)
        if self._conv is None:
            raise ValueError(f"i: expected a layer with a conv state, got layer {i}, with a "
                             f"recurrent state only (lightning attention)")
        return self._conv_views[i]

    @property
    def metadata_nbytes(self) -> int:
        """Device bytes of the slot indices and descriptor tables of the one-launch copies
        (``memory_report()["metadata"]``)."""
        tables = list(self._capture_sets.values()) + (
            [self._restore_set] if self._restore_set is not None else [])
        return int(self._slot_idx.nbytes + self._zero_idx.nbytes
                   + sum(t.device_infos.nbytes for t in tables) + self._state_writer.nbytes)

    def memory_report(self) -> dict:
        """Device bytes: ``recurrent``, ``conv`` (0 for a kind the layers do not have),
        ``metadata`` (:attr:`metadata_nbytes`), ``total`` (all three: ``config.nbytes``) and
        ``layers`` (states per layer)."""
        n = self.num_layers
        recurrent, conv = (int(x.nbytes) if x is not None else 0
                           for x in (self._recurrent, self._conv))
        return {"recurrent": recurrent, "conv": conv, "metadata": self.metadata_nbytes,
                "total": recurrent + conv + self.metadata_nbytes,
                "layers": ((recurrent + conv) // n if n else 0,) * n}

    # --- commands ---------------------------------------------------------------------------

    def _buffers(self) -> list:
        return [x for x in (self._recurrent, self._conv) if x is not None]

    def clear_states(self, stream=None) -> None:
        """Zero every state of every layer and slot (in place)."""
        with launch_scope(self._device, stream):
            for buffer in self._buffers():
                buffer.fill(0)

    def clear_slot(self, b, stream=None) -> None:
        """Zero slot ``b`` of every layer (in place). Raises ``IndexError`` for a bad slot."""
        b = check_index("b", b, self._config.max_batch_size)
        with launch_scope(self._device, stream):
            for buffer in self._buffers():
                buffer[:, b] = 0

    def capture_recurrent_states(self, b, stream=None) -> list:
        """Copy slot ``b``'s recurrent state of every layer (one launch).

        Returns
        -------
        list of arrays ``[1, num_heads, head_dim, state_size]``
            One per layer: views of one **newly allocated** ``[L, 1, ...]`` array; empty when
            the layers have no recurrent state.
        """
        return self._capture("recurrent", self._recurrent_views, b, stream)

    def capture_conv_states(self, b, stream=None) -> list:
        """Copy slot ``b``'s conv state of every layer (one launch).

        Returns
        -------
        list of arrays ``[1, conv_dim, conv_kernel]``
            One per layer: views of one **newly allocated** ``[L, 1, ...]`` array; empty when
            the layers have no conv state.
        """
        return self._capture("conv", self._conv_views, b, stream)

    def _capture(self, kind, views, b, stream) -> list:
        b = check_index("b", b, self._config.max_batch_size)
        buffer = self._recurrent if kind == "recurrent" else self._conv
        n = self.num_layers
        with launch_scope(self._device, stream):   # the stream is checked even with no state
            if buffer is None:
                return []
            out = self._device.xp.empty((n, 1) + buffer.shape[2:], dtype=buffer.dtype)
            if n:
                slots = self._capture_sets[kind]
                slots.rebind([(src, out[i]) for i, src in enumerate(views)], stream=stream)
                self._slot_idx.fill(b)
                ops.slot_copy(slots, self._slot_idx, self._zero_idx, stream=stream)
        return [out[i] for i in range(n)]

    def write_states(self, layer, recurrent=None, conv=None, *, slots=None,
                     stream=None) -> None:
        """Write new states of a batch into their slots, in place: row ``i`` goes to slot
        ``slots[i]``, for every layer or one. One launch for every written tensor (recurrent
        and conv, every layer: one slot-copy launch moves bytes of any dtype); no allocation,
        no sync; everything is checked before anything is written.

        Parameters
        ----------
        layer : int or None
            The Mamba layer written, or ``None`` for every one (``recurrent`` / ``conv`` are
            then lists, one array per layer).
        recurrent : array ``[rows, num_heads, head_dim, state_size]``, list of them, or None
            New recurrent states (``ssm_dtype``; its storage dtype on cuda), C-contiguous, this
            device's memory (any array protocol, no copy). None: not written.
        conv : array ``[rows, conv_dim, conv_kernel]``, list of them, or None
            New conv states (``conv_dtype``), as ``recurrent``. At least one of the two.
        slots : host ints [rows], device int32 [rows], or None
            Target slot of each row. Host slots are checked (in ``[0, max_batch)``, distinct)
            and staged; a device array is read at launch (an out-of-range slot is skipped).
            None: row ``i`` -> slot ``i``.
        stream : optional

        Raises
        ------
        TypeError, IndexError, ValueError
            A bad layer, a state the layers do not have, an array of the wrong module, shape,
            dtype or layout, row counts that differ, more rows than slots, bad or repeated
            slots, a bad stream. Nothing is written.
        """
        self._state_writer.write(layer, {"recurrent": recurrent, "conv": conv}, slots, stream)

    def restore_states(self, recurrent, conv, b, stream=None) -> None:
        """Write saved states into slot ``b`` of every layer (one launch, in place).

        Parameters
        ----------
        recurrent, conv : sequences of ``num_layers`` arrays
            Each ``[1, *slot_shape]`` (as captured) or ``[*slot_shape]``, C-contiguous, of this
            device and of the state's dtype; empty for a kind the layers do not have.
        b : int
            Target slot.

        Raises
        ------
        IndexError
            ``b`` out of range.
        TypeError, ValueError
            A wrong count, array module, shape, dtype or layout in any tensor; every tensor is
            checked before anything is written.
        """
        self._restore(recurrent, conv, b, stream, "recurrent")

    def _restore(self, recurrent, conv, b, stream, recurrent_name) -> None:
        """:meth:`restore_states`, the recurrent states named as the caller passed them."""
        b = check_index("b", b, self._config.max_batch_size)
        saved = (self._check_saved(recurrent_name, recurrent, self._recurrent_views, stream)
                 + self._check_saved("conv", conv, self._conv_views, stream))
        with launch_scope(self._device, stream):   # the stream is checked even with no state
            if not saved:
                return
            self._restore_set.rebind(list(zip(saved, self.state_tensors, strict=True)),
                                    stream=stream)
            self._slot_idx.fill(b)
            ops.slot_copy(self._restore_set, self._zero_idx, self._slot_idx, stream=stream)

    def _check_saved(self, name, tensors, views, stream) -> list:
        if isinstance(tensors, (str, bytes)) or not hasattr(tensors, "__len__"):
            raise TypeError(f"{name}: expected a sequence of arrays, got "
                            f"{type(tensors).__name__}")
        if len(tensors) != len(views):
            raise ValueError(f"{name}: expected {len(views)} tensors, got {len(tensors)}")
        out = []
        for i, (t, view) in enumerate(zip(tensors, views, strict=True)):
            where = f"{name}[{i}]"
            t = as_array(where, t, self._device, stream)
            slot_shape = tuple(view.shape[1:])
            if tuple(t.shape) not in ((1,) + slot_shape, slot_shape):
                raise ValueError(f"{where}: expected shape {(1,) + slot_shape}, "
                                 f"got {tuple(t.shape)}")
            if t.dtype != view.dtype:
                raise ValueError(f"{where}: expected dtype {view.dtype}, got {t.dtype}")
            if not t.flags.c_contiguous:
                raise ValueError(f"{where}: expected a C-contiguous array")
            out.append(t.reshape((1,) + slot_shape))
        return out
