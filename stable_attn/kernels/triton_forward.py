"""Triton forward kernel: FlashAttention-2 online softmax with the dynamic-max fix.

One program owns ``BLOCK_M`` query rows of one (batch, query head) and walks the key blocks of the
partition (multiples of ``BLOCK_N`` from key 0) in increasing order, exactly as
``reference.attention_forward`` does; every per-(row, block) decision (block max, tie count, the
offset ``r`` subtracted before ``exp2``) is the reference's, line for line. The walk has three
stretches: blocks cut by the sliding window's left edge (masked), blocks every row sees in full
(no structural mask), blocks cut by the causal diagonal or the end of the keys (masked). They are
visited in increasing key order, so the running state sees the same sequence as the reference.
With ``TILE_N = 2 * BLOCK_N`` (``triton_launch.fwd_config``: the rule's modes on sm_90 at D = 128) one K tile
holds two blocks: one score product for both, then the rule, ``P-bar`` and ``P-bar V`` block by block
(``fwd_tile``), the same operations on the same values as one block per tile.

Head dims above 256 (Gemma 4's 512; ``triton_launch.wide_tiles``): ``HEAD_D > BLOCK_D`` means Q and K come in
``BLOCK_D``-column chunks per key block (:func:`chunked_products`; ``q`` then holds pointers, the query is never
held whole), ``HEAD_DV > BLOCK_DV`` that V's head dim is split over programs (:func:`dv_blocks`, the grid's
second axis over (head, V block)): every program of a row block computes the same scores, decisions and row sums
and stores its V block's output columns; the first stores lse and the statistics (docs/ALGORITHM.md, "Head dims
above 256"). Below 257 columns both are whole, and the kernels compile to the SASS they had.

Compile-time flags select every variant (mode, causal, window, softcap, dropout, padding mask,
statistics), so a variant pays only for what it uses. ``TMA``: K and V arrive through tensor
descriptors (``triton_tiles.load_tile``, shared with the backward); the launcher takes them for the 128-key tile
of stabilize off on sm_90, where no rule sees the partition (``triton_launch.fwd_config``).
``UPCAST`` is set only under ``TRITON_INTERPRET=1``: the interpreter cannot do bf16 arithmetic or
bf16 ``tl.dot``, so operands are widened to fp32 right after loading, and every rounding point stays
an explicit cast to ``DTYPE`` (bf16 x bf16 products are exact in fp32, so CPU and GPU round ``P-bar``
at the same place).

Packed sequences (``attn_fwd_varlen_kernel``, FlashAttention's varlen layout: q ``[total_q, Hq, D]``,
k/v ``[total_k, Hkv, D]``, ``cu_seqlens``): one launch over (query block of the longest sequence,
head, sequence); a program past its sequence's last query block returns at once. Both kernels are
thin entries to one program body, :func:`fwd_program`, whose only varlen lines are offsets, each
chosen where it is used (``x if VARLEN else y``, resolved at compile time): the sequence's first
query and key and its lengths (so causal and window are bottom-right per sequence and the key blocks
start at its first key: the rule sees the partition ``attention()`` sees on the sequence alone),
rows ``[Hq, total_q]`` of lse and statistics, and the dropout counters of the sequence alone with
seed ``seed + b``. Two entries rather than a flag on one kernel: the varlen arguments alone (unused)
changed the dense kernel's SASS, while this way the dense kernels compile to the SASS they have without
varlen (all 12 sm_90 D = 64/128 variants of ``benchmarks/kernel_resources.py`` compared instruction by
instruction).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import rules
from .. import stats as _stats
from .triton_order import query_block
from .triton_tiles import TMA_PACKED, key_range, load_tile, round_to, scores_tile, varlen_bounds

# A jit function reads only globals that are tl.constexpr instances.
MODE_OFF = tl.constexpr(rules.MODE_OFF)
MODE_EXACT = tl.constexpr(rules.MODE_EXACT)
MODE_PAPER = tl.constexpr(rules.MODE_PAPER)
PAPER_ROW_SUM_FLOOR = tl.constexpr(rules.PAPER_ROW_SUM_FLOOR)
FP32_MAX = tl.constexpr(rules.FP32_MAX)
LOG2E = tl.constexpr(rules.LOG2E)
STATS_ENTROPY = tl.constexpr(_stats.STATS_ENTROPY)  # STATS: 0 none, 1 row statistics, 2 also the entropy
L_COLS = tl.constexpr(8)  # columns of the tensor-core row sum: wgmma's smallest N


@triton.constexpr_function
def tensor_core_row_sum(block_d, dropout):
    """Whether the exact mode's row sum runs on the tensor cores: where its ``[BLOCK_M, L_COLS]`` fp32
    accumulator fits in registers beside the others (benchmarks/kernel_resources.py: with it D = 256
    spills where it did not, and the dropout variants spill more)."""
    return block_d <= 128 and not dropout


# With two accumulators only their even columns are rescaled by alpha and read after the loop: every column
# holds the same sum and each thread of the sm_90 tiles holds one even and one odd column of each of its rows
# (wgmma's accumulator layout), so this halves the multiplies; the odd columns keep unscaled sums of P-bar
# <= 1 (finite), never read. Not with one accumulator: there it lengthened the decode kernel's loops (16-row
# tiles; benchmarks/decode_resources.py, exact, 128-key blocks: 470 -> 472 SASS at D = 64 on sm_90).
@triton.jit
def _even_cols():
    return (tl.arange(0, L_COLS) % 2 == 0)[None, :]


@triton.jit
def tc_row_sum_zeros(BLOCK_M: tl.constexpr, PARTS: tl.constexpr):
    """The exact mode's tensor-core row sum before the first key: a tuple of ``PARTS`` (1 or 2)
    ``[BLOCK_M, L_COLS]`` fp32 accumulators, one per column group of the key block (``tc_row_sum_add``)."""
    if PARTS == 2:
        return tl.zeros([BLOCK_M, L_COLS], tl.float32), tl.zeros([BLOCK_M, L_COLS], tl.float32)
    else:
        return (tl.zeros([BLOCK_M, L_COLS], tl.float32),)


@triton.jit
def tc_row_sum_add(l_i, p_cast, alpha, PREC: tl.constexpr):
    """``l_i * alpha + P-bar @ 1`` on the tensor cores: ``P-bar @ 1`` reads the P-bar registers the P-bar V
    product reads, instead of widening every element back to fp32; every column holds the row sum.

    With two accumulators (``tc_row_sum_zeros``) each half of the block's keys goes into its own: two
    products of ``BLOCK_N / 2`` keys against one ``[BLOCK_N / 2, L_COLS]`` tile of ones, whose shared-memory
    descriptors (one per 16 keys) then stay in uniform registers. One product of ``BLOCK_N`` keys needs
    twice as many and ptxas rebuilt half of them every iteration (sm_90, D = 64: 8 UMOV per key block; two
    products, with the even columns' rescale below, 551 instead of 560 loop SASS causal and 559 instead of
    570 not, benchmarks/kernel_resources.py, docs/BENCHMARKS.md). Two accumulators, not
    one chained through both products: Triton waits for a product whose result another one in the same
    iteration reads (its wgmma pipeline), only a loop-carried accumulator stays asynchronous.
    """
    if len(l_i) == 2:
        n: tl.constexpr = p_cast.shape[1] // 2
        # the halves of the key axis (column bit log2(n) is a register index of the dot's layout)
        p_a, p_b = tl.split(tl.permute(tl.reshape(p_cast, [p_cast.shape[0], 2, n]), [0, 2, 1]))
        ones = tl.full([n, L_COLS], 1.0, p_cast.dtype)
        scale = tl.where(_even_cols(), alpha[:, None], 1.0)
        l_i = (tl.dot(p_a, ones, l_i[0] * scale, input_precision=PREC),
               tl.dot(p_b, ones, l_i[1] * scale, input_precision=PREC))
    else:
        ones = tl.full([p_cast.shape[1], L_COLS], 1.0, p_cast.dtype)
        l_i = (tl.dot(p_cast, ones, l_i[0] * alpha[:, None], input_precision=PREC),)
    return l_i


@triton.jit
def tc_row_sum_total(l_i):
    """The row sum ``[BLOCK_M]`` of ``tc_row_sum_add``'s accumulators, after the loop."""
    if len(l_i) == 2:
        l = tl.max(tl.where(_even_cols(), l_i[0] + l_i[1], 0.0), 1)
    else:
        l = tl.max(l_i[0], 1)
    return l


