"""Device selection, dtypes, streams and the layout descriptors (docs/design.md §2, §3.1)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hcache import DTYPE_NAMES, dtype_name, resolve_device, resolve_dtype
from hcache.device import Device, cupy_available, stream_handle
from hcache.dtypes import storage_dtype
from hcache.ops.tables import KVGroup, SlotSet, group_layers_by_head_dim, pack_kv_layer_infos


def test_cpu_device_and_env_override(monkeypatch):
    assert resolve_device("cpu") == Device("cpu")
    assert resolve_device("CPU").xp is np
    monkeypatch.setenv("HCACHE_DEVICE", "cpu")
    assert resolve_device(None).kind == "cpu"
    monkeypatch.delenv("HCACHE_DEVICE")
    want = "cuda" if cupy_available() else "cpu"
    assert resolve_device(None).kind == want


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cuda:-1", "tpu:0", ""])
def test_malformed_device_strings(bad):
    with pytest.raises(ValueError, match="device: expected"):
        resolve_device(bad)


def test_device_type_errors():
    with pytest.raises(TypeError, match="device: expected None, 'cpu'"):
        resolve_device(0)


@pytest.mark.skipif(cupy_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="device: expected a usable CUDA device"):
        resolve_device("cuda:0")


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_every_spec_dtype_round_trips(name):
    dt = resolve_dtype(name)
    assert dtype_name(dt) == name
    assert resolve_dtype(dt) == dt
    assert storage_dtype(name, np) == dt


def test_dtype_aliases_and_ml_dtypes():
    assert resolve_dtype("bf16") == np.dtype(ml_dtypes.bfloat16)
    assert resolve_dtype(ml_dtypes.float8_e5m2).itemsize == 1
    assert resolve_dtype("FP16") == np.float16


@pytest.mark.parametrize("bad,exc", [("float64", ValueError), (np.int64, ValueError),
                                     (3.5, TypeError), ("fp4", ValueError)])
def test_unsupported_dtypes(bad, exc):
    with pytest.raises(exc, match="dtype: expected"):
        resolve_dtype(bad)


class _Proto:
    def __cuda_stream__(self):
        return (0, 1234)


def test_stream_normalisation():
    assert stream_handle(77) == 77
    assert stream_handle(np.int64(5)) == 5
    assert stream_handle(_Proto()) == 1234
    if not cupy_available():
        assert stream_handle(None) == 0
    with pytest.raises(ValueError, match="stream: expected a non-negative handle"):
        stream_handle(-1)
    with pytest.raises(TypeError, match="stream: expected None"):
        stream_handle("default")
    with pytest.raises(TypeError, match="stream: expected None"):
        stream_handle(True)


def test_kv_layer_info_bytes_match_the_c_struct():
    infos = pack_kv_layer_infos([0x1000, 0x2000], [3, 8], [16, 4096])
    raw = infos.tobytes()
    assert len(raw) == 32  # two 16-byte KVLayerInfo
    data, heads, seq = np.frombuffer(raw[16:], dtype=[("d", "<u8"), ("h", "<i4"),
                                                      ("s", "<i4")])[0]
    assert (data, heads, seq) == (0x2000, 8, 4096)


def test_kv_group_describes_its_layers():
    layers = [np.zeros((4, 2, h, 8, 36), np.float16) for h in (2, 5)]
    g = KVGroup(layers, layer_indices=[1, 7])
    assert (g.num_layers, g.max_kv_heads, g.head_dim, g.row_bytes) == (2, 5, 36, 72)
    assert g.layer_indices == (1, 7)
    assert g.device_layer_infos[1, 0] == layers[1].ctypes.data
    assert g.byte_strides == (0, 0, 0, 0)


def test_nhd_group_takes_strides_from_views():
    buf = np.zeros((3, 2, 4, 5, 2, 8), np.int8)  # [blocks, 2, layers, S, H, D]
    g = KVGroup([buf[:, :, i] for i in range(4)], layout="NHD")
    assert g.byte_strides == (2 * 4 * 5 * 2 * 8, 4 * 5 * 2 * 8, 8, 2 * 8)
    assert g.max_seq_lens == (5,) * 4 and g.num_kv_heads == (2,) * 4


@pytest.mark.parametrize("layers,msg", [
    ([], "layers: expected at least one layer"),
    ([np.zeros((2, 3, 1, 4, 8))], r"layers\[0\]: expected shape"),
    ([np.zeros((2, 2, 1, 4, 8)), np.zeros((2, 2, 1, 4, 16))], r"layers\[1\]: expected dtype"),
    ([np.zeros((2, 2, 1, 4, 8), np.float16)[:, :, :, ::2]], r"layers\[0\]: expected a C-cont"),
])
def test_kv_group_validation(layers, msg):
    with pytest.raises(ValueError, match=msg):
        KVGroup(layers)


def test_slot_set_validation_and_sizes():
    a, b = np.zeros((3, 4, 5), np.float32), np.zeros((7, 4, 5), np.float32)
    s = SlotSet([(a, b)])
    assert s.slot_bytes == (80,) and s.device_infos[0, 3] == 3 | (7 << 32)
    with pytest.raises(ValueError, match=r"pairs\[0\]: expected src and dst of one dtype"):
        SlotSet([(a, np.zeros((7, 4, 6), np.float32))])
    with pytest.raises(ValueError, match="pairs: expected at least one"):
        SlotSet([])


def test_head_dim_groups_keep_first_seen_order():
    assert group_layers_by_head_dim([256, 512, 256, 256, 512]) == [[0, 2, 3], [1, 4]]
