"""Stateful tests of the contiguous-slot managers against a NumPy model of their whole state.

One ``RuleBasedStateMachine`` per layout (uniform ``LinearKVCache``, heterogeneous head dims,
hybrid with ATTENTION_AND_MAMBA / NONE / kv_sharing, pure Mamba, every dtype, latent MLA layers
mixed with K/V layers and a model of latent layers only). Rules drive
writes through the routed views (as a runtime would), reset / commit / set_active / compact,
prompt-cache capture and restore; rejected calls are rules too and must leave every byte, the
active batch and the all-empty flag unchanged. The invariant ``state_matches_model`` (run by
Hypothesis's ``check_invariants`` after every step) compares the lengths, the active batch, the
flag, every KV byte below each slot's length and every Mamba state byte.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hcache.config.caches import (
    HybridCacheConfig,
    KVCacheConfig,
    KVLayerConfig,
    LayerType,
    LinearCacheConfig,
    MambaCacheConfig,
)
from hcache.device import data_pointer
from hcache.dtypes import DTYPE_NAMES
from hcache.slots.hybrid import HybridCacheManager
from hcache.slots.linear import LinearKVCache

A, M, AM, N = (LayerType.ATTENTION, LayerType.MAMBA, LayerType.ATTENTION_AND_MAMBA,
               LayerType.NONE)
SEEDS = st.integers(0, 2**32 - 1)


def random_bytes(seed, shape):
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def other_dtype(a):
    """A dtype different from ``a``'s."""
    return np.float32 if a.dtype != np.float32 else np.float16


def mamba_kinds(mcfg, recurrent, conv) -> list:
    """The state getters of the kinds a MambaCacheConfig has, recurrent first."""
    if mcfg is None:
        return []
    return ([recurrent] if mcfg.has_recurrent_state else []) + (
        [conv] if mcfg.has_conv_state else [])


def state_counts(mcfg, n) -> tuple[int, int]:
    """How many recurrent and conv tensors a capture returns."""
    if mcfg is None:
        return 0, 0
    return (n if mcfg.has_recurrent_state else 0), (n if mcfg.has_conv_state else 0)


def hybrid_setup(machine, m):
    """Routes of a HybridCacheManager: every attention / Mamba layer by absolute index."""
    cfg = m.config
    owners = [i for i, t in enumerate(cfg.layer_types)
              if t.has_attention and i not in cfg.kv_sharing]
    machine.kv_views = [m.get_combined_kv_cache(i) for i in owners]
    machine.kv_routes = [(lambda i=i: m.get_combined_kv_cache(i),
                          owners.index(cfg.kv_sharing.get(i, i)))
                         for i, t in enumerate(cfg.layer_types) if t.has_attention]
    mamba = [i for i, t in enumerate(cfg.layer_types) if t.has_mamba]
    # Only the kinds of state the layers have (LFM2: conv only; MiniMax: recurrent only).
    kinds = mamba_kinds(cfg.mamba, m.get_recurrent_state, m.get_conv_state)
    routes = [(get, i) for get in kinds for i in mamba]
    machine.state_views = [get(i) for get, i in routes]
    machine.state_routes = [(lambda get=get, i=i: get(i), j) for j, (get, i) in enumerate(routes)]
    machine.n_states = state_counts(cfg.mamba, len(mamba))
    # write_kv(layer): the decoder layers that own a cache, with their model index
    machine.write_layers = [(layer, j) for j, layer in enumerate(owners)]
    machine.capture_kv = m.capture_kv_cache
    machine.restore_kv = m.restore_kv_cache
    machine.capture_mamba = lambda b: (m.capture_recurrent_states(b), m.capture_conv_states(b))
    machine.restore_mamba = m.restore_mamba_states
    for shared, owner in cfg.kv_sharing.items():
        assert data_pointer(m.get_combined_kv_cache(shared)) == \
            data_pointer(m.get_combined_kv_cache(owner))


def linear_setup(machine, m):
    cfg = m.config
    machine.kv_views = [m.get_combined_kv_cache_for_decoder_layer(i)
                        for i in range(cfg.num_attention_layers)]
    machine.kv_routes = [(lambda i=i: m.get_combined_kv_cache_for_decoder_layer(i), i)
                         for i in range(cfg.num_attention_layers)]
    n = cfg.num_mamba_layers
    mcfg = m._mamba.config if n else None
    kinds = mamba_kinds(mcfg, m.get_ssm_state_for_layer, m.get_conv_state_for_layer)
    routes = [(get, i) for get in kinds for i in range(n)]
    machine.state_views = [get(i) for get, i in routes]
    machine.state_routes = [(lambda get=get, i=i: get(i), j) for j, (get, i) in enumerate(routes)]
    machine.n_states = state_counts(mcfg, n)
    machine.write_layers = [(i, i) for i in range(cfg.num_attention_layers)]
    machine.capture_kv = machine.restore_kv = None
    machine.capture_mamba = lambda b: (m.capture_ssm_states(b), m.capture_conv_states(b))
    machine.restore_mamba = m.restore_mamba_states


