"""A forward in Gluon for Hopper and Blackwell: a TMA loader warp, MMA consumer warps, the dynamic-max fix. Opt-in.

Triton 3.9's automatic warp specialization (``tl.range(warp_specialize=True)``, ``triton_forward_ws.py``) makes no
producer/consumer split on sm_90 and fails on sm_100; Gluon (``triton.experimental.gluon``) states the split by hand.
One program owns ``BLOCK_M = 128`` query rows of one (batch, query head), as ``triton_forward.py`` does, in two
partitions (``gl.warp_specialize``):

- the loader (one warp, 24 registers: ``setmaxnreg``): Q once, then K and V of each key block through TMA into a
  ring of ``STAGES`` shared-memory slots, each with its own ``ready`` mbarriers (K, V) and a ``free`` mbarrier;
- the consumer (the kernel's warps, with the registers the loader gave up): per key block ``S = Q K^T``, the
  stabilization rule, ``P-bar``, the row sum, ``P-bar V``, then the slot is handed back; after the loop the epilogue.
  sm_90 (:data:`attn_fwd_gluon_kernel`, two warpgroups): async wgmma, accumulators in registers, ``P-bar`` from
  registers. sm_100 (:data:`attn_fwd_gluon_sm100_kernel`, one warpgroup): tcgen05 MMAs, ``S`` and the accumulators
  in tensor memory, ``P-bar`` through shared memory.

The math is the current kernel's for the cases it serves (bf16, head dim 64 or 128, the 128-key partition, causal
or not, modes ``exact`` and ``off``, row statistics with or without the entropy): the same block maxima, tie test
(``row_top2``'s two-result reduction), offset ``r`` (``block_offset``), ``P-bar = exp2(fma(x, qk_scale2, -r))``
rounded once to bf16, the exact mode's row sum on the tensor cores in two accumulators (``tc_row_sum_add`` as
``triton_launch.row_sum_parts`` sets it on sm_90), statistics and epilogue, in the same key order. The score and
``P-bar V`` products are MMAs over the same tiles; whether they round as the current kernel's do (and so whether the
outputs are bit-identical) is for a GPU to say. The sink statistic's fp32 sum of ``q . k_0`` runs in another order
(within summation-order differences, as in the current kernel).

Gluon kernels do not run under ``TRITON_INTERPRET=1`` in Triton 3.9 (``gluon.jit`` asks for a GPU driver): this kernel
is checked on the CPU only by compiling it (``compile_kernel``, benchmarks/gluon_resources.py,
tests/kernels/test_gluon_forward.py) and on a GPU by benchmarks/gluon_check.py (in benchmarks/gpu_check.sh). No GPU
has run it: nothing selects it; :func:`forward` is its explicit entry (docs/lab/gluon-forward.md).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout,
    allocate_tensor_memory,
    tcgen05_commit,
    tcgen05_mma,
)
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .. import rules
from .. import stats as _stats
from ..options import Options
from ..stats import RowStats
from . import triton_launch as launch
from .triton_tiles import key_range

MODE_OFF = gl.constexpr(rules.MODE_OFF)
MODE_EXACT = gl.constexpr(rules.MODE_EXACT)
FP32_MAX = gl.constexpr(rules.FP32_MAX)
LOG2E = gl.constexpr(rules.LOG2E)
STATS_ENTROPY = gl.constexpr(_stats.STATS_ENTROPY)
L_COLS = gl.constexpr(8)  # columns of the tensor-core row sum: wgmma's smallest N

BLOCK_M = 128  # query rows per program: sm_90 8 consumer warps of 16 rows (wgmma), sm_100 128 tensor-memory lanes
BLOCK_N = 128  # the key partition it serves (Options.key_block's default)
LOADER_REGS = gl.constexpr(24)  # the fewest setmaxnreg allows: the loader holds only scalars
# per generation (sm_90, sm_100): the consumer's warps (the loader adds one warp, rounded up to a warpgroup) and the
# registers per thread at launch: sm_90 12 warps x 32 x 168 <= 64K, then setmaxnreg moves the loader's to the
# consumer (240); sm_100 8 warps, the default 255
NUM_WARPS = {90: 8, 100: 4}
MAX_REGS = {90: 168, 100: None}
GENERATIONS = tuple(NUM_WARPS)
HEAD_DIMS = (64, 128)
MODES = (rules.MODE_EXACT, rules.MODE_OFF)


def stages(head_dim: int) -> int:
    """K/V ring slots: as many as fit beside Q in the 227 KiB of shared memory a block may use (bf16)."""
    return 2 if head_dim == 128 else 3


@gluon.jit
def _top2_combine(a1, a2, b1, b2):
    return gl.maximum(a1, b1), gl.maximum(gl.minimum(a1, b1), gl.maximum(a2, b2))


@gluon.jit
def row_top2(x, rows: gl.constexpr):
    """Largest and second-largest value of each row (two equal values for a tie), in the layout ``rows``:
    ``triton_forward.row_top2``, the same pairing (neighbouring columns, held by one thread in wgmma's accumulator
    layout) and combine."""
    a, b = gl.split(gl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    top, second = gl.reduce((gl.maximum(a, b), gl.minimum(a, b)), 1, _top2_combine)
    return gl.convert_layout(top, rows), gl.convert_layout(second, rows)


@gluon.jit
def shifted_offset(m2, beta, min_shift2, max_shift2):
    """``triton_forward.shifted_offset``: ``m + clamp(max((beta - 1) m, -m), MIN_SHIFT, MAX_SHIFT)``."""
    paper_shift = gl.maximum((beta - 1.0) * m2, -m2)
    return m2 + gl.minimum(gl.maximum(paper_shift, min_shift2), max_shift2)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_free, q_row, kv_row, lo, hi):
    """The producer partition: Q, then K and V of the key blocks ``[lo, hi)`` in order, slot ``i % STAGES``."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    BN: gl.constexpr = k_desc.block_type.shape[1]
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_load(q_desc, [q_row, 0, 0], q_bar, q_smem)
    for start_n in range(lo, hi, BN):
        i = (start_n - lo) // BN
        slot = i % STAGES
        # a fresh mbarrier counts as having completed the phase before phase 0: the first round waits for nothing
        mbarrier.wait(kv_free.index(slot), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_load(k_desc, [kv_row, start_n, 0], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_load(v_desc, [kv_row, start_n, 0], v_ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _key_blocks(Nq, Nk, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr):
    """This program's rows and key blocks: ``(q_lo, pos_offset, lo, mid_hi, hi)``. ``[lo, hi)`` holds every visible
    key, ``[lo, mid_hi)`` the blocks every row sees in full: ``triton_tiles.key_range`` without a window, called
    rather than copied so both forwards walk the same blocks (a ``triton.jit`` function called from Gluon compiles
    with Gluon's semantics; this one takes and returns scalars only)."""
    if CAUSAL:  # the longest query blocks first (triton_order.query_block)
        start_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        start_m = gl.program_id(0)
    q_lo = start_m * BM
    pos_offset = Nk - Nq  # causal is aligned bottom-right
    lo, mid_lo, mid_hi, hi = key_range(q_lo, Nq, Nk, pos_offset, 0, CAUSAL, False, BM, BN)
    return q_lo, pos_offset, lo, mid_hi, hi


@gluon.jit
def _mask(x, start_n, offs_m, Nk, pos_offset, CAUSAL: gl.constexpr):
    """``-inf`` where a key lies past ``Nk`` or (causal) right of the row's diagonal (``triton_tiles.scores_tile``)."""
    offs_n = start_n + gl.arange(0, x.shape[1], gl.SliceLayout(0, x.type.layout))
    vis = offs_n[None, :] < Nk
    if CAUSAL:
        vis = vis & (offs_n[None, :] <= offs_m[:, None] + pos_offset)
    return gl.where(vis, x, float("-inf"))


@gluon.jit
def _decide(x, m_i, r_i, m2_i, fixed, qk_scale2, tie2, min_shift2, max_shift2, beta, MODE: gl.constexpr,
            STATS: gl.constexpr):
    """``triton_forward.fwd_decide`` / ``block_offset`` on the unscaled products ``x`` (the maxima are taken on
    ``x`` and scaled after, as there): ``(m_new, r_new, m2_i, fixed)``."""
    if MODE == MODE_OFF and not STATS:
        m_blk = gl.max(x, 1)
        m2_blk = m_blk
    else:
        m_blk, m2_blk = row_top2(x, gl.SliceLayout(1, x.type.layout))
    m_blk = m_blk * qk_scale2
    m2_blk = m2_blk * qk_scale2
    m_new = gl.maximum(m_i, m_blk)
    if MODE == MODE_EXACT:
        r_cand = gl.maximum(r_i, m_blk)
        # P-bar would round to exactly 1.0 at two or more keys of this block: shift the offset
        fire = m2_blk >= r_cand - tie2
        r_new = gl.where(fire, shifted_offset(m_new, beta, min_shift2, max_shift2), r_cand)
    else:
        fire = m_blk < float("-inf")  # all False; only read by the statistics
        r_new = gl.maximum(r_i, m_blk)
    if STATS:
        m2_i = gl.maximum(gl.minimum(m_i, m_blk), gl.maximum(m2_i, m2_blk))
        fixed += fire.to(gl.int32)
    return m_new, r_new, m2_i, fixed


@gluon.jit
def _weights(x, r_i, r_new, ent_i, ent_l, qk_scale2, MASK: gl.constexpr, STATS: gl.constexpr):
    """``triton_forward.fwd_weights`` up to the row sum: ``(p, alpha, ent_i, ent_l)``, ``p`` the fp32 ``P-bar``."""
    alpha = gl.exp2(r_i - r_new)
    t = gl.fma(x, gl.full(x.shape, qk_scale2, gl.float32, x.type.layout), -r_new[:, None])
    p = gl.exp2(t)
    if STATS == STATS_ENTROPY:
        if MASK:  # masked keys: t = -inf and P-bar = 0 add 0 (not 0 * inf)
            t = gl.maximum(t, -FP32_MAX)
        ent_i = alpha * (ent_i + (r_i - r_new) * ent_l) + gl.sum(p * t, 1)
        ent_l = ent_l * alpha + gl.sum(p, 1)
    return p, alpha, ent_i, ent_l


@gluon.jit
def _even_cols(layout: gl.constexpr):
    """The even columns of a row-sum accumulator (``triton_forward._even_cols``)."""
    return (gl.arange(0, L_COLS, gl.SliceLayout(0, layout)) % 2 == 0)[None, :]


@gluon.jit
def _epilogue(acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q2, K, Out, Lse, StSat, StFixed, StMax, StSink, StEnt,
              row0, kv_row, offs_m, q_lo, Nq, Nk, pos_offset, qk_scale2, sat2, CAUSAL: gl.constexpr,
              STATS: gl.constexpr, NW: gl.constexpr):
    """``triton_forward.fwd_program``'s epilogue for the cases this kernel serves: out, lse and the statistics.
    ``acc`` in its MMA layout, the row vectors in the score tile's row layout."""
    BM: gl.constexpr = acc.shape[0]
    D: gl.constexpr = acc.shape[1]
    rows: gl.constexpr = m_i.type.layout
    row_ok = offs_m < Nq
    seen = m_i > float("-inf")
    # a row that sees no key outputs zeros; a NaN row sum (NaN query) keeps out and lse NaN
    written = seen | (l_i != l_i)
    o_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    o = gl.where(gl.convert_layout(written, o_rows)[:, None], acc / gl.convert_layout(l_i, o_rows)[:, None], 0.0)
    offs_mo = q_lo + gl.arange(0, BM, o_rows)
    offs_d = gl.arange(0, D, gl.SliceLayout(0, acc.type.layout))
    o_ptrs = Out + ((row0 + offs_mo).to(gl.int64) * D)[:, None] + offs_d[None, :]
    gl.store(o_ptrs, o.to(gl.bfloat16), mask=(offs_mo < Nq)[:, None])
    lse = gl.where(written, r_i + gl.log2(l_i), float("inf"))
    row_ptr = row0 + offs_m
    gl.store(Lse + row_ptr, lse, mask=row_ok)
    if STATS:
        gl.store(StSat + row_ptr, ((m2_i >= m_i - sat2) & seen).to(gl.int8), mask=row_ok)
        gl.store(StFixed + row_ptr, fixed, mask=row_ok)
        gl.store(StMax + row_ptr, m_i / LOG2E, mask=row_ok)
        if STATS == STATS_ENTROPY:
            ent_ok = seen & (ent_l > 0)
            gl.store(StEnt + row_ptr, gl.where(ent_ok, (gl.log2(ent_l) - ent_i / ent_l) / LOG2E, 0.0), mask=row_ok)
        # the sink's score: the row's product with key 0, recomputed (fp32, within summation-order differences)
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        qf = q2.load(blocked).to(gl.float32)
        offs_k = gl.arange(0, D, gl.SliceLayout(0, blocked))
        k0 = gl.load(K + kv_row.to(gl.int64) * Nk * D + offs_k).to(gl.float32)
        s_first = gl.convert_layout(gl.sum(qf * k0[None, :], 1), rows) * qk_scale2
        if CAUSAL:
            s_first = gl.where(offs_m + pos_offset >= 0, s_first, float("-inf"))
        gl.store(StSink + row_ptr, gl.exp2(s_first - lse), mask=row_ok)


@gluon.jit
def _ring(q_desc, k_desc, v_desc, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Shared memory and mbarriers of both kernels: Q, the K/V ring, its mbarriers (initialized), and the ones
    the tensor-core row sum multiplies ``P-bar`` by (``[BLOCK_N / 2, L_COLS]``)."""
    BN: gl.constexpr = k_desc.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(gl.bfloat16, q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_free.index(s), count=1)
    ones_layout: gl.constexpr = gl.BlockedLayout([1, L_COLS], [32, 1], [num_warps, 1], [1, 0])
    ones = gl.allocate_shared_memory(gl.bfloat16, [BN // 2, L_COLS], gl.NVMMASharedLayout.get_default_for(
        [BN // 2, L_COLS], gl.bfloat16), gl.full([BN // 2, L_COLS], 1.0, gl.bfloat16, ones_layout))
    return q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_free, ones


@gluon.jit
def _block(acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q2, k_bufs, v_bufs, ones, k_ready, v_ready, kv_free, i,
           start_n, offs_m, Nk, pos_offset, qk_scale2, tie2, min_shift2, max_shift2, beta,
           s_layout: gl.constexpr, o_layout: gl.constexpr, l_layout: gl.constexpr, MASK: gl.constexpr,
           CAUSAL: gl.constexpr, MODE: gl.constexpr, STATS: gl.constexpr):
    """sm_90: one key block of the online softmax (``triton_forward.fwd_block``'s steps, same values)."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    BN: gl.constexpr = k_bufs.type.shape[2]
    D: gl.constexpr = k_bufs.type.shape[3]
    slot = i % STAGES
    phase = (i // STAGES) & 1
    mbarrier.wait(k_ready.index(slot), phase)
    k2 = k_bufs.index(slot).reshape([BN, D])
    x = warpgroup_mma(q2, k2.permute((1, 0)), gl.zeros([q2.shape[0], BN], gl.float32, s_layout), use_acc=False,
                      is_async=True)
    x = warpgroup_mma_wait(0, deps=(x, ))
    if MASK:
        x = _mask(x, start_n, offs_m, Nk, pos_offset, CAUSAL)
    m_new, r_new, m2_i, fixed = _decide(x, m_i, r_i, m2_i, fixed, qk_scale2, tie2, min_shift2, max_shift2, beta,
                                        MODE, STATS)
    p, alpha, ent_i, ent_l = _weights(x, r_i, r_new, ent_i, ent_l, qk_scale2, MASK, STATS)
    p_cast = p.to(gl.bfloat16)  # the rounding point the paper is about
    if MODE == MODE_EXACT:  # rescaled here (even columns: tc_row_sum_add says why), P-bar @ 1 added below
        scale = gl.where(_even_cols(l_layout), gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None], 1.0)
        l_i = (l_i[0] * scale, l_i[1] * scale)
    else:
        l_i = l_i * alpha + gl.sum(p, 1)
    # P-bar V (triton_forward.fwd_pv), P-bar from registers
    mbarrier.wait(v_ready.index(slot), phase)
    p_op = gl.convert_layout(p_cast, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    acc = warpgroup_mma(p_op, v_bufs.index(slot).reshape([BN, D]), acc, is_async=True)
    if MODE == MODE_EXACT:
        # the row sum adds exactly the weights that multiply V, on the tensor cores: triton_forward.tc_row_sum_add
        # with two accumulators (triton_launch.row_sum_parts on sm_90), one per half of the block's keys
        p_a, p_b = gl.split(gl.permute(gl.reshape(p_cast, [p_cast.shape[0], 2, BN // 2]), [0, 2, 1]))
        half: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=2)
        l_a = warpgroup_mma(gl.convert_layout(p_a, half), ones, l_i[0], is_async=True)
        l_b = warpgroup_mma(gl.convert_layout(p_b, half), ones, l_i[1], is_async=True)
        acc, l_a, l_b = warpgroup_mma_wait(0, deps=(acc, l_a, l_b))
        l_i = (l_a, l_b)
    else:
        acc = warpgroup_mma_wait(0, deps=(acc, ))
    gl.barrier()  # both warpgroups are done with the slot before it is handed back
    mbarrier.arrive(kv_free.index(slot))
    return acc, l_i, m_new, r_new, m2_i, fixed, ent_i, ent_l


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, ones, q_bar, k_ready, v_ready, kv_free, K, Out, Lse, StSat, StFixed, StMax,
              StSink, StEnt, row0, kv_row, q_lo, Nq, Nk, pos_offset, lo, mid_hi, hi, qk_scale2, tie2, sat2, min_shift2,
              max_shift2, beta, CAUSAL: gl.constexpr, MODE: gl.constexpr, STATS: gl.constexpr,
              BM: gl.constexpr, NW: gl.constexpr):
    """sm_90's consumer partition: the key loop (unmasked blocks, then the masked ones, in key order), the
    epilogue. The accumulators live in registers (wgmma's layouts)."""
    BN: gl.constexpr = k_bufs.type.shape[2]
    D: gl.constexpr = k_bufs.type.shape[3]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, D, 16])
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, L_COLS, 16])
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    offs_m = q_lo + gl.arange(0, BM, rows)
    m_i = gl.full([BM], float("-inf"), gl.float32, rows)  # true running max
    r_i = gl.full([BM], -FP32_MAX, gl.float32, rows)  # the offset subtracted before exp2 (triton_forward.py)
    if MODE == MODE_EXACT:
        l_i = (gl.zeros([BM, L_COLS], gl.float32, l_layout), gl.zeros([BM, L_COLS], gl.float32, l_layout))
    else:
        l_i = gl.zeros([BM], gl.float32, rows)
    m2_i = gl.full([BM], float("-inf"), gl.float32, rows)
    fixed = gl.zeros([BM], gl.int32, rows)
    ent_i = gl.zeros([BM], gl.float32, rows)
    ent_l = gl.zeros([BM], gl.float32, rows)
    acc = gl.zeros([BM, D], gl.float32, o_layout)
    mbarrier.wait(q_bar, 0)
    q2 = q_smem.reshape([BM, D])
    for start_n in range(lo, mid_hi, BN):  # seen in full by every row
        acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = _block(
            acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q2, k_bufs, v_bufs, ones, k_ready, v_ready, kv_free,
            (start_n - lo) // BN, start_n, offs_m, Nk, pos_offset, qk_scale2, tie2, min_shift2, max_shift2, beta,
            s_layout, o_layout, l_layout, False, CAUSAL, MODE, STATS)
    for start_n in range(mid_hi, hi, BN):  # cut by the causal diagonal or the end of the keys
        acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = _block(
            acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q2, k_bufs, v_bufs, ones, k_ready, v_ready, kv_free,
            (start_n - lo) // BN, start_n, offs_m, Nk, pos_offset, qk_scale2, tie2, min_shift2, max_shift2, beta,
            s_layout, o_layout, l_layout, True, CAUSAL, MODE, STATS)
    if MODE == MODE_EXACT:
        l_i = gl.convert_layout(gl.max(gl.where(_even_cols(l_layout), l_i[0] + l_i[1], 0.0), 1), rows)
    _epilogue(acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q2, K, Out, Lse, StSat, StFixed, StMax, StSink, StEnt,
              row0, kv_row, offs_m, q_lo, Nq, Nk, pos_offset, qk_scale2, sat2, CAUSAL, STATS, NW)


@gluon.jit(do_not_specialize=["Hq", "G", "Nq", "Nk"])
def attn_fwd_gluon_kernel(q_desc, k_desc, v_desc, K, Out, Lse, StSat, StFixed, StMax, StSink, StEnt,
                          Hq, G, Nq, Nk, qk_scale2, tie2, sat2, min_shift2, max_shift2, beta,
                          CAUSAL: gl.constexpr, MODE: gl.constexpr, STATS: gl.constexpr, STAGES: gl.constexpr,
                          num_warps: gl.constexpr):
    """sm_90: program ``(query block, head, batch)`` of contiguous ``[B, H, N, D]`` bf16 tensors; the descriptors
    view them as ``[B * H, N, D]`` (blocks ``[1, BLOCK_M or BLOCK_N, D]``: a tile never reads another head's rows,
    TMA fills rows past ``N`` with zeros)."""
    BM: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[1]
    h = gl.program_id(1)
    b = gl.program_id(2)
    q_lo, pos_offset, lo, mid_hi, hi = _key_blocks(Nq, Nk, BM, BN, CAUSAL)
    q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_free, ones = _ring(q_desc, k_desc, v_desc, STAGES,
                                                                           num_warps)
    fence_async_shared()
    q_row = b * Hq + h
    kv_row = b * (Hq // G) + h // G
    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, v_bufs, ones, q_bar, k_ready, v_ready, kv_free, K, Out, Lse, StSat, StFixed, StMax,
                     StSink, StEnt, q_row * Nq, kv_row, q_lo, Nq, Nk, pos_offset, lo, mid_hi, hi, qk_scale2, tie2,
                     sat2, min_shift2, max_shift2, beta, CAUSAL, MODE, STATS, BM, num_warps)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_free, q_row, kv_row,
                   lo, hi)),
    ], [1], [LOADER_REGS])


