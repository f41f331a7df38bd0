"""Alerts and their channels: log line, JSONL file, callables, webhook (local HTTP server), dispatcher."""

from __future__ import annotations

import contextlib
import errno
import http.server
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from stable_attn.monitor import (
    Alert,
    AlertChannel,
    AlertDispatcher,
    CallableChannel,
    JsonlChannel,
    LoggingChannel,
    SpikeEvent,
    WebhookChannel,
)
from stable_attn.monitor.alerts import alert as alerts_module
from stable_attn.monitor.alerts.webhook import MAX_TIMEOUT_S


def make_alert(**overrides) -> Alert:
    fields = dict(
        step=1234,
        kind="spike",
        metric="train/loss",
        value=5.25,
        baseline=3.18,
        threshold=3.35,
        score=41.3,
        lr=3e-4,
        layers=[("layer1", 0.02), ("layer3", -0.21), ("layer7", 0.05)],
        action="warn",
        message="",
        time=1_700_000_000.5,
    )
    fields.update(overrides)
    return Alert(**fields)


def strict_json(line: str) -> dict:
    def reject(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(line, parse_constant=reject)


# --------------------------------------------------------------------------- Alert


def test_alert_sorts_layers_and_round_trips_through_strict_json() -> None:
    alert = make_alert(
        value=math.nan, baseline=math.inf, threshold=-math.inf, score=math.inf, lr=None, kind="nonfinite"
    )
    assert [name for name, _ in alert.layers] == ["layer3", "layer7", "layer1"]
    data = strict_json(alert.to_json())
    assert data["value"] == "nan" and data["baseline"] == "inf" and data["threshold"] == "-inf"
    assert data["lr"] is None
    assert data["layers"] == [["layer3", -0.21], ["layer7", 0.05], ["layer1", 0.02]]
    assert set(data) == {
        "step", "kind", "metric", "value", "baseline", "threshold", "score", "lr", "layers", "action", "message",
        "checkpoint", "time",
        # schema version 2: the evidence (docs/ALERTS.md), null when the alert was not built by the engine
        "version", "data_position", "lrs", "world_size", "ranks", "loss_window", "attention", "grad_norms", "outcome",
        "diagnosis",
    }
    assert data["version"] == 2 and all(data[k] is None for k in Alert.EVIDENCE_FIELDS)
    back = Alert.from_dict(data)
    assert math.isnan(back.value) and back.baseline == math.inf and back.threshold == -math.inf
    assert back.layers == alert.layers and back.time == alert.time and back.lr is None


def test_alert_format_is_one_readable_line() -> None:
    line = make_alert(message="loss jumped\nafter data shard 17").format()
    assert "\n" not in line
    for part in ("spike at step 1234", "train/loss=5.25", "> 3.35", "baseline 3.18", "41.3 sigma", "lr 0.0003",
                 "layer3 -0.21", "action warn", "loss jumped after data shard 17"):
        assert part in line, (part, line)
    nonfinite = make_alert(kind="nonfinite", value=math.nan, score=math.inf).format()
    assert "train/loss=nan" in nonfinite and ">" not in nonfinite.split(";")[0]


def test_alert_validation_and_from_event() -> None:
    with pytest.raises(ValueError, match="kind"):
        make_alert(kind="oops")
    with pytest.raises(TypeError, match="layers"):
        make_alert(layers=["layer0"])
    event = SpikeEvent(7, "train/grad_norm", 9.0, 1.0, 1.5, 30.0, "spike", rule="drift")
    alert = Alert.from_event(event, lr=1e-3, layers=[("layer0", 0.1)], action="skip")
    assert (alert.step, alert.kind, alert.metric, alert.value, alert.lr, alert.action) == (
        7, "spike", "train/grad_norm", 9.0, 1e-3, "skip")
    assert "drift" in alert.message
    assert abs(alert.time - time.time()) < 60


# ------------------------------------------------------------------------ channels


def test_logging_channel_writes_one_warning_line(caplog: pytest.LogCaptureFixture) -> None:
    alert = make_alert()
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        LoggingChannel().send(alert)
    records = [r for r in caplog.records if r.name == "stable_attn"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING and records[0].getMessage() == alert.format()


def test_jsonl_channel_appends_one_object_per_alert(tmp_path) -> None:
    path = tmp_path / "run" / "alerts.jsonl"  # parent created on demand
    channel = JsonlChannel(path)
    first = make_alert()
    second = make_alert(step=1300, kind="nonfinite", value=math.inf, score=math.inf, layers=[])
    channel.send(first)
    assert len(path.read_text().splitlines()) == 1  # on disk as soon as send returns
    channel.send(second)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    rows = [strict_json(line) for line in lines]
    assert rows[0] == first.to_dict()
    assert rows[1]["step"] == 1300 and rows[1]["kind"] == "nonfinite" and rows[1]["value"] == "inf"
    assert Alert.from_dict(rows[0]).format() == first.format()


def test_callable_channel_and_dispatcher_survive_a_raising_callable(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    received: list[Alert] = []

    def broken(alert: Alert) -> None:
        raise RuntimeError("user hook bug")

    dispatcher = AlertDispatcher([broken, CallableChannel(received.append), JsonlChannel(tmp_path / "a.jsonl")])
    with caplog.at_level(logging.DEBUG, logger="stable_attn"):
        assert dispatcher.emit(make_alert(step=1)) == 2
        assert dispatcher.emit(make_alert(step=2)) == 2
    assert [a.step for a in received] == [1, 2]
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 2
    assert dispatcher.emitted == 2 and dispatcher.errors == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "user hook bug" in r.getMessage()]
    assert len(warnings) == 1  # once per channel and failure kind; the repeat goes to DEBUG
    with pytest.raises(TypeError, match="channels"):
        AlertDispatcher([42])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="fn"):
        CallableChannel("print")  # type: ignore[arg-type]


def test_dispatcher_flush_and_close_never_raise(caplog: pytest.LogCaptureFixture) -> None:
    class Faulty(AlertChannel):
        def send(self, alert: Alert) -> None:
            pass

        def flush(self, timeout: float | None = None) -> bool:
            raise OSError("disk gone")

        def close(self) -> None:
            raise OSError("disk gone")

    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        with AlertDispatcher([Faulty()]) as dispatcher:
            assert dispatcher.flush(0.1) is False
    assert sum("disk gone" in r.getMessage() for r in caplog.records) == 2


# ----------------------------------------------------------------- file and callable faults


def _read_only_path(tmp_path):
    """A file path inside a folder nobody may write to, or None. chmod does not stop root; sysfs
    refuses new files even to root."""
    if os.geteuid() != 0:
        folder = tmp_path / "read_only"
        folder.mkdir()
        folder.chmod(0o555)
        return folder / "alerts.jsonl"
    probe = "/sys/stable_attn_probe.jsonl"
    try:
        with open(probe, "ab"):
            pass
    except OSError:
        return probe
    os.remove(probe)
    return None


def _refuse_opening(monkeypatch, path, error: OSError) -> None:
    """Where the OS offers no such fault, the alerts module's ``open`` raises it for ``path`` only."""
    real_open = open

    def fake_open(file, *args, **kwargs):
        if str(file) == str(path):
            raise error
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(alerts_module, "open", fake_open, raising=False)


@pytest.mark.parametrize("fault", ["folder", "full", "read_only"])
def test_jsonl_write_faults_are_counted_and_name_the_file(fault, tmp_path, caplog, monkeypatch) -> None:
    if fault == "folder":
        path = tmp_path / "a_folder.jsonl"
        path.mkdir()
    elif fault == "full":
        path = "/dev/full"
        if not os.path.exists(path):
            _refuse_opening(monkeypatch, path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path))
    else:
        path = _read_only_path(tmp_path)
        if path is None:
            path = tmp_path / "alerts.jsonl"
            _refuse_opening(monkeypatch, path, PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path)))
    received: list[Alert] = []
    channel = JsonlChannel(path)
    dispatcher = AlertDispatcher([channel, received.append])
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        for step in range(3):
            assert dispatcher.emit(make_alert(step=step)) == 1  # the callable still gets every alert
        dispatcher.close()
        dispatcher.log_summary("at the end of fit()")
    assert len(received) == 3
    assert channel.counts() == {"delivered": 0, "failed": 3, "dropped": 0, "abandoned": 0}
    failures = [r.getMessage() for r in caplog.records if "failed on the alert" in r.getMessage()]
    assert len(failures) == 1 and str(path) in failures[0] and "object at 0x" not in failures[0]
    (summary,) = [r for r in caplog.records if "at the end of fit()" in r.getMessage() and "alerts file" in
                  r.getMessage()]
    assert summary.levelno == logging.WARNING
    assert f"alerts file {path} delivered 0 of 3" in summary.getMessage() and "3 failed" in summary.getMessage()


