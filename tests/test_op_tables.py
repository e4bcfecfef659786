"""The descriptor tables the kernels read (hcache/ops/tables.py, docs/design.md §3.1):
``KVLayerInfo`` / ``SlotTensorInfo`` bytes against the C structs of ``kernels/common.cuh``,
:class:`KVGroup` and :class:`SlotSet` validation, head-dim grouping. The compaction plan's
format (also in ``tables.py``) is tested with its family in ``test_op_compact.py``."""

from __future__ import annotations

import numpy as np
import pytest

from hcache.ops.tables import KVGroup, SlotSet, group_layers_by_head_dim, pack_kv_layer_infos


def test_kv_layer_info_bytes_match_the_c_struct():
    """pack_kv_layer_infos gives the bytes of KVLayerInfo[n] (24 bytes each, C layout:
    data, num_kv_heads, max_seq_len, ring_window, reserved)."""
    infos = pack_kv_layer_infos([0x1000, 0x2000], [3, 8], [16, 4096], [16, 0])
    raw = infos.tobytes()
    assert len(raw) == 48  # two 24-byte KVLayerInfo
    rec = np.dtype([("d", "<u8"), ("h", "<i4"), ("s", "<i4"), ("w", "<i4"), ("r", "<i4")])
    first, second = np.frombuffer(raw, dtype=rec)
    assert tuple(first) == (0x1000, 3, 16, 16, 0)
    assert tuple(second) == (0x2000, 8, 4096, 0, 0)
    assert pack_kv_layer_infos([0x1000], [3], [16])[0, 2] == 0   # unbounded by default


def test_kv_group_ring_windows():
    """A ring layer's window must equal its token axis; 0 marks an unbounded layer; the
    group's capture bounds follow (a ring holds the last W of any prefix)."""
    layers = [np.zeros((2, 2, 1, 4, 8), np.float16), np.zeros((2, 2, 1, 9, 8), np.float16)]
    g = KVGroup(layers, ring_windows=[4, 0])
    assert g.ring_windows == (4, 0) and g.has_rings
    assert tuple(g.device_layer_infos[:, 2]) == (4, 0)
    assert (g.held_tokens(0, 7), g.held_tokens(1, 7), g.held_tokens(0, 3)) == (4, 7, 3)
    assert g.max_tokens(0) == 2**31 - 1 and g.max_tokens(1) == 9
    assert not KVGroup(layers).has_rings
    with pytest.raises(ValueError, match=r"ring_windows\[1\]: expected 0 \(unbounded\) or 9"):
        KVGroup(layers, ring_windows=[4, 5])
    with pytest.raises(ValueError, match="ring_windows: expected 2 windows, got 1"):
        KVGroup(layers, ring_windows=[4])


def test_kv_group_describes_its_layers():
    """A KVGroup's sizes, labels, device table and strides against hand-computed values."""
    layers = [np.zeros((4, 2, h, 8, 36), np.float16) for h in (2, 5)]
    g = KVGroup(layers, layer_indices=[1, 7])
    assert (g.num_layers, g.max_kv_heads, g.head_dim, g.row_bytes) == (2, 5, 36, 72)
    assert g.layer_indices == (1, 7)
    assert g.device_layer_infos[1, 0] == layers[1].ctypes.data
    assert g.byte_strides == (0, 0, 0, 0)


def test_nhd_group_takes_strides_from_views():
    """An NHD group of views takes its byte strides, heads and lengths from the views."""
    buf = np.zeros((3, 2, 4, 5, 2, 8), np.int8)  # [blocks, 2, layers, S, H, D]
    g = KVGroup([buf[:, :, i] for i in range(4)], layout="NHD")
    assert g.byte_strides == (2 * 4 * 5 * 2 * 8, 4 * 5 * 2 * 8, 8, 2 * 8)
    assert g.max_seq_lens == (5,) * 4 and g.num_kv_heads == (2,) * 4


@pytest.mark.parametrize("layers,msg", [
    ([], "layers: expected at least one layer"),
    ([np.zeros((2, 3, 1, 4, 8))], r"layers\[0\]: expected shape"),
    ([np.zeros((2, 2, 1, 4, 8)), np.zeros((2, 2, 1, 4, 16))], r"layers\[1\]: expected dtype"),
    ([np.zeros((2, 2, 1, 4, 8), np.float16)[:, :, :, ::2]], r"layers\[0\]: expected a C-cont"),
    ([np.zeros((2, 1, 1, 4, 8)), np.zeros((2, 2, 1, 4, 8))],
     r"layers\[1\]: expected shape \[slots, 1, \., \., D\] \(components as layers\[0\]\)"),
])
def test_kv_group_validation(layers, msg):
    """Bad layer lists are refused with a ValueError naming the layer."""
    with pytest.raises(ValueError, match=msg):
        KVGroup(layers)


