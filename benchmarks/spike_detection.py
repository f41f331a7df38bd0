"""Spike detection on synthetic LM loss traces: stable_attn's SpikeDetector vs Lightning's SpikeDetection.

Run:  python benchmarks/spike_detection.py            (defaults: 200 traces x 5000 steps, ~1M steps)
      python benchmarks/spike_detection.py --traces 40 (quick look)

What a trace is (all sizes in units of the local noise sigma(t), the true standard deviation of the
clean per-step noise at that step):

- clean curve: power-law or power-law + exponential decay from ~7-11 down to 1.8-3.5 (cross-entropy
  in nats), and in ~30% of traces a gentle upward drift of 3-10 sigma spread over 300-800 steps
  (a data-mixture change; not a spike);
- noise: Gaussian with sigma(t) = sigma0 * (L(t) / L(end))^p * exp(a * sin(...)) times a regime change
  (x0.6-1.6 over 20-200 steps) somewhere in the run; sigma0 in 0.008-0.06 nats;
- hard batches: on 1% of steps the value lies 2-4 sigma above the curve (instead of its Gaussian
  noise). They are clean steps: flagging one is a false alarm;
- grey zone: on 0.1% of steps the value lies 4-8 sigma above the curve; neither clean nor ground
  truth, their detection rate is reported separately;
- events (ground truth), placed after step 300, >= 250 clean steps apart:
  corrupted batch (single-step bump), spike with recovery (rise over 1-3 steps, exponential
  recovery with time constant 2-200 steps), isolated NaN / inf step, and at most one run-ending
  explosion per trace (fast: x1.5-3 per step; slow: x1.01-1.08 per step) that ends in NaN or a
  plateau at the unigram loss. Spike peaks are log-uniform in 8-400 sigma.

Ground truth: **the smallest deviation counted as a spike is 8 sigma(t)**. An event's onset is the
first step whose injected deviation reaches 8 sigma (or the NaN step). Recall counts an event when
the detector flags any step from the event's first perturbed step up to onset + 2. Delay is
max(0, first flag - onset) over recalled events. False alarms are flagged clean steps (steps outside
every event region, where a region runs from the first perturbed step to 10 steps after the
deviation has fallen below 0.5 sigma), per 10,000 clean steps.

Lightning's rule is reimplemented from ``lightning/fabric/utilities/spike.py`` at its defaults
(mode="min", window=10, warmup=1, atol=None, rtol=2.0, finite_only=True): from batch 1 on, a value
is a spike if it is non-finite, or if it rose from the last accepted value and
``|value - mean| >= 2 * |mean|`` where mean is the mean of the last 10 accepted values; only
non-spike values are accepted. Lightning raises TrainingSpikeException at the first spike; here both
detectors keep going so every event is scored. The reimplementation is checked against Lightning's own
class (its ``_is_spike`` / ``_update_stats``) on a trace before the benchmark runs.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from stable_attn.monitor import SpikeDetector

MIN_SPIKE_SIGMA = 8.0
EARLY_SIGMA = 4.0  # a flag before onset counts only once the deviation is beyond plausible noise
RECALL_WINDOW = 2
REGION_MARGIN = 10
SIZE_BUCKETS = [(8.0, 12.0), (12.0, 20.0), (20.0, 50.0), (50.0, 400.0)]
UNIGRAM_LOSS = 10.8  # ln(50257): the loss of a collapsed GPT-2-sized model


@dataclass
class Event:
    kind: str  # "corrupted_batch" | "spike_recovery" | "nan_step" | "fast_explosion" | "slow_explosion"
    start: int  # first perturbed step
    early: int  # first step whose deviation reaches EARLY_SIGMA: flags from here on count as detection
    onset: int
    end: int  # last step of the region (inclusive), margin included
    peak_sigma: float  # peak deviation / sigma at onset (inf for NaN)


@dataclass
class Trace:
    values: np.ndarray
    events: list[Event]
    clean: np.ndarray  # bool mask of clean steps
    hard: np.ndarray  # bool mask of hard-batch steps (subset of clean)
    grey: np.ndarray  # bool mask of grey-zone bump steps


def make_trace(seed: int, steps: int) -> Trace:
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=np.float64)

    l_inf = rng.uniform(1.8, 3.5)
    amp = rng.uniform(4.0, 8.0)
    t0 = rng.uniform(20.0, 300.0)
    alpha = rng.uniform(0.3, 0.7)
    curve = l_inf + amp * (1.0 + t / t0) ** (-alpha)
    if rng.random() < 0.5:
        curve += rng.uniform(0.5, 2.0) * np.exp(-t / rng.uniform(30.0, 300.0))

    p = rng.uniform(0.0, 1.0)
    sigma = rng.uniform(np.log(0.008), np.log(0.06))
    sigma = np.exp(sigma) * (curve / curve[-1]) ** p
    sigma *= np.exp(rng.uniform(0.0, 0.5) * np.sin(2 * np.pi * t / rng.uniform(1000.0, 6000.0) + rng.uniform(0, 6.3)))
    change_at = rng.uniform(0.2, 0.9) * steps
    change_len = rng.uniform(20.0, 200.0)
    factor = rng.uniform(0.6, 1.6)
    ramp = np.clip((t - change_at) / change_len, 0.0, 1.0)
    sigma *= 1.0 + (factor - 1.0) * ramp

    if rng.random() < 0.3:
        drift_at = rng.uniform(0.3, 0.8) * steps
        drift_len = rng.uniform(300.0, 800.0)
        drift_size = rng.uniform(3.0, 10.0)
        curve += drift_size * sigma * np.clip((t - drift_at) / drift_len, 0.0, 1.0)

    noise = rng.standard_normal(steps)
    # A hard batch lies 2-4 sigma above the curve (its noise term replaced, not added to: a bump of
    # 4 sigma on top of +2 sigma noise would be a 6-sigma value, which is not "within plausible noise").
    hard = rng.random(steps) < 0.01
    noise[hard] = rng.uniform(2.0, 4.0, hard.sum())
    grey = rng.random(steps) < 0.001
    grey &= ~hard
    noise[grey] = rng.uniform(4.0, 8.0, grey.sum())
    values = curve + sigma * noise

    events: list[Event] = []
    region = np.zeros(steps, dtype=bool)
    pos = 300 + int(rng.integers(0, 300))
    explode = rng.random() < 0.5
    explosion_start = int(rng.uniform(0.5, 0.95) * steps) if explode else steps
    while pos < explosion_start - 250:
        kind = rng.choice(["corrupted_batch", "spike_recovery", "spike_recovery", "nan_step"])
        if kind == "nan_step":
            values[pos] = rng.choice([math.nan, math.inf])
            end = min(pos + REGION_MARGIN, steps - 1)
            events.append(Event("nan_step", pos, pos, pos, end, math.inf))
        else:
            peak = float(np.exp(rng.uniform(np.log(MIN_SPIKE_SIGMA), np.log(400.0))))
            if kind == "corrupted_batch":
                dev = np.array([peak])
            else:
                rise = int(rng.integers(1, 4))
                tau = float(np.exp(rng.uniform(np.log(2.0), np.log(200.0))))
                up = peak * np.arange(1, rise + 1) / rise
                k = np.arange(1, 10_000)
                down = peak * np.exp(-k / tau)
                down = down[down >= 0.5][: steps - pos - rise]
                dev = np.concatenate([up, down])
            dev = dev[: explosion_start - pos]
            n = len(dev)
            values[pos : pos + n] += dev * sigma[pos]
            over = np.nonzero(dev >= MIN_SPIKE_SIGMA)[0]
            if len(over) == 0:  # truncated before reaching spike size: not ground truth, just excluded
                region[pos : pos + n + REGION_MARGIN] = True
                pos += n + 250
                continue
            end = min(pos + n - 1 + REGION_MARGIN, steps - 1)
            early = pos + int(np.nonzero(dev >= EARLY_SIGMA)[0][0])
            events.append(Event(str(kind), pos, early, pos + int(over[0]), end, peak))
        region[events[-1].start : events[-1].end + 1] = True
        pos = events[-1].end + 250 + int(rng.integers(0, 500))

    if explode:
        fast = rng.random() < 0.5
        growth = rng.uniform(1.5, 3.0) if fast else rng.uniform(1.01, 1.08)
        s0 = sigma[explosion_start]
        n = np.arange(steps - explosion_start)
        dev = 0.5 * np.exp(np.minimum(n * np.log(growth), 600.0))  # in sigmas, starts at half a sigma
        dev_abs = np.minimum(dev * s0, UNIGRAM_LOSS - curve[explosion_start:])
        values[explosion_start:] = curve[explosion_start:] + dev_abs + sigma[explosion_start:] * rng.standard_normal(
            len(n)
        )
        capped = np.nonzero(dev * s0 >= UNIGRAM_LOSS - curve[explosion_start:])[0]
        if len(capped) and rng.random() < 0.5:  # the run ends in NaN a few steps after saturating
            values[explosion_start + capped[0] + int(rng.integers(1, 20)) :] = math.nan
        over = np.nonzero(dev >= MIN_SPIKE_SIGMA)[0]
        if len(over):
            kind = "fast_explosion" if fast else "slow_explosion"
            early = explosion_start + int(np.nonzero(dev >= EARLY_SIGMA)[0][0])
            events.append(Event(kind, explosion_start, early, explosion_start + int(over[0]), steps - 1, math.inf))
        region[explosion_start:] = True

    clean = ~region & ~grey
    clean[0] = False  # neither detector can judge the first value
    return Trace(values, events, clean, hard & clean, grey & ~region, )


def lightning_flags(values: np.ndarray, window: int = 10, warmup: int = 1, rtol: float = 2.0) -> np.ndarray:
    """Lightning SpikeDetection's decision per step at its defaults (see module docstring)."""
    flags = np.zeros(len(values), dtype=bool)
    accepted: deque[float] = deque(maxlen=window)
    last = 0.0
    for i, x in enumerate(values.tolist()):
        spike = False
        if i >= warmup:
            mean = sum(accepted) / len(accepted)
            if not math.isfinite(x):
                spike = True
            elif x - last > 0.0:
                spike = abs(x - mean) >= abs(rtol * mean)
        if spike:
            flags[i] = True
        else:
            accepted.append(x)
            last = x
    return flags


