"""SpikeDetector on synthetic training traces with known anomalies (SurgeDetector: test_surge.py)."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from detector_runs import run

from stable_attn.monitor import SpikeDetector, SurgeDetector


def lm_trace(
    seed: int, steps: int = 3000, sigma: float = 0.02, hard_rate: float = 0.01
) -> tuple[np.ndarray, np.ndarray]:
    """A decaying LM loss with Gaussian noise (absolute sigma) and hard batches 2-4 sigma above the curve.

    Returns (values, clean curve)."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=np.float64)
    curve = 2.5 + 6.0 * (1.0 + t / 80.0) ** -0.5
    noise = rng.standard_normal(steps)
    hard = rng.random(steps) < hard_rate
    noise[hard] = rng.uniform(2.0, 4.0, hard.sum())
    return curve + sigma * noise, curve


@pytest.mark.parametrize("seed", range(4))
def test_single_spike_flagged_at_its_step_and_nowhere_else(seed: int) -> None:
    values, _ = lm_trace(seed)
    step = 1200 + 311 * seed
    values[step] += 12 * 0.02  # a corrupted batch: 12 sigma above the curve
    events = run(SpikeDetector(), values)
    assert [e.step for e in events] == [step]
    event = events[0]
    assert event.kind == "spike" and event.rule == "jump" and event.is_new and event.run_length == 1
    assert event.metric == "train/loss"
    assert event.baseline < event.threshold < event.value
    assert event.score > 6.0


def test_spike_with_recovery_alerts_within_two_steps_and_once() -> None:
    values, curve = lm_trace(10)
    onset = 1500
    # Rises over 2 steps to 40 sigma, then recovers with a time constant of 15 steps.
    dev = np.concatenate([[20.0, 40.0], 40.0 * np.exp(-np.arange(1, 120) / 15.0)]) * 0.02
    values[onset : onset + len(dev)] += dev
    events = run(SpikeDetector(), values)
    assert events, "spike not detected"
    assert onset <= events[0].step <= onset + 2
    assert all(onset <= e.step < onset + len(dev) for e in events)
    assert [e.is_new for e in events].count(True) == 1
    assert [e.run_length for e in events] == list(range(1, len(events) + 1))


def test_hard_batches_within_noise_do_not_alert() -> None:
    values, _ = lm_trace(3, steps=4000, hard_rate=0.05)  # 5% of steps are 2-4 sigma hard batches
    assert run(SpikeDetector(), values) == []


def test_steep_decay_and_changing_noise_do_not_alert() -> None:
    rng = np.random.default_rng(5)
    steps = 4000
    t = np.arange(steps, dtype=np.float64)
    curve = 2.0 + 8.0 * np.exp(-t / 150.0) + 1.5 * (1.0 + t / 30.0) ** -0.7
    # Noise grows threefold over the run, and jumps by 1.5x at step 2500.
    sigma = 0.01 * (1.0 + 2.0 * t / steps) * np.where(t >= 2500, 1.5, 1.0)
    values = curve + sigma * rng.standard_normal(steps)
    assert run(SpikeDetector(), values) == []


def test_gradient_norm_like_series() -> None:
    """Log-normal noise of 20% around a slowly rising norm; a 5x jump is flagged, nothing else."""
    rng = np.random.default_rng(7)
    steps = 3000
    norm = 0.5 * np.exp(np.arange(steps) / steps * 0.4) * np.exp(0.2 * rng.standard_normal(steps))
    norm[2000] *= 5.0
    events = run(SpikeDetector.grad_norm(), norm)
    assert [e.step for e in events] == [2000]
    assert events[0].metric == "train/grad_norm"


