"""Packed sequences (FlashAttention's varlen layout) on the PyTorch path: one reference call per sequence.

q ``[total_q, Hq, D]``, k ``[total_k, Hkv, D]``, v ``[total_k, Hkv, Dv]``; sequence ``b`` is rows
``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k/v. Each sequence
runs through ``reference.py`` as the ``[1, H, N, D]`` view of its rows, so it gets exactly what
``attention()`` computes on that sequence alone: the same key blocks from its first key, causal and window
aligned bottom-right per sequence, learned sinks as on a dense call, and dropout seeded ``opts.seed + b``
(the Triton launchers ``triton_attention.forward_varlen`` / ``backward_varlen`` draw the same masks).
Nothing is padded. A sequence with no keys gives its rows zeros and ``lse = +inf``, as a dense row that sees
no key; a sequence with no queries contributes nothing.

The signatures and returns are those of the Triton launchers: ``lse`` is base 2, ``[Hq, total_q]``;
row statistics are shaped ``[1, Hq, total_q]``.
"""

from __future__ import annotations

import math

import torch

from .._checks import output_like
from ..options import Options
from ..stats import STATS_ENTROPY, RowStats
from . import reference


def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()  # one small device-to-host copy; this path loops on the host anyway
    return list(zip(cu[:-1], cu[1:]))


def _dense(x: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """Rows ``s:e`` of a packed ``[total, H, D]`` tensor as a ``[1, H, e - s, D]`` view (no copy)."""
    return x[s:e].transpose(0, 1).unsqueeze(0)


def forward_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, opts: Options,
                   with_stats: int, sinks: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, RowStats | None]:
    """``(out [total_q, Hq, Dv], lse2 [Hq, total_q], row_stats [1, Hq, total_q] | None)``; ``sinks`` ``[Hq]``
    as for ``reference.attention_forward`` (every sequence's rows see their head's sink)."""
    total_q, Hq, _ = q.shape
    out = output_like(q, v).zero_()
    lse2 = torch.full((Hq, total_q), math.inf, dtype=torch.float32, device=q.device)
    st = RowStats.unseen((1, Hq, total_q), q.device, entropy=with_stats == STATS_ENTROPY) if with_stats else None
    for b, ((qs, qe), (ks, ke)) in enumerate(zip(_bounds(cu_seqlens_q), _bounds(cu_seqlens_k), strict=True)):
        if qe == qs or ke == ks:
            continue  # no rows, or rows that see no key: the initial values are the answer
        o, lse_b, rs = reference.attention_forward(
            _dense(q, qs, qe), _dense(k, ks, ke), _dense(v, ks, ke), None, None, opts.replace(seed=opts.seed + b),
            with_stats, sinks,
        )
        out[qs:qe] = o[0].transpose(0, 1)
        lse2[:, qs:qe] = lse_b[0]
        if with_stats:
            st.write((..., slice(qs, qe)), rs)
    return out, lse2, st


def backward_varlen(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse2: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, opts: Options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the packed layout, from :func:`forward_varlen`'s ``out`` and ``lse2``."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b, ((qs, qe), (ks, ke)) in enumerate(zip(_bounds(cu_seqlens_q), _bounds(cu_seqlens_k), strict=True)):
        if qe == qs or ke == ks:
            continue  # no rows, or rows that see no key: zero gradients
        dq_b, dk_b, dv_b = reference.attention_backward(
            _dense(do, qs, qe), _dense(q, qs, qe), _dense(k, ks, ke), _dense(v, ks, ke), _dense(out, qs, qe),
            lse2[None, :, qs:qe], None, None, opts.replace(seed=opts.seed + b),
        )
        dq[qs:qe] = dq_b[0].transpose(0, 1)
        dk[ks:ke] = dk_b[0].transpose(0, 1)
        dv[ks:ke] = dv_b[0].transpose(0, 1)
    return dq, dk, dv
