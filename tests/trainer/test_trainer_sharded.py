"""StableAttentionTrainerCallback under FSDP2 (accelerate's fully_shard per GPT2Block, torchrun, 2 CPU processes,
gloo): a fault that only rank 1 sees, the same run under DDP as the reference (tests/trainer/sharded_trainer_run.py).

On the CPU accelerate ignores ``fsdp`` and runs DDP; the run takes accelerate's FSDP2 path as on GPUs
(``force_fsdp``), and the parameters are checked to be DTensors.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from distributed_helpers import assert_same_on_ranks, rank_results, read_alerts, run_launcher, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
ACTIONS = ["warn", "skip", "rollback", "stop", "recover"]


def launch(tmp_path, pretrained: str, strategy: str, actions: list[str], timeout: float) -> tuple[dict, dict]:
    out = tmp_path / strategy
    out.mkdir()
    run_launcher([*torchrun(os.path.join(HERE, "sharded_trainer_run.py")), pretrained, str(out), strategy, *actions],
                 out, timeout, HERE)
    r0, r1 = rank_results(out)
    for action in actions:  # both ranks acted alike
        assert_same_on_ranks(r0[action], r1[action], ("world", "global_step", "skipped_steps", "rollbacks",
                                                      "alert_count", "unchanged", "final"), action)
    return r0, r1


def test_trainer_fsdp2_skip_on_one_rank(tmp_path, pretrained):
    from sharded_trainer_run import BAD, NAN_GRAD, NAN_LOSS, STEPS

    r0, _ = launch(tmp_path, pretrained, "fsdp", ["skip"], timeout=240)
    res = r0["skip"]
    assert res["world"] == 2 and res["dtensor"]  # really sharded
    assert res["global_step"] == STEPS and res["skipped_steps"] == [BAD, NAN_LOSS, NAN_GRAD]
    assert {BAD, NAN_LOSS, NAN_GRAD} <= set(res["unchanged"])
    alerts = read_alerts(os.path.join(tmp_path, "fsdp", res["alerts_file"]))
    loss = [(a["step"], a["kind"], a["action"]) for a in alerts if a["metric"] == "train/loss"]
    assert loss == [(BAD, "spike", "skip"), (NAN_LOSS, "nonfinite", "skip")]
    grads = {a["step"]: a["kind"] for a in alerts if a["metric"] == "train/grad_norm"}
    assert grads.get(NAN_GRAD) == "nonfinite"
    check_rows(res)


def check_rows(res: dict) -> None:
    """Each step's attention rows per layer on this rank: one forward's (batch x tokens x heads)."""
    from callback_lm import SEQ
    from trainer_lm import BATCH

    assert len(res["rows"]) == res["global_step"]
    assert all(rows == [BATCH * SEQ * 2] * 2 for rows in res["rows"].values()), res["rows"]  # 2 heads, 2 layers


@pytest.mark.slow
def test_trainer_fsdp2_fault_matrix_matches_ddp(tmp_path, pretrained):
    from sharded_trainer_run import BAD, NAN_GRAD, NAN_LOSS

    fsdp, _ = launch(tmp_path, pretrained, "fsdp", ACTIONS, timeout=900)
    ddp, _ = launch(tmp_path, pretrained, "ddp", ACTIONS, timeout=900)
    asis, _ = launch(tmp_path, pretrained, "fsdp-asis", ["skip"], timeout=300)
    assert not asis["skip"]["dtensor"]  # accelerate on the CPU: fsdp= is ignored, DDP runs
    assert asis["skip"]["final"] == ddp["skip"]["final"]
    for action in ACTIONS:
        f, d = fsdp[action], ddp[action]
        assert f["dtensor"] and not d["dtensor"]
        if action != "recover":  # a recovery's skipped batches are drawn but not trained on
            check_rows(f)
            check_rows(d)
        for key in ("global_step", "skipped_steps", "rollbacks", "unchanged", "alert_count"):
            assert f[key] == d[key], (action, key)
        want = torch.load(tmp_path / "ddp" / f"ddp-{action}.pt", weights_only=True)
        got = torch.load(tmp_path / "fsdp" / f"fsdp-{action}.pt", weights_only=True)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
        assert f["grad_norm"].keys() == d["grad_norm"].keys()
        for step, norm in d["grad_norm"].items():  # the global norm, not a shard's
            assert f["grad_norm"][step] == pytest.approx(norm, rel=1e-5, nan_ok=True), (action, step)
    assert fsdp["warn"]["skipped_steps"] == [NAN_LOSS, NAN_GRAD]
    assert [r[0] for r in fsdp["rollback"]["rollbacks"]] == [BAD, NAN_LOSS, NAN_GRAD]
    assert [r[0] for r in fsdp["recover"]["rollbacks"]] == [BAD, NAN_LOSS]
    stop = fsdp["stop"]  # the one-step spike skips, the NaN loss stops: the Trainer's sharded checkpoint
    assert stop["skipped_steps"] == [BAD] and stop["global_step"] == NAN_LOSS
    assert stop["stop"].endswith(f"checkpoint-{NAN_LOSS}")
    assert {"pytorch_model_fsdp_0", "optimizer_0", "trainer_state.json"} <= set(stop["stop_files"])


@pytest.mark.slow
def test_trainer_fsdp2_resumes_from_its_sharded_stop_checkpoint(tmp_path, pretrained):
    """A stop writes the Trainer's sharded checkpoint (SHARDED_STATE_DICT); a second Trainer resumes from it:
    model and optimizer shards, and the monitor's whole state (detectors of every rank, recovery budget, skip
    window, counts) come back, the data continues after the stop step's batch, and the run goes on to the next
    stop, bitwise equal to the same resume under DDP."""
    from sharded_trainer_run import BAD, NAN_GRAD, NAN_LOSS

    cases = ["stop-resume", "recover-resume"]
    fsdp, _ = launch(tmp_path, pretrained, "fsdp", cases, timeout=600)
    ddp, _ = launch(tmp_path, pretrained, "ddp", cases, timeout=600)
    for case in cases:
        f, d = fsdp[case], ddp[case]
        assert f["dtensor"] and not d["dtensor"]
        first = f["first"]
        assert first["global_step"] == NAN_LOSS and first["stop"].endswith(f"checkpoint-{NAN_LOSS}")
        assert {"pytorch_model_fsdp_0", "optimizer_0", "trainer_state.json"} <= set(first["stop_files"])
        assert json.loads(first["loaded"]) == json.loads(first["state"])  # the engine's state, field for field
        assert json.loads(first["state"])["other_rank_loss_detectors"]  # rank 1's detectors are in it
        assert f["global_step"] == NAN_GRAD and f["stop"].endswith(f"checkpoint-{NAN_GRAD}")
        last = first["indices"][str(NAN_LOSS)]
        assert [f["indices"][str(s)] for s in range(NAN_LOSS + 1, NAN_GRAD + 1)] == \
            list(range(last + 1, last + 1 + NAN_GRAD - NAN_LOSS))  # the data goes on where the stop left it
        for key in ("global_step", "skipped_steps", "rollbacks", "unchanged", "alert_count", "indices",
                    "recoveries"):
            assert f[key] == d[key], (case, key)
        want = torch.load(tmp_path / "ddp" / f"ddp-{case}.pt", weights_only=True)
        got = torch.load(tmp_path / "fsdp" / f"fsdp-{case}.pt", weights_only=True)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    assert fsdp["stop-resume"]["skipped_steps"] == [BAD]  # the skip before the stop, from the checkpoint
    recover = fsdp["recover-resume"]  # the budget (max_recoveries=1) spent at BAD comes back: the NaN stops again
    assert recover["first"]["rollbacks"] == recover["rollbacks"] and recover["recoveries"] == 1
    assert json.loads(recover["first"]["state"])["recovery"]["used"] == 1
