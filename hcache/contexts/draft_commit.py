"""The draft commit of a :class:`~hcache.contexts.DynamicInferenceContext` (docs/design.md §6.9).

A verify step is an ordinary extension (``extend_requests``: ``k`` written tokens per request,
their blocks allocated, their K/V written with ``write_kv``) whose Mamba states go to
:class:`~.context_drafts.ContextDraftStates` instead of the live states. ``commit_draft`` then
makes the context exactly what it would be had the engine only ever extended each request by
its kept tokens (``accepted[i]``, plus the bonus token), and commits the step:

- the rejected tokens leave the request: its length, its token count, its blocks (the blocks
  that hold only rejected tokens go back to the pool, in both block spaces) and any hash a
  scheduled-block query computed over them (the chain is rewound to the kept blocks);
- the Mamba snapshots are planned for the kept range only, so a state is cached only at an
  accepted block boundary, and the states there are copied from the draft buffers into the
  snapshot scratch (one launch);
- the live Mamba state becomes the state after the last kept token (one ``draft_accept``
  launch for every layer, rows with nothing kept left as they were);
- then :meth:`~hcache.contexts.DynamicInferenceContext.commit_step`: the completed (accepted)
  blocks are queued for registration, no block is ever registered for a token that was not
  accepted.

The counts are host ints: the context's book-keeping (lengths, blocks, hashes) is host-side.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from .._checks import host_ints
from ..runtime.device import stream_handle
from .block_hashing import chain_block_hashes, chain_root
from .context_drafts import ContextDraftStates
from .token_batches import ragged_columns

__all__ = ["commit_draft"]

_PROMPT_TOKENS = attrgetter("prompt_tokens")


def commit_draft(self, request_ids, accepted, *, draft_states=None, bonus_token=False,
                 stream=None) -> dict:
    """Keep the accepted prefix of every request's verify step and commit the step.

    Every request with a scheduled step must be named: a verify step is committed whole (a
    prompt is committed with :meth:`commit_step`). Request ``i`` keeps ``kept = accepted[i] +
    bonus_token`` of the ``w_i`` tokens its step wrote (``extend_requests``); afterwards the
    context equals one whose engine only ever extended it by the kept tokens: lengths, block
    tables (up to block ids), registered hashes, cached Mamba states and prefix-cache hits.

    Parameters
    ----------
    request_ids : sequence of hashable [n]
        Every request with a scheduled step, each once, in the order of ``accepted``.
    accepted : host ints [n]
        Accepted draft tokens, ``0 <= accepted[i] <= w_i - bonus_token``. Host data: the
        context's lengths, blocks and hashes are kept on the host (a device array is a
        ``TypeError``).
    draft_states : ContextDraftStates, optional
        This context's draft buffers, position ``j`` of slot ``plan.mamba_slots[i]`` holding
        the state after written token ``j``; required with Mamba layers.
    bonus_token : bool
        The first written token is the previous step's bonus token, always kept.
    stream : optional

    Returns
    -------
    dict
        :meth:`commit_step`'s, with ``rejected_tokens`` and ``released_blocks`` (KV blocks
        that held only rejected tokens, full block space).

    Raises
    ------
    TypeError
        ``request_ids`` not a sequence of hashable ids, ``accepted`` not host integers,
        ``draft_states`` not ContextDraftStates, ``bonus_token`` not a bool, a bad ``stream``.
    ValueError
        An unknown or repeated id, a request without a scheduled step or whose prompt is
        scheduled, a scheduled request left out, a count out of range, ``draft_states`` of
        another context, missing, or with fewer positions than a request wrote. Nothing
        changes.
    """
    requests = self._requests
    rows = requests.rows(request_ids)
    ids = list(request_ids)
    pending = requests.pending_end[rows]
    prompt = np.fromiter(map(_PROMPT_TOKENS, map(requests._stats.__getitem__, rows.tolist())),
                         np.int64, len(rows))
    bad = np.flatnonzero((pending < 0) | (requests.lengths[rows] == prompt))
    if bad.size:
        i = int(bad[0])
        got = "no scheduled step" if pending[i] < 0 else "its prompt scheduled"
        raise ValueError(f"request_ids[{i}]: expected a request extended by a verify step, "
                         f"got {ids[i]!r} with {got}")
    scheduled = np.flatnonzero(requests.pending_end >= 0)
    if len(scheduled) != len(rows):
        left = np.setdiff1d(scheduled, rows)[0]
        raise ValueError(f"request_ids: expected every request with a scheduled step, got "
                         f"none for {requests.id_of(int(left))!r}")
    if not isinstance(bonus_token, (bool, np.bool_)):
        raise TypeError(f"bonus_token: expected a bool, got {type(bonus_token).__name__}")
    bonus = int(bonus_token)
    if draft_states is not None and not isinstance(draft_states, ContextDraftStates):
        raise TypeError(f"draft_states: expected ContextDraftStates, "
                        f"got {type(draft_states).__name__}")
    if draft_states is not None and draft_states.context is not self:
        raise ValueError("draft_states: expected the draft states of this context, got those "
                         "of another")
    if draft_states is None and self.num_mamba_layers:
        raise ValueError("draft_states: expected this context's ContextDraftStates (it has "
                         "Mamba layers), got None")
    counts = host_ints("accepted", accepted, len(rows))
    starts = requests.computed[rows]
    written = requests.lengths[rows] - starts
    kept = counts + bonus
    bad = np.flatnonzero((counts < 0) | (kept > written))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"accepted[{i}]: expected a count in [0, {written[i] - bonus}], "
                         f"got {counts[i]}")
    if draft_states is not None and self.num_mamba_layers and len(rows) \
            and written.max() > draft_states.max_draft_tokens:
        i = int(np.argmax(written))
        raise ValueError(f"draft_states: expected room for the {written[i]} tokens written "
                         f"for request_ids[{i}], got max_draft_tokens "
                         f"{draft_states.max_draft_tokens}")
    if stream is not None:
        stream_handle(stream)   # validated before anything changes
    # --- nothing changed so far; from here on the commit cannot fail ----------------------
    ends = starts + kept
    cut = kept < written
    released = _drop_rejected(self, rows[cut], ends[cut]) if cut.any() else 0
    rejected = int((written - kept).sum())
    self.stats.computed_tokens -= rejected
    requests.pending_end[rows] = np.where(kept > 0, ends, -1)   # nothing kept: no step
    if self.num_mamba_layers and len(rows):
        slots = requests.request_to_mamba_state_idx[rows]
        if self.mamba_slot_allocator is not None:
            _plan_kept_snapshots(self, draft_states, rows, starts, ends, kept, cut, stream)
        draft_states._scatter_accepted(counts, slots, int(written.max()), bonus, stream)
    out = self.commit_step(stream=stream)
    out.update(rejected_tokens=rejected, released_blocks=released)
    return out


def _drop_rejected(ctx, rows: np.ndarray, ends: np.ndarray) -> int:
    """Shorten distinct ``rows`` to ``ends`` tokens: lengths, blocks past
    ``ceil(ends / block_size)`` released (both spaces) and their table entries -1, hashes
    over rejected tokens forgotten. Returns the full-space blocks released."""
    requests, bs = ctx._requests, ctx.block_size_tokens
    keep = -(-ends // bs)
    drop = requests.num_blocks[rows] - keep
    released = 0
    if drop.any():
        which, cols = ragged_columns(keep, drop)
        table = requests.request_to_kv_block_ids
        # Blocks allocated by this step, never registered: ref count 1, back to the free stack.
        ctx.kv_block_allocator.release_memory_blocks(table[rows[which], cols])
        table[rows[which], cols] = -1
        released = len(cols)
    requests.num_blocks[rows] = keep
    requests.lengths[rows] = ends
    window = ctx.window_blocks
    if window is not None:
        drop = window.count[rows] - keep
        if drop.any():
            which, cols = ragged_columns(keep, drop)
            window.allocator.release_memory_blocks(window.table[rows[which], cols])
            window.table[rows[which], cols] = -1
        window.count[rows] = keep
    if requests.hashing:
        over = requests.hashed[rows] > ends // bs
        if over.any():
            _rewind_hashes(requests, rows[over], ends[over] // bs)
    return released


def _rewind_hashes(requests, rows: np.ndarray, upto: np.ndarray) -> None:
    """Forget the hashes of blocks ``>= upto[i]`` of ``rows`` (hashed early, by a query over
    the scheduled blocks): the chain's last digest is recomputed from the kept blocks (a
    rare path, linear in the row's length) and a keyed tail block waits for its key again."""
    bs = requests.block_size
    for row, h in zip(rows.tolist(), upto.tolist()):
        root = np.frombuffer(chain_root(requests.salts[row]), np.uint8)
        keys = requests.keys[row]
        digest = root
        if h:
            _, digests = chain_block_hashes(
                root[None], requests.tokens[row, :h * bs].reshape(h, bs), np.array([h]),
                {k: v for k, v in keys.items() if k < h} or None)
            digest = digests[-1]
        requests.digests[row] = digest
        requests.hashed[row] = h
        waiting = sorted(c for c in keys if c >= h)
        if waiting and requests.pending_key_cols[row] < 0:
            requests.pending_key_cols[row] = waiting[0]
            requests._pending_keys += 1


def _plan_kept_snapshots(ctx, draft_states, rows, starts, ends, kept, cut, stream) -> None:
    """Plan the Mamba snapshots of the kept ranges ``[starts, ends)`` as an extension by the
    kept tokens would (rows with everything kept, not ``cut``, have that plan already) and
    copy every planned state from the draft buffers into the scratch."""
    mamba = ctx.mamba_slot_allocator
    if cut.any():
        mamba._clear_intermediate_state(rows[cut])   # the plan of the whole written range
        again = cut & (kept > 0)
        if again.any():
            ctx._scheduler._plan_snapshots(rows[again], starts[again], ends[again],
                                           kept[again], None)
    targets = mamba.intermediate_targets()
    if not targets:
        return
    t_rows, offsets, scratch = (np.array(c, np.int64) for c in zip(*targets))
    slots = ctx._requests.request_to_mamba_state_idx[t_rows]
    # The state after ``offset`` tokens of the step is the one after written token offset - 1.
    draft_states._copy_to_scratch(slots, offsets - 1, scratch, stream)
