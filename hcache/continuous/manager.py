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

The batch protocol (claims, the batch in flight and its owner thread, fetch's wait, step,
release, reset) is a :class:`~hcache.continuous.batch_protocol.BatchProtocol` the manager
composes and delegates to, shared with the hybrid manager; which block holds which sequence and
its tokens are the protocol's :class:`~hcache.continuous.sequences.SequenceBlocks`; the device
side (``blocks_buf``, index buffers, the lock) a :class:`~hcache.continuous.store.KVBlockStore`
shared with the batches it hands out.
"""

from __future__ import annotations

from .._checks import as_int
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..dtypes import dtype_name
from ..memory import check_fits
from ..rings import ring_start
from ..runtime.device import Device, resolve_device
from .batch_protocol import BatchInFlightError, BatchProtocol
from .collection import ContinuousBatchingKVCacheCollection
from .params import KVCacheStaticParams, manager_arguments
from .sequences import draft_token_counts
from .store import KVBlockStore

__all__ = ["KVCacheStaticParams", "ContinuousBatchingKVCacheManager",
           "ContinuousBatchingKVCacheCollection", "BatchInFlightError"]


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
        self._batches = BatchProtocol(self, self._store, self._num_blocks, self._max_seq_len,
                                      ContinuousBatchingKVCacheCollection)
        self._sequences = self._batches.sequences

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

    num_free_blocks = property(lambda self: self._batches.num_free_blocks,
                               doc="Blocks no live sequence holds (thread-safe).")
    num_live_sequences = property(lambda self: self._batches.num_live_sequences,
                                  doc="Claimed and not released sequences (thread-safe).")
    cache_lengths = property(lambda self: self._batches.cache_lengths,
                             doc="Snapshot ``{seq_id: committed tokens}`` of the live sequences.")
    in_flight = property(lambda self: self._batches.in_flight,
                         doc="The fetched batch not yet stepped, or ``None``.")

    # MAX's names, read-only aliases of hcache's (docs/design.md §5)
    blocks_nd_buf, inflight_batch, this_device = blocks_buf, in_flight, device
    BlocksType = property(lambda self: type(self._store.blocks), doc="blocks_buf's array type.")
    other_device = property(lambda self: Device("cpu"), doc="The host, where the books live.")
    seq_id_counter = property(lambda self: self._sequences.next_id,
                              doc="The seq_id the next claim hands out (never reused).")

    def can_claim(self, batch_size: int) -> bool:
        """True when ``claim(batch_size)`` would succeed now."""
        return self._batches.can_claim(batch_size)

    def block_of(self, seq_id: int) -> int:
        """The block of a live sequence. Raises ``ValueError`` for an unknown id."""
        return self._batches.block_of(seq_id)

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
        return self._batches.claim(as_int("batch_size", batch_size, 0))

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
        return self._batches.fetch(seq_ids, wait, timeout, stream)

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
        self._batches.step(valid_lengths, collection)

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
        self._batches.release(seq_id, stream)

    def reset(self) -> None:
        """Release every live sequence and end the batch in flight: every block is free again.

        The cache bytes stay as they are (a new sequence starts at length 0, so nothing reads
        them). seq_ids handed out before stay invalid forever, so a stale id held by some thread
        cannot alias a sequence claimed after the reset; the collection that was in flight is
        ended (``write`` and ``step`` refuse it), and threads waiting in ``fetch(wait=True)``
        wake up. Work already queued on a stream still writes the old blocks: order it before
        claiming again.
        """
        self._batches.reset()

    # --- checks and diagnostics -------------------------------------------------------------

    def check_invariants(self) -> None:
        """Cross-check the redundant bookkeeping under the lock (the invariants listed in
        :func:`~hcache.continuous.invariants.broken_manager_invariants`); ``RuntimeError``
        listing every broken one. **Synchronizes** the device on cuda (reads the in-flight index
        buffers back)."""
        self._batches.check_invariants("ContinuousBatchingKVCacheManager")

    def memory_report(self) -> dict:
        """Sizes in bytes and occupancy: ``blocks_buf_bytes``, ``index_buffer_bytes``
        (``lookup_table`` and ``cache_lengths``), ``metadata_bytes`` (those, the row offsets
        and the layer tables), ``total_bytes`` (``blocks_buf`` and metadata: what
        :meth:`KVCacheStaticParams.nbytes` says), ``bytes_per_block``, ``bytes_per_token``
        (K and V, or the latent with ``is_mla``; all layers; per held token with a ring),
        ``num_blocks``, ``free_blocks``, ``live_sequences``, ``committed_tokens``,
        ``capacity_tokens``, ``token_utilization``, ``dtype``, ``device``; ``ring_window``
        (0 without rings)."""
        with self._batches.lock:
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

