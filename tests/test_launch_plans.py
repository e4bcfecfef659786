"""The host path of a launch (issue 23, docs/design.md §8 "Plan once, launch cheaply"), on the
emulated device: every steady-state call of the issue's table makes at most 40 hcache Python
calls per launch (a count, not a time); what a step plan or a launch memo validated once is
judged again when it can have changed (new step arrays, new lengths, another active batch, new
K/V pointers, bad rows), against the NumPy reference of the write; a call on the current
device and stream enters no scope; plain lists of ints take the vectorized path with the
argument's name and index in every error."""

from __future__ import annotations

import numpy as np
import pytest

import hcache
from hcache import ops
from hcache._checks import token_counts
from hcache.bench import calls
from hcache.ops import reference as ref
from hcache.ops.tables import KVGroup
from hcache.runtime.device import resolve_device

from helpers import host

pytestmark = pytest.mark.emulated


@pytest.mark.parametrize("name, make", calls.CASES, ids=[n for n, _ in calls.CASES])
def test_a_steady_state_call_makes_at_most_40_hcache_calls_per_launch(emu_rt, name, make):
    call = make(resolve_device("cuda"))
    counter = calls.count_calls(call, emu_rt)
    assert counter.calls > 0   # the counter sees hcache's code
    assert counter.per_launch <= calls.GOAL_CALLS, (
        f"{name}: {counter.calls} calls for {counter.launches} launches; the most frequent: "
        f"{sorted(counter.names.items(), key=lambda kv: -kv[1])[:8]}")


def test_the_counter_counts_calls_and_launches(emu_rt):
    xp = emu_rt.xp
    lengths = xp.zeros(8, np.int32)
    counter = calls.count_calls(lambda: ops.lengths_add(lengths, 8, 1, 100), emu_rt, warmup=0)
    assert counter.launches == 1
    assert counter.names.get("lengths.py:lengths_add") == 1   # the op itself, once
    assert host(lengths).tolist() == [1] * 8


# --- ops.kv_write: the step plan --------------------------------------------------------------

def _group(xp, rng, layers=3, batch=4, heads=(2, 1, 2), seq=16, dim=8):
    caches = [xp.asarray(rng.standard_normal((batch, 2, heads[i], seq, dim)).astype(np.float16))
              for i in range(layers)]
    return KVGroup(caches), caches


def _rows(xp, rng, n, heads, dim=8):
    return xp.asarray(rng.standard_normal((n, heads, dim)).astype(np.float16))


def _model(caches):
    """A NumPy model of the group: host copies of the caches."""
    return KVGroup([host(c) for c in caches])


def test_a_planned_step_writes_what_the_reference_writes_and_new_step_arrays_replan(emu_rt):
    xp, rng = emu_rt.xp, np.random.default_rng(0)
    group, caches = _group(xp, rng)
    model = _model(caches)
    for step_lengths in ([0, 3, 5, 9], [1, 1, 2, 7], [4, 0, 0, 15]):
        lengths = xp.asarray(np.array(step_lengths, np.int32))   # a new array each step
        for p in (0, 1, 2, 0):   # every layer of the step, one again
            k, v = (_rows(xp, rng, 4, group.num_kv_heads[p]) for _ in range(2))
            ops.kv_write(group, k, v, layers=p, uniform_tokens=1, batch=4,
                         cache_lengths=lengths)
            ref.kv_write(model, host(k), host(v), layers=p, uniform_tokens=1, batch=4,
                         cache_lengths=np.array(step_lengths, np.int32))
        assert group.write_plan is not None and group.write_plan.step[3] is lengths
    for c, m in zip(caches, model.layers):
        assert np.array_equal(host(c), m)


