"""The device boundary (docs/design.md §2, §9): every CuPy / CUDA call of the package.

hcache touches a GPU only through a *runtime*: an object with the methods of
:class:`CupyRuntime`. Each method is one CUDA runtime operation (named in its docstring) made
through CuPy; nothing else in ``hcache`` imports CuPy (tests/test_package_layout.py checks the
source). Everything above this module (staging, managers, ops) is host logic that the test
suite runs on an asynchronous emulated device implementing the same methods
(tests/emu_device.py), installed with :func:`use_runtime`.

Conventions of every method: "the current stream" and "the current device" are those of the
calling thread (CuPy's); copies and launches are asynchronous on the current stream unless the
docstring says *synchronizes*.
"""

from __future__ import annotations

import contextlib
from functools import cache

import numpy as np

from ..errors import KernelCompileError

__all__ = ["CupyRuntime", "runtime", "use_runtime"]

_installed = None   # a runtime set by use_runtime (tests), else CuPy's


def runtime():
    """The active runtime: the one installed by :func:`use_runtime`, else CuPy's; ``None``
    when CuPy does not import."""
    return _installed if _installed is not None else _cupy_runtime()


@contextlib.contextmanager
def use_runtime(rt):
    """Make ``rt`` the runtime of every ``cuda`` device while the block runs (process-wide;
    the test suite's emulated device). Devices resolved inside keep no reference to it."""
    global _installed
    previous, _installed = _installed, rt
    try:
        yield rt
    finally:
        _installed = previous


@cache
def _cupy_runtime():
    """CuPy's runtime, made once (its stream wrappers live as long as the process)."""
    try:
        import cupy
    except Exception:  # noqa: BLE001 - any import failure means "no CuPy"
        return None
    return CupyRuntime(cupy)


