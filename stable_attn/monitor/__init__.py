"""Training monitoring: spike and surge detectors, and the alerts they raise.

- :class:`SpikeDetector`: loss / gradient-norm spikes and non-finite values (``update(step, value)``);
- :class:`SurgeDetector`: early warnings when a per-layer attention statistic surges;
- :class:`Alert` and its channels (:class:`LoggingChannel`, :class:`JsonlChannel`,
  :class:`CallableChannel`, :class:`WebhookChannel`), fanned out by :class:`AlertDispatcher`.

Pure Python (no torch): :class:`stable_attn.callbacks.engine.MonitorEngine` builds on these for the
Lightning and transformers.Trainer callbacks; they work in any training loop.
"""

from .alerts import (
    ALERT_KINDS,
    DELIVERY_COUNTS,
    Alert,
    AlertChannel,
    AlertDispatcher,
    CallableChannel,
    JsonlChannel,
    LoggingChannel,
)
from .events import SpikeEvent
from .spikes import SpikeDetector
from .surge import SurgeDetector
from .webhook import WebhookChannel

__all__ = [
    "ALERT_KINDS",
    "Alert",
    "AlertChannel",
    "AlertDispatcher",
    "CallableChannel",
    "DELIVERY_COUNTS",
    "JsonlChannel",
    "LoggingChannel",
    "SpikeDetector",
    "SpikeEvent",
    "SurgeDetector",
    "WebhookChannel",
]
