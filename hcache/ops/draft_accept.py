"""Speculative-decoding commits (kernels/draft_accept.cu, docs/design.md §3.10). Ops:
:func:`draft_accept` (``hc_draft_accept``: the accepted position's recurrent / conv state into
the live state) and :func:`draft_lengths` (``hc_draft_lengths``: lengths advance by the kept
tokens)."""

from __future__ import annotations

from .._checks import INT32_MAX, check_int, int32_array
from ..runtime.device import array_module_of
from . import reference as ref
from ._launch import BLOCK, ceil_div, check_status, grid_x, i32, launcher, ptr

__all__ = ["draft_accept", "draft_lengths"]


def _check_rows(accepted, row_to_slot, num_rows, xp) -> int:
    num_rows = check_int("num_rows", num_rows, 0, INT32_MAX)
    int32_array("accepted", accepted, xp, min_len=num_rows)
    int32_array("row_to_slot", row_to_slot, xp, min_len=num_rows)
    return num_rows


def _check_counts(written, bonus, draft_len=None) -> tuple[int, int]:
    written = check_int("written", written, 0, INT32_MAX if draft_len is None else draft_len)
    bonus = check_int("bonus", bonus, 0, 1)
    return written, bonus


def draft_accept(slots, draft_len, accepted, num_rows, written, *, row_to_slot=None, bonus=0,
                 lengths=None, max_len=INT32_MAX, status=None, stream=None, backend=None):
    """Scatter the state after each row's last kept draft token into its live state (one
    launch for every tensor of ``slots``).

    Parameters
    ----------
    slots : SlotSet
        Pairs ``(draft, live)``: ``draft`` ``[num_slots * draft_len, ...]`` (sequence slot
        ``s``'s state after draft position ``j`` at ``s * draft_len + j``), ``live``
        ``[num_slots, ...]`` of the same slot shape and dtype.
    draft_len : int
        Draft positions per sequence slot in the draft tensors, ``>= 1``.
    accepted : int32 [>= num_rows]
        Accepted draft tokens per row (device data: never read on the host).
    num_rows : int
    written : int
        Tokens the engine wrote per row, in ``[0, draft_len]``.
    row_to_slot : int32 [>= num_rows], optional
        Row ``i``'s sequence slot (default ``i``); -1 skips the row; slots distinct.
    bonus : {0, 1}
        1 when the first written token is the previous step's bonus token (always kept):
        ``kept = accepted + bonus``.
    lengths : int32 [num_slots], optional
        The slots' lengths before the commit (read only): a row whose ``lengths[s] + kept``
        passes ``max_len`` commits nothing, as in :func:`draft_lengths`.
    max_len : int
    status : int32 [1], optional
        Incremented once per row out of range (bad slot, ``accepted < 0``, ``kept > written``,
        past ``max_len``); such a row's live state is not touched.

    In place: ``live[s] = draft[s * draft_len + kept - 1]`` for every committing row with
    ``kept >= 1``; nothing else is written.

    Raises
    ------
    TypeError, ValueError
        A bad argument (nothing runs): arrays of another module, wrong dtype, too short, a
        draft tensor whose slot count is not ``draft_len`` times its live tensor's.
    """
    xp = slots.xp
    draft_len = check_int("draft_len", draft_len, 1, INT32_MAX)
    num_rows = _check_rows(accepted, row_to_slot, num_rows, xp)
    written, bonus = _check_counts(written, bonus, draft_len)
    max_len = check_int("max_len", max_len, 0, INT32_MAX)
    for i, (draft, live) in enumerate(slots.pairs):
        if draft.shape[0] != live.shape[0] * draft_len:
            raise ValueError(f"slots: expected pair {i}'s draft tensor to hold {draft_len} "
                             f"slots per live slot ({live.shape[0] * draft_len}), "
                             f"got {draft.shape[0]}")
    num_slots = int(slots.pairs[0][1].shape[0])
    int32_array("lengths", lengths, xp, min_len=num_slots)
    check_status(status, xp)
    run = launcher(xp, backend, stream, slots.device_infos)
    if run is None:
        return ref.draft_accept(slots, draft_len, accepted[:num_rows], num_rows, written,
                                row_to_slot=None if row_to_slot is None
                                else row_to_slot[:num_rows],
                                bonus=bonus, lengths=lengths, max_len=max_len, status=status)
    if num_rows == 0:
        return
    grid = (grid_x(num_rows * ceil_div(slots.max_slot_bytes, 16)), slots.num_tensors, 1)
    run.launch("draft_accept", "hc_draft_accept", grid, (BLOCK, 1, 1),
               (ptr(slots.device_infos), ptr(accepted), ptr(row_to_slot), i32(num_rows),
                i32(draft_len), i32(written), i32(bonus), ptr(lengths), i32(max_len),
                ptr(status)))


def draft_lengths(lengths, accepted, num_rows, written, max_len, *, row_to_slot=None, bonus=0,
                  status=None, stream=None, backend=None):
    """``lengths[s] += accepted[i] + bonus`` for every row ``i`` (slot ``s``) whose count is in
    range (one launch); see :func:`draft_accept` for the rows and their predicate.

    Parameters
    ----------
    lengths : int32 [num_slots]
        In place.
    accepted, num_rows, written, row_to_slot, bonus : as :func:`draft_accept`
    max_len : int
        A row whose new length would pass it commits nothing.
    status : int32 [1], optional
        Incremented once per row out of range.

    Raises
    ------
    TypeError, ValueError
        A bad argument (nothing runs).
    """
    xp = array_module_of(lengths)
    int32_array("lengths", lengths, xp)
    num_rows = _check_rows(accepted, row_to_slot, num_rows, xp)
    written, bonus = _check_counts(written, bonus)
    max_len = check_int("max_len", max_len, 0, INT32_MAX)
    check_status(status, xp)
    run = launcher(xp, backend, stream, lengths)
    if run is None:
        return ref.draft_lengths(lengths, accepted[:num_rows], num_rows, written, max_len,
                                 row_to_slot=None if row_to_slot is None
                                 else row_to_slot[:num_rows],
                                 bonus=bonus, status=status)
    if num_rows == 0:
        return
    run.launch("draft_accept", "hc_draft_lengths", (grid_x(num_rows), 1, 1), (BLOCK, 1, 1),
               (ptr(lengths), i32(lengths.shape[0]), ptr(accepted), ptr(row_to_slot),
                i32(num_rows), i32(written), i32(bonus), i32(max_len), ptr(status)))
