"""Speculative decoding on the contiguous-slot managers: ``commit_draft`` with ``DraftStates``
(docs/design.md §4.13).

Oracle: a second manager of the same config that only ever writes the accepted tokens (a
ragged ``write_kv`` of the kept rows, the live state set to the state after the last kept
token, ``commit_sequence_length(kept)``). After every step of random accept patterns (0,
partial, all ``k``; with and without a bonus token) the speculative manager's lengths, the valid
prefix of every KV cache and every live state equal the oracle's, byte for byte, for every layer
kind (attention, latent MLA, shared KV, Mamba with both states, short convolutions, lightning
attention, attention-and-Mamba, cache-less) and every dtype; on the NumPy reference, on the real
kernels (host emulation) and on the emulated device with device-resident counts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hcache import DraftStates
from hcache.config.caches import (
    HybridCacheConfig,
    KVCacheConfig,
    KVLayerConfig,
    LayerType,
    LinearCacheConfig,
    MambaCacheConfig,
)
from hcache.dtypes import DTYPE_NAMES
from hcache.slots.hybrid import HybridCacheManager
from hcache.slots.linear import LinearKVCache

from helpers import host, put

A, M, AM, N = (LayerType.ATTENTION, LayerType.MAMBA, LayerType.ATTENTION_AND_MAMBA,
               LayerType.NONE)
B, S, K = 4, 48, 4


def _hybrid(kind, kv_dtype, ssm_dtype, conv_dtype, device):
    if kind == "mamba2":
        types = [M, A, AM, N, A, M]
        mamba = MambaCacheConfig(3, B, 2, 4, 3, 6, 4, ssm_dtype=ssm_dtype, conv_dtype=conv_dtype)
        kv = [KVLayerConfig(2, 8), KVLayerConfig(1, 12), KVLayerConfig(1, 10, components=1)]
        sharing = None
    elif kind == "short_conv":   # LFM2: conv state only
        types = [M, A, M, A]
        mamba = MambaCacheConfig(2, B, 0, 0, 0, 6, 3, conv_dtype=conv_dtype)
        kv = [KVLayerConfig(2, 8)]
        sharing = {3: 1}
    elif kind == "lightning":    # MiniMax: recurrent state only
        types = [M, A, M]
        mamba = MambaCacheConfig(2, B, 2, 4, 4, 0, 0, ssm_dtype=ssm_dtype)
        kv = [KVLayerConfig(1, 16)]
        sharing = None
    else:                        # attention only
        types = [A, A]
        mamba = None
        kv = [KVLayerConfig(2, 8), KVLayerConfig(1, 6, components=1)]
        sharing = None
    cfg = HybridCacheConfig(types, KVCacheConfig(B, S, kv, dtype=kv_dtype), mamba, B,
                            kv_sharing=sharing)
    return HybridCacheManager(cfg, device=device)


def _linear(kv_dtype, ssm_dtype, conv_dtype, device):
    cfg = LinearCacheConfig(2, B, S, 2, 8, dtype=kv_dtype, num_mamba_layers=2, mamba_num_heads=2,
                            mamba_head_dim=4, ssm_state_size=3, ssm_dtype=ssm_dtype, conv_dim=5,
                            conv_kernel=4, conv_dtype=conv_dtype)
    return LinearKVCache(cfg, device=device)


class Layout:
    """What the engine of a test needs of a manager: the cache-owning attention layers (write
    index, view, components) and the live / draft state tensors, in the same order."""

    def __init__(self, m, drafts):
        self.m = m
        if isinstance(m, LinearKVCache):
            c = m.config
            self.kv = [(i, m.get_combined_kv_cache_for_decoder_layer(i), 2)
                       for i in range(c.num_attention_layers)]
            mamba = list(range(c.num_mamba_layers))
            rec = (m.get_ssm_state_for_layer, m._mamba is not None
                   and m._mamba.config.has_recurrent_state)
            conv = (m.get_conv_state_for_layer, m._mamba is not None
                    and m._mamba.config.has_conv_state)
        else:
            c = m.config
            owners = [i for i, t in enumerate(c.layer_types)
                      if t.has_attention and i not in c.kv_sharing]
            self.kv = [(i, m.get_combined_kv_cache(i), lc.components)
                       for i, lc in zip(owners, c.kv.layer_configs)]
            mamba = [i for i, t in enumerate(c.layer_types) if t.has_mamba]
            rec = (m.get_recurrent_state, c.mamba is not None and c.mamba.has_recurrent_state)
            conv = (m.get_conv_state, c.mamba is not None and c.mamba.has_conv_state)
        self.live, self.draft = [], []
        for (get, has), dget in ((rec, "get_recurrent_draft"), (conv, "get_conv_draft")):
            if has:
                for i in mamba:
                    self.live.append(get(i))
                    if drafts is not None:
                        self.draft.append(getattr(drafts, dget)(i))


def _rows(rng, shape, dtype):
    """Random bytes of ``dtype`` shaped ``shape`` (host)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(dtype).reshape(shape)


