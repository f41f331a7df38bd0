"""The Action protocol: each action owns its state, the judge asks it to decide a dropped step and to word the
alerts' note, and it raises its own alerts."""

from __future__ import annotations

from stable_attn.monitor import SpikeDetector
from stable_attn.monitor.actions.base import Action, RunContext, Skip, Verdict
from stable_attn.monitor.actions.recovery import Recover, Recovery
from stable_attn.monitor.actions.rollback import Rollback
from stable_attn.monitor.verdict import ActionCap, RankReading, StepJudge


def _recovery(**overrides) -> Recovery:
    options = dict(rollback_steps=4, rollback_every=2, skip_batches=3, lr_factor=1.0, lr_steps=0, max_recoveries=2,
                   cooldown_steps=10)
    return Recovery(**(options | overrides))


def test_recover_decides_from_its_own_count_and_cooldown_and_words_its_note():
    run = RunContext(stop_path=lambda step: f"/ckpt/stop-{step}")
    action = Recover(run, _recovery())
    verdict = action.decide(20)
    assert verdict.recover and verdict.drop and action.pending
    assert action.note(verdict) == "; recovering (on_spike='recover')"
    action.recovery.begin(20, 16, None, None)  # what after_step records once it has rolled back
    action.pending = False
    within = action.decide(25)
    assert within.skip and within.action == "skip" and not action.pending
    assert "cooldown_steps=10" in action.note(within)
    assert action.note(Verdict.dropped("skip")) == "; update skipped"  # the judge's own skip, not its decision
    assert action.alerts(25, 1e-3) == []
    action.recovery.begin(40, 36, None, None)
    last = action.decide(60)
    assert last.stop and "max_recoveries=2" in action.note(last)
    (alert,) = action.alerts(60, 1e-3)
    assert alert.kind == "recovery" and alert.action == "stop" and alert.checkpoint == "/ckpt/stop-60"
    assert action.alerts(60, 1e-3) == []  # said once
    assert action.state_dict() == {"recovery": action.recovery.state_dict()}


def test_rollback_names_its_snapshot_only_once_it_has_one():
    action = Rollback(RunContext(), every=4)
    verdict = action.decide(3)
    assert verdict.rollback and action.pending and action.restores_to is None
    assert action.note(verdict) == "; rolling back to the state at global_step ?"
    assert action.state_dict() == {}  # no snapshot: no checkpoint keys


def test_the_judge_asks_the_action_only_for_a_step_dropped_as_on_spike():
    asked = []

    class Asking(Action):
        def decide(self, step: int) -> Verdict:
            asked.append(step)
            return super().decide(step)

    judge = StepJudge("stop", SpikeDetector.loss(), SpikeDetector.grad_norm(), ActionCap(10, 20), confirm=2,
                      action=Asking(word="stop"))
    losses = [5.0 - 0.01 * s for s in range(30)] + [50.0, 50.0]
    verdicts = [judge.judge(step, [RankReading(loss, 1.0)], has_norm=True, scaler=False, lr=1e-3).verdict
                for step, loss in enumerate(losses)]
    assert verdicts[30].skip and verdicts[31].stop  # the first spiking step waits as a skip; the second is decided
    assert asked == [31]


def test_stateless_actions_are_their_word():
    assert Skip().decide(1) == Verdict.dropped("skip") and Skip().note(Verdict.dropped("skip")) == "; update skipped"
    assert Action(word="stop").note(Verdict.dropped("stop")) == "; stopping"
