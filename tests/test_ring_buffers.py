"""Ring buffers for sliding-window layers in the contiguous-slot managers (docs/design.md §4.10).

The oracle is the same model on unbounded caches (``ring_windows=False``): a tiny NumPy model
whose sliding layers attend to the last ``W`` tokens runs a step loop (ragged prefill longer than
the window, decode to four windows past it, an eviction with a non-monotone compaction, a prompt
cache captured and restored from a wrapped ring) on both layouts, on the ``cpu`` device and on
the emulated kernels. Every generated token must be equal, every logit bit for bit, and after
every step every ring must equal the unbounded cache restricted to the window (positions
``length - min(length, W) ..`` at entries ``p mod W``).
"""

from __future__ import annotations

import numpy as np
import pytest

from hcache import HybridCacheConfig, HybridCacheManager, KVCacheConfig, KVLayerConfig, ops
from hcache.config.caches import LayerType, MambaCacheConfig
from hcache.dtypes import resolve_dtype

from helpers import DEVICES, host

W = 5
S = 48
VOCAB, HIDDEN = 13, 8
# (heads, head_dim, window): two head dims, ring and unbounded layers in each group
LAYERS = [(2, 4, W), (1, 4, None), (3, 8, W), (2, 8, 3), (1, 8, None)]


def _config(rings: bool, max_batch=4) -> HybridCacheConfig:
    kinds = [LayerType.ATTENTION] * 3 + [LayerType.MAMBA] + [LayerType.ATTENTION] * 2
    kv = KVCacheConfig(max_batch, S, [KVLayerConfig(h, d, w) for h, d, w in LAYERS], "float32",
                       ring_windows=rings)
    mamba = MambaCacheConfig(1, max_batch, 1, 2, 2, 2, 2, "float32", "float32")
    return HybridCacheConfig(kinds, kv, mamba, max_batch)


def _on(device, a):
    """Host rows ``a`` as an array of ``device``'s module (C-contiguous)."""
    a = np.ascontiguousarray(a)
    if device == "cpu":
        return a
    from hcache import _cuda

    return _cuda.runtime().xp.asarray(a)


class TinyModel:
    """Per attention layer: K, V, Q projections of the hidden state; layer ``a`` attends to
    the last ``window`` tokens (or all) of its cache, read in position order."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.embed = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
        self.out = rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32)
        self.proj = [tuple(rng.standard_normal((HIDDEN, h * d)).astype(np.float32) * 0.5
                           for _ in range(3)) + (rng.standard_normal((h * d, HIDDEN))
                                                 .astype(np.float32) * 0.5,)
                     for h, d, _ in LAYERS]

    def kv(self, a, hidden):
        h, d, _ = LAYERS[a]
        wk, wv, _, _ = self.proj[a]
        n = hidden.shape[0]
        return (hidden @ wk).reshape(n, h, d), (hidden @ wv).reshape(n, h, d)

    def attend(self, a, hidden, keys, values):
        """One query row against ``keys`` / ``values`` ``[H, T, D]`` in position order."""
        h, d, _ = LAYERS[a]
        _, _, wq, wo = self.proj[a]
        q = (hidden @ wq).reshape(h, 1, d)
        scores = (q @ keys.transpose(0, 2, 1)) / np.float32(np.sqrt(d))
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        return hidden + (scores @ values).reshape(1, h * d) @ wo


def _ordered(manager, a, layer, slot, length):
    """Layer ``a``'s cached K and V of ``slot`` that its window sees, in position order: an
    unbounded cache is sliced by position, a ring is unrolled from :meth:`ring_start`."""
    cache = host(manager.get_combined_kv_cache(layer))
    window = LAYERS[a][2] or S
    m = min(length, window)
    ring = manager.get_ring_window(layer)
    if ring:
        start = manager.ring_start(layer, length)
        entries = (start + np.arange(m)) % ring
        assert cache.shape[3] == ring
    else:
        entries = np.arange(length - m, length)
    return cache[slot, 0][:, entries], cache[slot, 1][:, entries]


class Engine:
    """Drives one manager: prefill (one ragged write per layer), decode, eviction."""

    ATTN = [0, 1, 2, 4, 5]   # decoder layers of the attention layers

    def __init__(self, rings, model, device="cpu"):
        self.m = HybridCacheManager(_config(rings), device=device)
        self.device = device
        self.model = model

    def forward(self, tokens_per_row, lengths):
        """Run every row's new tokens through the model. Per layer: attend over the cached
        window (read in position order, before this step's write, which may wrap a ring over
        it) and the step's own K/V, then write the step's K/V (one ragged write). Returns the
        last token's logits per row and commits the new lengths."""
        m = self.m
        counts = [len(t) for t in tokens_per_row]
        hidden = self.model.embed[np.concatenate(tokens_per_row)]
        for a, layer in enumerate(self.ATTN):
            k, v = self.model.kv(a, hidden)
            window = LAYERS[a][2] or S
            new = np.empty_like(hidden)
            t = 0
            for row, n in enumerate(counts):
                ck, cv = _ordered(m, a, layer, row, lengths[row])
                keys = np.concatenate([ck, k[t:t + n].transpose(1, 0, 2)], axis=1)
                values = np.concatenate([cv, v[t:t + n].transpose(1, 0, 2)], axis=1)
                c = ck.shape[1]
                for i in range(n):
                    lo = max(0, c + i + 1 - window)
                    hi = c + i + 1
                    new[t + i] = self.model.attend(a, hidden[t + i:t + i + 1],
                                                   keys[:, lo:hi], values[:, lo:hi])[0]
                t += n
            m.write_kv(layer, _on(self.device, k), _on(self.device, v),
                       seq_lengths=counts)
            hidden = new
        last = np.cumsum(counts) - 1
        m.commit_sequence_length(np.asarray(counts, np.int32))
        return hidden[last] @ self.model.out


