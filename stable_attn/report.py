"""Turn a training run's metrics CSV and alerts JSONL into plots and a Markdown report.

A run directory holds what a Lightning run with :class:`~stable_attn.callbacks.lightning.StableAttentionCallback`
and a ``CSVLogger`` leaves behind, or the ``output_dir`` of a transformers ``Trainer`` run with
:class:`~stable_attn.callbacks.trainer.StableAttentionTrainerCallback`. :func:`build_report` finds the files
like this:

- metrics: ``RUN_DIR/metrics.csv`` if present, else the most recently modified ``metrics.csv``
  anywhere below ``RUN_DIR`` (a ``CSVLogger(save_dir=RUN_DIR, name="csv")`` writes
  ``RUN_DIR/csv/version_N/metrics.csv``; a rerun adds a new ``version_N``, and the newest is the one
  you are looking at). Ties on the modification time go to the longer, then the larger path, so
  ``version_10`` wins over ``version_9``.
- or, without any ``metrics.csv``, a Trainer's ``trainer_state.json``: its ``log_history`` (the Trainer
  writes one into every ``checkpoint-N`` and with ``trainer.save_state()`` into ``output_dir``; the one
  with the highest ``global_step`` wins, then the most recently modified). The Trainer's names are read
  as the callback's: ``loss`` as ``train/loss``, ``eval_loss`` as ``val/loss``, ``grad_norm`` as
  ``train/grad_norm``, ``learning_rate`` as ``train/lr``; the ``stable_attn/...`` metrics keep their names.
- alerts: the callback's ``stable_attn_alerts.jsonl`` (:data:`~stable_attn.monitor.names.ALERTS_FILE`;
  older runs' ``alerts.jsonl`` is read too). The callback writes it in ``trainer.log_dir``, which with a
  CSVLogger is the directory of ``metrics.csv``: the alerts file next to the chosen metrics file wins,
  then one directly in ``RUN_DIR``, then the most recently modified one anywhere below (a TensorBoard
  or no logger at all puts it in another directory than any CSV).

The CSV has Lightning's shape: a ``step`` column, an optional ``epoch`` column, and one sparse
column per metric (a row carries only the metrics logged together; the same step can span several
rows). A metric logged with ``on_step``/``on_epoch`` suffixes (``train/loss_step``) is used when the
plain name is absent. Per-layer metrics are ``stable_attn/<stat>/<layer>`` for any layer name the
callback writes (``layer0``, or ``model.layer0`` when a module holds several models).

This module's own code uses no torch (numpy, and matplotlib for the plots), but importing it imports the
``stable_attn`` package, which imports torch. matplotlib draws with its Agg canvas directly, so building
a report never touches the caller's pyplot state or needs a display.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .monitor.names import (
    ALERT_KINDS,
    ALERTS_FILE,
    GRAD_NORM,
    LEGACY_ALERTS_FILES,
    LOSS,
    LR,
    METRICS_FILE,
    VAL_LOSS,
    layer_metric,
    parse_layer_metric,
)

REPORT_FILE = "report.md"
LOSS_PNG = "loss.png"
SATURATION_PNG = "saturation_heatmap.png"
MAX_LOGIT_PNG = "max_logit.png"

_KIND_COLORS = {"spike": "tab:red", "nonfinite": "black", "early_warning": "tab:orange", "not_training": "tab:brown"}
# Alert fields that hold floats; Alert.to_json writes non-finite ones as "nan", "inf", "-inf".
_FLOAT_FIELDS = ("value", "baseline", "threshold", "score", "lr")
_MAX_ALERT_ROWS = 100
_MAX_ANNOTATED_ALERTS = 20


@dataclass
class Series:
    """One metric over training: ``steps`` (int64, increasing) and ``values`` (float64, may hold NaN)."""

    steps: np.ndarray
    values: np.ndarray


@dataclass
class RunData:
    """What :func:`load_run` read from a run directory, with notes on whatever was missing."""

    run_dir: Path
    metrics_path: Path | None
    alerts_path: Path | None
    metrics: dict[str, Series]
    alerts: list[dict]
    notes: list[str] = field(default_factory=list)

    def series(self, name: str) -> Series | None:
        """``name``, else ``name_step``, else ``name_epoch`` (Lightning's suffixes), else None."""
        for candidate in (name, f"{name}_step", f"{name}_epoch"):
            if candidate in self.metrics:
                return self.metrics[candidate]
        return None

    def layers(self) -> list[str]:
        """Layer names with any per-layer stable_attn metric (``layer0``, ``model.layer1``, ...), in
        natural order (``layer2`` before ``layer10``)."""
        found = {parsed[1] for parsed in map(parse_layer_metric, self.metrics) if parsed}
        return sorted(found, key=_natural_key)


def _short(layer: str) -> str:
    """``layer3`` as ``L3`` (``model.layer3`` as ``model.L3``), for the one-line console summary."""
    return re.sub(r"\blayer(\d+)$", r"L\1", layer)


def _natural_key(name: str) -> list[tuple[int, int | str]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part]


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


# --------------------------------------------------------------------------------------------------
# Reading


def _newest(run_dir: Path, name: str) -> Path | None:
    direct = run_dir / name
    if direct.is_file():
        return direct
    found = [p for p in run_dir.rglob(name) if p.is_file()]
    if not found:
        return None
    return max(found, key=lambda p: (p.stat().st_mtime, len(str(p)), str(p)))


def find_metrics_csv(run_dir: str | os.PathLike) -> Path | None:
    """The metrics CSV :func:`build_report` would use (see the module docstring), or None."""
    return _newest(Path(run_dir), METRICS_FILE)


def find_alerts_jsonl(run_dir: str | os.PathLike, metrics_csv: str | os.PathLike | None = None) -> Path | None:
    """The alerts JSONL :func:`build_report` would use (see the module docstring), or None.

    ``metrics_csv``: the metrics file in use (default: :func:`find_metrics_csv`); an alerts file in its
    directory is the same run's."""
    root = Path(run_dir)
    metrics = Path(metrics_csv) if metrics_csv is not None else find_metrics_csv(root)
    names = (ALERTS_FILE, *LEGACY_ALERTS_FILES)
    for directory in ([metrics.parent] if metrics is not None else []) + [root]:
        for name in names:
            if (directory / name).is_file():
                return directory / name
    found = [p for name in names for p in root.rglob(name) if p.is_file()]
    if not found:
        return None
    return max(found, key=lambda p: (p.stat().st_mtime, len(str(p)), str(p)))


def _to_float(text: str) -> float | None:
    text = text.strip()
    if not text:
        return None
    try:
        return float(text)  # accepts "nan", "inf", "-inf" as Lightning writes them
    except ValueError:
        return None


def read_metrics(path: str | os.PathLike) -> dict[str, Series]:
    """Read a Lightning ``metrics.csv`` into one :class:`Series` per metric column.

    Empty cells are skipped; when a step has several values for a metric (a re-logged value), the
    last row wins. Rows without a parsable ``step`` are skipped. Non-numeric columns are dropped.
    """
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise ValueError(
                f"metrics file {str(path)!r} has no 'step' column (columns: {reader.fieldnames}); "
                "expected a Lightning CSVLogger metrics.csv"
            )
        per_metric: dict[str, dict[int, float]] = {}
        for row in reader:
            step = _to_float(row.get("step") or "")
            if step is None or not math.isfinite(step):
                continue
            for key, text in row.items():
                if key in ("step", "epoch") or key is None or text is None:
                    continue
                value = _to_float(text)
                if value is not None:
                    per_metric.setdefault(key, {})[int(step)] = value
    out = {}
    for key, by_step in per_metric.items():
        steps = np.array(sorted(by_step), dtype=np.int64)
        out[key] = Series(steps, np.array([by_step[s] for s in steps.tolist()], dtype=np.float64))
    return out


def read_alerts(path: str | os.PathLike) -> tuple[list[dict], int]:
    """Alerts from a JSONL file (one object per line) and the number of lines that were not alerts.

    Blank lines are ignored; a line that is not a JSON object with an integer-like ``step`` counts
    as bad. :meth:`~stable_attn.monitor.Alert.to_json` writes non-finite floats as the strings
    ``"nan"``, ``"inf"`` and ``"-inf"`` (strict JSON); they are read back as floats here, as are the
    ``NaN``/``Infinity`` literals Python's ``json`` writes by default, so ``value``, ``baseline``,
    ``threshold``, ``score`` and ``lr`` are floats (or None) in what this returns.
    """
    alerts = []
    bad = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                alert = json.loads(line)
                alert["step"] = int(alert["step"])
                for name in _FLOAT_FIELDS:
                    if alert.get(name) is not None:
                        alert[name] = float(alert[name])  # float() parses "nan", "inf", "-inf"
            except (ValueError, TypeError, KeyError):
                bad += 1
                continue
            alerts.append(alert)
    alerts.sort(key=lambda a: a["step"])
    return alerts, bad


#: The file a transformers ``Trainer`` writes its state and ``log_history`` to.
TRAINER_STATE_FILE = "trainer_state.json"
# The Trainer's log names that mean what the callback's names mean.
_TRAINER_NAMES = {"loss": LOSS, "eval_loss": VAL_LOSS, "grad_norm": GRAD_NORM, "learning_rate": LR}
# Keys of a log_history entry that are not metrics over steps: the position, and the end-of-run summary.
_TRAINER_SKIP = ("step", "epoch", "total_flos")


def _global_step(path: Path) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            step = json.load(f).get("global_step", -1)
    except (OSError, ValueError, AttributeError):
        return -1
    return step if isinstance(step, int) else -1


def find_trainer_state(run_dir: str | os.PathLike) -> Path | None:
    """The ``trainer_state.json`` below ``run_dir`` with the highest ``global_step`` (then the newest), or None."""
    found = [p for p in Path(run_dir).rglob(TRAINER_STATE_FILE) if p.is_file()]
    if not found:
        return None
    return max(found, key=lambda p: (_global_step(p), p.stat().st_mtime, str(p)))


def read_trainer_state(path: str | os.PathLike) -> dict[str, Series]:
    """The ``log_history`` of a transformers ``trainer_state.json`` as one :class:`Series` per metric.

    Entries without an integer ``step`` and non-numeric values are skipped; the end-of-run summary
    (``train_runtime``, ``train_loss``, ...) is left out; when a step logs a metric twice, the last wins.
    ValueError when the file is not a Trainer state.
    """
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)  # Python's json reads the NaN and Infinity the Trainer writes
    except ValueError as err:
        raise ValueError(f"{str(path)!r} is not JSON: {err}") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ValueError(f"{str(path)!r} has no 'log_history' list; expected a transformers trainer_state.json")
    per_metric: dict[str, dict[int, float]] = {}
    for entry in history:
        step = entry.get("step") if isinstance(entry, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, value in entry.items():
            if key in _TRAINER_SKIP or key.startswith("train_") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                per_metric.setdefault(_TRAINER_NAMES.get(key, key), {})[step] = float(value)
    out = {}
    for key, by_step in per_metric.items():
        steps = np.array(sorted(by_step), dtype=np.int64)
        out[key] = Series(steps, np.array([by_step[s] for s in steps.tolist()], dtype=np.float64))
    return out


def load_run(run_dir: str | os.PathLike) -> RunData:
    """Find and read the metrics CSV and the alerts JSONL of ``run_dir``; a missing file is a note."""
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"run_dir={str(run_dir)!r} is not a directory; expected the directory a training run "
            f"wrote (with a {METRICS_FILE} below it and usually a {ALERTS_FILE})"
        )
    notes: list[str] = []
    metrics_path = find_metrics_csv(root)
    metrics: dict[str, Series] = {}
    trainer_state = find_trainer_state(root) if metrics_path is None else None
    if trainer_state is not None:
        metrics_path = trainer_state
        try:
            metrics = read_trainer_state(trainer_state)
        except ValueError as err:
            notes.append(f"Could not read {trainer_state.name}: {err}")
    elif metrics_path is None:
        notes.append(f"No {METRICS_FILE} found below the run directory (nor a Trainer's {TRAINER_STATE_FILE}): "
                     "no loss or attention plots.")
    else:
        try:
            metrics = read_metrics(metrics_path)
        except ValueError as err:
            notes.append(f"Could not read {metrics_path.name}: {err}")
        others = [p for p in root.rglob(METRICS_FILE) if p.is_file() and p != metrics_path]
        if others:
            notes.append(
                f"Used the newest {METRICS_FILE}; {len(others)} older one(s) ignored: "
                + ", ".join(f"`{_rel(p, root)}`" for p in sorted(others))
            )
    alerts_path = find_alerts_jsonl(root, metrics_path)
    alerts: list[dict] = []
    if alerts_path is None:
        notes.append(f"No {ALERTS_FILE} found: no alerts are shown (the run may not have had the callback, "
                     "or its alerts_file was None or renamed).")
    else:
        alerts, bad = read_alerts(alerts_path)
        if bad:
            notes.append(f"{bad} line(s) of {alerts_path.name} were not valid alerts and were skipped.")
    return RunData(root, metrics_path, alerts_path, metrics, alerts, notes)


