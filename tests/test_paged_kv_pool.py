"""PagedKVPool: writes through block tables and copy-on-write, against a NumPy model."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from hcache import DTYPE_NAMES, KVLayerConfig, resolve_dtype
from hcache.contexts import PagedKVPool

import helpers
from helpers import host

DEVICES = helpers.DEVICES
# Two head dims (4 and 8), interleaved, with different head counts.
LAYERS = [KVLayerConfig(2, 4), KVLayerConfig(1, 8), KVLayerConfig(3, 4)]



def raw(a):
    """Bytes of an array as uint8, for byte-exact comparison of any dtype."""
    a = np.ascontiguousarray(host(a))
    return a.view(np.uint8)


def random_rows(pool, rng, num_tokens, layer):
    lc = pool.layer_configs[layer]
    shape = (num_tokens, lc.num_kv_heads, lc.head_dim)
    itemsize = np.dtype(pool.storage_dtype).itemsize
    data = rng.integers(0, 256, size=(int(np.prod(shape)) * itemsize,), dtype=np.uint8)
    return pool.xp.asarray(data.view(pool.storage_dtype).reshape(shape))


def model_of(pool):
    return [host(a).copy() for a in pool.layers]


def model_write(model, layer, k, v, offsets, cache_lengths, table, block_size):
    """Token ``offsets[b] + j`` of row ``b`` lands at position ``cache_lengths[b] + j``, i.e.
    block ``table[b][pos // block_size]`` (skipped when -1), offset ``pos % block_size``."""
    k, v = host(k), host(v)
    for b, pos0 in enumerate(cache_lengths):
        for j in range(offsets[b + 1] - offsets[b]):
            pos = pos0 + j
            block = table[b][pos // block_size]
            if block != -1:
                model[layer][block, 0, :, pos % block_size, :] = k[offsets[b] + j]
                model[layer][block, 1, :, pos % block_size, :] = v[offsets[b] + j]


def ragged(pool, rng, lengths, cache_lengths, table, pad=0):
    """Inputs of a ragged write: per-layer k/v with ``pad`` padding tokens at the end."""
    xp = pool.xp
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(offsets[-1]) + pad
    ks = [random_rows(pool, rng, total, i) for i in range(pool.num_layers)]
    vs = [random_rows(pool, rng, total, i) for i in range(pool.num_layers)]
    args = dict(seq_offsets=xp.asarray(offsets), cache_lengths=xp.asarray(
        np.asarray(cache_lengths, dtype=np.int32)), block_table=xp.asarray(
        np.asarray(table, dtype=np.int32)))
    return ks, vs, offsets, args


def check_pool(pool, model):
    for i, (a, m) in enumerate(zip(pool.layers, model, strict=True)):
        assert np.array_equal(raw(a), raw(m)), f"layer {i} differs"


@pytest.mark.parametrize("device", DEVICES)
def test_ragged_write_of_all_layers_lands_in_the_right_blocks(device):
    pool = PagedKVPool(LAYERS, num_blocks=8, block_size=4, dtype="float16", device=device)
    assert [g.head_dim for g in pool.groups] == [4, 8]
    assert [list(g.layer_indices) for g in pool.groups] == [[0, 2], [1]]
    rng = np.random.default_rng(0)
    lengths, cache_lengths = [5, 2, 3], [0, 3, 6]
    # Row 1 crosses a block boundary (positions 3..4); row 2 starts in its second block;
    # row 2's first table entry is -1 (nothing there is written).
    table = [[1, 4, -1], [6, 2, 0], [-1, 7, 5]]
    ks, vs, offsets, args = ragged(pool, rng, lengths, cache_lengths, table, pad=3)
    model = model_of(pool)
    pool.write(ks, vs, **args)
    for i in range(pool.num_layers):
        model_write(model, i, ks[i], vs[i], offsets, cache_lengths, table, 4)
    check_pool(pool, model)
    assert all(np.any(raw(a)) for a in pool.layers)


@pytest.mark.parametrize("device", DEVICES)
def test_single_layer_write_touches_only_that_layer(device):
    pool = PagedKVPool(LAYERS, num_blocks=4, block_size=2, device=device)
    rng = np.random.default_rng(1)
    k, v = random_rows(pool, rng, 3, 2), random_rows(pool, rng, 3, 2)
    xp = pool.xp
    pool.write(k, v, layer=2, uniform_tokens=3,
               block_table=xp.asarray(np.array([[3, 0]], dtype=np.int32)))
    model = [np.zeros_like(host(a)) for a in pool.layers]
    model_write(model, 2, k, v, [0, 3], [0], [[3, 0]], 2)
    check_pool(pool, model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_every_dtype_is_written_and_copied_byte_exactly(device, dtype):
    pool = PagedKVPool([KVLayerConfig(1, 2), KVLayerConfig(2, 2)], 5, 3, dtype=dtype,
                       device=device)
    assert pool.dtype == resolve_dtype(dtype)
    rng = np.random.default_rng(2)
    table = [[2, 0], [4, 1]]
    ks, vs, offsets, args = ragged(pool, rng, [4, 2], [1, 0], table)
    pool.write(ks, vs, **args)
    model = model_of(pool)
    expected = [np.zeros_like(m) for m in model]
    for i in range(2):
        model_write(expected, i, ks[i], vs[i], offsets, [1, 0], table, 3)
    check_pool(pool, expected)
    pool.copy_blocks([2, 4], [3, 0])
    for m in expected:
        m[[3, 0]] = m[[2, 4]]
    check_pool(pool, expected)


@given(st.data())
def test_random_ragged_batches_match_the_model(data):
    block_size = data.draw(st.integers(1, 4))
    pool = PagedKVPool(LAYERS, num_blocks=10, block_size=block_size, device="cpu")
    batch = data.draw(st.integers(0, 3))
    lengths = data.draw(st.lists(st.integers(0, 5), min_size=batch, max_size=batch))
    cache_lengths = data.draw(st.lists(st.integers(0, 4), min_size=batch, max_size=batch))
    width = max([1] + [-(-(c + n) // block_size) for n, c in zip(lengths, cache_lengths,
                                                                  strict=True)])
    # Rows own disjoint blocks (a shared prefix block is never written); -1 entries allowed.
    blocks = data.draw(st.permutations(range(10)))
    table = [[blocks[(b * width + j) % 10] if b * width + j < 10 else -1
              for j in range(width)] for b in range(batch)]
    table = [[-1 if data.draw(st.integers(0, 5)) == 0 else x for x in row] for row in table]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    pad = data.draw(st.integers(0, 2))
    if batch == 0:
        table = np.zeros((0, 1), dtype=np.int32)
    ks, vs, offsets, args = ragged(pool, rng, lengths, cache_lengths, table, pad=pad)
    model = model_of(pool)
    pool.write(ks, vs, **args)
    for i in range(pool.num_layers):
        model_write(model, i, ks[i], vs[i], offsets, cache_lengths, table, block_size)
    check_pool(pool, model)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_copies_every_layer_and_nothing_else(device):
    pool = PagedKVPool(LAYERS, num_blocks=6, block_size=2, device=device)
    rng = np.random.default_rng(3)
    for a in pool.layers:
        a[...] = pool.xp.asarray(rng.standard_normal(a.shape).astype(np.float16))
    model = model_of(pool)
    pool.copy_blocks([0, 5, -1], [3, 1, 2])
    for m in model:
        m[[3, 1]] = m[[0, 5]]
    check_pool(pool, model)
    pool.copy_blocks([], [])
    check_pool(pool, model)


@pytest.mark.gpu
def test_copy_blocks_with_device_index_arrays():
    import cupy

    pool = PagedKVPool(LAYERS, num_blocks=6, block_size=2, device="cuda")
    for a in pool.layers:
        a[...] = cupy.arange(a.size, dtype=cupy.float16).reshape(a.shape)
    model = model_of(pool)
    status = cupy.zeros(1, dtype=cupy.int32)
    pool.copy_blocks(cupy.asarray([4, 9], dtype=cupy.int32), cupy.asarray([2, 3],
                                                                          dtype=cupy.int32),
                     status=status)
    for m in model:
        m[2] = m[4]
    check_pool(pool, model)
    assert int(status[0]) == 1   # the out-of-range pair is skipped and counted


@pytest.mark.parametrize("src,dst,exc", [
    ([0, 1], [2], ValueError),          # lengths differ
    ([0, 1], [2, 2], ValueError),       # repeated destination
    ([0, 1], [1, 2], ValueError),       # a block both read and written
    ([0, 6], [2, 3], IndexError),       # out of range
    ([0], [-2], IndexError),
    ([0.0], [1.0], TypeError),
])
def test_copy_blocks_rejects_bad_ids_and_changes_nothing(src, dst, exc):
    pool = PagedKVPool(LAYERS, num_blocks=6, block_size=2, device="cpu")
    for i, a in enumerate(pool.layers):
        a[...] = np.arange(a.size).reshape(a.shape) + i
    model = model_of(pool)
    with pytest.raises(exc):
        pool.copy_blocks(src, dst)
    check_pool(pool, model)


def test_write_rejects_bad_inputs_and_changes_nothing():
    pool = PagedKVPool(LAYERS, num_blocks=4, block_size=2, device="cpu")
    rng = np.random.default_rng(4)
    ks, vs, offsets, args = ragged(pool, rng, [2], [0], [[1, 2]])
    model = model_of(pool)
    bad_shape = [ks[0], ks[1], ks[2][:, :2]]
    bad_dtype = [ks[0], ks[1].astype(np.float32), ks[2]]
    with pytest.raises(ValueError, match="k"):
        pool.write(ks[:2], vs, **args)
    with pytest.raises(ValueError, match=r"k\[2\]"):
        pool.write(bad_shape, vs, **args)
    with pytest.raises(ValueError, match=r"k\[1\]"):
        pool.write(bad_dtype, vs, **args)
    with pytest.raises(ValueError, match="block_table"):   # int64 table: checked by ops first
        pool.write(ks, vs, **{**args, "block_table": args["block_table"].astype(np.int64)})
    with pytest.raises(TypeError, match="block_table"):
        pool.write(ks, vs, **{**args, "block_table": None})
    with pytest.raises(IndexError, match="layer"):
        pool.write(ks[0], vs[0], layer=3, **args)
    with pytest.raises(TypeError, match="layer"):
        pool.write(ks[0], vs[0], layer="0", **args)
    with pytest.raises(TypeError, match="k"):
        pool.write([k.tolist() for k in ks], vs, **args)
    check_pool(pool, model)


def test_pool_without_attention_layers_holds_nothing():
    # A pure-Mamba model: blocks carry hashes and positions only.
    pool = PagedKVPool([], 4, 2, device="cpu")
    assert pool.num_layers == 0 and pool.nbytes == 0 and pool.bytes_per_block == 0
    pool.write([], [], block_table=np.zeros((1, 1), np.int32), uniform_tokens=1)
    pool.copy_blocks([0], [1])
    with pytest.raises(IndexError):
        pool.copy_blocks([0], [4])
    with pytest.raises(ValueError):
        pool.write([np.zeros((1, 1, 1))], [], block_table=np.zeros((1, 1), np.int32))


def test_constructor_validation_layers_and_report():
    with pytest.raises(TypeError):
        PagedKVPool([(2, 4)], 4, 2, device="cpu")
    with pytest.raises(ValueError):
        PagedKVPool(LAYERS, 0, 2, device="cpu")
    with pytest.raises(ValueError):
        PagedKVPool(LAYERS, 4, 2, dtype="float64", device="cpu")
    pool = PagedKVPool(LAYERS, 4, 2, dtype="bfloat16", device="cpu")
    assert [a.shape for a in pool.layers] == [(4, 2, 2, 2, 4), (4, 2, 1, 2, 8),
                                              (4, 2, 3, 2, 4)]
    per_block = 2 * 2 * (2 * 4 + 1 * 8 + 3 * 4) * 2   # K+V, tokens, sum(H*D), bytes
    report = pool.memory_report()
    assert report["bytes_per_block"] == per_block == pool.bytes_per_block
    # metadata: per layer its KVLayerInfo and pointer-scratch rows (24 B each), its int32
    # label and its 32-byte SlotTensorInfo (block copies); the int32 copy ids [2, num_blocks]
    metadata = 3 * (2 * 24 + 4 + 32) + 2 * 4 * 4
    assert report["metadata_bytes"] == metadata
    assert report["total_bytes"] == 4 * per_block + metadata
    assert report["groups"][0]["layers"] == [0, 2] and report["dtype"] == "bfloat16"
    view = pool.get_layer(1)
    view[2, 1, 0, 1, 3] = 5
    assert pool.layers[1][2, 1, 0, 1, 3] == 5
    with pytest.raises(IndexError):
        pool.get_layer(3)
    with pytest.raises(IndexError):
        pool.get_layer(-1)


def test_uniform_rows_must_fill_whole_rows():
    """With ``uniform_tokens`` and no explicit ``batch``, a token count that is not a multiple
    would silently drop the last tokens: refused, nothing written. An explicit ``batch`` keeps
    the kernel's meaning (rows past ``batch * uniform_tokens`` are padding)."""
    pool = PagedKVPool(LAYERS, num_blocks=4, block_size=2, device="cpu")
    rng = np.random.default_rng(3)
    k, v = random_rows(pool, rng, 5, 0), random_rows(pool, rng, 5, 0)
    table = np.array([[0, 1, -1], [2, 3, -1]], np.int32)
    before = model_of(pool)
    with pytest.raises(ValueError, match=r"k: expected a multiple of uniform_tokens \(2\) rows, "
                                         r"got 5"):
        pool.write_kv(k, v, layer=0, block_table=table, uniform_tokens=2)
    check_pool(pool, before)
    pool.write_kv(k, v, layer=0, block_table=table, uniform_tokens=2, batch=2)   # 1 pad row
    written = host(pool.get_layer(0))
    np.testing.assert_array_equal(written[0, 0, :, 0], host(k)[0])
    np.testing.assert_array_equal(written[2, 0, :, 1], host(k)[3])
