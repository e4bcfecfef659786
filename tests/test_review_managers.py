"""Review of the contiguous-slot managers and their configs (docs/design.md §4, issue 3): edge
cases found
in review, each checked against the contract's words (docs/design.md) or hand-computed values."""

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
    LinearCacheConfig,
    MambaCacheConfig,
)
from hcache.device import data_pointer
from hcache.slots.hybrid import HybridCacheManager
from hcache.slots.linear import LinearKVCache

from helpers import host

B, S = 3, 6



def gemma_like():
    """Layers 0 A(8), 1 A(16), 2 NONE, 3 A sharing layer 0's cache (numpy ints on purpose)."""
    kv = KVCacheConfig(B, S, [KVLayerConfig(2, 8), KVLayerConfig(1, 16)])
    return HybridCacheConfig(["attention", "attention", "none", "attention"], kv, None, B,
                             kv_sharing={np.int64(3): np.int64(0)})


def hybrid(device="cpu"):
    kv = KVCacheConfig(B, S, [KVLayerConfig(1, 8)])
    mamba = MambaCacheConfig(1, B, 1, 2, 3, 2, 3)
    return HybridCacheManager(HybridCacheConfig(["attention", "mamba"], kv, mamba, B),
                              device=device)


def linear(device="cpu"):
    return LinearKVCache(LinearCacheConfig(1, B, S, 1, 8, num_mamba_layers=1, mamba_num_heads=1,
                                           mamba_head_dim=2, ssm_state_size=3, conv_dim=2,
                                           conv_kernel=3), device=device)


FACTORIES = [pytest.param(hybrid, id="hybrid"), pytest.param(linear, id="linear")]


def batch_snapshot(m):
    lengths = m.get_kv_cache_lengths()
    full = lengths.base if lengths.base is not None else lengths
    return host(full).tolist(), m.active_batch_size, m.kv_cache_all_empty


# --- configs --------------------------------------------------------------------------------

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
    """docs/design.md §4: a bad value raises ValueError, a wrong type TypeError, as "name: expected
    X,
    got Y"."""
    kv = KVCacheConfig(B, S, [KVLayerConfig(2, 8), KVLayerConfig(1, 16)])
    with pytest.raises(exc, match=match):
        HybridCacheConfig(types, kv, None, B, kv_sharing=sharing)


def test_max_sequence_length_fits_the_int32_lengths():
    """docs/design.md §4: the lengths are one device int32 array, so a capacity past 2**31 - 1
    cannot be
    represented (a pure-Mamba model, with no KV memory to exhaust, would otherwise wrap a reset
    length of 2**31 to -2**31)."""
    mamba = MambaCacheConfig(1, 1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="max_sequence_length"):
        KVCacheConfig(1, 2**31, [])
    with pytest.raises(ValueError, match="max_sequence_length"):
        LinearCacheConfig(0, 1, 2**31, 1, 1)
    top = 2**31 - 1
    m = HybridCacheManager(HybridCacheConfig(["mamba"], KVCacheConfig(1, top, []), mamba, 1),
                           device="cpu")
    m.reset_for_new_sequences([top - 1])
    m.commit_sequence_length(1)
    assert host(m.get_kv_cache_lengths()).tolist() == [top]
    with pytest.raises(ValueError):
        m.commit_sequence_length(1)


@pytest.mark.parametrize("value, exc", [(0, ValueError), (-512, ValueError), (False, TypeError),
                                        (512.0, TypeError)])
def test_gemma4_bad_global_head_dim_is_refused_not_replaced(value, exc):
    """docs/design.md §4: an inconsistent config raises naming the field; a global_head_dim of 0
    must not
    silently become head_dim (only an explicit null means "same as head_dim")."""
    cfg = {"model_type": "gemma4_text", "num_hidden_layers": 6, "head_dim": 64}
    with pytest.raises(exc, match="global_head_dim"):
        HybridCacheConfig.from_hf_config({**cfg, "global_head_dim": value}, max_batch_size=1,
                                         max_sequence_length=8)
    null = HybridCacheConfig.from_hf_config({**cfg, "global_head_dim": None}, max_batch_size=1,
                                            max_sequence_length=8)
    assert [lc.head_dim for lc in null.kv.layer_configs] == [64] * 6


# --- batch API: host integers ---------------------------------------------------------------

@pytest.mark.parametrize("make", FACTORIES)
def test_bool_entries_in_host_lists_are_type_errors_and_change_nothing(make):
    """A bool is not an int (docs/design.md §4: TypeError for a wrong type), inside a list too: [0,
    True]
    must not reset a length to 1, nor [True, 0] compact slot 0 into slot 1."""
    m = make()
    m.reset_for_new_sequences([2, 4])
    before = batch_snapshot(m)
    calls = [(m.reset_for_new_sequences, ([0, True],)),
             (m.reset_for_new_sequences, ((np.bool_(False), 1),)),
             (m.commit_sequence_length, ([1, False],)),
             (m.compact_batch, ([True, 0], 2, 2))]
    for call, args in calls:
        with pytest.raises(TypeError, match="bool"):
            call(*args)
        assert batch_snapshot(m) == before
    assert host(m.get_kv_cache_lengths()).tolist() == [2, 4]


@pytest.mark.parametrize("make", FACTORIES)
def test_uint64_entries_past_int64_are_not_wrapped(make):
    """2**64 - 1 is not a slot: it must not read as -1 (evicted) in a mapping, nor be reported
    as -1 in a reset."""
    m = make()
    m.reset_for_new_sequences([2, 4])
    before = batch_snapshot(m)
    huge = np.array([2**64 - 1, 0], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"batch_mapping\[0\].*18446744073709551615"):
        m.compact_batch(huge, 2, 1)
    assert batch_snapshot(m) == before
    with pytest.raises(ValueError, match="18446744073709551615"):
        m.reset_for_new_sequences(huge)
    assert batch_snapshot(m) == before
    m.compact_batch(np.array([1, 0], dtype=np.uint64), 2, 2)   # in range: still accepted
    assert host(m.get_kv_cache_lengths()).tolist() == [4, 2]


# --- Mamba restore without Mamba layers -----------------------------------------------------

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


# --- memory report --------------------------------------------------------------------------

def test_memory_report_total_counts_every_descriptor_table():
    """Hand count for B=3, one attention layer (H=1, S=6, D=8, fp16), one Mamba layer
    (recurrent [1, 2, 3] fp32, conv [2, 3] fp16). Device arrays besides the caches: the
    KVLayerInfo table and its scratch (16 B per layer each); the int32 lengths, increments and
    mapping [B], status [1] and plan [4 + 8 B]; one 32-byte SlotTensorInfo per tensor that
    compaction moves (recurrent, conv, lengths); the Mamba copies' two int32 slot indices and
    their SlotTensorInfo tables (capture: 1 + 1 tensors, restore: 2)."""
    kv, rec, conv = B * 2 * 1 * S * 8 * 2, B * 1 * 2 * 3 * 4, B * 2 * 3 * 2
    metadata = (2 * 16 + (3 * B + 1 + 4 + 8 * B) * 4 + 3 * 32 + 2 * 4 + (1 + 1 + 2) * 32)
    for m in (hybrid(), linear()):
        report = m.memory_report()
        assert (report["kv_cache"], report["recurrent"], report["conv"]) == (kv, rec, conv)
        assert report["metadata"] == metadata
        assert report["total"] == kv + rec + conv + metadata
