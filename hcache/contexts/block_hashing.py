"""Chained SHA-256 hashes of the complete blocks of a token sequence (docs/design.md §6).

``digest_k = sha256(digest_{k-1} || tokens of block k as little-endian int64)`` with
``digest_{-1}`` = 32 zero bytes, and ``hash_k = uint64_le(digest_k[:8]) mod (2^63 - 1) + 1``:
a positive int64, so -1 ("unregistered") and 0 ("no parent") never collide with a hash. Because
the digest is chained, a block's hash identifies the whole prefix that ends with it. These are
the hashes Megatron-LM computes, so they are interchangeable with it.

:func:`compute_block_hashes` hashes a whole sequence; :func:`chain_block_hashes` continues chains
from their last digests, so a growing sequence hashes each block once, when it completes;
:func:`prompt_block_hashes` is its one-chain form for a checked prompt (an admission).

Isolation (docs/design.md §6.1): a request's optional *salt* replaces the 32 zero bytes the
chain starts from by ``sha256(SALT_DOMAIN || salt)``, so it enters the first block's hash and,
through the chain, every later one; optional *extra keys* of block ``k`` are appended to its
message, ``sha256(digest_{k-1} || tokens of block k || keys_k)`` with ``keys_k`` the
concatenation of ``uint64_le(len(key)) || key`` over its keys, so they enter that block's hash
and every later one. Without a salt and keys every hash is the plain rule's.
:func:`cache_salt` and :func:`block_keys` check and encode them.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Mapping

import numpy as np

from .._checks import as_int, host_array
from ..runtime.device import array_module_of

__all__ = ["compute_block_hashes", "chain_block_hashes", "prompt_block_hashes", "DIGEST_BYTES",
           "cache_salt", "block_keys", "chain_root", "chain_listed", "chain_cells"]

_MOD = (1 << 63) - 1
_MOD_U64 = np.uint64(_MOD)
_FIRST_WORD = struct.Struct("<Q").unpack_from     # a digest's first 8 bytes, little-endian
# Up to this many digests, chain_cells reads each one's hash as it goes (one call each); more
# are joined and read at once (a fixed four calls).
_FEW_CELLS = 4
DIGEST_BYTES = 32   # a SHA-256 digest; an unsalted chain starts from DIGEST_BYTES zero bytes
# Prefix of a salt's root message: it is no block message (those start with a digest, and no
# digest starts with these bytes but by a 2^-144 chance), so a salted root is no block's digest.
SALT_DOMAIN = b"hcache prefix-cache salt\x00"


def cache_salt(name: str, salt) -> bytes | None:
    """A salt as bytes (a str as its UTF-8 bytes), or None for no salt.

    Raises
    ------
    TypeError
        ``salt`` is neither None, bytes, bytearray nor str.
    """
    if salt is None:
        return None
    if isinstance(salt, str):
        return salt.encode("utf-8", "surrogatepass")
    if isinstance(salt, (bytes, bytearray)):
        return bytes(salt)
    raise TypeError(f"{name}: expected bytes or str, got {type(salt).__name__}")


def block_keys(name: str, extra_keys, num_blocks: int) -> dict[int, bytes]:
    """Extra keys by block index, checked and encoded: ``{k: keys_k}`` for every block with at
    least one key (``keys_k``: ``uint64_le(len(key)) || key`` per key, in order).

    Parameters
    ----------
    extra_keys : None or mapping of int to (bytes, str, or a sequence of bytes and str)
        A block's key or keys (a str as its UTF-8 bytes); an empty sequence is no key.
    num_blocks : int
        Blocks of the sequence, the partial tail included: indices are in ``[0, num_blocks)``.

    Raises
    ------
    TypeError
        Not a mapping, an index that is not an int, a key that is not bytes or str.
    IndexError
        An index of a block the sequence does not have.
    """
    if extra_keys is None:
        return {}
    if not isinstance(extra_keys, Mapping):
        raise TypeError(f"{name}: expected a mapping of block index to keys, "
                        f"got {type(extra_keys).__name__}")
    out = {}
    for index, keys in extra_keys.items():
        if isinstance(index, (bool, np.bool_)) or not hasattr(index, "__index__"):
            raise TypeError(f"{name}: expected int block indices, got {type(index).__name__}")
        k = operator.index(index)
        if not 0 <= k < num_blocks:
            raise IndexError(f"{name}: expected block indices in [0, {num_blocks}), got {k}")
        if isinstance(keys, (bytes, bytearray, str)):
            keys = (keys,)
        elif not isinstance(keys, (list, tuple)):
            raise TypeError(f"{name}[{k}]: expected bytes, str or a list of them, "
                            f"got {type(keys).__name__}")
        parts = []
        for j, key in enumerate(keys):
            raw = cache_salt(f"{name}[{k}][{j}]", key)
            if raw is None:
                raise TypeError(f"{name}[{k}][{j}]: expected bytes or str, got NoneType")
            parts.append(len(raw).to_bytes(8, "little") + raw)
        if parts:
            out[k] = b"".join(parts)
    return out


def chain_root(salt: bytes | None) -> bytes:
    """The digest a chain starts from: 32 zero bytes, or ``sha256(SALT_DOMAIN || salt)``."""
    return bytes(DIGEST_BYTES) if salt is None else hashlib.sha256(SALT_DOMAIN + salt).digest()


def compute_block_hashes(tokens, block_size: int, *, salt=None, extra_keys=None) -> list[int]:
    """Hashes of the complete blocks of ``tokens``; a trailing partial block has none.

    Parameters
    ----------
    tokens : sequence of int or integer array [num_tokens]
        Token ids (NumPy or CuPy arrays, lists, tuples); each must fit in int64.
    block_size : int
        Tokens per block (>= 1).
    salt : bytes or str, optional
        The request's isolation key (a str as its UTF-8 bytes), mixed into the first block's
        hash and so into every later one; None: the plain chain.
    extra_keys : mapping of int to (bytes, str or a list of them), optional
        Keys of block ``k`` (``0 <= k < ceil(num_tokens / block_size)``), mixed into its hash
        and so into every later one (a key of the partial tail block enters no hash here).

    Returns
    -------
    list of int
        ``num_tokens // block_size`` positive hashes in ``[1, 2^63 - 1]`` (Python ints; pass
        them to ``numpy.asarray(..., dtype=numpy.int64)`` for an array).

    Raises
    ------
    TypeError
        ``block_size`` is not an int, ``tokens`` are not integers, ``salt`` is not bytes or
        str, or ``extra_keys`` is not a mapping of int to keys.
    ValueError
        ``block_size < 1``, or ``tokens`` is not 1-D.
    IndexError
        ``extra_keys`` names a block the tokens do not have.
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
    if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)
                     or (arr.dtype == np.uint64 and bool((arr > np.iinfo(np.int64).max).any()))):
        raise TypeError(f"tokens: expected int64 token ids, got dtype {arr.dtype}")
    root = chain_root(cache_salt("salt", salt))
    keys = block_keys("extra_keys", extra_keys, -(-arr.shape[0] // block_size))
    if arr.size == 0:
        return []
    num_blocks = arr.shape[0] // block_size
    data = arr[: num_blocks * block_size].astype("<i8").tobytes()
    step = 8 * block_size
    digest, out = root, []
    for k in range(num_blocks):
        message = digest + data[k * step: (k + 1) * step] + keys.get(k, b"")
        digest = hashlib.sha256(message).digest()
        out.append(int.from_bytes(digest[:8], "little") % _MOD + 1)
    return out


def chain_block_hashes(parent_digests: np.ndarray, blocks: np.ndarray,
                       chain_lengths: np.ndarray | None = None, keys: dict | None = None):
    """Hashes of blocks that continue chains whose last digests are known.

    Chain ``i`` continues from ``parent_digests[i]`` with ``chain_lengths[i]`` consecutive
    complete blocks; the result equals the tail of :func:`compute_block_hashes` of each chain's
    whole sequence, at one SHA-256 call per new block.

    Parameters
    ----------
    parent_digests : uint8 [num_chains, 32]
        The digest of the block before each chain's first new block (:func:`chain_root` of
        the salt for a chain that starts at block 0).
    blocks : int64 [num_new_blocks, block_size]
        The new blocks' tokens, chain after chain, in order within each chain.
    chain_lengths : int64 [num_chains], optional
        New blocks per chain (each >= 1); by default one per chain.
    keys : dict of int to bytes, optional
        Encoded extra keys (:func:`block_keys`) by row of ``blocks``.

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
        raw, width = msg.tobytes(), msg.shape[1]    # bytes slices: no row views to make
        digests = [sha(raw[i:i + width]).digest() for i in range(0, m * width, width)]
        for i, suffix in (keys or {}).items():
            digests[i] = sha(msg[i].tobytes() + suffix).digest()
    else:
        # A block's parent is the previous block of its chain: hash chain by chain.
        raw, step = data.tobytes(), data.shape[1]
        digests, pos, keyed = [], 0, keys or {}
        for parent, n in zip(parent_digests, np.asarray(chain_lengths).tolist(), strict=True):
            digest = parent.tobytes()
            for _ in range(n):
                if keyed:
                    digest = sha(digest + raw[pos:pos + step]
                                 + keyed.get(len(digests), b"")).digest()
                else:
                    digest = sha(digest + raw[pos:pos + step]).digest()
                digests.append(digest)
                pos += step
    joined = b"".join(digests)
    return _hashes_of(joined), np.frombuffer(joined, dtype=np.uint8).reshape(m, DIGEST_BYTES)


def prompt_block_hashes(root: bytes, tokens: np.ndarray, block_size: int, keys: dict | None):
    """:func:`chain_block_hashes` of one chain from its root: the hashes of the complete blocks
    of ``tokens`` and the last one's digest, with as little work around SHA-256 as possible
    (an admission hashes a whole prompt).

    Parameters
    ----------
    root : bytes [32]
        :func:`chain_root` of the salt.
    tokens : int64 [num_tokens]
        Checked tokens; a trailing partial block has no hash.
    block_size : int
    keys : dict of int to bytes, optional
        Encoded extra keys (:func:`block_keys`) by block index.

    Returns
    -------
    hashes : int64 [num_tokens // block_size]
    digest : bytes [32]
        The digest of the last complete block (``root`` when there is none).
    """
    step = 8 * block_size
    raw = tokens[:len(tokens) // block_size * block_size].astype("<i8", copy=False).tobytes()
    sha, digest, starts = hashlib.sha256, root, range(0, len(raw), step)
    if keys:
        digests = [digest := sha(digest + raw[pos:pos + step] + keys.get(k, b"")).digest()
                   for k, pos in enumerate(starts)]
    else:
        digests = [digest := sha(digest + raw[pos:pos + step]).digest() for pos in starts]
    return _hashes_of(b"".join(digests)), digest


def chain_listed(roots: bytes, raw: bytes, step: int, keys: dict | None):
    """:func:`chain_block_hashes` of one new block per chain on bytes and lists, for the few
    blocks of a serving step (no array made per block).

    Parameters
    ----------
    roots : bytes [num_chains * 32]
        Each chain's parent digest, concatenated.
    raw : bytes [num_chains * step]
        Each chain's new block's tokens as little-endian int64, concatenated.
    step : int
        Bytes per block (``8 * block_size``).
    keys : dict of int to bytes, optional
        Encoded extra keys (:func:`block_keys`) by chain.

    Returns
    -------
    hashes : list of int [num_chains]
    digests : bytes [num_chains * 32]
        The new blocks' digests, concatenated.
    parent_hashes : list of int [num_chains]
        The hashes of ``roots`` (a chain root's is no block's).
    """
    sha, width, m = hashlib.sha256, DIGEST_BYTES, len(roots) // DIGEST_BYTES
    if keys:
        digests = b"".join([sha(roots[i * width:(i + 1) * width] + raw[i * step:(i + 1) * step]
                                + keys.get(i, b"")).digest() for i in range(m)])
    else:
        digests = b"".join([sha(roots[i * width:(i + 1) * width] + raw[i * step:(i + 1) * step])
                            .digest() for i in range(m)])
    return _listed_hashes(digests, m), digests, _listed_hashes(roots, m)


def chain_cells(digests: memoryview, tokens: memoryview, cells: list, step: int,
                span: int) -> list[int]:
    """:func:`chain_listed` of a few chains whose digests and tokens are rows of two tables,
    in place: the digest row of each chain becomes its new block's digest (one SHA-256 of the
    digest and the block's bytes per chain).

    Parameters
    ----------
    digests : writable bytes memoryview [num_rows * 32]
        Row ``r``'s last digest at ``[32 * r, 32 * r + 32)``.
    tokens : bytes memoryview [num_rows * span]
        Row ``r``'s block ``c`` (little-endian int64 tokens) at ``r * span + c * step``.
    cells : list of (int, int)
        The ``(row, col)`` of each new block; distinct rows.
    step, span : int
        Bytes of a block, of a row of tokens.

    Returns
    -------
    list of int
        The new blocks' hashes, in the order of ``cells``.
    """
    sha, width, word, new = hashlib.sha256, DIGEST_BYTES, _FIRST_WORD, []
    few = len(cells) <= _FEW_CELLS      # hashes read one at a time, else all at once
    for r, c in cells:
        at, start = r * width, r * span + c * step
        digest = sha(digests[at:at + width].tobytes() + tokens[start:start + step]).digest()
        digests[at:at + width] = digest
        new.append(word(digest)[0] % _MOD + 1 if few else digest)
    return new if few else _listed_hashes(b"".join(new), len(new))


def _listed_hashes(joined: bytes, m: int) -> list[int]:
    """The hashes of ``m`` concatenated digests, a list of Python ints."""
    return [h % _MOD + 1 for h in struct.unpack("<" + "Q24x" * m, joined)]


def _hashes_of(joined: bytes) -> np.ndarray:
    """int64 hashes of concatenated digests: ``uint64_le(digest[:8]) mod (2^63 - 1) + 1``."""
    hashes = np.frombuffer(joined, dtype="<u8")[::DIGEST_BYTES // 8] % _MOD_U64
    hashes += np.uint64(1)
    return hashes.view(np.int64)    # < 2^63: the same values
