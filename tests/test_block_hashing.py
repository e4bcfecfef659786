"""compute_block_hashes and chain_block_hashes: the SHA-256 chain of docs/design.md §6, checked
against an independent hashlib computation."""

from __future__ import annotations

import hashlib
import random
import struct

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

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
