"""Preparing the transformers models inside a training module (a LightningModule) for a monitored run:
switched to ``"stable_attn"``, with per-layer statistics attached."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from stable_attn.integrations.transformers.models import attach_stats, attention_modules
from stable_attn.integrations.transformers.registry import NAMES, register
from stable_attn.stats import AttentionStats

__all__ = ["PreparedModels", "find_hf_models", "prepare_models", "swap_attention"]


def find_hf_models(root: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The outermost transformers ``PreTrainedModel`` instances under ``root`` (by module path;
    ``""`` when ``root`` is one). Inner ones (the ``GPT2Model`` in a ``GPT2LMHeadModel``) share the
    outer model's config and follow its attention implementation."""
    found: dict[str, torch.nn.Module] = {}
    for name, module in root.named_modules():
        if not isinstance(module, PreTrainedModel):
            continue
        if any(name == p or name.startswith(p + ".") for p in found if p != name) or "" in found:
            continue
        found[name] = module
    return found


def swap_attention(models: dict[str, torch.nn.Module]) -> None:
    """``set_attn_implementation("stable_attn")`` on each model (registering the implementation
    with transformers first)."""
    register()
    for model in models.values():
        if getattr(model.config, "_attn_implementation", None) not in NAMES:
            model.set_attn_implementation("stable_attn")


@dataclass(frozen=True)
class PreparedModels:
    """What :func:`prepare_models` did: the models it prepared (by module path), and with ``stats=True`` each
    attention layer's statistics and module under one layer name (``layer{i}``, prefixed with the model's path,
    or ``model``, when a run holds several models)."""

    models: dict[str, torch.nn.Module] = field(default_factory=dict)
    stats: dict[str, AttentionStats] = field(default_factory=dict)
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)

    @property
    def attention_layers(self) -> int:
        """The attention modules of the prepared models."""
        return sum(len(attention_modules(m)) for m in self.models.values())


def prepare_models(root: torch.nn.Module, *, swap: bool, stats: bool,
                   prepared: Collection[torch.nn.Module] = ()) -> PreparedModels:
    """Prepare the outermost transformers models under ``root`` (:func:`find_hf_models`) that are not in
    ``prepared`` (the models of an earlier call of the same run): ``swap`` switches them to ``"stable_attn"``,
    ``stats`` attaches :class:`AttentionStats` to every attention layer (:func:`attach_stats`)."""
    known = {id(m) for m in prepared}
    models = {path: m for path, m in find_hf_models(root).items() if id(m) not in known}
    if swap and models:
        swap_attention(models)
    layer_stats: dict[str, AttentionStats] = {}
    modules: dict[str, torch.nn.Module] = {}
    several = len(models) + len(known) > 1
    for path, model in models.items():
        if not stats:
            continue
        # attach_stats names the layers in attention_modules' order
        attached = attach_stats(model)
        names = [f"{path or 'model'}.{layer}" if several else layer for layer in attached]
        layer_stats.update(zip(names, attached.values(), strict=True))
        modules.update(zip(names, (m for _, m in attention_modules(model)), strict=True))
    return PreparedModels(models, layer_stats, modules)
