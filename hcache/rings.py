"""Ring buffers of sliding-window layers (docs/design.md §3.9): where a ring's oldest valid
token sits.

A ring of window ``W`` holds the last ``min(length, W)`` tokens of a sequence of ``length``
tokens, position ``p`` at entry ``p mod W``; lengths stay absolute. Read in entry order the
tokens are rotated, which an attention over all of them may ignore (softmax-weighted sums do not
depend on the order); a kernel that needs position order starts at :func:`ring_start`.
"""

from __future__ import annotations

from ._checks import as_int, host_array
from .device import array_module_of, as_array, on_device, resolve_device

__all__ = ["ring_start"]


def ring_start(lengths, window: int, device=None):
    """The entry of the oldest valid token of a ring of ``window`` tokens (0: unbounded).

    Parameters
    ----------
    lengths : int or int array (host memory, or ``device``'s memory: any array library)
        Absolute sequence lengths.
    window : int
        The ring's window ``W`` (>= 0), or 0 for an unbounded cache.
    device : None, "cpu", "cuda", "cuda:N" or Device, optional
        The caches' device: device arrays of another library are viewed as its module
        (``device.as_array``); host arrays of any library as NumPy arrays.

    Returns
    -------
    int or array of ``lengths``' shape, dtype and module
        ``length % W`` once ``length > W``, else 0 (always 0 when ``window`` is 0). Entries
        ``start, ..., W - 1, 0, ..., start - 1`` hold positions ``length - min(length, W)``
        onward, in order.

    Raises
    ------
    TypeError
        ``lengths`` is neither an int nor an integer array (of a library ``device`` can
        import); ``window`` is not an int; ``device`` is not a device.
    ValueError
        A negative host length, ``window`` < 0, or ``device`` names no usable device.
    """
    window = as_int("window", window, 0)
    if device is not None:
        device = resolve_device(device)
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        if lengths < 0:
            raise ValueError(f"lengths: expected a length >= 0, got {lengths}")
        return lengths % window if window and lengths > window else 0
    on_host = device is None or not on_device(lengths)
    lengths = host_array("lengths", lengths) if on_host else as_array("lengths", lengths, device)
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"lengths: expected an int or an int array, got dtype {lengths.dtype}")
    if on_host and lengths.size and int(lengths.min()) < 0:   # device lengths are not read
        raise ValueError(f"lengths: expected lengths >= 0, got {int(lengths.min())}")
    xp = array_module_of(lengths)
    if not window:
        return xp.zeros_like(lengths)
    return xp.where(lengths > window, lengths % window, 0).astype(lengths.dtype)
