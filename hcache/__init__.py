"""hcache: inference caches for hybrid attention + Mamba LLMs, for runtimes without torch.

Public surface: the configs, the managers, the errors and the device helpers. Kernel wrappers
live in :mod:`hcache.ops` (with their NumPy reference in :mod:`hcache.reference`).
"""

from __future__ import annotations

from .configs import (
                      HybridCacheConfig,
                      KVCacheConfig,
                      KVLayerConfig,
                      LayerType,
                      LinearCacheConfig,
                      MambaCacheConfig,
)
from .contexts import (
                      DynamicInferenceContext,
                      KVBlockAllocator,
                      MambaSlotAllocator,
                      MambaSlotCapacityError,
                      PagedKVPool,
                      compute_block_hashes,
)
from .continuous_batching import (
                      BatchInFlightError,
                      ContinuousBatchingKVCacheCollection,
                      ContinuousBatchingKVCacheManager,
                      KVCacheStaticParams,
)
from .device import Device, resolve_device
from .dtypes import DTYPE_NAMES, dtype_name, resolve_dtype
from .errors import CacheCapacityError, KernelCompileError, KernelLaunchError
from .hybrid_cache_manager import HybridCacheManager, KVHeadDimGroupView
from .kv_cache_manager import KVCacheManager
from .linear_kv_cache import LinearKVCache
from .mamba_cache_manager import MambaCacheManager

__version__ = "0.1.0"

__all__ = ["__version__", "CacheCapacityError", "KernelCompileError", "KernelLaunchError",
           "MambaSlotCapacityError", "BatchInFlightError",
           "Device", "resolve_device", "DTYPE_NAMES", "dtype_name", "resolve_dtype",
           "LayerType", "KVLayerConfig", "KVCacheConfig", "MambaCacheConfig",
           "HybridCacheConfig", "LinearCacheConfig",
           "KVCacheManager", "MambaCacheManager", "HybridCacheManager", "KVHeadDimGroupView",
           "LinearKVCache",
           "KVCacheStaticParams", "ContinuousBatchingKVCacheManager",
           "ContinuousBatchingKVCacheCollection",
           "compute_block_hashes", "KVBlockAllocator", "PagedKVPool", "MambaSlotAllocator",
           "DynamicInferenceContext"]
