"""Prefix caching for hybrid models (docs/design.md §6), mirroring Megatron-LM's
``core.inference.contexts``: block hashing, the KV block allocator, the paged KV pool, the Mamba
slot allocator and the dynamic inference context.

One concept per module; each owner composes its collaborators:

- ``block_hashing``: chained block hashes;
- ``kv_block_allocator`` (:class:`KVBlockAllocator`) owns a ``block_forest.BlockForest``
  (registered hashes, parent forest, leaf-peeling eviction order);
- ``paged_kv_pool`` (:class:`PagedKVPool`): per-layer paged K/V arrays;
- ``mamba_slot_allocator`` (:class:`MambaSlotAllocator`) owns a ``mamba_slot_pool.MambaSlotPool``
  (slots, free stack, LRU eviction), a ``mamba_hash_map.MambaHashMap``, a
  ``mamba_intermediate.IntermediateStates`` (mid-prefill snapshots, the rows holding them noted
  by a ``mamba_entry_rows.EntryRows``) and a
  ``mamba_state_copies.MambaStateCopies`` (cache arrays and every copy into or out of them);
  ``mamba_commit`` keeps a step's boundary states (a lean path for a step's few entries, the
  general one as its oracle);
- ``dynamic_context`` (:class:`DynamicInferenceContext`) owns a ``requests.RequestTable`` (per-row
  tokens, counters and block hashes), a ``block_registration.BlockRegistration`` (when completed
  blocks are hashed and registered; ``backlog_duplicates`` finds which will stay private;
  ``step_registration`` registers a serving step's blocks on lists), a
  ``step_scheduler.StepScheduler`` (admissions and batched extensions, applying the policy of
  ``prefix_match``, functions of explicit inputs), a
  ``live_states.LiveMambaStates`` and a ``step_kv_writer.StepKVWriter``; it answers with the
  plans of ``step_plans`` (:class:`StepPlan`, :class:`BatchStepPlan`) and checks its arguments
  with ``token_batches``; a verify step of speculative decoding is committed by
  ``draft_commit`` from the Mamba states of ``context_drafts`` (:class:`ContextDraftStates`).
"""

from __future__ import annotations

from .block_hashing import compute_block_hashes
from .context_drafts import ContextDraftStates
from .dynamic_context import BatchStepPlan, DynamicInferenceContext, PrefixCacheStats, StepPlan
from .kv_block_allocator import KVBlockAllocator
from .mamba_slot_allocator import (
    MAX_INTERMEDIATE_OFFSETS_PER_REQUEST,
    MambaSlotAllocator,
    MambaSlotCapacityError,
)
from .paged_kv_pool import PagedKVPool

__all__ = ["compute_block_hashes", "KVBlockAllocator", "PagedKVPool", "MambaSlotAllocator",
           "MambaSlotCapacityError", "MAX_INTERMEDIATE_OFFSETS_PER_REQUEST",
           "DynamicInferenceContext", "StepPlan", "BatchStepPlan", "PrefixCacheStats",
           "ContextDraftStates"]
