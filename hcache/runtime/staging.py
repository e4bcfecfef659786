"""Pinned staging of host-to-device uploads (docs/design.md §2 "Uploads").

Every host table the package copies to a device (lengths, increments, mappings, offsets,
positions, pointer tables) goes through one :class:`StagingRing` of its device: the bytes are
copied into a page-locked slot and an asynchronous copy from that slot is queued on the
current stream. Invariants:

- **No pageable copy.** A copy from pageable memory may synchronize the host with the device
  and cannot be captured; a copy from a pinned slot does neither.
- **A slot is reused only after its copy ran.** The copy reads the slot when it *executes*, not
  when it is queued, so each eager upload records an event after its copy, and the slot is
  written again only once that event completed (a host wait that in steady state finds it long
  done: the ring has :data:`EAGER_SLOTS` slots).
- **A captured upload owns its slot for good.** A graph replays its copies from the slots it
  captured, at every launch, so an upload made during capture takes a slot out of the reserve
  and never returns it (the reserve is refilled, outside capture, by the next eager upload).
  No allocation and no synchronization happens during capture.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["StagingRing", "EAGER_SLOTS", "CAPTURE_RESERVE", "SLOT_BYTES"]

EAGER_SLOTS = 8          # rotated slots of eager uploads
CAPTURE_RESERVE = 32     # slots kept free for uploads made during capture
SLOT_BYTES = 4096        # initial slot size; an eager slot grows (once) to the largest upload


class _Slot:
    __slots__ = ("buf", "event", "used")

    def __init__(self, rt, nbytes: int):
        self.buf = rt.pinned_empty(nbytes)
        self.event = rt.event()
        self.used = False   # an eager copy from it was queued (its event was recorded)


class StagingRing:
    """The pinned upload slots of one device of one runtime.

    Parameters
    ----------
    rt : runtime
        The device runtime (:mod:`hcache._cuda`).
    reserve_bytes : int
        Size of each capture-reserve slot: the largest single upload a capture may make.
    """

    def __init__(self, rt, reserve_bytes: int = 65536):
        self._rt = rt
        self._lock = threading.Lock()
        self._eager: list[_Slot] = []
        self._next = 0
        self._reserve: list[_Slot] = []
        self._reserve_bytes = int(reserve_bytes)
        self.captured: list[_Slot] = []   # slots that graphs read at replay (never reused)

    def upload(self, dst, host: np.ndarray) -> None:
        """``dst[...] = host`` through a pinned slot, queued on the current stream.

        ``dst`` is a contiguous device array of ``host``'s size; ``host`` is contiguous.

        Raises
        ------
        RuntimeError
            During capture: the upload is larger than a reserve slot, or the reserve is spent
            (more uploads in captures than :data:`CAPTURE_RESERVE` since the last eager one).
        """
        rt, n = self._rt, host.nbytes
        data = host.reshape(-1).view(np.uint8)
        with self._lock:
            capturing = rt.is_capturing()
            if capturing:
                slot = self._take_reserved(n)
                self.captured.append(slot)
            else:
                if len(self._reserve) < CAPTURE_RESERVE:
                    self._refill()
                slot = self._take_eager(n)
            slot.buf[:n] = data
            rt.copy_h2d(dst, slot.buf[:n].view(host.dtype).reshape(host.shape))
            if not capturing:
                rt.record(slot.event)
                slot.used = True

    def _take_eager(self, n: int) -> _Slot:
        rt = self._rt
        if len(self._eager) < EAGER_SLOTS:
            self._eager.append(_Slot(rt, max(n, SLOT_BYTES)))
            return self._eager[-1]
        slot = self._eager[self._next]
        self._next = (self._next + 1) % EAGER_SLOTS
        if slot.used:
            rt.event_synchronize(slot.event)   # its last copy ran: the slot may be rewritten
        if slot.buf.nbytes < n:
            slot = self._eager[self._eager.index(slot)] = _Slot(rt, n)
        return slot

    def _refill(self) -> None:
        while len(self._reserve) < CAPTURE_RESERVE:
            self._reserve.append(_Slot(self._rt, self._reserve_bytes))

    def _take_reserved(self, n: int) -> _Slot:
        if n > self._reserve_bytes:
            raise RuntimeError(f"upload: expected at most {self._reserve_bytes} bytes per upload "
                               f"during capture, got {n}")
        if not self._reserve:
            raise RuntimeError(f"upload: expected at most {CAPTURE_RESERVE} uploads in captures "
                               "between two uploads outside capture, got more (the capture "
                               "reserve of pinned slots is spent)")
        return self._reserve.pop()
