"""Alerts and where they go: Python logging, a JSONL file, user callables, a webhook.

An :class:`Alert` is one record of something worth a human's attention during training (a loss spike,
a NaN, a surge in attention saturation). An :class:`AlertDispatcher` hands each alert to every
channel and shields training from channel failures: a full disk, a raising user callback or an
unreachable webhook is logged, never raised, and counted (:data:`DELIVERY_COUNTS`). The webhook channel
lives in :mod:`stable_attn.monitor.alerts.webhook`. Only the standard library is used.

JSON encoding (JSONL lines and webhook bodies, via :meth:`Alert.to_dict`): one object with the keys
:attr:`Alert.FIELDS`, in that order. Non-finite floats (:attr:`Alert.FLOAT_FIELDS` and the changes in
``layers``) are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (strict JSON has no
NaN/Infinity, and a string keeps the difference between NaN and inf that ``null`` would lose); ``lr``
is ``null`` when unknown; ``layers`` is a list of ``[name, change]`` pairs; ``time`` is seconds since
the epoch. :meth:`Alert.from_dict` reverses the encoding; :meth:`Alert.decode_fields` undoes it
without building an alert, for readers that also take older or hand-written lines (``stable-attn report``).
The evidence fields (:attr:`Alert.EVIDENCE_FIELDS`, schema version 2) hold JSON values as written: nested
non-finite floats are the same strings there. docs/ALERTS.md documents every field; the schema's machine
form is :mod:`stable_attn.monitor.alerts.schema`.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from ..detectors.events import SpikeEvent
from ..names import ALERT_KINDS
from . import schema as alert_schema

__all__ = [
    "ALERT_KINDS",
    "DELIVERY_COUNTS",
    "SLOW_CALLABLE_S",
    "Alert",
    "AlertChannel",
    "AlertDispatcher",
    "CallableChannel",
    "JsonlChannel",
    "LoggingChannel",
    "callable_name",
]

logger = logging.getLogger("stable_attn")




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


def checkpoint_name(path: str) -> str:
    """The file or folder name of a checkpoint path (``/runs/a/checkpoint-25/`` -> ``checkpoint-25``): what may
    leave the machine."""
    trimmed = path.rstrip("/\\")
    return trimmed.replace("\\", "/").rpartition("/")[2] or trimmed


def json_safe(value: Any) -> Any:
    """``value`` as strict JSON can hold it: non-finite floats as ``"nan"``/``"inf"``/``"-inf"``, tuples as
    lists, mapping keys as str; other values as they are."""
    if isinstance(value, float):
        return _encode_float(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _number(x: Any) -> float | None:
    """A JSON float (number or its string form) as a float; None for anything else."""
    if isinstance(x, bool) or x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


# What the replay's verdict means, for the log line (monitor/actions/replay.py decides it)
_VERDICT_WORDS = {
    "numerical": "numerical (a replay with another attention arithmetic did not spike)",
    "data": "data (every replayed attention arithmetic spiked: look at the batch)",
    "unclear": "unclear (the replays neither all spiked nor stopped spiking with a fix)",
}


def _diagnosis_words(diagnosis: Mapping[str, Any]) -> str:
    """The spike's diagnosis (``diagnose_spikes``) in a few words: the verdict, else why there is none."""
    if diagnosis.get("verdict") is not None:
        words = f"diagnosis {_VERDICT_WORDS.get(diagnosis['verdict'], diagnosis['verdict'])}"
    elif diagnosis.get("skipped"):
        words = f"diagnosis skipped: {diagnosis['skipped']}"
    elif diagnosis.get("error"):
        words = f"diagnosis failed: {diagnosis['error']}"
    else:
        return "diagnosis: none"
    if diagnosis.get("bundle"):
        words += f", replay bundle {diagnosis['bundle']}"
    return words


