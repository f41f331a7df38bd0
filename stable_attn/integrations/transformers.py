"""Hugging Face transformers: ``attn_implementation="stable_attn"``.

:func:`register` adds two functions to transformers under the name ``"stable_attn"``:

- :func:`stable_attn_mask`, the mask builder (``AttentionMaskInterface``). Models call it through
  ``create_causal_mask`` / ``create_sliding_window_causal_mask`` / ``create_bidirectional_mask`` and pass
  whatever it returns, untouched, to the attention function. It recognizes the mask patterns the fused
  kernel takes as flags -- causal (bottom-right aligned, as with a KV cache), causal with a left sliding
  window, bidirectional -- each with an optional key-padding mask, and returns a :class:`StableAttnMask`
  describing them: no ``[B, 1, Nq, Nk]`` tensor is built. The mask ``masking_utils`` builds for packed
  sequences (``position_ids`` that restart, no 2D mask, no cache) over a causal or sliding-window
  pattern is recognized too and becomes a :class:`StableAttnMask` holding the documents' ``cu_seqlens``.
  Anything else (chunked or block-wise attention, custom ``or``/``and`` mask functions, a static cache
  whose query offset is a tensor) gets the exact boolean 4D mask from transformers' own ``sdpa_mask``,
  which the attention op serves on its PyTorch path (stabilized, slower; the op logs that once).
- :func:`stable_attn_attention_forward`, the attention function (``AttentionInterface``). It maps the
  model's arguments (``scaling``, ``dropout``, ``softcap``, ``sliding_window``, GQA key/value heads) to
  :func:`stable_attn.attention` and returns ``(out [B, N, H, D], None)``. Packed documents (padding-free
  training, e.g. ``DataCollatorWithFlattening``) go to :func:`stable_attn.attention_varlen`, one
  sequence per document and no padding, whatever ``use_cache`` is: from the packed mask above, from
  FlashAttention's ``cu_seq_lens_q/k`` and ``max_length_q/k`` keyword arguments, or, with a plain causal
  mask (a cache makes ``masking_utils`` skip packing), from ``position_ids`` as ``flash_attention_2``
  reads them (see :func:`packed_documents`).

Recognition reads the closures transformers' ``masking_utils`` builds (``causal_mask_function``,
``and_masks(sliding_window_overlay(W), causal_mask_function)``, ``bidirectional_mask_function``). If a
future transformers builds them differently, recognition fails and the exact 4D mask is used: slower,
never wrong.

Options per model (``stabilize``, ``beta``, ``backend``, ``block_n``): :func:`configure`, or a dict in the
model config, ``config.stable_attn = {"beta": 4.0}`` (saved with the config). Per-layer statistics:
:func:`attach_stats` / :func:`detach_stats`. Features the fused op cannot compute (attention weights for
``output_attentions=True``, attention sinks, sparse-attention indices, T5-style ``position_bias``, a
learned (requires-grad) additive mask, ``value`` head dim != ``query`` head dim) raise at the first
forward, naming the feature and the model. A model whose attention does not dispatch through
``AttentionInterface`` never reaches stable_attn; :func:`attach_stats` and :func:`configure` raise for it.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import masking_utils
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from ..attention import attention
from ..options import DEFAULTS, MODEL_OPTIONS, Stabilize, model_options
from ..stats import AttentionStats
from ..varlen import attention_varlen

NAME = "stable_attn"
# The options a model sets (configure() or config.stable_attn), with their defaults (options.DEFAULTS).
OPTION_DEFAULTS: dict[str, Any] = {name: DEFAULTS[name] for name in MODEL_OPTIONS}
# Arguments some models pass that change the attention in ways the fused op cannot reproduce.
_UNSUPPORTED_KWARGS = {
    "s_aux": "attention sinks (`s_aux`)",
    "sinks": "attention sinks (`sinks`)",
    "indices": "sparse attention (`indices`)",
    "block_indices": "block-sparse attention (`block_indices`)",
    "position_bias": "an additive relative position bias (`position_bias`, T5 style)",
    "head_mask": "a per-head mask (`head_mask`)",
}


@dataclass(frozen=True)
class StableAttnMask:
    """An attention mask as the fused kernel takes it: flags plus an optional key-padding mask.

    Returned by the ``"stable_attn"`` mask builder in place of a ``[B, 1, Nq, Nk]`` tensor. It is not a
    tensor on purpose: model code that tried to use it as one fails loudly instead of applying half a mask.

    - ``causal``: query ``i`` sees keys ``j <= i + (kv_length - q_length)`` (bottom-right alignment);
    - ``window``: left sliding window ``W`` (with ``causal``): query at position ``p`` sees ``p - W < j``;
    - ``key_padding_mask``: ``[B, kv_length]`` bool, True = attend; None when nothing is padded.
    - ``cu_seqlens``: packed documents (then ``q_length == kv_length`` and nothing is padded): int32
      ``[n_docs + 1]`` offsets into the ``B * q_length`` tokens of the batch, rows flattened in order;
      ``causal`` and ``window`` then hold within each document, and no token sees another document.
      ``max_seqlen`` is the longest document. None when the batch is not packed.
    """

    causal: bool
    window: int | None
    key_padding_mask: torch.Tensor | None
    q_length: int
    kv_length: int
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0

    def __repr__(self) -> str:
        kpm = None if self.key_padding_mask is None else tuple(self.key_padding_mask.shape)
        docs = "" if self.cu_seqlens is None else f", documents={self.cu_seqlens.numel() - 1}"
        return (f"StableAttnMask(causal={self.causal}, window={self.window}, key_padding_mask={kpm}, "
                f"q_length={self.q_length}, kv_length={self.kv_length}{docs})")


# ---------------------------------------------------------------------------------------------------
# Mask builder


def _closure_vars(fn: Callable) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return out


def _made_by(fn: Callable, qualname: str) -> bool:
    return getattr(fn, "__module__", None) == masking_utils.__name__ and getattr(fn, "__qualname__", None) == qualname


def recognize_mask_function(mask_function: Callable) -> tuple[bool, int | None] | None:
    """``(causal, window)`` if ``mask_function`` is one of transformers' plain patterns, else None.

    Exact identity and closure checks only: a function that merely behaves like a causal mask is not
    recognized (and then gets the materialized mask, which is always right).
    """
    if mask_function is masking_utils.causal_mask_function:
        return True, None
    if mask_function is getattr(masking_utils, "bidirectional_mask_function", None):  # absent before 5.0
        return False, None
    if _made_by(mask_function, "and_masks.<locals>.and_mask"):
        parts = _closure_vars(mask_function).get("mask_functions")
        if (isinstance(parts, tuple) and len(parts) == 2 and parts[1] is masking_utils.causal_mask_function
                and _made_by(parts[0], "sliding_window_overlay.<locals>.inner_mask")):
            window = _closure_vars(parts[0]).get("sliding_window")
            if isinstance(window, int) and not isinstance(window, bool) and window >= 1:
                return True, window
    return None


def recognize_packed_mask_function(mask_function: Callable) -> tuple[bool, int | None, torch.Tensor] | None:
    """``(causal, window, segment_ids)`` if ``mask_function`` is masking_utils' packed-sequence mask, else None.

    That mask is ``and_masks(remap_positions_for_packed_sequence(pattern, position_ids),
    packed_sequence_mask_function(segment_ids))`` (transformers before the remap: ``and_masks(pattern,
    packed_sequence_mask_function(segment_ids))``): ``pattern`` (causal, or causal with a sliding
    window) read at the tokens' positions (or indices), and only within a document (``segment_ids[b, i]``,
    from ``find_packed_sequence_indices``: a new document wherever the position does not grow by 1).
    Inside a document the positions grow by 1, so the pattern on positions is the pattern on token
    indices, and the whole mask is ``pattern`` per document: what the varlen kernel computes.
    """
    if not _made_by(mask_function, "and_masks.<locals>.and_mask"):
        return None
    parts = _closure_vars(mask_function).get("mask_functions")
    if not (isinstance(parts, tuple) and len(parts) == 2
            and _made_by(parts[1], "packed_sequence_mask_function.<locals>.inner_mask")):
        return None
    inner = parts[0]
    if _made_by(inner, "remap_positions_for_packed_sequence.<locals>.inner_mask"):
        inner = _closure_vars(inner).get("mask_function")
    pattern = None if inner is None else recognize_mask_function(inner)
    segment_ids = _closure_vars(parts[1]).get("packed_sequence_mask")
    if pattern is None or not pattern[0] or not isinstance(segment_ids, torch.Tensor) or segment_ids.dim() != 2:
        return None
    return pattern[0], pattern[1], segment_ids


def _documents(starts: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """``(cu_seqlens, max_seqlen)`` of the documents that begin where ``starts`` ``[B, N]`` is True.

    Every row begins a document (one never spans two rows); rows are flattened in order. None when
    each row holds a single document: the batch is not packed, and the dense kernel serves it as it is.
    """
    starts = starts.clone()
    starts[:, 0] = True
    first = starts.reshape(-1).nonzero().reshape(-1)
    if first.numel() == starts.shape[0]:
        return None
    cu_seqlens = torch.cat([first, first.new_tensor([starts.numel()])]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def packed_documents(position_ids: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, int] | None:
    """``(cu_seqlens, max_seqlen)`` of the documents packed in ``position_ids`` ``[B|1, N]``, or None.

    A document begins wherever the position does not grow by exactly 1 from the previous token (and at
    every row's first token): the rule of ``masking_utils.find_packed_sequence_indices``, so that with
    or without a cache the documents are the ones transformers' own packed mask separates. For
    ``DataCollatorWithFlattening`` (positions restart at 0 per document) that is also where
    ``flash_attention_2`` cuts; unlike it, several packed rows (``B > 1``) are served, each row's
    documents on their own. Reads the values: one host synchronization per call.
    """
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch_size):
        raise ValueError(f"position_ids of shape {tuple(position_ids.shape)}: expected [B, N] or [1, N] with "
                         f"B = {batch_size}")
    position_ids = position_ids.expand(batch_size, -1)
    starts = torch.zeros(position_ids.shape, dtype=torch.bool, device=position_ids.device)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return _documents(starts)


def _key_padding(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    missing = kv_offset + kv_length - mask.shape[-1]
    if missing > 0:  # keys beyond the 2D mask (a static cache's empty slots) are padding, as in transformers
        mask = torch.nn.functional.pad(mask, (0, missing), value=False)
    kpm = mask[:, kv_offset:kv_offset + kv_length]
    if bool(kpm.all()):  # the same host sync transformers' sdpa mask does to skip the mask
        return None
    return kpm.contiguous()


def _query_positions(kwargs: dict) -> tuple[int, int | None]:
    """``(q_length, q_offset)`` from either mask-builder signature; ``q_offset`` None if not a plain int.

    transformers >= 5.1x passes ``q_length``/``q_offset``; 5.0 passed ``cache_position`` (the queries'
    absolute positions), which the kernel's alignment can express only when it is a contiguous range.
    """
    if "q_length" in kwargs:
        q_offset = kwargs.get("q_offset", 0)
        ok = isinstance(q_offset, int) and not isinstance(q_offset, bool)
        return int(kwargs["q_length"]), q_offset if ok else None
    positions = kwargs.get("cache_position")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.numel() == 0:
        raise TypeError("stable_attn_mask needs q_length (transformers >= 5.1x) or cache_position (5.0)")
    first = int(positions[0])
    contiguous = torch.equal(positions, torch.arange(first, first + positions.numel(), device=positions.device))
    return positions.numel(), first if contiguous else None


def _packed_mask(mask_function: Callable, batch_size: int, length: int, local_size: int | None,
                 ) -> StableAttnMask | None:
    """The :class:`StableAttnMask` of masking_utils' packed-sequence mask (no cache, no 2D mask), else None."""
    packed = recognize_packed_mask_function(mask_function)
    if packed is None:
        return None
    causal, window, segment_ids = packed
    if tuple(segment_ids.shape) != (batch_size, length) or (window is not None and local_size not in (None, window)):
        return None
    starts = torch.zeros(segment_ids.shape, dtype=torch.bool, device=segment_ids.device)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    documents = _documents(starts)
    return StableAttnMask(causal, window, None, length, length, *(documents or ()))


def stable_attn_mask(
    batch_size: int,
    kv_length: int,
    kv_offset: int = 0,
    mask_function: Callable = masking_utils.causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> StableAttnMask | torch.Tensor:
    """Mask builder registered with ``AttentionMaskInterface`` (the signature of ``sdpa_mask``).

    Returns a :class:`StableAttnMask` for the patterns the kernel takes as flags (and for masking_utils'
    packed-sequence mask over them, with the documents' ``cu_seqlens``), else the boolean
    ``[B, 1, q_length, kv_length]`` mask of ``transformers.masking_utils.sdpa_mask`` (True = attend).
    Query positions come as ``q_length``/``q_offset`` (current transformers) or ``cache_position``
    (transformers 5.0); everything else is passed to ``sdpa_mask`` unchanged.
    """
    q_length, q_offset = _query_positions(kwargs)
    if (not use_vmap and attention_mask is None and q_offset == 0 and isinstance(kv_offset, int) and kv_offset == 0
            and q_length == kv_length):
        packed = _packed_mask(mask_function, batch_size, q_length, local_size)
        if packed is not None:
            return packed
    pattern = None if use_vmap else recognize_mask_function(mask_function)
    if pattern is not None and q_offset is not None and isinstance(kv_offset, int):
        causal, window = pattern
        # the kernel aligns causal masks bottom-right; the mask builder's positions must agree with that
        aligned = not causal or q_offset - kv_offset == kv_length - q_length
        if aligned and (window is None or local_size in (None, window)):
            return StableAttnMask(causal, window, _key_padding(attention_mask, kv_length, kv_offset),
                                  q_length, int(kv_length))
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return masking_utils.sdpa_mask(
        batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset, mask_function=mask_function,
        attention_mask=attention_mask, local_size=local_size, use_vmap=use_vmap, **kwargs,
    )


# ---------------------------------------------------------------------------------------------------
# Attention function


def _who(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    return type(module).__name__ + (f" (model_type={model_type!r})" if model_type else "")


def _wants_attention_weights(module: nn.Module, kwargs: dict) -> bool:
    requested = kwargs.get("output_attentions")
    if requested is None:
        requested = getattr(getattr(module, "config", None), "output_attentions", False)
    return bool(requested)


def _options(module: nn.Module) -> dict[str, Any]:
    own = getattr(module, "stable_attn_options", None)
    if own is not None:
        return own
    # config.stable_attn: a dict or None, checked and completed with the defaults
    from_config = getattr(getattr(module, "config", None), "stable_attn", None)
    return model_options(from_config, where=f"{_who(module)}: config.stable_attn")


def stable_attn_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: StableAttnMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered with ``AttentionInterface`` as ``"stable_attn"``.

    ``query`` ``[B, Hq, Nq, D]``, ``key``/``value`` ``[B, Hkv, Nk, D]`` (the model's KV heads: GQA is
    served without repeating them). ``attention_mask`` is what :func:`stable_attn_mask` returned: a
    :class:`StableAttnMask`, a 4D bool/additive tensor (which then holds causality, window and padding,
    as for sdpa), or None (no mask was built: causality comes from ``is_causal`` or ``module.is_causal``,
    the window from ``sliding_window``). Dropout applies only while ``module.training``, as in eager.

    Packed documents, with no padding and no arbitrary mask, go to :func:`stable_attn.attention_varlen`
    on ``[B * N, H, D]`` views, taken (as ``flash_attention_2`` does) from FlashAttention's
    ``cu_seq_lens_q/k`` + ``max_length_q/k`` keyword arguments, else from the packed mask, else, for a
    causal self-attention call, from ``position_ids`` (:func:`packed_documents`).
    """
    who = _who(module)
    if _wants_attention_weights(module, kwargs):
        raise ValueError(
            f"stable_attn: {who} was asked for attention weights (output_attentions=True); the fused kernel "
            "never materializes them. Load or switch the model with attn_implementation='eager' for that call."
        )
    for name, feature in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"stable_attn: {who} uses {feature}, which stable_attn does not implement; "
                             "use attn_implementation='eager' for this model")
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"stable_attn: {who} has value head dim {value.shape[-1]} != query head dim "
                         f"{query.shape[-1]} (e.g. multi-head latent attention), which stable_attn does not implement")

    causal, window, key_padding_mask, attn_mask, documents = False, None, None, None, None
    if isinstance(attention_mask, StableAttnMask):
        if attention_mask.kv_length != key.shape[2] or attention_mask.q_length != query.shape[2]:
            raise RuntimeError(
                f"stable_attn: {who}: the mask was built for q_length={attention_mask.q_length}, "
                f"kv_length={attention_mask.kv_length} but the layer got query length {query.shape[2]} and key "
                f"length {key.shape[2]} (a cache whose sizes disagree with the model's mask)"
            )
        causal, window, key_padding_mask = attention_mask.causal, attention_mask.window, attention_mask.key_padding_mask
        if attention_mask.cu_seqlens is not None:
            cu, longest = attention_mask.cu_seqlens, attention_mask.max_seqlen
            documents = cu, cu, longest, longest
    elif attention_mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        window = sliding_window
    elif isinstance(attention_mask, torch.Tensor):
        if attention_mask.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"stable_attn: {who} passes a learned additive attention mask (it requires grad); "
                             "stable_attn does not return a gradient for attention masks")
        attn_mask = attention_mask
    else:
        raise TypeError(f"stable_attn: {who} passed an attention mask of type {type(attention_mask).__name__}; "
                        "stable_attn takes its own mask, a 4D bool/additive tensor, or None")
    if attn_mask is None and key_padding_mask is None:
        # as flash_attention_2: explicit cu_seq_lens first, then the packed mask, then position_ids
        documents = _flash_kwargs_documents(kwargs, who) or documents
        if documents is None and causal and query.shape[2] == key.shape[2] > 1:
            documents = _position_documents(kwargs.get("position_ids"), query.shape[0], query.shape[2])

    stats = getattr(module, "stable_attn_stats", None)
    if stats is not None and not stats.enabled:
        stats = None
    opts = _options(module)
    common = dict(causal=causal, scale=scaling, window=window, softcap=softcap or None,
                  dropout_p=float(dropout) if module.training else 0.0, stabilize=opts["stabilize"],
                  beta=opts["beta"], stats=stats, backend=opts["backend"], block_n=opts["block_n"])
    try:
        if documents is not None:
            B, Nq = query.shape[0], query.shape[2]
            # [B, H, N, D] -> [B * N, H, D]: a view for one packed row (DataCollatorWithFlattening's layout)
            q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (query, key, value))
            out = attention_varlen(q, k, v, *documents, **common)
            return out.view(B, Nq, *out.shape[1:]), None
        out = attention(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask, **common)
    except (ValueError, TypeError) as err:
        raise type(err)(f"stable_attn: {who}: {err}") from err
    return out.transpose(1, 2).contiguous(), None


_FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _flash_kwargs_documents(kwargs: dict, who: str) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """FlashAttention's varlen keyword arguments (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``)."""
    given = [kwargs.get(name) for name in _FLASH_KWARGS]
    if all(x is None for x in given):
        return None
    if any(x is None for x in given):
        missing = [name for name, x in zip(_FLASH_KWARGS, given) if x is None]
        raise ValueError(f"stable_attn: {who} got some of FlashAttention's varlen arguments but not {missing}; "
                         f"pass all of {list(_FLASH_KWARGS)} or none")
    cu_q, cu_k, max_q, max_k = given
    return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)


# packed_documents of the last position_ids seen: every layer of one forward gets the same tensor
_last_documents: tuple[weakref.ref, int, int, tuple | None] | None = None


def _position_documents(position_ids: Any, batch_size: int, length: int,
                        ) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    global _last_documents
    # other layouts (e.g. multimodal RoPE's [3, B, N]) carry no document boundaries we know how to read
    if (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
            or position_ids.shape[0] not in (1, batch_size) or position_ids.shape[1] != length):
        return None
    try:
        version = position_ids._version  # changes on every in-place write
    except RuntimeError:  # inference tensors keep no version: no reuse
        version = None
    last = _last_documents
    if (version is not None and last is not None and last[0]() is position_ids and last[1] == version
            and last[2] == batch_size):
        return last[3]
    found = packed_documents(position_ids, batch_size)
    documents = None if found is None else (found[0], found[0], found[1], found[1])
    if version is not None:
        _last_documents = (weakref.ref(position_ids), version, batch_size, documents)
    return documents


def register() -> None:
    """Register ``"stable_attn"`` with transformers (attention function and mask builder). Idempotent."""
    AttentionInterface.register(NAME, stable_attn_attention_forward)
    AttentionMaskInterface.register(NAME, stable_attn_mask)


# ---------------------------------------------------------------------------------------------------
# Per-model helpers: finding attention modules, options, statistics

_calls_interface_cache: dict[type, bool] = {}


def _calls_attention_interface(cls: type) -> bool:
    """Whether ``cls.forward`` dispatches through transformers' ``AttentionInterface``.

    That module is exactly the ``module`` argument the attention function receives. The test reads the
    source, as transformers itself does to decide whether a model can switch implementations.
    """
    if cls not in _calls_interface_cache:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        _calls_interface_cache[cls] = "ALL_ATTENTION_FUNCTIONS" in source
    return _calls_interface_cache[cls]


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every attention module of ``model``, in module order.

    An attention module is one whose ``forward`` calls transformers' ``ALL_ATTENTION_FUNCTIONS`` (e.g.
    ``LlamaAttention``, ``GPT2Attention``, ``BertSelfAttention``); it is what the attention function gets
    as ``module``. Module order is layer order for every transformers model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return [(name, m) for name, m in model.named_modules() if _calls_attention_interface(type(m))]


def _require_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = attention_modules(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention module that dispatches through transformers' "
            "AttentionInterface, so attn_implementation='stable_attn' cannot reach it"
        )
    return found


def configure(
    model: nn.Module,
    *,
    stabilize: Stabilize = DEFAULTS["stabilize"],
    beta: float = DEFAULTS["beta"],
    backend: str = DEFAULTS["backend"],
    block_n: int | None = DEFAULTS["block_n"],
) -> None:
    """Set the :func:`stable_attn.attention` options every attention layer of ``model`` uses.

    Takes precedence over ``config.stable_attn``. Values are checked here (``options.model_options``).
    """
    options = model_options({"stabilize": stabilize, "beta": beta, "backend": backend, "block_n": block_n},
                            where="configure")
    for _, module in _require_attention_modules(model):
        module.stable_attn_options = dict(options)


def attach_stats(model: nn.Module) -> dict[str, AttentionStats]:
    """Attach an :class:`AttentionStats` to every attention layer; returns ``{"layer{i}": stats}``.

    ``i`` counts attention modules in module order (the decoder layer index for models with one
    attention per layer). Stats already attached are kept and returned, so calling this twice is safe.
    They fill on every forward that runs through ``"stable_attn"`` while ``stats.enabled`` is True.
    """
    out = {}
    for i, (_, module) in enumerate(_require_attention_modules(model)):
        stats = getattr(module, "stable_attn_stats", None)
        if not isinstance(stats, AttentionStats):
            stats = AttentionStats()
            module.stable_attn_stats = stats
        out[f"layer{i}"] = stats
    return out


def detach_stats(model: nn.Module) -> None:
    """Remove the statistics :func:`attach_stats` attached (no-op where there are none)."""
    for _, module in attention_modules(model):
        if hasattr(module, "stable_attn_stats"):
            del module.stable_attn_stats


__all__ = [
    "NAME",
    "StableAttnMask",
    "attach_stats",
    "attention_modules",
    "configure",
    "detach_stats",
    "recognize_mask_function",
    "register",
    "stable_attn_attention_forward",
    "stable_attn_mask",
]
