"""A 2-process DDP run of transformers.Trainer (gloo, CPU) in which only rank 1 goes wrong: it reads a
garbled batch at step BAD, and its model's logits are NaN at step NAN_STEP.

Run by test_trainer_ddp.py as ``torchrun --nproc_per_node 2 ddp_trainer_run.py WEIGHTS OUT_DIR``. Each rank
writes ``OUT_DIR/rank{r}.json`` with what it saw and did.
"""

from __future__ import annotations

import os
import sys

import torch
from distributed_helpers import digest, shutdown, write_results
from trainer_lm import make_trainer, optimizer_digest
from transformers import TrainerCallback

from stable_attn.callbacks import StableAttentionTrainerCallback
from stable_attn.monitor import SpikeDetector

STEPS = 24
BAD = 14
NAN_STEP = 20
WORLD = 2


class RankFaults(TrainerCallback):
    """NaN logits on rank 1 during step NAN_STEP; digests around BAD and NAN_STEP on every rank."""

    def __init__(self) -> None:
        self.before: dict[int, list[str]] = {}
        self.after: dict[int, list[str]] = {}
        self.handle = None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        step = state.global_step + 1
        if step in (BAD, NAN_STEP):
            self.before[step] = [digest(model), optimizer_digest(optimizer)]
        if step == NAN_STEP and args.process_index == 1:
            self.handle = model.lm_head.register_forward_hook(lambda m, i, out: out * float("nan"))

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if state.global_step in (BAD, NAN_STEP):
            self.after[state.global_step] = [digest(model), optimizer_digest(optimizer)]


def main(weights: str, out: str) -> None:
    torch.set_num_threads(1)
    cb = StableAttentionTrainerCallback(on_spike="skip", loss_detector=SpikeDetector.loss(warmup=10),
                                        grad_norm_detector=SpikeDetector.grad_norm(warmup=10))
    faults = RankFaults()
    # rank r reads global batches r, r + 2, ...: batch 2 * (BAD - 1) + 1 is rank 1's at step BAD
    trainer = make_trainer(out, [cb, faults], steps=STEPS, weights=weights, corrupt=[2 * (BAD - 1) + 1],
                           ddp_backend="gloo")
    trainer.train()
    rank = trainer.args.process_index
    result = {
        "rank": rank,
        "world": trainer.args.world_size,
        "global_step": trainer.state.global_step,
        "skipped_steps": cb.skipped_steps,
        "alert_count": cb.alert_count,
        "unchanged": {str(s): faults.before[s] == faults.after[s] for s in (BAD, NAN_STEP)},
        "final": digest(trainer.model),
        "alerts_file": os.path.exists(os.path.join(out, "stable_attn_alerts.jsonl")),
    }
    write_results(out, rank, result)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
