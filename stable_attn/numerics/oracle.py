"""Attention in float64, materialized: the exact answer the probe measures errors against.

Plain ``softmax(q k^T * scale + mask) v`` with every mask :func:`stable_attn.attention` accepts
(bottom-right causal, left window, key padding, boolean or additive ``attn_mask``, softcap, GQA), and
nothing of the kernel's algorithm (no blocks, no online softmax, no offsets). It materializes one
``[Hq, Nq, Nk]`` score tensor per batch element, so it is meant for probe-sized inputs.
"""

from __future__ import annotations

import math

import torch


def attention_fp64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """``[B, Hq, Nq, D]`` float64 output; rows that see no key are 0 (as the kernel returns)."""
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    pos = torch.arange(Nq, device=q.device)[:, None] + (Nk - Nq)
    key = torch.arange(Nk, device=q.device)[None, :]
    structural = torch.ones(Nq, Nk, dtype=torch.bool, device=q.device)
    if causal:
        structural &= key <= pos
    if window is not None:
        structural &= key > pos - window
    out = torch.zeros(B, Hq, Nq, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        kb = k[b].double().repeat_interleave(group, dim=0)
        vb = v[b].double().repeat_interleave(group, dim=0)
        s = torch.matmul(q[b].double(), kb.transpose(-1, -2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        visible = structural.expand(Hq, Nq, Nk).clone()
        if key_padding_mask is not None:
            visible &= key_padding_mask[b][None, None, :]
        if attn_mask is not None:
            m = attn_mask
            while m.dim() < 4:
                m = m.unsqueeze(0)
            m = m[b if m.shape[0] > 1 else 0].expand(Hq, Nq, Nk)
            if m.dtype == torch.bool:
                visible &= m
            else:
                s = s + m.double()
        s = s.masked_fill(~visible, -math.inf)
        any_key = torch.isfinite(s).any(dim=-1, keepdim=True)
        p = torch.softmax(torch.where(any_key, s, torch.zeros_like(s)), dim=-1)
        p = torch.where(visible & any_key, p, torch.zeros_like(p))
        out[b] = torch.matmul(p, vb)
    return out
