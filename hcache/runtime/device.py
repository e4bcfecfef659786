"""Device selection, array modules and stream normalisation (docs/design.md §2).

``device=None`` means ``$HCACHE_DEVICE`` if set, else ``"cuda"`` when CuPy is importable and a
GPU is present, else ``"cpu"``. On ``cpu`` arrays are NumPy arrays and the NumPy reference does
the work; on ``cuda[:N]`` arrays are CuPy arrays and the kernels of ``kernels/`` do it.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from collections.abc import Mapping, Set
from dataclasses import dataclass, field

import numpy as np

from . import _cuda
from .staging import StagingRing

__all__ = ["Device", "resolve_device", "cupy_available", "stream_handle", "stream_scope",
           "launch_scope", "upload", "upload_ints", "to_host", "array_module_of", "data_pointer",
           "ALIGNMENT", "zeros", "cuda_free_bytes"]


def _runtime():
    return _cuda.runtime()


def cupy_available() -> bool:
    """True when a device runtime is usable: CuPy imports and ``cupy.cuda.is_available()`` (a
    driver and a GPU) holds, or the test suite's emulated device is installed."""
    rt = _runtime()
    return rt is not None and rt.usable()


@dataclass(frozen=True)
class Device:
    """A resolved device: ``kind`` is ``"cpu"`` or ``"cuda"``; ``index`` is the CUDA ordinal."""

    kind: str
    index: int = 0
    is_cuda: bool = field(init=False, repr=False, compare=False)   # kind == "cuda"

    def __post_init__(self):
        if self.kind not in ("cpu", "cuda"):
            raise ValueError(f"kind: expected 'cpu' or 'cuda', got {self.kind!r}")
        if isinstance(self.index, bool) or not isinstance(self.index, (int, np.integer)):
            raise TypeError(f"index: expected an int, got {type(self.index).__name__}")
        if not 0 <= self.index < 2**31 or (self.kind == "cpu" and self.index):
            raise ValueError(f"index: expected a CUDA ordinal >= 0 (0 on cpu), "
                             f"got {self.index}")
        object.__setattr__(self, "index", int(self.index))
        # read on every call of every method: an attribute, not a property
        object.__setattr__(self, "is_cuda", self.kind == "cuda")

    @property
    def xp(self):
        """The array module: ``numpy`` on cpu, the runtime's (``cupy``) on cuda."""
        return _runtime().xp if self.is_cuda else np

    def scope(self):
        """A context manager that makes this device current (a no-op on cpu)."""
        if self.is_cuda:
            return _runtime().device_scope(self.index)
        return contextlib.nullcontext()

    def __str__(self) -> str:
        return f"cuda:{self.index}" if self.is_cuda else "cpu"


