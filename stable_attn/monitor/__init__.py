"""Training monitoring: spike and surge detectors, and the alerts they raise.

- :class:`SpikeDetector`: loss / gradient-norm spikes and non-finite values (``update(step, value)``);
- :class:`SurgeDetector`: early warnings when a per-layer attention statistic surges;
- :class:`EntropyCollapseDetector`: early warnings when a layer's attention entropy collapses;
- :class:`Alert` and its channels (:class:`LoggingChannel`, :class:`JsonlChannel`,
  :class:`CallableChannel`, :class:`WebhookChannel`), fanned out by :class:`AlertDispatcher`.

Pure Python (no torch): they work in any training loop. :class:`stable_attn.monitor.engine.MonitorEngine`
(torch; imported on its own, not from here) builds on them for any training loop, and the Lightning and
transformers.Trainer callbacks (:mod:`stable_attn.callbacks`) are thin adapters over it.
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
from .collapse import EntropyCollapseDetector
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
    "EntropyCollapseDetector",
    "JsonlChannel",
    "LoggingChannel",
    "SpikeDetector",
    "SpikeEvent",
    "SurgeDetector",
    "WebhookChannel",
]
