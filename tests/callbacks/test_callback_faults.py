"""StableAttentionCallback under faults, in real Lightning runs of the tiny GPT-2 on the CPU.

Alerts come from NaN losses injected at known steps (a non-finite value always alerts, whatever the
detectors have learnt), so these tests do not depend on the detectors' tuning. Every server listens
on 127.0.0.1 and is stopped by the test that started it; timeouts are short (0.5 s), and every wait
is bounded.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import lightning as L
import pytest
import torch
from callback_lm import ByteLM, batches_loader, trainer
from lightning.pytorch import Callback

from stable_attn.callbacks import StableAttentionCallback
from stable_attn.integrations.sdpa import is_sdpa_patched
from stable_attn.monitor import SpikeDetector

TIMEOUT = 0.5
# What the end of fit() may take beyond one webhook timeout: joining a thread whose socket was shut
# down, Lightning's own teardown, a loaded 2-core machine.
SLACK = 0.8


class FaultyLM(ByteLM):
    """ByteLM whose loss is NaN at ``nan_steps`` and whose ``training_step`` raises ``exc`` at ``raise_at``."""

    def __init__(self, *args, nan_steps=(), raise_at=None, exc=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.nan_steps = set(nan_steps)
        self.raise_at = raise_at
        self.exc = exc
        self.raised_at_time: float | None = None

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.raise_at:
            self.raised_at_time = time.monotonic()
            raise self.exc
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step in self.nan_steps else loss


class EndTime(Callback):
    """When training ended (Lightning's on_train_end, before the teardown hooks)."""

    def on_train_end(self, trainer, pl_module):
        self.time = time.monotonic()


def make_callback(**kwargs) -> StableAttentionCallback:
    kwargs.setdefault("loss_detector", SpikeDetector("train/loss", warmup=20))
    kwargs.setdefault("grad_norm_detector", SpikeDetector("train/grad_norm", warmup=20))
    kwargs.setdefault("webhook_timeout", TIMEOUT)
    return StableAttentionCallback(**kwargs)


def run(tmp_path, pretrained, callbacks, steps, ckpt_path=None, batch_ids=None, **module_kwargs):
    L.seed_everything(0, verbose=False)
    module = FaultyLM(weights=pretrained, **module_kwargs)
    t = trainer(tmp_path, callbacks, steps)
    loader = batches_loader(batch_ids if batch_ids is not None else range(steps))
    t.fit(module, loader, ckpt_path=ckpt_path)
    return t, module


def webhook_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "stable_attn-webhook" and t.is_alive()]


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------- local servers


@contextlib.contextmanager
def hanging_server() -> Iterator[str]:
    """A URL on 127.0.0.1 whose server accepts connections (the kernel's backlog) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/alerts/SECRET-PATH?token=SECRET-QUERY"
    finally:
        listener.close()


@contextlib.contextmanager
def recording_server(status: int = 200, location: str = "") -> Iterator[http.server.ThreadingHTTPServer]:
    """An HTTP server on 127.0.0.1 that records (method, path, headers) of every request."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _record(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            server.requests.append((self.command, self.path, dict(self.headers)))  # type: ignore[attr-defined]
            self.send_response(status)
            if location:
                self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_GET = _record  # noqa: N815 - http.server's naming

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


# ----------------------------------------------------------------------------- the tests


