"""attn_implementation="stable_attn" on tiny random transformers models, against "eager" / "sdpa".

Every family is built from its config class (no downloads), 2 layers, width 32, sequences of 20
tokens (gpt-oss: learned sinks, sliding and full layers, GQA; DeepSeek-V3: multi-head latent attention, query
head dim 24 against value head dim 16; Gemma 4: a sliding layer of head dim 8 and a global layer of head dim 512),
and checked for: fp32 logits and every parameter gradient (no padding, right padding, left
padding, ragged lengths in one batch); bf16 logits and gradients within bf16 error of the fp32 model;
greedy ``generate()`` with a KV cache (left-padded ragged prompts) identical to the reference; and a
switch to ``"stable_attn"`` and back at run time. Tests run on the PyTorch backend (CPU); DeepSeek-V3 and Gemma 4
also on the Triton kernels under ``TRITON_INTERPRET=1`` (:func:`test_deepseek_v3_on_the_triton_kernels_matches_eager`,
:func:`test_gemma4_on_the_triton_kernels_matches_eager`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import stable_attn.integrations.transformers as st
from stable_attn.integrations.transformers import dispatch

# Gemma 4 came with transformers 5.5; the floor CI environment (5.0) builds the other families
Gemma4ForCausalLM = getattr(transformers, "Gemma4ForCausalLM", None)
Gemma4TextConfig = getattr(transformers, "Gemma4TextConfig", None)
GEMMA4_SINCE = (5, 5)

VOCAB = 96
SEQ = 20
WINDOW = 6  # Mistral / Gemma 2 sliding window, well below SEQ so that it matters
LENGTHS = (SEQ, SEQ - 7, SEQ - 3)  # a ragged batch

st.register()


@dataclass
class Family:
    name: str
    model_cls: type
    config: object
    decoder: bool = True
    reference: str = "sdpa"  # for generate(); "eager" where the model does not support sdpa
    extra: dict = field(default_factory=dict)
    prepare: Callable[[torch.nn.Module], None] | None = None  # after the seeded init, before any run
    # what serves each layer on a CUDA device (dispatch.serving), in layer order
    paths: tuple[str, ...] = (dispatch.TRITON_DENSE, dispatch.TRITON_DENSE)
    grad_atol_rel: float = 1e-5  # fp32 gradients' absolute tolerance, relative to the model's largest gradient


def _sinks_that_matter(model: torch.nn.Module) -> None:
    """gpt-oss initialises its sinks near 0 (std 0.02): spread them over a few nats so that they move the output
    (test_sinks_and_head_dims_really_matter) and their gradients are far from zero."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.copy_(torch.randn(module.sinks.shape, generator=g) * 1.5)


def _families() -> list[Family]:
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64)
    families = [
        # GPT-2's defaults keep attention dropout 0.1: eval for equality, training tested separately
        Family("gpt2", GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4)),
        Family("llama", LlamaForCausalLM, LlamaConfig(**small, num_key_value_heads=2)),
        Family("qwen3", Qwen3ForCausalLM, Qwen3Config(**small, num_key_value_heads=2, head_dim=8)),
        Family("mistral", MistralForCausalLM, MistralConfig(**small, num_key_value_heads=2, sliding_window=WINDOW)),
        # layers alternate sliding / global; a small softcap and scale so that capping really bites
        Family("gemma2", Gemma2ForCausalLM,
               Gemma2Config(**small, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
                            attn_logit_softcapping=0.5, query_pre_attn_scalar=2, initializer_range=0.2),
               reference="eager"),
        Family("bert", BertForMaskedLM, BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   max_position_embeddings=64), decoder=False),
        Family("phi3", Phi3ForCausalLM, Phi3Config(**small, num_key_value_heads=2, pad_token_id=0)),
        Family("gpt_neox", GPTNeoXForCausalLM, GPTNeoXConfig(**small)),
        Family("opt", OPTForCausalLM, OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                num_attention_heads=4, max_position_embeddings=64,
                                                word_embed_proj_dim=32)),
        # learned sinks (s_aux), layer 0 sliding window, layer 1 full, GQA 4/2; no sdpa in transformers
        Family("gpt_oss", GptOssForCausalLM,
               GptOssConfig(**small, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
                            layer_types=["sliding_attention", "full_attention"], num_local_experts=2,
                            num_experts_per_tok=1),
               reference="eager", prepare=_sinks_that_matter),
        # multi-head latent attention: q/k head dim 16 + 8 (rope) = 24, v head dim 16 (DeepSeek-V3's 192 / 128)
        Family("deepseek_v3", DeepseekV3ForCausalLM,
               DeepseekV3Config(**small, num_key_value_heads=4, moe_intermediate_size=16, q_lora_rank=16,
                                kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                                topk_group=1)),
    ]
    if Gemma4ForCausalLM is None:
        return families
    return families + [
        # layer 0 sliding window with head dim 8, layer 1 global with head dim 512 (Gemma 4's global_head_dim)
        Family("gemma4", Gemma4ForCausalLM,
               Gemma4TextConfig(**small, num_key_value_heads=2, head_dim=8, global_head_dim=512,
                                sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                                vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8),
               # its fp32 gradient noise is larger: sdpa's own gradients differ from eager's by 1.0e-5 of the
               # largest one (3.2e-3 of 311), ours by 1.2e-5
               grad_atol_rel=5e-5),
    ]


