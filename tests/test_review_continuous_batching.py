"""Review of ContinuousBatchingKVCacheManager (docs/design.md §5, common error contract): edge
cases.

Oracles: the contract's words (docs/design.md) (a caller mistake raises ``TypeError`` /
``ValueError`` and changes
nothing; committed lengths stay within ``[0, max_seq_len]``; ``stream`` is validated on cpu
too) and hand-computed lengths.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hcache.continuous.manager import (
    BatchInFlightError,
    ContinuousBatchingKVCacheManager,
    KVCacheStaticParams,
)

H, D, S = 1, 2, 8


def make(n=3, s=S, layers=2):
    return ContinuousBatchingKVCacheManager("float32", KVCacheStaticParams(H, D), n, s, layers,
                                            device="cpu")


def state(m):
    live = m.cache_lengths
    return (live, {s: m.block_of(s) for s in live}, m.num_free_blocks, m.in_flight,
            m.blocks_buf.tobytes())


@pytest.mark.parametrize("huge", [[2**63 - 1], np.array([2**63 - 1], dtype=np.int64), [2**70],
                                  np.array([2**64 - 1], dtype=np.uint64),
                                  [np.uint64(2**64 - 1)]])
def test_step_refuses_lengths_that_overflow_int64(huge):
    """3 committed + a huge length is past max_seq_len: ValueError, nothing changes (it used to
    wrap to a negative committed length, or raise OverflowError)."""
    m = make()
    [a] = m.claim(1)
    c = m.fetch([a])
    m.step([3], c)
    coll = m.fetch([a])
    before = state(m)
    with pytest.raises(ValueError, match=r"valid_lengths\[0\]: expected at most 5"):
        m.step(huge, coll)
    assert state(m) == before and m.cache_lengths == {a: 3} and coll.is_active
    m.step([5], coll)
    assert m.cache_lengths == {a: 8}
    m.check_invariants()


def test_int_arguments_refuse_float_arrays():
    """A 0-d float array is not an int: it must not be truncated to one."""
    m = make()
    a, b = m.claim(2)
    before = state(m)
    for call, match in ((lambda: m.fetch([np.array(a + 0.5)]), r"seq_ids\[0\]"),
                        (lambda: m.release(np.array(float(b))), "seq_id"),
                        (lambda: m.block_of(np.array(float(a))), "seq_id"),
                        (lambda: m.claim(np.array(1.5)), "batch_size"),
                        (lambda: m.can_claim(np.array(1.0)), "batch_size"),
                        (lambda: KVCacheStaticParams(np.array(2.5), 4), "num_heads"),
                        (lambda: ContinuousBatchingKVCacheManager(
                            "float32", KVCacheStaticParams(1, 2), np.array(2.0), 4, 1,
                            device="cpu"), "max_batch_size")):
        with pytest.raises(TypeError, match=match):
            call()
        assert state(m) == before
    coll = m.fetch([np.array(a), np.int64(b)])     # 0-d int arrays and numpy ints are ints
    before = state(m)
    for call, match in ((lambda: m.step([np.array(2.7), 0], coll), r"valid_lengths\[0\]"),
                        (lambda: coll.key_cache(np.array(1.0)), "layer"),
                        (lambda: coll.write(np.array(0.0), *[np.zeros((2, 1, H, D),
                                                                      np.float32)] * 2),
                         "layer")):
        with pytest.raises(TypeError, match=match):
            call()
        assert state(m) == before
    m.step([np.array(2), np.int32(1)], coll)
    assert m.cache_lengths == {a: 2, b: 1}


def test_write_validates_stream_on_cpu():
    """docs/design.md §2: the stream is ignored on cpu, but a non-stream is a caller mistake
    (``fetch``
    refuses it on cpu too); nothing is written."""
    m = make()
    [a] = m.claim(1)
    coll = m.fetch([a])
    k = np.ones((1, 2, H, D), np.float32)
    before = state(m)
    with pytest.raises(TypeError, match="stream"):
        coll.write(0, k, k, stream="s")
    assert state(m) == before and not m.blocks_buf.any()
    coll.write(0, k, k, stream=0)
    assert m.blocks_buf[0, :, 0, :2].tolist() == [[[[1.0, 1.0]]] * 2] * 2


def test_fetch_timeout_validated():
    m = make()
    a, b = m.claim(2)
    for held in (False, True):
        coll = m.fetch([a]) if held else None
        before = state(m)
        for bad, exc in (("1", TypeError), (True, TypeError), (-1, ValueError),
                         (float("nan"), ValueError)):
            with pytest.raises(exc, match="timeout"):
                m.fetch([b], wait=True, timeout=bad)
            assert state(m) == before
        if held:
            m.step([0], coll)


def test_fetch_wait_from_a_thread_that_reuses_the_owner_ident():
    """The batch's owner thread exited; a new thread that got the same (recycled) thread id
    does not hold the batch, so ``fetch(wait=True)`` must wait (here: time out), not refuse at
    once as if it were the owner."""
    m = make()
    a, b = m.claim(2)
    owner = []

    def hold():
        owner.append(threading.get_ident())
        m.fetch([a])

    t = threading.Thread(target=hold)
    t.start()
    t.join()
    outcome = []

    def waiter():
        if threading.get_ident() != owner[0]:
            return
        try:
            m.fetch([b], wait=True, timeout=0.05)
        except BatchInFlightError as exc:
            outcome.append(str(exc))

    for _ in range(50):
        t = threading.Thread(target=waiter)
        t.start()
        t.join()
        if outcome:
            break
    if not outcome:
        pytest.skip("this platform did not recycle the thread id")
    assert "within" in outcome[0], outcome[0]       # timed out waiting, not refused as owner
    assert m.in_flight is not None and m.in_flight.seq_ids == (a,)
