"""The contract between what a training run writes and what reads it back: file names, metric names
and alert kinds, in one place.

:class:`~stable_attn.callbacks.lightning.StableAttentionCallback` and
:class:`~stable_attn.callbacks.trainer.StableAttentionTrainerCallback` write these names,
:mod:`stable_attn.monitor.alerts.alert` validates alert kinds against :data:`ALERT_KINDS`, and
:mod:`stable_attn.report` (``stable-attn report``) reads them back. A name changed here changes for
all of them. Pure Python: no torch, no Lightning.
"""

from __future__ import annotations

import re

__all__ = [
    "ALERTS_FILE",
    "ALERT_COUNT",
    "ALERT_KINDS",
    "GRADIENTS",
    "GRAD_NORM",
    "LAYER_STATS",
    "LEGACY_ALERTS_FILES",
    "LOSS",
    "LR",
    "METRICS_FILE",
    "NOT_TRAINING",
    "QK_CLIP_HEADS",
    "VAL_LOSS",
    "layer_metric",
    "parse_layer_metric",
    "qk_clip_metric",
]

# ---------------------------------------------------------------------------------------- alert kinds
#: ``spike``: a loss or gradient-norm jump or drift; ``nonfinite``: a NaN or inf loss, gradient norm or
#: attention statistic; ``early_warning``: a per-layer attention statistic surged; ``not_training``:
#: many optimizer steps in a row had their update dropped or a non-finite loss (the run is not learning);
#: ``qk_clip``: QK-Clip edited the weights of heads whose max logit passed ``qk_clip`` (first and every 100th).
ALERT_KINDS = ("spike", "nonfinite", "early_warning", "not_training", "qk_clip", "recovery")
#: The metric of ``kind="recovery"`` alerts (on_spike="recover"): the recoveries used so far.
RECOVERIES = "stable_attn/recoveries"

# ---------------------------------------------------------------------------------------------- files
#: The callback's default alerts file, written in the run's log directory (``trainer.log_dir``).
ALERTS_FILE = "stable_attn_alerts.jsonl"
#: Names older runs used for the alerts file (the example wrote ``alerts.jsonl``); the report reads them too.
LEGACY_ALERTS_FILES = ("alerts.jsonl",)
#: Lightning's ``CSVLogger`` file; with a CSVLogger it sits in the same directory as the alerts file.
METRICS_FILE = "metrics.csv"

# -------------------------------------------------------------------------------------------- metrics
LOSS = "train/loss"
GRAD_NORM = "train/grad_norm"
#: The metric of a ``nonfinite`` alert raised by the gradient check when the norm is not monitored.
GRADIENTS = "train/gradients"
#: The metric of ``not_training`` alerts: optimizer steps in a row without an applied update.
NOT_TRAINING = "train/steps_not_training"
LR = "train/lr"
VAL_LOSS = "val/loss"
ALERT_COUNT = "stable_attn/alerts"
#: Per-layer statistics, logged as ``stable_attn/<stat>/<layer>`` (see :func:`layer_metric`).
LAYER_STATS = ("saturation", "fixed_rate", "max_logit", "sink_mass", "entropy")

#: QK-Clip (``qk_clip=``): query heads clipped at a step, and per layer ``qk_clip/max_logit/<layer>``, the
#: largest pre-clip max logit (logged on the steps that clip; see :func:`qk_clip_metric`).
QK_CLIP_HEADS = "qk_clip/clipped_heads"


def qk_clip_metric(layer: str) -> str:
    """``qk_clip/max_logit/<layer>``: the layer's largest max logit before QK-Clip edited it."""
    return f"qk_clip/max_logit/{layer}"


# ------------------------------------------------------------------ checkpoints and the Trainer's files
#: The checkpoint a stop writes (``on_spike="stop"``, or a not-training streak) in the Lightning run's log
#: directory; ``{step}`` is the step that stopped it (see :func:`stop_checkpoint`).
STOP_CHECKPOINT = "stable_attn-stop-step={step}.ckpt"
#: The last rollback snapshot (weights, optimizer state: tensors), saved by the transformers.Trainer callback
#: next to a single-process checkpoint (``checkpoint-<step>/stable_attn_rollback.pt``).
ROLLBACK_SNAPSHOT_FILE = "stable_attn_rollback.pt"
#: A transformers.Trainer checkpoint folder in ``output_dir`` (the Trainer's own name; see :func:`trainer_checkpoint`).
TRAINER_CHECKPOINT = "checkpoint-{step}"
#: The transformers.Trainer's state file (``log_history``; the callback's state), in every checkpoint folder.
TRAINER_STATE_FILE = "trainer_state.json"
#: What a transformers.Trainer logs under its own names, and the name of each here.
TRAINER_LOGS = {"loss": LOSS, "eval_loss": VAL_LOSS, "grad_norm": GRAD_NORM, "learning_rate": LR}


def stop_checkpoint(step: int) -> str:
    """The file name of the checkpoint a stop at ``step`` writes: ``stable_attn-stop-step=<step>.ckpt``."""
    return STOP_CHECKPOINT.format(step=step)


def trainer_checkpoint(step: int) -> str:
    """The transformers.Trainer's checkpoint folder of ``step``: ``checkpoint-<step>``."""
    return TRAINER_CHECKPOINT.format(step=step)


__all__ += ["ROLLBACK_SNAPSHOT_FILE", "STOP_CHECKPOINT", "TRAINER_CHECKPOINT", "TRAINER_LOGS", "TRAINER_STATE_FILE",
            "stop_checkpoint", "trainer_checkpoint"]

_LAYER_METRIC = re.compile(r"^stable_attn/(" + "|".join(LAYER_STATS) + r")/([^/]+)$")


def layer_metric(stat: str, layer: str) -> str:
    """The metric name of ``stat`` for ``layer``: ``layer_metric("saturation", "layer0")`` is
    ``"stable_attn/saturation/layer0"``. Layer names are ``layer<i>`` for one model, and
    ``<model path>.layer<i>`` (e.g. ``model.layer0``, ``encoder.layer3``) when the LightningModule
    holds several models; they never contain ``/``."""
    if stat not in LAYER_STATS:
        raise ValueError(f"stat={stat!r} is not a layer statistic; use one of {LAYER_STATS}")
    if not isinstance(layer, str) or not layer or "/" in layer:
        raise ValueError(f"layer={layer!r} is not a layer name; use a non-empty str without '/'")
    return f"stable_attn/{stat}/{layer}"


def parse_layer_metric(name: str) -> tuple[str, str] | None:
    """``(stat, layer)`` for a per-layer metric name (the inverse of :func:`layer_metric`), else None.
    Lightning's ``_step``/``_epoch`` suffixes are not part of a layer name: they are not stripped here."""
    match = _LAYER_METRIC.match(name)
    return (match.group(1), match.group(2)) if match else None
