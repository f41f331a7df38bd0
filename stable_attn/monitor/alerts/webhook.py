"""The webhook channel: each alert POSTed as JSON to one URL, from a background thread.

What the request holds: ``POST`` to the URL's path and query, headers ``Content-Type:
application/json``, ``User-Agent: stable_attn-alerts`` and the caller's ``headers``, and a body that
is ``payload(alert)`` as JSON; by default :meth:`Alert.to_dict`, the keys of :attr:`Alert.FIELDS`:
``step``, ``kind``, ``metric``, ``value``, ``baseline``, ``threshold``, ``score``, ``lr``, ``layers``
(layer names and changes), ``action``, ``message``, ``checkpoint`` (a file or folder name) and ``time``, and
the evidence of schema version 2 with its lists capped (docs/ALERTS.md,
:data:`~stable_attn.monitor.alerts.schema.REMOTE_CAPS`): no data, no weights, no file paths beyond what
a user's own message holds.

Where it goes, and nowhere else: a direct connection to the URL's host and port (``http.client``: no
proxy from the environment, no redirect followed; a 3xx answer counts as a failure with its status),
so the headers (a token) reach that host only. Log lines, summaries and ``repr`` name the scheme, host
and port, never the path or query (webhook paths often hold a secret).

Time: ``send`` only enqueues. Each connect and each read has ``timeout`` seconds. After
``max_failures`` failures in a row the endpoint is paused for ``pause`` seconds (alerts handed over
meanwhile are counted ``abandoned``), then tried again. :meth:`WebhookChannel.close` returns within
``timeout`` seconds (plus a short grace to join the thread), whatever the server does: what is still
queued is abandoned and a request in flight is cut off (its socket shut down); the thread has ended
when ``close`` returns, except in a name (DNS) lookup, which no socket call can interrupt (a WARNING
then says so; the thread posts nothing more).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import queue
import re
import selectors
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from .alert import Alert, AlertChannel

__all__ = ["MAX_TIMEOUT_S", "WebhookChannel", "check_headers", "check_timeout", "check_url"]

logger = logging.getLogger("stable_attn")

#: The longest ``timeout`` accepted (seconds): the end of a run waits up to one timeout for the webhook.
MAX_TIMEOUT_S = 60.0
# Joining the worker after its socket was shut down takes milliseconds; this bounds it.
_JOIN_GRACE_S = 0.5
# The connect loop looks at the closed flag this often (seconds).
_CONNECT_POLL_S = 0.05
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_STOP = object()


def _safe_url(parsed: urllib.parse.SplitResult) -> str:
    host = parsed.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{parsed.scheme}://{host}{f':{parsed.port}' if parsed.port else ''}"


def printable(text: str) -> str:
    """``text`` with every non-printable character (control characters, line breaks) escaped as Python
    writes it (``\\n``, ``\\x1b``): what a server or a socket says goes into one log line as it is, nothing more."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown_url(url: str) -> str:
    """``url`` as an error message may show it: scheme, host and port (credentials as ``***@``), and
    ``/...`` in place of any path, query or fragment (webhook paths often hold a secret); non-printable
    characters escaped. Works on text that is no URL at all (no scheme: the part before the first ``/``,
    ``?`` or ``#``, usually the host)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return printable(f"{scheme}{sep}{netloc}{'/...' if tail.strip('/') else tail}")


def check_url(url: Any, name: str = "url") -> urllib.parse.SplitResult:
    """The parsed ``url`` if a webhook can POST to it; else ValueError/TypeError naming ``name``. The
    messages show the URL through :func:`shown_url`: never its path or query."""
    accepted = "an http:// or https:// URL with a host, in ASCII, without spaces, control characters or credentials"
    if not isinstance(url, str):
        raise TypeError(f"{name} is a {type(url).__name__}, which is not supported; use {accepted}")
    shown = shown_url(url)
    bad = next((c for c in url if ord(c) < 33 or ord(c) == 127), None)
    if bad is not None:
        what = "a space" if bad == " " else f"the control character {bad!r}"
        raise ValueError(f"{name}={shown!r} is not supported: it contains {what}; use {accepted} "
                         "(percent-encode a space as %20)")
    if not url.isascii():
        raise ValueError(f"{name}={shown!r} is not supported: it contains non-ASCII characters; use {accepted} "
                         "(percent-encode the path, use the IDNA form of the host)")
    try:
        parsed = urllib.parse.urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed [ of an IPv6 host
        raise ValueError(f"{name}={shown!r} is not supported: {exc}; use {accepted}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{name} must be an http:// or https:// URL with a host, got {shown!r}")
    if parsed.username is not None or parsed.password is not None:
        raise ValueError(f"{name}={shown!r} is not supported: it holds credentials (user:password@), which are "
                         "never sent; use " + accepted + " and pass the credentials as a header "
                         "(e.g. Authorization)")
    try:
        parsed.port  # noqa: B018 - raises on a port that is not a number in 0..65535
    except ValueError as exc:
        raise ValueError(f"{name}={shown!r} is not supported: {exc}; use {accepted}") from None
    return parsed


def check_timeout(timeout: Any, name: str = "timeout") -> float:
    """``timeout`` as a float if it is a number of seconds in (0, MAX_TIMEOUT_S]; else ValueError."""
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout)
            or not 0 < timeout <= MAX_TIMEOUT_S):
        raise ValueError(f"{name}={timeout!r} is not supported; use a number of seconds in (0, {MAX_TIMEOUT_S:g}] "
                         "(the end of a run waits up to one timeout for the webhook)")
    return float(timeout)


def check_headers(headers: Any, name: str = "headers") -> dict[str, str]:
    """``headers`` as a dict of HTTP header names to values; else an error naming the header (never
    its value, which is often a token)."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise TypeError(f"{name} must be a mapping of header names to str values or None, got a "
                        f"{type(headers).__name__}")
    out = {}
    for key, value in headers.items():
        if not isinstance(key, str) or not _HEADER_NAME.match(key):
            raise ValueError(f"{name} holds the header name {key!r}, which is not an HTTP token; use letters, "
                             "digits and -")
        if not isinstance(value, str):
            raise TypeError(f"{name}[{key!r}] is a {type(value).__name__}; use a str")
        if any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in value) or not value.isascii():
            raise ValueError(f"{name}[{key!r}] holds a control character or non-ASCII text (value not shown); "
                             "use printable ASCII")
        out[key] = value
    return out


