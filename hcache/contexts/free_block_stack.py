"""The free blocks of a paged pool as a stack (docs/design.md §6.2): a fresh pool hands out ids
0, 1, 2, ...; an allocation takes its blocks from the top, top first, and freed or evicted blocks
are pushed in order."""

from __future__ import annotations

import numpy as np

from .scalar_views import ScalarViews

__all__ = ["FreeBlockStack"]

_FEW = 16   # a list of up to this many is pushed element by element


class FreeBlockStack:
    """The free block ids among ``num_blocks``: ``ids[:top]``, bottom first."""

    def __init__(self, num_blocks: int):
        self.ids = np.empty(num_blocks, dtype=np.int32)
        self._scalars = ScalarViews(ids=self.ids)
        self.top = 0
        self.reset()

    def reset(self) -> None:
        """Every block free (bottom-to-top n-1..0)."""
        n = len(self.ids)
        self.ids[:] = np.arange(n - 1, -1, -1, dtype=np.int32)
        self.top = n

    @property
    def free_block_ids(self) -> np.ndarray:
        return self.ids[: self.top].copy()

    def push(self, block_ids) -> None:
        """Push ``block_ids`` (an int array or a list of ints) in order."""
        k = len(block_ids)
        if type(block_ids) is list and k <= _FEW:   # (cheaper than converting the list)
            ids, top = self._scalars.ids, self.top
            for b in block_ids:
                ids[top] = b
                top += 1
        else:
            self.ids[self.top: self.top + k] = block_ids
        self.top += k

    def pop(self, n: int) -> np.ndarray:
        """The top ``n`` ids (a new int32 array, top first); ``n <= top``."""
        top = self.top - n
        out = self.ids[top: self.top][::-1].copy()
        self.top = top
        return out

    def pop_per_request(self, counts: list, top: int) -> np.ndarray:
        """Empty the stack as consecutive :meth:`pop` ``(counts[i])`` would have, had each pushed
        its own share of the victims first: ``top`` ids were free, the rest (pushed since, in
        peel order) are one eviction's victims; ``sum(counts)`` is the stack's size."""
        if counts.count(1) == len(counts):   # one each: the free ones top down, then victims
            out = np.concatenate((self.ids[top - 1::-1], self.ids[top: self.top])) if top \
                else self.ids[: self.top].copy()
        else:
            out = np.asarray(per_request_order(self.ids[: self.top].tolist(), top, counts),
                             dtype=np.int32)
        self.top = 0
        return out

    def pop_all_listed(self, counts: list | None, top: int) -> list:
        """What :meth:`pop` ``(self.top)`` (``counts`` None) or :meth:`pop_per_request`
        ``(counts, top)`` return, as a list (no NumPy call on a step's few blocks)."""
        stack = self._scalars.ids[: self.top].tolist()      # bottom first
        self.top = 0
        if counts is None:
            stack.reverse()
            return stack
        if counts.count(1) == len(counts):      # one each: the free ones top down, then victims
            out = stack[:top]
            out.reverse()
            out += stack[top:]
            return out
        return per_request_order(stack, top, counts)


def per_request_order(stack: list, top: int, counts: list) -> list:
    """The blocks consecutive allocations of ``counts[i]`` blocks take off a free stack whose
    first ``top`` entries of ``stack`` are its blocks (bottom first) and whose next entries are
    the victims one eviction pushed (in peel order): each allocation takes its count from the
    top, the stack's blocks top down and then, when they run out, the victims its own eviction
    would have pushed, and hands them out top first."""
    out: list[int] = []
    s, v = top, top
    for k in counts:
        m = min(k, s)
        chunk = stack[s - m: s] + stack[v: v + k - m]
        chunk.reverse()
        out += chunk
        s -= m
        v += k - m
    return out
