"""The ``"stable_attn"`` mask builder (transformers' ``AttentionMaskInterface``) and what it returns.

:func:`stable_attn_mask` recognizes the mask patterns the fused kernel takes as flags (causal, causal with
a left sliding window, bidirectional, each with an optional key-padding mask, and masking_utils' packed
sequences over them) and returns a :class:`StableAttnMask`; anything else gets transformers' exact
boolean 4D mask. Recognition reads the closures ``masking_utils`` builds (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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
      ``max_seqlen`` bounds the longest document. None when the batch is not packed. The mask builder
      finds documents on the device with a static shape (:func:`device_documents`): ``B * q_length + 1``
      offsets, the unused trailing ones equal to the token count, ``max_seqlen = q_length``.
    - ``kv_used``: only the first ``kv_used`` keys can be seen by any query (a static cache's filled
      prefix); the attention function slices the keys to them. None: all ``kv_length`` keys.
    - ``kv_end``: the same bound as a 0-dim tensor (a static cache's prefill while tracing, where its query
      offset cannot be read): the attention function rotates the keys so that the filled prefix ends at the
      last key, where the kernel's bottom-right alignment puts it, and masks the empty slots, now in front
      of it, through ``key_padding_mask`` (:func:`rotate_filled_prefix`; without a window key 0 stays first).
      None: the prefix length is static.
    - ``read_positions``: whether the attention function may read packed documents from ``position_ids``
      (False when the model got a 2D ``attention_mask``: then, as with sdpa, documents are not separated).
    - ``memo``: per-forward scratch shared by the layers (the documents read from ``position_ids`` once).
    """

    causal: bool
    window: int | None
    key_padding_mask: torch.Tensor | None
    q_length: int
    kv_length: int
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    kv_used: int | None = None
    kv_end: torch.Tensor | None = None
    read_positions: bool = True
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def ndim(self) -> int:
        """It stands in for a ``[B, 1, q_length, kv_length]`` mask: ``generate()`` builds the mask of a static
        cache ahead of the forward (``create_masks_for_generate``) and the model's ``create_causal_mask`` then
        reads its ``ndim`` and passes it back to the mask builder, which returns it as it is."""
        return 4

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


