"""When the blocks a step completes are hashed and registered (docs/design.md §6.8).

Registering a block costs its SHA-256 and its hash-map and forest updates, 1 to 2 µs on the
host. In a decode batch that moves in lock step every request completes a block in the same
step; registering them all in that step made it many times slower than the others (batch
256, block size 16: 0.9 ms every 16th step). So :class:`BlockRegistration` keeps a backlog, a
first-in first-out queue of ``(rows, upto)`` entries (register each row through block column
``upto``). A :meth:`commit` registers ``max(budget, ceil(backlog / 8))`` blocks from its front
(whole entries, then the leading rows of the next one), only of entries queued two commits
ago or earlier: the step that completes blocks keeps their Mamba states and the next one
opens the rows' next blocks, so neither also registers them; and a backlog fed faster than
the budget still converges. Blocks are hashed when registered, each once, chained from the
row's last digest. A prompt's blocks, hashed at admission for the prefix match, cost no
SHA-256: they are registered at their step when their row has no backlog.

Every outcome that depends on registration is the outcome of registering at once:

- :meth:`flush_for_prompt`, before a prefix match, drains the queue through the last entry of
  a row the prompt could match a backlog block of (a block's hash fixes its whole prefix, so
  only a row whose registered prefix the prompt continues can hold one of its blocks);
- :meth:`flush` drains through the last entry of the rows a release drops (their blocks stay
  cached), or all of it (a release that deregisters, :meth:`computing_any`, the context's
  ``register_completed_blocks``);
- eviction keeps the registered blocks the backlog's blocks will link to, and their cached
  ancestors, as it keeps the parents of used registered blocks (:meth:`pending_parents`, read by
  the KV allocator; it hashes the backlog, but registers nothing);
- a block whose hash was deregistered after it completed was a duplicate of a registered block
  then, and stays private, as it would have (the KV allocator's deregistration observer);
- a context with a local (sliding-window) block space registers everything at every commit,
  since its commit releases the local blocks that leave the window.

``tests/test_block_registration.py`` runs a context with the smallest budget against one that
registers at once. Two things differ: between steps the registration state lags (hash maps,
``block_hashes``, forest links), and when two blocks of equal content complete at the same
step, one by a prompt and one by a decode, the prompt's serves later matches (at once, the
lower row's would).
The boundary state of a backlog block is kept at its step, before its hash is known, and becomes
reachable (and counts in ``stored_states``) when the block is registered
(``MambaSlotAllocator._settle_deferred``); when slots run short, the backlog is hashed first
(:meth:`private_blocks`) so that a duplicate, which registering at once would not store, takes
none.

Invariants (checked by :meth:`BlockRegistration.broken_invariants`): the queue holds exactly the
backlog, the computed complete blocks of each row beyond its ``registered`` count, in
increasing ``upto`` per row; ``deferred`` marks exactly their blocks; ``queued`` counts them.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat

import numpy as np

from .prefix_match import blocks_to_register, pending_blocks_overlap
from .token_batches import ragged_columns

__all__ = ["BlockRegistration", "PendingParents"]

# A commit drains at least this fraction (1/8) of the backlog, so a backlog fed faster than the
# budget converges geometrically instead of growing; it drains blocks queued this many commits
# ago or earlier.
DRAIN_FRACTION = 8
DRAIN_AGE = 2


class PendingParents:
    """What :attr:`KVBlockAllocator.pending_parents` calls: ``registration.pending_parents()``.
    A copy of the allocator (``copy.deepcopy``, pickle) keeps a snapshot of them, detached from
    the context."""

    def __init__(self, registration=None, snapshot=None):
        self._registration, self._snapshot = registration, snapshot

    def __call__(self) -> np.ndarray:
        if self._registration is None:
            return self._snapshot
        return self._registration.pending_parents()

    def __reduce__(self):
        return (PendingParents, (None, self()))


class BlockRegistration:
    """The registration backlog of a context's request table.

    Parameters
    ----------
    requests : RequestTable
    kv_block_allocator : KVBlockAllocator
    window_blocks : WindowBlocks or None
        The local block space; with one, every commit registers everything.
    mamba_slot_allocator : MambaSlotAllocator or None
    stats_owner : object, optional
        Whose ``stats`` (a ``PrefixCacheStats``) count a backlog block's Mamba state in
        ``stored_states`` when it becomes reachable (the context).
    budget : int or None
        Blocks a :meth:`commit` registers: at most ``max(budget, ceil(queued / 8))`` (at least
        one row's); None: all.

    Attributes
    ----------
    deferred : bool [num_blocks]
        The blocks in the backlog.
    queued : int
        How many there are.
    """

    def __init__(self, requests, kv_block_allocator, window_blocks, mamba_slot_allocator,
                 budget, stats_owner=None):
        self.requests, self.kv, self.window = requests, kv_block_allocator, window_blocks
        self.mamba, self._owner = mamba_slot_allocator, stats_owner
        self.budget = None if window_blocks is not None else budget
        self.deferred = np.zeros(kv_block_allocator.num_blocks, bool)
        if mamba_slot_allocator is not None:    # its states of these blocks await a hash
            mamba_slot_allocator.deferred_blocks = self.deferred
            mamba_slot_allocator.private_deferred = self.private_blocks
        kv_block_allocator.pending_parents = PendingParents(self)
        self._queue: deque = deque()     # (rows, upto, counts, commit number)
        self.queued = self._commits = 0
        self._dropped: dict = {}        # hash -> last commit count at its deregistration
        kv_block_allocator.add_blocks_deregistered_observer(self._on_deregistered)

    def reset(self) -> None:
        """Forget the backlog (the requests are gone)."""
        self._queue.clear()
        self.deferred.fill(False)
        self.queued = 0
        self._commits = 0
        self._dropped.clear()

    def commit(self, rows: np.ndarray, before: np.ndarray, ends: np.ndarray) -> int:
        """After a step of ``rows`` (ascending; ``before``: their computed tokens before it,
        ``ends``: after it): queue the blocks it completed, then register at most ``budget``
        queued blocks. Returns the number registered."""
        requests, bs = self.requests, self.requests.block_size
        if self.window is not None and len(rows):
            requests.hash_through(rows, ends // bs)
            self.window.commit(requests, rows, requests.registered[rows].copy(), ends,
                               register=requests.hashing)
        if not requests.hashing:
            return 0
        self._commits += 1
        # Only entries of two steps ago and older: the step that completes blocks keeps their
        # Mamba states, the next one opens the rows' next blocks; neither registers them too.
        registered = 0 if not self.queued else self._drain(
            None if self.budget is None else max(self.budget, -(-self.queued // DRAIN_FRACTION)),
            self._commits - DRAIN_AGE)
        upto = ends // bs
        grew = upto > before // bs
        if not grew.any():
            return registered
        rows, upto = rows[grew], upto[grew]
        first = np.maximum(before[grew] // bs, requests.registered[rows])   # matched run ahead
        grew = upto > first
        if grew.any():
            rows, first, upto = rows[grew], first[grew], upto[grew]
            if self.budget is None:         # everything now, rows ascending
                return registered + self._register(rows, upto)
            # A prompt's blocks (hashed at admission: no SHA-256 to spread) of a row without
            # a backlog are registered at once.
            now = (requests.hashed[rows] >= upto) & (requests.registered[rows] == first)
            if now.any():
                registered += self._register(rows[now], upto[now])
            if not now.all():
                self._enqueue(rows[~now], first[~now], upto[~now])
        return registered

    def _enqueue(self, rows: np.ndarray, first: np.ndarray, upto: np.ndarray) -> None:
        """Queue blocks ``[first, upto)`` of distinct ``rows`` and mark them deferred."""
        table, counts = self.requests.request_to_kv_block_ids, upto - first
        if counts.max() == 1:
            self.deferred[table[rows, first]] = True
            self._queue.append((rows, upto, None, self._commits))     # None: one block each
            self.queued += len(rows)
        else:
            which, cols = ragged_columns(first, counts)
            self.deferred[table[rows[which], cols]] = True
            self._queue.append((rows, upto, counts, self._commits))
            self.queued += int(counts.sum())

    def flush(self, rows=None) -> int:
        """Register the backlog through the last entry holding one of ``rows`` (default:
        all of it). Returns the number registered."""
        if not self.queued:
            return 0
        if rows is None:
            return self._drain(None)
        marked = np.zeros(self.requests.max_requests, bool)
        marked[rows] = True
        last = -1
        for i, (entry_rows, *_) in enumerate(self._queue):
            if marked[entry_rows].any():
                last = i
        if last < 0:
            return 0
        return self._drain(sum(len(rows) if counts is None else int(counts.sum())
                               for rows, _, counts, _ in list(self._queue)[:last + 1]))

    def flush_for_prompt(self, prompt_hashes: list) -> int:
        """:meth:`flush` the rows that could hold a backlog block of a prompt whose complete
        blocks hash to ``prompt_hashes``: those whose registered prefix it continues."""
        if not self.queued or not prompt_hashes:
            return 0
        requests = self.requests
        rows = np.flatnonzero(requests.registered < requests.computed // requests.block_size)
        done = requests.registered[rows]
        rows, done = rows[done < len(prompt_hashes)], done[done < len(prompt_hashes)]
        if not len(rows):
            return 0
        prompt = np.asarray(prompt_hashes, dtype=np.int64)
        last = np.maximum(done - 1, 0)
        continues = (done == 0) | (prompt[last] == requests.hashes[rows, last])
        return self.flush(rows[continues]) if continues.any() else 0

    def pending_parents(self) -> np.ndarray:
        """The registered blocks that the backlog's blocks will link to (int64): the block
        registered under the predecessor hash of each backlog block that will register. Eviction
        keeps them, and their cached ancestors, as it keeps the parents of used registered
        blocks (the backlog is hashed for it, each block once, as always)."""
        owners, cols, _, hashes, private = self._backlog()
        keep = ~private & (cols > 0)
        parents = self.requests.hashes[owners[keep], cols[keep] - 1].tolist()
        get = self.kv.kv_hash_to_block_id.get
        out = np.fromiter(map(get, parents, repeat(-1)), np.int64, len(parents))
        return out[out >= 0]

    def private_blocks(self) -> np.ndarray:
        """The backlog blocks (int64) that will stay private when registered: registering at
        once, they were duplicates (see :meth:`_backlog`), so they keep no Mamba state."""
        _, _, blocks, _, private = self._backlog()
        return blocks[private]

    def _backlog(self):
        """``(rows, columns, blocks, hashes, private)`` of every backlog block in registration
        order, hashed now; ``private``: a duplicate of a registered block, of an earlier backlog
        block, or of a block dropped since it completed."""
        requests, parts = self.requests, []
        for rows, upto, counts, commit in self._queue:
            requests.hash_through(rows, upto)
            if counts is None:
                owners, cols = rows, upto - 1
            else:
                which, cols = ragged_columns(upto - counts, counts)
                owners = rows[which]
            parts.append((owners, cols, np.full(len(cols), commit)))
        if not parts:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty, empty, np.zeros(0, bool)
        owners, cols, commits = (np.concatenate(x) for x in zip(*parts))
        hashes = requests.hashes[owners, cols]
        listed = hashes.tolist()
        registered, seen, dropped = self.kv.kv_hash_to_block_id, {}, self._dropped
        private = np.fromiter((h in registered or seen.setdefault(h, i) != i
                               or dropped.get(h, -1) >= c
                               for i, (h, c) in enumerate(zip(listed, commits.tolist()))),
                              bool, len(listed))
        blocks = requests.request_to_kv_block_ids[owners, cols].astype(np.int64)
        return owners, cols, blocks, hashes, private

    def _on_deregistered(self, block_ids, hashes) -> None:
        """Observer of the KV allocator: remember when the hashes left the map, while blocks
        that completed earlier may still duplicate them."""
        if self.queued:
            self._dropped.update(dict.fromkeys(hashes, self._commits))

    def computing_any(self, hashes: list) -> bool:
        """Whether a block of ``hashes`` is not registered but a scheduled step is computing
        it (after catching up: the backlog is registered, the scheduled blocks hashed)."""
        self.flush()
        requests = self.requests
        rows = np.flatnonzero(requests.pending_end >= 0)
        requests.hash_through(rows, requests.lengths[rows] // requests.block_size)
        return pending_blocks_overlap(set(hashes).difference(self.kv.kv_hash_to_block_id),
                                      requests)

    def _drain(self, limit, last_commit=None) -> int:
        """Register queued entries from the front, at most ``limit`` blocks (None: all) but at
        least the first row's, and only those queued by commit ``last_commit`` or earlier
        (None: any)."""
        taken = 0
        registered = 0
        while self._queue and (limit is None or taken < limit):
            rows, upto, counts, commit = self._queue[0]
            if last_commit is not None and commit > last_commit:
                break
            total = len(rows) if counts is None else int(counts.sum())
            if limit is not None and taken + total > limit:
                k = limit - taken if counts is None else \
                    max(1, int(np.searchsorted(np.cumsum(counts), limit - taken, "right")))
                if k < len(rows):
                    rest = None if counts is None else counts[k:]
                    self._queue[0] = (rows[k:], upto[k:], rest, commit)
                    rows, upto = rows[:k], upto[:k]
                    counts = None if counts is None else counts[:k]
                    total = k if counts is None else int(counts.sum())
                else:
                    self._queue.popleft()
            else:
                self._queue.popleft()
            taken += total
            self.queued -= total
            registered += self._register(rows, upto, counts is None, commit)
        if not self.queued:
            self._dropped.clear()
        return registered

    def _register(self, rows: np.ndarray, upto: np.ndarray, single=False, commit=None) -> int:
        """Hash and register blocks ``[registered, upto)`` of distinct ``rows`` (``single``: one
        each), completed at commit ``commit`` (None: the current one)."""
        requests, kv = self.requests, self.kv
        if single and not self._dropped:
            cols = upto - 1
            if (requests.hashed[rows] == cols).all():     # a decode step's: one new block each
                hashes = requests.hash_next(rows, cols)
                parents = np.where(cols > 0, requests.hashes[rows, cols - 1], 0)
                ids = requests.request_to_kv_block_ids[rows, cols].astype(np.int64)
                listed = hashes.tolist()
                if kv.kv_hash_to_block_id.keys().isdisjoint(listed) \
                        and len(set(listed)) == len(listed):
                    requests.registered[rows] = upto
                    kv._register_new_blocks(ids, hashes, parents)
                    return self._settle(ids, hashes, len(ids))
        requests.hash_through(rows, upto)
        ids, hashes, parents, drained, drained_hashes = blocks_to_register(
            requests, rows, upto * requests.block_size, kv.kv_hash_to_block_id)
        if self._dropped and len(ids):
            # A hash deregistered since these blocks completed was registered then: registering
            # at once would have left them private, so they stay private.
            at = self._commits if commit is None else commit
            fresh = np.fromiter((self._dropped.get(h, -1) < at for h in hashes.tolist()), bool,
                                len(hashes))
            ids, hashes, parents = ids[fresh], hashes[fresh], parents[fresh]
        if len(ids):
            kv._register_new_blocks(ids, hashes, parents)
        return self._settle(drained, drained_hashes, len(ids))

    def _settle(self, drained: np.ndarray, hashes: np.ndarray, registered: int) -> int:
        """The ``drained`` blocks (``hashes``) left the backlog: unmark them and settle the
        Mamba states awaiting them; returns ``registered``."""
        self.deferred[drained] = False
        if self.mamba is not None:
            reachable = self.mamba._settle_deferred(drained, hashes)
            if reachable and self._owner is not None:
                self._owner.stats.stored_states += reachable
        return registered

    def broken_invariants(self) -> list[str]:
        """Every broken invariant (see the module docstring); empty when all hold."""
        requests, bs = self.requests, self.requests.block_size
        if not requests.hashing:
            return [] if not self._queue and not self.queued else ["a backlog without hashing"]
        expected = np.zeros_like(self.deferred)
        reach = requests.registered.copy()
        total = 0
        for rows, upto, counts, _ in self._queue:
            counts = np.ones(len(rows), np.int64) if counts is None else counts
            if (upto <= reach[rows]).any() or (counts != upto - reach[rows]).any():
                return ["a registration entry does not extend its rows' backlog"]
            which, cols = ragged_columns(reach[rows], counts)
            expected[requests.request_to_kv_block_ids[rows[which], cols]] = True
            total += int(counts.sum())
            reach[rows] = upto
        problems = []
        if (reach != np.maximum(requests.registered, requests.computed // bs)).any():
            problems.append("the registration queue does not cover the backlog")
        if (expected != self.deferred).any():
            problems.append("deferred blocks are not the backlog's blocks")
        if total != self.queued:
            problems.append(f"{self.queued} blocks counted queued, {total} in the queue")
        return problems
