"""Three arithmetic models of ``O = softmax(s) V`` for one query row, and the exact answer they are measured against.

Each model takes bf16-representable scores ``s`` ``[T, N]`` (already scaled: the softmax input) and
bf16 values ``v`` ``[T, N, D]``, one independent row per trial ``t``, and returns the bf16 output
``[T, D]`` (as float64) plus how many ``P-bar`` entries were exactly 1.0 (the paper's trigger).

- (a) :func:`kernel_model`: what our kernel computes. It calls :func:`stable_attn.attention`
  itself: ``P-bar`` in fp32, cast to bf16, ``P-bar V`` accumulated in fp32, ``O`` stored in bf16.
  The row sum ``l`` depends on the fix: ``"ours"`` sums the bf16-rounded ``P-bar`` (the weights
  that multiply ``V``; ALGORITHM.md, "Consistent normalisation"), ``"off"`` and ``"paper"`` sum the
  unrounded fp32 ``P-bar`` as FlashAttention-2 does.
- (b) :func:`blockwise_bf16_model`: the published reference implementation's arithmetic with bf16
  inputs (ucker/why-low-precision-training-fails, ``attention.py``): every tensor is bf16, so
  scores, ``exp``, the block row sums, the running max, ``O`` and the row sums are rounded to bf16
  after every operation, across key blocks. Its ``einsum`` for ``P-bar V`` is a bf16 matrix product:
  fp32 accumulation rounded to bf16 on output (``native_matmul=True`` calls the device's own bf16
  matmul instead, e.g. tensor cores on a GPU).
- (c) :func:`sequential_bf16_model`: ``P-bar`` as in (a), but ``P-bar V`` summed key by key with
  every product and every addition rounded to bf16 (round-to-nearest-even), in key order, over the
  whole row (one block). The row sum is float64 and the final division is rounded once to bf16,
  so the only bf16 roundings besides ``P-bar`` and the output are those of the ``P-bar V`` sum.

- (d) :func:`tensor_core_model`: our kernel's forward, key block by key block, with ``P-bar V`` (and
  the exact mode's tensor-core row sum) as a GPU's tensor cores compute them
  (:func:`stable_attn.numerics.tensor_core.mma`, ``model="a100"``/``"h100"``/``"b200"``/``"ieee"``).

``fix`` is ``"off"`` (plain safe softmax), ``"ours"`` (stable_attn's rule: exact trigger, minimum and
capped shift, rules.py) or ``"paper"`` (the published rule: 1e-3 window, ``beta*m`` or 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import rules
from ..attention import attention
from ..kernels import naive, reference
from ..options import BLOCK_N, FIX_NAMES, Options
from ..stats import AttentionStats
from . import tensor_core

FIXES = tuple(FIX_NAMES)
_BF16 = torch.bfloat16


@dataclass
class ModelOutput:
    """The bf16 output of one model as float64 ``[T, D]``, and its trigger diagnostics."""

    out: torch.Tensor
    # per row: the largest number of P-bar entries equal to 1.0 within one key block (None for (a),
    # whose P-bar is internal to the kernel)
    pbar_ones: torch.Tensor | None
    # key blocks per row where the stabilization shifted the offset (mean over rows)
    fired_rate: float
    # the key partition the model walked (tensor-core models; None where the kernel chose it itself)
    key_block: int | None = None
    # per row: the base-2 log-sum-exp ``r + log2(l)`` the kernel saves for its backward (+inf on rows that see
    # no key; tensor-core models only): what a training step needs to run the backward on this forward's O
    lse2: torch.Tensor | None = None


def _check(scores: torch.Tensor, values: torch.Tensor, fix: str) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores must be [T, N], got shape {tuple(scores.shape)}")
    if values.dim() != 3 or values.shape[:2] != scores.shape:
        raise ValueError(f"values must be [T, N, D] with [T, N] = {tuple(scores.shape)}, got {tuple(values.shape)}")
    if values.dtype != _BF16:
        raise TypeError(f"values.dtype={values.dtype}: the models take bfloat16 values")
    if fix not in FIXES:
        raise ValueError(f"fix={fix!r} is not supported; use one of {FIXES}")


def oracle(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``softmax(s) V`` in float64 from the same (bf16) inputs: the exact answer, ``[T, D]``.

    The score-level form of :func:`stable_attn.kernels.naive.attention` (same softmax, scores given).
    """
    return torch.einsum("tn,tnd->td", naive.probabilities(scores), values.double())


