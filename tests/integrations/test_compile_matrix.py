"""``torch.compile(fullgraph=True)`` over ``attn_implementation="stable_attn"``: every layer on the fused op.

A matrix of the common training inputs (dense, an all-ones 2D mask, left padding, packed ``position_ids``,
packed FlashAttention kwargs) x ``use_cache`` True / False, on a tiny Llama compiled with
``fullgraph=True`` through a backend that records the FX graph dynamo captured and then runs
``aot_eager``. Each cell asserts, from that graph (what the compiled code calls, so the count survives
tracing): one graph (no graph break), exactly one call of the fused op per attention layer
(``stable_attn::attention_fwd`` or ``stable_attn::attention_varlen_fwd``), none with a materialized
4D ``attn_mask`` (the PyTorch reference path for arbitrary masks), and that the loss and every gradient
equal the eager model's (uncompiled ``"stable_attn"`` and an independent implementation, ``"sdpa"``).
A cell served by the slow path fails here. Other families: ``@pytest.mark.slow``.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from transformers import (
    DataCollatorWithFlattening,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import stable_attn
import stable_attn.integrations.transformers as st
from stable_attn.integrations.transformers import dispatch

st.register()

VOCAB = 128
LLAMA = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, vocab_size=VOCAB)
_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
              vocab_size=VOCAB)
FAMILIES = {
    "llama": (LlamaForCausalLM, LLAMA),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**_SMALL, head_dim=8)),
    "mistral": (MistralForCausalLM, MistralConfig(**_SMALL, sliding_window=4)),
    # no dropout, so that eager and compiled draw nothing different
    "gpt2": (GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
}
KINDS = ("dense", "ones", "left", "packed", "flash")
AOT = True
FUSED = {"stable_attn.attention_fwd.default", "stable_attn.attention_varlen_fwd.default"}


def build(name: str, impl: str) -> torch.nn.Module:
    cls, config = FAMILIES[name]
    torch.manual_seed(0)
    model = cls._from_config(copy.deepcopy(config), attn_implementation=impl)
    # GPT2LMHeadModel's name gives no loss type: transformers then logs a warning_once from the loss, which
    # dynamo cannot trace (transformers' graph break, not ours)
    model.loss_type = "ForCausalLM"
    return model


def make_batch(kind: str) -> dict:
    g = torch.Generator().manual_seed(0)
    if kind in ("dense", "ones", "left"):
        ids = torch.randint(1, VOCAB, (2, 12), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if kind == "ones":
            batch["attention_mask"] = torch.ones_like(ids)
        if kind == "left":
            mask = torch.ones_like(ids)
            mask[0, :3] = 0
            batch["attention_mask"] = mask
            batch["labels"][mask == 0] = -100
            # as generate() does for left padding
            batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        return batch
    docs = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 1, 7, 3, 6)]
    collate = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=kind == "flash")
    return dict(collate([{"input_ids": d, "labels": d} for d in docs]))


class Recorder:
    """A dynamo backend: keeps each FX graph it gets (one per graph break + 1), then runs aot_eager."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []
        self._aot = lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self._aot(gm, example_inputs) if AOT else gm

    def attention_calls(self) -> list[tuple[str, bool]]:
        """``(op, has a 4D mask)`` of every stable_attn op the captured graphs call."""
        calls = []
        for gm in self.graphs:
            for node in gm.graph.nodes:
                if node.op == "call_function" and str(node.target).startswith("stable_attn."):
                    four_d = str(node.target) == "stable_attn.attention_fwd.default" and node.args[4] is not None
                    calls.append((str(node.target), four_d))
        return calls


def loss_and_grads(model, batch, use_cache):
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=use_cache)
    out.loss.backward()
    return out.loss.detach(), {n.removeprefix("_orig_mod."): p.grad.detach().clone()
                               for n, p in model.named_parameters() if p.grad is not None}


def assert_close(got, want, what):
    (loss, grads), (want_loss, want_grads) = got, want
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} loss: {m}")
    assert grads.keys() == want_grads.keys(), what
    top = max(g.abs().max().item() for g in want_grads.values())
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-5 * top, msg=lambda m, n=n: f"{what} d{n}: {m}")


