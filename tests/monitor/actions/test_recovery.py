"""monitor/actions/recovery.py and monitor/loop.py with a fake model and optimizer."""

from __future__ import annotations

import pytest
import torch

from stable_attn.monitor.actions.recovery import (
    LrScale,
    Recovery,
    SkipStream,
    SnapshotRing,
    ring_layout,
    snapshot_bytes,
)
from stable_attn.monitor.actions.snapshots import Trainables
from stable_attn.monitor.loop import batch_fingerprint, data_position


def state(step: int, model: torch.nn.Module, opt) -> Trainables:
    return Trainables(step=step, model=model, optimizers=[opt])


@pytest.mark.parametrize("steps,every,layout", [(100, 100, (100, 2)), (100, 25, (25, 5)), (4, 2, (2, 3)),
                                                (10, 100, (10, 2)), (7, 3, (3, 4))])
def test_ring_layout_always_reaches_rollback_steps_back(steps, every, layout):
    assert ring_layout(steps, every) == layout
    spacing, length = layout
    # at any step, the ring's oldest snapshot is at least `steps` back once the run is old enough
    for now in range(steps + spacing, steps + 5 * spacing):
        kept = [s for s in range(0, now + 1, spacing)][-length:]
        assert kept[0] <= now - steps


def test_ring_chooses_the_newest_snapshot_far_enough_back_and_drops_newer_ones_after():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ring = SnapshotRing(*ring_layout(4, 2))
    for step in range(0, 13):
        with torch.no_grad():
            model.weight.fill_(step)
        if ring.due(step):
            ring.take(state(step, model, opt))
    assert ring.steps == [8, 10, 12]
    assert all(t.device.type == "cpu" for t in ring.entries[0].snapshot.model.values())
    assert [e.step for e in ring.candidates(13, 4)] == [8]
    choice = ring.choose(13, 4, state(13, model, opt))
    assert choice.snapshot.step == 8 and float(choice.snapshot.model["weight"][0, 0]) == 8.0
    assert ring.steps == [8, 10, 12]  # nothing dropped before the restore
    ring.keep_through(choice.entry)
    assert ring.steps == [8]  # 10 and 12 belong to the abandoned trajectory
    assert ring.choose(9, 100, state(9, model, opt)).snapshot.step == 8  # too young a run: the oldest one


