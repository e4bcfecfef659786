"""The decode-step fast paths of issue 11 (commits a0ba42e, bca9203) change cost, not behaviour.

Oracles: the plain forms the fast paths replaced, kept here as small functions (``np.lexsort``
LRU victims, ``np.isin`` exclusion, a hash lookup for every parent, the settle and drop checks
the map's invariants were argued to make redundant); per-row models of the boundary-state
tracking and of a commit short of slots (owners, then the first new blocks that fit); a
pair-by-pair model of ``slot_copy``; ``compute_block_hashes`` of whole sequences; and a context
whose pool, hash map, backlog analysis and forest run those plain forms, driven side by side
with an unchanged one through admissions, decode steps, extensions, commits and releases under
KV and Mamba-slot pressure (every outcome and every piece of state equal after every operation).
"""

from __future__ import annotations

import copy
from types import MethodType

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import example, given, settings
from test_dynamic_context import make_ctx

from hcache.contexts import compute_block_hashes
from hcache.contexts import mamba_intermediate as mi
from hcache.contexts.backlog_duplicates import backlog_blocks, entangled_rows
from hcache.contexts.block_forest import BlockForest
from hcache.contexts.block_registration import ENTANGLED_ROWS
from hcache.contexts.kv_block_allocator import KVBlockAllocator
from hcache.contexts.mamba_slot_pool import MambaSlotCapacityError, MambaSlotPool, _oldest
from hcache.contexts.token_batches import batch_tokens
from hcache.ops import reference
from hcache.ops.tables import SlotSet

# --- the code before the fast paths ------------------------------------------------------------


def lexsort_oldest(candidates, timestamps, n):
    stamps = (np.zeros(len(candidates), dtype=np.int64) if timestamps is None
              else np.asarray(timestamps)[candidates])
    return np.lexsort((candidates, stamps))[:n]


def before_evictable_blocks(self, ref_counts, exclude=None):
    owned = self.slot_to_block[self.slot_to_block >= 0].astype(np.int64)
    candidates = owned[np.asarray(ref_counts)[owned] == 0]
    if exclude is not None and len(exclude):
        candidates = candidates[~np.isin(candidates, exclude)]
    return candidates


def before_evict(self, n, ref_counts, timestamps, *, exclude=None, candidates=None):
    candidates = self.evictable_blocks(ref_counts, exclude)     # the scan, never reused
    if len(candidates) < n:
        raise MambaSlotCapacityError(n, len(candidates))
    victims = candidates[lexsort_oldest(candidates, timestamps, n)]
    slots = self.block_to_slot[victims].copy()
    self.block_to_slot[victims] = -1
    self.slot_to_block[slots] = -1
    self._owned[victims] = False
    return slots, victims


def before_settle(self, block_ids, hashes, kv_block_hashes, block_to_slot):
    waiting = self.awaiting[block_ids]
    if not waiting.any():
        return np.zeros(0, np.int64), 0
    blocks, hs = block_ids[waiting], hashes[waiting]
    self.awaiting[blocks] = False
    owned = block_to_slot[blocks] >= 0
    ok = owned & (kv_block_hashes[blocks] == hs)
    listed = hs.tolist()
    ok &= ~np.fromiter(map(self.hash_to_block_id.__contains__, listed), bool, len(hs))
    self.hash_to_block_id.update(zip(hs[ok].tolist(), blocks[ok].tolist()))
    return blocks[owned & ~ok], int(np.count_nonzero(ok))


def before_drop_blocks(self, block_ids, kv_block_hashes):
    m = self.hash_to_block_id
    for b, h in zip(block_ids.tolist(), kv_block_hashes[block_ids].tolist(), strict=True):
        if m.get(h) == b:
            del m[h]


def before_backlog(self):
    entangled = entangled_rows(self.requests, self.kv, bool(self._dropped), ENTANGLED_ROWS)
    return backlog_blocks(self._queue, self.requests, self.kv.kv_hash_to_block_id,
                          self._dropped, entangled)


def before_link(self, block_ids, hashes, parent_hashes, likely_parents=None):
    BlockForest.link(self, block_ids, hashes, parent_hashes)      # every parent by its hash


def as_before(ctx):
    """``ctx`` with every changed component running the code before the fast paths."""
    m, kv, reg = ctx.mamba_slot_allocator, ctx.kv_block_allocator, ctx._registration
    patches = [(m._pool, "evictable_blocks", before_evictable_blocks),
               (m._pool, "evict", before_evict),
               (m._hashes, "settle", before_settle),
               (m._hashes, "drop_blocks", before_drop_blocks),
               (reg, "_backlog", before_backlog),
               (kv._forest, "link", before_link)]
    for obj, name, fn in patches:
        assert callable(getattr(obj, name))
        setattr(obj, name, MethodType(fn, obj))
    return ctx


# --- the whole context, side by side with one running the code before -----------------------

STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5], [1, 2, 3, 4, 7, 7, 7], [5, 5]]


def snapshot(ctx):
    """Everything the changed code reads or writes (read only: no catching up)."""
    kv, m, t = ctx.kv_block_allocator, ctx.mamba_slot_allocator, ctx._requests
    f, pool, inter = kv._forest, m._pool, m._intermediate
    arrays = [kv.free_block_ids, f.hashes, f.parent_ids, f.parent_hashes, f.child_counts,
              kv.block_ref_counts, kv.block_timestamps, t.request_to_kv_block_ids, t.hashes,
              t.digests, t.lengths, t.computed, t.registered, t.hashed, pool.block_to_slot,
              pool.slot_to_block, pool.free_slots[:pool.free_count], np.frombuffer(pool.owned,
              np.uint8), m._hashes.awaiting, inter.counts, inter.block_ids, inter.eos_block_ids]
    states = [a.tobytes() for a in (m.conv_states, m.ssm_states) if a is not None]
    return ([a.tolist() for a in arrays], states,
            sorted(f.hash_to_block.items()), sorted(m.hash_to_block_id.items()),
            inter.pending, ctx._registration.queued, list(ctx.request_ids), vars(ctx.stats))


