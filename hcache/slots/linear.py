"""One monolithic KV buffer for uniform models, plus optional Mamba states (docs/design.md §4).

``kv [L, max_batch, 2, H, S, D]``: attention layer ``a``'s cache is the C-contiguous view
``kv[a]`` (``a`` is an attention index, the decoder layer of a pure-attention model). Mamba
states, when the config has Mamba layers, live in a
:class:`~hcache.slots.mamba.MambaCacheManager` (indexed by Mamba index). The batch API is
shared with the hybrid manager; compaction moves the KV tokens, the Mamba states and the
lengths.
"""

from __future__ import annotations

from .._checks import check_index
from ..config.caches import LinearCacheConfig, MambaCacheConfig
from ..dtypes import storage_dtype
from ..memory import check_fits
from ..ops.tables import KVGroup
from ..runtime.device import launch_scope, resolve_device, zeros
from .batch import BatchAPI
from .kv_writes import KVWriter
from .mamba import MambaCacheManager

__all__ = ["LinearKVCache"]


class LinearKVCache(BatchAPI):
    """KV caches of ``L`` identical attention layers in one buffer, and Mamba states.

    Parameters
    ----------
    config : LinearCacheConfig
    stream : stream, optional
        Stream of the construction work.
    device : None, "cpu", "cuda" or "cuda:N"

    Raises
    ------
    TypeError
        ``config`` is not a :class:`LinearCacheConfig`.
    CacheCapacityError
        The caches do not fit in the memory available on the device
        (``config.nbytes``, :func:`hcache.memory.check_fits`); nothing is allocated.
    """

    def __init__(self, config, stream=None, *, device=None):
        if not isinstance(config, LinearCacheConfig):
            raise TypeError(f"config: expected LinearCacheConfig, got {type(config).__name__}")
        self._config = config
        device = resolve_device(device)
        check_fits("config", config.nbytes, device)
        xp = device.xp
        c = config
        self._mamba = None
        if c.num_mamba_layers:
            self._mamba = MambaCacheManager(
                MambaCacheConfig(c.num_mamba_layers, c.max_batch_size, c.mamba_num_heads,
                                 c.mamba_head_dim, c.ssm_state_size, c.conv_dim, c.conv_kernel,
                                 ssm_dtype=c.ssm_dtype, conv_dtype=c.conv_dtype),
                stream, device=device)
        with launch_scope(device, stream):
            self._buffer = zeros(device, (c.num_attention_layers, c.max_batch_size, 2,
                                          c.num_kv_heads, c.max_sequence_length, c.head_dim),
                                 storage_dtype(c.dtype, xp))
            self._layers = tuple(self._buffer[i] for i in range(c.num_attention_layers))
            self._groups = (KVGroup(list(self._layers)),) if self._layers else ()
            self._kv_writer = KVWriter(device, self._layers, self._groups, c.dtype,
                                       c.max_sequence_length)
            states = self._mamba.state_tensors if self._mamba is not None else ()
            super().__init__(device, c.max_batch_size, c.max_sequence_length,
                             kv_groups=self._groups, slot_tensors=states)

    # --- queries ----------------------------------------------------------------------------

    @property
    def config(self) -> LinearCacheConfig:
        """The layout this cache was built from."""
        return self._config

    def get_kv_cache_buffer(self):
        """The whole KV buffer, a view ``[L, max_batch, 2, H, S, D]``."""
        return self._buffer

    def get_combined_kv_cache_for_decoder_layer(self, i):
        """Layer ``i``'s cache, a C-contiguous view ``[max_batch, 2, H, S, D]``.
        Raises ``IndexError`` for a bad layer."""
        return self._layers[check_index("i", i, len(self._layers))]

    def get_separate_kv_cache_for_decoder_layer(self, i):
        """Layer ``i``'s K and V caches, strided views ``[max_batch, H, S, D]`` of the combined
        layout. Raises ``IndexError`` for a bad layer."""
        cache = self.get_combined_kv_cache_for_decoder_layer(i)
        return cache[:, 0], cache[:, 1]

    def get_ssm_state_for_layer(self, i):
        """The SSM state of Mamba layer ``i`` (a Mamba index), a view ``[max_batch, heads,
        head_dim, state_size]``. Raises ``IndexError`` for a bad layer (any ``i`` without Mamba
        layers)."""
        check_index("i", i, self._config.num_mamba_layers)
        return self._mamba.get_recurrent_state(i)

    def get_recurrent_state(self, i):
        """Alias of :meth:`get_ssm_state_for_layer` (TensorRT-Edge-LLM's ``getSSMStateForLayer``
        names it here), the name the hybrid and Mamba managers use."""
        return self.get_ssm_state_for_layer(i)

    def get_conv_state(self, i):
        """Alias of :meth:`get_conv_state_for_layer`, the hybrid and Mamba managers' name."""
        return self.get_conv_state_for_layer(i)

    def get_conv_state_for_layer(self, i):
        """The conv state of Mamba layer ``i`` (a Mamba index), a view ``[max_batch, conv_dim,
        conv_kernel]``. Raises ``IndexError`` for a bad layer (any ``i`` without Mamba
        layers)."""
        check_index("i", i, self._config.num_mamba_layers)
        return self._mamba.get_conv_state(i)

    def memory_report(self) -> dict:
        """Device bytes: ``kv_cache``, ``recurrent``, ``conv``, ``metadata`` (lengths, plan,
        descriptors, write staging) and ``total``."""
        mamba = self._mamba.memory_report() if self._mamba is not None else \
            {"recurrent": 0, "conv": 0}
        metadata = self.batch_state_nbytes + self._kv_writer.nbytes + sum(
            g.nbytes for g in self._groups)
        if self._mamba is not None:
            metadata += self._mamba.metadata_nbytes
        report = {"kv_cache": int(self._buffer.nbytes), "recurrent": mamba["recurrent"],
                  "conv": mamba["conv"], "metadata": metadata}
        report["total"] = sum(report.values())
        return report

    # --- KV writes (BatchAPI.write_kv; layers are attention indices) -------------------------

    def _kv_write_index(self, layer) -> int:
        return check_index("layer", layer, len(self._layers))

    def get_kv_scales(self):
        """FP8 scale tables ``(k_scales, v_scales)``, float32 views ``[L, H]`` (1.0 at
        construction): the scale each layer's latest :meth:`write_kv` divided by (an attention
        kernel dequantizes as ``q * scale``). Raises ``ValueError`` unless the cache is FP8."""
        return self._kv_writer.scales()

    def set_kv_scales(self, k_scale=None, v_scale=None, stream=None) -> None:
        """Record scales for every layer (a float, or a float32 device array ``[L]`` or ``[L,
        >= H]``; ``None`` keeps one), used by later :meth:`write_kv` calls without a scale.
        Raises ``ValueError`` / ``TypeError`` before recording anything."""
        self._kv_writer.set_scales(k_scale, v_scale, stream)

    def skipped_kv_write_count(self, stream=None) -> int:
        """Tokens :meth:`write_kv` skipped as out of range so far (device positions, unknown
        lengths). **Synchronizes** ``stream``."""
        return self._kv_writer.skipped_count(stream)

    # --- Mamba states -----------------------------------------------------------------------

    def clear_mamba_states(self, stream=None) -> None:
        """Zero every SSM and conv state (a no-op without Mamba layers)."""
        if self._mamba is not None:
            self._mamba.clear_states(stream)

    def capture_ssm_states(self, b, stream=None) -> list:
        """Slot ``b``'s SSM state per Mamba layer: **new** ``[1, heads, head_dim,
        state_size]`` arrays (empty without Mamba layers). Raises ``IndexError``."""
        check_index("b", b, self._config.max_batch_size)
        return self._mamba.capture_recurrent_states(b, stream) if self._mamba is not None else []

    def capture_conv_states(self, b, stream=None) -> list:
        """Slot ``b``'s conv state per Mamba layer: **new** ``[1, conv_dim, conv_kernel]``
        arrays (empty without Mamba layers). Raises ``IndexError``."""
        check_index("b", b, self._config.max_batch_size)
        return self._mamba.capture_conv_states(b, stream) if self._mamba is not None else []

    def write_states(self, layer, recurrent=None, conv=None, *, slots=None,
                     stream=None) -> None:
        """Write new SSM (``recurrent``) / conv states of a batch into their slots: row ``i``
        -> slot ``slots[i]`` (None: slot ``i``), of Mamba layer ``layer`` or of every one
        (``layer=None``: lists). One launch, no allocation, no sync; lengths untouched. See
        :meth:`MambaCacheManager.write_states` (same arrays, same errors)."""
        if self._mamba is None:
            check_index("layer", layer if layer is not None else 0, 0)   # raises: no layers
        self._mamba.write_states(layer, recurrent, conv, slots=slots, stream=stream)

    def restore_mamba_states(self, ssm, conv, b, stream=None) -> None:
        """Write saved SSM and conv states into slot ``b`` (one launch; validates everything
        first). See :meth:`MambaCacheManager.restore_states`."""
        check_index("b", b, self._config.max_batch_size)
        if self._mamba is None:
            for name, t in (("ssm", ssm), ("conv", conv)):
                if isinstance(t, (str, bytes)) or not hasattr(t, "__len__"):
                    raise TypeError(f"{name}: expected a sequence of arrays, "
                                    f"got {type(t).__name__}")
                if len(t):
                    raise ValueError(f"{name}: expected 0 tensors, got {len(t)}")
            return
        self._mamba._restore(ssm, conv, b, stream, "ssm")
