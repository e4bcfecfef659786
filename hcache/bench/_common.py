"""What every benchmark module shares: the timer, the model shapes, the copy baseline and the
report row (docs/design.md §8).

A benchmark module names its row family in ``FAMILY`` and has ``run(ctx) -> list[dict]``, one
row per case built by :meth:`BenchContext.measure`; the runner adds ``family`` to each row.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from hcache.ops.tables import KVGroup
from hcache.runtime import _cuda
from hcache.runtime.device import Device

__all__ = ["DTYPE", "Timer", "BenchContext", "Mamba", "Model", "models", "kv_groups",
           "mamba_states"]

DTYPE = np.float16  # KV caches and conv states; SSM states are float32
REPLAYS = 20  # back-to-back graph replays (or copies) per timed run on a GPU


class Timer:
    """Median time of ``fn()`` in µs over ``repeat`` runs, after ``warmup`` untimed runs.

    On a GPU each run is bracketed by CUDA events (:mod:`hcache._cuda`) on the current stream
    (the device time of the work ``fn`` enqueues); on the CPU by ``time.perf_counter_ns``.
    """

    def __init__(self, xp, repeat: int, warmup: int):
        self.xp, self.repeat, self.warmup = xp, repeat, warmup

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        if self.xp is np:
            for _ in range(self.repeat):
                t0 = time.perf_counter_ns()
                fn()
                times.append((time.perf_counter_ns() - t0) / 1e3)
        else:
            rt = _cuda.runtime()
            start, end = rt.event(timing=True), rt.event(timing=True)
            for _ in range(self.repeat):
                rt.record(start)
                fn()
                rt.record(end)
                rt.event_synchronize(end)
                times.append(rt.elapsed_ms(start, end) * 1e3)  # ms -> µs
        return statistics.median(times)


@dataclass(frozen=True)
class BenchContext:
    """One bench run: the device, its timer, and ``scale`` (1 on a GPU; on the CPU shapes are
    divided by it so that the reference path finishes quickly)."""

    device: Device
    timer: Timer
    scale: int
    quick: bool = False   # ``--quick``: fewer repetitions (and shorter workloads where they run)

    @property
    def xp(self):
        return self.device.xp

    def copy_us(self, nbytes: int) -> float:
        """µs of one device-to-device copy moving ``nbytes`` (read + written)."""
        half = max(nbytes // 2, 16)
        src, dst = self.xp.ones(half, np.uint8), self.xp.empty(half, np.uint8)
        return self.timer(lambda: dst.__setitem__(Ellipsis, src))

    def host_us(self, fn) -> float:
        """Median wall µs of the call ``fn()`` alone (what the host spends enqueuing it; no
        sync inside the timed span, the device is drained between runs)."""
        sync = (lambda: None) if self.xp is np else _cuda.runtime().synchronize_stream
        for _ in range(self.timer.warmup):
            fn()
        times = []
        for _ in range(self.timer.repeat):
            sync()
            t0 = time.perf_counter_ns()
            fn()
            times.append((time.perf_counter_ns() - t0) / 1e3)
        sync()
        return statistics.median(times)

    def kernel_us(self, fn) -> tuple[float | None, str | None]:
        """``(µs, how)``: the median device µs of the launches of ``fn()`` alone, on a GPU
        (``(None, None)`` on the CPU). ``how == "graph"``: replays of a CUDA graph captured from
        one call, timed by events around :data:`REPLAYS` back-to-back replays. Where capture
        fails, events around as many back-to-back calls (then host gaps count once the host is
        slower than the device), and ``how`` says ``"calls"`` and why."""
        if self.xp is np:
            return None, None
        replay, reason = _cuda.runtime().capture_replay(fn)
        if replay is None:
            return self._events_us(fn, REPLAYS), f"calls (capture failed: {reason})"
        replay()
        return self._events_us(replay, REPLAYS), "graph"

    def memcpy_us(self, nbytes: int) -> float:
        """Median µs of one ``cudaMemcpyAsync`` device-to-device copy moving ``nbytes`` (read +
        written, so ``nbytes / 2`` copied): replays of a graph captured from one copy, timed
        as :meth:`kernel_us` times kernels (back-to-back copies where capture fails); on the
        CPU, a NumPy copy of the same bytes."""
        half = max(nbytes // 2, 16)
        src, dst = self.xp.ones(half, np.uint8), self.xp.empty(half, np.uint8)
        if self.xp is np:
            return self.timer(lambda: np.copyto(dst, src))
        rt = _cuda.runtime()

        def copy():
            rt.copy_d2d(dst, src, half)

        replay, _ = rt.capture_replay(copy)   # like kernel_us: small copies are not host-bound
        if replay is None:
            return self._events_us(copy, REPLAYS)
        replay()
        return self._events_us(replay, REPLAYS)

    def _events_us(self, fn, calls: int) -> float:
        """Median over ``timer.repeat`` runs of µs per call of ``calls`` back-to-back ``fn()``,
        by CUDA events on the current stream."""
        rt = _cuda.runtime()
        start, end = rt.event(timing=True), rt.event(timing=True)
        times = []
        for _ in range(self.timer.repeat):
            rt.record(start)
            for _ in range(calls):
                fn()
            rt.record(end)
            rt.event_synchronize(end)
            times.append(rt.elapsed_ms(start, end) * 1e3 / calls)
        return statistics.median(times)

    def measure(self, model: str, case: str, fn, nbytes: int, naive, launches: int) -> dict:
        """Time ``fn``, a copy of the same bytes and ``naive`` (the obvious CuPy alternative, or
        None); return the report row (without ``family``).

        ``nbytes`` counts the bytes that must move, read + written; ``launches`` the kernel
        launches of one ``fn()`` on a GPU. Row fields: ``us`` (events around one call, host
        gaps included), ``kernel_us`` (device time of the launches alone, None on the CPU),
        ``kernel_timing`` (``"graph"``, or ``"calls"`` and why capture failed), ``host_us``
        (wall time of the call, no sync), ``memcpy_us`` (a device-to-device
        ``cudaMemcpyAsync`` of the same bytes, same run; a NumPy copy on the CPU),
        ``kernel_vs_memcpy`` (``memcpy_us / kernel_us``: 1 is copy speed), ``vs_copy`` and
        ``speedup_vs_naive`` (against ``us``).
        """
        us = self.timer(fn)
        kernel_us, kernel_timing = self.kernel_us(fn)
        host_us = self.host_us(fn)
        memcpy_us = self.memcpy_us(nbytes)
        copy_us = self.copy_us(nbytes)
        naive_us = self.timer(naive) if naive is not None else None
        return {"model": model, "case": case, "us": round(us, 3), "bytes": int(nbytes),
                "GBps": round(nbytes / us / 1e3, 2) if us else None,
                "vs_copy": significant(copy_us / us) if us else None,
                "speedup_vs_naive": significant(naive_us / us) if naive_us and us else None,
                "kernel_us": round(kernel_us, 3) if kernel_us is not None else None,
                "kernel_timing": kernel_timing,
                "host_us": round(host_us, 3),
                "memcpy_us": round(memcpy_us, 3),
                "kernel_vs_memcpy": (significant(memcpy_us / kernel_us) if kernel_us
                                     else None),
                "launches": launches}


@dataclass(frozen=True)
class Mamba:
    """Mamba-2 layers: ``layers`` SSM states ``[slots, *ssm]`` (float32) and as many conv
    states ``[slots, *conv]`` (:data:`DTYPE`)."""

    layers: int
    ssm: tuple[int, ...]
    conv: tuple[int, ...]


@dataclass(frozen=True)
class Model:
    """A benchmark model: ``attention`` is ``(kv heads, head dim)`` per attention layer;
    ``components`` is 2 (K and V) or 1 (latent MLA caches, one plane per layer)."""

    name: str
    attention: tuple[tuple[int, int], ...]
    mamba: Mamba | None
    components: int = 2


def significant(ratio: float, digits: int = 3) -> float:
    """``ratio`` to ``digits`` significant digits: a slow case's tiny ratio (the CPU reference
    of an FP8 write against a copy) stays > 0, where a fixed number of decimals rounds it to 0."""
    return float(f"{ratio:.{digits}g}")


def models(scale: int) -> list[Model]:
    """A Nemotron-H-like hybrid (4 attention layers of 8 KV heads × 128, 24 Mamba-2 layers), a
    Gemma-like heterogeneous model (5 sliding layers of head dim 256, 1 full layer of 512) and
    a DeepSeek-V3-like MLA model (61 latent layers of 512 + 64, one head; fewer on the CPU)."""
    nemotron = Model("nemotron-h-like", ((8, 128),) * 4,
                     Mamba(24, (128 // scale, 64, 128 // scale), (8192 // scale, 4)))
    gemma = Model("gemma-like", ((16, 256),) * 5 + ((4, 512),), None)
    deepseek = Model("deepseek-v3-like", ((1, 576),) * max(61 // scale, 1), None, components=1)
    return [nemotron, gemma, deepseek]


def kv_groups(xp, model: Model, slots: int, seq: int) -> list[tuple[KVGroup, list]]:
    """Zeroed HND caches ``[slots, C, H, seq, D]`` (``C = model.components``) of ``model``'s
    attention layers, one ``(KVGroup, layers)`` per head dim (one launch each)."""
    by_dim: dict[int, list] = {}
    for heads, dim in model.attention:
        by_dim.setdefault(dim, []).append(xp.zeros((slots, model.components, heads, seq, dim),
                                                   DTYPE))
    return [(KVGroup(layers), layers) for layers in by_dim.values()]


def mamba_states(xp, mamba: Mamba, slots: int, fill: float = 0.0) -> list:
    """``mamba.layers`` SSM states then as many conv states, ``slots`` slots each."""
    return ([xp.full((slots, *mamba.ssm), fill, np.float32) for _ in range(mamba.layers)]
            + [xp.full((slots, *mamba.conv), fill, DTYPE) for _ in range(mamba.layers)])