def write_random_states(ctx, rng_seed) -> None:
    """The forward pass: random live and scratch Mamba states (the same for twins given the
    same ``rng_seed``)."""
    rng = np.random.default_rng(rng_seed)
    m = ctx.mamba_slot_allocator
    for a in (ctx.mamba_conv_states, ctx.mamba_ssm_states, m.intermediate_conv_out,
              m.intermediate_ssm_out):
        if a is not None:
            a[...] = rng.standard_normal(a.shape).astype(a.dtype)


def outcome(f):
    try:
        return f()
    except Exception as e:  # noqa: BLE001 - the refusals must be the same too
        return type(e).__name__, str(e)


def plan_tuple(p):
    return (p.starts.tolist(), p.ends.tolist(), p.rows.tolist(), p.tokens.tolist())


def ready_ids(ctx) -> list:
    """The requests of ``ctx`` without a scheduled step (those a step may extend)."""
    t = ctx._requests
    return [r for r in ctx.request_ids if t.pending_end[t.row(r)] < 0]


def random_prompt(rng, stems=STEMS) -> list:
    """A prompt: a random head of one of ``stems``, then up to 3 random tokens."""
    stem = stems[int(rng.integers(len(stems)))]
    return stem[:int(rng.integers(1, len(stem) + 1))] + \
        rng.integers(0, 3, int(rng.integers(0, 4))).tolist()


def random_extension(rng, ready, chunked_one_in=4, longest=3) -> tuple:
    """Some of ``ready`` (all of them two times in three) and their tokens: one each, or one
    time in ``chunked_one_in`` 1..``longest`` each."""
    ids = ready if rng.integers(3) else ready[:int(rng.integers(1, len(ready) + 1))]
    toks = rng.integers(0, 3, len(ids)) if rng.integers(chunked_one_in) else \
        [rng.integers(0, 3, int(rng.integers(1, longest + 1))).tolist() for _ in ids]
    return ids, toks


def random_release(rng, live) -> list:
    """Up to two of ``live``, each drawn with chance 1/3 (the first when none is)."""
    return [r for r in live if rng.integers(3) == 0][:2] or live[:1]


