"""Typed launch wrappers, one per kernel (SPEC §3).

Each wrapper validates its arrays (shape, dtype, array module, contiguity), casts every scalar to
the C type of the kernel's parameter, computes the grid in one visible place and launches on the
given stream. On NumPy arrays with no explicit ``backend`` the call goes to the NumPy reference
(:mod:`hcache.reference`), which is the ``cpu`` backend; the signatures are the same.

``backend`` is anything with ``launch(family, name, grid, block, args)``: the CuPy launcher
below, or the host emulation of the test suite, which runs the same ``.cu`` through g++. The
argument tuples are identical for both: ``numpy`` scalars (``int32``, ``int64``, ``uint64``
for pointers; 0 is a null pointer).

None of these functions synchronizes the device or allocates device memory.
"""

from __future__ import annotations

import numpy as np

from . import _kernels
from . import reference as ref
from .device import Device, array_module_of, data_pointer, stream_scope

__all__ = ["BLOCK", "compaction_plan_size", "compaction_plan", "kv_compact", "slots_compact",
           "slot_copy", "kv_write", "kv_capture", "kv_restore", "kv_prefix_copy", "lengths_add",
           "CupyLauncher"]

BLOCK = 256          # threads per block for every kernel
MAX_GRID_X = 8192    # grid-stride loops cover the rest
MAX_GRID_Z = 64
compaction_plan_size = ref.compaction_plan_size


class CupyLauncher:
    """Launches through CuPy ``RawKernel`` on the current device and ``stream``."""

    def __init__(self, stream=None):
        self.stream = stream

    def _device(self):
        import cupy

        return Device("cuda", cupy.cuda.runtime.getDevice())

    def launch(self, family, name, grid, block, args):
        device = self._device()
        kernel = _kernels.get_function(family, name, device.index)
        with stream_scope(self.stream, device):
            kernel(grid, block, args)

    def upload(self, scratch, host: np.ndarray):
        """Copy a small host table into preallocated device memory, ordered on the stream."""
        with stream_scope(self.stream, self._device()):
            scratch[: host.shape[0]].set(host)


def _launcher(xp, backend, stream):
    if backend is not None:
        return backend
    if xp is np:
        return None
    return CupyLauncher(stream)


def _ptr(a) -> np.uint64:
    return np.uint64(0 if a is None else data_pointer(a))


def _i32(x) -> np.int32:
    return np.int32(int(x))


def _i64(x) -> np.int64:
    return np.int64(int(x))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _grid_x(work_items: int) -> int:
    """Blocks along x for ``work_items`` thread-sized items (grid-stride beyond the cap)."""
    return max(1, min(MAX_GRID_X, _ceil_div(work_items, BLOCK)))


def _grid_z(span_bytes: int) -> int:
    """Blocks along z splitting one (layer, kv, head) span of ``span_bytes`` bytes."""
    return max(1, min(MAX_GRID_Z, _ceil_div(span_bytes, 16 * BLOCK * 4)))


def _check_index_array(name, a, xp, *, min_len=0, ndim=1):
    if a is None:
        return
    if array_module_of(a) is not xp:
        raise TypeError(f"{name}: expected a {xp.__name__} array, got {type(a).__name__}")
    if a.dtype != np.int32:
        raise ValueError(f"{name}: expected dtype int32, got {a.dtype}")
    if a.ndim != ndim or (a.shape[0] if a.ndim else 0) < min_len:
        raise ValueError(f"{name}: expected {ndim}-D with at least {min_len} rows, "
                         f"got shape {tuple(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")


def _check_status(status, xp):
    if status is not None:
        _check_index_array("status", status, xp, min_len=1)


def _upload_table(run, group, host: np.ndarray):
    """Put a per-call pointer table into the group's preallocated scratch, stream-ordered.

    Skipped when the table equals the last one uploaded (an engine that reuses its K/V
    buffers pays for the upload once)."""
    if group.scratch_host is not None and np.array_equal(group.scratch_host, host):
        return
    if isinstance(group.scratch_infos, np.ndarray):
        group.scratch_infos[: host.shape[0]] = host
    else:
        run.upload(group.scratch_infos, host)
    group.scratch_host = host


# --- compaction -----------------------------------------------------------------------------

