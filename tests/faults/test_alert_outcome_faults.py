"""Every alert of a step tells the step's outcome as it resolved after the optimizer step, not as it was decided:
for each ``on_spike`` action, and for each way ``"recover"`` resolves (a recovery, a skip within the cool-down, a
stop once every recovery is used, a stop when no snapshot passes its check)."""

from __future__ import annotations

import pytest
from ring_loop import NAN_AT, RingLoop, rewrite, truncate, wrong_shape

from stable_attn.monitor import names

STOP = names.stop_checkpoint(NAN_AT)


def outcome(taken: str, applied: bool, back: int | None = None, skipping: list[int] | None = None,
            stop: bool = False) -> dict:
    return {"taken": taken, "update_applied": applied, "rolled_back_to": back, "skipping_batches": skipping,
            "stopped": stop, "checkpoint": STOP if stop else None}


def both_files_bad(loop: RingLoop) -> None:
    rewrite(loop.file(4), wrong_shape)
    truncate(loop.file(2))


# case: (options, NaN steps, the step judged, its expected outcome, damage)
CASES = {
    "warn": (dict(on_spike="warn"), (NAN_AT,), NAN_AT, outcome("warn", True), None),
    "warn, a NaN": (dict(on_spike="warn", spike=float("nan")), (NAN_AT,), NAN_AT, outcome("skip", False), None),
    "skip": (dict(on_spike="skip"), (NAN_AT,), NAN_AT, outcome("skip", False), None),
    "rollback": (dict(on_spike="rollback", rollback_every=2), (NAN_AT,), NAN_AT, outcome("rollback", False, 6), None),
    "stop": (dict(on_spike="stop"), (NAN_AT,), NAN_AT, outcome("stop", False, stop=True), None),
    "recover -> recover": (dict(skip_batches=2), (NAN_AT,), NAN_AT, outcome("recover", False, 4, [8, 9]), None),
    "recover -> skip (cool-down)": (dict(cooldown_steps=5), (NAN_AT, NAN_AT + 1), NAN_AT + 1,
                                    outcome("skip", False), None),
    "recover -> stop (max_recoveries used)": (dict(max_recoveries=1, cooldown_steps=1), (5, NAN_AT), NAN_AT,
                                              outcome("stop", False, stop=True), None),
    "recover -> stop (no snapshot passes)": (dict(), (NAN_AT,), NAN_AT, outcome("stop", False, stop=True),
                                             both_files_bad),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_alert_of_the_step_tells_what_the_step_did(tmp_path, row, case):
    options, nan_at, judged, expected, damage = CASES[case]
    options = dict(options)
    spike = options.pop("spike", 1e3 if options.get("on_spike") == "warn" else float("nan"))
    loop = RingLoop(str(tmp_path), **options)
    loop.run(nan_at=nan_at, damage=damage, spike=spike)
    alerts = [a for a in loop.alerts if a.step == judged]
    row(f"every alert of step {judged}: {expected}", f"{len(alerts)} alert(s): "
        + "; ".join(f"{a.kind} {a.outcome}" for a in alerts))
    assert len(alerts) >= 2  # the loss's and the gradient norm's (and the action's own, if any)
    for alert in alerts:
        assert alert.outcome == expected, (alert.kind, alert.message)
        if expected["stopped"]:
            assert alert.checkpoint is not None and alert.checkpoint.endswith(STOP)
    end = loop.ends[judged]
    assert (end.stop_checkpoint is not None) is expected["stopped"]
    loop.engine.end_run("at the end of the test")