def test_nonfinite_always_alerts_even_in_warmup_and_does_not_touch_the_baseline() -> None:
    values, _ = lm_trace(1, steps=2000)
    det = SpikeDetector()
    assert run(det, values[:5]) == []
    event = det.update(5, math.nan)
    assert event is not None and event.kind == "nonfinite" and event.rule == "nonfinite"
    assert math.isnan(event.value) and event.score == math.inf
    assert not det.ready
    events = run(det, values[6:1000], start=6)
    assert events == []
    before = det.baseline
    for step, bad in ((1000, math.inf), (1001, -math.inf), (1002, math.nan)):
        event = det.update(step, bad)
        assert event is not None and event.kind == "nonfinite"
        assert event.is_new == (step == 1000) and event.run_length == step - 999
        assert math.isfinite(event.baseline) and math.isfinite(event.threshold)
    assert abs(math.log(det.baseline / before)) < 0.01
    assert run(det, values[1003:], start=1003) == []


def test_kind_change_within_an_episode_is_new() -> None:
    values, _ = lm_trace(2, steps=1000)
    det = SpikeDetector()
    run(det, values[:800])
    first = det.update(800, 50.0)
    second = det.update(801, math.nan)
    third = det.update(802, math.nan)
    assert (first.kind, first.is_new) == ("spike", True)
    assert (second.kind, second.is_new, second.run_length) == ("nonfinite", True, 2)
    assert (third.kind, third.is_new, third.run_length) == ("nonfinite", False, 3)


def test_warmup_blocks_calibrated_rules_but_not_gross_jumps_or_nonfinite() -> None:
    values, _ = lm_trace(4, steps=400)
    values[40] *= 1.03  # 3% (about 5 sigma): a calibrated jump, not a gross or provisional one
    values[50] *= 3.0
    det = SpikeDetector(warmup=100)
    events = run(det, values[:100])
    assert [(e.step, e.rule) for e in events] == [(50, "gross")]
    assert not det.ready and det.phase == "gross"
    run(det, values[100:])
    assert det.ready and det.phase == "calibrated"
    with pytest.raises(ValueError, match="warmup"):
        SpikeDetector(warmup=-1)


def test_flagged_values_do_not_poison_the_baseline() -> None:
    values, curve = lm_trace(6, steps=3000)
    det = SpikeDetector()
    run(det, values[:1500])
    expected = curve[1500]
    start_error = abs(math.log(det.baseline / expected))
    # A 30-step plateau 25 sigma high (shorter than rebaseline_after): every step flagged.
    plateau = values[1500:1530] + 25 * 0.02
    events = run(det, plateau, start=1500)
    assert [e.step for e in events] == list(range(1500, 1530))
    # The forecast only extrapolated its (decayed) trend: still near the clean curve, not the plateau.
    assert abs(math.log(det.baseline / curve[1530])) < start_error + 0.01
    assert det.baseline < curve[1530] + 3 * 0.02
    # Back to normal: no alerts, and the next spike is caught at its step.
    tail = values[1530:].copy()
    tail[500] += 10 * 0.02
    events = run(det, tail, start=1530)
    assert [e.step for e in events] == [2030]


def test_persistent_level_shift_rebaselines_and_goes_quiet() -> None:
    values, _ = lm_trace(8, steps=3000)
    values[1500:] *= 1.3  # a permanent 30% rise: flagged until accepted as the new level
    det = SpikeDetector(rebaseline_after=40)
    events = run(det, values)
    steps = [e.step for e in events]
    assert steps[0] == 1500
    assert steps == list(range(1500, 1540))
    assert det.ready
    assert abs(det.baseline / values[-200:].mean() - 1.0) < 0.02


def test_slow_explosion_flagged_early_by_the_drift_rule() -> None:
    values, curve = lm_trace(9, steps=3000)
    start = 2000
    dev = 0.5 * 1.03 ** np.arange(1000)  # sigmas, +3% per step
    values[start:] += np.minimum(dev * 0.02, 8.0)
    events = run(SpikeDetector(), values)
    assert events and events[0].step >= start
    first = events[0]
    # Flagged before the deviation reaches 10 sigma (about 0.2 nats on a ~3 nat loss).
    assert dev[first.step - start] < 10.0
    assert {e.rule for e in events} <= {"drift", "jump", "gross"}  # gross: after a re-baseline
    assert "drift" in {e.rule for e in events[:3]}


