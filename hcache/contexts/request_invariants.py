"""The invariants of a :class:`~hcache.contexts.requests.RequestTable` (see its module
docstring): rows and live slots partitioned, counters and block tables consistent, block hashes
that agree with the tokens, salts and extra keys. Rehashes every row: a check for tests."""

from __future__ import annotations

import numpy as np

from .block_hashing import chain_block_hashes, chain_root

__all__ = ["broken_request_invariants"]


def broken_request_invariants(requests) -> list[str]:
    """Every broken invariant of request table ``requests``; empty when all hold. Reads only."""
    problems = []
    bs = requests.block_size
    active = sorted(requests._row_of.values())
    if sorted(active + requests._free_rows) != list(range(requests.max_requests)):
        problems.append("active and free rows do not partition the rows")
    slots = sorted(requests.request_to_mamba_state_idx[active].tolist() + requests._free_live_slots)
    if slots != list(range(requests.max_requests)):
        problems.append("live slots of active requests and free slots do not partition")
    for row in active:
        n, nb = int(requests.lengths[row]), int(requests.num_blocks[row])
        table = requests.request_to_kv_block_ids[row]
        if not 0 <= requests.computed[row] <= n or requests.pending_end[row] not in (-1, n) \
                or (requests.pending_end[row] < 0 and requests.computed[row] != n):
            problems.append(f"row {row}: computed {requests.computed[row]}, pending "
                            f"{requests.pending_end[row]}, length {n}")
        if nb != -(-n // bs) or (table[:nb] < 0).any() or (table[nb:] != -1).any():
            problems.append(f"row {row}: {nb} blocks for {n} tokens, table {table}")
        h = int(requests.hashed[row])
        if not requests.registered[row] <= (h if requests.hashing else n // bs) <= n // bs:
            problems.append(f"row {row}: {requests.registered[row]} blocks registered, {h} "
                            f"hashed, {n // bs} complete")
        if requests.hashing:
            root = np.frombuffer(chain_root(requests.salts[row]), np.uint8)
            keys = requests.keys[row]
            hashes, digests = chain_block_hashes(
                root[None], requests.tokens[row, :h * bs].reshape(-1, bs), np.array([h]),
                {k: v for k, v in keys.items() if k < h})
            last = digests[-1] if h else root
            if (requests.hashes[row, :h] != hashes).any() or (requests.digests[row] != last).any():
                problems.append(f"row {row}: block hashes disagree with its tokens, salt "
                                f"and extra keys")
            waiting = [c for c in keys if c >= h]
            if waiting != ([requests.pending_key_cols[row]] if requests.pending_key_cols[row] >= 0
                           else []):
                problems.append(f"row {row}: extra keys of unhashed blocks {waiting}, "
                                f"pending column {requests.pending_key_cols[row]}")
    free = [r for r in range(requests.max_requests) if r not in set(active)]
    if any(requests.salts[r] is not None or requests.keys[r] for r in free) \
            or (requests.pending_key_cols[free] != -1).any():
        problems.append("free rows with salts or extra keys")
    if requests._pending_keys != int(np.count_nonzero(requests.pending_key_cols >= 0)):
        problems.append(f"{requests._pending_keys} pending keys counted, "
                        f"{np.count_nonzero(requests.pending_key_cols >= 0)} columns")
    if (requests.request_to_kv_block_ids[free] != -1).any() \
            or (requests.request_to_mamba_state_idx[free] != -1).any():
        problems.append("free rows with table entries")
    return problems
