"""Attention in float64, materialized: the exact answer every test, the numerics lab and the probe compare with.

Plain ``softmax(q k^T * scale + mask) v`` with every mask :func:`stable_attn.attention` accepts
(bottom-right causal, left window, key padding, boolean or additive ``attn_mask``, softcap, GQA), learned
sinks (one logit per query head in the softmax's denominator, as gpt-oss defines them), a value head dim apart
from the query's, and nothing of the fast paths' algorithm: no key blocks, no online softmax, no offsets, no
stabilization, no code shared with ``reference.py`` or the Triton kernels. It is differentiable
(autograd in float64 gives the exact gradients) and materializes one ``[Hq, Nq, Nk]`` score tensor
per batch element, so it is meant for test- and probe-sized inputs.
"""

from __future__ import annotations

import math

import torch


def visibility(nq: int, nk: int, *, causal: bool = False, window: int | None = None,
               key_padding_mask: torch.Tensor | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Which keys each query sees, ``[B|1, 1, Nq, Nk]`` bool (before any ``attn_mask``).

    Positions are aligned bottom-right: query ``i`` stands at ``p = i + Nk - Nq``. ``causal`` keeps
    ``j <= p``; ``window`` keeps ``j > p - window`` (with ``causal=False`` it bounds only the left
    side); ``key_padding_mask[b, j]`` keeps key ``j`` of batch element ``b``.
    """
    pos = torch.arange(nq, device=device)[:, None] + (nk - nq)
    key = torch.arange(nk, device=device)[None, :]
    vis = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if causal:
        vis &= key <= pos
    if window is not None:
        vis &= key > pos - window
    vis = vis[None, None]
    if key_padding_mask is not None:
        vis = vis & key_padding_mask.to(device)[:, None, None, :]
    return vis


def probabilities(scores: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax`` over the last dim in float64, masked entries ``-inf``; a row with no finite entry is 0.

    ``sinks`` (``[Hq]`` for ``[Hq, Nq, Nk]`` scores): gpt-oss's learned sinks, one more logit per row that
    joins the denominator and receives no value; the returned probabilities are the keys' only (they sum
    to ``1 - P(sink)``). :func:`sink_probabilities` gives the sink's own column.
    """
    return _probabilities_and_sink(scores, sinks)[0]


def sink_probabilities(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``[Hq, Nq]`` float64: the probability each row puts on its sink (0 for a row that sees no key)."""
    return _probabilities_and_sink(scores, sinks)[1]


def _probabilities_and_sink(scores: torch.Tensor, sinks: torch.Tensor | None):
    s = scores.double()
    any_key = torch.isfinite(s).any(dim=-1, keepdim=True)
    # softmax of an all -inf row is NaN, and NaN would reach the gradient through torch.where
    s = torch.where(any_key, s, torch.zeros_like(s))
    if sinks is None:
        p = torch.softmax(s, dim=-1)
        return torch.where(torch.isfinite(scores) & any_key, p, torch.zeros_like(p)), None
    column = sinks.double().reshape(-1, *([1] * (s.dim() - 1))).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)
    keys, sink = p[..., :-1], p[..., -1]
    keys = torch.where(torch.isfinite(scores) & any_key, keys, torch.zeros_like(keys))
    return keys, torch.where(any_key[..., 0], sink, torch.zeros_like(sink))


def scores(
    q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
    window: int | None = None, softcap: float | None = None,
) -> list[torch.Tensor]:
    """Per batch element, the ``[Hq, Nq, Nk]`` float64 scores softmax sees (after scale, softcap and masks;
    hidden entries ``-inf``); arguments as for :func:`attention`."""
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    vis_all = visibility(Nq, Nk, causal=causal, window=window, key_padding_mask=key_padding_mask, device=q.device)
    mask = None
    if attn_mask is not None:
        mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    out = []
    for b in range(B):  # one batch element at a time: [Hq, Nq, Nk] is the largest tensor
        kb = k[b].double().repeat_interleave(group, dim=0)
        s = torch.matmul(q[b].double(), kb.transpose(-1, -2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        vis = vis_all[b if vis_all.shape[0] > 1 else 0].expand(Hq, Nq, Nk)
        if mask is not None:
            mb = mask[b if mask.shape[0] > 1 else 0].expand(Hq, Nq, Nk)
            if mb.dtype == torch.bool:
                vis = vis & mb
            else:
                s = s + mb.double()
        out.append(s.masked_fill(~vis, -math.inf))
    return out


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
    window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, Hq, Nq, Dv]`` float64 output of q ``[B, Hq, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]``.

    Arguments mean what they mean for :func:`stable_attn.attention` (``sinks``: ``[Hq]``, the learned sink
    logits). A row that sees no key outputs 0 and gets zero gradients (as the kernels do).
    """
    group = q.shape[1] // k.shape[1]
    per_batch = scores(q, k, causal=causal, scale=scale, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                       window=window, softcap=softcap)
    outs = [torch.matmul(probabilities(s, sinks), v[b].double().repeat_interleave(group, dim=0))
            for b, s in enumerate(per_batch)]
    return torch.stack(outs)


def entropy(
    q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
    window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, Hq, Nq]`` float64: each row's attention entropy ``-sum_j p_j ln p_j`` in nats, 0 for a row that
    sees no key (the statistics' convention); arguments as for :func:`attention`. With ``sinks`` the sink is
    one more outcome of the distribution (docs/ALGORITHM.md, "Learned sinks")."""
    per_batch = scores(q, k, causal=causal, scale=scale, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                       window=window, softcap=softcap)
    out = []
    for s in per_batch:
        p, p_sink = _probabilities_and_sink(s, sinks)
        h = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(-1)
        if p_sink is not None:
            h = h - torch.where(p_sink > 0, p_sink * torch.log(p_sink), torch.zeros_like(p_sink))
        out.append(h)
    return torch.stack(out)
