"""The device side of a hybrid continuous-batching manager (docs/design.md §5.1).

A :class:`HybridBlockStore` holds, for ``num_blocks`` blocks (one per live sequence), one KV cache
per cache-owning attention layer ``[num_blocks, C_a, H_a, L_a, D_a]`` (HND, as the contiguous-slot
managers: heads, head dims, components and ring windows may differ per layer), grouped by
``(head dim, components)`` for one launch per group, and the recurrent and conv states of every
recurrent layer ``[num_blocks, ...]`` (a kind the layers lack has no buffer). Block ``b`` of every
cache and state belongs to the same sequence. It also holds the index buffers of the batch in
flight, the descriptor tables of the state copies and the lock of the manager. No method
allocates device memory after construction.
"""

from __future__ import annotations

import threading

import numpy as np

from .. import ops
from ..dtypes import storage_dtype
from ..ops.tables import KVGroup, SlotSet, group_layers_by_head_dim
from ..runtime.device import launch_scope, settle, upload_ints, zeros
from ..runtime.stream_order import StreamOrder

__all__ = ["HybridBlockStore", "STATE_KINDS"]

STATE_KINDS = ("recurrent", "conv")


def _kind_sets(kinds: tuple) -> list[tuple]:
    """The kind combinations a state write may name: each kind alone, and all of them."""
    return [(k,) for k in kinds] + ([kinds] if len(kinds) > 1 else [])


