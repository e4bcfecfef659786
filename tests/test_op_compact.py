"""The ``compact`` family (kernels/compact.cu, hcache/ops/compact.py): ``compaction_plan``,
``kv_compact``, ``slots_compact``.

Oracles: the NumPy reference (:mod:`hcache.ops.reference`) must give the kernels' bytes, plan
words and status; both must match a naive scratch-copy model of the compaction. The kernels run
on the host emulation of the real ``.cu`` (``emu``: forward order; ``emu-reverse``: reverse
thread order and 64-bit index paths) and on CuPy (``gpu`` tier); every array sits between
canary bytes, which must survive whatever the indices say.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hcache import ops
from hcache.dtypes import DTYPE_NAMES, resolve_dtype
from hcache.ops.tables import CLEAR, TMP, KVGroup, SlotSet, plan_schedule

from helpers import host
from kernel_cases import (
    BACKENDS,
    HEAD_DIMS,
    WITH_REFERENCE,
    Arena,
    as_bytes,
    assert_same_bytes,
    bad_mappings,
    dtypes,
    injective_mappings,
    int32_on,
    kernel_env,
    misaligns,
    on,
    twins,
)

# --- random cases: kernels against the reference and a naive model ---------------------------


@st.composite
def compaction_cases(draw, components=(2,)):
    """A compaction of caches with ``components`` (2: K and V, 1: latent) planes."""
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
                components=draw(st.sampled_from(components)),
                lengths=np.asarray(lengths, np.int32), mamba=mamba,
                misalign=draw(misaligns), seed=draw(st.integers(0, 2**32 - 1)))


def _compaction_state(arena, c, xp):
    layers = [arena.array((c["max_batch"], c.get("components", 2), h, c["seq"], c["head_dim"]),
                          c["dtype"],
                          misalign=c["misalign"] * c["dtype"].itemsize) for h in c["heads"]]
    states = [arena.array((c["max_batch"], *shape), dt, misalign=c["misalign"])
              for shape, dt in c["mamba"]]
    lengths = arena.array((c["max_batch"],), np.int32)
    lengths[...] = on(xp, c["lengths"])
    plan = arena.array((ops.compaction_plan_size(c["max_batch"]),), np.int32, fill="zeros")
    mapping = arena.array((max(c["old"], 1),), np.int32)
    mapping[: c["old"]] = on(xp, c["mapping"])
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
    """Plan + kv_compact + slots_compact on random injective mappings: the kernels' caches,
    states, lengths and plan words equal the reference's, which equal the scratch-copy model."""
    xp, backend = kernel_env(kind)
    ref_arena, k_arena = twins(c["seed"], xp)
    ref_state = _compaction_state(ref_arena, c, np)
    k_state = _compaction_state(k_arena, c, xp)
    expected = _naive_compaction(ref_state[0], ref_state[1], ref_state[2], c["mapping"],
                                 c["new"], c["seq"])
    _run_compaction(ref_state, c, None)
    _run_compaction(k_state, c, backend)
    for r, k in zip(ref_state[0] + ref_state[1] + [ref_state[2], ref_state[3]],
                    k_state[0] + k_state[1] + [k_state[2], k_state[3]]):
        assert_same_bytes(r, k)
    for e, r in zip(expected[0] + expected[1] + [expected[2]],
                    ref_state[0] + ref_state[1] + [ref_state[2]]):
        assert_same_bytes(e, r)
    k_arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=60)
@given(c=compaction_cases(components=(1,)))
def test_latent_compaction_matches_reference_and_model(kind, c):
    """Latent caches (``[slots, 1, H, S, D]``): the kernels move each kept slot's one plane
    exactly as the reference and the scratch-copy model, and touch nothing past the buffers
    (a two-plane stride would run off the end of the last slot)."""
    test_compaction_matches_reference_and_model.hypothesis.inner_test(kind, c)


class _OneSmallBlock:
    """A backend that launches the copy kernels with one block of 32 threads along their tiled
    axis (z of ``hc_kv_compact``, x of ``hc_slots_compact``; tiles of 128 chunks), so the block
    strides over every tile of every span; the plan kernel runs as asked."""

    def __init__(self, inner):
        self.inner = inner

    def launch(self, family, name, grid, block, args):
        if name == "hc_kv_compact":
            grid, block = (*grid[:2], 1), (32, 1, 1)
        elif name == "hc_slots_compact":
            grid, block = (1, *grid[1:]), (32, 1, 1)
        self.inner.launch(family, name, grid, block, args)


