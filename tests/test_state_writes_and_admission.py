"""Batched state writes (``write_states``), per-slot admission (``admit_sequences``) and the
keyed prompt store (``PromptCacheStore``) of the contiguous-slot managers (issue 25, items 3-4).

Oracles: a NumPy model of the slots (``model[slot] = row``), the lengths written by hand, the
bytes of a slot captured before; on the emulated device also the launches, allocations and
syncs the runtime counts (one launch for every state written; none of the other two).
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import hcache

from helpers import DEVICES, host, randomize

B, S = 6, 16
KV = hcache.KVCacheConfig(B, S, [hcache.KVLayerConfig(2, 8), hcache.KVLayerConfig(1, 16)],
                          "bfloat16")
MAMBA = hcache.MambaCacheConfig(3, B, 2, 4, 3, 5, 4, ssm_dtype="float32", conv_dtype="bfloat16")
TYPES = ["mamba", "attention", "mamba", "none", "attention", "mamba"]
MAMBA_LAYERS = [0, 2, 5]


def hybrid(device="cpu", mamba=MAMBA):
    return hcache.HybridCacheManager(hcache.HybridCacheConfig(TYPES, KV, mamba, B),
                                     device=device)


def states(m):
    """Host copies of every recurrent and conv state, by Mamba index."""
    return ([host(m.get_recurrent_state(i)) for i in MAMBA_LAYERS],
            [host(m.get_conv_state(i)) for i in MAMBA_LAYERS])


def same(a, b) -> bool:
    """Byte equality (random bytes hold NaNs)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def rows_like(view, n, rng, xp=np):
    a = rng.standard_normal((n, *view.shape[1:])).astype(np.float32)
    return xp.asarray(a.astype(view.dtype) if view.dtype != np.uint16 else a.view(np.uint16))


# --- write_states ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_write_states_every_layer_lands_rows_at_their_slots(device):
    m = hybrid(device)
    rng = np.random.default_rng(0)
    randomize([*m.mamba_cache_manager.state_tensors], rng)
    before_rec, before_conv = states(m)
    slots = [4, 0, 2]
    xp = m.device.xp
    rec = [rows_like(m.get_recurrent_state(i), 3, rng, xp) for i in MAMBA_LAYERS]
    conv = [rows_like(m.get_conv_state(i), 3, rng, xp) for i in MAMBA_LAYERS]
    m.write_states(None, rec, conv, slots=slots)
    after_rec, after_conv = states(m)
    for j in range(3):
        want_rec, want_conv = before_rec[j].copy(), before_conv[j].copy()
        want_rec[slots] = host(rec[j])
        want_conv[slots] = host(conv[j])
        assert same(after_rec[j], want_rec)
        assert same(after_conv[j], want_conv)


@pytest.mark.parametrize("device", DEVICES)
def test_write_states_one_layer_one_kind_leaves_the_rest(device):
    m = hybrid(device)
    rng = np.random.default_rng(1)
    randomize([*m.mamba_cache_manager.state_tensors], rng)
    before_rec, before_conv = states(m)
    rec = rows_like(m.get_recurrent_state(2), 2, rng, m.device.xp)
    m.write_states(2, rec, slots=[5, 1])          # decoder layer 2 = Mamba index 1
    after_rec, after_conv = states(m)
    want = before_rec[1].copy()
    want[[5, 1]] = host(rec)
    assert same(after_rec[1], want)
    for j in (0, 2):
        assert same(after_rec[j], before_rec[j])
    for j in range(3):
        assert same(after_conv[j], before_conv[j])


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_write_states_matches_a_model_of_the_slots(data):
    m = hybrid()
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    model_rec, model_conv = states(m)
    for _ in range(data.draw(st.integers(1, 4))):
        n = data.draw(st.integers(0, B))
        slots = data.draw(st.permutations(range(B)))[:n]
        layer = data.draw(st.sampled_from([None, *MAMBA_LAYERS]))
        kinds = data.draw(st.sampled_from([("rec",), ("conv",), ("rec", "conv")]))
        targets = range(3) if layer is None else [MAMBA_LAYERS.index(layer)]
        rec = [rows_like(m.get_recurrent_state(MAMBA_LAYERS[j]), n, rng) for j in targets]
        conv = [rows_like(m.get_conv_state(MAMBA_LAYERS[j]), n, rng) for j in targets]
        for j, r, c in zip(targets, rec, conv):
            if "rec" in kinds:
                model_rec[j][slots] = r
            if "conv" in kinds:
                model_conv[j][slots] = c
        pick = (lambda a: a) if layer is None else (lambda a: a[0])
        m.write_states(layer, pick(rec) if "rec" in kinds else None,
                       pick(conv) if "conv" in kinds else None,
                       slots=None if data.draw(st.booleans()) and slots == list(range(n))
                       else slots)
    got_rec, got_conv = states(m)
    for j in range(3):
        assert same(got_rec[j], model_rec[j])
        assert same(got_conv[j], model_conv[j])


