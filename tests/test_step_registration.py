"""The list form of a serving step's registration (hcache/contexts/step_registration.py, issue 24)
changes cost, not behaviour.

Oracles: the general path of ``BlockRegistration.commit`` (``register_step`` declining every
step), driven side by side with an unchanged context through admissions with shared stems,
salts and extra keys, one-token and multi-token decode steps, commits, releases, catch-ups and
``shares_pending_blocks`` under KV-block and Mamba-slot pressure, budgets from None to 1 (every
outcome and every piece of state equal after every operation, the hash map's order included);
``BlockForest.link`` of the entries that hold a new hash first, for ``link_new``; and
``compute_block_hashes`` of whole sequences (the request table's invariants rehash every row).
"""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from test_decode_fast_paths import (
    forest_state,
    link_cases,
    outcome,
    plan_tuple,
    random_extension,
    random_prompt,
    random_release,
    ready_ids,
    snapshot,
)
from test_dynamic_context import make_ctx

from hcache.contexts import block_forest, block_registration, step_registration
from hcache.contexts import request_handoff as handoff
from hcache.contexts.block_forest import BlockForest
from hcache.contexts.block_hashing import (
    cache_salt,
    chain_block_hashes,
    chain_cells,
    chain_root,
    compute_block_hashes,
)

STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5], [1, 2, 3, 4, 7, 7, 7], [5, 5]]
SALTS = [None, None, None, b"s1"]
KEYS = [None, None, None, {0: b"img"}, {1: [b"a", "b"]}]


def full_state(ctx):
    """:func:`snapshot` and what it leaves out: the hash map in insertion order, the dangling
    roots, the evictable leaves, the backlog marks."""
    kv, reg, t = ctx.kv_block_allocator, ctx._registration, ctx._requests
    f = kv._forest
    if ctx.mamba_slot_allocator is not None:
        head = snapshot(ctx)
    else:
        head = ([a.tolist() for a in (kv.free_block_ids, f.hashes, f.parent_ids, f.parent_hashes,
                                      f.child_counts, kv.block_ref_counts, kv.block_timestamps,
                                      t.request_to_kv_block_ids, t.hashes, t.digests, t.lengths,
                                      t.computed, t.registered, t.hashed)],
                list(ctx.request_ids), vars(ctx.stats))
    return (head, list(f.hash_to_block.items()), f.dangling.tolist(), f.num_dangling,
            kv._leaves.member.tolist(), reg.deferred.tolist(), reg.queued,
            ctx._requests.pending_key_cols.tolist(), kv.get_evictable_block_count())