class ManagerMachine(RuleBasedStateMachine):
    """Drives one manager and a NumPy model of its state; subclasses pick the layout."""

    kv_captures = Bundle("kv_captures")
    mamba_captures = Bundle("mamba_captures")

    def build(self, data):
        raise NotImplementedError

    @initialize(data=st.data())
    def setup(self, data):
        self.m = self.build(data)
        if isinstance(self.m, LinearKVCache):
            linear_setup(self, self.m)
            self.B, self.S = self.m.config.max_batch_size, self.m.config.max_sequence_length
        else:
            hybrid_setup(self, self.m)
            self.B, self.S = self.m.config.max_batch_size, self.m.config.kv.max_sequence_length
        # Random bytes everywhere (the caches start zeroed; that is checked elsewhere), so that
        # any misplaced move shows.
        seed = data.draw(SEEDS)
        self.kv, self.states = [], []
        for views, model in ((self.kv_views, self.kv), (self.state_views, self.states)):
            for k, v in enumerate(views):
                u8 = v.view(np.uint8)
                u8[...] = random_bytes(seed + k, u8.shape)
                model.append(u8.copy())
        self.lengths = np.zeros(self.B, dtype=np.int64)
        self.active = 0
        self.all_empty = True

    # --- helpers ----------------------------------------------------------------------------

    def snapshot(self):
        view = self.m.get_kv_cache_lengths()
        full = view.base if view.base is not None else view
        return ([a.view(np.uint8).copy() for a in self.kv_views + self.state_views]
                + [np.array(full)], self.m.active_batch_size, self.m.kv_cache_all_empty)

    def rejected(self, exc, call, *args):
        before = self.snapshot()
        with pytest.raises(exc):
            call(*args)
        after = self.snapshot()
        assert before[1:] == after[1:]
        for x, y in zip(before[0], after[0], strict=True):
            np.testing.assert_array_equal(x, y)

    # --- writes by the "runtime" ------------------------------------------------------------

    @precondition(lambda self: self.kv_routes)
    @rule(data=st.data(), seed=SEEDS)
    def write_kv(self, data, seed):
        get, j = data.draw(st.sampled_from(self.kv_routes))
        slot = data.draw(st.integers(0, self.B - 1))
        start = data.draw(st.integers(0, self.S - 1))
        stop = data.draw(st.integers(start + 1, self.S))
        u8 = get().view(np.uint8)
        raw = random_bytes(seed, u8[slot, :, :, start:stop].shape)
        u8[slot, :, :, start:stop] = raw
        self.kv[j][slot, :, :, start:stop] = raw

    def _batched(self, data, seed, *, overflow=False):
        """A write_kv call for the active batch: ``(layer, ks, vs, kwargs, placed)`` with
        ``placed`` the (model index, slot, position, token) of every written row; with
        ``overflow`` one row gets one token more than its room (a rejected call)."""
        n = self.active
        layer = data.draw(st.sampled_from([None] + self.write_layers))
        members = self.write_layers if layer is None else [layer]
        ragged = data.draw(st.booleans())
        explicit = not overflow and data.draw(st.integers(0, 3)) == 0
        room = self.S - self.lengths[:n]
        if ragged:
            counts = [data.draw(st.integers(0, min(int(r), 3))) for r in room]
        else:
            counts = [data.draw(st.integers(0, min(int(room.min()) if n else 3, 3)))] * n
        if overflow:
            b = data.draw(st.integers(0, n - 1))
            counts = [int(room[b]) + 1] * n if not ragged else \
                [c if i != b else int(room[b]) + 1 for i, c in enumerate(counts)]
        lead = (sum(counts),) if ragged else (n, counts[0] if n else 0)
        kwargs = {"seq_lengths": counts} if ragged else {}
        positions = []
        for b, c in enumerate(counts):
            if explicit:
                pos = data.draw(st.lists(st.integers(-1, self.S - 1), min_size=c, max_size=c,
                                         unique_by=lambda p: p if p >= 0 else object()))
            else:
                pos = [int(self.lengths[b]) + t for t in range(c)]
            positions.append(pos)
        if explicit:
            flat = [p for pos in positions for p in pos]
            kwargs["positions"] = np.array(flat, np.int64).reshape(lead)
        ks, vs, placed = [], [], []
        for i, (_, j) in enumerate(members):
            cache = self.kv_views[j]
            shape = lead + (cache.shape[2], cache.shape[4])
            k = random_bytes(seed + 2 * i, shape + (cache.itemsize,)).view(cache.dtype)
            v = random_bytes(seed + 2 * i + 1, shape + (cache.itemsize,)).view(cache.dtype)
            ks.append(k.reshape(shape))
            vs.append(v.reshape(shape) if cache.shape[1] == 2 else None)   # latent: no V
            t = 0
            for b, pos in enumerate(positions):
                for p in pos:
                    if p >= 0:
                        placed.append((j, b, p, t, i))
                    t += 1
        if layer is not None:
            ks, vs = ks[0], vs[0]
        elif all(v is None for v in vs) and data.draw(st.booleans()):
            vs = None   # every layer latent: v=None stands for the list of Nones
        return (None if layer is None else layer[0]), ks, vs, kwargs, placed

    @rule(data=st.data(), seed=SEEDS)
    def batched_write_kv(self, data, seed):
        """write_kv of the active batch (uniform or ragged, one layer or all, at the committed
        lengths or at explicit positions): the model gets the rows at their slots."""
        if not self.write_layers:
            return
        layer, ks, vs, kwargs, placed = self._batched(data, seed)
        self.m.write_kv(layer, ks, vs, **kwargs)
        for j, b, p, t, i in placed:
            k = ks[i] if layer is None else ks
            v = (vs[i] if vs is not None else None) if layer is None else vs
            rows_k = k.reshape(-1, *k.shape[-2:]).view(np.uint8)
            self.kv[j][b, 0, :, p] = rows_k[t]
            if v is not None:
                rows_v = v.reshape(-1, *v.shape[-2:]).view(np.uint8)
                self.kv[j][b, 1, :, p] = rows_v[t]

    @precondition(lambda self: self.active)
    @rule(data=st.data(), seed=SEEDS)
    def batched_write_kv_rejected(self, data, seed):
        """A row that would pass max_sequence_length: ValueError, nothing changes."""
        if not self.write_layers:
            return
        layer, ks, vs, kwargs, _ = self._batched(data, seed, overflow=True)
        self.rejected(ValueError, lambda: self.m.write_kv(layer, ks, vs, **kwargs))

    @precondition(lambda self: self.state_routes)
    @rule(data=st.data(), seed=SEEDS)
    def write_state(self, data, seed):
        get, j = data.draw(st.sampled_from(self.state_routes))
        slot = data.draw(st.integers(0, self.B - 1))
        u8 = get().view(np.uint8)
        u8[slot] = random_bytes(seed, u8[slot].shape)
        self.states[j][slot] = u8[slot]

    # --- batch API --------------------------------------------------------------------------

    @rule(data=st.data())
    def reset(self, data):
        reuse = data.draw(st.lists(st.integers(0, self.S), max_size=self.B))
        as_array = data.draw(st.booleans())
        self.m.reset_for_new_sequences(np.array(reuse, dtype=np.int32) if as_array else reuse)
        n = len(reuse)
        self.lengths[:n] = reuse
        self.active = n
        self.all_empty = not any(reuse)

    @rule(data=st.data())
    def reset_rejected(self, data):
        too_long = st.lists(st.integers(0, self.S), min_size=self.B + 1, max_size=self.B + 2)
        bad_value = st.lists(st.integers(0, self.S), min_size=1, max_size=self.B).flatmap(
            lambda xs: st.sampled_from([-1, self.S + 1]).map(lambda v: xs[:-1] + [v]))
        self.rejected(ValueError, self.m.reset_for_new_sequences,
                      data.draw(st.one_of(too_long, bad_value)))

    def _commit(self, inc, increment):
        new = self.lengths[:self.active] + inc
        if (new > self.S).any():
            self.rejected(ValueError, self.m.commit_sequence_length, increment)
            return
        self.m.commit_sequence_length(increment)
        self.lengths[:self.active] = new
        self.all_empty = not (new > 0).any()

    @rule(data=st.data())
    def commit_int(self, data):
        x = data.draw(st.integers(0, self.S))
        self._commit(np.full(self.active, x), x)

    @rule(data=st.data())
    def commit_array(self, data):
        xs = data.draw(st.lists(st.integers(0, self.S), min_size=self.active,
                                max_size=self.active))
        form = data.draw(st.sampled_from(["list", "int32", "int64"]))
        increment = xs if form == "list" else np.array(xs, dtype=form)
        self._commit(np.array(xs, dtype=np.int64), increment)

    @rule(data=st.data())
    def commit_malformed(self, data):
        n = self.active
        bad = data.draw(st.sampled_from([
            ("negative", -1, ValueError), ("too long", [0] * (n + 1), ValueError),
            ("float", 1.0, TypeError), ("too large", self.S + 1, ValueError)]))
        if n:
            bad = data.draw(st.sampled_from([bad, ("negative entry", [0] * (n - 1) + [-1],
                                                   ValueError),
                                             ("floats", [0.0] * n, TypeError)]))
        self.rejected(bad[2], self.m.commit_sequence_length, bad[1])

    @rule(data=st.data())
    def set_active(self, data):
        n = data.draw(st.integers(0, self.B))
        self.m.set_active_batch_size(n)
        self.active = n

    @rule(data=st.data())
    def set_active_rejected(self, data):
        self.rejected(ValueError, self.m.set_active_batch_size,
                      data.draw(st.sampled_from([-1, self.B + 1])))

    @rule(data=st.data())
    def compact(self, data):
        old = self.active
        new = data.draw(st.integers(0, self.B))
        k = data.draw(st.integers(0, min(old, new)))
        kept = sorted(data.draw(st.permutations(range(old)))[:k])
        targets = data.draw(st.permutations(range(new)))[:k]
        if data.draw(st.booleans()):
            targets = sorted(targets)
        mapping = [-1] * old
        for i, t in zip(kept, targets, strict=True):
            mapping[i] = t
        as_array = data.draw(st.booleans())
        self.m.compact_batch(np.array(mapping, dtype=np.int32) if as_array else mapping,
                             old, new)
        # The model: new[mapping[i]] = old[i] for the first lengths[i] tokens; whole states;
        # slots below new that receive nothing get zero states and length 0.
        old_len, old_kv, old_states = self.lengths.copy(), [a.copy() for a in self.kv], \
            [a.copy() for a in self.states]
        for a in self.states:
            a[:new] = 0
        self.lengths[:new] = 0
        for i, d in enumerate(mapping):
            if d < 0:
                continue
            for a, src in zip(self.kv, old_kv, strict=True):
                a[d, :, :, :old_len[i]] = src[i, :, :, :old_len[i]]
            for a, src in zip(self.states, old_states, strict=True):
                a[d] = src[i]
            self.lengths[d] = old_len[i]
        self.active = new

    @rule(data=st.data())
    def compact_rejected(self, data):
        old, B = self.active, self.B
        cases = [("old_batch", [-1] * (old + 1) if old < B else [-1] * (old - 1),
                  old + 1 if old < B else old - 1, 0),
                 ("new_batch", [-1] * old, old, B + 1),
                 ("length", [-1] * (old + 1), old, 0)]
        if old >= 1:
            cases += [("out of range", [0] + [-1] * (old - 1), old, 0),
                      ("below -1", [-2] + [-1] * (old - 1), old, 1)]
        if old >= 2:
            cases.append(("duplicate", [0, 0] + [-1] * (old - 2), old, 1))
        _, mapping, old_batch, new_batch = data.draw(st.sampled_from(cases))
        self.rejected(ValueError, self.m.compact_batch, mapping, old_batch, new_batch)

    # --- prompt cache -----------------------------------------------------------------------

    @precondition(lambda self: self.capture_kv is not None)
    @rule(target=kv_captures, data=st.data())
    def capture_kv_cache(self, data):
        b = data.draw(st.integers(0, self.B - 1))
        n = data.draw(st.integers(0, self.S))
        saved = self.capture_kv(b, n)
        assert len(saved) == len(self.kv)
        valid = min(n, int(self.lengths[b]))
        for t, model in zip(saved, self.kv, strict=True):
            assert t.shape[2] == n
            np.testing.assert_array_equal(t.view(np.uint8)[:, :, :valid],
                                          model[b, :, :, :valid])
        return saved

    @rule(saved=kv_captures, data=st.data())
    def restore_kv_cache(self, saved, data):
        b = data.draw(st.integers(0, self.B - 1))
        self.restore_kv(saved, b)
        for t, model in zip(saved, self.kv, strict=True):
            model[b, :, :, :t.shape[2]] = t.view(np.uint8)

    @rule(saved=kv_captures, data=st.data())
    def restore_kv_cache_rejected(self, saved, data):
        cases = [("slot", saved, self.B, IndexError), ("slot", saved, -1, IndexError)]
        if saved:
            last = saved[-1]
            cases += [("count", saved[:-1], 0, ValueError),
                      ("tokens", saved[:-1] + [np.zeros(last.shape[:2] + (last.shape[2] + 1,)
                                                        + last.shape[3:], last.dtype)],
                       0, ValueError),
                      ("dtype", saved[:-1] + [np.zeros(last.shape, other_dtype(last))], 0,
                       ValueError)]
        _, tensors, b, exc = data.draw(st.sampled_from(cases))
        self.rejected(exc, self.restore_kv, tensors, b)

    @rule(target=mamba_captures, data=st.data())
    def capture_mamba_states(self, data):
        b = data.draw(st.integers(0, self.B - 1))
        rec, conv = self.capture_mamba(b)
        assert (len(rec), len(conv)) == self.n_states
        for t, model in zip(rec + conv, self.states, strict=True):
            assert t.view(np.uint8).shape == (1,) + model.shape[1:]
            np.testing.assert_array_equal(t.view(np.uint8)[0], model[b])
        return rec, conv

    @rule(saved=mamba_captures, data=st.data())
    def restore_mamba_states(self, saved, data):
        b = data.draw(st.integers(0, self.B - 1))
        rec, conv = saved
        self.restore_mamba(rec, conv, b)
        for t, model in zip(rec + conv, self.states, strict=True):
            model[b] = t.view(np.uint8)[0]

    @rule(saved=mamba_captures, data=st.data())
    def restore_mamba_states_rejected(self, saved, data):
        rec, conv = saved
        cases = [(rec, conv, self.B, IndexError), (rec, conv, -1, IndexError),
                 (rec, conv + [np.zeros(1)], 0, ValueError)]
        if conv:
            last = conv[-1]
            cases += [(rec, conv[:-1], 0, ValueError),
                      (rec, conv[:-1] + [np.zeros(last.shape, other_dtype(last))], 0,
                       ValueError),
                      (rec, conv[:-1] + [np.zeros((2,) + last.shape[1:], last.dtype)], 0,
                       ValueError)]
        rec_, conv_, b, exc = data.draw(st.sampled_from(cases))
        self.rejected(exc, self.restore_mamba, rec_, conv_, b)

    @rule(data=st.data())
    def capture_bad_slot(self, data):
        b = data.draw(st.sampled_from([-1, self.B]))
        with pytest.raises(IndexError):
            self.capture_mamba(b)
        if self.capture_kv is not None:
            with pytest.raises(IndexError):
                self.capture_kv(b, 0)

    # --- the whole state --------------------------------------------------------------------

    @invariant()
    def state_matches_model(self):
        # (``check_invariants`` is Hypothesis's own name for the runner of these.)
        m = self.m
        assert m.active_batch_size == self.active
        assert m.kv_cache_all_empty == self.all_empty
        lengths = m.get_kv_cache_lengths()
        assert lengths.dtype == np.int32
        np.testing.assert_array_equal(lengths, self.lengths[:self.active])
        for view, model in zip(self.kv_views, self.kv, strict=True):
            got = view.view(np.uint8)
            for slot, n in enumerate(self.lengths):
                np.testing.assert_array_equal(got[slot, :, :, :n], model[slot, :, :, :n])
        for view, model in zip(self.state_views, self.states, strict=True):
            np.testing.assert_array_equal(view.view(np.uint8), model)


