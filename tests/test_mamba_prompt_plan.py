"""The admission's trusted boundary plan (``IntermediateStates.plan_prompt``, issue 24) against
the checked ``plan`` it stands in for: the same entries, the same refusal."""

from types import SimpleNamespace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from hcache.contexts.mamba_intermediate import IntermediateStates
from hcache.runtime.device import Device

ROWS, WIDTH = 3, 40


def _states():
    return IntermediateStates(Device("cpu"), 1, ROWS, (2,), (3,), np.float32, np.float32)


def _tracking(inter):
    return (inter.offsets.copy(), inter.block_ids.copy(), inter.counts.copy(),
            inter.eos_block_ids.copy(), inter.pending)


@st.composite
def admissions(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    align = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if bs % d == 0]))
    n = draw(st.integers(1, (WIDTH - 1) * bs))
    required = -(-n // bs)
    matched = draw(st.integers(0, n // bs))
    skip = draw(st.integers(0, n - 1))
    table = np.full((ROWS, WIDTH), -1, np.int32)
    row = draw(st.integers(0, ROWS - 1))
    table[row, :required] = draw(st.permutations(range(100, 100 + required)))
    hole = draw(st.none() | st.integers(0, required - 1))    # a boundary without a block
    if hole is not None:
        table[row, hole] = -1
    return bs, align, n, required, matched, skip, table, row


@given(admissions(), st.booleans())
def test_plan_prompt_is_plan_of_a_whole_prompt(case, earlier):
    bs, align, n, required, matched, skip, table, row = case
    checked, trusted = _states(), _states()
    if earlier:     # an uncommitted entry of another row, and one of this row, stay or go alike
        for inter in (checked, trusted):
            inter.offsets[row], inter.block_ids[row], inter.counts[row] = [1, 0, 0], [7, -1, -1], 1
            inter.eos_block_ids[(row + 1) % ROWS] = 9
            inter.pending = True
    extra = n // bs * bs - bs
    req = SimpleNamespace(prompt_length=n, finished_chunk_token_count=0)
    outcomes = []
    for run in (lambda: checked.plan(row, req, skip, n, matched, table[row, :matched].tolist(),
                                     required, block_table=table, block_size=bs,
                                     chunk_size=align, extra_boundaries=(extra,)),
                lambda: trusted.plan_prompt(row, table[row], skip, n, matched, required, extra,
                                            bs, align)):
        try:
            run()
            outcomes.append(None)
        except ValueError as e:
            outcomes.append(str(e))
    assert outcomes[0] == outcomes[1]
    for a, b in zip(_tracking(checked), _tracking(trusted)):
        np.testing.assert_array_equal(a, b)
    assert not checked.broken_invariants()


def test_plan_prompt_hand_computed():
    """Block 4, a 12-token prompt with 1 block matched, skip 4: boundaries 4 (the divergence),
    12 (the last boundary, the EOS entry), 8 (the last block's start) and 8 (the extra):
    offsets from the chunk start 4 are 4 (block column 1); the EOS entry is column 2."""
    inter = _states()
    table = np.full((ROWS, WIDTH), -1, np.int32)
    table[1, :3] = [50, 51, 52]
    inter.plan_prompt(1, table[1], 4, 12, 1, 3, 8, 4, 4)
    assert inter.offsets[1].tolist() == [4, 0, 0]
    assert inter.block_ids[1].tolist() == [51, -1, -1]
    assert inter.counts.tolist() == [0, 1, 0]
    assert inter.eos_block_ids.tolist() == [-1, 52, -1]
    assert inter.pending


def test_plan_refuses_an_extra_boundary_inside_a_block_and_changes_nothing():
    """A state belongs to the end of a block: a boundary at position 3 (block 4) would have
    been kept as block column -1, the row's last block. It is refused, nothing changed."""
    inter = _states()
    table = np.full((ROWS, WIDTH), -1, np.int32)
    table[0, :3] = [100, 101, 102]
    before = _tracking(inter)
    req = SimpleNamespace(prompt_length=12, finished_chunk_token_count=0)
    try:
        inter.plan(0, req, 0, 12, 0, [], 3, block_table=table, block_size=4, chunk_size=1,
                   extra_boundaries=(8, 3))
    except ValueError as e:
        assert str(e) == "extra_boundaries: expected multiples of block_size 4, got 3"
    else:
        raise AssertionError("a boundary inside a block was accepted")
    for a, b in zip(before, _tracking(inter)):
        np.testing.assert_array_equal(a, b)
