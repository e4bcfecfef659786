"""hcache.transfer between DynamicInferenceContexts in one process: the descriptor plan of a
request's blocks and live Mamba states, executed with memmove against NumPy gathers through the
block tables (block sizes, a prefix the receiver holds, TP re-slicing; no NIXL), then NIXL pulls
between context engines (agents on loopback): the demo model decodes the same tokens as one
context, the receiver's own cached prefix is not pulled, and every failure (abort, cancel,
deadline, lease, refusals) leaves the receiving context as it was."""

from __future__ import annotations

import ctypes
import time

import context_peer as cp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_transfer import config_of, rank_slices

from hcache import CacheCapacityError, HybridCacheManager
from hcache.contexts import compute_block_hashes
from hcache.contexts import request_handoff as handoff
from hcache.transfer import (
    ContextTransferEngine,
    TensorParallelLayout,
    TransferAborted,
    TransferCancelled,
    TransferEngine,
    TransferTimeout,
    describe_context,
    nixl_available,
    plan_context_pull,
)

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed "
                                "(pip install --no-deps nixl-cu12)")


def fill(ctx, seed):
    """Random bytes in every pool layer and live state of ``ctx``."""
    rng = np.random.default_rng(seed)
    arrays = list(ctx.kv_pool.layers)
    if ctx.num_mamba_layers:
        arrays += [ctx.mamba_conv_states, ctx.mamba_ssm_states]
    for a in arrays:
        a[...] = rng.standard_normal(a.shape).astype(a.dtype)


