"""StableAttentionTrainerCallback in a real transformers.Trainer on the CPU (tiny GPT-2, real text)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from trainer_lm import digest, make_trainer, optimizer_digest
from transformers import TrainerCallback, TrainerControl

from stable_attn.callbacks import StableAttentionTrainerCallback
from stable_attn.monitor import names
from stable_attn.monitor.alerts.schema import validate_alert

BAD = 12  # the optimizer step that reads the garbled batch (its loss is about 3x the trained level)


def read_alerts(out) -> list[dict]:
    path = os.path.join(out, names.ALERTS_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Probe(TrainerCallback):
    """Digests of the weights and the optimizer state before and after chosen steps (runs after the
    callback under test: it is later in the list)."""

    def __init__(self, steps=()) -> None:
        self.steps = set(steps)
        self.before: dict[int, tuple[str, str]] = {}
        self.after: dict[int, tuple[str, str]] = {}

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step + 1 in self.steps:
            self.before[state.global_step + 1] = (digest(model), optimizer_digest(optimizer))

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.after[state.global_step] = (digest(model), optimizer_digest(optimizer))


def batch_of(step: int, accumulation: int = 1) -> list[int]:
    """The batches optimizer step ``step`` (1-based, the Trainer's numbering) reads in one process."""
    return list(range((step - 1) * accumulation, step * accumulation))


def test_healthy_run_logs_layer_metrics_and_raises_no_alert(tmp_path, pretrained):
    class Reporter(TrainerCallback):  # stands for a report_to integration: those run before user callbacks
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    cb, reporter = StableAttentionTrainerCallback(), Reporter()
    trainer = make_trainer(str(tmp_path), [reporter, cb], steps=30, weights=pretrained)
    trainer.train()

    assert trainer.model.config._attn_implementation == "stable_attn"
    reported = [e for e in reporter.logs if "loss" in e]
    assert len(reported) == 6 and all("stable_attn/max_logit/layer1" in e for e in reported)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logged] == [5, 10, 15, 20, 25, 30]
    for entry in logged:  # the Trainer's own entry of the step carries the layer statistics
        for stat in names.LAYER_STATS:
            for layer in ("layer0", "layer1"):
                value = entry[names.layer_metric(stat, layer)]
                assert value == value  # not NaN
        assert 0.0 <= entry["stable_attn/saturation/layer0"] <= 1.0
        assert 0.0 < entry["stable_attn/sink_mass/layer0"] <= 1.0
        assert entry[names.ALERT_COUNT] == 0.0
        assert "grad_norm" in entry and "learning_rate" in entry
    assert not any(names.LOSS in e for e in trainer.state.log_history)  # the Trainer's "loss" is not repeated
    assert cb.alert_count == 0 and cb.skipped_steps == [] and read_alerts(tmp_path) == []
    # the wrapped Trainer methods are put back
    assert "training_step" not in vars(trainer) and "log" not in vars(trainer)
    assert "clip_grad_norm_" not in vars(trainer.accelerator)


