"""integrations/transformers/swap.py: the outermost models under a module, switched to "stable_attn" and
given per-layer statistics."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

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


def test_prepare_models_swaps_attaches_and_names_the_layers_of_several_models():
    root = torch.nn.ModuleDict({"a": _lm(), "b": _lm()})
    prepared = swap.prepare_models(root, swap=True, stats=True)
    assert list(prepared.models) == ["a", "b"]
    assert all(m.config._attn_implementation == "stable_attn" for m in prepared.models.values())
    assert list(prepared.stats) == ["a.layer0", "b.layer0"] == list(prepared.modules)
    assert prepared.stats["b.layer0"] is prepared.modules["b.layer0"].stable_attn_stats
    assert prepared.modules["a.layer0"] is root["a"].transformer.h[0].attn
    assert prepared.attention_layers == 2


def test_prepare_models_skips_prepared_models_and_can_leave_the_attention_alone():
    root = torch.nn.ModuleDict({"a": _lm()})
    first = swap.prepare_models(root, swap=False, stats=False)
    assert list(first.models) == ["a"] and not first.stats and not first.modules
    assert root["a"].config._attn_implementation == "eager"
    assert not hasattr(root["a"].transformer.h[0].attn, "stable_attn_stats")
    root["b"] = _lm()
    second = swap.prepare_models(root, swap=True, stats=True, prepared=first.models.values())
    assert list(second.models) == ["b"]
    assert list(second.stats) == ["b.layer0"]  # named with its path: the run holds two models
    assert root["a"].config._attn_implementation == "eager"
    assert root["b"].config._attn_implementation == "stable_attn"
