"""NumPy reference of the ``kv_write`` family (``kernels/kv_write.cu``): where each new token's
K/V row lands, the write itself (``kv_write``) and the quantizing write (``kv_write_fp8``,
``quantize_fp8``). Re-exported by :mod:`hcache.ops.reference`.

The per-token mapping (row, position, slot, status count) follows the kernel step for step. It is
computed once per call, vectorized, and the rows of every launched layer move with one NumPy
fancy-index assignment per plane. The decode step (one token per row at ``cache_lengths``, rows
to slots by ``row_to_slot`` or identity) has a fast path: when every position and slot is in
range, which two reductions decide, the index arrays go to NumPy as they are, with no mask and
no temporary; anything else (padding, out-of-range entries, ragged rows, explicit positions,
block tables) takes the general path, which gives the same bytes and counts.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["kv_write", "kv_write_fp8", "kv_write_targets", "write_rows", "quantize_fp8",
           "FP8_DTYPES", "SRC_DTYPES"]

FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
SRC_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))

_iota_cache = np.arange(256, dtype=np.intp)


def _iota(n: int) -> np.ndarray:
    """``arange(n)`` as a view of a cached array (grown when needed; never written)."""
    global _iota_cache
    if _iota_cache.shape[0] < n:
        _iota_cache = np.arange(max(n, 2 * _iota_cache.shape[0]), dtype=np.intp)
        _iota_cache.flags.writeable = False
    return _iota_cache[:n]


_iota_cache.flags.writeable = False


def _token_rows(num_tokens, batch, seq_offsets, uniform_tokens):
    """Row of each token (-1: padding), the index of its row's first token and one past its
    row's last (``end``)."""
    t = _iota(num_tokens)
    if seq_offsets is None:
        if uniform_tokens <= 0:
            zeros = np.zeros(num_tokens, dtype=np.int64)
            return np.full(num_tokens, -1), zeros, zeros
        b = t // uniform_tokens
        b[b >= batch] = -1
        start = np.maximum(b, 0) * uniform_tokens
        return b, start, start + uniform_tokens
    if batch <= 0:
        zeros = np.zeros(num_tokens, dtype=np.int64)
        return np.full(num_tokens, -1), zeros, zeros
    off = np.asarray(seq_offsets[:batch + 1], dtype=np.int64)
    if (off[1:] >= off[:-1]).all():
        # Sorted offsets: the kernel's binary search (largest b with off[b] <= t) is
        # searchsorted's answer, empty rows included.
        b = np.searchsorted(off[:batch], t, side="right").astype(np.int64) - 1
    else:
        # Unsorted offsets (device data nobody checks): the kernel's binary search step for
        # step, so that the reference finds the kernel's rows.
        lo = np.zeros(num_tokens, dtype=np.int64)
        hi = np.full(num_tokens, batch - 1, dtype=np.int64)
        while (lo < hi).any():
            mid = (lo + hi + 1) >> 1
            le = off[mid] <= t
            active = lo < hi
            lo = np.where(active & le, mid, lo)
            hi = np.where(active & ~le, mid - 1, hi)
        b = lo
    b[(t < off[0]) | (t >= off[batch])] = -1
    bb = np.maximum(b, 0)
    return b, off[bb], off[bb + 1]


def _decode_targets(group, idx, n, cache_lengths, row_to_slot):
    """The decode fast path: token ``t`` of row ``t`` to ``(row_to_slot[t] or t,
    cache_lengths[t] or 0)``; ``None`` unless every slot and position is in range."""
    if row_to_slot is None and n > group.num_slots:
        return None
    rings = [group.ring_windows[li] for li in idx]
    if any(rings):
        # a ring takes any position >= 0 (modulo its window); the others their token axis
        cap = min((group.max_seq_lens[li] for li, w in zip(idx, rings) if not w),
                  default=2**31)
    else:
        cap = min(group.max_seq_lens[li] for li in idx) if len(idx) > 1 else \
            group.max_seq_lens[idx[0]]
    if cache_lengths is None:
        pos = 0
    else:
        pos = cache_lengths[:n]
        if pos.dtype != np.int32:
            return None
        top = int(pos.view(np.uint32).max())   # negatives read as huge: one reduction
        if top >= cap:
            return None
        if row_to_slot is None and int(pos.min()) == top:
            pos = top   # one position for all: a strided copy, not a scatter
    if row_to_slot is None:
        slot = slice(0, n)
        if not isinstance(pos, int):
            slot = _iota(n)
    else:
        slot = row_to_slot[:n]
        if slot.dtype != np.int32 or int(slot.view(np.uint32).max()) >= group.num_slots:
            return None
        if isinstance(pos, int):
            pos = np.zeros(n, dtype=np.intp)
    if any(rings):
        wrapped = {w: pos % w for w in set(rings) if w}
        return [(None, slot, wrapped[w] if w else pos, n) for w in rings], 0
    return [(None, slot, pos, n)] * len(idx), 0


