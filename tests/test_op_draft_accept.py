"""The ``draft_accept`` family (kernels/draft_accept.cu, hcache/ops/draft_accept.py):
``draft_accept`` and ``draft_lengths``.

Oracles: a naive row-by-row model of the documented rule (a row keeps ``accepted + bonus`` of
its ``written`` draft tokens: its live state becomes the draft state after the last kept one, its
length grows by the kept count; padding rows are skipped, rows out of range commit nothing and
are counted once) and the NumPy reference, which must give the kernel's bytes and status. The
kernels run on the host emulation of the real ``.cu`` (``emu``, ``emu-reverse``), on the emulated
device and on CuPy (``gpu`` tier); every array sits between canary bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hcache import ops
from hcache.dtypes import DTYPE_NAMES, resolve_dtype
from hcache.ops.tables import SlotSet

from helpers import host
from kernel_cases import (
    BACKENDS,
    WITH_REFERENCE,
    Arena,
    as_bytes,
    assert_same_bytes,
    dtypes,
    int32_on,
    kernel_env,
    misaligns,
    on,
    twins,
)

BIG = 2**31 - 1


@st.composite
def draft_cases(draw):
    num_slots = draw(st.integers(1, 6))
    draft_len = draw(st.integers(1, 5))
    written = draw(st.integers(0, draft_len))
    bonus = draw(st.integers(0, 1))
    tensors = draw(st.lists(st.tuples(st.lists(st.integers(1, 6), max_size=3), dtypes),
                            min_size=1, max_size=3))
    num_rows = draw(st.integers(0, num_slots))
    identity = draw(st.booleans())
    slots = (list(range(num_rows)) if identity
             else draw(st.permutations(range(num_slots)))[:num_rows])
    if not identity:
        slots = [s if draw(st.integers(0, 5)) else -1 for s in slots]
    top = max(written - bonus, 0)
    accepted = draw(st.lists(st.integers(0, top), min_size=num_rows, max_size=num_rows))
    if num_rows and draw(st.integers(0, 2)) == 0:   # a row out of range
        i = draw(st.integers(0, num_rows - 1))
        what = draw(st.sampled_from(["neg", "big", "huge", "slot"]))
        if what == "neg":
            accepted[i] = draw(st.sampled_from([-1, -5, -(2**31)]))
        elif what == "big":
            accepted[i] = written - bonus + draw(st.integers(1, 3))
        elif what == "huge":
            accepted[i] = BIG
        elif not identity:
            slots[i] = draw(st.sampled_from([num_slots, num_slots + 7, -3]))
    max_seq = draw(st.integers(0, 12))
    lengths = draw(st.lists(st.integers(0, max_seq), min_size=num_slots, max_size=num_slots))
    return dict(num_slots=num_slots, draft_len=draft_len, written=written, bonus=bonus,
                tensors=tensors, slots=None if identity else slots, accepted=accepted,
                lengths=lengths, max_len=max_seq, with_lengths=draw(st.booleans()),
                misalign=draw(misaligns), seed=draw(st.integers(0, 2**32 - 1)))


def _model_rows(c):
    """``[(slot, kept)]`` of the committing rows and the count of bad ones: the rule, row by
    row."""
    rows, bad = [], 0
    for i, a in enumerate(c["accepted"]):
        s = i if c["slots"] is None else c["slots"][i]
        if s == -1:
            continue
        kept = a + c["bonus"]
        cap = min(c["written"], c["draft_len"])
        if not 0 <= s < c["num_slots"] or a < 0 or kept > cap or \
                (c["with_lengths"] and c["lengths"][s] + kept > c["max_len"]):
            bad += 1
            continue
        rows.append((s, kept))
    return rows, bad


def _state(arena, c, xp):
    pairs = []
    for shape, dt in c["tensors"]:
        draft = arena.array((c["num_slots"] * c["draft_len"], *shape), dt, misalign=c["misalign"])
        pairs.append((draft, arena.array((c["num_slots"], *shape), dt)))
    accepted = arena.int32(c["accepted"]) if c["accepted"] else arena.array((0,), np.int32)
    slots = None if c["slots"] is None else (
        arena.int32(c["slots"]) if c["slots"] else arena.array((0,), np.int32))
    lengths = arena.int32(c["lengths"])
    return pairs, accepted, slots, lengths, arena.array((1,), np.int32, fill="zeros")


def _run(c, pairs, accepted, slots, lengths, status, backend):
    n = len(c["accepted"])
    ops.draft_accept(SlotSet(pairs), c["draft_len"], accepted, n, c["written"],
                     row_to_slot=slots, bonus=c["bonus"],
                     lengths=lengths if c["with_lengths"] else None, max_len=c["max_len"],
                     status=status, backend=backend)
    ops.draft_lengths(lengths, accepted, n, c["written"],
                      c["max_len"] if c["with_lengths"] else BIG, row_to_slot=slots,
                      bonus=c["bonus"], status=status, backend=backend)


@pytest.mark.parametrize("kind", BACKENDS)
@given(c=draft_cases())
def test_draft_accept_and_lengths_match_reference_and_model(kind, c):
    """Random draft buffers, accept counts (0, partial, all, out of range), row maps, bonus
    tokens and lengths: live states, lengths and status equal the reference's, which equal the
    row-by-row model's; nothing outside the buffers is touched."""
    xp, backend = kernel_env(kind)
    ref_arena, k_arena = twins(c["seed"], xp)
    rp, ra, rs, rl, rstat = _state(ref_arena, c, np)
    kp, ka, ks, kl, kstat = _state(k_arena, c, xp)
    expected = [live.copy() for _, live in rp]
    want_lengths = rl.copy()
    rows, bad = _model_rows(c)
    for s, kept in rows:
        want_lengths[s] += kept
        if kept:
            for j, (draft, _) in enumerate(rp):
                expected[j][s] = draft[s * c["draft_len"] + kept - 1]
    drafts_before = [d.copy() for d, _ in rp]
    _run(c, rp, ra, rs, rl, rstat, None)
    _run(c, kp, ka, ks, kl, kstat, backend)
    for (rd, r), (kd, k), e, d0 in zip(rp, kp, expected, drafts_before):
        assert_same_bytes(e, r)
        assert_same_bytes(r, k)
        assert_same_bytes(d0, rd)
        assert_same_bytes(d0, kd)   # the draft buffers are read only
    assert_same_bytes(want_lengths, rl)
    assert_same_bytes(rl, kl)
    assert int(rstat[0]) == int(as_bytes(kstat).view(np.int32)[0]) == 2 * bad
    k_arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_draft_accept_by_hand(kind, dtype):
    """Three slots, drafts of 3 positions, accepted (0, 2, 3) with no bonus and (a bad row)
    with a row map: hand-computed live states and lengths, per dtype."""
    xp, backend = kernel_env(kind)
    dt = resolve_dtype(dtype)
    arena = Arena(np.random.default_rng(3), xp)
    draft = arena.array((9, 4, 5), dt)
    live = arena.array((3, 4, 5), dt)
    before = host(live).copy()
    lengths = arena.int32([4, 5, 6])
    status = arena.array((1,), np.int32, fill="zeros")
    accepted = arena.int32([0, 2, 3])
    ops.draft_accept(SlotSet([(draft, live)]), 3, accepted, 3, 3, lengths=lengths, max_len=8,
                     status=status, backend=backend)
    ops.draft_lengths(lengths, accepted, 3, 3, 8, status=status, backend=backend)
    want = before.copy()
    want[1] = host(draft)[3 + 1]   # slot 1 keeps 2 tokens: draft position 1
    # slot 2: 6 + 3 > 8, out of range: nothing moves, counted by both kernels
    assert np.array_equal(as_bytes(live), as_bytes(want))
    np.testing.assert_array_equal(as_bytes(lengths).view(np.int32), [4, 7, 6])
    assert int(as_bytes(status).view(np.int32)[0]) == 2
    # A row map with the bonus token: row 0 -> slot 2 keeps 1 + 1, row 1 is padding.
    ops.draft_accept(SlotSet([(draft, live)]), 3, int32_on(xp, [1, 2]), 2, 3,
                     row_to_slot=int32_on(xp, [2, -1]), bonus=1, backend=backend)
    want[2] = host(draft)[6 + 1]
    assert np.array_equal(as_bytes(live), as_bytes(want))
    arena.check_canaries()


