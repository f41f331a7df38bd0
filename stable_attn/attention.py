"""``stable_attn.attention``: the dense op, its backend dispatch and its torch.library registration.

The op is registered as ``stable_attn::attention_fwd`` / ``stable_attn::attention_bwd`` by
:func:`stable_attn._ops.define` (fake implementation, autograd formula, the glue it shares with the
varlen op); its scalar arguments are the fields of :class:`stable_attn.options.Options`, by name. The
options are checked in options.py, the tensors in _checks.py (:func:`stable_attn._checks.dense_problem`).
"""

from __future__ import annotations

import logging

import torch

from . import _ops, call_cache
from ._checks import (
    Problem,
    both_layouts_fit,
    dense_problem,
    layout_doubt,
    layout_problem,
    raise_problem,
    unit_last_stride,
)
from ._ops import autocast_inputs, check_stats, draw_seed, resolve_backend
from .kernels import reference, reference_decode
from .kernels.decode_plan import takes_decode
from .options import DEFAULTS, Options, Stabilize
from .stats import AttentionStats, RowStats


def _decode(q, k, attn_mask, opts: Options, with_stats: int) -> bool:
    """Whether this forward takes the decode path (split keys; kernels/decode_plan.py lists the cases: no
    gradient needed, Nq <= 16 against at least two key blocks, no attn_mask, no dropout, no statistics), on
    either backend: the PyTorch path mirrors the decode kernel's decisions, so both give the same ones."""
    return takes_decode(q.shape[2], k.shape[2], opts.key_block, forward_only=opts.forward_only,
                        has_attn_mask=attn_mask is not None, dropout_p=opts.dropout_p, with_stats=with_stats)


def _forward(q, k, v, sinks, key_padding_mask, attn_mask, opts: Options, with_stats: int,
             ) -> tuple[torch.Tensor, torch.Tensor, RowStats | None]:
    # resolve_backend sent what the kernels lack (float32 K and V tiles too large for them) to the PyTorch path
    if _decode(q, k, attn_mask, opts, with_stats):
        if opts.backend == "triton":
            from .kernels import triton_decode

            return triton_decode.forward(q, k, v, key_padding_mask, opts, sinks=sinks)
        return reference_decode.attention_forward(q, k, v, key_padding_mask, opts, sinks=sinks)
    if opts.backend == "triton":
        from .kernels import triton_attention

        return triton_attention.forward(q, k, v, key_padding_mask, opts, with_stats, sinks=sinks)
    return reference.attention_forward(q, k, v, key_padding_mask, attn_mask, opts, with_stats, sinks)


def _backward(do, q, k, v, sinks, out, lse, key_padding_mask, attn_mask, opts: Options):
    if opts.backend == "triton":
        from .kernels import triton_attention

        dq, dk, dv = triton_attention.backward(do, q, k, v, out, lse, key_padding_mask, opts)
    else:
        dq, dk, dv = reference.attention_backward(do, q, k, v, out, lse, key_padding_mask, attn_mask, opts)
    dsinks = None if sinks is None else reference.sink_gradient(sinks, lse, reference.row_delta(do, out))
    return dq, dk, dv, dsinks


_attention_fwd, _attention_bwd = _ops.define(
    "attention", "Tensor? key_padding_mask, Tensor? attn_mask", _forward, _backward,
    rows=lambda q: (q.shape[:3], q.shape[:3]),
)


# What the wrong-layout check does with a doubt (set_layout_check): one process-wide mode
LAYOUT_CHECKS = ("warn", "error", "off")
_layout_check = ["warn"]


def set_layout_check(mode: str) -> str:
    """How :func:`attention` (called without ``layout=``) and :func:`stable_attn.flash_attn_func` treat inputs whose
    shapes look like the other layout (:func:`stable_attn._checks.layout_doubt`): ``"warn"`` (the default: one
    WARNING per shape), ``"error"`` (strict: a ValueError; and an :func:`attention` call without ``layout=`` whose
    shapes fit both layouts, which no shape rule can tell apart, must then say its layout) or ``"off"``. Returns
    the previous mode. Calls that pass ``layout=`` are never checked: they said what their tensors are."""
    if mode not in LAYOUT_CHECKS:
        raise ValueError(f"mode={mode!r} is not supported; use one of {', '.join(map(repr, LAYOUT_CHECKS))}")
    previous, _layout_check[0] = _layout_check[0], mode
    return previous


