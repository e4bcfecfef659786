"""Invalid values by kind of argument, and a snapshot of everything an object can reach.

A kind describes what a parameter accepts; ``bad_values(valid)`` is a fixed list of values that
the kind refuses whatever the object's state (a wrong type, an int out of the kind's range incl.
2**63 and 2**64, a bool, an entry out of range, a nested or ragged entry, a repeated entry where
entries must differ, a wrong shape or dtype, each refused array also behind ``__dlpack__`` only
and ``__array__`` only), built from the valid value of the call being perturbed: every one of
them is tried by the sweep. ``bad(valid)`` is the fuzzer's strategy: that list plus values drawn
at random where the space is large (any out-of-range int, a bad entry at any position).
``snapshot`` is the oracle of "nothing changed": every array's bytes, shape and dtype, every
container and every attribute of every object reachable from the root
(cycles followed once), so a new attribute cannot be forgotten.
"""

from __future__ import annotations

import enum
import threading
import types

import hypothesis.strategies as st
import numpy as np

# Values that are no int, no sequence of ints and no array, whatever a parameter expects.
JUNK = (1.5, float("nan"), "3", b"3", object(), 2 + 0j, {"a": 1})
SPECIAL_INTS = (-1, -(2**31) - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30)


class DLPackOnly:
    """A host array behind ``__dlpack__`` only (what a CuPy-less library hands out)."""

    def __init__(self, a):
        self._a = np.ascontiguousarray(a)

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (1, 0)   # kDLCPU

    def __repr__(self):
        return f"DLPackOnly({self._a.dtype} {self._a.shape})"


class ArrayOnly:
    """A host array behind ``__array__`` only (a lazily converted container)."""

    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        return self._a

    def __repr__(self):
        return f"ArrayOnly({self._a.dtype} {self._a.shape})"


def foreign(values):
    """Each refused array also behind either foreign protocol: foreign arrays are accepted
    (zero-copy), so their shape and dtype must be checked as a NumPy array's are."""
    out = []
    for v in values:
        out.append(v)
        if isinstance(v, np.ndarray):
            out += [DLPackOnly(v), ArrayOnly(v)]
    return out


class Kind:
    """What a parameter accepts; ``bad(valid)`` draws refused values. ``also``: other
    arguments a message may name instead, when the value is refused for disagreeing with them
    (a length that does not match another argument's)."""

    none_ok = False
    also: tuple = ()

    def relating(self, *names):
        self.also = names
        return self

    def bad_values(self, valid):
        raise NotImplementedError

    def bad(self, valid):
        return st.sampled_from(self.bad_values(valid))

    def _junk(self, *extra):
        return list(JUNK) + list(extra) + ([] if self.none_ok else [None])


class Int(Kind):
    """An int in ``[lo, hi]`` (``hi=None``: up to 2**63 - 1, the bound of every size and count
    in hcache); bools and floats are refused."""

    def __init__(self, lo=0, hi=None, *, none_ok=False):
        self.lo, self.hi, self.none_ok = lo, 2**63 - 1 if hi is None else hi, none_ok

    def out_of_range_values(self):
        """The bounds' neighbours and the special ints outside ``[lo, hi]``."""
        hi = self.hi
        values = [self.lo - 1] + ([] if hi is None else [hi + 1])
        return values + [v for v in SPECIAL_INTS if v not in values
                         and (v < self.lo or (hi is not None and v > hi))]

    def out_of_range(self):
        parts = [st.sampled_from(self.out_of_range_values()),
                 st.integers(max_value=self.lo - 1)]
        if self.hi is not None:
            parts.append(st.integers(min_value=self.hi + 1))
        return st.one_of(parts)

    def bad_values(self, valid):
        return (self._junk(True, False, [1], np.float64(1.0), np.array([1]))
                + self.out_of_range_values())

    def bad(self, valid):
        return st.one_of(st.sampled_from(self.bad_values(valid)), self.out_of_range())


class Index(Int):
    """An index in ``[0, size)``."""

    def __init__(self, size, *, none_ok=False):
        super().__init__(0, size - 1, none_ok=none_ok)


