"""``python -m hcache`` (issue 12): ``--version``, a bad ``--device`` as one line on stderr
with a non-zero status (no traceback), and the test summary not buried under skip lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib

import hcache
from hcache.__main__ import main

ROOT = Path(__file__).resolve().parent.parent


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"hcache {hcache.__version__}\n"


@pytest.mark.parametrize("command", ["info", "demo", "bench"])
@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu:0"])
def test_a_bad_device_is_one_line_and_a_non_zero_status(capsys, command, device):
    assert main([command, "--device", device]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"python -m hcache {command}: error: --device: expected ")
    assert repr(device) in err


def test_a_bad_device_from_the_shell_prints_no_traceback():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "hcache", "info", "--device", "gpu"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert done.stdout == "" and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr


def test_skips_are_summarised_by_reason_not_listed():
    """``-ra`` listed every skipped location before the failures; the suite now shows
    failures and errors (``-rfE``) and one line per skip reason with its count."""
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["addopts"].split()
    assert "-ra" not in addopts and "-rfE" in addopts
    import conftest

    def skip(reason):
        return SimpleNamespace(longrepr=("tests/x.py", 1, f"Skipped: {reason}"))

    lines = []
    reporter = SimpleNamespace(
        stats={"skipped": [skip("no GPU")] * 3 + [skip("no JAX")]},
        section=lambda title, sep: lines.append(f"== {title}"),
        write_line=lines.append)
    conftest.pytest_terminal_summary(reporter)
    assert lines == ["== skipped tests by reason", "     3  no GPU", "     1  no JAX"]
