"""Frozen, validated configuration dataclasses (docs/design.md §4).

Every field is checked in ``__post_init__``: a wrong type raises ``TypeError``, a wrong value
``ValueError``, both with the message ``"<field>: expected X, got Y"``. Sequences are stored as
tuples and dtypes by their docs/design.md §2 names, so configs are hashable and compare by value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .._checks import as_int
from ..dtypes import dtype_name, resolve_dtype
from . import sizing
from .fields import _dtype, _FrozenMapping, _largest_batch, _seq_len, _state_fields
from .hf import read_hf_layout
from .layers import KVLayerConfig, LayerType, _set, kv_layer_list

__all__ = ["LayerType", "KVLayerConfig", "KVCacheConfig", "MambaCacheConfig",
           "HybridCacheConfig", "LinearCacheConfig", "hybrid_config_from_hf"]


@dataclass(frozen=True)
class KVCacheConfig:
    """Per-layer KV caches ``[max_batch_size, C_i, H_i, L_i, D_i]`` (``C_i`` =
    ``layer_configs[i].components``: 2 for K and V, 1 for a latent MLA cache).

    ``L_i`` (:attr:`layer_cache_lengths`) is ``max_sequence_length``, or with ``ring_windows``
    the window ``W_i`` of a sliding-window layer whose window is shorter: that layer's cache
    is a ring buffer holding the last ``W_i`` tokens, position ``p`` at entry ``p mod W_i``
    (docs/design.md §3.9, §4.10). Lengths stay absolute.
    """

    max_batch_size: int
    max_sequence_length: int
    layer_configs: tuple = ()
    dtype: str = "float16"
    ring_windows: bool = False

    def __post_init__(self):
        _set(self, "max_batch_size", as_int("max_batch_size", self.max_batch_size, 1))
        _set(self, "max_sequence_length", _seq_len(self.max_sequence_length))
        _set(self, "layer_configs", kv_layer_list("layer_configs", self.layer_configs))
        _dtype(self, "dtype")
        if not isinstance(self.ring_windows, (bool, np.bool_)):
            raise TypeError(f"ring_windows: expected a bool, "
                            f"got {type(self.ring_windows).__name__}")
        _set(self, "ring_windows", bool(self.ring_windows))

    @property
    def num_attention_layers(self) -> int:
        """Attention layers that own a cache (``len(layer_configs)``)."""
        return len(self.layer_configs)

    @property
    def layer_ring_windows(self) -> tuple:
        """Per attention layer: its ring window ``W`` (a ring buffer of ``W`` tokens), or 0
        (an unbounded cache). A layer is a ring when ``ring_windows`` is set and its
        ``sliding_window`` is shorter than ``max_sequence_length``."""
        if not self.ring_windows:
            return (0,) * len(self.layer_configs)
        return tuple(lc.sliding_window if lc.sliding_window is not None
                     and lc.sliding_window < self.max_sequence_length else 0
                     for lc in self.layer_configs)

    @property
    def layer_cache_lengths(self) -> tuple:
        """Per attention layer, the tokens its cache holds per slot (its token axis): the
        ring window, or ``max_sequence_length`` for an unbounded layer. A layer's cache bytes
        are ``max_batch_size * components * num_kv_heads * length * head_dim * itemsize``."""
        return tuple(w or self.max_sequence_length for w in self.layer_ring_windows)

    @property
    def nbytes(self) -> int:
        """Device bytes a :class:`~hcache.KVCacheManager` of this config allocates: caches
        and metadata, its ``memory_report()["total"]``, known before any allocation."""
        return sizing.kv_manager_nbytes(self)

    def max_batch_size_for(self, budget) -> int:
        """The largest ``max_batch_size`` whose :class:`~hcache.KVCacheManager` fits in
        ``budget`` bytes (the other fields as they are), or 0 if not even one slot fits.
        ``TypeError`` / ``ValueError`` unless ``budget`` is an int >= 0."""
        return _largest_batch(budget, lambda b: replace(self, max_batch_size=b))


@dataclass(frozen=True)
class MambaCacheConfig:
    """Recurrent state ``[max_batch, num_heads, head_dim, state_size]`` and conv state
    ``[max_batch, conv_dim, conv_kernel]`` per layer. Covers Mamba-2, Mamba-1/Jamba
    (``num_heads=1, head_dim=d_inner``), gated delta-net and KDA (``[v_heads, k_head_dim,
    v_head_dim]``), lightning attention (``[heads, head_dim, head_dim]``, no conv state:
    ``conv_dim = conv_kernel = 0``) and short convolutions (no recurrent state: ``num_heads =
    head_dim = state_size = 0``). A state's fields are all 0 (it does not exist) or all >= 1;
    at least one of the two states exists."""

    num_layers: int
    max_batch_size: int
    num_heads: int
    head_dim: int
    state_size: int
    conv_dim: int
    conv_kernel: int
    ssm_dtype: str = "float32"
    conv_dtype: str = "float16"

    def __post_init__(self):
        _set(self, "num_layers", as_int("num_layers", self.num_layers, 0))
        _set(self, "max_batch_size", as_int("max_batch_size", self.max_batch_size, 1))
        _state_fields(self, ("num_heads", "head_dim", "state_size"), ("conv_dim", "conv_kernel"))
        _dtype(self, "ssm_dtype")
        _dtype(self, "conv_dtype")

    @property
    def has_recurrent_state(self) -> bool:
        """Whether the layers have a recurrent state (not short-convolution layers)."""
        return self.state_size > 0

    @property
    def has_conv_state(self) -> bool:
        """Whether the layers have a conv state (not lightning-attention layers)."""
        return self.conv_dim > 0

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """``(num_heads, head_dim, state_size)``; all 0 without a recurrent state."""
        return (self.num_heads, self.head_dim, self.state_size)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """``(conv_dim, conv_kernel)``; both 0 without a conv state."""
        return (self.conv_dim, self.conv_kernel)

    @property
    def nbytes(self) -> int:
        """Device bytes a :class:`~hcache.MambaCacheManager` of this config allocates: caches
        and metadata, its ``memory_report()["total"]``, known before any allocation."""
        return sizing.mamba_manager_nbytes(self)

    def max_batch_size_for(self, budget) -> int:
        """The largest ``max_batch_size`` whose :class:`~hcache.MambaCacheManager` fits in
        ``budget`` bytes (the other fields as they are), or 0 if not even one slot fits.
        ``TypeError`` / ``ValueError`` unless ``budget`` is an int >= 0."""
        return _largest_batch(budget, lambda b: replace(self, max_batch_size=b))


@dataclass(frozen=True)
class HybridCacheConfig:
    """Layer routing of a hybrid model by absolute decoder-layer index.

    ``kv.layer_configs`` has one entry per attention layer that owns a cache (absolute order);
    ``kv_sharing`` maps a layer to the earlier attention layer whose cache it reads.
    """

    layer_types: tuple
    kv: KVCacheConfig
    mamba: MambaCacheConfig | None
    max_batch_size: int
    kv_sharing: object = field(default=None)

    def __post_init__(self):
        if isinstance(self.layer_types, (str, bytes, type)) \
                or not hasattr(self.layer_types, "__iter__"):
            raise TypeError(f"layer_types: expected a sequence of LayerType, "
                            f"got {type(self.layer_types).__name__}")
        types = tuple(LayerType.coerce(t, f"layer_types[{i}]")
                      for i, t in enumerate(self.layer_types))
        if not types:
            raise ValueError("layer_types: expected at least one layer, got 0")
        _set(self, "layer_types", types)
        if not isinstance(self.kv, KVCacheConfig):
            raise TypeError(f"kv: expected KVCacheConfig, got {type(self.kv).__name__}")
        if self.mamba is not None and not isinstance(self.mamba, MambaCacheConfig):
            raise TypeError(f"mamba: expected MambaCacheConfig or None, "
                            f"got {type(self.mamba).__name__}")
        _set(self, "max_batch_size", as_int("max_batch_size", self.max_batch_size, 1))
        try:
            pairs = dict(self.kv_sharing or {})
        except (TypeError, ValueError):
            raise TypeError(f"kv_sharing: expected a mapping of layer to owner layer, "
                            f"got {type(self.kv_sharing).__name__}") from None
        sharing = {as_int("kv_sharing key", layer): as_int("kv_sharing value", owner)
                   for layer, owner in pairs.items()}
        for layer, owner in sharing.items():
            if not 0 <= layer < len(types) or not types[layer].has_attention:
                raise ValueError(f"kv_sharing: expected attention layers as keys, got {layer}")
            if not 0 <= owner < layer or not types[owner].has_attention or owner in sharing:
                raise ValueError(f"kv_sharing[{layer}]: expected an earlier attention layer that "
                                 f"owns its cache, got {owner}")
        _set(self, "kv_sharing", _FrozenMapping(sharing))
        owners = sum(1 for i, t in enumerate(types) if t.has_attention and i not in sharing)
        if owners != self.kv.num_attention_layers:
            raise ValueError(f"kv.layer_configs: expected {owners} entries (attention layers "
                             f"that own a cache), got {self.kv.num_attention_layers}")
        n_mamba = sum(1 for t in types if t.has_mamba)
        have = 0 if self.mamba is None else self.mamba.num_layers
        if n_mamba != have:
            raise ValueError(f"mamba.num_layers: expected {n_mamba} (Mamba layers in "
                             f"layer_types), got {have}")
        if self.kv.max_batch_size != self.max_batch_size:
            raise ValueError(f"kv.max_batch_size: expected {self.max_batch_size}, "
                             f"got {self.kv.max_batch_size}")
        if self.mamba is not None and self.mamba.max_batch_size != self.max_batch_size:
            raise ValueError(f"mamba.max_batch_size: expected {self.max_batch_size}, "
                             f"got {self.mamba.max_batch_size}")

    def __hash__(self):
        return hash((self.layer_types, self.kv, self.mamba, self.max_batch_size,
                     tuple(sorted(self.kv_sharing.items()))))

    @property
    def num_layers(self) -> int:
        """Decoder layers, cache-less ones included."""
        return len(self.layer_types)

    @property
    def nbytes(self) -> int:
        """Device bytes a :class:`~hcache.HybridCacheManager` of this config allocates: caches
        and metadata, its ``memory_report()["total"]``, known before any allocation."""
        return sizing.hybrid_manager_nbytes(self)

    def max_batch_size_for(self, budget) -> int:
        """The largest ``max_batch_size`` whose :class:`~hcache.HybridCacheManager` fits in
        ``budget`` bytes (the other fields as they are), or 0 if not even one slot fits.
        ``TypeError`` / ``ValueError`` unless ``budget`` is an int >= 0."""
        return _largest_batch(budget, lambda b: self._with_batch(b))

    def _with_batch(self, b: int) -> HybridCacheConfig:
        mamba = None if self.mamba is None else replace(self.mamba, max_batch_size=b)
        return replace(self, kv=replace(self.kv, max_batch_size=b), mamba=mamba,
                       max_batch_size=b)

    @classmethod
    def from_hf_config(cls, config_dict, *, max_batch_size, max_sequence_length,
                       kv_dtype="float16", ssm_dtype="float32", conv_dtype=None,
                       ring_windows=True):
        """Build the layout from a Hugging Face ``config.json`` dict (see
        :func:`hybrid_config_from_hf`)."""
        return hybrid_config_from_hf(config_dict, max_batch_size=max_batch_size,
                                     max_sequence_length=max_sequence_length,
                                     kv_dtype=kv_dtype, ssm_dtype=ssm_dtype,
                                     conv_dtype=conv_dtype, ring_windows=ring_windows)


@dataclass(frozen=True)
class LinearCacheConfig:
    """Uniform layout of ``LinearKVCache`` (TensorRT-Edge-LLM's LinearKVCache): one ``[L, B, 2, H,
    S, D]`` buffer, plus
    optional Mamba states (all Mamba fields 0 for a pure-attention model)."""

    num_attention_layers: int
    max_batch_size: int
    max_sequence_length: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    num_mamba_layers: int = 0
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    ssm_dtype: str = "float32"
    conv_dim: int = 0
    conv_kernel: int = 0
    conv_dtype: str = "float16"

    def __post_init__(self):
        _set(self, "num_attention_layers",
             as_int("num_attention_layers", self.num_attention_layers, 0))
        for name in ("max_batch_size", "num_kv_heads", "head_dim"):
            _set(self, name, as_int(name, getattr(self, name), 1))
        _set(self, "max_sequence_length", _seq_len(self.max_sequence_length))
        _set(self, "num_mamba_layers", as_int("num_mamba_layers", self.num_mamba_layers, 0))
        recurrent = ("mamba_num_heads", "mamba_head_dim", "ssm_state_size")
        if self.num_mamba_layers:   # 0 for all fields of a state the layers do not have
            _state_fields(self, recurrent, ("conv_dim", "conv_kernel"))
        for name in recurrent + ("conv_dim", "conv_kernel"):
            _set(self, name, as_int(name, getattr(self, name), 0))
        for name in ("dtype", "ssm_dtype", "conv_dtype"):
            _dtype(self, name)

    @property
    def nbytes(self) -> int:
        """Device bytes a :class:`~hcache.LinearKVCache` of this config allocates: caches
        and metadata, its ``memory_report()["total"]``, known before any allocation."""
        return sizing.linear_manager_nbytes(self)

    def max_batch_size_for(self, budget) -> int:
        """The largest ``max_batch_size`` whose :class:`~hcache.LinearKVCache` fits in
        ``budget`` bytes (the other fields as they are), or 0 if not even one slot fits.
        ``TypeError`` / ``ValueError`` unless ``budget`` is an int >= 0."""
        return _largest_batch(budget, lambda b: replace(self, max_batch_size=b))


def hybrid_config_from_hf(config_dict, *, max_batch_size, max_sequence_length,
                          kv_dtype="float16", ssm_dtype="float32",
                          conv_dtype=None, ring_windows=True) -> HybridCacheConfig:
    """Build the cache layout of a model from its Hugging Face ``config.json``.

    Parameters
    ----------
    config_dict : Mapping
        The parsed ``config.json`` (a nested ``text_config`` is used when present) of a model
        type in ``hcache.config.hf.SUPPORTED_MODEL_TYPES`` (docs/design.md §4.3): Nemotron-H,
        Jamba, Bamba, Granite-4.0-H, Falcon-H1, Zamba2, Qwen3-Next, LFM2, MiniMax-Text-01 / M1,
        Kimi Linear, Gemma 2 / 3 / 4 and the listed plain attention models. The family is the
        stated ``model_type`` (an unknown one raises whatever ``architectures`` says); only a
        config without any reads ``architectures``, then family-specific fields.
    max_batch_size, max_sequence_length : int
        Slots and tokens per slot of the KV caches (and slots of the Mamba states).
    kv_dtype, ssm_dtype : str or dtype
        Dtypes of the KV caches and of the recurrent states.
    conv_dtype : str or dtype, optional
        Dtype of the conv states; ``None`` means ``kv_dtype``.
    ring_windows : bool
        ``True`` (default): every sliding-window layer whose window is shorter than
        ``max_sequence_length`` gets a ring buffer of its window (``KVCacheConfig.ring_windows``;
        Gemma 3 at 128k context then allocates about 17 % of the unbounded bytes). ``False``
        keeps the unbounded layout, for engines whose attention kernels index a full-length
        cache by absolute position (the windows are still recorded).

    Returns
    -------
    HybridCacheConfig
        ``layer_types`` by absolute decoder index (MLP/MoE-only layers are ``LayerType.NONE``),
        one ``KVLayerConfig`` per cache-owning attention layer, a ``MambaCacheConfig`` (``None``
        without recurrent layers) and Gemma 4's ``kv_sharing``.

    Raises
    ------
    TypeError
        ``config_dict`` is not a mapping, or a field or dtype has the wrong type.
    ValueError
        An unknown ``model_type`` (named), a missing size field without a class default, an
        unsupported or inconsistent config (the message names the field), or a bad dtype,
        batch size or sequence length.
    """
    kv_dt = dtype_name(resolve_dtype(kv_dtype, name="kv_dtype"))
    ssm_dt = dtype_name(resolve_dtype(ssm_dtype, name="ssm_dtype"))
    conv_dt = kv_dt if conv_dtype is None else dtype_name(resolve_dtype(conv_dtype,
                                                                        name="conv_dtype"))
    layout = read_hf_layout(config_dict)
    owners = [layout.kv[i] for i in sorted(layout.kv) if i not in layout.sharing]
    if not isinstance(ring_windows, (bool, np.bool_)):
        raise TypeError(f"ring_windows: expected a bool, got {type(ring_windows).__name__}")
    kv = KVCacheConfig(max_batch_size, max_sequence_length, owners, kv_dt, bool(ring_windows))
    n_mamba = sum(1 for t in layout.types if t.has_mamba)
    mamba = (MambaCacheConfig(n_mamba, max_batch_size, **layout.mamba, ssm_dtype=ssm_dt,
                              conv_dtype=conv_dt) if n_mamba else None)
    return HybridCacheConfig(layout.types, kv, mamba, max_batch_size, layout.sharing or None)