@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_draft_accept_refuses_bad_arguments(kind):
    """Wrong draft slot counts, written past draft_len, a bonus not 0/1, a list for accepted:
    errors naming the argument, nothing written; reference and kernel alike."""
    xp, backend = kernel_env(kind)
    draft = on(xp, np.arange(12, dtype=np.float32).reshape(6, 2))
    live = xp.zeros((2, 2), np.float32)
    acc = int32_on(xp, [1, 1])
    with pytest.raises(ValueError, match="slots: expected pair 0's draft tensor"):
        ops.draft_accept(SlotSet([(draft, live)]), 2, acc, 2, 2, backend=backend)
    with pytest.raises(ValueError, match="written: expected"):
        ops.draft_accept(SlotSet([(draft, live)]), 3, acc, 2, 4, backend=backend)
    with pytest.raises(ValueError, match="bonus: expected"):
        ops.draft_accept(SlotSet([(draft, live)]), 3, acc, 2, 2, bonus=2, backend=backend)
    with pytest.raises(TypeError, match="accepted: expected a"):
        ops.draft_accept(SlotSet([(draft, live)]), 3, [1, 1], 2, 2, backend=backend)
    with pytest.raises(ValueError, match="accepted: expected 1-D with at least 3"):
        ops.draft_lengths(xp.zeros(3, np.int32), acc, 3, 2, 10, backend=backend)
    assert not as_bytes(live).any()
