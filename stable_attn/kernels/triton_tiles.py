"""Triton tile helpers both the forward (``triton_forward.py``) and the backward (``triton_backward.py``) use.

One home for what the two kernel files share: the rounding points (``round_to``), the tanh of the
softcap (``tanh_f32``), a tile's base-2 scores with its masks (``scores_tile``), the key blocks a query
block visits and which of them need no structural mask (``key_range``), the row tiles of K, V, Q or dO
through tensor descriptors or pointers (``load_tile``, ``TMA_PACKED``) and the bounds of one packed
sequence (``varlen_bounds``). Moved here from ``triton_forward.py`` unchanged: the kernels compile to
the same SASS (benchmarks/kernel_resources.py, every variant compared).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import rules

# A jit function reads only globals that are tl.constexpr instances.
TWO_LOG2E = tl.constexpr(2.0 * rules.LOG2E)
# SOFTCAP, the kernels' score form (rules.SCORES_*): 0 the products, 1 softcap, 2 scores scaled first
CAPPED = tl.constexpr(rules.SCORES_CAPPED)


@triton.jit
def tanh_f32(y):
    """tanh from one exp2, identical on the interpreter and the GPU (libdevice is GPU-only)."""
    e = tl.exp2(-(tl.abs(y) * TWO_LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t)


@triton.jit
def round_to(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """``x`` (fp32) rounded to nearest-even in ``DTYPE``: the rounding points of the algorithm.

    On the GPU this is the hardware conversion. Under the interpreter the result stays fp32 (it
    cannot compute in bf16), and bf16 is rounded here with integer arithmetic, because the
    interpreter's own fp32 -> bf16 cast truncates instead of rounding to nearest-even.
    """
    if UPCAST:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            y = bits.to(tl.float32, bitcast=True)
        else:
            y = x.to(DTYPE).to(tl.float32)
    else:
        y = x.to(DTYPE)
    return y


# ``TMA`` of the varlen programs: 3D descriptors over packed ``[total, H, D]`` (the dense kernels pass
# True for 4D descriptors over ``[B, H, N, D]``, False for pointers)
TMA_PACKED = tl.constexpr(2)


@triton.jit
def load_tile(desc, ptrs, b, h, start, stride, offs_r0, offs_d, n_rows, ROWS: tl.constexpr, HEAD_D: tl.constexpr,
              BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """Rows ``[start, start + ROWS)`` of one (batch, head) of a ``[B, H, N, D]`` tensor, zero past ``N``
    and past ``HEAD_D``: through the tensor descriptor ``desc`` (``TMA``) or the pointers ``ptrs``.

    ``TMA == TMA_PACKED``: rows ``b + start ...`` of a packed ``[total, H, D]`` tensor (``b`` is the
    sequence's first row); rows past the sequence are the next sequence's, zero only past ``total``.
    """
    if TMA:
        if TMA == TMA_PACKED:
            x = desc.load([b + start, h, 0]).reshape(ROWS, BLOCK_D)
        else:
            x = desc.load([b, h, start, 0]).reshape(ROWS, BLOCK_D)
    else:
        mask = (start + offs_r0)[:, None] < n_rows
        if HEAD_D != BLOCK_D:
            mask = mask & (offs_d[None, :] < HEAD_D)
        x = tl.load(ptrs + start * stride, mask=mask, other=0.0)
    return x


@triton.jit
def scores_tile(q, k, offs_m, offs_n, kp, qk_scale2, cap_scale, cap_log2e, Nk, pos_offset, window,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                HAS_KPM: tl.constexpr, PREC: tl.constexpr):
    """Base-2 scores ``[BLOCK_M, BLOCK_N]`` of a tile (fp32, invisible entries ``-inf``) and tanh or None.

    ``kp`` is the key padding mask of the block (bool ``[BLOCK_N]``) when ``HAS_KPM``. ``SOFTCAP`` is the score
    form (``rules.SCORES_*``; only ``CAPPED`` applies tanh). ``qk_scale2=None`` (without softcap): the unscaled
    products ``x = q.k``, masked alike (the forward scales them inside its ``exp2(fma(x, qk_scale2, -r))``, see
    ``fwd_block``).
    """
    if k is None:  # q already holds the products (the sink's score in the epilogue)
        x = q
    else:
        x = tl.dot(q, tl.trans(k), input_precision=PREC)
    if SOFTCAP == CAPPED:
        t = tanh_f32(x * cap_scale)
        s2 = t * cap_log2e
    elif qk_scale2 is None:
        t = x
        s2 = x
    else:
        t = x
        s2 = x * qk_scale2
    if HAS_KPM:
        s2 = tl.where(kp[None, :], s2, float("-inf"))
    if MASK:
        vis = offs_n[None, :] < Nk
        pos = offs_m[:, None] + pos_offset
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= pos)
        if WINDOW:
            vis = vis & (offs_n[None, :] > pos - window)
        s2 = tl.where(vis, s2, float("-inf"))
    return s2, t


@triton.jit
def key_range(q_lo, Nq, Nk, pos_offset, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks for query rows ``[q_lo, q_lo + BLOCK_M)``: ``(lo, mid_lo, mid_hi, hi)``, all block-aligned.

    ``[lo, hi)`` holds every block with a key visible to some row (the others are fully masked and
    would leave the row state unchanged); ``[mid_lo, mid_hi)`` holds the blocks every row sees in
    full, which need no structural mask.
    """
    q_last = tl.minimum(q_lo + BLOCK_M, Nq) - 1
    hi = Nk
    full_hi = (Nk // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.maximum(tl.minimum(Nk, q_last + pos_offset + 1), 0)
        full_hi = tl.minimum(full_hi, (tl.maximum(q_lo + pos_offset + 1, 0) // BLOCK_N) * BLOCK_N)
    hi_al = tl.cdiv(hi, BLOCK_N) * BLOCK_N
    lo = hi_al * 0
    mid_lo = lo
    if WINDOW:
        lo = tl.minimum((tl.maximum(q_lo + pos_offset - window + 1, 0) // BLOCK_N) * BLOCK_N, hi_al)
        full_lo = tl.maximum(q_lo + BLOCK_M - 1 + pos_offset - window + 1, 0)
        mid_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), hi_al)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), hi_al)
    return lo, mid_lo, mid_hi, hi_al


@triton.jit
def varlen_bounds(CuQ, CuK, b):
    """First query and key of sequence ``b`` (int64) and its lengths (int32), from the ``cu_seqlens``."""
    q_start = tl.load(CuQ + b)
    k_start = tl.load(CuK + b)
    return q_start.to(tl.int64), k_start.to(tl.int64), tl.load(CuQ + b + 1) - q_start, tl.load(CuK + b + 1) - k_start
