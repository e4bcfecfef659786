"""Moving a request's caches between engines with NIXL, and tensor-parallel cache layouts
(docs/design.md, "Transfer between engines").

- :class:`TensorParallelLayout`: per-rank configs that shard KV heads and Mamba heads/groups.
- :func:`describe_manager`, :func:`slot_units`: a manager's slot layout and a request's bytes.
- :class:`TransferEngine`: a NIXL agent over a manager's buffers; ``export`` / ``pull`` /
  ``push`` a request between engines of any TP degrees.
- :class:`ContextTransferEngine`: the same over a ``DynamicInferenceContext``'s paged pool
  and live Mamba states; ``pull`` admits the request through the receiver's prefix cache.

NIXL is imported on first use (``pip install 'hcache[transfer]'``); this package imports
without it, and :func:`nixl_available` says whether it is there.
"""

from __future__ import annotations

from ._nixl import load_nixl, nixl_available
from .context_engine import ContextTransferEngine, PendingContextPull
from .engine import PendingTransfer, TransferEngine
from .errors import TransferAborted, TransferCancelled, TransferError, TransferTimeout
from .layout import check_compatible, describe_manager, slot_units
from .paged import check_paged_compatible, describe_context, plan_context_pull
from .plan import merge_ranges, plan_pull, plan_push
from .tensor_parallel import TensorParallelLayout, split_heads

__all__ = ["nixl_available", "load_nixl", "TransferEngine", "PendingTransfer",
           "TransferError", "TransferTimeout", "TransferAborted", "TransferCancelled",
           "describe_manager", "slot_units", "check_compatible", "merge_ranges", "plan_pull",
           "plan_push", "TensorParallelLayout", "split_heads", "ContextTransferEngine",
           "PendingContextPull", "describe_context", "check_paged_compatible",
           "plan_context_pull"]
