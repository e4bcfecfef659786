"""compute_block_hashes and chain_block_hashes: the SHA-256 chain of docs/design.md §6, checked
against an independent hashlib computation."""

from __future__ import annotations

import hashlib
import random
import struct

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from hcache.contexts import compute_block_hashes
from hcache.contexts.block_hashing import chain_block_hashes

TOKENS = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40)


def oracle(tokens, block_size):
    """Straight from the definition, with struct packing instead of NumPy."""
    digest, out = b"\0" * 32, []
    for k in range(len(tokens) // block_size):
        block = tokens[k * block_size:(k + 1) * block_size]
        digest = hashlib.sha256(digest + struct.pack(f"<{block_size}q", *block)).digest()
        out.append(struct.unpack("<Q", digest[:8])[0] % (2**63 - 1) + 1)
    return out


def test_hand_computed_hash_of_a_tiny_input():
    # Block [1, 2]: sha256(32 zero bytes || 01 00*7 || 02 00*7).
    payload = bytes(32) + (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
    first = hashlib.sha256(payload).digest()
    expected0 = int.from_bytes(first[:8], "little") % (2**63 - 1) + 1
    second = hashlib.sha256(first + (3).to_bytes(8, "little") + (4).to_bytes(8, "little"))
    expected1 = int.from_bytes(second.digest()[:8], "little") % (2**63 - 1) + 1
    assert compute_block_hashes([1, 2, 3, 4, 5], 2) == [expected0, expected1]


def test_chaining_makes_a_hash_depend_on_the_whole_prefix():
    a = compute_block_hashes([1, 2, 3, 4], 2)
    b = compute_block_hashes([9, 9, 3, 4], 2)
    assert a[0] != b[0] and a[1] != b[1]   # same second block, different prefix
    assert compute_block_hashes([3, 4], 2)[0] not in (a[1], b[1])


def test_partial_block_is_ignored_and_short_inputs_give_nothing():
    assert compute_block_hashes([1, 2, 3], 2) == compute_block_hashes([1, 2], 2)
    assert compute_block_hashes([1, 2, 3], 4) == []
    assert compute_block_hashes([], 1) == []


@given(TOKENS, st.integers(1, 6))
def test_matches_the_definition(tokens, block_size):
    got = compute_block_hashes(tokens, block_size)
    assert got == oracle(tokens, block_size)
    assert all(1 <= h <= 2**63 - 1 for h in got)


@given(TOKENS, TOKENS, st.integers(1, 4))
def test_equal_prefixes_give_equal_hashes(prefix, tail, block_size):
    full = compute_block_hashes(prefix + tail, block_size)
    head = compute_block_hashes(prefix, block_size)
    assert full[: len(head)] == head


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16, np.uint64])
def test_array_inputs_of_any_integer_dtype_hash_by_value(dtype):
    tokens = [0, 7, 65535, 3, 12, 1]
    assert compute_block_hashes(np.array(tokens, dtype=dtype), 3) == oracle(tokens, 3)


def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="block_size"):
        compute_block_hashes([1, 2], 0)
    with pytest.raises(TypeError, match="block_size"):
        compute_block_hashes([1, 2], 2.0)
    with pytest.raises(TypeError, match="tokens"):
        compute_block_hashes([1.5, 2.0], 1)
    with pytest.raises(TypeError, match="tokens"):
        compute_block_hashes(np.array([True, False]), 1)
    with pytest.raises(TypeError, match="tokens"):
        compute_block_hashes(np.array([2**64 - 1], dtype=np.uint64), 1)
    with pytest.raises(ValueError, match="tokens"):
        compute_block_hashes(np.zeros((2, 2), dtype=np.int64), 2)


@pytest.mark.gpu
def test_cupy_tokens_hash_like_host_tokens():
    import cupy

    tokens = list(range(50))
    assert compute_block_hashes(cupy.asarray(tokens), 8) == oracle(tokens, 8)


# --- a second oracle: int.to_bytes instead of struct, on edge-valued tokens -------------------

