"""Host cost of a launch (``python -m hcache bench --calls``; docs/design.md §8).

For each steady-state call an engine makes every step (or every layer of every step), two
numbers:

* ``calls_per_launch``: the Python function calls whose code lives in ``hcache/`` while one
  steady-state call runs (after a warm-up), divided by the kernel launches it makes (at least
  one). Counted with :func:`sys.setprofile` on the emulated device of the test suite
  (``tests/emu_device.py``, from a source checkout), which runs the same manager and op code as
  a GPU; without a source checkout, on the device the bench runs on. A count, not a time: the
  machine's load does not change it (issue 23's goal: at most 40).
* ``us``: host µs per call, the median over the rounds. On ``cuda`` the real cost of the call
  (the launch included, no sync). On the emulated device (no GPU) the time includes the
  emulator's own work (queueing, argument checks) and is reported as ``emulated_us``; it is an
  upper bound of the host path, not a GPU number.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np

FAMILY = "calls"
GOAL_CALLS = 40
_HCACHE = str(Path(__file__).resolve().parent.parent)


class CallCounter:
    """Counts hcache Python calls and kernel launches while it is active (``with``)."""

    def __init__(self, launch_code=None):
        self.calls = 0
        self.launches = 0
        self.names: dict = {}
        self._launch_code = launch_code

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code is self._launch_code:
            self.launches += 1
        elif code.co_filename.startswith(_HCACHE) and code.co_filename != __file__:
            self.calls += 1
            key = f"{Path(code.co_filename).name}:{code.co_name}"
            self.names[key] = self.names.get(key, 0) + 1

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    @property
    def per_launch(self) -> float:
        return self.calls / max(self.launches, 1)


def count_calls(call, rt=None, warmup: int = 8) -> CallCounter:
    """The :class:`CallCounter` of one ``call()`` after ``warmup`` calls; launches are the
    calls of ``rt.launch`` (the device runtime's; ``None``: none counted)."""
    for _ in range(warmup):
        call()
    launch = getattr(type(rt), "launch", None) if rt is not None else None
    counter = CallCounter(getattr(launch, "__code__", None))
    with counter:
        call()
    return counter


# Calls a case's objects can take after its warm-up (capacity: a context grows a block per
# request every 16 decode steps and admits up to max_requests); other cases take any number.
MAX_CALLS = {"context decode step b256": 500, "context add_request": 100}
PER_ROUND = 10


def _rounds(name: str, rounds: int) -> int:
    """``rounds``, cut to what case ``name`` can take (:data:`MAX_CALLS`)."""
    return min(rounds, MAX_CALLS.get(name, rounds * PER_ROUND) // PER_ROUND)


def _median_us(call, rounds: int, per_round: int = PER_ROUND) -> float:
    times = []
    for _ in range(rounds):
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            for _ in range(per_round):
                call()
            times.append((time.perf_counter_ns() - t0) / 1e3 / per_round)
        finally:
            gc.enable()
    return statistics.median(times)


# --- the steady-state calls (issue 23's table) -------------------------------------------------

CASES = [
    ("ops.kv_write decode 64x1, 4 layers, one call", lambda d: _op_write(d, None)),
    ("ops.kv_write decode 64x1, per layer", lambda d: _op_write(d, "layer")),
    ("ops.kv_write latent decode 64x1, 61 layers", lambda d: _op_latent(d)),
    ("ops.lengths_add", lambda d: _op_lengths(d)),
    ("hybrid write_kv(None) decode", lambda d: _hybrid_write(d, None)),
    ("hybrid write_kv(layer) decode", lambda d: _hybrid_write(d, 1)),
    ("hybrid commit_sequence_length(1) 52L", lambda d: _hybrid_commit(d)),
    ("hybrid compact_batch(device mapping)", lambda d: _hybrid_compact(d)),
    ("continuous fetch+step b256", lambda d: _continuous_step(d)),
    ("continuous batch.write(layer)", lambda d: _continuous_write(d)),
    ("context decode step b256", lambda d: _context_step(d)),
    ("context add_request", lambda d: _context_add(d)),
]
"""``(name, make)``: ``make(device)`` builds the objects on ``device`` and returns the
steady-state call (a function of no argument)."""



def _op_write(device, mode):
    from hcache.ops import kv_write
    from hcache.ops.tables import KVGroup

    xp, batch, heads, dim = device.xp, 64, 8, 128
    layers = [xp.zeros((batch, 2, heads, 64, dim), np.float16) for _ in range(4)]
    group = KVGroup(layers)
    k = [xp.zeros((batch, heads, dim), np.float16) for _ in range(4)]
    lengths = xp.zeros(batch, np.int32)
    if mode is None:
        return lambda: kv_write(group, k, k, uniform_tokens=1, batch=batch,
                                cache_lengths=lengths)
    state = [0]

    def per_layer():
        i = state[0] = (state[0] + 1) % 4
        kv_write(group, k[i], k[i], layers=i, uniform_tokens=1, batch=batch,
                 cache_lengths=lengths)
    return per_layer


def _op_latent(device):
    from hcache.ops import kv_write
    from hcache.ops.tables import KVGroup

    xp, batch, dim, n = device.xp, 64, 576, 61
    layers = [xp.zeros((batch, 1, 1, 16, dim), np.float16) for _ in range(n)]
    group = KVGroup(layers)
    k = [xp.zeros((batch, 1, dim), np.float16) for _ in range(n)]
    lengths = xp.zeros(batch, np.int32)
    return lambda: kv_write(group, k, None, uniform_tokens=1, batch=batch,
                            cache_lengths=lengths)


def _op_lengths(device):
    from hcache.ops import lengths_add

    xp = device.xp
    lengths, status = xp.zeros(256, np.int32), xp.zeros(1, np.int32)
    return lambda: lengths_add(lengths, 256, 0, 1 << 30, status=status)


def _hybrid_config(batch, pattern, seq=4096, heads=2, dim=64):
    from hcache.config import HybridCacheConfig

    return HybridCacheConfig.from_hf_config(
        {"model_type": "nemotron_h", "hybrid_override_pattern": pattern,
         "num_attention_heads": 8, "num_key_value_heads": heads, "head_dim": dim,
         "mamba_num_heads": 1, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 1,
         "conv_kernel": 4},
        max_batch_size=batch, max_sequence_length=seq)


def _hybrid_write(device, layer):
    from hcache.slots.hybrid import HybridCacheManager

    batch = 64
    cache = HybridCacheManager(_hybrid_config(batch, "M*M*M*M*"), device=device)
    cache.reset_for_new_sequences(np.zeros(batch, np.int32))
    k = device.xp.zeros((batch, 1, 2, 64), np.float16)
    if layer is None:
        ks = [k] * 4
        return lambda: cache.write_kv(None, ks, ks)
    return lambda: cache.write_kv(layer, k, k)


def _hybrid_commit(device):
    from hcache.slots.hybrid import HybridCacheManager

    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"   # 52 layers
    cache = HybridCacheManager(_hybrid_config(256, pattern, 4096, 1, 8), device=device)
    cache.reset_for_new_sequences(np.zeros(256, np.int32))
    return lambda: cache.commit_sequence_length(1)


def _hybrid_compact(device):
    from hcache.slots.hybrid import HybridCacheManager

    batch = 64
    cache = HybridCacheManager(_hybrid_config(batch, "M*M*"), device=device)
    cache.reset_for_new_sequences(np.zeros(batch, np.int32))
    mapping = np.arange(batch, dtype=np.int32)[::-1].copy()
    if device.is_cuda:
        mapping = device.xp.asarray(mapping)
    return lambda: cache.compact_batch(mapping, batch, batch)


def _continuous(device, batch=256):
    from hcache.continuous.manager import ContinuousBatchingKVCacheManager, KVCacheStaticParams

    mgr = ContinuousBatchingKVCacheManager(
        "float16", KVCacheStaticParams(num_heads=2, head_size=64), max_batch_size=batch,
        max_seq_len=4096, num_layers=2, device=device)
    return mgr, mgr.claim(batch)


def _continuous_step(device):
    mgr, ids = _continuous(device)
    ones = [1] * len(ids)
    return lambda: mgr.step(ones, mgr.fetch(ids))


def _continuous_write(device):
    mgr, ids = _continuous(device)
    batch = mgr.fetch(ids)
    k = device.xp.zeros((len(ids), 1, 2, 64), np.float16)
    return lambda: batch.write(1, k, k)


def _context(device, batch=256):
    from hcache.config import KVLayerConfig
    from hcache.contexts import DynamicInferenceContext

    return DynamicInferenceContext(
        kv_layer_configs=[KVLayerConfig(1, 8)], num_blocks=batch * 40 + 64,
        block_size_tokens=16, max_requests=batch, max_blocks_per_request=1024,
        num_mamba_layers=4, ssm_states_shape=(2, 4, 4), conv_states_shape=(16, 4),
        mamba_cache_slots=5 * batch, device=device)


def _context_step(device):
    context = _context(device)
    rng = np.random.default_rng(0)
    ids = list(range(256))
    for rid in ids:
        context.add_request(rid, rng.integers(0, 50_000, 64))
    context.commit_step()
    tokens = np.arange(256, dtype=np.int64) + 7

    def step():
        context.extend_requests(ids, tokens)
        context.commit_step()
    return step


def _context_add(device):
    """Admitting one request (a 64-token prompt) next to the others, as ``bench --host``
    does: 128 admitted, then one more per call (the warm-up and the counted call fit)."""
    context = _context(device)
    rng = np.random.default_rng(0)
    for rid in range(128):
        context.add_request(rid, rng.integers(0, 50_000, 64))
    context.commit_step()
    state = {"next": 1000}
    prompt = rng.integers(0, 50_000, 64)

    def add():
        state["next"] += 1
        context.add_request(state["next"], prompt)
    return add


# --- the runner --------------------------------------------------------------------------------

def emulated_runtime():
    """The test suite's emulated device (``tests/emu_device.py``) when this is a source
    checkout with a host C++ compiler, else None."""
    tests = Path(__file__).resolve().parents[2] / "tests"
    if not (tests / "emu_device.py").is_file():
        return None
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    try:
        import emu
        from emu_device import EmuRuntime
    except Exception:  # noqa: BLE001 - no emulator: count on the bench's device
        return None
    return EmuRuntime() if emu.have_compiler() else None


def measure(device, rounds: int = 5, only=None) -> list[dict]:
    """One row per case of :data:`CASES` (those whose name contains a string of ``only``):
    ``calls_per_launch`` counted on the emulated device when there is one (else on
    ``device``), and host µs per call: ``us`` on a ``cuda`` device, else ``emulated_us`` on the
    emulated device (its own cost included)."""
    from hcache.runtime import _cuda
    from hcache.runtime.device import resolve_device

    rt = emulated_runtime()
    rows = []
    for name, make in CASES:
        if only is not None and not any(s in name for s in only):
            continue
        row = {"model": "-", "case": name}
        if rt is not None:
            with _cuda.use_runtime(rt):
                call = make(resolve_device("cuda"))
                counter = count_calls(call, rt)
                if not device.is_cuda:
                    row["emulated_us"] = round(_median_us(call, _rounds(name, rounds)), 1)
                rt.synchronize()
            counted_on = "emulated cuda"
        else:
            call = make(device)
            counter = count_calls(call, _cuda.runtime() if device.is_cuda else None)
            counted_on = str(device)
        if device.is_cuda:
            call = make(device)
            count_calls(call)   # the warm-up
            row["us"] = round(_median_us(call, _rounds(name, rounds)), 1)
        row.update(calls_per_launch=round(counter.per_launch, 1), launches=counter.launches,
                   counted_on=counted_on, goal_calls=GOAL_CALLS)
        rows.append(row)
    return rows


def describe(device) -> str:
    """What the numbers of :func:`measure` are, for the report."""
    us = ("host us per call on this GPU (no sync; median of rounds)" if device.is_cuda else
          "host us per call on the emulated device (the emulator's own cost included: an "
          "upper bound, not a GPU number)")
    return (f"hcache Python calls per launch of each steady-state call after a warm-up "
            f"(goal <= {GOAL_CALLS}); {us}")


def run(ctx) -> list[dict]:
    """The bench runner's entry (``python -m hcache bench --calls``)."""
    return measure(ctx.device, rounds=ctx.timer.repeat)
