"""Cache layout from a Hugging Face ``config.json`` dict (SPEC §4, ``from_hf_config``).

One small builder per model family turns the model's fields into a :class:`_Layout`; the shared
rules are: a key absent (or ``null``) takes the default of the model's transformers config class
(``_DEFAULTS``); head dims come from the config's own fields and are derived from ``hidden_size``
only where the model itself does so; a Mamba-2 layer's inner size is ``heads * head_dim`` (or
``mamba_d_ssm``) and its conv dim ``inner + 2 * n_groups * d_state``; an unsupported or
inconsistent value raises ``ValueError`` naming the field (``TypeError`` for a wrong JSON type).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .configs import (
    HybridCacheConfig,
    KVCacheConfig,
    KVLayerConfig,
    LayerType,
    MambaCacheConfig,
    _int,
)
from .dtypes import dtype_name, resolve_dtype

__all__ = ["hybrid_config_from_hf"]

A, M, AM, NONE = (LayerType.ATTENTION, LayerType.MAMBA, LayerType.ATTENTION_AND_MAMBA,
                  LayerType.NONE)

_NEMOTRON_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_ZAMBA2_BLOCKS = (("mamba",) + (("mamba",) * 5 + ("hybrid",)) * 7 + ("mamba",) * 4
                  + ("hybrid",) + ("mamba",) * 3 + ("hybrid",) + ("mamba",) * 2)

# Defaults of the transformers config classes, for the keys this module reads.
_DEFAULTS: dict[str, dict] = {
    "nemotron_h": dict(hybrid_override_pattern=_NEMOTRON_PATTERN, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, mamba_num_heads=128,
                       mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4),
    "jamba": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                  num_key_value_heads=8, attn_layer_period=8, attn_layer_offset=4,
                  mamba_d_state=16, mamba_d_conv=4, mamba_expand=2),
    "granitemoehybrid": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                             mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=256,
                             mamba_d_head="auto", mamba_d_conv=4, mamba_expand=2),
    "falcon_h1": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, mamba_d_ssm=1024, mamba_n_heads=128,
                      mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4,
                      mamba_expand=2),
    "zamba2": dict(hidden_size=2560, num_attention_heads=32, layers_block_type=_ZAMBA2_BLOCKS,
                   mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1,
                   n_mamba_heads=8),
    "qwen3_next": dict(num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                       head_dim=256, full_attention_interval=4, linear_conv_kernel_dim=4,
                       linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_num_key_heads=16, linear_num_value_heads=32),
    "gemma3": dict(num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, sliding_window=4096, sliding_window_pattern=6),
    "gemma4": dict(num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, global_head_dim=512, sliding_window=512,
                   sliding_window_pattern=6, num_kv_shared_layers=0),
    "plain": {},
}

# Layer-type names of ``layer_types`` / ``layers_block_type`` (legacy and current spellings).
_KIND = {"mamba": M, "linear_attention": M, "attention": A, "full_attention": A,
         "sliding_attention": A, "chunked_attention": A, "hybrid": AM, "mlp": NONE, "moe": NONE}
_PATTERN_KIND = {"M": M, "*": A, "-": NONE, "E": NONE}
_NEMOTRON_NAMES = ("mamba", "linear_attention", "attention", "full_attention", "mlp", "moe")
_SLIDING = ("sliding_attention", "full_attention")

# Fallbacks when neither model_type nor architectures names a known family.
_FIELD_HINTS = (("hybrid_override_pattern", "nemotron_h"), ("mamba_num_heads", "nemotron_h"),
                ("attn_layer_period", "jamba"), ("linear_num_value_heads", "qwen3_next"),
                ("mamba_d_ssm", "falcon_h1"), ("n_mamba_heads", "zamba2"),
                ("mamba_n_heads", "granitemoehybrid"), ("global_head_dim", "gemma4"),
                ("num_kv_shared_layers", "gemma4"), ("sliding_window_pattern", "gemma3"))


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
        return _int(key, value, minimum)

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


def _per_head(c: _Cfg, key: str, inner: int, heads_key: str) -> int:
    """A Mamba head dim that may be ``"auto"`` (``inner // heads``)."""
    value, heads = c.get(key), c.int(heads_key)
    if value is not None and value != "auto":
        return _int(key, value, 1)
    if inner % heads:
        raise ValueError(f"{heads_key}: expected a divisor of the Mamba inner size {inner}, "
                         f"got {heads}")
    return inner // heads


def _mamba2(heads: int, head_dim: int, groups: int, state: int, kernel: int) -> dict:
    return dict(num_heads=heads, head_dim=head_dim, state_size=state,
                conv_dim=heads * head_dim + 2 * groups * state, conv_kernel=kernel)


def _uniform(types: list, layer: KVLayerConfig) -> dict:
    return {i: layer for i, t in enumerate(types) if t.has_attention}


def _nemotron_h(c: _Cfg) -> _Layout:
    names = (None if c.raw.get("hybrid_override_pattern") is not None
             else _names(c, ("layers_block_type", "layer_types"), _NEMOTRON_NAMES))
    if names is not None:
        types = [_KIND[n] for n in names]
    else:
        pattern = c.get("hybrid_override_pattern")
        if not isinstance(pattern, str):
            raise ValueError(f"hybrid_override_pattern: expected a string, "
                             f"got {type(pattern).__name__}")
        for i, ch in enumerate(pattern):
            if ch not in _PATTERN_KIND:
                raise ValueError(f"hybrid_override_pattern[{i}]: expected one of "
                                 f"'M', '*', '-', 'E', got {ch!r}")
        _check_count(c, len(pattern), "hybrid_override_pattern")
        types = [_PATTERN_KIND[ch] for ch in pattern]
    kv = KVLayerConfig(_kv_heads(c), _head_dim(c, "head_dim", "attention_head_dim"))
    mamba = _mamba2(c.int("mamba_num_heads"), c.int("mamba_head_dim"),
                    c.int("n_groups", "mamba_n_groups"), c.int("ssm_state_size"),
                    c.int("conv_kernel", "mamba_d_conv"))
    return _Layout(types, _uniform(types, kv), mamba)


def _jamba(c: _Cfg) -> _Layout:
    n, period = c.int("num_hidden_layers"), c.int("attn_layer_period")
    offset = c.int("attn_layer_offset", minimum=0)
    if offset >= period:
        raise ValueError(f"attn_layer_offset: expected < attn_layer_period ({period}), "
                         f"got {offset}")
    types = [A if i % period == offset else M for i in range(n)]
    kv = KVLayerConfig(_kv_heads(c), _head_dim(c, "head_dim"), c.get("sliding_window"))
    d_inner = c.int("mamba_expand") * c.int("hidden_size")
    mamba = dict(num_heads=1, head_dim=d_inner, state_size=c.int("mamba_d_state"),
                 conv_dim=d_inner, conv_kernel=c.int("mamba_d_conv"))
    return _Layout(types, _uniform(types, kv), mamba)


def _granite(c: _Cfg) -> _Layout:
    names = _names(c, ("layer_types", "layers_block_type"),
                   ("mamba", "linear_attention", "attention", "full_attention"))
    types = [_KIND[n] for n in names] if names else [M] * c.int("num_hidden_layers")
    kv = KVLayerConfig(_kv_heads(c), _head_dim(c, "head_dim"))
    inner = c.int("mamba_expand") * c.int("hidden_size")
    mamba = _mamba2(c.int("mamba_n_heads"), _per_head(c, "mamba_d_head", inner, "mamba_n_heads"),
                    c.int("mamba_n_groups"), c.int("mamba_d_state"), c.int("mamba_d_conv"))
    return _Layout(types, _uniform(types, kv), mamba)


def _falcon_h1(c: _Cfg) -> _Layout:
    types = [AM] * c.int("num_hidden_layers")
    kv = KVLayerConfig(_kv_heads(c), _head_dim(c, "head_dim"))
    d_ssm = c.stated("mamba_d_ssm")      # an explicit null means expand * hidden_size
    inner = (c.int("mamba_expand") * c.int("hidden_size") if d_ssm is None
             else _int("mamba_d_ssm", d_ssm, 1))
    heads = c.int("mamba_n_heads")
    head_dim = _per_head(c, "mamba_d_head", inner, "mamba_n_heads")
    if heads * head_dim != inner:
        raise ValueError(f"mamba_d_head: expected mamba_d_ssm / mamba_n_heads = "
                         f"{inner} / {heads}, got {head_dim}")
    mamba = _mamba2(heads, head_dim, c.int("mamba_n_groups"), c.int("mamba_d_state"),
                    c.int("mamba_d_conv"))
    return _Layout(types, _uniform(types, kv), mamba)


def _zamba2(c: _Cfg) -> _Layout:
    names = _names(c, ("layers_block_type", "layer_types"),
                   ("mamba", "linear_attention", "hybrid"))
    types = [_KIND[n] for n in names]
    kv = KVLayerConfig(_kv_heads(c), _head_dim(c, "attention_head_dim", factor=2))
    inner = c.int("mamba_expand") * c.int("hidden_size")
    mamba = _mamba2(c.int("n_mamba_heads"), _per_head(c, "mamba_headdim", inner, "n_mamba_heads"),
                    c.int("mamba_ngroups"), c.int("mamba_d_state"), c.int("mamba_d_conv"))
    return _Layout(types, _uniform(types, kv), mamba)


def _qwen3_next(c: _Cfg) -> _Layout:
    names = _names(c, ("layer_types",), ("linear_attention", "full_attention"))
    if names is not None:
        types = [_KIND[n] for n in names]
    else:
        interval = c.int("full_attention_interval")
        types = [A if (i + 1) % interval == 0 else M for i in range(c.int("num_hidden_layers"))]
    kv = KVLayerConfig(_kv_heads(c), _head_dim(c, "head_dim"))
    k_dim, v_dim = c.int("linear_key_head_dim"), c.int("linear_value_head_dim")
    k_heads, v_heads = c.int("linear_num_key_heads"), c.int("linear_num_value_heads")
    mamba = dict(num_heads=v_heads, head_dim=k_dim, state_size=v_dim,
                 conv_dim=2 * k_heads * k_dim + v_heads * v_dim,
                 conv_kernel=c.int("linear_conv_kernel_dim"))
    return _Layout(types, _uniform(types, kv), mamba)


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
    full_dim = head_dim if full_dim is None else _int("global_head_dim", full_dim, 1)
    global_heads = c.raw.get("num_global_key_value_heads")
    full_heads = (heads if global_heads is None or c.raw.get("attention_k_eq_v") is False
                  else _int("num_global_key_value_heads", global_heads, 1))
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


_BUILDERS = {"nemotron_h": _nemotron_h, "jamba": _jamba, "granitemoehybrid": _granite,
             "falcon_h1": _falcon_h1, "zamba2": _zamba2, "qwen3_next": _qwen3_next,
             "gemma3": _gemma3, "gemma4": _gemma4, "plain": _plain}
_BY_KEY = {re.sub(r"[^a-z0-9]", "", f): f for f in _BUILDERS if f != "plain"}


def _family_key(name) -> str | None:
    """``"gemma3_text"``, ``"Gemma3ForConditionalGeneration"`` → ``"gemma3"``."""
    if not isinstance(name, str):
        return None
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    key = re.sub(r"(text)?(forcausallm|forconditionalgeneration|model)?$", "", key)
    return _BY_KEY.get(key)


def _select(config: Mapping) -> tuple[str, dict]:
    """The family and the text model's fields (a nested ``text_config`` if there is one)."""
    text = config.get("text_config")
    fields = dict(text) if isinstance(text, Mapping) else dict(config)
    archs = config.get("architectures")
    names = [fields.get("model_type"), config.get("model_type"),
             *(archs if isinstance(archs, (list, tuple)) else [archs])]
    for name in names:
        if (family := _family_key(name)) is not None:
            return family, fields
    family = next((f for key, f in _FIELD_HINTS if fields.get(key) is not None), "plain")
    if family == "plain" and fields.get("model_type") is None:
        fields["model_type"] = config.get("model_type")
    return family, fields


def hybrid_config_from_hf(config_dict, *, max_batch_size, max_sequence_length,
                          kv_dtype="float16", ssm_dtype="float32",
                          conv_dtype=None) -> HybridCacheConfig:
    """Build the cache layout of a model from its Hugging Face ``config.json``.

    Parameters
    ----------
    config_dict : Mapping
        The parsed ``config.json`` (a nested ``text_config`` is used when present) of
        Nemotron-H / Nemotron-Nano-v2 / Nemotron-3, Jamba, Granite-4.0-H, Falcon-H1, Zamba2,
        Qwen3-Next, Gemma 3 / 4 or any plain attention model. The family is read from
        ``model_type``, then ``architectures``, then from family-specific fields.
    max_batch_size, max_sequence_length : int
        Slots and tokens per slot of the KV caches (and slots of the Mamba states).
    kv_dtype, ssm_dtype : str or dtype
        Dtypes of the KV caches and of the recurrent states.
    conv_dtype : str or dtype, optional
        Dtype of the conv states; ``None`` means ``kv_dtype``.

    Returns
    -------
    HybridCacheConfig
        ``layer_types`` by absolute decoder index (MLP/MoE-only layers are ``LayerType.NONE``),
        one ``KVLayerConfig`` per cache-owning attention layer, a ``MambaCacheConfig`` (``None``
        without recurrent layers) and Gemma 4's ``kv_sharing``.

    Raises
    ------
    TypeError
        ``config_dict`` is not a mapping, or a field or dtype has the wrong type.
    ValueError
        An unsupported or inconsistent config (the message names the field), or a bad dtype,
        batch size or sequence length.
    """
    if not isinstance(config_dict, Mapping):
        raise TypeError(f"config_dict: expected a mapping (a parsed config.json), "
                        f"got {type(config_dict).__name__}")
    kv_dt = dtype_name(resolve_dtype(kv_dtype, name="kv_dtype"))
    ssm_dt = dtype_name(resolve_dtype(ssm_dtype, name="ssm_dtype"))
    conv_dt = kv_dt if conv_dtype is None else dtype_name(resolve_dtype(conv_dtype,
                                                                        name="conv_dtype"))
    family, fields = _select(config_dict)
    layout = _BUILDERS[family](_Cfg(fields, _DEFAULTS[family]))
    owners = [layout.kv[i] for i in sorted(layout.kv) if i not in layout.sharing]
    kv = KVCacheConfig(max_batch_size, max_sequence_length, owners, kv_dt)
    n_mamba = sum(1 for t in layout.types if t.has_mamba)
    mamba = (MambaCacheConfig(n_mamba, max_batch_size, **layout.mamba, ssm_dtype=ssm_dt,
                              conv_dtype=conv_dt) if n_mamba else None)
    return HybridCacheConfig(layout.types, kv, mamba, max_batch_size, layout.sharing or None)