def spec_hashes(tokens, block_size):
    """``digest_k = sha256(digest_{k-1} || block k as int64 LE)``, ``digest_{-1}`` = 32 zero
    bytes, ``hash_k = uint64_le(digest_k[:8]) mod (2^63 - 1) + 1``."""
    digest, out = bytes(32), []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        payload = b"".join(int(t).to_bytes(8, "little", signed=True)
                           for t in tokens[start:start + block_size])
        digest = hashlib.sha256(digest + payload).digest()
        out.append(int.from_bytes(digest[:8], "little", signed=False) % (2**63 - 1) + 1)
    return out


@pytest.mark.parametrize("block_size", [1, 2, 3, 5])
@pytest.mark.parametrize("length", [0, 1, 5, 6, 15])
def test_block_hashes_follow_the_spec_definition(block_size, length):
    rng = random.Random(block_size * 100 + length)
    tokens = [rng.choice([0, 1, -1, 2**63 - 1, -(2**63), rng.randrange(-2**40, 2**40)])
              for _ in range(length)]
    got = compute_block_hashes(tokens, block_size)
    assert got == spec_hashes(tokens, block_size)
    assert len(got) == length // block_size     # partial tail block: no hash
    assert compute_block_hashes(np.asarray(tokens, dtype=np.int64), block_size) == got


# --- incremental hashing: chains continued from their last digest -----------------------------

@given(st.integers(1, 5), st.integers(1, 4), st.data())
def test_chains_continued_from_their_digests_equal_the_whole_prefix(block_size, streams, data):
    """Token streams grown in random chunks (across block boundaries, several blocks at once
    or none); after each round the blocks that completed are hashed in one
    chain_block_hashes call, continuing every stream from its last digest. The hashes kept so
    far always equal compute_block_hashes (and the definition) of each whole stream."""
    tokens = [[] for _ in range(streams)]
    hashes = [[] for _ in range(streams)]
    digests = np.zeros((streams, 32), np.uint8)
    for _ in range(data.draw(st.integers(1, 6))):
        grown, blocks, counts = [], [], []
        for i in range(streams):
            done = len(tokens[i]) // block_size
            tokens[i] += data.draw(st.lists(st.integers(-2**63, 2**63 - 1), max_size=12))
            new = len(tokens[i]) // block_size - done
            if new:
                grown.append(i)
                counts.append(new)
                blocks += [tokens[i][k * block_size:(k + 1) * block_size]
                           for k in range(done, done + new)]
        if grown:
            got, got_digests = chain_block_hashes(
                digests[grown], np.array(blocks, np.int64).reshape(-1, block_size),
                np.array(counts))
            ends = np.cumsum(counts)
            for i, n, end in zip(grown, counts, ends.tolist(), strict=True):
                hashes[i] += got[end - n:end].tolist()
                digests[i] = got_digests[end - 1]
        for i in range(streams):
            assert hashes[i] == compute_block_hashes(tokens[i], block_size) \
                == oracle(tokens[i], block_size)


def test_one_block_per_chain_and_empty_inputs():
    tokens = np.arange(12, dtype=np.int64)
    first, digests = chain_block_hashes(np.zeros((3, 32), np.uint8), tokens.reshape(3, 4))
    assert first.tolist() == [compute_block_hashes(tokens[k * 4:k * 4 + 4], 4)[0]
                              for k in range(3)]
    second, _ = chain_block_hashes(digests, tokens[::-1].reshape(3, 4))
    assert [compute_block_hashes(np.concatenate([tokens[k * 4:k * 4 + 4],
                                                 tokens[::-1][k * 4:k * 4 + 4]]), 4)[1]
            for k in range(3)] == second.tolist()
    empty, no_digests = chain_block_hashes(np.zeros((0, 32), np.uint8), np.zeros((0, 4)))
    assert empty.shape == (0,) and no_digests.shape == (0, 32)


# --- isolation: a salt and extra keys per block (issue 30, docs/design.md §6.1) ---------------

SALTS = st.one_of(st.none(), st.sampled_from([b"", b"a", "a", b"b", "\u00e9", b"\xc3\xa9"]))
KEY = st.sampled_from([b"", b"x", "x", b"y", b"\x00" * 8])
BLOCK_KEYS = st.one_of(KEY, st.lists(KEY, max_size=2))