def kernel_model(scores: torch.Tensor, values: torch.Tensor, fix: str, block_n: int = BLOCK_N,
                 backend: str = "torch") -> ModelOutput:
    """(a) Our kernel, called through :func:`stable_attn.attention`.

    The scores are planted exactly: ``q = e_0`` and ``k_j = s_j e_0`` with ``scale=1`` make
    ``q . k_j = s_j`` with no rounding (one non-zero product of two bf16 numbers).
    """
    _check(scores, values, fix)
    T, N, D = values.shape
    dev = values.device
    q = torch.zeros(T, 1, 1, D, dtype=_BF16, device=dev)
    q[..., 0] = 1.0
    k = torch.zeros(T, 1, N, D, dtype=_BF16, device=dev)
    k[:, 0, :, 0] = scores.to(_BF16)
    stats = AttentionStats()
    out = attention(q, k, values[:, None], scale=1.0, stabilize=FIX_NAMES[fix], stats=stats, backend=backend,
                    block_n=block_n)
    return ModelOutput(out[:, 0, 0].double(), None, float(stats.fixed_rate.sum()))


def _ours_offset(m_new: torch.Tensor) -> torch.Tensor:
    """Our rule's shifted offset in natural units (rules.py works in base 2; the rule is linear)."""
    _, min2, max2 = rules.rule_constants(_BF16, rules.MODE_EXACT)
    return rules.shifted_offset(m_new * rules.LOG2E, 2.0, min2, max2) / rules.LOG2E


def _bf16_matmul(p: torch.Tensor, v: torch.Tensor, native: bool) -> torch.Tensor:
    """``[T, n] @ [T, n, D]`` -> ``[T, D]`` bf16: a bf16 GEMM (fp32 accumulator, bf16 output).

    ``native``: the device's own bf16 batched matmul. One row per trial would be a matrix-vector
    product, which cuBLAS serves without tensor cores; padding each trial to 16 rows (zeros below
    the real one, which change nothing in it) makes it a GEMM tile, the shape flash attention uses.
    """
    if native:
        padded = torch.zeros(p.shape[0], 16, p.shape[1], dtype=p.dtype, device=p.device)
        padded[:, 0] = p
        return torch.matmul(padded, v)[:, 0]
    return torch.einsum("tn,tnd->td", p.float(), v.float()).to(_BF16)


