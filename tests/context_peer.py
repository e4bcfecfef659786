"""The context engines of the transfer tests: the demo model (hcache.demo) served over a
DynamicInferenceContext (prefill, decode), and a command loop run in a spawned process (a
prefill peer on loopback).

Every wait here is bounded: the loop ends on "quit", on a closed pipe, or after ``IDLE_S``
without a command.
"""

from __future__ import annotations

import numpy as np
import transfer_peer as peer  # its import keeps UCX on loopback

from hcache.contexts import DynamicInferenceContext
from hcache.demo.adapters import PagedCache

IDLE_S = 60.0
BLOCK = 4


def model_of(layout: str):
    """The demo model (seed 0) of ``layout`` ("attention" or "hybrid"), and its config."""
    config = peer.cache_config(layout, 2, 64)
    return peer.demo_model(config), config


def context(layout: str, **kw) -> DynamicInferenceContext:
    """A context for the demo model of ``layout`` (:func:`context_for` its config)."""
    return context_for(model_of(layout)[1], **kw)


def context_for(config, *, num_blocks=32, block_size=BLOCK, max_requests=3, blocks_per=12,
                mamba_cache_slots=8, **kw) -> DynamicInferenceContext:
    """A context of the layers and Mamba states of ``config`` (a HybridCacheConfig; float32
    everywhere, on the cpu)."""
    m = config.mamba
    return DynamicInferenceContext(
        kv_layer_configs=config.kv.layer_configs, num_blocks=num_blocks,
        block_size_tokens=block_size, max_requests=max_requests,
        max_blocks_per_request=blocks_per, num_mamba_layers=m.num_layers if m else 0,
        conv_states_shape=m.conv_state_shape if m else (1,),
        ssm_states_shape=m.recurrent_state_shape if m else (1,), kv_dtype="float32",
        conv_states_dtype="float32", ssm_states_dtype="float32",
        mamba_cache_slots=mamba_cache_slots if m else 0, mamba_chunk_size=1, device="cpu", **kw)


def prefill(model, ctx, rid, tokens):
    """Admit ``tokens`` as ``rid`` and run its prompt step; the greedy next token and its
    logits row."""
    plan = ctx.add_request(rid, tokens)
    out = model.forward([plan.tokens.tolist()], [plan.start], PagedCache(ctx, [plan]))[0][-1]
    ctx.commit_step()
    return int(np.argmax(out)), out


def decode(model, ctx, rid, token, steps):
    """Greedy decode ``steps`` tokens of live request ``rid`` (``token`` next); the tokens
    and their logits."""
    tokens, rows = [], []
    for _ in range(steps):
        plan = ctx.extend_request(rid, [token])
        out = model.forward([plan.tokens.tolist()], [plan.start], PagedCache(ctx, [plan]))[0][-1]
        ctx.commit_step()
        token = int(np.argmax(out))
        tokens.append(token)
        rows.append(out)
    return tokens, rows


def request_bytes(ctx, rid):
    """The request's K/V rows of every layer (positions ``[0, n)`` gathered through its block
    table) and its live Mamba states, as bytes."""
    n = ctx.num_computed_tokens(rid)
    blocks, bs = ctx.block_ids(rid), ctx.block_size_tokens
    pos = np.arange(n)
    out = [np.asarray(layer)[blocks[pos // bs], :, :, pos % bs].tobytes()
           for layer in ctx.kv_pool.layers]
    if ctx.num_mamba_layers:
        slot = ctx.mamba_slot(rid)
        out += [np.asarray(s)[:, slot].tobytes() for s in (ctx.mamba_conv_states,
                                                          ctx.mamba_ssm_states)]
    return out


def serve(conn) -> None:
    """Command loop of the peer process (prefill side); replies ``("ok", value)`` or
    ``("error", text)``."""
    from hcache.transfer import ContextTransferEngine

    engine = ctx = model = None
    while conn.poll(IDLE_S):
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "quit":
                conn.send(("ok", None))
                break
            if cmd == "build":                  # layout, name, context keywords
                if engine is not None:
                    engine.close()
                big = args[0] == "big"
                model = None if big else model_of(args[0])[0]
                ctx = context_for(peer.cache_config("big", 1, 8), **args[2]) if big \
                    else context(args[0], **args[2])
                engine = ContextTransferEngine(ctx, args[1], timeout_s=10.0)
                value = engine.metadata
            elif cmd == "connect":
                value = engine.connect(args[0])
            elif cmd == "prefill_export":       # request id, prompt
                rid, prompt = args
                token, row = prefill(model, ctx, rid, prompt)
                value = (engine.export(rid), token, row.tobytes(), request_bytes(ctx, rid))
            elif cmd == "fill_export":          # request id, length: layer a holds a + 1
                rid, n = args
                ctx.add_request(rid, list(range(n)))
                ctx.commit_step()
                blocks = ctx.block_ids(rid)
                for a, layer in enumerate(ctx.kv_pool.layers):
                    layer[blocks] = a + 1
                value = engine.export(rid)
            elif cmd == "export_state":         # request id, seconds to wait for "done"
                rid, wait = args
                value = engine.export_state(rid)
                for _ in range(int(wait / 0.01)):
                    if value != "pending":
                        break
                    conn.poll(0.01)
                    value = engine.export_state(rid)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", value))
        except Exception as e:   # noqa: BLE001 - reported to the test
            conn.send(("error", f"{type(e).__name__}: {e}"))
    if engine is not None:
        engine.close()