FAMILIES = {f.name: f for f in _families()}
DECODERS = [name for name, f in FAMILIES.items() if f.decoder]


def build(family: Family, impl: str = "eager", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = copy.deepcopy(family.config)
    model = family.model_cls._from_config(config, attn_implementation=impl).eval()
    if family.prepare is not None:
        family.prepare(model)
    return model


def batch(padding: str | None, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [3, SEQ] and a 2D mask: None, or ragged LENGTHS padded on the right or the left."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (len(LENGTHS), SEQ), generator=g)
    if padding is None:
        return ids, None
    mask = torch.zeros(len(LENGTHS), SEQ, dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        if padding == "right":
            mask[b, :n] = 1
        else:
            mask[b, SEQ - n:] = 1
    return ids, mask


def run(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, weights: torch.Tensor):
    """Logits at real tokens and every parameter's gradient of a random linear function of them."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    valid = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    picked = logits[valid]
    (picked.float() * weights[: picked.shape[0]]).sum().backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return picked.detach(), grads


def weights_for(seed: int = 2) -> torch.Tensor:
    return torch.randn(len(LENGTHS) * SEQ, VOCAB, generator=torch.Generator().manual_seed(seed))


def assert_close_scaled(actual, expected, rtol, atol_rel, what, scale=None):
    """allclose with the absolute tolerance relative to a magnitude (default: the expected tensor's)."""
    scale = expected.abs().max().item() if scale is None else scale
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol_rel * max(scale, 1e-30),
                               msg=lambda m: f"{what}: {m}")


def assert_grads_close(actual: dict, expected: dict, rtol: float, atol_rel: float, who: str):
    """Every gradient, with the absolute tolerance relative to the largest gradient of the model: some
    gradients are exactly zero in exact arithmetic (a key bias under softmax) and hold only rounding noise."""
    assert actual.keys() == expected.keys()
    scale = max(g.abs().max().item() for g in expected.values() if g is not None)
    compared = 0
    for name, g_ref in expected.items():
        g = actual[name]
        assert (g is None) == (g_ref is None), f"{who}: gradient presence differs for {name}"
        if g_ref is not None:
            assert_close_scaled(g, g_ref, rtol, atol_rel, f"{who}: grad of {name}", scale)
            compared += 1
    assert compared > 0


def calls(stats: dict) -> int:
    return sum(s.calls for s in stats.values())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp32_logits_and_gradients_match_eager_and_switch_back(name):
    family = FAMILIES[name]
    model = build(family, "eager")
    stats = st.attach_stats(model)
    n_layers = len(stats)
    assert n_layers == 2
    w = weights_for()
    cases = [batch(None), batch("right"), batch("left")]
    reference = [run(model, ids, mask, w) for ids, mask in cases]
    assert calls(stats) == 0  # eager does not go through stable_attn

    model.set_attn_implementation("stable_attn")
    assert model.config._attn_implementation == "stable_attn"
    for (ids, mask), (ref_logits, ref_grads), label in zip(cases, reference, ("unpadded", "right", "left")):
        before = calls(stats)
        with dispatch.recording() as served:
            logits, grads = run(model, ids, mask, w)
        assert calls(stats) - before == n_layers, "the stable_attn function did not serve every layer"
        if mask is None:  # padded batches may need a 4D mask in some families (dispatch's "4d-mask")
            assert tuple(r["path"] for r in served) == family.paths, [(r["path"], r["reason"]) for r in served]
        assert_close_scaled(logits, ref_logits, 1e-4, 1e-5, f"{name} {label} logits")
        assert_grads_close(grads, ref_grads, 1e-4, family.grad_atol_rel, f"{name} {label}")

    model.set_attn_implementation("eager")
    before = calls(stats)
    logits, _ = run(model, *cases[1], w)
    assert calls(stats) == before
    torch.testing.assert_close(logits, reference[1][0], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bf16_within_bf16_error_of_fp32(name):
    """bf16 logits and gradients are as close to the fp32 model as eager's bf16 ones are (or closer)."""
    family = FAMILIES[name]
    ids, mask = batch("right")
    w = weights_for()
    fp32 = build(family, "eager")
    ref_logits, ref_grads = run(fp32, ids, mask, w)
    errors = {}
    for impl in ("eager", "stable_attn"):
        model = copy.deepcopy(fp32).to(torch.bfloat16)
        model.set_attn_implementation(impl)
        logits, grads = run(model, ids, mask, w)
        assert logits.dtype == torch.bfloat16
        assert torch.isfinite(logits).all()
        logit_err = (logits.float() - ref_logits).abs().max().item() / ref_logits.abs().max().item()
        # relative to the tensor's norm, floored at 1% of the largest one: a few gradients are zero in
        # exact arithmetic (a key bias under softmax) and hold only rounding noise
        floor = 0.01 * max(g.norm().item() for g in ref_grads.values() if g is not None)
        grad_err = max(
            (g.float() - ref_grads[n]).norm().item() / max(ref_grads[n].norm().item(), floor)
            for n, g in grads.items() if g is not None
        )
        errors[impl] = (logit_err, grad_err)
    (e_logit, e_grad), (s_logit, s_grad) = errors["eager"], errors["stable_attn"]
    # bf16 has 8 significant bits (relative step 2^-8 ~ 0.4%); allow 2x eager's error plus one step
    assert s_logit <= 2 * e_logit + 2**-8, errors
    assert s_grad <= 2 * e_grad + 2**-8, errors
    assert s_logit < 0.1 and s_grad < 0.5, errors  # and neither is garbage


@pytest.mark.parametrize("name", DECODERS)
def test_generate_with_kv_cache_matches_reference(name):
    """Greedy tokens from left-padded ragged prompts, with a KV cache, equal sdpa's (eager for Gemma 2)."""
    family = FAMILIES[name]
    ids, mask = batch("left", seed=3)
    prompt_ids, prompt_mask = ids[:, :12], mask[:, :12]
    prompt_mask[:, -1] = 1
    out = {}
    for impl in (family.reference, "stable_attn"):
        model = build(family, impl)
        stats = st.attach_stats(model)
        with torch.no_grad():
            out[impl] = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=10,
                                       do_sample=False, use_cache=True, pad_token_id=0)
        # prefill + one call per new token after the first, per layer
        assert calls(stats) == (0 if impl != "stable_attn" else 10 * len(stats))
    assert out["stable_attn"].shape == (3, 22)
    assert torch.equal(out["stable_attn"], out[family.reference])


def _on_the_triton_kernels(name: str, launches: list, trained, generated, caplog) -> None:
    """The family ``name`` on the Triton kernels (the interpreter) against eager: fp32 logits and every gradient,
    unpadded and right-padded (``trained(launches)`` checks each step's launches), then greedy ``generate()``
    with 16-key blocks and a 33-token prompt, one row left-padded, so the steps after the prefill see at least
    two key blocks and take the decode kernel (decode_plan.takes_decode; ``generated(launches)`` checks them):
    eager's tokens. No call is logged as sent to the PyTorch path."""
    family = FAMILIES[name]
    model = build(family, "eager")
    w = weights_for()
    cases = [batch(None), batch("right")]
    reference = [run(model, ids, mask, w) for ids, mask in cases]
    model.set_attn_implementation("stable_attn")
    st.configure(model, backend="triton")
    with caplog.at_level(logging.INFO, logger="stable_attn"):
        for (ids, mask), (ref_logits, ref_grads) in zip(cases, reference, strict=True):
            launches.clear()
            logits, grads = run(model, ids, mask, w)
            trained(launches)
            assert_close_scaled(logits, ref_logits, 1e-4, 1e-5, f"{name} triton logits")
            assert_grads_close(grads, ref_grads, 1e-4, family.grad_atol_rel, f"{name} triton")
        st.configure(model, backend="triton", block_n=16)
        ids = torch.randint(2, VOCAB, (2, 33), generator=torch.Generator().manual_seed(3))
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        prompt = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=True,
                      pad_token_id=0)
        launches.clear()
        with torch.no_grad():
            ours = model.generate(**prompt)
        generated(launches)
    assert not [r for r in caplog.records if "PyTorch path" in r.getMessage()]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        assert torch.equal(ours, model.generate(**prompt))


def test_deepseek_v3_on_the_triton_kernels_matches_eager(monkeypatch, caplog):
    """Multi-head latent attention (q/k head dim 24, v head dim 16, nothing padded) on the Triton kernels: every
    call reaches the kernels (_on_the_triton_kernels)."""
    from stable_attn.kernels import triton_attention
    from stable_attn.kernels.decode_launch import DecodeLaunch

    launches = []
    # the decode kernel's launches: a repeated call skips triton_decode.forward, never DecodeLaunch.run (call_cache.py)
    for module, name in ((triton_attention, "_forward"), (triton_attention, "_backward"), (DecodeLaunch, "run")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **kw: launches.append(_name)
                            or _real(*a, **kw))

    def trained(launches):
        assert launches == ["_forward"] * 2 + ["_backward"] * 2

    def generated(launches):
        assert launches == ["_forward"] * 2 + ["run"] * 6  # prefill, then 3 steps x 2 layers on the decode kernel

    _on_the_triton_kernels("deepseek_v3", launches, trained, generated, caplog)


@pytest.mark.skipif("gemma4" not in FAMILIES, reason="this transformers has no Gemma 4 (the floor environment)")
def test_gemma4_on_the_triton_kernels_matches_eager(monkeypatch, caplog):
    """Gemma 4's sliding layer (head dim 8) and global layer (head dim 512: Q and K in column chunks, V split over
    programs) on the Triton kernels: the global layer's calls reach the kernels, the head dims of the launches
    say so (_on_the_triton_kernels)."""
    from stable_attn.kernels import triton_attention
    from stable_attn.kernels.decode_launch import DecodeLaunch

    launches = []
    for module, name in ((triton_attention, "_forward"), (triton_attention, "_backward")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **kw: launches.append(
            (_name, a[1 if _name == "_backward" else 0].shape[-1])) or _real(*a, **kw))
    real_run = DecodeLaunch.run
    monkeypatch.setattr(DecodeLaunch, "run", lambda self, q, *a, **kw: launches.append(("run", q.shape[-1]))
                        or real_run(self, q, *a, **kw))

    def trained(launches):
        assert sorted(launches) == [("_backward", 8), ("_backward", 512), ("_forward", 8), ("_forward", 512)]

    def generated(launches):
        assert launches[:2] == [("_forward", 8), ("_forward", 512)] and ("run", 512) in launches
        assert all(name in ("run", "_forward") for name, _ in launches) and len(launches) == 8

    _on_the_triton_kernels("gemma4", launches, trained, generated, caplog)


def test_generate_with_a_static_cache_matches_sdpa(monkeypatch):
    """A static cache (its query offset a tensor, its keys the whole cache): the prefill is causal over the
    cache's filled prefix, each decoding step a key mask; no 4D mask, and the tokens agree with sdpa."""
    family = FAMILIES["llama"]
    ids, mask = batch("left", seed=4)
    prompt_ids, prompt_mask = ids[:, :12], mask[:, :12]
    masks_seen = []
    real = st.attention_function.attention

    def spy(*args, **kwargs):
        masks_seen.append(kwargs["attn_mask"] is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(st.attention_function, "attention", spy)
    out = {}
    for impl in ("sdpa", "stable_attn"):
        with torch.no_grad():
            out[impl] = build(family, impl).generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=6, do_sample=False,
                pad_token_id=0, cache_implementation="static")
    assert len(masks_seen) == 6 * 2 and not any(masks_seen)
    assert torch.equal(out["stable_attn"], out["sdpa"])


def test_from_config_with_stable_attn():
    model = AutoModelForCausalLM.from_config(copy.deepcopy(FAMILIES["llama"].config), attn_implementation="stable_attn")
    assert model.config._attn_implementation == "stable_attn"
    stats = st.attach_stats(model)
    model(input_ids=batch(None)[0])
    assert calls(stats) == 2


def _delta(family: Family, patch_attr: str, value, ids, mask) -> float:
    """Max logit change when one layer attribute is overridden (to show the feature changes the output)."""
    model = build(family, "stable_attn")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        for _, module in st.attention_modules(model):
            setattr(module, patch_attr, value)
        return (model(input_ids=ids, attention_mask=mask).logits - ref).abs().max().item()


def test_window_and_softcap_really_matter_in_the_configs_above():
    """Guards the matrix above against passing only because the window or the softcap had no effect."""
    ids, mask = batch("right")
    assert _delta(FAMILIES["gemma2"], "attn_logit_softcapping", None, ids, mask) > 1e-2
    assert _delta(FAMILIES["gemma2"], "sliding_window", None, ids, mask) == 0.0  # the mask carries the window
    mistral = build(FAMILIES["mistral"], "stable_attn")
    mistral.config.sliding_window = None
    wide = build(FAMILIES["mistral"], "stable_attn")
    with torch.no_grad():
        diff = (mistral(input_ids=ids).logits - wide(input_ids=ids).logits).abs().max().item()
    assert diff > 1e-3


def test_sinks_and_head_dims_really_matter():
    """Guards the new families' rows: gpt-oss's sinks move the output and their gradients equal eager's at their
    own scale; DeepSeek-V3's layers see q/k head dim 24 and v head dim 16; Gemma 4's global layer head dim 512."""
    ids, mask = batch("right")
    w = weights_for()
    family = FAMILIES["gpt_oss"]
    model = build(family, "eager")
    ref_logits, ref_grads = run(model, ids, mask, w)
    model.set_attn_implementation("stable_attn")
    logits, grads = run(model, ids, mask, w)
    for name in (n for n in ref_grads if n.endswith("sinks")):
        assert_close_scaled(grads[name], ref_grads[name], 1e-4, 1e-5, f"gpt_oss grad of {name}")
        assert ref_grads[name].abs().max() > 1e-3
    assert _delta(family, "sinks", torch.nn.Parameter(torch.full((4,), -1e4)), ids, mask) > 1e-2

    seen = []
    real = st.attention_function.attention

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[-1], v.shape[-1], kwargs["sinks"] is not None))
        return real(q, k, v, **kwargs)

    cases = {"deepseek_v3": [(24, 16, False)] * 2, "gemma4": [(8, 8, False), (512, 512, False)],
             "gpt_oss": [(8, 8, True)] * 2}
    for name, want in ((n, w) for n, w in cases.items() if n in FAMILIES):
        seen.clear()
        model = build(FAMILIES[name], "stable_attn")
        with pytest.MonkeyPatch.context() as mp, torch.no_grad():
            mp.setattr(st.attention_function, "attention", spy)
            model(input_ids=ids, attention_mask=mask)
        assert seen == want, (name, seen)


