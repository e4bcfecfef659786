"""Model families whose attention is multi-head latent attention (MLA): DeepSeek-V2
(``deepseek_v2``), DeepSeek-V3 (``deepseek_v3``) and Kimi K2 (``kimi_k2``, DeepSeek-V3's
architecture under its own ``model_type``).

Every decoder layer is an MLA attention layer; dense and MoE feed-forward layers
(``first_k_dense_replace``, ``moe_layer_freq``) do not change the cache. An MLA layer caches one
latent vector per token, the compressed ``c_kv`` (``kv_lora_rank`` elements) followed by the
rotary key ``k_pe`` (``qk_rope_head_dim``), shared by every query head: a
``KVLayerConfig(1, kv_lora_rank + qk_rope_head_dim, components=1)`` and no V. The K/V head
fields (``num_key_value_heads``, ``qk_nope_head_dim``, ``v_head_dim``) size the decompressed
heads, which are not cached, so they are not read; neither is DeepSeek-V3's
``num_nextn_predict_layers`` (its multi-token-prediction layer is not one of the
``num_hidden_layers`` decoder layers).

``MLA_DEFAULTS`` holds the defaults of the transformers config classes (``DeepseekV2Config``,
``DeepseekV3Config``; Kimi K2 ships ``DeepseekV3Config``) for the keys read here;
``MLA_BUILDERS`` maps each ``model_type`` to its builder.
"""

from __future__ import annotations

from .hf_fields import A, _Cfg, _Layout
from .layers import KVLayerConfig

__all__ = ["MLA_BUILDERS", "MLA_DEFAULTS"]

_V3_DEFAULTS = dict(num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64)

MLA_DEFAULTS: dict[str, dict] = {
    "deepseek_v2": dict(num_hidden_layers=32, kv_lora_rank=512, qk_rope_head_dim=64),
    "deepseek_v3": _V3_DEFAULTS,
    "kimi_k2": _V3_DEFAULTS,
}


def _mla(c: _Cfg) -> _Layout:
    """Every layer MLA attention: one ``kv_lora_rank + qk_rope_head_dim`` latent per token."""
    layers = c.int("num_hidden_layers")
    latent = KVLayerConfig(1, c.int("kv_lora_rank") + c.int("qk_rope_head_dim"), components=1)
    return _Layout([A] * layers, {i: latent for i in range(layers)})


MLA_BUILDERS = {family: _mla for family in MLA_DEFAULTS}
