"""Foreign arrays: inputs of any array library as arrays of the call's device (docs/design.md
§2, "Foreign arrays").

One coercion for every array argument of the package: :func:`as_array`. On ``cpu`` an array of
any library is viewed as NumPy (:func:`host_array`); on ``cuda`` a device array of any library
is viewed as the runtime's (CuPy) without a copy and without a host wait: the call's stream is
ordered after the producer's on the device (:func:`hcache.device.wait_for_producer`, or the
DLPack producer's own ordering). Memory of the other kind is refused, since using it would
mean a copy.
"""

from __future__ import annotations

import numpy as np

from . import _cuda
from .device import Device, launch_scope, resolve_device, stream_handle, wait_for_stream

__all__ = ["as_array", "host_array", "on_device"]

_DLPACK_HOST = (1, 3)   # kDLCPU, kDLCUDAHost: memory the host reads in place
_FOREIGN_ERRORS = (BufferError, RuntimeError, TypeError, ValueError, KeyError)


def _is_runtime_array(value) -> bool:
    rt = _cuda.runtime()
    return rt is not None and not isinstance(value, np.ndarray) and rt.is_array(value)


def on_device(value) -> bool:
    """True when ``value`` says its memory is device memory (a runtime array, the CUDA array
    interface, a DLPack device other than the host). DLPack is asked before the interface,
    whose producer may compute it only after its pending work (see :func:`as_array`)."""
    if _is_runtime_array(value):
        return True
    where = _dlpack_device(value)
    if where is not None:
        return where[0] not in _DLPACK_HOST
    return hasattr(value, "__cuda_array_interface__")


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

    On ``cpu`` see :func:`host_array`. On ``cuda`` a runtime (CuPy) array is returned as it is;
    any other device array is viewed in place, with ``stream`` (the call's stream) ordered
    after its producer on the device, never by a host wait: DLPack where the array has it
    (``__dlpack__(stream=...)``: the producer orders its work before ``stream``; it carries
    bfloat16 and float8), else ``__cuda_array_interface__`` through
    :func:`hcache.device.adopt` and :func:`hcache.device.wait_for_producer` (whose ``stream``
    entry names the producer). During a CUDA graph capture nothing is
    waited for: the caller orders the producer before capturing. Host memory is refused,
    since using it would mean a copy.

    Raises
    ------
    TypeError
        ``value`` is not an array, lives in the other kind of memory, or has a dtype the array
        module cannot import (the message says which).
    ValueError
        On ``cuda``: the array lives on another device than ``device``.
    TypeError, ValueError
        ``device`` is not a device, or ``stream`` not a stream (:func:`stream_handle`).
    """
    if type(device) is not Device:
        device = resolve_device(device)
    if stream is not None:
        stream_handle(stream)   # a bad stream is the stream's error, not the array's
    if not device.is_cuda:
        return host_array(name, value)
    rt = _cuda.runtime()
    if not isinstance(value, np.ndarray) and rt.is_array(value):
        index = rt.array_device(value)
        if index != device.index:
            raise ValueError(f"{name}: expected an array on {device}, got one on cuda:{index}")
        return value
    return _adopt(name, value, device, stream, rt)


def _adopt(name: str, value, device: Device, stream, rt):
    """A foreign device array as a runtime array, in one pass: recognized by its protocol,
    checked for its device before any work is queued for it, then viewed on ``stream`` after
    its producer (the interface's ``stream`` entry, or DLPack's own ordering)."""
    kind = type(value).__name__
    # DLPack first where both are offered (JAX, torch): it carries every cache dtype (the
    # interface has no typestr for bfloat16 or float8) and orders the producer on the device;
    # an interface without a ``stream`` entry says nothing of the producer's pending work
    where = _dlpack_device(value) if hasattr(value, "__dlpack__") else None
    iface = None if where is not None else getattr(value, "__cuda_array_interface__", None)
    if iface is None:
        if where is None or where[0] in _DLPACK_HOST:
            raise TypeError(f"{name}: expected a {device.xp.__name__} array (or an array on "
                            f"{device} with __cuda_array_interface__ or __dlpack__), got {kind}")
        if where[1] is not None and where[1] != device.index:
            raise ValueError(f"{name}: expected an array on {device}, got one on "
                             f"cuda:{where[1]}")
    else:
        try:
            view = rt.adopt(value)
        except _FOREIGN_ERRORS as exc:
            raise TypeError(f"{name}: expected an array the device runtime can import, got "
                            f"{kind}: {exc}") from None
        index = rt.array_device(view)
        if index != device.index:
            raise ValueError(f"{name}: expected an array on {device}, got one on cuda:{index}")
    with launch_scope(device, stream):
        if iface is not None:
            producer = iface.get("stream") if isinstance(iface, dict) else None
            if producer:
                wait_for_stream(rt, producer, device.index)
            return view
        try:
            view = rt.from_dlpack(value)
        except _FOREIGN_ERRORS as exc:
            raise TypeError(f"{name}: expected an array the device runtime can import, got "
                            f"{kind}: {exc}") from None
    index = rt.array_device(view) if rt.is_array(view) else None
    if index is not None and index != device.index:
        raise ValueError(f"{name}: expected an array on {device}, got one on cuda:{index}")
    return view


def _dlpack_device(value):
    """``(kind, ordinal)`` of ``value.__dlpack_device__()`` (ordinal None when unreadable), or
    None without one (or when it fails: not an array of a device)."""
    where = getattr(value, "__dlpack_device__", None)
    if where is None:
        return None
    try:
        found = where()
        kind = int(found[0])
    except (*_FOREIGN_ERRORS, AttributeError, IndexError):
        return None
    try:
        return kind, int(found[1])
    except (*_FOREIGN_ERRORS, AttributeError, IndexError):
        return kind, None   # the import itself reports what is wrong


def _check_dlpack_device(name: str, value, device: Device) -> None:
    """Refuse a DLPack array of another ordinal before importing it (the import would order
    the call's stream against another device's)."""
    try:
        index = int(value.__dlpack_device__()[1])
    except (*_FOREIGN_ERRORS, AttributeError, IndexError):
        return   # the import itself reports what is wrong
    if index != device.index:
        raise ValueError(f"{name}: expected an array on {device}, got one on cuda:{index}")
