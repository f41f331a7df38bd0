"""Does the attention-entropy collapse rule warn before the loss explodes, and stay silent while a model learns?

Run:  python benchmarks/entropy_collapse.py                      (trains the 14 runs below, ~30 s each on one core,
                                                                 writes benchmarks/results/entropy_collapse.json)
      python benchmarks/entropy_collapse.py --replay benchmarks/results/entropy_collapse.json   (re-judge, seconds)

The runs are those of ``benchmarks/instability.py`` (tiny pre-LN GPT, bytes of Python's documentation, fp32,
AdamW, warm-up over 300 steps, 400 steps; ``instability.train``), over learning rates and seeds. Each layer's
mean attention entropy (``AttentionStats.summary()["entropy"]``, what the callbacks log as
``stable_attn/entropy/<layer>``) goes to ``EntropyCollapseDetector()`` and its max logit to
``SurgeDetector.max_logit()``, with the step's loss, as ``LayerWatch`` feeds them; the loss goes to
``SpikeDetector.loss()``; the loss-gated ``collapse`` rule is also replayed alone (``alarm_fraction=0``).
The defaults of the entropy rule were chosen on the two tuning runs (lr 1.0 seed 0,
lr 1e-2 seed 0) only; every other run is held out. Lead: steps from the first warning to the first loss alert.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from instability import RunConfig, train  # noqa: E402

from stable_attn.monitor import SpikeDetector, SurgeDetector  # noqa: E402
from stable_attn.monitor.detectors.collapse import EntropyCollapseDetector  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TUNING = {(1.0, 0), (1e-2, 0)}
GRID = [(3e-3, s) for s in range(3)] + [(1e-2, s) for s in range(3)] + [(3e-2, s) for s in range(2)] \
    + [(0.3, s) for s in range(2)] + [(1.0, s) for s in range(4)]


def judge(run: dict) -> dict:
    """First entropy warning (and its rule), first max-logit warning, first loss alert, warnings counted."""
    layers = len(run["entropy"][0])
    entropy = [EntropyCollapseDetector(f"stable_attn/entropy/layer{i}") for i in range(layers)]
    gated = [EntropyCollapseDetector(f"stable_attn/entropy/layer{i}", alarm_fraction=0.0) for i in range(layers)]
    max_logit = [SurgeDetector.max_logit(f"stable_attn/max_logit/layer{i}") for i in range(layers)]
    loss_det = SpikeDetector.loss()
    out = {"entropy": None, "entropy_rule": None, "collapse_alone": None, "max_logit": None, "loss_alert": None,
           "entropy_warnings": 0}
    for step, loss in enumerate(run["loss"]):
        event = loss_det.update(step, loss)
        if event is not None and out["loss_alert"] is None:
            out["loss_alert"] = step
        for i in range(layers):
            event = entropy[i].update(step, run["entropy"][step][i], loss=loss)
            if event is not None and event.is_new:
                out["entropy_warnings"] += 1
                if out["entropy"] is None:
                    out["entropy"], out["entropy_rule"] = step, f"{event.rule}, layer{i}"
            event = gated[i].update(step, run["entropy"][step][i], loss=loss)
            if event is not None and out["collapse_alone"] is None:
                out["collapse_alone"] = step
            event = max_logit[i].update(step, run["max_logit"][step][i], loss=loss)
            if event is not None and event.is_new and out["max_logit"] is None:
                out["max_logit"] = step
    return out


def lead(warning: int | None, loss_alert: int | None) -> str:
    return "-" if warning is None or loss_alert is None else str(loss_alert - warning)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replay", help="judge the traces of this JSON instead of training")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "entropy_collapse.json"))
    args = parser.parse_args()
    if args.replay:
        with open(args.replay) as f:
            runs = json.load(f)["runs"]
    else:
        import torch

        torch.set_num_threads(1)
        train_args = argparse.Namespace(steps=400, warmup=300, width=128, heads=4, layers=2, seq=64, batch=16)
        runs = []
        for lr, seed in GRID:
            r = train(RunConfig("run", lr, seed=seed), train_args)
            runs.append({"lr": lr, "seed": seed, "loss": r.loss, "max_logit": r.max_logit, "entropy": r.entropy})
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"runs": runs}, f)
    print("| lr | seed | set | loss, mean of last 100 | min entropy (nats) | first loss alert "
          "| entropy rule: first warning (rule, layer), lead | `collapse` alone (no `plunge`): first warning "
          "| max-logit rule: first warning, lead "
          "| entropy warnings |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in sorted(runs, key=lambda r: (r["lr"], r["seed"])):
        j = judge(run)
        tail = run["loss"][-100:]
        # fp32 summation can leave a one-hot layer at -1e-7 nats
        low = max(0.0, min(v for row in run["entropy"] for v in row if math.isfinite(v)))

        tuned = "tuning" if (run["lr"], run["seed"]) in TUNING else "held out"
        ent = "none" if j["entropy"] is None else f"step {j['entropy']} ({j['entropy_rule']})"
        ml = "none" if j["max_logit"] is None else f"step {j['max_logit']}"
        print(f"| {run['lr']:g} | {run['seed']} | {tuned} | {sum(tail) / len(tail):.2f} | {low:.3f} "
              f"| {j['loss_alert'] if j['loss_alert'] is not None else 'none'} "
              f"| {ent}, {lead(j['entropy'], j['loss_alert'])} "
              f"| {'none' if j['collapse_alone'] is None else 'step ' + str(j['collapse_alone'])} "
              f"| {ml}, {lead(j['max_logit'], j['loss_alert'])} | {j['entropy_warnings']} |")


if __name__ == "__main__":
    main()