def check_layout(q: torch.Tensor, k: torch.Tensor, causal: bool, flash: bool = False) -> None:
    """The wrong-layout check (:func:`set_layout_check`) of the ``[B, H, N, D]`` q, k that :func:`attention` receives
    without ``layout=``. ``flash``: the caller is ``flash_attn_func``, which passes the transposes of its own
    ``[B, N, H, D]`` inputs; the message then speaks of those (its layout is its API's: no ambiguity rule)."""
    mode = _layout_check[0]
    if mode == "off":
        return
    doubt = layout_doubt(q, k, causal)
    B, H, N = q.shape[0], q.shape[1], q.shape[2]
    if doubt is None:
        if mode == "error" and not flash and both_layouts_fit(q, k, causal):
            raise ValueError(
                f"stable_attn.attention: q {tuple(q.shape)} and k {tuple(k.shape)} fit both layouts ({H} heads of {N} "
                f"tokens as [B, H, N, D], or {N} heads of {H} tokens as [B, N, H, D]) and set_layout_check('error') "
                "asks such calls to say which: pass layout='bhnd' or layout='bnhd'")
        return
    fix = "q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)"
    if flash:  # the caller's tensors are the transposes: its N is our H, its H our N
        given, shapes, layout = "stable_attn.flash_attn_func", (q.transpose(1, 2).shape, k.transpose(1, 2).shape), \
            "[B, N, H, D]"
        advice = (f"If they are [B, H, N, D] (batch {B}, {N} heads, {H} tokens), call stable_attn.attention, which "
                  f"takes that layout, or pass {fix}")
    else:
        given, shapes, layout = "stable_attn.attention", (q.shape, k.shape), "[B, H, N, D]"
        advice = (f"If they are FlashAttention's [B, N, H, D] (batch {B}, {H} tokens, {N} heads), pass "
                  f"layout='bnhd' (or {fix}); if they are [B, H, N, D], pass layout='bhnd' to say so")
    message = f"{given} reads q {tuple(shapes[0])} and k {tuple(shapes[1])} as {layout}: {doubt}. {advice}"
    if mode == "error":
        raise ValueError(f"{message} (set_layout_check('error'))")
    _ops.log_once(f"layout {tuple(q.shape)} {tuple(k.shape)} {causal}", f"{message} (logged once per shape)",
                  logging.WARNING)


