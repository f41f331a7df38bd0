"""on_spike="recover" in a real transformers.Trainer on the CPU: the rollback target, the skipped batches
(by fingerprint), a resume inside a skip window, data loader workers, and the escalation to stop."""

from __future__ import annotations

import json
import os

import pytest
import torch
from trainer_lm import BATCH, Batches, digest, make_trainer
from transformers import TrainerCallback

from stable_attn.callbacks import StableAttentionTrainerCallback
from stable_attn.monitor import names
from stable_attn.monitor.loop import batch_fingerprint

BAD = 12  # the optimizer step (Trainer numbering) that reads the garbled batch BAD - 1


def fingerprint_of(batch: int, n: int = 40) -> str:
    data = Batches(n, corrupt=[BAD - 1])
    return batch_fingerprint({"input_ids": torch.stack([data[i]["input_ids"]
                                                        for i in range(batch * BATCH, (batch + 1) * BATCH)])})


class Positions(TrainerCallback):
    """The engine's data position and the weights' digest after every step."""

    def __init__(self, cb) -> None:
        self.cb, self.at, self.weights = cb, {}, {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.at[state.global_step] = dict(self.cb.engine.data_position)
        self.weights[state.global_step] = digest(model)


def recover_cb(**kw):
    options = dict(on_spike="recover", spike_confirm_steps=1, rollback_steps=4, rollback_every=2, skip_batches=3,
                   cooldown_steps=3)
    options.update(kw)
    return StableAttentionTrainerCallback(**options)


def read_alerts(out) -> list[dict]:
    with open(os.path.join(out, names.ALERTS_FILE), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("memory_limit", [None, 0], ids=["in memory", "on disk"])
def test_recover_rolls_back_rollback_steps_and_skips_exactly_the_window(tmp_path, pretrained, memory_limit):
    cb = recover_cb(snapshot_memory_limit=memory_limit)
    pos = Positions(cb)
    trainer = make_trainer(str(tmp_path), [cb, pos], steps=16, weights=pretrained, corrupt=[BAD - 1], batches=40)
    trainer.train()
    ring = cb.engine.recovery.ring
    assert ring.on_disk is (memory_limit == 0)
    if ring.on_disk:  # in the Trainer's output_dir; the end of the run deletes the files
        assert ring.directory == os.path.join(str(tmp_path), "recovery") and os.listdir(ring.directory) == []
    # snapshots every min(2, 4) = 2 steps: the newest at least 4 steps before step 12 is step 8's
    assert cb.rollbacks == [(BAD, 8)]
    assert pos.weights[BAD] == pos.weights[8]
    # step 12 read batch 11; batches 12, 13, 14 are skipped; step 13 reads batch 15, and so on
    assert [pos.at[s]["batch_index"] for s in range(10, 17)] == [9, 10, 11, 15, 16, 17, 18]
    for s in (BAD, BAD + 1, 16):
        assert pos.at[s]["fingerprint"] == fingerprint_of(pos.at[s]["batch_index"])
    assert cb.engine.recovery.skipped_batches == 3 and cb.engine.recovery.used == 1
    recoveries = [a for a in read_alerts(tmp_path) if a["kind"] == "recovery"]
    assert len(recoveries) == 1 and recoveries[0]["action"] == "recover"
    assert "rolled back to step 8, skipping batches 12-14 (epoch 0)" in recoveries[0]["message"]
    assert "recovery 1 of 3" in recoveries[0]["message"]
    # nothing stays wrapped
    assert "get_batch_samples" not in trainer.__dict__ and "training_step" not in trainer.__dict__


def test_two_dataloader_workers_skip_the_same_batches(tmp_path, pretrained):
    runs = []
    for workers in (0, 2):
        cb = recover_cb()
        pos = Positions(cb)
        trainer = make_trainer(str(tmp_path / str(workers)), [cb, pos], steps=16, weights=pretrained,
                               corrupt=[BAD - 1], batches=40, dataloader_num_workers=workers)
        trainer.train()
        runs.append((cb.rollbacks, pos.at, pos.weights[16]))
    assert runs[0] == runs[1]


def test_resume_inside_the_skip_window_continues_it_exactly(tmp_path, pretrained):
    # skip_batches=6: the window is batches 12..17; the checkpoint of step 13 is taken inside it
    first = recover_cb(skip_batches=6)
    pos = Positions(first)
    trainer = make_trainer(str(tmp_path), [first, pos], steps=16, weights=pretrained, corrupt=[BAD - 1],
                           batches=40, save_strategy="steps", save_steps=13)
    trainer.train()
    assert [pos.at[s]["batch_index"] for s in (12, 13, 14)] == [11, 18, 19]

    resumed = recover_cb(skip_batches=6)
    again = Positions(resumed)
    trainer = make_trainer(str(tmp_path), [resumed, again], steps=16, weights=pretrained, corrupt=[BAD - 1],
                           batches=40)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-13"))
    assert resumed.engine.recovery.used == 1  # the recoveries used survive the resume
    for s in (14, 15, 16):
        assert again.at[s] == pos.at[s]
    assert again.weights[16] == pos.weights[16]


def test_a_spike_after_the_last_recovery_stops_with_a_checkpoint(tmp_path, pretrained):
    cb = recover_cb(max_recoveries=1)
    # the garbled batches 11 (step 12) and 22 (read by step 20 once 12..14 are skipped)
    trainer = make_trainer(str(tmp_path), [cb], steps=30, weights=pretrained, corrupt=[BAD - 1, 22], batches=40)
    trainer.train()
    assert cb.engine.recovery.used == 1
    assert trainer.state.global_step == 20
    assert cb.stop_checkpoint == str(tmp_path / "checkpoint-20") and (tmp_path / "checkpoint-20").is_dir()
    stops = [a for a in read_alerts(tmp_path) if a["kind"] == "recovery" and a["action"] == "stop"]
    assert len(stops) == 1 and stops[0]["checkpoint"] == cb.stop_checkpoint


@pytest.mark.parametrize("bad", [dict(skip_batches=-1), dict(max_recoveries=0), dict(lr_factor=0.0),
                                 dict(lr_factor=2.0), dict(rollback_steps=0), dict(cooldown_steps=True),
                                 dict(snapshot_memory_limit=-1), dict(snapshot_memory_limit=1.5)])
def test_bad_arguments_raise_naming_them(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        StableAttentionTrainerCallback(on_spike="recover", **bad)
