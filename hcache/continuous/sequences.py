"""Which block holds which sequence, and how many tokens it has committed (docs/design.md §5).

A :class:`SequenceBlocks` is the bookkeeping of a continuous-batching manager, with no lock and no
device state of its own (the manager holds the lock around every call): a free heap of blocks, the
live seq_ids with their blocks, and the committed tokens of every block in one int64 array, so that
a decode step reads and commits the lengths of a whole batch with a few vectorized operations.

Invariants (:meth:`SequenceBlocks.broken_invariants`): every block is on the free heap or held by
exactly one live sequence; a free block has no committed tokens; every length is in
``[0, max_seq_len]``; every live seq_id is below the id counter (ids are never handed out twice).
"""

from __future__ import annotations

import heapq
from operator import itemgetter

import numpy as np

from .._checks import check_int, exact_int, refuse_unordered, token_counts
from ..errors import CacheCapacityError

__all__ = ["SequenceBlocks", "seq_id_list", "token_count_array", "draft_token_counts"]


class SequenceBlocks:
    """Blocks ``0..num_blocks-1``, each free or holding one live sequence's committed tokens.

    Parameters
    ----------
    num_blocks, max_seq_len : int
        Checked by the manager.
    """

    def __init__(self, num_blocks: int, max_seq_len: int):
        self.num_blocks = num_blocks
        self.max_seq_len = max_seq_len
        self.free: list[int] = list(range(num_blocks))   # a heap: claim takes the lowest block
        self.block_of: dict[int, int] = {}                # live seq_id -> block
        self.block_len = np.zeros(num_blocks, dtype=np.int64)   # block -> committed tokens
        self.next_id = 0                                  # ids below it were handed out once
        self._row_mark = np.full(num_blocks, -1, dtype=np.int64)   # duplicate detection
        self._rows = np.arange(num_blocks, dtype=np.int64)
        # The last looked-up ids and their blocks, valid until the next claim or release
        # (decode steps fetch the same batch again and again).
        self._last_lookup: tuple[list, np.ndarray] | None = None

    def lengths(self) -> dict[int, int]:
        """``{seq_id: committed tokens}`` of the live sequences."""
        return {s: int(self.block_len[b]) for s, b in self.block_of.items()}

    def block(self, seq_id: int) -> int:
        """The block of a live ``seq_id`` (an int); ``ValueError`` for an unknown one."""
        if seq_id not in self.block_of:
            raise ValueError(f"seq_id: expected a live sequence, got {seq_id}")
        return self.block_of[seq_id]

    def blocks_of(self, ids: list) -> np.ndarray:
        """The blocks of ``ids`` (Python ints), int64 ``[len(ids)]``, read-only.

        Raises
        ------
        ValueError
            An id is unknown (or released), or named twice.
        """
        last = self._last_lookup
        if last is not None and last[0] == ids:   # both lists of ints: == compares exactly
            return last[1]
        batch = len(ids)
        try:
            found = itemgetter(*ids)(self.block_of)
        except (KeyError, TypeError):
            unknown = [s for s in ids if s not in self.block_of]
            raise ValueError(f"seq_ids: expected live sequences, got unknown {unknown}") from None
        blocks = np.array(found if batch > 1 else (found,), dtype=np.int64)
        # Live ids hold distinct blocks, so a repeated id is a repeated block.
        rows = self._rows[:batch]
        self._row_mark[blocks] = rows
        if (self._row_mark[blocks] != rows).any():
            raise ValueError(f"seq_ids: expected distinct ids, got {ids}")
        blocks.flags.writeable = False
        self._last_lookup = (ids, blocks)
        return blocks

    def claim(self, n: int) -> list[int]:
        """Bind ``n`` new seq_ids to the lowest free blocks, all or none.

        Raises
        ------
        CacheCapacityError
            Fewer than ``n`` free blocks; nothing changes.
        """
        available = len(self.free)
        if n > available:
            raise CacheCapacityError(f"batch_size: expected at most {available} free blocks "
                                     f"(of {self.num_blocks}), got {n}",
                                     required=n, available=available)
        ids = list(range(self.next_id, self.next_id + n))
        self._last_lookup = None
        for sid in ids:
            block = heapq.heappop(self.free)
            self.block_of[sid] = block
            self.block_len[block] = 0
        self.next_id += n
        return ids

    def commit(self, blocks: np.ndarray, lengths: np.ndarray) -> None:
        """``block_len[blocks] = lengths`` (checked by the caller)."""
        self.block_len[blocks] = lengths

    def release(self, seq_id: int) -> None:
        """Return a live sequence's block to the free heap (checked by the caller)."""
        block = self.block_of.pop(seq_id)
        self._last_lookup = None
        self.block_len[block] = 0
        heapq.heappush(self.free, block)

    def reset(self) -> None:
        """Free every block and forget every live sequence; the id counter is kept, so ids
        handed out before stay unknown forever."""
        self.free[:] = range(self.num_blocks)
        self.block_of.clear()
        self.block_len[:] = 0
        self._last_lookup = None

    def broken_invariants(self) -> list[str]:
        """A message per broken invariant (see the module docstring); empty if none."""
        p: list[str] = []
        live, free, total = list(self.block_of.values()), self.free, self.num_blocks
        if self.block_len[free].any():
            p.append("a free block has committed tokens")
        if len(set(live)) != len(live):
            p.append(f"a block is held by two live sequences: {sorted(live)}")
        if len(set(free)) != len(free):
            p.append(f"a block is free twice: {sorted(free)}")
        if set(free) & set(live):
            p.append(f"blocks both free and live: {sorted(set(free) & set(live))}")
        if len(free) + len(live) != total or set(free) | set(live) != set(range(total)):
            p.append(f"free ({len(free)}) + live ({len(live)}) blocks do not make the "
                     f"{total} blocks")
        if any(free[(i - 1) // 2] > free[i] for i in range(1, len(free))):
            p.append("the free list is not a heap")
        bad = {s: int(self.block_len[b]) for s, b in self.block_of.items()
               if not 0 <= self.block_len[b] <= self.max_seq_len}
        if bad:
            p.append(f"lengths outside [0, {self.max_seq_len}]: {bad}")
        if any(not 0 <= s < self.next_id for s in self.block_of):
            p.append("a live seq_id was never handed out")
        return p


def seq_id_list(seq_ids) -> list:
    """``seq_ids`` as a list of Python ints (any size), checked for type only.

    Raises
    ------
    TypeError
        Not a sequence or a 1-D integer array, or an entry that is not an int (a bool, a
        float, ...).
    """
    if isinstance(seq_ids, np.ndarray):
        if seq_ids.ndim != 1 or seq_ids.dtype.kind not in "iu":
            raise TypeError(f"seq_ids: expected a 1-D integer array, got {seq_ids.dtype} "
                            f"with shape {seq_ids.shape}")
        return seq_ids.tolist()
    if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
        raise TypeError(f"seq_ids: expected a sequence of int, got {type(seq_ids).__name__}")
    refuse_unordered("seq_ids", seq_ids)
    ids = list(seq_ids)
    if set(map(type, ids)) <= {int}:
        return ids
    return [exact_int(f"seq_ids[{i}]", s) for i, s in enumerate(ids)]


def token_count_array(values, batch: int, cap: int) -> np.ndarray:
    """``valid_lengths`` as int64 ``[batch]``, each >= 0, entries above ``cap`` replaced by
    ``cap + 1`` (so that they are refused, never wrapped in int64).

    Raises
    ------
    TypeError, ValueError
        As :func:`hcache._checks.token_counts`.
    """
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind == "i" \
            and values.shape[0] == batch:
        if batch and int(values.min()) < 0:
            token_counts(values, batch)   # raises, naming the caller's values
        return np.minimum(values, cap + 1, dtype=np.int64)
    counts = token_counts(values, batch)
    if counts and max(counts) > cap:
        counts = [min(v, cap + 1) for v in counts]
    return np.array(counts, dtype=np.int64)


def draft_token_counts(accepted, num_draft_tokens, bonus_token, collection,
                       ring_window: int) -> np.ndarray:
    """The tokens each row keeps after a speculative step (docs/design.md §5, §4.13): ``kept =
    accepted + bonus_token`` of the ``num_draft_tokens`` written, as int64 ``[batch]``.

    Raises
    ------
    TypeError
        ``collection`` is no collection, ``accepted`` not host integers, ``bonus_token`` not a
        bool.
    ValueError
        A count out of ``[0, num_draft_tokens - bonus_token]``, or ring blocks (a rejected draft
        overwrote a token of the window).
    """
    batch = getattr(collection, "batch_size", None)
    if not isinstance(batch, int):
        raise TypeError(f"collection: expected a ContinuousBatchingKVCacheCollection, "
                        f"got {type(collection).__name__}")
    if not isinstance(bonus_token, (bool, np.bool_)):
        raise TypeError(f"bonus_token: expected a bool, got {type(bonus_token).__name__}")
    written = check_int("num_draft_tokens", num_draft_tokens, int(bonus_token))
    counts = token_counts(accepted, batch, "accepted")
    top = written - int(bonus_token)
    bad = [i for i, a in enumerate(counts) if a > top]
    if bad:
        raise ValueError(f"accepted[{bad[0]}]: expected a count in [0, {top}], "
                         f"got {counts[bad[0]]}")
    if ring_window:
        raise ValueError("step_draft: expected unbounded blocks (rejected drafts overwrite the "
                         f"window), got ring blocks of {ring_window} tokens")
    return np.asarray(counts, dtype=np.int64) + int(bonus_token)
