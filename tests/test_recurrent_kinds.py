"""Recurrent layers with one state only, through the managers: LFM2's short convolutions (a conv
state, no recurrent state) and MiniMax's lightning attention (a ``[heads, d, d]`` state, no conv
state), built from their real ``config.json`` values; Kimi Linear's KDA + MLA layout.

Views exist only for the states a layer has and the others raise ``ValueError``; nothing is
allocated for a missing state; capture / restore / compaction move exactly the states that exist
(the stateful machines of ``test_managers_stateful.py`` drive the batch API over these layouts on
the cpu device and the emulated kernels); prefix caching restores and snapshots a single state
kind, checked against a NumPy fold of a stand-in model and against the same workload uncached.
Each manager test runs on every device of ``helpers.DEVICES``, the asynchronous emulated device
(the CUDA path) included.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_hf_families import KIMI_LINEAR_48B, LFM2_1_2B, MINIMAX_M1, MINIMAX_TYPES

from hcache import (
    ContinuousBatchingKVCacheManager,
    HybridCacheConfig,
    HybridCacheManager,
    KVCacheStaticParams,
    LinearCacheConfig,
    LinearKVCache,
    ops,
)
from hcache.contexts import DynamicInferenceContext
from hcache.device import resolve_device

import helpers
from helpers import host, put

emu_mod = pytest.importorskip("emu")


DEVICES = helpers.DEVICES


def manager(cfg, batch=2, seq=16, device="cpu", **kw):
    config = HybridCacheConfig.from_hf_config(cfg, max_batch_size=batch,
                                              max_sequence_length=seq, **kw)
    return HybridCacheManager(config, device=device)


# MiniMax-M1 with its first eight layers (7 lightning + 1 softmax): the real head geometry, a
# state of 64 x 128 x 128 float32 per layer and slot.
MINIMAX_8 = {**MINIMAX_M1, "num_hidden_layers": 8, "attn_type_list": MINIMAX_TYPES[:8]}


@pytest.mark.parametrize("device", DEVICES)
def test_lfm2_views_exist_for_the_conv_state_only(device):
    m = manager(LFM2_1_2B, kv_dtype="bfloat16", device=device)
    conv_layer, attn_layer = 0, 2
    assert m.get_conv_state(conv_layer).shape == (2, 2048, 3)
    assert m.get_conv_state(conv_layer).dtype == m.get_combined_kv_cache(attn_layer).dtype
    with pytest.raises(ValueError,
                       match=r"^i: expected a layer with a recurrent state, got layer 0\b"):
        m.get_recurrent_state(conv_layer)
    with pytest.raises(ValueError,
                       match=r"^i: expected an attention layer, got layer 0\b"):
        m.get_combined_kv_cache(conv_layer)
    with pytest.raises(ValueError,
                       match=r"^i: expected a Mamba layer, got layer 2\b"):
        m.get_conv_state(attn_layer)
    assert m.get_combined_kv_cache(attn_layer).shape == (2, 2, 8, 16, 64)
    mamba = m.mamba_cache_manager
    with pytest.raises(ValueError, match="recurrent state"):
        mamba.get_recurrent_state(0)
    report = m.memory_report()
    assert report["recurrent"] == 0
    assert report["conv"] == 10 * 2 * 2048 * 3 * 2
    assert report["layers"][0] == 2 * 2048 * 3 * 2 and report["layers"][1] == 2 * 2048 * 3 * 2
    assert len(mamba.state_tensors) == 10


@pytest.mark.parametrize("device", DEVICES)
def test_minimax_views_exist_for_the_lightning_state_only(device):
    m = manager(MINIMAX_8, batch=1, device=device)
    assert m.get_recurrent_state(0).shape == (1, 64, 128, 128)
    assert m.get_recurrent_state(0).dtype == np.float32
    with pytest.raises(ValueError,
                       match=r"^i: expected a layer with a conv state, got layer 3\b"):
        m.get_conv_state(3)
    with pytest.raises(ValueError,
                       match=r"^i: expected an attention layer, got layer 6\b"):
        m.get_combined_kv_cache(6)
    assert m.get_combined_kv_cache(7).shape == (1, 2, 8, 16, 128)
    report = m.memory_report()
    assert report["conv"] == 0 and report["recurrent"] == 7 * 64 * 128 * 128 * 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [LFM2_1_2B, MINIMAX_8])
def test_capture_and_restore_move_only_the_states_that_exist(cfg, device):
    m = manager(cfg, batch=3, device=device)
    has_rec = m.mamba_cache_manager.config.has_recurrent_state
    views = list(m.mamba_cache_manager.state_tensors)
    rng = np.random.default_rng(0)
    for v in views:
        put(v, rng.integers(0, 100, v.shape).astype(host(v[:0]).dtype))
    before = [host(v).copy() for v in views]
    rec, conv = m.capture_recurrent_states(1), m.capture_conv_states(1)
    assert (len(rec) > 0, len(conv) > 0) == (has_rec, not has_rec)
    m.restore_mamba_states(rec, conv, 2)
    for v, old in zip(views, before, strict=True):
        np.testing.assert_array_equal(host(v)[2], old[1])
        np.testing.assert_array_equal(host(v)[:2], old[:2])
    # The missing kind takes an empty list and nothing else; a refusal changes nothing.
    saved = rec or conv
    with pytest.raises(ValueError, match="expected 0 tensors"):
        m.restore_mamba_states(saved, saved, 0)
    for v, old in zip(views, before, strict=True):
        np.testing.assert_array_equal(host(v)[:2], old[:2])
    # Compaction moves the existing states with the lengths.
    m.reset_for_new_sequences([0, 0, 0])
    m.compact_batch(np.array([-1, 0, 1], np.int32), old_batch=3, new_batch=2)
    for v, old in zip(views, before, strict=True):
        np.testing.assert_array_equal(host(v)[0], old[1])
        np.testing.assert_array_equal(host(v)[1], old[1])   # slot 2 held slot 1's state


@pytest.mark.parametrize("device", DEVICES)
def test_linear_cache_with_conv_only_layers(device):
    cfg = LinearCacheConfig(2, 2, 8, 2, 8, num_mamba_layers=3, conv_dim=6, conv_kernel=4)
    m = LinearKVCache(cfg, device=device)
    assert m.get_conv_state_for_layer(2).shape == (2, 6, 4)
    with pytest.raises(ValueError, match="recurrent state"):
        m.get_ssm_state_for_layer(0)
    assert m.capture_ssm_states(0) == [] and len(m.capture_conv_states(0)) == 3
    assert m.memory_report()["recurrent"] == 0
    with pytest.raises(ValueError, match="ssm_state_size"):
        LinearCacheConfig(2, 2, 8, 2, 8, num_mamba_layers=3, mamba_num_heads=2, conv_dim=6,
                          conv_kernel=4)


def test_kimi_linear_layout_at_the_config_level():
    c = HybridCacheConfig.from_hf_config(KIMI_LINEAR_48B, max_batch_size=2,
                                         max_sequence_length=64)
    assert c.kv.num_attention_layers == 7
    assert {lc.components for lc in c.kv.layer_configs} == {1}
    assert c.mamba.recurrent_state_shape == (32, 128, 128)


KIMI_SMALL = {**KIMI_LINEAR_48B, "num_hidden_layers": 4, "kv_lora_rank": 16,
              "qk_rope_head_dim": 8,
              "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3],
                                     "num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4}}


@pytest.mark.parametrize("device", DEVICES)
def test_kimi_linear_through_the_manager(device):
    m = manager(KIMI_SMALL, device=device)
    assert m.get_combined_kv_cache(3).shape == (2, 1, 1, 16, 24)
    assert m.get_recurrent_state(0).shape == (2, 2, 8, 8)
    assert m.get_conv_state(0).shape == (2, 3 * 2 * 8, 4)
    with pytest.raises(ValueError, match="expected an attention layer"):
        m.get_combined_kv_cache(0)


@pytest.mark.parametrize("device", DEVICES)
def test_continuous_batching_serves_the_attention_layers_of_a_conv_hybrid(device):
    layout = HybridCacheConfig.from_hf_config(LFM2_1_2B, max_batch_size=2,
                                              max_sequence_length=16)
    kv = layout.kv.layer_configs
    params = KVCacheStaticParams(kv[0].num_kv_heads, kv[0].head_dim)
    cb = ContinuousBatchingKVCacheManager("float16", params, 2, 16, len(kv), device=device)
    xp = resolve_device(device).xp
    (sid,) = cb.claim(1)
    batch = cb.fetch([sid])
    rows = np.arange(3 * 8 * 64, dtype=np.float16).reshape(1, 3, 8, 64)
    for layer in range(len(kv)):
        batch.write(layer, xp.asarray(rows + layer), xp.asarray(rows - layer))
    cb.step(np.array([3]), batch)
    block = int(host(batch.lookup_table)[0])
    np.testing.assert_array_equal(host(batch.key_cache(5))[block, :3], rows[0] + 5)
    np.testing.assert_array_equal(host(batch.value_cache(5))[block, :3], rows[0] - 5)


# --- prefix caching with one state kind ----------------------------------------------------------

BS, L, VOCAB, P = 4, 2, 50, 65521
SHAPES = {"conv": (3, 4), "ssm": (2, 3, 3)}     # a short-conv window; a lightning [h, d, d]
ATTN = HybridCacheConfig.from_hf_config(
    {**LFM2_1_2B, "num_hidden_layers": 2, "layer_types": ["conv", "full_attention"],
     "full_attn_idxs": [1], "hidden_size": 64, "num_attention_heads": 4,
     "num_key_value_heads": 2},
    max_batch_size=1, max_sequence_length=8).kv.layer_configs * 2


def state_step(state, tok):
    """Advance every layer by one token: shift in a rolling hash of the whole state (so the
    state depends on the whole history; exact in float32)."""
    flat = state.reshape(L, -1).astype(np.float64)
    new = (3 * flat.sum(axis=1) + tok * (np.arange(L) + 1) + 1) % P
    return np.concatenate([flat[:, 1:], new[:, None]], axis=1).reshape(state.shape).astype(
        np.float32)


def kv_rows(state, pos):
    r = int(state.sum()) % 1021
    return [(np.full((lc.num_kv_heads, lc.head_dim), (r + pos + i) % 1021, np.float16),
             np.full((lc.num_kv_heads, lc.head_dim), (3 * r + i) % 1021, np.float16))
            for i, lc in enumerate(ATTN)]


def oracle(kind, tokens):
    state, rows = np.zeros((L, *SHAPES[kind]), np.float32), []
    for p, t in enumerate(tokens):
        state = state_step(state, t)
        rows.append(kv_rows(state, p))
    return state, rows


def live(ctx, kind):
    return ctx.mamba_conv_states if kind == "conv" else ctx.mamba_ssm_states


def run_step(ctx, kind, plans):
    xp, alloc = ctx.xp, ctx.mamba_slot_allocator
    scratch = None if alloc is None else getattr(alloc, f"intermediate_{kind}_out")
    targets = {}
    for rid, off, idx in ctx.snapshot_targets():
        targets.setdefault(rid, {})[off] = idx
    ks, vs, finals = [[] for _ in ATTN], [[] for _ in ATTN], {}
    for plan in plans:
        state = host(live(ctx, kind)[:, plan.mamba_slot]).copy()
        for i, tok in enumerate(plan.tokens.tolist()):
            state = state_step(state, tok)
            for j, (k, v) in enumerate(kv_rows(state, plan.start + i)):
                ks[j].append(k)
                vs[j].append(v)
            if (idx := targets.get(plan.request_id, {}).get(i + 1)) is not None:
                scratch[:, idx] = xp.asarray(state)
        live(ctx, kind)[:, plan.mamba_slot] = xp.asarray(state)
        finals[plan.request_id] = state
    ctx.write_kv([p.request_id for p in plans], [xp.asarray(np.stack(k)) for k in ks],
                 [xp.asarray(np.stack(v)) for v in vs])
    out = {rid: int(s.sum()) % VOCAB for rid, s in finals.items()}
    ctx.commit_step()
    ctx.check_invariants()
    return out


def serve(ctx, kind, waves):
    results = {}
    for wave in waves:
        gen = {rid: [] for rid, _, _ in wave}
        plans = [ctx.add_request(rid, prompt) for rid, prompt, _ in wave]
        while plans:
            for rid, tok in run_step(ctx, kind, plans).items():
                gen[rid].append(tok)
            plans = [ctx.extend_request(rid, [gen[rid][-1]]) for rid, _, n in wave
                     if len(gen[rid]) < n]
        for rid, prompt, _ in wave:
            n = ctx.num_computed_tokens(rid)
            blocks, pos = ctx.block_ids(rid), np.arange(n)
            results[rid] = dict(
                sequence=prompt + gen[rid][:-1], generated=gen[rid],
                state=host(live(ctx, kind)[:, ctx.mamba_slot(rid)]).copy(),
                kv=[host(layer)[blocks[pos // BS], :, :, pos % BS, :]
                    for layer in ctx.kv_pool.layers],
                stats=ctx.request_stats(rid))
        ctx.release_requests([rid for rid, _, _ in wave])
    return results


def make_ctx(kind, caching, device="cpu"):
    shapes = {f"{k}_states_shape": (SHAPES[k] if k == kind else None) for k in SHAPES}
    return DynamicInferenceContext(
        kv_layer_configs=ATTN, num_blocks=48, block_size_tokens=BS, max_requests=3,
        max_blocks_per_request=12, num_mamba_layers=L, **shapes, kv_dtype="float16",
        conv_states_dtype="float32", ssm_states_dtype="float32", mamba_cache_slots=12,
        enable_prefix_caching=caching, device=device)


SYSTEM = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 3]


@pytest.mark.parametrize("backend", ["reference", pytest.param("emu", marks=pytest.mark.emu),
                                     pytest.param("emulated", marks=pytest.mark.emulated)])
@pytest.mark.parametrize("kind", ["conv", "ssm"])
def test_prefix_caching_restores_and_snapshots_a_single_state_kind(kind, backend, request):
    """On the cpu device (the NumPy reference or the host-emulated kernels) or on the emulated
    device (the CUDA path, cached run on a non-blocking stream): both runs give the model's
    states, KV rows and tokens."""
    waves = [[("a", SYSTEM + [11, 12, 13], 3)],
             [("b", SYSTEM + [21, 22], 2), ("c", SYSTEM + [31, 32, 33, 34, 35, 36], 2)],
             [("d", SYSTEM + [31, 32, 33, 34, 35], 1)]]
    other = "ssm" if kind == "conv" else "conv"
    device = "cuda" if backend == "emulated" else "cpu"
    on, off = make_ctx(kind, True, device), make_ctx(kind, False, device)
    assert live(on, other) is None and getattr(on.mamba_slot_allocator, f"{other}_states") is None
    if backend == "emu":
        if not emu_mod.have_compiler():  # pragma: no cover
            pytest.skip("no host C++ compiler")
        launcher = emu_mod.EmuLauncher()
        with ops.host_backend(launcher):
            cached = serve(on, kind, waves)
        assert any("slot_copy" in name for name, _, _ in launcher.launches), launcher.launches
    elif backend == "emulated":   # a non-blocking stream current: no legacy-stream ordering
        rt = request.getfixturevalue("emu_rt")
        with rt.stream(non_blocking=True):
            cached = serve(on, kind, waves)
        assert any("slot_copy" in name for name in rt.launches), rt.launches
    else:
        cached = serve(on, kind, waves)
    uncached = serve(off, kind, waves)
    for rid, res in cached.items():
        state, rows = oracle(kind, res["sequence"])
        np.testing.assert_array_equal(res["state"], state, err_msg=rid)
        for i, layer in enumerate(res["kv"]):
            np.testing.assert_array_equal(layer[:, 0], np.stack([r[i][0] for r in rows]))
            np.testing.assert_array_equal(layer[:, 1], np.stack([r[i][1] for r in rows]))
        assert res["generated"] == uncached[rid]["generated"], rid
    # b and c restore the system prompt's state (stored at a's block-3 boundary); d restores
    # c's snapshot at its last block boundary (16 tokens).
    assert cached["b"]["stats"].skipped_tokens == 12 == cached["c"]["stats"].skipped_tokens
    assert cached["d"]["stats"].skipped_tokens == 16
    assert on.stats.mamba_hits == 3 and off.stats.skipped_tokens == 0


@pytest.mark.parametrize("device", DEVICES)
def test_context_refuses_missing_both_states_and_a_state_for_a_missing_kind(device):
    with pytest.raises(ValueError, match="ssm_states_shape"):
        DynamicInferenceContext(kv_layer_configs=ATTN, num_blocks=8, block_size_tokens=BS,
                                max_requests=2, max_blocks_per_request=4, num_mamba_layers=L,
                                conv_states_shape=None, ssm_states_shape=None,
                                mamba_cache_slots=4, device="cpu")
    ctx = make_ctx("conv", True, device)
    alloc = ctx.mamba_slot_allocator
    (block,) = ctx.kv_block_allocator.allocate_memory_blocks(1)
    alloc.allocate_slots_batch([block])
    conv = np.ones(SHAPES["conv"], np.float32)
    with pytest.raises(ValueError, match="ssm_state: expected None"):
        alloc.store_from_tensors(block, 0, np.zeros(SHAPES["ssm"], np.float32), conv)
    assert not host(alloc.conv_states).any()
    alloc.store_from_tensors(block, 1, None, conv)   # a host state (staged on a device)
    slot = alloc.get_slot(block)
    np.testing.assert_array_equal(host(alloc.conv_states)[1, slot], conv)
    alloc.store_from_tensors(block, 0, None, ctx.xp.asarray(conv * 2))   # a device array
    np.testing.assert_array_equal(host(alloc.conv_states)[0, slot], conv * 2)
