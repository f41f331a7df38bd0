"""StableAttentionCallback under DDP: 2 CPU processes (gloo); only rank 1 sees the corrupted batch."""

from __future__ import annotations

import os

from distributed_helpers import rank_results, read_alerts, run_launcher

HERE = os.path.dirname(os.path.abspath(__file__))


def run_ddp(tmp_path, pretrained, *extra):
    """ddp_spike_run.py, whose second rank Lightning starts; each rank's results."""
    run_launcher([os.path.join(HERE, "ddp_spike_run.py"), pretrained, str(tmp_path), *extra], tmp_path, 300, HERE)
    return rank_results(tmp_path)


def test_ddp_spike_on_one_rank_acts_on_all(tmp_path, pretrained):
    from ddp_spike_run import BAD, GRAD_STEP, NAN_STEP, STEPS

    r0, r1 = run_ddp(tmp_path, pretrained)

    # both ranks finished (no deadlock) and both skipped the steps that only rank 1 saw go wrong
    assert r0["global_step"] == r1["global_step"] == STEPS
    assert r0["skipped_steps"] == r1["skipped_steps"] == [GRAD_STEP, BAD, NAN_STEP]
    assert r0["unchanged_at_bad"] and r1["unchanged_at_bad"]
    assert r0["final"] == r1["final"]  # replicas still identical: the decision was the same everywhere
    assert r0["alert_count"] == r1["alert_count"] >= 1

    # side effects on rank zero only: one JSONL, written by rank 0, naming rank 1 as the source
    assert r0["had_dispatcher"] and not r1["had_dispatcher"]
    alerts = read_alerts(r0["log_dir"])
    assert {a["step"] for a in alerts} == {GRAD_STEP, BAD, NAN_STEP}
    loss = [a for a in alerts if a["metric"] == "train/loss"]
    assert len(loss) == 1 and "on rank 1 of 2" in loss[0]["message"] and loss[0]["action"] == "skip"
    # the evidence: both ranks' readings from the step's one all-gather, the flagged rank first
    from stable_attn.monitor.alerts.schema import validate_alert

    assert all(validate_alert(a) == 2 and a["world_size"] == 2 for a in alerts)
    first, second = loss[0]["ranks"]
    assert (first["rank"], second["rank"]) == (1, 0)
    assert first["loss"]["value"] == loss[0]["value"] and first["loss"]["threshold"] == loss[0]["threshold"]
    assert second["loss"]["threshold"] is None and second["loss"]["value"] < first["loss"]["baseline"] * 1.5
    assert loss[0]["outcome"]["update_applied"] is False
    # rank 1's gradient norm alone decided these two (rank 0's was normal)
    norm = {a["step"]: a for a in alerts if a["metric"] == "train/grad_norm" and a["step"] != BAD}
    assert norm.keys() == {GRAD_STEP, NAN_STEP}
    assert norm[GRAD_STEP]["kind"] == "spike" and norm[NAN_STEP]["kind"] == "nonfinite"
    assert all("on rank 1 of 2" in a["message"] and a["action"] == "skip" for a in norm.values())
    assert len(alerts) == r0["alert_count"]


def test_ddp_nan_gradient_on_one_rank_without_norm_monitoring(tmp_path, pretrained):
    # monitor_grad_norm=False: each rank's max-abs check of its own gradients is shared with the others
    from ddp_spike_run import BAD, NAN_STEP, STEPS

    r0, r1 = run_ddp(tmp_path, pretrained, "no-norm")
    assert r0["global_step"] == r1["global_step"] == STEPS
    assert r0["skipped_steps"] == r1["skipped_steps"] == [BAD, NAN_STEP]
    assert r0["final"] == r1["final"]
    grads = [a for a in read_alerts(r0["log_dir"]) if a["metric"] == "train/gradients"]
    assert [(a["step"], a["kind"], a["action"]) for a in grads] == [(NAN_STEP, "nonfinite", "skip")]
    assert "on rank 1 of 2" in grads[0]["message"]