def compaction_plan(mapping, old_batch, new_batch, plan, *, lengths=None, stream=None,
                    backend=None):
    """Build the in-place move schedule of a batch compaction into ``plan``.

    Parameters
    ----------
    mapping : int32 [>= old_batch]
        ``mapping[old]`` = new slot in ``[0, new_batch)``, or -1 (evicted).
    old_batch, new_batch : int
        Batch sizes, each in ``[0, max_batch]``.
    plan : int32 [compaction_plan_size(max_batch)]
        Written in place: ``plan[0]`` = 0 (valid), 1 (not injective into ``[0, new_batch)``) or
        2 (bad batch sizes); the copy kernels do nothing for an invalid plan.
    lengths : int32 [max_batch], optional
        Current lengths, for the longest moved span (read by :func:`kv_compact`).
    """
    xp = array_module_of(plan)
    _check_index_array("plan", plan, xp, min_len=ref.PLAN_HEADER)
    max_batch = ref.plan_max_batch(plan)
    if plan.shape[0] != ref.compaction_plan_size(max_batch):
        raise ValueError(f"plan: expected length 4 + 8 * max_batch, got {plan.shape[0]}")
    _check_index_array("mapping", mapping, xp, min_len=old_batch)
    _check_index_array("lengths", lengths, xp, min_len=max_batch)
    run = _launcher(xp, backend, stream)
    if run is None:
        return ref.compaction_plan(mapping, old_batch, new_batch, plan, lengths=lengths)
    run.launch("compact", "hc_compaction_plan", (1, 1, 1), (1, 1, 1),
               (_ptr(mapping), _i32(old_batch), _i32(new_batch), _i32(max_batch),
                _ptr(lengths), _ptr(plan)))


def kv_compact(group, plan, lengths, *, stream=None, backend=None):
    """Move the first ``lengths[old]`` tokens of every kept slot of every layer of ``group``
    (one launch). ``group`` must be HND. In place; ``lengths`` are the pre-compaction lengths
    ``int32 [num_slots]``."""
    xp = group.xp
    if group.layout != "HND":
        raise ValueError("group: expected an HND group for compaction, got NHD")
    _check_index_array("plan", plan, xp, min_len=ref.PLAN_HEADER)
    _check_index_array("lengths", lengths, xp, min_len=group.num_slots)
    run = _launcher(xp, backend, stream)
    if run is None:
        return ref.kv_compact(group, plan, lengths)
    span = max(group.max_seq_lens) * group.row_bytes
    grid = (2 * group.max_kv_heads, group.num_layers, _grid_z(span))
    run.launch("compact", "hc_kv_compact", grid, (BLOCK, 1, 1),
               (_ptr(group.device_layer_infos), _ptr(plan), _i32(ref.plan_max_batch(plan)),
                _ptr(lengths), _i32(group.row_bytes), _i32(group.num_slots)))


def slots_compact(slots, plan, *, stream=None, backend=None):
    """Move whole slots of every tensor of ``slots`` by the plan (one launch); slots below
    ``new_batch`` that receive nothing are zeroed. In place (each pair is ``(t, t)``)."""
    xp = slots.xp
    _check_index_array("plan", plan, xp, min_len=ref.PLAN_HEADER)
    for i, (s, d) in enumerate(slots.pairs):
        if s is not d and data_pointer(s) != data_pointer(d):
            raise ValueError(f"slots.pairs[{i}]: expected an in-place pair (t, t)")
    run = _launcher(xp, backend, stream)
    if run is None:
        return ref.slots_compact(slots, plan)
    grid = (_grid_x(_ceil_div(slots.max_slot_bytes, 16)), slots.num_tensors, 1)
    run.launch("compact", "hc_slots_compact", grid, (BLOCK, 1, 1),
               (_ptr(slots.device_infos), _ptr(plan), _i32(ref.plan_max_batch(plan))))


# --- slot copies ----------------------------------------------------------------------------

