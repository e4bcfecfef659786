"""Token and id arguments of the context's batched calls, checked and flattened, and the ragged
column arithmetic that lays a batch's tokens and blocks over the request table (docs/design.md
§6)."""

from __future__ import annotations

import numpy as np

from .._checks import host_array, is_array

__all__ = ["token_array", "id_list", "batch_tokens", "ragged_columns"]


def token_array(name: str, tokens) -> np.ndarray:
    """``tokens`` (a 1-D integer sequence or array) as a 1-D int64 array.

    Raises
    ------
    TypeError
        Not integers (floats, bools, a scalar), or a uint64 value int64 cannot hold.
    ValueError
        Not 1-D.
    """
    arr = host_array(name, tokens)   # refuses bool entries, ragged and beyond-int64 lists
    if arr.size == 0 and arr.ndim == 1:
        return np.zeros(0, np.int64)
    if arr.ndim == 0 or arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected a 1-D sequence of ints, got {arr.dtype} "
                        f"{arr.shape}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.dtype == np.uint64 and (arr > np.iinfo(np.int64).max).any():
        raise TypeError(f"{name}: expected int64 token ids, got a uint64 above 2**63 - 1")
    return arr.astype(np.int64, copy=False)


def id_list(name: str, request_ids) -> list:
    """``request_ids`` as a list (an array of any library as Python scalars)."""
    ids = host_array(name, request_ids) if is_array(request_ids) else request_ids
    return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)


def batch_tokens(name: str, tokens, n: int):
    """The new tokens of ``n`` requests, flattened: ``(flat int64 [total], counts)``.

    ``tokens`` is one token per request (a 1-D integer array or a sequence of ints; ``counts``
    is then None), ``k`` per request (a 2-D integer array ``[n, k]``) or a sequence of ``n``
    1-D integer sequences; ``counts`` is an int64 array ``[n]`` in the last two cases.

    Raises
    ------
    TypeError
        Not integers.
    ValueError
        Not ``n`` entries, a bad shape, or a request with no token.
    """
    if type(tokens) is np.ndarray and tokens.ndim == 1 and tokens.dtype == np.int64:
        flat = tokens       # one token each, stored as the table stores them: nothing to convert
    else:
        tokens = host_array(name, tokens) if is_array(tokens) else tokens
        if isinstance(tokens, np.ndarray) and tokens.ndim == 2:
            if tokens.shape[0] != n or tokens.shape[1] == 0:
                raise ValueError(f"{name}: expected shape [{n}, >= 1], got {tokens.shape}")
            flat = token_array(name, tokens.reshape(-1))
            return flat, np.full(n, tokens.shape[1], np.int64)
        if isinstance(tokens, (list, tuple)) and len(tokens) \
                and isinstance(tokens[0], (list, tuple, np.ndarray)):
            parts = [token_array(f"{name}[{i}]", t) for i, t in enumerate(tokens)]
            if len(parts) != n:
                raise ValueError(f"{name}: expected {n} token sequences, got {len(parts)}")
            counts = np.fromiter(map(len, parts), np.int64, n)
            if not counts.all():
                i = int(np.argmin(counts))
                raise ValueError(f"{name}[{i}]: expected at least 1 token, got 0")
            return np.concatenate(parts), counts
        flat = token_array(name, tokens)
    if len(flat) != n:
        raise ValueError(f"{name}: expected {n} tokens (one per request), got {len(flat)}")
    return flat, None


def ragged_columns(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(which, column)`` of every cell of ``counts[i]`` consecutive columns from
    ``starts[i]``, entry after entry: ``which`` indexes the entries."""
    if len(counts) == 1:    # one entry (a prompt's step)
        start = int(starts[0])
        return np.zeros(int(counts[0]), np.intp), np.arange(start, start + int(counts[0]))
    total = int(counts.sum())
    which = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return which, np.arange(total) - first[which] + starts[which]
