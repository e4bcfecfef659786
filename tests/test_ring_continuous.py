"""Continuous batching with ring blocks (``sliding_window``, docs/design.md §5): requests are
admitted and released while others decode four windows past the window; after every step each
live sequence's ring equals an unbounded manager's block restricted to the window (positions
``length - min(length, W)`` onward at entries ``p mod W``). On the ``cpu`` device and on the
emulated kernels."""

from __future__ import annotations

import numpy as np
import pytest

from hcache import ops
from hcache.continuous.manager import ContinuousBatchingKVCacheManager
from hcache.continuous.params import KVCacheStaticParams

from helpers import DEVICES, host
from kernel_cases import on

W, S, LAYERS, HEADS, DIM = 4, 40, 2, 2, 8


def _check(ring, flat, lengths):
    """Every live sequence's ring against the unbounded block, every layer, K and V."""
    rb, fb = host(ring.blocks_buf), host(flat.blocks_buf)
    for (rblock, fblock), n in lengths.items():
        for p in range(max(0, n - W), n):
            assert np.array_equal(rb[rblock, :, :, p % W], fb[fblock, :, :, p])
        start = ring.ring_start(n)
        order = (start + np.arange(min(n, W))) % W
        assert np.array_equal(rb[rblock][:, :, order], fb[fblock][:, :, n - min(n, W):n])


def _device_xp():
    from hcache import _cuda

    return _cuda.runtime().xp


def _run(rng, device="cpu"):
    params = KVCacheStaticParams(HEADS, DIM)
    ring = ContinuousBatchingKVCacheManager("float32", params, 3, S, LAYERS, device=device,
                                            sliding_window=W)
    flat = ContinuousBatchingKVCacheManager("float32", params, 3, S, LAYERS, device=device)
    assert ring.blocks_buf.shape == (3, 2, LAYERS, W, HEADS, DIM) and ring.ring_window == W
    assert ring.memory_report()["blocks_buf_bytes"] * S == \
        flat.memory_report()["blocks_buf_bytes"] * W
    live = {}   # ring seq_id -> (flat seq_id, length)
    xp = np if device == "cpu" else _device_xp()

    def admit(prompt_len):
        rid, fid = ring.claim(1)[0], flat.claim(1)[0]
        live[rid] = (fid, 0)
        step({rid: prompt_len})

    def step(counts):
        rids = list(counts)
        colls = ring.fetch(rids), flat.fetch([live[r][0] for r in rids])
        n = [counts[r] for r in rids]
        for layer in range(LAYERS):
            k = on(xp, rng.standard_normal((sum(n), HEADS, DIM)).astype(np.float32))
            v = on(xp, rng.standard_normal((sum(n), HEADS, DIM)).astype(np.float32))
            for coll in colls:
                coll.write(layer, k, v, seq_lengths=n)
        # the ring starts of the batch, from its device lengths (before the step commits)
        lengths = colls[0].cache_lengths
        starts = ring.ring_start(lengths)
        assert type(starts) is type(lengths)
        want = [live[r][1] % W if live[r][1] > W else 0 for r in rids]
        assert host(starts).tolist() == want
        ring.step(n, colls[0])
        flat.step(n, colls[1])
        for r, c in counts.items():
            live[r] = (live[r][0], live[r][1] + c)
        _check(ring, flat, {(ring.block_of(r), flat.block_of(f)): length
                            for r, (f, length) in live.items()})

    admit(3)
    admit(2 * W + 1)            # a prefill longer than the window: only its last W land
    for i in range(4 * W + 2):
        step({r: 1 for r in live})
        if i == W:              # release one, admit another while the rest decode
            gone = next(iter(live))
            ring.release(gone)
            flat.release(live.pop(gone)[0])
            admit(W + 3)
    assert min(length for _, length in live.values()) >= 4 * W
    ring.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
def test_continuous_batching_rings_match_unbounded_blocks(device):
    """cpu, a GPU, and the asynchronous emulated device (the CUDA path)."""
    _run(np.random.default_rng(0), device)


@pytest.mark.emu
def test_continuous_batching_rings_emulated():
    emu = pytest.importorskip("emu")
    if not emu.have_compiler():
        pytest.skip("no host C++ compiler")
    launcher = emu.EmuLauncher()
    with ops.host_backend(launcher):
        _run(np.random.default_rng(1))
    assert any(name == "hc_kv_write" for name, _, _ in launcher.launches)


def test_sliding_window_argument():
    """A window at or past max_seq_len keeps unbounded blocks; a bad window is refused."""
    params = KVCacheStaticParams(1, 4)
    m = ContinuousBatchingKVCacheManager("float16", params, 2, 8, 1, device="cpu",
                                         sliding_window=8)
    assert m.ring_window == 0 and m.blocks_buf.shape[3] == 8 and m.ring_start(9) == 0
    with pytest.raises(ValueError, match="sliding_window"):
        ContinuousBatchingKVCacheManager("float16", params, 2, 8, 1, device="cpu",
                                         sliding_window=0)
    m = ContinuousBatchingKVCacheManager("float16", params, 2, 8, 1, device="cpu",
                                         sliding_window=3)
    assert [m.ring_start(n) for n in (2, 3, 4, 8)] == [0, 0, 1, 2]
    assert m.memory_report()["ring_window"] == 3
