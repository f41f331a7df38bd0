"""FlashAttention 2's Python interface over stable_attn: ``flash_attn_func`` and ``flash_attn_varlen_func``.

Code written for ``flash_attn`` runs with one changed import::

    from stable_attn import flash_attn_func, flash_attn_varlen_func

The arguments, their order, defaults and layouts are FlashAttention 2's (``[B, N, H, D]`` for the dense
function, ``[total, H, D]`` with ``cu_seqlens`` for the varlen one); the computation is
:func:`stable_attn.attention` / :func:`stable_attn.attention_varlen` with the stabilization on. Only
transposes stand between the two layouts: ``[B, N, H, D]`` viewed as ``[B, H, N, D]`` has a unit last
stride, which the kernels take as it is, and the output is allocated with the input's strides, so it
comes back as a contiguous ``[B, N, H, D]`` tensor like FlashAttention's.

``window_size=(left, right)``: FlashAttention lets the query at position ``p`` (bottom-right aligned,
``p = i + Nk - Nq``) see keys ``p - left <= j <= p + right``, ``-1`` meaning unbounded, and with
``causal=True`` it takes ``right = 0``. stable_attn's ``window=W`` keeps keys ``j > p - W``, i.e.
``W = left + 1``, and bounds only the left side; so a right bound is expressible only as none (``-1``)
or as causality (``0``). :func:`window_arguments` maps the supported combinations and refuses the
others. ``alibi_slopes``, ``return_attn_probs=True`` and a paged
``block_table`` are refused. ``deterministic`` is accepted and changes nothing: the backward has no
atomics and is deterministic already. The packed-input variants (``flash_attn_qkvpacked_func``,
``flash_attn_kvpacked_func`` and their varlen forms) split the stacked tensor into views and call the
two functions above.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..attention import attention, check_layout
from ..options import DEFAULTS, Stabilize
from ..stats import AttentionStats
from ..varlen import attention_varlen

Window = tuple[int, int]


def window_arguments(window_size: Any, causal: bool) -> tuple[bool, int | None]:
    """``(causal, window)`` for :func:`stable_attn.attention` from FlashAttention's ``causal, window_size``.

    As in FlashAttention, a negative bound is unbounded and ``causal=True`` sets the right bound to 0
    whatever ``window_size`` says. Supported: a left bound ``left >= 0`` (keys ``j >= p - left``) or
    none, with the right bound unbounded (non-causal) or 0 (causal). A right bound > 0 without
    ``causal`` raises.
    """
    ok_pair = (isinstance(window_size, (tuple, list)) and len(window_size) == 2
               and all(isinstance(x, int) and not isinstance(x, bool) for x in window_size))
    if not ok_pair:
        raise TypeError(f"window_size={window_size!r} must be a pair of ints (left, right), -1 = unbounded")
    left, right = window_size
    if right > 0 and not causal:
        raise ValueError(
            f"window_size={tuple(window_size)!r} with causal=False: a right bound > 0 is not supported; "
            "stable_attn's window bounds the left side only, so right must be -1 (unbounded) or 0 (causal)"
        )
    window = None if left < 0 else left + 1  # FlashAttention's left bound is inclusive, ours exclusive
    return bool(causal) or right == 0, window


def _refuse(alibi_slopes: Any, return_attn_probs: Any, fn: str) -> None:
    if alibi_slopes is not None:
        raise ValueError(f"{fn}: alibi_slopes is not supported by stable_attn; pass alibi_slopes=None")
    if return_attn_probs:
        raise ValueError(f"{fn}: return_attn_probs=True is not supported (the fused kernel never materializes "
                         "the probabilities); pass return_attn_probs=False")


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _scalars(softmax_scale: Any, softcap: Any, fn: str) -> tuple[float | None, float | None]:
    """FlashAttention's ``softmax_scale`` (None = 1/sqrt(D)) and ``softcap`` (0.0 = off) checked in its own
    terms, as stable_attn's ``scale`` and ``softcap`` (None = off)."""
    if softmax_scale is not None and not _positive(softmax_scale):
        raise ValueError(f"{fn}: softmax_scale={softmax_scale!r} is not supported; use a finite number > 0 or None "
                         "(1/sqrt(D))")
    if softcap is None or (isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap == 0):
        return softmax_scale, None
    if not _positive(softcap):
        raise ValueError(f"{fn}: softcap={softcap!r} is not supported; use a finite number > 0 (scores capped "
                         "as c * tanh(s / c)) or 0.0 (off)")
    return softmax_scale, float(softcap)


