"""Hybrids whose recurrent layers are not Mamba: short convolutions, lightning attention, KDA.

Each builder returns the shape of its one recurrent layer kind as ``MambaCacheConfig`` fields,
with 0 for a state the layer does not have:

- LFM2 (``lfm2``): gated short-convolution layers, a conv state ``[hidden_size, conv_L_cache]``
  and no recurrent state; ``layer_types`` names them ``"conv"`` (or ``full_attn_idxs`` lists the
  attention layers).
- MiniMax-Text-01 / M1 (``minimax``, ``minimax_m1``, ``minimax_text_01``): lightning (linear)
  attention layers, a recurrent state ``[num_attention_heads, head_dim, head_dim]`` and no conv
  state; ``layer_types`` (``"linear_attention"`` / ``"full_attention"``) or ``attn_type_list``
  (0 lightning, 1 softmax) says which layer is which.
- Kimi Linear (``kimi_linear``): KDA layers, short convolutions over q, k and v (conv dim
  ``3 * heads * head_dim``) and a recurrent state ``[heads, head_dim, head_dim]``, read from
  ``linear_attn_config``; its full attention layers are MLA, whose cache is one latent vector of
  ``kv_lora_rank + qk_rope_head_dim`` per token (``KVLayerConfig(1, ..., components=1)``).
"""

from __future__ import annotations

from collections.abc import Mapping

from .._checks import as_int
from .hf_fields import A, M, _Cfg, _check_count, _head_dim, _kv_heads, _Layout, _names
from .layers import KVLayerConfig

__all__ = ["RECURRENT_BUILDERS", "RECURRENT_DEFAULTS"]

_MINIMAX = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                num_key_value_heads=8)

# Defaults of the transformers config classes, for the keys these builders read (the remote-code
# MiniMax classes have none here: their configs state every size).
RECURRENT_DEFAULTS: dict[str, dict] = {
    "lfm2": dict(num_hidden_layers=32, hidden_size=2560, num_attention_heads=32,
                 num_key_value_heads=8, conv_L_cache=3),
    "minimax": _MINIMAX,
    "minimax_m1": {},
    "minimax_text_01": {},
    "kimi_linear": dict(num_hidden_layers=27, hidden_size=2304, num_attention_heads=32,
                        kv_lora_rank=512, qk_rope_head_dim=64, linear_head_dim=128,
                        linear_num_heads=32, linear_conv_kernel_dim=4),
}


def _no_recurrent(conv_dim: int, kernel: int) -> dict:
    return dict(num_heads=0, head_dim=0, state_size=0, conv_dim=conv_dim, conv_kernel=kernel)


