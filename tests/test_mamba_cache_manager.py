"""MambaCacheManager (docs/design.md §4): shapes, zeroing, clears, capture/restore and its
validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hcache.config.caches import MambaCacheConfig
from hcache.dtypes import DTYPE_NAMES, resolve_dtype
from hcache.slots.mamba import MambaCacheManager

import helpers
from helpers import host, put

DEVICES = helpers.DEVICES
L, B = 3, 4
REC = (2, 3, 5)        # heads, head_dim, state_size
CONV = (6, 4)          # conv_dim, conv_kernel




def manager(ssm="float32", conv="float16", device="cpu", layers=L):
    cfg = MambaCacheConfig(layers, B, *REC, *CONV, ssm_dtype=ssm, conv_dtype=conv)
    return MambaCacheManager(cfg, device=device)


def randomize(m, rng):
    """Random bytes in every state; returns host byte copies (recurrent list, conv list)."""
    out = ([], [])
    for i in range(m.num_layers):
        for kind, a in enumerate((m.get_recurrent_state(i), m.get_conv_state(i))):
            u8 = a.view(np.uint8)
            raw = rng.integers(0, 256, size=u8.shape, dtype=np.uint8)
            put(u8, raw)
            out[kind].append(raw)
    return out


def state_bytes(m):
    return ([host(m.get_recurrent_state(i).view(np.uint8)) for i in range(m.num_layers)],
            [host(m.get_conv_state(i).view(np.uint8)) for i in range(m.num_layers)])


def assert_states(m, want):
    got = state_bytes(m)
    for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_shapes_dtypes_zeroed(dtype, device):
    m = manager(ssm=dtype, conv=dtype, device=device)
    assert m.num_layers == L and m.config.num_layers == L
    for i in range(L):
        rec, conv = m.get_recurrent_state(i), m.get_conv_state(i)
        assert tuple(rec.shape) == (B,) + REC and tuple(conv.shape) == (B,) + CONV
        assert rec.dtype.itemsize == conv.dtype.itemsize == resolve_dtype(dtype).itemsize
        assert rec.flags.c_contiguous and conv.flags.c_contiguous
        assert not host(rec.view(np.uint8)).any() and not host(conv.view(np.uint8)).any()


def test_layers_are_distinct_and_views_persist():
    m = manager()
    m.get_recurrent_state(1)[2] = 3.5
    assert m.get_recurrent_state(1)[2, 1, 2, 4] == 3.5
    assert not m.get_recurrent_state(0).any() and not m.get_recurrent_state(2).any()
    assert not np.shares_memory(m.get_conv_state(0), m.get_conv_state(1))


@pytest.mark.parametrize("bad, exc", [(-1, IndexError), (L, IndexError), (True, TypeError),
                                      (0.0, TypeError)])
def test_layer_and_slot_index_errors(bad, exc):
    m = manager()
    for call in (m.get_recurrent_state, m.get_conv_state):
        with pytest.raises(exc):
            call(bad)
    slot = B if bad == L else bad
    for call in (m.clear_slot, m.capture_recurrent_states, m.capture_conv_states):
        with pytest.raises(exc):
            call(slot)


def test_config_type_checked():
    with pytest.raises(TypeError):
        MambaCacheManager(None)


@pytest.mark.parametrize("device", DEVICES)
def test_clear_states_and_clear_slot(device):
    m = manager(device=device)
    rec, conv = randomize(m, np.random.default_rng(0))
    m.clear_slot(2)
    for r, c in zip(rec, conv, strict=True):
        r[2] = 0
        c[2] = 0
    assert_states(m, (rec, conv))
    m.clear_states()
    assert not any(a.any() for a in state_bytes(m)[0] + state_bytes(m)[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_capture_restore_round_trip(dtype, device):
    m = manager(ssm=dtype, conv="bfloat16", device=device)
    rec, conv = randomize(m, np.random.default_rng(1))
    cap_r, cap_c = m.capture_recurrent_states(3), m.capture_conv_states(3)
    assert [tuple(t.shape) for t in cap_r] == [(1,) + REC] * L
    assert [tuple(t.shape) for t in cap_c] == [(1,) + CONV] * L
    for i in range(L):
        np.testing.assert_array_equal(host(cap_r[i].view(np.uint8))[0], rec[i][3])
        np.testing.assert_array_equal(host(cap_c[i].view(np.uint8))[0], conv[i][3])
    m.restore_states(cap_r, cap_c, 0)
    for r, c in zip(rec, conv, strict=True):
        r[0] = r[3]
        c[0] = c[3]
    assert_states(m, (rec, conv))


def test_capture_is_a_copy_and_unbatched_restore():
    m = manager()
    rec, conv = randomize(m, np.random.default_rng(2))
    cap_r, cap_c = m.capture_recurrent_states(1), m.capture_conv_states(1)
    m.clear_states()
    np.testing.assert_array_equal(cap_r[2].view(np.uint8)[0], rec[2][1])
    m.restore_states([t[0] for t in cap_r], [t[0] for t in cap_c], 2)   # [slot shape] works
    for i in range(L):
        np.testing.assert_array_equal(m.get_recurrent_state(i)[2].view(np.uint8), rec[i][1])
        np.testing.assert_array_equal(m.get_conv_state(i)[2].view(np.uint8), conv[i][1])
        assert not m.get_recurrent_state(i)[[0, 1, 3]].any()


def test_restore_rejected_writes_nothing():
    m = manager()
    randomize(m, np.random.default_rng(3))
    cap_r = [np.ones((1,) + REC, np.float32) for _ in range(L)]
    cap_c = [np.ones((1,) + CONV, np.float16) for _ in range(L)]
    before = state_bytes(m)
    wrong_dtype = cap_c[:-1] + [np.ones((1,) + CONV, np.float32)]
    wrong_shape = cap_c[:-1] + [np.ones((2,) + CONV, np.float16)]
    strided = cap_c[:-1] + [np.ones((1, 6, 8), np.float16)[:, :, ::2]]
    cases = [((cap_r, wrong_dtype, 0), ValueError), ((cap_r, wrong_shape, 0), ValueError),
             ((cap_r, strided, 0), ValueError), ((cap_r, cap_c[:-1], 0), ValueError),
             ((cap_r[:-1], cap_c, 0), ValueError), ((cap_r, cap_c + cap_c[:1], 0), ValueError),
             ((cap_r, cap_c[:-1] + ["x"], 0), TypeError), ((cap_r, 7, 0), TypeError),
             ((cap_r, cap_c, B), IndexError), ((cap_r, cap_c, -1), IndexError),
             ((cap_r, cap_c, 1.0), TypeError)]
    for args, exc in cases:
        with pytest.raises(exc):
            m.restore_states(*args)
        assert_states(m, before)


def test_zero_layers():
    m = manager(layers=0)
    assert m.num_layers == 0
    assert m.capture_recurrent_states(0) == [] and m.capture_conv_states(B - 1) == []
    m.restore_states([], [], 1)
    m.clear_states()
    m.clear_slot(0)
    # two int32 slot indices and write_states' three int32 [B] indices, no descriptor table
    metadata = 2 * 4 + 3 * B * 4
    assert m.memory_report() == {"recurrent": 0, "conv": 0, "metadata": metadata,
                                 "total": metadata, "layers": ()}
    with pytest.raises(IndexError):
        m.get_recurrent_state(0)


def test_memory_report_by_hand():
    m = manager(ssm="float32", conv="int8")
    rec = B * int(np.prod(REC)) * 4
    conv = B * int(np.prod(CONV)) * 1
    # metadata: two int32 slot indices and one 32-byte SlotTensorInfo per state view in the
    # capture tables (L recurrent, L conv) and the restore table (2 L); write_states' three
    # int32 [B] indices and its one-layer tables (recurrent 1, conv 1, both 2 rows)
    metadata = 2 * 4 + 4 * L * 32 + 3 * B * 4 + 4 * 32
    assert m.memory_report() == {"recurrent": L * rec, "conv": L * conv, "metadata": metadata,
                                 "total": L * (rec + conv) + metadata,
                                 "layers": (rec + conv,) * L}


@settings(max_examples=25)
@given(ssm=st.sampled_from(DTYPE_NAMES), conv=st.sampled_from(DTYPE_NAMES),
       ops_=st.lists(st.tuples(st.sampled_from(["copy", "clear"]), st.integers(0, B - 1),
                               st.integers(0, B - 1)), max_size=6),
       seed=st.integers(0, 2**32 - 1))
def test_slot_operations_against_model(ssm, conv, ops_, seed):
    m = manager(ssm=ssm, conv=conv)
    rec, cnv = randomize(m, np.random.default_rng(seed))
    for op, a, b in ops_:
        if op == "copy":
            m.restore_states(m.capture_recurrent_states(a), m.capture_conv_states(a), b)
            for x in rec + cnv:
                x[b] = x[a]
        else:
            m.clear_slot(a)
            for x in rec + cnv:
                x[a] = 0
    assert_states(m, (rec, cnv))
