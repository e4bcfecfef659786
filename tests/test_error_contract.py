"""The error contract on every public callable of ``hcache.__all__`` (issue 12): a bad argument
raises ``IndexError``, ``ValueError``, ``TypeError`` or ``CacheCapacityError`` whose message
starts with the name of the argument the caller passed ("name: expected X, got Y", or
``name[i]`` / ``name.field`` for a part of it), and changes nothing.

The callables are enumerated by introspection (with the interop functions of ``hcache.arrays``,
``hcache.device``, ``hcache.dtypes``, ``hcache.memory`` and ``hcache.rings`` listed in
``MODULE_FUNCTIONS``), so a new public method
without a case in :mod:`error_contract_cases` fails ``test_every_public_callable_has_a_case``.
Each case's valid call must succeed (``test_valid_calls_succeed``); the fuzzer perturbs one
argument of it with a value its kind refuses (:mod:`error_contract_kinds`) and compares a
snapshot of everything the owning object reaches (buffer bytes, lengths, allocator state) before
and after (derived caches and scratch excepted, listed in ``error_contract_kinds.MEMO``).

Skipped: exception constructors, two classes that users receive rather than build, and the
methods without parameters (listed by introspection, nothing to perturb). A parameter the
fuzzer leaves alone is a ``Fixed`` kind with its reason in the case. The ``ci`` profile runs 20
examples per method (about 15 s on one core, no GPU needed), which leave some (case, argument)
pairs unperturbed, so a deterministic sweep
(``test_sweep_every_bad_value_is_refused_and_changes_nothing``) tries every value of each
kind's ``bad_values`` on every pair (several hundred pairs, over ten thousand calls), and
``test_the_sweep_covers_every_fuzzable_pair`` checks that none is left out. Foreign arrays are
accepted without a copy, so every array kind also draws its refused arrays behind
``__dlpack__`` only and ``__array__`` only, and
``test_a_foreign_array_of_a_wrong_dtype_is_refused`` passes both for every array parameter.
"""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import hypothesis.strategies as st
import numpy as np
import pytest
from error_contract_cases import CASES, CTX, VARIANTS
from error_contract_kinds import (
    Array,
    ArrayOnly,
    DLPackOnly,
    Fixed,
    Ints,
    Scale,
    first_difference,
    snapshot,
)
from hypothesis import given, settings

import hcache
from hcache.errors import CacheCapacityError

CONTRACT = (IndexError, ValueError, TypeError, CacheCapacityError)

# Public callables without arguments to perturb (or not built by users), with the reason.
NO_ARGUMENTS = "takes no argument: nothing to perturb"
SKIPPED = {
    ("CacheCapacityError", "__init__"): "an exception: any message is accepted",
    ("KernelCompileError", "__init__"): "an exception",
    ("KernelLaunchError", "__init__"): "an exception",
    ("MambaSlotCapacityError", "__init__"): "an exception",
    ("BatchInFlightError", "__init__"): "an exception",
    ("KVHeadDimGroupView", "__init__"): "built by HybridCacheManager.get_kv_head_dim_groups",
    ("ContinuousBatchingKVCacheCollection", "__init__"): "built by "
                                                         "ContinuousBatchingKVCacheManager.fetch",
    ("ContinuousBatchingKVCacheManager", "CollectionType"): "MAX's alias of the collection "
                                                            "class, built by fetch",
    ("ContinuousBatchingHybridCollection", "__init__"): "built by "
                                                        "ContinuousBatchingHybridCacheManager.fetch",
    ("arrays.on_device", ""): "a predicate: every value has an answer, none is an error",
    ("device.cuda_free_bytes", ""): "needs a CUDA device; memory.available_bytes is the "
                                    "checked entry point",
    ("CapturedPrompt", "__init__"): "built by PromptCacheStore.capture",
}


# Functions of public modules (README "Binding hcache into your engine") that issue 12's
# interop half added: foreign arrays, aligned allocation, DLPack views, memory checks.
MODULE_FUNCTIONS = {"arrays": ("as_array", "host_array", "on_device"),
                    "device": ("zeros", "cuda_free_bytes"),
                    "dtypes": ("dlpack_view",), "memory": ("available_bytes", "check_fits"),
                    "rings": ("ring_start",)}


