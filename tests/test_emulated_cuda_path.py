"""The managers' CUDA path on the asynchronous emulated device (tests/emu_device.py): captured
decode steps, several streams and threads, several devices, and the GPU-only defects of issue 10
(docs/design.md §2). Each ``test_defect_*`` names the defect it catches when reintroduced."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_batch_api import hybrid

import hcache
from hcache.continuous.manager import ContinuousBatchingKVCacheManager, KVCacheStaticParams

from helpers import host

pytestmark = pytest.mark.emulated

B, S = 6, 12


def _kv_inputs(m, xp, tokens=1, batch=B, fill=0):
    """Per cache-owning attention layer: device K and V ``[batch, tokens, H, D]`` (float16)."""
    kvm = m.kv_cache_manager
    shapes = [kvm.get_combined_kv_cache(i).shape for i in range(kvm.num_layers)]
    ks = [xp.full((batch, tokens, s[2], s[4]), fill, dtype=np.float16) for s in shapes]
    vs = [xp.full((batch, tokens, s[2], s[4]), -fill, dtype=np.float16) for s in shapes]
    return ks, vs


def _caches(m):
    kvm = m.kv_cache_manager
    return [host(kvm.get_combined_kv_cache(i)) for i in range(kvm.num_layers)]


class _Foreign:
    """A producer's device array, seen only through ``__cuda_array_interface__`` with a stream
    (what a framework tensor hands over)."""

    def __init__(self, array, stream):
        iface = dict(array.__cuda_array_interface__)
        iface["stream"] = stream.ptr
        self.__cuda_array_interface__ = iface
        self.shape, self.dtype, self._keep = array.shape, array.dtype, array


# --- capture -----------------------------------------------------------------------------------

def test_defect_3_a_captured_decode_step_replays_100_times_like_the_model(emu_rt):
    """Defect 3: uploads made during capture come from pinned slots the graph keeps, and a
    captured pointer table is uploaded by the graph itself (an eager call between replays
    points the group's scratch elsewhere)."""
    xp = emu_rt.xp
    m = hybrid("cuda", seq=128)
    steps = 100
    m.reset_for_new_sequences([0] * B)
    m.commit_sequence_length(xp.zeros(B, dtype=np.int32))   # lengths now unknown on the host
    ks, vs = _kv_inputs(m, xp)
    decoy_k, decoy_v = _kv_inputs(m, xp, fill=99)
    skip = np.full((B, 1), -1)                                  # positions -1: writes nothing
    s = emu_rt.stream(non_blocking=True)
    emu_rt.synchronize()
    m.write_kv(None, ks, vs, stream=s)              # warm-up on s: the table is cached for s
    m.commit_sequence_length(np.ones(B, np.int64), stream=s)
    with s:
        s.begin_capture()
        m.write_kv(None, ks, vs, stream=s)                      # uploads a pointer table
        m.commit_sequence_length(np.ones(B, np.int64), stream=s)   # uploads increments
        graph = s.end_capture()
        for step in range(steps):
            for layer, (k, v) in enumerate(zip(ks, vs)):
                k[...] = step + 1 + layer
                v[...] = -(step + 1 + layer)
            graph.launch(s)
            m.write_kv(None, decoy_k, decoy_v, positions=skip, stream=s)
        s.synchronize()
    assert host(m.get_kv_cache_lengths()).tolist() == [steps + 1] * B
    for layer, cache in enumerate(_caches(m)):
        assert (cache[:, 0, :, 0] == 0).all()                   # the warm-up wrote zeros
        want = np.arange(1, steps + 1, dtype=np.float16) + layer
        np.testing.assert_array_equal(cache[:B, 0, :, 1:steps + 1], np.broadcast_to(
            want[None, None, :, None], cache[:B, 0, :, 1:steps + 1].shape))
        np.testing.assert_array_equal(cache[:B, 1, :, 1:steps + 1], -cache[:B, 0, :, 1:steps + 1])
        assert not cache[:B, :, :, steps + 1:].any()
    assert emu_rt.counters["pageable_copies"] == 0
    assert m.refused_commit_count() == 0


def test_capture_of_a_compaction_with_a_host_mapping(emu_rt):
    """A host mapping is staged into a pinned slot the graph keeps: every replay moves the
    slots again (a swap replayed twice is the identity)."""
    xp = emu_rt.xp
    m = hybrid("cuda")
    m.reset_for_new_sequences([1, 2, 3, 4, 5, 6])
    emu_rt.synchronize()
    s = emu_rt.stream(non_blocking=True)
    with s:
        s.begin_capture()
        m.compact_batch(np.array([1, 0, 2, 3, 4, 5]), B, B, stream=s)
        graph = s.end_capture()
        for _ in range(4):
            graph.launch(s)
        s.synchronize()
    assert host(m.get_kv_cache_lengths()).tolist() == [1, 2, 3, 4, 5, 6]   # 4 swaps
    with s:
        graph.launch(s)
        s.synchronize()
    assert host(m.get_kv_cache_lengths()).tolist() == [2, 1, 3, 4, 5, 6]
    del xp


def test_paged_block_copies_captured_with_host_ids(emu_rt):
    """Host block ids staged during capture belong to the graph: an eager copy between capture
    and launch restages the pool's id buffer, and the replay still copies its own blocks."""
    import test_paged_kv_pool as paged

    from hcache.contexts import PagedKVPool

    pool = PagedKVPool(paged.LAYERS, num_blocks=6, block_size=2, device="cuda")
    rng = np.random.default_rng(5)
    for a in pool.layers:
        a[...] = pool.xp.asarray(rng.standard_normal(a.shape).astype(np.float16))
    model = paged.model_of(pool)
    emu_rt.synchronize()
    s = emu_rt.stream(non_blocking=True)
    with s:
        s.begin_capture()
        pool.copy_blocks([0, 5], [3, 1], stream=s)
        graph = s.end_capture()
        pool.copy_blocks([2], [0], stream=s)
        graph.launch(s)
        s.synchronize()
    for m in model:
        m[0] = m[2]
        m[[3, 1]] = m[[0, 5]]
    paged.check_pool(pool, model)


# --- steady state --------------------------------------------------------------------------

def test_defect_7_steady_state_uploads_are_never_pageable(emu_rt):
    """Defect 7: every host table goes through pinned staging (a pageable copy may make the
    driver synchronize), and a decode loop synchronizes nothing (a staging slot's event wait
    aside, which finds its copy done unless the device is a ring's worth of uploads behind)."""
    xp = emu_rt.xp
    m = hybrid("cuda", seq=64)
    ks, vs = _kv_inputs(m, xp, tokens=2)
    emu_rt.synchronize()
    before, syncs = emu_rt.counters["pageable_copies"], emu_rt.counters["syncs"]
    for i in range(12):
        if i % 4 == 0:
            m.reset_for_new_sequences([0] * B)
        m.write_kv(None, ks, vs)
        m.commit_sequence_length(np.full(B, 2))
        m.compact_batch(np.arange(B)[::-1].copy(), B, B)
        ragged = [[k.reshape(-1, *k.shape[2:])[:B] for k in ks],
                  [v.reshape(-1, *v.shape[2:])[:B] for v in vs]]
        m.write_kv(None, *ragged, seq_lengths=[1] * B)
        m.commit_sequence_length(1)
    assert emu_rt.counters["syncs"] == syncs          # and no host sync either
    emu_rt.synchronize()
    assert emu_rt.counters["pageable_copies"] == before
    assert host(m.get_kv_cache_lengths()).tolist() == [12] * B   # 4 steps of 2 + 1 tokens


def test_defect_8_staging_slots_are_reused_only_after_their_copy_ran(emu_rt):
    """Defect 8 (host side): more uploads queued than the ring has slots, none executed yet;
    a slot rewritten before its copy ran would commit the wrong increments."""
    m = hybrid("cuda", seq=4000)
    m.reset_for_new_sequences([0] * B)
    s = emu_rt.stream(non_blocking=True)
    total = np.zeros(B, np.int64)
    for i in range(40):
        inc = (np.arange(B) + i) % 5
        total += inc
        m.commit_sequence_length(inc, stream=s)
    s.synchronize()
    assert host(m.get_kv_cache_lengths()).tolist() == total.tolist()


def test_defect_8_two_streams_share_a_managers_scratch_in_call_order(emu_rt):
    """Defect 8 (device side): calls on two streams stage into the same device buffers; the
    adversary interleaves the streams op by op."""
    m = hybrid("cuda", seq=100)
    m.reset_for_new_sequences([0] * B)
    emu_rt.synchronize()
    a, b = emu_rt.stream(non_blocking=True), emu_rt.stream(non_blocking=True)
    m.commit_sequence_length(10 * np.arange(B), stream=a)
    m.compact_batch(np.array([5, 4, 3, 2, 1, 0]), B, B, stream=a)
    m.commit_sequence_length(np.arange(B), stream=b)
    m.compact_batch(np.array([1, 0, 2, 3, 4, 5]), B, B, stream=b)
    emu_rt.synchronize(schedule="round_robin")
    want = (10 * np.arange(B))[::-1] + np.arange(B)
    want[[0, 1]] = want[[1, 0]]
    assert host(m.get_kv_cache_lengths()).tolist() == want.tolist()


# --- hidden syncs and foreign arrays ---------------------------------------------------------

def test_defect_4_stream_ordered_foreign_arrays_cause_no_host_sync(emu_rt):
    """Defect 4: a ``__cuda_array_interface__`` with a ``stream`` is viewed, and its producer
    ordered on the device (``cupy.asarray`` would synchronize the host)."""
    xp = emu_rt.xp
    m = hybrid("cuda")
    m.reset_for_new_sequences([0] * B)
    producer = emu_rt.stream(non_blocking=True)
    emu_rt.synchronize()
    inc = xp.zeros(B, dtype=np.int32)
    mapping = xp.zeros(B, dtype=np.int32)
    with producer:
        inc[...] = 3
        mapping[...] = xp.asarray(np.array([5, 4, 3, 2, 1, 0], np.int32))
    syncs = emu_rt.counters["syncs"]
    consumer = emu_rt.stream(non_blocking=True)
    m.commit_sequence_length(_Foreign(inc, producer), stream=consumer)
    m.compact_batch(_Foreign(mapping, producer), B, B, stream=consumer)
    assert emu_rt.counters["syncs"] == syncs
    with consumer:
        assert m.last_compaction_valid(stream=consumer)
        assert host(m.get_kv_cache_lengths()).tolist() == [3] * B


# --- devices ----------------------------------------------------------------------------------

def test_defect_10_a_manager_on_the_second_device(emu_rt):
    """Defect 10: a manager launches on its own device whatever device is current, and refuses
    arrays of another device before changing anything."""
    xp = emu_rt.xp
    m = hybrid("cuda:1")
    m.reset_for_new_sequences([0] * B)
    with emu_rt.device_scope(1):
        ks, vs = _kv_inputs(m, xp, fill=2)
        inc = xp.full(B, 2, dtype=np.int32)
    m.write_kv(None, ks, vs)
    m.commit_sequence_length(inc)
    m.compact_batch(np.arange(B)[::-1].copy(), B, B)
    s1 = emu_rt.stream(device=1)
    m.commit_sequence_length(1, stream=s1)
    ks0, vs0 = _kv_inputs(m, xp, fill=5)               # on device 0
    inc0 = xp.ones(B, dtype=np.int32)
    for call, name in ((lambda: m.write_kv(None, ks0, vs0), "k"),
                       (lambda: m.commit_sequence_length(inc0), "increment"),
                       (lambda: m.compact_batch(inc0, B, B), "batch_mapping")):
        with pytest.raises(ValueError, match=f"{name}.*cuda:1.*cuda:0"):
            call()
    with emu_rt.device_scope(1):
        assert host(m.get_kv_cache_lengths()).tolist() == [3] * B
    assert all((c[:B, 0, :, 0] == 2).all() for c in _caches(m))


def test_a_stream_of_another_device_is_refused(emu_rt):
    m = hybrid("cuda:0")
    m.reset_for_new_sequences([0] * B)
    s1 = emu_rt.stream(device=1)
    with pytest.raises(Exception, match="device 1"):
        m.commit_sequence_length(1, stream=s1)


# --- continuous batching: release ordering, threads and streams -----------------------------

def _continuous(n=4, s=16, layers=2):
    return ContinuousBatchingKVCacheManager("float32", KVCacheStaticParams(1, 2), n, s, layers,
                                            device="cuda")


def test_defect_12_a_released_block_is_reused_after_the_work_queued_before_release(emu_rt):
    """Defect 12: work still queued on the releasing stream reads the block; the next owner's
    writes, on another stream, must not overtake it."""
    xp = emu_rt.xp
    m = _continuous(n=1)
    a, b = emu_rt.stream(non_blocking=True), emu_rt.stream(non_blocking=True)
    [first] = m.claim(1)
    c = m.fetch([first], stream=a)
    with a:
        for layer in range(m.num_layers):
            c.write(layer, xp.full((1, 3, 1, 2), 7, np.float32),
                    xp.full((1, 3, 1, 2), 8, np.float32), stream=a)
        m.step([3], c)
        seen = m.blocks_buf[0].copy()             # the caller's attention, still queued on a
    m.release(first, stream=a)
    [second] = m.claim(1)
    c = m.fetch([second], stream=b)
    for layer in range(m.num_layers):
        c.write(layer, xp.full((1, 3, 1, 2), 1, np.float32),
                xp.full((1, 3, 1, 2), 2, np.float32), stream=b)
    m.step([3], c)
    emu_rt.synchronize(schedule="lifo")            # b first, as far as the device allows
    got = host(seen)
    assert (got[0, :, :3] == 7).all() and (got[1, :, :3] == 8).all()


def test_continuous_batching_from_threads_each_on_its_own_stream(emu_rt):
    """Threads share one manager, each on its own stream; each checks its own tokens before
    releasing (read on its stream), so a block written under another owner, or a write that
    overtook the previous owner's read, fails."""
    xp = emu_rt.xp
    m = _continuous(n=3, s=8)
    errors, rounds = [], 6

    def worker(tid):
        s = emu_rt.stream(non_blocking=tid % 2 == 0)
        try:
            for r in range(rounds):
                [sid] = m.claim(1) if m.num_free_blocks else (None,)
                if sid is None:
                    continue
                value = float(tid * 100 + r)
                c = m.fetch([sid], stream=s, wait=True, timeout=20)
                with s:   # the inputs are made on the thread's stream, as a model's are
                    k = xp.full((1, 2, 1, 2), value, np.float32)
                    v = xp.full((1, 2, 1, 2), -value, np.float32)
                for layer in range(m.num_layers):
                    c.write(layer, k, v, stream=s)
                block = c.blocks[0]
                m.step([2], c)
                with s:
                    got = m.blocks_buf[block].get()
                if not ((got[0, :, :2] == value).all() and (got[1, :, :2] == -value).all()):
                    errors.append(f"thread {tid} round {r}: block {block} holds {got[0, 0, 0]}")
                m.release(sid, stream=s)
        except hcache.CacheCapacityError:
            pass
        except Exception as exc:   # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert m.num_free_blocks == 3


def test_mamba_states_stored_from_host_and_foreign_arrays_without_sync_or_allocation(emu_rt):
    """``store_from_tensors``: host states go through pinned staging (no pageable copy, no
    temporary device array), a producer's ``__cuda_array_interface__`` is ordered on the
    device (no host sync)."""
    import test_mamba_slot_allocator as msa

    _, kv, alloc = msa.make("cuda")
    ids, _ = msa.registered_blocks(kv, 2)
    slot = alloc.allocate_slots_batch(ids[:1])[0]
    xp = emu_rt.xp
    ssm = np.arange(10, dtype=np.float32).reshape(msa.SSM)
    producer = emu_rt.stream(non_blocking=True)
    emu_rt.synchronize()
    with producer:
        conv = xp.full(msa.CONV, 7, dtype=np.float16)
    counts = dict(emu_rt.counters)
    alloc.store_from_tensors(ids[0], 1, ssm, _Foreign(conv, producer))
    ssm[...] = -1                                   # staged: the caller may reuse it at once
    assert emu_rt.counters["syncs"] == counts.get("syncs", 0)
    assert emu_rt.counters["allocations"] == counts.get("allocations", 0)
    assert emu_rt.counters["pageable_copies"] == counts.get("pageable_copies", 0)
    np.testing.assert_array_equal(host(alloc.ssm_states)[1, slot],
                                  np.arange(10, dtype=np.float32).reshape(msa.SSM))
    assert (host(alloc.conv_states)[1, slot] == 7).all()


def test_a_captured_continuous_batch_write_follows_each_fetch(emu_rt):
    """A ragged continuous-batching write captured once: its row offsets replay by value, the
    lookup table and cache lengths are read at launch, so each replay writes where the batch
    fetched since says (decode with a graph)."""
    xp = emu_rt.xp
    m = _continuous(n=2, s=16, layers=1)
    a, b = m.claim(2)
    s = emu_rt.stream(non_blocking=True)
    with s:
        k, v = xp.zeros((3, 1, 2), np.float32), xp.zeros((3, 1, 2), np.float32)
        c = m.fetch([a, b], stream=s)
        s.begin_capture()
        c.write(0, k, v, seq_lengths=[1, 2], stream=s)
        graph = s.end_capture()
        for step in range(4):
            if step:
                c = m.fetch([a, b], stream=s)
            values = np.arange(3, dtype=np.float32)[:, None, None] + 10 * step
            k[...], v[...] = xp.asarray(values), xp.asarray(-values)
            graph.launch(s)
            m.step([1, 2], c)
        s.synchronize()
    blocks = host(m.blocks_buf)[:, 0, 0, :, 0, 0]        # [block, position] of layer 0, K
    want_a = [10 * t for t in range(4)]
    want_b = [v for t in range(4) for v in (10 * t + 1, 10 * t + 2)]
    assert blocks[m.block_of(a), :4].tolist() == want_a
    assert blocks[m.block_of(b), :8].tolist() == want_b
    assert (host(m.blocks_buf)[:, 1, 0, :8, 0, 0] == -host(m.blocks_buf)[:, 0, 0, :8, 0, 0]).all()
    assert m.cache_lengths == {a: 4, b: 8}


@pytest.mark.parametrize("scenario", ["test_overlapping_prompts", "test_multi_turn_continuation",
                                      "test_decode_through_extend_requests",
                                      "test_latent_layers_end_to_end"])
def test_prefix_caching_context_on_a_non_blocking_stream(emu_rt, scenario, monkeypatch):
    """The prefix-caching scenarios of tests/test_prefix_caching_e2e.py (latent MLA layers
    among K/V ones included) with a non-blocking stream current throughout: nothing may rely
    on the legacy default stream's ordering."""
    import test_prefix_caching_e2e as e2e

    latent = scenario == "test_latent_layers_end_to_end"
    with emu_rt.stream(non_blocking=True):
        getattr(e2e, scenario)("cuda", *((monkeypatch,) if latent else ()))
