"""``spike_confirm_steps``: ``"rollback"``, ``"stop"`` and ``"recover"`` wait for a spike that lasts.

Acting on a spike's first step, a healthy run's single hard batch stopped 7 of the 18 healthy runs of
benchmarks/healthy_traces.py's replay when this rule was made; a run that is lost spikes step after step.
The spike's first steps have their update dropped as under ``"skip"``, so the weights the rollback or stop
keeps are those it would have kept at once.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_engine import BAD, Loop, assert_equal
from test_spikes import lm_trace

from stable_attn.monitor import Alert, SpikeDetector
from stable_attn.monitor.config import MonitorConfig
from stable_attn.monitor.engine import MonitorEngine
from stable_attn.monitor.verdict import ActionCap, RankReading, StepJudge

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ACTIONS = ("rollback", "stop", "recover")


def make_judge(on_spike: str, confirm: int = 3) -> StepJudge:
    return StepJudge(on_spike, SpikeDetector.loss(), SpikeDetector.grad_norm(), ActionCap(10, 20), confirm=confirm)


def falling(steps: int) -> list[float]:
    """A loss falling from 5.5 towards 1 with a 1% noise."""
    return [1.0 + 4.5 * 0.97 ** s * (1.0 + 0.01 * (-1) ** s) for s in range(steps)]


def judge_all(judge: StepJudge, losses: list[float], norm: float = 1.0):
    return [judge.judge(step, [RankReading(loss, norm)], has_norm=True, scaler=False, lr=1e-3)
            for step, loss in enumerate(losses)]


def taken(judged) -> list[tuple[int, str]]:
    return [(step, j.verdict.action) for step, j in enumerate(judged) if j.verdict.drop]


@pytest.mark.parametrize("on_spike", ACTIONS)
def test_a_spike_of_one_step_is_skipped_not_acted_on(on_spike):
    losses = falling(60)
    losses[40] *= 10.0
    judged = judge_all(make_judge(on_spike), losses)
    assert taken(judged) == [(40, "skip")]
    verdict = judged[40].verdict
    assert verdict.skip and not (verdict.rollback or verdict.stop or verdict.recover)
    (event, message), = judged[40].spikes
    assert "spike_confirm_steps" in message and f"on_spike={on_spike!r}" in message and "1 so far" in message


@pytest.mark.parametrize("on_spike", ACTIONS)
def test_a_spike_that_lasts_is_acted_on_at_its_third_step(on_spike):
    losses = falling(60)
    for s in (40, 41, 42):
        losses[s] *= 10.0
    judged = judge_all(make_judge(on_spike), losses)
    assert taken(judged) == [(40, "skip"), (41, "skip"), (42, on_spike)]
    assert getattr(judged[42].verdict, on_spike)


@pytest.mark.parametrize("on_spike", ACTIONS)
def test_confirm_one_acts_on_the_first_step_as_before(on_spike):
    losses = falling(60)
    losses[40] *= 10.0
    assert taken(judge_all(make_judge(on_spike, confirm=1), losses)) == [(40, on_spike)]


@pytest.mark.parametrize("on_spike", ACTIONS)
def test_a_nan_is_acted_on_at_once(on_spike):
    losses = falling(60)
    losses[40] = math.nan
    assert taken(judge_all(make_judge(on_spike), losses)) == [(40, on_spike)]


def test_a_drift_is_acted_on_at_once():
    """A drift is a sustained rise by construction: no wait (the slow explosion of test_spikes)."""
    values, _ = lm_trace(9, steps=2400)
    start = 2000
    for i in range(start, len(values)):
        values[i] += min(0.5 * 1.03 ** (i - start) * 0.02, 8.0)
    judge = StepJudge("stop", SpikeDetector.loss(), SpikeDetector.grad_norm(), ActionCap(10, 20), confirm=3)
    judged = judge_all(judge, [float(v) for v in values])
    dropped = taken(judged)
    assert dropped and dropped[0][0] >= start
    first_drift = next(step for step, j in enumerate(judged) if any(e.rule == "drift" for e, _ in j.spikes))
    assert judged[first_drift].verdict.stop
    # whatever came before the drift (jumps of one or two steps) was skipped, not stopped on
    assert all(action == "skip" for step, action in dropped if step < first_drift)


def test_the_wait_is_counted_in_the_saved_state():
    """A resumed run counts the spike's steps on (the engine saves the cap as "spike_actions")."""
    losses = falling(60)
    for s in (40, 41, 42):
        losses[s] *= 10.0
    judge = make_judge("stop")
    judge_all(judge, losses[:42])
    saved = judge.cap.state_dict()
    assert saved["lasted"] == 2
    resumed = make_judge("stop")
    resumed.cap.load_state_dict(saved)
    for metric, ranks in judge.ranks.items():
        resumed.ranks[metric].detectors[0].load_state_dict(ranks.detectors[0].state_dict())
    last = resumed.judge(42, [RankReading(losses[42], 1.0)], has_norm=True, scaler=False, lr=1e-3)
    assert last.verdict.stop
    older = ActionCap(10, 20)
    older.load_state_dict({"count": 1, "quiet": 0})  # a state saved before spike_confirm_steps
    assert older.lasted == 0
    with pytest.raises(ValueError, match=r"spike_actions.lasted='2' .* expected an integer >= 0"):
        ActionCap(10, 20).load_state_dict({"count": 1, "quiet": 0, "lasted": "2"})


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="spike_confirm_steps"):
        MonitorConfig(spike_confirm_steps=0)
    assert MonitorConfig().spike_confirm_steps == 3


