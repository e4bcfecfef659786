"""A serving step's registration through kept memoryviews (issue 24, seventh pass) changes cost,
not behaviour.

Oracles: ``chain_block_hashes`` for ``chain_cells``; ``RequestTable.hash_next`` (arrays) for
``hash_next_listed`` (scalars) on twin tables; ``link_new``'s array path and ``BlockForest.link``
of the entries that claim a new hash for ``_link_few`` on batches of a few prompts' chains and a
decode step's blocks (up to and past ``_FEW_LINKS``); the NumPy write for
``EvictableLeaves.discard`` of a list; and, for ``ScalarViews``, the arrays they view, in the
owner, its deep copy and its unpickled copy.
"""

from __future__ import annotations

import copy
import pickle

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from test_decode_fast_paths import forest_state

from hcache.contexts import block_forest
from hcache.contexts.block_forest import BlockForest
from hcache.contexts.block_hashing import (
    DIGEST_BYTES,
    chain_block_hashes,
    chain_cells,
    compute_block_hashes,
)
from hcache.contexts.evictable_leaves import EvictableLeaves
from hcache.contexts.requests import RequestTable
from hcache.contexts.scalar_views import ScalarViews

seeds = st.integers(0, 2**32 - 1)


@given(seeds, st.integers(1, 5), st.integers(1, 6))
def test_chain_cells_hash_as_chain_block_hashes(seed, block_size, rows):
    """Each cell's new block continues its row's digest as ``chain_block_hashes`` does: the
    same hash, the row's digest replaced by the block's, other rows' digests untouched."""
    rng = np.random.default_rng(seed)
    width = 4
    tokens = rng.integers(-2**63, 2**63 - 1, (rows, width * block_size), dtype=np.int64)
    digests = rng.integers(0, 256, (rows, DIGEST_BYTES), dtype=np.uint8)
    picked = rng.permutation(rows)[:rng.integers(0, rows + 1)].tolist()
    cells = [(r, int(rng.integers(width))) for r in picked]
    blocks = np.array([tokens[r, c * block_size:(c + 1) * block_size] for r, c in cells],
                      np.int64).reshape(len(cells), block_size)
    want, want_digests = chain_block_hashes(digests[picked], blocks)
    after = digests.copy()
    step = 8 * block_size
    got = chain_cells(memoryview(after).cast("B"), memoryview(tokens).cast("B"), cells, step,
                      step * width)
    assert got == want.tolist()
    expected = digests.copy()
    expected[picked] = want_digests
    assert (after == expected).all()


