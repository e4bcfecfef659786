"""Memoryviews of a bookkeeping class's 1-D NumPy arrays, for the element-by-element paths of a
serving step (docs/design.md §8, issue 24).

Subscripting a memoryview reads or writes one element as a Python int about twice as fast as
``arr.item(i)`` / ``arr[i] = x``, and making one costs more than a step's few reads, so a class
keeps its views beside its arrays (``bool`` arrays as bytes: 0 / 1). A memoryview can be neither
deep-copied nor pickled: :class:`ScalarViews` leaves them out of the state a copy or a pickle
takes and makes them again over the copied arrays. The arrays are never replaced (their
contents are written in place), so the views stay theirs.
"""

from __future__ import annotations

__all__ = ["ScalarViews"]


class ScalarViews:
    """Mixin: ``_VIEWS``, pairs ``(view attribute, array attribute)``; :meth:`_bind_views`
    makes the views (call it once the arrays exist)."""

    _VIEWS: tuple = ()

    def _bind_views(self) -> None:
        for view, name in self._VIEWS:
            array = getattr(self, name)
            m = memoryview(array)
            setattr(self, view, m.cast("B") if array.dtype.kind == "b" else m)

    def __getstate__(self) -> dict:
        views = {view for view, _ in self._VIEWS}
        return {k: v for k, v in self.__dict__.items() if k not in views}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._bind_views()
