"""Healthy CPU training runs under the callback's defaults: alerts, and what skip / rollback / stop do to them.

Run:  python benchmarks/healthy_runs.py            (3 data seeds x 200 steps per task; a few minutes on 1 thread)
      python benchmarks/healthy_runs.py --steps 120 --seeds 1

Not CI. Nothing is injected into the healthy runs; each is trained with ``StableAttentionCallback`` at its
defaults and ``on_spike`` in warn / skip / rollback / stop, and the table gives the spike alerts, the
updates skipped, the rollbacks, the step a stop halted at, and whether the final weights equal those of
the ``warn`` run (the callback acted on nothing). Then a corrupted batch (every byte's high bit set) is
put into the same runs at steps 30 and 120 under ``skip``: is it skipped on its step, and by which metric.

Tasks (none was used to choose a number of the detector):

- ``memorise``: the tiny byte-level GPT-2 of tests/callbacks/callback_lm.py memorising a period-7 byte
  pattern (random phase per sample) with 0.3% of the bytes random: the loss falls to 0.005-0.2 nats and
  the batch noise reaches several times the loss;
- ``small_batch``: the same model on the Python documentation text (callback_lm.py), batches of 2 chunks
  of 32 bytes, lr 3e-3 from random weights: a noisy loss at 2-3 nats;
- ``text``: callback_lm.py's own run, 8 chunks per batch, from random weights;
- ``finetune``: the model pre-trained for 150 steps on other chunks of the text (callback_lm.pretrain), then
  fine-tuned on 16 chunks it has not seen, drawn at random into batches of 8, until it has them by heart
  (loss below 0.1 nats from step ~100): a fine-tuning run that ends at a low loss.
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
from callback_lm import BATCH, CHUNK_ORDER, ByteChunks, ByteLM, PeriodicBytes, pretrain, trainer  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from stable_attn.callbacks import StableAttentionCallback  # noqa: E402

FINETUNE_CHUNKS = 16
_PRETRAINED: dict[int, str] = {}
_DIR = tempfile.TemporaryDirectory()


def pretrained(seed: int) -> str:
    """Weights pre-trained on chunks far from the fine-tuning ones (made once per seed and process)."""
    if seed not in _PRETRAINED:
        path = os.path.join(_DIR.name, f"pretrained-{seed}.pt")
        pretrain(path, steps=150, seed=seed)
        _PRETRAINED[seed] = path
    return _PRETRAINED[seed]


class Positions(Dataset):
    """``ByteChunks`` whose items at ``corrupt`` positions are garbled (a chunk repeats, so by position)."""

    def __init__(self, indices: list[int], corrupt: set[int]) -> None:
        self.chunks, self.corrupt = ByteChunks(indices), corrupt

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> torch.Tensor:
        data = self.chunks[i]
        return data ^ 0x80 if i in self.corrupt else data


def loader(task: str, steps: int, seed: int, corrupt=()) -> DataLoader:
    if task == "finetune":
        g = torch.Generator().manual_seed(seed)
        pool = CHUNK_ORDER[100 * seed: 100 * seed + FINETUNE_CHUNKS]
        order = [pool[i] for i in torch.randint(0, len(pool), (steps * BATCH,), generator=g).tolist()]
        bad = {b * BATCH + i for b in corrupt for i in range(BATCH)}
        return DataLoader(Positions(order, bad), batch_size=BATCH)
    if task == "memorise":
        return DataLoader(PeriodicBytes(steps, seed, corrupt), batch_size=BATCH)
    per = 2 if task == "small_batch" else BATCH
    offset = 1000 * seed
    chunks = CHUNK_ORDER[offset: offset + steps * per]
    bad = [c for b in corrupt for c in chunks[b * per:(b + 1) * per]]
    return DataLoader(ByteChunks(chunks, bad), batch_size=per)


def fit(task: str, steps: int, seed: int, on_spike: str, corrupt=()):
    got = []
    cb = StableAttentionCallback(on_spike=on_spike, on_alert=got.append)
    L.seed_everything(seed, verbose=False)
    with tempfile.TemporaryDirectory() as tmp:
        t = trainer(tmp, [cb], steps)
        module = ByteLM(weights=pretrained(seed)) if task == "finetune" else ByteLM()
        t.fit(module, loader(task, steps, seed, corrupt))
    return module, cb, got, t.global_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tasks", default="memorise,small_batch,text,finetune")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in ("lightning", "lightning.pytorch", "stable_attn"):
        logging.getLogger(name).setLevel(logging.ERROR)
    t0 = time.perf_counter()
    print("| task | seed | on_spike | spike alerts | skipped | rollbacks | stopped at | weights = warn run |")
    print("|---|---|---|---|---|---|---|---|")
    for task in args.tasks.split(","):
        for seed in range(args.seeds):
            ref, _, _, _ = fit(task, args.steps, seed, "warn")
            for on_spike in ("warn", "skip", "rollback", "stop"):
                module, cb, got, ended = fit(task, args.steps, seed, on_spike)
                same = all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), ref.state_dict().values()))
                spikes = sum(a.kind == "spike" for a in got)
                stop = ended if ended < args.steps else "-"
                print(f"| {task} | {seed} | {on_spike} | {spikes} | {len(cb.skipped_steps)} | {len(cb.rollbacks)} | "
                      f"{stop} | {'yes' if same else 'no'} |", flush=True)
    print()
    print("| task | seed | corrupted step | skipped | alerted by |")
    print("|---|---|---|---|---|")
    for task in args.tasks.split(","):
        for seed in range(args.seeds):
            for bad in (30, 120):
                if bad + 2 > args.steps:
                    continue
                _, cb, got, _ = fit(task, bad + 2, seed, "skip", corrupt=(bad,))
                by = ", ".join(sorted({a.metric for a in got if a.step == bad})) or "-"
                others = sorted({a.step for a in got if a.step != bad})
                print(f"| {task} | {seed} | {bad} | {'yes' if bad in cb.skipped_steps else 'no'}"
                      f"{' (also ' + str(others) + ')' if others else ''} | {by} |", flush=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s, torch {torch.__version__}, 1 thread")


if __name__ == "__main__":
    main()
