"""No NaN update is ever applied, whatever ``on_spike`` says, and a run that stops training escalates.

Real Lightning runs of the pre-trained tiny GPT-2 (callback_lm.py) in which the module itself (user
code) makes the loss or a gradient non-finite at chosen steps.
"""

from __future__ import annotations

import logging
import os

import lightning as L
import pytest
import torch
from callback_lm import ByteLM, batches_loader, trainer
from lightning.pytorch import Callback

from stable_attn.callbacks import StableAttentionCallback
from stable_attn.monitor import Alert
from stable_attn.monitor.names import GRADIENTS, NOT_TRAINING


class FaultyLM(ByteLM):
    """ByteLM whose loss is NaN at ``nan_loss`` steps and whose gradients get a NaN/inf at ``bad_grads`` steps."""

    def __init__(self, weights, nan_loss=(), bad_grads: dict[int, float] | None = None) -> None:
        super().__init__(weights=weights)
        self.nan_loss = set(nan_loss)
        self.bad_grads = bad_grads or {}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step in self.nan_loss else loss

    def on_after_backward(self):
        value = self.bad_grads.get(self.trainer.global_step)
        if value is not None:
            self.model.lm_head.weight.grad[3, 5] = value  # one element of one gradient; the loss stays finite


class States(Callback):
    """The weights at the start of every optimizer step."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.at[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def run(tmp_path, weights, steps, module_kwargs, **cb_kwargs):
    received: list[Alert] = []
    cb = StableAttentionCallback(on_alert=received.append, **cb_kwargs)
    states = States()
    L.seed_everything(0, verbose=False)
    module = FaultyLM(weights, **module_kwargs)
    t = trainer(tmp_path, [cb, states], steps)
    t.fit(module, batches_loader(range(steps)))
    return t, cb, states, module, received


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_nan_loss_is_skipped_even_with_warn(tmp_path, pretrained):
    t, cb, states, module, received = run(tmp_path, pretrained, 30, {"nan_loss": [20]})  # on_spike="warn"
    assert t.global_step == 30
    assert same(states.at[20], states.at[21])  # the NaN step changed nothing
    assert not same(states.at[21], states.at[22])  # and training goes on
    assert all(torch.isfinite(v).all() for v in module.state_dict().values())
    assert cb.skipped_steps == [20]
    at_20 = [a for a in received if a.step == 20]
    assert {(a.kind, a.metric) for a in at_20} >= {("nonfinite", "train/loss")}
    assert all(a.action == "skip" and "never applied" in a.message for a in at_20)
    assert all(a.kind != "nonfinite" for a in received if a.step != 20)


@pytest.mark.parametrize("on_spike", ["warn", "skip"])
def test_non_finite_gradients_are_skipped_without_norm_monitoring(tmp_path, pretrained, on_spike):
    bad = {12: float("nan"), 13: float("inf"), 20: -float("inf")}
    t, cb, states, module, received = run(tmp_path, pretrained, 25, {"bad_grads": bad}, on_spike=on_spike,
                                          monitor_grad_norm=False)
    assert t.global_step == 25
    for step in bad:
        assert same(states.at[step], states.at[step + 1]), step
    assert not same(states.at[14], states.at[15])
    assert all(torch.isfinite(v).all() for v in module.state_dict().values())
    assert [s for s in cb.skipped_steps if s in bad] == [12, 13, 20]
    grads = [a for a in received if a.metric == GRADIENTS]
    # one alert per episode of bad gradients: steps 12-13 are one, step 20 another
    assert [(a.step, a.kind, a.action) for a in grads] == [(12, "nonfinite", "skip"), (20, "nonfinite", "skip")]


def test_a_run_that_does_not_train_alerts_then_stops_with_a_checkpoint(tmp_path, pretrained, caplog):
    first = 20
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        t, cb, states, module, received = run(
            tmp_path, pretrained, 60, {"nan_loss": range(first, 60)}, not_training_after=5, not_training_stop_after=12)
    stop_step = first + 11
    assert t.global_step == stop_step + 1 and t.should_stop
    stalls = [a for a in received if a.kind == "not_training"]
    assert [(a.step, a.metric, a.value, a.action) for a in stalls] == [
        (first + 4, NOT_TRAINING, 5.0, "warn"), (stop_step, NOT_TRAINING, 12.0, "stop")]
    assert "the run is not training" in stalls[0].message and f"steps {first}..{first + 4}" in stalls[0].message
    # the NaN losses are one episode: one nonfinite loss alert, not one per step
    assert [a.step for a in received if a.kind == "nonfinite" and a.metric == "train/loss"] == [first]
    path = os.path.join(t.log_dir, f"stable_attn-stop-step={stop_step}.ckpt")
    assert cb.stop_checkpoint == path and os.path.isfile(path)
    ckpt = torch.load(path, weights_only=False)
    assert same(ckpt["state_dict"], states.at[first])  # the last weights that were applied
    assert cb.state_dict()["not_training_streak"] == 12
    summary = [r.message for r in caplog.records if "alert(s) (" in r.message]
    assert len(summary) == 1 and "not_training 2" in summary[0] and "stopped, checkpoint" in summary[0]


def test_a_step_that_trains_ends_the_streak(tmp_path, pretrained):
    t, cb, states, module, received = run(tmp_path, pretrained, 35, {"nan_loss": [20, 21, 22, 28, 29, 30]},
                                          not_training_after=3, not_training_stop_after=4)
    assert t.global_step == 35 and cb.stop_checkpoint is None
    assert [(a.step, a.action) for a in received if a.kind == "not_training"] == [(22, "warn"), (30, "warn")]


def test_escalation_arguments_are_checked():
    with pytest.raises(ValueError, match=r"not_training_after=0 .*int >= 1"):
        StableAttentionCallback(not_training_after=0)
    with pytest.raises(ValueError, match=r"not_training_stop_after=5 .*int >= 10 or None"):
        StableAttentionCallback(not_training_stop_after=5)
    cb = StableAttentionCallback(not_training_stop_after=None)
    assert cb.not_training_after == 10 and cb.not_training_stop_after is None
