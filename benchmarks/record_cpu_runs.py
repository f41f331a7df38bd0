"""Record the self-trained runs of the real-run corpus: kinds the public Trainer states lack.

Run:  python benchmarks/record_cpu_runs.py            (4 runs of the tiny byte-level GPT-2; about a minute, 1 thread)

Not CI. The public runs of ``benchmarks/data/real_runs/`` (``benchmarks/real_runs.py``) are healthy fine-tunes
whose only real events are gradient-norm spikes; none has a loss spike, an lr-driven divergence or a schedule
that restarts several times. These four runs train the tiny GPT-2 of ``tests/callbacks/callback_lm.py`` on
Python's documentation text with a plain loop logged as ``transformers.Trainer`` logs at ``logging_steps=1``
(the mean loss of the step, the gradient norm before clipping at 1.0, the learning rate of the step), and
write ``cpu_*.csv`` beside the public runs. Nothing here chooses a number of any detector.

- ``cpu_cosine_restarts``: cosine with hard restarts every 150 steps (lr 3e-3 back up from ~0 at 150, 300, 450);
- ``cpu_corrupted_batches``: a cosine run with the batch at steps 200 and 350 garbled (every byte's high bit
  flipped, bytes the model has not seen): a real loss and gradient-norm spike on each;
- ``cpu_lr_divergence``: the learning rate grows geometrically from 1e-3 to 1.0 over 600 steps without clipping,
  so the run trains, then destabilises and diverges;
- ``cpu_small_batch``: batches of one 32-byte chunk, lr 1e-3 constant after a 20-step warm-up: the per-step
  noise of a batch of 32 tokens.
"""

from __future__ import annotations

import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "callbacks"))
from callback_lm import CHUNK_ORDER, SEQ, TEXT, tiny_gpt2  # noqa: E402

OUT = os.path.join(HERE, "data", "real_runs")


def chunk(index: int, corrupt: bool = False) -> torch.Tensor:
    data = torch.frombuffer(bytearray(TEXT[index * SEQ:(index + 1) * SEQ]), dtype=torch.uint8).long()
    return data ^ 0x80 if corrupt else data


def train(name: str, steps: int, lr_at, batch: int = 8, clip: float | None = 1.0, corrupt=(), seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(1), betas=(0.9, 0.95), weight_decay=0.1)
    rows = []
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        ids = CHUNK_ORDER[(step - 1) * batch: step * batch]
        x = torch.stack([chunk(i, step in corrupt) for i in ids])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else math.inf)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows.append((step, float(loss.detach()), float(norm), lr_at(step)))
    with open(os.path.join(OUT, f"{name}.csv"), "w") as f:
        f.write("step,loss,grad_norm,learning_rate\n")
        for step, loss, norm, lr in rows:
            f.write(f"{step},{loss:.5g},{norm:.4g},{lr:.4g}\n")
    top = max(r[2] for r in rows)
    print(f"{name}: {steps} steps, loss {rows[0][1]:.3f} -> {rows[-1][1]:.3f}, max grad norm {top:.3g}")


def cosine(step: int, peak: float, length: int, warmup: int = 20) -> float:
    if step <= warmup:
        return peak * step / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (length - warmup)))


RUNS = {
    "cpu_cosine_restarts": lambda: train(
        "cpu_cosine_restarts", 600, lambda s: 3e-3 * 0.5 * (1.0 + math.cos(math.pi * ((s - 1) % 150) / 150))),
    "cpu_corrupted_batches": lambda: train(
        "cpu_corrupted_batches", 500, lambda s: cosine(s, 3e-3, 500), corrupt={200, 350}, seed=1),
    "cpu_lr_divergence": lambda: train(
        "cpu_lr_divergence", 600, lambda s: 1e-3 * (1000.0 ** ((s - 1) / 599)), clip=None, seed=2),
    "cpu_small_batch": lambda: train("cpu_small_batch", 500, lambda s: 1e-3 * min(1.0, s / 20), batch=1, seed=3),
}


def main() -> None:
    torch.set_num_threads(1)
    for name in sys.argv[1:] or RUNS:
        RUNS[name]()


if __name__ == "__main__":
    main()
