"""Tensor parallelism under Lightning: ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)`` on 2
CPU processes (gloo), the tiny Llama of tests/monitor/tp_run.py with q/k/v column-wise and o row-wise
(``parallelize_module`` in ``configure_model``), StableAttentionCallback with QK-Clip watching; the same module
without a device mesh, in one process on each rank, is the reference. At NAN_GRAD one element of rank 1's shard
of a ``q_proj`` gradient turns NaN (the reference's whole gradient gets the same element).

Run by test_plain_loop.py as ``python tp_lightning_run.py OUT_DIR`` in two processes (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set: Lightning launches nothing); each rank writes
``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import copy
import os
import sys

import lightning as L
import torch
from distributed_helpers import full, shutdown, write_results
from lightning.pytorch import Callback
from tp_guard_run import STEPS, tau_between, weights

from stable_attn.callbacks import StableAttentionCallback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "monitor"))
from tp_run import HEAD_DIM, HEADS, model  # noqa: E402

NAN_GRAD = 3


class TPModule(L.LightningModule):
    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.model = copy.deepcopy(base)

    def configure_model(self) -> None:
        if self.device_mesh is None:
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh["tensor_parallel"]
        for layer in self.model.model.layers:
            parallelize_module(layer.self_attn, mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                       "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})

    def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss

    def on_after_backward(self) -> None:
        if self.trainer.global_step != NAN_GRAD:
            return
        grad = self.model.model.layers[0].self_attn.q_proj.weight.grad
        if type(grad).__name__ == "DTensor":
            if self.trainer.global_rank == 1:
                grad.to_local().view(-1)[0] = float("nan")
        else:
            grad.view(-1)[HEADS // 2 * HEAD_DIM * grad.shape[1]] = float("nan")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        data = [torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(s)) for s in range(2 * STEPS)]
        return torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)


class Watch(Callback):
    def __init__(self) -> None:
        self.before: dict[int, dict] = {}
        self.unchanged: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[trainer.global_step] = weights(pl_module.model)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        after = weights(pl_module.model)
        if all(torch.equal(self.before[step][n], after[n]) for n in after):
            self.unchanged.append(step)


class Metrics(L.pytorch.loggers.Logger):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "metrics"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.seen.setdefault(int(step), {}).update({k: float(v) for k, v in metrics.items()
                                                    if k.startswith(("stable_attn/", "qk_clip/"))})


def fit(base: torch.nn.Module, out: str, name: str, tau: float, tp: bool):
    from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy

    cb = StableAttentionCallback(on_spike="skip", qk_clip=tau, log_every_n_steps=1)
    watch, logger = Watch(), Metrics()
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2) if tp else \
        SingleDeviceStrategy(device="cpu")
    trainer = L.Trainer(accelerator="cpu", devices=2 if tp else 1, strategy=strategy, max_steps=STEPS, max_epochs=1,
                        logger=logger, callbacks=[cb, watch], enable_checkpointing=False, enable_progress_bar=False,
                        use_distributed_sampler=False,  # TP ranks share the batches: the loader as it is
                        enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0,
                        default_root_dir=os.path.join(out, name))
    module = TPModule(base)
    trainer.fit(module)
    return cb, watch, logger, module


def main(out: str) -> None:
    torch.set_num_threads(1)
    base = model()
    first = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    tau = tau_between(base, first)
    tp = fit(base, out, "tp", tau, tp=True)
    rank = int(os.environ["RANK"])
    ref = fit(base, out, f"ref-rank{rank}", tau, tp=False)
    result = {
        "dtensor_q": type(tp[3].model.model.layers[0].self_attn.q_proj.weight).__name__ == "DTensor",
        "skipped_steps": [list(tp[0].skipped_steps), list(ref[0].skipped_steps)],
        "unchanged": [tp[1].unchanged, ref[1].unchanged],
        "metrics": [tp[2].seen, ref[2].seen],
        "max_weight_diff": max(float((full(a) - full(b)).abs().max()) for a, b in
                               zip(weights(tp[3].model).values(), weights(ref[3].model).values(), strict=True)),
    }
    write_results(out, rank, result)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
