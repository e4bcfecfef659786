"""Batched K/V writes into contiguous-slot caches: the ``write_kv`` of
:class:`~hcache.slots.kv.KVCacheManager`, :class:`~hcache.slots.hybrid.HybridCacheManager` and
:class:`~hcache.slots.linear.LinearKVCache` (docs/design.md §4.9).

A :class:`KVWriter` belongs to one set of per-attention-layer caches ``[max_batch, C_a, H_a, S,
D_a]`` (``C_a`` = 2 for K and V, 1 for a latent MLA cache written from ``k`` alone) and their
head-dim groups. It validates a call completely, then stages its index arrays in
buffers allocated at construction (ragged row offsets, host positions) and launches
:func:`hcache.ops.kv_write` (rows of the cache dtype) or :func:`hcache.ops.kv_write_fp8` (float
rows into an FP8 cache) once per head-dim group. Row ``b`` of a batch is slot ``b``; its tokens
land at explicit positions or at the row's committed length (the ``lengths`` of the batch state
that calls it).

FP8 caches keep one scale per attention layer and KV head for K and for V
(:class:`~hcache.slots.kv_scale_tables.KVScaleTables`).
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import token_counts
from ..dtypes import is_fp8, resolve_dtype, storage_dtype
from ..runtime import _cuda
from ..runtime.arrays import as_array
from ..runtime.device import (
    launch_scope,
    stream_handle,
    upload,
    upload_ints,
)
from ..runtime.stream_order import StreamOrder
from .kv_scale_tables import KVScaleTables
from .write_positions import check_positions

__all__ = ["KVWriter"]

_FLOATS = tuple(resolve_dtype(n) for n in ("float32", "float16", "bfloat16"))


class KVWriter:
    """Writes new tokens' K/V into per-attention-layer caches (one launch per head-dim group).

    Parameters
    ----------
    device : Device
    caches : sequence of arrays ``[max_batch, C_a, H_a, S, D_a]``
        One per attention layer (its attention index is its position), C-contiguous; ``C_a`` is
        2 (K and V) or 1 (a latent cache: no V rows).
    groups : sequence of KVGroup
        The caches by head dim; ``layer_indices`` are attention indices.
    dtype : str or dtype
        The caches' dtype (a float8 dtype makes quantizing writes and scale tables possible).
    max_sequence_length : int
    ring_windows : sequence of int, optional
        Per attention layer its ring window (0: unbounded); host positions are checked to be
        distinct modulo a written ring's window among each row's last ``W`` tokens (the ones
        that land, docs/design.md §3.9).

    Notes
    -----
    Allocates on the current device and stream: the manager calls it inside its
    construction's launch scope.
    """

    def __init__(self, device, caches, groups, dtype, max_sequence_length: int, *,
                 ring_windows=None):
        xp = device.xp
        self._device, self._caches, self._groups = device, tuple(caches), tuple(groups)
        self.order = StreamOrder()   # replaced by the batch state's when a manager has one
        self.dtype = resolve_dtype(dtype)
        self._storage = storage_dtype(self.dtype, xp)
        self._max_len = int(max_sequence_length)
        self._rings = tuple(ring_windows) if ring_windows is not None else (0,) * len(caches)
        self._max_batch = int(caches[0].shape[0]) if caches else 0
        self._where = {a: (g, p) for g, group in enumerate(groups)
                       for p, a in enumerate(group.layer_indices)}
        n = 1 if caches else 0   # nothing to stage without an attention layer
        self._offsets = xp.zeros((self._max_batch + 1) * n, dtype=np.int32)
        self._positions = xp.zeros(max(self._max_batch, 1) * n, dtype=np.int32)
        self._status = xp.zeros(n, dtype=np.int32)
        self._fp8 = is_fp8(self.dtype)
        self._scales = KVScaleTables(device, caches) if self._fp8 else None
        # float rows a quantizing write takes, by array dtype (bfloat16 may be held as uint16)
        self._float_dtypes = {np.dtype(storage_dtype(d, xp)): d for d in _FLOATS}
        self._array_type = xp.ndarray
        self._all_members = tuple((g, tuple(group.layer_indices))
                                  for g, group in enumerate(groups))

    # --- queries ----------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    @property
    def nbytes(self) -> int:
        """Device bytes of the staging buffers, the status word and the scale tables."""
        n = self._offsets.nbytes + self._positions.nbytes + self._status.nbytes
        if self._scales is not None:
            n += self._scales.nbytes
        return int(n)

    def scales(self):
        """``(k_scales, v_scales)``: the float32 ``[num_layers, max_kv_heads]`` tables.

        Raises
        ------
        ValueError
            The caches are not FP8.
        """
        if self._scales is None:
            raise ValueError(f"kv scales: expected an FP8 cache, got {self.dtype}")
        return self._scales.tables

    def check_scale(self, name, scale, stream=None):
        """``scale`` checked for every layer, as :meth:`set_scales` would take it (FP8 caches
        only). Raises ``ValueError`` / ``TypeError``."""
        self.scales()
        return self._scales.check(name, scale, list(range(self.num_layers)), stream)

    def skipped_count(self, stream=None) -> int:
        """Tokens the kernels skipped as out of range so far. **Synchronizes** ``stream``."""
        if not self._caches:
            return 0
        with launch_scope(self._device, stream, self.order):
            host = self._status.get() if hasattr(self._status, "get") else self._status
        return int(host[0])

    # --- commands ---------------------------------------------------------------------------

    def set_scales(self, k_scale, v_scale, stream=None) -> None:
        """Record ``k_scale`` / ``v_scale`` (``None`` keeps one) for every layer; see
        :meth:`write`. Validates both before recording either."""
        stream_handle(stream)
        self.scales()
        layers = list(range(self.num_layers))
        checked = [self._scales.check(name, s, layers, stream)
                   for name, s in (("k_scale", k_scale), ("v_scale", v_scale))]
        with launch_scope(self._device, stream, self.order):
            for kv, s in enumerate(checked):
                self._scales.record(kv, s, layers)

    def write(self, index, k, v, *, batch_state=None, seq_lengths=None, positions=None,
              k_scale=None, v_scale=None, stream=None) -> None:
        """Write new tokens of one attention layer (``index``) or of every one (``None``).

        ``batch_state`` (a :class:`~hcache.slots.batch.BatchAPI`) supplies the active batch and
        its committed lengths; without it rows are ``k``'s and ``positions`` are required. See
        :meth:`hcache.slots.batch.BatchAPI.write_kv` for the parameters. Raises before any
        change.
        """
        if batch_state is not None and seq_lengths is None and positions is None \
                and k_scale is None and v_scale is None \
                and self._decode_write(index, k, v, batch_state, stream):
            return   # the common decode write, checked and launched in one pass
        stream_handle(stream)
        layers = list(range(self.num_layers)) if index is None else [index]
        ks = self._per_layer("k", k, index, stream)
        if v is None and index is None and all(self._latent(a) for a in layers):
            vs = [None] * len(layers)   # a model of latent layers only: no V anywhere
        else:
            vs = self._per_layer("v", v, index, stream)
        if not layers:
            return
        ragged = seq_lengths is not None
        lead = self._lead(ks[0], ragged)
        src = self._check_rows(ks, vs, layers, lead, index is not None)
        quantize = src is not None
        if batch_state is not None:
            batch = batch_state.active_batch_size
        else:
            batch = len(seq_lengths) if ragged and hasattr(seq_lengths, "__len__") else lead[0]
            if batch > self._max_batch:
                raise ValueError(f"k: expected at most {self._max_batch} sequences (slots), "
                                 f"got {batch}")
        if ragged:
            listed = token_counts(seq_lengths, batch, "seq_lengths")
            if sum(listed) != lead[0]:    # Python ints: no int64 overflow
                raise ValueError(f"k: expected {sum(listed)} tokens (the sum of "
                                 f"seq_lengths), got {lead[0]}")
            counts = np.asarray(listed, np.int64)
        elif lead[0] != batch:
            raise ValueError(f"k: expected {batch} sequences (the active batch), got {lead[0]}")
        total = lead[0] if ragged else lead[0] * lead[1]
        staged = self._check_positions(positions, lead, batch,
                                       counts if ragged else lead[1], layers, stream)
        if positions is None:
            if batch_state is None:
                raise ValueError("positions: expected explicit positions (a KVCacheManager "
                                 "keeps no lengths), got None")
            self._check_room(batch_state, counts if ragged else lead[1])
        scales = [None, None]
        if quantize:
            scales = [self._scales.check(n, s, layers, stream)
                      for n, s in (("k_scale", k_scale), ("v_scale", v_scale))]
            if v_scale is not None and all(self._latent(a) for a in layers):
                raise ValueError(f"v_scale: expected None (latent layers have no V), "
                                 f"got {type(v_scale).__name__}")
        else:
            for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
                if s is not None:
                    raise ValueError(f"{name}: expected None (scales apply to float rows "
                                     f"written into an FP8 cache), got {type(s).__name__}")
        if batch_state is not None:
            self.order = batch_state._order   # one chain with the manager's other calls
        with launch_scope(self._device, stream, self.order):
            if total == 0:
                return
            kwargs = dict(batch=batch, status=self._status, stream=stream)
            if ragged:
                upload_ints(self._offsets, np.concatenate([[0], np.cumsum(counts)]))
                kwargs["seq_offsets"] = self._offsets[:batch + 1]
            else:
                kwargs["uniform_tokens"] = lead[1]
            if positions is None:
                kwargs["cache_lengths"] = batch_state.get_kv_cache_lengths()
            else:
                kwargs["positions"] = self._stage(staged, total)
            if quantize:
                for kv, s in enumerate(scales):
                    self._scales.record(kv, s, layers)
                kwargs.update(k_scale=self._scales.tables[0], v_scale=self._scales.tables[1],
                              fp8_dtype=self.dtype, src_dtype=src)
            self._launch(index, ks, vs, total, quantize, kwargs)

    # --- internals --------------------------------------------------------------------------

    def _decode_write(self, index, k, v, state, stream) -> bool:
        """A plain uniform write at the committed lengths (the decode step), when every array
        is this device's, of the cache dtype, shaped and contiguous as required, and every
        active slot has room (O(1) while the host knows the lengths): checked inline, launched
        with the lengths view the step plans of :func:`hcache.ops.kv_write` key on. False
        (nothing done) for anything else: :meth:`write` then judges it in full."""
        if index is None:
            ks, vs, layers = k, v, range(len(self._caches))
            if type(ks) is not list and type(ks) is not tuple or len(ks) != len(layers):
                return False
            if v is None or type(vs) is not list and type(vs) is not tuple \
                    or len(vs) != len(layers):
                return False
        elif type(index) is int and 0 <= index < len(self._caches):
            ks, vs, layers = (k,), (v,), (index,)
        else:
            return False
        device, array, dtype = self._device, self._array_type, self._storage
        if not layers or type(ks[0]) is not array or ks[0].ndim != 4:
            return False
        batch, tokens = ks[0].shape[:2]
        if batch != state._active or tokens == 0:
            return False
        rt = _cuda.runtime() if device.is_cuda else None
        for a, b, i in zip(ks, vs, layers):
            cache = self._caches[i]
            want = (batch, tokens, cache.shape[2], cache.shape[4])
            if cache.shape[1] == 1 and b is not None:
                return False   # a latent layer has no V: the full path says so
            for x in (a,) if cache.shape[1] == 1 else (a, b):
                if type(x) is not array or x.shape != want or x.dtype != dtype \
                        or not x.flags.c_contiguous \
                        or rt is not None and rt.array_device(x) != device.index:
                    return False
        headroom = state._headroom_now()
        if headroom is None or tokens > headroom:
            return False
        total = batch * tokens
        lengths = state.get_kv_cache_lengths()
        self.order = state._order   # one chain with the manager's other calls
        with launch_scope(device, stream, self.order):
            written = self._all_members if index is None else ((self._where[index][0], (0,)),)
            for g, members in written:
                group = self._groups[g]
                rows = [None if vs[j] is None else vs[j].reshape(total, *vs[j].shape[2:])
                        for j in members]
                group_ks = [ks[j].reshape(total, *ks[j].shape[2:]) for j in members]
                if index is None:
                    ops.kv_write(group, group_ks, rows, uniform_tokens=tokens, batch=batch,
                                 cache_lengths=lengths, status=self._status, stream=stream)
                else:
                    ops.kv_write(group, group_ks[0], rows[0], layers=self._where[index][1],
                                 uniform_tokens=tokens, batch=batch, cache_lengths=lengths,
                                 status=self._status, stream=stream)
        return True

    def _latent(self, index) -> bool:
        """Attention layer ``index`` caches one latent vector per token (no V plane)."""
        return int(self._caches[index].shape[1]) == 1

    def _per_layer(self, name, arrays, index, stream) -> list:
        """The K (or V) arrays of the layers written, each as a ``device.xp`` array; a V
        entry that is None or belongs to a latent layer stays as given (:meth:`_check_rows`
        requires it to be None exactly when the layer is latent)."""
        if index is not None:
            return [self._coerce(name, name, arrays, index, stream)]
        if isinstance(arrays, (list, tuple)) and len(arrays) == self.num_layers:
            return [self._coerce(name, f"{name}[{j}]", a, j, stream)
                    for j, a in enumerate(arrays)]
        got = len(arrays) if isinstance(arrays, (list, tuple)) else type(arrays).__name__
        raise ValueError(f"{name}: expected a list of {self.num_layers} arrays (one per "
                         f"attention layer), got {got}")

    def _coerce(self, kind, name, a, index, stream):
        if kind == "v" and (a is None or self._latent(index)):
            return a   # judged by _check_rows: None exactly for a latent layer
        return as_array(name, a, self._device, stream)

    def _lead(self, a, ragged) -> tuple:
        want = 3 if ragged else 4
        if a.ndim != want:
            form = "[total_tokens, H, D]" if ragged else "[batch, new_tokens, H, D]"
            raise ValueError(f"k: expected shape {form}, got {tuple(a.shape)}")
        return tuple(int(n) for n in a.shape[:want - 2])

    def _check_rows(self, ks, vs, layers, lead, single):
        """Every K/V array (a latent layer's ``v`` must be None, any other layer's an array);
        returns the float dtype of a quantizing write, or None."""
        dtype = ks[0].dtype
        for kind, arrays in (("k", ks), ("v", vs)):
            for j, (a, index) in enumerate(zip(arrays, layers)):
                name = kind if single else f"{kind}[{j}]"
                cache = self._caches[index]
                if kind == "v" and self._latent(index):
                    if a is not None:
                        raise ValueError(f"{name}: expected None (attention layer {index} is a "
                                         f"latent cache: its rows go in k), "
                                         f"got {type(a).__name__}")
                    continue
                if kind == "v" and a is None:
                    raise ValueError(f"{name}: expected V rows (attention layer {index} has a "
                                     f"V plane), got None")
                if kind == "k" and j == 0:
                    src = self._source_dtype(name, dtype)   # k's own dtype named before v's
                want = lead + (int(cache.shape[2]), int(cache.shape[4]))
                if tuple(a.shape) != want:
                    raise ValueError(f"{name}: expected shape {list(want)}, "
                                     f"got {list(a.shape)}")
                if a.dtype != dtype:
                    raise ValueError(f"{name}: expected dtype {dtype} (as k), got {a.dtype}")
                if not a.flags.c_contiguous:
                    raise ValueError(f"{name}: expected a C-contiguous array")
        return src

    def _source_dtype(self, name, dtype):
        """The float dtype of a quantizing write of rows of ``dtype``, or None (plain)."""
        if dtype in (self._storage, self.dtype):
            return None
        if self._fp8 and dtype in self._float_dtypes:
            return self._float_dtypes[dtype]
        also = ", float32, float16 or bfloat16 (quantized)" if self._fp8 else ""
        raise ValueError(f"{name}: expected dtype {self.dtype}{also}, got {dtype}")

    def _check_room(self, state, counts) -> None:
        """Each active slot whose length the host knows (``state``'s host mirror) has room for
        its new tokens (``counts``: an int for every row, or one per row)."""
        n = state.active_batch_size
        if isinstance(counts, int):   # uniform: O(1) while every active length is known
            headroom = state._headroom_now()
            if headroom is not None and counts <= headroom:
                return
        new = state._host_lengths[:n] + counts
        over = np.flatnonzero(state._known[:n] & (new > self._max_len))
        if over.size:
            b = int(over[0])
            have = int(state._host_lengths[b])
            raise ValueError(f"k: expected at most {self._max_len - have} new tokens for slot "
                             f"{b} (length {have}), got {int(new[b]) - have}")

    def _check_positions(self, positions, lead, batch, counts, layers, stream):
        """Host positions, checked and flattened (int64), or the device array as it is."""
        windows = sorted({self._rings[a] for a in layers} - {0})
        return check_positions(positions, lead, batch, counts, self._max_len, windows,
                               self._device, stream)

    def _stage(self, staged, total):
        """Host positions into the staging buffer (grown, once, past its capacity); device
        positions as they are."""
        if not isinstance(staged, np.ndarray):
            return staged   # device positions
        if staged.shape[0] > self._positions.shape[0]:
            self._positions = self._device.xp.zeros(staged.shape[0], dtype=np.int32)
        upload(self._positions, staged.astype(np.int32))
        return self._positions[:total]

    def _launch(self, index, ks, vs, total, quantize, kwargs) -> None:
        op = ops.kv_write_fp8 if quantize else ops.kv_write

        def rows(a, cache):
            return None if a is None else a.reshape(total, cache.shape[2], cache.shape[4])

        if index is not None:
            g, p = self._where[index]
            cache = self._caches[index]
            op(self._groups[g], rows(ks[0], cache), rows(vs[0], cache), layers=p, **kwargs)
            return
        for group in self._groups:
            members = group.layer_indices
            op(group, [rows(ks[a], self._caches[a]) for a in members],
               [rows(vs[a], self._caches[a]) for a in members], **kwargs)
