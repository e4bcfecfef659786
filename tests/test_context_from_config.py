"""DynamicInferenceContext built from a model's layout (issue 25, item 2): ``from_config`` and
``from_hf_config`` give the context the explicit constructor builds from the same numbers (the
oracle: the layout's fields, read by hand), the step's scratch states are reachable on the
context, and every public attribute of the prefix-caching classes has a docstring of its own.
"""

from __future__ import annotations

import inspect
from operator import attrgetter

import numpy as np
import pytest

import hcache
from hcache import HybridCacheConfig, KVLayerConfig
from hcache.contexts import DynamicInferenceContext

NEMOTRON_H = {"model_type": "nemotron_h", "hybrid_override_pattern": "M*M-*M",
              "num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 4,
              "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 1, "conv_kernel": 4}
LLAMA = {"model_type": "llama", "num_hidden_layers": 3, "hidden_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2}
LFM2 = {"model_type": "lfm2", "num_hidden_layers": 4, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "conv_L_cache": 3,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"]}


def layout(ctx):
    """What a context allocated: pool layers, live and cached states, sizes."""
    def shape(a):
        return None if a is None else (tuple(a.shape), str(a.dtype))
    alloc = ctx.mamba_slot_allocator
    return {"pool": [shape(layer) for layer in ctx.kv_pool.layers],
            "live": (shape(ctx.mamba_conv_states), shape(ctx.mamba_ssm_states)),
            "cached": None if alloc is None else (shape(alloc.conv_states),
                                                  shape(alloc.ssm_states)),
            "sizes": (ctx.kv_block_allocator.num_blocks, ctx.block_size_tokens,
                      ctx.max_requests, ctx.max_blocks_per_request, ctx.max_sequence_length)}


def test_from_hf_config_is_the_explicit_context_of_its_layout():
    ctx = DynamicInferenceContext.from_hf_config(NEMOTRON_H, max_requests=3,
                                                 max_sequence_length=30, block_size_tokens=4,
                                                 kv_dtype="bfloat16", device="cpu")
    # by hand: layers M * M - * M -> attention at 1 and 4 (2 KV heads of 16), Mamba at 0, 2, 5
    # (4 heads x 8 x state 8; conv dim = 4 * 8 + 2 * 1 * 8 = 48, kernel 4); 30 tokens -> 8 blocks
    explicit = DynamicInferenceContext(
        kv_layer_configs=[KVLayerConfig(2, 16)] * 2, num_blocks=3 * 8, block_size_tokens=4,
        max_requests=3, max_blocks_per_request=8, num_mamba_layers=3,
        conv_states_shape=(48, 4), ssm_states_shape=(4, 8, 8), kv_dtype="bfloat16",
        conv_states_dtype="bfloat16", ssm_states_dtype="float32", mamba_cache_slots=3,
        device="cpu")
    assert layout(ctx) == layout(explicit)
    assert ctx.max_sequence_length == 32 and ctx.block_size == 4


def test_from_config_takes_overrides_and_the_constructor_options():
    config = HybridCacheConfig.from_hf_config(NEMOTRON_H, max_batch_size=2,
                                              max_sequence_length=16)
    ctx = DynamicInferenceContext.from_config(config, block_size_tokens=8, num_blocks=5,
                                              max_requests=4, mamba_cache_slots=7,
                                              eviction_policy="ref_zero", device="cpu")
    assert (ctx.kv_block_allocator.num_blocks, ctx.max_requests, ctx.max_blocks_per_request) \
        == (5, 4, 2)
    assert ctx.mamba_slot_allocator.max_slots == 7
    assert ctx.kv_block_allocator.eviction_policy == "ref_zero"
    assert ctx.mamba_conv_states.dtype == np.float16   # conv_dtype None: kv_dtype


def test_attention_only_and_conv_only_layouts():
    llama = DynamicInferenceContext.from_hf_config(LLAMA, max_requests=2, max_sequence_length=8,
                                                   device="cpu")
    assert llama.mamba_slot_allocator is None and llama.num_mamba_layers == 0
    assert llama.intermediate_ssm_out is None and llama.intermediate_conv_out is None
    assert [tuple(x.shape[1:]) for x in llama.kv_pool.layers] == [(2, 2, 16, 16)] * 3
    lfm2 = DynamicInferenceContext.from_hf_config(LFM2, max_requests=2, max_sequence_length=8,
                                                  block_size_tokens=4, device="cpu")
    assert lfm2.mamba_ssm_states is None and lfm2.intermediate_ssm_out is None
    assert lfm2.mamba_conv_states.shape == (2, 2, 64, 3)
    assert lfm2.intermediate_conv_out is lfm2.mamba_slot_allocator.intermediate_conv_out


def test_scratch_states_on_the_context_are_the_allocators():
    ctx = DynamicInferenceContext.from_hf_config(NEMOTRON_H, max_requests=2,
                                                 max_sequence_length=16, block_size_tokens=4,
                                                 device="cpu")
    alloc = ctx.mamba_slot_allocator
    assert ctx.intermediate_ssm_out is alloc.intermediate_ssm_out
    assert ctx.intermediate_conv_out is alloc.intermediate_conv_out
    plan = ctx.add_request("a", np.arange(9))
    (_, offset, scratch), *_ = ctx.snapshot_targets()
    ctx.intermediate_ssm_out[:, scratch] = 5.0       # the state after `offset` tokens
    ctx.intermediate_conv_out[:, scratch] = 2.0
    ctx.commit_step()
    slot = alloc.get_slot(plan.block_ids[offset // 4 - 1])
    assert (alloc.ssm_states[:, slot] == 5.0).all() and (alloc.conv_states[:, slot] == 2).all()


@pytest.mark.parametrize("bad, error", [(NEMOTRON_H, TypeError), (None, TypeError)])
def test_from_config_refuses_what_is_not_a_config(bad, error):
    with pytest.raises(error, match="config: expected HybridCacheConfig"):
        DynamicInferenceContext.from_config(bad, device="cpu")


def test_from_config_refuses_a_bad_block_size():
    config = HybridCacheConfig.from_hf_config(LLAMA, max_batch_size=1, max_sequence_length=8)
    with pytest.raises(ValueError, match="block_size_tokens"):
        DynamicInferenceContext.from_config(config, block_size_tokens=0, device="cpu")


ATTRGETTER_DOC = attrgetter("x").__doc__ or ""


@pytest.mark.parametrize("name", [n for n in hcache.__all__
                                  if inspect.isclass(getattr(hcache, n))])
def test_every_public_property_has_its_own_docstring(name):
    cls = getattr(hcache, name)
    missing = []
    for attr, value in inspect.getmembers(cls):
        if attr.startswith("_") or not isinstance(value, property):
            continue
        doc = (value.__doc__ or "").strip()
        if not doc or doc == ATTRGETTER_DOC.strip() or doc.startswith("attrgetter("):
            missing.append(attr)
    assert not missing, f"{name}: properties without a docstring: {missing}"
