"""The lean boundary commit (hcache/contexts/mamba_commit.py, issue 24) changes cost, not outcome.

Oracle: :func:`~hcache.contexts.mamba_commit.commit_general`, the NumPy statement of the rule,
run by a twin context whose allocator has ``lean_commit = False``. Both contexts go through the
same admissions (shared stems: matched, cached and repeated blocks), decode and multi-token
extensions, commits, releases and catch-ups under KV-block and Mamba-slot pressure, with and
without a registration backlog; before every commit the "model" writes the same random live and
scratch states into both. Every outcome, every piece of allocator state (slot owners and
numbering, free stack, Mamba hash map, awaiting marks) and every cached state byte must agree
after every operation. The oracle is shown to catch a defect put into the lean path.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from test_decode_fast_paths import (
    outcome,
    plan_tuple,
    random_extension,
    random_prompt,
    random_release,
    ready_ids,
    snapshot,
    write_random_states,
)
from test_dynamic_context import make_ctx

from hcache.contexts import mamba_commit
from hcache.contexts.mamba_slot_pool import MambaSlotPool


def full_state(ctx):
    m = ctx.mamba_slot_allocator
    return snapshot(ctx), m.conv_states.tobytes(), m.ssm_states.tobytes(), \
        ctx.mamba_conv_states.tobytes(), ctx.mamba_ssm_states.tobytes()


def twin_steps(fast, oracle, rng, check=lambda fast, oracle: None):
    """``(both, commit)`` for driving two contexts alike: ``both(f)`` calls ``f`` on each and
    asserts the same outcome and full state (and ``check``), returning the outcome;
    ``commit()`` writes the same random Mamba states into both, then commits both."""
    def both(f):
        got = [outcome(lambda c=c: f(c)) for c in (fast, oracle)]
        assert got[0] == got[1]
        assert full_state(fast) == full_state(oracle)
        check(fast, oracle)
        return got[0]

    def commit():
        state_seed = int(rng.integers(2**32))
        for c in (fast, oracle):
            write_random_states(c, state_seed)
        both(lambda c: c.commit_step())
    return both, commit


def drive(seed, steps, *, lean=True):
    """Run a lean context (``lean``: its path on) beside a general one."""
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 2, 3]))
    kw = dict(bs=bs, mamba=2, slots=int(rng.integers(2, 9)), rows=int(rng.integers(3, 7)),
              max_blocks=24 // bs, registration_budget=[None, None, 1, 2][int(rng.integers(4))])
    blocks = int(rng.integers(14, 40))
    fast, oracle = make_ctx(blocks, **kw), make_ctx(blocks, **kw)
    fast.mamba_slot_allocator.lean_commit = lean
    oracle.mamba_slot_allocator.lean_commit = False
    next_id = 0
    both, commit = twin_steps(fast, oracle, rng)

    for _ in range(steps):
        op = rng.integers(10)
        ready = ready_ids(fast)
        if op < 3 or not fast.request_ids:
            tokens = random_prompt(rng)
            rid, next_id = next_id, next_id + 1
            both(lambda c, r=rid, t=tokens: c.add_request(r, t).row)
            if rng.integers(2):
                commit()
        elif op < 7 and ready:
            ids, toks = random_extension(rng, ready, 3, 2 * bs + 1)
            both(lambda c, i=ids, t=toks: plan_tuple(c.extend_requests(i, t)))
            commit()
        elif op < 8:
            commit()
        elif op < 9:
            gone = random_release(rng, fast.request_ids)
            both(lambda c, g=gone: c.release_requests(g))
        else:
            both(lambda c: c.register_completed_blocks())
    for c in (fast, oracle):
        c.check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_lean_commit_equals_the_general_commit(seed):
    """Random serving traffic: the lean context equals the general one in every outcome, every
    piece of allocator state and every cached state byte, after every operation."""
    drive(seed, 60)


def test_the_twin_workload_reaches_every_case_of_the_lean_path(monkeypatch):
    """The side-by-side runs make the lean path handle what it claims to (else they would
    prove little): scratch and EOS entries in one step, cached or unregistered entries and
    repeated blocks (the slow selection), owners keeping their slots, LRU eviction, a
    shortage that keeps owners and the first new blocks; and make it decline (the general
    path runs), e.g. for a deferred block."""
    import hcache.contexts.mamba_slot_allocator as allocator
    seen = dict.fromkeys(["lean", "declined", "scratch and eos", "slow selection", "owners",
                          "evicted", "shortage", "repeated block"], 0)
    lean, kept, first = (mamba_commit.commit_lean, mamba_commit._kept,
                         mamba_commit._owners_and_first)
    evict, inside = MambaSlotPool.evict, [False]

    def counting_lean(m, stream):
        entries = m._intermediate.entries(mamba_commit.LEAN_MAX_ENTRIES) \
            if m._intermediate.pending else None
        inside[0] = True
        try:
            done = lean(m, stream)
        finally:
            inside[0] = False
        if entries and entries[0]:
            bids, eos_rows, num_inter = entries
            seen["lean" if done is not None else "declined"] += 1
            if done is not None:
                seen["scratch and eos"] += 0 < num_inter < len(bids)
                seen["owners"] += any(m._pool.owned[b] for b in bids)
                seen["repeated block"] += len(set(bids)) < len(bids)
        return done

    def counting(key, fn):
        def wrapper(*a, **k):
            seen[key] += inside[0]
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(allocator, "commit_lean", counting_lean)
    monkeypatch.setattr(mamba_commit, "_kept", counting("slow selection", kept))
    monkeypatch.setattr(mamba_commit, "_owners_and_first", counting("shortage", first))
    monkeypatch.setattr(MambaSlotPool, "evict", counting("evicted", evict))
    for seed in range(6):
        drive(seed, 60)
        commit_twins(seed)
    assert all(seen.values()), seen


@pytest.mark.parametrize("defect", ["newest victims", "last new blocks kept", "no dedup"])
def test_the_oracle_catches_a_defect_in_the_lean_path(monkeypatch, defect):
    """Put a defect back into the lean path: the side-by-side runs fail."""
    if defect == "newest victims":      # the lean path's candidates taken newest first
        evict = MambaSlotPool.evict

        def newest(self, n, refs, stamps, *, exclude=None, candidates=None):
            if type(candidates) is list:
                candidates = self._evictable.oldest(len(candidates) + 3, self.owned, refs,
                                                    stamps, set(exclude))[::-1]
            return evict(self, n, refs, stamps, exclude=exclude, candidates=candidates)
        monkeypatch.setattr(MambaSlotPool, "evict", newest)
    elif defect == "last new blocks kept":
        def last(picked, bids, owned, room):
            new = [i for i in picked if not owned[bids[i]]]
            keep = set(new[len(new) - room:]) if room else set()
            return [i for i in picked if owned[bids[i]] or i in keep]
        monkeypatch.setattr(mamba_commit, "_owners_and_first", last)
    else:
        monkeypatch.setattr(mamba_commit, "_kept", lambda bids, hashes, mamba_map: [
            i for i, (b, h) in enumerate(zip(bids, hashes)) if h > 0 and
            mamba_map.get(h, -1) != b])
    with pytest.raises((AssertionError, RuntimeError)):   # a difference, or broken state
        for seed in range(12):
            commit_twins(seed)
            drive(seed, 60)


# --- one allocator's commits, entries of any shape ------------------------------------------

def allocator_twins(seed):
    """Two equal allocators over stand-in contexts (tests/test_mamba_slot_allocator.py) with
    registered, unregistered, released, slot-owning and cached blocks; the first lean."""
    from test_mamba_slot_allocator import make, registered_blocks
    rng = np.random.default_rng(seed)
    slots = int(rng.integers(1, 7))
    made = [make(num_blocks=40, max_slots=slots) for _ in range(2)]
    made[1][2].lean_commit = False
    for _, kv, alloc in made:
        r = np.random.default_rng(seed)
        chains = [registered_blocks(kv, int(r.integers(2, 7)), salt=s)[0] for s in range(3)]
        unregistered = kv.allocate_memory_blocks(int(r.integers(1, 4))).tolist()
        blocks = [b for c in chains for b in c] + unregistered
        owners = r.permutation([b for c in chains for b in c])[:int(r.integers(0, slots + 1))]
        alloc.allocate_slots_batch(owners.tolist())
        cached = owners[:int(r.integers(0, len(owners) + 1))].tolist()
        alloc.register_block_hashes_batch(cached, kv.block_hashes[cached].tolist())
        kv.release_memory_blocks(chains[int(r.integers(3))])
        kv.advance_clock()
    return made, blocks


def plan_entries(alloc, rng, blocks):
    """Random scratch entries (any row, repeats allowed) and EOS entries (rows with a live
    slot), as the model's planning would leave them."""
    inter = alloc._intermediate
    counts = rng.integers(0, 4, 4) * (rng.integers(0, 2, 4) == 0)
    for row in range(4):
        n = int(counts[row])
        inter.block_ids[row] = [*rng.choice(blocks, n).tolist(), *[-1] * (3 - n)]
        inter.offsets[row] = [*range(1, n + 1), *[0] * (3 - n)]
        inter.counts[row] = n
        inter.eos_block_ids[row] = int(rng.choice(blocks)) if row < 3 and rng.integers(2) else -1
    inter.pending = True


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_lean_allocator_commit_equals_the_general_one(seed):
    """Commits of random entries (scratch and EOS, repeated blocks, cached, unregistered and
    slot-owning blocks, evictable slots of several ages, slots short or not): the lean
    allocator's counts, slot owners and numbering, free stack, Mamba map and cached bytes are
    the general one's, commit after commit."""
    commit_twins(seed)


def commit_twins(seed):
    from test_mamba_slot_allocator import snapshot as alloc_snapshot
    made, blocks = allocator_twins(seed)
    rng = np.random.default_rng(seed + 1)
    for _ in range(4):
        plan = int(rng.integers(2**32))
        scratch = np.random.default_rng(plan).random(made[0][2].intermediate_ssm_out.shape)
        got = []
        for _, kv, alloc in made:
            plan_entries(alloc, np.random.default_rng(plan), blocks)
            alloc.intermediate_ssm_out[...] = scratch
            got.append(alloc.commit_intermediate_states())
            alloc.check_invariants()
            kv.advance_clock()
        assert got[0] == got[1]
        for a, b in zip(*(alloc_snapshot(alloc) for _, _, alloc in made), strict=True):
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(a, b)
            else:
                assert a == b
        assert [alloc._hashes.awaiting.tolist() for _, _, alloc in made][0] == \
            made[1][2]._hashes.awaiting.tolist()
        release = rng.choice(blocks, 2, replace=False).tolist()
        for _, kv, _ in made:     # make more slots evictable between commits
            kv.release_memory_blocks([b for b in release if kv.block_ref_counts[b] > 0])
