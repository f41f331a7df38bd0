"""``stable_attn.attention``: tensor checks, backend dispatch, and the torch.library op.

The op is registered as ``stable_attn::attention_fwd`` / ``stable_attn::attention_bwd`` with a fake
(meta) implementation and an autograd formula, so ``torch.compile`` keeps it in the graph as one
opaque call and autograd never traces through a reference implementation. Its scalar arguments are
the fields of :class:`stable_attn.options.Options`, by name (``options.op_schema``); the options
themselves are checked in options.py. The helpers here (autocast, seed, backend choice, statistics
placeholders) are shared with the varlen op (varlen.py).
"""

from __future__ import annotations

import logging
import os

import torch

from .kernels import reference, rules
from .options import DEFAULTS, Options, Stabilize, op_schema
from .stats import AttentionStats, RowStats

logger = logging.getLogger("stable_attn")

_logged_once: set[str] = set()


def log_once(key: str, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` the first time ``key`` is seen in this process (the fallback notices)."""
    if key not in _logged_once:
        _logged_once.add(key)
        logger.log(level, message)


_FA_HINT = ("; they would fit as [B, N, H, D] (FlashAttention's layout): if that is their layout, pass "
            "q.transpose(1, 2) etc., or call stable_attn.flash_attn_func, which takes [B, N, H, D]")


def _fits_bnhd(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether q, k read as ``[B, N, H, D]`` (FlashAttention's layout) would be a valid call."""
    return q.shape[2] >= 1 and k.shape[2] >= 1 and q.shape[2] % k.shape[2] == 0 and k.shape[1] >= 1


def check_tensors(q, k, v, key_padding_mask=None, attn_mask=None) -> None:
    """Check q, k, v (``[B, H, N, D]``) and the masks; errors name the argument, its shape and the layout."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            hint = (" (packed [total, H, D] sequences go to stable_attn.attention_varlen)" if t.dim() == 3 else "")
            raise ValueError(f"{name} must have rank 4 [B, H, N, D], got shape {tuple(t.shape)}{hint}")
        if t.dtype not in rules.SUPPORTED_DTYPES:
            raise TypeError(f"{name}.dtype={t.dtype} is not supported; use bfloat16, float16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Nq, D = q.shape
    layout = f"q {tuple(q.shape)} and k {tuple(k.shape)} as [B, H, N, D]"
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B, Hkv, Nk, D], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[0] != B:
        raise ValueError(f"k batch size {k.shape[0]} does not match q batch size {B} ({layout})")
    if k.shape[3] != D:
        raise ValueError(f"k head dim {k.shape[3]} does not match q head dim {D} ({layout})")
    if not 1 <= D <= 256:
        raise ValueError(f"head dim D={D} is not supported; use 1 <= D <= 256 (the last dim of [B, H, N, D])")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        hint = _FA_HINT if _fits_bnhd(q, k) else ""
        raise ValueError(f"q heads Hq={Hq} must be a multiple of k/v heads Hkv={Hkv} (GQA/MQA; {layout}){hint}")
    if Nq == 0 or k.shape[2] == 0:
        raise ValueError(f"sequence lengths must be >= 1, got Nq={Nq}, Nk={k.shape[2]} ({layout})")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            got = getattr(key_padding_mask, "dtype", type(key_padding_mask).__name__)
            raise TypeError(f"key_padding_mask must be a bool tensor (True = attend), got {got}")
        if tuple(key_padding_mask.shape) != (B, k.shape[2]):
            fits = tuple(key_padding_mask.shape) == (B, k.shape[1]) and _fits_bnhd(q, k)
            raise ValueError(
                f"key_padding_mask must have shape [B, Nk] = {(B, k.shape[2])} ({layout}), got "
                f"{tuple(key_padding_mask.shape)}{_FA_HINT if fits else ''}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device}, q on {q.device}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask.dtype={attn_mask.dtype}: use bool (True = attend) or a float additive mask")
        if not _broadcasts(attn_mask, (B, Hq, Nq, k.shape[2])):
            fits = _fits_bnhd(q, k) and _broadcasts(attn_mask, (B, q.shape[2], q.shape[1], k.shape[1]))
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to [B, Hq, Nq, Nk] = "
                f"{(B, Hq, Nq, k.shape[2])} ({layout}){_FA_HINT if fits else ''}"
            )
        if attn_mask.requires_grad and torch.is_grad_enabled():
            raise ValueError("attn_mask requires grad, but stable_attn returns no gradient for attention masks; "
                             "detach it if it is constant")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask is on {attn_mask.device}, q on {q.device}")


def _broadcasts(mask: torch.Tensor, shape: tuple[int, int, int, int]) -> bool:
    if mask.dim() > 4:
        return False
    padded = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    return all(s in (1, t) for s, t in zip(padded, shape))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# The Triton kernels address one batch element's q/k/v/o with 32-bit offsets.
_TRITON_MAX_ELEMENTS_PER_BATCH = 2**31


def resolve_backend(backend: str, q: torch.Tensor, has_attn_mask: bool, k: torch.Tensor | None = None) -> str:
    """Pick the implementation. Never drops the stabilization: what Triton cannot serve goes to torch."""
    if backend == "torch":
        return "torch"
    if has_attn_mask:
        if backend == "triton" or q.is_cuda:
            log_once("attn_mask", "stable_attn: an arbitrary attn_mask is served by the PyTorch path "
                     "(stabilized, slower than the Triton kernel)", logging.WARNING)
        return "torch"
    per_batch = max(q[0].numel(), 0 if k is None else k[0].numel())
    if per_batch >= _TRITON_MAX_ELEMENTS_PER_BATCH and (backend == "triton" or q.is_cuda):
        log_once("int32", f"stable_attn: {per_batch} elements per batch element exceed the Triton kernels' "
                 "32-bit offsets; served by the PyTorch path (stabilized, slower)", logging.WARNING)
        return "torch"
    if backend == "auto":
        return "triton" if q.is_cuda else "torch"
    if not q.is_cuda and not _interpreting():
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is "
                         "imported; use backend='torch' or 'auto' for the CPU path")
    return "triton"


def autocast_inputs(*xs):
    """Like F.scaled_dot_product_attention, attention runs in autocast's lower precision."""
    first = xs[0]
    if isinstance(first, torch.Tensor) and torch.is_autocast_enabled(first.device.type):
        dt = torch.get_autocast_dtype(first.device.type)
        return tuple(t.to(dt) if isinstance(t, torch.Tensor) else t for t in xs)
    return xs


def check_stats(stats: object) -> None:
    if stats is not None and not isinstance(stats, AttentionStats):
        raise TypeError(f"stats must be an AttentionStats or None, got {type(stats).__name__}")


def unit_last_stride(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Unit stride in the last dim, so every backend returns outputs with exactly the strides the fake
    implementations promise (empty_like of these inputs)."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in xs)


def seed_value(seed: torch.Tensor | None) -> int:
    """The dropout seed an op received; it travels as a tensor so that drawing it is a graph op under
    torch.compile (no .item() in the traced code)."""
    return 0 if seed is None else int(seed)


def draw_seed(dropout_p: float) -> torch.Tensor | None:
    """A fresh Philox seed for a call with dropout, None without.

    Drawn from the CPU generator, whose state torch.utils.checkpoint restores for the recompute.
    """
    return torch.randint(0, 2**62, (), dtype=torch.int64) if dropout_p > 0 else None


def empty_stats(q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Placeholders for the four statistics outputs when none are collected."""
    return tuple(q.new_empty((0,), dtype=dt) for dt in (torch.bool, torch.int32, torch.float32, torch.float32))


def stats_like(rows: tuple[int, ...], q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Fake statistics outputs of shape ``rows`` (what RowStats holds)."""
    return tuple(q.new_empty(rows, dtype=dt) for dt in (torch.bool, torch.int32, torch.float32, torch.float32))


STATS_RESULTS = "Tensor, Tensor, Tensor, Tensor"  # RowStats' fields: saturated, fixed_blocks, max_logit, first_key_prob


# The ops take the Options fields as named scalar arguments (options.op_schema()): the schema is written
# from the dataclass, and the implementations rebuild the Options with Options.from_op_args.
_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? attn_mask, Tensor? seed, bool with_stats, "
    f"{op_schema()}) -> (Tensor, Tensor, {STATS_RESULTS})"
)
_BWD_SCHEMA = (
    "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? key_padding_mask, "
    f"Tensor? attn_mask, Tensor? seed, {op_schema()}) -> (Tensor, Tensor, Tensor)"
)


def _forward_impl(q, k, v, key_padding_mask, attn_mask, seed, with_stats, *options):
    opts = Options.from_op_args(options, seed_value(seed))
    if opts.backend == "triton":
        from .kernels import triton_attention

        out, lse, rs = triton_attention.forward(q, k, v, key_padding_mask, opts, with_stats)
    else:
        out, lse, rs = reference.attention_forward(q, k, v, key_padding_mask, attn_mask, opts, with_stats)
    if rs is None:
        return (out, lse, *empty_stats(q))
    return out, lse, rs.saturated, rs.fixed_blocks, rs.max_logit, rs.first_key_prob


def _backward_impl(do, q, k, v, out, lse, key_padding_mask, attn_mask, seed, *options):
    opts = Options.from_op_args(options, seed_value(seed))
    do = do.contiguous()
    if opts.backend == "triton":
        from .kernels import triton_attention

        return triton_attention.backward(do, q, k, v, out, lse, key_padding_mask, opts)
    return reference.attention_backward(do, q, k, v, out, lse, key_padding_mask, attn_mask, opts)


_attention_fwd = torch.library.custom_op("stable_attn::attention_fwd", _forward_impl, mutates_args=(),
                                         schema=_FWD_SCHEMA)
_attention_bwd = torch.library.custom_op("stable_attn::attention_bwd", _backward_impl, mutates_args=(),
                                         schema=_BWD_SCHEMA)


@_attention_fwd.register_fake
def _(q, k, v, key_padding_mask, attn_mask, seed, with_stats, *options):
    rows = q.shape[:3]
    lse = q.new_empty(rows, dtype=torch.float32)
    return (torch.empty_like(q), lse, *(stats_like(rows, q) if with_stats else empty_stats(q)))


@_attention_bwd.register_fake
def _(do, q, k, v, out, lse, key_padding_mask, attn_mask, seed, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, kpm, am, seed, _with_stats, *options = inputs
    ctx.options = options
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(q, k, v, output[0], output[1], kpm, am, seed)


def _backward(ctx, do, dlse, *unused):
    q, k, v, out, lse, kpm, am, seed = ctx.saved_tensors
    dq, dk, dv = _attention_bwd(do, q, k, v, out, lse, kpm, am, seed, *ctx.options)
    return dq, dk, dv, *([None] * (ctx.n_inputs - 3))  # no gradient for the masks, the seed, the options


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


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
) -> torch.Tensor:
    """Scaled dot-product attention with the dynamic-max fix (Qiu & Yao, ICLR 2026).

    Computes ``softmax(q k^T * scale + mask) v`` exactly like ``F.scaled_dot_product_attention``,
    with the FlashAttention-2 algorithm; the stabilization only changes the constant subtracted
    inside the online softmax (docs/ALGORITHM.md).

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nk, D]`` with ``Hq % Hkv == 0`` (GQA/MQA).
            dtypes bfloat16, float16, float32; ``D <= 256``.
        causal: causal mask aligned bottom-right when ``Nq != Nk`` (query i sees keys
            ``j <= i + Nk - Nq``), as FlashAttention >= 2.1 and KV-cache decoding.
        scale: score scale, default ``1/sqrt(D)``.
        key_padding_mask: ``[B, Nk]`` bool, True = attend. A row that sees no key outputs zeros
            and gets zero gradients.
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
    """
    q, k, v = autocast_inputs(q, k, v)
    check_tensors(q, k, v, key_padding_mask, attn_mask)
    opts = Options.create(head_dim=q.shape[-1], causal=causal, scale=scale, window=window, softcap=softcap,
                          dropout_p=dropout_p, stabilize=stabilize, beta=beta, backend=backend, block_n=block_n)
    check_stats(stats)
    impl = resolve_backend(opts.backend, q, attn_mask is not None, k)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.contiguous()  # the kernels index it as [b * Nk + j]
    q, k, v = unit_last_stride(q, k, v)
    collect = stats is not None and stats.enabled
    outs = _attention_fwd(q, k, v, key_padding_mask, attn_mask, draw_seed(opts.dropout_p), collect,
                          *opts.replace(backend=impl).op_args())
    if collect:
        stats.update(RowStats(*outs[2:]))
    return outs[0]
