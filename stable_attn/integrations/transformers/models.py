"""Per-model helpers: finding a model's attention modules, their options, their statistics."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from stable_attn.options import DEFAULTS, MODEL_OPTIONS, Stabilize, model_options
from stable_attn.stats import AttentionStats

# The options a model sets (configure() or config.stable_attn), with their defaults (options.DEFAULTS).
OPTION_DEFAULTS: dict[str, Any] = {name: DEFAULTS[name] for name in MODEL_OPTIONS}


_MODEL_DEFAULTS: dict[str, Any] = model_options(None, where="defaults")


def _who(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    return type(module).__name__ + (f" (model_type={model_type!r})" if model_type else "")


def model_options_of(module: nn.Module) -> dict[str, Any]:
    """The options an attention module runs: its own (:func:`configure`), else its model config's
    ``stable_attn`` dict (checked, completed with the defaults), else the defaults. Not a copy: do not mutate it."""
    own = getattr(module, "stable_attn_options", None)
    if own is not None:
        return own
    # config.stable_attn: a dict or None, checked and completed with the defaults
    from_config = getattr(getattr(module, "config", None), "stable_attn", None)
    if from_config is None:  # a plain dict: traced code then reads no mapping proxy (options.DEFAULTS)
        return _MODEL_DEFAULTS
    return model_options(from_config, where=f"{_who(module)}: config.stable_attn")


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
    pv_fp32: bool = DEFAULTS["pv_fp32"],
) -> None:
    """Set the :func:`stable_attn.attention` options every attention layer of ``model`` uses.

    Takes precedence over ``config.stable_attn``. Values are checked here (``options.model_options``).
    """
    options = model_options({"stabilize": stabilize, "beta": beta, "backend": backend, "block_n": block_n,
                             "pv_fp32": pv_fp32}, where="configure")
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


