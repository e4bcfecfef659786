"""The kernel loader: sources of ``kernels/`` compiled through the device runtime.

Sources live in the repository's ``kernels/``, shipped in the wheel as ``hcache/kernels/``
(package data; :func:`kernel_dir` finds either); each family is
compiled on first use, once per device (and runtime), with a ``#line`` directive so that compile
errors name the real file and line. Importing hcache compiles nothing.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

from ..runtime import _cuda

__all__ = ["FAMILIES", "kernel_dir", "kernel_source", "nvrtc_options", "get_function"]

# family -> exported kernel names (each .cu ends with the same list in an "Exported:" comment).
# Kernel hc_<op> is launched by op <op> of hcache/ops/<family>.py (docs/design.md §9).
FAMILIES: dict[str, tuple[str, ...]] = {
    "kv_write": ("hc_kv_write", "hc_kv_write_fp8"),
    "compact": ("hc_compaction_plan", "hc_kv_compact", "hc_slots_compact"),
    "slot_copy": ("hc_slot_copy",),
    "kv_capture": ("hc_kv_capture",),
    "lengths": ("hc_lengths_add",),
    "draft_accept": ("hc_draft_accept", "hc_draft_lengths"),
}


def kernel_dir() -> Path:
    """The folder holding ``*.cu``/``*.cuh``: ``hcache/kernels`` in an installed wheel (package
    data), else the repository's top-level ``kernels/`` (a checkout or an editable install)."""
    package = Path(__file__).resolve().parent.parent
    shipped = package / "kernels"    # by its header: a stale folder (a __pycache__) is no wheel
    return shipped if (shipped / "common.cuh").is_file() else package.parent / "kernels"


def kernel_source(family: str) -> tuple[str, str]:
    """``(path, source)`` of a family, the source prefixed with ``#line 1 "<path>"`` and
    suffixed with a digest of the ``.cuh`` headers: CuPy keys its kernel cache by the source
    text, not by what it includes, so a changed header must change the text."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")
    folder = kernel_dir()
    path = folder / f"{family}.cu"
    headers = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.glob("*.cuh"))))
    return str(path), (f'#line 1 "{path}"\n' + path.read_text()
                       + f"\n// hcache headers sha256 {headers.hexdigest()}\n")


def nvrtc_options() -> tuple[str, ...]:
    return ("-std=c++17", f"-I{kernel_dir()}")


@cache
def _module(family: str, device_id: int, runtime_key: str):
    path, source = kernel_source(family)
    return _cuda.runtime().compile(path, source, nvrtc_options(), device_id)


def get_function(family: str, name: str, device_id: int):
    """The kernel ``name`` of ``family`` on device ``device_id`` of the active runtime
    (compiled once per family, device and kind of runtime)."""
    if name not in FAMILIES.get(family, ()):
        raise ValueError(f"name: expected a kernel of {family!r}, got {name!r}")
    return _kernel(family, name, device_id, _cuda.runtime().cache_key)


@cache
def _kernel(family: str, name: str, device_id: int, runtime_key: str):
    return _cuda.runtime().kernel(_module(family, device_id, runtime_key), name)
