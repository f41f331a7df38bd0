"""device_skip=True in a real transformers.Trainer on the CPU (tiny GPT-2, a garbled batch): the same weights,
AdamW state, skipped steps and alerts as the host's decision."""

from __future__ import annotations

import json
import os

from trainer_lm import digest, make_trainer, optimizer_digest

from stable_attn.callbacks import StableAttentionTrainerCallback
from stable_attn.monitor import names

BAD = 12  # the optimizer step that reads the garbled batch


def train(out, pretrained, device_skip: bool):
    cb = StableAttentionTrainerCallback(on_spike="skip", device_skip=device_skip)
    trainer = make_trainer(str(out), [cb], steps=BAD + 8, weights=pretrained, corrupt=[BAD - 1])
    trainer.train()
    with open(os.path.join(out, names.ALERTS_FILE), encoding="utf-8") as f:
        alerts = [{k: v for k, v in json.loads(line).items() if k not in ("time", "grad_norms")} for line in f]
    return trainer, cb, alerts


def test_trainer_device_skip_equals_the_host_path(tmp_path, pretrained):
    host_trainer, host, host_alerts = train(tmp_path / "host", pretrained, False)
    dev_trainer, dev, dev_alerts = train(tmp_path / "device", pretrained, True)
    assert host.skipped_steps == [BAD] and dev.skipped_steps == host.skipped_steps
    assert digest(dev_trainer.model) == digest(host_trainer.model)
    assert optimizer_digest(dev_trainer.optimizer) == optimizer_digest(host_trainer.optimizer)
    assert dev_alerts == host_alerts and host_alerts
    assert dev.engine._device.mismatches == 0


def test_every_save_of_the_trainer_sees_the_last_step_read(tmp_path, pretrained):
    """save_strategy="epoch" (and "best") saves after on_epoch_end / on_evaluate, not in on_step_end: the
    last gated step must be read (a dropped one's host-side optimizer state put back) before the optimizer is
    written."""
    cb = StableAttentionTrainerCallback(on_spike="skip", device_skip=True)
    trainer = make_trainer(str(tmp_path), [cb], steps=BAD + 2, weights=pretrained, corrupt=[BAD - 1], batches=BAD,
                           save_strategy="epoch")
    saves, save = [], trainer._save_checkpoint

    def checked_save(*args, **kwargs):
        saves.append((trainer.state.global_step, cb.engine._device.pending))
        return save(*args, **kwargs)

    trainer._save_checkpoint = checked_save
    trainer.train()
    assert [step for step, _ in saves] == [BAD, BAD + 2]
    assert all(pending is None for _, pending in saves), saves
    assert cb.skipped_steps == [BAD]