def _public_callables():
    """``(owner, method)`` for every public function, constructor and method of
    ``hcache.__all__`` (``(name, "")`` for a function)."""
    out = {}
    for name in hcache.__all__:
        obj = getattr(hcache, name)
        if inspect.isclass(obj):
            out[(name, "__init__")] = obj
            if issubclass(obj, BaseException):
                continue
            names = set(dir(obj)) | {n for klass in obj.__mro__    # Enum's dir() hides some
                                     if klass.__module__.startswith("hcache") for n in vars(klass)}
            for attr in sorted(names):
                static = inspect.getattr_static(obj, attr)
                if attr.startswith("_") or isinstance(static, property):
                    continue
                member = getattr(obj, attr)
                if callable(member) and not isinstance(member, obj):   # enum members
                    out[(name, attr)] = member
        elif callable(obj):
            out[(name, "")] = obj
    for module, names in MODULE_FUNCTIONS.items():
        for name in names:
            out[(f"{module}.{name}", "")] = getattr(getattr(hcache, module), name)
    return out


PUBLIC = _public_callables()


def _parameters(key):
    owner, method = key
    target = PUBLIC[key]
    sig = inspect.signature(target)
    return [p for p in sig.parameters.values()
            if p.name not in ("self", "cls") and p.kind is not p.VAR_POSITIONAL]


for _key in PUBLIC:
    if _key not in CASES and _key not in SKIPPED and not _parameters(_key):
        SKIPPED[_key] = NO_ARGUMENTS


ALL = {**CASES, **VARIANTS}    # key[:2]: (owner, method) of the callable


def test_every_public_callable_has_a_case():
    missing = sorted(k for k in PUBLIC if k not in CASES and k not in SKIPPED)
    assert not missing, f"public callables without an error-contract case: {missing}"
    stale = sorted(k for k in ALL if k[:2] not in PUBLIC)
    assert not stale, f"cases of callables that are not public: {stale}"
    for key, reason in SKIPPED.items():
        if reason == NO_ARGUMENTS:
            assert not _parameters(key), key


@pytest.mark.parametrize("key", sorted(ALL), ids="-".join)
def test_every_parameter_has_a_kind(key):
    names = {p.name for p in _parameters(key[:2]) if p.kind is not p.VAR_KEYWORD}
    kinds = ALL[key].kinds
    assert names <= set(kinds), f"parameters without a kind: {sorted(names - set(kinds))}"


def _call(key, target, kwargs):
    owner, method = key[:2]
    if method in ("", "__init__"):      # a function (of a public module), or a constructor
        module, _, name = owner.rpartition(".")
        return getattr(getattr(hcache, module) if module else hcache, name)(**kwargs)
    return getattr(target, method)(**kwargs)


@pytest.mark.parametrize("key", sorted(ALL), ids="-".join)
def test_valid_calls_succeed(key):
    """The unperturbed call of each case is valid (so a perturbed one tests one argument)."""
    case = ALL[key]
    _, target = case.make()
    _call(key, target, case.args(target))


FUZZED = sorted(k for k, c in ALL.items()
                if any(not isinstance(kind, Fixed) for kind in c.kinds.values()))


def check_refused(key, name, value):
    """Call ``key`` with argument ``name`` replaced by ``value``; check the contract."""
    case = ALL[key]
    root, target = case.make()
    kwargs = case.args(target)
    kwargs[name] = value
    before = snapshot(root)
    with pytest.raises(Exception) as info:  # noqa: PT011 - the type is checked below
        _call(key, target, kwargs)
    exc = info.value
    assert isinstance(exc, CONTRACT) and type(exc).__module__.split(".")[0] in (
        "builtins", "hcache"), f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    message = str(exc)
    labels = [kwargs[n] for n, k in case.kinds.items() if isinstance(k, Fixed) and k.label]
    names = (name, *case.kinds[name].also, *labels)
    assert re.match(rf"({'|'.join(map(re.escape, names))})(\b|\[|\.)", message), \
        f"{type(exc).__name__} does not name {name!r}: {message}"
    after = snapshot(root)
    diff = first_difference(before, after)
    assert diff is None, f"state changed at {diff} by a call that raised {message!r}"


@pytest.mark.parametrize("key", FUZZED, ids="-".join)
@settings(max_examples=20)
@given(data=st.data())
def test_bad_argument_is_refused_and_changes_nothing(key, data):
    case = ALL[key]
    names = sorted(n for n, k in case.kinds.items() if not isinstance(k, Fixed))
    name = data.draw(st.sampled_from(names), label="argument")
    _, target = case.make()
    valid = case.args(target)[name]
    value = data.draw(case.kinds[name].bad(valid), label=name)
    check_refused(key, name, value)


