"""Memory before allocation: how much a device can take now, and the check every manager runs
before its first allocation (docs/design.md §2, "Memory").

A manager knows its bytes from its config (``config.nbytes``, :mod:`hcache.config.sizing`);
:func:`check_fits` compares them with :func:`available_bytes`, so a layout that does not fit
raises :class:`~hcache.CacheCapacityError` with nothing allocated, instead of an allocator
error after the layers that fit (or, on an overcommitting host, an out-of-memory kill later).
"""

from __future__ import annotations

import os

from ._checks import exact_int
from .errors import CacheCapacityError
from .runtime.device import Device, cuda_free_bytes, resolve_device

__all__ = ["available_bytes", "check_fits"]


def available_bytes(device: Device) -> int | None:
    """Bytes an allocation on ``device`` can take now, or ``None`` where that is unknown.

    ``cuda``: the device's free memory (``cudaMemGetInfo``) plus what CuPy's memory pool holds
    unused. ``cpu``: ``MemAvailable`` of ``/proc/meminfo`` (else the free physical pages of
    ``os.sysconf``), capped by a cgroup v2 memory limit when the process runs under one.

    Raises
    ------
    TypeError, ValueError
        ``device`` is not a device (:func:`~hcache.device.resolve_device`).
    """
    device = resolve_device(device)
    if device.is_cuda:
        return cuda_free_bytes(device)
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f_max, \
                open("/sys/fs/cgroup/memory.current") as f_cur:
            limit, used = f_max.read().strip(), int(f_cur.read())
        if limit != "max":
            avail = min(avail, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return avail


def check_fits(name: str, nbytes: int, device: Device) -> None:
    """Refuse, before any allocation, a layout of ``nbytes`` that ``device`` cannot hold now.

    Raises
    ------
    CacheCapacityError
        ``nbytes`` exceeds :func:`available_bytes` (``required`` and ``available`` say by
        how much); no check where the available memory is unknown.
    TypeError, ValueError
        ``nbytes`` is not an int >= 0, or ``device`` not a device.
    """
    nbytes, device = exact_int("nbytes", nbytes), resolve_device(device)
    if nbytes < 0:   # any size above: an absurd layout is a capacity error, not a bad value
        raise ValueError(f"nbytes: expected an int >= 0, got {nbytes}")
    avail = available_bytes(device)
    if avail is not None and nbytes > avail:
        raise CacheCapacityError(
            f"{name}: expected a layout of at most {avail} bytes (available on {device}), "
            f"got {nbytes} bytes", required=int(nbytes), available=int(avail))
