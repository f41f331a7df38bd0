"""The constants of the stabilization rule and its PyTorch functions (``shifted_offset``, ``block_offset``,
``row_top2``: the twins of ``triton_forward``'s), in one place.

The PyTorch reference (``reference.py``) and the Triton kernels (``triton_forward.py``, ``triton_backward.py``) both
implement docs/ALGORITHM.md with these numbers. Everything here is in *base-2 units*: the kernels
work with ``s2 = s * log2(e)`` and ``exp2``, the instruction GPUs execute, so every threshold below
is a natural-log quantity multiplied by ``LOG2E``. The thresholds are compared with ``s2 = fl(q.k * qk_scale2)``
while ``P-bar`` is ``exp2`` of ``q.k * qk_scale2 - r`` rounded once (``tl.fma`` in the kernel,
``reference.fma_f32`` on the PyTorch path; docs/ALGORITHM.md, "Rounding points").
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634

# fp32's normal range: the score scale ``scale * LOG2E`` lies in it (options._check_scale), so the forward
# may take block maxima on the unscaled scores (docs/ALGORITHM.md, "Rounding points")
FP32_MIN_NORMAL = 2.0**-126
FP32_MAX = float(torch.finfo(torch.float32).max)

# How the kernels form a tile's base-2 scores (their SOFTCAP compile-time constant; score_form chooses).
SCORES_FUSED = 0  # the products x = q.k; P-bar = exp2(fma(x, qk_scale2, -r)), rounded once
SCORES_CAPPED = 1  # softcap: tanh(x * scale / softcap) * softcap * log2(e); P-bar = exp2(s2 - r)
SCORES_SCALED = 2  # s2 = fl(x * qk_scale2) first; P-bar = exp2(s2 - r): scales over FUSED_SCALE_MAX

# The largest qk_scale2 = scale * log2(e) whose products the kernels scale inside P-bar's fma. That form
# subtracts an fp32 offset r from the exact product x * qk_scale2; r itself is off by up to 2^-24 of it, and
# P-bar = exp2 of that error overflows fp32 once it passes 2^7, at |x * qk_scale2| >= 2^31 (about 1e9 x 2 with
# unit-scale q and k). Up to this bound a row's products may reach 2^23 before that; above it the scores are
# rounded first (two roundings, as with softcap), which stays finite wherever fp32 holds the scores.
FUSED_SCALE_MAX = 256.0


def score_form(softcap: bool, qk_scale2: float) -> int:
    """The kernels' score form (``SCORES_*``) for a call with or without softcap at ``qk_scale2``."""
    if softcap:
        return SCORES_CAPPED
    return SCORES_FUSED if qk_scale2 <= FUSED_SCALE_MAX else SCORES_SCALED


# Stabilization modes, as integers so they can be compile-time constants of a kernel.
MODE_OFF = 0  # plain FlashAttention-2: subtract the running max
MODE_EXACT = 1  # our rule: exact trigger, minimum shift, capped shift
MODE_PAPER = 2  # the published rule, verbatim (scores within 1e-3 of the block max; beta*m or 0)

# The published code's tie window, in natural units of the scaled score.
PAPER_TIE_WINDOW = 1e-3

# The published code's floor on each key block's row sum (its EPSILON), kept in paper mode: where
# the shifted offset underflows every P-bar of a row, its row sum stays 1e-10 instead of 0, so the
# row outputs values near 0 instead of NaN (ALGORITHM.md, "stabilize='paper'").
PAPER_ROW_SUM_FLOOR = 1e-10

# Minimum shift (nats) when the rule fires: the paper's rule moves nothing when m == 0 and almost
# nothing for tiny m. exp(-0.5) = 0.607 is far from 1.0 and from any power of two in every dtype.
MIN_SHIFT = 0.5

# Largest shift (nats). After the shift the row's largest P-bar is exp(-cap). bf16 and fp32 keep
# 8 exponent bits (smallest normal 2^-126 = e^-87.3): with cap 64 every entry within e^-23 of the
# row max is still a normal number, far below what fp32 accumulation can see (2^-24 = e^-16.6).
# fp16's smallest normal is 2^-14 = e^-9.7: with cap 2 every entry that can still matter at fp16
# precision (within 2^-11 = e^-7.6 of the max) stays normal.
MAX_SHIFT = {torch.bfloat16: 64.0, torch.float16: 2.0, torch.float32: 64.0}

# Significand bits (stored) of the dtype P-bar is cast to before the P-bar V product.
_STORED_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}

SUPPORTED_DTYPES = tuple(_STORED_BITS)


