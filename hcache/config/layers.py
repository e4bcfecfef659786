"""The per-layer vocabulary of a cache layout: what kind each decoder layer is, and the KV shape
of one attention layer (docs/design.md §4)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .._checks import as_int

__all__ = ["LayerType", "KVLayerConfig", "kv_layer_list"]


def _set(obj, name, value):
    object.__setattr__(obj, name, value)


class LayerType(enum.Enum):
    """Kind of one decoder layer."""

    ATTENTION = "attention"
    MAMBA = "mamba"
    ATTENTION_AND_MAMBA = "attention_and_mamba"  # Falcon-H1 / Zamba2 hybrid layers
    NONE = "none"                                # MLP/MoE-only layer: no cache

    @property
    def has_attention(self) -> bool:
        return self in (LayerType.ATTENTION, LayerType.ATTENTION_AND_MAMBA)

    @property
    def has_mamba(self) -> bool:
        return self in (LayerType.MAMBA, LayerType.ATTENTION_AND_MAMBA)

    @classmethod
    def _missing_(cls, value):
        raise ValueError(f"value: expected one of {', '.join(repr(m.value) for m in cls)}, "
                         f"got {value!r}")

    @classmethod
    def coerce(cls, value, name: str = "layer_type") -> LayerType:
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
            try:
                return cls[value.upper()]
            except KeyError:
                pass
            raise ValueError(f"{name}: expected a LayerType, got {value!r}")
        raise TypeError(f"{name}: expected a LayerType or its name, got {type(value).__name__}")


@dataclass(frozen=True)
class KVLayerConfig:
    """KV shape of one attention layer; ``sliding_window`` is recorded from the model.

    ``components`` is 2 for separate K and V, or 1 for a multi-head latent attention (MLA) layer
    that caches one latent vector per token (``c_kv`` then ``k_pe``, ``head_dim = kv_lora_rank +
    qk_rope_head_dim``, ``num_kv_heads = 1``) and no V.
    """

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    components: int = 2

    def __post_init__(self):
        _set(self, "num_kv_heads", as_int("num_kv_heads", self.num_kv_heads, 1))
        _set(self, "head_dim", as_int("head_dim", self.head_dim, 1))
        if self.sliding_window is not None:
            _set(self, "sliding_window", as_int("sliding_window", self.sliding_window, 1))
        _set(self, "components", as_int("components", self.components, 1))
        if self.components not in (1, 2):
            raise ValueError(f"components: expected 1 (latent MLA cache) or 2 (K and V), "
                             f"got {self.components}")


def kv_layer_list(name: str, configs) -> tuple:
    """``configs`` (a sequence of :class:`KVLayerConfig`) as a tuple; ``TypeError`` naming
    ``name`` (or ``name[i]``) otherwise."""
    if isinstance(configs, (str, bytes, type)) or not hasattr(configs, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of KVLayerConfig, "
                        f"got {type(configs).__name__}")
    configs = tuple(configs)
    for i, lc in enumerate(configs):
        if not isinstance(lc, KVLayerConfig):
            raise TypeError(f"{name}[{i}]: expected KVLayerConfig, got {type(lc).__name__}")
    return configs