def _check_layout(q: Any, k: Any, v: Any, rank: int, layout: str, fn: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{fn}: {name} must have rank {rank} {layout}, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k and v must have the same shape {layout}, got {tuple(k.shape)} and {tuple(v.shape)}")


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    stabilize: Stabilize = DEFAULTS["stabilize"],
    beta: float = DEFAULTS["beta"],
    stats: AttentionStats | None = None,
    backend: str = DEFAULTS["backend"],
) -> torch.Tensor:
    """FlashAttention 2's ``flash_attn_func``: q ``[B, Nq, Hq, D]``, k/v ``[B, Nk, Hkv, D]`` -> ``[B, Nq, Hq, D]``.

    ``causal`` is bottom-right aligned when ``Nq != Nk``; ``Hq % Hkv == 0`` (GQA/MQA); ``softcap`` 0.0 =
    off; ``dropout_p`` applies whenever it is > 0 (pass 0.0 at evaluation, as with FlashAttention).
    Keyword-only extras: ``stabilize``, ``beta``, ``stats``, ``backend`` as in :func:`stable_attn.attention`.
    """
    fn = "flash_attn_func"
    _refuse(alibi_slopes, return_attn_probs, fn)
    _check_layout(q, k, v, 4, "[B, N, H, D]", fn)
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"{fn}: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch B and head dim D "
                         "in the layout [B, N, H, D]")
    causal, window = window_arguments(window_size, causal)
    softmax_scale, softcap = _scalars(softmax_scale, softcap, fn)
    if not torch.compiler.is_compiling():  # its layout is its API's: attention() is told it (layout='bhnd')
        check_layout(q.transpose(1, 2), k.transpose(1, 2), causal, flash=True)
    try:
        out = attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, scale=softmax_scale,
            window=window, softcap=softcap, dropout_p=dropout_p, stabilize=stabilize, beta=beta,
            stats=stats, backend=backend, layout="bhnd",
        )
    except (ValueError, TypeError) as err:  # its shapes are the [B, H, N, D] transposes of the caller's
        raise type(err)(f"{fn} (q, k, v given as [B, N, H, D], seen by stable_attn.attention as their "
                        f"[B, H, N, D] transposes): {err}") from err
    return out.transpose(1, 2)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    stabilize: Stabilize = DEFAULTS["stabilize"],
    beta: float = DEFAULTS["beta"],
    stats: AttentionStats | None = None,
    backend: str = DEFAULTS["backend"],
) -> torch.Tensor:
    """FlashAttention 2's ``flash_attn_varlen_func``: q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]``.

    Sequence ``b`` holds queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (int32 ``[batch + 1]``); causal and window are bottom-right
    aligned per sequence. Returns ``[total_q, Hq, D]``. Keyword-only extras as in :func:`flash_attn_func`.
    """
    fn = "flash_attn_varlen_func"
    _refuse(alibi_slopes, return_attn_probs, fn)
    if block_table is not None:
        raise ValueError(f"{fn}: a paged KV cache (block_table) is not supported; pass block_table=None")
    causal, window = window_arguments(window_size, causal)
    softmax_scale, softcap = _scalars(softmax_scale, softcap, fn)
    try:
        return attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, scale=softmax_scale,
            window=window, softcap=softcap, dropout_p=dropout_p, stabilize=stabilize, beta=beta,
            stats=stats, backend=backend,
        )
    except (ValueError, TypeError) as err:
        raise type(err)(f"{fn}: {err}") from err


# FlashAttention's packed-input variants: q, k, v stacked along one dimension of a single tensor. They
# take views of it (unit last stride kept), so the gradients flow back into the stacked tensor.


def _split(x: Any, parts: int, layout: str, fn: str, name: str) -> tuple[torch.Tensor, ...]:
    if not isinstance(x, torch.Tensor) or x.dim() != layout.count(",") + 1 or x.shape[-3] != parts:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{fn}: {name} must have the layout {layout}, got {got}")
    return x.unbind(-3)


def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: Window = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                              return_attn_probs: bool = False, **options: Any) -> torch.Tensor:
    """FlashAttention 2's ``flash_attn_qkvpacked_func``: qkv ``[B, N, 3, H, D]`` -> ``[B, N, H, D]``."""
    q, k, v = _split(qkv, 3, "[B, N, 3, H, D]", "flash_attn_qkvpacked_func", "qkv")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, **options)


def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                             softmax_scale: float | None = None, causal: bool = False,
                             window_size: Window = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                             return_attn_probs: bool = False, **options: Any) -> torch.Tensor:
    """FlashAttention 2's ``flash_attn_kvpacked_func``: q ``[B, Nq, Hq, D]``, kv ``[B, Nk, 2, Hkv, D]``."""
    k, v = _split(kv, 2, "[B, N, 2, H, D]", "flash_attn_kvpacked_func", "kv")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, **options)


def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                     dropout_p: float = 0.0, softmax_scale: float | None = None,
                                     causal: bool = False, window_size: Window = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                     return_attn_probs: bool = False, **options: Any) -> torch.Tensor:
    """FlashAttention 2's ``flash_attn_varlen_qkvpacked_func``: qkv ``[total, 3, H, D]`` -> ``[total, H, D]``."""
    q, k, v = _split(qkv, 3, "[total, 3, H, D]", "flash_attn_varlen_qkvpacked_func", "qkv")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, **options)


def flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                    dropout_p: float = 0.0, softmax_scale: float | None = None,
                                    causal: bool = False, window_size: Window = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                    return_attn_probs: bool = False, **options: Any) -> torch.Tensor:
    """FlashAttention 2's ``flash_attn_varlen_kvpacked_func``: q ``[total_q, Hq, D]``, kv ``[total_k, 2, Hkv, D]``."""
    k, v = _split(kv, 2, "[total, 2, H, D]", "flash_attn_varlen_kvpacked_func", "kv")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, **options)


__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "window_arguments",
]