def blockwise_bf16_model(scores: torch.Tensor, values: torch.Tensor, fix: str, block_n: int = BLOCK_N,
                         native_matmul: bool = False) -> ModelOutput:
    """(b) The published implementation's all-bf16 FlashAttention-2 forward (our own emulation).

    State kept in bf16 across key blocks, as there: the output ``o``, the row sums ``l`` and the
    running offset ``r`` (their "row max", which the published rule replaces by ``2m`` or 0). For
    ``fix="ours"`` the same bf16 arithmetic runs with stable_attn's offset (decided in fp32 on the
    bf16 scores, the offset itself then stored in bf16 like any other state).
    """
    _check(scores, values, fix)
    T, N, D = values.shape
    dev = values.device
    s_all = scores.to(_BF16)
    big = torch.finfo(_BF16).max
    r = torch.full((T, 1), -big, dtype=_BF16, device=dev)  # their initial "max" is -finfo.max, not -inf
    m_true = torch.full((T, 1), -float("inf"), device=dev)  # only our rule needs the true max
    l = torch.zeros(T, 1, dtype=_BF16, device=dev)
    o = torch.zeros(T, D, dtype=_BF16, device=dev)
    ones = torch.zeros(T, dtype=torch.int64, device=dev)
    fired = torch.zeros(T, device=dev)
    tie_ours = rules.tie_tolerance(_BF16)
    for j0 in range(0, N, block_n):
        s = s_all[:, j0:j0 + block_n]
        m_blk = s.amax(dim=-1, keepdim=True)
        if fix == "paper":
            # bf16 arithmetic as published: the window m - 1e-3 is itself rounded to bf16
            ties = (s >= m_blk - 1e-3).sum(dim=-1, keepdim=True) > 1
            m_adj = torch.where(ties & (m_blk > 0), 2.0 * m_blk, m_blk)
            m_adj = torch.where(ties & (m_adj < 0), torch.zeros_like(m_adj), m_adj)
            fired += (ties & (m_blk != 0)).squeeze(-1).double()
            r_new = torch.maximum(m_adj, r)
        elif fix == "ours":
            sf, rf = s.float(), r.float()
            m_true = torch.maximum(m_true, m_blk.float())
            r_cand = torch.maximum(rf, m_blk.float())
            fire = (sf >= r_cand - tie_ours).sum(dim=-1, keepdim=True) >= 2
            r_new = torch.where(fire, _ours_offset(m_true), r_cand).to(_BF16)
            fired += fire.squeeze(-1).double()
        else:
            r_new = torch.maximum(m_blk, r)
        p = torch.exp(s - r_new)  # bf16 subtraction, bf16 exp
        ones = torch.maximum(ones, (p == 1.0).sum(dim=-1))
        l_blk = p.float().sum(dim=-1, keepdim=True).to(_BF16).clamp(min=1e-10)
        pv = _bf16_matmul(p, values[:, j0:j0 + block_n], native_matmul)
        alpha = torch.exp(r - r_new)
        l = alpha * l + l_blk  # two bf16 roundings, as in the published update
        o = o * alpha + pv  # likewise: O lives in bf16 between blocks
        r = r_new
    o = o / l
    return ModelOutput(o.double(), ones, fired.mean().item())