def test_jsonl_line_cut_short_by_a_failed_write_is_ended(tmp_path) -> None:
    path = tmp_path / "alerts.jsonl"
    path.write_text('{"step": 1, "kind": "spi')  # what a write that failed half-way leaves
    JsonlChannel(path).send(make_alert(step=2))
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and strict_json(lines[1])["step"] == 2


def test_slow_callable_warns_once_naming_it(caplog) -> None:
    def slow_hook(alert: Alert) -> None:
        time.sleep(0.06)

    channel = CallableChannel(slow_hook, budget=0.03)
    quick = CallableChannel(lambda alert: None, budget=0.03)
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        for step in range(3):
            AlertDispatcher([channel, quick]).emit(make_alert(step=step))
    slow = [r.getMessage() for r in caplog.records if "budget" in r.getMessage()]
    assert len(slow) == 1 and "slow_hook" in slow[0] and "training thread" in slow[0]
    assert channel.delivered == 3
    with pytest.raises(ValueError, match=r"budget=0 "):
        CallableChannel(print, budget=0)


def test_dispatcher_summary_is_info_when_everything_was_delivered(tmp_path, caplog) -> None:
    dispatcher = AlertDispatcher([LoggingChannel(), JsonlChannel(tmp_path / "a.jsonl"), lambda a: None])
    dispatcher.emit(make_alert())
    with caplog.at_level(logging.INFO, logger="stable_attn"):
        dispatcher.log_summary()
    lines = [r for r in caplog.records if "stable_attn alerts at the end" in r.getMessage()]
    assert len(lines) == 3 and all(r.levelno == logging.INFO and "delivered 1 of 1" in r.getMessage() for r in lines)
    delivery = dispatcher.delivery()
    assert list(delivery)[1] == f"alerts file {tmp_path / 'a.jsonl'}"
    assert all(c == {"delivered": 1, "failed": 0, "dropped": 0, "abandoned": 0} for c in delivery.values())


