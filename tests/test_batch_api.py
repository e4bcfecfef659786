"""Batch API of the contiguous-slot managers (docs/design.md §4): lengths, reset/commit, the
all-empty
flag, active batch and compaction, against a plain NumPy model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hcache.config.caches import (
    HybridCacheConfig,
    KVCacheConfig,
    KVLayerConfig,
    LinearCacheConfig,
    MambaCacheConfig,
)
from hcache.device import array_module_of, resolve_device
from hcache.slots.hybrid import HybridCacheManager
from hcache.slots.linear import LinearKVCache

import helpers
from helpers import host

DEVICES = helpers.DEVICES
B, S = 6, 12



def hybrid(device="cpu", max_batch=B, seq=S, kv_dtype="float16"):
    kv = KVCacheConfig(max_batch, seq, [KVLayerConfig(2, 8), KVLayerConfig(1, 36),
                                        KVLayerConfig(3, 8)], kv_dtype)
    mamba = MambaCacheConfig(2, max_batch, 2, 3, 4, 5, 3, ssm_dtype="float32",
                             conv_dtype="bfloat16")
    cfg = HybridCacheConfig(["attention", "mamba", "attention_and_mamba", "none", "attention"],
                            kv, mamba, max_batch)
    return HybridCacheManager(cfg, device=device)


def linear(device="cpu", max_batch=B, seq=S):
    cfg = LinearCacheConfig(2, max_batch, seq, 2, 8, dtype="int8", num_mamba_layers=1,
                            mamba_num_heads=1, mamba_head_dim=4, ssm_state_size=2, conv_dim=3,
                            conv_kernel=4)
    return LinearKVCache(cfg, device=device)


FACTORIES = [pytest.param(hybrid, id="hybrid"), pytest.param(linear, id="linear")]


def kv_arrays(m):
    if isinstance(m, LinearKVCache):
        return [m.get_combined_kv_cache_for_decoder_layer(i) for i in range(2)]
    kvm = m.kv_cache_manager
    return [kvm.get_combined_kv_cache(i) for i in range(kvm.num_layers)]


def state_arrays(m):
    if isinstance(m, LinearKVCache):
        return [m.get_ssm_state_for_layer(0), m.get_conv_state_for_layer(0)]
    mm = m.mamba_cache_manager
    return ([mm.get_recurrent_state(i) for i in range(mm.num_layers)]
            + [mm.get_conv_state(i) for i in range(mm.num_layers)])


def fill_random(arrays, rng):
    """Fill arrays with random bytes through their views; returns host byte copies."""
    out = []
    for a in arrays:
        raw = rng.integers(0, 256, size=a.nbytes, dtype=np.uint8)
        u8 = a.view(np.uint8)
        if hasattr(a, "get"):
            u8[...] = array_module_of(a).asarray(raw.reshape(u8.shape))
        else:
            u8[...] = raw.reshape(u8.shape)
        out.append(raw.reshape(u8.shape).copy())
    return out


def snapshot(m):
    lengths = m.get_kv_cache_lengths()
    full = lengths.base if lengths.base is not None else lengths
    return ([host(a.view(np.uint8)).copy() for a in kv_arrays(m) + state_arrays(m)]
            + [host(full).copy()], m.active_batch_size, m.kv_cache_all_empty)


def assert_same(before, after):
    arrays0, active0, empty0 = before
    arrays1, active1, empty1 = after
    assert active0 == active1 and empty0 == empty1
    for a, b in zip(arrays0, arrays1, strict=True):
        np.testing.assert_array_equal(a, b)


def model_compact(mapping, new_batch, lengths, kv, states):
    """``new[mapping[i]] = old[i]``: the first ``lengths[i]`` tokens of every KV layer, whole
    states (slots below ``new_batch`` receiving nothing are zero), lengths (holes 0)."""
    old_len = lengths.copy()
    kv_new = [a.copy() for a in kv]
    st_new = [a.copy() for a in states]
    for a in st_new:
        a[:new_batch] = 0
    lengths[:new_batch] = 0
    for i, d in enumerate(mapping):
        if d < 0:
            continue
        n = old_len[i]
        for a, src in zip(kv_new, kv, strict=True):
            a[d, :, :, :n] = src[i, :, :, :n]
        for a, src in zip(st_new, states, strict=True):
            a[d] = src[i]
        lengths[d] = old_len[i]
    return kv_new, st_new


# --- reset / commit / all-empty -------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", FACTORIES)
def test_initial_state(make, device):
    m = make(device)
    assert m.active_batch_size == 0
    assert m.kv_cache_all_empty is True
    assert tuple(m.get_kv_cache_lengths().shape) == (0,)
    assert m.get_kv_cache_lengths().dtype == np.int32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", FACTORIES)
def test_reset_and_commit(make, device):
    m = make(device)
    m.reset_for_new_sequences([0, 0, 0])
    assert m.active_batch_size == 3 and m.kv_cache_all_empty
    view = m.get_kv_cache_lengths()
    m.commit_sequence_length(0)
    assert m.kv_cache_all_empty
    m.commit_sequence_length([0, 2, 0])
    assert not m.kv_cache_all_empty
    m.commit_sequence_length(np.array([1, 1, 3], dtype=np.int64))
    m.commit_sequence_length(1)
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [2, 4, 4])
    np.testing.assert_array_equal(host(view), [2, 4, 4])   # a view, not a copy
    m.reset_for_new_sequences(np.array([3, 0], dtype=np.uint8))
    assert m.active_batch_size == 2 and not m.kv_cache_all_empty
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [3, 0])
    m.reset_for_new_sequences([])
    assert m.active_batch_size == 0 and m.kv_cache_all_empty
    m.commit_sequence_length(5)          # nothing active: nothing changes
    assert m.kv_cache_all_empty


@pytest.mark.parametrize("make", FACTORIES)
def test_reset_only_writes_n_entries(make):
    m = make()
    m.reset_for_new_sequences([1, 2, 3, 4])
    m.reset_for_new_sequences([7])
    m.set_active_batch_size(4)
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [7, 2, 3, 4])


@pytest.mark.parametrize("make", FACTORIES)
@pytest.mark.parametrize("bad, exc", [
    ([0] * (B + 1), ValueError), ([1, -1], ValueError), ([S + 1], ValueError),
    ([1.0, 2.0], TypeError), ([True], TypeError), ([[1, 2]], ValueError), ("12", TypeError)])
def test_reset_rejected_changes_nothing(make, bad, exc):
    m = make()
    m.reset_for_new_sequences([1, 2])
    fill_random(kv_arrays(m) + state_arrays(m), np.random.default_rng(0))
    before = snapshot(m)
    with pytest.raises(exc):
        m.reset_for_new_sequences(bad)
    assert_same(before, snapshot(m))


@pytest.mark.parametrize("make", FACTORIES)
def test_commit_to_the_limit_and_refused_overflow(make):
    m = make()
    m.reset_for_new_sequences([S - 2, 0])
    m.commit_sequence_length([2, 0])
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [S, 0])
    before = snapshot(m)
    for bad in (1, [1, 0], [0, S + 1], np.array([1, 0], dtype=np.int32)):
        with pytest.raises(ValueError):
            m.commit_sequence_length(bad)
        assert_same(before, snapshot(m))
    assert m.refused_commit_count() == 0   # refused on the host: nothing reached the device


@pytest.mark.parametrize("make", FACTORIES)
@pytest.mark.parametrize("bad, exc", [
    (-1, ValueError), ([1, -1, 0], ValueError), ([1, 1], ValueError), ([1, 1, 1, 1], ValueError),
    (np.zeros((3, 1), dtype=np.int32), ValueError), (1.0, TypeError), (True, TypeError),
    ([0.5, 1, 1], TypeError), (None, TypeError)])
def test_commit_rejected_changes_nothing(make, bad, exc):
    m = make()
    m.reset_for_new_sequences([0, 1, 2])
    before = snapshot(m)
    with pytest.raises(exc):
        m.commit_sequence_length(bad)
    assert_same(before, snapshot(m))


@pytest.mark.parametrize("make", FACTORIES)
def test_set_active_batch_size(make):
    m = make()
    m.reset_for_new_sequences([5, 5, 5])
    m.set_active_batch_size(1)
    assert not m.kv_cache_all_empty          # only reset and commit recompute the flag
    m.commit_sequence_length(1)
    m.set_active_batch_size(3)
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [6, 5, 5])
    m.set_active_batch_size(0)
    assert m.get_kv_cache_lengths().shape == (0,)
    m.set_active_batch_size(B)
    for bad, exc in ((-1, ValueError), (B + 1, ValueError), (1.0, TypeError),
                     (False, TypeError)):
        with pytest.raises(exc):
            m.set_active_batch_size(bad)
        assert m.active_batch_size == B


@pytest.mark.parametrize("make", FACTORIES)
def test_all_empty_flag_recomputed_by_commit(make):
    m = make()
    m.reset_for_new_sequences([2, 0])
    m.set_active_batch_size(1)
    m.reset_for_new_sequences([0])
    m.commit_sequence_length([0])
    assert m.kv_cache_all_empty
    m.set_active_batch_size(2)                     # exposes slot 1 (length 0)
    m.commit_sequence_length(0)
    assert m.kv_cache_all_empty
    m.reset_for_new_sequences([0, 3])
    m.set_active_batch_size(1)
    m.commit_sequence_length(0)                    # slot 1 is no longer active
    assert m.kv_cache_all_empty


# --- compaction -----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", FACTORIES)
@pytest.mark.parametrize("mapping, new_batch", [
    ([-1, 0, 1], 2),            # old batch (3) below max batch (6), monotone
    ([1, 0, -1], 2),            # a swap
    ([2, -1, 0], 4),            # new batch above the survivors: holes 1 and 3
    ([0, 1, 2], 3),             # identity
    ([-1, -1, -1], 0)])         # everything evicted
def test_compact_batch_against_model(make, device, mapping, new_batch):
    m = make(device)
    rng = np.random.default_rng(1)
    m.reset_for_new_sequences([4, 0, 7])
    kv = fill_random(kv_arrays(m), rng)
    states = fill_random(state_arrays(m), rng)
    lengths = np.array([4, 0, 7, 0, 0, 0])
    # Byte views [B, 2, H, S, D * itemsize] keep tokens on axis 3.
    kv_new, st_new = model_compact(mapping, new_batch, lengths, kv, states)
    m.compact_batch(mapping, 3, new_batch)
    assert m.active_batch_size == new_batch
    assert m.last_compaction_valid()
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), lengths[:new_batch])
    for a, want in zip(kv_arrays(m), kv_new, strict=True):
        got = host(a.view(np.uint8))
        for slot in range(B):
            n = lengths[slot]
            np.testing.assert_array_equal(got[slot, :, :, :n], want[slot, :, :, :n])
    for a, want in zip(state_arrays(m), st_new, strict=True):
        np.testing.assert_array_equal(host(a.view(np.uint8)), want)


@pytest.mark.parametrize("make", FACTORIES)
def test_compaction_keeps_host_mirror(make):
    m = make()
    m.reset_for_new_sequences([S, 1, 2])
    m.compact_batch([-1, 1, 0], 3, 3)              # slot 2 becomes a hole (length 0)
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [2, 1, 0])
    m.commit_sequence_length(S - 2)
    with pytest.raises(ValueError):
        m.commit_sequence_length([1, 0, 0])
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [S, S - 1, S - 2])


@pytest.mark.parametrize("make", FACTORIES)
@pytest.mark.parametrize("mapping, old, new, exc", [
    ([0, 1], 2, 2, ValueError),          # old batch is not the active batch (3)
    ([0, 1, 2], 3, B + 1, ValueError),   # new batch too large
    ([0, 1, 2], 3, -1, ValueError),
    ([0, 1], 3, 3, ValueError),          # wrong length
    ([0, 1, 2, 3], 3, 3, ValueError),
    ([0, 0, -1], 3, 2, ValueError),      # not injective
    ([0, 2, 1], 3, 2, ValueError),       # target out of [0, new_batch)
    ([0, -2, 1], 3, 2, ValueError),      # below -1
    ([0.0, 1.0, 2.0], 3, 3, TypeError),
    ([0, 1, 2], 3.0, 3, TypeError)])
def test_compaction_rejected_changes_nothing(make, mapping, old, new, exc):
    m = make()
    m.reset_for_new_sequences([3, 1, 2])
    fill_random(kv_arrays(m) + state_arrays(m), np.random.default_rng(2))
    before = snapshot(m)
    with pytest.raises(exc):
        m.compact_batch(mapping, old, new)
    assert_same(before, snapshot(m))


@st.composite
def compaction_case(draw):
    max_batch = draw(st.integers(1, 6))
    old = draw(st.integers(0, max_batch))
    lengths = draw(st.lists(st.integers(0, 8), min_size=old, max_size=old))
    new = draw(st.integers(0, max_batch))
    keep_count = draw(st.integers(0, min(old, new)))
    kept = sorted(draw(st.permutations(range(old)))[:keep_count])
    targets = draw(st.permutations(range(new)))[:keep_count]
    if draw(st.booleans()):
        targets = sorted(targets)                  # monotone, order-preserving
    mapping = [-1] * old
    for i, t in zip(kept, targets, strict=True):
        mapping[i] = t
    return max_batch, lengths, mapping, new, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=30)
@given(case=compaction_case(), use_linear=st.booleans())
def test_compaction_property(case, use_linear):
    max_batch, reuse, mapping, new, seed = case
    m = linear(max_batch=max_batch, seq=8) if use_linear else hybrid(max_batch=max_batch, seq=8)
    rng = np.random.default_rng(seed)
    m.reset_for_new_sequences(reuse)
    kv = fill_random(kv_arrays(m), rng)
    states = fill_random(state_arrays(m), rng)
    lengths = np.zeros(max_batch, dtype=np.int64)
    lengths[:len(reuse)] = reuse
    kv_new, st_new = model_compact(mapping, new, lengths, kv, states)
    m.compact_batch(np.array(mapping, dtype=np.int64), len(reuse), new)
    assert m.active_batch_size == new
    np.testing.assert_array_equal(m.get_kv_cache_lengths(), lengths[:new])
    for a, want in zip(kv_arrays(m), kv_new, strict=True):
        got = a.view(np.uint8)
        for slot in range(max_batch):
            np.testing.assert_array_equal(got[slot, :, :, :lengths[slot]],
                                          want[slot, :, :, :lengths[slot]])
    for a, want in zip(state_arrays(m), st_new, strict=True):
        np.testing.assert_array_equal(a.view(np.uint8), want)


# --- device data (GPU tier) -----------------------------------------------------------------

@pytest.mark.parametrize("device", helpers.DEVICES[1:])
def test_device_commit_and_conservative_flag(device):
    cupy = resolve_device(device).xp
    m = hybrid(device)
    m.reset_for_new_sequences([0, 0])
    m.commit_sequence_length(cupy.zeros(2, dtype=cupy.int32))
    assert not m.kv_cache_all_empty                 # unknown on the host: conservative
    m.commit_sequence_length(cupy.array([2, 3], dtype=cupy.int32))
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [2, 3])
    m.commit_sequence_length(cupy.array([S, 0], dtype=cupy.int32))   # overflow: refused
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [2, 3])
    assert m.refused_commit_count() == 1
    m.commit_sequence_length(S)                     # lengths unknown: refused on the device
    assert m.refused_commit_count() == 2
    m.refresh_host_lengths()
    with pytest.raises(ValueError):
        m.commit_sequence_length(S)
    with pytest.raises(ValueError):
        m.commit_sequence_length(cupy.array([1, 1], dtype=cupy.int64))
    with pytest.raises(ValueError):
        m.commit_sequence_length(cupy.array([1, 1, 1], dtype=cupy.int32))


@pytest.mark.parametrize("device", helpers.DEVICES[1:])
def test_device_mapping_compaction_and_invalid_mapping(device):
    cupy = resolve_device(device).xp
    m = hybrid(device)
    m.reset_for_new_sequences([1, 2, 3])
    m.compact_batch(cupy.array([1, -1, 0], dtype=cupy.int32), 3, 2)
    assert m.last_compaction_valid()
    np.testing.assert_array_equal(host(m.get_kv_cache_lengths()), [3, 1])
    before = snapshot(m)
    m.compact_batch(cupy.array([0, 0], dtype=cupy.int32), 2, 2)     # not injective
    assert not m.last_compaction_valid()
    after = snapshot(m)
    for a, b in zip(before[0], after[0], strict=True):
        np.testing.assert_array_equal(a, b)


# --- int32 lengths: the capacity limit --------------------------------------------------------

def test_max_sequence_length_fits_the_int32_lengths():
    """docs/design.md §4: the lengths are one device int32 array, so a capacity past 2**31 - 1
    cannot be represented (a pure-Mamba model, with no KV memory to exhaust, would otherwise
    wrap a reset length of 2**31 to -2**31)."""
    mamba = MambaCacheConfig(1, 1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="max_sequence_length"):
        KVCacheConfig(1, 2**31, [])
    with pytest.raises(ValueError, match="max_sequence_length"):
        LinearCacheConfig(0, 1, 2**31, 1, 1)
    top = 2**31 - 1
    m = HybridCacheManager(HybridCacheConfig(["mamba"], KVCacheConfig(1, top, []), mamba, 1),
                           device="cpu")
    m.reset_for_new_sequences([top - 1])
    m.commit_sequence_length(1)
    assert host(m.get_kv_cache_lengths()).tolist() == [top]
    with pytest.raises(ValueError):
        m.commit_sequence_length(1)


# --- host integers: bools and uint64 are not slot numbers -------------------------------------

def batch_snapshot(m):
    lengths = m.get_kv_cache_lengths()
    full = lengths.base if lengths.base is not None else lengths
    return host(full).tolist(), m.active_batch_size, m.kv_cache_all_empty


@pytest.mark.parametrize("make", FACTORIES)
def test_bool_entries_in_host_lists_are_type_errors_and_change_nothing(make):
    """A bool is not an int (docs/design.md §4: TypeError for a wrong type), inside a list too:
    [0, True] must not reset a length to 1, nor [True, 0] compact slot 0 into slot 1."""
    m = make()
    m.reset_for_new_sequences([2, 4])
    before = batch_snapshot(m)
    calls = [(m.reset_for_new_sequences, ([0, True],)),
             (m.reset_for_new_sequences, ((np.bool_(False), 1),)),
             (m.commit_sequence_length, ([1, False],)),
             (m.compact_batch, ([True, 0], 2, 2))]
    for call, args in calls:
        with pytest.raises(TypeError, match="bool"):
            call(*args)
        assert batch_snapshot(m) == before
    assert host(m.get_kv_cache_lengths()).tolist() == [2, 4]


@pytest.mark.parametrize("make", FACTORIES)
def test_uint64_entries_past_int64_are_not_wrapped(make):
    """2**64 - 1 is not a slot: it must not read as -1 (evicted) in a mapping, nor be reported
    as -1 in a reset."""
    m = make()
    m.reset_for_new_sequences([2, 4])
    before = batch_snapshot(m)
    huge = np.array([2**64 - 1, 0], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"batch_mapping\[0\].*18446744073709551615"):
        m.compact_batch(huge, 2, 1)
    assert batch_snapshot(m) == before
    with pytest.raises(ValueError, match="18446744073709551615"):
        m.reset_for_new_sequences(huge)
    assert batch_snapshot(m) == before
    m.compact_batch(np.array([1, 0], dtype=np.uint64), 2, 2)   # in range: still accepted
    assert host(m.get_kv_cache_lengths()).tolist() == [4, 2]


# --- memory report: a hand count of every device array ------------------------------------------

def one_layer_hybrid(b, s):
    """One attention layer (H=1, D=8, fp16) and one Mamba layer (recurrent [1, 2, 3] fp32,
    conv [2, 3] fp16)."""
    kv = KVCacheConfig(b, s, [KVLayerConfig(1, 8)])
    mamba = MambaCacheConfig(1, b, 1, 2, 3, 2, 3)
    return HybridCacheManager(HybridCacheConfig(["attention", "mamba"], kv, mamba, b),
                              device="cpu")


def one_layer_linear(b, s):
    """The same layers as :func:`one_layer_hybrid`, in a LinearKVCache."""
    return LinearKVCache(LinearCacheConfig(1, b, s, 1, 8, num_mamba_layers=1, mamba_num_heads=1,
                                           mamba_head_dim=2, ssm_state_size=3, conv_dim=2,
                                           conv_kernel=3), device="cpu")


def test_memory_report_total_counts_every_descriptor_table():
    """Hand count for b=3, one attention layer (H=1, S=6, D=8, fp16), one Mamba layer
    (recurrent [1, 2, 3] fp32, conv [2, 3] fp16). Device arrays besides the caches: the
    KVLayerInfo table and its scratch (24 B per layer each) and the group's int32 layer labels;
    the int32 lengths, increments and
    mapping [b], status [1] and plan [4 + 8 b]; one 32-byte SlotTensorInfo per tensor that
    compaction moves (recurrent, conv, lengths); the Mamba copies' two int32 slot indices and
    their SlotTensorInfo tables (capture: 1 + 1 tensors, restore: 2); write_kv's int32 staging:
    row offsets [b + 1], positions [b] and its status word [1]; write_states' three int32 [b]
    index buffers and its one-layer tables (recurrent: 1, conv: 1, both: 2 rows);
    admit_sequences' int32 rows and slots [b] and its one-row lengths table."""
    b, s = 3, 6
    kv, rec, conv = b * 2 * 1 * s * 8 * 2, b * 1 * 2 * 3 * 4, b * 2 * 3 * 2
    metadata = (2 * 24 + 4 + (3 * b + 1 + 4 + 8 * b) * 4 + 3 * 32 + 2 * 4 + (1 + 1 + 2) * 32
                + (b + 1 + b + 1) * 4
                + 3 * b * 4 + (1 + 1 + 2) * 32      # write_states
                + 2 * b * 4 + 32)                   # admit_sequences
    for m in (one_layer_hybrid(b, s), one_layer_linear(b, s)):
        report = m.memory_report()
        assert (report["kv_cache"], report["recurrent"], report["conv"]) == (kv, rec, conv)
        assert report["metadata"] == metadata
        assert report["total"] == kv + rec + conv + metadata