@triton.jit
def _top2_combine(a1, a2, b1, b2):
    return tl.maximum(a1, b1), tl.maximum(tl.minimum(a1, b1), tl.maximum(a2, b2))


@triton.jit
def row_top2(s2):
    """Largest and second-largest score of each row of a tile (two equal values for a tie).

    ``count(s2 >= t) >= 2`` iff ``second >= t``: the trigger and the saturation statistic become one
    comparison per row instead of a count per element (the PyTorch twin is ``rules.row_top2``).
    """
    a, b = tl.split(tl.reshape(s2, [s2.shape[0], s2.shape[1] // 2, 2]))
    return tl.reduce((tl.maximum(a, b), tl.minimum(a, b)), 1, _top2_combine)


@triton.jit
def halves_top2(s, BLOCK_N: tl.constexpr):
    """``row_top2`` of each ``BLOCK_N``-key half of a ``[BLOCK_M, 2 * BLOCK_N]`` tile, both reduced at once
    from the tile as the score product leaves it: ``(top_a, second_a, top_b, second_b)``.

    The same values as ``row_top2`` of each half (max and min are exact, in any order); reducing the
    halves after splitting them made Triton move one of them through warp shuffles (sm_90, D = 64:
    829 instead of 685 SASS per 128-key iteration).
    """
    a, b = tl.split(tl.reshape(s, [s.shape[0], 2, BLOCK_N // 2, 2]))
    top, second = tl.reduce((tl.maximum(a, b), tl.minimum(a, b)), 2, _top2_combine)
    top_a, top_b = tl.split(top)
    second_a, second_b = tl.split(second)
    return top_a, second_a, top_b, second_b


@triton.jit
def row_top2_by_count(s2):
    """``row_top2`` from built-in reductions only: the same two values (selected, never computed).

    The interpreter runs a ``tl.reduce`` with a Python combine function element by element (a 300-key
    forward took 7 s instead of 0.5 s), so under ``TRITON_INTERPRET=1`` the kernel takes this form;
    tests/kernels/test_rule_functions.py checks that both give the same decisions on tie-heavy tiles.
    """
    top = tl.max(s2, 1)
    at_top = s2 == top[:, None]
    below = tl.max(tl.where(at_top, float("-inf"), s2), 1)
    return top, tl.where(tl.sum(at_top.to(tl.int32), 1) >= 2, top, below)


@triton.jit
def shifted_offset(m2, beta, min_shift2, max_shift2):
    """The offset when the rule fires: ``m + clamp(shift_paper(m), MIN_SHIFT, MAX_SHIFT)``.

    docs/ALGORITHM.md, forward step 4; the same bits as ``rules.shifted_offset`` (``beta - 1`` in fp32).
    ``shift_paper(m)`` is ``max((beta - 1) * m, -m)`` here: with ``beta > 1`` (``Options``) the first is the
    larger for ``m > 0`` and the second for ``m < 0``, the values ``rules.shifted_offset`` selects by the
    sign of ``m``, with a multiply and a max instead of a compare, a multiply and a select (a zero's
    sign, where the two could differ, is lost in the clamp: ``MIN_SHIFT > 0``).
    """
    # beta - 1 in fp32 (the cast: the interpreter would otherwise subtract Python floats in double)
    paper_shift = tl.maximum((tl.cast(beta, tl.float32) - 1.0) * m2, -m2)
    return m2 + tl.minimum(tl.maximum(paper_shift, min_shift2), max_shift2)


@triton.jit
def block_offset(r, m_new, m_blk, m2_blk, tie2, min_shift2, max_shift2, beta, MODE: tl.constexpr):
    """The stabilization rule for one key block: ``(r_new, fire)`` per row (docs/ALGORITHM.md, forward 2-4).

    The twin of ``rules.block_offset`` (same arguments, same bits; tests/kernels/test_rule_functions.py).
    """
    if MODE == MODE_EXACT:
        r_cand = tl.maximum(r, m_blk)
        # P-bar would round to exactly 1.0 at two or more keys of this block: shift the offset. A block
        # without a key (m2_blk = -inf) cannot fire: r >= -FP32_MAX, so r_cand - tie2 is finite
        fire = m2_blk >= r_cand - tie2
        r_new = tl.where(fire, shifted_offset(m_new, beta, min_shift2, max_shift2), r_cand)
    elif MODE == MODE_PAPER:
        fire = (m2_blk >= m_blk - tie2) & (m_blk > float("-inf"))
        m_adj = tl.where(fire & (m_blk > 0), beta * m_blk, tl.where(fire & (m_blk < 0), 0.0, m_blk))
        fire = fire & (m_blk != 0)
        r_new = tl.maximum(r, m_adj)
    else:
        fire = m_blk < float("-inf")  # all False; only read by the statistics
        r_new = tl.maximum(r, m_blk)
    return r_new, fire


@triton.jit
def kv_tile_mask(offs_n, offs_d, Nk, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The rows of a K or V tile that exist (keys ``offs_n < Nk``) and its real head-dim columns."""
    mask = offs_n[:, None] < Nk
    if HEAD_D % BLOCK_D != 0:  # a tile (or the last of a wide head dim's column blocks) reaches past HEAD_D
        mask = mask & (offs_d[None, :] < HEAD_D)
    return mask


@triton.constexpr_function
def dv_blocks(head_dv, block_dv):
    """Programs per (query block, head) that share its rows: one per ``BLOCK_DV`` columns of V and the output.
    More than one only where V's head dim is wider than a tile holds (``triton_launch.wide_tiles``)."""
    return (head_dv + block_dv - 1) // block_dv


@triton.jit
def chunked_products(q_ptrs, k_ptrs, start_n, offs_n, offs_d, stride_kn, Nk, MASK: tl.constexpr,
                     HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """``x = q.k`` of a tile where the head dim is wider than one tile (``HEAD_D > BLOCK_D``): Q and K come in
    ``BLOCK_D``-column chunks, loaded here chunk by chunk (``q_ptrs``: the query rows' first columns), their
    products summed in fp32 in a fixed order, so no program holds the whole query row in registers. Every program
    of a row block runs the same chunks in the same order on the same data: the same bits of ``x``."""
    x = tl.zeros([q_ptrs.shape[0], offs_n.shape[0]], tl.float32)
    for c in range(0, HEAD_D, BLOCK_D):
        if HEAD_D % BLOCK_D != 0:
            cols = (c + offs_d)[None, :] < HEAD_D
            q = tl.load(q_ptrs + c, mask=cols, other=0.0)
            k_mask = cols & (offs_n[:, None] < Nk) if MASK else cols
            k = tl.load(k_ptrs + start_n * stride_kn + c, mask=k_mask, other=0.0)
        else:
            q = tl.load(q_ptrs + c)
            if MASK:
                k = tl.load(k_ptrs + start_n * stride_kn + c, mask=offs_n[:, None] < Nk, other=0.0)
            else:
                k = tl.load(k_ptrs + start_n * stride_kn + c)
        if UPCAST:
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        x = tl.dot(q, tl.trans(k), x, input_precision=PREC)
    return x


@triton.jit
def fwd_scores(q, tile_b, hkv, k_ptrs, kpm_ptrs, start_n, offs_m, offs_n0, offs_d, stride_kn, qk_scale2, cap_scale,
               cap_log2e, Nk, pos_offset, window, MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
               UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    """Scores of the keys ``start_n + offs_n0`` against ``q`` (K loaded here) and the K/V row mask. Where the
    head dim is wider than a tile (``HEAD_D > BLOCK_D``) ``q`` holds the query rows' pointers and the products
    come chunk by chunk (:func:`chunked_products`)."""
    offs_n = start_n + offs_n0
    kv_mask = kv_tile_mask(offs_n, offs_d, Nk, HEAD_D, BLOCK_D)
    if HEAD_D > BLOCK_D:  # the products themselves; scores_tile below takes them as they are
        x = chunked_products(q, k_ptrs, start_n, offs_n, offs_d, stride_kn, Nk, MASK, HEAD_D, BLOCK_D, UPCAST, PREC)
        k = None
    else:
        x = q
        if TMA:
            k = load_tile(k_ptrs, k_ptrs, tile_b, hkv, start_n, stride_kn, offs_n0, offs_d, Nk, offs_n0.shape[0],
                          HEAD_D, BLOCK_D, TMA)
        elif MASK:
            k = tl.load(k_ptrs + start_n * stride_kn, mask=kv_mask, other=0.0)
        elif HEAD_D != BLOCK_D:
            k = tl.load(k_ptrs + start_n * stride_kn, mask=offs_d[None, :] < HEAD_D, other=0.0)
        else:
            k = tl.load(k_ptrs + start_n * stride_kn)
        if UPCAST:
            k = k.to(tl.float32)
    kp = offs_n0 < 0  # placeholder, only read when HAS_KPM
    if HAS_KPM:
        if MASK:
            kp = tl.load(kpm_ptrs + start_n, mask=offs_n < Nk, other=0) != 0
        else:
            kp = tl.load(kpm_ptrs + start_n) != 0
    # without softcap s holds x = q.k: the maxima are taken on x and scaled after, the bits of the
    # maxima of fl(x * qk_scale2) (rounding is monotone and qk_scale2 > 0), and P-bar below rounds
    # once (docs/ALGORITHM.md, "Rounding points"); with softcap s holds the base-2 scores
    s, _ = scores_tile(x, k, offs_m, offs_n, kp, qk_scale2 if SOFTCAP else None, cap_scale, cap_log2e, Nk,
                       pos_offset, window, MASK, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, PREC)
    return s, kv_mask


@triton.jit
def fwd_decide(m_i, r_i, m2_i, fixed, s, top1, top2, qk_scale2, tie2, min_shift2, max_shift2, beta,
               SOFTCAP: tl.constexpr, MODE: tl.constexpr, STATS: tl.constexpr, UPCAST: tl.constexpr):
    """The decision of one block of the partition (``s``: ``fwd_scores`` of its keys): its maxima, the
    rule's offset and the statistics' row state. Returns ``(m_blk, m_new, r_new, m2_i, fixed)``.
    ``top1``/``top2``: the block's ``row_top2`` of ``s`` if already known, else None."""
    if MODE == MODE_OFF and not STATS:
        m_blk = tl.max(s, 1)
        m2_blk = m_blk  # unused: plain FA2 makes no tie test
    elif top1 is not None:
        m_blk = top1
        m2_blk = top2
    elif UPCAST:  # the interpreter (see row_top2_by_count); the GPU reduces pairwise
        m_blk, m2_blk = row_top2_by_count(s)
    else:
        m_blk, m2_blk = row_top2(s)
    if not SOFTCAP:
        m_blk = m_blk * qk_scale2
        m2_blk = m2_blk * qk_scale2
    m_new = tl.maximum(m_i, m_blk)
    r_new, fire = block_offset(r_i, m_new, m_blk, m2_blk, tie2, min_shift2, max_shift2, beta, MODE)
    if STATS:
        # the running second-largest score of the row, merged with the block's top two (the running
        # max is m_new): the row saturates where it lies within sat2 of the max (reference.py, the same)
        m2_i = tl.maximum(tl.minimum(m_i, m_blk), tl.maximum(m2_i, m2_blk))
        fixed += fire.to(tl.int32)
    return m_blk, m_new, r_new, m2_i, fixed


@triton.jit
def fwd_weights(l_i, ent_i, ent_l, s, m_blk, r_i, r_new, start_n, offs_n0, qk_scale2, seed, drop_p, drop_row,
                MASK: tl.constexpr, SOFTCAP: tl.constexpr, MODE: tl.constexpr, STATS: tl.constexpr,
                DROPOUT: tl.constexpr, BLOCK_D: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr,
                PREC: tl.constexpr):
    """P-bar of one block under the offset ``r_new`` ``fwd_decide`` chose (the row's previous offset
    ``r_i``), rounded, dropout applied, and the row sum: ``(p_cast, alpha, l_i, ent_i, ent_l)``; ``fwd_pv``
    adds ``P-bar V``. ``STATS``: the entropy's running sums ``ent_i = sum_j P-bar_j (s2_j - r)`` and
    ``ent_l = sum_j P-bar_j`` of the unrounded fp32 ``P-bar``, rescaled to ``r_new``."""
    # r starts at -FP32_MAX (fwd_program), so r - r_new and s - r are never inf - inf: no guard here
    alpha = tl.exp2(r_i - r_new)  # 0 (or 1 on zeros) while the row has seen no key
    if SOFTCAP:
        t = s - r_new[:, None]
    else:  # P-bar = exp2(x * qk_scale2 - r), rounded once (reference.fma_f32 on the PyTorch path)
        t = tl.fma(s, qk_scale2, -r_new[:, None])
    p = tl.exp2(t)
    if STATS == STATS_ENTROPY:
        # the entropy of softmax itself (reference.py, the same): fp32 P-bar over its own fp32 sum. The row
        # sum l would not do: in exact mode it adds the rounded P-bar, and under the stabilization's shift
        # (up to MAX_SHIFT) the mismatch would put that shift times bf16's rounding error into the entropy.
        # Moving the offset to r_new adds r_i - r_new to every earlier key's t, and alpha rescales P-bar.
        if MASK:  # masked or padded keys: t = -inf and P-bar = 0 add 0 (not 0 * inf)
            t = tl.maximum(t, -FP32_MAX)
        ent_i = alpha * (ent_i + (r_i - r_new) * ent_l) + tl.sum(p * t, 1)
        ent_l = ent_l * alpha + tl.sum(p, 1)
    # the rounding point the paper is about: P-bar is cast to the input dtype before P-bar V
    p_cast = round_to(p, DTYPE, UPCAST)
    if (MODE == MODE_EXACT) and tensor_core_row_sum(BLOCK_D, DROPOUT):
        # consistent normalisation: the row sum adds exactly the weights that multiply V
        l_i = tc_row_sum_add(l_i, p_cast, alpha, PREC)
    elif MODE == MODE_EXACT:  # the same sum, element by element (where the accumulator would spill)
        l_i = l_i * alpha + tl.sum(p_cast.to(tl.float32), 1)
    elif MODE == MODE_PAPER:  # the published floor, in blocks where the row sees a key
        l_blk = tl.sum(p, 1)
        l_i = l_i * alpha + tl.where(m_blk > float("-inf"), tl.maximum(l_blk, PAPER_ROW_SUM_FLOOR), l_blk)
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:  # a 0/1 mask keeps P-bar exact; 1/(1-p) is applied once, at the end
        keep = tl.rand(seed, drop_row[:, None] + (start_n + offs_n0)[None, :].to(tl.int64)) >= drop_p
        p_cast = tl.where(keep, p_cast, tl.zeros_like(p_cast))
    return p_cast, alpha, l_i, ent_i, ent_l


@triton.jit
def fwd_pv(acc, p_cast, alpha, kv_mask, tile_b, hkv, v_ptrs, start_n, offs_n0, offs_d, stride_vn, Nk,
           MASK: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
           PREC: tl.constexpr, TMA: tl.constexpr):
    """``acc * alpha + P-bar V`` for the keys ``start_n + offs_n0`` (V loaded here)."""
    if TMA:
        v = load_tile(v_ptrs, v_ptrs, tile_b, hkv, start_n, stride_vn, offs_n0, offs_d, Nk, offs_n0.shape[0],
                      HEAD_D, BLOCK_D, TMA)
    elif MASK:
        v = tl.load(v_ptrs + start_n * stride_vn, mask=kv_mask, other=0.0)
    elif HEAD_D % BLOCK_D != 0:
        v = tl.load(v_ptrs + start_n * stride_vn, mask=offs_d[None, :] < HEAD_D, other=0.0)
    else:
        v = tl.load(v_ptrs + start_n * stride_vn)
    if UPCAST:
        v = v.to(tl.float32)
    acc = tl.dot(p_cast, v, acc * alpha[:, None], input_precision=PREC)
    return acc


@triton.jit
def fwd_update(acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, s, top1, top2, kv_mask, tile_b, hkv, v_ptrs, start_n,
               offs_n0, offs_d, offs_dv,
               stride_vn, qk_scale2, Nk, tie2, min_shift2, max_shift2, beta, seed, drop_p, drop_row,
               MASK: tl.constexpr, SOFTCAP: tl.constexpr, MODE: tl.constexpr, STATS: tl.constexpr,
               DROPOUT: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr,
               BLOCK_DV: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
               TMA: tl.constexpr, HAS_KPM: tl.constexpr = False):
    """The online-softmax step of one block of the partition: ``fwd_decide``, ``fwd_weights``, ``fwd_pv``; the
    updated row state. ``kv_mask``: the V tile's (``offs_dv``, ``HEAD_DV``: the value head dim, apart from the
    query's ``HEAD_D`` in multi-head latent attention). ``HAS_KPM``: padded keys' scores are ``-inf`` in the
    unmasked stretch too (the entropy's sums skip them: ``fwd_weights``)."""
    m_blk, m_new, r_new, m2_i, fixed = fwd_decide(m_i, r_i, m2_i, fixed, s, top1, top2, qk_scale2, tie2, min_shift2,
                                                  max_shift2, beta, SOFTCAP, MODE, STATS, UPCAST)
    p_cast, alpha, l_i, ent_i, ent_l = fwd_weights(l_i, ent_i, ent_l, s, m_blk, r_i, r_new, start_n, offs_n0,
                                                   qk_scale2, seed,
                                            drop_p, drop_row, MASK or HAS_KPM, SOFTCAP, MODE, STATS, DROPOUT,
                                            BLOCK_D if BLOCK_D >= BLOCK_DV else BLOCK_DV, DTYPE, UPCAST, PREC)
    acc = fwd_pv(acc, p_cast, alpha, kv_mask, tile_b, hkv, v_ptrs, start_n, offs_n0, offs_dv, stride_vn, Nk, MASK,
                 HEAD_DV, BLOCK_DV, UPCAST, PREC, TMA)
    return acc, l_i, m_new, r_new, m2_i, fixed, ent_i, ent_l


@triton.jit
def fwd_block(acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q, tile_b, hkv, k_ptrs, v_ptrs, kpm_ptrs, start_n, offs_m,
              offs_n0, offs_d, offs_dv, stride_kn, stride_vn, qk_scale2, cap_scale, cap_log2e, Nk, pos_offset, window,
              tie2, min_shift2, max_shift2, beta, seed, drop_p, drop_row,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
              HAS_KPM: tl.constexpr, MODE: tl.constexpr, STATS: tl.constexpr, DROPOUT: tl.constexpr,
              HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr,
              BLOCK_DV: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr,
              PREC: tl.constexpr, TMA: tl.constexpr):
    """One key block of the online softmax for ``BLOCK_M`` rows; returns the updated row state.

    With ``TMA``, ``k_ptrs`` and ``v_ptrs`` are the K and V descriptors, indexed by ``tile_b`` and ``hkv``.
    """
    s, kv_mask = fwd_scores(q, tile_b, hkv, k_ptrs, kpm_ptrs, start_n, offs_m, offs_n0, offs_d, stride_kn,
                            qk_scale2, cap_scale, cap_log2e, Nk, pos_offset, window, MASK, CAUSAL, WINDOW, SOFTCAP,
                            HAS_KPM, HEAD_D, BLOCK_D, UPCAST, PREC, TMA)
    if HEAD_DV != HEAD_D or HEAD_D > BLOCK_D:  # the V tile's own columns
        kv_mask = kv_tile_mask(start_n + offs_n0, offs_dv, Nk, HEAD_DV, BLOCK_DV)
    return fwd_update(acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, s, None, None, kv_mask, tile_b, hkv, v_ptrs,
                      start_n,
                      offs_n0, offs_d, offs_dv, stride_vn, qk_scale2, Nk, tie2, min_shift2, max_shift2, beta, seed,
                      drop_p, drop_row, MASK, SOFTCAP, MODE, STATS, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE,
                      UPCAST, PREC, TMA, HAS_KPM)


@triton.jit
def fwd_tile(acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q, tile_b, hkv, k_ptrs, v_ptrs, kpm_ptrs, start_n, offs_m,
             offs_t0,
             offs_n0, offs_d, offs_dv, stride_kn, stride_vn, qk_scale2, cap_scale, cap_log2e, Nk, pos_offset, window,
             tie2, min_shift2, max_shift2, beta, seed, drop_p, drop_row,
             MASK: tl.constexpr, BOTH: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
             SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr, MODE: tl.constexpr, STATS: tl.constexpr,
             DROPOUT: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr,
              BLOCK_DV: tl.constexpr, DTYPE: tl.constexpr,
             UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    """Two key blocks of the partition, ``start_n`` and ``start_n + BLOCK_N``, from one key tile of
    ``TILE_N = 2 * BLOCK_N`` rows: one score product for both, then in key order the two blocks'
    decisions (``fwd_decide``: the second's from the row state the first left), their P-bar and row sums
    (``fwd_weights``) and their ``P-bar V`` products (``fwd_pv``): the same operations on the same values
    as two ``fwd_block`` calls. Issuing both decisions, then both row-sum products, before either
    ``P-bar V`` lets the row-sum products start early: sm_90, D = 128, 808 -> 772 SASS per tile, and with
    statistics the tile fits in 255 registers without spilling (it spilled 72 bytes). ``BOTH`` false: the
    first block only (the scores of the second are dropped).

    ``k_ptrs`` and ``kpm_ptrs`` span the tile (``offs_t0``), ``v_ptrs`` one block (``offs_n0``).
    """
    s, _ = fwd_scores(q, tile_b, hkv, k_ptrs, kpm_ptrs, start_n, offs_m, offs_t0, offs_d, stride_kn, qk_scale2,
                      cap_scale, cap_log2e, Nk, pos_offset, window, MASK, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, HEAD_D,
                      BLOCK_D, UPCAST, PREC, TMA)
    # the two halves of the key axis (column bit log2(BLOCK_N) is a register index of the dot's layout)
    s_a, s_b = tl.split(tl.permute(tl.reshape(s, [s.shape[0], 2, offs_n0.shape[0]]), [0, 2, 1]))
    if UPCAST or (MODE == MODE_OFF and not STATS):  # fwd_update reduces (the interpreter: by counts)
        t1a = None
        t2a = None
        t1b = None
        t2b = None
    else:
        t1a, t2a, t1b, t2b = halves_top2(s, offs_n0.shape[0])
    mask_a = kv_tile_mask(start_n + offs_n0, offs_dv, Nk, HEAD_DV, BLOCK_DV)  # the V tile's
    if BOTH:
        start_b = start_n + offs_n0.shape[0]
        mb_a, m_i, r_a, m2_i, fixed = fwd_decide(m_i, r_i, m2_i, fixed, s_a, t1a, t2a, qk_scale2, tie2, min_shift2,
                                                 max_shift2, beta, SOFTCAP, MODE, STATS, UPCAST)
        mb_b, m_i, r_b, m2_i, fixed = fwd_decide(m_i, r_a, m2_i, fixed, s_b, t1b, t2b, qk_scale2, tie2, min_shift2,
                                                 max_shift2, beta, SOFTCAP, MODE, STATS, UPCAST)
        p_a, alpha_a, l_i, ent_i, ent_l = fwd_weights(l_i, ent_i, ent_l, s_a, mb_a, r_i, r_a, start_n, offs_n0,
                                                      qk_scale2, seed,
                                               drop_p, drop_row, MASK or HAS_KPM, SOFTCAP, MODE, STATS, DROPOUT,
                                               BLOCK_D if BLOCK_D >= BLOCK_DV else BLOCK_DV, DTYPE, UPCAST, PREC)
        p_b, alpha_b, l_i, ent_i, ent_l = fwd_weights(l_i, ent_i, ent_l, s_b, mb_b, r_a, r_b, start_b, offs_n0,
                                                      qk_scale2, seed,
                                               drop_p, drop_row, MASK or HAS_KPM, SOFTCAP, MODE, STATS, DROPOUT,
                                               BLOCK_D if BLOCK_D >= BLOCK_DV else BLOCK_DV, DTYPE, UPCAST, PREC)
        r_i = r_b
        acc = fwd_pv(acc, p_a, alpha_a, mask_a, tile_b, hkv, v_ptrs, start_n, offs_n0, offs_dv, stride_vn, Nk,
                     MASK, HEAD_DV, BLOCK_DV, UPCAST, PREC, TMA)
        acc = fwd_pv(acc, p_b, alpha_b, kv_tile_mask(start_b + offs_n0, offs_dv, Nk, HEAD_DV, BLOCK_DV), tile_b,
                     hkv, v_ptrs, start_b, offs_n0, offs_dv, stride_vn, Nk, MASK, HEAD_DV, BLOCK_DV, UPCAST, PREC,
                     TMA)
    else:
        acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_update(
            acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, s_a, t1a, t2a, mask_a, tile_b, hkv, v_ptrs, start_n,
            offs_n0, offs_d, offs_dv,
            stride_vn, qk_scale2, Nk, tie2, min_shift2, max_shift2, beta, seed, drop_p, drop_row, MASK,
            SOFTCAP, MODE, STATS, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE, UPCAST, PREC, TMA, HAS_KPM)
    return acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l


@triton.jit
def fwd_blocks(m_i, r_i, l_i, acc, m2_i, fixed, ent_i, ent_l, q, tile_b, hkv, k_ptrs, v_ptrs, kpm_ptrs, lo, hi,
               offs_m, offs_n0,
               offs_d, offs_dv, stride_kn, stride_vn, qk_scale2, cap_scale, cap_log2e, Nk, pos_offset, window, tie2,
               min_shift2, max_shift2, beta, seed, drop_p, drop_row,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
               HAS_KPM: tl.constexpr, MODE: tl.constexpr, STATS: tl.constexpr, DROPOUT: tl.constexpr,
               HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr,
              BLOCK_DV: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr,
               PREC: tl.constexpr, TMA: tl.constexpr):
    """The blocks ``[lo, hi)`` of the partition in key order, one ``fwd_block`` each (``fwd_stretch`` of a
    one-block key tile); returns the row state in ``fwd_block``'s order.

    The row state comes in the order ``fwd_program`` defines it (``m_i, r_i, l_i, acc``): Triton carries a
    loop's values in the order its scope defined them, and that order decides ptxas's register
    assignment; it is the order of these loops when they stood in ``fwd_program`` (the SASS of every
    one-block variant is unchanged by the move, benchmarks/kernel_resources.py).
    """
    for start_n in range(lo, hi, offs_n0.shape[0]):
        acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_block(
            acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q, tile_b, hkv, k_ptrs, v_ptrs, kpm_ptrs, start_n, offs_m,
            offs_n0, offs_d, offs_dv, stride_kn, stride_vn, qk_scale2, cap_scale, cap_log2e, Nk, pos_offset,
            window, tie2, min_shift2, max_shift2, beta, seed, drop_p, drop_row,
            MASK, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, MODE, STATS, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE,
            UPCAST, PREC, TMA)
    return acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l


@triton.jit
def fwd_stretch(acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q, tile_b, hkv, k_ptrs, v_ptrs, kpm_ptrs, lo, hi,
                offs_m, offs_t0,
                offs_n0, offs_d, offs_dv, stride_kn, stride_vn, qk_scale2, cap_scale, cap_log2e, Nk, pos_offset, window,
                tie2, min_shift2, max_shift2, beta, seed, drop_p, drop_row,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                HAS_KPM: tl.constexpr, MODE: tl.constexpr, STATS: tl.constexpr, DROPOUT: tl.constexpr,
                HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr,
              BLOCK_DV: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr,
                PREC: tl.constexpr, TMA: tl.constexpr):
    """The blocks ``[lo, hi)`` of the partition in key order: one per ``fwd_block`` where the key tile is one
    block (``offs_t0`` is ``offs_n0``: ``fwd_blocks``), else two per ``fwd_tile`` and an odd last one alone
    (``MASK`` stretches only: the unmasked stretch is cut to whole tiles). ``k_ptrs`` and ``kpm_ptrs`` span
    the key tile."""
    TILE_N: tl.constexpr = offs_t0.shape[0]
    if TILE_N == offs_n0.shape[0]:
        acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_blocks(
            m_i, r_i, l_i, acc, m2_i, fixed, ent_i, ent_l, q, tile_b, hkv, k_ptrs, v_ptrs, kpm_ptrs, lo, hi, offs_m,
            offs_n0,
            offs_d, offs_dv, stride_kn, stride_vn, qk_scale2, cap_scale, cap_log2e, Nk, pos_offset, window, tie2,
            min_shift2, max_shift2, beta, seed, drop_p, drop_row, MASK, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, MODE,
            STATS, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE, UPCAST, PREC, TMA)
    else:
        tiles_hi = lo + (hi - lo) // TILE_N * TILE_N
        for start_n in range(lo, tiles_hi, TILE_N):
            acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_tile(
                acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q, tile_b, hkv, k_ptrs, v_ptrs, kpm_ptrs, start_n,
                offs_m,
                offs_t0, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, qk_scale2, cap_scale, cap_log2e, Nk,
                pos_offset,
                window, tie2, min_shift2, max_shift2, beta, seed, drop_p, drop_row, MASK, True, CAUSAL, WINDOW,
                SOFTCAP, HAS_KPM, MODE, STATS, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE, UPCAST, PREC, TMA)
        if MASK:
            if tiles_hi < hi:
                acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_tile(
                    acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q, tile_b, hkv, k_ptrs, v_ptrs, kpm_ptrs, tiles_hi,
                    offs_m,
                    offs_t0, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, qk_scale2, cap_scale, cap_log2e, Nk,
                    pos_offset, window, tie2, min_shift2, max_shift2, beta, seed, drop_p, drop_row, MASK, False,
                    CAUSAL, WINDOW, SOFTCAP, HAS_KPM, MODE, STATS, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE,
                    UPCAST, PREC,
                    TMA)
    return acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l


@triton.jit
def sink_start(Sinks, h, row_ok, r_i, l_i, ent_l, ROW_SUM_PARTS: tl.constexpr, TC_ROW_SUM: tl.constexpr):
    """The row state after the learned sink's own one-entry block (``reference.sink_state``): the offset ``r``
    from the sink's logit ``sink2 = fl(sink * log2(e))`` (a ``-inf`` sink leaves ``-FP32_MAX``), its weight
    ``exp2(sink2 - r)`` (1, or 0) in the row sum and in the entropy's ``ent_l``; the keys' max ``m`` stays
    ``-inf``. ``h``: each row's query head. Returns ``(sink2, r_i, l_i, ent_l)``."""
    sink2 = tl.load(Sinks + h, mask=row_ok, other=float("-inf")).to(tl.float32) * LOG2E
    r_i = tl.maximum(r_i, sink2)
    l0 = tl.exp2(sink2 - r_i)
    if TC_ROW_SUM:  # every column of the (first) accumulator holds the row sum
        if ROW_SUM_PARTS == 2:
            l_i = (l_i[0] + l0[:, None], l_i[1])
        else:
            l_i = (l_i[0] + l0[:, None],)
    else:
        l_i = l_i + l0
    return sink2, r_i, l_i, ent_l + l0


@triton.jit
def fwd_program(
    Q, K, V, KPM, Out, Lse, StSat, StFixed, StMax, StSink, StEnt, Sinks,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on, stride_kpmb,
    Hq, G, Nq, Nk, window, q_start, k_start, total_q, b_first,
    qk_scale2, cap_scale, cap_log2e, tie2, sat2, min_shift2, max_shift2, beta,
    seed, drop_p, keep_frac,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KPM: tl.constexpr,
    MODE: tl.constexpr, STATS: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    ROW_SUM_PARTS: tl.constexpr, HAS_SINKS: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """The program of both forward kernels: ``BLOCK_M`` query rows of one (batch or sequence, head).
    ``HAS_SINKS``: ``Sinks`` holds one fp32 learned-sink logit per query head (:func:`sink_start`).
    ``HEAD_DV``: V's head dim (and the output's), ``BLOCK_DV`` its power-of-two tile; they equal ``HEAD_D`` and
    ``BLOCK_D`` but in multi-head latent attention, where V is never padded to the query's head dim.

    Dense: batch ``b`` of ``[B, H, N, D]`` tensors, rows ``(b, h, i)`` of ``[B, Hq, Nq]``. ``VARLEN``:
    sequence ``b`` of packed ``[total, H, D]`` tensors, its rows from ``q_start`` and keys from
    ``k_start``, ``Nq``/``Nk`` its lengths, rows ``(h, q_start + i)`` of ``[Hq, total_q]``. The
    difference is confined to the offsets, each chosen where it is used (``x if VARLEN else y``,
    resolved at compile time), so the dense kernel's code carries no varlen line.
    """
    start_m = query_block(Nq, BLOCK_M, CAUSAL, VARLEN)  # causal: the longest blocks first (triton_order.py)
    DV_BLOCKS: tl.constexpr = dv_blocks(HEAD_DV, BLOCK_DV)
    if DV_BLOCKS > 1:  # the programs of one row block split V's head dim; each computes every row's scores
        h = tl.program_id(1) // DV_BLOCKS
        dv_lo = tl.program_id(1) % DV_BLOCKS * BLOCK_DV
    else:
        h = tl.program_id(1)
        dv_lo = 0
    b = tl.program_id(2) + b_first  # dense: launches in chunks of the batch start at b_first (grid limit)
    hkv = h // G
    pos_offset = Nk - Nq  # causal and window are aligned bottom-right

    q_lo = start_m * BLOCK_M
    offs_m = q_lo + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if DV_BLOCKS > 1:
        offs_dv = dv_lo + tl.arange(0, BLOCK_DV)
    else:
        offs_dv = offs_d if BLOCK_DV == BLOCK_D else tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Nq
    q_mask = row_ok[:, None]
    if HEAD_D % BLOCK_D != 0:
        q_mask = q_mask & (offs_d[None, :] < HEAD_D)
    o_mask = q_mask  # the output's rows and V's head-dim columns
    if HEAD_DV != HEAD_D or HEAD_D > BLOCK_D or DV_BLOCKS > 1:
        o_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DV)
    # the row statistics and lse: every program of a row block computes the same bits, the first writes them
    row_w = row_ok if DV_BLOCKS == 1 else row_ok & ((tl.zeros([BLOCK_M], tl.int32) + dv_lo) == 0)
    b64 = b.to(tl.int64)
    if HEAD_D > BLOCK_D:
        # a head dim wider than a tile: q stays in memory, loaded chunk by chunk with each key block
        # (chunked_products); rows past Nq read row Nq - 1 (their scores are never stored)
        q = (Q + (q_start * stride_qn if VARLEN else b64 * stride_qb) + h * stride_qh
             + tl.minimum(offs_m, Nq - 1)[:, None] * stride_qn + offs_d[None, :])
    else:
        q_ptrs = (Q + (q_start * stride_qn if VARLEN else b64 * stride_qb) + h * stride_qh
                  + offs_m[:, None] * stride_qn + offs_d[None, :])
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
    tile_b = k_start.to(tl.int32) if VARLEN else b  # what the descriptor loads index by
    if TMA:
        k_ptrs = K
        v_ptrs = V
    else:
        k_ptrs = (K + (k_start * stride_kn if VARLEN else b64 * stride_kb) + hkv * stride_kh
                  + offs_n0[:, None] * stride_kn + offs_d[None, :])
        v_ptrs = (V + (k_start * stride_vn if VARLEN else b64 * stride_vb) + hkv * stride_vh
                  + offs_n0[:, None] * stride_vn + offs_dv[None, :])
    kpm_ptrs = KPM + b64 * stride_kpmb + offs_n0
    # dropout counter of (b, h, i, 0), as reference.dropout_keep (varlen: of the sequence alone, b = 0)
    drop_row = ((h.to(tl.int64) * Nq + offs_m) * Nk if VARLEN else ((b64 * Hq + h) * Nq + offs_m) * Nk)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # true running max
    # the offset subtracted before exp2; before the row's first key -FP32_MAX, below every finite score, so
    # the first key block takes its own max (reference.py, docs/ALGORITHM.md "Rounding points")
    r_i = tl.full([BLOCK_M], -FP32_MAX, tl.float32)
    # the widest tile (q, K or V, the accumulator) decides whether the tensor-core row sum fits beside them
    ROW_D: tl.constexpr = BLOCK_D if BLOCK_D >= BLOCK_DV else BLOCK_DV
    if (MODE == MODE_EXACT) and tensor_core_row_sum(ROW_D, DROPOUT):
        l_i = tc_row_sum_zeros(BLOCK_M, ROW_SUM_PARTS)  # the row sum, as tensor-core accumulators
    else:
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m2_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # second-largest score (statistics)
    fixed = tl.zeros([BLOCK_M], tl.int32)
    ent_i = tl.zeros([BLOCK_M], tl.float32)  # the entropy's running sums (statistics, fwd_weights)
    ent_l = tl.zeros([BLOCK_M], tl.float32)
    sink2 = m_i  # placeholder, only read when HAS_SINKS
    if HAS_SINKS:
        sink2, r_i, l_i, ent_l = sink_start(Sinks, h + tl.zeros([BLOCK_M], tl.int32), row_ok, r_i, l_i, ent_l,
                                            ROW_SUM_PARTS,
                                            (MODE == MODE_EXACT) and tensor_core_row_sum(ROW_D, DROPOUT))

    lo, mid_lo, mid_hi, hi_al = key_range(q_lo, Nq, Nk, pos_offset, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    if TILE_N > BLOCK_N:  # two blocks of the partition per key tile: K and the padding mask span the tile
        offs_t0 = tl.arange(0, TILE_N)
        if TMA:
            kt_ptrs = K
        else:
            kt_ptrs = (K + (k_start * stride_kn if VARLEN else b64 * stride_kb) + hkv * stride_kh
                       + offs_t0[:, None] * stride_kn + offs_d[None, :])
        kpmt_ptrs = KPM + b64 * stride_kpmb + offs_t0
        # an odd block left over from the unmasked stretch is walked with the masked ones (same bits:
        # the mask hides no key of it)
        full_hi = mid_lo + (mid_hi - mid_lo) // TILE_N * TILE_N
    else:
        offs_t0 = offs_n0
        kt_ptrs = k_ptrs
        kpmt_ptrs = kpm_ptrs
        full_hi = mid_hi
    # the three stretches in key order. Three calls, not one in a tl.static_range loop over the bounds: the
    # same PTX then, but one call site inlined twice with MASK (window edge and diagonal) places the debug
    # labels elsewhere, and ptxas assigned other registers (sm_90 D = 64 off with window etc.)
    if WINDOW:  # cut by the window's left edge (masked)
        acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_stretch(
            acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q, tile_b, hkv, kt_ptrs, v_ptrs, kpmt_ptrs, lo, mid_lo,
            offs_m,
            offs_t0, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, qk_scale2, cap_scale, cap_log2e, Nk, pos_offset,
            window, tie2, min_shift2, max_shift2, beta, seed, drop_p, drop_row,
            True, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, MODE, STATS, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE,
            UPCAST, PREC, TMA)
    acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_stretch(  # seen in full by every row (unmasked)
        acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q, tile_b, hkv, kt_ptrs, v_ptrs, kpmt_ptrs, mid_lo, full_hi,
        offs_m,
        offs_t0, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, qk_scale2, cap_scale, cap_log2e, Nk, pos_offset,
        window, tie2, min_shift2, max_shift2, beta, seed, drop_p, drop_row,
        False, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, MODE, STATS, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE,
        UPCAST, PREC, TMA)
    # cut by the causal diagonal or the end of the keys (masked)
    acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l = fwd_stretch(
        acc, l_i, m_i, r_i, m2_i, fixed, ent_i, ent_l, q, tile_b, hkv, kt_ptrs, v_ptrs, kpmt_ptrs, full_hi, hi_al,
        offs_m,
        offs_t0, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, qk_scale2, cap_scale, cap_log2e, Nk, pos_offset,
        window, tie2, min_shift2, max_shift2, beta, seed, drop_p, drop_row,
        True, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, MODE, STATS, DROPOUT, HEAD_D, BLOCK_D, HEAD_DV, BLOCK_DV, DTYPE,
        UPCAST, PREC, TMA)

    if (MODE == MODE_EXACT) and tensor_core_row_sum(ROW_D, DROPOUT):
        l_i = tc_row_sum_total(l_i)
    seen = m_i > float("-inf")
    # a row that sees no key outputs zeros; every other row has l > 0 (paper mode: the floor). A NaN query
    # makes every visible score NaN, which the row max passes over: l is NaN then, and out and lse stay NaN.
    written = seen | (l_i != l_i)
    if DROPOUT:
        o = acc / (l_i * keep_frac)[:, None]
    else:
        o = acc / l_i[:, None]
    o = tl.where(written[:, None], o, 0.0)
    o_ptrs = (Out + (q_start * stride_on if VARLEN else b64 * stride_ob) + h * stride_oh
              + offs_m[:, None] * stride_on + offs_dv[None, :])
    tl.store(o_ptrs, round_to(o, DTYPE, UPCAST).to(DTYPE), mask=o_mask)
    lse = tl.where(written, r_i + tl.log2(l_i), float("inf"))
    row_ptr = (h.to(tl.int64) * total_q + q_start + offs_m) if VARLEN else (b64 * Hq + h) * Nq + offs_m
    tl.store(Lse + row_ptr, lse, mask=row_w)
    if STATS:
        # saturation against the row max with the sink (two keys within sat2 of a sink above them stay < 1.0)
        top = tl.maximum(m_i, sink2) if HAS_SINKS else m_i
        tl.store(StSat + row_ptr, ((m2_i >= top - sat2) & seen).to(tl.int8), mask=row_w)
        tl.store(StFixed + row_ptr, fixed, mask=row_w)
        tl.store(StMax + row_ptr, m_i / LOG2E, mask=row_w)
        # H = ln 2 * (log2 L - ent / L) nats with L = ent_l; 0 where no key is seen, and where every P-bar
        # underflowed (L = 0: only the published rule's unbounded offset does that)
        if STATS == STATS_ENTROPY:
            ent_ok = seen & (ent_l > 0)
            tl.store(StEnt + row_ptr, tl.where(ent_ok, (tl.log2(ent_l) - ent_i / ent_l) / LOG2E, 0.0), mask=row_w)
        # the sink's score, recomputed from key 0 alone: the loops then carry no test for block 0
        # (fp32 sum in another order than the tile's dot: within summation-order differences)
        # (varlen: a sequence without keys has no key 0; the next sequence's must not be read)
        if HEAD_D > BLOCK_D:  # chunk by chunk, as the scores (no 512-wide row in registers)
            k0_ptr = K + (k_start * stride_kn if VARLEN else b64 * stride_kb) + hkv * stride_kh + offs_d
            q0_ptrs = (Q + (q_start * stride_qn if VARLEN else b64 * stride_qb) + h * stride_qh
                       + offs_m.to(tl.int64)[:, None] * stride_qn + offs_d[None, :])
            x0 = tl.zeros([BLOCK_M], tl.float32)
            for c in tl.static_range(0, HEAD_D, BLOCK_D):
                cols = (c + offs_d) < HEAD_D
                k0 = tl.load(k0_ptr + c, mask=cols & (Nk > 0) if VARLEN else cols, other=0.0)
                q_c = tl.load(q0_ptrs + c, mask=row_ok[:, None] & cols[None, :], other=0.0)
                x0 += tl.sum(q_c.to(tl.float32) * k0.to(tl.float32)[None, :], 1)
        else:
            if TMA:  # key 0 picked out of the first key tile (an exact sum of one value and zeros)
                offs_k0 = tl.arange(0, TILE_N)  # the K descriptor's rows
                k_first = load_tile(K, K, tile_b, hkv, 0, stride_kn, offs_k0, offs_d, Nk, TILE_N, HEAD_D, BLOCK_D,
                                    TMA)
                k0 = tl.sum(tl.where(offs_k0[:, None] == 0, k_first.to(tl.float32), 0.0), 0)
                if VARLEN:
                    k0 = tl.where(Nk > 0, k0, 0.0)
            else:
                k0 = tl.load(K + (k_start * stride_kn if VARLEN else b64 * stride_kb) + hkv * stride_kh + offs_d,
                             mask=offs_d < (tl.minimum(Nk, 1) * HEAD_D if VARLEN else HEAD_D), other=0.0)
            # reloaded: q itself need not stay in registers; its addresses are formed again here (64-bit row
            # offsets, not the loads' expression), so they are not kept, or spilled, across the key loop
            q_again = tl.load(Q + (q_start * stride_qn if VARLEN else b64 * stride_qb) + h * stride_qh
                              + offs_m.to(tl.int64)[:, None] * stride_qn + offs_d[None, :], mask=q_mask, other=0.0)
            x0 = tl.sum(q_again.to(tl.float32) * k0.to(tl.float32)[None, :], 1)
        key0 = tl.zeros([1], tl.int32)
        kp0 = key0 < 0  # placeholder, only read when HAS_KPM
        if HAS_KPM:
            kp0 = tl.load(KPM + b64 * stride_kpmb + key0) != 0
        s_first, _ = scores_tile(x0[:, None], None, offs_m, key0, kp0, qk_scale2, cap_scale, cap_log2e, Nk,
                                 pos_offset, window, True, CAUSAL, WINDOW, SOFTCAP, HAS_KPM, PREC)
        tl.store(StSink + row_ptr, tl.exp2(tl.max(s_first, 1) - lse), mask=row_w)


@triton.jit(do_not_specialize=["Hq", "G", "Nq", "Nk", "window", "b_first", "seed"])
def attn_fwd_kernel(
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
    """Program ``(query block, head, batch - b_first)`` of ``[B, H, N, D]`` tensors; with ``TMA``, ``K`` and ``V``
    are descriptors (blocks ``[1, 1, TILE_N, BLOCK_D]`` and ``[1, 1, BLOCK_N, BLOCK_DV]``)."""
    fwd_program(Q, K, V, KPM, Out, Lse, StSat, StFixed, StMax, StSink, StEnt, Sinks,
                stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                stride_ob, stride_oh, stride_on, stride_kpmb, Hq, G, Nq, Nk, window, None, None, None, b_first,
                qk_scale2, cap_scale, cap_log2e, tie2, sat2, min_shift2, max_shift2, beta, seed, drop_p, keep_frac,
                CAUSAL, WINDOW, SOFTCAP, HAS_KPM, MODE, STATS, DROPOUT, False, HEAD_D, BLOCK_D, BLOCK_M, BLOCK_N,
                TILE_N, DTYPE, UPCAST, PREC, TMA, ROW_SUM_PARTS, HAS_SINKS, HEAD_DV, BLOCK_DV)


@triton.jit(do_not_specialize=["Hq", "G", "window", "total_q", "seed"])
def attn_fwd_varlen_kernel(
    Q, K, V, Out, Lse, StSat, StFixed, StMax, StSink, StEnt, Sinks, CuQ, CuK,
    stride_qh, stride_qn, stride_kh, stride_kn, stride_vh, stride_vn, stride_oh, stride_on,
    Hq, G, window, total_q,
    qk_scale2, cap_scale, cap_log2e, tie2, sat2, min_shift2, max_shift2, beta,
    seed, drop_p, keep_frac,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    MODE: tl.constexpr, STATS: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    ROW_SUM_PARTS: tl.constexpr, HAS_SINKS: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program ``(query block, head, sequence)`` of packed ``[total, H, D]`` tensors (FlashAttention's
    varlen layout); the grid covers the longest sequence and the other programs end here at once.
    With ``TMA``, ``K`` and ``V`` are descriptors over ``[total_k, Hkv, D]`` (blocks ``[TILE_N, 1, BLOCK_D]``
    and ``[BLOCK_N, 1, BLOCK_DV]``):
    key rows they read past the sequence's end (the next sequence's) lie in the masked stretch, where
    ``P-bar = 0`` (exact zeros for finite inputs, as in the dense case).
    Dropout of sequence ``b``: the mask attention() draws on the sequence alone with ``seed + b``."""
    b = tl.program_id(2)
    q_start, k_start, Nq, Nk = varlen_bounds(CuQ, CuK, b)
    if tl.program_id(0) * BLOCK_M >= Nq:
        return
    fwd_program(Q, K, V, Q, Out, Lse, StSat, StFixed, StMax, StSink, StEnt, Sinks,
                0, stride_qh, stride_qn, 0, stride_kh, stride_kn, 0, stride_vh, stride_vn,
                0, stride_oh, stride_on, 0, Hq, G, Nq, Nk, window, q_start, k_start, total_q, 0,
                qk_scale2, cap_scale, cap_log2e, tie2, sat2, min_shift2, max_shift2, beta, seed + b, drop_p,
                keep_frac, CAUSAL, WINDOW, SOFTCAP, False, MODE, STATS, DROPOUT, True, HEAD_D, BLOCK_D, BLOCK_M,
                BLOCK_N, TILE_N, DTYPE, UPCAST, PREC, TMA_PACKED if TMA else False, ROW_SUM_PARTS, HAS_SINKS,
                HEAD_DV, BLOCK_DV)
