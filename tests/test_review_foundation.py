"""Review of the foundation (ops wrappers, reference, kernels, layout, loader): each test pins a
defect that was found and fixed. Kernels run through the host emulation of the real ``.cu``
(forward order and the reverse / 64-bit-index variant) and, in the ``gpu`` tier, on CuPy; the
NumPy reference must give the same bytes and status counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hcache import ops, resolve_device, resolve_dtype
from hcache.device import cupy_available
from hcache.dtypes import storage_dtype
from hcache.ops import _loader as _kernels
from hcache.ops.tables import KVGroup, SlotSet

from kernel_cases import BACKENDS, Arena, as_bytes, kernel_env

INT32_MAX = 2**31 - 1
# The reference (None) and the host-emulated kernels, both orders.
HOST = [pytest.param("reference", id="reference"), *BACKENDS]


def _env(kind):
    return (np, None) if kind == "reference" else kernel_env(kind)


def _dev(xp, a):
    return a if xp is np else xp.asarray(a)


def _i32(xp, values):
    return _dev(xp, np.asarray(values, np.int32))


# --- compaction: the plan's longest span bounds what kv_compact moves -----------------------

@pytest.mark.parametrize("kind", HOST)
@pytest.mark.parametrize("plan_lengths", ["none", "shorter", "same"])
def test_kv_compact_moves_at_most_the_plans_longest_span(kind, plan_lengths):
    # The kernel only visits offsets below the plan's max length (plan[2]); the reference used
    # to move lengths[src] tokens regardless, so a plan built without (or with other) lengths
    # gave different bytes on cpu and cuda.
    xp, backend = _env(kind)
    rng = np.random.default_rng(7)
    # Rows of 6 bytes in spans of 4 * 6 = 24: 8-byte chunks, so a limit of one token (6
    # bytes) ends inside a chunk.
    host = rng.integers(0, 256, (4, 2, 2, 4, 6), dtype=np.uint8)
    lengths = np.array([3, 4, 2, 3], np.int32)
    plan_len = {"none": None, "shorter": np.array([1, 1, 1, 1], np.int32),
                "same": lengths}[plan_lengths]
    mapping = np.array([1, 0, -1, 2], np.int32)      # swap 0 <-> 1 (a cycle), 3 -> 2
    layer = _dev(xp, host.copy())
    plan = xp.zeros(ops.compaction_plan_size(4), np.int32)
    ops.compaction_plan(_dev(xp, mapping), 4, 3, plan,
                        lengths=None if plan_len is None else _dev(xp, plan_len),
                        backend=backend)
    ops.kv_compact(KVGroup([layer]), plan, _dev(xp, lengths), backend=backend)
    # Model: new[mapping[i]] = old[i] for min(lengths[i], longest planned span) tokens.
    limit = 0 if plan_len is None else max(int(plan_len[i]) for i in (0, 1, 3))
    want = host.copy()
    for old, new in enumerate(mapping):
        if new >= 0:
            n = min(int(lengths[old]), limit)
            want[new, :, :, :n] = host[old, :, :, :n]
    np.testing.assert_array_equal(as_bytes(layer), want.reshape(-1))


@pytest.mark.parametrize("kind", HOST)
def test_compaction_wrappers_check_the_plan_against_the_tensors(kind):
    # A plan for more slots than the tensors have used to make the reference raise IndexError
    # half-way (after moving some slots) while the kernel silently skipped those moves.
    xp, backend = _env(kind)
    host = np.arange(4 * 2 * 1 * 2 * 4, dtype=np.uint8).reshape(4, 2, 1, 2, 4)
    layer = _dev(xp, host.copy())
    state = _dev(xp, np.arange(4, dtype=np.float32))
    lengths = _i32(xp, [2] * 8)
    plan = xp.zeros(ops.compaction_plan_size(8), np.int32)
    ops.compaction_plan(_i32(xp, [5, 0, 1, 2, 3, 4]), 6, 6, plan, lengths=lengths,
                        backend=backend)
    with pytest.raises(ValueError, match="plan: expected a plan for at most 4 slots"):
        ops.kv_compact(KVGroup([layer]), plan, lengths, backend=backend)
    with pytest.raises(ValueError, match="plan: expected a plan for at most 4 slots"):
        ops.slots_compact(SlotSet([(state, state)]), plan, backend=backend)
    with pytest.raises(ValueError, match="plan: expected length 4 \\+ 8 \\* max_batch"):
        ops.kv_compact(KVGroup([layer]), plan[:-1], lengths, backend=backend)
    with pytest.raises(ValueError, match="plan: expected length 4 \\+ 8 \\* max_batch"):
        ops.slots_compact(SlotSet([(state, state)]), plan[:-3], backend=backend)
    np.testing.assert_array_equal(as_bytes(layer), host.reshape(-1))
    np.testing.assert_array_equal(as_bytes(state).view(np.float32), np.arange(4))


@pytest.mark.parametrize("kind", HOST)
def test_compaction_never_reads_schedule_entries_past_the_plan(kind):
    # plan[1] (the entry count) is device data; a plan that did not come from compaction_plan
    # may claim more entries than its schedule holds. The kernels used to read them from past
    # the end of the plan buffer. Here the words after the plan hold a move 0 -> 1.
    xp, backend = _env(kind)
    size = ops.compaction_plan_size(2)          # schedule capacity: 3 * 2 = 6 (src, dst) pairs
    words = np.full(size + 16, -7, np.int32)    # -7: no slot, skipped
    words[:4] = (0, 6 + 8, 1, -1)               # valid, 14 entries, max length 1
    words[size:] = np.tile([0, 1], 8)           # past the plan: 0 -> 1
    buf = _dev(xp, words)
    plan = buf[:size]
    cache = np.zeros((2, 2, 1, 1, 4), np.uint8)
    cache[0] = 9
    layer = _dev(xp, cache.copy())
    state = _dev(xp, np.array([[1.0], [2.0]], np.float32))
    ops.kv_compact(KVGroup([layer]), plan, _i32(xp, [1, 1]), backend=backend)
    ops.slots_compact(SlotSet([(state, state)]), plan, backend=backend)
    np.testing.assert_array_equal(as_bytes(layer), cache.reshape(-1))
    np.testing.assert_array_equal(as_bytes(state).view(np.float32), [1.0, 2.0])


@st.composite
def arbitrary_plans(draw):
    mb = draw(st.integers(1, 4))
    size = ops.compaction_plan_size(mb)
    words = draw(st.lists(st.integers(-4, mb + 1), min_size=size, max_size=size))
    words[0] = 0
    words[1] = draw(st.integers(-2, 3 * mb + 4))
    words[2] = draw(st.integers(-2, 7))
    return dict(mb=mb, words=words, seed=draw(st.integers(0, 2**16)),
                lengths=draw(st.lists(st.integers(-2, 7), min_size=mb, max_size=mb)))


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=30)
@given(c=arbitrary_plans())
def test_compaction_kernels_match_the_reference_for_any_plan_contents(kind, c):
    # Whatever the (unchecked, device-side) plan says, the kernels stay inside their buffers
    # and do what the reference does: out-of-range entries are skipped.
    xp, backend = kernel_env(kind)
    out = []
    for mod, be in ((np, None), (xp, backend)):
        arena = Arena(np.random.default_rng(c["seed"]), mod)
        layer = arena.array((c["mb"], 2, 2, 5, 6), np.uint8, misalign=2)
        state = arena.array((c["mb"], 3), np.float16)
        plan = arena.array((len(c["words"]),), np.int32)
        plan[...] = _i32(mod, c["words"])
        lengths = arena.array((c["mb"],), np.int32)
        lengths[...] = _i32(mod, c["lengths"])
        ops.kv_compact(KVGroup([layer]), plan, lengths, backend=be)
        ops.slots_compact(SlotSet([(state, state)]), plan, backend=be)
        arena.check_canaries()
        out.append((as_bytes(layer), as_bytes(state)))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_array_equal(out[0][1], out[1][1])


# --- lengths_add and scalar arguments: both backends validate the same way --------------------

@pytest.mark.parametrize("kind", HOST)
@pytest.mark.parametrize("n,increment,max_len,exc", [
    (-1, 1, 10, ValueError),              # reference sliced lengths[:-1]; kernel did nothing
    (2, 2**31, 10, ValueError),           # kernel path: OverflowError; reference: refused
    (2, -(2**31) - 1, 10, ValueError),
    (2, 1, 2**31, ValueError),            # kernel path: OverflowError
    (2, 1.5, 10, TypeError),              # reference treated it as an array
    (2, True, 10, TypeError),
    (True, 1, 10, TypeError),
])
def test_lengths_add_validates_its_scalars_before_anything(kind, n, increment, max_len, exc):
    xp, backend = _env(kind)
    lengths = _i32(xp, [1, 2, 3])
    status = xp.zeros(1, np.int32)
    with pytest.raises(exc):
        ops.lengths_add(lengths, n, increment, max_len, status=status, backend=backend)
    assert as_bytes(lengths).view(np.int32).tolist() == [1, 2, 3]
    assert int(as_bytes(status).view(np.int32)[0]) == 0


@pytest.mark.parametrize("kind", HOST)
def test_scalar_arguments_outside_c_int_raise_on_every_backend(kind):
    xp, backend = _env(kind)
    cache = np.arange(2 * 2 * 1 * 4 * 8, dtype=np.uint8).reshape(2, 2, 1, 4, 8)
    layer = _dev(xp, cache.copy())
    group = KVGroup([layer])
    plan = xp.zeros(ops.compaction_plan_size(2), np.int32)
    status = xp.zeros(1, np.int32)
    with pytest.raises(ValueError, match="new_batch: expected"):
        ops.compaction_plan(_i32(xp, [0]), 1, 2**40, plan, backend=backend)
    with pytest.raises(ValueError, match="slot: expected"):
        ops.kv_prefix_copy(group, 2**40, 1, [xp.zeros((2, 1, 1, 8), np.uint8)],
                           to_cache=False, status=status, backend=backend)
    k = xp.ones((2, 1, 8), np.uint8)
    with pytest.raises(ValueError, match="uniform_tokens: expected"):
        ops.kv_write(group, k, k, layers=0, uniform_tokens=2**40, backend=backend)
    with pytest.raises(TypeError, match="batch: expected an int"):
        ops.kv_write(group, k, k, layers=0, uniform_tokens=1, batch=1.0, backend=backend)
    assert not as_bytes(plan).any() and not as_bytes(status).any()
    np.testing.assert_array_equal(as_bytes(layer), cache.reshape(-1))


@pytest.mark.parametrize("kind", HOST)
def test_index_arrays_must_be_arrays(kind):
    # A list used to reach ``a.dtype`` and fail with AttributeError.
    xp, backend = _env(kind)
    layer = xp.zeros((2, 2, 1, 4, 8), np.uint8)
    k = xp.ones((2, 1, 8), np.uint8)
    with pytest.raises(TypeError, match="seq_offsets: expected a"):
        ops.kv_write(KVGroup([layer]), k, k, layers=0, seq_offsets=[0, 2], backend=backend)
    state = xp.zeros((2, 3), np.float32)
    with pytest.raises(TypeError, match="src_idx: expected a"):
        ops.slot_copy(SlotSet([(state, state)]), [0], _i32(xp, [1]), backend=backend)


# --- KV writes -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", HOST)
def test_kv_write_block_table_without_columns_counts_every_token(kind):
    # A [batch, 0] block table: every token's block column is past the width (skipped and
    # counted). The reference used to raise IndexError on table[b, -1].
    xp, backend = _env(kind)
    layer = xp.zeros((2, 2, 1, 4, 8), np.uint8)
    k = xp.ones((3, 1, 8), np.uint8)
    status = xp.zeros(1, np.int32)
    ops.kv_write(KVGroup([layer]), k, k, layers=0, uniform_tokens=1,
                 block_table=xp.zeros((3, 0), np.int32), status=status, backend=backend)
    assert int(as_bytes(status).view(np.int32)[0]) == 3
    assert not as_bytes(layer).any()


@pytest.mark.parametrize("kind", HOST)
def test_kv_write_positions_past_int32_use_64_bit_arithmetic(kind):
    # cache_lengths[b] + (t - start) overflowed int in the kernel (undefined behaviour; on the
    # GPU it wrapped negative and the token was reported) while the reference wrote it.
    # Paged pool with block size 2**20: position 2**31 - 1 is block column 2047, offset
    # 2**20 - 1; position 2**31 is column 2048, offset 0. Both columns map to block 0.
    xp, backend = _env(kind)
    s = 2**20
    layer = xp.zeros((1, 2, 1, s, 1), np.uint8)
    k = _dev(xp, np.array([[[5]], [[6]]], np.uint8))
    v = _dev(xp, np.array([[[7]], [[8]]], np.uint8))
    status = xp.zeros(1, np.int32)
    ops.kv_write(KVGroup([layer]), k, v, layers=0, seq_offsets=_i32(xp, [0, 2]),
                 cache_lengths=_i32(xp, [INT32_MAX]), block_table=xp.zeros((1, 2049), np.int32),
                 status=status, backend=backend)
    got = as_bytes(layer).reshape(2, s)
    assert int(as_bytes(status).view(np.int32)[0]) == 0
    assert (got[0, s - 1], got[1, s - 1], got[0, 0], got[1, 0]) == (5, 7, 6, 8)
    assert int(np.count_nonzero(got)) == 4


@st.composite
def unsorted_offsets(draw):
    batch = draw(st.integers(1, 6))
    return dict(offsets=draw(st.lists(st.integers(-2, 12), min_size=batch + 1,
                                      max_size=batch + 1)),
                tokens=draw(st.integers(1, 12)),
                lengths=draw(st.lists(st.integers(0, 3), min_size=batch, max_size=batch)),
                seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=30)
@given(c=unsorted_offsets())
def test_kv_write_unsorted_seq_offsets_match_the_reference(kind, c):
    # seq_offsets are device data the wrapper cannot check; the reference used searchsorted,
    # whose answer on unsorted offsets differs from the kernel's binary search.
    xp, backend = kernel_env(kind)
    batch = len(c["lengths"])
    rng = np.random.default_rng(c["seed"])
    k = rng.integers(1, 256, (c["tokens"], 2, 4), dtype=np.uint8)
    v = rng.integers(1, 256, (c["tokens"], 2, 4), dtype=np.uint8)
    out = []
    for mod, be in ((np, None), (xp, backend)):
        arena = Arena(np.random.default_rng(c["seed"]), mod)
        layer = arena.array((batch, 2, 2, 16, 4), np.uint8, fill="zeros")
        status = arena.array((1,), np.int32, fill="zeros")
        ops.kv_write(KVGroup([layer]), _dev(mod, k), _dev(mod, v), layers=0,
                     seq_offsets=_i32(mod, c["offsets"]), cache_lengths=_i32(mod, c["lengths"]),
                     status=status, backend=be)
        arena.check_canaries()
        out.append((as_bytes(layer), int(as_bytes(status).view(np.int32)[0])))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    assert out[0][1] == out[1][1]


# --- slot copies ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", HOST)
def test_slot_copy_counts_bad_pairs_when_the_first_tensor_has_empty_slots(kind):
    # Tensor 0 counts out-of-range pairs; with 0-byte slots its kernel loop had no work items,
    # so nothing was counted while the reference counted them.
    xp, backend = _env(kind)
    empty = xp.zeros((3, 0), np.float32)
    src = _dev(xp, np.arange(6, dtype=np.float32).reshape(3, 2))
    dst = xp.zeros((3, 2), np.float32)
    status = xp.zeros(1, np.int32)
    ops.slot_copy(SlotSet([(empty, xp.zeros((3, 0), np.float32)), (src, dst)]),
                  _i32(xp, [5, 0, -1, 1]), _i32(xp, [0, 2, 1, 7]), status=status,
                  backend=backend)
    assert int(as_bytes(status).view(np.int32)[0]) == 2      # pairs (5, 0) and (1, 7)
    np.testing.assert_array_equal(as_bytes(dst).view(np.float32).reshape(3, 2),
                                  [[0, 0], [0, 0], [0, 1]])


# --- layout descriptors --------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 2, 0, 4, 8), (2, 2, 1, 0, 8), (2, 2, 1, 4, 0)])
def test_kv_group_rejects_empty_heads_tokens_or_head_dim(shape):
    # S = 0 made the paged write divide by zero (pos / S), H = 0 a zero-sized grid.x, D = 0 a
    # loop without work items that reported nothing.
    with pytest.raises(ValueError, match=r"layers\[0\]: expected at least one"):
        KVGroup([np.zeros(shape, np.float16)])


def test_descriptors_refuse_more_layers_than_grid_y_holds():
    one = np.zeros((1, 2, 1, 1, 1), np.uint8)
    with pytest.raises(ValueError, match="layers: expected at most 65535 layers"):
        KVGroup([one] * 65536)
    t = np.zeros((1, 1), np.uint8)
    with pytest.raises(ValueError, match="pairs: expected at most 65535 pairs"):
        SlotSet([(t, t)] * 65536)


# --- devices and dtypes --------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["cuda:", "cuda:\u00b2", "cuda:\u0661"])
def test_malformed_cuda_ordinals_are_refused_as_malformed(bad):
    # "cuda:" (no ordinal) and non-ASCII digits ("²" made int() fail with its own message,
    # Arabic-Indic "١" was read as device 1) are not "cuda:N".
    with pytest.raises(ValueError, match="device: expected None, 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device(bad)


def test_none_is_not_a_dtype():
    # np.dtype(None) is float64: the error said "got float64" for a missing dtype.
    with pytest.raises(TypeError, match="dtype: expected a dtype name or dtype, got NoneType"):
        resolve_dtype(None)


def test_storage_dtype_never_hides_a_device_error():
    # Without a usable GPU every CuPy allocation fails; storage_dtype used to read that as
    # "dtype unsupported" and answer uint32 for float32.
    cupy = pytest.importorskip("cupy")
    if cupy_available():
        assert storage_dtype("float32", cupy) == np.float32
    else:
        with pytest.raises(RuntimeError):
            storage_dtype("float32", cupy)


# --- loader --------------------------------------------------------------------------------

def test_kernel_source_changes_when_an_included_header_changes(monkeypatch, tmp_path):
    # CuPy keys its on-disk kernel cache by the source text and options, not by the headers
    # the source includes: the text must change with common.cuh, or an edited or upgraded
    # common.cuh would load a stale cubin.
    for p in _kernels.kernel_dir().iterdir():
        (tmp_path / p.name).write_text(p.read_text())
    monkeypatch.setattr(_kernels, "kernel_dir", lambda: tmp_path)
    before = _kernels.kernel_source("slot_copy")[1]
    header = tmp_path / "common.cuh"
    header.write_text(header.read_text() + "\n// changed\n")
    after = _kernels.kernel_source("slot_copy")[1]
    assert before != after
    assert after.startswith(f'#line 1 "{tmp_path / "slot_copy.cu"}"\n')


# --- streams (GPU) -------------------------------------------------------------------------

@pytest.mark.gpu
def test_pointer_table_is_uploaded_again_on_another_current_stream():
    # With stream=None the upload memo was keyed by None, so a call under another current
    # stream skipped the upload and its kernel read the table before the first stream had
    # written it. Stream 1 is held back behind a spin kernel while the table upload is queued
    # on it; stream 2 must not run ahead with the previous table.
    import cupy

    spin = cupy.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) { }
    }''', "spin")
    layers = [cupy.zeros((2, 2, 1, 4, 8), np.float16) for _ in range(2)]
    group = KVGroup(layers)
    old = [cupy.full((1, 1, 8), 1, np.float16) for _ in range(2)]
    new = [cupy.full((1, 1, 8), 2, np.float16) for _ in range(2)]
    offsets = cupy.array([0, 1], np.int32)
    ops.kv_write(group, old, old, seq_offsets=offsets)                 # table of `old`
    cupy.cuda.Device().synchronize()
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with s1:
        spin((1,), (1,), (np.int64(2_000_000_000),))                    # ~1 s
        ops.kv_write(group, new, new, seq_offsets=offsets)             # upload queued on s1
    with s2:
        ops.kv_write(group, new, new, seq_offsets=offsets)
    s2.synchronize()
    got = [float(layer[0, 0, 0, 0, 0].get()) for layer in layers]
    cupy.cuda.Device().synchronize()
    assert got == [2.0, 2.0]
