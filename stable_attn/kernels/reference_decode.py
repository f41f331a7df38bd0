"""The decode path in PyTorch: split keys, the rule per split, a merge by offsets. The mirror of
``triton_decode.py``, decision for decision (docs/ALGORITHM.md, "Decode: split keys").

The keys are cut into splits of ``split`` keys (``decode_plan.split_keys``: a multiple of the key block, so
each split is a run of whole blocks of the rule's partition). Each split is walked by
``reference.walk_blocks`` from the initial state (``m = -inf``, ``r = -FP32_MAX``, ``l = 0``): the rule restarts
its offset at the split's first block. A split's result is its *partial*: the fp32 accumulator ``acc_s``
(``sum P-bar_c V``, not divided), the row sum ``l_s``, the offset ``r_s`` and the true max ``m_s``. The merge
(:func:`combine`) is one more FlashAttention-2 step over the splits, in fp32, with no rounding point:
``R = max_s r_s``, ``w_s = exp2(r_s - R)``, ``O = sum_s w_s acc_s / sum_s w_s l_s``, ``lse2 = R + log2(sum_s w_s l_s)``.
"""

from __future__ import annotations

import math

import torch

from ..options import Options
from . import decode_plan
from .reference import Problem, grouped, sink_logits2, walk_blocks


def partials(q, k, v, key_padding_mask, opts: Options, split: int, sinks=None):
    """The splits' partials ``(acc [B, Hq, Nq, S, Dv], l, r, m [B, Hq, Nq, S])``, fp32, for splits of ``split``
    keys: what the decode kernel writes before its merge (the same ``r`` and ``m`` bits: the decisions).
    Learned ``sinks`` join the first split's walk as its first key (counted once in the merged row sum);
    ``m`` is the keys' own max, so a row that sees only its sink is a row that sees no key."""
    decode_plan.check_split(split, opts.key_block)
    p = Problem(q, k, v, key_padding_mask, None, opts)
    B, Hkv, G, Nq, D = p.B, p.Hkv, p.G, p.Nq, p.D
    S = decode_plan.num_splits(p.Nk, split)
    q_c = grouped(q, p).float().reshape(B, Hkv, G * Nq, D)
    blocks = list(p.key_blocks(0, Nq))  # the visible blocks of the partition, in key order
    acc = torch.empty(B, p.Hq, Nq, S, p.Dv, device=q.device)
    l, r, m = (torch.empty(B, p.Hq, Nq, S, device=q.device) for _ in range(3))
    sink2 = sink_logits2(sinks, p)
    for s in range(S):
        mine = [(j0, j1) for j0, j1 in blocks if s * split <= j0 < (s + 1) * split]
        w = walk_blocks(p, q_c, k, v, 0, Nq, mine, sink2=sink2 if s == 0 else None)
        acc[:, :, :, s] = w.acc.view(B, p.Hq, Nq, p.Dv)
        l[..., s], r[..., s], m[..., s] = (x.expand(B, Hkv, G, Nq).reshape(B, p.Hq, Nq) for x in (w.l, w.r, w.m))
    return acc, l, r, m


def combine(acc, l, r, m, dtype: torch.dtype):
    """Merge the splits (last axis of ``l, r, m``; ``acc``'s second to last): ``(out, lse2)``, as the decode
    kernel's combine step. A row that sees no key in any split outputs 0 with ``lse2 = +inf``."""
    R = r.amax(-1, keepdim=True)  # r_s >= -FP32_MAX, so R - r_s is never inf - inf
    w = torch.exp2(r - R)
    L = (w * l).sum(-1)
    A = (w[..., None] * acc).sum(-2)
    seen = m.amax(-1) != -math.inf
    out = torch.where(seen[..., None], A / L[..., None], torch.zeros_like(A)).to(dtype)
    lse2 = torch.where(seen, R[..., 0] + torch.log2(L), torch.full_like(L, math.inf))
    return out, lse2


def attention_forward(q, k, v, key_padding_mask, opts: Options, split: int | None = None, sinks=None):
    """The decode forward: ``(out, lse2, None)`` as ``reference.attention_forward`` returns them (no statistics:
    ``decode_plan.takes_decode`` sends calls with statistics to the training path). ``split`` defaults to
    ``decode_plan.split_keys`` of the shapes."""
    if split is None:
        split = decode_plan.split_keys(q.shape[0], k.shape[1], k.shape[2], opts.key_block)
    out, lse2 = combine(*partials(q, k, v, key_padding_mask, opts, split, sinks), q.dtype)
    return out, lse2, None

