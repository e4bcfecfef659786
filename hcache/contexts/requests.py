"""Per-request records of :class:`~hcache.contexts.DynamicInferenceContext` (docs/design.md §6).

- :class:`PrefixCacheStats`: prefix-cache counters, per request and in total;
- :class:`StepPlan`: what the engine computes for one request in the current step;
- ``_Request``: the context's private record of an active request (row, live Mamba slot,
  tokens, blocks, hashes and progress counters), and ``_Chunk``, the request view that
  :meth:`MambaSlotAllocator.compute_and_store_offsets` reads;
- :class:`RequestTable`: the request-id -> record table, the free rows and live Mamba slots,
  and the host tables ``request_to_kv_block_ids`` / ``request_to_mamba_state_idx``;
- :func:`token_list`: the check of the token arguments of the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["PrefixCacheStats", "StepPlan", "RequestTable"]


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
    """The context's record of an active request (see :class:`RequestTable`)."""

    request_id: object
    row: int
    live_slot: int
    tokens: list
    blocks: list
    hashes: list                  # hashes of the complete blocks of `tokens` computed so far
    computed: int = 0             # tokens whose KV and Mamba state are final
    kv_cached: int = 0            # positions below this live in shared (matched) blocks
    registered: int = 0           # leading blocks whose hashes are registered
    pending_end: int = -1         # end of the scheduled step, or -1
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)


@dataclass(frozen=True)
class _Chunk:
    """The request view :meth:`MambaSlotAllocator.compute_and_store_offsets` reads."""

    prompt_length: int
    finished_chunk_token_count: int


class RequestTable:
    """The active requests of a context: id -> record, their rows and live Mamba slots, and the
    host tables the allocators read.

    Parameters
    ----------
    max_requests, max_blocks_per_request : int

    Attributes
    ----------
    request_to_kv_block_ids : int32 [max_requests, max_blocks_per_request]
        Block table: row -> the request's block ids; -1 = none.
    request_to_mamba_state_idx : int32 [max_requests]
        Row -> live Mamba slot; -1 = none.

    Notes
    -----
    Invariant: every active record owns one row and one live slot, written into the two tables;
    rows and live slots of no record are on the free lists, and their table entries are -1.
    """

    def __init__(self, max_requests: int, max_blocks_per_request: int):
        self.max_requests = max_requests
        self.request_to_kv_block_ids = np.full((max_requests, max_blocks_per_request), -1,
                                               dtype=np.int32)
        self.request_to_mamba_state_idx = np.full(max_requests, -1, dtype=np.int32)
        self._records: dict[object, _Request] = {}
        self.reset()

    def reset(self) -> None:
        """Forget every record; every row and live slot is free."""
        self._records.clear()
        self.request_to_kv_block_ids.fill(-1)
        self.request_to_mamba_state_idx.fill(-1)
        self._free_rows = list(range(self.max_requests - 1, -1, -1))   # pop(): lowest row first
        self._free_live_slots = list(range(self.max_requests))         # pop(): highest first

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, request_id) -> bool:
        return request_id in self._records

    @property
    def ids(self) -> list:
        """Active request ids in admission order."""
        return list(self._records)

    @property
    def has_free_row(self) -> bool:
        return bool(self._free_rows)

    def records(self):
        """The active records in admission order."""
        return self._records.values()

    def in_row_order(self) -> list:
        """The active records sorted by row."""
        return sorted(self._records.values(), key=lambda r: r.row)

    def get(self, request_id) -> _Request:
        """The record of an active request.

        Raises
        ------
        TypeError
            ``request_id`` is not hashable.
        ValueError
            No active request has this id.
        """
        try:
            return self._records[request_id]
        except TypeError:
            raise TypeError(f"request_id: expected a hashable id, "
                            f"got {type(request_id).__name__}") from None
        except KeyError:
            raise ValueError(f"request_id: expected an active request, got {request_id!r}") \
                from None

    def new_record(self, request_id, tokens: list, blocks: list, hashes: list) -> _Request:
        """A record for a new request on the lowest free row and a free live slot (the caller
        checked :attr:`has_free_row`); :meth:`install` makes it active."""
        return _Request(request_id, self._free_rows.pop(), self._free_live_slots.pop(), tokens,
                        blocks, hashes)

    def install(self, r: _Request) -> None:
        """Make ``r`` active and write its row of both tables (again after its blocks grew)."""
        self.request_to_kv_block_ids[r.row] = -1
        self.request_to_kv_block_ids[r.row, :len(r.blocks)] = r.blocks
        self.request_to_mamba_state_idx[r.row] = r.live_slot
        self._records[r.request_id] = r

    def release(self, records) -> None:
        """Forget active ``records``: clear their table rows, free their rows and live slots."""
        rows = [r.row for r in records]
        self.request_to_kv_block_ids[rows] = -1
        self.request_to_mamba_state_idx[rows] = -1
        for r in records:
            self._free_rows.append(r.row)
            self._free_live_slots.append(r.live_slot)
            del self._records[r.request_id]
