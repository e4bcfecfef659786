"""``python -m hcache info --config``: the layout and the bytes of real configs, against sums
worked out by hand; a config hcache cannot lay out exits with status 2 and says why."""

from __future__ import annotations

import json

import pytest
from test_hf_families import GEMMA4_PER_LAYER, KIMI_LINEAR_48B, LFM2_1_2B, MINIMAX_M1

from hcache import HybridCacheConfig
from hcache.__main__ import main
from hcache.config import KVCacheConfig, KVLayerConfig, LayerType
from hcache.config.report import layout_bytes, layout_report


def run_info(tmp_path, capsys, cfg, *args):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code = main(["info", "--config", str(path), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_lfm2_bytes(tmp_path, capsys):
    code, out, _ = run_info(tmp_path, capsys, LFM2_1_2B, "--kv-dtype", "float16")
    assert code == 0
    # 6 attention layers x K and V x 8 heads x 64 x 2 bytes; 10 conv states of 2048 x 3 x 2.
    per_token, states = 6 * 2 * 8 * 64 * 2, 10 * 2048 * 3 * 2
    assert f"bytes per token     {per_token:,}" in out
    assert f"bytes per sequence  {states + 4096 * per_token:,} at 4,096 tokens" in out
    assert "  0-1       recurrent conv [2048, 3] float16" in out
    assert "  2         attention KV 8 x 64 float16" in out
    assert "layers      16: 10 MAMBA, 6 ATTENTION" in out


def test_minimax_and_kimi_bytes(tmp_path, capsys):
    code, out, _ = run_info(tmp_path, capsys, MINIMAX_M1, "--seq-len", "1000")
    assert code == 0
    per_token, states = 10 * 2 * 8 * 128 * 2, 70 * 64 * 128 * 128 * 4
    assert f"{states + 1000 * per_token:,} at 1,000 tokens = {states:,}" in out
    assert "recurrent state [64, 128, 128] float32" in out
    cfg = HybridCacheConfig.from_hf_config(KIMI_LINEAR_48B, max_batch_size=1,
                                           max_sequence_length=10, kv_dtype="bfloat16")
    # MLA: one latent of 576 per token per layer (no V); KDA: state + three short convs.
    assert layout_bytes(cfg) == {
        "per_token": 7 * 576 * 2, "rings": 0,
        "states": 20 * (32 * 128 * 128 * 4 + 3 * 32 * 128 * 4 * 2),
        "per_sequence": 20 * (32 * 128 * 128 * 4 + 3 * 32 * 128 * 4 * 2) + 10 * 7 * 576 * 2}
    _, out, _ = run_info(tmp_path, capsys, KIMI_LINEAR_48B)
    assert "attention latent 576 (MLA, one component) bfloat16" in out


def test_deepseek_v3_latent_bytes(tmp_path, capsys):
    # 61 MLA layers, each one latent of kv_lora_rank 512 + qk_rope_head_dim 64 per token (no V).
    code, out, _ = run_info(tmp_path, capsys, {"model_type": "deepseek_v3"},
                            "--kv-dtype", "bfloat16")
    assert code == 0
    assert f"bytes per token     {61 * 576 * 2:,}" in out


def test_shared_layers_cost_nothing(tmp_path, capsys):
    cfg = {**GEMMA4_PER_LAYER, "num_hidden_layers": 4, "num_kv_shared_layers": 2,
           "layer_types": ["sliding_attention", "full_attention"] * 2}
    # 512 tokens: no longer than Gemma 4's default window, so no layer is a ring buffer.
    code, out, _ = run_info(tmp_path, capsys, cfg, "--kv-dtype", "float32", "--seq-len", "512")
    assert code == 0
    # Layers 2 and 3 read layers 0 and 1's caches: only 0 (2 x 8) and 1 (2 x 16) own one.
    assert f"bytes per token     {2 * (2 * 8 + 2 * 16) * 4:,}" in out
    assert "reads layer 0's KV" in out and "reads layer 1's KV" in out


@pytest.mark.parametrize(("text", "reason"), [
    (json.dumps({"model_type": "an_invented_model"}), "model_type"),
    (json.dumps({"model_type": "llama", "num_hidden_layers": 2}), "num_key_value_heads"),
    ("{not json", "Expecting"),
])
def test_a_config_that_cannot_be_laid_out_exits_2(tmp_path, capsys, text, reason):
    path = tmp_path / "config.json"
    path.write_text(text)
    assert main(["info", "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert reason in err and out == ""
    assert main(["info", "--config", str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize(("option", "value"), [("--seq-len", "0"), ("--kv-dtype", "float9"),
                                               ("--ssm-dtype", "x"), ("--conv-dtype", "")])
def test_a_bad_option_is_named_on_one_line_and_exits_2(tmp_path, capsys, option, value):
    code, out, err = run_info(tmp_path, capsys, LFM2_1_2B, option, value)
    assert code == 2 and out == ""
    assert err.startswith(f"python -m hcache info: error: {option}: expected ")
    assert err.count("\n") == 1 and repr(value)[1:-1] in err


def test_ring_buffers_are_fixed_bytes(tmp_path, capsys):
    # Gemma 4 (default window 512): layer 0 slides, so at 4096 tokens it is a ring of 512;
    # layer 1 (2 heads x 16) is unbounded. float32.
    ring, row = 2 * 2 * 8 * 4 * 512, 2 * 2 * 16 * 4
    code, out, _ = run_info(tmp_path, capsys, GEMMA4_PER_LAYER, "--kv-dtype", "float32")
    assert code == 0
    assert f"bytes per token     {row:,} (KV of 1 cache-owning attention layers with " in out
    assert f"ring buffers        {ring:,} (KV of 1 sliding-window layers" in out
    assert f"bytes per sequence  {ring + 4096 * row:,} at 4,096 tokens = 0 " in out
    assert "  0         attention KV 2 x 8, window 512 (ring buffer) float32" in out
    # Unbounded on request: every layer grows with the length, as without windows.
    code, out, _ = run_info(tmp_path, capsys, GEMMA4_PER_LAYER, "--kv-dtype", "float32",
                            "--no-ring-windows")
    assert code == 0 and "ring buffers" not in out and "(ring buffer)" not in out
    assert f"bytes per token     {row + 2 * 2 * 8 * 4:,}" in out


def test_latent_ring_layer_bytes():
    # A latent (MLA, one component) layer with a window is a ring like any other: its bytes
    # are one latent of 576 per entry of its 128-entry ring, fixed; the other layer grows.
    kv = KVCacheConfig(1, 1024, (KVLayerConfig(1, 576, 128, components=1),
                                 KVLayerConfig(1, 576, None, components=1)), "bfloat16", True)
    cfg = HybridCacheConfig((LayerType.ATTENTION,) * 2, kv, None, 1)
    assert kv.layer_ring_windows == (128, 0) and kv.layer_cache_lengths == (128, 1024)
    assert layout_bytes(cfg) == {"per_token": 576 * 2, "rings": 128 * 576 * 2, "states": 0,
                                 "per_sequence": 128 * 576 * 2 + 1024 * 576 * 2}
    assert "  0         attention latent 576 (MLA, one component), window 128 (ring buffer) " \
           "bfloat16" in layout_report(cfg)


def test_no_ring_windows_takes_no_value_and_bad_options_are_still_named(tmp_path, capsys):
    code, out, err = run_info(tmp_path, capsys, GEMMA4_PER_LAYER, "--no-ring-windows",
                              "--seq-len", "0")
    assert code == 2 and out == ""
    assert err == "python -m hcache info: error: --seq-len: expected an int >= 1, got 0\n"
    with pytest.raises(SystemExit) as exit_:    # argparse's own usage error
        run_info(tmp_path, capsys, GEMMA4_PER_LAYER, "--no-ring-windows=1")
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and "--no-ring-windows" in err
