"""What the loss and gradient-norm detectors see on real CPU runs: record the traces once, replay them offline.

Run:  python benchmarks/healthy_traces.py                       (3 tasks x 6 data seeds; about 2 minutes, 1 thread)
      python benchmarks/healthy_traces.py --traces runs.json    (replay a recorded file only)

Not CI. Each task of ``benchmarks/healthy_runs.py`` is trained under ``on_spike="warn"`` (which changes
nothing in training) three times per data seed: healthy, and with a corrupted batch (every byte's high bit
set) at step 30 and at step 120. The detectors' inputs are recorded, so a detector variant can be judged on
the same values in seconds: the table gives, per run, the steps the default detectors flag (healthy runs:
false alarms) and whether the corrupted step is flagged, and then the worst excursions of healthy batches
beside the corrupted ones: the ratio over the median of the previous 5 losses, and the share of the run's
progress the value undoes, ``(value - median) / (initial - median)`` with the initial loss the median of the
first 5. Seeds 0-2 are the ones looked at while the detectors were changed, 3-5 are held out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import healthy_runs  # noqa: E402

from stable_attn.monitor import names, spikes  # noqa: E402

CORRUPT_AT = (30, 120)


def record(tasks: list[str], seeds: list[int], steps: int) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{"task/seed/bad": {metric: [(step, value), ...]}}``, ``bad`` the corrupted step or ``None``."""
    seen: list[tuple[str, int, float]] = []
    update = spikes.SpikeDetector.update

    def recording(self, step, value):
        seen.append((self.metric, int(step), float(value)))
        return update(self, step, value)

    spikes.SpikeDetector.update = recording
    try:
        runs = {}
        for task in tasks:
            for seed in seeds:
                for bad in (None, *CORRUPT_AT):
                    seen.clear()
                    healthy_runs.fit(task, steps if bad is None else bad + 2, seed, "warn",
                                     corrupt=() if bad is None else (bad,))
                    trace: dict[str, list[tuple[int, float]]] = {}
                    for metric, step, value in seen:
                        trace.setdefault(metric, []).append((step, value))
                    runs[f"{task}/{seed}/{bad}"] = trace
        return runs
    finally:
        spikes.SpikeDetector.update = update


def flags(trace: list[tuple[int, float]], detector: spikes.SpikeDetector) -> dict[int, str]:
    out = {}
    for step, value in trace:
        event = detector.update(step, value)
        if event is not None:
            out[step] = event.rule
    return out


def replay(runs: dict) -> None:
    print("| run | seeds | loss flags (step: rule) | grad-norm flags | corrupted step flagged |")
    print("|---|---|---|---|---|")
    excursions = []
    for key, trace in runs.items():
        task, seed, bad = key.split("/")
        loss = flags(trace[names.LOSS], spikes.SpikeDetector.loss())
        norm = flags(trace.get(names.GRAD_NORM, []), spikes.SpikeDetector.grad_norm())
        held = "held out" if int(seed) >= 3 else "looked at"
        hit = "-" if bad == "None" else ("yes" if int(bad) in loss or int(bad) in norm else "**no**")
        show = lambda f: ", ".join(f"{s}: {r}" for s, r in sorted(f.items())) or "-"  # noqa: E731
        print(f"| {key} | {held} | {show(loss)} | {show(norm)} | {hit} |")
        values = [v for _, v in trace[names.LOSS]]
        initial = statistics.median(values[:5])
        for i in range(8, len(values)):
            median = statistics.median(values[i - 5:i])
            corrupted = bad != "None" and trace[names.LOSS][i][0] == int(bad)
            if bad == "None" or corrupted:
                excursions.append((corrupted, task, values[i] / median, (values[i] - median) / (initial - median)))
    print()
    print("| task | healthy batches: largest ratio over the median of 5 | largest share of progress undone | "
          "corrupted batches: smallest ratio | smallest share undone |")
    print("|---|---|---|---|---|")
    for task in sorted({t for _, t, _, _ in excursions}):
        ok = [(r, m) for c, t, r, m in excursions if t == task and not c]
        bad = [(r, m) for c, t, r, m in excursions if t == task and c]
        print(f"| {task} | {max(r for r, _ in ok):.2f} | {max(m for _, m in ok):.2f} | "
              f"{min(r for r, _ in bad):.2f} | {min(m for _, m in bad):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--tasks", default="memorise,small_batch,text")
    parser.add_argument("--traces", help="a JSON file of recorded traces: replayed if it exists, else written")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in ("lightning", "lightning.pytorch", "stable_attn"):
        logging.getLogger(name).setLevel(logging.ERROR)
    t0 = time.perf_counter()
    if args.traces and os.path.exists(args.traces):
        with open(args.traces) as f:
            runs = json.load(f)
    else:
        runs = record(args.tasks.split(","), list(range(args.seeds)), args.steps)
        if args.traces:
            with open(args.traces, "w") as f:
                json.dump(runs, f)
    replay(runs)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s, torch {torch.__version__}, 1 thread")


if __name__ == "__main__":
    main()
