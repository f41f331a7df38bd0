"""A warp-specialized forward for Hopper and Blackwell (sm_90, sm_100): the fix unchanged, the key loop pipelined.

FlashAttention-3 reaches its speed on an H100 by splitting each program's warps into a producer (TMA loads of
the K and V tiles into shared memory) and consumers (the tensor-core products and the softmax), overlapping the
loads and the matrix work of successive key tiles. Triton 3.9 does this split itself for a loop written
``tl.range(..., warp_specialize=True)`` whose tiles come through tensor descriptors: it places the descriptor
loads in a producer partition, hands the tiles over through shared-memory buffers and mbarriers, and gives the
partitions their own register budgets (``setmaxnreg``).

:func:`attn_fwd_ws_kernel` is ``triton_forward.attn_fwd_kernel`` with that loop: the same arguments, the same
row state, the same block step (``triton_forward.fwd_block``: the rule's decisions, rounding points and masks are
that function's), the same epilogue; only the unmasked stretch of keys (where a long sequence spends nearly all
its iterations) runs in the warp-specialized loop, the masked ones (the causal diagonal, the end of the keys) as
in the current kernel. So it computes the same bits: under the interpreter, which runs ``warp_specialize`` loops
as plain loops, the outputs are compared bit for bit with the current kernel's (tests/kernels/test_forward_ws.py);
on a GPU, benchmarks/gpu_check.sh compares it with kernels/reference.py and times both variants.

It serves the plain variants (:func:`serves`: no window, softcap, key padding mask, dropout or statistics, one
block of the partition per key tile, K and V through descriptors: the sm_90 / sm_100 tiles of
``triton_launch.fwd_config`` with TMA-compatible strides), dense (no packed sequences). The launcher takes it on
sm_90 and sm_100 GPUs where it compiles to a warp-specialized kernel (:func:`use`, :func:`launch`: checked once per
set of constants; otherwise logged once and the current kernel serves), the current kernel elsewhere;
``STABLE_ATTN_FORWARD=classic`` turns it off, ``=ws`` forces it where it serves (tests under the interpreter).

Where Triton 3.9 stands (benchmarks/forward_ws_resources.py, docs/BENCHMARKS.md): on sm_90 the loop compiles
without a warp split (no ``setmaxnreg``; with the count-based top two, 255 registers and a longer loop than the
current kernel's), on sm_100 the compile fails in the warp-specialization passes. So :func:`launch` checks the
compiled kernel for the split and takes it only then: today the current kernel serves both.
"""

from __future__ import annotations

import logging
import os

import triton
import triton.language as tl
from triton.errors import TritonError

from .triton_forward import (
    FP32_MAX,
    MODE_EXACT,
    MODE_OFF,
    fwd_blocks,
    fwd_scores,
    fwd_update,
    round_to,
    row_top2_by_count,
    sink_start,
    tc_row_sum_total,
    tc_row_sum_zeros,
    tensor_core_row_sum,
)
from .triton_order import query_block
from .triton_tiles import key_range

logger = logging.getLogger("stable_attn")
GENERATIONS = (90, 100)  # the compute capabilities it is chosen for (Hopper, datacenter Blackwell)
_compiles: dict[tuple, bool] = {}


