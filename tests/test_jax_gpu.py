"""JAX on the GPU with hcache on ``cuda`` (issue 29): how a JAX engine uses hcache.

For every cache dtype: JAX device arrays (K/V rows, states, slots, length increments, block
tables and lengths) go into ``cuda`` managers without a copy and without a host wait; the caches
come out to JAX without a copy through their storage type (:mod:`hcache.interop.jax`); a write
through hcache is seen by a JAX array imported before it, in and outside ``jit``; a JAX
computation on a cache imported on hcache's stream runs after hcache's launches on it.

No host wait is shown with work still running on the device: JAX inputs are outputs of a jitted
step that waits (on JAX's stream) for a slow JAX computation (:class:`Pending`, a chain of large
float32 matrix products, a few hundred ms), so they are pending when hcache takes them; hcache's
call must return while that computation still runs. The other direction, a JAX step on a cache
that hcache's queued launches write, holds hcache's stream with a *gate*: a one-thread kernel
that spins until the host opens a pinned flag (a timer opens it after a few seconds, so a host
wait ends instead of hanging and the test says so). What JAX itself does with DLPack is probed
in the same process (:func:`jax_export_waits`, :func:`jax_import_waits`): where JAX's own export
or import waits on the host, hcache cannot avoid that wait and the no-wait assertion is skipped
with that reason; the bytes are checked either way. Oracles: the host bytes of the inputs placed
by hand (cache layouts of docs/design.md), the same call with native CuPy arrays, and
``unsafe_buffer_pointer()`` against hcache's pointers for "no copy".

Sizes are a few KB, whatever other processes hold on the GPU. Marked ``gpu``; without a GPU, or
with a JAX that has no GPU backend (no CUDA plugin), every test skips; the module imports
without either.
"""

from __future__ import annotations

import functools
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

    def __init__(self, cp, stream, limit: float = 5.0):
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


HEAVY_N, HEAVY_CHAIN = 8192, 32   # float32 products at full precision: ~0.6 s on an H200


@functools.cache
def _heavy():
    @jax.jit
    def flag(eye):
        m = eye
        for _ in range(HEAVY_CHAIN):
            m = jnp.matmul(m, eye, precision=jax.lax.Precision.HIGHEST)
        return (m[0, 0] > 2.0).astype(jnp.uint32)   # 0 at run time: eye is the identity
    eye = jnp.eye(HEAVY_N, dtype=jnp.float32)
    flag(eye).block_until_ready()                    # compiled before any timing matters
    return flag, eye


@functools.cache
def _mix(dtype):
    """``s ^ g`` (``g``: 0, the slow step's output) seen as ``dtype``: a new buffer that JAX
    computes only after the slow step."""
    return jax.jit(lambda s, g: jax.lax.bitcast_convert_type(s ^ g.astype(s.dtype),
                                                             jnp.dtype(dtype)))


class Pending:
    """JAX arrays still being computed: ``arrays[i]`` is ``inputs[i] = (values, dtype)`` as the
    output of a jitted step that JAX runs after a slow computation dispatched last in the
    constructor (every step compiled and every input uploaded before it); :attr:`running` says
    whether that computation still runs (asked without a host wait). ``slow=False``: the same
    arrays with nothing to wait for (a rehearsal that compiles whatever the call compiles on its
    first use, so the timed run measures the call alone)."""

    def __init__(self, inputs, slow: bool = True):
        flag, eye = _heavy()
        zero = jnp.zeros((), jnp.uint32)
        sources = []
        for values, dtype in inputs:
            values = np.ascontiguousarray(values)
            src = jnp.asarray(values.view(UINT[values.dtype.itemsize]))
            _mix(np.dtype(dtype))(src, zero).block_until_ready()   # compiled now
            sources.append((src, np.dtype(dtype)))
        self.flag = flag(eye) if slow else zero
        self.arrays = [_mix(dtype)(src, self.flag) for src, dtype in sources]
        self._sources = sources

    @property
    def running(self) -> bool:
        return not self.flag.is_ready()

    def wait(self):
        self.flag.block_until_ready()


@functools.cache
def jax_export_waits() -> bool:
    """Whether a plain ``cupy.from_dlpack`` of a pending JAX array (JAX's ``__dlpack__`` with
    a consumer stream) waits on the host for it, in this JAX: hcache adopts JAX arrays so."""
    import cupy

    pending = Pending([(np.zeros(64, np.uint8), np.uint8)])
    x, = pending.arrays
    assert pending.running, "precondition: the slow JAX step still runs"
    with cupy.cuda.Stream(non_blocking=True):
        cupy.from_dlpack(x)
    waited = not pending.running
    pending.wait()
    return waited


