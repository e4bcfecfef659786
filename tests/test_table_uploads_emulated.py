"""Per-call pointer tables on the asynchronous emulated device (tests/emu_device.py): a table
uploaded on one stream is not visible to a kernel on another stream that is not ordered after
the upload, so a call on another stream uploads its own (docs/design.md §2)."""

from __future__ import annotations

import numpy as np
import pytest

from hcache import ops
from hcache.ops.tables import KVGroup

from helpers import host

pytestmark = pytest.mark.emulated


def test_defect_write_plan_skips_the_upload_on_another_current_stream(emu_rt):
    """A repeated ``ops.kv_write`` (its step plan memoizes the pointer table) under a second
    current stream, while the first stream's upload of the same table is still queued: the
    second stream's kernel must read a table uploaded on its own stream (model: every layer
    holds the new rows). The GPU run of 2026-11-27 found the plan keyed the memo by pointers
    alone and wrote the previous table's rows."""
    xp = emu_rt.xp
    layers = [xp.zeros((2, 2, 1, 4, 8), np.float16) for _ in range(2)]
    group = KVGroup(layers)
    old = [xp.full((1, 1, 8), 1, np.float16) for _ in range(2)]
    new = [xp.full((1, 1, 8), 2, np.float16) for _ in range(2)]
    offsets = xp.asarray(np.array([0, 1], np.int32))
    ops.kv_write(group, old, old, seq_offsets=offsets)        # the plan's table: `old`
    emu_rt.synchronize()
    s1, s2 = emu_rt.stream(non_blocking=True), emu_rt.stream(non_blocking=True)
    with s1:
        ops.kv_write(group, new, new, seq_offsets=offsets)    # upload of `new` queued on s1
    with s2:
        ops.kv_write(group, new, new, seq_offsets=offsets)
    s2.synchronize()                                          # s1 has not run
    assert s1.executed < s1.enqueued
    got = [host(layer)[0, :, 0, 0, 0].tolist() for layer in layers]
    assert got == [[2.0, 2.0], [2.0, 2.0]]


def test_defect_a_new_group_is_read_on_a_non_blocking_stream_before_its_tables_land(emu_rt):
    """A ``KVGroup`` built on the current stream, then written on a non-blocking stream at
    once: the kernel must find the group's layer table uploaded (model: the rows written).
    With the construction's uploads left queued on the legacy stream, the kernel read
    uninitialized descriptors (the emulator's fresh bytes)."""
    xp = emu_rt.xp
    layers = [xp.zeros((2, 2, 1, 4, 8), np.float16) for _ in range(2)]
    rows = [xp.full((1, 1, 8), 3, np.float16) for _ in range(2)]
    offsets = xp.asarray(np.array([0, 1], np.int32))
    emu_rt.synchronize()                                # the caller's arrays are ready
    s = emu_rt.stream(non_blocking=True)
    group = KVGroup(layers)
    with s:
        ops.kv_write(group, rows, rows, seq_offsets=offsets)
        s.synchronize()
    for layer in layers:
        assert host(layer)[0, :, 0, 0, 0].tolist() == [3.0, 3.0]


def test_a_repeated_write_on_one_stream_writes_each_steps_rows(emu_rt):
    """The memo still holds on one stream: repeated writes from the same buffers, whose
    contents change between calls, write each call's contents at its position."""
    xp = emu_rt.xp
    layers = [xp.zeros((2, 2, 1, 4, 8), np.float16) for _ in range(2)]
    group = KVGroup(layers)
    rows = [xp.zeros((1, 1, 8), np.float16) for _ in range(2)]
    offsets = xp.asarray(np.array([0, 1], np.int32))
    lengths = [xp.asarray(np.array([step], np.int32)) for step in range(3)]
    emu_rt.synchronize()
    s = emu_rt.stream(non_blocking=True)
    with s:
        for step in range(3):
            for r in rows:
                r[...] = step + 1
            ops.kv_write(group, rows, rows, seq_offsets=offsets, cache_lengths=lengths[step])
        s.synchronize()
    for layer in layers:
        assert host(layer)[0, 0, 0, :3, 0].tolist() == [1.0, 2.0, 3.0]