def _hybrid(types, kv_layers, mamba, max_batch, seq, *, sharing=None, kv_dtype="float16",
            ssm="float32", conv="float16"):
    kv = KVCacheConfig(max_batch, seq, kv_layers, kv_dtype)
    mcfg = None if mamba is None else MambaCacheConfig(
        mamba[0], max_batch, *mamba[1:], ssm_dtype=ssm, conv_dtype=conv)
    return HybridCacheManager(HybridCacheConfig(types, kv, mcfg, max_batch,
                                                kv_sharing=sharing), device="cpu")


class UniformMachine(ManagerMachine):
    def build(self, data):
        cfg = LinearCacheConfig(3, 4, 8, 2, 8, dtype="float16", num_mamba_layers=1,
                                mamba_num_heads=2, mamba_head_dim=2, ssm_state_size=3,
                                conv_dim=4, conv_kernel=3)
        return LinearKVCache(cfg, device="cpu")


class HeterogeneousMachine(ManagerMachine):
    def build(self, data):
        layers = [KVLayerConfig(2, 8), KVLayerConfig(1, 36), KVLayerConfig(3, 80),
                  KVLayerConfig(2, 8)]
        return _hybrid([A] * 4, layers, None, 5, 12, kv_dtype="bfloat16")


class HybridMachine(ManagerMachine):
    def build(self, data):
        types = [M, A, N, AM, A, M, A]
        layers = [KVLayerConfig(2, 80), KVLayerConfig(1, 8), KVLayerConfig(2, 36)]
        return _hybrid(types, layers, (3, 2, 3, 4, 5, 3), 6, 16, sharing={4: 1})


