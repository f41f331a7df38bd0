"""The tiny byte-level GPT-2 of the callback tests (tests/callbacks/callback_lm.py), fed to a
transformers ``Trainer`` on the CPU: data as the Trainer wants it, a Trainer with nothing else switched
on, and digests of weights and optimizer state for bitwise comparisons.

The Trainer reads the data in order (``train_sampling_strategy="sequential"``), so batch ``b`` is
consumed by optimizer step ``b // accumulation + 1`` (the Trainer's numbering) in a single process;
under DDP, rank ``r`` gets batches ``r, r + world, ...``.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "callbacks"))

from callback_lm import BATCH, CHUNK_ORDER, ByteChunks, pretrain, tiny_gpt2  # noqa: E402
from distributed_helpers import digest  # noqa: E402  (the weights' digest, one for every test)

__all__ = ["BATCH", "Batches", "digest", "make_trainer", "optimizer_digest", "pretrain", "tiny_gpt2"]


class Batches(Dataset):
    """``n`` batches of ``BATCH`` text chunks each, as ``{"input_ids", "labels"}`` items in order;
    the batches in ``corrupt`` are garbled (every byte's high bit flipped, see callback_lm)."""

    def __init__(self, n: int, corrupt: Iterable[int] = (), offset: int = 0) -> None:
        picks = [CHUNK_ORDER[offset + b * BATCH: offset + (b + 1) * BATCH] for b in range(n)]
        bad = [c for b in corrupt for c in picks[b]]
        self.chunks = ByteChunks([c for p in picks for c in p], bad)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.chunks[i]
        return {"input_ids": ids, "labels": ids}


def make_trainer(out: str, callbacks: Sequence[Any], steps: int, weights: str | None = None,
                 corrupt: Iterable[int] = (), batches: int | None = None, **overrides: Any) -> Trainer:
    """A CPU Trainer over the tiny GPT-2 (built with "sdpa": the callback switches it) for ``steps``
    optimizer steps: AdamW lr 3e-3, betas (0.9, 0.95), weight decay 0.1, 5 warm-up steps, clipping 1.0,
    logging every 5 steps, no saving, no reporting, no progress bar."""
    model = tiny_gpt2()
    if weights is not None:
        model.load_state_dict(torch.load(weights, weights_only=True))
    kwargs: dict[str, Any] = dict(
        output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=3e-3, adam_beta2=0.95,
        weight_decay=0.1, warmup_steps=5, lr_scheduler_type="constant_with_warmup", max_grad_norm=1.0,
        logging_steps=5, save_strategy="no", report_to="none", use_cpu=True, train_sampling_strategy="sequential",
        disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    args = TrainingArguments(**kwargs)
    n = batches if batches is not None else steps * args.gradient_accumulation_steps * args.world_size
    return Trainer(model=model, args=args, train_dataset=Batches(n, corrupt), callbacks=list(callbacks))


def optimizer_digest(optimizer: Any) -> str:
    """Every tensor and number of the optimizer's per-parameter state (moments, step counts)."""
    h = hashlib.sha256()
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            h.update(f"{index}.{key}".encode())
            h.update(value.detach().cpu().contiguous().numpy().tobytes() if torch.is_tensor(value)
                     else repr(value).encode())
    return h.hexdigest()