@gluon.jit
def _bw_block(acc_t, la_t, lb_t, s_t, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q2, k_bufs, v_bufs, p_smem, ones,
              k_ready, v_ready, kv_free, s_bar, o_bar, i, start_n, offs_m, Nk, pos_offset, qk_scale2, tie2,
              min_shift2, max_shift2, beta, MASK: gl.constexpr, CAUSAL: gl.constexpr, MODE: gl.constexpr,
              STATS: gl.constexpr):
    """sm_100: one key block, the steps of :func:`_block` with tcgen05 MMAs: ``S`` into tensor memory, loaded one
    row per thread; ``P-bar`` through shared memory into ``P-bar V`` and the row sum, whose accumulators stay in
    tensor memory and are rescaled there (loaded, multiplied, stored back) before the block's products."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    BN: gl.constexpr = k_bufs.type.shape[2]
    D: gl.constexpr = k_bufs.type.shape[3]
    slot = i % STAGES
    phase = (i // STAGES) & 1
    mbarrier.wait(k_ready.index(slot), phase)
    tcgen05_mma(q2, k_bufs.index(slot).reshape([BN, D]).permute((1, 0)), s_t, use_acc=False)
    tcgen05_commit(s_bar)
    mbarrier.wait(s_bar, i & 1)
    x = s_t.load()
    if MASK:
        x = _mask(x, start_n, offs_m, Nk, pos_offset, CAUSAL)
    m_new, r_new, m2_i, fixed = _decide(x, m_i, r_i, m2_i, fixed, qk_scale2, tie2, min_shift2, max_shift2, beta,
                                        MODE, STATS)
    p, alpha, ent_i, ent_l = _weights(x, r_i, r_new, ent_i, ent_l, qk_scale2, MASK, STATS)
    p_smem.store(p.to(gl.bfloat16))  # the rounding point the paper is about
    fence_async_shared()
    # the previous block's products are complete (o_bar): rescale the accumulators where they live
    o = acc_t.load()
    acc_t.store(o * gl.convert_layout(alpha, gl.SliceLayout(1, o.type.layout))[:, None])
    if MODE == MODE_EXACT:
        la = la_t.load()
        scale = gl.where(_even_cols(la.type.layout),
                         gl.convert_layout(alpha, gl.SliceLayout(1, la.type.layout))[:, None], 1.0)
        la_t.store(la * scale)
        lb_t.store(lb_t.load() * scale)
    else:
        l_i = l_i * alpha + gl.sum(p, 1)
    mbarrier.wait(v_ready.index(slot), phase)
    tcgen05_mma(p_smem, v_bufs.index(slot).reshape([BN, D]), acc_t)
    if MODE == MODE_EXACT:  # the row sum in two accumulators, one per half of the keys (as on sm_90)
        tcgen05_mma(p_smem.slice(0, BN // 2, dim=1), ones, la_t)
        tcgen05_mma(p_smem.slice(BN // 2, BN // 2, dim=1), ones, lb_t)
    tcgen05_commit(o_bar)
    mbarrier.wait(o_bar, i & 1)
    mbarrier.arrive(kv_free.index(slot))
    return l_i, m_new, r_new, m2_i, fixed, ent_i, ent_l


@gluon.jit
def _bw_consumer(q_smem, k_bufs, v_bufs, p_smem, ones, acc_t, la_t, lb_t, s_t, q_bar, k_ready, v_ready, kv_free,
                 s_bar, o_bar, K, Out, Lse, StSat, StFixed, StMax, StSink, StEnt, row0, kv_row, q_lo, Nq, Nk,
                 pos_offset, lo, mid_hi, hi, qk_scale2, tie2, sat2, min_shift2, max_shift2, beta,
                 CAUSAL: gl.constexpr, MODE: gl.constexpr, STATS: gl.constexpr, BM: gl.constexpr,
                 NW: gl.constexpr):
    """sm_100's consumer partition (one warpgroup: one tensor-memory lane, so one query row, per thread)."""
    BN: gl.constexpr = k_bufs.type.shape[2]
    D: gl.constexpr = k_bufs.type.shape[3]
    rows: gl.constexpr = gl.SliceLayout(1, s_t.get_reg_layout())
    offs_m = q_lo + gl.arange(0, BM, rows)
    m_i = gl.full([BM], float("-inf"), gl.float32, rows)
    r_i = gl.full([BM], -FP32_MAX, gl.float32, rows)
    l_i = gl.zeros([BM], gl.float32, rows)  # the off mode's row sum (the exact mode's is in tensor memory)
    m2_i = gl.full([BM], float("-inf"), gl.float32, rows)
    fixed = gl.zeros([BM], gl.int32, rows)
    ent_i = gl.zeros([BM], gl.float32, rows)
    ent_l = gl.zeros([BM], gl.float32, rows)
    mbarrier.wait(q_bar, 0)
    q2 = q_smem.reshape([BM, D])
    for start_n in range(lo, mid_hi, BN):  # seen in full by every row
        l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = _bw_block(
            acc_t, la_t, lb_t, s_t, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q2, k_bufs, v_bufs, p_smem, ones,
            k_ready, v_ready, kv_free, s_bar, o_bar, (start_n - lo) // BN, start_n, offs_m, Nk, pos_offset,
            qk_scale2, tie2, min_shift2, max_shift2, beta, False, CAUSAL, MODE, STATS)
    for start_n in range(mid_hi, hi, BN):  # cut by the causal diagonal or the end of the keys
        l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = _bw_block(
            acc_t, la_t, lb_t, s_t, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q2, k_bufs, v_bufs, p_smem, ones,
            k_ready, v_ready, kv_free, s_bar, o_bar, (start_n - lo) // BN, start_n, offs_m, Nk, pos_offset,
            qk_scale2, tie2, min_shift2, max_shift2, beta, True, CAUSAL, MODE, STATS)
    if MODE == MODE_EXACT:
        la = la_t.load()
        l_i = gl.convert_layout(gl.max(gl.where(_even_cols(la.type.layout), la + lb_t.load(), 0.0), 1), rows)
    _epilogue(acc_t.load(), l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q2, K, Out, Lse, StSat, StFixed, StMax, StSink,
              StEnt, row0, kv_row, offs_m, q_lo, Nq, Nk, pos_offset, qk_scale2, sat2, CAUSAL, STATS, NW)