def test_a_planned_step_still_refuses_bad_rows_and_writes_nothing(emu_rt):
    xp, rng = emu_rt.xp, np.random.default_rng(1)
    group, caches = _group(xp, rng)
    lengths = xp.asarray(np.array([0, 1, 2, 3], np.int32))
    k0 = _rows(xp, rng, 4, 2)
    ops.kv_write(group, k0, k0, layers=0, uniform_tokens=1, batch=4, cache_lengths=lengths)
    assert group.write_plan is not None
    before = [host(c) for c in caches]
    bad = {
        "wrong heads": (_rows(xp, rng, 4, 1), 0, ValueError, r"k\[0\]: expected shape"),
        "wrong dtype": (xp.zeros((4, 2, 8), np.float32), 0, ValueError, "dtype"),
        "host rows": (np.zeros((4, 2, 8), np.float16), 0, TypeError, "expected a"),
        "strided rows": (xp.zeros((4, 2, 16), np.float16)[:, :, ::2], 0, ValueError,
                         "C-contiguous"),
        "a bool layer": (k0, True, TypeError, "layers: expected an int"),
        "a layer out of range": (k0, 3, IndexError, "layers: expected a group position"),
    }
    for k, layer, error, message in bad.values():
        with pytest.raises(error, match=message):
            ops.kv_write(group, k, k, layers=layer, uniform_tokens=1, batch=4,
                         cache_lengths=lengths)
    with pytest.raises(ValueError, match="v: expected V rows"):
        ops.kv_write(group, k0, None, layers=0, uniform_tokens=1, batch=4,
                     cache_lengths=lengths)
    for c, b in zip(caches, before):
        assert np.array_equal(host(c), b)


def test_a_step_array_replaced_in_place_by_another_shape_is_checked_again(emu_rt):
    xp, rng = emu_rt.xp, np.random.default_rng(2)
    group, _ = _group(xp, rng)
    lengths = xp.asarray(np.array([0, 1, 2, 3], np.int32))
    k = _rows(xp, rng, 4, 2)
    ops.kv_write(group, k, k, layers=0, uniform_tokens=1, batch=4, cache_lengths=lengths)
    short = lengths[:2]   # another object: the plan does not hold it
    with pytest.raises(ValueError, match="cache_lengths: expected 1-D with at least 4 rows"):
        ops.kv_write(group, k, k, layers=0, uniform_tokens=1, batch=4, cache_lengths=short)
    with pytest.raises(ValueError, match="cache_lengths: expected 1-D with at least 5 rows"):
        ops.kv_write(group, xp.zeros((5, 2, 8), np.float16), xp.zeros((5, 2, 8), np.float16),
                     layers=0, uniform_tokens=1, batch=5, cache_lengths=lengths)


def test_the_pointer_table_is_uploaded_only_when_a_pointer_changed(emu_rt, monkeypatch):
    xp, rng = emu_rt.xp, np.random.default_rng(3)
    group, caches = _group(xp, rng)
    model = _model(caches)
    lengths_host = np.array([2, 0, 5, 1], np.int32)
    lengths = xp.asarray(lengths_host)
    uploads = []
    copy = emu_rt.copy_h2d
    monkeypatch.setattr(emu_rt, "copy_h2d", lambda dst, src: (uploads.append(src.nbytes),
                                                             copy(dst, src)))

    def write(ks, vs):
        ops.kv_write(group, ks, vs, uniform_tokens=1, batch=4, cache_lengths=lengths)
        ref.kv_write(model, [host(a) for a in ks], [host(a) for a in vs], uniform_tokens=1,
                     batch=4, cache_lengths=lengths_host)

    ks = [_rows(xp, rng, 4, h) for h in group.num_kv_heads]
    vs = [_rows(xp, rng, 4, h) for h in group.num_kv_heads]
    write(ks, vs)
    first = len(uploads)
    assert first == 1   # the table of 3 layers' (k, v) pointers
    for _ in range(3):
        write(ks, vs)   # the same buffers (rewritten by the engine): no upload
        ks[1][...] = _rows(xp, rng, 4, group.num_kv_heads[1])
    assert len(uploads) == first
    ks[2] = _rows(xp, rng, 4, group.num_kv_heads[2])   # a new buffer: a new pointer
    write(ks, vs)
    assert len(uploads) == first + 1
    for c, m in zip(caches, model.layers):
        assert np.array_equal(host(c), m)


