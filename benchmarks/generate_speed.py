"""CPU benchmark: ``model.generate()`` with ``attn_implementation="stable_attn"`` against ``"sdpa"``.

    python benchmarks/generate_speed.py [--new-tokens 64] [--repeats 5] [--threads 1] [--models llama,qwen2]

One tiny randomly initialised causal LM per family (fp32, no download), greedy decoding of ``--new-tokens``
tokens after a 16-token prompt, batch 1, the default dynamic KV cache. Each model is built once and switched
between the two implementations with ``model.set_attn_implementation(...)`` (the line README gives for
generating with a model trained on ``"stable_attn"``), the two rounds interleaved, one warm-up round each.
Before timing, both must produce the same tokens. Prints, per model, the median wall time and CPU time
(``time.process_time``: on a shared machine it moves less with the load) of one ``generate()`` call, tokens
per second and the ratio stable_attn / sdpa, side by side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_model  # noqa: E402

import stable_attn  # noqa: E402, F401  (registers "stable_attn")

IMPLEMENTATIONS = ("sdpa", "stable_attn")
PROMPT_TOKENS = 16


def tiny_model(family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    if family not in configs:
        raise ValueError(f"--models: {family!r} is not one of {sorted(configs)}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs[family](**common), attn_implementation="stable_attn")
    return model.eval()


def generate(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0)


def measure(family: str, new_tokens: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall s, CPU s) of one generate() call per implementation."""
    model = tiny_model(family)
    prompt = torch.randint(1, 256, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
    outputs = {}
    for impl in IMPLEMENTATIONS:  # warm-up, and the check that both decode the same tokens
        model.set_attn_implementation(impl)
        outputs[impl] = generate(model, prompt, new_tokens)
    if not torch.equal(outputs["sdpa"], outputs["stable_attn"]):
        raise AssertionError(f"{family}: stable_attn and sdpa generated different tokens")
    times: dict[str, list[tuple[float, float]]] = {impl: [] for impl in IMPLEMENTATIONS}
    for _ in range(repeats):
        for impl in IMPLEMENTATIONS:
            model.set_attn_implementation(impl)
            wall, cpu = time.perf_counter(), time.process_time()
            generate(model, prompt, new_tokens)
            times[impl].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {impl: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for impl, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--models", default="llama,qwen2", help="comma-separated: llama, qwen2")
    args = parser.parse_args(argv)
    if args.new_tokens < 1 or args.repeats < 1:
        parser.error(f"--new-tokens and --repeats must be >= 1, got {args.new_tokens} and {args.repeats}")
    torch.set_num_threads(args.threads)
    import transformers

    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, {args.threads} torch thread(s); torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"generate(): batch 1, {PROMPT_TOKENS}-token prompt, {args.new_tokens} new tokens, greedy, fp32, "
          f"median of {args.repeats}")
    print(f"{'model':<8} {'sdpa wall s':>11} {'stable wall s':>13} {'sdpa tok/s':>10} {'stable tok/s':>12} "
          f"{'wall ratio':>10} {'CPU ratio':>9}")
    for family in [f for f in args.models.split(",") if f]:
        result = measure(family, args.new_tokens, args.repeats)
        (sw, sc), (aw, ac) = result["sdpa"], result["stable_attn"]
        print(f"{family:<8} {sw:>11.3f} {aw:>13.3f} {args.new_tokens / sw:>10.0f} {args.new_tokens / aw:>12.0f} "
              f"{aw / sw:>9.2f}x {ac / sc:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
