"""``stable_attn.attention``: argument checks, backend dispatch, and the torch.library op.

The op is registered as ``stable_attn::attention_fwd`` / ``stable_attn::attention_bwd`` with a fake
(meta) implementation and an autograd formula, so ``torch.compile`` keeps it in the graph as one
opaque call and autograd never traces through a reference implementation.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Literal

import torch

from .kernels import reference, rules
from .stats import AttentionStats, RowStats

logger = logging.getLogger("stable_attn")

Stabilize = bool | Literal["paper"]
_BACKENDS = ("auto", "torch", "triton")
_logged_once: set[str] = set()


def log_once(key: str, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` the first time ``key`` is seen in this process (the fallback notices)."""
    if key not in _logged_once:
        _logged_once.add(key)
        logger.log(level, message)


def _mode(stabilize: object) -> int:
    if stabilize is True:
        return rules.MODE_EXACT
    if stabilize is False:
        return rules.MODE_OFF
    if stabilize == "paper":
        return rules.MODE_PAPER
    raise ValueError(f"stabilize={stabilize!r} is not supported; use True, False or 'paper'")


def _check(q, k, v, key_padding_mask, attn_mask, scale, window, softcap, dropout_p):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 [B, H, N, D], got shape {tuple(t.shape)}")
        if t.dtype not in rules.SUPPORTED_DTYPES:
            raise TypeError(f"{name}.dtype={t.dtype} is not supported; use bfloat16, float16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Nq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B:
        raise ValueError(f"k batch size {k.shape[0]} does not match q batch size {B}")
    if k.shape[3] != D:
        raise ValueError(f"k head dim {k.shape[3]} does not match q head dim {D}")
    if not 1 <= D <= 256:
        raise ValueError(f"head dim D={D} is not supported; use 1 <= D <= 256")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q heads Hq={Hq} must be a multiple of k/v heads Hkv={Hkv} (GQA/MQA)")
    if Nq == 0 or k.shape[2] == 0:
        raise ValueError(f"sequence lengths must be >= 1, got Nq={Nq}, Nk={k.shape[2]}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            got = getattr(key_padding_mask, "dtype", type(key_padding_mask).__name__)
            raise TypeError(f"key_padding_mask must be a bool tensor (True = attend), got {got}")
        if tuple(key_padding_mask.shape) != (B, k.shape[2]):
            raise ValueError(
                f"key_padding_mask must have shape [B, Nk] = {(B, k.shape[2])}, got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device}, q on {q.device}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask.dtype={attn_mask.dtype}: use bool (True = attend) or a float additive mask")
        shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
        ok = attn_mask.dim() <= 4 and all(s in (1, t) for s, t in zip(shape, (B, Hq, Nq, k.shape[2])))
        if not ok or shape[1] not in (1, Hq):
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to [B, Hq, Nq, Nk] = "
                f"{(B, Hq, Nq, k.shape[2])}"
            )
        if attn_mask.requires_grad and torch.is_grad_enabled():
            raise ValueError("attn_mask requires grad, but stable_attn returns no gradient for attention masks; "
                             "detach it if it is constant")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask is on {attn_mask.device}, q on {q.device}")
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if scale is not None and not (number(scale) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r} must be a finite positive number or None (1/sqrt(D))")
    if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
        raise ValueError(f"window={window!r} must be a positive int (keys j > p - window) or None")
    if softcap is not None and not (number(softcap) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap={softcap!r} must be a finite positive number or None")
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p={dropout_p!r} must be in [0, 1)")


def check_options(stabilize: object = True, beta: object = 2.0, backend: object = "auto",
                  block_n: object = None) -> None:
    """Check the options that select the computation; the op, ``patch_sdpa`` and ``configure`` share it."""
    _mode(stabilize)
    if not (isinstance(beta, (int, float)) and not isinstance(beta, bool) and beta > 1.0 and math.isfinite(beta)):
        raise ValueError(f"beta={beta!r} must be a finite number > 1")
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; use one of {_BACKENDS}")
    if block_n is not None and not (isinstance(block_n, int) and not isinstance(block_n, bool) and block_n >= 16
                                    and block_n & (block_n - 1) == 0):
        raise ValueError(f"block_n={block_n!r} must be a power of two >= 16 or None")


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


def _opts(causal, scale, window, softcap, dropout_p, seed, mode, beta, block_n):
    return reference.Options(
        causal=causal, scale=scale, window=None if window < 0 else window,
        softcap=None if softcap <= 0 else softcap, dropout_p=dropout_p, seed=seed, mode=mode,
        beta=beta, block_n=block_n,
    )


def _seed(seed: torch.Tensor | None) -> int:
    # the seed travels as a tensor so that drawing it is a graph op under torch.compile (no .item())
    return 0 if seed is None else int(seed)


def _empty_stats(q):
    return tuple(q.new_empty((0,), dtype=dt) for dt in (torch.bool, torch.int32, torch.float32, torch.float32))


@torch.library.custom_op("stable_attn::attention_fwd", mutates_args=())
def _attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None, seed: torch.Tensor | None, causal: bool, scale: float, window: int,
    softcap: float, dropout_p: float, mode: int, beta: float, block_n: int, backend: str, with_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    opts = _opts(causal, scale, window, softcap, dropout_p, _seed(seed), mode, beta, block_n)
    if backend == "triton":
        from .kernels import triton_attention

        out, lse, rs = triton_attention.forward(q, k, v, key_padding_mask, opts, with_stats)
    else:
        out, lse, rs = reference.attention_forward(q, k, v, key_padding_mask, attn_mask, opts, with_stats)
    if rs is None:
        return (out, lse, *_empty_stats(q))
    return out, lse, rs.saturated, rs.fixed_blocks, rs.max_logit, rs.first_key_prob


@_attention_fwd.register_fake
def _(q, k, v, key_padding_mask, attn_mask, seed, causal, scale, window, softcap, dropout_p, mode, beta,
      block_n, backend, with_stats):
    B, H, N, _ = q.shape
    lse = q.new_empty((B, H, N), dtype=torch.float32)
    if not with_stats:
        return (torch.empty_like(q), lse, *_empty_stats(q))
    return (torch.empty_like(q), lse, q.new_empty((B, H, N), dtype=torch.bool),
            q.new_empty((B, H, N), dtype=torch.int32), lse.new_empty((B, H, N)), lse.new_empty((B, H, N)))


@torch.library.custom_op("stable_attn::attention_bwd", mutates_args=())
def _attention_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
    seed: torch.Tensor | None, causal: bool, scale: float, window: int, softcap: float, dropout_p: float,
    mode: int, beta: float, block_n: int, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    opts = _opts(causal, scale, window, softcap, dropout_p, _seed(seed), mode, beta, block_n)
    do = do.contiguous()
    if backend == "triton":
        from .kernels import triton_attention

        return triton_attention.backward(do, q, k, v, out, lse, key_padding_mask, opts)
    return reference.attention_backward(do, q, k, v, out, lse, key_padding_mask, attn_mask, opts)


@_attention_bwd.register_fake
def _(do, q, k, v, out, lse, key_padding_mask, attn_mask, seed, causal, scale, window, softcap, dropout_p,
      mode, beta, block_n, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, kpm, am, seed = inputs[:6]
    ctx.args = inputs[6:15]  # causal ... backend
    ctx.save_for_backward(q, k, v, output[0], output[1], kpm, am, seed)


def _backward(ctx, do, dlse, *unused):
    q, k, v, out, lse, kpm, am, seed = ctx.saved_tensors
    dq, dk, dv = _attention_bwd(do, q, k, v, out, lse, kpm, am, seed, *ctx.args)
    return dq, dk, dv, *([None] * 13)


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    stabilize: Stabilize = True,
    beta: float = 2.0,
    stats: AttentionStats | None = None,
    backend: str = "auto",
    block_n: int | None = None,
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
        block_n: key-block size (the partition the per-block rule sees); default (None) lets the
            backend choose (the PyTorch path uses 64).
    """
    if isinstance(q, torch.Tensor) and torch.is_autocast_enabled(q.device.type):
        # like F.scaled_dot_product_attention, attention runs in autocast's lower precision
        dt = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dt) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    _check(q, k, v, key_padding_mask, attn_mask, scale, window, softcap, dropout_p)
    check_options(stabilize, beta, backend, block_n)
    mode = _mode(stabilize)
    if stats is not None and not isinstance(stats, AttentionStats):
        raise TypeError(f"stats must be an AttentionStats or None, got {type(stats).__name__}")
    impl = resolve_backend(backend, q, attn_mask is not None, k)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # drawn from the CPU generator, whose state torch.utils.checkpoint restores for the recompute
    seed = torch.randint(0, 2**62, (), dtype=torch.int64) if dropout_p > 0 else None
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.contiguous()  # the kernels index it as [b * Nk + j]
    # unit stride in the last dim, so every backend returns outputs with exactly the strides the
    # fake implementations promise (empty_like of these inputs)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    collect = stats is not None and stats.enabled
    outs = _attention_fwd(
        q, k, v, key_padding_mask, attn_mask, seed, bool(causal), float(scale),
        -1 if window is None else int(window), 0.0 if softcap is None else float(softcap),
        float(dropout_p), mode, float(beta), int(block_n or 0), impl, collect,
    )
    if collect:
        stats.update(RowStats(*outs[2:]))
    return outs[0]
