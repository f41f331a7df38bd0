"""The callback's alert channels: its arguments checked up front, the channels built, closed and counted.

One place for what :class:`~stable_attn.callbacks.StableAttentionCallback` does with ``on_alert``,
``webhook_url``, ``webhook_timeout``, ``webhook_headers`` and ``alerts_file``, so that every argument
that cannot work is refused at construction (naming the argument, its value and what is accepted),
and the end of a run, normal or not, closes the channels within one webhook timeout and says what
was not delivered.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .alert import DELIVERY_COUNTS, Alert, AlertDispatcher, CallableChannel, JsonlChannel, LoggingChannel
from .webhook import WebhookChannel, check_headers, check_timeout, check_url

__all__ = ["add_counts", "build_dispatcher", "check_alerts_file", "check_on_alert", "check_webhook", "close_dispatcher"]

Counts = dict[str, dict[str, int]]


def check_on_alert(on_alert: Any) -> list[Callable[[Alert], Any]]:
    """``on_alert`` as a list of callables (None: none); TypeError naming what is not callable."""
    if on_alert is None:
        return []
    if callable(on_alert):
        return [on_alert]
    if isinstance(on_alert, (str, bytes)):  # iterable, but its letters are not callables
        raise TypeError(f"on_alert={on_alert!r} is not supported; use a callable (e.g. print, not 'print'), "
                        "a list of callables or None")
    try:
        callbacks = list(on_alert)
    except TypeError:
        raise TypeError(f"on_alert={on_alert!r} is not supported; use a callable, a list of callables "
                        "or None") from None
    for fn in callbacks:
        if not callable(fn):
            raise TypeError(f"on_alert holds {fn!r}, which is not callable; each entry receives the Alert")
    return callbacks


def check_alerts_file(alerts_file: Any) -> None:
    """A plain file name (written in the run's log directory) or None; else ValueError."""
    if alerts_file is None:
        return
    plain = (isinstance(alerts_file, str) and alerts_file not in ("", ".", "..")
             and os.path.basename(alerts_file) == alerts_file
             and not any(sep and sep in alerts_file for sep in (os.sep, os.altsep, "/"))
             and all(ord(c) >= 32 and ord(c) != 127 for c in alerts_file))
    if not plain:
        raise ValueError(f"alerts_file={alerts_file!r} is not supported; use a plain file name such as "
                         "'stable_attn_alerts.jsonl' (it is written in the run's log directory; no folder, "
                         "'.', '..' or control characters) or None")
    try:
        size, limit = len(os.fsencode(alerts_file)), _name_max(os.getcwd())
    except UnicodeEncodeError:
        raise ValueError(f"alerts_file={alerts_file!r} is not supported: the file system cannot encode it "
                         f"({sys.getfilesystemencoding()}); use a plain file name") from None
    if size > limit:  # the file would never open: every alert written to it would fail
        raise ValueError(f"alerts_file={alerts_file[:40]!r}... is {size} bytes long; file names hold at most "
                         f"{limit} bytes on this file system")


def _name_max(directory: str) -> int:
    """The longest file name, in bytes, the file system of ``directory`` takes (255, the common limit, where
    it cannot tell)."""
    try:
        limit = os.pathconf(directory, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):  # no pathconf (Windows), or no answer for this file system
        return 255
    return min(255, limit) if limit > 0 else 255  # -1: no limit known


def check_webhook(url: Any, timeout: Any, headers: Any) -> tuple[float, dict[str, str]]:
    """Check ``webhook_url``, ``webhook_timeout`` and ``webhook_headers``; return the timeout and headers."""
    if url is not None:
        check_url(url, "webhook_url")
    timeout = check_timeout(timeout, "webhook_timeout")
    checked = check_headers(headers, "webhook_headers")
    if checked and url is None:
        raise ValueError("webhook_headers are sent with each webhook request, and webhook_url is None; "
                         "give webhook_url too, or leave webhook_headers out")
    return timeout, checked


def build_dispatcher(log_dir: str, alerts_file: str | None, on_alert: Iterable[Callable[[Alert], Any]],
                     webhook_url: str | None, webhook_timeout: float,
                     webhook_headers: Mapping[str, str]) -> AlertDispatcher:
    """The log line, the JSONL file, each callable and the webhook, in that order."""
    channels: list[Any] = [LoggingChannel()]
    if alerts_file is not None:
        channels.append(JsonlChannel(os.path.join(log_dir, alerts_file)))
    channels.extend(CallableChannel(fn) for fn in on_alert)
    if webhook_url is not None:
        channels.append(WebhookChannel(webhook_url, timeout=webhook_timeout, headers=webhook_headers))
    return AlertDispatcher(channels)


def close_dispatcher(dispatcher: AlertDispatcher, timeout: float, when: str) -> Counts:
    """Close every channel within ``timeout`` seconds in all, log one line per channel (a WARNING for
    each that did not deliver everything) and return the counts."""
    dispatcher.close(timeout=timeout)
    dispatcher.log_summary(when)
    return dispatcher.delivery()


def add_counts(a: Counts, b: Counts) -> Counts:
    """Per-channel counts of ``a`` and ``b`` added (e.g. a resumed run's to the checkpoint's)."""
    out = {name: dict(counts) for name, counts in a.items()}
    for name, counts in b.items():
        mine = out.setdefault(name, dict.fromkeys(DELIVERY_COUNTS, 0))
        for key in DELIVERY_COUNTS:
            mine[key] = int(mine.get(key, 0)) + int(counts.get(key, 0))
    return out
