"""``python -m hcache demo``: it runs clean, and its exactness check can fail.

The demo compares every generated token (and its logits, bit for bit) with an uncached
reference run. The corruption tests break one cache operation at a time (a hybrid-manager
``write_kv``, a restore, the KV moves of a compaction, a continuous-batching K/V write, state
write or claim, a prefix-cache restore) and require the
demo to report the mismatch in the right part and return 1.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hcache.ops
from hcache.config.caches import HybridCacheConfig
from hcache.contexts.mamba_slot_allocator import MambaSlotAllocator
from hcache.continuous.hybrid_collection import ContinuousBatchingHybridCollection
from hcache.continuous.hybrid_store import HybridBlockStore
from hcache.demo import run as demo
from hcache.demo.model import PlainCache, TinyHybridModel, reference_logits
from hcache.slots.hybrid import HybridCacheManager

import helpers

DEVICES = helpers.DEVICES


@pytest.mark.parametrize("device", DEVICES)
def test_demo_runs_clean(device, capsys):
    assert demo.run_demo(device=device) == 0
    out = capsys.readouterr().out
    for part in ("Part 1 - HybridCacheManager", "Part 2 - ContinuousBatchingHybridCacheManager",
                 "Part 3 - DynamicInferenceContext"):
        assert part in out
    assert "compact_batch([0, -1, 2, 1], 4, 3)" in out        # a non-monotone compaction
    assert "MISMATCH" not in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("demo: all ") and "match the uncached reference run" in last
    assert int(last.split()[2]) > 50


def test_main_entry_point(capsys):
    from hcache.__main__ import main

    assert main(["demo", "--device", "cpu"]) == 0
    assert "generated tokens match" in capsys.readouterr().out


def _drop_layer1_write(original):
    def write(self, layer, key, value, **kw):
        if layer != 1:
            original(self, layer, key, value, **kw)
    return write


def _drop_layer0_states(original):
    def write_states(self, layer, recurrent=None, conv=None, **kw):
        if layer != 0:
            original(self, layer, recurrent, conv, **kw)
    return write_states


def _drop_first_attention_write(original):
    def write_kv(self, layer, k, v, **kw):
        first = next(i for i in range(self.num_layers) if self.get_layer_type(i).has_attention)
        if layer != first:
            original(self, layer, k, v, **kw)
    return write_kv


CORRUPTIONS = [
    # the hybrid manager's write_kv (how the demo writes K/V) loses the first attention layer
    pytest.param("part 1", lambda mp: mp.setattr(
        HybridCacheManager, "write_kv",
        _drop_first_attention_write(HybridCacheManager.write_kv)), id="hybrid-write"),
    # slots 1..3 start from stale/zero Mamba states instead of the system prompt's
    pytest.param("part 1", lambda mp: mp.setattr(HybridCacheManager, "restore_mamba_states",
                                                 lambda self, *a, **k: None), id="restore"),
    # compaction moves states and lengths but not the K/V of a moved slot
    pytest.param("part 1", lambda mp: mp.setattr(hcache.ops, "kv_compact", lambda *a, **k: None),
                 id="compaction"),
    # continuous batching loses every write of decoder layer 1 (the first attention layer)
    pytest.param("part 2", lambda mp: mp.setattr(
        ContinuousBatchingHybridCollection, "write_kv",
        _drop_layer1_write(ContinuousBatchingHybridCollection.write_kv)), id="cb-write"),
    # continuous batching keeps the Mamba states of decoder layer 0 at their claimed zeros
    pytest.param("part 2", lambda mp: mp.setattr(
        ContinuousBatchingHybridCollection, "write_states",
        _drop_layer0_states(ContinuousBatchingHybridCollection.write_states)), id="cb-states"),
    # a claim hands out a released block's state slots without zeroing them
    pytest.param("part 2", lambda mp: mp.setattr(HybridBlockStore, "clear_states",
                                                 lambda self, *a, **k: None), id="cb-claim"),
    # prefix caching claims a restore but leaves the live Mamba slot as it was
    pytest.param("part 3", lambda mp: mp.setattr(MambaSlotAllocator, "restore_to_live",
                                                 lambda self, *a, **k: True), id="prefix"),
]


@pytest.mark.parametrize(("part", "corrupt"), CORRUPTIONS)
def test_a_corrupted_cache_is_detected(part, corrupt, monkeypatch, capsys):
    corrupt(monkeypatch)
    assert demo.run_demo(device="cpu") == 1
    out = capsys.readouterr().out
    assert f"MISMATCH {part} " in out
    assert out.strip().splitlines()[-1].startswith("demo: FAILED")
    if part == "part 3":      # the run without prefix caching never restores: still exact
        assert "MISMATCH part 3 (no prefix caching)" not in out


@settings(max_examples=30)
@given(st.lists(st.booleans(), min_size=1, max_size=8))
def test_fill_holes_is_a_valid_compaction(done):
    mapping = demo._fill_holes(done)
    new = done.count(False)
    kept = [j for j in mapping if j >= 0]
    assert sorted(kept) == list(range(new))                      # injective onto [0, new)
    assert all((j == -1) == d for j, d in zip(mapping, done, strict=True))
    assert all(j == i for i, j in enumerate(mapping) if 0 <= i < new and j >= 0)   # no churn


def _model():
    config = HybridCacheConfig.from_hf_config(demo.NEMOTRON_H_CONFIG, max_batch_size=2,
                                              max_sequence_length=32, kv_dtype="float32")
    return TinyHybridModel(config, seed=0)


def test_model_is_batch_invariant_and_context_sensitive():
    model = _model()
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 64, 9).tolist(), rng.integers(0, 64, 4).tolist()
    ref_a, ref_b = reference_logits(model, a), reference_logits(model, b)
    # token by token through one PlainCache equals the whole sequence at once
    cache = PlainCache(model)
    steps = [model.forward([[t]], [i], cache)[0][0] for i, t in enumerate(a)]
    assert np.stack(steps).tobytes() == ref_a.tobytes()
    # the context matters: the last token's logits change with an earlier token
    changed = reference_logits(model, [(a[0] + 1) % 64] + a[1:])
    assert changed[-1].tobytes() != ref_a[-1].tobytes()
    assert len(set(np.argmax(ref_a, -1).tolist())) > 1
    assert ref_b.dtype == np.float32 and ref_b.shape == (4, 64)
