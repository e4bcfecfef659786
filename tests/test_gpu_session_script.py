"""``bench/gpu_session.sh``, the one command run on a lent GPU (issue 10, defect 2), executed here
with stand-ins for ``python3``, ``nvidia-smi`` and ``compute-sanitizer`` that log how they were
called: memcheck runs with CuPy's pool off (an overrun inside a pooled block is invisible to it),
initcheck runs too, racecheck (shared memory only; no kernel uses any) does not, every stage has
a time limit, and a sanitizer off ``PATH`` is found."""

from __future__ import annotations

import glob
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_session.sh"
LOGGER = """#!/usr/bin/env bash
echo "$(basename "$0") pool=${HCACHE_CUPY_POOL:-on} timeout=${HCACHE_TIMEOUT_SEEN:-?} $*" \
    >> "$CALLS"
"""


def _stub(folder: Path, name: str) -> None:
    path = folder / name
    path.write_text(LOGGER)
    path.chmod(0o755)


def _run(tmp_path, sanitizer_on_path: bool) -> list[str]:
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    for name in ("python3", "nvidia-smi"):
        _stub(bin_dir, name)
    if sanitizer_on_path:
        _stub(bin_dir, "compute-sanitizer")
    # `timeout` is the real one: wrap it to record that a stage ran under it.
    real_timeout = shutil.which("timeout")
    (bin_dir / "timeout").write_text(
        f'#!/usr/bin/env bash\nHCACHE_TIMEOUT_SEEN="$1" exec {real_timeout} "$@"\n')
    (bin_dir / "timeout").chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out), "CALLS": str(calls),
           "HOME": str(tmp_path)}
    subprocess.run(["bash", str(SCRIPT)], env=env, cwd=SCRIPT.parents[1], check=True,
                   capture_output=True, timeout=60)
    return calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_sanitizers_run_memcheck_unpooled_and_initcheck_under_time_limits(tmp_path):
    calls = _run(tmp_path, sanitizer_on_path=True)
    sanitizer = [c for c in calls if c.startswith("compute-sanitizer")]
    tools = [c.split("--tool ", 1)[1].split()[0] for c in sanitizer]
    assert tools == ["memcheck", "initcheck"]
    assert all(" pool=0 " in c for c in sanitizer)           # CuPy's pool off under both
    assert all("timeout=?" not in c for c in sanitizer)      # each under `timeout`
    assert all("--error-exitcode" in c for c in sanitizer)
    python = [c for c in calls if c.startswith("python3")]
    assert any("-m pytest -m gpu" in c for c in python)      # the gpu tier
    assert any("-m hcache bench --out" in c for c in python)
    assert any("-m hcache bench --host" in c for c in python)
    assert python and all("timeout=?" not in c for c in python)


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_without_a_sanitizer_the_session_still_runs_and_says_so(tmp_path):
    calls = _run(tmp_path, sanitizer_on_path=False)
    assert not any(c.startswith("compute-sanitizer") for c in calls)
    assert any("-m pytest -m gpu" in c for c in calls)
    # Off PATH, the script looks where CUDA installs put it.
    installed = [p for pattern in ("/usr/local/cuda*/bin/compute-sanitizer",
                                   "/opt/nvidia/*/compute-sanitizer",
                                   "/usr/local/cuda*/compute-sanitizer/compute-sanitizer")
                 for p in glob.glob(pattern)]
    log = (tmp_path / "out" / "sanitizer_memcheck.txt").read_text()
    if installed:
        assert "compute-sanitizer not found" not in log
    else:
        assert log.strip() == "compute-sanitizer not found"