# --- the sweep: every refused value of every kind, for every fuzzable pair ----------------

# (case, parameter) for every parameter the fuzzer perturbs: the ci profile's examples draw
# only some of them, the sweep tries each one with every value of its kind's ``bad_values``.
PAIRS = sorted((k, n) for k in FUZZED for n, kind in ALL[k].kinds.items()
               if not isinstance(kind, Fixed))


def test_the_sweep_covers_every_fuzzable_pair():
    """No (case, parameter) the fuzzer may draw is left out of the sweep, and every swept pair
    has refused values to try."""
    fuzzable = {(k, n) for k, c in ALL.items() for n, kind in c.kinds.items()
                if not isinstance(kind, Fixed)}
    assert set(PAIRS) == fuzzable and len(PAIRS) == len(fuzzable)
    for key, name in PAIRS:
        case = ALL[key]
        _, target = case.make()
        assert case.kinds[name].bad_values(case.args(target)[name]), (key, name)


@pytest.mark.parametrize("key, name", PAIRS, ids=[f"{'-'.join(k)}-{n}" for k, n in PAIRS])
def test_sweep_every_bad_value_is_refused_and_changes_nothing(key, name):
    """Every value of ``bad_values`` for this argument: refused with a contract exception
    naming it, nothing changed (all failures of the pair listed at once)."""
    case = ALL[key]
    _, target = case.make()
    failures = []
    for value in case.kinds[name].bad_values(case.args(target)[name]):
        try:
            check_refused(key, name, value)
        except (AssertionError, pytest.fail.Exception) as e:
            failures.append(f"{name}={value!r}: {str(e).splitlines()[0]}")
    assert not failures, "\n".join(failures)


# --- regression tests: each defect the fuzzer found (issue 12) ------------------------------

