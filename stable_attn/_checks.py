"""Tensor rules: what ``attention()``, ``attention_varlen()`` and the patched sdpa accept, in one place.

:func:`dense_problem` (``[B, H, N, D]`` inputs and their masks) and :func:`packed_problem` (FlashAttention's
varlen layout) return the :class:`Problem` with a call, or None; the two entry points raise it
(:func:`raise_problem`): its message names the argument, its value and what is accepted.
:func:`sdpa_problem` says why ``patch_sdpa``'s wrapper must leave a call to the original
``scaled_dot_product_attention``: the sdpa-only rules first (nested tensors, GQA without
``enable_gqa``, ...), then the scale rule of :mod:`stable_attn.options` and :func:`dense_problem`
itself, so every call the wrapper serves is one that ``attention()`` accepts.

The rules on scalars (scale, window, ...) live in options.py; here are the rules on tensors, the
interpreter test and the unit-stride rule the ops' fake implementations rely on. No tensor values
are read (safe to trace); the values of ``cu_seqlens`` are checked inside the varlen op.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd import forward_ad

from . import rules
from .options import is_int, scale_problem

# Head dims q/k and v may have (each on its own: a value head dim apart from the query's is multi-head latent
# attention); 512 is Gemma 4's global layers
MAX_HEAD_DIM = 512


class Problem(NamedTuple):
    """Why a call is refused: the exception type to raise and its message."""

    error: type[Exception]
    message: str


def raise_problem(problem: Problem | None) -> None:
    if problem is not None:
        raise problem.error(problem.message)


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``): the Triton backend on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unit_last_stride(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Unit stride in the last dim, so every backend returns outputs with exactly the strides the fake
    implementations promise (empty_like of these inputs)."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in xs)


def output_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The uninitialized output of q ``[..., D]`` and v ``[..., Dv]``: ``empty_like(q)`` when ``Dv == D`` (q's
    strides, what the ops always promised), else contiguous ``[..., Dv]``; every backend and the ops' fake
    implementations allocate it here, so they promise the same strides."""
    if v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q)
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def sinks_problem(sinks: Any, q: torch.Tensor, heads: int) -> Problem | None:
    """What is wrong with learned ``sinks`` for a query with ``heads`` heads, or None: one logit per query
    head, ``[Hq]``, floating point, on q's device (its values are not read: a traced call reads none)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        return Problem(TypeError, f"sinks must be a tensor [Hq] (one logit per query head) or None, got "
                                  f"{type(sinks).__name__}")
    if not sinks.is_floating_point():
        return Problem(TypeError, f"sinks.dtype={sinks.dtype} is not supported; use a floating-point tensor "
                                  "(float32, bfloat16 or float16: the logits are read in float32)")
    if tuple(sinks.shape) != (heads,):
        return Problem(ValueError, f"sinks must have shape [Hq] = ({heads},) (one logit per query head), got "
                                   f"{tuple(sinks.shape)}")
    if sinks.device != q.device:
        return Problem(ValueError, f"sinks is on {sinks.device}, q on {q.device}; put it on q's device")
    return None


def broadcasts(mask: torch.Tensor, shape: tuple[int, int, int, int]) -> bool:
    """Whether ``mask`` broadcasts to ``shape`` ``[B, Hq, Nq, Nk]``."""
    if mask.dim() > 4:
        return False
    padded = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    return all(s in (1, t) for s, t in zip(padded, shape))


def _mask_dtype_ok(mask: torch.Tensor) -> bool:
    return mask.dtype == torch.bool or mask.is_floating_point()


def _mask_needs_grad(mask: torch.Tensor) -> bool:
    return mask.requires_grad and torch.is_grad_enabled()


_FA_HINT = ("; they would fit as [B, N, H, D] (FlashAttention's layout): if that is their layout, pass "
            "q.transpose(1, 2) etc., or call stable_attn.flash_attn_func, which takes [B, N, H, D]")


def _fits_bnhd(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether q, k read as ``[B, N, H, D]`` (FlashAttention's layout) would be a valid call."""
    return q.shape[2] >= 1 and k.shape[2] >= 1 and q.shape[2] % k.shape[2] == 0 and k.shape[1] >= 1


