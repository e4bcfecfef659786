"""Tensor-parallel layouts: which heads of every cache each of ``N`` ranks holds
(docs/design.md, "Transfer between engines").

One :class:`TensorParallelLayout` is built from the model's (unsharded) ``HybridCacheConfig``;
``rank_config(r)`` is the config rank ``r`` builds its manager from. KV heads are split in
contiguous runs (``H % N == 0``) or, when there are fewer KV heads than ranks (``N % H == 0``),
each head is replicated on ``N / H`` consecutive ranks, as Megatron and vLLM do for GQA. A
Mamba-2 layer's recurrent state is split by head, its conv state by channel: the ``x`` channels
follow the heads, the ``B`` and ``C`` channels follow the groups (split when ``G % N == 0``,
every rank holding all of them when ``G == 1``).

Every cache is described as *units*: a KV ``(layer, component, head)`` row run, a recurrent
head, a run of conv channels. A unit has a global key, the same on every rank that holds it,
so a transfer between two different TP degrees is a matching of keys (head re-slicing).
"""

from __future__ import annotations

from dataclasses import replace

from ..config.caches import HybridCacheConfig

__all__ = ["TensorParallelLayout", "split_heads"]


def split_heads(name: str, count: int, tp_size: int, rank: int) -> tuple[int, ...]:
    """The global indices of ``count`` heads that rank ``rank`` of ``tp_size`` holds.

    Raises
    ------
    ValueError
        Neither ``count % tp_size == 0`` (split) nor ``tp_size % count == 0`` (replicate).
    """
    if count % tp_size == 0:
        per = count // tp_size
        return tuple(range(rank * per, (rank + 1) * per))
    if tp_size % count == 0:
        return (rank // (tp_size // count),)
    raise ValueError(f"{name}: expected a count that divides or is divided by the TP size "
                     f"{tp_size}, got {count}")


class TensorParallelLayout:
    """Per-rank layouts of a hybrid model's caches sharded over ``tp_size`` ranks.

    Parameters
    ----------
    config : HybridCacheConfig
        The unsharded model's caches.
    tp_size : int
        Ranks, >= 1.
    mamba_groups : int, optional
        B/C groups of the Mamba-2 layers; default ``(conv_dim - heads * head_dim) / (2 *
        state_size)``.

    Raises
    ------
    TypeError
        ``config`` is not a :class:`HybridCacheConfig`, ``tp_size`` not an int.
    ValueError
        A head or group count that cannot be split over ``tp_size`` ranks, or (for ``tp_size
        > 1``) Mamba layers whose conv channels are not Mamba-2's ``x, B, C``.
    """

    def __init__(self, config, tp_size: int = 1, *, mamba_groups: int | None = None):
        if not isinstance(config, HybridCacheConfig):
            raise TypeError(f"config: expected HybridCacheConfig, got {type(config).__name__}")
        if isinstance(tp_size, bool) or not isinstance(tp_size, int):
            raise TypeError(f"tp_size: expected an int, got {type(tp_size).__name__}")
        if tp_size < 1:
            raise ValueError(f"tp_size: expected >= 1, got {tp_size}")
        self.config, self.tp_size = config, tp_size
        for a, lc in enumerate(config.kv.layer_configs):
            split_heads(f"kv.layer_configs[{a}].num_kv_heads", lc.num_kv_heads, tp_size, 0)
        self.mamba_groups = None
        m = config.mamba
        if m is not None:
            inner = m.num_heads * m.head_dim
            if mamba_groups is None and m.has_conv_state and m.has_recurrent_state:
                rest = m.conv_dim - inner
                if rest > 0 and rest % (2 * m.state_size) == 0:
                    mamba_groups = rest // (2 * m.state_size)
            if tp_size > 1:
                if mamba_groups is None or not (m.has_conv_state and m.has_recurrent_state) \
                        or m.conv_dim != inner + 2 * mamba_groups * m.state_size:
                    raise ValueError(f"mamba: expected Mamba-2 conv channels (x, B, C: conv_dim"
                                     f" = heads * head_dim + 2 * groups * state_size) to shard "
                                     f"over {tp_size} ranks, got conv_dim {m.conv_dim}")
                split_heads("mamba.num_heads", m.num_heads, tp_size, 0)
                if m.num_heads % tp_size:
                    raise ValueError(f"mamba.num_heads: expected a multiple of the TP size "
                                     f"{tp_size}, got {m.num_heads}")
                if mamba_groups % tp_size and mamba_groups != 1:
                    raise ValueError(f"mamba_groups: expected 1 or a multiple of the TP size "
                                     f"{tp_size}, got {mamba_groups}")
            self.mamba_groups = mamba_groups

    def kv_heads(self, layer: int, rank: int) -> tuple[int, ...]:
        """Global KV heads of attention layer ``layer`` on ``rank``."""
        lc = self.config.kv.layer_configs[layer]
        return split_heads("num_kv_heads", lc.num_kv_heads, self.tp_size, rank)

    def mamba_heads(self, rank: int) -> tuple[int, ...]:
        """Global Mamba heads on ``rank``."""
        return split_heads("mamba.num_heads", self.config.mamba.num_heads, self.tp_size, rank)

    def mamba_group_ids(self, rank: int) -> tuple[int, ...]:
        """Global Mamba B/C groups on ``rank`` (all of them when there is one group)."""
        g = self.mamba_groups
        return tuple(range(g)) if g == 1 or self.tp_size == 1 else \
            split_heads("mamba_groups", g, self.tp_size, rank)

    def conv_segments(self, rank: int) -> tuple:
        """The conv channels of ``rank`` in local order: ``(name, global ids, width)`` per
        segment; a unit is one id of one segment, ``width`` channels wide."""
        m = self.config.mamba
        if self.mamba_groups is None:
            return (("all", (0,), m.conv_dim),)
        groups = self.mamba_group_ids(rank)
        return (("x", self.mamba_heads(rank), m.head_dim), ("B", groups, m.state_size),
                ("C", groups, m.state_size))

    def rank_config(self, rank: int) -> HybridCacheConfig:
        """The config rank ``rank`` builds its :class:`~hcache.HybridCacheManager` from.

        Raises
        ------
        IndexError
            ``rank`` not in ``[0, tp_size)``.
        """
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank: expected an int, got {type(rank).__name__}")
        if not 0 <= rank < self.tp_size:
            raise IndexError(f"rank: expected 0 <= rank < {self.tp_size}, got {rank}")
        c = self.config
        if self.tp_size == 1:
            return c
        layers = tuple(replace(lc, num_kv_heads=len(self.kv_heads(a, rank)))
                       for a, lc in enumerate(c.kv.layer_configs))
        mamba = c.mamba
        if mamba is not None:
            heads = len(self.mamba_heads(rank))
            mamba = replace(mamba, num_heads=heads, conv_dim=sum(
                len(ids) * width for _, ids, width in self.conv_segments(rank)))
        return replace(c, kv=replace(c.kv, layer_configs=layers), mamba=mamba)
