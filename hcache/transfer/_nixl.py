"""NIXL, imported on first use: hcache imports without it (the ``hcache[transfer]`` extra)."""

from __future__ import annotations

import functools
import importlib

__all__ = ["nixl_available", "load_nixl"]

_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")


@functools.cache
def _find():
    for name in _MODULES:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    return None


def nixl_available() -> bool:
    """Whether a NIXL Python package (``nixl_cu12``, ``nixl_cu13`` or ``nixl``) imports."""
    return _find() is not None


def load_nixl():
    """NIXL's ``_api`` module (``nixl_agent``, ``nixl_agent_config``).

    Raises
    ------
    ImportError
        No NIXL package is installed.
    """
    api = _find()
    if api is None:
        raise ImportError("hcache.transfer: expected a NIXL package (pip install "
                          "'hcache[transfer]', or pip install --no-deps nixl-cu12), got none "
                          f"of {', '.join(_MODULES)}")
    return api
