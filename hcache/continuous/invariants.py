"""The invariants of a :class:`~hcache.continuous.manager.ContinuousBatchingKVCacheManager`
(docs/design.md §5), recounted from scratch: for tests and debugging, never on a step's path.

Its :class:`~hcache.continuous.sequences.SequenceBlocks` states its own (every block free or
held by one live sequence, lengths in range); what is checked here besides is the batch in
flight against them: distinct live seq_ids, host and device ``lookup_table`` /
``cache_lengths`` equal to their blocks and committed lengths, and an owner thread exactly when
there is a batch.
"""

from __future__ import annotations

from ..runtime.device import to_host

__all__ = ["broken_manager_invariants"]


def broken_manager_invariants(sequences, inflight, owner) -> list[str]:
    """Every broken invariant, one message each; empty when all hold. The invariants: every
    block is on the free heap or held by exactly one live sequence; the live seq_ids are those
    of ``cache_lengths``, each below the id counter, each length in ``[0, max_seq_len]``; a
    batch in flight names distinct live sequences, its host and device ``lookup_table`` /
    ``cache_lengths`` agree with their blocks and committed lengths, and it has an owner thread
    (and there is no owner without a batch).

    Parameters
    ----------
    sequences : SequenceBlocks
    inflight : ContinuousBatchingKVCacheCollection or None
        The batch in flight. Its device index buffers are read back: **synchronizes** on cuda.
    owner : threading.Thread or None
        The thread that fetched it.

    Returns
    -------
    list of str
    """
    problems = sequences.broken_invariants()
    if inflight is not None:
        problems += _inflight_problems(sequences, inflight, owner)
    elif owner is not None:
        problems.append("an in-flight owner without a batch in flight")
    return problems


def _inflight_problems(seqs, coll, owner) -> list[str]:
    ids, p = coll.seq_ids, []
    if any(s not in seqs.block_of for s in ids) or len(set(ids)) != len(ids):
        return [f"in-flight batch {list(ids)} holds dead or repeated seq_ids"]
    if [seqs.block_of[s] for s in ids] != list(coll.blocks):
        p.append("in-flight blocks differ from the live sequences' blocks")
    if [int(seqs.block_len[seqs.block_of[s]]) for s in ids] != list(coll.host_cache_lengths):
        p.append("in-flight lengths differ from the committed lengths")
    dev = [to_host(a) for a in (coll.lookup_table, coll.cache_lengths)]
    if dev[0].tolist() != list(coll.blocks) or dev[1].tolist() != list(
            coll.host_cache_lengths):
        p.append("device lookup_table/cache_lengths differ from the batch")
    if owner is None:
        p.append("a batch in flight without an owner thread")
    return p
