"""Continuous batching after a speculative verify: ``step_draft(accepted, num_draft_tokens,
collection, bonus_token=...)``.

Oracle: a second manager that only ever writes the kept tokens (a ragged write of
``accepted + bonus`` rows per sequence, then ``step(kept)``): after every step of random accept
patterns (0, partial, all) the lengths and the committed prefix of every block equal it, byte
for byte, for every dtype; on the reference and on the emulated kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

from hcache import ContinuousBatchingKVCacheManager, KVCacheStaticParams
from hcache.dtypes import DTYPE_NAMES

from helpers import host

H, D, N, S, L, K = 2, 8, 4, 40, 2, 4


def _make(dtype):
    return ContinuousBatchingKVCacheManager(dtype, KVCacheStaticParams(H, D), N, S, L,
                                            device="cpu")


def _rows(rng, shape, dtype):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_step_draft_equals_a_run_that_wrote_only_the_kept(backend, dtype):
    rng = np.random.default_rng(DTYPE_NAMES.index(dtype))
    spec, ref = _make(dtype), _make(dtype)
    ids, ref_ids = spec.claim(3), ref.claim(3)
    cdtype = spec.blocks_buf.dtype
    for _step in range(10):
        bonus = bool(rng.integers(0, 2))
        written = int(rng.integers(max(int(bonus), 1), K + 1))
        top = written - int(bonus)
        accepted = [0, top, int(rng.integers(0, top + 1))]
        rng.shuffle(accepted)
        kept = [a + int(bonus) for a in accepted]
        c, rc = spec.fetch(ids), ref.fetch(ref_ids)
        for layer in range(L):
            k, v = _rows(rng, (3, written, H, D), cdtype), _rows(rng, (3, written, H, D), cdtype)
            c.write_kv(layer, k, v)
            if sum(kept):
                rc.write_kv(layer, np.concatenate([k[i, :kept[i]] for i in range(3)]),
                            np.concatenate([v[i, :kept[i]] for i in range(3)]),
                            seq_lengths=kept)
        spec.step_draft(np.asarray(accepted), written, c, bonus_token=bonus)
        ref.step(kept, rc)
        lengths = [spec.cache_lengths[s] for s in ids]
        assert lengths == [ref.cache_lengths[s] for s in ref_ids]
        a, b = host(spec.blocks_buf), host(ref.blocks_buf)
        for s, rs, n in zip(ids, ref_ids, lengths, strict=True):
            got = a[spec.block_of(s), :, :, :n]
            want = b[ref.block_of(rs), :, :, :n]
            assert got.tobytes() == want.tobytes()
        spec.check_invariants()


def test_step_draft_refuses_bad_counts_and_changes_nothing():
    m = _make("float16")
    ids = m.claim(2)
    c = m.fetch(ids)
    with pytest.raises(ValueError, match=r"accepted\[1\]: expected a count in \[0, 2\], got 3"):
        m.step_draft([0, 3], 3, c, bonus_token=True)
    with pytest.raises(ValueError, match="accepted: expected lengths >= 0"):
        m.step_draft([-1, 0], 3, c)
    with pytest.raises(TypeError, match="bonus_token: expected a bool"):
        m.step_draft([0, 0], 3, c, bonus_token=1)
    with pytest.raises(ValueError, match="num_draft_tokens: expected"):
        m.step_draft([0, 0], 0, c, bonus_token=True)
    with pytest.raises(TypeError, match="collection: expected a"):
        m.step_draft([0, 0], 3, object())
    assert c.is_active and m.cache_lengths == dict.fromkeys(ids, 0)
    m.step_draft([1, 2], 3, c, bonus_token=True)
    assert m.cache_lengths == {ids[0]: 2, ids[1]: 3}


def test_step_draft_refuses_ring_blocks():
    m = ContinuousBatchingKVCacheManager("float16", KVCacheStaticParams(H, D), N, S, L,
                                         device="cpu", sliding_window=8)
    c = m.fetch(m.claim(1))
    with pytest.raises(ValueError, match="expected unbounded blocks"):
        m.step_draft([1], 2, c)
