"""On-disk cache of NVRTC compile checks for ``python -m hcache info`` (docs/design.md §7).

A family's check result (it compiled, the cubin's size) is stored under a key of everything
the result depends on: the source text as the loader gives it (which carries a digest of the
``.cuh`` headers), the NVRTC options, the target ``sm_XX``, the NVRTC version and the library's
path. Any change of those is a different key, so nothing is ever invalidated by hand; a failed
compile is never stored (it is compiled, and reported, again). The folder is
``$HCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/hcache``, else ``~/.cache/hcache``, plus
``nvrtc/``; a folder that cannot be written only loses the caching.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from . import _loader, _nvrtc

__all__ = ["cache_dir", "compile_key", "checked_compile"]


def cache_dir() -> Path:
    """The folder of the stored results (created on first store)."""
    root = os.environ.get("HCACHE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "hcache")
    return Path(root) / "nvrtc"


def compile_key(family: str, arch: str) -> str:
    """The sha256 of everything a compile of ``family`` for ``arch`` depends on."""
    _, source = _loader.kernel_source(family)
    lib = _nvrtc.find_libnvrtc()
    parts = [source, *_loader.nvrtc_options(), arch, repr(_nvrtc.nvrtc_version()),
             getattr(lib, "_name", "") or ""]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def checked_compile(family: str, arch: str, *, use_cache: bool = True) -> tuple[int, bool]:
    """Compile ``family`` for ``arch`` unless a stored result has the same key.

    Returns
    -------
    (cubin_size, cached) : (int, bool)

    Raises
    ------
    KernelCompileError, RuntimeError
        As :func:`hcache.ops._nvrtc.compile_family` (nothing is stored).
    """
    path = cache_dir() / f"{compile_key(family, arch)}.json"
    if use_cache:
        try:
            stored = json.loads(path.read_text())
            if stored.get("family") == family and stored.get("arch") == arch:
                return int(stored["cubin_size"]), True
        except (OSError, ValueError, KeyError, TypeError):
            pass   # no entry, or an unreadable one: compile
    size = _nvrtc.compile_family(family, arch)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"family": family, "arch": arch, "cubin_size": size}))
            os.replace(tmp, path)   # atomic: a concurrent reader sees all or nothing
        except OSError:
            pass
    return size, False
