"""Step-time overhead of StableAttentionCallback (Lightning) or StableAttentionTrainerCallback
(transformers.Trainer, ``--loop trainer``) on a small GPT-2, CPU, real text.

Every configuration runs the model with ``attn_implementation="stable_attn"``, so the difference is
the callback's own cost: per-layer attention statistics switched on in the kernel, their reduction and
logging, the gradient norm, the host sync for the loss and norm, the spike detectors. Configurations
run interleaved (A, B, C, A, B, C, ...) so that drifting machine load hits all of them alike; each
run times ``--steps`` optimizer steps after ``--warmup`` untimed ones; the table shows the median over
``--repeats`` runs of the mean step time, in wall time and in process CPU time (less sensitive to
other jobs on a shared machine), the minimum CPU time (other load only ever adds to it), and the CPU
time spent inside the callback's hooks per step (its own work, nearly immune to machine noise; as a
percentage of the no-callback CPU step). The kernel's extra work for statistics is in the step times
only.

    python benchmarks/callback_overhead.py [--steps 60] [--warmup 10] [--repeats 7] [--threads 1]
    python benchmarks/callback_overhead.py --loop trainer [--steps 60] ...   # transformers.Trainer
    python benchmarks/callback_overhead.py --accelerator cuda --precision bf16-mixed   # on a GPU (Lightning)

With ``--loop trainer`` the Trainer runs AdamW with its defaults (linear decay, clipping at 1.0), logging
every step (``logging_steps=1``) in every configuration, so only the callback differs.

On a GPU, CPU time is not the step time (the host waits for the device); read the wall columns.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import tempfile
import time
import warnings
from pydoc_data.topics import topics
from typing import Any

import lightning as L
import torch
import transformers
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from stable_attn.callbacks import StableAttentionCallback, StableAttentionTrainerCallback
from stable_attn.integrations.transformers import register

TEXT = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def gpt2(args: argparse.Namespace) -> GPT2LMHeadModel:
    register()
    config = GPT2Config(
        vocab_size=256, n_positions=args.seq, n_embd=args.width, n_layer=args.layers, n_head=args.heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="stable_attn",
    )
    return GPT2LMHeadModel(config)


class LM(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.model = gpt2(args)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95))


class StepTimer(Callback):
    """Wall time and process CPU time from the end of the last warm-up step to the end of the last step.

    CPU time (``time.process_time``) counts only this process's work, so other jobs on a shared
    machine barely move it; wall time is what a user waits for. Both are reported.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the step's kernels are done, not merely queued
        now = (time.perf_counter(), time.process_time())
        if trainer.global_step == self.warmup:
            self.start = now
        self.end = now


def rows(args: argparse.Namespace) -> torch.Tensor:
    n = (args.steps + args.warmup) * args.batch
    chunk = args.seq
    return torch.tensor([list(TEXT[i * chunk:(i + 1) * chunk]) for i in range(n)], dtype=torch.long)


def data(args: argparse.Namespace) -> DataLoader:
    return DataLoader(TensorDataset(rows(args)), batch_size=args.batch, shuffle=False)


_HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")
_TRAINER_HOOKS = ("on_step_begin", "on_pre_optimizer_step", "on_step_end")


def timed_hooks(callback: Any, spent: list[float], hooks: tuple[str, ...] = _HOOKS) -> Any:
    """Wrap the callback's per-step hooks so that the CPU time spent inside them adds up in ``spent``.

    This isolates the callback's own work from the machine's noise; the extra work it asks of the
    attention kernel (statistics as side outputs) happens in the forward pass and shows only in the
    step time. (The Trainer callback's per-micro-batch loss hand-over runs outside its hooks, inside
    the wrapped ``training_step``: one tensor addition, not counted here.)
    """
    for name in hooks:
        fn = getattr(callback, name)

        def wrapped(*args, _fn=fn, **kwargs):
            start = time.process_time()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[0] += time.process_time() - start

        setattr(callback, name, wrapped)
    return callback


def run(args: argparse.Namespace, callback_factory) -> tuple[float, float, float]:
    """Mean wall, CPU, and in-hook CPU seconds per timed step of one fit."""
    L.seed_everything(0, verbose=False)
    timer = StepTimer(args.warmup)
    spent = [0.0]
    callbacks = [timer] + ([timed_hooks(callback_factory(), spent)] if callback_factory else [])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            accelerator=args.accelerator, devices=1, precision=args.precision, max_steps=args.steps + args.warmup,
            logger=CSVLogger(tmp),
            log_every_n_steps=1, callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(LM(args), data(args))
    wall, cpu = ((end - start) / args.steps for start, end in zip(timer.start, timer.end))
    return wall, cpu, spent[0] / (args.steps + args.warmup)


