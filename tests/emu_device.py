"""An asynchronous emulated CUDA device: the runtime of ``hcache._cuda`` with GPU semantics,
on the host, running the real ``kernels/*.cu`` through ``tests/emu.py``.

Semantics (each a rule the CUDA path must respect on a GPU):

- **Queues.** Every copy, fill and launch is queued on the current stream of the current
  device and runs only when something waits for it: a stream or event synchronize, a device to
  host read, or another stream's wait on an event recorded after it. A device-wide
  :meth:`EmuRuntime.synchronize` drains the streams latest-used first (adversarial order).
- **Legacy default stream.** The default stream (handle 0) of a device is ordered with every
  blocking stream of that device, as CUDA's legacy stream is; ``non_blocking`` streams are not.
- **Host memory.** A copy from pinned memory (:meth:`EmuRuntime.pinned_empty`) reads the host
  buffer when it *executes*, so a staging buffer reused too early shows up as wrong data. A
  copy from pageable memory is staged at the call (as the driver does), is counted in
  ``counters["pageable_copies"]``, and is refused during capture.
- **Capture.** :meth:`EmuStream.begin_capture` records the stream's work into a graph that
  :meth:`EmuGraph.launch` replays (kernels with their argument values, pinned copies reading
  their buffers at replay). During a capture: synchronizing anything, reading the device,
  allocating device or pinned memory, pageable copies, and waiting on an event recorded outside
  the capture raise :class:`EmuError`.
- **Devices.** Several devices, each with its own default stream; a stream made current on
  another device, or a kernel given memory of another device, raises :class:`EmuError`.
- **Freed memory** is poisoned (bytes ``0xDD``), ordered on the stream it was allocated on;
  new allocations hold garbage (``0xBE``) until written; a launch naming freed memory raises.
- **Capacity.** Each device holds ``capacity`` bytes: :meth:`EmuRuntime.free_bytes` is what
  live allocations leave, and an allocation past it raises :class:`EmuError`
  (``cudaErrorMemoryAllocation``).
- **DLPack.** An array's ``__dlpack__(stream=s)`` orders its device's current stream before
  ``s`` (an event, no host wait); :meth:`EmuRuntime.from_dlpack` imports on the current stream.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import threading
import weakref
from pathlib import Path

import numpy as np

import emu
import emu_array

FRESH, POISON = 0xBE, 0xDD


class EmuError(RuntimeError):
    """What a GPU would report (a CUDA error), or a hazard it would silently let through."""


class EmuEvent:
    """An event: the point of a stream's queue at its last record."""

    def __init__(self):
        self.stream, self.seq, self.graph = None, 0, None


class EmuGraph:
    """Work captured from a stream; :meth:`launch` queues it again, as often as wanted."""

    def __init__(self, rt, stream):
        self.rt, self.stream, self.ops = rt, stream, []

    def launch(self, stream=None):
        rt = self.rt
        with rt.lock:
            target = stream if stream is not None else rt.current()
            for fn, what in self.ops:
                rt.enqueue(fn, what, target, replay=True)
            rt.counters["graph_launches"] += 1


class EmuStream:
    """A stream of one device (``ptr`` is its handle; ``with stream:`` makes it current)."""

    def __init__(self, rt, device: int, handle: int, non_blocking: bool):
        self.rt, self.device, self.ptr, self.non_blocking = rt, device, handle, non_blocking
        self.pending = collections.deque()
        self.enqueued = self.executed = 0
        self.graph = None

    def __cuda_stream__(self):
        return (0, self.ptr)

    def __enter__(self):
        self.rt.push_stream(self)
        return self

    def __exit__(self, *exc):
        self.rt.pop_stream(self)

    def synchronize(self):
        self.rt.refuse_in_capture("cudaStreamSynchronize")
        self.rt.counters["syncs"] += 1
        self.run_until(self.enqueued)

    def run_until(self, seq: int) -> None:
        with self.rt.lock:
            while self.executed < seq:
                fn, deps, what = self.pending.popleft()
                for stream, n in deps:
                    stream.run_until(n)
                fn()
                self.executed += 1

    def begin_capture(self):
        if self.graph is not None:
            raise EmuError("cudaStreamBeginCapture: the stream is capturing already")
        if self.ptr == 0:
            raise EmuError("cudaStreamBeginCapture: the legacy default stream cannot capture")
        self.graph = EmuGraph(self.rt, self)

    def end_capture(self) -> EmuGraph:
        graph, self.graph = self.graph, None
        if graph is None:
            raise EmuError("cudaStreamEndCapture: the stream is not capturing")
        return graph