@gluon.jit(do_not_specialize=["Hq", "G", "Nq", "Nk"])
def attn_fwd_gluon_sm100_kernel(q_desc, k_desc, v_desc, K, Out, Lse, StSat, StFixed, StMax, StSink, StEnt,
                                Hq, G, Nq, Nk, qk_scale2, tie2, sat2, min_shift2, max_shift2, beta,
                                CAUSAL: gl.constexpr, MODE: gl.constexpr, STATS: gl.constexpr,
                                STAGES: gl.constexpr, num_warps: gl.constexpr):
    """sm_100: :data:`attn_fwd_gluon_kernel`'s program with tcgen05 and tensor memory (``S``: ``BLOCK_N`` columns,
    the output accumulator ``D``, the row sum's two ``L_COLS``) and ``P-bar`` staged in shared memory."""
    BM: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[1]
    D: gl.constexpr = k_desc.block_type.shape[2]
    h = gl.program_id(1)
    b = gl.program_id(2)
    q_lo, pos_offset, lo, mid_hi, hi = _key_blocks(Nq, Nk, BM, BN, CAUSAL)
    q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_free, ones = _ring(q_desc, k_desc, v_desc, STAGES,
                                                                           num_warps)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], gl.NVMMASharedLayout.get_default_for([BM, BN],
                                                                                                   gl.bfloat16))
    s_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    o_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(s_bar, count=1)
    mbarrier.init(o_bar, count=1)
    fence_async_shared()
    s_t = allocate_tensor_memory(gl.float32, [BM, BN], TensorMemoryLayout(block=(BM, BN), col_stride=1))
    acc_t = allocate_tensor_memory(gl.float32, [BM, D], TensorMemoryLayout(block=(BM, D), col_stride=1))
    acc_t.store(gl.zeros([BM, D], gl.float32, acc_t.get_reg_layout()))
    la_t = allocate_tensor_memory(gl.float32, [BM, L_COLS], TensorMemoryLayout(block=(BM, L_COLS), col_stride=1))
    lb_t = allocate_tensor_memory(gl.float32, [BM, L_COLS], TensorMemoryLayout(block=(BM, L_COLS), col_stride=1))
    la_t.store(gl.zeros([BM, L_COLS], gl.float32, la_t.get_reg_layout()))
    lb_t.store(gl.zeros([BM, L_COLS], gl.float32, lb_t.get_reg_layout()))
    q_row = b * Hq + h
    kv_row = b * (Hq // G) + h // G
    gl.warp_specialize([
        (_bw_consumer, (q_smem, k_bufs, v_bufs, p_smem, ones, acc_t, la_t, lb_t, s_t, q_bar, k_ready, v_ready,
                        kv_free, s_bar, o_bar, K, Out, Lse, StSat, StFixed, StMax, StSink, StEnt, q_row * Nq, kv_row,
                        q_lo, Nq, Nk, pos_offset, lo, mid_hi, hi, qk_scale2, tie2, sat2, min_shift2, max_shift2,
                        beta, CAUSAL, MODE, STATS, BM, num_warps)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_free, q_row, kv_row,
                   lo, hi)),
    ], [1], [LOADER_REGS])