def test_gpt2_attention_dropout_in_training():
    """GPT-2's default attn_pdrop=0.1 applies in train mode only, reproducibly under a torch seed."""
    family = FAMILIES["gpt2"]
    config = copy.deepcopy(family.config)
    config.resid_pdrop = config.embd_pdrop = 0.0  # isolate the attention dropout
    torch.manual_seed(0)
    model = GPT2LMHeadModel._from_config(config, attn_implementation="stable_attn")
    ids, mask = batch("right")
    model.eval()
    with torch.no_grad():
        eval_a = model(input_ids=ids, attention_mask=mask).logits
        eval_b = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(eval_a, eval_b, rtol=0, atol=0)

    model.train()
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        logits = model(input_ids=ids, attention_mask=mask).logits
        outs.append(logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert (outs[0] - outs[2]).abs().max() > 1e-3
    assert (outs[0] - eval_a).abs().max() > 1e-3
    outs[0].float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_packed_gpt_oss_is_each_document_alone():
    """gpt-oss with packed position_ids: each document's logits are those of the document run alone (eager in
    transformers 5.24 lets the second document see the first here, so eager is no reference for this case)."""
    family = FAMILIES["gpt_oss"]
    ids, _ = batch(None)
    position_ids = torch.cat([torch.arange(8), torch.arange(SEQ - 8)]).expand(len(LENGTHS), SEQ)
    model = build(family, "stable_attn")
    with torch.no_grad(), dispatch.recording() as served:
        packed = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    assert len(served) == 2 and all(r["varlen"] for r in served)
    with torch.no_grad():
        for lo, hi in ((0, 8), (8, SEQ)):
            alone = model(input_ids=ids[:, lo:hi], use_cache=False).logits
            torch.testing.assert_close(packed[:, lo:hi], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in ("llama", "deepseek_v3", "gemma4") if n in FAMILIES])
