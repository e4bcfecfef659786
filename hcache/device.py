"""Device selection, array modules and stream normalisation (docs/design.md §2).

``device=None`` means ``$HCACHE_DEVICE`` if set, else ``"cuda"`` when CuPy is importable and a
GPU is present, else ``"cpu"``. On ``cpu`` arrays are NumPy arrays and the NumPy reference does
the work; on ``cuda[:N]`` arrays are CuPy arrays and the kernels of ``kernels/`` do it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from functools import cache

import numpy as np

__all__ = ["Device", "resolve_device", "cupy_available", "stream_handle", "stream_scope",
           "launch_scope", "upload", "upload_ints", "to_host", "array_module_of", "data_pointer",
           "as_array", "host_array", "on_device", "ALIGNMENT", "zeros", "cuda_free_bytes"]


@cache
def _cupy():
    try:
        import cupy
    except Exception:  # noqa: BLE001 - any import failure means "no CuPy"
        return None
    return cupy


def cupy_available() -> bool:
    """True when CuPy imports and ``cupy.cuda.is_available()`` (a driver and a GPU) holds."""
    cp = _cupy()
    if cp is None:
        return False
    try:
        return bool(cp.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


@dataclass(frozen=True)
class Device:
    """A resolved device: ``kind`` is ``"cpu"`` or ``"cuda"``; ``index`` is the CUDA ordinal."""

    kind: str
    index: int = 0

    def __post_init__(self):
        if self.kind not in ("cpu", "cuda"):
            raise ValueError(f"kind: expected 'cpu' or 'cuda', got {self.kind!r}")
        if isinstance(self.index, bool) or not isinstance(self.index, (int, np.integer)):
            raise TypeError(f"index: expected an int, got {type(self.index).__name__}")
        if not 0 <= self.index < 2**31 or (self.kind == "cpu" and self.index):
            raise ValueError(f"index: expected a CUDA ordinal >= 0 (0 on cpu), "
                             f"got {self.index}")
        object.__setattr__(self, "index", int(self.index))

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def xp(self):
        """The array module: ``numpy`` on cpu, ``cupy`` on cuda."""
        return _cupy() if self.is_cuda else np

    def scope(self):
        """A context manager that makes this device current (a no-op on cpu)."""
        if self.is_cuda:
            return _cupy().cuda.Device(self.index)
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
    index = int(ordinal) if ordinal else _cupy().cuda.runtime.getDevice()
    count = _cupy().cuda.runtime.getDeviceCount()
    if index >= count:
        raise ValueError(f"device: expected an ordinal below {count}, got {index}")
    return Device("cuda", index)


def array_module_of(array):
    """``numpy`` or ``cupy``, by the array's type (anything not CuPy is treated as NumPy)."""
    cp = _cupy()
    if cp is not None and isinstance(array, cp.ndarray):
        return cp
    return np


def data_pointer(array) -> int:
    """The address of an array's first element (host address for NumPy, device for CuPy)."""
    if isinstance(array, np.ndarray):
        return int(array.ctypes.data)
    return int(array.data.ptr)


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
        return int(_cupy().cuda.get_current_stream().ptr) if cupy_available() else 0
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
    """Context manager that makes ``stream`` current for CuPy work on ``device``.

    On cpu the stream is validated and otherwise ignored.
    """
    handle = stream_handle(stream)
    if not device.is_cuda:
        return contextlib.nullcontext()
    cp = _cupy()
    if stream is None:
        return contextlib.nullcontext()
    if isinstance(stream, cp.cuda.Stream):
        return stream
    return _external_stream(handle, device.index)


class _StreamHandle:
    """A raw ``cudaStream_t`` as an object of the CUDA stream protocol."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


@cache
def _external_stream(handle: int, device_index: int):
    """A CuPy stream for a foreign ``cudaStream_t`` on ``device_index``, made once per handle
    (``Stream.from_external``; CuPy 13 has only the deprecated ``ExternalStream``)."""
    cp = _cupy()
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is None:
        return cp.cuda.ExternalStream(handle, device_index)
    with cp.cuda.Device(device_index):
        return from_external(_StreamHandle(handle))


_NO_SCOPE = contextlib.nullcontext()   # reusable: entering it does nothing


def launch_scope(device: Device, stream):
    """Make ``device`` current, then ``stream`` (on that device), for the uploads and launches
    of one call; validates ``stream`` on cpu too. The one owner of the device and the stream of
    a call: the order matters, since a stream belongs to the device current when it is made.

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
    return _cuda_launch_scope(device, stream)


@contextlib.contextmanager
def _cuda_launch_scope(device: Device, stream):
    with device.scope(), stream_scope(stream, device):
        yield


ALIGNMENT = 64   # bytes: the first byte of every cache buffer (DLPack importers copy less)


def zeros(device: Device, shape, dtype):
    """A zeroed C-contiguous array of ``device``'s module whose first byte is
    :data:`ALIGNMENT`-aligned: the allocator of every cache buffer.

    On ``cpu`` the buffer is over-allocated by ``ALIGNMENT`` bytes and the array starts at the
    first aligned byte (``numpy.zeros`` gives only 16 bytes, and JAX copies a less than
    64-byte aligned buffer that it imports). CuPy's allocations are 256-byte aligned already.
    ``TypeError`` / ``ValueError`` for a bad ``device``, ``shape`` or ``dtype``.
    """
    device = resolve_device(device)
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__") or any(
            isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer))
            or n < 0 for n in shape):
        raise TypeError(f"shape: expected a sequence of ints >= 0, got {shape!r:.60}")
    try:
        dtype = np.dtype(dtype if dtype is not None else "")   # np.dtype(None) is float64
    except TypeError:
        raise TypeError(f"dtype: expected a dtype, got {dtype!r:.60}") from None
    if device.is_cuda:
        return _cupy().zeros(shape, dtype=dtype)
    shape = tuple(int(n) for n in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + ALIGNMENT, dtype=np.uint8)   # calloc: untouched pages stay free
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def cuda_free_bytes(device: Device) -> int:
    """Free memory of a CUDA ``device``, CuPy's pooled free blocks included (see
    :func:`hcache.memory.available_bytes`)."""
    cp = _cupy()
    with cp.cuda.Device(device.index):
        free, _ = cp.cuda.runtime.memGetInfo()
        return int(free) + int(cp.get_default_memory_pool().free_bytes())


