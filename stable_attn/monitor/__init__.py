"""Training monitoring: spike and surge detectors, and the alerts they raise.

- :class:`SpikeDetector`: loss / gradient-norm spikes and non-finite values (``update(step, value)``);
- :class:`SurgeDetector`: early warnings when a per-layer attention statistic surges;
- :class:`EntropyCollapseDetector`: early warnings when a layer's attention entropy collapses;
- :class:`Alert` and its channels (:class:`LoggingChannel`, :class:`JsonlChannel`,
  :class:`CallableChannel`, :class:`WebhookChannel`), fanned out by :class:`AlertDispatcher`.

Pure Python (no torch): they work in any training loop. :class:`stable_attn.monitor.engine.MonitorEngine`
(torch; imported on its own, not from here) builds on them for any training loop, and the Lightning and
transformers.Trainer callbacks (:mod:`stable_attn.callbacks`) are thin adapters over it.

The folders: ``detectors/`` (these detectors), ``alerts/`` (alerts, their schema, evidence and delivery) and
``actions/`` (what a spike does, each action with its state; torch). Code inside this package imports from the
defining modules, not from here.
"""

from .alerts.alert import (
    ALERT_KINDS,
    DELIVERY_COUNTS,
    Alert,
    AlertChannel,
    AlertDispatcher,
    CallableChannel,
    JsonlChannel,
    LoggingChannel,
)
from .alerts.webhook import WebhookChannel
from .detectors.collapse import EntropyCollapseDetector
from .detectors.events import SpikeEvent
from .detectors.spikes import SpikeDetector
from .detectors.surge import SurgeDetector

__all__ = [
    "ALERT_KINDS",
    "Alert",
    "AlertChannel",
    "AlertDispatcher",
    "CallableChannel",
    "DELIVERY_COUNTS",
    "EntropyCollapseDetector",
    "JsonlChannel",
    "LoggingChannel",
    "SpikeDetector",
    "SpikeEvent",
    "SurgeDetector",
    "WebhookChannel",
]