# ------------------------------------------------------------------------- webhook


class _Recorder(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append((self.path, dict(self.headers), body))  # type: ignore[attr-defined]
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        if self.server.location:  # type: ignore[attr-defined]
            self.send_header("Location", self.server.location)  # type: ignore[attr-defined]
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802 - a followed redirect would arrive as a GET
        self.server.received.append((self.path, dict(self.headers), b""))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def local_server(status: int = 200, location: str = "") -> Iterator[http.server.ThreadingHTTPServer]:
    """An HTTP server on 127.0.0.1 that records each request, stopped when the block ends."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.received = []  # type: ignore[attr-defined]
    server.status = status  # type: ignore[attr-defined]
    server.location = location  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def hanging_server() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections (the kernel's backlog) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


@contextlib.contextmanager
def unanswered_connect() -> Iterator[int]:
    """A port on 127.0.0.1 whose accept queue is full: a new connect gets no answer (SYNs dropped)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port), timeout=1.0)  # takes the one backlog place
    try:
        yield port
    finally:
        filler.close()
        listener.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _webhook_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "stable_attn-webhook"]


def test_webhook_posts_json_with_headers_to_a_local_server() -> None:
    with local_server() as server:
        url = f"http://127.0.0.1:{server.server_port}/hook"
        channel = WebhookChannel(url, timeout=2.0, headers={"Authorization": "Bearer T0KEN"})
        alerts = [make_alert(step=1), make_alert(step=2, kind="nonfinite", value=math.nan)]
        for alert in alerts:
            channel.deliver(alert)
        assert channel.flush(10.0)
        channel.close()
    assert channel.counts() == {"delivered": 2, "failed": 0, "dropped": 0, "abandoned": 0}
    assert [path for path, _, _ in server.received] == ["/hook", "/hook"]
    assert all(h["Content-Type"] == "application/json" and h["Authorization"] == "Bearer T0KEN"
               for _, h, _ in server.received)
    bodies = sorted((strict_json(body.decode()) for _, _, body in server.received), key=lambda b: b["step"])
    assert bodies == [a.to_dict() for a in alerts]
    assert not _webhook_threads()


