"""Latent (MLA) KV caches through the managers: one component per token, no V.

An MLA layer (``KVLayerConfig(1, kv_lora_rank + qk_rope_head_dim, components=1)``) caches one
latent vector per token. Checked here on the cpu device, on the host-emulated kernels
(``emu``) and on the asynchronous emulated device (``emulated``: the CUDA path, its staging and
launch scopes included): the exact bytes a latent layer allocates, its views, ``write_kv``
(plain and FP8 quantizing) against hand-placed rows and an ``ml_dtypes`` oracle, refused calls
that change nothing, capture/restore shapes, the paged pool and continuous batching
(``is_mla``).
Compaction and capture/restore under random call sequences are in the stateful machines
(``tests/test_managers_stateful.py``: ``LatentMachine``, ``MLAMachine``), prefix caching in
``tests/test_prefix_caching_e2e.py``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hcache import ops
from hcache.config.caches import HybridCacheConfig, KVCacheConfig, KVLayerConfig, LayerType
from hcache.contexts import PagedKVPool
from hcache.continuous.manager import ContinuousBatchingKVCacheManager, KVCacheStaticParams
from hcache.device import resolve_device
from hcache.slots.hybrid import HybridCacheManager
from hcache.slots.kv import KVCacheManager

import helpers
from helpers import host, put

A, N = LayerType.ATTENTION, LayerType.NONE
D = 512 + 64   # DeepSeek-V3's kv_lora_rank + qk_rope_head_dim
MLA = KVLayerConfig(1, D, components=1)


@pytest.fixture(params=["reference", pytest.param("emu", marks=pytest.mark.emu),
                        pytest.param("emulated", marks=pytest.mark.emulated)])
def kernels(request):
    """The device the managers run on: cpu with the ops on the NumPy reference or on the real
    ``.cu`` compiled for the host, or the emulated device (``"cuda"``; tests/emu_device.py)."""
    if request.param == "reference":
        yield "cpu"
        return
    if request.param == "emulated":
        rt = request.getfixturevalue("emu_rt")
        yield "cuda"
        assert rt.launches, "no kernel ran on the emulated device"
        return
    emu = pytest.importorskip("emu")
    if not emu.have_compiler():
        pytest.skip("no host C++ compiler")
    launcher = emu.EmuLauncher()
    with ops.host_backend(launcher):
        yield "cpu"
    assert launcher.launches, "no kernel ran through the emulation"


def _rows(rng, shape, dtype=np.float16):
    return rng.standard_normal(shape).astype(dtype)


def _on(device):
    """Host array -> an array of ``device`` (itself on cpu)."""
    xp = resolve_device(device).xp
    return (lambda a: a) if xp is np else xp.asarray


def _snapshot(caches):
    return [host(c).copy() for c in caches]


# --- contiguous slots -------------------------------------------------------------------------

@pytest.mark.parametrize("device", helpers.DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32"])
def test_mla_layer_allocates_exactly_one_latent_vector_per_token(dtype, device):
    """An MLA layer owns ``max_batch * max_seq * D * itemsize`` bytes (no V), a K/V layer twice
    its heads' worth; the views and memory_report say the same."""
    b, s = 3, 7
    kv = KVCacheManager(KVCacheConfig(b, s, [MLA, KVLayerConfig(2, 64), MLA], dtype),
                        device=device)
    item = np.dtype(host(kv.get_combined_kv_cache(0)).dtype).itemsize
    assert kv.get_combined_kv_cache(0).shape == (b, 1, 1, s, D)
    assert kv.get_combined_kv_cache(0).nbytes == b * s * D * item
    assert kv.memory_report()["layers"] == (b * s * D * item, b * 2 * 2 * s * 64 * item,
                                            b * s * D * item)
    assert [(g.components, g.layer_indices) for g in kv.groups] == [(1, (0, 2)), (2, (1,))]
    assert not kv.is_uniform
    with pytest.raises(ValueError,
                       match=r"^i: expected a layer with separate K and V, got layer 0\b"):
        kv.get_separate_kv_cache(0)
    k, v = kv.get_separate_kv_cache(1)
    assert k.shape == v.shape == (b, 2, s, 64)