def test_state_dict_round_trip_gives_identical_future_decisions() -> None:
    values, _ = lm_trace(11, steps=3000)
    values[2000] += 0.5
    values[2300:2330] += 0.4
    values[2600] = math.nan
    values[2700:] *= 1.02 ** np.arange(300)
    reference = SpikeDetector()
    head = run(reference, values[:1800])
    state = reference.state_dict()

    via_json = json.loads(json.dumps(state, allow_nan=False))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    via_torch = torch.load(buffer, weights_only=True)

    # repr() compares floats exactly and NaN equal to NaN.
    tail = [repr(e) for e in run(reference, values[1800:], start=1800)]
    assert len(tail) > 30, "the tail must contain decisions to compare"
    for restored_state in (via_json, via_torch):
        restored = SpikeDetector()
        restored.load_state_dict(restored_state)
        assert [repr(e) for e in run(restored, values[1800:], start=1800)] == tail
        assert restored.state_dict() == reference.state_dict()
    assert head == []


def test_state_dict_rejects_foreign_state() -> None:
    det = SpikeDetector()
    state = det.state_dict()
    with pytest.raises(ValueError, match="version"):
        det.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="SurgeDetector"):
        det.load_state_dict(SurgeDetector.saturation().state_dict())
    with pytest.raises(ValueError, match="missing"):
        det.load_state_dict({k: v for k, v in state.items() if k != "level"})
    with pytest.raises(TypeError, match="mapping"):
        det.load_state_dict([1, 2])  # type: ignore[arg-type]


def test_linear_space_and_both_directions() -> None:
    rng = np.random.default_rng(12)
    values = -1.0 + 0.05 * rng.standard_normal(1500)  # a metric that is negative: log space impossible
    values[1000] += 1.0
    values[1200] -= 1.0
    up = run(SpikeDetector("reward", log_space=False), values)
    both = run(SpikeDetector("reward", log_space=False, direction="both"), values)
    assert [e.step for e in up] == [1000]
    assert [e.step for e in both] == [1000, 1200]
    assert both[1].score < -6.0


def test_flat_series_level_can_still_move() -> None:
    det = SpikeDetector(warmup=20)
    run(det, [3.0] * 200)
    # A 0.5% step (below the 1% jump floor) is absorbed instead of freezing the detector; on a
    # noiseless series it is a sustained rise, so the drift rule may say so once.
    events = run(det, [3.015] * 300, start=200)
    assert [e.rule for e in events] in ([], ["drift"])
    assert abs(det.baseline - 3.015) < 1e-3
    event = det.update(500, 3.2)
    assert event is not None and event.rule == "jump"


def test_constructor_and_update_validation() -> None:
    with pytest.raises(ValueError, match="z_threshold"):
        SpikeDetector(z_threshold=0)
    with pytest.raises(ValueError, match="level_rate"):
        SpikeDetector(level_rate=1.5)
    with pytest.raises(ValueError, match="direction"):
        SpikeDetector(direction="down")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="metric"):
        SpikeDetector("")
    with pytest.raises(TypeError, match="rebaseline_after"):
        SpikeDetector(rebaseline_after=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="value"):
        SpikeDetector().update(0, "high")  # type: ignore[arg-type]


def test_events_of_an_episode_describe_it() -> None:
    """A two-step spike: the first event opens the episode, the second continues it, and each event's
    fields (what an alert is built from) say what the detector saw."""
    det = SpikeDetector("train/loss")
    rng = np.random.default_rng(3)
    assert run(det, 3.0 + 0.01 * rng.standard_normal(200)) == []
    first, second = det.update(200, 30.0), det.update(201, 31.0)
    assert first is not None and second is not None
    d1, d2 = first.to_dict(), second.to_dict()
    assert (d1["step"], d1["metric"], d1["value"], d1["kind"]) == (200, "train/loss", 30.0, "spike")
    assert d1["is_new"] and not d2["is_new"]
    assert (d1["run_length"], d2["run_length"]) == (1, 2)
    for d in (d1, d2):
        assert d["baseline"] < d["threshold"] < d["value"]
        assert abs(d["baseline"] - 3.0) < 0.1
    # the flagged values did not enter the baseline: a return to the old level raises nothing
    assert det.update(202, 3.0) is None
