"""FlashAttention-2 with the dynamic-max fix, in PyTorch: the CPU path and the readable spec.

This file follows docs/ALGORITHM.md line by line, with the same key-block partition and the same
per-(row, block) decisions as the Triton kernels (``triton_forward.py``, ``triton_backward.py``).
Vectorized over batch, heads and query rows; Python loops run only over query chunks and key blocks, so memory is
bounded: one score tile ``[B, Hq, chunk, block_n]`` (about ``TILE_ELEMENTS`` fp32 values) plus a few
same-sized temporaries, on top of the fp32 output accumulator (forward) or the fp32 gradient
accumulators (backward).

Layouts: q ``[B, Hq, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]`` (``Dv`` may differ from ``D``:
multi-head latent attention; nothing is padded). Learned sinks (``sinks``, one logit per query head, gpt-oss)
are the row's first key, in a block of its own before the first key block (:func:`sink_state`; docs/ALGORITHM.md,
"Learned sinks"). Internally q is viewed as
``[B, Hkv, G, Nq, D]`` (``G = Hq // Hkv``) so grouped-query attention never repeats k or v.
Scores live in base-2 units (``s2 = s * log2(e)``, see stable_attn/rules.py); ``lse`` is saved in base 2. The forward
rounds ``P-bar = exp2(x * qk_scale2 - r)`` once, as the kernel's ``tl.fma`` does: :func:`fma_f32`
(docs/ALGORITHM.md, "Rounding points").
"""

from __future__ import annotations

import math

import torch

from .. import rules
from .._checks import output_like
from ..options import Options

# the rule's functions live in stable_attn/rules.py; called by these names below, so that tests can record
# the calls by patching reference.block_offset
from ..rules import block_offset, row_top2
from ..stats import STATS_ENTROPY, RowStats
from .philox import keep_mask

TILE_ELEMENTS = 1 << 17  # fp32 elements in one score tile (512 KiB)
_DEFAULT_OPTIONS = Options()


