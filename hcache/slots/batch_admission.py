"""Per-slot admission into a running batch (``admit_sequences``, docs/design.md §4.12), a part
of :class:`~hcache.slots.batch.BatchAPI`: new lengths land in chosen slots on the device, one
slot-copy launch from the staged increments buffer, every other slot untouched, no host read.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import host_ints, index_array
from ..ops.tables import SlotSet
from ..runtime.device import launch_scope, upload_ints

__all__ = ["BatchAdmission"]


class BatchAdmission:
    """The admission half of :class:`~hcache.slots.batch.BatchAPI` (its state: ``_lengths``,
    ``_increments``, the host mirror, the active batch)."""

    def _init_admission(self, xp) -> None:
        """Row indices ``arange(max_batch)``, the staged slots, and the one-row table moving
        staged lengths (in ``_increments``) to ``lengths[slots]``. In construction scope."""
        self._admit_rows = xp.zeros(self._max_batch, dtype=np.int32)
        upload_ints(self._admit_rows, np.arange(self._max_batch))
        self._admit_slots = xp.zeros(self._max_batch, dtype=np.int32)
        self._admit_set = SlotSet([(self._increments.reshape(-1, 1),
                                    self._lengths.reshape(-1, 1))])

    @property
    def _admission_nbytes(self) -> int:
        return int(self._admit_rows.nbytes + self._admit_slots.nbytes
                   + self._admit_set.device_infos.nbytes)

    def admit_sequences(self, slots, lengths, stream=None) -> None:
        """Admit sequences into single slots of a running batch: ``lengths[slots[i]] =
        lengths[i]`` on the device, every other slot's length untouched (one upload and one
        launch, no host sync, no allocation). The active batch grows to cover the highest
        admitted slot. Write the slots' caches and states before or after (a restored prompt:
        :meth:`restore_kv_cache`, :meth:`write_states`, or :class:`~hcache.PromptCacheStore`,
        which admits for you); a fresh sequence admitted with length 0 needs its Mamba states
        zeroed or written by the engine.

        Parameters
        ----------
        slots : host ints [n]
            Distinct slots in ``[0, max_batch)``: a running row to replace, or a slot at or
            past ``active_batch_size``; every slot between the old active batch size and the
            highest admitted one must be admitted too (no slot comes back with a stale length).
        lengths : host ints [n]
            Tokens already in each slot (its restored prompt), in
            ``[0, max_sequence_length]``.
        stream : optional

        Raises
        ------
        TypeError, IndexError, ValueError
            Not host integers, a slot out of range or repeated, lengths of another count or
            out of range, a gap that would expose a stale slot, a bad stream. Nothing changes.
        """
        index, new_lengths, active = self._check_admission(slots, lengths)
        n = len(index)
        with launch_scope(self._device, stream, self._order):
            if n:
                upload_ints(self._increments, new_lengths)
                upload_ints(self._admit_slots, index)
                ops.slot_copy(self._admit_set, self._admit_rows[:n], self._admit_slots[:n],
                              stream=stream)
        self._host_lengths[index] = new_lengths
        self._known[index] = True
        self._set_active(active)
        known = bool(self._known[:active].all())
        self._all_empty = known and not bool((self._host_lengths[:active] > 0).any())
        self._headroom_stale = True

    def _check_admission(self, slots, lengths) -> tuple:
        """:meth:`admit_sequences`' checks: ``(slots int64 [n], lengths int64 [n], the new
        active batch size)``; changes nothing."""
        index = index_array("slots", slots, self._max_batch, distinct=True)
        n = len(index)
        new_lengths = host_ints("lengths", lengths)
        if new_lengths.shape[0] != n:
            raise ValueError(f"lengths: expected {n} lengths (one per slot), "
                             f"got {new_lengths.shape[0]}")
        bad = np.flatnonzero((new_lengths < 0) | (new_lengths > self._max_len))
        if bad.size:
            raise ValueError(f"lengths[{bad[0]}]: expected a length in [0, {self._max_len}], "
                             f"got {new_lengths[bad[0]]}")
        active = max(self._active, int(index.max()) + 1 if n else 0)
        gap = np.setdiff1d(np.arange(self._active, active), index)
        if gap.size:
            raise ValueError(f"slots: expected every slot in [{self._active}, {active}) "
                             f"(past the active batch, below the highest admitted), "
                             f"missing {int(gap[0])}")
        return index, new_lengths, active