class TrainerStepTimer(TrainerCallback):
    """:class:`StepTimer` for transformers.Trainer (``state.global_step`` counts the finished steps)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = (time.perf_counter(), time.process_time())
        if state.global_step == self.warmup:
            self.start = now
        self.end = now


def trainer_run(args: argparse.Namespace, callback_factory) -> tuple[float, float, float]:
    """:func:`run` with transformers.Trainer."""
    torch.manual_seed(0)
    timer = TrainerStepTimer(args.warmup)
    spent = [0.0]
    callbacks = [timer] + ([timed_hooks(callback_factory(), spent, _TRAINER_HOOKS)] if callback_factory else [])
    items = [{"input_ids": r, "labels": r} for r in rows(args)]
    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(
            output_dir=tmp, max_steps=args.steps + args.warmup, per_device_train_batch_size=args.batch,
            learning_rate=1e-3, adam_beta2=0.95, logging_steps=1, save_strategy="no", report_to="none",
            disable_tqdm=True, use_cpu=args.accelerator == "cpu", train_sampling_strategy="sequential",
            dataloader_num_workers=0, seed=0,
        )
        Trainer(model=gpt2(args), args=targs, train_dataset=items, callbacks=callbacks).train()
    wall, cpu = ((end - start) / args.steps for start, end in zip(timer.start, timer.end))
    return wall, cpu, spent[0] / (args.steps + args.warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accelerator", default="cpu", help="cpu or cuda")
    p.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed on a GPU")
    p.add_argument("--loop", choices=("lightning", "trainer"), default="lightning",
                   help="the training loop: lightning.Trainer or transformers.Trainer")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "stable_attn"):
        logging.getLogger(name).setLevel(logging.ERROR)

    if args.loop == "trainer":
        for name in ("transformers", "accelerate"):
            logging.getLogger(name).setLevel(logging.ERROR)
        if args.precision != "32-true":
            p.error("--precision is Lightning's; the Trainer loop runs in fp32")
    cls = StableAttentionTrainerCallback if args.loop == "trainer" else StableAttentionCallback
    configs = {
        "no callback": None,
        "callback, monitor every step": lambda: cls(log_every_n_steps=1),
        "  same, attention_stats=False": lambda: cls(log_every_n_steps=1, attention_stats=False),
        "callback, monitor every 50 steps": lambda: cls(log_every_n_steps=50),
    }
    fit = trainer_run if args.loop == "trainer" else run
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, factory in configs.items():
            times[name].append(fit(args, factory))

    loop = f"transformers.Trainer {transformers.__version__}" if args.loop == "trainer" else \
        f"lightning.Trainer {L.__version__}"
    print(f"# {loop}; GPT-2 {args.layers} layers, width {args.width}, {args.heads} heads, seq {args.seq}, batch "
          f"{args.batch}; attn_implementation='stable_attn' everywhere; AdamW; {args.accelerator}, precision "
          f"{args.precision}, torch threads {args.threads}")
    gpu = f", {torch.cuda.get_device_name()}" if args.accelerator in ("cuda", "gpu") else ""
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs{gpu}, "
          f"torch {torch.__version__}; {args.repeats} repeats x {args.steps} timed steps "
          f"(after {args.warmup} warm-up steps); median over repeats of the mean step time")
    print(f"| {'configuration':<34} | wall ms/step | wall overhead | CPU ms/step | CPU overhead | CPU min ms/step "
          "| overhead of min | in callback hooks |")
    print(f"|{'-' * 36}|" + "|".join("-" * w for w in (14, 15, 13, 14, 17, 17, 19)) + "|")
    base = [statistics.median(t[i] for t in times["no callback"]) for i in (0, 1)]
    base_min = min(t[1] for t in times["no callback"])
    for name, ts in times.items():
        wall, cpu, hooks = (statistics.median(t[i] for t in ts) for i in (0, 1, 2))
        cpu_min = min(t[1] for t in ts)
        print(f"| {name:<34} | {wall * 1e3:12.2f} | {(wall / base[0] - 1) * 100:+12.1f}% | {cpu * 1e3:11.2f} | "
              f"{(cpu / base[1] - 1) * 100:+11.1f}% | {cpu_min * 1e3:15.2f} | "
              f"{(cpu_min / base_min - 1) * 100:+14.1f}% | {hooks * 1e3:6.2f} ms {hooks / base[1] * 100:6.2f}% |")

if __name__ == "__main__":
    main()
