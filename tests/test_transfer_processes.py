"""Disaggregated prefill / decode across two processes on loopback (NIXL, UCX over tcp+cma):
a spawned peer prefills with the demo model and exports the request; this process pulls it
and decodes. Oracle: the same requests served in one process by one manager (tokens and logits
bit-identical), and the uncached reference model. A killed peer leaves this side consistent.

Every wait is bounded (pipe polls with timeouts, transfer deadlines); the peers end by
themselves.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import pytest
import transfer_peer as peer

from hcache import HybridCacheManager
from hcache.demo.model import reference_logits
from hcache.transfer import TransferEngine, TransferError, nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed "
                                "(pip install --no-deps nixl-cu12)")

STEP_S = 60.0          # bound on one command of the peer (its first includes Python's start)
PROMPTS = [[5, 17, 3, 40, 22, 9, 61], [11, 2, 33, 7, 58, 19, 4, 27, 45]]
DECODE_STEPS = 5


class Peer:
    """A spawned process running ``serve`` (:func:`transfer_peer.serve`, or the context
    peer's): commands over a pipe, each answered within ``STEP_S``."""

    def __init__(self, serve=peer.serve):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def call(self, *cmd, timeout=STEP_S):
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer: no answer to {cmd[0]!r} within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer: {cmd[0]} failed: {value}")
        return value

    def kill(self):
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self):
        if self.process.is_alive():
            try:
                self.call("quit", timeout=10)
            except (OSError, TimeoutError, RuntimeError, EOFError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


@pytest.fixture(scope="module")
def prefill_peer():
    p = Peer()
    yield p
    p.stop()


def one_process(layout):
    """The oracle run: both prompts prefilled in one manager, prompt 1 kept (compacted to
    slot 0) and decoded there."""
    config = peer.cache_config(layout, 4, 64)
    mgr, model = HybridCacheManager(config), peer.demo_model(config)
    first, rows = peer.prefill(model, mgr, PROMPTS)
    mgr.compact_batch([-1, 0], 2, 1)
    tokens, logits = peer.decode(model, mgr, len(PROMPTS[1]), first[1], DECODE_STEPS)
    return model, first[1], rows[1], tokens, logits


@pytest.mark.parametrize("layout", ["attention", "hybrid", "windowed"])
def test_decode_after_a_transfer_matches_one_process(prefill_peer, layout):
    name = f"prefill-{layout}"
    metadata = prefill_peer.call("build", layout, 4, 64, name)
    config = peer.cache_config(layout, 2, 48)        # another slot count and length here
    mgr, model = HybridCacheManager(config), peer.demo_model(config)
    with TransferEngine(mgr, f"decode-{layout}", timeout_s=10) as engine:
        engine.connect(metadata)
        prefill_peer.call("connect", engine.metadata)
        handle, first, first_row = prefill_peer.call("prefill_export", PROMPTS, 1, layout)
        engine.pull(handle, 0)
        mgr.reset_for_new_sequences([len(PROMPTS[1])])
        tokens, logits = peer.decode(model, mgr, len(PROMPTS[1]), first, DECODE_STEPS)
        assert prefill_peer.call("export_state", layout, 5.0) == "done"
    _, want_first, want_row, want_tokens, want_logits = one_process(layout)
    assert (first, first_row) == (want_first, want_row.tobytes())
    assert tokens == want_tokens
    assert [x.tobytes() for x in logits] == [x.tobytes() for x in want_logits]
    ref = reference_logits(model, PROMPTS[1] + [first] + tokens[:-1])[len(PROMPTS[1]):]
    assert [int(np.argmax(r)) for r in ref] == tokens


def test_killed_peer_leaves_this_side_consistent():
    """The peer exports a request and is killed (SIGKILL) before this side pulls it; a second
    request of this side was exported to it and never pulled."""
    victim = Peer()
    try:
        metadata = victim.call("build", "hybrid", 4, 64, "victim")
        config = peer.cache_config("hybrid", 2, 48)
        mgr = HybridCacheManager(config)
        for b in [mgr.kv_cache_manager.get_combined_kv_cache(a) for a in range(2)] + [
                mgr.mamba_cache_manager.get_conv_state(i) for i in range(3)]:
            b[...] = 7
        with TransferEngine(mgr, "survivor", timeout_s=3) as engine:
            engine.connect(metadata)
            victim.call("connect", engine.metadata)
            handle, _, _ = victim.call("prefill_export", PROMPTS, 1, "lost")
            mine = engine.export("mine", 1, 5)
            before = peer.snapshot(mgr)
            victim.kill()
            with pytest.raises(TransferError, match="'lost'"):
                engine.pull(handle, 0, timeout_s=3)
            n = len(PROMPTS[1])
            for a in range(2):                         # slot 0: no partial state
                cache = mgr.kv_cache_manager.get_combined_kv_cache(a)
                assert not cache[0, :, :, :n].any() and (cache[0, :, :, n:] == 7).all()
                assert (cache[1] == 7).all()
            for i in range(3):
                assert not mgr.mamba_cache_manager.get_recurrent_state(i)[0].any()
                assert not mgr.mamba_cache_manager.get_conv_state(i)[0].any()
            after = peer.snapshot(mgr)
            assert [a for a, b in zip(after, before, strict=True) if a != b] != []
            assert engine.export_state("mine") == "pending"
            assert engine.release_export("mine") == "pending"   # a dead peer is told nothing
            assert engine.pending_exports == ()
            engine.disconnect("victim")
            # this engine still works: a fresh exporter in this process
            other = HybridCacheManager(peer.cache_config("hybrid", 4, 64))
            other.kv_cache_manager.get_combined_kv_cache(0)[2, :, :, :4] = 3
            with TransferEngine(other, "fresh") as fresh:
                engine.connect(fresh.metadata)
                engine.pull(fresh.export("again", 2, 4), 0)
            assert (mgr.kv_cache_manager.get_combined_kv_cache(0)[0, :, :, :4] == 3).all()
            del mine
    finally:
        victim.stop()


def test_peer_killed_during_a_large_pull_leaves_this_side_consistent():
    """SIGKILL right after a 16 MiB pull started: either the pull finished first and every
    byte is the peer's, or it fails and its ranges are zero; never a mix, and slot 1 and the
    tokens past the length keep their bytes."""
    victim = Peer()
    try:
        length = 512                                  # 4 layers x 32 KiB x 512 = 16 MiB
        metadata = victim.call("build", "big", 2, length, "big-victim")
        mgr = HybridCacheManager(peer.cache_config("big", 2, length + 8))
        caches = [mgr.kv_cache_manager.get_combined_kv_cache(a) for a in range(peer.BIG_LAYERS)]
        for c in caches:
            c[...] = -1
        with TransferEngine(mgr, "big-survivor", timeout_s=20) as engine:
            engine.connect(metadata)
            handle = victim.call("fill_export", 1, length, "big")
            pending = engine.begin_pull(handle, 0)
            os.kill(victim.process.pid, signal.SIGKILL)
            try:
                pending.wait()
                outcome = "done"
            except TransferError:
                outcome = "failed"
            victim.process.join(10)
            for a, c in enumerate(caches):
                head = c[0, :, :, :length]
                assert (head == (a + 1 if outcome == "done" else 0)).all(), outcome
                assert (c[0, :, :, length:] == -1).all() and (c[1] == -1).all()
    finally:
        victim.stop()