def _in_bnhd_terms(problem: Problem | None) -> Problem | None:
    """A refusal of the transposes of ``layout='bnhd'`` inputs, saying that its shapes are the transposes'."""
    if problem is None:
        return None
    return Problem(problem.error, f"stable_attn.attention(layout='bnhd'): q, k, v given as [B, N, H, D], checked as "
                                  f"their [B, H, N, D] transposes: {problem.message}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = DEFAULTS["causal"],
    scale: float | None = DEFAULTS["scale"],
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    window: int | None = DEFAULTS["window"],
    softcap: float | None = DEFAULTS["softcap"],
    dropout_p: float = DEFAULTS["dropout_p"],
    stabilize: Stabilize = DEFAULTS["stabilize"],
    beta: float = DEFAULTS["beta"],
    stats: AttentionStats | None = None,
    backend: str = DEFAULTS["backend"],
    block_n: int | None = DEFAULTS["block_n"],
    pv_fp32: bool = DEFAULTS["pv_fp32"],
    sinks: torch.Tensor | None = None,
    layout: str | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with the dynamic-max fix (Qiu & Yao, ICLR 2026).

    Computes ``softmax(q k^T * scale + mask) v`` exactly like ``F.scaled_dot_product_attention``,
    with the FlashAttention-2 algorithm; the stabilization only changes the constant subtracted
    inside the online softmax (docs/ALGORITHM.md).

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, Nk, D]``, v: ``[B, Hkv, Nk, Dv]`` with ``Hq % Hkv == 0``
            (GQA/MQA); ``Dv`` may differ from ``D`` (multi-head latent attention: nothing is padded); the
            output is ``[B, Hq, Nq, Dv]``. dtypes bfloat16, float16, float32; ``D, Dv <= 512`` (the Triton
            kernels serve all of them, above 256 in column chunks; what does not fit their shared memory goes to
            the PyTorch path, logged once).
        causal: causal mask aligned bottom-right when ``Nq != Nk`` (query i sees keys
            ``j <= i + Nk - Nq``), as FlashAttention >= 2.1 and KV-cache decoding.
        scale: score scale, default ``1/sqrt(D)``.
        key_padding_mask: ``[B, Nk]`` bool, True = attend. A row that sees no key outputs zeros
            and gets zero gradients. A NaN in q, or in a key or value a row sees, makes that row NaN (as
            in SDPA); as in SDPA, a NaN in a key or value the row does not see but that shares a key
            block with ones it sees can also reach it (a zero weight times NaN), in the output through
            ``v`` and in ``dq`` through ``k``.
        attn_mask: arbitrary bool (True = attend) or additive float mask broadcastable to
            ``[B, Hq, Nq, Nk]``; served by the PyTorch path.
        window: left sliding window ``W``: the query at position ``p = i + Nk - Nq`` sees keys
            ``j > p - W``. It bounds only the left side: with ``causal=True`` that is
            ``p - W < j <= p``; with ``causal=False`` the query also sees every key to its right.
        softcap: logit softcapping ``c * tanh(s / c)`` applied to the scaled scores.
        dropout_p: attention dropout probability. The caller decides when it applies (pass 0.0
            at evaluation). Counter-based (Philox), the same mask in the backward.
        stabilize: True (our rule), ``"paper"`` (the published rule as its code behaves, including
            its 1e-10 floor on each key block's row sum; docs/ALGORITHM.md), False (plain FA2).
        beta: the paper's multiplier for a positive max (> 1).
        stats: an :class:`AttentionStats` to accumulate per-head row statistics into (skipped
            while its ``enabled`` is False).
        backend: ``"auto"`` (Triton on CUDA, PyTorch on CPU), ``"torch"`` or ``"triton"``.
        block_n: key-block size (the partition the per-block rule sees); default (None) is
            ``options.BLOCK_N`` (64) on both backends (where no rule sees the partition, stabilize off
            without statistics, the Triton forward may tile the keys otherwise).
        pv_fp32: keep ``P-bar`` in fp32 for the ``P-bar V`` product (Qiu & Yao: fp32 for that product alone
            stabilises training); a comparison variant served by the PyTorch path only (``backend="triton"``
            raises; ``"auto"`` on CUDA logs that the PyTorch path serves it). The backward is unchanged.
        sinks: learned attention sinks (gpt-oss): ``[Hq]``, one logit per query head in the units of the scaled
            scores, read in fp32; it joins every row's softmax denominator and receives no value, so a row's
            weights sum to ``1 - P(sink)``. Differentiable (``d sinks`` from the backward). The rule sees the
            sink as the row's first entry, in a key block of its own (docs/ALGORITHM.md, "Learned sinks").
            Both backends serve it (the Triton forward and decode kernels start each row from the sink).
        layout: ``"bhnd"`` (q, k, v and the output ``[B, H, N, D]``, SDPA's), ``"bnhd"`` (``[B, N, H, D]``,
            FlashAttention's: the op runs on the transposed views, nothing is copied, and the output comes back
            ``[B, Nq, Hq, Dv]``) or None (the default): ``"bhnd"``, with a check that warns once per shape when the
            shapes look like ``[B, N, H, D]`` (an error under ``set_layout_check("error")``, which also refuses
            calls whose shapes fit both layouts without ``layout=``). Masks are the same in both layouts.

    A call that needs no gradient with at most 16 queries against at least two key blocks (no ``attn_mask``,
    no dropout, no ``stats``: a ``generate()`` step) takes the decode path on both backends: the keys split
    into runs of whole key blocks, the rule per run, the runs merged in fp32 (docs/ALGORITHM.md, "Decode:
    split keys"; kernels/decode_plan.py).
    """
    raise_problem(layout_problem(layout))
    if layout == "bnhd":
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
            raise_problem(_in_bnhd_terms(dense_problem(q, k, v)))  # the rank and type errors, as they are
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        raise_problem(_in_bnhd_terms(dense_problem(*autocast_inputs(q, k, v), key_padding_mask, attn_mask, sinks)))
        out = attention(q, k, v, causal=causal, scale=scale,
                        key_padding_mask=key_padding_mask, attn_mask=attn_mask, window=window, softcap=softcap,
                        dropout_p=dropout_p, stabilize=stabilize, beta=beta, stats=stats, backend=backend,
                        block_n=block_n, pv_fp32=pv_fp32, sinks=sinks, layout="bhnd")
        return out.transpose(1, 2)
    key = None
    if call_cache.ENABLED and attn_mask is None and stats is None and not torch.compiler.is_compiling():
        # a call repeating the signature of an earlier no-gradient call that passed every check (call_cache.py)
        key = call_cache.signature((q, k, v, key_padding_mask, sinks), (
            causal, scale, window, softcap, dropout_p, stabilize, beta, backend, block_n, pv_fp32, layout,
            _layout_check[0]))
        known = call_cache.get(key)
        if known is not None:
            return known(q, k, v, key_padding_mask, sinks)
    q, k, v = autocast_inputs(q, k, v)
    raise_problem(dense_problem(q, k, v, key_padding_mask, attn_mask, sinks))
    # a log call would break the graph; eager calls are where shapes go wrong
    if layout is None and not torch.compiler.is_compiling():
        check_layout(q, k, causal)
    opts = Options.create(head_dim=q.shape[-1], causal=causal, scale=scale, window=window, softcap=softcap,
                          dropout_p=dropout_p, stabilize=stabilize, beta=beta, backend=backend, block_n=block_n,
                          pv_fp32=pv_fp32)
    check_stats(stats)
    # no backward will be asked for: a short query may take the decode path (_decode)
    needs_grad = q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    opts = opts.replace(forward_only=not (torch.is_grad_enabled() and needs_grad))
    impl = resolve_backend(opts.backend, q, attn_mask is not None, k, opts.pv_fp32, v, opts.key_block)
    given = (q, k, v, key_padding_mask)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.contiguous()  # the kernels index it as [b * Nk + j]
    q, k, v = unit_last_stride(q, k, v)
    out = _ops.run(_attention_fwd, q, k, v, sinks, (key_padding_mask, attn_mask), draw_seed(opts.dropout_p), opts,
                   impl, stats)
    if opts.forward_only and opts.dropout_p == 0:
        call_cache.remember(key, _Known(opts.replace(backend=impl), _decode(q, k, None, opts, 0), *given))
    return out


class _Known:
    """A checked no-gradient call (call_cache.py): its options and path decided, run without the op (nothing
    needs autograd; the op's forward implementation is ``_forward``, called here directly). The signature fixes
    the strides, so whether a tensor needs the copy ``attention()`` makes is known here. The decode path on the
    Triton backend runs its prepared launch (kernels/decode_launch.py) and drops ``lse``."""

    __slots__ = ("opts", "decode", "launch", "copies")

    def __init__(self, opts: Options, decode: bool, q, k, v, key_padding_mask) -> None:
        self.opts, self.decode, self.launch = opts, decode and opts.backend == "triton", None
        # attention()'s unit_last_stride and contiguous mask (the kernels' dense_last asks no more of q, k, v)
        self.copies = (any(t.stride(-1) != 1 for t in (q, k, v))
                       or (key_padding_mask is not None and not key_padding_mask.is_contiguous()))

    def __call__(self, q, k, v, key_padding_mask, sinks) -> torch.Tensor:
        if self.copies:
            q, k, v = unit_last_stride(q, k, v)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.contiguous()
        if not self.decode:
            return _forward(q, k, v, sinks, key_padding_mask, None, self.opts, 0)[0]
        if self.launch is None:  # the signature fixes the shapes: one launch serves every call
            from .kernels import decode_launch

            self.launch = decode_launch.prepared(q, k, v, key_padding_mask, self.opts, sinks)
        return self.launch.run(q, k, v, key_padding_mask, sinks, fresh_lse=False)[0]
