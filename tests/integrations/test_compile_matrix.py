"""``torch.compile`` over ``attn_implementation="stable_attn"``: every layer on the fused op.

A matrix of the common training inputs (dense, an all-ones 2D mask, left padding, packed ``position_ids``,
packed FlashAttention kwargs) x ``use_cache`` True / False x gradient checkpointing off / on, over tiny
Llama, Qwen3, Mistral (sliding window), Gemma 2 (softcap, alternating sliding / global layers) and GPT-2
(tests/integrations/tiny_models.py), compiled with ``fullgraph=True`` through a backend that records the FX
graph dynamo captured and then runs ``aot_eager``. Each cell asserts, from that graph (what the compiled code
calls, so the count survives tracing): one graph (no graph break), exactly one call of the fused op per
attention layer (``stable_attn::attention_fwd`` or ``stable_attn::attention_varlen_fwd``; with gradient
checkpointing inside each layer's checkpoint body), none with a materialized 4D ``attn_mask`` (the PyTorch
reference path for arbitrary masks), and that the loss and every gradient equal the eager model's
(uncompiled ``"stable_attn"`` and an independent implementation, ``"sdpa"``, or ``"eager"`` for Gemma 2).
A cell served by the slow path fails here. Gradient checkpointing turns the cache off (transformers warns
about ``use_cache=True`` with a ``logger.warning_once``, which breaks a graph: transformers', not ours, see
:func:`test_graph_breaks_without_fullgraph_are_not_ours`), so its cells run ``use_cache=False``.
Then ``generate()`` with dynamic and static caches, compiled. The CPU suite runs one cell per code path; the
rest is ``@pytest.mark.slow``.
"""

from __future__ import annotations

import logging
import os

import pytest
import tiny_models
import torch
from tiny_models import NAMES
from torch._dynamo.backends.registry import lookup_backend
from transformers import DataCollatorWithFlattening

import stable_attn
import stable_attn.integrations.transformers as st
from stable_attn.integrations.transformers import dispatch
from stable_attn.integrations.transformers.checkpointing import prepare_checkpointed_training

st.register()

VOCAB = 128
KINDS = ("dense", "ones", "left", "packed", "flash")
AOT = True
FUSED = {"stable_attn.attention_fwd.default", "stable_attn.attention_varlen_fwd.default"}
CHECKPOINT = "tag_activation_checkpoint"  # str() of the HOP dynamo records for torch.utils.checkpoint


def build(name: str, impl: str, checkpointing: bool = False) -> torch.nn.Module:
    model = tiny_models.build(name, impl, VOCAB)
    if checkpointing:
        model.train()  # transformers checkpoints only while training
        model.gradient_checkpointing_enable()
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
            # The last pad's logits predict the first real token, and a pad query sees no key: its output is a
            # convention (0 here and in sdpa, the mean of all values in "eager"), not attention. No loss on it.
            batch["labels"][0, :4] = -100
            # as generate() does for left padding
            batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        return batch
    docs = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 1, 7, 3, 6)]
    collate = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=kind == "flash")
    return dict(collate([{"input_ids": d, "labels": d} for d in docs]))


