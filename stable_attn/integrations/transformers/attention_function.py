"""The ``"stable_attn"`` attention function (transformers' ``AttentionInterface``).

It maps a model's arguments to :func:`stable_attn.attention`, or, for packed documents, to
:func:`stable_attn.attention_varlen`; both are looked up in this module at call time (the numerics
probe replaces ``attention`` here while it records a model's calls).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stable_attn.attention import attention
from stable_attn.integrations.transformers import dispatch
from stable_attn.integrations.transformers.masks import (
    StableAttnMask,
    device_documents,
    position_starts,
    rotate_filled_prefix,
)
from stable_attn.integrations.transformers.models import _who, model_options_of
from stable_attn.varlen import attention_varlen

# Arguments some models pass that change the attention in ways the fused op cannot reproduce.
_UNSUPPORTED_KWARGS = {
    "indices": "sparse attention (`indices`)",
    "block_indices": "block-sparse attention (`block_indices`)",
    "position_bias": "an additive relative position bias (`position_bias`, T5 style)",
    "head_mask": "a per-head mask (`head_mask`)",
}


def _wants_attention_weights(module: nn.Module, kwargs: dict) -> bool:
    requested = kwargs.get("output_attentions")
    if requested is None:
        requested = getattr(getattr(module, "config", None), "output_attentions", False)
    return bool(requested)


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

    ``query`` ``[B, Hq, Nq, D]``, ``key`` ``[B, Hkv, Nk, D]``, ``value`` ``[B, Hkv, Nk, Dv]`` (the model's KV heads:
    GQA is served without repeating them; ``Dv`` may differ from ``D``, multi-head latent attention, and the output
    has ``Dv``). Learned sinks (``s_aux``, gpt-oss's name, which FlashAttention's and flex attention's integrations
    take too; ``[Hq]``) go to the op's ``sinks``. ``attention_mask`` is what :func:`stable_attn_mask` returned: a
    :class:`StableAttnMask`, a 4D bool/additive tensor (which then holds causality, window and padding, as for
    sdpa), or None (no mask was built: causality comes from ``is_causal`` or ``module.is_causal``, the window from
    ``sliding_window``). Dropout applies only while ``module.training``, as in eager.

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
    sinks = kwargs.get("s_aux")

    causal, window, key_padding_mask, attn_mask, documents = False, None, None, None, None
    read_positions, memo = True, None
    if isinstance(attention_mask, StableAttnMask):
        if attention_mask.kv_length != key.shape[2] or attention_mask.q_length != query.shape[2]:
            raise RuntimeError(
                f"stable_attn: {who}: the mask was built for q_length={attention_mask.q_length}, "
                f"kv_length={attention_mask.kv_length} but the layer got query length {query.shape[2]} and key "
                f"length {key.shape[2]} (a cache whose sizes disagree with the model's mask)"
            )
        causal, window, key_padding_mask = attention_mask.causal, attention_mask.window, attention_mask.key_padding_mask
        read_positions, memo = attention_mask.read_positions, attention_mask.memo
        if attention_mask.kv_used is not None:  # a static cache: only its filled prefix can be seen
            key, value = key[:, :, :attention_mask.kv_used], value[:, :, :attention_mask.kv_used]
        if attention_mask.kv_end is not None:  # the same, traced: the prefix's length is a tensor
            key, value, key_padding_mask = rotate_filled_prefix(key, value, key_padding_mask, attention_mask.kv_end,
                                                                 keep_first=attention_mask.window is None)
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
        if documents is None and read_positions and causal and query.shape[2] == key.shape[2] > 1:
            documents = _position_documents(kwargs.get("position_ids"), query.shape[0], query.shape[2], memo)

    stats = getattr(module, "stable_attn_stats", None)
    if stats is not None and not stats.enabled:
        stats = None
    opts = model_options_of(module)
    dispatch.record(module, query, key, opts["backend"], attn_mask=attn_mask, varlen=documents is not None, who=who,
                    pv_fp32=opts["pv_fp32"], value=value, key_block=opts["block_n"])
    common = dict(causal=causal, scale=scaling, window=window, softcap=softcap or None,
                  dropout_p=float(dropout) if module.training else 0.0, stabilize=opts["stabilize"],
                  beta=opts["beta"], stats=stats, backend=opts["backend"], block_n=opts["block_n"],
                  pv_fp32=opts["pv_fp32"], sinks=sinks)
    try:
        if documents is not None:
            B, Nq = query.shape[0], query.shape[2]
            # [B, H, N, D] -> [B * N, H, D]: a view for one packed row (DataCollatorWithFlattening's layout)
            q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (query, key, value))
            out = attention_varlen(q, k, v, *documents, **common)
            return out.view(B, Nq, *out.shape[1:]), None
        # transformers hands every backend [B, H, N, D]: no layout check
        out = attention(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask, layout="bhnd",
                        **common)
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


def _position_documents(position_ids: Any, batch_size: int, length: int, memo: dict | None,
                        ) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """Documents read from ``position_ids`` (:func:`masks.position_starts`), once per forward: kept in the
    mask's ``memo``, which every layer of the forward shares (eager and traced alike). Gradient checkpointing
    turns the cache off, so its packed batches bring their documents with the packed mask and compiled
    checkpointed layers do not come here (a memo write from inside one is a side effect dynamo refuses).

    Traced: always the varlen op, with the documents found on the device (:func:`masks.device_documents`;
    an unpacked batch is one document per row), so nothing depends on the values. Eager: one host read
    decides whether the batch is packed at all, so that an unpacked batch stays on the dense op.
    """
    # other layouts (e.g. multimodal RoPE's [3, B, N]) carry no document boundaries we know how to read
    if (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
            or position_ids.shape[0] not in (1, batch_size) or position_ids.shape[1] != length):
        return None
    if memo is not None:
        for seen, documents in memo.get("positions", ()):
            if seen is position_ids:
                return documents
    starts = position_starts(position_ids, batch_size)
    if not torch.compiler.is_compiling() and int(starts.sum()) == batch_size:
        documents = None  # one document per row: not packed
    else:
        cu, longest = device_documents(starts)
        documents = (cu, cu, longest, longest)
    if memo is not None:
        memo["positions"] = (*memo.get("positions", ()), (position_ids, documents))
    return documents
