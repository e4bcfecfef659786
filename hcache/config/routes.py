"""Which cache each decoder layer of a hybrid model reads (docs/design.md §5, §9 index spaces).

A :class:`LayerRoutes` maps a decoder layer to its ``attention_index`` (the cache it reads: its
own, or its owner's for a layer in ``kv_sharing``) and its ``mamba_index`` (its recurrent and
conv state slots); ``NONE`` layers have neither. Both the contiguous
:class:`~hcache.slots.hybrid.HybridCacheManager` and the continuous-batching hybrid manager route
through it. Errors name the caller's argument.
"""

from __future__ import annotations

from .._checks import check_index

__all__ = ["LayerRoutes"]


class LayerRoutes:
    """Decoder layer -> attention index and Mamba index of a ``HybridCacheConfig``.

    Attributes
    ----------
    owner_layers : tuple of int
        ``owner_layers[attention_index]``: the decoder layer that owns (writes) that cache.
    mamba_layers : tuple of int
        ``mamba_layers[mamba_index]``: the decoder layer of that state.
    attention_of, mamba_of : tuple of (int or None)
        By decoder layer: its ``attention_index`` / ``mamba_index``, None where it has none.
    """

    def __init__(self, config):
        self._types = config.layer_types
        self._attention: list[int | None] = [None] * len(self._types)   # attention_of
        self._mamba: list[int | None] = [None] * len(self._types)       # mamba_of
        owners, mamba = [], []
        for layer, kind in enumerate(self._types):
            if kind.has_attention:
                owner = config.kv_sharing.get(layer)
                if owner is None:
                    self._attention[layer] = len(owners)
                    owners.append(layer)
                else:
                    self._attention[layer] = self._attention[owner]
            if kind.has_mamba:
                self._mamba[layer] = len(mamba)
                mamba.append(layer)
        self.owner_layers, self.mamba_layers = tuple(owners), tuple(mamba)
        self.attention_of, self.mamba_of = tuple(self._attention), tuple(self._mamba)

    @property
    def num_layers(self) -> int:
        return len(self._types)

    def _route(self, layer, table, kind: str, name: str) -> int:
        layer = check_index(name, layer, self.num_layers)
        index = table[layer]
        if index is None:
            raise ValueError(f"{name}: expected {kind} layer, got layer {layer} "
                             f"({self._types[layer].name})")
        return index

    def attention_index(self, layer, name: str = "layer") -> int:
        """The cache decoder ``layer`` reads.

        Raises
        ------
        TypeError, IndexError
            ``layer`` is not an int in ``[0, num_layers)``.
        ValueError
            The layer has no attention.
        """
        return self._route(layer, self._attention, "an attention", name)

    def owned_attention_index(self, layer, name: str = "layer") -> int:
        """The cache decoder ``layer`` writes: raises like :meth:`attention_index`, and
        ``ValueError`` for a layer that reads another layer's cache (``kv_sharing``)."""
        index = self.attention_index(layer, name)
        if self.owner_layers[index] != layer:
            raise ValueError(f"{name}: expected a layer that owns its KV cache, got layer "
                             f"{layer}, which shares layer {self.owner_layers[index]}'s "
                             f"(write that one)")
        return index

    def mamba_index(self, layer, name: str = "layer") -> int:
        """The state slot pools of decoder ``layer``; raises like :meth:`attention_index`
        (``ValueError``: not a recurrent layer)."""
        return self._route(layer, self._mamba, "a recurrent (Mamba)", name)