def test_constructor_refuses_what_cannot_work():
    cases = [
        (dict(webhook_url="http://example.com/hook\r\nX: 1"), ValueError, r"webhook_url=.*control character"),
        (dict(webhook_url="http://example.com/a hook"), ValueError, r"webhook_url=.*a space"),
        (dict(webhook_url="http://user:pw@example.com/"), ValueError, r"webhook_url=.*credentials"),
        (dict(webhook_url="http://example.com/", webhook_timeout=1e9), ValueError, r"webhook_timeout=1000000000.0"),
        (dict(webhook_timeout=float("nan")), ValueError, r"webhook_timeout=nan .*seconds in \(0, 60\]"),
        (dict(webhook_url="http://example.com/", webhook_headers={"Authorization": "a\nb"}), ValueError,
         r"webhook_headers\['Authorization'\]"),
        (dict(webhook_headers={"Authorization": "Bearer x"}), ValueError, r"webhook_headers .* webhook_url is None"),
        (dict(on_alert="print"), TypeError, r"on_alert='print' is not supported; use a callable \(e.g. print"),
    ]
    for name in (".", "..", "", "logs/a.jsonl", "a\nb.jsonl", os.path.join("..", "a.jsonl")):
        cases.append((dict(alerts_file=name), ValueError, f"alerts_file={name!r}".replace("\\", "\\\\")
                      .replace(".", r"\.").replace("(", r"\(")))
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            StableAttentionCallback(**kwargs)
    with pytest.raises(ValueError) as info:
        StableAttentionCallback(webhook_url="http://example.com/", webhook_headers={"Authorization": "S3CRET\r\n"})
    assert "S3CRET" not in str(info.value)


def test_hanging_webhook_costs_fit_one_timeout_and_is_reported(tmp_path, pretrained, caplog):
    with hanging_server() as url:
        cb, end = make_callback(webhook_url=url), EndTime()
        with caplog.at_level(logging.INFO, logger="stable_attn"):
            t, _ = run(tmp_path, pretrained, [cb, end], 12, nan_steps=(3, 6, 9))
            returned = time.monotonic()
        assert not webhook_threads()  # the sender ended with fit()
    assert returned - end.time < TIMEOUT + SLACK, returned - end.time
    host = url.split("/alerts")[0]
    (summary,) = [r for r in caplog.records if f"webhook {host} delivered" in r.getMessage()]
    n = cb.alert_count  # each NaN step alerts on the loss and on the gradient norm
    assert n >= 3 and summary.levelno == logging.WARNING and f"delivered 0 of {n}" in summary.getMessage()
    assert "SECRET" not in caplog.text  # neither the path nor the query of the webhook is ever logged
    counts = cb.alert_delivery[f"webhook {host}"]
    assert counts["delivered"] == 0 and counts["failed"] + counts["abandoned"] == n, counts
    assert cb.state_dict()["alert_delivery"] == cb.alert_delivery
    # the JSONL file, written synchronously, has every alert
    file_counts = cb.alert_delivery[f"alerts file {os.path.join(t.log_dir, 'stable_attn_alerts.jsonl')}"]
    assert file_counts == {"delivered": n, "failed": 0, "dropped": 0, "abandoned": 0}
    lines = read_jsonl(os.path.join(t.log_dir, "stable_attn_alerts.jsonl"))
    assert len(lines) == n and {3, 6, 9} <= {d["step"] for d in lines}


def test_webhook_headers_go_to_the_url_and_a_redirect_reaches_nobody(tmp_path, pretrained, caplog):
    with recording_server() as elsewhere, recording_server() as direct:
        target = f"http://127.0.0.1:{elsewhere.server_port}/collect"
        with recording_server(status=302, location=target) as redirecting:
            headers = {"Authorization": "Bearer T0KEN"}
            to_direct = make_callback(webhook_url=f"http://127.0.0.1:{direct.server_port}/hook",
                                      webhook_headers=headers)
            to_redirect = make_callback(webhook_url=f"http://127.0.0.1:{redirecting.server_port}/hook",
                                        webhook_headers=headers)
            with caplog.at_level(logging.WARNING, logger="stable_attn"):
                run(tmp_path / "a", pretrained, [to_direct], 5, nan_steps=(2,))
                run(tmp_path / "b", pretrained, [to_redirect], 5, nan_steps=(2,))
    n = to_direct.alert_count
    assert n >= 1 and [(m, p, h["Authorization"]) for m, p, h in direct.requests] == [
        ("POST", "/hook", "Bearer T0KEN")] * n
    assert len(redirecting.requests) == to_redirect.alert_count
    assert elsewhere.requests == []  # the redirect was not followed: no alert, no token went there
    host = f"http://127.0.0.1:{redirecting.server_port}"
    assert to_redirect.alert_delivery[f"webhook {host}"] == {"delivered": 0, "failed": n, "dropped": 0,
                                                             "abandoned": 0}
    (summary,) = [r.getMessage() for r in caplog.records if f"webhook {host} delivered" in r.getMessage()]
    assert f"{n} failed" in summary and "HTTP 302" in summary
    assert to_direct.alert_delivery[f"webhook http://127.0.0.1:{direct.server_port}"]["delivered"] == n
    assert "T0KEN" not in caplog.text


