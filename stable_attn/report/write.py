"""Writing a run's report: the three PNGs and ``report.md`` (:func:`build_report`)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from ..monitor.alerts.alert import Alert
from ..monitor.names import LOSS, VAL_LOSS
from .evidence import evidence_section
from .plots import KIND_COLORS, LEVELS, plot_loss, plot_max_logit, plot_qk_clip, plot_saturation
from .read import RunData, display_path, load_run
from .summary import fmt, summarize

__all__ = ["LOSS_PNG", "MAX_LOGIT_PNG", "REPORT_FILE", "SATURATION_PNG", "build_report"]

REPORT_FILE = "report.md"
LOSS_PNG = "loss.png"
SATURATION_PNG = "saturation_heatmap.png"
MAX_LOGIT_PNG = "max_logit.png"
QK_CLIP_PNG = "qk_clip.png"  # only where the run used qk_clip= and it clipped

_MAX_ALERT_ROWS = 100
# The alerts table shows every version-1 field of an alert but the learning rate and the wall-clock time; the
# evidence (schema version 2) has its own section below the table.
_ALERT_COLUMNS = tuple(name for name in Alert.FIELDS
                       if name not in ("lr", "time", "version") and name not in Alert.EVIDENCE_FIELDS)


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


def _how_to_read() -> list[str]:
    colors = ", ".join(f"{kind} {color.removeprefix('tab:')}" for kind, color in KIND_COLORS.items())
    sat = "; ".join(label for _, label in LEVELS["saturation"])
    logit = "; ".join(label for _, label in LEVELS["max_logit"])
    return [
        f"- **Loss**: dashed vertical lines are alerts, coloured by kind ({colors}); the title counts them. A "
        "spike alert marks a step whose loss or gradient norm jumped far above its recent level (with "
        '`on_spike="skip"` that update was dropped).',
        "- **Saturation heatmap**: per layer and logged step, the fraction of query rows whose maximum score is "
        "tied by two or more keys: the state in which BF16 `P V` would round with a bias without stable_attn's "
        f"fix (README's healthy main job: 0.05-0.11 per layer on average). The cyan line on the colour bar: "
        f"{sat}.",
        "- **Max logit**: the largest scaled attention score per layer (log axis when all are positive; README's "
        f"healthy main job peaks at 2-8). Dotted lines: {logit}.",
        "- The levels are the early-warning detectors' defaults (`SurgeDetector.saturation()`, "
        "`SurgeDetector.max_logit()`); a run given other detectors alerts at its own. docs/DETECTORS.md has the "
        "rules.",
    ]


def build_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``loss.png``, ``saturation_heatmap.png``, ``max_logit.png`` and ``report.md`` for a run.

    ``out_dir`` defaults to ``run_dir``. Missing files, columns or alerts leave a note in the
    report instead of an error; a plot without data is not written. Returns the path of report.md.
    An output folder that cannot be written (read-only, full) raises one OSError naming it.
    """
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir
    try:
        return _write(run, out)
    except OSError as err:  # a read-only or full folder: one error naming it, not matplotlib's traceback
        why = err.strerror or str(err) or type(err).__name__
        raise OSError(err.errno, f"cannot write the report to {out}: {why}", str(out)) from err


def _write(run: RunData, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(run)
    notes = list(run.notes)

    plots = {
        LOSS_PNG: plot_loss(run, out / LOSS_PNG),
        SATURATION_PNG: plot_saturation(run, out / SATURATION_PNG),
        MAX_LOGIT_PNG: plot_max_logit(run, out / MAX_LOGIT_PNG),
        QK_CLIP_PNG: plot_qk_clip(run, out / QK_CLIP_PNG),
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
        md.append(f"Metrics: `{display_path(run.metrics_path, run.run_dir)}` ({len(run.metrics)} metrics{span})  ")
    if run.alerts_path is not None:
        md.append(f"Alerts: `{display_path(run.alerts_path, run.run_dir)}` ({len(run.alerts)} alert(s))")
    md += ["", "## Summary", "", "| quantity | value |", "|---|---|"]
    md.append(f"| final train loss | {_loss_cell(train_last)} |")
    md.append(f"| final validation loss | {_loss_cell(summary.final_val_loss)} |")
    for kind, n in summary.alert_counts.items():
        md.append(f"| alerts: {_cell(kind)} | {n} |")

    md += ["", "## How to read this", ""] + _how_to_read()
    md += ["", "## Alerts", ""]
    if not run.alerts:
        md.append("No alerts were raised." if run.alerts_path is not None else "No alerts file.")
    else:
        keys = _ALERT_COLUMNS
        md += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for alert in run.alerts[:_MAX_ALERT_ROWS]:
            md.append("| " + " | ".join(_cell(alert.get(k)) for k in keys) + " |")
        if len(run.alerts) > _MAX_ALERT_ROWS:
            md.append(f"\n{len(run.alerts) - _MAX_ALERT_ROWS} more alerts are in the JSONL file.")
        md += evidence_section(run.alerts)

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
    if plots[QK_CLIP_PNG]:
        md += ["", f"![QK-Clip: clipped heads per step]({QK_CLIP_PNG})"]
    if notes:
        md += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    path = out / REPORT_FILE
    path.write_text("\n".join(md) + "\n", encoding="utf-8")
    return path