def test_packed_sequences_match_eager(name):
    """position_ids that restart mark packed documents (three packed rows): served per document, like eager
    (the new families: Dv != D and head dim 512 through the varlen op)."""
    family = FAMILIES[name]
    ids, _ = batch(None)
    position_ids = torch.cat([torch.arange(8), torch.arange(SEQ - 8)]).expand(len(LENGTHS), SEQ)
    model = build(family, "eager")
    w = weights_for()

    def go():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        (logits * w.view(len(LENGTHS), SEQ, VOCAB)).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_logits, ref_grads = go()
    model.set_attn_implementation("stable_attn")
    with dispatch.recording() as served:
        logits, grads = go()
    assert len(served) == 2 and all(r["varlen"] for r in served)
    assert_close_scaled(logits, ref_logits, 1e-4, 1e-5, "packed logits")
    assert_grads_close(grads, ref_grads, 1e-4, family.grad_atol_rel, "packed")
    # and the documents are really separated: the second one does not depend on the first
    ids2 = ids.clone()
    ids2[:, :8] = (ids2[:, :8] + 1) % VOCAB
    with torch.no_grad():
        moved = model(input_ids=ids2, position_ids=position_ids, use_cache=False).logits
    torch.testing.assert_close(moved[:, 8:], logits[:, 8:], rtol=1e-5, atol=1e-5)
    assert (moved[:, :8] - logits[:, :8]).abs().max() > 1e-3


