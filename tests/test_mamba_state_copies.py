"""MambaStateCopies on the host (docs/design.md §8): a copy direction is one gather per kind
of state over all layers, on record views of the state arrays. Oracle: the ``slot_copy`` op's
NumPy reference over the same SlotSet."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mamba_slot_allocator import make

from hcache.ops import reference as ref
from hcache.ops.tables import SlotSet


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_host_copies_match_the_slot_copy_op(data):
    # On the host a copy direction is one gather per kind of state; the op over the same
    # SlotSet (its NumPy reference) is the oracle, for one pair and for several.
    _, kv, alloc = make(max_slots=6)
    copies = alloc._copies
    for k, state in enumerate((copies.conv_states, copies.ssm_states, *copies._live,
                               *copies._scratch)):     # every source distinct, nonzero
        state[...] = (np.arange(state.size).reshape(state.shape) * 3 + 11 * k) % 97 + 1
    direction = data.draw(st.sampled_from(["live_to_cache", "cache_to_live",
                                           "scratch_to_cache"]))
    pairs = getattr(copies, "_" + direction)
    src_n, dst_n = pairs.pairs[0][0].shape[0], pairs.pairs[0][1].shape[0]
    n = data.draw(st.integers(1, min(src_n, dst_n)))
    src = data.draw(st.lists(st.integers(0, src_n - 1), min_size=n, max_size=n))
    dst = data.draw(st.lists(st.integers(0, dst_n - 1), min_size=n, max_size=n, unique=True))
    expected = [d.copy() for _, d in pairs.pairs]
    twin = SlotSet([(s, e) for (s, _), e in zip(pairs.pairs, expected)])
    ref.slot_copy(twin, np.array(src, np.int32), np.array(dst, np.int32))
    copies._copy(direction, src, dst, 0, None)
    for (_, got), want in zip(pairs.pairs, expected):
        np.testing.assert_array_equal(got, want)
