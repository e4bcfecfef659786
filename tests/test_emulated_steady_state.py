"""The GPU tier's steady-state loops (tests/test_gpu_steady_state.py) on the asynchronous
emulated device, so CI runs them: a thousand decode steps allocate nothing, synchronize nothing
and have no commit refused (issue 10, defect 1: with a reset every 50 steps of 2 tokens the
lengths passed ``seq=64`` and the device refused commits)."""

from __future__ import annotations

import numpy as np
import pytest

import hcache

from helpers import host

pytestmark = pytest.mark.emulated

BATCH, SEQ = 8, 64


def _hybrid():
    cfg = hcache.HybridCacheConfig(
        ["mamba", "attention", "mamba", "attention"],
        hcache.KVCacheConfig(BATCH, SEQ, [hcache.KVLayerConfig(2, 64),
                                          hcache.KVLayerConfig(1, 128)]),
        hcache.MambaCacheConfig(2, BATCH, 2, 16, 8, 32, 4), BATCH)
    return hcache.HybridCacheManager(cfg, device="cuda")


def _device_arrays(xp):
    """The loop's device increments and mapping, allocated once, outside the timed steps."""
    return (xp.ones(BATCH, dtype=np.int32),
            xp.asarray(np.array([1, 0, 2, 3, 4, 5, 6, 7], np.int32)))


def _decode_steps(m, arrays, n, reset_every):
    """The GPU tier's loop: 2 tokens per step (a uniform and a per-sequence commit), a device
    and a host compaction; returns the lengths a NumPy model expects."""
    inc, swap = arrays
    lengths = np.zeros(BATCH, np.int64)
    for i in range(n):
        if i % reset_every == 0:
            m.reset_for_new_sequences([0] * BATCH)
            lengths[:] = 0
        m.commit_sequence_length(1)
        m.commit_sequence_length(inc)
        lengths += 2
        m.compact_batch(swap, BATCH, BATCH)
        m.compact_batch(np.arange(BATCH, dtype=np.int32)[::-1].copy(), BATCH, BATCH)
    return lengths


def test_thousand_decode_steps_allocate_and_synchronize_nothing(emu_rt):
    m = _hybrid()
    arrays = _device_arrays(emu_rt.xp)
    _decode_steps(m, arrays, 3, 16)
    emu_rt.synchronize()
    allocations, syncs = emu_rt.counters["allocations"], emu_rt.counters["syncs"]
    want = _decode_steps(m, arrays, 1000, 16)
    assert emu_rt.counters["syncs"] == syncs
    emu_rt.synchronize()
    assert emu_rt.counters["allocations"] == allocations
    assert m.last_compaction_valid() and m.refused_commit_count() == 0
    assert host(m.get_kv_cache_lengths()).tolist() == want.tolist()


def test_the_old_loop_overran_the_sequence_and_the_device_refused_its_commits(emu_rt):
    """Defect 1 as it was: a reset every 50 steps of 2 tokens passes seq=64 after 32 steps; the
    device refuses the commits that would (all or nothing), and says so."""
    m = _hybrid()
    _decode_steps(m, _device_arrays(emu_rt.xp), 40, 50)
    emu_rt.synchronize()
    assert m.refused_commit_count() > 0
    assert int(host(m.get_kv_cache_lengths()).max()) <= SEQ
