"""Device bytes a manager allocates, known before it allocates them (docs/design.md §2).

Every count is a sum over the buffers a manager makes at construction: the caches themselves,
then the metadata (descriptor tables, lengths, compaction plan, staging). Each function equals
the ``total`` of that manager's ``memory_report()`` after construction (the tests check that
for every manager), so a caller can size a configuration to a memory budget and a manager can
refuse one that does not fit before its first allocation. The functions take the config
objects by their fields (this module imports no config class: the configs import it).
"""

from __future__ import annotations

import math

from ..dtypes import is_fp8, resolve_dtype
from ..ops.tables import KV_LAYER_INFO_WORDS, compaction_plan_size

__all__ = ["kv_manager_nbytes", "mamba_manager_nbytes", "hybrid_manager_nbytes",
           "linear_manager_nbytes", "continuous_manager_nbytes",
           "continuous_hybrid_manager_nbytes", "paged_pool_nbytes",
           "context_states_nbytes", "largest_fitting"]

# per KV layer: its KVLayerInfo row, pointer scratch row (one KVLayerInfo wide), int32 label
_LAYER_TABLES = 2 * 8 * KV_LAYER_INFO_WORDS + 4
_SLOT_INFO = 32              # one SlotTensorInfo row (four uint64)
_I32 = 4


def _itemsize(dtype) -> int:
    return resolve_dtype(dtype).itemsize


def _kv_layer_bytes(lc, slots: int, tokens: int, itemsize: int) -> int:
    """One attention layer's cache: ``components`` planes (K and V, or one latent plane)."""
    return slots * lc.components * lc.num_kv_heads * tokens * lc.head_dim * itemsize


def _kv_writer_bytes(max_batch: int, num_layers: int, max_heads: int, dtype) -> int:
    """``write_kv``'s staging (row offsets, positions, status word) and FP8 scale tables."""
    if not num_layers:
        return 0
    staged = (max_batch + 1 + max(max_batch, 1) + 1) * _I32
    return staged + (2 * num_layers * max_heads * 4 if is_fp8(dtype) else 0)


def _batch_state_bytes(max_batch: int, slot_tensors: int) -> int:
    """Lengths, staged increments, mapping, status word and plan of the batch API, the
    descriptor table of the tensors compaction moves (the slot tensors and the lengths), and
    admission's row and slot indices and its one-row lengths table."""
    return (5 * max_batch + 1 + compaction_plan_size(max_batch)) * _I32 \
        + (slot_tensors + 2) * _SLOT_INFO


def _mamba_states_bytes(c) -> int:
    """Both states of every layer and slot; an absent state (its shape fields all 0) is 0."""
    per_slot = (math.prod(c.recurrent_state_shape) * _itemsize(c.ssm_dtype)
                + math.prod(c.conv_state_shape) * _itemsize(c.conv_dtype))
    return c.num_layers * c.max_batch_size * per_slot


def _state_kinds(recurrent_shape, conv_shape) -> int:
    """How many of the two states (recurrent, conv) the layers have: a state whose shape
    holds a 0 is not allocated, so no descriptor table moves it."""
    return sum(1 for shape in (recurrent_shape, conv_shape) if all(int(n) for n in shape))


def _mamba_copies_bytes(num_layers: int, kinds: int, max_batch: int) -> int:
    """Two int32 slot indices and the tables of the captures (one per state the layers have)
    and of the restore (every state tensor); ``write_states``' three int32 ``[max_batch]``
    index buffers and its one-layer tables (one per kind, and both kinds together)."""
    one_layer = (kinds + (2 if kinds == 2 else 0)) if num_layers else 0
    return (2 + 3 * max_batch) * _I32 + (2 * kinds * num_layers + one_layer) * _SLOT_INFO