def _check_rings_equal_window(ring_m, flat_m, lengths):
    """Every ring equals the unbounded cache restricted to its window."""
    for a, layer in enumerate(Engine.ATTN):
        for slot, length in enumerate(lengths):
            got = _ordered(ring_m, a, layer, slot, length)
            want = _ordered(flat_m, a, layer, slot, length)
            w = ring_m.get_ring_window(layer)
            if w:   # the whole window the ring holds, not only what the model reads
                cache = host(ring_m.get_combined_kv_cache(layer))[slot]
                flat = host(flat_m.get_combined_kv_cache(layer))[slot]
                for p in range(max(0, length - w), length):
                    assert np.array_equal(cache[:, :, p % w], flat[:, :, p])
            for g, e in zip(got, want):
                assert np.array_equal(g, e)


def _run_loop(device="cpu"):
    model = TinyModel()
    ring, flat = Engine(True, model, device), Engine(False, model, device)
    assert ring.m.memory_report()["kv_cache"] < flat.m.memory_report()["kv_cache"]
    assert ring.m.memory_report()["kv_cache_unbounded"] == flat.m.memory_report()["kv_cache"]
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, VOCAB, n)) for n in (3, 2 * W + 1, W, W + 2)]
    for e in (ring, flat):
        e.m.reset_for_new_sequences([0] * 4)
    lengths = [0] * 4
    outs = [e.forward(prompts, lengths) for e in (ring, flat)]
    assert np.array_equal(outs[0], outs[1])
    lengths = [len(p) for p in prompts]
    _check_rings_equal_window(ring.m, flat.m, lengths)
    generated = [[], []]
    for step in range(4 * W + 3):
        if step == W:   # evict row 1, non-monotone compaction of the rest: 0->2, 2->0, 3->1
            for e in (ring, flat):
                e.m.compact_batch(np.asarray([2, -1, 0, 1], np.int32), 4, 3)
            lengths = [lengths[2], lengths[3], lengths[0]]
            outs = [o[[2, 3, 0]] for o in outs]
            generated = [[g[i] for i in (2, 3, 0)] if g and isinstance(g[0], list) else g
                         for g in generated]
            _check_rings_equal_window(ring.m, flat.m, lengths)
        nxt = [list(np.argmax(o, axis=-1)) for o in outs]
        assert nxt[0] == nxt[1]
        generated[0].append(nxt[0])
        outs = [e.forward([[t] for t in nxt[0]], lengths) for e in (ring, flat)]
        assert np.array_equal(outs[0], outs[1])   # every logit, bit for bit
        lengths = [n + 1 for n in lengths]
        _check_rings_equal_window(ring.m, flat.m, lengths)
    assert min(lengths) >= 4 * W   # decoded four windows past the window
    # a prompt cache of a wrapped ring: the last min(n, W) positions, in order
    slot, n = 0, lengths[0]
    saved_ring = ring.m.capture_kv_cache(slot, n)
    saved_flat = flat.m.capture_kv_cache(slot, n)
    for a, layer in enumerate(Engine.ATTN):
        w = ring.m.get_ring_window(layer)
        want = host(saved_flat[a])[:, :, n - w:] if w else host(saved_flat[a])
        assert np.array_equal(host(saved_ring[a]), want)
    with pytest.raises(ValueError, match=r"sequence_length: expected \d+ \(slot 0's length"):
        ring.m.capture_kv_cache(slot, n - 1)
    for e, saved in ((ring, saved_ring), (flat, saved_flat)):
        e.m.restore_kv_cache(saved, 2)
        e.m.reset_for_new_sequences([lengths[0], lengths[1], lengths[0]])
    lengths = [lengths[0], lengths[1], lengths[0]]
    _check_rings_equal_window(ring.m, flat.m, lengths)
    nxt = [int(t) for t in np.argmax(outs[0], axis=-1)]
    nxt[2] = nxt[0]   # the restored copy of slot 0 gets slot 0's next token
    outs = [e.forward([[t] for t in nxt], lengths) for e in (ring, flat)]
    assert np.array_equal(outs[0], outs[1])
    assert np.array_equal(outs[0][0], outs[0][2])   # the restored slot continues as slot 0


