"""The alert desk: where a run's alerts are delivered, on rank zero.

It owns the channels (an :class:`~stable_attn.monitor.alerts.alert.AlertDispatcher`, opened at the run's start
and closed at its end), each alert's :class:`~stable_attn.monitor.alerts.evidence.Evidence`, the alerts held back
until their monitored step's attention statistics are reduced, and the per-channel delivery counts across runs (a
resume adds the checkpoint's). The engine hands it each alert with a
:class:`~stable_attn.monitor.alerts.evidence.StepFacts`; ranks
other than zero never open it, so there it delivers nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import channels as alerting
from .alert import Alert, AlertDispatcher
from .evidence import Evidence, StepFacts

__all__ = ["AlertDesk"]


class AlertDesk:
    """Delivery of the alerts of one engine (see the module)."""

    def __init__(self) -> None:
        self.dispatcher: AlertDispatcher | None = None
        self.evidence = Evidence()
        self.delivered: dict[str, dict[str, int]] = {}  # per channel: closed channels and earlier runs of a resume
        self.defer = False  # alerts delivered now wait for the end of their step (flush)
        self._deferred: list[Alert] = []

    @property
    def is_open(self) -> bool:
        return self.dispatcher is not None

    def open(self, log_dir: str, alerts_file: str | None, on_alert: Iterable[Callable[[Alert], Any]],
             webhook_url: str | None, webhook_timeout: float, webhook_headers: Mapping[str, str]) -> None:
        """The channels of a run: the log line, the JSONL file in ``log_dir``, the callables, the webhook."""
        self.dispatcher = alerting.build_dispatcher(log_dir, alerts_file, on_alert, webhook_url, webhook_timeout,
                                                    webhook_headers)

    def deliver(self, alert: Alert, facts: StepFacts) -> None:
        """``alert`` with its evidence, to every channel; while :attr:`defer` is set, every field but the attention
        statistics and the outcome is filled now (the gradients are gone after the step) and it waits for
        :meth:`flush` (the step's statistics reduced, its action resolved)."""
        if self.dispatcher is None:
            return
        if self.defer:
            self._deferred.append(self.evidence.fill(alert, facts, leave=("attention", "outcome")))
        else:
            self.dispatcher.emit(self.evidence.fill(alert, facts))

    def flush(self, facts: StepFacts) -> None:
        """Deliver the alerts held back, with the statistics in ``facts``."""
        deferred, self._deferred = self._deferred, []
        if self.dispatcher is not None:
            for alert in deferred:
                self.dispatcher.emit(self.evidence.fill(alert, facts))

    def close(self, timeout: float, when: str) -> None:
        """Close the channels within ``timeout`` seconds in all and keep their counts (idempotent)."""
        dispatcher, self.dispatcher = self.dispatcher, None
        if dispatcher is not None:
            self.delivered = alerting.add_counts(self.delivered, alerting.close_dispatcher(dispatcher, timeout, when))

    def delivery(self) -> dict[str, dict[str, int]]:
        """Per-channel delivery counts so far: closed channels, earlier runs, and the open channels."""
        live = self.dispatcher.delivery() if self.dispatcher is not None else {}
        return alerting.add_counts(self.delivered, {k: v for k, v in live.items() if any(v.values())})

    def load(self, counts: Mapping[str, Mapping[str, int]]) -> None:
        """A resumed run's counts start from the checkpoint's."""
        self.delivered = alerting.add_counts({}, counts)
