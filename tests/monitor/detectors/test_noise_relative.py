"""Detectors judged against the run's own noise, flagged values re-entering the baseline, the
re-baseline by share, and the cap on spike actions."""

from __future__ import annotations

import numpy as np
import pytest
from detector_runs import run

from stable_attn.monitor import SpikeDetector
from stable_attn.monitor.verdict import SPIKE_ACTIONS, ActionCap, RankReading, StepJudge


def noisy_loss(seed: int, level: float, cv: float, steps: int = 1500, additive: bool = False) -> np.ndarray:
    """A loss decaying to ``level`` with noise of ``cv`` times the loss (lognormal, or additive and
    folded at zero), its size drifting by +-50% over hundreds of steps, and 3-sigma outliers on 1% of steps."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    curve = level * (1.0 + 3.0 * np.exp(-t / 150.0))
    cv_t = cv * (1.0 + 0.5 * np.sin(2 * np.pi * t / rng.uniform(200, 600) + rng.uniform(0, 6)))
    z = rng.standard_normal(steps)
    odd = rng.random(steps) < 0.01
    z[odd] = 3.0 * np.sign(rng.standard_normal(odd.sum()))
    if additive:
        return np.abs(curve + level * cv_t * z) + 1e-6 * level
    s = np.sqrt(np.log1p(cv_t**2))
    return curve * np.exp(s * z - 0.5 * s * s)


@pytest.mark.parametrize("level", [0.001, 0.07, 10.0])
@pytest.mark.parametrize("cv", [0.01, 0.3, 1.0])
@pytest.mark.parametrize("additive", [False, True])
def test_silent_at_any_loss_scale_and_noise_level(level, cv, additive):
    # Bars blind to the run's noise raise hundreds of gross alerts per 1,500 steps at 0.3 and 1.0 of noise,
    # at every level.
    for seed in range(2):
        assert run(SpikeDetector(), noisy_loss(seed, level, cv, additive=additive)) == [], (seed, level, cv)


@pytest.mark.parametrize("cv", [0.01, 0.1, 0.3])
def test_a_spike_of_many_sigmas_is_still_caught_at_any_noise_level(cv):
    for step in (60, 400, 1200):
        values = noisy_loss(step, 0.07, cv)
        sigma = np.sqrt(np.log1p(cv**2)) * 1.5  # the noise at its widest
        values[step] *= np.exp(max(12.0 * sigma, np.log(1.5)))
        events = run(SpikeDetector(), values)
        assert [e.step for e in events] == [step], (cv, step, [(e.step, e.rule) for e in events])


def test_flagged_values_of_a_wider_noise_reenter_the_scale():
    # The noise widens 3x at step 300 at once: values flagged against the old scale re-enter it (after
    # 3 accepted values in a row), so the flags stop within a bounded number of steps instead of
    # excluding the wider noise for ever.
    rng = np.random.default_rng(3)
    z = rng.standard_normal(1500)
    z[300:] *= 3.0
    values = 2.0 * np.exp(0.02 * z)
    det = SpikeDetector()
    events = run(det, values)
    assert all(e.step < 420 for e in events), [e.step for e in events]
    assert det._sigma() > 0.04  # learnt the wider noise (0.06)


def test_interleaved_flags_rebaseline_like_a_run_of_flags():
    # A shift to +40% whose noise lets every third value through: 50 flags of 100 re-baseline.
    rng = np.random.default_rng(4)
    values = 2.0 * np.exp(0.01 * rng.standard_normal(1200))
    values[600:] *= 1.4
    values[600::3] /= 1.4
    det = SpikeDetector(gross_ratio=None)
    events = run(det, values)
    late = [e.step for e in events if e.step >= 800]
    assert len(events) <= 60 and late == [], (len(events), late[:5])


def test_action_cap_stops_acting_after_the_cap_and_resumes_after_the_cooldown():
    cap = ActionCap(3, 5)
    due = [cap.update(True, acted=not cap.exhausted) for _ in range(5)]
    assert due == [False, False, True, False, False] and cap.exhausted
    for _ in range(4):
        cap.update(False, acted=False)
    assert cap.exhausted  # not yet cooled down
    cap.update(False, acted=False)
    assert not cap.exhausted and cap.count == 0
    restored = ActionCap(3, 5)
    restored.load_state_dict(cap.state_dict())
    assert restored.state_dict() == cap.state_dict()


def test_judge_warns_only_at_the_cap_but_still_drops_nonfinite_updates():
    judge = StepJudge("skip", SpikeDetector(), SpikeDetector.grad_norm(), ActionCap(2, 10))
    for step in range(60):
        judge.judge(step, [RankReading(2.0 + 0.01 * (step % 3), 1.0)], has_norm=True, scaler=False, lr=1e-3)
    verdicts, alerts = [], []
    for step in range(60, 64):
        out = judge.judge(step, [RankReading(50.0, 1.0)], has_norm=True, scaler=False, lr=1e-3)
        verdicts.append(out.verdict.skip)
        alerts += out.alerts
    assert verdicts == [True, True, False, False]
    assert [a.metric for a in alerts] == [SPIKE_ACTIONS] and "miscalibrated" in alerts[0].message
    out = judge.judge(64, [RankReading(float("nan"), 1.0)], has_norm=True, scaler=False, lr=1e-3)
    assert out.verdict.drop  # a NaN update is never applied, cap or not
