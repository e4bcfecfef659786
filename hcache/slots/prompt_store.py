"""A keyed store of captured prompt caches, restored into slots of a running batch
(TensorRT-Edge-LLM's system-prompt cache; docs/design.md §4.12).

:class:`PromptCacheStore` keeps, per key, what :class:`~hcache.HybridCacheManager` captures of
one slot: the first ``length`` tokens of every attention layer (``capture_kv_cache``), the
slot's recurrent and conv states, and ``length``. :meth:`PromptCacheStore.restore` puts one
prompt into several slots: the states of every slot in one launch, the KV prefix of every slot
with one launch per head-dim group, and the lengths with
:meth:`~hcache.slots.batch.BatchAPI.admit_sequences` (one launch), leaving the other rows alone,
with no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import index_array
from .._copying import refuse_copy, refuse_deepcopy, refuse_pickle
from ..runtime.device import launch_scope, stream_handle, upload_ints

__all__ = ["PromptCacheStore", "CapturedPrompt"]


@dataclass(frozen=True, eq=False)
class CapturedPrompt:
    """One captured prompt: ``kv[i]`` ``[C_i, H_i, m_i, D_i]`` per cache-owning attention layer
    (as :meth:`~hcache.HybridCacheManager.capture_kv_cache` gives them), ``recurrent`` /
    ``conv`` ``[1, *slot_shape]`` per Mamba layer (empty for a state the layers do not have),
    ``length`` the tokens it holds, ``scales`` the FP8 scale tables (or None)."""

    kv: list
    recurrent: list
    conv: list
    length: int
    scales: tuple | None = None

    @property
    def nbytes(self) -> int:
        """Device bytes the captured arrays hold."""
        return int(sum(a.nbytes for a in (*self.kv, *self.recurrent, *self.conv)))


class PromptCacheStore:
    """Captured prompt caches of a :class:`~hcache.HybridCacheManager`, by key.

    Parameters
    ----------
    manager : HybridCacheManager

    Notes
    -----
    Each capture allocates its arrays (a capture is not a steady-state call); a restore
    allocates nothing. Driven by one thread, as the manager is.
    """

    __copy__, __deepcopy__, __reduce_ex__ = refuse_copy, refuse_deepcopy, refuse_pickle

    def __init__(self, manager):
        from .hybrid import HybridCacheManager
        if not isinstance(manager, HybridCacheManager):
            raise TypeError(f"manager: expected HybridCacheManager, "
                            f"got {type(manager).__name__}")
        self._manager = manager
        self._prompts: dict = {}

    # --- queries ------------------------------------------------------------------------

    @property
    def manager(self):
        """The manager whose slots this store captures and restores."""
        return self._manager

    def __contains__(self, key) -> bool:
        return key in self._prompts

    def __len__(self) -> int:
        return len(self._prompts)

    def keys(self) -> list:
        """The stored keys, in capture order."""
        return list(self._prompts)

    def get(self, key) -> CapturedPrompt:
        """The prompt stored under ``key``. Raises ``ValueError`` for an unknown key (as an
        unknown id anywhere in hcache), ``TypeError`` for an unhashable one."""
        try:
            return self._prompts[key]
        except TypeError:
            raise TypeError(f"key: expected a hashable key, got {type(key).__name__}") from None
        except KeyError:
            raise ValueError(f"key: expected a stored key, got {key!r}") from None

    @property
    def nbytes(self) -> int:
        """Device bytes of every stored prompt."""
        return sum(p.nbytes for p in self._prompts.values())

    # --- commands -----------------------------------------------------------------------

    def capture(self, key, b, sequence_length, stream=None) -> CapturedPrompt:
        """Capture tokens ``[0, sequence_length)`` of slot ``b`` (every attention layer, with
        the FP8 scales of an FP8 cache) and the slot's Mamba states under ``key`` (replacing
        what was stored there); the arguments are :meth:`capture_kv_cache`'s. Call it when the
        slot's states are those after ``sequence_length`` tokens.

        Raises
        ------
        TypeError
            ``key`` is not hashable, or a bad slot, length or stream type.
        IndexError, ValueError
            As :meth:`~hcache.HybridCacheManager.capture_kv_cache`. Nothing is stored.
        """
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"key: expected a hashable key, got {type(key).__name__}") from None
        m = self._manager
        fp8 = m.config.kv.dtype.startswith("float8")
        captured = m.capture_kv_cache(b, sequence_length, stream, with_scales=fp8)
        kv, scales = captured if fp8 else (captured, None)
        prompt = CapturedPrompt(kv, m.capture_recurrent_states(b, stream),
                                m.capture_conv_states(b, stream), int(sequence_length), scales)
        self._prompts[key] = prompt
        return prompt

    def restore(self, key, slots, stream=None) -> None:
        """Restore the prompt stored under ``key`` into every slot of ``slots`` and admit them
        (:meth:`~hcache.slots.batch.BatchAPI.admit_sequences` with the prompt's length):
        the Mamba states of all slots in one launch, the KV prefix of all slots in one launch per
        head-dim group, the lengths in one launch; other rows untouched, no host sync, no
        allocation.

        Raises
        ------
        TypeError, IndexError, ValueError
            An unknown or unhashable ``key``, bad ``slots`` (as :meth:`admit_sequences`), or
            a bad stream; nothing changes.
        """
        prompt = self.get(key)
        m = self._manager
        index = index_array("slots", slots, m.config.max_batch_size, distinct=True)
        m._check_admission(index, [prompt.length] * len(index))
        if stream is not None:
            stream_handle(stream)   # validated before anything changes
        if not len(index):
            return
        kv = m.kv_cache_manager
        saved, n = kv._check_saved(prompt.kv, prompt.length, stream)
        if m.mamba_cache_manager is not None:
            m.mamba_cache_manager._state_writer.broadcast(
                {"recurrent": prompt.recurrent, "conv": prompt.conv}, index, stream)
        with launch_scope(m.device, stream, m._order):
            more = None
            if len(index) > 1:   # the further targets, staged where admission stages its slots
                upload_ints(m._admit_slots, index[1:])
                more = m._admit_slots[:len(index) - 1]
            kv._restore_groups(saved, int(index[0]), n, more, stream)
        if prompt.scales is not None:
            kv.set_kv_scales(prompt.scales[0], prompt.scales[1], stream)
        m.admit_sequences(index, [prompt.length] * len(index), stream)

    def discard(self, key) -> None:
        """Forget the prompt stored under ``key`` (nothing if there is none)."""
        self._prompts.pop(key, None)
