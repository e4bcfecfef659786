"""The ``kv_capture`` family (kernels/kv_capture.cu, hcache/ops/kv_capture.py): ``kv_capture``,
``kv_restore`` and ``kv_prefix_copy``, all launching ``hc_kv_capture``.

Oracles: the NumPy reference (:mod:`hcache.ops.reference`) must give the kernel's bytes and
status count; both must match a naive slicing model (tokens ``[0, n)`` of one slot of every
layer to or from compact tensors). The kernel runs on the host emulation of the real ``.cu``
(``emu``, ``emu-reverse``) and on CuPy (``gpu`` tier); every array sits between canary bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hcache import ops
from hcache.dtypes import DTYPE_NAMES, resolve_dtype
from hcache.ops.tables import KVGroup

from helpers import host
from kernel_cases import (
    BACKENDS,
    HEAD_DIMS,
    WITH_REFERENCE,
    Arena,
    as_bytes,
    assert_same_bytes,
    dtypes,
    kernel_env,
    misaligns,
    on,
    twins,
)


@st.composite
def prefix_cases(draw, components=(2,)):
    seq = draw(st.integers(1, 6))
    return dict(components=draw(st.sampled_from(components)), dtype=draw(dtypes),
                head_dim=draw(st.sampled_from(HEAD_DIMS)), seq=seq,
                slots=draw(st.integers(1, 4)),
                heads=draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)),
                slot=draw(st.integers(-2, 5)), n=draw(st.integers(0, seq + 2)),
                misalign=draw(misaligns), seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("to_cache", [False, True], ids=["capture", "restore"])
@given(c=prefix_cases())
def test_prefix_copy_matches_reference_and_model(kind, to_cache, c):
    """Unchecked kv_prefix_copy, both directions, with slots and lengths in and out of range:
    the kernel's caches, compact tensors and status equal the reference's, which equal the
    slicing model's (an invalid call copies nothing and counts every layer)."""
    xp, backend = kernel_env(kind)
    ref_arena, k_arena = twins(c["seed"], xp)
    n = min(c["n"], c["seq"] + 2)

    def state(arena):
        comps = c["components"]
        layers = [arena.array((c["slots"], comps, h, c["seq"], c["head_dim"]), c["dtype"],
                              misalign=c["misalign"] * c["dtype"].itemsize)
                  for h in c["heads"]]
        compact = [arena.array((comps, h, n, c["head_dim"]), c["dtype"]) for h in c["heads"]]
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
        assert_same_bytes(r, k)
        assert_same_bytes(e, r)
    want_bad = 0 if valid or n == 0 else len(c["heads"])
    assert int(rstat[0]) == int(kstat[0]) == want_bad
    k_arena.check_canaries()


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("to_cache", [False, True], ids=["capture", "restore"])
@settings(max_examples=40)
@given(c=prefix_cases(components=(1,)))
def test_latent_prefix_copy_matches_reference_and_model(kind, to_cache, c):
    """Latent caches and compact tensors ``[1, H, n, D]``, both directions, slots and lengths
    in and out of range: kernel = reference = slicing model, canaries intact."""
    test_prefix_copy_matches_reference_and_model.hypothesis.inner_test(kind, to_cache, c)


@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_latent_capture_checks_the_component_count(kind):
    """A latent group's compact tensors have one plane: a two-plane tensor is refused before
    anything is copied, and a round trip moves exactly the latent rows."""
    xp, backend = kernel_env(kind)
    rng = np.random.default_rng(5)
    cache = on(xp, rng.standard_normal((3, 1, 1, 6, 576)).astype(np.float16))
    group = KVGroup([cache])
    with pytest.raises(ValueError, match=r"compact\[0\]: expected shape \[1, 1, n, 576\]"):
        ops.kv_capture(group, 1, 4, [xp.zeros((2, 1, 4, 576), np.float16)], backend=backend)
    out = [xp.zeros((1, 1, 4, 576), np.float16)]
    ops.kv_capture(group, 1, 4, out, backend=backend)
    np.testing.assert_array_equal(host(out[0]), host(cache)[1, :, :, :4])
    ops.kv_restore(group, out, 2, backend=backend)
    np.testing.assert_array_equal(host(cache)[2, :, :, :4], host(cache)[1, :, :, :4])