def _layout(rows: int, head_dim: int):
    return gl.NVMMASharedLayout.get_default_for([1, rows, head_dim], gl.bfloat16)


def signature(head_dim: int) -> tuple[dict, dict]:
    """``(signature, attrs)`` of both kernels for ``triton.compile`` (no GPU needed)."""
    d = head_dim
    sig = {"q_desc": f"tensordesc<bf16[1, {BLOCK_M}, {d}],{_layout(BLOCK_M, d)!r}>",
           "k_desc": f"tensordesc<bf16[1, {BLOCK_N}, {d}],{_layout(BLOCK_N, d)!r}>",
           "v_desc": f"tensordesc<bf16[1, {BLOCK_N}, {d}],{_layout(BLOCK_N, d)!r}>",
           "K": "*bf16", "Out": "*bf16", "Lse": "*fp32", "StSat": "*i8", "StFixed": "*i32", "StMax": "*fp32",
           "StSink": "*fp32", "StEnt": "*fp32", "Hq": "i32", "G": "i32", "Nq": "i32", "Nk": "i32"}
    for name in ("qk_scale2", "tie2", "sat2", "min_shift2", "max_shift2", "beta"):
        sig[name] = "fp32"
    names = attn_fwd_gluon_kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in
             ("K", "Out", "Lse", "StSat", "StFixed", "StMax", "StSink", "StEnt")}
    return sig, attrs


