"""The report's plots, drawn with matplotlib's Agg canvas (no pyplot state, no display needed).

Each ``plot_*`` function writes one PNG of a :class:`~stable_attn.report.read.RunData` and returns
False, writing nothing, when the run has no data for it. Alerts are drawn as dashed lines in the
colour of their kind, and each title says what happened (``no alerts`` when there were none). The
saturation and max-logit plots draw the early-warning detectors' default levels as labelled lines: the
values are read from :class:`~stable_attn.monitor.SurgeDetector`'s own defaults (:data:`LEVELS`), not
copied.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..monitor.detectors.surge import SurgeDetector
from ..monitor.names import LOSS, QK_CLIP_HEADS, VAL_LOSS, layer_metric, parse_layer_metric
from .read import RunData

__all__ = ["KIND_COLORS", "LEVELS", "alerts_phrase", "plot_loss", "plot_max_logit", "plot_qk_clip", "plot_saturation"]

_SATURATION, _MAX_LOGIT = SurgeDetector.saturation(), SurgeDetector.max_logit()
#: The lines drawn on the per-layer plots: (value, label) per statistic, from the surge detectors' defaults.
LEVELS: dict[str, list[tuple[float, str]]] = {
    "saturation": [(_SATURATION.min_level, f"early-warning floor {_SATURATION.min_level:g}: a rise to here, "
                                           "with the loss stalled, alerts")],
    "max_logit": [(_MAX_LOGIT.min_level, f"early-warning floor {_MAX_LOGIT.min_level:g}: a rise to here, with the "
                                         "loss stalled, alerts"),
                  (_MAX_LOGIT.alarm_level, f"alarm {_MAX_LOGIT.alarm_level:g}: alerts whatever the loss does")],
}

KIND_COLORS = {"spike": "tab:red", "nonfinite": "black", "early_warning": "tab:orange", "not_training": "tab:brown",
               "qk_clip": "tab:gray"}
_MAX_ANNOTATED_ALERTS = 20
_MAX_TITLE_STEPS = 4
# Level lines in colours no alert kind uses: the early-warning floor, then the alarm level.
_LEVEL_COLORS = ("tab:olive", "tab:pink")


def _figure(width: float = 8.0, height: float = 4.5):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError("stable_attn.report needs matplotlib: pip install 'stable-attn[examples]'") from err
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _mark_alerts(ax, alerts: list[dict], annotate: bool) -> None:
    seen: set[str] = set()
    for n, alert in enumerate(alerts):
        kind = str(alert.get("kind", "unknown"))
        color = KIND_COLORS.get(kind, "tab:purple")
        ax.axvline(
            alert["step"],
            color=color,
            linestyle="--",
            linewidth=1.2,
            label=f"alert: {kind}" if kind not in seen else None,
        )
        seen.add(kind)
        if annotate and n < _MAX_ANNOTATED_ALERTS:
            ax.annotate(
                f"{kind} @ {alert['step']}",
                xy=(alert["step"], 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, -4),
                textcoords="offset points",
                rotation=90,
                va="top",
                ha="left",
                fontsize=8,
                color=color,
            )


def alerts_phrase(alerts: list[dict]) -> str:
    """``no alerts``, or ``3 alerts (spike 2, early_warning 1) at steps 37, 50``: what a plot's title says
    happened (the steps when there are at most :data:`_MAX_TITLE_STEPS` of them)."""
    if not alerts:
        return "no alerts"
    kinds: dict[str, int] = {}
    for alert in alerts:
        kind = str(alert.get("kind", "unknown"))
        kinds[kind] = kinds.get(kind, 0) + 1
    listed = ", ".join(f"{kind} {n}" for kind, n in kinds.items())
    steps = sorted({int(alert["step"]) for alert in alerts})
    where = f" at step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}" \
        if len(steps) <= _MAX_TITLE_STEPS else ""
    return f"{len(alerts)} alert{'s' if len(alerts) > 1 else ''} ({listed}){where}"


def _stat_alerts(alerts: list[dict], stat: str) -> list[dict]:
    """The alerts raised on ``stat`` of some layer (early warnings)."""
    return [a for a in alerts if (parse_layer_metric(str(a.get("metric", ""))) or ("", ""))[0] == stat]


def _peak(layers: list[str], steps: np.ndarray, matrix: np.ndarray) -> str:
    row, col = np.unravel_index(int(np.nanargmax(matrix)), matrix.shape)
    return f"peak {matrix[row, col]:.3g} ({layers[row]}, step {int(steps[col])})"


def plot_loss(run: RunData, path: Path) -> bool:
    train = run.series(LOSS)
    val = run.series(VAL_LOSS)
    if train is None and val is None:
        return False
    fig = _figure()
    ax = fig.add_subplot()
    # Fixed colors keep the alert colors (red, black, orange) free for the markers.
    for series, label, style, color in (
        (train, "train loss", "-", "tab:blue"),
        (val, "validation loss", "o-", "tab:green"),
    ):
        if series is None:
            continue
        finite = np.isfinite(series.values)
        ax.plot(series.steps, np.where(finite, series.values, np.nan), style, color=color, label=label, markersize=4)
        if not finite.all():
            # Non-finite losses cannot sit on the y axis: mark them on the top edge instead.
            ax.plot(
                series.steps[~finite],
                np.full(int((~finite).sum()), 0.97),
                "x",
                color="black",
                transform=ax.get_xaxis_transform(),
                label=f"{label}: NaN/Inf",
            )
    _mark_alerts(ax, run.alerts, annotate=True)
    for alert in run.alerts:
        value = alert.get("value")
        # The alert's own value, where it is a loss this plot shows, pins the alert to the curve.
        if alert.get("metric") in (LOSS, VAL_LOSS) and isinstance(value, (int, float)):
            if math.isfinite(value):
                kind = str(alert.get("kind", "unknown"))
                ax.plot([alert["step"]], [value], "o", color=KIND_COLORS.get(kind, "tab:purple"), zorder=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"Loss: {alerts_phrase(run.alerts)}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.savefig(path)
    return True


def _layer_matrix(run: RunData, metric: str) -> tuple[list[int], np.ndarray, np.ndarray] | None:
    layers = [i for i in run.layers() if layer_metric(metric, i) in run.metrics]
    if not layers:
        return None
    series = [run.metrics[layer_metric(metric, i)] for i in layers]
    steps = np.unique(np.concatenate([s.steps for s in series]))
    matrix = np.full((len(layers), steps.size), np.nan)
    for row, s in enumerate(series):
        matrix[row, np.searchsorted(steps, s.steps)] = s.values
    matrix[~np.isfinite(matrix)] = np.nan
    return layers, steps, matrix


def _edges(centers: np.ndarray) -> np.ndarray:
    # Cell edges halfway between logged steps, so irregular logging intervals are drawn to scale.
    c = centers.astype(np.float64)
    if c.size == 1:
        return np.array([c[0] - 0.5, c[0] + 0.5])
    mid = (c[1:] + c[:-1]) / 2
    return np.concatenate([[c[0] - (mid[0] - c[0])], mid, [c[-1] + (c[-1] - mid[-1])]])


def plot_saturation(run: RunData, path: Path) -> bool:
    found = _layer_matrix(run, "saturation")
    if found is None or np.isnan(found[2]).all():
        return False
    layers, steps, matrix = found
    fig = _figure(8.0, max(3.0, 1.0 + 0.3 * len(layers)))
    ax = fig.add_subplot()
    mesh = ax.pcolormesh(
        _edges(steps),
        np.arange(len(layers) + 1) - 0.5,
        np.ma.masked_invalid(matrix),
        cmap="magma",
        vmin=0.0,
        # up to the early-warning floor at least, so its line on the colour bar is always in view
        vmax=max(float(np.nanmax(matrix)), *(level * 1.25 for level, _ in LEVELS["saturation"])),
        shading="flat",
    )
    bar = fig.colorbar(mesh, ax=ax, label="saturated rows / rows")
    ticks = {float(t): f"{t:.2g}" for t in bar.get_ticks() if 0.0 <= t <= bar.vmax}
    for level, _ in LEVELS["saturation"]:
        bar.ax.axhline(level, color="tab:cyan", linewidth=3)  # cyan stands out on magma's dark and light ends
        ticks = {t: text for t, text in ticks.items() if abs(t - level) > 0.06 * bar.vmax}  # no overlap
        ticks[level] = f"{level:g}: early-\nwarning floor"
    bar.set_ticks(sorted(ticks), labels=[ticks[t] for t in sorted(ticks)])
    ax.set_yticks(np.arange(len(layers)), layers)
    _mark_alerts(ax, run.alerts, annotate=False)
    ax.set_xlabel("step")
    ax.set_title(f"Attention saturation per layer (rows with tied maxima)\n{_peak(layers, steps, matrix)}; "
                 f"{alerts_phrase(_stat_alerts(run.alerts, 'saturation'))} on it", fontsize=10)
    fig.savefig(path)
    return True


def plot_max_logit(run: RunData, path: Path) -> bool:
    found = _layer_matrix(run, "max_logit")
    if found is None or np.isnan(found[2]).all():
        return False
    layers, steps, matrix = found
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    fig = _figure()
    ax = fig.add_subplot()
    for row, layer in enumerate(layers):
        present = ~np.isnan(matrix[row])
        ax.plot(
            steps[present],
            matrix[row, present],
            label=layer,
            color=cmap(row / max(1, len(layers) - 1)),
        )
    # A log axis shows a healthy 5-10 beside the levels 50 and 1000; values <= 0 need a linear one.
    if np.nanmin(matrix) > 0:
        ax.set_yscale("log")
    for (level, label), color in zip(LEVELS["max_logit"], _LEVEL_COLORS):
        ax.axhline(level, color=color, linestyle=":", linewidth=1.5, label=label)
    _mark_alerts(ax, run.alerts, annotate=False)
    ax.set_xlabel("step")
    ax.set_ylabel("max scaled attention score")
    ax.set_title(f"Max attention logit per layer: {_peak(layers, steps, matrix)}; "
                 f"{alerts_phrase(_stat_alerts(run.alerts, 'max_logit'))} on it", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncols=max(1, math.ceil(len(layers) / 8)), loc="best")
    fig.savefig(path)
    return True


def plot_qk_clip(run: RunData, path: Path) -> bool:
    """Query heads QK-Clip clipped per step (``qk_clip/clipped_heads``, logged on the steps that clip)."""
    series = run.series(QK_CLIP_HEADS)
    if series is None or not np.isfinite(series.values).any():
        return False
    fig = _figure(8.0, 3.5)
    ax = fig.add_subplot()
    ax.vlines(series.steps, 0, series.values, color="tab:cyan", linewidth=1.0)
    ax.plot(series.steps, series.values, ".", color="tab:cyan", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("clipped query heads")
    ax.set_title("QK-Clip: heads whose max logit passed tau, per step (steps without a bar clipped none)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.savefig(path)
    return True