def slot_copy(slots, src_idx, dst_idx, *, status=None, stream=None, backend=None):
    """``dst_t[dst_idx[i]] = src_t[src_idx[i]]`` for every tensor pair of ``slots`` and every
    ``i`` (one launch).

    Parameters
    ----------
    slots : SlotSet
    src_idx, dst_idx : int32 [num_pairs]
        -1 in either marks padding (skipped). Other out-of-range entries are skipped and
        counted in ``status[0]``. No pair may write a slot another pair reads.
    status : int32 [1], optional
        Incremented once per out-of-range pair.
    """
    xp = slots.xp
    _check_index_array("src_idx", src_idx, xp)
    _check_index_array("dst_idx", dst_idx, xp, min_len=src_idx.shape[0])
    _check_status(status, xp)
    n = int(src_idx.shape[0])
    run = _launcher(xp, backend, stream)
    if run is None:
        return ref.slot_copy(slots, src_idx[:n], dst_idx[:n], status=status)
    if n == 0:
        return
    grid = (_grid_x(n * _ceil_div(slots.max_slot_bytes, 16)), slots.num_tensors, 1)
    run.launch("slot_copy", "hc_slot_copy", grid, (BLOCK, 1, 1),
               (_ptr(slots.device_infos), _ptr(src_idx), _ptr(dst_idx), _i32(n),
                _ptr(status)))


# --- KV writes ------------------------------------------------------------------------------

def _check_rows(name, a, group, layer, num_tokens, xp):
    heads = group.num_kv_heads[layer]
    want = (num_tokens, heads, group.head_dim)
    if array_module_of(a) is not xp:
        raise TypeError(f"{name}: expected a {xp.__name__} array, got {type(a).__name__}")
    if tuple(a.shape) != want:
        raise ValueError(f"{name}: expected shape {want}, got {tuple(a.shape)}")
    if a.dtype != group.dtype:
        raise ValueError(f"{name}: expected dtype {group.dtype}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")


