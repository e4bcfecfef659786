"""The batch handed out by a continuous-batching ``fetch`` (docs/design.md §5).

A :class:`ContinuousBatchingKVCacheCollection` is a non-owning view of one fetched batch: the
rows' seq_ids, the device ``lookup_table`` (row -> block) and ``cache_lengths`` (row -> committed
tokens at fetch time), per-layer K/V views of the manager's ``blocks_buf`` and a ``write`` that
appends new tokens with one kernel launch. It is *active* from ``fetch`` until the manager's
``step`` ends it; an ended collection keeps its ``key_cache`` / ``value_cache`` views (they view
``blocks_buf``, which never moves) but refuses ``write`` and ``step``.
"""

from __future__ import annotations

import numpy as np

from ..kv_scales import check_scale, source_dtype
from ..runtime import _cuda
from ..runtime.arrays import as_array
from ..runtime.device import stream_handle
from .fetched_batch import FetchedBatch, check_room, ragged_token_counts

__all__ = ["ContinuousBatchingKVCacheCollection"]


class ContinuousBatchingKVCacheCollection(FetchedBatch):
    """One fetched batch of a ``ContinuousBatchingKVCacheManager``.

    Built only by the manager's ``fetch``; do not construct it directly. It reads and writes
    the manager's device buffers through the :class:`~hcache.continuous.store.KVBlockStore`
    that the manager hands it.

    Attributes
    ----------
    seq_ids : tuple of int
        The sequence of each batch row, in fetch order.
    lookup_table : array, int32 [batch]
        Device array (NumPy on cpu): ``lookup_table[row]`` = the block holding row's sequence.
        A view of a buffer preallocated by the manager and refilled by the next ``fetch``, so it
        is meaningful only while this collection is active.
    cache_lengths : array, int32 [batch]
        Device array: committed tokens of each row at fetch time (where ``write`` puts the
        row's first new token). Same lifetime as ``lookup_table``.
    """

    __slots__ = ()

    # --- queries ----------------------------------------------------------------------------

    @property
    def max_cache_length(self) -> int:
        """The longest committed length in the batch (0 for an empty cache)."""
        return int(self._lengths.max()) if self._lengths.size else 0

    def key_cache(self, layer: int):
        """Keys of decoder layer ``layer``: a view ``[num_blocks, max_seq_len, num_heads,
        head_size]`` of ``blocks_buf[:, 0, layer]`` (index it with ``lookup_table``).

        Raises
        ------
        TypeError
            ``layer`` is not an int.
        IndexError
            ``layer`` is outside ``[0, num_layers)``.
        """
        return self._store.kv_view(0, layer)

    def value_cache(self, layer: int):
        """Values of decoder layer ``layer``: a view of ``blocks_buf[:, 1, layer]``; see
        :meth:`key_cache`. Raises ``ValueError`` for an MLA cache (``is_mla``: keys only)."""
        return self._store.kv_view(1, layer)

    # --- command ----------------------------------------------------------------------------

    def write(self, layer: int, key, value=None, *, seq_lengths=None, stream=None) -> None:
        """MAX's name of :meth:`write_kv` (rows of the cache dtype, or float rows of an FP8
        cache quantized with scale 1.0); errors name ``key`` / ``value``."""
        self._write(layer, key, value, ("key", "value"), seq_lengths, None, None, stream)

    def write_kv(self, layer: int, k, v=None, *, seq_lengths=None, k_scale=None, v_scale=None,
                 stream=None) -> None:
        """Append new tokens of one layer at each row's committed length (one kernel launch).

        Token ``t`` of row ``i`` lands at position ``host_cache_lengths[i] + t`` of block
        ``blocks[i]``. Writing does not commit: ``step`` decides how many of the written tokens
        each row keeps (``valid_lengths``).

        Parameters
        ----------
        layer : int
            Decoder layer in ``[0, num_layers)``.
        k, v : arrays
            Uniform: ``[batch, new_tokens, num_heads, head_size]`` (every row gets
            ``new_tokens``). Ragged (with ``seq_lengths``): ``[total_tokens, num_heads,
            head_size]``, row ``i``'s tokens after those of rows ``< i``. C-contiguous, the
            manager's array module, one dtype: the manager's (on cuda a float8 or bfloat16
            cache that CuPy cannot type is written from arrays of its storage dtype, see
            :func:`hcache.dtypes.storage_dtype`), or for an FP8 cache float32, float16 or
            bfloat16 rows quantized on write (docs/design.md §3.7). An MLA cache
            (``kv_params.is_mla``) takes its latent rows as ``k`` and ``v`` must be None; any
            other cache requires ``v``.
        seq_lengths : host ints [batch], optional
            New tokens of each row for a ragged write (their sum is ``total_tokens``). The row
            offsets go to a device buffer preallocated by the manager.
        k_scale, v_scale : float or float32 array, optional
            Quantization scales of float rows written into an FP8 cache (each element is
            stored as ``fp8(x / scale)``): a float for every head, or a device table
            ``[num_layers]`` (per layer) or ``[num_layers, >= num_heads]`` (per head) whose row
            ``layer`` is used. None means 1.0: the manager records no scales (the caller keeps
            them for its attention kernel). Must be None for any other write (``v_scale`` also
            for an MLA cache).
        stream : optional
            Stream of the launch (docs/design.md §2); use the stream of ``fetch``. Ignored on cpu.

        Raises
        ------
        ValueError
            The collection is ended or not this manager's in-flight batch; a shape or dtype
            does not match; some row would pass ``max_seq_len``; a scale is given for a write
            that does not quantize, is not finite and > 0, or a table has the wrong shape or
            dtype. Nothing is written.
        TypeError
            ``layer`` is not an int, an array or scale table has the wrong array module, or
            ``stream`` is not a stream.
        IndexError
            ``layer`` is outside ``[0, num_layers)``.
        """
        self._write(layer, k, v, ("k", "v"), seq_lengths, k_scale, v_scale, stream)

    def _write(self, layer, key, value, names, seq_lengths, k_scale, v_scale, stream) -> None:
        if seq_lengths is None and k_scale is None and v_scale is None \
                and self._plain_write(layer, key, value, stream):
            return   # the common decode write, checked and launched in one pass
        store = self._store
        stream_handle(stream)   # validates ``stream`` (on cpu too) before anything
        with store.lock:   # held across the launch: a concurrent step cannot end the batch
            if not self.is_active:
                raise ValueError("write: expected the batch in flight, got an ended collection")
            layer = store.check_layer(layer)
            group = store.group
            heads, size = group.num_kv_heads[0], group.head_dim
            ragged = seq_lengths is not None
            if ragged:
                counts = ragged_token_counts(seq_lengths, self.batch_size, store.max_seq_len)
            key = as_array(names[0], key, store.device, stream)
            self._check_rows(names[0], key, heads, size, ragged)
            src = source_dtype(names[0], key.dtype, store.dtype, group.xp)  # k before v
            if group.components == 1:   # MLA: the latent rows are the keys; no V plane
                if value is not None:
                    raise ValueError(f"{names[1]}: expected None (an MLA cache stores keys "
                                     f"only), got {type(value).__name__}")
                if v_scale is not None:
                    raise ValueError(f"v_scale: expected None (an MLA cache stores keys "
                                     f"only), got {type(v_scale).__name__}")
            elif value is None:
                raise ValueError(f"{names[1]}: expected values shaped as {names[0]}, got None")
            else:
                value = as_array(names[1], value, store.device, stream)
                self._check_rows(names[1], value, heads, size, ragged)
                if key.shape != value.shape:
                    raise ValueError(f"{names[1]}: expected the shape of {names[0]} "
                                     f"{tuple(key.shape)}, got {tuple(value.shape)}")
                if key.dtype != value.dtype:
                    raise ValueError(f"{names[1]}: expected dtype {key.dtype} (as "
                                     f"{names[0]}), got {value.dtype}")
            scales = [check_scale(n, s, src is not None, store.device, store.num_layers, heads,
                                  stream)
                      for n, s in (("k_scale", k_scale), ("v_scale", v_scale))]
            if ragged and int(counts.sum()) != key.shape[0]:
                raise ValueError(f"{names[0]}: expected {int(counts.sum())} tokens (the sum of "
                                 f"seq_lengths), got {key.shape[0]}")
            if not ragged:
                counts = np.full(self.batch_size, int(key.shape[1]), dtype=np.int64)
            check_room(names[0], self, counts, store.max_seq_len)
            if counts.any():
                store.write(layer, key, value, batch=self.batch_size, counts=counts,
                            ragged=ragged, src_dtype=src, scales=scales, stream=stream)

    def _plain_write(self, layer, key, value, stream) -> bool:
        """A uniform write of rows of the cache's storage dtype, this device's, shaped and
        contiguous as required, with room in every row (the rows' room is computed once per
        batch): checked inline and launched. False (nothing done) for anything else, which
        :meth:`_write` then judges in full."""
        store = self._store
        group = store.group
        array, want_dtype = group.xp.ndarray, group.dtype
        if type(layer) is not int or type(key) is not array or key.ndim != 4:
            return False
        tokens = key.shape[1]
        want = (len(self.seq_ids), tokens, group.num_kv_heads[0], group.head_dim)
        rows = (key,) if group.components == 1 and value is None else (key, value)
        if group.components == 1 and value is not None or tokens == 0:
            return False
        rt = _cuda.runtime() if store.device.is_cuda else None
        for a in rows:
            if type(a) is not array or a.shape != want or a.dtype != want_dtype \
                    or not a.flags.c_contiguous \
                    or rt is not None and rt.array_device(a) != store.device.index:
                return False
        if tokens > self._room:
            return False
        if stream is not None:
            stream_handle(stream)
        with store.lock:   # held across the launch: a concurrent step cannot end the batch
            if not self.is_active or not 0 <= layer < store.num_layers:
                return False
            store.write(layer, key, value, batch=want[0], counts=None, ragged=False,
                        stream=stream)
        return True