class Ints(Kind):
    """A 1-D sequence (list or array) of ints in ``[lo, hi]``: junk, bad entries (floats, bools,
    None, nested lists, out of range), float or bool arrays, 2-D arrays; ``length`` fixes the
    count (the valid value's) and ``unique`` forbids repeats."""

    def __init__(self, lo=0, hi=None, *, fixed_length=True, unique=False, none_ok=False,
                 nonempty=False, nested_ok=False, set_ok=False):
        self.entry = Int(lo, hi)
        self.set_ok = set_ok     # an order-free argument (a set of hashes to delete)
        self.nested_ok = nested_ok
        self.fixed_length, self.unique = fixed_length, unique
        self.none_ok, self.nonempty = none_ok, nonempty

    def _bad_entries(self):
        junk = [1.5, True, None, "1", object()] + ([] if self.nested_ok else [[0]])
        return junk + self.entry.out_of_range_values()

    def bad_values(self, valid):
        base = [int(x) for x in np.asarray(valid).ravel()]
        values = self._junk(7) + [np.float64(2.0)]
        if base:
            ends = sorted({0, len(base) - 1})     # each bad entry first and last
            values += [base[:j] + [e] + base[j + 1:] for e in self._bad_entries() for j in ends]
            arrays = [np.array(base, dtype=np.float64), np.array(base, dtype=np.bool_)]
            if not self.nested_ok:
                arrays.append(np.array(base, dtype=np.int64).reshape(-1, 1))
                values.append([[x] for x in base])
            values += foreign(arrays)
            # unordered containers: a set's own order and a mapping's keys are never the
            # entries the caller meant (issue 21 item 6)
            values += ([] if self.set_ok else [set(base), frozenset(base)]) + \
                [dict(enumerate(base))]
            if self.fixed_length:
                values.append(base + [base[0]])
            if self.unique and len(base) >= 2:
                values.append([base[0]] + base[:-1])
        if self.nonempty or (base and self.fixed_length):
            values.append([])
        return values

    def bad(self, valid):
        base = [int(x) for x in np.asarray(valid).ravel()]
        options = [st.sampled_from(self.bad_values(valid))]
        if base:
            entry = st.one_of(st.sampled_from(self._bad_entries()), self.entry.out_of_range())
            options.append(st.tuples(st.integers(0, len(base) - 1), entry).map(
                lambda je: base[:je[0]] + [je[1]] + base[je[0] + 1:]))
        return st.one_of(options)


class Array(Kind):
    """An array of the valid value's shape and dtype: junk, wrong dtypes, wrong shapes
    (``squeezable``: a leading axis of 1 may be dropped or added; ``free_last``: any extent
    of the last axis is valid)."""

    def __init__(self, *, bad_dtypes=(np.int32, np.float64), none_ok=False, squeezable=False,
                 free_last=False):
        self.bad_dtypes, self.none_ok, self.squeezable = bad_dtypes, none_ok, squeezable
        self.free_last = free_last

    def bad_values(self, valid):
        a = np.asarray(valid)
        options = [np.zeros(()), a.reshape(-1)[:-1] if a.size else np.zeros(1)]
        if not self.squeezable:
            options.append(a[None])
        if a.ndim and not self.free_last:
            options.append(a[..., :-1] if a.shape[-1] > 1 else np.concatenate([a, a], -1))
        if a.ndim >= 2 and not self.squeezable:
            options.append(a[0])
        options += [a.astype(dt) for dt in self.bad_dtypes if np.dtype(dt) != a.dtype]
        return self._junk() + foreign(options)


class Arrays(Kind):
    """A sequence of arrays (one per layer): junk, a wrong count, a bad entry."""

    def __init__(self, *, bad_dtypes=(np.int32, np.float64), none_ok=False, squeezable=False):
        self.item = Array(bad_dtypes=bad_dtypes, squeezable=squeezable)
        self.none_ok = none_ok

    def bad_values(self, valid):
        base = list(valid)
        values = self._junk(7) + [base[:-1], base + base[:1]]
        j = len(base) - 1                          # each refused array as the last entry
        return values + [base[:j] + [v] + base[j + 1:] for v in self.item.bad_values(base[j])]

    def bad(self, valid):
        base = list(valid)
        return st.one_of(st.sampled_from(self.bad_values(valid)),
                         st.tuples(st.integers(0, len(base) - 1), st.data()).map(
            lambda jd: base[:jd[0]] + [jd[1].draw(self.item.bad(base[jd[0]]))]
            + base[jd[0] + 1:]))