def kv_manager_nbytes(config) -> int:
    """Bytes a :class:`~hcache.KVCacheManager` of ``config`` allocates (caches, layer tables,
    write staging and FP8 scales); a ring layer's cache holds its window
    (``config.layer_cache_lengths``)."""
    b, layers = config.max_batch_size, config.layer_configs
    item = _itemsize(config.dtype)
    heads = max((lc.num_kv_heads for lc in layers), default=0)
    return (sum(_kv_layer_bytes(lc, b, s, item)
                for lc, s in zip(layers, config.layer_cache_lengths))
            + len(layers) * _LAYER_TABLES + _kv_writer_bytes(b, len(layers), heads, config.dtype))


def mamba_manager_nbytes(config) -> int:
    """Bytes a :class:`~hcache.MambaCacheManager` of ``config`` allocates (states and the
    tables of its slot copies)."""
    kinds = _state_kinds(config.recurrent_state_shape, config.conv_state_shape)
    return _mamba_states_bytes(config) + _mamba_copies_bytes(config.num_layers, kinds,
                                                             config.max_batch_size)


def hybrid_manager_nbytes(config) -> int:
    """Bytes a :class:`~hcache.HybridCacheManager` of ``config`` allocates: its KV and Mamba
    sub-managers and the batch state."""
    mamba = config.mamba
    state_tensors = 0 if mamba is None else mamba.num_layers * _state_kinds(
        mamba.recurrent_state_shape, mamba.conv_state_shape)
    return (kv_manager_nbytes(config.kv)
            + (mamba_manager_nbytes(mamba) if mamba is not None else 0)
            + _batch_state_bytes(config.max_batch_size, state_tensors))


def linear_manager_nbytes(config) -> int:
    """Bytes a :class:`~hcache.LinearKVCache` of ``config`` allocates."""
    c = config
    item = _itemsize(c.dtype)
    kv = (c.num_attention_layers * c.max_batch_size * 2 * c.num_kv_heads
          * c.max_sequence_length * c.head_dim * item)
    kv += c.num_attention_layers * _LAYER_TABLES + _kv_writer_bytes(
        c.max_batch_size, c.num_attention_layers, c.num_kv_heads, c.dtype)
    mamba = state_tensors = 0
    if c.num_mamba_layers:   # a state whose fields are 0 is absent: 0 bytes, no table rows
        recurrent = (c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size)
        conv = (c.conv_dim, c.conv_kernel)
        kinds = _state_kinds(recurrent, conv)
        per_slot = (math.prod(recurrent) * _itemsize(c.ssm_dtype)
                    + math.prod(conv) * _itemsize(c.conv_dtype))
        mamba = c.num_mamba_layers * c.max_batch_size * per_slot \
            + _mamba_copies_bytes(c.num_mamba_layers, kinds, c.max_batch_size)
        state_tensors = kinds * c.num_mamba_layers
    return kv + mamba + _batch_state_bytes(c.max_batch_size, state_tensors)


def continuous_manager_nbytes(dtype, num_heads: int, head_size: int, max_batch_size: int,
                              max_seq_len: int, num_layers: int, components: int = 2,
                              ring_window: int = 0) -> int:
    """Bytes a :class:`~hcache.ContinuousBatchingKVCacheManager` allocates: ``blocks_buf``
    (``components`` planes: 2, or 1 for an MLA cache; ``ring_window`` tokens per block for a
    ring, else ``max_seq_len``), the lookup table, lengths and row offsets of the batch in
    flight, the layer tables."""
    n, tokens = max_batch_size, ring_window or max_seq_len
    blocks = n * components * num_layers * tokens * num_heads * head_size * _itemsize(dtype)
    return blocks + (n + n + n + 1) * _I32 + num_layers * _LAYER_TABLES


