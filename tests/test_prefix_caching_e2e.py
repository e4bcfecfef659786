"""End-to-end prefix caching with DynamicInferenceContext and a deterministic stand-in model.

The stand-in hybrid model has Mamba layers whose conv state is a window of token codes and
whose SSM state is a set of rolling hashes (integers, exact in float16/float32); attention
layer ``i``'s K/V row at position ``p`` is a function of the SSM state after token ``p``; the
next token reads every cached K row of the request back from the paged pool through its block
table. So a wrong restore, a wrong snapshot, a wrong shared block or a lost KV write changes the
generated tokens, the final states or the KV bytes. Every run is checked against a pure NumPy
fold of the model over the token sequence and against the same workload with caching off.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from hcache.config.caches import KVLayerConfig
from hcache.contexts import DynamicInferenceContext
from hcache.errors import CacheCapacityError

import helpers
from helpers import host

DEVICES = helpers.DEVICES
BS, L = 4, 2
CONV, SSM = (2, 3), (2, 2)
ATTN = [KVLayerConfig(2, 4), KVLayerConfig(1, 8), KVLayerConfig(2, 4)]
# Latent (MLA) layers mixed with K/V layers; one shares its head dim with a K/V layer.
LATENT_ATTN = [KVLayerConfig(1, 12, components=1), KVLayerConfig(2, 4),
               KVLayerConfig(1, 4, components=1)]
VOCAB, P = 50, 65521
_A = (np.arange(L * 4).reshape(L, *SSM) % 29 + 2).astype(np.float64)
_B = (np.arange(L * 4).reshape(L, *SSM) % 13 + 1).astype(np.float64)



# --- the stand-in model -------------------------------------------------------------------------

def mamba_step(conv, ssm, tok):
    """Advance every Mamba layer by one token (host arrays ``[L, *CONV]``, ``[L, *SSM]``)."""
    codes = (tok * (np.arange(CONV[0])[None, :] + 1) + 3 * np.arange(L)[:, None]) % 1021
    conv = np.concatenate([conv[..., 1:], codes[..., None].astype(conv.dtype)], axis=-1)
    mix = conv.astype(np.float64).sum(axis=(1, 2))[:, None, None]
    ssm = ((ssm.astype(np.float64) * _A + tok * _B + mix) % P).astype(np.float32)
    return conv, ssm


def kv_rows(ssm, pos):
    """K, V rows ``[H_i, D_i]`` of every attention layer at position ``pos`` (V is None for a
    latent layer)."""
    r = int(ssm[0, 0, 0])
    out = []
    for i, lc in enumerate(ATTN):
        h = np.arange(lc.num_kv_heads)[:, None]
        d = np.arange(lc.head_dim)[None, :]
        out.append((((r + 17 * h + 5 * d + 11 * i + pos) % 1021).astype(np.float16),
                    ((3 * r + 7 * h + d + i) % 1021).astype(np.float16)
                    if lc.components == 2 else None))
    return out


def oracle(tokens):
    """Final (conv, ssm) and every position's K/V rows, folding the model from zero state."""
    conv, ssm = np.zeros((L, *CONV), np.float16), np.zeros((L, *SSM), np.float32)
    rows = []
    for p, t in enumerate(tokens):
        conv, ssm = mamba_step(conv, ssm, t)
        rows.append(kv_rows(ssm, p))
    return conv, ssm, rows


