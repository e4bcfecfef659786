"""The kernel sources and the floor plan of each family (docs/design.md §3, §9): NVRTC compiles
every family for sm_80 and sm_90 (no GPU needed), the loader's ``#line`` directive names the
real file in errors, each ``.cu`` lists the kernels that the loader expects, and every family
has its kernel file, ops module, reference functions, test module and benchmark under one
name."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from hcache import ops
from hcache.errors import KernelCompileError
from hcache.ops import _loader, _nvrtc
from hcache.ops import reference as ref

FAMILIES = sorted(_loader.FAMILIES)
TESTS = Path(__file__).resolve().parent
LAUNCH_ONLY = ("stream", "backend")   # keyword-only, last, in every wrapper; not in the reference
needs_nvrtc = pytest.mark.skipif(_nvrtc.find_libnvrtc() is None,
                                 reason="libnvrtc missing: pip install nvidia-cuda-nvrtc-cu12")


# Registers per thread on sm_90 that each kernel may use (issue 22): the copies keep several
# 16-byte loads in flight per thread and need occupancy to hide DRAM latency, so a rewrite that
# brings back per-chunk 64-bit index math (68 registers for hc_kv_write before) fails here.
REGISTER_BUDGET = {"hc_kv_write": 48, "hc_kv_write_fp8": 64}


@pytest.mark.nvrtc
@needs_nvrtc
def test_kernel_registers_reports_every_kernel_within_budget():
    """ptxas reports a register count for every exported kernel of every family, and the write
    kernels stay within their budgets (their launch bounds)."""
    for family, names in _loader.FAMILIES.items():
        regs = _nvrtc.kernel_registers(family, "sm_90")
        if set(regs) != set(names):   # say what ptxas printed (once seen empty on a GPU host)
            log = _nvrtc._compile(family, "sm_90", ("-Xptxas=-v",))[1]
            pytest.fail(f"{family}: expected registers of {sorted(names)}, got {regs}; "
                        f"nvrtc {_nvrtc.find_libnvrtc()}, log:\n{log[-3000:]}")
        assert all(0 < n <= 255 for n in regs.values())
        for name, budget in REGISTER_BUDGET.items():
            if name in regs:
                assert regs[name] <= budget, (name, regs[name])


@pytest.mark.nvrtc
@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_compiles_with_nvrtc(family, arch):
    """NVRTC compiles the family's source (as the loader gives it) to a non-trivial cubin."""
    assert _nvrtc.compile_family(family, arch) > 1000


@pytest.mark.nvrtc
@needs_nvrtc
def test_compile_errors_name_the_cu_file_and_line(monkeypatch, tmp_path):
    """A compile error raises KernelCompileError whose log names the .cu file and line."""
    src = (_loader.kernel_dir() / "lengths.cu").read_text()
    broken = src.replace("if (blockIdx.x != 0", "if (undeclared_name != 0", 1)
    line = broken[:broken.index("undeclared_name")].count("\n") + 1
    (tmp_path / "lengths.cu").write_text(broken)
    (tmp_path / "common.cuh").write_text((_loader.kernel_dir() / "common.cuh").read_text())
    monkeypatch.setattr(_loader, "kernel_dir", lambda: tmp_path)
    with pytest.raises(KernelCompileError) as info:
        _nvrtc.compile_family("lengths", "sm_80")
    assert info.value.filename.endswith("lengths.cu")
    assert f"lengths.cu({line})" in info.value.log


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_comment_matches_loader_table(family):
    """The ``// Exported:`` comment of the .cu equals the loader's FAMILIES entry, and every
    listed kernel is defined ``extern "C" __global__`` (with or without launch bounds)."""
    path, source = _loader.kernel_source(family)
    assert source.startswith(f'#line 1 "{path}"\n')
    exported = re.search(r"// Exported: (.*)", source).group(1)
    assert tuple(n.strip() for n in exported.split(",")) == _loader.FAMILIES[family]
    for name in _loader.FAMILIES[family]:
        bounds = r"(__launch_bounds__\(\d+(, \d+)?\) )?"
        assert re.search(rf'extern "C" __global__ void {bounds}{name}\(', source), name


@pytest.mark.parametrize("family", FAMILIES)
def test_sources_use_no_host_headers(family):
    """A family's source includes nothing but common.cuh (NVRTC has no host headers)."""
    _, source = _loader.kernel_source(family)
    includes = re.findall(r'#include\s+[<"]([^>"]+)[>"]', source)
    assert set(includes) <= {"common.cuh"}