REGRESSIONS = [
    # (case, argument, value): wrong exception type, message naming another argument, or
    # accepted although invalid.
    (("MambaSlotAllocator", "register_block_hashes_batch"), "hashes", [2**64]),
    (("MambaSlotAllocator", "register_block_hashes_batch"), "hashes", [-2]),
    (("MambaSlotAllocator", "allocate_slots_batch"), "block_ids", [5, True]),
    (("MambaSlotAllocator", "allocate_slots_batch"), "block_ids", None),
    (("MambaSlotAllocator", "can_allocate_slots"), "block_ids", [5, [0]]),
    (("MambaSlotAllocator", "on_kv_blocks_deregistered"), "block_ids_list", None),
    (("MambaSlotAllocator", "on_kv_blocks_deregistered"), "block_ids_list", [99]),
    (("MambaSlotAllocator", "on_kv_blocks_deregistered"), "hashes_to_delete", ["1"]),
    (("MambaSlotAllocator", "on_kv_blocks_deregistered"), "hashes_to_delete", [2**64]),
    (("MambaSlotAllocator", "get_intermediate_gpu_data"), "prefill_start", 2**63),
    (("MambaSlotAllocator", "restore_to_live"), "request_idx", 1.5),
    (("MambaSlotAllocator", "restore_to_live"), "block_id", -1),
    (("MambaSlotAllocator", "compute_and_store_offsets_batch"), "rows", [0, 0]),
    (("MambaSlotAllocator", "compute_and_store_offsets_batch"), "boundaries", [[2], [4, 5]]),
    (("MambaSlotAllocator", "compute_and_store_offsets"), "matched_block_ids", "3"),
    (("MambaSlotAllocator", "__init__"), "context", None),
    (("KVBlockAllocator", "retain_memory_blocks"), "block_ids", [1, True]),
    (("KVBlockAllocator", "release_memory_blocks"), "block_ids", [1, [0]]),
    (("DynamicInferenceContext", "add_request"), "tokens", [2**63, 1]),
    (("DynamicInferenceContext", "add_request"), "stream", "s"),
    (("DynamicInferenceContext", "commit_step"), "stream", -1),
    (("DynamicInferenceContext", "release_requests"), "request_ids", ["a", "c", "a"]),
    (("DynamicInferenceContext", "release_requests"), "request_ids", None),
    (("DynamicInferenceContext", "release_requests"), "request_ids", ["a", "nope"]),
    (("DynamicInferenceContext", "write_kv"), "request_ids", ["a", "c", "a"]),
    (("DynamicInferenceContext", "__init__"), "kv_dtype", "bogus"),
    (("DynamicInferenceContext", "__init__"), "kv_layer_configs", None),
    (("PagedKVPool", "write_kv"), "k", np.zeros((4, 1, 8), np.int32)),
    (("PagedKVPool", "launch_write"), "checked", 1),
    (("PagedKVPool", "launch_write"), "uniform_tokens", -1),
    (("PagedKVPool", "__init__"), "layer_configs", list),
    (("HybridCacheManager", "get_combined_kv_cache"), "i", 9),
    (("HybridCacheManager", "get_recurrent_state"), "i", 1),
    (("HybridCacheManager", "capture_kv_cache"), "b", -1),
    (("HybridCacheManager", "capture_kv_cache"), "with_scales", "yes"),
    (("HybridCacheManager", "capture_kv_cache"), "with_scales", True),
    (("HybridCacheManager", "set_active_batch_size"), "n", 9),
    (("HybridCacheManager", "write_kv"), "k", np.zeros((3, 1, 8), np.float64)),
    (("HybridCacheManager", "write_kv"), "seq_lengths", [2**63, 1]),
    (("HybridCacheManager", "commit_sequence_length"), "increment", [1, [0]]),
    (("LinearKVCache", "restore_mamba_states"), "ssm", None),
    (("KVCacheManager", "write_kv"), "positions", [[0, True], [3, 4]]),
    (("KVCacheManager", "write_kv"), "positions", [[0, [1]], [3, 4]]),
    (("ContinuousBatchingKVCacheCollection", "write_kv"), "k",
     np.zeros((3, 1, 2), np.float64)),
    (("KVCacheConfig", "__init__"), "layer_configs", tuple),
    (("Device", "__init__"), "kind", "gpu"),
    (("Device", "__init__"), "index", -1),
    (("LayerType", "__init__"), "value", "bogus"),
    (("compute_block_hashes", ""), "tokens", [1, 2, True]),
    # merged with issue 13: latent (MLA) layers take no V, a missing state is no excuse
    (("KVCacheManager", "write_kv", "mla"), "v", np.zeros((2, 2, 1, 8), np.float16)),
    (("HybridCacheManager", "write_kv", "mla"), "v", np.zeros((3, 1, 8), np.float16)),
    (("PagedKVPool", "write_kv", "mla"), "v", np.zeros((4, 1, 8), np.float16)),
    (("ContinuousBatchingKVCacheCollection", "write", "mla"), "value",
     np.zeros((3, 1, 2), np.float16)),
    (("DynamicInferenceContext", "write_kv", "mla-no-conv"), "v", np.zeros((2, 1, 4), np.float16)),
    (("MambaCacheConfig", "__init__", "conv-only"), "head_dim", 1),
    (("MambaCacheConfig", "__init__", "recurrent-only"), "conv_kernel", 2),
    (("MambaCacheManager", "capture_conv_states", "recurrent-only"), "stream", "s"),
    (("MambaCacheManager", "restore_states", "conv-only"), "stream", -1),
    (("MambaCacheManager", "restore_states", "conv-only"), "recurrent",
     [np.zeros((1, 1, 2, 3), np.float32)] * 2),
    (("KVCacheStaticParams", "__init__", "mla"), "is_mla", 1),
    # merged with issue 12's interop half: foreign arrays, sizing, memory
    (("LinearKVCache", "write_kv"), "k", None),
    # merged with issue 10 (the device boundary): its new stream and order parameters. Host
    # lengths ignored ``stream`` (a bad one passed on cpu and failed only on cuda).
    (("rings.ring_start", ""), "stream", "s"),
    (("rings.ring_start", ""), "stream", 2**64),
    (("rings.ring_start", ""), "order", "chain"),
    (("KVCacheManager", "ring_start"), "stream", -1),
    (("HybridCacheManager", "ring_start", "ring"), "stream", 1.5),
    (("ContinuousBatchingKVCacheManager", "ring_start"), "stream", object()),
    (("ContinuousBatchingKVCacheManager", "release"), "stream", "s"),
    (("arrays.as_array", ""), "stream", -1),
    (("arrays.as_array", ""), "device", "gpu"),
    # found by the sweep: an int64 product of a shape wrapped (to 0 bytes: allocated as
    # nothing, then a reshape error), an entry beyond int64 escaped as OverflowError, and a
    # block count beyond the int32 block ids reached np.empty
    (("device.zeros", ""), "shape", [2**62, 4]),
    (("device.zeros", ""), "shape", [2, 2**64]),
    ((CTX, "__init__"), "ssm_states_shape", (2**62, 4)),
    ((CTX, "__init__"), "conv_states_shape", (2**32, 2**31)),
    (("KVBlockAllocator", "__init__"), "num_blocks", 2**63),
    ((CTX, "__init__"), "num_blocks", 2**63),
]


