"""JAX on the GPU with hcache on ``cuda`` (issue 29): how a JAX engine uses hcache.

For every cache dtype: JAX device arrays (K/V rows, states, slots, length increments, block
tables and lengths) go into ``cuda`` managers without a copy and without a host wait; the caches
come out to JAX without a copy through their storage type (:mod:`hcache.interop.jax`); a write
through hcache is seen by a JAX array imported before it, in and outside ``jit``; a JAX
computation on a cache imported on hcache's stream runs after hcache's launches on it.

No host wait is shown by a *gate*: a one-thread kernel holds a stream until the host opens a
pinned flag, so the JAX inputs (and hcache's launches behind them) are still pending when the
call returns. A call that waited on the host for them would block until the gate's timer opens
it, and the test then fails on ``gate.opened_by_timer`` instead of hanging. Oracles: the host
bytes of the inputs placed by hand (cache layouts of docs/design.md), the same call with native
CuPy arrays, and ``unsafe_buffer_pointer()`` against hcache's pointers for "no copy".

Sizes are a few KB, whatever other processes hold on the GPU. Marked ``gpu``; without a GPU, or
with a JAX that has no GPU backend (no CUDA plugin), every test skips; the module imports
without either.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_jax_gpu_emulated import DTYPES, hybrid, rows  # the same scenarios' set-up

import hcache
from hcache.arrays import as_array
from hcache.continuous.manager import ContinuousBatchingKVCacheManager, KVCacheStaticParams
from hcache.device import cupy_available, data_pointer, resolve_device
from hcache.dtypes import dlpack_view
from hcache.interop.jax import as_cache_dtype, cache_dtype, storage_array

from helpers import host

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
HOLD = r"""
extern "C" __global__ void hold_until_open(const volatile int* flag) {
    while (*flag == 0) {
    }
}
"""


@pytest.fixture
def cp():
    cupy = pytest.importorskip("cupy")
    if not cupy_available():
        pytest.skip("no CUDA GPU")
    return cupy


@pytest.fixture
def gpu(cp):
    """JAX's first GPU, the device hcache's ``cuda`` is (cuda:0)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"JAX has no GPU backend (no CUDA plugin): {exc}")
    return devices[0]


class Gate:
    """Holds ``stream`` on the device until :meth:`open`: a one-thread kernel spins on a pinned
    host flag, so every later launch on ``stream`` (and whatever waits on it) stays pending while
    the host goes on. A timer opens it after ``limit`` seconds, so a host wait for held work
    ends (``opened_by_timer`` then says so) instead of hanging the test."""

    def __init__(self, cp, stream, limit: float = 20.0):
        self._memory = cp.cuda.alloc_pinned_memory(4)
        self._flag = np.frombuffer(self._memory, np.int32, 1)
        self._flag[0] = 0
        self.opened_by_timer = False
        self._stream = stream
        kernel = cp.RawKernel(HOLD, "hold_until_open")
        kernel((1,), (1,), (np.uint64(self._memory.ptr),), stream=stream)
        self._timer = threading.Timer(limit, self._time_out)
        self._timer.start()

    def _time_out(self):
        self.opened_by_timer = True
        self._flag[0] = 1

    def open(self):
        self._timer.cancel()
        self._flag[0] = 1
        self._stream.synchronize()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.open()


def held_jax(cp, values: np.ndarray, gate_stream, dtype, keep: list):
    """A JAX array of ``values`` (dtype ``dtype``) on JAX's GPU that is the output of a jitted
    JAX step whose input is written by a copy still held behind the gate on ``gate_stream``
    (JAX imports it on that stream, so the step waits for the copy on the device). The host
    bytes of ``values`` are the oracle."""
    values = np.ascontiguousarray(values)
    src = cp.asarray(values.view(UINT[values.dtype.itemsize]))
    cp.cuda.Device().synchronize()
    with gate_stream:
        pending = src.copy()                       # queued behind the gate
        imported = jax.dlpack.from_dlpack(pending)  # JAX's stream waits for gate_stream
    # XOR 0 makes a new buffer (a step returning its argument would forward it); the bitcast
    # gives the dtype hcache takes (the cache's, or its storage type where CuPy has none)
    step = jax.jit(lambda s: jax.lax.bitcast_convert_type(s ^ 0, jnp.dtype(dtype)))
    keep.append((pending, imported))
    return step(imported)


