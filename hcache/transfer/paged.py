"""Where a request of a :class:`~hcache.contexts.DynamicInferenceContext` lives: a serializable
description of a context's paged KV pool and live Mamba states, and the transfer descriptors
that fill a request's blocks from a peer's (docs/design.md §10.1).

A context's description is a plain dict like a manager's (:mod:`hcache.transfer.layout`): per
attention layer the pool's address, its per-block stride, the global heads it holds, head dim,
components and element size; the block size and block count; the live Mamba states in the
manager's ``"mamba"`` form (slot = live Mamba slot). The bytes of token positions ``[s, e)``
of one ``(layer, component, head)`` within one block are contiguous (the pool is ``[blocks, C,
H, block_size, D]``), so :func:`plan_context_pull` cuts a request's positions where either
side's blocks end and pairs each piece; whole blocks of equal block sizes merge into one
descriptor per run of consecutive block ids on both sides.
"""

from __future__ import annotations

import math

import numpy as np

from .layout import address_of, check_kv_layers, check_mamba_compatible, mamba_units
from .plan import merge_ranges

__all__ = ["describe_context", "check_paged_compatible", "plan_context_pull"]


def _rank_check(ctx, tp, rank):
    """Refuse a context whose layers are not rank ``rank``'s of ``tp``."""
    config = tp.rank_config(rank)
    mine = [(lc.num_kv_heads, lc.head_dim, lc.components) for lc in ctx.kv_pool.layer_configs]
    want = [(lc.num_kv_heads, lc.head_dim, lc.components) for lc in config.kv.layer_configs]
    shapes = {"ssm": ctx.mamba_ssm_states, "conv": ctx.mamba_conv_states}
    m = config.mamba
    want_shapes = {"ssm": m.recurrent_state_shape if m and m.has_recurrent_state else None,
                   "conv": m.conv_state_shape if m and m.has_conv_state else None}
    got = {k: None if v is None or not ctx.num_mamba_layers else tuple(v.shape[2:])
           for k, v in shapes.items()}
    if mine != want or got != want_shapes or ctx.num_mamba_layers != (m.num_layers if m else 0):
        raise ValueError(f"ctx: expected the layers of rank {rank} of {tp.tp_size} "
                         f"(TensorParallelLayout.rank_config), got KV {mine}, states {got}")


def describe_context(ctx, tp=None, rank: int = 0) -> dict:
    """The paged layout of a context (rank ``rank`` of ``tp``, a
    :class:`~hcache.transfer.TensorParallelLayout`, when its heads are a shard).

    Raises
    ------
    TypeError
        ``ctx`` is not a DynamicInferenceContext.
    ValueError
        ``ctx`` has a local block space (``num_local_blocks``), or its layers and state shapes
        are not ``tp.rank_config(rank)``'s.
    """
    if not hasattr(ctx, "kv_pool") or not hasattr(ctx, "_requests"):
        raise TypeError(f"ctx: expected DynamicInferenceContext, got {type(ctx).__name__}")
    if ctx.window_blocks is not None:
        raise ValueError("ctx: expected a context without a local block space, got "
                         "num_local_blocks set (its window blocks are not transferred)")
    if tp is not None:
        _rank_check(ctx, tp, rank)
    pool = ctx.kv_pool
    layers = []
    for a, (lc, cache) in enumerate(zip(pool.layer_configs, pool.layers, strict=True)):
        heads = tp.kv_heads(a, rank) if tp is not None else range(lc.num_kv_heads)
        layers.append({"addr": address_of(cache), "block_stride": int(cache.strides[0]),
                       "components": lc.components, "heads": list(heads),
                       "head_dim": lc.head_dim, "itemsize": int(cache.itemsize)})
    desc = {"paged": True, "tp": None if tp is None else [rank, tp.tp_size],
            "kv_dtype": str(pool.dtype), "kv": layers, "block_size": pool.block_size,
            "num_blocks": pool.num_blocks, "max_batch": ctx.max_requests,
            "max_len": ctx.max_sequence_length, "mamba": None, "device": str(ctx.device)}
    L = ctx.num_mamba_layers
    if L:
        mamba = {"layers": L, "recurrent": None, "conv": None}
        ssm, conv = ctx.mamba_ssm_states, ctx.mamba_conv_states
        if ssm is not None:
            shape = ssm.shape[2:]
            mamba["recurrent"] = {
                "addrs": [address_of(ssm) + i * int(ssm.strides[0]) for i in range(L)],
                "slot_stride": int(ssm.strides[1]),
                "heads": list(tp.mamba_heads(rank) if tp is not None else range(shape[0])),
                "head_bytes": math.prod(shape[1:]) * int(ssm.itemsize), "dtype": str(ssm.dtype)}
        if conv is not None:
            row = conv.shape[3] * int(conv.itemsize)      # [L, R, conv_dim, kernel]
            segments = tp.conv_segments(rank) if tp is not None else (("all", (0,),
                                                                       conv.shape[2]),)
            mamba["conv"] = {
                "addrs": [address_of(conv) + i * int(conv.strides[0]) for i in range(L)],
                "slot_stride": int(conv.strides[1]),
                "segments": [[name, list(ids), width * row] for name, ids, width in segments],
                "dtype": str(conv.dtype), "kernel": int(conv.shape[3])}
        desc["mamba"] = mamba
    return desc