@pytest.mark.parametrize("device", helpers.DEVICES)
def test_hybrid_routes_latent_layers_and_reports_their_groups(device):
    """Decoder-layer routing of an MLA model with cache-less layers: latent views, a latent
    head-dim group view, per-layer bytes, and a clear error for a separate K/V."""
    kv = KVCacheConfig(2, 5, [MLA, MLA], "float16")
    m = HybridCacheManager(HybridCacheConfig([A, N, A], kv, None, 2), device=device)
    assert m.get_combined_kv_cache(2).shape == (2, 1, 1, 5, D)
    with pytest.raises(ValueError,
                       match=r"^i: expected a layer with separate K and V, got layer 2\b"):
        m.get_separate_kv_cache(2)
    (view,) = m.get_kv_head_dim_groups()
    assert (view.components, view.head_dim, view.layer_indices) == (1, D, (0, 2))
    assert m.memory_report()["layers"] == (2 * 5 * D * 2, 0, 2 * 5 * D * 2)


def test_write_kv_places_latent_rows_and_refuses_v(kernels):
    """Latent rows are ``k`` (``v`` None), K/V rows need ``v``; a refused call changes
    nothing; a mixed all-layer write takes None in the latent places."""
    rng = np.random.default_rng(1)
    d = _on(kernels)
    m = KVCacheManager(KVCacheConfig(3, 6, [MLA, KVLayerConfig(2, 8)], "float16"),
                       device=kernels)
    latent, paired = m.get_combined_kv_cache(0), m.get_combined_kv_cache(1)
    k = _rows(rng, (2, 2, 1, D))
    pos = [[0, 1], [3, -1]]
    before = _snapshot([latent, paired])
    for call in (lambda: m.write_kv(0, d(k), d(k), positions=pos),
                 lambda: m.write_kv(1, d(_rows(rng, (2, 2, 2, 8))), positions=pos),
                 lambda: m.write_kv(None, [d(k), d(_rows(rng, (2, 2, 2, 8)))], positions=pos)):
        with pytest.raises(ValueError, match="v|V rows"):
            call()
    for a, b in zip(before, _snapshot([latent, paired])):
        np.testing.assert_array_equal(a, b)
    m.write_kv(0, d(k), positions=pos)
    want = before[0].copy()
    want[0, 0, 0, 0:2] = k[0, :, 0]
    want[1, 0, 0, 3] = k[1, 0, 0]
    np.testing.assert_array_equal(host(latent), want)
    kk, vv = _rows(rng, (1, 1, 2, 8)), _rows(rng, (1, 1, 2, 8))
    m.write_kv(None, [d(k[:1, :1]), d(kk)], [None, d(vv)], positions=[[5]])
    assert host(latent)[0, 0, 0, 5].tobytes() == k[0, 0, 0].tobytes()
    np.testing.assert_array_equal(host(paired)[0, :, :, 5], np.stack([kk[0, 0], vv[0, 0]]))


def test_fp8_write_quantizes_latent_rows_with_k_scale(kernels):
    """Float rows into an FP8 latent cache become ``fp8(x / k_scale)`` (ml_dtypes oracle); a
    ``v_scale`` for latent layers only is refused; the recorded k scale is the one used."""
    rng = np.random.default_rng(2)
    kv = KVCacheConfig(2, 4, [MLA, MLA], "float8_e4m3fn")
    d = _on(kernels)
    m = HybridCacheManager(HybridCacheConfig([A, A], kv, None, 2), device=kernels)
    m.reset_for_new_sequences([1, 0])
    x = [_rows(rng, (2, 1, 1, D), np.float32) * 300 for _ in range(2)]
    with pytest.raises(ValueError, match="v_scale: expected None"):
        m.write_kv(None, [d(a) for a in x], k_scale=2.0, v_scale=2.0)
    m.write_kv(None, [d(a) for a in x], k_scale=2.0)
    for layer, rows in enumerate(x):
        q = np.clip(rows / np.float32(2.0), -448, 448).astype(ml_dtypes.float8_e4m3fn)
        cache = host(m.get_combined_kv_cache(layer)).view(np.uint8)
        assert cache[0, 0, 0, 1].tobytes() == q[0, 0, 0].view(np.uint8).tobytes()
        assert cache[1, 0, 0, 0].tobytes() == q[1, 0, 0].view(np.uint8).tobytes()
    np.testing.assert_array_equal(host(m.get_kv_scales()[0]), np.full((2, 1), 2.0, np.float32))


