"""Per-layer KV caches for attention layers of any head count and head dim (docs/design.md §4).

The manager's layers are attention indices (docs/design.md §9): attention layer ``a`` owns one
C-contiguous cache ``[max_batch, 2, H_a, S, D_a]`` (K plane then V plane, HND). Layers are
grouped by head dim in first-seen order; each group is a :class:`~hcache.ops.tables.KVGroup`,
the unit of one kernel launch (compaction, capture, restore), whose ``layer_indices`` give the
attention index of each ``group_position``.
"""

from __future__ import annotations

from .. import ops
from .._checks import check_index, check_int
from ..config.caches import KVCacheConfig, KVLayerConfig
from ..device import array_module_of, launch_scope, resolve_device
from ..dtypes import storage_dtype
from ..ops.tables import KVGroup, group_layers_by_head_dim

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
    """

    def __init__(self, config, stream=None, *, device=None):
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected KVCacheConfig, got {type(config).__name__}")
        self._config = config
        self._device = resolve_device(device)
        xp = self._device.xp
        dtype = storage_dtype(config.dtype, xp)
        b, s = config.max_batch_size, config.max_sequence_length
        with launch_scope(self._device, stream):
            self._caches = tuple(xp.zeros((b, 2, lc.num_kv_heads, s, lc.head_dim), dtype=dtype)
                                 for lc in config.layer_configs)
            self._groups = tuple(
                KVGroup([self._caches[a] for a in indices], layer_indices=indices)
                for indices in group_layers_by_head_dim(lc.head_dim
                                                        for lc in config.layer_configs))

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
        """True when every layer has the same ``(num_kv_heads, head_dim)`` (or there are none)."""
        return len({(lc.num_kv_heads, lc.head_dim) for lc in self._config.layer_configs}) <= 1

    @property
    def groups(self) -> tuple:
        """The head-dim groups (:class:`~hcache.ops.tables.KVGroup`, first-seen order of head dim;
        ``layer_indices[group_position]`` is an attention index)."""
        return self._groups

    def get_combined_kv_cache(self, i):
        """Layer ``i``'s cache, a view ``[max_batch, 2, H_i, S, D_i]``. Raises ``IndexError``."""
        return self._caches[check_index("layer", i, self.num_layers)]

    def get_separate_kv_cache(self, i):
        """Layer ``i``'s K and V caches: strided views ``[max_batch, H_i, S, D_i]`` of the
        combined cache (``cache[:, 0]`` and ``cache[:, 1]``). Raises ``IndexError``."""
        cache = self.get_combined_kv_cache(i)
        return cache[:, 0], cache[:, 1]

    def get_layer_config(self, i) -> KVLayerConfig:
        """Layer ``i``'s :class:`KVLayerConfig`. Raises ``IndexError``."""
        return self._config.layer_configs[check_index("layer", i, self.num_layers)]

    def memory_report(self) -> dict:
        """Device bytes: ``kv_cache`` (all layers), ``layer_infos`` (group descriptors),
        ``total`` and ``layers`` (per layer)."""
        layers = tuple(int(c.nbytes) for c in self._caches)
        infos = sum(g.nbytes for g in self._groups)
        return {"kv_cache": sum(layers), "layer_infos": infos, "total": sum(layers) + infos,
                "layers": layers}

    # --- prompt-cache capture / restore -----------------------------------------------------

    def capture_kv_cache(self, b, sequence_length, stream=None) -> list:
        """Copy tokens ``[0, sequence_length)`` of slot ``b`` of every layer (one launch per
        head-dim group).

        Returns
        -------
        list of arrays ``[2, H_a, sequence_length, D_a]``
            One **newly allocated** array per layer (attention-index order), K plane then V
            plane.

        Raises
        ------
        IndexError
            ``b`` out of range.
        TypeError, ValueError
            ``sequence_length`` not an int in ``[0, max_sequence_length]``.
        """
        b = check_index("slot", b, self._config.max_batch_size)
        n = check_int("sequence_length", sequence_length, 0, self._config.max_sequence_length)
        xp = self._device.xp
        with launch_scope(self._device, stream):
            out = [xp.empty((2, c.shape[2], n, c.shape[4]), dtype=c.dtype) for c in self._caches]
            for group in self._groups:
                ops.kv_capture(group, b, n, [out[a] for a in group.layer_indices],
                               stream=stream)
        return out

    def restore_kv_cache(self, saved, b, stream=None) -> None:
        """Write ``saved[i]`` into tokens ``[0, n)`` of slot ``b`` of layer ``i`` (one launch per
        head-dim group, in place; lengths are not touched).

        Parameters
        ----------
        saved : sequence of ``num_layers`` arrays ``[2, H_i, n, D_i]``
            One ``n`` for all layers, ``n <= max_sequence_length``; C-contiguous, of this device
            and the cache dtype.
        b : int

        Raises
        ------
        IndexError
            ``b`` out of range.
        TypeError, ValueError
            A wrong count, array module, shape, length, dtype or layout in any tensor; every
            tensor is checked before anything is written.
        """
        b = check_index("slot", b, self._config.max_batch_size)
        self._check_saved(saved)
        with launch_scope(self._device, stream):
            for group in self._groups:
                ops.kv_restore(group, [saved[a] for a in group.layer_indices], b, stream=stream)

    def _check_saved(self, saved) -> None:
        if isinstance(saved, (str, bytes)) or not hasattr(saved, "__len__"):
            raise TypeError(f"saved: expected a sequence of arrays, got {type(saved).__name__}")
        if len(saved) != self.num_layers:
            raise ValueError(f"saved: expected {self.num_layers} tensors, got {len(saved)}")
        xp = self._device.xp
        n = None
        for i, (t, cache) in enumerate(zip(saved, self._caches, strict=True)):
            if array_module_of(t) is not xp or not hasattr(t, "shape"):
                raise TypeError(f"saved[{i}]: expected a {xp.__name__} array, "
                                f"got {type(t).__name__}")
            heads, dim = cache.shape[2], cache.shape[4]
            if t.ndim != 4 or t.shape[0] != 2 or t.shape[1] != heads or t.shape[3] != dim:
                raise ValueError(f"saved[{i}]: expected shape [2, {heads}, n, {dim}], "
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
