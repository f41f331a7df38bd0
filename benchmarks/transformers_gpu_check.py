"""GPU check of the transformers integration and patch_sdpa on the Triton backend; prints a table.

Run on a CUDA machine from the repository root: ``python benchmarks/transformers_gpu_check.py``.
For each tiny random model (no downloads) and dtype it compares "stable_attn" (forced to
backend=BACKEND) with "eager" on the same weights: logits at real tokens of a ragged, padded batch,
and every parameter gradient. For bf16 it also prints eager's own bf16 error against the fp32 model,
the yardstick for "within bf16 error". Then greedy generate() with a KV cache against sdpa (eager for
Gemma 2), packed documents (DataCollatorWithFlattening) against eager on each document alone, and a
nanoGPT-style module under patch_sdpa() against plain sdpa. Exit code 1 on a failure.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    DataCollatorWithFlattening,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

import stable_attn.integrations.transformers as st  # noqa: E402
from stable_attn.integrations.sdpa import patch_sdpa  # noqa: E402

DEV = os.environ.get("CHECK_DEVICE", "cuda")  # "cpu" dry-runs the script on the PyTorch backend
BACKEND = "triton" if DEV == "cuda" else "torch"
VOCAB, SEQ, WINDOW = 128, 200, 48
LENGTHS = (SEQ, SEQ - 37, SEQ - 90)
DOC_LENGTHS = (SEQ, 1, 57, 130, 90)  # packed documents: one token, some shorter and some longer than WINDOW
small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512)
FAMILIES = {
    "gpt2": (GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_positions=512, n_embd=64, n_layer=2, n_head=4), "sdpa"),
    "llama": (LlamaForCausalLM, LlamaConfig(**small, num_key_value_heads=2), "sdpa"),
    "mistral": (MistralForCausalLM, MistralConfig(**small, num_key_value_heads=2, sliding_window=WINDOW), "sdpa"),
    "gemma2": (Gemma2ForCausalLM, Gemma2Config(**small, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                               attn_logit_softcapping=0.5, query_pre_attn_scalar=2,
                                               initializer_range=0.2), "eager"),
    "bert": (BertForMaskedLM, BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=512), None),
}
failures: list[str] = []


def check(ok: bool, what: str) -> str:
    if not ok:
        failures.append(what)
    return "ok" if ok else "FAIL"


def build(name, impl, dtype=torch.float32):
    cls, config, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = cls._from_config(copy.deepcopy(config), attn_implementation=impl).eval().to(DEV)
    return model.to(dtype)


def batch(side):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (len(LENGTHS), SEQ), generator=g)
    mask = torch.zeros(len(LENGTHS), SEQ, dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        if side == "right":
            mask[b, :n] = 1
        else:
            mask[b, SEQ - n:] = 1
    return ids.to(DEV), mask.to(DEV)


def run(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    picked = logits[mask.bool()]
    w = torch.randn(picked.shape, generator=torch.Generator().manual_seed(2)).to(DEV)
    (picked.float() * w).sum().backward()
    return picked.detach().float(), {n: p.grad.detach().float() for n, p in model.named_parameters()
                                     if p.grad is not None}


def errors(logits, grads, ref_logits, ref_grads):
    le = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    floor = 0.01 * max(g.norm().item() for g in ref_grads.values())
    ge = max((grads[n] - g).norm().item() / max(g.norm().item(), floor) for n, g in ref_grads.items())
    return le, ge


def main() -> int:
    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device}, backend={BACKEND}")
    st.register()
    print(f"\n{'model':8} {'dtype':5} {'pad':5} | {'logit err':>9} {'grad err':>9} | {'eager bf16':>10} | result")
    for name in FAMILIES:
        for side in ("right", "left"):
            ids, mask = batch(side)
            ref32 = run(build(name, "eager"), ids, mask)
            for dtype in (torch.float32, torch.bfloat16):
                model = build(name, "stable_attn", dtype)
                st.configure(model, backend=BACKEND)
                stats = st.attach_stats(model)
                got = run(model, ids, mask)
                served = sum(s.calls for s in stats.values()) == 2
                le, ge = errors(*got, *ref32)
                if dtype == torch.float32:
                    ok = served and le < 1e-4 and ge < 1e-3
                    result = check(ok, f"{name} fp32 {side}")
                    print(f"{name:8} fp32  {side:5} | {le:9.2e} {ge:9.2e} | {'':>10} | {result}")
                else:
                    ee = errors(*run(build(name, "eager", dtype), ids, mask), *ref32)
                    ok = served and le <= 2 * ee[0] + 2**-8 and ge <= 2 * ee[1] + 2**-8
                    print(f"{name:8} bf16  {side:5} | {le:9.2e} {ge:9.2e} | {ee[0]:4.1e}/{ee[1]:4.1e} | "
                          f"{check(ok, f'{name} bf16 {side}')}")

    print("\ngenerate (fp32, left-padded ragged prompts, 24 new tokens, KV cache) vs reference")
    for name, (_, _, reference) in FAMILIES.items():
        if reference is None:
            continue
        ids, mask = batch("left")
        prompt, pmask = ids[:, :64], mask[:, :64].clone()
        pmask[:, -1] = 1
        outs = {}
        for impl in (reference, "stable_attn"):
            model = build(name, impl)
            if impl == "stable_attn":
                st.configure(model, backend=BACKEND)
            with torch.no_grad():
                outs[impl] = model.generate(input_ids=prompt, attention_mask=pmask, max_new_tokens=24,
                                            do_sample=False, pad_token_id=0)
        same = torch.equal(outs["stable_attn"], outs[reference])
        print(f"  {name:8} vs {reference:5}: {check(same, f'{name} generate')}")

    print("\npacked documents (DataCollatorWithFlattening, fp32) vs eager on each document alone")
    docs = [torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(3 + i)).tolist()
            for i, n in enumerate(DOC_LENGTHS)]
    packed = {k: v.to(DEV) for k, v in DataCollatorWithFlattening(return_tensors="pt")(
        [{"input_ids": d, "labels": d} for d in docs]).items()}
    for name, (_, _, reference) in FAMILIES.items():
        if reference is None:  # an encoder: transformers packs only causal masks
            continue
        eager = build(name, "eager")
        ref_logits = torch.cat([eager(input_ids=torch.tensor([d], device=DEV)).logits[0] for d in docs])
        w = torch.randn(ref_logits.shape, generator=torch.Generator().manual_seed(4)).to(DEV)
        (ref_logits * w).sum().backward()
        ref = ref_logits.detach(), {n: p.grad.detach() for n, p in eager.named_parameters() if p.grad is not None}
        for use_cache in (None, False):
            model = build(name, "stable_attn")
            st.configure(model, backend=BACKEND)
            stats = st.attach_stats(model)
            logits = model(**packed, **({} if use_cache is None else {"use_cache": use_cache})).logits[0]
            (logits * w).sum().backward()
            got = logits.detach(), {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
            le, ge = errors(*got, *ref)
            served = sum(s.calls for s in stats.values()) == 2
            print(f"  {name:8} use_cache={use_cache!s:5}: logit err {le:.2e}, grad err {ge:.2e}: "
                  f"{check(served and le < 1e-4 and ge < 1e-3, f'{name} packed use_cache={use_cache}')}")

    print("\npatch_sdpa on a causal self-attention call (bf16, B=2, H=8, N=512, D=64) vs plain sdpa")
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(2, 8, 512, 64, device=DEV, generator=g, dtype=torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with patch_sdpa(backend=BACKEND):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    err = (out.float() - ref.float()).abs().max().item()
    print(f"  max abs diff {err:.2e}: {check(err < 2e-2, 'patch_sdpa bf16')}")

    print("\nFAILURES: " + ", ".join(failures) if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"({time.time() - t0:.1f} s)")
    sys.exit(rc)