@pytest.mark.parametrize("status", [302, 307])
def test_webhook_redirect_reaches_nobody(status, caplog) -> None:
    with local_server() as elsewhere:
        target = f"http://127.0.0.1:{elsewhere.server_port}/collect"
        with local_server(status=status, location=target) as server:
            channel = WebhookChannel(f"http://127.0.0.1:{server.server_port}/hook/SECRET", timeout=2.0,
                                     headers={"Authorization": "Bearer T0KEN"})
            with caplog.at_level(logging.WARNING, logger="stable_attn"):
                channel.send(make_alert())
                assert channel.flush(10.0)
                channel.close()
    assert len(server.received) == 1
    assert elsewhere.received == []  # neither the alert nor the header went to the redirect's host
    assert channel.counts() == {"delivered": 0, "failed": 1, "dropped": 0, "abandoned": 0}
    assert channel.last_failure.startswith(f"HTTP {status}")
    assert any(f"HTTP {status}" in r.getMessage() for r in caplog.records)
    assert "SECRET" not in caplog.text


def test_webhook_http_error_is_counted_and_logs_no_path(caplog) -> None:
    with local_server(status=500) as server:
        channel = WebhookChannel(f"http://127.0.0.1:{server.server_port}/T/SECRET?token=XYZ", timeout=2.0,
                                 payload=lambda a: {"text": a.format()})
        with caplog.at_level(logging.DEBUG, logger="stable_attn"):
            channel.send(make_alert())
            assert channel.flush(10.0)
            channel.close()
            AlertDispatcher([channel]).log_summary()
    assert channel.failed == 1 and channel.delivered == 0
    assert server.received[0][0] == "/T/SECRET?token=XYZ"
    assert strict_json(server.received[0][2].decode()) == {"text": make_alert().format()}
    assert any("HTTP 500" in r.getMessage() for r in caplog.records)
    assert "SECRET" not in caplog.text and "XYZ" not in caplog.text and "SECRET" not in repr(channel)
    assert f"webhook http://127.0.0.1:{server.server_port} delivered 0 of 1" in caplog.text


def test_unreachable_webhook_is_paused_after_repeated_failures(caplog) -> None:
    channel = WebhookChannel(f"http://127.0.0.1:{_closed_port()}/hook/SECRET-TOKEN", timeout=1.0, max_failures=3)
    dispatcher = AlertDispatcher([channel])
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        t0 = time.perf_counter()
        for step in range(5):
            assert dispatcher.emit(make_alert(step=step)) == 1  # the channel accepted it: no exception
        assert time.perf_counter() - t0 < 0.5  # sending never waits on the network
        assert channel.flush(10.0)
    dispatcher.close()
    assert channel.counts() == {"delivered": 0, "failed": 3, "dropped": 0, "abandoned": 2}
    failures = [r for r in caplog.records if "failed: ConnectionRefusedError" in r.getMessage()]
    assert len(failures) == 1  # once per failure kind
    assert sum("paused for 60 s" in r.getMessage() for r in caplog.records) == 1
    assert "SECRET-TOKEN" not in caplog.text and "SECRET-TOKEN" not in repr(channel)