def _index_list(c: _Cfg, key: str, values, n: int, base: int) -> set[int]:
    """A list of ``base``-based layer indices, validated, as 0-based indices."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise ValueError(f"{key}: expected a list of layer indices, got {type(values).__name__}")
    out = set()
    for i, v in enumerate(values):
        v = as_int(f"{key}[{i}]", v, base)
        if v >= n + base:
            raise ValueError(f"{key}[{i}]: expected a layer index in [{base}, {n + base}) "
                             f"(num_hidden_layers {n}), got {v}")
        out.add(v - base)
    return out


def _agree(key: str, types: list, other: list) -> None:
    """A second spelling of the layer list must say the same as ``layer_types``."""
    if other != types:
        i = next((i for i, (a, b) in enumerate(zip(types, other)) if a is not b),
                 min(len(types), len(other)))
        raise ValueError(f"{key}: expected the layer kinds of layer_types, got a different "
                         f"kind (or count) at layer {i}")


def _lfm2(c: _Cfg) -> _Layout:
    names = _names(c, ("layer_types",), ("conv", "full_attention"))
    n = c.int("num_hidden_layers") if names is None else len(names)
    idxs = c.raw.get("full_attn_idxs")
    full = set(range(n)) if idxs is None else _index_list(c, "full_attn_idxs", idxs, n, 0)
    types = [A if i in full else M for i in range(n)]
    if names is not None:
        if idxs is not None:
            _agree("full_attn_idxs", [A if name == "full_attention" else M for name in names],
                   types)
        types = [A if name == "full_attention" else M for name in names]
    kv = KVLayerConfig(_kv_heads(c), _head_dim(c, "head_dim"))
    mamba = _no_recurrent(c.int("hidden_size"), c.int("conv_L_cache"))
    return _Layout(types, {i: kv for i, t in enumerate(types) if t is A}, mamba)


def _minimax(c: _Cfg) -> _Layout:
    names = _names(c, ("layer_types",), ("linear_attention", "full_attention"))
    key, codes = c.find("attn_type_list", "decoder_attention_types")
    types = None
    if codes is None:
        if names is None:   # the transformers default: even layers full, odd layers lightning
            types = [A if i % 2 == 0 else M for i in range(c.int("num_hidden_layers"))]
    else:
        if isinstance(codes, (str, bytes)) or not isinstance(codes, (list, tuple)):
            raise ValueError(f"{key}: expected a list of 0 (lightning) and 1 (softmax), "
                             f"got {type(codes).__name__}")
        for i, code in enumerate(codes):
            if isinstance(code, bool) or code not in (0, 1):
                raise ValueError(f"{key}[{i}]: expected 0 (lightning) or 1 (softmax), "
                                 f"got {code!r}")
        _check_count(c, len(codes), key)
        types = [A if code == 1 else M for code in codes]
    if names is not None:
        if types is not None:
            _agree(key, [A if name == "full_attention" else M for name in names], types)
        types = [A if name == "full_attention" else M for name in names]
    head_dim = _head_dim(c, "head_dim")
    kv = KVLayerConfig(_kv_heads(c), head_dim, c.get("sliding_window"))
    mamba = dict(num_heads=c.int("num_attention_heads"), head_dim=head_dim, state_size=head_dim,
                 conv_dim=0, conv_kernel=0)
    return _Layout(types, {i: kv for i, t in enumerate(types) if t is A}, mamba)


def _kimi_linear(c: _Cfg) -> _Layout:
    sub = c.raw.get("linear_attn_config")
    if sub is not None and not isinstance(sub, Mapping):
        raise TypeError(f"linear_attn_config: expected a mapping, got {type(sub).__name__}")
    sub = sub or {}

    def linear(key: str, flat: str) -> int:
        if sub.get(key) is not None:
            return as_int(f"linear_attn_config.{key}", sub[key], 1)
        return c.int(flat)

    names = _names(c, ("layer_types",), ("linear_attention", "full_attention"))
    n = c.int("num_hidden_layers") if names is None else len(names)
    types = None
    if sub.get("full_attn_layers") is not None or sub.get("kda_layers") is not None:
        # The checkpoint's own spelling: 1-based layer numbers, every layer in exactly one list.
        full = _index_list(c, "linear_attn_config.full_attn_layers",
                           sub.get("full_attn_layers") or [], n, 1)
        kda = _index_list(c, "linear_attn_config.kda_layers", sub.get("kda_layers") or [], n, 1)
        if full & kda or len(full | kda) != n:
            missing = sorted(set(range(n)) - (full | kda)) or sorted(full & kda)
            raise ValueError(f"linear_attn_config.kda_layers: expected every layer 1..{n} in "
                             f"exactly one of full_attn_layers and kda_layers, got layer "
                             f"{missing[0] + 1} in {'both' if full & kda else 'neither'}")
        types = [A if i in full else M for i in range(n)]
    if names is not None:
        if types is not None:
            _agree("linear_attn_config.full_attn_layers",
                   [A if name == "full_attention" else M for name in names], types)
        types = [A if name == "full_attention" else M for name in names]
    elif types is None:
        types = [A if (i + 1) % 4 == 0 else M for i in range(n)]
    latent = c.int("kv_lora_rank") + c.int("qk_rope_head_dim", minimum=0)
    kv = KVLayerConfig(1, latent, components=1)
    heads, head_dim = linear("num_heads", "linear_num_heads"), linear("head_dim", "linear_head_dim")
    mamba = dict(num_heads=heads, head_dim=head_dim, state_size=head_dim,
                 conv_dim=3 * heads * head_dim,
                 conv_kernel=linear("short_conv_kernel_size", "linear_conv_kernel_dim"))
    return _Layout(types, {i: kv for i, t in enumerate(types) if t is A}, mamba)


RECURRENT_BUILDERS = {"lfm2": _lfm2, "minimax": _minimax, "minimax_m1": _minimax,
                      "minimax_text_01": _minimax, "kimi_linear": _kimi_linear}
