"""One engine's side of a cache transfer: a NIXL agent over a manager's buffers
(docs/design.md, "Transfer between engines").

A prefill engine ``export``\\ s a finished request (its slot and length) as a *handle*, a plain
dict it sends to the decode engine by its own control channel; the decode engine ``pull``\\ s
the handles of every rank of the prefill side into one of its slots (one-sided NIXL READs, one
per source rank, descriptors merged where contiguous) and continues decoding with identical
caches. ``push`` is the mirror image: the receiver exports its empty destination slot and the
sender WRITEs into it. Every finished transfer notifies the exporting side
(``hcache:done:<request>``), so it knows when the slot may be reused.

Failure contract: a transfer that errs (a peer gone), passes its deadline, is aborted by the
exporter (``release_export`` while pending) or cancelled here (``PendingTransfer.cancel``,
a request released during the transfer) raises a :class:`~hcache.transfer.errors.TransferError`
subclass, and the destination ranges are zeroed before it is raised: no partial state is
left that a caller could mistake for a request's caches. Lengths are never set by a transfer:
the caller makes the slot live (``reset_for_new_sequences``) only after ``pull`` returned.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from ._nixl import load_nixl
from .errors import TransferError, TransferTimeout
from .layout import describe_manager, kv_entries
from .pending import PendingTransfer
from .plan import plan_pull, plan_push

__all__ = ["TransferEngine", "PendingTransfer"]

_DONE, _ABORT = "hcache:done:", "hcache:abort:"
_names = itertools.count()


def _check_timeout(timeout_s):
    """``timeout_s`` (None: the engine's) as a float > 0."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not timeout_s > 0:
        raise ValueError(f"timeout_s: expected None or a number > 0, got {timeout_s!r}")
    return float(timeout_s)


def _check_int(name, value, lo, hi=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if value < lo or (hi is not None and value >= hi):
        bound = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise (IndexError if hi is not None else ValueError)(
            f"{name}: expected {bound}, got {value}")
    return value


class TransferEngine:
    """A NIXL agent that owns the registration of one manager's cache buffers.

    Parameters
    ----------
    manager : HybridCacheManager
        Its KV caches (every attention layer) and Mamba states (every Mamba layer) are
        registered: as ``"VRAM"`` on a CUDA device, ``"DRAM"`` on the cpu device.
    name : str, optional
        The agent's name (unique among the peers); default ``hcache-<n>``.
    tp : TensorParallelLayout, optional
        The model's TP layout when ``manager`` holds rank ``rank``'s shard.
    rank : int
    timeout_s : float
        Default deadline of a transfer, and the lease of an export (how long a handle may be
        pulled).
    backends : sequence of str
        NIXL backends (``"UCX"``).

    Raises
    ------
    ImportError
        NIXL is not installed.
    TypeError, ValueError
        As :func:`~hcache.transfer.layout.describe_manager`; a bad ``timeout_s``.
    """

    _describe = staticmethod(describe_manager)    # the layout a subclass registers

    def __init__(self, manager, name=None, *, tp=None, rank=0, timeout_s=10.0,
                 backends=("UCX",)):
        if _check_timeout(timeout_s) is None:
            raise ValueError("timeout_s: expected a number > 0, got None")
        layout = self._describe(manager, tp, rank)
        api = load_nixl()
        self.manager, self.layout, self.timeout_s = manager, layout, float(timeout_s)
        self.name = name if name is not None else f"hcache-{next(_names)}"
        device = manager.device
        self._mem = "VRAM" if device.is_cuda else "DRAM"
        self._dev_id = device.index if device.is_cuda else 0
        config = api.nixl_agent_config(backends=list(backends))
        self._agent = api.nixl_agent(self.name, config)
        self._registered = self._agent.register_memory(
            [(addr, n, self._dev_id, "") for addr, n in self._buffers()], self._mem)
        self._peers = {}       # peer name -> (memory type of its buffers, device id)
        self._exports = {}     # request id -> {"deadline", "done": set, "aborted": bool}
        self._aborted = {}     # (peer, request id) -> the serials of its aborted exports
        self._export_serial = 0   # each export's number: a new export of a released id is
                                  # not aborted by the abort of the old one
        self._done = {}        # request id -> peers that finished a transfer of it

    def _buffers(self):
        """(address, nbytes) of every registered buffer."""
        mgr = self.manager
        kv = mgr.kv_cache_manager
        out = [(int(layer["addr"]), int(kv.get_combined_kv_cache(a).nbytes))
               for a, layer in enumerate(self.layout["kv"])]
        mamba = mgr.mamba_cache_manager
        if mamba is not None:
            for i in range(mamba.config.num_layers):
                if mamba.config.has_recurrent_state:
                    v = mamba.get_recurrent_state(i)
                    out.append((self.layout["mamba"]["recurrent"]["addrs"][i], int(v.nbytes)))
                if mamba.config.has_conv_state:
                    v = mamba.get_conv_state(i)
                    out.append((self.layout["mamba"]["conv"]["addrs"][i], int(v.nbytes)))
        return out

    # --- peers ------------------------------------------------------------------------------

    @property
    def metadata(self) -> bytes:
        """This agent's NIXL metadata, for a peer's :meth:`connect`."""
        return self._agent.get_agent_metadata()

    def connect(self, metadata: bytes) -> str:
        """Add a peer from its :attr:`metadata` (where its caches live, DRAM or VRAM, comes
        with each of its handles). Returns the peer's name."""
        if not isinstance(metadata, (bytes, bytearray)):
            raise TypeError(f"metadata: expected bytes, got {type(metadata).__name__}")
        try:
            peer = self._agent.add_remote_agent(bytes(metadata))
        except Exception as e:   # noqa: BLE001 - NIXL's own error types
            raise ValueError(f"metadata: expected a NIXL agent's metadata, got {len(metadata)} "
                             f"bytes NIXL refused ({type(e).__name__}: {e})") from None
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        self._peers[peer] = True
        return peer

    def disconnect(self, peer: str) -> None:
        """Forget a peer (a dead one included)."""
        if self._peers.pop(peer, None) is not None:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:   # noqa: BLE001 - the peer may be gone already
                pass

    @property
    def peers(self) -> tuple:
        return tuple(self._peers)

    # --- exporting side ---------------------------------------------------------------------

    def export(self, request_id: str, slot: int, length: int) -> dict:
        """Offer the first ``length`` tokens of ``slot`` (and its Mamba states) to peers.

        The caller keeps the slot's caches unchanged until :meth:`export_state` says
        ``"done"`` or ``"expired"`` (the lease is ``timeout_s``), and for a ring layer the
        slot must hold exactly ``length`` tokens. Returns the handle (a plain dict) to send.

        Raises
        ------
        TypeError, IndexError, ValueError
            ``request_id`` not a str, ``slot`` out of range, ``length`` not in ``[1,
            max_sequence_length]``, or ``request_id`` already exported.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id: expected a str, got {type(request_id).__name__}")
        slot = _check_int("slot", slot, 0, self.layout["max_batch"])
        length = _check_int("length", length, 1)
        if length > self.layout["max_len"]:
            raise ValueError(f"length: expected <= {self.layout['max_len']} "
                             f"(max_sequence_length), got {length}")
        if request_id in self._exports:
            raise ValueError(f"request_id: expected a request not exported yet, got "
                             f"{request_id!r}")
        return {"agent": self.name, "request_id": request_id, "slot": slot, "length": length,
                "lease_until": time.time() + self.timeout_s, "layout": self.layout,
                "export": self._new_export(request_id)}

    def _new_export(self, request_id: str) -> int:
        """Book an export of ``request_id`` (its lease starts now); returns its serial."""
        self._export_serial += 1
        self._exports[request_id] = {"deadline": time.monotonic() + self.timeout_s,
                                     "done": set(), "export": self._export_serial}
        return self._export_serial

    def export_state(self, request_id: str) -> str:
        """``"pending"``, ``"done"`` (a peer finished a transfer of it) or ``"expired"`` (its
        lease ended); ``KeyError`` for a request not exported (or released)."""
        self._drain()
        record = self._exports[request_id]
        if record["done"]:
            return "done"
        return "expired" if time.monotonic() > record["deadline"] else "pending"

    def release_export(self, request_id: str) -> str:
        """Stop offering ``request_id`` (e.g. the request was released). While still pending,
        every peer is told (``hcache:abort``), so a pull of it in flight fails rather than
        return caches the slot may no longer hold. Returns the state it had."""
        state = self.export_state(request_id)
        serial = self._exports.pop(request_id)["export"]
        if state == "pending":
            for peer in self._peers:
                try:
                    self._agent.send_notif(peer, f"{_ABORT}{request_id}#{serial}".encode())
                except Exception:   # noqa: BLE001 - a dead peer pulls nothing
                    pass
        return state

    @property
    def pending_exports(self) -> tuple:
        self._drain()
        return tuple(r for r, rec in self._exports.items() if not rec["done"])

    def done_peers(self, request_id: str) -> frozenset:
        """Peers that reported a finished transfer of ``request_id`` (a pull from this
        engine, or a push into it)."""
        self._drain()
        return frozenset(self._done.get(request_id, ()))

    def _drain(self) -> None:
        """Move NIXL notifications into the books."""
        try:
            notes = self._agent.get_new_notifs()
        except Exception:   # noqa: BLE001 - nothing to read from a broken connection
            return
        for peer, messages in notes.items():
            peer = peer.decode() if isinstance(peer, bytes) else str(peer)
            for raw in messages:
                text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
                if text.startswith(_DONE):
                    rid = text[len(_DONE):]
                    self._done.setdefault(rid, set()).add(peer)
                    if rid in self._exports:
                        self._exports[rid]["done"].add(peer)
                elif text.startswith(_ABORT):
                    rid, _, serial = text[len(_ABORT):].rpartition("#")
                    self._aborted.setdefault((peer, rid), set()).add(
                        int(serial) if serial.isdigit() else None)

    def _was_aborted(self, peer, request_id, export=None) -> bool:
        """Whether ``peer`` aborted its export ``export`` of ``request_id`` (None: any)."""
        self._drain()
        serials = self._aborted.get((peer, request_id))
        return bool(serials) and (export is None or export in serials)

    # --- receiving side ---------------------------------------------------------------------

    def _check_handles(self, handles) -> list:
        if isinstance(handles, dict):
            handles = [handles]
        if not isinstance(handles, (list, tuple)) or not handles:
            raise TypeError(f"handles: expected a handle or a non-empty list of handles, got "
                            f"{type(handles).__name__}")
        for i, h in enumerate(handles):
            if not isinstance(h, dict) or not {"agent", "request_id", "slot", "length",
                                               "lease_until", "layout"} <= h.keys():
                raise TypeError(f"handles[{i}]: expected a handle from export(), got "
                                f"{type(h).__name__}")
            if h["agent"] not in self._peers:
                raise ValueError(f"handles[{i}]: expected a connected peer, got agent "
                                 f"{h['agent']!r} (connect() its metadata first)")
        rids = {h["request_id"] for h in handles}
        lengths = {h["length"] for h in handles}
        if len(rids) != 1 or len(lengths) != 1:
            raise ValueError(f"handles: expected one request and length on every rank, got "
                             f"requests {sorted(rids)} and lengths {sorted(lengths)}")
        return list(handles)

    def pull(self, handles, slot: int, *, timeout_s: float | None = None,
             merge: bool = True) -> None:
        """Fill ``slot`` with the request of ``handles`` (one per rank of the sending side,
        any TP degree) and return when its caches are here; see :meth:`begin_pull`."""
        self.begin_pull(handles, slot, timeout_s=timeout_s, merge=merge).wait()

    def begin_pull(self, handles, slot: int, *, timeout_s: float | None = None,
                   merge: bool = True):
        """Start READs of the request of ``handles`` into ``slot`` (nothing else of the
        manager changes; the caller sets the slot's length afterwards). ``merge=False``
        sends one descriptor per unit (the bench's baseline).

        Returns
        -------
        PendingTransfer

        Raises
        ------
        TypeError, IndexError, ValueError
            Bad handles (not from :meth:`export`, an unknown peer, mixed requests), ``slot``
            out of range, or layouts that cannot hold the same tokens
            (:func:`~hcache.transfer.layout.check_compatible`); nothing started.
        TransferTimeout
            A handle's lease (the exporter's ``timeout_s`` from its export, wall clock) has
            ended; nothing started. A pull's deadline is never past the lease.
        TransferError
            NIXL refused to start (a peer gone); the slot is zeroed.
        """
        handles = self._check_handles(handles)
        slot = _check_int("slot", slot, 0, self.layout["max_batch"])
        timeout_s = _check_timeout(timeout_s)
        length = handles[0]["length"]
        plan = plan_pull(self.layout, slot, [(h["agent"], h["layout"], h["slot"])
                                             for h in handles], length, merge=merge)
        lease = min(h["lease_until"] for h in handles) - time.time()
        if lease <= 0:
            raise TransferTimeout(f"handles: the lease of {handles[0]['request_id']!r} ended "
                                  f"{-lease:.3g} s ago (the exporter may reuse its slot); "
                                  f"nothing started")
        return self._start("READ", plan, handles, slot, length,
                           min(timeout_s or self.timeout_s, lease), clear=True)

    def push(self, handles, slot: int, *, timeout_s: float | None = None) -> None:
        """Write ``slot``'s first ``length`` tokens (the handles' length) into the slots
        that ``handles`` (exported by the receiving ranks) offer: the units this rank holds.
        Returns when written; raises like :meth:`begin_pull` (nothing here is zeroed: the
        receiving side owns the destination, and sees no ``done`` from this rank)."""
        handles = self._check_handles(handles)
        slot = _check_int("slot", slot, 0, self.layout["max_batch"])
        timeout_s = _check_timeout(timeout_s)
        length = handles[0]["length"]
        plan = plan_push(self.layout, slot, [(h["agent"], h["layout"], h["slot"])
                                             for h in handles], length)
        self._start("WRITE", plan, handles, slot, length, timeout_s or self.timeout_s,
                    clear=False).wait()

    def _start(self, op, plan, handles, slot, length, timeout_s, *, clear):
        request_id = handles[0]["request_id"]
        devices = {h["agent"]: str(h["layout"]["device"]) for h in handles}
        pending = PendingTransfer(self, request_id, plan, slot, length, timeout_s, op, clear)
        pending.exports = {h["agent"]: h.get("export") for h in handles}
        try:
            for peer, rows in plan:
                device = devices[peer]        # "cpu" or "cuda:N": DRAM or VRAM there
                mem = "VRAM" if device.startswith("cuda") else "DRAM"
                dev = int(device.partition(":")[2] or 0)
                local = np.stack([rows[:, 0], rows[:, 2],
                                  np.full(len(rows), self._dev_id, np.int64)], axis=1)
                remote = np.stack([rows[:, 1], rows[:, 2], np.full(len(rows), dev, np.int64)],
                                  axis=1)
                handle = self._agent.initialize_xfer(
                    op, self._agent.get_xfer_descs(local, self._mem),
                    self._agent.get_xfer_descs(remote, mem), peer,
                    (_DONE + request_id).encode())
                pending._handles.append((peer, handle))
                if self._agent.transfer(handle) == "ERR":
                    raise TransferError(f"transfer of {request_id!r} with peer {peer!r}: "
                                        f"NIXL reported an error at start")
        except TransferError as e:
            pending._fail(e)
        except Exception as e:   # noqa: BLE001 - NIXL raises its own types for a lost peer
            pending._fail(TransferError(f"transfer of {request_id!r}: NIXL failed to start "
                                        f"({type(e).__name__}: {e})"))
        return pending

    def zero_slot(self, slot: int, length: int | None = None) -> None:
        """Zero ``slot``'s first ``length`` KV entries (default: all) and its Mamba states,
        on the manager's current stream: what a failed pull leaves (exactly its units)."""
        slot = _check_int("slot", slot, 0, self.layout["max_batch"])
        length = self.layout["max_len"] if length is None else length
        kv, mamba = self.manager.kv_cache_manager, self.manager.mamba_cache_manager
        with self.manager.device.scope():
            for a, layer in enumerate(self.layout["kv"]):
                kv.get_combined_kv_cache(a)[slot, :, :, :kv_entries(layer, length)] = 0
            if mamba is not None:
                for i in range(mamba.config.num_layers):
                    if mamba.config.has_recurrent_state:
                        mamba.get_recurrent_state(i)[slot] = 0
                    if mamba.config.has_conv_state:
                        mamba.get_conv_state(i)[slot] = 0

    def close(self) -> None:
        """Deregister the buffers and forget every peer (the agent ends with this object)."""
        for peer in list(self._peers):
            self.disconnect(peer)
        if self._registered is not None:
            try:
                self._agent.deregister_memory(self._registered)
            finally:
                self._registered = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
