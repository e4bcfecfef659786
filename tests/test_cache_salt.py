"""Prefix-cache isolation in DynamicInferenceContext (issue 30, docs/design.md §6.1): a request
reuses a KV block or a Mamba state only if its salt and every extra key up to that block equal
the donor's.

Oracle: a stand-in model whose every output is a code of what it may depend on. The Mamba
state after ``s`` tokens and the K/V row of position ``s - 1`` are ``code(s)``, a digest of the
request's salt, the extra keys of the blocks through the one that holds token ``s - 1`` and the
tokens ``[0, s)`` (as a LoRA adapter, an image or a model revision would change them). So a
block or a state handed over from a request with another salt or another key carries another
code, and the restored live state and the matched blocks' K/V rows are compared with the
request's own codes. The number of matched blocks is compared with the longest run of prompt
blocks whose (tokens, salt, keys) some earlier request registered (the pool never evicts here):
equal salts and keys share exactly as without them.
"""

from __future__ import annotations

import hashlib

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from hcache.config.caches import KVLayerConfig
from hcache.contexts import DynamicInferenceContext, compute_block_hashes

BS = 2
STEMS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5]]
SALTS = [None, b"lora-1", "lora-1", b"lora-2", b""]
KEYS = [b"img-a", "img-a", b"img-b", [b"img-a", b"img-b"], []]


def make_ctx(**kw):
    args = dict(kv_layer_configs=[KVLayerConfig(1, 2)], num_blocks=256, block_size_tokens=BS,
                max_requests=2, max_blocks_per_request=8, num_mamba_layers=1,
                conv_states_shape=(1,), ssm_states_shape=(1,), kv_dtype="float32",
                conv_states_dtype="float32", ssm_states_dtype="float32",
                mamba_cache_slots=64, device="cpu")
    return DynamicInferenceContext(**{**args, **kw})


def normal(value):
    """A salt or key as the bytes that identify it (a str is its UTF-8 bytes)."""
    return value.encode() if isinstance(value, str) else value


class Request:
    def __init__(self, tokens, salt, extra):
        self.tokens, self.salt, self.extra = list(tokens), salt, extra

    def keys(self, block):
        v = self.extra.get(block, [])
        return tuple(normal(k) for k in ([v] if isinstance(v, (bytes, str)) else v))

    def identity(self, s):
        """What the model's output after ``s`` tokens depends on."""
        last = (s - 1) // BS
        return (None if self.salt is None else normal(self.salt),
                tuple(self.keys(b) for b in range(last + 1)), tuple(self.tokens[:s]))

    def code(self, s):
        if s == 0:
            return 0.0
        digest = hashlib.sha256(repr(self.identity(s)).encode()).digest()
        return float(int.from_bytes(digest[:3], "little") + 1)   # exact in float32


def run_step(ctx, req, plan):
    """The stand-in model over ``plan``: checks the state it starts from, writes K/V rows,
    the snapshots asked for and the final live state, then commits."""
    slot = plan.mamba_slot
    assert ctx.mamba_ssm_states[0, slot, 0] == req.code(plan.start)   # restored or continued
    m = ctx.mamba_slot_allocator
    for rid, off, idx in ctx.snapshot_targets():
        assert rid == plan.request_id
        m.intermediate_conv_out[0, idx, 0] = m.intermediate_ssm_out[0, idx, 0] = \
            req.code(plan.start + off)
    rows = np.array([req.code(p + 1) for p in range(plan.start, plan.end)], np.float32)
    k = np.repeat(rows[:, None, None], 2, axis=2)
    ctx.write_kv([plan.request_id], [k], [-k])
    ctx.mamba_conv_states[0, slot, 0] = ctx.mamba_ssm_states[0, slot, 0] = req.code(plan.end)
    ctx.commit_step()
    ctx.check_invariants()


REQUEST = st.tuples(st.sampled_from(STEMS), st.integers(1, 7), st.lists(st.integers(0, 1),
                                                                          max_size=2),
                    st.sampled_from(SALTS), st.dictionaries(st.integers(0, 4),
                                                            st.sampled_from(KEYS), max_size=2),
                    st.lists(st.integers(0, 1), max_size=3))


