"""Copies between the live per-request Mamba states and the durable cache slots.

The live states ``mamba_conv_states`` / ``mamba_ssm_states``
``[num_mamba_layers, max_requests, *shape]`` belong to the context, which maps a request row
to its live slot through ``request_to_mamba_state_idx``. Storing copies a request's live state
into a cache slot owned by a block; restoring copies a block's cached state back into a live
slot. Every batch of copies is a single :func:`hcache.ops.slot_copy` launch over conv and SSM of
all layers, and every call validates all of its arguments before copying anything.

:class:`MambaStateCopyMixin` holds these methods; :class:`MambaSlotAllocator` inherits them.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_index, index_array
from ..device import stream_scope, to_host

__all__ = ["MambaStateCopyMixin"]


class MambaStateCopyMixin:
    """Store/restore methods of :class:`~hcache.contexts.MambaSlotAllocator`.

    Relies on the allocator's ``context``, ``xp``, ``device``, ``max_requests``, ``max_slots``,
    ``num_blocks``, ``num_mamba_layers``, ``conv_states`` / ``ssm_states``,
    ``block_to_slot`` / ``slot_to_block``, ``get_slot``, ``_copy`` and the SlotSets
    ``_live_to_cache`` / ``_cache_to_live``.
    """

    def _live_slots(self, rows: np.ndarray) -> np.ndarray:
        live = to_host(self.context.request_to_mamba_state_idx)[rows].astype(np.int64)
        bad = (live < 0) | (live >= self.max_requests)
        if bad.any():
            raise ValueError(f"request_indices: expected requests with a live Mamba slot, "
                             f"got request {int(rows[bad][0])} -> {int(live[bad][0])}")
        return live

    def _rows(self, name, values) -> np.ndarray:
        table = self.context.request_to_mamba_state_idx
        return index_array(name, values, len(table))

    def store_from_tensors(self, block_id, layer_idx, ssm_state, conv_state, *,
                           stream=None) -> None:
        """Write one layer's states into the slot of ``block_id`` (mainly for tests).

        ``ssm_state`` / ``conv_state`` have the per-slot shapes and storage dtypes; an array of
        another module is converted (an allocation). Raises ``IndexError`` (block or layer out
        of range), ``ValueError`` (block owns no slot, or shape/dtype mismatch).
        """
        slot = self.get_slot(block_id)
        layer = check_index("layer_idx", layer_idx, self.num_mamba_layers)
        if slot < 0:
            raise ValueError(f"block_id: expected a block owning a slot, got {int(block_id)}")
        for name, value, cache in (("ssm_state", ssm_state, self.ssm_states),
                                   ("conv_state", conv_state, self.conv_states)):
            if tuple(value.shape) != cache.shape[2:] or value.dtype != cache.dtype:
                raise ValueError(f"{name}: expected {cache.dtype}{cache.shape[2:]}, "
                                 f"got {value.dtype}{tuple(value.shape)}")
        with stream_scope(stream, self.device), self.device.scope():
            self.ssm_states[layer, slot] = self.xp.asarray(ssm_state)
            self.conv_states[layer, slot] = self.xp.asarray(conv_state)

    def store_from_live_batch(self, slots, request_indices, *, stream=None) -> None:
        """Copy every layer's live state of each request into the paired cache slot (one launch).

        Raises ``IndexError`` (slot or row out of range) or ``ValueError`` (lengths differ, a
        slot repeats or is free, a request has no live slot); nothing is copied then.
        """
        dst = index_array("slots", slots, self.max_slots)
        rows = self._rows("request_indices", request_indices)
        if len(dst) != len(rows):
            raise ValueError(f"request_indices: expected {len(dst)} rows, got {len(rows)}")
        if len(np.unique(dst)) != len(dst):
            raise ValueError("slots: expected distinct slots, got a repeated slot")
        free = dst[self.slot_to_block[dst] < 0]
        if len(free):
            raise ValueError(f"slots: expected slots owned by a block, got free slot "
                             f"{int(free[0])}")
        self._copy(self._live_to_cache, self._live_slots(rows), dst, 0, stream)

    def restore_to_live(self, request_idx, block_id, *, stream=None) -> bool:
        """Copy every layer's cached state of ``block_id`` into the request's live slot.

        Returns False (and copies nothing) when the block owns no slot. Raises ``IndexError``
        (row or block out of range) or ``ValueError`` (the request has no live slot).
        """
        return bool(self.restore_to_live_batch([request_idx], [block_id], stream=stream)[0])

    def restore_to_live_batch(self, request_indices, block_ids, *, stream=None) -> list[bool]:
        """Batched :meth:`restore_to_live`: one launch for every request that has a state.

        Returns, per entry, whether it was restored. The requests' live slots must differ.
        """
        rows = self._rows("request_indices", request_indices)
        ids = index_array("block_ids", block_ids, self.num_blocks)
        if len(ids) != len(rows):
            raise ValueError(f"block_ids: expected {len(rows)} blocks, got {len(ids)}")
        live = self._live_slots(rows)
        if len(np.unique(live)) != len(live):
            raise ValueError("request_indices: expected distinct live slots, got a repeat")
        src = self.block_to_slot[ids]
        found = src >= 0
        self._copy(self._cache_to_live, src[found], live[found], 0, stream)
        return found.tolist()
