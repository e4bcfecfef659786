"""``python -m hcache demo --speculative`` (docs/design.md §7, §4.13): speculative decoding of
the demo's hybrid model with hcache's draft commits, checked exactly.

A draft model (the target's weights with a perturbed LM head, so it agrees with the target
often but not always) proposes ``k`` tokens per sequence. The target verifies them in one
forward pass over ``[last token, d1 .. dk]`` per sequence: the K/V of all ``k + 1`` tokens go into
the :class:`~hcache.slots.hybrid.HybridCacheManager` at each sequence's length, and the Mamba
state after each of them into a :class:`~hcache.slots.drafts.DraftStates` buffer, the live
states untouched. The longest prefix of drafts that equals the target's greedy tokens is
accepted, the target's token after it is the bonus token, and
``commit_draft(accepted, k + 1, bonus_token=True)`` keeps exactly the last token and the
accepted drafts: lengths advance, and the live Mamba states become those after the last kept
token, for every layer in one launch. Every generated token, and its logits, must equal (bit
for bit) the uncached greedy reference run, as in the plain demo.
"""

from __future__ import annotations

import time

import numpy as np

from ..config.caches import HybridCacheConfig
from ..runtime.device import resolve_device
from ..slots.drafts import DraftStates
from ..slots.hybrid import HybridCacheManager
from .adapters import SlotCache, host
from .model import TinyHybridModel, reference_logits
from .run import NEMOTRON_H_CONFIG, _Checker

__all__ = ["run_speculative_demo", "DraftSlotCache"]

DRAFT_TOKENS = 3


class DraftSlotCache(SlotCache):
    """A verify pass over a HybridCacheManager: K/V rows go to the caches at the committed
    lengths (as :class:`~hcache.demo.adapters.SlotCache`), the Mamba state after each new
    token to position ``t`` of the draft buffers, and the live states stay as they were."""

    def __init__(self, mgr, model, n, drafts):
        super().__init__(mgr, model, n)
        self.drafts = drafts

    def on_mamba_token(self, m, seqs, offset, conv, ssm):
        i = self.model.mamba_layers[m]
        rows = self.xp.asarray(np.asarray(seqs, np.int64))
        self.drafts.get_conv_draft(i)[rows, offset - 1] = self.xp.asarray(conv)
        self.drafts.get_recurrent_draft(i)[rows, offset - 1] = self.xp.asarray(ssm)

    def set_mamba(self, m, conv, ssm):
        """The live states change only by ``commit_draft``."""


def _draft_model(config) -> TinyHybridModel:
    draft = TinyHybridModel(config, vocab_size=NEMOTRON_H_CONFIG["vocab_size"],
                            hidden_size=NEMOTRON_H_CONFIG["hidden_size"],
                            num_q_heads=NEMOTRON_H_CONFIG["num_attention_heads"], seed=0)
    noise = np.random.default_rng(7).standard_normal(draft.lm_head.shape).astype(np.float32)
    draft.lm_head = draft.lm_head + np.float32(0.35) * noise * np.abs(draft.lm_head).mean()
    return draft


def _propose(draft, context, k) -> list[int]:
    """``k`` greedy tokens of the draft model after ``context`` (recomputed from scratch)."""
    out = []
    for _ in range(k):
        out.append(int(np.argmax(reference_logits(draft, list(context) + out)[-1])))
    return out


def run_speculative_demo(device=None, *, draft_tokens: int = DRAFT_TOKENS) -> int:
    """Serve the demo model speculatively on ``device`` and compare every token with the
    uncached greedy reference run.

    Returns
    -------
    int
        0 when every token matches, 1 otherwise (each mismatch is printed).
    """
    t0 = time.perf_counter()
    dev = resolve_device(device)
    k = int(draft_tokens)
    config = HybridCacheConfig.from_hf_config(NEMOTRON_H_CONFIG, max_batch_size=4,
                                              max_sequence_length=64, kv_dtype="float32")
    model = TinyHybridModel(config, vocab_size=NEMOTRON_H_CONFIG["vocab_size"],
                            hidden_size=NEMOTRON_H_CONFIG["hidden_size"],
                            num_q_heads=NEMOTRON_H_CONFIG["num_attention_heads"], seed=0)
    draft = _draft_model(config)
    print(f"hcache demo --speculative on {dev}: the demo's Nemotron-H-style model verifies "
          f"{k} draft tokens per step from a draft model (its LM head perturbed)")
    check = _Checker(model)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in (5, 3, 7, 4)]
    budgets, n = [12, 9, 14, 10], len(prompts)
    mgr = HybridCacheManager(config, device=dev)
    drafts = DraftStates(mgr, k + 1)
    mgr.reset_for_new_sequences([0] * n)
    logits = model.forward(prompts, [0] * n, SlotCache(mgr, model, n))
    mgr.commit_sequence_length([len(p) for p in prompts])
    gen = [[int(np.argmax(out[-1]))] for out in logits]
    rows = [[out[-1]] for out in logits]
    lengths = [len(p) for p in prompts]
    steps = proposed = accepted_total = 0
    while any(len(g) < b for g, b in zip(gen, budgets, strict=True)):
        proposals = [_propose(draft, p + g, k) for p, g in zip(prompts, gen, strict=True)]
        chunks = [[g[-1]] + d for g, d in zip(gen, proposals, strict=True)]
        logits = model.forward(chunks, lengths, DraftSlotCache(mgr, model, n, drafts))
        accepted = []
        for s in range(n):
            target = [int(np.argmax(row)) for row in logits[s]]
            a = 0
            while a < k and proposals[s][a] == target[a]:
                a += 1
            accepted.append(a)
            if len(gen[s]) < budgets[s]:
                gen[s] += target[:a + 1]
                rows[s] += list(logits[s][:a + 1])
                proposed += k
                accepted_total += a
        mgr.commit_draft(accepted, k + 1, draft_states=drafts, bonus_token=True)
        lengths = [length + 1 + a for length, a in zip(lengths, accepted, strict=True)]
        steps += 1
        device_lengths = host(mgr.get_kv_cache_lengths()).tolist()
        if device_lengths != lengths:
            check.fail(f"MISMATCH speculative: device lengths {device_lengths}, expected "
                       f"{lengths}")
        print(f"  step {steps}: accepted {accepted} of {k} drafts; lengths {device_lengths}")
    for s in range(n):
        check.check("speculative", f"r{s}", prompts[s], gen[s][:budgets[s]],
                    rows[s][:budgets[s]])
    rate = accepted_total / proposed if proposed else 0.0
    tokens = sum(min(len(g), b) for g, b in zip(gen, budgets, strict=True))
    print(f"  {n} requests, {tokens} tokens in {steps} verify steps (plain decoding: "
          f"{max(budgets) - 1}); accepted {accepted_total} of {proposed} drafts "
          f"({100 * rate:.0f}%)")
    seconds = time.perf_counter() - t0
    if check.problems:
        print(f"demo --speculative: FAILED, {len(check.problems)} mismatch(es) against the "
              f"uncached reference run ({check.tokens} tokens checked, {seconds:.1f} s)")
        return 1
    print(f"demo --speculative: all {check.tokens} generated tokens match the non-speculative "
          f"uncached reference run (bit-identical logits; accepted rate {100 * rate:.0f}%; "
          f"{seconds:.1f} s)")
    return 0
