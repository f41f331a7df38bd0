"""The fp64 oracle every attention test compares against: plain softmax attention, materialized.

Kept deliberately naive (no blocks, no online softmax, no stabilization) so that it shares no
code or idea with what it checks.
"""

from __future__ import annotations

import math

import torch


def oracle_attention(q, k, v, *, causal=False, scale=None, key_padding_mask=None, attn_mask=None,
                     window=None, softcap=None):
    """fp64 attention on [B, H, N, D] inputs (k/v may have fewer heads). Rows that see no key give 0."""
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    g = Hq // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    visible = torch.ones(B, Hq, Nq, Nk, dtype=torch.bool)
    pos = torch.arange(Nq)[:, None] + (Nk - Nq)
    key = torch.arange(Nk)[None, :]
    if causal:
        visible &= key <= pos
    if window is not None:
        visible &= key > pos - window
    if key_padding_mask is not None:
        visible &= key_padding_mask[:, None, None, :]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            visible &= attn_mask
        else:
            s = s + attn_mask.double()
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    p = torch.where(denom > 0, e / denom.clamp(min=1e-300), torch.zeros_like(e))
    return torch.einsum("bhij,bhjd->bhid", p, v)