class PureMambaMachine(ManagerMachine):
    def build(self, data):
        return _hybrid([M, N, M, M], [], (3, 1, 6, 2, 3, 4), 3, 5, ssm="bfloat16",
                       conv="float32")


class ShortConvMachine(ManagerMachine):
    """LFM2's layout: attention and short-convolution layers (a conv state, no recurrent)."""

    def build(self, data):
        return _hybrid([M, A, M, M, A], [KVLayerConfig(2, 8), KVLayerConfig(2, 8)],
                       (3, 0, 0, 0, 12, 3), 4, 8, conv="bfloat16")


class LightningMachine(ManagerMachine):
    """MiniMax's layout: lightning attention (a [heads, d, d] state, no conv) and softmax
    attention layers."""

    def build(self, data):
        return _hybrid([M, M, A, M, A], [KVLayerConfig(1, 16), KVLayerConfig(1, 16)],
                       (3, 2, 4, 4, 0, 0), 4, 8)


class ShortConvUniformMachine(ManagerMachine):
    def build(self, data):
        cfg = LinearCacheConfig(2, 3, 8, 2, 8, dtype="float16", num_mamba_layers=2,
                                conv_dim=6, conv_kernel=3)
        return LinearKVCache(cfg, device="cpu")


class DtypeMachine(ManagerMachine):
    def build(self, data):
        kv_dtype, ssm, conv = (data.draw(st.sampled_from(DTYPE_NAMES)) for _ in range(3))
        layers = [KVLayerConfig(1, 8), KVLayerConfig(2, 36), KVLayerConfig(1, 8)]
        return _hybrid([A, AM, M, N, A], layers, (2, 2, 2, 3, 3, 2), 4, 6, kv_dtype=kv_dtype,
                       ssm=ssm, conv=conv)


