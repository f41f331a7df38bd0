"""What the loss and gradient-norm detectors see on real CPU runs: record the traces once, replay them offline.

Run:  python benchmarks/healthy_traces.py                       (3 tasks x 6 data seeds; about 2 minutes, 1 thread)
      python benchmarks/healthy_traces.py --traces runs.json    (replay a recorded file only)

Not CI. Each task of ``benchmarks/healthy_runs.py`` is trained under ``on_spike="warn"`` (which changes
nothing in training) three times per data seed: healthy, and with a corrupted batch (every byte's high bit
set) at step 30 and at step 120. The detectors' inputs are recorded, so a detector variant can be judged on
the same values in seconds: the table gives, per run, the spike alerts the engine raises with the default
detectors (healthy runs: false alarms), the gradient-norm jumps it counts but does not alert (the loss did
not confirm them), and whether the corrupted step is alerted, and then the worst excursions of healthy batches
beside the corrupted ones: the ratio over the median of the previous 5 losses, and the share of the run's
progress the value undoes, ``(value - median) / (initial - median)`` with the initial loss the median of the
first 5. Seeds 0-2 are the ones looked at while the detectors were changed, 3-5 are held out, and 6 on
(``--first-seed 6``) were recorded only after the last change, to judge it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import healthy_runs  # noqa: E402

from stable_attn.monitor import SpikeDetector, names  # noqa: E402
from stable_attn.monitor.detectors import spikes  # noqa: E402
from stable_attn.monitor.verdict import RankReading, StepJudge  # noqa: E402

CORRUPT_AT = (30, 120)


def record(tasks: list[str], seeds: list[int], steps: int) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{"task/seed/bad": {metric: [(step, value), ...]}}``, ``bad`` the corrupted step or ``None``."""
    seen: list[tuple[str, int, float]] = []
    update = spikes.SpikeDetector.update

    def recording(self, step, value, lr=None):
        seen.append((self.metric, int(step), float(value)))
        return update(self, step, value, lr=lr)

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


def alerts(trace: dict[str, list[tuple[int, float]]], **loss_options) -> tuple[dict[int, list[str]], int]:
    """The spike alerts the engine raises on a recorded run (its StepJudge under ``on_spike="warn"``, the
    default detectors), ``{step: [metric, ...]}``, and the gradient-norm jumps the loss did not confirm."""
    judge = StepJudge("warn", SpikeDetector.loss(**loss_options), SpikeDetector.grad_norm())
    out: dict[int, list[str]] = {}
    unconfirmed = 0
    for (step, loss), (_, norm) in zip(trace[names.LOSS], trace[names.GRAD_NORM]):
        judged = judge.judge(step, [RankReading(loss, norm)], has_norm=True, scaler=False, lr=math.nan)
        unconfirmed += judged.unconfirmed
        for event, _ in judged.spikes:
            out.setdefault(step, []).append(event.metric.split("/")[-1])
    return out, unconfirmed


SHAPE_FROM = 60  # the noise shape is read after the first descent
SHAPE_WINDOW = 9  # residuals about the centred median of this many values


def noise_shape(values: list[float]) -> tuple[float, float, float]:
    """The skewness of a healthy run's noise in linear and in log space, and its size relative to the loss:
    residuals about the centred median of 9 values, from step 60 on. Noise that is Gaussian in linear space
    has skewness ~0 there and a negative one in log space; log-normal noise the other way round."""
    tail = [v for v in values[SHAPE_FROM:] if math.isfinite(v) and v > 0]
    half = SHAPE_WINDOW // 2

    def moments(space: list[float]) -> tuple[float, float]:  # skewness and standard deviation of the residuals
        res = [space[i] - statistics.median(space[i - half:i + half + 1]) for i in range(half, len(space) - half)]
        mean = statistics.fmean(res)
        m2 = statistics.fmean([(r - mean) ** 2 for r in res])
        skew = statistics.fmean([(r - mean) ** 3 for r in res]) / m2 ** 1.5 if m2 > 0 else math.nan
        return skew, math.sqrt(m2)

    linear, sd = moments(tail)
    log, _ = moments([math.log(v) for v in tail])
    return linear, log, sd / statistics.fmean(tail)


