"""One engine's side of a transfer between :class:`~hcache.contexts.DynamicInferenceContext`\\ s
(docs/design.md §10.1): a prefill engine hands a finished prompt, its KV blocks and live Mamba
states, to a decode engine, which admits it through its own context and continues.

The exporter offers an active request with no scheduled step (``export``): the handle carries
its tokens, block ids and live Mamba slot. The receiver's ``pull`` admits the request in its
context (``add_request``: its own cached prefix is matched and pinned, the rest allocated),
*parks* it (no step completes it, nothing writes or releases it), READs the blocks it does not
hold and every live Mamba state, and makes it live: computed through its length, its complete
blocks registered as after a prefill. A failure, a deadline, an abort by the exporter or a
cancel here zero what was written and release the request: the allocator's counts return to
where they were and no hash of unpulled data is registered. READs never write the exporter's
blocks (shared ones included).
"""

from __future__ import annotations

import time

import numpy as np

from ..contexts.request_handoff import abandon, admit_parked, complete, offer, zero_filled
from ..runtime.device import settle
from .engine import _DONE, TransferEngine, _check_timeout
from .errors import TransferTimeout
from .layout import address_of
from .paged import describe_context, plan_context_pull

__all__ = ["ContextTransferEngine", "PendingContextPull"]


class PendingContextPull:
    """A pull into a context, in flight: :meth:`wait` (or :meth:`poll`) makes the request live
    when its bytes are here; :meth:`cancel` (the request was released here meanwhile) zeroes
    and releases it.

    Attributes
    ----------
    request_id : str
        The request's id in this context.
    num_matched_blocks : int
        Leading blocks this context's own prefix cache held (not pulled).
    num_pulled_blocks : int
        Blocks filled by the transfer.
    transfer : PendingTransfer
    """

    def __init__(self, engine, transfer, request_id, plan, idle_peers, source_id):
        self.engine, self.transfer, self.request_id = engine, transfer, request_id
        self.num_matched_blocks = plan.num_matched_blocks
        self.num_pulled_blocks = len(plan.block_ids) - plan.num_matched_blocks
        self._idle, self._source_id, self.live = idle_peers, source_id, False

    @property
    def state(self) -> str:
        """``"PROC"``, ``"DONE"`` (live) or ``"FAILED"``."""
        return "DONE" if self.live else ("FAILED" if self.transfer.state == "FAILED"
                                         else "PROC")

    @property
    def nbytes(self) -> int:
        return self.transfer.nbytes

    @property
    def num_descriptors(self) -> int:
        return self.transfer.num_descriptors

    def poll(self) -> bool:
        """True once the request is live here. Raises like
        :meth:`~hcache.transfer.PendingTransfer.poll` (the request released first)."""
        if self.live:
            return True
        if not self.transfer.poll():
            return False
        complete(self.engine.context, self.request_id)
        self.live = True
        for peer in self._idle:       # ranks that had nothing to send still learn it is done
            try:
                self.engine._agent.send_notif(peer, (_DONE + self._source_id).encode())
            except Exception:   # noqa: BLE001 - a peer gone after the transfer
                pass
        return True

    def wait(self, timeout_s: float | None = None) -> None:
        """Poll until live (bounded by the transfer's deadline, or ``timeout_s``)."""
        self.transfer.wait(timeout_s)
        self.poll()

    def cancel(self) -> None:
        """Stop the pull and release the request (zeroed first); a live one is left as it
        is."""
        if not self.live:
            self.transfer.cancel()


