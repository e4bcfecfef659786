"""The tiny hybrid model of ``python -m hcache demo``: random weights, NumPy on the host.

A Nemotron-H-style decoder built from a :class:`~hcache.config.caches.HybridCacheConfig`:
Mamba-2-like
layers (a depthwise causal conv over the last ``conv_kernel`` inputs, then a diagonal selective
recurrence on a state ``[heads, head_dim, state_size]``), grouped-query attention layers (no
positional encoding: the Mamba layers carry order) and MLP layers, each pre-normed and residual.

The model owns no cache. :meth:`TinyHybridModel.forward` reads and writes every state through a
*cache adapter* with five methods (``get_mamba``, ``set_mamba``, ``on_mamba_token``, ``write_kv``,
``read_kv``; see :class:`PlainCache`), so the same code runs over hcache's managers and over the
plain NumPy reference, and a byte lost or moved wrongly by a cache changes the logits.

Exactness: cached runs batch rows differently from the reference run, yet must give bit-identical
logits. So every reduction is a sequential ``np.cumsum`` (its order does not depend on how many
rows are batched; BLAS ``@`` blocks by shape), everything is float32, transcendental functions
are elementwise, and attention runs one query at a time with shapes set by its position only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TinyHybridModel", "PlainCache", "reference_logits"]

F32 = np.float32


def _sum(a, axis):
    """Sum along ``axis`` in index order (batch-invariant, unlike pairwise sums or BLAS)."""
    return np.cumsum(a, axis=axis, dtype=F32).take(-1, axis=axis)


def _mm(x, w):
    """``x [N, in] @ w [in, out]`` with a sequential reduction over ``in``."""
    return _sum(x[:, :, None] * w, 1)


def _silu(x):
    return x / (F32(1) + np.exp(-x))


class TinyHybridModel:
    """Random-weight hybrid decoder with the layout of ``config`` (float32 everywhere).

    Parameters
    ----------
    config : HybridCacheConfig
        Layer kinds, KV heads / head dim (all attention layers alike) and Mamba shapes.
    vocab_size, hidden_size, num_q_heads : int
    seed : int
    """

    def __init__(self, config, *, vocab_size=64, hidden_size=32, num_q_heads=4, seed=0):
        rng = np.random.default_rng(seed)

        def w(*shape, scale=1.0):
            return (rng.standard_normal(shape) * scale / np.sqrt(shape[0])).astype(F32)

        d, self.vocab_size = hidden_size, vocab_size
        self.kinds = ["mamba" if t.has_mamba else "attention" if t.has_attention else "mlp"
                      for t in config.layer_types]
        self.mamba_layers = [i for i, k in enumerate(self.kinds) if k == "mamba"]
        self.attention_layers = [i for i, k in enumerate(self.kinds) if k == "attention"]
        kv = config.kv.layer_configs[0]
        self.kv_heads, self.head_dim, self.q_heads = kv.num_kv_heads, kv.head_dim, num_q_heads
        self.q_to_kv = np.arange(num_q_heads) // (num_q_heads // kv.num_kv_heads)
        m = config.mamba
        self.m_heads, self.m_head_dim, self.state = m.num_heads, m.head_dim, m.state_size
        self.inner = m.num_heads * m.head_dim
        self.conv_dim, self.conv_kernel = m.conv_dim, m.conv_kernel
        self.groups = (m.conv_dim - self.inner) // (2 * m.state_size)
        self.head_group = np.arange(m.num_heads) // (m.num_heads // self.groups)
        self.embed = rng.standard_normal((vocab_size, d)).astype(F32)
        self.lm_head = w(d, vocab_size, scale=3.0)
        self.final_norm = (1 + 0.1 * rng.standard_normal(d)).astype(F32)
        self.layers = []
        for kind in self.kinds:
            p = {"norm": (1 + 0.1 * rng.standard_normal(d)).astype(F32)}
            if kind == "mamba":
                p.update(w_in=w(d, 2 * self.inner + 2 * self.groups * self.state + self.m_heads),
                         conv_w=w(self.conv_kernel, self.conv_dim).T.copy(),
                         conv_b=(0.1 * rng.standard_normal(self.conv_dim)).astype(F32),
                         dt_bias=rng.standard_normal(self.m_heads).astype(F32),
                         decay=rng.uniform(0.2, 1.5, self.m_heads).astype(F32),
                         skip=rng.uniform(0.5, 1.0, self.m_heads).astype(F32),
                         w_out=w(self.inner, d))
            elif kind == "attention":
                q, kv = num_q_heads * self.head_dim, self.kv_heads * self.head_dim
                p.update(wq=w(d, q), wk=w(d, kv), wv=w(d, kv), wo=w(q, d))
            else:
                p.update(w1=w(d, 2 * d), w2=w(2 * d, d))
            self.layers.append(p)

    @staticmethod
    def _norm(x, weight):
        return x / np.sqrt(_sum(x * x, -1)[:, None] / F32(x.shape[-1]) + F32(1e-5)) * weight

    def forward(self, chunks, starts, cache) -> list:
        """Run new tokens of several sequences through every layer (layer by layer).

        Parameters
        ----------
        chunks : list of int sequences
            Sequence ``s`` brings ``len(chunks[s]) >= 1`` new tokens at positions
            ``starts[s], starts[s] + 1, ...``.
        starts : list of int
            Tokens already in each sequence's caches.
        cache : cache adapter (see :class:`PlainCache`)
            Its states for the sequences, in ``chunks`` order; updated in place.

        Returns
        -------
        list of numpy.ndarray float32 [len(chunks[s]), vocab_size]
            The logits after each new token.
        """
        lens = [len(c) for c in chunks]
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        x = self.embed[np.concatenate([np.asarray(c, np.int64) for c in chunks])]
        for i, (kind, p) in enumerate(zip(self.kinds, self.layers, strict=True)):
            h = self._norm(x, p["norm"])
            if kind == "mamba":
                y = self._mamba(self.mamba_layers.index(i), p, h, lens, offsets, cache)
            elif kind == "attention":
                y = self._attention(self.attention_layers.index(i), p, h, lens, offsets,
                                    starts, cache)
            else:
                y = _mm(np.maximum(_mm(h, p["w1"]), F32(0)), p["w2"])
            x = x + y
        logits = _mm(self._norm(x, self.final_norm), self.lm_head)
        return [logits[offsets[s]:offsets[s + 1]] for s in range(len(chunks))]

    def _mamba(self, m, p, h, lens, offsets, cache):
        inner, gn, H = self.inner, self.groups * self.state, self.m_heads
        proj = _mm(h, p["w_in"])
        z, xbc, dt_raw = proj[:, :inner], proj[:, inner:inner + inner + 2 * gn], proj[:, -H:]
        conv, ssm = cache.get_mamba(m)
        out = np.empty((h.shape[0], inner), dtype=F32)
        for t in range(max(lens)):
            seqs = [s for s, n in enumerate(lens) if n > t]
            rows = offsets[seqs] + t
            c = np.concatenate([conv[seqs][..., 1:], xbc[rows][..., None]], axis=-1)
            xc = _silu(_sum(c * p["conv_w"], -1) + p["conv_b"])
            xs = xc[:, :inner].reshape(-1, H, self.m_head_dim)
            b = xc[:, inner:inner + gn].reshape(-1, self.groups, self.state)[:, self.head_group]
            cc = xc[:, inner + gn:].reshape(-1, self.groups, self.state)[:, self.head_group]
            dt = F32(1) / (F32(1) + np.exp(-(dt_raw[rows] + p["dt_bias"])))
            s = (ssm[seqs] * np.exp(-dt * p["decay"])[:, :, None, None]
                 + (dt[:, :, None] * xs)[..., None] * b[:, :, None, :])
            y = _sum(s * cc[:, :, None, :], -1) + p["skip"][:, None] * xs
            out[rows] = y.reshape(-1, inner) * _silu(z[rows])
            conv[seqs], ssm[seqs] = c, s
            cache.on_mamba_token(m, seqs, t + 1, c, s)
        cache.set_mamba(m, conv, ssm)
        return _mm(out, p["w_out"])

    def _attention(self, a, p, h, lens, offsets, starts, cache):
        D = self.head_dim
        q = _mm(h, p["wq"]).reshape(-1, self.q_heads, D)
        k = _mm(h, p["wk"]).reshape(-1, self.kv_heads, D)
        v = _mm(h, p["wv"]).reshape(-1, self.kv_heads, D)
        spans = [slice(offsets[s], offsets[s + 1]) for s in range(len(lens))]
        cache.write_kv(a, [k[sp] for sp in spans], [v[sp] for sp in spans])
        out = np.empty_like(q)
        scale = F32(1 / np.sqrt(D))
        for s, sp in enumerate(spans):
            keys, values = cache.read_kv(a, s, starts[s] + lens[s])     # [n, kv_heads, D]
            for t in range(lens[s]):
                n = starts[s] + t + 1
                kh, vh = keys[:n][:, self.q_to_kv], values[:n][:, self.q_to_kv]
                scores = _sum(q[sp][t][None] * kh, -1).T * scale          # [q_heads, n]
                e = np.exp(scores - scores.max(-1, keepdims=True))
                probs = e / _sum(e, -1)[:, None]
                out[sp][t] = _sum(probs.T[:, :, None] * vh, 0)
        return _mm(out.reshape(-1, self.q_heads * D), p["wo"])


class PlainCache:
    """The uncached reference's state: one sequence in plain NumPy arrays, no hcache object.

    Also documents the cache-adapter protocol of :meth:`TinyHybridModel.forward` (all arrays
    host float32, sequences in the order of the forward's ``chunks``).
    """

    def __init__(self, model: TinyHybridModel):
        n_m, n_a = len(model.mamba_layers), len(model.attention_layers)
        self.conv = [np.zeros((1, model.conv_dim, model.conv_kernel), F32) for _ in range(n_m)]
        self.ssm = [np.zeros((1, model.m_heads, model.m_head_dim, model.state), F32)
                    for _ in range(n_m)]
        empty = np.zeros((0, model.kv_heads, model.head_dim), F32)
        self.k, self.v = [empty] * n_a, [empty] * n_a

    def get_mamba(self, m):
        """Conv ``[S, conv_dim, conv_kernel]`` and SSM ``[S, heads, head_dim, state]`` states of
        Mamba layer ``m`` (local index), copies the model may modify."""
        return self.conv[m].copy(), self.ssm[m].copy()

    def set_mamba(self, m, conv, ssm):
        """Store the states after the forward's last token."""
        self.conv[m], self.ssm[m] = conv, ssm

    def on_mamba_token(self, m, seqs, offset, conv, ssm):
        """States of sequences ``seqs`` after ``offset`` new tokens (snapshot hook)."""

    def write_kv(self, a, ks, vs):
        """Append K, V rows ``[T_s, kv_heads, D]`` of attention layer ``a`` per sequence."""
        self.k[a] = np.concatenate([self.k[a], ks[0]])
        self.v[a] = np.concatenate([self.v[a], vs[0]])

    def read_kv(self, a, s, n):
        """K and V ``[n, kv_heads, D]`` of positions ``[0, n)`` of sequence ``s``."""
        return self.k[a][:n], self.v[a][:n]


def reference_logits(model: TinyHybridModel, tokens) -> np.ndarray:
    """Logits ``[len(tokens), vocab]`` of ``tokens`` computed from scratch, without hcache."""
    return model.forward([list(tokens)], [0], PlainCache(model))[0]
