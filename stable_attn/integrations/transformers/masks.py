"""The ``"stable_attn"`` mask builder (transformers' ``AttentionMaskInterface``) and what it returns.

:func:`stable_attn_mask` recognizes the mask patterns the fused kernel takes as flags (causal, causal with
a left sliding window, bidirectional, each with an optional key-padding mask, and masking_utils' packed
sequences over them) and returns a :class:`StableAttnMask`; anything else gets transformers' exact
boolean 4D mask. Recognition reads the closures ``masking_utils`` builds (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import masking_utils


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


