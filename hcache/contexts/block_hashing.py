"""Chained SHA-256 hashes of the complete blocks of a token sequence (docs/design.md §6).

``digest_k = sha256(digest_{k-1} || tokens of block k as little-endian int64)`` with
``digest_{-1}`` = 32 zero bytes, and ``hash_k = uint64_le(digest_k[:8]) mod (2^63 - 1) + 1``:
a positive int64, so -1 ("unregistered") and 0 ("no parent") never collide with a hash. Because
the digest is chained, a block's hash identifies the whole prefix that ends with it. These are
the hashes Megatron-LM computes, so they are interchangeable with it.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .._checks import as_int
from ..device import array_module_of

__all__ = ["compute_block_hashes"]

_MOD = (1 << 63) - 1


def compute_block_hashes(tokens, block_size: int) -> list[int]:
    """Hashes of the complete blocks of ``tokens``; a trailing partial block has none.

    Parameters
    ----------
    tokens : sequence of int or integer array [num_tokens]
        Token ids (NumPy or CuPy arrays, lists, tuples); each must fit in int64.
    block_size : int
        Tokens per block (>= 1).

    Returns
    -------
    list of int
        ``num_tokens // block_size`` positive hashes in ``[1, 2^63 - 1]`` (Python ints; pass
        them to ``numpy.asarray(..., dtype=numpy.int64)`` for an array).

    Raises
    ------
    TypeError
        ``block_size`` is not an int, or ``tokens`` are not integers.
    ValueError
        ``block_size < 1``, or ``tokens`` is not 1-D.
    """
    block_size = as_int("block_size", block_size, 1)
    if array_module_of(tokens) is not np:
        tokens = tokens.get()   # host copy of a CuPy array (synchronizes)
    try:
        arr = np.asarray(tokens)
    except (OverflowError, ValueError) as exc:
        raise TypeError(f"tokens: expected int64 token ids, got {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return []
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer) \
            or (arr.dtype == np.uint64 and bool((arr > np.iinfo(np.int64).max).any())):
        raise TypeError(f"tokens: expected int64 token ids, got dtype {arr.dtype}")
    num_blocks = arr.shape[0] // block_size
    data = arr[: num_blocks * block_size].astype("<i8").tobytes()
    step = 8 * block_size
    digest = bytes(32)
    out = []
    for k in range(num_blocks):
        digest = hashlib.sha256(digest + data[k * step: (k + 1) * step]).digest()
        out.append(int.from_bytes(digest[:8], "little") % _MOD + 1)
    return out