def test_hanging_webhook_close_takes_one_timeout_and_counts_the_rest(caplog) -> None:
    with hanging_server() as port:
        channel = WebhookChannel(f"http://127.0.0.1:{port}/", timeout=0.3)
        for step in range(10):
            channel.send(make_alert(step=step))
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="stable_attn"):
            channel.close()
        took = time.monotonic() - t0
        assert not _webhook_threads()  # the thread ended with close()
    assert took < 0.3 + 0.4, took  # one timeout, plus the join of a thread whose socket was shut down
    counts = channel.counts()
    assert counts["delivered"] == 0 and sum(counts.values()) == 10 and counts["abandoned"] >= 8, counts
    channel.send(make_alert(step=99))  # after close: counted, not raised
    assert channel.dropped == 1


def test_https_to_a_plain_http_server_fails_cleanly(caplog) -> None:
    with local_server() as server:  # speaks HTTP, so the TLS handshake fails
        channel = WebhookChannel(f"https://127.0.0.1:{server.server_port}/hook/SECRET", timeout=2.0)
        with caplog.at_level(logging.WARNING, logger="stable_attn"):
            channel.send(make_alert())
            assert channel.flush(10.0)
            channel.close()
    assert channel.counts() == {"delivered": 0, "failed": 1, "dropped": 0, "abandoned": 0}
    assert channel.describe() == f"webhook https://127.0.0.1:{server.server_port}"
    assert "SSL" in channel.last_failure and "SECRET" not in caplog.text


def test_connect_that_gets_no_answer_is_cut_off_at_close() -> None:
    with unanswered_connect() as port:
        channel = WebhookChannel(f"http://127.0.0.1:{port}/", timeout=MAX_TIMEOUT_S)
        channel.send(make_alert())
        time.sleep(0.05)  # the worker is inside connect()
        t0 = time.monotonic()
        channel.close(timeout=0.1)
        took = time.monotonic() - t0
        assert not _webhook_threads()
    assert took < 0.1 + 0.3, took
    assert channel.counts() == {"delivered": 0, "failed": 0, "dropped": 0, "abandoned": 1}


def test_webhook_full_queue_drops_without_blocking(caplog) -> None:
    with hanging_server() as port:
        channel = WebhookChannel(f"http://127.0.0.1:{port}/", timeout=0.2, max_queue=1)
        with caplog.at_level(logging.WARNING, logger="stable_attn"):
            t0 = time.perf_counter()
            for step in range(6):
                channel.send(make_alert(step=step))
            assert time.perf_counter() - t0 < 0.3
            assert channel.flush(5.0)
        assert channel.dropped >= 3 and channel.failed + channel.dropped == 6
        assert sum("queue of 1 full" in r.getMessage() for r in caplog.records) == 1
        channel.close()


@pytest.mark.parametrize("url, message", [
    ("ftp://example.com/hook", "url must be an http"),
    ("not a url", "contains a space"),
    ("http://example.com/a b", "contains a space"),
    ("http://example.com/hook\r\nX-Evil: 1", "control character '\\\\r'"),
    ("http://example.com/\thook", "control character"),
    ("http://example.com/h\u00e9", "non-ASCII"),
    ("http://example.com:99999/", "Port out of range"),
    ("http:///path-only", "url must be an http"),
])
def test_webhook_refuses_urls_that_cannot_work(url, message) -> None:
    with pytest.raises(ValueError, match=message):
        WebhookChannel(url)


