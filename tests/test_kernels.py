"""Every kernel family against the NumPy reference and an independent naive model.

Runs the real ``kernels/*.cu`` twice: on the CPU through the host emulation (``emu``, every CI
machine) and on CuPy (``gpu`` tier). Every array sits between canary bytes, which must survive,
whatever the indices say.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hcache import ops
from hcache.ops.tables import KVGroup, SlotSet

from kernel_cases import (
    BACKENDS,
    HEAD_DIMS,
    Arena,
    as_bytes,
    bad_mappings,
    dtypes,
    injective_mappings,
    kernel_env,
)

misaligns = st.sampled_from([0, 0, 1, 2, 4, 8])




def _twins(seed, xp):
    """Two arenas that produce identical bytes: one NumPy (reference), one on ``xp``."""
    return Arena(np.random.default_rng(seed), np), Arena(np.random.default_rng(seed), xp)


def _same(a, b):
    assert np.array_equal(as_bytes(a), as_bytes(b))


def _to(xp, a):
    return a if xp is np else xp.asarray(a)


# --- compaction ----------------------------------------------------------------------------

@st.composite
def compaction_cases(draw):
    max_batch, old_batch, new_batch, mapping = draw(injective_mappings())
    dtype = draw(dtypes)
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    seq = draw(st.integers(1, 5))
    heads = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    lengths = draw(st.lists(st.integers(0, seq), min_size=max_batch, max_size=max_batch))
    if draw(st.integers(0, 9)) == 0:  # lengths the kernel must clamp to [0, S]
        lengths[draw(st.integers(0, max_batch - 1))] = draw(st.sampled_from([-3, seq + 4]))
    mamba = draw(st.lists(st.tuples(st.lists(st.integers(1, 5), min_size=1, max_size=3),
                                    dtypes), min_size=0, max_size=3))
    return dict(max_batch=max_batch, old=old_batch, new=new_batch, mapping=mapping,
                dtype=dtype, head_dim=head_dim, seq=seq, heads=heads,
                lengths=np.asarray(lengths, np.int32), mamba=mamba,
                misalign=draw(misaligns), seed=draw(st.integers(0, 2**32 - 1)))


def _compaction_state(arena, c, xp):
    layers = [arena.array((c["max_batch"], 2, h, c["seq"], c["head_dim"]), c["dtype"],
                          misalign=c["misalign"] * c["dtype"].itemsize) for h in c["heads"]]
    states = [arena.array((c["max_batch"], *shape), dt, misalign=c["misalign"])
              for shape, dt in c["mamba"]]
    lengths = arena.array((c["max_batch"],), np.int32)
    lengths[...] = _to(xp, c["lengths"])
    plan = arena.array((ops.compaction_plan_size(c["max_batch"]),), np.int32, fill="zeros")
    mapping = arena.array((max(c["old"], 1),), np.int32)
    mapping[: c["old"]] = _to(xp, c["mapping"])
    return layers, states, lengths, plan, mapping


def _run_compaction(state, c, backend):
    layers, states, lengths, plan, mapping = state
    ops.compaction_plan(mapping, c["old"], c["new"], plan, lengths=lengths, backend=backend)
    ops.kv_compact(KVGroup(layers), plan, lengths, backend=backend)
    ops.slots_compact(SlotSet([(t, t) for t in states] + [(lengths, lengths)]), plan,
                      backend=backend)


def _naive_compaction(layers, states, lengths, mapping, new_batch, seq):
    """Scratch-copy model: new[mapping[i]] = old[i] for the first lengths[i] tokens; holes
    below new_batch get zeroed states and length 0."""
    out_layers = [a.copy() for a in layers]
    out_states = [a.copy() for a in states]
    out_len = lengths.copy()
    received = np.zeros(len(lengths), bool)
    for old, new in enumerate(mapping):
        if new < 0:
            continue
        n = min(max(int(lengths[old]), 0), seq)
        for src, dst in zip(layers, out_layers):
            dst[new, :, :, :n] = src[old, :, :, :n]
        for src, dst in zip(states, out_states):
            dst[new] = src[old]
        out_len[new] = lengths[old]
        received[new] = True
    for j in range(new_batch):
        if not received[j]:
            for dst in out_states:
                dst[j] = 0
            out_len[j] = 0
    return out_layers, out_states, out_len


@pytest.mark.parametrize("kind", BACKENDS)
@given(c=compaction_cases())
def test_compaction_matches_reference_and_model(kind, c):
    xp, backend = kernel_env(kind)
    ref_arena, k_arena = _twins(c["seed"], xp)
    ref_state = _compaction_state(ref_arena, c, np)
    k_state = _compaction_state(k_arena, c, xp)
    expected = _naive_compaction(ref_state[0], ref_state[1], ref_state[2], c["mapping"],
                                 c["new"], c["seq"])
    _run_compaction(ref_state, c, None)
    _run_compaction(k_state, c, backend)
    for r, k in zip(ref_state[0] + ref_state[1] + [ref_state[2], ref_state[3]],
                    k_state[0] + k_state[1] + [k_state[2], k_state[3]]):
        _same(r, k)
    for e, r in zip(expected[0] + expected[1] + [expected[2]],
                    ref_state[0] + ref_state[1] + [ref_state[2]]):
        _same(e, r)
    k_arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@given(bad=bad_mappings(), seed=st.integers(0, 2**32 - 1), dtype=dtypes)
def test_invalid_mapping_moves_nothing(kind, bad, seed, dtype):
    xp, backend = kernel_env(kind)
    max_batch, old, new, mapping = bad
    c = dict(max_batch=max(max_batch, old), old=old, new=new, mapping=mapping, dtype=dtype,
             head_dim=8, seq=3, heads=[2, 1], lengths=np.full(max(max_batch, old), 2, np.int32),
             mamba=[((3,), dtype)], misalign=0, seed=seed)
    arena = Arena(np.random.default_rng(seed), xp)
    state = _compaction_state(arena, c, xp)
    before = [as_bytes(a) for a in state[0] + state[1] + [state[2]]]
    _run_compaction(state, c, backend)
    assert int(state[3][0]) == 1
    assert 0 <= int(state[3][3]) < old
    for b, a in zip(before, state[0] + state[1] + [state[2]]):
        assert np.array_equal(b, as_bytes(a))
    arena.check_canaries()


# --- KV writes -----------------------------------------------------------------------------

@st.composite
def write_cases(draw):
    mode = draw(st.sampled_from(["ragged", "positions", "paged", "nhd"]))
    dtype = draw(dtypes)
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    seq = draw(st.integers(1, 6))
    slots = draw(st.integers(1, 5))
    batch = draw(st.integers(0, 4))
    counts = draw(st.lists(st.integers(0, 4), min_size=batch, max_size=batch))
    pad = draw(st.integers(0, 3))
    heads = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    if mode == "nhd":
        heads = [heads[0]] * len(heads)
        counts = [draw(st.integers(0, 3))] * batch
        pad = 0
    tokens = sum(counts) + pad
    lengths = draw(st.lists(st.integers(0, seq + 1), min_size=batch, max_size=batch))
    rows = list(draw(st.permutations(list(range(slots)) + [-1] * batch))[:batch])
    hostile = draw(st.integers(0, 3)) == 0
    if hostile and batch:  # out-of-range slots / positions must be skipped and counted
        rows[draw(st.integers(0, batch - 1))] = draw(st.sampled_from([slots, slots + 7, -5]))
    positions = draw(st.lists(st.integers(-1, seq - 1), min_size=tokens, max_size=tokens))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    for b in range(batch):  # one token per (row, position): duplicates would race on a GPU
        seen = set()
        for t in range(offsets[b], offsets[b + 1]):
            if positions[t] in seen:
                positions[t] = -1
            seen.add(positions[t])
    if hostile and tokens:
        positions[draw(st.integers(0, tokens - 1))] = draw(st.sampled_from([seq, -9]))
    width = draw(st.integers(1, 3))
    table = list(draw(st.permutations(list(range(slots)) + [-1] * batch * width))
                 [:batch * width])
    if hostile and table:
        table[draw(st.integers(0, len(table) - 1))] = draw(st.sampled_from([slots, -4]))
    return dict(mode=mode, dtype=dtype, head_dim=head_dim, seq=seq, slots=slots, batch=batch,
                counts=counts, tokens=tokens, heads=heads, lengths=lengths, rows=rows,
                positions=positions, width=width, table=table,
                single=draw(st.booleans()), layer=draw(st.integers(0, len(heads) - 1)),
                misalign=draw(misaligns), seed=draw(st.integers(0, 2**32 - 1)))


def _write_state(arena, c, xp):
    dt, d, s = c["dtype"], c["head_dim"], c["seq"]
    mis = c["misalign"] * dt.itemsize
    if c["mode"] == "nhd":
        buf = arena.array((c["slots"], 2, len(c["heads"]), s, c["heads"][0], d), dt,
                          misalign=mis)
        layers = [buf[:, :, i] for i in range(len(c["heads"]))]
        group, keep = KVGroup(layers, layout="NHD"), [buf]
    else:
        layers = [arena.array((c["slots"], 2, h, s, d), dt, misalign=mis) for h in c["heads"]]
        group, keep = KVGroup(layers), layers
    k = [arena.array((c["tokens"], h, d), dt) for h in c["heads"]]
    v = [arena.array((c["tokens"], h, d), dt) for h in c["heads"]]

    def i32(values, shape=None):
        a = arena.array((len(values),) if shape is None else shape, np.int32)
        a[...] = _to(xp, np.asarray(values, np.int32).reshape(a.shape))
        return a

    offsets = i32(np.concatenate([[0], np.cumsum(c["counts"])]).astype(np.int32))
    kwargs = dict(batch=c["batch"], cache_lengths=i32(c["lengths"]))
    if c["mode"] == "nhd":
        kwargs.update(uniform_tokens=max(c["counts"][0] if c["counts"] else 1, 1),
                      row_to_slot=i32(c["rows"]))
    else:
        kwargs["seq_offsets"] = offsets
    if c["mode"] == "ragged":
        kwargs["row_to_slot"] = i32(c["rows"])
    elif c["mode"] == "positions":
        kwargs["positions"] = i32(c["positions"])
        kwargs["row_to_slot"] = i32(c["rows"])
    elif c["mode"] == "paged":
        kwargs["block_table"] = i32(c["table"], (c["batch"], c["width"]))
    status = arena.array((1,), np.int32, fill="zeros")
    return group, keep, k, v, kwargs, status


def _naive_write(c, layers, k, v, layout):
    """Token-by-token model of kernels/kv_write.cu; returns the number of reported tokens."""
    out = [a.copy() for a in layers]
    offsets = np.concatenate([[0], np.cumsum(c["counts"])])
    reported = 0
    for t in range(c["tokens"]):
        rows = [b for b in range(c["batch"]) if offsets[b] <= t < offsets[b + 1]]
        if not rows:  # padding
            continue
        b = rows[0]
        if c["mode"] == "positions":
            pos = c["positions"][t]
        else:
            pos = c["lengths"][b] + t - offsets[b]
        if pos == -1:
            continue
        if pos < 0:
            reported += 1
            continue
        for j, (layer, cap) in enumerate(zip(out, [c["seq"]] * len(out))):
            if c["mode"] == "paged":
                col = pos // cap
                if col >= c["width"]:
                    bad = True
                    slot = None
                else:
                    slot, p, bad = c["table"][b * c["width"] + col], pos % cap, False
            else:
                slot, p, bad = c["rows"][b], pos, False
            if not bad and slot == -1:
                continue
            if bad or not (0 <= slot < c["slots"]) or p >= cap:
                reported += j == 0
                continue
            if layout == "HND":
                layer[slot, 0, :, p] = k[j][t]
                layer[slot, 1, :, p] = v[j][t]
            else:
                layer[slot, 0, p] = k[j][t]
                layer[slot, 1, p] = v[j][t]
    return out, reported


@pytest.mark.parametrize("kind", BACKENDS)
@given(c=write_cases())
def test_kv_write_matches_reference_and_model(kind, c):
    xp, backend = kernel_env(kind)
    ref_arena, k_arena = _twins(c["seed"], xp)
    rg, rkeep, rk, rv, rkw, rstatus = _write_state(ref_arena, c, np)
    kg, kkeep, kk, kv, kkw, kstatus = _write_state(k_arena, c, xp)
    single = c["single"]
    model_c = dict(c)
    if single:
        li = c["layer"]
        args_r = (rk[li], rv[li])
        args_k = (kk[li], kv[li])
    else:
        args_r, args_k = (rk, rv), (kk, kv)
    layers_before = [a.copy() for a in rg.layers]
    ks = [rk[c["layer"]]] if single else rk
    vs = [rv[c["layer"]]] if single else rv
    picked = [layers_before[c["layer"]]] if single else layers_before
    expected, reported = _naive_write(model_c, picked, ks, vs, rg.layout)
    layers = c["layer"] if single else None
    ops.kv_write(rg, *args_r, layers=layers, status=rstatus, **rkw)
    ops.kv_write(kg, *args_k, layers=layers, status=kstatus, backend=backend, **kkw)
    for r, k in zip(rkeep, kkeep):
        _same(r, k)
    assert int(rstatus[0]) == int(kstatus[0])
    if c["tokens"]:
        got = [rg.layers[c["layer"]]] if single else rg.layers
        for e, g in zip(expected, got):
            _same(e, g)
        assert int(rstatus[0]) == reported
    k_arena.check_canaries()


# --- slot copies ---------------------------------------------------------------------------

@st.composite
def slot_copy_cases(draw):
    tensors = draw(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 5),
                                      st.lists(st.integers(1, 6), min_size=0, max_size=3),
                                      dtypes), min_size=1, max_size=3))
    n_src = min(t[0] for t in tensors)
    n_dst = min(t[1] for t in tensors)
    n = draw(st.integers(0, n_dst))
    dst = draw(st.permutations(range(n_dst)))[:n]
    src = draw(st.lists(st.integers(-1, n_src - 1), min_size=n, max_size=n))
    dst = [d if draw(st.integers(0, 6)) else -1 for d in dst]
    if n and draw(st.integers(0, 2)) == 0:
        i = draw(st.integers(0, n - 1))
        (src if draw(st.booleans()) else dst)[i] = draw(st.sampled_from([n_src + n_dst + 3, -7]))
    return dict(tensors=tensors, src=src, dst=dst, misalign=draw(misaligns),
                seed=draw(st.integers(0, 2**32 - 1)))


def _slot_state(arena, c, xp):
    pairs = []
    for ns, nd, shape, dt in c["tensors"]:
        pairs.append((arena.array((ns, *shape), dt, misalign=c["misalign"]),
                      arena.array((nd, *shape), dt)))
    src = arena.array((len(c["src"]),), np.int32)
    dst = arena.array((len(c["dst"]),), np.int32)
    src[...] = _to(xp, np.asarray(c["src"], np.int32))
    dst[...] = _to(xp, np.asarray(c["dst"], np.int32))
    return pairs, src, dst, arena.array((1,), np.int32, fill="zeros")


@pytest.mark.parametrize("kind", BACKENDS)
@given(c=slot_copy_cases())
def test_slot_copy_matches_reference_and_model(kind, c):
    xp, backend = kernel_env(kind)
    ref_arena, k_arena = _twins(c["seed"], xp)
    rp, rs, rd, rstat = _slot_state(ref_arena, c, np)
    kp, ks, kd, kstat = _slot_state(k_arena, c, xp)
    expected = [d.copy() for _, d in rp]
    bad = 0
    for s, d in zip(c["src"], c["dst"]):
        if s == -1 or d == -1:
            continue
        for j, (src, dst) in enumerate(rp):
            if 0 <= s < src.shape[0] and 0 <= d < dst.shape[0]:
                expected[j][d] = src[s]
            elif j == 0:
                bad += 1
    ops.slot_copy(SlotSet(rp), rs, rd, status=rstat)
    ops.slot_copy(SlotSet(kp), ks, kd, status=kstat, backend=backend)
    for (_, r), (_, k), e in zip(rp, kp, expected):
        _same(r, k)
        _same(e, r)
    assert int(rstat[0]) == int(kstat[0]) == bad
    k_arena.check_canaries()


# --- prompt-cache capture / restore --------------------------------------------------------

@st.composite
def prefix_cases(draw):
    seq = draw(st.integers(1, 6))
    return dict(dtype=draw(dtypes), head_dim=draw(st.sampled_from(HEAD_DIMS)), seq=seq,
                slots=draw(st.integers(1, 4)),
                heads=draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)),
                slot=draw(st.integers(-2, 5)), n=draw(st.integers(0, seq + 2)),
                misalign=draw(misaligns), seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("to_cache", [False, True], ids=["capture", "restore"])
@given(c=prefix_cases())
def test_prefix_copy_matches_reference_and_model(kind, to_cache, c):
    xp, backend = kernel_env(kind)
    ref_arena, k_arena = _twins(c["seed"], xp)
    n = min(c["n"], c["seq"] + 2)

    def state(arena):
        layers = [arena.array((c["slots"], 2, h, c["seq"], c["head_dim"]), c["dtype"],
                              misalign=c["misalign"] * c["dtype"].itemsize)
                  for h in c["heads"]]
        compact = [arena.array((2, h, n, c["head_dim"]), c["dtype"]) for h in c["heads"]]
        return layers, compact, arena.array((1,), np.int32, fill="zeros")

    rl, rc, rstat = state(ref_arena)
    kl, kc, kstat = state(k_arena)
    valid = 0 <= c["slot"] < c["slots"] and n <= c["seq"]
    exp_l, exp_c = [a.copy() for a in rl], [a.copy() for a in rc]
    if valid:
        for layer, saved in zip(exp_l, exp_c):
            if to_cache:
                layer[c["slot"], :, :, :n] = saved
            else:
                saved[...] = layer[c["slot"], :, :, :n]
    ops.kv_prefix_copy(KVGroup(rl), c["slot"], n, rc, to_cache=to_cache, status=rstat)
    ops.kv_prefix_copy(KVGroup(kl), c["slot"], n, kc, to_cache=to_cache, status=kstat,
                       backend=backend)
    for r, k, e in zip(rl + rc, kl + kc, exp_l + exp_c):
        _same(r, k)
        _same(e, r)
    want_bad = 0 if valid or n == 0 else len(c["heads"])
    assert int(rstat[0]) == int(kstat[0]) == want_bad
    k_arena.check_canaries()


# --- lengths -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", BACKENDS)
@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=8),
       inc=st.one_of(st.integers(-5, 8), st.lists(st.integers(-5, 8), min_size=8, max_size=8)),
       n=st.integers(0, 8), max_len=st.integers(0, 25), seed=st.integers(0, 2**16))
def test_lengths_add_is_all_or_nothing(kind, lengths, inc, n, max_len, seed):
    xp, backend = kernel_env(kind)
    n = min(n, len(lengths))
    arena = Arena(np.random.default_rng(seed), xp)
    cur = arena.array((len(lengths),), np.int32)
    cur[...] = _to(xp, np.asarray(lengths, np.int32))
    status = arena.array((1,), np.int32, fill="zeros")
    if isinstance(inc, list):
        increment = arena.array((8,), np.int32)
        increment[...] = _to(xp, np.asarray(inc, np.int32))
        delta = np.asarray(inc[:n])
    else:
        increment, delta = inc, inc
    want = np.asarray(lengths, np.int64)
    nxt = want[:n] + delta
    refused = n > 0 and bool(((np.asarray(delta) < 0) | (nxt > max_len)).any())
    if not refused:
        want[:n] = nxt
    ops.lengths_add(cur, n, increment, max_len, status=status, backend=backend)
    assert as_bytes(cur).view(np.int32).tolist() == want.tolist()
    assert int(status[0]) == int(refused)
    arena.check_canaries()