@triton.jit(do_not_specialize=["Hq", "G", "Nq", "Nk", "window", "b_first", "seed"])
def attn_fwd_ws_kernel(
    Q, K, V, KPM, Out, Lse, StSat, StFixed, StMax, StSink, StEnt, Sinks,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on, stride_kpmb,
    Hq, G, Nq, Nk, window, b_first,
    qk_scale2, cap_scale, cap_log2e, tie2, sat2, min_shift2, max_shift2, beta,
    seed, drop_p, keep_frac,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr,
    MODE: tl.constexpr, STATS: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    ROW_SUM_PARTS: tl.constexpr, HAS_SINKS: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program ``(query block, head, batch - b_first)`` of ``[B, H, N, D]`` tensors, ``K`` and ``V`` descriptors
    (blocks ``[1, 1, BLOCK_N, BLOCK_D]``): ``triton_forward.fwd_program``'s dense plain path, its unmasked key
    stretch in a warp-specialized loop. The unused arguments keep the current kernel's signature (one argument
    set for both)."""
    tl.static_assert(not (WINDOW or SOFTCAP or HAS_KPM or DROPOUT or STATS))
    tl.static_assert(TMA and TILE_N == BLOCK_N)
    start_m = query_block(Nq, BLOCK_M, CAUSAL, False)
    h = tl.program_id(1)
    b = tl.program_id(2) + b_first
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
    o_mask = q_mask  # the output's rows and V's head-dim columns
    if HEAD_DV != HEAD_D:
        o_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DV)
    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :], mask=q_mask,
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    kpm_ptrs = KPM + offs_n0  # never read: no padding mask
    drop_row = offs_m.to(tl.int64)  # never read: no dropout

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    r_i = tl.full([BLOCK_M], -FP32_MAX, tl.float32)
    if (MODE == MODE_EXACT) and tensor_core_row_sum(BLOCK_D, DROPOUT):
        l_i = tc_row_sum_zeros(BLOCK_M, ROW_SUM_PARTS)
    else:
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m2_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # never read: no statistics
    fixed = tl.zeros([BLOCK_M], tl.int32)
    ent_i = tl.zeros([BLOCK_M], tl.float32)
    ent_l = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        _, r_i, l_i, ent_l = sink_start(Sinks, h + tl.zeros([BLOCK_M], tl.int32), row_ok, r_i, l_i, ent_l,
                                        ROW_SUM_PARTS, (MODE == MODE_EXACT) and tensor_core_row_sum(BLOCK_D, DROPOUT))

    lo, mid_lo, mid_hi, hi_al = key_range(q_lo, Nq, Nk, pos_offset, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    # seen in full by every row (unmasked): the warp-specialized loop, fwd_blocks' body
    # (fwd_block's body, the block's top two from single-result reductions: row_top2_by_count selects the values
    # row_top2 computes; the partitioner of Triton 3.9's warp specialization takes no multi-result tl.reduce)
    for start_n in tl.range(mid_lo, mid_hi, BLOCK_N, warp_specialize=True):
        s, kv_mask = fwd_scores(q, b, hkv, K, kpm_ptrs, start_n, offs_m, offs_n0, offs_d, stride_kn, qk_scale2,
                                cap_scale, cap_log2e, Nk, pos_offset, window, False, CAUSAL, WINDOW, SOFTCAP, HAS_KPM,
                                HEAD_D, BLOCK_D, UPCAST, PREC, TMA)
        if MODE == MODE_OFF:
            top1 = None  # plain FA2: fwd_decide takes the max alone
            top2 = None
        else:
            top1, top2 = row_top2_by_count(s)
        acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_update(
            acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, s, top1, top2, kv_mask, b, hkv, V, start_n, offs_n0,
            offs_d, offs_dv, stride_vn, qk_scale2, Nk, tie2, min_shift2, max_shift2, beta, seed, drop_p, drop_row,
            False, SOFTCAP, MODE, STATS, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE, UPCAST, PREC, TMA)
    # cut by the causal diagonal or the end of the keys (masked), as the current kernel walks it
    acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_blocks(
        m_i, r_i, l_i, acc, m2_i, fixed, ent_i, ent_l, q, b, hkv, K, V, kpm_ptrs, mid_hi, hi_al, offs_m, offs_n0,
        offs_d, offs_dv, stride_kn, stride_vn, qk_scale2, cap_scale, cap_log2e, Nk, pos_offset, window, tie2,
        min_shift2, max_shift2, beta, seed, drop_p, drop_row, True, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, MODE, STATS,
        DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE, UPCAST, PREC, TMA)

    if (MODE == MODE_EXACT) and tensor_core_row_sum(BLOCK_D, DROPOUT):
        l_i = tc_row_sum_total(l_i)
    seen = m_i > float("-inf")
    written = seen | (l_i != l_i)  # as fwd_program: no key, zeros; a NaN query, NaN
    o = tl.where(written[:, None], acc / l_i[:, None], 0.0)
    tl.store(Out + b64 * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_dv[None, :],
             round_to(o, DTYPE, UPCAST).to(DTYPE), mask=o_mask)
    tl.store(Lse + (b64 * Hq + h) * Nq + offs_m, tl.where(written, r_i + tl.log2(l_i), float("inf")), mask=row_ok)


def serves(consts: dict, packed: bool) -> bool:
    """Whether :func:`attn_fwd_ws_kernel` computes this launch of the current kernel (the module docstring)."""
    return (not packed and consts["TMA"] and consts["TILE_N"] == consts["BLOCK_N"] and not consts["STATS"]
            and not (consts["WINDOW"] or consts["SOFTCAP"] or consts.get("HAS_KPM") or consts["DROPOUT"]))


def choice() -> str:
    """``STABLE_ATTN_FORWARD``: ``"auto"`` (default), ``"ws"``, ``"classic"`` or ``"gluon"`` (the Gluon forward of
    gluon_forward.py where it serves the call, the current kernel elsewhere: triton_attention.forward)."""
    value = os.environ.get("STABLE_ATTN_FORWARD", "auto")
    if value not in ("auto", "ws", "classic", "gluon"):
        raise ValueError(f"STABLE_ATTN_FORWARD={value!r}: use 'auto' (the warp-specialized forward on sm_90 / "
                         "sm_100 where it compiles), 'ws' (wherever it serves), 'classic' (never) or 'gluon' (the "
                         "Gluon forward where it serves, never run on a GPU yet)")
    return value


def use(cc: int, is_cuda: bool, consts: dict, packed: bool) -> bool:
    """Whether the launcher takes the warp-specialized forward for these constants (module docstring)."""
    how = choice()
    if how in ("classic", "gluon") or not serves(consts, packed):
        return False
    if how == "ws":
        return True
    return is_cuda and cc in GENERATIONS and _compiles.get((cc, *sorted(consts.items())), True)


def launch(grid: tuple, cc: int, consts: dict, **kwargs) -> bool:
    """Launch it; False where it is not worth launching: the caller launches the current kernel.

    The first launch of a set of constants compiles it (``warmup``) and keeps the answer: taken only where the
    compiler split the warps (``setmaxnreg`` in the PTX: producer and consumer partitions with their own register
    budgets). Where the compile fails, or succeeds without the split (the loop then runs unpipelined, as the
    current kernel's but with its own code), it logs why once and the current kernel serves. ``STABLE_ATTN_FORWARD
    =ws`` launches it without asking (tests under the interpreter; a compile error then raises)."""
    if choice() != "ws":
        key = (cc, *sorted(consts.items()))
        known = _compiles.get(key)
        if known is None:
            try:
                compiled = attn_fwd_ws_kernel.warmup(grid=grid, **kwargs)
                known = "setmaxnreg" in compiled.asm.get("ptx", "")
                why = "it compiles without a producer/consumer split (no setmaxnreg in the PTX)"
            except (TritonError, RuntimeError) as err:  # compile errors, ptxas; the lowering raises RuntimeErrors
                known = False
                why = f"it does not compile ({type(err).__name__}: {str(err).strip().splitlines()[-1:]})"
            _compiles[key] = known
            if not known:
                logger.warning("stable_attn: the warp-specialized forward is not used on sm_%d: %s; the current "
                               "kernel serves", cc, why)
        if not known:
            return False
    attn_fwd_ws_kernel[grid](**kwargs)
    return True
