"""The verdict carries what is done as flags: skip, rollback or stop exactly when the update is dropped."""

from __future__ import annotations

import math

import pytest

from stable_attn.monitor import SpikeDetector
from stable_attn.monitor.actions.base import Action, Verdict
from stable_attn.monitor.verdict import NotTrainingStreak, RankReading, StepJudge


def judge(on_spike: str, loss: float):
    notes: list[Verdict] = []

    class Noting(Action):
        def note(self, verdict: Verdict) -> str:
            notes.append(verdict)
            return ""

    judge = StepJudge(on_spike, SpikeDetector.loss(), SpikeDetector.grad_norm(), action=Noting(word=on_spike))
    row = [RankReading(loss, 1.0)]
    return judge.judge(0, row, has_norm=True, scaler=False, lr=1e-3), notes


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


def _steps(judge: StepJudge, rows: list[tuple[float, float]]):
    return [judge.judge(step, [RankReading(loss, norm)], has_norm=True, scaler=False, lr=1e-3)
            for step, (loss, norm) in enumerate(rows)]


def _falling(steps: int = 40) -> list[tuple[float, float]]:
    """A loss falling from 5.5 towards 1 with a little noise, a gradient norm near 1."""
    return [(1.0 + 4.5 * 0.93 ** s * (1.0 + 0.01 * (-1) ** s), 1.0 + 0.02 * (-1) ** s) for s in range(steps)]


def test_a_gradient_norm_jump_the_loss_does_not_confirm_is_counted_not_alerted():
    """Healthy small-batch runs jump 4-30x in one step with an ordinary loss (benchmarks/healthy_traces.py)."""
    judge = StepJudge("skip", SpikeDetector.loss(), SpikeDetector.grad_norm())
    rows = _falling()
    loss, _ = rows[30]
    rows[30] = (loss, 30.0)
    judged = _steps(judge, rows)
    assert [j.unconfirmed for j in judged].count(1) == 1 and judged[30].unconfirmed == 1
    assert not any(j.verdict.drop or j.spikes for j in judged)


def test_a_loss_back_half_way_to_its_start_confirms_a_gradient_norm_jump():
    """The loss need not be flagged itself (its noise can hide it): undoing half the run's progress is enough.
    The loss detector here cannot flag anything, so only the share can confirm."""
    blind = SpikeDetector.loss(gross_ratio=None, z_threshold=1e6, drift_threshold=None)
    judge = StepJudge("skip", blind, SpikeDetector.grad_norm())
    rows = _falling()
    start, level = 5.5, rows[29][0]
    rows[30] = (level + 0.6 * (start - level), 30.0)
    share = judge.ranks["train/loss"][0]
    judged = _steps(judge, rows[:30])
    assert 0.5 <= share.progress_share(rows[30][0]) < 1.0
    last = _steps_from(judge, 30, rows[30:31])[0]
    assert last.verdict.skip and [e.metric for e, _ in last.spikes] == ["train/grad_norm"]
    assert last.unconfirmed == 0 and not any(j.verdict.drop for j in judged)


def test_a_gradient_norm_episode_is_alerted_once_the_loss_confirms_it():
    judge = StepJudge("warn", SpikeDetector.loss(), SpikeDetector.grad_norm())
    rows = _falling()
    judged = _steps(judge, rows[:30])
    first = _steps_from(judge, 30, [(rows[30][0], 30.0)])[0]
    assert first.unconfirmed == 1 and not first.spikes
    start, level = 5.5, rows[30][0]
    second = _steps_from(judge, 31, [(level + 0.9 * (start - level), 40.0)])[0]
    assert "train/grad_norm" in {e.metric for e, _ in second.spikes}  # not hidden as the episode's second step
    assert not any(j.spikes for j in judged)


def _steps_from(judge: StepJudge, first: int, rows: list[tuple[float, float]]):
    return [judge.judge(first + i, [RankReading(loss, norm)], has_norm=True, scaler=False, lr=1e-3)
            for i, (loss, norm) in enumerate(rows)]