class Scale(Kind):
    """An FP8 scale: ``None``, a positive finite float, or a float32 array ``[L]`` /
    ``[L, >= H]``."""

    none_ok = True

    def bad_values(self, valid):
        return ["3", object(), [1.0], -1.0, 0.0, float("nan"), float("inf"), True,
                DeviceMemory(), *foreign([np.ones(7, np.float32), np.ones(2, np.float64),
                                          np.ones((2, 1, 1), np.float32)])]


class OnlyNone(Kind):
    """A scale of a write that does not quantize (a cache that is not FP8): only None."""

    none_ok = True

    def bad_values(self, valid):
        return [0.5, 1.0, "x", object(), np.ones(2, np.float32), True]


class Absent(Kind):
    """A part the object does not have: only None (the V of a latent MLA layer) or, with
    ``empty``, only an empty sequence (the states of a kind the layers lack); ``like`` is what
    the part would be if it existed, the first value refused."""

    def __init__(self, like, *, empty=False):
        self.like, self.empty = like, empty
        self.none_ok = not empty

    def bad_values(self, valid):
        values = [[self.like], 1.0, "x", object()]
        if not self.empty:
            values += [self.like, np.zeros(1, np.float16)]
        return values + self._junk()


class DeviceMemory:
    """An array that says its memory is a GPU's (the CUDA array interface), on a cpu device."""

    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False),
                                "version": 3}


class AnyArray(Kind):
    """An array of any shape and dtype (NumPy or any library with an array protocol): junk,
    a list, a tuple, and device memory where host memory is due."""

    def bad_values(self, valid):
        return self._junk([1, 2], (1,), DeviceMemory())


class Junk(Kind):
    """An optional argument whose valid values the case does not build (a device index array,
    a count): only values no such argument takes (a float, a string, a list, an object)."""

    def __init__(self, *, none_ok=True):
        self.none_ok = none_ok

    def bad_values(self, valid):
        return self._junk([0, 1], np.zeros(3, np.float32))


class Lengths(Kind):
    """Sequence lengths: an int >= 0 or an int array of them (host memory on a cpu device)."""

    def __init__(self, *, none_ok=False):
        self.none_ok = none_ok

    def bad_values(self, valid):
        return self._junk(True, [1.5], [True], ["1"], DeviceMemory(),
                          *foreign([np.ones(2, np.float32), np.ones(2, np.bool_)]),
                          -1, -(2**40), [2, -1], np.array([-3, 1], np.int32))


class Seconds(Kind):
    """None or a number of seconds >= 0."""

    none_ok = True

    def bad_values(self, valid):
        return ["1", True, -1.0, -1, object(), [1], float("nan")]


class Stream(Kind):
    """``None``, a CuPy stream, a handle in ``[0, 2**64)`` or an object with
    ``__cuda_stream__``."""

    none_ok = True

    def bad_values(self, valid):
        return ["s", 1.5, -1, -(2**63) - 1, 2**64, 10**30, True, False, object(), [0],
                np.float64(0.0)]


class Bool(Kind):
    def __init__(self, *, none_ok=False):
        self.none_ok = none_ok

    def bad_values(self, valid):
        return self._junk(1, 0, "yes", [True])


class Choice(Kind):
    """One of a few strings."""

    def __init__(self, *, none_ok=False):
        self.none_ok = none_ok

    def bad_values(self, valid):
        return self._junk(1, "bogus", "")


class Key(Kind):
    """A hashable id that must be known (an active request, a live sequence)."""

    def __init__(self, unknown=("nope", 12345)):
        self.unknown = unknown

    def bad_values(self, valid):
        return [[1], {"a": 1}, {1}, *self.unknown]


class Keys(Kind):
    """A sequence of known hashable ids, distinct when ``unique``."""

    def __init__(self, *, unique=True, unknown="nope", nonempty=False):
        self.unique, self.unknown, self.nonempty = unique, unknown, nonempty

    def bad_values(self, valid):
        base = list(valid)
        options = [None, 7, 1.5, object(), [[1]], [{}], base + [self.unknown]]
        if self.unique and base:
            options.append(base + base[:1])
        if self.nonempty:
            options.append([])
        return options


class Salt(Kind):
    """A prefix-cache salt: None, bytes or str."""

    none_ok = True

    def bad_values(self, valid):
        return [1, 0, True, 1.5, object(), [b"a"], ["a"], (b"a",), {"a": 1}, np.int64(1),
                np.array([1], np.uint8), memoryview(b"a")]


