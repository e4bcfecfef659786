"""ContinuousBatchingHybridCacheManager: sizes before allocation, claimed states, layer routing,
launches per head-dim group, refused calls (docs/design.md §5.1). The random interleavings are
in test_continuous_hybrid_stateful.py, the threads in test_continuous_batching_threads.py."""

from __future__ import annotations

import numpy as np
import pytest
from test_continuous_hybrid_stateful import KIMI_TINY, gemma3_layout

from hcache import ContinuousBatchingHybridCacheManager, HybridCacheConfig, ops
from hcache.config.caches import KVCacheConfig, KVLayerConfig, LayerType, MambaCacheConfig
from hcache.demo.run import NEMOTRON_H_CONFIG

from helpers import DEVICES, host

A, M, AM, X = (LayerType.ATTENTION, LayerType.MAMBA, LayerType.ATTENTION_AND_MAMBA,
               LayerType.NONE)


def hand_layout(types, kv_layers, states, b=3, s=10, sharing=None, dtype="float16"):
    """``states``: (heads, head_dim, state, conv_dim, conv_kernel) of every recurrent layer."""
    n = sum(t.has_mamba for t in types)
    mamba = MambaCacheConfig(n, b, *states, ssm_dtype="float32", conv_dtype="bfloat16") \
        if n else None
    kv = KVCacheConfig(b, s, kv_layers, dtype, ring_windows=True)
    return HybridCacheConfig(types, kv, mamba, b, sharing)


LAYOUTS = {
    "nemotron_h": lambda: HybridCacheConfig.from_hf_config(
        NEMOTRON_H_CONFIG, max_batch_size=3, max_sequence_length=10),
    "gemma3": gemma3_layout,
    "kimi_linear": lambda: HybridCacheConfig.from_hf_config(
        KIMI_TINY, max_batch_size=3, max_sequence_length=10),
    "short_conv": lambda: hand_layout([M, A, M, X], [KVLayerConfig(2, 4)], (0, 0, 0, 6, 3)),
    "lightning": lambda: hand_layout([M, M, A], [KVLayerConfig(1, 8)], (2, 4, 4, 0, 0)),
    "falcon_h1": lambda: hand_layout([AM, AM, X], [KVLayerConfig(2, 4)] * 2, (2, 2, 3, 5, 4)),
    "gemma4_sharing": lambda: hand_layout(
        [A, A, A], [KVLayerConfig(2, 4, sliding_window=4), KVLayerConfig(1, 16)],
        (0, 0, 0, 0, 0), sharing={2: 0}),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sizes_equal_allocations(name):
    config = LAYOUTS[name]()
    m = ContinuousBatchingHybridCacheManager(config, device="cpu")
    report = m.memory_report()
    assert report["total"] == ContinuousBatchingHybridCacheManager.nbytes(config)
    # recounted from the arrays the manager hands out
    caches = {id(m.get_combined_kv_cache(i)): m.get_combined_kv_cache(i)
              for i, t in enumerate(config.layer_types) if t.has_attention}
    assert report["kv_cache"] == sum(c.nbytes for c in caches.values())
    for kind, get in (("recurrent", m.get_recurrent_state), ("conv", m.get_conv_state)):
        pools = []
        for i, t in enumerate(config.layer_types):
            if t.has_mamba:
                try:
                    pools.append(get(i))
                except ValueError:
                    pass
        assert report[kind] == sum(p.nbytes for p in pools)
    # a budget of exactly b managers' bytes gives b blocks; one byte less gives b - 1
    for b in (1, 2, 5):
        nbytes = ContinuousBatchingHybridCacheManager.nbytes(config._with_batch(b))
        assert ContinuousBatchingHybridCacheManager.max_batch_size_for(config, nbytes) == b
        assert ContinuousBatchingHybridCacheManager.max_batch_size_for(config, nbytes - 1) \
            == b - 1


def test_ring_layers_are_sized_by_their_window():
    config = gemma3_layout()
    flat = HybridCacheConfig(config.layer_types,
                             KVCacheConfig(config.max_batch_size, config.kv.max_sequence_length,
                                           config.kv.layer_configs, config.kv.dtype),
                             None, config.max_batch_size)
    ring, full = (ContinuousBatchingHybridCacheManager(c, device="cpu").memory_report()
                  for c in (config, flat))
    # 10 local layers of 2 x 4 at window 3 instead of 12, 2 global layers of 1 x 8 at 12
    assert full["kv_cache"] - ring["kv_cache"] == 4 * 2 * 10 * 2 * (12 - 3) * 4 * 4


@pytest.mark.parametrize("device", DEVICES)
def test_claim_zeroes_the_states_of_a_reused_block(device):
    m = ContinuousBatchingHybridCacheManager(LAYOUTS["falcon_h1"](), device=device)
    xp = m.device.xp
    sid = m.claim(1)[0]
    coll = m.fetch([sid])
    rec = [xp.asarray(np.full((1,) + m.get_recurrent_state(i).shape[1:], 7, np.float32))
           for i in (0, 1)]
    conv_dtype = m.get_conv_state(0).dtype
    conv = [xp.asarray(np.ones((1,) + m.get_conv_state(i).shape[1:], np.float32)
                       .astype(conv_dtype)) for i in (0, 1)]
    coll.write_states(None, rec, conv)
    m.step([0], coll)
    other = m.claim(1)[0]
    block = m.block_of(sid)
    assert host(m.get_recurrent_state(1))[block].min() == 7
    m.release(sid)
    again = m.claim(1)[0]
    assert m.block_of(again) == block and m.block_of(other) != block
    for i in (0, 1):
        assert not host(m.get_recurrent_state(i)).any()
        assert not host(m.get_conv_state(i)).view(np.uint16).any()


def test_group_views_name_decoder_layers_and_rings():
    m = ContinuousBatchingHybridCacheManager(gemma3_layout(), device="cpu")
    groups = m.get_kv_head_dim_groups()
    assert [(g.head_dim, g.layer_indices) for g in groups] == [
        (4, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)), (8, (5, 11))]
    assert groups[0].ring_windows == (3,) * 10 and groups[1].ring_windows == (0, 0)
    assert host(groups[0].device_layer_infos).shape == (10, 3)
    assert [m.get_ring_window(i) for i in (0, 5)] == [3, 0]
    assert host(m.ring_start(0, np.array([2, 3, 4, 8]))).tolist() == [0, 0, 1, 2]
    kimi = ContinuousBatchingHybridCacheManager(LAYOUTS["kimi_linear"](), device="cpu")
    (latent,) = kimi.get_kv_head_dim_groups()
    assert latent.components == 1 and latent.layer_indices == (1, 3) and latent.head_dim == 8


