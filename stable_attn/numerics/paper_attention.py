"""The paper's failing arithmetic as a training op: an all-BF16 FlashAttention-2, forward and backward (model b).

Qiu & Yao's reference (ucker/why-low-precision-training-fails, read, not copied) is a PyTorch flash
attention whose every tensor is bf16: the scores ``S``, ``P-bar = exp(S - m)``, the *unnormalised*
``O-bar = P-bar V`` and the running ``O``, ``l`` and ``m`` across key blocks, the log-sum-exp saved for
the backward, and ``delta``, ``dP``, ``dS``, ``dQ``, ``dK``, ``dV``. Each matrix product here is an fp32
accumulation rounded once to bf16 (a bf16 GEMM), each elementwise operation one bf16 rounding. Unlike
fused kernels, ``O-bar`` is rounded to bf16 *before* it is divided by ``l``: where several ``P-bar`` are
exactly 1.0, that rounding is decided by the sign of the other keys' values (docs/NUMERICS.md, "The
asymmetric-value study"). :func:`stable_attn.numerics.arithmetic.blockwise_bf16_model` is the same
forward for planted scores; a test checks the two agree bit for bit.

``fix="paper"`` is the published rule per key block: two or more bf16 scores within 1e-3 of the block max
``m`` replace the offset by ``2m`` (``m > 0``) or 0 (``m < 0``). Masked keys (causal) never count as ties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import rules

__all__ = ["PaperStats", "paper_forward", "paper_backward", "paper_attention"]

_BF16 = torch.bfloat16
FIXES = ("off", "paper")


@dataclass
class PaperStats:
    """Counts over (row, key block) pairs that see a key, accumulated by :func:`paper_attention`."""

    blocks: int = 0
    # blocks with two or more P-bar equal to 1.0 against the plain running max (the trigger, fix or not)
    tie_blocks: int = 0
    # blocks where the paper's rule shifted the offset
    fired_blocks: int = 0

    @property
    def tie_rate(self) -> float:
        return self.tie_blocks / self.blocks if self.blocks else 0.0

    @property
    def fired_rate(self) -> float:
        return self.fired_blocks / self.blocks if self.blocks else 0.0


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A bf16 GEMM: exact bf16 products, fp32 accumulation, the result rounded once to bf16."""
    return torch.matmul(a.float(), b.float()).to(_BF16)


def _scores(q: torch.Tensor, kj: torch.Tensor, scale: float, visible: torch.Tensor | None) -> torch.Tensor:
    s = _mm(q, kj.transpose(-1, -2)) * scale
    return s if visible is None else s.masked_fill(~visible, -float("inf"))


