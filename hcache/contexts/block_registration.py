"""When the blocks a step completes are hashed and registered: docs/design.md §6.8 is the
contract (why a backlog, what a commit drains, why every outcome is registering at once's).

:class:`BlockRegistration` keeps a backlog, a first-in first-out queue of ``(rows, upto)``
entries (register each row through block column ``upto``). A :meth:`commit` registers a small
step at once (with the backlog, at most ``budget / 4`` blocks: the backlog first), else queues
it, and works on entries queued two commits ago or earlier, on ``max(budget, ceil(backlog /
8))`` blocks: it registers the hashed front or hashes that many. A prompt's blocks (hashed at
admission) register at their step, first (with no backlog, the usual step on Python lists:
:func:`~.step_registration.register_step`). The :meth:`flush` family, :meth:`pending_parents`
and :meth:`private_blocks` keep every outcome that of registering at once
(``tests/test_block_registration.py`` runs budgets against ``budget=None``).

Invariants (checked by :meth:`BlockRegistration.broken_invariants`): the queue holds exactly the
backlog, the computed complete blocks of each row beyond its ``registered`` count, in
increasing ``upto`` per row; ``deferred`` marks exactly their blocks; ``queued`` counts them.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat

import numpy as np

from .backlog_duplicates import (
    PendingParents,
    backlog_blocks,
    entangled_rows,
    mark_rows_of,
    prune_dropped,
)
from .prefix_match import blocks_to_register, pending_blocks_overlap
from .step_registration import register_step
from .token_batches import ragged_columns

__all__ = ["BlockRegistration", "PendingParents"]

# A commit drains at least this fraction (1/8) of the backlog, so a backlog fed faster than the
# budget converges geometrically instead of growing; it drains blocks queued this many commits
# ago or earlier.
DRAIN_FRACTION = 8
DRAIN_AGE = 2
# A step whose blocks and the backlog number at most budget / 4 registers them all at once, the
# backlog first (a serving load completes a few blocks on every step: queuing them cost more in
# bookkeeping, the duplicate analysis at each eviction and deferred Mamba states, than it spread).
AT_ONCE_FRACTION = 4
# Beyond this many rows that could hold duplicates, all of the backlog is hashed to find them.
ENTANGLED_ROWS = 16


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
        Blocks a :meth:`commit` hashes or registers: ``max(budget, ceil(queued / 8))``; None:
        all, at once.

    Attributes
    ----------
    deferred : bool [num_blocks]
        The blocks in the backlog.
    queued : int
        How many there are.
    marked : bool [max_requests]
        Rows whose backlog may hold a duplicate of a hash dropped since: their last registered
        block lost a child, or any backlog row when a dangling root existed (docs/design.md §6.8).
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
        kv_block_allocator.pending_parents = watch = PendingParents(self)
        kv_block_allocator.deregistering = watch.deregistering
        self.marked = np.zeros(requests.max_requests, bool)
        self._scratch = np.zeros(kv_block_allocator.num_blocks, bool)
        self._queue: deque = deque()     # (rows, upto, counts, commit number)
        self.queued = self._commits = 0
        self._dropped: dict = {}        # hash -> last commit count at its deregistration
        self._drop_log: deque = deque()     # (commit count, hashes) in deregistration order
        self.prune_dropped = True       # False: keep every drop until the backlog drains

    def reset(self) -> None:
        """Forget the backlog (the requests are gone)."""
        self._queue.clear()
        self.deferred.fill(False)
        self.queued = self._commits = 0
        self._dropped.clear()
        self._drop_log.clear()
        self.marked.fill(False)

    def commit(self, rows: np.ndarray, before: np.ndarray, ends: np.ndarray) -> int:
        """After a step of ``rows`` (ascending; ``before``: their computed tokens before it,
        ``ends``: after it): register or queue the blocks it completed, and work on the
        backlog. Returns the number registered."""
        requests, bs = self.requests, self.requests.block_size
        if self.window is not None and len(rows):
            requests.hash_through(rows, ends // bs)
            self.window.commit(requests, rows, requests.registered[rows], ends,
                               register=requests.hashing)
        if not requests.hashing:
            return 0
        self._commits += 1
        if not (self.queued or self._dropped):      # no backlog: the usual serving step
            done = register_step(requests, self.kv, rows, ends,
                                 self.budget and self.budget // AT_ONCE_FRACTION)
            if done is not None:
                return done
        # Only entries of two steps ago and older: the step that completes blocks keeps their
        # Mamba states, the next one opens the rows' next blocks; neither registers them too.
        registered = 0 if not self.queued else self._advance(
            None if self.budget is None else max(self.budget, -(-self.queued // DRAIN_FRACTION)),
            self._commits - DRAIN_AGE)
        upto = ends // bs
        grew = upto > before // bs
        if not np.count_nonzero(grew):
            return registered
        rows, upto = rows[grew], upto[grew]
        first = np.maximum(before[grew] // bs, requests.registered[rows])   # matched run ahead
        grew = upto > first
        if np.count_nonzero(grew):
            rows, first, upto = rows[grew], first[grew], upto[grew]
            # A prompt's blocks (hashed at admission: no SHA-256 to spread) of a row without
            # a backlog are registered at once.
            now = (requests.hashed[rows] >= upto) & (requests.registered[rows] == first)
            taken = np.count_nonzero(now)
            if taken:
                registered += self._register(rows[now], upto[now])
            if taken < len(now):
                rows, first, upto = rows[~now], first[~now], upto[~now]
                if self.budget is None or self.queued + int((upto - first).sum()) \
                        <= self.budget // AT_ONCE_FRACTION:
                    registered += self._drain(None) if self.queued else 0
                    single = not np.count_nonzero(upto - first != 1)
                    registered += self._register(rows, upto, single, deferred=False)
                else:
                    self._enqueue(rows, first, upto)
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
        """Register the backlog through the last entry holding one of ``rows`` (default: all);
        returns the number registered."""
        if not self.queued or rows is None:
            return self._drain(None) if self.queued else 0
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

    def flush_for_prompt(self, prompt_hashes: np.ndarray) -> int:
        """:meth:`flush` the rows that could hold a backlog block of a prompt whose complete
        blocks hash to ``prompt_hashes`` (int64): those whose registered prefix it continues."""
        if not self.queued or not len(prompt_hashes):
            return 0
        requests = self.requests
        rows = np.flatnonzero(requests.registered < requests.computed // requests.block_size)
        done = requests.registered[rows]
        rows, done = rows[done < len(prompt_hashes)], done[done < len(prompt_hashes)]
        last = np.maximum(done - 1, 0)
        continues = (done == 0) | (prompt_hashes[last] == requests.hashes[rows, last])
        return self.flush(rows[continues]) if continues.any() else 0

    def pending_parents(self) -> np.ndarray:
        """The registered blocks that the backlog's blocks will link to (int64): the block
        registered under the predecessor hash of each backlog block that will register. Eviction
        keeps them, and their cached ancestors, as it keeps the parents of used registered
        blocks (what it needs of the backlog is hashed for it, each block once, as always)."""
        if not self.queued:
            return np.zeros(0, np.int64)
        owners, cols, _, hashes, private = self._backlog()
        keep = ~private & (cols > 0)
        parents = self.requests.hashes[owners[keep], cols[keep] - 1].tolist()
        get = self.kv.kv_hash_to_block_id.get
        out = np.fromiter(map(get, parents, repeat(-1)), np.int64, len(parents))
        return out[out >= 0]

    def private_blocks(self) -> np.ndarray:
        """The backlog blocks (int64) that will stay private when registered: registering at
        once, they were duplicates (see :meth:`_backlog`), so they keep no Mamba state."""
        if not self.queued:
            return np.zeros(0, np.int64)
        _, _, blocks, _, private = self._backlog()
        return blocks[private]

    def _backlog(self):
        """:func:`~.backlog_duplicates.backlog_blocks` of this backlog: its rows that could
        hold a duplicate, the :attr:`marked` ones too while a drop is remembered. Every backlog
        row is hashed then, as when every row was analysed (what is hashed decides when
        :meth:`_advance` registers rather than hashes)."""
        marked, requests = None, self.requests
        if self._dropped:      # the queue holds every computed complete block of these rows
            marked, ends = self.marked, requests.computed // requests.block_size
            rows = np.flatnonzero(requests.registered < ends)
            requests.hash_through(rows, ends[rows])
        entangled = entangled_rows(requests, self.kv, False, ENTANGLED_ROWS, marked)
        if not entangled.any():     # no backlog block could duplicate one: all will register
            empty = np.zeros(0, np.int64)
            return empty, empty, empty, empty, np.zeros(0, bool)
        return backlog_blocks(self._queue, self.requests, self.kv.kv_hash_to_block_id,
                              self._dropped, entangled)

    def deregistering(self, block_ids: np.ndarray) -> None:
        """Before the KV allocator deregisters ``block_ids`` (int64), while a backlog could hold
        a block their hashes make private: :func:`~.backlog_duplicates.mark_rows_of` them, and
        remember when their hashes leave the map (no observer call is needed for that)."""
        if self.queued:
            mark_rows_of(block_ids, self.requests, self.kv._forest, self.marked, self._scratch)
            listed = self.kv.block_hashes[block_ids].tolist()
            self._dropped.update(dict.fromkeys(listed, self._commits))
            self._drop_log.append((self._commits, listed))

    def computing_any(self, hashes: list) -> bool:
        """Whether a block of ``hashes`` is not registered but a scheduled step is computing
        it (after catching up: the backlog is registered, the scheduled blocks hashed)."""
        self.flush()
        requests = self.requests
        rows = np.flatnonzero(requests.pending_end >= 0)
        requests.hash_through(rows, requests.lengths[rows] // requests.block_size)
        return pending_blocks_overlap(set(hashes).difference(self.kv.kv_hash_to_block_id),
                                      requests)

    def _drain(self, limit, last_commit=None, hashed_only=False) -> int:
        """Register queued entries from the front, at most ``limit`` blocks (None: all) but at
        least the first row's, and only those queued by commit ``last_commit`` or earlier
        (None: any); ``hashed_only``: stop at the first row not hashed yet."""
        taken = registered = 0
        while self._queue and (limit is None or taken < limit):
            rows, upto, counts, commit = self._queue[0]
            if last_commit is not None and commit > last_commit:
                break
            total = len(rows) if counts is None else int(counts.sum())
            ready = len(rows)
            if hashed_only:
                done = self.requests.hashed[rows] >= upto
                ready = len(rows) if done.all() else int(np.argmin(done))
                if not ready:
                    break
            if ready < len(rows) or (limit is not None and taken + total > limit):
                k = ready if limit is None else min(ready, limit - taken if counts is None else
                    max(1, int(np.searchsorted(np.cumsum(counts), limit - taken, "right"))))
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
            self._drop_log.clear()
            self.marked.fill(False)
        elif self.prune_dropped:
            prune_dropped(self._drop_log, self._dropped, self._queue[0][3])
        return registered

    def _advance(self, limit, last_commit) -> int:
        """One commit's share of the backlog queued by commit ``last_commit`` or earlier:
        register up to ``limit`` hashed blocks from its front, or, if its front is not hashed,
        hash up to ``limit`` blocks (whole entries, then leading rows). SHA-256 is most of the
        cost, so a step does one or the other. Returns the number registered."""
        queued = self.queued
        registered = self._drain(limit, last_commit, hashed_only=True)
        if self.queued < queued or not self._queue \
                or self.requests.hashed[self._queue[0][0][0]] >= self._queue[0][1][0]:
            return registered      # registered, or nothing to do (the front is too young)
        requests, hashed = self.requests, 0
        for rows, upto, _, commit in self._queue:
            if commit > last_commit or (limit is not None and hashed >= limit):
                break
            todo = upto - np.minimum(requests.hashed[rows], upto)
            if not todo.any():
                continue
            if limit is not None and hashed + int(todo.sum()) > limit:
                k = max(1, int(np.searchsorted(np.cumsum(todo), limit - hashed, "right")))
                rows, upto, todo = rows[:k], upto[:k], todo[:k]
            requests.hash_through(rows, upto)
            hashed += int(todo.sum())
        return 0

    def _register(self, rows: np.ndarray, upto: np.ndarray, single=False, commit=None,
                  deferred=True) -> int:
        """Hash and register blocks ``[registered, upto)`` of distinct ``rows`` (``single``: one
        each), completed at commit ``commit`` (None: now); ``deferred``: they were queued."""
        requests, kv = self.requests, self.kv
        if single:     # a decode step's: one new block each
            cols, done = upto - 1, requests.hashed[rows]
            if not np.count_nonzero(done != cols):      # each hashed through the one before
                requests.hash_through(rows, upto)
                done = upto
            hashes = requests.hashes[rows, cols] if not np.count_nonzero(done < upto) else None
            if hashes is not None:
                table = requests.request_to_kv_block_ids
                parents = np.where(cols > 0, requests.hashes[rows, cols - 1], 0)
                ids = table[rows, cols].astype(np.int64)
                listed = hashes.tolist()
                # No hash taken, repeated or dropped (then none stays private).
                if kv.kv_hash_to_block_id.keys().isdisjoint(listed) \
                        and len(set(listed)) == len(listed) \
                        and self._dropped.keys().isdisjoint(listed):
                    requests.registered[rows] = upto
                    # Most parents are the row's previous block (column -1 is checked and
                    # fails, as parent hash 0 is no block's).
                    kv._register_new_blocks(ids, hashes, parents,
                                            table[rows, cols - 1].astype(np.int64))
                    return self._settle(ids, hashes, len(ids)) if deferred else len(ids)
        requests.hash_through(rows, upto)
        ids, hashes, parents, likely, drained, drained_hashes = blocks_to_register(
            requests, rows, upto * requests.block_size, kv.kv_hash_to_block_id)
        if self._dropped and len(ids):
            # A hash deregistered since these blocks completed was registered then: registering
            # at once would have left them private, so they stay private.
            at = self._commits if commit is None else commit
            fresh = np.fromiter((self._dropped.get(h, -1) < at for h in hashes.tolist()), bool,
                                len(hashes))
            ids, hashes, parents, likely = ids[fresh], hashes[fresh], parents[fresh], likely[fresh]
        if len(ids):
            kv._register_new_blocks(ids, hashes, parents, likely)
        return self._settle(drained, drained_hashes, len(ids)) if deferred else len(ids)

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
