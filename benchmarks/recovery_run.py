"""``on_spike="recover"`` on a CPU run with an injected bad data window.

Run:  python benchmarks/recovery_run.py              (4 runs of ~600 steps; a few minutes on 1 thread)
      python benchmarks/recovery_run.py --batches 400

Not CI. The tiny byte-level GPT-2 of tests/callbacks/callback_lm.py, pre-trained for 150 steps on other
chunks of the text (callback_lm.pretrain), is trained under Lightning on ``--batches`` batches of 8 text chunks,
one optimizer step per batch, with ``StableAttentionCallback`` at its defaults except ``on_spike``:

- ``window``: batches 150..179 are replaced by repeated tokens (every byte of every sequence is ``z``), as a
  broken shard of a data pipeline would be. ``recover`` (the defaults ``rollback_steps=100``,
  ``skip_batches=200``, with ``rollback_every=25`` so the ring holds snapshots 25 steps apart) against
  ``warn`` on the same data, and against a run that never saw the window (the same batches without 150..179).
  The recovering run drops the ~100 updates it rolled back and skips 200 batches, so it is given more data
  and every run ends after the same number of kept updates (the LR scheduler's count, which a rollback
  restores); the final loss is measured on 32 held-out batches;
- ``recurring``: a burst of 5 such batches every 60 batches from batch 150 on; ``recover`` with
  ``skip_batches=30`` (shorter than the period, so the next burst is met) and ``max_recoveries=3``: the fourth
  spike stops the run with a checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "callbacks"))
import lightning as L  # noqa: E402
from callback_lm import BATCH, CHUNK_ORDER, ByteChunks, ByteLM, pretrain, trainer  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from stable_attn.callbacks import StableAttentionCallback  # noqa: E402

EVAL_OFFSET = 12000  # chunks of CHUNK_ORDER held out for the final loss (pre-training uses 8000..9199)
EVAL_BATCHES = 32


class Batches(Dataset):
    """Batch ``b`` of ``ids`` is BATCH chunks of the text; batches in ``bad`` are repeated tokens."""

    def __init__(self, ids: list[int], bad: set[int], offset: int = 0) -> None:
        self.ids, self.bad = ids, bad
        self.chunks = ByteChunks(CHUNK_ORDER[offset:offset + (max(ids) + 1) * BATCH])

    def __len__(self) -> int:
        return len(self.ids) * BATCH

    def __getitem__(self, i: int) -> torch.Tensor:
        b = self.ids[i // BATCH]
        chunk = self.chunks[b * BATCH + i % BATCH]
        return torch.full_like(chunk, ord("z")) if b in self.bad else chunk


def eval_loss(model: torch.nn.Module) -> float:
    data = Batches(list(range(EVAL_BATCHES)), set(), offset=EVAL_OFFSET)
    model.eval()
    with torch.no_grad():
        losses = [model.model(input_ids=b, labels=b).loss.item() for b in DataLoader(data, batch_size=BATCH)]
    return sum(losses) / len(losses)


class Budget(Callback):
    """Stop once the LR scheduler has counted ``updates`` steps: the steps of the kept trajectory (a rollback
    restores the scheduler with the weights), so every run ends after the same number of kept updates."""

    def __init__(self, updates: int | None) -> None:
        self.updates = updates

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.updates is not None and trainer.lr_scheduler_configs[0].scheduler.last_epoch >= self.updates:
            trainer.should_stop = True


def run(out: str, weights: str, ids: list[int], bad: set[int], updates: int | None = None, **options) -> dict:
    L.seed_everything(0, verbose=False)
    module = ByteLM(weights=weights)
    cb = StableAttentionCallback(**options)
    t = trainer(out, [cb, Budget(updates)], max_steps=len(ids), max_epochs=1, log_every_n_steps=50)
    start = time.perf_counter()
    t.fit(module, DataLoader(Batches(ids, bad), batch_size=BATCH, shuffle=False))
    recovery = cb.engine.recovery
    return {"loss": eval_loss(module), "steps": t.global_step,
            "updates": t.lr_scheduler_configs[0].scheduler.last_epoch, "seconds": time.perf_counter() - start,
            "rollbacks": list(cb.rollbacks), "skipped": recovery.skipped_batches if recovery else 0,
            "recoveries": recovery.used if recovery else 0, "stop": cb.stop_checkpoint,
            "windows": [h["window"] for h in recovery.history] if recovery else []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("stable_attn").setLevel(logging.ERROR)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    tmp = tempfile.mkdtemp()
    weights = os.path.join(tmp, "pretrained.pt")
    pretrain(weights, steps=150, seed=0)
    n = args.batches
    window = set(range(150, 180))
    every = list(range(n))
    clean = run(os.path.join(tmp, "clean"), weights, [b for b in every if b not in window], set())
    more = list(range(n + 400))  # data enough for the same number of kept updates after a rollback and a skip
    rows = {
        "never saw the window": clean,
        "window, warn": run(os.path.join(tmp, "warn"), weights, more, window, clean["updates"], on_spike="warn"),
        "window, recover": run(os.path.join(tmp, "recover"), weights, more, window, clean["updates"],
                               on_spike="recover", rollback_every=25),
    }
    recurring = {b for start in range(150, n, 60) for b in range(start, start + 5)}
    rows["recurring, recover"] = run(os.path.join(tmp, "recurring"), weights, every, recurring, on_spike="recover",
                                     rollback_every=25, skip_batches=30, max_recoveries=3)
    base = rows["never saw the window"]["loss"]
    print(f"recovery_run: {n} batches of {BATCH}x32 bytes, tiny GPT-2 pre-trained 150 steps, Lightning, 1 CPU thread")
    print("every run but the last ends after the same number of kept updates (the LR scheduler's count)")
    print(f"{'run':24s} {'final loss':>10s} {'/ clean':>8s} {'steps':>6s} {'kept':>5s} {'rollbacks (step->to)':>26s} "
          f"{'skipped':>8s} {'recoveries':>10s}  stop   windows skipped   seconds")
    for name, r in rows.items():
        rb = ", ".join(f"{a}->{b}" for a, b in r["rollbacks"]) or "-"
        win = ", ".join(f"{w['start']}-{w['stop'] - 1}" for w in r["windows"] if w) or "-"
        print(f"{name:24s} {r['loss']:10.4f} {r['loss'] / base:8.4f} {r['steps']:6d} {r['updates']:5d} {rb:>26s} "
              f"{r['skipped']:8d} "
              f"{r['recoveries']:10d}  {'yes' if r['stop'] else 'no ':4s}  {win:17s} {r['seconds']:7.1f}")


if __name__ == "__main__":
    main()
