"""The arrays and counters :class:`~hcache.contexts.DynamicInferenceContext` exposes, read
from its collaborators (docs/design.md §6): live Mamba states, host block tables, the step's
scratch states, and derived values.
"""

from __future__ import annotations

from operator import attrgetter

__all__ = ["ContextViews"]


class ContextViews:
    """Read-only views of a context's collaborators (the arrays are written in place by the
    context's methods)."""

    # The collaborators' arrays (see Attributes), written in place by the methods.
    mamba_conv_states = property(attrgetter("_live.conv_states"), doc=(
        "Live conv states ``[num_mamba_layers, max_requests, *conv_states_shape]`` (the model "
        "reads and writes column ``plan.mamba_slot``); None without a conv state."))
    mamba_ssm_states = property(attrgetter("_live.ssm_states"), doc=(
        "Live SSM states ``[num_mamba_layers, max_requests, *ssm_states_shape]`` (column "
        "``plan.mamba_slot``); None without a recurrent state."))
    request_to_kv_block_ids = property(attrgetter("_requests.request_to_kv_block_ids"), doc=(
        "Host block table ``int32 [max_requests, max_blocks_per_request]`` by request row; "
        "-1 = no block."))
    request_to_mamba_state_idx = property(attrgetter("_requests.request_to_mamba_state_idx"),
                                          doc="Host ``int32 [max_requests]``: request row -> "
                                              "live Mamba slot; -1 = none.")

    @property
    def intermediate_conv_out(self):
        """Scratch conv states the model writes at :meth:`snapshot_targets`,
        ``[num_mamba_layers, max_intermediate_count, *conv_states_shape]``: the state after
        ``offset`` computed tokens goes to ``[:, scratch_index]``. None without Mamba state
        caching (``mamba_cache_slots=0``, prefix caching off, no Mamba layers) or without a
        conv state. The same array as ``mamba_slot_allocator.intermediate_conv_out``."""
        allocator = self.mamba_slot_allocator
        return None if allocator is None else allocator.intermediate_conv_out

    @property
    def intermediate_ssm_out(self):
        """Scratch SSM states, ``[num_mamba_layers, max_intermediate_count,
        *ssm_states_shape]``; as :attr:`intermediate_conv_out`."""
        allocator = self.mamba_slot_allocator
        return None if allocator is None else allocator.intermediate_ssm_out

    @property
    def block_size(self) -> int:
        """Alias of :attr:`block_size_tokens` (Megatron-LM's name), the name
        :class:`PagedKVPool` uses."""
        return self.block_size_tokens

    @property
    def prefix_caching_enabled(self) -> bool:
        """Whether complete blocks are hashed, registered and shared between requests."""
        return self.kv_block_allocator.enable_prefix_caching

    @property
    def prefix_cache_lru_clock(self) -> int:
        """The KV block allocator's LRU clock (advanced once per :meth:`commit_step`)."""
        return self.kv_block_allocator.clock

    @property
    def num_active_requests(self) -> int:
        """Requests added and not released."""
        return len(self._requests)

    request_ids = property(attrgetter("_requests.ids"),
                           doc="The active request ids, in admission order (a new list).")