@pytest.mark.parametrize("device", DEVICES)
def test_step_loop_on_rings_matches_unbounded_cache(device):
    """cpu device (the NumPy reference), a GPU, and the asynchronous emulated device (the CUDA
    path: staged tables, queued launches)."""
    _run_loop(device)


@pytest.mark.emu
def test_step_loop_on_rings_matches_unbounded_cache_emulated():
    """The same loop on the real kernels compiled for the host; launches are counted, so the
    loop cannot pass on the reference."""
    emu = pytest.importorskip("emu")
    if not emu.have_compiler():
        pytest.skip("no host C++ compiler")
    launcher = emu.EmuLauncher()
    with ops.host_backend(launcher):
        _run_loop()
    names = {name for name, _, _ in launcher.launches}
    assert {"hc_kv_write", "hc_kv_compact", "hc_kv_capture"} <= names


def test_ring_config_lengths_and_views():
    """Per-layer cache lengths and windows: a window at or past max_sequence_length stays
    unbounded; views are [B, 2, H, W, D]; ring_start by hand."""
    kv = KVCacheConfig(2, 10, [KVLayerConfig(1, 4, 3), KVLayerConfig(1, 4, 10),
                               KVLayerConfig(1, 4, None)], ring_windows=True)
    assert kv.layer_ring_windows == (3, 0, 0) and kv.layer_cache_lengths == (3, 10, 10)
    off = KVCacheConfig(2, 10, kv.layer_configs)
    assert off.layer_ring_windows == (0, 0, 0) and off.layer_cache_lengths == (10, 10, 10)
    with pytest.raises(TypeError, match="ring_windows: expected a bool, got int"):
        KVCacheConfig(2, 10, kv.layer_configs, ring_windows=1)
    from hcache import KVCacheManager

    m = KVCacheManager(kv, device="cpu")
    assert m.get_combined_kv_cache(0).shape == (2, 2, 1, 3, 4)
    assert m.get_separate_kv_cache(0)[0].shape == (2, 1, 3, 4)
    assert [m.ring_start(0, n) for n in (0, 2, 3, 4, 7, 9)] == [0, 0, 0, 1, 1, 0]
    assert m.ring_start(1, 9) == 0
    assert list(m.ring_start(0, np.array([2, 4, 8], np.int32))) == [0, 1, 2]
    report = m.memory_report()
    assert report["kv_cache"] == 2 * 2 * 4 * 2 * (3 + 10 + 10)   # float16
    assert report["kv_cache_unbounded"] == 2 * 2 * 4 * 2 * 30


