"""on_spike="recover" in a real Lightning run on the CPU: the rollback target, the skipped batches (by
fingerprint), equality with a run that never saw the dropped and skipped batches, data loader workers, the
LR factor, the escalation to stop, and nothing left patched."""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch
from callback_lm import ByteLM, batches_loader, trainer
from lightning.pytorch import Callback
from torch.utils.data import DataLoader

from stable_attn.callbacks import StableAttentionCallback
from stable_attn.monitor import SpikeDetector
from stable_attn.monitor.alerts.schema import validate_alert
from stable_attn.monitor.loop import batch_fingerprint

BAD = 50
STEPS = 60


def make_callback(**kwargs) -> StableAttentionCallback:
    options = dict(on_spike="recover", rollback_steps=4, rollback_every=2, skip_batches=3, cooldown_steps=3,
                   spike_confirm_steps=1,
                   loss_detector=SpikeDetector.loss(warmup=20), grad_norm_detector=SpikeDetector.grad_norm(warmup=20))
    options.update(kwargs)
    return StableAttentionCallback(**options)


class Positions(Callback):
    def __init__(self, cb) -> None:
        self.cb, self.at, self.lrs = cb, {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.at[trainer.global_step] = dict(self.cb.engine.data_position)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs[trainer.global_step] = optimizer.param_groups[0]["lr"]


def fit(tmp_path, pretrained, callbacks, batch_ids=range(STEPS), corrupt=(BAD,), workers=0, **kwargs):
    L.seed_everything(0, verbose=False)
    module = ByteLM(weights=pretrained)
    loader = batches_loader(batch_ids, corrupt_batches=corrupt)
    if workers:
        loader = DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=False, num_workers=workers)
    t = trainer(tmp_path, callbacks, len(list(batch_ids)), max_epochs=1, **kwargs)
    t.fit(module, loader)
    return t, module, loader


def fingerprints(loader) -> list[str]:
    return [batch_fingerprint(b) for b in loader]


class RingFiles(Callback):
    """The ring's files after each step (on_spike="recover" with snapshot_memory_limit=0)."""

    def __init__(self, cb) -> None:
        self.cb, self.files = cb, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ring = self.cb.engine.recovery.ring
        if ring.on_disk:
            self.files[trainer.global_step] = sorted(os.listdir(ring.directory))


@pytest.mark.parametrize("memory_limit", [8 * 2**30, 0], ids=["in memory", "on disk"])
def test_recover_matches_a_run_that_never_saw_the_window(tmp_path, pretrained, memory_limit):
    cb = make_callback(snapshot_memory_limit=memory_limit)
    pos, ring_files = Positions(cb), RingFiles(cb)
    t, module, loader = fit(tmp_path / "a", pretrained, [cb, pos, ring_files])
    ring = cb.engine.recovery.ring
    assert ring.on_disk is (memory_limit == 0)
    if ring.on_disk:  # the ring's three files (4 steps back, one every 2), written and deleted as it moved on
        assert ring_files.files[40] == [f"snapshot-step={s}-rank=0.pt" for s in (36, 38, 40)]
        assert ring_files.files[BAD + 1] == ["snapshot-step=46-rank=0.pt"]  # 48 and 50: the abandoned trajectory
        assert os.listdir(ring.directory) == []  # the end of the run deletes the rest
        assert os.path.dirname(ring.directory) == t.log_dir
    # snapshots every 2 steps; the newest at least 4 steps before the spike at 50 is the state after 46 steps
    assert cb.rollbacks == [(BAD, 46)]
    recovery = cb.engine.recovery
    assert recovery.window.state_dict() == {"epoch": 0, "start": 51, "stop": 54}
    assert recovery.skipped_batches == 3
    prints = fingerprints(loader)
    after = sorted(s for s in pos.at if s > BAD + 1)  # keyed by the steps done: step 51's batch is read by step 50
    assert [pos.at[s]["batch_index"] for s in after] == list(range(54, STEPS))
    assert all(pos.at[s]["fingerprint"] == prints[pos.at[s]["batch_index"]] for s in pos.at)
    # the alerts validate against the schema, and the recovery's says what it did (docs/ALERTS.md)
    files = list((tmp_path / "a").rglob("stable_attn_alerts.jsonl"))
    assert len(files) == 1, files
    lines = [json.loads(line) for line in files[0].read_text().splitlines()]
    for line in lines:
        validate_alert(line)
    recovery_alert = next(a for a in lines if a["kind"] == "recovery")
    assert recovery_alert["outcome"] == {"taken": "recover", "update_applied": False, "rolled_back_to": 46,
                                         "skipping_batches": [51, 53], "stopped": False, "checkpoint": None}
    assert recovery_alert["data_position"]["batch_index"] == BAD
    # the fetcher has its own iterator back
    fetcher = t.fit_loop._data_fetcher
    assert fetcher is None or fetcher.iterator is None or type(fetcher.iterator).__name__ != "SkipStream"

    # a run that never saw batches 46..50 (rolled back) nor 51..53 (skipped) ends with the same weights
    kept = [b for b in range(STEPS) if not 46 <= b <= 53]
    ref_cb = StableAttentionCallback(loss_detector=SpikeDetector.loss(warmup=20),
                                     grad_norm_detector=SpikeDetector.grad_norm(warmup=20))
    _, ref, _ = fit(tmp_path / "b", pretrained, [ref_cb], batch_ids=kept, corrupt=())
    for k, v in module.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k


