"""The ``lengths`` family (kernels/lengths.cu, hcache/ops/lengths.py): ``lengths_add``.

Oracle: a direct model of the all-or-nothing commit (refused whole, and counted once, when any
increment is negative or any result would pass ``max_len``). The kernel runs on the host
emulation of the real ``.cu`` (``emu``, ``emu-reverse``) and on CuPy (``gpu`` tier); the NumPy
reference is checked against hand-computed results and, for argument checks, alongside.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hcache import ops

from kernel_cases import BACKENDS, WITH_REFERENCE, Arena, as_bytes, int32_on, kernel_env, on


@pytest.mark.parametrize("kind", BACKENDS)
@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=8),
       inc=st.one_of(st.integers(-5, 8), st.lists(st.integers(-5, 8), min_size=8, max_size=8)),
       n=st.integers(0, 8), max_len=st.integers(0, 25), seed=st.integers(0, 2**16))
def test_lengths_add_is_all_or_nothing(kind, lengths, inc, n, max_len, seed):
    """Random lengths, scalar or array increments and caps: the kernel's lengths and status
    equal the all-or-nothing model's."""
    xp, backend = kernel_env(kind)
    n = min(n, len(lengths))
    arena = Arena(np.random.default_rng(seed), xp)
    cur = arena.array((len(lengths),), np.int32)
    cur[...] = on(xp, np.asarray(lengths, np.int32))
    status = arena.array((1,), np.int32, fill="zeros")
    if isinstance(inc, list):
        increment = arena.array((8,), np.int32)
        increment[...] = on(xp, np.asarray(inc, np.int32))
        delta = np.asarray(inc[:n])
    else:
        increment, delta = inc, inc
    want = np.asarray(lengths, np.int64)
    nxt = want[:n] + delta
    refused = n > 0 and bool(((np.asarray(delta) < 0) | (nxt > max_len)).any())
    if not refused:
        want[:n] = nxt
    ops.lengths_add(cur, n, increment, max_len, status=status, backend=backend)
    assert as_bytes(cur).view(np.int32).tolist() == want.tolist()
    assert int(status[0]) == int(refused)
    arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 2600), bad=st.one_of(st.none(), st.integers(0, 2599)),
       scalar=st.booleans(), seed=st.integers(0, 2**16))
def test_lengths_add_of_a_large_batch_is_all_or_nothing(kind, n, bad, scalar, seed):
    """Batches past one thread per entry (the block's threads stride, up to 2600 entries) with
    at most one offending entry anywhere (a negative increment, or a length that passes
    max_len): the whole batch is refused and counted once, or every entry is updated."""
    xp, backend = kernel_env(kind)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 1000, n).astype(np.int32)
    inc = rng.integers(0, 5, n).astype(np.int32)
    max_len = 2000
    if bad is not None and bad < n:
        if scalar or rng.integers(2):
            lengths[bad] = max_len
        else:
            inc[bad] = -1
    increment = 1 if scalar else on(xp, inc)
    delta = 1 if scalar else inc
    cur = on(xp, lengths.copy())
    status = xp.zeros(1, np.int32)
    nxt = lengths.astype(np.int64) + delta
    refused = bool(((np.asarray(delta) < 0) | (nxt > max_len)).any())
    ops.lengths_add(cur, n, increment, max_len, status=status, backend=backend)
    want = lengths if refused else nxt
    assert as_bytes(cur).view(np.int32).tolist() == want.tolist()
    assert int(as_bytes(status).view(np.int32)[0]) == int(refused)


def test_lengths_add_refuses_overflow_whole():
    """Reference lengths_add against hand-computed lengths and status: an overflowing or
    negative commit changes nothing and is counted once."""
    lengths = np.array([3, 9], np.int32)
    status = np.zeros(1, np.int32)
    ops.lengths_add(lengths, 2, 1, 9, status=status)
    assert lengths.tolist() == [3, 9] and status[0] == 1
    ops.lengths_add(lengths, 2, np.array([2, 0], np.int32), 9, status=status)
    assert lengths.tolist() == [5, 9] and status[0] == 1
    ops.lengths_add(lengths, 2, np.array([1, -1], np.int32), 9, status=status)  # no rollback
    assert lengths.tolist() == [5, 9] and status[0] == 2


@pytest.mark.parametrize("kind", WITH_REFERENCE)
@pytest.mark.parametrize("n,increment,max_len,exc", [
    (-1, 1, 10, ValueError),              # reference sliced lengths[:-1]; kernel did nothing
    (2, 2**31, 10, ValueError),           # kernel path: OverflowError; reference: refused
    (2, -(2**31) - 1, 10, ValueError),
    (2, 1, 2**31, ValueError),            # kernel path: OverflowError
    (2, 1.5, 10, TypeError),              # reference treated it as an array
    (2, True, 10, TypeError),
    (True, 1, 10, TypeError),
])
def test_lengths_add_validates_its_scalars_before_anything(kind, n, increment, max_len, exc):
    """Bad scalars (out of range, float, bool) raise the same exception on every path, before
    the lengths or the status change."""
    xp, backend = kernel_env(kind)
    lengths = int32_on(xp, [1, 2, 3])
    status = xp.zeros(1, np.int32)
    with pytest.raises(exc):
        ops.lengths_add(lengths, n, increment, max_len, status=status, backend=backend)
    assert as_bytes(lengths).view(np.int32).tolist() == [1, 2, 3]
    assert int(as_bytes(status).view(np.int32)[0]) == 0
