"""hcache.transfer in one process: slot layouts, descriptor merging, tensor-parallel layouts,
and NIXL pulls / pushes between engines (agents on loopback), checked byte for byte against
NumPy slices of the managers' buffers; failures leave the destination zeroed."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import transfer_peer as peer
from hypothesis import given
from hypothesis import strategies as st

from hcache import HybridCacheConfig, HybridCacheManager
from hcache.transfer import (
    TensorParallelLayout,
    TransferAborted,
    TransferCancelled,
    TransferEngine,
    TransferTimeout,
    describe_manager,
    merge_ranges,
    nixl_available,
    slot_units,
    split_heads,
)

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed "
                                "(pip install --no-deps nixl-cu12)")


def hf(pattern="M*M-*M", **kw):
    return dict(peer.NEMOTRON_H_CONFIG, hybrid_override_pattern=pattern, **kw)


def config_of(pattern="M*M-*M", max_batch=4, max_len=32, window=None, **kw):
    config = HybridCacheConfig.from_hf_config(hf(pattern, **kw), max_batch_size=max_batch,
                                              max_sequence_length=max_len, kv_dtype="float32")
    if window:
        layers = tuple(replace(lc, sliding_window=window) for lc in config.kv.layer_configs)
        config = replace(config, kv=replace(config.kv, layer_configs=layers, ring_windows=True))
    return config


def buffers(mgr):
    """Every KV cache and Mamba state array of ``mgr`` (views into its buffers)."""
    kv = mgr.kv_cache_manager
    out = [kv.get_combined_kv_cache(a) for a in range(kv.num_layers)]
    mm = mgr.mamba_cache_manager
    if mm is not None:
        for i in range(mm.config.num_layers):
            out += [mm.get_recurrent_state(i), mm.get_conv_state(i)]
    return out


def fill(mgr, seed):
    rng = np.random.default_rng(seed)
    for b in buffers(mgr):
        b[...] = rng.standard_normal(b.shape).astype(b.dtype)


# --- layouts and merging (no NIXL) ----------------------------------------------------------

@given(st.lists(st.tuples(st.sampled_from([0, 0, 0, 1, 7]), st.booleans(),
                          st.integers(0, 60), st.integers(0, 6)), max_size=30),
       st.randoms(use_true_random=False))
def test_merge_ranges_moves_the_same_bytes_in_fewer_rows(pairs, shuffler):
    """Oracle: the byte-level map local -> remote of the pairs. Local ranges follow each other
    with gaps of 0 (often) or more; a remote range continues the previous one or jumps; the
    pairs arrive in any order."""
    local, remote, nbytes, lo, ro = [], [], [], 0, 0
    for gap, follows, jump, n in pairs:
        lo, ro = lo + gap, ro if follows else 100 + jump * 8
        local.append(lo)
        remote.append(ro)
        nbytes.append(n)
        lo, ro = lo + n, ro + n
    order = list(range(len(pairs)))
    shuffler.shuffle(order)
    rows = merge_ranges([local[i] for i in order], [remote[i] for i in order],
                        [nbytes[i] for i in order])
    want = {lo + k: ro + k for lo, ro, n in zip(local, remote, nbytes) for k in range(n)}
    got = {}
    for lo, ro, n in rows.tolist():
        assert n > 0
        for k in range(n):
            assert lo + k not in got
            got[lo + k] = ro + k
    assert got == want
    for (l0, r0, n0), (l1, r1, _) in zip(rows.tolist(), rows[1:].tolist()):
        assert not (l1 == l0 + n0 and r1 == r0 + n0), "two rows left unmerged"


def test_merge_ranges_joins_only_when_both_sides_continue():
    rows = merge_ranges([0, 10, 20, 30], [100, 110, 125, 135], [10, 10, 10, 10])
    assert rows.tolist() == [[0, 100, 20], [20, 125, 20]]


@pytest.mark.parametrize("window", [None, 8])
def test_slot_units_are_the_numpy_slices_of_the_slot(window):
    config = config_of(window=window)
    mgr = HybridCacheManager(config, device="cpu")   # host views
    desc = describe_manager(mgr)
    slot, length = 2, 11
    units = slot_units(desc, slot, length)
    want = {}
    for a in range(mgr.kv_cache_manager.num_layers):
        cache = mgr.kv_cache_manager.get_combined_kv_cache(a)
        n = min(length, window) if window else length
        for c in range(2):
            for h in range(cache.shape[2]):
                view = cache[slot, c, h, :n]
                want[("kv", a, c, h)] = (view.ctypes.data, view.nbytes)
    mm = mgr.mamba_cache_manager
    for i in range(3):
        for h in range(4):
            view = mm.get_recurrent_state(i)[slot, h]
            want[("rec", i, h)] = (view.ctypes.data, view.nbytes)
        conv = mm.get_conv_state(i)[slot]
        for name, gid, lo, hi in (("x", h, 8 * h, 8 * h + 8) for h in range(4)):
            want[("conv", i, name, gid)] = (conv[lo:hi].ctypes.data, conv[lo:hi].nbytes)
        want[("conv", i, "B", 0)] = (conv[32:36].ctypes.data, conv[32:36].nbytes)
        want[("conv", i, "C", 0)] = (conv[36:40].ctypes.data, conv[36:40].nbytes)
    assert units == want


def test_split_heads_splits_replicates_or_refuses():
    assert [split_heads("h", 4, 2, r) for r in range(2)] == [(0, 1), (2, 3)]
    assert [split_heads("h", 2, 4, r) for r in range(4)] == [(0,), (0,), (1,), (1,)]
    with pytest.raises(ValueError, match="h: expected a count"):
        split_heads("h", 3, 2, 0)


def test_rank_configs_shard_heads_and_conv_channels():
    config = config_of(**{"n_groups": 2})
    tp = TensorParallelLayout(config, 2)
    assert tp.mamba_groups == 2
    for r in range(2):
        rc = tp.rank_config(r)
        assert [lc.num_kv_heads for lc in rc.kv.layer_configs] == [1, 1]
        assert rc.mamba.num_heads == 2
        assert rc.mamba.conv_dim == 2 * 8 + 2 * 1 * 4
    one = TensorParallelLayout(config_of(), 2)       # one group: replicated on both ranks
    assert one.mamba_group_ids(1) == (0,) and one.rank_config(1).mamba.conv_dim == 16 + 8
    assert TensorParallelLayout(config, 1).rank_config(0) is config
    with pytest.raises(ValueError, match="num_kv_heads: expected a count that divides"):
        TensorParallelLayout(config, 3)
    with pytest.raises(IndexError, match="rank"):
        tp.rank_config(2)
    with pytest.raises(ValueError, match="manager: expected the config of rank 0"):
        describe_manager(HybridCacheManager(config), tp, 0)


def test_package_imports_without_nixl():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('nixl', 'nixl_cu12', 'nixl_cu13'):\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import hcache, hcache.transfer as t\n"
            "assert not t.nixl_available()\n"
            "try:\n"
            "    t.load_nixl()\n"
            "except ImportError as e:\n"
            "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=str(peer.__file__).rsplit("/tests/", 1)[0])
    assert out.returncode == 0, out.stderr
    assert "refused: hcache.transfer: expected a NIXL package" in out.stdout


# --- engines in one process (NIXL agents on loopback) ---------------------------------------

@pytest.fixture(scope="module")
def pair():
    """A prefill engine (4 slots, 32 tokens) and a decode engine (2 slots, 24 tokens) of the
    demo's hybrid layout, connected both ways."""
    if not nixl_available():
        pytest.skip("NIXL not installed (pip install --no-deps nixl-cu12)")
    src, dst = HybridCacheManager(config_of(max_len=32)), HybridCacheManager(
        config_of(max_batch=2, max_len=24))
    a, b = TransferEngine(src, "t-prefill", timeout_s=5), TransferEngine(dst, "t-decode",
                                                                         timeout_s=5)
    a.connect(b.metadata)
    b.connect(a.metadata)
    yield src, dst, a, b
    a.close()
    b.close()