def test_stop_on_one_spiking_step_skips_it_and_trains_on(tmp_path):
    alerts: list[Alert] = []
    engine = MonitorEngine(on_spike="stop", on_alert=alerts.append)
    loop = Loop(engine, str(tmp_path))
    loop.run(steps=BAD + 6, scale={BAD: 20.0})
    assert [(d.step, d.action) for d in loop.decisions if d.drop] == [(BAD, "skip")]
    assert not any(d.stop for d in loop.decisions) and engine.stop_checkpoint is None
    assert engine.skipped_steps == [BAD]
    assert_equal(loop.states[BAD][0], loop.states[BAD + 1][0])  # the spiking update is not applied
    spike = next(a for a in alerts if a.kind == "spike")
    assert spike.action == "skip" and "spike_confirm_steps" in spike.message


def test_stop_on_a_lasting_spike_keeps_the_weights_before_it(tmp_path):
    engine = MonitorEngine(on_spike="stop")
    loop = Loop(engine, str(tmp_path))
    loop.run(steps=BAD + 3, scale={BAD: 20.0, BAD + 1: 20.0, BAD + 2: 20.0})
    assert [(d.step, d.action) for d in loop.decisions if d.drop] == [(BAD, "skip"), (BAD + 1, "skip"),
                                                                        (BAD + 2, "stop")]
    (stop,) = [e for e in loop.ends if e.stop_checkpoint is not None]
    assert stop.step == BAD + 2 and engine.stop_checkpoint == stop.stop_checkpoint
    # none of the spike's updates was applied: the weights are those before it, as a stop at once kept
    assert_equal(loop.states[BAD][0], loop.states[BAD + 3][0])


def test_rollback_on_a_lasting_spike_restores_the_snapshot(tmp_path):
    engine = MonitorEngine(on_spike="rollback", rollback_every=4)
    loop = Loop(engine, str(tmp_path))
    loop.run(steps=BAD + 4, scale={BAD: 20.0, BAD + 1: 20.0, BAD + 2: 20.0})
    # the snapshot is the state after step 11 (BAD = 12 is a multiple of rollback_every)
    assert engine.rollbacks == [(BAD + 2, BAD)]
    assert_equal(loop.states[BAD + 3][0], loop.states[BAD][0])
    assert_equal(loop.states[BAD + 3][1], loop.states[BAD][1])
    assert not torch.equal(loop.states[BAD + 4][0]["lm_head.weight"], loop.states[BAD][0]["lm_head.weight"])
