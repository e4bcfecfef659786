"""The built wheel ships ``kernels/*.cu``/``*.cuh`` inside the package, and a non-editable
install finds and compiles them from site-packages, not from the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hcache.ops import _loader as _kernels

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src") / "hcache"  # a clean copy: no stale build/ folder
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", "bench"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), str(src)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.fail(f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}")
    (path,) = out.glob("hcache-*.whl")
    return path


def test_wheel_contains_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "hcache" / "kernels").iterdir()
                     if p.suffix in (".cu", ".cuh"))
    assert sources, "no kernel sources in the checkout"
    for name in sources:
        assert f"hcache/kernels/{name}" in names
    assert not any("tests/" in n for n in names)
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "hcache").rglob("*.py")
                     if "__pycache__" not in p.parts)
    missing = [m for m in modules if m not in names]
    assert not missing, f"modules left out of the wheel (setup.cfg packages): {missing}"


def test_non_editable_install_loads_kernels_from_the_package(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    code = (
        "import numpy as np, hcache, hcache.ops._loader as k, hcache.ops._nvrtc as n;"
        "from hcache import ops; from hcache.ops.tables import KVGroup;"
        "print(k.kernel_dir());"
        "print(n.compile_family('compact', 'sm_90') > 0 if n.find_libnvrtc() else True);"
        "c = np.zeros((1, 2, 1, 2, 4), np.float16);"
        "ops.kv_write(KVGroup([c]), np.ones((1, 1, 4), np.float16), np.ones((1, 1, 4),"
        " np.float16), layers=0, uniform_tokens=1);"
        "print(float(c.sum()))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout.split("\n")
    assert Path(out[0]).is_relative_to(target)
    assert out[1] == "True"
    assert out[2] == "8.0"
    assert _kernels.kernel_dir() != Path(out[0])
