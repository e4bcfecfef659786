"""Draft states of speculative decoding for a contiguous-slot manager (docs/design.md §4.11).

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

from .._checks import check_index, check_int
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..device import launch_scope, settle, zeros
from ..memory import check_fits
from ..ops.tables import SlotSet

__all__ = ["DraftStates"]


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
        from .batch import BatchAPI

        if not isinstance(manager, BatchAPI):
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