def _visible(n_q: int, j0: int, j1: int, causal: bool, device: torch.device) -> torch.Tensor | None:
    if not causal:
        return None
    return torch.arange(n_q, device=device)[:, None] >= torch.arange(j0, j1, device=device)[None, :]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fix: str, block_n: int) -> None:
    if q.dtype != _BF16 or k.dtype != _BF16 or v.dtype != _BF16:
        raise TypeError(f"q, k, v must be bfloat16 (the paper's arithmetic); got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q must be [B, H, Nq, D] and k, v [B, H, Nk, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if fix not in FIXES:
        raise ValueError(f"fix={fix!r}; accepted values: {FIXES}")
    if block_n < 1:
        raise ValueError(f"block_n={block_n} must be >= 1")


def paper_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, fix: str = "off",
                  block_n: int = 512, causal: bool = True,
                  stats: PaperStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``O`` ``[B, H, Nq, D]`` and the log-sum-exp ``[B, H, Nq, 1]`` (natural log), both bf16, in the paper's
    arithmetic. Causal masks key ``j > i`` (queries and keys aligned at the start)."""
    _check(q, k, v, fix, block_n)
    n_q, n_k = q.shape[-2], k.shape[-2]
    shape = (*q.shape[:-1], 1)
    r = torch.full(shape, -torch.finfo(_BF16).max, dtype=_BF16, device=q.device)  # the published initial "max"
    l = torch.zeros(shape, dtype=_BF16, device=q.device)
    o = torch.zeros(q.shape, dtype=_BF16, device=q.device)
    for j0 in range(0, n_k, block_n):
        j1 = min(j0 + block_n, n_k)
        s = _scores(q, k[..., j0:j1, :], scale, _visible(n_q, j0, j1, causal, q.device))
        m_blk = s.amax(dim=-1, keepdim=True)
        live = m_blk > -float("inf")
        m_adj = m_blk
        fired = torch.zeros_like(live)
        if fix == "paper":
            ties = ((s >= m_blk - rules.PAPER_TIE_WINDOW) & (s > -float("inf"))).sum(dim=-1, keepdim=True) > 1
            m_adj = torch.where(ties & (m_blk > 0), 2.0 * m_blk, m_blk)
            m_adj = torch.where(ties & (m_adj < 0), torch.zeros_like(m_adj), m_adj)
            fired = ties & (m_blk != 0)
        r_new = torch.maximum(m_adj, r)
        p = torch.exp(s - r_new)
        if stats is not None:
            plain = torch.exp(s - torch.maximum(m_blk, r))  # P-bar against the plain running max
            stats.blocks += int(live.sum())
            stats.tie_blocks += int(((plain == 1.0).sum(dim=-1, keepdim=True) >= 2).logical_and(live).sum())
            stats.fired_blocks += int(fired.logical_and(live).sum())
        alpha = torch.exp(r - r_new)
        l = alpha * l + p.float().sum(dim=-1, keepdim=True).to(_BF16).clamp(min=rules.PAPER_ROW_SUM_FLOOR)
        o = o * alpha + _mm(p, v[..., j0:j1, :])
        r = r_new
    o = o / l
    return o, r + torch.log(l)


def paper_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, *, scale: float, block_n: int = 512,
                   causal: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2's backward in bf16: ``delta = rowsum(dO * O)``, then per key block ``P = exp(S - lse)``,
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - delta)``, ``dQ += dS K scale``, ``dK = dS^T Q scale``."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    do = do.to(_BF16)
    delta = (do * o).float().sum(dim=-1, keepdim=True).to(_BF16)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for j0 in range(0, n_k, block_n):
        j1 = min(j0 + block_n, n_k)
        kj, vj = k[..., j0:j1, :], v[..., j0:j1, :]
        p = torch.exp(_scores(q, kj, scale, _visible(n_q, j0, j1, causal, q.device)) - lse)
        dv[..., j0:j1, :] = _mm(p.transpose(-1, -2), do)
        ds = p * (_mm(do, vj.transpose(-1, -2)) - delta)
        dq = dq + _mm(ds, kj) * scale
        dk[..., j0:j1, :] = _mm(ds.transpose(-1, -2), q) * scale
    return dq, dk, dv


class _PaperAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, fix: str, block_n: int, causal: bool, stats):
        o, lse = paper_forward(q, k, v, scale=scale, fix=fix, block_n=block_n, causal=causal, stats=stats)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (scale, block_n, causal)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        scale, block_n, causal = ctx.args
        dq, dk, dv = paper_backward(do, q, k, v, o, lse, scale=scale, block_n=block_n, causal=causal)
        return dq, dk, dv, None, None, None, None, None


def paper_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, fix: str = "off",
                    scale: float | None = None, block_n: int = 512, causal: bool = True,
                    stats: PaperStats | None = None) -> torch.Tensor:
    """Differentiable attention of bf16 ``q, k, v`` ``[B, H, N, D]`` in the paper's all-BF16 arithmetic
    (forward and backward); ``scale`` defaults to ``D ** -0.5``; ``stats`` (optional) accumulates the tie and
    fired counts of the forward."""
    _check(q, k, v, fix, block_n)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _PaperAttention.apply(q, k, v, scale, fix, block_n, causal, stats)