@st.composite
def long_compaction_cases(draw):
    """Compactions whose KV spans and states cover from under one tile to many (up to 40
    tokens of up to 512 elements, states of up to 90 x 6 elements), every dtype, head dim and
    alignment, spans ending in a partial chunk, and lengths from 0 (an empty span) to past the
    cache."""
    c = draw(compaction_cases(components=(1, 2)))
    # a multiple of 16 tokens keeps the head spans 16-byte aligned for any row size, so a span
    # of an odd length ends in a partial chunk
    seq = draw(st.one_of(st.integers(1, 40), st.sampled_from([16, 32])))
    lengths = draw(st.lists(st.integers(0, seq), min_size=c["max_batch"],
                            max_size=c["max_batch"]))
    if draw(st.booleans()):  # a length the kernel must clamp to [0, S]
        lengths[draw(st.integers(0, c["max_batch"] - 1))] = draw(st.sampled_from([-3, seq + 4]))
    mamba = draw(st.lists(st.tuples(st.lists(st.integers(1, 90), min_size=1, max_size=2)
                                    .map(lambda s: [s[0], *[min(x, 6) for x in s[1:]]]),
                                    dtypes), min_size=0, max_size=2))
    return dict(c, seq=seq, heads=c["heads"][:2], lengths=np.asarray(lengths, np.int32),
                mamba=mamba)


@pytest.mark.emu
@pytest.mark.parametrize("kind", ["emu", "emu-reverse"])
@settings(max_examples=40)
@given(c=long_compaction_cases(), small=st.booleans())
def test_compaction_of_spans_of_many_tiles_matches_the_model(kind, c, small):
    """Spans of many tiles (a partial last one, misaligned starts, tiny and empty spans), run
    by the launch the wrapper picks or by one small block that strides over every tile: the
    caches, states and lengths equal the scratch-copy model's and the reference's."""
    xp, backend = kernel_env(kind)
    ref_arena, k_arena = twins(c["seed"], xp)
    ref_state = _compaction_state(ref_arena, c, np)
    k_state = _compaction_state(k_arena, c, xp)
    expected = _naive_compaction(ref_state[0], ref_state[1], ref_state[2], c["mapping"],
                                 c["new"], c["seq"])
    _run_compaction(ref_state, c, None)
    _run_compaction(k_state, c, _OneSmallBlock(backend) if small else backend)
    for e, r, k in zip(expected[0] + expected[1] + [expected[2]],
                       ref_state[0] + ref_state[1] + [ref_state[2]],
                       k_state[0] + k_state[1] + [k_state[2]]):
        assert_same_bytes(e, r)
        assert_same_bytes(e, k)
    k_arena.check_canaries()


@pytest.mark.emu
@pytest.mark.parametrize("kind", ["emu", "emu-reverse"])
@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("head_dim", [3, 36])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_compaction_of_spans_ending_in_a_partial_chunk(kind, small, head_dim, dtype):
    """16-byte aligned head spans (32 tokens) whose moved prefixes end inside a chunk (rows of
    3 or 36 elements, odd lengths; up to two tiles of one small block), through two cycles and
    a chain: the bytes equal the scratch-copy model's and the reference's."""
    xp, backend = kernel_env(kind)
    c = dict(max_batch=6, old=6, new=5, mapping=[2, 0, 1, -1, 4, 3], dtype=resolve_dtype(dtype),
             head_dim=head_dim, seq=32, heads=[2], components=2,
             lengths=np.asarray([31, 17, 5, 9, 32, 33], np.int32), mamba=[((7,), np.uint8)],
             misalign=0, seed=head_dim)
    ref_arena, k_arena = twins(c["seed"], xp)
    ref_state = _compaction_state(ref_arena, c, np)
    k_state = _compaction_state(k_arena, c, xp)
    expected = _naive_compaction(ref_state[0], ref_state[1], ref_state[2], c["mapping"],
                                 c["new"], c["seq"])
    _run_compaction(ref_state, c, None)
    _run_compaction(k_state, c, _OneSmallBlock(backend) if small else backend)
    for e, r, k in zip(expected[0] + expected[1] + [expected[2]],
                       ref_state[0] + ref_state[1] + [ref_state[2]],
                       k_state[0] + k_state[1] + [k_state[2]]):
        assert_same_bytes(e, r)
        assert_same_bytes(e, k)
    k_arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@given(bad=bad_mappings(), seed=st.integers(0, 2**32 - 1), dtype=dtypes)
