"""Moved to :mod:`stable_attn.integrations.transformers.swap`; this shim keeps ``callbacks.swap`` working.

The functions import the new module when called, not here, so that importing the callbacks never
imports transformers (as before the move).
"""

from __future__ import annotations

import torch

__all__ = ["find_hf_models", "swap_attention"]


def find_hf_models(root: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """:func:`stable_attn.integrations.transformers.swap.find_hf_models`."""
    from ..integrations.transformers.swap import find_hf_models as moved

    return moved(root)


def swap_attention(models: dict[str, torch.nn.Module]) -> None:
    """:func:`stable_attn.integrations.transformers.swap.swap_attention`."""
    from ..integrations.transformers.swap import swap_attention as moved

    moved(models)
