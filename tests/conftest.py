"""Test tiers and hypothesis profiles.

Tiers: everything runs on every machine (unit, property, stateful, host-emulated kernels,
NVRTC compile) except tests marked ``gpu``, which are skipped when no CUDA GPU is usable.
Hypothesis profiles: ``ci`` (derandomized, default under ``CI``), ``dev`` (default locally,
more examples), ``gpu`` (fewer examples, for the device tier); pick one with
``HYPOTHESIS_PROFILE``.
"""

from __future__ import annotations

import os
from collections import Counter

# JAX preallocates most of a GPU's memory in every process that imports it (its default), which
# leaves CuPy in the same and in the other pytest-xdist workers a few MB: share the GPU instead.
# Set before anything imports JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest
from hypothesis import HealthCheck, settings

from hcache.device import cupy_available

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=40,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None, max_examples=150,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("gpu", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI")
                                                               else "dev"))

HAS_GPU = cupy_available()

if HAS_GPU and os.environ.get("HCACHE_CUPY_POOL") == "0":
    # Under compute-sanitizer memcheck: every array its own allocation, so an overrun past an
    # array's end is outside any allocation (inside a pooled block it would go unseen).
    import cupy

    cupy.cuda.set_allocator(None)
    cupy.cuda.set_pinned_memory_allocator(None)


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU (cupy.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason with its count (``-ra`` would list every skipped location
    and bury the failures); printed before the short summary of failures."""
    reports = terminalreporter.stats.get("skipped", [])
    if not reports:
        return
    reasons = Counter(str(r.longrepr[2] if isinstance(r.longrepr, tuple) else r.longrepr)
                      .removeprefix("Skipped: ") for r in reports)
    terminalreporter.section("skipped tests by reason", sep="-")
    for reason, n in reasons.most_common():
        terminalreporter.write_line(f"{n:6d}  {reason}")


@pytest.fixture(autouse=True)
def _emulated_device(request):
    """Tests marked ``emulated`` run with the asynchronous emulated device as the CUDA runtime
    (tests/emu_device.py): ``device="cuda"`` resolves to it, ``cuda:1`` to its second device.
    At the end every queue is drained, so a hazard queued by the test still runs."""
    if request.node.get_closest_marker("emulated") is None:
        yield None
        return
    emu = pytest.importorskip("emu")
    if not emu.have_compiler():
        pytest.skip("no host C++ compiler")
    from hcache import _cuda

    from emu_device import EmuRuntime

    rt = EmuRuntime()
    with _cuda.use_runtime(rt):
        yield rt
        if not rt.capturing_anywhere():
            rt.synchronize()


def pytest_report_header(config):
    return f"hcache: GPU tier {'enabled' if HAS_GPU else 'skipped (no CUDA GPU)'}"


@pytest.fixture
def xp_device():
    """``(device_name, array_module)`` for the cpu device; the GPU tier parametrizes cuda."""
    import numpy

    return "cpu", numpy


@pytest.fixture
def emu_rt(_emulated_device):
    """The emulated device's runtime of a test marked ``emulated``."""
    assert _emulated_device is not None, "emu_rt: expected a test marked emulated"
    return _emulated_device


@pytest.fixture(params=["reference", pytest.param("emu", marks=pytest.mark.emu)])
def backend(request):
    """Run the test's cpu-device calls on the NumPy reference (None), or on the real ``.cu``
    compiled for the host (yields the launcher, whose ``launches`` grow with every launch)."""
    if request.param == "reference":
        yield None
        return
    emu = pytest.importorskip("emu")
    if not emu.have_compiler():
        pytest.skip("no host C++ compiler")
    from hcache import ops

    launcher = emu.EmuLauncher()
    with ops.host_backend(launcher):
        yield launcher


@pytest.fixture
def own_pool():
    """A memory pool of this test alone, made the allocator for the whole test: arrays that
    earlier tests left to the garbage collector live in the default pool, so their release
    during the measured loop cannot move this pool's counts (a strict
    ``used_bytes`` equality then measures this test alone)."""
    import gc

    import cupy

    gc.collect()
    pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(pool.malloc):
        yield pool