def device_documents(starts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` of the documents that begin where ``starts`` ``[B, N]`` is True, on the device.

    Every row begins a document (one never spans two rows); rows are flattened in order. Static shapes
    and tensor ops only (no host read, nothing data-dependent for ``torch.compile``): ``cu_seqlens`` has
    ``B * N + 1`` int32 entries, the offsets of the documents followed by the token count repeated (empty
    trailing sequences, which :func:`stable_attn.varlen.launch_extent` drops before the launch), and
    ``max_seqlen`` is ``N``, the bound a row gives.
    """
    B, N = starts.shape
    T = B * N
    first = torch.zeros_like(starts)
    first[:, 0] = True
    flat = (starts | first).reshape(-1)
    index = torch.arange(T, device=starts.device)
    # document d's first token goes to slot d; every other token to a dump slot T + 1, cut off below
    slot = torch.where(flat, flat.cumsum(0) - 1, T + 1)
    cu = torch.full((T + 2,), T, dtype=torch.int64, device=starts.device).scatter(0, slot, index)
    return cu[:T + 1].to(torch.int32), N


def position_starts(position_ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``[B, N]`` bool: where a document begins in ``position_ids`` ``[B|1, N]`` (the position does not grow by 1:
    ``masking_utils.find_packed_sequence_indices``' rule), as tensor ops."""
    position_ids = position_ids.expand(batch_size, -1)
    starts = torch.ones(position_ids.shape, dtype=torch.bool, device=position_ids.device)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return starts


def _key_padding(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    missing = kv_offset + kv_length - mask.shape[-1]
    if missing > 0:  # keys beyond the 2D mask (a static cache's empty slots) are padding, as in transformers
        mask = torch.nn.functional.pad(mask, (0, missing), value=False)
    kpm = mask[:, kv_offset:kv_offset + kv_length]
    # Eager only: the host read transformers' sdpa mask does too, so that an all-ones mask gets the plain
    # kernel (once per forward: the builder runs once, its result serves every layer). Traced code keeps the
    # mask (the kernel's padding variant): no data-dependent branch.
    if not torch.compiler.is_compiling() and bool(kpm.all()):
        return None
    return kpm.contiguous()


def _query_positions(kwargs: dict) -> tuple[int, int | torch.Tensor | None]:
    """``(q_length, q_offset)`` from either mask-builder signature; ``q_offset`` an int, a 0-dim tensor (a static
    cache's), or None (not a contiguous range).

    transformers >= 5.1x passes ``q_length``/``q_offset``; 5.0 passed ``cache_position`` (the queries'
    absolute positions), which the kernel's alignment can express only when it is a contiguous range.
    """
    if "q_length" in kwargs:
        q_offset = kwargs.get("q_offset", 0)
        if isinstance(q_offset, torch.Tensor) and q_offset.numel() == 1:
            return int(kwargs["q_length"]), q_offset.reshape(())
        ok = isinstance(q_offset, int) and not isinstance(q_offset, bool)
        return int(kwargs["q_length"]), q_offset if ok else None
    positions = kwargs.get("cache_position")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.numel() == 0:
        raise TypeError("stable_attn_mask needs q_length (transformers >= 5.1x) or cache_position (5.0)")
    first = int(positions[0])
    contiguous = torch.equal(positions, torch.arange(first, first + positions.numel(), device=positions.device))
    return positions.numel(), first if contiguous else None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# the code of masking_utils.and_masks' closure (dynamo exposes a traced closure's __code__, not its cells)
_AND_MASK_CODE = masking_utils.and_masks(masking_utils.causal_mask_function).__code__


def _traced_pattern(mask_function: Callable, local_size: int | None, kwargs: dict) -> tuple[bool, int | None] | None:
    """``(causal, window)`` of a masking_utils closure while tracing, from static information only.

    Under ``torch.compile`` the closures' cells cannot be read (dynamo does not expose ``__closure__``), but
    their code is known (``__code__``) and so is the call: ``create_causal_mask`` and
    ``create_sliding_window_causal_mask`` compose ``and_masks`` of the causal pattern, the sliding window
    (``local_size``, the config's ``sliding_window``) and the packed-sequence parts; custom ``and``/``or``
    masks come with ``use_vmap``, bidirectional creators pass ``allow_is_bidirectional_skip``, chunked
    attention a ``local_size`` that is the config's ``attention_chunk_size``. What this infers is then
    checked against the mask function itself (:func:`_check_pattern`). Whether the closure is the packed mask
    is :func:`_traced_packed`'s question.
    """
    if getattr(mask_function, "__code__", None) is not _AND_MASK_CODE or "allow_is_bidirectional_skip" in kwargs:
        return None
    if local_size is None:
        return True, None
    config = kwargs.get("config")
    if _is_int(local_size) and local_size >= 1 and local_size == getattr(config, "sliding_window", None):
        return True, local_size
    return None


def _traced_packed(kwargs: dict) -> bool:
    """Whether an ``and_masks`` closure met while tracing is masking_utils' packed-sequence mask, from the call alone.

    masking_utils builds that mask only without a cache and a 2D mask (training), and whenever it does it turns
    the causal skip off (``allow_is_causal_skip=False``); a sliding window without packing (a cache, or no
    ``position_ids``) keeps the skip allowed. So the documents of a packed mask are all in the mask function
    (read from it), and an unpacked window gets its documents from ``position_ids`` in the attention function,
    as in eager code.
    """
    return kwargs.get("allow_is_causal_skip") is False


def _evaluate(mask_function: Callable, batch_size: int, q_abs: torch.Tensor, kv_abs: torch.Tensor) -> torch.Tensor:
    """``mask_function`` at the ``[1|B, N]`` pairs ``(q_abs, kv_abs)`` of every batch row: ``[B, N]`` bool."""
    b = torch.arange(batch_size, device=q_abs.device)[:, None]
    h = torch.zeros((1, 1), dtype=torch.long, device=q_abs.device)
    return mask_function(b, h, q_abs, kv_abs).to(torch.bool).expand(batch_size, q_abs.shape[-1])


def _check_pattern(mask_function: Callable, batch_size: int, q_length: int, kv_length: int, q_offset: Any,
                   kv_offset: int, window: int | None, starts: torch.Tensor | None, device: torch.device,
                   kv_end: Any = None) -> None:
    """Assert on the device (``torch._assert_async``: no host read) that ``mask_function`` agrees with causal
    (+ ``window``) attention, the last query seeing key ``kv_end - 1`` (default: the last key; bottom-right
    aligned), within the documents beginning at ``starts``, at the keys where such masks differ from their
    neighbours: each query's own position, the next key, the first key it sees and the one before. A
    transformers mask we mistook (a block-wise image overlay, a bidirectional window) fails here loudly
    instead of being computed wrong.
    """
    i = torch.arange(q_length, device=device)[None, :].expand(batch_size, -1)
    p = i + ((kv_length if kv_end is None else kv_end) - q_length)  # the query's own key index
    lo = torch.zeros_like(p)
    if starts is not None:
        lo = torch.cummax(torch.where(starts, i, 0), dim=1).values
    if window is not None:
        lo = torch.maximum(lo, p - window + 1)

    def at(j):
        inside = (j >= 0) & (j < kv_length)
        got = _evaluate(mask_function, batch_size, i + q_offset, j.clamp(0, kv_length - 1) + kv_offset)
        return got, inside

    ok = torch.ones_like(p, dtype=torch.bool)
    for j, want in ((p, True), (p + 1, False), (lo, True), (lo - 1, False)):
        got, inside = at(j)
        ok &= ~inside | (got == want)
    torch._assert_async(ok.all(), "stable_attn: transformers' mask is not the causal/window/packed pattern it was "
                                  "recognized as; please report this with the model and transformers version")


def _mask_starts(mask_function: Callable, batch_size: int, length: int, device: torch.device) -> torch.Tensor:
    """``[B, N]``: where a token cannot see the token before it, i.e. where masking_utils' packed mask starts a
    document (read from the mask function itself, on the device)."""
    i = torch.arange(length, device=device)[None, :]
    sees_previous = _evaluate(mask_function, batch_size, i, (i - 1).clamp(min=0))
    starts = ~sees_previous
    starts[:, 0] = True
    return starts


def _packed_mask(mask_function: Callable, batch_size: int, length: int, local_size: int | None, kwargs: dict,
                 device: torch.device) -> StableAttnMask | None:
    """The :class:`StableAttnMask` of masking_utils' packed-sequence mask (no cache, no 2D mask), else None.

    Eager: recognized from the closures. Traced: inferred from static information (:func:`_traced_pattern`).
    Either way the documents are read from the mask function on the device (:func:`_mask_starts`) and the
    pattern is checked there (:func:`_check_pattern`).
    """
    if torch.compiler.is_compiling():
        pattern = _traced_pattern(mask_function, local_size, kwargs) if _traced_packed(kwargs) else None
    else:
        packed = recognize_packed_mask_function(mask_function)
        pattern = None if packed is None else packed[:2]
        if packed is not None and tuple(packed[2].shape) != (batch_size, length):
            pattern = None
    if pattern is None:
        return None
    causal, window = pattern
    if window is not None and local_size not in (None, window):
        return None
    if window == 1:  # a token sees only itself: no document boundary to read, none needed
        return StableAttnMask(causal, window, None, length, length)
    starts = _mask_starts(mask_function, batch_size, length, device)
    _check_pattern(mask_function, batch_size, length, length, 0, 0, window, starts, device)
    cu, longest = device_documents(starts)
    return StableAttnMask(causal, window, None, length, length, cu, longest)


def _traced_prefix_mask(mask_function: Callable, batch_size: int, q_length: int, kv_length: int,
                        q_offset: torch.Tensor, kv_offset: int, window: int | None,
                        attention_mask: torch.Tensor | None, read_positions: bool,
                        device: torch.device) -> StableAttnMask:
    """A static cache's prefill (several queries) while tracing: causal over the first ``q_offset + q_length``
    keys, a bound that is a 0-dim tensor (``kv_end``), so no shape depends on it. An inferred window is checked
    on the device against that bound."""
    kv_end = (q_offset + q_length - kv_offset).to(device)
    if window is not None:
        _check_pattern(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, window, None, device,
                       kv_end=kv_end)
    kpm = _key_padding(attention_mask, kv_length, kv_offset)
    return StableAttnMask(True, window, kpm, q_length, kv_length, kv_end=kv_end, read_positions=read_positions)


def rotate_filled_prefix(key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None,
                         kv_end: torch.Tensor, *, keep_first: bool = True,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys ``[B, H, Nk, D]`` of which only the first ``kv_end`` (0-dim tensor) can be seen, rotated along the key
    axis so that those end at the last key, and the key-padding mask ``[B, Nk]`` that hides the rest.

    The kernel aligns causal attention bottom-right (query ``i`` sees keys ``j <= i + Nk - Nq``); after the
    rotation by ``Nk - kv_end`` that is old key ``j - (Nk - kv_end) <= i + kv_end - Nq``, exactly the causal
    prefix, and the empty slots are padding. With ``keep_first`` (no sliding window) key 0 stays at
    position 0 and only keys ``1 .. kv_end - 1`` move to the end, the empty slots between them: every query
    of a prefill sees key 0 either way (``kv_end >= Nq``), and the kernel's ``sink_mass`` (the probability on
    position 0) is then key 0's, not an empty slot's. A sliding window measures distances in positions,
    and the gap would move key 0 out of it: there the plain rotation serves, and ``sink_mass`` reads an
    empty slot (0). Static shapes, tensor ops (a gather): the same graph for every offset.
    """
    B, n = key.shape[0], key.shape[2]
    j = torch.arange(n, device=key.device)
    shift = n - kv_end
    source = (j - shift) % n  # the old key now at position j
    filled = (j >= shift)[None, :].expand(B, n)  # positions of the filled prefix
    if keep_first:
        # old key 0 at position 0, the empty slots (old kv_end ..) at 1 .. shift, old keys 1 .. at the end
        source = torch.where(j == 0, 0, torch.where(j <= shift, (kv_end + j - 1) % n, j - shift))
        filled = ((j == 0) | (j > shift))[None, :].expand(B, n)
    key, value = key.index_select(2, source), value.index_select(2, source)
    if key_padding_mask is not None:
        filled = filled & key_padding_mask.index_select(1, source)
    return key, value, filled.contiguous()


def _single_query_mask(batch_size: int, kv_length: int, kv_offset: Any, mask_function: Callable,
                       attention_mask: torch.Tensor | None, kwargs: dict, use_vmap: bool, local_size) -> StableAttnMask:
    """One query per row (decoding): whatever the pattern, its mask is a key mask. transformers' own
    ``sdpa_mask`` builds it (``[B, 1, 1, kv_length]``, no skip, no host read) and the kernel takes it as a
    key-padding mask, non-causal: a static cache's tensor offset, chunked or custom patterns included."""
    mask = masking_utils.sdpa_mask(batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset,
                                   mask_function=mask_function, attention_mask=attention_mask, local_size=local_size,
                                   use_vmap=use_vmap, **kwargs)
    return StableAttnMask(False, None, mask.reshape(batch_size, kv_length).contiguous(), 1, kv_length,
                          read_positions=False)


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
    (transformers 5.0); everything else is passed to ``sdpa_mask`` unchanged. Works the same eager and
    under ``torch.compile(fullgraph=True)``: no closure is read while tracing and no Python branch depends
    on tensor values (the one host read, eager only, drops an all-ones padding mask).
    """
    if isinstance(attention_mask, StableAttnMask):  # built ahead of the forward (generate with a static cache)
        return attention_mask
    q_length, q_offset = _query_positions(kwargs)
    device = kwargs.get("device", "cpu")
    device = torch.device(device) if isinstance(device, str) else device
    context = dict(kwargs)  # what the creator passed (before the skips are turned off for sdpa_mask below)
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    read_positions = attention_mask is None
    if (not use_vmap and attention_mask is None and _is_int(q_offset) and q_offset == 0 and _is_int(kv_offset)
            and kv_offset == 0 and q_length == kv_length and mask_function is not masking_utils.causal_mask_function
            and mask_function is not getattr(masking_utils, "bidirectional_mask_function", None)):
        packed = _packed_mask(mask_function, batch_size, q_length, local_size, context, device)
        if packed is not None:
            return packed
    if use_vmap or q_offset is None:
        pattern = None
    elif torch.compiler.is_compiling() and mask_function not in (masking_utils.causal_mask_function,
                                                                 getattr(masking_utils, "bidirectional_mask_function",
                                                                         None)):
        pattern = _traced_pattern(mask_function, local_size, context)
    else:
        pattern = recognize_mask_function(mask_function)
    if pattern is not None and not _is_int(kv_offset):
        pattern = None
    if pattern is not None:
        causal, window = pattern
        if window is not None and local_size not in (None, window):
            pattern = None
        elif causal:
            # The kernel aligns causal masks bottom-right: query i sees keys j <= i + (kv_length - q_length).
            # A static cache's keys end after the last query (empty slots no query sees): keep the first `used`.
            # Its query offset is a tensor; eager, it is read (one host read per forward, the prefill's), traced
            # it cannot be: the prefix's end stays a tensor (kv_end; decoding is served below as a key mask).
            if isinstance(q_offset, torch.Tensor) and torch.compiler.is_compiling() and q_length > 1:
                return _traced_prefix_mask(mask_function, batch_size, q_length, int(kv_length), q_offset, kv_offset,
                                           window, attention_mask, read_positions, device)
            if isinstance(q_offset, torch.Tensor):
                used = None if q_length == 1 else int(q_offset) + q_length - kv_offset
            else:
                used = q_offset + q_length - kv_offset
            if used == kv_length:
                pass
            elif used is not None and q_length <= used < kv_length:
                return StableAttnMask(causal, window, _key_padding(attention_mask, used, kv_offset), q_length,
                                      int(kv_length), kv_used=used, read_positions=read_positions)
            else:
                pattern = None
    if pattern is not None:
        causal, window = pattern
        if torch.compiler.is_compiling() and window is not None:  # inferred, not read: check it
            _check_pattern(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, window, None, device)
        return StableAttnMask(causal, window, _key_padding(attention_mask, kv_length, kv_offset),
                              q_length, int(kv_length), read_positions=read_positions)
    if q_length == 1:
        return _single_query_mask(batch_size, kv_length, kv_offset, mask_function, attention_mask, kwargs, use_vmap,
                                  local_size)
    return masking_utils.sdpa_mask(
        batch_size=batch_size, kv_length=kv_length, kv_offset=kv_offset, mask_function=mask_function,
        attention_mask=attention_mask, local_size=local_size, use_vmap=use_vmap, **kwargs,
    )
