"""StableAttentionTrainerCallback(qk_clip=tau) end to end in a transformers.Trainer on the CPU.

The tiny models and the exact per-step edit check are tests/callbacks/qk_clip_lm.py's (the Lightning tests use
them too). The Trainer numbers a step by the update it makes (1-based): metrics, alerts and skips use it.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from stable_attn.callbacks import StableAttentionTrainerCallback
from stable_attn.monitor import names
from stable_attn.monitor.alerts.schema import validate_alert

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "callbacks"))

from qk_clip_lm import (  # noqa: E402 - tests/callbacks, put on the path above
    BATCH,
    EditCheck,
    assert_moments_equal,
    batches,
    group_max_logits,
    head_max_logits,
    moments,
    params,
    read_alerts,
    tau_between,
    tiny_model,
)


class Rows(Dataset):
    """The micro-batches of qk_clip_lm.batches, row by row, in order."""

    def __init__(self, micro_batches: list[torch.Tensor]) -> None:
        self.rows = [r for b in micro_batches for r in b]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class Before(TrainerCallback):
    """Listed before the callback under test: sees each step before its clip."""

    def __init__(self, check: EditCheck) -> None:
        self.check = check

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.check.step_logits()

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.check.before_clip(optimizer)


class After(TrainerCallback):
    def __init__(self, check: EditCheck, skipped=()) -> None:
        self.check, self.skipped = check, skipped

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.check.after_clip(state.global_step, optimizer, applied=state.global_step not in self.skipped)


class NaNLoss(TrainerCallback):
    """The logits (so the loss) of optimizer step ``step`` are NaN: a forward hook on the LM head."""

    def __init__(self, model, step: int) -> None:
        self.step, self.on = step, False
        model.lm_head.register_forward_hook(lambda m, i, out: out * math.nan if self.on else None)

    def on_step_begin(self, args, state, control, **kwargs):
        self.on = state.global_step + 1 == self.step


def train(out, family, qk_clip, *, steps, data, accumulate=1, nan_step=None, resume=None, save_steps=None,
          **cb_kwargs):
    model = tiny_model(family)
    cb = StableAttentionTrainerCallback(qk_clip=qk_clip, **cb_kwargs)
    check = EditCheck(model, qk_clip or math.inf)
    skipped = (nan_step,) if nan_step is not None else ()
    callbacks = [Before(check), cb, After(check, skipped)]
    if nan_step is not None:
        callbacks.insert(0, NaNLoss(model, nan_step))
    args = TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=BATCH, gradient_accumulation_steps=accumulate,
        learning_rate=1e-2, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=2, report_to="none",
        use_cpu=True, train_sampling_strategy="sequential", disable_tqdm=True, seed=0, dataloader_num_workers=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Rows(data), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, cb, check


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_trainer_clips_every_step_exactly_logs_and_alerts(tmp_path, family):
    """Two micro-batches per step, 3 steps: each step's edit is the one its statistics (the MAX over both
    micro-batches) call for, its metrics are in the Trainer's log history at its step, the first clip writes
    one schema-valid qk_clip alert."""
    data = batches(6)
    groups = group_max_logits(tiny_model(family), data[:2])
    tau = tau_between(groups)
    trainer, cb, check = train(tmp_path, family, tau, steps=3, accumulate=2, data=data)

    assert trainer.state.global_step == 3 and check.checked == [1, 2, 3]
    heads = head_max_logits(tiny_model(family), data[:2])  # step 1's statistics: the MAX over both micro-batches
    for n in heads:
        torch.testing.assert_close(check.history_S[1][n], heads[n], rtol=1e-6, atol=0)
    assert check.clipped[1]["layer0"] == (groups["layer0"] > tau).nonzero().flatten().tolist()
    assert 0 < len(check.clipped[1]["layer0"]) < len(groups["layer0"])
    history = {}
    for entry in trainer.state.log_history:
        if names.QK_CLIP_HEADS in entry:
            assert entry["step"] not in history
            history[entry["step"]] = entry
    clip_steps = [s for s in check.checked if check.clipped[s]]
    assert sorted(history) == clip_steps and cb.engine._qk.clip_steps == len(clip_steps)
    group = 2 if family == "llama" else 1
    for step in clip_steps:
        assert history[step][names.QK_CLIP_HEADS] == group * sum(len(g) for g in check.clipped[step].values())
        for layer in check.clipped[step]:
            assert history[step][names.qk_clip_metric(layer)] == check.history[step][layer]
    alerts = [a for a in read_alerts(tmp_path) if a["kind"] == "qk_clip"]
    assert len(alerts) == 1 and alerts[0]["step"] == 1 and validate_alert(alerts[0]) == 2
    assert alerts[0]["threshold"] == pytest.approx(tau) and cb.alert_kinds["qk_clip"] == 1


def test_trainer_one_step_against_a_plain_run(tmp_path):
    """Against the same step without qk_clip: the unclipped groups' rows, every other parameter and the
    AdamW moments are the same bits, the clipped rows the plain run's times (tau / S) ** 0.5."""
    data = batches(1)
    plain, _, plain_check = train(tmp_path / "plain", "llama", None, steps=1, data=data, log_every_n_steps=1)
    assert plain_check.checked == [1] and plain_check.clipped[1] == {}
    tau = float(plain_check.S["layer0"].view(2, 2).amax(1).mean())
    trainer, _, check = train(tmp_path / "clip", "llama", tau, steps=1, data=data, log_every_n_steps=1)
    assert len(check.clipped[1]["layer0"]) == 1
    for n in plain_check.S:
        assert torch.equal(check.S[n], plain_check.S[n])
    replay = EditCheck(trainer.model, tau)
    replay.S, replay._before, replay._moments = check.S, params(plain.model), moments(plain.optimizer)
    replay.after_clip(1, trainer.optimizer)
    assert_moments_equal(moments(plain.optimizer), moments(trainer.optimizer))


def test_trainer_skipped_step_is_not_clipped(tmp_path):
    data = batches(4)
    tau = tau_between(group_max_logits(tiny_model("gpt2"), data[:1]))
    trainer, cb, check = train(tmp_path, "gpt2", tau, steps=4, data=data, nan_step=3, on_spike="skip")
    assert cb.skipped_steps == [3] and check.checked == [1, 2, 3, 4]
    assert check.clipped[3] == {} and check.clipped[2] and check.clipped[4]
    assert cb.engine._qk.clip_steps == 3
    assert not any(names.QK_CLIP_HEADS in e for e in trainer.state.log_history if e.get("step") == 3)


def test_trainer_resume_keeps_the_qk_clip_count(tmp_path):
    """resume_from_checkpoint: the clip count comes back from trainer_state.json, so the resumed run's clips
    raise no second "first clip" alert."""
    data = batches(4)
    tau = tau_between(group_max_logits(tiny_model("gpt2"), data[:1]))
    _, cb, _ = train(tmp_path, "gpt2", tau, steps=2, data=data, save_steps=2)
    assert cb.engine._qk.clip_steps == 2 and len(read_alerts(tmp_path)) == 1
    os.remove(os.path.join(tmp_path, names.ALERTS_FILE))
    _, cb2, check = train(tmp_path, "gpt2", tau, steps=4, data=data, resume=str(tmp_path / "checkpoint-2"))
    assert check.checked == [3, 4] and all(check.clipped[s] for s in (3, 4))
    assert cb2.engine._qk.clip_steps == 4 and cb2.alert_kinds["qk_clip"] == 1
    assert read_alerts(tmp_path) == []
