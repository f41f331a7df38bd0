"""Triton decode kernel: short queries (``Nq <= 16``) against a long KV cache, split over the keys.

What ``generate()`` sends every step (one query, or a few, against the whole cache) gives the training
forward one program per (batch, query head) with a 128-row tile holding ``Nq`` real rows, each program walking
the whole cache and every query head re-reading its KV head. Here instead:

- **the G query heads of one KV head share a program**: its rows are the ``G * Nq`` pairs (head ``g``, query
  ``i``) packed into the M dimension (``BLOCK_M = 16 .. 64`` rows; more rows take more row blocks), so K and V
  of a KV head are read once per split for all its query heads;
- **the keys are split** into ``S`` contiguous splits of whole key blocks (``decode_plan.split_keys``: about
  ``TARGET_PROGRAMS / (B * Hkv)`` splits), one program per (split, KV head, batch element), enough programs to
  fill the GPU when ``B * Hkv`` alone would not;
- each program walks its split's blocks with the training kernel's own block step (``triton_forward.fwd_blocks``:
  the same rule, rounding points and masks, called with the query index of each packed row for causal and
  window), **from the initial state**: the rule restarts its offset at the split's first block. It writes the
  split's partial: the fp32 accumulator (not divided), row sum, offset ``r`` and true max ``m``;
- :func:`attn_decode_combine_kernel` merges the splits of each row by their offsets in fp32
  (``R = max r_s``, ``w_s = exp2(r_s - R)``, ``O = sum w_s acc_s / sum w_s l_s``), no rounding point but the
  output's cast.

Above 256 columns (Gemma 4's 512) Q and K come in column chunks and V's head dim is split over programs (the
grid's second axis over (KV head, V block)), as in the training forward (``triton_forward.chunked_products``,
``dv_blocks``); the first V block's program stores the row sums, offsets and maxima.

``reference_decode.py`` is the PyTorch mirror: the same splits, the same walk per split (``reference.walk_blocks``),
the same merge; the offsets and maxima of every split are the same bits (tests/kernels/test_decode.py).
Why restarting the offset keeps the rule's guarantee, and where the output differs from the training
kernel's: docs/ALGORITHM.md, "Decode: split keys". No statistics, no dropout, no ``attn_mask``
(``decode_plan.takes_decode`` sends those calls to the training kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._ops import TILE_HEAD_DIM
from ..options import Options
from . import decode_plan
from . import triton_launch as launch
from .triton_forward import (
    FP32_MAX,
    MODE_EXACT,
    dv_blocks,
    fwd_blocks,
    sink_start,
    tc_row_sum_total,
    tc_row_sum_zeros,
    tensor_core_row_sum,
)
from .triton_tiles import key_range, round_to

MAX_QUERIES = tl.constexpr(decode_plan.MAX_QUERIES)
# Shared memory the decode kernel takes beside its pipelined K/V tiles (12 KiB measured at D = 256, sm_90)
_DECODE_SHARED_EXTRA = 16 * 1024
MAX_ROWS = 64  # packed rows per program: more (G * Nq > 64) take several row blocks, each reading its split
# (Q and K chunk, V block) columns where a head dim is above TILE_HEAD_DIM: 128 / 128 compiled without spills on
# sm_80 and sm_90 (16 rows, 8 warps, 2 stages; benchmarks/kernel_resources.py --kernels decode --d 512)
WIDE_DECODE = (128, 128)


@triton.jit(do_not_specialize=["Hq", "G", "Nq", "Nk", "window", "split", "n_splits", "b_first"])
def attn_decode_kernel(
    Q, K, V, KPM, Acc, Lsum, Roff, Mmax, Sinks,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_kpmb,
    Hq, G, Nq, Nk, window, split, n_splits, b_first,
    qk_scale2, cap_scale, cap_log2e, tie2, min_shift2, max_shift2, beta,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr, MODE: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_SINKS: tl.constexpr,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program ``(split * row blocks + row block, KV head, batch - b_first)``: the partial of one split for
    ``BLOCK_M`` packed rows (query head ``hkv * G + g``, query ``i``) of ``[B, H, N, D]`` tensors. ``HAS_SINKS``:
    the first split starts from the learned sink's state (``reference_decode.partials``), the others do not.
    ``HEAD_DV``: V's head dim (the partials' and the output's), ``BLOCK_DV`` its tile
    (``triton_forward.fwd_program``)."""
    n_rb = tl.cdiv(G * Nq, BLOCK_M)
    split_id = tl.program_id(0) // n_rb
    rb = tl.program_id(0) % n_rb
    DV_BLOCKS: tl.constexpr = dv_blocks(HEAD_DV, BLOCK_DV)
    if DV_BLOCKS > 1:  # V's head dim split over programs, as in the training forward (triton_forward.fwd_program)
        hkv = tl.program_id(1) // DV_BLOCKS
        dv_lo = tl.program_id(1) % DV_BLOCKS * BLOCK_DV
    else:
        hkv = tl.program_id(1)
        dv_lo = 0
    b = tl.program_id(2) + b_first
    b64 = b.to(tl.int64)
    pos_offset = Nk - Nq  # causal and window are aligned bottom-right

    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * Nq
    g = rows // Nq
    offs_i = rows % Nq  # the query index of each row: causal and window read it
    h = hkv * G + g
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if DV_BLOCKS > 1:
        offs_dv = dv_lo + tl.arange(0, BLOCK_DV)
    else:
        offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)
    q_mask = row_ok[:, None]
    if HEAD_D % BLOCK_D != 0:
        q_mask = q_mask & (offs_d[None, :] < HEAD_D)
    acc_mask = q_mask  # the partial's rows and V's head-dim columns
    if HEAD_DV != HEAD_D or HEAD_D > BLOCK_D or DV_BLOCKS > 1:
        acc_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DV)
    row_w = row_ok if DV_BLOCKS == 1 else row_ok & ((tl.zeros([BLOCK_M], tl.int32) + dv_lo) == 0)
    if HEAD_D > BLOCK_D:  # q's rows as pointers, loaded chunk by chunk per key block (triton_forward.fwd_scores)
        rows_c = tl.minimum(rows, G * Nq - 1)  # rows past the last read the last (never stored)
        q = (Q + b64 * stride_qb + (hkv * G + rows_c // Nq)[:, None] * stride_qh + (rows_c % Nq)[:, None] * stride_qn
             + offs_d[None, :])
    else:
        q = tl.load(Q + b64 * stride_qb + h[:, None] * stride_qh + offs_i[:, None] * stride_qn + offs_d[None, :],
                    mask=q_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
    k_ptrs = K + b64 * stride_kb + hkv * stride_kh + offs_n0[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + b64 * stride_vb + hkv * stride_vh + offs_n0[:, None] * stride_vn + offs_dv[None, :]
    kpm_ptrs = KPM + b64 * stride_kpmb + offs_n0
    drop_row = offs_i.to(tl.int64)  # unused: no dropout here

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    r_i = tl.full([BLOCK_M], -FP32_MAX, tl.float32)  # the initial offset: every split starts here
    ROW_D: tl.constexpr = BLOCK_D if BLOCK_D >= BLOCK_DV else BLOCK_DV  # the widest tile (fwd_program)
    if (MODE == MODE_EXACT) and tensor_core_row_sum(ROW_D, False):
        # one accumulator (triton_launch.row_sum_parts: measured on the training forward's tiles only)
        l_i = tc_row_sum_zeros(BLOCK_M, 1)
    else:
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m2_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # unused: no statistics
    fixed = tl.zeros([BLOCK_M], tl.int32)
    ent_i = tl.zeros([BLOCK_M], tl.float32)
    ent_l = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        first = (split_id + tl.zeros([BLOCK_M], tl.int32)) == 0  # only the first split counts the sink
        _, r_i, l_i, ent_l = sink_start(Sinks, h, row_ok & first, r_i, l_i, ent_l, 1,
                                        (MODE == MODE_EXACT) and tensor_core_row_sum(ROW_D, False))

    # the visible blocks of all Nq queries (MAX_QUERIES rows: at worst one more block in the masked
    # stretches, the same bits), cut to this split's keys [s0, s1)
    lo, mid_lo, mid_hi, hi_al = key_range(0, Nq, Nk, pos_offset, window, CAUSAL, WINDOW, MAX_QUERIES, BLOCK_N)
    s0 = split_id * split
    s1 = s0 + split
    if WINDOW:  # cut by the window's left edge (masked)
        acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_blocks(
            m_i, r_i, l_i, acc, m2_i, fixed, ent_i, ent_l, q, b, hkv, k_ptrs, v_ptrs, kpm_ptrs,
            tl.maximum(lo, s0), tl.minimum(mid_lo, s1), offs_i, offs_n0, offs_d, offs_dv, stride_kn, stride_vn,
            qk_scale2, cap_scale, cap_log2e, Nk, pos_offset, window, tie2, min_shift2, max_shift2, beta, 0, 0.0,
            drop_row, True, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, MODE, 0, False, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE,
            UPCAST, PREC, False)
    acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_blocks(  # seen in full by every row (unmasked)
        m_i, r_i, l_i, acc, m2_i, fixed, ent_i, ent_l, q, b, hkv, k_ptrs, v_ptrs, kpm_ptrs,
        tl.maximum(mid_lo, s0), tl.minimum(mid_hi, s1), offs_i, offs_n0, offs_d, offs_dv, stride_kn, stride_vn,
        qk_scale2, cap_scale, cap_log2e, Nk, pos_offset, window, tie2, min_shift2, max_shift2, beta, 0, 0.0, drop_row,
        False, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, MODE, 0, False, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE, UPCAST,
        PREC, False)
    acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_blocks(  # cut by the diagonal or the end of the keys
        m_i, r_i, l_i, acc, m2_i, fixed, ent_i, ent_l, q, b, hkv, k_ptrs, v_ptrs, kpm_ptrs,
        tl.maximum(mid_hi, s0), tl.minimum(hi_al, s1), offs_i, offs_n0, offs_d, offs_dv, stride_kn, stride_vn,
        qk_scale2, cap_scale, cap_log2e, Nk, pos_offset, window, tie2, min_shift2, max_shift2, beta, 0, 0.0, drop_row,
        True, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, MODE, 0, False, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE, UPCAST, PREC,
        False)
    if (MODE == MODE_EXACT) and tensor_core_row_sum(ROW_D, False):
        l_i = tc_row_sum_total(l_i)

    part = ((b64 * Hq + h) * Nq + offs_i) * n_splits + split_id  # partial (b, h, i, split)
    tl.store(Acc + part[:, None] * HEAD_DV + offs_dv[None, :], acc, mask=acc_mask)
    tl.store(Lsum + part, l_i, mask=row_w)  # the same bits in every program of V's blocks: the first writes them
    tl.store(Roff + part, r_i, mask=row_w)
    tl.store(Mmax + part, m_i, mask=row_w)


@triton.jit(do_not_specialize=["Hq", "Nq", "n_splits"])
def attn_decode_combine_kernel(
    Acc, Lsum, Roff, Mmax, Out, Lse, stride_ob, stride_oh, stride_on, Hq, Nq, n_splits,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program ``row = (b * Hq + h) * Nq + i``: the merge of the row's splits (reference_decode.combine)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // (Hq * Nq)
    h = (row // Nq) % Hq
    i = row % Nq
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    part = row * n_splits + offs_s
    r = tl.load(Roff + part, mask=s_ok, other=-FP32_MAX)
    l_s = tl.load(Lsum + part, mask=s_ok, other=0.0)
    m = tl.load(Mmax + part, mask=s_ok, other=float("-inf"))
    a_mask = s_ok[:, None] & (offs_d[None, :] < HEAD_D)
    acc = tl.load(Acc + part[:, None] * HEAD_D + offs_d[None, :], mask=a_mask, other=0.0)
    r_max = tl.max(r, 0)  # r_s >= -FP32_MAX: r_s - r_max is never inf - inf
    w = tl.exp2(r - r_max)
    l_sum = tl.sum(w * l_s, 0)
    o = tl.sum(w[:, None] * acc, 0) / l_sum
    # a row that sees no key outputs zeros and lse +inf; a NaN query (NaN scores, which the max passes over)
    # has l NaN: NaN out, as SDPA
    seen = (tl.max(m, 0) != float("-inf")) | (l_sum != l_sum)
    o = tl.where(seen, o, 0.0)
    tl.store(Out + b * stride_ob + h * stride_oh + i * stride_on + offs_d, round_to(o, DTYPE, UPCAST).to(DTYPE),
             mask=offs_d < HEAD_D)
    tl.store(Lse + row, tl.where(seen, r_max + tl.log2(l_sum), float("inf")))


def block_rows(groups: int, nq: int) -> int:
    """Packed rows per program: ``G * Nq`` rounded up to a power of two, between 16 (tl.dot's minimum) and 64."""
    return min(MAX_ROWS, max(16, triton.next_power_of_2(groups * nq)))


def decode_constants(head_dim: int, dtype: torch.dtype, cc: int, *, groups: int, nq: int, causal: bool,
                     window: bool, softcap: int, kpm: bool, mode: int, block_n: int, upcast: bool = False,
                     sinks: bool = False, value_dim: int | None = None) -> tuple[dict, dict]:
    """``(constexprs, compile options)`` of :func:`attn_decode_kernel`: what :func:`forward` launches and what
    ``triton_aot`` compiles (benchmarks/kernel_resources.py ``--kernels decode``). ``block_n``: the rule's key
    block (``Options.key_block``), never retiled here: the decode kernel walks the partition block by block.
    ``value_dim``: V's head dim where it differs from ``head_dim`` (``HEAD_DV``; warps and stages by the wider)."""
    head_dv = head_dim if value_dim is None else value_dim
    consts = dict(CAUSAL=causal, WINDOW=window, SOFTCAP=softcap, HAS_KPM=kpm, MODE=mode, HEAD_D=head_dim,
                  BLOCK_D=launch.head_block(head_dim), BLOCK_M=block_rows(groups, nq), BLOCK_N=block_n,
                  DTYPE=launch.TL_DTYPE[dtype], UPCAST=upcast, PREC=launch.precision(dtype, upcast), HAS_SINKS=sinks,
                  HEAD_DV=head_dv, BLOCK_DV=launch.head_block(head_dv))
    if max(consts["BLOCK_D"], consts["BLOCK_DV"]) > TILE_HEAD_DIM:
        # head dim 512: Q and K in chunks, V split over programs, as the training forward (launch.wide_tiles)
        chunk, split = WIDE_DECODE  # at most _ops.WIDE_TILE_COLS (kv_tile_bytes)
        consts["BLOCK_D"] = min(consts["BLOCK_D"], chunk)
        consts["BLOCK_DV"] = min(consts["BLOCK_DV"], split)
    wide_d = max(consts["BLOCK_D"], consts["BLOCK_DV"])
    # 8 warps where a K tile is 128 x 128 or more: with 4, the 128-key blocks at D = 128 took 255 registers and
    # spilled (stabilize off, sm_90: benchmarks/decode_resources.py)
    warps = 8 if block_n * wide_d >= 128 * 128 else 4
    # the pipeline holds num_stages - 1 K/V tile pairs in shared memory: fewer stages where they would not fit
    # (D = 256: 3 stages took 268 KiB on sm_90, 2 stages 140 KiB on sm_120; benchmarks/kernel_resources.py)
    kv_bytes = block_n * (consts["BLOCK_D"] + consts["BLOCK_DV"]) * torch.finfo(dtype).bits // 8
    limit = launch.SHARED_LIMIT.get(cc, launch.SHARED_LIMIT[120])
    stages = 3 if launch.tile_generation(cc) == 90 else 2
    while stages > 1 and (stages - 1) * kv_bytes + _DECODE_SHARED_EXTRA > limit:
        stages -= 1
    if consts["HEAD_D"] > consts["BLOCK_D"] or consts["HEAD_DV"] > consts["BLOCK_DV"]:
        stages = min(stages, 2)  # D = 512 on sm_90: 3 stages spilled 40-48 bytes, 2 none
    return consts, dict(num_warps=warps, num_stages=stages, **launch.FWD_COMPILE_OPTIONS)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None, opts: Options,
            split: int | None = None, return_partials: bool = False, sinks: torch.Tensor | None = None):
    """The decode forward on the GPU (or the interpreter): ``(out, lse2, None)`` as
    ``triton_attention.forward`` returns them; ``return_partials``: also the splits' ``(acc, l, r, m)``, shaped
    as ``reference_decode.partials`` returns them. ``split`` defaults to ``decode_plan.split_keys``. The launch is
    prepared from the shapes (``decode_launch.py``) and kept for the calls that repeat them, unless the caller
    gives a ``split``, asks for the partials or ``call_cache.ENABLED`` is off (then prepared for this call alone)."""
    from .. import call_cache
    from .decode_launch import DecodeLaunch, prepared

    launch.check_device(q)
    q, k, v = launch.dense_last(q), launch.dense_last(k), launch.dense_last(v)
    if split is None and not return_partials and call_cache.ENABLED:
        out, lse2 = prepared(q, k, v, key_padding_mask, opts, sinks).run(q, k, v, key_padding_mask, sinks)
        return out, lse2, None
    single = DecodeLaunch(q, k, v, key_padding_mask, opts, sinks is not None, split)
    acc_shape, row_shape = single.partial_shapes
    parts = (launch.empty(acc_shape, torch.float32, q.device),
             *(launch.empty(row_shape, torch.float32, q.device) for _ in range(3)))
    out, lse2 = single.run(q, k, v, key_padding_mask, sinks, partials=parts)
    if return_partials:
        return out, lse2, None, parts
    return out, lse2, None
