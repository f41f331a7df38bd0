"""integrations/transformers/swap.py: the outermost models under a module, switched to "stable_attn"
(callbacks/swap.py still answers for the callbacks that import it there)."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from stable_attn.callbacks import swap as callbacks_swap
from stable_attn.integrations.transformers import swap


def _lm() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return GPT2LMHeadModel._from_config(config, attn_implementation="eager")


def test_outermost_models_are_found_and_swapped():
    root = torch.nn.ModuleDict({"lm": _lm(), "other": torch.nn.Linear(2, 2)})
    found = swap.find_hf_models(root)
    assert list(found) == ["lm"]  # not lm.transformer, which follows the outer model's config
    assert swap.find_hf_models(root["lm"]) == {"": root["lm"]}
    swap.swap_attention(found)
    assert root["lm"].config._attn_implementation == "stable_attn"


def test_the_callbacks_shim_delegates():
    lm = _lm()
    assert callbacks_swap.find_hf_models(lm) == swap.find_hf_models(lm)
    callbacks_swap.swap_attention({"": lm})
    assert lm.config._attn_implementation == "stable_attn"