# --- the managers' decode writes --------------------------------------------------------------

def _hybrid(batch=4, seq=16):
    cfg = hcache.HybridCacheConfig(
        ["attention", "mamba", "attention"],
        hcache.KVCacheConfig(batch, seq, [hcache.KVLayerConfig(2, 8), hcache.KVLayerConfig(1, 16)]),
        hcache.MambaCacheConfig(1, batch, 2, 4, 4, 8, 4), batch)
    return hcache.HybridCacheManager(cfg, device="cuda")


def test_decode_writes_follow_commits_compactions_and_the_active_batch(emu_rt):
    xp, rng = emu_rt.xp, np.random.default_rng(4)
    m = _hybrid()
    m.reset_for_new_sequences([0, 3, 1, 2])
    lengths = np.array([0, 3, 1, 2])
    model = [np.zeros((4, 2, 2, 16, 8), np.float16), np.zeros((4, 2, 1, 16, 16), np.float16)]
    dims = [(2, 8), (1, 16)]

    def step(active):
        for layer, a in ((0, 0), (2, 1)):
            k, v = (rng.standard_normal((active, 1) + dims[a]).astype(np.float16)
                    for _ in range(2))
            m.write_kv(layer, xp.asarray(k), xp.asarray(v))
            for b in range(active):
                model[a][b, 0, :, lengths[b]] = k[b, 0]
                model[a][b, 1, :, lengths[b]] = v[b, 0]
        m.commit_sequence_length(1)
        lengths[:active] += 1

    for _ in range(3):
        step(4)
    mapping = np.array([2, -1, 0, 1])   # slot 1 evicted, the others move
    m.compact_batch(mapping, 4, 3)
    moved = [np.zeros_like(x) for x in model]
    for old, new in enumerate(mapping):
        if new >= 0:
            for x, y in zip(model, moved):
                y[new, :, :, :lengths[old]] = x[old, :, :, :lengths[old]]
    model, lengths = moved, np.array([lengths[2], lengths[3], lengths[0], 0])
    for _ in range(2):
        step(3)
    with pytest.raises(ValueError, match="k: expected 3 sequences"):
        m.write_kv(0, xp.zeros((4, 1, 2, 8), np.float16), xp.zeros((4, 1, 2, 8), np.float16))
    for a, layer in ((0, 0), (1, 2)):
        got = host(m.get_combined_kv_cache(layer))
        for b in range(3):
            assert np.array_equal(got[b, :, :, :lengths[b]], model[a][b, :, :, :lengths[b]])


def test_a_decode_write_past_the_room_is_refused_before_anything_moves(emu_rt):
    xp = emu_rt.xp
    m = _hybrid(seq=4)
    m.reset_for_new_sequences([0, 0, 0, 3])
    k = xp.ones((4, 1, 2, 8), np.float16)
    m.write_kv(0, k, k)   # every slot has room for one token
    m.commit_sequence_length(1)   # slot 3 is full now
    before = host(m.get_combined_kv_cache(0))
    with pytest.raises(ValueError, match="k: expected at most 0 new tokens for slot 3"):
        m.write_kv(0, k, k)
    assert np.array_equal(host(m.get_combined_kv_cache(0)), before)


