"""Zero-copy JAX access to hcache's caches, for every cache dtype (README "hcache in a jitted
decode step"). JAX is optional: this module imports it on use.

A cache's memory is imported once, in its *storage* dtype (the dtype DLPack carries: the cache
dtype itself, or ``uint16`` / ``uint8`` for bfloat16 and the FP8 types), with
:func:`storage_array`. The jitted step takes that array **as an argument** and reinterprets it
inside with :func:`as_cache_dtype` (``lax.bitcast_convert_type``: no copy inside XLA). Both
halves matter:

- ``jax_array.view(jnp.bfloat16)`` outside ``jit`` materialises a new array (a copy): a write by
  hcache after it is not seen;
- a JAX array captured in a ``jit`` closure becomes a constant of the compiled step: frozen at
  trace time.

An argument is read when the step runs, so every write hcache made before the call is seen.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import dlpack_view, resolve_dtype

__all__ = ["storage_array", "as_cache_dtype", "cache_dtype"]


def _jax():
    import jax  # optional dependency: ``pip install hcache[jax]``
    import jax.numpy as jnp
    return jax, jnp


def cache_dtype(dtype):
    """The JAX dtype of an hcache cache dtype (a name or a NumPy / ml_dtypes dtype):
    ``float32``, ``float16``, ``bfloat16``, ``float8_e4m3fn``, ``float8_e5m2``, ``int8``,
    ``uint8``. Raises ``ValueError`` / ``TypeError`` for anything else."""
    _, jnp = _jax()
    return jnp.dtype(resolve_dtype(dtype, "dtype").name)


def storage_array(view):
    """A JAX array over the memory of an hcache array (a cache, a state, the lengths), no
    copy, in its storage dtype.

    Parameters
    ----------
    view : numpy.ndarray or cupy.ndarray
        A view hcache hands out (``get_combined_kv_cache``, ``get_recurrent_state``,
        ``kv_pool.layers[l]``, ...): allocated 64-byte aligned, so JAX's CPU import does not
        copy it; on cuda the import is DLPack's, ordered on the current stream.

    Returns
    -------
    jax.Array
        Same shape; dtype the cache dtype, or ``uint16`` (bfloat16) / ``uint8`` (FP8). Pass it
        to a jitted function and call :func:`as_cache_dtype` there.

    Raises
    ------
    TypeError
        ``view`` is not a NumPy or CuPy array.
    """
    jax, _ = _jax()
    return jax.dlpack.from_dlpack(dlpack_view(view))


def as_cache_dtype(storage, dtype):
    """``storage`` (from :func:`storage_array`) as the cache dtype: itself when the dtypes
    agree, else ``lax.bitcast_convert_type`` (same itemsize, same shape). Inside ``jit`` this
    is a free reinterpretation of the argument's buffer; outside it makes a new array (a
    snapshot), which is fine for reading once but is not a live view.

    Raises
    ------
    ValueError
        ``dtype`` is not a cache dtype, or its itemsize differs from the storage's.
    """
    jax, jnp = _jax()
    want = cache_dtype(dtype)
    have = jnp.dtype(storage.dtype)
    if have == want:
        return storage
    if have.itemsize != want.itemsize:
        raise ValueError(f"dtype: expected a dtype of {have.itemsize} bytes (the storage's "
                         f"{have}), got {want} ({np.dtype(want).itemsize} bytes)")
    return jax.lax.bitcast_convert_type(storage, want)
