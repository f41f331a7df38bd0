"""``generate()`` through the decode path (kernels/decode_plan.py): the same tokens as through the training path
and as eager attention.

A tiny Llama (GQA 4/2, head dim 8, fp32, tests/integrations/tiny_models.py), key blocks of 16 keys and a
40-token prompt, so every decoding step (one query against 40 to 45 keys: three key blocks) takes the decode
path, with the padding mask transformers builds for it (left-padded ragged prompts). What is asserted, for the
PyTorch path and for the Triton kernel under the interpreter:

* the decode path ran: once per layer for each decoding step (the spy counts the calls);
* the greedy tokens equal those of the same model with the decode path switched off (``takes_decode`` patched
  to False: every step through the training path) and those of ``attn_implementation="eager"``;
* why that equality is not luck: the two paths compute the same fp32 softmax with different offsets (the
  rounding of ``P-bar`` to fp32 is the identity), so their logits differ by fp32 noise; the test measures that
  difference and checks that at every step the winning token leads the runner-up by more than 100 times it,
  so no rounding difference of that size could have changed a token.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from tiny_models import build

import stable_attn.integrations.transformers as st
from stable_attn.kernels import reference_decode
from stable_attn.kernels import triton_decode as td

attention_mod = importlib.import_module("stable_attn.attention")  # the module (the package exports the function)
PROMPT, NEW = 40, 6


def prompts():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 64, (2, PROMPT), generator=g)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :9] = 0  # row 1 left-padded: its steps see a key padding mask with 9 hidden keys
    return ids, mask


def generate(impl, backend=None):
    model = build("llama", impl, 64)
    if backend is not None:
        st.configure(model, backend=backend, block_n=16)
    ids, mask = prompts()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             use_cache=True, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_generate_through_the_decode_path_gives_the_training_paths_tokens(backend, monkeypatch):
    calls = []
    target, name = (reference_decode, "attention_forward") if backend == "torch" else (td, "forward")
    real = getattr(target, name)
    monkeypatch.setattr(target, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tokens, logits = generate("stable_attn", backend)
    assert len(calls) == 2 * (NEW - 1)  # two layers, every step after the prefill

    monkeypatch.setattr(attention_mod, "takes_decode", lambda *a, **kw: False)
    tokens_train, logits_train = generate("stable_attn", backend)
    assert len(calls) == 2 * (NEW - 1)  # none more: all through the training path
    eager, _ = generate("eager")

    assert torch.equal(tokens, tokens_train) and torch.equal(tokens, eager)
    diff = (logits - logits_train).abs().max()
    top2 = logits_train.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).min()
    assert diff < 1e-4 and margin > 100 * diff, (diff, margin)
