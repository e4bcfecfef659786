"""Thread safety of ContinuousBatchingKVCacheManager (docs/design.md §5).

Design under test: one batch in flight, shared by all threads. A thread whose ``fetch`` meets
another thread's batch either retries on :class:`BatchInFlightError` or waits with
``fetch(wait=True)``; both kinds of thread run together here. The test records the owner of
every block in its own dict under its own lock: a block handed to two live sequences, an id
handed out twice, a lost or foreign token in a thread's blocks, a leaked block or a broken
invariant fails the test.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

import numpy as np
import pytest

from hcache.continuous.manager import (
    BatchInFlightError,
    ContinuousBatchingKVCacheManager,
    KVCacheStaticParams,
)
from hcache.errors import CacheCapacityError

THREADS, BLOCKS, S, L, H, D = 8, 8, 12, 2, 2, 4
DEADLINE_S = 60.0


@pytest.fixture
def fast_switching():
    """Switch threads often, so that more interleavings of the bookkeeping occur."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


def run_threads(target, n):
    errors: list[str] = []
    barrier = threading.Barrier(n)

    def wrapped(tid):
        try:
            barrier.wait()
            target(tid)
        except BaseException:   # noqa: BLE001 - reported to the main thread below
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[0]


class Ledger:
    """The test's own record of which live sequence holds which block."""

    def __init__(self):
        self.lock = threading.Lock()
        self.owner: dict[int, tuple[int, int]] = {}    # block -> (thread, seq_id)
        self.issued: set[int] = set()
        self.claims = 0
        self.busy = 0                                   # refused fetches and claims

    def take(self, tid, ids, blocks):
        with self.lock:
            assert not set(ids) & self.issued, f"seq_ids {ids} handed out twice"
            self.issued |= set(ids)
            self.claims += len(ids)
            for sid, block in zip(ids, blocks, strict=True):
                assert block not in self.owner, \
                    f"block {block} given to {sid} while {self.owner[block]} holds it"
                self.owner[block] = (tid, sid)

    def drop(self, tid, ids, blocks):
        with self.lock:
            for sid, block in zip(ids, blocks, strict=True):
                assert self.owner.pop(block) == (tid, sid)


def claim(m, ledger, tid, k):
    end = time.monotonic() + DEADLINE_S
    while True:
        try:
            ids = m.claim(k)
        except CacheCapacityError as exc:
            assert exc.required == k and 0 <= exc.available < k
            with ledger.lock:
                ledger.busy += 1
            assert time.monotonic() < end, "claim starved"
            time.sleep(0)
            continue
        blocks = [m.block_of(s) for s in ids]
        ledger.take(tid, ids, blocks)
        return ids, blocks


def fetch(m, ledger, ids, wait):
    if wait:
        return m.fetch(ids, wait=True, timeout=DEADLINE_S)
    end = time.monotonic() + DEADLINE_S
    while True:
        try:
            return m.fetch(ids)
        except BatchInFlightError:
            with ledger.lock:
                ledger.busy += 1
            assert time.monotonic() < end, "fetch starved"
            time.sleep(0)


def test_threads_never_share_a_block(fast_switching):
    m = ContinuousBatchingKVCacheManager("float32", KVCacheStaticParams(H, D), BLOCKS, S, L,
                                         device="cpu")
    ledger = Ledger()
    stop = threading.Event()
    audits = []

    def auditor():
        while not stop.is_set():
            m.check_invariants()
            audits.append(1)
            time.sleep(0.001)

    def worker(tid):
        wait = tid % 2 == 0
        for cycle in range(200):
            k = 1 + (cycle + tid) % 2
            ids, blocks = claim(m, ledger, tid, k)
            lengths = np.zeros(k, dtype=np.int64)
            for new in (3, 1, 2):         # prompt, then two decode steps
                coll = fetch(m, ledger, ids, wait)
                assert coll.lookup_table.tolist() == blocks
                assert coll.cache_lengths.tolist() == lengths.tolist()
                # token value: seq_id * S + position, so a foreign or misplaced row shows
                pos = lengths[:, None] + np.arange(new)[None, :]
                val = np.array(ids)[:, None] * S + pos
                key = np.broadcast_to(val[:, :, None, None], (k, new, H, D)).astype(np.float32)
                for layer in range(L):
                    coll.write(layer, key, -key - layer)
                m.step([new] * k, coll)
                lengths += new
            for sid, block, n in zip(ids, blocks, lengths, strict=True):
                want = (sid * S + np.arange(n))[:, None, None]
                got = m.blocks_buf[block, :, :, :n]            # [2, L, n, H, D]
                assert (got[0] == want).all(), f"thread {tid}: keys of seq {sid} corrupted"
                for layer in range(L):
                    assert (got[1, layer] == -want - layer).all()
            ledger.drop(tid, ids, blocks)
            for sid in ids:
                m.release(sid)

    audit = threading.Thread(target=auditor)
    audit.start()
    try:
        run_threads(worker, THREADS)
    finally:
        stop.set()
        audit.join()
    assert ledger.claims == len(ledger.issued) == THREADS * 300   # 200 cycles of 1 or 2 seqs
    assert not ledger.owner and audits
    assert m.num_free_blocks == BLOCKS and m.num_live_sequences == 0
    assert m.in_flight is None and m.cache_lengths == {}
    m.check_invariants()
    assert m.claim(BLOCKS) and m.num_free_blocks == 0     # nothing leaked


