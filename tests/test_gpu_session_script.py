"""``bench/gpu_session.sh``, the one command run on a lent GPU, executed here with stand-ins for
``python3``, ``nvidia-smi`` and ``compute-sanitizer`` that log how they were called: one global
deadline over every stage (issue 21 item 4), each stage under ``timeout``, memcheck with CuPy's
pool off (an overrun inside a pooled block is invisible to it) and initcheck, the gpu tier with
pytest-xdist, the three benches (kernels, calls per launch, host), the sanitizers beside the
whole suite, at most 8 files, each written as its stage runs."""

from __future__ import annotations

import glob
import shutil
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_session.sh"
LOGGER = """#!/usr/bin/env bash
echo "$(basename "$0") pool=${HCACHE_CUPY_POOL:-on} timeout=${HCACHE_TIMEOUT_SEEN:-?} $*" \\
    >> "$CALLS"
echo "output of $(basename "$0") $*"
sleep "${STUB_SLEEP:-0}"
"""

pytestmark = pytest.mark.skipif(shutil.which("timeout") is None,
                                reason="needs coreutils timeout")


def _stub(folder: Path, name: str) -> None:
    path = folder / name
    path.write_text(LOGGER)
    path.chmod(0o755)


def _run(tmp_path, sanitizer_on_path=True, deadline=420, stub_sleep=0.0, only=""):
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
           "HOME": str(tmp_path), "DEADLINE_S": str(deadline), "STUB_SLEEP": str(stub_sleep),
           "ONLY": only}
    t0 = time.monotonic()
    subprocess.run(["bash", str(SCRIPT)], env=env, cwd=SCRIPT.parents[1], check=True,
                   capture_output=True, timeout=60)
    elapsed = time.monotonic() - t0
    return (calls.read_text().splitlines() if calls.exists() else []), out, elapsed


def test_every_stage_runs_under_a_time_limit_into_at_most_eight_files(tmp_path):
    calls, out, _ = _run(tmp_path)
    sanitizer = [c for c in calls if c.startswith("compute-sanitizer")]
    tools = [c.split("--tool ", 1)[1].split()[0] for c in sanitizer]
    assert tools == ["memcheck", "initcheck", "racecheck"]
    assert all(" pool=0 " in c for c in sanitizer[:2])       # CuPy's pool off under both
    assert "test_op_lengths.py" in sanitizer[2] and "test_op_compact.py" in sanitizer[2]
    assert all("--error-exitcode" in c for c in sanitizer)
    python = [c for c in calls if c.startswith("python3") and "import xdist" not in c]
    assert all("timeout=?" not in c for c in python + sanitizer)   # each under `timeout`
    assert any("-m pytest -m gpu" in c and "-n 8" in c for c in python)  # xdist
    assert any("-m hcache bench --quick --out" in c for c in python)
    assert any("-m hcache bench --calls --out" in c for c in python)
    assert any("-m hcache bench --host --quick" in c for c in python)
    assert any("bench/probe_decode.py" in c for c in python)        # ncu's decode probe
    suite = [c for c in python if "-m pytest" in c and "-m gpu" not in c]
    assert len(suite) == 1 and "-n 12" in suite[0]                  # the whole suite
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8
    assert {"gpu_tier.txt", "sanitizer.txt", "bench.txt", "suite.txt",
            "summary.txt"} <= set(files)
    # each stage's own output is in its log as it ran
    assert "-m pytest -m gpu" in (out / "gpu_tier.txt").read_text()
    assert "-m hcache info" in (out / "bench.txt").read_text()
    summary = (out / "summary.txt").read_text()
    assert "output of nvidia-smi" in summary
    for stage in ("info", "gpu_tier", "memcheck", "initcheck", "racecheck", "bench",
                  "bench_calls", "bench_host", "suite"):
        assert f"{stage}=0 " in summary


def test_one_global_deadline_cuts_the_stages_that_do_not_fit(tmp_path):
    """Each stand-in takes 1 s; with a 6 s deadline the session ends near 6 s, the stages
    past the deadline are reported as skipped, and what ran left its logs."""
    calls, out, elapsed = _run(tmp_path, deadline=6, stub_sleep=1)
    assert elapsed < 15                                     # not 10 calls x 1 s + budgets
    summary = (out / "summary.txt").read_text()
    assert "skipped(deadline)" in summary and "suite=skipped(deadline)" in summary
    assert "info=0" in summary
    assert "output of nvidia-smi" in summary


def test_without_a_sanitizer_the_session_still_runs_and_says_so(tmp_path):
    calls, out, _ = _run(tmp_path, sanitizer_on_path=False)
    assert not any(c.startswith("compute-sanitizer") for c in calls)
    assert any("-m pytest -m gpu" in c for c in calls)
    # Off PATH, the script looks where CUDA installs put it.
    installed = [p for pattern in ("/usr/local/cuda*/bin/compute-sanitizer",
                                   "/opt/nvidia/*/compute-sanitizer",
                                   "/usr/local/cuda*/compute-sanitizer/compute-sanitizer")
                 for p in glob.glob(pattern)]
    log = (out / "sanitizer.txt").read_text()
    if installed:
        assert "compute-sanitizer not found" not in log
    else:
        assert log.strip() == "compute-sanitizer not found"


def test_only_runs_the_stages_it_names(tmp_path):
    """A follow-up call (``ONLY``) runs the stages it names, in the session's order, and no
    sanitizer unless named."""
    calls, out, _ = _run(tmp_path, only="gpu_tier bench_host")
    assert not any(c.startswith("compute-sanitizer") for c in calls)
    python = [c for c in calls if c.startswith("python3") and "import xdist" not in c]
    assert len(python) == 2
    assert "-m pytest -m gpu" in python[0] and "-m hcache bench --host" in python[1]
    summary = (out / "summary.txt").read_text()
    assert "gpu_tier=0 " in summary and "bench_host=0 " in summary and "suite=" not in summary
