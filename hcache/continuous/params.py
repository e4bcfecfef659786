"""The KV head geometry of the continuous-batching API (docs/design.md §5)."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import as_int

__all__ = ["KVCacheStaticParams"]


@dataclass(frozen=True)
class KVCacheStaticParams:
    """Per-layer KV geometry: ``num_heads`` KV heads of ``head_size`` elements, both >= 1.

    ``is_mla`` (MAX's flag for multi-head latent attention): the cache stores only K, one
    latent vector per token (``num_heads = 1``, ``head_size = kv_lora_rank +
    qk_rope_head_dim``, ``c_kv`` then ``k_pe``), and no V.

    Raises
    ------
    TypeError, ValueError
        A field is not an int >= 1, or ``is_mla`` is not a bool.
    """

    num_heads: int
    head_size: int
    is_mla: bool = False

    def __post_init__(self):
        object.__setattr__(self, "num_heads", as_int("num_heads", self.num_heads, 1))
        object.__setattr__(self, "head_size", as_int("head_size", self.head_size, 1))
        if not isinstance(self.is_mla, bool):
            raise TypeError(f"is_mla: expected a bool, got {type(self.is_mla).__name__}")

    @property
    def components(self) -> int:
        """Cache planes per layer: 2 (K and V), or 1 with ``is_mla``."""
        return 1 if self.is_mla else 2