def resolve_device(device=None) -> Device:
    """Resolve ``None | "cpu" | "cuda" | "cuda:N" | Device`` to a :class:`Device`.

    Raises
    ------
    TypeError
        ``device`` is not a string, ``None`` or a :class:`Device`.
    ValueError
        The string is malformed, or names ``cuda`` when no GPU is usable, or an ordinal that
        does not exist.
    """
    if isinstance(device, Device):
        return device
    if device is None:
        device = os.environ.get("HCACHE_DEVICE") or ("cuda" if cupy_available() else "cpu")
    if not isinstance(device, str):
        raise TypeError(f"device: expected None, 'cpu', 'cuda' or 'cuda:N', "
                        f"got {type(device).__name__}")
    text = device.strip().lower()
    if text == "cpu":
        return Device("cpu")
    kind, colon, ordinal = text.partition(":")
    if kind != "cuda" or (colon and not (ordinal.isascii() and ordinal.isdigit())):
        raise ValueError(f"device: expected None, 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if not cupy_available():
        raise ValueError(f"device: expected a usable CUDA device for {device!r}, "
                         "got none (CuPy missing or no GPU/driver); use device='cpu'")
    index = int(ordinal) if ordinal else _runtime().current_device()
    count = _runtime().device_count()
    if index >= count:
        raise ValueError(f"device: expected an ordinal below {count}, got {index}")
    return Device("cuda", index)


def array_module_of(array):
    """``numpy`` or the runtime's array module (``cupy``), by the array's type (anything not a
    device array is treated as NumPy)."""
    rt = _runtime()
    if rt is not None and not isinstance(array, np.ndarray) and rt.is_array(array):
        return rt.xp
    return np


def data_pointer(array) -> int:
    """The address of an array's first element (host address for NumPy, device for CuPy)."""
    if isinstance(array, np.ndarray):
        return int(array.ctypes.data)
    return _runtime().pointer(array)


def array_device(array) -> int | None:
    """The CUDA ordinal that owns a device array's memory; ``None`` for a host array."""
    if isinstance(array, np.ndarray):
        return None
    rt = _runtime()
    return rt.array_device(array) if rt is not None and rt.is_array(array) else None


def adopt(obj):
    """``obj`` as a device array of the runtime, with **no** synchronization: a device array as
    it is; an object with ``__cuda_array_interface__`` viewed in place (``cupy.asarray`` would
    synchronize the host with the stream the interface names). Order the producer's stream
    with :func:`wait_for_producer` inside the call's launch scope."""
    rt = _runtime()
    if rt.is_array(obj):
        return obj
    return rt.adopt(obj)


_producer_events = weakref.WeakKeyDictionary()   # runtime -> {device: the producers' event}
_producer_lock = threading.Lock()


def wait_for_producer(obj, device: Device) -> None:
    """Inside a launch scope on ``device``: the current stream waits (on the device, no host
    wait) for the stream that ``obj.__cuda_array_interface__`` names as its producer (``1`` is
    the legacy default stream; absent or ``None``: nothing to order). During capture nothing is
    waited for: the caller orders the producer before capturing (a capture cannot wait for
    work outside it)."""
    if not device.is_cuda or _runtime().is_array(obj):   # our own arrays: stream-ordered
        return
    iface = getattr(obj, "__cuda_array_interface__", None)
    stream = iface.get("stream") if isinstance(iface, dict) else None
    if stream:
        wait_for_stream(_runtime(), stream, device.index)


def wait_for_stream(rt, stream: int, index: int) -> None:
    """:func:`wait_for_producer` of a ``__cuda_array_interface__`` ``stream`` entry (not 0 or
    None) on device ``index``, which is current."""
    handle = 0 if stream in (1, 2) else int(stream)
    if rt.is_capturing() or handle == rt.current_stream():
        return
    with _producer_lock:
        per_device = _producer_events.setdefault(rt, {})
        event = per_device.get(index)
        if event is None:
            event = per_device[index] = rt.event()
        with rt.stream_scope(handle, handle, index):
            rt.record(event)
        rt.wait(event)


def check_device(name: str, array, device: Device) -> None:
    """Refuse a device array that lives on another device than ``device`` (kernels launched on
    ``device`` cannot address it).

    Raises
    ------
    ValueError
        ``array`` is a device array of another ordinal.
    """
    index = array_device(array) if device.is_cuda else None
    if index is not None and index != device.index:
        raise ValueError(f"{name}: expected an array on {device}, got one on cuda:{index}")


def stream_handle(stream) -> int:
    """Normalise a stream argument to a raw ``cudaStream_t`` handle (an ``int``).

    Accepted: ``None`` (the current CuPy stream), a ``cupy.cuda.Stream`` (or ``ExternalStream``),
    a raw handle as ``int``, or any object implementing ``__cuda_stream__`` (which returns
    ``(version, handle)``).

    Raises
    ------
    TypeError
        ``stream`` is none of these.
    ValueError
        An ``int`` handle is negative or does not fit a 64-bit ``cudaStream_t``.
    """
    if stream is None:
        rt = _cuda.runtime()
        return rt.current_stream() if rt is not None and rt.usable() else 0
    if isinstance(stream, bool):
        raise TypeError("stream: expected None, a CuPy stream, an int handle or an object with "
                        "__cuda_stream__, got bool")
    if isinstance(stream, (int, np.integer)):
        if not 0 <= int(stream) < 2**64:
            raise ValueError(f"stream: expected a cudaStream_t handle in [0, 2**64), "
                             f"got {int(stream)}")
        return int(stream)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        if isinstance(value, tuple) and len(value) == 2:
            return int(value[1])
        raise TypeError("stream: expected __cuda_stream__ to give (version, handle), "
                        f"got {value!r}")
    ptr = getattr(stream, "ptr", None)
    if isinstance(ptr, (int, np.integer)):
        return int(ptr)
    raise TypeError("stream: expected None, a CuPy stream, an int handle or an object with "
                    f"__cuda_stream__, got {type(stream).__name__}")


def stream_scope(stream, device: Device):
    """Context manager that makes ``stream`` current for device work on ``device`` (which must
    be current already: see :func:`launch_scope`). On cpu the stream is validated and otherwise
    ignored."""
    handle = stream_handle(stream)
    if not device.is_cuda:
        return contextlib.nullcontext()
    return _runtime().stream_scope(stream, handle, device.index)


_NO_SCOPE = contextlib.nullcontext()   # reusable: entering it does nothing


def launch_scope(device: Device, stream, order=None):
    """Make ``device`` current, then ``stream`` (on that device), for the uploads and launches
    of one call; validates ``stream`` on cpu too. The one owner of the device and the stream of
    a call: the order matters, since a stream belongs to the device current when it is made.
    With ``order`` (a :class:`~hcache.stream_order.StreamOrder`), the call's work is chained
    after the owner's earlier work on other streams.

    Raises
    ------
    TypeError, ValueError
        ``stream`` is not a stream (see :func:`stream_handle`); raised here, on entry to the
        call, before the caller mutates anything.
    """
    if not device.is_cuda:
        if stream is not None:
            stream_handle(stream)
        return _NO_SCOPE
    rt = _cuda.runtime()
    if rt.current_device() == device.index and (
            stream is None or stream_handle(stream) == rt.current_stream()):
        # the device and the stream are current already: nothing to enter or restore
        return _NO_SCOPE if order is None else order
    return _cuda_launch_scope(device, stream, order)


@contextlib.contextmanager
def _cuda_launch_scope(device: Device, stream, order):
    with device.scope(), stream_scope(stream, device):
        if order is None:
            yield
            return
        with order:
            yield


_rings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # runtime -> {device: ring}
_rings_lock = threading.Lock()
_NO_RINGS: dict = {}


def _staging(rt, index: int) -> StagingRing:
    with _rings_lock:
        per_device = _rings.setdefault(rt, {})
        ring = per_device.get(index)
        if ring is None:
            with rt.device_scope(index):
                ring = per_device[index] = StagingRing(rt)
        return ring


ALIGNMENT = 64   # bytes: the first byte of every cache buffer (DLPack importers copy less)
_MAX_NBYTES = 2**63 - 1 - ALIGNMENT   # an int64 byte count, the alignment slack included


def zeros(device: Device, shape, dtype):
    """A zeroed C-contiguous array of ``device``'s module whose first byte is
    :data:`ALIGNMENT`-aligned: the allocator of every cache buffer.

    On ``cpu`` the buffer is over-allocated by ``ALIGNMENT`` bytes and the array starts at the
    first aligned byte (``numpy.zeros`` gives only 16 bytes, and JAX copies a less than
    64-byte aligned buffer that it imports). On ``cuda`` the runtime allocates on the current
    device (256-byte aligned) and queues the zero fill on the current stream: call it inside
    the construction's launch scope, which ends with :func:`settle`. ``TypeError`` for a bad
    ``device``, ``shape`` or ``dtype``; ``ValueError`` for a shape of more bytes than an
    int64 counts.
    """
    device = resolve_device(device)
    if isinstance(shape, (str, bytes, Set, Mapping)) or not hasattr(shape, "__iter__") or any(
            isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer))
            or n < 0 for n in shape):
        raise TypeError(f"shape: expected a sequence of ints >= 0, got {shape!r:.60}")
    try:
        dtype = np.dtype(dtype if dtype is not None else "")   # np.dtype(None) is float64
    except TypeError:
        raise TypeError(f"dtype: expected a dtype, got {dtype!r:.60}") from None
    shape = tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * dtype.itemsize     # exact: an int64 product could wrap to 0
    if nbytes > _MAX_NBYTES:
        raise ValueError(f"shape: expected at most {_MAX_NBYTES} bytes of {dtype}, "
                         f"got {shape!r:.60} ({nbytes} bytes)")
    if device.is_cuda:
        return _runtime().zeros(shape, dtype)
    raw = np.zeros(nbytes + ALIGNMENT, dtype=np.uint8)   # calloc: untouched pages stay free
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def cuda_free_bytes(device: Device) -> int:
    """Free memory of a CUDA ``device``, the runtime's pooled free blocks included (see
    :func:`hcache.memory.available_bytes`); no device work is queued or waited for."""
    return _runtime().free_bytes(device.index)


