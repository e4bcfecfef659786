"""HybridCacheManager (docs/design.md §4): routing by absolute layer index, head-dim group
views, prompt-cache capture/restore, hybrid compaction and the memory report."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import numpy as np
import pytest

from hcache.config.caches import (
    HybridCacheConfig,
    KVCacheConfig,
    KVLayerConfig,
    LayerType,
    LinearCacheConfig,
    MambaCacheConfig,
)
from hcache.device import data_pointer
from hcache.dtypes import DTYPE_NAMES
from hcache.slots.hybrid import HybridCacheManager, KVHeadDimGroupView
from hcache.slots.linear import LinearKVCache

import helpers
from helpers import host, randomize

DEVICES = helpers.DEVICES
B, S = 4, 9
A, M, AM, N = (LayerType.ATTENTION, LayerType.MAMBA, LayerType.ATTENTION_AND_MAMBA,
               LayerType.NONE)
# Absolute layers: 0 M, 1 A(80), 2 N, 3 AM(8), 4 A shared with 1, 5 M, 6 A(36), 7 A(80)
TYPES = [M, A, N, AM, A, M, A, A]
SHARING = {4: 1}
OWNERS = [1, 3, 6, 7]            # cache-owning attention layers, absolute order
KV_LAYERS = [KVLayerConfig(2, 80), KVLayerConfig(1, 8), KVLayerConfig(3, 36),
             KVLayerConfig(1, 80)]
MAMBA_LAYERS = [0, 3, 5]




def config(kv_dtype="float16", ssm="float32", conv="float16", max_batch=B):
    kv = KVCacheConfig(max_batch, S, KV_LAYERS, kv_dtype)
    mamba = MambaCacheConfig(3, max_batch, 2, 4, 3, 5, 4, ssm_dtype=ssm, conv_dtype=conv)
    return HybridCacheConfig(TYPES, kv, mamba, max_batch, kv_sharing=SHARING)


def manager(device="cpu", **kw):
    return HybridCacheManager(config(**kw), device=device)



def kv_caches(m):
    return [m.get_combined_kv_cache(i) for i in OWNERS]


def states(m):
    return ([m.get_recurrent_state(i) for i in MAMBA_LAYERS]
            + [m.get_conv_state(i) for i in MAMBA_LAYERS])


# --- routing --------------------------------------------------------------------------------

def test_routing_by_absolute_index():
    m = manager()
    assert m.num_layers == len(TYPES)
    assert [m.get_layer_type(i) for i in range(len(TYPES))] == TYPES
    kvm, mm = m.kv_cache_manager, m.mamba_cache_manager
    assert kvm.num_layers == 4 and mm.num_layers == 3
    for local, absolute in enumerate(OWNERS):
        assert m.get_combined_kv_cache(absolute) is kvm.get_combined_kv_cache(local)
        lc = KV_LAYERS[local]
        assert m.get_combined_kv_cache(absolute).shape == (B, 2, lc.num_kv_heads, S, lc.head_dim)
    for local, absolute in enumerate(MAMBA_LAYERS):
        assert m.get_recurrent_state(absolute) is mm.get_recurrent_state(local)
        assert m.get_conv_state(absolute) is mm.get_conv_state(local)


def test_shared_layer_reads_its_owners_cache():
    m = manager()
    assert data_pointer(m.get_combined_kv_cache(4)) == data_pointer(m.get_combined_kv_cache(1))
    k4, v4 = m.get_separate_kv_cache(4)
    k1, v1 = m.get_separate_kv_cache(1)
    assert data_pointer(k4) == data_pointer(k1) and data_pointer(v4) == data_pointer(v1)
    m.get_combined_kv_cache(4)[0, 1, 1, 2, :] = 9
    assert (m.get_combined_kv_cache(1)[0, 1, 1, 2] == 9).all()


def test_attention_and_mamba_layer_has_both():
    m = manager()
    assert m.get_combined_kv_cache(3).shape == (B, 2, 1, S, 8)
    assert m.get_recurrent_state(3).shape == (B, 2, 4, 3)
    assert m.get_conv_state(3).shape == (B, 5, 4)


@pytest.mark.parametrize("layer", [0, 2, 5])
def test_no_attention_raises_value_error(layer):
    m = manager()
    for call in (m.get_combined_kv_cache, m.get_separate_kv_cache):
        with pytest.raises(ValueError, match=f"layer {layer}"):
            call(layer)


@pytest.mark.parametrize("layer", [1, 2, 4, 6, 7])
def test_no_mamba_raises_value_error(layer):
    m = manager()
    for call in (m.get_recurrent_state, m.get_conv_state):
        with pytest.raises(ValueError, match=f"layer {layer}"):
            call(layer)


@pytest.mark.parametrize("bad, exc", [(-1, IndexError), (len(TYPES), IndexError),
                                      (1.0, TypeError), (None, TypeError)])
def test_layer_index_errors(bad, exc):
    m = manager()
    for call in (m.get_layer_type, m.get_combined_kv_cache, m.get_separate_kv_cache,
                 m.get_recurrent_state, m.get_conv_state):
        with pytest.raises(exc):
            call(bad)


def test_head_dim_group_views():
    m = manager()
    groups = m.get_kv_head_dim_groups()
    assert all(isinstance(g, KVHeadDimGroupView) for g in groups)
    assert [(g.head_dim, g.num_layers, g.max_kv_heads, g.layer_indices) for g in groups] == [
        (80, 2, 2, (1, 7)), (8, 1, 1, (3,)), (36, 1, 3, (6,))]
    for g in groups:
        infos = host(g.device_layer_infos)
        assert infos.shape == (g.num_layers, 3)
        assert (infos[:, 2] == 0).all()   # no ring layers
        for row, layer in zip(infos, g.layer_indices, strict=True):
            cache = m.get_combined_kv_cache(layer)
            assert int(row[0]) == data_pointer(cache)
            assert int(row[1]) & 0xFFFFFFFF == cache.shape[2]
    with pytest.raises(dataclasses.FrozenInstanceError):
        groups[0].head_dim = 1


def test_without_mamba_and_without_attention():
    kv = KVCacheConfig(2, 4, [KVLayerConfig(1, 8)])
    m = HybridCacheManager(HybridCacheConfig([N, A], kv, None, 2), device="cpu")
    assert m.mamba_cache_manager is None
    assert m.capture_recurrent_states(1) == [] and m.capture_conv_states(0) == []
    m.restore_mamba_states([], [], 1)
    with pytest.raises(ValueError):
        m.restore_mamba_states([np.zeros(1)], [], 0)
    with pytest.raises(IndexError):
        m.capture_recurrent_states(2)
    with pytest.raises(ValueError):
        m.get_recurrent_state(1)
    m.reset_for_new_sequences([1, 2])
    m.compact_batch([1, 0], 2, 2)
    np.testing.assert_array_equal(m.get_kv_cache_lengths(), [2, 1])

    mamba = MambaCacheConfig(2, 2, 1, 4, 2, 3, 2)
    pure = HybridCacheManager(HybridCacheConfig([M, N, M], KVCacheConfig(2, 4, []), mamba, 2),
                              device="cpu")
    assert pure.get_kv_head_dim_groups() == []
    assert pure.capture_kv_cache(0, 3) == []
    with pytest.raises(ValueError):
        pure.get_combined_kv_cache(0)


def test_config_type_checked():
    with pytest.raises(TypeError):
        HybridCacheManager(config().kv)


# --- capture / restore ----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_kv_and_mamba_capture_restore_round_trip(dtype, device):
    m = manager(device, kv_dtype=dtype, ssm=dtype, conv=dtype)
    rng = np.random.default_rng(7)
    kv = randomize(kv_caches(m), rng)
    st = randomize(states(m), rng)
    saved = m.capture_kv_cache(2, 5)
    assert [tuple(t.shape) for t in saved] == [(2, lc.num_kv_heads, 5, lc.head_dim)
                                               for lc in KV_LAYERS]
    for t, raw in zip(saved, kv, strict=True):
        np.testing.assert_array_equal(host(t.view(np.uint8)), raw[2, :, :, :5])
    rec, conv = m.capture_recurrent_states(2), m.capture_conv_states(2)
    m.restore_kv_cache(saved, 0)
    m.restore_mamba_states(rec, conv, 3)
    for a, raw in zip(kv_caches(m), kv, strict=True):
        want = raw.copy()
        want[0, :, :, :5] = raw[2, :, :, :5]
        np.testing.assert_array_equal(host(a.view(np.uint8)), want)
    for a, raw in zip(states(m), st, strict=True):
        want = raw.copy()
        want[3] = raw[2]
        np.testing.assert_array_equal(host(a.view(np.uint8)), want)


def test_restore_rejected_writes_nothing():
    m = manager()
    rng = np.random.default_rng(8)
    randomize(kv_caches(m) + states(m), rng)
    saved = m.capture_kv_cache(0, 3)
    rec, conv = m.capture_recurrent_states(0), m.capture_conv_states(0)
    before = [a.view(np.uint8).copy() for a in kv_caches(m) + states(m)]
    bad_kv = saved[:1] + [np.zeros((2, 1, 4, 8), np.float16)] + saved[2:]
    bad_conv = conv[:1] + [np.zeros((1, 5, 4), np.float32)] + conv[2:]
    for call, args, exc in [(m.restore_kv_cache, (bad_kv, 1), ValueError),
                            (m.restore_kv_cache, (saved, B), IndexError),
                            (m.restore_mamba_states, (rec, bad_conv, 1), ValueError),
                            (m.restore_mamba_states, (rec, conv, -1), IndexError)]:
        with pytest.raises(exc):
            call(*args)
        for a, b in zip(kv_caches(m) + states(m), before, strict=True):
            np.testing.assert_array_equal(a.view(np.uint8), b)


# --- compaction -----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_compaction_moves_kv_states_and_lengths(device):
    m = manager(device, max_batch=6)
    rng = np.random.default_rng(9)
    m.reset_for_new_sequences([3, 9, 0, 5, 2])
    kv = randomize(kv_caches(m), rng)
    st = randomize(states(m), rng)
    # old 0 -> 2, old 1 evicted, old 2 -> 0, old 3 -> 1, old 4 evicted; new batch 4 (3 is a hole)
    m.compact_batch([2, -1, 0, 1, -1], 5, 4)
    assert m.active_batch_size == 4
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [0, 5, 3, 0])
    moves = {2: (0, 3), 0: (2, 0), 1: (3, 5)}        # new slot: (old slot, tokens)
    for a, raw in zip(kv_caches(m), kv, strict=True):
        got = host(a.view(np.uint8))
        for new, (old, n) in moves.items():
            np.testing.assert_array_equal(got[new, :, :, :n], raw[old, :, :, :n])
    for a, raw in zip(states(m), st, strict=True):
        got = host(a.view(np.uint8))
        for new, (old, _) in moves.items():
            np.testing.assert_array_equal(got[new], raw[old])
        assert not got[3].any()                        # hole below new_batch: zeroed
        np.testing.assert_array_equal(got[4:], raw[4:])  # past new_batch: untouched


def test_memory_report():
    m = manager(kv_dtype="float8_e4m3fn", ssm="float32", conv="bfloat16")
    kv = [B * 2 * lc.num_kv_heads * S * lc.head_dim for lc in KV_LAYERS]
    rec, conv = B * 2 * 4 * 3 * 4, B * 5 * 4 * 2
    report = m.memory_report()
    assert report["kv_cache"] == sum(kv)
    assert report["recurrent"] == 3 * rec and report["conv"] == 3 * conv
    assert report["layers"] == (rec + conv, kv[0], 0, kv[1] + rec + conv, 0, rec + conv,
                                kv[2], kv[3])
    assert report["metadata"] > 0
    assert report["total"] == sum(kv) + 3 * (rec + conv) + report["metadata"]


# --- the config: copies, pickling and argument types ------------------------------------------

def gemma_like():
    """Layers 0 A(8), 1 A(16), 2 NONE, 3 A sharing layer 0's cache (numpy ints on purpose)."""
    kv = KVCacheConfig(B, S, [KVLayerConfig(2, 8), KVLayerConfig(1, 16)])
    return HybridCacheConfig(["attention", "attention", "none", "attention"], kv, None, B,
                             kv_sharing={np.int64(3): np.int64(0)})