def general(f):
    """``f()`` with every step left to the general path."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(block_registration, "register_step", lambda *a: None)
        return f()


def forced(few_rows, few_links, read_rows=4):
    """A runner of ``f()`` with ``register_step``'s scalar path taken for at most ``few_rows``
    rows (reading up to ``read_rows`` rows one by one) and ``link_new``'s for at most
    ``few_links`` entries (0: the list and array paths)."""
    def run(f):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(step_registration, "FEW_ROWS", few_rows)
            m.setattr(step_registration, "READ_ROWS", read_rows)
            m.setattr(block_forest, "_FEW_LINKS", few_links)
            return f()
    return run


def drive(seed, steps, *, stems=STEMS, run=lambda f: f(), oracle=general):
    """``steps`` random operations on two twin contexts, one run by ``run``, the other by
    ``oracle``: every outcome and all state agree after each."""
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 2, 3, 4]))
    kw = dict(bs=bs, mamba=int(rng.integers(2)), slots=int(rng.integers(2, 9)),
              rows=int(rng.integers(3, 7)), max_blocks=24 // bs,
              policy=["lru", "lru", "ref_zero"][int(rng.integers(3))],
              registration_budget=[None, 1, 4, 8, 128][int(rng.integers(5))])
    blocks = int(rng.integers(12, 60))
    fast, slow = make_ctx(blocks, **kw), make_ctx(blocks, **kw)
    next_id = 0

    def both(f):
        got = (run(lambda f=f: outcome(lambda: f(fast))),
               oracle(lambda f=f: outcome(lambda: f(slow))))
        assert got[0] == got[1]
        assert full_state(fast) == full_state(slow)
        return got[0]

    for _ in range(steps):
        op = rng.integers(13)
        ready = ready_ids(fast)
        if op < 3 or not fast.request_ids:
            tokens = random_prompt(rng, stems)
            salt, keys = SALTS[int(rng.integers(len(SALTS)))], KEYS[int(rng.integers(len(KEYS)))]
            keys = keys if keys is None or max(keys) < -(-len(tokens) // bs) else None
            rid, next_id = next_id, next_id + 1
            both(lambda c, r=rid, t=tokens, s=salt, k=keys: c.add_request(
                r, t, salt=s, extra_keys=k).row)
        elif op < 8 and ready:
            ids, toks = random_extension(rng, ready)
            both(lambda c, i=ids, t=toks: plan_tuple(c.extend_requests(i, t)))
            both(lambda c: c.commit_step())
        elif op < 9:
            both(lambda c: c.commit_step())
        elif op < 11:
            gone = random_release(rng, fast.request_ids)
            both(lambda c, g=gone: c.release_requests(g))
        elif op < 12:
            stem = stems[int(rng.integers(len(stems)))]
            both(lambda c, s=stem: c.shares_pending_blocks(s))
        else:
            both(lambda c: c.register_completed_blocks())
    for c in (fast, slow):
        c.check_invariants()
    return fast


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_a_context_registers_as_the_general_path_does(seed):
    """Every outcome and every piece of registration state equals that of a context whose
    steps all take the general path."""
    drive(seed, 60)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_list_path_registers_as_the_general_path_does(seed):
    """Steps of any size on the list path and ``link_new``'s array path (the scalar paths
    off) leave every outcome and all state as the general path."""
    drive(seed, 60, run=forced(0, 0))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 8), st.sampled_from([0, 4, 24]),
       st.sampled_from([0, 1, 4, 8]))
def test_scalar_steps_register_as_the_list_path_does(seed, few_rows, few_links, read_rows):
    """A step growing at most ``few_rows`` rows registered on scalars (``_register_few``;
    up to ``read_rows`` rows read one by one, more gathered), the larger ones on lists, each
    linked entry by entry up to ``few_links`` entries, leave every outcome and all state (the
    hash map's order, dangling roots, leaves, each row's hashes, digests, ``hashed`` and
    ``registered``) as the list and array paths do."""
    drive(seed, 60, run=forced(few_rows, few_links, read_rows), oracle=forced(0, 0))


def test_the_scalar_paths_are_taken():
    """``drive``'s steps reach the paths the twin tests compare: ``_register_few`` with prompt
    rows and decoded blocks, rows read one by one and gathered, ``_link_few``, and
    ``link_new``'s array path."""
    calls = {"few": 0, "few prompt": 0, "few decode": 0, "link few": 0, "link array": 0,
             "read": 0, "gathered": 0}
    few, link_few, link_new = (step_registration._register_few, BlockForest._link_few,
                               BlockForest.link_new)

    def counted_few(requests, kv, rows, first, upto, grew, limit):
        hashed = requests.hashed[rows[grew]] >= upto[grew]
        out = few(requests, kv, rows, first, upto, grew, limit)
        calls["few"] += out is not None
        calls["few prompt"] += out is not None and bool(hashed.any())
        calls["few decode"] += out is not None and not bool(hashed.all())
        calls["read" if len(grew) <= step_registration.READ_ROWS else "gathered"] += 1
        return out

    def counted_link_few(self, *a):
        calls["link few"] += 1
        return link_few(self, *a)

    def counted_link_new(self, ids, *a):
        calls["link array"] += len(ids) > block_forest._FEW_LINKS
        return link_new(self, ids, *a)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(step_registration, "_register_few", counted_few)
        m.setattr(BlockForest, "_link_few", counted_link_few)
        m.setattr(BlockForest, "link_new", counted_link_new)
        for seed in range(3):
            drive(seed, 60, run=forced(3, 4, 1), oracle=forced(0, 0))
    assert all(calls.values()), calls


