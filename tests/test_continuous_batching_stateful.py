"""Stateful test of ContinuousBatchingKVCacheManager against a dict-and-bytes model.

Rules cover every command (claim, fetch, write, step, release) and the calls the manager must
refuse (capacity, unknown/duplicate/released ids, a second fetch, overflowing writes and steps,
wrong length counts, ended collections, in-flight releases); a refused call must leave the whole
observable state unchanged. After every step: ``check_invariants()`` and a full comparison with
the model (lengths, block of each id, free count, every byte of ``blocks_buf``).
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hcache.continuous.manager import (
    BatchInFlightError,
    ContinuousBatchingKVCacheManager,
    KVCacheStaticParams,
)
from hcache.errors import CacheCapacityError

N, S, L, H, D = 4, 6, 2, 2, 3


def raw_bytes(m) -> np.ndarray:
    b = np.ascontiguousarray(m.blocks_buf)
    return b.view(np.uint8).reshape(*b.shape[:-1], -1).copy()


class ContinuousBatchingMachine(RuleBasedStateMachine):
    @initialize(dtype=st.sampled_from(["bfloat16", "uint8", "float32"]))
    def setup(self, dtype):
        self.m = ContinuousBatchingKVCacheManager(dtype, KVCacheStaticParams(H, D), N, S, L,
                                                  device="cpu")
        self.itemsize = self.m.blocks_buf.dtype.itemsize
        self.lengths: dict[int, int] = {}       # live seq_id -> committed tokens
        self.block: dict[int, int] = {}         # live seq_id -> block
        self.free = set(range(N))
        self.issued: set[int] = set()           # every id ever handed out
        self.expected = np.zeros_like(raw_bytes(self.m))
        self.batch = None                       # (collection, seq_ids) in flight
        self.ended = None                       # the last stepped collection

    # --- helpers ----------------------------------------------------------------------------

    def snapshot(self):
        m = self.m
        return (m.cache_lengths, {s: m.block_of(s) for s in m.cache_lengths}, m.num_free_blocks,
                m.in_flight, raw_bytes(m).tobytes())

    def refused(self, exc, call, match=None):
        before = self.snapshot()
        try:
            call()
        except exc as e:
            assert match is None or match in str(e), str(e)
        else:
            raise AssertionError(f"expected {exc.__name__}")
        assert self.snapshot() == before

    def rows(self, data, batch, t):
        # random bytes from a drawn seed (st.binary shrinks to zeros, which hide misplacement)
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        raw = rng.integers(1, 256, size=(batch, t, H, D * self.itemsize), dtype=np.uint8)
        return raw.view(self.m.blocks_buf.dtype).copy(), raw

    # --- commands ---------------------------------------------------------------------------

    @rule(n=st.integers(0, N + 1))
    def claim(self, n):
        if n > len(self.free):
            self.refused(CacheCapacityError, lambda: self.m.claim(n))
            return
        ids = self.m.claim(n)
        assert len(ids) == n and not set(ids) & self.issued and len(set(ids)) == n
        for sid, block in zip(ids, sorted(self.free)[:n], strict=True):   # lowest blocks first
            assert self.m.block_of(sid) == block
            self.block[sid], self.lengths[sid] = block, 0
            self.free.discard(block)
        self.issued |= set(ids)

    @precondition(lambda self: self.batch is None and self.lengths)
    @rule(data=st.data())
    def fetch(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.lengths)), min_size=1,
                                 unique=True))
        coll = self.m.fetch(ids)
        assert coll.seq_ids == tuple(ids)
        assert coll.lookup_table.tolist() == [self.block[s] for s in ids]
        assert coll.cache_lengths.tolist() == [self.lengths[s] for s in ids]
        self.batch = (coll, ids)

    @precondition(lambda self: self.batch is not None)
    @rule(layer=st.integers(0, L - 1), t=st.integers(0, 3), data=st.data())
    def write(self, layer, t, data):
        coll, ids = self.batch
        k, kb = self.rows(data, len(ids), t)
        v, vb = self.rows(data, len(ids), t)
        if any(self.lengths[s] + t > S for s in ids):
            self.refused(ValueError, lambda: coll.write(layer, k, v), "new tokens")
            return
        coll.write(layer, k, v)
        for i, sid in enumerate(ids):
            for j in range(t):
                self.expected[self.block[sid], 0, layer, self.lengths[sid] + j] = kb[i, j]
                self.expected[self.block[sid], 1, layer, self.lengths[sid] + j] = vb[i, j]

    @precondition(lambda self: self.batch is not None)
    @rule(data=st.data())
    def step(self, data):
        coll, ids = self.batch
        valid = data.draw(st.lists(st.integers(0, S), min_size=len(ids), max_size=len(ids)))
        if any(self.lengths[s] + n > S for s, n in zip(ids, valid, strict=True)):
            self.refused(ValueError, lambda: self.m.step(valid, coll), "valid_lengths")
            return
        self.m.step(valid, coll)
        for sid, n in zip(ids, valid, strict=True):
            self.lengths[sid] += n
        self.batch, self.ended = None, coll
        assert not coll.is_active

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def release(self, data):
        sid = data.draw(st.sampled_from(sorted(self.lengths)))
        if self.batch is not None and sid in self.batch[1]:
            self.refused(ValueError, lambda: self.m.release(sid), "in flight")
            return
        self.m.release(sid)
        self.free.add(self.block.pop(sid))
        del self.lengths[sid]

    # --- rejected calls ---------------------------------------------------------------------

    @precondition(lambda self: self.batch is not None and self.lengths)
    @rule(data=st.data())
    def second_fetch(self, data):
        sid = data.draw(st.sampled_from(sorted(self.lengths)))
        self.refused(BatchInFlightError, lambda: self.m.fetch([sid]), "in flight")

    @precondition(lambda self: self.batch is None)
    @rule(data=st.data())
    def fetch_bad_ids(self, data):
        dead = sorted(self.issued - set(self.lengths)) + [len(self.issued) + 5, -1]
        bad = data.draw(st.sampled_from(dead))
        live = sorted(self.lengths)
        self.refused(ValueError, lambda: self.m.fetch(live + [bad]), "unknown")
        if live:
            self.refused(ValueError, lambda: self.m.fetch([live[0], live[0]]), "distinct")

    @precondition(lambda self: self.batch is not None)
    @rule(extra=st.sampled_from([-1, 1]))
    def step_wrong_count(self, extra):
        coll, ids = self.batch
        self.refused(ValueError, lambda: self.m.step([0] * (len(ids) + extra), coll),
                     "lengths")

    @precondition(lambda self: self.ended is not None)
    @rule()
    def use_ended_collection(self):
        coll = self.ended
        n = coll.batch_size
        z = np.zeros((n, 1, H, D), dtype=self.m.blocks_buf.dtype)
        self.refused(ValueError, lambda: coll.write(0, z, z), "ended")
        self.refused(ValueError, lambda: self.m.step([0] * n, coll), "ended")

    @rule(sid=st.integers(-2, 40))
    def release_unknown(self, sid):
        if sid not in self.lengths:
            self.refused(ValueError, lambda: self.m.release(sid), "live sequence")

    # --- checks -----------------------------------------------------------------------------

    @invariant()
    def matches_model(self):
        m = self.m
        m.check_invariants()
        assert m.cache_lengths == self.lengths
        assert {s: m.block_of(s) for s in self.lengths} == self.block
        assert m.num_free_blocks == len(self.free) == N - m.num_live_sequences
        assert m.in_flight is (self.batch[0] if self.batch else None)
        np.testing.assert_array_equal(raw_bytes(m), self.expected)


ContinuousBatchingMachine.TestCase.settings = settings(ContinuousBatchingMachine.TestCase.settings,
                                                       stateful_step_count=30)
TestContinuousBatchingMachine = ContinuousBatchingMachine.TestCase
