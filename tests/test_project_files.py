"""The files a new user reads first (issue 25, item 6): the README opens with what hcache and
the engine each do and says which manager fits which engine near the top; the measured numbers
name their device; LICENSE is the license setup.cfg declares; CHANGELOG.md covers this
version; bench/NOTES.md no longer says no GPU ran the kernels. (The README's examples run in
tests/test_readme.py.)"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import hcache

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_both_halves_and_the_manager_table():
    head = README[:README.index("## Set-up")]
    assert "**What hcache does.**" in head and "**What your engine does.**" in head
    assert "### Which manager for which engine" in head
    # continuous batching: the K/V-only seed manager and the one that holds states (issue 26)
    for name in ("HybridCacheManager", "ContinuousBatchingKVCacheManager",
                 "ContinuousBatchingHybridCacheManager",
                 "DynamicInferenceContext", "PagedKVPool", "hcache.interop.jax"):
        assert name in head, name
    assert "### The cache layouts" in head and "```text" in head
    assert "### Compatibility" in head


def test_measured_numbers_name_their_device():
    measured = README[README.index("### Measured"):README.index("### Compatibility")]
    assert "NVIDIA H200" in measured and "CPU" in measured
    assert re.search(r"\| `kv_write`.*\| \d+(\.\d+)? µs \|", measured)


def test_license_is_the_declared_one_and_the_changelog_covers_this_version():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert "Version 2.0" in (ROOT / "LICENSE").read_text()[:200]
    assert f"## {hcache.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_bench_notes_record_the_gpu_run():
    notes = (ROOT / "bench" / "NOTES.md").read_text()
    assert "No GPU has been lent" not in notes and "H200" in notes
