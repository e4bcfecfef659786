"""The bench's GPU path (``python -m hcache bench`` on ``cuda``) on the emulated device: every
kernel family's rows are made with a captured graph for ``kernel_us`` and a device-to-device
copy for ``memcpy_us``, through the device boundary. The first GPU runs met this code untested:
here it runs in CI (the emulator times nothing: it shows the path works and captures)."""

from __future__ import annotations

import pytest

from hcache.bench import _common, calls
from hcache.bench._common import BenchContext, Timer
from hcache.bench.runner import KERNEL_BENCHES
from hcache.runtime.device import resolve_device

pytestmark = pytest.mark.emulated


@pytest.mark.parametrize("bench", KERNEL_BENCHES, ids=lambda b: b.FAMILY)
def test_every_kernel_row_is_timed_from_a_captured_graph(emu_rt, bench, monkeypatch):
    """Each row of the family on ``cuda`` (shapes scaled down) has a graph-replay kernel time
    and a copy baseline; a call that could not be captured would say so in ``kernel_timing``
    (one replay per timing: the emulator runs every replayed kernel)."""
    monkeypatch.setattr(_common, "REPLAYS", 1)
    device = resolve_device("cuda")
    ctx = BenchContext(device, Timer(device.xp, 1, 0), 16)
    with device.scope():
        rows = bench.run(ctx)
    assert rows
    for row in rows:
        assert row["kernel_timing"] == "graph", (row["case"], row["kernel_timing"])
        assert row["kernel_us"] is not None and row["memcpy_us"] is not None


def test_calls_bench_on_cuda_takes_as_many_rounds_as_a_gpu_run(emu_rt):
    """``bench --calls`` on ``cuda`` times every case over the GPU bench's 200 rounds: the
    context cases stay within their capacity (the GPU run of 2026-11-27 ran out of KV blocks
    in the decode case and of request slots in ``add_request``)."""
    device = resolve_device("cuda")
    rows = calls.measure(device, rounds=200, only=["context"])
    assert [r["case"] for r in rows] == ["context decode step b256", "context add_request"]
    assert all(r["us"] > 0 for r in rows)


def test_quick_serving_rows_on_cuda_are_short_whatever_the_timer_repeats(emu_rt):
    """``bench --host --quick`` on ``cuda`` (the GPU timer repeats 20 times): one short run at
    pool x1 per block size. The GPU run of 2026-11-27 guessed "quick" from the repeats and ran
    the full serving bench (10,704 steps) into its time limit."""
    from hcache.bench import host_serving

    device = resolve_device("cuda")
    ctx = BenchContext(device, Timer(device.xp, 20, 5), 1, quick=True)
    rows = host_serving.run(ctx)
    decode = [r for r in rows if r["case"].startswith("serving decode")]
    assert [r["block"] for r in decode] == [16, 256]
    assert all(r["pool_scale"] == 1 and r["rounds"] == 1 and r["steps"] == 20 for r in decode)
