"""StableAttentionGuard in a hand-written loop: 2 CPU processes (gloo), FSDP2 (``fully_shard``) against the same
loop under DDP, a fault that only rank 1 sees (tests/callbacks/plain_run.py runs the cases).

One launch runs several cases one after the other in the same two processes.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
from distributed_helpers import assert_like_ddp, assert_same_on_ranks, read_alerts, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
# what both ranks must agree on, and what the FSDP2 loop must share with the DDP loop
SAME_ON_RANKS = ("last_step", "skipped_steps", "rollbacks", "alert_count", "unchanged", "final", "recoveries",
                 "skipped_batches", "lr", "scaled")
LIKE_DDP = ("last_step", "skipped_steps", "rollbacks", "unchanged", "lr", "scaled", "indices", "recoveries")


def launch(tmp_path, pretrained: str, cases: list[str], timeout: float) -> list[dict]:
    """Both ranks of plain_run.py; each rank's per-case results."""
    return run_ranks(os.path.join(HERE, "plain_run.py"), [pretrained, str(tmp_path), *cases], tmp_path, timeout)


check_same_on_both_ranks = partial(assert_same_on_ranks, keys=SAME_ON_RANKS)
check_like_ddp = partial(assert_like_ddp, keys=LIKE_DDP)


def check_sharded(res: dict) -> None:
    assert res["dtensor"]  # fully_shard was applied: the parameters are DTensors
    assert res["local_elems"]["temperature"] in (0, 1)  # one row over two ranks: rank 1's shard is empty


def test_plain_fsdp2_loop_skips_like_ddp(tmp_path, pretrained):
    """on_spike="skip": the corrupted batch, the NaN loss and the NaN gradient of rank 1 drop the update on both
    ranks; the FSDP2 loop ends with DDP's weights bit for bit; the statistics count one forward per step."""
    from callback_lm import BATCH, SEQ
    from plain_run import BAD, NAN_GRAD, NAN_LOSS, STEPS

    (f0, d0), (f1, d1) = ([r["fsdp:skip"], r["ddp:skip"]] for r in launch(tmp_path, pretrained,
                                                                            ["fsdp:skip", "ddp:skip"], timeout=240))
    check_same_on_both_ranks(f0, f1)
    check_same_on_both_ranks(d0, d1)
    check_sharded(f0)
    check_sharded(f1)
    assert {f0["local_elems"]["temperature"], f1["local_elems"]["temperature"]} == {0, 1}
    assert not d0["dtensor"]
    assert f0["last_step"] == STEPS - 1
    assert f0["skipped_steps"] == [BAD, NAN_LOSS, NAN_GRAD]
    assert f0["unchanged"] == [BAD, NAN_LOSS, NAN_GRAD]  # only those: every other step changed the weights
    check_like_ddp(tmp_path, f0, d0, "fsdp:skip", "ddp:skip")
    assert f0["indices"] == {str(s): s for s in range(STEPS)}  # each step's batch and its index in the epoch
    assert len(f0["grad_norm"]) == STEPS  # log_every_n_steps=1: every step's metrics
    assert all(rows == [BATCH * SEQ * 2] * 2 for rows in f0["rows"].values()), f0["rows"]  # 2 heads, 2 layers
    alerts = read_alerts(f0["log_dir"])
    assert {(a["step"], a["action"]) for a in alerts if a["metric"] == "train/loss"} >= {(BAD, "skip"),
                                                                                         (NAN_LOSS, "skip")}
    assert all("on rank 1 of 2" in a["message"] for a in alerts if a["metric"] == "train/loss")


SLOW_CASES = ["fsdp:warn", "ddp:warn", "fsdp:rollback", "ddp:rollback", "fsdp:recover", "ddp:recover",
              "fsdp:recover-disk", "fsdp:stop-resume", "ddp:stop-resume", "fsdp:stop-damaged"]