README = Path(__file__).resolve().parents[2] / "README.md"
_PATH_WORDS = {dispatch.TRITON_DENSE: "fused", dispatch.TRITON_VARLEN: "fused (packed)", dispatch.PYTORCH: "PyTorch"}


def _features(family: Family) -> str:
    """What the family's model passes to the op on an unpadded batch, in README's words."""
    calls_seen = []
    real = st.attention_function.attention

    def spy(q, k, v, **kwargs):
        calls_seen.append((q.shape[1] != k.shape[1], q.shape[-1], v.shape[-1], kwargs))
        return real(q, k, v, **kwargs)

    model = build(family, "stable_attn")
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(st.attention_function, "attention", spy)
        model(input_ids=batch(None)[0])
    words = ["causal" if all(kw["causal"] for *_, kw in calls_seen) else "bidirectional"]
    words += [w for w, seen in (("GQA", any(gqa for gqa, *_ in calls_seen)),
                                ("sliding window", any(kw["window"] for *_, kw in calls_seen)),
                                ("softcap", any(kw["softcap"] for *_, kw in calls_seen)),
                                ("learned sinks", any(kw["sinks"] is not None for *_, kw in calls_seen))) if seen]
    dims = list(dict.fromkeys(f"{d}" if d == dv else f"{d}/{dv}" for _, d, dv, _ in calls_seen))
    shown = f"head dim {dims[0]}" if len(dims) == 1 else "head dims " + " and ".join(dims)
    return ", ".join(words) + "; " + shown + (" (q, k / v)" if "/" in shown else "")


