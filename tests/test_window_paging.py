"""Window-aware paging and prefix reuse (docs/design.md §6.7): the sliding-window layers of a
paged pool get their own block space; a request's local blocks are released once out of every
window (registered ones stay cached, evictable on their own), and a prefix hit needs only the
local blocks inside the window before the hit point.

The scenario below counts blocks by hand at every step (block size 4, window 6 tokens: after
``c`` computed tokens, local columns below ``(c - 5) // 4`` are released) and checks the bytes
the engine wrote: K/V rows are ``token * 1000 + position``, so every block's content is known.
It runs on the ``cpu`` device and on the emulated kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

from hcache import KVLayerConfig, ops
from hcache.contexts import DynamicInferenceContext, PagedKVPool

from helpers import DEVICES, host
from kernel_cases import on

BS, W = 4, 6
LAYERS = [KVLayerConfig(1, 8), KVLayerConfig(2, 4, W)]   # full, local


def _ctx(num_local_blocks=10, device="cpu"):
    return DynamicInferenceContext(kv_layer_configs=LAYERS, num_blocks=32, block_size_tokens=BS,
                                   max_requests=4, max_blocks_per_request=16, kv_dtype="float32",
                                   num_local_blocks=num_local_blocks, device=device)


def _xp(ctx):
    return ctx.kv_pool.xp


def _rows(tokens, start, end):
    """K/V rows of positions [start, end): every element token * 1000 + position."""
    vals = (np.asarray(tokens[start:end]) * 1000 + np.arange(start, end)).astype(np.float32)
    return [np.ascontiguousarray(np.broadcast_to(vals[:, None, None],
                                                 (end - start, lc.num_kv_heads, lc.head_dim)))
            for lc in LAYERS]


def _run(ctx, rid, tokens, start, end):
    """The engine's step for one request: write its K/V, commit."""
    rows = [on(_xp(ctx), r) for r in _rows(tokens, start, end)]
    ctx.write_kv([rid], rows, rows)
    return ctx.commit_step()


def _used(allocator) -> int:
    return int(np.count_nonzero(allocator.block_ref_counts))


def _block_positions(ctx, layer, block):
    """The position part of a block's K values (layer: attention index)."""
    data = host(ctx.kv_pool.layers[layer][block, 0, 0, :, 0])
    return (data % 1000).astype(int).tolist()


def scenario(device="cpu"):
    ctx = _ctx(device=device)
    full, local = ctx.kv_block_allocator, ctx.window_blocks.allocator
    a_tokens = list(range(1, 40))           # A's prompt: 32 tokens, then decode
    # A, chunk 1: 16 tokens, 4 columns in both spaces; (16 - 5) // 4 = 2 columns leave the window
    plan = ctx.add_request("A", a_tokens[:16])
    assert (plan.start, plan.end) == (0, 16)
    _run(ctx, "A", a_tokens, 0, 16)
    assert list(ctx.local_block_ids("A")[:2]) == [-1, -1]
    assert (_used(full), _used(local)) == (4, 2)
    # chunk 2: 16 more; computed 32 -> columns < 6 released
    ctx.extend_request("A", a_tokens[16:32])
    _run(ctx, "A", a_tokens, 16, 32)
    assert (_used(full), _used(local)) == (8, 2)
    a_local = ctx.local_block_ids("A")
    assert list(a_local[:6]) == [-1] * 6 and (a_local[6:] >= 0).all()
    a_window = list(a_local[6:8])   # the local blocks of columns 6 and 7
    # one decode token opens column 8; computed 33 -> column 6 released
    ctx.extend_request("A", a_tokens[32:33])
    _run(ctx, "A", a_tokens, 32, 33)
    a_local = ctx.local_block_ids("A")
    assert list(a_local[:7]) == [-1] * 7
    assert (_used(full), _used(local)) == (9, 2)
    assert local.num_free_blocks == 1 and local.get_evictable_block_count() == 7
    # C (20 other tokens, 5 columns) evicts A's four oldest out-of-window local blocks (columns
    # 0..3, cached at clock 0), not columns 4..6 (clock 1): they are evictable although A is live
    c_tokens = list(range(100, 120))
    ctx.add_request("C", c_tokens)
    _run(ctx, "C", c_tokens, 0, 20)
    assert (_used(full), _used(local)) == (14, 4)     # C keeps columns 3, 4 ((20 - 5) // 4 = 3)
    ctx.release_requests(["A"])
    assert (_used(full), _used(local)) == (5, 2)
    # B = A's 32-token prefix + 1: the full layers match 8 blocks; the local layers need only
    # columns 6 and 7 (the window before position 32), still cached: a full hit
    b_tokens = a_tokens[:32] + [7]
    plan = ctx.add_request("B", b_tokens)
    stats = ctx.request_stats("B")
    assert plan.start == 32 and stats.kv_hit_blocks == 8 and stats.skipped_tokens == 32
    b_local = ctx.local_block_ids("B")
    assert list(b_local[:6]) == [-1] * 6 and list(b_local[6:8]) == a_window
    assert (_used(full), _used(local)) == (5 + 9, 2 + 3)
    for col in (6, 7):   # the matched local blocks hold A's K/V of the window
        assert _block_positions(ctx, 1, b_local[col]) == list(range(4 * col, 4 * col + 4))
    _run(ctx, "B", b_tokens, 32, 33)
    assert _block_positions(ctx, 1, ctx.local_block_ids("B")[8])[0] == 32
    assert host(ctx.kv_pool.layers[1][ctx.local_block_ids("B")[8], 0, 0, 0, 0]) == \
        7 * 1000 + 32
    # E = A's first 12 tokens + 4 new: its local window (columns 1, 2) was evicted, and so were
    # the shorter windows: no usable match, everything is computed
    plan = ctx.add_request("E", a_tokens[:12] + [200, 201, 202, 203])
    stats = ctx.request_stats("E")
    assert plan.start == 0 and stats.kv_hit_blocks == 0
    ctx.check_invariants()
    return ctx


