"""A speculative context and its twin (tests of ``DynamicInferenceContext.commit_draft``).

:class:`Twins` drives two contexts of one configuration through the same serving workload:
``draft`` verifies ``w`` written tokens per request (``extend_requests``, every K/V row written,
the Mamba state after each written token into :class:`hcache.ContextDraftStates`) and commits
random accepted counts with ``commit_draft``; ``twin`` only ever extends each request by its
kept tokens (``accepted + bonus``) and commits with ``commit_step``. :meth:`Twins.compare` then
checks that the two are the same context: requests, lengths, tokens, counters, block tables up
to a renaming of block ids (one consistent bijection, under which ref counts, registered hashes,
parents and timestamps agree), the registered hash sets of both block spaces, the valid K/V
bytes, live and cached Mamba states (by hash), and both contexts' invariants.

The stand-in model: a Mamba layer's conv state is a window of token codes and its SSM state a
rolling sum (small integers, exact in every state dtype used); the K/V row of layer ``i`` at
position ``p`` is a function of the SSM (or conv) state after token ``p``, cast to the KV dtype.
"""

from __future__ import annotations

import numpy as np

import hcache
from hcache.config.caches import KVLayerConfig
from hcache.contexts import DynamicInferenceContext

from helpers import host

BS = 4


def configs():
    """Context configurations by name: every layer kind the context supports."""
    attn = [KVLayerConfig(2, 4), KVLayerConfig(1, 8, components=1), KVLayerConfig(1, 4, 6)]
    base = dict(kv_layer_configs=attn, num_blocks=160, block_size_tokens=BS, max_requests=4,
                max_blocks_per_request=10, num_mamba_layers=2, conv_states_shape=(2, 3),
                ssm_states_shape=(2, 2), kv_dtype="float16", conv_states_dtype="float16",
                ssm_states_dtype="float32", mamba_cache_slots=64, mamba_chunk_size=None,
                registration_budget=128)
    return {
        "hybrid-f16": base,
        "window-blocks-bf16": dict(base, kv_dtype="bfloat16", conv_states_dtype="bfloat16",
                                   ssm_states_dtype="float16", num_local_blocks=160),
        "conv-only-fp8": dict(base, kv_dtype="float8_e4m3fn", ssm_states_shape=None,
                              conv_states_dtype="float32", registration_budget=1),
        "ssm-only-int8": dict(base, kv_dtype="int8", conv_states_shape=None,
                              mamba_chunk_size=2),
        "attention-only-u8": dict(base, kv_dtype="uint8", num_mamba_layers=0),
        "no-state-cache-f32": dict(base, kv_dtype="float32", mamba_cache_slots=0),
        "no-prefix-caching": dict(base, enable_prefix_caching=False),
        "mla-e5m2-at-once": dict(base, kv_layer_configs=[KVLayerConfig(1, 12, components=1)],
                                 kv_dtype="float8_e5m2", registration_budget=None),
    }


def step_states(conv, ssm, tok):
    """Advance every Mamba layer by one token (host arrays ``[L, ...]`` or None)."""
    if conv is not None:
        L = conv.shape[0]
        codes = (tok * (np.arange(conv.shape[1])[None, :] + 1) + 3 * np.arange(L)[:, None]) % 97
        conv = np.concatenate([conv[..., 1:], codes[..., None].astype(conv.dtype)], axis=-1)
    if ssm is not None:
        mix = 0 if conv is None else conv.astype(np.float64).sum(axis=(1, 2))[:, None, None]
        ssm = ((ssm.astype(np.float64) * 3 + tok + mix) % 251).astype(ssm.dtype)
    return conv, ssm


def kv_rows(ctx, summary, pos):
    """K, V rows of every attention layer at ``pos``, from a state summary (an int)."""
    out = []
    dt = ctx.kv_pool.layers[0].dtype if ctx.kv_pool.layers else np.float16
    for i, lc in enumerate(ctx.kv_pool.layer_configs):
        h = np.arange(lc.num_kv_heads)[:, None]
        d = np.arange(lc.head_dim)[None, :]
        k = ((summary + 5 * h + 3 * d + 7 * i + pos) % 13).astype(np.float32)
        v = ((2 * summary + h + d + i) % 11).astype(np.float32)
        out.append((k.astype(dt), None if lc.components == 1 else v.astype(dt)))
    return out


def make(name, device="cpu", *, max_draft_tokens=5):
    """``(draft, twin, draft_states)`` of configuration ``name``."""
    kw = configs()[name]
    draft, twin = (DynamicInferenceContext(**kw, device=device) for _ in range(2))
    return draft, twin, hcache.ContextDraftStates(draft, max_draft_tokens)