def _row_offset(s: torch.Tensor, fix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The offset a single-block kernel subtracts under ``fix``, and whether the rule fired."""
    m = s.amax(dim=-1, keepdim=True)
    if fix == "off":
        return m, torch.zeros_like(m, dtype=torch.bool)
    if fix == "paper":
        fire = (s >= m - rules.PAPER_TIE_WINDOW).sum(dim=-1, keepdim=True) > 1
        shifted = torch.where(m > 0, 2.0 * m, torch.zeros_like(m))
        fire = fire & (m != 0)
        return torch.where(fire, shifted, m), fire
    fire = (s >= m - rules.tie_tolerance(_BF16)).sum(dim=-1, keepdim=True) >= 2
    return torch.where(fire, _ours_offset(m), m), fire


def sequential_bf16_model(scores: torch.Tensor, values: torch.Tensor, fix: str) -> ModelOutput:
    """(c) ``P-bar V`` with every product and every addition rounded to bf16, key by key."""
    _check(scores, values, fix)
    T, N, D = values.shape
    s = scores.float()
    r, fire = _row_offset(s, fix)
    p32 = torch.exp(s - r)
    p = p32.to(_BF16)  # the same rounding point as our kernel
    acc = torch.zeros(T, D, dtype=_BF16, device=values.device)
    for j in range(N):
        # bf16 x bf16 is exact in fp32 and bf16 + bf16 never double-rounds through fp32, so each
        # torch bf16 op here is one correctly rounded (nearest-even) bf16 operation
        acc = acc + p[:, j:j + 1] * values[:, j]
    o = (acc.double() / p32.double().sum(dim=-1, keepdim=True)).to(_BF16)
    return ModelOutput(o.double(), (p == 1.0).sum(dim=-1), fire.double().mean().item())


def rounded_rowsum_model(scores: torch.Tensor, values: torch.Tensor, fix: str) -> ModelOutput:
    """(a') Model (a) with the row sum taken over the bf16-rounded ``P-bar``, for every fix (one key block).

    Written when the kernel still summed the fp32 ``P-bar`` into ``l`` while multiplying ``V`` by
    the bf16-rounded ``P-bar`` (as FlashAttention-2 does), so that the weights it applied did not sum
    to exactly 1; this variant measured what normalising by the rounded weights would change. The
    kernel's ``stabilize=True`` now does this blockwise, so for ``fix="ours"`` this is a one-block
    cross-check of (a); for ``"off"`` and ``"paper"`` (which keep the fp32 row sum in the kernel) it
    still shows what consistent normalisation would do for them.
    ``P-bar V`` is accumulated in float64 here (the kernel: fp32; the order of the sums is not what
    matters).
    """
    _check(scores, values, fix)
    s = scores.float()
    r, fire = _row_offset(s, fix)
    p = torch.exp(s - r).to(_BF16)
    num = torch.einsum("tn,tnd->td", p.double(), values.double())
    o = (num / p.double().sum(dim=-1, keepdim=True)).to(_BF16)
    return ModelOutput(o.double(), (p == 1.0).sum(dim=-1), fire.double().mean().item())


TC_K_CHUNK = 16  # K of one bf16 MMA instruction (mma.sync m16n8k16 on A100, wgmma k16 on H100)

# The lab's rule constants for P-bar cast to fp8 E4M3 (the FP8 study; the product has no fp8 path, so
# rules.py has none). The trigger is the exact one of rules.tie_tolerance for E4M3's 3 stored bits:
# P-bar rounds to 1.0 iff s - r >= log(1 - 2^-5). The shift is floored as in bf16 (MIN_SHIFT) and
# capped at 2 nats like fp16's, since E4M3's smallest normal, 2^-6 = e^-4.2, is nearer still.
FP8_STORED_BITS = 3
FP8_MAX_SHIFT = 2.0


def rule_constants(dtype: torch.dtype, mode: int) -> tuple[float, float, float]:
    """``(tie2, min_shift2, max_shift2)`` for ``P-bar`` cast to ``dtype``: rules.py's, and the lab's for E4M3."""
    if dtype != torch.float8_e4m3fn or mode == rules.MODE_PAPER:
        return rules.rule_constants(torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype, mode)
    tie = -math.log1p(-(2.0 ** -(FP8_STORED_BITS + 2)))
    return tie * rules.LOG2E, rules.MIN_SHIFT * rules.LOG2E, FP8_MAX_SHIFT * rules.LOG2E


def tensor_core_forward(x: torch.Tensor, values: torch.Tensor, fix: str, *, qk_scale2: float,
                        model: str = "h100", block_n: int = BLOCK_N, k_chunk: int = TC_K_CHUNK,
                        group: torch.Tensor | None = None, beta: float = 2.0,
                        out_dtype: torch.dtype = _BF16) -> ModelOutput:
    """Our kernel's forward for independent query rows with ``P-bar V`` on a model of tensor cores.

    ``x`` ``[T, N]`` fp32: the products ``q.k`` of each row with every key, unscaled, keys the row does
    not see ``-inf`` (as the kernel's ``scores_tile`` masks them); ``values`` ``[G, N, D]`` (bf16, fp16 or
    fp8 E4M3: ``P-bar`` is cast to this dtype before the product, as the kernel casts it to the input
    dtype); ``group`` ``[T]``: which of the ``G`` value sets row ``t`` reads (None: ``G = T``, row ``t``
    reads ``values[t]``). Per key block, as ``triton_forward.fwd_decide``/``fwd_weights``/``fwd_pv`` (and
    ``reference.attention_forward``, whose helper functions this reuses) run it: the running max and
    the offset ``r`` of the rule (``reference.block_offset``), ``alpha = exp2(r - r_new)``,
    ``P-bar = exp2(fma(x, qk_scale2, -r_new))`` in fp32, rounded to nearest even in ``values.dtype``, then
    ``acc = tl.dot(P-bar, V, acc * alpha)``: the fp32 accumulator, rescaled by ``alpha`` (one fp32
    rounding), is the ``C`` of the first MMA instruction, and the block's keys run through instructions
    of ``k_chunk`` keys, each one's ``D`` the next one's ``C``; each instruction is
    :func:`tensor_core.mma` under ``model`` (which splits it into its fused blocks). For ``fix="ours"``
    the row sum is ``tl.dot(P-bar, 1, l * alpha)`` on the tensor cores too (``tensor_core_row_sum``:
    head dim <= 128; one chain per block here, where the sm_90 kernel sums each half of the block's keys
    into its own accumulator and adds the two after the loop, ``triton_launch.row_sum_parts``: the same
    rounded P-bar in another fp32 order, not modelled), else ``l * alpha + sum(P-bar)`` in fp32 (the
    unrounded P-bar for ``"off"`` and ``"paper"``, with the paper's floor). ``O = acc / l``, stored in ``out_dtype``.

    A row that sees no key of a block keeps its state bit for bit (``r_new = r``, ``alpha = 1``, zero
    products), so such rows skip the block here, as the kernel skips blocks no row of its tile sees.
    ``model="fp32_matmul"`` replaces the MMA by ``acc * alpha + P-bar @ V`` in fp32 and the row sum by
    an fp32 sum: the PyTorch path's arithmetic (the cross-check against :func:`kernel_model`).
    The result carries ``lse2 = r + log2(l)`` per row, as ``reference.attention_forward`` saves it.
    """
    if model != "fp32_matmul" and model not in tensor_core.MODELS:
        raise ValueError(f"model={model!r}; accepted values: {(*tensor_core.MODELS, 'fp32_matmul')}")
    if fix not in FIXES:
        raise ValueError(f"fix={fix!r} is not supported; use one of {FIXES}")
    if k_chunk < 1 or block_n < 1:
        raise ValueError(f"k_chunk={k_chunk} and block_n={block_n} must be >= 1")
    T, N = x.shape
    D = values.shape[-1]
    x, values = x.cpu().float(), values.cpu()
    dtype = values.dtype
    mode = options_mode(fix)
    tie2, min_shift2, max_shift2 = rule_constants(dtype, mode)
    m = torch.full((T,), -float("inf"))
    r = torch.full((T,), -rules.FP32_MAX)
    l = torch.zeros(T)
    acc = torch.zeros(T, D)
    ones = torch.zeros(T, dtype=torch.int64)
    fired = torch.zeros(T)
    tc_row_sum = mode == rules.MODE_EXACT and D <= 128 and model != "fp32_matmul"
    for j0 in range(0, N, block_n):
        s = x[:, j0:j0 + block_n]
        n = s.shape[1]
        m_blk, m2_blk = reference.row_top2(s)
        m_blk, m2_blk = m_blk * qk_scale2, m2_blk * qk_scale2
        live = m_blk > -float("inf")
        if not bool(live.any()):
            continue
        rows = None if bool(live.all()) else live.nonzero()[:, 0]
        m_i, r_i, l_i, acc_i, m_blk, m2_blk, s = (t if rows is None else t[rows]
                                                  for t in (m, r, l, acc, m_blk, m2_blk, s))
        m_new = torch.maximum(m_i, m_blk)
        r_new, fire = reference.block_offset(r_i, m_new, m_blk, m2_blk, tie2, min_shift2, max_shift2, beta, mode)
        alpha = torch.exp2(r_i - r_new)
        p_bar = torch.exp2(reference.fma_f32(s, qk_scale2, -r_new[:, None]))
        p_cast = p_bar.to(dtype)
        g = torch.arange(T) if group is None else group
        v = values[g if rows is None else g[rows], j0:j0 + n]
        if tc_row_sum:
            l_i = _tc_chain(p_cast[:, None, :], torch.ones(p_cast.shape[0], n, 1, dtype=dtype),
                            (l_i * alpha)[:, None, None], model, k_chunk)[:, 0, 0]
        else:
            l_blk = (p_cast.float() if mode == rules.MODE_EXACT else p_bar).sum(-1)
            if mode == rules.MODE_PAPER:
                l_blk = l_blk.clamp(min=rules.PAPER_ROW_SUM_FLOOR)  # every row here sees a key of the block
            l_i = l_i * alpha + l_blk
        c_acc = acc_i * alpha[:, None]
        if model == "fp32_matmul":
            acc_i = c_acc + torch.matmul(p_cast.float()[:, None, :], v.float())[:, 0]
        else:
            acc_i = _tc_chain(p_cast[:, None, :], v, c_acc[:, None, :], model, k_chunk)[:, 0]
        block_ones = (p_cast == 1.0).sum(dim=-1)
        if rows is None:
            m, r, l, acc = m_new, r_new, l_i, acc_i
            ones = torch.maximum(ones, block_ones)
            fired += fire.double()
        else:
            m[rows], r[rows], l[rows], acc[rows] = m_new, r_new, l_i, acc_i
            ones[rows] = torch.maximum(ones[rows], block_ones)
            fired[rows] += fire.double()
    seen = m > -float("inf")
    o = torch.where(seen[:, None], acc / l[:, None], torch.zeros_like(acc)).to(out_dtype)
    lse2 = torch.where(seen, r + torch.log2(l), torch.full_like(l, math.inf))
    return ModelOutput(o.double(), ones, fired.mean().item(), block_n, lse2)


def tensor_core_model(scores: torch.Tensor, values: torch.Tensor, fix: str, block_n: int = BLOCK_N,
                      model: str = "h100", k_chunk: int = TC_K_CHUNK,
                      pbar_dtype: torch.dtype = _BF16) -> ModelOutput:
    """(d) Our kernel's forward with ``P-bar V`` on a model of a GPU's tensor cores, one query row per trial.

    The scores are planted as in :func:`kernel_model` (``x = q.k = s``, ``scale = 1``) and the rows run
    through :func:`tensor_core_forward`. ``pbar_dtype=torch.float8_e4m3fn``: ``P-bar`` and ``V`` are cast
    to E4M3 for the product (as FP8 attention kernels do) and the products run on ``model``'s fp8 path;
    ``O`` stays bf16. The error is then measured against the oracle on the E4M3 values
    (:func:`fp8_values`), so only ``P-bar``'s rounding and the accumulation count as error.
    """
    _check(scores, values, fix)
    if pbar_dtype not in (_BF16, torch.float8_e4m3fn):
        raise ValueError(f"pbar_dtype={pbar_dtype}; accepted values: (torch.bfloat16, torch.float8_e4m3fn)")
    v = values if pbar_dtype == _BF16 else fp8_values(values).to(pbar_dtype)
    return tensor_core_forward(scores, v, fix, qk_scale2=1.0 * rules.LOG2E, model=model, block_n=block_n,
                               k_chunk=k_chunk)


def kernel_key_block(model: str, fix: str, dtype: torch.dtype, head_dim: int, plain: bool) -> int:
    """The key partition the Triton forward walks on ``model``'s GPU (``triton_launch.fwd_config``).

    Where a rule or a statistic sees the partition, the partition (``options.BLOCK_N``, 128 keys); with
    stabilize off and no statistics the tile the kernel takes (128 keys on sm_90's plain variants, 64 on
    sm_80 and with the optional features). ``"ieee"`` (no GPU), or without Triton installed: the partition.
    """
    cc = {"a100": 80, "h100": 90}.get(model)
    if cc is None:
        return BLOCK_N
    try:
        from ..kernels.triton_launch import fwd_config, head_block
    except ImportError:
        return BLOCK_N
    cfg = fwd_config(head_block(head_dim), BLOCK_N, dtype, cc, mode=options_mode(fix), stats=False, plain=plain)
    return cfg.block_n or BLOCK_N


def tensor_core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                          fixes: Sequence[str] = FIXES, *, model: str = "h100", causal: bool = False,
                          scale: float | None = None, key_padding_mask: torch.Tensor | None = None,
                          attn_mask: torch.Tensor | None = None, window: int | None = None,
                          softcap: float | None = None, block_n: int | None = None,
                          k_chunk: int = TC_K_CHUNK) -> dict[str, ModelOutput]:
    """Our kernel's forward for some query rows of one attention call, every product on tensor cores.

    ``q`` ``[B, Hq, Nq, D]``, ``k``/``v`` ``[B, Hkv, Nk, D]`` (bf16 or fp16; GQA as in
    :func:`stable_attn.attention`), masks as there; ``rows`` ``[R, 3]`` int64 ``(b, query head, query
    position)``: the rows to compute (the emulation costs ~``2 Nk D`` multiply-adds a row). The scores
    ``x = q.k`` are ``tl.dot(q, k^T)``: a chain of ``k_chunk``-wide MMA instructions over the head dim
    from ``C = 0``; keys a row does not see are ``-inf`` (:func:`stable_attn.kernels.naive.visibility`
    and a boolean ``attn_mask``); then :func:`tensor_core_forward` on the key partition of
    :func:`kernel_key_block` (or ``block_n``), once per fix of ``fixes`` on the same scores. Returns
    ``{fix: ModelOutput}`` with ``O`` ``[R, D]`` (as float64). Softcap and additive masks are not
    modelled (their scores are not ``x * qk_scale2``).
    """
    if softcap is not None or (attn_mask is not None and attn_mask.dtype != torch.bool):
        raise ValueError("softcap and additive (float) attn_mask are not modelled by the tensor-core forward; "
                         f"got softcap={softcap!r}, attn_mask dtype {None if attn_mask is None else attn_mask.dtype}")
    if q.dtype not in (_BF16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype of (torch.bfloat16, torch.float16); got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if rows.dim() != 2 or rows.shape[1] != 3:
        raise ValueError(f"rows must be [R, 3] (batch, query head, query position), got {tuple(rows.shape)}")
    bad = [f for f in fixes if f not in FIXES]
    if bad or not fixes:
        raise ValueError(f"fixes={list(fixes)!r}: use a non-empty subset of {list(FIXES)}")
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q, k, v, rows = q.cpu(), k.cpu(), v.cpu(), rows.cpu()
    b, h, i = rows.unbind(1)
    vis = naive.visibility(Nq, Nk, causal=causal, window=window, key_padding_mask=key_padding_mask)
    seen = vis[b if vis.shape[0] > 1 else torch.zeros_like(b), 0, i]
    if attn_mask is not None:
        am = attn_mask.cpu().reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        seen = seen & am.expand(B, Hq, Nq, Nk)[b, h, i]
    group = b * Hkv + h // G
    x = torch.empty(rows.shape[0], Nk)
    for g in torch.unique(group).tolist():
        sel = (group == g).nonzero()[:, 0]
        qs = q[b[sel], h[sel], i[sel]]  # [M, D]
        kt = k[g // Hkv, g % Hkv].transpose(0, 1)  # [D, Nk]
        if model == "fp32_matmul":
            x[sel] = qs.float() @ kt.float()
        else:
            x[sel] = _tc_chain(qs, kt, torch.zeros(qs.shape[0], Nk), model, k_chunk)
    x = x.masked_fill(~seen, -float("inf"))
    plain = window is None and key_padding_mask is None
    out = {}
    for fix in fixes:
        opts = Options.create(head_dim=D, causal=causal, scale=scale, window=window, stabilize=FIX_NAMES[fix])
        bn = block_n or kernel_key_block(model, fix, q.dtype, D, plain)
        out[fix] = tensor_core_forward(x, v.reshape(B * Hkv, Nk, D), fix, qk_scale2=opts.qk_scale2, model=model,
                                       block_n=bn, k_chunk=k_chunk, group=group, beta=opts.beta, out_dtype=q.dtype)
    return out


def fp8_values(values: torch.Tensor) -> torch.Tensor:
    """``values`` rounded to E4M3 (nearest even; |v| < 448 here) and held in bf16: the FP8 study's ``V``."""
    return values.to(torch.float8_e4m3fn).to(_BF16)


def _tc_chain(p: torch.Tensor, v: torch.Tensor, c: torch.Tensor, model: str, k_chunk: int) -> torch.Tensor:
    """``tl.dot(p, v, c)`` as a chain of MMA instructions of ``k_chunk`` keys (batched over trials)."""
    d = c
    for k0 in range(0, p.shape[-1], k_chunk):
        d = tensor_core.mma(p[..., k0:k0 + k_chunk], v[..., k0:k0 + k_chunk, :], d, model=model)
    return d


def options_mode(fix: str) -> int:
    """``rules.MODE_*`` of a lab ``fix`` name."""
    return {"off": rules.MODE_OFF, "ours": rules.MODE_EXACT, "paper": rules.MODE_PAPER}[fix]


MODELS = {
    "a_kernel": kernel_model,
    "b_blockwise_bf16": blockwise_bf16_model,
    "c_sequential_bf16": sequential_bf16_model,
    "a_rounded_rowsum": rounded_rowsum_model,
    "d_tensor_core_a100": lambda s, v, fix: tensor_core_model(s, v, fix, model="a100"),
    "d_tensor_core_h100": lambda s, v, fix: tensor_core_model(s, v, fix, model="h100"),
}
