"""Registering ``"stable_attn"`` with transformers: the attention function and the mask builder."""

from __future__ import annotations

from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from stable_attn.integrations.transformers.attention_function import stable_attn_attention_forward
from stable_attn.integrations.transformers.masks import stable_attn_mask

NAME = "stable_attn"
# the package's spelling on PyPI and the command line; registered too, so it cannot meet transformers' own error
ALIAS = "stable-attn"
NAMES = (NAME, ALIAS)


def register() -> None:
    """Register ``"stable_attn"`` (and its alias ``"stable-attn"``) with transformers: the attention function and
    the mask builder. Idempotent."""
    for name in NAMES:
        AttentionInterface.register(name, stable_attn_attention_forward)
        AttentionMaskInterface.register(name, stable_attn_mask)