class CupyRuntime:
    """The CuPy side of the boundary: one CUDA operation per method."""

    cache_key = "cupy"    # compiled modules are cached per kind of runtime (ops/_loader.py)

    def __init__(self, cupy):
        self.cp = cupy
        self.xp = cupy            # the device array module (allocation, dtype probes)
        self._streams = {}        # (handle, device) -> Stream.from_external, made once
        self._usable = None

    @property
    def version(self) -> str:
        return str(self.cp.__version__)

    # --- devices ----------------------------------------------------------------------------

    def usable(self) -> bool:
        """``cudaGetDeviceCount() > 0`` with a working driver (asked once per process)."""
        if self._usable is None:
            try:
                self._usable = bool(self.cp.cuda.is_available())
            except Exception:  # noqa: BLE001
                self._usable = False
        return self._usable

    def device_count(self) -> int:
        """``cudaGetDeviceCount``."""
        return int(self.cp.cuda.runtime.getDeviceCount())

    def current_device(self) -> int:
        """``cudaGetDevice``."""
        return int(self.cp.cuda.runtime.getDevice())

    def device_scope(self, index: int):
        """``cudaSetDevice(index)`` for a ``with`` block (the previous device restored)."""
        return self.cp.cuda.Device(index)

    def device_name(self, index: int) -> str:
        """``cudaGetDeviceProperties(index).name``."""
        name = self.cp.cuda.runtime.getDeviceProperties(index)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    # --- arrays -----------------------------------------------------------------------------

    def is_array(self, a) -> bool:
        """Whether ``a`` is a device array of this runtime."""
        return isinstance(a, self.cp.ndarray)

    def array_device(self, a) -> int:
        """The device that owns ``a``'s memory."""
        return int(a.device.id)

    def pointer(self, a) -> int:
        """The device address of ``a``'s first element."""
        return int(a.data.ptr)

    def adopt(self, obj):
        """A device array viewing a ``__cuda_array_interface__`` object, with **no**
        synchronization (``cupy.asarray`` would synchronize the producer's ``stream``): the
        caller orders the producer's stream (see :func:`hcache.device.adopt`)."""
        iface = obj.__cuda_array_interface__
        shape, dtype = tuple(iface["shape"]), np.dtype(iface["typestr"])
        strides = iface.get("strides")
        if strides is None:
            strides = tuple(int(s) for s in np.empty(shape, dtype).strides) if shape else ()
        ptr = int(iface["data"][0])
        span = (max(((n - 1) * s for n, s in zip(shape, strides) if s > 0), default=0)
                + dtype.itemsize) if all(shape) else 0
        memory = self.cp.cuda.UnownedMemory(ptr, span, obj)   # its device from the pointer
        return self.cp.ndarray(shape, dtype, self.cp.cuda.MemoryPointer(memory, 0), strides)

    def from_dlpack(self, obj):
        """``cupy.from_dlpack(obj)``: a view of a DLPack producer's device memory, imported on
        the current stream (``obj.__dlpack__(stream=current)``: the producer orders its
        pending work before the current stream, on the device; no host wait)."""
        return self.cp.from_dlpack(obj)

    # --- streams and capture ----------------------------------------------------------------

    def current_stream(self) -> int:
        """The handle of the current stream (``cudaStream_t``)."""
        return int(self.cp.cuda.get_current_stream().ptr)

    def stream_scope(self, stream, handle: int, index: int):
        """Make ``stream`` (handle ``handle``, on device ``index``, already current) current
        for a ``with`` block; a foreign handle is wrapped once (``Stream.from_external``)."""
        if stream is None:
            return contextlib.nullcontext()
        if isinstance(stream, self.cp.cuda.Stream):
            return stream
        if handle == 0:
            return self.cp.cuda.Stream.null   # the legacy default stream
        key = (handle, index)
        wrapped = self._streams.get(key)
        if wrapped is None:
            from_external = getattr(self.cp.cuda.Stream, "from_external", None)
            if from_external is None:   # CuPy 13
                wrapped = self.cp.cuda.ExternalStream(handle, index)
            else:
                with self.cp.cuda.Device(index):
                    wrapped = from_external(_StreamHandle(handle))
            self._streams[key] = wrapped
        return wrapped

    def is_capturing(self) -> bool:
        """``cudaStreamIsCapturing(current stream) != cudaStreamCaptureStatusNone``."""
        handle = self.current_stream()
        return int(self.cp.cuda.runtime.streamIsCapturing(handle)) != 0

    # --- memory -----------------------------------------------------------------------------

    def zeros(self, shape: tuple, dtype) -> object:
        """``cudaMalloc`` (CuPy's pool: 256-byte aligned) on the current device, then
        ``cudaMemsetAsync(0)`` on the current stream."""
        return self.cp.zeros(shape, dtype=dtype)

    def ring_start(self, lengths, window: int):
        """A new device array ``lengths % window`` where ``lengths > window``, else 0 (same
        shape and dtype), computed by an elementwise kernel on the current stream: no host
        read. ``window`` > 0."""
        w = lengths.dtype.type(window)
        return self.cp.where(lengths > w, lengths % w, 0).astype(lengths.dtype, copy=False)

    def free_bytes(self, index: int) -> int:
        """``cudaMemGetInfo`` free bytes of device ``index``, plus the free blocks CuPy's
        memory pool holds there (an allocation reuses them first)."""
        with self.cp.cuda.Device(index):
            free, _ = self.cp.cuda.runtime.memGetInfo()
            return int(free) + int(self.cp.get_default_memory_pool().free_bytes())

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        """``cudaHostAlloc``: page-locked host memory as a NumPy ``uint8 [nbytes]``."""
        memory = self.cp.cuda.alloc_pinned_memory(max(int(nbytes), 1))
        return np.frombuffer(memory, np.uint8, int(nbytes))

    def copy_h2d(self, dst, src: np.ndarray) -> None:
        """``cudaMemcpyAsync(dst, src, HostToDevice, current stream)``; ``dst`` and ``src``
        contiguous, of equal size. From pinned ``src`` the copy reads it when it executes, and
        it may be captured into a graph (CuPy's ``copy_from_host_async`` refuses any host copy
        during capture, pinned or not: the GPU run of 2026-11-27 found every captured upload
        refused, so the runtime call is made directly)."""
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes, rt.memcpyHostToDevice,
                       self.cp.cuda.get_current_stream().ptr)

    def synchronize_stream(self) -> None:
        """``cudaStreamSynchronize(current stream)``."""
        self.cp.cuda.get_current_stream().synchronize()

    def copy_d2d(self, dst, src, nbytes: int) -> None:
        """``cudaMemcpyAsync(dst, src, nbytes, DeviceToDevice, current stream)``."""
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, int(nbytes), rt.memcpyDeviceToDevice,
                       self.cp.cuda.get_current_stream().ptr)

    def capture_replay(self, fn):
        """``(replay, None)``: ``replay()`` launches, on the current stream, a CUDA graph
        captured (on a new non-blocking stream) from one ``fn()``, run once uncaptured first for
        its lazy set-up; ``(None, reason)`` when ``fn`` cannot be captured (``reason``: the
        error). For timing launches without host time."""
        stream = self.cp.cuda.Stream(non_blocking=True)
        with stream:
            fn()
            stream.synchronize()
            try:
                stream.begin_capture()
                try:
                    fn()
                finally:
                    graph = stream.end_capture()
            except Exception as exc:  # noqa: BLE001 - not capturable: the caller times calls
                return None, f"{type(exc).__name__}: {exc}"
        return (lambda: graph.launch(self.cp.cuda.get_current_stream())), None

    def to_host(self, a) -> np.ndarray:
        """``cudaMemcpyAsync`` device to host on the current stream, then
        ``cudaStreamSynchronize``: **synchronizes** the current stream."""
        return a.get()

    # --- events -----------------------------------------------------------------------------

    def event(self, timing: bool = False):
        """``cudaEventCreateWithFlags`` (``cudaEventDisableTiming`` unless ``timing``)."""
        return self.cp.cuda.Event(disable_timing=not timing)

    def record(self, event) -> None:
        """``cudaEventRecord(event, current stream)``."""
        event.record(self.cp.cuda.get_current_stream())

    def wait(self, event) -> None:
        """``cudaStreamWaitEvent(current stream, event)``: later work on the current stream
        runs after the work before the event's record (no host wait)."""
        self.cp.cuda.get_current_stream().wait_event(event)

    def event_synchronize(self, event) -> None:
        """``cudaEventSynchronize``: the host waits for the event's work."""
        event.synchronize()

    def elapsed_ms(self, start, end) -> float:
        """``cudaEventElapsedTime`` (timing events)."""
        return float(self.cp.cuda.get_elapsed_time(start, end))

    # --- kernels ----------------------------------------------------------------------------

    def compile(self, path: str, source: str, options: tuple, index: int):
        """NVRTC compile of ``source`` into a module on device ``index`` (``cupy.RawModule``).

        Raises
        ------
        KernelCompileError
            NVRTC rejected the source.
        """
        with self.cp.cuda.Device(index):
            module = self.cp.RawModule(code=source, options=options, name_expressions=None)
            try:
                module.compile()
            except self.cp.cuda.compiler.CompileException as exc:
                raise KernelCompileError(path, str(exc)) from None
        return module

    def kernel(self, module, name: str):
        """``cuModuleGetFunction``: kernel ``name`` of a compiled module."""
        return module.get_function(name)

    def launch(self, kernel, grid, block, args) -> None:
        """``cuLaunchKernel`` on the current stream (``args``: NumPy scalars, by value)."""
        kernel(grid, block, args)


class _StreamHandle:
    """A raw ``cudaStream_t`` as an object of the CUDA stream protocol."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)