def test_corrupted_batch_alerts_at_its_step_and_skip_leaves_weights_and_optimizer_unchanged(tmp_path, pretrained):
    seen = []
    cb = StableAttentionTrainerCallback(on_spike="skip", on_alert=seen.append)
    probe = Probe(steps=[BAD])
    trainer = make_trainer(str(tmp_path), [cb, probe], steps=BAD + 4, weights=pretrained, corrupt=batch_of(BAD))
    trainer.train()

    alerts = read_alerts(tmp_path)
    assert [(a.step, a.metric) for a in seen] == [(a["step"], a["metric"]) for a in alerts]  # callables too
    jsonl = next(counts for channel, counts in cb.alert_delivery.items() if names.ALERTS_FILE in channel)
    assert jsonl["delivered"] == len(alerts) and jsonl["failed"] == 0
    loss = [a for a in alerts if a["metric"] == names.LOSS]
    assert [(a["step"], a["kind"], a["action"]) for a in loss] == [(BAD, "spike", "skip")]
    assert all(a["step"] == BAD for a in alerts)
    # the evidence (docs/ALERTS.md): the schema, the Trainer's step numbering, the skipped update
    assert all(validate_alert(a) == 2 for a in alerts)
    assert loss[0]["loss_window"][-1] == [BAD, pytest.approx(loss[0]["value"])]
    assert [s for s, _ in loss[0]["loss_window"]] == list(range(max(1, BAD - 31), BAD + 1))
    assert loss[0]["lrs"] and loss[0]["lrs"][0] == pytest.approx(loss[0]["lr"])
    assert loss[0]["outcome"]["taken"] == "skip" and loss[0]["outcome"]["update_applied"] is False
    assert loss[0]["grad_norms"]["top"] and loss[0]["ranks"][0]["loss"]["threshold"] == pytest.approx(
        loss[0]["threshold"])
    assert cb.skipped_steps == [BAD]
    assert probe.after[BAD] == probe.before[BAD]  # weights and AdamW moments/step counts bitwise unchanged
    assert probe.after[BAD - 1] == probe.before[BAD]
    assert probe.after[BAD + 1][0] != probe.after[BAD][0]  # and training goes on
    assert trainer.state.global_step == BAD + 4


def test_without_the_callback_the_same_batch_changes_the_weights(tmp_path, pretrained):
    # the baseline the skip test stands on: the garbled step does update a plain run
    probe = Probe(steps=[BAD])
    trainer = make_trainer(str(tmp_path), [probe], steps=BAD, weights=pretrained, corrupt=batch_of(BAD))
    trainer.train()
    assert probe.after[BAD][0] != probe.before[BAD][0] and probe.after[BAD][1] != probe.before[BAD][1]


def test_gradient_accumulation_one_garbled_micro_batch(tmp_path, pretrained):
    cb = StableAttentionTrainerCallback(on_spike="skip")
    probe = Probe(steps=[BAD])
    trainer = make_trainer(str(tmp_path), [cb, probe], steps=BAD + 2, weights=pretrained,
                           corrupt=batch_of(BAD, 2)[1:], gradient_accumulation_steps=2)
    trainer.train()
    assert cb.skipped_steps == [BAD]
    assert probe.after[BAD] == probe.before[BAD]
    # the step's loss is the mean over both micro-batches: the Trainer's logged loss at step 10 is the mean
    # of steps 6..10, and the engine's last seen loss matches the scale of a whole step, not half of one
    assert cb.engine.last[names.LOSS] == pytest.approx(trainer.state.log_history[-2]["loss"], rel=0.2)


def test_rollback_restores_the_last_snapshot(tmp_path, pretrained):
    cb = StableAttentionTrainerCallback(on_spike="rollback", spike_confirm_steps=1, rollback_every=5)
    probe = Probe()
    trainer = make_trainer(str(tmp_path), [cb, probe], steps=BAD + 2, weights=pretrained, corrupt=batch_of(BAD))
    trainer.train()
    assert cb.rollbacks == [(BAD, 10)]
    assert probe.after[BAD] == probe.after[10]  # model and optimizer as they were after step 10
    assert probe.after[BAD + 1][0] != probe.after[10][0]


