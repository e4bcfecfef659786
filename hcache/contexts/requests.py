"""Per-request records of :class:`~hcache.contexts.DynamicInferenceContext` (docs/design.md §6).

- :class:`PrefixCacheStats`: prefix-cache counters, per request and in total;
- :class:`StepPlan`: what the engine computes for one request in the current step;
- ``_Request``: the context's private record of an active request (row, live Mamba slot,
  tokens, blocks, hashes and progress counters), and ``_Chunk``, the request view that
  :meth:`MambaSlotAllocator.compute_and_store_offsets` reads;
- :class:`RequestTableMixin`: the request-id -> record table and its per-request queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["PrefixCacheStats", "StepPlan", "RequestTableMixin"]


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
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


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


@dataclass
class _Request:
    request_id: object
    row: int
    live_slot: int
    tokens: list
    prompt_length: int
    blocks: list
    hashes: list                  # hashes of the complete blocks of `tokens` computed so far
    computed: int = 0             # tokens whose KV and Mamba state are final
    kv_cached: int = 0            # positions below this live in shared (matched) blocks
    registered: int = 0           # leading blocks whose hashes are registered
    pending_end: int = -1         # end of the scheduled step, or -1
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    @property
    def finished_chunk_token_count(self) -> int:
        return self.computed


@dataclass(frozen=True)
class _Chunk:
    """The request view :meth:`MambaSlotAllocator.compute_and_store_offsets` reads."""

    prompt_length: int
    finished_chunk_token_count: int


class RequestTableMixin:
    """The request table of :class:`~hcache.contexts.DynamicInferenceContext`.

    Relies on the context's ``_requests`` (request id -> ``_Request``, insertion order),
    ``request_to_kv_block_ids`` and ``request_to_mamba_state_idx``.
    """

    @property
    def num_active_requests(self) -> int:
        return len(self._requests)

    @property
    def request_ids(self) -> list:
        return list(self._requests)

    def request_stats(self, request_id) -> PrefixCacheStats:
        """Counters of one live request (a copy)."""
        return PrefixCacheStats(**vars(self._get(request_id).stats))

    def block_ids(self, request_id) -> np.ndarray:
        """The request's block-table row, ``int32 [num_blocks]`` (a copy)."""
        r = self._get(request_id)
        return np.asarray(r.blocks, dtype=np.int32)

    def num_computed_tokens(self, request_id) -> int:
        return self._get(request_id).computed

    def mamba_slot(self, request_id) -> int:
        """The request's live Mamba slot."""
        return self._get(request_id).live_slot

    def _get(self, request_id) -> _Request:
        try:
            return self._requests[request_id]
        except TypeError:
            raise TypeError(f"request_id: expected a hashable id, "
                            f"got {type(request_id).__name__}") from None
        except KeyError:
            raise ValueError(f"request_id: expected an active request, got {request_id!r}") \
                from None

    def _tokens(self, name, tokens) -> list:
        arr = np.asarray(tokens)
        if arr.size == 0:
            return []
        if arr.ndim == 0 or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name}: expected a 1-D sequence of ints, got {arr.dtype} "
                            f"{arr.shape}")
        if arr.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
        return arr.astype(np.int64).tolist()

    def _install(self, r: _Request) -> None:
        self.request_to_kv_block_ids[r.row] = -1
        self.request_to_kv_block_ids[r.row, :len(r.blocks)] = r.blocks
        self.request_to_mamba_state_idx[r.row] = r.live_slot
        self._requests[r.request_id] = r
