"""The live per-request Mamba states of a context (docs/design.md §6).

Live slot ``s`` of ``conv_states`` / ``ssm_states`` ``[num_mamba_layers, max_requests, *shape]``
holds the state of the request that owns it, after the tokens it has computed: the model reads
and advances it in place. A fresh request's slot is either restored from the Mamba state cache
or zeroed here, in one :func:`hcache.ops.slot_copy` launch over conv and SSM of every layer.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..device import launch_scope
from ..ops.tables import SlotSet

__all__ = ["LiveMambaStates"]


class LiveMambaStates:
    """Live Mamba states of ``max_requests`` slots (none when ``num_mamba_layers`` is 0).

    Attributes
    ----------
    conv_states, ssm_states : arrays [num_mamba_layers, max_requests, *shape]
        Zero-initialised, on ``device``, in the storage dtypes.
    """

    def __init__(self, device, num_mamba_layers, max_requests, conv_states_shape,
                 ssm_states_shape, conv_dtype, ssm_dtype):
        xp, L = device.xp, num_mamba_layers
        self.device = device
        with device.scope():
            self.conv_states = xp.zeros((L, max_requests, *conv_states_shape), dtype=conv_dtype)
            self.ssm_states = xp.zeros((L, max_requests, *ssm_states_shape), dtype=ssm_dtype)
            if L:
                zeros_conv = xp.zeros((L, 1, *conv_states_shape), dtype=conv_dtype)
                zeros_ssm = xp.zeros((L, 1, *ssm_states_shape), dtype=ssm_dtype)
                self._zero_to_live = SlotSet(
                    [(zeros_conv[m], self.conv_states[m]) for m in range(L)]
                    + [(zeros_ssm[m], self.ssm_states[m]) for m in range(L)])
                self._zero_idx = xp.zeros(1, dtype=np.int32)
                self._live_idx = xp.zeros(1, dtype=np.int32)

    def zero(self, live_slot: int, *, stream=None) -> None:
        """Zero every layer's conv and SSM state of ``live_slot`` (requires Mamba layers)."""
        with launch_scope(self.device, stream):
            self._live_idx.fill(live_slot)
            ops.slot_copy(self._zero_to_live, self._zero_idx, self._live_idx, stream=stream)
