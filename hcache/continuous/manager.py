"""Continuous-batching KV cache: one block per sequence, all layers (docs/design.md §5).

After MAX's Mojo ``ContinuousBatchingKVCacheManager``. ``blocks_buf`` is
``[num_blocks, 2, num_layers, max_seq_len, num_heads, head_size]`` with ``num_blocks =
max_batch_size``: block ``b`` holds one sequence's K (``[:, 0]``) and V (``[:, 1]``) of every
layer. The call order of a request is ``claim`` -> (``fetch`` -> ``write`` per layer -> ``step``)
for the prompt and then per generated token -> ``release``.

Design decisions (where the reference is silent or not thread-safe):

* **seq_ids are not block indices.** ``claim`` hands out ids from a counter that never repeats
  and binds each to the lowest free block. A released id stays unknown forever, so a stale id
  held by some thread can never alias a newer sequence that reuses its block.
* **One batch in flight**, shared by all threads, as in the reference: ``fetch`` fills
  preallocated device buffers (``lookup_table``, ``cache_lengths``) that ``step`` frees for the
  next batch. A second ``fetch`` raises :class:`BatchInFlightError` (a ``ValueError``), or with
  ``wait=True`` blocks until the batch is stepped (refused at once for the thread that holds it).
* **An in-flight sequence cannot be released** (``ValueError``): its block is read by the
  batch's kernels until ``step``. Step with zero lengths to end a batch without committing.
* **Thread safety**: one re-entrant lock (with a condition for ``wait``) guards all bookkeeping;
  every method validates, then mutates, under it. ``write`` holds it across the launch so that a
  concurrent ``step`` cannot end the batch half-way. ``fetch`` and ``write`` should use one
  stream (the index buffers are reused by the next ``fetch``).
"""

from __future__ import annotations

import heapq
import math
import operator
import threading
from dataclasses import dataclass

import numpy as np

from .._checks import as_int
from ..config.caches import _set
from ..device import resolve_device, stream_scope
from ..dtypes import dtype_name, resolve_dtype, storage_dtype
from ..errors import CacheCapacityError
from ..ops.tables import KVGroup
from .collection import ContinuousBatchingKVCacheCollection
from .diagnostics import ContinuousBatchingDiagnosticsMixin

__all__ = ["KVCacheStaticParams", "ContinuousBatchingKVCacheManager",
           "ContinuousBatchingKVCacheCollection", "BatchInFlightError"]

_INT32_MAX = 2**31 - 1


class BatchInFlightError(ValueError):
    """``fetch`` was called while another batch is in flight (not yet stepped)."""


@dataclass(frozen=True)
class KVCacheStaticParams:
    """Per-layer KV geometry: ``num_heads`` KV heads of ``head_size`` elements, both >= 1."""

    num_heads: int
    head_size: int

    def __post_init__(self):
        _set(self, "num_heads", _int("num_heads", self.num_heads, 1))
        _set(self, "head_size", _int("head_size", self.head_size, 1))


def _seq_id(value, name="seq_id") -> int:
    # ``operator.index``, not ``int``: a 0-d float array has ``__index__`` but is no int.
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def _int(name: str, value, minimum: int = 0) -> int:
    return as_int(name, _seq_id(value, name), minimum)