class WebhookChannel(AlertChannel):
    """POSTs each alert as JSON to ``url`` from a background daemon thread (see the module docstring
    for what the request holds, where it goes, and how long anything may take).

    ``send`` only enqueues (a bounded queue of ``max_queue`` alerts; when full, the alert is dropped),
    so training never waits on the network. Each alert is counted (:attr:`counts`): ``delivered`` (a
    2xx answer), ``failed`` (connection error, timeout, a non-2xx status, 3xx included), ``dropped``
    (queue full, or sent after close) and ``abandoned`` (given up at close or during a pause). Each kind
    of failure is logged at WARNING once (later ones at DEBUG); nothing is ever raised. Call
    :meth:`flush` to wait for delivery (tests) and :meth:`close` at the end of the run.

    Args:
        url: ``http://`` or ``https://`` endpoint (see :func:`check_url`).
        timeout: seconds for each connect and each read, in (0, :data:`MAX_TIMEOUT_S`]; also how
            long :meth:`close` waits for queued alerts.
        max_queue: alerts waiting for delivery before new ones are dropped.
        headers: extra HTTP headers (e.g. ``{"Authorization": "Bearer ..."}``), sent to ``url``'s host
            only.
        payload: maps an alert to the JSON body; default :meth:`Alert.to_dict`. It is given the alert as it
            may leave the machine (:meth:`Alert.for_remote`: a stop's checkpoint by file name, not local path).
            For a Slack-style incoming webhook use ``payload=lambda a: {"text": a.format()}``.
        max_failures: failures in a row after which the endpoint is paused.
        pause: seconds the endpoint is paused for.
    """

    asynchronous = True

    def __init__(
        self,
        url: str,
        timeout: float = 2.0,
        *,
        max_queue: int = 64,
        headers: Mapping[str, str] | None = None,
        payload: Callable[[Alert], Any] | None = None,
        max_failures: int = 3,
        pause: float = 60.0,
    ) -> None:
        parsed = check_url(url)
        self.timeout = check_timeout(timeout)
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an int >= 1, got {max_queue!r}")
        if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 1:
            raise ValueError(f"max_failures={max_failures!r} is not supported; use an int >= 1")
        if isinstance(pause, bool) or not isinstance(pause, (int, float)) or not 0 <= pause < math.inf:
            raise ValueError(f"pause={pause!r} is not supported; use a finite number of seconds >= 0")
        if payload is not None and not callable(payload):
            raise TypeError(f"payload must be callable (Alert -> JSON-serialisable object), got {payload!r}")
        self.url = url
        self._safe_url = _safe_url(parsed)
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname or ""
        self._port = parsed.port
        self._target = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
        # Failure texts come from sockets and servers; none should contain the path, but make sure.
        self._secrets = [s for s in (parsed.path, parsed.query, self._target) if len(s) > 1]
        self.headers = {"Content-Type": "application/json", "User-Agent": "stable_attn-alerts"}
        self.headers.update(check_headers(headers))
        self.payload = payload or Alert.to_dict
        self.max_failures = max_failures
        self.pause = float(pause)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._pending = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._conn: http.client.HTTPConnection | None = None
        self._streak = 0
        self._paused_until = 0.0
        self._reported: set[str] = set()

    # ------------------------------------------------------------------ caller's side
    def send(self, alert: Alert) -> None:
        # the message without local paths (a stop names its checkpoint by file name): the payload leaves the machine
        body = json.dumps(self.payload(alert.for_remote()), allow_nan=False).encode("utf-8")
        with self._cond:
            if self._closed:
                self.dropped += 1
                self._report("closed", "webhook %s is closed; the alert at step %s is dropped", self._safe_url,
                             alert.step)
                return
            self._start()
            try:
                self._queue.put_nowait(body)
            except queue.Full:
                self.dropped += 1
                self._report("queue full", "webhook %s is behind (queue of %d full); the alert at step %s is "
                             "dropped (counted)", self._safe_url, self._queue.maxsize, alert.step)
                return
            self._pending += 1

    def deliver(self, alert: Alert) -> None:
        """Enqueue; the worker thread counts the outcome (the caller never waits for it)."""
        self.send(alert)

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
        """Wait up to ``timeout`` seconds (default: the request timeout) for queued alerts, then
        abandon the rest, cut off a request in flight and end the thread. Later sends are dropped."""
        wait = self.timeout if timeout is None else max(0.0, float(timeout))
        deadline = time.monotonic() + wait
        with self._cond:
            if self._closed:
                return
        self.flush(wait)
        with self._cond:
            self._closed = True
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    self._settle("abandoned")
            conn = self._conn
        if conn is not None and conn.sock is not None:
            try:  # the base method: also for a TLS socket, whose own shutdown is not thread-safe
                socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
            except OSError:
                pass
        thread = self._thread
        if thread is None:
            return
        self._queue.put_nowait(_STOP)  # emptied above, and nothing is enqueued once closed
        thread.join(max(0.0, deadline - time.monotonic()) + _JOIN_GRACE_S)
        if thread.is_alive():
            logger.warning("webhook %s: the sender thread is still blocked (a name lookup cannot be interrupted); "
                           "it sends nothing more and ends when the lookup returns", self._safe_url)

    def describe(self) -> str:
        return f"webhook {self._safe_url}"

    def __repr__(self) -> str:
        return f"WebhookChannel({self._safe_url + '/...'!r}, timeout={self.timeout!r})"

    # ------------------------------------------------------------------ worker thread
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="stable_attn-webhook", daemon=True)
            self._thread.start()

    def _worker(self) -> None:
        while True:
            body = self._queue.get()
            if body is _STOP:
                return
            with self._cond:
                skip = self._closed or time.monotonic() < self._paused_until
            if skip:
                self._settle("abandoned")
                continue
            try:
                status = self._post(body)
            except Exception as exc:  # every failure is counted and logged, none may escape
                if self._closed:
                    self._settle("abandoned")  # cut off by close()
                else:
                    self._failed(type(exc).__name__, printable(self._scrub(_failure_text(exc))))
                continue
            if 200 <= status < 300:
                self._streak = 0
                self._settle("delivered")
            elif 300 <= status < 400:
                self._failed(f"HTTP {status}", f"HTTP {status} (a redirect: not followed, so the alert and the "
                             "headers go to no other host)")
            else:
                self._failed(f"HTTP {status}", f"HTTP {status}")

    def _post(self, body: bytes) -> int:
        if self._https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                self._host, self._port, timeout=self.timeout, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        conn._create_connection = self._connect  # type: ignore[attr-defined] # an abortable connect
        with self._cond:
            if self._closed:
                raise ConnectionAbortedError("closed")
            self._conn = conn
        try:
            conn.connect()
            if self._closed:
                raise ConnectionAbortedError("closed")
            conn.request("POST", self._target, body=body, headers=self.headers)
            return conn.getresponse().status
        finally:
            with self._cond:
                self._conn = None
            conn.close()

    def _connect(self, address: tuple[str, int], timeout: float, source_address: Any = None) -> socket.socket:
        """``socket.create_connection`` that gives up as soon as the channel closes (a connect to a host
        that drops packets would otherwise block close() for a whole timeout)."""
        error: OSError | None = None
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(*address, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                code = sock.connect_ex(sockaddr)
                deadline = time.monotonic() + timeout
                with selectors.DefaultSelector() as sel:
                    sel.register(sock, selectors.EVENT_WRITE)
                    while code != 0:
                        if self._closed:
                            raise ConnectionAbortedError("closed")
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TimeoutError("timed out")
                        if sel.select(min(left, _CONNECT_POLL_S)):
                            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                            if code:
                                raise OSError(code, os.strerror(code))
                sock.settimeout(timeout)
                return sock
            except OSError as exc:
                sock.close()
                error = exc
        raise error if error is not None else OSError("no address found")

    def _settle(self, outcome: str) -> None:
        with self._cond:
            setattr(self, outcome, getattr(self, outcome) + 1)
            self._pending -= 1
            self._cond.notify_all()

    def _failed(self, kind: str, text: str) -> None:
        self.last_failure = text
        self._report(kind, "webhook %s failed: %s (alerts keep going to the other channels)", self._safe_url, text)
        self._streak += 1
        if self._streak >= self.max_failures:
            self._streak = 0
            with self._cond:
                self._paused_until = time.monotonic() + self.pause
            self._report("paused", "webhook %s failed %d times in a row; paused for %g s (alerts meanwhile are "
                         "counted abandoned)", self._safe_url, self.max_failures, self.pause)
        self._settle("failed")

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "/...")
        return text

    def _report(self, kind: str, msg: str, *args: Any) -> None:
        if kind in self._reported:
            logger.debug(msg, *args)
        else:
            self._reported.add(kind)
            logger.warning(msg, *args)


def _failure_text(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    text = str(exc)
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
