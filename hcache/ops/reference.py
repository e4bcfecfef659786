"""NumPy reference of every op: the ``cpu`` backend and the test oracle.

One function per op of :mod:`hcache.ops`, under the op's name, with the wrapper's parameters
minus the launch-only ones (``stream``, ``backend``: keyword-only at the end of every wrapper).
Each produces the same bytes and status counts as the kernel (the compaction plan word for word)
and works on the Python-level arrays of a :class:`~hcache.ops.tables.KVGroup` /
:class:`~hcache.ops.tables.SlotSet`. The wrappers check their arguments before calling it.

Families (``kernels/<family>.cu``, ``hcache/ops/<family>.py``): ``compact`` (compaction_plan,
kv_compact, slots_compact), ``kv_write`` (kv_write, kv_write_fp8; ``quantize_fp8`` is the
quantization alone), ``slot_copy``, ``kv_capture`` (kv_capture, kv_restore, kv_prefix_copy),
``lengths`` (lengths_add) and ``draft_accept`` (draft_accept, draft_lengths).
"""

from __future__ import annotations

import weakref

import numpy as np

from ._ref_kv_write import kv_write, kv_write_fp8, quantize_fp8
from .tables import CLEAR, PLAN_HEADER, TMP, plan_max_batch, plan_schedule

__all__ = ["compaction_plan", "kv_compact", "slots_compact", "kv_write", "kv_write_fp8",
           "quantize_fp8", "slot_copy", "kv_capture", "kv_restore", "kv_prefix_copy",
           "lengths_add", "draft_accept", "draft_lengths"]


def _bump(status, n: int = 1):
    if status is not None and n:
        status[0] += n


# --- compact: kernels/compact.cu ------------------------------------------------------------------

def compaction_plan(mapping, old_batch, new_batch, plan, *, lengths=None):
    """Turn ``mapping[old] = new | -1`` into an in-place move schedule, written into ``plan``.

    See ``kernels/compact.cu`` for the layout. ``plan[0]`` is 0 when the mapping is injective
    into ``[0, new_batch)``, 1 when it is not (``plan[3]`` = the first offending old index),
    2 when the batch sizes are out of range.
    """
    mb = plan_max_batch(plan)
    plan[1] = 0
    plan[2] = 0
    plan[3] = -1
    if mb < 0 or not 0 <= old_batch <= mb or not 0 <= new_batch <= mb:
        plan[0] = 2
        return
    m = np.asarray(mapping[:old_batch], dtype=np.int64)
    inv = np.full(mb, -1, dtype=np.int64)
    for old in range(old_batch):
        dst = int(m[old])
        if dst == -1:
            continue
        if dst < 0 or dst >= new_batch or inv[dst] != -1:
            plan[0] = 1
            plan[3] = old
            plan[PLAN_HEADER:PLAN_HEADER + mb] = inv[:mb]  # as far as the kernel got
            plan[PLAN_HEADER + mb:PLAN_HEADER + 2 * mb] = 0
            return
        inv[dst] = old
    done = np.zeros(mb, dtype=np.int64)
    sched: list[tuple[int, int]] = []
    lens = None if lengths is None else np.asarray(lengths)
    max_len = 0

    def note(src):
        nonlocal max_len
        if lens is not None and int(lens[src]) > max_len:
            max_len = int(lens[src])

    for end in range(mb):
        if inv[end] < 0 or inv[end] == end or (end < old_batch and m[end] != -1):
            continue
        cur = end
        while inv[cur] >= 0 and inv[cur] != cur and not done[cur]:
            src = int(inv[cur])
            sched.append((src, cur))
            done[cur] = 1
            note(src)
            cur = src
    for start in range(old_batch):
        dst = int(m[start])
        if dst < 0 or dst == start or done[dst]:
            continue
        sched.append((start, TMP))
        note(start)
        cur = start
        while inv[cur] != start:
            src = int(inv[cur])
            sched.append((src, cur))
            done[cur] = 1
            note(src)
            cur = src
        sched.append((TMP, cur))
        done[cur] = 1
    for j in range(new_batch):
        if inv[j] == -1:
            sched.append((CLEAR, j))
    plan[PLAN_HEADER:PLAN_HEADER + mb] = inv
    plan[PLAN_HEADER + mb:PLAN_HEADER + 2 * mb] = done
    start = PLAN_HEADER + 2 * mb
    if sched:
        plan[start:start + 2 * len(sched)] = np.asarray(sched, dtype=np.int32).reshape(-1)
    plan[1] = len(sched)
    plan[2] = max_len
    plan[0] = 0


