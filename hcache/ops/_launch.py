"""Launch plumbing shared by the wrappers: launchers, C-typed scalars, grids, validation.

The rule every wrapper follows: op parameters first (those of its NumPy reference, same names),
then the launch-only keywords ``stream=None, backend=None`` at the end.
"""

from __future__ import annotations

import contextlib
import weakref

import numpy as np

from .._checks import int32_array
from ..runtime import _cuda
from ..runtime.device import Device, array_device, data_pointer, launch_scope, stream_handle, upload
from . import _loader
from .tables import PLAN_HEADER, compaction_plan_size, plan_max_batch

BLOCK = 256          # threads per block for every kernel
WARP = 32            # the kernels that give a warp to a row or token (kv_write)
WARPS_IN_FLIGHT = 2048   # per launched layer of a KV write: 16 per SM of an H100 / H200
MAX_GRID_X = 8192    # grid-stride loops cover the rest
MAX_GRID_Z = 64


class CupyLauncher:
    """Launches through the device runtime on ``device`` (the CUDA ordinal of the op's arrays;
    ``None``: the current device) and ``stream`` (a stream of that device)."""

    __slots__ = ("stream", "device")

    def __init__(self, stream=None, device: int | None = None):
        self.stream = stream
        self.device = device

    def launch(self, family, name, grid, block, args):
        rt = _cuda.runtime()
        index = rt.current_device() if self.device is None else self.device
        kernel = _kernels.get((family, name, index, rt.cache_key))
        if kernel is None:
            kernel = _kernels[family, name, index, rt.cache_key] = \
                _loader.get_function(family, name, index)
        with launch_scope(cuda_device(index), self.stream):
            rt.launch(kernel, grid, block, args)


_kernels: dict = {}   # (family, name, device, kind of runtime) -> kernel, as _loader caches it
_cuda_devices: dict = {}


def cuda_device(index: int) -> Device:
    """The :class:`Device` of CUDA ordinal ``index`` (made once)."""
    device = _cuda_devices.get(index)
    if device is None:
        device = _cuda_devices[index] = Device("cuda", index)
    return device


class LaunchMemo:
    """The last checked launch of one op for each first argument (docs/design.md §8 "Plan
    once, launch cheaply"): an op whose arguments are the very same objects with the same
    shapes (plain ints equal), on the same stream, as a launch it checked before launches
    again at once with the arguments it converted then.

    Entries hold the objects of their key (an identity is never reused while its entry
    lives) and their first argument weakly (a dead one's entry is never used again).
    """

    __slots__ = ("_entries",)

    def __init__(self):
        self._entries: dict = {}

    @staticmethod
    def key(args) -> list:
        """Plain ints by value; anything else by identity and shape."""
        return [("v", x) if type(x) is int else ("id", id(x), getattr(x, "shape", None))
                for x in args]

    def launch(self, args, stream) -> bool:
        """Launch as last time when ``args`` (the op's arguments, first the one the entry is
        kept for, ``stream`` among them) are last time's; False (nothing done) otherwise."""
        entry = self._entries.get(id(args[0]))
        if entry is None or entry[0]() is not args[0] or entry[1] != self.key(args):
            return False
        with launch_scope(entry[2], stream):
            _cuda.runtime().launch(*entry[3])
        return True

    def run(self, run, args, family, name, grid, block, kernel_args) -> None:
        """``run.launch(family, name, grid, block, kernel_args)``, remembered for ``args``
        when it went to the device."""
        run.launch(family, name, grid, block, kernel_args)
        if not isinstance(run, CupyLauncher) or run.device is None:
            return
        try:
            ref = weakref.ref(args[0])
        except TypeError:   # no weak references to this type: nothing remembered
            return
        if len(self._entries) > 64:
            self._entries.clear()
        kernel = _loader.get_function(family, name, run.device)
        self._entries[id(args[0])] = (ref, self.key(args), cuda_device(run.device),
                                      (kernel, grid, block, kernel_args), args)


def launcher(xp, backend, stream, like=None):
    """The launcher of an op: ``backend`` if given, the host backend (NumPy arrays), else a
    :class:`CupyLauncher` on the device of ``like`` (one of the op's device arrays), so an op
    runs where its arrays live whatever device is current."""
    if backend is not None:
        return backend
    if xp is np:
        return _host_backend  # None: the NumPy reference
    return CupyLauncher(stream, None if like is None else array_device(like))


_host_backend = None


