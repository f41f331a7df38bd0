"""Triton backward kernels: FlashAttention-2 backward, the same arithmetic as ``reference.attention_backward``.

Three launches, no atomics, so the gradients are deterministic:

1. ``attn_bwd_preprocess``: ``delta = rowsum(dO * O)`` in fp32, one value per query row;
2. ``attn_bwd_dkdv_kernel``: one program per (key block, batch, kv head). It loops over the ``G``
   query heads that share the kv head (GQA without repeating k/v and without partial buffers) and,
   for each, over the query blocks that see the key block, accumulating dK and dV in fp32;
3. ``attn_bwd_dq_kernel``: one program per (query block, batch, query head), looping over the key
   blocks like the forward and accumulating dQ in fp32.

Both gradient kernels recompute ``P`` from the saved base-2 log-sum-exp as the forward formed ``P-bar``:
``exp2(fma(x, qk_scale2, -lse2))`` on the products ``x = q.k``, rounded once (with softcap
``exp2(s2 - lse2)``): ``fl(x * qk_scale2)`` would move each key's exponent by up to half an ulp of a
huge ``s2`` against the forward's (docs/ALGORITHM.md, "Rounding points"). With
``TMA`` (sm_90, strides the Tensor Memory Accelerator accepts; the launcher decides) the tiles that
stream through the inner loop (Q and dO for dK/dV, K and V for dQ) arrive through 4D tensor
descriptors over ``[B, H, N, D]``: no per-element addresses in registers, which is what lets a
128-key dK/dV tile run on wgmma without spills; the hardware zero-fills rows past ``N`` and columns
past ``HEAD_D``, as the masked loads of the pointer path do. The

stabilization does not appear here: it changed only the offset, not ``O`` or ``lse``. Rounding
points as in the reference: ``P`` (after dropout scaling) is cast to the input dtype before
``P^T dO``; ``dS * scale`` is cast to the input dtype before ``dS K`` and ``dS^T Q``.

Packed sequences: ``attn_bwd_preprocess_varlen``, ``attn_bwd_dkdv_varlen_kernel`` and
``attn_bwd_dq_varlen_kernel`` run the same program bodies (``delta_program``, ``dkdv_program``,
``dq_program``) over (block of the longest sequence, head, sequence), with the offsets of
``triton_forward.fwd_program`` (same reason for separate entries: the dense kernels' SASS is unchanged).
With ``TMA`` the descriptors are 3D over the packed ``[total, H, D]`` tensors (``TMA_PACKED``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_order import query_block
from .triton_tiles import CAPPED, TMA_PACKED, key_range, load_tile, round_to, scores_tile, tanh_f32, varlen_bounds


@triton.jit
def delta_program(Out, DO, Delta, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don, Hq, Nq,
                  q_start, total_q, b_first, VARLEN: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """``delta`` of ``BLOCK_M`` rows of one (batch, head) into ``[B, Hq, Nq]``, or with ``VARLEN`` of one
    (sequence from row ``q_start``, head) of packed ``[total_q, Hq, D]`` tensors into ``[Hq, total_q]``."""
    start_m = tl.program_id(0)
    h = tl.program_id(1)
    b = (tl.program_id(2) + b_first).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Nq) & (offs_d[None, :] < HEAD_D)
    o = tl.load(Out + (q_start * stride_on if VARLEN else b * stride_ob) + h * stride_oh + offs_m[:, None] * stride_on
                + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + (q_start * stride_don if VARLEN else b * stride_dob) + h * stride_doh
                 + offs_m[:, None] * stride_don + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    row0 = h.to(tl.int64) * total_q + q_start if VARLEN else (b * Hq + h) * Nq
    tl.store(Delta + row0 + offs_m, tl.sum(o * do, 1), mask=offs_m < Nq)


@triton.jit(do_not_specialize=["b_first"])
def attn_bwd_preprocess(Out, DO, Delta, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
                        Hq, Nq, b_first, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    delta_program(Out, DO, Delta, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don, Hq, Nq,
                  None, None, b_first, False, HEAD_D, BLOCK_D, BLOCK_M)


@triton.jit(do_not_specialize=["Hq", "total_q"])
def attn_bwd_preprocess_varlen(Out, DO, Delta, CuQ, stride_oh, stride_on, stride_doh, stride_don, Hq, total_q,
                               HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    b = tl.program_id(2)
    q_start = tl.load(CuQ + b)
    Nq = tl.load(CuQ + b + 1) - q_start
    if tl.program_id(0) * BLOCK_M >= Nq:
        return
    delta_program(Out, DO, Delta, 0, stride_oh, stride_on, 0, stride_doh, stride_don, Hq, Nq, q_start.to(tl.int64),
                  total_q, 0, True, HEAD_D, BLOCK_D, BLOCK_M)


@triton.jit
def dkdv_block(dk, dv, k, v, kp, Q, DO, b, h, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m, offs_m0, offs_n,
               offs_d, offs_dv, stride_qn, stride_don, Nq, Nk, pos_offset, window, qk_scale2, cap_scale, cap_log2e,
               scale,
               seed, drop_p, keep_scale, drop_head,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
               HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
               HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, DTYPE: tl.constexpr,
               UPCAST: tl.constexpr, PREC: tl.constexpr,
               TMA: tl.constexpr):
    """One query block's contribution to dK, dV of a key block, in transposed ``[BLOCK_N, BLOCK_M]`` tiles."""
    dk, dv, _ = dkdv_step(dk, dv, k, v, kp, Q, DO, b, h, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m, offs_m0, offs_n,
                          offs_d, offs_dv, stride_qn, stride_don, Nq, Nk, pos_offset, window, qk_scale2, cap_scale,
                          cap_log2e, scale, seed, drop_p, keep_scale, drop_head, MASK, CAUSAL, WINDOW, SOFTCAP, HAS_KPM,
                          DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, BLOCK_M, DTYPE, UPCAST, PREC, TMA)
    return dk, dv