@functools.cache
def jax_import_waits() -> bool:
    """Whether ``jax.dlpack.from_dlpack`` of a CuPy array whose producer stream is held waits
    on the host, in this JAX (then no import of a cache with pending writes can avoid it)."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    src = cupy.zeros(64, np.uint8)
    cupy.cuda.Device().synchronize()
    with Gate(cupy, stream) as gate:
        with stream:
            pending = src + 1
            jax.dlpack.from_dlpack(pending)
        waited = gate.opened_by_timer
    return waited


def check_no_wait(returned_while_running: bool, what: str):
    """Fail when hcache's call waited on the host and JAX's own export does not."""
    if returned_while_running:
        return
    if jax_export_waits():
        pytest.skip(f"this JAX ({jax.__version__}) waits on the host in its own DLPack export "
                    f"of a pending array: {what} cannot avoid the wait (bytes checked)")
    pytest.fail(f"{what} waited on the host for a pending JAX array")


def as_bytes(a):
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_inputs_go_into_a_hybrid_manager_without_a_copy_or_a_host_wait(cp, gpu, dtype):
    """K/V rows, states, the state slots and the length increments are JAX outputs still
    pending on the device; hcache views them in place (same pointer), returns before they are
    computed, and once JAX has computed them the cache holds them where the layout says."""
    m = hybrid(dtype)
    cache, state = m.get_combined_kv_cache(0), m.get_recurrent_state(1)
    row_dtype = np.dtype(cache.dtype)   # the cache dtype, or its storage type on this CuPy
    rng = np.random.default_rng(0)
    k, v = rows(row_dtype, (2, 3, 2, 16), rng), rows(row_dtype, (2, 3, 2, 16), rng)
    rec = rows(state.dtype, (1,) + state.shape[1:], rng)
    stream = cp.cuda.Stream(non_blocking=True)
    m.reset_for_new_sequences([0, 0], stream=stream)
    specs = [(k, row_dtype), (v, row_dtype), (rec, state.dtype),
             (np.array([1], np.int32), np.int32), (np.array([3, 2], np.int32), np.int32)]

    def call(kj, vj, recj, slots, increments):
        m.write_kv(0, kj, vj, stream=stream)
        m.write_states(1, recj, slots=slots, stream=stream)
        m.commit_sequence_length(increments, stream=stream)

    call(*Pending(specs, slow=False).arrays)       # rehearsal: the same bytes, then reset
    m.reset_for_new_sequences([0, 0], stream=stream)
    pending = Pending(specs)
    kj = pending.arrays[0]
    assert pending.running, "precondition: the slow JAX step still runs"
    view = as_array("k", kj, resolve_device("cuda"), stream)
    assert data_pointer(view) == kj.unsafe_buffer_pointer(), "k was copied"
    call(*pending.arrays)
    returned_while_running = pending.running
    pending.wait()
    stream.synchronize()
    got = host(cache)
    assert np.array_equal(as_bytes(got[:, 0, :, :3].transpose(0, 2, 1, 3)), as_bytes(k))
    assert np.array_equal(as_bytes(got[:, 1, :, :3].transpose(0, 2, 1, 3)), as_bytes(v))
    assert not as_bytes(got[:, :, :, 3:]).any()
    assert np.array_equal(as_bytes(host(state)[1:]), as_bytes(rec))
    assert not as_bytes(host(state)[0]).any()
    assert host(m.get_kv_cache_lengths()).tolist() == [3, 2]
    check_no_wait(returned_while_running, "the hybrid manager's write_kv / write_states / commit")


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
    add0 = jax.jit(lambda x: x + 0)
    first(storage_array(cache)).block_until_ready()        # compiled outside the gate's window
    add0(storage_array(m.get_kv_cache_lengths())).block_until_ready()
    with Gate(cp, stream) as gate:
        m.write_kv(0, src, src, stream=stream)            # held behind the gate
        m.commit_sequence_length(1, stream=stream)
        with stream:
            storage = storage_array(cache)                # ordered after hcache's launches
            lengths = storage_array(m.get_kv_cache_lengths())
        out, seen = first(storage), add0(lengths)
        waited = gate.opened_by_timer
    want = np.stack([k[:, 0], k[:, 0]], axis=1)   # token 0 of K and V: [B, 2, H, D]
    assert as_bytes(want).any() and np.array_equal(as_bytes(out), as_bytes(want))
    assert np.asarray(seen).tolist() == [1, 1]
    if waited and jax_import_waits():
        pytest.skip(f"this JAX ({jax.__version__}) waits on the host when it imports an array "
                    "with pending writes (bytes checked)")
    assert not waited, "the import or the dispatch waited on the host"


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
    batch.write_kv(0, *Pending([(k, row_dtype), (v, row_dtype)], slow=False).arrays,
                   stream=stream)                 # rehearsal: the same bytes at the same rows
    pending = Pending([(k, row_dtype), (v, row_dtype)])
    kj, vj = pending.arrays
    assert pending.running, "precondition: the slow JAX step still runs"
    batch.write_kv(0, kj, vj, stream=stream)
    returned_while_running = pending.running
    pending.wait()
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
    check_no_wait(returned_while_running, "the continuous batch's write_kv")


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
    stream = cp.cuda.Stream(non_blocking=True)
    specs = [(a, a.dtype) for a in (k, v, table, lengths)]

    def call(k_, v_, table_, lengths_):
        pools[1].write_kv(k_, v_, block_table=table_, layer=0, uniform_tokens=3, batch=1,
                          cache_lengths=lengths_, stream=stream)

    call(*Pending(specs, slow=False).arrays)       # rehearsal: the same bytes
    pending = Pending(specs)
    assert pending.running, "precondition: the slow JAX step still runs"
    call(*pending.arrays)
    returned_while_running = pending.running
    pending.wait()
    stream.synchronize()
    want, got = as_bytes(host(pools[0].layers[0])), as_bytes(host(pools[1].layers[0]))
    assert want.any() and np.array_equal(want, got)
    check_no_wait(returned_while_running, "the paged pool's write_kv")