def kv_write_targets(group, idx, num_tokens, *, seq_offsets=None, uniform_tokens=0, batch=None,
                     cache_lengths=None, positions=None, row_to_slot=None, block_table=None):
    """Where the tokens of one ``kv_write`` land in each launched layer.

    Parameters
    ----------
    group : KVGroup
    idx : sequence of int
        The launched group positions.
    num_tokens : int
    seq_offsets, uniform_tokens, batch, cache_lengths, positions, row_to_slot, block_table
        As in :func:`kv_write`.

    Returns
    -------
    targets : list of ``(tokens, slots, positions, count)`` per launched layer, or None
        The ``count`` tokens that are written, their slots and positions (``tokens=None``:
        tokens ``0..count-1``, in order; ``slots`` may be a slice and ``positions`` one int);
        ``None`` when nothing is written anywhere.
    reported : int
        Tokens skipped for being out of range (as the kernel counts them: by the first
        launched layer's ranges).
    """
    if batch is None:
        batch = (len(seq_offsets) - 1) if seq_offsets is not None else (
            num_tokens // uniform_tokens if uniform_tokens > 0 else 0)
    if (seq_offsets is None and positions is None and block_table is None
            and uniform_tokens == 1):
        n = min(num_tokens, batch)
        if n <= 0:
            return None, 0
        fast = _decode_targets(group, idx, n, cache_lengths, row_to_slot)
        if fast is not None:
            return fast
    b, start, end = _token_rows(num_tokens, batch, seq_offsets, uniform_tokens)
    live = b >= 0
    if not live.any():
        return None, 0
    bb = np.maximum(b, 0)
    t = _iota(num_tokens)
    if positions is not None:
        pos = np.asarray(positions[:num_tokens], dtype=np.int64)
    else:
        base = np.asarray(cache_lengths, dtype=np.int64)[bb] if cache_lengths is not None else 0
        pos = base + (t - start)
    live &= pos != -1
    bad = live & (pos < 0)
    live &= pos >= 0
    pp = np.maximum(pos, 0)
    targets, reported = [], 0
    for j, li in enumerate(idx):
        cap = group.max_seq_lens[li]
        ring = group.ring_windows[li] and block_table is None
        l_live, l_bad = live, bad
        if ring:   # only a row's last `cap` tokens land; older ones are skipped silently
            recent = (end - t) <= cap
            l_live, l_bad = live & recent, bad & recent
        if block_table is not None:
            table = np.asarray(block_table)
            col = pp // cap
            wide = live & (col >= table.shape[1])
            if table.shape[1]:
                slot = table[bb, np.minimum(col, table.shape[1] - 1)].astype(np.int64)
            else:
                slot = np.full(num_tokens, -1, dtype=np.int64)   # every token is `wide`
            p = pp % cap
        else:
            wide = None
            slot = np.asarray(row_to_slot, dtype=np.int64)[bb] if row_to_slot is not None else bb
            p = pp % cap if ring else pp
        cand = l_live & (slot != -1)
        if wide is not None:
            cand &= ~wide
        oob = cand & ((slot < 0) | (slot >= group.num_slots) | (p >= cap))
        go = cand & ~oob
        if j == 0:
            rep = l_bad | oob
            if wide is not None:
                rep |= wide
            reported = int(np.count_nonzero(rep))
        if go.all():
            targets.append((None, slot, p, num_tokens))
        else:
            ts = np.flatnonzero(go)
            targets.append((ts, slot[ts], p[ts], ts.shape[0]))
    return targets, reported


def write_rows(layer, layout: str, kv: int, rows, target) -> None:
    """``layer[slot, kv, token p] = rows[t]`` for every ``(t, slot, p)`` of ``target``
    (``(tokens or None, slots, positions, count)``; slots may be a slice and positions one int,
    NumPy index forms that cover the same tokens)."""
    ts, slot, p, count = target
    if count == 0:
        return
    src = rows[:count] if ts is None else rows[ts]
    if layout == "HND":
        layer[slot, kv, :, p, :] = src
    else:
        layer[slot, kv, p] = src


def kv_write(group, k, v, *, layers=None, seq_offsets=None, uniform_tokens=0, batch=None,
             cache_lengths=None, positions=None, row_to_slot=None, block_table=None,
             status=None):
    """Write new K/V rows into the group's caches (semantics in ``kernels/kv_write.cu``); a
    latent group (one component) writes ``k`` only."""
    _write_layers(group, k, v, layers, lambda li, kv, rows: rows, status,
                  seq_offsets=seq_offsets, uniform_tokens=uniform_tokens, batch=batch,
                  cache_lengths=cache_lengths, positions=positions, row_to_slot=row_to_slot,
                  block_table=block_table)


def _write_layers(group, k, v, layers, convert, status, **rows):
    """The write both kernels share: map the tokens once (``rows``: the index arguments), then
    put ``convert(group_position, kv, rows)`` of each layer's K (kv 0) and V (kv 1, only when
    the group has two components) in place."""
    if layers is None:
        idx, ks = range(group.num_layers), k
        vs = [None] * group.num_layers if v is None else v
    else:
        idx, ks, vs = (int(layers),), (k,), (v,)
    targets, reported = kv_write_targets(group, idx, int(ks[0].shape[0]), **rows)
    if targets is not None:
        for li, kk, vv, target in zip(idx, ks, vs, targets):
            layer = group.layers[li]
            write_rows(layer, group.layout, 0, convert(li, 0, kk), target)
            if group.components == 2:
                write_rows(layer, group.layout, 1, convert(li, 1, vv), target)
    if status is not None and reported:
        status[0] += reported


# --- kv_write_fp8 ---------------------------------------------------------------------------

def quantize_fp8(x, scale, fp8_dtype):
    """``fp8(clip(float32(x) / float32(scale), -max, max))``: the kernel's quantization.

    Parameters
    ----------
    x : float32, float16 or bfloat16 array
    scale : float or float32 array broadcastable against ``x``
    fp8_dtype : ``float8_e4m3fn`` or ``float8_e5m2`` (an ml_dtypes dtype)

    Returns
    -------
    array of ``fp8_dtype``, the shape of ``x``
        Round to nearest even; finite values past ``max`` and +-Inf saturate to +-max; NaN stays
        NaN with its sign (a NaN quotient keeps the input's NaN on the host).
    """
    fmax = np.float32(ml_dtypes.finfo(fp8_dtype).max)
    with np.errstate(all="ignore"):   # NaN and Inf are data here, not errors
        q = x.astype(np.float32) / np.asarray(scale, dtype=np.float32)
        np.clip(q, -fmax, fmax, out=q)
        return q.astype(fp8_dtype)


def _layer_scale(scale, row: int, heads: int):
    """The scale of one layer: a float32 scalar, or ``[1, heads, 1]`` per head."""
    if not isinstance(scale, np.ndarray):
        return np.float32(scale)
    if scale.ndim == 1:
        return scale[row]
    return scale[row, :heads].reshape(1, heads, 1)


def kv_write_fp8(group, k, v, *, layers=None, seq_offsets=None, uniform_tokens=0, batch=None,
                 cache_lengths=None, positions=None, row_to_slot=None, block_table=None,
                 k_scale=1.0, v_scale=1.0, fp8_dtype=None, src_dtype=None, status=None):
    """Quantize new K/V rows to FP8 and write them (semantics in ``kernels/kv_write.cu``): the
    rows of ``kv_write``, each element ``quantize_fp8(x, scale)`` with the scale of the layer's
    row ``group.layer_indices[p]`` (and head) of ``k_scale`` / ``v_scale``."""
    fp8 = np.dtype(fp8_dtype) if fp8_dtype is not None else group.dtype

    def quantized(li, kv, rows):
        if src_dtype is not None and rows.dtype != src_dtype:
            rows = rows.view(src_dtype)    # bfloat16 held as uint16
        scale = _layer_scale(v_scale if kv else k_scale, group.layer_indices[li],
                             group.num_kv_heads[li])
        return quantize_fp8(rows, scale, fp8).view(group.dtype)

    _write_layers(group, k, v, layers, quantized, status, seq_offsets=seq_offsets,
                  uniform_tokens=uniform_tokens, batch=batch, cache_lengths=cache_lengths,
                  positions=positions, row_to_slot=row_to_slot, block_table=block_table)
