"""One name per idea (issue 25, item 5): where two names meant one thing, the seed's name (or
the sibling's) stays and the other is an alias that returns the very same thing and says so in
its docstring."""

from __future__ import annotations

import numpy as np
import pytest

import hcache
from hcache.contexts import DynamicInferenceContext, PagedKVPool

LIN = hcache.LinearCacheConfig(1, 2, 8, 1, 8, num_mamba_layers=2, mamba_num_heads=1,
                               mamba_head_dim=2, ssm_state_size=3, conv_dim=4, conv_kernel=2)


def _same(a, b):
    if isinstance(a, np.ndarray):
        return np.shares_memory(a, b) and a.shape == b.shape
    return a == b


def _doc(owner, name):
    return " ".join((getattr(type(owner), name).__doc__ or "").split())


@pytest.mark.parametrize("owner, alias, canonical, args", [
    (lambda: hcache.LinearKVCache(LIN, device="cpu"), "get_recurrent_state",
     "get_ssm_state_for_layer", (1,)),
    (lambda: hcache.LinearKVCache(LIN, device="cpu"), "get_conv_state",
     "get_conv_state_for_layer", (1,)),
    (lambda: hcache.KVCacheStaticParams(2, 8), "head_dim", "head_size", None),
    (lambda: hcache.ContinuousBatchingKVCacheManager(
        "float16", hcache.KVCacheStaticParams(1, 8), 2, 16, 1, device="cpu"),
     "max_sequence_length", "max_seq_len", None),
    (lambda: PagedKVPool([hcache.KVLayerConfig(1, 8)], 4, 16, device="cpu"),
     "block_size_tokens", "block_size", None),
    (lambda: DynamicInferenceContext(kv_layer_configs=[hcache.KVLayerConfig(1, 8)],
                                     num_blocks=4, block_size_tokens=8, max_requests=1,
                                     max_blocks_per_request=2, device="cpu"),
     "block_size", "block_size_tokens", None),
])
def test_an_alias_is_the_same_thing_and_says_so(owner, alias, canonical, args):
    obj = owner()
    a, c = getattr(obj, alias), getattr(obj, canonical)
    if args is not None:
        a, c = a(*args), c(*args)
    assert _same(a, c)
    assert "alias" in _doc(obj, alias).lower() and canonical in _doc(obj, alias)


def test_continuous_batch_lengths_under_both_names_and_write_under_write_kv():
    m = hcache.ContinuousBatchingKVCacheManager(
        "float16", hcache.KVCacheStaticParams(1, 8), 2, 16, 1, device="cpu")
    ids = m.claim(2)
    batch = m.fetch(ids)
    rows = np.ones((2, 3, 1, 8), np.float16)
    batch.write_kv(0, rows, rows)
    m.step([3, 3], batch)
    batch = m.fetch(ids)
    assert batch.host_cache_lengths == tuple(batch.cache_lengths_host.tolist()) == (3, 3)
    assert "cache_lengths_host" in _doc(batch, "host_cache_lengths")
    assert "write_kv" in (type(batch).write.__doc__ or "")
