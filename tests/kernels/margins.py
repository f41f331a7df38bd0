"""Which decisions two matrix-multiply implementations must agree on, and inputs on which they all do.

The PyTorch path's scores come from torch's matmul (MKL or ATen's own vectorised kernels), the
interpreter's from NumPy's BLAS (OpenBLAS, whose kernel depends on the CPU and on ``OPENBLAS_CORETYPE``),
a GPU's from tensor cores. Each sums ``q.k`` in its own order, so the last bits of an fp32 score differ
between them, and a decision that compares two scores (the tie trigger, the saturation statistic)
can flip where the comparison's margin is below that difference. Two tools:

* :func:`on_grid` builds inputs whose scores are exact in *any* summation order: q and k on a dyadic
  grid, few significant bits, so every product and every partial sum is an fp32 number. There both
  backends see identical scores and must take bit-identical decisions (ties at the max included).
* :func:`robust_rows` says, for arbitrary inputs, which rows' decisions no summation order can change:
  the rule's walk (docs/ALGORITHM.md, forward steps 2-4, and the saturation statistic) replayed in fp64
  with every comparison's margin checked against a bound on the score error.

The bound. For an fp32 dot product of length D, computed in any order (FMA or not, blocked or not),
``|fl(q.k) - q.k| <= gamma_D * sum_i |q_i k_i|`` with ``gamma_D = D u / (1 - D u)``, ``u = 2^-24``
(Higham, *Accuracy and Stability of Numerical Algorithms*, eq. 3.5; the products are included).
Two implementations differ by at most twice that. The scaled score is ``x * qk_scale2`` (one more
rounding, common to both only where x agrees), softcap's ``tanh`` differs by an ulp between libraries.
The running offset ``r`` moves with the row max with slope at most ``beta`` (``rules.shifted_offset``),
so a comparison ``m2_blk >= max(r, m_blk) - tie2`` is safe when its margin exceeds ``(2 + beta) E``
plus a few fp32 ulps of the compared values.
"""

from __future__ import annotations

import math

import torch

from stable_attn import options as options_mod
from stable_attn import rules
from stable_attn.kernels import naive

U32 = 2.0**-24  # unit roundoff of fp32
ROUNDING_ULPS = 8  # fp32 ulps of the compared values added to every margin (subtractions, scaling)


def on_grid(x: torch.Tensor, step: float = 2.0**-5) -> torch.Tensor:
    """``x`` rounded to a multiple of ``step`` (a power of two): with |x| < 8 and step 2^-5, at most
    8 significant bits, exact in bf16, fp16 and fp32."""
    return torch.round(x / step) * step


def _grid_exponent(x: torch.Tensor) -> int | None:
    """Smallest ``a >= -60`` with ``x * 2^a`` integral everywhere, or None (not a dyadic grid we know)."""
    xd = x.detach().double().cpu()
    for a in range(-60, 61):
        if torch.equal(torch.frac(xd * 2.0**a), torch.zeros_like(xd)):
            return a
    return None


