"""``HybridCacheConfig.from_hf_config`` for the multi-head latent attention families
(hcache/config/families_mla.py): DeepSeek-V2, DeepSeek-V3 and Kimi K2.

The dicts are the published ``config.json`` files of DeepSeek-V2-Lite, DeepSeek-V2,
DeepSeek-V3 and Kimi-K2-Instruct (cache-relevant fields and their neighbours, values as
published), and Kimi K2.5's nested ``text_config``. The oracle is the MLA cache as the models
and serving engines keep it: every decoder layer caches one latent vector of
``kv_lora_rank + qk_rope_head_dim`` elements per token (512 + 64 = 576 in all of them), one
"head", no V, whatever the attention head counts and MoE layout.
"""

from __future__ import annotations

import pytest

from hcache.config.caches import HybridCacheConfig, KVLayerConfig, LayerType
from hcache.config.hf import read_hf_layout
from hcache.slots.hybrid import HybridCacheManager

A = LayerType.ATTENTION

_DEEPSEEK_V2_MOE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", attention_bias=False,
    aux_loss_alpha=0.001, hidden_act="silu", kv_lora_rank=512, max_position_embeddings=163840,
    moe_layer_freq=1, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                  "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                  "type": "yarn"},
    rope_theta=10000, scoring_func="softmax", torch_dtype="bfloat16", vocab_size=102400)

DEEPSEEK_V2_LITE = dict(
    _DEEPSEEK_V2_MOE, first_k_dense_replace=1, hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, n_group=1, n_routed_experts=64, n_shared_experts=2,
    num_attention_heads=16, num_experts_per_tok=6, num_hidden_layers=27,
    num_key_value_heads=16, q_lora_rank=None, topk_group=1, topk_method="greedy")

DEEPSEEK_V2 = dict(
    _DEEPSEEK_V2_MOE, first_k_dense_replace=1, hidden_size=5120, intermediate_size=12288,
    moe_intermediate_size=1536, n_group=8, n_routed_experts=160, n_shared_experts=2,
    num_attention_heads=128, num_experts_per_tok=6, num_hidden_layers=60,
    num_key_value_heads=128, q_lora_rank=1536, topk_group=3,
    topk_method="group_limited_greedy")

DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", first_k_dense_replace=3,
    hidden_size=7168, intermediate_size=18432, kv_lora_rank=512,
    max_position_embeddings=163840, moe_intermediate_size=2048, moe_layer_freq=1, n_group=8,
    n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True, num_attention_heads=128,
    num_experts_per_tok=8, num_hidden_layers=61, num_key_value_heads=128,
    num_nextn_predict_layers=1, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
    rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", topk_group=4,
    topk_method="noaux_tc", torch_dtype="bfloat16", v_head_dim=128, vocab_size=129280,
    quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                         "weight_block_size": [128, 128]})

KIMI_K2_INSTRUCT = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", first_k_dense_replace=1,
    hidden_size=7168, intermediate_size=18432, kv_lora_rank=512,
    max_position_embeddings=131072, moe_intermediate_size=2048, moe_layer_freq=1, n_group=1,
    n_routed_experts=384, n_shared_experts=1, norm_topk_prob=True, num_attention_heads=64,
    num_experts_per_tok=8, num_hidden_layers=61, num_key_value_heads=64,
    num_nextn_predict_layers=0, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
    rope_theta=50000.0, routed_scaling_factor=2.827, scoring_func="sigmoid", topk_group=1,
    topk_method="noaux_tc", torch_dtype="bfloat16", v_head_dim=128, vocab_size=163840)

KIMI_K2_5 = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
             "vision_config": {"vt_num_hidden_layers": 27},
             "text_config": dict(KIMI_K2_INSTRUCT, max_position_embeddings=262144)}

LATENT = KVLayerConfig(1, 576, components=1)


@pytest.mark.parametrize("cfg, layers", [(DEEPSEEK_V2_LITE, 27), (DEEPSEEK_V2, 60),
                                         (DEEPSEEK_V3, 61), (KIMI_K2_INSTRUCT, 61),
                                         (KIMI_K2_5, 61)],
                         ids=["deepseek-v2-lite", "deepseek-v2", "deepseek-v3", "kimi-k2",
                              "kimi-k2.5"])
def test_every_layer_caches_one_576_element_latent(cfg, layers):
    """Dense and MoE layers alike: ``num_hidden_layers`` MLA layers (V3's MTP layer is not
    one), each ``KVLayerConfig(1, 576, components=1)``; no Mamba state, no sharing."""
    layout = read_hf_layout(cfg)
    assert layout.types == [A] * layers
    assert set(layout.kv) == set(range(layers)) and set(layout.kv.values()) == {LATENT}
    assert layout.mamba is None and layout.sharing == {}
    hc = HybridCacheConfig.from_hf_config(cfg, max_batch_size=2, max_sequence_length=8,
                                          kv_dtype="bfloat16")
    assert hc.kv.layer_configs == (LATENT,) * layers and hc.mamba is None


def test_a_deepseek_v3_manager_allocates_the_latent_bytes_only():
    """61 layers x 2 slots x 16 tokens x 576 bfloat16 elements: no V, one head."""
    hc = HybridCacheConfig.from_hf_config(DEEPSEEK_V3, max_batch_size=2, max_sequence_length=16,
                                          kv_dtype="bfloat16")
    m = HybridCacheManager(hc, device="cpu")
    assert m.get_combined_kv_cache(60).shape == (2, 1, 1, 16, 576)
    assert m.memory_report()["kv_cache"] == 61 * 2 * 16 * 576 * 2
    assert [g.components for g in m.get_kv_head_dim_groups()] == [1]


def test_missing_keys_take_the_transformers_class_defaults():
    """``DeepseekV2Config``: 32 layers; ``DeepseekV3Config`` (also Kimi K2's): 61; both
    ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64; ``null`` counts as absent."""
    assert len(read_hf_layout({"model_type": "deepseek_v2"}).types) == 32
    for family in ("deepseek_v3", "kimi_k2"):
        layout = read_hf_layout({"model_type": family, "kv_lora_rank": None})
        assert len(layout.types) == 61 and set(layout.kv.values()) == {LATENT}
    small = read_hf_layout({"architectures": ["DeepseekV2ForCausalLM"], "num_hidden_layers": 3,
                            "kv_lora_rank": 16, "qk_rope_head_dim": 8, "head_dim": 999,
                            "num_key_value_heads": 4})
    assert small.kv[2] == KVLayerConfig(1, 24, components=1)


@pytest.mark.parametrize("key, value, exc", [
    ("kv_lora_rank", 0, ValueError), ("qk_rope_head_dim", -64, ValueError),
    ("num_hidden_layers", 0, ValueError), ("kv_lora_rank", "512", TypeError),
    ("qk_rope_head_dim", 64.0, TypeError), ("num_hidden_layers", True, TypeError)])
def test_bad_size_fields_are_refused_naming_the_field(key, value, exc):
    with pytest.raises(exc, match=key):
        read_hf_layout(dict(DEEPSEEK_V3, **{key: value}))
