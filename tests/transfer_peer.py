"""The other engine of the transfer tests: the demo model (hcache.demo) served over a
HybridCacheManager, and a command loop run in a spawned process (a peer on loopback).

Every wait here is bounded: the loop ends on "quit", on a closed pipe, or after ``IDLE_S``
without a command.
"""

from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("UCX_TLS", "tcp,cma")       # loopback only
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402

from hcache import (  # noqa: E402
    HybridCacheConfig,
    HybridCacheManager,
    KVCacheConfig,
    KVLayerConfig,
    LayerType,
    MambaCacheConfig,
)
from hcache.demo.adapters import SlotCache  # noqa: E402
from hcache.demo.model import TinyHybridModel  # noqa: E402
from hcache.demo.run import NEMOTRON_H_CONFIG  # noqa: E402

IDLE_S = 60.0
WINDOW = 16
PATTERNS = {"attention": "*-*-", "hybrid": "M*M-*M", "windowed": "M*M-*M"}
BIG_LAYERS, BIG_HEADS, BIG_DIM = 4, 8, 128      # "big": 32 KiB of K/V per token (float32)


def cache_config(layout: str, max_batch: int, max_len: int) -> HybridCacheConfig:
    """The demo model's caches: ``attention`` (no Mamba layer), ``hybrid`` (the demo's
    Nemotron-H pattern) or ``windowed`` (hybrid, attention layers as rings of ``WINDOW``); or
    ``big``: ``BIG_LAYERS`` attention layers of ``BIG_HEADS`` x ``BIG_DIM`` (no model)."""
    if layout == "big":
        kv = KVCacheConfig(max_batch, max_len, (KVLayerConfig(BIG_HEADS, BIG_DIM),) * BIG_LAYERS,
                           dtype="float32")
        return HybridCacheConfig((LayerType.ATTENTION,) * BIG_LAYERS, kv, None, max_batch)
    hf = dict(NEMOTRON_H_CONFIG, hybrid_override_pattern=PATTERNS[layout])
    config = HybridCacheConfig.from_hf_config(hf, max_batch_size=max_batch,
                                              max_sequence_length=max_len, kv_dtype="float32")
    if layout == "windowed":
        layers = tuple(replace(lc, sliding_window=WINDOW) for lc in config.kv.layer_configs)
        config = replace(config, kv=replace(config.kv, layer_configs=layers, ring_windows=True))
        assert set(config.kv.layer_cache_lengths) == {WINDOW}
    return config


def demo_model(config: HybridCacheConfig) -> TinyHybridModel:
    """The demo's model (seed 0) for ``config``; without Mamba layers its Mamba fields come
    from an empty Mamba config (the model reads them, no layer uses them)."""
    if config.mamba is None:
        config = replace(config, mamba=MambaCacheConfig(
            0, config.max_batch_size, 4, 8, 4, 40, 4, "float32", "float32"))
    return TinyHybridModel(config, vocab_size=NEMOTRON_H_CONFIG["vocab_size"],
                           hidden_size=NEMOTRON_H_CONFIG["hidden_size"],
                           num_q_heads=NEMOTRON_H_CONFIG["num_attention_heads"], seed=0)


def prefill(model, mgr, prompts):
    """Prefill ``prompts`` into slots ``0..n-1`` (one ragged batch); the greedy first token
    of each and its logits."""
    mgr.reset_for_new_sequences([0] * len(prompts))
    logits = model.forward(prompts, [0] * len(prompts), SlotCache(mgr, model, len(prompts)))
    mgr.commit_sequence_length(np.array([len(p) for p in prompts]))
    return [int(np.argmax(x[-1])) for x in logits], [x[-1] for x in logits]


def decode(model, mgr, length, token, steps):
    """Greedy decode ``steps`` tokens of the sequence in slot 0 (``length`` tokens cached,
    ``token`` next); the tokens and their logits."""
    mgr.reset_for_new_sequences([length])
    tokens, rows = [], []
    for _ in range(steps):
        out = model.forward([[token]], [length], SlotCache(mgr, model, 1))[0][-1]
        mgr.commit_sequence_length(1)
        length += 1
        token = int(np.argmax(out))
        tokens.append(token)
        rows.append(out)
    return tokens, rows


def serve(conn) -> None:
    """Command loop of the peer process (prefill side); replies ``("ok", value)`` or
    ``("error", text)``."""
    from hcache.transfer import TransferEngine

    engine = mgr = model = None
    while conn.poll(IDLE_S):
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "quit":
                conn.send(("ok", None))
                break
            if cmd == "build":                  # layout, max_batch, max_len, name
                if engine is not None:
                    engine.close()
                config = cache_config(*args[:3])
                mgr = HybridCacheManager(config)
                model = demo_model(config) if args[0] != "big" else None
                engine = TransferEngine(mgr, args[3], timeout_s=10.0)
                value = engine.metadata
            elif cmd == "connect":
                value = engine.connect(args[0])
            elif cmd == "prefill_export":       # prompts, slot, request id
                prompts, slot, rid = args
                tokens, rows = prefill(model, mgr, prompts)
                value = (engine.export(rid, slot, len(prompts[slot])), tokens[slot],
                         rows[slot].tobytes())
            elif cmd == "fill_export":          # slot, length, request id: layer a = a + 1
                slot, length, rid = args
                for a in range(mgr.kv_cache_manager.num_layers):
                    mgr.kv_cache_manager.get_combined_kv_cache(a)[slot, :, :, :length] = a + 1
                value = engine.export(rid, slot, length)
            elif cmd == "export_state":         # request id, seconds to wait for "done"
                rid, wait = args
                value = engine.export_state(rid)
                for _ in range(int(wait / 0.01)):
                    if value != "pending":
                        break
                    conn.poll(0.01)
                    value = engine.export_state(rid)
            elif cmd == "pull":                 # handles, slot, timeout
                engine.pull(args[0], args[1], timeout_s=args[2])
                value = None
            elif cmd == "snapshot":             # every cache buffer as bytes
                value = snapshot(mgr)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", value))
        except Exception as e:   # noqa: BLE001 - reported to the test
            conn.send(("error", f"{type(e).__name__}: {e}"))
    if engine is not None:
        engine.close()


def snapshot(mgr) -> list:
    """Bytes of every KV cache and Mamba state buffer of ``mgr``."""
    kv = mgr.kv_cache_manager
    out = [np.asarray(kv.get_combined_kv_cache(a)).tobytes() for a in range(kv.num_layers)]
    mm = mgr.mamba_cache_manager
    if mm is not None:
        for i in range(mm.config.num_layers):
            out.append(np.asarray(mm.get_recurrent_state(i)).tobytes())
            out.append(np.asarray(mm.get_conv_state(i)).tobytes())
    return out