def _step(spec, ref, rng, written, bonus, accepted, device_counts):
    """One verify step: the engine writes ``written`` tokens and their states into ``spec``
    (drafts) and only the kept ones into ``ref``; both commit."""
    n = spec.m.active_batch_size
    kept = accepted + int(bonus)
    ks, vs, rks, rvs = [], [], [], []
    for (_, view, comps), (_, _, _) in zip(spec.kv, ref.kv):
        heads, dim = view.shape[2], view.shape[4]
        k = _rows(rng, (n, written, heads, dim), view.dtype)
        v = _rows(rng, (n, written, heads, dim), view.dtype) if comps == 2 else None
        ks.append(k)
        vs.append(v)
        rks.append(np.concatenate([k[b, :kept[b]] for b in range(n)]))
        rvs.append(None if v is None else np.concatenate([v[b, :kept[b]] for b in range(n)]))
    xp = spec.m.device.xp
    if written and spec.kv:
        spec.m.write_kv(None, [xp.asarray(k) for k in ks],
                        [None if v is None else xp.asarray(v) for v in vs])
    if kept.sum() and ref.kv:
        ref.m.write_kv(None, [xp.asarray(k) for k in rks],
                       [None if v is None else xp.asarray(v) for v in rvs],
                       seq_lengths=[int(x) for x in kept])
    for live, draft, ref_live in zip(spec.live, spec.draft, ref.live):
        states = _rows(rng, (n, written) + tuple(live.shape[1:]), live.dtype)
        put(draft[:n, :written], states)
        want = host(ref_live)
        for b in range(n):
            if kept[b]:
                want[b] = states[b, kept[b] - 1]
        put(ref_live, want)
    counts = xp.asarray(accepted.astype(np.int32)) if device_counts else accepted.tolist()
    spec.m.commit_draft(counts, written, draft_states=spec.drafts, bonus_token=bonus)
    ref.m.commit_sequence_length([int(x) for x in kept])


def _assert_same(spec, ref, model_lengths):
    n = spec.m.active_batch_size
    lengths = host(spec.m.get_kv_cache_lengths())
    np.testing.assert_array_equal(lengths, model_lengths)
    np.testing.assert_array_equal(host(ref.m.get_kv_cache_lengths()), model_lengths)
    for (_, a, _), (_, b, _) in zip(spec.kv, ref.kv):
        a, b = host(a), host(b)
        for slot in range(n):
            length = int(model_lengths[slot])
            assert a[slot, :, :, :length].tobytes() == b[slot, :, :, :length].tobytes()
    for a, b in zip(spec.live, ref.live):
        assert host(a).tobytes() == host(b).tobytes()


def _run(make, seed, steps, device_counts=False):
    rng = np.random.default_rng(seed)
    spec_m, ref_m = make(), make()
    drafts = DraftStates(spec_m, K) if spec_m._mamba is not None else None
    spec, ref = Layout(spec_m, drafts), Layout(ref_m, None)
    spec.drafts = drafts
    # The live states start with the same random bytes, so a state that moves shows.
    for a, b in zip(spec.live, ref.live):
        start = _rows(rng, a.shape, a.dtype)
        put(a, start)
        put(b, start)
    n = B - 1
    start = rng.integers(0, 5, n)
    spec_m.reset_for_new_sequences(start.tolist())
    ref_m.reset_for_new_sequences(start.tolist())
    lengths = start.astype(np.int64)
    for step in range(steps):
        bonus = bool(rng.integers(0, 2))
        written = int(rng.integers(int(bonus), K + 1))
        top = written - int(bonus)
        pattern = step % 4
        if pattern == 0:
            accepted = np.zeros(n, np.int64)
        elif pattern == 1:
            accepted = np.full(n, top, np.int64)
        else:
            accepted = rng.integers(0, top + 1, n)
        _step(spec, ref, rng, written, bonus, accepted, device_counts)
        lengths = lengths + accepted + int(bonus)
        _assert_same(spec, ref, lengths)
    return spec_m


KINDS = ["mamba2", "short_conv", "lightning", "attention"]