@pytest.mark.parametrize("exc", [RuntimeError("user code failed at step 5"), KeyboardInterrupt()],
                         ids=["raise", "keyboard_interrupt"])
def test_a_failing_fit_is_torn_down(exc, tmp_path, pretrained, caplog):
    original = torch.nn.functional.scaled_dot_product_attention
    sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT after a KeyboardInterrupt
    expected = SystemExit if isinstance(exc, KeyboardInterrupt) else RuntimeError
    module = None
    try:
        with hanging_server() as url:
            cb = make_callback(webhook_url=url, patch_sdpa=True)
            L.seed_everything(0, verbose=False)
            module = FaultyLM(weights=pretrained, nan_steps=(2,), raise_at=5, exc=exc)
            t = trainer(tmp_path, [cb], 10)
            with caplog.at_level(logging.WARNING, logger="stable_attn"), pytest.raises(expected):
                t.fit(module, batches_loader(range(10)))
            returned = time.monotonic()
            assert not webhook_threads()
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert returned - module.raised_at_time < TIMEOUT + SLACK, returned - module.raised_at_time
    assert torch.nn.functional.scaled_dot_product_attention is original and not is_sdpa_patched()
    assert cb.dispatcher is None and not any(s.enabled for s in cb.layers.stats.values())
    summary = [r.getMessage() for r in caplog.records if "webhook http://127.0.0.1" in r.getMessage()
               and f"delivered 0 of {cb.alert_count}" in r.getMessage()]
    assert len(summary) == 1 and f"after fit() raised {type(exc).__name__}" in summary[0]
    lines = read_jsonl(os.path.join(t.log_dir, "stable_attn_alerts.jsonl"))
    assert len(lines) == cb.alert_count >= 1 and 2 in {d["step"] for d in lines}


def test_the_stop_action_is_torn_down(tmp_path, pretrained):
    original = torch.nn.functional.scaled_dot_product_attention
    threads_before = {t.ident for t in threading.enumerate()}
    with recording_server() as server:
        cb = make_callback(on_spike="stop", patch_sdpa=True, webhook_url=f"http://127.0.0.1:{server.server_port}/")
        t, _ = run(tmp_path, pretrained, [cb], 10, nan_steps=(4,))
        assert t.global_step == 5 and os.path.isfile(cb.stop_checkpoint)
        assert len(server.requests) == cb.alert_count >= 1
    assert torch.nn.functional.scaled_dot_product_attention is original and not is_sdpa_patched()
    assert cb.dispatcher is None and not webhook_threads()
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= threads_before  # nothing left running
    assert cb.alert_delivery[f"webhook http://127.0.0.1:{server.server_port}"]["delivered"] == cb.alert_count


def test_a_slow_on_alert_callable_is_named_once(tmp_path, pretrained, caplog):
    def slow_pager(alert):
        time.sleep(0.15)

    cb = make_callback(on_alert=slow_pager)
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        run(tmp_path, pretrained, [cb], 6, nan_steps=(1, 4))
    slow = [r.getMessage() for r in caplog.records if "slow_pager" in r.getMessage()]
    assert len(slow) == 1 and "training thread" in slow[0]
    assert cb.alert_delivery["on_alert callable " + slow_pager.__module__ + "." + slow_pager.__qualname__][
        "delivered"] == cb.alert_count >= 2


