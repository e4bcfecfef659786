"""Disaggregated prefill / decode between DynamicInferenceContexts in two processes on
loopback (NIXL, UCX over tcp+cma): a spawned peer prefills with the demo model and exports the
request; this process pulls it into its own context (its cached prefix not pulled) and decodes.
Oracle: the same prompt served by one context (tokens and logits bit-identical) and the
uncached reference model. A peer killed before or during the pull leaves this context as it
was: the allocator's counts, no hash of the unpulled prompt, a usable engine.

Every wait is bounded (pipe polls with timeouts, transfer deadlines); the peers end by
themselves.
"""

from __future__ import annotations

import context_peer as cp
import numpy as np
import pytest
from test_transfer_context import counts, handoff_hashes, rows
from test_transfer_processes import Peer

from hcache.demo.model import reference_logits
from hcache.transfer import ContextTransferEngine, TransferError, nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed "
                                "(pip install --no-deps nixl-cu12)")

SYSTEM = [5, 17, 3, 40, 22, 9, 61, 11]
PROMPT = SYSTEM + [2, 33, 7, 58, 19]
DECODE_STEPS = 5


@pytest.fixture(scope="module")
def prefill_peer():
    p = Peer(cp.serve)
    yield p
    p.stop()


@pytest.mark.parametrize("layout,cached", [("attention", False), ("hybrid", False),
                                           ("hybrid", True)])
def test_decode_after_a_handoff_matches_one_context(prefill_peer, layout, cached):
    """``cached``: this side served the system prompt before, so its first two blocks are
    its own and only the rest is pulled."""
    name = f"ctx-prefill-{layout}-{cached}"
    metadata = prefill_peer.call("build", layout, name, {})
    ctx = cp.context(layout, num_blocks=24)           # another pool size here
    model, _ = cp.model_of(layout)
    if cached:
        cp.prefill(model, ctx, "earlier", SYSTEM + [1])
        ctx.release_requests(["earlier"])
    with ContextTransferEngine(ctx, f"ctx-decode-{layout}-{cached}", timeout_s=10) as engine:
        engine.connect(metadata)
        prefill_peer.call("connect", engine.metadata)
        handle, first, first_row, source_bytes = prefill_peer.call("prefill_export", "r",
                                                                   PROMPT)
        pending = engine.pull(handle)
        assert pending.num_matched_blocks == (2 if cached else 0)
        assert pending.num_pulled_blocks == (2 if cached else 4)
        got = cp.request_bytes(ctx, "r")
        assert got == source_bytes
        assert set(handoff_hashes(PROMPT)) <= set(ctx.kv_block_allocator.kv_hash_to_block_id)
        tokens, logits = cp.decode(model, ctx, "r", first, DECODE_STEPS)
        assert prefill_peer.call("export_state", "r", 5.0) == "done"
    one = cp.context(layout)
    want_first, want_row = cp.prefill(model, one, "one", PROMPT)
    want_tokens, want_logits = cp.decode(model, one, "one", want_first, DECODE_STEPS)
    assert (first, first_row) == (want_first, want_row.tobytes())
    assert tokens == want_tokens
    assert [x.tobytes() for x in logits] == [x.tobytes() for x in want_logits]
    ref = reference_logits(model, PROMPT + [first] + tokens[:-1])[len(PROMPT):]
    assert [int(np.argmax(r)) for r in ref] == tokens
    ctx.check_invariants()


def test_killed_peer_leaves_the_context_as_it_was():
    """The peer exports a request and is killed (SIGKILL) before this side pulls it: the pull
    fails, the request is gone, the allocator's counts and hash map are as before (this
    side's own cached prefix included), and the engine still pulls from a live exporter."""
    victim = Peer(cp.serve)
    try:
        metadata = victim.call("build", "hybrid", "ctx-victim", {})
        ctx = cp.context("hybrid")
        model, _ = cp.model_of("hybrid")
        cp.prefill(model, ctx, "earlier", SYSTEM + [1])
        ctx.release_requests(["earlier"])
        before = counts(ctx)
        with ContextTransferEngine(ctx, "ctx-survivor", timeout_s=3) as engine:
            engine.connect(metadata)
            victim.call("connect", engine.metadata)
            handle, _, _, _ = victim.call("prefill_export", "lost", PROMPT)
            victim.kill()
            with pytest.raises(TransferError, match="'lost'"):
                engine.pull(handle, timeout_s=3)
            assert counts(ctx) == before and ctx.num_active_requests == 0
            ctx.check_invariants()
            engine.disconnect("ctx-victim")
            other = cp.context("hybrid")                 # a fresh exporter in this process
            with ContextTransferEngine(other, "ctx-fresh") as fresh:
                engine.connect(fresh.metadata)
                first, _ = cp.prefill(model, other, "again", PROMPT)
                engine.pull(fresh.export("again"))
            assert cp.request_bytes(ctx, "again") == cp.request_bytes(other, "again")
            ctx.check_invariants()
    finally:
        victim.stop()


def test_peer_killed_during_a_large_pull_leaves_the_context_consistent():
    """SIGKILL right after a 16 MiB pull started: either it finished first (every byte the
    peer's, the request live) or it fails (its blocks zeroed and released, counts and hash
    map as before); never a mix."""
    victim = Peer(cp.serve)
    try:
        length, bs = 512, 16                  # 4 layers x 32 KiB x 512 tokens = 16 MiB
        kw = {"num_blocks": 40, "block_size": bs, "blocks_per": 40, "max_requests": 2}
        metadata = victim.call("build", "big", "ctx-big-victim", kw)
        ctx = cp.context_for(cp.peer.cache_config("big", 1, 8), **kw)
        for layer in ctx.kv_pool.layers:
            layer[...] = -1
        before = counts(ctx)
        with ContextTransferEngine(ctx, "ctx-big-survivor", timeout_s=20) as engine:
            engine.connect(metadata)
            handle = victim.call("fill_export", "big", length)
            pending = engine.begin_pull(handle)
            blocks = ctx.block_ids("big")
            victim.kill()
            try:
                pending.wait()
                outcome = "done"
            except TransferError:
                outcome = "failed"
            others = np.setdiff1d(np.arange(40), blocks)
            for a, layer in enumerate(ctx.kv_pool.layers):
                assert (layer[blocks] == (a + 1 if outcome == "done" else 0)).all(), outcome
                assert (layer[others] == -1).all()
            if outcome == "failed":
                assert counts(ctx) == before and ctx.num_active_requests == 0
            else:
                assert [x.shape[0] for x in rows(ctx, "big")] == [length] * 4
            ctx.check_invariants()
    finally:
        victim.stop()
