"""Registering ``"stable_attn"`` with transformers: the attention function and the mask builder."""

from __future__ import annotations

from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from stable_attn.integrations.transformers.attention_function import stable_attn_attention_forward
from stable_attn.integrations.transformers.masks import stable_attn_mask

NAME = "stable_attn"


def register() -> None:
    """Register ``"stable_attn"`` with transformers (attention function and mask builder). Idempotent."""
    AttentionInterface.register(NAME, stable_attn_attention_forward)
    AttentionMaskInterface.register(NAME, stable_attn_mask)
