"""Bench output: the printed table, the JSON report and the PNG plot (when matplotlib is
present)."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

__all__ = ["print_table", "write_report"]


def print_table(rows: list[dict]) -> None:
    if rows and all("calls_per_launch" in r for r in rows):
        return print_calls(rows)
    kernel_rows = [r for r in rows if "GBps" in r]
    host_rows = [r for r in rows if "worst_us" in r]
    if kernel_rows:
        print(f"{'family':<11} {'model':<16} {'case':<24} {'us':>10} {'kernel':>9} "
              f"{'host':>8} {'memcpy':>8} {'xmemcpy':>7} {'GB/s':>9} {'xcopy':>7} "
              f"{'xnaive':>7} launches")
    failed = []
    for r in kernel_rows:
        kernel = r.get("kernel_us")
        ratio = r.get("kernel_vs_memcpy")
        timing = r.get("kernel_timing")
        mark = "" if timing in (None, "graph") else "*"   # not a graph replay: host gaps count
        if mark:
            failed.append(f"{r['family']} {r['model']} {r['case']}: {timing}")
        print(f"{r['family']:<11} {r['model']:<16} {r['case']:<24} {r['us']:>10.1f} "
              f"{'-' if kernel is None else f'{kernel:.1f}{mark}':>9} "
              f"{r.get('host_us') or 0:>8.1f} {r.get('memcpy_us') or 0:>8.1f} "
              f"{'-' if ratio is None else f'{ratio:.3g}':>7} "
              f"{r['GBps'] or 0:>9.1f} {r['vs_copy'] or 0:>7.3g} "
              f"{r['speedup_vs_naive'] or 0:>7.3g} {r['launches']}")
    for line in failed:
        print(f"* kernel timed over back-to-back calls, {line}")
    if host_rows:
        print(f"{'case':<30} {'median us':>10} {'mean us':>9} {'worst us':>9} {'goal us':>8}  "
              "other")
    for r in host_rows:
        other = {k: v for k, v in r.items() if k not in ("family", "model", "case", "us",
                                                           "mean_us", "worst_us", "goal_us")}
        goal = "-" if r["goal_us"] is None else f"{r['goal_us']:.1f}"
        print(f"{r['case']:<30} {r['us']:>10.2f} {r['mean_us']:>9.2f} {r['worst_us']:>9.2f} "
              f"{goal:>8}  {other}")


def print_calls(rows: list[dict]) -> None:
    """The rows of ``bench --calls``: hcache Python calls per launch, host µs per call."""
    print(f"{'case':<46} {'calls/launch':>12} {'launches':>8} {'goal':>5} {'us':>9}  where")
    for r in rows:
        us = r.get("us", r.get("emulated_us"))
        where = r["counted_on"] + ("" if "us" in r or us is None else
                                   " (us: the emulator's cost included)")
        print(f"{r['case']:<46} {r['calls_per_launch']:>12.1f} {r['launches']:>8} "
              f"{r['goal_calls']:>5} {'-' if us is None else f'{us:.1f}':>9}  {where}")


def write_report(out: Path, report: dict) -> list[Path]:
    """Write ``<out>/<date>_<device>_<kind>[_quick].json`` (and ``.png``); return the paths
    written.

    ``report`` holds ``device`` (a name), ``kind`` (what the rows measure), ``quick``, ``rows``
    and whatever else describes the run.
    """
    out.mkdir(parents=True, exist_ok=True)
    device = "".join(c if c.isalnum() else "-" for c in report["device"])
    stem = f"{_dt.date.today().isoformat()}_{device}_{report['kind']}"
    if report.get("quick"):
        stem += "_quick"
    path = out / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1))
    png = _plot(report["rows"], out / f"{stem}.png")
    return [path] + ([png] if png else [])


def _plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [f"{r['family']}\n{r['model']}\n{r['case']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    ax.bar(range(len(rows)), [r.get("GBps") or 0 for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("effective GB/s (read + written)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