def test_invalid_mapping_moves_nothing(kind, bad, seed, dtype):
    """A mapping that is not injective into [0, new_batch): the kernel's plan says status 1 and
    the first offending index, and the copy kernels change no byte (model: nothing moves)."""
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


@st.composite
def arbitrary_plans(draw):
    mb = draw(st.integers(1, 4))
    size = ops.compaction_plan_size(mb)
    words = draw(st.lists(st.integers(-4, mb + 1), min_size=size, max_size=size))
    words[0] = 0
    words[1] = draw(st.integers(-2, 3 * mb + 4))
    words[2] = draw(st.integers(-2, 7))
    return dict(mb=mb, words=words, seed=draw(st.integers(0, 2**16)),
                lengths=draw(st.lists(st.integers(-2, 7), min_size=mb, max_size=mb)))


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=30)
@given(c=arbitrary_plans())
def test_compaction_kernels_match_the_reference_for_any_plan_contents(kind, c):
    """Plans of arbitrary words (not made by compaction_plan): kv_compact and slots_compact give
    the reference's bytes (out-of-range entries skipped) and keep the canaries."""
    # Whatever the (unchecked, device-side) plan says, the kernels stay inside their buffers
    # and do what the reference does: out-of-range entries are skipped.
    xp, backend = kernel_env(kind)
    out = []
    for mod, be in ((np, None), (xp, backend)):
        arena = Arena(np.random.default_rng(c["seed"]), mod)
        layer = arena.array((c["mb"], 2, 2, 5, 6), np.uint8, misalign=2)
        state = arena.array((c["mb"], 3), np.float16)
        plan = arena.array((len(c["words"]),), np.int32)
        plan[...] = int32_on(mod, c["words"])
        lengths = arena.array((c["mb"],), np.int32)
        lengths[...] = int32_on(mod, c["lengths"])
        ops.kv_compact(KVGroup([layer]), plan, lengths, backend=be)
        ops.slots_compact(SlotSet([(state, state)]), plan, backend=be)
        arena.check_canaries()
        out.append((as_bytes(layer), as_bytes(state)))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_array_equal(out[0][1], out[1][1])


# --- every dtype x the head dims the issue names: kernels against a fixed model --------------

@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("head_dim", (8, 36, 80, 96, 512))
def test_compaction_with_a_cycle_chains_and_holes(kind, dtype, head_dim):
    """A fixed mapping with a cycle, chains, evictions and a hole, per dtype and head dim:
    the kernels' caches, states and lengths equal the hand-written expected moves."""
    # 6 slots: 0->3, 1 evicted, 2->0, 3->2 (cycle 0->3->2->0), 4->1, 5 evicted; new batch 5,
    # so slot 4 is a hole. Lengths differ so each move copies its own prefix.
    xp, backend = kernel_env(kind)
    dt = resolve_dtype(dtype)
    arena = Arena(np.random.default_rng(head_dim), xp)
    layers = [arena.array((6, 2, h, 5, head_dim), dt, misalign=dt.itemsize) for h in (2, 1)]
    state = arena.array((6, 3, 7), dt)
    lengths = arena.int32([5, 1, 3, 0, 2, 4])
    mapping = arena.int32([3, -1, 0, 2, 1, -1])
    plan = arena.array((ops.compaction_plan_size(6),), np.int32, fill="zeros")
    before_layers = [host(a).copy() for a in layers]
    before_state = host(state).copy()
    ops.compaction_plan(mapping, 6, 5, plan, lengths=lengths, backend=backend)
    ops.kv_compact(KVGroup(layers), plan, lengths, backend=backend)
    ops.slots_compact(SlotSet([(state, state), (lengths, lengths)]), plan, backend=backend)
    moves = {0: 3, 2: 0, 3: 2, 4: 1}
    old_len = [5, 1, 3, 0, 2, 4]
    for layer, before in zip(layers, before_layers):
        want = before.copy()
        for old, new in moves.items():
            n = old_len[old]
            want[new, :, :, :n] = before[old, :, :, :n]
        assert np.array_equal(as_bytes(layer), as_bytes(want))
    want_state = before_state.copy()
    for old, new in moves.items():
        want_state[new] = before_state[old]
    want_state[4] = 0
    assert np.array_equal(as_bytes(state), as_bytes(want_state))
    assert host(lengths).tolist() == [3, 2, 0, 5, 0, 4]
    arena.check_canaries()


# --- the plan's format and schedule (reference, hand-computed) -------------------------------

