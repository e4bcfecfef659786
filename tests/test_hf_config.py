"""HybridCacheConfig.from_hf_config / hcache.config.hf.hybrid_config_from_hf (docs/design.md §4).

Each model's config dict carries its published values (source in the comment above it); the
expected layouts are computed by hand from those values (layer positions, counts, Mamba sizes by
the formulas of the model's own code), never by calling the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hcache.config import hybrid_config_from_hf
from hcache.config.caches import HybridCacheConfig, KVLayerConfig, LayerType

A, M, AM, NONE = (LayerType.ATTENTION, LayerType.MAMBA, LayerType.ATTENTION_AND_MAMBA,
                  LayerType.NONE)


def build(cfg, **kw):
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("max_sequence_length", 256)
    return hybrid_config_from_hf(cfg, **kw)


def indices(types, kind):
    return [i for i, t in enumerate(types) if t is kind]


def mamba_fields(c):
    m = c.mamba
    return (m.num_layers, m.num_heads, m.head_dim, m.state_size, m.conv_dim, m.conv_kernel)


# --- published configs -------------------------------------------------------------------------

# nvidia/Nemotron-H-8B-Base-8K config.json (as reproduced in Megatron-Bridge's NemotronH bridge
# test fixture, trimmed to the cache-relevant keys).
NEMOTRON_H_8B = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "attention_head_dim": 128, "conv_kernel": 4, "expand": 2, "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "mamba_head_dim": 64, "mamba_num_heads": 128, "n_groups": 8, "num_attention_heads": 32,
    "num_hidden_layers": 52, "num_key_value_heads": 8, "ssm_state_size": 128,
}

# nvidia/NVIDIA-Nemotron-Nano-9B-v2 config.json (56 layers: 27 Mamba-2, 25 MLP, 4 attention per
# its model card; mamba 128 heads x 80, state 128, 8 groups).
NEMOTRON_NANO_9B_V2 = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "num_hidden_layers": 56, "hidden_size": 4480, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 80,
    "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
}

# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B: the MoE pattern and mamba_num_heads of its config.json;
# every other key is left out on purpose, so it takes the NemotronHConfig class default.
NEMOTRON_3_NANO = {
    "model_type": "nemotron_h", "mamba_num_heads": 64,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
}

# ai21labs/Jamba-v0.1 config.json: attention every 8 layers from offset 4, Mamba-1 d_state 16.
JAMBA_V01 = {
    "architectures": ["JambaForCausalLM"], "model_type": "jamba", "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "attn_layer_offset": 4, "attn_layer_period": 8, "expert_layer_offset": 1,
    "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2,
}

# Granite-4.0-H interleave: attention at layers 5, 15, 25, 35 of 40 (layer_types of
# ibm-granite/granite-4.0-h-tiny / -1b config.json; -small publishes the same 36/4 tally).
GRANITE_LAYER_TYPES = (["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"]
                       + ["mamba"] * 9 + ["attention"] + ["mamba"] * 9 + ["attention"]
                       + ["mamba"] * 4)

# ibm-granite/granite-4.0-h-small config.json (cache-relevant keys).
GRANITE_H_SMALL = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "hidden_size": 4096, "num_hidden_layers": 40, "num_attention_heads": 32,
    "num_key_value_heads": 8, "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128,
    "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
    "layer_types": GRANITE_LAYER_TYPES,
}

# ibm-granite/granite-4.0-h-tiny config.json (cache-relevant keys).
GRANITE_H_TINY = {
    "model_type": "granitemoehybrid", "hidden_size": 1536, "num_hidden_layers": 40,
    "num_attention_heads": 12, "num_key_value_heads": 4, "mamba_n_heads": 48,
    "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
    "mamba_expand": 2, "layer_types": GRANITE_LAYER_TYPES,
}

# tiiuae/Falcon-H1-7B-Instruct config.json: attention and Mamba-2 side by side in all 44 layers.
FALCON_H1_7B = {
    "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "hidden_size": 3072,
    "num_hidden_layers": 44, "num_attention_heads": 12, "num_key_value_heads": 2,
    "head_dim": 128, "mamba_d_conv": 4, "mamba_d_head": 128, "mamba_d_ssm": 3072,
    "mamba_d_state": 256, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 24,
}

# Zyphra/Zamba2-2.7B: the layer list is Zamba2Config's default (documented as the 2.7B layout:
# a shared-attention "hybrid" layer after every 6 Mamba blocks, 54 layers); hidden 2560,
# 32 heads (MHA), Mamba-2 80 heads x 64, d_state 64, 1 group.
ZAMBA2_BLOCKS = (["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"]
                 + ["mamba"] * 3 + ["hybrid"] + ["mamba"] * 2)
ZAMBA2_2_7B = {
    "architectures": ["Zamba2ForCausalLM"], "model_type": "zamba2", "hidden_size": 2560,
    "num_hidden_layers": 54, "num_attention_heads": 32, "num_key_value_heads": 32,
    "attention_head_dim": 160, "layers_block_type": ZAMBA2_BLOCKS, "mamba_d_state": 64,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1, "n_mamba_heads": 80,
    "mamba_headdim": 64,
}

# Qwen/Qwen3-Next-80B-A3B-Instruct config.json: full attention every 4th layer of 48.
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}

# google/gemma-3-27b-it config.json: multimodal wrapper, the text model in text_config
# (sliding_window_pattern absent: the class default 6 applies).
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "mm_tokens_per_image": 256,
    "text_config": {"model_type": "gemma3_text", "head_dim": 128, "hidden_size": 5376,
                    "num_attention_heads": 32, "num_hidden_layers": 62,
                    "num_key_value_heads": 16, "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 27,
                      "num_attention_heads": 16, "hidden_size": 1152},
}

# Gemma 4 31B (its published config.json): 60 layers, 50 sliding with
# 16 KV heads x 256 and window 1024, 10 full with 4 KV heads x 512 (K = V projection).
GEMMA4_31B = {
    "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
    "text_config": {"model_type": "gemma4_text", "hidden_size": 5376, "num_hidden_layers": 60,
                    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 256,
                    "global_head_dim": 512, "num_global_key_value_heads": 4,
                    "attention_k_eq_v": True, "sliding_window": 1024,
                    "num_kv_shared_layers": 0,
                    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10},
}

# google/gemma-4-E2B-it text_config: 35 layers (4 sliding + 1 full) x 7, one KV head, the last
# 20 layers read the KV of layers 13 (sliding) / 14 (full).
GEMMA4_E2B = {
    "model_type": "gemma4",
    "text_config": {"model_type": "gemma4_text", "hidden_size": 1536, "num_hidden_layers": 35,
                    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
                    "global_head_dim": 512, "num_global_key_value_heads": None,
                    "attention_k_eq_v": False, "sliding_window": 512,
                    "num_kv_shared_layers": 20,
                    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7},
}

# meta-llama/Meta-Llama-3-8B config.json.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
}


# --- per-model layouts ---------------------------------------------------------------------------

def test_nemotron_h_8b():
    c = build(NEMOTRON_H_8B)
    assert c.num_layers == 52
    assert indices(c.layer_types, A) == [7, 18, 29, 40]
    assert len(indices(c.layer_types, M)) == 24 and len(indices(c.layer_types, NONE)) == 24
    assert c.kv.layer_configs == (KVLayerConfig(8, 128),) * 4
    # conv dim = 128 * 64 + 2 * 8 * 128
    assert mamba_fields(c) == (24, 128, 64, 128, 10240, 4)
    assert dict(c.kv_sharing) == {}


def test_nemotron_nano_9b_v2_inner_size_is_heads_times_head_dim():
    c = build(NEMOTRON_NANO_9B_V2)
    assert c.num_layers == 56
    assert indices(c.layer_types, A) == [14, 21, 30, 39]
    assert (len(indices(c.layer_types, M)), len(indices(c.layer_types, NONE))) == (27, 25)
    assert c.kv.layer_configs == (KVLayerConfig(8, 128),) * 4
    # 128 * 80 = 10240 (not expand * hidden = 8960), + 2 * 8 * 128
    assert mamba_fields(c) == (27, 128, 80, 128, 12288, 4)


def test_nemotron_3_moe_layers_hold_no_cache_and_missing_keys_take_class_defaults():
    c = build(NEMOTRON_3_NANO)
    assert c.num_layers == 52
    assert indices(c.layer_types, A) == [5, 12, 19, 26, 33, 42]
    assert (len(indices(c.layer_types, M)), len(indices(c.layer_types, NONE))) == (23, 23)
    # NemotronHConfig defaults: 8 KV heads x head_dim 128, head dim 64, state 128, 8 groups,
    # conv kernel 4.
    assert c.kv.layer_configs == (KVLayerConfig(8, 128),) * 6
    assert mamba_fields(c) == (23, 64, 64, 128, 64 * 64 + 2 * 8 * 128, 4)


def test_jamba_v01_is_mamba1_with_one_head_of_d_inner():
    c = build(JAMBA_V01)
    assert indices(c.layer_types, A) == [4, 12, 20, 28]
    assert len(indices(c.layer_types, M)) == 28
    assert c.kv.layer_configs == (KVLayerConfig(8, 128),) * 4   # 4096 / 32
    assert mamba_fields(c) == (28, 1, 8192, 16, 8192, 4)         # d_inner = 2 * 4096


@pytest.mark.parametrize("cfg, kv, mamba", [
    (GRANITE_H_SMALL, KVLayerConfig(8, 128), (36, 128, 64, 128, 8192 + 256, 4)),
    (GRANITE_H_TINY, KVLayerConfig(4, 128), (36, 48, 64, 128, 3072 + 256, 4)),
], ids=["small", "tiny"])
def test_granite_4_h(cfg, kv, mamba):
    c = build(cfg)
    assert c.num_layers == 40
    assert indices(c.layer_types, A) == [5, 15, 25, 35]
    assert c.kv.layer_configs == (kv,) * 4
    assert mamba_fields(c) == mamba


def test_falcon_h1_7b_every_layer_has_attention_and_mamba():
    c = build(FALCON_H1_7B)
    assert c.layer_types == (AM,) * 44
    assert c.kv.layer_configs == (KVLayerConfig(2, 128),) * 44
    assert mamba_fields(c) == (44, 24, 128, 256, 3072 + 2 * 256, 4)


def test_zamba2_2_7b_hybrid_layers_own_kv_and_mamba():
    c = build(ZAMBA2_2_7B)
    hybrid = [6, 12, 18, 24, 30, 36, 42, 47, 51]
    assert c.num_layers == 54
    assert indices(c.layer_types, AM) == hybrid
    assert len(indices(c.layer_types, M)) == 45
    assert c.kv.layer_configs == (KVLayerConfig(32, 160),) * 9
    assert mamba_fields(c) == (54, 80, 64, 64, 80 * 64 + 2 * 64, 4)


def test_zamba2_head_dims_come_from_fields_then_from_twice_hidden_over_heads():
    given_fields = build({**ZAMBA2_2_7B, "attention_head_dim": 96, "mamba_headdim": 32,
                          "n_mamba_heads": 160})
    assert given_fields.kv.layer_configs[0].head_dim == 96
    assert given_fields.mamba.head_dim == 32
    derived = {k: v for k, v in ZAMBA2_2_7B.items()
               if k not in ("attention_head_dim", "mamba_headdim")}
    c = build(derived)
    assert c.kv.layer_configs[0].head_dim == 2 * 2560 // 32
    assert c.mamba.head_dim == 2 * 2560 // 80


def test_qwen3_next_80b_gated_delta_net_layers():
    c = build(QWEN3_NEXT_80B)
    assert indices(c.layer_types, A) == list(range(3, 48, 4))
    assert len(indices(c.layer_types, M)) == 36
    assert c.kv.layer_configs == (KVLayerConfig(2, 256),) * 12
    # [v_heads, k_head_dim, v_head_dim]; conv dim = 2 * (16 * 128) + 32 * 128
    assert mamba_fields(c) == (36, 32, 128, 128, 8192, 4)


def test_qwen3_next_layer_types_override_the_interval():
    names = ["linear_attention", "full_attention"] * 24
    c = build({**QWEN3_NEXT_80B, "layer_types": names})
    assert indices(c.layer_types, A) == list(range(1, 48, 2))
    assert c.mamba.num_layers == 24


def test_gemma3_27b_from_nested_text_config():
    c = build(GEMMA3_27B)
    full = [i for i in range(62) if i % 6 == 5]
    assert c.layer_types == (A,) * 62 and c.mamba is None
    layers = c.kv.layer_configs
    assert len(layers) == 62
    for i, lc in enumerate(layers):
        assert (lc.num_kv_heads, lc.head_dim) == (16, 128)
        assert lc.sliding_window == (None if i in full else 1024)


def test_gemma4_31b_full_layers_use_global_head_dim_and_kv_heads():
    c = build(GEMMA4_31B)
    assert c.num_layers == 60 and c.mamba is None and dict(c.kv_sharing) == {}
    for i, lc in enumerate(c.kv.layer_configs):
        if i % 6 == 5:
            assert lc == KVLayerConfig(4, 512)
        else:
            assert lc == KVLayerConfig(16, 256, 1024)


def test_gemma4_e2b_shared_kv_layers():
    c = build(GEMMA4_E2B)
    assert c.num_layers == 35
    expected = {i: (13 if i % 5 != 4 else 14) for i in range(15, 35)}
    assert dict(c.kv_sharing) == expected
    # Only layers 0..14 own a cache; attention_k_eq_v false: full layers keep 1 KV head.
    owners = c.kv.layer_configs
    assert len(owners) == 15
    for i, lc in enumerate(owners):
        assert lc == (KVLayerConfig(1, 512) if i % 5 == 4 else KVLayerConfig(1, 256, 512))


def test_llama3_8b_plain_attention():
    c = build(LLAMA3_8B)
    assert c.layer_types == (A,) * 32 and c.mamba is None
    assert c.kv.layer_configs == (KVLayerConfig(8, 128),) * 32


def test_plain_model_head_dim_field_wins_over_hidden_over_heads():
    # Qwen3-style: head_dim 128 although 4096 / 64 = 64.
    c = build({"model_type": "qwen3", "num_hidden_layers": 3, "hidden_size": 4096,
               "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128})
    assert c.kv.layer_configs == (KVLayerConfig(4, 128),) * 3


def test_plain_model_kv_heads_default_to_attention_heads_and_windows_are_recorded():
    c = build({"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 512,
               "num_attention_heads": 8, "sliding_window": 4096})
    assert c.kv.layer_configs == (KVLayerConfig(8, 64, 4096),) * 2
    off = build({"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 512,
                 "num_attention_heads": 8, "sliding_window": 4096, "use_sliding_window": False})
    assert off.kv.layer_configs == (KVLayerConfig(8, 64),) * 2
    typed = build({"model_type": "gpt_oss", "num_hidden_layers": 2, "head_dim": 64,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "sliding_window": 128,
                   "layer_types": ["sliding_attention", "full_attention"]})
    assert typed.kv.layer_configs == (KVLayerConfig(8, 64, 128), KVLayerConfig(8, 64))


# --- defaults, aliases, detection ------------------------------------------------------------

@pytest.mark.parametrize("cfg, n_layers, attn, kv, mamba", [
    # NemotronHConfig: 52-char default pattern, 8 x 128 KV, 128 x 64 heads, state 128, 8 groups.
    ({"model_type": "nemotron_h"}, 52, [7, 18, 29, 40], KVLayerConfig(8, 128),
     (24, 128, 64, 128, 8192 + 2048, 4)),
    # JambaConfig: the Jamba-v0.1 shape.
    ({"model_type": "jamba"}, 32, [4, 12, 20, 28], KVLayerConfig(8, 128),
     (28, 1, 8192, 16, 8192, 4)),
    # GraniteMoeHybridConfig: every layer Mamba, d_head auto = 2 * 4096 / 128, state 256.
    ({"model_type": "granitemoehybrid"}, 32, [], None, (32, 128, 64, 256, 8192 + 512, 4)),
    # FalconH1Config: mamba_d_ssm 1024 over 128 heads, 8 KV heads x 4096 / 32.
    ({"model_type": "falcon_h1"}, 32, list(range(32)), KVLayerConfig(8, 128),
     (32, 128, 8, 256, 1024 + 512, 4)),
    # Zamba2Config: 54 layers, 8 Mamba heads of 2 * 2560 / 8, attention head dim 2 * 2560 / 32.
    ({"model_type": "zamba2"}, 54, [6, 12, 18, 24, 30, 36, 42, 47, 51], KVLayerConfig(32, 160),
     (54, 8, 640, 64, 5120 + 128, 4)),
    # Qwen3NextConfig: the 80B-A3B shape.
    ({"model_type": "qwen3_next"}, 48, list(range(3, 48, 4)), KVLayerConfig(2, 256),
     (36, 32, 128, 128, 8192, 4)),
], ids=["nemotron_h", "jamba", "granite", "falcon_h1", "zamba2", "qwen3_next"])
def test_missing_keys_take_the_transformers_class_defaults(cfg, n_layers, attn, kv, mamba):
    c = build(cfg)
    assert c.num_layers == n_layers
    assert [i for i, t in enumerate(c.layer_types) if t.has_attention] == attn
    assert c.kv.layer_configs == (kv,) * len(attn)
    assert mamba_fields(c) == mamba


def test_gemma_defaults():
    g3 = build({"model_type": "gemma3_text", "num_hidden_layers": 12})
    assert [lc.sliding_window for lc in g3.kv.layer_configs] == [4096] * 5 + [None] \
        + [4096] * 5 + [None]
    assert {(lc.num_kv_heads, lc.head_dim) for lc in g3.kv.layer_configs} == {(4, 256)}
    g4 = build({"model_type": "gemma4_text"})
    assert g4.num_layers == 30
    full = [i for i in range(30) if i % 6 == 5]
    for i, lc in enumerate(g4.kv.layer_configs):
        assert lc == (KVLayerConfig(4, 512) if i in full else KVLayerConfig(4, 256, 512))


def test_null_values_count_as_absent():
    c = build({"model_type": "granitemoehybrid", "num_hidden_layers": 2, "hidden_size": 256,
               "num_attention_heads": 4, "num_key_value_heads": None, "mamba_n_heads": 8,
               "mamba_d_head": None, "layer_types": ["mamba", "attention"]})
    assert c.kv.layer_configs == (KVLayerConfig(4, 64),)
    assert c.mamba.head_dim == 2 * 256 // 8


def test_falcon_explicit_null_d_ssm_means_expand_times_hidden():
    c = build({**FALCON_H1_7B, "mamba_d_ssm": None, "mamba_d_head": "auto",
               "mamba_expand": 1})
    assert (c.mamba.num_heads, c.mamba.head_dim) == (24, 3072 // 24)
    auto = build({**FALCON_H1_7B, "mamba_d_head": "auto"})
    assert auto.mamba.head_dim == 128


def test_nemotron_aliases_and_layer_list_form():
    legacy = {k: v for k, v in NEMOTRON_H_8B.items() if k not in ("n_groups", "conv_kernel")}
    legacy.update(mamba_n_groups=2, mamba_d_conv=3)
    c = build(legacy)
    assert (c.mamba.conv_kernel, c.mamba.conv_dim) == (3, 128 * 64 + 2 * 2 * 128)
    as_list = {k: v for k, v in NEMOTRON_H_8B.items() if k != "hybrid_override_pattern"}
    as_list["num_hidden_layers"] = 5
    as_list["layers_block_type"] = ["mamba", "moe", "attention", "mlp", "linear_attention"]
    c = build(as_list)
    assert c.layer_types == (M, NONE, A, NONE, M)


def test_family_detected_by_architectures_and_by_fields():
    by_arch = {k: v for k, v in JAMBA_V01.items() if k != "model_type"}
    assert build(by_arch) == build(JAMBA_V01)
    by_fields = {k: v for k, v in QWEN3_NEXT_80B.items()
                 if k not in ("model_type", "architectures")}
    assert build(by_fields) == build(QWEN3_NEXT_80B)
    nemo = {k: v for k, v in NEMOTRON_H_8B.items() if k not in ("model_type", "architectures")}
    assert build(nemo) == build(NEMOTRON_H_8B)
    top_only = {"model_type": "gemma3", "text_config": {**GEMMA3_27B["text_config"]}}
    del top_only["text_config"]["model_type"]
    assert build(top_only) == build(GEMMA3_27B)


def test_text_config_fields_are_used_not_the_wrapper():
    wrapped = {"model_type": "llava", "num_hidden_layers": 99, "text_config": LLAMA3_8B}
    assert build(wrapped) == build(LLAMA3_8B)


def test_gemma4_forces_the_last_layer_to_full_attention():
    c = build({"model_type": "gemma4_text", "num_hidden_layers": 3, "num_key_value_heads": 2,
               "layer_types": ["sliding_attention"] * 3})
    assert [lc.head_dim for lc in c.kv.layer_configs] == [256, 256, 512]


@pytest.mark.parametrize("k_eq_v, full_heads", [(True, 2), (None, 2), (False, 8)])
def test_gemma4_global_kv_heads_apply_unless_k_eq_v_is_false(k_eq_v, full_heads):
    text = {"model_type": "gemma4_text", "num_hidden_layers": 2, "num_key_value_heads": 8,
            "num_global_key_value_heads": 2, "layer_types": ["sliding_attention",
                                                             "full_attention"]}
    if k_eq_v is not None:
        text["attention_k_eq_v"] = k_eq_v
    c = build(text)
    assert [lc.num_kv_heads for lc in c.kv.layer_configs] == [8, full_heads]


def test_gemma4_shared_layer_without_an_earlier_owner_keeps_its_cache():
    # 4 layers, all shared: layer 0 (sliding) and 3 (full) have no earlier owner of their kind.
    c = build({"model_type": "gemma4_text", "num_hidden_layers": 4, "num_kv_shared_layers": 4,
               "layer_types": ["sliding_attention"] * 3 + ["full_attention"]})
    assert dict(c.kv_sharing) == {1: 0, 2: 0}
    assert c.kv.num_attention_layers == 2


def test_from_hf_config_delegates():
    assert HybridCacheConfig.from_hf_config(
        NEMOTRON_H_8B, max_batch_size=4, max_sequence_length=256) == build(NEMOTRON_H_8B)


# --- dtypes --------------------------------------------------------------------------------------

def test_dtype_arguments():
    c = build(NEMOTRON_H_8B)
    assert (c.kv.dtype, c.mamba.ssm_dtype, c.mamba.conv_dtype) == ("float16", "float32",
                                                                   "float16")
    c = build(NEMOTRON_H_8B, kv_dtype="bf16", ssm_dtype=np.float16)
    assert (c.kv.dtype, c.mamba.ssm_dtype, c.mamba.conv_dtype) == ("bfloat16", "float16",
                                                                   "bfloat16")
    c = build(NEMOTRON_H_8B, kv_dtype="float8_e4m3fn", conv_dtype="float32")
    assert (c.kv.dtype, c.mamba.conv_dtype) == ("float8_e4m3fn", "float32")
    assert (c.max_batch_size, c.kv.max_sequence_length) == (4, 256)


@pytest.mark.parametrize("arg", ["kv_dtype", "ssm_dtype", "conv_dtype"])
def test_bad_dtype_names_the_argument(arg):
    with pytest.raises(ValueError, match=arg):
        build(NEMOTRON_H_8B, **{arg: "float64"})
    with pytest.raises(TypeError, match=arg):
        build(NEMOTRON_H_8B, **{arg: 3.5})


# --- errors --------------------------------------------------------------------------------------

def _without(cfg, *keys):
    return {k: v for k, v in cfg.items() if k not in keys}


@pytest.mark.parametrize("cfg, field", [
    ({**NEMOTRON_H_8B, "num_hidden_layers": 51}, "hybrid_override_pattern"),
    ({**NEMOTRON_H_8B, "hybrid_override_pattern": "M*X-"}, r"hybrid_override_pattern\[2\]"),
    ({**NEMOTRON_H_8B, "hybrid_override_pattern": ["M"]}, "hybrid_override_pattern"),
    ({**NEMOTRON_H_8B, "hybrid_override_pattern": "", "num_hidden_layers": None},
     "hybrid_override_pattern"),
    ({"model_type": "bert_like", "num_hidden_layers": 4, "hidden_size": 64}, "model_type"),
    ({"model_type": "mystery"}, "model_type"),
    ({}, "model_type"),
    ({**QWEN3_NEXT_80B, "layer_types": ["full_attention"] * 47}, "layer_types"),
    ({**QWEN3_NEXT_80B, "layer_types": ["full_attention"] * 47 + ["mamba2"]},
     r"layer_types\[47\]"),
    ({**GRANITE_H_TINY, "layer_types": GRANITE_LAYER_TYPES[:-1]}, "layer_types"),
    ({**GRANITE_H_TINY, "layer_types": "mamba"}, "layer_types"),
    ({**ZAMBA2_2_7B, "num_hidden_layers": 53}, "layers_block_type"),
    ({**ZAMBA2_2_7B, "layers_block_type": ["mamba", "attention"], "num_hidden_layers": 2},
     r"layers_block_type\[1\]"),
    (GEMMA3_27B | {"text_config": {**GEMMA3_27B["text_config"],
                                   "layer_types": ["sliding_attention"] * 61}}, "layer_types"),
    ({"model_type": "gemma4_text", "num_hidden_layers": 4, "num_kv_shared_layers": 5},
     "num_kv_shared_layers"),
    ({"model_type": "gemma4_text", "num_kv_shared_layers": -1}, "num_kv_shared_layers"),
    ({**JAMBA_V01, "attn_layer_offset": 8}, "attn_layer_offset"),
    ({**JAMBA_V01, "attn_layer_period": 0}, "attn_layer_period"),
    ({**_without(LLAMA3_8B, "hidden_size")}, "hidden_size"),
    ({**LLAMA3_8B, "hidden_size": 4100}, "hidden_size"),
    ({**_without(LLAMA3_8B, "num_hidden_layers")}, "num_hidden_layers"),
    ({**LLAMA3_8B, "num_key_value_heads": 0}, "num_key_value_heads"),
    ({**FALCON_H1_7B, "mamba_d_head": 64}, "mamba_d_head"),
    ({**_without(GRANITE_H_TINY, "mamba_d_head"), "mamba_n_heads": 7}, "mamba_n_heads"),
    ({**NEMOTRON_H_8B, "ssm_state_size": 0}, "ssm_state_size"),
])
def test_unsupported_or_inconsistent_configs_raise_value_error_naming_the_field(cfg, field):
    with pytest.raises(ValueError, match=field):
        build(cfg)


@pytest.mark.parametrize("cfg, field", [
    ({**LLAMA3_8B, "num_hidden_layers": "32"}, "num_hidden_layers"),
    ({**NEMOTRON_H_8B, "mamba_head_dim": 64.0}, "mamba_head_dim"),
    ({**LLAMA3_8B, "sliding_window": "4k"}, "sliding_window"),
])
def test_wrong_json_types_raise_type_error_naming_the_field(cfg, field):
    with pytest.raises(TypeError, match=field):
        build(cfg)


def test_bad_arguments():
    with pytest.raises(TypeError, match="config_dict"):
        build([("model_type", "llama")])
    with pytest.raises(ValueError, match="max_batch_size"):
        build(LLAMA3_8B, max_batch_size=0)
    with pytest.raises(ValueError, match="max_sequence_length"):
        build(NEMOTRON_H_8B, max_sequence_length=0)


# --- properties ----------------------------------------------------------------------------------

_CHAR_KIND = {"M": M, "*": A, "-": NONE, "E": NONE}


@given(st.text(alphabet="M*-E", min_size=1, max_size=80), st.booleans())
def test_nemotron_patterns_build_layouts_matching_the_pattern(pattern, state_layers):
    cfg = {"model_type": "nemotron_h", "hybrid_override_pattern": pattern,
           "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2}
    if state_layers:
        cfg["num_hidden_layers"] = len(pattern)
    c = build(cfg)
    assert c.layer_types == tuple(_CHAR_KIND[ch] for ch in pattern)
    assert c.kv.num_attention_layers == pattern.count("*")
    if "M" in pattern:
        assert mamba_fields(c) == (pattern.count("M"), 4, 8, 16, 4 * 8 + 2 * 2 * 16, 4)
    else:
        assert c.mamba is None


@given(st.integers(1, 12).flatmap(lambda p: st.tuples(st.just(p), st.integers(0, p - 1))),
       st.integers(1, 64))
def test_jamba_periods_build_layouts_matching_the_period(period_offset, n):
    period, offset = period_offset
    c = build({"model_type": "jamba", "num_hidden_layers": n, "attn_layer_period": period,
               "attn_layer_offset": offset, "hidden_size": 256, "num_attention_heads": 4})
    attn = [i for i in range(n) if i % period == offset]
    assert indices(c.layer_types, A) == attn
    assert indices(c.layer_types, M) == [i for i in range(n) if i not in attn]
    assert c.kv.num_attention_layers == len(attn)
    if len(attn) == n:
        assert c.mamba is None
    else:
        assert mamba_fields(c) == (n - len(attn), 1, 512, 16, 512, 4)


@given(st.lists(st.booleans(), min_size=1, max_size=30), st.integers(0, 30))
def test_gemma4_sharing_invariants(sliding, shared):
    n = len(sliding)
    shared = min(shared, n)
    names = ["sliding_attention" if s else "full_attention" for s in sliding]
    names[-1] = "full_attention"
    kinds = [nm == "sliding_attention" for nm in names]
    c = build({"model_type": "gemma4_text", "num_hidden_layers": n,
               "num_kv_shared_layers": shared, "layer_types": names})
    sharing = dict(c.kv_sharing)
    first = n - shared
    for i in range(n):
        earlier_same = [j for j in range(i) if kinds[j] == kinds[i]]
        if i < first or not earlier_same:
            assert i not in sharing
        else:
            owner = sharing[i]
            assert kinds[owner] == kinds[i] and owner not in sharing
            # the last earlier cache owner of its kind
            assert owner == max(j for j in earlier_same if j not in sharing)
    assert c.kv.num_attention_layers == n - len(sharing)


@pytest.mark.parametrize("value, exc", [(0, ValueError), (-512, ValueError), (False, TypeError),
                                        (512.0, TypeError)])
def test_gemma4_bad_global_head_dim_is_refused_not_replaced(value, exc):
    """docs/design.md §4: an inconsistent config raises naming the field; a global_head_dim of 0
    must not silently become head_dim (only an explicit null means "same as head_dim")."""
    cfg = {"model_type": "gemma4_text", "num_hidden_layers": 6, "head_dim": 64}
    with pytest.raises(exc, match="global_head_dim"):
        HybridCacheConfig.from_hf_config({**cfg, "global_head_dim": value}, max_batch_size=1,
                                         max_sequence_length=8)
    null = HybridCacheConfig.from_hf_config({**cfg, "global_head_dim": None}, max_batch_size=1,
                                            max_sequence_length=8)
    assert [lc.head_dim for lc in null.kv.layer_configs] == [64] * 6
