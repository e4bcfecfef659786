"""Caches of a hybrid attention + Mamba model, routed by decoder layer (TensorRT-Edge-LLM's
HybridCacheManager; docs/design.md §4).

A :class:`HybridCacheManager` owns a :class:`~hcache.slots.kv.KVCacheManager` (one cache
per attention layer that owns one), a :class:`~hcache.slots.mamba.MambaCacheManager`
(one recurrent and conv state per Mamba layer, or none) and the shared batch state
(:class:`~hcache.slots.batch.BatchAPI`): one lengths array for every layer, compaction of KV,
Mamba states and lengths together, prompt-cache capture and restore.

Routing (docs/design.md §9 "index spaces"): the public methods take a decoder ``layer``; the
manager maps it to an ``attention_index`` (the KV sub-manager's layer) and a ``mamba_index``
(the Mamba sub-manager's layer). An ``ATTENTION_AND_MAMBA`` layer has both; a layer in
``kv_sharing`` has its owner's ``attention_index``; a ``NONE`` layer has neither (routing it
raises ``ValueError``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import check_index
from ..config.caches import HybridCacheConfig, LayerType
from ..config.routes import LayerRoutes
from ..memory import check_fits
from ..runtime.device import launch_scope, resolve_device
from .batch import BatchAPI
from .kv import KVCacheManager
from .mamba import MambaCacheManager

__all__ = ["HybridCacheManager", "KVHeadDimGroupView"]


@dataclass(frozen=True, eq=False)
class KVHeadDimGroupView:
    """What a caller needs to launch its own kernel over one head-dim group (compared and
    hashed by identity, since it holds a device array).

    Attributes
    ----------
    device_layer_infos : array, uint64 [num_layers, 3]
        The group's ``KVLayerInfo`` array on the device; valid for the manager's lifetime.
    num_layers, head_dim, max_kv_heads : int
    layer_indices : tuple of int
        ``layer_indices[group_position]``: the decoder layer that owns the cache in row
        ``group_position`` of ``device_layer_infos``.
    components : int
        2 (each cache ``[max_batch, 2, H, S, D]``) or 1 (latent MLA caches ``[max_batch, 1,
        1, S, D]``): one group never mixes the two.
    ring_windows : tuple of int
        Per group position, the ring window ``W`` of a ring-buffer layer (its ``max_seq_len``;
        position ``p`` at entry ``p mod W``) or 0 (unbounded); also the third word of each
        ``KVLayerInfo`` row.
    """

    device_layer_infos: object
    num_layers: int
    head_dim: int
    max_kv_heads: int
    layer_indices: tuple
    components: int = 2
    ring_windows: tuple = ()


class HybridCacheManager(BatchAPI):
    """KV caches, Mamba states and batch state of a hybrid model.

    Parameters
    ----------
    config : HybridCacheConfig
    stream : stream, optional
        Stream of the construction work.
    device : None, "cpu", "cuda" or "cuda:N"

    Raises
    ------
    TypeError
        ``config`` is not a :class:`HybridCacheConfig`.
    CacheCapacityError
        The caches do not fit in the memory available on the device
        (``config.nbytes``, :func:`hcache.memory.check_fits`); nothing is allocated.
    """

    def __init__(self, config, stream=None, *, device=None):
        if not isinstance(config, HybridCacheConfig):
            raise TypeError(f"config: expected HybridCacheConfig, got {type(config).__name__}")
        self._config = config
        device = resolve_device(device)
        check_fits("config", config.nbytes, device)
        self._kv = KVCacheManager(config.kv, stream, device=device)
        self._mamba = (MambaCacheManager(config.mamba, stream, device=device)
                       if config.mamba is not None else None)
        # decoder layer -> attention_index / mamba_index (None: the layer has no such cache)
        routes = LayerRoutes(config)
        self._attention_index_of, self._mamba_index_of = routes.attention_of, routes.mamba_of
        self._owner_layer = routes.owner_layers   # attention_index -> the owning layer
        self._group_views = tuple(
            KVHeadDimGroupView(g.device_layer_infos, g.num_layers, g.head_dim, g.max_kv_heads,
                               tuple(self._owner_layer[a] for a in g.layer_indices), g.components,
                               g.ring_windows)
            for g in self._kv.groups)
        states = self._mamba.state_tensors if self._mamba is not None else ()
        self._kv_writer = self._kv._writer   # write_kv (BatchAPI) through the KV sub-manager
        with launch_scope(device, stream):
            super().__init__(device, config.max_batch_size, config.kv.max_sequence_length,
                             kv_groups=self._kv.groups, slot_tensors=states)

    # --- routing ----------------------------------------------------------------------------

    @property
    def config(self) -> HybridCacheConfig:
        """The layout this manager was built from."""
        return self._config

    @property
    def num_layers(self) -> int:
        """Decoder layers, cache-less ones included."""
        return self._config.num_layers

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        """The KV sub-manager (its layers are attention indices)."""
        return self._kv

    @property
    def mamba_cache_manager(self) -> MambaCacheManager | None:
        """The Mamba sub-manager (its layers are Mamba indices), or ``None`` without Mamba
        layers."""
        return self._mamba

    def get_layer_type(self, i) -> LayerType:
        """Kind of decoder layer ``i``. Raises ``IndexError``."""
        return self._config.layer_types[check_index("i", i, self.num_layers)]

    def _route(self, layer, table, kind: str, name: str) -> int:
        """``table[layer]``, the sub-manager index of decoder layer ``layer`` (the caller's
        argument ``name``).

        Raises
        ------
        TypeError, IndexError
            ``layer`` is not an int in ``[0, num_layers)``.
        ValueError
            The layer has no cache of this ``kind``.
        """
        layer = check_index(name, layer, self.num_layers)
        index = table[layer]
        if index is None:
            raise ValueError(f"{name}: expected {kind} layer, got layer {layer} "
                             f"({self._config.layer_types[layer].name})")
        return index

    def _attention_index(self, layer, name: str = "i") -> int:
        return self._route(layer, self._attention_index_of, "an attention", name)

    def _kv_write_index(self, layer) -> int:
        """The attention index that ``write_kv(layer)`` writes: an attention layer that owns
        its cache (a shared layer's cache is its owner's to write)."""
        index = self._attention_index(layer, "layer")
        if self._owner_layer[index] != layer:
            raise ValueError(f"layer: expected a layer that owns its KV cache, got layer {layer}"
                             f", which shares layer {self._owner_layer[index]}'s (write that one)")
        return index

    def _mamba_index(self, layer) -> int:
        return self._route(layer, self._mamba_index_of, "a Mamba", "i")

    def get_combined_kv_cache(self, i):
        """KV cache read by decoder layer ``i`` (its owner's for a shared layer), a view
        ``[max_batch, 2, H, L, D]``, or ``[max_batch, 1, 1, L, kv_lora_rank +
        qk_rope_head_dim]`` for a latent (MLA) layer (``c_kv`` then ``k_pe``); ``L``:
        ``max_sequence_length``, or the window of a ring layer (see :meth:`get_ring_window`).

        Raises
        ------
        IndexError
            ``i`` out of range.
        ValueError
            Layer ``i`` has no attention.
        """
        return self._kv.get_combined_kv_cache(self._attention_index(i))

    def get_separate_kv_cache(self, i):
        """K and V caches of decoder layer ``i``: strided views ``[max_batch, H, L, D]``.
        Raises like :meth:`get_combined_kv_cache`, and ``ValueError`` for a latent (MLA) layer,
        which has no V."""
        index = self._attention_index(i)
        if self._kv.get_layer_config(index).components != 2:
            raise ValueError(f"i: expected a layer with separate K and V, got layer {int(i)}, a "
                             f"latent (MLA) layer (one component; use get_combined_kv_cache)")
        return self._kv.get_separate_kv_cache(index)

    def get_ring_window(self, i) -> int:
        """Ring window of the cache decoder layer ``i`` reads (0: unbounded). Raises like
        :meth:`get_combined_kv_cache`."""
        return self._kv.get_ring_window(self._attention_index(i))

    def ring_start(self, i, lengths=None, stream=None):
        """Entry of the oldest valid token of decoder layer ``i``'s ring for ``lengths``
        (default: the active slots' lengths, :meth:`get_kv_cache_lengths`, a device array:
        the result is then a new device array computed on ``stream``, no host sync); see
        :meth:`KVCacheManager.ring_start`."""
        index = self._attention_index(i)
        return self._kv.ring_start(index, self.get_kv_cache_lengths() if lengths is None
                                   else lengths, stream)

    def get_recurrent_state(self, i):
        """Recurrent state of decoder layer ``i``, a view ``[max_batch, heads, head_dim,
        state_size]``. Raises ``IndexError`` (range) or ``ValueError`` (not a Mamba layer, or
        a conv-only one: LFM2's short convolutions)."""
        mamba_index = self._mamba_index(i)   # raises before the sub-manager is touched
        if not self._mamba.config.has_recurrent_state:
            raise ValueError(f"i: expected a layer with a recurrent state, got layer {i}, a "
                             f"conv-only MAMBA layer (short convolution)")
        return self._mamba.get_recurrent_state(mamba_index)

    def get_conv_state(self, i):
        """Conv state of decoder layer ``i``, a view ``[max_batch, conv_dim, conv_kernel]``.
        Raises ``IndexError`` (range) or ``ValueError`` (not a Mamba layer, or one without a
        conv state: MiniMax's lightning attention)."""
        mamba_index = self._mamba_index(i)
        if not self._mamba.config.has_conv_state:
            raise ValueError(f"i: expected a layer with a conv state, got layer {i}, a MAMBA "
                             f"layer with a recurrent state only (lightning attention)")
        return self._mamba.get_conv_state(mamba_index)

    def get_kv_scales(self):
        """FP8 scale tables ``(k_scales, v_scales)``, float32 views ``[num_kv_layers,
        max_kv_heads]`` by attention index; see :meth:`KVCacheManager.get_kv_scales`."""
        return self._kv.get_kv_scales()

    def set_kv_scales(self, k_scale=None, v_scale=None, stream=None) -> None:
        """Record FP8 scales for every cache-owning attention layer; see
        :meth:`KVCacheManager.set_kv_scales`."""
        self._kv.set_kv_scales(k_scale, v_scale, stream)

    def skipped_kv_write_count(self, stream=None) -> int:
        """Tokens :meth:`write_kv` skipped as out of range so far (device positions, unknown
        lengths). **Synchronizes** ``stream``."""
        return self._kv.skipped_kv_write_count(stream)

    def get_kv_head_dim_groups(self) -> list:
        """One :class:`KVHeadDimGroupView` per head dim (and component count), in first-seen
        order."""
        return list(self._group_views)

    def memory_report(self) -> dict:
        """Device bytes per component (``kv_cache``, ``recurrent``, ``conv``, ``metadata``:
        lengths, plan, descriptor tables and write staging), ``total``, and ``layers``: per
        decoder layer, the cache bytes it owns (0 for shared and cache-less layers);
        ``kv_cache_unbounded``: the KV bytes without ring buffers (not in ``total``)."""
        kv = self._kv.memory_report()
        mamba = self._mamba.memory_report() if self._mamba is not None else \
            {"recurrent": 0, "conv": 0, "layers": ()}
        layers = []
        for layer in range(self.num_layers):
            own = 0
            attention_index = self._attention_index_of[layer]
            if attention_index is not None and self._owner_layer[attention_index] == layer:
                own += kv["layers"][attention_index]
            mamba_index = self._mamba_index_of[layer]
            if mamba_index is not None:
                own += mamba["layers"][mamba_index]
            layers.append(own)
        metadata = kv["layer_infos"] + kv["write_state"] + self.batch_state_nbytes + (
            self._mamba.metadata_nbytes if self._mamba is not None else 0)
        report = {"kv_cache": kv["kv_cache"], "recurrent": mamba["recurrent"],
                  "conv": mamba["conv"], "metadata": metadata}
        report["total"] = sum(report.values())
        report["layers"] = tuple(layers)
        report["kv_cache_unbounded"] = kv["kv_cache_unbounded"]
        return report

    # --- prompt cache -----------------------------------------------------------------------

    def capture_kv_cache(self, b, sequence_length, stream=None, *, with_scales=False):
        """Tokens ``[0, sequence_length)`` of slot ``b``, one **new** ``[C_i, H_i, m_i, D_i]``
        array (``[1, 1, m_i, D_i]`` for a latent layer) per cache-owning attention layer
        (attention-index order, which is decoder-layer order; one launch per head-dim group; a
        ring layer gives its last ``m_i = min(n, W)`` positions in order); with ``with_scales``
        (FP8) also copies of the scale tables. See :meth:`KVCacheManager.capture_kv_cache`.

        Raises
        ------
        ValueError
            Besides the sub-manager's: a ring layer no longer holds the requested tokens
            (the slot's known length is past its window and differs from ``sequence_length``).
        """
        rings = [w for w in self._config.kv.layer_ring_windows if w]
        if rings and isinstance(b, (int, np.integer)) and not isinstance(b, bool) \
                and 0 <= b < self._config.max_batch_size and self._known[b] \
                and isinstance(sequence_length, (int, np.integer)):
            have, n = int(self._host_lengths[b]), int(sequence_length)
            if have > min(rings) and n != have:
                raise ValueError(f"sequence_length: expected {have} (slot {b}'s length: its "
                                 f"ring layers hold only the last {min(rings)} tokens), "
                                 f"got {n}")
        return self._kv.capture_kv_cache(b, sequence_length, stream, with_scales=with_scales)

    def restore_kv_cache(self, saved, b, stream=None, *, scales=None,
                         sequence_length=None) -> None:
        """Inverse of :meth:`capture_kv_cache` into slot ``b`` (lengths untouched; validates
        everything first; ``scales`` as captured, FP8; ``sequence_length`` needed only when
        every layer is a full ring). See :meth:`KVCacheManager.restore_kv_cache`."""
        self._kv.restore_kv_cache(saved, b, stream, scales=scales,
                                  sequence_length=sequence_length)

    def capture_recurrent_states(self, b, stream=None) -> list:
        """Slot ``b``'s recurrent state per Mamba layer (**new** ``[1, ...]`` arrays; empty
        without Mamba layers or recurrent states). Raises ``IndexError`` for a bad slot."""
        if self._mamba is None:
            check_index("b", b, self._config.max_batch_size)
            return []
        return self._mamba.capture_recurrent_states(b, stream)

    def capture_conv_states(self, b, stream=None) -> list:
        """Slot ``b``'s conv state per Mamba layer (**new** ``[1, ...]`` arrays; empty without
        Mamba layers or conv states). Raises ``IndexError`` for a bad slot."""
        if self._mamba is None:
            check_index("b", b, self._config.max_batch_size)
            return []
        return self._mamba.capture_conv_states(b, stream)

    def write_states(self, layer, recurrent=None, conv=None, *, slots=None,
                     stream=None) -> None:
        """Write new recurrent / conv states of a batch into their slots: row ``i`` -> slot
        ``slots[i]`` (None: slot ``i``), of decoder layer ``layer`` (a Mamba layer) or, with
        ``layer=None``, of every Mamba layer (lists, one array per Mamba layer in decoder
        order). One launch, no allocation, no sync; lengths untouched. See
        :meth:`MambaCacheManager.write_states` (same arrays, same errors)."""
        index = None if layer is None else self._route(layer, self._mamba_index_of,
                                                       "a Mamba", "layer")
        if self._mamba is None:
            raise ValueError("layer: expected a model with Mamba layers, got one without")
        self._mamba.write_states(index, recurrent, conv, slots=slots, stream=stream)

    def restore_mamba_states(self, recurrent, conv, b, stream=None) -> None:
        """Write saved recurrent and conv states into slot ``b`` of every Mamba layer (one
        launch; validates everything first). See :meth:`MambaCacheManager.restore_states`."""
        if self._mamba is None:
            check_index("b", b, self._config.max_batch_size)
            for name, t in (("recurrent", recurrent), ("conv", conv)):
                if isinstance(t, (str, bytes)) or not hasattr(t, "__len__"):
                    raise TypeError(f"{name}: expected a sequence of arrays, "
                                    f"got {type(t).__name__}")
                if len(t):
                    raise ValueError(f"{name}: expected 0 tensors, got {len(t)}")
            return
        self._mamba.restore_states(recurrent, conv, b, stream)