def host_runs_reference() -> bool:
    """Whether an op on NumPy arrays runs the NumPy reference (no :func:`host_backend` set):
    a manager may then do a copy's NumPy work itself."""
    return _host_backend is None


@contextlib.contextmanager
def host_backend(backend):
    """Run every op on NumPy arrays through ``backend`` instead of the NumPy reference.

    For tests: with the host emulation of ``kernels/*.cu`` as ``backend``, the managers run
    the real kernels on the CPU. Not thread-safe (it sets a module-level default).
    """
    global _host_backend
    previous, _host_backend = _host_backend, backend
    try:
        yield backend
    finally:
        _host_backend = previous


def ptr(a) -> np.uint64:
    return np.uint64(0 if a is None else data_pointer(a))


def i32(x) -> np.int32:
    return np.int32(int(x))


def i64(x) -> np.int64:
    return np.int64(int(x))


def f32(x) -> np.float32:
    return np.float32(x)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def grid_x(work_items: int) -> int:
    """Blocks along x for ``work_items`` thread-sized items (grid-stride beyond the cap)."""
    return max(1, min(MAX_GRID_X, ceil_div(work_items, BLOCK)))


def warps_per_token(num_tokens: int, rows: int, row_bytes: int) -> int:
    """Warps sharing one token's ``rows`` rows of ``row_bytes`` in the KV writes: one for many
    tokens (prefill), up to one per group of rows a warp covers in one pass when tokens are few
    (decode), so that about :data:`WARPS_IN_FLIGHT` warps move a layer's bytes."""
    chunks = max(1, row_bytes // 16)                 # 16-byte vectors per row (when aligned)
    lanes_per_row = 1 << min(5, (chunks - 1).bit_length())
    passes = ceil_div(rows, WARP // lanes_per_row)   # row groups one warp walks
    return max(1, min(passes, ceil_div(WARPS_IN_FLIGHT, max(num_tokens, 1))))


def grid_z(span_bytes: int) -> int:
    """Blocks along z splitting one (layer, kv, head) span of ``span_bytes`` bytes."""
    return max(1, min(MAX_GRID_Z, ceil_div(span_bytes, 16 * BLOCK * 4)))


def check_plan(plan, xp, num_slots: int | None = None) -> int:
    """Validate a compaction plan (for tensors of ``num_slots`` slots, if given); return its
    max_batch.

    The plan's contents are device data (unchecked); its size says which slots its schedule
    may name, so a plan for more slots than the tensors have is refused here.
    """
    int32_array("plan", plan, xp, min_len=PLAN_HEADER)
    max_batch = plan_max_batch(plan)
    if plan.shape[0] != compaction_plan_size(max_batch):
        raise ValueError(f"plan: expected length 4 + 8 * max_batch, got {plan.shape[0]}")
    if num_slots is not None and max_batch > num_slots:
        raise ValueError(f"plan: expected a plan for at most {num_slots} slots, "
                         f"got one for {max_batch}")
    return max_batch


def check_status(status, xp):
    if status is not None:
        int32_array("status", status, xp, min_len=1)


def upload_table(run, group, host: np.ndarray):
    """Put a per-call pointer table into the group's preallocated scratch, stream-ordered.

    Skipped when the table equals the last one uploaded on the same stream (an engine that
    reuses its K/V buffers pays for the upload once); another stream uploads again, since it
    is not ordered after the first upload. ``stream=None`` is keyed by the current stream's
    handle, not by ``None``. During stream capture the upload is always made (from a pinned slot
    the graph keeps), and from then on never skipped: a replay rewrites the scratch with its own
    table, so the last eager upload no longer says what the scratch holds. The table is one per
    group: calls on two streams that may run concurrently must be ordered (the managers order
    their own calls, see :class:`hcache.device.StreamOrder`)."""
    stream = getattr(run, "stream", None)
    key = stream_handle(stream)  # None: the current stream's handle
    scratch = group.scratch_infos
    flat = host.reshape(-1)   # the scratch is flat: tables of 2- or 3-word records
    if isinstance(scratch, np.ndarray):
        upload(scratch, flat)
        return
    with launch_scope(Device("cuda", array_device(scratch)), stream):
        if _cuda.runtime().is_capturing():
            group.scratch_captured = True
        else:
            last = group.scratch_host
            if not group.scratch_captured and last is not None and last[0] == key \
                    and np.array_equal(last[1], host):
                return
        upload(scratch, flat)
    group.scratch_host = None if group.scratch_captured else (key, host)