def continuous_hybrid_manager_nbytes(config) -> int:
    """Bytes a :class:`~hcache.ContinuousBatchingHybridCacheManager` of ``config`` (a
    ``HybridCacheConfig``; ``max_batch_size`` blocks) allocates: a KV cache per cache-owning
    attention layer (a ring layer's of its window) and its layer table, the recurrent and conv
    states of every recurrent layer, the lookup table, lengths and row offsets of the batch in
    flight and, with states, the row / zero / claimed index buffers, one zero slot per state
    kind and the descriptor tables of the claim's zeroing and of the state writes (each kind
    alone and both together, for one layer and for every layer)."""
    kv, mamba, n = config.kv, config.mamba, config.max_batch_size
    item = _itemsize(kv.dtype)
    total = sum(_kv_layer_bytes(lc, n, s, item)
                for lc, s in zip(kv.layer_configs, kv.layer_cache_lengths))
    total += len(kv.layer_configs) * _LAYER_TABLES + (3 * n + 1) * _I32
    if mamba is None or not mamba.num_layers:
        return total
    kinds = [(math.prod(shape), _itemsize(dt)) for shape, dt in
             ((mamba.recurrent_state_shape, mamba.ssm_dtype),
              (mamba.conv_state_shape, mamba.conv_dtype)) if all(shape)]
    layers = mamba.num_layers
    total += sum(layers * n * size * i + size * i for size, i in kinds)   # pools, zero slots
    sets = [1] * len(kinds) + ([len(kinds)] if len(kinds) > 1 else [])   # kinds per write set
    rows = len(kinds) * layers + sum(k * (1 + layers) for k in sets)
    return total + 3 * n * _I32 + rows * _SLOT_INFO


def paged_pool_nbytes(layer_configs, num_blocks: int, block_size: int, dtype,
                      num_local_blocks=None) -> int:
    """Bytes a :class:`~hcache.PagedKVPool` allocates: its per-layer blocks (a sliding-window
    layer's in the local block space of ``num_local_blocks`` when given), the layer and copy
    tables, and the staging of the block ids of a copy (sized for the larger space)."""
    item = _itemsize(dtype)
    layers = sum(_kv_layer_bytes(lc, num_local_blocks if num_local_blocks is not None
                                 and lc.sliding_window is not None else num_blocks,
                                 block_size, item) for lc in layer_configs)
    ids = max(num_blocks, num_local_blocks or 0)
    return layers + len(layer_configs) * (_LAYER_TABLES + _SLOT_INFO) + 2 * ids * _I32


def context_states_nbytes(context, mamba_cache_slots: int, conv_shape, ssm_shape, conv_dtype,
                          ssm_dtype, snapshots_per_request: int = 3, local_tables=False) -> int:
    """Device bytes of a :class:`~hcache.DynamicInferenceContext` besides its paged pool: the
    live Mamba states, the cached ones and the per-step snapshots (when ``mamba_cache_slots``),
    and the staging of a step's KV writes (descriptor tables of a few bytes per layer aside).
    A state whose shape is ``None`` (the layers have no such state) counts 0 bytes.
    ``context`` gives the checked ``num_mamba_layers``, ``max_requests``,
    ``max_blocks_per_request`` and ``max_step_tokens``; ``local_tables``: the step also stages
    the block tables of the local block space (a pool with ``num_local_blocks``)."""
    rows = context.max_requests
    per_state = sum(math.prod(shape) * _itemsize(dt) for shape, dt in
                    ((conv_shape, conv_dtype), (ssm_shape, ssm_dtype)) if shape is not None)
    states = rows + (mamba_cache_slots + snapshots_per_request * rows
                     if mamba_cache_slots else 0)
    tables = 2 if local_tables else 1
    staging = (rows * (tables * context.max_blocks_per_request + 1) + 1
               + context.max_step_tokens) * _I32
    return context.num_mamba_layers * states * per_state + staging


def largest_fitting(nbytes_of, budget: int, *, upper: int = 2**31 - 1) -> int:
    """The largest ``n`` in ``[1, upper]`` with ``nbytes_of(n) <= budget``, or 0 if none.

    ``nbytes_of`` must not decrease as ``n`` grows (bytes of a manager by batch size or by
    block count). O(log n) calls: doubling, then bisection.
    """
    if nbytes_of(1) > budget:
        return 0
    lo, hi = 1, 2
    while hi <= upper and nbytes_of(hi) <= budget:
        lo, hi = hi, hi * 2
    hi = min(hi, upper + 1)      # nbytes_of(lo) fits; hi does not, or is past upper
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if nbytes_of(mid) <= budget else (lo, mid)
    return lo