def replay(runs: dict, **loss_options) -> None:
    print("| run | seeds | final loss | spike alerts (step: metrics) | gradient-norm jumps not confirmed | "
          "corrupted step alerted |")
    print("|---|---|---|---|---|---|")
    excursions = []
    groups = ("looked at", "held out", "fresh")
    false_alarms = {g: 0 for g in groups}
    caught = {g: [0, 0] for g in groups}
    present = set()  # the groups that have a run
    for key, trace in runs.items():
        task, seed, bad = key.split("/")
        got, unconfirmed = alerts(trace, **loss_options)
        held = groups[min(int(seed) // 3, 2)]  # 0-2 looked at, 3-5 held out, 6 on fresh (never looked at)
        present.add(held)
        if bad == "None":
            hit = "-"
            false_alarms[held] += len(got)
        else:
            hit = "yes" if int(bad) in got else "**no**"
            caught[held][0] += int(bad) in got
            caught[held][1] += 1
        shown = ", ".join(f"{s}: {'+'.join(m)}" for s, m in sorted(got.items())) or "-"
        values = [v for _, v in trace[names.LOSS]]
        final = f"{statistics.median(values[-10:]):.3g}" if bad == "None" else "-"  # median of the last 10
        print(f"| {key} | {held} | {final} | {shown} | {unconfirmed} | {hit} |")
        initial = statistics.median(values[:5])
        norms = [v for _, v in trace[names.GRAD_NORM]]
        for i in range(8, len(values)):
            median = statistics.median(values[i - 5:i])
            corrupted = bad != "None" and trace[names.LOSS][i][0] == int(bad)
            if bad == "None" or corrupted:
                norm = norms[i] / statistics.median(norms[i - 5:i]) if i < len(norms) else math.nan
                excursions.append((corrupted, task, values[i] / median, (values[i] - median) / (initial - median),
                                   norm))
    print()
    for held in (g for g in groups if g in present):
        print(f"seeds {held}: {false_alarms[held]} spike alert(s) on the healthy runs; corrupted batches alerted on "
              f"their step: {caught[held][0]}/{caught[held][1]}")
    print()
    print("| task | healthy batches: largest ratio over the median of 5 | largest share of progress undone | "
          "corrupted batches: smallest ratio | smallest share undone |")
    print("|---|---|---|---|---|")
    for task in sorted({t for _, t, *_ in excursions}):
        ok = [(r, m) for c, t, r, m, _ in excursions if t == task and not c]
        bad = [(r, m) for c, t, r, m, _ in excursions if t == task and c]
        print(f"| {task} | {max(r for r, _ in ok):.2f} | {max(m for _, m in ok):.2f} | "
              f"{min(r for r, _ in bad):.2f} | {min(m for _, m in bad):.2f} |")
    print()
    # Does the gradient norm tell apart what the loss cannot? The healthy batches at least as large (loss over the
    # median of 5) as the smallest corrupted one, beside the corrupted ones, both signals' ratios.
    print("| task | corrupted batches: loss ratio | their gradient-norm ratio | healthy batches with a loss ratio at "
          "least the smallest corrupted one | their gradient-norm ratio |")
    print("|---|---|---|---|---|")
    for task in sorted({t for _, t, *_ in excursions}):
        bad = [(r, n) for c, t, r, _, n in excursions if t == task and c]
        if not bad:
            continue
        floor = min(r for r, _ in bad)
        alike = [(r, n) for c, t, r, _, n in excursions if t == task and not c and r >= floor]
        spread = (lambda xs: f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-")
        print(f"| {task} | {spread([r for r, _ in bad])} | {spread([n for _, n in bad])} | {len(alike)} | "
              f"{spread([n for _, n in alike])} |")
    print()
    print(f"| task | healthy runs | noise / loss | skewness, linear space | skewness, log space |  (from step "
          f"{SHAPE_FROM}, about the centred median of {SHAPE_WINDOW}; mean over runs)")
    print("|---|---|---|---|---|")
    for task in sorted({key.split("/")[0] for key in runs}):
        shapes = [noise_shape([v for _, v in trace[names.LOSS]]) for key, trace in runs.items()
                  if key.startswith(task + "/") and key.endswith("/None") and len(trace[names.LOSS]) > SHAPE_FROM + 20]
        if shapes:
            lin, log, size = (statistics.fmean(col) for col in zip(*shapes))
            print(f"| {task} | {len(shapes)} | {size:.3f} | {lin:.2f} | {log:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="data seeds first-seed .. first-seed + seeds - 1 (6 on: never looked at while tuning)")
    parser.add_argument("--tasks", default="memorise,small_batch,text")
    parser.add_argument("--traces", help="a JSON file of recorded traces: replayed if it exists, else written")
    parser.add_argument("--min-progress-share", type=float, default=None,
                        help="replay with SpikeDetector.loss(min_progress_share=...) (default: off, as the callbacks)")
    parser.add_argument("--noisy-progress-share", type=float, default=None,
                        help="replay with SpikeDetector.loss(noisy_progress_share=...); a negative value: None (off, "
                             "the gate off); default: the callbacks' 0.1")
    parser.add_argument("--gross-ratio", type=float, default=None,
                        help="replay with SpikeDetector.loss(gross_ratio=...) (default: the callbacks' 1.25)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in ("lightning", "lightning.pytorch", "stable_attn"):
        logging.getLogger(name).setLevel(logging.ERROR)
    t0 = time.perf_counter()
    if args.traces and os.path.exists(args.traces):
        with open(args.traces) as f:
            runs = json.load(f)
    else:
        runs = record(args.tasks.split(","), list(range(args.first_seed, args.first_seed + args.seeds)), args.steps)
        if args.traces:
            with open(args.traces, "w") as f:
                json.dump(runs, f)
    options = {} if args.min_progress_share is None else {"min_progress_share": args.min_progress_share}
    if args.noisy_progress_share is not None:
        options["noisy_progress_share"] = None if args.noisy_progress_share < 0 else args.noisy_progress_share
    if args.gross_ratio is not None:
        options["gross_ratio"] = args.gross_ratio
    replay(runs, **options)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s, torch {torch.__version__}, 1 thread")


if __name__ == "__main__":
    main()
