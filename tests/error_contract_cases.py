"""One valid call of every public method of every public class and function of ``hcache``
(``hcache.__all__``), on small objects with some state, and the kind of each parameter.

``CASES[(owner, method)]`` is a :class:`Case`: ``make()`` builds ``(root, target)`` (``root`` is
what the snapshot covers: the object that owns all the state the call may touch, ``target`` the
object whose method is called), ``args(target)`` the valid keyword arguments, and ``kinds`` what
each parameter accepts (see :mod:`error_contract_kinds`). Constructors are ``(class,
"__init__")`` with ``root = target = None``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from error_contract_kinds import (
    Absent,
    AnyArray,
    Array,
    Arrays,
    BlockKeys,
    Bool,
    Callable,
    Choice,
    Fixed,
    Index,
    Instance,
    Int,
    Ints,
    Junk,
    Key,
    Keys,
    Lengths,
    OnlyNone,
    Salt,
    Scale,
    Seconds,
    Stream,
)

import hcache
from hcache import (
    ContinuousBatchingKVCacheManager,
    Device,
    DynamicInferenceContext,
    HybridCacheConfig,
    HybridCacheManager,
    KVBlockAllocator,
    KVCacheConfig,
    KVCacheManager,
    KVCacheStaticParams,
    KVLayerConfig,
    LayerType,
    LinearCacheConfig,
    LinearKVCache,
    MambaCacheConfig,
    MambaCacheManager,
    PagedKVPool,
)

CPU = "cpu"


class Case:
    def __init__(self, make, args, kinds):
        self.make, self.args, self.kinds = make, args, kinds


CASES: dict[tuple[str, str], Case] = {}
# More cases of a callable, on another kind of object (a latent MLA layer, a missing state):
# ``(owner, method, variant)``; validated and fuzzed as the cases are.
VARIANTS: dict[tuple[str, str, str], Case] = {}


def case(owner, method, make, args, /, **kinds):
    CASES[(owner, method)] = Case(make, args, kinds)


def ctor(cls, args, /, **kinds):
    CASES[(cls.__name__, "__init__")] = Case(lambda: (None, None), lambda _: dict(args), kinds)


def fn(fname, args, /, **kinds):
    CASES[(fname, "")] = Case(lambda: (None, None), lambda _: dict(args), kinds)


def rows(shape, dtype=np.float16, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# --- functions and small value classes -----------------------------------------------------

fn("resolve_device", {"device": "cpu"}, device=Choice(none_ok=True))
fn("dtype_name", {"dtype": "float16"}, dtype=Choice())
fn("resolve_dtype", {"dtype": "float16", "name": "dtype"}, dtype=Choice(),
   name=Fixed("the label of the checked argument", label=True))
TOKENS = (-(2**63), 2**63 - 1)      # token ids: any int64
fn("compute_block_hashes", {"tokens": [1, 2, 3, 4, 5], "block_size": 2, "salt": "tenant",
                            "extra_keys": {0: b"img", 2: [b"a", "b"]}},
   tokens=Ints(*TOKENS, fixed_length=False), block_size=Int(1),
   salt=Salt(), extra_keys=BlockKeys(3))

ctor(Device, {"kind": "cpu", "index": 0}, kind=Choice(), index=Int(0))
ctor(KVLayerConfig, {"num_kv_heads": 2, "head_dim": 4, "sliding_window": None,
                     "components": 2},
     num_kv_heads=Int(1), head_dim=Int(1), sliding_window=Int(1, none_ok=True),
     components=Int(1, 2))
ctor(KVCacheConfig, {"max_batch_size": 2, "max_sequence_length": 4,
                     "layer_configs": (KVLayerConfig(1, 4),), "dtype": "float16"},
     max_batch_size=Int(1), max_sequence_length=Int(1, 2**31 - 1),
     layer_configs=Instance(), dtype=Choice())
ctor(MambaCacheConfig, {"num_layers": 1, "max_batch_size": 2, "num_heads": 1, "head_dim": 2,
                        "state_size": 2, "conv_dim": 2, "conv_kernel": 2,
                        "ssm_dtype": "float32", "conv_dtype": "float16"},
     num_layers=Int(0), max_batch_size=Int(1), num_heads=Int(1), head_dim=Int(1),
     state_size=Int(1), conv_dim=Int(1), conv_kernel=Int(1), ssm_dtype=Choice(),
     conv_dtype=Choice())
ctor(HybridCacheConfig, {"layer_types": ("attention", "mamba"),
                         "kv": KVCacheConfig(2, 4, (KVLayerConfig(1, 4),)),
                         "mamba": MambaCacheConfig(1, 2, 1, 2, 2, 2, 2),
                         "max_batch_size": 2, "kv_sharing": None},
     layer_types=Instance(), kv=Instance(), mamba=Instance(),
     max_batch_size=Int(2, 2).relating("kv", "mamba"), kv_sharing=Instance(none_ok=True))
ctor(LinearCacheConfig, {"num_attention_layers": 1, "max_batch_size": 2,
                         "max_sequence_length": 4, "num_kv_heads": 1, "head_dim": 4,
                         "dtype": "float16", "num_mamba_layers": 0, "mamba_num_heads": 0,
                         "mamba_head_dim": 0, "ssm_state_size": 0, "ssm_dtype": "float32",
                         "conv_dim": 0, "conv_kernel": 0, "conv_dtype": "float16"},
     num_attention_layers=Int(0), max_batch_size=Int(1), max_sequence_length=Int(1, 2**31 - 1),
     num_kv_heads=Int(1), head_dim=Int(1), dtype=Choice(), num_mamba_layers=Int(0),
     mamba_num_heads=Int(0), mamba_head_dim=Int(0), ssm_state_size=Int(0), ssm_dtype=Choice(),
     conv_dim=Int(0), conv_kernel=Int(0), conv_dtype=Choice())
ctor(KVCacheStaticParams, {"num_heads": 1, "head_size": 2, "is_mla": False}, num_heads=Int(1),
     head_size=Int(1), is_mla=Bool())
# --- sizing before allocation, and the interop functions of hcache.device / dtypes / memory --

_BUDGET = {"budget": 4096}
for _cfg in (KVCacheConfig(2, 4, (KVLayerConfig(1, 4),)), MambaCacheConfig(1, 2, 1, 2, 2, 2, 2),
             HybridCacheConfig(("attention", "mamba"), KVCacheConfig(2, 4, (KVLayerConfig(1, 4),)),
                               MambaCacheConfig(1, 2, 1, 2, 2, 2, 2), 2),
             LinearCacheConfig(1, 2, 4, 1, 4)):
    case(type(_cfg).__name__, "max_batch_size_for", lambda c=_cfg: (c, c), lambda _: _BUDGET,
         budget=Int(0))
_STATIC = KVCacheStaticParams(1, 2)
_SIZES = {"dtype": "float16", "max_seq_len": 6, "num_layers": 2}
case("KVCacheStaticParams", "nbytes", lambda: (_STATIC, _STATIC),
     lambda _: dict(_SIZES, max_batch_size=3), dtype=Choice(), max_batch_size=Int(1),
     max_seq_len=Int(1, 2**31 - 1), num_layers=Int(1))
case("KVCacheStaticParams", "max_batch_size_for", lambda: (_STATIC, _STATIC),
     lambda _: dict(_SIZES, budget=4096), budget=Int(0), dtype=Choice(),
     max_seq_len=Int(1, 2**31 - 1), num_layers=Int(1))
_POOL_LAYERS = [KVLayerConfig(2, 4), KVLayerConfig(1, 8, components=1)]
case("PagedKVPool", "nbytes_for", lambda: (None, PagedKVPool),
     lambda _: {"layer_configs": list(_POOL_LAYERS), "num_blocks": 6, "block_size": 2,
                "dtype": "float16"},
     layer_configs=Instance(), num_blocks=Int(1), block_size=Int(1), dtype=Choice())
case("PagedKVPool", "num_blocks_for", lambda: (None, PagedKVPool),
     lambda _: {"layer_configs": list(_POOL_LAYERS), "block_size": 2, "budget": 4096,
                "dtype": "float16"},
     layer_configs=Instance(), block_size=Int(1), budget=Int(0), dtype=Choice())
_LABEL = Fixed("the label of the checked argument", label=True)
fn("arrays.as_array", {"name": "x", "value": np.zeros((2, 3), np.float16), "device": CPU,
                       "stream": None},
   name=_LABEL, value=AnyArray(), device=Choice(none_ok=True), stream=Stream())
fn("arrays.host_array", {"name": "x", "value": np.zeros(3, np.int32)}, name=_LABEL,
   value=AnyArray())
fn("device.zeros", {"device": CPU, "shape": (2, 3), "dtype": "bfloat16"},
   device=Choice(none_ok=True), shape=Ints(0, 2**63 - 1, fixed_length=False), dtype=Choice())
fn("dtypes.dlpack_view", {"array": np.zeros(2, hcache.dtypes.resolve_dtype("bfloat16"))},
   array=AnyArray())
fn("memory.available_bytes", {"device": CPU}, device=Choice(none_ok=True))
fn("memory.check_fits", {"name": "x", "nbytes": 1, "device": CPU}, name=_LABEL,
   nbytes=Int(0), device=Choice(none_ok=True))

ctor(LayerType, {"value": "attention"}, value=Choice(),
     **{n: Fixed("the functional API of Enum, not a lookup") for n in
        ("names", "module", "qualname", "type", "start", "boundary")})

case("LayerType", "coerce", lambda: (None, LayerType), lambda _: {"value": "mamba", "name": "kind"},
     value=Choice(), name=Fixed("the label of the checked argument", label=True))


def _hf():
    return {"model_type": "nemotron_h", "hybrid_override_pattern": "M*", "hidden_size": 8,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
            "mamba_num_heads": 2, "mamba_head_dim": 4, "ssm_state_size": 2, "n_groups": 1,
            "conv_kernel": 2, "num_hidden_layers": 2}


case("HybridCacheConfig", "from_hf_config", lambda: (None, HybridCacheConfig),
     lambda _: {"config_dict": _hf(), "max_batch_size": 2, "max_sequence_length": 4,
                "kv_dtype": "float16", "ssm_dtype": "float32", "conv_dtype": None},
     config_dict=Instance().relating("model_type"), max_batch_size=Int(1),
     max_sequence_length=Int(1, 2**31 - 1),
     kv_dtype=Choice(), ssm_dtype=Choice(), conv_dtype=Choice(none_ok=True))

# --- slot managers -------------------------------------------------------------------------

KV_CFG = KVCacheConfig(3, 6, (KVLayerConfig(2, 4), KVLayerConfig(1, 8)))
MAMBA_CFG = MambaCacheConfig(2, 3, 1, 2, 3, 4, 2)
HYB_CFG = HybridCacheConfig(("mamba", "attention", "mamba", "attention"), KV_CFG, MAMBA_CFG, 3)
LIN_CFG = LinearCacheConfig(2, 3, 6, 1, 4, num_mamba_layers=1, mamba_num_heads=1,
                            mamba_head_dim=2, ssm_state_size=3, conv_dim=4, conv_kernel=2)


def _filled(mgr):
    """Random bytes in every cache buffer, so a write of zeros would be seen."""
    rng = np.random.default_rng(1)
    for a in _buffers(mgr):
        a.view(np.uint8)[...] = rng.integers(0, 256, a.nbytes, dtype=np.uint8).reshape(
            a.view(np.uint8).shape)
    return mgr


def _buffers(mgr):
    if isinstance(mgr, KVCacheManager):
        return [mgr.get_combined_kv_cache(i) for i in range(mgr.num_layers)]
    if isinstance(mgr, MambaCacheManager):
        return list(mgr.state_tensors)
    if isinstance(mgr, HybridCacheManager):
        out = _buffers(mgr.kv_cache_manager)
        return out + (_buffers(mgr.mamba_cache_manager) if mgr.mamba_cache_manager else [])
    if isinstance(mgr, LinearKVCache):
        return [mgr.get_kv_cache_buffer()] + [mgr.get_ssm_state_for_layer(i) for i in range(1)] \
            + [mgr.get_conv_state_for_layer(i) for i in range(1)]
    return []


def make_kv():
    m = _filled(KVCacheManager(KV_CFG, device=CPU))
    return m, m


def make_mamba():
    m = _filled(MambaCacheManager(MAMBA_CFG, device=CPU))
    return m, m


def make_hybrid():
    m = _filled(HybridCacheManager(HYB_CFG, device=CPU))
    m.reset_for_new_sequences([2, 2])
    return m, m


def make_linear():
    m = _filled(LinearKVCache(LIN_CFG, device=CPU))
    m.reset_for_new_sequences([2, 2])
    return m, m


I3, B3, S6 = Index(3), Index(3), Int(0, 6)
FP8 = "float8_e4m3fn"


def make_fp8(owner):
    def make():
        kv = KVCacheConfig(3, 6, KV_CFG.layer_configs, FP8)
        if owner == "KVCacheManager":
            m = KVCacheManager(kv, device=CPU)
        elif owner == "HybridCacheManager":
            m = HybridCacheManager(HybridCacheConfig(HYB_CFG.layer_types, kv, MAMBA_CFG, 3),
                                   device=CPU)
        else:
            m = LinearKVCache(LinearCacheConfig(2, 3, 6, 1, 4, FP8), device=CPU)
        return m, m
    return make

for owner, make in (("KVCacheManager", make_kv), ("HybridCacheManager", make_hybrid),
                    ("LinearKVCache", make_linear), ("MambaCacheManager", make_mamba)):
    cfg = {"KVCacheManager": KV_CFG, "HybridCacheManager": HYB_CFG, "LinearKVCache": LIN_CFG,
           "MambaCacheManager": MAMBA_CFG}[owner]
    ctor_cls = getattr(hcache, owner)
    CASES[(owner, "__init__")] = Case(
        lambda: (None, None), lambda _, cfg=cfg: {"config": cfg, "stream": None, "device": CPU},
        {"config": Instance(), "stream": Stream(), "device": Choice(none_ok=True)})
    for meth in ("refused_commit_count", "refresh_host_lengths", "skipped_kv_write_count",
                 "last_compaction_valid", "clear_states", "clear_mamba_states"):
        if hasattr(ctor_cls, meth):
            case(owner, meth, make, lambda _: {"stream": None}, stream=Stream())

_LAYER_GETTERS = {
    "KVCacheManager": (("get_combined_kv_cache", 2), ("get_separate_kv_cache", 2),
                       ("get_layer_config", 2)),
    "MambaCacheManager": (("get_recurrent_state", 2), ("get_conv_state", 2)),
    "HybridCacheManager": (("get_layer_type", 4), ("get_combined_kv_cache", 4),
                           ("get_separate_kv_cache", 4), ("get_recurrent_state", 4),
                           ("get_conv_state", 4)),
    "LinearKVCache": (("get_combined_kv_cache_for_decoder_layer", 2),
                      ("get_separate_kv_cache_for_decoder_layer", 2),
                      ("get_ssm_state_for_layer", 1), ("get_conv_state_for_layer", 1),
                      ("get_recurrent_state", 1), ("get_conv_state", 1)),
}
_VALID_LAYER = {("HybridCacheManager", "get_recurrent_state"): 0,
                ("HybridCacheManager", "get_conv_state"): 0,
                ("HybridCacheManager", "get_combined_kv_cache"): 1,
                ("HybridCacheManager", "get_separate_kv_cache"): 1}
for owner, getters in _LAYER_GETTERS.items():
    make = {"KVCacheManager": make_kv, "MambaCacheManager": make_mamba,
            "HybridCacheManager": make_hybrid, "LinearKVCache": make_linear}[owner]
    for meth, n in getters:
        valid = _VALID_LAYER.get((owner, meth), 0)
        case(owner, meth, make, lambda _, v=valid: {"i": v}, i=Index(n))

for owner, make in (("KVCacheManager", make_kv), ("HybridCacheManager", make_hybrid)):
    case(owner, "capture_kv_cache", make,
         lambda _: {"b": 1, "sequence_length": 3, "stream": None, "with_scales": False},
         b=B3, sequence_length=S6, stream=Stream(), with_scales=Bool())
    case(owner, "restore_kv_cache", make,
         lambda m: {"saved": [rows((2, 2, 3, 4), seed=2), rows((2, 1, 3, 8), seed=3)],
                    "b": 2, "stream": None, "scales": None},
         saved=Arrays(), b=B3, stream=Stream(), scales=Instance(none_ok=True))
    case(owner, "set_kv_scales", make_fp8(owner),
         lambda _: {"k_scale": 0.5, "v_scale": np.full(2, 0.25, np.float32), "stream": None},
         k_scale=Scale(), v_scale=Scale(), stream=Stream())

case("KVCacheManager", "write_kv", make_kv,
     lambda _: {"layer": 1, "k": rows((2, 2, 1, 8)), "v": rows((2, 2, 1, 8), seed=1),
                "seq_lengths": None, "positions": [[0, 1], [3, 4]], "k_scale": None,
                "v_scale": None, "stream": None},
     layer=Index(2, none_ok=True), k=Array(), v=Array(),
     seq_lengths=Fixed("None is the valid value; bad lengths are fuzzed on HybridCacheManager"),
     positions=Ints(-1, 5), k_scale=OnlyNone(), v_scale=OnlyNone(),
     stream=Stream())
for owner, make, layer in (("HybridCacheManager", make_hybrid, 3),
                           ("LinearKVCache", make_linear, 1)):
    dim = 8 if owner == "HybridCacheManager" else 4
    case(owner, "write_kv", make,
         lambda _, layer=layer, dim=dim: {"layer": layer, "k": rows((3, 1, dim)),
                                         "v": rows((3, 1, dim), seed=1),
                    "seq_lengths": [2, 1], "positions": None, "k_scale": None,
                    "v_scale": None, "stream": None},
         layer=(Index(4) if owner == "HybridCacheManager" else Index(2)).relating("k"),
         k=Array(), v=Array(), seq_lengths=Ints(0, 4).relating("k", "v"),
         positions=Fixed("None is valid with seq_lengths"),
         k_scale=OnlyNone(), v_scale=OnlyNone(), stream=Stream())
    case(owner, "set_active_batch_size", make, lambda _: {"n": 1}, n=Int(0, 3))
    case(owner, "reset_for_new_sequences", make,
         lambda _: {"reuse_kv_cache_lengths": [1, 2, 0], "stream": None},
         reuse_kv_cache_lengths=Ints(0, 6, fixed_length=False), stream=Stream())
    case(owner, "commit_sequence_length", make, lambda _: {"increment": [1, 2], "stream": None},
         increment=Ints(0, 4), stream=Stream())
    case(owner, "compact_batch", make,
         lambda _: {"batch_mapping": [1, 0], "old_batch": 2, "new_batch": 2, "stream": None},
         batch_mapping=Ints(-1, 1, unique=True), old_batch=Int(2, 2), new_batch=Int(0, 3),
         stream=Stream())

case("LinearKVCache", "set_kv_scales", make_fp8("LinearKVCache"),
     lambda _: {"k_scale": 0.5, "v_scale": np.full(2, 0.25, np.float32), "stream": None},
     k_scale=Scale(), v_scale=Scale(), stream=Stream())
for owner, make in (("HybridCacheManager", make_hybrid), ("LinearKVCache", make_linear),
                    ("MambaCacheManager", make_mamba)):
    cap = {"HybridCacheManager": ("capture_recurrent_states", "capture_conv_states"),
           "LinearKVCache": ("capture_ssm_states", "capture_conv_states"),
           "MambaCacheManager": ("capture_recurrent_states", "capture_conv_states")}[owner]
    for meth in cap:
        case(owner, meth, make, lambda _: {"b": 1, "stream": None}, b=B3, stream=Stream())
    restore, first = {"HybridCacheManager": ("restore_mamba_states", "recurrent"),
                      "LinearKVCache": ("restore_mamba_states", "ssm"),
                      "MambaCacheManager": ("restore_states", "recurrent")}[owner]
    nl = 1 if owner == "LinearKVCache" else 2
    shapes = ((1, 2, 3), (4, 2)) if owner != "LinearKVCache" else ((1, 2, 3), (4, 2))
    case(owner, restore, make,
         lambda _, nl=nl, shapes=shapes, first=first: {
             first: [rows((1, *shapes[0]), np.float32, seed=i) for i in range(nl)],
             "conv": [rows((1, *shapes[1]), seed=i) for i in range(nl)], "b": 1,
             "stream": None},
         **{first: Arrays(squeezable=True), "conv": Arrays(squeezable=True), "b": B3,
            "stream": Stream()})


def make_drafts(make):
    """A manager (with some active lengths) whose ``_drafts`` are its DraftStates of 3 tokens,
    filled with random bytes: the manager is the root, so the drafts are in the snapshot."""
    def build():
        m, _ = make()
        m._drafts = hcache.DraftStates(m, 3)
        rng = np.random.default_rng(2)
        for a in m._drafts._drafts:
            a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, dtype=np.uint8)
        return m, m
    return build


for owner, make in (("HybridCacheManager", make_hybrid), ("LinearKVCache", make_linear)):
    case(owner, "commit_draft", make_drafts(make),
         lambda m: {"accepted": [1, 2], "num_draft_tokens": 2, "draft_states": m._drafts,
                    "bonus_token": False, "stream": None},
         accepted=Ints(0, 2), num_draft_tokens=Int(0, 3), draft_states=Instance(),
         bonus_token=Bool(), stream=Stream())
CASES[("DraftStates", "__init__")] = Case(
    lambda: (None, None),
    lambda _: {"manager": make_hybrid()[0], "max_draft_tokens": 2, "stream": None},
    {"manager": Instance(), "max_draft_tokens": Int(1, (2**31 - 1) // 3), "stream": Stream()})


def make_draft_states():
    m, _ = make_drafts(make_hybrid)()
    return m, m._drafts


for meth in ("get_recurrent_draft", "get_conv_draft"):
    case("DraftStates", meth, make_draft_states, lambda _: {"i": 0}, i=Index(4))
case("MambaCacheManager", "clear_slot", make_mamba, lambda _: {"b": 1, "stream": None},
     b=B3, stream=Stream())


# --- continuous batching -------------------------------------------------------------------

def make_cb(fetched=False):
    def make():
        m = ContinuousBatchingKVCacheManager("float16", KVCacheStaticParams(1, 2), 3, 6, 2,
                                             device=CPU)
        m.blocks_buf.view(np.uint8)[...] = np.random.default_rng(0).integers(
            0, 256, m.blocks_buf.view(np.uint8).shape, dtype=np.uint8)
        ids = m.claim(2)
        c = m.fetch(ids)
        c.write(0, rows((2, 1, 1, 2)), rows((2, 1, 1, 2), seed=1))
        m.step([1, 1], c)
        if fetched:
            return m, m.fetch(ids)
        return m, m
    return make


CB = "ContinuousBatchingKVCacheManager"
CASES[(CB, "__init__")] = Case(
    lambda: (None, None),
    lambda _: {"dtype": "float16", "kv_params": KVCacheStaticParams(1, 2), "max_batch_size": 2,
               "max_seq_len": 4, "num_layers": 1, "device": CPU},
    {"dtype": Choice(), "kv_params": Instance(), "max_batch_size": Int(1),
     "max_seq_len": Int(1, 2**31 - 1), "num_layers": Int(1), "device": Choice(none_ok=True)})
case(CB, "can_claim", make_cb(), lambda _: {"batch_size": 1}, batch_size=Int(0))
case(CB, "claim", make_cb(), lambda _: {"batch_size": 1}, batch_size=Int(0, 1))
case(CB, "block_of", make_cb(), lambda _: {"seq_id": 0}, seq_id=Key(unknown=(99, -1, 2**70)))
case(CB, "release", make_cb(), lambda _: {"seq_id": 0, "stream": None},
     seq_id=Key(unknown=(99, -1, 2**70)), stream=Stream())
case(CB, "fetch", make_cb(), lambda _: {"seq_ids": [0, 1], "wait": False, "timeout": None,
                                        "stream": None},
     seq_ids=Keys(unknown=99), wait=Bool(), timeout=Seconds(),
     stream=Stream())


def _cb_step_args(m):
    return {"valid_lengths": [1, 2], "collection": m.fetch([0, 1])}


def make_cb_in_flight():
    m, _ = make_cb()()
    return m, m


case(CB, "step", make_cb_in_flight, _cb_step_args, valid_lengths=Ints(0, 5),
     collection=Instance())
case(CB, "step_draft", make_cb_in_flight,
     lambda m: {"accepted": [1, 2], "num_draft_tokens": 3, "collection": m.fetch([0, 1]),
                "bonus_token": True},
     accepted=Ints(0, 2), num_draft_tokens=Int(1, 2**31 - 1), collection=Instance(),
     bonus_token=Bool())
COLL = "ContinuousBatchingKVCacheCollection"
for meth in ("key_cache", "value_cache"):
    case(COLL, meth, make_cb(fetched=True), lambda _: {"layer": 1}, layer=Index(2))
for meth, names in (("write", ("key", "value")), ("write_kv", ("k", "v"))):
    extra = {} if meth == "write" else {"k_scale": None, "v_scale": None}
    case(COLL, meth, make_cb(fetched=True),
         lambda _, names=names, extra=extra: {"layer": 1, names[0]: rows((3, 1, 2)),
                                              names[1]: rows((3, 1, 2), seed=1),
                                              "seq_lengths": [2, 1], "stream": None, **extra},
         layer=Index(2), seq_lengths=Ints(0, 5).relating(*names), stream=Stream(),
         **{names[0]: Array(), names[1]: Array()},
         **({} if meth == "write" else {"k_scale": OnlyNone(), "v_scale": OnlyNone()}))


# --- paged pool, allocators, context ----------------------------------------------------------

def make_pool():
    p = PagedKVPool([KVLayerConfig(2, 4), KVLayerConfig(1, 8)], 6, 2, device=CPU)
    for a in p.layers:
        a.view(np.uint8)[...] = np.random.default_rng(0).integers(
            0, 256, a.view(np.uint8).shape, dtype=np.uint8)
    return p, p


CASES[("PagedKVPool", "__init__")] = Case(
    lambda: (None, None),
    lambda _: {"layer_configs": [KVLayerConfig(1, 4)], "num_blocks": 2, "block_size": 2,
               "dtype": "float16", "device": CPU, "extra_nbytes": 64},
    {"layer_configs": Instance(), "num_blocks": Int(1), "block_size": Int(1),
     "dtype": Choice(), "device": Choice(none_ok=True), "extra_nbytes": Int(0)})
case("PagedKVPool", "get_layer", make_pool, lambda _: {"i": 1}, i=Index(2))
case("PagedKVPool", "copy_blocks", make_pool,
     lambda _: {"src_ids": [0, 1], "dst_ids": [2, 3], "status": None, "stream": None},
     src_ids=Ints(-1, 5).relating("dst_ids"), dst_ids=Ints(-1, 5, unique=True),
     status=Junk(), stream=Stream())
def _table():
    """A block table: a narrower one is valid (positions past it are skipped and counted)."""
    return Array(bad_dtypes=(np.int64, np.float32), free_last=True)


_POOL_WRITE = {"layer": 1, "block_table": np.array([[0, 1], [2, -1]], np.int32),
               "seq_offsets": None, "uniform_tokens": 2, "batch": None, "cache_lengths": None,
               "positions": None, "k_scale": None, "v_scale": None, "status": None,
               "stream": None}
for meth in ("write", "write_kv"):
    case("PagedKVPool", meth, make_pool,
         lambda _: {"k": rows((4, 1, 8)), "v": rows((4, 1, 8), seed=1), **_POOL_WRITE},
         k=Array(), v=Array(), layer=Index(2, none_ok=True),
         block_table=_table(),
         seq_offsets=Junk(), uniform_tokens=Int(1).relating("seq_offsets"), batch=Junk(),
         cache_lengths=Junk(), positions=Junk(),
         k_scale=OnlyNone(), v_scale=OnlyNone(),
         status=Junk(), stream=Stream())
case("PagedKVPool", "check_write", make_pool,
     lambda _: {"k": rows((4, 1, 8)), "v": rows((4, 1, 8), seed=1), "layer": 1,
                "k_scale": None, "v_scale": None, "num_tokens": 4},
     k=Array(), v=Array(), layer=Index(2, none_ok=True), k_scale=OnlyNone(),
     v_scale=OnlyNone(), num_tokens=Int(0, none_ok=True).relating("k"))
case("PagedKVPool", "launch_write", make_pool,
     lambda p: {"checked": p.check_write(rows((4, 1, 8)), rows((4, 1, 8), seed=1), layer=1),
                "block_table": np.array([[0, 1], [2, -1]], np.int32), "stream": None,
                "uniform_tokens": 2},
     checked=Instance(none_ok=True), block_table=_table(),
     stream=Stream(), uniform_tokens=Int(1).relating("seq_offsets"))

ALLOC = "KVBlockAllocator"


def make_alloc():
    a = KVBlockAllocator(8)
    ids = a.allocate_memory_blocks(4)                      # 0..3 held
    a.register_kv_block_hashes(ids[:2], [11, 12], [0, 11])
    a.release_memory_blocks(ids[:1])                       # block of hash 11 cached
    a.advance_clock(3)
    return a, a


def _held(a):
    return [int(b) for b in np.flatnonzero(np.asarray(a.block_ref_counts) > 0)]


CASES[(ALLOC, "__init__")] = Case(
    lambda: (None, None),
    lambda _: {"num_blocks": 4, "enable_prefix_caching": True, "eviction_policy": "lru"},
    {"num_blocks": Int(1, 2**31 - 1), "enable_prefix_caching": Bool(),
     "eviction_policy": Choice()})
case(ALLOC, "add_blocks_deregistered_observer", make_alloc, lambda _: {"fn": print},
     fn=Callable())
case(ALLOC, "add_released_observer", make_alloc, lambda _: {"fn": print}, fn=Callable())
case(ALLOC, "advance_clock", make_alloc, lambda _: {"steps": 1}, steps=Int(0, 2**63 - 1 - 3))
case(ALLOC, "allocate_memory_blocks", make_alloc, lambda _: {"n": 2, "retained": [0]}, n=Int(0),
     retained=Ints(0, 7, fixed_length=False, none_ok=True))
case(ALLOC, "allocate_memory_blocks_per_request", make_alloc, lambda _: {"counts": [1, 0, 2]},
     counts=Ints(0, fixed_length=False))
case(ALLOC, "can_allocate_memory_blocks", make_alloc, lambda _: {"n": 5, "retained": [0]},
     n=Int(0), retained=Ints(0, 7, fixed_length=False, none_ok=True))
case(ALLOC, "evict_lru_blocks", make_alloc, lambda _: {"n": 1}, n=Int(0))
case(ALLOC, "get_evictable_block_count", make_alloc, lambda _: {"block_ids": [0, 1]},
     block_ids=Ints(0, 7, fixed_length=False, none_ok=True))
case(ALLOC, "is_memory_available", make_alloc, lambda _: {"n": 2, "potential_matched_count": 1},
     n=Int(0), potential_matched_count=Int(0))
case(ALLOC, "register_kv_block_hashes", make_alloc,
     lambda _: {"block_ids": [2, 3], "hashes": [21, 22], "parent_hashes": [0, 21]},
     block_ids=Ints(0, 7, unique=True).relating("hashes"), hashes=Ints(1, 2**63 - 1),
     parent_hashes=Ints(-(2**63), 2**63 - 1, none_ok=True))
case(ALLOC, "release_memory_blocks", make_alloc, lambda a: {"block_ids": _held(a)[:2]},
     block_ids=Ints(0, 7, fixed_length=False))
case(ALLOC, "retain_memory_blocks", make_alloc, lambda a: {"block_ids": [1, 2]},
     block_ids=Ints(0, 7, fixed_length=False))

CTX = "DynamicInferenceContext"
_CTX_ARGS = {"kv_layer_configs": [KVLayerConfig(1, 4)], "num_blocks": 12,
             "block_size_tokens": 2, "max_requests": 3, "max_blocks_per_request": 4,
             "num_mamba_layers": 1, "conv_states_shape": (2,), "ssm_states_shape": (3,),
             "kv_dtype": "float16", "conv_states_dtype": "float16",
             "ssm_states_dtype": "float32", "mamba_cache_slots": 4, "mamba_chunk_size": None,
             "enable_prefix_caching": True, "eviction_policy": "lru", "max_step_tokens": None,
             "device": CPU}


def make_ctx(pending=True, args=None):
    def make():
        ctx = DynamicInferenceContext(**(_CTX_ARGS if args is None else args))
        rng = np.random.default_rng(0)
        for a in (ctx.mamba_conv_states, ctx.mamba_ssm_states, *ctx.kv_pool.layers):
            a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, np.uint8)
        ctx.add_request("a", [1, 2, 3, 4, 5])
        ctx.add_request("b", [1, 2, 7])
        ctx.commit_step()
        ctx.release_requests(["b"])
        if pending:
            ctx.extend_request("a", [6])
            ctx.add_request("c", [1, 2, 3, 4, 9])
        return ctx, ctx
    return make


CASES[(CTX, "__init__")] = Case(
    lambda: (None, None), lambda _: dict(_CTX_ARGS),
    {"kv_layer_configs": Instance(), "num_blocks": Int(1, 2**31 - 1),
     "block_size_tokens": Int(1), "max_requests": Int(1), "max_blocks_per_request": Int(1),
     "num_mamba_layers": Int(0),
     "conv_states_shape": Ints(1, 2**63 - 1, fixed_length=False, none_ok=True),
     "ssm_states_shape": Ints(1, 2**63 - 1, fixed_length=False, none_ok=True),
     "kv_dtype": Choice(), "conv_states_dtype": Choice(), "ssm_states_dtype": Choice(),
     "mamba_cache_slots": Int(0), "mamba_chunk_size": Int(1, 2, none_ok=True),
     "enable_prefix_caching": Bool(), "eviction_policy": Choice(),
     "max_step_tokens": Int(1, none_ok=True), "device": Choice(none_ok=True)})
for meth in ("request_stats", "block_ids", "num_computed_tokens", "mamba_slot"):
    case(CTX, meth, make_ctx(), lambda _: {"request_id": "a"}, request_id=Key())
case(CTX, "shares_pending_blocks", make_ctx(),
     lambda _: {"tokens": [1, 2, 3, 4], "salt": b"tenant", "extra_keys": {0: b"img"}},
     tokens=Ints(*TOKENS, fixed_length=False), salt=Salt(), extra_keys=BlockKeys(2))
case(CTX, "add_request", make_ctx(pending=False),
     lambda _: {"request_id": "d", "tokens": [1, 2, 3, 4, 8], "stream": None,
                "salt": "tenant", "extra_keys": {0: b"img", 2: "tail"}},
     request_id=Key(unknown=("a",)), tokens=Ints(*TOKENS, fixed_length=False, nonempty=True),
     stream=Stream(), salt=Salt(), extra_keys=BlockKeys(3))
case(CTX, "extend_request", make_ctx(pending=False),
     lambda _: {"request_id": "a", "tokens": [6, 7]}, request_id=Key(),
     tokens=Ints(*TOKENS, fixed_length=False, nonempty=True))
case(CTX, "extend_requests", make_ctx(pending=False),
     lambda _: {"request_ids": ["a"], "tokens": [6]}, request_ids=Keys(nonempty=False),
     tokens=Ints(*TOKENS, nested_ok=True))
case(CTX, "release_requests", make_ctx(), lambda _: {"request_ids": ["a", "c"]},
     request_ids=Keys())
case(CTX, "write_kv", make_ctx(),
     lambda _: {"request_ids": ["a", "c"], "k": rows((2, 1, 4)), "v": rows((2, 1, 4), seed=1),
                "layer": 0, "k_scale": None, "v_scale": None, "stream": None},
     request_ids=Keys(), k=Array(), v=Array(), layer=Index(1, none_ok=True),
     k_scale=OnlyNone(), v_scale=OnlyNone(), stream=Stream())
case(CTX, "commit_step", make_ctx(), lambda _: {"stream": None}, stream=Stream())


def make_ctx_draft():
    """A context with a verify step scheduled (two tokens each for "a" and "c") whose
    ``_drafts`` are its ContextDraftStates of 3 tokens, filled with random bytes: the context
    is the root, so the drafts are in the snapshot."""
    ctx, _ = make_ctx(pending=False)()
    ctx.add_request("c", [1, 2, 7])
    ctx.commit_step()
    ctx._drafts = hcache.ContextDraftStates(ctx, 3)
    rng = np.random.default_rng(3)
    for a in (ctx._drafts.conv_states, ctx._drafts.ssm_states):
        a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, np.uint8)
    ctx.extend_requests(["a", "c"], [[6, 7], [8, 9]])
    return ctx, ctx


case(CTX, "commit_draft", make_ctx_draft,
     lambda c: {"request_ids": ["a", "c"], "accepted": [1, 2], "draft_states": c._drafts,
                "bonus_token": False, "stream": None},
     request_ids=Keys(), accepted=Ints(0, 2), draft_states=Instance(), bonus_token=Bool(),
     stream=Stream())
CASES[("ContextDraftStates", "__init__")] = Case(
    lambda: (None, None),
    lambda _: {"context": make_ctx(pending=False)()[0], "max_draft_tokens": 2, "stream": None},
    {"context": Instance(), "max_draft_tokens": Int(1, (2**31 - 1) // 3), "stream": Stream()})


def make_context_draft_states():
    ctx, _ = make_ctx_draft()
    return ctx, ctx._drafts

MSA = "MambaSlotAllocator"


def make_msa():
    ctx, _ = make_ctx()()
    return ctx, ctx.mamba_slot_allocator


def _msa_state_block(m):
    return int(np.flatnonzero(m.block_to_slot >= 0)[0])


CASES[(MSA, "__init__")] = Case(
    lambda: (None, None),
    lambda _: {"context": make_ctx(pending=False)()[0], "max_slots": 2, "num_mamba_layers": 1,
               "conv_states_shape": (2,), "ssm_states_shape": (3,),
               "conv_states_dtype": "float16", "ssm_states_dtype": "float32"},
    {"context": Instance(), "max_slots": Int(1), "num_mamba_layers": Int(1),
     "conv_states_shape": Ints(1).relating("context"),
     "ssm_states_shape": Ints(1).relating("context"),
     "conv_states_dtype": Choice(), "ssm_states_dtype": Choice()})
for meth in ("get_slot", "has_state", "invalidate_block"):
    case(MSA, meth, make_msa, lambda m: {"block_id": _msa_state_block(m)}, block_id=Index(12))
for meth in ("can_allocate_slots", "allocate_slots_batch"):
    case(MSA, meth, make_msa, lambda _: {"block_ids": [5, 6]},
         block_ids=Ints(0, 11, fixed_length=False))
case(MSA, "on_kv_blocks_deregistered", make_msa,
     lambda _: {"block_ids_list": [5], "hashes_to_delete": [77]},
     block_ids_list=Ints(0, 11, fixed_length=False),
     hashes_to_delete=Ints(-(2**63), 2**63 - 1, fixed_length=False, set_ok=True))
case(MSA, "register_block_hashes_batch", make_msa,
     lambda m: {"block_ids": [_msa_state_block(m)],
                "hashes": [int(m.context.kv_block_allocator.block_hashes[_msa_state_block(m)])]},
     block_ids=Ints(0, 11).relating("hashes"), hashes=Ints(-1, 2**63 - 1))
case(MSA, "store_from_tensors", make_msa,
     lambda m: {"block_id": _msa_state_block(m), "layer_idx": 0,
                "ssm_state": np.ones(3, np.float32), "conv_state": np.ones(2, np.float16),
                "stream": None},
     block_id=Index(12), layer_idx=Index(1), ssm_state=Array(), conv_state=Array(),
     stream=Stream())
case(MSA, "store_from_live_batch", make_msa,
     lambda m: {"slots": [int(m.block_to_slot[_msa_state_block(m)])], "request_indices": [0],
                "stream": None},
     slots=Ints(0, 3, unique=True).relating("request_indices"), request_indices=Ints(0, 2),
     stream=Stream())
case(MSA, "restore_to_live", make_msa,
     lambda m: {"request_idx": 0, "block_id": _msa_state_block(m), "stream": None},
     request_idx=Index(3), block_id=Index(12), stream=Stream())
case(MSA, "restore_to_live_batch", make_msa,
     lambda m: {"request_indices": [0], "block_ids": [_msa_state_block(m)], "stream": None},
     request_indices=Ints(0, 2, unique=True).relating("block_ids"), block_ids=Ints(0, 11),
     stream=Stream())
case(MSA, "get_intermediate_gpu_data", make_msa,
     lambda _: {"prefill_start": 0, "prefill_count": 2, "stream": None},
     prefill_start=Int(0, 1).relating("prefill_count"), prefill_count=Int(0, 3, none_ok=True),
     stream=Stream())
case(MSA, "commit_intermediate_states", make_msa, lambda _: {"stream": None}, stream=Stream())
case(MSA, "compute_and_store_offsets", make_msa,
     lambda m: {"req": SimpleNamespace(prompt_length=4), "current_id": 0, "skip_tokens": 0,
                "prefill_chunk_length": 4,
                "num_matched_blocks": 0, "matched_block_ids": [], "overall_required_blocks": 2,
                "extra_boundaries": ()},
     req=Instance(), current_id=Index(3),
     skip_tokens=Int(0), prefill_chunk_length=Int(0),
     num_matched_blocks=Int(0).relating("matched_block_ids"),
     matched_block_ids=Ints(0, 11, fixed_length=False),
     overall_required_blocks=Int(0), extra_boundaries=Ints(0, None, fixed_length=False))
case(MSA, "compute_and_store_offsets_batch", make_msa,
     lambda m: {"rows": [0], "chunk_starts": [0], "seq_lens": [4],
                "boundaries": [[2, 4, -1]], "eos_columns": [-1]},
     rows=Ints(0, 2, unique=True).relating("chunk_starts"), chunk_starts=Ints(0),
     seq_lens=Ints(0), boundaries=Array(bad_dtypes=(np.float64,), none_ok=True, free_last=True),
     eos_columns=Ints(-1, 3).relating("request_to_kv_block_ids"))


# --- variants: latent (MLA) layers and missing recurrent states (issue 13) -----------------

def variant(owner, method, label, make, args, /, **kinds):
    VARIANTS[(owner, method, label)] = Case(make, args, kinds)


LATENT = KVLayerConfig(1, 8, components=1)
KV_MLA = KVCacheConfig(3, 6, (KVLayerConfig(2, 4), LATENT))
CONV_ONLY = MambaCacheConfig(2, 3, 0, 0, 0, 4, 2)          # short convolutions
RECURRENT_ONLY = MambaCacheConfig(2, 3, 1, 2, 3, 0, 0)     # lightning attention
HYB_MLA = HybridCacheConfig(HYB_CFG.layer_types, KV_MLA, CONV_ONLY, 3)


def make_kv_mla():
    m = _filled(KVCacheManager(KV_MLA, device=CPU))
    return m, m


def make_hybrid_mla():
    m = _filled(HybridCacheManager(HYB_MLA, device=CPU))
    m.reset_for_new_sequences([2, 2])
    return m, m


def make_mamba_of(cfg):
    def make():
        m = _filled(MambaCacheManager(cfg, device=CPU))
        return m, m
    return make


variant("KVCacheStaticParams", "__init__", "mla", lambda: (None, None),
        lambda _: {"num_heads": 1, "head_size": 2, "is_mla": True},
        num_heads=Int(1), head_size=Int(1), is_mla=Bool())
_MAMBA_KINDS = {"num_layers": Int(0), "max_batch_size": Int(1), "ssm_dtype": Choice(),
                "conv_dtype": Choice()}
variant("MambaCacheConfig", "__init__", "conv-only", lambda: (None, None),
        lambda _: {"num_layers": 1, "max_batch_size": 2, "num_heads": 0, "head_dim": 0,
                   "state_size": 0, "conv_dim": 2, "conv_kernel": 2, "ssm_dtype": "float32",
                   "conv_dtype": "float16"},
        num_heads=Int(0, 0), head_dim=Int(0, 0), state_size=Int(0, 0),
        conv_dim=Int(1).relating("conv_kernel"), conv_kernel=Int(1).relating("conv_dim"),
        **_MAMBA_KINDS)
variant("MambaCacheConfig", "__init__", "recurrent-only", lambda: (None, None),
        lambda _: {"num_layers": 1, "max_batch_size": 2, "num_heads": 1, "head_dim": 2,
                   "state_size": 2, "conv_dim": 0, "conv_kernel": 0, "ssm_dtype": "float32",
                   "conv_dtype": "float16"},
        num_heads=Int(1), head_dim=Int(1), state_size=Int(1),
        conv_dim=Int(0, 0).relating("conv_kernel"), conv_kernel=Int(0, 0).relating("conv_dim"),
        **_MAMBA_KINDS)
for label, cfg in (("conv-only", CONV_ONLY), ("recurrent-only", RECURRENT_ONLY)):
    make = make_mamba_of(cfg)
    variant("MambaCacheManager", "__init__", label, lambda: (None, None),
            lambda _, cfg=cfg: {"config": cfg, "stream": None, "device": CPU},
            config=Instance(), stream=Stream(), device=Choice(none_ok=True))
    getter = "get_conv_state" if label == "conv-only" else "get_recurrent_state"
    variant("MambaCacheManager", getter, label, make, lambda _: {"i": 1}, i=Index(2))
    variant("MambaCacheManager", "clear_slot", label, make, lambda _: {"b": 1, "stream": None},
            b=B3, stream=Stream())
    for meth in ("capture_recurrent_states", "capture_conv_states"):
        variant("MambaCacheManager", meth, label, make, lambda _: {"b": 1, "stream": None},
                b=B3, stream=Stream())
    rec = [] if label == "conv-only" else [rows((1, 1, 2, 3), np.float32, seed=i)
                                           for i in range(2)]
    conv = [rows((1, 4, 2), seed=i) for i in range(2)] if label == "conv-only" else []
    variant("MambaCacheManager", "restore_states", label, make,
            lambda _, rec=rec, conv=conv: {"recurrent": list(rec), "conv": list(conv), "b": 1,
                                           "stream": None},
            recurrent=(Absent(rows((1, 1, 2, 3), np.float32), empty=True) if not rec
                       else Arrays(squeezable=True)),
            conv=Absent(rows((1, 4, 2)), empty=True) if not conv else Arrays(squeezable=True),
            b=B3, stream=Stream())
variant("HybridCacheManager", "__init__", "mla-conv-only", lambda: (None, None),
        lambda _: {"config": HYB_MLA, "stream": None, "device": CPU},
        config=Instance(), stream=Stream(), device=Choice(none_ok=True))
variant("HybridCacheManager", "get_conv_state", "mla-conv-only", make_hybrid_mla,
        lambda _: {"i": 2}, i=Index(4))
variant("KVCacheManager", "write_kv", "mla", make_kv_mla,
        lambda _: {"layer": 1, "k": rows((2, 2, 1, 8)), "v": None, "seq_lengths": None,
                   "positions": [[0, 1], [3, 4]], "k_scale": None, "v_scale": None,
                   "stream": None},
        layer=Index(2, none_ok=True).relating("v"), k=Array(), v=Absent(rows((2, 2, 1, 8))),
        seq_lengths=Fixed("None is the valid value"), positions=Ints(-1, 5),
        k_scale=OnlyNone(), v_scale=OnlyNone(), stream=Stream())
variant("KVCacheManager", "restore_kv_cache", "mla", make_kv_mla,
        lambda m: {"saved": [rows((2, 2, 3, 4), seed=2), rows((1, 1, 3, 8), seed=3)],
                   "b": 2, "stream": None, "scales": None},
        saved=Arrays(), b=B3, stream=Stream(), scales=Instance(none_ok=True))
variant("HybridCacheManager", "write_kv", "mla", make_hybrid_mla,
        lambda _: {"layer": 3, "k": rows((3, 1, 8)), "v": None, "seq_lengths": [2, 1],
                   "positions": None, "k_scale": None, "v_scale": None, "stream": None},
        layer=Index(4).relating("k", "v"), k=Array(), v=Absent(rows((3, 1, 8))),
        seq_lengths=Ints(0, 4).relating("k"), positions=Fixed("None is valid with seq_lengths"),
        k_scale=OnlyNone(), v_scale=OnlyNone(), stream=Stream())


def make_cb_mla():
    m = ContinuousBatchingKVCacheManager("float16", KVCacheStaticParams(1, 2, is_mla=True), 3,
                                         6, 2, device=CPU)
    m.blocks_buf.view(np.uint8)[...] = np.random.default_rng(0).integers(
        0, 256, m.blocks_buf.view(np.uint8).shape, dtype=np.uint8)
    ids = m.claim(2)
    c = m.fetch(ids)
    c.write(0, rows((2, 1, 1, 2)), None)
    m.step([1, 1], c)
    return m, m.fetch(ids)


for meth, names in (("write", ("key", "value")), ("write_kv", ("k", "v"))):
    extra = {} if meth == "write" else {"k_scale": None, "v_scale": None}
    variant(COLL, meth, "mla", make_cb_mla,
            lambda _, names=names, extra=extra: {"layer": 1, names[0]: rows((3, 1, 2)),
                                                 names[1]: None, "seq_lengths": [2, 1],
                                                 "stream": None, **extra},
            layer=Index(2), seq_lengths=Ints(0, 5).relating(names[0]), stream=Stream(),
            **{names[0]: Array(), names[1]: Absent(rows((3, 1, 2)))},
            **({} if meth == "write" else {"k_scale": OnlyNone(), "v_scale": OnlyNone()}))


def make_pool_mla():
    p = PagedKVPool([KVLayerConfig(2, 4), LATENT], 6, 2, device=CPU)
    for a in p.layers:
        a.view(np.uint8)[...] = np.random.default_rng(0).integers(
            0, 256, a.view(np.uint8).shape, dtype=np.uint8)
    return p, p


variant("PagedKVPool", "write_kv", "mla", make_pool_mla,
        lambda _: {"k": rows((4, 1, 8)), "v": None, **_POOL_WRITE},
        k=Array(), v=Absent(rows((4, 1, 8))), layer=Index(2, none_ok=True).relating("k", "v"),
        block_table=_table(),
        seq_offsets=Junk(), uniform_tokens=Int(1).relating("seq_offsets"), batch=Junk(),
        cache_lengths=Junk(), positions=Junk(), k_scale=OnlyNone(), v_scale=OnlyNone(),
        status=Junk(), stream=Stream())
_CTX_MLA = dict(_CTX_ARGS, kv_layer_configs=[KVLayerConfig(1, 4, components=1)],
                conv_states_shape=None)


def make_ctx_mla():
    ctx = DynamicInferenceContext(**_CTX_MLA)
    rng = np.random.default_rng(0)
    for a in (ctx.mamba_ssm_states, *ctx.kv_pool.layers):
        a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, np.uint8)
    ctx.add_request("a", [1, 2, 3, 4, 5])
    ctx.commit_step()
    ctx.extend_request("a", [6])
    ctx.add_request("c", [1, 2, 3, 4, 9])
    return ctx, ctx


variant(CTX, "__init__", "mla-no-conv", lambda: (None, None), lambda _: dict(_CTX_MLA),
        **dict(CASES[(CTX, "__init__")].kinds, conv_states_shape=Junk()))
variant(CTX, "write_kv", "mla-no-conv", make_ctx_mla,
        lambda _: {"request_ids": ["a", "c"], "k": rows((2, 1, 4)), "v": None, "layer": 0,
                   "k_scale": None, "v_scale": None, "stream": None},
        request_ids=Keys(), k=Array(), v=Absent(rows((2, 1, 4))),
        layer=Index(1, none_ok=True).relating("k", "v"), k_scale=OnlyNone(),
        v_scale=OnlyNone(), stream=Stream())
variant(MSA, "restore_to_live", "mla-no-conv", lambda: (lambda c: (c, c.mamba_slot_allocator))(
            make_ctx_mla()[0]),
        lambda m: {"request_idx": 0, "block_id": _msa_state_block(m), "stream": None},
        request_idx=Index(3), block_id=Index(12), stream=Stream())


def _hf_variant(label, config_dict):
    variant("HybridCacheConfig", "from_hf_config", label, lambda: (None, HybridCacheConfig),
            lambda _: {"config_dict": dict(config_dict), "max_batch_size": 2,
                       "max_sequence_length": 4, "kv_dtype": "float16", "ssm_dtype": "float32",
                       "conv_dtype": None},
            **CASES[("HybridCacheConfig", "from_hf_config")].kinds)


def _hf_families():
    from test_hf_config_mla import DEEPSEEK_V2_LITE
    from test_hf_families import LFM2_1_2B, MINIMAX_M1

    for label, cfg in (("mla", DEEPSEEK_V2_LITE), ("conv-only", LFM2_1_2B),
                       ("recurrent-only", MINIMAX_M1)):
        _hf_variant(label, cfg)


_hf_families()


# --- ring buffers and local block spaces (issue 14) ----------------------------------------

def _extend(key, **params):
    """Add new parameters to a case: ``name=(valid value, kind)``."""
    c = (CASES if len(key) == 2 else VARIANTS)[key]
    args = c.args
    c.args = lambda t, args=args: dict(args(t), **{n: v for n, (v, _) in params.items()})
    c.kinds.update({n: kind for n, (_, kind) in params.items()})


for _key in (("KVCacheConfig", "__init__"), ("HybridCacheConfig", "from_hf_config"),
             *(("HybridCacheConfig", "from_hf_config", label)
               for label in ("mla", "conv-only", "recurrent-only"))):
    _extend(_key, ring_windows=(_key[1] == "from_hf_config", Bool()))
for _key in (("KVCacheStaticParams", "nbytes"), ("KVCacheStaticParams", "max_batch_size_for"),
             (CB, "__init__")):
    _extend(_key, sliding_window=(None, Int(1, none_ok=True)))
for _key in (("PagedKVPool", "__init__"), ("PagedKVPool", "nbytes_for"),
             ("PagedKVPool", "num_blocks_for"), (CTX, "__init__"),
             (CTX, "__init__", "mla-no-conv")):
    _extend(_key, num_local_blocks=(None, Int(1, none_ok=True)))
for _key in ((CTX, "__init__"), (CTX, "__init__", "mla-no-conv")):
    _extend(_key, registration_budget=(64, Int(1, none_ok=True)))
_extend(("PagedKVPool", "copy_blocks"), local=(False, Bool()))
for _key in (("PagedKVPool", "write"), ("PagedKVPool", "write_kv"),
             ("PagedKVPool", "launch_write"), ("PagedKVPool", "write_kv", "mla")):
    _extend(_key, local_block_table=(None, Junk()))
for _key in (("KVCacheManager", "restore_kv_cache"), ("HybridCacheManager", "restore_kv_cache"),
             ("KVCacheManager", "restore_kv_cache", "mla")):
    _extend(_key, sequence_length=(3, Int(3, 3, none_ok=True).relating("saved")))
fn("rings.ring_start", {"lengths": np.array([2, 7], np.int64), "window": 3, "device": CPU,
                       "stream": None, "order": None},
   lengths=Lengths(), window=Int(0), device=Choice(none_ok=True), stream=Stream(),
   order=Instance(none_ok=True))
case("KVCacheManager", "get_ring_window", make_kv, lambda _: {"i": 1}, i=Index(2))
case("KVCacheManager", "ring_start", make_kv,
     lambda _: {"i": 1, "lengths": [2, 5], "stream": None},
     i=Index(2), lengths=Lengths(), stream=Stream())
case("HybridCacheManager", "get_ring_window", make_hybrid, lambda _: {"i": 1}, i=Index(4))
case("HybridCacheManager", "ring_start", make_hybrid,
     lambda _: {"i": 3, "lengths": None, "stream": None},
     i=Index(4), lengths=Lengths(none_ok=True), stream=Stream())
case(CB, "ring_start", make_cb(), lambda _: {"lengths": 5, "stream": None}, lengths=Lengths(),
     stream=Stream())
case(CTX, "local_block_ids", make_ctx(), lambda _: {"request_id": "a"}, request_id=Key())

# A ring layout: layer 0 a ring of 3 entries, layer 1 a ring of 4 (max_sequence_length 6), so
# a capture's length cannot be read from the tensors once both rings are full.
KV_RING = KVCacheConfig(3, 6, (KVLayerConfig(2, 4, 3), KVLayerConfig(1, 8, 4)), "float16",
                        ring_windows=True)
HYB_RING = HybridCacheConfig(HYB_CFG.layer_types, KV_RING, MAMBA_CFG, 3)


def make_kv_ring():
    m = _filled(KVCacheManager(KV_RING, device=CPU))
    return m, m


def make_hybrid_ring():
    m = _filled(HybridCacheManager(HYB_RING, device=CPU))
    m.reset_for_new_sequences([5, 2])
    return m, m


variant("KVCacheConfig", "__init__", "ring", lambda: (None, None),
        lambda _: {"max_batch_size": 3, "max_sequence_length": 6,
                   "layer_configs": KV_RING.layer_configs, "dtype": "float16",
                   "ring_windows": True},
        **CASES[("KVCacheConfig", "__init__")].kinds)
variant("KVCacheManager", "write_kv", "ring", make_kv_ring,
        lambda _: {"layer": None, "k": [rows((2, 2, 2, 4)), rows((2, 2, 1, 8), seed=4)],
                   "v": [rows((2, 2, 2, 4), seed=1), rows((2, 2, 1, 8), seed=5)],
                   "seq_lengths": None, "positions": [[4, 5], [1, 3]], "k_scale": None,
                   "v_scale": None, "stream": None},
        layer=Index(2, none_ok=True).relating("k", "v"), k=Arrays(), v=Arrays(),
        seq_lengths=Fixed("None is the valid value"), positions=Ints(-1, 5, unique=True),
        k_scale=OnlyNone(), v_scale=OnlyNone(), stream=Stream())
variant("KVCacheManager", "restore_kv_cache", "ring", make_kv_ring,
        lambda m: {"saved": [rows((2, 2, 3, 4), seed=2), rows((2, 1, 4, 8), seed=3)],
                   "b": 2, "stream": None, "scales": None, "sequence_length": 5},
        saved=Arrays(), b=B3, stream=Stream(), scales=Instance(none_ok=True),
        sequence_length=Int(4, 6).relating("saved"))
variant("HybridCacheManager", "restore_kv_cache", "ring", make_hybrid_ring,
        lambda m: {"saved": [rows((2, 2, 2, 4), seed=2), rows((2, 1, 2, 8), seed=3)],
                   "b": 2, "stream": None, "scales": None, "sequence_length": None},
        saved=Arrays(), b=B3, stream=Stream(), scales=Instance(none_ok=True),
        sequence_length=Int(2, 2, none_ok=True).relating("saved"))
variant("KVCacheManager", "ring_start", "ring", make_kv_ring,
        lambda _: {"i": 0, "lengths": np.array([2, 5, 6], np.int32), "stream": None},
        i=Index(2), lengths=Lengths(), stream=Stream())
variant("HybridCacheManager", "ring_start", "ring", make_hybrid_ring,
        lambda _: {"i": 1, "lengths": None, "stream": None}, i=Index(4),
        lengths=Lengths(none_ok=True), stream=Stream())
variant("HybridCacheManager", "write_kv", "ring", make_hybrid_ring,
        lambda _: {"layer": 3, "k": rows((3, 1, 8)), "v": rows((3, 1, 8), seed=1),
                   "seq_lengths": [1, 2], "positions": None, "k_scale": None,
                   "v_scale": None, "stream": None},
        layer=Index(4).relating("k"), k=Array(), v=Array(),
        seq_lengths=Ints(0, 4).relating("k", "v"),
        positions=Fixed("None is valid with seq_lengths"),
        k_scale=OnlyNone(), v_scale=OnlyNone(), stream=Stream())


def make_cb_ring(fetched=False):
    def make():
        m = ContinuousBatchingKVCacheManager("float16", KVCacheStaticParams(1, 2), 3, 6, 2,
                                             device=CPU, sliding_window=2)
        m.blocks_buf.view(np.uint8)[...] = np.random.default_rng(0).integers(
            0, 256, m.blocks_buf.view(np.uint8).shape, dtype=np.uint8)
        ids = m.claim(2)
        c = m.fetch(ids)
        c.write(0, rows((2, 4, 1, 2)), rows((2, 4, 1, 2), seed=1))   # past the window
        m.step([4, 4], c)
        return (m, m.fetch(ids)) if fetched else (m, m)
    return make


variant(CB, "__init__", "ring", lambda: (None, None),
        lambda _: {"dtype": "float16", "kv_params": KVCacheStaticParams(1, 2),
                   "max_batch_size": 2, "max_seq_len": 6, "num_layers": 1, "device": CPU,
                   "sliding_window": 2},
        **CASES[(CB, "__init__")].kinds)
variant(CB, "ring_start", "ring", make_cb_ring(), lambda _: {"lengths": [5, 6], "stream": None},
        lengths=Lengths(), stream=Stream())
variant(CB, "step", "ring", lambda: (lambda m: (m, m))(make_cb_ring()()[0]),
        lambda m: {"valid_lengths": [1, 2], "collection": m.fetch([0, 1])},
        valid_lengths=Ints(0, 2), collection=Instance())
variant(COLL, "write_kv", "ring", make_cb_ring(fetched=True),
        lambda _: {"layer": 1, "k": rows((3, 1, 2)), "v": rows((3, 1, 2), seed=1),
                   "seq_lengths": [2, 1], "stream": None, "k_scale": None, "v_scale": None},
        layer=Index(2), seq_lengths=Ints(0, 5).relating("k", "v"), stream=Stream(),
        k=Array(), v=Array(), k_scale=OnlyNone(), v_scale=OnlyNone())

# A pool with a local block space: layer 0 slides (4 local blocks), layer 1 is full (6).
_LOCAL_LAYERS = [KVLayerConfig(2, 4, 2), KVLayerConfig(1, 8)]


def make_pool_local():
    p = PagedKVPool(_LOCAL_LAYERS, 6, 2, device=CPU, num_local_blocks=4)
    for a in p.layers:
        a.view(np.uint8)[...] = np.random.default_rng(0).integers(
            0, 256, a.view(np.uint8).shape, dtype=np.uint8)
    return p, p


_LOCAL_WRITE = dict(_POOL_WRITE, layer=None,
                    local_block_table=np.array([[-1, 3], [0, -1]], np.int32))
variant("PagedKVPool", "__init__", "local", lambda: (None, None),
        lambda _: {"layer_configs": list(_LOCAL_LAYERS), "num_blocks": 2, "block_size": 2,
                   "dtype": "float16", "device": CPU, "extra_nbytes": 64,
                   "num_local_blocks": 3},
        **dict(CASES[("PagedKVPool", "__init__")].kinds, num_local_blocks=Int(1, none_ok=True)))
for _meth in ("write", "write_kv"):
    variant("PagedKVPool", _meth, "local", make_pool_local,
            lambda _: {"k": [rows((4, 2, 4)), rows((4, 1, 8), seed=2)],
                       "v": [rows((4, 2, 4), seed=1), rows((4, 1, 8), seed=3)], **_LOCAL_WRITE},
            **dict(CASES[("PagedKVPool", _meth)].kinds, k=Arrays(), v=Arrays(),
                   layer=Index(2, none_ok=True).relating("k", "v"),
                   local_block_table=_table()))
variant("PagedKVPool", "copy_blocks", "local", make_pool_local,
        lambda _: {"src_ids": [0, 1], "dst_ids": [2, 3], "status": None, "stream": None,
                   "local": True},
        src_ids=Ints(-1, 3).relating("dst_ids"), dst_ids=Ints(-1, 3, unique=True),
        status=Junk(), stream=Stream(), local=Bool())

_CTX_LOCAL = dict(_CTX_ARGS, kv_layer_configs=[KVLayerConfig(1, 4, 2), KVLayerConfig(1, 4)],
                  num_local_blocks=6, registration_budget=64)


def make_ctx_local(pending=True):
    return make_ctx(pending, _CTX_LOCAL)


variant(CTX, "__init__", "local", lambda: (None, None), lambda _: dict(_CTX_LOCAL),
        **dict(CASES[(CTX, "__init__")].kinds, num_local_blocks=Int(1, none_ok=True)))
variant(CTX, "write_kv", "local", make_ctx_local(),
        lambda _: {"request_ids": ["a", "c"], "k": [rows((2, 1, 4)), rows((2, 1, 4), seed=2)],
                   "v": [rows((2, 1, 4), seed=1), rows((2, 1, 4), seed=3)], "layer": None,
                   "k_scale": None, "v_scale": None, "stream": None},
        request_ids=Keys(), k=Arrays(), v=Arrays(),
        layer=Index(2, none_ok=True).relating("k", "v"), k_scale=OnlyNone(),
        v_scale=OnlyNone(), stream=Stream())
for _meth, _make, _args, _kinds in (
        ("local_block_ids", make_ctx_local(), {"request_id": "a"}, {"request_id": Key()}),
        ("commit_step", make_ctx_local(), {"stream": None}, {"stream": Stream()}),
        ("release_requests", make_ctx_local(), {"request_ids": ["a", "c"]},
         {"request_ids": Keys()}),
        ("add_request", make_ctx_local(pending=False),
         {"request_id": "d", "tokens": [1, 2, 3, 4, 8], "stream": None, "salt": b"t",
          "extra_keys": {2: [b"img"]}},
         {"request_id": Key(unknown=("a",)),
          "tokens": Ints(*TOKENS, fixed_length=False, nonempty=True), "stream": Stream(),
          "salt": Salt(), "extra_keys": BlockKeys(3)}),
        ("extend_requests", make_ctx_local(pending=False), {"request_ids": ["a"], "tokens": [6]},
         {"request_ids": Keys(nonempty=False), "tokens": Ints(*TOKENS, nested_ok=True)})):
    variant(CTX, _meth, "local", _make, lambda _, a=_args: dict(a), **_kinds)


# --- issue 25: state writes, admission, the prompt store, the context from a config ---------

for owner, make, layer, nl in (("HybridCacheManager", make_hybrid, Index(4, none_ok=True), 2),
                               ("MambaCacheManager", make_mamba, Index(2, none_ok=True), 2),
                               ("LinearKVCache", make_linear, Index(1, none_ok=True), 1)):
    case(owner, "write_states", make,
         lambda _, nl=nl: {"layer": None,
                           "recurrent": [rows((2, 1, 2, 3), np.float32, seed=i)
                                         for i in range(nl)],
                           "conv": [rows((2, 4, 2), seed=i) for i in range(nl)],
                           "slots": [2, 0], "stream": None},
         layer=layer, recurrent=Arrays(none_ok=True), conv=Arrays(none_ok=True),
         slots=Ints(0, 2, unique=True, none_ok=True), stream=Stream())
for owner, make in (("HybridCacheManager", make_hybrid), ("LinearKVCache", make_linear)):
    case(owner, "admit_sequences", make,
         lambda _: {"slots": [2, 0], "lengths": [3, 1], "stream": None},
         slots=Ints(0, 2, unique=True).relating("lengths"), lengths=Ints(0, 6), stream=Stream())

def make_store():
    m, _ = make_hybrid()
    store = hcache.PromptCacheStore(m)
    store.capture("p", 0, 2)
    return m, store


ctor(hcache.PromptCacheStore, {"manager": make_hybrid()[0]}, manager=Instance())
case("PromptCacheStore", "capture", make_store,
     lambda _: {"key": "q", "b": 1, "sequence_length": 2, "stream": None},
     key=Fixed("any hashable key: a new one stores, a stored one is replaced"), b=B3,
     sequence_length=S6, stream=Stream())
case("PromptCacheStore", "restore", make_store,
     lambda _: {"key": "p", "slots": [2], "stream": None},
     key=Key(), slots=Ints(0, 2, unique=True, fixed_length=False), stream=Stream())
case("PromptCacheStore", "get", make_store, lambda _: {"key": "p"}, key=Key())
case("PromptCacheStore", "discard", make_store, lambda _: {"key": "p"},
     key=Fixed("any key: discarding an absent one does nothing"))

case(CTX, "from_config", lambda: (None, DynamicInferenceContext),
     lambda _: {"config": HYB_CFG, "block_size_tokens": 2, "num_blocks": None,
                "max_requests": None, "mamba_cache_slots": None},
     config=Instance(), block_size_tokens=Int(1), num_blocks=Int(1, none_ok=True),
     max_requests=Int(1, none_ok=True), mamba_cache_slots=Int(0, none_ok=True))
case(CTX, "from_hf_config", lambda: (None, DynamicInferenceContext),
     lambda _: {"config_dict": _hf(), "max_requests": 2, "max_sequence_length": 8,
                "block_size_tokens": 2, "kv_dtype": "float16", "ssm_dtype": "float32",
                "conv_dtype": None},
     config_dict=Instance().relating("model_type"), max_requests=Int(1),
     max_sequence_length=Int(1, 2**31 - 1), block_size_tokens=Int(1), kv_dtype=Choice(),
     ssm_dtype=Choice(), conv_dtype=Choice(none_ok=True))


# --- continuous batching over a HybridCacheConfig (K/V and recurrent states per block) ------

HCB, HCOLL = "ContinuousBatchingHybridCacheManager", "ContinuousBatchingHybridCollection"


def make_hcb(fetched=False):
    def make():
        m = hcache.ContinuousBatchingHybridCacheManager(HYB_CFG, device=CPU)
        rng = np.random.default_rng(0)
        pools = [m.get_combined_kv_cache(i) for i in (1, 3)] + [
            get(i) for get in (m.get_recurrent_state, m.get_conv_state) for i in (0, 2)]
        for a in pools:
            a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, dtype=np.uint8)
        ids = m.claim(2)
        c = m.fetch(ids)
        c.write_kv(1, rows((2, 1, 2, 4)), rows((2, 1, 2, 4), seed=1))
        m.step([1, 1], c)
        return (m, m.fetch(ids)) if fetched else (m, m)
    return make


CASES[(HCB, "__init__")] = Case(lambda: (None, None),
                                lambda _: {"config": HYB_CFG, "device": CPU},
                                {"config": Instance(), "device": Choice(none_ok=True)})
case(HCB, "from_hf_config", lambda: (None, hcache.ContinuousBatchingHybridCacheManager),
     lambda _: {"config_dict": _hf(), "max_batch_size": 2, "max_seq_len": 4,
                "kv_dtype": "float16", "ssm_dtype": "float32", "conv_dtype": None,
                "ring_windows": True, "device": CPU},
     config_dict=Instance().relating("model_type"), max_batch_size=Int(1),
     max_seq_len=Int(1, 2**31 - 1), kv_dtype=Choice(), ssm_dtype=Choice(),
     conv_dtype=Choice(none_ok=True), ring_windows=Bool(), device=Choice(none_ok=True))
case(HCB, "nbytes", lambda: (None, hcache.ContinuousBatchingHybridCacheManager),
     lambda _: {"config": HYB_CFG}, config=Instance())
case(HCB, "max_batch_size_for", lambda: (None, hcache.ContinuousBatchingHybridCacheManager),
     lambda _: {"config": HYB_CFG, "budget": 4096}, config=Instance(), budget=Int(0))
case(HCB, "can_claim", make_hcb(), lambda _: {"batch_size": 1}, batch_size=Int(0))
case(HCB, "claim", make_hcb(), lambda _: {"batch_size": 1, "stream": None},
     batch_size=Int(0, 1), stream=Stream())
case(HCB, "block_of", make_hcb(), lambda _: {"seq_id": 0}, seq_id=Key(unknown=(99, -1, 2**70)))
case(HCB, "release", make_hcb(), lambda _: {"seq_id": 0, "stream": None},
     seq_id=Key(unknown=(99, -1, 2**70)), stream=Stream())
case(HCB, "fetch", make_hcb(), lambda _: {"seq_ids": [0, 1], "wait": False, "timeout": None,
                                          "stream": None},
     seq_ids=Keys(unknown=99), wait=Bool(), timeout=Seconds(), stream=Stream())
case(HCB, "step", lambda: make_hcb()(), _cb_step_args, valid_lengths=Ints(0, 5),
     collection=Instance())
for _meth, _valid in (("get_layer_type", 0), ("get_combined_kv_cache", 1),
                      ("get_ring_window", 3), ("get_recurrent_state", 0), ("get_conv_state", 2)):
    case(HCB, _meth, make_hcb(), lambda _, v=_valid: {"i": v}, i=Index(4))
case(HCB, "ring_start", make_hcb(), lambda _: {"i": 1, "lengths": 5, "stream": None},
     i=Index(4), lengths=Lengths(), stream=Stream())
for _meth, _valid in (("kv_cache", 1), ("key_cache", 3), ("value_cache", 1),
                      ("recurrent_state", 0), ("conv_state", 2)):
    case(HCOLL, _meth, make_hcb(fetched=True), lambda _, v=_valid: {"layer": v},
         layer=Index(4))
case(HCOLL, "write_kv", make_hcb(fetched=True),
     lambda _: {"layer": 3, "k": rows((3, 1, 8)), "v": rows((3, 1, 8), seed=1),
                "seq_lengths": [2, 1], "stream": None},
     layer=Index(4, none_ok=True).relating("k", "v"), k=Array(), v=Array(),
     seq_lengths=Ints(0, 5).relating("k", "v"), stream=Stream())
case(HCOLL, "write_states", make_hcb(fetched=True),
     lambda _: {"layer": 2, "recurrent": rows((2, 1, 2, 3), np.float32),
                "conv": rows((2, 4, 2), seed=1), "stream": None},
     layer=Index(4, none_ok=True).relating("recurrent", "conv"),
     recurrent=Array(none_ok=True), conv=Array(none_ok=True), stream=Stream())
