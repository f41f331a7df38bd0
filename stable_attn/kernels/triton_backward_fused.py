"""A fused Triton backward (prototype, opt-in): dK, dV and dQ from one program per key tile.

Today's backward (``triton_backward.py``) runs a dK/dV kernel over the query tiles of each key tile
and a separate dQ kernel over the key tiles of each query tile, both recomputing ``S``, ``P`` and
``dP``: 4 + 3 = 7 matrix products per (query tile, key tile) pair. Here one program per (key tile,
kv head, batch) does, per query tile of each of the ``G`` query heads of its kv head (GQA without
repeating K/V), the 5 products ``S^T = K Q^T``, ``dP^T = V dO^T``, ``dV += P^T dO``, ``dK += dS^T Q``
and ``dQ_j = dS K``, with the arithmetic and rounding points of the two-kernel path
(``triton_backward.dkdv_step``: same ``P``, same ``dS * scale`` cast to the input dtype).

dQ of a query tile is a sum over the key tiles that see it, and those live in different programs:

- ordered (the default, deterministic): key tile ``j`` writes its fp32 partial ``dQ_j`` to a scratch
  buffer ``[n_key_tiles, rows, D]`` (rows indexed like ``lse2``); ``attn_bwd_dq_sum_kernel`` then adds,
  per query tile, the partials of exactly the key tiles that wrote one (``triton_backward.query_range``,
  the same function the fused program walks by), in ascending ``j``, and rounds once to the input
  dtype: the same bits on every run. Cost: ``n_key_tiles`` fp32 copies of dQ in memory (written once,
  read once); per (batch, head) of 4k tokens at D = 128 with 128-key tiles, 32 x 2 MiB = 64 MiB.
- ``atomic`` (explicit opt-in): ``tl.atomic_add`` of the partials into one zeroed fp32 ``[rows, D]``
  buffer, then one cast. O(dQ) memory, but the fp32 additions happen in whatever order the programs
  reach them: dQ may differ in its last bits from run to run.

Not the default: on sm_90 its lowest-R tiles spill and its spill-free tiles are issue-bound, at
D = 64 and 128 (docs/ARCHITECTURE.md, "The backward"; docs/BENCHMARKS.md, "The backward: two kernels
against a fused prototype"). It is selected by
``STABLE_ATTN_BACKWARD=fused`` or ``fused-atomic`` (:func:`backward_mode`), for dense inputs
(``triton_attention.backward``) and packed sequences (``backward_varlen``: ``attn_bwd_fused_varlen_kernel``
and ``attn_bwd_dq_sum_varlen_kernel``, the offsets of ``triton_backward.dkdv_program``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._checks import interpreting
from . import triton_launch as launch
from .triton_backward import attn_bwd_preprocess, attn_bwd_preprocess_varlen, dkdv_step, query_range
from .triton_launch import Packed
from .triton_tiles import TMA_PACKED, round_to, varlen_bounds

BACKWARD_ENV = "STABLE_ATTN_BACKWARD"  # which backward the Triton launcher runs (see backward_mode)
BACKWARD_MODES = ("two-kernel", "fused", "fused-atomic")  # the first is the default


def backward_mode() -> str:
    """The backward ``STABLE_ATTN_BACKWARD`` selects: one of :data:`BACKWARD_MODES` (unset: ``two-kernel``)."""
    mode = os.environ.get(BACKWARD_ENV, BACKWARD_MODES[0]).strip().lower() or BACKWARD_MODES[0]
    if mode not in BACKWARD_MODES:
        raise ValueError(f"{BACKWARD_ENV}={os.environ[BACKWARD_ENV]!r}: accepted are {', '.join(BACKWARD_MODES)} "
                         f"(unset means {BACKWARD_MODES[0]})")
    return mode


@triton.jit
def fused_step(dk, dv, k, v, kp, Q, DO, b, h, q_ptrs, do_ptrs, lse_ptr, delta_ptr, dq_base, start_m, offs_m0, offs_n,
               offs_d, stride_qn, stride_don, Nq, Nk, pos_offset, window, qk_scale2, cap_scale, cap_log2e, scale,
               seed, drop_p, keep_scale, drop_head, MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, HEAD_D: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr,
               PREC: tl.constexpr, TMA: tl.constexpr, ATOMIC: tl.constexpr):
    """One query block: dK, dV as ``dkdv_block`` does (4 products), plus this key block's dQ partial
    ``dS K`` (the fifth), stored to (or, ``ATOMIC``, added into) the fp32 rows at ``dq_base``."""
    dk, dv, ds_cast = dkdv_step(dk, dv, k, v, kp, Q, DO, b, h, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m, offs_m0,
                                offs_n, offs_d, offs_d, stride_qn, stride_don, Nq, Nk, pos_offset, window, qk_scale2,
                                cap_scale, cap_log2e, scale, seed, drop_p, keep_scale, drop_head, MASK, CAUSAL, WINDOW,
                                SOFTCAP, HAS_KPM, DROPOUT, HEAD_D, BLOCK_D, HEAD_D, BLOCK_D, BLOCK_M, DTYPE, UPCAST,
                                PREC,
                                TMA)
    dq = tl.dot(tl.trans(ds_cast), k, input_precision=PREC)
    rows = start_m + offs_m0
    mask = (rows < Nq)[:, None]
    if HEAD_D != BLOCK_D:
        mask = mask & (offs_d[None, :] < HEAD_D)
    ptrs = dq_base + rows[:, None] * HEAD_D + offs_d[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, dq, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, dq, mask=mask)
    return dk, dv


@triton.jit
def fused_program(
    Q, K, V, KPM, DO, Lse, Delta, DK, DV, DQP,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_kpmb, Hq, G, Nq, Nk, window, q_start, k_start, total_q, b_first, n_rows, qk_scale2, cap_scale, cap_log2e,
    scale, seed, drop_p, keep_scale, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    TMA: tl.constexpr, ATOMIC: tl.constexpr,
):
    """dK, dV of key block ``j = program_id(0)`` and its dQ partials; the offsets, stretches and ``VARLEN``
    layout of ``triton_backward.dkdv_program``, which this follows stretch for stretch.

    ``DQP``: fp32 rows of ``HEAD_D``, indexed like ``Lse`` (``n_rows`` of them: ``B * Hq * Nq`` dense,
    ``Hq * total_q`` packed); ordered, one such plane per key block (``[n_key_blocks, n_rows, HEAD_D]``),
    ``ATOMIC`` one plane, zeroed.
    """
    j = tl.program_id(0)
    start_n = j * BLOCK_N
    hkv = tl.program_id(1)
    b = tl.program_id(2) + b_first
    b64 = b.to(tl.int64)
    tile_b = q_start.to(tl.int32) if VARLEN else b  # what the descriptor loads index by
    pos_offset = Nk - Nq

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = offs_n[:, None] < Nk
    if HEAD_D != BLOCK_D:
        kv_mask = kv_mask & (offs_d[None, :] < HEAD_D)
    k = tl.load(K + (k_start * stride_kn if VARLEN else b64 * stride_kb) + hkv * stride_kh
                + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + (k_start * stride_vn if VARLEN else b64 * stride_vb) + hkv * stride_vh
                + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    kp = offs_n < 0  # placeholder, only read when HAS_KPM
    if HAS_KPM:
        kp = tl.load(KPM + b64 * stride_kpmb + offs_n, mask=offs_n < Nk, other=0) != 0
    q_lo, mid_lo, mid_hi, q_hi = query_range(start_n, Nq, Nk, pos_offset, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, G):
        h = hkv * G + g
        if TMA:
            q_ptrs = Q
            do_ptrs = DO
        else:
            q_ptrs = (Q + (q_start * stride_qn if VARLEN else b64 * stride_qb) + h * stride_qh
                      + offs_m0[:, None] * stride_qn + offs_d[None, :])
            do_ptrs = (DO + (q_start * stride_don if VARLEN else b64 * stride_dob) + h * stride_doh
                       + offs_m0[:, None] * stride_don + offs_d[None, :])
        row0 = h.to(tl.int64) * total_q + q_start if VARLEN else (b64 * Hq + h) * Nq
        lse_ptr = Lse + row0
        delta_ptr = Delta + row0
        drop_head = h.to(tl.int64) * Nq * Nk if VARLEN else row0 * Nk  # varlen: the sequence alone, as attention()
        if ATOMIC:
            dq_base = DQP + row0 * HEAD_D
        else:
            dq_base = DQP + (j.to(tl.int64) * n_rows + row0) * HEAD_D
        for start_m in range(q_lo, mid_lo, BLOCK_M):
            dk, dv = fused_step(dk, dv, k, v, kp, Q, DO, tile_b, h, q_ptrs, do_ptrs, lse_ptr, delta_ptr, dq_base,
                                start_m, offs_m0, offs_n, offs_d, stride_qn, stride_don, Nq, Nk, pos_offset, window,
                                qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale, drop_head, True,
                                CAUSAL, WINDOW, SOFTCAP, HAS_KPM, DROPOUT, HEAD_D, BLOCK_D, BLOCK_M, DTYPE, UPCAST,
                                PREC, TMA, ATOMIC)
        for start_m in range(mid_lo, mid_hi, BLOCK_M):
            dk, dv = fused_step(dk, dv, k, v, kp, Q, DO, tile_b, h, q_ptrs, do_ptrs, lse_ptr, delta_ptr, dq_base,
                                start_m, offs_m0, offs_n, offs_d, stride_qn, stride_don, Nq, Nk, pos_offset, window,
                                qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale, drop_head, False,
                                CAUSAL, WINDOW, SOFTCAP, HAS_KPM, DROPOUT, HEAD_D, BLOCK_D, BLOCK_M, DTYPE, UPCAST,
                                PREC, TMA, ATOMIC)
        if WINDOW:
            for start_m in range(mid_hi, q_hi, BLOCK_M):
                dk, dv = fused_step(dk, dv, k, v, kp, Q, DO, tile_b, h, q_ptrs, do_ptrs, lse_ptr, delta_ptr, dq_base,
                                    start_m, offs_m0, offs_n, offs_d, stride_qn, stride_don, Nq, Nk, pos_offset, window,
                                    qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale, drop_head, True,
                                    CAUSAL, WINDOW, SOFTCAP, HAS_KPM, DROPOUT, HEAD_D, BLOCK_D, BLOCK_M, DTYPE, UPCAST,
                                    PREC, TMA, ATOMIC)

    tl.store(DK + (k_start * stride_dkn if VARLEN else b64 * stride_dkb) + hkv * stride_dkh
             + offs_n[:, None] * stride_dkn + offs_d[None, :], round_to(dk, DTYPE, UPCAST).to(DTYPE), mask=kv_mask)
    tl.store(DV + (k_start * stride_dvn if VARLEN else b64 * stride_dvb) + hkv * stride_dvh
             + offs_n[:, None] * stride_dvn + offs_d[None, :], round_to(dv, DTYPE, UPCAST).to(DTYPE), mask=kv_mask)


@triton.jit(do_not_specialize=["Hq", "G", "Nq", "Nk", "window", "b_first", "n_rows", "seed"])
def attn_bwd_fused_kernel(
    Q, K, V, KPM, DO, Lse, Delta, DK, DV, DQP,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_kpmb, Hq, G, Nq, Nk, window, b_first, n_rows, qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p,
    keep_scale, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr,
    DROPOUT: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """Program ``(key block, kv head, batch - b_first)`` of ``[B, H, N, D]`` tensors; with ``TMA``, ``Q``
    and ``DO`` are descriptors as in ``attn_bwd_dkdv_kernel``."""
    fused_program(Q, K, V, KPM, DO, Lse, Delta, DK, DV, DQP, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh,
                  stride_kn, stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don, stride_dkb,
                  stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_kpmb, Hq, G, Nq, Nk, window, None,
                  None, None, b_first, n_rows, qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale,
                  CAUSAL, WINDOW, SOFTCAP, HAS_KPM, DROPOUT, False, HEAD_D, BLOCK_D, BLOCK_M, BLOCK_N, DTYPE, UPCAST,
                  PREC, TMA, ATOMIC)


@triton.jit(do_not_specialize=["Hq", "G", "window", "total_q", "n_rows", "seed"])
def attn_bwd_fused_varlen_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, DQP, CuQ, CuK,
    stride_qh, stride_qn, stride_kh, stride_kn, stride_vh, stride_vn, stride_doh, stride_don,
    stride_dkh, stride_dkn, stride_dvh, stride_dvn,
    Hq, G, window, total_q, n_rows, qk_scale2, cap_scale, cap_log2e, scale, seed, drop_p, keep_scale,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, ATOMIC: tl.constexpr,
):
    """Program ``(key block, kv head, sequence)`` of packed tensors, as ``attn_bwd_dkdv_varlen_kernel``."""
    b = tl.program_id(2)
    q_start, k_start, Nq, Nk = varlen_bounds(CuQ, CuK, b)
    if tl.program_id(0) * BLOCK_N >= Nk:
        return
    fused_program(Q, K, V, Q, DO, Lse, Delta, DK, DV, DQP, 0, stride_qh, stride_qn, 0, stride_kh, stride_kn, 0,
                  stride_vh, stride_vn, 0, stride_doh, stride_don, 0, stride_dkh, stride_dkn, 0, stride_dvh, stride_dvn,
                  0, Hq, G, Nq, Nk, window, q_start, k_start, total_q, 0, n_rows, qk_scale2, cap_scale, cap_log2e,
                  scale, seed + b, drop_p, keep_scale, CAUSAL, WINDOW, SOFTCAP, False, DROPOUT, True, HEAD_D, BLOCK_D,
                  BLOCK_M, BLOCK_N, DTYPE, UPCAST, PREC, TMA_PACKED if TMA else False, ATOMIC)


@triton.jit
def dq_sum_program(DQP, DQ, dq_row, stride_dqn, row0, n_rows, Nq, Nk, window, CAUSAL: tl.constexpr,
                   WINDOW: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """dQ of query block ``program_id(0)`` of one (batch or sequence, head): the partials of the key blocks
    whose :func:`query_range` holds it, added in ascending key-block order, rounded once. ``row0``: its
    first row in the scratch's ``n_rows``; ``dq_row``: the address of its dQ's first row."""
    start_m = tl.program_id(0) * BLOCK_M
    pos_offset = Nk - Nq
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < Nq)[:, None]
    if HEAD_D != BLOCK_D:
        mask = mask & (offs_d[None, :] < HEAD_D)
    offs = rows[:, None] * HEAD_D + offs_d[None, :]
    plane = (row0 * 0 + n_rows) * HEAD_D  # elements per key block of the scratch, int64
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(0, tl.cdiv(Nk, BLOCK_N)):
        q_lo, _, _, q_hi = query_range(j * BLOCK_N, Nq, Nk, pos_offset, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
        if (start_m >= q_lo) & (start_m < q_hi):
            acc += tl.load(DQP + j * plane + row0 * HEAD_D + offs, mask=mask, other=0.0)
    tl.store(dq_row + rows[:, None] * stride_dqn + offs_d[None, :], round_to(acc, DTYPE, UPCAST).to(DTYPE), mask=mask)


@triton.jit(do_not_specialize=["Hq", "Nq", "Nk", "window", "b_first", "n_rows"])
def attn_bwd_dq_sum_kernel(DQP, DQ, stride_dqb, stride_dqh, stride_dqn, Hq, Nq, Nk, window, b_first, n_rows,
                           CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """Program ``(query block, head, batch - b_first)``; ``BLOCK_M`` / ``BLOCK_N``: the fused kernel's
    query step and key tile."""
    h = tl.program_id(1)
    b64 = (tl.program_id(2) + b_first).to(tl.int64)
    dq_sum_program(DQP, DQ, DQ + b64 * stride_dqb + h * stride_dqh, stride_dqn, (b64 * Hq + h) * Nq, n_rows, Nq, Nk,
                   window, CAUSAL, WINDOW, HEAD_D, BLOCK_D, BLOCK_M, BLOCK_N, DTYPE, UPCAST)


@triton.jit(do_not_specialize=["Hq", "window", "total_q", "n_rows"])
def attn_bwd_dq_sum_varlen_kernel(DQP, DQ, CuQ, CuK, stride_dqh, stride_dqn, Hq, window, total_q, n_rows,
                                  CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HEAD_D: tl.constexpr,
                                  BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """Program ``(query block, head, sequence)`` of packed ``[total_q, Hq, D]`` dQ."""
    h = tl.program_id(1)
    q_start, _, Nq, Nk = varlen_bounds(CuQ, CuK, tl.program_id(2))
    if tl.program_id(0) * BLOCK_M >= Nq:
        return
    dq_sum_program(DQP, DQ, DQ + q_start * stride_dqn + h * stride_dqh, stride_dqn, h.to(tl.int64) * total_q + q_start,
                   n_rows, Nq, Nk, window, CAUSAL, WINDOW, HEAD_D, BLOCK_D, BLOCK_M, BLOCK_N, DTYPE, UPCAST)


def fused_constants(head_dim: int, dtype: torch.dtype, cc: int, *, atomic: bool = False,
                    **features) -> tuple[dict, dict]:
    """``(constexprs, compile options)`` of the fused kernel: the dK/dV kernel's tiling and constants
    (``triton_launch.launch_constants("bwd_dkdv", ...)``, the one place they are chosen) plus ``ATOMIC``.
    ``features``: the other keyword arguments of ``launch_constants`` (causal, window, ...)."""
    consts, opts = launch.launch_constants("bwd_dkdv", head_dim, dtype, cc, **features)
    for name in ("HEAD_DV", "BLOCK_DV"):  # V's head dim is the query's here (the launchers send Dv != D elsewhere)
        consts.pop(name)
    return dict(consts, ATOMIC=atomic), opts


def backward_fused(do, q, k, v, out, lse2, key_padding_mask, opts, *, atomic: bool = False, config=None,
                   packed: Packed | None = None):
    """The fused backward: ``(dq, dk, dv)`` like ``triton_attention.backward`` (dense ``[B, H, N, D]``), or
    with ``packed`` (``triton_launch.Packed``) like ``backward_varlen`` (``[total, H, D]``, ``lse2``
    ``[Hq, total_q]``).

    ``atomic``: dQ through ``tl.atomic_add`` (not deterministic, see the module docstring); default the
    ordered scratch-buffer sum. ``config``: a ``BwdConfig`` whose dK/dV fields tile the fused kernel.
    """
    launch.check_device(q)
    q, k, v, out, do = (launch.dense_last(x) for x in (q, k, v, out, do))
    lse2 = lse2.contiguous()
    if packed is None:
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        n_rows = B * Hq * Nq
    else:
        _, Hq, D = q.shape
        Hkv = k.shape[1]
        B, Nq, Nk = packed.batch, packed.max_q, packed.max_k
        n_rows = Hq * q.shape[0]
    launch.check_heads(Hq)
    dtype = q.dtype
    block_d = launch.head_block(D)
    consts, compile_opts = fused_constants(
        D, dtype, launch.capability(q.device), atomic=atomic, **launch.feature_flags(opts),
        kpm=(key_padding_mask is not None) if packed is None else None, tma=launch.tma_compatible(q, k, v, do),
        upcast=interpreting(), config=config)
    m, n = consts["BLOCK_M"], consts["BLOCK_N"]
    n_kt = triton.cdiv(Nk, n)

    delta = launch.empty(lse2.shape, torch.float32, q.device)
    dk, dv = launch.empty_like(k), launch.empty_like(v)
    # the partials, rows indexed like lse2; ordered: only the (key block, query block) pairs query_range
    # names are written, and only those read
    dqp = (torch.zeros((n_rows, D), dtype=torch.float32, device=q.device) if atomic
           else launch.empty((n_kt, n_rows, D), torch.float32, q.device))
    sc = launch.kernel_scalars(opts, dtype)
    describe = launch.descriptor if packed is None else launch.packed_descriptor
    q_in, do_in = (describe(q, m, block_d), describe(do, m, block_d)) if consts["TMA"] else (q, do)
    pre = dict(Out=out, DO=do, Delta=delta, **launch.strides("o", out), **launch.strides("do", do), Hq=Hq, HEAD_D=D,
               BLOCK_D=block_d, BLOCK_M=64)
    fused = dict(Q=q_in, K=k, V=v, DO=do_in, Lse=lse2, Delta=delta, DK=dk, DV=dv, DQP=dqp, **launch.strides("q", q),
                 **launch.strides("k", k), **launch.strides("v", v), **launch.strides("do", do),
                 **launch.strides("dk", dk), **launch.strides("dv", dv), Hq=Hq, G=Hq // Hkv, window=sc["window"],
                 n_rows=n_rows, qk_scale2=sc["qk_scale2"], cap_scale=sc["cap_scale"], cap_log2e=sc["cap_log2e"],
                 scale=opts.scale, seed=sc["seed"], drop_p=sc["drop_p"], keep_scale=sc["keep_scale"], **consts,
                 **compile_opts)
    dq = None if atomic else launch.empty_like(q)
    dq_sum = None if atomic else dict(
        DQP=dqp, DQ=dq, **launch.strides("dq", dq), Hq=Hq, window=sc["window"], n_rows=n_rows, CAUSAL=consts["CAUSAL"],
        WINDOW=consts["WINDOW"], HEAD_D=D, BLOCK_D=block_d, BLOCK_M=m, BLOCK_N=n, DTYPE=consts["DTYPE"],
        UPCAST=consts["UPCAST"], num_warps=4)
    if packed is not None:
        total_q = q.shape[0]
        bounds = dict(CuQ=packed.cu_q, CuK=packed.cu_k, total_q=total_q)
        if min(B, Hq, Nq) > 0:
            attn_bwd_preprocess_varlen[(triton.cdiv(Nq, 64), Hq, B)](CuQ=packed.cu_q, total_q=total_q, **pre)
        if min(B, Nk) > 0:
            attn_bwd_fused_varlen_kernel[(n_kt, Hkv, B)](**bounds, **fused)
        if atomic:
            return dqp.view(Hq, total_q, D).transpose(0, 1).to(dtype).contiguous(), dk, dv
        if min(B, Hq, Nq) > 0:
            attn_bwd_dq_sum_varlen_kernel[(triton.cdiv(Nq, m), Hq, B)](**bounds, **dq_sum)
        return dq, dk, dv
    kpm = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else lse2
    kpm_stride = kpm.stride(0) if key_padding_mask is not None else 0
    for b_first, nb in launch.batches(B):
        attn_bwd_preprocess[(triton.cdiv(Nq, 64), Hq, nb)](Nq=Nq, b_first=b_first, **pre)
        attn_bwd_fused_kernel[(n_kt, Hkv, nb)](KPM=kpm, stride_kpmb=kpm_stride, Nq=Nq, Nk=Nk, b_first=b_first, **fused)
    if atomic:
        return dqp.view(B, Hq, Nq, D).to(dtype), dk, dv
    for b_first, nb in launch.batches(B):
        attn_bwd_dq_sum_kernel[(triton.cdiv(Nq, m), Hq, nb)](Nq=Nq, Nk=Nk, b_first=b_first, **dq_sum)
    return dq, dk, dv
