"""Hugging Face transformers: ``attn_implementation="stable_attn"``.

:func:`register` adds two functions to transformers under the name ``"stable_attn"``:

- :func:`stable_attn_mask`, the mask builder (``AttentionMaskInterface``). Models call it through
  ``create_causal_mask`` / ``create_sliding_window_causal_mask`` / ``create_bidirectional_mask`` and pass
  whatever it returns, untouched, to the attention function. It recognizes the mask patterns the fused
  kernel takes as flags -- causal (bottom-right aligned, as with a KV cache), causal with a left sliding
  window, bidirectional -- each with an optional key-padding mask, and returns a :class:`StableAttnMask`
  describing them: no ``[B, 1, Nq, Nk]`` tensor is built. Anything else (packed sequences, chunked or
  block-wise attention, custom ``or``/``and`` mask functions, a static cache whose query offset is a
  tensor) gets the exact boolean 4D mask from transformers' own ``sdpa_mask``, which the attention op
  serves on its PyTorch path (stabilized, slower; the op logs that once).
- :func:`stable_attn_attention_forward`, the attention function (``AttentionInterface``). It maps the
  model's arguments (``scaling``, ``dropout``, ``softcap``, ``sliding_window``, GQA key/value heads) to
  :func:`stable_attn.attention` and returns ``(out [B, N, H, D], None)``.

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
    """

    causal: bool
    window: int | None
    key_padding_mask: torch.Tensor | None
    q_length: int
    kv_length: int

    def __repr__(self) -> str:
        kpm = None if self.key_padding_mask is None else tuple(self.key_padding_mask.shape)
        return (f"StableAttnMask(causal={self.causal}, window={self.window}, key_padding_mask={kpm}, "
                f"q_length={self.q_length}, kv_length={self.kv_length})")


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

    Returns a :class:`StableAttnMask` for the patterns the kernel takes as flags, else the boolean
    ``[B, 1, q_length, kv_length]`` mask of ``transformers.masking_utils.sdpa_mask`` (True = attend).
    Query positions come as ``q_length``/``q_offset`` (current transformers) or ``cache_position``
    (transformers 5.0); everything else is passed to ``sdpa_mask`` unchanged.
    """
    q_length, q_offset = _query_positions(kwargs)
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
    from_config = getattr(getattr(module, "config", None), "stable_attn", None)
    return _validated_options(from_config, where=f"{_who(module)}: config.stable_attn")


def _validated_options(options: Any, where: str) -> dict[str, Any]:
    """``config.stable_attn`` (a dict or None) checked and completed with the defaults."""
    return model_options(options, where=where)


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

    causal, window, key_padding_mask, attn_mask = False, None, None, None
    if isinstance(attention_mask, StableAttnMask):
        if attention_mask.kv_length != key.shape[2] or attention_mask.q_length != query.shape[2]:
            raise RuntimeError(
                f"stable_attn: {who}: the mask was built for q_length={attention_mask.q_length}, "
                f"kv_length={attention_mask.kv_length} but the layer got query length {query.shape[2]} and key "
                f"length {key.shape[2]} (a cache whose sizes disagree with the model's mask)"
            )
        causal, window, key_padding_mask = attention_mask.causal, attention_mask.window, attention_mask.key_padding_mask
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

    stats = getattr(module, "stable_attn_stats", None)
    if stats is not None and not stats.enabled:
        stats = None
    opts = _options(module)
    try:
        out = attention(
            query, key, value, causal=causal, scale=scaling, key_padding_mask=key_padding_mask,
            attn_mask=attn_mask, window=window, softcap=softcap or None,
            dropout_p=float(dropout) if module.training else 0.0,
            stabilize=opts["stabilize"], beta=opts["beta"], stats=stats, backend=opts["backend"],
            block_n=opts["block_n"],
        )
    except (ValueError, TypeError) as err:
        raise type(err)(f"stable_attn: {who}: {err}") from err
    return out.transpose(1, 2).contiguous(), None


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
