"""The managers on the real kernels, on a machine without a GPU.

Every op on NumPy arrays normally runs the NumPy reference; inside
``ops.host_backend(EmuLauncher())`` it runs ``kernels/*.cu`` compiled for the host instead. Here
the stateful machines and end-to-end scenarios of the managers run that way, so compaction,
capture/restore, continuous-batching writes, paged writes and Mamba slot copies are checked,
through the managers' own launch arguments, against the same NumPy models as the reference.
Each emulated launch is counted, so these tests cannot pass by falling back to the reference.
"""

from __future__ import annotations

import pytest
import test_continuous_batching as cb
import test_mamba_slot_allocator_stateful as mamba
import test_managers_stateful as managers
import test_paged_kv_pool as paged
import test_prefix_caching_e2e as e2e
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hcache import ops

emu_mod = pytest.importorskip("emu")
pytestmark = pytest.mark.emu

if not emu_mod.have_compiler():  # pragma: no cover - CI checks the compiler first
    pytest.skip("no host C++ compiler", allow_module_level=True)

EMU = emu_mod.EmuLauncher()


def _emulated(machine):
    """A subclass of ``machine`` whose every op runs the emulated kernels."""

    class Emulated(machine):
        def __init__(self):
            self._backend = ops.host_backend(EMU)
            self._backend.__enter__()
            super().__init__()

        def teardown(self):
            try:
                super().teardown()
            finally:
                self._backend.__exit__(None, None, None)

    Emulated.__name__ = f"Emulated{machine.__name__}"
    return Emulated


TestUniform = _emulated(managers.UniformMachine).TestCase
TestHybrid = _emulated(managers.HybridMachine).TestCase
TestDtypes = _emulated(managers.DtypeMachine).TestCase
TestShortConv = _emulated(managers.ShortConvMachine).TestCase
TestLightning = _emulated(managers.LightningMachine).TestCase
TestLatent = _emulated(managers.LatentMachine).TestCase
TestMLA = _emulated(managers.MLAMachine).TestCase
TestMambaCache = _emulated(mamba.MambaCacheMachine).TestCase
TestMambaCache.settings = mamba.TestMambaCacheLRU.settings


@pytest.fixture
def emulated():
    before = len(EMU.launches)
    with ops.host_backend(EMU):
        yield
    assert len(EMU.launches) > before, "no kernel ran through the emulation"


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e5m2", "float32"])
def test_continuous_batching_lifecycle(emulated, dtype):
    cb.test_lifecycle_matches_model(dtype, "cpu")


def test_continuous_batching_exact_positions(emulated):
    cb.test_write_fills_exactly_the_new_positions_of_each_row()
    cb.test_ragged_write_puts_each_rows_tokens_at_its_length("cpu")


def test_paged_pool_writes_and_block_copies(emulated):
    paged.test_ragged_write_of_all_layers_lands_in_the_right_blocks("cpu")
    paged.test_single_layer_write_touches_only_that_layer("cpu")
    paged.test_copy_blocks_copies_every_layer_and_nothing_else("cpu")


def test_prefix_caching_end_to_end(emulated):
    e2e.test_overlapping_prompts("cpu")
    e2e.test_multi_turn_continuation("cpu")


def test_prefix_caching_with_latent_layers(emulated, monkeypatch):
    e2e.test_latent_layers_end_to_end("cpu", monkeypatch)


@pytest.mark.parametrize("policy", ["lru", "ref_zero"])
def test_prefix_caching_under_eviction(emulated, policy):
    e2e.test_evictions_under_a_small_pool("cpu", policy)


def test_an_emulated_machine_launches_kernels():
    before = len(EMU.launches)
    run_state_machine_as_test(_emulated(managers.HybridMachine),
                              settings=settings(max_examples=5, stateful_step_count=20))
    names = {name for name, _, _ in EMU.launches[before:]}
    assert names, "the emulated machine ran no kernel"
    assert names <= {"hc_compaction_plan", "hc_kv_compact", "hc_slots_compact",
                     "hc_kv_capture", "hc_slot_copy", "hc_kv_write", "hc_lengths_add"}