def test_write_states_without_slots_is_rows_to_slots_in_order():
    m = hybrid()
    rec = [np.full((2, 2, 4, 3), j + 1.0, np.float32) for j in range(3)]
    m.write_states(None, rec)
    assert host(m.get_recurrent_state(5))[:, 0, 0, 0].tolist() == [3, 3, 0, 0, 0, 0]


def test_write_states_on_the_mamba_and_linear_managers():
    mm = hcache.MambaCacheManager(MAMBA, device="cpu")
    conv = np.ones((1, 5, 4), mm.get_conv_state(0).dtype)
    mm.write_states(1, None, conv, slots=[3])
    assert host(mm.get_conv_state(1))[:, 0, 0].astype(np.float32).tolist() == [0, 0, 0, 1, 0, 0]
    lin = hcache.LinearKVCache(hcache.LinearCacheConfig(
        1, 4, 8, 1, 8, num_mamba_layers=2, mamba_num_heads=1, mamba_head_dim=2,
        ssm_state_size=3, conv_dim=4, conv_kernel=2), device="cpu")
    rec = [np.full((2, 1, 2, 3), 7, np.float32)] * 2
    lin.write_states(None, rec, slots=[2, 0])
    assert host(lin.get_recurrent_state(1))[:, 0, 0, 0].tolist() == [7, 0, 7, 0]
    assert lin.get_recurrent_state(1) is not None
    assert np.shares_memory(lin.get_recurrent_state(0), lin.get_ssm_state_for_layer(0))


@pytest.mark.parametrize("call, error, match", [
    (lambda m, r, c: m.write_states(1, r[0]), ValueError, "layer: expected a Mamba layer"),
    (lambda m, r, c: m.write_states(None, r[0]), TypeError, "recurrent: expected a list"),
    (lambda m, r, c: m.write_states(None, r[:2]), ValueError, "expected 3 arrays"),
    (lambda m, r, c: m.write_states(None, None, None), ValueError, "got None for both"),
    (lambda m, r, c: m.write_states(None, r, slots=[0, 0]), ValueError, "distinct"),
    (lambda m, r, c: m.write_states(None, r, slots=[0, 6]), IndexError, r"\[0, 6\)"),
    (lambda m, r, c: m.write_states(None, r, slots=[0]), ValueError, "expected 2 slots"),
    (lambda m, r, c: m.write_states(None, r, [x[:1] for x in c]), ValueError, "expected 2 rows"),
    (lambda m, r, c: m.write_states(None, [x.astype(np.float16) for x in r]), ValueError,
     "dtype"),
    (lambda m, r, c: m.write_states(None, [x[:, :, :, :2] for x in r]), ValueError, "shape"),
    (lambda m, r, c: m.write_states(None, r, c, stream="s"), TypeError, "stream"),
])
def test_write_states_refuses_bad_arguments_and_changes_nothing(call, error, match):
    m = hybrid()
    randomize([*m.mamba_cache_manager.state_tensors], np.random.default_rng(3))
    before = [s.copy() for s in m.mamba_cache_manager.state_tensors]
    rec = [np.zeros((2, 2, 4, 3), np.float32) for _ in range(3)]
    conv = [np.zeros((2, 5, 4), m.get_conv_state(0).dtype) for _ in range(3)]
    with pytest.raises(error, match=match):
        call(m, rec, conv)
    for a, b in zip(before, m.mamba_cache_manager.state_tensors):
        assert same(a, b)


