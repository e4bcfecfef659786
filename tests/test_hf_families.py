"""Issue 13's families from their real ``config.json`` values: Bamba, Gemma 4's
``per_layer_config``, Zamba2's older spelling, LFM2 (short convolutions), MiniMax-Text-01 / M1
(lightning attention), Kimi Linear (KDA + MLA); and the strict reader: an unknown ``model_type``
or a missing size field raises, naming it. Expected shapes are those the models' reference
implementations allocate (transformers' cache classes), worked out by hand below."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hcache import HybridCacheConfig, KVLayerConfig, LayerType, MambaCacheConfig
from hcache.config.families_attention import PLAIN_MODEL_TYPES
from hcache.config.hf import SUPPORTED_MODEL_TYPES

A, M, AM = LayerType.ATTENTION, LayerType.MAMBA, LayerType.ATTENTION_AND_MAMBA
ROOT = Path(__file__).resolve().parent.parent


def build(cfg, **kw):
    kw.setdefault("max_batch_size", 2)
    kw.setdefault("max_sequence_length", 64)
    return HybridCacheConfig.from_hf_config(cfg, **kw)


def indices(types, kind):
    return [i for i, t in enumerate(types) if t is kind]


def shapes(c):
    """(layers, recurrent state shape, conv state shape) of the Mamba config."""
    m = c.mamba
    return m.num_layers, m.recurrent_state_shape, m.conv_state_shape


# ibm-ai-platform/Bamba-9B config.json: attention at layers 9, 18, 27 of 32; Mamba-2 with 128
# heads of 64 (expand 2 x 4096 / 128), d_state 128, one group.
BAMBA_9B = {
    "architectures": ["BambaForCausalLM"], "model_type": "bamba", "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "attn_layer_indices": [9, 18, 27], "mamba_n_heads": 128, "mamba_d_head": 64,
    "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_chunk_size": 256, "intermediate_size": 14336, "max_position_embeddings": 262144,
}

# Zyphra/Zamba2-7B config.json in the older key spelling (expansion_factor, state_size,
# conv_dimension, mamba_headdim, no n_mamba_heads): 81 layers, 13 shared-attention "hybrid".
ZAMBA2_7B_BLOCKS = (["mamba"] * 6 + ["hybrid"] + ["mamba"] * 4 + ["hybrid"]
                    + (["mamba"] * 5 + ["hybrid"]) * 11 + ["mamba"] * 3)
ZAMBA2_7B = {
    "architectures": ["Zamba2ForCausalLM"], "model_type": "zamba2", "add_bias_linear": False,
    "conv_dimension": 4, "expansion_factor": 2, "ffn_hidden_size": 14336, "hidden_size": 3584,
    "kv_channels": 112, "layers_block_type": ZAMBA2_7B_BLOCKS, "lora_rank": 128,
    "mamba_headdim": 64, "mamba_ngroups": 2, "max_position_embeddings": 4096,
    "num_attention_heads": 32, "num_hidden_layers": 81, "num_key_value_heads": 32,
    "num_mem_blocks": 2, "num_query_groups": 32, "sliding_window": None, "state_size": 64,
    "use_shared_attention_lora": False, "use_shared_block_lora": True, "vocab_size": 32000,
}

# LiquidAI/LFM2-1.2B config.json: 16 layers, attention at 2, 5, 8, 10, 12, 14, short
# convolutions elsewhere (depthwise over hidden_size channels, L_cache 3).
LFM2_LAYERS = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
               "full_attention", "conv", "full_attention", "conv", "full_attention", "conv",
               "full_attention", "conv"]
LFM2_1_2B = {
    "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 2048,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "conv_L_cache": 3, "conv_bias": False, "block_dim": 2048, "block_ff_dim": 12288,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14], "layer_types": LFM2_LAYERS, "norm_eps": 1e-05,
    "max_position_embeddings": 128000, "vocab_size": 65536,
}

# MiniMaxAI/MiniMax-M1-80k config.json: 80 layers, a softmax attention layer after every seven
# lightning attention layers (attn_type_list 0 / 1), 64 heads of 128, 8 KV heads.
MINIMAX_TYPES = ([0] * 7 + [1]) * 10
MINIMAX_M1 = {
    "architectures": ["MiniMaxM1ForCausalLM"], "model_type": "minimax_m1", "hidden_size": 6144,
    "head_dim": 128, "num_attention_heads": 64, "num_key_value_heads": 8,
    "num_hidden_layers": 80, "attn_type_list": MINIMAX_TYPES, "rotary_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 2, "intermediate_size": 9216,
    "max_position_embeddings": 10240000, "vocab_size": 200064,
}
# MiniMaxAI/MiniMax-Text-01-hf (the transformers conversion) says the same with layer_types.
MINIMAX_TEXT_01_HF = {
    **{k: v for k, v in MINIMAX_M1.items() if k != "attn_type_list"},
    "architectures": ["MiniMaxForCausalLM"], "model_type": "minimax",
    "layer_types": ["full_attention" if t else "linear_attention" for t in MINIMAX_TYPES],
    "block_size": 256,
}

# moonshotai/Kimi-Linear-48B-A3B-Instruct config.json: 27 layers, MLA at 4, 8, ..., 24 and 27
# (1-based), KDA elsewhere: 32 heads of 128, short convolutions of width 4 over q, k and v.
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "hidden_size": 2304, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_key_value_heads": 32, "head_dim": 72, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
    "num_experts": 256, "num_experts_per_token": 8, "moe_intermediate_size": 1024,
}

# The Gemma 4 repro: current configs carry the full layer's shape in per_layer_config.
GEMMA4_PER_LAYER = {
    "model_type": "gemma4_text", "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "layer_types": ["sliding_attention",
                                                             "full_attention"],
    "per_layer_config": {"1": {"head_dim": 16}},
}


def test_bamba_9b_attention_layers_come_from_attn_layer_indices():
    c = build(BAMBA_9B)
    assert indices(c.layer_types, A) == [9, 18, 27]
    assert len(indices(c.layer_types, M)) == 29
    assert c.kv.layer_configs == (KVLayerConfig(8, 4096 // 32),) * 3
    # Mamba-2: conv over x, B and C: 128 * 64 + 2 * 1 * 128 channels.
    assert shapes(c) == (29, (128, 64, 128), (128 * 64 + 2 * 128, 4))


def test_bamba_without_indices_is_all_mamba_as_the_class_says():
    c = build({k: v for k, v in BAMBA_9B.items() if k != "attn_layer_indices"})
    assert c.layer_types == (M,) * 32 and c.kv.layer_configs == ()


def test_gemma4_per_layer_config_gives_the_full_layer_its_shape():
    c = build(GEMMA4_PER_LAYER)
    assert c.kv.layer_configs == (KVLayerConfig(2, 8, 512), KVLayerConfig(2, 16))
    # KV heads may be overridden too, per layer; a layer without an entry keeps the base shape.
    c = build({**GEMMA4_PER_LAYER, "num_hidden_layers": 3,
               "layer_types": ["sliding_attention", "full_attention", "full_attention"],
               "per_layer_config": {"1": {"head_dim": 16, "num_key_value_heads": 1}}})
    assert c.kv.layer_configs == (KVLayerConfig(2, 8, 512), KVLayerConfig(1, 16),
                                  KVLayerConfig(2, 8))


@pytest.mark.parametrize(("table", "exc", "field"), [
    ({"2": {"head_dim": 16}}, ValueError, "per_layer_config"),
    ({"x": {"head_dim": 16}}, ValueError, "per_layer_config"),
    ({"1": {"head_dim": 0}}, ValueError, "per_layer_config['1'].head_dim"),
    ({"1": {"head_dim": 1.5}}, TypeError, "per_layer_config['1'].head_dim"),
    ({"1": 16}, TypeError, "per_layer_config['1']"),
    ([16], TypeError, "per_layer_config"),
])
def test_gemma4_bad_per_layer_config_is_refused(table, exc, field):
    with pytest.raises(exc, match=re.escape(field)):
        build({**GEMMA4_PER_LAYER, "per_layer_config": table})


def test_zamba2_7b_older_spelling_derives_112_mamba_heads():
    c = build(ZAMBA2_7B)
    assert c.num_layers == 81
    assert indices(c.layer_types, AM) == [6, 11] + list(range(17, 78, 6))
    # 2 * 3584 / 64 = 112 heads; conv over x, B, C: 112 * 64 + 2 * 2 * 64.
    assert shapes(c) == (81, (112, 64, 64), (112 * 64 + 2 * 2 * 64, 4))
    assert c.kv.layer_configs == (KVLayerConfig(32, 2 * 3584 // 32),) * 13


def test_zamba2_heads_and_head_dim_must_agree_with_the_inner_size():
    with pytest.raises(ValueError, match="n_mamba_heads"):
        build({**ZAMBA2_7B, "n_mamba_heads": 8})
    with pytest.raises(ValueError, match="mamba_headdim"):
        build({**ZAMBA2_7B, "mamba_headdim": 100})


def test_lfm2_short_conv_layers_have_a_conv_state_only():
    c = build(LFM2_1_2B)
    assert indices(c.layer_types, A) == [2, 5, 8, 10, 12, 14]
    assert c.kv.layer_configs == (KVLayerConfig(8, 2048 // 32),) * 6
    assert shapes(c) == (10, (0, 0, 0), (2048, 3))
    assert not c.mamba.has_recurrent_state and c.mamba.has_conv_state
    # full_attn_idxs alone gives the same layout.
    legacy = build({k: v for k, v in LFM2_1_2B.items() if k != "layer_types"})
    assert legacy == c


@pytest.mark.parametrize("cfg", [MINIMAX_M1, MINIMAX_TEXT_01_HF,
                                 {**MINIMAX_M1, "model_type": "minimax_text_01"},
                                 {**MINIMAX_TEXT_01_HF, "attn_type_list": MINIMAX_TYPES}])
def test_minimax_lightning_layers_have_a_head_dim_square_state_and_no_conv(cfg):
    c = build(cfg)
    assert indices(c.layer_types, A) == list(range(7, 80, 8))
    assert c.kv.layer_configs == (KVLayerConfig(8, 128),) * 10
    assert shapes(c) == (70, (64, 128, 128), (0, 0))
    assert c.mamba.has_recurrent_state and not c.mamba.has_conv_state


def test_kimi_linear_kda_layers_and_mla_latent_caches():
    c = build(KIMI_LINEAR_48B)
    mla = [3, 7, 11, 15, 19, 23, 26]
    assert indices(c.layer_types, A) == mla
    # transformers saves layer_types next to the checkpoint's lists; they agree.
    saved = build({**KIMI_LINEAR_48B, "layer_types": [
        "full_attention" if i in mla else "linear_attention" for i in range(27)]})
    assert saved == c
    # MLA: one latent c_kv (512) + k_pe (64) per token, one head, no V.
    assert c.kv.layer_configs == (KVLayerConfig(1, 512 + 64, components=1),) * 7
    # KDA: [heads, head_k_dim, head_v_dim] and three short convs (q, k, v) of 32 * 128 each.
    assert shapes(c) == (20, (32, 128, 128), (3 * 32 * 128, 4))
    flat = {k: v for k, v in KIMI_LINEAR_48B.items() if k != "linear_attn_config"}
    default = build({**flat, "linear_num_heads": 32, "linear_head_dim": 128})
    # Without the checkpoint's lists the class default puts MLA at every fourth layer.
    assert indices(default.layer_types, A) == [3, 7, 11, 15, 19, 23]


@pytest.mark.parametrize(("edit", "field"), [
    ({"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3]}, "linear_attn_config.kda_layers"),
    ({"full_attn_layers": [1, 28]}, "linear_attn_config.full_attn_layers[1]"),
    ({"full_attn_layers": [0]}, "linear_attn_config.full_attn_layers[0]"),
    ({"num_heads": 0}, "linear_attn_config.num_heads"),
])
def test_kimi_linear_bad_layer_lists_are_refused(edit, field):
    cfg = {**KIMI_LINEAR_48B,
           "linear_attn_config": {**KIMI_LINEAR_48B["linear_attn_config"], **edit}}
    with pytest.raises(ValueError, match=re.escape(field)):
        build(cfg)


@pytest.mark.parametrize("model_type", ["deepseek_v4", "minimax_m2", "mamba", "rwkv6",
                                        "an_invented_model"])
def test_unknown_model_types_raise_naming_the_model_type(model_type):
    cfg = {"model_type": model_type, "num_hidden_layers": 4, "hidden_size": 256,
           "num_attention_heads": 4, "kv_lora_rank": 64}
    with pytest.raises(ValueError, match=f"model_type: .*got '{model_type}'"):
        build(cfg)
    # Nor does an architecture name a stated model type contradicts.
    with pytest.raises(ValueError, match=model_type):
        build({**cfg, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match=model_type):
        build({"model_type": model_type, "text_config": {k: v for k, v in cfg.items()
                                                          if k != "model_type"}})
    # A wrapper's unknown type does not hide a known text model (LLaVA around Llama).
    wrapped = build({"model_type": model_type, "text_config": {**cfg, "model_type": "llama"}})
    assert wrapped.num_layers == 4
    # Nor does a known wrapper hide an unknown text model: the text model's type decides.
    with pytest.raises(ValueError, match=f"got '{model_type}'"):
        build({"model_type": "gemma3", "text_config": {**cfg, "sliding_window": 8,
                                                       "sliding_window_pattern": 2}})


@pytest.mark.parametrize(("cfg", "field"), [
    ({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32},
     "num_hidden_layers"),
    ({"model_type": "mistral", "num_hidden_layers": 2, "num_attention_heads": 32},
     "hidden_size"),
    ({"model_type": "qwen3", "num_hidden_layers": 2, "head_dim": 64}, "num_key_value_heads"),
    ({k: v for k, v in MINIMAX_M1.items() if k not in ("head_dim", "hidden_size")},
     "hidden_size"),
    ({k: v for k, v in MINIMAX_M1.items() if k != "num_key_value_heads"
      and k != "num_attention_heads"}, "num_key_value_heads"),
    ({"model_type": "minimax_m1", "head_dim": 8, "num_attention_heads": 2,
      "num_key_value_heads": 1}, "num_hidden_layers"),
    ({**LFM2_1_2B, "layer_types": ["conv", "mamba"] * 8}, "layer_types[1]"),
    ({**LFM2_1_2B, "layer_types": ["conv"] * 15}, "layer_types"),
    ({**MINIMAX_M1, "attn_type_list": [0, 2] * 40}, "attn_type_list[1]"),
    ({**MINIMAX_M1, "attn_type_list": [0, 1] * 30}, "attn_type_list"),
    ({**BAMBA_9B, "attn_layer_indices": [9, 32]}, "attn_layer_indices[1]"),
    ({**BAMBA_9B, "mamba_d_head": 32}, "mamba_d_head"),
    ({**KIMI_LINEAR_48B, "kv_lora_rank": 0}, "kv_lora_rank"),
    # Two spellings of the layer list that disagree: neither is guessed right.
    ({**LFM2_1_2B, "full_attn_idxs": [2, 5, 8, 10, 12]}, "full_attn_idxs"),
    ({**MINIMAX_TEXT_01_HF, "attn_type_list": [1] + MINIMAX_TYPES[1:]}, "attn_type_list"),
    ({**KIMI_LINEAR_48B, "layer_types": ["linear_attention"] * 27},
     "linear_attn_config.full_attn_layers"),
])
def test_missing_or_bad_size_fields_raise_naming_the_field(cfg, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        build(cfg)


def test_plain_families_are_an_explicit_list():
    cfg = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
           "num_key_value_heads": 2}
    for model_type in PLAIN_MODEL_TYPES:
        c = build({**cfg, "model_type": model_type})
        assert c.kv.layer_configs == (KVLayerConfig(2, 64),) * 2, model_type
    assert set(PLAIN_MODEL_TYPES) <= set(SUPPORTED_MODEL_TYPES)


def test_gemma2_alternates_sliding_and_full_layers():
    c = build({"model_type": "gemma2", "num_hidden_layers": 4, "head_dim": 128,
               "num_key_value_heads": 8, "sliding_window": 4096})
    assert [lc.sliding_window for lc in c.kv.layer_configs] == [4096, None, 4096, None]


def test_every_supported_model_type_is_in_the_readme_and_design_tables():
    for doc in ("README.md", "docs/design.md"):
        text = (ROOT / doc).read_text()
        missing = [t for t in SUPPORTED_MODEL_TYPES if f"`{t}`" not in text]
        assert not missing, f"{doc} does not list {missing}"


@pytest.mark.parametrize(("fields", "name"), [
    (dict(num_heads=0, head_dim=4, state_size=4, conv_dim=8, conv_kernel=4), "num_heads"),
    (dict(num_heads=2, head_dim=4, state_size=4, conv_dim=8, conv_kernel=0), "conv_kernel"),
    (dict(num_heads=0, head_dim=0, state_size=0, conv_dim=0, conv_kernel=0), "state_size"),
    (dict(num_heads=-1, head_dim=0, state_size=0, conv_dim=8, conv_kernel=4), "num_heads"),
])
def test_mamba_config_states_are_whole_or_absent(fields, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        MambaCacheConfig(2, 2, **fields)
    conv_only = MambaCacheConfig(2, 2, 0, 0, 0, 8, 4)
    assert (conv_only.has_recurrent_state, conv_only.has_conv_state) == (False, True)
    lightning = MambaCacheConfig(2, 2, 2, 4, 4, 0, 0)
    assert (lightning.has_recurrent_state, lightning.has_conv_state) == (True, False)