def _arguments(node: torch.fx.Node) -> dict:
    names = [a.name for a in node.target._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


class Recorder:
    """A dynamo backend: keeps each FX graph it gets (one per graph break + 1), then runs aot_eager."""

    def __init__(self, aot: bool = AOT):
        self.graphs: list[torch.fx.GraphModule] = []
        self._aot = lookup_backend("aot_eager") if aot else None

    def __deepcopy__(self, memo):  # transformers' CompileConfig.to_dict deep-copies the backend
        return self

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self._aot(gm, example_inputs) if self._aot is not None else gm

    def _nodes(self, graphs=None):
        # a checkpointed layer's ops live in the body graph of its checkpoint HOP: a submodule graph
        for gm in self.graphs if graphs is None else graphs:
            for m in gm.modules():
                if isinstance(m, torch.fx.GraphModule):
                    yield from (n for n in m.graph.nodes if n.op == "call_function")

    def ops(self, graphs=None) -> list[dict]:
        """The arguments (by name, ``op`` added) of every stable_attn op the captured graphs call."""
        return [{"op": str(n.target), **_arguments(n)} for n in self._nodes(graphs)
                if str(n.target).startswith("stable_attn.")]

    def attention_calls(self, graphs=None) -> list[tuple[str, bool]]:
        """``(op, has a 4D mask)`` of every stable_attn op the captured graphs call."""
        return [(c["op"], c.get("attn_mask") is not None) for c in self.ops(graphs)]

    def checkpoints(self) -> int:
        return sum(str(n.target) == CHECKPOINT for n in self._nodes())


def assert_every_layer_fused(calls, n_layers, what):
    assert len(calls) == n_layers, f"{what}: {calls}"
    assert all(op in FUSED and not four_d for op, four_d in calls), f"{what}: slow path in {calls}"


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


def independent_reference(name, batch, checkpointing):
    """An independent implementation (sdpa, or eager for Gemma 2), without a cache (its packed mask separates
    the documents)."""
    ref = build(name, tiny_models.reference_impl(name), checkpointing)
    b = {k: v for k, v in batch.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    return loss_and_grads(ref, b, False)


def run_cell(name, kind, use_cache, checkpointing=False):
    torch._dynamo.reset()
    batch = make_batch(kind)
    model = build(name, "stable_attn", checkpointing)
    # what the callbacks do for a checkpointed model (transformers >= 5.25 needs the dynamo switch)
    undo = prepare_checkpointed_training([model])
    try:
        return _run_cell(name, kind, use_cache, checkpointing, batch, model)
    finally:
        undo.restore()


def _run_cell(name, kind, use_cache, checkpointing, batch, model):
    eager = loss_and_grads(model, batch, use_cache)
    recorder = Recorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    got = loss_and_grads(compiled, batch, use_cache)
    what = f"{name} {kind} use_cache={use_cache} checkpointing={checkpointing}"
    n_layers = len(st.attention_modules(model))
    assert len(recorder.graphs) == 1, f"{what}: {len(recorder.graphs)} graphs (graph breaks)"
    assert recorder.checkpoints() == (n_layers if checkpointing else 0), f"{what}: checkpointed layers"
    calls = recorder.attention_calls()
    assert_every_layer_fused(calls, n_layers, what)
    assert_close(got, eager, f"{what} compiled vs eager")
    assert_close(got, independent_reference(name, batch, checkpointing), f"{what} compiled vs reference")
    if name == "gemma2":  # layer 0 a sliding window, layer 1 global, both softcapped, as the config says
        ops = recorder.ops()
        assert sorted(c["window"] or 0 for c in ops) == [0, tiny_models.WINDOW], ops
        assert all(c["softcap"] == 0.5 for c in ops), ops
    return calls


# Each cell compiles the model (~4-8 s on 2 cores): the CPU suite runs one cell per code path, the rest is slow.
# Paths: traced packed-mask recognition (use_cache=False, no 2D mask: transformers always builds its packed
# mask while tracing), documents from position_ids (use_cache=True), a key-padding mask (2D mask), the
# FlashAttention kwargs; gradient checkpointing (the ops inside the checkpoint bodies); Gemma 2's alternating
# windows with softcap.
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


# Mistral, packed, with a cache: a path Llama does not take (a sliding-window closure that, traced, looks like a
# packed mask; the documents then come from position_ids too). Gemma 2 without a cache: the traced packed mask
# of both its patterns (window and global) in one model.
_FAST_FAMILY = {("mistral", "packed", True), ("gemma2", "dense", False)}
FAMILY_CELLS = [pytest.param(name, kind, use_cache,
                             marks=() if (name, kind, use_cache) in _FAST_FAMILY else pytest.mark.slow)
                for name in NAMES if name != "llama" for kind in KINDS for use_cache in (True, False)]


@pytest.mark.parametrize(("name", "kind", "use_cache"), FAMILY_CELLS)
def test_other_families_compile_fullgraph_onto_the_fused_op(name, kind, use_cache):
    run_cell(name, kind, use_cache)


CHECKPOINT_CELLS = [pytest.param(name, kind, marks=() if (name, kind) == ("llama", "packed") else pytest.mark.slow)
                    for name in NAMES for kind in KINDS]


@pytest.mark.parametrize(("name", "kind"), CHECKPOINT_CELLS)
def test_gradient_checkpointing_compiles_fullgraph_onto_the_fused_op(name, kind):
    """``model.gradient_checkpointing_enable()`` under ``torch.compile(fullgraph=True)``: every layer's fused op
    inside its checkpoint body, loss and gradients as eager (checkpointed too) and the reference."""
    run_cell(name, kind, use_cache=False, checkpointing=True)


_STABLE_ATTN_DIR = os.path.dirname(os.path.abspath(stable_attn.__file__))


def breaks_in_stable_attn(explained) -> list[str]:
    """The graph breaks whose user stack passes through stable_attn's own code."""
    return [str(r.reason) for r in explained.break_reasons
            if any(os.path.abspath(f.filename).startswith(_STABLE_ATTN_DIR) for f in r.user_stack)]


BREAK_CELLS = [pytest.param("llama", "packed", True, True, id="llama-checkpointing-use_cache"),
               pytest.param("gpt2", "left", True, False, id="gpt2-no-loss-type", marks=pytest.mark.slow),
               pytest.param("gemma2", "left", True, True, id="gemma2-checkpointing-use_cache", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("name", "kind", "use_cache", "checkpointing"), BREAK_CELLS)
def test_graph_breaks_without_fullgraph_are_not_ours(name, kind, use_cache, checkpointing):
    """Without ``fullgraph``, graphs may break in transformers' code (gradient checkpointing with
    ``use_cache=True`` warns through ``logger.warning_once``; GPT-2 without a loss type too): none of the
    breaks is stable_attn's, and every layer still reaches the fused op."""
    torch._dynamo.reset()
    model = build(name, "stable_attn", checkpointing)
    if name == "gpt2":
        model.loss_type = None  # transformers' loss lookup then warns once, a break
    undo = prepare_checkpointed_training([model])  # as the callbacks do; use_cache=True passed explicitly still warns
    try:
        explained = torch._dynamo.explain(model)(**make_batch(kind), use_cache=use_cache)
    finally:
        undo.restore()
    assert explained.graph_break_count >= 1, explained  # transformers' breaks happen: this cell can see breaks
    assert breaks_in_stable_attn(explained) == []
    recorder = Recorder(aot=False)
    recorder.graphs = list(explained.graphs)
    assert_every_layer_fused(recorder.attention_calls(), len(st.attention_modules(model)), f"{name} {kind}")


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


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second prompt left-padded, as generate() wants it
    return ids, mask


def generated(model, **kwargs) -> torch.Tensor:
    ids, mask = _prompt()
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                              pad_token_id=0, **kwargs)


# "forward": the user compiles model.forward (prefill and decoding compiled; a dynamic cache recompiles as it
# grows); "auto": generate() compiles decoding itself (a static cache and a CompileConfig), the prefill eager.
# (the CPU suite: Llama "auto"; a compiled prefill into a static cache is the next test's). The prompts and the
# tokens generated are longer than Mistral's and Gemma 2's window.
GENERATIONS = (("static", "auto"), ("static", "forward"), ("dynamic", "forward"))
GENERATE_CELLS = [pytest.param(name, cache, how, marks=() if (name, cache, how) == ("llama", "static", "auto")
                               else pytest.mark.slow)
                  for name in NAMES for cache, how in GENERATIONS]


@pytest.mark.parametrize(("name", "cache", "how"), GENERATE_CELLS)
def test_generate_compiles_onto_the_fused_op(name, cache, how):
    """``generate()`` compiled with ``fullgraph=True``: every graph dynamo captured (prefill, decoding steps) calls
    the fused op once per layer with no 4D mask, and the tokens are those of eager sdpa (eager for Gemma 2)."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    want = generated(build(name, tiny_models.reference_impl(name)).eval(),
                     cache_implementation=None if cache == "dynamic" else cache)
    model = build(name, "stable_attn").eval()
    recorder = Recorder(aot=False)
    kwargs = {"cache_implementation": None if cache == "dynamic" else cache}
    if how == "forward":
        model.forward = torch.compile(model.forward, fullgraph=True, backend=recorder)
    else:
        config = CompileConfig(fullgraph=True, backend=recorder, mode=None)  # a mode is for inductor
        config._compile_all_devices = True  # transformers compiles decoding on GPUs only, unless told
        kwargs["compile_config"] = config
    got = generated(model, **kwargs)
    assert recorder.graphs, "nothing was compiled"
    n_layers = len(st.attention_modules(model))
    for i, gm in enumerate(recorder.graphs):
        assert_every_layer_fused(recorder.attention_calls([gm]), n_layers, f"{name} {cache} {how} graph {i}")
    assert torch.equal(got, want), (got, want)


def test_static_cache_prefill_after_cached_tokens_compiles_onto_the_fused_op():
    """A prefill into a static cache that already holds tokens (chunked prefill, a second turn), compiled: the
    cache's query offset is then a tensor, so the causal prefix has a tensor length; every layer still calls
    the fused op (the keys rotated, the empty slots a key mask) and the logits are eager sdpa's."""
    from transformers import StaticCache

    torch._dynamo.reset()
    ids, mask = _prompt()
    more = torch.randint(1, VOCAB, (2, 3), generator=torch.Generator().manual_seed(6))
    full_mask = torch.cat([mask, torch.ones_like(more)], 1)
    logits, recorder = {}, Recorder(aot=False)
    for impl in ("sdpa", "stable_attn"):
        model = build("llama", impl).eval()
        cache = StaticCache(config=model.config, max_cache_len=16)
        run = torch.compile(model, fullgraph=True, backend=recorder) if impl == "stable_attn" else model
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            first = run(input_ids=ids, attention_mask=mask, position_ids=positions[:, :6], past_key_values=cache)
            second = run(input_ids=more, attention_mask=full_mask, position_ids=positions[:, 6:],
                         past_key_values=cache)
        logits[impl] = torch.cat([first.logits, second.logits], 1)
    assert len(recorder.graphs) == 2  # the empty cache's prefill (an int offset) and the second (a tensor one)
    for i, gm in enumerate(recorder.graphs):
        assert_every_layer_fused(recorder.attention_calls([gm]), 2, f"prefill {i}")
    valid = full_mask.bool()  # the pad queries see no key: their output is a convention, not attention
    torch.testing.assert_close(logits["stable_attn"][valid], logits["sdpa"][valid], rtol=1e-5, atol=1e-5)
