"""What the kernels read besides the caches: descriptor tables and the compaction plan's format.

A :class:`KVGroup` is the unit of one launch for attention data (docs/design.md §3.1): the layers
of one head dim and one component count (K and V, or one latent MLA vector), with a device array
of ``KVLayerInfo {uint64 data; int32 num_kv_heads; int32 max_seq_len; int32 ring_window; int32
reserved}`` (24 bytes) built once; ``ring_window`` is 0 for an unbounded layer and the window
``W`` (= ``max_seq_len``) of a ring-buffer layer. A :class:`SlotSet` is the unit of one launch
for whole-slot copies (Mamba states, lengths, paged blocks): a device array of ``SlotTensorInfo
{uint64 src, dst; int64 slot_bytes; int32 src_slots, dst_slots}``. Both are stored as
``uint64`` words because CuPy has no structured dtypes; the byte layout is the C struct's.

A compaction plan is an int32 array laid out as ``kernels/compact.cu`` says: a header of
:data:`PLAN_HEADER` words, the inverse mapping, done flags, then ``(src, dst)`` schedule pairs
where :data:`TMP` names the register temporary and :data:`CLEAR` a hole to zero.
"""

from __future__ import annotations

import numpy as np

from ..runtime.device import (
    Device,
    array_device,
    array_module_of,
    data_pointer,
    launch_scope,
    settle,
    to_host,
    upload,
)

__all__ = ["KVGroup", "SlotSet", "group_layers_by_head_dim", "pack_kv_layer_infos",
           "KV_LAYER_INFO_WORDS",
           "PLAN_HEADER", "TMP", "CLEAR", "compaction_plan_size", "plan_max_batch",
           "plan_schedule"]

_LAYOUTS = ("HND", "NHD")
_INT32_MAX = 2**31 - 1
MAX_GRID_Y = 65535  # layers of a group / tensors of a set: one grid.y index each

# --- the compaction plan (kernels/compact.cu: HC_PLAN_HEADER, HC_TMP, HC_CLEAR) ---------------

PLAN_HEADER = 4
TMP = -2
CLEAR = -3


def compaction_plan_size(max_batch: int) -> int:
    """int32 entries of a compaction plan for ``max_batch`` slots (see ``kernels/compact.cu``)."""
    return PLAN_HEADER + 8 * int(max_batch)


def plan_max_batch(plan) -> int:
    """The ``max_batch`` a plan of this length was made for."""
    return (int(plan.shape[0]) - PLAN_HEADER) // 8


def plan_schedule(plan) -> np.ndarray:
    """The plan's schedule as host int32 ``[count, 2]`` (src, dst) pairs; like the kernels,
    a count outside ``[0, 3 max_batch]`` (the schedule's capacity) is clamped to it."""
    host = to_host(plan)
    mb = plan_max_batch(host)
    n = min(max(int(host[1]), 0), 3 * mb)
    start = PLAN_HEADER + 2 * mb
    return host[start:start + 2 * n].reshape(n, 2)


# --- descriptor tables ------------------------------------------------------------------------


KV_LAYER_INFO_WORDS = 3   # uint64 words of one KVLayerInfo (24 bytes)


def pack_kv_layer_infos(pointers, num_kv_heads, max_seq_lens, ring_windows=None) -> np.ndarray:
    """Host ``uint64 [n, 3]`` array with the bytes of ``KVLayerInfo[n]`` (``ring_windows``:
    per layer 0, unbounded, or its window; default all 0)."""
    n = len(pointers)
    out = np.zeros((n, KV_LAYER_INFO_WORDS), dtype=np.uint64)
    if n:
        out[:, 0] = np.asarray(pointers, dtype=np.uint64)
        heads = np.asarray(num_kv_heads, dtype=np.uint64)
        seq = np.asarray(max_seq_lens, dtype=np.uint64)
        out[:, 1] = heads | (seq << np.uint64(32))
        if ring_windows is not None:
            out[:, 2] = np.asarray(ring_windows, dtype=np.uint64)
    return out


def _to_device(host: np.ndarray, xp):
    """A new ``xp`` array holding ``host`` (the descriptor tables, built once)."""
    out = xp.empty(host.shape, dtype=host.dtype)
    upload(out, host)
    return out


