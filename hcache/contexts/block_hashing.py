"""Chained SHA-256 hashes of the complete blocks of a token sequence (docs/design.md §6).

``digest_k = sha256(digest_{k-1} || tokens of block k as little-endian int64)`` with
``digest_{-1}`` = 32 zero bytes, and ``hash_k = uint64_le(digest_k[:8]) mod (2^63 - 1) + 1``:
a positive int64, so -1 ("unregistered") and 0 ("no parent") never collide with a hash. Because
the digest is chained, a block's hash identifies the whole prefix that ends with it. These are
the hashes Megatron-LM computes, so they are interchangeable with it.

:func:`compute_block_hashes` hashes a whole sequence; :func:`chain_block_hashes` continues chains
from their last digests, so a growing sequence hashes each block once, when it completes.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .._checks import as_int, host_array
from ..runtime.device import array_module_of

__all__ = ["compute_block_hashes", "chain_block_hashes", "DIGEST_BYTES"]

_MOD = (1 << 63) - 1
DIGEST_BYTES = 32   # a SHA-256 digest; a chain starts from DIGEST_BYTES zero bytes


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
        arr = host_array("tokens", tokens)   # bool entries, ragged lists: TypeError
    except ValueError as exc:                 # a Python int beyond int64
        raise TypeError(str(exc)) from None
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


def chain_block_hashes(parent_digests: np.ndarray, blocks: np.ndarray,
                       chain_lengths: np.ndarray | None = None):
    """Hashes of blocks that continue chains whose last digests are known.

    Chain ``i`` continues from ``parent_digests[i]`` with ``chain_lengths[i]`` consecutive
    complete blocks; the result equals the tail of :func:`compute_block_hashes` of each chain's
    whole sequence, at one SHA-256 call per new block.

    Parameters
    ----------
    parent_digests : uint8 [num_chains, 32]
        The digest of the block before each chain's first new block (32 zero bytes for a chain
        that starts at block 0).
    blocks : int64 [num_new_blocks, block_size]
        The new blocks' tokens, chain after chain, in order within each chain.
    chain_lengths : int64 [num_chains], optional
        New blocks per chain (each >= 1); by default one per chain.

    Returns
    -------
    hashes : int64 [num_new_blocks]
        Positive hashes in ``[1, 2^63 - 1]``.
    digests : uint8 [num_new_blocks, 32]
        Each block's digest (the last of a chain is the parent digest of its next block).

    Notes
    -----
    Internal (the caller's arrays are trusted): ``parent_digests`` C-contiguous uint8,
    ``blocks`` int64, and the chain lengths summing to ``num_new_blocks``.
    """
    m = blocks.shape[0]
    if m == 0:
        return np.zeros(0, np.int64), np.zeros((0, DIGEST_BYTES), np.uint8)
    data = np.ascontiguousarray(blocks, dtype="<i8").view(np.uint8).reshape(m, -1)
    sha = hashlib.sha256
    if chain_lengths is None or len(chain_lengths) == m:
        # Every parent is known up front: hash the rows [parent digest || block] directly.
        msg = np.empty((m, DIGEST_BYTES + data.shape[1]), np.uint8)
        msg[:, :DIGEST_BYTES] = parent_digests
        msg[:, DIGEST_BYTES:] = data
        digests = [sha(row).digest() for row in msg]
    else:
        # A block's parent is the previous block of its chain: hash chain by chain.
        raw, step = data.tobytes(), data.shape[1]
        digests, pos = [], 0
        for parent, n in zip(parent_digests, np.asarray(chain_lengths).tolist(), strict=True):
            digest = parent.tobytes()
            for _ in range(n):
                digest = sha(digest + raw[pos:pos + step]).digest()
                digests.append(digest)
                pos += step
    joined = b"".join(digests)
    first8 = np.frombuffer(joined, dtype="<u8").reshape(m, 4)[:, 0]
    hashes = (first8 % np.uint64(_MOD)).astype(np.int64) + 1
    return hashes, np.frombuffer(joined, dtype=np.uint8).reshape(m, DIGEST_BYTES)