def test_unknown_family_or_kernel():
    """An unknown family or kernel name is a ValueError naming the expected ones."""
    with pytest.raises(ValueError, match="family: expected one of"):
        _loader.kernel_source("nope")
    with pytest.raises(ValueError, match="name: expected a kernel of 'compact'"):
        _loader.get_function("compact", "hc_nope", 0)


def test_import_compiles_nothing():
    """Importing hcache and hcache.ops compiles no module and does not import CuPy."""
    import subprocess
    import sys

    code = ("import hcache, hcache.ops, hcache.ops._loader as k, sys;"
            "print(k._module.cache_info().currsize, 'cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["0", "False"]


def test_kernel_source_changes_when_an_included_header_changes(monkeypatch, tmp_path):
    """The source the loader hands CuPy changes when common.cuh changes (CuPy keys its
    on-disk cache by the source text, not by the headers it includes)."""
    # CuPy keys its on-disk kernel cache by the source text and options, not by the headers
    # the source includes: the text must change with common.cuh, or an edited or upgraded
    # common.cuh would load a stale cubin.
    for p in _loader.kernel_dir().iterdir():
        (tmp_path / p.name).write_text(p.read_text())
    monkeypatch.setattr(_loader, "kernel_dir", lambda: tmp_path)
    before = _loader.kernel_source("slot_copy")[1]
    header = tmp_path / "common.cuh"
    header.write_text(header.read_text() + "\n// changed\n")
    after = _loader.kernel_source("slot_copy")[1]
    assert before != after
    assert after.startswith(f'#line 1 "{tmp_path / "slot_copy.cu"}"\n')


def test_plan_format_constants_match_compact_cu():
    """The compaction plan's constants in hcache/ops/tables.py equal the #defines of
    kernels/compact.cu (the kernels and the reference read the same words)."""
    from hcache.ops import tables

    _, source = _loader.kernel_source("compact")
    defines = dict(re.findall(r"#define (HC_\w+) \(?(-?\d+)\)?", source))
    assert int(defines["HC_PLAN_HEADER"]) == tables.PLAN_HEADER
    assert int(defines["HC_TMP"]) == tables.TMP
    assert int(defines["HC_CLEAR"]) == tables.CLEAR


# --- one name per op, from the .cu to the benchmark (docs/design.md §9) ------------------------

def _ops_of(family):
    """The ops a family's kernels name: kernel ``hc_<op>`` -> ``<op>``."""
    names = _loader.FAMILIES[family]
    assert all(n.startswith("hc_") for n in names), names
    return [n[len("hc_"):] for n in names]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_has_kernel_ops_reference_and_tests_under_one_name(family):
    """For family F: ``kernels/F.cu`` exists; ``hcache.ops.F`` exports every op its
    kernels name (``hc_<op>`` -> ``<op>``), each re-exported by ``hcache.ops``; every op of
    ``hcache.ops.F`` has a function of the same name in ``hcache.ops.reference`` whose
    parameters (names, kinds, defaults) are the wrapper's minus the launch-only ``stream`` and
    ``backend``, which end every wrapper keyword-only; ``tests/test_op_F.py`` exists."""
    assert (_loader.kernel_dir() / f"{family}.cu").is_file()
    module = importlib.import_module(f"hcache.ops.{family}")
    exported = list(module.__all__)
    for op in _ops_of(family):
        assert op in exported, f"hcache.ops.{family} does not export {op}"
    for op in exported:
        wrapper = getattr(module, op)
        assert getattr(ops, op) is wrapper, f"hcache.ops.{op} is not hcache.ops.{family}.{op}"
        params = list(inspect.signature(wrapper).parameters.values())
        launch = params[-len(LAUNCH_ONLY):]
        assert [(p.name, p.kind, p.default) for p in launch] == \
            [(n, inspect.Parameter.KEYWORD_ONLY, None) for n in LAUNCH_ONLY], op
        assert hasattr(ref, op) and op in ref.__all__, f"hcache.ops.reference lacks {op}"
        want = [(p.name, p.kind, p.default) for p in params[:-len(LAUNCH_ONLY)]]
        got = [(p.name, p.kind, p.default)
               for p in inspect.signature(getattr(ref, op)).parameters.values()]
        assert got == want, f"reference.{op}{got} differs from ops.{family}.{op}{want}"
    assert (TESTS / f"test_op_{family}.py").is_file()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_has_a_benchmark(family):
    """For family F, module ``hcache.bench.F`` exists (the benchmark of F's ops)."""
    importlib.import_module(f"hcache.bench.{family}")