class ResumableLoader(DataLoader):
    """A data loader with ``state_dict`` / ``load_state_dict``, which Lightning resumes mid-epoch itself."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._start = self._drawn = 0

    def __iter__(self):
        start, self._start = self._start, 0
        for i, batch in enumerate(super().__iter__()):
            if i >= start:
                self._drawn = i + 1
                yield batch

    def state_dict(self):
        return {"drawn": self._drawn}

    def load_state_dict(self, state):
        self._start = state["drawn"]


@pytest.mark.parametrize("resumable", [False, True], ids=["loader restarted", "loader resumable"])
def test_resume_inside_the_skip_window_continues_it_exactly(tmp_path, pretrained, resumable):
    """A checkpoint of the recovering step (rolled back, the window 51..53 open, none of it drawn yet); the
    resumed run skips the window and trains on what the uninterrupted run trained on, to the same weights.
    Lightning restarts a loader without state at the epoch's first batch: the stream passes over the batches the
    checkpointed run had used; a resumable loader starts where it stood."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(folder, ckpt_path=None, save=False):
        cb = make_callback()
        pos = Positions(cb)
        callbacks = [cb, pos] + ([ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=BAD + 1,
                                                  save_top_k=-1)] if save else [])
        L.seed_everything(0, verbose=False)
        module = ByteLM(weights=pretrained)
        plain = batches_loader(range(STEPS), corrupt_batches=(BAD,))
        loader = ResumableLoader(plain.dataset, batch_size=plain.batch_size, shuffle=False) if resumable else plain
        t = trainer(tmp_path / folder, callbacks, STEPS, max_epochs=1, enable_checkpointing=save)
        t.fit(module, loader, ckpt_path=ckpt_path)
        return cb, pos, module

    first, pos, module = run("first", save=True)
    assert first.rollbacks == [(BAD, 46)] and pos.at[BAD + 1]["batch_index"] == BAD
    ckpt = tmp_path / "ckpt" / f"epoch=0-step={BAD + 1}.ckpt"
    assert ckpt.is_file()
    resumed, again, module2 = run("resumed", ckpt_path=str(ckpt))
    assert resumed.engine.recovery.used == 1 and resumed.engine.recovery.skipped_batches == 3
    assert sorted(again.at) == [s for s in sorted(pos.at) if s > BAD + 1]  # to the epoch's end (data exhausted)
    assert len(again.at) == STEPS - 3 - (BAD + 1)
    assert all(again.at[s] == pos.at[s] for s in again.at)  # the same batches (index and fingerprint) step by step
    assert again.at[BAD + 2]["batch_index"] == 54  # after the window
    for k, v in module.state_dict().items():
        assert torch.equal(v, module2.state_dict()[k]), k


def test_two_workers_skip_the_same_batches(tmp_path, pretrained):
    seen = []
    for workers in (0, 2):
        cb = make_callback()
        pos = Positions(cb)
        _, module, _ = fit(tmp_path / str(workers), pretrained, [cb, pos], workers=workers)
        seen.append((cb.rollbacks, pos.at, [v.clone() for v in module.state_dict().values()]))
    assert seen[0][:2] == seen[1][:2]
    assert all(torch.equal(a, b) for a, b in zip(seen[0][2], seen[1][2], strict=True))


def test_lr_factor_applies_for_lr_steps_and_the_schedule_is_untouched(tmp_path, pretrained):
    cb = make_callback(lr_factor=0.5, lr_steps=4)
    pos = Positions(cb)
    t, _, _ = fit(tmp_path, pretrained, [cb, pos])
    # Lightning runs the step's closure (and on_before_optimizer_step) inside optimizer.step(): the rate read
    # there is the one the update uses; steps 51..54, after the recovery at 50, run at half the rate
    scaled = sorted(s for s, lr in pos.lrs.items() if s > 10 and lr != pytest.approx(3e-3))
    assert scaled == [51, 52, 53, 54]
    assert all(pos.lrs[s] == pytest.approx(1.5e-3) for s in scaled)
    opt = t.optimizers[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-3)  # the scheduler never saw the scaled rate
    assert t.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == pytest.approx(3e-3)
    assert not cb.engine.recovery.lr  # no wrapper left on the optimizer


def test_a_spike_after_the_last_recovery_stops_with_a_checkpoint(tmp_path, pretrained):
    cb = make_callback(max_recoveries=1)
    t, _, _ = fit(tmp_path, pretrained, [cb], corrupt=(BAD, 56))
    assert cb.engine.recovery.used == 1
    assert cb.stop_checkpoint is not None and t.should_stop
    assert os.path.isfile(cb.stop_checkpoint)
    assert cb.alert_kinds["recovery"] == 2
    (alerts,) = list(tmp_path.rglob("stable_attn_alerts.jsonl"))
    lines = [json.loads(line) for line in alerts.read_text().splitlines()]
    # only the recovery's alert says which batches it skips; the alerts of the later stop do not
    assert [a["outcome"]["skipping_batches"] for a in lines if a["kind"] == "recovery"] == [[51, 53], None]
    assert all(a["outcome"]["skipping_batches"] is None for a in lines if a["step"] > BAD)


@pytest.mark.slow
def test_ddp_ranks_roll_back_and_skip_alike(tmp_path, pretrained):
    """2 gloo processes; only rank 1 reads the corrupted batch (of its own shard)."""
    from distributed_helpers import rank_results, run_launcher

    here = os.path.dirname(os.path.abspath(__file__))
    run_launcher([os.path.join(here, "ddp_recover_run.py"), pretrained, str(tmp_path)], tmp_path, 300, here)
    r0, r1 = rank_results(tmp_path)
    assert r0["rollbacks"] == r1["rollbacks"] == [[BAD, 46]]
    assert r0["window"] == r1["window"] == {"epoch": 0, "start": 51, "stop": 54}
    assert r0["skipped"] == r1["skipped"] == 3
    assert r0["positions"] == r1["positions"]  # the same batch indices of each rank's shard, step by step
    assert r0["final"] == r1["final"]  # the replicas are still identical