def _plan(mapping, old, new, max_batch, lengths=None):
    plan = np.zeros(ops.compaction_plan_size(max_batch), np.int32)
    ops.compaction_plan(np.asarray(mapping, np.int32), old, new, plan,
                        lengths=None if lengths is None else np.asarray(lengths, np.int32))
    return plan


def test_plan_of_monotone_mapping_is_ascending_chains_without_scratch():
    """Reference plan of a monotone mapping against the hand-computed schedule: ascending
    moves, no TMP entry, the longest moved span in plan[2]."""
    # TensorRT-Edge-LLM's buildBatchMapping: survivors 1, 2, 4 of 5 move down in order.
    plan = _plan([-1, 0, 1, -1, 2], 5, 3, 6, lengths=[4, 3, 7, 1, 2, 0])
    assert plan[0] == 0
    assert plan_schedule(plan).tolist() == [[1, 0], [2, 1], [4, 2]]
    assert plan[2] == 7  # longest moved span
    assert TMP not in plan_schedule(plan)


def test_plan_of_swap_saves_one_slot_to_registers():
    """Reference plan of a swap against the hand-computed schedule (save, move, restore)."""
    plan = _plan([1, 0], 2, 2, 2)
    assert plan_schedule(plan).tolist() == [[0, TMP], [1, 0], [TMP, 1]]


def test_plan_marks_holes_for_clearing_last():
    """Reference plan with holes below new_batch: CLEAR entries come after every move."""
    plan = _plan([2, -1], 2, 3, 4)
    assert plan_schedule(plan).tolist() == [[0, 2], [CLEAR, 0], [CLEAR, 1]]


@pytest.mark.parametrize("mapping,old,new,status,bad", [
    ([0, 0], 2, 2, 1, 1),       # duplicate target
    ([0, 2], 2, 2, 1, 1),       # target >= new_batch
    ([-2, 0], 2, 2, 1, 0),      # below -1
    ([0], 1, 5, 2, -1),         # new_batch > max_batch
])
def test_invalid_plans_are_flagged(mapping, old, new, status, bad):
    """Reference plan header of invalid mappings against the documented status codes."""
    plan = _plan(mapping, old, new, 4)
    assert plan[0] == status and plan[3] == bad and plan[1] == 0


@given(case=injective_mappings())
def test_schedule_moves_every_slot_like_a_scratch_copy(case):
    """Replaying the reference schedule on slot labels gives the scratch-copy result; a
    monotone mapping needs no TMP entry."""
    max_batch, old, new, mapping = case
    plan = _plan(mapping, old, new, max_batch)
    slots = list(range(max_batch))  # slot contents are their original labels
    tmp = None
    for src, dst in plan_schedule(plan):
        if dst == TMP:
            tmp = slots[src]
        elif src == TMP:
            slots[dst] = tmp
        elif src == CLEAR:
            slots[dst] = None
        else:
            slots[dst] = slots[src]
    want = list(range(max_batch))
    for o, n in enumerate(mapping):
        if n >= 0:
            want[n] = o
    for j in range(new):
        if j not in mapping:
            want[j] = None
    assert slots == want
    monotone = all(n <= o for o, n in enumerate(mapping) if n >= 0) and \
        list(n for n in mapping if n >= 0) == sorted(n for n in mapping if n >= 0)
    if monotone:
        assert TMP not in plan_schedule(plan)


def test_kv_compact_moves_only_each_slots_own_prefix():
    """Reference kv_compact against a hand-computed cache: only the source's own prefix moves."""
    cache = np.arange(3 * 2 * 1 * 4 * 2, dtype=np.float32).reshape(3, 2, 1, 4, 2)
    lengths = np.array([2, 0, 3], np.int32)
    before = cache.copy()
    plan = _plan([-1, -1, 0], 3, 1, 3, lengths=lengths)
    ops.kv_compact(KVGroup([cache]), plan, lengths)
    want = before.copy()
    want[0, :, :, :3] = before[2, :, :, :3]  # token 3 of slot 0 is stale and stays
    np.testing.assert_array_equal(cache, want)


def test_slots_compact_moves_lengths_and_zeroes_holes():
    """Reference slots_compact against hand-computed states and lengths (holes zeroed)."""
    lengths = np.array([5, 6, 7], np.int32)
    state = np.arange(6, dtype=np.float16).reshape(3, 2)
    plan = _plan([1, -1, 2], 3, 3, 3)
    ops.slots_compact(SlotSet([(state, state), (lengths, lengths)]), plan)
    assert lengths.tolist() == [0, 5, 7]
    assert state.tolist() == [[0, 0], [0, 1], [4, 5]]