def tie_tolerance(dtype: torch.dtype) -> float:
    """Largest ``x >= 0`` (nats) such that ``exp(-x)`` rounds to 1.0 when cast to ``dtype``.

    The representable number just below 1.0 is ``1 - 2^-(bits+1)``; the midpoint between it and 1.0
    is ``1 - 2^-(bits+2)``, and round-to-nearest-even sends the midpoint to 1.0 (even significand).
    So ``P-bar = exp(s - r)`` becomes exactly 1.0 iff ``s - r >= log(1 - 2^-(bits+2))``.
    For bf16 that is 1.955e-3 nats: the paper's heuristic 1e-3 is about half of it.
    """
    bits = _STORED_BITS[dtype]
    return -math.log1p(-(2.0 ** -(bits + 2)))


def rule_constants(dtype: torch.dtype, mode: int) -> tuple[float, float, float]:
    """``(tie_tol2, min_shift2, max_shift2)`` in base-2 units for ``dtype`` and ``mode``.

    In paper mode the tie window is the published 1e-3 and the shift is neither floored nor capped
    (min 0, max +inf), so the caller reproduces the published rule exactly.
    """
    if mode == MODE_PAPER:
        return PAPER_TIE_WINDOW * LOG2E, 0.0, math.inf
    return tie_tolerance(dtype) * LOG2E, MIN_SHIFT * LOG2E, MAX_SHIFT[dtype] * LOG2E


def sat_tolerance2(dtype: torch.dtype) -> float:
    """The saturation statistic's window (base 2): ``P-bar`` of the row max would round to 1.0."""
    return tie_tolerance(dtype) * LOG2E


def shifted_offset(m2: torch.Tensor, beta: float, min_shift2: float, max_shift2: float) -> torch.Tensor:
    """The offset subtracted when the rule fires, for a row whose true running max is ``m2``.

    docs/ALGORITHM.md, forward step 4: the published rule subtracts ``beta*m`` (m > 0) or ``0``
    (m < 0), i.e. shifts the offset above the max by ``(beta-1)*m`` or ``-m``. We clamp that shift to
    ``[min_shift, max_shift]``. The result is non-decreasing in ``m``, which keeps the running offset
    monotone. ``beta - 1`` is formed in fp32 from the fp32 ``beta``, as the kernel does with its fp32
    argument, so both backends shift by the same bits for any ``beta``. The Triton twin is
    ``triton_forward.shifted_offset``.
    """
    beta_m1 = float(torch.tensor(beta, dtype=torch.float32)) - 1.0  # exact in double; rounds to fp32 below
    paper_shift = torch.where(m2 > 0, torch.tensor(beta_m1, dtype=torch.float32) * m2, -m2)
    return m2 + paper_shift.clamp(min=min_shift2, max=max_shift2)


def row_top2(s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest and second-largest score of each row of a block (two equal values for a tie).

    ``count(s2 >= t) >= 2`` iff ``second >= t``: every tie test of the algorithm is one comparison
    per row with these two numbers (the Triton twin is ``triton_forward.row_top2``).
    """
    if s2.shape[-1] < 2:
        return s2[..., 0], torch.full_like(s2[..., 0], -math.inf)
    top = torch.topk(s2, 2, dim=-1).values
    return top[..., 0], top[..., 1]


def block_offset(r, m_new, m_blk, m2_blk, tie2, min_shift2, max_shift2, beta, mode):
    """The stabilization rule for one key block: ``(r_new, fire)`` per row (docs/ALGORITHM.md, forward 2-4).

    ``r`` is the offset so far, ``m_new`` the running max including this block, ``m_blk`` and
    ``m2_blk`` the block's largest and second-largest score. The Triton kernel calls its twin
    ``triton_forward.block_offset`` with the same arguments; tests/kernels/test_rule_functions.py checks that
    both give the same bits.
    """
    if mode == MODE_EXACT:
        r_cand = torch.maximum(r, m_blk)
        # P-bar would round to exactly 1.0 at two or more keys of this block: shift the offset. A block
        # without a key (m2_blk = -inf) cannot fire: r >= -FP32_MAX, so r_cand - tie2 is finite
        fire = m2_blk >= r_cand - tie2
        r_new = torch.where(fire, shifted_offset(m_new, beta, min_shift2, max_shift2), r_cand)
    elif mode == MODE_PAPER:
        fire = (m2_blk >= m_blk - tie2) & (m_blk > -math.inf)
        m_adj = torch.where(fire & (m_blk > 0), beta * m_blk,
                            torch.where(fire & (m_blk < 0), torch.zeros_like(m_blk), m_blk))
        fire = fire & (m_blk != 0)
        r_new = torch.maximum(r, m_adj)
    else:
        fire = torch.zeros_like(m_blk, dtype=torch.bool)
        r_new = torch.maximum(r, m_blk)
    return r_new, fire
