"""The row-by-row Mamba boundary tracking (hcache/contexts/mamba_entry_rows.py, issue 24) changes
cost, not outcome.

Oracle: a twin context whose tracking never notes rows (every read, plan and clear takes the
NumPy scans over all rows, the code before), whose decode steps plan their EOS entries through
the general ``compute_and_store_offsets_batch`` path and whose commit is the general one. Both
go through the same admissions, decode steps (many rows closing a block at once, or a few),
multi-token extensions, commits and releases; the tracking arrays, the pending flag, the
entries a commit reads and every other outcome must agree after every operation, and the fast
context's invariants (every row holding an entry is noted) must hold. The oracle is shown to
catch defects put into the row-by-row paths.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from test_decode_fast_paths import plan_tuple, random_prompt
from test_dynamic_context import make_ctx
from test_mamba_commit_lean import twin_steps

from hcache.contexts import mamba_entry_rows
from hcache.contexts.mamba_entry_rows import EntryRows


class UntrackedRows(EntryRows):
    """Tracking that never notes a row: every path scans the arrays with NumPy."""

    rows = property(lambda self: None, lambda self, value: None)


def oracle_of(ctx):
    """Turn ``ctx`` into the oracle: untracked rows, general EOS planning, general commit."""
    m, scheduler = ctx.mamba_slot_allocator, ctx._scheduler
    m._intermediate.entry_rows.__class__ = UntrackedRows
    m.lean_commit = False
    plan = scheduler._plan_snapshots

    def general(rows, starts, ends, counts, closing):
        return plan(rows, starts, ends, counts, None if closing is not False else closing)
    scheduler._plan_snapshots = general
    return ctx


def tracking(ctx):
    inter = ctx.mamba_slot_allocator._intermediate
    entries = inter.entries(10**6) if inter.pending else None
    return (inter.offsets.tolist(), inter.block_ids.tolist(), inter.counts.tolist(),
            inter.eos_block_ids.tolist(), inter.pending, entries)


def drive(seed, steps):
    rng = np.random.default_rng(seed)
    bs = int(rng.integers(1, 4))
    rows = int(rng.integers(4, 13))
    kw = dict(bs=bs, mamba=2, slots=int(rng.integers(2, 12)), rows=rows, max_blocks=30 // bs,
              registration_budget=[None, None, 1][int(rng.integers(3))])
    blocks = int(rng.integers(4 * rows, 8 * rows))
    fast, oracle = make_ctx(blocks, **kw), oracle_of(make_ctx(blocks, **kw))
    next_id = 0
    full = rng.integers(2)      # start with every row admitted (many rows close blocks at once)

    def tracked_alike(fast, oracle):
        assert tracking(fast) == tracking(oracle)
        assert fast.mamba_slot_allocator._intermediate.broken_invariants() == []
    both, commit = twin_steps(fast, oracle, rng, tracked_alike)

    for _ in range(steps):
        op = rng.integers(12)
        ready = [r for r in fast.request_ids
                 if fast._requests.pending_end[fast._requests.row(r)] < 0]
        if op < 3 or not fast.request_ids or full and len(fast.request_ids) < rows:
            tokens = random_prompt(rng, [list(range(1, 13)), [5, 4, 3, 2, 1] * 2])
            rid, next_id = next_id, next_id + 1
            both(lambda c, r=rid, t=tokens: c.add_request(r, t).row)
            if rng.integers(2):
                commit()
        elif op < 8 and ready:      # decode: one token for all (many close a block) or some
            ids = ready if rng.integers(3) else ready[:int(rng.integers(1, len(ready) + 1))]
            toks = rng.integers(0, 3, len(ids))
            both(lambda c, i=ids, t=toks: plan_tuple(c.extend_requests(i, t)))
            if rng.integers(4):
                commit()
        elif op < 9 and ready:
            ids = ready[:int(rng.integers(1, len(ready) + 1))]
            toks = [rng.integers(0, 3, int(rng.integers(1, 2 * bs + 2))).tolist() for _ in ids]
            both(lambda c, i=ids, t=toks: plan_tuple(c.extend_requests(i, t)))
        elif op < 10:
            commit()
        else:
            live = fast.request_ids
            gone = [r for r in live if rng.integers(3) == 0][:3] or live[:1]
            both(lambda c, g=gone: c.release_requests(g))
    for c in (fast, oracle):
        c.check_invariants()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_row_tracking_equals_the_numpy_scans(seed):
    """Random serving traffic: the tracked context equals the untracked, general one in the
    tracking arrays, the pending flag, the entries, every outcome and every state byte."""
    drive(seed, 50)


def test_the_workload_reaches_every_path(monkeypatch):
    """The side-by-side runs take the paths they are meant to prove: EOS planning of a few
    rows (lists) and of many (arrays), tracked reads of scratch and EOS entries, releases
    clearing tracked rows, and tracking given up for too many rows (the replacement of a
    row's scratch entries by an EOS entry, unreachable through the context, is proven on
    the rows alone below)."""
    seen = dict.fromkeys(["eos few", "eos many", "scratch read", "release clear", "overflow"],
                         0)
    write_eos, entries, clear = EntryRows.write_eos, EntryRows.entries, EntryRows.clear

    def counting_write_eos(self, rows, block_ids):
        if type(self) is EntryRows:
            seen["eos few" if type(rows) is list else "eos many"] += 1
        was = self.rows is not None
        write_eos(self, rows, block_ids)
        seen["overflow"] += was and self.rows is None

    def counting_entries(self, limit):
        got = entries(self, limit)
        if type(self) is EntryRows and self.rows is not None and got:
            seen["scratch read"] += got[2] > 0
        return got

    def counting_clear(self, rows=None):
        if type(self) is EntryRows and rows is not None and self.rows and self.pending:
            seen["release clear"] += bool(self.rows.intersection(rows))
        return clear(self, rows)

    monkeypatch.setattr(EntryRows, "write_eos", counting_write_eos)
    monkeypatch.setattr(EntryRows, "entries", counting_entries)
    monkeypatch.setattr(EntryRows, "clear", counting_clear)
    monkeypatch.setattr(mamba_entry_rows, "TRACKED", 3)    # (a small limit: it is reached)
    for seed in range(8):
        drive(seed, 50)
    assert all(seen.values()), seen


@pytest.mark.parametrize("defect", ["unsorted rows", "stale scratch", "forgotten row"])
def test_the_oracle_catches_a_defect(monkeypatch, defect):
    """Put a defect into the row-by-row paths: the side-by-side runs fail."""
    if defect == "unsorted rows":       # entries read in the order rows were noted
        entries = EntryRows.entries

        def unsorted(self, limit):
            got = entries(self, limit)
            if self.rows is not None and got and got[2] == 0 and len(got[1]) > 1:
                return got[0][::-1], got[1][::-1], 0
            return got
        monkeypatch.setattr(EntryRows, "entries", unsorted)
    elif defect == "stale scratch":     # a decode EOS entry leaves the row's scratch entries
        write_eos = EntryRows.write_eos

        def keep_scratch(self, rows, block_ids):
            if self.rows is None:
                return write_eos(self, rows, block_ids)
            listed = rows if type(rows) is list else rows.tolist()
            eos = self._views.eos
            for r, b in zip(listed, block_ids if type(block_ids) is list
                            else block_ids.tolist()):
                eos[r] = b
            self.track(listed)
        monkeypatch.setattr(EntryRows, "write_eos", keep_scratch)
    else:       # a release's clear drops a row it did not clear from the tracked ones
        clear = EntryRows.clear

        def forgetful(self, rows=None):
            clear(self, rows)
            if rows is not None and self.rows:
                self.rows.discard(max(self.rows))
        monkeypatch.setattr(EntryRows, "clear", forgetful)
    with pytest.raises(AssertionError):
        if defect == "stale scratch":   # (unreachable through a context: the rows alone)
            test_rows_equal_the_numpy_scans()
        for seed in range(16):
            drive(seed, 50)


# --- the rows alone, any sequence of writes ------------------------------------------------

def rows_twins(max_requests):
    made = []
    for cls in (EntryRows, UntrackedRows):
        arrays = (np.zeros((max_requests, 3), np.int32), np.full((max_requests, 3), -1, np.int32),
                  np.zeros(max_requests, np.int32), np.full(max_requests, -1, np.int32))
        rows = EntryRows(*arrays)
        rows.__class__ = cls
        made.append((rows, arrays))
    return made


class ArraysModel:
    """The four tracking arrays written as the docstrings of :class:`EntryRows` say, with
    NumPy and nothing of EntryRows: the oracle of its writes and reads."""

    def __init__(self, max_requests, k=3):
        self.offsets = np.zeros((max_requests, k), np.int32)
        self.block_ids = np.full((max_requests, k), -1, np.int32)
        self.counts = np.zeros(max_requests, np.int32)
        self.eos = np.full(max_requests, -1, np.int32)

    def clear(self, rows=slice(None)):
        self.offsets[rows], self.block_ids[rows], self.counts[rows], self.eos[rows] = 0, -1, 0, -1

    def write_row(self, row, offsets, block_ids, eos):
        self.clear(row)
        n = len(offsets)
        self.offsets[row, :n], self.block_ids[row, :n], self.counts[row] = offsets, block_ids, n
        self.eos[row] = eos

    def write_eos(self, rows, block_ids):
        self.clear(list(rows))
        self.eos[list(rows)] = block_ids

    def arrays(self):
        return self.offsets, self.block_ids, self.counts, self.eos

    def entries(self, limit):
        rows, eos_rows = np.flatnonzero(self.counts), np.flatnonzero(self.eos >= 0)
        if self.offsets.shape[1] * len(rows) + len(eos_rows) > limit:
            return None
        scratch = [b for r in rows for b in self.block_ids[r, :self.counts[r]].tolist()]
        return scratch + self.eos[eos_rows].tolist(), eos_rows.tolist(), len(scratch)


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 20), st.data())
def test_rows_equal_the_numpy_scans(max_requests, data):
    """Random writes of rows (scratch and EOS entries), EOS entries of a few rows (lists) or
    many (arrays) replacing what rows hold, clears of some rows (lists or arrays) or all, and
    direct writes flagged through ``pending``: the arrays and the entries read equal those of
    a NumPy model of the documented writes (:class:`ArraysModel`), the arrays, the flag and
    the entries equal the untracked twin's, and every row holding an entry stays noted."""
    twins, model = rows_twins(max_requests), ArraysModel(max_requests)
    row = st.integers(0, max_requests - 1)
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["row", "eos", "clear rows", "clear", "direct"]))
        if op == "row":
            r, n = data.draw(row), data.draw(st.integers(0, 3))
            offsets = sorted(data.draw(st.lists(st.integers(1, 50), min_size=n, max_size=n,
                                                unique=True)))
            ids = data.draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))
            eos = data.draw(st.one_of(st.just(-1), st.integers(0, 99)))     # -1: no EOS entry
            for rows, _ in twins:
                rows.write_row(r, offsets, ids, eos)
            model.write_row(r, offsets, ids, eos)
        elif op == "eos":
            rs = data.draw(st.lists(row, min_size=1, max_size=max_requests, unique=True))
            ids = data.draw(st.lists(st.integers(0, 99), min_size=len(rs), max_size=len(rs)))
            as_arrays = data.draw(st.booleans())
            for rows, _ in twins:
                if as_arrays:
                    rows.write_eos(np.array(rs, np.int64), np.array(ids, np.int32))
                else:
                    rows.write_eos(list(rs), list(ids))
            model.write_eos(rs, ids)
        elif op == "clear rows":
            rs = data.draw(st.lists(row, max_size=max_requests))
            as_array = data.draw(st.booleans())
            for rows, _ in twins:
                rows.clear(np.array(rs, np.int64) if as_array else list(rs))
            model.clear(list(rs))
        elif op == "clear":
            for rows, _ in twins:
                rows.clear()
            model.clear()
        else:       # a writer of the arrays flags them (the tracking is given up)
            r, b = data.draw(row), data.draw(st.integers(0, 99))
            for rows, arrays in twins:
                arrays[3][r] = b
                rows.flag(True)
            model.eos[r] = b
        fast, slow = twins
        for a, b, c in zip(fast[1], slow[1], model.arrays(), strict=True):
            np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(b, c)
        assert fast[0].pending == slow[0].pending
        assert fast[0].entries(10**6) == slow[0].entries(10**6) == model.entries(10**6)
        assert fast[0].broken_invariants() == []
        limit = data.draw(st.integers(0, 8))
        assert fast[0].entries(limit) == slow[0].entries(limit) == model.entries(limit)
