"""StableAttentionCallback with its DEFAULT arguments, as a new user runs it: a real Lightning Trainer on
the CPU, the tiny byte-level GPT-2 of callback_lm.py, real text.

- a corrupted batch (the text garbled as if decoded with the wrong codec) at step 10, 20, 50, 90, 110 or
  130 of a fine-tuning run is alerted on that very step, and nothing before it;
- healthy runs (fine-tuning, and training from scratch at lr 3e-3) raise no alert of any kind;
- ``stable-attn report`` on the run directory shows the alert the callback wrote;
- a healthy low-loss run (memorising a pattern, loss 0.005-0.2 nats with batch noise up to several times
  the loss) with ``on_spike="skip"`` skips nothing and ends with the weights of the run that only warns,
  and a corrupted batch in it is still skipped.
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from callback_lm import BATCH, ByteLM, PeriodicBytes, batches_loader, trainer
from torch.utils.data import DataLoader

from stable_attn.callbacks import StableAttentionCallback
from stable_attn.cli import main
from stable_attn.monitor import Alert
from stable_attn.monitor.names import ALERTS_FILE


def fit_defaults(tmp_path, weights, steps: int, corrupt=(), log_every: int = 50):
    """``log_every``: the Trainer's ``log_every_n_steps`` (50, its default), which the callback follows."""
    received: list[Alert] = []
    cb = StableAttentionCallback(on_alert=received.append)
    L.seed_everything(0, verbose=False)
    t = trainer(tmp_path, [cb], steps, log_every_n_steps=log_every)
    t.fit(ByteLM(weights=weights), batches_loader(range(steps), corrupt_batches=corrupt))
    return t, cb, received


# 10-90: the gross-jump rule's time; 110-130: around the calibrated rule's take-over (~100-130 steps)
@pytest.mark.parametrize("bad", [10, 20, 50, 90, 110, 130])
def test_a_corrupted_batch_is_caught_on_its_step(tmp_path, pretrained, bad):
    t, cb, received = fit_defaults(tmp_path, pretrained, bad + 2, corrupt=(bad,))
    assert t.global_step == bad + 2
    assert received, f"no alert for the corrupted batch at step {bad}"
    assert {a.step for a in received} == {bad}, [a.format() for a in received]
    assert "train/loss" in {a.metric for a in received if a.kind == "spike"}


def test_a_healthy_fine_tuning_run_raises_no_alert(tmp_path, pretrained, caplog):
    # every step monitored: the early-warning detectors see all 150 values of every layer's statistics
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        t, cb, received = fit_defaults(tmp_path, pretrained, 150, log_every=1)
    assert t.global_step == 150
    assert received == [], [a.format() for a in received]
    assert cb.alert_count == 0 and cb.skipped_steps == []
    # what the user sees: the swap, detection becoming active, and the summary, all at WARNING
    messages = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert any("switched 1 transformers model(s)" in m for m in messages)
    assert any("spike detection active from step" in m and "train/loss" in m for m in messages)
    assert messages[-1].startswith("StableAttentionCallback: 0 alert(s) (spike 0, nonfinite 0")


def test_training_from_scratch_at_a_high_learning_rate_raises_no_alert(tmp_path):
    # lr 3e-3 from random weights: the max logit grows and attention sinks form while the model learns
    t, cb, received = fit_defaults(tmp_path, None, 150, log_every=1)
    assert t.global_step == 150
    assert received == [], [a.format() for a in received]


def test_the_report_shows_the_alert_of_a_default_run(tmp_path, pretrained, capsys):
    bad = 30
    t, cb, received = fit_defaults(tmp_path, pretrained, bad + 3, corrupt=(bad,))
    assert (t.log_dir.rstrip("/").rsplit("/", 1)[-1]) == "version_0"  # trainer.log_dir: RUN_DIR/run/version_0
    assert (tmp_path / "run" / "version_0" / ALERTS_FILE).is_file()
    assert main(["report", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    n_spikes = sum(a.kind == "spike" for a in received)
    assert n_spikes >= 1 and f"spike {n_spikes}" in printed
    md = (tmp_path / "report.md").read_text()
    assert f"| {bad} | spike | train/loss |" in md
    assert f"| alerts: spike | {n_spikes} |" in md


# ---------------------------------------------------------------- a healthy low-loss run
def fit_periodic(tmp_path, steps: int, on_spike: str, seed: int = 1, corrupt=()):
    received: list[Alert] = []
    cb = StableAttentionCallback(on_spike=on_spike, on_alert=received.append)
    L.seed_everything(seed, verbose=False)
    t = trainer(tmp_path, [cb], steps)
    module = ByteLM()
    t.fit(module, DataLoader(PeriodicBytes(steps, seed, corrupt), batch_size=BATCH))
    return module, cb, received


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_healthy_low_loss_run_skips_nothing(tmp_path, seed):
    # Why the bars are noise-relative and gated: a fixed gross rule (1.25x the median of 5) and jump rules
    # blind to this noise flag 30-35 of 200 healthy steps from step ~60 on, and "skip" drops 68-72 updates.
    # Noise-relative bars alone still skip 1 and 5 steps at seeds 1 and 2 (a batch with several random bytes,
    # the Poisson tail of a noise whose median lies far below its mean, read as a jump at 0.1 nats); the
    # noisy-loss gate (noisy_progress_share=0.1: at 10-14% noise such a batch undoes 3-6% of the progress)
    # leaves none, and skip leaves the weights as the run that only warns.
    module, cb, received = fit_periodic(tmp_path, 200, "skip", seed=seed)
    assert cb.skipped_steps == [], [a.format() for a in received]
    assert [a for a in received if a.kind == "spike"] == [], [a.format() for a in received]
    reference, _, _ = fit_periodic(tmp_path / "warn", 200, "warn", seed=seed)
    for (name, a), b in zip(module.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("bad", [30, 120])
def test_a_corrupted_batch_of_the_low_loss_run_is_still_skipped(tmp_path, bad):
    module, cb, received = fit_periodic(tmp_path, bad + 2, "skip", corrupt=(bad,))
    assert cb.skipped_steps == [bad], [a.format() for a in received]
    # caught by the loss at step 30; at 120 (loss ~0.01-0.2) the loss's bar is the larger of its relative
    # and absolute noise readings, and this noise inflates the relative one: there only the gradient norm
    assert {a.step for a in received} == {bad}
