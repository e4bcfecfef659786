"""Device arrays of the emulated device (tests/emu_device.py) and their array module.

An :class:`EmuArray` is a view of an emulated allocation. Metadata (shape, dtype, strides,
slices, reshapes, dtype views) is host-side and immediate; writes (``a[...] = x``, ``fill``,
``copy``, ``astype``, the ``zeros``/``ones``/``full`` of :class:`EmuXP`) are queued on the
current stream like CuPy's; reads go through the runtime's synchronizing ``to_host``
(``a.get()``).

Anything else a test does with device arrays (arithmetic, comparisons, ``tolist()``, NumPy
functions) is a *test-side* convenience: it synchronizes the current stream and computes on
the host, as a CuPy op followed by a read would. Called from inside ``hcache`` it raises
:class:`~emu_device.EmuError` instead: the package must not compute on device arrays outside
its kernels (a hidden round trip through the host).
"""

from __future__ import annotations

import bisect
import ctypes
import operator
import sys

import numpy as np


def _error(msg):
    from emu_device import EmuError

    return EmuError(msg)


def _from_package() -> str | None:
    """The ``hcache`` module that called into this file, if the nearest caller outside the
    emulation is one."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name not in ("emu_array", "emu_device", "numpy", "contextlib") \
                and not name.startswith("numpy."):
            consumer = name.startswith(("hcache.demo", "hcache.bench"))   # a runtime's role
            return name if name.startswith("hcache") and not consumer else None
        frame = frame.f_back
    return None


def _test_only(what: str) -> None:
    caller = _from_package()
    if caller is not None:
        raise _error(f"{caller}: {what} on device memory outside a kernel (a host round trip "
                     "that a GPU would pay for, or a CuPy op the boundary does not own)")


def _basic(key) -> bool:
    items = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (slice, int, np.integer))
               and not isinstance(k, bool) for k in items)


class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class _Dev:
    def __init__(self, index):
        self.id = index


class EmuArray:
    """A device array of the emulated device."""

    __array_priority__ = 100

    def __init__(self, rt, alloc, view: np.ndarray, root=None):
        self._rt, self._alloc, self._v, self._root = rt, alloc, view, root

    @property
    def base(self):
        """The array this one views (``None`` for an array that owns its allocation)."""
        return self._root

    # --- metadata ---------------------------------------------------------------------------
    shape = property(lambda self: self._v.shape)
    dtype = property(lambda self: self._v.dtype)
    ndim = property(lambda self: self._v.ndim)
    size = property(lambda self: self._v.size)
    nbytes = property(lambda self: self._v.nbytes)
    itemsize = property(lambda self: self._v.itemsize)
    strides = property(lambda self: self._v.strides)
    flags = property(lambda self: self._v.flags)
    device = property(lambda self: _Dev(self._alloc.device))
    data = property(lambda self: _Ptr(self.address))

    @property
    def address(self) -> int:
        """The device address of the first element: 0 for an array of a zero-byte allocation
        (CuPy's null pointer), whatever view of it this is."""
        return 0 if self._alloc.null else int(self._v.ctypes.data)

    def __len__(self):
        return len(self._v)

    def __repr__(self):
        return f"EmuArray(device={self._alloc.device}, shape={self.shape}, dtype={self.dtype})"

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self.address, False), "strides": self.strides,
                "stream": None}

    def __dlpack_device__(self):
        return (2, self._alloc.device)   # kDLCUDA

    def __dlpack__(self, stream=None, **kwargs):
        """An :class:`EmuCapsule` of this array; a consumer ``stream`` (a handle; 1: the legacy
        default stream) is ordered after this device's current stream, as CuPy's export does."""
        rt, device = self._rt, self._alloc.device
        if stream is not None and stream != -1:
            with rt.lock, rt.device_scope(device):
                event = rt.event()
                rt.record(event)
                consumer = rt.defaults[device] if stream in (1, 2) else \
                    rt.stream_scope(stream, stream, device)
                if consumer is not rt.current():
                    with consumer:
                        rt.wait(event)
        return EmuCapsule(self)

    def _wrap(self, view):
        return EmuArray(self._rt, self._alloc, view, self if self._root is None else self._root)

    def _is_view(self, view) -> bool:
        p = view.ctypes.data
        return self._alloc.ptr <= p <= self._alloc.ptr + self._alloc.nbytes

    def __getitem__(self, key):
        if not _basic(key):
            return self._eager("__getitem__", key)
        items = key if isinstance(key, tuple) else (key,)
        if Ellipsis not in items:
            items = items + (Ellipsis,)
        return self._wrap(self._v[items])

    def reshape(self, *shape, **kw):
        view = self._v.reshape(*shape, **kw)
        if not self._is_view(view):
            return self._eager("reshape", *shape, **kw)
        return self._wrap(view)

    def ravel(self):
        return self.reshape(-1)

    def view(self, dtype):
        return self._wrap(self._v.view(dtype))

    @property
    def T(self):
        return self._wrap(self._v.T)

    def get(self, stream=None):
        return self._rt.to_host(self)

    # --- queued writes ----------------------------------------------------------------------

    def __setitem__(self, key, value):
        target = self[key] if _basic(key) else None
        if target is None:
            _test_only("fancy-index assignment")
            host = self._host_now()
            host[_unwrap((key,))[0]] = value.get() if isinstance(value, EmuArray) else value
            return self._rt.xp.write_now(self, host)
        target._assign(value)

    def _assign(self, value):
        out = self._v
        if isinstance(value, EmuArray):
            src = value._v
            self._rt.enqueue(lambda: np.copyto(out, src, casting="unsafe"), "memcpy DtoD")
        elif isinstance(value, np.ndarray):
            self._rt.refuse_in_capture("a pageable host copy")
            self._rt.counters["pageable_copies"] += 1
            data = np.array(value)
            self._rt.enqueue(lambda: np.copyto(out, data, casting="unsafe"), "memcpy HtoD")
        else:
            scalar = np.asarray(value).astype(out.dtype)
            self._rt.enqueue(lambda: out.fill(scalar), "memset")

    def fill(self, value):
        self._assign(value)

    def copy(self, order="C"):
        out = self._rt.xp.empty(self.shape, self.dtype)
        out._assign(self)
        return out

    def astype(self, dtype, copy=True):
        if np.dtype(dtype) == self.dtype and not copy:
            return self
        out = self._rt.xp.empty(self.shape, dtype)
        out._assign(self)
        return out

    # --- test-side conveniences -------------------------------------------------------------

    def _host_now(self) -> np.ndarray:
        return self._rt.to_host(self)

    def _eager(self, name, *args, **kw):
        _test_only(name)
        result = getattr(self._host_now(), name)(*_unwrap(args), **_unwrap_kw(kw))
        return self._rt.xp.wrap_now(result)

    def __array__(self, dtype=None, copy=None):
        # CuPy refuses implicit conversion, in tests too: a test that reads a device array
        # with np.array / np.asarray instead of .get() (helpers.host) fails on a GPU.
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __getattr__(self, name):
        if name.startswith("_") or not hasattr(np.ndarray, name):
            raise AttributeError(name)
        if not callable(getattr(np.ndarray, name)):
            _test_only(name)
            return self._rt.xp.wrap_now(getattr(self._host_now(), name))
        return lambda *a, **k: self._eager(name, *a, **k)

    def __iter__(self):
        _test_only("iteration")
        return iter(self._rt.xp.wrap_now(x) for x in self._host_now())

    def __bool__(self):
        _test_only("bool()")
        return bool(self._host_now())

    def __int__(self):
        _test_only("int()")
        return int(self._host_now())

    def __float__(self):
        _test_only("float()")
        return float(self._host_now())

    def __index__(self):
        _test_only("index()")
        return operator.index(self._host_now())


