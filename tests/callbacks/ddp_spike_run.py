"""A 2-process DDP run (gloo, CPU) in which only rank 1 sees a corrupted batch, and only rank 1's
gradients go wrong after the all-reduce (user code or faulty hardware): 100x too large at GRAD_STEP,
one NaN at NAN_STEP.

Run by test_callback_ddp.py as ``python ddp_spike_run.py WEIGHTS OUT_DIR [no-norm]`` (``no-norm``: with
``monitor_grad_norm=False``, and without the 100x step, which only a gradient norm can see): Lightning's
``strategy="ddp"`` starts the second process by running this script again, so it must be a script, not a
pytest test.
Each rank writes ``OUT_DIR/rank{r}.json`` with what it saw and did.
"""

from __future__ import annotations

import sys

import lightning as L
import torch
from callback_lm import ByteLM, batches_loader
from distributed_helpers import RANK_OFFSET, digest, shutdown, write_results
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from stable_attn.callbacks import StableAttentionCallback
from stable_attn.monitor import SpikeDetector

STEPS = 60
BAD = 50
GRAD_STEP = 40
NAN_STEP = 55


class RankLM(ByteLM):
    scale_grads = True

    def train_dataloader(self):
        rank = self.trainer.global_rank
        first = RANK_OFFSET * rank
        corrupt = [first + BAD] if rank == 1 else []
        return batches_loader(range(first, first + STEPS), corrupt_batches=corrupt)

    def on_after_backward(self):
        # DDP has all-reduced the gradients by now: what happens here is seen by this rank only.
        if self.trainer.global_rank != 1:
            return
        if self.trainer.global_step == GRAD_STEP and self.scale_grads:
            for p in self.parameters():
                p.grad.mul_(100.0)
        elif self.trainer.global_step == NAN_STEP:
            self.model.lm_head.weight.grad[3, 5] = float("nan")


class Probe(Callback):
    def __init__(self, cb: StableAttentionCallback) -> None:
        self.cb = cb

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == BAD:
            self.before = digest(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == BAD + 1:
            self.after = digest(pl_module)

    def on_train_end(self, trainer, pl_module):
        self.had_dispatcher = self.cb.dispatcher is not None


def main(weights: str, out: str, monitor_grad_norm: bool = True) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    cb = StableAttentionCallback(
        on_spike="skip", log_every_n_steps=5, monitor_grad_norm=monitor_grad_norm,
        loss_detector=SpikeDetector.loss(warmup=20),
        grad_norm_detector=SpikeDetector.grad_norm(warmup=20),
    )
    probe = Probe(cb)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=CSVLogger(out, name="run"),
        callbacks=[cb, probe], use_distributed_sampler=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=5,
    )
    module = RankLM(weights=weights)
    module.scale_grads = monitor_grad_norm
    trainer.fit(module)
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "skipped_steps": cb.skipped_steps,
        "alert_count": cb.alert_count,
        "unchanged_at_bad": probe.before == probe.after,
        "final": digest(module),
        "had_dispatcher": probe.had_dispatcher,
        "log_dir": cb.log_dir,
    }
    write_results(out, trainer.global_rank, result)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], monitor_grad_norm=sys.argv[3:] != ["no-norm"])
