"""Kernel microbenchmarks (docs/design.md §8), run by ``python -m hcache bench``.

One module per kernel family, named like its ``.cu`` file (:mod:`.kv_write`, :mod:`.compact`,
:mod:`.slot_copy`, :mod:`.kv_capture`, :mod:`.lengths`,
:mod:`.draft_accept`); the rows they report carry that name as
``family``. Each case is timed on realistic shapes: a Nemotron-H-like hybrid and a Gemma-like
heterogeneous model, at decode and prefill sizes. On a GPU a case is the median of many runs
after warm-up, timed with CUDA events, and reported as µs, effective GB/s (bytes that must move,
read + written), the ratio to a plain device-to-device copy of the same bytes measured in the
same run, and the speed-up over the obvious CuPy alternative (a per-layer loop of fancy-indexed
copies). On the CPU the same cases run, scaled down, on the NumPy reference path, and the report
says so.

:func:`main` (:mod:`.runner`) takes the list of benchmark modules to run
(:data:`BENCHES` by default: :data:`KERNEL_BENCHES`, one per kernel family, then
:mod:`.transfer`, a NIXL pull between two engines, when NIXL is installed); the shared
timer, shapes and baseline are in :mod:`._common`, the table, JSON and PNG output in
:mod:`._report`.
"""

from .runner import BENCHES, KERNEL_BENCHES, main

__all__ = ["BENCHES", "KERNEL_BENCHES", "main"]
