"""The report's plots, drawn with matplotlib's Agg canvas (no pyplot state, no display needed).

Each ``plot_*`` function writes one PNG of a :class:`~stable_attn.report.read.RunData` and returns
False, writing nothing, when the run has no data for it. Alerts are drawn as dashed lines in the
colour of their kind.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..monitor.names import LOSS, QK_CLIP_HEADS, VAL_LOSS, layer_metric
from .read import RunData

__all__ = ["plot_loss", "plot_max_logit", "plot_qk_clip", "plot_saturation"]

_KIND_COLORS = {"spike": "tab:red", "nonfinite": "black", "early_warning": "tab:orange", "not_training": "tab:brown",
                "qk_clip": "tab:cyan"}
_MAX_ANNOTATED_ALERTS = 20


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
        color = _KIND_COLORS.get(kind, "tab:purple")
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
                ax.plot([alert["step"]], [value], "o", color=_KIND_COLORS.get(kind, "tab:purple"), zorder=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Loss, with stable_attn alerts")
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
        vmax=max(float(np.nanmax(matrix)), 1e-6),
        shading="flat",
    )
    fig.colorbar(mesh, ax=ax, label="saturated rows / rows")
    ax.set_yticks(np.arange(len(layers)), layers)
    _mark_alerts(ax, run.alerts, annotate=False)
    ax.set_xlabel("step")
    ax.set_title("Attention saturation (two or more keys tied at the row max), per layer")
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
    _mark_alerts(ax, run.alerts, annotate=False)
    ax.set_xlabel("step")
    ax.set_ylabel("max scaled attention score")
    ax.set_title("Max attention logit per layer")
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