def _unwrap(args):
    """Host values of ``args``: device arrays read back, index tuples of them too."""
    return tuple(a._host_now() if isinstance(a, EmuArray)
                 else _unwrap(a) if isinstance(a, tuple) else a for a in args)


def _unwrap_kw(kw):
    return {k: (v._host_now() if isinstance(v, EmuArray) else v) for k, v in kw.items()}


def _binary(name):
    def op(self, *args):
        _test_only(name)
        return self._rt.xp.wrap_now(getattr(self._host_now(), name)(*_unwrap(args)))
    op.__name__ = name
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
              "lshift", "rshift", "radd", "rsub", "rmul", "rtruediv", "rfloordiv", "rmod",
              "rand", "ror", "rxor", "eq", "ne", "lt", "le", "gt", "ge", "neg", "pos",
              "invert", "abs", "iadd", "isub", "imul"):
    setattr(EmuArray, f"__{_name}__", _binary(f"__{_name}__"))
EmuArray.__hash__ = None


def _inplace(name):
    def op(self, other):
        _test_only(name)
        host = getattr(self._host_now(), name)(*_unwrap((other,)))
        self._assign(host)
        return self
    return op


for _name in ("iadd", "isub", "imul"):
    setattr(EmuArray, f"__{_name}__", _inplace(f"__{_name}__"))


