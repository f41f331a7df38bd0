"""A 2-process DDP run of transformers.Trainer (gloo, CPU) with ``on_spike="recover"`` in which only rank 1
reads a garbled batch (at step BAD): both ranks must roll back to the same snapshot and skip the same window of
their own shards.

Run by test_trainer_ddp.py as ``torchrun --nproc_per_node 2 ddp_trainer_recover_run.py WEIGHTS OUT_DIR``. Each
rank writes ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import sys

import torch
from distributed_helpers import digest, shutdown, write_results
from trainer_lm import make_trainer
from transformers import TrainerCallback

from stable_attn.callbacks import StableAttentionTrainerCallback
from stable_attn.monitor import SpikeDetector

STEPS = 24
BAD = 14


class Positions(TrainerCallback):
    def __init__(self, cb) -> None:
        self.cb, self.at = cb, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.at[state.global_step] = dict(self.cb.engine.data_position)


def main(weights: str, out: str) -> None:
    torch.set_num_threads(1)
    cb = StableAttentionTrainerCallback(on_spike="recover", rollback_steps=4, rollback_every=2, skip_batches=3,
                                        cooldown_steps=3, spike_confirm_steps=1,
                                        loss_detector=SpikeDetector.loss(warmup=10),
                                        grad_norm_detector=SpikeDetector.grad_norm(warmup=10))
    pos = Positions(cb)
    # rank r reads global batches r, r + 2, ...: batch 2 * (BAD - 1) + 1 is rank 1's at step BAD
    trainer = make_trainer(out, [cb, pos], steps=STEPS, weights=weights, corrupt=[2 * (BAD - 1) + 1],
                           batches=2 * (STEPS + 8), ddp_backend="gloo")
    trainer.train()
    recovery = cb.engine.recovery
    result = {
        "rank": trainer.args.process_index,
        "rollbacks": cb.rollbacks,
        "window": recovery.window.state_dict() if recovery.window is not None else None,
        "skipped": recovery.skipped_batches,
        "positions": {str(s): p["batch_index"] for s, p in sorted(pos.at.items())},
        "final": digest(trainer.model),
    }
    write_results(out, result["rank"], result)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