@settings(max_examples=60, deadline=None)
@given(st.lists(REQUEST, min_size=2, max_size=8))
def test_reuse_only_under_equal_salt_and_keys(requests):
    """Requests one after another (prompt, then an optional continuation that may complete a
    keyed partial block): each matches exactly the blocks an earlier one registered under the
    same tokens, salt and keys, and restores only such a Mamba state."""
    ctx = make_ctx()
    registered = set()      # identities of the complete blocks registered so far
    for i, (stem, cut, tail, salt, extra, more) in enumerate(requests):
        tokens = stem[:cut] + tail
        blocks = -(-len(tokens) // BS)
        extra = {b: k for b, k in extra.items() if b < blocks}
        req = Request(tokens, salt, extra)
        plan = ctx.add_request(i, tokens, salt=salt, extra_keys=extra)
        want = 0
        while want < len(tokens) // BS and req.identity((want + 1) * BS) in registered:
            want += 1
        assert plan.num_matched_blocks == want
        # The matched blocks' rows are this request's own (a donor's under its salt and keys).
        pool = ctx.kv_pool.layers[0]
        ids = ctx.block_ids(i)
        for p in range(want * BS):
            assert pool[ids[p // BS], 0, 0, p % BS, 0] == req.code(p + 1), p
        run_step(ctx, req, plan)
        if more:
            req.tokens += more
            run_step(ctx, req, ctx.extend_request(i, more))
        ctx.register_completed_blocks()
        n = len(req.tokens)
        row = ctx._requests.row(i)
        assert ctx._requests.hashes[row, :n // BS].tolist() == compute_block_hashes(
            req.tokens, BS, salt=salt, extra_keys=extra)
        registered.update(req.identity((b + 1) * BS) for b in range(n // BS))
        ctx.release_requests([i])
        ctx.check_invariants()


def test_no_salt_shares_as_before_and_salts_split_the_cache():
    """Hand-built: equal salts share the prompt's blocks and the state, a str salt is its
    UTF-8 bytes, another salt or no salt shares nothing, an extra key splits from its block
    on (the blocks before it are still shared)."""
    ctx = make_ctx()
    prompt = [1, 2, 3, 4, 5, 6, 7]
    for rid, kwargs, matched in [("a", {}, 0), ("b", {}, 3), ("c", {"salt": "t"}, 0),
                                 ("d", {"salt": b"t"}, 3), ("e", {"salt": b"u"}, 0),
                                 ("f", {"extra_keys": {1: b"img"}}, 1),
                                 ("g", {"extra_keys": {1: "img"}}, 3),
                                 ("h", {"salt": "t", "extra_keys": {1: b"img"}}, 1)]:
        req = Request(prompt, kwargs.get("salt"), kwargs.get("extra_keys", {}))
        plan = ctx.add_request(rid, prompt, **kwargs)
        assert plan.num_matched_blocks == matched, rid
        # States are kept at the last two boundaries of a prompt (§6.6): a full match restores.
        assert (plan.restored_block >= 0) == (matched == 3)
        run_step(ctx, req, plan)
        ctx.release_requests([rid])


def test_a_key_of_the_partial_tail_block_enters_its_hash_when_it_completes():
    """A prompt of 3 tokens (block size 2) with a key on its partial block 1: decoding the 4th
    token completes the block, whose registered hash carries the key; a later prompt with the
    block complete matches it only under the same key."""
    ctx = make_ctx()
    req = Request([1, 2, 3], None, {1: b"img"})
    run_step(ctx, req, ctx.add_request("a", [1, 2, 3], extra_keys={1: b"img"}))
    assert ctx._requests.pending_key_cols[ctx._requests.row("a")] == 1   # waits for it
    req.tokens.append(4)
    run_step(ctx, req, ctx.extend_request("a", [4]))
    ctx.release_requests(["a"])
    want = compute_block_hashes([1, 2, 3, 4], BS, extra_keys={1: b"img"})
    assert ctx.kv_block_allocator.block_hashes[ctx.kv_block_allocator.kv_hash_to_block_id[
        want[1]]] == want[1]
    assert want[1] != compute_block_hashes([1, 2, 3, 4], BS)[1]
    for keys, matched in [({1: b"img"}, 2), ({1: b"other"}, 1), ({}, 1)]:
        plan = ctx.add_request("b", [1, 2, 3, 4, 5], extra_keys=keys)
        assert plan.num_matched_blocks == matched, keys
        ctx.release_requests(["b"])


def test_shares_pending_blocks_hashes_under_the_salt():
    ctx = make_ctx()
    ctx.add_request("a", [1, 2, 3, 4], salt="t")     # computing, not registered yet
    assert ctx.shares_pending_blocks([1, 2, 3, 4], salt="t")
    assert ctx.shares_pending_blocks([1, 2], salt=b"t")
    assert not ctx.shares_pending_blocks([1, 2, 3, 4])
    assert not ctx.shares_pending_blocks([1, 2, 3, 4], salt="u")
    assert not ctx.shares_pending_blocks([1, 2, 3, 4], salt="t", extra_keys={0: b"k"})


@pytest.mark.parametrize("kwargs, error, message", [
    ({"salt": 1}, TypeError, r"^salt: expected bytes or str, got int$"),
    ({"salt": 1.5}, TypeError, r"^salt: expected bytes or str, got float$"),
    ({"extra_keys": {4: b"x"}}, IndexError,
     r"^extra_keys: expected block indices in \[0, 4\), got 4$"),
    ({"extra_keys": {0: 3}}, TypeError, r"^extra_keys\[0\]: expected bytes, str or a list"),
    ({"extra_keys": (b"x",)}, TypeError, r"^extra_keys: expected a mapping"),
])
def test_bad_salt_or_keys_change_nothing(kwargs, error, message):
    """Refused before anything changes: no row taken, no block pinned or allocated."""
    ctx = make_ctx()
    req = Request([1, 2, 3, 4], None, {})
    run_step(ctx, req, ctx.add_request("a", [1, 2, 3, 4]))
    kv = ctx.kv_block_allocator
    before = (kv.block_ref_counts.tolist(), kv.free_block_ids.tolist(), ctx.request_ids,
              ctx._requests.salts[:], ctx._requests.keys[:],
              ctx._requests.pending_key_cols.tolist())
    with pytest.raises(error, match=message):
        ctx.add_request("b", [1, 2, 3, 4, 5, 6, 7], **kwargs)     # 4 blocks, the last partial
    assert before == (kv.block_ref_counts.tolist(), kv.free_block_ids.tolist(),
                      ctx.request_ids, ctx._requests.salts[:], ctx._requests.keys[:],
                      ctx._requests.pending_key_cols.tolist())