@pytest.mark.parametrize("kind", WITH_REFERENCE)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("head_dim", (8, 36, 80, 96, 512))
def test_capture_restore_round_trip(kind, dtype, head_dim):
    """kv_capture of slot 1 then kv_restore into slot 2, per dtype and head dim, layers of
    different head counts: the captured tensors equal the slot's prefix and the restored slot
    equals them (slicing model); reference and kernel alike."""
    xp, backend = kernel_env(kind)
    dt = resolve_dtype(dtype)
    arena = Arena(np.random.default_rng(head_dim + 3), xp)
    layers = [arena.array((3, 2, h, 5, head_dim), dt) for h in (2, 1, 3)]
    group = KVGroup(layers)
    saved = [arena.array((2, h, 4, head_dim), dt, fill="zeros") for h in (2, 1, 3)]
    ops.kv_capture(group, 1, 4, saved, backend=backend)
    for layer, s in zip(layers, saved):
        assert np.array_equal(as_bytes(s), as_bytes(host(layer)[1, :, :, :4]))
    before = [host(a).copy() for a in layers]
    ops.kv_restore(group, saved, 2, backend=backend)
    for layer, b, s in zip(layers, before, saved):
        want = b.copy()
        want[2, :, :, :4] = host(s)
        assert np.array_equal(as_bytes(layer), as_bytes(want))
    arena.check_canaries()


@pytest.mark.parametrize("kind", WITH_REFERENCE)
@settings(max_examples=20, deadline=None)
@given(targets=st.lists(st.integers(-1, 4), min_size=0, max_size=4),
       head_dim=st.sampled_from((8, 36, 80)), n=st.integers(1, 5))
def test_restore_into_several_slots_in_one_launch(kind, targets, head_dim, n):
    """kv_restore with ``more_slots``: slot 0 and every in-range target get the prefix, other
    slots (and out-of-range targets: skipped) are untouched; the reference agrees, one launch
    (slicing model)."""
    xp, backend = kernel_env(kind)
    arena = Arena(np.random.default_rng(head_dim + n), xp)
    layers = [arena.array((4, 2, h, 5, head_dim), np.float16) for h in (2, 1)]
    group = KVGroup(layers)
    saved = [arena.array((2, h, n, head_dim), np.float16) for h in (2, 1)]
    before = [host(a).copy() for a in layers]
    more = xp.asarray(np.array(targets, np.int32))
    ops.kv_restore(group, saved, 0, more_slots=more, backend=backend)
    for layer, b, s in zip(layers, before, saved):
        want = b.copy()
        for slot in [0, *targets]:
            if 0 <= slot < 4:
                want[slot, :, :, :n] = host(s)
        assert np.array_equal(as_bytes(layer), as_bytes(want))
    arena.check_canaries()


@pytest.mark.parametrize("kind", WITH_REFERENCE)
def test_kv_prefix_copy_scalars_outside_c_int_raise(kind):
    """kv_prefix_copy with a slot outside C int raises ValueError before touching the cache or
    the status; reference and kernel alike."""
    xp, backend = kernel_env(kind)
    cache = np.arange(2 * 2 * 1 * 4 * 8, dtype=np.uint8).reshape(2, 2, 1, 4, 8)
    layer = on(xp, cache.copy())
    status = xp.zeros(1, np.int32)
    with pytest.raises(ValueError, match="slot: expected"):
        ops.kv_prefix_copy(KVGroup([layer]), 2**40, 1, [xp.zeros((2, 1, 1, 8), np.uint8)],
                           to_cache=False, status=status, backend=backend)
    assert not as_bytes(status).any()
    np.testing.assert_array_equal(as_bytes(layer), cache.reshape(-1))


def test_kv_capture_and_restore_validate_slot_and_length():
    """kv_capture / kv_restore refuse a slot past the group (IndexError), a length past the
    cache and saved tensors of different lengths (ValueError), naming the argument."""
    cache = np.zeros((2, 2, 1, 4, 8), np.float16)
    group = KVGroup([cache])
    with pytest.raises(IndexError, match="slot: expected a slot in"):
        ops.kv_capture(group, 2, 1, [np.zeros((2, 1, 1, 8), np.float16)])
    with pytest.raises(ValueError, match="num_tokens: expected a length in"):
        ops.kv_capture(group, 0, 5, [np.zeros((2, 1, 5, 8), np.float16)])
    with pytest.raises(ValueError, match="saved: expected one token count"):
        ops.kv_restore(KVGroup([cache, cache.copy()]),
                       [np.zeros((2, 1, 1, 8), np.float16), np.zeros((2, 1, 2, 8), np.float16)],
                       0)
