"""Alerts and their channels: log line, JSONL file, callables, webhook (local HTTP server), dispatcher."""

from __future__ import annotations

import http.server
import json
import logging
import math
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
        "time",
    }
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


# ------------------------------------------------------------------------- webhook


class _Recorder(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append((self.path, self.headers["Content-Type"], body))  # type: ignore[attr-defined]
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.received = []  # type: ignore[attr-defined]
    server.status = 200  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_webhook_posts_json_to_a_local_server(http_server) -> None:
    url = f"http://127.0.0.1:{http_server.server_port}/hook"
    channel = WebhookChannel(url, timeout=2.0)
    alerts = [make_alert(step=1), make_alert(step=2, kind="nonfinite", value=math.nan)]
    for alert in alerts:
        channel.send(alert)
    assert channel.flush(10.0)
    channel.close()
    assert (channel.sent, channel.failed, channel.dropped) == (2, 0, 0)
    assert [path for path, _, _ in http_server.received] == ["/hook", "/hook"]
    assert {ctype for _, ctype, _ in http_server.received} == {"application/json"}
    bodies = sorted((strict_json(body.decode()) for _, _, body in http_server.received), key=lambda b: b["step"])
    assert bodies == [a.to_dict() for a in alerts]


def test_webhook_custom_payload_and_http_error_is_logged(http_server, caplog: pytest.LogCaptureFixture) -> None:
    http_server.status = 500
    url = f"http://127.0.0.1:{http_server.server_port}/"
    channel = WebhookChannel(url, timeout=2.0, payload=lambda a: {"text": a.format()})
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        channel.send(make_alert())
        assert channel.flush(10.0)
    channel.close()
    assert channel.failed == 1 and channel.sent == 0
    assert strict_json(http_server.received[0][2].decode()) == {"text": make_alert().format()}
    assert any("HTTP Error 500" in r.getMessage() for r in caplog.records)


def test_unreachable_webhook_is_harmless_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    channel = WebhookChannel(f"http://127.0.0.1:{_closed_port()}/hook/SECRET-TOKEN", timeout=1.0)
    dispatcher = AlertDispatcher([channel])
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        t0 = time.perf_counter()
        for step in range(3):
            assert dispatcher.emit(make_alert(step=step)) == 1  # the channel accepted it: no exception
        assert time.perf_counter() - t0 < 0.5  # sending never waits on the network
        assert channel.flush(10.0)
    dispatcher.close()
    assert channel.failed == 3 and channel.sent == 0
    failures = [r for r in caplog.records if "webhook" in r.getMessage() and "failed" in r.getMessage()]
    assert len(failures) == 1  # once per failure kind
    assert "SECRET-TOKEN" not in caplog.text and "SECRET-TOKEN" not in repr(channel)


def test_webhook_full_queue_drops_without_blocking(caplog: pytest.LogCaptureFixture) -> None:
    # A server that accepts connections but never answers: the worker waits out its timeout.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        channel = WebhookChannel(f"http://127.0.0.1:{listener.getsockname()[1]}/", timeout=0.5, max_queue=1)
        with caplog.at_level(logging.WARNING, logger="stable_attn"):
            t0 = time.perf_counter()
            for step in range(6):
                channel.send(make_alert(step=step))
            assert time.perf_counter() - t0 < 0.3
            assert channel.flush(10.0)
        assert channel.dropped >= 3 and channel.failed + channel.dropped == 6
        assert sum("queue full" in r.getMessage() for r in caplog.records) == 1
        channel.close()
        channel.send(make_alert(step=99))  # after close: dropped, not raised
        assert channel.dropped >= 4
    finally:
        listener.close()


def test_webhook_validation() -> None:
    with pytest.raises(ValueError, match="url"):
        WebhookChannel("ftp://example.com/hook")
    with pytest.raises(ValueError, match="url"):
        WebhookChannel("not a url")
    with pytest.raises(ValueError, match="timeout"):
        WebhookChannel("http://127.0.0.1:9/", timeout=0)
    with pytest.raises(ValueError, match="max_queue"):
        WebhookChannel("http://127.0.0.1:9/", max_queue=0)
    with pytest.raises(TypeError, match="payload"):
        WebhookChannel("http://127.0.0.1:9/", payload="text")  # type: ignore[arg-type]
