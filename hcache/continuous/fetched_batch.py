"""What every continuous-batching collection is: one fetched batch's rows (docs/design.md §5).

A :class:`FetchedBatch` owns the rows of a batch that a manager's ``fetch`` started: their
seq_ids, the device ``lookup_table`` / ``cache_lengths`` views of the store's index buffers and
their read-only host mirrors, valid while the batch is in flight (only ``step`` commits, and an
in-flight sequence cannot be released, so the mirrors never go stale before the batch ends).
The collections of both managers extend it with their cache views and writes; the checks their
writes share are its ``_check_rows`` (the shape of token rows), :func:`ragged_token_counts` (the
new tokens of a ragged write) and :func:`check_room` (the room left in every row).
"""

from __future__ import annotations

import numpy as np

from .._checks import token_counts
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle

__all__ = ["FetchedBatch", "check_room", "ragged_token_counts"]


class FetchedBatch:
    """The rows of one fetched batch; built by a manager's ``fetch`` (through a collection).

    Parameters
    ----------
    manager : object
        The manager that fetched the batch (its ``in_flight`` decides :attr:`is_active`).
    store : KVBlockStore or HybridBlockStore
        Holds the index buffers ``lookup_table`` and ``cache_lengths`` (``[num_blocks]``).
    seq_ids : sequence of int
    host_blocks, host_lengths : numpy.ndarray, int64 [batch]
        What ``fetch`` loaded into the index buffers; viewed read-only, never copied.
    """

    __copy__, __deepcopy__, __reduce_ex__ = refuse_copy, refuse_deepcopy, refuse_pickle

    __slots__ = ("_manager", "_store", "seq_ids", "lookup_table", "cache_lengths", "_blocks",
                 "_lengths", "_room")

    def __init__(self, manager, store, seq_ids, host_blocks, host_lengths):
        self._manager, self._store = manager, store
        self.seq_ids = tuple(seq_ids)
        self.lookup_table = store.lookup_table[:len(self.seq_ids)]
        self.cache_lengths = store.cache_lengths[:len(self.seq_ids)]
        self._blocks, self._lengths = host_blocks.view(), host_lengths.view()
        self._blocks.flags.writeable = False
        self._lengths.flags.writeable = False
        # new tokens every row takes (max_seq_len - the longest row): a write within it needs
        # no per-row check against the host mirrors
        self._room = store.max_seq_len - int(host_lengths.max()) if len(host_lengths) else 0

    manager = property(lambda self: self._manager, doc="The manager that fetched this batch.")
    batch_size = property(lambda self: len(self.seq_ids), doc="Number of rows.")

    @property
    def is_active(self) -> bool:
        """True from ``fetch`` until ``step`` ends the batch."""
        return self._manager.in_flight is self

    @property
    def blocks(self) -> tuple[int, ...]:
        """Host copy of ``lookup_table``: the block of each row."""
        return tuple(int(b) for b in self._blocks)

    @property
    def host_cache_lengths(self) -> tuple[int, ...]:
        """Host copy of ``cache_lengths``: committed tokens of each row at fetch time (the
        ints of :attr:`cache_lengths_host`)."""
        return tuple(int(n) for n in self._lengths)

    @property
    def lookup_table_host(self) -> np.ndarray:
        """Read-only host mirror of ``lookup_table``, int64 ``[batch]``."""
        return self._blocks

    @property
    def cache_lengths_host(self) -> np.ndarray:
        """Read-only host mirror of ``cache_lengths``, int64 ``[batch]``."""
        return self._lengths

    @property
    def is_context_encoding(self) -> bool:
        """True when every row's cache is empty (the batch encodes prompts)."""
        return not bool(self._lengths.any())

    def _check_rows(self, name, a, heads, size, ragged=False, dtype=None) -> None:
        """``ValueError`` naming ``name`` unless ``a`` is token rows of ``heads x size``:
        ``[batch, new_tokens, heads, size]``, or ``[total_tokens, heads, size]`` when
        ``ragged``; of ``dtype`` when one is given; C-contiguous."""
        if ragged:
            if a.ndim != 3 or tuple(a.shape[1:]) != (heads, size):
                raise ValueError(f"{name}: expected shape [total_tokens, {heads}, {size}], "
                                 f"got {tuple(a.shape)}")
        elif a.ndim != 4 or a.shape[0] != self.batch_size or tuple(a.shape[2:]) != (heads, size):
            raise ValueError(f"{name}: expected shape [{self.batch_size}, new_tokens, {heads}, "
                             f"{size}], got {tuple(a.shape)}")
        if dtype is not None and a.dtype != dtype:
            raise ValueError(f"{name}: expected dtype {dtype}, got {a.dtype}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous array")

    def __repr__(self) -> str:
        state = "active" if self.is_active else "ended"
        return (f"{type(self).__name__}(seq_ids={list(self.seq_ids)}, "
                f"blocks={list(self.blocks)}, cache_lengths={list(self.host_cache_lengths)}, "
                f"{state})")


def ragged_token_counts(seq_lengths, batch: int, max_seq_len: int) -> np.ndarray:
    """``seq_lengths`` (host ints, one per row) as int64 ``[batch]``; ``TypeError`` /
    ``ValueError`` naming ``seq_lengths`` for a bad count or one above ``max_seq_len`` (refused
    before a sum could overflow int64)."""
    listed = token_counts(seq_lengths, batch, "seq_lengths")
    big = [i for i, c in enumerate(listed) if c > max_seq_len]
    if big:
        raise ValueError(f"seq_lengths[{big[0]}]: expected at most {max_seq_len} new tokens, "
                         f"got {listed[big[0]]}")
    return np.asarray(listed, dtype=np.int64)


def check_room(name: str, batch: FetchedBatch, counts: np.ndarray, max_seq_len: int) -> None:
    """``ValueError`` naming ``name`` unless every row of ``batch`` takes its ``counts`` new
    tokens without passing ``max_seq_len``."""
    lengths = batch.cache_lengths_host
    over = np.flatnonzero(lengths + counts > max_seq_len)
    if over.size:
        i = int(over[0])
        raise ValueError(f"{name}: expected at most {max_seq_len - int(lengths[i])} new tokens "
                         f"for row {i} (seq_id {batch.seq_ids[i]}), got {int(counts[i])}")