def test_stop_saves_a_checkpoint_and_stops(tmp_path, pretrained):
    cb = StableAttentionTrainerCallback(on_spike="stop", spike_confirm_steps=1)
    probe = Probe()
    trainer = make_trainer(str(tmp_path), [cb, probe], steps=BAD + 10, weights=pretrained, corrupt=batch_of(BAD))
    trainer.train()
    assert trainer.state.global_step == BAD
    checkpoint = tmp_path / f"checkpoint-{BAD}"
    assert cb.stop_checkpoint == str(checkpoint) and checkpoint.is_dir()
    assert probe.after[BAD] == probe.after[BAD - 1]  # the spiking update was not applied
    # the checkpoint holds the weights of step BAD - 1 and the callback's state
    saved = make_trainer(str(tmp_path / "x"), [], steps=1).model
    from safetensors.torch import load_file

    saved.load_state_dict(load_file(str(checkpoint / "model.safetensors")), strict=False)
    assert digest(saved) == probe.after[BAD - 1][0]
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    engine = state["stateful_callbacks"]["StableAttentionTrainerCallback"]["attributes"]["_checkpoint_state"]
    assert engine["engine"]["alert_count"] == cb.alert_count >= 1
    assert [a["action"] for a in read_alerts(tmp_path) if a["metric"] == names.LOSS] == ["stop"]


def test_resume_keeps_the_detector_state(tmp_path, pretrained):
    first = StableAttentionTrainerCallback()
    trainer = make_trainer(str(tmp_path), [first], steps=20, weights=pretrained, batches=30,
                           save_strategy="steps", save_steps=20)
    trainer.train()
    saved = first.engine.loss_detector.state_dict()

    # the resumed run reads a garbled batch at its 2nd step: a fresh detector has seen one value there and
    # judges NaN/inf only; the restored one has seen 21 and catches the jump
    resumed = StableAttentionTrainerCallback(on_spike="skip")

    class AtStart(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.loaded = json.loads(json.dumps(resumed.engine.loss_detector.state_dict()))

    at_start = AtStart()
    trainer = make_trainer(str(tmp_path), [resumed, at_start], steps=25, weights=pretrained, batches=30,
                           corrupt=batch_of(22), save_strategy="no")
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-20"))
    assert at_start.loaded == json.loads(json.dumps(saved))
    assert resumed.skipped_steps == [22]


def test_restoring_callbacks_from_the_json_is_refused_when_arguments_would_be_lost(tmp_path, pretrained):
    seen = []
    trainer = make_trainer(str(tmp_path), [StableAttentionTrainerCallback(on_alert=seen.append)], steps=5,
                           weights=pretrained, save_strategy="steps", save_steps=5)
    trainer.train()
    again = make_trainer(str(tmp_path), [StableAttentionTrainerCallback(on_alert=seen.append)], steps=8,
                         weights=pretrained, restore_callback_states_from_checkpoint=True)
    with pytest.raises(ValueError, match=r"restore_callback_states_from_checkpoint=False.*|on_alert"):
        again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))


def test_bf16_autocast_run(tmp_path, pretrained):
    cb = StableAttentionTrainerCallback()
    trainer = make_trainer(str(tmp_path), [cb], steps=5, weights=pretrained, bf16=True)
    trainer.train()
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    assert torch.isfinite(torch.tensor(entry["loss"])) and "stable_attn/max_logit/layer1" in entry
    assert cb.alert_count == 0


def test_resume_rolls_back_to_the_snapshot_saved_with_the_checkpoint(tmp_path, pretrained):
    first = StableAttentionTrainerCallback(on_spike="rollback", spike_confirm_steps=1, rollback_every=5)
    probe = Probe()
    trainer = make_trainer(str(tmp_path), [first, probe], steps=12, weights=pretrained, batches=20,
                           save_strategy="steps", save_steps=12)
    trainer.train()
    assert (tmp_path / "checkpoint-12" / "stable_attn_rollback.pt").is_file()

    # resumed at 12, the garbled batch at 14 rolls back to step 10's state, as in an uninterrupted run
    # (a snapshot taken afresh at the resume would be step 12's)
    resumed = StableAttentionTrainerCallback(on_spike="rollback", spike_confirm_steps=1, rollback_every=5)
    after = Probe()
    trainer = make_trainer(str(tmp_path), [resumed, after], steps=15, weights=pretrained, batches=20,
                           corrupt=batch_of(14))
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-12"))
    assert resumed.rollbacks == [(14, 10)]
    assert after.after[14] == probe.after[10]  # weights and optimizer state


