"""ContinuousBatchingKVCacheManager (docs/design.md §5): call order, data written, errors,
diagnostics.

The oracle for the data is a byte model ``expected[block, kv, layer, pos, head, byte]`` updated
by hand from the documented semantics (token ``t`` of row ``i`` lands at the row's committed
length + ``t`` in the row's block), compared byte for byte with ``blocks_buf``.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from hcache.continuous.manager import (
    BatchInFlightError,
    ContinuousBatchingKVCacheCollection,
    ContinuousBatchingKVCacheManager,
    KVCacheStaticParams,
)
from hcache.device import resolve_device
from hcache.dtypes import DTYPE_NAMES
from hcache.errors import CacheCapacityError

import helpers
from helpers import host

DEVICES = helpers.DEVICES
H, D = 2, 3



def make(dtype="float16", n=4, s=8, layers=3, device="cpu", heads=H, size=D):
    return ContinuousBatchingKVCacheManager(dtype, KVCacheStaticParams(heads, size), n, s,
                                            layers, device=device)


def raw_bytes(m) -> np.ndarray:
    """``blocks_buf`` as bytes ``[N, 2, L, S, H, D * itemsize]`` (host copy)."""
    b = np.ascontiguousarray(host(m.blocks_buf))
    return b.view(np.uint8).reshape(*b.shape[:-1], -1).copy()


def tokens(m, rng, batch, t):
    """Random K or V rows ``[batch, t, H, D]``: (device array, host bytes)."""
    itemsize = m.blocks_buf.dtype.itemsize
    kp = m.kv_params
    b = rng.integers(0, 256, size=(batch, t, kp.num_heads, kp.head_size * itemsize),
                     dtype=np.uint8)
    arr = b.view(np.dtype(m.blocks_buf.dtype))
    return m.device.xp.asarray(arr), b


class Model:
    """Independent model: lengths per seq, blocks, expected bytes."""

    def __init__(self, m):
        self.m = m
        self.expected = np.zeros_like(raw_bytes(m))
        self.lengths: dict[int, int] = {}
        self.block: dict[int, int] = {}

    def write(self, seq_ids, layer, kb, vb):
        for i, sid in enumerate(seq_ids):
            for t in range(kb.shape[1]):
                pos = self.lengths[sid] + t
                self.expected[self.block[sid], 0, layer, pos] = kb[i, t]
                self.expected[self.block[sid], 1, layer, pos] = vb[i, t]


def state(m):
    """Everything observable that a rejected call must leave unchanged."""
    live = m.cache_lengths
    return (live, {s: m.block_of(s) for s in live}, m.num_free_blocks, m.in_flight,
            raw_bytes(m).tobytes())


# --- construction ---------------------------------------------------------------------------

def test_static_params_validated_and_frozen():
    p = KVCacheStaticParams(8, 128)
    assert (p.num_heads, p.head_size) == (8, 128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.num_heads = 2
    for bad in (0, -1):
        with pytest.raises(ValueError, match="num_heads"):
            KVCacheStaticParams(bad, 4)
        with pytest.raises(ValueError, match="head_size"):
            KVCacheStaticParams(4, bad)
    for bad in (1.0, True, "2", None):
        with pytest.raises(TypeError, match="num_heads"):
            KVCacheStaticParams(bad, 4)
    assert KVCacheStaticParams(np.int64(2), 4).num_heads == 2


def test_constructor_validation():
    p = KVCacheStaticParams(2, 4)
    with pytest.raises(TypeError, match="kv_params"):
        ContinuousBatchingKVCacheManager("float16", (2, 4), 2, 4, 1, device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        ContinuousBatchingKVCacheManager("float64", p, 2, 4, 1, device="cpu")
    for args, name in (((0, 4, 1), "max_batch_size"), ((2, 0, 1), "max_seq_len"),
                       ((2, 4, 0), "num_layers"), ((2, 2**31, 1), "max_seq_len")):
        with pytest.raises(ValueError, match=name):
            ContinuousBatchingKVCacheManager("float16", p, *args, device="cpu")
    with pytest.raises(TypeError, match="num_layers"):
        ContinuousBatchingKVCacheManager("float16", p, 2, 4, 1.5, device="cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_geometry_and_views(device):
    m = make("bfloat16", n=3, s=5, layers=4, device=device, heads=2, size=8)
    assert m.blocks_buf.shape == (3, 2, 4, 5, 2, 8)
    assert m.blocks_buf.dtype.itemsize == 2
    assert m.num_blocks == m.max_batch_size == 3 and m.max_seq_len == 5 and m.num_layers == 4
    assert not host(m.blocks_buf).view(np.uint8).any()
    [sid] = m.claim(1)
    c = m.fetch([sid])
    for layer in range(4):
        k, v = c.key_cache(layer), c.value_cache(layer)
        assert k.shape == v.shape == (3, 5, 2, 8)
        k[...] = 1          # zero-copy: the views alias blocks_buf at (:, kv, layer)
        assert host(m.blocks_buf[:, 0]).view(np.uint8).any(axis=(0, 2, 3, 4)).tolist() == [
            i == layer for i in range(4)]
        assert not host(m.blocks_buf[:, 1]).view(np.uint8).any()
        m.blocks_buf[:, 0, layer] = 0
    for bad, exc in ((4, IndexError), (-1, IndexError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="layer"):
            c.key_cache(bad)
        with pytest.raises(exc, match="layer"):
            c.value_cache(bad)


# --- the call order -------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_lifecycle_matches_model(dtype, device):
    """claim -> fetch/write/step (prompts, padded) -> (fetch/write/step)* -> release."""
    rng = np.random.default_rng(DTYPE_NAMES.index(dtype))
    m = make(dtype, n=4, s=9, layers=3, device=device)
    model = Model(m)
    ids = m.claim(3)
    assert len(set(ids)) == 3 and m.num_free_blocks == 1 and m.num_live_sequences == 3
    assert m.cache_lengths == dict.fromkeys(ids, 0)
    for sid in ids:
        model.block[sid], model.lengths[sid] = m.block_of(sid), 0
    assert sorted(model.block.values()) == [0, 1, 2]    # lowest free blocks first

    def run_step(seq_ids, new_tokens, valid):
        c = m.fetch(seq_ids)
        assert c.is_active and c.seq_ids == tuple(seq_ids)
        assert host(c.lookup_table).tolist() == [model.block[s] for s in seq_ids]
        assert host(c.cache_lengths).tolist() == [model.lengths[s] for s in seq_ids]
        assert c.lookup_table.dtype == c.cache_lengths.dtype == np.int32
        assert c.is_context_encoding == all(model.lengths[s] == 0 for s in seq_ids)
        for layer in range(m.num_layers):
            k, kb = tokens(m, rng, len(seq_ids), new_tokens)
            v, vb = tokens(m, rng, len(seq_ids), new_tokens)
            c.write(layer, k, v)
            model.write(seq_ids, layer, kb, vb)
        m.step(valid, c)
        for sid, n in zip(seq_ids, valid, strict=True):
            model.lengths[sid] += n
        assert not c.is_active and m.in_flight is None
        assert m.cache_lengths == model.lengths
        np.testing.assert_array_equal(raw_bytes(m), model.expected)
        m.check_invariants()
        return c

    # context encoding: ragged prompts written padded to 4 tokens, rows in a shuffled order
    order = [ids[2], ids[0], ids[1]]
    run_step(order, 4, [4, 2, 3])
    for _ in range(3):                                      # token generation
        run_step(ids, 1, [1, 1, 1])
    m.release(ids[1])
    del model.lengths[ids[1]]
    [late] = m.claim(1)                                     # joins mid-flight, gets a free block
    model.block[late], model.lengths[late] = m.block_of(late), 0
    assert model.block[late] in (1, 3)
    run_step([late], 3, [3])
    c = run_step([ids[0], late, ids[2]], 1, [1, 0, 1])      # a row may commit nothing
    assert c.host_cache_lengths == (5, 3, 7)
    # the views of an ended collection stay views of blocks_buf
    assert host(c.key_cache(2)).tobytes() == host(m.blocks_buf[:, 0, 2]).tobytes()
    for sid in (ids[0], ids[2], late):
        m.release(sid)
    assert m.num_free_blocks == 4 and m.num_live_sequences == 0 and m.cache_lengths == {}
    m.check_invariants()


def test_fetch_reuses_preallocated_buffers():
    m = make(n=4)
    ids = m.claim(4)
    c1 = m.fetch(ids[:3])
    m.step([0, 0, 0], c1)
    c2 = m.fetch(ids[1:])
    assert np.shares_memory(c1.lookup_table, c2.lookup_table)
    assert np.shares_memory(c1.cache_lengths, c2.cache_lengths)
    assert c2.lookup_table.shape == c2.cache_lengths.shape == (3,)
    assert c2.lookup_table.tolist() == [1, 2, 3]


def test_write_fills_exactly_the_new_positions_of_each_row():
    """Hand-computed case: two rows at lengths 2 and 0 write 2 tokens of layer 1."""
    m = make("float32", n=3, s=5, layers=2, heads=1, size=2)
    a, b = m.claim(2)
    c = m.fetch([a])
    m.step([2], c)
    c = m.fetch([b, a])            # row 0 -> block 1 (length 0), row 1 -> block 0 (length 2)
    k = np.arange(1, 9, dtype=np.float32).reshape(2, 2, 1, 2)
    c.write(1, k, -k)
    buf = m.blocks_buf
    assert buf[1, 0, 1, :, 0].tolist() == [[1, 2], [3, 4], [0, 0], [0, 0], [0, 0]]
    assert buf[0, 0, 1, :, 0].tolist() == [[0, 0], [0, 0], [5, 6], [7, 8], [0, 0]]
    assert buf[0, 1, 1, 2:4, 0].tolist() == [[-5, -6], [-7, -8]]
    assert not buf[:, :, 0].any() and not buf[2].any()
    c.write(1, k[:, :0], k[:, :0])         # zero new tokens: nothing happens
    m.step([2, 2], c)
    assert m.cache_lengths == {a: 4, b: 2}


@pytest.mark.parametrize("device", DEVICES)
def test_ragged_write_puts_each_rows_tokens_at_its_length(device):
    """Rows of 3, 0 and 2 new tokens in one flat [total, H, D] array (one launch)."""
    m = make("float32", n=3, s=6, layers=2, heads=1, size=2, device=device)
    a, b, c = m.claim(3)
    coll = m.fetch([a, b, c])
    m.step([1, 4, 0], coll)                       # committed lengths 1, 4, 0
    coll = m.fetch([a, b, c])
    xp = resolve_device(device).xp
    k = xp.asarray(np.arange(1, 11, dtype=np.float32).reshape(5, 1, 2))
    coll.write(0, k, -k, seq_lengths=[3, 0, 2])
    buf = host(m.blocks_buf)
    ba, bb, bc = (m.block_of(x) for x in (a, b, c))
    assert buf[ba, 0, 0, 1:4, 0].tolist() == [[1, 2], [3, 4], [5, 6]]
    assert buf[bc, 1, 0, 0:2, 0].tolist() == [[-7, -8], [-9, -10]]
    assert not buf[bb].any() and not buf[:, :, 1].any()
    assert not buf[ba, :, 0, [0, 4, 5]].any() and not buf[bc, :, 0, 2:].any()
    m.step([3, 0, 2], coll)
    assert m.cache_lengths == {a: 4, b: 4, c: 2}


def test_ragged_write_errors_write_nothing():
    m = make("float16", n=2, s=4, layers=1, heads=1, size=2)
    a, b = m.claim(2)
    coll = m.fetch([a, b])
    m.step([2, 0], coll)
    coll = m.fetch([a, b])
    k = np.ones((3, 1, 2), np.float16)
    for bad, exc in (([1, 1], ValueError),          # sum 2 != 3 tokens
                     ([3, 0], ValueError),          # row 0: 2 + 3 > max_seq_len 4
                     ([1, 1, 1], ValueError),       # one length per row
                     ([4, -1], ValueError),
                     ([1.5, 1.5], TypeError),
                     ("12", TypeError)):
        with pytest.raises(exc):
            coll.write(0, k, k, seq_lengths=bad)
    with pytest.raises(ValueError, match=r"key: expected shape \[total_tokens, 1, 2\]"):
        coll.write(0, k.reshape(1, 3, 1, 2), k.reshape(1, 3, 1, 2), seq_lengths=[2, 1])
    assert not m.blocks_buf.any()
    coll.write(0, k, k, seq_lengths=[2, 1])
    assert m.blocks_buf.sum() == 2 * 3 * 2


# --- errors leave the state unchanged -------------------------------------------------------

def test_claim_errors():
    m = make(n=3)
    first = m.claim(2)
    before = state(m)
    with pytest.raises(CacheCapacityError) as info:
        m.claim(2)
    assert (info.value.required, info.value.available) == (2, 1)
    with pytest.raises(CacheCapacityError) as info:
        m.claim(7)
    assert (info.value.required, info.value.available) == (7, 1)
    with pytest.raises(ValueError, match="batch_size"):
        m.claim(-1)
    for bad in (1.0, True, "1", None):
        with pytest.raises(TypeError, match="batch_size"):
            m.claim(bad)
    assert state(m) == before
    assert m.claim(0) == [] and state(m) == before
    assert m.can_claim(1) and not m.can_claim(2) and m.can_claim(0)
    [third] = m.claim(1)
    assert third not in first


def test_fetch_errors():
    m = make(n=4)
    a, b, c = m.claim(3)
    m.release(c)
    before = state(m)
    for bad, exc, match in (([], ValueError, "at least one"),
                            ([a, a], ValueError, "distinct"),
                            ([a, 99], ValueError, "unknown"),
                            ([c], ValueError, "unknown"),          # released
                            ([-1], ValueError, "unknown"),
                            ([a, 1.0], TypeError, r"seq_ids\[1\]"),
                            ([True], TypeError, "seq_ids"),
                            (a, TypeError, "seq_ids"),
                            ("ab", TypeError, "seq_ids")):
        with pytest.raises(exc, match=match):
            m.fetch(bad)
        assert state(m) == before
    with pytest.raises(TypeError, match="stream"):
        m.fetch([a], stream="s")
    assert state(m) == before
    coll = m.fetch((b, a))                    # any iterable of ids
    before = state(m)
    with pytest.raises(BatchInFlightError, match="in flight"):
        m.fetch([a])
    with pytest.raises(ValueError, match="in flight"):
        m.fetch([b], wait=True)               # the caller holds the batch: refused, not a hang
    assert state(m) == before and m.in_flight is coll


def test_step_errors():
    m = make(n=3, s=6)
    a, b = m.claim(2)
    c = m.fetch([a])
    m.step([4], c)
    coll = m.fetch([a, b])
    before = state(m)
    for bad, exc, match in (([1], ValueError, "2 lengths"),
                            ([1, 1, 1], ValueError, "2 lengths"),
                            ([1, -1], ValueError, ">= 0"),
                            ([3, 0], ValueError, r"valid_lengths\[0\]"),   # 4 + 3 > 6
                            ([0, 7], ValueError, r"valid_lengths\[1\]"),
                            ([1.0, 1], TypeError, r"valid_lengths\[0\]"),
                            (np.array([1.0, 1.0]), TypeError, "integer"),
                            (np.array([[1, 1]]), TypeError, "1-D"),
                            (3, TypeError, "valid_lengths")):
        with pytest.raises(exc, match=match):
            m.step(bad, coll)
        assert state(m) == before
    with pytest.raises(TypeError, match="collection"):
        m.step([1, 1], "batch")
    other = make(n=3, s=6)
    foreign = other.fetch(other.claim(2))
    with pytest.raises(ValueError, match="foreign"):
        m.step([1, 1], foreign)
    assert state(m) == before and foreign.is_active
    m.step(np.array([2, 6], dtype=np.int64), coll)
    assert m.cache_lengths == {a: 6, b: 6}
    after = state(m)
    with pytest.raises(ValueError, match="ended"):
        m.step([0, 0], coll)
    assert state(m) == after


def test_write_errors():
    m = make("float16", n=3, s=6, layers=2)
    a, b = m.claim(2)
    c = m.fetch([a])
    m.step([5], c)
    coll = m.fetch([b, a])
    ok = np.zeros((2, 1, H, D), np.float16)
    before = state(m)
    cases = [((2, ok, ok), IndexError, "layer"), ((-1, ok, ok), IndexError, "layer"),
             ((1.0, ok, ok), TypeError, "layer"),
             ((0, ok.tolist(), ok), TypeError, "key"),
             ((0, ok, np.zeros((3, 1, H, D), np.float16)), ValueError, "value: expected shape"),
             ((0, np.zeros((2, 1, H + 1, D), np.float16), ok), ValueError, "key"),
             ((0, np.zeros((2, 1, H, D + 1), np.float16), ok), ValueError, "key"),
             ((0, np.zeros((2, H, D), np.float16), ok), ValueError, "key"),
             ((0, ok.astype(np.float32), ok), ValueError, "dtype"),
             ((0, ok, np.zeros((2, 2, H, D), np.float16)), ValueError, "shape of key"),
             ((0, np.zeros((2, 2, H, 2 * D), np.float16)[..., ::2], ok), ValueError,
              "contiguous"),
             # row 1 (seq a) is at length 5 of 6: two new tokens would pass max_seq_len
             ((0, np.ones((2, 2, H, D), np.float16), np.ones((2, 2, H, D), np.float16)),
              ValueError, "row 1")]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            coll.write(*args)
        assert state(m) == before
    coll.write(1, ok + 1, ok + 2)
    m.step([1, 1], coll)
    after = state(m)
    with pytest.raises(ValueError, match="ended"):
        coll.write(1, ok, ok)
    assert state(m) == after


def test_release_errors_and_id_freshness():
    m = make(n=2)
    a, b = m.claim(2)
    coll = m.fetch([a])
    before = state(m)
    with pytest.raises(ValueError, match="in flight"):
        m.release(a)
    for bad, exc in ((7, ValueError), (-1, ValueError), (1.5, TypeError), (None, TypeError)):
        with pytest.raises(exc, match="seq_id"):
            m.release(bad)
    assert state(m) == before
    m.release(b)                                  # not in the batch: allowed while in flight
    m.step([0], coll)
    m.release(a)
    with pytest.raises(ValueError, match="live sequence"):
        m.release(a)
    with pytest.raises(ValueError, match="live sequence"):
        m.block_of(a)
    new = m.claim(2)                              # blocks are reused, ids never are
    assert not set(new) & {a, b}
    assert sorted(m.block_of(s) for s in new) == [0, 1]
    with pytest.raises(ValueError, match="unknown"):
        m.fetch([a])


# --- waiting for the batch in flight --------------------------------------------------------

def test_fetch_wait_hands_over_between_threads():
    m = make(n=4)
    a, b = m.claim(2)
    coll = m.fetch([a])
    got, started = [], threading.Event()

    def other():
        started.set()
        got.append(m.fetch([b], wait=True, timeout=10))

    t = threading.Thread(target=other)
    t.start()
    started.wait()
    t.join(0.05)
    assert t.is_alive() and not got              # blocked while the batch is in flight
    m.step([1], coll)
    t.join(10)
    assert not t.is_alive() and got[0].seq_ids == (b,) and m.in_flight is got[0]
    with pytest.raises(ValueError, match="in flight"):   # the batch belongs to the thread
        m.fetch([a], wait=True, timeout=0.01)
    m.step([1], got[0])


def test_fetch_wait_timeout():
    m = make(n=4)
    a, b = m.claim(2)

    def hold():
        m.fetch([a])

    t = threading.Thread(target=hold)
    t.start()
    t.join()
    before = state(m)
    with pytest.raises(BatchInFlightError, match="within"):
        m.fetch([b], wait=True, timeout=0.05)
    assert state(m) == before


# --- diagnostics ----------------------------------------------------------------------------

def test_check_invariants_reports_every_broken_invariant():
    m = make(n=4, s=5)
    a, b, _ = m.claim(3)
    m.check_invariants()
    seqs = m._sequences
    seqs.block_of[b] = seqs.block_of[a]          # two live sequences on one block
    seqs.block_len[seqs.block_of[a]] = 6         # past max_seq_len
    with pytest.raises(RuntimeError) as info:
        m.check_invariants()
    text = str(info.value)
    assert "two live sequences" in text and "lengths outside" in text and "do not make" in text


def test_check_invariants_checks_the_batch_in_flight():
    m = make(n=4, s=5)
    a, b = m.claim(2)
    coll = m.fetch([a, b])
    m.check_invariants()
    coll.lookup_table[0] = 3                     # device table disagrees with the batch
    with pytest.raises(RuntimeError, match="lookup_table"):
        m.check_invariants()


def test_memory_report():
    m = make("bfloat16", n=4, s=8, layers=3, heads=2, size=5)
    a, b = m.claim(2)
    c = m.fetch([a, b])
    m.step([3, 5], c)
    r = m.memory_report()
    per_token = 2 * 3 * 2 * 5 * 2                 # K and V, layers, heads, head size, bytes
    assert r["bytes_per_token"] == per_token
    assert r["bytes_per_block"] == per_token * 8
    assert r["blocks_buf_bytes"] == per_token * 8 * 4
    assert r["index_buffer_bytes"] == 2 * 4 * 4
    # metadata: the index buffers, the int32 row offsets [n + 1] and, per layer, its
    # KVLayerInfo and pointer-scratch rows (24 B each) and int32 label
    assert r["metadata_bytes"] == 2 * 4 * 4 + 5 * 4 + 3 * (2 * 24 + 4)
    assert r["total_bytes"] == r["blocks_buf_bytes"] + r["metadata_bytes"]
    assert (r["free_blocks"], r["live_sequences"], r["committed_tokens"]) == (2, 2, 8)
    assert r["capacity_tokens"] == 32 and r["token_utilization"] == 8 / 32
    assert r["dtype"] == "bfloat16" and r["device"] == "cpu"
    assert isinstance(repr(m), str) and isinstance(repr(c), str)
    assert isinstance(c, ContinuousBatchingKVCacheCollection)


# --- argument edge cases: int64 overflow, float arrays, streams, timeouts, thread ids ----------
# One float32 head of 2 elements, 3 blocks of 8 tokens, 2 layers; ``state`` is the one above.

SMALL_H, SMALL_D = 1, 2


def make_small(n=3, s=8, layers=2):
    return make("float32", n, s, layers, heads=SMALL_H, size=SMALL_D)


@pytest.mark.parametrize("huge", [[2**63 - 1], np.array([2**63 - 1], dtype=np.int64), [2**70],
                                  np.array([2**64 - 1], dtype=np.uint64),
                                  [np.uint64(2**64 - 1)]])
def test_step_refuses_lengths_that_overflow_int64(huge):
    """3 committed + a huge length is past max_seq_len: ValueError, nothing changes (it used to
    wrap to a negative committed length, or raise OverflowError)."""
    m = make_small()
    [a] = m.claim(1)
    c = m.fetch([a])
    m.step([3], c)
    coll = m.fetch([a])
    before = state(m)
    with pytest.raises(ValueError, match=r"valid_lengths\[0\]: expected at most 5"):
        m.step(huge, coll)
    assert state(m) == before and m.cache_lengths == {a: 3} and coll.is_active
    m.step([5], coll)
    assert m.cache_lengths == {a: 8}
    m.check_invariants()


def test_int_arguments_refuse_float_arrays():
    """A 0-d float array is not an int: it must not be truncated to one."""
    m = make_small()
    a, b = m.claim(2)
    before = state(m)
    for call, match in ((lambda: m.fetch([np.array(a + 0.5)]), r"seq_ids\[0\]"),
                        (lambda: m.release(np.array(float(b))), "seq_id"),
                        (lambda: m.block_of(np.array(float(a))), "seq_id"),
                        (lambda: m.claim(np.array(1.5)), "batch_size"),
                        (lambda: m.can_claim(np.array(1.0)), "batch_size"),
                        (lambda: KVCacheStaticParams(np.array(2.5), 4), "num_heads"),
                        (lambda: ContinuousBatchingKVCacheManager(
                            "float32", KVCacheStaticParams(1, 2), np.array(2.0), 4, 1,
                            device="cpu"), "max_batch_size")):
        with pytest.raises(TypeError, match=match):
            call()
        assert state(m) == before
    coll = m.fetch([np.array(a), np.int64(b)])     # 0-d int arrays and numpy ints are ints
    before = state(m)
    for call, match in ((lambda: m.step([np.array(2.7), 0], coll), r"valid_lengths\[0\]"),
                        (lambda: coll.key_cache(np.array(1.0)), "layer"),
                        (lambda: coll.write(np.array(0.0), *[np.zeros(
                            (2, 1, SMALL_H, SMALL_D), np.float32)] * 2), "layer")):
        with pytest.raises(TypeError, match=match):
            call()
        assert state(m) == before
    m.step([np.array(2), np.int32(1)], coll)
    assert m.cache_lengths == {a: 2, b: 1}


def test_write_validates_stream_on_cpu():
    """docs/design.md §2: the stream is ignored on cpu, but a non-stream is a caller mistake
    (``fetch`` refuses it on cpu too); nothing is written."""
    m = make_small()
    [a] = m.claim(1)
    coll = m.fetch([a])
    k = np.ones((1, 2, SMALL_H, SMALL_D), np.float32)
    before = state(m)
    with pytest.raises(TypeError, match="stream"):
        coll.write(0, k, k, stream="s")
    assert state(m) == before and not m.blocks_buf.any()
    coll.write(0, k, k, stream=0)
    assert m.blocks_buf[0, :, 0, :2].tolist() == [[[[1.0, 1.0]]] * 2] * 2


def test_fetch_timeout_validated():
    m = make_small()
    a, b = m.claim(2)
    for held in (False, True):
        coll = m.fetch([a]) if held else None
        before = state(m)
        for bad, exc in (("1", TypeError), (True, TypeError), (-1, ValueError),
                         (float("nan"), ValueError)):
            with pytest.raises(exc, match="timeout"):
                m.fetch([b], wait=True, timeout=bad)
            assert state(m) == before
        if held:
            m.step([0], coll)


def test_fetch_wait_from_a_thread_that_reuses_the_owner_ident():
    """The batch's owner thread exited; a new thread that got the same (recycled) thread id
    does not hold the batch, so ``fetch(wait=True)`` must wait (here: time out), not refuse at
    once as if it were the owner."""
    m = make_small()
    a, b = m.claim(2)
    owner = []

    def hold():
        owner.append(threading.get_ident())
        m.fetch([a])

    t = threading.Thread(target=hold)
    t.start()
    t.join()
    outcome = []

    def waiter():
        if threading.get_ident() != owner[0]:
            return
        try:
            m.fetch([b], wait=True, timeout=0.05)
        except BatchInFlightError as exc:
            outcome.append(str(exc))

    for _ in range(50):
        t = threading.Thread(target=waiter)
        t.start()
        t.join()
        if outcome:
            break
    if not outcome:
        pytest.skip("this platform did not recycle the thread id")
    assert "within" in outcome[0], outcome[0]       # timed out waiting, not refused as owner
    assert m.in_flight is not None and m.in_flight.seq_ids == (a,)


# --- the decode fast paths: a repeated fetch reuses its lookup, step commits vectorized ------

def test_repeated_fetch_follows_claims_and_releases():
    m = make(n=4, s=8)
    a, b, c = m.claim(3)
    m.step(np.ones(2, np.int32), m.fetch([a, b]))
    m.step([1, 1], m.fetch([a, b]))                  # the same ids again
    m.release(b)
    with pytest.raises(ValueError, match="unknown"):
        m.fetch([a, b])                              # b is gone, even though [a, b] was cached
    (d,) = m.claim(1)                                # d takes b's block, with no tokens
    coll = m.fetch([a, d])
    assert coll.blocks == (m.block_of(a), m.block_of(d)) and coll.host_cache_lengths == (2, 0)
    m.step([3, 1], coll)
    assert m.cache_lengths == {a: 5, c: 0, d: 1}
    m.check_invariants()


def test_repeated_fetch_still_checks_types_and_duplicates():
    m = make(n=4, s=8)
    a, b = m.claim(2)
    m.step([0, 0], m.fetch([a, b]))
    for bad in ([float(a), b], [a, True], [a, np.float64(b)]):
        with pytest.raises(TypeError, match=r"seq_ids\[\d\]"):
            m.fetch(bad)
    with pytest.raises(ValueError, match="distinct"):
        m.fetch([a, a])
    coll = m.fetch(np.array([b, a]))                 # an integer array works like a list
    assert coll.seq_ids == (b, a)


@pytest.mark.parametrize("lengths", [[2**70, 0], np.array([2**64 - 1, 0], np.uint64),
                                     [9, 0], np.array([9, 0], np.int32)])
def test_step_refuses_a_length_past_the_block_with_its_exact_value(lengths):
    m = make(n=2, s=8)
    a, b = m.claim(2)
    coll = m.fetch([a, b])
    before = state(m)
    with pytest.raises(ValueError, match=rf"valid_lengths\[0\]: .* got {int(lengths[0])}$"):
        m.step(lengths, coll)
    assert state(m) == before and m.in_flight is coll


@pytest.mark.parametrize("lengths", [np.array([1, -1], np.int64), [1, -1]])
def test_step_refuses_negative_lengths_from_arrays_and_lists(lengths):
    m = make(n=2, s=8)
    coll = m.fetch(m.claim(2))
    with pytest.raises(ValueError, match="lengths >= 0"):
        m.step(lengths, coll)
    assert m.in_flight is coll and set(m.cache_lengths.values()) == {0}


# --- refusals found by trying every input, and reset -------------------------------------------

def test_fetch_wait_must_be_a_bool():
    m = make(n=2, s=8)
    ids = m.claim(2)
    before = state(m)
    with pytest.raises(TypeError, match="wait: expected a bool, got str"):
        m.fetch(ids, wait="yes")
    assert state(m) == before and m.in_flight is None


def test_ragged_write_of_too_many_tokens_is_a_value_error_not_an_overflow():
    m = make(n=3, s=8)
    coll = m.fetch(m.claim(3))
    rows = np.zeros((3, H, D), np.float16)
    before = state(m)
    with pytest.raises(ValueError, match=r"seq_lengths\[0\]: expected at most 8 new tokens, "
                                         r"got 9223372036854775808"):
        coll.write_kv(0, rows, rows, seq_lengths=[2**63] * 3)
    assert state(m) == before


def test_reset_frees_every_block_and_ends_the_batch():
    m = make(n=3, s=8)
    a, b, c = m.claim(3)
    m.step([4, 2, 1], m.fetch([a, b, c]))
    coll = m.fetch([a, b])
    m.reset()
    assert m.num_free_blocks == 3 and m.num_live_sequences == 0 and m.in_flight is None
    assert m.cache_lengths == {} and not coll.is_active
    rows = np.zeros((2, 1, H, D), np.float16)
    with pytest.raises(ValueError, match="ended collection"):
        coll.write_kv(0, rows, rows)
    with pytest.raises(ValueError, match="unknown"):
        m.fetch([a])                                  # old ids never come back
    (d,) = m.claim(1)
    assert d > c and m.cache_lengths == {d: 0}
    m.step([1], m.fetch([d]))
    m.check_invariants()


def test_max_names_of_seed_004_are_read_only_aliases():
    """Issue 21 item 9: MAX's CollectionType, BlocksType, inflight_batch, this_device,
    other_device, blocks_nd_buf and seq_id_counter, each what hcache's own name holds."""
    from hcache import Device

    mgr = ContinuousBatchingKVCacheManager("float16", KVCacheStaticParams(2, 4),
                                           max_batch_size=3, max_seq_len=8, num_layers=2,
                                           device="cpu")
    assert mgr.CollectionType is ContinuousBatchingKVCacheManager.CollectionType
    assert mgr.BlocksType is np.ndarray and isinstance(mgr.blocks_buf, mgr.BlocksType)
    assert mgr.blocks_nd_buf is mgr.blocks_buf
    assert mgr.this_device == mgr.device and mgr.other_device == Device("cpu")
    assert mgr.seq_id_counter == 0 and mgr.inflight_batch is None
    ids = mgr.claim(2)
    assert mgr.seq_id_counter == 2
    mgr.release(ids[0])
    assert mgr.seq_id_counter == 2                         # ids are never handed out twice
    batch = mgr.fetch(ids[1:])
    assert isinstance(batch, mgr.CollectionType) and mgr.inflight_batch is batch
    mgr.step([1], batch)
    assert mgr.inflight_batch is None
    for name in ("BlocksType", "blocks_nd_buf", "inflight_batch", "this_device",
                 "other_device", "seq_id_counter"):
        with pytest.raises(AttributeError):
            setattr(mgr, name, None)
