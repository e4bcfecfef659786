"""Attention-only model families: Gemma 2 / 3 / 4 and the plain attention models.

Gemma 2 and 3 alternate sliding and full attention layers of one shape; Gemma 4 gives its full
attention layers their own shape (``per_layer_config``, or the older ``global_head_dim`` /
``num_global_key_value_heads``) and shares KV caches across its last layers. A *plain* model
(:data:`PLAIN_MODEL_TYPES`) has one KV shape for every layer: ``num_key_value_heads`` (else
``num_attention_heads``) heads of ``head_dim`` (else ``hidden_size / num_attention_heads``), an
optional ``layer_types`` list and a recorded ``sliding_window`` (without ``layer_types``, the
sliding layers follow the family's transformers rule: :func:`_default_sliding`). Plain models
have no class defaults here: a missing size field raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from .._checks import as_int
from .hf_fields import A, _Cfg, _head_dim, _kv_heads, _Layout, _names
from .layers import KVLayerConfig

__all__ = ["ATTENTION_BUILDERS", "ATTENTION_DEFAULTS", "PLAIN_MODEL_TYPES"]

# Model types whose every layer is standard (grouped-query) attention with one KV shape.
PLAIN_MODEL_TYPES = ("llama", "mistral", "mixtral", "ministral", "qwen2", "qwen2_moe", "qwen3",
                     "qwen3_moe", "gemma", "phi3", "gpt_oss", "olmo2", "granite", "starcoder2")

# Defaults of the transformers config classes, for the keys these builders read.
ATTENTION_DEFAULTS: dict[str, dict] = {
    "gemma2": dict(num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, sliding_window=4096, sliding_window_pattern=2),
    "gemma3": dict(num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, sliding_window=4096, sliding_window_pattern=6),
    "gemma4": dict(num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, global_head_dim=512, sliding_window=512,
                   sliding_window_pattern=6, num_kv_shared_layers=0),
    **{name: {} for name in PLAIN_MODEL_TYPES},
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


def _per_layer_config(c: _Cfg, n: int) -> dict[int, dict]:
    """Gemma 4's ``per_layer_config``: layer -> ``{"head_dim": .., "num_key_value_heads": ..}``
    overrides (the keys that size a cache; others are not cache shapes)."""
    table = c.raw["per_layer_config"]
    if not isinstance(table, Mapping):
        raise TypeError(f"per_layer_config: expected a mapping of layer to fields, "
                        f"got {type(table).__name__}")
    out = {}
    for key, fields in table.items():
        try:
            layer = int(key) if not isinstance(key, bool) else None
        except (TypeError, ValueError):
            layer = None
        if layer is None or str(layer) != str(key).strip() or not 0 <= layer < n:
            raise ValueError(f"per_layer_config: expected layer indices in [0, {n}), got {key!r}")
        if not isinstance(fields, Mapping):
            raise TypeError(f"per_layer_config[{key!r}]: expected a mapping, "
                            f"got {type(fields).__name__}")
        out[layer] = {name: as_int(f"per_layer_config[{key!r}].{name}", fields[name], 1)
                      for name in ("head_dim", "num_key_value_heads")
                      if fields.get(name) is not None}
    return out


def _gemma4(c: _Cfg) -> _Layout:
    sliding, window = _sliding_flags(c), c.int("sliding_window")
    sliding[-1] = False                  # transformers forces the last layer to full attention
    heads, head_dim = _kv_heads(c), _head_dim(c, "head_dim")
    n = len(sliding)
    if c.raw.get("per_layer_config") is not None:
        # Current configs: the per-layer overrides are the whole story (global_* are unused).
        overrides = _per_layer_config(c, n)
        shapes = [(overrides.get(i, {}).get("num_key_value_heads", heads),
                   overrides.get(i, {}).get("head_dim", head_dim)) for i in range(n)]
    else:
        full_dim = c.stated("global_head_dim")     # an explicit null means head_dim
        full_dim = head_dim if full_dim is None else as_int("global_head_dim", full_dim, 1)
        global_heads = c.raw.get("num_global_key_value_heads")
        full_heads = (heads if global_heads is None or c.raw.get("attention_k_eq_v") is False
                      else as_int("num_global_key_value_heads", global_heads, 1))
        shapes = [(heads, head_dim) if s else (full_heads, full_dim) for s in sliding]
    shared = c.int("num_kv_shared_layers", minimum=0)
    if shared > n:
        raise ValueError(f"num_kv_shared_layers: expected <= {n} (the layer count), got {shared}")
    kv, sharing, last_owner = {}, {}, {}
    for i, s in enumerate(sliding):
        kv[i] = KVLayerConfig(*shapes[i], window if s else None)
        # Layer i >= n - shared reads the cache of the last earlier owner of its own kind;
        # with no such owner it keeps (and becomes the owner of) its own cache.
        if i >= n - shared and s in last_owner:
            sharing[i] = last_owner[s]
        else:
            last_owner[s] = i
    return _Layout([A] * n, kv, None, sharing)


def _plain(c: _Cfg, family: str) -> _Layout:
    heads, head_dim = _kv_heads(c), _head_dim(c, "head_dim")
    use = c.raw.get("use_sliding_window")
    if use is None:   # the class default: Qwen2/3 configs slide only when they say so
        use = family not in _WINDOW_FROM_LAYER or c.raw.get("layer_types") is not None
    window = c.get("sliding_window") if use is not False else None
    names = _names(c, ("layer_types",), ("full_attention", "sliding_attention",
                                         "chunked_attention", "attention"))
    if names is None:
        names = [("sliding_attention" if window and _default_sliding(c, family, i)
                  else "full_attention") for i in range(c.int("num_hidden_layers"))]
    kv = {i: KVLayerConfig(heads, head_dim, window if n == "sliding_attention" else None)
          for i, n in enumerate(names)}
    return _Layout([A] * len(names), kv)


# Plain families whose windowed configs slide only from max_window_layers on.
_WINDOW_FROM_LAYER = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def _default_sliding(c: _Cfg, family: str, i: int) -> bool:
    """Whether layer ``i`` of a plain ``family`` slides when a windowed config has no
    ``layer_types`` (the rule of the model's transformers config class): gpt-oss alternates,
    even layers sliding; Qwen2 / Qwen3 slide from ``max_window_layers`` on (required then);
    every other plain model slides everywhere (Mistral). Gemma 2 alternates through
    ``sliding_window_pattern``. A ring buffer for a full-attention layer would lose tokens, so
    this matters."""
    if family == "gpt_oss":
        return i % 2 == 0
    if family in _WINDOW_FROM_LAYER:
        return i >= c.int("max_window_layers", minimum=0)
    return True


ATTENTION_BUILDERS = {"gemma2": _gemma3, "gemma3": _gemma3, "gemma4": _gemma4,
                      **{name: partial(_plain, family=name) for name in PLAIN_MODEL_TYPES}}