def slot_bytes(mgr, slot, length):
    """Per buffer, slot ``slot``'s first ``length`` tokens (KV) or whole state (Mamba)."""
    out = []
    for b in buffers(mgr):
        out.append(b[slot, :, :, :length].tobytes() if b.ndim == 5 else b[slot].tobytes())
    return out


_ids = iter(range(10**6))


def rid():
    return f"r{next(_ids)}"


@needs_nixl
def test_pull_copies_one_request_between_different_slot_layouts(pair):
    src, dst, a, b = pair
    fill(src, 1)
    fill(dst, 2)
    before = [x.copy() for x in buffers(dst)]
    r = rid()
    b.pull(a.export(r, 3, 13), 1)
    assert slot_bytes(dst, 1, 13) == slot_bytes(src, 3, 13)
    for x, y in zip(buffers(dst), before, strict=True):    # nothing else changed
        if x.ndim == 5:
            assert (x[1, :, :, 13:] == y[1, :, :, 13:]).all()
        assert (x[0] == y[0]).all()
    for _ in range(200):
        if a.export_state(r) == "done":
            break
        time.sleep(0.01)
    assert a.export_state(r) == "done" and a.done_peers(r) == {"t-decode"}
    assert a.release_export(r) == "done"
    assert r not in a.pending_exports


