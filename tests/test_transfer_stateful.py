"""A TransferEngine's books and its destination slots under any sequence of exports, pulls,
releases during a pull, cancels and source rewrites (hypothesis RuleBasedStateMachine).

Oracle: a NumPy model of the destination manager's buffers, updated by the documented effect
of each call (a pull copies the exported slot's first ``length`` K/V rows and its Mamba states
as they were at export time; a failed or cancelled pull zeroes exactly those ranges), and the
set of exports that are still pending. Two engines (NIXL agents on loopback) are made once for
the module; every example starts from freshly filled buffers.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import transfer_peer  # noqa: F401  (loopback UCX settings before NIXL loads)
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hcache import HybridCacheConfig, HybridCacheManager
from hcache.transfer import TransferAborted, TransferCancelled, TransferEngine, nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed "
                                "(pip install --no-deps nixl-cu12)")

HF = dict(transfer_peer.NEMOTRON_H_CONFIG)
_engines = {}
_ids = iter(range(10**9))


def engines():
    """(source manager, destination manager, source engine, destination engine), made once."""
    if not _engines:
        src = HybridCacheManager(HybridCacheConfig.from_hf_config(
            HF, max_batch_size=3, max_sequence_length=16, kv_dtype="float32"))
        dst = HybridCacheManager(HybridCacheConfig.from_hf_config(
            HF, max_batch_size=2, max_sequence_length=12, kv_dtype="float32"))
        a, b = TransferEngine(src, "sm-src", timeout_s=120), TransferEngine(dst, "sm-dst",
                                                                          timeout_s=120)
        a.connect(b.metadata)
        b.connect(a.metadata)
        _engines.update(src=src, dst=dst, a=a, b=b)
    e = _engines
    return e["src"], e["dst"], e["a"], e["b"]


def buffers(mgr):
    kv = mgr.kv_cache_manager
    out = [kv.get_combined_kv_cache(i) for i in range(kv.num_layers)]
    mm = mgr.mamba_cache_manager
    for i in range(mm.config.num_layers):
        out += [mm.get_recurrent_state(i), mm.get_conv_state(i)]
    return out


def copy_request(dst_model, src_arrays, src_slot, dst_slot, length, zero=False):
    """The documented effect of a pull on the destination model."""
    for d, s in zip(dst_model, src_arrays, strict=True):
        if d.ndim == 5:
            d[dst_slot, :, :, :length] = 0 if zero else s[src_slot, :, :, :length]
        else:
            d[dst_slot] = 0 if zero else s[src_slot]


def wait_until(predicate, seconds=3.0):
    end = time.monotonic() + seconds
    while not predicate() and time.monotonic() < end:
        time.sleep(0.005)
    return predicate()


class TransferBooks(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.src, self.dst, self.a, self.b = engines()
        for r in list(self.a.pending_exports):
            self.a.release_export(r)
        rng = np.random.default_rng(next(_ids))
        for mgr in (self.src, self.dst):
            for x in buffers(mgr):
                x[...] = rng.standard_normal(x.shape).astype(x.dtype)
        self.model = [x.copy() for x in buffers(self.dst)]
        self.exports = {}     # rid -> (handle, source arrays at export, slot, length)
        self.pending = set()

    @precondition(lambda self: not self.pending)
    @rule(seed=st.integers(0, 2**16))
    def rewrite_source(self, seed):
        """The source reuses its slots (allowed once no export is pending)."""
        rng = np.random.default_rng(seed)
        for x in buffers(self.src):
            x[...] = rng.standard_normal(x.shape).astype(x.dtype)

    @rule(slot=st.integers(0, 2), length=st.integers(1, 12))
    def export(self, slot, length):
        rid = f"sm{next(_ids)}"
        handle = self.a.export(rid, slot, length)
        self.exports[rid] = (handle, [x.copy() for x in buffers(self.src)], slot, length)
        self.pending.add(rid)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), dst_slot=st.integers(0, 1))
    def pull(self, data, dst_slot):
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        handle, arrays, slot, length = self.exports[rid]
        self.b.pull(handle, dst_slot)
        copy_request(self.model, arrays, slot, dst_slot, length)
        assert wait_until(lambda: self.a.export_state(rid) == "done")
        assert self.a.release_export(rid) == "done"
        self.pending.discard(rid)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), dst_slot=st.integers(0, 1))
    def release_then_pull(self, data, dst_slot):
        """The exporter releases a pending request; a pull of its handle then fails."""
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        handle, arrays, slot, length = self.exports[rid]
        assert self.a.release_export(rid) == "pending"
        self.pending.discard(rid)
        assert wait_until(lambda: self.b._was_aborted("sm-src", rid))
        with pytest.raises(TransferAborted):
            self.b.pull(handle, dst_slot)
        copy_request(self.model, arrays, slot, dst_slot, length, zero=True)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), dst_slot=st.integers(0, 1))
    def cancel(self, data, dst_slot):
        """This side releases its request while the pull is in flight."""
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        handle, arrays, slot, length = self.exports[rid]
        pending = self.b.begin_pull(handle, dst_slot)
        pending.cancel()
        with pytest.raises(TransferCancelled):
            pending.wait()
        copy_request(self.model, arrays, slot, dst_slot, length, zero=True)
        # NIXL may have finished the READ (and notified "done") before the cancel: either
        # way the reader no longer needs the slot, and the exporter drops the request
        assert self.a.release_export(rid) in ("pending", "done")
        self.pending.discard(rid)

    @invariant()
    def destination_matches_the_model(self):
        for got, want in zip(buffers(self.dst), self.model, strict=True):
            assert got.tobytes() == want.tobytes()

    @invariant()
    def books_match(self):
        assert set(self.a.pending_exports) == self.pending


TestTransferBooks = TransferBooks.TestCase
TestTransferBooks.settings = settings(max_examples=5, stateful_step_count=6, deadline=None)
