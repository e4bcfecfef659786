"""Reading a Hugging Face ``config.json`` dict into a cache layout (docs/design.md §4).

:func:`read_hf_layout` picks the model family from the stated ``model_type`` (the text model's,
else the top level's; ``architectures`` and then family-specific fields only for a config that
states none) and runs its
builder from :mod:`hcache.config.families` over a :class:`~hcache.config.hf_fields._Cfg` reader.
Only the model types in ``SUPPORTED_MODEL_TYPES`` are read: any other raises ``ValueError``
naming it, since guessing a layout is how caches get silently corrupted. The shared rules: a key
absent (or ``null``) takes the default of the model's transformers config class, and raises when
the class has none; head dims come from the config's own fields and are derived from
``hidden_size`` only where the model itself does so; an unsupported or inconsistent value raises
``ValueError`` naming the field (``TypeError`` for a wrong JSON type).
:meth:`hcache.HybridCacheConfig.from_hf_config` turns the layout into a config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .families import BUILDERS as _BUILDERS
from .families import DEFAULTS as _DEFAULTS
from .families import SUPPORTED_MODEL_TYPES
from .hf_fields import _Cfg, _Layout

__all__ = ["read_hf_layout", "SUPPORTED_MODEL_TYPES"]

# Fallbacks for a config without any model_type whose architectures name no known family.
_FIELD_HINTS = (("hybrid_override_pattern", "nemotron_h"), ("mamba_num_heads", "nemotron_h"),
                ("attn_layer_period", "jamba"), ("linear_num_value_heads", "qwen3_next"),
                ("mamba_d_ssm", "falcon_h1"), ("n_mamba_heads", "zamba2"),
                ("mamba_n_heads", "granitemoehybrid"), ("global_head_dim", "gemma4"),
                ("num_kv_shared_layers", "gemma4"), ("sliding_window_pattern", "gemma3"))

_BY_KEY = {re.sub(r"[^a-z0-9]", "", f): f for f in _BUILDERS}


def _family_key(name) -> str | None:
    """``"gemma3_text"``, ``"Gemma3ForConditionalGeneration"`` → ``"gemma3"``."""
    if not isinstance(name, str):
        return None
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    key = re.sub(r"(text)?(forcausallm|forconditionalgeneration|model)?$", "", key)
    return _BY_KEY.get(key)


def _select(config: Mapping) -> tuple[str, dict]:
    """The family and the text model's fields (a nested ``text_config`` if there is one).

    A stated ``model_type`` (the text model's if it states one, else the top level's) decides:
    an unknown one is refused even when ``architectures`` names a known class or the wrapper
    around it is known. ``architectures``, then the family-specific fields, are read only for a
    config that states no ``model_type``.
    """
    text = config.get("text_config")
    fields = dict(text) if isinstance(text, Mapping) else dict(config)
    # The text model's own type, when it states one, is the only one that decides: a known
    # wrapper around an unknown text model is still an unknown layout.
    stated = [n for n in (fields.get("model_type"), config.get("model_type")) if n is not None][:1]
    if not stated:
        archs = config.get("architectures")
        for name in archs if isinstance(archs, (list, tuple)) else [archs]:
            if (family := _family_key(name)) is not None:
                return family, fields
        family = next((f for key, f in _FIELD_HINTS if fields.get(key) is not None), None)
        if family is not None:
            return family, fields
        raise ValueError(f"model_type: expected one of {', '.join(SUPPORTED_MODEL_TYPES)}, "
                         f"got nothing (no model_type, and no known architectures)")
    for name in stated:
        if (family := _family_key(name)) is not None:
            return family, fields
    raise ValueError(f"model_type: expected one of {', '.join(SUPPORTED_MODEL_TYPES)}, got "
                     f"{stated[0]!r} (a model type hcache cannot lay out)")


def read_hf_layout(config_dict) -> _Layout:
    """The layer kinds and cache shapes of a model, read from its ``config.json`` dict.

    Returns
    -------
    _Layout
        ``types`` (one :class:`LayerType` per decoder layer), ``kv`` (decoder layer ->
        :class:`KVLayerConfig` for every attention layer), ``mamba`` (the recurrent and conv
        state shape fields, ``None`` without Mamba layers) and ``sharing`` (layer -> the earlier
        layer whose KV cache it reads).

    Raises
    ------
    TypeError
        ``config_dict`` is not a mapping, or a field has the wrong JSON type.
    ValueError
        An unsupported or inconsistent config; the message names the field.
    """
    if not isinstance(config_dict, Mapping):
        raise TypeError(f"config_dict: expected a mapping (a parsed config.json), "
                        f"got {type(config_dict).__name__}")
    family, fields = _select(config_dict)
    return _BUILDERS[family](_Cfg(fields, _DEFAULTS[family]))
