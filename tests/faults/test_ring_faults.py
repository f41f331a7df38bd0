"""The recovery ring under faults (``on_spike="recover"``, snapshots on disk): a damaged, missing or unreadable
snapshot never reaches the model (one alert names the file and the problem, then the next older good snapshot is
restored, or the run stops with a checkpoint, nothing restored); a full disk while writing a snapshot degrades the
ring and training goes on; stale files of this rank are deleted when the ring starts; under several ranks, a bad
file on one rank makes every rank refuse it together."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch
from distributed_helpers import rank_results, run_launcher
from ring_loop import NAN_AT, RingLoop, equal, flip_a_byte, nan_weights, rewrite, truncate, wrong_shape

from stable_attn.monitor.actions import ring as ring_module
from stable_attn.monitor.actions.ring import RING_DIR

HERE = os.path.dirname(os.path.abspath(__file__))


def recovery_alerts(loop: RingLoop) -> list:
    return [a for a in loop.alerts if a.kind == "recovery"]


def ring_files(loop: RingLoop) -> list[str]:
    folder = os.path.join(loop.log_dir, RING_DIR)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


DAMAGES = {
    "nan weights": (lambda loop: rewrite(loop.file(4), nan_weights), "model['0.weight'] is a tensor with NaN or inf"),
    "wrong shape": (lambda loop: rewrite(loop.file(4), wrong_shape), "model['2.weight'] is torch.float32 (8, 1)"),
    "truncated": (lambda loop: truncate(loop.file(4)), "cannot be read"),
    "deleted": (lambda loop: os.remove(loop.file(4)), "is missing"),
    "flipped byte": (lambda loop: flip_a_byte(loop.file(4)), "model['0.bias'] has CRC-32"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_bad_snapshot_is_passed_over_for_the_next_older_good_one(tmp_path, row, caplog, damage):
    hurt, problem = DAMAGES[damage]
    loop = RingLoop(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        loop.run(damage=hurt)
    (alert,) = recovery_alerts(loop)
    row("one alert naming snapshot-step=4 and the problem, restored step 2 exactly, training goes on",
        f"{alert.message}; outcome {alert.outcome}")
    assert f"{RING_DIR}/snapshot-step=4-rank=0.pt (step 4) {problem}" in alert.message
    assert "fell back to an older snapshot: rolled back to step 2" in alert.message
    assert alert.outcome["rolled_back_to"] == 2 and alert.action == "recover"
    assert equal(loop.states[NAN_AT + 1], loop.states[2])  # exactly the older state: nothing of the bad file
    assert all(bool(torch.isfinite(t).all()) for t in loop.states[len(loop.states) - 1].values())
    assert loop.engine.rollbacks == [(NAN_AT, 2)] and len(loop.ends) == 10  # and training went on
    assert any(str(tmp_path / RING_DIR / "snapshot-step=4-rank=0.pt") in r.getMessage() for r in caplog.records)
    loop.engine.end_run("at the end of the test")


def test_no_good_snapshot_stops_with_a_checkpoint_and_restores_nothing(tmp_path, row):
    loop = RingLoop(str(tmp_path))

    def both(loop: RingLoop) -> None:
        rewrite(loop.file(4), wrong_shape)
        truncate(loop.file(2))

    loop.run(damage=both)
    (alert,) = recovery_alerts(loop)
    end = loop.ends[-1]
    row("stop with a checkpoint, weights untouched (no partial restore), newer snapshots kept",
        f"{alert.message}; stop {end.stop_checkpoint}; files {ring_files(loop)}")
    assert end.stop_checkpoint is not None and alert.action == "stop" and alert.checkpoint == end.stop_checkpoint
    assert alert.outcome == {"taken": "stop", "update_applied": False, "rolled_back_to": None,
                             "skipping_batches": None, "stopped": True,
                             "checkpoint": os.path.basename(end.stop_checkpoint)}
    assert "snapshot-step=4-rank=0.pt (step 4) model['2.weight']" in alert.message
    assert "snapshot-step=2-rank=0.pt (step 2) cannot be read" in alert.message
    assert equal(loop.states[NAN_AT + 1], loop.states[NAN_AT])  # the spike's update dropped, nothing restored
    assert ring_files(loop) == [f"snapshot-step={s}-rank=0.pt" for s in (2, 4, 6)]  # nothing deleted
    assert loop.engine.recovery.used == 0 and loop.engine.rollbacks == []


def _full_disk(monkeypatch, written: list[str]) -> None:
    """From now on every ring write puts a few bytes in its file, then fails as a full disk does."""

    def save(obj, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half")
        written.append(str(path))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ring_module.torch, "save", save)


@pytest.mark.parametrize("memory", ["fits", "does not fit"])
def test_a_full_disk_degrades_the_ring_and_training_goes_on(tmp_path, row, caplog, monkeypatch, memory):
    loop = RingLoop(str(tmp_path))
    written: list[str] = []
    loop.run(steps=3, nan_at=())  # snapshots 0 and 2 on disk
    _full_disk(monkeypatch, written)
    monkeypatch.setattr(ring_module, "host_memory_available", lambda: 2**40 if memory == "fits" else 10)
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        loop.run(steps=10, nan_at=(NAN_AT,))
    failed = [a for a in recovery_alerts(loop) if a.action == "warn"]
    warnings = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()
                and r.getMessage().startswith("StableAttentionCallback")]
    got = f"{failed[0].message if failed else 'no alert'}; then {[a.message for a in recovery_alerts(loop)[1:]]}"
    row(f"WARNING + alert naming the file and ENOSPC, no .partial; ring {'in memory' if memory == 'fits' else 'off'}",
        got)
    assert written and not any(name.endswith(".partial") for name in ring_files(loop))
    assert len(failed) == 1 and len(warnings) == 1
    assert written[0].endswith(".pt.partial")
    name = os.path.basename(written[0]).removesuffix(".partial")
    assert f"{RING_DIR}/{name} could not be written (OSError: ENOSPC (No space left on device))" in failed[0].message
    assert f"{written[0].removesuffix('.partial')} could not be written (OSError: ENOSPC" in warnings[0]
    if memory == "fits":
        assert "host memory from now on" in failed[0].message and loop.engine.recovery.ring.on_disk is False
        assert loop.engine.rollbacks and len(loop.ends) == 10  # the recovery used the ring, training went on
    else:
        assert "recovery is off" in failed[0].message and loop.engine.recovery.ring.off
        assert ring_files(loop) == []  # the ring dropped its files with its snapshots
        stop = recovery_alerts(loop)[-1]
        assert stop.action == "stop" and "holds no snapshot" in stop.message
        assert loop.ends[-1].stop_checkpoint is not None


def test_stale_files_of_this_rank_are_deleted_when_the_ring_starts(tmp_path, row):
    folder = tmp_path / RING_DIR
    folder.mkdir()
    for name in ("snapshot-step=4-rank=0.pt", "snapshot-step=6-rank=0.pt.partial", "snapshot-step=4-rank=1.pt",
                 "notes.txt"):
        (folder / name).write_bytes(b"old")
    loop = RingLoop(str(tmp_path), snapshot_memory_limit=None)  # a ring in memory still cleans its folder
    left = sorted(p.name for p in folder.iterdir())
    row("this rank's .pt and .partial deleted, another rank's and other files kept", left)
    assert left == ["notes.txt", "snapshot-step=4-rank=1.pt"]
    loop.engine.end_run("at the end of the test")


def test_ranks_refuse_a_bad_file_of_one_rank_together(tmp_path, row):
    """Two gloo processes (about 30 s); only rank 1's files are damaged: its newest wanted one, or all."""
    cases = ("rank 1 bad newest", "rank 1 bad all")
    run_launcher([os.path.join(HERE, "ring_ddp_run.py"), str(tmp_path), *cases], tmp_path, 240, HERE)
    got = {case: rank_results(tmp_path / case.replace(" ", "_")) for case in cases}
    row("newest bad on rank 1: both ranks restore step 2; all bad on rank 1: both stop; rank 0's alert names "
        "rank 1's file", "; ".join(f"{case}: rollbacks {r0['rollbacks']}/{r1['rollbacks']}, stopped "
                                   f"{r0['stopped']}/{r1['stopped']}" for case, (r0, r1) in got.items()))
    for case, (r0, r1) in got.items():
        assert r0["rollbacks"] == r1["rollbacks"] and r0["stopped"] == r1["stopped"], case
        assert r0["final"] == r1["final"], case  # the replicas are still identical
        assert "rank 1's recovery/snapshot-step=4-rank=1.pt (step 4) failed its check" in r0["alerts"][-1]
    (r0, _), (s0, _) = got[cases[0]], got[cases[1]]
    assert r0["rollbacks"] == [[NAN_AT, 2]] and not r0["stopped"]
    assert s0["rollbacks"] == [] and s0["stopped"]
    assert "rank 1's recovery/snapshot-step=2-rank=1.pt (step 2) failed its check" in s0["alerts"][-1]