@pytest.mark.parametrize("kv_dtype", DTYPE_NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_random_accepts_equal_a_run_that_wrote_only_the_accepted(backend, kind, kv_dtype):
    """Every layer kind x every KV dtype (the states in the other dtypes), 8 steps of random
    accept patterns: the caches equal the accepted-only run's after every step."""
    others = [d for d in DTYPE_NAMES if d != kv_dtype]
    ssm, conv = others[DTYPE_NAMES.index(kv_dtype) % len(others)], kv_dtype
    before = len(backend.launches) if backend is not None else 0
    _run(lambda: _hybrid(kind, kv_dtype, ssm, conv, "cpu"), DTYPE_NAMES.index(kv_dtype), 8)
    if backend is not None:
        names = {name for name, _, _ in backend.launches[before:]}
        assert "hc_draft_lengths" in names
        assert ("hc_draft_accept" in names) == (kind != "attention")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_linear_cache_random_accepts(backend, dtype):
    _run(lambda: _linear(dtype, dtype, dtype, "cpu"), 11, 8)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(KINDS),
       kv=st.sampled_from(DTYPE_NAMES), ssm=st.sampled_from(DTYPE_NAMES))
def test_property_random_steps_random_layouts(seed, kind, kv, ssm):
    """Hypothesis: any seed, layout and pair of dtypes, 12 steps: caches equal the oracle's."""
    _run(lambda: _hybrid(kind, kv, ssm, kv, "cpu"), seed, 12)


@pytest.mark.emulated
@pytest.mark.parametrize("kind", ["mamba2", "short_conv", "lightning"])
def test_emulated_device_with_device_counts(emu_rt, kind):
    """On the emulated device (the CUDA path) with device-resident counts: the same equality,
    and no host synchronization by commit_draft."""
    m = _run(lambda: _hybrid(kind, "bfloat16", "float32", "float16", "cuda"), 5, 8,
             device_counts=True)
    drafts = DraftStates(m, 2)
    counts = emu_rt.xp.asarray(np.zeros(m.active_batch_size, np.int32))
    m.commit_draft(counts, 2, draft_states=drafts)
    emu_rt.synchronize()
    syncs, allocations = emu_rt.counters["syncs"], emu_rt.counters["allocations"]
    for _ in range(5):
        m.commit_draft(counts, 2, draft_states=drafts)
    assert emu_rt.counters["syncs"] == syncs
    assert emu_rt.counters["allocations"] == allocations


@pytest.mark.emulated
def test_emulated_out_of_range_device_counts_commit_nothing_and_are_counted(emu_rt):
    """Device counts out of range (negative, more than written, int32 max) are not read on the
    host: those rows keep their state and length, the others commit, and
    refused_commit_count says how many."""
    m = _hybrid("mamba2", "float16", "float32", "float16", "cuda")
    drafts = DraftStates(m, 3)
    m.reset_for_new_sequences([2, 3, 4, 5])
    live = m.get_recurrent_state(0)
    before = host(live).copy()
    d = drafts.get_recurrent_draft(0)
    states = np.arange(np.prod(d.shape), dtype=np.float32).reshape(d.shape)
    put(d, states)
    m.commit_draft(emu_rt.xp.asarray(np.array([-1, 4, 2**31 - 1, 3], np.int32)), 3,
                   draft_states=drafts)
    want = before.copy()
    want[3] = states[3, 2]
    np.testing.assert_array_equal(host(live), want)
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [2, 3, 4, 8])
    assert m.refused_commit_count() == 3


def test_host_counts_out_of_range_raise_and_change_nothing():
    m = _hybrid("mamba2", "float16", "float32", "float16", "cpu")
    drafts = DraftStates(m, 3)
    m.reset_for_new_sequences([2, S - 1])
    live = host(m.get_recurrent_state(0)).copy()
    put(drafts.get_recurrent_draft(0), np.ones(drafts.get_recurrent_draft(0).shape))
    with pytest.raises(ValueError, match=r"accepted\[0\]: expected a count in \[0, 2\], got 3"):
        m.commit_draft([3, 0], 2, draft_states=drafts)
    with pytest.raises(ValueError, match=r"accepted\[1\]: expected a commit within"):
        m.commit_draft([0, 2], 2, draft_states=drafts)
    with pytest.raises(ValueError, match=r"accepted\[0\]: expected a count in \[0, 1\]"):
        m.commit_draft([2, 0], 2, draft_states=drafts, bonus_token=True)
    with pytest.raises(ValueError, match="num_draft_tokens: expected"):
        m.commit_draft([0, 0], 4, draft_states=drafts)
    with pytest.raises(ValueError, match="draft_states: expected this manager's"):
        m.commit_draft([0, 0], 2)
    other = DraftStates(_hybrid("mamba2", "float16", "float32", "float16", "cpu"), 3)
    with pytest.raises(ValueError, match="draft_states: expected the draft states of this"):
        m.commit_draft([0, 0], 2, draft_states=other)
    with pytest.raises(TypeError, match="bonus_token: expected a bool"):
        m.commit_draft([0, 0], 2, draft_states=drafts, bonus_token=1)
    with pytest.raises(TypeError, match="stream"):
        m.commit_draft([0, 0], 2, draft_states=drafts, stream="s")
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [2, S - 1])
    np.testing.assert_array_equal(host(m.get_recurrent_state(0)), live)
    assert m.refused_commit_count() == 0


