"""The bench runner behind ``python -m hcache bench`` (docs/design.md §7, §8)."""

from __future__ import annotations

import platform
from pathlib import Path

from hcache.runtime import _cuda
from hcache.runtime.device import Device, resolve_device

from . import compact, draft_accept, kv_capture, kv_write, lengths, slot_copy, transfer
from ._common import BenchContext, Timer
from ._report import print_table, write_report

__all__ = ["KERNEL_BENCHES", "BENCHES", "main"]

# One module per kernel family, named like its .cu file; each has FAMILY and run(ctx).
KERNEL_BENCHES = (kv_write, compact, slot_copy, kv_capture, draft_accept, lengths)
# What ``python -m hcache bench`` runs: the kernel families, then the NIXL transfer (no rows
# without NIXL).
BENCHES = KERNEL_BENCHES + (transfer,)

CPU_SCALE = 16  # shapes are divided by this on the CPU


def main(device=None, out_dir=None, quick: bool = False, benches=BENCHES,
         kind: str = "kernels") -> int:
    """Run ``benches`` on ``device``, print a table and write the report to ``out_dir``
    (default ``bench/results`` under the current directory) as
    ``<date>_<device>_<kind>[_quick].json``. Returns the exit status (0).

    Parameters
    ----------
    device : None, "cpu", "cuda", "cuda:N" or Device
        As :func:`hcache.device.resolve_device`. On the CPU the NumPy reference path runs,
        shapes scaled down by ``CPU_SCALE``, and the report says so.
    out_dir : str or Path, optional
    quick : bool
        Fewer repetitions (20 instead of 200 on a GPU, 2 instead of 5 on the CPU).
    benches : sequence of modules
        Each with ``FAMILY`` (the rows' ``family``) and ``run(ctx) -> list[dict]``.
    kind : str
        What the report holds (``"kernels"``, ``"host"``): part of its file name, so the
        reports of one day and device do not overwrite each other.
    """
    dev = resolve_device(device)
    if dev.is_cuda:
        repeat, warmup, scale = (20 if quick else 200), 5, 1
    else:
        repeat, warmup, scale = (2 if quick else 5), 1, CPU_SCALE
    ctx = BenchContext(dev, Timer(dev.xp, repeat, warmup), scale, quick)
    rows: list[dict] = []
    with dev.scope():
        for bench in benches:
            rows.extend({"family": bench.FAMILY, **row} for row in bench.run(ctx))
    name, note = _describe(dev)
    if len(benches) == 1 and hasattr(benches[0], "describe"):
        note = benches[0].describe(dev)
    print(f"hcache bench on {name} ({dev}): {note}")
    print_table(rows)
    out = Path(out_dir) if out_dir else Path.cwd() / "bench" / "results"
    paths = write_report(out, {"device": name, "backend": str(dev), "note": note,
                               "kind": kind, "quick": quick, "repeat": repeat, "rows": rows})
    print("wrote " + " and ".join(map(str, paths)))
    return 0


def _describe(dev: Device) -> tuple[str, str]:
    """The device's name and what the numbers mean."""
    if not dev.is_cuda:
        return (platform.processor() or "cpu",
                f"CPU: NumPy reference path (the cpu backend), shapes scaled down "
                f"{CPU_SCALE}x; not kernel speed")
    return _cuda.runtime().device_name(dev.index), "CUDA kernels, CUDA-event medians"