def admitted_table(rng, block_size):
    """A request table of a few rows hashed up to a random column each (as a serving step
    leaves them: the next block complete, not hashed yet), stale hashes past them."""
    rows, blocks = 5, 6
    t = RequestTable(rows, blocks, block_size, hashing=True)
    cells = []
    for _ in range(int(rng.integers(1, rows + 1))):
        n = int(rng.integers(1, blocks)) * block_size + int(rng.integers(block_size))
        tokens = rng.integers(0, 50, n)
        hashed = int(rng.integers(0, n // block_size))     # the next block is complete
        hashes = compute_block_hashes(tokens[:hashed * block_size], block_size)
        digest = bytes(DIGEST_BYTES)
        if hashed:
            _, digests = chain_block_hashes(np.zeros((1, DIGEST_BYTES), np.uint8),
                                            tokens[:hashed * block_size].reshape(hashed, -1),
                                            np.array([hashed]))
            digest = digests[-1].tobytes()
        blocks_held = -(-n // block_size)
        row = t.admit(len(cells), tokens, [], rng.permutation(50)[:blocks_held], hashes, digest,
                      kv_cached=0, registered=hashed, computed=n, stats=None)
        cells.append((row, hashed))
    stale = np.arange(blocks) >= t.hashed[:, None]     # no invariant holds them (a reused row)
    t.hashes[stale] = rng.integers(1, 2**63 - 1, int(stale.sum()))
    order = rng.permutation(len(cells))
    return t, [cells[i] for i in order]


@given(seeds, st.integers(1, 4))
def test_hash_next_listed_hashes_as_hash_next(seed, block_size):
    """``hash_next_listed`` of a few cells equals ``hash_next`` of them on a twin table: the
    same hashes, previous blocks' hashes (0 at column 0), table hashes, digests and hashed
    counts; and it appends the cells' block ids."""
    rng = np.random.default_rng(seed)
    t, cells = admitted_table(rng, block_size)
    twin = copy.deepcopy(t)
    rows, cols = (np.array(x, np.int64) for x in zip(*cells))
    want, roots = twin.hash_next(rows, cols)
    ids, hashes, parents = [7], [8], [9]        # appended to
    t.hash_next_listed(cells, ids, hashes, parents)
    assert hashes == [8, *want]
    assert parents == [9, *(p if c else 0 for p, (_, c) in zip(roots, cells))]
    assert ids == [7, *(int(t.request_to_kv_block_ids[r, c]) for r, c in cells)]
    for name in ("hashes", "digests", "hashed", "tokens", "registered"):
        assert (getattr(t, name) == getattr(twin, name)).all(), name
    assert t.broken_invariants() == []


@st.composite
def step_batches(draw):
    """A forest of registered chains (some evicted again), then a step's batch: a few prompt
    chains (each entry's parent the previous one; a chain's head continues a registered hash,
    an unknown one or none), a decode block per row continuing registered hashes, and hashes
    already held (registered before, or earlier in the batch: those blocks stay private)."""
    rng = np.random.default_rng(draw(seeds))
    nb = 400
    f, next_hash = BlockForest(nb), 1
    free = rng.permutation(nb).tolist()
    for _ in range(int(rng.integers(0, 6))):
        n = int(rng.integers(1, 40))
        ids = np.array([free.pop() for _ in range(n)], np.int64)
        hs = np.arange(next_hash, next_hash + n, dtype=np.int64)
        ps = np.concatenate([[0], hs[:-1]])
        f.link(ids, hs, ps)
        next_hash += n
    held = list(f.hash_to_block)
    if held and rng.integers(2):
        gone = rng.choice(held, int(rng.integers(1, min(len(held), 10) + 1)), replace=False)
        gone_ids = np.array([f.hash_to_block[h] for h in gone.tolist()], np.int64)
        f.unlink(gone_ids)
        free += gone_ids.tolist()
        held = list(f.hash_to_block)
    ids, hs, ps = [], [], []
    size = draw(st.sampled_from([5, 60, block_forest._FEW_LINKS + 30]))
    while len(ids) < size and len(free) > 1:
        if rng.integers(3):     # a prompt chain
            head = [0, next_hash + 10**6, *held][int(rng.integers(len(held) + 2))]
            for i in range(int(rng.integers(1, 50))):
                ps.append(head if i == 0 else hs[-1])
                hs.append(next_hash)
                next_hash += 1
                ids.append(free.pop())
        else:                   # a decode block: a registered parent, or a sibling's
            ps.append([*held, *hs, 0][int(rng.integers(len(held) + len(hs) + 1))])
            hs.append(next_hash)
            next_hash += 1
            ids.append(free.pop())
        if rng.integers(4) == 0 and (held or hs):
            hs[-1] = [*held, *hs[:-1]][int(rng.integers(len(held) + len(hs) - 1))] \
                if len(held) + len(hs) > 1 else hs[-1]
    return f, ids, hs, ps


@settings(max_examples=60, deadline=None)
@given(step_batches())
def test_link_few_links_a_steps_chains_as_the_array_path_and_link_do(case):
    """``link_new`` entry by entry (``_FEW_LINKS`` and past it) and on arrays (0) leave the
    same forest, map order, dangling roots and child counts, and return the same count and
    parents in entry order; both equal ``link`` of the entries that claim a new hash."""
    f, ids, hs, ps = case
    arrays, oracle = copy.deepcopy(f), copy.deepcopy(f)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(block_forest, "_FEW_LINKS", len(ids))
        got = f.link_new(ids, hs, ps)
        m.setattr(block_forest, "_FEW_LINKS", 0)
        want = arrays.link_new(ids, hs, ps)
    keep, claimed = [], set(oracle.hash_to_block)
    for h in hs:
        keep.append(h not in claimed)
        claimed.add(h)
    keep = np.array(keep, bool)
    oracle.link(*(np.array(x, np.int64)[keep] for x in (ids, hs, ps)))
    assert got[0] == want[0] == int(keep.sum())
    assert list(got[1]) == list(want[1])
    for other in (arrays, oracle):
        assert forest_state(f) == forest_state(other)
        assert list(f.hash_to_block.items()) == list(other.hash_to_block.items())
        assert f.dangling.tolist() == other.dangling.tolist()
        assert f.num_dangling == other.num_dangling
    assert f.broken_invariants() == []


@given(seeds)
def test_discarding_a_list_drops_what_the_array_write_drops(seed):
    """``EvictableLeaves.discard`` of a list (repeats allowed) leaves the members the NumPy
    write of the same ids leaves."""
    rng = np.random.default_rng(seed)
    n = 50
    listed, arrays = EvictableLeaves(n), EvictableLeaves(n)
    stamps = rng.integers(0, 9, n)
    members = np.flatnonzero(rng.integers(0, 2, n))
    listed.add(members, stamps)
    arrays.add(members, stamps)
    dropped = rng.integers(0, n, int(rng.integers(0, 20)))
    listed.discard(dropped.tolist())
    arrays.discard(dropped)
    assert listed.member.tolist() == arrays.member.tolist()
    assert set(np.flatnonzero(listed.member)) == set(members.tolist()) - set(dropped.tolist())


class _Owner:
    """An owner of arrays and of their views."""

    def __init__(self, rng):
        self.flat = rng.integers(-9, 9, 7)
        self.grid = rng.integers(-9, 9, (3, 4)).astype(np.int32)
        self.raw = rng.integers(-9, 9, (2, 3))
        self.bits = rng.integers(0, 2, 5).astype(bool)
        self.bytes = rng.integers(0, 256, (2, 8)).astype(np.uint8)
        self.views = ScalarViews(("raw",), flat=self.flat, grid=self.grid, raw=self.raw,
                                 bits=self.bits, bytes=self.bytes)


@pytest.mark.parametrize("clone", [lambda o: o, copy.deepcopy,
                                   lambda o: pickle.loads(pickle.dumps(o))],
                         ids=["owner", "deepcopy", "pickle"])
@given(seeds)
def test_scalar_views_view_their_owners_arrays_in_every_copy(clone, seed):
    """A view reads and writes its owner's array (element ``(i, j)`` at ``i * width + j``,
    bytes for a raw or uint8 array), in the owner and in its deep or unpickled copy, whose
    views write the copy's arrays, never the original's."""
    rng = np.random.default_rng(seed)
    original = _Owner(rng)
    before = {k: v.copy() for k, v in vars(original).items() if isinstance(v, np.ndarray)}
    o = clone(original)
    v = o.views
    assert v.flat.tolist() == o.flat.tolist() and v.bits.tolist() == o.bits.tolist()
    i, j = int(rng.integers(3)), int(rng.integers(4))
    assert v.grid[i * 4 + j] == o.grid[i, j]
    v.grid[i * 4 + j] = 100
    v.flat[6] += 1
    v.bits[2] = not v.bits[2]
    v.raw[8:16] = np.int64(-5).tobytes()
    v.bytes[8 + j] = 255
    assert o.grid[i, j] == 100 and o.flat[6] == before["flat"][6] + 1
    assert o.bits[2] != before["bits"][2] and o.raw[0, 1] == -5 and o.bytes[1, j] == 255
    if o is not original:
        for k, a in before.items():
            assert (getattr(original, k) == a).all(), k