def _clamp(x: int, cap: int) -> int:
    return min(max(int(x), 0), cap)


def kv_compact(group, plan, lengths):
    """Run the plan over every layer of ``group``: move the first ``lengths[src]`` tokens, but
    none at or past the plan's longest span ``plan[2]``; entries naming no slot are skipped."""
    if int(plan[0]) != 0:
        return
    sched = plan_schedule(plan)
    slots = group.num_slots
    for layer, cap in zip(group.layers, group.max_seq_lens):
        tok_axis = 3 if group.layout == "HND" else 2
        limit = _clamp(plan[2], cap)
        tmp, tmp_n = None, 0

        def span(slot, n, layer=layer, tok_axis=tok_axis):
            idx = [slot, slice(None), slice(None), slice(None)]
            idx[tok_axis] = slice(0, n)
            return tuple(idx)

        for src, dst in sched:
            if dst == TMP:
                if 0 <= src < slots:
                    tmp_n = min(_clamp(lengths[src], cap), limit)
                    tmp = layer[span(src, tmp_n)].copy()
            elif src == TMP:
                if 0 <= dst < slots and tmp_n:
                    layer[span(dst, tmp_n)] = tmp
            elif 0 <= src < slots and 0 <= dst < slots:
                n = min(_clamp(lengths[src], cap), limit)
                layer[span(dst, n)] = layer[span(src, n)]


def slots_compact(slots, plan):
    """Run the plan over whole slots of every tensor of ``slots`` (src is dst); holes are
    zeroed."""
    if int(plan[0]) != 0:
        return
    sched = plan_schedule(plan)
    for _, t in slots.pairs:
        n = t.shape[0]
        tmp = np.zeros_like(t[0]) if n else None   # the kernel's register chunk starts zeroed
        for src, dst in sched:
            if dst == TMP:
                if 0 <= src < n:
                    tmp = t[src].copy()
            elif not 0 <= dst < n:
                continue
            elif src == TMP:
                t[dst] = tmp
            elif src == CLEAR:
                t[dst] = 0
            elif 0 <= src < n:
                t[dst] = t[src]


# --- kv_write: kernels/kv_write.cu (hcache/ops/_ref_kv_write.py) -------------------------------

# --- slot_copy: kernels/slot_copy.cu --------------------------------------------------------------

def slot_copy(slots, src_idx, dst_idx, *, status=None):
    """``dst_t[dst_idx[i]] = src_t[src_idx[i]]`` for every tensor and pair; -1 skips, other
    out-of-range pairs are skipped (per tensor) and counted once each in ``status[0]``."""
    s = np.asarray(src_idx, dtype=np.int64)
    d = np.asarray(dst_idx, dtype=np.int64)
    # The common call has no padding and no negative index: bounds then need only the maxima
    # (of Python lists for a few pairs: NumPy's reductions cost more to call than to run).
    if not len(s):
        low, top = 0, (-1, -1)
    elif len(s) <= 64:
        src_list, dst_list = s.tolist(), d.tolist()
        low, top = min(min(src_list), min(dst_list)), (max(src_list), max(dst_list))
    else:
        low, top = min(s.min(), d.min()), (int(s.max()), int(d.max()))
    nonnegative = low >= 0
    records, fewest = _slot_records(slots)
    if len(s) == 1 and nonnegative:     # one pair (a restore): scalar indices, no masks
        i, j = top
        src0, dst0 = slots.pairs[0]
        _bump(status, int(i >= src0.shape[0] or j >= dst0.shape[0]))
        for src, dst in records:
            if i < src.shape[0] and j < dst.shape[0]:
                dst[j] = src[i]
        return
    if nonnegative and top[0] < fewest[0] and top[1] < fewest[1]:
        for src, dst in records:      # every pair in range of every tensor: copy all
            dst[d] = src[s]
        return
    rows: dict = {}   # (src slots, dst slots) -> (out-of-range count, rows to copy or None: all)

    def copied(num_src, num_dst):
        if (num_src, num_dst) not in rows:
            if nonnegative and top[0] < num_src and top[1] < num_dst:
                rows[num_src, num_dst] = (0, None)
            else:
                pad = (s == -1) | (d == -1)
                oob = ~pad & ((s < 0) | (s >= num_src) | (d < 0) | (d >= num_dst))
                good = ~(pad | oob)
                rows[num_src, num_dst] = (int(np.count_nonzero(oob)),
                                          None if good.all() else good)
        return rows[num_src, num_dst]

    src0, dst0 = slots.pairs[0]
    _bump(status, copied(src0.shape[0], dst0.shape[0])[0])
    for src, dst in records:
        good = copied(src.shape[0], dst.shape[0])[1]
        if good is None:
            dst[d] = src[s]
        elif good.any():
            dst[d[good]] = src[s[good]]


