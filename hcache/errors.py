"""Exceptions raised by hcache.

Policy (docs/design.md §4): caller mistakes raise ``IndexError`` / ``ValueError`` / ``TypeError``
with a
message of the form ``"<name>: expected X, got Y"``; running out of slots or blocks raises
:class:`CacheCapacityError`; a ``.cu`` file that fails to compile raises
:class:`KernelCompileError`, which names the file and line.
"""

from __future__ import annotations

__all__ = ["CacheCapacityError", "KernelCompileError", "KernelLaunchError"]


class CacheCapacityError(RuntimeError):
    """Not enough free slots or blocks for a request.

    Attributes
    ----------
    required : int or None
        How many slots/blocks the call needed.
    available : int or None
        How many were available when the call was refused.
    """

    def __init__(self, message: str, *, required: int | None = None,
                 available: int | None = None):
        super().__init__(message)
        self.required = required
        self.available = available


class KernelCompileError(RuntimeError):
    """A ``kernels/*.cu`` file failed to compile (NVRTC, or the host compiler in tests).

    Attributes
    ----------
    filename : str
        The ``.cu`` file, as named by the ``#line`` directive.
    log : str
        The compiler log; its lines name ``<file>(<line>)``.
    """

    def __init__(self, filename: str, log: str):
        super().__init__(f"{filename}: compilation failed:\n{log}")
        self.filename = filename
        self.log = log


class KernelLaunchError(RuntimeError):
    """A kernel could not be launched (no CUDA device, or a driver error)."""