@pytest.mark.parametrize("device", DEVICES)
def test_window_paging_frees_and_reuses_blocks(device):
    """cpu, a GPU, and the asynchronous emulated device (the local block table staged per
    step)."""
    scenario(device)


@pytest.mark.emu
def test_window_paging_emulated():
    emu = pytest.importorskip("emu")
    if not emu.have_compiler():
        pytest.skip("no host C++ compiler")
    launcher = emu.EmuLauncher()
    with ops.host_backend(launcher):
        scenario()
    assert any(name == "hc_kv_write" for name, _, _ in launcher.launches)


@pytest.mark.parametrize("device", DEVICES)
def test_pool_with_a_local_block_space(device):
    """Local layers live in num_local_blocks blocks and are written through the local table
    (-1 entries skipped); the full layers through the full one; a missing local table is
    refused before anything is written."""
    pool = PagedKVPool(LAYERS, num_blocks=5, block_size=2, dtype="float32",
                       num_local_blocks=3, device=device)
    assert pool.local_layers == (False, True)
    assert pool.layers[0].shape == (5, 2, 1, 2, 8) and pool.layers[1].shape == (3, 2, 2, 2, 4)
    assert pool.memory_report()["num_local_blocks"] == 3
    assert pool.bytes_per_local_block == 2 * 2 * 2 * 4 * 4
    k_host = [np.arange(4 * lc.num_kv_heads * lc.head_dim, dtype=np.float32).reshape(
        4, lc.num_kv_heads, lc.head_dim) for lc in LAYERS]
    k = [on(pool.xp, a) for a in k_host]
    table = on(pool.xp, np.array([[4, 1]], np.int32))
    with pytest.raises(TypeError, match="local_block_table: expected"):
        pool.write_kv(k, k, block_table=table, uniform_tokens=4)
    assert not host(pool.layers[0]).any()
    pool.write_kv(k, k, block_table=table,
                  local_block_table=on(pool.xp, np.array([[-1, 2]], np.int32)),
                  uniform_tokens=4)
    layers = [host(a) for a in pool.layers]
    assert np.array_equal(layers[0][4, 0, :, 0], k_host[0][0])
    assert np.array_equal(layers[0][1, 1, :, 1], k_host[0][3])
    assert np.array_equal(layers[1][2, 0, :, 0], k_host[1][2])   # positions 2, 3 -> block 2
    assert not layers[1][:2].any()                                # column 0 was -1
    pool.copy_blocks([2], [0], local=True)
    local = host(pool.layers[1])
    assert np.array_equal(local[0], local[2])
    with pytest.raises(IndexError):
        pool.copy_blocks([3], [0], local=True)
    plain = PagedKVPool(LAYERS, num_blocks=5, block_size=2, device=device)
    assert plain.local_layers == (False, False) and not plain.has_local_space
    with pytest.raises(ValueError, match="local: expected a pool with a local block space"):
        plain.copy_blocks([1], [0], local=True)


