"""GPU tier: steady-state methods allocate no device memory and can be captured in a CUDA graph
(docs/design.md §2, §3). Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import hcache

from helpers import host

pytestmark = pytest.mark.gpu



def _hybrid(max_batch=8, seq=64):
    cfg = hcache.HybridCacheConfig(
        ["mamba", "attention", "mamba", "attention"],
        hcache.KVCacheConfig(max_batch, seq, [hcache.KVLayerConfig(2, 64),
                                             hcache.KVLayerConfig(1, 128)]),
        hcache.MambaCacheConfig(2, max_batch, 2, 16, 8, 32, 4), max_batch)
    return hcache.HybridCacheManager(cfg, device="cuda")


def test_thousand_decode_steps_allocate_nothing(own_pool):
    import cupy

    m = _hybrid()
    pool = own_pool
    inc = cupy.ones(8, dtype=cupy.int32)
    swap = cupy.array([1, 0, 2, 3, 4, 5, 6, 7], dtype=cupy.int32)

    def steps(n):
        for i in range(n):
            # Each step commits 2 tokens: a new batch every 16 steps stays within seq=64.
            if i % 16 == 0:
                m.reset_for_new_sequences([0] * 8)
            m.commit_sequence_length(1)
            m.commit_sequence_length(inc)
            m.compact_batch(swap, 8, 8)                                    # device mapping
            m.compact_batch(np.arange(8, dtype=np.int32)[::-1].copy(), 8, 8)  # host mapping

    steps(3)  # warm-up: kernel compilation and CuPy's own caches
    cupy.cuda.get_current_stream().synchronize()
    used, total = pool.used_bytes(), pool.total_bytes()
    steps(1000)
    cupy.cuda.get_current_stream().synchronize()
    assert pool.used_bytes() == used and pool.total_bytes() == total
    assert m.last_compaction_valid() and m.refused_commit_count() == 0


def test_continuous_batching_steps_allocate_nothing(own_pool):
    import cupy

    mgr = hcache.ContinuousBatchingKVCacheManager(
        "bfloat16", hcache.KVCacheStaticParams(4, 64), max_batch_size=4, max_seq_len=2048,
        num_layers=3, device="cuda")
    ids = mgr.claim(4)
    token = cupy.zeros((4, 1, 4, 64), dtype=mgr.blocks_buf.dtype)
    pool = own_pool

    def steps(n):
        for _ in range(n):
            batch = mgr.fetch(ids)
            for layer in range(3):
                batch.write(layer, token, token)
            mgr.step([1, 1, 1, 1], batch)

    steps(2)
    cupy.cuda.get_current_stream().synchronize()
    used = pool.used_bytes()
    steps(500)
    cupy.cuda.get_current_stream().synchronize()
    assert pool.used_bytes() == used


def test_decode_step_replays_from_a_cuda_graph():
    import cupy

    m = _hybrid()
    m.reset_for_new_sequences([3, 1, 4, 1])
    inc = cupy.array([1, 2, 0, 1], dtype=cupy.int32)
    mapping = cupy.array([0, 1, 2, 3], dtype=cupy.int32)
    m.commit_sequence_length(inc)           # compile every kernel before capture
    m.compact_batch(mapping, 4, 4)
    cupy.cuda.get_current_stream().synchronize()
    start = host(m.get_kv_cache_lengths())
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        m.commit_sequence_length(inc, stream=stream)
        m.compact_batch(mapping, 4, 4, stream=stream)
        graph = stream.end_capture()
    for _ in range(5):
        graph.launch(stream)
    stream.synchronize()
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()),
                                  start + 5 * np.array([1, 2, 0, 1]))


def test_a_decode_step_with_host_uploads_replays_from_a_cuda_graph():
    """``write_kv(None, ...)`` (uploads a pointer table) and ``commit_sequence_length`` of host
    ints (uploads the increments) captured together and replayed: each replay writes the rows
    the K/V buffers hold then, at the next position. The GPU run of 2026-11-27 found CuPy's
    ``copy_from_host_async`` refusing every host copy during capture (twin on the emulated
    device: test_emulated_cuda_path.py, defect 3)."""
    import cupy

    batch, steps = 4, 5
    m = _hybrid()
    m.reset_for_new_sequences([0] * batch)
    kvm = m.kv_cache_manager
    caches = [kvm.get_combined_kv_cache(i) for i in range(kvm.num_layers)]
    ks = [cupy.zeros((batch, 1, c.shape[2], c.shape[4]), c.dtype) for c in caches]
    vs = [cupy.zeros_like(k) for k in ks]
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    m.write_kv(None, ks, vs, stream=stream)                   # warm-up: position 0 holds zeros
    m.commit_sequence_length(np.ones(batch, np.int64), stream=stream)
    with stream:
        stream.begin_capture()
        m.write_kv(None, ks, vs, stream=stream)
        m.commit_sequence_length(np.ones(batch, np.int64), stream=stream)
        graph = stream.end_capture()
        for step in range(steps):
            for layer, (k, v) in enumerate(zip(ks, vs)):
                k.fill(step + 1 + layer)
                v.fill(-(step + 1 + layer))
            graph.launch(stream)
        stream.synchronize()
    assert host(m.get_kv_cache_lengths()).tolist() == [steps + 1] * batch
    for layer, cache in enumerate(caches):
        got = host(cache)[:batch]
        want = (np.arange(1, steps + 1) + layer).astype(got.dtype)
        np.testing.assert_array_equal(got[:, 0, :, 1:steps + 1],
                                      np.broadcast_to(want[None, None, :, None],
                                                      got[:, 0, :, 1:steps + 1].shape))
        np.testing.assert_array_equal(got[:, 1, :, 1:steps + 1], -got[:, 0, :, 1:steps + 1])
        assert not got[:, :, :, 0].any() and not got[:, :, :, steps + 1:].any()