def test_writes_launch_once_per_group_and_once_for_every_state():
    emu = pytest.importorskip("emu")
    if not emu.have_compiler():
        pytest.skip("no host C++ compiler")
    config = hand_layout([AM, A, M, A], [KVLayerConfig(2, 4), KVLayerConfig(1, 8),
                                         KVLayerConfig(2, 4)], (2, 2, 3, 5, 4), dtype="float32")
    m = ContinuousBatchingHybridCacheManager(config, device="cpu")
    launcher = emu.EmuLauncher()
    ids = m.claim(2)
    coll = m.fetch(ids)
    k = [np.ones((2, 3, h, d), np.float32) for h, d in ((2, 4), (1, 8), (2, 4))]
    rec = [np.ones((2, 2, 2, 3), np.float32) for _ in range(2)]
    conv = [np.ones((2, 5, 4), np.float32).astype(m.get_conv_state(0).dtype)] * 2
    with ops.host_backend(launcher):
        coll.write_kv(None, k, k)
        kv_launches = [n for n, _, _ in launcher.launches]
        coll.write_states(None, rec, conv)
    assert kv_launches == ["hc_kv_write"] * 2     # two head-dim groups, three layers
    assert [n for n, _, _ in launcher.launches[2:]] == ["hc_slot_copy"]
    m.step([3, 3], coll)
    for i in (0, 1, 3):
        assert (m.get_combined_kv_cache(i)[m.block_of(ids[0]), :, :, :3] == 1).all()
    assert (m.get_recurrent_state(2)[m.block_of(ids[1])] == 1).all()
    # the same source arrays again, with new contents, in the other row order: the copy table
    # is reused (no rebind) and the rows still land in their blocks
    rec[0][...] = np.array([3, 4], np.float32)[:, None, None, None]
    coll = m.fetch(ids[::-1])
    coll.write_states(None, rec, conv)
    m.step([0, 0], coll)
    assert (m.get_recurrent_state(0)[m.block_of(ids[1])] == 3).all()
    assert (m.get_recurrent_state(0)[m.block_of(ids[0])] == 4).all()


