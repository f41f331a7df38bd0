"""The headline numbers of a run: final losses, alert counts by kind, per-layer attention numbers.

:func:`summarize` feeds report.md (:func:`~stable_attn.report.build_report`); :func:`format_summary`
is the few lines ``stable-attn report`` and the example print at the end of a run.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..monitor.names import ALERT_KINDS, LOSS, VAL_LOSS, layer_metric
from .read import RunData, Series

__all__ = ["LayerSummary", "RunSummary", "fmt", "format_summary", "summarize"]


@dataclass
class LayerSummary:
    """Per-layer numbers of the report over finite logged values; None where there are none."""

    layer: str
    mean_saturation: float | None
    max_saturation: float | None
    mean_fixed_rate: float | None
    max_logit: float | None
    final_max_logit: float | None
    mean_sink_mass: float | None


@dataclass
class RunSummary:
    """The headline numbers of a run (used by report.md and by the example's console summary)."""

    final_train_loss: tuple[int, float] | None
    last_finite_train_loss: tuple[int, float] | None
    final_val_loss: tuple[int, float] | None
    alert_counts: dict[str, int]
    layers: list[LayerSummary]


def _short(layer: str) -> str:
    """``layer3`` as ``L3`` (``model.layer3`` as ``model.L3``), for the one-line console summary."""
    return re.sub(r"\blayer(\d+)$", r"L\1", layer)


def _last(series: Series | None, finite_only: bool = False) -> tuple[int, float] | None:
    if series is None or series.values.size == 0:
        return None
    idx = np.flatnonzero(np.isfinite(series.values)) if finite_only else np.arange(series.values.size)
    if idx.size == 0:
        return None
    i = int(idx[-1])
    return int(series.steps[i]), float(series.values[i])


def _finite(series: Series | None) -> np.ndarray:
    if series is None:
        return np.zeros(0)
    return series.values[np.isfinite(series.values)]


def _stat(series: Series | None, fn) -> float | None:
    values = _finite(series)
    return float(fn(values)) if values.size else None


def summarize(run: RunData) -> RunSummary:
    """Final losses, alert counts by kind and per-layer attention numbers of ``run``."""
    counts = Counter(str(a.get("kind", "unknown")) for a in run.alerts)
    alert_counts = {kind: counts.pop(kind, 0) for kind in ALERT_KINDS}
    alert_counts.update(sorted(counts.items()))
    layers = []
    for i in run.layers():
        sat = run.metrics.get(layer_metric("saturation", i))
        logit = run.metrics.get(layer_metric("max_logit", i))
        final_logit = _last(logit, finite_only=True)
        layers.append(
            LayerSummary(
                layer=i,
                mean_saturation=_stat(sat, np.mean),
                max_saturation=_stat(sat, np.max),
                mean_fixed_rate=_stat(run.metrics.get(layer_metric("fixed_rate", i)), np.mean),
                max_logit=_stat(logit, np.max),
                final_max_logit=final_logit[1] if final_logit else None,
                mean_sink_mass=_stat(run.metrics.get(layer_metric("sink_mass", i)), np.mean),
            )
        )
    train = run.series(LOSS)
    return RunSummary(
        final_train_loss=_last(train),
        last_finite_train_loss=_last(train, finite_only=True),
        final_val_loss=_last(run.series(VAL_LOSS)),
        alert_counts=alert_counts,
        layers=layers,
    )


def fmt(value: float | None) -> str:
    """Numbers as the report prints them: 6 significant digits, ``n/a`` for a missing value."""
    if value is None:
        return "n/a"
    return f"{value:.6g}"


def format_summary(summary: RunSummary) -> str:
    """A few plain-text lines for the end of a training run."""

    def loss(entry: tuple[int, float] | None) -> str:
        return "n/a" if entry is None else f"{fmt(entry[1])} (step {entry[0]})"

    lines = [f"final train loss: {loss(summary.final_train_loss)}"]
    if summary.final_train_loss and not math.isfinite(summary.final_train_loss[1]):
        lines[-1] += f"; last finite: {loss(summary.last_finite_train_loss)}"
    lines.append(f"final val loss:   {loss(summary.final_val_loss)}")
    lines.append("alerts:           " + ", ".join(f"{k} {n}" for k, n in summary.alert_counts.items()))
    if summary.layers:
        lines.append(
            "saturation:       "
            + " ".join(f"{_short(s.layer)}={fmt(s.mean_saturation)}" for s in summary.layers)
            + "  (mean fraction of rows with tied maxima)"
        )
    return "\n".join(lines)