@pytest.mark.slow
def test_plain_fsdp2_loop_fault_matrix_matches_ddp(tmp_path, pretrained):
    """warn, rollback, recover (ring in memory and on disk), stop and a resume from the sharded stop checkpoint:
    the FSDP2 loop against the DDP loop, both ranks alike."""
    from plain_run import BAD, NAN_GRAD, NAN_LOSS, STEPS

    r0, r1 = launch(tmp_path, pretrained, SLOW_CASES, timeout=900)
    for case in SLOW_CASES:
        a, b = r0[case], r1[case]
        if "refused" in a:  # stop-damaged: the loop that stopped, before its checkpoint was damaged
            a, b = a["first"], b["first"]
        check_same_on_both_ranks(a, b)
    for action in ("warn", "rollback", "recover", "stop-resume"):
        check_sharded(r0[f"fsdp:{action}"])
        check_like_ddp(tmp_path, r0[f"fsdp:{action}"], r0[f"ddp:{action}"], f"fsdp:{action}", f"ddp:{action}")
    check_like_ddp(tmp_path, r0["fsdp:recover-disk"], r0["ddp:recover"], "fsdp:recover-disk", "ddp:recover")
    ring = os.path.join(r0["fsdp:recover-disk"]["log_dir"], "recovery")
    assert os.path.isdir(ring) and not os.listdir(ring)  # each rank's files were written, and removed at close

    warn = r0["fsdp:warn"]  # the spike is applied; a non-finite loss or gradient never is
    assert warn["skipped_steps"] == [NAN_LOSS, NAN_GRAD]
    assert warn["unchanged"] == [NAN_LOSS, NAN_GRAD]

    rollback = r0["fsdp:rollback"]  # spike_confirm_steps=1: each fault rolls back at once, on both ranks
    assert [r[0] for r in rollback["rollbacks"]] == [BAD, NAN_LOSS, NAN_GRAD]
    assert all(to <= at for at, to in rollback["rollbacks"])

    recover = r0["fsdp:recover"]  # batches of the skip windows never reach the loop; the LR runs at x0.5 after
    assert recover["recoveries"] >= 1 and recover["skipped_batches"] >= 2
    steps = sorted(int(s) for s in recover["indices"])
    assert len(steps) == STEPS - recover["skipped_batches"]
    indices = [recover["indices"][str(s)] for s in steps]
    assert indices == sorted(set(indices)) and len(set(range(STEPS)) - set(indices)) == recover["skipped_batches"]
    at, _ = recover["rollbacks"][0]
    # lr_steps=3: the three steps after the recovery run at lr x lr_factor (those of them that apply an update)
    assert recover["scaled"][:2] == [s for s in range(at + 1, at + 4) if str(s) in recover["lr"]][:2]
    assert recover["scaled"] and recover["scaled"][0] == at + 1

    first, resumed = r0["fsdp:stop-resume"]["first"], r0["fsdp:stop-resume"]
    # a one-step spike only skips (spike_confirm_steps=3); the NaN loss stops at once, the resumed loop at the NaN
    assert first["last_step"] == NAN_LOSS and first["skipped_steps"] == [BAD] and NAN_LOSS in first["unchanged"]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "loop.pt"} <= set(first["stop_files"])
    assert resumed["skipped_steps"] == [BAD]  # the guard's state came back with the checkpoint
    assert resumed["alert_count"] > first["alert_count"] and NAN_GRAD in resumed["unchanged"]
    assert min(int(s) for s in resumed["indices"]) == NAN_LOSS + 1 and resumed["last_step"] == NAN_GRAD
    assert resumed["indices"][str(NAN_LOSS + 1)] == NAN_LOSS + 1  # the data continues after the stop step's batch

    # rank 1's shard file removed: every rank refuses together (DCP gathers the failures), and the model is left
    # as it was (the loop reads into copies; dcp.load in place would leave the shards read so far)
    for damaged in (r0["fsdp:stop-damaged"], r1["fsdp:stop-damaged"]):
        assert damaged["refused"] is not None and damaged["refused"].startswith("CheckpointException")
        assert "__1_0.distcp" in damaged["refused"] or "ranks" in damaged["refused"]
        assert damaged["model_untouched"]