def test_ring_layers_are_refused():
    cfg = HybridCacheConfig([A, M], KVCacheConfig(B, S, [KVLayerConfig(2, 8, sliding_window=8)],
                                                  ring_windows=True),
                            MambaCacheConfig(1, B, 2, 4, 3, 6, 4), B)
    m = HybridCacheManager(cfg, device="cpu")
    drafts = DraftStates(m, 2)
    m.reset_for_new_sequences([1])
    with pytest.raises(ValueError, match="without ring-buffer layers"):
        m.commit_draft([1], 2, draft_states=drafts)


def test_draft_states_sizes_and_getters():
    """Buffers ``[max_batch, max_draft, ...]`` per live state, of its dtype; nbytes equals the
    report's total and nbytes_for; getters route like the manager's state getters."""
    m = _hybrid("mamba2", "float16", "float32", "bfloat16", "cpu")
    d = DraftStates(m, 5)
    r, c = d.get_recurrent_draft(0), d.get_conv_draft(2)
    assert r.shape == (B, 5, 2, 4, 3) and r.dtype == m.get_recurrent_state(0).dtype
    assert c.shape == (B, 5, 6, 4) and c.dtype == m.get_conv_state(2).dtype
    live = m.mamba_cache_manager.state_tensors
    assert d.nbytes == d.memory_report()["total"] == DraftStates._nbytes_for(live, 5)
    assert d.memory_report()["draft_states"] == 5 * sum(t.nbytes for t in live)
    with pytest.raises(ValueError, match="expected a Mamba layer"):
        d.get_recurrent_draft(1)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        DraftStates(m, 0)
    with pytest.raises(TypeError, match="manager: expected"):
        DraftStates(object(), 2)


def test_the_draft_kernels_run_once_per_commit(backend):
    """One state launch for every Mamba layer and one lengths launch per commit."""
    if backend is None:
        pytest.skip("counts launches of the emulated kernels")
    m = _hybrid("mamba2", "float16", "float32", "float16", "cpu")
    drafts = DraftStates(m, 2)
    m.reset_for_new_sequences([0, 0, 0])
    before = len(backend.launches)
    m.commit_draft([1, 2, 0], 2, draft_states=drafts)
    assert [name for name, _, _ in backend.launches[before:]] == \
        ["hc_draft_accept", "hc_draft_lengths"]


@pytest.mark.emulated
def test_captured_draft_commit_replays_with_new_counts(emu_rt):
    """A whole batch's accept step (``commit_draft`` with device counts: state scatter and
    lengths) captured on the emulated device and replayed with new counts and new draft states
    copied in before each replay: lengths and live states equal the NumPy model's after every
    replay; the replays make no host sync."""
    xp, rng = emu_rt.xp, np.random.default_rng(4)
    m = _hybrid("mamba2", "float16", "float32", "float16", "cuda")
    drafts = DraftStates(m, K)
    m.reset_for_new_sequences([0, 0, 0])
    live, draft = m.get_recurrent_state(0), drafts.get_recurrent_draft(0)
    conv, conv_draft = m.get_conv_state(5), drafts.get_conv_draft(5)
    counts = xp.zeros(3, np.int32)
    s = emu_rt.stream(non_blocking=True)
    emu_rt.synchronize()
    with s:
        m.commit_draft(counts, K, draft_states=drafts, stream=s)     # warm-up, eager
        s.begin_capture()
        m.commit_draft(counts, K, draft_states=drafts, stream=s)
        graph = s.end_capture()
    emu_rt.synchronize()
    want_live, want_conv = host(live).copy(), host(conv).copy()
    lengths = np.zeros(3, np.int64)
    syncs = emu_rt.counters["syncs"]
    for _ in range(6):
        acc = rng.integers(0, K + 1, 3).astype(np.int32)
        d = _rows(rng, draft.shape, draft.dtype)
        c = _rows(rng, conv_draft.shape, conv_draft.dtype)
        with s:
            counts[...] = xp.asarray(acc)
            draft[...] = xp.asarray(d)
            conv_draft[...] = xp.asarray(c)
            graph.launch(s)
        for b in range(3):
            if acc[b]:
                want_live[b] = d[b, acc[b] - 1]
                want_conv[b] = c[b, acc[b] - 1]
        lengths += acc
    assert emu_rt.counters["syncs"] == syncs
    emu_rt.synchronize()
    assert host(live).tobytes() == want_live.tobytes()
    assert host(conv).tobytes() == want_conv.tobytes()
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), lengths)