def test_refused_writes_change_nothing():
    m = ContinuousBatchingHybridCacheManager(LAYOUTS["gemma4_sharing"](), device="cpu")
    ids = m.claim(2)
    coll = m.fetch(ids)
    k = np.ones((2, 1, 2, 4), np.float16)
    before = [m.get_combined_kv_cache(i).copy() for i in (0, 1)]
    with pytest.raises(ValueError, match="layer: expected a layer that owns its KV cache"):
        coll.write_kv(2, k, k)     # reads layer 0's cache
    with pytest.raises(ValueError, match="layer: expected a recurrent"):
        coll.write_states(0, conv=np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match=r"k\[1\]: expected shape"):
        coll.write_kv(None, [k, k], [k, k])
    with pytest.raises(ValueError, match="k: expected dtype float16"):
        coll.write_kv(0, k.astype(np.float32), k.astype(np.float32))
    with pytest.raises(TypeError, match="k: expected a list"):
        coll.write_kv(None, k, k)
    with pytest.raises(IndexError):
        coll.write_kv(3, k, k)
    assert all((m.get_combined_kv_cache(i) == b).all() for i, b in zip((0, 1), before))
    assert m.get_combined_kv_cache(2) is m.get_combined_kv_cache(0)
    lightning = ContinuousBatchingHybridCacheManager(LAYOUTS["lightning"](), device="cpu")
    coll = lightning.fetch(lightning.claim(1))
    with pytest.raises(ValueError, match="conv: expected None"):
        coll.write_states(0, conv=np.zeros((1, 1), np.float32))
    with pytest.raises(ValueError, match="recurrent, conv: expected at least one"):
        coll.write_states(0)
    with pytest.raises(ValueError, match=r"recurrent: expected shape \[1, 2, 4, 4\]"):
        coll.write_states(1, np.zeros((1, 2, 4, 5), np.float32))
    lightning.step([0], coll)
    with pytest.raises(ValueError, match="write_states: expected the batch in flight"):
        coll.write_states(0, np.zeros((1, 2, 4, 4), np.float32))


@pytest.mark.emulated
def test_decode_steps_allocate_and_synchronize_nothing(emu_rt):
    """fetch / write_kv of every layer / write_states of every layer / step, with a release and
    a claim (states zeroed) every tenth step, on the asynchronous emulated device."""
    config = hand_layout([M, A, M, A], [KVLayerConfig(2, 8), KVLayerConfig(1, 16)],
                         (2, 4, 4, 8, 4), b=4, s=512, dtype="float32")
    m = ContinuousBatchingHybridCacheManager(config, device="cuda")
    xp = emu_rt.xp
    k = [xp.asarray(np.ones((3, 1, h, d), np.float32)) for h, d in ((2, 8), (1, 16))]
    rec = [xp.asarray(np.full((3, 2, 4, 4), r + 1, np.float32)) for r in range(2)]
    conv_dtype = m.get_conv_state(0).dtype
    conv = [xp.asarray(np.ones((3, 8, 4), np.float32).astype(conv_dtype))] * 2
    ids = m.claim(3)
    want = dict.fromkeys(ids, 0)

    def steps(n):
        for i in range(n):
            if i % 10 == 9:
                del want[ids[0]]
                m.release(ids.pop(0))
                ids.extend(m.claim(1))
                want[ids[-1]] = 0
            coll = m.fetch(ids)
            coll.write_kv(None, k, k)
            coll.write_states(None, rec, conv)
            m.step([1, 1, 1], coll)
            for sid in ids:
                want[sid] += 1

    steps(3)
    emu_rt.synchronize()
    allocations, syncs = emu_rt.counters["allocations"], emu_rt.counters["syncs"]
    steps(200)
    assert emu_rt.counters["syncs"] == syncs
    emu_rt.synchronize()
    assert emu_rt.counters["allocations"] == allocations
    assert m.cache_lengths == want and max(want.values()) > 10
    for sid in ids:
        assert (host(m.get_recurrent_state(2))[m.block_of(sid)] == 2).all()
    m.check_invariants()