class ContextTransferEngine(TransferEngine):
    """A NIXL agent over one context's paged KV pool and live Mamba states.

    Parameters
    ----------
    context : DynamicInferenceContext
        Without a local block space (``num_local_blocks``). Its pool layers and live states are
        registered (``"VRAM"`` on a CUDA device, ``"DRAM"`` on the cpu device).
    name, timeout_s, backends
        As :class:`~hcache.transfer.TransferEngine`.
    tp : TensorParallelLayout, optional
        When ``context`` holds rank ``rank``'s heads: its layers must be
        ``tp.rank_config(rank)``'s. Both sides pass one, or neither.
    rank : int

    Raises
    ------
    ImportError
        NIXL is not installed.
    TypeError, ValueError
        As :func:`~hcache.transfer.paged.describe_context`; a bad ``timeout_s``.
    """

    _describe = staticmethod(describe_context)

    def __init__(self, context, name=None, *, tp=None, rank=0, timeout_s=10.0,
                 backends=("UCX",)):
        super().__init__(context, name, tp=tp, rank=rank, timeout_s=timeout_s,
                         backends=backends)
        self.context = context

    def _buffers(self):
        ctx = self.manager
        arrays = list(ctx.kv_pool.layers)
        if ctx.num_mamba_layers:
            arrays += [s for s in (ctx.mamba_conv_states, ctx.mamba_ssm_states) if s is not None]
        return [(address_of(a), int(a.nbytes)) for a in arrays if a.nbytes]

    # --- exporting side ---------------------------------------------------------------------

    def export(self, request_id: str) -> dict:
        """Offer an active request of the context (its tokens, blocks and live Mamba states)
        to peers. The caller neither steps nor releases it until :meth:`export_state` says
        ``"done"`` or ``"expired"`` (or it calls :meth:`release_export` first, which aborts
        pulls in flight). On a GPU this waits for the current stream (the request's K/V and
        states written there are final before a peer reads them). Returns the handle (a plain
        dict) to send.

        Raises
        ------
        TypeError
            ``request_id`` is not a str.
        ValueError
            ``request_id`` is not active, has a scheduled step, or is exported already.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id: expected a str, got {type(request_id).__name__}")
        tokens, blocks, slot = offer(self.context, request_id)
        if request_id in self._exports:
            raise ValueError(f"request_id: expected a request not exported yet, got "
                             f"{request_id!r}")
        settle(self.context.device)   # its K/V and states, written on this stream, are final
        return {"agent": self.name, "request_id": request_id, "slot": slot,
                "length": len(tokens), "lease_until": time.time() + self.timeout_s,
                "layout": self.layout, "blocks": blocks.tolist(), "tokens": tokens.tolist(),
                "export": self._new_export(request_id)}

    # --- receiving side ---------------------------------------------------------------------

    def pull(self, handles, request_id=None, *, salt=None, extra_keys=None,
             timeout_s: float | None = None, merge: bool = True) -> PendingContextPull:
        """Admit the request of ``handles`` and return when it is live here; see
        :meth:`begin_pull`."""
        pending = self.begin_pull(handles, request_id, salt=salt, extra_keys=extra_keys,
                                  timeout_s=timeout_s, merge=merge)
        pending.wait()
        return pending

    def begin_pull(self, handles, request_id=None, *, salt=None, extra_keys=None,
                   timeout_s: float | None = None, merge: bool = True) -> PendingContextPull:
        """Admit the request of ``handles`` (one per rank of the sending side) as
        ``request_id`` (default: the exporter's id) and start READs of what this context does
        not hold: the blocks past its own cached prefix and every live Mamba state.

        ``salt`` and ``extra_keys`` are the request's (as ``add_request`` takes them): the
        prefix match and the hashes registered when it is live use them.

        Returns
        -------
        PendingContextPull

        Raises
        ------
        TypeError, ValueError
            Bad handles (not from :meth:`export`, an unknown peer, mixed requests or tokens),
            layouts that cannot hold the same request
            (:func:`~hcache.transfer.paged.check_paged_compatible`), ``request_id`` already
            active; nothing changes.
        CacheCapacityError
            No free row, or not enough blocks even after eviction (``add_request``); nothing
            changes.
        TransferTimeout
            A handle's lease ended; nothing changes.
        TransferError
            NIXL refused to start (a peer gone): the request is released again. (Later
            failures release it too; one whose READs NIXL could not cancel keeps it parked,
            its blocks held, and says so: ``hcache.contexts.request_handoff.abandon`` releases
            it once the peer is gone.)
        """
        handles = self._check_handles(handles)
        for i, h in enumerate(handles):
            if not {"blocks", "tokens"} <= h.keys():
                raise TypeError(f"handles[{i}]: expected a handle of ContextTransferEngine."
                                f"export(), got one without blocks and tokens")
            if h["tokens"] != handles[0]["tokens"]:
                raise ValueError(f"handles[{i}]: expected the tokens of handles[0], got others")
        timeout_s = _check_timeout(timeout_s)
        source_id = handles[0]["request_id"]
        request_id = source_id if request_id is None else request_id
        tokens = np.asarray(handles[0]["tokens"], dtype=np.int64)
        n = len(tokens)
        sources = [(h["agent"], h["layout"], h["blocks"], h["slot"]) for h in handles]
        # Everything the plan checks, before the admission changes anything.
        plan_context_pull(self.layout, np.zeros(-(-n // self.layout["block_size"]), np.int64),
                          0, 0, sources, n, merge=merge)
        lease = min(h["lease_until"] for h in handles) - time.time()
        if lease <= 0:
            raise TransferTimeout(f"handles: the lease of {source_id!r} ended {-lease:.3g} s "
                                  f"ago (the exporter may reuse its blocks); nothing started")
        ctx = self.context
        step = admit_parked(ctx, request_id, tokens, salt=salt, extra_keys=extra_keys)
        settle(ctx.device)    # the admission's Mamba restore or zeroing lands before the READs
        first = step.num_matched_blocks
        try:
            plan = plan_context_pull(self.layout, step.block_ids, first, step.mamba_slot,
                                     sources, n, merge=merge)
        except Exception:
            abandon(ctx, request_id)
            raise

        def clear(released):
            zero_filled(ctx, request_id, first)
            if released:        # else NIXL may still write: the request keeps its blocks
                abandon(ctx, request_id)

        busy = {peer for peer, _ in plan}
        idle = sorted({h["agent"] for h in handles} - busy)
        transfer = self._start("READ", plan, handles, step.mamba_slot, n,
                               min(timeout_s or self.timeout_s, lease), clear=clear)
        return PendingContextPull(self, transfer, request_id, step, idle, source_id)

    def push(self, handles, slot, *, timeout_s=None):
        """Not offered for contexts: the receiving side pulls (it admits the request first)."""
        raise NotImplementedError("ContextTransferEngine.push: the receiving context pulls "
                                  "(begin_pull admits the request through its own prefix "
                                  "cache first)")

    def zero_slot(self, slot, length=None):
        """Not offered for contexts (a failed pull zeroes and releases its request)."""
        raise NotImplementedError("ContextTransferEngine.zero_slot: a failed pull zeroes "
                                  "its request's blocks and releases it")