def kernel(cc: int):
    """The kernel of a GPU generation (``cc`` 90 or 100)."""
    return attn_fwd_gluon_kernel if cc == 90 else attn_fwd_gluon_sm100_kernel


def constants(cc: int, head_dim: int, causal: bool, mode: int, stats: int) -> dict:
    """The constexprs of one variant."""
    return dict(CAUSAL=bool(causal), MODE=int(mode), STATS=int(stats), STAGES=stages(head_dim),
                num_warps=NUM_WARPS[cc])


def compile_options(cc: int) -> dict:
    return dict(num_warps=NUM_WARPS[cc], **({"maxnreg": MAX_REGS[cc]} if MAX_REGS[cc] else {}))


def compile_kernel(cc: int, head_dim: int, causal: bool, mode: int = rules.MODE_EXACT, stats: int = 0):
    """Compile one variant for ``GPUTarget("cuda", cc, 32)`` on any machine (the static evidence): the sm_90 kernel
    for ``cc`` 90, the sm_100 one for 100 and above."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    gen = 90 if cc < 100 else 100
    sig, attrs = signature(head_dim)
    consts = constants(gen, head_dim, causal, mode, stats)
    for name in consts:
        sig[name] = "constexpr"
    src = GluonASTSource(fn=kernel(gen), signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=compile_options(gen))


def _generation(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: Options) -> str | None:
    """None where this kernel serves the call, else why not (a sentence naming the argument)."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return (f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: the Gluon forward takes [B, H, N, D] "
                "tensors with v shaped as k")
    B, Hq, Nq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or k.shape[1] < 1 or Hq % k.shape[1]:
        return f"k {tuple(k.shape)} for q {tuple(q.shape)}: batch and head dim must match, Hq a multiple of Hkv"
    if min(B, Hq, Nq, k.shape[2]) < 1 or max(B, Hq) > 65535:
        return (f"q {tuple(q.shape)}, k {tuple(k.shape)}: the Gluon forward takes at least one query and one key, "
                "and at most 65535 batch elements and heads (one grid dimension each)")
    if q.dtype != torch.bfloat16 or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}: the Gluon forward takes bfloat16 q, k and v"
    if D not in HEAD_DIMS:
        return f"head dim {D}: the Gluon forward takes head dims in {HEAD_DIMS}"
    if opts.mode not in MODES:
        return f"mode={opts.mode}: the Gluon forward serves the exact and off modes"
    if opts.key_block != BLOCK_N:
        return f"key_block={opts.key_block}: the Gluon forward serves the {BLOCK_N}-key partition"
    if opts.window is not None or opts.softcap is not None or opts.dropout_p > 0:
        return "window, softcap and dropout are not served by the Gluon forward"
    if opts.pv_fp32:
        return "pv_fp32=True: the Gluon forward multiplies P-bar V in bf16"
    if launch.score_form(opts) != rules.SCORES_FUSED:
        return (f"qk_scale2={opts.qk_scale2}: the Gluon forward serves the fused score form (qk_scale2 <= "
                f"{rules.FUSED_SCALE_MAX}), not the pre-scaled one")
    if not q.is_cuda or _generation(q.device) not in GENERATIONS:
        return f"q on {q.device}: the Gluon forward runs on sm_90 (Hopper) and sm_100 (Blackwell B200) GPUs only"
    return None


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: Options, with_stats: int = 0):
    """``(out, lse2, row_stats)`` as ``triton_attention.forward`` returns them, from the Gluon kernel; raises
    ``ValueError`` where it does not serve the call (:func:`serves`)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    why = serves(q, k, v, opts)
    if why is not None:
        raise ValueError(why)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    out = launch.empty_like(q)
    lse2 = launch.empty((B, Hq, Nq), torch.float32, q.device)
    with_stats = int(with_stats)
    if with_stats:
        st = RowStats.empty((B, Hq, Nq), q.device, alloc=launch.empty, entropy=with_stats == STATS_ENTROPY)
        sat, fixed, max_logit, sink, entropy = st.saturated.view(torch.int8), *st.tensors()[1:]
        if not st.has_entropy:
            entropy = lse2
    else:
        sat = fixed = max_logit = sink = entropy = lse2  # never touched: STATS is a compile-time 0

    def describe(x, rows):
        flat = x.view(-1, x.shape[2], D)
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [1, rows, D], _layout(rows, D))

    tie2, min_shift2, max_shift2 = rules.rule_constants(q.dtype, opts.mode)
    grid = (triton.cdiv(Nq, BLOCK_M), Hq, B)
    gen = _generation(q.device)
    kernel(gen)[grid](
        describe(q, BLOCK_M), describe(k, BLOCK_N), describe(v, BLOCK_N), k, out, lse2, sat, fixed, max_logit, sink,
        entropy, Hq, Hq // Hkv, Nq, Nk, opts.qk_scale2, tie2, rules.sat_tolerance2(q.dtype), min_shift2, max_shift2,
        opts.beta, **constants(gen, D, opts.causal, opts.mode, with_stats),
        **{k: v for k, v in compile_options(gen).items() if k != "num_warps"})
    return out, lse2, (st if with_stats else None)