def _short_evidence(alert: Alert) -> list[str]:
    """The evidence in a few words for the log line: what was done, where in the data, what moved."""
    parts = []
    outcome = alert.outcome or {}
    if outcome:
        done = "update applied" if outcome.get("update_applied") else "update dropped" \
            if outcome.get("update_applied") is False else ""
        if outcome.get("rolled_back_to") is not None:
            done += f", rolled back to step {outcome['rolled_back_to']}"
        if outcome.get("skipping_batches") is not None:
            a, b = outcome["skipping_batches"]
            done += f", skipping batches {a}-{b}"
        if outcome.get("stopped"):
            done += ", stopped"
        if done:
            parts.append(done.lstrip(", "))
    position = alert.data_position or {}
    if position:
        where = [f"{key.replace('_', ' ')} {position[key]}" for key in ("epoch", "batch_index")
                 if position.get(key) is not None]
        if position.get("fingerprint"):
            where.append(f"fingerprint {position['fingerprint']}")
        if where:
            parts.append("data " + " ".join(where))
    moved = (alert.attention or {}).get("moved")
    if moved:
        before, after = _number(moved.get("before")), _number(moved.get("after"))
        head = f" head {moved['head']}" if moved.get("head") is not None else ""
        span = f" {_fmt(before)}->{_fmt(after)}" if before is not None and after is not None else ""
        parts.append(f"moved most: {moved['layer']}{head} {moved['stat']}{span}")
    top = (alert.grad_norms or {}).get("top") or []
    if top:
        norm = _number(top[0][1])
        parts.append(f"top grad {top[0][0]} {_fmt(norm) if norm is not None else top[0][1]}")
    return parts


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
        checkpoint: the checkpoint a stop writes (a local path; None unless the alert stops the run). The
            formatted line ends with it; :meth:`for_remote` keeps its file or folder name only.
        time: wall-clock time of the alert, seconds since the epoch.
        version: the schema version of the line (:data:`~stable_attn.monitor.alerts.schema.VERSION`; 1 for a
            line read back without one).
        data_position, lrs, world_size, ranks, loss_window, attention, grad_norms, outcome, diagnosis: the evidence
            (:attr:`EVIDENCE_FIELDS`), JSON values, each None when unknown; docs/ALERTS.md says what each
            holds. :mod:`stable_attn.monitor.alerts.evidence` fills them for the engine's alerts.
    """

    #: The keys of an alert's JSON object (:meth:`to_dict`; the alerts JSONL, webhook bodies), in the
    #: order they are written: the attributes above.
    FIELDS: ClassVar[tuple[str, ...]]
    #: The keys whose values are floats (``lr`` may be None); JSON holds non-finite ones as strings.
    FLOAT_FIELDS: ClassVar[tuple[str, ...]] = ("value", "baseline", "threshold", "score", "lr")
    #: The evidence fields (schema version 2): JSON values (nested non-finite floats as strings), or None.
    EVIDENCE_FIELDS: ClassVar[tuple[str, ...]] = tuple(k for k in alert_schema.EVIDENCE if k != "version")

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
    checkpoint: str | None = None
    time: float = field(default_factory=time.time)
    version: int = alert_schema.VERSION
    data_position: dict[str, Any] | None = None
    lrs: list[Any] | None = None
    world_size: int | None = None
    ranks: list[dict[str, Any]] | None = None
    loss_window: list[list[Any]] | None = None
    attention: dict[str, Any] | None = None
    grad_norms: dict[str, Any] | None = None
    outcome: dict[str, Any] | None = None
    diagnosis: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ALERT_KINDS:
            raise ValueError(f"kind must be one of {ALERT_KINDS}, got {self.kind!r}")
        if not isinstance(self.metric, str):
            raise TypeError(f"metric must be a str, got {self.metric!r}")
        if self.checkpoint is not None and not isinstance(self.checkpoint, str):
            raise TypeError(f"checkpoint must be None or a path (str), got {self.checkpoint!r}")
        self.step = int(self.step)
        for name in self.FLOAT_FIELDS:
            value = getattr(self, name)
            if name != "lr" or value is not None:  # only the learning rate may be unknown
                setattr(self, name, float(value))
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
        checkpoint: str | None = None,
        diagnosis: dict[str, Any] | None = None,
    ) -> Alert:
        """Build an alert from a detector's :class:`SpikeEvent` plus training context.

        Without a ``message``, a drift event (a sustained rise, no single jump) and an entropy collapse say so
        in the message.
        """
        if not message and event.rule == "drift":
            message = "sustained rise over recent steps (drift rule)"
        elif not message and event.rule in ("collapse", "plunge"):
            message = f"attention entropy collapsed below its running median ({event.rule} rule)"
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
            checkpoint=checkpoint,
            diagnosis=diagnosis,
        )

    def for_remote(self) -> Alert:
        """This alert as it may leave the machine (the webhook's payload): a stop's checkpoint named by its
        file or folder name (``stable_attn-stop-step=25.ckpt``, ``checkpoint-25``), not its local path.
        The evidence's lists are cut to :data:`~stable_attn.monitor.alerts.schema.REMOTE_CAPS` (docs/ALERTS.md).
        Returns ``self`` when there is nothing to change."""
        changes: dict[str, Any] = {}
        if self.checkpoint is not None:
            changes["checkpoint"] = checkpoint_name(self.checkpoint)
        caps = alert_schema.REMOTE_CAPS
        for name in ("lrs", "ranks", "loss_window"):
            value = getattr(self, name)
            if value is not None and len(value) > caps[name]:
                changes[name] = list(value[-caps[name]:] if name == "loss_window" else value[:caps[name]])
        for name, key in (("attention", "layers"), ("grad_norms", "top")):
            value = getattr(self, name)
            cap = caps[f"{name}.{key}"]
            if value is not None and len(value.get(key) or ()) > cap:
                changes[name] = {**value, key: list(value[key][:cap])}
        return replace(self, **changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict with the keys :attr:`FIELDS` of the alerts JSONL (non-finite floats as strings)."""
        data = {name: getattr(self, name) for name in self.FIELDS}
        for name in self.FLOAT_FIELDS:
            data[name] = _encode_float(data[name])
        data["layers"] = [[name, _encode_float(change)] for name, change in self.layers]
        for name in self.EVIDENCE_FIELDS:
            data[name] = json_safe(data[name])
        return data

    @classmethod
    def decode_fields(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of one alert's JSON object with the float encoding undone: each of :attr:`FLOAT_FIELDS`
        present and not None becomes a float (``"nan"``, ``"inf"``, ``"-inf"`` and the ``NaN``/``Infinity``
        literals of Python's ``json`` included); every other key, known or not, is kept as it is.
        ValueError or TypeError for a float field that holds no number."""
        decoded = dict(data)
        for name in cls.FLOAT_FIELDS:
            if name in decoded:
                decoded[name] = _decode_float(decoded[name])
        return decoded

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Alert:
        """Rebuild an alert from :meth:`to_dict` output (e.g. one parsed JSONL line). Keys that are no field of
        :class:`Alert` (a newer writer's) are left out."""
        kwargs = {k: v for k, v in cls.decode_fields(data).items() if k in cls.FIELDS}
        kwargs.setdefault("version", 1)  # a line without a version is a version-1 line
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
            # a fall (an entropy collapse) is flagged below its threshold
            head += f" {'<' if self.value < self.threshold else '>'} {_fmt(self.threshold)}"
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
        parts.extend(_short_evidence(self))
        if self.diagnosis:
            parts.append(_diagnosis_words(self.diagnosis))
        if self.message:
            parts.append(" ".join(self.message.split()))  # one line, whatever the caller passed
        if self.checkpoint is not None:
            parts.append(f"checkpoint {self.checkpoint}")
        return "; ".join(parts)

    def __str__(self) -> str:
        return self.format()


Alert.FIELDS = tuple(f.name for f in fields(Alert))
# The schema and the dataclass name the same fields (docs/ALERTS.md documents both).
assert set(Alert.FIELDS) == set(alert_schema.ALERT_SCHEMA["properties"]), "Alert and alert_schema disagree"

#: What every channel counts, in this order: ``delivered`` (the channel finished with the alert),
#: ``failed`` (it tried and the write, call or request failed), ``dropped`` (refused without trying:
#: the webhook's queue was full, or the channel was already closed) and ``abandoned`` (accepted but
#: never finished: still queued or in flight when the channel closed, or handed over while a webhook
#: was paused after repeated failures).
DELIVERY_COUNTS = ("delivered", "failed", "dropped", "abandoned")

#: Seconds an ``on_alert`` callable may take before :class:`CallableChannel` warns (once per callable):
#: callables run on the training thread, so a slow one delays the step that alerted.
SLOW_CALLABLE_S = 0.1


class AlertChannel:
    """Where alerts go. Subclasses implement :meth:`send`; :meth:`flush` and :meth:`close` default to no-ops.

    ``send`` may raise: :meth:`deliver` (what :class:`AlertDispatcher` calls) counts the alert as
    ``failed`` and re-raises, the dispatcher logs it. A channel that does slow work (the webhook) must
    not block the caller: it sets ``asynchronous = True``, overrides :meth:`deliver` and counts its
    alerts itself. The counts are those of :data:`DELIVERY_COUNTS`.
    """

    asynchronous = False
    delivered = 0
    failed = 0
    dropped = 0
    abandoned = 0
    #: short text of the latest failure (no secrets: file paths are fine, webhook paths never appear)
    last_failure: str | None = None

    def send(self, alert: Alert) -> None:
        raise NotImplementedError

    def deliver(self, alert: Alert) -> None:
        """:meth:`send` and count the outcome (an exception is counted, then re-raised)."""
        try:
            self.send(alert)
        except Exception as exc:
            self.failed += 1
            self.last_failure = _describe_exception(exc)
            raise
        self.delivered += 1

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued alerts are delivered (or failed); True if nothing is left pending."""
        return True

    def close(self) -> None:
        """Release resources; later sends are dropped."""

    def describe(self) -> str:
        """What the channel is, for log lines and summaries (never a secret)."""
        return type(self).__name__

    def counts(self) -> dict[str, int]:
        """The :data:`DELIVERY_COUNTS` of this channel so far."""
        return {name: int(getattr(self, name)) for name in DELIVERY_COUNTS}


def _describe_exception(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc)
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


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

    def describe(self) -> str:
        return f"log (logger {self.logger.name!r})"


class JsonlChannel(AlertChannel):
    """Appends one JSON object per alert to ``path`` (see the module docstring for the encoding).

    Synchronous: the file is opened, written in full and closed within ``send``, so each alert is in
    the file (the OS's page cache) when ``send`` returns, even if training dies right after, and no
    handle is held between the (rare) alerts. Parent directories are created on the first alert. A
    failed write (disk full, read-only file system, a folder at ``path``) raises, is counted ``failed``
    and logged by the dispatcher with the file's path; a line that a failed write left cut short is
    ended before the next alert is appended, so every later line still parses.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {path!r}")
        self.path = Path(path)
        self._lock = threading.Lock()

    def send(self, alert: Alert) -> None:
        data = (alert.to_json() + "\n").encode("utf-8")
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Unbuffered: a write error surfaces here, not in a later flush or close.
            with open(self.path, "a+b", buffering=0) as f:
                if f.seek(0, os.SEEK_END) > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        data = b"\n" + data
                view = memoryview(data)
                while view:
                    written = f.write(view)
                    if not written:
                        raise OSError(errno.EIO, f"no bytes written to {self.path}")
                    view = view[written:]

    def describe(self) -> str:
        return f"alerts file {self.path}"

    def __repr__(self) -> str:
        return f"JsonlChannel({str(self.path)!r})"


def callable_name(fn: Any) -> str:
    """``module.qualname`` of a function or method, else its ``repr`` (for log lines)."""
    qualname = getattr(fn, "__qualname__", None)
    if qualname is None:
        return repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


class CallableChannel(AlertChannel):
    """Calls ``fn(alert)`` for each alert (e.g. a user's ``on_alert`` hook), on the caller's thread.

    The call is synchronous (the alert reaches ``fn`` before training goes on, in order), so a slow
    ``fn`` delays the training step that alerted: when one call takes longer than ``budget`` seconds
    (default :data:`SLOW_CALLABLE_S`), a WARNING naming ``fn`` says so, once per channel. Hand slow
    work (network, disk) to a thread of your own, or use :class:`WebhookChannel`, which never blocks.
    """

    def __init__(self, fn: Callable[[Alert], Any], budget: float = SLOW_CALLABLE_S) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable (it receives the Alert), got {fn!r}")
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget < math.inf:
            raise ValueError(f"budget={budget!r} is not supported; use a finite number of seconds > 0")
        self.fn = fn
        self.budget = float(budget)
        self._warned_slow = False

    def send(self, alert: Alert) -> None:
        start = time.perf_counter()
        try:
            self.fn(alert)
        finally:
            took = time.perf_counter() - start
            if took > self.budget and not self._warned_slow:
                self._warned_slow = True
                logger.warning(
                    "on_alert callable %s took %.2f s on the alert at step %s (budget %.2g s): alert callables run "
                    "on the training thread and delay the step; hand slow work to a thread, or use a webhook "
                    "(warned once)", callable_name(self.fn), took, alert.step, self.budget)

    def describe(self) -> str:
        return f"on_alert callable {callable_name(self.fn)}"

    def __repr__(self) -> str:
        return f"CallableChannel({callable_name(self.fn)!r})"


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
        """Hand ``alert`` to every channel; return how many accepted it without raising."""
        if not isinstance(alert, Alert):
            raise TypeError(f"alert must be an Alert, got {alert!r}")
        self.emitted += 1
        accepted = 0
        for channel in self.channels:
            try:
                channel.deliver(alert)
                accepted += 1
            except Exception as exc:  # a channel must never crash training
                self.errors += 1
                key = (id(channel), type(exc).__name__)
                level = logging.DEBUG if key in self._reported else logging.WARNING
                self._reported.add(key)
                logger.log(level, "alert channel %s failed on the alert at step %s: %s (alerts keep going to the "
                           "other channels)", _describe(channel), alert.step, _describe_exception(exc))
        return accepted

    def flush(self, timeout: float | None = None) -> bool:
        """Flush every channel (each gets up to ``timeout``); True if all are drained."""
        return all([self._safe(channel.flush, timeout) for channel in self.channels])

    def close(self, timeout: float | None = None) -> None:
        """Close every channel, within ``timeout`` seconds in all (None: each asynchronous channel
        takes its own default, one request timeout for a webhook). Queued alerts not delivered by then
        are counted ``abandoned``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for channel in self.channels:
            if channel.asynchronous:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._safe(channel.close, left)
            else:
                self._safe(channel.close)

    def delivery(self) -> dict[str, dict[str, int]]:
        """``{channel description: its DELIVERY_COUNTS}`` (a repeated description gets `` #2``, ...)."""
        out: dict[str, dict[str, int]] = {}
        for channel in self.channels:
            name = _describe(channel)
            key, n = name, 1
            while key in out:
                n += 1
                key = f"{name} #{n}"
            out[key] = _counts(channel)
        return out

    def log_summary(self, when: str = "at the end of the run") -> None:
        """One line per channel: a WARNING naming each channel that did not deliver every alert (with
        the counts and the last failure), INFO for the others."""
        for channel in self.channels:
            counts = _counts(channel)
            total = sum(counts.values())
            lost = total - counts["delivered"]
            level = logging.WARNING if lost else logging.INFO
            line = f"stable_attn alerts {when}: {_describe(channel)} delivered {counts['delivered']} of {total}"
            if lost:
                line += (f"; not delivered: {counts['failed']} failed, {counts['dropped']} dropped (queue full or "
                         f"closed), {counts['abandoned']} abandoned (paused after repeated failures, or still "
                         "pending at close)")
                if channel.last_failure:
                    line += f"; last failure: {channel.last_failure}"
            logger.log(level, "%s", line)

    def _safe(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            result = fn(*args)
            return True if result is None else result
        except Exception as exc:  # flush/close must not raise either
            owner = getattr(fn, "__self__", None)
            logger.warning("alert channel %s: %s failed: %s", _describe(owner) if owner is not None else fn,
                           getattr(fn, "__name__", "call"), _describe_exception(exc))
            return False

    def __enter__(self) -> AlertDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe(channel: Any) -> str:
    try:
        return str(channel.describe())
    except Exception:  # a user channel's describe must not break logging either
        return type(channel).__name__


def _counts(channel: Any) -> dict[str, int]:
    try:
        return channel.counts()
    except Exception:
        return dict.fromkeys(DELIVERY_COUNTS, 0)