class EmuXP:
    """The array module of the emulated device (what ``cupy`` is to a GPU)."""

    __name__ = "emulated_cupy"
    ndarray = EmuArray

    def __init__(self, rt):
        self._rt = rt

    def empty(self, shape, dtype=np.float64, order="C"):
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        alloc = self._rt.allocate(nbytes)
        view = alloc.buf[:nbytes].view(dtype).reshape(shape)
        return EmuArray(self._rt, alloc, view)

    def full(self, shape, fill_value, dtype=None, order="C"):
        out = self.empty(shape, np.asarray(fill_value).dtype if dtype is None else dtype)
        out.fill(fill_value)
        return out

    def zeros(self, shape, dtype=np.float64, order="C"):
        return self.full(shape, 0, dtype)

    def ones(self, shape, dtype=np.float64, order="C"):
        return self.full(shape, 1, dtype)

    def zeros_like(self, a, dtype=None):
        return self.zeros(a.shape, a.dtype if dtype is None else dtype)

    def empty_like(self, a, dtype=None):
        return self.empty(a.shape, a.dtype if dtype is None else dtype)

    def asarray(self, a, dtype=None):
        """A device array as it is; a ``__cuda_array_interface__`` object viewed as CuPy does
        (**synchronizing** the producer's ``stream`` when it names one); host data copied
        from pageable memory."""
        if isinstance(a, EmuArray):
            return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
        if hasattr(a, "__cuda_array_interface__"):
            stream = a.__cuda_array_interface__.get("stream")
            if stream:   # CuPy's default: synchronize the producer's stream
                rt = self._rt
                rt.refuse_in_capture("cudaStreamSynchronize (cupy.asarray of a stream-ordered "
                                     "__cuda_array_interface__)")
                rt.counters["syncs"] += 1
                target = rt.defaults[rt.current_device()] if stream == 2 else \
                    rt.stream_scope(stream, stream, rt.current_device())
                target.run_until(target.enqueued)
            return self.view_interface(a)
        host = np.asarray(a, dtype=dtype)
        out = self.empty(host.shape, host.dtype)
        out._assign(host)
        return out

    array = asarray

    def view_interface(self, obj):
        """A view of emulated memory described by ``obj.__cuda_array_interface__`` (no sync)."""
        iface = obj.__cuda_array_interface__
        ptr, dtype = int(iface["data"][0]), np.dtype(iface["typestr"])
        shape = tuple(iface["shape"])
        strides = iface.get("strides") or np.empty(shape, dtype).strides
        rt = self._rt
        if ptr == 0 and 0 in shape:
            return self.empty(shape, dtype)   # CuPy's zero-size arrays have no memory
        i = bisect.bisect(rt._starts, ptr) - 1
        if i < 0 or ptr >= rt._ranges[rt._starts[i]][0]:
            raise _error(f"__cuda_array_interface__: {ptr:#x} is not emulated device memory")
        start = rt._starts[i]
        alloc = _Borrowed(rt._ranges[start], start, obj)
        base = np.ctypeslib.as_array((ctypes.c_uint8 * alloc.nbytes).from_address(start))
        view = np.ndarray(shape, dtype, buffer=base, offset=ptr - start, strides=strides)
        return EmuArray(rt, alloc, view)

    def write_now(self, dst: EmuArray, host: np.ndarray):
        """Test side: write ``host`` into ``dst`` after a sync (used by eager assignments)."""
        dst._v[...] = host

    def wrap_now(self, result):
        """Test side: a host result as a new device array (written at once), scalars as they
        are."""
        if not isinstance(result, np.ndarray):
            return result
        out = self.empty(result.shape, result.dtype)
        out._v[...] = result
        return out

    def __getattr__(self, name):
        attr = getattr(np, name)
        if isinstance(attr, type) or not callable(attr):
            return attr

        def eager(*args, **kw):
            _test_only(f"{self.__name__}.{name}")
            return self.wrap_now(attr(*_unwrap(args), **_unwrap_kw(kw)))
        return eager


class _Borrowed:
    """The allocation a ``__cuda_array_interface__`` view points into (kept alive by ``owner``)."""

    def __init__(self, entry, start, owner):
        self.nbytes, self.device, self.ptr, self.owner = entry[0] - start, entry[1], start, owner
        self.null = False


class EmuCapsule:
    """What an emulated array's ``__dlpack__`` hands out (a DLPack capsule stands for this)."""

    def __init__(self, array):
        self.array = array
