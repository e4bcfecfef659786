"""Prefix caching for hybrid models (docs/design.md §6), mirroring Megatron-LM's
``core.inference.contexts``: block hashing, the KV block allocator, the paged KV pool, the Mamba
slot allocator and the dynamic inference context."""

from __future__ import annotations

from .block_hashing import compute_block_hashes
from .dynamic_context import DynamicInferenceContext, PrefixCacheStats, StepPlan
from .kv_block_allocator import KVBlockAllocator
from .mamba_slot_allocator import (
    MAX_INTERMEDIATE_OFFSETS_PER_REQUEST,
    MambaSlotAllocator,
    MambaSlotCapacityError,
)
from .paged_kv_pool import PagedKVPool

__all__ = ["compute_block_hashes", "KVBlockAllocator", "PagedKVPool", "MambaSlotAllocator",
           "MambaSlotCapacityError", "MAX_INTERMEDIATE_OFFSETS_PER_REQUEST",
           "DynamicInferenceContext", "StepPlan", "PrefixCacheStats"]