def test_slot_set_validation_and_sizes():
    """A SlotSet's slot sizes and SlotTensorInfo words; mismatched or empty pairs refused."""
    a, b = np.zeros((3, 4, 5), np.float32), np.zeros((7, 4, 5), np.float32)
    s = SlotSet([(a, b)])
    assert s.slot_bytes == (80,) and s.device_infos[0, 3] == 3 | (7 << 32)
    with pytest.raises(ValueError, match=r"pairs\[0\]: expected src and dst of one dtype"):
        SlotSet([(a, np.zeros((7, 4, 6), np.float32))])
    with pytest.raises(ValueError, match="pairs: expected at least one"):
        SlotSet([])


def test_head_dim_groups_keep_first_seen_order():
    """Layers grouped by head dim, groups in first-seen order."""
    assert group_layers_by_head_dim([256, 512, 256, 256, 512]) == [[0, 2, 3], [1, 4]]


def test_latent_layers_group_apart_from_kv_layers_of_their_head_dim():
    """With component counts, a latent layer and a K/V layer of one head dim are two groups
    (first-seen order); a latent group says so."""
    assert group_layers_by_head_dim([576, 128, 576, 576], [1, 2, 2, 1]) == [[0, 3], [1], [2]]
    with pytest.raises(ValueError, match="components: expected 2 values"):
        group_layers_by_head_dim([8, 8], [1])
    g = KVGroup([np.zeros((3, 1, 1, 4, 576), np.float16)])
    assert (g.components, g.num_kv_heads, g.row_bytes) == (1, (1,), 1152)
    assert KVGroup([np.zeros((3, 2, 1, 4, 8))]).components == 2


@pytest.mark.parametrize("shape", [(2, 2, 0, 4, 8), (2, 2, 1, 0, 8), (2, 2, 1, 4, 0)])
def test_kv_group_rejects_empty_heads_tokens_or_head_dim(shape):
    """A layer with no kv head, token or head-dim element is refused with ValueError."""
    # S = 0 made the paged write divide by zero (pos / S), H = 0 a zero-sized grid.x, D = 0 a
    # loop without work items that reported nothing.
    with pytest.raises(ValueError, match=r"layers\[0\]: expected at least one"):
        KVGroup([np.zeros(shape, np.float16)])


def test_descriptors_refuse_more_layers_than_grid_y_holds():
    """More layers (pairs) than grid.y holds (65535) are refused with ValueError."""
    one = np.zeros((1, 2, 1, 1, 1), np.uint8)
    with pytest.raises(ValueError, match="layers: expected at most 65535 layers"):
        KVGroup([one] * 65536)
    t = np.zeros((1, 1), np.uint8)
    with pytest.raises(ValueError, match="pairs: expected at most 65535 pairs"):
        SlotSet([(t, t)] * 65536)


def test_slot_set_rebind_rewrites_its_table_in_place():
    """rebind points the set at other tensors of the same slot sizes through the same table
    (hand-computed SlotTensorInfo words); another slot size or pair count is refused and
    changes nothing."""
    a, b = np.zeros((3, 4), np.float32), np.zeros((5, 4), np.float32)
    s = SlotSet([(a, b)])
    table = s.device_infos
    c, d = np.zeros((2, 4), np.float32), np.zeros((6, 4), np.float32)
    s.rebind([(c, d)])
    assert s.device_infos is table and s.pairs[0][0] is c and s.pairs[0][1] is d
    assert table[0].tolist() == [c.ctypes.data, d.ctypes.data, 16, 2 | (6 << 32)]
    wide = np.zeros((2, 5), np.float32)
    with pytest.raises(ValueError, match=r"pairs: expected slot sizes \(16,\)"):
        s.rebind([(wide, wide)])
    with pytest.raises(ValueError, match="pairs: expected 1 pairs, got 2"):
        s.rebind([(c, d), (c, d)])
    assert s.pairs[0][0] is c
    assert table[0].tolist() == [c.ctypes.data, d.ctypes.data, 16, 2 | (6 << 32)]
