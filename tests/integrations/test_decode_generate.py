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
from stable_attn import call_cache
from stable_attn.kernels import decode_launch, reference_decode

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
    target, name = ((reference_decode, "attention_forward") if backend == "torch"
                    else (decode_launch.DecodeLaunch, "run"))  # every route to the decode kernel
    real = getattr(target, name)
    monkeypatch.setattr(target, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tokens, logits = generate("stable_attn", backend)
    assert len(calls) == 2 * (NEW - 1)  # two layers, every step after the prefill

    monkeypatch.setattr(attention_mod, "takes_decode", lambda *a, **kw: False)
    call_cache._calls.clear()  # the repeated calls remember takes_decode's decisions (stable_attn/call_cache.py)
    tokens_train, logits_train = generate("stable_attn", backend)
    assert len(calls) == 2 * (NEW - 1)  # none more: all through the training path
    eager, _ = generate("eager")

    assert torch.equal(tokens, tokens_train) and torch.equal(tokens, eager)
    diff = (logits - logits_train).abs().max()
    top2 = logits_train.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).min()
    assert diff < 1e-4 and margin > 100 * diff, (diff, margin)


def test_static_cache_decoding_compiles_onto_the_decode_kernel(monkeypatch):
    """A static cache's decoding steps on the Triton backend, compiled with ``fullgraph=True`` (what
    ``generate()`` compiles, and what a CUDA graph captures): one graph, the dense op once per layer, and inside
    it the decode kernel every step (its launch prepared from the shapes alone: tests/kernels/test_decode_launch.py
    runs that path on meta tensors, which have no values to read); logits those of eager sdpa."""
    from test_compile_matrix import Recorder
    from transformers import StaticCache

    runs = []
    real = decode_launch.DecodeLaunch.run
    monkeypatch.setattr(decode_launch.DecodeLaunch, "run", lambda *a, **kw: runs.append(1) or real(*a, **kw))
    torch._dynamo.reset()
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 48, dtype=torch.long)  # the whole cache: every step has the same shapes (3 key blocks)
    mask[0, :2] = 0
    logits, recorder = {}, Recorder()
    for impl in ("sdpa", "stable_attn"):
        model = build("llama", impl, 64)
        if impl == "stable_attn":
            st.configure(model, backend="triton", block_n=16)
        cache = StaticCache(config=model.config, max_cache_len=48)
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask[:, :7], past_key_values=cache, use_cache=True)
        step = torch.compile(model, fullgraph=True, backend=recorder) if impl == "stable_attn" else model
        token, steps = first.logits[:, -1:].argmax(-1), []
        runs.clear()
        with torch.no_grad():
            for n in range(3):
                step_mask = mask.clone()
                step_mask[:, 8 + n:] = 0  # the slots not written yet
                out = step(input_ids=token, attention_mask=step_mask, past_key_values=cache, use_cache=True,
                           position_ids=step_mask.sum(-1, keepdim=True) - 1)
                steps.append(out.logits)
                token = out.logits[:, -1:].argmax(-1)
        logits[impl] = torch.cat(steps, 1)
    assert len(recorder.graphs) == 1, f"{len(recorder.graphs)} graphs (graph breaks)"
    assert recorder.attention_calls() == [("stable_attn.attention_fwd.default", False)] * 2
    assert len(runs) == 2 * 3  # the decode kernel, every layer of every step
    torch.testing.assert_close(logits["stable_attn"], logits["sdpa"], rtol=1e-5, atol=1e-5)
