"""Where a slot's caches live: a serializable description of a manager's buffers, and the
byte ranges (*units*) that hold one request (docs/design.md, "Transfer between engines").

A description is a plain dict (it travels to the peer inside a request handle): per attention
layer the cache's address, per-slot stride, token axis (``cache_len``; a ring layer's window),
the global heads it holds and the element size; per Mamba layer the addresses of its recurrent
and conv states. :func:`slot_units` turns a description, a slot and a length into
``{key: (address, nbytes)}``: one entry per KV ``(layer, component, head)`` holding the slot's
first ``min(length, window)`` entries, per recurrent ``(layer, head)`` and per conv
``(layer, segment, id)``. Keys are global (see :mod:`hcache.transfer.tensor_parallel`), so
two descriptions of different TP degrees or different slot shapes can be matched key by key.
"""

from __future__ import annotations

from .tensor_parallel import TensorParallelLayout

__all__ = ["describe_manager", "slot_units", "mamba_units", "address_of", "check_compatible",
           "check_mamba_compatible"]


def address_of(array) -> int:
    """The address of an array's first element (NumPy: host, CuPy: device)."""
    face = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return int(face["data"][0])


def describe_manager(manager, tp: TensorParallelLayout | None = None, rank: int = 0) -> dict:
    """The slot layout of a :class:`~hcache.HybridCacheManager` (rank ``rank`` of ``tp``).

    Raises
    ------
    TypeError
        ``manager`` has no KV sub-manager (not a HybridCacheManager).
    ValueError
        ``manager.config`` is not ``tp.rank_config(rank)``.
    """
    kv = getattr(manager, "kv_cache_manager", None)
    if kv is None:
        raise TypeError(f"manager: expected HybridCacheManager, got {type(manager).__name__}")
    tp = tp if tp is not None else TensorParallelLayout(manager.config, 1)
    if tp.rank_config(rank) != manager.config:
        raise ValueError(f"manager: expected the config of rank {rank} of {tp.tp_size} "
                         f"(TensorParallelLayout.rank_config), got a different config")
    config = manager.config
    layers = []
    for a, (lc, window) in enumerate(zip(config.kv.layer_configs, config.kv.layer_ring_windows,
                                         strict=True)):
        cache = kv.get_combined_kv_cache(a)
        layers.append({"addr": address_of(cache), "slot_stride": int(cache.strides[0]),
                       "components": lc.components, "heads": list(tp.kv_heads(a, rank)),
                       "cache_len": int(cache.shape[3]), "head_dim": lc.head_dim,
                       "itemsize": int(cache.itemsize), "window": window})
    desc = {"tp": [rank, tp.tp_size], "kv_dtype": config.kv.dtype, "kv": layers,
            "max_batch": config.max_batch_size, "max_len": config.kv.max_sequence_length,
            "mamba": None, "device": str(manager.device)}
    mm = manager.mamba_cache_manager
    if mm is not None:
        m = config.mamba
        mamba = {"layers": m.num_layers, "recurrent": None, "conv": None}
        if m.has_recurrent_state:
            views = [mm.get_recurrent_state(i) for i in range(m.num_layers)]
            mamba["recurrent"] = {
                "addrs": [address_of(v) for v in views],
                "slot_stride": int(views[0].strides[0]) if views else 0,
                "heads": list(tp.mamba_heads(rank)),
                "head_bytes": m.head_dim * m.state_size * int(views[0].itemsize) if views else 0,
                "dtype": m.ssm_dtype}
        if m.has_conv_state:
            views = [mm.get_conv_state(i) for i in range(m.num_layers)]
            row = m.conv_kernel * (int(views[0].itemsize) if views else 0)
            mamba["conv"] = {
                "addrs": [address_of(v) for v in views],
                "slot_stride": int(views[0].strides[0]) if views else 0,
                "segments": [[name, list(ids), width * row]
                             for name, ids, width in tp.conv_segments(rank)],
                "dtype": m.conv_dtype, "kernel": m.conv_kernel}
        desc["mamba"] = mamba
    return desc


def kv_entries(layer: dict, length: int) -> int:
    """Entries of a slot's cache that hold tokens ``[0, length)``: the last ``min(length,
    window)`` of a ring layer."""
    return min(length, layer["window"]) if layer["window"] else length


