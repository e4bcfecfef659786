"""The built wheel ships ``kernels/*.cu``/``*.cuh`` inside the package, and a non-editable
install finds and compiles them from site-packages, not from the checkout; ``python -m hcache
bench`` runs from such an install in a fresh venv."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hcache.ops import _loader

ROOT = Path(__file__).resolve().parent.parent
_SKIP = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
                               ".venv", ".pytest_cache", ".ruff_cache", ".benchmarks")


def _not_for_the_wheel(folder, names):
    """Build outputs and caches anywhere, and the checkout's ``bench/`` folder (committed
    results); ``hcache/bench`` is package code and stays."""
    skip = set(_SKIP(folder, names))
    if Path(folder).resolve() == ROOT and "bench" in names:
        skip.add("bench")
    return skip


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src") / "hcache"  # a clean copy: no stale build/ folder
    shutil.copytree(ROOT, src, ignore=_not_for_the_wheel)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), str(src)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.fail(f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}")
    (path,) = out.glob("hcache-*.whl")
    return path


def test_wheel_contains_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "kernels").iterdir()
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
    assert _loader.kernel_dir() != Path(out[0])


def test_bench_runs_from_the_wheel_in_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    # numpy, ml_dtypes and pip come from the system site (no network); --without-pip saves
    # the ensurepip run.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(venv)], check=True, capture_output=True)
    if sys.prefix != sys.base_prefix:
        # Tests running in a venv: --system-site-packages sees the base interpreter's site, not
        # this one; list this one as plain paths (its .pth files, e.g. an editable hcache's
        # finder, do not run).
        (next(venv.glob("lib*/python*/site-packages")) / "outer_site.pth").write_text(
            "\n".join(site.getsitepackages()) + "\n")
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    work = tmp_path / "elsewhere"  # outside the checkout: nothing of it on sys.path
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "HCACHE_DEVICE")}

    def run(*args):
        proc = subprocess.run([str(a) for a in args], cwd=work, env=env, capture_output=True,
                              text=True)
        assert proc.returncode == 0, f"{args}:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    run(python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
        wheel)
    where = run(python, "-c", "import hcache.bench; print(hcache.__file__)").strip()
    assert Path(where).is_relative_to(venv), f"imported {where}, not the wheel's hcache"
    for cli in ((python, "-m", "hcache"), (bindir / "hcache",)):
        text = run(*cli, "bench", "--help")
        assert all(opt in text for opt in ("--device", "--out", "--quick"))
    out = tmp_path / "results"
    text = run(python, "-m", "hcache", "bench", "--device", "cpu", "--quick", "--out", out)
    assert "NumPy reference path" in text
    (path,) = out.glob("*.json")
    rows = json.loads(path.read_text())["rows"]
    families = {p.stem for p in (ROOT / "kernels").glob("*.cu")}
    assert {r["family"] for r in rows} - {"transfer"} == families   # transfer: with NIXL
    assert all(r["us"] > 0 and r["launches"] >= 1 for r in rows)
    assert not (work / "bench").exists()


def test_a_checkout_loads_the_top_level_kernel_folder():
    """Issue 21 item 10: the sources live in the repository's ``kernels/`` (the design card's
    place); a checkout or an editable install reads them there, a wheel from the package."""
    assert _loader.kernel_dir() == ROOT / "kernels"
    assert not (ROOT / "hcache" / "kernels").exists()
    assert {p.stem for p in (ROOT / "kernels").glob("*.cu")} == set(_loader.FAMILIES)