@needs_nixl
def test_push_writes_into_the_slot_the_receiver_exports(pair):
    src, dst, a, b = pair
    fill(src, 3)
    fill(dst, 4)
    r = rid()
    a.push(b.export(r, 0, 9), 2)
    assert slot_bytes(dst, 0, 9) == slot_bytes(src, 2, 9)
    for _ in range(200):
        if b.done_peers(r):
            break
        time.sleep(0.01)
    assert b.done_peers(r) == {"t-prefill"}
    b.release_export(r)


@needs_nixl
def test_ring_layers_move_rotated_entries_and_refuse_other_windows():
    src, dst = (HybridCacheManager(config_of(window=8, max_len=32)),
                HybridCacheManager(config_of(window=8, max_len=24, max_batch=2)))
    other = HybridCacheManager(config_of(window=6, max_len=24, max_batch=2))
    fill(src, 5)
    with TransferEngine(src, "w-src") as a, TransferEngine(dst, "w-dst") as b, \
            TransferEngine(other, "w-other") as c:
        b.connect(a.metadata)
        c.connect(a.metadata)
        h = a.export(rid(), 1, 20)                 # 20 tokens: each ring holds the last 8
        b.pull(h, 1)
        assert slot_bytes(dst, 1, 8) == slot_bytes(src, 1, 8)
        snap = [x.copy() for x in buffers(other)]
        with pytest.raises(ValueError, match="same ring window in attention layer 0"):
            c.pull(h, 0)
        assert all((x == y).all() for x, y in zip(buffers(other), snap, strict=True))
        c.pull(a.export(rid(), 1, 6), 0)           # 6 tokens fit both windows
        assert slot_bytes(other, 0, 6) == slot_bytes(src, 1, 6)


@needs_nixl
def test_pull_refuses_other_head_dims_and_bad_arguments(pair):
    src, dst, a, b = pair
    odd = HybridCacheManager(config_of(max_batch=2, head_dim=4))
    with TransferEngine(odd, "odd") as c:
        c.connect(a.metadata)
        with pytest.raises(ValueError, match="head_dim 4 in attention layer 0, got 8"):
            c.pull(a.export(rid(), 0, 4), 0)
    snap = [x.copy() for x in buffers(dst)]
    h = a.export(rid(), 0, 4)
    for bad, err, match in (([h], IndexError, "slot: expected in"),
                            ({"x": 1}, TypeError, "handles"),
                            ([], TypeError, "handles")):
        with pytest.raises(err, match=match):
            b.pull(bad, 5 if err is IndexError else 0)
    with pytest.raises(ValueError, match="timeout_s: expected None or a number > 0"):
        b.pull(h, 0, timeout_s=-1)
    with pytest.raises(ValueError, match="metadata: expected a NIXL agent's metadata"):
        b.connect(b"not metadata")
    with pytest.raises(ValueError, match="length: expected <= 24"):
        b.pull(a.export(rid(), 0, 30), 0)
    with pytest.raises(ValueError, match="request_id: expected a request not exported"):
        a.export(h["request_id"], 0, 4)
    with pytest.raises(IndexError, match="slot"):
        a.export(rid(), 4, 4)
    assert all((x == y).all() for x, y in zip(buffers(dst), snap, strict=True))


@needs_nixl
def test_abort_by_the_exporter_fails_the_pull_and_zeroes_the_slot(pair):
    src, dst, a, b = pair
    fill(src, 6)
    fill(dst, 7)
    r = rid()
    h = a.export(r, 0, 10)
    assert a.release_export(r) == "pending"         # released while a pull may run
    for _ in range(300):
        if b._was_aborted("t-prefill", r):
            break
        time.sleep(0.01)
    keep = dst.kv_cache_manager.get_combined_kv_cache(0)[1].copy()
    with pytest.raises(TransferAborted, match="released the request"):
        b.pull(h, 0)
    assert all(not s.strip(b"\0") for s in slot_bytes(dst, 0, 10))   # no partial state
    assert (dst.kv_cache_manager.get_combined_kv_cache(0)[1] == keep).all()


@needs_nixl
def test_an_id_exported_again_after_an_abort_is_pulled(pair):
    """An abort belongs to the export it ended: the same request id exported again (a new
    request under a reused id) is pulled whole. Aborts used to be kept by id, so every later
    pull of that id failed as aborted."""
    src, dst, a, b = pair
    fill(src, 10)
    fill(dst, 11)
    r = rid()
    a.export(r, 1, 9)
    assert a.release_export(r) == "pending"           # aborted: peers are told
    for _ in range(300):
        if b._was_aborted("t-prefill", r):
            break
        time.sleep(0.01)
    assert b._was_aborted("t-prefill", r)
    b.pull(a.export(r, 1, 9), 0)                      # the new export of the same id
    assert slot_bytes(dst, 0, 9) == slot_bytes(src, 1, 9)


