"""Host emulation of the CUDA kernels: compiles each unchanged ``kernels/<family>.cu`` with g++
through ``tests/cuda_emu.h`` and launches its kernels with the same argument tuples that
:mod:`hcache.ops` gives CuPy (use ``backend=EMU`` on NumPy arrays)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import numpy as np

from hcache.ops._loader import FAMILIES, kernel_dir

HEADER = Path(__file__).resolve().parent / "cuda_emu.h"
# Misaligned vector accesses and the undefined behaviour that a GPU compiler may exploit
# differently from g++ (signed overflow, division by zero) abort the test run.
FLAGS = ("-std=c++20", "-O2", "-shared", "-fPIC", "-Wall", "-Werror", "-Wno-unknown-pragmas",
         "-fsanitize=alignment,signed-integer-overflow,integer-divide-by-zero,shift",
         "-fno-sanitize-recover=all")
_CTYPE = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
          np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float}


def have_compiler() -> bool:
    return shutil.which(os.environ.get("CXX", "g++")) is not None


@cache
def build(family: str, wide_index: bool = False) -> ctypes.CDLL:
    """Compile ``family`` for the host (cached by source hash) and load it; ``wide_index``
    defines ``HC_FORCE_U64_INDEX`` (64-bit flat indices even where 32 bits would do)."""
    src = kernel_dir() / f"{family}.cu"
    exports = "".join(f"CUDA_EMU_EXPORT({name})\n" for name in FAMILIES[family])
    define = "#define HC_FORCE_U64_INDEX 1\n" if wide_index else ""
    # block-wide kernels (barriers, shared memory): their threads run as coroutines
    barriers = ["-DCUDA_EMU_BARRIERS=1"] if "__syncthreads" in src.read_text() else []
    wrapper = f'{define}#include "{src}"\n{exports}'
    digest = hashlib.sha256((" ".join(FLAGS + tuple(barriers)) + wrapper + HEADER.read_text()
                             + src.read_text()
                             + (kernel_dir() / "common.cuh").read_text()).encode()).hexdigest()
    out_dir = Path(tempfile.gettempdir()) / "hcache-emu"
    out_dir.mkdir(exist_ok=True)
    lib = out_dir / f"{family}-{digest[:16]}.so"
    if not lib.exists():
        cpp = out_dir / f"{family}-{digest[:16]}.cpp"
        cpp.write_text(wrapper)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [os.environ.get("CXX", "g++"), *FLAGS, *barriers,
               "-include", str(HEADER), f"-I{kernel_dir()}", str(cpp), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"g++ failed for {src}:\n{proc.stderr}")
        os.replace(tmp, lib)
    return ctypes.CDLL(str(lib))


class EmuLauncher:
    """``backend`` for :mod:`hcache.ops` that runs the real ``.cu`` on the CPU."""

    def __init__(self, *, reverse: bool = False, wide_index: bool = False):
        self.reverse = reverse        # run blocks and threads in reverse order (cuda_emu.h)
        self.wide_index = wide_index  # the kernels' 64-bit index paths (common.cuh)
        self.launches: list[tuple[str, tuple, tuple]] = []

    def launch(self, family, name, grid, block, args):
        grid, block = run_kernel(family, name, grid, block, args, reverse=self.reverse,
                                 wide_index=self.wide_index)
        self.launches.append((name, grid, block))


def check_args(args) -> None:
    """Kernel arguments are NumPy scalars of the C types the kernels take."""
    for a in args:
        if not isinstance(a, np.generic) or a.dtype not in _CTYPE:
            raise TypeError(f"kernel argument {a!r}: expected an int32/int64/uint64/float32 "
                            "scalar")


def run_kernel(family, name, grid, block, args, *, reverse=False, wide_index=False):
    """Run kernel ``name`` of ``family`` on the host, now; returns the 3-d grid and block."""
    check_args(args)
    holders = [_CTYPE[a.dtype](a.item()) for a in args]
    argv = (ctypes.c_void_p * len(holders))(
        *[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
    fn = getattr(build(family, wide_index), f"emu_{name}")
    fn.restype = None
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
    fn(*[ctypes.c_uint(x) for x in grid + block], ctypes.c_int(int(reverse)), argv)
    return grid, block
