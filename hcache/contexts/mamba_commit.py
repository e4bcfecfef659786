"""The boundary commit of a step: which of its Mamba boundary states become cached states
(:meth:`MambaSlotAllocator.commit_intermediate_states`, docs/design.md §6).

A step leaves scratch entries (states the model emitted mid-prefill) and EOS entries (live
states of chunks that ended on a block boundary). The commit keeps, in entry order (scratch
entries in ascending row order, then EOS entries in ascending row order):

- the entries whose KV block is registered (hash > 0) and not cached under its hash already, or
  whose registration the context deferred (their states await it, :attr:`MambaHashMap.awaiting`);
  a repeated block keeps its first entry;
- short of slots (free plus LRU-evictable ones outside the entries), owners and then the first
  new blocks that fit; a deferring context's backlog blocks that will stay private give their
  awaiting slots up first.

:func:`commit_general` states the rule with NumPy over any number of entries and is the oracle.
:func:`commit_lean` is the same rule in plain Python for the few entries of a serving step
(decode EOS entries, an admission's scratch entries), where a NumPy call on a tiny array costs
more to make than to run; it declines (returns None, nothing changed) whenever a case it does
not handle could arise: many entries, a repeated block, a deferred block, or a shortage while
some state awaits its hash.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

__all__ = ["LEAN_MAX_ENTRIES", "commit_general", "commit_lean"]

# Entries above which plain Python loses to NumPy's per-call cost.
LEAN_MAX_ENTRIES = 64


def commit_general(m, stream) -> int:
    """The commit of allocator ``m`` (``stream`` checked) with NumPy, for any entries; returns
    the states made reachable."""
    data = m._collect_commit_data()
    if data is None:
        m._clear_intermediate_state()
        return 0
    inter, src, eos, eos_rows, hashes = data
    bids = np.concatenate([inter, eos]) if len(inter) else eos
    deferred = m.deferred_blocks
    waiting = np.zeros(len(bids), bool) if deferred is None else deferred[bids]
    if not len(inter) and np.count_nonzero(waiting) == len(bids):   # a decode step's, queued
        idx = np.arange(len(bids))
    else:
        idx = (((hashes > 0) & ~m._hashes.cached(bids, hashes)) | waiting).nonzero()[0]
        if len(idx) > 1:       # a repeated block keeps its first entry
            idx = idx[m._pool.first_occurrences(bids[idx])]
    refs, stamps, pool = m._kv.block_ref_counts, m._timestamps(), m._pool
    short = pool.shortfall(bids[idx], refs, stamps, distinct=True)
    if short[1] is not None and np.count_nonzero(waiting) + m._hashes.has_awaiting():
        private = m.private_deferred()   # duplicates: registering at once keeps none
        if len(private):
            pool.release(m._hashes.forget_awaiting(private))
            idx = idx[~np.isin(bids[idx], private)]
            short = pool.shortfall(bids[idx], refs, stamps, distinct=True)
    new, available = short[0], m.free_count + len(() if short[1] is None else short[1])
    if len(new) > available:    # keep owners and the first `available` new (distinct) blocks
        owned = m.block_to_slot[bids[idx]] >= 0
        idx = idx[owned | (np.cumsum(~owned) <= available)]
    ids = bids[idx]     # the blocks left out own no slot: the candidates stand
    slots, victims = pool.allocate(ids, refs, stamps, distinct=True, shortfall=short)
    m._hashes.drop_blocks(victims, m._kv.block_hashes)
    is_inter = idx < len(inter)
    if inters := np.count_nonzero(is_inter):
        m._copies.scratch_to_cache_unchecked(src[idx[is_inter]], slots[is_inter], stream)
    if inters < len(idx):      # checked by construction: owned distinct slots, live rows
        m._copies.store_live_unchecked(slots[~is_inter], eos_rows[idx[~is_inter] - len(inter)],
                                       stream)
    # Registered unchecked: the hashes are these blocks' own KV hashes, just read.
    waiting = waiting[idx]
    m._hashes.mark_awaiting(ids[waiting])
    m.hash_to_block_id.update(zip(hashes[idx[~waiting]].tolist(), ids[~waiting].tolist()))
    m._clear_intermediate_state()
    return int(len(idx) - np.count_nonzero(waiting))


def commit_lean(m, stream) -> int | None:
    """:func:`commit_general` of allocator ``m`` in plain Python, or None (nothing changed)
    when the step's entries fall outside the cases it handles (see the module docstring)."""
    inter = m._intermediate.entry_rows
    if not inter.pending:
        return 0        # nothing planned since the last commit: the tracking is clear
    entries = inter.entries(LEAN_MAX_ENTRIES)
    if entries is None:
        return None
    bids, eos_rows, num_inter = entries
    if not bids:
        inter.clear()
        return 0
    if m.deferred_blocks is not None and any(map(m.deferred_blocks.item, bids)):
        return None     # a deferred block: its state awaits its hash (general rule)
    kv, pool, mamba_map = m._kv, m._pool, m._hashes.hash_to_block_id
    hashes = list(map(kv.block_hashes.item, bids))
    if min(hashes) > 0 and mamba_map.keys().isdisjoint(hashes) and len(set(bids)) == len(bids):
        picked, kept = None, bids   # registered, uncached, distinct: all are kept
    else:
        picked = _kept(bids, hashes, mamba_map)
        kept = [bids[i] for i in picked]
    owned, free = pool.owned, pool.free_count
    new = [b for b in kept if not owned[b]]
    refs, stamps = kv.block_ref_counts, m._timestamps()
    if len(new) > free:
        if m._hashes.has_awaiting():
            return None     # a shortage may free the slots of private awaiting states first
        # every candidate is evicted below: the heap drops their entries now
        candidates = pool._evictable.take_oldest(len(new) - free, owned, refs, stamps, set(kept))
        available = free + len(candidates)
        if len(new) > available:   # keep owners and the first `available` new blocks
            picked = _owners_and_first(range(len(bids)) if picked is None else picked, bids,
                                       owned, available)
            new = new[:available]
        excluded, kept = kept, kept if picked is None else [bids[i] for i in picked]
    slots = pool.take_free(min(len(new), free))
    if len(new) > free:      # the oldest evictable blocks outside the kept ones
        taken, victims = pool.evict(len(new) - free, refs, stamps, exclude=excluded,
                                    candidates=candidates)
        slots += taken if type(taken) is list else taken.tolist()
        m._hashes.drop_blocks(victims, kv.block_hashes)
    pool.assign(new, slots, refs, stamps)
    if len(new) < len(kept):      # owners keep their slots
        slot_of, owner_slot = dict(zip(new, slots)), pool.block_to_slot.item
        slots = [slot_of[b] if b in slot_of else owner_slot(b) for b in kept]
    copies = m._copies
    if picked is None:      # the scratch entries come first
        if num_inter:
            copies.scratch_to_cache_unchecked(list(range(num_inter)), slots[:num_inter],
                                              stream)
        if num_inter < len(bids):
            copies.store_live_unchecked(slots[num_inter:], eos_rows, stream)
        mamba_map.update(zip(hashes, bids))
    else:
        k = bisect_left(picked, num_inter)
        if k:
            copies.scratch_to_cache_unchecked(picked[:k], slots[:k], stream)
        if k < len(picked):
            copies.store_live_unchecked(slots[k:], [eos_rows[i - num_inter] for i in picked[k:]],
                                        stream)
        mamba_map.update([(hashes[i], bids[i]) for i in picked])
    inter.clear()
    return len(kept)


def _kept(bids: list, hashes: list, mamba_map: dict) -> list:
    """Positions of the entries to keep: registered (hash > 0), not cached under their hash,
    each block's first."""
    picked, seen = [], set()
    for i, b, h in zip(range(len(bids)), bids, hashes):
        if h > 0 and mamba_map.get(h, -1) != b and b not in seen:
            seen.add(b)
            picked.append(i)
    return picked


def _owners_and_first(picked: list, bids: list, owned, room: int) -> list:
    """The ``picked`` positions whose block owns a slot, and the first ``room`` others."""
    kept = []
    for i in picked:
        if owned[bids[i]]:
            kept.append(i)
        elif room:
            kept.append(i)
            room -= 1
    return kept
