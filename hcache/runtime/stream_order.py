"""Cross-stream ordering of one owner's device work (docs/design.md §2 "Streams").

A manager's calls read and write the same device memory whatever stream each call names: its
lengths and blocks, and the scratch buffers its host tables are staged into (increments,
mappings, plans, status words, row offsets, positions, block ids, pointer tables). A
:class:`StreamOrder` makes that work one chain: every launch scope of the owner ends by
recording one event on its stream, and a scope on another stream starts with
``cudaStreamWaitEvent`` on it. The device orders the calls; the host never waits.

During stream capture nothing is recorded or waited for (a capture cannot wait for work outside
it, and an event recorded inside it is not usable outside): the caller orders a capture after
the owner's earlier work on other streams, and a graph's launches before later calls on other
streams.
"""

from __future__ import annotations

import threading

from . import _cuda

__all__ = ["StreamOrder"]


class StreamOrder:
    """The last stream an owner's work was queued on, and an event after that work."""

    __slots__ = ("_event", "_stream", "_lock")

    def __init__(self):
        self._event = None
        self._stream = None          # handle of the stream the event was last recorded on
        self._lock = threading.Lock()

    def __reduce__(self):
        """A copy starts a chain of its own (the cache owners themselves refuse copies,
        :mod:`hcache._copying`)."""
        return (StreamOrder, ())

    def __enter__(self):
        """A launch scope on the current device and stream: :meth:`before`, then on exit
        :meth:`after`, with the active runtime."""
        self.before(_cuda.runtime())
        return self

    def __exit__(self, *exc) -> None:
        self.after(_cuda.runtime())

    def before(self, rt) -> None:
        """At the start of a launch scope (its device and stream current): order the current
        stream after the owner's previous work on another stream."""
        if rt.is_capturing():
            return
        with self._lock:
            if self._stream is not None and self._stream != rt.current_stream():
                rt.wait(self._event)

    def after(self, rt) -> None:
        """At the end of a launch scope: the owner's work so far ends at a new record."""
        if rt.is_capturing():
            return
        with self._lock:
            if self._event is None:
                self._event = rt.event()
            rt.record(self._event)
            self._stream = rt.current_stream()
