"""Per-layer KV caches for attention layers of any head count and head dim (docs/design.md §4).

The manager's layers are attention indices (docs/design.md §9): attention layer ``a`` owns one
C-contiguous cache ``[max_batch, C_a, H_a, S, D_a]``, HND: ``C_a = 2`` planes (K then V), or
``C_a = 1`` for a latent MLA layer (``components=1``: one ``kv_lora_rank + qk_rope_head_dim``
vector per token, ``H_a = 1``, no memory for a V). Layers are grouped by head dim and component
count in first-seen order; each group is a :class:`~hcache.ops.tables.KVGroup`, the unit of one
kernel launch (writes, compaction, capture, restore), whose ``layer_indices`` give the attention
index of each ``group_position``.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import check_index, check_int
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..config.caches import KVCacheConfig, KVLayerConfig
from ..device import as_array, launch_scope, resolve_device, zeros
from ..dtypes import is_fp8, storage_dtype
from ..memory import check_fits
from ..ops.tables import KVGroup, group_layers_by_head_dim
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
        b, s = config.max_batch_size, config.max_sequence_length
        with launch_scope(self._device, stream):
            self._caches = tuple(
                zeros(self._device, (b, lc.components, lc.num_kv_heads, s, lc.head_dim), dtype)
                for lc in config.layer_configs)
            self._groups = tuple(
                KVGroup([self._caches[a] for a in indices], layer_indices=indices)
                for indices in group_layers_by_head_dim(
                    [lc.head_dim for lc in config.layer_configs],
                    [lc.components for lc in config.layer_configs]))
            self._writer = KVWriter(self._device, self._caches, self._groups, config.dtype,
                                    config.max_sequence_length)

    # --- queries ----------------------------------------------------------------------------

    @property
    def config(self) -> KVCacheConfig:
        return self._config

    @property
    def device(self):
        return self._device

    @property
    def num_layers(self) -> int:
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
        """Layer ``i``'s cache, a view ``[max_batch, C_i, H_i, S, D_i]``: ``C_i = 2`` (K, V), or
        ``[max_batch, 1, 1, S, kv_lora_rank + qk_rope_head_dim]`` for a latent (MLA) layer,
        ``c_kv`` then ``k_pe`` in each row. Raises ``IndexError``."""
        return self._caches[check_index("i", i, self.num_layers)]

    def get_separate_kv_cache(self, i):
        """Layer ``i``'s K and V caches: strided views ``[max_batch, H_i, S, D_i]`` of the
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

    def get_layer_config(self, i) -> KVLayerConfig:
        """Layer ``i``'s :class:`KVLayerConfig`. Raises ``IndexError``."""
        return self._config.layer_configs[check_index("i", i, self.num_layers)]

    def memory_report(self) -> dict:
        """Device bytes: ``kv_cache`` (all layers), ``layer_infos`` (group descriptors),
        ``write_state`` (the staging buffers, status word and FP8 scale tables of
        :meth:`write_kv`), ``total`` and ``layers`` (per layer)."""
        layers = tuple(int(c.nbytes) for c in self._caches)
        infos = sum(g.nbytes for g in self._groups)
        writes = self._writer.nbytes
        return {"kv_cache": sum(layers), "layer_infos": infos, "write_state": writes,
                "total": sum(layers) + infos + writes, "layers": layers}

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
        head-dim group).

        Returns
        -------
        list of arrays ``[C_a, H_a, sequence_length, D_a]``
            One **newly allocated** array per layer (attention-index order), K plane then V
            plane (``[1, 1, n, D]`` for a latent layer): the cache's bytes (FP8 bytes for an
            FP8 cache).
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
            out = [xp.empty((c.shape[1], c.shape[2], n, c.shape[4]), dtype=c.dtype)
                   for c in self._caches]
            for group in self._groups:
                ops.kv_capture(group, b, n, [out[a] for a in group.layer_indices],
                               stream=stream)
            if tables is not None:
                return out, (tables[0].copy(), tables[1].copy())
        return out

    def restore_kv_cache(self, saved, b, stream=None, *, scales=None) -> None:
        """Write ``saved[i]`` into tokens ``[0, n)`` of slot ``b`` of layer ``i`` (one launch per
        head-dim group, in place; lengths are not touched).

        Parameters
        ----------
        saved : sequence of ``num_layers`` arrays ``[C_i, H_i, n, D_i]``
            One ``n`` for all layers, ``n <= max_sequence_length``; C-contiguous, of this device
            and the cache dtype.
        b : int
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
        saved = self._check_saved(saved, stream)
        if scales is not None:
            if not isinstance(scales, (tuple, list)) or len(scales) != 2:
                raise TypeError(f"scales: expected a (k_scales, v_scales) pair, "
                                f"got {type(scales).__name__}")
            for name, t in zip(("scales[0]", "scales[1]"), scales):
                self._writer.check_scale(name, t)
        with launch_scope(self._device, stream):
            for group in self._groups:
                ops.kv_restore(group, [saved[a] for a in group.layer_indices], b, stream=stream)
        if scales is not None:
            self._writer.set_scales(scales[0], scales[1], stream)

    def _check_saved(self, saved, stream) -> list:
        """``saved`` as a list of checked ``device.xp`` arrays (any array library)."""
        if isinstance(saved, (str, bytes)) or not hasattr(saved, "__len__"):
            raise TypeError(f"saved: expected a sequence of arrays, got {type(saved).__name__}")
        if len(saved) != self.num_layers:
            raise ValueError(f"saved: expected {self.num_layers} tensors, got {len(saved)}")
        n, out = None, []
        for i, (t, cache) in enumerate(zip(saved, self._caches, strict=True)):
            t = as_array(f"saved[{i}]", t, self._device, stream)
            out.append(t)
            comps, heads, dim = cache.shape[1], cache.shape[2], cache.shape[4]
            if t.ndim != 4 or t.shape[0] != comps or t.shape[1] != heads or t.shape[3] != dim:
                raise ValueError(f"saved[{i}]: expected shape [{comps}, {heads}, n, {dim}], "
                                 f"got {tuple(t.shape)}")
            n = int(t.shape[2]) if n is None else n
            if t.shape[2] != n:
                raise ValueError(f"saved[{i}]: expected {n} tokens (as saved[0]), "
                                 f"got {t.shape[2]}")
            if n > self._config.max_sequence_length:
                raise ValueError(f"saved[{i}]: expected at most "
                                 f"{self._config.max_sequence_length} tokens, got {n}")
            if t.dtype != cache.dtype:
                raise ValueError(f"saved[{i}]: expected dtype {cache.dtype}, got {t.dtype}")
            if not t.flags.c_contiguous:
                raise ValueError(f"saved[{i}]: expected a C-contiguous array")
        return out