def check_paged_compatible(local: dict, remote: dict, length: int) -> None:
    """Refuse (``ValueError``, naming what differs) to fill a request of ``length`` tokens of
    context layout ``local`` from ``remote``: not a context's layout, other KV dtypes, layer
    counts, head dims, components or element sizes, a TP layout on one side only, other Mamba
    states, or a length past this side's block table. Block sizes, block counts, request
    rows and TP degrees may differ."""
    if not remote.get("paged"):
        raise ValueError("layout: expected a DynamicInferenceContext's paged layout on the "
                         "peer, got a HybridCacheManager's slot layout")
    check_kv_layers(local, remote)
    if (local["tp"] is None) != (remote["tp"] is None):
        raise ValueError(f"layout: expected {'a' if local['tp'] else 'no'} TP layout on the "
                         f"peer as here, got {remote['tp']} (pass tp= on both sides or neither)")
    if length > local["max_len"]:
        raise ValueError(f"length: expected <= {local['max_len']} (max_blocks_per_request x "
                         f"block_size_tokens), got {length}")
    check_mamba_compatible(local["mamba"], remote["mamba"])


def _kv_pieces(local, local_blocks, remote, remote_blocks, t0, t1):
    """Per attention layer, the pieces of positions ``[t0, t1)`` as ``(local offsets, remote
    offsets, nbytes per row)``: start addresses of each piece relative to a head's plane."""
    bl, br = local["block_size"], remote["block_size"]
    if t1 <= t0:
        return None
    cuts = np.union1d(np.arange(t0, t1 + 1, bl), np.arange(-(-t0 // br) * br, t1 + 1, br))
    cuts = np.union1d(cuts, [t0, t1])
    starts, ends = cuts[:-1], cuts[1:]
    return (starts, ends, np.asarray(local_blocks, np.int64)[starts // bl], starts % bl,
            np.asarray(remote_blocks, np.int64)[starts // br], starts % br)


def plan_context_pull(local: dict, local_blocks, first_block: int, live_slot: int,
                      sources: list, length: int, *, merge: bool = True) -> list:
    """Descriptors that fill a request of ``length`` tokens in a context of layout ``local``.

    Parameters
    ----------
    local : dict
        This side's :func:`describe_context`.
    local_blocks : int sequence [ceil(length / block_size)]
        The request's blocks here; ``first_block`` leading ones are filled already (a prefix
        this side's cache held), the rest receive positions ``[first_block * block_size,
        length)`` (through the end of the last block both sides have).
    live_slot : int
        The request's live Mamba slot here (all its states are filled).
    sources : list of (peer, layout, blocks, slot)
        Every rank of the sending side: its description, the request's blocks and live slot
        there. Each unit comes from the first source holding it.
    merge : bool
        Merge contiguous pieces (:func:`~hcache.transfer.plan.merge_ranges`).

    Returns
    -------
    list of (peer, rows)
        ``rows`` int64 ``[m, 3]`` (local, remote, nbytes), local = destination; a source
        that provides no bytes has no entry.

    Raises
    ------
    ValueError
        Layouts that differ (:func:`check_paged_compatible`), a source whose blocks do not
        hold ``length`` tokens or lie outside its pool, or a head or state no source holds.
    """
    t0 = first_block * local["block_size"]
    todo = {("kv", a, c, h) for a, layer in enumerate(local["kv"])
            for c in range(layer["components"]) for h in layer["heads"]}
    mine_m = mamba_units(local["mamba"], live_slot)
    todo |= set(mine_m)
    plan = []
    for i, (peer, layout, blocks, slot) in enumerate(sources):
        check_paged_compatible(local, layout, length)
        blocks = np.asarray(blocks, np.int64)
        need = -(-length // layout["block_size"])
        if blocks.shape != (need,) or (len(blocks) and not
                                      (0 <= blocks.min() and blocks.max() < layout["num_blocks"])):
            raise ValueError(f"handles[{i}]: expected {need} block ids in [0, "
                             f"{layout['num_blocks']}) for {length} tokens, got {blocks.tolist()}")
        t1 = min(-(-length // b) * b for b in (local["block_size"], layout["block_size"]))
        pieces = _kv_pieces(local, local_blocks, layout, blocks, t0, t1)
        lo, ro, nb = [], [], []
        for a, (mine, theirs) in enumerate(zip(local["kv"], layout["kv"], strict=True)):
            row, remote_heads = mine["head_dim"] * mine["itemsize"], theirs["heads"]
            where = {h: i for i, h in enumerate(remote_heads)}
            # (local plane, remote plane) of each (component, head) taken from this source
            planes = [(c * len(mine["heads"]) + li, c * len(remote_heads) + where[h])
                      for c in range(mine["components"]) for li, h in enumerate(mine["heads"])
                      if h in where and ("kv", a, c, h) in todo]
            todo.difference_update(("kv", a, c, h) for c in range(mine["components"])
                                   for h in mine["heads"] if h in where)
            if pieces is None or not planes:
                continue
            starts, ends, lblk, loff, rblk, roff = pieces
            lp, rp = (np.array(p, np.int64)[:, None] for p in zip(*planes, strict=True))
            lo.append((mine["addr"] + lblk * mine["block_stride"]
                       + (lp * local["block_size"] + loff) * row).ravel())
            ro.append((theirs["addr"] + rblk * theirs["block_stride"]
                       + (rp * layout["block_size"] + roff) * row).ravel())
            nb.append(np.broadcast_to((ends - starts) * row, (len(planes), len(starts))).ravel())
        theirs_m = mamba_units(layout["mamba"], slot)
        keys = [k for k in mine_m if k in todo and k in theirs_m]
        for key in keys:
            if mine_m[key][1] != theirs_m[key][1]:
                raise ValueError(f"layout: expected {mine_m[key][1]} bytes for {key}, got "
                                 f"{theirs_m[key][1]} on the peer (state shapes differ)")
        if keys:
            todo.difference_update(keys)
            lo.append(np.array([mine_m[k][0] for k in keys], np.int64))
            ro.append(np.array([theirs_m[k][0] for k in keys], np.int64))
            nb.append(np.array([mine_m[k][1] for k in keys], np.int64))
        if lo:
            rows = merge_ranges(np.concatenate(lo), np.concatenate(ro), np.concatenate(nb),
                                merge=merge)
            if len(rows):
                plan.append((peer, rows))
    if todo:
        raise ValueError(f"sources: expected every head and state of this rank, got none "
                         f"holding {min(todo)} (and {len(todo) - 1} more)")
    return plan
