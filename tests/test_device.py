"""Device selection, dtypes and streams (docs/design.md §2), against hand-written expectations.
The descriptor tables the kernels read are tested in ``test_op_tables.py``."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hcache import DTYPE_NAMES, dtype_name, resolve_device, resolve_dtype
from hcache.device import Device, cupy_available, stream_handle
from hcache.dtypes import storage_dtype


def test_cpu_device_and_env_override(monkeypatch):
    """``"cpu"`` resolves to the NumPy device; ``$HCACHE_DEVICE`` overrides ``None``, else
    CuPy's availability decides."""
    assert resolve_device("cpu") == Device("cpu")
    assert resolve_device("CPU").xp is np
    monkeypatch.setenv("HCACHE_DEVICE", "cpu")
    assert resolve_device(None).kind == "cpu"
    monkeypatch.delenv("HCACHE_DEVICE")
    want = "cuda" if cupy_available() else "cpu"
    assert resolve_device(None).kind == want


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cuda:-1", "tpu:0", ""])
def test_malformed_device_strings(bad):
    """Malformed device strings are ValueErrors with the expected forms."""
    with pytest.raises(ValueError, match="device: expected"):
        resolve_device(bad)


def test_device_type_errors():
    """A non-string device is a TypeError."""
    with pytest.raises(TypeError, match="device: expected None, 'cpu'"):
        resolve_device(0)


@pytest.mark.skipif(cupy_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_is_a_clear_error():
    """Without a GPU ``"cuda:0"`` is a ValueError that says no usable CUDA device exists."""
    with pytest.raises(ValueError, match="device: expected a usable CUDA device"):
        resolve_device("cuda:0")


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_every_supported_dtype_round_trips(name):
    """Every supported dtype name resolves, names itself back and is its own NumPy storage
    dtype."""
    dt = resolve_dtype(name)
    assert dtype_name(dt) == name
    assert resolve_dtype(dt) == dt
    assert storage_dtype(name, np) == dt


def test_dtype_aliases_and_ml_dtypes():
    """Aliases (bf16, FP16) and ml_dtypes types resolve to the expected dtypes."""
    assert resolve_dtype("bf16") == np.dtype(ml_dtypes.bfloat16)
    assert resolve_dtype(ml_dtypes.float8_e5m2).itemsize == 1
    assert resolve_dtype("FP16") == np.float16


@pytest.mark.parametrize("bad,exc", [("float64", ValueError), (np.int64, ValueError),
                                     (3.5, TypeError), ("fp4", ValueError)])
def test_unsupported_dtypes(bad, exc):
    """Unsupported dtypes are ValueErrors, non-dtypes TypeErrors."""
    with pytest.raises(exc, match="dtype: expected"):
        resolve_dtype(bad)


class _Proto:
    def __cuda_stream__(self):
        return (0, 1234)


def test_stream_normalisation():
    """Streams normalise to raw handles (int, NumPy int, __cuda_stream__); bad ones raise."""
    assert stream_handle(77) == 77
    assert stream_handle(np.int64(5)) == 5
    assert stream_handle(_Proto()) == 1234
    if not cupy_available():
        assert stream_handle(None) == 0
    assert stream_handle(2**64 - 1) == 2**64 - 1
    for bad in (-1, 2**64, 2**70):
        with pytest.raises(ValueError, match=r"stream: expected a cudaStream_t handle in \[0, "):
            stream_handle(bad)
    with pytest.raises(TypeError, match="stream: expected None"):
        stream_handle("default")
    with pytest.raises(TypeError, match="stream: expected None"):
        stream_handle(True)


@pytest.mark.parametrize("bad", ["cuda:", "cuda:\u00b2", "cuda:\u0661"])
def test_malformed_cuda_ordinals_are_refused_as_malformed(bad):
    """``"cuda:"`` and non-ASCII digits are refused with the malformed-device message."""
    # "cuda:" (no ordinal) and non-ASCII digits ("²" made int() fail with its own message,
    # Arabic-Indic "١" was read as device 1) are not "cuda:N".
    with pytest.raises(ValueError, match="device: expected None, 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device(bad)


def test_none_is_not_a_dtype():
    """resolve_dtype(None) is a TypeError naming NoneType (np.dtype(None) would be float64)."""
    with pytest.raises(TypeError, match="dtype: expected a dtype name or dtype, got NoneType"):
        resolve_dtype(None)


def test_storage_dtype_never_hides_a_device_error():
    """Without a usable GPU storage_dtype on CuPy raises, rather than answering uint32 for
    float32; with one it answers float32."""
    # Without a usable GPU every CuPy allocation fails; storage_dtype used to read that as
    # "dtype unsupported" and answer uint32 for float32.
    cupy = pytest.importorskip("cupy")
    if cupy_available():
        assert storage_dtype("float32", cupy) == np.float32
    else:
        with pytest.raises(RuntimeError):
            storage_dtype("float32", cupy)


@pytest.mark.gpu
def test_foreign_stream_handles_wrap_without_deprecation_warnings():
    """CuPy 14 deprecates ``ExternalStream`` (a warning per op): a raw handle is wrapped once
    through ``Stream.from_external`` and reused."""
    import warnings

    import cupy

    from hcache.device import launch_scope

    device = resolve_device("cuda")
    raw = cupy.cuda.Stream(non_blocking=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for _ in range(2):
            with launch_scope(device, raw.ptr):
                assert cupy.cuda.get_current_stream().ptr == raw.ptr
