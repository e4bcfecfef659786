"""``python -m hcache bench`` runs on the CPU (reference path, and says so) and writes JSON; the
bench package has one module per kernel family, named like its ``.cu`` file."""

from __future__ import annotations

import json

import pytest

from hcache.__main__ import main
from hcache.bench import KERNEL_BENCHES
from hcache.bench import main as bench_main
from hcache.bench._common import BenchContext, significant
from hcache.ops import _loader
from hcache.transfer import nixl_available

KERNEL_FAMILIES = {p.stem for p in _loader.kernel_dir().glob("*.cu")}


def test_one_bench_module_per_kernel_family():
    assert KERNEL_FAMILIES == {"kv_write", "compact", "slot_copy", "kv_capture", "lengths",
                               "draft_accept"}
    assert {b.FAMILY for b in KERNEL_BENCHES} == KERNEL_FAMILIES
    for bench in KERNEL_BENCHES:
        assert bench.__name__ == f"hcache.bench.{bench.FAMILY}"


def test_bench_on_cpu_writes_every_family(tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    report = json.loads(path.read_text())
    assert "reference" in report["note"] and report["backend"] == "cpu"
    transfer = {"transfer"} if nixl_available() else set()     # CI installs NIXL
    assert {r["family"] for r in report["rows"]} == KERNEL_FAMILIES | transfer
    models = {r["model"] for r in report["rows"] if r["family"] not in ("lengths", "transfer")}
    assert models == {"nemotron-h-like", "gemma-like", "deepseek-v3-like"}
    assert any("fp8" in r["case"] for r in report["rows"] if r["family"] == "kv_write")
    for r in report["rows"]:
        assert r["us"] > 0 and r["bytes"] >= 0 and r["launches"] >= 1
        # ratios keep 3 significant digits: the CPU reference of an FP8 decode write is so much
        # slower than a copy that a fixed 2 or 3 decimals used to round its ratio to 0
        assert r["vs_copy"] > 0 and r["speedup_vs_naive"] > 0
        assert significant(r["vs_copy"]) == r["vs_copy"]
        # kernel time apart from host time (issue 22): no device on the CPU, so no kernel time
        # and no ratio to a device copy; the call's wall time and a copy of its bytes measured
        assert r["kernel_us"] is None and r["kernel_vs_memcpy"] is None
        assert r["host_us"] > 0 and r["memcpy_us"] > 0
    out = capsys.readouterr().out
    assert "NumPy reference path" in out and str(path) in out


def test_bench_default_out_is_bench_results_under_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bench_main("cpu", quick=True, benches=KERNEL_BENCHES[-1:]) == 0
    (path,) = (tmp_path / "bench" / "results").glob("*.json")
    assert {r["family"] for r in json.loads(path.read_text())["rows"]} == {"lengths"}


def test_runner_takes_any_list_of_bench_modules(tmp_path):
    class Host:  # a stand-in for a host-overhead benchmark module
        FAMILY = "host"

        @staticmethod
        def run(ctx: BenchContext) -> list[dict]:
            return [ctx.measure("any", "noop", lambda: None, 0, None, 1)]

    assert bench_main("cpu", tmp_path, quick=True, benches=[Host]) == 0
    (path,) = tmp_path.glob("*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["family"] == "host" and row["speedup_vs_naive"] is None


def test_bench_help_documents_the_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--device", "--out", "--quick", "bench/results"):
        assert option in out


def test_info_reports_every_kernel_family(capsys):
    assert main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for family in KERNEL_FAMILIES:
        assert family in out
    assert "bfloat16" in out and "device      cpu" in out


def test_host_bench_on_cpu_reports_every_case(tmp_path, capsys):
    """``bench --host``: one row per host-overhead case, each a per-step table's median, mean and
    worst step (so median and mean never pass the worst), written as JSON that loads."""
    assert main(["bench", "--host", "--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    rows = json.loads(path.read_text())["rows"]
    cases = [r["case"] for r in rows]
    assert {"hybrid commit(1) 52 layers", "continuous fetch+step", "context add_request",
            "cpu kv_write decode b64", "context verify b256 k4"} <= set(cases)
    (verify,) = [r for r in rows if r["case"] == "context verify b256 k4"]
    assert verify["extend_commit_us"] > 0 and verify["vs_extend_commit"] > 0
    assert sum(c.startswith("context decode") for c in cases) == 5
    assert {"serving decode block16 pool x1", "serving decode block256 pool x1"} <= set(cases)
    for r in rows:
        if r["case"].startswith("serving "):
            assert r["python_calls"] > 0
    for r in rows:
        assert r["family"] == "host" and 0 < r["us"] <= r["worst_us"]
        assert min(r["us"], r["mean_us"]) <= r["worst_us"]
    assert "median us" in capsys.readouterr().out


def test_ratios_keep_significant_digits_however_small():
    assert significant(0.000123456) == 0.000123
    assert significant(12345.6) == 12300.0
    assert significant(2 / 3) == 0.667


def test_kernel_and_host_reports_of_one_day_do_not_overwrite_each_other(tmp_path):
    """Issue 21 item 11: ``--quick`` and ``--host`` into one folder leave two reports, each
    named by what it holds."""
    lengths_only = KERNEL_BENCHES[-1:]
    assert bench_main("cpu", tmp_path, quick=True, benches=lengths_only) == 0
    assert bench_main("cpu", tmp_path, quick=False, benches=lengths_only) == 0
    assert bench_main("cpu", tmp_path, quick=True, benches=lengths_only, kind="host") == 0
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert len(names) == 3
    assert [n.split("_", 2)[2] for n in names] == ["host_quick.json", "kernels.json",
                                                   "kernels_quick.json"]
    for name in names:
        report = json.loads((tmp_path / name).read_text())
        assert name.endswith(f"_{report['kind']}{'_quick' if report['quick'] else ''}.json")


def test_calls_report_is_named_by_what_it_holds(tmp_path):
    """``bench --calls`` (issue 23) writes ``*_calls[_quick].json``, not over the kernel
    report of the same day (issue 21 item 11)."""
    assert main(["bench", "--calls", "--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    report = json.loads(path.read_text())
    assert path.name.endswith("_calls_quick.json") and report["kind"] == "calls"
    assert any(r["case"] == "context add_request" for r in report["rows"])


def test_serving_rows_count_the_same_python_calls_in_every_run():
    """The serving rows' ``python_calls`` (a decode step's, an admission's, a release's) do not
    depend on the machine: two fresh runs of the same seeded workload count the same, and a
    decode step makes more calls at block 16 (its blocks complete 16 times as often)."""
    from hcache.bench import host_serving

    class Ctx:
        device, quick = "cpu", True

    def calls(block):
        rows = host_serving._serving(Ctx, 1, block, 1, warm_steps=30, timed_steps=10)
        return {r["case"]: r["python_calls"] for r in rows}

    first = calls(256)
    assert first == calls(256)
    assert calls(16)["serving decode block16 pool x1"] > first["serving decode block256 pool x1"]
