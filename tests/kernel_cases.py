"""Machinery shared by the ``tests/test_op_<family>.py`` modules: where an op runs (the NumPy
reference, the host emulation of the ``.cu``, CuPy), guarded buffers (canary bytes around every
array), byte comparisons, and random inputs (dtypes, head dims, misalignments, mappings)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st

from hcache.dtypes import DTYPE_NAMES, resolve_dtype

GUARD = 64
# Where the kernels run: the host emulation (forward order, 32-bit indices), the alternate
# emulation (reverse thread order, 64-bit index paths), CuPy on a GPU, and the asynchronous
# emulated device (tests/emu_device.py: device arrays, queued launches, the CUDA path).
BACKENDS = [pytest.param("emu", marks=pytest.mark.emu),
            pytest.param("emu-reverse", marks=pytest.mark.emu),
            pytest.param("cuda", marks=pytest.mark.gpu),
            pytest.param("emulated", marks=pytest.mark.emulated)]
# The NumPy reference (NumPy arrays, no backend) and the kernels: for checks that every path
# makes alike (argument checks, edge cases).
WITH_REFERENCE = [pytest.param("reference", id="reference"), *BACKENDS]


def kernel_env(kind):
    """``(array module, backend)`` for a BACKENDS / WITH_REFERENCE entry (skips without a host
    compiler); ``"reference"`` is ``(numpy, None)``."""
    if kind == "reference":
        return np, None
    if kind in ("emu", "emu-reverse"):   # not "emulated": that one is the device below
        import emu

        if not emu.have_compiler():
            pytest.skip("no host C++ compiler")
        alternate = kind == "emu-reverse"
        return np, emu.EmuLauncher(reverse=alternate, wide_index=alternate)
    from hcache import _cuda

    return _cuda.runtime().xp, None


HEAD_DIMS = (1, 3, 8, 36, 80, 96, 128, 512)
dtypes = st.sampled_from(DTYPE_NAMES).map(resolve_dtype)
misaligns = st.sampled_from([0, 0, 1, 2, 4, 8])


def on(xp, a):
    """Host array ``a`` on module ``xp`` (itself for NumPy)."""
    return a if xp is np else xp.asarray(a)


def int32_on(xp, values):
    """``values`` as an int32 array on module ``xp``."""
    return on(xp, np.asarray(values, np.int32))


class Arena:
    """Allocates arrays inside canary-filled byte buffers, at a chosen misalignment."""

    def __init__(self, rng: np.random.Generator, xp=np):
        self.rng = rng
        self.xp = xp
        self.buffers: list[tuple[object, np.ndarray, slice]] = []

    def array(self, shape, dtype, *, misalign=0, fill="random"):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        host = self.rng.integers(0, 256, GUARD + misalign + nbytes + GUARD, dtype=np.uint8)
        inner = slice(GUARD + misalign, GUARD + misalign + nbytes)
        if fill == "zeros":
            host[inner] = 0
        buf = self.xp.asarray(host) if self.xp is not np else host
        view = buf[inner].view(dtype).reshape(shape)
        self.buffers.append((buf, host.copy(), inner))
        return view

    def int32(self, values, shape=None):
        """A guarded int32 array holding ``values`` (reshaped to ``shape`` if given)."""
        host = np.asarray(values, np.int32)
        a = self.array(host.shape if shape is None else shape, np.int32)
        a[...] = on(self.xp, host.reshape(a.shape))
        return a

    def check_canaries(self):
        for buf, original, inner in self.buffers:
            now = buf.get() if hasattr(buf, "get") else buf
            assert np.array_equal(now[:inner.start], original[:inner.start]), "canary before"
            assert np.array_equal(now[inner.stop:], original[inner.stop:]), "canary after"


def twins(seed, xp):
    """Two arenas that produce identical bytes: one NumPy (for the reference), one on ``xp``."""
    return Arena(np.random.default_rng(seed), np), Arena(np.random.default_rng(seed), xp)


def as_bytes(a) -> np.ndarray:
    """The bytes of a NumPy or CuPy array, on the host, flat."""
    a = a.get() if hasattr(a, "get") else a
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def assert_same_bytes(a, b):
    assert np.array_equal(as_bytes(a), as_bytes(b))


@st.composite
def injective_mappings(draw, max_batch_max=8):
    """``(max_batch, old_batch, new_batch, mapping)``: mapping[old] in [0, new_batch) or -1,
    injective; monotone compacting ones (TensorRT-Edge-LLM's) and arbitrary ones."""
    max_batch = draw(st.integers(1, max_batch_max))
    old_batch = draw(st.integers(0, max_batch))
    keep = draw(st.lists(st.booleans(), min_size=old_batch, max_size=old_batch))
    kept = [i for i, k in enumerate(keep) if k]
    if draw(st.booleans()):  # monotone, onto [0, len(kept))
        new_batch = len(kept)
        targets = list(range(new_batch))
    else:
        new_batch = draw(st.integers(len(kept), max_batch))
        targets = draw(st.permutations(range(new_batch)))[:len(kept)]
    mapping = np.full(old_batch, -1, dtype=np.int32)
    mapping[kept] = targets
    return max_batch, old_batch, new_batch, mapping


@st.composite
def bad_mappings(draw):
    """A mapping that is not injective into [0, new_batch) (duplicate, too large, < -1)."""
    max_batch, old_batch, new_batch, mapping = draw(injective_mappings())
    if old_batch == 0:
        mapping = np.zeros(1, dtype=np.int32)
        old_batch = 1
        new_batch = 0
        return max_batch, old_batch, new_batch, mapping
    i = draw(st.integers(0, old_batch - 1))
    kind = draw(st.sampled_from(["big", "neg", "dup"]))
    mapping = mapping.copy()
    if kind == "dup" and old_batch >= 2 and new_batch >= 1:
        j = (i + draw(st.integers(1, old_batch - 1))) % old_batch
        mapping[i] = mapping[j] = draw(st.integers(0, new_batch - 1))
    elif kind == "neg":
        mapping[i] = draw(st.integers(-50, -2))
    else:
        mapping[i] = new_batch + draw(st.integers(0, 5))
    return max_batch, old_batch, new_batch, mapping
