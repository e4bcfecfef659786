"""Ring buffers of sliding-window layers (docs/design.md §3.9): where a ring's oldest valid
token sits.

A ring of window ``W`` holds the last ``min(length, W)`` tokens of a sequence of ``length``
tokens, position ``p`` at entry ``p mod W``; lengths stay absolute. Read in entry order the
tokens are rotated, which an attention over all of them may ignore (softmax-weighted sums do not
depend on the order); a kernel that needs position order starts at :func:`ring_start`.
"""

from __future__ import annotations

import numpy as np

from ._checks import INT32_MAX, check_int, host_array
from .runtime import _cuda
from .runtime.arrays import as_array, on_device
from .runtime.device import launch_scope, resolve_device, stream_handle
from .runtime.stream_order import StreamOrder

__all__ = ["ring_start"]


def ring_start(lengths, window: int, device=None, stream=None, *, order=None):
    """The entry of the oldest valid token of a ring of ``window`` tokens (0: unbounded).

    Parameters
    ----------
    lengths : int or int array (host memory, or ``device``'s memory: any array library)
        Absolute sequence lengths.
    window : int
        The ring's window ``W`` (>= 0), or 0 for an unbounded cache.
    device : None, "cpu", "cuda", "cuda:N" or Device, optional
        The caches' device: device arrays of another library are viewed as its module
        (:func:`hcache.arrays.as_array`); host arrays of any library as NumPy arrays.
    stream : stream, optional
        For device ``lengths``: the stream the result is computed on (default: the current
        stream of ``device``).
    order : StreamOrder, optional
        The owner's cross-stream order of the lengths' writes (a manager's): the computation
        is chained after its earlier work on other streams.

    Returns
    -------
    int or array of ``lengths``' shape and dtype
        ``length % W`` once ``length > W``, else 0 (always 0 when ``window`` is 0). Entries
        ``start, ..., W - 1, 0, ..., start - 1`` hold positions ``length - min(length, W)``
        onward, in order. Host ``lengths`` give a NumPy array. Device ``lengths`` are **read
        on the device** and give a new **device array** of ``device``'s module, written by an
        elementwise kernel on ``stream`` (ordered after the lengths' producer, no host read or
        sync; it allocates, so it is not for a captured step).

    Raises
    ------
    TypeError
        ``lengths`` is neither an int nor an integer array (of a library ``device`` can
        import); ``window`` is not an int; ``device`` is not a device; ``stream`` is not a
        stream; ``order`` is not a :class:`~hcache.stream_order.StreamOrder`.
    ValueError
        A negative host length, ``window`` < 0, ``device`` names no usable device, or a
        ``stream`` handle out of range.
    """
    window = check_int("window", window, 0, INT32_MAX)   # the kernels' int32 ring window
    if device is not None:
        device = resolve_device(device)
    stream_handle(stream)
    if order is not None and not isinstance(order, StreamOrder):
        raise TypeError(f"order: expected None or a StreamOrder, got {type(order).__name__}")
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        if lengths < 0:
            raise ValueError(f"lengths: expected a length >= 0, got {lengths}")
        return lengths % window if window and lengths > window else 0
    if device is not None and device.is_cuda and on_device(lengths):
        with launch_scope(device, stream, order):
            lengths = as_array("lengths", lengths, device)
            _check_int_array(lengths)
            if not window:
                return device.xp.zeros(lengths.shape, lengths.dtype)
            return _cuda.runtime().ring_start(lengths, window)
    lengths = host_array("lengths", lengths)
    _check_int_array(lengths)
    if lengths.size and int(lengths.min()) < 0:   # device lengths are not read
        raise ValueError(f"lengths: expected lengths >= 0, got {int(lengths.min())}")
    if not window:
        return np.zeros_like(lengths)
    return np.where(lengths > window, lengths % window, 0).astype(lengths.dtype)


def _check_int_array(lengths) -> None:
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"lengths: expected an int or an int array, got dtype {lengths.dtype}")
