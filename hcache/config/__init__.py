"""Cache layouts: frozen, validated config dataclasses (:mod:`~hcache.config.layers`,
:mod:`~hcache.config.caches`) and their construction from a Hugging Face ``config.json``
(:mod:`~hcache.config.hf`, with the model-family tables in :mod:`~hcache.config.families`)."""

from __future__ import annotations

from .caches import (
    HybridCacheConfig,
    KVCacheConfig,
    LinearCacheConfig,
    MambaCacheConfig,
    hybrid_config_from_hf,
)
from .hf import SUPPORTED_MODEL_TYPES, read_hf_layout
from .layers import KVLayerConfig, LayerType

__all__ = ["LayerType", "KVLayerConfig", "KVCacheConfig", "MambaCacheConfig",
           "HybridCacheConfig", "LinearCacheConfig", "hybrid_config_from_hf", "read_hf_layout",
           "SUPPORTED_MODEL_TYPES"]
