"""``python -m hcache bench`` runs on the CPU (reference path, and says so) and writes JSON."""

from __future__ import annotations

import json

from hcache.__main__ import main


def test_bench_on_cpu_writes_every_family(tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    report = json.loads(path.read_text())
    assert "reference" in report["note"]
    families = {r["family"] for r in report["rows"]}
    assert families == {"kv_write", "compaction", "slot_copy", "kv_capture"}
    for r in report["rows"]:
        assert r["us"] > 0 and r["bytes"] >= 0 and r["launches"] >= 1
    assert "NumPy reference path" in capsys.readouterr().out


def test_info_reports_every_kernel_family(capsys):
    assert main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for family in ("kv_write", "compact", "slot_copy", "kv_capture", "lengths"):
        assert family in out
    assert "bfloat16" in out and "device      cpu" in out
