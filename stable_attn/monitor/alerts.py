"""Alerts and where they go: Python logging, a JSONL file, user callables, a webhook.

An :class:`Alert` is one record of something worth a human's attention during training (a loss spike,
a NaN, a surge in attention saturation). An :class:`AlertDispatcher` hands each alert to every
channel and shields training from channel failures: a full disk, a raising user callback or an
unreachable webhook is logged, never raised. Only the standard library is used (urllib for HTTP).

JSON encoding (JSONL lines and webhook bodies, via :meth:`Alert.to_dict`): non-finite floats are
written as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (strict JSON has no NaN/Infinity, and a
string keeps the difference between NaN and inf that ``null`` would lose); ``lr`` is ``null`` when
unknown; ``layers`` is a list of ``[name, change]`` pairs; ``time`` is seconds since the epoch.
:meth:`Alert.from_dict` reverses the encoding.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .names import ALERT_KINDS
from .spikes import SpikeEvent

__all__ = [
    "ALERT_KINDS",
    "Alert",
    "AlertChannel",
    "AlertDispatcher",
    "CallableChannel",
    "JsonlChannel",
    "LoggingChannel",
    "WebhookChannel",
]

logger = logging.getLogger("stable_attn")

_FLOAT_FIELDS = ("value", "baseline", "threshold", "score")


def _encode_float(x: float | None) -> float | str | None:
    if x is None:
        return None
    x = float(x)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _decode_float(x: Any) -> float | None:
    if x is None:
        return None
    return float(x)  # float() parses "nan", "inf", "-inf" as well as numbers


def _fmt(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)


@dataclass
class Alert:
    """One alert raised during training.

    Attributes:
        step: global training step.
        kind: ``"spike"``, ``"nonfinite"`` or ``"early_warning"``.
        metric: the metric that fired, e.g. ``"train/loss"`` or ``"stable_attn/saturation/layer3"``.
        value: the observed value.
        baseline: what the detector expected (NaN if unknown).
        threshold: the value above which it fires (NaN if unknown).
        score: robust sigmas above the baseline (inf for non-finite values, NaN if unknown).
        lr: learning rate at the step, if known.
        layers: ``(layer name, change)`` pairs, the layers whose saturation or max logit changed most
            over the recent window; sorted here by ``|change|``, most-changed first.
        action: what training does about it (``"warn"``, ``"skip"``, ``"rollback"``, ``"stop"``).
        message: free text added to the formatted line.
        time: wall-clock time of the alert, seconds since the epoch.
    """

    step: int
    kind: str
    metric: str
    value: float
    baseline: float = math.nan
    threshold: float = math.nan
    score: float = math.nan
    lr: float | None = None
    layers: list[tuple[str, float]] = field(default_factory=list)
    action: str = "warn"
    message: str = ""
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.kind not in ALERT_KINDS:
            raise ValueError(f"kind must be one of {ALERT_KINDS}, got {self.kind!r}")
        if not isinstance(self.metric, str):
            raise TypeError(f"metric must be a str, got {self.metric!r}")
        self.step = int(self.step)
        for name in _FLOAT_FIELDS:
            setattr(self, name, float(getattr(self, name)))
        if self.lr is not None:
            self.lr = float(self.lr)
        pairs = []
        for item in self.layers:
            try:
                name, change = item
                pairs.append((str(name), float(change)))
            except (TypeError, ValueError):
                raise TypeError(f"layers must hold (name, change) pairs, got {item!r}") from None
        pairs.sort(key=lambda p: -abs(p[1]) if not math.isnan(p[1]) else 0.0)
        self.layers = pairs

    @classmethod
    def from_event(
        cls,
        event: SpikeEvent,
        *,
        lr: float | None = None,
        layers: Iterable[tuple[str, float]] = (),
        action: str = "warn",
        message: str = "",
    ) -> Alert:
        """Build an alert from a detector's :class:`SpikeEvent` plus training context.

        Without a ``message``, a drift event (a sustained rise, no single jump) says so in the message.
        """
        if not message and event.rule == "drift":
            message = "sustained rise over recent steps (drift rule)"
        return cls(
            step=event.step,
            kind=event.kind,
            metric=event.metric,
            value=event.value,
            baseline=event.baseline,
            threshold=event.threshold,
            score=event.score,
            lr=lr,
            layers=list(layers),
            action=action,
            message=message,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict with the keys of the alerts JSONL (non-finite floats as strings)."""
        return {
            "step": self.step,
            "kind": self.kind,
            "metric": self.metric,
            "value": _encode_float(self.value),
            "baseline": _encode_float(self.baseline),
            "threshold": _encode_float(self.threshold),
            "score": _encode_float(self.score),
            "lr": _encode_float(self.lr),
            "layers": [[name, _encode_float(change)] for name, change in self.layers],
            "action": self.action,
            "message": self.message,
            "time": self.time,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Alert:
        """Rebuild an alert from :meth:`to_dict` output (e.g. one parsed JSONL line)."""
        kwargs = dict(data)
        for name in (*_FLOAT_FIELDS, "lr"):
            if name in kwargs:
                kwargs[name] = _decode_float(kwargs[name])
        kwargs["layers"] = [(name, _decode_float(change)) for name, change in kwargs.get("layers", [])]
        return cls(**kwargs)

    def to_json(self) -> str:
        """One line of strict JSON (no NaN/Infinity literals)."""
        return json.dumps(self.to_dict(), allow_nan=False, separators=(",", ":"))

    def format(self) -> str:
        """One readable line, e.g.
        ``spike at step 1200: train/loss=5.21 > 3.35 (baseline 3.18, 41.3 sigma); lr 3e-04; layers: ...``."""
        head = f"{self.kind} at step {self.step}: {self.metric}={_fmt(self.value)}"
        if self.kind != "nonfinite" and math.isfinite(self.threshold):
            head += f" > {_fmt(self.threshold)}"
        details = []
        if math.isfinite(self.baseline):
            details.append(f"baseline {_fmt(self.baseline)}")
        if math.isfinite(self.score):
            details.append(f"{self.score:.1f} sigma")
        if details:
            head += f" ({', '.join(details)})"
        parts = [head]
        if self.lr is not None:
            parts.append(f"lr {self.lr:.3g}")
        if self.layers:
            parts.append("layers " + ", ".join(f"{name} {change:+.3g}" for name, change in self.layers[:4]))
        parts.append(f"action {self.action}")
        if self.message:
            parts.append(" ".join(self.message.split()))  # one line, whatever the caller passed
        return "; ".join(parts)

    def __str__(self) -> str:
        return self.format()


class AlertChannel:
    """Where alerts go. Subclasses implement :meth:`send`; :meth:`flush` and :meth:`close` default to no-ops.

    ``send`` may raise: :class:`AlertDispatcher` catches and logs it. Channels that do slow work
    (the webhook) must not block the caller.
    """

    def send(self, alert: Alert) -> None:
        raise NotImplementedError

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued alerts are delivered (or failed); True if nothing is left pending."""
        return True

    def close(self) -> None:
        """Release resources; later sends are dropped."""


class LoggingChannel(AlertChannel):
    """One line per alert (:meth:`Alert.format`) on the ``stable_attn`` logger, at WARNING by default."""

    def __init__(self, logger: logging.Logger | str = "stable_attn", level: int = logging.WARNING) -> None:
        if isinstance(logger, str):
            logger = logging.getLogger(logger)
        if not isinstance(logger, logging.Logger):
            raise TypeError(f"logger must be a logging.Logger or a logger name, got {logger!r}")
        self.logger = logger
        self.level = level

    def send(self, alert: Alert) -> None:
        self.logger.log(self.level, "%s", alert.format())


class JsonlChannel(AlertChannel):
    """Appends one JSON object per alert to ``path`` (see the module docstring for the encoding).

    The file is opened, written and closed per alert: each alert is on disk when ``send`` returns,
    even if training dies right after, and no handle is held between the (rare) alerts. Parent
    directories are created on the first alert.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {path!r}")
        self.path = Path(path)
        self._lock = threading.Lock()

    def send(self, alert: Alert) -> None:
        line = alert.to_json() + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()


class CallableChannel(AlertChannel):
    """Calls ``fn(alert)`` for each alert (e.g. a user's ``on_alert`` hook)."""

    def __init__(self, fn: Callable[[Alert], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable (it receives the Alert), got {fn!r}")
        self.fn = fn

    def send(self, alert: Alert) -> None:
        self.fn(alert)

    def __repr__(self) -> str:
        return f"CallableChannel({getattr(self.fn, '__qualname__', self.fn)!r})"


_STOP = object()


class WebhookChannel(AlertChannel):
    """POSTs each alert as JSON to ``url`` from a background daemon thread.

    ``send`` only enqueues (bounded queue of ``max_queue`` alerts; when full, the alert is dropped and
    a warning logged), so training never waits on the network. Each POST has ``timeout`` seconds.
    Failures (connection refused, timeout, HTTP error status) are counted in ``failed`` and logged at
    WARNING once per kind of failure (later ones of the same kind at DEBUG); they are never raised.
    Call :meth:`flush` to wait for delivery (tests, end of training) and :meth:`close` at shutdown.
    Log lines and ``repr`` show only the URL's scheme, host and port: webhook paths often hold a token.

    Args:
        url: ``http://`` or ``https://`` endpoint.
        timeout: seconds per request.
        max_queue: alerts waiting for delivery before new ones are dropped.
        headers: extra HTTP headers (e.g. authorization).
        payload: maps an alert to the JSON body; default :meth:`Alert.to_dict`. For a Slack-style
            incoming webhook use ``payload=lambda a: {"text": a.format()}``.
    """

    def __init__(
        self,
        url: str,
        timeout: float = 2.0,
        *,
        max_queue: int = 64,
        headers: Mapping[str, str] | None = None,
        payload: Callable[[Alert], Any] | None = None,
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"url must be a str, got {url!r}")
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"url must be an http:// or https:// URL with a host, got {url!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an int >= 1, got {max_queue!r}")
        if payload is not None and not callable(payload):
            raise TypeError(f"payload must be callable (Alert -> JSON-serialisable object), got {payload!r}")
        self.url = url
        # Webhook paths often carry a secret token (Slack, Discord): logs and reprs show host only.
        host = parsed.hostname or ""
        self._safe_url = f"{parsed.scheme}://{host}{f':{parsed.port}' if parsed.port else ''}/..."
        self.timeout = float(timeout)
        self.headers = {"Content-Type": "application/json", "User-Agent": "stable_attn-alerts"}
        self.headers.update(headers or {})
        self.payload = payload or Alert.to_dict
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._pending = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._reported: set[str] = set()

    def send(self, alert: Alert) -> None:
        if self._closed:
            self._report("closed", "webhook channel is closed; alert at step %s dropped", alert.step)
            self.dropped += 1
            return
        body = json.dumps(self.payload(alert), allow_nan=False).encode("utf-8")
        with self._cond:
            self._start()
            try:
                self._queue.put_nowait(body)
            except queue.Full:
                self.dropped += 1
                self._report("queue full", "webhook %s is behind (queue full); alert at step %s dropped",
                              self._safe_url, alert.step)
                return
            self._pending += 1

    def flush(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Deliver what is queued (waiting up to ``timeout``, default twice the request timeout), stop."""
        if self._closed:
            return
        wait = 2 * self.timeout if timeout is None else timeout
        self.flush(wait)
        self._closed = True
        thread = self._thread
        if thread is not None:
            try:
                self._queue.put(_STOP, timeout=max(wait, 0.01))
            except queue.Full:
                return  # the daemon thread ends with the interpreter
            thread.join(wait)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="stable_attn-webhook", daemon=True)
            self._thread.start()

    def _worker(self) -> None:
        while True:
            body = self._queue.get()
            if body is _STOP:
                return
            try:
                self._post(body)
                self.sent += 1
            except Exception as exc:  # every failure is logged, none may escape
                self.failed += 1
                self._report(_failure_kind(exc), "webhook %s failed: %s (alerts keep going to other channels)",
                             self._safe_url, exc)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _post(self, body: bytes) -> None:
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            response.read()

    def _report(self, kind: str, msg: str, *args: Any) -> None:
        if kind in self._reported:
            logger.debug(msg, *args)
        else:
            self._reported.add(kind)
            logger.warning(msg, *args)

    def __repr__(self) -> str:
        return f"WebhookChannel({self._safe_url!r}, timeout={self.timeout!r})"


def _failure_kind(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    if isinstance(exc, urllib.error.URLError):
        return f"URLError:{type(exc.reason).__name__}"
    return type(exc).__name__


class AlertDispatcher:
    """Delivers each alert to every channel; a failing channel is logged and never stops training.

    Args:
        channels: :class:`AlertChannel` instances; plain callables are wrapped in
            :class:`CallableChannel`.

    Attributes:
        channels: the channels, in delivery order (append more at any time).
        emitted: alerts passed to :meth:`emit`.
        errors: channel failures caught.
    """

    def __init__(self, channels: Sequence[AlertChannel | Callable[[Alert], Any]] = ()) -> None:
        self.channels: list[AlertChannel] = []
        for channel in channels:
            if isinstance(channel, AlertChannel):
                self.channels.append(channel)
            elif callable(channel):
                self.channels.append(CallableChannel(channel))
            else:
                raise TypeError(f"channels must hold AlertChannel instances or callables, got {channel!r}")
        self.emitted = 0
        self.errors = 0
        self._reported: set[tuple[int, str]] = set()

    def emit(self, alert: Alert) -> int:
        """Send ``alert`` to every channel; return how many accepted it without raising."""
        if not isinstance(alert, Alert):
            raise TypeError(f"alert must be an Alert, got {alert!r}")
        self.emitted += 1
        delivered = 0
        for channel in self.channels:
            try:
                channel.send(alert)
                delivered += 1
            except Exception as exc:  # a channel must never crash training
                self.errors += 1
                key = (id(channel), type(exc).__name__)
                level = logging.DEBUG if key in self._reported else logging.WARNING
                self._reported.add(key)
                logger.log(level, "alert channel %r failed on the alert at step %s: %r", channel, alert.step, exc)
        return delivered

    def flush(self, timeout: float | None = None) -> bool:
        """Flush every channel (each gets up to ``timeout``); True if all are drained."""
        return all([self._safe(channel.flush, timeout) for channel in self.channels])

    def close(self) -> None:
        """Close every channel (pending webhook alerts get a short grace period)."""
        for channel in self.channels:
            self._safe(channel.close)

    def _safe(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            result = fn(*args)
            return True if result is None else result
        except Exception as exc:  # flush/close must not raise either
            logger.warning("alert channel call %r failed: %r", fn, exc)
            return False

    def __enter__(self) -> AlertDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