def twin_contexts(rng, before=lambda ctx: ctx):
    """Two contexts of one random small shape under KV-block and Mamba-slot pressure, the
    second passed through ``before``."""
    bs = int(rng.choice([1, 2, 3]))
    kw = dict(bs=bs, mamba=1, slots=int(rng.integers(2, 7)), rows=int(rng.integers(3, 7)),
              max_blocks=24 // bs, registration_budget=[None, 1, 2][int(rng.integers(3))])
    blocks = int(rng.integers(14, 40))
    return make_ctx(blocks, **kw), before(make_ctx(blocks, **kw))


def twin_steps(rng, new, both, steps) -> None:
    """``steps`` random operations on ``new``'s requests (admissions, decode and chunked
    extensions with their commits, commits, releases, catch-ups), each done through
    ``both(fn)``, which applies ``fn`` to ``new`` and its twin."""
    next_id = 0
    for step in range(steps):
        op = rng.integers(10)
        ready = ready_ids(new)
        if op < 2 or not new.request_ids:
            tokens = random_prompt(rng)
            rid, next_id = next_id, next_id + 1
            both(lambda c, r=rid, t=tokens: c.add_request(r, t).row)
        elif op < 7 and ready:
            ids, toks = random_extension(rng, ready)
            both(lambda c, i=ids, t=toks: plan_tuple(c.extend_requests(i, t)))
            both(lambda c, k=step: write_random_states(c, k) or c.commit_step())
        elif op < 8:
            both(lambda c, k=step: write_random_states(c, k) or c.commit_step())
        elif op < 9:
            gone = random_release(rng, new.request_ids)
            both(lambda c, g=gone: c.release_requests(g))
        else:
            both(lambda c: c.register_completed_blocks())


def drive_twins(seed, steps):
    rng = np.random.default_rng(seed)
    new, old = twin_contexts(rng, as_before)

    def both(f):
        got = [outcome(lambda c=c: f(c)) for c in (new, old)]
        assert got[0] == got[1]
        assert snapshot(new) == snapshot(old)
        return got[0]

    twin_steps(rng, new, both, steps)
    for c in (new, old):
        c.check_invariants()
    return new


@settings(max_examples=25)
@given(st.integers(0, 2**32 - 1))
def test_context_equals_the_context_before_the_fast_paths(seed):
    """Admissions with shared stems, decode steps (one int64 token each, or a few), commits,
    releases and catch-ups under KV-block and Mamba-slot pressure: every outcome and every
    piece of changed state equals that of a context running the code before."""
    drive_twins(seed, 60)


def test_the_twin_workload_reaches_the_changed_paths():
    """The side-by-side runs do reach what changed (else they would prove little): LRU slot
    eviction, a slot shortage at commit, KV deregistration, decode registration with guessed
    parents, settling awaiting states, dropping victims from a non-empty map, EOS-only
    collects and a backlog analysis with entangled rows."""
    from hcache.contexts.block_registration import BlockRegistration
    from hcache.contexts.mamba_hash_map import MambaHashMap
    seen = dict.fromkeys(["evict", "shortage", "deregistered", "guessed", "settled",
                          "dropped", "eos only", "entangled"], 0)
    shortfall = MambaSlotPool.shortfall

    def counting(cls, name, key, when):
        fn = getattr(cls, name)

        def wrapper(self, *a, **k):
            seen[key] += bool(when(self, *a, **k))
            return fn(self, *a, **k)
        return wrapper

    counters = [
        (MambaSlotPool, "evict", "evict", lambda self, n, *a, **k: n > 0),
        (MambaSlotPool, "shortfall", "shortage",      # (shortfall reads only)
         lambda self, *a, **k: (lambda new, candidates: candidates is not None and len(new) >
                                self.free_count + len(candidates))(*shortfall(self, *a, **k))),
        (KVBlockAllocator, "_deregister", "deregistered", lambda self, ids: len(ids)),
        (BlockForest, "link", "guessed",
         lambda self, b, h, p, lp=None: lp is not None and (p > 0).any()),
        (MambaHashMap, "settle", "settled", lambda self, b, *a: self.awaiting[b].any()),
        (MambaHashMap, "drop_blocks", "dropped",
         lambda self, b, kvh: len(b) and self.hash_to_block_id),
        (mi.IntermediateStates, "collect", "eos only",
         lambda self, h: self.pending and not self.counts.any()),
        (BlockRegistration, "_backlog", "entangled",
         lambda self: entangled_rows(self.requests, self.kv, bool(self._dropped),
                                     ENTANGLED_ROWS).any()),
    ]
    with pytest.MonkeyPatch.context() as m:
        for cls, name, key, when in counters:
            m.setattr(cls, name, counting(cls, name, key, when))
        for seed in range(4):
            drive_twins(seed, 60)
    assert all(seen.values()), seen


# --- Mamba slot pool: LRU victims, exclusion, release -----------------------------------------

@st.composite
def lru_cases(draw):
    num_blocks = draw(st.sampled_from([1, 2, 5, 16, 40, 300]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    candidates = rng.permutation(num_blocks)[:draw(st.integers(0, num_blocks))]
    kind = draw(st.sampled_from(["none", "ties", "wide", "huge", "negative"]))
    lo, hi = {"none": (0, 1), "ties": (0, 3), "wide": (0, 10**6),
              "huge": (2**62, 2**63 - 1), "negative": (-5, 5)}[kind]
    stamps = None if kind == "none" else rng.integers(lo, hi, num_blocks, dtype=np.int64)
    n = draw(st.sampled_from([0, 1, 2, len(candidates) // 3, len(candidates) // 2,
                              len(candidates) - 1, len(candidates)]))
    return candidates.astype(np.int64), stamps, min(max(n, 0), len(candidates)), num_blocks


def test_oldest_of_many_candidates_in_order():
    """Hundreds of candidates, few victims (the partial selection, then a sort of those):
    the lexsort order, ties included."""
    rng = np.random.default_rng(11)
    for nb, spread in ((300, 4), (1000, 10**6), (64, 1)):
        cands = rng.permutation(nb)[:nb - 7].astype(np.int64)
        stamps = rng.integers(0, spread, nb)
        for n in (1, 2, 5, 40, len(cands) // 2 - 1, len(cands) // 2 + 1, len(cands)):
            assert _oldest(cands, stamps, n, nb).tolist() == \
                lexsort_oldest(cands, stamps, n).tolist()


@given(lru_cases())
def test_oldest_equals_lexsort_by_stamp_then_block(case):
    """``_oldest`` picks the same positions in the same order as ``np.lexsort((candidates,
    stamps))[:n]``: ties by block id, timestamps None, n == 0 and n == all, stamps near
    2**63 and negative ones (its fallback)."""
    candidates, stamps, n, num_blocks = case
    got = _oldest(candidates, stamps, n, num_blocks)
    assert got.tolist() == lexsort_oldest(candidates, stamps, n).tolist()


def test_oldest_at_the_edge_of_its_single_key():
    """Stamps just below and at the largest value whose key ``stamp * num_blocks + block``
    fits int64: both give the lexsort order (the key path and the fallback)."""
    nb = 7
    edge = np.iinfo(np.int64).max // nb - 1
    for top in (edge - 1, edge, edge + 1):
        stamps = np.array([top, top, 0, top - 1, 3, top, 0], np.int64)
        cands = np.array([5, 0, 6, 1, 3, 2], np.int64)
        for n in range(len(cands) + 1):
            assert _oldest(cands, stamps, n, nb).tolist() == \
                lexsort_oldest(cands, stamps, n).tolist()


@st.composite
def pools(draw):
    num_blocks = draw(st.integers(1, 24))
    max_slots = draw(st.integers(1, 12))
    owners = draw(st.permutations(range(num_blocks)))[:min(max_slots, num_blocks)]
    owners = owners[:draw(st.integers(0, len(owners)))]
    refs = np.array(draw(st.lists(st.integers(0, 2), min_size=num_blocks,
                                  max_size=num_blocks)), np.int32)
    stamps = np.array(draw(st.lists(st.integers(0, 3), min_size=num_blocks,
                                    max_size=num_blocks)), np.int64) if draw(st.booleans()) \
        else None    # None: a KV allocator without timestamps (all 0)
    exclude = np.array(draw(st.lists(st.integers(0, num_blocks - 1), max_size=6)), np.int64)
    pool = MambaSlotPool(num_blocks, max_slots)
    owners = np.array(owners, np.int64)
    pool.allocate(owners, np.ones(num_blocks, np.int32), stamps, distinct=True)
    # As the KV allocator reports them: the owners whose ref count then dropped to 0.
    pool.released(owners[refs[owners] == 0], stamps)
    assert pool.broken_invariants(refs, stamps) == []
    return pool, refs, stamps, exclude


def pool_state(pool):
    return (pool.block_to_slot.tolist(), pool.slot_to_block.tolist(),
            pool.free_slots[:pool.free_count].tolist(), bytes(pool.owned))


@given(pools(), st.data())
def test_pool_evicts_and_excludes_as_before(case, data):
    """On random pools (ref counts, timestamps with ties, an ``exclude`` list with repeats):
    the evictable blocks, the victims and their order, the slots taken and the final state
    equal the code before (``np.isin``, ``np.lexsort``); the exclusion scratch is left clear; a
    shortage raises the same error and changes nothing."""
    pool, refs, stamps, exclude = case
    twin = copy.deepcopy(pool)
    want = before_evictable_blocks(twin, refs, exclude)
    assert pool.evictable_blocks(refs, exclude).tolist() == want.tolist()
    assert not pool._excluded.any()
    assert pool.evictable_blocks(refs).tolist() == before_evictable_blocks(twin, refs).tolist()
    n = data.draw(st.integers(0, len(want) + 1))
    got = outcome(lambda: tuple(a.tolist() for a in pool.evict(n, refs, stamps,
                                                                exclude=exclude)))
    expected = outcome(lambda: tuple(a.tolist() for a in before_evict(twin, n, refs, stamps,
                                                                          exclude=exclude)))
    assert got == expected
    assert pool_state(pool) == pool_state(twin)
    assert not pool._excluded.any()     # (the taken slots are the caller's: off both stacks)
    assert np.array_equal(pool._owned, pool.block_to_slot >= 0)


@given(pools(), st.data())
def test_pool_release_and_allocate_keep_the_owned_flags(case, data):
    """Releasing (an empty array, blocks without a slot, owners) and allocating under a
    shortage (evicting LRU owners, or refusing with nothing changed) keep the ``owned`` flags
    a mirror of ``block_to_slot`` and give the states the code before gives."""
    pool, refs, stamps, _ = case
    nb = len(pool.block_to_slot)
    twin = copy.deepcopy(pool)
    gone = np.array(data.draw(st.lists(st.integers(0, nb - 1), unique=True, max_size=4)),
                    np.int64)
    had = {int(b): int(pool.block_to_slot[b]) for b in gone if pool.block_to_slot[b] >= 0}
    kept = {int(b): int(pool.block_to_slot[b]) for b in np.flatnonzero(pool.block_to_slot >= 0)
            if b not in had}
    free = pool.free_slots[:pool.free_count].tolist()
    pool.release(np.zeros(0, np.int64))
    assert pool_state(pool) == pool_state(twin)
    pool.release(gone)
    assert {int(b): int(pool.block_to_slot[b]) for b in np.flatnonzero(
        pool.block_to_slot >= 0)} == kept
    assert pool.free_slots[:pool.free_count].tolist() == free + [had[b] for b in gone.tolist()
                                                                 if b in had]
    assert pool.broken_invariants() == []
    twin = copy.deepcopy(pool)
    ids = np.array(data.draw(st.lists(st.integers(0, nb - 1), unique=True, max_size=8)),
                   np.int64)
    twin.evict = MethodType(before_evict, twin)
    twin.evictable_blocks = MethodType(before_evictable_blocks, twin)
    got, expected = (outcome(lambda p=p: tuple(a.tolist() for a in p.allocate(
        ids, refs, stamps, distinct=True))) for p in (pool, twin))
    assert got == expected
    assert pool_state(pool) == pool_state(twin)
    assert pool.broken_invariants() == []
    assert np.array_equal(pool._owned, pool.block_to_slot >= 0)


def test_evictable_slot_heap_stays_bounded_when_nothing_is_evicted():
    """Blocks released and retained over and over with slots to spare (no eviction ever pops
    the heap): the stale entries are rebuilt away, so the heap stays within about twice the
    slots, and every evictable slot keeps a live entry."""
    from hcache.contexts.evictable_slots import _SLACK
    rng = np.random.default_rng(5)
    nb, slots = 64, 16
    pool = MambaSlotPool(nb, slots)
    refs, stamps = np.ones(nb, np.int32), np.zeros(nb, np.int64)
    owners = np.arange(slots, dtype=np.int64) * 3
    pool.allocate(owners, refs, stamps, distinct=True)
    for clock in range(1, 3000):
        b = owners[rng.integers(slots, size=4)]
        stamps[b], refs[b] = clock, 0          # retained at `clock`, then released
        pool.released(np.unique(b), stamps)
        assert len(pool._evictable._heap) <= 2 * slots + _SLACK + 4
    assert pool.broken_invariants(refs, stamps) == []
    want = before_evictable_blocks(pool, refs)
    got = pool.evict(len(want), refs, stamps)[1]
    assert got.tolist() == want[lexsort_oldest(want, stamps, len(want))].tolist()


def test_evict_lru_slots_batch_ignores_exclude_ids_out_of_range():
    """``_evict_lru_slots_batch(n, exclude=...)``: an id outside ``[0, num_blocks)`` (a -1 pad,
    a too-large id) excludes no block, and a tuple is a list of ids, as with ``np.isin``
    before; -1 must not exclude the last block."""
    from test_mamba_slot_allocator import make, registered_blocks
    for exclude, victim in (([-1], 15), ([-1, 10**6], 15), ((15, 3), 5), (np.array([-1, 3]), 15),
                            ([15], 3)):
        _, kv, alloc = make(num_blocks=16, max_slots=3)
        ids, _ = registered_blocks(kv, 16)
        kv.release_memory_blocks(ids)
        kv.advance_clock()
        kv.retain_memory_blocks([3, 5])         # the LRU block is the last one, 15
        kv.release_memory_blocks([3, 5])
        slots = dict(zip([15, 3, 5], alloc.allocate_slots_batch([15, 3, 5])))
        assert alloc._evict_lru_slots_batch(1, exclude=exclude) == [slots[victim]]
        assert alloc.get_slot(victim) == -1      # (the slot is the caller's now)


# --- block forest: link with guessed parents ----------------------------------------------------

def forest_state(f):
    return (f.hashes.tolist(), sorted(f.hash_to_block.items()), f.parent_ids.tolist(),
            f.parent_hashes.tolist(), f.child_counts.tolist())


@st.composite
def link_cases(draw):
    """A forest built by earlier batches and unlinks (blocks evicted and free for re-use),
    then a batch of unregistered blocks whose parent hashes are registered hashes, hashes
    earlier or later in the batch, unknown ones or 0, with guesses right and wrong."""
    nb = draw(st.integers(2, 20))
    f, next_hash = BlockForest(nb), 1
    for _ in range(draw(st.integers(0, 3))):
        free = np.flatnonzero(f.hashes == -1)
        ids = np.array(draw(st.permutations(free.tolist()))[:draw(st.integers(0, len(free)))],
                       np.int64)
        hs = np.arange(next_hash, next_hash + len(ids), dtype=np.int64)
        next_hash += len(ids) + 1
        known = [0, *f.hash_to_block.keys(), *hs.tolist()]
        ps = np.array([draw(st.sampled_from(known)) for _ in ids], np.int64)
        f.link(ids, hs, ps)
        held = np.flatnonzero(f.hashes != -1).tolist()
        gone = draw(st.lists(st.sampled_from(held), unique=True, max_size=3)) if held else []
        if gone:
            f.unlink(np.array(gone, np.int64))
    free = np.flatnonzero(f.hashes == -1)
    ids = np.array(draw(st.permutations(free.tolist()))[:draw(st.integers(0, len(free)))],
                   np.int64)
    hs = np.arange(next_hash + 5, next_hash + 5 + len(ids), dtype=np.int64)
    known = [0, next_hash + 1000, *f.hash_to_block.keys(), *hs.tolist()]
    # Often a chain: the previous entry's hash (a prompt's blocks, row after row).
    ps = np.array([draw(st.sampled_from(known + [int(hs[i - 1])] * 3 if i else known))
                   for i in range(len(ids))], np.int64)
    right = np.array([f.hash_to_block.get(p, -1) for p in ps.tolist()], np.int64)
    in_batch = dict(zip(hs.tolist(), ids.tolist()))     # earlier or later entries
    guesses = np.array([draw(st.sampled_from([int(r), -1, draw(st.integers(0, nb - 1)),
                                              int(ids[i]), int(ids[i - 1]) if i else -1,
                                              in_batch.get(int(ps[i]), -1)]))
                        for i, r in enumerate(right)], np.int64)
    return f, ids, hs, ps, guesses


@given(link_cases())
def test_link_with_guessed_parents_links_as_by_hash(case):
    """``link(..., likely_parents)``: right guesses, wrong ones (a private, free, unlinked or
    unrelated block, -1, the block itself, a later entry holding the parent hash), parents
    earlier in the batch (guessed as the previous entry, or not) and parent hash 0 give
    exactly the parent ids, parent hashes, child counts and map of a link by hash."""
    f, ids, hs, ps, guesses = case
    twin = copy.deepcopy(f)
    f.link(ids, hs, ps, guesses)
    twin.link(ids, hs, ps)
    assert forest_state(f) == forest_state(twin)
    assert f.broken_invariants() == []


def test_link_guess_of_minus_one_when_the_last_block_holds_the_parent_hash():
    """A guess of -1 (column 0's previous block, an unassigned entry) while the last block
    holds the parent hash: numpy reads ``hashes[-1]``, yet the link goes to that last block
    by the hash lookup, never to -1."""
    f = BlockForest(4)
    f.link(np.array([3]), np.array([7]), np.array([0]))
    twin = copy.deepcopy(f)
    args = np.array([0, 1]), np.array([8, 9]), np.array([7, 7])
    f.link(*args, np.array([-1, 2]))
    twin.link(*args)
    assert forest_state(f) == forest_state(twin)
    assert f.parent_ids[[0, 1]].tolist() == [3, 3] and f.child_counts[3] == 2


@st.composite
def unlink_cases(draw):
    """A forest of chains and branches (parents registered before their children), and a set
    of registered blocks to unlink: leaves and parents together, or parents whose children
    stay (orphans, dangling roots), of any size."""
    nb = draw(st.integers(1, 90))
    f = BlockForest(nb)
    order = draw(st.permutations(range(nb)))[:draw(st.integers(1, nb))]
    hashes = [0]
    for i, b in enumerate(order):
        parent = draw(st.sampled_from(hashes[: i + 1]))
        f.link(np.array([b]), np.array([i + 1]), np.array([parent]))
        hashes.append(i + 1)
    if draw(st.booleans()):     # an earlier unlink left dangling roots
        f.unlink(np.array([draw(st.sampled_from(order))], np.int64))
    held = np.flatnonzero(f.hashes != -1).tolist()
    gone = draw(st.lists(st.sampled_from(held), unique=True, min_size=1)) if held else []
    return f, np.array(gone, np.int64)


@pytest.mark.parametrize("scalar", [8, 200])
@given(case=unlink_cases())
def test_unlink_of_few_blocks_equals_the_vectorised_unlink(scalar, case):
    """``unlink`` works element by element up to ``_SCALAR`` ids: the same forest, hash set and
    parents left childless (sorted) as the NumPy path, orphans and dangling roots too."""
    from hcache.contexts import block_forest
    f, gone = case
    if not len(gone):
        return
    twin = copy.deepcopy(f)
    saved = block_forest._SCALAR
    try:
        block_forest._SCALAR = scalar
        few = f.unlink(gone.copy())
        block_forest._SCALAR = -1
        many = twin.unlink(gone.copy())
    finally:
        block_forest._SCALAR = saved
    assert few[0] == many[0]
    assert few[1].dtype == many[1].dtype and few[1].tolist() == many[1].tolist()
    assert forest_state(f) == forest_state(twin)
    assert (f.dangling.tolist(), f.num_dangling) == (twin.dangling.tolist(), twin.num_dangling)
    assert f.broken_invariants() == []


# --- reference slot_copy: the fast path when every index is in range --------------------------

@st.composite
def slot_copy_sets(draw):
    sizes = draw(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1,
                          max_size=3))
    top = max(max(s, d) for s, d in sizes)
    mode = draw(st.sampled_from(["in all", "padded", "in some", "edge", "any", "none"]))
    lo, hi = {"in some": (0, top - 1), "any": (-3, top + 2), "edge": (0, top)}.get(
        mode, (0, min(map(min, sizes)) - 1))
    dst = [] if mode == "none" else draw(     # distinct: each dst written once
        st.lists(st.integers(lo, hi), min_size=1, max_size=8, unique=True))
    src = draw(st.lists(st.integers(lo, hi), min_size=len(dst), max_size=len(dst)))
    if mode == "padded" and dst:        # else in range: -1 in one of the arrays only
        pad = draw(st.lists(st.integers(0, len(dst) - 1), min_size=1, unique=True))
        which = src if draw(st.booleans()) else dst
        for i in pad:
            which[i] = -1
    elif mode == "edge" and dst:        # a largest index equal to some pair's slot count
        (src if draw(st.booleans()) else dst)[0] = draw(st.sampled_from(
            sorted({x for pair in sizes for x in pair})))
        if len(set(dst)) < len(dst):
            dst = list(dict.fromkeys(dst))
            src = src[:len(dst)]
    return sizes, np.array(src, np.int32), np.array(dst, np.int32), draw(st.integers(0, 9))


@given(slot_copy_sets())
def test_reference_slot_copy_equals_a_pair_by_pair_model(case):
    """Pairs of different slot counts (an index in range for one pair and not another), -1
    padding, other negative and too-large indices, or all in range (the fast path): the
    reference copies what a pair-by-pair model copies and counts the first pair's
    out-of-range pairs, once each."""
    sizes, src_idx, dst_idx, seed = case
    rng = np.random.default_rng(seed)
    pairs = [(rng.integers(0, 99, (s, 2)).astype(np.float32),
              rng.integers(0, 99, (d, 2)).astype(np.float32)) for s, d in sizes]
    want = [d.copy() for _, d in pairs]
    bad = 0
    for s, d in zip(src_idx.tolist(), dst_idx.tolist()):
        if s == -1 or d == -1:
            continue
        for j, (src, _) in enumerate(pairs):
            if 0 <= s < src.shape[0] and 0 <= d < want[j].shape[0]:
                want[j][d] = src[s]
            elif j == 0:
                bad += 1
    status = np.array([5], np.int32)
    reference.slot_copy(SlotSet(pairs), src_idx, dst_idx, status=status)
    for (_, got), w in zip(pairs, want):
        np.testing.assert_array_equal(got, w)
    assert int(status[0]) == 5 + bad


@pytest.mark.parametrize("src_idx, dst_idx, copied, bad", [
    ([0, 1], [2, -1], [[9, 9, 0, 9], [9, 9, 0]], 0),       # padding in dst only
    ([-1, 1], [2, 0], [[1, 9, 9, 9], [1, 9, 9]], 0),       # padding in src only
    ([3, 0], [0, 1], [[3, 0, 9, 9], [9, 0, 9]], 0),        # 3 == the second pair's src count
    ([0, 1], [3, 0], [[1, 9, 9, 0], [1, 9, 9]], 0),        # 3 == the second pair's dst count
    ([4, 0], [0, 1], [[9, 0, 9, 9], [9, 0, 9]], 1),        # 4 == the first pair's src count
])
def test_reference_slot_copy_padding_and_slot_count_edges(src_idx, dst_idx, copied, bad):
    """Hand-computed: pair 0 is 4 -> 4 slots, pair 1 is 3 -> 3 slots; -1 in one index array
    skips the pair everywhere, an index equal to a pair's slot count skips it there."""
    pairs = [(np.arange(4.0), np.full(4, 9.0)), (np.arange(3.0), np.full(3, 9.0))]
    status = np.zeros(1, np.int32)
    reference.slot_copy(SlotSet(pairs), np.array(src_idx), np.array(dst_idx), status=status)
    assert [d.tolist() for _, d in pairs] == copied and int(status[0]) == bad


def test_reference_slot_copy_in_range_for_the_first_pair_only():
    """Index 4 fits the first pair (6 slots) but not the second (3): the second skips it."""
    a, b = np.zeros((6, 1)), np.zeros((6, 1))
    c, d = np.arange(3.0).reshape(3, 1), np.full((3, 1), 9.0)
    a[4] = 7
    status = np.zeros(1, np.int32)
    reference.slot_copy(SlotSet([(a, b), (c, d)]), np.array([4, 1]), np.array([0, 2]),
                        status=status)
    assert b[:, 0].tolist() == [7, 0, 0, 0, 0, 0] and d[:, 0].tolist() == [9, 9, 1]
    assert int(status[0]) == 0


# --- batch_tokens: a 1-D int64 array as it is --------------------------------------------------

@pytest.mark.parametrize("tokens", [np.array([3, 1, 2], np.int64), [3, 1, 2], (3, 1, 2),
                                    np.array([3, 1, 2], np.int32), np.array([3, 1, 2], ">i8"),
                                    np.array([3, 1, 2], np.uint64)])
def test_batch_tokens_one_each_whatever_the_form(tokens):
    flat, counts = batch_tokens("tokens", tokens, 3)
    assert counts is None and flat.dtype == np.int64 and flat.tolist() == [3, 1, 2]
    assert flat.dtype.byteorder in "=<|"


@pytest.mark.parametrize("n", [0, 2, 4])
@pytest.mark.parametrize("tokens", [np.array([3, 1, 2], np.int64), [3, 1, 2],
                                    np.array([3, 1, 2], np.int32)])
def test_batch_tokens_wrong_count_is_refused_alike(tokens, n):
    """Every form of 3 tokens for ``n != 3`` requests: the same ValueError and message."""
    with pytest.raises(ValueError) as e:
        batch_tokens("tokens", tokens, n)
    assert str(e.value) == f"tokens: expected {n} tokens (one per request), got 3"


def test_batch_tokens_other_arrays_are_still_checked():
    with pytest.raises(TypeError, match="tokens: expected a 1-D sequence of ints"):
        batch_tokens("tokens", np.array([1.0, 2.0]), 2)
    with pytest.raises(TypeError, match="tokens: expected a 1-D sequence of ints"):
        batch_tokens("tokens", np.array([True, False]), 2)
    with pytest.raises(TypeError, match="uint64 above"):
        batch_tokens("tokens", np.array([2**64 - 1, 1], np.uint64), 2)
    flat, counts = batch_tokens("tokens", np.array([[1, 2], [3, 4]], np.int64), 2)
    assert flat.tolist() == [1, 2, 3, 4] and counts.tolist() == [2, 2]
    with pytest.raises(ValueError, match=r"tokens: expected shape \[3, >= 1\]"):
        batch_tokens("tokens", np.zeros((2, 2), np.int64), 3)


# --- block hashes of many rows, gathered as whole rows of a block view ------------------------

@settings(max_examples=20)
@given(st.integers(1, 4), st.lists(st.lists(st.lists(st.integers(-2**63, 2**63 - 1),
                                                      min_size=1, max_size=9),
                                             min_size=1, max_size=4), min_size=2, max_size=5))
def test_hashes_of_many_rows_equal_hashes_of_their_whole_prefixes(bs, streams):
    """Several requests (rows other than 0, released and re-used rows) extended together by
    ragged chunks, so one hashing batch spans rows and several blocks per row: every row's
    hashes are compute_block_hashes of its whole sequence."""
    ctx = make_ctx(200, bs=bs, rows=4, max_blocks=40 // bs)
    ctx.add_request("gone", [1] * bs)               # its row is re-used: row order != id order
    ctx.commit_step()
    seqs = {}
    for i, s in enumerate(streams[:3]):
        seqs[i] = list(s[0])
        ctx.add_request(i, seqs[i])
    ctx.commit_step()
    ctx.release_requests(["gone"])
    for step in range(1, 4):
        ids = [i for i in seqs if step < len(streams[i]) and
               len(seqs[i]) + len(streams[i][step]) <= ctx.max_sequence_length]
        if not ids:
            break
        ctx.extend_requests(ids, [streams[i][step] for i in ids])
        for i in ids:
            seqs[i] += streams[i][step]
        ctx.commit_step()
    ctx.register_completed_blocks()
    t = ctx._requests
    for i, seq in seqs.items():
        want = compute_block_hashes(seq, bs)
        assert t.hashes[t.row(i), :len(want)].tolist() == want
    ctx.check_invariants()


def test_decode_hashes_of_rows_at_different_columns():
    """One-token decode steps over rows whose sequences differ in length (so each step's
    block boundary is a different column per row, hashed one block each): the hashes equal
    compute_block_hashes of the whole sequences."""
    ctx = make_ctx(200, bs=2, rows=4, max_blocks=12, registration_budget=1)
    seqs = {i: list(range(10 * i, 10 * i + 1 + i)) for i in range(4)}
    for i, s in seqs.items():
        ctx.add_request(i, s)
    ctx.commit_step()
    for step in range(9):
        toks = np.array([100 + step + i for i in seqs], np.int64)
        ctx.extend_requests(list(seqs), toks)
        for i, tok in zip(seqs, toks.tolist()):
            seqs[i].append(tok)
        ctx.commit_step()
    ctx.register_completed_blocks()
    t = ctx._requests
    for i, seq in seqs.items():
        want = compute_block_hashes(seq, 2)
        assert t.hashes[t.row(i), :len(want)].tolist() == want
        kv = ctx.kv_block_allocator
        assert kv.block_hashes[ctx.block_ids(i)[:len(want)]].tolist() == want


# --- Mamba commit under a slot shortage: owners, then the first new blocks that fit ----------

def kept_by_model(alloc, kv):
    """Entries (positions in the commit's scratch-then-EOS order) a commit keeps, by the rule
    it documents: registered, not cached under their hash, first of their block; then every
    block owning a slot, and new blocks in order while free plus evictable slots (owned by a
    block of ref count 0 outside the batch) last."""
    inter, src, eos, eos_rows, hashes = alloc._collect_commit_data()
    bids, hs = inter.tolist() + eos.tolist(), hashes.tolist()
    entries, seen = [], set()
    for i, (b, h) in enumerate(zip(bids, hs)):
        if h > 0 and alloc.hash_to_block_id.get(h) != b and b not in seen:
            seen.add(b)
            entries.append(i)
    owners = [int(b) for b in alloc.slot_to_block.tolist() if b >= 0]
    evictable = [b for b in owners if kv.block_ref_counts[b] == 0 and b not in bids]
    room, kept = alloc.free_count + len(evictable), []
    for i in entries:
        if alloc.block_to_slot[bids[i]] >= 0:
            kept.append(i)
        elif room:
            kept.append(i)
            room -= 1
    return kept, bids, hs, src.tolist(), eos_rows.tolist(), len(inter)


@settings(max_examples=30)
@given(st.lists(st.booleans(), min_size=8, max_size=8), st.integers(1, 4),
       st.lists(st.booleans(), min_size=3, max_size=3))
# Short of slots with some available: evictable ones only, then owners among the new blocks.
@example([False] * 8, 1, [True] * 3)
@example([False, False, False, True, False, True, False, False], 4, [True, False, False])
@example([False, True, False, False, False, False, True, False], 4, [True, True, True])
def test_commit_under_a_shortage_keeps_owners_then_the_first_new_blocks(owned, max_slots,
                                                                          freed):
    """Two rows' boundary states (scratch and EOS entries over 8 registered blocks, some
    already owning a slot outside the map, so owners come before and after new blocks), with
    fewer free or evictable slots than new blocks: the states kept, their contents and the
    count are those of the documented rule (:func:`kept_by_model`); the others own no slot."""
    from test_mamba_slot_allocator import _req, make, registered_blocks
    ctx, kv, alloc = make(bs=4, chunk=2, max_slots=max_slots, num_blocks=24)
    ids, _ = registered_blocks(kv, 8)
    others, _ = registered_blocks(kv, 3, salt=1)
    mine = [b for b, o in zip(ids, owned) if o][:max_slots]
    alloc.allocate_slots_batch(mine)
    room = max_slots - len(mine)
    alloc.allocate_slots_batch(others[:room])
    kv.release_memory_blocks([b for b, f in zip(others[:room], freed) if f])
    ctx.request_to_kv_block_ids[0, :4] = ids[:4]
    ctx.request_to_kv_block_ids[2, :4] = ids[4:]
    alloc.compute_and_store_offsets(_req(16), 0, 0, 16, 0, [], 4)
    alloc.compute_and_store_offsets(_req(16), 2, 0, 16, 0, [], 4)
    alloc.intermediate_ssm_out[...] = np.random.default_rng(3).random(
        alloc.intermediate_ssm_out.shape)
    scratch = alloc.intermediate_ssm_out.copy()       # as stored (the cache's dtype)
    kept, bids, hs, src, eos_rows, n_inter = kept_by_model(alloc, kv)
    assert alloc.commit_intermediate_states() == len(kept)
    assert dict(alloc.hash_to_block_id) == {hs[i]: bids[i] for i in kept}
    for i in kept:
        slot = int(alloc.block_to_slot[bids[i]])
        want = scratch[:, src[i]] if i < n_inter else \
            ctx.mamba_ssm_states[:, ctx.request_to_mamba_state_idx[eos_rows[i - n_inter]]]
        np.testing.assert_array_equal(alloc.ssm_states[:, slot], want)
    dropped = {bids[i] for i in range(len(bids))} - {bids[i] for i in kept} - set(mine)
    assert all(alloc.block_to_slot[b] < 0 for b in dropped)
    alloc.check_invariants()


# --- Mamba boundary-state tracking: collect and clear -----------------------------------------

def intermediate_twins(rng, rows=5):
    from hcache.device import Device
    made = [mi.IntermediateStates(Device("cpu"), 1, rows, (2,), (3,), np.float32, np.float32)
            for _ in range(2)]
    counts = rng.integers(0, mi._K + 1, rows) * (rng.integers(0, 3, rows) == 0)
    blocks = rng.integers(0, 50, (rows, mi._K))
    eos = np.where(rng.integers(0, 2, rows) == 0, rng.integers(0, 50, rows), -1)
    for x in made:
        x.counts[:] = counts
        x.block_ids[:] = np.where(np.arange(mi._K)[None, :] < counts[:, None], blocks, -1)
        x.offsets[:] = np.where(x.block_ids >= 0, 3, 0)
        x.eos_block_ids[:] = eos
        x.pending = bool(counts.any() or (eos >= 0).any())
    return made


def tracking(x):
    return (x.offsets.tolist(), x.block_ids.tolist(), x.counts.tolist(),
            x.eos_block_ids.tolist(), x.pending)


def collect_by_model(x, kv_block_hashes):
    """Row by row: each row's first ``counts`` scratch blocks (scratch index = running count),
    then each row's EOS block, and their hashes; None when nothing is pending."""
    rows = range(len(x.counts))
    inter = [int(x.block_ids[r, k]) for r in rows for k in range(int(x.counts[r]))]
    eos_rows = [r for r in rows if x.eos_block_ids[r] >= 0]
    eos = [int(x.eos_block_ids[r]) for r in eos_rows]
    if not x.pending or not inter + eos:
        return None
    return (inter, list(range(len(inter))), eos, eos_rows,
            [int(kv_block_hashes[b]) for b in inter + eos])


def clear_by_model(tracked, rows):
    """``tracking`` after forgetting ``rows`` (None: all): their entries reset, ``pending``
    while any entry is left."""
    offsets, block_ids, counts, eos, _ = copy.deepcopy(tracked)
    for r in range(len(counts)) if rows is None else rows.tolist():
        offsets[r], block_ids[r] = [0] * len(offsets[r]), [-1] * len(block_ids[r])
        counts[r], eos[r] = 0, -1
    return offsets, block_ids, counts, eos, any(counts) or any(e >= 0 for e in eos)


@settings(max_examples=30)
@given(st.integers(0, 2**32 - 1))
def test_intermediate_collect_and_clear_follow_the_row_model(seed):
    """Random pending entries (none, EOS only as in decode steps, scratch and EOS): collect
    returns the row-by-row model's entries as int64 arrays; clearing some rows, then all,
    leaves the model's tracking and ``pending`` flag, and the invariants hold."""
    rng = np.random.default_rng(seed)
    x, _ = intermediate_twins(rng)
    hashes = rng.integers(-1, 1000, 50)
    got, want = x.collect(hashes), collect_by_model(x, hashes)
    assert (got is None) == (want is None)
    if got is not None:
        assert [a.tolist() for a in got] == list(want)
        assert all(a.dtype == np.int64 for a in got)
    rows = rng.permutation(5)[:int(rng.integers(0, 6))]
    for clear_rows in (rows, None, None):
        want = clear_by_model(tracking(x), clear_rows)
        x.clear(clear_rows)
        assert tracking(x) == want
        assert x.broken_invariants() == []
    assert x.collect(hashes) is None and not x.pending


# --- Mamba hash map: ownership flags in a bytearray ---------------------------------------------

def test_register_refuses_a_block_without_a_slot_and_changes_nothing():
    """``register_block_hashes_batch`` of a registered block that owns no slot (never had one,
    or lost it) raises the same ValueError, naming the block, and changes nothing; the lean
    list path refuses it too and falls through to the same error."""
    from test_mamba_slot_allocator import make, registered_blocks
    _, kv, alloc = make(max_slots=4)
    ids, hashes = registered_blocks(kv, 3)
    alloc.allocate_slots_batch(ids[:2])
    alloc.invalidate_block(ids[0])
    for bad in (ids[0], ids[2]):
        before = (dict(alloc.hash_to_block_id), alloc.block_to_slot.tolist())
        for args in (([ids[1], bad], [hashes[1], hashes[ids.index(bad)]]),
                     (np.array([ids[1], bad]), np.array([hashes[1], hashes[ids.index(bad)]]))):
            with pytest.raises(ValueError, match=f"block_ids: expected blocks owning a slot, "
                                                 f"got {bad}$"):
                alloc.register_block_hashes_batch(*args)
            assert (dict(alloc.hash_to_block_id), alloc.block_to_slot.tolist()) == before
    alloc.register_block_hashes_batch([ids[1]], [hashes[1]])
    assert alloc.hash_to_block_id == {hashes[1]: ids[1]}
    alloc.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_add_blocks_of_few_rows_equals_the_scatter(data):
    """A decode step's new blocks written row by row (up to ``_FEW_ROWS`` rows) land where the
    NumPy scatter puts them: each marked row's next column, its block count one higher."""
    from hcache.contexts import requests as rq
    R, B = 20, 6
    held = np.array(data.draw(st.lists(st.integers(0, B - 1), min_size=R, max_size=R)))
    mask = np.array(data.draw(st.lists(st.integers(0, 1), min_size=R, max_size=R)), np.int8)
    rows = np.array(data.draw(st.permutations(range(R))), np.int64)
    blocks = np.array(data.draw(st.lists(st.integers(0, 999), min_size=int(mask.sum()),
                                         max_size=int(mask.sum()), unique=True)), np.int64)
    tables = []
    for few in (rq._FEW_ROWS, -1):      # -1: the NumPy scatter whatever the count
        t = rq.RequestTable(R, B, 4, hashing=False)
        t.num_blocks[:] = held
        t.request_to_kv_block_ids[:] = np.where(np.arange(B)[None, :] < held[:, None], 7, -1)
        saved, rq._FEW_ROWS = rq._FEW_ROWS, few
        try:
            t.add_blocks(rows, mask.astype(bool), blocks)
        finally:
            rq._FEW_ROWS = saved
        tables.append((t.request_to_kv_block_ids.copy(), t.num_blocks.copy()))
    (fast, fast_held), (scatter, scatter_held) = tables
    np.testing.assert_array_equal(fast, scatter)
    np.testing.assert_array_equal(fast_held, scatter_held)
    marked = rows[mask.view(bool)]
    np.testing.assert_array_equal(fast[marked, held[marked]], blocks)
    np.testing.assert_array_equal(fast_held, held + np.isin(np.arange(R), marked))
