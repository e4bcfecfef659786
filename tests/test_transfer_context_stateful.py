"""Context handoffs under any sequence of exports, pulls (some while the receiver runs steps of
other requests), releases by the exporter, cancels and decode steps (hypothesis
RuleBasedStateMachine).

Oracle: the exporter's bytes of each request at export (its K/V rows gathered through its block
table and its live states), the receiver's own bytes of the prefix its cache held, and the
receiver's allocator counts and hash map before every pull that fails; the contexts' own
``check_invariants`` after every rule. Two engines (NIXL agents on loopback) are made once for
the module; every example starts from reset contexts.
"""

from __future__ import annotations

import time

import context_peer as cp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_transfer_context import counts, live, rows

from hcache.transfer import (
    ContextTransferEngine,
    TransferAborted,
    TransferCancelled,
    nixl_available,
)

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed "
                                "(pip install --no-deps nixl-cu12)")

_engines = {}
_ids = iter(range(10**9))
PREFIXES = [list(range(10, 18)), list(range(30, 38))]     # two blocks of 4 / one of 8


def engines():
    if not _engines:
        src, dst = cp.context("hybrid", num_blocks=48), cp.context("hybrid", block_size=8,
                                                                  blocks_per=6, num_blocks=20)
        a = ContextTransferEngine(src, "csm-src", timeout_s=120)
        b = ContextTransferEngine(dst, "csm-dst", timeout_s=120)
        a.connect(b.metadata)
        b.connect(a.metadata)
        _engines.update(src=src, dst=dst, a=a, b=b)
    e = _engines
    return e["src"], e["dst"], e["a"], e["b"]


def wait_until(predicate, seconds=3.0):
    end = time.monotonic() + seconds
    while not predicate() and time.monotonic() < end:
        time.sleep(0.005)
    return predicate()


class ContextHandoffs(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.src, self.dst, self.a, self.b = engines()
        for r in list(self.a.pending_exports):
            self.a.release_export(r)
        self.src.reset()
        self.dst.reset()
        self.rng = np.random.default_rng(next(_ids))
        self.exports = {}     # rid -> (handle, bytes at export)
        self.live = []        # requests live on the receiver

    def _compute(self, ctx, step):
        """Random K/V for the step's own positions and a random live state (no model)."""
        n = step.end - step.start
        for a, layer in enumerate(ctx.kv_pool.layers):
            k = self.rng.standard_normal((n, *layer.shape[2:3], layer.shape[4])).astype(
                np.float32)
            ctx.write_kv([step.request_id], k, k + 1, layer=a)
        for states in (ctx.mamba_conv_states, ctx.mamba_ssm_states):
            states[:, step.mamba_slot] = self.rng.standard_normal(
                states[:, step.mamba_slot].shape).astype(np.float32)

    @precondition(lambda self: len(self.exports) < self.src.max_requests)
    @rule(prefix=st.sampled_from([0, 1]), tail=st.integers(1, 9))
    def export(self, prefix, tail):
        rid = f"csm{next(_ids)}"
        tokens = PREFIXES[prefix] + self.rng.integers(0, 50, tail).tolist()
        step = self.src.add_request(rid, tokens)
        self._compute(self.src, step)
        self.src.commit_step()
        handle = self.a.export(rid)
        self.exports[rid] = (handle, ([x.tobytes() for x in rows(self.src, rid)],
                                      [x.tobytes() for x in live(self.src, rid)]))

    def _pull_checked(self, rid, pending):
        handle, (kv, states) = self.exports[rid]
        t0 = pending.num_matched_blocks * self.dst.block_size_tokens
        own = [x.tobytes() for x in rows(self.dst, rid, 0, t0)]
        pending.wait()
        assert [x.tobytes() for x in rows(self.dst, rid, 0, t0)] == own
        src_rows = [np.frombuffer(b, np.float32).reshape(-1, *x.shape[1:])
                    for b, x in zip(kv, rows(self.dst, rid), strict=True)]
        assert [x.tobytes() for x in rows(self.dst, rid, t0)] == [
            x[t0:].tobytes() for x in src_rows]
        assert [x.tobytes() for x in live(self.dst, rid)] == states
        assert wait_until(lambda: self.a.export_state(rid) == "done")
        self.a.release_export(rid)
        self.src.release_requests([rid])
        del self.exports[rid]
        self.live.append(rid)

    @precondition(lambda self: self.exports and len(self.live) < 2)
    @rule(data=st.data())
    def pull(self, data):
        rid = data.draw(st.sampled_from(sorted(self.exports)))
        self._pull_checked(rid, self.b.begin_pull(self.exports[rid][0]))

    @precondition(lambda self: self.exports and len(self.live) == 1)
    @rule(data=st.data())
    def pull_during_a_step(self, data):
        """The receiver's other request runs a step while the pull is in flight: its commit
        leaves the parked request alone."""
        rid = data.draw(st.sampled_from(sorted(self.exports)))
        pending = self.b.begin_pull(self.exports[rid][0])
        other = self.live[0]
        step = self.dst.extend_request(other, [int(self.rng.integers(0, 50))])
        self._compute(self.dst, step)
        self.dst.commit_step()
        requests = self.dst._requests
        row = requests.row(rid)
        assert requests.parked[row] and requests.computed[row] < requests.lengths[row]
        new = self.dst.block_ids(rid)[pending.num_matched_blocks:]
        assert (self.dst.kv_block_allocator.block_hashes[new] == -1).all()   # none registered
        self._pull_checked(rid, pending)

    @precondition(lambda self: self.exports)
    @rule(data=st.data(), abort=st.booleans())
    def fail(self, data, abort):
        """The exporter releases the request before the pull (abort), or this side cancels
        it in flight: the receiver is as before."""
        rid = data.draw(st.sampled_from(sorted(self.exports)))
        handle = self.exports.pop(rid)[0]
        before = counts(self.dst)
        if abort:
            assert self.a.release_export(rid) == "pending"
            assert wait_until(lambda: self.b._was_aborted("csm-src", rid))
            with pytest.raises(TransferAborted):
                self.b.pull(handle)
        else:
            pending = self.b.begin_pull(handle)
            pending.cancel()
            with pytest.raises(TransferCancelled):
                pending.wait()
            self.a.release_export(rid)
        assert counts(self.dst) == before and rid not in self.dst._requests
        self.src.release_requests([rid])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(self.live))
        self.dst.release_requests([rid])
        self.live.remove(rid)

    @invariant()
    def contexts_agree(self):
        self.dst.check_invariants()
        self.src.check_invariants()
        assert set(self.a.pending_exports) == set(self.exports)
        assert set(self.dst._requests.ids) == set(self.live)


TestContextHandoffs = ContextHandoffs.TestCase
TestContextHandoffs.settings = settings(max_examples=6, stateful_step_count=8, deadline=None)
