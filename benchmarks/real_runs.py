"""Spike alerts on real training curves: ours against five published rules, per signal.

Run:  python benchmarks/real_runs.py                      (the corpus + 9 synthetic families x 50 traces x 4000 steps;
                                                          about 17 minutes on a shared 2-core machine, 1 thread)
      python benchmarks/real_runs.py --traces 4 --steps 1500   (a quick look)
      python benchmarks/real_runs.py --markdown table.md --json summary.json
      python benchmarks/real_runs.py --agreement               (only: a lower gradient-norm bar where the loss agrees)
      python benchmarks/real_runs.py --frontier                (only: every target against settings of our options;
                                                          about 8 minutes)

The corpus is ``benchmarks/data/real_runs/`` (its ``manifest.json`` names every run's source): the loss,
gradient-norm and learning-rate series of 82 public ``transformers.Trainer`` runs and 4 CPU runs of
``benchmarks/record_cpu_runs.py``, each real event labelled by eye with its signals and step window, and the
context (warm-up, restarts, epoch boundaries, quantised or exactly-zero losses) that is not an event.
Each rule sees one signal of one run from its first logged point, one value per point, as a callback fed
at the logging interval would.

Rules (each is given exactly what its source does; none is tuned here):

- **ours**: ``SpikeDetector.loss()`` on the loss and ``SpikeDetector.grad_norm()`` on the gradient norm, as
  ``MonitorEngine`` builds them, each value with the run's learning rate at that point (as the engine passes the
  optimizer's); a point is flagged when ``update`` returns an event. A reference row: the same without the
  learning rate (a loop that does not pass it). ``ENGINE_ROW``: what the engine alerts, each logged step's loss and
  gradient norm judged together by its ``StepJudge`` (a gradient-norm jump counts only where the loss confirms it;
  no GradScaler assumed, so a non-finite norm counts). Another (not a default): ``warmup_drift=False``, no drift alert
  while a warm-up's learning rate rises. Another (not a default): the same with ``gross_z=0``, the gross
  rule's ratio without its noise bar. Another:
  ``rising_noise=False, start_ratio=None``, the gradient-norm detector before it measured its noise on rises only
  and had its start rule (docs/DETECTORS.md, "The start of a run"; with today's 3x minimum rise for its jumps); on
  the loss those are the defaults.
- **Lightning**: ``lightning.fabric.utilities.spike.SpikeDetection`` at its defaults (mean of the last 10
  accepted values, ``rtol=2.0``, mode ``min``), as ``benchmarks/spike_detection.py`` reimplements it
  (checked against Lightning's class when this runs).
- **median/MAD**: log value more than 6 robust sigmas (1.4826 MAD) above the median of the last 50 accepted
  log values (``spike_detection.median_mad_flags``; k = 6 is what ``spike_detection.py`` chose on its
  tuning traces, ``benchmarks/results/spike_detection.json``).
- **OLMo-core**: ``SkipStepOptimizer.get_step_factor`` (allenai/OLMo-core,
  ``src/olmo_core/optim/skip_step_optimizer.py``): the last 128 values plus the current one are kept, no
  decision before 64 are held, ``|x - mean| / std`` over the previous ones (unbiased std) above
  ``sigma_factor=6`` skips; every value enters the window, flagged ones too. Two-sided (``abs``), as there.
  A NaN z (a window of identical values, or a NaN in it) skips, as ``nan <= 6`` is false there.
- **llm.c**: ``update_detector`` (karpathy/llm.c, ``llmc/outlier_detector.h``): a 64-value window, z of the
  new value with the new value already in the window, and a value above the threshold taken back out of
  the window (kept out) unless it is the third outlier in a row. llm.c's thresholds
  (``-sl``/``-sg``, ``skip_update_lossz``/``skip_update_gradz`` in ``train_gpt2.cu``) default to 0 (off);
  6 here, the same sigma as OLMo-core's, so the two differ only in what enters the window.
- **cosmos**: ``LossSpikeRollback`` (NVIDIA/cosmos-framework, ``cosmos_framework/callbacks/loss_spike_rollback.py``),
  gradient norm only: a norm above 10x the median of the last 50 accepted norms (from 12 on), the median
  capped at 4x the lowest median seen; flagged norms are not appended; a non-finite norm is flagged.

Scores, per rule and signal. An alert *episode* is a maximal run of consecutive flagged points; it is
*on an event* if one of its points lies in the step window of a labelled event of that signal, else it is
*benign* (a false alarm: warm-up, restarts and every other context item included).

- runs alerted: runs with at least one benign episode / runs that log the signal;
- benign episodes per 10,000 points of the signal;
- events caught: labelled events of the signal with a flag inside their window; delay: logged points from
  the window's first point to the first flag (mean over caught events).

The synthetic part scores the same rules (loss version; cosmos is a gradient-norm rule) on the families of
``benchmarks/spike_detection.py`` (tuning, held-out, scale/noise with Gaussian and with log-normal noise), with
that script's ground truth: an event is caught when a flag falls from its 4-sigma step to 2 steps after its
8-sigma onset; benign episodes start on clean steps, per 10,000 clean steps. Three more families: ``restarts``
and ``restarts, held out`` (``restart_trace``: the tuning and fresh held-out traces under a cosine schedule with
warm restarts, the loss jumping with the learning rate; ours is given the schedule) and ``clusters, held out``
(``cluster_trace``: fresh held-out traces whose corrupted batches come in threes, the 2nd and 3rd scored as
``cluster_2nd`` and ``cluster_3rd``). Two more: ``warm-up`` and ``warm-up, held out`` (``warmup_trace``: the loss
rising with a warm-up's learning rate and settling back after its end; the held-out one with its own warm-up
shapes and fresh held-out traces; ours is given the schedule).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # machine.py, spike_detection.py
import spike_detection as sd  # noqa: E402
from machine import cpu_model  # noqa: E402

from stable_attn.monitor import SpikeDetector, names  # noqa: E402
from stable_attn.monitor.verdict import RankReading, StepJudge  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "real_runs")
SIGNALS = ("loss", "grad_norm")
MAD_K = 6.0  # chosen by spike_detection.py on its tuning traces (benchmarks/results/spike_detection.json)
OLMO_WINDOW, OLMO_SIGMA = 128, 6.0
LLMC_WINDOW, LLMC_Z = 64, 6.0
COSMOS_FACTOR, COSMOS_WINDOW, COSMOS_MIN, COSMOS_CAP = 10.0, 50, 12, 4.0
FAMILIES = ("tuning", "heldout", "scale", "scale_lognormal")
# Families under a schedule with warm restarts (restart_trace): the spike_detection.py family each builds on and
# the seed offset (the held-out one's seeds are fresh, never looked at while choosing).
RESTART_FAMILIES = {"restarts": ("tuning", 0), "restarts, held out": ("heldout", 5_000_011)}
CLUSTER_FAMILY, CLUSTER_SEEDS = "clusters, held out", 9_000_017  # cluster_trace's family and fresh seeds
# Families under a warm-up (warmup_trace): the spike_detection.py family each builds on and fresh seeds. The held-out
# one also has its own warm-up shapes (never looked at while choosing).
WARMUP_FAMILIES = {"warm-up": ("tuning", 11_000_003), "warm-up, held out": ("heldout", 13_000_019)}


# ------------------------------------------------------------------------------------------------ corpus
@dataclass
class Series:
    run: str
    signal: str
    steps: np.ndarray
    values: np.ndarray
    events: list[dict] = field(default_factory=list)  # manifest events of this signal
    lrs: np.ndarray | None = None  # the learning rate at each point (NaN where the run did not log it)
    blind: bool = False  # labelled before any detector ran on it, after every detector change: never tuned on


def load_manifest(folder: str = CORPUS) -> dict:
    with open(os.path.join(folder, "manifest.json")) as f:
        return json.load(f)


def load_series(folder: str = CORPUS) -> list[Series]:
    """One ``Series`` per run and signal the run logs, with the events labelled on that signal."""
    out = []
    for run in load_manifest(folder)["runs"]:
        with open(os.path.join(folder, run["file"])) as f:
            rows = list(csv.DictReader(f))
        for signal in SIGNALS:
            kept = [(int(r["step"]), float(r[signal]), float(r.get("learning_rate") or "nan"))
                    for r in rows if r[signal] != ""]
            if not kept:
                continue
            events = [e for e in run["events"] if signal in e["signals"]]
            steps, values, lrs = (np.array(column) for column in zip(*kept))
            out.append(Series(run["id"], signal, steps.astype(int), values, events,
                              None if np.isnan(lrs).all() else lrs, bool(run.get("blind", False))))
    return out


# ------------------------------------------------------------------------------------------------- rules
def lr_detector_flags(det: SpikeDetector, values: np.ndarray, lrs: np.ndarray | None) -> np.ndarray:
    """``det`` fed each value with its learning rate (None: without), as the engine feeds it."""
    if lrs is None:
        return sd.detector_flags(det, values)
    update = det.update
    return np.array([update(i, x, lr=lr) is not None for i, (x, lr) in enumerate(zip(values.tolist(), lrs.tolist()))],
                    dtype=bool)


def preset(signal: str, **kwargs: float | bool | None) -> SpikeDetector:
    return SpikeDetector.loss(**kwargs) if signal == "loss" else SpikeDetector.grad_norm(**kwargs)


def ours_flags(values: np.ndarray, signal: str, lrs: np.ndarray | None = None) -> np.ndarray:
    """The callbacks' detectors, fed the learning rate (the engine passes the optimizer's)."""
    return lr_detector_flags(preset(signal), values, lrs)


def ours_without_lr_flags(values: np.ndarray, signal: str, lrs: np.ndarray | None = None) -> np.ndarray:
    """A reference row: ours without the learning rate (a loop that does not pass it; no schedule restart seen)."""
    return lr_detector_flags(preset(signal), values, None)


def ours_two_sided_flags(values: np.ndarray, signal: str, lrs: np.ndarray | None = None) -> np.ndarray:
    """A reference row, not a default: two-sided noise and no start rule (on the loss, its defaults: the same as
    ours)."""
    return lr_detector_flags(preset(signal, rising_noise=False, start_ratio=None), values, lrs)


def ours_warmup_hold_flags(values: np.ndarray, signal: str, lrs: np.ndarray | None = None) -> np.ndarray:
    """A reference row, not a default: ours with ``warmup_drift=False`` (no drift alert while a warm-up's learning
    rate rises)."""
    return lr_detector_flags(preset(signal, warmup_drift=False), values, lrs)


def ours_ratio_only_flags(values: np.ndarray, signal: str, lrs: np.ndarray | None = None) -> np.ndarray:
    """A reference row, not a default: ours with ``gross_z=0`` (the gross rule's ratio alone, no noise bar)."""
    return lr_detector_flags(preset(signal, gross_z=0.0), values, lrs)


def olmo_flags(values: np.ndarray, window: int = OLMO_WINDOW, sigma: float = OLMO_SIGMA) -> np.ndarray:
    """OLMo-core's skip decision per value (see the module docstring)."""
    flags = np.zeros(len(values), dtype=bool)
    held = max(20, window // 2)
    for i, x in enumerate(values.tolist()):
        prev = values[max(0, i - window): i]
        if len(prev) + 1 < held:
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            z = abs(x - prev.mean()) / prev.std(ddof=1)
        flags[i] = not (z <= sigma)
    return flags


def llmc_flags(values: np.ndarray, window: int = LLMC_WINDOW, threshold: float = LLMC_Z) -> np.ndarray:
    """llm.c's outlier detector with a skip threshold (see the module docstring)."""
    flags = np.zeros(len(values), dtype=bool)
    buf: list[float] = []
    index, in_a_row, total, total_sq = 0, 0, 0.0, 0.0
    for i, x in enumerate(values.tolist()):
        if len(buf) < window:
            buf.append(x)
            total, total_sq, in_a_row = total + x, total_sq + x * x, 0
            continue
        old = buf[index]
        total, total_sq = total - old + x, total_sq - old * old + x * x
        buf[index] = x
        mean = total / window
        std = math.sqrt(max(total_sq / window - mean * mean, 0.0)) if math.isfinite(total_sq) else math.nan
        z = 0.0 if std == 0.0 else (x - mean) / std
        if z > threshold:
            flags[i] = True
            in_a_row += 1
            if in_a_row < 3:  # kept out of the window, except the third outlier in a row
                total, total_sq = total - x + old, total_sq - x * x + old * old
                buf[index] = old
                continue
        else:
            in_a_row = 0
        index = (index + 1) % window
    return flags


def cosmos_flags(values: np.ndarray, factor: float = COSMOS_FACTOR, window: int = COSMOS_WINDOW,
                 minimum: int = COSMOS_MIN, cap: float = COSMOS_CAP) -> np.ndarray:
    """cosmos-framework's gradient-norm spike test (see the module docstring)."""
    flags = np.zeros(len(values), dtype=bool)
    norms: deque[float] = deque(maxlen=window)
    healthy: float | None = None
    for i, x in enumerate(values.tolist()):
        if not math.isfinite(x):
            flags[i] = True
            continue
        baseline = None
        if len(norms) >= minimum:
            ordered = sorted(norms)
            mid = len(ordered) // 2
            median = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
            healthy = median if healthy is None or median < healthy else healthy
            baseline = min(median, cap * healthy)
        if baseline is not None and baseline > 0.0 and x > factor * baseline:
            flags[i] = True
            continue
        norms.append(x)
    return flags


Rule = Callable[[np.ndarray, str, "np.ndarray | None"], "np.ndarray | None"]
RULES: dict[str, Rule] = {
    "ours": ours_flags,
    "ours, without the learning rate (reference)": ours_without_lr_flags,
    "ours, gross_z=0 (reference)": ours_ratio_only_flags,
    "ours, two-sided noise, no start rule (reference)": ours_two_sided_flags,
    "ours, drift held in warm-ups (reference)": ours_warmup_hold_flags,
    "Lightning": lambda v, s, lr: sd.lightning_flags(v),
    f"median/MAD k={MAD_K:g}": lambda v, s, lr: sd.median_mad_flags(v, MAD_K),
    "OLMo-core 6σ/128": lambda v, s, lr: olmo_flags(v),
    "llm.c 6σ/64 kept out": lambda v, s, lr: llmc_flags(v),
    "cosmos 10x median": lambda v, s, lr: cosmos_flags(v) if s == "grad_norm" else None,
}


# ------------------------------------------------------------------------------------------------ scores
# The row of what a user sees: both signals of a run judged together, as the callbacks' engine judges them.
ENGINE_ROW = "ours, as the engine alerts (both signals judged together)"


def engine_flags(series: list[Series]) -> dict[tuple[str, str], np.ndarray]:
    """Per (run, signal), the points the engine treats as spikes: each logged step's loss and gradient norm judged
    together by the engine's ``StepJudge`` (the callbacks' detectors, ``on_spike="warn"``, the learning rate), so a
    gradient-norm jump counts only where the loss confirms it (``monitor/verdict.py``); a step that logs one signal
    is judged on that one. No GradScaler is assumed (a non-finite norm is a spike)."""
    runs: dict[str, dict[str, Series]] = {}
    for s in series:
        runs.setdefault(s.run, {})[s.signal] = s
    out = {}
    for run, both in runs.items():
        at = {signal: {int(step): i for i, step in enumerate(s.steps.tolist())} for signal, s in both.items()}
        flags = {signal: np.zeros(len(s.values), dtype=bool) for signal, s in both.items()}
        judge = StepJudge("warn", preset("loss"), preset("grad_norm"))
        for step in sorted(set().union(*at.values())):
            i, j = at.get("loss", {}).get(step), at.get("grad_norm", {}).get(step)
            lrs = [float(both[signal].lrs[k]) for signal, k in (("loss", i), ("grad_norm", j))
                   if k is not None and both[signal].lrs is not None]
            reading = RankReading(float(both["loss"].values[i]) if i is not None else math.nan,
                                  float(both["grad_norm"].values[j]) if j is not None else math.nan,
                                  has_loss=i is not None)
            judged = judge.judge(step, [reading], has_norm=j is not None, scaler=False,
                                 lr=lrs[0] if lrs else math.nan)
            if i is not None:
                flags["loss"][i] = bool(judged.events[names.LOSS])
            if j is not None:  # one rank: its norm's event counts unless it went unconfirmed
                flags["grad_norm"][j] = bool(judged.events[names.GRAD_NORM]) and not judged.unconfirmed
        out.update({(run, signal): f for signal, f in flags.items()})
    return out


def episodes(flags: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive flagged points, as (first index, last index)."""
    out, start = [], None
    for i, f in enumerate(flags.tolist() + [False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i - 1))
            start = None
    return out


@dataclass
class CorpusScore:
    points: int = 0
    runs: int = 0
    runs_alerted: int = 0
    benign: int = 0
    flagged: int = 0
    events: int = 0
    caught: int = 0
    delays: list[int] = field(default_factory=list)
    benign_at: list[tuple[str, int, int]] = field(default_factory=list)  # (run, first step, length)

    def rate(self) -> float:
        return 1e4 * self.benign / max(self.points, 1)


def score_series(score: CorpusScore, series: Series, flags: np.ndarray) -> None:
    in_event = np.zeros(len(series.values), dtype=bool)
    for event in series.events:
        lo, hi = event["steps"]
        window = (series.steps >= lo) & (series.steps <= hi)
        in_event |= window
        score.events += 1
        hits = np.nonzero(window & flags)[0]
        if len(hits):
            score.caught += 1
            score.delays.append(int(hits[0] - np.argmax(window)))
    benign = [(a, b) for a, b in episodes(flags) if not in_event[a: b + 1].any()]
    score.points += len(series.values)
    score.runs += 1
    score.runs_alerted += bool(benign)
    score.benign += len(benign)
    score.flagged += int(flags.sum())
    score.benign_at += [(series.run, int(series.steps[a]), b - a + 1) for a, b in benign]


def score_corpus(series: list[Series], engine: dict[tuple[str, str], np.ndarray] | None = None
                 ) -> dict[str, dict[str, CorpusScore]]:
    """Every rule's scores per signal, and right after ours the engine's (ENGINE_ROW; ``engine``: its flags, from
    :func:`engine_flags` of these series or more, computed here without)."""
    out: dict[str, dict[str, CorpusScore]] = {}
    engine = engine_flags(series) if engine is None else engine
    for name, rule in RULES.items():
        for s in series:
            flags = rule(s.values, s.signal, s.lrs)
            if flags is None:
                continue
            score_series(out.setdefault(name, {}).setdefault(s.signal, CorpusScore()), s, flags)
        if name == "ours":
            for s in series:
                score_series(out.setdefault(ENGINE_ROW, {}).setdefault(s.signal, CorpusScore()), s,
                             engine[(s.run, s.signal)])
    return out


@dataclass
class SyntheticScore:
    clean: int = 0
    benign: int = 0
    traces: int = 0
    traces_alerted: int = 0
    recall: sd.Score = field(default_factory=sd.Score)

    def rate(self) -> float:
        return 1e4 * self.benign / max(self.clean, 1)


def restart_trace(seed: int, steps: int, family: str) -> tuple[sd.Trace, np.ndarray]:
    """A trace of ``spike_detection.py`` (its events and clean steps) under a cosine schedule with warm restarts,
    and that schedule: every 300-1000 steps the learning rate returns from at most 1% of its peak to the peak
    (half of the cycles through a linear warm-up of up to 50 steps), and the loss jumps with it by 5% to 100%
    (log-uniform) over the warm-up and up to 5 more steps, then settles back over 10-300 steps. The jump is
    clean: a rule that flags it raises a false alarm. ``restarts`` builds on the tuning traces, ``restarts,
    held out`` on held-out ones of fresh seeds."""
    base, offset = RESTART_FAMILIES[family]
    trace = sd.make_trace(offset + seed, steps, base)
    rng = np.random.default_rng(7_000_003 + offset + seed)
    lrs, factor = np.empty(steps), np.ones(steps)
    peak, start = 10.0 ** rng.uniform(-5.0, -3.0), 0
    while start < steps:
        period = int(rng.integers(300, 1001))
        warm = int(rng.integers(1, 51)) if rng.random() < 0.5 else 1
        floor = peak * rng.uniform(0.0, 0.01)
        k = np.arange(min(period, steps - start))
        cosine = floor + 0.5 * (peak - floor) * (1.0 + np.cos(np.pi * k / period))
        lrs[start: start + len(k)] = cosine * np.minimum(1.0, (k + 1) / warm)
        if start > 0:
            size = math.exp(rng.uniform(math.log(0.05), 0.0))
            rise = warm + int(rng.integers(0, 6))
            tau = math.exp(rng.uniform(math.log(10.0), math.log(300.0)))
            j = np.arange(steps - start)
            factor[start:] *= 1.0 + size * np.minimum(1.0, (j + 1) / rise) * np.exp(-np.maximum(j - rise, 0) / tau)
        start += len(k)
    return dataclasses.replace(trace, values=trace.values * factor), lrs


def warmup_trace(seed: int, steps: int, family: str) -> tuple[sd.Trace, np.ndarray]:
    """A trace of ``spike_detection.py`` (its events and clean steps) whose learning rate warms up from near zero and
    then decays, the loss rising with the learning rate through the warm-up by 5% to 100% (log-uniform) and
    settling back after its end: a warm-up that is a little too hot, as a fine-tuning's often is (the gradient
    norm rises with the learning rate the same way). The rise is clean: a rule that flags it raises a false alarm.

    ``warm-up`` (tuning traces): a linear warm-up of 100-1500 steps (log-uniform), the rise following
    ``(lr / peak) ** p`` (p in 1-4), settling back exponentially over 10-300 steps, then a cosine decay to 0-10% of
    the peak. ``warm-up, held out`` (held-out traces, fresh seeds, other shapes): a half-cosine warm-up of 60-2000
    steps, the rise a logistic in the warm-up's progress that peaks 0-20 steps after its end, settling back as a
    power law, then a linear decay or a constant learning rate."""
    base, offset = WARMUP_FAMILIES[family]
    trace = sd.make_trace(offset + seed, steps, base)
    rng = np.random.default_rng(offset + 17 + seed)
    t = np.arange(steps, dtype=np.float64)
    peak, size = 10.0 ** rng.uniform(-5.0, -3.0), math.exp(rng.uniform(math.log(0.05), 0.0))
    if base == "tuning":
        warm = int(math.exp(rng.uniform(math.log(100.0), math.log(1500.0))))
        ramp = np.minimum(1.0, (t + 1) / warm)
        floor = rng.uniform(0.0, 0.1)
        after = floor + (1.0 - floor) * 0.5 * (1.0 + np.cos(np.pi * np.clip(t - warm, 0, None) / (steps - warm)))
        lrs = peak * ramp * np.where(t < warm, 1.0, after)
        tau = math.exp(rng.uniform(math.log(10.0), math.log(300.0)))
        rise = np.where(t < warm, ramp ** rng.uniform(1.0, 4.0), np.exp(-np.clip(t - warm, 0, None) / tau))
    else:
        warm = int(math.exp(rng.uniform(math.log(60.0), math.log(2000.0))))
        ramp = np.where(t < warm, 0.5 * (1.0 - np.cos(np.pi * (t + 1) / warm)), 1.0)
        after = 1.0 - rng.uniform(0.0, 0.9) * np.clip(t - warm, 0, None) / (steps - warm) if rng.random() < 0.5 \
            else np.ones(steps)
        lrs = peak * np.maximum(ramp, 1e-3) * after
        lag, width = rng.uniform(0.0, 20.0), rng.uniform(0.05, 0.3) * warm
        up = 1.0 / (1.0 + np.exp(-(t - warm - lag + 3.0 * width) / width))
        down = (1.0 + np.clip(t - warm - lag, 0, None) / rng.uniform(5.0, 100.0)) ** -rng.uniform(0.5, 2.0)
        rise = np.where(t < warm + lag, up, up * down)
    return dataclasses.replace(trace, values=trace.values * (1.0 + size * rise)), lrs


def cluster_trace(seed: int, steps: int) -> tuple[sd.Trace, None]:
    """A held-out trace of ``spike_detection.py`` (fresh seeds) where each corrupted batch is followed by two more
    of the same size (its deviation from the values around it, added), 2 to 60 steps apart: a cluster of bad
    batches (one bad data shard read over consecutive batches). The second and third are events of their own
    (``cluster_2nd``, ``cluster_3rd``); a follower that would land on an event's or a NaN's steps is left out."""
    trace = sd.make_trace(CLUSTER_SEEDS + seed, steps, "heldout")
    rng = np.random.default_rng(CLUSTER_SEEDS + 7 + seed)
    values, clean, events = trace.values.copy(), trace.clean.copy(), list(trace.events)
    for event in trace.events:
        if event.kind != "corrupted_batch":
            continue
        p = event.onset
        around = np.concatenate([values[max(p - 3, 0): p], values[p + 1: p + 4]])
        deviation = values[p] - float(np.nanmedian(around))
        q = p
        for kind in ("cluster_2nd", "cluster_3rd"):
            q += int(rng.integers(2, 61))
            end = min(q + sd.REGION_MARGIN, steps - 1)
            if q >= steps or not (clean[q: end + 1].all() and np.isfinite(values[q: end + 1]).all()):
                break
            values[q] += deviation
            clean[q: end + 1] = False
            events.append(sd.Event(kind, q, q, q, end, event.peak_sigma))
    return dataclasses.replace(trace, values=values, events=events, clean=clean, hard=trace.hard & clean,
                               grey=trace.grey & clean), None


def synthetic_families(traces: int, steps: int) -> dict[str, list[tuple[sd.Trace, np.ndarray | None]]]:
    """Every synthetic family's traces (with the learning rate where the family has a schedule), by name."""
    out = {}
    for family in FAMILIES + tuple(RESTART_FAMILIES) + tuple(WARMUP_FAMILIES) + (CLUSTER_FAMILY,):
        out[family] = [restart_trace(seed, steps, family) if family in RESTART_FAMILIES
                       else warmup_trace(seed, steps, family) if family in WARMUP_FAMILIES
                       else cluster_trace(seed, steps) if family == CLUSTER_FAMILY
                       else (sd.make_trace(seed, steps, family), None) for seed in range(traces)]
    return out


def score_synthetic(traces: list[tuple[sd.Trace, np.ndarray | None]], rule: Rule) -> SyntheticScore | None:
    out = SyntheticScore()
    for trace, lrs in traces:
        flags = rule(trace.values, "loss", lrs)
        if flags is None:
            return None
        out.recall.add(trace, flags)
        benign = sum(1 for a, _ in episodes(flags) if trace.clean[a])
        out.clean += int(trace.clean.sum())
        out.benign += benign
        out.traces += 1
        out.traces_alerted += bool(benign)
    return out


# ------------------------------------------------------------------------------------------- agreement
AGREEMENT_BARS = ((4.0, 1.2), (4.0, 1.25), (3.0, 1.25), (3.0, 1.3), (3.0, 1.2), (2.5, 1.25))


def ratio_to_recent(values: np.ndarray, i: int) -> float:
    """``values[i]`` over the median of the (up to) 5 values before it; 0 with fewer than 3 before it."""
    before = values[max(0, i - 5): i]
    reference = float(np.median(before)) if len(before) >= 3 else 0.0
    return float(values[i]) / reference if reference > 0.0 else 0.0


def agreement_table(series: list[Series]) -> list[str]:
    """Ours on the gradient norm, plus a flag wherever the norm is at least ``R_n`` and the loss at the same step at
    least ``R_l`` times the median of their previous 5 points (a lower bar where both signals agree): gradient-norm
    events caught and benign episodes, per pair of bars."""
    runs: dict[str, dict[str, Series]] = {}
    for s in series:
        runs.setdefault(s.run, {})[s.signal] = s
    lines = ["| norm bar R_n | loss bar R_l | events caught | benign episodes / 10k points "
             "| points added outside ours (the first 6) |", "|---|---|---|---|---|"]
    for bar_norm, bar_loss in ((0.0, 0.0),) + AGREEMENT_BARS:
        score, added = CorpusScore(), []
        for run, both in runs.items():
            norm = both.get("grad_norm")
            if norm is None:
                continue
            flags = ours_flags(norm.values, "grad_norm", norm.lrs)
            loss = both.get("loss")
            if bar_norm and loss is not None:
                at = {int(step): j for j, step in enumerate(loss.steps)}
                for i, step in enumerate(norm.steps.tolist()):
                    j = at.get(int(step))
                    if (j is not None and not flags[i] and ratio_to_recent(norm.values, i) >= bar_norm
                            and ratio_to_recent(loss.values, j) >= bar_loss):
                        flags[i] = True
                        added.append(f"{run} @{step}")
            score_series(score, norm, flags)
        name = ("ours alone", "-") if not bar_norm else (f"{bar_norm:g}", f"{bar_loss:g}")
        lines.append(f"| {name[0]} | {name[1]} | {score.caught} of {score.events} "
                     f"| {score.rate():.1f} ({score.benign}) | {_some(added)} |")
    return lines


# -------------------------------------------------------------------------------------------- frontier
# Settings of the detectors' public options, each the move that one measured trade-off of docs/DETECTORS.md makes
# (the loss's options, the gradient norm's): the frontier table scores each against every target of the real-runs
# evaluation, so that what one setting gains is read beside what it loses.
FRONTIER: tuple[tuple[str, dict, dict], ...] = (
    ("defaults", {}, {}),
    ("z_threshold=5.5", {"z_threshold": 5.5}, {"z_threshold": 5.5}),
    ("z_threshold=5", {"z_threshold": 5.0}, {"z_threshold": 5.0}),
    ("loss start_ratio=1.8", {"start_ratio": 1.8}, {}),
    ("loss gross_ratio=1.4", {"gross_ratio": 1.4}, {}),
    ("warmup_drift=False", {"warmup_drift": False}, {"warmup_drift": False}),
    ("grad-norm gross_ratio=4.5", {}, {"gross_ratio": 4.5}),
)
# The targets: every labelled event caught; benign episodes per 10k points at most these; on every synthetic family
# recall at least FRONTIER_RECALL at most FRONTIER_BENIGN benign episodes per 10k clean steps.
FRONTIER_CORPUS_BENIGN = {"loss": 0.5, "grad_norm": 2.0}
FRONTIER_RECALL, FRONTIER_BENIGN = 0.97, 0.2


def setting_rule(loss: dict, grad_norm: dict) -> Rule:
    """Ours with these options (on the loss, on the gradient norm), fed the learning rate."""
    return lambda values, signal, lrs=None: lr_detector_flags(
        preset(signal, **(loss if signal == "loss" else grad_norm)), values, lrs)


def frontier_table(series: list[Series], families: dict[str, list]) -> list[str]:
    """One row per setting of FRONTIER: each target's value, a bold value where the target is met, and how many
    targets are met."""
    head = ["setting", "loss events", "loss benign / 10k", "grad-norm events", "grad-norm benign / 10k"]
    head += [f"{family} (loss): recall, benign / 10k" for family in families] + ["targets met"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    total = 4 + len(families)
    for name, loss, grad_norm in FRONTIER:
        rule, cells, met = setting_rule(loss, grad_norm), [], 0
        for signal in SIGNALS:
            score = CorpusScore()
            for s in series:
                if s.signal == signal:
                    score_series(score, s, rule(s.values, signal, s.lrs))
            every, quiet = score.caught == score.events, score.rate() <= FRONTIER_CORPUS_BENIGN[signal]
            met += every + quiet
            cells += [_bold(f"{score.caught} of {score.events}", every), _bold(f"{score.rate():.1f}", quiet)]
        for traces in families.values():
            result = score_synthetic(traces, rule)
            assert result is not None
            ok = result.recall.recall_value() >= FRONTIER_RECALL and result.rate() <= FRONTIER_BENIGN
            met += ok
            cells.append(_bold(f"{result.recall.recall_value():.3f}, {result.rate():.2f}", ok))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {met} of {total} |")
    return lines


def _bold(text: str, met: bool) -> str:
    return f"**{text}**" if met else text


def _some(points: list[str], shown: int = 6) -> str:
    """The first ``shown`` points and how many more."""
    more = f" and {len(points) - shown} more" if len(points) > shown else ""
    return (", ".join(points[:shown]) + more) or "-"


# ---------------------------------------------------------------------------------------------- reporting
def corpus_table(scores: dict[str, dict[str, CorpusScore]], signal: str) -> list[str]:
    first = next(iter(scores.values()))[signal]
    lines = [f"| rule | runs alerted (of {first.runs}) | benign episodes / 10k points | flagged points "
             f"| events caught (of {first.events}) | delay, points |", "|---|---|---|---|---|---|"]
    for name, per in scores.items():
        if signal not in per:
            lines.append(f"| {name} | - | - | - | - | - |")
            continue
        s = per[signal]
        delay = f"{np.mean(s.delays):.1f}" if s.delays else "-"
        lines.append(f"| {name} | {s.runs_alerted} | {s.rate():.1f} ({s.benign}) | {s.flagged} | {s.caught} "
                     f"| {delay} |")
    return lines


def synthetic_table(results: dict[str, dict[str, SyntheticScore | None]]) -> list[str]:
    families = list(next(iter(results.values())))
    lines = ["| rule | " + " | ".join(f"{f}: benign / 10k, recall, delay" for f in families) + " |",
             "|---|" + "---|" * len(families)]
    for name, per in results.items():
        cells = []
        for family in families:
            s = per[family]
            if s is None:
                cells.append("-")
                continue
            delays = s.recall.delays.get("all", [])
            delay = np.mean(delays) if delays else math.nan
            cells.append(f"{s.rate():.2f}, {s.recall.recall_value():.3f}, {delay:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def kind_table(results: dict[str, dict[str, SyntheticScore | None]]) -> list[str]:
    """Recall per kind of synthetic event, the families pooled."""
    kinds = ["corrupted_batch", "cluster_2nd", "cluster_3rd", "spike_recovery", "nan_step", "fast_explosion",
             "slow_explosion"]
    lines = ["| rule | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for name, per in results.items():
        scores = [s for s in per.values() if s is not None]
        if not scores:
            lines.append(f"| {name} | " + " | ".join("-" for _ in kinds) + " |")
            continue
        cells = []
        for kind in kinds:
            hits = [h for s in scores for h in s.recall.detected.get(kind, [])]
            cells.append(f"{np.mean(hits):.3f} ({sum(hits)}/{len(hits)})" if hits else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def event_table(series: list[Series], engine: dict[tuple[str, str], np.ndarray]) -> list[str]:
    """Per labelled event and signal: the step of each rule's first flag inside the window ('-': missed);
    ``engine``: :func:`engine_flags` of the series."""
    heads = [h for name in RULES for h in ((name, ENGINE_ROW) if name == "ours" else (name,))]
    lines = ["| run | event | signal | steps | " + " | ".join(heads) + " |", "|---|---|---|---|" + "---|" * len(heads)]
    for s in series:
        for event in s.events:
            lo, hi = event["steps"]
            window = (s.steps >= lo) & (s.steps <= hi)
            cells = []
            for name in heads:
                flags = engine[(s.run, s.signal)] if name == ENGINE_ROW else RULES[name](s.values, s.signal, s.lrs)
                hits = np.nonzero(window & flags)[0] if flags is not None else []
                cells.append("n/a" if flags is None else (str(int(s.steps[hits[0]])) if len(hits) else "missed"))
            lines.append(f"| {s.run} | {event['kind']} | {s.signal} | {lo}-{hi} | " + " | ".join(cells) + " |")
    return lines


def corpus_summary(series: list[Series]) -> list[str]:
    runs = load_manifest()["runs"]
    loss = [s for s in series if s.signal == "loss"]
    medians = [float(np.median(s.values)) for s in loss]
    events = sum(len(r["events"]) for r in runs)
    return [f"Corpus: {len(runs)} runs ({sum(1 for r in runs if 'repo' in r['source'])} public, "
            f"{sum(1 for r in runs if 'script' in r['source'])} CPU), "
            f"{sum(len(s.values) for s in loss):,} loss points, "
            f"{sum(len(s.values) for s in series if s.signal == 'grad_norm'):,} grad-norm points in "
            f"{sum(1 for s in series if s.signal == 'grad_norm')} runs; median loss per run "
            f"{min(medians):.2g} to {max(medians):.3g}; logged every "
            f"{min(np.diff(s.steps).min() for s in loss)} to {max(np.diff(s.steps).max() for s in loss)} steps; "
            f"{events} labelled events."]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=int, default=50, help="synthetic traces per family")
    parser.add_argument("--steps", type=int, default=4000, help="steps per synthetic trace")
    parser.add_argument("--verify-steps", type=int, default=1500, help="steps checked against Lightning's class")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    parser.add_argument("--json", default=None, help="also write the summary numbers to this file")
    parser.add_argument("--agreement", action="store_true",
                        help="only print the table of a lower gradient-norm bar where the loss agrees (corpus)")
    parser.add_argument("--frontier", action="store_true",
                        help="only print the table of the targets against settings of the detectors' options")
    args = parser.parse_args(argv)
    if args.frontier:
        t0 = time.perf_counter()
        text = "\n".join(frontier_table(load_series(), synthetic_families(args.traces, args.steps)) + [
            "", f"Command: `python benchmarks/real_runs.py {' '.join(argv or [])}`; machine: {cpu_model()}, "
            f"{os.cpu_count()} cores visible, Python {platform.python_version()}, numpy {np.__version__}; "
            f"{datetime.date.today().isoformat()}; {time.perf_counter() - t0:.0f} s."])
        print(text)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text + "\n")
        return {"frontier": text}
    if args.agreement:
        text = "\n".join(agreement_table(load_series()))
        print(text)
        return {"agreement": text}

    t0 = time.perf_counter()
    verified = sd.verify_lightning_reimplementation(args.verify_steps) if args.verify_steps else 0
    series = load_series()
    engine = engine_flags(series)  # per run: the blind runs' flags are theirs
    corpus = score_corpus(series, engine)
    blind = [s for s in series if s.blind]
    corpus_blind = score_corpus(blind, engine)
    synthetic: dict[str, dict[str, SyntheticScore | None]] = {name: {} for name in RULES}
    for family, traces in synthetic_families(args.traces, args.steps).items():
        for name, rule in RULES.items():
            synthetic[name][family] = score_synthetic(traces, rule)

    lines = corpus_summary(series) + [""]
    for signal, title in (("loss", "Loss"), ("grad_norm", "Gradient norm")):
        lines += [f"**{title}, real runs**", ""] + corpus_table(corpus, signal) + [""]
    runs = len({s.run for s in blind})
    for signal, title in (("loss", "Loss"), ("grad_norm", "Gradient norm")):
        lines += [f"**{title}, the {runs} runs labelled blind** (added and labelled after every detector change, "
                  "before any detector ran on them: data no rule was tuned on)", ""]
        lines += corpus_table(corpus_blind, signal) + [""]
    lines += ["**Labelled events: the step of each rule's first flag in the event's window**", ""]
    lines += event_table(series, engine) + [""]
    lines += [f"**Loss, synthetic families** ({args.traces} traces x {args.steps} steps each; "
              "benign episodes per 10k clean steps, recall of spikes >= 8 sigma, mean delay in steps)", ""]
    lines += synthetic_table(synthetic) + [""]
    lines += ["**Loss, synthetic families pooled: recall by event kind**", ""] + kind_table(synthetic) + [""]
    ours = corpus["ours"]
    for signal in SIGNALS:
        at = ", ".join(f"{run} @{step}" + (f" ({n} pts)" if n > 1 else "") for run, step, n in ours[signal].benign_at)
        lines.append(f"ours, benign {signal} episodes: {at or 'none'}")
    lines += ["", f"Command: `python benchmarks/real_runs.py{' ' + ' '.join(argv) if argv else ''}`; "
              f"Lightning reimplementation checked on {verified} steps against its class; machine: {cpu_model()}, "
              f"{os.cpu_count()} cores visible, Python {platform.python_version()}, numpy {np.__version__}; "
              f"{datetime.date.today().isoformat()}; {time.perf_counter() - t0:.0f} s."]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    def scores(table: dict[str, dict[str, CorpusScore]]) -> dict:
        return {name: {signal: {"runs": s.runs, "runs_alerted": s.runs_alerted, "points": s.points,
                                "benign_episodes": s.benign, "benign_per_10k": s.rate(), "flagged": s.flagged,
                                "events": s.events, "caught": s.caught,
                                "mean_delay": float(np.mean(s.delays)) if s.delays else None,
                                "benign_at": s.benign_at}
                       for signal, s in per.items()} for name, per in table.items()}

    summary = {
        "corpus": scores(corpus),
        "corpus_blind": scores(corpus_blind),
        "synthetic": {name: {family: None if s is None else {
            "benign_per_10k": s.rate(), "traces_alerted": s.traces_alerted, "traces": s.traces,
            "recall": s.recall.recall_value()} for family, s in per.items()} for name, per in synthetic.items()},
        "traces": args.traces, "steps": args.steps,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
