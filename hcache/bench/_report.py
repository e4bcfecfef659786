"""Bench output: the printed table, the JSON report and the PNG plot (when matplotlib is
present)."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

__all__ = ["print_table", "write_report"]


def print_table(rows: list[dict]) -> None:
    print(f"{'family':<11} {'model':<16} {'case':<24} {'us':>10} {'GB/s':>9} {'xcopy':>7} "
          f"{'xnaive':>7} launches")
    for r in rows:
        print(f"{r['family']:<11} {r['model']:<16} {r['case']:<24} {r['us']:>10.1f} "
              f"{r['GBps'] or 0:>9.1f} {r['vs_copy'] or 0:>7.2f} "
              f"{r['speedup_vs_naive'] or 0:>7.2f} {r['launches']}")


def write_report(out: Path, report: dict) -> list[Path]:
    """Write ``<out>/<date>_<device>.json`` (and ``.png``); return the paths written.

    ``report`` holds ``device`` (a name), ``rows`` and whatever else describes the run.
    """
    out.mkdir(parents=True, exist_ok=True)
    device = "".join(c if c.isalnum() else "-" for c in report["device"])
    stem = f"{_dt.date.today().isoformat()}_{device}"
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
    ax.bar(range(len(rows)), [r["GBps"] or 0 for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("effective GB/s (read + written)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
