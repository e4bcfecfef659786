"""The batch API shared by the contiguous-slot managers (SPEC §4 "Batch API").

One device ``int32 [max_batch]`` lengths array (the past length of every slot, bound by a
runtime as ``kvcache_start_index``), the active batch size, the ``kv_cache_all_empty`` flag, and
batch compaction after evictions. :class:`BatchAPI` is a base class: a manager calls
:meth:`BatchAPI._setup_batch` once with its head-dim groups and its whole-slot state tensors
(Mamba recurrent and conv states), and inherits the public methods.

Host mirror. The host keeps a copy of the lengths of the slots whose lengths it knows: every
length written by a reset, a host-data commit or a host-mapping compaction is known; a commit
of device data, or a compaction by a device mapping, makes the affected slots unknown until the
next reset (or :meth:`BatchAPI.refresh_host_lengths`). Host data is validated against the
mirror before anything is launched, so an overflowing commit raises ``ValueError`` and changes
nothing. Every commit also goes through :func:`hcache.ops.lengths_add`, which refuses an
overflowing commit on the device, all or nothing, and counts it (:meth:`refused_commit_count`).
"""

from __future__ import annotations

import contextlib

import numpy as np

from . import ops
from .device import array_module_of, stream_scope
from .layout import SlotSet

__all__ = ["BatchAPI", "check_index", "check_int", "launch_scope"]


