"""The device side of batch compaction (docs/design.md §4 "Batch API").

A :class:`BatchCompaction` owns what :meth:`hcache.slots.batch.BatchAPI.compact_batch` moves and
the buffers it moves them with: the head-dim groups (tokens, by span), one
:class:`~hcache.ops.tables.SlotSet` of the whole-slot states with the lengths last, and the
device mapping and plan buffers. One compaction is one :func:`hcache.ops.compaction_plan`
launch (the mapping becomes a plan, or is flagged invalid), one :func:`hcache.ops.kv_compact`
launch per head-dim group and one :func:`hcache.ops.slots_compact` launch.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import host_ints
from ..ops.tables import SlotSet
from ..runtime.arrays import as_array, on_device
from ..runtime.device import to_host, upload_ints

__all__ = ["BatchCompaction"]


class BatchCompaction:
    """Moves the slots of a contiguous-slot manager to their new indices, in place.

    Parameters
    ----------
    device : Device
    lengths : array, int32 [max_batch]
        The manager's lengths: moved with the states, and read by the token moves.
    kv_groups : sequence of KVGroup
        HND groups moved by token spans (the first ``length`` tokens of each slot).
    slot_tensors : sequence of arrays ``[max_batch, ...]``
        C-contiguous per-slot states moved whole (Mamba recurrent and conv states).

    Notes
    -----
    Allocates on the current device and stream: construct it inside the manager's launch scope.
    """

    def __init__(self, device, lengths, *, kv_groups=(), slot_tensors=()):
        xp = device.xp
        max_batch = int(lengths.shape[0])
        self._device = device
        self._lengths = lengths
        self._mapping = xp.full(max_batch, -1, dtype=np.int32)
        self._plan = xp.zeros(ops.compaction_plan_size(max_batch), dtype=np.int32)
        self._kv_groups = tuple(kv_groups)
        # The lengths come last in the one slot launch: the token moves before it read the
        # pre-compaction lengths.
        self._slots = SlotSet([(t, t) for t in slot_tensors] + [(lengths, lengths)])

    @property
    def nbytes(self) -> int:
        """Device bytes of the mapping and plan buffers and of the slot descriptor table."""
        return int(self._mapping.nbytes + self._plan.nbytes + self._slots.device_infos.nbytes)

    def check_mapping(self, batch_mapping, old: int, new: int, stream=None):
        """``batch_mapping`` in the form :meth:`run` takes; changes nothing (a foreign device
        mapping orders ``stream``, the compaction's, after its producer).

        Returns
        -------
        numpy.ndarray, int64 [old], or a device array, int32 [>= old]
            A host mapping, checked: each entry -1 or a slot in ``[0, new)``, injective. A
            device mapping (on cuda) is checked for dtype, shape and layout only.

        Raises
        ------
        TypeError
            A host mapping that is not host integers.
        ValueError
            A device mapping that is not C-contiguous int32 ``[>= old]``; a host mapping with
            other than ``old`` entries, an entry out of range, or a slot named twice.
        """
        if self._device.is_cuda and on_device(batch_mapping):
            mapping = as_array("batch_mapping", batch_mapping, self._device, stream)
            if mapping.dtype != np.int32 or mapping.ndim != 1 or mapping.shape[0] < old \
                    or not mapping.flags.c_contiguous:
                raise ValueError(f"batch_mapping: expected a C-contiguous int32 [>= {old}] "
                                 f"array, got {mapping.dtype} {tuple(mapping.shape)}")
            return mapping
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

    def run(self, mapping, old: int, new: int, stream) -> None:
        """Plan and move (in place): slot ``i`` to ``mapping[i]``, for ``i < old``.

        ``mapping`` comes from :meth:`check_mapping`: a host one is uploaded to the mapping
        buffer first; a device one goes to the kernels as it is (an invalid one moves nothing).
        Call it inside the manager's launch scope.
        """
        if isinstance(mapping, np.ndarray):
            upload_ints(self._mapping, mapping)
            mapping = self._mapping
        ops.compaction_plan(mapping, old, new, self._plan, lengths=self._lengths, stream=stream)
        for group in self._kv_groups:
            ops.kv_compact(group, self._plan, self._lengths, stream=stream)
        ops.slots_compact(self._slots, self._plan, stream=stream)

    def last_valid(self) -> bool:
        """Whether the last plan was valid: reads its status on the current stream
        (**synchronizes** it)."""
        return int(to_host(self._plan[:1])[0]) == 0