def upload(dst, host: np.ndarray) -> None:
    """``dst[:len(host)] = host``: host to device on the current stream (a plain copy for a NumPy
    ``dst``). The one way the package copies host data into device buffers; ``host`` must have
    ``dst``'s dtype and trailing shape, and ``dst``'s device must be current.

    On a device the bytes go through a pinned slot of the device's
    :class:`~hcache.staging.StagingRing`: no pageable copy, capture-safe (a captured upload
    keeps its slot for the graph's replays), and ``host`` may be reused as soon as this returns.
    """
    n = host.shape[0]
    if n == 0:
        return
    if isinstance(dst, np.ndarray):
        dst[:n] = host
        return
    rt = _cuda.runtime()
    index = rt.array_device(dst)
    ring = _rings.get(rt, _NO_RINGS).get(index) or _staging(rt, index)
    ring.upload(dst[:n], np.ascontiguousarray(host))


def upload_ints(dst, host: np.ndarray) -> None:
    """:func:`upload` of host integers into an int32 ``dst``."""
    upload(dst, host.astype(np.int32))


def settle(device: Device) -> None:
    """End of a construction: wait (host side) until the zero fills and table uploads it queued
    on the current stream of ``device`` ran, so the new memory is ready for work on any stream
    (a non-blocking stream is not ordered after the construction's stream). A no-op on cpu."""
    if device.is_cuda:
        with device.scope():
            _runtime().synchronize_stream()


def to_host(array) -> np.ndarray:
    """A host view of ``array`` (NumPy as it is; a CuPy array is copied, **synchronously**)."""
    if isinstance(array, np.ndarray):
        return array
    rt = _runtime()
    if rt is not None and rt.is_array(array):
        return rt.to_host(array)
    return np.asarray(array)
