"""The request table of :class:`~hcache.contexts.DynamicInferenceContext` (docs/design.md §6).

A request lives in one row of host arrays indexed by row, so a step over many requests is a few
NumPy operations rather than a Python loop: its tokens (a preallocated
``[max_requests, max_sequence_length]`` table that grows without copying), its progress
counters, its block-table row, and the chained hashes of its complete blocks, each computed
once (:func:`~hcache.contexts.block_hashing.chain_block_hashes`, continuing from the row's last
digest): a prompt's at admission, for the prefix match; a block completed by a step when its
registration needs it (:meth:`RequestTable.hash_through`, see
:mod:`~hcache.contexts.block_registration`).

Invariants (checked by :meth:`RequestTable.broken_invariants`), for an active row ``r``:

- ``computed <= lengths``; ``pending_end`` is -1 (then ``computed == lengths``) or
  ``lengths`` (a step is scheduled over ``[computed, lengths)``);
- ``num_blocks == ceil(lengths / block_size)`` and ``request_to_kv_block_ids[r]`` holds that
  many block ids, then -1; ``registered <= hashed <= lengths // block_size``;
- with hashing on, ``hashes[r, :hashed]`` are the chained hashes of the row's tokens (under
  its salt and extra keys) and ``digests[r]`` is the digest of block ``hashed - 1`` (the
  chain's root when none); ``pending_key_cols[r]`` is the column of its keyed block not hashed
  yet (only a prompt's partial tail block can be one), else -1;
- rows and live slots of no request are on the free lists, and their table entries are -1.
"""

from __future__ import annotations

import numpy as np

from .._checks import host_array, is_array
from .block_hashing import DIGEST_BYTES, chain_block_hashes, chain_cells, chain_listed
from .request_invariants import broken_request_invariants
from .scalar_views import ScalarViews
from .step_plans import PrefixCacheStats
from .token_batches import ragged_columns

__all__ = ["RequestTable"]

# Up to this many rows get a decode step's new blocks one by one (cheaper than a scatter).
_FEW_ROWS = 16


