"""What :class:`~hcache.contexts.DynamicInferenceContext` tells the engine to compute, and its
counters (docs/design.md §6).

- :class:`StepPlan`: one request's work in the current step (``add_request``,
  ``extend_request``);
- :class:`BatchStepPlan`: the work of a batch of extended requests (``extend_requests``), as
  arrays, with a :class:`StepPlan` per request on demand;
- :class:`PrefixCacheStats`: prefix-cache counters, per request and in total.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PrefixCacheStats", "StepPlan", "BatchStepPlan"]


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, per request or in total."""

    requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0      # tokens scheduled for computation (prefill and extensions)
    skipped_tokens: int = 0       # prompt tokens restored instead of computed
    kv_hit_blocks: int = 0        # complete prompt blocks found in the KV map
    kv_miss_blocks: int = 0       # complete prompt blocks not found
    mamba_hits: int = 0           # requests that restored a cached Mamba state
    stored_states: int = 0        # Mamba states committed to the cache (totals only)

    def add(self, other: PrefixCacheStats) -> None:
        """Add ``other``'s counters to these, field by field (in place)."""
        mine, theirs = self.__dict__, other.__dict__
        for name in self.__dataclass_fields__:
            mine[name] += theirs[name]


@dataclass(frozen=True)
class StepPlan:
    """What the engine computes for one request in the current step.

    Attributes
    ----------
    request_id : hashable
    row : int
        Request row (index of ``request_to_kv_block_ids`` and the intermediate tracking).
    mamba_slot : int
        Live Mamba slot: the state before ``start`` is ``mamba_*_states[:, mamba_slot]``.
    start, end : int
        Positions ``[start, end)`` to compute; ``tokens`` are the request's tokens there.
    tokens : numpy.ndarray of int64 [end - start]
    block_ids : numpy.ndarray of int32 [ceil(end / block_size)]
        The request's blocks (position ``p`` lives in ``block_ids[p // block_size]``).
    skip_tokens : int
        Prompt tokens restored from the cache (first step only).
    num_matched_blocks : int
        Complete prompt blocks shared from the KV cache (first step only).
    restored_block : int
        KV block whose Mamba state was restored, or -1 (zeroed, or continued).
    """

    request_id: object
    row: int
    mamba_slot: int
    start: int
    end: int
    tokens: np.ndarray
    block_ids: np.ndarray
    skip_tokens: int = 0
    num_matched_blocks: int = 0
    restored_block: int = -1


@dataclass(slots=True)     # not frozen: built every decode step, a frozen init costs 5x
class BatchStepPlan:
    """What the engine computes for a batch of extended requests in the current step.

    Request ``i`` (``request_ids[i]``) computes positions ``[starts[i], ends[i])``, its new
    tokens, which are ``tokens[token_offsets[i]:token_offsets[i + 1]]``, from the live Mamba
    state ``mamba_*_states[:, mamba_slots[i]]``; position ``p`` lives in block
    ``block_table[i, p // block_size]``. An extension restores nothing, so every
    :class:`StepPlan` of the batch has ``skip_tokens == 0``, ``num_matched_blocks == 0`` and
    ``restored_block == -1``. ``plan[i]`` (and iteration) builds request ``i``'s
    :class:`StepPlan`, ``len(plan)`` is the batch size.

    Attributes
    ----------
    request_ids : list
        In the order of the call.
    rows : numpy.ndarray of int64 [n]
        Request rows.
    mamba_slots : numpy.ndarray of int32 [n]
        Live Mamba slots.
    starts, ends : numpy.ndarray of int64 [n]
        Positions to compute; ``ends - starts`` tokens each (>= 1).
    token_offsets : numpy.ndarray of int64 [n + 1]
        Prefix sums of ``ends - starts``.
    tokens : numpy.ndarray of int64 [token_offsets[-1]]
        The batch's new tokens, request after request.
    block_table : numpy.ndarray of int32 [n, max_blocks_per_request]
        A copy of the requests' block-table rows (-1 = none): ``ceil(ends[i] / block_size)``
        blocks each.
    """

    request_ids: list
    rows: np.ndarray
    mamba_slots: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    token_offsets: np.ndarray
    tokens: np.ndarray
    block_table: np.ndarray

    def __len__(self) -> int:
        return len(self.request_ids)

    def __getitem__(self, i: int) -> StepPlan:
        """Request ``i``'s :class:`StepPlan` (its arrays are copies)."""
        i = range(len(self.request_ids))[i]      # IndexError out of range, negatives allowed
        blocks = self.block_table[i]
        return StepPlan(self.request_ids[i], int(self.rows[i]), int(self.mamba_slots[i]),
                        int(self.starts[i]), int(self.ends[i]),
                        self.tokens[self.token_offsets[i]:self.token_offsets[i + 1]].copy(),
                        blocks[blocks >= 0].copy())

    def __iter__(self):
        return (self[i] for i in range(len(self.request_ids)))