def test_webhook_refuses_credentials_timeouts_and_headers() -> None:
    with pytest.raises(ValueError, match="credentials") as info:
        WebhookChannel("http://user:pa55word@example.com/hook")
    assert "pa55word" not in str(info.value) and "example.com" in str(info.value)
    for timeout in (0, -1, 1e9, math.inf, math.nan, True, "2"):
        with pytest.raises(ValueError, match=r"timeout=.*seconds in \(0, 60\]"):
            WebhookChannel("http://127.0.0.1:9/", timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="header name 'Bad Name'"):
        WebhookChannel("http://127.0.0.1:9/", headers={"Bad Name": "x"})
    with pytest.raises(ValueError, match=r"headers\['Authorization'\].*value not shown") as info:
        WebhookChannel("http://127.0.0.1:9/", headers={"Authorization": "Bearer S3CRET\r\nX-Evil: 1"})
    assert "S3CRET" not in str(info.value)
    with pytest.raises(TypeError, match="headers"):
        WebhookChannel("http://127.0.0.1:9/", headers=[("a", "b")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_queue"):
        WebhookChannel("http://127.0.0.1:9/", max_queue=0)
    with pytest.raises(TypeError, match="payload"):
        WebhookChannel("http://127.0.0.1:9/", payload="text")  # type: ignore[arg-type]


@pytest.mark.parametrize("url", [
    "https://hooks.example.com/services/T0/S3CRET\n",  # a trailing newline pasted with the URL
    "hooks.example.com/services/T0/S3CRET",  # no scheme
    "ftp://hooks.example.com/S3CRET?token=S3CRET",
    "http://hooks.example.com:99999/S3CRET",
    "http://hooks.example.com/S3CRET\u00e9",
    "http://hooks.example.com/S3CRET?q=a b",
    "http://u:S3CRET@hooks.example.com/S3CRET",
    "http://[::1/S3CRET",
])
def test_refused_webhook_urls_never_show_their_path_or_query(url) -> None:
    with pytest.raises(ValueError) as info:
        WebhookChannel(url)
    text = str(info.value)
    assert "S3CRET" not in text and ("hooks.example.com" in text or "[::1" in text), text
    assert "\n" not in text


def test_webhook_payload_names_a_stop_checkpoint_by_its_file_name_only() -> None:
    from stable_attn.monitor.verdict import NotTrainingStreak

    streak = NotTrainingStreak(after=1, stop_after=1)
    action = streak.update(True)
    local = os.path.join("/home/someone/private run", "stable_attn-stop-step=7.ckpt")
    alert = streak.alert(7, action, 1e-3, local)
    assert alert.checkpoint == local and local in alert.format()  # the local alerts (log, JSONL, callables) keep it
    assert local not in alert.message
    with local_server() as server:
        channel = WebhookChannel(f"http://127.0.0.1:{server.server_port}/hook", timeout=5.0)
        channel.send(alert)
        assert channel.flush(5.0) and channel.delivered == 1
        channel.close()
    body = json.loads(server.received[0][2])
    sent = server.received[0][2].decode()
    assert "/home/someone" not in sent and "private run" not in sent
    assert body["message"].endswith("; stopping") and body["checkpoint"] == "stable_attn-stop-step=7.ckpt"
    trainer_style = Alert(step=7, kind="spike", metric="loss", value=9.0, message="loss spike; stopping",
                          checkpoint="/out/dir/checkpoint-7/")
    assert trainer_style.for_remote().checkpoint == "checkpoint-7"
    assert trainer_style.for_remote().message == trainer_style.message
    plain = make_alert()
    assert plain.for_remote() is plain


def test_webhook_server_text_is_escaped_in_warnings(caplog) -> None:
    """A server's bad status line with control characters (terminal escapes, line breaks) is logged escaped."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def answer() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"EVIL \x1b[2J\x07 FAKE\rWARNING forged line\r\n\r\n")
        conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        channel = WebhookChannel(f"http://127.0.0.1:{listener.getsockname()[1]}/hook", timeout=5.0)
        with caplog.at_level(logging.WARNING, logger="stable_attn"):
            channel.send(make_alert())
            assert channel.flush(5.0)
            channel.close()
    finally:
        thread.join(5)
        listener.close()
    assert channel.failed == 1
    messages = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert messages and "EVIL" in messages[0]
    assert all(c.isprintable() for m in messages for c in m), messages
    assert "\\x1b" in messages[0] and all(c.isprintable() for c in channel.last_failure)
