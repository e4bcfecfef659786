"""Compile-only NVRTC checks through ``ctypes`` (no GPU and no CuPy needed).

Used by ``python -m hcache info`` and the compile tier of the tests: each ``kernels/*.cu`` is
compiled to a cubin for a given ``sm_XX`` with the options the loader gives ``RawModule``.
libnvrtc is found in the ``nvidia-cuda-nvrtc-cu12`` / ``nvidia-cuda-nvrtc`` wheels, then in
``$CUDA_HOME`` / ``/usr/local/cuda``, then on the loader path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
from functools import cache
from pathlib import Path

from ..errors import KernelCompileError
from . import _loader

__all__ = ["find_libnvrtc", "nvrtc_version", "compile_family", "kernel_registers"]


def _candidates() -> list[str]:
    found: list[str] = []
    try:
        import nvidia

        for root in nvidia.__path__:
            for pattern in ("cuda_nvrtc/lib/libnvrtc.so*", "cu13/lib/libnvrtc.so*",
                            "cuda_nvrtc/bin/nvrtc64_*.dll"):
                found += sorted(glob.glob(str(Path(root) / pattern)), reverse=True)
    except ImportError:
        pass
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(str(Path(home) / "lib64" / "libnvrtc.so*")), reverse=True)
    name = ctypes.util.find_library("nvrtc")
    if name:
        found.append(name)
    return [f for f in found if "builtins" not in f and ".alt." not in f]


@cache
def find_libnvrtc():
    """The loaded libnvrtc (``ctypes.CDLL``), or ``None`` if none can be loaded."""
    for path in _candidates():
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def nvrtc_version() -> tuple[int, int] | None:
    lib = find_libnvrtc()
    if lib is None:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def _check(lib, code: int, what: str):
    if code != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(code).decode()}")


def compile_family(family: str, arch: str = "sm_80") -> int:
    """Compile ``kernels/<family>.cu`` to a cubin for ``arch``; return the cubin's size.

    Raises
    ------
    KernelCompileError
        NVRTC rejected the source; the log names ``<file>(<line>)``.
    RuntimeError
        libnvrtc could not be found or failed.
    """
    return _compile(family, arch, ())[0]


def kernel_registers(family: str, arch: str = "sm_90") -> dict[str, int]:
    """Registers per thread of each kernel of ``family`` compiled for ``arch`` (ptxas ``-v``):
    ``{kernel name: registers}``. Raises as :func:`compile_family`."""
    log = _compile(family, arch, ("-Xptxas=-v",))[1]
    found: dict[str, int] = {}
    name = None
    for line in log.splitlines():
        entry = re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?",
                          line)
        if entry:
            name = entry.group(1)
        used = re.search(r"Used (\d+) registers", line)
        if used and name is not None:
            found[name] = int(used.group(1))
    return found


def _compile(family: str, arch: str, extra: tuple[str, ...]) -> tuple[int, str]:
    """``(cubin size, compile log)`` of ``family`` for ``arch`` with ``extra`` options."""
    lib = find_libnvrtc()
    if lib is None:
        raise RuntimeError("libnvrtc not found: install nvidia-cuda-nvrtc-cu12 (hcache[test])")
    path, source = _loader.kernel_source(family)
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(),
                                       Path(path).name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in (*_loader.nvrtc_options(), f"-arch={arch}", *extra)]
        argv = (ctypes.c_char_p * len(opts))(*opts)
        code = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        if code != 0:
            raise KernelCompileError(path, text)
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        return int(size.value), text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