def test_a_train_that_raises_is_ended_by_the_next_train(tmp_path, pretrained):
    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise KeyError("user code failed")

    cb = StableAttentionTrainerCallback()
    failing = make_trainer(str(tmp_path), [], steps=6, weights=pretrained)
    failing.add_callback(cb)  # added after construction: its first train() is not guarded
    failing.add_callback(Boom())
    with pytest.raises(KeyError):
        failing.train()
    assert cb.engine.dispatcher is not None  # no Trainer event ran for the failure: the run is still open
    assert "training_step" in vars(failing)

    healthy = make_trainer(str(tmp_path), [cb], steps=4, weights=pretrained)
    healthy.train()  # ends the failed run first (its channels closed, its Trainer unwrapped), then runs
    assert "training_step" not in vars(failing) and "training_step" not in vars(healthy)
    assert cb.engine.dispatcher is None and healthy.state.global_step == 4


def test_a_failure_while_starting_leaves_the_trainer_unwrapped(tmp_path, pretrained, monkeypatch):
    import torch.nn.functional as F

    original_sdpa = F.scaled_dot_product_attention
    cb = StableAttentionTrainerCallback(patch_sdpa=True)
    trainer = make_trainer(str(tmp_path), [cb], steps=2, weights=pretrained)
    with monkeypatch.context() as patch:
        patch.setattr(cb.engine, "train_start", lambda state: (_ for _ in ()).throw(MemoryError("no snapshot")))
        with pytest.raises(MemoryError):
            trainer.train()
    assert "training_step" not in vars(trainer) and "log" not in vars(trainer)
    assert "clip_grad_norm_" not in vars(trainer.accelerator)
    assert F.scaled_dot_product_attention is original_sdpa and cb.engine.dispatcher is None

    losses = []
    monkeypatch.setattr(cb.engine, "add_loss", losses.append)  # the taps call it once per micro-batch
    trainer.train()  # the same callback starts cleanly: its taps wrap the Trainer's own methods, once
    assert len(losses) == 2 and trainer.state.global_step == 2


def test_methods_wrapped_by_someone_else_are_put_back_as_they_were(tmp_path, pretrained):
    cb = StableAttentionTrainerCallback()
    trainer = make_trainer(str(tmp_path), [cb], steps=2, weights=pretrained)
    theirs_step, theirs_log = trainer.training_step, trainer.log  # bound methods, set on the instance

    def training_step(*args, **kwargs):
        return theirs_step(*args, **kwargs)

    def log(*args, **kwargs):
        return theirs_log(*args, **kwargs)

    trainer.training_step, trainer.log = training_step, log
    trainer.train()
    assert trainer.training_step is training_step and trainer.log is log
    assert "clip_grad_norm_" not in vars(trainer.accelerator)


def test_deepspeed_is_refused_before_anything_is_wrapped(tmp_path, pretrained):
    """Under DeepSpeed the update happens inside backward(): the callback could drop none, so it refuses."""
    cb = StableAttentionTrainerCallback(on_spike="skip")
    trainer = make_trainer(str(tmp_path), [cb], steps=2, weights=pretrained)
    # what a DeepSpeed config sets: DeepSpeed 0.19.8 installs on the CPU, but its Trainer builds its CPU ops
    # for minutes before the first event (docs/DISTRIBUTED.md)
    trainer.is_deepspeed_enabled = True

    def train_loop(self):  # the Trainer's loop calls on_train_begin with the Trainer as its ``self``
        cb.on_train_begin(self.args, self.state, TrainerControl(), model=self.model)

    with pytest.raises(ValueError, match=r"does not support DeepSpeed \(TrainingArguments.deepspeed=None\).*"
                                         r"use FSDP2 \(fsdp='full_shard', fsdp_config=\{'version': 2\}\)"):
        train_loop(trainer)
    assert "training_step" not in vars(trainer) and cb.engine.dispatcher is None