def gather_kv(ctx, rid, n):
    """K/V of positions ``[0, n)`` of every layer, read through the block table."""
    blocks = ctx.block_ids(rid)
    pos = np.arange(n)
    return [host(layer)[blocks[pos // BS], :, :, pos % BS, :] for layer in ctx.kv_pool.layers]


def next_token(ctx, rid, n, ssm):
    """'Attention': a function of every cached K of layer 0 and the last Mamba layer."""
    k = gather_kv(ctx, rid, n)[0][:, 0]
    return int((k.astype(np.float64).sum() + ssm[-1, 0, -1]) % VOCAB)


def run_step(ctx, plans):
    """One forward pass over ``plans``: states, snapshots, KV writes; then commit."""
    xp = ctx.xp
    targets = {}
    for rid, off, idx in ctx.snapshot_targets():
        targets.setdefault(rid, {})[off] = idx
    mamba = ctx.mamba_slot_allocator
    ks = [[] for _ in ATTN]
    vs = [[] for _ in ATTN]
    finals = {}
    for plan in plans:
        slot = plan.mamba_slot
        conv = host(ctx.mamba_conv_states[:, slot]).copy()
        ssm = host(ctx.mamba_ssm_states[:, slot]).copy()
        for i, tok in enumerate(plan.tokens.tolist()):
            conv, ssm = mamba_step(conv, ssm, tok)
            for j, (k, v) in enumerate(kv_rows(ssm, plan.start + i)):
                ks[j].append(k)
                vs[j].append(v)
            idx = targets.get(plan.request_id, {}).get(i + 1)
            if idx is not None:
                mamba.intermediate_conv_out[:, idx] = xp.asarray(conv)
                mamba.intermediate_ssm_out[:, idx] = xp.asarray(ssm)
        ctx.mamba_conv_states[:, slot] = xp.asarray(conv)
        ctx.mamba_ssm_states[:, slot] = xp.asarray(ssm)
        finals[plan.request_id] = (plan.end, ssm)
    ctx.write_kv([p.request_id for p in plans], [xp.asarray(np.stack(k)) for k in ks],
                 [None if lc.components == 1 else xp.asarray(np.stack(v))
                  for lc, v in zip(ATTN, vs, strict=True)])
    out = {rid: next_token(ctx, rid, end, ssm) for rid, (end, ssm) in finals.items()}
    ctx.commit_step()
    check(ctx)
    return out


def check(ctx):
    ctx.check_invariants()      # the allocators', and the request table's block hashes


def serve(ctx, waves, *, batched=False):
    """Run ``waves`` of ``(request_id, prompt, num_generated)``: a wave's requests prefill in
    one step, decode together (``batched``: one ``extend_requests`` call per step, else one
    ``extend_request`` per request), and are released together. ``prompt`` may be a function
    of the results so far (multi-turn). Returns per request: generated tokens, the computed
    sequence, final live states and KV rows."""
    results = {}
    for wave in waves:
        prompts = {rid: (p(results) if callable(p) else list(p)) for rid, p, _ in wave}
        want = {rid: n for rid, _, n in wave}
        gen = {rid: [] for rid in want}
        plans = [ctx.add_request(rid, prompts[rid]) for rid in want]
        for plan in plans:
            assert plan.end - plan.start >= 1
        while True:
            out = run_step(ctx, plans)
            for rid, tok in out.items():
                gen[rid].append(tok)
            more = [rid for rid in want if len(gen[rid]) < want[rid]]
            if batched and more:
                plans = list(ctx.extend_requests(more, np.array([gen[r][-1] for r in more])))
            else:
                plans = [ctx.extend_request(rid, [gen[rid][-1]]) for rid in more]
            if not plans:
                break
        for rid in want:
            n = ctx.num_computed_tokens(rid)
            slot = ctx.mamba_slot(rid)
            results[rid] = dict(
                generated=gen[rid], sequence=prompts[rid] + gen[rid][:-1],
                conv=host(ctx.mamba_conv_states[:, slot]).copy(),
                ssm=host(ctx.mamba_ssm_states[:, slot]).copy(),
                kv=gather_kv(ctx, rid, n), stats=ctx.request_stats(rid))
        ctx.release_requests(list(want))
        check(ctx)
    return results


def make_ctx(device="cpu", *, caching=True, num_blocks=64, slots=16, max_requests=4,
             policy="lru", chunk=1, mamba_layers=L):
    return DynamicInferenceContext(
        kv_layer_configs=ATTN, num_blocks=num_blocks, block_size_tokens=BS,
        max_requests=max_requests, max_blocks_per_request=16, num_mamba_layers=mamba_layers,
        conv_states_shape=CONV, ssm_states_shape=SSM, kv_dtype="float16",
        conv_states_dtype="float16", ssm_states_dtype="float32", mamba_cache_slots=slots,
        mamba_chunk_size=chunk, enable_prefix_caching=caching, eviction_policy=policy,
        device=device)


def assert_exact(results, reference=None):
    """Every request matches the pure model fold (and the reference run, if given)."""
    for rid, res in results.items():
        seq = res["sequence"]
        conv, ssm, rows = oracle(seq)
        np.testing.assert_array_equal(res["conv"], conv, err_msg=f"{rid}: conv state")
        np.testing.assert_array_equal(res["ssm"], ssm, err_msg=f"{rid}: ssm state")
        for i, layer in enumerate(res["kv"]):
            assert layer.shape[1] == ATTN[i].components
            np.testing.assert_array_equal(layer[:, 0], np.stack([r[i][0] for r in rows]))
            if ATTN[i].components == 2:
                np.testing.assert_array_equal(layer[:, 1], np.stack([r[i][1] for r in rows]))
        if reference is not None:
            ref = reference[rid]
            assert res["generated"] == ref["generated"], rid
            assert res["conv"].tobytes() == ref["conv"].tobytes(), rid
            assert res["ssm"].tobytes() == ref["ssm"].tobytes(), rid
            for a, b in zip(res["kv"], ref["kv"], strict=True):
                assert a.tobytes() == b.tobytes(), rid


def compare(waves, device="cpu", *, batched=False, **kw):
    on, off = make_ctx(device, **kw), make_ctx(device, caching=False, **kw)
    cached, uncached = serve(on, waves, batched=batched), serve(off, waves)
    assert_exact(uncached)
    assert_exact(cached, uncached)
    return on, off, cached


# --- scenarios ----------------------------------------------------------------------------------

SYSTEM = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 3]      # 3 blocks


@pytest.mark.parametrize("device", DEVICES)
def test_overlapping_prompts(device, batched=False):
    waves = [
        [("a", SYSTEM + [11, 12, 13], 3)],
        [("b", SYSTEM + [21, 22], 2), ("c", SYSTEM + [31, 32, 33, 34, 35, 36], 2)],
        [("d", SYSTEM, 2), ("e", SYSTEM[:6], 1), ("f", SYSTEM + [11, 12, 13, 14, 15], 2)],
        [("g", SYSTEM + [31, 32, 33, 34, 35], 1), ("h", SYSTEM + [31, 32, 33, 34], 1)],
    ]
    on, off, res = compare(waves, device, batched=batched)
    assert on.stats.computed_tokens < off.stats.computed_tokens
    assert off.stats.skipped_tokens == 0 and on.stats.mamba_hits >= 6
    # b and c restore the system prompt's state (block 3 boundary) stored by a's prefill.
    assert res["b"]["stats"].skipped_tokens == 12 and res["c"]["stats"].skipped_tokens == 12
    # d repeats the block-aligned system prompt: it backs off to compute at least one token.
    assert 0 < res["d"]["stats"].computed_tokens - 1 <= BS
    # f extends a's prompt: a's prefill stored the last full block boundary (12) and decode
    # completed block 4 (a's tokens 12..15 = 11, 12, 13, gen0) only if gen0 == 14.
    assert res["f"]["stats"].skipped_tokens >= 12
    # g shares c's first 16 tokens: c's prefill snapshot at its last block boundary (16);
    # h is exactly those 16 tokens, so it backs off to the state at 12.
    assert res["g"]["stats"].skipped_tokens == 16
    assert res["h"]["stats"].skipped_tokens == 12


@pytest.mark.parametrize("device", DEVICES)
def test_multi_turn_continuation(device, batched=False):
    turn1 = [5, 6, 7, 8, 9, 1, 2, 3, 4, 10, 11]
    waves = [
        [("t1", turn1, 6)],
        [("t2", lambda r: r["t1"]["sequence"] + [r["t1"]["generated"][-1], 40, 41, 42], 4)],
        [("t3", lambda r: r["t2"]["sequence"] + [r["t2"]["generated"][-1], 43], 2)],
    ]
    on, off, res = compare(waves, device, batched=batched)
    # t1 computed 16 tokens (11 prompt + 5 fed back), so blocks 0..3 are cached with a decode
    # snapshot at 16; t2 restores there.
    assert res["t2"]["stats"].skipped_tokens == 16
    assert res["t3"]["stats"].skipped_tokens >= 20
    assert on.stats.computed_tokens < off.stats.computed_tokens - 30


@pytest.mark.parametrize("device", DEVICES)
def test_decode_through_extend_requests(device):
    """The scenarios above with every decode step one extend_requests call."""
    test_overlapping_prompts(device, batched=True)
    test_multi_turn_continuation(device, batched=True)
    for policy in ("lru", "ref_zero"):
        test_evictions_under_a_small_pool(device, policy, batched=True)


@pytest.mark.parametrize("device", DEVICES)
def test_latent_layers_end_to_end(device, monkeypatch):
    """The scenarios above with latent (MLA) attention layers among K/V ones: the pool gives
    each latent layer one plane, writes take ``v=None`` for it, and every cached KV byte and
    generated token matches the model fold and the uncached run."""
    monkeypatch.setattr(__import__(__name__), "ATTN", LATENT_ATTN)
    ctx = make_ctx(device)
    assert [tuple(a.shape[1:3]) for a in ctx.kv_pool.layers] == [(1, 1), (2, 2), (1, 1)]
    test_overlapping_prompts(device)
    test_multi_turn_continuation(device, batched=True)
    test_evictions_under_a_small_pool(device, "lru")


def test_same_step_duplicates_and_deferral():
    prompt = SYSTEM + [1, 2, 3, 4, 5]
    ctx = make_ctx()
    plans = [ctx.add_request(rid, prompt) for rid in ("x", "y")]
    assert ctx.shares_pending_blocks(prompt + [9])          # a scheduler can defer this one
    assert not ctx.shares_pending_blocks([1, 1, 1, 1])
    run_step(ctx, plans)
    # Only one copy of each block hash is registered; the duplicate blocks stay private.
    assert len(ctx.kv_block_allocator.kv_hash_to_block_id) == 4
    assert not ctx.shares_pending_blocks(prompt + [9])
    plan = ctx.add_request("z", prompt + [9])
    assert plan.skip_tokens == 16 and plan.num_matched_blocks == 4
    run_step(ctx, [plan])
    for rid in ("x", "y", "z"):
        n = ctx.num_computed_tokens(rid)
        slot = ctx.mamba_slot(rid)
        conv, ssm, _ = oracle((prompt + [9])[:n])
        np.testing.assert_array_equal(host(ctx.mamba_ssm_states[:, slot]), ssm)
    with pytest.raises(ValueError, match=r"request_ids: expected distinct request ids"):
        ctx.release_requests(["x", "y", "z", "x"])       # a repeated id changes nothing
    ctx.release_requests(["x", "y", "z"])
    check(ctx)
    assert ctx.num_active_requests == 0 and ctx.kv_block_allocator.num_used_blocks == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["lru", "ref_zero"])
def test_evictions_under_a_small_pool(device, policy, batched=False):
    rng = np.random.default_rng(3)
    prefixes = [SYSTEM, SYSTEM[::-1], [1, 2] * 5]
    waves = []
    for w in range(8):
        wave = []
        for j in range(2):
            p = prefixes[int(rng.integers(3))][: int(rng.integers(6, 13))]
            wave.append((f"r{w}.{j}", p + rng.integers(0, VOCAB, int(rng.integers(1, 6))).tolist(),
                         int(rng.integers(1, 4))))
        waves.append(wave)
    deregistered = []
    on = make_ctx(device, num_blocks=12, slots=3, max_requests=2, policy=policy)
    on.kv_block_allocator.add_blocks_deregistered_observer(
        lambda ids, hashes: deregistered.extend(ids))
    off = make_ctx(device, caching=False, num_blocks=12, slots=3, max_requests=2)
    cached, uncached = serve(on, waves, batched=batched), serve(off, waves)
    assert_exact(uncached)
    assert_exact(cached, uncached)
    assert deregistered, "the pool must have deregistered blocks"
    if policy == "lru":     # under ref_zero nothing outlives its requests: no hits across waves
        assert on.stats.computed_tokens < off.stats.computed_tokens
        assert on.stats.mamba_hits > 0 and on.kv_block_allocator.num_cached_blocks > 0


def test_memory_only_mode_shares_kv_without_skipping():
    waves = [[("a", SYSTEM + [1], 2)], [("b", SYSTEM + [2, 3], 2)]]
    on, off, res = compare(waves, slots=0)
    assert on.mamba_slot_allocator is None
    assert res["b"]["stats"].kv_hit_blocks == 3 and res["b"]["stats"].skipped_tokens == 0
    assert on.stats.computed_tokens == off.stats.computed_tokens


def test_snapshots_need_chunk_aligned_offsets():
    # With a 4-token scan chunk (= block size) mid-prefill snapshots still land on boundaries.
    waves = [[("a", SYSTEM + [1, 2, 3, 4, 5], 1)], [("b", SYSTEM + [1, 2, 3, 4, 6], 1)]]
    on, off, res = compare(waves, chunk=BS)
    assert res["b"]["stats"].skipped_tokens == 16


def test_attention_only_skip_rule():
    ctx = make_ctx(mamba_layers=0, slots=0)
    plan = ctx.add_request("a", SYSTEM)
    ctx.commit_step()
    plan = ctx.add_request("b", SYSTEM)          # all 3 blocks cached: compute the last token
    assert plan.skip_tokens == 11 and plan.start == 11 and plan.num_matched_blocks == 3
    plan = ctx.add_request("c", SYSTEM[:8] + [5])
    assert plan.skip_tokens == 8 and plan.restored_block == -1


# --- API errors ---------------------------------------------------------------------------------

def test_add_request_errors_change_nothing():
    ctx = make_ctx(num_blocks=6, max_requests=2)
    run_step(ctx, [ctx.add_request("a", SYSTEM)])
    with pytest.raises(ValueError, match="request_id"):
        ctx.add_request("a", [1])
    with pytest.raises(ValueError, match="tokens"):
        ctx.add_request("b", [])
    with pytest.raises(ValueError, match="tokens"):
        ctx.add_request("b", list(range(16 * BS + 1)))
    with pytest.raises(TypeError, match="tokens"):
        ctx.add_request("b", [1.5, 2.0])
    kv = ctx.kv_block_allocator
    state = (kv.block_ref_counts.copy(), kv.block_timestamps.copy(), kv.num_free_blocks,
             ctx.request_to_kv_block_ids.copy())
    with pytest.raises(CacheCapacityError):
        ctx.add_request("b", SYSTEM + list(range(13)))     # 3 matched + 4 new > 3 free
    assert (kv.block_ref_counts == state[0]).all() and (kv.block_timestamps == state[1]).all()
    assert kv.num_free_blocks == state[2]
    assert (ctx.request_to_kv_block_ids == state[3]).all() and ctx.num_active_requests == 1
    run_step(ctx, [ctx.add_request("b", [1, 2])])
    with pytest.raises(CacheCapacityError, match="rows"):
        ctx.add_request("c", [3])
    with pytest.raises(ValueError, match="request_id"):
        ctx.release_requests(["a", "nope"])
    assert ctx.num_active_requests == 2
    with pytest.raises(ValueError, match="request_id"):
        ctx.extend_request("nope", [1])
    ctx.extend_request("b", [3])
    with pytest.raises(ValueError, match="scheduled"):
        ctx.extend_request("b", [4])
    with pytest.raises(ValueError, match="scheduled"):
        ctx.write_kv(["a"], [], [])
    ctx.release_requests(["b"])          # releasing mid-step forgets the scheduled step
    assert ctx.snapshot_targets() == []
    ctx.reset()
    assert ctx.num_active_requests == 0 and kv.num_free_blocks == 6 and ctx.stats.requests == 0
    check(ctx)


# --- property: random workloads -----------------------------------------------------------------

@settings(max_examples=8)
@given(st.data())
def test_random_workloads_match_uncached(data):
    stems = [SYSTEM, [9, 9, 1, 2, 3, 4, 5, 6]]
    waves = []
    for w in range(data.draw(st.integers(2, 5))):
        wave = []
        for j in range(data.draw(st.integers(1, 3))):
            stem = data.draw(st.sampled_from(stems))
            cut = data.draw(st.integers(1, len(stem)))
            tail = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=6))
            wave.append((f"{w}.{j}", stem[:cut] + tail, data.draw(st.integers(1, 3))))
        waves.append(wave)
    policy = data.draw(st.sampled_from(["lru", "ref_zero"]))
    on, off, _ = compare(waves, num_blocks=14, slots=3, max_requests=3, policy=policy,
                         chunk=data.draw(st.sampled_from([1, 2, 4])),
                         batched=data.draw(st.booleans()))
    assert on.stats.computed_tokens <= off.stats.computed_tokens