def as_bytes(a):
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_inputs_go_into_a_hybrid_manager_without_a_copy_or_a_host_wait(cp, gpu, dtype):
    """K/V rows, states, the state slots and the length increments are JAX outputs still
    pending on the device; hcache views them in place (same pointer), returns before they are
    computed, and after the gate opens the cache holds them where the layout says."""
    m = hybrid(dtype)
    cache, state = m.get_combined_kv_cache(0), m.get_recurrent_state(1)
    row_dtype = np.dtype(cache.dtype)   # the cache dtype, or its storage type on this CuPy
    rng = np.random.default_rng(0)
    k, v = rows(row_dtype, (2, 3, 2, 16), rng), rows(row_dtype, (2, 3, 2, 16), rng)
    rec = rows(state.dtype, (1,) + state.shape[1:], rng)
    stream, gate_stream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    m.reset_for_new_sequences([0, 0], stream=stream)
    keep = []
    with Gate(cp, gate_stream) as gate:
        kj = held_jax(cp, k, gate_stream, row_dtype, keep)
        vj = held_jax(cp, v, gate_stream, row_dtype, keep)
        recj = held_jax(cp, rec, gate_stream, state.dtype, keep)
        slots = held_jax(cp, np.array([1], np.int32), gate_stream, np.int32, keep)
        increments = held_jax(cp, np.array([3, 2], np.int32), gate_stream, np.int32, keep)
        view = as_array("k", kj, resolve_device("cuda"), stream)
        assert data_pointer(view) == kj.unsafe_buffer_pointer(), "k was copied"
        m.write_kv(0, kj, vj, stream=stream)
        m.write_states(1, recj, slots=slots, stream=stream)
        m.commit_sequence_length(increments, stream=stream)
        assert not gate.opened_by_timer, "hcache waited on the host for a pending JAX array"
    stream.synchronize()
    assert not gate.opened_by_timer, "hcache waited on the host for a pending JAX array"
    got = host(cache)
    assert np.array_equal(as_bytes(got[:, 0, :, :3].transpose(0, 2, 1, 3)), as_bytes(k))
    assert np.array_equal(as_bytes(got[:, 1, :, :3].transpose(0, 2, 1, 3)), as_bytes(v))
    assert not as_bytes(got[:, :, :, 3:]).any()
    assert np.array_equal(as_bytes(host(state)[1:]), as_bytes(rec))
    assert not as_bytes(host(state)[0]).any()
    assert host(m.get_kv_cache_lengths()).tolist() == [3, 2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_cache_imported_before_a_write_sees_it_in_and_outside_jit(cp, gpu, dtype):
    """The storage array is the cache's memory (same pointer, on JAX's GPU); a write by hcache
    after the import is read by a jitted step taking it as an argument and outside ``jit``."""
    m = hybrid(dtype)
    cache = m.get_combined_kv_cache(0)
    storage = storage_array(cache)
    assert storage.unsafe_buffer_pointer() == data_pointer(cache)
    assert storage.devices() == {gpu}
    assert storage.dtype == np.dtype(dlpack_view(cache).dtype)

    @jax.jit
    def read(s):
        return as_cache_dtype(s, dtype)

    rng = np.random.default_rng(1)
    k = rows(cache.dtype, (2, 3, 2, 16), rng)
    stream = cp.cuda.Stream(non_blocking=True)
    m.reset_for_new_sequences([0, 0], stream=stream)
    with stream:
        m.write_kv(0, cp.asarray(k.view(UINT[k.itemsize])).view(cache.dtype),
                   cp.asarray(k.view(UINT[k.itemsize])).view(cache.dtype), stream=stream)
    stream.synchronize()     # the subject is the shared memory, not the ordering (next test)
    got = read(storage)
    assert got.dtype == cache_dtype(dtype)
    assert np.array_equal(as_bytes(got), as_bytes(host(cache)))
    assert np.array_equal(as_bytes(as_cache_dtype(storage, dtype)), as_bytes(host(cache)))
    assert np.array_equal(as_bytes(np.asarray(got)[:, 0, :, :3].transpose(0, 2, 1, 3)),
                          as_bytes(k))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_jax_step_on_a_cache_imported_on_hcaches_stream_runs_after_its_launches(cp, gpu,
                                                                                  dtype):
    """hcache's write is queued on its stream behind the gate; the cache imported on that
    stream (DLPack: JAX's stream waits for it on the device) is read by a jitted step that is
    dispatched while the write is still held; no host wait anywhere, and the step reads the
    written rows, not the zeros before them."""
    m = hybrid(dtype)
    cache = m.get_combined_kv_cache(0)
    row_dtype = np.dtype(cache.dtype)
    rng = np.random.default_rng(2)
    k = rows(row_dtype, (2, 1, 2, 16), rng)
    src = cp.asarray(k.view(UINT[k.itemsize])).view(row_dtype)
    m.reset_for_new_sequences([0, 0])
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    first = jax.jit(lambda s: as_cache_dtype(s, dtype)[:, :, :, 0])   # [B, 2, H, D]
    with Gate(cp, stream) as gate:
        m.write_kv(0, src, src, stream=stream)            # held behind the gate
        m.commit_sequence_length(1, stream=stream)
        with stream:
            storage = storage_array(cache)                # ordered after hcache's launches
            lengths = storage_array(m.get_kv_cache_lengths())
        out, seen = first(storage), jax.jit(lambda x: x + 0)(lengths)
        assert not gate.opened_by_timer, "the import or the dispatch waited on the host"
    want = np.stack([k[:, 0], k[:, 0]], axis=1)   # token 0 of K and V: [B, 2, H, D]
    assert as_bytes(want).any() and np.array_equal(as_bytes(out), as_bytes(want))
    assert np.asarray(seen).tolist() == [1, 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_continuous_batching_takes_jax_rows_and_its_tables_go_out_to_jax(cp, gpu, dtype):
    """A continuous batch written from pending JAX rows (no host wait); its lookup table and
    lengths (device int arrays) and ``blocks_buf`` imported by JAX on the batch's stream, no
    copy; JAX's reads place every row where the table says."""
    m = ContinuousBatchingKVCacheManager(dtype, KVCacheStaticParams(2, 16), 2, 8, 1,
                                         device="cuda")
    row_dtype = np.dtype(m.blocks_buf.dtype)
    rng = np.random.default_rng(3)
    k, v = rows(row_dtype, (2, 2, 2, 16), rng), rows(row_dtype, (2, 2, 2, 16), rng)
    stream = cp.cuda.Stream(non_blocking=True)
    ids = m.claim(2)[::-1]
    batch = m.fetch(ids, stream=stream)
    gate_stream = cp.cuda.Stream(non_blocking=True)
    keep = []
    with Gate(cp, gate_stream) as gate:
        kj = held_jax(cp, k, gate_stream, row_dtype, keep)
        vj = held_jax(cp, v, gate_stream, row_dtype, keep)
        batch.write_kv(0, kj, vj, stream=stream)
        assert not gate.opened_by_timer, "hcache waited on the host for a pending JAX array"
    with stream:
        blocks = storage_array(m.blocks_buf)
        table = storage_array(batch.lookup_table)
        lengths = storage_array(batch.cache_lengths)
    assert blocks.unsafe_buffer_pointer() == data_pointer(m.blocks_buf)
    assert table.unsafe_buffer_pointer() == data_pointer(batch.lookup_table)
    gathered = jax.jit(lambda b, t: b[t][:, :, 0, :2])(blocks, table)   # [2, 2, 2, H, D]
    assert np.asarray(lengths).tolist() == [0, 0]
    assert np.array_equal(as_bytes(np.asarray(gathered)[:, 0]), as_bytes(k))
    assert np.array_equal(as_bytes(np.asarray(gathered)[:, 1]), as_bytes(v))
    m.step([2, 1], batch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_paged_pool_takes_a_jax_block_table_and_lengths(cp, gpu, dtype):
    """``PagedKVPool.write_kv`` with JAX rows, block table and cache lengths still pending
    leaves the bytes the same call with native CuPy arrays leaves, with no host wait."""
    pools = [hcache.PagedKVPool([hcache.KVLayerConfig(2, 8)], 4, 2, dtype, device="cuda")
             for _ in range(2)]
    row_dtype = np.dtype(pools[0].layers[0].dtype)
    rng = np.random.default_rng(4)
    k, v = rows(row_dtype, (3, 2, 8), rng), rows(row_dtype, (3, 2, 8), rng)
    table, lengths = np.array([[2, 0]], np.int32), np.array([1], np.int32)

    def native(a):
        return cp.asarray(a.view(UINT[a.itemsize])).view(a.dtype)

    pools[0].write_kv(native(k), native(v), block_table=native(table), layer=0,
                      uniform_tokens=3, batch=1, cache_lengths=native(lengths))
    cp.cuda.Device().synchronize()
    stream, gate_stream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    keep = []
    with Gate(cp, gate_stream) as gate:
        held = [held_jax(cp, a, gate_stream, a.dtype, keep) for a in (k, v, table, lengths)]
        pools[1].write_kv(held[0], held[1], block_table=held[2], layer=0, uniform_tokens=3,
                          batch=1, cache_lengths=held[3], stream=stream)
        assert not gate.opened_by_timer, "hcache waited on the host for a pending JAX array"
    stream.synchronize()
    want, got = as_bytes(host(pools[0].layers[0])), as_bytes(host(pools[1].layers[0]))
    assert want.any() and np.array_equal(want, got)