@pytest.mark.slow
def test_tensor_parallel_loop_through_the_guard(tmp_path):
    """Tensor parallelism (parallelize_module: q/k/v column-wise, o row-wise; each rank 4 of the 8 query heads)
    driven by StableAttentionGuard with QK-Clip, against one unsharded copy driven by a single-process guard: the
    logged layer statistics agree (rows add up over the TP ranks, maxima are maxima), QK-Clip clips the same heads
    on the same steps, and a NaN gradient in rank 1's shard drops the step on both ranks, its QK-Clip edit too
    (the clean run clips there); with rollback, both roll back to the same snapshot."""
    from tp_guard_run import NAN_GRAD

    r0, r1 = run_ranks(os.path.join(HERE, "tp_guard_run.py"), [str(tmp_path), "skip", "rollback"], tmp_path, 240)
    for action in ("skip", "rollback"):
        res = r0[action]
        assert res == r1[action]  # both ranks saw, decided and logged the same
        assert res["dtensor_q"]
        (tp_metrics, ref_metrics), (tp_clips, ref_clips) = res["metrics"], res["clipped"]
        assert tp_metrics.keys() == ref_metrics.keys()
        for step, ref in ref_metrics.items():
            assert tp_metrics[step].keys() == ref.keys()
            for name, value in ref.items():
                assert tp_metrics[step][name] == pytest.approx(value, rel=1e-5, abs=1e-7), (action, step, name)
        assert tp_clips == ref_clips and any(tp_clips.values())
        assert res["clean_clipped"][str(NAN_GRAD)] > 0 and tp_clips[str(NAN_GRAD)] == 0  # the dropped step's clip
        assert res["max_weight_diff"] < 1e-4  # TP sums the matmuls in another order: close, not bitwise
    assert r0["skip"]["skipped_steps"] == [[NAN_GRAD], [NAN_GRAD]]
    assert r0["skip"]["unchanged"] == [[NAN_GRAD], [NAN_GRAD]]  # no update and no QK-Clip edit, on every rank
    tp_rollbacks, ref_rollbacks = r0["rollback"]["rollbacks"]
    assert tp_rollbacks == ref_rollbacks and [r[0] for r in tp_rollbacks] == [NAN_GRAD]


@pytest.mark.slow
def test_tensor_parallel_under_lightning(tmp_path):
    """Lightning's ModelParallelStrategy(tensor_parallel_size=2), parallelize_module in configure_model on a model
    built in __init__, StableAttentionCallback(qk_clip=tau): the logged layer metrics and QK-Clip's clipped heads
    equal a single-device run's, and a NaN in rank 1's q_proj gradient shard drops the step on both ranks (no update,
    no QK-Clip edit). QK-Clip reads the layouts again at fit start, after configure_model replaced the parameters."""
    from tp_lightning_run import NAN_GRAD

    r0, r1 = run_ranks(os.path.join(HERE, "tp_lightning_run.py"), [str(tmp_path)], tmp_path, 300)
    for res in (r0, r1):
        assert res["dtensor_q"]
        assert res["skipped_steps"] == [[NAN_GRAD], [NAN_GRAD]] and res["unchanged"] == [[NAN_GRAD], [NAN_GRAD]]
        assert res["max_weight_diff"] < 1e-4
    tp, ref = r0["metrics"]  # rank zero logs
    assert tp.keys() == ref.keys() and len(ref) >= 8
    for step, values in ref.items():
        assert tp[step].keys() == values.keys(), step
        for name, value in values.items():
            assert tp[step][name] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, name)
    clipped = {s: v.get("qk_clip/clipped_heads", 0.0) for s, v in tp.items()}
    assert any(clipped.values()) and clipped[str(NAN_GRAD)] == 0
