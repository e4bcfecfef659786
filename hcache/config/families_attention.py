"""Layouts of the attention-only families from their Hugging Face fields.

Gemma 3 and Gemma 4 (sliding and full attention layers, Gemma 4 with its own full-attention
shape and cross-layer KV sharing) and any plain attention model (``num_attention_heads`` and
friends, optionally ``layer_types`` or a ``sliding_window``). None has recurrent state.
"""

from __future__ import annotations

from .._checks import as_int
from .caches import KVLayerConfig
from .hf_fields import A, _Cfg, _head_dim, _kv_heads, _Layout, _names

__all__ = ["BUILDERS", "DEFAULTS"]

# Defaults of the transformers config classes, for the keys these builders read.
DEFAULTS: dict[str, dict] = {
    "gemma3": dict(num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, sliding_window=4096, sliding_window_pattern=6),
    "gemma4": dict(num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, global_head_dim=512, sliding_window=512,
                   sliding_window_pattern=6, num_kv_shared_layers=0),
    "plain": {},
}

_SLIDING = ("sliding_attention", "full_attention")


def _sliding_flags(c: _Cfg) -> list[bool]:
    """Per layer: sliding (True) or full attention, from ``layer_types``, else every
    ``sliding_window_pattern``-th layer is full."""
    names = _names(c, ("layer_types",), _SLIDING)
    if names is not None:
        return [n == "sliding_attention" for n in names]
    pattern = c.int("sliding_window_pattern")
    return [(i + 1) % pattern != 0 for i in range(c.int("num_hidden_layers"))]


def _gemma3(c: _Cfg) -> _Layout:
    sliding, window = _sliding_flags(c), c.int("sliding_window")
    heads, head_dim = _kv_heads(c), _head_dim(c, "head_dim")
    kv = {i: KVLayerConfig(heads, head_dim, window if s else None) for i, s in enumerate(sliding)}
    return _Layout([A] * len(sliding), kv)


def _gemma4(c: _Cfg) -> _Layout:
    sliding, window = _sliding_flags(c), c.int("sliding_window")
    sliding[-1] = False                  # transformers forces the last layer to full attention
    heads, head_dim = _kv_heads(c), _head_dim(c, "head_dim")
    full_dim = c.stated("global_head_dim")     # an explicit null means head_dim
    full_dim = head_dim if full_dim is None else as_int("global_head_dim", full_dim, 1)
    global_heads = c.raw.get("num_global_key_value_heads")
    full_heads = (heads if global_heads is None or c.raw.get("attention_k_eq_v") is False
                  else as_int("num_global_key_value_heads", global_heads, 1))
    n, shared = len(sliding), c.int("num_kv_shared_layers", minimum=0)
    if shared > n:
        raise ValueError(f"num_kv_shared_layers: expected <= {n} (the layer count), got {shared}")
    kv, sharing, last_owner = {}, {}, {}
    for i, s in enumerate(sliding):
        kv[i] = KVLayerConfig(heads, head_dim, window) if s else KVLayerConfig(full_heads,
                                                                              full_dim)
        # Layer i >= n - shared reads the cache of the last earlier owner of its own kind;
        # with no such owner it keeps (and becomes the owner of) its own cache.
        if i >= n - shared and s in last_owner:
            sharing[i] = last_owner[s]
        else:
            last_owner[s] = i
    return _Layout([A] * n, kv, None, sharing)


def _plain(c: _Cfg) -> _Layout:
    if c.raw.get("num_attention_heads") is None and c.raw.get("num_key_value_heads") is None:
        raise ValueError(f"model_type: expected a supported hybrid model or a config with "
                         f"attention fields (num_attention_heads), "
                         f"got {c.raw.get('model_type')!r}")
    heads, head_dim = _kv_heads(c), _head_dim(c, "head_dim")
    window = c.get("sliding_window") if c.raw.get("use_sliding_window") is not False else None
    names = _names(c, ("layer_types",), ("full_attention", "sliding_attention",
                                         "chunked_attention", "attention"))
    if names is None:
        names = ["sliding_attention" if window else "full_attention"] * c.int("num_hidden_layers")
    kv = {i: KVLayerConfig(heads, head_dim, window if n == "sliding_attention" else None)
          for i, n in enumerate(names)}
    return _Layout([A] * len(names), kv)


BUILDERS = {"gemma3": _gemma3, "gemma4": _gemma4, "plain": _plain}
