"""Stateful test of ContinuousBatchingHybridCacheManager against a NumPy model.

Three layouts: (a) a Nemotron-H hybrid (Mamba-2 layers and attention), (b) a Gemma 3 layout (five
sliding-window ring layers to one global layer, two head dims), (c) Kimi Linear (latent MLA layers
and KDA layers with three short convolutions). Rules cover claim (states zeroed), fetch, K/V
writes of one layer or of every layer (uniform and ragged), state writes of one or every
recurrent layer and one or both kinds, step, release, and the calls that must be refused (a
refused call leaves every byte, length and block as it was). The model keeps every cache and
state as a host array and applies each write by the documented rule (token ``t`` of row ``i`` at
position ``length + t``, entry ``p mod W`` of a ring; a row's states into its block), so after
every step every byte of every cache and state pool is compared, and ``check_invariants()`` runs.
On cpu and on the emulated device (the CUDA path with the real kernels).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hcache import ContinuousBatchingHybridCacheManager, HybridCacheConfig
from hcache.config.caches import KVCacheConfig, KVLayerConfig, LayerType
from hcache.continuous.manager import BatchInFlightError
from hcache.demo.run import NEMOTRON_H_CONFIG
from hcache.errors import CacheCapacityError

from helpers import host

N, S = 4, 12   # blocks, max_seq_len

KIMI_TINY = {
    "model_type": "kimi_linear", "hidden_size": 16, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "kv_lora_rank": 6,
    "q_lora_rank": None, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4,
    "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 4,
                           "num_heads": 2, "short_conv_kernel_size": 3}}


def gemma3_layout(dtype="float32"):
    """Five local layers (window 3, 2 heads of 4) to one global layer (1 head of 8), twice."""
    local, full = KVLayerConfig(2, 4, sliding_window=3), KVLayerConfig(1, 8)
    layers = ([local] * 5 + [full]) * 2
    kv = KVCacheConfig(N, S, layers, dtype, ring_windows=True)
    return HybridCacheConfig([LayerType.ATTENTION] * len(layers), kv, None, N)


def layout(name, dtype):
    if name == "nemotron_h":
        return HybridCacheConfig.from_hf_config(NEMOTRON_H_CONFIG, max_batch_size=N,
                                                max_sequence_length=S, kv_dtype=dtype)
    if name == "gemma3":
        return gemma3_layout(dtype)
    return HybridCacheConfig.from_hf_config(KIMI_TINY, max_batch_size=N, max_sequence_length=S,
                                            kv_dtype=dtype, conv_dtype="bfloat16")


def _xp(device):
    if device == "cpu":
        return np
    from hcache import _cuda

    return _cuda.runtime().xp


def raw(a) -> np.ndarray:
    a = np.ascontiguousarray(host(a))
    return a.view(np.uint8).copy()


LAYOUTS = ["nemotron_h", "gemma3", "kimi_linear"]


class HybridContinuousMachine(RuleBasedStateMachine):
    DEVICE, LAYOUTS = "cpu", LAYOUTS

    @initialize(data=st.data(), dtype=st.sampled_from(["float32", "bfloat16"]))
    def setup(self, data, dtype):
        self.config = layout(data.draw(st.sampled_from(self.LAYOUTS)), dtype)
        self.m = ContinuousBatchingHybridCacheManager(self.config, device=self.DEVICE)
        self.xp = _xp(self.DEVICE)
        m, c = self.m, self.config
        self.attention = [i for i, t in enumerate(c.layer_types) if t.has_attention
                          and i not in c.kv_sharing]
        self.recurrent = [i for i, t in enumerate(c.layer_types) if t.has_mamba]
        self.windows = list(c.kv.layer_ring_windows)
        self.kv = [raw(m.get_combined_kv_cache(i)).reshape(
            m.get_combined_kv_cache(i).shape[:-1] + (-1,)) for i in self.attention]
        self.kinds = {}
        if self.recurrent:
            for kind, get in (("recurrent", m.get_recurrent_state), ("conv", m.get_conv_state)):
                try:
                    get(self.recurrent[0])
                except ValueError:
                    continue
                self.kinds[kind] = [raw(get(i)).reshape(get(i).shape[0], -1)
                                    for i in self.recurrent]
        self.lengths: dict[int, int] = {}
        self.block: dict[int, int] = {}
        self.free = set(range(N))
        self.issued: set[int] = set()
        self.batch = None   # (collection, seq_ids)

    # --- helpers ----------------------------------------------------------------------------

    def pools(self):
        m = self.m
        out = [m.get_combined_kv_cache(i) for i in self.attention]
        for kind in self.kinds:
            get = m.get_recurrent_state if kind == "recurrent" else m.get_conv_state
            out += [get(i) for i in self.recurrent]
        return out

    def snapshot(self):
        m = self.m
        return (m.cache_lengths, {s: m.block_of(s) for s in m.cache_lengths}, m.num_free_blocks,
                m.in_flight, tuple(raw(p).tobytes() for p in self.pools()))

    def refused(self, exc, call):
        before = self.snapshot()
        with pytest.raises(exc):
            call()
        assert self.snapshot() == before

    def random_rows(self, data, shape, dtype):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        item = np.dtype(dtype).itemsize
        b = rng.integers(1, 256, size=int(np.prod(shape)) * item, dtype=np.uint8)
        return b.view(dtype).reshape(shape), b.reshape(shape[:-1] + (shape[-1] * item,))

    def headroom(self, row):
        return S - self.lengths[self.batch[1][row]]

    # --- commands ---------------------------------------------------------------------------

    @rule(n=st.integers(0, N + 1))
    def claim(self, n):
        if n > len(self.free):
            self.refused(CacheCapacityError, lambda: self.m.claim(n))
            return
        ids = self.m.claim(n)
        assert len(ids) == n and not set(ids) & self.issued and len(set(ids)) == n
        for sid, block in zip(ids, sorted(self.free)[:n], strict=True):   # lowest blocks first
            self.block[sid], self.lengths[sid] = block, 0
            self.free.discard(block)
            self.issued.add(sid)
            for pools in self.kinds.values():
                for p in pools:
                    p[block] = 0

    @precondition(lambda self: self.batch is None and self.lengths)
    @rule(data=st.data())
    def fetch(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.lengths)), min_size=1,
                                 unique=True))
        coll = self.m.fetch(ids)
        assert coll.blocks == tuple(self.block[s] for s in ids)
        assert coll.host_cache_lengths == tuple(self.lengths[s] for s in ids)
        assert host(coll.lookup_table).tolist() == list(coll.blocks)
        self.batch = (coll, ids)

    @precondition(lambda self: self.batch is not None)
    @rule()
    def fetch_in_flight_is_refused(self):
        self.refused(BatchInFlightError, lambda: self.m.fetch(self.batch[1]))

    @precondition(lambda self: self.batch is not None and self.attention)
    @rule(data=st.data(), every=st.booleans(), ragged=st.booleans())
    def write_kv(self, data, every, ragged):
        coll, ids = self.batch
        batch = len(ids)
        room = min(self.headroom(i) for i in range(batch))
        if ragged:
            counts = [data.draw(st.integers(0, self.headroom(i))) for i in range(batch)]
        else:
            counts = [data.draw(st.integers(0, room))] * batch
        targets = (list(range(len(self.attention))) if every
                   else [data.draw(st.integers(0, len(self.attention) - 1))])
        ks, vs, updates = [], [], []
        for a in targets:
            cache = self.m.get_combined_kv_cache(self.attention[a])
            _, c, h, _, d = cache.shape
            shape = (sum(counts), h, d) if ragged else (batch, counts[0], h, d)
            k, kb = self.random_rows(data, shape, cache.dtype)
            v, vb = self.random_rows(data, shape, cache.dtype) if c == 2 else (None, None)
            ks.append(self.xp.asarray(k) if self.xp is not np else k)
            vs.append(None if v is None else self.xp.asarray(v) if self.xp is not np else v)
            updates.append((a, kb.reshape(sum(counts), h, kb.shape[-1]),
                            None if vb is None else vb.reshape(sum(counts), h, vb.shape[-1])))
        kw = {"seq_lengths": counts} if ragged else {}
        if every:
            coll.write_kv(None, ks, vs, **kw)
        else:
            coll.write_kv(self.attention[targets[0]], ks[0], vs[0], **kw)
        for a, kb, vb in updates:
            w, t = self.windows[a], 0
            for i, sid in enumerate(ids):
                for j in range(counts[i]):
                    pos = self.lengths[sid] + j
                    entry = pos % w if w else pos
                    self.kv[a][self.block[sid], 0, :, entry] = kb[t]
                    if vb is not None:
                        self.kv[a][self.block[sid], 1, :, entry] = vb[t]
                    t += 1

    @precondition(lambda self: self.batch is not None and self.attention)
    @rule(data=st.data())
    def write_kv_past_max_seq_len_is_refused(self, data):
        coll, ids = self.batch
        batch = len(ids)
        room = min(self.headroom(i) for i in range(batch))
        cache = self.m.get_combined_kv_cache(self.attention[0])
        _, c, h, _, d = cache.shape
        k, _ = self.random_rows(data, (batch, room + 1, h, d), cache.dtype)
        k = self.xp.asarray(k) if self.xp is not np else k
        self.refused(ValueError, lambda: coll.write_kv(self.attention[0], k,
                                                       k if c == 2 else None))

    @precondition(lambda self: self.batch is not None and self.kinds)
    @rule(data=st.data(), every=st.booleans())
    def write_states(self, data, every):
        coll, ids = self.batch
        kinds = data.draw(st.lists(st.sampled_from(sorted(self.kinds)), min_size=1, unique=True))
        targets = (list(range(len(self.recurrent))) if every
                   else [data.draw(st.integers(0, len(self.recurrent) - 1))])
        given, updates = {}, []
        for kind in kinds:
            get = self.m.get_recurrent_state if kind == "recurrent" else self.m.get_conv_state
            arrays = []
            for r in targets:
                pool = get(self.recurrent[r])
                a, b = self.random_rows(data, (len(ids),) + tuple(pool.shape[1:]), pool.dtype)
                arrays.append(self.xp.asarray(a) if self.xp is not np else a)
                updates.append((kind, r, b.reshape(len(ids), -1)))
            given[kind] = arrays if every else arrays[0]
        coll.write_states(None if every else self.recurrent[targets[0]], **given)
        for kind, r, b in updates:
            for i, sid in enumerate(ids):
                self.kinds[kind][r][self.block[sid]] = b[i]

    @precondition(lambda self: self.batch is not None and self.kinds)
    @rule(data=st.data())
    def write_states_of_a_wrong_shape_is_refused(self, data):
        coll, ids = self.batch
        kind = sorted(self.kinds)[0]
        get = self.m.get_recurrent_state if kind == "recurrent" else self.m.get_conv_state
        pool = get(self.recurrent[0])
        a, _ = self.random_rows(data, (len(ids) + 1,) + tuple(pool.shape[1:]), pool.dtype)
        a = self.xp.asarray(a) if self.xp is not np else a
        self.refused(ValueError, lambda: coll.write_states(self.recurrent[0], **{kind: a}))

    @precondition(lambda self: self.batch is not None)
    @rule(data=st.data())
    def step(self, data):
        coll, ids = self.batch
        add = [data.draw(st.integers(0, self.headroom(i))) for i in range(len(ids))]
        self.m.step(add, coll)
        for sid, n in zip(ids, add, strict=True):
            self.lengths[sid] += n
        self.batch = None
        self.refused(ValueError, lambda: coll.write_kv(None, [], []))   # ended

    @precondition(lambda self: self.batch is not None)
    @rule(data=st.data())
    def step_past_max_seq_len_is_refused(self, data):
        coll, ids = self.batch
        i = data.draw(st.integers(0, len(ids) - 1))
        add = [0] * len(ids)
        add[i] = self.headroom(i) + 1
        self.refused(ValueError, lambda: self.m.step(add, coll))

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def release(self, data):
        sid = data.draw(st.sampled_from(sorted(self.lengths)))
        if self.batch is not None and sid in self.batch[1]:
            self.refused(ValueError, lambda: self.m.release(sid))
            return
        self.m.release(sid)
        self.free.add(self.block.pop(sid))
        del self.lengths[sid]

    @precondition(lambda self: self.issued - set(self.lengths))
    @rule(data=st.data())
    def released_ids_are_refused(self, data):
        sid = data.draw(st.sampled_from(sorted(self.issued - set(self.lengths))))
        self.refused(ValueError, lambda: self.m.release(sid))

    # --- invariants -------------------------------------------------------------------------

    @invariant()
    def matches_the_model(self):
        if not hasattr(self, "m"):
            return
        m = self.m
        m.check_invariants()
        assert m.cache_lengths == self.lengths
        assert {s: m.block_of(s) for s in self.lengths} == self.block
        assert m.num_free_blocks == len(self.free)
        for a, i in enumerate(self.attention):
            got = raw(m.get_combined_kv_cache(i)).reshape(self.kv[a].shape)
            assert np.array_equal(got, self.kv[a]), f"KV of layer {i}"
        for kind, pools in self.kinds.items():
            get = m.get_recurrent_state if kind == "recurrent" else m.get_conv_state
            for r, i in enumerate(self.recurrent):
                got = raw(get(i)).reshape(pools[r].shape)
                assert np.array_equal(got, pools[r]), f"{kind} state of layer {i}"


def _machine(device, name):
    class Machine(HybridContinuousMachine):
        DEVICE, LAYOUTS = device, [name]

    Machine.__name__ = f"HybridContinuousMachine_{name}_{device}"
    return Machine


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_matches_the_model_on_cpu(name):
    run_state_machine_as_test(_machine("cpu", name),
                              settings=settings(max_examples=40, stateful_step_count=30,
                                                deadline=None))


@pytest.mark.emulated
@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_matches_the_model_on_the_emulated_device(emu_rt, name):
    run_state_machine_as_test(_machine("cuda", name),
                              settings=settings(max_examples=10, stateful_step_count=25,
                                                deadline=None))