def test_write_states_of_a_state_the_layers_do_not_have():
    conv_only = hcache.MambaCacheConfig(3, B, 0, 0, 0, 5, 4)
    m = hybrid(mamba=conv_only)
    with pytest.raises(ValueError, match="recurrent: expected None"):
        m.write_states(None, [np.zeros((1, 2, 4, 3), np.float32)] * 3)


# --- admission ------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_admit_leaves_other_rows_alone_and_grows_the_batch(device):
    m = hybrid(device)
    m.reset_for_new_sequences([3, 4, 5])
    m.commit_sequence_length(2)
    m.compact_batch(np.array([0, -1, 1], np.int32), 3, 2)    # lengths [5, 7]
    m.admit_sequences([2], [9])                               # the restored request
    assert m.active_batch_size == 3
    assert host(m.get_kv_cache_lengths()).tolist() == [5, 7, 9]
    m.admit_sequences([0, 4, 3], [1, 2, 0])                   # replace row 0, append 3 and 4
    assert host(m.get_kv_cache_lengths()).tolist() == [1, 7, 9, 0, 2]
    m.commit_sequence_length(1)
    assert host(m.get_kv_cache_lengths()).tolist() == [2, 8, 10, 1, 3]
    assert not m.kv_cache_all_empty


def test_admit_with_a_device_commit_pending_needs_no_host_read(emu_rt):
    m = hybrid("cuda")
    m.reset_for_new_sequences([1, 2])
    m.commit_sequence_length(emu_rt.xp.asarray(np.array([3, 4], np.int32)))   # lengths unknown
    emu_rt.synchronize()
    syncs, allocations = emu_rt.counters["syncs"], emu_rt.counters["allocations"]
    launches = len(emu_rt.launches)
    m.admit_sequences([2], [5])
    assert emu_rt.counters["syncs"] == syncs
    emu_rt.synchronize()
    assert emu_rt.counters["allocations"] == allocations
    assert len(emu_rt.launches) - launches == 1
    assert host(m.get_kv_cache_lengths()).tolist() == [4, 6, 5]


test_admit_with_a_device_commit_pending_needs_no_host_read = pytest.mark.emulated(
    test_admit_with_a_device_commit_pending_needs_no_host_read)


@pytest.mark.parametrize("slots, lengths, error, match", [
    ([3], [1], ValueError, r"missing 2"),           # would expose slot 2's stale length
    ([1, 1], [1, 2], ValueError, "distinct"),
    ([6], [1], IndexError, r"\[0, 6\)"),
    ([2], [1, 2], ValueError, "expected 1 lengths"),
    ([2], [S + 1], ValueError, r"lengths\[0\]"),
    ([2], [-1], ValueError, r"lengths\[0\]"),
    ([2.5], [1], TypeError, "slots"),
])
def test_admit_refuses_and_changes_nothing(slots, lengths, error, match):
    m = hybrid()
    m.reset_for_new_sequences([3, 4])
    with pytest.raises(error, match=match):
        m.admit_sequences(slots, lengths)
    assert m.active_batch_size == 2 and m.get_kv_cache_lengths().tolist() == [3, 4]