def ours_flags(values: np.ndarray) -> np.ndarray:
    det = SpikeDetector("train/loss")
    flags = np.zeros(len(values), dtype=bool)
    update = det.update
    for i, x in enumerate(values.tolist()):
        if update(i, x) is not None:
            flags[i] = True
    return flags


def verify_lightning_reimplementation(steps: int) -> int:
    """Run Lightning's own SpikeDetection decision logic next to ours on one trace; return #steps."""
    import torch
    from lightning.fabric.utilities.spike import SpikeDetection

    # A trace with large spikes and a NaN, so the rule fires on some steps and not on others.
    trace = make_trace(12345, steps)
    values = trace.values.copy()
    values[steps // 3] = values[steps // 3 - 1] * 4.0
    values[steps // 2] = math.nan
    ref = SpikeDetection()
    expected = np.zeros(steps, dtype=bool)
    for i, x in enumerate(values.tolist()):
        loss = torch.tensor(x, dtype=torch.float64)
        is_spike = bool(i >= ref.warmup and ref._is_spike(loss))
        expected[i] = is_spike
        if not is_spike:
            ref._update_stats(loss)
    got = lightning_flags(values)
    if not np.array_equal(expected, got) or not expected.any():
        diff = np.nonzero(expected != got)[0][:10]
        raise SystemExit(f"Lightning rule reimplementation differs from Lightning at steps {diff.tolist()}")
    return steps


@dataclass
class Score:
    detected: dict[str, list[bool]] = field(default_factory=dict)
    delays: dict[str, list[int]] = field(default_factory=dict)
    false_alarms: int = 0
    false_alarms_hard: int = 0
    clean_steps: int = 0
    hard_steps: int = 0
    grey_flagged: int = 0
    grey_steps: int = 0
    explosions: dict[str, list[tuple[int | None, float | None]]] = field(default_factory=dict)

    def add(self, trace: Trace, flags: np.ndarray) -> None:
        for ev in trace.events:
            window = flags[ev.early : ev.onset + RECALL_WINDOW + 1]
            hit = bool(window.any())
            delay = max(0, ev.early + int(np.argmax(window)) - ev.onset) if hit else None
            for key in (ev.kind, bucket_of(ev), "all"):
                if key is None:
                    continue
                self.detected.setdefault(key, []).append(hit)
                if delay is not None:
                    self.delays.setdefault(key, []).append(delay)
            if ev.kind.endswith("explosion"):
                # Explosions: also when the detector first fires at all, relative to onset
                # (negative: before the deviation reached 8 sigma), and how far the loss had risen.
                later = np.nonzero(flags[ev.early :])[0]
                first = ev.early + int(later[0]) if len(later) else None
                rise = None if first is None else float(trace.values[first] / trace.values[ev.start - 1])
                self.explosions.setdefault(ev.kind, []).append((None if first is None else first - ev.onset, rise))
        self.false_alarms += int((flags & trace.clean).sum())
        self.false_alarms_hard += int((flags & trace.hard).sum())
        self.clean_steps += int(trace.clean.sum())
        self.hard_steps += int(trace.hard.sum())
        self.grey_flagged += int((flags & trace.grey).sum())
        self.grey_steps += int(trace.grey.sum())

    def recall(self, key: str) -> str:
        hits = self.detected.get(key, [])
        return f"{np.mean(hits):.3f} ({sum(hits)}/{len(hits)})" if hits else "-"

    def delay(self, key: str) -> str:
        d = self.delays.get(key, [])
        return f"{np.mean(d):.2f}" if d else "-"


def first_flag_summary(items: list[tuple[int | None, float | None]]) -> tuple[str, str, str]:
    flagged = [(d, r) for d, r in items if d is not None]
    never = f"{len(items) - len(flagged)}/{len(items)}"
    if not flagged:
        return "-", "-", never
    delays = np.array([d for d, _ in flagged])
    rises = np.array([r for _, r in flagged], dtype=float)
    finite = rises[np.isfinite(rises)]
    rise = f"{np.median(finite):.2f}x" if len(finite) else "-"
    if len(finite) < len(rises):
        rise += f" ({len(rises) - len(finite)} at NaN)"
    return f"{np.median(delays):+.0f} [{delays.min():+d}, {delays.max():+d}]", rise, never


def bucket_of(ev: Event) -> str | None:
    if ev.kind not in ("corrupted_batch", "spike_recovery"):
        return None
    for lo, hi in SIZE_BUCKETS:
        if lo <= ev.peak_sigma < hi:
            return f"spikes {lo:g}-{hi:g} sigma"
    return f"spikes {SIZE_BUCKETS[-1][0]:g}-{SIZE_BUCKETS[-1][1]:g} sigma"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=int, default=200, help="number of synthetic traces (seeds 0..N-1)")
    parser.add_argument("--steps", type=int, default=5000, help="steps per trace")
    parser.add_argument("--seed-offset", type=int, default=0, help="first seed")
    parser.add_argument("--verify-steps", type=int, default=1500, help="steps checked against Lightning's class")
    args = parser.parse_args()

    t_start = time.perf_counter()
    verified = verify_lightning_reimplementation(args.verify_steps)
    t_verify = time.perf_counter() - t_start

    ours, theirs = Score(), Score()
    t_ours = t_theirs = 0.0
    total_steps = 0
    for seed in range(args.seed_offset, args.seed_offset + args.traces):
        trace = make_trace(seed, args.steps)
        total_steps += len(trace.values)
        t0 = time.perf_counter()
        ours.add(trace, ours_flags(trace.values))
        t1 = time.perf_counter()
        theirs.add(trace, lightning_flags(trace.values))
        t_ours += t1 - t0
        t_theirs += time.perf_counter() - t1

    keys = ["all", "corrupted_batch", "spike_recovery", "nan_step", "fast_explosion", "slow_explosion"]
    keys += [f"spikes {lo:g}-{hi:g} sigma" for lo, hi in SIZE_BUCKETS]
    print(f"Spike detection on synthetic LM loss traces: {args.traces} traces x {args.steps} steps "
          f"(seeds {args.seed_offset}..{args.seed_offset + args.traces - 1}), {total_steps:,} steps")
    print(f"Smallest spike counted: {MIN_SPIKE_SIGMA:g} x local noise sigma; recall = flagged by onset + "
          f"{RECALL_WINDOW} steps; hard batches (2-4 sigma, 1% of steps) are clean steps.")
    print()
    w = 50
    print(f"| {'events':<{w}} | {'n':>7} | {'recall, ours':>18} | {'recall, Lightning':>18} "
          f"| {'delay, ours':>11} | {'delay, Lightning':>16} |")
    print(f"|{'-' * (w + 2)}|{'-' * 9}|{'-' * 20}|{'-' * 20}|{'-' * 13}|{'-' * 18}|")
    for key in keys:
        n = len(ours.detected.get(key, []))
        print(f"| {key:<{w}} | {n:>7} | {ours.recall(key):>18} | {theirs.recall(key):>18} "
              f"| {ours.delay(key):>11} | {theirs.delay(key):>16} |")
    print()
    fa = lambda s: 1e4 * s.false_alarms / max(s.clean_steps, 1)  # noqa: E731
    print(f"| {'clean steps':<{w}} | {'':>7} | {'ours':>18} | {'Lightning':>18} |")
    print(f"|{'-' * (w + 2)}|{'-' * 9}|{'-' * 20}|{'-' * 20}|")
    print(f"| {'false alarms / 10k clean':<{w}} | {'':>7} | {fa(ours):>18.3f} | {fa(theirs):>18.3f} |")
    print(f"| {'false alarms (count)':<{w}} | {ours.clean_steps:>7} | {ours.false_alarms:>18} "
          f"| {theirs.false_alarms:>18} |")
    print(f"| {'  of which on hard batches':<{w}} | {ours.hard_steps:>7} | {ours.false_alarms_hard:>18} "
          f"| {theirs.false_alarms_hard:>18} |")
    print(f"| {'grey zone 4-8 sigma flagged':<{w}} | {ours.grey_steps:>7} | {ours.grey_flagged:>18} "
          f"| {theirs.grey_flagged:>18} |")
    print()
    print(f"| {'explosions: first flag at any time':<{w}} | {'n':>7} | {'ours':>18} | {'Lightning':>18} |")
    print(f"|{'-' * (w + 2)}|{'-' * 9}|{'-' * 20}|{'-' * 20}|")
    for kind in ("fast_explosion", "slow_explosion"):
        cells = [first_flag_summary(score.explosions.get(kind, [])) for score in (ours, theirs)]
        rows = (("steps after onset, median [range]", 0), ("loss / pre-event loss, median", 1), ("never flagged", 2))
        for label, idx in rows:
            n = len(ours.explosions.get(kind, []))
            print(f"| {kind + ': ' + label:<{w}} | {n:>7} | {cells[0][idx]:>18} | {cells[1][idx]:>18} |")
    print()
    print(f"Detector time: ours {1e6 * t_ours / total_steps:.2f} us/step, "
          f"Lightning rule (pure Python) {1e6 * t_theirs / total_steps:.2f} us/step; "
          f"Lightning reimplementation verified on {verified} steps against its class ({t_verify:.1f} s).")
    print(f"Machine: {cpu_model()}, {os.cpu_count()} cores visible, {platform.system()}, "
          f"Python {platform.python_version()}, numpy {np.__version__}; total {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
