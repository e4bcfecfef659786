"""The emulated device's own rules (tests/emu_device.py): each is a GPU behaviour that the CUDA
path's tests rely on to fail when the package breaks it, so each is checked here first."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from hcache import _cuda, ops
from hcache.device import resolve_device, to_host, upload

from emu_device import FRESH, POISON, EmuError

pytestmark = pytest.mark.emulated


def test_work_waits_in_its_queue_until_something_waits_for_it(emu_rt):
    xp = emu_rt.xp
    a = xp.zeros(4, dtype=np.int32)
    s = emu_rt.stream(non_blocking=True)
    with s:
        a[...] = 7
    assert not (a._v == 7).any()        # queued, not run (nor is the zero fill yet)
    assert a.get().tolist() == [0] * 4  # the default stream does not wait for s
    s.synchronize()
    assert a.get().tolist() == [7] * 4


def test_legacy_default_stream_orders_blocking_streams(emu_rt):
    xp = emu_rt.xp
    a = xp.zeros(3, dtype=np.int32)
    s = emu_rt.stream()                 # blocking, as cupy.cuda.Stream() is
    with s:
        a[...] = 5
    assert a.get().tolist() == [5] * 3  # a read on the default stream waits for s


def test_pinned_copies_read_the_host_at_execution_pageable_at_the_call(emu_rt):
    xp = emu_rt.xp
    dst = xp.zeros(2, dtype=np.int32)
    pinned = emu_rt.pinned_empty(8).view(np.int32)
    pinned[:] = [1, 2]
    emu_rt.copy_h2d(dst, pinned)
    pinned[:] = [3, 4]                  # rewritten before the copy ran
    assert dst.get().tolist() == [3, 4]
    pageable = np.array([5, 6], np.int32)
    before = emu_rt.counters["pageable_copies"]
    emu_rt.copy_h2d(dst, pageable)
    pageable[:] = 0
    assert dst.get().tolist() == [5, 6]
    assert emu_rt.counters["pageable_copies"] == before + 1


def test_capture_refuses_syncs_allocations_and_pageable_copies(emu_rt):
    xp = emu_rt.xp
    a = xp.zeros(2, dtype=np.int32)
    s = emu_rt.stream(non_blocking=True)
    with s:
        s.begin_capture()
        for bad in (lambda: a.get(), lambda: xp.zeros(1), lambda: emu_rt.pinned_empty(8),
                    lambda: emu_rt.copy_h2d(a, np.zeros(2, np.int32)), emu_rt.synchronize):
            with pytest.raises(EmuError, match="capture"):
                bad()
        s.end_capture()


def test_a_graph_replays_its_work_reading_pinned_memory_each_time(emu_rt):
    xp = emu_rt.xp
    acc = xp.zeros(3, dtype=np.int32)
    inc = xp.zeros(3, dtype=np.int32)
    pinned = emu_rt.pinned_empty(12).view(np.int32)
    s = emu_rt.stream(non_blocking=True)
    emu_rt.synchronize()                # the zero fills (default stream) before s's work
    with resolve_device("cuda").scope(), s:
        s.begin_capture()
        emu_rt.copy_h2d(inc, pinned)
        ops.lengths_add(acc, 3, inc, 1000)
        graph = s.end_capture()
        for step in range(5):
            pinned[:] = step
            graph.launch(s)
            s.synchronize()
    assert acc.get().tolist() == [10] * 3   # 0 + 1 + 2 + 3 + 4


def test_devices_keep_their_streams_and_memory(emu_rt):
    xp = emu_rt.xp
    with emu_rt.device_scope(1):
        on1 = xp.zeros(4, dtype=np.int32)
        s1 = emu_rt.stream()
    assert on1.device.id == 1
    with pytest.raises(EmuError, match="device 1"):
        with s1:
            pass
    with pytest.raises(EmuError, match="device 1"):
        emu_rt.launch(("lengths", "hc_lengths_add"), (1,), (1,), (np.uint64(on1.data.ptr),))
    on0 = xp.ones(4, dtype=np.int32)
    with pytest.raises(EmuError, match="memory of device 0 given to a launch on device 1"):
        ops.lengths_add(on1, 4, on0, 10)   # the op runs on its lengths' device, 1
    ops.lengths_add(on1, 4, 1, 10)         # an op runs where its arrays live (device 0 current)
    with emu_rt.device_scope(1):
        assert on1.get().tolist() == [1] * 4


def test_freed_memory_is_poisoned_and_fresh_memory_is_garbage(emu_rt):
    xp = emu_rt.xp
    a = xp.empty(16, dtype=np.uint8)
    assert (a._v == FRESH).all()
    raw = a._v
    ptr = a.data.ptr
    del a
    gc.collect()
    emu_rt.synchronize()
    assert (raw == POISON).all()
    with pytest.raises(EmuError, match="freed"):
        emu_rt.launch(("lengths", "hc_lengths_add"), (1,), (1,), (np.uint64(ptr),))


def test_the_package_may_not_compute_on_device_arrays(emu_rt):
    """A NumPy-style op on device memory from inside hcache is a hidden host round trip."""
    xp = emu_rt.xp
    a = xp.zeros(2, dtype=np.float32)
    with pytest.raises(EmuError, match="hcache.dtypes"):
        from hcache.dtypes import fp8_scales

        fp8_scales(a)
    assert (a + 1).get().tolist() == [1.0, 1.0]   # a test may


def test_uploads_are_pinned_and_capturable(emu_rt):
    xp = emu_rt.xp
    dst = xp.zeros(4, dtype=np.int32)
    s = emu_rt.stream(non_blocking=True)
    host = np.arange(4, dtype=np.int32)
    emu_rt.synchronize()
    with resolve_device("cuda").scope(), s:
        upload(dst, host)                   # fills the capture reserve, outside capture
        s.begin_capture()
        upload(dst, host + 10)
        graph = s.end_capture()
        host[:] = -1                        # the caller's array may change: it was staged
        upload(dst, np.zeros(4, np.int32))
        graph.launch(s)
        assert to_host(dst).tolist() == [10, 11, 12, 13]   # read on s
    assert emu_rt.counters["pageable_copies"] == 0
    assert _cuda.runtime() is emu_rt