def rows(ctx, rid, lo=0, hi=None):
    """Per layer, K/V of positions ``[lo, hi)`` of ``rid`` gathered through its block table,
    ``[n, C, H, D]``."""
    bs, blocks = ctx.block_size_tokens, ctx.block_ids(rid)
    pos = np.arange(lo, ctx._requests.lengths[ctx._requests.row(rid)] if hi is None else hi)
    return [layer[blocks[pos // bs], :, :, pos % bs] for layer in ctx.kv_pool.layers]


def live(ctx, rid):
    slot = ctx.mamba_slot(rid)
    return [ctx.mamba_conv_states[:, slot].copy(), ctx.mamba_ssm_states[:, slot].copy()]


def memmove(plan):
    """Run a plan in this process (both sides' addresses are ours)."""
    for _, descs in plan:
        for local, remote, n in descs.tolist():
            ctypes.memmove(local, remote, n)


def admit_source(ctx, rid, tokens):
    """A finished prompt in ``ctx`` (no model: the bytes are the pool's random fill)."""
    ctx.add_request(rid, tokens)
    ctx.commit_step()


def counts(ctx):
    kv = ctx.kv_block_allocator
    return (kv.num_free_blocks, kv.get_allocatable_count(), int(kv.block_ref_counts.sum()),
            dict(kv.kv_hash_to_block_id))


# --- the plan, executed with memmove (no NIXL) ---------------------------------------------

@given(st.sampled_from([2, 4, 8]), st.sampled_from([2, 4, 8]), st.integers(1, 40),
       st.integers(0, 4), st.booleans())
def test_a_pulled_request_holds_the_sources_rows_and_states(src_bs, dst_bs, n, warm, hybrid):
    """Oracle: NumPy gathers of the source's rows through its block table. Positions the
    receiver's prefix cache held (``warm`` blocks of a previous request) keep its own bytes;
    every other block of its pool is untouched."""
    layout = "hybrid" if hybrid else "attention"
    src = cp.context(layout, block_size=src_bs, blocks_per=40 // src_bs + 1)
    dst = cp.context(layout, block_size=dst_bs, blocks_per=40 // dst_bs + 1, num_blocks=48)
    fill(src, 1)
    fill(dst, 2)
    tokens = (np.arange(n) * 7 + 3) % 50
    warm = min(warm, (n - 1) // dst_bs)
    if warm:
        admit_source(dst, "warm", tokens[:warm * dst_bs])
        dst.release_requests(["warm"])
    admit_source(src, "r", tokens)
    before = [layer.copy() for layer in dst.kv_pool.layers]
    step = handoff.admit_parked(dst, "r", tokens)
    assert step.num_matched_blocks == warm
    src_desc, dst_desc = describe_context(src), describe_context(dst)
    plan = plan_context_pull(dst_desc, step.block_ids, warm, step.mamba_slot,
                             [("peer", src_desc, src.block_ids("r"), src.mamba_slot("r"))], n)
    memmove(plan)
    assert handoff.complete(dst, "r") == n // dst_bs - warm     # the rest were cached
    t0 = warm * dst_bs
    for got, want in zip(rows(dst, "r", t0), rows(src, "r", t0), strict=True):
        assert got.tobytes() == want.tobytes()
    for got, old in zip(dst.kv_pool.layers, before, strict=True):
        mine = np.zeros(len(old), bool)
        mine[step.block_ids[warm:]] = True
        assert (got[~mine] == old[~mine]).all()
        assert (got[step.block_ids[:warm]] == old[step.block_ids[:warm]]).all()
    if hybrid:
        assert [x.tobytes() for x in live(dst, "r")] == [x.tobytes() for x in live(src, "r")]
    assert dst.num_computed_tokens("r") == n
    dst.check_invariants()
    if src_bs == dst_bs:     # whole blocks merge: one descriptor per run of consecutive ids
        assert sum(len(d) for _, d in plan) <= len(src.kv_pool.layers) * max(
            1, len(step.block_ids) - warm) + 2 * src.num_mamba_layers


def test_tp_one_to_two_and_back_byte_for_byte():
    """Oracle: the manager tests' NumPy head / conv-channel slices of each rank, written from
    the TP rules, applied to the pool's blocks and the live states."""
    config = config_of(max_len=48)
    tp, tp1 = TensorParallelLayout(config, 2), TensorParallelLayout(config, 1)
    whole, back = cp.context_for(config), cp.context_for(config)
    ranks = [cp.context_for(tp.rank_config(r)) for r in range(2)]
    for i, c in enumerate([whole, back, *ranks]):
        fill(c, 20 + i)
    tokens, n = list(range(3, 20)), 17
    admit_source(whole, "r", tokens)
    whole_desc = describe_context(whole, tp1)
    for r, ctx in enumerate(ranks):                              # 1 -> 2
        step = handoff.admit_parked(ctx, "r", tokens)
        memmove(plan_context_pull(describe_context(ctx, tp, r), step.block_ids, 0,
                                  step.mamba_slot, [("w", whole_desc, whole.block_ids("r"),
                                                     whole.mamba_slot("r"))], n))
        handoff.complete(ctx, "r")
        idx = rank_slices(tp, r, config)
        for a, (got, want) in enumerate(zip(rows(ctx, "r"), rows(whole, "r"), strict=True)):
            assert got.tobytes() == want[:, :, idx[a][1]].tobytes()     # [n, C, H, D]
        for i in range(config.mamba.num_layers):
            rec, conv = idx[len(ctx.kv_pool.layers) + 2 * i:][:2]
            assert live(ctx, "r")[1][i].tobytes() == live(whole, "r")[1][i][rec[1:]].tobytes()
            assert live(ctx, "r")[0][i].tobytes() == live(whole, "r")[0][i][conv[1:]].tobytes()
    step = handoff.admit_parked(back, "r", tokens)               # 2 -> 1
    memmove(plan_context_pull(describe_context(back, tp1), step.block_ids, 0, step.mamba_slot,
                              [(f"r{r}", describe_context(c, tp, r), c.block_ids("r"),
                                c.mamba_slot("r")) for r, c in enumerate(ranks)], n))
    handoff.complete(back, "r")
    assert [x.tobytes() for x in rows(back, "r")] == [x.tobytes() for x in rows(whole, "r")]
    assert [x.tobytes() for x in live(back, "r")] == [x.tobytes() for x in live(whole, "r")]
    with pytest.raises(ValueError, match="sources: expected every head"):
        plan_context_pull(describe_context(back, tp1), step.block_ids, 0, step.mamba_slot,
                          [("r0", describe_context(ranks[0], tp, 0), ranks[0].block_ids("r"),
                            0)], n)
    with pytest.raises(ValueError, match="TP layout on one side only|pass tp= on both"):
        plan_context_pull(describe_context(back), step.block_ids, 0, 0,
                          [("r0", describe_context(ranks[0], tp, 0), ranks[0].block_ids("r"),
                            0)], n)
    with pytest.raises(ValueError, match="ctx: expected the layers of rank 0 of 2"):
        describe_context(whole, tp, 0)


def test_layout_refusals_name_what_differs():
    src = describe_context(cp.context("hybrid"))
    blocks = [0, 1, 2]

    def plan(dst_ctx, desc=src, bl=blocks, n=10):
        return plan_context_pull(describe_context(dst_ctx), [0] * 3, 0, 0,
                                 [("p", desc, bl, 0)], n)

    with pytest.raises(ValueError, match="KV dtype float32, got float16"):
        plan(cp.context("hybrid"), dict(src, kv_dtype="float16"))
    with pytest.raises(ValueError, match="expected 2 attention layers, got 3"):
        plan(cp.context("hybrid"), dict(src, kv=src["kv"] + src["kv"][:1]))
    with pytest.raises(ValueError, match="head_dim 8 in attention layer 0, got 16"):
        plan(cp.context("hybrid"), dict(src, kv=[dict(src["kv"][0], head_dim=16),
                                                 src["kv"][1]]))
    with pytest.raises(ValueError, match="expected 3 Mamba layers, got 0"):
        plan(cp.context("hybrid"), dict(src, mamba=None))
    with pytest.raises(ValueError, match="Mamba recurrent state float32, got float16"):
        mamba = dict(src["mamba"], recurrent=dict(src["mamba"]["recurrent"], dtype="float16"))
        plan(cp.context("hybrid"), dict(src, mamba=mamba))
    with pytest.raises(ValueError, match="paged layout on the peer, got a HybridCacheManager"):
        plan(cp.context("hybrid"), {"kv": []})
    with pytest.raises(ValueError, match=r"handles\[0\]: expected 3 block ids in \[0, 32\)"):
        plan(cp.context("hybrid"), bl=[0, 1, 32])
    with pytest.raises(ValueError, match=r"handles\[0\]: expected 3 block ids"):
        plan(cp.context("hybrid"), bl=[0, 1])
    with pytest.raises(ValueError, match="length: expected <= 8"):
        plan(cp.context("hybrid", blocks_per=2))
    with pytest.raises(ValueError, match="num_local_blocks"):
        describe_context(cp.context("windowed", num_local_blocks=8))
    with pytest.raises(TypeError, match="ctx: expected DynamicInferenceContext, got "
                                        "HybridCacheManager"):
        describe_context(HybridCacheManager(config_of(), device="cpu"))


def test_a_parked_request_is_kept_out_of_steps():
    """While a transfer fills it: other requests' steps do not complete it, write_kv and
    release_requests refuse it; abandoning it returns every block and registers nothing."""
    ctx = cp.context("hybrid")
    before = counts(ctx)
    step = handoff.admit_parked(ctx, "in", list(range(10)))
    other = ctx.add_request("other", list(range(30, 37)))
    assert ctx.snapshot_targets() and all(rid == "other" for rid, _, _ in ctx.snapshot_targets())
    k = np.zeros((other.end - other.start, 2, 8), np.float32)
    with pytest.raises(ValueError, match="not one a transfer fills"):
        ctx.write_kv(["in"], k, k, layer=0)
    ctx.write_kv(["other"], k, k, layer=0)
    ctx.commit_step()
    assert ctx.num_computed_tokens("in") == step.skip_tokens == 0
    with pytest.raises(ValueError, match="expected no request a transfer fills"):
        ctx.release_requests(["other", "in"])
    with pytest.raises(ValueError, match="scheduled step"):
        ctx.extend_request("in", [1])
    with pytest.raises(ValueError, match="without a scheduled step"):
        handoff.offer(ctx, "in")
    ctx.check_invariants()
    handoff.zero_filled(ctx, "in", 0)
    handoff.abandon(ctx, "in")
    ctx.release_requests(["other"])
    after = counts(ctx)        # "other" left one registered block cached, nothing of "in"
    assert after[1:3] == before[1:3] and after[0] == before[0] - 1
    assert set(after[3]) == set(handoff_hashes(list(range(30, 37))))
    ctx.check_invariants()


def handoff_hashes(tokens, bs=cp.BLOCK):
    return list(compute_block_hashes(tokens, bs))


# --- NIXL pulls between context engines in one process --------------------------------------

PROMPT = [5, 17, 3, 40, 22, 9, 61, 11, 2, 33]
_ids = iter(range(10**6))


def rid():
    return f"c{next(_ids)}"


@pytest.fixture
def engines(request):
    """A prefill and a decode context of ``request.param``'s layout with engines, connected
    both ways."""
    if not nixl_available():
        pytest.skip("NIXL not installed (pip install --no-deps nixl-cu12)")
    layout = request.param
    src, dst = cp.context(layout), cp.context(layout, block_size=8, blocks_per=6)
    name = rid()
    a = ContextTransferEngine(src, f"{name}-prefill", timeout_s=5)
    b = ContextTransferEngine(dst, f"{name}-decode", timeout_s=5)
    a.connect(b.metadata)
    b.connect(a.metadata)
    yield layout, src, dst, a, b
    a.close()
    b.close()


def one_context(layout, prompt, steps=5):
    """The oracle run: prefill and decode in one context."""
    model, _ = cp.model_of(layout)
    ctx = cp.context(layout)
    first, row = cp.prefill(model, ctx, "one", prompt)
    return first, row, cp.decode(model, ctx, "one", first, steps)


def wait_done(engine, request_id):
    for _ in range(300):
        if engine.export_state(request_id) != "pending":
            break
        time.sleep(0.01)
    return engine.export_state(request_id)


@needs_nixl
@pytest.mark.parametrize("engines", ["attention", "hybrid"], indirect=True)
def test_a_handoff_decodes_the_tokens_of_one_context(engines):
    """Another block size on the decode side (8 against 4): pieces cut at both sides' block
    ends. Oracle: the same prompt served by one context, and the prefill side's bytes."""
    layout, src, dst, a, b = engines
    model, _ = cp.model_of(layout)
    r = rid()
    first, row = cp.prefill(model, src, r, PROMPT)
    source = [x.copy() for x in src.kv_pool.layers]
    pending = b.pull(a.export(r))
    assert all((x == y).all() for x, y in zip(src.kv_pool.layers, source, strict=True))
    assert pending.state == "DONE" and pending.num_matched_blocks == 0
    assert pending.num_pulled_blocks == 2 and dst.num_computed_tokens(r) == len(PROMPT)
    assert [x.tobytes() for x in rows(dst, r)] == [x.tobytes() for x in rows(src, r)]
    if layout == "hybrid":
        assert [x.tobytes() for x in live(dst, r)] == [x.tobytes() for x in live(src, r)]
    assert set(dst.kv_block_allocator.kv_hash_to_block_id) == set(handoff_hashes(PROMPT, 8))
    assert wait_done(a, r) == "done" and a.done_peers(r) == {b.name}
    tokens, logits = cp.decode(model, dst, r, first, 5)
    want_first, want_row, (want_tokens, want_logits) = one_context(layout, PROMPT)
    assert (first, row.tobytes()) == (want_first, want_row.tobytes())
    assert tokens == want_tokens
    assert [x.tobytes() for x in logits] == [x.tobytes() for x in want_logits]
    assert a.release_export(r) == "done"
    salted = b.pull(a.export(r), "salted", salt="tenant")   # hashed as add_request(salt=)
    assert salted.num_matched_blocks == 0
    assert set(compute_block_hashes(PROMPT, 8, salt="tenant")) <= set(
        dst.kv_block_allocator.kv_hash_to_block_id)
    dst.check_invariants()
    src.check_invariants()


@needs_nixl
@pytest.mark.parametrize("engines", ["attention", "hybrid"], indirect=True)
def test_a_prefix_the_receiver_caches_is_not_pulled(engines):
    """The decode side served a request with the same first 16 tokens (two blocks of 8): it
    pulls only the third block (and the live states), and decodes as one context."""
    layout, src, dst, a, b = engines
    model, _ = cp.model_of(layout)
    system = list(range(7, 23))
    prompt = system + [40, 41, 42]
    cp.prefill(model, dst, "earlier", system + [50, 51])
    dst.release_requests(["earlier"])
    r = rid()
    first, _ = cp.prefill(model, src, r, prompt)
    pending = b.pull(a.export(r))
    assert (pending.num_matched_blocks, pending.num_pulled_blocks) == (2, 1)
    kv_bytes = sum(layer[0].nbytes for layer in dst.kv_pool.layers) // 8   # per position
    states = 0 if layout == "attention" else sum(x.nbytes for x in live(dst, r))
    assert pending.nbytes == 4 * kv_bytes + states      # positions [16, 20): both sides' blocks
    assert [x.tobytes() for x in rows(dst, r)] == [x.tobytes() for x in rows(src, r)]
    tokens, _ = cp.decode(model, dst, r, first, 4)
    _, _, (want, _) = one_context(layout, prompt, 4)
    assert tokens == want
    dst.check_invariants()


@needs_nixl
@pytest.mark.parametrize("engines", ["hybrid"], indirect=True)
def test_abort_cancel_and_leases_leave_the_receiver_as_it_was(engines):
    """Abort by the exporter, a cancel here (the request released during the transfer), a
    passed deadline and an ended lease: the pull raises, the allocator's counts and hash map
    are as before, the request is gone, and the engines still work."""
    layout, src, dst, a, b = engines
    fill(src, 3)
    tokens = list(range(1, 19))
    before = counts(dst)
    r = rid()
    admit_source(src, r, tokens)
    handle = a.export(r)
    assert a.release_export(r) == "pending"            # released while a pull may run
    for _ in range(300):
        if b._was_aborted(a.name, r):
            break
        time.sleep(0.01)
    with pytest.raises(TransferAborted, match="released the request"):
        b.pull(handle)
    assert counts(dst) == before and r not in dst._requests
    fill(dst, 4)
    pending = b.begin_pull(a.export(r), "mine")
    assert dst.num_active_requests == 1
    blocks, slot = dst.block_ids("mine"), dst.mamba_slot("mine")
    pending.cancel()
    assert pending.state == "FAILED" and counts(dst) == before
    assert not any(layer[blocks].any() for layer in dst.kv_pool.layers)   # nothing partial
    assert not dst.mamba_conv_states[:, slot].any() and not dst.mamba_ssm_states[:, slot].any()
    with pytest.raises(TransferCancelled):
        pending.poll()
    a.release_export(r)
    pending = b.begin_pull(a.export(r))
    with pytest.raises(TransferTimeout, match="deadline"):
        pending.wait(timeout_s=0)
    assert counts(dst) == before and dst.num_active_requests == 0
    a.release_export(r)
    with ContextTransferEngine(src, f"{a.name}-short", timeout_s=0.05) as short:
        b.connect(short.metadata)
        handle = short.export(r)
        time.sleep(0.1)
        with pytest.raises(TransferTimeout, match="lease .* ended"):
            b.pull(handle)
        b.disconnect(short.name)
    assert counts(dst) == before
    dst.check_invariants()
    again = rid()          # (the abort of r stays on record here: a new id)
    admit_source(src, again, tokens)
    b.pull(a.export(again))                            # still works
    assert [x.tobytes() for x in rows(dst, again)] == [x.tobytes() for x in rows(src, again)]


@needs_nixl
@pytest.mark.parametrize("engines", ["hybrid"], indirect=True)
def test_refusals_change_nothing(engines):
    layout, src, dst, a, b = engines
    r = rid()
    admit_source(src, r, list(range(12)))
    handle = a.export(r)
    before = counts(dst)
    with pytest.raises(ValueError, match="request_id: expected a request not exported"):
        a.export(r)
    with pytest.raises(TypeError, match="request_id: expected a str, got int"):
        a.export(3)
    with pytest.raises(ValueError, match="request_id: expected an active request"):
        a.export("nobody")
    src.add_request("busy", [1, 2, 3])
    with pytest.raises(ValueError, match="without a scheduled step"):
        a.export("busy")
    with pytest.raises(TypeError, match="without blocks and tokens"):
        b.pull({k: v for k, v in handle.items() if k != "blocks"})
    with pytest.raises(ValueError, match="tokens of handles"):
        b.pull([handle, dict(handle, tokens=handle["tokens"][:-1] + [9])])
    with pytest.raises(ValueError, match=r"expected 3 block ids in \[0, 32\) for 12 tokens"):
        b.pull(dict(handle, blocks=handle["blocks"][:1]))
    with pytest.raises(ValueError, match="timeout_s"):
        b.pull(handle, timeout_s=0)
    with pytest.raises(NotImplementedError, match="pulls"):
        b.push(handle, 0)
    cp.prefill(cp.model_of(layout)[0], dst, "taken", [1, 2])
    before = counts(dst)
    with pytest.raises(ValueError, match="request_id: expected a new id, got active 'taken'"):
        b.pull(handle, "taken")
    full = cp.context(layout, max_requests=1)
    with ContextTransferEngine(full, f"{a.name}-full") as c:
        c.connect(a.metadata)
        full.add_request("only", [1])
        full.commit_step()
        with pytest.raises(CacheCapacityError, match="rows are in use"):
            c.pull(handle)
        assert full.num_active_requests == 1
    manager = HybridCacheManager(config_of(), device="cpu")
    with TransferEngine(manager, f"{a.name}-mgr") as m:
        b.connect(m.metadata)
        with pytest.raises(ValueError, match="paged layout on the peer"):
            b.pull(dict(m.export("x", 0, 4), blocks=[0], tokens=[1, 2, 3, 4]))
    assert counts(dst) == before
    dst.check_invariants()
