"""The observers of a :class:`~hcache.contexts.KVBlockAllocator`: callables it calls after a
batch of blocks is deregistered or released (docs/design.md §6.2), in the order they were added.
An observer's raise is logged, not propagated, and does not stop the others; a list or set
argument is the observer's own (no observer sees another's changes to it)."""

from __future__ import annotations

import logging

__all__ = ["checked_observer", "notify"]

_log = logging.getLogger(__name__)


def checked_observer(fn):
    """``fn``, checked callable (``TypeError`` otherwise)."""
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    return fn


def notify(observers: list, ids, others) -> None:
    """Call each of ``observers`` with ``(ids, others)``: a list ``ids`` and a set ``others``
    are copied for each observer but the last, which gets them (the caller's no longer); arrays
    are passed as they are (read only). A raise is logged."""
    calls = list(observers)     # (an observer may add one: it is called from the next batch)
    copied = type(ids) is list
    for k, fn in enumerate(calls, 1 - len(calls)):      # k == 0: the last
        try:
            if copied and k:
                fn(ids.copy(), set(others))
            else:
                fn(ids, others)
        except Exception:  # noqa: BLE001 - observers must not break the allocator
            _log.exception("blocks observer %r failed", fn)
