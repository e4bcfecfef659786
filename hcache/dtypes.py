"""The seven cache dtypes of docs/design.md §2 and their NumPy / ml_dtypes equivalents.

Every copy, compaction, capture and restore moves bytes, so only ``itemsize`` matters to the
kernels; the dtype is kept so that views handed to a runtime carry the right element type.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from .runtime.device import array_module_of

__all__ = ["DTYPE_NAMES", "resolve_dtype", "dtype_name", "storage_dtype", "is_fp8", "fp8_max",
           "fp8_scales", "dlpack_view"]

_BY_NAME: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
            "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}

DTYPE_NAMES: tuple[str, ...] = tuple(_BY_NAME)
_UINT_OF_SIZE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def resolve_dtype(dtype, name: str = "dtype") -> np.dtype:
    """Return the NumPy dtype for one of the seven supported cache dtypes.

    Parameters
    ----------
    dtype : str or numpy.dtype or type
        A name of docs/design.md §2 (``"float16"``, ``"bfloat16"``, ...; short aliases such as
        ``"fp16"``
        and ``"bf16"`` are accepted) or an equivalent NumPy / ml_dtypes dtype.
    name : str
        The argument name used in error messages.

    Raises
    ------
    TypeError
        ``dtype`` is neither a string nor a dtype-like object.
    ValueError
        ``dtype`` is not one of the seven supported dtypes.
    """
    if isinstance(dtype, str):
        key = _ALIASES.get(dtype.lower(), dtype.lower())
        if key not in _BY_NAME:
            raise ValueError(f"{name}: expected one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
        return _BY_NAME[key]
    try:
        if dtype is None:  # np.dtype(None) is float64
            raise TypeError
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}: expected a dtype name or dtype, got {type(dtype).__name__}") \
            from None
    if dt not in _BY_NAME.values():
        raise ValueError(f"{name}: expected one of {', '.join(DTYPE_NAMES)}, got {dt}")
    return dt


def dtype_name(dtype) -> str:
    """The docs/design.md §2 name of a supported dtype (``np.float16`` → ``"float16"``)."""
    dt = resolve_dtype(dtype)
    return next(k for k, v in _BY_NAME.items() if v == dt)


def storage_dtype(dtype, xp) -> np.dtype:
    """The dtype an array module can allocate for ``dtype``.

    NumPy holds all seven. CuPy may not know the ml_dtypes float8 types; for those the bytes are
    stored as an unsigned integer of the same size (the kernels only move bytes), and views are
    reinterpreted with ``.view(dtype)`` where the array module allows it.
    """
    dt = resolve_dtype(dtype)
    if xp is np:
        return dt
    return dt if _module_handles(xp, dt.name) else _UINT_OF_SIZE[dt.itemsize]


_NO_DLPACK = frozenset(_BY_NAME[n] for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2"))


def dlpack_view(array):
    """``array`` in a dtype that DLPack carries: the array itself, or for bfloat16 and float8
    (ml_dtypes types that NumPy cannot export through DLPack) a view of the same memory as
    the unsigned integer of its size, its storage type (``uint16`` / ``uint8``). No copy
    either way; the importer views the bytes back as the cache dtype. JAX: a ``.view`` outside
    ``jit`` copies, so use :mod:`hcache.interop.jax` (import with ``storage_array``, pass the
    array into the jitted step, reinterpret there with ``as_cache_dtype``).

    Parameters
    ----------
    array : numpy.ndarray or cupy.ndarray
        A cache view of any dtype (a CuPy cache stored as its storage dtype is returned as it
        is).

    Raises
    ------
    TypeError
        ``array`` is not an array (no ``dtype`` and ``view``).
    """
    if not (hasattr(array, "dtype") and hasattr(array, "view")):
        raise TypeError(f"array: expected a numpy or cupy array, got {type(array).__name__}")
    dt = np.dtype(array.dtype)
    return array.view(_UINT_OF_SIZE[dt.itemsize]) if dt in _NO_DLPACK else array


@functools.cache
def _module_handles(xp, name: str) -> bool:
    """Whether ``xp`` runs the ops the managers use on ``name`` arrays: a zero fill, a slice
    copy and a byte view. Some CuPy versions accept float8 dtypes at allocation but fail in
    their first kernel, so allocation alone is not proof. A CUDA error (no GPU) propagates."""
    try:
        a = xp.zeros((2,), dtype=np.dtype(name))
        a[1:] = a[:1]
        a.copy().view(np.uint8)
        return True
    except Exception as exc:  # noqa: BLE001 - CuPy raises compile errors as well as TypeErrors
        if type(exc).__name__ == "CUDARuntimeError":
            raise
        return False


_FP8 = (_BY_NAME["float8_e4m3fn"], _BY_NAME["float8_e5m2"])


def is_fp8(dtype) -> bool:
    """True for ``float8_e4m3fn`` and ``float8_e5m2`` (by name or dtype)."""
    return resolve_dtype(dtype) in _FP8


def fp8_max(dtype="float8_e4m3fn") -> float:
    """The largest finite value of an FP8 format: 448.0 (e4m3fn) or 57344.0 (e5m2).

    Raises
    ------
    ValueError
        ``dtype`` is not an FP8 dtype.
    """
    dt = resolve_dtype(dtype)
    if dt not in _FP8:
        raise ValueError(f"dtype: expected float8_e4m3fn or float8_e5m2, got {dt}")
    return float(ml_dtypes.finfo(dt).max)


def fp8_scales(amax, dtype="float8_e4m3fn"):
    """Quantization scales from observed absolute maxima: ``amax / fp8_max(dtype)``.

    With this scale the largest observed magnitude maps to the format's largest finite value
    (docs/design.md §3.7): pass it as ``k_scale`` / ``v_scale`` of a quantizing ``write_kv``
    (and dequantize as ``q * scale``).

    Parameters
    ----------
    amax : float, or a float array of any shape (NumPy or CuPy)
        Absolute maxima of K or V, e.g. per layer ``[L]`` or per layer and head ``[L, H]``.
    dtype : str or dtype
        The FP8 format.

    Returns
    -------
    float, or float32 array of ``amax``'s shape and array module
        A **new** array for array input. An ``amax`` of 0 gives the scale 1.0 (any scale
        represents zeros exactly), so the result is always > 0 for finite ``amax >= 0``.

    Raises
    ------
    ValueError
        ``dtype`` is not FP8, or a host ``amax`` is negative or not finite (device arrays are
        not read back: their values are the caller's to check).
    """
    fmax = fp8_max(dtype)
    if isinstance(amax, (int, float, np.integer, np.floating)) and not isinstance(amax, bool):
        value = float(amax)
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"amax: expected a finite value >= 0, got {amax}")
        return value / fmax if value > 0 else 1.0
    if isinstance(amax, np.ndarray):
        a = np.asarray(amax, dtype=np.float32)
        if not (np.isfinite(a).all() and (a >= 0).all()):
            raise ValueError("amax: expected finite values >= 0, got a negative or non-finite "
                             "one")
        return np.where(a > 0, a / np.float32(fmax), np.float32(1)).astype(np.float32)
    xp = array_module_of(amax)
    if xp is np:
        raise TypeError(f"amax: expected a float or a float array, got {type(amax).__name__}")
    a = amax.astype(np.float32)
    return xp.where(a > 0, a / np.float32(fmax), np.float32(1)).astype(np.float32)
