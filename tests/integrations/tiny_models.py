"""Tiny random causal LMs of the families the integration tests cover, built the same way by every test.

Two layers, width 32, 4 query / 2 kv heads (GQA; GPT-2: 4 heads), head dim 8: small enough for Triton's
interpreter and for ``torch.compile`` on a 2-core CPU. Mistral has a sliding window shorter than the test
sequences; Gemma 2 alternates a sliding-window layer and a global one, with a small softcap and scale so that
the capping bites. No dropout anywhere (GPT-2's defaults have some), so eager and compiled runs draw nothing
different.
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

WINDOW = 4  # Mistral's and Gemma 2's sliding window: shorter than the test sequences and the longest document
NAMES = ("llama", "qwen3", "mistral", "gemma2", "gpt2")
_CLASSES = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM, "mistral": MistralForCausalLM,
            "gemma2": Gemma2ForCausalLM, "gpt2": GPT2LMHeadModel}


def config(name: str, vocab: int) -> PretrainedConfig:
    """The tiny config of family ``name`` (one of :data:`NAMES`) with a vocabulary of ``vocab`` tokens."""
    small = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    if name == "llama":
        return LlamaConfig(**small)
    if name == "qwen3":
        return Qwen3Config(**small, head_dim=8)
    if name == "mistral":
        return MistralConfig(**small, sliding_window=WINDOW)
    if name == "gemma2":  # layer 0 sliding window, layer 1 global (Gemma 2's default layer_types)
        return Gemma2Config(**small, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=0.5,
                            query_pre_attn_scalar=2, initializer_range=0.2)
    if name == "gpt2":
        return GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0)
    raise ValueError(f"family {name!r}: expected one of {NAMES}")


_CONFIGS: dict[tuple[str, int], PretrainedConfig] = {}


def build(name: str, impl: str, vocab: int) -> torch.nn.Module:
    """Family ``name`` with attention implementation ``impl``, the same weights for every ``impl`` (seed 0)."""
    if (name, vocab) not in _CONFIGS:
        _CONFIGS[name, vocab] = config(name, vocab)
    torch.manual_seed(0)
    model = _CLASSES[name]._from_config(copy.deepcopy(_CONFIGS[name, vocab]), attn_implementation=impl)
    # GPT2LMHeadModel's name gives no loss type: transformers then logs a warning_once from the loss, which
    # dynamo cannot trace (transformers' graph break, not ours)
    model.loss_type = "ForCausalLM"
    return model


def reference_impl(name: str) -> str:
    """An implementation independent of stable_attn for family ``name``: ``"sdpa"``, or ``"eager"`` where
    transformers has no sdpa path (Gemma 2: its softcap)."""
    return "eager" if name == "gemma2" else "sdpa"