def _settle(xp, array) -> None:
    """A construction's end: the table uploads and fills it queued on the current stream have
    run (a host wait, once), so a launch on any stream reads them; a non-blocking stream is
    not ordered after the construction's."""
    if xp is not np:
        settle(Device("cuda", array_device(array)))


class KVGroup:
    """Attention layers sharing one head dim and one component count, launched together.

    Parameters
    ----------
    layers : list of arrays
        Per-layer caches, all of one dtype and one array module. ``layout="HND"``: each
        ``[num_slots, C, H_l, S, D]`` and C-contiguous (``H_l`` may differ between layers).
        ``layout="NHD"``: each ``[num_slots, C, S, H, D]``, any strides with a contiguous last
        axis, and the same strides for every layer (the continuous-batching buffer's views).
        For a paged pool, ``S`` is the block size and ``num_slots`` the number of blocks.
        ``C``, the components, is the same for every layer: 2 (K plane then V plane) or 1 (a
        latent MLA cache: one vector per token, no V).
    layout : {"HND", "NHD"}
    layer_indices : sequence of int, optional
        Labels of the layers (e.g. attention indices), ints in ``[0, 2**31)``; default
        ``0..n-1``.
    ring_windows : sequence of int, optional
        Per layer 0 (unbounded: position ``p`` at token ``p``) or ``W`` for a ring buffer of a
        sliding-window layer, whose token axis must be exactly ``W`` long: position ``p`` lives
        at ``p mod W`` (docs/design.md §3.9). Default: every layer unbounded. Ring and
        unbounded layers share one launch. Paged writes (a block table) ignore it.

    Attributes
    ----------
    components : int
        2 (K and V) or 1 (latent): the kernels' ``components`` argument.
    device_layer_infos : array, uint64 [num_layers, 3]
        The ``KVLayerInfo`` array on the layers' device (built once).
    device_layer_indices : array, int32 [num_layers]
        ``layer_indices`` on the device (built once): the row of a per-layer scale table that
        :func:`hcache.ops.kv_write_fp8` reads for each group position.
    """

    def __init__(self, layers, *, layout: str = "HND", layer_indices=None, ring_windows=None):
        if not layers:
            raise ValueError("layers: expected at least one layer, got 0")
        if len(layers) > MAX_GRID_Y:
            raise ValueError(f"layers: expected at most {MAX_GRID_Y} layers, got {len(layers)}")
        if layout not in _LAYOUTS:
            raise ValueError(f"layout: expected one of {_LAYOUTS}, got {layout!r}")
        first = layers[0]
        self.xp = array_module_of(first)
        self.layout = layout
        self.layers = list(layers)
        self.dtype = first.dtype
        self.head_dim = int(first.shape[-1])
        self.num_slots = int(first.shape[0])
        self.components = int(first.shape[1]) if first.ndim == 5 else 0
        heads, seqs = [], []
        for i, layer in enumerate(self.layers):
            if layer.ndim != 5 or layer.shape[1] not in (1, 2) \
                    or layer.shape[1] != self.components:
                want = self.components if self.components in (1, 2) else "1 or 2"
                raise ValueError(f"layers[{i}]: expected shape [slots, {want}, ., ., D] "
                                 f"(components as layers[0]), got {tuple(layer.shape)}")
            if layer.dtype != self.dtype or layer.shape[-1] != self.head_dim \
                    or layer.shape[0] != self.num_slots:
                raise ValueError(f"layers[{i}]: expected dtype {self.dtype}, {self.num_slots} "
                                 f"slots and head dim {self.head_dim}, got {layer.dtype}, "
                                 f"{layer.shape[0]} and {layer.shape[-1]}")
            if array_module_of(layer) is not self.xp:
                raise TypeError(f"layers[{i}]: expected a {self.xp.__name__} array, "
                                f"got {type(layer).__name__}")
            if 0 in layer.shape[2:]:
                # S = 0 would divide by zero in paged writes, H = 0 launch an empty grid.
                raise ValueError(f"layers[{i}]: expected at least one kv head, token and "
                                 f"head-dim element, got shape {tuple(layer.shape)}")
            if layout == "HND":
                if not layer.flags.c_contiguous:
                    raise ValueError(f"layers[{i}]: expected a C-contiguous HND cache")
                heads.append(int(layer.shape[2]))
                seqs.append(int(layer.shape[3]))
            else:
                if layer.strides != first.strides or layer.shape != first.shape \
                        or layer.strides[-1] != layer.itemsize:
                    raise ValueError(f"layers[{i}]: expected the strides and shape of layer 0 "
                                     "with a contiguous last axis")
                heads.append(int(layer.shape[3]))
                seqs.append(int(layer.shape[2]))
        self.num_kv_heads = tuple(heads)
        self.max_seq_lens = tuple(seqs)
        self.layer_indices = tuple(range(len(layers)) if layer_indices is None
                                   else (int(i) for i in layer_indices))
        if len(self.layer_indices) != len(self.layers):
            raise ValueError(f"layer_indices: expected {len(self.layers)} labels, "
                             f"got {len(self.layer_indices)}")
        if any(not 0 <= i <= _INT32_MAX for i in self.layer_indices):
            raise ValueError(f"layer_indices: expected labels in [0, {_INT32_MAX}], "
                             f"got {self.layer_indices}")
        rings = (0,) * len(self.layers) if ring_windows is None else tuple(
            int(w) for w in ring_windows)
        if len(rings) != len(self.layers):
            raise ValueError(f"ring_windows: expected {len(self.layers)} windows, "
                             f"got {len(rings)}")
        for i, (w, s) in enumerate(zip(rings, seqs)):
            if w not in (0, s):
                raise ValueError(f"ring_windows[{i}]: expected 0 (unbounded) or {s} (the "
                                 f"layer's token axis), got {w}")
        self.ring_windows = rings
        host = pack_kv_layer_infos([data_pointer(a) for a in self.layers], heads, seqs, rings)
        self.device_layer_infos = _to_device(host, self.xp)
        # The labels on the device: the scale row of each group position (kv_write_fp8).
        self.device_layer_indices = _to_device(np.asarray(self.layer_indices, np.int32), self.xp)
        # Per-call pointer tables (write sources, capture/restore tensors) are uploaded here,
        # so no call allocates device memory.
        # Flat: a table of n KVSrcInfo (2 words each) or n KVLayerInfo (3 words each).
        self.scratch_infos = self.xp.zeros(len(self.layers) * KV_LAYER_INFO_WORDS,
                                           dtype=np.uint64)
        self.scratch_host = None  # (stream key, table) that scratch_infos holds now
        self.scratch_captured = False  # a captured graph rewrites scratch_infos when replayed
        self.write_plan = None  # the last validated step of ops.kv_write (ops/write_plan.py)
        _settle(self.xp, self.scratch_infos)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_kv_heads(self) -> int:
        return max(self.num_kv_heads)

    @property
    def has_rings(self) -> bool:
        return any(self.ring_windows)

    def max_tokens(self, p: int) -> int:
        """The largest prefix a capture / restore can hold for group position ``p``: its token
        axis, or unbounded (int32 max) for a ring, which keeps the last ``W`` of any prefix."""
        return _INT32_MAX if self.ring_windows[p] else self.max_seq_lens[p]

    def held_tokens(self, p: int, n: int) -> int:
        """Tokens of an ``n``-token prefix that group position ``p`` holds: ``min(n, W)`` for a
        ring, ``n`` otherwise."""
        return min(n, self.ring_windows[p]) if self.ring_windows[p] else n

    @property
    def nbytes(self) -> int:
        """Device bytes of the group's tables (layer infos, labels, pointer scratch)."""
        return int(self.device_layer_infos.nbytes + self.device_layer_indices.nbytes
                   + self.scratch_infos.nbytes)

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, head) row: ``head_dim * itemsize``."""
        return self.head_dim * self.dtype.itemsize

    @property
    def byte_strides(self) -> tuple[int, int, int, int]:
        """``(slot, kv, head, token)`` strides in bytes for NHD groups; zeros for HND (derived
        per layer by the kernels from the head count, length and ``components``)."""
        if self.layout == "HND":
            return (0, 0, 0, 0)
        s = self.layers[0].strides
        return (int(s[0]), int(s[1]), int(s[3]), int(s[2]))


def group_layers_by_head_dim(head_dims, components=None) -> list[list[int]]:
    """Positions of ``head_dims`` grouped by value, groups in first-seen order; with
    ``components`` (one per layer, 2 or 1), by ``(head dim, components)``: a latent layer never
    shares a launch with a K/V layer of its head dim."""
    dims = [int(d) for d in head_dims]
    comps = [2] * len(dims) if components is None else [int(c) for c in components]
    if len(comps) != len(dims):
        raise ValueError(f"components: expected {len(dims)} values (one per layer), "
                         f"got {len(comps)}")
    groups: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(zip(dims, comps)):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


class SlotSet:
    """Tensors moved slot by slot in one launch (Mamba states, lengths, paged blocks).

    Parameters
    ----------
    pairs : list of (src, dst) arrays
        Slot ``i`` of a tensor is ``tensor[i]`` (leading axis), C-contiguous. ``src`` and
        ``dst`` of a pair have the same dtype and per-slot shape; their slot counts may differ
        (e.g. live states ``[max_requests, ...]`` and a cache ``[max_slots, ...]``). For an
        in-place set (compaction) pass ``(t, t)``.

    Attributes
    ----------
    device_infos : array, uint64 [num_tensors, 4]
        The ``SlotTensorInfo`` array on the tensors' device (built once).
    """

    def __init__(self, pairs):
        if not pairs:
            raise ValueError("pairs: expected at least one (src, dst) pair, got 0")
        if len(pairs) > MAX_GRID_Y:
            raise ValueError(f"pairs: expected at most {MAX_GRID_Y} pairs, got {len(pairs)}")
        self.pairs = [(s, d) for s, d in pairs]
        self.xp = array_module_of(self.pairs[0][0])
        host = self._table(self.pairs)
        self.slot_bytes = tuple(int(b) for b in host[:, 2])
        self.device_infos = _to_device(host, self.xp)
        _settle(self.xp, self.device_infos)

    def _table(self, pairs) -> np.ndarray:
        """Validate ``pairs`` and return their host ``SlotTensorInfo`` table."""
        host = np.zeros((len(pairs), 4), dtype=np.uint64)
        for i, (src, dst) in enumerate(pairs):
            for name, a in (("src", src), ("dst", dst)):
                if array_module_of(a) is not self.xp:
                    raise TypeError(f"pairs[{i}].{name}: expected a {self.xp.__name__} array, "
                                    f"got {type(a).__name__}")
                if a.ndim < 1 or not a.flags.c_contiguous:
                    raise ValueError(f"pairs[{i}].{name}: expected a C-contiguous array with a "
                                     "leading slot axis")
            if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
                raise ValueError(f"pairs[{i}]: expected src and dst of one dtype and slot shape, "
                                 f"got {src.dtype}{tuple(src.shape[1:])} and "
                                 f"{dst.dtype}{tuple(dst.shape[1:])}")
            slot_bytes = int(np.prod(src.shape[1:], dtype=np.int64)) * src.itemsize
            host[i] = (data_pointer(src), data_pointer(dst), slot_bytes,
                       int(src.shape[0]) | (int(dst.shape[0]) << 32))
        return host

    def rebind(self, pairs, *, stream=None) -> None:
        """Point the set at other tensors of the same per-slot sizes, reusing its device table.

        For per-call sets (captures into fresh arrays, restores from saved ones): the table is
        rewritten in place, ordered on ``stream``, so no descriptor memory is allocated.

        Raises
        ------
        ValueError
            A different number of pairs, or a pair whose slot size differs from the original.
        """
        pairs = [(s, d) for s, d in pairs]
        if len(pairs) != len(self.pairs):
            raise ValueError(f"pairs: expected {len(self.pairs)} pairs, got {len(pairs)}")
        host = self._table(pairs)
        if tuple(int(b) for b in host[:, 2]) != self.slot_bytes:
            raise ValueError(f"pairs: expected slot sizes {self.slot_bytes}, "
                             f"got {tuple(int(b) for b in host[:, 2])}")
        if isinstance(self.device_infos, np.ndarray):
            upload(self.device_infos, host)
        else:
            with launch_scope(Device("cuda", array_device(self.device_infos)), stream):
                upload(self.device_infos, host)
        self.pairs = pairs

    @property
    def num_tensors(self) -> int:
        return len(self.pairs)

    @property
    def max_slot_bytes(self) -> int:
        return max(self.slot_bytes)