def test_host_positions_must_hit_distinct_ring_entries():
    """Explicit positions that would land on one ring entry are refused before anything is
    written; the same positions outside the last W tokens of their row are fine."""
    from hcache import KVCacheManager

    kv = KVCacheConfig(1, 16, [KVLayerConfig(1, 4, 3)], "float32", ring_windows=True)
    m = KVCacheManager(kv, device="cpu")
    k = np.ones((1, 3, 1, 4), np.float32)
    with pytest.raises(ValueError, match="positions: expected positions distinct modulo 3"):
        m.write_kv(0, k, k, positions=[[0, 3, 1]])
    assert not np.asarray(m.get_combined_kv_cache(0)).any()
    k4 = np.arange(16, dtype=np.float32).reshape(1, 4, 1, 4)
    m.write_kv(0, k4, k4, positions=[[0, 4, 5, 6]])   # position 0 is overwritten anyway
    cache = m.get_combined_kv_cache(0)
    assert [int(cache[0, 0, 0, p % 3, 0]) for p in (4, 5, 6)] == [4, 8, 12]


# --- from_hf_config: windowed layouts and the memory they save ----------------------------------

GEMMA3_27B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 62,
                              "num_attention_heads": 32, "num_key_value_heads": 16,
                              "head_dim": 128, "sliding_window": 1024,
                              "sliding_window_pattern": 6}}


def _kv_bytes(kv: KVCacheConfig) -> int:
    """Bytes a manager allocates for the KV caches of ``kv``, from its per-layer lengths."""
    item = resolve_dtype(kv.dtype).itemsize
    return sum(kv.max_batch_size * 2 * lc.num_kv_heads * length * lc.head_dim * item
               for lc, length in zip(kv.layer_configs, kv.layer_cache_lengths))


def test_gemma3_at_128k_allocates_under_a_quarter():
    """Gemma 3 27B at 128k context: 52 of 62 layers become 1024-token rings, ~16.8 % of the
    unbounded bytes (<= 25 %, as ``nbytes`` reports them: what the manager allocates, metadata
    included); ring_windows=False keeps the unbounded layout."""
    ring = HybridCacheConfig.from_hf_config(GEMMA3_27B, max_batch_size=1,
                                            max_sequence_length=131072, kv_dtype="bfloat16")
    flat = HybridCacheConfig.from_hf_config(GEMMA3_27B, max_batch_size=1,
                                            max_sequence_length=131072, kv_dtype="bfloat16",
                                            ring_windows=False)
    assert ring.kv.layer_ring_windows.count(1024) == 52
    assert ring.kv.layer_ring_windows.count(0) == 10
    assert flat.kv.layer_cache_lengths == (131072,) * 62
    per_token_layer = 2 * 16 * 128 * 2
    assert _kv_bytes(ring.kv) == per_token_layer * (52 * 1024 + 10 * 131072)
    assert _kv_bytes(ring.kv) <= 0.25 * _kv_bytes(flat.kv)
    # nbytes: the manager's whole allocation; only the ring layers' caches differ
    assert ring.nbytes <= 0.25 * flat.nbytes
    assert flat.nbytes - ring.nbytes == per_token_layer * 52 * (131072 - 1024)
    assert ring.kv.nbytes - _kv_bytes(ring.kv) == flat.kv.nbytes - _kv_bytes(flat.kv) > 0
    with pytest.raises(TypeError, match="ring_windows: expected a bool, got str"):
        HybridCacheConfig.from_hf_config(GEMMA3_27B, max_batch_size=1,
                                         max_sequence_length=128, ring_windows="yes")


