"""The verdict carries what is done as flags: skip, rollback or stop exactly when the update is dropped."""

from __future__ import annotations

import math

import pytest

from stable_attn.monitor import SpikeDetector
from stable_attn.monitor.verdict import NotTrainingStreak, StepJudge, Verdict


def judge(on_spike: str, loss: float):
    judge = StepJudge(on_spike, SpikeDetector.loss(), SpikeDetector.grad_norm())
    notes: list[Verdict] = []
    row = [[loss, 1.0, 1.0, 0.0]]
    return judge.judge(0, row, has_norm=True, scaler=False, lr=1e-3, note=lambda v: notes.append(v) or ""), notes


@pytest.mark.parametrize("on_spike", ["warn", "skip", "rollback", "stop"])
def test_a_healthy_step_is_not_dropped(on_spike):
    verdict = judge(on_spike, 2.0)[0].verdict
    assert not (verdict.drop or verdict.skip or verdict.rollback or verdict.stop or verdict.not_training)
    assert verdict.action == on_spike  # the word alerts would carry, as before


@pytest.mark.parametrize(("on_spike", "flag"), [("warn", "skip"), ("skip", "skip"), ("rollback", "rollback"),
                                                ("stop", "stop")])
def test_a_nonfinite_step_is_dropped_with_one_flag(on_spike, flag):
    judged, notes = judge(on_spike, math.nan)
    verdict = judged.verdict
    assert verdict.drop and verdict.not_training and verdict.action == flag
    assert [name for name in ("skip", "rollback", "stop") if getattr(verdict, name)] == [flag]
    assert notes == [verdict]  # the alerts' note is told the verdict itself


def test_the_streak_says_when_it_stops():
    streak = NotTrainingStreak(after=2, stop_after=3)
    assert [streak.update(True) for _ in range(3)] == [None, "warn", "stop"] and streak.stops
    assert streak.update(False) is None and not streak.stops