def test_hybrid_config_pickles_copies_and_converts_to_a_dict():
    """A frozen config compares by value; it must survive pickle (worker processes), deepcopy
    and dataclasses.asdict like the other configs do."""
    unshared = HybridCacheConfig(["attention"], KVCacheConfig(B, S, [KVLayerConfig(1, 8)]),
                                 None, B)
    for cfg in (gemma_like(), unshared):
        for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg), copy.copy(cfg)):
            assert clone == cfg and hash(clone) == hash(cfg)
            assert dict(clone.kv_sharing) == dict(cfg.kv_sharing)
    cfg = gemma_like()
    assert dataclasses.asdict(cfg)["kv_sharing"] == {3: 0}
    assert json.dumps(dict(cfg.kv_sharing)) == '{"3": 0}'      # plain ints, not numpy ints
    with pytest.raises(TypeError):
        cfg.kv_sharing[1] = 0                                   # still read-only
    m = HybridCacheManager(pickle.loads(pickle.dumps(cfg)), device="cpu")
    assert data_pointer(m.get_combined_kv_cache(3)) == data_pointer(m.get_combined_kv_cache(0))


@pytest.mark.parametrize("types, sharing, exc, match", [
    (["attention", 5, "attention", "attention"], {3: 0}, TypeError, r"layer_types\[1\]: expected"),
    ([None, "attention", "none", "attention"], {3: 0}, TypeError, r"layer_types\[0\]: expected"),
    (["attention", "attention", True, "attention"], {3: 0}, TypeError,
     r"layer_types\[2\]: expected"),
    (["attention", "attention", "conv", "attention"], {3: 0}, ValueError,
     r"layer_types\[2\]: expected"),
    (["attention", "attention", "none", "attention"], 5, TypeError, "kv_sharing: expected"),
    (["attention", "attention", "none", "attention"], [3, 0], TypeError, "kv_sharing: expected"),
    (["attention", "attention", "none", "attention"], {3.0: 0}, TypeError, "kv_sharing key"),
    (["attention", "attention", "none", "attention"], {3: True}, TypeError, "kv_sharing value"),
])
def test_hybrid_config_wrong_types_raise_type_error(types, sharing, exc, match):
    """docs/design.md §4: a bad value raises ValueError, a wrong type TypeError, as "name:
    expected X, got Y"."""
    kv = KVCacheConfig(B, S, [KVLayerConfig(2, 8), KVLayerConfig(1, 16)])
    with pytest.raises(exc, match=match):
        HybridCacheConfig(types, kv, None, B, kv_sharing=sharing)


# --- Mamba restore without Mamba layers (hybrid and linear managers) ----------------------------

def test_restore_mamba_states_without_mamba_layers_checks_types():
    kv = KVCacheConfig(B, S, [KVLayerConfig(1, 8)])
    m = HybridCacheManager(HybridCacheConfig(["attention"], kv, None, B), device="cpu")
    c = LinearKVCache(LinearCacheConfig(1, B, S, 1, 8), device="cpu")
    for restore, first in ((m.restore_mamba_states, "recurrent"),
                           (c.restore_mamba_states, "ssm")):
        with pytest.raises(TypeError, match=f"{first}: expected a sequence"):
            restore(None, [], 0)
        with pytest.raises(TypeError, match="conv: expected a sequence"):
            restore([], 3, 0)
        with pytest.raises(ValueError, match="conv: expected 0 tensors"):
            restore([], [np.zeros(1)], 0)
        restore([], (), B - 1)
