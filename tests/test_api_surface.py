"""The API surface of the first wave still stands after the floor-plan restructuring: every
public attribute of each manager and allocator (as the first wave had them), and the underscore
methods Megatron-LM's ``MambaSlotAllocator`` documents, still exist (their behaviour is the
subject of the other test modules)."""

from __future__ import annotations

import pytest

import hcache
from hcache import contexts
from hcache.contexts.mamba_slot_allocator import MAX_INTERMEDIATE_OFFSETS_PER_REQUEST

# Names listed from the first wave's classes (commit 6483678), before the restructuring.
FIRST_WAVE = {
    'HybridCacheManager': (
        'active_batch_size', 'batch_state_nbytes', 'capture_conv_states',
        'capture_kv_cache', 'capture_recurrent_states', 'commit_sequence_length',
        'compact_batch', 'config', 'device', 'get_combined_kv_cache', 'get_conv_state',
        'get_kv_cache_lengths', 'get_kv_head_dim_groups', 'get_layer_type',
        'get_recurrent_state', 'get_separate_kv_cache', 'kv_cache_all_empty',
        'kv_cache_manager', 'last_compaction_valid', 'mamba_cache_manager',
        'memory_report', 'num_layers', 'refresh_host_lengths', 'refused_commit_count',
        'reset_for_new_sequences', 'restore_kv_cache', 'restore_mamba_states',
        'set_active_batch_size',
    ),
    'KVCacheManager': (
        'capture_kv_cache', 'config', 'device', 'get_combined_kv_cache',
        'get_layer_config', 'get_separate_kv_cache', 'groups', 'is_uniform',
        'memory_report', 'num_layers', 'restore_kv_cache',
    ),
    'MambaCacheManager': (
        'capture_conv_states', 'capture_recurrent_states', 'clear_slot', 'clear_states',
        'config', 'device', 'get_conv_state', 'get_recurrent_state', 'memory_report',
        'metadata_nbytes', 'num_layers', 'restore_states', 'state_tensors',
    ),
    'LinearKVCache': (
        'active_batch_size', 'batch_state_nbytes', 'capture_conv_states',
        'capture_ssm_states', 'clear_mamba_states', 'commit_sequence_length',
        'compact_batch', 'config', 'device', 'get_combined_kv_cache_for_decoder_layer',
        'get_conv_state_for_layer', 'get_kv_cache_buffer', 'get_kv_cache_lengths',
        'get_separate_kv_cache_for_decoder_layer', 'get_ssm_state_for_layer',
        'kv_cache_all_empty', 'last_compaction_valid', 'memory_report',
        'refresh_host_lengths', 'refused_commit_count', 'reset_for_new_sequences',
        'restore_mamba_states', 'set_active_batch_size',
    ),
    'ContinuousBatchingKVCacheManager': (
        'block_of', 'blocks_buf', 'cache_lengths', 'can_claim', 'check_invariants',
        'claim', 'device', 'dtype', 'fetch', 'in_flight', 'kv_params', 'max_batch_size',
        'max_seq_len', 'memory_report', 'num_blocks', 'num_free_blocks', 'num_layers',
        'num_live_sequences', 'release', 'step',
    ),
    'ContinuousBatchingKVCacheCollection': (
        'batch_size', 'blocks', 'cache_lengths', 'host_cache_lengths', 'is_active',
        'is_context_encoding', 'key_cache', 'lookup_table', 'manager',
        'max_cache_length', 'seq_ids', 'value_cache', 'write',
    ),
    'KVBlockAllocator': (
        'add_blocks_deregistered_observer', 'advance_clock', 'allocate_memory_blocks',
        'allocate_memory_blocks_per_request', 'can_allocate_memory_blocks',
        'caches_released_blocks', 'check_invariants', 'clock', 'evict_lru_blocks',
        'free_block_ids', 'get_allocatable_count', 'get_evictable_block_count',
        'is_memory_available', 'num_blocks', 'num_cached_blocks', 'num_free_blocks',
        'num_used_blocks', 'register_kv_block_hashes', 'release_memory_blocks', 'reset',
        'retain_memory_blocks',
    ),
    'PagedKVPool': (
        'bytes_per_block', 'copy_blocks', 'get_layer', 'memory_report', 'nbytes',
        'num_layers', 'write',
    ),
    'MambaSlotAllocator': (
        '_clear_intermediate_state', '_collect_commit_data',
        '_copy_intermediate_to_cache', '_evict_lru_slots_batch',
        '_invalidate_blocks_batch', 'allocate_slots_batch', 'can_allocate_slots',
        'check_invariants', 'commit_intermediate_states', 'compute_and_store_offsets',
        'evictable_count', 'get_intermediate_gpu_data', 'get_slot', 'has_state',
        'intermediate_targets', 'invalidate_block', 'num_cached_states',
        'num_used_slots', 'on_kv_blocks_deregistered', 'register_block_hashes_batch',
        'reset', 'restore_to_live', 'restore_to_live_batch', 'store_from_live_batch',
        'store_from_tensors',
    ),
    'DynamicInferenceContext': (
        'add_request', 'block_ids', 'commit_step', 'extend_request', 'mamba_slot',
        'num_active_requests', 'num_computed_tokens', 'prefix_cache_lru_clock',
        'prefix_caching_enabled', 'release_requests', 'request_ids', 'request_stats',
        'reset', 'shares_pending_blocks', 'snapshot_targets', 'step', 'write_kv',
    ),
}

CLASSES = {name: getattr(hcache, name, None) or getattr(contexts, name) for name in FIRST_WAVE}


@pytest.mark.parametrize("name", sorted(FIRST_WAVE))
def test_first_wave_names_still_exist(name):
    missing = [n for n in FIRST_WAVE[name] if not hasattr(CLASSES[name], n)]
    assert not missing, f"{name} lost {missing}"


def test_megatron_constant_stays_in_its_module():
    assert MAX_INTERMEDIATE_OFFSETS_PER_REQUEST == 3


WRITERS = ["HybridCacheManager", "KVCacheManager", "LinearKVCache",
           "ContinuousBatchingKVCacheCollection", "PagedKVPool", "DynamicInferenceContext"]


@pytest.mark.parametrize("name", WRITERS)
def test_every_kv_writer_has_write_kv_with_the_shared_names(name):
    """One name and one vocabulary for writing K/V, whatever the cache (docs/design.md §4.9)."""
    import inspect

    cls = getattr(hcache, name, None) or getattr(contexts, name)
    params = inspect.signature(cls.write_kv).parameters
    assert {"k", "v", "k_scale", "v_scale", "stream"} <= set(params)
    for keyword in ("k_scale", "v_scale", "stream"):
        assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY
