"""Continuous batching for every model hcache supports: one block per sequence in every KV cache
and every recurrent-state pool (docs/design.md §5.1).

:class:`ContinuousBatchingHybridCacheManager` runs the cycle of the seed's
:class:`~hcache.continuous.manager.ContinuousBatchingKVCacheManager` (MAX's ``claim`` -> (``fetch``
-> writes -> ``step``) ... -> ``release``) over the layout of a
:class:`~hcache.config.caches.HybridCacheConfig` (or an HF ``config.json``): attention layers may
differ in heads, head dim, ring window and component count (latent MLA), and a claimed sequence
owns, besides its KV blocks, one slot of every recurrent state (Mamba / SSM, conv, linear
attention / KDA, short conv), zeroed by ``claim``. Block ``b`` is the same sequence in every cache
and state pool, so one ``lookup_table`` indexes all of them.

The protocol's rules are the seed's: seq_ids from a counter that never repeats, one batch in
flight shared by all threads (``BatchInFlightError``, or ``wait=True``), no release of an
in-flight sequence, one re-entrant lock with a condition around all bookkeeping, writes that hold
it across their launches: both managers compose one
:class:`~hcache.continuous.batch_protocol.BatchProtocol` (the seed's
:class:`~hcache.continuous.sequences.SequenceBlocks` inside); the device side is a
:class:`~hcache.continuous.hybrid_store.HybridBlockStore`.
"""

from __future__ import annotations

from .._checks import INT32_MAX, as_int, check_index
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..config.caches import HybridCacheConfig, hybrid_config_from_hf
from ..config.routes import LayerRoutes
from ..config.sizing import continuous_hybrid_manager_nbytes, largest_fitting
from ..memory import check_fits
from ..rings import ring_start
from ..runtime.device import resolve_device, stream_handle
from ..slots.hybrid import KVHeadDimGroupView
from .batch_protocol import BatchProtocol
from .hybrid_collection import ContinuousBatchingHybridCollection
from .hybrid_store import HybridBlockStore

__all__ = ["ContinuousBatchingHybridCacheManager", "ContinuousBatchingHybridCollection"]


class ContinuousBatchingHybridCacheManager:
    """KV caches and recurrent states of up to ``config.max_batch_size`` live sequences.

    Parameters
    ----------
    config : HybridCacheConfig
        The layout by decoder layer; ``max_batch_size`` is the number of blocks and
        ``kv.max_sequence_length`` the most tokens of one sequence (``max_seq_len``). Ring
        layers (``kv.ring_windows``) hold the last ``W`` tokens, position ``p`` at entry
        ``p mod W``; lengths stay absolute.
    device : None, "cpu", "cuda" or "cuda:N"

    Raises
    ------
    TypeError
        ``config`` is not a :class:`HybridCacheConfig`.
    CacheCapacityError
        The caches do not fit in the memory available (:meth:`nbytes`); nothing is allocated.
    """

    __copy__, __deepcopy__, __reduce_ex__ = refuse_copy, refuse_deepcopy, refuse_pickle

    def __init__(self, config, *, device=None):
        if not isinstance(config, HybridCacheConfig):
            raise TypeError(f"config: expected HybridCacheConfig, got {type(config).__name__}")
        self._config = config
        self._device = resolve_device(device)
        check_fits("config", self.nbytes(config), self._device)
        self._routes = LayerRoutes(config)
        self._store = HybridBlockStore(self._device, config)
        self._batches = BatchProtocol(self, self._store, config.max_batch_size, self.max_seq_len,
                                      ContinuousBatchingHybridCollection, (self._routes,))
        self._sequences = self._batches.sequences
        self._group_views = tuple(
            KVHeadDimGroupView(g.device_layer_infos, g.num_layers, g.head_dim, g.max_kv_heads,
                               tuple(self._routes.owner_layers[a] for a in g.layer_indices),
                               g.components, g.ring_windows)
            for g in self._store.groups)

    @classmethod
    def from_hf_config(cls, config_dict, *, max_batch_size, max_seq_len, kv_dtype="float16",
                       ssm_dtype="float32", conv_dtype=None, ring_windows=True, device=None):
        """A manager for the model of a Hugging Face ``config.json`` dict
        (:func:`hcache.config.caches.hybrid_config_from_hf`; ``max_seq_len`` is its
        ``max_sequence_length``). Raises as that function and the constructor."""
        if as_int("max_seq_len", max_seq_len, 1) > INT32_MAX:
            raise ValueError(f"max_seq_len: expected an int <= {INT32_MAX} (int32 lengths), "
                             f"got {max_seq_len}")
        return cls(hybrid_config_from_hf(config_dict, max_batch_size=max_batch_size,
                                         max_sequence_length=max_seq_len, kv_dtype=kv_dtype,
                                         ssm_dtype=ssm_dtype, conv_dtype=conv_dtype,
                                         ring_windows=ring_windows), device=device)

    # --- sizing (before allocation) ---------------------------------------------------------

    @staticmethod
    def nbytes(config) -> int:
        """Device bytes a manager of ``config`` allocates (its ``memory_report()["total"]``),
        known before any allocation. ``TypeError`` for a config that is not a
        :class:`HybridCacheConfig`."""
        if not isinstance(config, HybridCacheConfig):
            raise TypeError(f"config: expected HybridCacheConfig, got {type(config).__name__}")
        return continuous_hybrid_manager_nbytes(config)

    @classmethod
    def max_batch_size_for(cls, config, budget) -> int:
        """The largest ``max_batch_size`` (blocks) whose manager of ``config`` (its other
        fields as they are) fits in ``budget`` bytes, or 0 if not even one block fits.
        ``TypeError`` / ``ValueError`` for a bad argument."""
        budget = as_int("budget", budget, 0)
        cls.nbytes(config)
        return largest_fitting(lambda b: cls.nbytes(config._with_batch(b)), budget)

    # --- geometry ---------------------------------------------------------------------------

    config = property(lambda self: self._config, doc="The layout.")
    device = property(lambda self: self._device, doc="The resolved device.")
    num_blocks = property(lambda self: self._config.max_batch_size,
                          doc="Blocks (= max_batch_size).")
    max_batch_size = property(lambda self: self._config.max_batch_size, doc="Most live sequences.")
    max_seq_len = property(lambda self: self._config.kv.max_sequence_length,
                           doc="Tokens per sequence.")
    num_layers = property(lambda self: self._config.num_layers, doc="Decoder layers.")

    def get_layer_type(self, i):
        """Kind of decoder layer ``i`` (a :class:`~hcache.config.layers.LayerType`)."""
        return self._config.layer_types[check_index("i", i, self.num_layers)]

    def get_combined_kv_cache(self, i):
        """KV cache of decoder layer ``i`` (its owner's under ``kv_sharing``), ``[num_blocks, C,
        H, L, D]``; ``ValueError`` for a layer without attention."""
        return self._store.caches[self._routes.attention_index(i, "i")]

    def get_ring_window(self, i) -> int:
        """Ring window of the cache decoder layer ``i`` reads, or 0 (unbounded)."""
        return self._config.kv.layer_ring_windows[self._routes.attention_index(i, "i")]

    def ring_start(self, i, lengths, stream=None):
        """Entry of the oldest valid token of layer ``i``'s ring for sequences of ``lengths``
        tokens (an int, host ints or a device array such as a collection's ``cache_lengths``);
        0 for an unbounded layer. See :func:`hcache.rings.ring_start`."""
        return ring_start(lengths, self.get_ring_window(i), self._device, stream,
                          order=self._store.order)

    def get_recurrent_state(self, i):
        """Recurrent state pool of decoder layer ``i``, ``[num_blocks, heads, head_dim,
        state_size]``; ``ValueError`` for a layer without one."""
        return self._state_pool("recurrent", i)

    def get_conv_state(self, i):
        """Conv state pool of decoder layer ``i``, ``[num_blocks, conv_dim, conv_kernel]``;
        ``ValueError`` for a layer without one."""
        return self._state_pool("conv", i)

    def _state_pool(self, kind, i):
        m = self._routes.mamba_index(i, "i")
        if kind not in self._store.states:
            raise ValueError(f"i: expected a layer with a {kind} state, got layer {i}, whose "
                             f"recurrent layers have none")
        return self._store.state_views[kind][m]

    def get_kv_head_dim_groups(self) -> list:
        """One :class:`~hcache.slots.hybrid.KVHeadDimGroupView` per ``(head dim, components)``
        (first-seen order): the ``KVLayerInfo`` table an engine's kernel binds, with the
        decoder layer of each group position. Slots are blocks: index them with a batch's
        ``lookup_table``."""
        return list(self._group_views)

    # --- queries ----------------------------------------------------------------------------

    num_free_blocks = property(lambda self: self._batches.num_free_blocks,
                               doc="Blocks no live sequence holds (what :meth:`claim` can "
                                   "hand out now).")
    num_live_sequences = property(lambda self: self._batches.num_live_sequences,
                                  doc="Sequences claimed and not released.")
    cache_lengths = property(lambda self: self._batches.cache_lengths,
                             doc="Snapshot ``{seq_id: committed tokens}`` of the live sequences.")
    in_flight = property(lambda self: self._batches.in_flight,
                         doc="The fetched batch not yet stepped, or ``None``.")

    def can_claim(self, batch_size: int) -> bool:
        """True when ``claim(batch_size)`` would succeed now."""
        return self._batches.can_claim(batch_size)

    def block_of(self, seq_id: int) -> int:
        """The block of a live sequence. ``ValueError`` for an unknown id."""
        return self._batches.block_of(seq_id)

    # --- commands ---------------------------------------------------------------------------

    def claim(self, batch_size: int, stream=None) -> list[int]:
        """Bind ``batch_size`` fresh sequences to free blocks (the lowest first), all or none,
        and zero their recurrent and conv states (one launch on ``stream``).

        Raises
        ------
        TypeError, ValueError
            ``batch_size`` is not an int >= 0, or ``stream`` is not a stream.
        CacheCapacityError
            Fewer than ``batch_size`` free blocks; nothing is claimed.
        """
        n = as_int("batch_size", batch_size, 0)
        stream_handle(stream)
        with self._batches.lock:   # the states are zeroed before another thread sees the ids
            ids = self._batches.claim(n)
            self._store.clear_states([self._sequences.block_of[s] for s in ids], stream)
            return ids

    def fetch(self, seq_ids, *, wait: bool = False, timeout: float | None = None,
              stream=None) -> ContinuousBatchingHybridCollection:
        """Start a batch: fill the device lookup table and lengths of ``seq_ids``; as the
        seed's :meth:`ContinuousBatchingKVCacheManager.fetch` (same arguments and errors).

        Returns
        -------
        ContinuousBatchingHybridCollection
            Active until :meth:`step`.
        """
        return self._batches.fetch(seq_ids, wait, timeout, stream)

    def step(self, valid_lengths, collection) -> None:
        """Commit ``valid_lengths[i]`` more tokens to row ``i`` and end the batch (the states
        are what the batch wrote: a step commits lengths only).

        Raises
        ------
        TypeError
            ``collection`` is not a collection, or a length is not an int.
        ValueError
            ``collection`` is ended or not this manager's; ``valid_lengths`` has the wrong
            count or a negative entry; a row would pass ``max_seq_len``. Nothing changes.
        """
        self._batches.step(valid_lengths, collection)

    def release(self, seq_id: int, stream=None) -> None:
        """Return a sequence's block (of every cache and state pool); the id is never valid
        again. ``stream``: as the seed's :meth:`ContinuousBatchingKVCacheManager.release`.

        Raises
        ------
        TypeError
            ``seq_id`` is not an int, or ``stream`` is not a stream.
        ValueError
            Unknown (or released) ``seq_id``, or one in the batch in flight.
        """
        self._batches.release(seq_id, stream)

    def reset(self) -> None:
        """Release every live sequence and end the batch in flight (seq_ids handed out before
        stay invalid; a later claim zeroes the states it hands out)."""
        self._batches.reset()

    # --- checks and diagnostics -------------------------------------------------------------

    def check_invariants(self) -> None:
        """The seed's checks (free blocks, live sequences, lengths, the batch in flight and its
        device index buffers). **Synchronizes** on cuda. ``RuntimeError`` listing every broken
        invariant."""
        self._batches.check_invariants("ContinuousBatchingHybridCacheManager")

    def memory_report(self) -> dict:
        """Device bytes: ``kv_cache``, ``recurrent``, ``conv`` (0 for a kind the layers lack),
        ``metadata`` (index buffers, layer and copy tables, zero slots), ``total`` (all four:
        :meth:`nbytes`), ``bytes_per_block`` (caches and states of one sequence); occupancy:
        ``num_blocks``, ``free_blocks``, ``live_sequences``, ``committed_tokens``; ``dtype``,
        ``device``."""
        s = self._store
        with self._batches.lock:
            kv, rec, conv = s.kv_nbytes, s.state_nbytes("recurrent"), s.state_nbytes("conv")
            meta = s.metadata_nbytes
            return {"device": str(self._device), "dtype": self._config.kv.dtype,
                    "kv_cache": kv, "recurrent": rec, "conv": conv, "metadata": meta,
                    "total": kv + rec + conv + meta,
                    "bytes_per_block": (kv + rec + conv) // self.num_blocks,
                    "num_blocks": self.num_blocks, "free_blocks": len(self._sequences.free),
                    "live_sequences": len(self._sequences.block_of),
                    "committed_tokens": int(self._sequences.block_len.sum())}

    def __repr__(self) -> str:
        return (f"ContinuousBatchingHybridCacheManager(layers={self.num_layers}, "
                f"attention={len(self._routes.owner_layers)}, "
                f"recurrent={len(self._routes.mamba_layers)}, "
                f"kv_dtype={self._config.kv.dtype}, "
                f"max_batch_size={self.num_blocks}, max_seq_len={self.max_seq_len}, "
                f"device={self._device}, live={self.num_live_sequences})")
