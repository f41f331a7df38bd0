"""ScheduleTracker alone: which learning rates are a restart, and how the grace and the settling run down."""

from __future__ import annotations

import json
import math

import pytest

from stable_attn.monitor.detectors.schedule import (
    RESTART,
    RESTART_GRACE,
    RESTART_RISE,
    RESTART_SETTLE,
    STATE_KEYS,
    WARMUP_END,
    WARMUP_MIN,
    ScheduleTracker,
)


def restarts_at(lrs: list[float | None], ratio: float | None = 2.0) -> list[int]:
    tracker = ScheduleTracker(ratio)
    return [i for i, lr in enumerate(lrs) if tracker.observe(lr) == RESTART]


def test_a_fall_and_a_rise_by_the_ratio_is_a_restart() -> None:
    cosine = [1e-3 * 0.5 * (1 + math.cos(math.pi * k / 100)) + 1e-6 for k in range(100)]
    assert restarts_at(cosine * 3) == [100, 200]
    # a fall and a rise of less than the ratio: no restart
    assert restarts_at([1.0, 0.6, 1.0, 0.6, 1.0]) == []
    assert restarts_at([1.0, 0.5, 1.0]) == [2]


@pytest.mark.parametrize("lrs", [
    [1e-3 * (k + 1) / 50 for k in range(200)],  # a warm-up from the start, then constant
    [1e-3] * 100,
    [1e-3 * 0.1 ** (k // 30) for k in range(100)],  # step decay only falls
])
def test_a_warm_up_a_constant_or_a_decay_is_no_restart(lrs: list[float]) -> None:
    assert restarts_at(lrs) == []


@pytest.mark.parametrize("unknown", [None, math.nan, math.inf, 0.0, -1.0])
def test_an_unknown_learning_rate_changes_nothing(unknown: float | None) -> None:
    assert restarts_at([1.0, 0.1, unknown, 1.0]) == [3]
    tracker = ScheduleTracker(2.0)
    for lr in (1.0, 0.1):
        tracker.observe(lr)
    before = tracker.state_dict()
    assert tracker.observe(unknown) is None and tracker.state_dict() == before


def test_without_a_ratio_nothing_is_a_restart() -> None:
    assert restarts_at([1.0, 0.1, 1.0, 0.1, 1.0], ratio=None) == []


@pytest.mark.parametrize("bad", [1.0, 0.5, math.inf, math.nan])
def test_the_ratio_is_checked(bad: float) -> None:
    with pytest.raises(ValueError, match="lr_restart_ratio"):
        ScheduleTracker(bad)
    with pytest.raises(TypeError, match="lr_restart_ratio"):
        ScheduleTracker([2.0])  # type: ignore[arg-type]


def grace_length(rising: int) -> int:
    """Updates of the grace after a restart whose learning rate rises over ``rising`` more updates."""
    tracker = ScheduleTracker(2.0)
    tracker.observe(1.0)
    tracker.observe(0.01)
    lr = 0.02
    assert tracker.observe(lr) == RESTART and tracker.in_grace and tracker.settling and tracker.restarts == 1
    n = 0
    while tracker.in_grace:
        if n < rising:
            lr *= 1.01  # still rising
        tracker.observe(lr)
        tracker.grace_step()
        n += 1
    return n


def test_the_grace_waits_for_the_rise_but_not_for_ever() -> None:
    assert grace_length(0) == RESTART_GRACE
    assert grace_length(7) == RESTART_GRACE + 7
    assert grace_length(10 * RESTART_RISE) == RESTART_GRACE + RESTART_RISE


def test_the_settling_ends_when_settled_or_runs_down() -> None:
    tracker = ScheduleTracker(2.0)
    for lr in (1.0, 0.1, 1.0):
        tracker.observe(lr)
    tracker.settle_step(False)
    assert tracker.settling
    tracker.settle_step(True)
    assert not tracker.settling
    for lr in (0.1, 1.0):
        tracker.observe(lr)
    for _ in range(RESTART_SETTLE - 1):
        tracker.settle_step(False)
    assert tracker.settling
    tracker.settle_step(False)
    assert not tracker.settling and tracker.restarts == 2


def test_state_round_trip() -> None:
    tracker, restored = ScheduleTracker(2.0), ScheduleTracker(2.0)
    for lr in (1.0, 0.2, 0.1, 0.5):
        tracker.observe(lr)
    state = json.loads(json.dumps(tracker.state_dict()))
    assert tuple(state) == STATE_KEYS
    restored.load_state_dict(state)
    assert restored.state_dict() == tracker.state_dict()
    for lr in (0.6, 0.05, 0.2, 0.3, 0.3):
        assert restored.observe(lr) == tracker.observe(lr)
    assert restored.state_dict() == tracker.state_dict()


def changes(lrs: list[float]) -> list[tuple[int, str]]:
    tracker = ScheduleTracker(2.0)
    return [(i, change) for i, lr in enumerate(lrs) if (change := tracker.observe(lr)) is not None]


def test_a_warm_up_ends_at_its_peak() -> None:
    warm = [1e-3 * (k + 1) / 100 for k in range(100)]
    cosine = [1e-3 * 0.5 * (1 + math.cos(math.pi * k / 300)) for k in range(300)]
    tracker = ScheduleTracker(2.0)
    seen = [(i, tracker.observe(lr), tracker.warming) for i, lr in enumerate(warm + cosine)]
    assert [(i, c) for i, c, _ in seen if c is not None] == [(100, WARMUP_END)]
    assert [i for i, _, warming in seen if warming] == list(range(1, 100))
    assert not tracker.settling and not tracker.in_grace and tracker.restarts == 0
    tracker.start_settling()  # the detector's choice (a calibrated one)
    assert tracker.settling
    # a constant learning rate after the warm-up ends it too
    assert changes(warm + [1e-3] * 50) == [(100, WARMUP_END)]


@pytest.mark.parametrize("lrs", [
    [1e-3] * 50,  # constant: no warm-up
    [1e-3 * 0.99 ** k for k in range(50)] + [1e-3] * 10,  # starts by falling: no warm-up, never a later one
    [1e-3 * (k + 1) for k in range(WARMUP_MIN - 1)] + [1e-3] * 20,  # too short a rise
    [1e-3 * 1.01 ** k for k in range(600)],  # a ramp that never ends
])
def test_no_warm_up_end_without_a_warm_up_that_ends(lrs: list[float]) -> None:
    assert changes(lrs) == []


def test_a_warm_up_after_a_restart_is_the_restart_s() -> None:
    cosine = [1e-3 * 0.5 * (1 + math.cos(math.pi * k / 100)) + 1e-6 for k in range(100)]
    warm = [1e-3 * (k + 1) / 20 for k in range(20)]
    # the run's own warm-up ends once; a restart's warm-up is the restart's grace, not a second end
    assert changes(warm + cosine + warm + cosine) == [(21, WARMUP_END), (120, RESTART)]
