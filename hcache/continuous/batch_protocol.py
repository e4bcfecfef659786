"""The batch protocol shared by the continuous-batching managers (docs/design.md §5, §5.1).

A :class:`BatchProtocol` owns what MAX's ``claim`` -> (``fetch`` -> writes -> ``step``) ... ->
``release`` cycle keeps besides the device data: the :class:`SequenceBlocks` (which block holds
which sequence, its committed tokens), the one batch in flight with the thread that fetched it,
and the re-entrant lock (a ``threading.Condition``, the store's) that guards them all. A manager
composes one, hands it its store (index buffers, stream order) and its collection class, and
delegates the protocol's queries and commands to it; what differs between managers (the device
layout, the collection's views and writes) stays theirs.

Invariants: a batch is in flight exactly when it has an owner thread; ``step`` and ``reset``
end it and wake ``fetch(wait=True)`` waiters; an in-flight sequence cannot be released.
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np

from .._checks import as_int, exact_int, token_counts
from ..runtime.device import launch_scope, stream_handle
from .invariants import broken_manager_invariants
from .sequences import SequenceBlocks, seq_id_list, token_count_array

__all__ = ["BatchInFlightError", "BatchProtocol"]


class BatchInFlightError(ValueError):
    """``fetch`` was called while another batch is in flight (not yet stepped)."""


class BatchProtocol:
    """Claims, the batch in flight and its lock for one manager's store.

    Parameters
    ----------
    manager : object
        The manager whose collections this protocol accepts (``collection.manager``); held by a
        weak reference, so that a manager is freed as soon as it is dropped.
    store : KVBlockStore or HybridBlockStore
        Its ``lock`` guards this protocol; ``load_batch`` fills the index buffers of a batch;
        ``device`` and ``order`` order a released block's reuse.
    num_blocks, max_seq_len : int
        Blocks (= most live sequences) and tokens per sequence.
    collection_type : type
        What ``fetch`` returns, built as ``collection_type(manager, store, seq_ids, blocks,
        lengths, *collection_args)``; named in the errors for a foreign argument.
    collection_args : tuple
        What else the collections take (the layer routes of a hybrid manager).
    """

    def __init__(self, manager, store, num_blocks, max_seq_len, collection_type,
                 collection_args=()):
        self._manager, self._store = weakref.ref(manager), store
        self._collection_type, self._collection_args = collection_type, collection_args
        self.lock = store.lock                          # one lock for the manager and its batch
        self.sequences = SequenceBlocks(num_blocks, max_seq_len)
        self.in_flight = None                          # the fetched batch not yet stepped
        self._owner: threading.Thread | None = None    # the thread that fetched it

    # --- queries (thread-safe) --------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        with self.lock:
            return len(self.sequences.free)

    @property
    def num_live_sequences(self) -> int:
        with self.lock:
            return len(self.sequences.block_of)

    @property
    def cache_lengths(self) -> dict[int, int]:
        with self.lock:
            return self.sequences.lengths()

    def can_claim(self, batch_size) -> bool:
        n = as_int("batch_size", batch_size, 0)
        with self.lock:
            return n <= len(self.sequences.free)

    def block_of(self, seq_id) -> int:
        sid = exact_int("seq_id", seq_id)
        with self.lock:
            return self.sequences.block(sid)

    # --- commands ---------------------------------------------------------------------------

    def claim(self, n: int) -> list[int]:
        """``n`` (an int >= 0, checked by the caller) fresh seq_ids, all or none."""
        with self.lock:
            return self.sequences.claim(n)

    def fetch(self, seq_ids, wait, timeout, stream):
        """Validate every argument, wait out (or refuse) the batch in flight, load the index
        buffers and make a collection of them the batch in flight; see the managers'
        ``fetch``."""
        ids = seq_id_list(seq_ids)
        if not isinstance(wait, (bool, np.bool_)):
            raise TypeError(f"wait: expected a bool, got {type(wait).__name__}")
        if not ids:
            raise ValueError("seq_ids: expected at least one seq_id, got 0")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer,
                                                                      np.floating)):
                raise TypeError(f"timeout: expected None or seconds, "
                                f"got {type(timeout).__name__}")
            if math.isnan(timeout) or timeout < 0:
                raise ValueError(f"timeout: expected seconds >= 0, got {timeout}")
        stream_handle(stream)   # validates ``stream`` before anything
        with self.lock:
            if self.in_flight is not None:
                # the Thread object, not get_ident(): idents are recycled once a thread exits
                if not wait or self._owner is threading.current_thread():
                    raise BatchInFlightError("fetch: expected no batch in flight, got one of "
                                             f"seq_ids {list(self.in_flight.seq_ids)}; step it")
                if not self.lock.wait_for(lambda: self.in_flight is None, timeout):
                    raise BatchInFlightError(f"fetch: expected the batch in flight to be "
                                             f"stepped within {timeout} s, got none")
            blocks = self.sequences.blocks_of(ids)
            lengths = self.sequences.block_len[blocks]
            self._store.load_batch(blocks, lengths, stream)
            batch = self._collection_type(self._manager(), self._store, ids, blocks, lengths,
                                          *self._collection_args)
            self.in_flight, self._owner = batch, threading.current_thread()
            return batch

    def step(self, valid_lengths, collection) -> None:
        """Commit ``valid_lengths[i]`` more tokens to row ``i`` of the batch in flight and end
        it; every check before the first change."""
        with self.lock:
            self.check_active(collection, "step")
            cap = self.sequences.max_seq_len
            add = token_count_array(valid_lengths, collection.batch_size, cap)
            old = collection.cache_lengths_host
            new = old + add
            if (new > cap).any():
                i = int(np.flatnonzero(new > cap)[0])
                got = token_counts(valid_lengths, collection.batch_size)[i]   # exact value
                raise ValueError(f"valid_lengths[{i}]: expected at most {cap - int(old[i])} "
                                 f"for seq_id {collection.seq_ids[i]}, got {got}")
            self.sequences.commit(collection.lookup_table_host, new)
            self.in_flight, self._owner = None, None
            self.lock.notify_all()

    def release(self, seq_id, stream) -> None:
        """Free a live sequence's block, its reuse ordered after the work on ``stream``."""
        sid = exact_int("seq_id", seq_id)
        stream_handle(stream)
        with self.lock:
            self.sequences.block(sid)   # raises for an unknown id
            if self.in_flight is not None and sid in self.in_flight.seq_ids:
                raise ValueError(f"seq_id: expected a sequence not in the batch in flight, "
                                 f"got {sid}; step the batch first")
            with launch_scope(self._store.device, stream, self._store.order):
                pass   # the block's reuse is ordered after the work queued on ``stream``
            self.sequences.release(sid)

    def reset(self) -> None:
        """Release every live sequence and end the batch in flight."""
        with self.lock:
            self.sequences.reset()
            self.in_flight, self._owner = None, None
            self.lock.notify_all()

    # --- checks -----------------------------------------------------------------------------

    def check_active(self, collection, what: str) -> None:
        """Raise unless ``collection`` is this manager's batch in flight (under the lock)."""
        kind = self._collection_type
        if not isinstance(collection, kind):
            raise TypeError(f"collection: expected a {kind.__name__}, "
                            f"got {type(collection).__name__}")
        if collection.manager is not self._manager():
            raise ValueError(f"{what}: expected a collection of this manager, got a foreign one")
        if self.in_flight is not collection:
            raise ValueError(f"{what}: expected the batch in flight, got an ended collection")

    def check_invariants(self, owner_name: str) -> None:
        """``RuntimeError`` naming ``owner_name`` and listing every broken invariant
        (:func:`~hcache.continuous.invariants.broken_manager_invariants`); synchronizes on
        cuda."""
        with self.lock:
            p = broken_manager_invariants(self.sequences, self.in_flight, self._owner)
            if p:
                raise RuntimeError(f"{owner_name}: broken invariants:\n- " + "\n- ".join(p))
