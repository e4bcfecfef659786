"""The rows of the Mamba boundary tracking that hold entries (docs/design.md §6 and §8, issue 24).

:class:`~.mamba_intermediate.IntermediateStates` keeps a step's boundary entries in per-row
arrays over every request row; a serving step fills one or two rows. :class:`EntryRows` notes
the rows that may hold entries (a superset, at most ``TRACKED`` of them), so the commit reads
and clears those rows one by one through kept memoryviews instead of scanning every row with
NumPy. Invariants (checked by :meth:`EntryRows.broken_invariants`):

- ``pending`` is True whenever some row holds an entry (a scratch entry or an EOS entry);
- while ``rows`` is a set, every row holding an entry is in it; ``rows`` is None (untracked:
  the arrays are scanned) once more than ``TRACKED`` rows were noted, or after a writer of the
  arrays set ``pending`` itself, until the next full :meth:`EntryRows.clear`.
"""

from __future__ import annotations

from array import array

import numpy as np

from .._checks import index_array
from .scalar_views import ScalarViews

__all__ = ["TRACKED", "EntryRows"]

TRACKED = 64
_PLAIN_INT = {int}


class EntryRows:
    """The pending flag and the rows that may hold entries of the tracking arrays.

    Parameters
    ----------
    offsets, block_ids : int32 [max_requests, K]
    counts, eos_block_ids : int32 [max_requests]
        The tracking arrays of :class:`~.mamba_intermediate.IntermediateStates` (its own,
        never rebound; the packing invariants are its).

    Attributes
    ----------
    pending : bool
        Whether some row may hold an entry (a writer of the arrays other than these methods
        sets it through :meth:`flag`).
    rows : set of int or None
        A superset of the rows holding entries, or None (untracked).
    """

    def __init__(self, offsets, block_ids, counts, eos_block_ids):
        self._arrays = (offsets, block_ids, counts, eos_block_ids)
        self.max_requests, self.width = offsets.shape
        self._views = ScalarViews(offsets=offsets, block_ids=block_ids, counts=counts,
                                  eos=eos_block_ids)
        self._zeros, self._none = (array("i", [v] * self.width) for v in (0, -1))
        self.pending, self.rows = False, set()

    def flag(self, pending) -> None:
        """Set :attr:`pending` after writing the arrays directly (True: the rows written are
        unknown, so they are no longer tracked)."""
        self.pending = bool(pending)
        if self.pending:
            self.rows = None

    def track(self, rows) -> None:
        """Note that ``rows`` (Python ints) may hold entries now; they are pending."""
        tracked = self.rows
        if tracked is not None:
            tracked.update(rows)
            if len(tracked) > TRACKED:
                self.rows = None
        self.pending = True

    def _drop_row_scratch(self, row: int) -> None:
        views = self._views
        n = views.counts[row]
        if n:       # (the entries beyond a row's count are clear)
            base = row * self.width
            views.offsets[base:base + n] = self._zeros[:n]
            views.block_ids[base:base + n] = self._none[:n]
            views.counts[row] = 0

    def write_row(self, row: int, offsets: list, block_ids: list, eos: int) -> None:
        """Replace the entries of ``row``: ``offsets`` / ``block_ids`` (at most ``K``, Python
        ints) and the EOS block ``eos`` (-1: none); notes the row if it holds an entry."""
        k, n, views = self.width, len(offsets), self._views
        offsets_array, block_ids_array, _, _ = self._arrays
        offsets_array[row] = offsets + [0] * (k - n)
        block_ids_array[row] = block_ids + [-1] * (k - n)
        views.counts[row] = n
        views.eos[row] = eos
        if n or eos >= 0:
            self.track((row,))

    def write_eos(self, rows, block_ids) -> None:
        """Replace the entries of distinct ``rows`` by EOS entries of ``block_ids``: lists of
        Python ints, or (for many) int arrays."""
        arrays = type(rows) is not list
        rows_array, rows = (rows, rows.tolist()) if arrays else (None, rows)
        tracked = self.rows
        if not self.pending or tracked is not None and tracked.isdisjoint(rows):
            pass        # none of them holds an entry
        elif tracked is None:
            offsets, block_ids_array, counts, _ = self._arrays
            offsets[rows] = 0
            block_ids_array[rows] = -1
            counts[rows] = 0
        else:
            for row in tracked.intersection(rows):
                self._drop_row_scratch(row)
        if arrays:
            self._arrays[3][rows_array] = block_ids
        else:
            eos = self._views.eos
            for row, block in zip(rows, block_ids):
                eos[row] = block
        self.track(rows)

    def entries(self, limit: int):
        """``(block_ids, eos_rows, num_scratch)``: the blocks of the scratch entries (rows in
        ascending order, each row's in order), then of the EOS entries (of ``eos_rows``,
        ascending), as lists; None when over ``limit`` entries may be pending."""
        views, k = self._views, self.width
        counts, ids, eos = views.counts, views.block_ids, views.eos
        if self.rows is None:
            _, _, counts_array, eos_array = self._arrays
            rows = counts_array.nonzero()[0].tolist()
            eos_rows = (eos_array >= 0).nonzero()[0].tolist()
            eos_ids = [eos[row] for row in eos_rows]
        else:
            tracked = sorted(self.rows)
            rows = [row for row in tracked if counts[row]]
            eos_rows = [row for row in tracked if eos[row] >= 0]
            eos_ids = [eos[row] for row in eos_rows]
        if k * len(rows) + len(eos_rows) > limit:
            return None
        block_ids = []
        for row in rows:
            block_ids += ids[row * k:row * k + counts[row]]
        num_scratch = len(block_ids)
        return block_ids + eos_ids, eos_rows, num_scratch

    def clear(self, rows=None) -> None:
        """Forget the entries of ``rows`` (default: every row). Raises ``IndexError`` (nothing
        changes) when a row is out of range."""
        tracked = self.rows
        if rows is None:
            if tracked is None:
                if self.pending:
                    self._forget(None)
                self.rows = set()
            elif tracked:
                if self.pending:
                    counts, eos = self._views.counts, self._views.eos
                    for row in tracked:
                        if counts[row]:
                            self._drop_row_scratch(row)
                        eos[row] = -1
                tracked.clear()
            self.pending = False      # every row is clear
            return
        listed = type(rows) is list and set(map(type, rows)) <= _PLAIN_INT and \
            (not rows or 0 <= min(rows) and max(rows) < self.max_requests)
        sel = rows if listed else index_array("rows", rows, self.max_requests)
        if not self.pending:
            return      # every row is clear already
        if tracked is None:
            self._forget(None, sel)
            _, _, counts, eos = self._arrays
            self.pending = bool(np.count_nonzero(counts) or np.count_nonzero(eos >= 0))
            return
        gone = tracked.intersection(sel if listed else sel.tolist())
        if gone:
            self._forget(gone)
            tracked -= gone
        counts, eos = self._views.counts, self._views.eos
        for row in tracked:
            if counts[row] or eos[row] >= 0:
                return      # still pending
        tracked.clear()
        self.pending = False

    def _forget(self, rows, sel=slice(None)) -> None:
        """Clear ``rows`` one by one, or (None) the rows of ``sel`` with NumPy."""
        if rows is None:
            offsets, block_ids, counts, eos = self._arrays
            offsets[sel] = 0
            block_ids[sel] = -1
            counts[sel] = 0
            eos[sel] = -1
            return
        counts, eos = self._views.counts, self._views.eos
        for row in rows:
            if counts[row]:
                self._drop_row_scratch(row)
            eos[row] = -1

    def broken_invariants(self) -> list[str]:
        """Every broken invariant (module docstring); empty when all hold."""
        _, _, counts, eos = self._arrays
        held = set(np.flatnonzero((counts != 0) | (eos >= 0)).tolist())
        problems = []
        if not self.pending and held:
            problems.append("intermediate entries pending while none are flagged")
        if self.rows is not None and not held <= self.rows:
            problems.append(f"rows with entries not tracked: {sorted(held - self.rows)[:8]}")
        return problems