class Twins:
    """The pair and its workload (see the module docstring)."""

    def __init__(self, name, device="cpu", *, max_draft_tokens=5):
        self.draft, self.twin, self.states = make(name, device, max_draft_tokens=max_draft_tokens)
        self.k = max_draft_tokens
        self.tokens: dict = {}      # request id -> its tokens (the kept ones)

    # --- the engine -----------------------------------------------------------------------

    def _live(self, ctx, slot):
        c, s = ctx.mamba_conv_states, ctx.mamba_ssm_states
        return (None if c is None else host(c[:, slot]).copy(),
                None if s is None else host(s[:, slot]).copy())

    def _summary(self, conv, ssm):
        return int(ssm[0].ravel()[-1]) if ssm is not None else (
            int(conv[0].ravel()[-1]) if conv is not None else 0)

    def forward(self, ctx, plans, *, drafting=False):
        """Compute ``plans`` (``StepPlan`` list) on ``ctx``: K/V written, Mamba states into
        the scratch and live states, or (``drafting``) into the draft buffers."""
        xp, L = ctx.xp, ctx.num_mamba_layers
        targets: dict = {}
        for rid, off, idx in ctx.snapshot_targets():
            targets.setdefault(rid, {})[off] = idx
        ks = [[] for _ in ctx.kv_pool.layers]
        vs = [[] for _ in ctx.kv_pool.layers]
        for plan in plans:
            slot = plan.mamba_slot
            conv, ssm = self._live(ctx, slot) if L else (None, None)
            summary = 0
            for j, tok in enumerate(plan.tokens.tolist()):
                pos = plan.start + j
                if L:
                    conv, ssm = step_states(conv, ssm, tok)
                    summary = self._summary(conv, ssm)
                else:
                    summary = tok + pos
                for i, (k, v) in enumerate(kv_rows(ctx, summary, pos)):
                    ks[i].append(k)
                    vs[i].append(v)
                if not L:
                    continue
                if drafting:
                    for d, x in ((self.states.conv_states, conv), (self.states.ssm_states, ssm)):
                        if d is not None:
                            d[:, slot, j] = xp.asarray(x)
                    continue
                idx = targets.get(plan.request_id, {}).get(j + 1)
                if idx is not None:
                    for out, x in ((ctx.intermediate_conv_out, conv),
                                   (ctx.intermediate_ssm_out, ssm)):
                        if out is not None:
                            out[:, idx] = xp.asarray(x)
            if L and not drafting:
                for live, x in ((ctx.mamba_conv_states, conv), (ctx.mamba_ssm_states, ssm)):
                    if live is not None:
                        live[:, slot] = xp.asarray(x)
        if plans:
            ctx.write_kv([p.request_id for p in plans],
                         [xp.asarray(np.stack(k)) for k in ks],
                         [None if lc.components == 1 else xp.asarray(np.stack(v))
                          for lc, v in zip(ctx.kv_pool.layer_configs, vs, strict=True)])

    # --- the workload ---------------------------------------------------------------------

    def admit(self, rid, prompt):
        """Admit ``rid`` into both and commit its prompt step; returns both plans."""
        plans = []
        for ctx in (self.draft, self.twin):
            plan = ctx.add_request(rid, list(prompt))
            self.forward(ctx, [plan])
            ctx.commit_step()
            plans.append(plan)
        self.tokens[rid] = list(prompt)
        return plans

    def room(self, rid):
        return self.draft.max_sequence_length - len(self.tokens[rid])

    def verify(self, written: dict, accepted: dict, *, bonus=False, query=None):
        """One verify step: ``written[rid]`` tokens per request (every request with room;
        the first is the bonus token when ``bonus``), ``accepted[rid]`` of them kept (plus
        the bonus). ``query``: tokens of a ``shares_pending_blocks`` call made on both while
        their steps are scheduled. Returns ``commit_draft``'s answer."""
        ids = list(written)
        if ids:
            plan = self.draft.extend_requests(ids, [written[r] for r in ids])
            self.forward(self.draft, list(plan), drafting=True)
        kept = {r: accepted[r] + int(bonus) for r in ids}
        keep = [r for r in ids if kept[r]]
        if keep:
            tplan = self.twin.extend_requests(keep, [written[r][:kept[r]] for r in keep])
        if query is not None:
            self.draft.shares_pending_blocks(query)
            self.twin.shares_pending_blocks(query)
        if keep:
            self.forward(self.twin, list(tplan))
        out = self.draft.commit_draft(ids, [accepted[r] for r in ids],
                                      draft_states=self.states, bonus_token=bonus)
        twin_out = self.twin.commit_step()
        assert out["registered_blocks"] == twin_out["registered_blocks"]
        assert out["stored_states"] == twin_out["stored_states"]
        for r in ids:
            self.tokens[r] += list(written[r][:kept[r]])
        return out

    def release(self, ids):
        for ctx in (self.draft, self.twin):
            ctx.release_requests(ids)
        for r in ids:
            del self.tokens[r]

    # --- the comparison -------------------------------------------------------------------

    def compare(self):
        d, t = self.draft, self.twin
        d.check_invariants()
        t.check_invariants()
        assert d._requests.ids == t._requests.ids
        assert vars(d.stats) == vars(t.stats)
        bs = BS
        ren: dict = {}     # twin block id -> draft block id
        local = d.window_blocks is not None
        for rid in t._requests.ids:
            n = t.num_computed_tokens(rid)
            assert d.num_computed_tokens(rid) == n == len(self.tokens[rid]), rid
            rd, rt = d._requests.row(rid), t._requests.row(rid)
            assert d._requests.tokens[rd, :n].tolist() == t._requests.tokens[rt, :n].tolist()
            assert d._requests.tokens[rd, :n].tolist() == self.tokens[rid]
            assert vars(d.request_stats(rid)) == vars(t.request_stats(rid)), rid
            assert d.mamba_slot(rid) == t.mamba_slot(rid)
            bd, bt = d.block_ids(rid), t.block_ids(rid)
            assert len(bd) == len(bt) == -(-n // bs), rid
            for a, b in zip(bt.tolist(), bd.tolist()):
                assert ren.setdefault(a, b) == b, f"{rid}: block {a} renamed twice"
            pos = np.arange(n)
            for ld, lt, in_window in zip(d.kv_pool.layers, t.kv_pool.layers,
                                         d.kv_pool.local_layers, strict=True):
                if in_window:
                    continue    # a local layer: its blocks are compared below
                va = host(ld)[bd[pos // bs], :, :, pos % bs].view(np.uint8)
                vb = host(lt)[bt[pos // bs], :, :, pos % bs].view(np.uint8)
                assert va.tobytes() == vb.tobytes(), f"{rid}: K/V"
            if local:
                assert (d.local_block_ids(rid) >= 0).tolist() == \
                    (t.local_block_ids(rid) >= 0).tolist()
            if d.num_mamba_layers:
                slot = d.mamba_slot(rid)
                for a, b in zip(self._live(d, slot), self._live(t, slot)):
                    assert a is None or a.tobytes() == b.tobytes(), f"{rid}: live state"
        ka, kb = d.kv_block_allocator, t.kv_block_allocator
        assert set(ka.kv_hash_to_block_id) == set(kb.kv_hash_to_block_id)
        for h, b in kb.kv_hash_to_block_id.items():
            a = ka.kv_hash_to_block_id[h]
            assert ren.setdefault(b, a) == a, f"hash {h}: block {b} renamed twice"
            for ld, lt, in_window in zip(d.kv_pool.layers, t.kv_pool.layers,
                                         d.kv_pool.local_layers, strict=True):
                if not in_window:
                    assert host(ld)[a].tobytes() == host(lt)[b].tobytes(), f"block of {h}"
        assert len(set(ren.values())) == len(ren), "the renaming is not one-to-one"
        twin_ids = np.array(list(ren), np.int64)
        draft_ids = np.array([ren[b] for b in twin_ids.tolist()], np.int64)
        for name in ("block_ref_counts", "block_hashes", "block_timestamps"):
            assert getattr(ka, name)[draft_ids].tolist() == \
                getattr(kb, name)[twin_ids].tolist(), name
        parents = kb.block_parent_ids[twin_ids].tolist()
        assert ka.block_parent_ids[draft_ids].tolist() == [ren.get(p, p) for p in parents]
        assert ka.num_free_blocks == kb.num_free_blocks
        if local:
            la, lb = d.window_blocks.allocator, t.window_blocks.allocator
            assert set(la.kv_hash_to_block_id) == set(lb.kv_hash_to_block_id)
            assert la.num_free_blocks == lb.num_free_blocks
        ma, mb = d.mamba_slot_allocator, t.mamba_slot_allocator
        if mb is not None:
            assert set(ma.hash_to_block_id) == set(mb.hash_to_block_id)
            for h, b in mb.hash_to_block_id.items():
                sa, sb = ma.block_to_slot[ma.hash_to_block_id[h]], mb.block_to_slot[b]
                for ca, cb in ((ma.conv_states, mb.conv_states), (ma.ssm_states, mb.ssm_states)):
                    if ca is not None:
                        assert host(ca[:, sa]).tobytes() == host(cb[:, sb]).tobytes(), h
