"""Switching the transformers models inside a training module (a LightningModule) to ``"stable_attn"``."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from stable_attn.integrations.transformers.registry import register

__all__ = ["find_hf_models", "swap_attention"]


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
        if getattr(model.config, "_attn_implementation", None) != "stable_attn":
            model.set_attn_implementation("stable_attn")