# --------------------------------------------------------------------------------------------------
# Summary


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


# --------------------------------------------------------------------------------------------------
# Plots


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


def _plot_loss(run: RunData, path: Path) -> bool:
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


def _plot_saturation(run: RunData, path: Path) -> bool:
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


def _plot_max_logit(run: RunData, path: Path) -> bool:
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


# --------------------------------------------------------------------------------------------------
# Report


def _rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return fmt(value)
    if isinstance(value, (list, tuple)):
        value = ", ".join(_layer_change(v) for v in value)
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _layer_change(item: object) -> str:
    """An alert's ``(name, change)`` pair as ``layer0/max_logit +0.238``; anything else as text."""
    if isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], (int, float)):
        return f"{item[0]} {item[1]:+.3g}"
    return str(item)


def _loss_cell(entry: tuple[int, float] | None) -> str:
    return "n/a" if entry is None else f"{fmt(entry[1])} (step {entry[0]})"


def build_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``loss.png``, ``saturation_heatmap.png``, ``max_logit.png`` and ``report.md`` for a run.

    ``out_dir`` defaults to ``run_dir``. Missing files, columns or alerts leave a note in the
    report instead of an error; a plot without data is not written. Returns the path of report.md.
    """
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(run)
    notes = list(run.notes)

    plots = {
        LOSS_PNG: _plot_loss(run, out / LOSS_PNG),
        SATURATION_PNG: _plot_saturation(run, out / SATURATION_PNG),
        MAX_LOGIT_PNG: _plot_max_logit(run, out / MAX_LOGIT_PNG),
    }
    if run.metrics_path is not None:
        if run.series(LOSS) is None:
            notes.append("The metrics have no `train/loss` column.")
        if run.series(VAL_LOSS) is None:
            notes.append("The metrics have no `val/loss` column (no validation ran, or it was not logged).")
        if not plots[SATURATION_PNG]:
            notes.append(
                "No `stable_attn/saturation/layer{i}` values: was the StableAttentionCallback attached "
                'and the model using `attn_implementation="stable_attn"`?'
            )
        if not plots[MAX_LOGIT_PNG]:
            notes.append("No `stable_attn/max_logit/layer{i}` values.")
    train_last = summary.final_train_loss
    if train_last is not None and not math.isfinite(train_last[1]):
        notes.append(
            f"The train loss is non-finite at step {train_last[0]}; last finite value: "
            f"{_loss_cell(summary.last_finite_train_loss)}."
        )

    md = ["# stable_attn training report", ""]
    md.append(f"Run directory: `{run.run_dir}`  ")
    if run.metrics_path is not None:
        steps = np.concatenate([s.steps for s in run.metrics.values()]) if run.metrics else np.zeros(0)
        span = f", steps {int(steps.min())}-{int(steps.max())}" if steps.size else ""
        md.append(f"Metrics: `{_rel(run.metrics_path, run.run_dir)}` ({len(run.metrics)} metrics{span})  ")
    if run.alerts_path is not None:
        md.append(f"Alerts: `{_rel(run.alerts_path, run.run_dir)}` ({len(run.alerts)} alert(s))")
    md += ["", "## Summary", "", "| quantity | value |", "|---|---|"]
    md.append(f"| final train loss | {_loss_cell(train_last)} |")
    md.append(f"| final validation loss | {_loss_cell(summary.final_val_loss)} |")
    for kind, n in summary.alert_counts.items():
        md.append(f"| alerts: {_cell(kind)} | {n} |")

    md += ["", "## Alerts", ""]
    if not run.alerts:
        md.append("No alerts were raised." if run.alerts_path is not None else "No alerts file.")
    else:
        keys = ("step", "kind", "metric", "value", "baseline", "threshold", "score", "layers", "action", "message")
        md += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for alert in run.alerts[:_MAX_ALERT_ROWS]:
            md.append("| " + " | ".join(_cell(alert.get(k)) for k in keys) + " |")
        if len(run.alerts) > _MAX_ALERT_ROWS:
            md.append(f"\n{len(run.alerts) - _MAX_ALERT_ROWS} more alerts are in the JSONL file.")

    md += ["", "## Loss", ""]
    md.append(f"![loss]({LOSS_PNG})" if plots[LOSS_PNG] else "No loss values were logged.")
    md += ["", "## Attention by layer", ""]
    if summary.layers:
        md += [
            "| layer | mean saturation | max saturation | mean fixed rate | max logit | final max logit "
            "| mean sink mass |",
            "|---|---|---|---|---|---|---|",
        ]
        for s in summary.layers:
            md.append(
                f"| {_cell(s.layer)} | {fmt(s.mean_saturation)} | {fmt(s.max_saturation)} | "
                f"{fmt(s.mean_fixed_rate)} | {fmt(s.max_logit)} | {fmt(s.final_max_logit)} | "
                f"{fmt(s.mean_sink_mass)} |"
            )
        md += [
            "",
            "Saturation: fraction of query rows where two or more keys tie at the row max (the state "
            "in which BF16 `P V` rounds with a bias). Fixed rate: how often the stabilization shifted "
            "the softmax offset. Sink mass: mean attention probability on the first token.",
        ]
    else:
        md.append("No per-layer stable_attn metrics were logged.")
    if plots[SATURATION_PNG]:
        md += ["", f"![saturation heatmap]({SATURATION_PNG})"]
    if plots[MAX_LOGIT_PNG]:
        md += ["", f"![max logit per layer]({MAX_LOGIT_PNG})"]
    if notes:
        md += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    path = out / REPORT_FILE
    path.write_text("\n".join(md) + "\n", encoding="utf-8")
    return path
