"""monitor/names.py is the one place for the names the callback writes and the report reads."""

from __future__ import annotations

import inspect

import pytest

from stable_attn import report
from stable_attn.callbacks import StableAttentionCallback
from stable_attn.monitor import alerts, names
from stable_attn.monitor.layer_stats import STAT_NAMES


def test_every_reader_and_writer_uses_the_same_names():
    assert alerts.ALERT_KINDS is names.ALERT_KINDS and report.ALERT_KINDS is names.ALERT_KINDS
    assert "not_training" in names.ALERT_KINDS
    default = inspect.signature(StableAttentionCallback).parameters["alerts_file"].default
    assert default == names.ALERTS_FILE == report.ALERTS_FILE
    assert STAT_NAMES is names.LAYER_STATS
    with pytest.raises(ValueError, match="kind must be one of"):
        alerts.Alert(step=1, kind="loss_spike", metric="train/loss", value=1.0)
    alerts.Alert(step=1, kind="not_training", metric=names.NOT_TRAINING, value=10.0)


@pytest.mark.parametrize("layer", ["layer0", "layer12", "model.layer0", "encoder.block.3"])
@pytest.mark.parametrize("stat", names.LAYER_STATS)
def test_layer_metric_round_trip(stat, layer):
    name = names.layer_metric(stat, layer)
    assert name == f"stable_attn/{stat}/{layer}"
    assert names.parse_layer_metric(name) == (stat, layer)


def test_layer_metric_rejects_what_it_cannot_round_trip():
    for name in ("stable_attn/alerts", "stable_attn/temperature/layer0", "train/loss", "stable_attn/saturation/a/b"):
        assert names.parse_layer_metric(name) is None, name
    with pytest.raises(ValueError, match="stat='temperature'"):
        names.layer_metric("temperature", "layer0")
    with pytest.raises(ValueError, match="layer='a/b'"):
        names.layer_metric("saturation", "a/b")


def test_checkpoint_and_trainer_names():
    from stable_attn.callbacks import trainer as trainer_callback

    assert names.stop_checkpoint(7) == "stable_attn-stop-step=7.ckpt"
    assert names.trainer_checkpoint(12) == "checkpoint-12"
    assert trainer_callback.SNAPSHOT_FILE == names.ROLLBACK_SNAPSHOT_FILE == "stable_attn_rollback.pt"
    assert report.TRAINER_STATE_FILE == names.TRAINER_STATE_FILE == "trainer_state.json"
    # the report reads the Trainer's log names as the callback leaves them to the Trainer
    assert getattr(report, "_TRAINER_NAMES", names.TRAINER_LOGS) == names.TRAINER_LOGS
    assert set(trainer_callback._TRAINER_LOGS) == {names.LOSS, names.GRAD_NORM, names.LR, names.VAL_LOSS}