def test_a_continuous_batch_writes_at_each_rows_block_and_length(emu_rt):
    xp, rng = emu_rt.xp, np.random.default_rng(5)
    mgr = hcache.ContinuousBatchingKVCacheManager(
        "float16", hcache.KVCacheStaticParams(num_heads=2, head_size=8), max_batch_size=6,
        max_seq_len=8, num_layers=2, device="cuda")
    ids = mgr.claim(6)
    lengths = dict.fromkeys(ids, 0)
    expect = {}
    for batch_ids in (ids[:4], ids[2:], ids[:4], [ids[5], ids[0]]):
        batch = mgr.fetch(batch_ids)
        for layer in (0, 1):
            k, v = (rng.standard_normal((len(batch_ids), 1, 2, 8)).astype(np.float16)
                    for _ in range(2))
            batch.write(layer, xp.asarray(k), xp.asarray(v))
            for i, sid in enumerate(batch_ids):
                expect[int(batch.blocks[i]), layer, lengths[sid]] = (k[i, 0], v[i, 0])
        mgr.step([1] * len(batch_ids), batch)
        for sid in batch_ids:
            lengths[sid] += 1
    blocks = host(mgr.blocks_buf)
    for (block, layer, pos), (k, v) in expect.items():
        assert np.array_equal(blocks[block, 0, layer, pos], k)
        assert np.array_equal(blocks[block, 1, layer, pos], v)


# --- lengths_add and the compaction ops: the launch memo ---------------------------------------

def test_lengths_add_relaunches_only_what_it_checked(emu_rt):
    xp = emu_rt.xp
    lengths, status = xp.zeros(6, np.int32), xp.zeros(1, np.int32)
    want = np.zeros(6, np.int64)
    for n, inc in ((6, 1), (6, 1), (4, 1), (4, 2), (6, 2), (6, 2)):
        ops.lengths_add(lengths, n, inc, 100, status=status)
        want[:n] += inc
    incs = xp.asarray(np.array([1, 2, 3, 4, 5, 6], np.int32))
    ops.lengths_add(lengths, 6, incs, 100, status=status)
    ops.lengths_add(lengths, 6, incs, 100, status=status)
    want += 2 * np.arange(1, 7)
    assert host(lengths).tolist() == want.tolist()
    with pytest.raises(ValueError, match="n: expected an int in"):
        ops.lengths_add(lengths, 7, 1, 100, status=status)
    with pytest.raises(TypeError, match="increment: expected"):
        ops.lengths_add(lengths, 6, 1.0, 100, status=status)
    ops.lengths_add(lengths, 6, 1, 12, status=status)   # refused on the device: past max_len
    assert host(lengths).tolist() == want.tolist() and host(status).tolist() == [1]


# --- no scope juggling, cheap lists -------------------------------------------------------------

def test_a_call_on_the_current_device_and_stream_enters_no_scope(emu_rt, monkeypatch):
    xp = emu_rt.xp
    m = _hybrid()
    m.reset_for_new_sequences([0] * 4)
    k = xp.ones((4, 1, 2, 8), np.float16)
    m.write_kv(0, k, k)
    entered = []
    scope, push = emu_rt.device_scope, emu_rt.push_stream
    monkeypatch.setattr(emu_rt, "device_scope", lambda i: (entered.append(i), scope(i))[1])
    monkeypatch.setattr(emu_rt, "push_stream", lambda s: (entered.append(s), push(s))[1])
    m.write_kv(0, k, k)
    m.commit_sequence_length(1)
    assert entered == []
    s = emu_rt.stream()
    m.write_kv(0, k, k, stream=s)   # another stream: entered, and ordered after the others
    assert entered


def test_plain_int_lists_are_counted_whole_and_errors_name_the_entry():
    assert token_counts([1] * 5, 5) == [1] * 5
    assert token_counts([], 0) == []
    assert token_counts([2**70, 0], 2) == [2**70, 0]   # exact, any size
    with pytest.raises(TypeError, match=r"valid_lengths\[2\]: expected an int, got bool"):
        token_counts([1, 1, True], 3)
    with pytest.raises(TypeError, match=r"valid_lengths\[1\]: expected an int, got float"):
        token_counts([1, 1.0], 2)
    with pytest.raises(ValueError, match="valid_lengths: expected lengths >= 0"):
        token_counts([1, -1, 1], 3)
    with pytest.raises(ValueError, match="valid_lengths: expected 3 lengths, got 2"):
        token_counts([1, 1], 3)