def _qkv_problem(q: Any, k: Any, v: Any, packed: bool) -> Problem | None:
    """The rules q, k, v share in both layouts: ``[B, H, N, D]`` or, ``packed``, ``[total, H, D]``."""
    rank = 3 if packed else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return Problem(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            if packed:
                hint = " (batched [B, H, N, D] inputs go to stable_attn.attention)" if t.dim() == 4 else ""
                return Problem(ValueError, f"{name} must have rank 3 [total, H, D] (FlashAttention's varlen layout), "
                                           f"got shape {tuple(t.shape)}{hint}")
            hint = " (packed [total, H, D] sequences go to stable_attn.attention_varlen)" if t.dim() == 3 else ""
            return Problem(ValueError, f"{name} must have rank 4 [B, H, N, D], got shape {tuple(t.shape)}{hint}")
        if t.dtype not in rules.SUPPORTED_DTYPES:
            return Problem(TypeError, f"{name}.dtype={t.dtype} is not supported; use bfloat16, float16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        return Problem(TypeError, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        return Problem(ValueError, f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if packed:
        layout_name, kv_layout = "[total, H, D]", "[total_k, Hkv, D]"
        layout = f"q {tuple(q.shape)}, k {tuple(k.shape)} as {layout_name}"
    else:
        layout_name, kv_layout = "[B, H, N, D]", "[B, Hkv, Nk, D]"
        layout = f"q {tuple(q.shape)} and k {tuple(k.shape)} as {layout_name}"
    if k.shape[:-1] != v.shape[:-1]:
        kv_value = kv_layout.replace("D]", "Dv]")
        return Problem(ValueError, f"k {kv_layout} and v {kv_value} must agree in all but the head dim, got "
                                   f"{tuple(k.shape)} and {tuple(v.shape)}")
    if not packed and k.shape[0] != q.shape[0]:
        return Problem(ValueError, f"k batch size {k.shape[0]} does not match q batch size {q.shape[0]} ({layout})")
    D = q.shape[-1]
    if k.shape[-1] != D:
        return Problem(ValueError, f"k head dim {k.shape[-1]} does not match q head dim {D} ({layout})")
    if not 1 <= D <= MAX_HEAD_DIM:
        return Problem(ValueError, f"head dim D={D} is not supported; use 1 <= D <= {MAX_HEAD_DIM} (the last dim of "
                                   f"{layout_name})")
    Dv = v.shape[-1]
    if not 1 <= Dv <= MAX_HEAD_DIM:
        return Problem(ValueError, f"value head dim Dv={Dv} is not supported; use 1 <= Dv <= {MAX_HEAD_DIM} (the "
                                   f"last dim of v; it may differ from q's and k's D={D})")
    Hq, Hkv = q.shape[-2 if packed else 1], k.shape[-2 if packed else 1]
    if Hkv == 0 or Hq % Hkv != 0:
        hint = _FA_HINT if not packed and _fits_bnhd(q, k) else ""
        return Problem(ValueError, f"q heads Hq={Hq} must be a multiple of k/v heads Hkv={Hkv} (GQA/MQA; {layout})"
                                   f"{hint}")
    if packed and (q.shape[0] == 0 or k.shape[0] == 0):
        return Problem(ValueError, f"the packed sequences must hold at least one token, got total_q={q.shape[0]}, "
                                   f"total_k={k.shape[0]}")
    if not packed and (q.shape[2] == 0 or k.shape[2] == 0):
        return Problem(ValueError, f"sequence lengths must be >= 1, got Nq={q.shape[2]}, Nk={k.shape[2]} ({layout})")
    return None


def forward_mode_problem(*tensors: Any) -> Problem | None:
    """Forward-mode differentiation (``torch.func.jvp``, ``torch.autograd.forward_ad``) of a call: refused.

    The ops define a backward only; without this rule forward mode gives a silently zero tangent (``jvp``) or
    none (a dual tensor's level). A traced call is left to the tracer (reading functorch's stack would break the
    graph)."""
    if torch.compiler.is_compiling():
        return None
    dual = forward_ad._current_level >= 0 and any(
        isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors)
    if not dual and torch._C._functorch.peek_interpreter_stack() is not None:
        dual = any(i.key() == torch._C._functorch.TransformType.Jvp for i in retrieve_all_functorch_interpreters())
    if dual:
        return Problem(NotImplementedError, "stable_attn computes no forward-mode derivative (torch.func.jvp, "
                                            "torch.func.jacfwd, torch.autograd.forward_ad); use reverse mode "
                                            "(backward, torch.func.grad/vjp/jacrev)")
    return None


def dense_problem(q: Any, k: Any, v: Any, key_padding_mask: Any = None, attn_mask: Any = None,
                  sinks: Any = None) -> Problem | None:
    """What is wrong with an ``attention()`` call's q, k, v (``[B, H, N, D]``), masks and sinks, or None."""
    problem = (_qkv_problem(q, k, v, packed=False) or sinks_problem(sinks, q, q.shape[1])
               or forward_mode_problem(q, k, v, sinks))
    if problem is not None:
        return problem
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    layout = f"q {tuple(q.shape)} and k {tuple(k.shape)} as [B, H, N, D]"
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            got = getattr(key_padding_mask, "dtype", type(key_padding_mask).__name__)
            return Problem(TypeError, f"key_padding_mask must be a bool tensor (True = attend), got {got}")
        if tuple(key_padding_mask.shape) != (B, Nk):
            fits = tuple(key_padding_mask.shape) == (B, k.shape[1]) and _fits_bnhd(q, k)
            return Problem(ValueError, f"key_padding_mask must have shape [B, Nk] = {(B, Nk)} ({layout}), got "
                                       f"{tuple(key_padding_mask.shape)}{_FA_HINT if fits else ''}")
        if key_padding_mask.device != q.device:
            return Problem(ValueError, f"key_padding_mask is on {key_padding_mask.device}, q on {q.device}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            return Problem(TypeError, f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
        if not _mask_dtype_ok(attn_mask):
            return Problem(TypeError, f"attn_mask.dtype={attn_mask.dtype}: use bool (True = attend) or a float "
                                      "additive mask")
        if not broadcasts(attn_mask, (B, Hq, Nq, Nk)):
            fits = _fits_bnhd(q, k) and broadcasts(attn_mask, (B, q.shape[2], q.shape[1], k.shape[1]))
            return Problem(ValueError, f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                                       f"[B, Hq, Nq, Nk] = {(B, Hq, Nq, Nk)} ({layout}){_FA_HINT if fits else ''}")
        if _mask_needs_grad(attn_mask):
            return Problem(ValueError, "attn_mask requires grad, but stable_attn returns no gradient for attention "
                                       "masks; detach it if it is constant")
        if attn_mask.device != q.device:
            return Problem(ValueError, f"attn_mask is on {attn_mask.device}, q on {q.device}")
    return None


# Models rarely have more than 128 attention heads (Llama 3.1 405B and DeepSeek-V3 have 128), and "heads" this
# many times the queries per head, on more than 64 of them, read more like a sequence axis: the layout doubt below.
COMMON_MAX_HEADS = 128
HEADS_PER_QUERY = 16


# The layouts attention() takes (its layout= argument); None is "bhnd" with the wrong-layout check
LAYOUTS = {"bhnd": "[B, H, N, D] (SDPA's, the default)", "bnhd": "[B, N, H, D] (FlashAttention's)"}


def layout_problem(layout: Any) -> Problem | None:
    """What is wrong with ``attention()``'s ``layout`` argument, or None."""
    if layout is None or (isinstance(layout, str) and layout in LAYOUTS):
        return None
    accepted = ", ".join(f"{name!r} ({what})" for name, what in LAYOUTS.items())
    return Problem(ValueError, f"layout={layout!r} is not supported; use {accepted} or None (the default: 'bhnd', "
                               "with the check that warns when the shapes look like the other one)")


def both_layouts_fit(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """Whether q, k that :func:`dense_problem` accepts as ``[B, H, N, D]`` would be a valid call read as
    ``[B, N, H, D]`` too: its heads ``q.shape[2]`` a multiple of ``k.shape[2]``, at least 2 of them, and with
    ``causal`` no query without a key. Then only the shapes' sizes (:func:`layout_doubt`) or the caller can tell."""
    H, Nq = q.shape[1], q.shape[2]
    Hkv, Nk = k.shape[1], k.shape[2]
    return Nq >= 2 and Nk >= 1 and Nq % Nk == 0 and (not causal or H <= Hkv)


def layout_doubt(q: torch.Tensor, k: torch.Tensor, causal: bool) -> str | None:
    """Why q, k of a call that :func:`dense_problem` accepts as ``[B, H, N, D]`` look like FlashAttention's
    ``[B, N, H, D]`` instead (a phrase for a WARNING), or None. Shapes only: no tensor data is read.

    Only when the other reading is a valid call too (:func:`both_layouts_fit`) and one of these holds:

    - ``causal`` with ``Nq > Nk`` leaves the first ``Nq - Nk`` query rows of every head without a key (their
      output is zeros): what FlashAttention's GQA tensors ``[B, N, Hq, D]``, ``[B, N, Hkv, D]`` give;
    - without ``causal``, the same GQA tensors: as many heads for q as for k, ``Nq > Nk`` queries and keys no more
      than :data:`COMMON_MAX_HEADS` (head counts), and more heads than queries (the heads are a sequence axis);
    - more than :data:`COMMON_MAX_HEADS` / 2 heads and at least :data:`HEADS_PER_QUERY` times as many heads as
      queries per head (or more than :data:`COMMON_MAX_HEADS` heads and 8 times).

    Decoding (``Nq == 1``), GQA prompts (``Hq != Hkv`` with ``causal``), long sequences with few heads, short
    prompts of models with up to 64 heads and cross-attention with fewer heads than queries never raise it.
    Multi-head self-attention whose tokens and heads could trade places (``[1, 32, 16, D]``: 32 heads of 16 tokens,
    or 16 heads of 32 tokens) cannot be told from its shapes: ``attention(layout=...)`` says which, and
    ``set_layout_check("error")`` makes every such call say it.
    """
    if not both_layouts_fit(q, k, causal):
        return None
    _, H, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    read = f"{H} heads of {Nq} queries over {Nk} keys"
    if causal and Nq > Nk:
        return (f"{read}, and causal leaves {Nq - Nk} of every head's {Nq} query rows without a key (their output "
                "is zeros)")
    if not causal and Nq > Nk and H == Hkv and Nq <= COMMON_MAX_HEADS and H > Nq:
        return f"{read}: fewer keys than queries in every head, as a GQA model's heads would give"
    if (H > COMMON_MAX_HEADS // 2 and H >= HEADS_PER_QUERY * Nq) or (H > COMMON_MAX_HEADS and H >= 8 * Nq):
        return f"{read}: more heads than models use, with few queries each"
    return None


def packed_problem(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                   max_seqlen_k: Any, sinks: Any = None) -> Problem | None:
    """What is wrong with the shapes, dtypes and devices of an ``attention_varlen()`` call, or None."""
    problem = (_qkv_problem(q, k, v, packed=True) or sinks_problem(sinks, q, q.shape[1])
               or forward_mode_problem(q, k, v, sinks))
    if problem is not None:
        return problem
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            return Problem(TypeError, f"{name} must be an int32 tensor [batch + 1], got {type(cu).__name__}")
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
            return Problem(ValueError, f"{name} must be an int32 tensor of shape [batch + 1] (batch >= 1), got dtype "
                                       f"{cu.dtype} and shape {tuple(cu.shape)}")
        if cu.device != q.device:
            return Problem(ValueError, f"{name} is on {cu.device}, q on {q.device}; put it on q's device")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        return Problem(ValueError, f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                                   f"shapes {tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not ((is_int(m) or isinstance(m, torch.SymInt)) and m >= 1):
            return Problem(ValueError, f"{name}={m!r} must be a positive int (the longest sequence's length)")
    return None


def sdpa_problem(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any, is_causal: Any, scale: Any,
                 enable_gqa: Any, extra: dict) -> str | None:
    """Why a ``scaled_dot_product_attention`` call cannot go to ``attention()`` (a short phrase), or None."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "non-tensor inputs"
    if any(t.is_nested for t in tensors):
        return "nested tensors"
    if extra:
        return f"arguments stable_attn does not know ({', '.join(sorted(extra))})"
    if any(t.dim() != 4 for t in tensors):
        return f"inputs of rank {query.dim()}/{key.dim()}/{value.dim()} (stable_attn takes [B, H, N, D])"
    if any(t.dtype not in rules.SUPPORTED_DTYPES for t in tensors) or not query.dtype == key.dtype == value.dtype:
        return f"dtypes {query.dtype}/{key.dtype}/{value.dtype} (stable_attn takes one of float16, bfloat16, float32)"
    if not query.device == key.device == value.device:
        return "inputs on different devices"
    B, Hq, Nq, D = query.shape
    if key.shape[:3] != value.shape[:3] or key.shape[3] != D:
        return "a key head dim that differs from the query's, or key and value shapes apart in more than the head dim"
    if max(D, value.shape[3]) > MAX_HEAD_DIM:
        return f"head dim {max(D, value.shape[3])} > {MAX_HEAD_DIM}"
    if key.shape[0] != B:
        return "batch broadcasting between query and key"
    Hkv, Nk = key.shape[1], key.shape[2]
    if Hkv != Hq and not (enable_gqa and Hkv > 0 and Hq % Hkv == 0):
        return "query and key head counts that sdpa only accepts with enable_gqa=True"
    if Nq == 0 or Nk == 0:
        return "an empty sequence"
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        return f"dropout_p={dropout_p!r}"
    problem = scale_problem(scale)
    if problem is not None:
        return problem
    if attn_mask is not None:
        if is_causal:
            return "attn_mask together with is_causal=True"
        if not isinstance(attn_mask, torch.Tensor) or attn_mask.is_nested:
            return "an attn_mask that is not a plain tensor"
        if not _mask_dtype_ok(attn_mask):
            return f"an attn_mask of dtype {attn_mask.dtype}"
        if _mask_needs_grad(attn_mask):
            return "an attn_mask that requires grad (stable_attn returns no gradient for masks)"
        if attn_mask.device != query.device:
            return "an attn_mask on another device"
        if not broadcasts(attn_mask, (B, Hq, Nq, Nk)):
            return f"an attn_mask of shape {tuple(attn_mask.shape)} that does not broadcast to {(B, Hq, Nq, Nk)}"
    # whatever attention() itself would refuse (the rules above only phrase the common cases for sdpa users)
    problem = dense_problem(query, key, value, attn_mask=attn_mask)
    return None if problem is None else problem.message
