"""The batch API shared by the contiguous-slot managers (docs/design.md §4 "Batch API").

One device ``int32 [max_batch]`` lengths array (the past length of every slot, bound by a
runtime as ``kvcache_start_index``), the active batch size, the ``kv_cache_all_empty`` flag, and
batch compaction after evictions. :class:`BatchAPI` is the base class of the hybrid and linear
managers: each calls ``BatchAPI.__init__`` once, in its construction's launch scope, with its
head-dim groups and whole-slot state tensors, and inherits the public methods. A compaction's
device moves belong to a :class:`~hcache.slots.batch_compaction.BatchCompaction` it owns.

Host mirror. The host keeps a copy of the lengths of the slots whose lengths it knows: every
length written by a reset, a host-data commit or a host-mapping compaction is known; a commit
of device data, or a compaction by a device mapping, makes the affected slots unknown until the
next reset (or :meth:`BatchAPI.refresh_host_lengths`). Host data is validated against the
mirror before anything is launched, so an overflowing commit raises ``ValueError`` and changes
nothing. Every commit also goes through :func:`hcache.ops.lengths_add`, which refuses an
overflowing commit on the device, all or nothing, and counts it (:meth:`refused_commit_count`).
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import check_int, host_ints
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..runtime.arrays import as_array, on_device
from ..runtime.device import launch_scope, settle, to_host, upload_ints, zeros
from ..runtime.stream_order import StreamOrder
from .batch_admission import BatchAdmission
from .batch_compaction import BatchCompaction
from .drafts import commit_draft

__all__ = ["BatchAPI"]


class BatchAPI(BatchAdmission):
    """Lengths, active batch, all-empty flag and compaction of a contiguous-slot manager.

    Parameters
    ----------
    device : Device
    max_batch_size, max_sequence_length : int
        Slots, and the most tokens a slot holds.
    kv_groups : sequence of KVGroup
        HND groups compacted by token spans (the first ``length`` tokens of each slot).
    slot_tensors : sequence of arrays ``[max_batch, ...]``
        C-contiguous per-slot states compacted whole (Mamba recurrent and conv states).

    Notes
    -----
    Allocates on the current device and stream: a manager calls it inside its construction's
    :func:`~hcache.device.launch_scope`.
    """

    __copy__, __deepcopy__, __reduce_ex__ = refuse_copy, refuse_deepcopy, refuse_pickle

    def __init__(self, device, max_batch_size: int, max_sequence_length: int, *,
                 kv_groups=(), slot_tensors=()):
        xp = device.xp
        self._device = device
        self._order = StreamOrder()   # the manager's calls: one chain across streams
        self._write_indices = {}      # decoder layer -> the KV writer's index, once checked
        self._max_batch = int(max_batch_size)
        self._max_len = int(max_sequence_length)
        # the device truth; 64-byte aligned like the caches, so importers (JAX) need no copy
        self._lengths = zeros(device, (self._max_batch,), np.int32)
        self._increments = xp.zeros(self._max_batch, dtype=np.int32)   # staged host increments
        self._status = xp.zeros(1, dtype=np.int32)                     # refused commits so far
        self._compaction = BatchCompaction(device, self._lengths, kv_groups=kv_groups,
                                           slot_tensors=slot_tensors)
        self._init_admission(xp)
        self._has_rings = any(g.has_rings for g in kv_groups)   # refused by commit_draft
        # host mirror: _host_lengths[i] == _lengths[i] wherever _known[i]
        self._host_lengths = np.zeros(self._max_batch, dtype=np.int64)
        self._known = np.ones(self._max_batch, dtype=bool)
        self._set_active(0)
        self._all_empty = True
        # Headroom of the active batch: max_len - max(active host lengths) when all of them are
        # known, else None; recomputed only after a change other than a uniform commit.
        self._headroom: int | None = self._max_len
        self._headroom_stale = False
        settle(device)   # the manager's memory is ready for any stream

    # --- queries ----------------------------------------------------------------------------

    device = property(lambda self: self._device, doc="The resolved device.")
    active_batch_size = property(lambda self: self._active,
                                 doc="Number of active sequences (slots [0, active_batch_size)).")

    @property
    def kv_cache_all_empty(self) -> bool:
        """True iff every active length is 0 (true with no active sequence).

        Recomputed by every reset and commit; :meth:`set_active_batch_size` and
        :meth:`compact_batch` leave it as it is. After a commit of device data (or of host data
        while some active length is unknown on the host) it is ``False`` unless the increment
        is known to be 0: conservative, since the host cannot see the device lengths.
        """
        return self._all_empty

    @property
    def batch_state_nbytes(self) -> int:
        """Device bytes of the lengths, staging, mapping, plan and status buffers and of the
        descriptor table of the slot tensors that compaction moves."""
        return int(self._lengths.nbytes + self._increments.nbytes + self._status.nbytes
                   + self._compaction.nbytes + self._admission_nbytes)

    def get_kv_cache_lengths(self):
        """The device lengths of the active sequences.

        Returns
        -------
        array, int32 [active_batch_size]
            A zero-copy view of the manager's lengths array (capacity ``max_batch``).
        """
        return self._lengths_view   # one view per active batch: step plans key on it

    def _set_active(self, n: int) -> None:
        self._active, self._lengths_view = n, self._lengths[:n]   # one view per active batch

    def refused_commit_count(self, stream=None) -> int:
        """How many commits the device refused (they would have passed
        ``max_sequence_length``). **Synchronizes** ``stream``."""
        with launch_scope(self._device, stream, self._order):
            return int(to_host(self._status)[0])

    def refresh_host_lengths(self, stream=None) -> None:
        """Copy the device lengths to the host mirror, so every length is known again.
        **Synchronizes** ``stream``."""
        with launch_scope(self._device, stream, self._order):
            host = to_host(self._lengths)
        self._host_lengths[:] = host
        self._known[:] = True
        self._headroom_stale = True

    # --- commands ---------------------------------------------------------------------------

    def set_active_batch_size(self, n) -> None:
        """Set the active batch to slots ``[0, n)``; lengths are kept.

        Raises
        ------
        TypeError, ValueError
            ``n`` is not an int in ``[0, max_batch]``.
        """
        self._set_active(check_int("n", n, 0, self._max_batch))
        self._headroom_stale = True

    def reset_for_new_sequences(self, reuse_kv_cache_lengths, stream=None) -> None:
        """Start a new batch: ``lengths[:n] = reuse`` (host to device), active batch ``n``.

        Parameters
        ----------
        reuse_kv_cache_lengths : host ints [n]
            Tokens already in each slot (restored prompt caches), ``n <= max_batch``, each in
            ``[0, max_sequence_length]``.

        Raises
        ------
        TypeError
            Not host integers.
        ValueError
            Too many entries, or an entry out of range.
        """
        reuse = host_ints("reuse_kv_cache_lengths", reuse_kv_cache_lengths)
        n = reuse.shape[0]
        if n > self._max_batch:
            raise ValueError(f"reuse_kv_cache_lengths: expected at most {self._max_batch} "
                             f"entries, got {n}")
        bad = np.flatnonzero((reuse < 0) | (reuse > self._max_len))
        if bad.size:
            raise ValueError(f"reuse_kv_cache_lengths[{bad[0]}]: expected a length in "
                             f"[0, {self._max_len}], got {reuse[bad[0]]}")
        with launch_scope(self._device, stream, self._order):
            upload_ints(self._lengths, reuse)
        self._host_lengths[:n] = reuse
        self._known[:n] = True
        self._set_active(n)
        self._all_empty = not bool((reuse > 0).any())
        self._headroom_stale = True

    def commit_sequence_length(self, increment, stream=None) -> None:
        """Add ``increment`` to every active length (after an engine step).

        Parameters
        ----------
        increment : int, host ints [active_batch_size], or device int32 [active_batch_size]
            Non-negative tokens per sequence (an int for all of them).

        Raises
        ------
        TypeError
            Not an int, host integers or a device int32 array of this device.
        ValueError
            Wrong shape or dtype, a negative increment, or (host data, host-known lengths) a
            length that would pass ``max_sequence_length``; nothing changes. With device data or
            unknown lengths such a commit is refused on the device instead (nothing changes,
            :meth:`refused_commit_count` grows).
        """
        n = self._active
        if isinstance(increment, bool):
            raise TypeError("increment: expected an int or an int array, got bool")
        if isinstance(increment, (int, np.integer)):
            self._commit_uniform(check_int("increment", increment, 0, self._max_len), stream)
        elif self._device.is_cuda and on_device(increment):
            self._commit_device(increment, stream)
        else:
            inc = host_ints("increment", increment, n)
            if (inc < 0).any():
                raise ValueError(f"increment: expected increments >= 0, got {int(inc.min())}")
            if (inc > self._max_len).any():
                raise ValueError(f"increment: expected increments <= {self._max_len}, "
                                 f"got {int(inc.max())}")
            self._commit_host(inc, stream)

    def _headroom_now(self) -> int | None:
        if self._headroom_stale:
            n = self._active
            if not self._known[:n].all():
                self._headroom = None
            else:
                self._headroom = self._max_len - (int(self._host_lengths[:n].max()) if n else 0)
            self._headroom_stale = False
        return self._headroom

    def _commit_uniform(self, inc: int, stream) -> None:
        """The decode step: the same increment for every active sequence, O(1) host checks."""
        n = self._active
        headroom = self._headroom_now()
        if headroom is not None and inc > headroom:
            new = self._host_lengths[:n] + inc
            slot = int(np.flatnonzero(new > self._max_len)[0])
            raise ValueError(f"increment[{slot}]: expected a commit within max_sequence_length "
                             f"{self._max_len}, got length {int(new[slot])}")
        with launch_scope(self._device, stream, self._order):
            ops.lengths_add(self._lengths, n, inc, self._max_len, status=self._status,
                            stream=stream)
        if headroom is not None:
            if inc and n:
                self._host_lengths[:n] += inc
                self._headroom = headroom - inc
                self._all_empty = False
            else:
                self._all_empty = not bool((self._host_lengths[:n] > 0).any())
        elif inc and n:
            self._known[:n] = False   # the device may have refused it: lengths unknown
            self._all_empty = False

    def _commit_host(self, inc: np.ndarray, stream) -> None:
        n = self._active
        known = self._headroom_now() is not None
        new = self._host_lengths[:n] + inc
        if known and (new > self._max_len).any():
            slot = int(np.flatnonzero(new > self._max_len)[0])
            raise ValueError(f"increment[{slot}]: expected a commit within max_sequence_length "
                             f"{self._max_len}, got length {int(new[slot])}")
        with launch_scope(self._device, stream, self._order):
            upload_ints(self._increments, inc)
            ops.lengths_add(self._lengths, n, self._increments, self._max_len,
                            status=self._status, stream=stream)
        grew = bool((inc > 0).any())
        if known:
            self._host_lengths[:n] = new
            self._all_empty = not bool((new > 0).any())
            self._headroom_stale = True
        elif grew:
            self._known[:n] = False   # the device may have refused it: lengths unknown
            self._all_empty = False

    def _commit_device(self, increment, stream) -> None:
        increment = as_array("increment", increment, self._device, stream)
        n = self._active
        if increment.dtype != np.int32:
            raise ValueError(f"increment: expected dtype int32, got {increment.dtype}")
        if increment.ndim != 1 or increment.shape[0] != n:
            raise ValueError(f"increment: expected shape ({n},), got {tuple(increment.shape)}")
        if not increment.flags.c_contiguous:
            raise ValueError("increment: expected a C-contiguous array")
        with launch_scope(self._device, stream, self._order):
            ops.lengths_add(self._lengths, n, increment, self._max_len, status=self._status,
                            stream=stream)
        self._known[:n] = False
        self._all_empty = n == 0
        self._headroom_stale = True

    commit_draft = commit_draft   # speculative decoding (slots/drafts.py)

    # --- KV writes (slots/kv_writes.py) ------------------------------------------------------

    def write_kv(self, layer, k, v=None, *, seq_lengths=None, positions=None, k_scale=None,
                 v_scale=None, stream=None) -> None:
        """Write the new tokens of the active batch into the KV cache, in place (docs/design.md
        §4.9): row ``b`` is slot ``b``; its tokens land at its committed length (or at
        ``positions``). Lengths are not changed: commit them with
        :meth:`commit_sequence_length`. One launch per head-dim group; no allocation, no sync.

        Parameters
        ----------
        layer : int or None
            ``HybridCacheManager``: the decoder layer (an attention layer that owns its cache);
            ``LinearKVCache``: the attention index. ``None`` writes every cache-owning
            attention layer: ``k`` and ``v`` are then lists, one per layer in attention order.
        k, v : arrays
            ``[batch, new_tokens, H, D]`` (every row gets ``new_tokens``), or with
            ``seq_lengths`` ragged ``[total_tokens, H, D]`` (row ``b``'s tokens after those of
            rows ``< b``); ``batch`` is the active batch. C-contiguous, this device's array
            module, of the cache dtype (its storage dtype on cuda); for an FP8 cache also
            float32, float16 or bfloat16, quantized on write (bfloat16 held as uint16 on a
            CuPy without bfloat16). A latent (MLA) layer's rows are ``k`` (``H = 1``, ``D =
            kv_lora_rank + qk_rope_head_dim``) and its ``v`` is None: None in its place in the
            list, or ``v=None`` when every written layer is latent.
        seq_lengths : host ints [batch], optional
            New tokens per row of a ragged write (their sum is ``total_tokens``).
        positions : ints shaped like ``k``'s leading axes, optional
            Explicit positions per token (-1 skips a token). Host integers are checked (in
            ``[-1, max_sequence_length)``, distinct within a row) and staged; a device int32
            array is passed as it is (out-of-range tokens are skipped and counted, see
            :meth:`skipped_kv_write_count`).
        k_scale, v_scale : None, float, or float32 device array [L] or [L, >= H]
            FP8 caches written from float rows only: ``q = fp8(x / scale)`` per layer (and per
            KV head), ``L`` the cache-owning attention layers (``v_scale`` must be None when
            every written layer is latent). ``None`` uses the manager's recorded scales
            (:meth:`get_kv_scales`); a given scale is recorded first for the written layers (a
            device copy, none for a float equal to the last one).
        stream : optional

        Raises
        ------
        TypeError, IndexError, ValueError
            A bad layer (or a layer without a cache of its own), array, shape, dtype, batch,
            ``seq_lengths``, position, scale, stream, or a row whose committed length (known
            on the host) leaves too little room. Nothing is written or recorded.
        """
        index = self._write_indices.get(layer) if type(layer) is int else None
        if index is None and layer is not None:
            index = self._kv_write_index(layer)
        self._kv_writer.write(index, k, v, batch_state=self, seq_lengths=seq_lengths,
                              positions=positions, k_scale=k_scale, v_scale=v_scale,
                              stream=stream)
        if type(layer) is int:   # kept after a write that went well: a refusal changes nothing
            self._write_indices[layer] = index

    # --- compaction -------------------------------------------------------------------------

    def compact_batch(self, batch_mapping, old_batch, new_batch, stream=None) -> None:
        """Compact the batch after evictions: slot ``i`` moves to ``batch_mapping[i]``.

        Moves the first ``length[i]`` tokens of every attention layer (one launch per head-dim
        group), then every Mamba recurrent and conv state and the lengths (one launch; slots
        below ``new_batch`` that receive nothing get zero states and length 0). Any injective
        mapping works, in place. Afterwards the active batch is ``new_batch``; slots at or past
        ``new_batch`` keep stale data.

        Parameters
        ----------
        batch_mapping : host ints [old_batch], or device int32 [>= old_batch]
            New slot in ``[0, new_batch)`` or -1 (evicted), injective. A host mapping is
            validated before anything moves. A device mapping goes to the kernels unchecked: if
            it is invalid they move nothing (see :meth:`last_compaction_valid`).
        old_batch : int
            Must equal :attr:`active_batch_size`.
        new_batch : int
            In ``[0, max_batch]``.

        Raises
        ------
        TypeError, ValueError
            A bad batch size, or a host mapping that is malformed or not injective into
            ``[0, new_batch)``; nothing changes.
        """
        old = check_int("old_batch", old_batch, 0, self._max_batch)
        if old != self._active:
            raise ValueError(f"old_batch: expected the active batch size {self._active}, "
                             f"got {old}")
        new = check_int("new_batch", new_batch, 0, self._max_batch)
        mapping = self._compaction.check_mapping(batch_mapping, old, new, stream)
        with launch_scope(self._device, stream, self._order):
            self._compaction.run(mapping, old, new, stream)
        if not isinstance(mapping, np.ndarray):   # a device mapping: lengths now unknown
            self._known[:new] = False
        else:
            kept = np.flatnonzero(mapping >= 0)
            lengths, known = self._host_lengths.copy(), self._known.copy()
            self._host_lengths[:new] = 0
            self._known[:new] = True
            self._host_lengths[mapping[kept]] = lengths[kept]
            self._known[mapping[kept]] = known[kept]
        self._set_active(new)
        self._headroom_stale = True

    def last_compaction_valid(self, stream=None) -> bool:
        """Whether the last :meth:`compact_batch` mapping was valid (its moves ran).

        Only a device mapping can be invalid here (host mappings are validated and raise);
        an invalid one moved nothing. **Synchronizes** ``stream`` to read the plan status.
        """
        with launch_scope(self._device, stream, self._order):
            return self._compaction.last_valid()
