"""LinearKVCache (docs/design.md §4): the monolithic buffer and its views, Mamba states, and the
batch API with compaction of KV tokens, Mamba states and lengths."""

from __future__ import annotations

import numpy as np
import pytest

from hcache.config.caches import LinearCacheConfig
from hcache.device import data_pointer
from hcache.dtypes import DTYPE_NAMES, resolve_dtype
from hcache.slots.linear import LinearKVCache

import helpers
from helpers import host, randomize

DEVICES = helpers.DEVICES
L, B, H, S, D = 3, 5, 2, 7, 36
ML, MH, MD, DS, CD, CK = 2, 2, 3, 4, 6, 3




def cache(device="cpu", dtype="float16", mamba=True, layers=L):
    extra = dict(num_mamba_layers=ML, mamba_num_heads=MH, mamba_head_dim=MD, ssm_state_size=DS,
                 conv_dim=CD, conv_kernel=CK, ssm_dtype="float32", conv_dtype="bfloat16")
    cfg = LinearCacheConfig(layers, B, S, H, D, dtype=dtype, **(extra if mamba else {}))
    return LinearKVCache(cfg, device=device)



def mamba_states(c):
    return ([c.get_ssm_state_for_layer(i) for i in range(ML)]
            + [c.get_conv_state_for_layer(i) for i in range(ML)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_buffer_and_layer_views(dtype, device):
    c = cache(device, dtype)
    buf = c.get_kv_cache_buffer()
    assert tuple(buf.shape) == (L, B, 2, H, S, D)
    assert buf.dtype.itemsize == resolve_dtype(dtype).itemsize
    assert not host(buf.view(np.uint8)).any()
    layer_bytes = B * 2 * H * S * D * buf.dtype.itemsize
    for i in range(L):
        layer = c.get_combined_kv_cache_for_decoder_layer(i)
        assert tuple(layer.shape) == (B, 2, H, S, D) and layer.flags.c_contiguous
        assert data_pointer(layer) == data_pointer(buf) + i * layer_bytes
        k, v = c.get_separate_kv_cache_for_decoder_layer(i)
        assert tuple(k.shape) == tuple(v.shape) == (B, H, S, D)
        assert data_pointer(k) == data_pointer(layer)
        assert data_pointer(v) == data_pointer(layer) + H * S * D * buf.dtype.itemsize


def test_writes_through_views_land_in_the_buffer():
    c = cache()
    raw = randomize([c.get_kv_cache_buffer()], np.random.default_rng(0))[0]
    k, v = c.get_separate_kv_cache_for_decoder_layer(1)
    np.testing.assert_array_equal(k.view(np.uint8), raw[1, :, 0])
    np.testing.assert_array_equal(v.view(np.uint8), raw[1, :, 1])
    c.get_combined_kv_cache_for_decoder_layer(2)[4, 1, 0, 6, :] = 3
    assert (c.get_kv_cache_buffer()[2, 4, 1, 0, 6] == 3).all()


@pytest.mark.parametrize("bad, exc", [(-1, IndexError), (L, IndexError), (1.5, TypeError)])
def test_layer_index_errors(bad, exc):
    c = cache()
    for call in (c.get_combined_kv_cache_for_decoder_layer,
                 c.get_separate_kv_cache_for_decoder_layer):
        with pytest.raises(exc):
            call(bad)
    mamba_bad = ML if bad == L else bad
    for call in (c.get_ssm_state_for_layer, c.get_conv_state_for_layer):
        with pytest.raises(exc):
            call(mamba_bad)


def test_mamba_views_clear_and_capture():
    c = cache()
    assert c.get_ssm_state_for_layer(1).shape == (B, MH, MD, DS)
    assert c.get_conv_state_for_layer(0).shape == (B, CD, CK)
    raw = randomize(mamba_states(c), np.random.default_rng(1))
    ssm, conv = c.capture_ssm_states(3), c.capture_conv_states(3)
    assert [t.shape for t in ssm] == [(1, MH, MD, DS)] * ML
    assert [t.shape for t in conv] == [(1, CD, CK)] * ML
    for t, r in zip(ssm + conv, raw, strict=True):
        np.testing.assert_array_equal(t.view(np.uint8)[0], r[3])
    c.clear_mamba_states()
    assert not any(a.any() for a in mamba_states(c))
    c.restore_mamba_states(ssm, conv, 0)
    for a, r in zip(mamba_states(c), raw, strict=True):
        np.testing.assert_array_equal(a.view(np.uint8)[0], r[3])
        assert not a[1:].any()
    with pytest.raises(IndexError):
        c.capture_ssm_states(B)
    with pytest.raises(ValueError):
        c.restore_mamba_states(ssm[:1], conv, 0)


def test_pure_attention_and_zero_attention_layers():
    c = cache(mamba=False)
    with pytest.raises(IndexError):
        c.get_ssm_state_for_layer(0)
    assert c.capture_ssm_states(0) == [] and c.capture_conv_states(0) == []
    c.clear_mamba_states()
    c.restore_mamba_states([], [], 1)
    with pytest.raises(IndexError):
        c.capture_conv_states(-1)
    z = cache(layers=0, mamba=False)
    assert z.get_kv_cache_buffer().shape == (0, B, 2, H, S, D)
    z.reset_for_new_sequences([1, 2])
    z.compact_batch([1, 0], 2, 2)
    np.testing.assert_array_equal(z.get_kv_cache_lengths(), [2, 1])


def test_config_type_checked():
    with pytest.raises(TypeError):
        LinearKVCache({"num_attention_layers": 1})


def test_memory_report():
    c = cache(dtype="int8")
    report = c.memory_report()
    assert report["kv_cache"] == L * B * 2 * H * S * D
    assert report["recurrent"] == ML * B * MH * MD * DS * 4
    assert report["conv"] == ML * B * CD * CK * 2
    assert report["metadata"] > 0
    assert report["total"] == sum(v for k, v in report.items() if k != "total")


@pytest.mark.parametrize("device", DEVICES)
def test_compaction_moves_kv_mamba_and_lengths(device):
    c = cache(device)
    rng = np.random.default_rng(2)
    c.reset_for_new_sequences([2, 7, 4, 1])
    c.commit_sequence_length([1, 0, 2, 0])          # lengths 3, 7, 6, 1
    assert not c.kv_cache_all_empty
    kv = randomize([c.get_kv_cache_buffer()], rng)[0]
    st = randomize(mamba_states(c), rng)
    c.compact_batch([1, 0, -1, 2], 4, 3)            # a swap of 0 and 1, slot 2 evicted
    assert c.active_batch_size == 3
    np.testing.assert_array_equal(host(c.get_kv_cache_lengths()), [7, 3, 1])
    got = host(c.get_kv_cache_buffer().view(np.uint8))
    for new, old, n in ((0, 1, 7), (1, 0, 3), (2, 3, 1)):
        np.testing.assert_array_equal(got[:, new, :, :, :n], kv[:, old, :, :, :n])
    for a, r in zip(mamba_states(c), st, strict=True):
        g = host(a.view(np.uint8))
        for new, old in ((0, 1), (1, 0), (2, 3)):
            np.testing.assert_array_equal(g[new], r[old])
        np.testing.assert_array_equal(g[3:], r[3:])