class BlockKeys(Kind):
    """Extra keys by block: None or a mapping of a block index in ``[0, blocks)`` to bytes,
    str or a list of them."""

    none_ok = True

    def __init__(self, blocks):
        self.blocks = blocks

    def bad_values(self, valid):
        n = self.blocks
        return [1, "0", b"x", [b"x"], (b"x",), object(), {n: b"x"}, {-1: b"x"},
                {2**64: b"x"}, {"0": b"x"}, {True: b"x"}, {1.5: b"x"}, {None: b"x"},
                {0: 1}, {0: None}, {0: {b"x"}}, {0: [b"x", 2]}, {0: [[b"x"]]},
                {0: b"x", n: b"y"}]


class Instance(Kind):
    """An object of one class."""

    def __init__(self, *, none_ok=False):
        self.none_ok = none_ok

    def bad_values(self, valid):
        return self._junk(1, [1], type(valid))


class Callable(Kind):
    def bad_values(self, valid):
        return self._junk(1, [1])


class Fixed:
    """A parameter the fuzzer does not perturb, with the reason; ``label``: the parameter is
    the name the messages use for the checked argument (``resolve_dtype(x, name)``)."""

    def __init__(self, reason, *, label=False):
        self.reason, self.label = reason, label


# --- state ---------------------------------------------------------------------------------

# Derived caches and scratch, recomputed from the state they summarise (a memo of the last
# batch's rows, a stale flag with its value, the marks of a duplicate check).
MEMO = frozenset({"_headroom", "_headroom_stale", "_seen", "_row_mark", "_last_ids",
                  "_last_rows", "_last_version", "_last_lookup"})

_OPAQUE = (type(threading.Lock()), type(threading.RLock()), threading.Condition,
           threading.Event, types.ModuleType, type)


def snapshot(root):
    """A comparable image of everything reachable from ``root``."""
    seen: dict[int, int] = {}
    keep = []                       # ids stay unique while the walk holds the objects

    def walk(x):
        if x is None or isinstance(x, (bool, int, str, bytes, enum.Enum)):
            return x
        if isinstance(x, (float, complex, np.generic)):
            return ("scalar", type(x).__name__, repr(x))
        if isinstance(x, _OPAQUE):
            return ("opaque", type(x).__name__, getattr(x, "__name__", ""))
        if isinstance(x, (types.FunctionType, types.BuiltinFunctionType)):
            return ("fn", getattr(x, "__qualname__", repr(x)))
        if id(x) in seen:
            return ("ref", seen[id(x)])
        seen[id(x)] = len(seen)
        keep.append(x)
        if isinstance(x, np.ndarray):
            return ("nd", x.dtype.str, x.shape, np.ascontiguousarray(x).tobytes())
        if isinstance(x, memoryview):       # (a view of an array: its contents)
            return ("mv", x.format, x.shape, x.tobytes())
        if hasattr(x, "__cuda_array_interface__") and hasattr(x, "get"):
            h = x.get()
            return ("nd", h.dtype.str, h.shape, np.ascontiguousarray(h).tobytes())
        if isinstance(x, types.MethodType):
            return ("method", x.__func__.__qualname__, walk(x.__self__))
        if isinstance(x, dict):
            return ("dict", [(walk(k), walk(v)) for k, v in x.items()])
        if isinstance(x, (list, tuple)) or type(x).__name__ == "deque":
            return (type(x).__name__, [walk(v) for v in x])
        if isinstance(x, (set, frozenset)):
            return ("set", sorted(repr(walk(v)) for v in x))
        if isinstance(x, np.dtype):
            return ("dtype", x.str, x.name)
        state = {}
        if hasattr(x, "__dict__"):
            state.update(vars(x))
        for cls in type(x).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if hasattr(x, name) and name not in ("__dict__", "__weakref__"):
                    state[name] = getattr(x, name)
        if not state:
            return ("repr", type(x).__name__, repr(x))
        return ("obj", type(x).__qualname__,
                [(k, walk(v)) for k, v in sorted(state.items()) if k not in MEMO])

    return walk(root)


def first_difference(a, b, path="root"):
    """Where two snapshots differ (a readable path), or None."""
    if type(a) is not type(b):
        return path
    if isinstance(a, tuple) and a and a[0] == "obj" and b[0] == "obj":
        da, db = dict(a[2]), dict(b[2])
        for k in sorted(set(da) | set(db)):
            if k not in da or k not in db:
                return f"{path}.{k}"
            d = first_difference(da[k], db[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return path
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else path