# --- the prompt store -----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_prompt_store_restores_one_prompt_into_several_slots(device):
    m = hybrid(device)
    rng = np.random.default_rng(5)
    m.reset_for_new_sequences([0])
    xp = m.device.xp
    dtype = m.get_combined_kv_cache(1).dtype
    ks = [xp.asarray(rng.standard_normal((1, 4, h, d)).astype(np.float32).astype(dtype)
                     if dtype != np.uint16 else rng.integers(0, 2**16, (1, 4, h, d), np.uint16))
          for h, d in ((2, 8), (1, 16))]
    m.write_kv(None, ks, ks)
    m.commit_sequence_length(4)
    rec = [rows_like(m.get_recurrent_state(i), 1, rng, xp) for i in MAMBA_LAYERS]
    conv = [rows_like(m.get_conv_state(i), 1, rng, xp) for i in MAMBA_LAYERS]
    m.write_states(None, rec, conv)
    store = hcache.PromptCacheStore(m)
    store.capture("system", 0, 4)
    assert "system" in store and len(store) == 1 and store.get("system").length == 4
    saved_kv = [host(a) for a in store.get("system").kv]
    m.reset_for_new_sequences([6, 2, 3])                        # a running batch
    randomize([m.get_combined_kv_cache(1), m.get_combined_kv_cache(4)], rng)
    others = [host(m.get_combined_kv_cache(layer))[[0, 2]] for layer in (1, 4)]
    store.restore("system", [1, 3])
    assert host(m.get_kv_cache_lengths()).tolist() == [6, 4, 3, 4]
    for j, layer in enumerate((1, 4)):
        cache = host(m.get_combined_kv_cache(layer))
        for slot in (1, 3):
            assert same(cache[slot][:, :, :4], saved_kv[j])
        assert same(cache[[0, 2]], others[j])           # other rows untouched
    got_rec, got_conv = states(m)
    for j in range(3):
        assert same(got_rec[j][[1, 3]], np.repeat(host(rec[j]), 2, axis=0))
        assert same(got_conv[j][[1, 3]], np.repeat(host(conv[j]), 2, axis=0))
    store.discard("system")
    assert "system" not in store and store.keys() == []


@pytest.mark.emulated
def test_prompt_store_restore_allocates_and_synchronizes_nothing(emu_rt):
    m = hybrid("cuda")
    m.reset_for_new_sequences([5])
    store = hcache.PromptCacheStore(m)
    store.capture("p", 0, 5)
    m.reset_for_new_sequences([1, 2])
    emu_rt.synchronize()
    syncs, allocations = emu_rt.counters["syncs"], emu_rt.counters["allocations"]
    launches = len(emu_rt.launches)
    store.restore("p", [2, 3, 4])
    assert emu_rt.counters["syncs"] == syncs
    emu_rt.synchronize()
    assert emu_rt.counters["allocations"] == allocations
    # states: 1 launch; KV: one per head-dim group (2) for the three slots; lengths: 1
    assert len(emu_rt.launches) - launches == 1 + 2 + 1
    assert host(m.get_kv_cache_lengths()).tolist() == [1, 2, 5, 5, 5]


def test_prompt_store_refusals_change_nothing():
    m = hybrid()
    m.reset_for_new_sequences([5, 1])
    store = hcache.PromptCacheStore(m)
    store.capture("p", 0, 5)
    with pytest.raises(ValueError, match="stored key"):
        store.restore("q", [2])
    with pytest.raises(ValueError, match="missing 2"):
        store.restore("p", [3])
    with pytest.raises(TypeError, match="key: expected a hashable"):
        store.capture([1], 0, 5)
    with pytest.raises(TypeError, match="manager: expected HybridCacheManager"):
        hcache.PromptCacheStore(object())
    assert m.get_kv_cache_lengths().tolist() == [5, 1] and m.active_batch_size == 2


@pytest.mark.emulated
def test_write_states_with_device_slots_in_one_launch_without_sync(emu_rt):
    m = hybrid("cuda")
    xp = emu_rt.xp
    rec = [xp.asarray(np.full((2, 2, 4, 3), j + 1.0, np.float32)) for j in range(3)]
    slots = xp.asarray(np.array([5, 2], np.int32))
    emu_rt.synchronize()
    syncs, allocations = emu_rt.counters["syncs"], emu_rt.counters["allocations"]
    launches = len(emu_rt.launches)
    m.write_states(None, rec, slots=slots)
    assert emu_rt.counters["syncs"] == syncs
    emu_rt.synchronize()
    assert emu_rt.counters["allocations"] == allocations
    assert len(emu_rt.launches) - launches == 1
    got = host(m.get_recurrent_state(5))[:, 0, 0, 0]
    assert got.tolist() == [0, 0, 3, 0, 0, 3]