def test_every_family_of_this_transformers_is_tested():
    """Only a transformers older than a family leaves it out (the floor environment), never the newest."""
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    assert ("gemma4" in FAMILIES) == (version >= GEMMA4_SINCE), transformers.__version__


def test_readme_families_table():
    """README's families table: one row per family of this file, its features as the model really passes them to
    the op, its paths as recorded by dispatch (the fp32 test asserts those per layer); and the refusals it lists
    are the attention function's."""
    text = README.read_text()
    marker = "<!-- families table: tests/integrations/test_transformers_models.py::test_readme_families_table -->"
    rows = text.split(marker, 1)[1].strip().split("\n\n", 1)[0].splitlines()[2:]
    table = {}
    for row in rows:
        name, features, paths = (c.strip() for c in row.strip("|").split("|"))
        table[name.strip("`")] = (features, paths)
    assert [name for name in table if name in FAMILIES] == list(FAMILIES)
    assert set(table) - set(FAMILIES) <= ({"gemma4"} if Gemma4ForCausalLM is None else set())
    for name, family in FAMILIES.items():
        want = (_features(family), ", ".join(_PATH_WORDS[p] for p in family.paths))
        assert table[name] == want, name
    refused = text.split("Refused, at the first forward", 1)[1].split("\n\n", 1)[0].replace("\n", " ")
    for feature in [*st.attention_function._UNSUPPORTED_KWARGS.values(), "output_attentions=True",
                    "learned additive attention mask"]:
        assert feature in refused, feature
