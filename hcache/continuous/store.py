"""The device side of a continuous-batching manager, shared with its batches (docs/design.md §5).

A :class:`KVBlockStore` holds ``blocks_buf``, the one NHD head-dim group of its per-layer views
(a decoder layer is its ``group_position``), the index buffers of the batch in flight and the lock
of the manager. The manager fills the index buffers in ``fetch``; a
:class:`~hcache.continuous.collection.ContinuousBatchingKVCacheCollection` writes through
:meth:`KVBlockStore.write`. No method allocates device memory after construction.
"""

from __future__ import annotations

import threading

import numpy as np

from .. import ops
from .._checks import exact_int
from ..dtypes import storage_dtype
from ..ops.tables import KVGroup
from ..runtime.device import launch_scope, settle, upload_ints, zeros
from ..runtime.stream_order import StreamOrder

__all__ = ["KVBlockStore"]


class KVBlockStore:
    """``blocks_buf``, its head-dim group, the batch index buffers and the lock of one manager.

    Parameters
    ----------
    device : Device
    dtype : numpy.dtype
        The resolved cache dtype.
    num_blocks, num_layers, max_seq_len, num_heads, head_size : int
        Each >= 1 (checked by the manager).
    ring_window : int
        0, or ``W < max_seq_len``: every layer of a block is then a ring of ``W`` tokens
        (position ``p`` at entry ``p mod W``; docs/design.md §5, §3.9).
    components : int
        2 (K and V) or 1 (an MLA cache: K only).

    Attributes
    ----------
    device : Device
    dtype : numpy.dtype
        The cache dtype.
    blocks : array [num_blocks, C, num_layers, T, num_heads, head_size]
        ``blocks_buf`` (``C = components``), zeroed at construction; it never moves (``T``:
        ``max_seq_len``, or the ring window).
    group : KVGroup
        One NHD group of the per-layer views ``blocks[:, :, layer]``, ``[num_blocks, C,
        max_seq_len, num_heads, head_size]``: row (``group_position``) ``layer`` is decoder
        layer ``layer``, so one launch serves any layer.
    lookup_table, cache_lengths : array, int32 [num_blocks]
        Row -> block and row -> committed tokens of the batch in flight, refilled by every
        ``fetch``.
    seq_offsets : array, int32 [num_blocks + 1]
        Row offsets of a ragged write, refilled by every ragged write.
    order : StreamOrder
        Chains the manager's uploads and launches across streams, and orders a released
        block's reuse after the work queued before its release.
    lock : threading.Condition
        Over a re-entrant lock: guards the manager's bookkeeping, and a write holds it across
        its launch so that ``step`` cannot end the batch half-way.
    """

    def __init__(self, device, dtype, num_blocks: int, num_layers: int, max_seq_len: int,
                 num_heads: int, head_size: int, ring_window: int = 0, components: int = 2):
        xp = device.xp
        self.device, self.dtype = device, dtype
        self._max_seq_len, self.ring_window = max_seq_len, ring_window
        tokens = ring_window or max_seq_len
        with launch_scope(device, None):   # the current stream: construction takes none
            self.blocks = zeros(device, (num_blocks, components, num_layers, tokens,
                                         num_heads, head_size), storage_dtype(dtype, xp))
            self.group = KVGroup([self.blocks[:, :, layer] for layer in range(num_layers)],
                                 layout="NHD", ring_windows=[ring_window] * num_layers)
            self.lookup_table = xp.zeros((num_blocks,), dtype=np.int32)
            self.cache_lengths = xp.zeros((num_blocks,), dtype=np.int32)
            self.seq_offsets = xp.zeros((num_blocks + 1,), dtype=np.int32)
            settle(device)
        self.lock = threading.Condition(threading.RLock())
        self.order = StreamOrder()   # the manager's device work: one chain across streams
        self._batch_views: dict = {}   # batch -> its views of the lengths, table, offsets

    @property
    def num_layers(self) -> int:
        return int(self.blocks.shape[2])

    @property
    def max_seq_len(self) -> int:
        """Tokens a sequence may hold (its ring keeps the last ``ring_window`` of them)."""
        return self._max_seq_len

    @property
    def index_nbytes(self) -> int:
        """Device bytes of ``lookup_table`` and ``cache_lengths``."""
        return int(self.lookup_table.nbytes + self.cache_lengths.nbytes)

    @property
    def metadata_nbytes(self) -> int:
        """Device bytes besides ``blocks``: the index buffers and the group's layer tables."""
        return self.index_nbytes + int(self.seq_offsets.nbytes) + self.group.nbytes

    def check_layer(self, layer) -> int:
        """``layer`` as a decoder layer in ``[0, num_layers)``.

        Raises
        ------
        TypeError
            ``layer`` is not an int.
        IndexError
            ``layer`` is out of range.
        """
        layer = exact_int("layer", layer)
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer: expected a layer in [0, {self.num_layers}), got {layer}")
        return layer

    def kv_view(self, kv: int, layer):
        """``blocks[:, kv, layer]``, ``[num_blocks, T, num_heads, head_size]`` (``kv``
        0 for keys, 1 for values; ``T`` as in ``blocks``). Raises like :meth:`check_layer`,
        and ``ValueError`` for values of an MLA cache (it has none)."""
        layer = self.check_layer(layer)
        if kv >= self.blocks.shape[1]:
            raise ValueError("value_cache: expected a cache with values, got an MLA cache "
                             "(is_mla: keys only)")
        return self.blocks[:, kv, layer]

    def load_batch(self, blocks: np.ndarray, lengths: np.ndarray, stream) -> None:
        """``lookup_table[:batch] = blocks``, ``cache_lengths[:batch] = lengths`` (host to
        device, on ``stream``), in place."""
        with launch_scope(self.device, stream, self.order):
            upload_ints(self.lookup_table, blocks)
            upload_ints(self.cache_lengths, lengths)

    def write(self, layer: int, key, value, *, batch: int, counts, ragged: bool,
              src_dtype=None, scales=(None, None), stream) -> None:
        """Write new tokens of decoder ``layer`` for the ``batch`` rows of the batch in flight
        at their committed lengths (one launch, in place).

        Parameters
        ----------
        key, value : arrays
            Checked by the caller: ``[batch, new_tokens, num_heads, head_size]``, or
            ``[total_tokens, num_heads, head_size]`` if ``ragged``; ``value`` is None for an
            MLA cache.
        counts : numpy.ndarray, int64 [batch]
            New tokens of each row (used for the ragged row offsets).
        src_dtype : numpy.dtype, optional
            The float dtype of rows quantized into an FP8 cache (:func:`hcache.ops.kv_write_fp8`
            with ``scales``, checked by the caller); None copies rows of the cache dtype.
        """
        heads, size = self.group.num_kv_heads[0], self.group.head_dim
        views = self._batch_views.get(batch)   # the same views every layer: step plans
        if views is None:                      # of ops.kv_write key on them
            views = self._batch_views[batch] = (self.cache_lengths[:batch],
                                                self.lookup_table[:batch],
                                                self.seq_offsets[:batch + 1])
        rows = dict(layers=layer, batch=batch, cache_lengths=views[0], row_to_slot=views[1],
                    stream=stream)
        if src_dtype is not None:
            op = ops.kv_write_fp8
            rows.update(k_scale=scales[0], v_scale=scales[1], fp8_dtype=self.dtype,
                        src_dtype=src_dtype)
        else:
            op = ops.kv_write
        with launch_scope(self.device, stream, self.order):
            if ragged:
                upload_ints(self.seq_offsets, np.concatenate([[0], np.cumsum(counts)]))
                op(self.group, key, value, seq_offsets=views[2], **rows)
            else:
                op(self.group, key.reshape(-1, heads, size),
                   None if value is None else value.reshape(-1, heads, size),
                   uniform_tokens=int(key.shape[1]), **rows)