def scores_exact_in_fp32(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether every ``q_i . k_j`` is computed exactly by any fp32 summation order.

    True when q and k lie on dyadic grids ``2^-a``, ``2^-b`` and ``sum_d |q_d k_d| * 2^(a+b) <= 2^24``:
    every product and partial sum is then an integer multiple of ``2^-(a+b)`` below ``2^24`` of them.
    Coordinates where q or k is zero in every row add exact zeros, whatever the other holds there.
    """
    dims = tuple(range(q.dim() - 1))
    active = (q != 0).any(dim=dims).cpu() & (k != 0).any(dim=dims).cpu()
    if not bool(active.any()):
        return True
    q, k = q.detach().cpu()[..., active], k.detach().cpu()[..., active]
    a, b = _grid_exponent(q), _grid_exponent(k)
    if a is None or b is None:
        return False
    return bool((_abs_products(q, k) * 2.0 ** (a + b) <= 2.0**24).all())


def _abs_products(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``sum_d |q_d| |k_d|``, ``[B, Hq, Nq, Nk]`` fp64 (k's heads repeated for GQA)."""
    group = q.shape[1] // k.shape[1]
    qa = q.detach().double().cpu().abs()
    ka = k.detach().double().cpu().abs().repeat_interleave(group, dim=1)
    return qa @ ka.transpose(-1, -2)


def _options(q: torch.Tensor, kw: dict) -> options_mod.Options:
    names = set(options_mod.DEFAULTS)
    return options_mod.Options.create(head_dim=q.shape[-1], **{n: kw[n] for n in names if n in kw})


def _scores2(q, k, opts: options_mod.Options, key_padding_mask, attn_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Base-2 scores in fp64 ``[B, Hq, Nq, Nk]`` (masked: -inf) and the bound E on each one's fp32 error
    difference between two implementations."""
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    group = Hq // k.shape[1]
    kd = k.detach().double().cpu().repeat_interleave(group, dim=1)
    x = q.detach().double().cpu() @ kd.transpose(-1, -2)
    gamma = D * U32 / (1 - D * U32)
    ex = 0.0 if scores_exact_in_fp32(q, k) else 2 * gamma * _abs_products(q, k)
    if opts.softcap is not None:
        t = torch.tanh(x * opts.cap_scale)
        s2 = t * opts.cap_log2e
        slope = opts.cap_scale * opts.cap_log2e  # d s2 / dx <= this
        err = ex * slope + 4 * U32 * s2.abs() + 4 * U32 * opts.cap_log2e  # + tanh's ulp in each library
    else:
        s2 = x * opts.qk_scale2
        err = ex * opts.qk_scale2 + (0.0 if isinstance(ex, float) else 2 * U32 * s2.abs())
    err = torch.as_tensor(err, dtype=torch.float64).expand(B, Hq, Nq, Nk)
    vis = naive.visibility(Nq, Nk, causal=opts.causal, window=opts.window,
                           key_padding_mask=None if key_padding_mask is None else key_padding_mask.cpu()).cpu()
    am = attn_mask
    if am is not None:
        am = am.detach().cpu()
        am = am.reshape((1,) * (4 - am.dim()) + tuple(am.shape))
        if am.dtype == torch.bool:
            vis = vis & am
        else:
            s2 = s2 + am.double() * rules.LOG2E
            err = err + 2 * U32 * s2.abs()
    s2 = s2.masked_fill(~vis, -math.inf)
    return s2, torch.where(vis, err, torch.zeros_like(err))


def robust_rows(q: torch.Tensor, k: torch.Tensor, **kw) -> torch.Tensor:
    """``[B, Hq, Nq]`` bool: rows whose tie decisions and saturation no fp32 summation order can change.

    ``kw`` are :func:`stable_attn.attention`'s arguments (masks, scale, softcap, ``stabilize``, ``beta``,
    ``block_n``). Where the scores are exact in fp32 (:func:`scores_exact_in_fp32`, no softcap and no
    additive mask) every row is robust: both backends then run the same fp32 operations on the same
    numbers.
    """
    return robust_rows_of(q, k, _options(q, kw), kw.get("key_padding_mask"), kw.get("attn_mask"))


def robust_rows_of(q: torch.Tensor, k: torch.Tensor, opts: options_mod.Options, key_padding_mask=None,
                   attn_mask=None) -> torch.Tensor:
    """:func:`robust_rows` for resolved :class:`~stable_attn.options.Options` (the launchers' tests)."""
    s2, err = _scores2(q, k, opts, key_padding_mask, attn_mask)
    if not bool((err > 0).any()):
        return torch.ones(s2.shape[:-1], dtype=torch.bool)
    tie2, min_shift2, max_shift2 = rules.rule_constants(q.dtype, opts.mode)
    sat2 = rules.sat_tolerance2(q.dtype)
    e_row = err.amax(-1)
    slack = (2 + opts.beta) * e_row
    row = s2.shape[:-1]
    m = torch.full(row, -math.inf, dtype=torch.float64)
    m2 = torch.full(row, -math.inf, dtype=torch.float64)
    r = torch.full(row, -rules.FP32_MAX, dtype=torch.float64)
    robust = torch.ones(row, dtype=torch.bool)

    def safe(lhs: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        """``lhs >= rhs`` cannot flip: a side is -inf (exact), or the margin beats the bound."""
        finite = torch.isfinite(lhs) & torch.isfinite(rhs)
        scale = torch.maximum(lhs.abs(), rhs.abs()).nan_to_num(0.0, 0.0, 0.0)
        tol = slack + ROUNDING_ULPS * U32 * scale
        return ~finite | ((lhs - rhs).abs() > tol)

    bn = opts.key_block
    for j0 in range(0, s2.shape[-1], bn):
        blk = s2[..., j0 : j0 + bn]
        top = blk.topk(min(2, blk.shape[-1]), dim=-1).values
        m_blk = top[..., 0]
        m2_blk = top[..., 1] if top.shape[-1] > 1 else torch.full_like(m_blk, -math.inf)
        m_new = torch.maximum(m, m_blk)
        if opts.mode == rules.MODE_EXACT:
            r_cand = torch.maximum(r, m_blk)
            robust &= safe(m2_blk, r_cand - tie2)
            fire = m2_blk >= r_cand - tie2
            shift = torch.where(m_new > 0, (opts.beta - 1) * m_new, -m_new).clamp(min_shift2, max_shift2)
            r = torch.where(fire, m_new + shift, r_cand)
        elif opts.mode == rules.MODE_PAPER:
            robust &= safe(m2_blk, m_blk - tie2)
            fire = (m2_blk >= m_blk - tie2) & (m_blk > -math.inf)
            # m_blk == 0 skips the rule: only a score that is exactly 0 in every order is safe there
            robust &= ~fire | (m_blk.abs() > e_row) | (e_row == 0)
            m_adj = torch.where(fire & (m_blk > 0), opts.beta * m_blk,
                                torch.where(fire & (m_blk < 0), torch.zeros_like(m_blk), m_blk))
            r = torch.maximum(r, m_adj)
        m2 = torch.maximum(torch.minimum(m, m_blk), torch.maximum(m2, m2_blk))
        m = m_new
    robust &= safe(m2, m - sat2)
    return robust


def score_error_output_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor,
                             o: torch.Tensor, scale: float) -> torch.Tensor:
    """First-order bound on how far the fp32 score errors alone move an output, ``[B, Hq, Nq, D]`` fp64.

    ``q [B, Hq, Nq, D]``, ``k, v [B, Hkv, Nk, D]``, ``p`` the exact probabilities, ``o`` the exact output.
    A score error ``d_j`` moves ``o_i`` by ``sum_j p_ij d_j (v_j - o_i)``; with ``|d_j| <= gamma_D scale
    sum_d |q_d k_jd|`` (softcap's tanh only shrinks it) that is at most
    ``gamma_D scale [sum_j p_ij A_ij |v_j| + |o_i| sum_j p_ij A_ij]``, ``A = |q| |k|^T``. Large logits
    make it large: the error of a score grows with its size, and softmax passes it on in full.
    """
    D = q.shape[-1]
    gamma = D * U32 / (1 - D * U32)
    group = q.shape[1] // k.shape[1]
    pa = p * _abs_products(q, k)
    va = v.detach().double().cpu().abs().repeat_interleave(group, dim=1)
    return gamma * scale * (pa @ va + pa.sum(-1, keepdim=True) * o.abs())