# --- edge cases every path handles alike (reference and kernels) -----------------------------

@pytest.mark.parametrize("kind", WITH_REFERENCE)
@pytest.mark.parametrize("plan_lengths", ["none", "shorter", "same"])
def test_kv_compact_moves_at_most_the_plans_longest_span(kind, plan_lengths):
    """kv_compact moves min(lengths[src], plan[2]) tokens (model), whether the plan was built
    without lengths, with shorter ones or with the same ones; reference and kernels alike."""
    # The kernel only visits offsets below the plan's max length (plan[2]); the reference used
    # to move lengths[src] tokens regardless, so a plan built without (or with other) lengths
    # gave different bytes on cpu and cuda.
    xp, backend = kernel_env(kind)
    rng = np.random.default_rng(7)
    # Rows of 6 bytes in spans of 4 * 6 = 24: 8-byte chunks, so a limit of one token (6
    # bytes) ends inside a chunk.
    host_cache = rng.integers(0, 256, (4, 2, 2, 4, 6), dtype=np.uint8)
    lengths = np.array([3, 4, 2, 3], np.int32)
    plan_len = {"none": None, "shorter": np.array([1, 1, 1, 1], np.int32),
                "same": lengths}[plan_lengths]
    mapping = np.array([1, 0, -1, 2], np.int32)      # swap 0 <-> 1 (a cycle), 3 -> 2
    layer = on(xp, host_cache.copy())
    plan = xp.zeros(ops.compaction_plan_size(4), np.int32)
    ops.compaction_plan(on(xp, mapping), 4, 3, plan,
                        lengths=None if plan_len is None else on(xp, plan_len),
                        backend=backend)
    ops.kv_compact(KVGroup([layer]), plan, on(xp, lengths), backend=backend)
    # Model: new[mapping[i]] = old[i] for min(lengths[i], longest planned span) tokens.
    limit = 0 if plan_len is None else max(int(plan_len[i]) for i in (0, 1, 3))
    want = host_cache.copy()
    for old, new in enumerate(mapping):
        if new >= 0:
            n = min(int(lengths[old]), limit)
            want[new, :, :, :n] = host_cache[old, :, :, :n]
    np.testing.assert_array_equal(as_bytes(layer), want.reshape(-1))


@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_compaction_wrappers_check_the_plan_against_the_tensors(kind):
    """A plan for more slots than the tensors have, or of a wrong length, raises ValueError
    before any byte moves; reference and kernels alike."""
    # A plan for more slots than the tensors have used to make the reference raise IndexError
    # half-way (after moving some slots) while the kernel silently skipped those moves.
    xp, backend = kernel_env(kind)
    host_cache = np.arange(4 * 2 * 1 * 2 * 4, dtype=np.uint8).reshape(4, 2, 1, 2, 4)
    layer = on(xp, host_cache.copy())
    state = on(xp, np.arange(4, dtype=np.float32))
    lengths = int32_on(xp, [2] * 8)
    plan = xp.zeros(ops.compaction_plan_size(8), np.int32)
    ops.compaction_plan(int32_on(xp, [5, 0, 1, 2, 3, 4]), 6, 6, plan, lengths=lengths,
                        backend=backend)
    with pytest.raises(ValueError, match="plan: expected a plan for at most 4 slots"):
        ops.kv_compact(KVGroup([layer]), plan, lengths, backend=backend)
    with pytest.raises(ValueError, match="plan: expected a plan for at most 4 slots"):
        ops.slots_compact(SlotSet([(state, state)]), plan, backend=backend)
    with pytest.raises(ValueError, match="plan: expected length 4 \\+ 8 \\* max_batch"):
        ops.kv_compact(KVGroup([layer]), plan[:-1], lengths, backend=backend)
    with pytest.raises(ValueError, match="plan: expected length 4 \\+ 8 \\* max_batch"):
        ops.slots_compact(SlotSet([(state, state)]), plan[:-3], backend=backend)
    np.testing.assert_array_equal(as_bytes(layer), host_cache.reshape(-1))
    np.testing.assert_array_equal(as_bytes(state).view(np.float32), np.arange(4))