def _foreign_wrong():
    """``(key, name, wrong)`` for every array parameter: a NumPy array of a wrong dtype that
    its kind refuses, to be passed behind a foreign protocol."""
    out = []
    for key, case in sorted(ALL.items()):
        kinds = case.kinds
        for name in sorted(n for n, k in kinds.items() if isinstance(k, (Array, Ints, Scale))):
            kind = kinds[name]
            if isinstance(kind, Scale):
                wrong = np.ones(2, np.float64)
            else:
                _, target = case.make()
                valid = np.asarray(case.args(target)[name])
                if valid.size == 0:
                    continue   # an empty array of any dtype is an empty list, as np.asarray([])
                if isinstance(kind, Ints):
                    wrong = valid.astype(np.float64)
                else:
                    wrong = valid.astype(next(d for d in kind.bad_dtypes
                                              if np.dtype(d) != valid.dtype))
            out.append((key, name, wrong))
    return out


FOREIGN_WRONG = _foreign_wrong()


@pytest.mark.parametrize("wrap", [DLPackOnly, ArrayOnly], ids=["dlpack", "array"])
@pytest.mark.parametrize("key, name, wrong", FOREIGN_WRONG,
                         ids=[f"{'-'.join(k)}-{n}" for k, n, _ in FOREIGN_WRONG])
def test_a_foreign_array_of_a_wrong_dtype_is_refused(key, name, wrong, wrap):
    """Foreign arrays are accepted without a copy, so a ``__dlpack__``-only or an
    ``__array__``-only object of a wrong dtype must be refused as the NumPy array would be,
    naming the argument, with nothing changed (every array parameter, not a sample)."""
    check_refused(key, name, wrap(wrong))


@pytest.mark.parametrize("key, name, value", REGRESSIONS,
                         ids=[f"{'-'.join(k)}-{n}-{i}" for i, (k, n, _) in
                              enumerate(REGRESSIONS)])
def test_regression(key, name, value):
    check_refused(key, name, value)


def test_sizing_counts_state_bytes_exactly():
    """Layout sizes are exact Python ints: a state shape whose int64 product wraps (to 0)
    must count its true bytes, so the capacity check refuses it (oracle: the product by
    hand)."""
    from hcache.config.sizing import context_states_nbytes

    ctx = SimpleNamespace(num_mamba_layers=1, max_requests=1, max_blocks_per_request=1,
                          max_step_tokens=1)
    n = context_states_nbytes(ctx, 0, None, (2**62, 4), None, "float32")
    assert n == 2**64 * 4 + (1 * (1 + 1) + 1 + 1) * 4


def test_release_with_a_bad_stream_releases_nothing():
    """``release(seq_id, stream=<bad>)`` refuses the stream before the block returns to the
    pool: the sequence stays live, its block held, and a later valid release still works."""
    m = hcache.ContinuousBatchingKVCacheManager("float16", hcache.KVCacheStaticParams(1, 2), 2,
                                                4, 1, device="cpu")
    (sid,) = m.claim(1)
    block, free = m.block_of(sid), m.can_claim(2)
    for bad in ("s", -1, 2**64, True, object()):
        with pytest.raises((TypeError, ValueError), match=r"^stream: expected"):
            m.release(sid, stream=bad)
        assert m.block_of(sid) == block and m.can_claim(2) == free
    m.release(sid, stream=None)
    assert m.can_claim(2)
    with pytest.raises(ValueError, match=r"^seq_id"):
        m.block_of(sid)


