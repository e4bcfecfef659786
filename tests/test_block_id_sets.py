"""The np.unique stand-in for a step's block ids (hcache/contexts/block_id_sets.py) against
np.unique itself."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given

from hcache.contexts.block_id_sets import counted

ids = st.lists(st.integers(0, 40), max_size=30).map(lambda xs: np.array(xs, np.int64))


@given(ids)
def test_counted_is_unique_with_counts(a):
    uniq, counts = counted(a)
    want_uniq, want_counts = np.unique(a, return_counts=True)
    assert uniq.tolist() == want_uniq.tolist() and counts.tolist() == want_counts.tolist()