@triton.jit
def dkdv_step(dk, dv, k, v, kp, Q, DO, b, h, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m, offs_m0, offs_n,
              offs_d, offs_dv, stride_qn, stride_don, Nq, Nk, pos_offset, window, qk_scale2, cap_scale, cap_log2e,
              scale,
              seed, drop_p, keep_scale, drop_head,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
              HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
              HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, DTYPE: tl.constexpr,
              UPCAST: tl.constexpr, PREC: tl.constexpr,
              TMA: tl.constexpr):
    """:func:`dkdv_block`'s arithmetic, also returning ``dS * scale`` rounded to the input dtype
    (``[BLOCK_N, BLOCK_M]``, the operand of ``dS^T Q``), which the fused backward
    (``triton_backward_fused.py``) multiplies by K for its dQ: one place for the rounding points. ``dO`` (and V,
    dV) have the value head dim ``HEAD_DV`` (``offs_dv``), q and K the query's ``HEAD_D``."""
    offs_m = start_m + offs_m0
    row_ok = offs_m < Nq
    q = load_tile(Q, q_ptrs, b, h, start_m, stride_qn, offs_m0, offs_d, Nq, BLOCK_M, HEAD_D, BLOCK_D, TMA)
    do = load_tile(DO, do_ptrs, b, h, start_m, stride_don, offs_m0, offs_dv, Nq, BLOCK_M, HEAD_DV, BLOCK_DV, TMA)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    # rows past Nq get lse = +inf, hence P = 0 and no contribution
    lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + offs_m, mask=row_ok, other=0.0)

    x = tl.dot(k, tl.trans(q), input_precision=PREC)
    if SOFTCAP == CAPPED:
        t = tanh_f32(x * cap_scale)
        s = t * cap_log2e
    elif SOFTCAP:  # huge scales: the scores rounded first, as the forward's (rules.SCORES_SCALED)
        s = x * qk_scale2
    else:  # the unscaled products, scaled inside the fma below, as the forward does
        s = x
    if HAS_KPM:
        s = tl.where(kp[:, None], s, float("-inf"))
    if MASK:
        vis = offs_n[:, None] < Nk
        pos = offs_m[None, :] + pos_offset
        if CAUSAL:
            vis = vis & (offs_n[:, None] <= pos)
        if WINDOW:
            vis = vis & (offs_n[:, None] > pos - window)
        s = tl.where(vis, s, float("-inf"))
    if SOFTCAP:
        p = tl.exp2(s - lse[None, :])
    else:  # P = exp2(x * qk_scale2 - lse2) rounded once: the P-bar of the forward's fwd_block, lse2 for r
        p = tl.exp2(tl.fma(s, qk_scale2, -lse[None, :]))
    if DROPOUT:
        dp = tl.dot(v, tl.trans(do), input_precision=PREC)
        keep = tl.rand(seed, drop_head + offs_m[None, :].to(tl.int64) * Nk + offs_n[:, None]) >= drop_p
        p_drop = tl.where(keep, p * keep_scale, 0.0)
        dp = tl.where(keep, dp * keep_scale, 0.0) - delta[None, :]
    else:
        # dP - delta with the product accumulated onto -delta: no separate delta tile in registers
        dp = tl.dot(v, tl.trans(do), tl.zeros_like(s) - delta[None, :], input_precision=PREC)
        p_drop = p
    p_cast = round_to(p_drop, DTYPE, UPCAST)
    dv = tl.dot(p_cast, do, dv, input_precision=PREC)
    ds = p * dp
    if SOFTCAP == CAPPED:
        ds = ds * (1.0 - t * t)
    ds_cast = round_to(ds * scale, DTYPE, UPCAST)
    dk = tl.dot(ds_cast, q, dk, input_precision=PREC)
    return dk, dv, ds_cast


