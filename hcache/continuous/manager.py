"""Continuous-batching KV cache: one block per sequence, all layers (docs/design.md §5).

After MAX's Mojo ``ContinuousBatchingKVCacheManager``. ``blocks_buf`` is
``[num_blocks, 2, num_layers, max_seq_len, num_heads, head_size]`` with ``num_blocks =
max_batch_size``: block ``b`` holds one sequence's K (``[:, 0]``) and V (``[:, 1]``) of every
layer; with ``kv_params.is_mla`` it is ``[num_blocks, 1, ...]``, latent vectors as K and no V.
A request: ``claim`` -> (``fetch`` -> ``write`` per layer -> ``step``) per chunk -> ``release``.

Design decisions (where the reference is silent or not thread-safe):

* **seq_ids are not block indices.** ``claim`` hands out ids from a never-repeating counter,
  each bound to the lowest free block: a stale id never aliases a newer sequence in its block.
* **One batch in flight**, shared by all threads, as in the reference: ``fetch`` fills
  preallocated device buffers (``lookup_table``, ``cache_lengths``) that ``step`` frees for the
  next batch. A second ``fetch`` raises :class:`BatchInFlightError` (a ``ValueError``), or with
  ``wait=True`` blocks until the batch is stepped (refused at once for the thread that holds it).
* **An in-flight sequence cannot be released** (``ValueError``): the batch's kernels read its
  block until ``step`` (step with zero lengths to end a batch without committing).
* **Thread safety**: one re-entrant lock (with a condition for ``wait``) guards all bookkeeping;
  every method validates, then mutates, under it. ``write`` holds it across the launch so that a
  concurrent ``step`` cannot end the batch half-way. ``fetch`` and ``write`` should use one
  stream (the index buffers are reused by the next ``fetch``).

The manager runs the batch protocol (claims, the batch in flight, threads); which block holds
which sequence and its tokens are a :class:`~hcache.continuous.sequences.SequenceBlocks`; its
device side (``blocks_buf``, index buffers, the lock) a
:class:`~hcache.continuous.store.KVBlockStore` shared with the batches it hands out.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from .._checks import as_int, exact_int, token_counts
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..dtypes import dtype_name
from ..memory import check_fits
from ..rings import ring_start
from ..runtime.device import Device, launch_scope, resolve_device, stream_handle
from .collection import ContinuousBatchingKVCacheCollection
from .invariants import broken_manager_invariants
from .params import KVCacheStaticParams, manager_arguments
from .sequences import SequenceBlocks, draft_token_counts, seq_id_list, token_count_array
from .store import KVBlockStore

__all__ = ["KVCacheStaticParams", "ContinuousBatchingKVCacheManager",
           "ContinuousBatchingKVCacheCollection", "BatchInFlightError"]


class BatchInFlightError(ValueError):
    """``fetch`` was called while another batch is in flight (not yet stepped)."""


class ContinuousBatchingKVCacheManager:
    """KV caches of up to ``max_batch_size`` live sequences, one block each.

    Parameters
    ----------
    dtype : str or numpy.dtype
        One of the seven cache dtypes (docs/design.md §2).
    kv_params : KVCacheStaticParams
    max_batch_size, max_seq_len, num_layers : int
        Each >= 1; ``max_seq_len`` below 2**31.
    device : None, "cpu", "cuda" or "cuda:N"
    sliding_window : int, optional
        A window ``W`` for every layer (a model whose layers all attend locally, e.g.
        Mistral 7B v0.1): when ``W < max_seq_len`` each block holds a ring of ``W`` tokens per
        layer, position ``p`` at entry ``p mod W`` (``blocks_buf`` is ``[num_blocks, C,
        num_layers, W, num_heads, head_size]``); lengths stay absolute, up to ``max_seq_len``,
        and :meth:`ring_start` gives the oldest valid entry. Default: unbounded blocks.

    Raises
    ------
    TypeError, ValueError
        An argument has the wrong type or value.
    CacheCapacityError
        The blocks do not fit in the memory available on the device
        (:meth:`KVCacheStaticParams.nbytes`); nothing is allocated.
    """

    __copy__, __deepcopy__, __reduce_ex__ = refuse_copy, refuse_deepcopy, refuse_pickle

    CollectionType = ContinuousBatchingKVCacheCollection   # MAX's name: what fetch returns

    def __init__(self, dtype, kv_params, max_batch_size, max_seq_len, num_layers, *,
                 device=None, sliding_window=None):
        self._dtype, n, self._max_seq_len, self._num_layers, self._ring_window = \
            manager_arguments(dtype, kv_params, max_batch_size, max_seq_len, num_layers,
                              sliding_window)
        self._kv_params, self._num_blocks = kv_params, n
        self._device = resolve_device(device)
        check_fits("max_batch_size", kv_params.nbytes(
            dtype, n, self._max_seq_len, self._num_layers, sliding_window=sliding_window),
            self._device)
        self._store = KVBlockStore(self._device, self._dtype, n, self._num_layers,
                                   self._max_seq_len, kv_params.num_heads, kv_params.head_size,
                                   ring_window=self._ring_window,
                                   components=kv_params.components)
        self._cond = self._store.lock                  # one lock for the manager and its batch
        self._sequences = SequenceBlocks(n, self._max_seq_len)
        self._inflight: ContinuousBatchingKVCacheCollection | None = None
        self._inflight_owner: threading.Thread | None = None   # the thread that fetched it

    # --- geometry ---------------------------------------------------------------------------

    dtype = property(lambda self: self._dtype, doc="The cache dtype.")
    kv_params = property(lambda self: self._kv_params, doc="The KV head geometry.")
    device = property(lambda self: self._device, doc="The resolved device.")
    num_blocks = property(lambda self: self._num_blocks, doc="Blocks (= max_batch_size).")
    max_batch_size = property(lambda self: self._num_blocks, doc="Most live sequences.")
    max_seq_len = property(lambda self: self._max_seq_len, doc="Tokens per sequence.")
    max_sequence_length = property(max_seq_len.fget, doc="Alias of max_seq_len (MAX's name).")
    ring_window = property(lambda self: self._ring_window,
                           doc="Tokens a block holds per layer when it is a ring, else 0.")
    num_layers = property(lambda self: self._num_layers, doc="Decoder layers per block.")

    @property
    def blocks_buf(self):
        """The cache, ``[num_blocks, 2, num_layers, T, num_heads, head_size]`` (K at
        ``[:, 0]``, V at ``[:, 1]``; ``[num_blocks, 1, ...]``, K only, for an MLA
        ``kv_params``; ``T`` = ``max_seq_len``, or ``ring_window`` for rings), allocated once;
        zero-copy on both devices."""
        return self._store.blocks

    def ring_start(self, lengths, stream=None):
        """Entry of the oldest valid token of a ring block for sequences of ``lengths``
        tokens (an int or an int array, e.g. a collection's ``cache_lengths``): ``length %
        W`` once ``length > W``, else 0; always 0 without rings. Valid entries are
        ``min(length, W)``, in rotated order from here. Device lengths are read on the device
        and give a new device array computed on ``stream`` (no host sync; see
        :func:`hcache.rings.ring_start`)."""
        return ring_start(lengths, self._ring_window, self._device, stream,
                          order=self._store.order)

    # --- queries ----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no live sequence holds (thread-safe)."""
        with self._cond:
            return len(self._sequences.free)

    @property
    def num_live_sequences(self) -> int:
        """Claimed and not released sequences (thread-safe)."""
        with self._cond:
            return len(self._sequences.block_of)

    @property
    def cache_lengths(self) -> dict[int, int]:
        """Snapshot ``{seq_id: committed tokens}`` of the live sequences."""
        with self._cond:
            return self._sequences.lengths()

    in_flight = property(lambda self: self._inflight,
                         doc="The fetched batch not yet stepped, or ``None``.")

    # MAX's names, read-only aliases of hcache's (docs/design.md §5)
    blocks_nd_buf, inflight_batch, this_device = blocks_buf, in_flight, device
    BlocksType = property(lambda self: type(self._store.blocks), doc="blocks_buf's array type.")
    other_device = property(lambda self: Device("cpu"), doc="The host, where the books live.")
    seq_id_counter = property(lambda self: self._sequences.next_id,
                              doc="The seq_id the next claim hands out (never reused).")

    def can_claim(self, batch_size: int) -> bool:
        """True when ``claim(batch_size)`` would succeed now."""
        n = as_int("batch_size", batch_size, 0)
        with self._cond:
            return n <= len(self._sequences.free)

    def block_of(self, seq_id: int) -> int:
        """The block of a live sequence. Raises ``ValueError`` for an unknown id."""
        sid = exact_int("seq_id", seq_id)
        with self._cond:
            return self._sequences.block(sid)

    # --- commands ---------------------------------------------------------------------------

    def claim(self, batch_size: int) -> list[int]:
        """Bind ``batch_size`` fresh sequences to free blocks, all or none.

        Returns
        -------
        list of int
            New seq_ids (never handed out before), each with 0 committed tokens.

        Raises
        ------
        TypeError, ValueError
            ``batch_size`` is not an int >= 0.
        CacheCapacityError
            Fewer than ``batch_size`` free blocks (``.required``, ``.available``); nothing is
            claimed.
        """
        n = as_int("batch_size", batch_size, 0)
        with self._cond:
            return self._sequences.claim(n)

    def fetch(self, seq_ids, *, wait: bool = False, timeout: float | None = None,
              stream=None) -> ContinuousBatchingKVCacheCollection:
        """Start a batch: fill the device lookup table and lengths of ``seq_ids``.

        Parameters
        ----------
        seq_ids : sequence of int
            Distinct live seq_ids, one per batch row (at least one).
        wait : bool
            If another thread's batch is in flight, wait (up to ``timeout`` seconds) for its
            ``step`` instead of raising.
        stream : optional
            Stream of the host-to-device copies of the index buffers (docs/design.md §2).

        Returns
        -------
        ContinuousBatchingKVCacheCollection
            Active until :meth:`step`. No device memory is allocated: its arrays are views of
            buffers preallocated at construction.

        Raises
        ------
        BatchInFlightError
            A batch is in flight (and ``wait`` is false, the caller holds it, or ``timeout``
            passed).
        ValueError
            ``seq_ids`` is empty, repeats an id or names an unknown (or released) sequence;
            ``timeout`` is negative.
        TypeError
            An id is not an int, ``timeout`` is not None or a number, or ``stream`` is not a
            stream.
        """
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
        with self._cond:
            if self._inflight is not None:
                # the Thread object, not get_ident(): idents are recycled once a thread exits
                if not wait or self._inflight_owner is threading.current_thread():
                    raise BatchInFlightError("fetch: expected no batch in flight, got one of "
                                             f"seq_ids {list(self._inflight.seq_ids)}; step it")
                if not self._cond.wait_for(lambda: self._inflight is None, timeout):
                    raise BatchInFlightError(f"fetch: expected the batch in flight to be "
                                             f"stepped within {timeout} s, got none")
            blocks = self._sequences.blocks_of(ids)
            lengths = self._sequences.block_len[blocks]
            self._store.load_batch(blocks, lengths, stream)
            coll = ContinuousBatchingKVCacheCollection(self, self._store, ids, blocks, lengths)
            self._inflight, self._inflight_owner = coll, threading.current_thread()
            return coll

    def step(self, valid_lengths, collection: ContinuousBatchingKVCacheCollection) -> None:
        """Commit ``valid_lengths[i]`` more tokens to row ``i`` and end the batch.

        Raises
        ------
        TypeError
            ``collection`` is not a collection, or a length is not an int.
        ValueError
            ``collection`` is ended or not this manager's; ``valid_lengths`` has the wrong
            count or a negative entry; a row would pass ``max_seq_len``. Nothing changes.
        """
        with self._cond:
            self._check_active(collection, "step")
            add = token_count_array(valid_lengths, collection.batch_size, self._max_seq_len)
            old = collection.cache_lengths_host
            new = old + add
            if (new > self._max_seq_len).any():
                i = int(np.flatnonzero(new > self._max_seq_len)[0])
                got = token_counts(valid_lengths, collection.batch_size)[i]   # exact value
                raise ValueError(f"valid_lengths[{i}]: expected at most "
                                 f"{self._max_seq_len - int(old[i])} for seq_id "
                                 f"{collection.seq_ids[i]}, got {got}")
            self._sequences.commit(collection.lookup_table_host, new)
            self._inflight, self._inflight_owner = None, None
            self._cond.notify_all()

    def step_draft(self, accepted, num_draft_tokens, collection, *, bonus_token=False) -> None:
        """:meth:`step` of ``accepted[i] + bonus_token`` tokens per row after a speculative
        verify that wrote ``num_draft_tokens`` (errors: ``sequences.draft_token_counts``)."""
        self.step(draft_token_counts(accepted, num_draft_tokens, bonus_token, collection,
                                     self._ring_window), collection)

    def release(self, seq_id: int, stream=None) -> None:
        """Return a sequence's block to the pool; the id is never valid again.

        Parameters
        ----------
        seq_id : int
        stream : optional
            The stream on which the caller queued the last work that reads or writes the
            sequence's block (its attention, say); default the current stream. On cuda an event
            is recorded there, and the manager's next upload or launch on any other stream
            waits for it (on the device), so a later claim of the block, from any thread and
            stream, cannot overwrite it before that work ran. Work queued on *other* streams is
            the caller's to order before the release.

        Raises
        ------
        TypeError
            ``seq_id`` is not an int, or ``stream`` is not a stream.
        ValueError
            Unknown (or already released) ``seq_id``, or one in the in-flight batch.
        """
        sid = exact_int("seq_id", seq_id)
        stream_handle(stream)
        with self._cond:
            self._sequences.block(sid)   # raises for an unknown id
            if self._inflight is not None and sid in self._inflight.seq_ids:
                raise ValueError(f"seq_id: expected a sequence not in the batch in flight, "
                                 f"got {sid}; step the batch first")
            with launch_scope(self._device, stream, self._store.order):
                pass   # the block's reuse is ordered after the work queued on ``stream``
            self._sequences.release(sid)

    def reset(self) -> None:
        """Release every live sequence and end the batch in flight: every block is free again.

        The cache bytes stay as they are (a new sequence starts at length 0, so nothing reads
        them). seq_ids handed out before stay invalid forever, so a stale id held by some thread
        cannot alias a sequence claimed after the reset; the collection that was in flight is
        ended (``write`` and ``step`` refuse it), and threads waiting in ``fetch(wait=True)``
        wake up. Work already queued on a stream still writes the old blocks: order it before
        claiming again.
        """
        with self._cond:
            self._sequences.reset()
            self._inflight, self._inflight_owner = None, None
            self._cond.notify_all()

    # --- checks and diagnostics -------------------------------------------------------------

    def _check_active(self, collection, what: str) -> None:
        if not isinstance(collection, ContinuousBatchingKVCacheCollection):
            raise TypeError(f"collection: expected a ContinuousBatchingKVCacheCollection, "
                            f"got {type(collection).__name__}")
        if collection.manager is not self:
            raise ValueError(f"{what}: expected a collection of this manager, got a foreign one")
        if self._inflight is not collection:
            raise ValueError(f"{what}: expected the batch in flight, got an ended collection")

    def check_invariants(self) -> None:
        """Cross-check the redundant bookkeeping under the lock (the invariants listed in
        :func:`~hcache.continuous.invariants.broken_manager_invariants`); ``RuntimeError``
        listing every broken one. **Synchronizes** the device on cuda (reads the in-flight index
        buffers back)."""
        with self._cond:
            p = broken_manager_invariants(self._sequences, self._inflight, self._inflight_owner)
            if p:
                raise RuntimeError("ContinuousBatchingKVCacheManager: broken invariants:\n- "
                                   + "\n- ".join(p))

    def memory_report(self) -> dict:
        """Sizes in bytes and occupancy: ``blocks_buf_bytes``, ``index_buffer_bytes``
        (``lookup_table`` and ``cache_lengths``), ``metadata_bytes`` (those, the row offsets
        and the layer tables), ``total_bytes`` (``blocks_buf`` and metadata: what
        :meth:`KVCacheStaticParams.nbytes` says), ``bytes_per_block``, ``bytes_per_token``
        (K and V, or the latent with ``is_mla``; all layers; per held token with a ring),
        ``num_blocks``, ``free_blocks``, ``live_sequences``, ``committed_tokens``,
        ``capacity_tokens``, ``token_utilization``, ``dtype``, ``device``; ``ring_window``
        (0 without rings)."""
        with self._cond:
            blocks = int(self.blocks_buf.nbytes)
            per_block = blocks // self._num_blocks
            committed = int(self._sequences.block_len.sum())
            capacity = self._num_blocks * self._max_seq_len
            index, metadata = self._store.index_nbytes, self._store.metadata_nbytes
            return {"device": str(self._device), "dtype": dtype_name(self._dtype),
                    "blocks_buf_bytes": blocks, "index_buffer_bytes": index,
                    "metadata_bytes": metadata, "total_bytes": blocks + metadata,
                    "bytes_per_block": per_block,
                    "bytes_per_token": per_block // (self._ring_window or self._max_seq_len),
                    "ring_window": self._ring_window,
                    "num_blocks": self._num_blocks, "free_blocks": len(self._sequences.free),
                    "live_sequences": len(self._sequences.block_of), "committed_tokens": committed,
                    "capacity_tokens": capacity, "token_utilization": committed / capacity}

    def __repr__(self) -> str:
        return (f"ContinuousBatchingKVCacheManager(dtype={dtype_name(self._dtype)}, "
                f"num_heads={self._kv_params.num_heads}, head_size={self._kv_params.head_size}, "
                f"is_mla={self._kv_params.is_mla}, "
                f"max_batch_size={self._num_blocks}, max_seq_len={self._max_seq_len}, "
                f"num_layers={self._num_layers}, device={self._device}, "
                f"live={self.num_live_sequences})")

