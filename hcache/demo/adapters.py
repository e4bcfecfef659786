"""How the demo's engine binds its model to each hcache cache (``python -m hcache demo``).

Each class implements the cache-adapter protocol of
:meth:`hcache.demo.model.TinyHybridModel.forward` (documented on
:class:`hcache.demo.model.PlainCache`) over one of the package's managers: the model's math runs
on the host, so the adapter copies states and K/V rows between host and the cache's device
arrays, while every bulk move (KV writes, compaction, capture, restore, snapshots) is done by
hcache: K/V rows go in through each manager's public write (``HybridCacheManager.write_kv``,
the hybrid continuous-batching collection's ``write_kv``, ``DynamicInferenceContext.write_kv``)
and so do the continuous batch's Mamba states (``write_states``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["host", "SlotCache", "HybridBlockCache", "PagedCache"]

F32 = np.float32


def host(a) -> np.ndarray:
    """A host copy of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") else np.array(a)


class _Adapter:
    def on_mamba_token(self, m, seqs, offset, conv, ssm):
        """No snapshots by default."""


class SlotCache(_Adapter):
    """Sequence ``s`` of a forward lives in slot ``s`` of a HybridCacheManager whose active
    batch is the forward's sequences; K/V rows go to the manager's device lengths."""

    def __init__(self, mgr, model, n):
        self.mgr, self.model, self.n, self.xp = mgr, model, n, mgr.device.xp

    def get_mamba(self, m):
        i = self.model.mamba_layers[m]
        return (host(self.mgr.get_conv_state(i)[:self.n]),
                host(self.mgr.get_recurrent_state(i)[:self.n]))

    def set_mamba(self, m, conv, ssm):
        i = self.model.mamba_layers[m]
        self.mgr.get_conv_state(i)[:self.n] = self.xp.asarray(conv)
        self.mgr.get_recurrent_state(i)[:self.n] = self.xp.asarray(ssm)

    def write_kv(self, a, ks, vs):
        """``HybridCacheManager.write_kv`` of decoder layer ``attention_layers[a]`` (one
        launch): ragged rows, row ``s`` at slot ``s``'s committed length."""
        with self.mgr.device.scope():
            self.mgr.write_kv(self.model.attention_layers[a],
                              self.xp.asarray(np.concatenate(ks)),
                              self.xp.asarray(np.concatenate(vs)),
                              seq_lengths=[len(k) for k in ks])

    def read_kv(self, a, s, n):
        kv = host(self.mgr.get_combined_kv_cache(self.model.attention_layers[a])[s, :, :, :n])
        return kv[0].transpose(1, 0, 2), kv[1].transpose(1, 0, 2)     # [n, H, D]


class HybridBlockCache(_Adapter):
    """One block per sequence of a ContinuousBatchingHybridCacheManager collection, for K/V and
    for the Mamba states alike: states are read from the device pools at the rows' blocks and
    written back with ``write_states`` (one launch for both kinds); K/V rows go in with a ragged
    ``write_kv`` at each row's committed length. Layers are decoder layers."""

    def __init__(self, coll, model):
        self.coll, self.model, self.xp = coll, model, coll.manager.device.xp

    def get_mamba(self, m):
        layer, rows = self.model.mamba_layers[m], self.coll.lookup_table
        return (host(self.coll.conv_state(layer)[rows]),
                host(self.coll.recurrent_state(layer)[rows]))

    def set_mamba(self, m, conv, ssm):
        self.coll.write_states(self.model.mamba_layers[m], self.xp.asarray(ssm),
                               self.xp.asarray(conv))

    def write_kv(self, a, ks, vs):
        self.coll.write_kv(self.model.attention_layers[a], self.xp.asarray(np.concatenate(ks)),
                           self.xp.asarray(np.concatenate(vs)),
                           seq_lengths=[len(k) for k in ks])

    def read_kv(self, a, s, n):
        cache = self.coll.kv_cache(self.model.attention_layers[a])      # [blocks, 2, H, L, D]
        kv = host(cache[self.coll.blocks[s], :, :, :n])
        return kv[0].transpose(1, 0, 2), kv[1].transpose(1, 0, 2)      # [n, H, D]


class PagedCache(_Adapter):
    """The step plans of a DynamicInferenceContext: K/V written with ``ctx.write_kv`` and read
    back through the block table; live Mamba states at ``plan.mamba_slot``; the boundary states
    of ``ctx.snapshot_targets()`` written into the slot allocator's scratch."""

    def __init__(self, ctx, plans):
        self.ctx, self.plans, self.xp = ctx, plans, ctx.xp
        self.slots = self.xp.asarray(np.array([p.mamba_slot for p in plans]))
        targets = {}
        for rid, offset, idx in ctx.snapshot_targets():
            targets.setdefault(rid, {})[offset] = idx
        self.targets = [targets.get(p.request_id, {}) for p in plans]

    def get_mamba(self, m):
        return (host(self.ctx.mamba_conv_states[m][self.slots]),
                host(self.ctx.mamba_ssm_states[m][self.slots]))

    def set_mamba(self, m, conv, ssm):
        self.ctx.mamba_conv_states[m][self.slots] = self.xp.asarray(conv)
        self.ctx.mamba_ssm_states[m][self.slots] = self.xp.asarray(ssm)

    def on_mamba_token(self, m, seqs, offset, conv, ssm):
        alloc = self.ctx.mamba_slot_allocator
        for j, s in enumerate(seqs):
            idx = self.targets[s].get(offset)
            if idx is not None:
                alloc.intermediate_conv_out[m, idx] = self.xp.asarray(conv[j])
                alloc.intermediate_ssm_out[m, idx] = self.xp.asarray(ssm[j])

    def write_kv(self, a, ks, vs):
        self.ctx.write_kv([p.request_id for p in self.plans], self.xp.asarray(np.concatenate(ks)),
                          self.xp.asarray(np.concatenate(vs)), layer=a)

    def read_kv(self, a, s, n):
        pos, bs = np.arange(n), self.ctx.block_size_tokens
        blocks = host(self.ctx.kv_pool.layers[a][self.xp.asarray(self.plans[s].block_ids)])
        kv = blocks[pos // bs, :, :, pos % bs]                          # [n, 2, H, D]
        return kv[:, 0], kv[:, 1]