def scripted(policy, calls, budget=128, bs=2):
    """Run ``calls`` (functions of a context) on a context and on one whose steps take the
    general path; every outcome and all state agree after each."""
    fast, slow = (make_ctx(40, bs=bs, mamba=1, slots=12, rows=6, max_blocks=12, policy=policy,
                           registration_budget=budget) for _ in range(2))
    for f in calls:
        got = outcome(lambda f=f: f(fast)), general(lambda f=f: outcome(lambda: f(slow)))
        assert got[0] == got[1]
        assert full_state(fast) == full_state(slow)
    for c in (fast, slow):
        c.check_invariants()
    return fast


def add(rid, tokens, **kw):
    return lambda c: c.add_request(rid, tokens, **kw).row


def extend(ids, tokens):
    return lambda c: plan_tuple(c.extend_requests(ids, tokens))


def commit(c):
    return c.commit_step()


def release(*ids):
    return lambda c: c.release_requests(list(ids))


def test_steps_with_repeated_held_dangling_and_sibling_blocks_register_as_the_general_path():
    """Scripted steps reaching every branch of the list form: identical prompts in one step
    (repeated hashes) that then decode the same tokens (repeated decode blocks), a row
    decoding a block another registered earlier (a held hash), a released original under
    ``"ref_zero"`` (the duplicate row's next block links to no parent: a dangling root),
    two rows whose first private blocks share a parent (siblings), a prompt and decode
    blocks in one step, an extra key waiting for a decoded block, a first block completed
    by decode in a reused row, multi-block steps, a transferred request made live and a
    step over the budget's share (declined)."""
    seen = dict.fromkeys(["repeated", "held", "dangling", "siblings", "prompt and decode",
                          "keys", "declined"], 0)
    register, link_new = step_registration.register_step, BlockForest.link_new

    def counting_step(requests, kv, rows, ends, limit):
        up = ends // requests.block_size
        todo = up > requests.registered[rows]
        hashed = requests.hashed[rows] >= up
        keys = requests._pending_keys
        out = register(requests, kv, rows, ends, limit)
        seen["declined"] += out is None
        seen["prompt and decode"] += bool((todo & hashed).any() and (todo & ~hashed).any()) \
            and out is not None
        seen["keys"] += out is not None and requests._pending_keys < keys
        return out

    def counting_link(self, block_ids, hashes, parent_hashes):
        seen["held"] += any(h in self.hash_to_block for h in hashes)
        seen["repeated"] += len(set(hashes)) < len(hashes)
        dangling = self.num_dangling
        out = link_new(self, block_ids, hashes, parent_hashes)
        seen["dangling"] += self.num_dangling > dangling
        seen["siblings"] += len(set(out[1])) < len(out[1])
        return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(block_registration, "register_step", counting_step)
        m.setattr(BlockForest, "link_new", counting_link)
        for policy in ("lru", "ref_zero"):
            scripted(policy, [
                add("a", [1, 2, 3, 4, 5]), add("b", [1, 2, 3, 4, 5]), commit,
                extend(["a", "b"], [6, 6]), commit,                    # repeated decode block
                extend(["a"], [7]), commit, extend(["a"], [8]), commit,
                extend(["b"], [7]), commit, extend(["b"], [8]), commit,     # held by a's
                release("a"), extend(["b"], [9]), commit, extend(["b"], [10]), commit,
                add("c", [1, 2, 3, 4]), commit,
                add("d", [1, 2, 3, 4, 9]), add("e", [1, 2, 3, 4, 8]), commit,
                extend(["d", "e"], [1, 1]), commit,                    # siblings
                add("f", [5, 5, 5], extra_keys={1: b"img"}), extend(["d"], [[2, 3]]), commit,
                extend(["f"], [5]), commit,                            # the key's block
                extend(["d", "e"], [[3, 4, 5, 6], [3]]), commit,       # multi-block
                lambda c: handoff.admit_parked(c, "p", [1, 2, 3, 4, 5, 6, 7]).row, commit,
                lambda c: handoff.complete(c, "p"), extend(["p"], [8]), commit,  # a transfer's
            ])
        scripted("lru", [add("g", list(range(24))), commit, release("g"),   # row 0 reused:
                         add("h", [7]), commit, extend(["h"], [7]), commit])  # a stale tail hash
        scripted("lru", [add(i, [i, 9, 9]) for i in range(5)] + [commit]
                 + [extend(list(range(5)), [1] * 5), commit] * 3, budget=8)   # over budget / 4
    assert all(seen.values()), seen