def test_ring_over_its_memory_limit_keeps_files_and_restores_the_same_state(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # optimizer moments to save
    stale = tmp_path / "snapshot-step=4-rank=1.pt"  # an earlier run's file of this rank: deleted at the start
    other = tmp_path / "snapshot-step=4-rank=0.pt"  # another rank's: kept
    stale.write_bytes(b"x")
    other.write_bytes(b"x")
    ring = SnapshotRing(*ring_layout(4, 2), memory_limit=3 * (6 + 2) * 4 * 3 - 1, directory=str(tmp_path), rank=1)
    kept = {}
    for step in range(0, 13):
        with torch.no_grad():
            model.weight.fill_(step)
        if ring.due(step):
            ring.take(state(step, model, opt), {"loss": [{"step": step}]})
            kept[step] = {k: v.clone() for k, v in model.state_dict().items()}
    # weight 6 + bias 2 floats, with two AdamW moments: 3 x 8 x 4 bytes, and the step counter
    assert ring.snapshot_bytes == snapshot_bytes(ring.entries[0].load()) >= 3 * 8 * 4
    assert ring.on_disk and all(e.snapshot is None for e in ring.entries)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["snapshot-step=10-rank=1.pt", "snapshot-step=12-rank=1.pt", "snapshot-step=4-rank=0.pt",
                     "snapshot-step=8-rank=1.pt"]  # 0..6 deleted as the ring moved on, the stale file at start
    choice = ring.choose(13, 4, state(13, model, opt))
    entry, snap = choice.entry, choice.snapshot
    assert entry.step == 8 and entry.detectors == {"loss": [{"step": 8}]} and not choice.passed_over
    assert all(torch.equal(snap.model[k], kept[8][k]) for k in kept[8])
    assert snap.optimizers[0]["state"][0]["exp_avg"].shape == (2, 3)
    ring.keep_through(entry)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot-step=4-rank=0.pt", "snapshot-step=8-rank=1.pt"]
    ring.clear()
    assert [p.name for p in tmp_path.iterdir()] == ["snapshot-step=4-rank=0.pt"]


def test_ring_within_its_memory_limit_stays_in_memory(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ring = SnapshotRing(2, 3, memory_limit=3 * 8 * 4, directory=str(tmp_path))
    ring.take(state(0, model, opt))
    assert ring.on_disk is False and ring.entries[0].snapshot is not None and not list(tmp_path.iterdir())


def test_ring_on_disk_without_a_directory_raises():
    model = torch.nn.Linear(3, 2)
    ring = SnapshotRing(2, 3, memory_limit=0)
    with pytest.raises(ValueError, match="snapshot_memory_limit=0"):
        ring.take(state(0, model, torch.optim.SGD(model.parameters(), lr=0.1)))


def test_decide_counts_recoveries_and_the_cooldown():
    r = Recovery(rollback_steps=4, rollback_every=2, skip_batches=3, lr_factor=1.0, lr_steps=0, max_recoveries=2,
                 cooldown_steps=10)
    assert r.decide(20) == "recover"
    entry = r.begin(20, 16, epoch=0, start=5)
    assert entry["window"] == {"epoch": 0, "start": 5, "stop": 8}
    assert r.message(entry) == "rolled back to step 16, skipping batches 5-7 (epoch 0), recovery 1 of 2"
    assert r.decide(29) == "skip" and r.decide(30) == "recover"
    r.begin(30, 26, epoch=0, start=20)
    assert r.decide(100) == "stop"
    saved = r.state_dict()
    again = Recovery(rollback_steps=4, rollback_every=2, skip_batches=3, lr_factor=1.0, lr_steps=0,
                     max_recoveries=2, cooldown_steps=10)
    again.load_state_dict(saved)
    assert again.state_dict() == saved and again.decide(100) == "stop"
    with pytest.raises(ValueError, match=r"recovery\['used'\] is -1"):
        again.load_state_dict({**saved, "used": -1})


def test_skip_stream_discards_the_window_and_numbers_what_it_gives():
    r = Recovery(rollback_steps=4, rollback_every=2, skip_batches=3, lr_factor=1.0, lr_steps=0, max_recoveries=2,
                 cooldown_steps=10)
    r.begin(5, 1, epoch=0, start=2)
    stream = SkipStream(iter(range(10)), 0, r.skips)
    got = [next(stream) for _ in range(4)]
    assert got == [0, 1, 5, 6]
    assert [stream.data_index(p) for p in range(4)] == [0, 1, 5, 6]
    assert r.skipped_batches == 3 and stream.discarded == 3
    # another epoch: the window has ended with its epoch
    assert list(SkipStream(iter(range(5)), 1, r.skips)) == [0, 1, 2, 3, 4]


def test_lr_scale_scales_inside_step_only_and_unwraps_itself():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    inner = opt.step

    def recording(*a, **k):
        seen.append(opt.param_groups[0]["lr"])
        return inner(*a, **k)

    opt.step = recording  # someone else's wrapper on the instance: put back as it was
    scale = LrScale()
    scale.wrap(opt, 0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.step()
    assert seen == [pytest.approx(0.05), 0.5]
    assert opt.param_groups[0]["lr"] == 0.5 and opt.step is recording


def test_fingerprint_reads_input_ids_or_the_first_integer_tensor():
    ids = torch.arange(12).reshape(3, 4)
    a = batch_fingerprint({"input_ids": ids, "labels": ids + 1})
    assert a == batch_fingerprint(ids) == batch_fingerprint((torch.ones(2), ids)) and len(a) == 16
    assert a != batch_fingerprint(ids + 1) and a != batch_fingerprint(ids.reshape(4, 3))
    assert batch_fingerprint(torch.ones(3)) is None and batch_fingerprint("text") is None
    assert data_position(ids, 1, 7) == {"epoch": 1, "batch_index": 7, "fingerprint": a}


def test_engine_add_batch_sets_the_position_and_keeps_references():
    from stable_attn.monitor.engine import MonitorEngine

    engine = MonitorEngine()
    engine.start("", 0)
    engine.begin_step(0)
    one, two = torch.arange(4), torch.arange(4) + 1
    engine.add_batch(one, epoch=0, batch_index=0)
    engine.add_batch(two, epoch=0, batch_index=1)
    assert engine.step_batches[0] is one and engine.step_batches[1] is two
    assert engine.data_position == {"epoch": 0, "batch_index": 1, "fingerprint": batch_fingerprint(two)}
    engine.begin_step(1)
    assert engine.step_batches == []
    engine.end_run("test")
