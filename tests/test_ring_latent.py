"""A latent (MLA, one component) layer with a sliding window is a ring buffer like a K/V layer
(docs/design.md §3.8, §3.9, §4.10).

MLA models rarely slide, but nothing in the layout forbids it: the ring window lives in each
layer's ``KVLayerInfo`` and the component count is a launch argument, so a latent ring shares
its launch with a latent unbounded layer of its head dim, and a K/V ring of the same head dim
gets a launch of its own. The oracle is the same program on unbounded caches
(``ring_windows=False``): after every step every ring must equal the unbounded cache restricted
to its window (position ``p`` at entry ``p mod W``), captures of a wrapped ring must be the
unbounded capture's last ``W`` tokens, and a restore must land them where they were. Run on the
``cpu`` device (the NumPy reference) and on the kernels compiled for the host.
"""

from __future__ import annotations

import numpy as np
import pytest

from hcache import HybridCacheConfig, HybridCacheManager, KVCacheConfig, KVLayerConfig, ops
from hcache.config.caches import LayerType

from helpers import DEVICES, host
from kernel_cases import on

W, S, D = 3, 24, 16
# (heads, head_dim, window, components): a latent ring, a latent unbounded layer, a K/V ring
LAYERS = [(1, D, W, 1), (1, D, None, 1), (2, D, W, 2)]


def _manager(rings: bool, device="cpu") -> HybridCacheManager:
    kv = KVCacheConfig(3, S, [KVLayerConfig(h, d, w, components=c) for h, d, w, c in LAYERS],
                       "float32", ring_windows=rings)
    cfg = HybridCacheConfig((LayerType.ATTENTION,) * len(LAYERS), kv, None, 3)
    return HybridCacheManager(cfg, device=device)


def _check(ring, flat, lengths):
    """Every ring holds the unbounded cache's last min(length, W) positions at p mod W; every
    unbounded layer of the ring manager equals the other manager's, token for token."""
    for layer, (_, _, window, comps) in enumerate(LAYERS):
        r = host(ring.get_combined_kv_cache(layer))
        f = host(flat.get_combined_kv_cache(layer))
        assert r.shape[1] == f.shape[1] == comps
        w = ring.get_ring_window(layer)
        assert w == (window or 0)
        for slot, n in enumerate(lengths):
            if w:
                for p in range(max(0, n - w), n):
                    assert np.array_equal(r[slot, :, :, p % w], f[slot, :, :, p])
            else:
                assert np.array_equal(r[slot, :, :, :n], f[slot, :, :, :n])


def _write(managers, rng, counts):
    """One ragged write of every layer (latent layers: k only) and a commit, on both."""
    total = sum(counts)
    ks = [rng.standard_normal((total, h, d)).astype(np.float32) for h, d, _, _ in LAYERS]
    vs = [rng.standard_normal((total, h, d)).astype(np.float32) if c == 2 else None
          for h, d, _, c in LAYERS]
    for m in managers:
        xp = m.kv_cache_manager.device.xp
        m.write_kv(None, [on(xp, k) for k in ks], [v if v is None else on(xp, v) for v in vs],
                   seq_lengths=counts)
        m.commit_sequence_length(np.asarray(counts, np.int32))