class RequestTable:
    """The active requests of a context, one row each, and the host tables the allocators
    read.

    Parameters
    ----------
    max_requests, max_blocks_per_request, block_size : int
    hashing : bool
        Whether complete blocks are hashed (prefix caching on).

    Attributes
    ----------
    request_to_kv_block_ids : int32 [max_requests, max_blocks_per_request]
        Block table: row -> the request's block ids; -1 = none.
    request_to_mamba_state_idx : int32 [max_requests]
        Row -> live Mamba slot; -1 = none.
    tokens : int64 [max_requests, max_sequence_length]
        Row -> tokens (``lengths`` of them are valid). Allocated zeroed, so on most systems its
        pages are only committed as rows grow.
    lengths, num_blocks, computed, pending_end, kv_cached, registered, hashed : int64 [R]
        Per row: tokens held, blocks held, tokens computed (KV and Mamba state final), the end
        of the scheduled step (-1 = none), positions below which the blocks are shared
        (matched) ones, leading blocks already offered for registration, leading blocks hashed.
    hashes : int64 [max_requests, max_blocks_per_request]
        Chained hashes of each row's first ``hashed`` blocks.
    digests : uint8 [max_requests, 32]
        Digest of each row's last hashed block (its chain's root before the first).
    salts : list of (bytes or None) [max_requests]
        Each row's salt (docs/design.md §6.1).
    keys : list of dict [max_requests]
        Each row's encoded extra keys by block column (see :func:`.block_hashing.block_keys`).
    pending_key_cols : int64 [max_requests]
        The column of each row's keyed block not hashed yet; -1 = none.
    parked : bool [max_requests]
        Rows whose scheduled prompt a transfer fills (``hcache.contexts.request_handoff``).
    """

    def __init__(self, max_requests: int, max_blocks_per_request: int, block_size: int, *,
                 hashing: bool):
        R, B = max_requests, max_blocks_per_request
        self.max_requests, self.block_size, self.hashing = R, block_size, hashing
        self.max_sequence_length = B * block_size
        self.request_to_kv_block_ids = np.full((R, B), -1, dtype=np.int32)
        self.request_to_mamba_state_idx = np.full(R, -1, dtype=np.int32)
        self.tokens = np.zeros((R, self.max_sequence_length), dtype="<i8")
        self.hashes = np.zeros((R, B), dtype=np.int64)
        self.digests = np.zeros((R, DIGEST_BYTES), dtype=np.uint8)
        for name in ("lengths", "num_blocks", "computed", "pending_end", "kv_cached",
                     "registered", "hashed"):
            setattr(self, name, np.zeros(R, dtype=np.int64))
        self.salts: list = [None] * R
        self.keys: list = [{} for _ in range(R)]
        self.pending_key_cols = np.full(R, -1, dtype=np.int64)
        self._pending_keys = 0                  # rows with a pending key column
        self.parked = np.zeros(R, dtype=bool)   # filled by a transfer: no step completes it
        self._row_of: dict = {}                 # request id -> row, in admission order
        self._id_of: list = [None] * R
        self._stats: list = [None] * R          # admission counters
        self._seen = np.zeros(R, dtype=np.int64)   # scratch of the duplicate check
        self._order = np.arange(R)
        # The last distinct batch of ids looked up, valid while no request came or went.
        self._version, self._last_version, self._last_ids, self._last_rows = 0, -1, None, None
        self._scalars = ScalarViews(("tokens",), tokens=self.tokens, digests=self.digests,
                                    hashes=self.hashes, hashed=self.hashed, held=self.num_blocks,
                                    table=self.request_to_kv_block_ids)
        self.reset()

    def reset(self) -> None:
        """Forget every request; every row and live slot is free."""
        self._version += 1
        self._row_of.clear()
        self._id_of[:] = [None] * self.max_requests
        self.salts[:] = [None] * self.max_requests
        self.keys[:] = [{} for _ in range(self.max_requests)]
        self.pending_key_cols.fill(-1)
        self._pending_keys = 0
        self.parked.fill(False)
        self.request_to_kv_block_ids.fill(-1)
        self.request_to_mamba_state_idx.fill(-1)
        self.pending_end.fill(-1)
        for a in (self.lengths, self.num_blocks, self.computed, self.kv_cached,
                  self.registered, self.hashed):
            a.fill(0)
        self._free_rows = list(range(self.max_requests - 1, -1, -1))   # pop(): lowest row first
        self._free_live_slots = list(range(self.max_requests))         # pop(): highest first

    # --- lookups --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, request_id) -> bool:
        return request_id in self._row_of

    @property
    def ids(self) -> list:
        """Active request ids in admission order."""
        return list(self._row_of)

    @property
    def has_free_row(self) -> bool:
        return bool(self._free_rows)

    @property
    def has_pending_keys(self) -> bool:
        """Whether a row's keyed block waits to be hashed (:attr:`pending_key_cols`)."""
        return self._pending_keys > 0

    def id_of(self, row: int):
        return self._id_of[row]

    def row(self, request_id, name: str = "request_id") -> int:
        """The row of an active request.

        Raises
        ------
        TypeError
            ``request_id`` is not hashable.
        ValueError
            No active request has this id.
        """
        try:
            return self._row_of[request_id]
        except TypeError:
            raise TypeError(f"{name}: expected a hashable id, "
                            f"got {type(request_id).__name__}") from None
        except KeyError:
            raise ValueError(f"{name}: expected an active request, got {request_id!r}") \
                from None

    def rows(self, request_ids, name: str = "request_ids", *, distinct: bool = True):
        """The rows of active requests, ``int64 [n]``, in the order given.

        Raises
        ------
        TypeError
            ``request_ids`` is not a sequence, or an id is not hashable.
        ValueError
            An id is not active, or (``distinct``) appears twice.
        """
        listed = type(request_ids) is list
        if listed:
            if distinct and self._last_version == self._version \
                    and self._same_as_last(request_ids):
                return self._last_rows.copy()   # the previous batch again, no admission between
        elif is_array(request_ids):   # ids in an array of any library
            request_ids = host_array(name, request_ids)
        elif isinstance(request_ids, (str, bytes)) or not hasattr(request_ids, "__len__"):
            raise TypeError(f"{name}: expected a sequence of request ids, "
                            f"got {type(request_ids).__name__}")
        try:
            rows = np.fromiter(map(self._row_of.__getitem__, request_ids), np.int64,
                               len(request_ids))
        except (KeyError, TypeError):
            for i, rid in enumerate(request_ids):
                self.row(rid, f"{name}[{i}]")
            raise
        if distinct and len(rows) > 1:
            n, seen = len(rows), self._seen
            order = self._order[:n] if n <= self.max_requests else np.arange(n)
            seen[rows] = order      # a repeated row keeps its last position only
            if np.count_nonzero(seen[rows] != order):
                rid = request_ids[int(np.argmax(seen[rows] != order))]
                raise ValueError(f"{name}: expected distinct request ids, got {rid!r} twice")
        if listed and distinct:
            self._last_ids, self._last_rows = list(request_ids), rows.copy()
            self._last_version = self._version
        return rows

    def _same_as_last(self, request_ids: list) -> bool:
        """Whether ``request_ids`` are the last batch's, element by element; an id that compares
        ambiguously (an array) is not: the full lookup checks it."""
        try:
            return request_ids == self._last_ids
        except (TypeError, ValueError):
            return False

    def stats(self, row: int) -> PrefixCacheStats:
        """The counters of the request in ``row`` (a copy)."""
        out = PrefixCacheStats(**vars(self._stats[row]))
        # Every step schedules [computed, lengths): all but the skipped prompt tokens.
        out.computed_tokens = int(self.lengths[row]) - out.skipped_tokens
        return out

    def blocks(self, row: int) -> np.ndarray:
        """The row's block ids, ``int32 [num_blocks]`` (a copy)."""
        return self.request_to_kv_block_ids[row, :self.num_blocks[row]].copy()

    # --- commands -------------------------------------------------------------------------------

    def admit(self, request_id, tokens: np.ndarray, matched: list, new: np.ndarray,
              hashes: np.ndarray, digest: bytes, *, kv_cached: int, registered: int,
              computed: int, stats: PrefixCacheStats, salt: bytes | None = None,
              keys: dict | None = None) -> int:
        """Take the lowest free row and a free live slot for a new request (the caller checked
        :attr:`has_free_row`) and fill them; returns the row. Its blocks are the ``matched``
        ones, then ``new``; ``hashes`` / ``digest`` (bytes) are the hashes of the complete
        blocks of ``tokens`` and the last one's digest (the chain's root when none), under
        ``salt`` and the encoded extra ``keys`` by block (ignored without hashing)."""
        row, slot = self._free_rows.pop(), self._free_live_slots.pop()
        self._version += 1
        n, m, nb = len(tokens), len(matched), len(matched) + len(new)
        self.tokens[row, :n] = tokens
        self.lengths[row], self.num_blocks[row], self.computed[row] = n, nb, computed
        self.pending_end[row] = -1
        self.kv_cached[row], self.registered[row] = kv_cached, registered
        table = self.request_to_kv_block_ids[row]
        if m:
            table[:m] = matched
        table[m:nb] = new
        self.request_to_mamba_state_idx[row] = slot
        if self.hashing:
            self.hashes[row, :len(hashes)] = hashes
            self._scalars.digests[DIGEST_BYTES * row:DIGEST_BYTES * (row + 1)] = digest
            self.hashed[row] = len(hashes)
            self.salts[row], self.keys[row] = salt, dict(keys or {})
            tail = len(hashes)   # a key of the partial tail block waits for it to complete
            if tail in self.keys[row]:
                self.pending_key_cols[row] = tail
                self._pending_keys += 1
        self._row_of[request_id], self._id_of[row], self._stats[row] = row, request_id, stats
        return row

    def add_blocks(self, rows: np.ndarray, counts: np.ndarray, block_ids: np.ndarray) -> None:
        """Append ``counts[i]`` blocks of ``block_ids`` (in order) to the table row of
        ``rows[i]`` (``counts`` may be a bool mask: one block for each row it marks)."""
        if counts.dtype == np.bool_:
            rows = rows[counts]
            if len(rows) > _FEW_ROWS:
                self.request_to_kv_block_ids[rows, self.num_blocks[rows]] = block_ids
                self.num_blocks[rows] += 1
                return
            views, width = self._scalars, self.request_to_kv_block_ids.shape[1]
            table, held = views.table, views.held
            for row, block in zip(rows.tolist(), block_ids.tolist()):
                n = held[row]
                table[row * width + n], held[row] = block, n + 1
            return
        which, cols = ragged_columns(self.num_blocks[rows], counts)
        self.request_to_kv_block_ids[rows[which], cols] = block_ids
        self.num_blocks[rows] += counts

    def append(self, rows: np.ndarray, flat: np.ndarray, counts, starts: np.ndarray,
               ends: np.ndarray) -> None:
        """Append tokens to distinct ``rows`` holding ``starts`` tokens, ``ends - starts``
        each, from ``flat`` (one each when ``counts`` is None). The caller checked the room;
        the blocks they complete are hashed later (:meth:`hash_through`)."""
        if counts is None:
            self.tokens[rows, starts] = flat
        else:
            which, cols = ragged_columns(starts, counts)
            self.tokens[rows[which], cols] = flat
        self.lengths[rows] = ends

    def hash_through(self, rows: np.ndarray, upto: np.ndarray) -> None:
        """Hash the complete blocks ``[hashed, upto)`` of distinct ``rows`` (``upto`` at most
        their complete blocks), each once, chained from the row's last digest."""
        if not self.hashing or not len(rows):
            return
        first = self.hashed[rows]
        grew = upto > first
        if not grew.all():
            if not grew.any():
                return
            rows, first, upto = rows[grew], first[grew], upto[grew]
        counts = upto - first
        self._hash_new_blocks(rows, first, None if counts.max() == 1 else counts)
        self.hashed[rows] = upto

    def hash_next(self, rows: np.ndarray, cols: np.ndarray) -> tuple[list, list]:
        """Hash block ``cols[i] == hashed`` of distinct ``rows`` (complete) in one pass over
        bytes; returns the hashes and the previous blocks' (lists; column 0: no block's)."""
        blocks = self.tokens.reshape(self.max_requests, -1, self.block_size)[rows, cols]
        keys = self._pending_keys and self._take_pending_keys(rows, cols)
        hashes, lasts, parents = chain_listed(self.digests[rows].tobytes(), blocks.tobytes(),
                                              8 * self.block_size, keys)
        self.hashes[rows, cols] = hashes
        self.digests[rows] = np.frombuffer(lasts, np.uint8).reshape(-1, DIGEST_BYTES)
        self.hashed[rows] = cols + 1
        return hashes, parents

    def hash_next_listed(self, cells: list, ids: list, hashes: list, parents: list) -> None:
        """:meth:`hash_next` of a few ``(row, col)`` cells on scalars (no row waiting for an
        extra key), appending each block's id, hash and parent hash (0 at column 0) to ``ids``,
        ``hashes``, ``parents``."""
        views, width, step = self._scalars, self.hashes.shape[1], 8 * self.block_size
        new = chain_cells(views.digests, views.tokens, cells, step, step * width)
        table, chained, hashed = views.table, views.hashes, views.hashed
        for (r, c), h in zip(cells, new):
            at = r * width + c
            chained[at], hashed[r] = h, c + 1
            ids.append(table[at])
            parents.append(chained[at - 1] if c else 0)     # the hash of the row's digest
        hashes += new

    def _hash_new_blocks(self, rows, first, counts) -> np.ndarray:
        """Hash blocks ``[first[i], first[i] + counts[i])`` (one each when ``counts`` is
        None) of distinct ``rows``, chained from each row's last digest; returns the hashes."""
        if counts is None:
            owners, cols = rows, first
        else:
            which, cols = ragged_columns(first, counts)
            owners = rows[which]
        blocks = self.tokens.reshape(self.max_requests, -1, self.block_size)[owners, cols]
        chains = None if counts is None or len(cols) == len(rows) else counts
        keys = self._take_pending_keys(owners, cols) if self._pending_keys else None
        hashes, digests = chain_block_hashes(self.digests[rows], blocks, chains, keys)
        self.hashes[owners, cols] = hashes
        self.digests[rows] = digests if chains is None else digests[np.cumsum(counts) - 1]
        return hashes

    def _take_pending_keys(self, owners: np.ndarray, cols: np.ndarray) -> dict:
        """The encoded keys of the blocks ``(owners[i], cols[i])`` that wait for one, by
        ``i`` (they stop waiting: :attr:`pending_key_cols` -1)."""
        hits = np.flatnonzero(self.pending_key_cols[owners] == cols)
        self.pending_key_cols[(taken := owners[hits])] = -1
        self._pending_keys -= len(hits)
        return dict(zip(hits.tolist(), map(lambda r, c: self.keys[r][c], taken.tolist(),
                                           cols[hits].tolist())))

    def complete_steps(self):
        """Mark every scheduled step but a parked row's computed; returns its ``rows``
        (ascending) and their computed tokens before and after, int64 arrays."""
        on = self.pending_end >= 0    # (the mask of parked rows only when there are some)
        rows = (on & ~self.parked if np.count_nonzero(self.parked) else on).nonzero()[0]
        ends, before = self.pending_end[rows], self.computed[rows]    # (copies)
        self.computed[rows], self.pending_end[rows] = ends, -1
        return rows, before, ends

    def schedule(self, rows, ends) -> None:
        """Schedule ``[computed, ends)`` of ``rows``, ``ends`` being their lengths."""
        self.pending_end[rows] = ends

    def release(self, rows) -> None:
        """Forget the requests of ``rows``: clear their table rows, free rows and live slots."""
        self._version += 1
        for row in rows:
            self._free_rows.append(row)
            self._free_live_slots.append(int(self.request_to_mamba_state_idx[row]))
            del self._row_of[self._id_of[row]]
            self._id_of[row] = self._stats[row] = self.salts[row] = None
            self.keys[row] = {}
            self._pending_keys -= int(self.pending_key_cols[row] >= 0)
            self.pending_key_cols[row] = -1
        rows = rows[0] if len(rows) == 1 else np.array(rows, np.intp)   # for the ten writes
        self.request_to_kv_block_ids[rows] = -1
        self.request_to_mamba_state_idx[rows] = -1
        self.pending_end[rows] = -1
        self.parked[rows] = False
        for a in (self.lengths, self.num_blocks, self.computed, self.kv_cached,
                  self.registered, self.hashed):
            a[rows] = 0

    # --- checks ---------------------------------------------------------------------------------

    def broken_invariants(self) -> list[str]:
        """Every broken invariant (see the module docstring); empty when all hold. Rehashes
        every row's tokens: a check for tests, not for steps."""
        return broken_request_invariants(self)