@needs_nixl
def test_cancel_during_the_transfer_zeroes_the_slot(pair):
    src, dst, a, b = pair
    fill(src, 8)
    fill(dst, 9)
    pending = b.begin_pull(a.export(rid(), 2, 12), 1)
    pending.cancel()                                  # the request was released meanwhile
    assert pending.state == "FAILED"
    with pytest.raises(TransferCancelled):
        pending.poll()
    assert all(not s.strip(b"\0") for s in slot_bytes(dst, 1, 12))
    b.pull(a.export(rid(), 2, 12), 1)                 # the engine still works
    assert slot_bytes(dst, 1, 12) == slot_bytes(src, 2, 12)


# --- tensor parallelism: head re-slicing between TP degrees ---------------------------------

def rank_slices(tp, rank, config):
    """The oracle: for each buffer of a rank's manager, the NumPy index of the global
    (TP 1) buffer it holds, written from the TP rules, not from the layout code."""
    out = []
    for lc in config.kv.layer_configs:
        per = lc.num_kv_heads // tp.tp_size
        out.append(np.s_[:, rank * per:(rank + 1) * per])
    m = config.mamba
    hp = m.num_heads // tp.tp_size
    inner, g = m.num_heads * m.head_dim, tp.mamba_groups
    gp = g // tp.tp_size if g > 1 else g
    g0 = rank * gp if g > 1 else 0
    x = np.arange(rank * hp * m.head_dim, (rank + 1) * hp * m.head_dim)
    bch = inner + np.arange(g0 * m.state_size, (g0 + gp) * m.state_size)
    conv = np.concatenate([x, bch, bch + g * m.state_size])
    for _ in range(m.num_layers):
        out += [np.s_[:, rank * hp:(rank + 1) * hp], np.s_[:, conv]]
    return out


@needs_nixl
@pytest.mark.parametrize("groups", [1, 2])
def test_tp_one_to_two_and_back_byte_for_byte(groups):
    config = config_of(**{"n_groups": groups})
    tp = TensorParallelLayout(config, 2)
    whole = HybridCacheManager(config)
    ranks = [HybridCacheManager(tp.rank_config(r)) for r in range(2)]
    back = HybridCacheManager(config)
    fill(whole, 10)
    for r in ranks:
        fill(r, 11)
    length, slot = 17, 2
    with TransferEngine(whole, f"tp1-{groups}") as e1, \
            TransferEngine(ranks[0], f"tp2r0-{groups}", tp=tp, rank=0) as r0, \
            TransferEngine(ranks[1], f"tp2r1-{groups}", tp=tp, rank=1) as r1, \
            TransferEngine(back, f"tp1b-{groups}") as e2:
        for e in (r0, r1, e2):
            for f in (e1, r0, r1):
                if e is not f:
                    e.connect(f.metadata)
        h, back_id = e1.export(rid(), slot, length), rid()
        r0.pull(h, 0)                               # 1 -> 2: each rank takes its heads
        r1.pull(h, 3)
        for r, s in ((0, 0), (1, 3)):
            for got, want, idx in zip(buffers(ranks[r]), buffers(whole),
                                      rank_slices(tp, r, config), strict=True):
                if got.ndim == 5:
                    assert got[s, :, :, :length].tobytes() == \
                        want[slot][idx][:, :, :length].tobytes()
                else:
                    assert got[s].tobytes() == want[slot][idx[1:]].tobytes()
        fill(back, 12)
        e2.pull([r0.export(back_id, 0, length), r1.export(back_id, 3, length)], 1)   # 2 -> 1
        assert slot_bytes(back, 1, length) == slot_bytes(whole, slot, length)


@needs_nixl
def test_an_expired_lease_or_a_passed_deadline_times_out(pair):
    src, dst, a, b = pair
    fill(src, 13)
    fill(dst, 14)
    with TransferEngine(src, "short-lease", timeout_s=0.05) as short:
        b.connect(short.metadata)
        handle = short.export(rid(), 0, 8)
        time.sleep(0.1)
        snap = [x.copy() for x in buffers(dst)]
        with pytest.raises(TransferTimeout, match="lease .* ended"):
            b.pull(handle, 1)
        assert all((x == y).all() for x, y in zip(buffers(dst), snap, strict=True))
        assert short.export_state(handle["request_id"]) == "expired"
        b.disconnect("short-lease")
    pending = b.begin_pull(a.export(rid(), 0, 8), 1)
    time.sleep(0.01)
    with pytest.raises(TransferTimeout, match="deadline"):
        pending.wait(timeout_s=0)                 # a deadline already passed
    assert all(not s.strip(b"\0") for s in slot_bytes(dst, 1, 8))
