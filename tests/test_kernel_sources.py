"""The kernel sources: NVRTC compiles every family for sm_80 and sm_90 (no GPU needed), the
loader's ``#line`` directive names the real file in errors, and each ``.cu`` lists the kernels
that the loader expects."""

from __future__ import annotations

import re

import pytest

from hcache.errors import KernelCompileError
from hcache.ops import _loader as _kernels
from hcache.ops import _nvrtc

FAMILIES = sorted(_kernels.FAMILIES)
needs_nvrtc = pytest.mark.skipif(_nvrtc.find_libnvrtc() is None,
                                 reason="libnvrtc missing: pip install nvidia-cuda-nvrtc-cu12")


@pytest.mark.nvrtc
@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_compiles_with_nvrtc(family, arch):
    assert _nvrtc.compile_family(family, arch) > 1000


@pytest.mark.nvrtc
@needs_nvrtc
def test_compile_errors_name_the_cu_file_and_line(monkeypatch, tmp_path):
    src = (_kernels.kernel_dir() / "lengths.cu").read_text()
    broken = src.replace("if (blockIdx.x != 0", "if (undeclared_name != 0", 1)
    line = broken[:broken.index("undeclared_name")].count("\n") + 1
    (tmp_path / "lengths.cu").write_text(broken)
    (tmp_path / "common.cuh").write_text((_kernels.kernel_dir() / "common.cuh").read_text())
    monkeypatch.setattr(_kernels, "kernel_dir", lambda: tmp_path)
    with pytest.raises(KernelCompileError) as info:
        _nvrtc.compile_family("lengths", "sm_80")
    assert info.value.filename.endswith("lengths.cu")
    assert f"lengths.cu({line})" in info.value.log


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_comment_matches_loader_table(family):
    path, source = _kernels.kernel_source(family)
    assert source.startswith(f'#line 1 "{path}"\n')
    exported = re.search(r"// Exported: (.*)", source).group(1)
    assert tuple(n.strip() for n in exported.split(",")) == _kernels.FAMILIES[family]
    for name in _kernels.FAMILIES[family]:
        assert f'extern "C" __global__ void {name}(' in source


@pytest.mark.parametrize("family", FAMILIES)
def test_sources_use_no_host_headers(family):
    _, source = _kernels.kernel_source(family)
    includes = re.findall(r'#include\s+[<"]([^>"]+)[>"]', source)
    assert set(includes) <= {"common.cuh"}


def test_unknown_family_or_kernel():
    with pytest.raises(ValueError, match="family: expected one of"):
        _kernels.kernel_source("nope")
    with pytest.raises(ValueError, match="name: expected a kernel of 'compact'"):
        _kernels.get_function("compact", "hc_nope", 0)


def test_import_compiles_nothing():
    import subprocess
    import sys

    code = ("import hcache, hcache.ops, hcache.ops._loader as k, sys;"
            "print(k._module.cache_info().currsize, 'cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["0", "False"]
