"""A 2-process DDP run (gloo, CPU) with ``on_spike="recover"`` in which only rank 1 sees a corrupted batch:
both ranks must roll back to the same step and skip the same batch indices of their own shards.

Run by test_callback_recover.py as ``python ddp_recover_run.py WEIGHTS OUT_DIR`` (Lightning's
``strategy="ddp"`` starts the second process by running this script again). Each rank writes
``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import sys

import lightning as L
import torch
from ddp_spike_run import STEPS, RankLM
from distributed_helpers import digest, shutdown, write_results
from lightning.pytorch import Callback

from stable_attn.callbacks import StableAttentionCallback
from stable_attn.monitor import SpikeDetector


class Positions(Callback):
    def __init__(self, cb) -> None:
        self.cb, self.at = cb, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.at[trainer.global_step] = self.cb.engine.data_position["batch_index"]


class NoGradFaults(RankLM):
    def on_after_backward(self):  # only the corrupted batch here
        return


def main(weights: str, out: str) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    cb = StableAttentionCallback(on_spike="recover", rollback_steps=4, rollback_every=2, skip_batches=3,
                                 cooldown_steps=3, spike_confirm_steps=1, loss_detector=SpikeDetector.loss(warmup=20),
                                 grad_norm_detector=SpikeDetector.grad_norm(warmup=20))
    pos = Positions(cb)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, max_epochs=1, logger=False,
                        callbacks=[cb, pos], use_distributed_sampler=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    module = NoGradFaults(weights=weights)
    trainer.fit(module)
    result = {"rank": trainer.global_rank, "rollbacks": [list(r) for r in cb.rollbacks],
              "window": cb.engine.recovery.window.state_dict() if cb.engine.recovery.window else None,
              "skipped": cb.engine.recovery.skipped_batches, "positions": pos.at, "final": digest(module)}
    write_results(out, trainer.global_rank, result)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