def sdpa_reference(name, kind, batch):
    """An independent implementation: sdpa, without a cache (its packed mask separates the documents)."""
    ref = build(name, "sdpa")
    b = {k: v for k, v in batch.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    return loss_and_grads(ref, b, False)


def run_cell(name, kind, use_cache):
    torch._dynamo.reset()
    batch = make_batch(kind)
    model = build(name, "stable_attn")
    eager = loss_and_grads(model, batch, use_cache)
    recorder = Recorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    got = loss_and_grads(compiled, batch, use_cache)
    what = f"{name} {kind} use_cache={use_cache}"
    n_layers = len(st.attention_modules(model))
    assert len(recorder.graphs) == 1, f"{what}: {len(recorder.graphs)} graphs (graph breaks)"
    calls = recorder.attention_calls()
    assert len(calls) == n_layers, f"{what}: {calls}"
    assert all(op in FUSED and not four_d for op, four_d in calls), f"{what}: slow path in {calls}"
    assert_close(got, eager, f"{what} compiled vs eager")
    assert_close(got, sdpa_reference(name, kind, batch), f"{what} compiled vs sdpa")
    return calls


# Each cell compiles the model (~4 s on 2 cores): the CPU suite runs one cell per code path, the rest is slow.
# Paths: traced packed-mask recognition (use_cache=False, no 2D mask: transformers always builds its packed
# mask while tracing), documents from position_ids (use_cache=True), a key-padding mask (2D mask), the
# FlashAttention kwargs.
_FAST = {("dense", False), ("dense", True), ("left", False), ("packed", False), ("packed", True), ("flash", False)}
LLAMA_CELLS = [pytest.param(kind, use_cache, marks=() if (kind, use_cache) in _FAST else pytest.mark.slow)
               for kind in KINDS for use_cache in (True, False)]


@pytest.mark.parametrize(("kind", "use_cache"), LLAMA_CELLS)
def test_llama_compiles_fullgraph_onto_the_fused_op(kind, use_cache):
    calls = run_cell("llama", kind, use_cache)
    if kind in ("packed", "flash"):  # packed documents: the varlen op for every layer
        assert {op for op, _ in calls} == {"stable_attn.attention_varlen_fwd.default"}
    if kind in ("ones", "left"):  # a 2D mask: the dense op with a key-padding mask, documents never read
        assert {op for op, _ in calls} == {"stable_attn.attention_fwd.default"}


# Mistral, packed, with a cache: the one path Llama does not take (a sliding-window closure that, traced, looks
# like a packed mask; the documents then come from position_ids too)
FAMILY_CELLS = [pytest.param(name, kind, use_cache,
                             marks=() if (name, kind, use_cache) == ("mistral", "packed", True) else pytest.mark.slow)
                for name in ("qwen3", "mistral", "gpt2") for kind in KINDS for use_cache in (True, False)]


@pytest.mark.parametrize(("name", "kind", "use_cache"), FAMILY_CELLS)
def test_other_families_compile_fullgraph_onto_the_fused_op(name, kind, use_cache):
    run_cell(name, kind, use_cache)


def test_a_slow_layer_warns_once_per_model_and_reason(monkeypatch, caplog):
    """On a CUDA device, a layer served by the PyTorch path says so: one WARNING per model and reason,
    naming the model, the reason and what to change (CPU tensors stand in for CUDA ones here)."""
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_on_cuda", lambda t: True)
    model = build("llama", "stable_attn")
    four_d = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        for _ in range(2):
            st.stable_attn_attention_forward(st.attention_modules(model)[0][1], torch.randn(2, 4, 12, 8),
                                             torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8), four_d)
            st.stable_attn_attention_forward(st.attention_modules(model)[1][1], torch.randn(2, 4, 12, 8),
                                             torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8), four_d)
    ours = [r for r in caplog.records if "explain" in r.getMessage()]
    assert len(ours) == 1 and "LlamaAttention" in ours[0].getMessage() and "4D" in ours[0].getMessage()
    assert "pass a 2D attention_mask" in ours[0].getMessage()
    # a fused layer says nothing
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        model(input_ids=torch.randint(1, VOCAB, (2, 12)))
    assert not [r for r in caplog.records if "explain" in r.getMessage()]