def slot_units(desc: dict, slot: int, length: int) -> dict:
    """``{key: (address, nbytes)}`` for the first ``length`` tokens of ``slot`` (all Mamba
    states): one unit per KV ``("kv", layer, component, head)``, recurrent ``("rec", layer,
    head)`` and conv ``("conv", layer, segment, id)``; a unit is contiguous in memory."""
    units = {}
    for a, layer in enumerate(desc["kv"]):
        n = kv_entries(layer, length)
        row = layer["head_dim"] * layer["itemsize"]
        base = layer["addr"] + slot * layer["slot_stride"]
        heads = layer["heads"]
        for c in range(layer["components"]):
            for local, head in enumerate(heads):
                plane = (c * len(heads) + local) * layer["cache_len"]
                units[("kv", a, c, head)] = (base + plane * row, n * row)
    units.update(mamba_units(desc["mamba"], slot))
    return units


def mamba_units(mamba: dict | None, slot: int) -> dict:
    """The Mamba part of :func:`slot_units`: ``{("rec", layer, head) | ("conv", layer,
    segment, id): (address, nbytes)}`` of ``slot`` in a description's ``"mamba"`` entry."""
    units = {}
    if mamba is not None:
        rec = mamba["recurrent"]
        if rec is not None:
            for i, addr in enumerate(rec["addrs"]):
                base = addr + slot * rec["slot_stride"]
                for local, head in enumerate(rec["heads"]):
                    units[("rec", i, head)] = (base + local * rec["head_bytes"],
                                               rec["head_bytes"])
        conv = mamba["conv"]
        if conv is not None:
            for i, addr in enumerate(conv["addrs"]):
                offset = addr + slot * conv["slot_stride"]
                for name, ids, nbytes in conv["segments"]:
                    for gid in ids:
                        units[("conv", i, name, gid)] = (offset, nbytes)
                        offset += nbytes
    return units


def check_kv_layers(local: dict, remote: dict) -> None:
    """Refuse (``ValueError``) two layouts whose attention layers differ in KV dtype, count,
    head dim, components or element size (slot and paged layouts alike)."""
    if local["kv_dtype"] != remote["kv_dtype"]:
        raise ValueError(f"layout: expected KV dtype {local['kv_dtype']}, got "
                         f"{remote['kv_dtype']} on the peer")
    if len(local["kv"]) != len(remote["kv"]):
        raise ValueError(f"layout: expected {len(local['kv'])} attention layers, got "
                         f"{len(remote['kv'])} on the peer")
    for a, (mine, theirs) in enumerate(zip(local["kv"], remote["kv"], strict=True)):
        for field in ("head_dim", "components", "itemsize"):
            if mine[field] != theirs[field]:
                raise ValueError(f"layout: expected {field} {mine[field]} in attention layer "
                                 f"{a}, got {theirs[field]} on the peer (head-dim groups differ)")


def check_compatible(local: dict, remote: dict, length: int) -> None:
    """Refuse (``ValueError``, naming what differs) to move ``length`` tokens between two
    layouts that do not hold them the same way: different KV layers, head dims, components,
    dtypes, Mamba shapes, a length past either side's ``max_len``, or ring windows that differ
    once the tokens no longer fit the smaller one (the entries would be rotated differently).
    Slot counts, ``max_len`` and TP degrees may differ."""
    check_kv_layers(local, remote)
    for a, (mine, theirs) in enumerate(zip(local["kv"], remote["kv"], strict=True)):
        windows = [w for w in (mine["window"], theirs["window"]) if w]
        if windows and length > min(windows) and mine["window"] != theirs["window"]:
            raise ValueError(f"layout: expected the same ring window in attention layer {a} "
                             f"for {length} tokens, got {mine['window']} here and "
                             f"{theirs['window']} on the peer")
    for side in (local, remote):
        if length > side["max_len"]:
            raise ValueError(f"length: expected <= {side['max_len']} (max_sequence_length), "
                             f"got {length}")
    check_mamba_compatible(local["mamba"], remote["mamba"])


def check_mamba_compatible(mine: dict | None, theirs: dict | None) -> None:
    """Refuse (``ValueError``) two ``"mamba"`` entries of different layer counts, state kinds
    or dtypes (shapes are checked unit by unit)."""
    if (mine is None) != (theirs is None) or (mine and mine["layers"] != theirs["layers"]):
        raise ValueError(f"layout: expected {mine['layers'] if mine else 0} Mamba layers, got "
                         f"{theirs['layers'] if theirs else 0} on the peer")
    if mine is not None:
        for kind in ("recurrent", "conv"):
            a, b = mine[kind], theirs[kind]
            if (a is None) != (b is None) or (a and a["dtype"] != b["dtype"]):
                raise ValueError(f"layout: expected Mamba {kind} state "
                                 f"{a['dtype'] if a else 'absent'}, got "
                                 f"{b['dtype'] if b else 'absent'} on the peer")
