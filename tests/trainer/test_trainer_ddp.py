"""StableAttentionTrainerCallback under DDP: transformers.Trainer in 2 CPU processes (torchrun, gloo);
only rank 1 sees a garbled batch, and only rank 1's logits turn NaN."""

from __future__ import annotations

import os

import pytest
from distributed_helpers import rank_results, read_alerts, run_launcher, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))


def test_ddp_ranks_agree_on_every_action(tmp_path, pretrained):
    from ddp_trainer_run import BAD, NAN_STEP, STEPS

    run_launcher([*torchrun(os.path.join(HERE, "ddp_trainer_run.py")), pretrained, str(tmp_path)], tmp_path, 300, HERE)
    r0, r1 = rank_results(tmp_path)

    assert r0["world"] == r1["world"] == 2
    assert r0["global_step"] == r1["global_step"] == STEPS
    assert r0["skipped_steps"] == r1["skipped_steps"] == [BAD, NAN_STEP]  # both ranks skip what rank 1 saw
    assert all(r0["unchanged"].values()) and all(r1["unchanged"].values())
    assert r0["final"] == r1["final"]  # replicas identical: the same decision everywhere, no NaN applied
    assert r0["alert_count"] == r1["alert_count"] >= 2
    assert r0["alerts_file"]  # side effects on rank zero (both ranks share output_dir here)
    alerts = read_alerts(str(tmp_path))
    assert {a["step"] for a in alerts} == {BAD, NAN_STEP}
    loss = [a for a in alerts if a["metric"] == "train/loss"]
    assert [(a["step"], a["kind"]) for a in loss] == [(BAD, "spike"), (NAN_STEP, "nonfinite")]
    assert all("on rank 1 of 2" in a["message"] and a["action"] == "skip" for a in loss)
    assert len(alerts) == r0["alert_count"]


@pytest.mark.slow
def test_ddp_ranks_recover_alike(tmp_path, pretrained):
    """on_spike="recover" with 2 ranks, only rank 1 reading the garbled batch: the same rollback, the same
    window of each rank's own shard, the same batch indices after it, identical replicas."""
    from ddp_trainer_recover_run import BAD

    run_launcher([*torchrun(os.path.join(HERE, "ddp_trainer_recover_run.py")), pretrained, str(tmp_path)], tmp_path,
                 300, HERE)
    r0, r1 = rank_results(tmp_path)
    assert r0["rollbacks"] == r1["rollbacks"] == [[BAD, BAD - 4]]
    assert r0["window"] == r1["window"] == {"epoch": 0, "start": BAD, "stop": BAD + 3}
    assert r0["skipped"] == r1["skipped"] == 3
    assert r0["positions"] == r1["positions"]
    assert [r0["positions"][str(s)] for s in range(BAD - 1, BAD + 3)] == [BAD - 2, BAD - 1, BAD + 3, BAD + 4]
    assert r0["final"] == r1["final"]