def test_capture_and_restore_latent_layers(kernels):
    """capture_kv_cache gives ``[1, 1, n, D]`` per latent layer and ``[2, H, n, D]`` per K/V
    layer; restore copies them into another slot; a two-plane tensor for a latent layer is
    refused before anything is written."""
    rng = np.random.default_rng(3)
    d = _on(kernels)
    m = KVCacheManager(KVCacheConfig(3, 5, [KVLayerConfig(2, 8), MLA], "float16"),
                       device=kernels)
    for i in range(2):
        c = m.get_combined_kv_cache(i)
        put(c, _rows(rng, c.shape))
    saved = m.capture_kv_cache(1, 4)
    assert [t.shape for t in saved] == [(2, 2, 4, 8), (1, 1, 4, D)]
    np.testing.assert_array_equal(host(saved[1]), host(m.get_combined_kv_cache(1))[1, :, :, :4])
    before = _snapshot([m.get_combined_kv_cache(i) for i in range(2)])
    bad = [saved[0], d(np.zeros((2, 1, 4, D), np.float16))]
    with pytest.raises(ValueError, match=r"saved\[1\]: expected shape \[1, 1, n, 576\]"):
        m.restore_kv_cache(bad, 2)
    for a, b in zip(before, _snapshot([m.get_combined_kv_cache(i) for i in range(2)])):
        np.testing.assert_array_equal(a, b)
    m.restore_kv_cache(saved, 2)
    for i in range(2):
        c = host(m.get_combined_kv_cache(i))
        np.testing.assert_array_equal(c[2, :, :, :4], c[1, :, :, :4])
        np.testing.assert_array_equal(c[2, :, :, 4:], before[i][2, :, :, 4:])


# --- paged pool -------------------------------------------------------------------------------

