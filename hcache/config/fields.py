"""Field checks shared by the configuration dataclasses of :mod:`hcache.config.caches`
(docs/design.md §4): sequence lengths, dtypes, byte budgets, the shape fields of recurrent and
conv states, and the frozen mapping a config stores a dict in. Each check raises ``TypeError`` /
``ValueError`` with ``"<field>: expected X, got Y"``."""

from __future__ import annotations

from collections.abc import Mapping

from .._checks import INT32_MAX, as_int
from ..dtypes import dtype_name
from . import sizing
from .layers import _set

__all__ = []


def _seq_len(value) -> int:
    value = as_int("max_sequence_length", value, 1)
    if value > INT32_MAX:
        raise ValueError(f"max_sequence_length: expected an int <= {INT32_MAX} (int32 "
                         f"lengths), got {value}")
    return value


def _dtype(obj, name):
    try:
        _set(obj, name, dtype_name(getattr(obj, name)))
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {str(exc).split(': ', 1)[-1]}") from None


def _budget(budget) -> int:
    """``budget`` (bytes) as an int >= 0.

    Raises
    ------
    TypeError
        ``budget`` is not an int (a float is refused: bytes are whole).
    ValueError
        ``budget`` is negative.
    """
    return as_int("budget", budget, 0)


def _largest_batch(budget, with_batch) -> int:
    budget = _budget(budget)
    return sizing.largest_fitting(lambda b: with_batch(b).nbytes, budget)


class _FrozenMapping(Mapping):
    """A read-only, hashable mapping that pickles and deep-copies (unlike ``mappingproxy``)."""

    __slots__ = ("_data",)

    def __init__(self, data=()):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self):
        return hash(tuple(sorted(self._data.items())))

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self):
        return (type(self), (self._data,))


def _state_fields(obj, recurrent: tuple, conv: tuple) -> None:
    """Checks the shape fields of the two states: each state's fields are all 0 (no such state)
    or all >= 1, and at least one state exists."""
    for names in (recurrent, conv):
        for name in names:
            _set(obj, name, as_int(name, getattr(obj, name), 0))
        zero = [name for name in names if getattr(obj, name) == 0]
        given = [n for n in names if n not in zero]
        if zero and given:   # the message names the odd one out (the zeros on a tie)
            odd, rest = (given, zero) if len(given) < len(zero) else (zero, given)
            value = getattr(obj, odd[0])
            want = "0" if odd is given else ">= 1"
            state = "0" if odd is given else "set"
            raise ValueError(f"{odd[0]}: expected {want} since {' and '.join(rest)} "
                             f"{'is' if len(rest) == 1 else 'are'} {state} (0 for all of "
                             f"{', '.join(names)}: no such state), got {value}")
    if all(getattr(obj, name) == 0 for name in recurrent + conv):
        raise ValueError(f"{recurrent[-1]}: expected a recurrent state or a conv state, got "
                         f"neither (every shape field is 0)")
