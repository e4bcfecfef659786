"""Model-family tables: how each supported ``model_type`` lays out its caches.

Mamba + attention hybrids, here: Nemotron-H (Nemotron-Nano-v2, Nemotron-3), Jamba, Bamba,
Granite-4.0-H, Falcon-H1, Zamba2 and Qwen3-Next. One builder per family reads the layer types (a
per-layer list, a pattern string, a period or a list of attention layers), one attention shape
for every attention layer, and the shape of the recurrent state. A Mamba-2 layer's inner size is
``heads * head_dim`` (or ``mamba_d_ssm``) and its conv dim ``inner + 2 * n_groups * d_state``;
Jamba is Mamba-1 and Qwen3-Next's linear attention is Gated DeltaNet, each with its own state
shape.

Multi-head latent attention families (DeepSeek-V2 / V3, Kimi K2) are in
:mod:`~hcache.config.families_mla`.

The attention-only families live in :mod:`~hcache.config.families_attention`, the hybrids with
other recurrent layers (LFM2, MiniMax, Kimi Linear) in :mod:`~hcache.config.families_recurrent`.
``DEFAULTS`` holds the defaults of the transformers config classes for the keys the builders read;
``BUILDERS`` maps every supported ``model_type`` to its builder (nothing else is accepted).
"""

from __future__ import annotations

from .._checks import as_int
from .families_attention import ATTENTION_BUILDERS, ATTENTION_DEFAULTS
from .families_mla import MLA_BUILDERS, MLA_DEFAULTS
from .families_recurrent import RECURRENT_BUILDERS, RECURRENT_DEFAULTS
from .hf_fields import AM, NONE, A, M, _Cfg, _check_count, _head_dim, _kv_heads, _Layout, _names
from .layers import KVLayerConfig

__all__ = ["BUILDERS", "DEFAULTS", "SUPPORTED_MODEL_TYPES"]

# --- Mamba + attention hybrids ---------------------------------------------------------------

_NEMOTRON_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_ZAMBA2_BLOCKS = (("mamba",) + (("mamba",) * 5 + ("hybrid",)) * 7 + ("mamba",) * 4
                  + ("hybrid",) + ("mamba",) * 3 + ("hybrid",) + ("mamba",) * 2)

# Defaults of the transformers config classes, for the keys these builders read.
_HYBRID_DEFAULTS: dict[str, dict] = {
    "nemotron_h": dict(hybrid_override_pattern=_NEMOTRON_PATTERN, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, mamba_num_heads=128,
                       mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4),
    "jamba": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                  num_key_value_heads=8, attn_layer_period=8, attn_layer_offset=4,
                  mamba_d_state=16, mamba_d_conv=4, mamba_expand=2),
    "bamba": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                  num_key_value_heads=8, mamba_n_heads=128, mamba_d_head="auto",
                  mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2),
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
}

# Layer-type names of ``layers_block_type`` / ``layer_types`` (legacy and current spellings).
_KIND = {"mamba": M, "linear_attention": M, "attention": A, "full_attention": A,
         "sliding_attention": A, "chunked_attention": A, "hybrid": AM, "mlp": NONE, "moe": NONE}
_PATTERN_KIND = {"M": M, "*": A, "-": NONE, "E": NONE}
_NEMOTRON_NAMES = ("mamba", "linear_attention", "attention", "full_attention", "mlp", "moe")


def _per_head(c: _Cfg, key: str, inner: int, heads_key: str) -> int:
    """A Mamba head dim that may be ``"auto"`` (``inner // heads``)."""
    value, heads = c.get(key), c.int(heads_key)
    if value is not None and value != "auto":
        return as_int(key, value, 1)
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
             else as_int("mamba_d_ssm", d_ssm, 1))
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
    # The older checkpoint spelling: expansion_factor, state_size, conv_dimension, and the head
    # count implied by mamba_headdim (no n_mamba_heads).
    inner = c.int("mamba_expand", "expansion_factor") * c.int("hidden_size")
    if c.raw.get("n_mamba_heads") is None and c.raw.get("mamba_headdim") is not None:
        head_dim = c.int("mamba_headdim")
        if inner % head_dim:
            raise ValueError(f"mamba_headdim: expected a divisor of the Mamba inner size {inner} "
                             f"(no n_mamba_heads given), got {head_dim}")
        heads = inner // head_dim
    else:
        heads = c.int("n_mamba_heads")
        head_dim = _per_head(c, "mamba_headdim", inner, "n_mamba_heads")
    if heads * head_dim != inner:
        raise ValueError(f"n_mamba_heads: expected mamba_expand * hidden_size / mamba_headdim = "
                         f"{inner} / {head_dim} (the reference's state shape), got {heads}")
    mamba = _mamba2(heads, head_dim, c.int("mamba_ngroups"), c.int("mamba_d_state", "state_size"),
                    c.int("mamba_d_conv", "conv_dimension"))
    return _Layout(types, _uniform(types, kv), mamba)


def _bamba(c: _Cfg) -> _Layout:
    n = c.int("num_hidden_layers")
    indices = c.get("attn_layer_indices")
    attention = set()
    if indices is not None:
        if isinstance(indices, (str, bytes)) or not isinstance(indices, (list, tuple)):
            raise ValueError(f"attn_layer_indices: expected a list of layer indices, "
                             f"got {type(indices).__name__}")
        for i, v in enumerate(indices):
            v = as_int(f"attn_layer_indices[{i}]", v, 0)
            if v >= n:
                raise ValueError(f"attn_layer_indices[{i}]: expected a layer index below "
                                 f"num_hidden_layers ({n}), got {v}")
            attention.add(v)
    types = [A if i in attention else M for i in range(n)]
    kv = KVLayerConfig(_kv_heads(c), _head_dim(c, "head_dim"))
    inner = c.int("mamba_expand") * c.int("hidden_size")
    heads = c.int("mamba_n_heads")
    head_dim = _per_head(c, "mamba_d_head", inner, "mamba_n_heads")
    if heads * head_dim != inner:
        raise ValueError(f"mamba_d_head: expected mamba_expand * hidden_size / mamba_n_heads = "
                         f"{inner} / {heads}, got {head_dim}")
    mamba = _mamba2(heads, head_dim, c.int("mamba_n_groups"), c.int("mamba_d_state"),
                    c.int("mamba_d_conv"))
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


_HYBRID_BUILDERS = {"nemotron_h": _nemotron_h, "jamba": _jamba, "bamba": _bamba,
                    "granitemoehybrid": _granite, "falcon_h1": _falcon_h1, "zamba2": _zamba2,
                    "qwen3_next": _qwen3_next}

DEFAULTS: dict[str, dict] = {**_HYBRID_DEFAULTS, **ATTENTION_DEFAULTS, **RECURRENT_DEFAULTS,
                             **MLA_DEFAULTS}
BUILDERS = {**_HYBRID_BUILDERS, **ATTENTION_BUILDERS, **RECURRENT_BUILDERS, **MLA_BUILDERS}
# Every model_type read_hf_layout accepts (a text_config's or the top level's).
SUPPORTED_MODEL_TYPES = tuple(sorted(BUILDERS))
