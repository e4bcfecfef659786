"""Cache layout from a Hugging Face ``config.json`` dict (docs/design.md §4, ``from_hf_config``).

One small builder per model family turns the model's fields into a
:class:`~hcache.config.hf_fields._Layout`; the shared rules are: a key absent (or ``null``) takes
the
default of the model's transformers config class (``_DEFAULTS``); head dims come from the
config's own fields and are derived from ``hidden_size`` only where the model itself does so; a
Mamba-2 layer's inner size is ``heads * head_dim`` (or ``mamba_d_ssm``) and its conv dim
``inner + 2 * n_groups * d_state``; an unsupported or inconsistent value raises ``ValueError``
naming the field (``TypeError`` for a wrong JSON type).

This module picks the family and assembles the :class:`HybridCacheConfig`; the builders and
their defaults live in :mod:`hcache.config.families_hybrid` (Mamba hybrids) and
:mod:`hcache.config.families_attention`
(Gemma 3 / 4 and plain attention models), the field reader in :mod:`hcache.config.hf_fields`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..dtypes import dtype_name, resolve_dtype
from . import families_attention as hf_attention
from . import families_hybrid as hf_hybrid
from .caches import HybridCacheConfig, KVCacheConfig, MambaCacheConfig
from .hf_fields import _Cfg

__all__ = ["hybrid_config_from_hf"]

# Defaults of the transformers config classes, for the keys the builders read.
_DEFAULTS: dict[str, dict] = {**hf_hybrid.DEFAULTS, **hf_attention.DEFAULTS}
_BUILDERS = {**hf_hybrid.BUILDERS, **hf_attention.BUILDERS}

# Fallbacks when neither model_type nor architectures names a known family.
_FIELD_HINTS = (("hybrid_override_pattern", "nemotron_h"), ("mamba_num_heads", "nemotron_h"),
                ("attn_layer_period", "jamba"), ("linear_num_value_heads", "qwen3_next"),
                ("mamba_d_ssm", "falcon_h1"), ("n_mamba_heads", "zamba2"),
                ("mamba_n_heads", "granitemoehybrid"), ("global_head_dim", "gemma4"),
                ("num_kv_shared_layers", "gemma4"), ("sliding_window_pattern", "gemma3"))

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