def test_concurrent_claim_release_storm(fast_switching):
    """Claim/release only (no batch in flight): the all-or-nothing claim under contention."""
    m = ContinuousBatchingKVCacheManager("uint8", KVCacheStaticParams(1, 1), 12, 4, 1,
                                         device="cpu")
    ledger = Ledger()

    def worker(tid):
        rng = np.random.default_rng(tid)
        for _ in range(400):
            ids, blocks = claim(m, ledger, tid, int(rng.integers(1, 4)))
            assert m.num_free_blocks >= 0
            ledger.drop(tid, ids, blocks)
            for sid in ids:
                m.release(sid)

    run_threads(worker, THREADS)
    assert not ledger.owner and len(ledger.issued) == ledger.claims
    assert m.num_free_blocks == 12 and m.num_live_sequences == 0
    m.check_invariants()


def test_waiters_are_served_one_batch_at_a_time():
    """Many threads block in ``fetch(wait=True)``; each gets the slot only after a step."""
    m = ContinuousBatchingKVCacheManager("float16", KVCacheStaticParams(1, 2), THREADS, 8, 1,
                                         device="cpu")
    ids = m.claim(THREADS)
    inside = []
    lock = threading.Lock()

    def worker(tid):
        coll = m.fetch([ids[tid]], wait=True, timeout=DEADLINE_S)
        with lock:
            inside.append(tid)
            assert len(inside) == 1, f"two batches in flight: {inside}"
        time.sleep(0.002)
        with lock:
            inside.remove(tid)
        m.step([tid % 3], coll)

    run_threads(worker, THREADS)
    assert m.cache_lengths == {s: i % 3 for i, s in enumerate(ids)}
    m.check_invariants()


def test_threads_never_share_a_block_or_a_state(fast_switching):
    """The hybrid manager (Nemotron-H layout: attention K/V and Mamba-2 recurrent and conv
    states per block) under the same 8-thread load: a claimed block's states are zero, and every
    thread finds exactly its own K/V and states in its blocks after its batches."""
    from hcache import ContinuousBatchingHybridCacheManager, HybridCacheConfig
    from hcache.demo.run import NEMOTRON_H_CONFIG

    config = HybridCacheConfig.from_hf_config(NEMOTRON_H_CONFIG, max_batch_size=BLOCKS,
                                              max_sequence_length=S, kv_dtype="float32",
                                              conv_dtype="float32")
    m = ContinuousBatchingHybridCacheManager(config, device="cpu")
    attention = [i for i, t in enumerate(config.layer_types) if t.has_attention]
    recurrent = [i for i, t in enumerate(config.layer_types) if t.has_mamba]
    kv_shape = m.get_combined_kv_cache(attention[0]).shape   # [blocks, 2, H, S, D]
    rec_shape = m.get_recurrent_state(recurrent[0]).shape[1:]
    conv_shape = m.get_conv_state(recurrent[0]).shape[1:]
    ledger = Ledger()
    stop = threading.Event()
    audits = []

    def auditor():
        while not stop.is_set():
            m.check_invariants()
            audits.append(1)
            time.sleep(0.001)

    def worker(tid):
        wait = tid % 2 == 0
        for cycle in range(60):
            k = 1 + (cycle + tid) % 2
            ids, blocks = claim(m, ledger, tid, k)
            for i in recurrent:
                assert not m.get_recurrent_state(i)[blocks].any(), "a claimed state is not zero"
                assert not m.get_conv_state(i)[blocks].any()
            lengths = np.zeros(k, dtype=np.int64)
            for step, new in enumerate((3, 1, 2)):
                coll = fetch(m, ledger, ids, wait)
                assert coll.lookup_table.tolist() == blocks
                pos = lengths[:, None] + np.arange(new)[None, :]
                val = (np.array(ids)[:, None] * S + pos).astype(np.float32)
                key = np.ascontiguousarray(np.broadcast_to(
                    val[:, :, None, None], (k, new) + (kv_shape[2], kv_shape[4])))
                coll.write_kv(None, [key] * len(attention), [-key] * len(attention))
                tag = (np.array(ids) * 10 + step).astype(np.float32)
                coll.write_states(
                    None, [np.ascontiguousarray(np.broadcast_to(
                        (tag + r)[:, None, None, None], (k,) + rec_shape))
                        for r in range(len(recurrent))],
                    [np.ascontiguousarray(np.broadcast_to(
                        -(tag + r)[:, None, None], (k,) + conv_shape))
                        for r in range(len(recurrent))])
                m.step([new] * k, coll)
                lengths += new
            for sid, block, n in zip(ids, blocks, lengths, strict=True):
                want = (sid * S + np.arange(n))[None, :, None]
                for i in attention:
                    got = m.get_combined_kv_cache(i)[block, :, :, :n]   # [2, H, n, D]
                    assert (got[0] == want).all(), f"thread {tid}: keys of seq {sid} corrupted"
                    assert (got[1] == -want).all()
                for r, i in enumerate(recurrent):
                    assert (m.get_recurrent_state(i)[block] == sid * 10 + 2 + r).all(), \
                        f"thread {tid}: recurrent state of seq {sid} corrupted"
                    assert (m.get_conv_state(i)[block] == -(sid * 10 + 2 + r)).all()
            ledger.drop(tid, ids, blocks)
            for sid in ids:
                m.release(sid)

    audit = threading.Thread(target=auditor)
    audit.start()
    try:
        run_threads(worker, THREADS)
    finally:
        stop.set()
        audit.join()
    assert ledger.claims == len(ledger.issued) == THREADS * 90   # 60 cycles of 1 or 2 seqs
    assert not ledger.owner and audits
    assert m.num_free_blocks == BLOCKS and m.num_live_sequences == 0 and m.in_flight is None
    m.check_invariants()