# --- random runs: every live request's blocks hold its K/V ------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hcache.errors import CacheCapacityError  # noqa: E402

BASE = list(range(1, 60))   # prompts share prefixes of this sequence, so prefixes hit


def _check_data(ctx, tokens_of):
    """Full layer: positions [0, computed) of every live request; local layer: positions from
    the first live local column on. Rows of K are token * 1000 + position."""
    for rid, tokens in tokens_of.items():
        computed = ctx.num_computed_tokens(rid)
        full_ids, local_ids = ctx.block_ids(rid), ctx.local_block_ids(rid)
        for layer, ids in ((0, full_ids), (1, local_ids)):
            for p in range(computed):
                block = ids[p // BS]
                if block < 0:
                    assert layer == 1 and p < computed - W + 1   # only out-of-window ones
                    continue
                got = host(ctx.kv_pool.layers[layer][block, 0, 0, p % BS, 0])
                assert got == tokens[p] * 1000 + p, (rid, layer, p)


@settings(max_examples=30)
@given(ops_=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.booleans(),
                               st.integers(0, 4)), min_size=1, max_size=25),
       local_blocks=st.integers(6, 14), mamba=st.booleans())
def test_random_runs_keep_every_window(ops_, local_blocks, mamba):
    """Random admissions (shared prefixes, so hits across the window), extensions and releases
    with a small local space (refusals allowed): after every step the invariants hold and every
    live request's full blocks and live local blocks hold its K/V; released local columns are
    all out of the window."""
    _random_run(ops_, local_blocks, mamba, "cpu")


@pytest.mark.emulated
@settings(max_examples=6)
@given(ops_=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.booleans(),
                               st.integers(0, 4)), min_size=1, max_size=15),
       local_blocks=st.integers(6, 14), mamba=st.booleans())
def test_random_runs_keep_every_window_emulated_device(ops_, local_blocks, mamba):
    """The same on the asynchronous emulated device (the CUDA path)."""
    _random_run(ops_, local_blocks, mamba, "cuda")


def _random_run(ops_, local_blocks, mamba, device):
    ctx = DynamicInferenceContext(
        kv_layer_configs=LAYERS, num_blocks=40, block_size_tokens=BS, max_requests=4,
        max_blocks_per_request=16, kv_dtype="float32", num_local_blocks=local_blocks,
        num_mamba_layers=1 if mamba else 0, conv_states_shape=(2, 2), ssm_states_shape=(2,),
        mamba_cache_slots=4 if mamba else 0, device=device)
    tokens_of: dict = {}
    for i, (rid, n, private, what) in enumerate(ops_):
        try:
            if rid not in tokens_of:     # admit a prefix of BASE (plus a private token)
                prompt = BASE[:n] + ([1000 + i] if private else [])
                plan = ctx.add_request(rid, prompt)
                tokens_of[rid] = prompt
            elif what == 0:
                ctx.release_requests([rid])
                del tokens_of[rid]
                ctx.check_invariants()
                continue
            elif what == 4:              # a batched decode step of every live request
                rids = [r for r, t in tokens_of.items() if len(t) < 64]
                if not rids:
                    continue
                batch = ctx.extend_requests(rids, [3000 + i] * len(rids))
                for r in rids:
                    tokens_of[r] = tokens_of[r] + [3000 + i]
                rows = [_rows(tokens_of[r], p.start, p.end) for r, p in zip(rids, batch)]
                k = [on(_xp(ctx), np.concatenate([r[a] for r in rows]))
                     for a in range(len(LAYERS))]
                ctx.write_kv(rids, k, k)
                ctx.commit_step()
                ctx.check_invariants()
                _check_data(ctx, tokens_of)
                continue
            else:                        # extend by 1..6 tokens (decode or a chunk)
                k = min(n % 6 + 1, 64 - len(tokens_of[rid]))
                if k < 1:
                    continue
                new = [2000 + i + j for j in range(k)]
                plan = ctx.extend_request(rid, new)
                tokens_of[rid] = tokens_of[rid] + new
        except CacheCapacityError:
            ctx.check_invariants()
            continue
        _run(ctx, rid, tokens_of[rid], plan.start, plan.end)
        ctx.check_invariants()
        _check_data(ctx, tokens_of)