def test_warning_does_not_break_the_graph(monkeypatch, caplog):
    """The warning is issued from traced code without a graph break (dynamo reorders it after the graph)."""
    monkeypatch.setattr(dispatch, "_warned", set())
    torch._dynamo.reset()
    module = st.attention_modules(build("llama", "stable_attn"))[0][1]
    four_d = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    recorder = Recorder()
    monkeypatch.setattr(dispatch, "_on_cuda", lambda t: True)
    f = torch.compile(lambda q, k, v: st.stable_attn_attention_forward(module, q, k, v, four_d)[0], fullgraph=True,
                      backend=recorder)
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        f(torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8))
    assert len(recorder.graphs) == 1
    assert len([r for r in caplog.records if "explain" in r.getMessage()]) == 1


def test_explain_lists_every_layer_and_why(capsys):
    model = build("llama", "stable_attn")
    ids = torch.randint(1, VOCAB, (2, 12))
    rows = stable_attn.explain(model, {"input_ids": ids})
    assert [r["path"] for r in rows] == [dispatch.TRITON_DENSE] * 2 and all(r["reason"] is None for r in rows)
    packed = make_batch("packed")
    rows = stable_attn.explain(model, {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"]})
    assert [r["path"] for r in rows] == [dispatch.TRITON_VARLEN] * 2
    text = capsys.readouterr().out
    assert "model.layers.0.self_attn" in text and "model.layers.1.self_attn" in text
    # a custom 4D mask: the PyTorch path, with the reason
    four_d = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()[None].expand(1, 2, 1, 12, 12)[0]
    rows = stable_attn.explain(model, {"input_ids": ids, "attention_mask": four_d, "use_cache": False})
    assert [r["path"] for r in rows] == [dispatch.PYTORCH] * 2 and "4D" in rows[0]["reason"]
    assert "4D" in capsys.readouterr().out


def test_static_cache_decoding_compiles_onto_the_fused_op():
    """A static cache's decoding step, compiled (what generate() compiles): one graph, the dense op with a
    key mask (a 0-dim tensor query offset, the keys the whole cache), tokens equal to eager sdpa's."""
    from transformers import StaticCache

    torch._dynamo.reset()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 16, dtype=torch.long)  # the whole cache's length: every step has the same shapes
    mask[0, :2] = 0
    logits = {}
    for impl in ("sdpa", "stable_attn"):
        model = build("llama", impl).eval()
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask[:, :7], past_key_values=cache, use_cache=True)
        recorder = Recorder()
        step = torch.compile(model, fullgraph=True, backend=recorder) if impl == "stable_attn" else model
        token = first.logits[:, -1:].argmax(-1)
        steps = []
        with torch.no_grad():
            for n in range(3):
                step_mask = mask.clone()
                step_mask[:, 8 + n:] = 0  # the slots not written yet
                out = step(input_ids=token, attention_mask=step_mask, past_key_values=cache, use_cache=True,
                           position_ids=(step_mask.sum(-1, keepdim=True) - 1))
                steps.append(out.logits)
                token = out.logits[:, -1:].argmax(-1)
        logits[impl] = torch.cat(steps, 1)
    assert len(recorder.graphs) == 1
    calls = recorder.attention_calls()
    assert calls == [("stable_attn.attention_fwd.default", False)] * 2, calls
    torch.testing.assert_close(logits["stable_attn"], logits["sdpa"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [True, False])
def test_packed_documents_cost_one_read_per_forward_and_launch_exactly(monkeypatch, compiled):
    """Documents found on the device (static shapes) reach the op; its value check reads ``cu_seqlens`` once
    per forward (every layer and the backward share the tensor), and the launch gets the documents alone
    (the static shape's empty trailing sequences dropped, ``max_seqlen`` the longest document)."""
    from stable_attn import varlen
    from stable_attn.kernels import reference_varlen

    reads, launches = [], []
    real_read, real_forward = varlen._host_values, reference_varlen.forward_varlen

    def read(cu):
        reads.append(cu.numel())
        return real_read(cu)

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, *rest):
        launches.append((cu_q.tolist(), max_q))
        return real_forward(q, k, v, cu_q, cu_k, max_q, max_k, *rest)

    monkeypatch.setattr(varlen, "_host_values", read)
    monkeypatch.setattr(reference_varlen, "forward_varlen", forward)
    torch._dynamo.reset()
    batch = make_batch("packed")  # documents of 5, 1, 7, 3, 6 tokens in one row of 22
    model = build("llama", "stable_attn")
    run = torch.compile(model, fullgraph=True, backend=Recorder()) if compiled else model
    run(**batch, use_cache=False).loss.backward()
    assert reads == [22 + 1]
    assert launches == [([0, 5, 6, 13, 16, 22], 7)] * 2