def test_pure_mamba_model_reuses_cached_states():
    """No attention layer: KV blocks only carry the prefix hashes; Mamba states are restored
    from the cache and continue exactly as a recomputation from zero would."""
    ctx = DynamicInferenceContext(
        kv_layer_configs=[], num_blocks=32, block_size_tokens=BS, max_requests=2,
        max_blocks_per_request=8, num_mamba_layers=L, conv_states_shape=CONV,
        ssm_states_shape=SSM, conv_states_dtype="float16", ssm_states_dtype="float32",
        mamba_cache_slots=8, mamba_chunk_size=1, device="cpu")
    results = {}
    for rid, prompt in (("a", SYSTEM + [1, 2]), ("b", SYSTEM + [3, 4, 5])):
        plan = ctx.add_request(rid, prompt)
        targets = {off: idx for r, off, idx in ctx.snapshot_targets() if r == rid}
        conv = host(ctx.mamba_conv_states[:, plan.mamba_slot])
        ssm = host(ctx.mamba_ssm_states[:, plan.mamba_slot])
        for i, tok in enumerate(plan.tokens.tolist()):
            conv, ssm = mamba_step(conv, ssm, tok)
            if i + 1 in targets:
                ctx.mamba_slot_allocator.intermediate_conv_out[:, targets[i + 1]] = conv
                ctx.mamba_slot_allocator.intermediate_ssm_out[:, targets[i + 1]] = ssm
        ctx.mamba_conv_states[:, plan.mamba_slot] = conv
        ctx.mamba_ssm_states[:, plan.mamba_slot] = ssm
        ctx.write_kv([rid], [], [])
        ctx.commit_step()
        check(ctx)
        want_conv, want_ssm, _ = oracle(prompt)
        np.testing.assert_array_equal(conv, want_conv)
        np.testing.assert_array_equal(ssm, want_ssm)
        results[rid] = plan
        ctx.release_requests([rid])
    assert results["a"].skip_tokens == 0
    assert results["b"].skip_tokens == len(SYSTEM)       # 3 cached blocks restored
    assert results["b"].restored_block >= 0