def test_a_failing_alerts_file_names_its_path(tmp_path, pretrained, caplog):
    (tmp_path / "stable_attn_alerts.jsonl").mkdir()  # a folder where the file should be
    cb = make_callback()
    L.seed_everything(0, verbose=False)
    t = L.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, default_root_dir=str(tmp_path),
                  callbacks=[cb], enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0)
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        t.fit(FaultyLM(weights=pretrained, nan_steps=(1, 3)), batches_loader(range(5)))
    assert t.global_step == 5  # training went on
    path = str(tmp_path / "stable_attn_alerts.jsonl")
    failures = [r.getMessage() for r in caplog.records if "failed on the alert" in r.getMessage()]
    assert len(failures) == 1 and f"alerts file {path}" in failures[0]
    n = cb.alert_count
    assert n >= 2 and cb.alert_delivery[f"alerts file {path}"] == {"delivered": 0, "failed": n, "dropped": 0,
                                                                   "abandoned": 0}
    assert any(f"alerts file {path} delivered 0 of {n}" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


class SaveAt(Callback):
    """Saves a checkpoint after ``step`` optimizer steps (after the other callbacks' batch-end hooks)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _nbytes(obj) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.tell()


def test_rollback_snapshot_survives_a_resume(tmp_path, pretrained):
    # Uninterrupted: snapshots every 4 steps; the NaN at step 50 rolls back to the state after 48 steps
    # (or to an earlier one, if a spike kept the snapshot of step 48 from being taken).
    # Interrupted after 49 steps (the snapshot of step 48 is in the checkpoint) and resumed: the same
    # rollback, to the same state, and the same weights at the end, bit for bit.
    steps, ckpt = 56, str(tmp_path / "at49.ckpt")
    whole = make_callback(on_spike="rollback", rollback_every=4)
    t_whole, m_whole = run(tmp_path / "a", pretrained, [whole, SaveAt(49, ckpt)], steps, nan_steps=(50,),
                           dropout=0.1)
    # the rollback of the NaN step uses a snapshot taken before the interruption
    assert any(step >= 49 and at <= 49 for step, at in whole.rollbacks), whole.rollbacks

    resumed = make_callback(on_spike="rollback", rollback_every=4)
    t_res, m_res = run(tmp_path / "b", pretrained, [resumed], steps, ckpt_path=ckpt, batch_ids=range(49, steps),
                       nan_steps=(50,), dropout=0.1)
    assert resumed.rollbacks == whole.rollbacks
    for name, value in m_whole.state_dict().items():
        assert torch.equal(value, m_res.state_dict()[name]), name

    # the size cost: the snapshot is one more copy of the weights and the optimizer state
    saved = torch.load(ckpt, weights_only=True)
    (state,) = [s for key, s in saved["callbacks"].items() if "StableAttentionCallback" in key]
    snapshot = _nbytes(state["rollback_snapshot"])
    weights_and_optimizer = _nbytes({"w": saved["state_dict"], "o": saved["optimizer_states"]})
    assert 0.9 < snapshot / weights_and_optimizer < 1.1, (snapshot, weights_and_optimizer)


def test_resume_without_a_snapshot_says_rollback_history_starts_afresh(tmp_path, pretrained, caplog):
    ckpt = str(tmp_path / "warn.ckpt")
    first = make_callback()
    run(tmp_path / "a", pretrained, [first, SaveAt(4, ckpt)], 4, nan_steps=(1,))
    resumed = make_callback(on_spike="rollback", rollback_every=4)
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        run(tmp_path / "b", pretrained, [resumed], 6, ckpt_path=ckpt, batch_ids=range(4, 6), nan_steps=(5,))
    (line,) = [r for r in caplog.records if "rollback history starts afresh" in r.getMessage()]
    assert line.levelno == logging.WARNING and "global_step 4" in line.getMessage()
    # the delivery counts add up over the resume (the log channel is the same in both runs)
    log_channel = "log (logger 'stable_attn')"
    new_alerts = resumed.alert_count - first.alert_count
    assert first.alert_count >= 1 and new_alerts >= 1
    assert resumed.alert_delivery[log_channel]["delivered"] == first.alert_count + new_alerts