@triton.jit
def query_range(start_n, Nq, Nk, pos_offset, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks for keys ``[start_n, start_n + BLOCK_N)``: ``(q_lo, mid_lo, mid_hi, q_hi)``, block-aligned.

    ``[q_lo, q_hi)`` holds the query blocks that see some key of this block; ``[mid_lo, mid_hi)`` those
    that see all of it (no structural mask). The fused backward's dQ sum asks it which key blocks wrote
    a partial for a query block, so the two cannot disagree.
    """
    q_lo = 0
    q_hi = Nq
    full_lo = 0
    full_hi = Nq + BLOCK_M
    if CAUSAL:
        q_lo = (tl.maximum(start_n - pos_offset, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - pos_offset, 0), BLOCK_M) * BLOCK_M
    if WINDOW:
        q_hi = tl.minimum(tl.maximum(start_n + BLOCK_N - 1 - pos_offset + window, 0), Nq)
        full_hi = (tl.maximum(start_n + window - pos_offset, 0) // BLOCK_M) * BLOCK_M
    q_hi = tl.cdiv(q_hi, BLOCK_M) * BLOCK_M
    q_lo = tl.minimum(q_lo, q_hi)
    mid_lo = tl.minimum(tl.maximum(full_lo, q_lo), q_hi)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), q_hi)
    if start_n + BLOCK_N > Nk:  # a partial key block is masked everywhere: all in the first stretch
        mid_lo = q_hi
        mid_hi = q_hi
    return q_lo, mid_lo, mid_hi, q_hi


@triton.jit
def dkdv_program(
    Q, K, V, KPM, DO, Lse, Delta, DK, DV,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_kpmb, Hq, G, Nq, Nk, window, q_start, k_start, total_q, b_first, qk_scale2, cap_scale, cap_log2e, scale,
    seed, drop_p, keep_scale, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dK, dV of one key block; with ``TMA``, ``Q`` and ``DO`` are descriptors (blocks ``[1, 1, BLOCK_M, BLOCK_D]``
    and ``[1, 1, BLOCK_M, BLOCK_DV]``). ``HEAD_DV``: V's head dim (``triton_forward.fwd_program``).

    ``VARLEN``: a key block of sequence ``b`` of packed tensors, offsets as in ``triton_forward.fwd_program``
    (``TMA`` is then ``TMA_PACKED``). The query rows a descriptor reads past the sequence's end belong to
    the next sequence: their ``lse`` is read as ``+inf``, so ``P = 0`` and ``dS = 0`` there and they add
    exact zeros (finite inputs), as the zero-filled rows of the dense descriptor do. An inf or NaN there
    reaches this sequence's dK/dV (``0 * NaN``). Zeroing those rows after the load is not done: it cost
    the steady loop 487 -> 585 / 350 -> 468 SASS and spills 24 -> 88 / 32 -> 216 bytes at D = 64 / 128
    (``benchmarks/kernel_resources.py --varlen true --kernels bwd_dkdv --cc 90 --d 64 128``, bf16, causal).
    """
    start_n = tl.program_id(0) * BLOCK_N
    hkv = tl.program_id(1)
    b = tl.program_id(2) + b_first  # dense: launches in chunks of the batch start at b_first (grid limit)
    b64 = b.to(tl.int64)
    tile_b = q_start.to(tl.int32) if VARLEN else b  # what the descriptor loads index by
    pos_offset = Nk - Nq

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)
    kv_mask = offs_n[:, None] < Nk
    if HEAD_D != BLOCK_D:
        kv_mask = kv_mask & (offs_d[None, :] < HEAD_D)
    v_mask = kv_mask
    if HEAD_DV != HEAD_D:
        v_mask = (offs_n[:, None] < Nk) & (offs_dv[None, :] < HEAD_DV)
    k = tl.load(K + (k_start * stride_kn if VARLEN else b64 * stride_kb) + hkv * stride_kh
                + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + (k_start * stride_vn if VARLEN else b64 * stride_vb) + hkv * stride_vh
                + offs_n[:, None] * stride_vn + offs_dv[None, :], mask=v_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    kp = offs_n < 0  # placeholder, only read when HAS_KPM
    if HAS_KPM:
        kp = tl.load(KPM + b64 * stride_kpmb + offs_n, mask=offs_n < Nk, other=0) != 0

    q_lo, mid_lo, mid_hi, q_hi = query_range(start_n, Nq, Nk, pos_offset, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, G):
        h = hkv * G + g
        if TMA:
            q_ptrs = Q
            do_ptrs = DO
        else:
            q_ptrs = (Q + (q_start * stride_qn if VARLEN else b64 * stride_qb) + h * stride_qh
                      + offs_m0[:, None] * stride_qn + offs_d[None, :])
            do_ptrs = (DO + (q_start * stride_don if VARLEN else b64 * stride_dob) + h * stride_doh
                       + offs_m0[:, None] * stride_don + offs_dv[None, :])
        row0 = h.to(tl.int64) * total_q + q_start if VARLEN else (b64 * Hq + h) * Nq
        lse_ptr = Lse + row0
        delta_ptr = Delta + row0
        # varlen: the counters of attention() on the sequence alone (b = 0)
        drop_head = h.to(tl.int64) * Nq * Nk if VARLEN else row0 * Nk
        for start_m in range(q_lo, mid_lo, BLOCK_M):
            dk, dv = dkdv_block(dk, dv, k, v, kp, Q, DO, tile_b, h, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m,
                                offs_m0, offs_n, offs_d, offs_dv, stride_qn, stride_don, Nq, Nk, pos_offset, window,
                                qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale, drop_head, True,
                                CAUSAL, WINDOW, SOFTCAP, HAS_KPM, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV,
                                BLOCK_M, DTYPE, UPCAST,
                                PREC, TMA)
        for start_m in range(mid_lo, mid_hi, BLOCK_M):
            dk, dv = dkdv_block(dk, dv, k, v, kp, Q, DO, tile_b, h, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m,
                                offs_m0, offs_n, offs_d, offs_dv, stride_qn, stride_don, Nq, Nk, pos_offset, window,
                                qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale, drop_head, False,
                                CAUSAL, WINDOW, SOFTCAP, HAS_KPM, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV,
                                BLOCK_M, DTYPE, UPCAST,
                                PREC, TMA)
        if WINDOW:  # without a window every query block past the diagonal sees the whole key block
            for start_m in range(mid_hi, q_hi, BLOCK_M):
                dk, dv = dkdv_block(dk, dv, k, v, kp, Q, DO, tile_b, h, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m,
                                    offs_m0, offs_n, offs_d, offs_dv, stride_qn, stride_don, Nq, Nk, pos_offset, window,
                                    qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale, drop_head,
                                    True, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV,
                                    BLOCK_DV, BLOCK_M, DTYPE,
                                    UPCAST, PREC, TMA)

    tl.store(DK + (k_start * stride_dkn if VARLEN else b64 * stride_dkb) + hkv * stride_dkh
             + offs_n[:, None] * stride_dkn + offs_d[None, :], round_to(dk, DTYPE, UPCAST).to(DTYPE), mask=kv_mask)
    tl.store(DV + (k_start * stride_dvn if VARLEN else b64 * stride_dvb) + hkv * stride_dvh
             + offs_n[:, None] * stride_dvn + offs_dv[None, :], round_to(dv, DTYPE, UPCAST).to(DTYPE), mask=v_mask)


@triton.jit(do_not_specialize=["Hq", "G", "Nq", "Nk", "window", "b_first", "seed"])
def attn_bwd_dkdv_kernel(
    Q, K, V, KPM, DO, Lse, Delta, DK, DV,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_kpmb, Hq, G, Nq, Nk, window, b_first, qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr,
    DROPOUT: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program ``(key block, kv head, batch - b_first)`` of ``[B, H, N, D]`` tensors."""
    dkdv_program(Q, K, V, KPM, DO, Lse, Delta, DK, DV, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh,
                 stride_kn, stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don, stride_dkb, stride_dkh,
                 stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_kpmb, Hq, G, Nq, Nk, window, None, None, None,
                 b_first, qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale, CAUSAL, WINDOW, SOFTCAP,
                 HAS_KPM, DROPOUT, False, HEAD_D, BLOCK_D, BLOCK_M, BLOCK_N, DTYPE, UPCAST, PREC, TMA, HEAD_DV,
                 BLOCK_DV)


@triton.jit(do_not_specialize=["Hq", "G", "window", "total_q", "seed"])
def attn_bwd_dkdv_varlen_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, CuQ, CuK,
    stride_qh, stride_qn, stride_kh, stride_kn, stride_vh, stride_vn, stride_doh, stride_don,
    stride_dkh, stride_dkn, stride_dvh, stride_dvn,
    Hq, G, window, total_q, qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program ``(key block, kv head, sequence)`` of packed tensors; with ``TMA``, ``Q`` and ``DO`` are
    descriptors over ``[total_q, Hq, D]`` (block ``[BLOCK_M, 1, BLOCK_D]``)."""
    b = tl.program_id(2)
    q_start, k_start, Nq, Nk = varlen_bounds(CuQ, CuK, b)
    if tl.program_id(0) * BLOCK_N >= Nk:
        return
    dkdv_program(Q, K, V, Q, DO, Lse, Delta, DK, DV, 0, stride_qh, stride_qn, 0, stride_kh, stride_kn, 0, stride_vh,
                 stride_vn, 0, stride_doh, stride_don, 0, stride_dkh, stride_dkn, 0, stride_dvh, stride_dvn, 0, Hq, G,
                 Nq, Nk, window, q_start, k_start, total_q, 0, qk_scale2, cap_scale, cap_log2e, scale, seed + b,
                 drop_p, keep_scale, CAUSAL, WINDOW, SOFTCAP, False, DROPOUT, True, HEAD_D, BLOCK_D, BLOCK_M, BLOCK_N,
                 DTYPE, UPCAST, PREC, TMA_PACKED if TMA else False, HEAD_DV, BLOCK_DV)


@triton.jit
def dq_block(dq, q, do, lse, delta, K, V, b, hkv, k_ptrs, v_ptrs, kpm_ptrs, start_n, offs_m, offs_n0, offs_d,
             offs_dv, stride_kn, stride_vn, Nk, pos_offset, window, qk_scale2, cap_scale, cap_log2e, scale, seed,
             drop_p,
             keep_scale, drop_row, MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
             SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, HEAD_D: tl.constexpr,
             BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
             DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    """One key block's contribution to dQ of a query block (V: the value head dim ``HEAD_DV``, ``offs_dv``)."""
    offs_n = start_n + offs_n0
    if TMA or MASK:
        k = load_tile(K, k_ptrs, b, hkv, start_n, stride_kn, offs_n0, offs_d, Nk, BLOCK_N, HEAD_D, BLOCK_D, TMA)
        v = load_tile(V, v_ptrs, b, hkv, start_n, stride_vn, offs_n0, offs_dv, Nk, BLOCK_N, HEAD_DV, BLOCK_DV, TMA)
        if TMA == TMA_PACKED and MASK:  # key rows past the sequence are the next one's: zeros, so that an
            k = tl.where((offs_n < Nk)[:, None], k, 0.0)  # inf or NaN there cannot reach dQ (through 0 * NaN)
            v = tl.where((offs_n < Nk)[:, None], v, 0.0)
    elif HEAD_D != BLOCK_D or HEAD_DV != BLOCK_DV:
        k = tl.load(k_ptrs + start_n * stride_kn, mask=offs_d[None, :] < HEAD_D, other=0.0)
        v = tl.load(v_ptrs + start_n * stride_vn, mask=offs_dv[None, :] < HEAD_DV, other=0.0)
    else:
        k = tl.load(k_ptrs + start_n * stride_kn)
        v = tl.load(v_ptrs + start_n * stride_vn)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    kp = offs_n0 < 0  # placeholder, only read when HAS_KPM
    if HAS_KPM:
        if MASK:
            kp = tl.load(kpm_ptrs + start_n, mask=offs_n < Nk, other=0) != 0
        else:
            kp = tl.load(kpm_ptrs + start_n) != 0
    # without softcap s holds x = q.k and P rounds once, as the forward's P-bar (see dkdv_block)
    s, t = scores_tile(q, k, offs_m, offs_n, kp, qk_scale2 if SOFTCAP else None, cap_scale, cap_log2e, Nk,
                       pos_offset, window, MASK, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, PREC)
    if SOFTCAP:
        p = tl.exp2(s - lse[:, None])
    else:
        p = tl.exp2(tl.fma(s, qk_scale2, -lse[:, None]))
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    if DROPOUT:
        keep = tl.rand(seed, drop_row[:, None] + offs_n[None, :].to(tl.int64)) >= drop_p
        dp = tl.where(keep, dp * keep_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if SOFTCAP == CAPPED:
        ds = ds * (1.0 - t * t)
    ds_cast = round_to(ds * scale, DTYPE, UPCAST)
    return tl.dot(ds_cast, k, dq, input_precision=PREC)


@triton.jit
def dq_program(
    Q, K, V, KPM, DO, Lse, Delta, DQ,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_dqb, stride_dqh, stride_dqn,
    stride_kpmb, Hq, G, Nq, Nk, window, q_start, k_start, total_q, b_first, qk_scale2, cap_scale, cap_log2e, scale,
    seed, drop_p, keep_scale, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dQ of one query block; with ``TMA``, ``K`` and ``V`` are descriptors (blocks ``[1, 1, BLOCK_N, BLOCK_D]`` and
    ``[1, 1, BLOCK_N, BLOCK_DV]``); dO and V have the value head dim ``HEAD_DV``.

    ``VARLEN``: a query block of sequence ``b`` of packed tensors, offsets as in ``triton_forward.fwd_program``
    (``TMA`` is then ``TMA_PACKED``). Key rows a descriptor reads past the sequence's end (the next
    sequence's) lie in the masked stretch (``offs_n < Nk``), where ``dq_block`` zeroes them after the load:
    exact zeros as in the dense case, whatever they hold (the unmasked loop is untouched: same SASS).
    """
    start_m = query_block(Nq, BLOCK_M, CAUSAL, VARLEN)  # causal: the longest blocks first (triton_order.py)
    h = tl.program_id(1)
    b = tl.program_id(2) + b_first  # dense: launches in chunks of the batch start at b_first (grid limit)
    b64 = b.to(tl.int64)
    tile_b = k_start.to(tl.int32) if VARLEN else b  # what the descriptor loads index by
    hkv = h // G
    pos_offset = Nk - Nq

    q_lo = start_m * BLOCK_M
    offs_m = q_lo + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Nq
    q_mask = row_ok[:, None]
    if HEAD_D != BLOCK_D:
        q_mask = q_mask & (offs_d[None, :] < HEAD_D)
    do_mask = q_mask
    if HEAD_DV != HEAD_D:
        do_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DV)
    q = tl.load(Q + (q_start * stride_qn if VARLEN else b64 * stride_qb) + h * stride_qh
                + offs_m[:, None] * stride_qn + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + (q_start * stride_don if VARLEN else b64 * stride_dob) + h * stride_doh
                 + offs_m[:, None] * stride_don + offs_dv[None, :], mask=do_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row_ptr = (h.to(tl.int64) * total_q + q_start + offs_m) if VARLEN else (b64 * Hq + h) * Nq + offs_m
    lse = tl.load(Lse + row_ptr, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + row_ptr, mask=row_ok, other=0.0)
    if TMA:
        k_ptrs = K
        v_ptrs = V
    else:
        k_ptrs = (K + (k_start * stride_kn if VARLEN else b64 * stride_kb) + hkv * stride_kh
                  + offs_n0[:, None] * stride_kn + offs_d[None, :])
        v_ptrs = (V + (k_start * stride_vn if VARLEN else b64 * stride_vb) + hkv * stride_vh
                  + offs_n0[:, None] * stride_vn + offs_dv[None, :])
    kpm_ptrs = KPM + b64 * stride_kpmb + offs_n0
    drop_row = (h.to(tl.int64) * Nq + offs_m) * Nk if VARLEN else row_ptr * Nk  # varlen: the sequence alone

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, mid_lo, mid_hi, hi = key_range(q_lo, Nq, Nk, pos_offset, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    if WINDOW:  # blocks cut by the window's left edge (lo == mid_lo == 0 without a window)
        for start_n in range(lo, mid_lo, BLOCK_N):
            dq = dq_block(dq, q, do, lse, delta, K, V, tile_b, hkv, k_ptrs, v_ptrs, kpm_ptrs, start_n, offs_m,
                          offs_n0, offs_d, offs_dv, stride_kn, stride_vn, Nk, pos_offset, window, qk_scale2, cap_scale,
                          cap_log2e, scale, seed, drop_p, keep_scale, drop_row, True, CAUSAL, WINDOW, SOFTCAP,
                          HAS_KPM, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, BLOCK_N, DTYPE, UPCAST, PREC, TMA)
    for start_n in range(mid_lo, mid_hi, BLOCK_N):
        dq = dq_block(dq, q, do, lse, delta, K, V, tile_b, hkv, k_ptrs, v_ptrs, kpm_ptrs, start_n, offs_m, offs_n0,
                      offs_d, offs_dv, stride_kn, stride_vn, Nk, pos_offset, window, qk_scale2, cap_scale, cap_log2e,
                      scale,
                      seed, drop_p, keep_scale, drop_row, False, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, DROPOUT, HEAD_D,
                      BLOCK_D, HEAD_DV, BLOCK_DV, BLOCK_N, DTYPE, UPCAST, PREC, TMA)
    for start_n in range(mid_hi, hi, BLOCK_N):
        dq = dq_block(dq, q, do, lse, delta, K, V, tile_b, hkv, k_ptrs, v_ptrs, kpm_ptrs, start_n, offs_m, offs_n0,
                      offs_d, offs_dv, stride_kn, stride_vn, Nk, pos_offset, window, qk_scale2, cap_scale, cap_log2e,
                      scale,
                      seed, drop_p, keep_scale, drop_row, True, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, DROPOUT, HEAD_D,
                      BLOCK_D, HEAD_DV, BLOCK_DV, BLOCK_N, DTYPE, UPCAST, PREC, TMA)
    tl.store(DQ + (q_start * stride_dqn if VARLEN else b64 * stride_dqb) + h * stride_dqh
             + offs_m[:, None] * stride_dqn + offs_d[None, :], round_to(dq, DTYPE, UPCAST).to(DTYPE), mask=q_mask)


@triton.jit(do_not_specialize=["Hq", "G", "Nq", "Nk", "window", "b_first", "seed"])
def attn_bwd_dq_kernel(
    Q, K, V, KPM, DO, Lse, Delta, DQ,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_dqb, stride_dqh, stride_dqn,
    stride_kpmb, Hq, G, Nq, Nk, window, b_first, qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr,
    DROPOUT: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program ``(query block, head, batch - b_first)`` of ``[B, H, N, D]`` tensors."""
    dq_program(Q, K, V, KPM, DO, Lse, Delta, DQ, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
               stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don, stride_dqb, stride_dqh, stride_dqn,
               stride_kpmb, Hq, G, Nq, Nk, window, None, None, None, b_first, qk_scale2, cap_scale, cap_log2e, scale,
               seed, drop_p, keep_scale, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, DROPOUT, False, HEAD_D, BLOCK_D, BLOCK_M,
               BLOCK_N, DTYPE, UPCAST, PREC, TMA, HEAD_DV, BLOCK_DV)


@triton.jit(do_not_specialize=["Hq", "G", "window", "total_q", "seed"])
def attn_bwd_dq_varlen_kernel(
    Q, K, V, DO, Lse, Delta, DQ, CuQ, CuK,
    stride_qh, stride_qn, stride_kh, stride_kn, stride_vh, stride_vn, stride_doh, stride_don, stride_dqh, stride_dqn,
    Hq, G, window, total_q, qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program ``(query block, head, sequence)`` of packed tensors; with ``TMA``, ``K`` and ``V`` are
    descriptors over ``[total_k, Hkv, D]`` (block ``[BLOCK_N, 1, BLOCK_D]``)."""
    b = tl.program_id(2)
    q_start, k_start, Nq, Nk = varlen_bounds(CuQ, CuK, b)
    if tl.program_id(0) * BLOCK_M >= Nq:
        return
    dq_program(Q, K, V, Q, DO, Lse, Delta, DQ, 0, stride_qh, stride_qn, 0, stride_kh, stride_kn, 0, stride_vh,
               stride_vn, 0, stride_doh, stride_don, 0, stride_dqh, stride_dqn, 0, Hq, G, Nq, Nk, window, q_start,
               k_start, total_q, 0, qk_scale2, cap_scale, cap_log2e, scale, seed + b, drop_p, keep_scale, CAUSAL,
               WINDOW, SOFTCAP, False, DROPOUT, True, HEAD_D, BLOCK_D, BLOCK_M, BLOCK_N, DTYPE, UPCAST, PREC,
               TMA_PACKED if TMA else False, HEAD_DV, BLOCK_DV)
