"""Draft states of speculative decoding for a :class:`~hcache.contexts.DynamicInferenceContext`
(docs/design.md §6.9).

A verify step extends each request by ``k`` written tokens (the previous step's bonus token
and the drafts). For every Mamba / linear-attention layer the engine writes the state after
each written token ``j`` into position ``j`` of the request's live slot here, and leaves the
live state as it was before the step. ``commit_draft`` then keeps, per request, the state
after its last accepted token: one :func:`hcache.ops.draft_accept` launch for every layer and
both kinds of state, into the live states; and it copies the states at the accepted block
boundaries the prefix cache keeps into the context's snapshot scratch (one
:func:`hcache.ops.slot_copy` launch). The buffers are separate from the context (their own
``nbytes``): a context that never speculates pays nothing.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import check_int
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..memory import check_fits
from ..ops.tables import SlotSet
from ..runtime.device import launch_scope, settle, upload_ints, zeros
from ..runtime.stream_order import StreamOrder

__all__ = ["ContextDraftStates"]

_INT32_MAX = 2**31 - 1


class ContextDraftStates:
    """Per-live-slot draft states of every Mamba layer of ``context``.

    Parameters
    ----------
    context : DynamicInferenceContext
        Its Mamba layers (if any) get a draft buffer per live state array.
    max_draft_tokens : int
        Positions per live slot, ``>= 1``: the most tokens a verify step writes per request.
    stream : stream, optional
        Stream of the construction work (zero fills, descriptor tables).

    Attributes
    ----------
    context : DynamicInferenceContext
    conv_states, ssm_states : arrays [num_mamba_layers, max_requests, max_draft_tokens, *shape]
        Position ``j`` of live slot ``s`` (``plan.mamba_slots[i]``) is the state after the
        ``j``-th token written in the verify step (in the live states' dtypes); None for a state
        kind the layers do not have, or without Mamba layers.

    Raises
    ------
    TypeError
        ``context`` is not a DynamicInferenceContext.
    ValueError
        ``max_draft_tokens`` is not an int in ``[1, 2**31 - 1]`` (or the buffers' slot count
        would pass it).
    CacheCapacityError
        The buffers do not fit in the device memory available (nothing is allocated).
    """

    __copy__, __deepcopy__, __reduce_ex__ = refuse_copy, refuse_deepcopy, refuse_pickle

    def __init__(self, context, max_draft_tokens, stream=None):
        if not (hasattr(context, "commit_draft") and hasattr(context, "_live")):
            raise TypeError(f"context: expected a DynamicInferenceContext, "
                            f"got {type(context).__name__}")
        self.context = context
        k = self._max_draft = check_int("max_draft_tokens", max_draft_tokens, 1, _INT32_MAX)
        R, L = context.max_requests, context.num_mamba_layers
        live = [t for t in (context.mamba_conv_states, context.mamba_ssm_states)
                if t is not None] if L else []
        if live and R * k > _INT32_MAX:
            raise ValueError(f"max_draft_tokens: expected at most {_INT32_MAX // R} for {R} "
                             f"live slots, got {k}")
        device = self.device = context.device
        check_fits("max_draft_tokens", sum(int(t.nbytes) for t in live) * k
                   + 64 * len(live) * L + 16 * R, device)
        self.order = StreamOrder()   # its staging buffers: one chain across streams
        self.conv_states = self.ssm_states = None
        self._to_live = self._to_scratch = None
        with launch_scope(device, stream):
            drafts = [None if t is None or not L
                      else zeros(device, (L, R, k) + tuple(t.shape[2:]), t.dtype)
                      for t in (context.mamba_conv_states, context.mamba_ssm_states)]
            self.conv_states, self.ssm_states = drafts
            # Staging: accepted counts and live slots of the scatter's rows, source and
            # destination rows of the snapshot copy (at most 3 per request row).
            self._rows_dev = zeros(device, (2, R), np.int32)
            self._copy_dev = zeros(device, (2, 3 * R), np.int32)
            flat = [None if d is None else d.reshape((L, R * k) + d.shape[3:]) for d in drafts]
            live_arrays = (context.mamba_conv_states, context.mamba_ssm_states)
            if live:
                self._to_live = SlotSet([(f[m], t[m]) for f, t in zip(flat, live_arrays)
                                         if f is not None for m in range(L)])
            allocator = context.mamba_slot_allocator
            if allocator is not None:
                scratch = (allocator.intermediate_conv_out, allocator.intermediate_ssm_out)
                self._to_scratch = SlotSet([(f[m], s[m]) for f, s in zip(flat, scratch)
                                            if f is not None for m in range(L)])
            settle(device)

    # --- queries ----------------------------------------------------------------------------

    @property
    def max_draft_tokens(self) -> int:
        """Draft positions per live slot (``k`` of a verify step, at most)."""
        return self._max_draft

    @property
    def nbytes(self) -> int:
        """Device bytes of the draft buffers, their descriptor tables and index staging."""
        return self.memory_report()["total"]

    def memory_report(self) -> dict:
        """Device bytes: ``draft_states`` (the buffers), ``metadata`` (descriptor tables and
        index staging), ``total``."""
        states = int(sum(d.nbytes for d in (self.conv_states, self.ssm_states) if d is not None))
        metadata = int(sum(s.device_infos.nbytes for s in (self._to_live, self._to_scratch)
                           if s is not None) + self._rows_dev.nbytes + self._copy_dev.nbytes)
        return {"draft_states": states, "metadata": metadata, "total": states + metadata}

    # --- the launches of a commit (arguments checked by the caller) ---------------------------

    def _scatter_accepted(self, accepted: np.ndarray, live_slots: np.ndarray, written: int,
                         bonus: int, stream) -> None:
        """``live[slot_i] = draft[slot_i, accepted[i] + bonus - 1]`` for every layer and state
        kind, rows with nothing kept left alone: one ``draft_accept`` launch (host counts
        staged; ``written``: the most tokens a row wrote)."""
        n = len(accepted)
        if self._to_live is None or n == 0:
            return
        acc, slots = self._rows_dev[0], self._rows_dev[1]
        with launch_scope(self.device, stream, self.order):
            upload_ints(acc, accepted)
            upload_ints(slots, live_slots)
            ops.draft_accept(self._to_live, self._max_draft, acc, n, written,
                             row_to_slot=slots, bonus=bonus, stream=stream)

    def _copy_to_scratch(self, live_slots: np.ndarray, positions: np.ndarray,
                        scratch_indices: np.ndarray, stream) -> None:
        """``scratch[scratch_indices[i]] = draft[live_slots[i], positions[i]]`` for every layer
        and state kind: one ``slot_copy`` launch (none when there is nothing to copy)."""
        n = len(positions)
        if self._to_scratch is None or n == 0:
            return
        src, dst = self._copy_dev[0], self._copy_dev[1]
        with launch_scope(self.device, stream, self.order):
            upload_ints(src, np.asarray(live_slots) * self._max_draft + positions)
            upload_ints(dst, np.asarray(scratch_indices))
            ops.slot_copy(self._to_scratch, src[:n], dst[:n], stream=stream)
