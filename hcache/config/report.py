"""What a cache layout costs, in words: the text of ``python -m hcache info --config``
(docs/design.md §7).

:func:`layout_report` describes a :class:`~hcache.config.caches.HybridCacheConfig` layer by layer
(runs of identical layers folded into one line) and gives its device bytes: per token (the KV
caches of the unbounded layers that own one), the ring buffers of sliding-window layers (their
last ``W`` tokens, fixed: ``KVCacheConfig.layer_cache_lengths``) and per sequence (the recurrent
and conv states and the rings, which do not grow, plus the KV of ``max_sequence_length`` tokens).
"""

from __future__ import annotations

import math

from ..dtypes import resolve_dtype
from .caches import HybridCacheConfig

__all__ = ["layout_bytes", "layout_report"]


def layout_bytes(config: HybridCacheConfig) -> dict:
    """Device bytes of one sequence of a layout.

    Returns
    -------
    dict
        ``per_token`` (KV bytes one token adds, over every cache-owning attention layer whose
        cache is unbounded), ``rings`` (KV bytes of the ring-buffer layers, each holding its
        window of ``W`` tokens whatever the length), ``states`` (recurrent and conv bytes of
        one sequence, independent of its length) and ``per_sequence`` (``states + rings +
        per_token * max_sequence_length``).
    """
    kv_item = resolve_dtype(config.kv.dtype).itemsize
    per_token = rings = 0
    for lc, window in zip(config.kv.layer_configs, config.kv.layer_ring_windows):
        row = lc.components * lc.num_kv_heads * lc.head_dim * kv_item
        if window:
            rings += row * window
        else:
            per_token += row
    states = 0
    if config.mamba is not None:
        m = config.mamba
        one = (math.prod(m.recurrent_state_shape) * resolve_dtype(m.ssm_dtype).itemsize
               if m.has_recurrent_state else 0)
        one += (math.prod(m.conv_state_shape) * resolve_dtype(m.conv_dtype).itemsize
                if m.has_conv_state else 0)
        states = one * m.num_layers
    return {"per_token": per_token, "rings": rings, "states": states,
            "per_sequence": states + rings + per_token * config.kv.max_sequence_length}


def _describe(config: HybridCacheConfig) -> list[str]:
    """One phrase per decoder layer: its kind and the shapes of the caches it owns."""
    owners = iter(zip(config.kv.layer_configs, config.kv.layer_ring_windows))
    m = config.mamba
    out = []
    for layer, kind in enumerate(config.layer_types):
        parts = []
        if kind.has_attention:
            if layer in config.kv_sharing:
                parts.append(f"attention, reads layer {config.kv_sharing[layer]}'s KV")
            else:
                lc, ring = next(owners)
                what = (f"latent {lc.head_dim} (MLA, one component)" if lc.components == 1
                        else f"KV {lc.num_kv_heads} x {lc.head_dim}")
                window = f", window {lc.sliding_window}" if lc.sliding_window else ""
                window += " (ring buffer)" if ring else ""
                parts.append(f"attention {what}{window} {config.kv.dtype}")
        if kind.has_mamba:
            states = []
            if m.has_recurrent_state:
                states.append(f"state {list(m.recurrent_state_shape)} {m.ssm_dtype}")
            if m.has_conv_state:
                states.append(f"conv {list(m.conv_state_shape)} {m.conv_dtype}")
            parts.append("recurrent " + " + ".join(states))
        out.append("; ".join(parts) or "no cache (MLP / MoE only)")
    return out


def layout_report(config: HybridCacheConfig, model_type=None) -> list[str]:
    """The lines ``python -m hcache info --config`` prints for ``config``."""
    phrases = _describe(config)
    counts = {kind: sum(1 for t in config.layer_types if t is kind)
              for kind in dict.fromkeys(config.layer_types)}
    lines = [f"model_type  {model_type}" if model_type is not None else "model_type  (none)",
             f"layers      {config.num_layers}: " + ", ".join(
                 f"{n} {kind.name}" for kind, n in counts.items())]
    start = 0
    for i in range(1, len(phrases) + 1):
        if i == len(phrases) or phrases[i] != phrases[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            lines.append(f"  {span:<9} {phrases[start]}")
            start = i
    b = layout_bytes(config)
    seq = config.kv.max_sequence_length
    n_rings = sum(1 for w in config.kv.layer_ring_windows if w)
    lines.append(f"bytes per token     {b['per_token']:,} (KV of "
                 f"{config.kv.num_attention_layers - n_rings} cache-owning attention layers"
                 f"{' with unbounded caches' if n_rings else ''})")
    rings = ""
    if n_rings:
        lines.append(f"ring buffers        {b['rings']:,} (KV of {n_rings} sliding-window layers, "
                     f"their last window of tokens each, fixed)")
        rings = f" + {b['rings']:,} (ring buffers, fixed)"
    lines.append(f"bytes per sequence  {b['per_sequence']:,} at {seq:,} tokens = {b['states']:,} "
                 f"(recurrent and conv states, fixed){rings} + {seq:,} x {b['per_token']:,}")
    return lines
