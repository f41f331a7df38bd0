"""Alerts and their delivery: :class:`~.alert.Alert` and its channels (:mod:`.alert`, :mod:`.webhook`), the line's
schema (:mod:`.schema`), the channels built from the arguments (:mod:`.channels`), the evidence an alert carries
(:mod:`.evidence`) and the desk that delivers a run's alerts on rank zero (:mod:`.desk`).

``stable_attn.monitor.alerts.Alert`` and the channel classes are importable from here; code inside
``stable_attn.monitor`` imports them from their modules.
"""

from .alert import (
    ALERT_KINDS,
    DELIVERY_COUNTS,
    Alert,
    AlertChannel,
    AlertDispatcher,
    CallableChannel,
    JsonlChannel,
    LoggingChannel,
    callable_name,
    checkpoint_name,
    json_safe,
)
from .webhook import WebhookChannel

__all__ = ["ALERT_KINDS", "DELIVERY_COUNTS", "Alert", "AlertChannel", "AlertDispatcher", "CallableChannel",
           "JsonlChannel", "LoggingChannel", "WebhookChannel", "callable_name", "checkpoint_name", "json_safe"]
