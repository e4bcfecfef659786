"""``python -m hcache demo``: a tiny hybrid model served by hcache's managers, checked token for
token against an uncached run (:mod:`hcache.demo.run`; the model in :mod:`hcache.demo.model`,
its bindings to the managers in :mod:`hcache.demo.adapters`)."""

from __future__ import annotations

from .run import run_demo

__all__ = ["run_demo"]
