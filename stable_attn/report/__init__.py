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

The package's own code uses no torch (numpy, and matplotlib for the plots), but importing it imports the
``stable_attn`` package, which imports torch. matplotlib draws with its Agg canvas directly, so building
a report never touches the caller's pyplot state or needs a display.

Reading is in :mod:`~stable_attn.report.read`, the headline numbers in :mod:`~stable_attn.report.summary`,
the plots in :mod:`~stable_attn.report.plots`, report.md in :mod:`~stable_attn.report.write`; every name
below is importable from ``stable_attn.report``.
"""

from __future__ import annotations

from ..monitor.names import (
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
from .read import (
    TRAINER_STATE_FILE,
    RunData,
    Series,
    find_alerts_jsonl,
    find_metrics_csv,
    find_trainer_state,
    load_run,
    read_alerts,
    read_metrics,
    read_trainer_state,
)
from .summary import LayerSummary, RunSummary, fmt, format_summary, summarize
from .write import LOSS_PNG, MAX_LOGIT_PNG, REPORT_FILE, SATURATION_PNG, build_report

__all__ = [
    # what a run writes and the report reads (stable_attn.monitor.names)
    "ALERTS_FILE",
    "ALERT_KINDS",
    "GRAD_NORM",
    "LEGACY_ALERTS_FILES",
    "LOSS",
    "LR",
    "METRICS_FILE",
    "VAL_LOSS",
    "layer_metric",
    "parse_layer_metric",
    # reading
    "TRAINER_STATE_FILE",
    "RunData",
    "Series",
    "find_alerts_jsonl",
    "find_metrics_csv",
    "find_trainer_state",
    "load_run",
    "read_alerts",
    "read_metrics",
    "read_trainer_state",
    # summary
    "LayerSummary",
    "RunSummary",
    "fmt",
    "format_summary",
    "summarize",
    # writing
    "LOSS_PNG",
    "MAX_LOGIT_PNG",
    "REPORT_FILE",
    "SATURATION_PNG",
    "build_report",
]
