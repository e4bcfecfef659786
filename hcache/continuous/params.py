"""The KV head geometry of the continuous-batching API (docs/design.md §5)."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import as_int

__all__ = ["KVCacheStaticParams"]


@dataclass(frozen=True)
class KVCacheStaticParams:
    """Per-layer KV geometry: ``num_heads`` KV heads of ``head_size`` elements, both >= 1.

    Raises
    ------
    TypeError, ValueError
        A field is not an int >= 1.
    """

    num_heads: int
    head_size: int

    def __post_init__(self):
        object.__setattr__(self, "num_heads", as_int("num_heads", self.num_heads, 1))
        object.__setattr__(self, "head_size", as_int("head_size", self.head_size, 1))
