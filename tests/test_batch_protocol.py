"""The batch protocol both continuous-batching managers compose (continuous/batch_protocol.py,
docs/design.md §5): the same call refused the same way by either manager, and a manager freed as
soon as it is dropped (the protocol does not keep it alive)."""

from __future__ import annotations

import sys
import weakref

import numpy as np
import pytest

from hcache import BatchInFlightError, ContinuousBatchingHybridCacheManager, HybridCacheConfig
from hcache.config.caches import KVCacheConfig, KVLayerConfig, LayerType, MambaCacheConfig
from hcache.continuous.manager import ContinuousBatchingKVCacheManager, KVCacheStaticParams

A, M = LayerType.ATTENTION, LayerType.MAMBA


def kv_manager():
    return ContinuousBatchingKVCacheManager("float16", KVCacheStaticParams(2, 4), 3, 6, 2)


def hybrid_manager():
    kv = KVCacheConfig(3, 6, [KVLayerConfig(2, 4)], "float16")
    mamba = MambaCacheConfig(1, 3, 2, 2, 3, 4, 2, ssm_dtype="float32", conv_dtype="float32")
    return ContinuousBatchingHybridCacheManager(HybridCacheConfig([M, A], kv, mamba, 3))


def refusal(call):
    """``(type, message)`` of the exception ``call()`` raises."""
    with pytest.raises(Exception) as info:
        call()
    return type(info.value), str(info.value)


def refusals(make):
    """The protocol's refusals, in one fixed scenario, on a fresh manager of ``make``."""
    m, other = make(), make()
    a, b, c = m.claim(3)
    coll = m.fetch([a, b])
    foreign = other.fetch(other.claim(1))
    got = [refusal(lambda: m.fetch([c])),                              # batch in flight
           refusal(lambda: m.fetch([c], wait=True, timeout=0.0)),      # own batch: at once
           refusal(lambda: m.release(a)),                              # in-flight sequence
           refusal(lambda: m.step([1, 7], coll)),                      # past max_seq_len
           refusal(lambda: m.step([1], coll)),                         # wrong count
           refusal(lambda: m.step([1, 1], foreign)),                   # another manager's
           refusal(lambda: m.block_of(99)),                            # unknown seq_id
           refusal(lambda: m.can_claim(-1)),
           refusal(lambda: m.fetch([])),
           refusal(lambda: m.fetch([c], timeout=-1.0))]
    state = (m.cache_lengths, m.num_free_blocks, m.num_live_sequences, m.in_flight is coll)
    m.step([2, 0], coll)
    got.append(refusal(lambda: m.step([0, 0], coll)))                  # ended collection
    m.reset()
    got.append(refusal(lambda: m.block_of(a)))                         # ids die with reset
    return got, state


def test_both_managers_refuse_alike_and_change_nothing():
    """Same calls, same exception types and messages, except for the collection class named
    by a foreign-collection TypeError (checked below); nothing changed by any refusal."""
    kv, kv_state = refusals(kv_manager)
    hy, hy_state = refusals(hybrid_manager)
    assert kv == hy
    assert kv_state == hy_state == ({0: 0, 1: 0, 2: 0}, 0, 3, True)
    assert kv[0][0] is BatchInFlightError and kv[1][0] is BatchInFlightError
    assert kv[2] == (ValueError, "seq_id: expected a sequence not in the batch in flight, got 0; "
                                 "step the batch first")
    assert kv[3] == (ValueError, "valid_lengths[1]: expected at most 6 for seq_id 1, got 7")


@pytest.mark.parametrize("make, name", [(kv_manager, "ContinuousBatchingKVCacheCollection"),
                                        (hybrid_manager, "ContinuousBatchingHybridCollection")])
def test_step_names_its_own_collection_class(make, name):
    m = make()
    with pytest.raises(TypeError, match=f"collection: expected a {name}, got list"):
        m.step([1], [0])


@pytest.mark.parametrize("make", [kv_manager, hybrid_manager])
def test_a_dropped_manager_is_freed_at_once(make):
    """No reference cycle through the protocol: a manager without a batch in flight is freed
    by reference counting alone (its device buffers with it), as before the protocol."""
    m = make()
    ids = m.claim(2)
    m.step(np.zeros(2, np.int64), m.fetch(ids))
    ref = weakref.ref(m)
    assert sys.getrefcount(m) == 2        # ``m`` and getrefcount's argument
    del m
    assert ref() is None