def test_paged_pool_gives_latent_layers_one_plane(kernels):
    """Latent blocks are ``[num_blocks, 1, 1, block_size, D]``; a mixed write through a block
    table lands each token at ``table[b, pos // bs]``, ``pos % bs`` (hand-placed model);
    ``v`` for a latent layer is refused; copy_blocks copies latent blocks too."""
    rng = np.random.default_rng(4)
    layers = [MLA, KVLayerConfig(2, 8), KVLayerConfig(1, 8, components=1)]
    d = _on(kernels)
    pool = PagedKVPool(layers, num_blocks=6, block_size=2, dtype="float16", device=kernels)
    assert [tuple(a.shape) for a in pool.layers] == [(6, 1, 1, 2, D), (6, 2, 2, 2, 8),
                                                     (6, 1, 1, 2, 8)]
    assert pool.bytes_per_block == 2 * 2 * (D + 2 * 2 * 8 + 8)
    assert [g["components"] for g in pool.memory_report()["groups"]] == [1, 2, 1]
    table = np.array([[4, 1, -1], [0, 3, 5]], np.int32)
    counts, starts = [3, 2], [0, 3]
    total = sum(counts)
    ks = [_rows(rng, (total, lc.num_kv_heads, lc.head_dim)) for lc in layers]
    vs = [None, _rows(rng, (total, 2, 8)), None]
    args = dict(block_table=d(table), seq_offsets=d(np.array([0, 3, 5], np.int32)),
                cache_lengths=d(np.array(starts, np.int32)))
    before = _snapshot(pool.layers)
    dk, dv = [d(a) for a in ks], [None if a is None else d(a) for a in vs]
    with pytest.raises(ValueError, match=r"v\[0\]: expected None"):
        pool.write_kv(dk, [dk[0], dv[1], None], **args)
    with pytest.raises(ValueError, match=r"v: expected None"):
        pool.write_kv(dk[2], dk[2], layer=2, **args)
    for a, b in zip(before, _snapshot(pool.layers)):
        np.testing.assert_array_equal(a, b)
    pool.write_kv(dk, dv, **args)
    model = before
    t = 0
    for b, (n, start) in enumerate(zip(counts, starts)):
        for j in range(n):
            pos = start + j
            blk, off = table[b, pos // 2], pos % 2
            for i in range(3):
                model[i][blk, 0, :, off] = ks[i][t]
                if vs[i] is not None:
                    model[i][blk, 1, :, off] = vs[i][t]
            t += 1
    for a, b in zip(model, _snapshot(pool.layers)):
        np.testing.assert_array_equal(a, b)
    pool.copy_blocks([4, 3], [2, 0])
    for a in pool.layers:
        np.testing.assert_array_equal(host(a)[2], host(a)[4])
        np.testing.assert_array_equal(host(a)[0], host(a)[3])


# --- continuous batching ----------------------------------------------------------------------

def test_continuous_mla_cache_stores_keys_only(kernels):
    """With ``is_mla`` the buffer is ``[num_blocks, 1, L, S, 1, D]``: writes put latent rows at
    each row's committed length (uniform and ragged), ``value_cache`` and ``v`` are refused,
    FP8 quantizes with ``k_scale``."""
    params = KVCacheStaticParams(1, D, is_mla=True)
    assert params.components == 1 and KVCacheStaticParams(1, D).components == 2
    with pytest.raises(TypeError, match="is_mla: expected a bool"):
        KVCacheStaticParams(1, D, is_mla=1)
    d = _on(kernels)
    m = ContinuousBatchingKVCacheManager("float16", params, 3, 6, 2, device=kernels)
    assert m.blocks_buf.shape == (3, 1, 2, 6, 1, D)
    assert m.memory_report()["bytes_per_token"] == 2 * D * 2
    rng = np.random.default_rng(5)
    ids = m.claim(2)
    c = m.fetch(ids)
    with pytest.raises(ValueError, match="value_cache: expected a cache with values"):
        c.value_cache(0)
    k = _rows(rng, (2, 2, 1, D))
    with pytest.raises(ValueError, match="value: expected None"):
        c.write(1, d(k), d(k))
    c.write(1, d(k))
    m.step([2, 1], c)
    c = m.fetch(ids)
    k2 = _rows(rng, (3, 1, D))
    c.write_kv(1, d(k2), seq_lengths=[1, 2])
    keys = host(c.key_cache(1))
    np.testing.assert_array_equal(keys[c.blocks[0], 0:3, 0], np.concatenate([k[0, :, 0],
                                                                              k2[:1, 0]]))
    np.testing.assert_array_equal(keys[c.blocks[1], 0], k[1, 0])
    np.testing.assert_array_equal(keys[c.blocks[1], 1:3, 0], k2[1:, 0])
    assert not host(m.blocks_buf)[:, :, 0].any()   # layer 0 never written
    m.step([0, 0], c)
    fp8 = ContinuousBatchingKVCacheManager("float8_e5m2", params, 1, 2, 1, device=kernels)
    c = fp8.fetch(fp8.claim(1))
    x = _rows(rng, (1, 1, 1, D), np.float32) * 1e5
    with pytest.raises(ValueError, match="v_scale: expected None"):
        c.write_kv(0, d(x), k_scale=4.0, v_scale=4.0)
    c.write_kv(0, d(x), k_scale=4.0)
    q = np.clip(x[0, 0] / np.float32(4.0), -57344, 57344).astype(ml_dtypes.float8_e5m2)
    assert host(c.key_cache(0))[c.blocks[0], 0].view(np.uint8).tobytes() == \
        q.view(np.uint8).tobytes()