class SpeculativeMachine(RuleBasedStateMachine):
    """Draft commits interleaved with the batch API (plain commits, host-mapping compactions,
    resets) on a speculative manager and an accepted-only oracle manager; the invariant: the
    two hold the same lengths, valid KV prefixes and live states."""

    @initialize(kind=st.sampled_from(["mamba2", "short_conv", "lightning"]),
                seed=st.integers(0, 2**32 - 1))
    def setup(self, kind, seed):
        self.rng = np.random.default_rng(seed)
        spec_m = _hybrid(kind, "bfloat16", "float32", "float16", "cpu")
        ref_m = _hybrid(kind, "bfloat16", "float32", "float16", "cpu")
        drafts = DraftStates(spec_m, K)
        self.spec = Layout(spec_m, drafts)
        self.spec.drafts = drafts
        self.ref = Layout(ref_m, None)
        self.lengths = np.zeros(0, np.int64)
        self._reset(3)

    def _reset(self, n):
        start = self.rng.integers(0, 5, n)
        for m in (self.spec.m, self.ref.m):
            m.reset_for_new_sequences(start.tolist())
        # The engine's prefill of the new prefixes, the same in both: the positions it covers
        # may hold a rejected draft token in one manager and nothing in the other.
        for (_, a, _), (_, b, _) in zip(self.spec.kv, self.ref.kv):
            prefix = _rows(self.rng, a[:n].shape, a.dtype)
            put(a[:n], prefix)
            put(b[:n], prefix)
        self.lengths = start.astype(np.int64)

    @rule(n=st.integers(1, B))
    def reset(self, n):
        self._reset(n)

    @precondition(lambda self: len(self.lengths) and self.lengths.max() + K + 1 <= S)
    @rule(bonus=st.booleans(), data=st.data())
    def draft_step(self, bonus, data):
        written = data.draw(st.integers(int(bonus), K))
        n = len(self.lengths)
        accepted = np.asarray(data.draw(st.lists(st.integers(0, written - int(bonus)),
                                                 min_size=n, max_size=n)), np.int64)
        _step(self.spec, self.ref, self.rng, written, bonus, accepted, False)
        self.lengths += accepted + int(bonus)

    @precondition(lambda self: len(self.lengths) and self.lengths.max() < S)
    @rule()
    def plain_decode(self):
        """A non-speculative step: one token written to both, live states updated in place."""
        n = len(self.lengths)
        ks, vs = [], []
        for _, view, comps in self.spec.kv:
            shape = (n, 1, view.shape[2], view.shape[4])
            ks.append(_rows(self.rng, shape, view.dtype))
            vs.append(_rows(self.rng, shape, view.dtype) if comps == 2 else None)
        for layout in (self.spec, self.ref):
            layout.m.write_kv(None, ks, vs)
            layout.m.commit_sequence_length(1)
        for a, b in zip(self.spec.live, self.ref.live):
            state = _rows(self.rng, (n,) + tuple(a.shape[1:]), a.dtype)
            put(a[:n], state)
            put(b[:n], state)
        self.lengths += 1

    @precondition(lambda self: len(self.lengths) > 1)
    @rule(data=st.data())
    def evict_one(self, data):
        n = len(self.lengths)
        gone = data.draw(st.integers(0, n - 1))
        mapping = [-1 if i == gone else i - (i > gone) for i in range(n)]
        for m in (self.spec.m, self.ref.m):
            m.compact_batch(mapping, n, n - 1)
        self.lengths = np.delete(self.lengths, gone)

    @invariant()
    def same_caches(self):
        if hasattr(self, "spec"):
            _assert_same(self.spec, self.ref, self.lengths)


TestSpeculativeMachine = SpeculativeMachine.TestCase
TestSpeculativeMachine.settings = settings(max_examples=10, stateful_step_count=12,
                                           deadline=None)