class _Alloc:
    """A device allocation: an aligned host buffer standing for device memory.

    A zero-byte allocation has the address 0, as CuPy's does (its memory pool hands out a null
    pointer for size 0): arrays of it look absent to a kernel that tests for ``nullptr``. The
    host buffer behind it still has one byte, so views of it stay valid NumPy arrays.
    """

    def __init__(self, rt, device: int, nbytes: int):
        self.null = int(nbytes) == 0
        raw = np.empty(max(nbytes, 1) + 256, np.uint8)
        off = (-raw.ctypes.data) % 256
        self.buf = raw[off:off + max(nbytes, 1)]
        self.buf[:] = FRESH
        self.device, self.ptr, self.nbytes = device, int(self.buf.ctypes.data), max(nbytes, 1)
        stream = rt.current()
        weakref.finalize(self, rt.on_free, self.ptr, self.buf, stream)


class EmuModule:
    """A kernel family compiled for the host (tests/emu.py)."""

    def __init__(self, family: str):
        self.family = family


class EmuRuntime:
    """The emulated device runtime (the methods of ``hcache._cuda.CupyRuntime``)."""

    cache_key = "emulated"
    version = "emulated"

    def __init__(self, num_devices: int = 2, capacity: int = 2**32):
        self.lock = threading.RLock()
        self.num_devices, self.capacity = num_devices, int(capacity)
        self.live_bytes = [0] * num_devices
        self._handles = {}
        self.defaults = [self._make_stream(d, False, 0) for d in range(num_devices)]
        self._local = threading.local()
        self._starts, self._ranges = [], {}   # device allocations: start -> (end, alloc info)
        self._pinned = []                     # (start, end) of pinned host buffers
        self._keep = []                       # freed buffers stay mapped (queued work may run)
        self._used = []                       # streams, most recently enqueued to last
        self.counters = collections.Counter()
        self.launches = []
        self.xp = emu_array.EmuXP(self)

    # --- devices ----------------------------------------------------------------------------

    def usable(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.num_devices

    def _tls(self):
        t = self._local
        if not hasattr(t, "device"):
            t.device, t.stacks = 0, collections.defaultdict(list)
        return t

    def current_device(self) -> int:
        return self._tls().device

    @contextlib.contextmanager
    def device_scope(self, index: int):
        if not 0 <= index < self.num_devices:
            raise EmuError(f"cudaSetDevice({index}): invalid device ordinal")
        t = self._tls()
        previous, t.device = t.device, index
        try:
            yield
        finally:
            t.device = previous

    def device_name(self, index: int) -> str:
        return f"Emulated GPU {index}"

    # --- streams ----------------------------------------------------------------------------

    def _make_stream(self, device, non_blocking, handle=None):
        handle = len(self._handles) * 16 + 0x1000 if handle is None else handle
        s = EmuStream(self, device, handle, non_blocking)
        if handle:
            self._handles[handle] = s
        return s

    def stream(self, non_blocking: bool = False, device: int | None = None) -> EmuStream:
        """A new stream on ``device`` (default: the current one), like ``cupy.cuda.Stream``."""
        with self.lock:
            return self._make_stream(self.current_device() if device is None else device,
                                     non_blocking)

    def current(self) -> EmuStream:
        t = self._tls()
        stack = t.stacks[t.device]
        return stack[-1] if stack else self.defaults[t.device]

    def current_stream(self) -> int:
        return self.current().ptr

    def push_stream(self, stream: EmuStream) -> None:
        t = self._tls()
        if stream.device != t.device:
            raise EmuError(f"stream of device {stream.device} made current while device "
                           f"{t.device} is current (cudaErrorInvalidResourceHandle)")
        t.stacks[t.device].append(stream)

    def pop_stream(self, stream: EmuStream) -> None:
        stack = self._tls().stacks[stream.device]
        if not stack or stack[-1] is not stream:
            raise EmuError("stream scopes exited out of order")
        stack.pop()

    def stream_scope(self, stream, handle: int, index: int):
        if stream is None:
            return contextlib.nullcontext()
        if handle == 0:
            target = self.defaults[index]
        elif handle in self._handles:
            target = self._handles[handle]
        else:
            raise EmuError(f"stream handle {handle:#x}: not a stream of this device")
        if target.device != index:
            raise EmuError(f"stream of device {target.device} used on device {index} "
                           "(cudaErrorInvalidResourceHandle)")
        return target

    def is_capturing(self) -> bool:
        return self.current().graph is not None

    def capturing_anywhere(self) -> bool:
        return any(s.graph is not None for s in self._handles.values())

    def refuse_in_capture(self, what: str) -> None:
        if self.capturing_anywhere():
            raise EmuError(f"{what} during stream capture (cudaErrorStreamCaptureUnsupported)")

    # --- queues -----------------------------------------------------------------------------

    def enqueue(self, fn, what: str, stream: EmuStream | None = None, replay=False) -> None:
        with self.lock:
            s = self.current() if stream is None else stream
            if s.graph is not None and not replay:
                s.graph.ops.append((fn, what))
                return
            deps = []
            if s.ptr == 0:
                deps = [(o, o.enqueued) for o in self._handles.values()
                        if o.device == s.device and not o.non_blocking and o.pending]
            elif not s.non_blocking:
                d = self.defaults[s.device]
                deps = [(d, d.enqueued)] if d.pending else []
            s.pending.append((fn, deps, what))
            s.enqueued += 1
            if s in self._used:
                self._used.remove(s)
            self._used.append(s)

    def synchronize(self, schedule: str = "lifo") -> None:
        """``cudaDeviceSynchronize`` of every device. ``schedule`` is the adversary's order:
        ``"lifo"`` drains the streams latest-used first; ``"round_robin"`` runs one operation
        of each stream in turn (so unordered work of two streams interleaves)."""
        self.refuse_in_capture("cudaDeviceSynchronize")
        with self.lock:
            streams = list(reversed(self._used))
            if schedule == "lifo":
                for s in streams:
                    s.run_until(s.enqueued)
            elif schedule == "round_robin":
                while any(s.executed < s.enqueued for s in streams):
                    for s in streams:
                        if s.executed < s.enqueued:
                            s.run_until(s.executed + 1)
            else:
                raise ValueError(f"schedule: expected 'lifo' or 'round_robin', got {schedule!r}")
            self.counters["syncs"] += 1

    # --- memory -----------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> _Alloc:
        """``cudaMalloc`` on the current device (refused during capture)."""
        self.refuse_in_capture("cudaMalloc")
        with self.lock:
            device = self.current_device()
            if int(nbytes) > self.free_bytes(device):
                raise EmuError(f"cudaMalloc({int(nbytes)}) on device {device}: out of memory "
                               "(cudaErrorMemoryAllocation)")
            a = _Alloc(self, device, int(nbytes))
            self.live_bytes[device] += a.nbytes
            i = bisect.bisect(self._starts, a.ptr)
            self._starts.insert(i, a.ptr)
            self._ranges[a.ptr] = [a.ptr + a.nbytes, a.device, True]
            self.counters["allocations"] += 1
            return a

    def on_free(self, ptr: int, buf: np.ndarray, stream: EmuStream) -> None:
        with self.lock:
            self._ranges[ptr][2] = False
            self.live_bytes[self._ranges[ptr][1]] -= buf.nbytes
            self._keep.append(buf)
            self.enqueue(lambda: buf.fill(POISON), "poison freed memory", stream, replay=True)

    def lookup(self, ptr: int):
        """``(device, live)`` of the allocation holding ``ptr``, or None."""
        i = bisect.bisect(self._starts, ptr) - 1
        if i < 0:
            return None
        end, device, live = self._ranges[self._starts[i]]
        return (device, live) if ptr < end else None

    def zeros(self, shape: tuple, dtype):
        """``cudaMalloc`` (garbage until the fill runs) + ``cudaMemsetAsync`` on the current
        stream."""
        return self.xp.zeros(shape, dtype)

    def ring_start(self, lengths, window: int):
        """The elementwise ``where(lengths > window, lengths % window, 0)`` kernel: a new array,
        written when the current stream reaches it (no host read)."""
        out = self.xp.empty(lengths.shape, lengths.dtype)
        src, dst, w = lengths._v, out._v, lengths.dtype.type(window)
        self.enqueue(lambda: np.copyto(dst, np.where(src > w, src % w, 0), casting="unsafe"),
                     "ring_start")
        return out

    def free_bytes(self, index: int) -> int:
        """``cudaMemGetInfo``: what the live allocations of device ``index`` leave."""
        return max(self.capacity - self.live_bytes[index], 0)

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        self.refuse_in_capture("cudaHostAlloc")
        buf = np.zeros(max(int(nbytes), 1), np.uint8)[:int(nbytes)]
        with self.lock:
            self._pinned.append((buf.ctypes.data, buf.ctypes.data + max(int(nbytes), 1), buf))
        return buf

    def is_pinned(self, a: np.ndarray) -> bool:
        start, end = a.ctypes.data, a.ctypes.data + a.nbytes
        return any(s <= start and end <= e for s, e, _ in self._pinned)

    def copy_h2d(self, dst, src: np.ndarray) -> None:
        view = dst._v
        if not (view.flags.c_contiguous and src.flags.c_contiguous) or view.nbytes != src.nbytes:
            raise EmuError("cudaMemcpyAsync: expected contiguous buffers of equal size")
        out = view.reshape(-1).view(np.uint8)
        if self.is_pinned(src):
            data = src.reshape(-1).view(np.uint8)   # read when the copy executes
            self.enqueue(lambda: np.copyto(out, data), "memcpy HtoD (pinned)")
            return
        if self.is_capturing():
            raise EmuError("cudaMemcpyAsync from pageable host memory during stream capture "
                           "(cudaErrorStreamCaptureUnsupported)")
        self.counters["pageable_copies"] += 1
        data = src.reshape(-1).view(np.uint8).copy()   # staged by the driver, now
        self.enqueue(lambda: np.copyto(out, data), "memcpy HtoD (pageable)")

    def copy_d2d(self, dst, src, nbytes: int) -> None:
        """``cudaMemcpyAsync`` device to device of ``nbytes`` on the current stream."""
        out, data = (a._v.reshape(-1).view(np.uint8) for a in (dst, src))
        if nbytes > min(out.nbytes, data.nbytes):
            raise EmuError("cudaMemcpyAsync: a device-to-device copy past its buffers")
        self.enqueue(lambda: np.copyto(out[:nbytes], data[:nbytes]), "memcpy DtoD")

    def capture_replay(self, fn):
        """As the CuPy runtime's: ``(replay, None)``, or ``(None, reason)`` when ``fn`` cannot
        be captured."""
        stream = self.stream(non_blocking=True)
        with stream:
            fn()
            stream.synchronize()
            try:
                stream.begin_capture()
                try:
                    fn()
                finally:
                    graph = stream.end_capture()
            except Exception as exc:  # noqa: BLE001 - as the CuPy runtime's
                return None, f"{type(exc).__name__}: {exc}"
        return (lambda: graph.launch(self.current())), None

    def synchronize_stream(self) -> None:
        self.refuse_in_capture("cudaStreamSynchronize")
        with self.lock:
            s = self.current()
            self.enqueue(lambda: None, "synchronize", s)   # the legacy stream's implicit waits
            s.run_until(s.enqueued)
            self.counters["syncs"] += 1

    def to_host(self, a) -> np.ndarray:
        self.refuse_in_capture("cudaMemcpy DtoH")
        with self.lock, self.device_scope(a._alloc.device):
            s = self.current()
            self.enqueue(lambda: None, "memcpy DtoH", s)   # ordered as a copy on s would be
            s.run_until(s.enqueued)
            self.counters["syncs"] += 1
            return a._v.copy()

    # --- arrays -----------------------------------------------------------------------------

    def is_array(self, a) -> bool:
        return isinstance(a, emu_array.EmuArray)

    def array_device(self, a) -> int:
        return a._alloc.device

    def pointer(self, a) -> int:
        return a.address

    def adopt(self, obj):
        return self.xp.view_interface(obj)

    def from_dlpack(self, obj):
        """Import on the current stream: ``obj.__dlpack__(stream=...)`` orders the producer's
        work before it (1 names the legacy default stream, as DLPack does)."""
        handle = self.current_stream()
        capsule = obj.__dlpack__(stream=handle if handle else 1)
        if not isinstance(capsule, emu_array.EmuCapsule):
            raise BufferError(f"from_dlpack: expected a DLPack tensor of the emulated device, "
                              f"got {type(capsule).__name__}")
        return capsule.array

    # --- events -----------------------------------------------------------------------------

    def event(self, timing: bool = False) -> EmuEvent:
        return EmuEvent()

    def record(self, event: EmuEvent) -> None:
        with self.lock:
            s = self.current()
            event.stream, event.seq, event.graph = s, s.enqueued, s.graph
            if s.graph is not None:
                event.seq = len(s.graph.ops)

    def wait(self, event: EmuEvent) -> None:
        s = self.current()
        if event.stream is None or event.stream is s and s.graph is event.graph:
            return
        if s.graph is not None or event.graph is not None:
            raise EmuError("cudaStreamWaitEvent across a capture boundary "
                           "(cudaErrorStreamCaptureIsolation)")
        src, seq = event.stream, event.seq
        self.enqueue(lambda: src.run_until(seq), "wait event")

    def event_synchronize(self, event: EmuEvent) -> None:
        self.refuse_in_capture("cudaEventSynchronize")
        self.counters["event_syncs"] += 1
        if event.stream is not None:
            event.stream.run_until(event.seq)

    def elapsed_ms(self, start, end) -> float:
        return 0.0

    # --- kernels ----------------------------------------------------------------------------

    def compile(self, path: str, source: str, options: tuple, index: int) -> EmuModule:
        return EmuModule(Path(path).stem)

    def kernel(self, module: EmuModule, name: str):
        return (module.family, name)

    def launch(self, kernel, grid, block, args) -> None:
        family, name = kernel
        emu.check_args(args)
        device = self.current_device()
        for a in args:
            if a.dtype != np.uint64 or not int(a):
                continue
            found = self.lookup(int(a))
            if found is None:
                raise EmuError(f"{name}: pointer {int(a):#x} is not device memory "
                               "(cudaErrorIllegalAddress)")
            if not found[1]:
                raise EmuError(f"{name}: pointer {int(a):#x} names freed device memory")
            if found[0] != device:
                raise EmuError(f"{name}: memory of device {found[0]} given to a launch on "
                               f"device {device} (cudaErrorIllegalAddress)")
        args = tuple(args)
        self.launches.append(name)
        self.enqueue(lambda: emu.run_kernel(family, name, grid, block, args), name)