def upload(dst, host: np.ndarray) -> None:
    """``dst[:len(host)] = host``: host to device on the current stream (a plain copy for a NumPy
    ``dst``). The one way the package copies host data into device buffers; ``host`` must have
    ``dst``'s dtype and trailing shape."""
    n = host.shape[0]
    if n == 0:
        return
    if isinstance(dst, np.ndarray):
        dst[:n] = host
    else:
        dst[:n].set(np.ascontiguousarray(host))


def upload_ints(dst, host: np.ndarray) -> None:
    """:func:`upload` of host integers into an int32 ``dst``."""
    upload(dst, host.astype(np.int32))


def to_host(array) -> np.ndarray:
    """A host view of ``array`` (NumPy as it is; a CuPy array is copied, **synchronously**)."""
    if isinstance(array, np.ndarray):
        return array
    return np.asarray(array.get() if hasattr(array, "get") else array)


# --- foreign arrays (docs/design.md §2) ---------------------------------------------------------

_DLPACK_HOST = (1, 3)   # kDLCPU, kDLCUDAHost: memory the host reads in place
_FOREIGN_ERRORS = (BufferError, RuntimeError, TypeError, ValueError)


def on_device(value) -> bool:
    """True when ``value`` says its memory is device memory (CuPy, the CUDA array interface, a
    DLPack device other than the host)."""
    cp = _cupy()
    if (cp is not None and isinstance(value, cp.ndarray)) \
            or hasattr(value, "__cuda_array_interface__"):
        return True
    where = getattr(value, "__dlpack_device__", None)
    if where is None:
        return False
    try:
        return int(where()[0]) not in _DLPACK_HOST
    except _FOREIGN_ERRORS:
        return False


def host_array(name: str, value) -> np.ndarray:
    """``value`` as a NumPy array, sharing its memory where it can.

    A NumPy array is returned as it is; an object with ``__dlpack__`` goes through
    ``numpy.from_dlpack`` (zero-copy; read-only when the producer says so); one with
    ``__array_interface__`` / ``__array__`` through ``numpy.asarray`` (zero-copy when the
    producer hands out its buffer, as JAX and NumPy-backed containers do). DLPack has no
    NumPy equivalent of bfloat16 or float8: such an object is read through ``__array__`` when
    it has one (JAX), else refused.

    Raises
    ------
    TypeError
        ``value`` is device memory, not an array (a list, a scalar, ``None``), or an array
        NumPy cannot import (the message says why).
    """
    if isinstance(value, np.ndarray):
        return value
    kind = type(value).__name__
    if on_device(value):
        raise TypeError(f"{name}: expected a numpy array (host memory: the device is cpu), "
                        f"got device memory ({kind})")
    problem = ""
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except _FOREIGN_ERRORS as exc:
            problem = f": {exc}"
    if any(hasattr(value, p) for p in ("__array_interface__", "__array_struct__", "__array__")):
        try:
            arr = np.asarray(value)
        except _FOREIGN_ERRORS as exc:
            problem = f": {exc}"
        else:
            if arr.dtype != object:
                return arr
            problem = problem or ": it converts to dtype object"
    raise TypeError(f"{name}: expected a numpy array (or an array with __dlpack__ or "
                    f"__array__), got {kind}{problem}")


def as_array(name: str, value, device: Device, stream=None):
    """``value`` as an array of ``device``'s module (``device.xp``), without a copy.

    On ``cpu`` see :func:`host_array`. On ``cuda`` a CuPy array is returned as it is and any
    other device array is imported by :func:`_cuda_import` (``__cuda_array_interface__`` or
    DLPack, on ``stream``); host memory is refused, since using it would mean a copy.

    Raises
    ------
    TypeError
        ``value`` is not an array, lives in the other kind of memory, or has a dtype the array
        module cannot import (the message says which).
    TypeError, ValueError
        ``device`` is not a device, or ``stream`` not a stream (:func:`stream_handle`).
    """
    device = resolve_device(device)
    stream_handle(stream)   # a bad stream is the stream's error, not the array's
    if not device.is_cuda:
        return host_array(name, value)
    if isinstance(value, _cupy().ndarray):
        return value
    if not on_device(value):
        raise TypeError(f"{name}: expected a cupy array (or an array on {device} with "
                        f"__cuda_array_interface__ or __dlpack__), got {type(value).__name__}")
    try:
        return _cuda_import(value, device, stream)
    except _FOREIGN_ERRORS as exc:
        raise TypeError(f"{name}: expected an array CuPy can import, got "
                        f"{type(value).__name__}: {exc}") from None


def _cuda_import(value, device: Device, stream):
    """A CuPy view of a foreign device array: the CUDA array interface, else DLPack (the
    producer orders its work before ``stream``)."""
    cp = _cupy()
    with launch_scope(device, stream):
        if hasattr(value, "__cuda_array_interface__"):
            return cp.asarray(value)
        return cp.from_dlpack(value)
