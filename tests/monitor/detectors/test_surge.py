"""SurgeDetector: early warnings when a per-layer attention statistic surges while the loss stalls.

The ``"surge"`` rule (a rise above absolute floors and the statistic's own baseline while the loss
has stopped improving), the ``"level"`` rule, non-finite values, state round trips and validation,
on synthetic traces: noise near zero, and attention statistics that grow while the model learns.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from detector_runs import run

from stable_attn.monitor import SurgeDetector


def test_saturation_noise_near_zero_never_fires_and_a_surge_does() -> None:
    rng = np.random.default_rng(20)
    noise = rng.uniform(0.0, 0.01, 500) * (rng.random(500) < 0.3)  # mostly exactly 0, sometimes up to 1%
    det = SurgeDetector.saturation("stable_attn/saturation/layer2")
    assert run(det, noise) == []
    event = det.update(500, 0.3)
    assert event is not None and event.kind == "early_warning" and event.rule == "surge"
    assert event.metric == "stable_attn/saturation/layer2"
    assert event.threshold >= event.baseline + 0.05
    # A small rise (below the 5-point floor) is not a surge.
    assert det.update(501, 0.04) is None


def test_max_logit_surge_and_no_observation() -> None:
    rng = np.random.default_rng(21)
    det = SurgeDetector.max_logit("stable_attn/max_logit/layer0")
    assert run(det, 52.0 + 0.5 * rng.standard_normal(300)) == []
    state = det.state_dict()
    assert det.update(300, -math.inf) is None  # AttentionStats saw no rows
    assert det.state_dict() == state
    assert det.update(301, 56.0) is None  # +4: within noise floors
    event = det.update(302, 80.0)
    assert event is not None and event.kind == "early_warning"
    assert 51.0 < event.baseline < 53.0
    nan_event = det.update(303, math.nan)
    assert nan_event is not None and nan_event.kind == "nonfinite" and nan_event.is_new


def test_surge_does_not_poison_and_sustained_surge_is_accepted() -> None:
    rng = np.random.default_rng(22)
    det = SurgeDetector.saturation(rebaseline_after=10)
    run(det, 0.02 + 0.002 * rng.standard_normal(200))
    baseline = det.baseline
    events = run(det, [0.4] * 30, start=200)
    assert [e.step for e in events] == list(range(200, 210))
    assert events[0].baseline == pytest.approx(baseline)
    assert det.baseline == pytest.approx(0.4)


def test_surge_state_round_trip() -> None:
    rng = np.random.default_rng(23)
    values = np.concatenate([60 + rng.standard_normal(200), [90.0, 91.0], 60 + rng.standard_normal(100)])
    reference = SurgeDetector.max_logit()
    run(reference, values[:150])
    state = json.loads(json.dumps(reference.state_dict(), allow_nan=False))
    restored = SurgeDetector.max_logit()
    restored.load_state_dict(state)
    expected = run(reference, values[150:], start=150)
    assert [e.step for e in expected] == [200, 201]
    assert run(restored, values[150:], start=150) == expected


def test_surge_validation() -> None:
    with pytest.raises(ValueError, match="ratio"):
        SurgeDetector("x", min_delta=1.0, ratio=0.5)
    with pytest.raises(ValueError, match="min_delta"):
        SurgeDetector("x", min_delta=0.0)
    with pytest.raises(TypeError):
        SurgeDetector("x")  # type: ignore[call-arg]  # min_delta is required: its scale depends on the metric


# -------------------------------------------------------------------- rules, with and without a loss
def learning_run(steps: int = 600, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A healthy run: the loss falls while the max logit rises from ~1 to ~300 and settles."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=np.float64)
    loss = (2.0 + 3.5 * (1.0 + t / 30.0) ** -0.8) * np.exp(0.03 * rng.standard_normal(steps))
    logit = (1.0 + 300.0 * (1.0 - np.exp(-t / 150.0))) * np.exp(0.05 * rng.standard_normal(steps))
    return loss, logit


def test_max_logit_growing_while_the_loss_falls_is_silent() -> None:
    loss, logit = learning_run()
    assert run(SurgeDetector.max_logit(), logit, loss) == []
    # The case, a small healthy run: max logit 1 -> 7, without a loss passed at all.
    assert run(SurgeDetector.max_logit(), np.linspace(1.0, 7.0, 100)) == []


def test_max_logit_growing_while_the_loss_stalls_warns() -> None:
    loss, logit = learning_run()
    stalled = np.r_[loss[:200], np.full(400, loss[200]) * np.exp(0.03 * np.random.default_rng(1).standard_normal(400))]
    # +2% per step with no progress, kept below the alarm level (1000) so that only the surge rule can fire
    rising = np.r_[logit[:200], np.minimum(logit[200] * 1.02 ** np.arange(1, 401), 900.0)]
    events = run(SurgeDetector.max_logit(), rising, stalled)
    assert events and events[0].kind == "early_warning" and events[0].rule == "surge"
    assert 200 < events[0].step < 350  # the slow loss average forgets the descent in ~100 updates
    assert events[0].value >= 50.0


def test_max_logit_alarm_level_fires_whatever_the_loss_does() -> None:
    loss, logit = learning_run()
    logit[400:] *= 5.0  # ~1500: beyond any healthy run measured, while the loss still falls
    events = run(SurgeDetector.max_logit(), logit, loss)
    assert events and events[0].step == 400 and events[0].rule == "level"
    assert events[0].threshold == 1000.0
    # Without the alarm level only the surge rule speaks, and only once the loss has flattened.
    later = run(SurgeDetector.max_logit(alarm_level=math.inf), logit, loss)
    assert later and later[0].step > 400 and {e.rule for e in later} == {"surge"}


def test_saturation_climbing_while_learning_is_silent_and_while_stalled_warns() -> None:
    rng = np.random.default_rng(2)
    loss, _ = learning_run(seed=2)
    sat = np.clip(0.3 * (1.0 - np.exp(-np.arange(600) / 100.0)) + 0.01 * rng.standard_normal(600), 0.0, 1.0)
    assert run(SurgeDetector.saturation(), sat, loss) == []
    flat = np.full(600, 3.0) * np.exp(0.02 * rng.standard_normal(600))
    climbing = np.r_[np.full(300, 0.02), np.linspace(0.02, 0.6, 300)] + 0.002 * rng.standard_normal(600)
    events = run(SurgeDetector.saturation(), climbing, flat)
    assert events and 300 < events[0].step < 450


def test_surge_waits_for_loss_history_and_ignores_nonfinite_loss() -> None:
    det = SurgeDetector.max_logit()
    assert det.loss_improving is None
    for i in range(49):
        assert det.update(i, 60.0, loss=3.0) is None
        assert det.loss_improving is True  # not enough history to judge progress: silent
    det.update(49, 60.0, loss=math.nan)
    det.update(50, 60.0, loss=3.0)
    assert det.loss_improving is False
    event = det.update(51, 200.0, loss=3.0)
    assert event is not None and event.kind == "early_warning"


def test_surge_min_level_and_version_1_state() -> None:
    det = SurgeDetector("x", min_delta=1.0, ratio=1.5, min_level=10.0)
    run(det, np.full(50, 2.0))
    assert det.update(50, 8.0) is None  # 4x its baseline, but below the absolute floor
    event = det.update(51, 12.0)
    assert event is not None and event.threshold == pytest.approx(10.0)
    state = det.state_dict()
    for key in ("loss_fast", "loss_slow", "losses"):
        state.pop(key)
    state["version"] = 1
    restored = SurgeDetector("x", min_delta=1.0, ratio=1.5, min_level=10.0)
    restored.load_state_dict(state)
    assert restored.baseline == det.baseline and restored.loss_improving is None


def test_surge_new_argument_validation() -> None:
    with pytest.raises(ValueError, match="loss_slow_rate"):
        SurgeDetector("x", min_delta=1.0, loss_fast_rate=0.01, loss_slow_rate=0.1)
    with pytest.raises(ValueError, match="min_level"):
        SurgeDetector("x", min_delta=1.0, min_level=math.nan)
    with pytest.raises(ValueError, match="alarm_level"):
        SurgeDetector("x", min_delta=1.0, min_level=5.0, alarm_level=5.0)
    with pytest.raises(ValueError, match="min_improvement"):
        SurgeDetector("x", min_delta=1.0, min_improvement=-0.1)
