"""Draft states of speculative decoding for a contiguous-slot manager (docs/design.md §4.13).

An engine that verifies ``k`` draft tokens in one forward pass writes, for every Mamba /
linear-attention layer, the recurrent and conv state after each draft position into a draft
buffer ``[max_batch, max_draft_tokens, ...]`` (position ``j``: the state after written token
``j``) and leaves the live state as it was before the drafts. After verification,
``commit_draft`` (:meth:`hcache.slots.batch.BatchAPI.commit_draft`) copies the state after the
last accepted token into the live state, for every layer in one launch
(:func:`hcache.ops.draft_accept`), and advances the lengths by the kept tokens. The draft buffers
are separate from the manager's caches (and from its ``memory_report``): a manager that never
speculates pays nothing.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import check_index, check_int, host_ints
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..memory import check_fits
from ..ops.tables import SlotSet
from ..runtime.arrays import as_array, on_device
from ..runtime.device import launch_scope, settle, upload_ints, zeros

__all__ = ["DraftStates", "commit_draft"]


class DraftStates:
    """Per-slot draft states of every Mamba layer of ``manager``.

    Parameters
    ----------
    manager : HybridCacheManager or LinearKVCache
        Its Mamba layers (if any) get one draft buffer per live state tensor.
    max_draft_tokens : int
        Positions per slot, ``>= 1``: the most tokens a verify step writes per sequence.
    stream : stream, optional
        Stream of the construction work (zeroing, the descriptor table).

    Attributes
    ----------
    manager
        The manager whose live states :meth:`~hcache.slots.batch.BatchAPI.commit_draft`
        updates from these buffers.

    Raises
    ------
    TypeError
        ``manager`` is not a contiguous-slot batch manager.
    ValueError
        ``max_draft_tokens`` is not an int in ``[1, 2**31 - 1]`` (or the buffers' slot count
        would pass it).
    CacheCapacityError
        The buffers do not fit in the device memory available (nothing is allocated).
    """

    __copy__, __deepcopy__, __reduce_ex__ = refuse_copy, refuse_deepcopy, refuse_pickle

    def __init__(self, manager, max_draft_tokens, stream=None):
        # A batch manager (BatchAPI) with its Mamba sub-manager; duck-typed, since batch.py
        # imports this module.
        if not (hasattr(manager, "commit_draft") and hasattr(manager, "_mamba")):
            raise TypeError(f"manager: expected a HybridCacheManager or LinearKVCache, "
                            f"got {type(manager).__name__}")
        mamba = manager._mamba
        self.manager = manager
        self._max_draft = check_int("max_draft_tokens", max_draft_tokens, 1, 2**31 - 1)
        self._mamba = mamba
        live = mamba.state_tensors if mamba is not None else ()
        batch = manager._max_batch
        if live and batch * self._max_draft > 2**31 - 1:
            raise ValueError(f"max_draft_tokens: expected at most {(2**31 - 1) // batch} for "
                             f"{batch} slots, got {self._max_draft}")
        device = manager.device
        check_fits("max_draft_tokens", self._nbytes_for(live, self._max_draft), device)
        self._drafts: tuple = ()
        self._slots = None
        with launch_scope(device, stream):
            drafts = [zeros(device, (batch, self._max_draft) + tuple(t.shape[1:]), t.dtype)
                      for t in live]
            self._drafts = tuple(drafts)
            if drafts:
                self._slots = SlotSet([(d.reshape((batch * self._max_draft,) + d.shape[2:]), t)
                                       for d, t in zip(drafts, live, strict=True)])
            settle(device)
        self._num_recurrent = (mamba.num_layers if mamba is not None
                               and mamba.config.has_recurrent_state else 0)

    @staticmethod
    def _nbytes_for(live_states, max_draft_tokens: int) -> int:
        """Device bytes of the draft buffers of ``live_states`` (each ``[max_batch, ...]``) at
        ``max_draft_tokens`` positions, with the descriptor table."""
        states = sum(int(t.nbytes) for t in live_states) * int(max_draft_tokens)
        return states + 32 * len(live_states)

    # --- queries ----------------------------------------------------------------------------

    @property
    def max_draft_tokens(self) -> int:
        """Draft positions per sequence each buffer holds (``k`` of a verify pass, at most)."""
        return self._max_draft

    @property
    def nbytes(self) -> int:
        """Device bytes of the draft buffers and their descriptor table."""
        return int(sum(d.nbytes for d in self._drafts)
                   + (self._slots.device_infos.nbytes if self._slots is not None else 0))

    @property
    def slot_set(self):
        """The ``(draft, live)`` :class:`~hcache.ops.tables.SlotSet` of the accept launch (draft
        tensors flattened to ``[max_batch * max_draft_tokens, ...]``), or None without Mamba
        layers."""
        return self._slots

    def _mamba_index(self, i) -> int:
        """Decoder layer ``i`` (HybridCacheManager) or Mamba index ``i`` (LinearKVCache)."""
        if hasattr(self.manager, "_mamba_index_of"):
            return self.manager._mamba_index(i)
        return check_index("i", i, self._mamba.num_layers if self._mamba is not None else 0)

    def get_recurrent_draft(self, i):
        """The recurrent draft buffer of layer ``i`` (a decoder layer of a
        HybridCacheManager, a Mamba index of a LinearKVCache): a view ``[max_batch,
        max_draft_tokens, num_heads, head_dim, state_size]`` (``ssm_dtype``); position ``j``
        of slot ``b`` is the state after the ``j``-th token written in the verify step.

        Raises
        ------
        IndexError, ValueError
            As the manager's ``get_recurrent_state``.
        """
        m = self._mamba_index(i)
        if not self._num_recurrent:
            raise ValueError(f"i: expected a layer with a recurrent state, got layer {i}, a "
                             f"conv-only layer (short convolution)")
        return self._drafts[m]

    def get_conv_draft(self, i):
        """The conv draft buffer of layer ``i`` (indexed as in :meth:`get_recurrent_draft`): a
        view ``[max_batch, max_draft_tokens, conv_dim, conv_kernel]`` (``conv_dtype``).

        Raises
        ------
        IndexError, ValueError
            As the manager's ``get_conv_state``.
        """
        m = self._mamba_index(i)
        if not self._mamba.config.has_conv_state:
            raise ValueError(f"i: expected a layer with a conv state, got layer {i}, with a "
                             f"recurrent state only (lightning attention)")
        return self._drafts[self._num_recurrent + m]

    def memory_report(self) -> dict:
        """Device bytes: ``draft_states`` (the buffers), ``metadata`` (descriptor table),
        ``total``."""
        states = int(sum(d.nbytes for d in self._drafts))
        return {"draft_states": states, "metadata": self.nbytes - states, "total": self.nbytes}


# BatchAPI.commit_draft (``self``: a HybridCacheManager or LinearKVCache), kept here with the
# draft states so that the batch module stays one concept.
def commit_draft(self, accepted, num_draft_tokens, *, draft_states=None, bonus_token=False,
                 stream=None) -> None:
    """Keep the accepted prefix of every active sequence's draft tokens (docs/design.md
    §4.13), in place: lengths advance by the kept tokens, and every Mamba layer's live
    state becomes the state after the last kept token (one launch for all layers, then one
    for the lengths). Nothing else moves; no host sync, no allocation: with device
    ``accepted`` the call is graph-capturable.

    The engine wrote ``num_draft_tokens`` tokens per sequence at its committed length
    (:meth:`write_kv`) and, into ``draft_states``, the state after each of them (position
    ``j``: after token ``j``), leaving the live states as they were before the drafts.

    Parameters
    ----------
    accepted : host ints [active_batch_size], or device int32 [active_batch_size]
        Sequence ``b`` keeps ``kept = accepted[b] + bonus_token`` of its written tokens,
        ``kept <= num_draft_tokens``; ``kept == 0`` leaves its state and length as they
        were. Device data is not read on the host: a row out of range (negative, too
        many, past ``max_sequence_length``) commits nothing and is counted in
        :meth:`refused_commit_count`.
    num_draft_tokens : int
        Tokens written per sequence, in ``[0, draft_states.max_draft_tokens]`` (``[0,
        max_sequence_length]`` without Mamba layers).
    draft_states : DraftStates, optional
        This manager's draft buffers; required when it has Mamba layers.
    bonus_token : bool
        The first written token is the previous step's bonus token, always kept.
    stream : optional

    Raises
    ------
    TypeError
        A bad ``accepted``, ``draft_states`` or stream.
    ValueError
        A bad count, ``draft_states`` of another manager or missing, a manager with ring
        (sliding-window) layers (a rejected draft overwrote tokens of the window), or (host
        data) an accepted count out of range or a length past ``max_sequence_length``.
        Nothing changes.
    """
    n = self._active
    if self._has_rings:
        raise ValueError("commit_draft: expected a manager without ring-buffer layers "
                         "(rejected drafts overwrite the window), got one with rings")
    if draft_states is not None and not isinstance(draft_states, DraftStates):
        raise TypeError(f"draft_states: expected DraftStates, "
                        f"got {type(draft_states).__name__}")
    if draft_states is not None and draft_states.manager is not self:
        raise ValueError("draft_states: expected the draft states of this manager, got "
                         "those of another")
    slots = None if draft_states is None else draft_states.slot_set
    if draft_states is None and self._mamba is not None:
        raise ValueError("draft_states: expected this manager's DraftStates (it has Mamba "
                         "layers), got None")
    if not isinstance(bonus_token, (bool, np.bool_)):
        raise TypeError(f"bonus_token: expected a bool, got {type(bonus_token).__name__}")
    cap = self._max_len if draft_states is None else draft_states.max_draft_tokens
    written = check_int("num_draft_tokens", num_draft_tokens, int(bonus_token), cap)
    bonus = int(bonus_token)
    if self._device.is_cuda and on_device(accepted):
        acc = as_array("accepted", accepted, self._device, stream)
        if acc.dtype != np.int32:
            raise ValueError(f"accepted: expected dtype int32, got {acc.dtype}")
        if acc.ndim != 1 or acc.shape[0] != n:
            raise ValueError(f"accepted: expected shape ({n},), got {tuple(acc.shape)}")
        if not acc.flags.c_contiguous:
            raise ValueError("accepted: expected a C-contiguous array")
        host = None
    else:
        host = host_ints("accepted", accepted, n)
        bad = np.flatnonzero((host < 0) | (host + bonus > written))
        if bad.size:
            raise ValueError(f"accepted[{bad[0]}]: expected a count in [0, "
                             f"{written - bonus}], got {host[bad[0]]}")
        if self._headroom_now() is not None:
            new = self._host_lengths[:n] + host + bonus
            over = np.flatnonzero(new > self._max_len)
            if over.size:
                raise ValueError(f"accepted[{over[0]}]: expected a commit within "
                                 f"max_sequence_length {self._max_len}, "
                                 f"got length {int(new[over[0]])}")
    with launch_scope(self._device, stream, self._order):
        if host is not None:
            upload_ints(self._increments, host)
            acc = self._increments
        if slots is not None:
            ops.draft_accept(slots, draft_states.max_draft_tokens, acc, n, written,
                             bonus=bonus, lengths=self._lengths, max_len=self._max_len,
                             stream=stream)
        ops.draft_lengths(self._lengths, acc, n, written, self._max_len, bonus=bonus,
                          status=self._status, stream=stream)
    if host is not None and self._headroom_now() is not None:
        self._host_lengths[:n] += host + bonus
        self._all_empty = not bool((self._host_lengths[:n] > 0).any())
    else:
        self._known[:n] = False
        self._all_empty = n == 0
    self._headroom_stale = True
