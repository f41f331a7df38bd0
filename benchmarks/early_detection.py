"""Detection from the first steps: a garbled batch early in a real run, and how far healthy early steps swing.

Run:  python benchmarks/early_detection.py     (~2 min on one core)

The tiny byte-level GPT-2 of the callback tests (``tests/callbacks/callback_lm.py``: 2 layers, width
32, sequence 32, batch 8, AdamW lr 3e-3 with a 5-step warm-up, Python's documentation as text) is
trained from its random initialisation in a plain loop, once clean and once per garbled step, where
the whole batch of that step has every byte's high bit flipped (bytes the model has never seen).
The loss and the gradient norm of every step go to ``SpikeDetector.loss()`` and
``SpikeDetector.grad_norm()`` with their defaults, as the Lightning callback feeds them.

Printed:

- for healthy runs (the clean run at lr 3e-3, and clean runs at 1e-2 and 3e-2), the largest ratio of
  a value to the median of its previous 5 values over the first 150 steps: how far a healthy loss and
  gradient norm swing before any detector is calibrated (the gross rule must stay above this);
- for each garbled step, the same ratio at that step, and which detector flagged it on that step
  (and with which rule), and any other alert in the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "callbacks"))

from callback_lm import batches_loader, tiny_gpt2  # noqa: E402

from stable_attn.monitor import SpikeDetector  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/machine.py
from machine import cpu_model  # noqa: E402

GARBLED = [5, 10, 20, 50, 90, 110, 150]
WINDOW = 5


def train(steps: int, lr: float, garbled: int | None) -> list[tuple[float, float]]:
    torch.manual_seed(0)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    rows = []
    for batch in batches_loader(range(steps), corrupt_batches=[] if garbled is None else [garbled]):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        rows.append((float(loss.detach()), norm))
    return rows


def ratio(values: list[float], i: int) -> float:
    previous = sorted(values[max(0, i - WINDOW) : i])
    mid = len(previous) // 2
    median = previous[mid] if len(previous) % 2 else 0.5 * (previous[mid - 1] + previous[mid])
    return values[i] / median


def detect(rows: list[tuple[float, float]]) -> list[tuple[int, str, str]]:
    detectors = {"loss": SpikeDetector.loss(), "grad_norm": SpikeDetector.grad_norm()}
    alerts = []
    for step, (loss, norm) in enumerate(rows):
        for name, value in (("loss", loss), ("grad_norm", norm)):
            event = detectors[name].update(step, value)
            if event is not None and event.is_new:
                alerts.append((step, name, event.rule))
    return alerts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "early_detection.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    result: dict = {"healthy": {}, "garbled": {}}
    print(f"Healthy runs: largest value / median of the previous {WINDOW}, steps 3-149")
    print()
    print("| lr | loss | grad norm | alerts |")
    print("|---|---|---|---|")
    for lr in (3e-3, 1e-2, 3e-2):
        rows = train(args.steps, lr, None)
        loss_max = max(ratio([r[0] for r in rows], i) for i in range(3, 150))
        norm_max = max(ratio([r[1] for r in rows], i) for i in range(3, 150))
        alerts = detect(rows)
        result["healthy"][f"{lr:g}"] = {"loss_ratio_max": loss_max, "grad_norm_ratio_max": norm_max, "alerts": alerts}
        print(f"| {lr:g} | {loss_max:.2f}x | {norm_max:.2f}x | {alerts or 'none'} |")
    print()
    print("Garbled batch at step s (lr 3e-3): its ratio to the median of the previous 5, and the alerts")
    print()
    print("| s | loss ratio | grad-norm ratio | flagged on step s by | other alerts |")
    print("|---|---|---|---|---|")
    for step in GARBLED:
        rows = train(args.steps, 3e-3, step)
        loss_r, norm_r = ratio([r[0] for r in rows], step), ratio([r[1] for r in rows], step)
        alerts = detect(rows)
        on_step = [f"{name} ({rule})" for s, name, rule in alerts if s == step]
        others = [(s, name, rule) for s, name, rule in alerts if s != step]
        result["garbled"][str(step)] = {"loss_ratio": loss_r, "grad_norm_ratio": norm_r, "alerts": alerts}
        print(f"| {step} | {loss_r:.2f}x | {norm_r:.2f}x | {', '.join(on_step) or 'missed'} | {others or 'none'} |")
    print()
    print(f"Machine: {cpu_model()}, {os.cpu_count()} cores visible, 1 torch thread, "
          f"Python {platform.python_version()}, torch {torch.__version__}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