def check_index(name: str, value, size: int) -> int:
    """``value`` as an index in ``[0, size)``; ``TypeError`` unless an int, else ``IndexError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value < size:
        raise IndexError(f"{name}: expected an index in [0, {size}), got {value}")
    return value


def check_int(name: str, value, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]``; ``TypeError`` unless an int, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value}")
    return value


@contextlib.contextmanager
def launch_scope(device, stream):
    """Make ``device`` and ``stream`` current, so that uploads and launches share the stream
    (validates ``stream`` on cpu too)."""
    with device.scope(), stream_scope(stream, device):
        yield


def host_ints(name: str, values, length: int | None = None) -> np.ndarray:
    """Host integers (sequence or NumPy array) as a 1-D ``int64`` array.

    Raises
    ------
    TypeError
        Not integers (floats, bools, a device array).
    ValueError
        Not 1-D, or not ``length`` entries.
    """
    if array_module_of(values) is not np or hasattr(values, "__cuda_array_interface__"):
        raise TypeError(f"{name}: expected host integers, got {type(values).__name__}")
    if isinstance(values, (list, tuple)) and any(isinstance(v, (bool, np.bool_))
                                                 for v in values):
        # np.asarray([1, True]) is an int array: a bool entry would pass as 0 or 1.
        raise TypeError(f"{name}: expected integers, got a bool entry")
    arr = np.asarray(values)
    if arr.size == 0 and arr.dtype == np.float64:  # np.asarray([]) is float64
        arr = arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise ValueError(f"{name}: expected {length} entries, got {arr.shape[0]}")
    big = np.flatnonzero(arr > np.iinfo(np.int64).max) if arr.dtype == np.uint64 else ()
    if len(big):   # would wrap to a negative int64 (2**64 - 1 would read as -1)
        raise ValueError(f"{name}[{big[0]}]: expected a value below 2**63, got {arr[big[0]]}")
    return arr.astype(np.int64)


class BatchAPI:
    """Lengths, active batch, all-empty flag and compaction of a contiguous-slot manager."""

    def _setup_batch(self, device, max_batch_size: int, max_sequence_length: int, *,
                     kv_groups=(), slot_tensors=()):
        """Allocate the batch state (call once, inside the constructor's launch scope).

        Parameters
        ----------
        kv_groups : sequence of KVGroup
            HND groups compacted by token spans (the first ``length`` tokens of each slot).
        slot_tensors : sequence of arrays ``[max_batch, ...]``
            C-contiguous per-slot states compacted whole (Mamba recurrent and conv states).
        """
        xp = device.xp
        self._device = device
        self._max_batch = int(max_batch_size)
        self._max_len = int(max_sequence_length)
        self._lengths = xp.zeros(self._max_batch, dtype=np.int32)
        self._increments = xp.zeros(self._max_batch, dtype=np.int32)
        self._mapping = xp.full(self._max_batch, -1, dtype=np.int32)
        self._plan = xp.zeros(ops.compaction_plan_size(self._max_batch), dtype=np.int32)
        self._status = xp.zeros(1, dtype=np.int32)
        self._kv_groups = tuple(kv_groups)
        # The lengths come last in the one slot launch; the KV launches before it read the
        # pre-compaction lengths.
        self._state_slots = SlotSet([(t, t) for t in slot_tensors]
                                    + [(self._lengths, self._lengths)])
        self._host_lengths = np.zeros(self._max_batch, dtype=np.int64)
        self._known = np.ones(self._max_batch, dtype=bool)
        self._active = 0
        self._all_empty = True

    # --- queries ----------------------------------------------------------------------------

    @property
    def active_batch_size(self) -> int:
        """Number of active sequences (slots ``[0, active_batch_size)``)."""
        return self._active

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
        return int(sum(a.nbytes for a in (self._lengths, self._increments, self._mapping,
                                          self._plan, self._status,
                                          self._state_slots.device_infos)))

    def get_kv_cache_lengths(self):
        """The device lengths of the active sequences.

        Returns
        -------
        array, int32 [active_batch_size]
            A zero-copy view of the manager's lengths array (capacity ``max_batch``).
        """
        return self._lengths[:self._active]

    def last_compaction_valid(self, stream=None) -> bool:
        """Whether the last :meth:`compact_batch` mapping was valid (its moves ran).

        Only a device mapping can be invalid here (host mappings are validated and raise);
        an invalid one moved nothing. **Synchronizes** ``stream`` to read the plan status.
        """
        with launch_scope(self._device, stream):
            head = self._plan[:1]
            return int(head.get()[0] if hasattr(head, "get") else head[0]) == 0

    def refused_commit_count(self, stream=None) -> int:
        """How many commits the device refused (they would have passed
        ``max_sequence_length``). **Synchronizes** ``stream``."""
        with launch_scope(self._device, stream):
            s = self._status
            return int(s.get()[0] if hasattr(s, "get") else s[0])

    def refresh_host_lengths(self, stream=None) -> None:
        """Copy the device lengths to the host mirror, so every length is known again.
        **Synchronizes** ``stream``."""
        with launch_scope(self._device, stream):
            lengths = self._lengths
            host = lengths.get() if hasattr(lengths, "get") else lengths.copy()
        self._host_lengths[:] = host
        self._known[:] = True

    # --- commands ---------------------------------------------------------------------------

    def set_active_batch_size(self, n) -> None:
        """Set the active batch to slots ``[0, n)``; lengths are kept.

        Raises
        ------
        TypeError, ValueError
            ``n`` is not an int in ``[0, max_batch]``.
        """
        self._active = check_int("active_batch_size", n, 0, self._max_batch)

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
        with launch_scope(self._device, stream):
            _upload(self._lengths, reuse)
        self._host_lengths[:n] = reuse
        self._known[:n] = True
        self._active = n
        self._all_empty = not bool((reuse > 0).any())

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
            inc = check_int("increment", increment, 0, self._max_len)
            self._commit_host(np.full(n, inc, dtype=np.int64), inc, stream)
        elif self._device.is_cuda and (array_module_of(increment) is not np
                                       or hasattr(increment, "__cuda_array_interface__")):
            self._commit_device(increment, stream)
        else:
            inc = host_ints("increment", increment, n)
            if (inc < 0).any():
                raise ValueError(f"increment: expected increments >= 0, got {int(inc.min())}")
            if (inc > self._max_len).any():
                raise ValueError(f"increment: expected increments <= {self._max_len}, "
                                 f"got {int(inc.max())}")
            self._commit_host(inc, None, stream)

    def _commit_host(self, inc: np.ndarray, scalar, stream) -> None:
        n = self._active
        known = bool(self._known[:n].all())
        new = self._host_lengths[:n] + inc
        if known and (new > self._max_len).any():
            slot = int(np.flatnonzero(new > self._max_len)[0])
            raise ValueError(f"increment[{slot}]: expected a commit within max_sequence_length "
                             f"{self._max_len}, got length {int(new[slot])}")
        with launch_scope(self._device, stream):
            if scalar is None:
                _upload(self._increments, inc)
            ops.lengths_add(self._lengths, n, scalar if scalar is not None else self._increments,
                            self._max_len, status=self._status, stream=stream)
        grew = bool((inc > 0).any())
        if known:
            self._host_lengths[:n] = new
            self._all_empty = not bool((new > 0).any())
        elif grew:
            self._known[:n] = False   # the device may have refused it: lengths unknown
            self._all_empty = False

    def _commit_device(self, increment, stream) -> None:
        xp = self._device.xp
        if array_module_of(increment) is not xp:
            increment = xp.asarray(increment)   # zero-copy for __cuda_array_interface__
        n = self._active
        if increment.dtype != np.int32:
            raise ValueError(f"increment: expected dtype int32, got {increment.dtype}")
        if increment.ndim != 1 or increment.shape[0] != n:
            raise ValueError(f"increment: expected shape ({n},), got {tuple(increment.shape)}")
        if not increment.flags.c_contiguous:
            raise ValueError("increment: expected a C-contiguous array")
        with launch_scope(self._device, stream):
            ops.lengths_add(self._lengths, n, increment, self._max_len, status=self._status,
                            stream=stream)
        self._known[:n] = False
        self._all_empty = n == 0

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
        xp = self._device.xp
        on_device = self._device.is_cuda and (array_module_of(batch_mapping) is not np or
                                              hasattr(batch_mapping, "__cuda_array_interface__"))
        if on_device:
            mapping = xp.asarray(batch_mapping)
            if mapping.dtype != np.int32 or mapping.ndim != 1 or mapping.shape[0] < old \
                    or not mapping.flags.c_contiguous:
                raise ValueError(f"batch_mapping: expected a C-contiguous int32 [>= {old}] "
                                 f"array, got {mapping.dtype} {tuple(mapping.shape)}")
        else:
            host = self._check_host_mapping(batch_mapping, old, new)
        with launch_scope(self._device, stream):
            if not on_device:
                _upload(self._mapping, host)
                mapping = self._mapping
            ops.compaction_plan(mapping, old, new, self._plan, lengths=self._lengths,
                                stream=stream)
            for group in self._kv_groups:
                ops.kv_compact(group, self._plan, self._lengths, stream=stream)
            ops.slots_compact(self._state_slots, self._plan, stream=stream)
        if on_device:
            self._known[:new] = False
        else:
            kept = np.flatnonzero(host >= 0)
            lengths, known = self._host_lengths.copy(), self._known.copy()
            self._host_lengths[:new] = 0
            self._known[:new] = True
            self._host_lengths[host[kept]] = lengths[kept]
            self._known[host[kept]] = known[kept]
        self._active = new

    @staticmethod
    def _check_host_mapping(batch_mapping, old: int, new: int) -> np.ndarray:
        host = host_ints("batch_mapping", batch_mapping, old)
        bad = np.flatnonzero((host < -1) | (host >= new))
        if bad.size:
            raise ValueError(f"batch_mapping[{bad[0]}]: expected -1 or a slot in [0, {new}), "
                             f"got {host[bad[0]]}")
        kept = host[host >= 0]
        if np.unique(kept).size != kept.size:
            values, counts = np.unique(kept, return_counts=True)
            raise ValueError(f"batch_mapping: expected an injective mapping, got slot "
                             f"{values[counts > 1][0]} more than once")
        return host


def _upload(dst, host: np.ndarray) -> None:
    """``dst[:len(host)] = host`` as int32, host to device on the current stream."""
    n = host.shape[0]
    if n == 0:
        return
    values = host.astype(np.int32)
    if isinstance(dst, np.ndarray):
        dst[:n] = values
    else:
        dst[:n].set(values)
