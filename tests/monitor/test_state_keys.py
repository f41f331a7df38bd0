"""The checkpoint format of :meth:`MonitorEngine.state_dict`, pinned key by key for each ``on_spike`` (and QK-Clip):
a checkpoint written by one version of the engine must load into the next, so a change of the engine's inner
layout must leave these keys as they are. Each run has a spike, so the optional parts are filled."""

from __future__ import annotations

import pytest
from test_engine import BAD, Loop

from stable_attn.monitor.engine import MonitorEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

COMMON = {
    "loss_detector", "other_rank_loss_detectors", "grad_norm_detector", "other_rank_grad_norm_detectors",
    "alert_kinds", "not_training_streak", "spike_actions", "surge", "alert_count", "skipped_steps", "rollbacks",
    "unconfirmed_grad_norm_jumps", "stop_checkpoint", "layers", "alert_delivery",
}
EXTRA = {
    "warn": set(),
    "skip": set(),
    "stop": set(),
    "rollback": {"rollback_snapshot", "rollback_detectors"},
    "recover": {"recovery"},
    "qk_clip": {"qk_clip"},
}
OPTIONS = {
    "warn": {},
    "skip": {"on_spike": "skip"},
    "stop": {"on_spike": "stop", "spike_confirm_steps": 1},
    "rollback": {"on_spike": "rollback", "spike_confirm_steps": 1, "rollback_every": 4},
    "recover": {"on_spike": "recover", "spike_confirm_steps": 1, "rollback_steps": 4, "rollback_every": 2},
    "qk_clip": {"qk_clip": 0.05},
}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_the_checkpoint_keys_of_each_action_are_pinned(tmp_path, case):
    engine = MonitorEngine(**OPTIONS[case])
    Loop(engine, str(tmp_path)).run(steps=BAD + 2, scale={BAD: 20.0})
    state = engine.state_dict()
    assert set(state) == COMMON | EXTRA[case]
    assert set(state["spike_actions"]) == {"count", "quiet", "lasted"}
    assert set(state["alert_kinds"]) == {"spike", "early_warning", "nonfinite", "not_training", "qk_clip", "recovery"}
    for counts in state["alert_delivery"].values():
        assert set(counts) == {"delivered", "failed", "dropped", "abandoned"}
    assert state["alert_count"] >= 1
    if case == "rollback":
        assert set(state["rollback_snapshot"]) == {"step", "model", "optimizers", "schedulers", "precision", "cpu_rng",
                                                   "cuda_rng"}
        assert set(state["rollback_detectors"]) == {"train/loss", "train/grad_norm"}
        assert state["rollbacks"] == [[BAD, 12]]
    if case == "recover":
        assert set(state["recovery"]) == {"used", "last_step", "lr_until", "skipped_batches", "window", "stream",
                                          "history"}
        assert set(state["recovery"]["history"][0]) == {"step", "rolled_back_to", "window"}
    if case == "qk_clip":
        assert set(state["qk_clip"]) == {"tau", "alpha", "clip_steps"}
        assert state["qk_clip"]["clip_steps"] > 0
    if case == "stop":
        assert state["stop_checkpoint"] is not None