def _latent(head_dim):
    return KVLayerConfig(1, head_dim, components=1)


class LatentMachine(ManagerMachine):
    """Latent (MLA) layers mixed with K/V layers, Mamba and a NONE layer; one latent layer
    shares its head dim with a K/V layer (two groups), two latent layers share one group."""

    def build(self, data):
        types = [A, M, A, N, A, AM]
        layers = [_latent(24), KVLayerConfig(2, 8), _latent(24), _latent(8)]
        return _hybrid(types, layers, (2, 2, 2, 3, 3, 2), 4, 10,
                       kv_dtype=data.draw(st.sampled_from(["float16", "float8_e4m3fn",
                                                           "float32"])))


class MLAMachine(ManagerMachine):
    """A DeepSeek-like model: latent layers only (``v=None`` writes every layer), NONE layers
    between them, every dtype."""

    def build(self, data):
        kv_dtype = data.draw(st.sampled_from(DTYPE_NAMES))
        return _hybrid([A, N, A, A], [_latent(36)] * 3, None, 3, 9, kv_dtype=kv_dtype)


_SETTINGS = settings(stateful_step_count=30)
TestUniform = UniformMachine.TestCase
TestHeterogeneous = HeterogeneousMachine.TestCase
TestHybrid = HybridMachine.TestCase
TestPureMamba = PureMambaMachine.TestCase
TestDtypes = DtypeMachine.TestCase
TestShortConv = ShortConvMachine.TestCase
TestLightning = LightningMachine.TestCase
TestShortConvUniform = ShortConvUniformMachine.TestCase
TestLatent = LatentMachine.TestCase
TestMLA = MLAMachine.TestCase
for _case in (TestUniform, TestHeterogeneous, TestHybrid, TestPureMamba, TestDtypes,
              TestShortConv, TestLightning, TestShortConvUniform, TestLatent, TestMLA):
    _case.settings = _SETTINGS
del _case
