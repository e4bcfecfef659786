"""A transfer of one request with every peer of a plan, in flight (docs/design.md, "Transfer
between engines"): polled to completion under a deadline, or failed / cancelled with the
destination ranges zeroed."""

from __future__ import annotations

import time

from .errors import TransferAborted, TransferCancelled, TransferError, TransferTimeout

__all__ = ["PendingTransfer"]

SETTLE_S = 1.0    # how long a failed transfer waits for NIXL to let go of its handles


class PendingTransfer:
    """Transfers of one request with every peer of a plan, in flight.

    ``state`` is ``"PROC"``, ``"DONE"`` or ``"FAILED"``. Call :meth:`poll` or :meth:`wait`;
    :meth:`cancel` when the request is released meanwhile.
    """

    def __init__(self, engine, request_id, plan, slot, length, timeout_s, op, clear):
        self.engine, self.request_id, self.op = engine, request_id, op
        self.slot, self.length = slot, length
        self._plan, self._handles, self._clear = plan, [], clear
        self._deadline = time.monotonic() + timeout_s
        self.state, self.error = "PROC", None
        self.exports = {}   # peer -> the serial of its export read here (engine._start)

    @property
    def nbytes(self) -> int:
        """Bytes moved (all peers)."""
        return int(sum(rows[:, 2].sum() for _, rows in self._plan))

    @property
    def num_descriptors(self) -> int:
        """Descriptors after merging (all peers)."""
        return sum(len(rows) for _, rows in self._plan)

    def _release(self) -> bool:
        """Release every NIXL handle; one still moving data (NIXL could not cancel it) is
        given up to ``SETTLE_S`` to finish or fail first. Returns False if one could not be
        released (its data may still land)."""
        agent, released = self.engine._agent, True
        for _, handle in self._handles:
            end = time.monotonic() + SETTLE_S
            while True:
                try:
                    agent.release_xfer_handle(handle)
                    break
                except Exception:   # noqa: BLE001 - in flight and not cancellable yet
                    if time.monotonic() > end:
                        released = False
                        break
                    time.sleep(1e-3)
        self._handles = []
        return released

    def _fail(self, error):
        released = self._release()
        if not released:
            error = type(error)(f"{error}; NIXL could not cancel a transfer within "
                                f"{SETTLE_S} s: its data may still land in the slot")
        if callable(self._clear):       # the destination's own clean-up (a context's request)
            self._clear(released)
        elif self._clear:
            self.engine.zero_slot(self.slot, self.length)
        self.state, self.error = "FAILED", error
        raise error

    def poll(self) -> bool:
        """True once every transfer is done (and not aborted by the exporter).

        Raises
        ------
        TransferError, TransferTimeout, TransferAborted
            The destination ranges are zeroed first (for a pull).
        """
        if self.state == "DONE":
            return True
        if self.state == "FAILED":
            raise self.error
        if time.monotonic() > self._deadline:     # even if done: the lease may have ended
            self._fail(TransferTimeout(f"transfer of {self.request_id!r}: not done within "
                                       f"its deadline"))
        agent, done = self.engine._agent, True
        for peer, handle in self._handles:
            try:
                status = agent.check_xfer_state(handle)
            except Exception as e:   # noqa: BLE001
                status = f"ERR ({type(e).__name__}: {e})"
            if status.startswith("ERR"):
                self._fail(TransferError(f"transfer of {self.request_id!r} with peer "
                                         f"{peer!r} failed: {status} (peer gone?)"))
            done &= status == "DONE"
        for peer, _ in self._plan:
            if self.op == "READ" and self.engine._was_aborted(peer, self.request_id,
                                                              self.exports.get(peer)):
                self._fail(TransferAborted(f"transfer of {self.request_id!r}: peer {peer!r} "
                                           f"released the request during the transfer"))
        if done:
            self._release()
            self.state = "DONE"
            return True
        return False

    def wait(self, timeout_s: float | None = None) -> None:
        """Poll until done (bounded by the transfer's deadline, or ``timeout_s`` if sooner).
        Raises like :meth:`poll`."""
        if timeout_s is not None:
            self._deadline = min(self._deadline, time.monotonic() + timeout_s)
        pause = 1e-5
        while not self.poll():
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def cancel(self) -> None:
        """Stop the transfer (its request was released here): the handles are released and
        the destination ranges zeroed; later :meth:`poll` raises ``TransferCancelled``. A
        transfer already done is left as it is."""
        if self.state != "PROC":
            return
        try:
            self._fail(TransferCancelled(f"transfer of {self.request_id!r}: cancelled"))
        except TransferCancelled:
            pass
