"""A :class:`~hcache.contexts.DynamicInferenceContext` for a model's layout: from a
:class:`~hcache.HybridCacheConfig` or a Hugging Face ``config.json`` (docs/design.md §6), as
the managers are built.
"""

from __future__ import annotations

from .._checks import as_int

__all__ = ["ContextConstructors"]


class ContextConstructors:
    """The config constructors of :class:`~hcache.contexts.DynamicInferenceContext`."""

    # --- constructors from a model's layout ------------------------------------------------------

    @classmethod
    def from_config(cls, config, *, block_size_tokens=16, num_blocks=None, max_requests=None,
                    mamba_cache_slots=None, **options):
        """A context for the layout of a :class:`~hcache.HybridCacheConfig`.

        Parameters
        ----------
        config : HybridCacheConfig
            Its attention layers that own a cache become the pool's layers (attention-index
            order; a layer in ``kv_sharing`` reads its owner's), its Mamba layers the live and
            cached states (shapes and dtypes of ``config.mamba``), ``config.kv.dtype`` the pool
            dtype. ``config.kv.max_sequence_length`` is the longest request (rounded up to whole
            blocks), ``config.max_batch_size`` the default ``max_requests``.
        block_size_tokens : int
            Tokens per KV block (default 16).
        num_blocks : int, optional
            Pool blocks; default: every request at full length
            (``max_requests * max_blocks_per_request``).
        max_requests : int, optional
            Request rows; default ``config.max_batch_size``.
        mamba_cache_slots : int, optional
            Cached Mamba states for prefix hits; default ``max_requests`` (0 without Mamba
            layers).
        **options
            Any other keyword of the constructor (``enable_prefix_caching``,
            ``eviction_policy``, ``mamba_chunk_size``, ``max_step_tokens``, ``device``,
            ``num_local_blocks``, ``registration_budget``).

        Raises
        ------
        TypeError
            ``config`` is not a ``HybridCacheConfig``, or an unknown keyword.
        ValueError, CacheCapacityError
            As the constructor.
        """
        from ..config.caches import HybridCacheConfig  # the config package imports contexts
        if not isinstance(config, HybridCacheConfig):
            raise TypeError(f"config: expected HybridCacheConfig, got {type(config).__name__}")
        block = as_int("block_size_tokens", block_size_tokens, 1)
        rows = config.max_batch_size if max_requests is None \
            else as_int("max_requests", max_requests, 1)
        per_request = -(-config.kv.max_sequence_length // block)
        mamba = config.mamba
        if mamba is not None:
            options.update(
                num_mamba_layers=mamba.num_layers,
                conv_states_shape=mamba.conv_state_shape if mamba.has_conv_state else None,
                ssm_states_shape=(mamba.recurrent_state_shape if mamba.has_recurrent_state
                                  else None),
                conv_states_dtype=mamba.conv_dtype, ssm_states_dtype=mamba.ssm_dtype)
        slots = (rows if mamba is not None else 0) if mamba_cache_slots is None \
            else mamba_cache_slots
        return cls(kv_layer_configs=config.kv.layer_configs,
                   num_blocks=rows * per_request if num_blocks is None else num_blocks,
                   block_size_tokens=block, max_requests=rows,
                   max_blocks_per_request=per_request, kv_dtype=config.kv.dtype,
                   mamba_cache_slots=slots, **options)

    @classmethod
    def from_hf_config(cls, config_dict, *, max_requests, max_sequence_length,
                       block_size_tokens=16, kv_dtype="float16", ssm_dtype="float32",
                       conv_dtype=None, **options):
        """A context for a model's Hugging Face ``config.json`` dict: the layout of
        :meth:`HybridCacheConfig.from_hf_config` (``max_batch_size=max_requests``, sliding-window
        layers paged at full length: pass ``num_local_blocks`` for their own block space), then
        :meth:`from_config` with ``block_size_tokens`` and ``**options``. Raises as both."""
        from ..config.caches import HybridCacheConfig
        rows = as_int("max_requests", max_requests, 1)   # named as passed, checked first
        block_size_tokens = as_int("block_size_tokens", block_size_tokens, 1)
        config = HybridCacheConfig.from_hf_config(
            config_dict, max_batch_size=rows, max_sequence_length=max_sequence_length,
            kv_dtype=kv_dtype, ssm_dtype=ssm_dtype, conv_dtype=conv_dtype, ring_windows=False)
        return cls.from_config(config, block_size_tokens=block_size_tokens, **options)