class ContinuousBatchingKVCacheManager(ContinuousBatchingDiagnosticsMixin):
    """KV caches of up to ``max_batch_size`` live sequences, one block each.

    Parameters
    ----------
    dtype : str or numpy.dtype
        One of the seven cache dtypes (docs/design.md §2).
    kv_params : KVCacheStaticParams
    max_batch_size, max_seq_len, num_layers : int
        Each >= 1; ``max_seq_len`` below 2**31.
    device : None, "cpu", "cuda" or "cuda:N"

    Raises
    ------
    TypeError, ValueError
        An argument has the wrong type or value.

    Notes
    -----
    :meth:`check_invariants` and :meth:`memory_report` come from
    :class:`~hcache.continuous.diagnostics.ContinuousBatchingDiagnosticsMixin`.
    """

    def __init__(self, dtype, kv_params, max_batch_size, max_seq_len, num_layers, *,
                 device=None):
        if not isinstance(kv_params, KVCacheStaticParams):
            raise TypeError(f"kv_params: expected KVCacheStaticParams, "
                            f"got {type(kv_params).__name__}")
        self._dtype = resolve_dtype(dtype)
        self._kv_params = kv_params
        self._num_blocks = _int("max_batch_size", max_batch_size, 1)
        self._max_seq_len = _int("max_seq_len", max_seq_len, 1)
        if self._max_seq_len > _INT32_MAX:
            raise ValueError(f"max_seq_len: expected at most {_INT32_MAX}, got {max_seq_len}")
        self._num_layers = _int("num_layers", num_layers, 1)
        self._device = resolve_device(device)
        xp = self._device.xp
        n, heads, size = self._num_blocks, kv_params.num_heads, kv_params.head_size
        with self._device.scope():
            self._storage = storage_dtype(self._dtype, xp)
            self._blocks = xp.zeros((n, 2, self._num_layers, self._max_seq_len, heads, size),
                                       dtype=self._storage)
            # Per-layer NHD views [num_blocks, 2, max_seq_len, H, D]: one group, one launch.
            self._group = KVGroup([self._blocks[:, :, layer]
                                   for layer in range(self._num_layers)], layout="NHD")
            self._dev_lookup = xp.zeros((n,), dtype=np.int32)
            self._dev_lengths = xp.zeros((n,), dtype=np.int32)
            self._dev_offsets = xp.zeros((n + 1,), dtype=np.int32)   # ragged writes
        self._cond = threading.Condition(threading.RLock())
        self._free: list[int] = list(range(n))        # a heap: claim takes the lowest block
        self._block_of: dict[int, int] = {}            # live seq_id -> block
        self._lengths: dict[int, int] = {}             # live seq_id -> committed tokens
        self._next_id = 0                              # ids below it were handed out once
        self._inflight: ContinuousBatchingKVCacheCollection | None = None
        self._inflight_owner: threading.Thread | None = None   # the thread that fetched it

    # --- geometry ---------------------------------------------------------------------------

    dtype = property(lambda self: self._dtype, doc="The cache dtype.")
    kv_params = property(lambda self: self._kv_params, doc="The KV head geometry.")
    device = property(lambda self: self._device, doc="The resolved device.")
    num_blocks = property(lambda self: self._num_blocks, doc="Blocks (= max_batch_size).")
    max_batch_size = property(lambda self: self._num_blocks, doc="Most live sequences.")
    max_seq_len = property(lambda self: self._max_seq_len, doc="Tokens per block.")
    num_layers = property(lambda self: self._num_layers, doc="Decoder layers per block.")

    @property
    def blocks_buf(self):
        """The cache, ``[num_blocks, 2, num_layers, max_seq_len, num_heads, head_size]``
        (K at ``[:, 0]``, V at ``[:, 1]``), allocated once; zero-copy on both devices."""
        return self._blocks

    # --- queries ----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        with self._cond:
            return len(self._free)

    @property
    def num_live_sequences(self) -> int:
        with self._cond:
            return len(self._block_of)

    @property
    def cache_lengths(self) -> dict[int, int]:
        """Snapshot ``{seq_id: committed tokens}`` of the live sequences."""
        with self._cond:
            return dict(self._lengths)

    @property
    def in_flight(self) -> ContinuousBatchingKVCacheCollection | None:
        """The fetched batch not yet stepped, or ``None``."""
        return self._inflight

    def can_claim(self, batch_size: int) -> bool:
        """True when ``claim(batch_size)`` would succeed now."""
        n = _int("batch_size", batch_size, 0)
        with self._cond:
            return n <= len(self._free)

    def block_of(self, seq_id: int) -> int:
        """The block of a live sequence. Raises ``ValueError`` for an unknown id."""
        sid = _seq_id(seq_id)
        with self._cond:
            if sid not in self._block_of:
                raise ValueError(f"seq_id: expected a live sequence, got {sid}")
            return self._block_of[sid]

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
        n = _int("batch_size", batch_size, 0)
        with self._cond:
            available = len(self._free)
            if n > available:
                raise CacheCapacityError(f"batch_size: expected at most {available} free blocks "
                                         f"(of {self._num_blocks}), got {n}",
                                         required=n, available=available)
            ids = list(range(self._next_id, self._next_id + n))
            for sid in ids:
                self._block_of[sid] = heapq.heappop(self._free)
                self._lengths[sid] = 0
            self._next_id += n
            return ids

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
        if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
            raise TypeError(f"seq_ids: expected a sequence of int, got {type(seq_ids).__name__}")
        ids = [_seq_id(s, f"seq_ids[{i}]") for i, s in enumerate(seq_ids)]
        if not ids:
            raise ValueError("seq_ids: expected at least one seq_id, got 0")
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids: expected distinct ids, got {ids}")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer,
                                                                      np.floating)):
                raise TypeError(f"timeout: expected None or seconds, "
                                f"got {type(timeout).__name__}")
            if math.isnan(timeout) or timeout < 0:
                raise ValueError(f"timeout: expected seconds >= 0, got {timeout}")
        scope = stream_scope(stream, self._device)   # validates ``stream`` first
        with self._cond:
            if self._inflight is not None:
                # the Thread object, not get_ident(): idents are recycled once a thread exits
                if not wait or self._inflight_owner is threading.current_thread():
                    raise BatchInFlightError("fetch: expected no batch in flight, got one of "
                                             f"seq_ids {list(self._inflight.seq_ids)}; step it")
                if not self._cond.wait_for(lambda: self._inflight is None, timeout):
                    raise BatchInFlightError(f"fetch: expected the batch in flight to be "
                                             f"stepped within {timeout} s, got none")
            unknown = [s for s in ids if s not in self._block_of]
            if unknown:
                raise ValueError(f"seq_ids: expected live sequences, got unknown {unknown}")
            batch = len(ids)
            blocks = np.fromiter((self._block_of[s] for s in ids), np.int32, batch)
            lengths = np.fromiter((self._lengths[s] for s in ids), np.int32, batch)
            with self._device.scope(), scope:
                self._upload(self._dev_lookup, blocks)
                self._upload(self._dev_lengths, lengths)
            coll = ContinuousBatchingKVCacheCollection(self, ids, self._dev_lookup[:batch],
                                                       self._dev_lengths[:batch], blocks, lengths)
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
            add = self._lengths_arg(valid_lengths, collection.batch_size)
            # Python ints: a huge length must be refused, not wrap around in int64.
            new = [n + a for n, a in zip(collection._lengths.tolist(), add, strict=True)]
            over = [i for i, n in enumerate(new) if n > self._max_seq_len]
            if over:
                i = over[0]
                raise ValueError(f"valid_lengths[{i}]: expected at most "
                                 f"{self._max_seq_len - int(collection._lengths[i])} for seq_id "
                                 f"{collection.seq_ids[i]}, got {add[i]}")
            for sid, n in zip(collection.seq_ids, new, strict=True):
                self._lengths[sid] = n
            self._inflight, self._inflight_owner = None, None
            self._cond.notify_all()

    def release(self, seq_id: int) -> None:
        """Return a sequence's block to the pool; the id is never valid again.

        Raises
        ------
        TypeError
            ``seq_id`` is not an int.
        ValueError
            Unknown (or already released) ``seq_id``, or one in the in-flight batch.
        """
        sid = _seq_id(seq_id)
        with self._cond:
            if sid not in self._block_of:
                raise ValueError(f"seq_id: expected a live sequence, got {sid}")
            if self._inflight is not None and sid in self._inflight._id_set:
                raise ValueError(f"seq_id: expected a sequence not in the batch in flight, "
                                 f"got {sid}; step the batch first")
            heapq.heappush(self._free, self._block_of.pop(sid))
            del self._lengths[sid]

    # --- collection support -----------------------------------------------------------------

    def _upload(self, device_buf, host: np.ndarray) -> None:
        if isinstance(device_buf, np.ndarray):
            device_buf[: host.shape[0]] = host
        else:   # pageable source: the driver stages it, so ``host`` may be reused at once
            xp = self._device.xp
            device_buf[: host.shape[0]].set(host, stream=xp.cuda.get_current_stream())

    def _check_active(self, collection, what: str) -> None:
        if not isinstance(collection, ContinuousBatchingKVCacheCollection):
            raise TypeError(f"collection: expected a ContinuousBatchingKVCacheCollection, "
                            f"got {type(collection).__name__}")
        if collection._manager is not self:
            raise ValueError(f"{what}: expected a collection of this manager, got a foreign one")
        if self._inflight is not collection:
            raise ValueError(f"{what}: expected the batch in flight, got an ended collection")

    def _lengths_arg(self, valid_lengths, batch: int, name: str = "valid_lengths") -> list[int]:
        if isinstance(valid_lengths, np.ndarray):
            if valid_lengths.dtype.kind not in "iu" or valid_lengths.ndim != 1:
                raise TypeError(f"{name}: expected a 1-D integer array, "
                                f"got {valid_lengths.dtype} with shape {valid_lengths.shape}")
            values = valid_lengths.tolist()     # exact Python ints (uint64 included)
        elif isinstance(valid_lengths, (str, bytes)) or not hasattr(valid_lengths, "__iter__"):
            raise TypeError(f"{name}: expected a sequence of int, "
                            f"got {type(valid_lengths).__name__}")
        else:
            values = [_seq_id(v, f"{name}[{i}]") for i, v in enumerate(valid_lengths)]
        if len(values) != batch:
            raise ValueError(f"{name}: expected {batch} lengths, got {len(values)}")
        if any(v < 0 for v in values):
            raise ValueError(f"{name}: expected lengths >= 0, got {values}")
        return values

    def _layer(self, layer) -> int:
        layer = _seq_id(layer, "layer")
        if not 0 <= layer < self._num_layers:
            raise IndexError(f"layer: expected a layer in [0, {self._num_layers}), got {layer}")
        return layer

    def _kv_view(self, kv: int, layer) -> object:
        return self.blocks_buf[:, kv, self._layer(layer)]

    def __repr__(self) -> str:
        return (f"ContinuousBatchingKVCacheManager(dtype={dtype_name(self._dtype)}, "
                f"num_heads={self._kv_params.num_heads}, head_size={self._kv_params.head_size}, "
                f"max_batch_size={self._num_blocks}, max_seq_len={self._max_seq_len}, "
                f"num_layers={self._num_layers}, device={self._device}, "
                f"live={self.num_live_sequences})")