_records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _slot_records(slots) -> tuple:
    """The pairs of ``slots`` as 1-D arrays of one opaque record per slot (views, cached until
    the set is rebound): a gather of whole records costs one copy per slot, not one per
    element; and the fewest source and destination slots of any pair."""
    cached = _records.get(slots)
    if cached is None or cached[0] is not slots.pairs:
        def record(a):
            if a.ndim < 2 or a.size == 0:
                return a
            n = a.shape[0]
            return a.reshape(n, -1).view(np.dtype((np.void, a.nbytes // n))).reshape(n)
        cached = (slots.pairs, [(record(src), record(dst)) for src, dst in slots.pairs],
                  (min(len(src) for src, _ in slots.pairs),
                   min(len(dst) for _, dst in slots.pairs)))
        _records[slots] = cached
    return cached[1], cached[2]


# --- kv_capture: kernels/kv_capture.cu ------------------------------------------------------------

def kv_capture(group, slot, num_tokens, out):
    """Copy tokens ``[0, num_tokens)`` of ``slot`` of every layer into ``out[l]``
    (``[C, H_l, m_l, D]``, ``C = group.components``, ``m_l = group.held_tokens(l, num_tokens)``:
    a ring layer gives the last ``min(num_tokens, W)`` in order)."""
    kv_prefix_copy(group, slot, num_tokens, out, to_cache=False)


def kv_restore(group, saved, slot, *, num_tokens=None, more_slots=None):
    """Copy every ``saved[l]`` (``[C, H_l, m_l, D]``, as :func:`kv_capture` gives them for an
    ``n``-token prefix; ``n`` defaults to ``saved[0]``'s token count) back into ``slot`` and
    into every slot of ``more_slots`` (a slot out of range skipped)."""
    n = int(saved[0].shape[2]) if num_tokens is None and saved else int(num_tokens or 0)
    for target in [slot, *(() if more_slots is None else np.asarray(more_slots).tolist())]:
        kv_prefix_copy(group, int(target), n, saved, to_cache=True)


def kv_prefix_copy(group, slot, num_tokens, compact, *, to_cache, status=None):
    """Copy tokens ``[0, num_tokens)`` of ``slot`` of every layer to (``to_cache=False``) or from
    (``to_cache=True``) compact tensors ``[C, H_l, n, D]``; a layer with bad arguments is
    skipped and counted. ``num_tokens == 0`` does nothing (no launch on the device). A ring
    layer (window ``W``) copies the ``m = min(num_tokens, W)`` positions ``num_tokens - m ..
    num_tokens - 1`` it holds, from ring entries ``p mod W``, to compact tokens ``0..m-1``."""
    if num_tokens == 0:
        return
    for layer, saved, heads, cap, ring in zip(group.layers, compact, group.num_kv_heads,
                                              group.max_seq_lens, group.ring_windows):
        m = min(num_tokens, cap) if ring else num_tokens
        if not (0 <= slot < group.num_slots and 0 <= num_tokens and m <= cap
                and m <= saved.shape[2] and saved.shape[1] == heads):
            _bump(status)
            continue
        entries = slice(0, m) if not ring else (num_tokens - m + np.arange(m)) % cap
        if to_cache:
            layer[slot][:, :, entries] = saved[:, :, :m]
        else:
            saved[:, :, :m] = layer[slot][:, :, entries]


# --- lengths: kernels/lengths.cu ------------------------------------------------------------------

def lengths_add(lengths, n, increment, max_len, *, status=None):
    """``lengths[:n] += increment`` (int or int32 array ``[n]``), all or nothing: refused (and
    counted in ``status``) if any increment is negative or any result would pass ``max_len``."""
    if isinstance(increment, (int, np.integer)):
        # The decode step: one increment for all, checked against the longest length.
        if n and (increment < 0 or int(lengths[:n].max()) + int(increment) > max_len):
            _bump(status)
            return
        lengths[:n] += increment
        return
    cur = np.asarray(lengths[:n], dtype=np.int64)
    inc = np.asarray(increment, dtype=np.int64)
    add = inc[:n] if inc.ndim else np.full(n, inc)
    nxt = cur + add
    if n and ((add < 0).any() or (nxt > max_len).any()):
        _bump(status)
        return
    lengths[:n] = nxt.astype(lengths.dtype)


# --- draft_accept: kernels/draft_accept.cu --------------------------------------------------------

def _draft_rows(accepted, row_to_slot, num_rows, bonus, cap, num_slots, lengths, max_len):
    """Per row ``(slot, kept, bad)`` as the kernels' ``hc_draft_row`` decides them: padding
    rows (slot -1) have kept 0 and are not bad; a bad row commits nothing."""
    acc = np.asarray(accepted[:num_rows], dtype=np.int64)
    slot = (np.arange(num_rows, dtype=np.int64) if row_to_slot is None
            else np.asarray(row_to_slot[:num_rows], dtype=np.int64))
    kept = acc + bonus
    pad = slot == -1
    bad = ~pad & ((slot < 0) | (slot >= num_slots) | (acc < 0) | (kept > cap))
    if lengths is not None:
        ok = ~pad & ~bad
        bad[ok] |= np.asarray(lengths, dtype=np.int64)[slot[ok]] + kept[ok] > max_len
    kept[pad | bad] = 0
    return slot, kept, bad


def draft_accept(slots, draft_len, accepted, num_rows, written, *, row_to_slot=None, bonus=0,
                 lengths=None, max_len=2**31 - 1, status=None):
    """``live[s] = draft[s * draft_len + kept - 1]`` for every row in range with ``kept =
    accepted + bonus >= 1``, for every ``(draft, live)`` pair of ``slots``; rows out of range
    are skipped and counted once each (on the first pair's slot counts)."""
    rows: dict = {}   # (draft slots, live slots) -> (bad count, source rows, live rows)
    for j, (draft, live) in enumerate(slots.pairs):
        key = (draft.shape[0], live.shape[0])
        if key not in rows:
            slot, kept, bad = _draft_rows(accepted, row_to_slot, num_rows, bonus,
                                          min(written, draft_len), live.shape[0], lengths,
                                          max_len)
            src = slot * draft_len + kept - 1
            bad |= (kept > 0) & (src >= draft.shape[0])
            go = (kept > 0) & ~bad
            rows[key] = (int(np.count_nonzero(bad)), src[go], slot[go])
        bad, src, dst = rows[key]
        if j == 0:
            _bump(status, bad)
        if len(dst):
            live[dst] = draft[src]


def draft_lengths(lengths, accepted, num_rows, written, max_len, *, row_to_slot=None, bonus=0,
                  status=None):
    """``lengths[s] += accepted + bonus`` for every row in range; rows out of range are
    skipped and counted once each."""
    slot, kept, bad = _draft_rows(accepted, row_to_slot, num_rows, bonus, written,
                                  lengths.shape[0], lengths, max_len)
    _bump(status, int(np.count_nonzero(bad)))
    go = kept > 0
    if go.any():
        lengths[slot[go]] += kept[go].astype(lengths.dtype)
