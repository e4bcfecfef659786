"""Errors of a transfer between engines: each leaves the destination slot zeroed (no partial
state) and both engines usable."""

from __future__ import annotations

__all__ = ["TransferError", "TransferTimeout", "TransferAborted", "TransferCancelled"]


class TransferError(RuntimeError):
    """A transfer failed (the peer is gone, NIXL reported an error)."""


class TransferTimeout(TransferError):
    """A transfer did not finish before its deadline."""


class TransferAborted(TransferError):
    """The sending side released the request while it was being pulled."""


class TransferCancelled(TransferError):
    """This side cancelled the transfer (its request was released during the transfer)."""
