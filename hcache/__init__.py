"""hcache: inference caches for hybrid attention + Mamba LLMs, for runtimes without torch.

Public surface: the configs, the managers, the errors and the device helpers. Kernel wrappers
live in :mod:`hcache.ops` (with their NumPy reference in :mod:`hcache.ops.reference`).
"""

from __future__ import annotations

from .config import (
    HybridCacheConfig,
    KVCacheConfig,
    KVLayerConfig,
    LayerType,
    LinearCacheConfig,
    MambaCacheConfig,
)
from .contexts import (
    ContextDraftStates,
    DynamicInferenceContext,
    KVBlockAllocator,
    MambaSlotAllocator,
    MambaSlotCapacityError,
    PagedKVPool,
    compute_block_hashes,
)
from .continuous.hybrid_manager import (
    ContinuousBatchingHybridCacheManager,
    ContinuousBatchingHybridCollection,
)
from .continuous.manager import (
    BatchInFlightError,
    ContinuousBatchingKVCacheCollection,
    ContinuousBatchingKVCacheManager,
    KVCacheStaticParams,
)
from .dtypes import DTYPE_NAMES, dtype_name, resolve_dtype
from .errors import CacheCapacityError, KernelCompileError, KernelLaunchError
from .runtime.device import Device, resolve_device
from .slots.drafts import DraftStates
from .slots.hybrid import HybridCacheManager, KVHeadDimGroupView
from .slots.kv import KVCacheManager
from .slots.linear import LinearKVCache
from .slots.mamba import MambaCacheManager
from .slots.prompt_store import CapturedPrompt, PromptCacheStore

__version__ = "0.1.0"


def _keep_old_module_paths() -> None:
    """Modules of the first wave stay importable under their old paths (``hcache.configs``,
    ``hcache.kv_cache_manager``, ...): each old name is an alias of the module that holds its
    contents now (see docs/design.md, "Package layout"); so do the device layer's modules,
    moved into ``hcache.runtime`` (``hcache.device``, ``hcache._cuda``, ...)."""
    import importlib
    import sys

    for old, new in _OLD_MODULE_PATHS.items():
        module = importlib.import_module(f"{__name__}.{new}")
        sys.modules.setdefault(f"{__name__}.{old}", module)
        globals().setdefault(old, module)


_OLD_MODULE_PATHS = {
    "configs": "config.caches", "hf_config": "config.caches", "layout": "ops.tables",
    "reference": "ops.reference", "batch_state": "slots.batch", "kv_cache_manager": "slots.kv",
    "mamba_cache_manager": "slots.mamba", "hybrid_cache_manager": "slots.hybrid",
    "linear_kv_cache": "slots.linear", "continuous_batching": "continuous.manager",
    "continuous_batching_collection": "continuous.collection",
    "_cuda": "runtime._cuda", "device": "runtime.device", "arrays": "runtime.arrays",
    "staging": "runtime.staging", "stream_order": "runtime.stream_order",
}
_keep_old_module_paths()

__all__ = ["__version__", "CacheCapacityError", "KernelCompileError", "KernelLaunchError",
           "MambaSlotCapacityError", "BatchInFlightError",
           "Device", "resolve_device", "DTYPE_NAMES", "dtype_name", "resolve_dtype",
           "LayerType", "KVLayerConfig", "KVCacheConfig", "MambaCacheConfig",
           "HybridCacheConfig", "LinearCacheConfig",
           "KVCacheManager", "MambaCacheManager", "HybridCacheManager", "KVHeadDimGroupView",
           "LinearKVCache", "PromptCacheStore", "CapturedPrompt", "DraftStates",
           "KVCacheStaticParams", "ContinuousBatchingKVCacheManager",
           "ContinuousBatchingKVCacheCollection", "ContinuousBatchingHybridCacheManager",
           "ContinuousBatchingHybridCollection",
           "compute_block_hashes", "KVBlockAllocator", "PagedKVPool", "MambaSlotAllocator",
           "DynamicInferenceContext", "ContextDraftStates"]