def test_ring_start_refuses_a_bad_stream_for_host_lengths():
    """On cpu (host lengths) ``stream`` is validated as on cuda: the same call must not pass
    on one device and fail on the other."""
    from hcache.rings import ring_start

    assert ring_start(np.array([2, 7]), 3, "cpu", stream=0).tolist() == [0, 1]
    assert ring_start(7, 3, stream=None) == 1
    with pytest.raises(ValueError, match=r"^stream: expected a cudaStream_t handle"):
        ring_start(np.array([2, 7]), 3, "cpu", stream=2**64)
    with pytest.raises(TypeError, match=r"^stream: expected"):
        ring_start(7, 3, stream="s")


def test_messages_name_the_callers_argument_exactly():
    """Spot checks of the messages themselves (the fuzzer only checks their first word)."""
    case = CASES[("MambaSlotAllocator", "register_block_hashes_batch")]
    _, alloc = case.make()
    with pytest.raises(ValueError, match=r"^hashes\[0\]: expected an int64 value in "
                                         r"\[-2\*\*63, 2\*\*63\), got 18446744073709551616$"):
        alloc.register_block_hashes_batch([0], [2**64])
    with pytest.raises(TypeError, match=r"^request_idx: expected an int, got float$"):
        alloc.restore_to_live(1.5, 0)
    with pytest.raises(TypeError, match=r"^block_ids_list: expected a 1-D sequence of ints, "
                                        r"got NoneType$"):
        alloc.on_kv_blocks_deregistered(None, set())


def test_a_missing_part_is_refused_naming_the_layer_argument():
    """A view of a state or a plane the layer does not have (issue 13's latent layers and
    missing states) is refused as a bad ``i``."""
    from error_contract_cases import CONV_ONLY, RECURRENT_ONLY, make_hybrid_mla, make_mamba_of

    hybrid, _ = make_hybrid_mla()
    with pytest.raises(ValueError, match=r"^i: expected a layer with separate K and V, "
                                         r"got layer 3, a latent"):
        hybrid.get_separate_kv_cache(3)
    with pytest.raises(ValueError, match=r"^i: expected a layer with a recurrent state, "
                                         r"got layer 0, a conv-only"):
        hybrid.get_recurrent_state(0)
    conv_only, _ = make_mamba_of(CONV_ONLY)()
    with pytest.raises(ValueError, match=r"^i: expected a layer with a recurrent state"):
        conv_only.get_recurrent_state(1)
    assert conv_only.capture_recurrent_states(1) == []
    lightning, _ = make_mamba_of(RECURRENT_ONLY)()
    with pytest.raises(ValueError, match=r"^i: expected a layer with a conv state"):
        lightning.get_conv_state(0)
    with pytest.raises(ValueError, match=r"^head_dim: expected 0 since num_heads and "
                                         r"state_size are 0 .*got 2$"):
        hcache.MambaCacheConfig(1, 2, 0, 2, 0, 4, 2)


def test_sets_and_mappings_are_refused_where_a_sequence_of_ints_is_due():
    """Issue 21 item 6: a set used to be read in its own order without repeats
    (``{5, 4, 5}`` gave lengths [4, 5]) and a mapping as its keys (``{0: 2, 1: 1, 2: 0}`` ran
    the identity); both are refused, naming the argument, and change nothing."""
    from test_batch_api import hybrid

    from hcache import ContinuousBatchingKVCacheManager, KVCacheStaticParams

    from helpers import host

    m = hybrid()
    m.reset_for_new_sequences([3, 1, 2])
    before = (host(m.get_kv_cache_lengths()).tolist(), m.active_batch_size)
    with pytest.raises(TypeError,
                       match=r"^reuse_kv_cache_lengths: expected a sequence of ints .*set"):
        m.reset_for_new_sequences({5, 4})
    with pytest.raises(TypeError, match=r"^batch_mapping: expected a sequence of ints .*dict"):
        m.compact_batch({0: 2, 1: 1, 2: 0}, 3, 3)
    assert (host(m.get_kv_cache_lengths()).tolist(), m.active_batch_size) == before
    c = ContinuousBatchingKVCacheManager("float16", KVCacheStaticParams(1, 4), max_batch_size=2,
                                         max_seq_len=8, num_layers=1, device="cpu")
    ids = c.claim(2)
    with pytest.raises(TypeError, match=r"^seq_ids: expected a sequence of ints .*frozenset"):
        c.fetch(frozenset(ids))
    batch = c.fetch(ids)
    with pytest.raises(TypeError, match=r"^valid_lengths: expected a sequence of ints .*set"):
        c.step({1, 2}, batch)