def kv_write(group, k, v, *, layers=None, seq_offsets=None, uniform_tokens=0, batch=None,
             cache_lengths=None, positions=None, row_to_slot=None, block_table=None,
             status=None, stream=None, backend=None):
    """Write new tokens' K and V into the caches of ``group`` (one launch).

    Parameters
    ----------
    group : KVGroup
        HND caches ``[num_slots, 2, H_l, S, D]`` (contiguous slots; with ``block_table`` a paged
        pool whose ``S`` is the block size) or NHD caches ``[num_slots, 2, S, H, D]``.
    k, v : arrays ``[num_tokens, H_l, D]``
        One layer's new rows when ``layers`` is an int; else lists, one per layer of the group.
    layers : int or None
        The group position of the one layer to write; ``None`` writes every layer.
    seq_offsets : int32 [batch + 1], optional
        Ragged rows: token ``t`` belongs to row ``b`` when ``seq_offsets[b] <= t <
        seq_offsets[b+1]``; tokens past ``seq_offsets[batch]`` are padding.
    uniform_tokens : int
        Without ``seq_offsets``: every row has this many tokens (``b = t // uniform_tokens``).
    batch : int, optional
        Number of rows (default ``len(seq_offsets) - 1`` or ``num_tokens // uniform_tokens``).
    cache_lengths : int32 [batch], optional
        Row ``b``'s first token goes to position ``cache_lengths[b]`` (default 0).
    positions : int32 [num_tokens], optional
        Explicit positions (override ``cache_lengths``); -1 marks padding.
    row_to_slot : int32 [batch], optional
        Slot of each row for contiguous caches (default ``b``); -1 skips the row.
    block_table : int32 [batch, max_blocks_per_seq], optional
        Paged pools: position ``p`` of row ``b`` lives in block ``block_table[b, p // S]`` at
        ``p % S``; -1 skips.
    status : int32 [1], optional
        Incremented once per token skipped for being out of range (padding is not counted).

    Raises
    ------
    ValueError, TypeError
        A shape, dtype or array module does not match the group.
    """
    xp = group.xp
    if layers is None:
        positions_in_group = list(range(group.num_layers))
        ks, vs = list(k), list(v)
        if len(ks) != group.num_layers or len(vs) != group.num_layers:
            raise ValueError(f"k, v: expected {group.num_layers} arrays each, "
                             f"got {len(ks)} and {len(vs)}")
    else:
        if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)):
            raise TypeError(f"layers: expected an int or None, got {type(layers).__name__}")
        if not 0 <= int(layers) < group.num_layers:
            raise IndexError(f"layers: expected a group position in [0, {group.num_layers}), "
                             f"got {int(layers)}")
        positions_in_group = [int(layers)]
        ks, vs = [k], [v]
    num_tokens = int(ks[0].shape[0]) if ks[0].ndim else 0
    for j, li in enumerate(positions_in_group):
        _check_rows(f"k[{j}]", ks[j], group, li, num_tokens, xp)
        _check_rows(f"v[{j}]", vs[j], group, li, num_tokens, xp)
    if batch is None:
        batch = (int(seq_offsets.shape[0]) - 1 if seq_offsets is not None
                 else (num_tokens // uniform_tokens if uniform_tokens > 0 else 0))
    if batch < 0:
        raise ValueError(f"batch: expected >= 0, got {batch}")
    if seq_offsets is None and uniform_tokens <= 0 and positions is None:
        raise ValueError("seq_offsets: expected seq_offsets, uniform_tokens > 0 or positions")
    _check_index_array("seq_offsets", seq_offsets, xp, min_len=batch + 1)
    _check_index_array("cache_lengths", cache_lengths, xp, min_len=batch)
    _check_index_array("positions", positions, xp, min_len=num_tokens)
    _check_index_array("row_to_slot", row_to_slot, xp, min_len=batch)
    _check_index_array("block_table", block_table, xp, min_len=batch, ndim=2)
    _check_status(status, xp)
    run = _launcher(xp, backend, stream)
    kwargs = dict(seq_offsets=seq_offsets, uniform_tokens=uniform_tokens, batch=batch,
                  cache_lengths=cache_lengths, positions=positions, row_to_slot=row_to_slot,
                  block_table=block_table, status=status)
    if run is None:
        return ref.kv_write(group, k, v, layers=layers, **kwargs)
    if num_tokens == 0:
        return
    if layers is None:
        table = np.array([[data_pointer(a), data_pointer(b)] for a, b in zip(ks, vs)],
                         dtype=np.uint64)
        _upload_table(run, group, table)
        srcs, k_ptr, v_ptr, offset = group.scratch_infos, np.uint64(0), np.uint64(0), 0
    else:
        srcs, k_ptr, v_ptr, offset = None, _ptr(ks[0]), _ptr(vs[0]), int(layers)
    max_blocks = int(block_table.shape[1]) if block_table is not None else 0
    heads = max(group.num_kv_heads[i] for i in positions_in_group)
    rows = num_tokens * 2 * heads * _ceil_div(group.row_bytes, 16)
    grid = (_grid_x(rows), len(positions_in_group), 1)
    slot_s, kv_s, head_s, tok_s = group.byte_strides
    run.launch("kv_write", "hc_kv_write", grid, (BLOCK, 1, 1),
               (_ptr(group.device_layer_infos), _i32(offset), _ptr(srcs), k_ptr, v_ptr,
                _ptr(seq_offsets), _i32(uniform_tokens), _i32(batch), _i32(num_tokens),
                _ptr(cache_lengths), _ptr(positions), _ptr(row_to_slot), _ptr(block_table),
                _i32(max_blocks), _i32(group.num_slots), _i32(group.row_bytes),
                _i64(slot_s), _i64(kv_s), _i64(head_s), _i64(tok_s), _ptr(status)))


# --- prompt-cache capture / restore ---------------------------------------------------------

def kv_prefix_copy(group, slot, num_tokens, compact, *, to_cache, status=None, stream=None,
                   backend=None):
    """Copy tokens ``[0, num_tokens)`` of ``slot`` of every layer of ``group`` to or from
    ``compact`` (one ``[2, H_l, n, D]`` tensor per layer, ``n >= num_tokens``), one launch.
    Prefer :func:`kv_capture` / :func:`kv_restore`, which validate the slot and length first.
    """
    xp = group.xp
    if group.layout != "HND":
        raise ValueError("group: expected an HND group, got NHD")
    if len(compact) != group.num_layers:
        raise ValueError(f"compact: expected {group.num_layers} tensors, got {len(compact)}")
    for j, (t, heads) in enumerate(zip(compact, group.num_kv_heads)):
        if array_module_of(t) is not xp:
            raise TypeError(f"compact[{j}]: expected a {xp.__name__} array, "
                            f"got {type(t).__name__}")
        if t.ndim != 4 or t.shape[0] != 2 or t.shape[1] != heads \
                or t.shape[3] != group.head_dim:
            raise ValueError(f"compact[{j}]: expected shape [2, {heads}, n, {group.head_dim}], "
                             f"got {tuple(t.shape)}")
        if t.dtype != group.dtype:
            raise ValueError(f"compact[{j}]: expected dtype {group.dtype}, got {t.dtype}")
        if not t.flags.c_contiguous:
            raise ValueError(f"compact[{j}]: expected a C-contiguous array")
    _check_status(status, xp)
    run = _launcher(xp, backend, stream)
    if run is None:
        return ref.kv_prefix_copy(group, slot, num_tokens, compact, to_cache=to_cache,
                                  status=status)
    if num_tokens == 0:
        return
    from .layout import pack_kv_layer_infos

    table = pack_kv_layer_infos([data_pointer(t) for t in compact],
                                [int(t.shape[1]) for t in compact],
                                [int(t.shape[2]) for t in compact])
    _upload_table(run, group, table)
    grid = (2 * group.max_kv_heads, group.num_layers, _grid_z(num_tokens * group.row_bytes))
    run.launch("kv_capture", "hc_kv_prefix_copy", grid, (BLOCK, 1, 1),
               (_ptr(group.device_layer_infos), _ptr(group.scratch_infos), _i32(slot),
                _i32(num_tokens), _i32(group.row_bytes), _i32(group.num_slots),
                _i32(1 if to_cache else 0), _ptr(status)))


def _check_slot_and_length(group, slot, num_tokens):
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
        raise TypeError(f"slot: expected an int, got {type(slot).__name__}")
    if not 0 <= int(slot) < group.num_slots:
        raise IndexError(f"slot: expected a slot in [0, {group.num_slots}), got {int(slot)}")
    cap = min(group.max_seq_lens)
    if not 0 <= int(num_tokens) <= cap:
        raise ValueError(f"num_tokens: expected a length in [0, {cap}], got {int(num_tokens)}")


def kv_capture(group, slot, num_tokens, out, *, stream=None, backend=None):
    """Copy tokens ``[0, num_tokens)`` of ``slot`` of every layer into ``out`` (list of
    ``[2, H_l, num_tokens, D]``), one launch. Raises ``IndexError`` / ``ValueError`` before
    touching anything."""
    _check_slot_and_length(group, slot, num_tokens)
    for j, t in enumerate(out):
        if t.ndim == 4 and t.shape[2] != num_tokens:
            raise ValueError(f"out[{j}]: expected {num_tokens} tokens, got {t.shape[2]}")
    kv_prefix_copy(group, int(slot), int(num_tokens), out, to_cache=False, stream=stream,
                   backend=backend)


def kv_restore(group, saved, slot, *, stream=None, backend=None):
    """Copy every ``saved[l]`` (``[2, H_l, n, D]``, one ``n`` for all) into tokens ``[0, n)``
    of ``slot`` of layer ``l``, one launch. Validates everything before touching anything."""
    if len(saved) != group.num_layers:
        raise ValueError(f"saved: expected {group.num_layers} tensors, got {len(saved)}")
    lengths = {int(t.shape[2]) for t in saved if t.ndim == 4}
    if len(lengths) > 1:
        raise ValueError(f"saved: expected one token count for every layer, got {sorted(lengths)}")
    n = lengths.pop() if lengths else 0
    _check_slot_and_length(group, slot, n)
    kv_prefix_copy(group, int(slot), n, saved, to_cache=True, stream=stream, backend=backend)


# --- lengths --------------------------------------------------------------------------------

def lengths_add(lengths, n, increment, max_len, *, status=None, stream=None, backend=None):
    """``lengths[:n] += increment`` on the device, all or nothing.

    Parameters
    ----------
    lengths : int32 [>= n]
    increment : int, or int32 [n] array of the same module as ``lengths``
    max_len : int
        A commit that would take any length outside ``[0, max_len]`` is refused: nothing
        changes and ``status[0]`` is incremented.
    """
    xp = array_module_of(lengths)
    _check_index_array("lengths", lengths, xp, min_len=n)
    _check_status(status, xp)
    scalar = 0
    inc = None
    if isinstance(increment, (int, np.integer)) and not isinstance(increment, bool):
        scalar = int(increment)
    else:
        inc = increment
        _check_index_array("increment", inc, xp, min_len=n)
    run = _launcher(xp, backend, stream)
    if run is None:
        return ref.lengths_add(lengths, n, increment if inc is None else inc[:n], max_len,
                               status=status)
    run.launch("lengths", "hc_lengths_add", (1, 1, 1), (1, 1, 1),
               (_ptr(lengths), _i32(n), _ptr(inc), _i32(scalar), _i32(max_len), _ptr(status)))