def test_gemma3_manager_memory_report_shows_the_saving():
    """An allocated Gemma 3-shaped manager (few layers, 4k context): memory_report's kv_cache
    against kv_cache_unbounded and an unbounded manager's kv_cache."""
    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 256,
           "sliding_window_pattern": 6}
    ring_config = HybridCacheConfig.from_hf_config(cfg, max_batch_size=2,
                                                   max_sequence_length=4096)
    ring = HybridCacheManager(ring_config, device="cpu").memory_report()
    assert ring["total"] == ring_config.nbytes
    flat = HybridCacheManager(HybridCacheConfig.from_hf_config(
        cfg, max_batch_size=2, max_sequence_length=4096, ring_windows=False),
        device="cpu").memory_report()
    layer = 2 * 2 * 1 * 32 * 2   # bytes per token of one layer, both slots
    assert ring["kv_cache"] == layer * (5 * 256 + 4096)
    assert ring["kv_cache_unbounded"] == flat["kv_cache"] == layer * 6 * 4096
    assert ring["layers"][:5] == (layer * 256,) * 5 and ring["layers"][5] == layer * 4096


@pytest.mark.parametrize("cfg,windows", [
    # Gemma 2 without layer_types: even layers slide (the transformers default)
    ({"model_type": "gemma2", "num_hidden_layers": 4, "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 64}, (64, 0, 64, 0)),
    # gpt-oss: layer_types as its config.json states them, and without them
    ({"model_type": "gpt_oss", "num_hidden_layers": 4, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 128,
      "layer_types": ["sliding_attention", "full_attention"] * 2}, (128, 0, 128, 0)),
    ({"model_type": "gpt_oss", "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 128}, (128, 0)),
    # Mistral: every layer slides
    ({"model_type": "mistral", "num_hidden_layers": 3, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 96}, (96, 96, 96)),
    # Qwen2 with use_sliding_window: layers from max_window_layers on; off: none
    ({"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 32,
      "use_sliding_window": True, "max_window_layers": 2}, (0, 0, 32, 32)),
    ({"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 32,
      "use_sliding_window": False, "max_window_layers": 0}, (0, 0)),
    # Gemma 3 and Gemma 4 (the last layer is full; a window past the context stays unbounded)
    ({"model_type": "gemma3_text", "num_hidden_layers": 7, "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 16,
      "sliding_window_pattern": 6}, (16, 16, 16, 16, 16, 0, 16)),
    ({"model_type": "gemma4_text", "num_hidden_layers": 3, "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 8, "global_head_dim": 16, "sliding_window": 512,
      "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}, (0, 0, 0)),
    ({"model_type": "gemma4_text", "num_hidden_layers": 3, "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 8, "global_head_dim": 16, "sliding_window": 32,
      "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
     (32, 32, 0)),
    # a hybrid with local attention layers (Jamba's attention layers record the window)
    ({"model_type": "jamba", "num_hidden_layers": 4, "attn_layer_period": 2,
      "attn_layer_offset": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
      "hidden_size": 32, "sliding_window": 48, "mamba_expand": 2, "mamba_d_state": 4,
      "mamba_d_conv": 4}, (48, 48)),
])
def test_from_hf_config_windows(cfg, windows):
    """Every family with windows gets its ring layers (contexts of 256 tokens)."""
    hc = HybridCacheConfig.from_hf_config(cfg, max_batch_size=1, max_sequence_length=256)
    assert hc.kv.ring_windows is True
    assert hc.kv.layer_ring_windows == windows
    assert hc.kv.layer_cache_lengths == tuple(w or 256 for w in windows)
    off = HybridCacheConfig.from_hf_config(cfg, max_batch_size=1, max_sequence_length=256,
                                           ring_windows=False)
    assert off.kv.layer_ring_windows == (0,) * len(windows)



def test_sliding_layers_follow_the_family_not_the_stated_model_type():
    """Which layers of a plain model slide is the family's rule, also for a config recognised
    by its architectures only (gpt-oss: even layers); a Qwen config with a window and no
    layer_types must say where the window starts (strict reading: no guessed default)."""
    gpt_oss = {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
               "sliding_window": 16}
    hc = HybridCacheConfig.from_hf_config(gpt_oss, max_batch_size=1, max_sequence_length=64)
    assert hc.kv.layer_ring_windows == (16, 0, 16, 0)
    qwen = {"model_type": "qwen3", "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 32,
            "use_sliding_window": True}
    with pytest.raises(ValueError, match="^max_window_layers: expected an int, got nothing"):
        HybridCacheConfig.from_hf_config(qwen, max_batch_size=1, max_sequence_length=64)
    typed = {**qwen, "layer_types": ["full_attention", "sliding_attention"]}
    hc = HybridCacheConfig.from_hf_config(typed, max_batch_size=1, max_sequence_length=64)
    assert hc.kv.layer_ring_windows == (0, 32)
    # Without use_sliding_window a Qwen model attends over everything (its config class
    # defaults the key to False): a window in the file makes no ring.
    quiet = {k: v for k, v in qwen.items() if k != "use_sliding_window"}
    for cfg in (quiet, {**quiet, "max_window_layers": 1}):
        hc = HybridCacheConfig.from_hf_config(cfg, max_batch_size=1, max_sequence_length=64)
        assert hc.kv.layer_ring_windows == (0, 0)

# --- random operation sequences: rings against unbounded caches ---------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def ring_programs(draw):
    """A list of operations on a 4-slot batch: ("write", per-row counts), ("compact",
    mapping, new batch), ("copy", src, dst)."""
    ops_, batch = [], 4
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["write", "write", "write", "compact", "copy"]))
        if kind == "write":
            ops_.append(("write", draw(st.lists(st.integers(0, 2 * W + 2), min_size=batch,
                                                max_size=batch))))
        elif kind == "compact" and batch > 1:
            new = draw(st.integers(1, batch))
            keep = draw(st.permutations(range(batch)))[:new]
            mapping = np.full(batch, -1, np.int32)
            mapping[keep] = draw(st.permutations(range(new)))
            ops_.append(("compact", mapping, new))
            batch = new
        elif kind == "copy" and batch > 1:
            src, dst = draw(st.permutations(range(batch)))[:2]
            ops_.append(("copy", src, dst))
    return ops_


def _apply(program, seed, device="cpu"):
    rng = np.random.default_rng(seed)
    ring, flat = (HybridCacheManager(_config(r), device=device) for r in (True, False))
    for m in (ring, flat):
        m.reset_for_new_sequences([0] * 4)
    lengths = [0] * 4
    for op in program:
        if op[0] == "write":
            counts = [min(c, S - n) for c, n in zip(op[1], lengths)]
            k = [_on(device, rng.standard_normal((sum(counts), h, d)).astype(np.float32))
                 for h, d, _ in LAYERS]
            for m in (ring, flat):
                m.write_kv(None, k, k, seq_lengths=counts)
                m.commit_sequence_length(np.asarray(counts, np.int32))
            lengths = [n + c for n, c in zip(lengths, counts)]
        elif op[0] == "compact":
            _, mapping, new = op
            for m in (ring, flat):
                m.compact_batch(mapping, len(lengths), new)
            moved = [0] * new
            for old, dst in enumerate(mapping):
                if dst >= 0:
                    moved[dst] = lengths[old]
            lengths = moved
        else:   # a prompt cache of slot src (a wrapped ring: its last W, in order) into dst
            _, src, dst = op
            saved = [m.capture_kv_cache(src, lengths[src]) for m in (ring, flat)]
            for a, layer in enumerate(Engine.ATTN):
                w = ring.get_ring_window(layer)
                flat_saved = host(saved[1][a])
                want = flat_saved[:, :, max(0, lengths[src] - w):] if w else flat_saved
                assert np.array_equal(host(saved[0][a]), want)
            lengths[dst] = lengths[src]
            for m, s in zip((ring, flat), saved):
                m.restore_kv_cache(s, dst)
                m.reset_for_new_sequences(lengths)
        _check_rings_equal_window(ring, flat, lengths)


@settings(max_examples=25)
@given(program=ring_programs(), seed=st.integers(0, 2**32 - 1))
def test_random_programs_keep_rings_equal_to_the_window(program, seed):
    """Ragged writes past the window, any injective compaction, prompt caches of wrapped rings
    restored into other slots: after every operation each ring equals the unbounded cache
    restricted to its window (cpu device)."""
    _apply(program, seed)


@pytest.mark.emu
@settings(max_examples=8)
@given(program=ring_programs(), seed=st.integers(0, 2**32 - 1))
def test_random_programs_on_rings_emulated(program, seed):
    """The same on the real kernels compiled for the host."""
    emu = pytest.importorskip("emu")
    if not emu.have_compiler():
        pytest.skip("no host C++ compiler")
    with ops.host_backend(emu.EmuLauncher(reverse=True, wide_index=True)):
        _apply(program, seed)


@pytest.mark.emulated
@settings(max_examples=6)
@given(program=ring_programs(), seed=st.integers(0, 2**32 - 1))
def test_random_programs_on_rings_emulated_device(program, seed):
    """The same on the asynchronous emulated device (the CUDA path: staged tables, queued
    launches, device captures restored)."""
    _apply(program, seed, "cuda")


# --- a captured decode step of a ring layout, replayed past the window -----------------------

@pytest.mark.emulated
def test_captured_ring_decode_step_replays_past_the_window(emu_rt):
    """One decode step of every layer (``write_kv`` at the device lengths, then the length
    commit) captured on the emulated device and replayed ``3W + 2`` times, each replay with new
    K/V rows: the rings wrap several times inside the graph. Against the NumPy model (the same
    steps on an unbounded ``cpu`` manager): every ring equals the unbounded cache restricted to
    its window, the device lengths and the device ``ring_start`` are the model's, and the
    replay loop makes no host sync and no pageable copy."""
    xp, rng = emu_rt.xp, np.random.default_rng(7)
    ring = HybridCacheManager(_config(True), device="cuda")
    flat = HybridCacheManager(_config(False), device="cpu")   # the NumPy model
    prompt = [3, 2 * W + 1, W, W + 2]
    for m in (ring, flat):
        m.reset_for_new_sequences([0] * 4)
    rows = [rng.standard_normal((sum(prompt), h, d)).astype(np.float32) for h, d, _ in LAYERS]
    ring.write_kv(None, [xp.asarray(r) for r in rows], [xp.asarray(-r) for r in rows],
                  seq_lengths=prompt)
    flat.write_kv(None, rows, [-r for r in rows], seq_lengths=prompt)
    for m in (ring, flat):
        m.commit_sequence_length(np.asarray(prompt, np.int32))
    steps = 3 * W + 2
    # every step's rows on the device up front: a replay's inputs are copied device to device
    inputs = [rng.standard_normal((steps + 1, 4, 1, h, d)).astype(np.float32)
              for h, d, _ in LAYERS]
    staged = [xp.asarray(a) for a in inputs]
    staged_v = [xp.asarray(a * 2) for a in inputs]
    ks = [xp.empty((4, 1, h, d), np.float32) for h, d, _ in LAYERS]
    vs = [xp.empty((4, 1, h, d), np.float32) for h, d, _ in LAYERS]
    one = np.ones(4, np.int32)
    s = emu_rt.stream(non_blocking=True)
    emu_rt.synchronize()
    with s:
        for k, v, a, b in zip(ks, vs, staged, staged_v):   # step 0, eager on s (warm-up)
            k[...] = a[0]
            v[...] = b[0]
        ring.write_kv(None, ks, vs, stream=s)
        ring.commit_sequence_length(one, stream=s)
        s.begin_capture()
        ring.write_kv(None, ks, vs, stream=s)
        ring.commit_sequence_length(one, stream=s)
        graph = s.end_capture()
        syncs, pageable = emu_rt.counters["syncs"], emu_rt.counters["pageable_copies"]
        for step in range(1, steps + 1):
            for k, v, a, b in zip(ks, vs, staged, staged_v):
                k[...] = a[step]
                v[...] = b[step]
            graph.launch(s)
        assert (emu_rt.counters["syncs"], emu_rt.counters["pageable_copies"]) == \
            (syncs, pageable)
        s.synchronize()
    for step in range(steps + 1):
        flat.write_kv(None, [a[step] for a in inputs], [a[step] * 2 for a in inputs])
        flat.commit_sequence_length(one)
    lengths = [n + steps + 1 for n in prompt]
    assert min(lengths) > 3 * W   # every ring wrapped inside the graph
    assert host(ring.get_kv_cache_lengths()).tolist() == lengths
    _check_rings_equal_window(ring, flat, lengths)
    for layer in Engine.ATTN:
        w = ring.get_ring_window(layer)
        starts = ring.ring_start(layer)   # from the device lengths, on the device
        assert host(starts).tolist() == [n % w if w and n > w else 0 for n in lengths]