@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_compaction_never_reads_schedule_entries_past_the_plan(kind):
    """A plan whose count claims more entries than its schedule holds: the words past the plan
    (a move 0 -> 1) are never run; reference and kernels leave every byte as it was."""
    # plan[1] (the entry count) is device data; a plan that did not come from compaction_plan
    # may claim more entries than its schedule holds. The kernels used to read them from past
    # the end of the plan buffer. Here the words after the plan hold a move 0 -> 1.
    xp, backend = kernel_env(kind)
    size = ops.compaction_plan_size(2)          # schedule capacity: 3 * 2 = 6 (src, dst) pairs
    words = np.full(size + 16, -7, np.int32)    # -7: no slot, skipped
    words[:4] = (0, 6 + 8, 1, -1)               # valid, 14 entries, max length 1
    words[size:] = np.tile([0, 1], 8)           # past the plan: 0 -> 1
    buf = on(xp, words)
    plan = buf[:size]
    cache = np.zeros((2, 2, 1, 1, 4), np.uint8)
    cache[0] = 9
    layer = on(xp, cache.copy())
    state = on(xp, np.array([[1.0], [2.0]], np.float32))
    ops.kv_compact(KVGroup([layer]), plan, int32_on(xp, [1, 1]), backend=backend)
    ops.slots_compact(SlotSet([(state, state)]), plan, backend=backend)
    np.testing.assert_array_equal(as_bytes(layer), cache.reshape(-1))
    np.testing.assert_array_equal(as_bytes(state).view(np.float32), [1.0, 2.0])


@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_compaction_plan_scalars_outside_c_int_raise(kind):
    """compaction_plan with a batch size outside C int raises ValueError and writes nothing to
    the plan; reference and kernels alike."""
    xp, backend = kernel_env(kind)
    plan = xp.zeros(ops.compaction_plan_size(2), np.int32)
    with pytest.raises(ValueError, match="new_batch: expected"):
        ops.compaction_plan(int32_on(xp, [0]), 1, 2**40, plan, backend=backend)
    assert not as_bytes(plan).any()


# --- the block-wide plan (issue 22): every word equals the serial definition's ----------------

@st.composite
def plan_inputs(draw):
    """``(max_batch, old_batch, new_batch, mapping, lengths)`` up to 1100 slots (past 1024 the
    kernel's serial path): monotone compactions (one long chain), permutations (cycles of any
    length, fixed points), mixtures with evictions and holes, and a mapping spoiled at a random
    place (out of range or a duplicate) a quarter of the time."""
    max_batch = draw(st.sampled_from([1, 2, 31, 33, 200, 1023, 1024, 1100]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old_batch = int(rng.integers(0, max_batch + 1))
    shape = draw(st.sampled_from(["monotone", "permutation", "mixed"]))
    keep = rng.random(old_batch) < (1.0 if shape == "permutation" else rng.random())
    kept = np.flatnonzero(keep)
    if shape == "monotone":
        new_batch = len(kept)
        targets = np.arange(new_batch)
    else:
        new_batch = int(rng.integers(len(kept), max_batch + 1))
        targets = rng.permutation(new_batch)[:len(kept)]
    mapping = np.full(old_batch, -1, np.int32)
    mapping[kept] = targets
    if old_batch and draw(st.integers(0, 3)) == 0:
        i = int(rng.integers(old_batch))
        if len(kept) >= 2 and rng.integers(2):
            j = int(kept[rng.integers(len(kept))])
            if j != i:
                mapping[i] = mapping[j]
        else:
            mapping[i] = new_batch + int(rng.integers(0, 3))
    lengths = rng.integers(-2, 5000, max_batch).astype(np.int32)
    return max_batch, old_batch, new_batch, mapping, lengths


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(c=plan_inputs())
def test_compaction_plan_words_equal_the_reference_at_any_size(kind, c):
    """Plans of up to 1100 slots (block-wide up to 1024, serial past it), valid or spoiled: every
    word (status, count, longest span, offender, inverse mapping, done flags and the schedule
    in order) equals the reference's, the serial definition."""
    xp, backend = kernel_env(kind)
    max_batch, old, new, mapping, lengths = c
    want = np.zeros(ops.compaction_plan_size(max_batch), np.int32)
    ops.compaction_plan(mapping, old, new, want, lengths=lengths)
    plan = xp.full(ops.compaction_plan_size(max_batch), 0, np.int32)
    ops.compaction_plan(on(xp, mapping), old, new, plan, lengths=on(xp, lengths),
                        backend=backend)
    got = as_bytes(plan).view(np.int32)
    count = 4 + 2 * max_batch + 2 * int(want[1])
    assert got[:count].tolist() == want[:count].tolist()
