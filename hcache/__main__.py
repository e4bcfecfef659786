"""``python -m hcache {info,demo,bench}`` (docs/design.md §7)."""

from __future__ import annotations

import argparse
import platform
import sys

DESCRIPTION = ("hcache: inference caches (KV, Mamba / recurrent states) of hybrid and\n"
               "attention models, for engines that do not use torch.")
EPILOG = """commands:
  python -m hcache info                       versions, device, dtypes, kernel compile check
  python -m hcache info --config config.json  a model's cache layout and bytes
  python -m hcache demo                       a small hybrid model served by hcache
  python -m hcache bench [--host]             kernel or host-overhead benchmarks
run 'python -m hcache <command> --help' for a command's options."""


def layout(args) -> int:
    """Print the cache layout of a ``config.json`` and its bytes per token and per sequence;
    exit status 2 (and the reason, one line on stderr) for a bad option or a config hcache
    cannot lay out."""
    import json

    from hcache._checks import as_int
    from hcache.config import HybridCacheConfig
    from hcache.config.report import layout_report
    from hcache.dtypes import resolve_dtype

    try:   # the options first, each named as typed
        as_int("--seq-len", args.seq_len, 1)
        for option in ("kv_dtype", "ssm_dtype", "conv_dtype"):
            if getattr(args, option) is not None:
                resolve_dtype(getattr(args, option), "--" + option.replace("_", "-"))
    except (TypeError, ValueError) as exc:
        print(f"python -m hcache info: error: {exc}", file=sys.stderr)
        return 2
    try:
        with open(args.config, encoding="utf-8") as f:
            raw = json.load(f)
        config = HybridCacheConfig.from_hf_config(
            raw, max_batch_size=1, max_sequence_length=args.seq_len, kv_dtype=args.kv_dtype,
            ssm_dtype=args.ssm_dtype, conv_dtype=args.conv_dtype,
            ring_windows=not args.no_ring_windows)
    except (OSError, ValueError, TypeError) as exc:   # json.JSONDecodeError is a ValueError
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 2
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    print(f"config      {args.config}")
    for line in layout_report(config, text.get("model_type", raw.get("model_type"))):
        print(line)
    return 0


def info(args) -> int:
    """Print versions, the default device, dtype support and whether each kernel compiles;
    with ``--config``, the cache layout of a model instead (:func:`layout`)."""
    if args.config is not None:
        return layout(args)
    import ml_dtypes
    import numpy as np

    import hcache
    from hcache.dtypes import DTYPE_NAMES, resolve_dtype, storage_dtype
    from hcache.ops import _loader, _nvrtc
    from hcache.ops._compile_cache import cache_dir, checked_compile
    from hcache.runtime import _cuda
    from hcache.runtime.device import cupy_available, resolve_device

    print(f"hcache      {hcache.__version__}")
    print(f"python      {platform.python_version()} ({sys.platform})")
    print(f"numpy       {np.__version__}")
    print(f"ml_dtypes   {ml_dtypes.__version__}")
    rt = _cuda.runtime()
    if rt is not None:
        print(f"cupy        {rt.version} (GPU usable: {cupy_available()})")
    else:
        print("cupy        not importable")
    version = _nvrtc.nvrtc_version()
    print(f"nvrtc       {'.'.join(map(str, version)) if version else 'not found'}")
    device = resolve_device(args.device)
    print(f"device      {device} (arrays: {device.xp.__name__})")
    print(f"kernels     {_loader.kernel_dir()}")
    print("dtypes:")
    for name in DTYPE_NAMES:
        dt = resolve_dtype(name)
        stored = storage_dtype(name, device.xp) if device.is_cuda else dt
        note = "" if stored == dt else f" (stored as {stored})"
        print(f"  {name:<14} itemsize {dt.itemsize}{note}")
    print(f"kernels compile (NVRTC, sm_80 / sm_90; results cached in {cache_dir()}"
          f"{', off' if args.no_cache else ''}):")
    ok = True
    for family in _loader.FAMILIES:
        results = []
        for arch in ("sm_80", "sm_90"):
            try:
                _, cached = checked_compile(family, arch, use_cache=not args.no_cache)
                results.append("ok (cached)" if cached else "ok")
            except Exception as exc:  # noqa: BLE001 - report, don't crash
                results.append(f"FAILED: {str(exc).splitlines()[0]}")
                ok = ok and version is None
        print(f"  {family:<11} {' / '.join(results)}")
        if results[-1] == "ok":
            regs = _nvrtc.kernel_registers(family, "sm_90")
            print("              registers/thread (sm_90): "
                  + ", ".join(f"{name} {n}" for name, n in regs.items()))
    if device.is_cuda:
        for family, names in _loader.FAMILIES.items():
            for name in names:
                _loader.get_function(family, name, device.index)
        print(f"  RawModule   all families loaded on {device}")
    return 0 if ok else 1