def _program(device="cpu"):
    rng = np.random.default_rng(7)
    ring, flat = _manager(True, device), _manager(False, device)
    groups = ring._kv.groups
    # one launch per (head dim, components): the two latent layers together, the K/V ring alone
    assert [(g.components, g.ring_windows) for g in groups] == [(1, (W, 0)), (2, (W,))]
    assert ring.memory_report()["kv_cache"] < flat.memory_report()["kv_cache"]
    for m in (ring, flat):
        m.reset_for_new_sequences([0, 0, 0])
    counts = [2 * W + 1, 1, W]             # a prefill longer than the window keeps its last W
    _write((ring, flat), rng, counts)
    lengths = list(counts)
    _check(ring, flat, lengths)
    for step in range(3 * W):
        if step == W:   # evict row 1 and swap the others: 0 -> 1, 2 -> 0
            for m in (ring, flat):
                m.compact_batch(np.asarray([1, -1, 0], np.int32), 3, 2)
            lengths = [lengths[2], lengths[0]]
            _check(ring, flat, lengths)
        _write((ring, flat), rng, [1] * len(lengths))
        lengths = [n + 1 for n in lengths]
        _check(ring, flat, lengths)
    # a prompt cache of a wrapped latent ring: [1, 1, W, D], the last W positions in order
    n = lengths[1]
    saved_ring, saved_flat = ring.capture_kv_cache(1, n), flat.capture_kv_cache(1, n)
    for a, (_, _, window, comps) in enumerate(LAYERS):
        flat_a = host(saved_flat[a])
        want = flat_a[:, :, n - window:] if window else flat_a
        assert saved_ring[a].shape[0] == comps
        assert np.array_equal(host(saved_ring[a]), want)
    for m, saved in ((ring, saved_ring), (flat, saved_flat)):
        m.reset_for_new_sequences([lengths[0], lengths[1], 0])
        m.restore_kv_cache(saved, 2)
        m.reset_for_new_sequences([lengths[0], lengths[1], n])
    _check(ring, flat, [lengths[0], lengths[1], n])
    _write((ring, flat), rng, [1, 1, 1])
    _check(ring, flat, [lengths[0] + 1, lengths[1] + 1, n + 1])


@pytest.mark.parametrize("device", DEVICES)
def test_latent_ring_layer_matches_unbounded_cache(device):
    """cpu device (the NumPy reference), a GPU, and the asynchronous emulated device."""
    _program(device)


@pytest.mark.emu
def test_latent_ring_layer_matches_unbounded_cache_emulated():
    """The same program on the real kernels compiled for the host: every write, compaction and
    capture/restore is an emulated launch (counted), with the latent group's component count."""
    emu = pytest.importorskip("emu")
    if not emu.have_compiler():
        pytest.skip("no host C++ compiler")
    launcher = emu.EmuLauncher(reverse=True, wide_index=True)
    with ops.host_backend(launcher):
        _program()
    names = {name for name, _, _ in launcher.launches}
    assert {"hc_kv_write", "hc_kv_compact", "hc_kv_capture"} <= names


def test_latent_ring_from_a_config_and_its_capture_length_check():
    """KVCacheConfig sizes a latent ring at its window (one component: no V bytes), and the
    hybrid manager refuses a capture shorter than a wrapped ring's slot length."""
    kv = KVCacheConfig(1, 64, [KVLayerConfig(1, 8, 4, components=1)], "float32",
                       ring_windows=True)
    assert kv.layer_cache_lengths == (4,)
    m = HybridCacheManager(HybridCacheConfig((LayerType.ATTENTION,), kv, None, 1), device="cpu")
    assert m.get_combined_kv_cache(0).shape == (1, 1, 1, 4, 8)
    assert m.memory_report()["kv_cache"] == 4 * 8 * 4
    m.reset_for_new_sequences([0])
    rows = np.arange(6 * 8, dtype=np.float32).reshape(1, 6, 1, 8)
    m.write_kv(None, [rows])               # v=None: every layer is latent
    m.commit_sequence_length(6)
    cache = m.get_combined_kv_cache(0)
    for p in range(2, 6):
        assert np.array_equal(cache[0, 0, 0, p % 4], rows[0, p, 0])
    assert int(m.ring_start(0)[0]) == 6 % 4
    with pytest.raises(ValueError, match=r"sequence_length: expected 6 \(slot 0's length"):
        m.capture_kv_cache(0, 5)
    (saved,) = m.capture_kv_cache(0, 6)
    assert np.array_equal(saved[0, 0], rows[0, 2:, 0])