@st.composite
def listed_cases(draw):
    """:func:`link_cases` with some hashes replaced by registered ones or by earlier
    entries' (the duplicates a step leaves private)."""
    f, ids, hs, ps, _ = draw(link_cases())
    hs = hs.copy()
    for i in range(len(hs)):
        pool = [*f.hash_to_block, *hs[:i].tolist()]
        if pool and draw(st.integers(0, 3)) == 0:
            hs[i] = draw(st.sampled_from(pool))
    return f, ids, hs, ps


@given(listed_cases())
def test_link_new_links_the_first_holders_as_link_does(case):
    """``link_new`` of lists equals ``link`` of the entries whose hash no block held before
    them (in the forest or earlier in the lists): the same hashes, map (in order), parents,
    parent hashes, child counts and dangling roots; it returns how many it registered and
    the parents that gained a child."""
    f, ids, hs, ps = case
    twin = copy.deepcopy(f)
    keep, held = [], set(f.hash_to_block)
    for h in hs.tolist():
        keep.append(h not in held)
        held.add(h)
    keep = np.array(keep, bool)
    registered, parents = f.link_new(ids.tolist(), hs.tolist(), ps.tolist())
    twin.link(ids[keep], hs[keep], ps[keep])
    assert forest_state(f) == forest_state(twin)
    assert list(f.hash_to_block.items()) == list(twin.hash_to_block.items())
    assert f.dangling.tolist() == twin.dangling.tolist() and f.num_dangling == twin.num_dangling
    assert registered == int(keep.sum())
    linked = twin.parent_ids[ids[keep]]
    assert sorted(parents) == sorted(linked[linked >= 0].tolist())
    assert f.broken_invariants() == []


@given(listed_cases())
def test_link_few_links_as_the_array_path_does(case):
    """``link_new`` entry by entry (``_link_few``) and on arrays (``_FEW_LINKS`` 0) leave the
    same forest (the hash map in order, dangling roots) and return the same count and parents
    (in entry order); the array path is checked against ``link`` as the scalar one is."""
    f, ids, hs, ps = case
    twin = copy.deepcopy(f)
    got = f._link_few(ids.tolist(), hs.tolist(), ps.tolist())
    with pytest.MonkeyPatch.context() as m:
        m.setattr(block_forest, "_FEW_LINKS", 0)
        want = twin.link_new(ids.tolist(), hs.tolist(), ps.tolist())
    assert got[0] == want[0] and list(got[1]) == list(want[1])
    assert forest_state(f) == forest_state(twin)
    assert list(f.hash_to_block.items()) == list(twin.hash_to_block.items())
    assert f.dangling.tolist() == twin.dangling.tolist() and f.num_dangling == twin.num_dangling
    assert f.broken_invariants() == []


@given(st.integers(1, 4), st.sampled_from([None, b"s1", "salt"]),
       st.lists(st.integers(-2**63, 2**63 - 1), max_size=20))
def test_chain_cells_continues_a_chain_as_the_whole_sequence_hashes(block_size, salt, tokens):
    """``chain_cells`` block by block from the salt's root (a one-row digest table, the tokens
    as its token row) gives ``compute_block_hashes`` of the whole sequence, and leaves in the
    digest row each block's digest as ``chain_block_hashes`` gives it."""
    whole = compute_block_hashes(tokens, block_size, salt=salt)
    arr = np.array(tokens, np.int64)
    row = bytearray(chain_root(cache_salt("salt", salt)))
    raw = arr.astype("<i8").tobytes()
    step = 8 * block_size
    for k, want in enumerate(whole):
        parent = np.frombuffer(bytes(row), np.uint8).reshape(1, -1)
        assert chain_cells(memoryview(row), memoryview(raw), [(0, k)], step, len(raw)) == [want]
        _, digests = chain_block_hashes(parent, arr[k * block_size:(k + 1) * block_size][None])
        assert bytes(row) == digests[0].tobytes()
