"""The field reader and layout record shared by the Hugging Face config builders.

:class:`_Cfg` reads a model's ``config.json`` fields with the transformers class defaults behind
them; :class:`_Layout` is what each family builder (:mod:`hcache.config.families`,
:mod:`hcache.config.families_attention`, :mod:`hcache.config.families_recurrent`) returns to
:func:`hcache.config.caches.hybrid_config_from_hf`. The helpers validate layer-type lists and
layer counts and derive attention head dims.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .._checks import as_int
from .layers import LayerType

A, M, AM, NONE = (LayerType.ATTENTION, LayerType.MAMBA, LayerType.ATTENTION_AND_MAMBA,
                  LayerType.NONE)


@dataclass
class _Layout:
    types: list
    kv: dict                      # absolute layer index -> KVLayerConfig, every attention layer
    mamba: dict | None = None     # MambaCacheConfig shape fields
    sharing: dict = field(default_factory=dict)


class _Cfg:
    """The model's fields with its class defaults behind them (``null`` counts as absent)."""

    def __init__(self, raw: Mapping, defaults: Mapping):
        self.raw, self.defaults = raw, defaults

    def find(self, *keys):
        """``(key, value)`` of the first key present, else of the first key with a default."""
        for key in keys:
            if self.raw.get(key) is not None:
                return key, self.raw[key]
        return next(((k, self.defaults[k]) for k in keys if self.defaults.get(k) is not None),
                    (keys[0], None))

    def get(self, *keys):
        return self.find(*keys)[1]

    def int(self, *keys, minimum: int = 1) -> int:
        key, value = self.find(*keys)
        if value is None:
            raise ValueError(f"{key}: expected an int, got nothing (absent, and no default)")
        return as_int(key, value, minimum)

    def stated(self, key):
        """The value as written, ``null`` included; the default when the key is absent."""
        return self.raw[key] if key in self.raw else self.defaults.get(key)


def _check_count(c: _Cfg, n: int, key: str) -> None:
    if n == 0:
        raise ValueError(f"{key}: expected at least one layer, got 0")
    if c.raw.get("num_hidden_layers") is not None and c.int("num_hidden_layers") != n:
        raise ValueError(f"{key}: expected {c.int('num_hidden_layers')} entries "
                         f"(num_hidden_layers), got {n}")


def _names(c: _Cfg, keys: tuple, allowed) -> list | None:
    """The validated list of layer-type names under the first of ``keys`` (None if absent)."""
    key, names = c.find(*keys)
    if names is None:
        return None
    if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)):
        raise ValueError(f"{key}: expected a list of layer type names, "
                         f"got {type(names).__name__}")
    for i, name in enumerate(names):
        if name not in allowed:
            raise ValueError(f"{key}[{i}]: expected one of {', '.join(allowed)}, got {name!r}")
    _check_count(c, len(names), key)
    return list(names)


def _head_dim(c: _Cfg, *keys, factor: int = 1) -> int:
    """Head dim from the first of ``keys`` present, else ``factor * hidden // heads``."""
    if c.get(*keys) is not None:
        return c.int(*keys)
    hidden, heads = c.int("hidden_size"), c.int("num_attention_heads")
    if (factor * hidden) % heads:
        raise ValueError(f"hidden_size: expected a multiple of num_attention_heads ({heads}) "
                         f"when no {keys[0]} is given, got {hidden}")
    return factor * hidden // heads


def _kv_heads(c: _Cfg) -> int:
    return c.int("num_key_value_heads", "num_attention_heads")
