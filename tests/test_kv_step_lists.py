"""A serving step's KV allocation and registration on Python lists (issue 24, eighth pass) change
cost, not behaviour.

Oracles: ``FreeBlockStack.pop`` / ``pop_per_request`` (NumPy) for ``pop_all_listed`` on twin
stacks; ``_listed_hashes`` (the step's digests joined and unpacked at once) for the hashes
``chain_cells`` reads one digest at a time; and a registration backlog that observes every
deregistration (the design before this pass, rebuilt here as an observer) for the drops that
``BlockRegistration.deregistering`` records now, on twin contexts under eviction.
"""

from __future__ import annotations

from collections import deque

import hypothesis.strategies as st
import numpy as np
from hypothesis import event, given, settings
from test_dynamic_context import make_ctx

from hcache.contexts import block_hashing
from hcache.contexts.block_hashing import DIGEST_BYTES, chain_cells
from hcache.contexts.free_block_stack import FreeBlockStack

# --- FreeBlockStack.pop_all_listed ----------------------------------------------------------


@st.composite
def emptied_stacks(draw):
    """A stack after some pops and pushes, the victims an eviction pushes on it, and the
    counts of the allocation that empties it (None: one ``pop``)."""
    n = draw(st.integers(2, 40))
    stack = FreeBlockStack(n)
    for _ in range(draw(st.integers(0, 4))):
        taken = stack.pop(draw(st.integers(0, stack.top)))
        back = draw(st.permutations(taken.tolist()))
        stack.push(back[: draw(st.integers(0, len(back)))])
    top = stack.top
    k = draw(st.integers(0, n - top))
    held = sorted(set(range(n)) - set(stack.ids[:top].tolist()))
    victims = draw(st.permutations(held))[:k]
    total = top + k
    kind = draw(st.sampled_from(["none", "ones", "counts"]))
    if kind == "none":
        counts = None
    elif kind == "ones":
        counts = [1] * total
    else:       # parts of ``total``, zeros between, each eviction's own share at its end
        cuts = sorted(draw(st.lists(st.integers(0, total), max_size=5)))
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    return stack, victims, counts


@given(emptied_stacks())
def test_pop_all_listed_pops_as_pop_and_pop_per_request(case):
    """After the victims are pushed, ``pop_all_listed`` returns what ``pop(top)`` or
    ``pop_per_request(counts, top)`` return on a twin stack, and empties the stack alike."""
    stack, victims, counts = case
    twin = FreeBlockStack(len(stack.ids))
    twin.ids[:], twin.top = stack.ids, stack.top
    top = stack.top
    for s in (stack, twin):
        s.push(list(victims))
    got = stack.pop_all_listed(counts, top)
    want = twin.pop(twin.top) if counts is None else twin.pop_per_request(counts, top)
    assert type(got) is list
    assert got == want.tolist()
    assert stack.top == twin.top == 0


# --- chain_cells' hashes ----------------------------------------------------------------------


@settings(max_examples=60)
@given(st.integers(0, 2**32 - 1), st.integers(1, 8), st.integers(1, 6))
def test_chain_cells_reads_the_hashes_listed_hashes_reads(seed, block_size, rows):
    """Each hash ``chain_cells`` returns is the one ``_listed_hashes`` reads off the digest it
    wrote (the first 8 bytes, little-endian, mod 2^63 - 1, plus 1), whatever the digest's
    top bit."""
    rng = np.random.default_rng(seed)
    width = 3
    tokens = rng.integers(0, 2**62, rows * width * block_size, dtype=np.int64)
    digests = rng.integers(0, 256, rows * DIGEST_BYTES, dtype=np.uint8)
    cells = [(r, int(rng.integers(0, width))) for r in range(rows)]
    step = 8 * block_size
    got = chain_cells(memoryview(digests), memoryview(tokens).cast("B"), cells, step,
                      step * width)
    joined = b"".join(digests[r * DIGEST_BYTES:(r + 1) * DIGEST_BYTES].tobytes()
                      for r, _ in cells)
    assert got == block_hashing._listed_hashes(joined, rows)
    assert all(0 < h < 2**63 for h in got)


def test_listed_hashes_reduces_modulo_as_documented():
    """Hand-computed: a digest whose first word is 2^63 - 1 (the modulus) hashes to 1, one of
    2^64 - 1 to 2^63 + 1 - 2^63 + 1 = 2 (the value mod 2^63 - 1 is 1), one of 5 to 6."""
    words = [(1 << 63) - 1, (1 << 64) - 1, 5]
    digests = b"".join(w.to_bytes(8, "little") + bytes(24) for w in words)
    assert block_hashing._listed_hashes(digests, 3) == [1, 2, 6]
    word = block_hashing._FIRST_WORD
    assert [word(digests, 32 * i)[0] % block_hashing._MOD + 1 for i in range(3)] == [1, 2, 6]


# --- the backlog's drops, recorded before the links go ---------------------------------------


def observed_drops(ctx):
    """Attach to ``ctx`` the backlog's former observer: the drops it would have recorded, as
    ``[(commit count, sorted hashes)]`` per deregistration batch while a backlog was queued."""
    reg, log = ctx._registration, []

    def observer(block_ids, hashes):
        if reg.queued:
            log.append((reg._commits, sorted(hashes)))
    ctx.kv_block_allocator.add_blocks_deregistered_observer(observer)
    return log


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_backlog_records_every_drop_an_observer_would(seed):
    """Under a small budget (a backlog) and a pool that evicts, the drops the backlog records
    in its ``deregistering`` hook are those an observer of every deregistration records (the
    same commit count and hashes per batch)."""
    rng = np.random.default_rng(seed)
    kw = dict(bs=2, mamba=int(rng.integers(2)), slots=8, rows=4, max_blocks=8,
              registration_budget=1)
    ctx = make_ctx(14, **kw)
    log = observed_drops(ctx)
    reg, recorded, live, next_id = ctx._registration, [], [], 0

    class Spy(deque):
        def append(self, entry):
            recorded.append((entry[0], sorted(entry[1])))
            super().append(entry)
    reg._drop_log = Spy()
    for _ in range(40):
        r = rng.random()
        try:
            if r < 0.3 or not live:
                tokens = rng.integers(0, 3, int(rng.integers(1, 9))).tolist()
                ctx.add_request(next_id, tokens)
                live.append(next_id)
                next_id += 1
            elif r < 0.8:
                ctx.extend_requests(live, rng.integers(0, 3, len(live)).tolist())
            else:
                ctx.release_requests([live.pop(int(rng.integers(len(live))))])
        except Exception:  # noqa: BLE001 - a full pool refuses; nothing changed
            pass
        if any(ctx._requests.pending_end >= 0):
            ctx.commit_step()
        ctx.check_invariants()
        # the map the backlog reads: each hash's last drop in the (pruned) log
        assert reg._dropped == {h: c for c, hashes in reg._drop_log for h in hashes}
    assert recorded == log
    event(f"drops recorded: {min(len(log), 3)}+")