class HybridBlockStore:
    """Caches, states, batch index buffers and the lock of one hybrid continuous manager.

    Parameters
    ----------
    device : Device
    config : HybridCacheConfig
        ``max_batch_size`` is the number of blocks.

    Attributes
    ----------
    caches : tuple of arrays
        Per attention index, ``[num_blocks, C, H, L, D]`` (``L``: ``max_sequence_length`` or
        the layer's ring window), zeroed at construction.
    groups : tuple of KVGroup
        One per ``(head dim, components)``, first-seen order; ``layer_indices`` are attention
        indices.
    positions : tuple of (int, int)
        ``positions[attention_index] = (group, group position)``.
    states : dict
        ``{"recurrent": [num_mamba, num_blocks, heads, head_dim, state_size], "conv":
        [num_mamba, num_blocks, conv_dim, conv_kernel]}``, only the kinds the layers have.
    state_views : dict
        ``{kind: tuple of the per-layer views [num_blocks, ...]}`` of ``states``.
    lookup_table, cache_lengths : array, int32 [num_blocks]
        Row -> block and row -> committed tokens of the batch in flight.
    seq_offsets : array, int32 [num_blocks + 1]
        Row offsets of a ragged write.
    order : StreamOrder
    lock : threading.Condition
    """

    def __init__(self, device, config):
        xp = device.xp
        kv, mamba, n = config.kv, config.mamba, config.max_batch_size
        self.device, self.num_blocks = device, n
        self.max_seq_len = kv.max_sequence_length
        rings = kv.layer_ring_windows
        with launch_scope(device, None):   # the current stream: construction takes none
            self.caches = tuple(
                zeros(device, (n, lc.components, lc.num_kv_heads, s, lc.head_dim),
                      storage_dtype(kv.dtype, xp))
                for lc, s in zip(kv.layer_configs, kv.layer_cache_lengths))
            members = group_layers_by_head_dim([lc.head_dim for lc in kv.layer_configs],
                                               [lc.components for lc in kv.layer_configs])
            self.groups = tuple(KVGroup([self.caches[a] for a in ids], layer_indices=ids,
                                        ring_windows=[rings[a] for a in ids]) for ids in members)
            where = {a: (g, p) for g, ids in enumerate(members) for p, a in enumerate(ids)}
            self.positions = tuple(where[a] for a in range(len(self.caches)))
            self.states, self.state_views = {}, {}
            if mamba is not None and mamba.num_layers:
                shapes = {"recurrent": (mamba.recurrent_state_shape, mamba.ssm_dtype),
                          "conv": (mamba.conv_state_shape, mamba.conv_dtype)}
                self.states = {kind: zeros(device, (mamba.num_layers, n) + shape,
                                           storage_dtype(dt, xp))
                               for kind, (shape, dt) in shapes.items() if all(shape)}
            self.state_views = {kind: tuple(pool[m] for m in range(mamba.num_layers))
                                for kind, pool in self.states.items()}
            self.lookup_table = xp.zeros((n,), dtype=np.int32)
            self.cache_lengths = xp.zeros((n,), dtype=np.int32)
            self.seq_offsets = xp.zeros((n + 1,), dtype=np.int32)
            self._build_state_copies(xp, n)
            settle(device)
        self.lock = threading.Condition(threading.RLock())
        self.order = StreamOrder()

    def _build_state_copies(self, xp, n: int) -> None:
        """The tables of the claim's zeroing and of the state writes, built once: a write
        rebinds the sources of the set of its scope (one layer / every layer) and kinds."""
        self.state_sets: dict = {}
        self._bound: dict = {}   # (every, kinds) -> the sources + views its table points at
        self.zero_set = None
        if not self.states:
            return
        kinds = tuple(self.states)
        self.row_ids = xp.zeros((n,), dtype=np.int32)          # src rows 0..batch-1
        upload_ints(self.row_ids, np.arange(n))
        self.zero_rows = xp.zeros((n,), dtype=np.int32)        # src row 0 of a zero tensor
        self.claimed = xp.zeros((n,), dtype=np.int32)          # dst blocks of a claim
        self.zero_states = {k: zeros(self.device, (1,) + s.shape[2:], s.dtype)
                            for k, s in self.states.items()}
        self.zero_set = SlotSet([(self.zero_states[k], view) for k in kinds
                                 for view in self.state_views[k]])
        for combo in _kind_sets(kinds):
            for every in (False, True):
                views = [v for k in combo for v in (self.state_views[k] if every
                                                    else self.state_views[k][:1])]
                self.state_sets[every, combo] = SlotSet([(v, v) for v in views])

    # --- queries ----------------------------------------------------------------------------

    @property
    def num_mamba_layers(self) -> int:
        return int(next(iter(self.states.values())).shape[0]) if self.states else 0

    @property
    def kv_nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self.caches)

    def state_nbytes(self, kind: str) -> int:
        return int(self.states[kind].nbytes) if kind in self.states else 0

    @property
    def metadata_nbytes(self) -> int:
        """Device bytes besides caches and states: index buffers, layer tables, the zero
        state rows and the descriptor tables of the state copies."""
        index = self.lookup_table.nbytes + self.cache_lengths.nbytes + self.seq_offsets.nbytes
        tables = sum(g.nbytes for g in self.groups)
        if self.states:
            index += self.row_ids.nbytes + self.zero_rows.nbytes + self.claimed.nbytes
            tables += sum(int(z.nbytes) for z in self.zero_states.values())
            tables += sum(int(s.device_infos.nbytes)
                          for s in [self.zero_set, *self.state_sets.values()])
        return int(index + tables)

    # --- commands (checked by the caller, run under its lock) -------------------------------

    def load_batch(self, blocks: np.ndarray, lengths: np.ndarray, stream) -> None:
        """``lookup_table[:batch] = blocks``, ``cache_lengths[:batch] = lengths``, in place."""
        with launch_scope(self.device, stream, self.order):
            upload_ints(self.lookup_table, blocks)
            upload_ints(self.cache_lengths, lengths)

    def clear_states(self, blocks: list, stream) -> None:
        """Zero every state of ``blocks`` (one launch; nothing without states)."""
        if self.zero_set is None or not blocks:
            return
        with launch_scope(self.device, stream, self.order):
            upload_ints(self.claimed, np.asarray(blocks, dtype=np.int64))
            ops.slot_copy(self.zero_set, self.zero_rows[:len(blocks)],
                          self.claimed[:len(blocks)], stream=stream)

    def write_kv(self, writes, *, batch: int, counts, ragged: bool, stream) -> None:
        """Write new tokens at each row's committed length through the lookup table.

        Parameters
        ----------
        writes : dict
            ``{group: (positions, ks, vs)}``: one launch per group; ``positions`` is a group
            position (one layer, ``ks`` / ``vs`` arrays) or None (every layer, lists). Rows
            checked by the caller: ``[batch * new_tokens, H, D]`` or ragged ``[total, H, D]``;
            ``vs`` None for a latent group.
        counts : numpy.ndarray, int64 [batch]
            New tokens of each row (the ragged row offsets).
        """
        rows = dict(batch=batch, cache_lengths=self.cache_lengths[:batch],
                    row_to_slot=self.lookup_table[:batch], stream=stream)
        with launch_scope(self.device, stream, self.order):
            if ragged:
                upload_ints(self.seq_offsets, np.concatenate([[0], np.cumsum(counts)]))
                rows["seq_offsets"] = self.seq_offsets[:batch + 1]
            else:
                rows["uniform_tokens"] = int(counts[0]) if batch else 0
            for g, (position, ks, vs) in writes.items():
                ops.kv_write(self.groups[g], ks, vs, layers=position, **rows)

    def write_states(self, every: bool, combo: tuple, sources: list, views: list, *,
                     batch: int, stream) -> None:
        """``views[t][lookup_table[i]] = sources[t][i]`` for every tensor ``t`` and row
        ``i < batch`` (one launch). ``sources`` checked by the caller (``[batch, ...]`` of the
        view's dtype and slot shape, C-contiguous)."""
        slots = self.state_sets[every, combo]
        # The table of the last rebind stays valid while the same array objects come back (an
        # engine's preallocated state outputs): an array never changes its buffer or shape, and
        # the set keeps its sources alive, so identity means the same pointers and row counts.
        last = self._bound.get((every, combo))
        with launch_scope(self.device, stream, self.order):
            if last is None or len(last) != len(sources) + len(views) \
                    or any(a is not b for a, b in zip(last, sources + views)):
                slots.rebind(list(zip(sources, views)), stream=stream)
                self._bound[every, combo] = sources + views
            ops.slot_copy(slots, self.row_ids[:batch], self.lookup_table[:batch], stream=stream)
