"""The KV head geometry of the continuous-batching API, the checks of the manager's arguments
and the bytes a manager of them allocates (docs/design.md §5)."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import INT32_MAX, as_int
from ..config.sizing import continuous_manager_nbytes, largest_fitting
from ..dtypes import resolve_dtype

__all__ = ["KVCacheStaticParams", "manager_arguments"]


def manager_arguments(dtype, kv_params, max_batch_size, max_seq_len, num_layers,
                      sliding_window=None) -> tuple:
    """The arguments of a :class:`~hcache.ContinuousBatchingKVCacheManager`, checked:
    ``(dtype, max_batch_size, max_seq_len, num_layers, ring_window)`` (a resolved dtype, four
    ints; ``ring_window`` is ``sliding_window`` when it is shorter than ``max_seq_len``, else
    0: unbounded blocks).

    Raises
    ------
    TypeError, ValueError
        An argument has the wrong type or value (the message names it).
    """
    if not isinstance(kv_params, KVCacheStaticParams):
        raise TypeError(f"kv_params: expected KVCacheStaticParams, "
                        f"got {type(kv_params).__name__}")
    dtype = resolve_dtype(dtype)
    blocks = as_int("max_batch_size", max_batch_size, 1)
    seq_len = as_int("max_seq_len", max_seq_len, 1)
    if seq_len > INT32_MAX:
        raise ValueError(f"max_seq_len: expected at most {INT32_MAX}, got {max_seq_len}")
    layers = as_int("num_layers", num_layers, 1)
    window = None if sliding_window is None else as_int("sliding_window", sliding_window, 1)
    ring = window if window is not None and window < seq_len else 0
    return dtype, blocks, seq_len, layers, ring


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
    def head_dim(self) -> int:
        """Alias of ``head_size`` (MAX's name, kept here), the name the other managers use."""
        return self.head_size

    @property
    def components(self) -> int:
        """Cache planes per layer: 2 (K and V), or 1 with ``is_mla``."""
        return 1 if self.is_mla else 2

    def nbytes(self, dtype, max_batch_size, max_seq_len, num_layers, *,
               sliding_window=None) -> int:
        """Device bytes a :class:`~hcache.ContinuousBatchingKVCacheManager` of this geometry
        and these arguments allocates (its ``memory_report()["total_bytes"]``; one plane per
        layer with ``is_mla``; ring blocks of the window with a ``sliding_window`` shorter
        than ``max_seq_len``), known before any allocation. Raises as the manager's
        constructor for a bad argument."""
        dtype, n, s, layers, ring = manager_arguments(dtype, self, max_batch_size, max_seq_len,
                                                      num_layers, sliding_window)
        return continuous_manager_nbytes(dtype, self.num_heads, self.head_size, n, s, layers,
                                         self.components, ring)

    def max_batch_size_for(self, budget, dtype, max_seq_len, num_layers, *,
                           sliding_window=None) -> int:
        """The largest ``max_batch_size`` (blocks) whose manager fits in ``budget`` bytes, or
        0 if not even one block fits. ``TypeError`` / ``ValueError`` for a bad argument."""
        budget = as_int("budget", budget, 0)
        self.nbytes(dtype, 1, max_seq_len, num_layers,
                    sliding_window=sliding_window)   # checks the other arguments
        return largest_fitting(lambda n: self.nbytes(dtype, n, max_seq_len, num_layers,
                                                     sliding_window=sliding_window), budget)
