"""The live per-request Mamba states of a context (docs/design.md §6).

Live slot ``s`` of ``conv_states`` / ``ssm_states`` ``[num_mamba_layers, max_requests, *shape]``
holds the state of the request that owns it, after the tokens it has computed: the model reads
and advances it in place. A fresh request's slot is either restored from the Mamba state cache
or zeroed here, with one fill per tensor for every layer at once. A state kind the layers do not
have (its shape ``None``) has no array.
"""

from __future__ import annotations

from ..runtime.device import launch_scope, zeros

__all__ = ["LiveMambaStates"]


class LiveMambaStates:
    """Live Mamba states of ``max_requests`` slots (none when ``num_mamba_layers`` is 0).

    Attributes
    ----------
    conv_states, ssm_states : arrays [num_mamba_layers, max_requests, *shape] or None
        Zero-initialised, on ``device``, in the storage dtypes; ``None`` for a state whose
        shape is ``None``.
    """

    def __init__(self, device, num_mamba_layers, max_requests, conv_states_shape,
                 ssm_states_shape, conv_dtype, ssm_dtype):
        L = num_mamba_layers
        self.device = device
        with device.scope():
            self.conv_states, self.ssm_states = (
                None if shape is None else zeros(device, (L, max_requests, *shape), dt)
                for shape, dt in ((conv_states_shape, conv_dtype), (ssm_states_shape, ssm_dtype)))

    def zero(self, live_slot: int, *, stream=None) -> None:
        """Zero every layer's conv and SSM state of ``live_slot``: one fill of each tensor's
        ``[:, live_slot]`` view (one kernel each on a GPU), on ``stream``."""
        with launch_scope(self.device, stream):
            for states in (self.conv_states, self.ssm_states):
                if states is not None:
                    states[:, live_slot] = 0