class Problem:
    """Shapes and masks of one call, and the tile geometry derived from them."""

    def __init__(self, q, k, v, key_padding_mask, attn_mask, opts: Options):
        self.B, self.Hq, self.Nq, self.D = q.shape
        self.Dv = v.shape[-1]
        self.Hkv, self.Nk = k.shape[1], k.shape[2]
        self.G = self.Hq // self.Hkv
        self.dtype = q.dtype
        self.opts = opts
        self.offset = self.Nk - self.Nq  # bottom-right alignment of causal / window
        self.kpm = None if key_padding_mask is None else key_padding_mask[:, None, None, None, :]
        self.attn_mask = None
        if attn_mask is not None:
            m = attn_mask
            while m.dim() < 4:
                m = m.unsqueeze(0)
            hm = m.shape[1]
            m = m.expand(m.shape[0], hm, self.Nq, self.Nk)
            # [B|1, Hq|1, Nq, Nk] -> [B|1, Hkv|1, G|1, Nq, Nk] without copying
            self.attn_mask = m.view(m.shape[0], self.Hkv, self.G, self.Nq, self.Nk) if hm != 1 else m[:, :, None]
        # a score tile is chunk x (the widest key block there is): with fewer keys than the partition the
        # chunk does not shrink for keys that do not exist (nor the summation order over chunks change)
        per_row = self.B * self.Hq * min(opts.key_block, max(self.Nk, 1))
        self.chunk = max(16, min(self.Nq, TILE_ELEMENTS // max(per_row, 1)))

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` outside which no query in [q0, q1) sees anything (causal, window)."""
        lo, hi = 0, self.Nk
        if self.opts.causal:
            hi = min(hi, q1 - 1 + self.offset + 1)
        if self.opts.window is not None:
            lo = max(lo, q0 + self.offset - self.opts.window + 1)
        return max(lo, 0), max(hi, 0)

    def key_blocks(self, q0: int, q1: int):
        """Key blocks that hold a key visible to some query in [q0, q1) (others are fully masked)."""
        bn = self.opts.key_block
        lo, hi = self.key_range(q0, q1)
        for j0 in range((lo // bn) * bn, hi, bn):
            yield j0, min(j0 + bn, self.Nk)

    @property
    def fused_scale(self) -> bool:
        """Whether the forward keeps the products ``x = q.k`` unscaled and forms ``P-bar`` as
        ``exp2(fma_f32(x, qk_scale2, -r))``, rounded once, as the kernel does (docs/ALGORITHM.md,
        "Rounding points"): everywhere but softcap and an additive ``attn_mask`` (which the kernel
        never sees), whose scores are not ``x * qk_scale2``, and scales over ``rules.FUSED_SCALE_MAX``, whose
        scores are rounded first (the kernel's ``SCORES_SCALED``)."""
        am = self.attn_mask
        fused = rules.score_form(self.opts.softcap is not None, self.opts.qk_scale2) == rules.SCORES_FUSED
        return fused and (am is None or am.dtype == torch.bool)

    def scores(self, q_c, k_b, q0, q1, j0, j1, scaled: bool = True):
        """Base-2 scores of a tile, ``[B, Hkv, G, cq, bn]``, fp32, masked entries ``-inf``.

        Also returns ``tanh`` of the capped scores (for the softcap backward) or None. ``scaled=False``
        (only where :attr:`fused_scale`): the unscaled products ``x``, masked alike.
        """
        B, Hkv, G = self.B, self.Hkv, self.G
        x = torch.matmul(q_c, k_b.transpose(-1, -2)).view(B, Hkv, G, q1 - q0, j1 - j0)
        t = None
        if self.opts.softcap is not None:
            t = torch.tanh(x * self.opts.cap_scale)
            s2 = t * self.opts.cap_log2e
        elif scaled:
            s2 = x * self.opts.qk_scale2
        else:
            s2 = x
        if self.attn_mask is not None:
            am = self.attn_mask[..., q0:q1, j0:j1]
            if am.dtype == torch.bool:
                s2 = s2.masked_fill(~am, -math.inf)
            else:
                s2 = s2 + am.float() * rules.LOG2E
        visible = self.visible(q0, q1, j0, j1, s2.device)
        if visible is not None:
            s2 = s2.masked_fill(~visible, -math.inf)
        return s2, t

    def visible(self, q0, q1, j0, j1, device):
        """Structural visibility (padding, causal, window) of a tile, or None if all visible."""
        vis = None
        if self.kpm is not None:
            vis = self.kpm[..., j0:j1]
        opts = self.opts
        pos = None
        if opts.causal or opts.window is not None:
            pos = torch.arange(q0, q1, device=device)[:, None] + self.offset
            key = torch.arange(j0, j1, device=device)[None, :]
        if opts.causal and j1 - 1 > q0 + self.offset:
            c = key <= pos
            vis = c if vis is None else vis & c
        if opts.window is not None and j0 <= q1 - 1 + self.offset - opts.window:
            w = key > pos - opts.window
            vis = w if vis is None else vis & w
        return vis

    def dropout_keep(self, q0, q1, j0, j1, device):
        """Keep mask of a tile, ``[B, Hkv, G, cq, bn]``, from the counter-based generator."""
        B, Hkv, G = self.B, self.Hkv, self.G
        b = torch.arange(B, device=device).view(B, 1, 1, 1, 1)
        h = (torch.arange(Hkv, device=device).view(1, Hkv, 1, 1, 1) * G
             + torch.arange(G, device=device).view(1, 1, G, 1, 1))
        i = torch.arange(q0, q1, device=device).view(1, 1, 1, -1, 1)
        j = torch.arange(j0, j1, device=device).view(1, 1, 1, 1, -1)
        offset = ((b * self.Hq + h) * self.Nq + i) * self.Nk + j
        return keep_mask(self.opts.seed, offset, self.opts.dropout_p)


# fp64 bits below an fp32 significand's last bit: 10...0 where the fp64 value is an fp32 rounding midpoint
_BELOW_F32 = (1 << 29) - 1
_F32_MIDPOINT = 1 << 28
_F32_EXPONENT = 0x7F800000
_INT32_MIN = -(1 << 31)


def fma_f32(a: torch.Tensor, b: float | torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to fp32 (nearest-even) for fp32 ``a``, ``c`` and ``b`` (a float is
    rounded to fp32 first, as a kernel argument is): the twin of ``tl.fma`` in ``triton_forward.fwd_block``.

    In fp64 the product is exact (24 + 24 significand bits fit in 53), so the fp64 sum is the exact
    value rounded once, and rounding it again to fp32 gives the exactly rounded result except where the
    fp64 sum is an fp32 rounding midpoint (a tie the first rounding may have made) or the result is
    zero or fp32-subnormal (where the midpoints lie elsewhere). Those entries, rare, are redone by
    :func:`_fma_f32_round_to_odd`; the test costs integer passes over the tile instead of an fp64 TwoSum
    over every entry. Infinities and NaN come out as fp32 arithmetic gives them:
    ``fma_f32(-inf, b, c) = -inf`` for finite ``b > 0`` and ``c``.
    """
    b64 = torch.as_tensor(b, dtype=torch.float32).double()
    s = a.to(torch.float64, copy=True)
    s.mul_(b64).add_(c.double())  # in place: the tile-sized fp64 buffers are the cost of this function
    y = s.float()
    if y.numel() == 0:
        return y
    # a midpoint's low 32-bit word has 10...0 in its 29 low bits, i.e. is INT32_MIN once shifted left by
    # 3; testing the high words too (int32 is cheaper than int64 here) can only send an entry to the
    # exact path needlessly
    if (s.view(torch.int32).bitwise_left_shift_(3).min() == _INT32_MIN
            or y.view(torch.int32).bitwise_and(_F32_EXPONENT).min() == 0):
        s = a.double() * b64 + c.double()
        doubt = ((s.view(torch.int64) & _BELOW_F32) == _F32_MIDPOINT) | ((y.view(torch.int32) & _F32_EXPONENT) == 0)
        a, b64, c = (torch.broadcast_to(t, s.shape)[doubt] for t in (a, b64, c))
        y[doubt] = _fma_f32_round_to_odd(a, b64, c)
    return y


def _fma_f32_round_to_odd(a: torch.Tensor, b64: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """:func:`fma_f32` for every entry: the fp64 sum rounded *to odd* (the TwoSum error term says whether it
    was exact; if not and its last bit is even, it steps one ulp toward the error), which rounds to fp32
    as the exact value does, since 53 >= 24 + 2 (Boldo and Melquiond, 2008)."""
    p = a.double() * b64
    c64 = c.double()
    s = p + c64
    bp = s - p
    err = (p - (s - bp)) + (c64 - bp)  # TwoSum: s + err == p + c exactly (s finite)
    inexact_even = (err != 0) & ((s.view(torch.int64) & 1) == 0) & torch.isfinite(s)
    s = torch.where(inexact_even, torch.nextafter(s, err * math.inf), s)  # toward the error's sign
    return s.float()


def grouped(x: torch.Tensor, p: Problem) -> torch.Tensor:
    return x.view(p.B, p.Hkv, p.G, p.Nq, x.shape[-1])


def sink_logits2(sinks: torch.Tensor | None, p: Problem) -> torch.Tensor | None:
    """The learned sinks in base-2 units, ``[1, Hkv, G, 1]`` fp32 (``fl(sink * LOG2E)``, as the kernels form
    them), or None."""
    if sinks is None:
        return None
    return (sinks.float() * rules.LOG2E).view(1, p.Hkv, p.G, 1)


def sink_state(sink2: torch.Tensor | None, row: tuple[int, ...], device) -> tuple[torch.Tensor, ...]:
    """The row state ``(m, r, l)`` a walk starts from: the initial state (``m = -inf``, ``r = -FP32_MAX``,
    ``l = 0``), or, with a sink, the state after the sink's own one-key block: the rule sees one entry there, so
    no tie can fire and every mode sets the offset ``r = sink2`` and ``l = exp2(0) = 1`` (a ``-inf`` sink leaves
    ``r`` at ``-FP32_MAX`` and adds 0: the state without a sink, bit for bit). ``m`` stays the keys' running max
    (``-inf``): the sink multiplies no value, so it is no key of the statistics nor of the "sees a key" test,
    and the accumulator starts at 0 either way (docs/ALGORITHM.md, "Learned sinks")."""
    m = torch.full(row, -math.inf, device=device)
    if sink2 is None:
        return m, torch.full(row, -rules.FP32_MAX, device=device), torch.zeros(row, device=device)
    r = sink2.expand(row).clamp(min=-rules.FP32_MAX)
    return m, r, torch.exp2(sink2 - r)


class Walk:
    """The row state after an online-softmax walk over some key blocks (:func:`walk_blocks`): the keys' running
    max ``m``, offset ``r`` (at least the sink's logit), row sum ``l`` (the sink's weight included), fp32
    accumulator ``acc`` ``[B, Hkv, G * cq, Dv]`` and the statistics' state (None without statistics)."""

    def __init__(self, **state):
        self.__dict__.update(state)


def walk_blocks(p: Problem, q_c, k, v, q0: int, q1: int, blocks, with_stats: int = False,
                sink2: torch.Tensor | None = None) -> Walk:
    """The online softmax with the rule (docs/ALGORITHM.md, forward steps 1-8) of the query rows ``[q0, q1)``
    (``q_c``: their fp32 ``[B, Hkv, G * cq, D]``) over the key ``blocks`` (``(j0, j1)`` in increasing order,
    aligned on the partition), from the initial state (``m = -inf``, ``r = -FP32_MAX``, ``l = 0``), or with
    ``sink2`` (:func:`sink_logits2`) from the state after the sink's block (:func:`sink_state`). The training
    forward walks every visible block of the partition once; the decode mirror (reference_decode.py) walks
    each split's blocks from the initial state (the sink joins the first split only)."""
    opts = p.opts
    B, Hkv, G = p.B, p.Hkv, p.G
    dtype = p.dtype
    tie2, min_shift2, max_shift2 = rules.rule_constants(dtype, opts.mode)
    neg_inf = -math.inf
    fused, c = p.fused_scale, opts.qk_scale2
    entropy_on = with_stats == STATS_ENTROPY
    cq = q1 - q0
    row = (B, Hkv, G, cq)
    # m: the true running max; r: the offset subtracted before exp2, -FP32_MAX before the row's first key
    # (below every finite score), so no inf - inf arises below (the kernel's fwd_program starts there too)
    m, r, l = sink_state(sink2, row, q_c.device)
    acc = torch.zeros(B, Hkv, G * cq, p.Dv, device=q_c.device)
    fixed = torch.zeros(row, dtype=torch.int32, device=q_c.device) if with_stats else None
    m2 = torch.full(row, neg_inf, device=q_c.device) if with_stats else None  # running second-largest score
    # sums of P-bar_j * (s2_j - r) and of P-bar_j over the keys seen (entropy, ALGORITHM.md "Statistics")
    # (the sink, t = 0 against its own offset, adds 0 to the first and its P-bar, l, to the second)
    ent = torch.zeros(row, device=q_c.device) if entropy_on else None
    ent_l = l.clone() if entropy_on else None
    s_first = torch.full(row, neg_inf, device=q_c.device)

    for j0, j1 in blocks:
        # upcast per block: full fp32 copies of k and v would double the path's memory
        k_b, v_b = k[:, :, j0:j1].float(), v[:, :, j0:j1].float()
        # fused: s holds x = q.k, its maxima are scaled after (monotone rounding, qk_scale2 > 0:
        # the bits of the maxima of the scaled scores); else s holds the base-2 scores s2
        s, _ = p.scores(q_c, k_b, q0, q1, j0, j1, scaled=not fused)
        if j0 == 0:
            s_first = s[..., 0] * c if fused else s[..., 0]
        m_blk, m2_blk = row_top2(s)
        if fused:
            m_blk, m2_blk = m_blk * c, m2_blk * c
        m_new = torch.maximum(m, m_blk)
        r_new, fire = block_offset(r, m_new, m_blk, m2_blk, tie2, min_shift2, max_shift2, opts.beta,
                                   opts.mode)

        if with_stats:
            # the keys' running second-largest score, merged with the block's top two: two keys lie
            # within the tie tolerance of the true max iff it does (ALGORITHM.md, "Statistics")
            m2 = torch.maximum(torch.minimum(m, m_blk), torch.maximum(m2, m2_blk))
            fixed += fire.to(torch.int32)

        alpha = torch.exp2(r - r_new)  # 0 (or 1 on zeros) while no key was seen
        # P-bar = exp2(x * c - r) rounded once where fused (the kernel's tl.fma), else exp2(fl(s2 - r))
        t = fma_f32(s, c, -r_new[..., None]) if fused else s - r_new[..., None]  # log2 of P-bar, unrounded
        p_bar = torch.exp2(t)
        # the rounding point the paper is about: P-bar is cast to the input dtype before P-bar V
        # (pv_fp32: the comparison variant that keeps P-bar in fp32 for the product, options.Options)
        p_cast = p_bar if opts.pv_fp32 else p_bar.to(dtype).float()
        if entropy_on:
            # the entropy of softmax itself: fp32 P-bar over its own sum ent_l (triton_forward.fwd_weights
            # says why not l); moving the offset from r to r_new adds (r - r_new) to every earlier t, and
            # alpha scales their P-bar; masked keys (t = -inf, P-bar = 0) add 0, not 0 * inf
            ent = alpha * (ent + (r - r_new) * ent_l) + (p_bar * t.clamp(min=-rules.FP32_MAX)).sum(-1)
            ent_l = ent_l * alpha + p_bar.sum(-1)
        # our rule: the row sum adds exactly the weights that multiply V (consistent
        # normalisation); FA2 and the paper sum the unrounded P-bar (ALGORITHM.md, step 6)
        l_blk = (p_cast if opts.mode == rules.MODE_EXACT else p_bar).sum(-1)
        if opts.mode == rules.MODE_PAPER:  # the published floor, in blocks where the row sees a key
            l_blk = torch.where(m_blk > neg_inf, l_blk.clamp(min=rules.PAPER_ROW_SUM_FLOOR), l_blk)
        l = l * alpha + l_blk
        if opts.dropout_p > 0:  # 0/1 keep mask is exact; the 1/(1-p) scale is applied once at the end
            p_cast = torch.where(p.dropout_keep(q0, q1, j0, j1, q_c.device), p_cast, torch.zeros_like(p_cast))
        p_cast = p_cast.view(B, Hkv, G * cq, j1 - j0)
        acc = acc * alpha.view(B, Hkv, G * cq, 1) + torch.matmul(p_cast, v_b)
        m, r = m_new, r_new
    return Walk(m=m, r=r, l=l, acc=acc, fixed=fixed, m2=m2, ent=ent, ent_l=ent_l, s_first=s_first)


def attention_forward(q, k, v, key_padding_mask=None, attn_mask=None, opts: Options = _DEFAULT_OPTIONS,
                      with_stats: int = False, sinks: torch.Tensor | None = None):
    """Forward pass. Returns ``(out, lse2, row_stats)``; ``row_stats`` is None unless requested
    (``with_stats``: a ``stats.STATS_*`` level; True collects the row statistics without the entropy).
    ``sinks``: ``[Hq]`` learned sink logits (natural units, like the scaled scores) or None; ``lse2`` then
    counts the sink."""
    p = Problem(q, k, v, key_padding_mask, attn_mask, opts)
    B, Hkv, G, Nq, D = p.B, p.Hkv, p.G, p.Nq, p.D
    dtype = q.dtype
    sat_tol2 = rules.sat_tolerance2(dtype)
    neg_inf = -math.inf
    sink2 = sink_logits2(sinks, p)

    qg = grouped(q, p)
    out = output_like(q, v)
    outg = grouped(out, p)
    lse2 = torch.empty(B, Hkv, G, Nq, dtype=torch.float32, device=q.device)
    entropy_on = with_stats == STATS_ENTROPY  # with_stats: a stats.STATS_* level (True: without the entropy)
    if with_stats:
        st = RowStats.empty((B, Hkv, G, Nq), q.device, entropy=entropy_on)

    for q0 in range(0, Nq, p.chunk):
        q1 = min(q0 + p.chunk, Nq)
        cq = q1 - q0
        q_c = qg[:, :, :, q0:q1].float().reshape(B, Hkv, G * cq, D)
        w = walk_blocks(p, q_c, k, v, q0, q1, p.key_blocks(q0, q1), with_stats, sink2)
        m, r, l, acc, fixed, m2, ent, ent_l = w.m, w.r, w.l, w.acc, w.fixed, w.m2, w.ent, w.ent_l

        # not ``m > -inf``: a NaN score (NaN in q or in a key the row sees) makes m NaN, and the row must
        # come out NaN, as on the kernel and in SDPA, not as a row that sees no key (zeros, lse = +inf); a
        # row that sees only its sink is a row that sees no key (m is the keys' max)
        seen = m != neg_inf
        o = acc.view(B, Hkv, G, cq, p.Dv) / (l[..., None] * (1.0 - opts.dropout_p))
        # a row that sees no key outputs zeros; every other row has l > 0 (paper mode: the floor)
        o = torch.where(seen[..., None], o, torch.zeros_like(o))
        outg[:, :, :, q0:q1] = o.to(dtype)
        lse = r + torch.log2(l)
        lse2[..., q0:q1] = torch.where(seen, lse, torch.full_like(lse, math.inf))
        if with_stats:
            # against the row max with the sink: two keys within the tolerance of a sink above them do not round
            # to 1.0
            top = m if sink2 is None else torch.maximum(m, sink2)
            st.saturated[..., q0:q1] = (m2 >= top - sat_tol2) & seen  # -inf >= -inf must not count
            st.fixed_blocks[..., q0:q1] = fixed
            st.max_logit[..., q0:q1] = m / rules.LOG2E
            st.sink_mass[..., q0:q1] = torch.exp2(w.s_first - lse2[..., q0:q1])
            if entropy_on:
                # H = ln 2 * (log2 L - ent / L) with L = ent_l: -sum_j (P-bar_j / L) log2(P-bar_j / L), in nats;
                # 0 where every P-bar underflowed (L = 0): only the published rule's unbounded offset does that
                entropy = (torch.log2(ent_l) - ent / ent_l) / rules.LOG2E
                st.entropy[..., q0:q1] = torch.where(seen & (ent_l > 0), entropy, torch.zeros_like(entropy))

    lse2 = lse2.view(B, p.Hq, Nq)
    row_stats = st.view(B, p.Hq, Nq) if with_stats else None
    return out, lse2, row_stats


def attention_backward(do, q, k, v, out, lse2, key_padding_mask=None, attn_mask=None,
                       opts: Options = _DEFAULT_OPTIONS):
    """FlashAttention-2 backward: recompute ``P`` per tile as the forward formed ``P-bar``, with ``lse2``
    for the offset: ``exp2(fma_f32(x, qk_scale2, -lse2))``, rounded once, where :attr:`Problem.fused_scale`,
    else ``exp2(s2 - lse2)``; returns dq, dk, dv. (With ``fl(x * qk_scale2)`` each key's exponent would
    move by up to half an ulp of a huge score against the forward's ``P-bar``.)

    With learned sinks nothing changes here: ``lse2`` counted the sink, so ``P`` is already the keys' share
    of the softmax with the sink, and ``delta = sum_j P_j dP_j`` has no sink term (its value, hence its
    ``dP``, is 0). The sinks' own gradient is :func:`sink_gradient`, on both backends.

    ``delta = rowsum(dO * O)`` replaces the softmax Jacobian's row term. ``P`` (for dV) and ``dS``
    (for dQ and dK) are cast to the input dtype before their products, as FA2 does; accumulation is
    fp32. The stabilization does not appear here: it changed only the offset, not ``O`` or ``lse``.
    """
    p = Problem(q, k, v, key_padding_mask, attn_mask, opts)
    B, Hkv, G, Nq, D = p.B, p.Hkv, p.G, p.Nq, p.D
    dtype = q.dtype
    keep_scale = opts.keep_scale
    fused, c = p.fused_scale, opts.qk_scale2

    qg, dog, og = grouped(q, p), grouped(do, p), grouped(out, p)
    lse2g = lse2.view(B, Hkv, G, Nq)
    # key blocks outside, query chunks inside: dK and dV need only a block-sized fp32 accumulator;
    # dQ is the one full-size fp32 accumulator (the memory budget in ALGORITHM.md)
    dq = torch.zeros(B, Hkv, G, Nq, D, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    chunks = [(q0, min(q0 + p.chunk, Nq)) for q0 in range(0, Nq, p.chunk)]
    delta = torch.empty(B, Hkv, G, Nq, device=q.device)
    for q0, q1 in chunks:  # by chunks: whole fp32 copies of dO and O would dominate the peak
        delta[..., q0:q1] = (dog[..., q0:q1, :].float() * og[..., q0:q1, :].float()).sum(-1)
    bn_max = opts.key_block

    for j0 in range(0, p.Nk, bn_max):
        j1 = min(j0 + bn_max, p.Nk)
        bn = j1 - j0
        k_b, v_b = k[:, :, j0:j1].float(), v[:, :, j0:j1].float()
        dk_b = torch.zeros(B, Hkv, bn, D, device=q.device)
        dv_b = torch.zeros(B, Hkv, bn, p.Dv, device=q.device)
        for q0, q1 in chunks:
            lo, hi = p.key_range(q0, q1)
            if j1 <= lo or j0 >= hi:
                continue  # the chunk sees no key of this block
            cq = q1 - q0
            q_c = qg[:, :, :, q0:q1].float().reshape(B, Hkv, G * cq, D)
            do_c = dog[:, :, :, q0:q1].float().reshape(B, Hkv, G * cq, p.Dv)
            s, t = p.scores(q_c, k_b, q0, q1, j0, j1, scaled=not fused)  # fused: s holds x = q.k
            lse_c = lse2g[..., q0:q1, None]
            prob = torch.exp2(fma_f32(s, c, -lse_c) if fused else s - lse_c)  # [B, Hkv, G, cq, bn]
            dp = torch.matmul(do_c, v_b.transpose(-1, -2)).view(B, Hkv, G, cq, bn)
            if opts.dropout_p > 0:
                keep = p.dropout_keep(q0, q1, j0, j1, q.device)
                prob_d = torch.where(keep, prob * keep_scale, torch.zeros_like(prob))
                dp = torch.where(keep, dp * keep_scale, torch.zeros_like(dp))
            else:
                prob_d = prob
            p_cast = prob_d.to(dtype).float().view(B, Hkv, G * cq, bn)
            dv_b += torch.matmul(p_cast.transpose(-1, -2), do_c)
            ds = prob * (dp - delta[..., q0:q1, None])
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds_cast = (ds * opts.scale).to(dtype).float().view(B, Hkv, G * cq, bn)
            dq[:, :, :, q0:q1] += torch.matmul(ds_cast, k_b).view(B, Hkv, G, cq, D)
            dk_b += torch.matmul(ds_cast.transpose(-1, -2), q_c)
        dk[:, :, j0:j1] = dk_b.to(dtype)
        dv[:, :, j0:j1] = dv_b.to(dtype)
    dq_out = torch.empty_like(q)  # q's strides: what the op's fake implementation promises
    dq_out.copy_(dq.view(q.shape))
    return dq_out, dk, dv


def row_delta(do: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dO * O)`` over the last dim in fp32, by chunks of rows (no full fp32 copy of ``dO`` or ``O``)."""
    rows = out.shape[:-1]
    do2, o2 = do.reshape(-1, do.shape[-1]), out.reshape(-1, out.shape[-1])
    delta = torch.empty(do2.shape[0], dtype=torch.float32, device=do.device)
    step = max(1, TILE_ELEMENTS // max(do2.shape[1], 1))
    for i in range(0, do2.shape[0], step):
        delta[i:i + step] = (do2[i:i + step].float() * o2[i:i + step].float()).sum(-1)
    return delta.view(rows)


def sink_gradient(sinks: torch.Tensor, lse2: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``d sinks`` ``[Hq]`` in ``sinks``' dtype, for both backends: the sink is a key whose value is 0, so its
    ``dP`` is 0 and its score gradient ``P_sink * (0 - delta)``, summed over the batch and the rows of its head,
    with ``P_sink = exp2(sink2 - lse2)``. ``lse2`` and ``delta`` (:func:`row_delta`) are ``[..., Hq, N]`` fp32; a
    row that sees no key has ``lse2 = +inf`` and gives its sink nothing (its output is 0, and so its delta)."""
    sink2 = (sinks.float() * rules.LOG2E).view(-1, 1)
    p_sink = torch.exp2(sink2 - lse2)
    return -(p_sink * delta).reshape(-1, *lse2.shape[-2:]).sum(dim=(0, 2)).to(sinks.dtype)
