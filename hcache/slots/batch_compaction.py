"""Batch compaction after evictions, a mixin of :class:`hcache.slots.batch.BatchAPI`.

:meth:`BatchCompaction.compact_batch` moves every surviving slot to its new index in place: one
:func:`hcache.ops.compaction_plan` launch turns the mapping into a plan (or flags it invalid), then
one :func:`hcache.ops.kv_compact` launch per head-dim group moves the first ``length`` tokens of
each slot, and one :func:`hcache.ops.slots_compact` launch moves the whole-slot states and the
lengths. The host mirror of the lengths follows a host mapping exactly; a device mapping makes
the slots below ``new_batch`` unknown on the host.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import check_int, host_ints
from ..device import array_module_of, launch_scope, upload_ints

__all__ = ["BatchCompaction"]


class BatchCompaction:
    """Compaction of a contiguous-slot manager's batch.

    Uses the state that :meth:`hcache.slots.batch.BatchAPI._setup_batch` allocates: the device
    lengths, mapping and plan buffers, the head-dim groups, the whole-slot tensors and the host
    mirror of the lengths.
    """

    def last_compaction_valid(self, stream=None) -> bool:
        """Whether the last :meth:`compact_batch` mapping was valid (its moves ran).

        Only a device mapping can be invalid here (host mappings are validated and raise);
        an invalid one moved nothing. **Synchronizes** ``stream`` to read the plan status.
        """
        with launch_scope(self._device, stream):
            head = self._plan[:1]
            return int(head.get()[0] if hasattr(head, "get") else head[0]) == 0

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
                upload_ints(self._mapping, host)
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
