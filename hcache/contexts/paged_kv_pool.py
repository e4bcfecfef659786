"""The paged KV pool of an attention stack: per-layer block arrays written through block tables
(docs/design.md §6).

Attention layer ``i`` (an ``attention_index``: its position among the layers that own a KV cache)
owns ``[num_blocks, C_i, H_i, block_size, D_i]`` (HND: K at ``[:, 0]``, V at ``[:, 1]``; a latent
MLA layer has ``C_i = 1``: ``[num_blocks, 1, 1, block_size, kv_lora_rank + qk_rope_head_dim]``, no
V). Block ids are shared by all layers (one :class:`KVBlockAllocator` hands them out), so a block
table row addresses every layer. With ``num_local_blocks``, the sliding-window layers
(``sliding_window`` set) form a second block space of that many blocks, addressed by a second
block table: blocks that left every window are freed there while the full layers keep theirs
(docs/design.md §6.7). Layers of one head dim, component count and block space form a
:class:`KVGroup` (first-seen order; a layer's row in it is its ``group_position``), the unit of
one write launch; a :class:`SlotSet` of a space's layers is the unit of one copy-on-write launch.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from .._checks import as_int, block_id_array, check_int, int32_array
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..config.caches import KVCacheConfig
from ..config.layers import kv_layer_list
from ..config.sizing import largest_fitting, paged_pool_nbytes
from ..dtypes import dtype_name, resolve_dtype, storage_dtype
from ..kv_scales import check_scale, source_dtype
from ..memory import check_fits
from ..ops.tables import KVGroup, SlotSet
from ..runtime.arrays import as_array, on_device
from ..runtime.device import launch_scope, resolve_device, settle, upload_ints, zeros
from ..runtime.stream_order import StreamOrder
from .paged_kv_rows import attention_index, check_rows, check_tables

__all__ = ["PagedKVPool"]


def _layer_configs(layer_configs) -> tuple:
    """``layer_configs`` (a sequence of :class:`KVLayerConfig`, or a :class:`KVCacheConfig`)
    as a tuple. Raises ``TypeError``."""
    if isinstance(layer_configs, KVCacheConfig):
        layer_configs = layer_configs.layer_configs
    return kv_layer_list("layer_configs", layer_configs)


class PagedKVPool:
    """Per-layer paged KV caches sharing one block-id space.

    Parameters
    ----------
    layer_configs : sequence of KVLayerConfig, or KVCacheConfig
        One entry per attention layer (its ``num_kv_heads``, ``head_dim`` and ``components``).
    num_blocks : int
        Blocks per layer (>= 1).
    block_size : int
        Tokens per block (>= 1).
    dtype : str or dtype
        One of the docs/design.md §2 dtypes. On CuPy, float8 is stored as ``uint8`` (same bytes).
    device : None, "cpu", "cuda" or "cuda:N"
    num_local_blocks : int, optional
        Blocks of the sliding-window layers' own block space (docs/design.md §6.7); default
        None: one space for every layer.
    extra_nbytes : int
        Device bytes its owner allocates along with it (a context's states), checked with the
        pool's before anything is allocated.

    Attributes
    ----------
    layers : tuple of arrays [num_blocks or num_local_blocks, C_i, H_i, block_size, D_i]
        Zero-initialised at construction; zero-copy views for a runtime's attention kernels.
    groups : tuple of KVGroup
        One per distinct (head dim, components, block space), in first-seen order;
        ``groups[g].layer_indices`` are the attention indices of its layers.
    local_layers : tuple of bool
        Per attention layer: addressed through the local block space.

    Raises
    ------
    TypeError, ValueError
        An argument has the wrong type or value.
    CacheCapacityError
        The pool does not fit in the memory available on the device (:meth:`nbytes_for`);
        nothing is allocated.
    """

    __copy__, __deepcopy__, __reduce_ex__ = refuse_copy, refuse_deepcopy, refuse_pickle

    def __init__(self, layer_configs, num_blocks: int, block_size: int, dtype="float16", *,
                 device=None, num_local_blocks=None, extra_nbytes: int = 0):
        configs = _layer_configs(layer_configs)
        self.layer_configs = configs
        self.num_blocks = as_int("num_blocks", num_blocks, 1)
        self.block_size = as_int("block_size", block_size, 1)
        self.dtype = resolve_dtype(dtype)
        self.device = resolve_device(device)
        self.order = StreamOrder()   # writes and block copies: one chain across streams
        self.num_local_blocks = (None if num_local_blocks is None
                                 else as_int("num_local_blocks", num_local_blocks, 1))
        check_fits("num_blocks", as_int("extra_nbytes", extra_nbytes) + paged_pool_nbytes(
            configs, self.num_blocks, self.block_size, self.dtype, self.num_local_blocks),
            self.device)
        xp = self.xp = self.device.xp
        self.storage_dtype = storage_dtype(self.dtype, xp)
        self.local_layers = tuple(self.num_local_blocks is not None
                                  and lc.sliding_window is not None for lc in configs)
        with self.device.scope():
            self.layers = tuple(
                zeros(self.device, (self.num_local_blocks if local else self.num_blocks,
                                    lc.components, lc.num_kv_heads, self.block_size,
                                    lc.head_dim), self.storage_dtype)
                for lc, local in zip(configs, self.local_layers))
            # (head dim, components, block space) -> attention indices, first-seen order
            by_key: dict = {}
            for a, (lc, local) in enumerate(zip(configs, self.local_layers)):
                by_key.setdefault((lc.head_dim, lc.components, local), []).append(a)
            members = list(by_key.values())
            self.groups = tuple(KVGroup([self.layers[a] for a in indices], layout="HND",
                                        layer_indices=indices) for indices in members)
            # One copy set per block space; None without layers there (a pure-Mamba model:
            # blocks carry only hashes).
            self._slots, self._local_slots = (
                SlotSet(pairs) if pairs else None
                for pairs in ([(a, a) for a, loc in zip(self.layers, self.local_layers)
                               if not loc],
                              [(a, a) for a, loc in zip(self.layers, self.local_layers) if loc]))
            # Host id lists for copy_blocks are uploaded here, so copies allocate nothing.
            self._copy_ids = xp.empty((2, max(self.num_blocks, self.num_local_blocks or 0)),
                                      dtype=np.int32)
            settle(self.device)
        # attention_index -> (group index, group_position)
        self._group_position = {a: (g, position) for g, indices in enumerate(members)
                                for position, a in enumerate(indices)}

    # --- sizing before allocation ---------------------------------------------------------

    @staticmethod
    def nbytes_for(layer_configs, num_blocks, block_size, dtype="float16", *,
                   num_local_blocks=None) -> int:
        """Device bytes a pool of these arguments allocates: its ``memory_report()
        ["total_bytes"]``, known before any allocation (with ``num_local_blocks``, the
        sliding-window layers at that many blocks). Raises as the constructor."""
        return paged_pool_nbytes(
            _layer_configs(layer_configs), as_int("num_blocks", num_blocks, 1),
            as_int("block_size", block_size, 1), resolve_dtype(dtype),
            None if num_local_blocks is None else as_int("num_local_blocks", num_local_blocks, 1))

    @staticmethod
    def num_blocks_for(layer_configs, block_size, budget, dtype="float16", *,
                       num_local_blocks=None) -> int:
        """The most blocks (of the full space; the local space, if any, stays at
        ``num_local_blocks``) whose pool fits in ``budget`` bytes, or 0 if not even one.
        ``TypeError`` / ``ValueError`` for a bad argument."""
        configs, budget = _layer_configs(layer_configs), as_int("budget", budget, 0)
        return largest_fitting(lambda n: PagedKVPool.nbytes_for(
            configs, n, block_size, dtype, num_local_blocks=num_local_blocks), budget)

    # --- derived values -----------------------------------------------------------------

    num_layers = property(lambda self: len(self.layers),
                          doc="Attention layers of the pool (``len(layers)``).")

    @property
    def has_local_space(self) -> bool:
        """Whether some layer lives in the local (sliding-window) block space."""
        return any(self.local_layers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id of the full space occupies across its layers (K and V, or a
        latent layer's one component)."""
        return sum(int(a.nbytes) for a, loc in zip(self.layers, self.local_layers)
                   if not loc) // self.num_blocks

    @property
    def bytes_per_local_block(self) -> int:
        """Bytes one local block id occupies across the sliding-window layers (0 without)."""
        if not self.has_local_space:
            return 0
        return sum(int(a.nbytes) for a, loc in zip(self.layers, self.local_layers)
                   if loc) // self.num_local_blocks

    @property
    def nbytes(self) -> int:
        """Bytes of the layers (the blocks); ``memory_report()["total_bytes"]`` adds the
        metadata."""
        return sum(int(a.nbytes) for a in self.layers)

    def get_layer(self, i: int):
        """The cache of attention layer ``i``, ``[num_blocks, C_i, H_i, block_size, D_i]`` (a
        view; writes through it are writes to the pool).

        Raises
        ------
        TypeError, IndexError
            ``i`` is not an int, or not in ``[0, num_layers)``.
        """
        return self.layers[attention_index(self.num_layers, i)]

    @property
    def metadata_nbytes(self) -> int:
        """Device bytes besides the layers: the group and copy tables, the copy-id staging."""
        slots = sum(int(s.device_infos.nbytes) for s in (self._slots, self._local_slots)
                    if s is not None)
        return int(sum(g.nbytes for g in self.groups) + slots + self._copy_ids.nbytes)

    def memory_report(self) -> dict:
        """Sizes in bytes: ``total_bytes`` (layers and metadata: what :meth:`nbytes_for`
        says), ``metadata_bytes``, per block (layers), per layer, and the head-dim groups."""
        return {
            "device": str(self.device), "dtype": dtype_name(self.dtype),
            "num_blocks": self.num_blocks, "block_size": self.block_size,
            "num_layers": self.num_layers, "bytes_per_block": self.bytes_per_block,
            "num_local_blocks": self.num_local_blocks or 0,
            "bytes_per_local_block": self.bytes_per_local_block,
            "total_bytes": self.nbytes + self.metadata_nbytes,
            "metadata_bytes": self.metadata_nbytes,
            "layer_bytes": [int(a.nbytes) for a in self.layers],
            "groups": [{"head_dim": g.head_dim, "components": g.components,
                        "layers": list(g.layer_indices),
                        "bytes": sum(int(a.nbytes) for a in g.layers)} for g in self.groups],
        }

    # --- commands -----------------------------------------------------------------------

    def write_kv(self, k, v=None, *, block_table, layer=None, seq_offsets=None, uniform_tokens=0,
                 batch=None, cache_lengths=None, positions=None, k_scale=None, v_scale=None,
                 status=None, stream=None, local_block_table=None):
        """Write new tokens' K and V through a block table (in place); ``write`` is an alias.

        Parameters
        ----------
        k, v : arrays [num_tokens, H_i, D_i], or sequences of them
            With ``layer=None``, one array per attention layer (one launch per head-dim group);
            with ``layer=i``, layer ``i``'s arrays (one launch). One dtype: the pool's storage
            dtype, or for an FP8 pool float32, float16 or bfloat16 rows quantized on write
            (``fp8(x / scale)``, docs/design.md §3.7). A latent layer's rows are ``k`` and its
            ``v`` is None (None in its place in a list, or ``v=None`` when every layer is
            latent).
        block_table : int32 [batch, max_blocks_per_seq]
            Position ``p`` of row ``b`` goes to block ``block_table[b, p // block_size]`` at
            offset ``p % block_size``; -1 entries are skipped.
        local_block_table : int32 [batch, max_blocks_per_seq], optional
            The same for the local block space (required when the pool has one): its -1
            entries are blocks that left the window.
        seq_offsets, uniform_tokens, batch, cache_lengths, positions, status, stream
            As in :func:`hcache.ops.kv_write` (ragged rows, first position of each row, explicit
            positions with -1 padding, count of skipped out-of-range tokens).
        k_scale, v_scale : float or float32 array, optional
            Scales of a quantizing write: a float, or a device table ``[num_layers]`` (per
            attention layer) or ``[num_layers, >= max H_i]`` (per head); None means 1.0 (the
            pool records no scales). Must be None for any other write; ``v_scale`` must be None
            when every written layer is latent.

        Raises
        ------
        IndexError
            ``layer`` is out of range.
        TypeError, ValueError
            An array has the wrong shape, dtype, array module or contiguity; a scale is given
            for a write that does not quantize or is not a valid scale (nothing written).
        """
        with launch_scope(self.device, stream):   # foreign arrays: stream after their producers
            checked = self.check_write(k, v, layer=layer, k_scale=k_scale, v_scale=v_scale)
            # index arrays of any library, viewed as this pool's (the op checks them)
            block_table, seq_offsets, cache_lengths, positions, local_block_table = (
                a if a is None else as_array(name, a, self.device) for name, a in (
                    ("block_table", block_table), ("seq_offsets", seq_offsets),
                    ("cache_lengths", cache_lengths), ("positions", positions),
                    ("local_block_table", local_block_table)))
        if checked is not None and seq_offsets is None and batch is None and \
                type(uniform_tokens) is int and check_int("uniform_tokens", uniform_tokens, 0):
            rows = (checked[1][0] if layer is None else checked[1]).shape[0]
            if rows % uniform_tokens:   # the rows past the last whole one would be dropped
                raise ValueError(f"k: expected a multiple of uniform_tokens ({uniform_tokens}) "
                                 f"rows, got {rows}")
        self.launch_write(checked, block_table=block_table, seq_offsets=seq_offsets,
                          uniform_tokens=uniform_tokens, batch=batch, cache_lengths=cache_lengths,
                          positions=positions, status=status, stream=stream,
                          local_block_table=local_block_table)

    write = write_kv
    block_size_tokens = property(lambda self: self.block_size, doc="Alias of block_size.")

    def check_write(self, k, v=None, *, layer=None, k_scale=None, v_scale=None, num_tokens=None):
        """The row and scale checks of :meth:`write_kv` (each layer's rows: ``num_tokens``, or the
        first ``k``'s); returns the checked call for :meth:`launch_write`. Foreign device arrays
        order the current stream after their producers: call it in the write's launch scope."""
        num_tokens = None if num_tokens is None else check_int("num_tokens", num_tokens, 0)
        if layer is not None:
            layer = attention_index(self.num_layers, layer, "layer")
        rows = check_rows(self.layer_configs, self.device, k, v, layer, self.dtype, num_tokens)
        if rows is None:
            return None  # no attention layer: nothing to write
        index, ks, vs, first = rows
        written = list(range(self.num_layers)) if layer is None else [layer]
        if v_scale is not None and all(self.layer_configs[a].components == 1 for a in written):
            raise ValueError(f"v_scale: expected None (latent layers have no V), "
                             f"got {type(v_scale).__name__}")
        src = source_dtype("k", first.dtype, self.dtype, self.xp)
        heads = max(lc.num_kv_heads for lc in self.layer_configs)
        scales = [check_scale(n, s, src is not None, self.device, self.num_layers, heads)
                  for n, s in (("k_scale", k_scale), ("v_scale", v_scale))]
        return index, ks, vs, src, scales

    def launch_write(self, checked, *, block_table, stream=None, local_block_table=None,
                     **rows) -> None:
        """Launch a write checked by :meth:`check_write`; ``rows``: the index arguments of
        :meth:`write_kv` (checked by the op before its first launch)."""
        if checked is not None and not (type(checked) is tuple and len(checked) == 5):
            raise TypeError(f"checked: expected the result of check_write, "
                            f"got {type(checked).__name__}")
        check_tables(block_table, local_block_table, self.has_local_space, self.xp)
        if checked is None:
            return
        attention_index, ks, vs, src, scales = checked
        op = ops.kv_write if src is None else ops.kv_write_fp8
        kwargs = dict(rows, stream=stream)
        tables = (block_table, local_block_table)
        if src is not None:
            kwargs.update(k_scale=scales[0], v_scale=scales[1], fp8_dtype=self.dtype,
                          src_dtype=src)
        with launch_scope(self.device, stream, self.order):
            if attention_index is not None:
                g, group_position = self._group_position[attention_index]
                op(self.groups[g], ks, vs, layers=group_position,
                   block_table=tables[self.local_layers[attention_index]], **kwargs)
                return
            # ops validates the shared index arrays on the first launch, before any write.
            for group in self.groups:
                indices = group.layer_indices
                op(group, [ks[a] for a in indices], [vs[a] for a in indices],
                   block_table=tables[self.local_layers[indices[0]]], **kwargs)

    def copy_blocks(self, src_ids, dst_ids, *, status=None, stream=None, local=False) -> None:
        """Copy whole blocks of every layer of a block space (the full one, or with ``local``
        the sliding-window layers'), ``dst[i] <- src[i]`` (copy-on-write), one launch.

        Parameters
        ----------
        src_ids, dst_ids : sequence of int [n], or int32 arrays of the pool's array module
            Host sequences (and NumPy arrays) are validated: ids in range, destinations
            distinct and disjoint from the sources. CuPy arrays are passed to the kernel as
            they are (no synchronisation): -1 is skipped, other out-of-range pairs are skipped
            and counted in ``status``.
        status : int32 [1], optional
        local : bool

        Raises
        ------
        IndexError
            A host id is out of range.
        TypeError, ValueError
            Wrong types or lengths, repeated destinations, a block both read and written, or
            ``local`` not a bool (or set on a pool without a local space).
        """
        if not isinstance(local, (bool, np.bool_)):
            raise TypeError(f"local: expected a bool, got {type(local).__name__}")
        if local and not self.has_local_space:
            raise ValueError("local: expected a pool with a local block space, got none")
        space = self.num_local_blocks if local else self.num_blocks
        with launch_scope(self.device, stream):   # device ids: stream after their producers
            src = self._copy_index("src_ids", src_ids, space)
            dst = self._copy_index("dst_ids", dst_ids, space)
        if src.shape[0] != dst.shape[0]:
            raise ValueError(f"dst_ids: expected {src.shape[0]} ids (one per source), "
                             f"got {dst.shape[0]}")
        if isinstance(src, np.ndarray) != isinstance(dst, np.ndarray):
            raise TypeError("src_ids, dst_ids: expected both host ids or both device arrays")
        host_ids = isinstance(src, np.ndarray)
        if host_ids:
            live = (src != -1) & (dst != -1)
            src, dst = src[live], dst[live]   # padding pairs are dropped on the host
            if np.unique(dst).shape[0] != dst.shape[0]:
                raise ValueError("dst_ids: expected distinct destination blocks, got repeats")
            both = np.isin(dst, src)
            if both.any():
                raise ValueError(f"dst_ids: expected no block that is also a source, got "
                                 f"{int(dst[both][0])}")
        int32_array("status", status, self.xp, min_len=1)   # before the ids are staged
        slots = self._local_slots if local else self._slots
        with launch_scope(self.device, stream, self.order):
            if slots is None:
                return  # no attention layer in the space: blocks hold no data
            if host_ids:
                n = src.shape[0]   # <= num_blocks: destinations are distinct
                upload_ints(self._copy_ids[0], src)
                upload_ints(self._copy_ids[1], dst)
                src, dst = self._copy_ids[0, :n], self._copy_ids[1, :n]
            ops.slot_copy(slots, src, dst, status=status, stream=stream)

    # --- internals ----------------------------------------------------------------------

    def _copy_index(self, name, ids, space):
        if self.xp is not np and on_device(ids):
            ids = as_array(name, ids, self.device)
            if ids.dtype != np.int32 or ids.ndim != 1:
                raise ValueError(f"{name}: expected a 1-D int32 array, got {ids.dtype} "
                                 f"{tuple(ids.shape)}")
            return ids
        return block_id_array(name, ids, space, padding=True).astype(np.int32)
