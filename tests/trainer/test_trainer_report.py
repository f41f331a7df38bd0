"""`stable-attn report` on a transformers.Trainer output_dir: trainer_state.json's log_history."""

from __future__ import annotations

import json
import math
import os

from stable_attn.monitor import names
from stable_attn.report import build_report, find_trainer_state, load_run, read_trainer_state, summarize


def write_state(directory, global_step, history):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "trainer_state.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"global_step": global_step, "log_history": history}, f)  # NaN as the Trainer writes it
    return path


HISTORY = [
    {"loss": 2.5, "grad_norm": 0.9, "learning_rate": 1e-3, "stable_attn/saturation/layer0": 0.01,
     "stable_attn/max_logit/layer0": 3.0, "epoch": 0.1, "step": 5},
    {"eval_loss": 2.6, "epoch": 0.1, "step": 5},
    {"loss": float("nan"), "grad_norm": float("inf"), "learning_rate": 1e-3, "stable_attn/saturation/layer0": 0.02,
     "stable_attn/max_logit/layer0": 4.0, "epoch": 0.2, "step": 10},
    {"train_runtime": 1.0, "train_loss": 2.4, "total_flos": 1.0, "epoch": 0.2, "step": 10},
]


def test_log_history_is_read_with_the_callbacks_names(tmp_path):
    metrics = read_trainer_state(write_state(tmp_path, 10, HISTORY))
    assert metrics[names.LOSS].steps.tolist() == [5, 10]
    assert metrics[names.LOSS].values[0] == 2.5 and math.isnan(metrics[names.LOSS].values[1])
    assert metrics[names.VAL_LOSS].values.tolist() == [2.6]
    assert metrics[names.GRAD_NORM].values.tolist() == [0.9, math.inf]
    assert metrics[names.LR].values.tolist() == [1e-3, 1e-3]
    assert metrics["stable_attn/max_logit/layer0"].values.tolist() == [3.0, 4.0]
    assert not any(k.startswith("train_") or k in ("epoch", "total_flos") for k in metrics)


def test_the_newest_checkpoint_state_is_used_with_the_alerts_of_output_dir(tmp_path):
    write_state(tmp_path / "checkpoint-5", 5, HISTORY[:2])
    newest = write_state(tmp_path / "checkpoint-10", 10, HISTORY)
    alert = {"step": 10, "kind": "nonfinite", "metric": names.LOSS, "value": "nan", "action": "skip", "message": ""}
    (tmp_path / names.ALERTS_FILE).write_text(json.dumps(alert) + "\n")
    assert str(find_trainer_state(tmp_path)) == newest
    run = load_run(tmp_path)
    assert str(run.metrics_path) == newest and run.alerts_path == tmp_path / names.ALERTS_FILE
    summary = summarize(run)
    assert summary.alert_counts["nonfinite"] == 1
    assert summary.final_val_loss == (5, 2.6) and summary.last_finite_train_loss == (5, 2.5)
    assert [s.layer for s in summary.layers] == ["layer0"] and summary.layers[0].max_logit == 4.0
    report = build_report(tmp_path).read_text()
    assert "checkpoint-10/trainer_state.json" in report and "| 10 | nonfinite | train/loss |" in report


def test_a_state_without_log_history_is_a_note(tmp_path):
    (tmp_path / "trainer_state.json").write_text('{"global_step": 3}')
    run = load_run(tmp_path)
    assert run.metrics == {} and any("log_history" in n for n in run.notes)
