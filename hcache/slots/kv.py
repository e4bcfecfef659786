"""Per-layer KV caches for attention layers of any head count and head dim (docs/design.md §4).

The manager's layers are attention indices (docs/design.md §9): attention layer ``a`` owns one
C-contiguous cache ``[max_batch, C_a, H_a, L_a, D_a]``, HND: ``C_a = 2`` planes (K then V), or
``C_a = 1`` for a latent MLA layer (``components=1``: one ``kv_lora_rank + qk_rope_head_dim``
vector per token, ``H_a = 1``, no memory for a V). ``L_a`` = ``config.layer_cache_lengths[a]``:
``max_sequence_length``, or a sliding-window layer's window ``W`` when it is a ring buffer
(position ``p`` at entry ``p mod W``; docs/design.md §4.10). Layers are grouped by head dim and
component count in first-seen order (ring and unbounded layers together); each group is a
:class:`~hcache.ops.tables.KVGroup`, the unit of one kernel launch (writes, compaction, capture,
restore), whose ``layer_indices`` give the attention index of each ``group_position``.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import check_index, check_int
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..config.caches import KVCacheConfig, KVLayerConfig
from ..dtypes import is_fp8, storage_dtype
from ..memory import check_fits
from ..ops.kv_capture import prefix_length
from ..ops.tables import KVGroup, group_layers_by_head_dim
from ..rings import ring_start
from ..runtime.arrays import as_array
from ..runtime.device import launch_scope, resolve_device, settle, zeros
from .kv_writes import KVWriter

__all__ = ["KVCacheManager"]


class KVCacheManager:
    """One KV cache per attention layer, allocated (zeroed) once at construction.

    Parameters
    ----------
    config : KVCacheConfig
    stream : stream, optional
        Stream of the construction work.
    device : None, "cpu", "cuda" or "cuda:N"

    Raises
    ------
    TypeError
        ``config`` is not a :class:`KVCacheConfig`.
    CacheCapacityError
        The caches do not fit in the memory available on the device
        (``config.nbytes``, :func:`hcache.memory.check_fits`); nothing is allocated.
    """

    __copy__, __deepcopy__, __reduce_ex__ = refuse_copy, refuse_deepcopy, refuse_pickle

    def __init__(self, config, stream=None, *, device=None):
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected KVCacheConfig, got {type(config).__name__}")
        self._config = config
        self._device = resolve_device(device)
        check_fits("config", config.nbytes, self._device)
        xp = self._device.xp
        dtype = storage_dtype(config.dtype, xp)
        b = config.max_batch_size
        rings = config.layer_ring_windows
        with launch_scope(self._device, stream):
            self._caches = tuple(
                zeros(self._device, (b, lc.components, lc.num_kv_heads, s, lc.head_dim), dtype)
                for lc, s in zip(config.layer_configs, config.layer_cache_lengths))
            # ring and unbounded layers of one (head dim, components) share a group (one launch)
            self._groups = tuple(
                KVGroup([self._caches[a] for a in indices], layer_indices=indices,
                        ring_windows=[rings[a] for a in indices])
                for indices in group_layers_by_head_dim(
                    [lc.head_dim for lc in config.layer_configs],
                    [lc.components for lc in config.layer_configs]))
            self._writer = KVWriter(self._device, self._caches, self._groups, config.dtype,
                                    config.max_sequence_length, ring_windows=rings)
            settle(self._device)

    # --- queries ----------------------------------------------------------------------------

    @property
    def config(self) -> KVCacheConfig:
        """The layout this manager was built from."""
        return self._config

    @property
    def device(self):
        """The resolved device."""
        return self._device

    @property
    def num_layers(self) -> int:
        """Attention layers (each owns one cache)."""
        return len(self._caches)

    @property
    def is_uniform(self) -> bool:
        """True when every layer has the same ``(num_kv_heads, head_dim, components)`` (or there
        are none)."""
        return len({(lc.num_kv_heads, lc.head_dim, lc.components)
                    for lc in self._config.layer_configs}) <= 1

    @property
    def groups(self) -> tuple:
        """The head-dim groups (:class:`~hcache.ops.tables.KVGroup`, first-seen order of
        ``(head dim, components)``; ``layer_indices[group_position]`` is an attention index)."""
        return self._groups

    def get_combined_kv_cache(self, i):
        """Layer ``i``'s cache, a view ``[max_batch, C_i, H_i, L_i, D_i]``: ``C_i = 2`` (K, V),
        or ``[max_batch, 1, 1, L_i, kv_lora_rank + qk_rope_head_dim]`` for a latent (MLA)
        layer, ``c_kv`` then ``k_pe`` in each row. ``L_i``: the ``max_sequence_length``, or the
        window ``W`` of a ring layer, whose valid entries are ``min(length, W)`` in rotated
        order, see :meth:`ring_start`. Raises ``IndexError``."""
        return self._caches[check_index("i", i, self.num_layers)]

    def get_separate_kv_cache(self, i):
        """Layer ``i``'s K and V caches: strided views ``[max_batch, H_i, L_i, D_i]`` of the
        combined cache (``cache[:, 0]`` and ``cache[:, 1]``).

        Raises
        ------
        IndexError
            ``i`` out of range.
        ValueError
            Layer ``i`` is a latent (MLA) layer: it has no V (use :meth:`get_combined_kv_cache`).
        """
        cache = self.get_combined_kv_cache(i)
        if cache.shape[1] != 2:
            raise ValueError(f"i: expected a layer with separate K and V, got layer {int(i)}, a "
                             f"latent (MLA) layer (one component; use get_combined_kv_cache)")
        return cache[:, 0], cache[:, 1]

    def get_ring_window(self, i) -> int:
        """Layer ``i``'s ring window ``W`` (its cache holds the last ``W`` tokens, position
        ``p`` at entry ``p mod W``), or 0 for an unbounded cache. Raises ``IndexError``."""
        return self._config.layer_ring_windows[check_index("i", i, self.num_layers)]

    def ring_start(self, i, lengths, stream=None):
        """The entry of the oldest valid token of layer ``i`` for sequences of ``lengths``
        tokens: ``lengths % W`` once ``lengths > W``, else 0 (always 0 for an unbounded layer).
        Entries ``ring_start, ..., W - 1, 0, ..., ring_start - 1`` hold positions ``length -
        min(length, W)`` onward, in order; an attention over all cached tokens may ignore the
        rotation (it is order-invariant once keys are rotated), a kernel that needs order reads
        from here.

        Parameters
        ----------
        i : int
            Attention index.
        lengths : int or int array (host, or this device's memory; any array library)
            Absolute sequence lengths (e.g. :meth:`~hcache.slots.batch.BatchAPI.
            get_kv_cache_lengths`).

        stream : stream, optional
            For device lengths: the stream of the computation, chained after the manager's
            earlier work (its length commits) on other streams.

        Returns
        -------
        int or array of the same shape and module (int32 for a device array)
            Device lengths are read on the device and give a new device array (an elementwise
            kernel on ``stream``: no host read or sync; it allocates, so not in a capture).
        """
        return ring_start(lengths, self.get_ring_window(i), self._device, stream,
                          order=self._writer.order)

    def get_layer_config(self, i) -> KVLayerConfig:
        """Layer ``i``'s :class:`KVLayerConfig`. Raises ``IndexError``."""
        return self._config.layer_configs[check_index("i", i, self.num_layers)]

    def memory_report(self) -> dict:
        """Device bytes: ``kv_cache`` (all layers), ``layer_infos`` (group descriptors),
        ``write_state`` (the staging buffers, status word and FP8 scale tables of
        :meth:`write_kv`), ``total`` and ``layers`` (per layer); ``kv_cache_unbounded``:
        what ``kv_cache`` would be with every layer at ``max_sequence_length`` (equal to
        ``kv_cache`` without ring layers), so ``kv_cache / kv_cache_unbounded`` is the saving
        of the ring buffers."""
        layers = tuple(int(c.nbytes) for c in self._caches)
        infos = sum(g.nbytes for g in self._groups)
        writes = self._writer.nbytes
        s = self._config.max_sequence_length
        unbounded = sum(int(c.nbytes) // int(c.shape[3]) * s for c in self._caches)
        return {"kv_cache": sum(layers), "layer_infos": infos, "write_state": writes,
                "total": sum(layers) + infos + writes, "layers": layers,
                "kv_cache_unbounded": unbounded}

    # --- batched writes (docs/design.md §4.9) -------------------------------------------------

    def write_kv(self, layer, k, v=None, *, seq_lengths=None, positions=None, k_scale=None,
                 v_scale=None, stream=None) -> None:
        """Write new tokens' K/V at explicit positions, in place: row ``b`` is slot ``b``.

        This manager keeps no lengths, so ``positions`` is required; otherwise as
        :meth:`hcache.slots.batch.BatchAPI.write_kv` (``HybridCacheManager.write_kv``), with
        ``batch`` the rows of ``k`` (at most ``max_batch``) and ``layer`` an attention index
        (or ``None``: every layer, one launch per head-dim group).

        Parameters
        ----------
        layer : int or None
        k, v : arrays ``[batch, new_tokens, H_a, D_a]`` or ragged ``[total_tokens, H_a, D_a]``
            A latent layer's rows are ``k`` and its ``v`` is None (with ``layer=None``: None in
            its place in the list, or ``v=None`` when every layer is latent).
        seq_lengths : host ints [batch], optional
        positions : ints shaped like ``k``'s leading axes
            Host ints (checked: in ``[-1, max_sequence_length)``, -1 skips a token, distinct
            within a row) or a device int32 array (unchecked; out-of-range tokens are skipped
            and counted, see :meth:`skipped_kv_write_count`).
        k_scale, v_scale : None, float, or float32 device array [num_layers] or
            [num_layers, >= H]; FP8 caches written from float rows only.
        stream : optional

        Raises
        ------
        TypeError, IndexError, ValueError
            ``positions`` missing, or anything ``BatchAPI.write_kv`` refuses; nothing changes.
        """
        index = None if layer is None else check_index("layer", layer, self.num_layers)
        self._writer.write(index, k, v, seq_lengths=seq_lengths, positions=positions,
                           k_scale=k_scale, v_scale=v_scale, stream=stream)

    def get_kv_scales(self):
        """The FP8 scale tables ``(k_scales, v_scales)``: float32 views ``[num_layers,
        max_kv_heads]`` (1.0 at construction) holding the scale each layer's latest write
        divided by; an attention kernel dequantizes head ``h`` of layer ``a`` as ``q *
        scales[a, h]``. Raises ``ValueError`` unless the cache is FP8."""
        return self._writer.scales()

    def set_kv_scales(self, k_scale=None, v_scale=None, stream=None) -> None:
        """Record scales for every layer (a float, or a float32 device array ``[num_layers]``
        or ``[num_layers, >= max_kv_heads]``; ``None`` keeps one), used by later
        :meth:`write_kv` calls without a scale. Raises ``ValueError`` / ``TypeError`` (not
        FP8, a bad scale) before recording anything."""
        self._writer.set_scales(k_scale, v_scale, stream)

    def skipped_kv_write_count(self, stream=None) -> int:
        """Tokens that :meth:`write_kv` skipped as out of range (device positions), so far.
        **Synchronizes** ``stream``."""
        return self._writer.skipped_count(stream)

    # --- prompt-cache capture / restore -----------------------------------------------------

    def capture_kv_cache(self, b, sequence_length, stream=None, *, with_scales=False):
        """Copy tokens ``[0, sequence_length)`` of slot ``b`` of every layer (one launch per
        head-dim group). A ring layer of window ``W`` gives the last ``m = min(sequence_length,
        W)`` positions in order, which it holds when ``sequence_length`` is the slot's length
        (or its ring has not wrapped past ``sequence_length``); this manager keeps no lengths,
        so that is the caller's to ensure.

        Returns
        -------
        list of arrays ``[C_a, H_a, m_a, D_a]``
            One **newly allocated** array per layer (attention-index order), K plane then V
            plane (``[1, 1, m_a, D]`` for a latent layer): the cache's bytes (FP8 bytes for an
            FP8 cache); ``m_a = sequence_length``, or ``min(sequence_length, W)`` for a ring
            layer.
        (list, (k_scales, v_scales))
            With ``with_scales=True`` (FP8 caches): also **new** copies of the scale tables
            (:meth:`get_kv_scales`) that dequantize the captured bytes.

        Raises
        ------
        IndexError
            ``b`` out of range.
        TypeError, ValueError
            ``sequence_length`` not an int in ``[0, max_sequence_length]``; ``with_scales``
            for a cache that is not FP8.
        """
        b = check_index("b", b, self._config.max_batch_size)
        n = check_int("sequence_length", sequence_length, 0, self._config.max_sequence_length)
        if not isinstance(with_scales, (bool, np.bool_)):
            raise TypeError(f"with_scales: expected a bool, got {type(with_scales).__name__}")
        if with_scales and not is_fp8(self._config.dtype):
            raise ValueError(f"with_scales: expected False for a {self._config.dtype} cache "
                             "(scale tables are FP8's), got True")
        tables = self._writer.scales() if with_scales else None
        xp = self._device.xp
        with launch_scope(self._device, stream):
            out = [xp.empty((c.shape[1], c.shape[2], min(n, c.shape[3]), c.shape[4]),
                            dtype=c.dtype)
                   for c in self._caches]
            for group in self._groups:
                ops.kv_capture(group, b, n, [out[a] for a in group.layer_indices],
                               stream=stream)
            if tables is not None:
                return out, (tables[0].copy(), tables[1].copy())
        return out

    def restore_kv_cache(self, saved, b, stream=None, *, scales=None,
                         sequence_length=None) -> None:
        """Write ``saved[i]`` into tokens ``[0, n)`` of slot ``b`` of layer ``i`` (one launch per
        head-dim group, in place; lengths are not touched); a ring layer's ``min(n, W)``
        tokens go to their entries ``p mod W``.

        Parameters
        ----------
        saved : sequence of ``num_layers`` arrays ``[C_i, H_i, m_i, D_i]``
            As :meth:`capture_kv_cache` gives them for an ``n``-token prefix (``m_i = n``, or
            ``min(n, W)`` for a ring layer), ``n <= max_sequence_length``; C-contiguous, of this
            device and the cache dtype.
        b : int
        sequence_length : int, optional
            ``n``; read from ``saved`` by default (an unbounded layer's count, or a ring's count
            below its window), required when every layer is a ring holding its full window.
        scales : (k_scales, v_scales), optional
            FP8 caches: the scale tables of the capture (``with_scales=True``), recorded after
            the bytes (:meth:`set_kv_scales`). Scales are per layer, not per slot: they apply
            to every slot, so restore them into a manager whose other slots were written with
            the same scales (one model's calibrated scales), or re-quantize.

        Raises
        ------
        IndexError
            ``b`` out of range.
        TypeError, ValueError
            A wrong count, array module, shape, length, dtype or layout in any tensor, or
            ``scales`` that are not a pair of valid scale tables (or a cache that is not FP8);
            everything is checked before anything is written.
        """
        b = check_index("b", b, self._config.max_batch_size)
        saved, n = self._check_saved(saved, sequence_length, stream)
        if scales is not None:
            if not isinstance(scales, (tuple, list)) or len(scales) != 2:
                raise TypeError(f"scales: expected a (k_scales, v_scales) pair, "
                                f"got {type(scales).__name__}")
            for name, t in zip(("scales[0]", "scales[1]"), scales):
                self._writer.check_scale(name, t, stream)
        with launch_scope(self._device, stream):
            self._restore_groups(saved, b, n, None, stream)
        if scales is not None:
            self._writer.set_scales(scales[0], scales[1], stream)

    def _restore_groups(self, saved, b, n, more_slots, stream) -> None:
        """One ``kv_restore`` launch per head-dim group of checked ``saved`` into slot ``b``
        and the device slots ``more_slots`` (or None), in the caller's launch scope."""
        for group in self._groups:
            ops.kv_restore(group, [saved[a] for a in group.layer_indices], b, num_tokens=n,
                           more_slots=more_slots, stream=stream)

    def _check_saved(self, saved, sequence_length, stream) -> tuple:
        """``saved`` as a list of checked ``device.xp`` arrays (any array library) and the
        prefix length ``n`` they hold."""
        if isinstance(saved, (str, bytes)) or not hasattr(saved, "__len__"):
            raise TypeError(f"saved: expected a sequence of arrays, got {type(saved).__name__}")
        if len(saved) != self.num_layers:
            raise ValueError(f"saved: expected {self.num_layers} tensors, got {len(saved)}")
        out = []
        for i, (t, cache) in enumerate(zip(saved, self._caches, strict=True)):
            t = as_array(f"saved[{i}]", t, self._device, stream)
            out.append(t)
            comps, heads, dim = cache.shape[1], cache.shape[2], cache.shape[4]
            if t.ndim != 4 or t.shape[0] != comps or t.shape[1] != heads or t.shape[3] != dim:
                raise ValueError(f"saved[{i}]: expected shape [{comps}, {heads}, n, {dim}], "
                                 f"got {tuple(t.shape)}")
        if sequence_length is not None:
            check_int("sequence_length", sequence_length, 0, self._config.max_sequence_length)
        n = prefix_length(_Rings(self._config.layer_ring_windows), out, sequence_length,
                          "saved", "sequence_length")
        if n > self._config.max_sequence_length:
            raise ValueError(f"saved: expected at most {self._config.max_sequence_length} "
                             f"tokens, got {n}")
        for i, (t, cache) in enumerate(zip(out, self._caches, strict=True)):
            if t.dtype != cache.dtype:
                raise ValueError(f"saved[{i}]: expected dtype {cache.dtype}, got {t.dtype}")
            if not t.flags.c_contiguous:
                raise ValueError(f"saved[{i}]: expected a C-contiguous array")
        return out, n


class _Rings:
    """The ring windows of every layer, in the form :func:`prefix_length` reads (a group's)."""

    def __init__(self, windows):
        self.ring_windows = tuple(windows)

    def held_tokens(self, p: int, n: int) -> int:
        w = self.ring_windows[p]
        return min(n, w) if w else n
