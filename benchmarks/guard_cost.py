"""What the monitoring guard costs per optimizer step as the number of ranks grows: its collectives (bytes,
calls; computed from the engine's own constants) next to one all-reduce of the gradients, and the host time
of judging a step (every rank runs every rank's loss and gradient-norm detectors; measured).

Run:  python benchmarks/guard_cost.py                  (GPT-2 small: 12 layers, 12 heads; about 1 min)
      python benchmarks/guard_cost.py --ranks 8 64 1024 --steps 200

Not CI. The collectives per step (docs/DISTRIBUTED.md): one all-gather of each rank's row (loss, gradient norm,
has-loss, non-finite flag: ``verdict.FIELDS`` float64) on every step; one all-gather of the per-layer sums
(``layer_stats`` columns, float64) on monitored steps; with ``qk_clip`` one all-gather of the per-head max logits
(float32) every step; under FSDP2 / tensor parallelism one all-reduce of a float32 scalar per device mesh for
the gradient norm. Bytes are what each rank receives from a ring all-gather, ``(W - 1) x`` the row; the
gradient all-reduce moves ``2 (W - 1) / W x`` the gradients per rank (ring). The judge time is measured on the
host here: ``StepJudge.judge`` over ``W`` rows of healthy values, the median per step after warm-up.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_model  # noqa: E402

from stable_attn.monitor import SpikeDetector  # noqa: E402
from stable_attn.monitor.layer_stats import _COLUMNS  # noqa: E402
from stable_attn.monitor.verdict import FIELDS, StepJudge  # noqa: E402


def gpt2_small_params() -> int:
    """GPT-2 small's parameter count, from its config on the meta device (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config())
    return sum(p.numel() for p in model.parameters())


def judge_ms(world: int, steps: int) -> float:
    judge = StepJudge("skip", SpikeDetector.loss(), SpikeDetector.grad_norm())
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(steps, world, 2, generator=g).mul(0.01).tolist()
    times = []
    for step in range(steps):
        rows = [[2.5 * (1 + a), 0.8 * (1 + b), 1.0, 0.0] for a, b in noise[step]]
        start = time.perf_counter()
        judge.judge(step, rows, has_norm=True, scaler=False, lr=1e-3, note=lambda verdict: "")
        times.append(time.perf_counter() - start)
    return statistics.median(times[steps // 2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 1024])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = gpt2_small_params()
    step_row = FIELDS * 8
    monitored_row = args.layers * _COLUMNS * 8
    qk_row = args.layers * args.heads * 4
    print(f"# guard cost per optimizer step; {params:,} gradient elements (GPT-2 small), {args.layers} layers, "
          f"{args.heads} heads; host: {cpu_model()}, 1 thread")
    print("| ranks W | every step: all-gather (B received) | monitored step: + all-gather (B) | qk_clip: "
          "+ all-gather (B) | FSDP2 norm: + all-reduce | gradient all-reduce, fp32 (B sent per rank) | ratio "
          "(every step) | judge, host (ms/step) |")
    print("|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        grads = 2 * (world - 1) / world * params * 4
        every = (world - 1) * step_row
        ms = judge_ms(world, args.steps)
        print(f"| {world:,} | {every:,} (1 call) | {(world - 1) * monitored_row:,} (1 call) | "
              f"{(world - 1) * qk_row:,} (1 call) | 4 B per mesh (1 call each) | {grads:,.0f} | "
              f"{every / grads:.1e} | {ms:.2f} |")
    print(f"# rows: {step_row} B per rank every step, {monitored_row} B per rank on monitored steps, {qk_row} B "
          f"per rank with qk_clip; ratio = every-step bytes / gradient bytes; log2 of the gather's hops at "
          f"{max(args.ranks)} ranks: {math.log2(max(args.ranks)):.0f} (tree) to {max(args.ranks) - 1} (ring)")


if __name__ == "__main__":
    main()
