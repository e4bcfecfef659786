"""The batch handed out by a hybrid continuous-batching ``fetch`` (docs/design.md §5.1).

A :class:`ContinuousBatchingHybridCollection` is a non-owning view of one fetched batch: the rows'
seq_ids, the device ``lookup_table`` (row -> block) and ``cache_lengths`` (row -> committed tokens
at fetch time), per decoder layer the KV cache and the recurrent / conv state pools that the
engine's kernels bind (indexed by ``lookup_table``), and the batched writes ``write_kv`` (one
launch per head-dim group) and ``write_states`` (one launch). Active from ``fetch`` until the
manager's ``step``; an ended collection keeps its views but refuses writes.
"""

from __future__ import annotations

import numpy as np

from ..runtime.arrays import as_array
from ..runtime.device import stream_handle
from .fetched_batch import FetchedBatch, check_room, ragged_token_counts
from .hybrid_store import STATE_KINDS

__all__ = ["ContinuousBatchingHybridCollection"]


class ContinuousBatchingHybridCollection(FetchedBatch):
    """One fetched batch of a ``ContinuousBatchingHybridCacheManager``; built only by its
    ``fetch``.

    Attributes
    ----------
    seq_ids : tuple of int
        The sequence of each row, in fetch order.
    lookup_table : array, int32 [batch]
        Device array: ``lookup_table[row]`` = the block of the row's sequence in every cache
        and state pool. A view of a buffer refilled by the next ``fetch``.
    cache_lengths : array, int32 [batch]
        Device array: committed tokens of each row at fetch time.
    """

    __slots__ = ("_routes",)

    def __init__(self, manager, store, seq_ids, host_blocks, host_lengths, routes):
        super().__init__(manager, store, seq_ids, host_blocks, host_lengths)
        self._routes = routes

    # --- queries ----------------------------------------------------------------------------

    def kv_cache(self, layer):
        """The KV cache decoder ``layer`` reads (its owner's under ``kv_sharing``): ``[num_blocks,
        C, H, L, D]`` (``C`` 2, or 1 for a latent MLA layer; ``L`` the ring window of a ring
        layer, else ``max_seq_len``); index it with ``lookup_table``. Raises ``TypeError`` /
        ``IndexError`` for a bad layer, ``ValueError`` for a layer without attention."""
        return self._store.caches[self._routes.attention_index(layer)]

    def key_cache(self, layer):
        """``kv_cache(layer)[:, 0]``: keys ``[num_blocks, H, L, D]`` (latents of an MLA layer)."""
        return self.kv_cache(layer)[:, 0]

    def value_cache(self, layer):
        """``kv_cache(layer)[:, 1]``; ``ValueError`` for a latent (MLA) layer, which has no V."""
        cache = self.kv_cache(layer)
        if cache.shape[1] != 2:
            raise ValueError(f"layer: expected a layer with values, got layer {layer}, a latent "
                             f"(MLA) layer (keys only)")
        return cache[:, 1]

    def recurrent_state(self, layer):
        """Recurrent state pool of decoder ``layer``, ``[num_blocks, heads, head_dim,
        state_size]``; row ``i``'s state is block ``lookup_table[i]``. ``ValueError`` for a layer
        without one."""
        return self._store_view("recurrent", layer)

    def conv_state(self, layer):
        """Conv state pool of decoder ``layer``, ``[num_blocks, conv_dim, conv_kernel]``; see
        :meth:`recurrent_state`."""
        return self._store_view("conv", layer)

    def _store_view(self, kind, layer, name="layer"):
        m = self._routes.mamba_index(layer, name)
        if kind not in self._store.states:
            raise ValueError(f"{name}: expected a layer with a {kind} state, got layer {layer}, "
                             f"whose recurrent layers have none")
        return self._store.state_views[kind][m]

    # --- commands ---------------------------------------------------------------------------

    def write_kv(self, layer, k, v=None, *, seq_lengths=None, stream=None) -> None:
        """Append new tokens' K/V at each row's committed length, through ``lookup_table``.

        Token ``t`` of row ``i`` lands at position ``host_cache_lengths[i] + t`` (entry ``p mod
        W`` of a ring layer). Writing does not commit: ``step`` does.

        Parameters
        ----------
        layer : int or None
            A decoder layer that owns its KV cache (one launch), or None: every cache-owning
            attention layer in decoder order, ``k`` and ``v`` lists (one launch per head-dim
            group).
        k, v : arrays
            Uniform ``[batch, new_tokens, H, D]`` or, with ``seq_lengths``, ragged
            ``[total_tokens, H, D]`` (``H``, ``D`` the layer's); the cache's storage dtype,
            C-contiguous, the manager's array module. A latent (MLA) layer takes its rows as
            ``k`` and ``v`` must be None (None in its place in the list).
        seq_lengths : host ints [batch], optional
            New tokens of each row (ragged).
        stream : optional
            Stream of the launches; use the stream of ``fetch``.

        Raises
        ------
        ValueError
            The collection is ended; a shape, dtype or list length is wrong; some row would pass
            ``max_seq_len``; ``layer`` shares another layer's cache or has no attention.
        TypeError
            ``layer`` is not an int or None, an array has the wrong module, ``stream`` is bad.
        IndexError
            ``layer`` is out of range.
        """
        store, routes = self._store, self._routes
        stream_handle(stream)
        with store.lock:   # held across the launch: a concurrent step cannot end the batch
            self._check_active("write_kv")
            every = layer is None
            indices = (range(len(store.caches)) if every
                       else [routes.owned_attention_index(layer)])
            ks = self._as_list("k", k, len(indices)) if every else [k]
            vs = self._as_list("v", v, len(indices), optional=True) if every else [v]
            ragged = seq_lengths is not None
            if ragged:
                counts = ragged_token_counts(seq_lengths, self.batch_size, store.max_seq_len)
            rows, tokens = [], None
            for j, a in enumerate(indices):
                kn, vn = (f"k[{j}]", f"v[{j}]") if every else ("k", "v")
                key, value = self._kv_rows(a, kn, vn, ks[j], vs[j], ragged, stream)
                t = key.shape[0] if ragged else key.shape[1]
                if tokens is not None and t != tokens:
                    raise ValueError(f"{kn}: expected {tokens} tokens (as k[0]), got {t}")
                tokens = t
                rows.append((a, key, value))
            if tokens is None:   # no cache-owning attention layer: nothing to write
                return
            if ragged and int(counts.sum()) != tokens:
                raise ValueError(f"{'k[0]' if every else 'k'}: expected {int(counts.sum())} "
                                 f"tokens (the sum of seq_lengths), got {tokens}")
            if not ragged:
                counts = np.full(self.batch_size, tokens, dtype=np.int64)
            check_room("k", self, counts, store.max_seq_len)
            if not counts.any():
                return
            writes: dict = {}
            for a, key, value in rows:
                g, p = store.positions[a]
                heads, size = key.shape[-2:]
                key = key.reshape(-1, heads, size)
                value = None if value is None else value.reshape(-1, heads, size)
                if every:
                    _, ks_g, vs_g = writes.setdefault(g, (None, [], []))
                    ks_g.append(key)
                    vs_g.append(value)
                else:
                    writes[g] = (p, key, value)
            store.write_kv(writes, batch=self.batch_size, counts=counts, ragged=ragged,
                           stream=stream)

    def write_states(self, layer, recurrent=None, conv=None, *, stream=None) -> None:
        """Set each row's recurrent and / or conv state of one or every recurrent layer
        (one launch for every tensor): block ``lookup_table[i]`` of the pool gets row ``i``.

        Parameters
        ----------
        layer : int or None
            A recurrent (Mamba, linear-attention, short-conv) decoder layer, or None: every
            recurrent layer in decoder order, ``recurrent`` and ``conv`` lists.
        recurrent, conv : arrays ``[batch, *state_shape]``, optional
            The new states, of the pool's storage dtype, C-contiguous, the manager's array
            module; None leaves that kind as it is (at least one is needed).
        stream : optional

        Raises
        ------
        ValueError
            The collection is ended; both are None; a shape, dtype or list length is wrong; the
            layers have no state of a given kind; ``layer`` is not a recurrent layer.
        TypeError, IndexError
            As :meth:`write_kv`.
        """
        store = self._store
        stream_handle(stream)
        with store.lock:
            self._check_active("write_states")
            every = layer is None
            if not every:
                self._routes.mamba_index(layer)
            given = {k: a for k, a in zip(STATE_KINDS, (recurrent, conv)) if a is not None}
            if not given:
                raise ValueError("recurrent, conv: expected at least one state, got None twice")
            n = store.num_mamba_layers if every else 1
            sources, views = [], []
            for kind in STATE_KINDS:
                if kind not in given:
                    continue
                if kind not in store.states:
                    raise ValueError(f"{kind}: expected None (the recurrent layers have no "
                                     f"{kind} state), got {type(given[kind]).__name__}")
                pools = (store.state_views[kind] if every
                         else [self._store_view(kind, layer)])
                arrays = self._as_list(kind, given[kind], n) if every else [given[kind]]
                for j, (a, view) in enumerate(zip(arrays, pools)):
                    name = f"{kind}[{j}]" if every else kind
                    sources.append(self._state_rows(name, a, view, stream))
                    views.append(view)
            store.write_states(every, tuple(k for k in STATE_KINDS if k in given), sources,
                               views, batch=self.batch_size, stream=stream)

    # --- checks -----------------------------------------------------------------------------

    def _check_active(self, what: str) -> None:
        if not self.is_active:
            raise ValueError(f"{what}: expected the batch in flight, got an ended collection")

    @staticmethod
    def _as_list(name, values, n, optional=False) -> list:
        if values is None and optional:
            return [None] * n
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"{name}: expected a list of {n} arrays (layer=None), "
                            f"got {type(values).__name__}")
        if len(values) != n:
            raise ValueError(f"{name}: expected {n} arrays (one per layer), got {len(values)}")
        return list(values)

    def _kv_rows(self, a, kn, vn, key, value, ragged, stream):
        store = self._store
        cache = store.caches[a]
        heads, size, latent = cache.shape[2], cache.shape[4], cache.shape[1] == 1
        key = as_array(kn, key, store.device, stream)
        self._check_rows(kn, key, heads, size, ragged, cache.dtype)
        if latent:
            if value is not None:
                raise ValueError(f"{vn}: expected None (a latent MLA layer stores keys only), "
                                 f"got {type(value).__name__}")
            return key, None
        if value is None:
            raise ValueError(f"{vn}: expected values shaped as {kn}, got None")
        value = as_array(vn, value, store.device, stream)
        self._check_rows(vn, value, heads, size, ragged, cache.dtype)
        if key.shape != value.shape:
            raise ValueError(f"{vn}: expected the shape of {kn} {tuple(key.shape)}, "
                             f"got {tuple(value.shape)}")
        return key, value

    def _state_rows(self, name, a, view, stream):
        if type(a) is not self._store.device.xp.ndarray:   # foreign arrays: viewed, checked
            a = as_array(name, a, self._store.device, stream)
        want = (self.batch_size,) + tuple(view.shape[1:])
        if tuple(a.shape) != want:
            raise ValueError(f"{name}: expected shape {list(want)}, got {tuple(a.shape)}")
        if a.dtype != view.dtype:
            raise ValueError(f"{name}: expected dtype {view.dtype}, got {a.dtype}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous array")
        return a
