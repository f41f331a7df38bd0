"""StableAttentionCallback under FSDP2 (Lightning's ModelParallelStrategy, fully_shard per GPT-2 block):
2 CPU processes (gloo), a fault that only rank 1 sees, the same run under DDP as the reference.

One launch (tests/callbacks/sharded_run.py) runs several cases one after the other in the same two processes.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
from distributed_helpers import assert_like_ddp, assert_same_on_ranks, read_alerts, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
# what both ranks must agree on, and what the FSDP2 run must share with the DDP run
SAME_ON_RANKS = ("global_step", "skipped_steps", "rollbacks", "alert_count", "unchanged", "final")
LIKE_DDP = ("global_step", "skipped_steps", "rollbacks", "unchanged", "metrics_steps")


def launch(tmp_path, pretrained: str, cases: list[str], timeout: float) -> list[dict]:
    """Both ranks of sharded_run.py; each rank's per-case results."""
    return run_ranks(os.path.join(HERE, "sharded_run.py"), [pretrained, str(tmp_path), *cases], tmp_path, timeout)


check_same_on_both_ranks = partial(assert_same_on_ranks, keys=SAME_ON_RANKS)
check_like_ddp = partial(assert_like_ddp, keys=LIKE_DDP)


def check_sharded(res: dict) -> None:
    assert res["dtensor"]  # FSDP2 was applied, not silently ignored on the CPU
    local = res["local_elems"]
    assert local["temperature"] in (0, 1)  # one row over two ranks: rank 1's shard is empty


def check_rows_counted_once(res: dict) -> None:
    """Each step's attention rows, per layer on this rank: one forward's (batch x tokens x heads)."""
    from callback_lm import BATCH, SEQ

    heads = 2  # callback_lm.tiny_gpt2
    assert len(res["rows"]) == res["global_step"]
    assert all(rows == [BATCH * SEQ * heads] * 2 for rows in res["rows"].values()), res["rows"]


def test_fsdp2_skip_on_one_rank_matches_ddp(tmp_path, pretrained):
    from sharded_run import BAD, NAN_GRAD, NAN_LOSS, STEPS

    (f0, d0), (f1, d1) = ([r["fsdp:skip"], r["ddp:skip"]] for r in launch(tmp_path, pretrained,
                                                                            ["fsdp:skip", "ddp:skip"], timeout=240))
    check_same_on_both_ranks(f0, f1)
    check_sharded(f0)
    check_sharded(f1)
    assert {f0["local_elems"]["temperature"], f1["local_elems"]["temperature"]} == {0, 1}
    assert f0["global_step"] == STEPS
    assert f0["skipped_steps"] == [BAD, NAN_LOSS, NAN_GRAD]
    assert set(f0["unchanged"]) == {BAD, NAN_LOSS, NAN_GRAD}
    check_like_ddp(tmp_path, f0, d0, "fsdp:skip", "ddp:skip")
    check_rows_counted_once(f0)
    check_rows_counted_once(d0)
    alerts = read_alerts(f0["log_dir"])
    assert {(a["step"], a["action"]) for a in alerts if a["metric"] == "train/loss"} >= {(BAD, "skip"),
                                                                                         (NAN_LOSS, "skip")}
    assert all("on rank 1 of 2" in a["message"] for a in alerts if a["metric"] == "train/loss")


SLOW_CASES = ["fsdp:warn", "ddp:warn", "fsdp:rollback", "ddp:rollback", "fsdp:stop", "ddp:stop", "fsdp:recover",
              "ddp:recover", "fsdp:recover-disk", "ddp:skip", "fsdp-ckpt:skip", "fsdp-hfckpt:skip",
              "fsdp:stop-resume", "ddp:stop-resume"]


@pytest.mark.slow
def test_fsdp2_fault_matrix_matches_ddp(tmp_path, pretrained):
    """Every action, and activation checkpointing under FSDP2, against the same run under DDP (one launch)."""
    from sharded_run import BAD, NAN_GRAD, NAN_LOSS, STEPS

    r0, r1 = launch(tmp_path, pretrained, SLOW_CASES, timeout=900)
    for case in SLOW_CASES:
        check_same_on_both_ranks(r0[case], r1[case])
    for action in ("warn", "rollback", "stop", "recover", "stop-resume"):
        check_sharded(r0[f"fsdp:{action}"])
        check_like_ddp(tmp_path, r0[f"fsdp:{action}"], r0[f"ddp:{action}"], f"fsdp:{action}", f"ddp:{action}")
    check_like_ddp(tmp_path, r0["fsdp:recover-disk"], r0["ddp:recover"], "fsdp:recover-disk", "ddp:recover")
    ring = os.path.join(r0["fsdp:recover-disk"]["log_dir"], "recovery")
    assert os.path.isdir(ring) and not os.listdir(ring)  # each rank's files were written, and removed at the end
    for case in ("fsdp-ckpt:skip", "fsdp-hfckpt:skip"):  # the recompute neither changes nor recounts anything
        check_sharded(r0[case])
        check_like_ddp(tmp_path, r0[case], r0["ddp:skip"], case, "ddp:skip")
        check_rows_counted_once(r0[case])

    warn = r0["fsdp:warn"]  # the spike is applied; a non-finite loss or gradient never is
    assert warn["global_step"] == STEPS and warn["skipped_steps"] == [NAN_LOSS, NAN_GRAD]
    assert BAD not in warn["unchanged"]
    assert {(a["step"], a["action"]) for a in read_alerts(warn["log_dir"]) if a["metric"] == "train/loss"} \
        == {(BAD, "warn"), (NAN_LOSS, "skip")}

    rollback = r0["fsdp:rollback"]  # spike_confirm_steps=1: each fault rolls back at once, on both ranks
    assert [r[0] for r in rollback["rollbacks"]] == [BAD, NAN_LOSS, NAN_GRAD]
    assert all(to <= at for at, to in rollback["rollbacks"])

    recover = r0["fsdp:recover"]
    assert [r[0] for r in recover["rollbacks"]] == [BAD, NAN_LOSS]
    assert all(at - to >= 4 for at, to in recover["rollbacks"])  # rollback_steps=4 back (or the oldest)

    stop, ddp_stop = r0["fsdp:stop"], r0["ddp:stop"]  # the one-step spike skips; the NaN loss stops at once
    assert stop["skipped_steps"] == [BAD] and stop["global_step"] == NAN_LOSS + 1
    assert stop["stop"].endswith(f"stable_attn-stop-step={NAN_LOSS}.ckpt")
    # FSDP2's stop checkpoint is Lightning's sharded (torch.distributed.checkpoint) save: one file per rank
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(stop["stop_files"])
    assert ddp_stop["stop_files"] is None and os.path.isfile(os.path.join(tmp_path, ddp_stop["stop"]))

    # resumed from the stop checkpoint (FSDP2: Lightning's sharded one): the model, the optimizer and the
    # callback's state come back (its skipped steps), training goes on after the stop step and stops at the next
    # fault, as under DDP (compared above)
    resumed = r0["fsdp:stop-resume"]
    assert resumed["first_stop"].endswith(f"stable_attn-stop-step={NAN_LOSS}.ckpt")
    assert resumed["stop"].endswith(f"stable_attn-stop-step={NAN_GRAD}.ckpt")
    assert resumed["global_step"] == NAN_GRAD + 1 and resumed["skipped_steps"] == [BAD]
    assert sorted(int(s) for s in resumed["rows"]) == list(range(NAN_LOSS + 1, NAN_GRAD + 1))
