"""A training run that raises or is interrupted at a step restores everything, in both adapters: SDPA no
longer patched, the Trainer's methods unwrapped, the webhook thread ended, the alerts file complete on disk,
statistics off."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading

import lightning as L
import pytest
import torch
from callback_lm import ByteLM, batches_loader
from callback_lm import trainer as lightning_trainer
from trainer_lm import make_trainer

from stable_attn.callbacks import StableAttentionCallback, StableAttentionTrainerCallback
from stable_attn.integrations.sdpa import is_sdpa_patched
from stable_attn.monitor import names

NAN_AT, RAISE_AT = 2, 4  # optimizer steps (1-based): a NaN loss (one alert), then the failure


@contextlib.contextmanager
def hanging_url():
    """A webhook URL whose server accepts connections and never answers: the webhook thread stays busy."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/alerts"
    finally:
        listener.close()


def webhook_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "stable_attn-webhook" and t.is_alive()]


def read_alerts(folder: str) -> list[dict]:
    with open(os.path.join(folder, names.ALERTS_FILE), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


class Fault:
    """A forward hook on the model: the loss NaN at the forward of step NAN_AT, ``exc`` raised at RAISE_AT."""

    def __init__(self, exc: BaseException) -> None:
        self.exc, self.calls = exc, 0

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls == RAISE_AT:
            raise self.exc
        if self.calls == NAN_AT:
            output.loss = output.loss * float("nan")
        return output


FAULTS = [RuntimeError("failed at a step"), KeyboardInterrupt()]


EXPECTED = "SDPA unpatched, methods unwrapped, webhook thread ended, alerts on disk, statistics off"


def _state(engine, wrapped: list[str]) -> str:
    """What is left behind, in the words of EXPECTED."""
    stats_on = [n for n, s in (engine.layers.stats.items() if engine.layers else ()) if s.enabled]
    return (f"SDPA {'patched' if is_sdpa_patched() else 'unpatched'}, methods wrapped: {wrapped or 'none'}, "
            f"webhook threads {len(webhook_threads())}, channels {'open' if engine.dispatcher else 'closed'}, "
            f"statistics on: {len(stats_on)} layer(s)")


def _assert_restored(engine, original_sdpa) -> None:
    assert torch.nn.functional.scaled_dot_product_attention is original_sdpa and not is_sdpa_patched()
    assert engine.dispatcher is None and not webhook_threads()
    assert not any(s.enabled for s in engine.layers.stats.values())


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: type(e).__name__)
def test_a_trainer_train_that_raises_restores_everything(tmp_path, exc, row):
    original = torch.nn.functional.scaled_dot_product_attention
    with hanging_url() as url:
        cb = StableAttentionTrainerCallback(patch_sdpa=True, webhook_url=url, webhook_timeout=0.5)
        trainer = make_trainer(str(tmp_path), [cb], steps=6)
        trainer.model.register_forward_hook(Fault(exc))
        with pytest.raises(type(exc)):
            trainer.train()
        wrapped = sorted({"training_step", "log", "get_batch_samples"} & set(vars(trainer)))
        row(EXPECTED, _state(cb.engine, wrapped) + f", alerts in the file {len(read_alerts(str(tmp_path)))}")
        _assert_restored(cb.engine, original)
    assert {"training_step", "log", "get_batch_samples"}.isdisjoint(vars(trainer))
    assert "clip_grad_norm_" not in vars(trainer.accelerator)
    alerts = read_alerts(str(tmp_path))
    assert {(a["step"], a["kind"]) for a in alerts} == {(NAN_AT, "nonfinite")} and len(alerts) == cb.alert_count
    (webhook,) = [counts for name, counts in cb.alert_delivery.items() if name.startswith("webhook")]
    assert webhook["delivered"] == 0 and sum(webhook.values()) == cb.alert_count  # each accounted for


def test_a_trainer_train_that_raises_can_train_again(tmp_path, row):
    cb = StableAttentionTrainerCallback()
    trainer = make_trainer(str(tmp_path), [cb], steps=5)
    hook = trainer.model.register_forward_hook(Fault(RuntimeError("once")))
    with pytest.raises(RuntimeError):
        trainer.train()
    hook.remove()
    trainer.train()  # the same Trainer and callback, wrapped once again
    row("the next train() runs all 5 steps and ends clean", f"{trainer.state.global_step} steps, " +
        _state(cb.engine, sorted({"training_step", "log"} & set(vars(trainer)))))
    assert trainer.state.global_step == 5 and cb.engine.dispatcher is None and "training_step" not in vars(trainer)


@pytest.mark.parametrize("exc", FAULTS, ids=lambda e: type(e).__name__)
def test_a_lightning_fit_that_raises_restores_everything(tmp_path, exc, row):
    original = torch.nn.functional.scaled_dot_product_attention
    sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT after a KeyboardInterrupt
    try:
        with hanging_url() as url:
            cb = StableAttentionCallback(patch_sdpa=True, webhook_url=url, webhook_timeout=0.5)
            L.seed_everything(0, verbose=False)
            module = ByteLM()
            module.model.register_forward_hook(Fault(exc))
            t = lightning_trainer(tmp_path, [cb], 6)
            with pytest.raises(SystemExit if isinstance(exc, KeyboardInterrupt) else type(exc)):
                t.fit(module, batches_loader(range(6)))
            row(EXPECTED, _state(cb.engine, []) + f", alerts in the file {len(read_alerts(t.log_dir))}")
            _assert_restored(cb.engine, original)
    finally:
        signal.signal(signal.SIGINT, sigint)
    alerts = read_alerts(t.log_dir)
    assert {(a["step"], a["kind"]) for a in alerts} == {(NAN_AT - 1, "nonfinite")}  # Lightning counts from 0
    assert len(alerts) == cb.alert_count
