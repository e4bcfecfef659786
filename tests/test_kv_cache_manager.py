"""KVCacheManager (docs/design.md §4): per-layer shapes, views, head-dim groups, validation,
prompt-cache capture/restore, memory report."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hcache.config.caches import KVCacheConfig, KVLayerConfig
from hcache.device import data_pointer
from hcache.dtypes import DTYPE_NAMES, resolve_dtype
from hcache.slots.kv import KVCacheManager

import helpers
from helpers import host, put

DEVICES = helpers.DEVICES
B, S = 3, 10
HETERO = [KVLayerConfig(2, 80), KVLayerConfig(1, 8), KVLayerConfig(3, 80), KVLayerConfig(2, 36),
          KVLayerConfig(4, 8)]




def randomize(m, rng):
    """Random bytes in every cache; returns host byte copies ``[B, 2, H, S, D * itemsize]``."""
    out = []
    for i in range(m.num_layers):
        u8 = m.get_combined_kv_cache(i).view(np.uint8)
        raw = rng.integers(0, 256, size=u8.shape, dtype=np.uint8)
        put(u8, raw)
        out.append(raw)
    return out


def manager(layers=HETERO, dtype="float16", device="cpu", max_batch=B, seq=S):
    return KVCacheManager(KVCacheConfig(max_batch, seq, layers, dtype), device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_shapes_dtypes_and_zeroed(dtype, device):
    m = manager(dtype=dtype, device=device)
    assert m.num_layers == len(HETERO)
    for i, lc in enumerate(HETERO):
        cache = m.get_combined_kv_cache(i)
        assert tuple(cache.shape) == (B, 2, lc.num_kv_heads, S, lc.head_dim)
        assert cache.dtype.itemsize == resolve_dtype(dtype).itemsize
        assert cache.flags.c_contiguous
        assert not host(cache.view(np.uint8)).any()
        assert m.get_layer_config(i) == lc
    if device == "cpu":
        assert m.get_combined_kv_cache(0).dtype == resolve_dtype(dtype)


def test_views_are_zero_copy():
    m = manager()
    a = m.get_combined_kv_cache(2)
    a[1, 0, 2, 5, :] = 7
    assert m.get_combined_kv_cache(2)[1, 0, 2, 5, 3] == 7
    assert np.shares_memory(a, m.get_combined_kv_cache(2))
    assert not np.shares_memory(a, m.get_combined_kv_cache(0))


@pytest.mark.parametrize("device", DEVICES)
def test_separate_views_are_strided_slices(device):
    m = manager(device=device)
    raw = randomize(m, np.random.default_rng(0))
    for i, lc in enumerate(HETERO):
        k, v = m.get_separate_kv_cache(i)
        assert tuple(k.shape) == tuple(v.shape) == (B, lc.num_kv_heads, S, lc.head_dim)
        np.testing.assert_array_equal(host(k.view(np.uint8)), raw[i][:, 0])
        np.testing.assert_array_equal(host(v.view(np.uint8)), raw[i][:, 1])
        cache = m.get_combined_kv_cache(i)
        assert data_pointer(k) == data_pointer(cache)
        assert data_pointer(v) == data_pointer(cache) + cache.strides[1]
    k, _ = m.get_separate_kv_cache(1)
    put(k[2, 0, 3], np.full(8, 5, dtype=k.dtype))
    assert host(m.get_combined_kv_cache(1))[2, 0, 0, 3, 7] == 5


def test_uniformity():
    assert manager([KVLayerConfig(2, 8)] * 3).is_uniform
    assert manager([]).is_uniform
    assert not manager(HETERO).is_uniform
    assert not manager([KVLayerConfig(2, 8), KVLayerConfig(1, 8)]).is_uniform


def test_head_dim_groups_first_seen_order_and_layer_infos():
    m = manager()
    groups = m.groups
    assert [g.head_dim for g in groups] == [80, 8, 36]
    assert [g.layer_indices for g in groups] == [(0, 2), (1, 4), (3,)]
    assert [g.max_kv_heads for g in groups] == [3, 4, 2]
    for g in groups:
        infos = host(g.device_layer_infos)
        for row, layer in zip(infos, g.layer_indices, strict=True):
            lc = HETERO[layer]
            assert int(row[0]) == data_pointer(m.get_combined_kv_cache(layer))
            assert int(row[1]) & 0xFFFFFFFF == lc.num_kv_heads
            assert int(row[1]) >> 32 == S


def test_zero_layers():
    m = manager([])
    assert m.num_layers == 0 and m.groups == ()
    assert m.capture_kv_cache(0, 4) == []
    m.restore_kv_cache([], 0)
    assert m.memory_report()["total"] == 0
    with pytest.raises(IndexError):
        m.get_combined_kv_cache(0)


@pytest.mark.parametrize("bad, exc", [(-1, IndexError), (len(HETERO), IndexError),
                                      (True, TypeError), (1.0, TypeError), ("1", TypeError)])
def test_layer_index_errors(bad, exc):
    m = manager()
    for call in (m.get_combined_kv_cache, m.get_separate_kv_cache, m.get_layer_config):
        with pytest.raises(exc):
            call(bad)


def test_config_type_checked():
    with pytest.raises(TypeError):
        KVCacheManager({"max_batch_size": 1})


def test_memory_report_by_hand():
    m = manager(dtype="bfloat16")
    want = [B * 2 * lc.num_kv_heads * S * lc.head_dim * 2 for lc in HETERO]
    report = m.memory_report()
    assert report["layers"] == tuple(want)
    assert report["kv_cache"] == sum(want)
    # per layer: a 24-byte KVLayerInfo, a 24-byte pointer-scratch row and a 4-byte label
    assert report["layer_infos"] == (2 * 24 + 4) * len(HETERO)
    assert report["kv_cache_unbounded"] == report["kv_cache"]   # no ring layers
    # write_kv: int32 row offsets [B + 1], staged positions [B], status [1] (no FP8 scales)
    assert report["write_state"] == (B + 1 + B + 1) * 4
    assert report["total"] == sum(want) + report["layer_infos"] + report["write_state"]


# --- capture / restore ----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_capture_restore_round_trip(dtype, device):
    m = manager(dtype=dtype, device=device)
    raw = randomize(m, np.random.default_rng(3))
    saved = m.capture_kv_cache(1, 6)
    for i, (t, lc) in enumerate(zip(saved, HETERO, strict=True)):
        assert tuple(t.shape) == (2, lc.num_kv_heads, 6, lc.head_dim)
        np.testing.assert_array_equal(host(t.view(np.uint8)), raw[i][1, :, :, :6])
    m.restore_kv_cache(saved, 2)
    for i in range(m.num_layers):
        got = host(m.get_combined_kv_cache(i).view(np.uint8))
        want = raw[i].copy()
        want[2, :, :, :6] = raw[i][1, :, :, :6]
        np.testing.assert_array_equal(got, want)     # nothing else touched


def test_capture_is_a_copy_and_edge_lengths():
    m = manager()
    raw = randomize(m, np.random.default_rng(4))
    saved = m.capture_kv_cache(0, S)
    randomize(m, np.random.default_rng(5))
    np.testing.assert_array_equal(saved[3].view(np.uint8), raw[3][0])
    empty = m.capture_kv_cache(2, 0)
    assert [t.shape[2] for t in empty] == [0] * len(HETERO)
    before = [m.get_combined_kv_cache(i).copy() for i in range(m.num_layers)]
    m.restore_kv_cache(empty, 1)
    for i in range(m.num_layers):
        np.testing.assert_array_equal(m.get_combined_kv_cache(i).view(np.uint8),
                                      before[i].view(np.uint8))


@pytest.mark.parametrize("slot, n, exc", [(B, 2, IndexError), (-1, 2, IndexError),
                                          (0, S + 1, ValueError), (0, -1, ValueError),
                                          (0.0, 2, TypeError), (0, 2.0, TypeError)])
def test_capture_rejected(slot, n, exc):
    with pytest.raises(exc):
        manager().capture_kv_cache(slot, n)


def _corruptions(saved):
    """(description, tensors, expected exception): the first layer always valid."""
    bad_shape = list(saved)
    bad_shape[1] = np.zeros((2, 1, 5, 8), dtype=saved[1].dtype)          # 5 tokens, not 4
    bad_heads = list(saved)
    bad_heads[4] = np.zeros((2, 3, 4, 8), dtype=saved[4].dtype)
    bad_dtype = list(saved)
    bad_dtype[2] = saved[2].astype(np.float32)
    strided = list(saved)
    strided[3] = np.zeros((2, 2, 8, 36), dtype=saved[3].dtype)[:, :, ::2]
    return [("count", saved[:-1], ValueError), ("tokens", bad_shape, ValueError),
            ("heads", bad_heads, ValueError), ("dtype", bad_dtype, ValueError),
            ("layout", strided, ValueError), ("type", saved[:-1] + [[[0]]], TypeError),
            ("not a sequence", 5, TypeError)]


def test_restore_rejected_writes_nothing():
    m = manager()
    randomize(m, np.random.default_rng(6))
    saved = m.capture_kv_cache(0, 4)
    for i in range(len(saved)):
        saved[i][...] = 1   # differs from the cache, so a partial write would show
    before = [m.get_combined_kv_cache(i).view(np.uint8).copy() for i in range(m.num_layers)]
    for _, tensors, exc in _corruptions(saved):
        with pytest.raises(exc):
            m.restore_kv_cache(tensors, 1)
        with pytest.raises(IndexError):
            m.restore_kv_cache(saved, B)
        for i in range(m.num_layers):
            np.testing.assert_array_equal(m.get_combined_kv_cache(i).view(np.uint8), before[i])
    too_long = [np.zeros((2, lc.num_kv_heads, S + 1, lc.head_dim), np.float16) for lc in HETERO]
    with pytest.raises(ValueError):
        m.restore_kv_cache(too_long, 0)


@settings(max_examples=25)
@given(dtype=st.sampled_from(DTYPE_NAMES), src=st.integers(0, B - 1), dst=st.integers(0, B - 1),
       n=st.integers(0, S), seed=st.integers(0, 2**32 - 1))
def test_capture_restore_property(dtype, src, dst, n, seed):
    m = manager(dtype=dtype)
    raw = randomize(m, np.random.default_rng(seed))
    m.restore_kv_cache(m.capture_kv_cache(src, n), dst)
    for i in range(m.num_layers):
        want = raw[i].copy()
        want[dst, :, :, :n] = raw[i][src, :, :, :n]
        np.testing.assert_array_equal(m.get_combined_kv_cache(i).view(np.uint8), want)
