"""Two CPU processes (gloo) that train the tiny GPT-2 under Lightning, once per case, with a fault that only
rank 1 sees: a corrupted batch at BAD (a loss spike), a NaN loss at NAN_LOSS, one NaN gradient element at
NAN_GRAD (after the gradients were reduced: faulty hardware or user code).

A case is ``STRATEGY:ACTION``: ``fsdp`` is ``ModelParallelStrategy(data_parallel_size=2)`` with ``fully_shard``
per GPT-2 block and on the model in ``configure_model`` (FSDP2; Lightning's ``FSDPStrategy`` refuses the CPU),
``ddp`` the same model replicated; ``ACTION`` is an ``on_spike`` value, or ``recover-disk`` (the ring in
files). ``fsdp-ckpt`` adds activation checkpointing of every block with torch's
``apply_activation_checkpointing`` (as torchtitan does), ``fsdp-hfckpt`` with transformers'
``gradient_checkpointing_enable``.

Run by test_callback_sharded.py as ``python sharded_run.py WEIGHTS OUT_DIR CASE [CASE ...]`` in two processes
that it starts itself (distributed_helpers.run_ranks: Lightning then launches
nothing), so one launch runs several cases: the imports and the process group are paid once. Each rank writes
``OUT_DIR/rank{r}.json`` (per case: what it saw and did), rank 0 ``OUT_DIR/<case>.pt`` (the full weights).
"""

from __future__ import annotations

import os
import sys

import distributed_helpers as dh
import lightning as L
import torch
from callback_lm import ByteLM, batches_loader
from callback_lm import TemperatureGPT as Net
from distributed_helpers import BAD, NAN_GRAD, NAN_LOSS, RANK_OFFSET, STEPS
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from stable_attn.callbacks import StableAttentionCallback

ACTION_OPTIONS = dict(dh.ACTION_OPTIONS)
# the recover ring on disk: each rank writes its own files (FSDP2: its shards, as DTensors)
ACTION_OPTIONS["recover-disk"] = dict(ACTION_OPTIONS["recover"], snapshot_memory_limit=0)
# stop, then a second fit resumed from the stop checkpoint (FSDP2: Lightning's sharded one), which stops again
ACTION_OPTIONS["stop-resume"] = {}


class ShardedLM(ByteLM):
    """The model is built in ``configure_model``: sharded there when the strategy gives a device mesh."""

    def __init__(self, weights: str, checkpointing: str | None = None) -> None:
        super().__init__()
        self.model = None  # ByteLM's replicated GPT-2 is not used
        self.weights, self.checkpointing = weights, checkpointing

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = Net(self.weights)
        if self.checkpointing == "hf":
            self.model.gpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif self.checkpointing == "torch":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block

            apply_activation_checkpointing(self.model, check_fn=lambda m: isinstance(m, GPT2Block))
        if self.device_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.gpt.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(batch)
        if self.trainer.global_rank == 1 and self.trainer.global_step == NAN_LOSS:
            loss = loss * float("nan")
        return loss

    def train_dataloader(self):
        rank = self.trainer.global_rank
        first = RANK_OFFSET * rank
        return batches_loader(range(first, first + STEPS), corrupt_batches=[first + BAD] if rank == 1 else [])

    def on_after_backward(self) -> None:
        # The gradients are reduced by now (all-reduced under DDP, reduce-scattered under FSDP2): this NaN is
        # rank 1's alone, in its local shard of the embedding's gradient.
        if self.trainer.global_rank == 1 and self.trainer.global_step == NAN_GRAD:
            dh.local(self.model.gpt.transformer.wte.weight.grad).view(-1)[0] = float("nan")


class MemoryLogger(CSVLogger):
    """A CSVLogger that also keeps every metric it was given (rank 0 logs)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics, step=None) -> None:
        self.seen.setdefault(int(step), {}).update({k: float(v) for k, v in metrics.items()})
        super().log_metrics(metrics, step)


class Steps(Callback):
    """Per step: the full weights' digest before and after, so a dropped update can be checked."""

    def __init__(self, cb: StableAttentionCallback) -> None:
        self.cb = cb
        self.before: dict[int, str] = {}
        self.after: dict[int, str] = {}
        self.rows: dict[int, list[int]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # this rank's attention rows per layer, counted by the forward (and by a recompute, were it counted)
        layers = self.cb.engine.layers
        if layers is not None and all(s.rows is not None for s in layers.stats.values()):
            self.rows[trainer.global_step] = [int(s.rows.sum()) for s in layers.stats.values()]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[trainer.global_step] = dh.digest(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step - 1] = dh.digest(pl_module)


def run_case(case: str, weights: str, out: str) -> dict:
    strategy_name, action = case.split(":")
    checkpointing = {"fsdp-ckpt": "torch", "fsdp-hfckpt": "hf"}.get(strategy_name)

    def fit(name: str, ckpt_path: str | None = None):
        L.seed_everything(0, verbose=False)
        if strategy_name == "ddp":
            strategy = "ddp"
        else:
            from lightning.pytorch.strategies import ModelParallelStrategy

            strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        cb = StableAttentionCallback(on_spike=action.split("-")[0], log_every_n_steps=1, **ACTION_OPTIONS[action])
        steps = Steps(cb)
        logger = MemoryLogger(os.path.join(out, name), name="run")
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, max_epochs=1, logger=logger,
            callbacks=[cb, steps], use_distributed_sampler=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0,
        )
        module = ShardedLM(weights, checkpointing=checkpointing)
        trainer.fit(module, ckpt_path=ckpt_path)
        return cb, steps, logger, trainer, module

    cb, steps, logger, trainer, module = fit(case.replace(":", "-"))
    first_stop = cb.stop_checkpoint
    if action == "stop-resume":
        cb, steps, logger, trainer, module = fit(case.replace(":", "-") + "-resumed", ckpt_path=first_stop)
    params = list(module.model.parameters())
    state = dh.full_state(module)
    if trainer.global_rank == 0:
        torch.save(state, os.path.join(out, dh.case_file(case)))
    stop = cb.stop_checkpoint
    return {
        "global_step": trainer.global_step,
        "skipped_steps": list(cb.skipped_steps),
        "rollbacks": [list(r) for r in cb.rollbacks],
        "alert_count": cb.alert_count,
        "dtensor": all(dh.is_dtensor(p) for p in params),
        "local_elems": dh.local_elems(module.model),
        "unchanged": sorted(s for s in steps.after if steps.before.get(s) == steps.after[s]),
        "grad_norm": {s: m["train/grad_norm"] for s, m in logger.seen.items() if "train/grad_norm" in m},
        "metrics_steps": sorted(logger.seen),
        "rows": steps.rows,
        "stop": stop,
        "first_stop": first_stop,
        "stop_files": sorted(os.listdir(stop)) if stop and os.path.isdir(stop) else None,
        "log_dir": cb.log_dir,
        "final": dh.digest(module),
    }


def main(weights: str, out: str, cases: list[str]) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = {}
    for case in cases:
        results[case] = run_case(case, weights, out)
        dh.write_results(out, rank, results)
    dh.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