def salted_oracle(tokens, block_size, salt=None, extra_keys=None):
    """The rule of §6.1 from scratch: the chain starts from 32 zero bytes, or from
    ``sha256(b"hcache prefix-cache salt\\0" || salt)``; block ``k``'s message is the parent
    digest, its tokens (int64 LE, struct-packed) and ``uint64_le(len(key)) || key`` per key."""
    def raw(x):
        return x.encode() if isinstance(x, str) else bytes(x)

    digest = bytes(32) if salt is None else \
        hashlib.sha256(b"hcache prefix-cache salt\x00" + raw(salt)).digest()
    out = []
    for k in range(len(tokens) // block_size):
        keys = (extra_keys or {}).get(k, ())
        keys = [keys] if isinstance(keys, (bytes, str)) else keys
        suffix = b"".join(struct.pack("<Q", len(raw(x))) + raw(x) for x in keys)
        block = tokens[k * block_size:(k + 1) * block_size]
        digest = hashlib.sha256(digest + struct.pack(f"<{block_size}q", *block) + suffix).digest()
        out.append(struct.unpack("<Q", digest[:8])[0] % (2**63 - 1) + 1)
    return out


@given(TOKENS, st.integers(1, 4))
def test_without_salt_or_keys_hashes_are_byte_identical_to_megatron(tokens, block_size):
    """No salt and no key (None, an empty mapping, blocks with empty key lists): the plain
    chain of Megatron-LM, pinned by two oracles written from its definition."""
    want = spec_hashes(tokens, block_size)
    assert oracle(tokens, block_size) == want
    blocks = -(-len(tokens) // block_size)
    for extra in (None, {}, {k: [] for k in range(blocks)}):
        assert compute_block_hashes(tokens, block_size, salt=None, extra_keys=extra) == want


@given(TOKENS, st.integers(1, 4), SALTS, st.data())
def test_salted_and_keyed_hashes_follow_the_rule(tokens, block_size, salt, data):
    blocks = -(-len(tokens) // block_size)
    extra = data.draw(st.dictionaries(st.integers(0, max(blocks - 1, 0)), BLOCK_KEYS,
                                      max_size=blocks))
    got = compute_block_hashes(tokens, block_size, salt=salt, extra_keys=extra)
    assert got == salted_oracle(tokens, block_size, salt, extra)
    assert all(1 <= h <= 2**63 - 1 for h in got)


def identity(tokens, block_size, salt, extra, k):
    """What block ``k``'s hash must identify: tokens through block ``k``, the salt (a str as
    its UTF-8 bytes) and the keys of blocks ``0..k`` (one key as a list of one; none as [])."""
    def raw(x):
        return x.encode() if isinstance(x, str) else x

    def keys(j):
        v = extra.get(j, [])
        return tuple(map(raw, [v] if isinstance(v, (bytes, str)) else v))

    return (tuple(tokens[:(k + 1) * block_size]), None if salt is None else raw(salt),
            tuple(keys(j) for j in range(k + 1)))


@settings(max_examples=300)
@given(st.integers(1, 3), st.data())
def test_equal_hashes_iff_equal_tokens_salt_and_keys_through_the_block(block_size, data):
    """Two sequences over a tiny alphabet, salts and keys from small sets (so that they often
    agree): block ``k`` hashes alike exactly when the tokens through it, the salts and the
    keys of every block up to it agree; a salt is never equal to no salt, a str salt equals
    its UTF-8 bytes."""
    sides = []
    for _ in range(2):
        tokens = data.draw(st.lists(st.integers(0, 1), min_size=block_size, max_size=9))
        blocks = -(-len(tokens) // block_size)
        extra = data.draw(st.dictionaries(st.integers(0, blocks - 1), BLOCK_KEYS,
                                          max_size=2))
        salt = data.draw(SALTS)
        sides.append((tokens, salt, extra,
                      compute_block_hashes(tokens, block_size, salt=salt, extra_keys=extra)))
    (ta, sa, ea, ha), (tb, sb, eb, hb) = sides
    for k in range(min(len(ha), len(hb))):
        same = identity(ta, block_size, sa, ea, k) == identity(tb, block_size, sb, eb, k)
        assert (ha[k] == hb[k]) == same, (k, sides)


@given(st.integers(1, 4), SALTS, st.lists(st.integers(-2**63, 2**63 - 1), max_size=20),
       st.data())
def test_keyed_chains_continued_block_by_block_equal_the_whole_sequence(block_size, salt,
                                                                        tokens, data):
    """chain_block_hashes from the salt's root with the encoded keys, one block at a time and
    all at once, equals compute_block_hashes of the whole sequence."""
    from hcache.contexts.block_hashing import block_keys, cache_salt, chain_root

    n = len(tokens) // block_size
    extra = data.draw(st.dictionaries(st.integers(0, max(n - 1, 0)), BLOCK_KEYS, max_size=3)) \
        if n else {}
    want = compute_block_hashes(tokens, block_size, salt=salt, extra_keys=extra)
    keys = block_keys("extra_keys", extra, n)
    root = np.frombuffer(chain_root(cache_salt("salt", salt)), np.uint8)[None]
    blocks = np.array(tokens[:n * block_size], np.int64).reshape(n, block_size)
    whole, _ = chain_block_hashes(root, blocks, np.array([n]), keys)
    assert whole.tolist() == want
    digest, one_by_one = root, []
    for k in range(n):
        h, d = chain_block_hashes(digest, blocks[k:k + 1], None,
                                  {0: keys[k]} if k in keys else None)
        one_by_one.append(int(h[0]))
        digest = d
    assert one_by_one == want


@pytest.mark.parametrize("kwargs, error, message", [
    ({"salt": 1}, TypeError, r"^salt: expected bytes or str, got int$"),
    ({"salt": ["a"]}, TypeError, r"^salt: expected bytes or str, got list$"),
    ({"extra_keys": [b"x"]}, TypeError, r"^extra_keys: expected a mapping"),
    ({"extra_keys": {3: b"x"}}, IndexError, r"^extra_keys: expected block indices in \[0, 3\), "
                                            r"got 3$"),
    ({"extra_keys": {-1: b"x"}}, IndexError, r"^extra_keys: expected block indices"),
    ({"extra_keys": {"0": b"x"}}, TypeError, r"^extra_keys: expected int block indices, "
                                             r"got str$"),
    ({"extra_keys": {True: b"x"}}, TypeError, r"^extra_keys: expected int block indices"),
    ({"extra_keys": {0: 7}}, TypeError, r"^extra_keys\[0\]: expected bytes, str or a list"),
    ({"extra_keys": {1: [b"x", None]}}, TypeError,
     r"^extra_keys\[1\]\[1\]: expected bytes or str, got NoneType$"),
])
def test_bad_salts_and_keys_are_refused_naming_the_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        compute_block_hashes([1, 2, 3, 4, 5], 2, **kwargs)   # 3 blocks, the last partial


@given(st.integers(1, 4), SALTS, st.lists(st.integers(-2**63, 2**63 - 1), max_size=20),
       st.data())
def test_prompt_block_hashes_equal_the_whole_sequence_and_the_general_chain(block_size, salt,
                                                                           tokens, data):
    """prompt_block_hashes (the admission's one-chain path) equals compute_block_hashes of the
    whole sequence, and its digest is the last one chain_block_hashes gives (the root when no
    block is complete); a key of the partial tail block enters no hash."""
    from hcache.contexts.block_hashing import (
        block_keys,
        cache_salt,
        chain_root,
        prompt_block_hashes,
    )

    n, num_blocks = len(tokens) // block_size, -(-len(tokens) // block_size)
    extra = data.draw(st.dictionaries(st.integers(0, max(num_blocks - 1, 0)), BLOCK_KEYS,
                                      max_size=3)) if num_blocks else {}
    keys = block_keys("extra_keys", extra, num_blocks)
    root = chain_root(cache_salt("salt", salt))
    arr = np.array(tokens, np.int64)
    hashes, digest = prompt_block_hashes(root, arr, block_size, keys or None)
    assert hashes.dtype == np.int64
    assert hashes.tolist() == compute_block_hashes(tokens, block_size, salt=salt,
                                                   extra_keys=extra)
    _, digests = chain_block_hashes(np.frombuffer(root, np.uint8)[None],
                                    arr[:n * block_size].reshape(n, block_size), np.array([n]),
                                    {k: v for k, v in keys.items() if k < n})
    assert digest == (digests[-1].tobytes() if n else root)