def demo(args) -> int:
    if args.speculative:
        from hcache.demo.speculative import run_speculative_demo

        return run_speculative_demo(device=args.device)
    from hcache.demo.run import run_demo

    return run_demo(device=args.device)


def bench(args) -> int:
    from hcache.bench import main as bench_main

    if args.calls:
        from hcache.bench import calls

        return bench_main(device=args.device, out_dir=args.out, quick=args.quick,
                          benches=(calls,), kind="calls")
    if args.host:
        from hcache.bench import host

        return bench_main(device=args.device, out_dir=args.out, quick=args.quick,
                          benches=(host,), kind="host")
    return bench_main(device=args.device, out_dir=args.out, quick=args.quick)


def main(argv=None) -> int:
    """Run one command; returns the exit status (2 for a bad ``--device``, printed as one
    line on stderr, no traceback)."""
    from hcache import __version__
    from hcache.runtime.device import resolve_device

    parser = argparse.ArgumentParser(prog="python -m hcache", description=DESCRIPTION,
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, text in (("info", info, "versions, device, dtypes, kernel compilation"),
                           ("demo", demo, "serve a small hybrid model with every cache"),
                           ("bench", bench, "kernel microbenchmarks")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: auto)")
        p.set_defaults(fn=fn)
        if name == "demo":
            p.add_argument("--speculative", action="store_true",
                           help="speculative decoding: a draft model proposes tokens, "
                                "commit_draft keeps the accepted ones")
        if name == "info":
            p.add_argument("--no-cache", action="store_true",
                           help="compile every kernel again (ignore and do not store cached "
                                "compile results)")
            p.add_argument("--config", default=None, metavar="PATH",
                           help="a model's config.json: print its cache layout and the bytes "
                                "per token and per sequence (nothing is allocated)")
            p.add_argument("--seq-len", type=int, default=4096,
                           help="tokens per sequence for the per-sequence bytes (default 4096)")
            p.add_argument("--kv-dtype", default="bfloat16", help="KV cache dtype")
            p.add_argument("--ssm-dtype", default="float32", help="recurrent state dtype")
            p.add_argument("--conv-dtype", default=None,
                           help="conv state dtype (default: the KV dtype)")
            p.add_argument("--no-ring-windows", action="store_true",
                           help="lay sliding-window layers out unbounded (no ring buffers), "
                                "as engines that index a full-length cache need")
        if name == "bench":
            p.description = ("Time every kernel family (kernels/*.cu) on Nemotron-H-like and "
                             "Gemma-like shapes: µs, GB/s, ratio to a copy of the same bytes, "
                             "speed-up over a per-layer CuPy loop. On the CPU the NumPy "
                             "reference path runs, scaled down, and says so. Writes "
                             "<out>/<date>_<device>.json (and .png with matplotlib).")
            p.add_argument("--out", default=None,
                           help="results folder (default: bench/results in the current directory)")
            p.add_argument("--quick", action="store_true",
                           help="fewer repetitions (20 on a GPU, 2 on the CPU)")
            p.add_argument("--calls", action="store_true",
                           help="the host path of a launch: hcache Python calls per launch of "
                                "each steady-state call (counted on the emulated device of a "
                                "source checkout) and host us per call (on a GPU; else on the "
                                "emulated device, its own cost included)")
            p.add_argument("--host", action="store_true",
                           help="host overhead per decode step (bookkeeping µs, median and "
                                "worst step) instead of the kernels")
    args = parser.parse_args(argv)
    try:
        args.device = resolve_device(args.device)
    except (TypeError, ValueError) as exc:
        print(f"python -m hcache {args.command}: error: --{exc}", file=sys.stderr)
        return 2
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
