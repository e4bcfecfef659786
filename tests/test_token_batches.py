"""The ragged column arithmetic of the context's batched calls (hcache/contexts/token_batches.py)
against a loop over the entries."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given

from hcache.contexts.token_batches import ragged_columns


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 6)), min_size=1, max_size=8))
def test_ragged_columns_lays_each_entry_out_in_order(entries):
    starts = np.array([s for s, _ in entries], np.int64)
    counts = np.array([c for _, c in entries], np.int64)
    which, cols = ragged_columns(starts, counts)
    want = [(i, s + k) for i, (s, c) in enumerate(entries) for k in range(c)]
    assert list(zip(which.tolist(), cols.tolist())) == want
    assert which.dtype.kind == cols.dtype.kind == "i"
