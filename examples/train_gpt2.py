"""Train a GPT-2 with stable_attn under Lightning, and leave a run directory with a report.

The main job of the project: real text, a real tokenizer, a real ``transformers`` model, Lightning, the
stabilized attention kernel and :class:`~stable_attn.callbacks.StableAttentionCallback`.

    python examples/train_gpt2.py                      # about 5 minutes on a 2-core CPU, no download
    python examples/train_gpt2.py --inject-spike-at 200  # one corrupted batch: an alert, the update skipped
    stable-attn report runs/gpt2-<timestamp>            # rebuild the plots from the CSV and JSONL

With no arguments it trains a small GPT-2 (4 layers, 4 heads, width 128, sequence 128) on the CPU on a
corpus assembled from the documentation every Python installation ships, tokenized with a byte-level
BPE trained on it (``examples/gpt2_data.py``; built once and cached). At the end it prints a summary
(final train and validation loss, alerts, saturation by layer) and leaves in the run directory
(``runs/gpt2-<timestamp>`` or ``--run-dir``):

- ``metrics.csv``: Lightning's CSVLogger file (``train/loss``, ``train/grad_norm``, ``train/lr``,
  ``val/loss``, ``stable_attn/alerts``, and per layer ``stable_attn/{saturation,fixed_rate,max_logit,
  sink_mass}/layer{i}``);
- ``stable_attn_alerts.jsonl``: one JSON object per alert (the callback's default file name);
- ``loss.png``, ``saturation_heatmap.png``, ``max_logit.png`` and ``report.md`` (``stable_attn.report``).

Precision (``--precision auto``): ``bf16-mixed`` on a CUDA GPU. On a CPU the model runs in fp32 and only
the attention in bf16 (q, k, v are cast to bf16 for it: ``--attention-dtype``), because CPUs without bf16
matrix hardware emulate bf16 matrix products about ten times slower (measured, see
:func:`resolve_precision`), while the attention's bf16 numerics -- ties at the row max, the rounding of
``P V`` that the fix is about -- are exactly those it has under ``bf16-mixed``.

``--inject-spike-at STEP`` replaces the batch(es) of optimizer step ``STEP`` (0-based, as
``trainer.global_step`` counts and as alerts report it) with uniformly random token ids
(``gpt2_data.corrupt_batch``), once, so the loss spikes for exactly that step; the callback then
alerts and applies ``--on-spike`` (default ``skip``: the step's update is dropped). Pick a step after the
loss detector's warm-up (about 120 steps).

``--preset gpt2-124m`` is the setting of Qiu & Yao (ICLR 2026) for a GPU: GPT-2 small (12 layers,
12 heads, width 768), no dropout, sequence 1024, AdamW lr 1e-3, betas (0.9, 0.95), weight decay 0,
2000 warm-up steps then cosine decay to 1e-5 over 600,000 steps, gradient clipping 1.0, bf16-mixed,
20 sequences per micro-batch x 16 accumulation steps (327,680 tokens per optimizer step, split over
``--devices``), as in the authors' nanoGPT-based script. "No biases": Hugging Face's GPT-2 always has
bias vectors (in its Conv1D projections and LayerNorms), so the preset sets them to zero and freezes
them, which computes exactly the bias-free model. Data: ``--data path/to/openwebtext/train.bin``
(nanoGPT's uint16 GPT-2 ids; ``val.bin`` beside it is used for validation). Blocks are consecutive,
non-overlapping and shuffled each epoch, where nanoGPT samples random offsets.

``--attention`` chooses the attention for A/B runs: ``stable_attn`` (the fix), ``stable_attn_paper``
(the published rule), ``stable_attn_off`` (the same kernel with the fix switched off: plain BF16 flash
attention, still measured), or ``sdpa`` (transformers' own; no per-layer statistics). For A/B runs pass
``--on-spike warn``, so the callback reports a failure instead of skipping over it.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from datetime import datetime
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import stable_attn  # noqa: F401  (registers attn_implementation="stable_attn" with transformers)
from stable_attn.callbacks import StableAttentionCallback
from stable_attn.integrations.transformers import configure
from stable_attn.monitor.names import ALERTS_FILE
from stable_attn.report import build_report, format_summary, load_run, summarize


def _load_data_module():
    """``examples/gpt2_data.py`` by path: the examples folder is not a package."""
    path = Path(__file__).resolve().with_name("gpt2_data.py")
    module = sys.modules.get("gpt2_data")
    if module is not None and Path(module.__file__).resolve() == path:
        return module
    spec = importlib.util.spec_from_file_location("gpt2_data", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpt2_data"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpt2_data = _load_data_module()

ATTENTIONS = ("stable_attn", "stable_attn_paper", "stable_attn_off", "sdpa")
ON_SPIKE = ("warn", "skip", "rollback", "stop")
_RUN_DIR_ENV = "STABLE_ATTN_EXAMPLE_RUN_DIR"
ATTENTION_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "model": None}
PRECISIONS = ("auto", "bf16-mixed", "32-true", "16-mixed", "bf16-true")
# Finite updates before a layer's early-warning detectors may fire, counted in optimizer steps (see main()).
EARLY_WARNING_WARMUP_STEPS = 100


@dataclass(frozen=True)
class Preset:
    """Model, optimizer and schedule of one training setting; every field can be overridden by a flag."""

    n_layer: int
    n_head: int
    n_embd: int
    seq_len: int
    batch_size: int  # sequences per micro-batch per device
    accumulate: int  # micro-batches per optimizer step (over all devices)
    max_steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int | None  # cosine decay horizon; None = max_steps
    weight_decay: float
    beta1: float
    beta2: float
    grad_clip: float
    precision: str
    val_every: int  # optimizer steps between validations (and one at the last step)
    val_batches: int
    log_every: int  # optimizer steps between logged rows (per-layer statistics are measured on those)
    bias: bool
    vocab_size: int  # BPE size for text data (a .bin brings its own)


PRESETS: dict[str, Preset] = {
    # Measured on the CPU dev box (AMD EPYC, AVX2, no bf16 hardware), 1 thread: ~170 s of CPU time in all.
    # lr 1e-3 (the paper's): at 3e-3 the max attention logits climbed to ~39 within 200 steps and the
    # early-warning detectors fired 8 times (train/val loss 5.16/5.59 then, 5.32/5.71 at 1e-3).
    "cpu": Preset(
        n_layer=4, n_head=4, n_embd=128, seq_len=128, batch_size=16, accumulate=1, max_steps=300, lr=1e-3,
        min_lr=1e-4, warmup_steps=30, decay_steps=None, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0,
        precision="auto", val_every=50, val_batches=8, log_every=1, bias=True, vocab_size=4096,
    ),
    # For tests and smoke runs: seconds, still long enough for the spike detector's warm-up.
    "tiny": Preset(
        n_layer=2, n_head=2, n_embd=64, seq_len=64, batch_size=8, accumulate=1, max_steps=160, lr=3e-3,
        min_lr=3e-4, warmup_steps=10, decay_steps=None, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0,
        precision="auto", val_every=40, val_batches=4, log_every=1, bias=True, vocab_size=4096,
    ),
    # Qiu & Yao's GPT-2 small setting (their nanoGPT-based train.py), for a GPU.
    "gpt2-124m": Preset(
        n_layer=12, n_head=12, n_embd=768, seq_len=1024, batch_size=20, accumulate=16, max_steps=600_000, lr=1e-3,
        min_lr=1e-5, warmup_steps=2000, decay_steps=600_000, weight_decay=0.0, beta1=0.9, beta2=0.95,
        grad_clip=1.0, precision="bf16-mixed", val_every=1000, val_batches=50, log_every=10, bias=False,
        vocab_size=4096,
    ),
}


# --------------------------------------------------------------------------------------------------
# Model and LightningModule


def cast_attention(base: str, dtype: torch.dtype) -> str:
    """Register ``base`` (a transformers attention implementation) behind a cast of q, k, v to ``dtype``.

    Returns the new implementation's name (``"stable_attn_in_bf16"``). What it computes is what the attention
    computes under ``bf16-mixed``, where q, k, v come out of bf16 matrix products: the softmax and ``P V``
    in bf16 with bf16 rounding, while the rest of the model stays in its own dtype. The example uses it on
    CPUs, where bf16 matrix products are emulated and ten times slower (see :func:`resolve_precision`).
    """
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    name = f"{base}_in_{short}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        inner = ALL_ATTENTION_FUNCTIONS[base]

        def attention_in_dtype(module, query, key, value, attention_mask, **kwargs):
            out, weights = inner(module, query.to(dtype), key.to(dtype), value.to(dtype), attention_mask, **kwargs)
            return out.to(query.dtype), weights

        AttentionInterface.register(name, attention_in_dtype)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def build_model(cfg: Preset, vocab_size: int, eos_id: int | None, attention: str, beta: float,
                attention_dtype: torch.dtype | None = None) -> GPT2LMHeadModel:
    """A freshly initialised ``GPT2LMHeadModel`` (weights tied, no dropout) with the chosen attention.

    ``attention_dtype``: run the attention in this dtype (see :func:`cast_attention`); None leaves it to
    the model and the precision plugin.
    """
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=cfg.seq_len, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=eos_id, eos_token_id=eos_id,
        attn_implementation="sdpa" if attention == "sdpa" else "stable_attn",
    )
    model = GPT2LMHeadModel(config)
    if attention != "sdpa":
        stabilize = {"stable_attn": True, "stable_attn_paper": "paper", "stable_attn_off": False}[attention]
        configure(model, stabilize=stabilize, beta=beta)
    if attention_dtype is not None:
        model.set_attn_implementation(cast_attention(model.config._attn_implementation, attention_dtype))
    if not cfg.bias:
        remove_biases(model)
    return model


def remove_biases(model: torch.nn.Module) -> int:
    """Zero and freeze every bias vector: the exact bias-free model (HF's GPT-2 cannot drop them).

    Returns the number of bias parameters frozen.
    """
    count = 0
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            with torch.no_grad():
                param.zero_()
            param.requires_grad_(False)
            count += param.numel()
    return count


def lr_factor(step: int, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """Linear warm-up from ``1/warmup`` to 1, then cosine decay to ``min_ratio`` at ``decay_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))


class GPT2LightningModule(L.LightningModule):
    """Next-token prediction on token blocks of ``seq_len + 1`` ids (inputs ``[:-1]``, targets ``[1:]``).

    The loss is computed here rather than by ``labels=`` so every position of the block has a target, as in
    nanoGPT. ``inject_spike_at``: the optimizer step whose batches are replaced once by random ids.
    """

    def __init__(self, model: GPT2LMHeadModel, cfg: Preset, inject_spike_at: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.cfg = cfg
        self.inject_spike_at = inject_spike_at
        self.injected_steps: list[int] = []
        self._injected = False

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        if self.inject_spike_at is not None and not self._injected and step == self.inject_spike_at:
            # Every micro-batch of this optimizer step, once: a rollback does not replay it.
            batch = gpt2_data.corrupt_batch(batch, self.model.config.vocab_size, seed=step)
            if not self.injected_steps or self.injected_steps[-1] != step:
                self.injected_steps.append(step)
        loss = self._loss(batch)
        self.log("loss", loss.detach(), prog_bar=True, logger=False, on_step=True, on_epoch=False)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self.injected_steps and self.trainer.global_step > self.injected_steps[-1]:
            self._injected = True
        if self.trainer.global_step >= self.trainer.max_steps > 0:
            # Stopping explicitly makes Lightning run the validation loop once more: a final val loss.
            self.trainer.should_stop = True

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), prog_bar=True, on_step=False, on_epoch=True, sync_dist=True)

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        # Weight decay on matrices only (embeddings included), as nanoGPT does; biases and norms are exempt.
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        optimizer = torch.optim.AdamW(groups, lr=self.cfg.lr, betas=(self.cfg.beta1, self.cfg.beta2))
        decay_steps = self.cfg.decay_steps or self.cfg.max_steps
        min_ratio = self.cfg.min_lr / self.cfg.lr
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, self.cfg.warmup_steps, decay_steps, min_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# --------------------------------------------------------------------------------------------------
# Command line


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train_gpt2.py",
        description="Train GPT-2 with stable_attn (Lightning + transformers) and write a report.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="cpu: the 5-minute CPU run; tiny: seconds (tests); gpt2-124m: the paper's GPU setting")
    parser.add_argument("--data", default=None,
                        help="text file, or nanoGPT uint16 .bin of GPT-2 ids; default: the offline Python-docs corpus")
    parser.add_argument("--attention", choices=ATTENTIONS, default="stable_attn")
    parser.add_argument("--attention-dtype", choices=("auto", *ATTENTION_DTYPES), default="auto",
                        help="dtype the attention runs in; auto: bfloat16 (under 32-true, q, k, v are cast to bf16 "
                        "for the attention only; under bf16-mixed they already are)")
    parser.add_argument("--beta", type=_positive_float, default=2.0, help="the fix's beta (stable_attn, paper)")
    parser.add_argument("--on-spike", choices=ON_SPIKE, default="skip",
                        help="what the callback does on a loss or gradient-norm spike")
    parser.add_argument("--inject-spike-at", type=_nonnegative_int, default=None, metavar="STEP",
                        help="replace the batch of optimizer step STEP (0-based) with random token ids, once")
    parser.add_argument("--run-dir", default=None, help="default: runs/gpt2-<timestamp>")
    parser.add_argument("--accelerator", default="auto", help="Lightning accelerator: auto, cpu, gpu, ...")
    parser.add_argument("--devices", default="1", help="Lightning devices: a count, 'auto', or a list like 0,1")
    parser.add_argument("--strategy", default="auto", help="Lightning strategy (auto, ddp, ...)")
    parser.add_argument("--checkpoint-every", type=_positive_int, default=None, metavar="STEPS",
                        help="save a checkpoint (the latest only) to RUN_DIR/checkpoints every STEPS steps")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--cache-dir", default=None, help="corpus/tokenizer cache (default ~/.cache/stable_attn)")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="torch CPU threads (default: torch's choice, one per core)")
    parser.add_argument("--no-progress-bar", action="store_true", help="hide Lightning's progress bar")
    over = parser.add_argument_group("overrides of the preset")
    over.add_argument("--max-steps", type=_positive_int)
    over.add_argument("--batch-size", type=_positive_int, help="sequences per micro-batch per device")
    over.add_argument("--accumulate", type=_positive_int, help="micro-batches per optimizer step, over all devices")
    over.add_argument("--seq-len", type=_positive_int)
    over.add_argument("--n-layer", type=_positive_int)
    over.add_argument("--n-head", type=_positive_int)
    over.add_argument("--n-embd", type=_positive_int)
    over.add_argument("--lr", type=_positive_float)
    over.add_argument("--min-lr", type=_positive_float)
    over.add_argument("--warmup-steps", type=_nonnegative_int)
    over.add_argument("--decay-steps", type=_positive_int)
    over.add_argument("--weight-decay", type=float)
    over.add_argument("--grad-clip", type=float, help="0 disables clipping")
    over.add_argument("--precision", choices=PRECISIONS)
    over.add_argument("--val-every", type=_positive_int, help="optimizer steps between validations")
    over.add_argument("--val-batches", type=_positive_int)
    over.add_argument("--log-every", type=_positive_int, help="optimizer steps between logged metric rows")
    over.add_argument("--vocab-size", type=_positive_int, help="BPE vocabulary for text data")
    return parser


def resolve_preset(args: argparse.Namespace) -> Preset:
    """The preset with every flag the user gave applied, checked for consistency."""
    cfg = PRESETS[args.preset]
    given = {f.name: getattr(args, f.name) for f in fields(Preset) if getattr(args, f.name, None) is not None}
    cfg = replace(cfg, **given)
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"n_embd={cfg.n_embd} must be a multiple of n_head={cfg.n_head}")
    if cfg.min_lr > cfg.lr:
        raise ValueError(f"min_lr={cfg.min_lr} must not exceed lr={cfg.lr}")
    if cfg.grad_clip < 0 or cfg.weight_decay < 0:
        raise ValueError(f"grad_clip={cfg.grad_clip} and weight_decay={cfg.weight_decay} must be >= 0")
    if args.inject_spike_at is not None and args.inject_spike_at >= cfg.max_steps:
        raise ValueError(f"--inject-spike-at {args.inject_spike_at} must be below --max-steps {cfg.max_steps}")
    return cfg


def _devices(text: str) -> int | str | list[int]:
    if text == "auto":
        return text
    if "," in text:
        return [int(x) for x in text.split(",") if x.strip()]
    return int(text)


def resolve_precision(precision: str, accelerator: str) -> str:
    """``"auto"``: ``bf16-mixed`` on a CUDA GPU, ``32-true`` otherwise.

    Why not bf16 on every CPU: without bf16 matrix hardware (AMX, AVX512-BF16) PyTorch emulates bf16
    matrix products. Measured on the CPU dev box (AMD EPYC, AVX2, 1 thread) for the ``cpu`` preset: 528 ms
    of CPU time per training step in fp32, 5.3 s under bf16-mixed, which would not fit the 5-minute budget.
    Pass ``--precision bf16-mixed`` to run the attention in bf16 on the CPU anyway.
    """
    if precision != "auto":
        return precision
    wants_gpu = accelerator in ("auto", "gpu", "cuda")
    return "bf16-mixed" if wants_gpu and torch.cuda.is_available() else "32-true"


def resolve_attention_dtype(choice: str, precision: str) -> torch.dtype | None:
    """``"auto"``: bf16 attention whatever the precision (a cast only under ``32-true``; ``16-mixed`` keeps
    fp16). ``"model"``: no cast."""
    if choice == "auto":
        return torch.bfloat16 if precision.startswith("32") else None
    return ATTENTION_DTYPES[choice]


def _world_size(trainer: L.Trainer) -> int:
    return max(1, trainer.world_size)


def _describe(cfg: Preset, model: GPT2LMHeadModel, args: argparse.Namespace, data, accumulate: int,
              world: int) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tokens = cfg.batch_size * accumulate * world * cfg.seq_len
    return (
        f"data: {data.source}\n"
        f"model: GPT-2, {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, seq {cfg.seq_len}, "
        f"vocab {data.vocab_size}, {trainable / 1e6:.2f}M trainable parameters"
        f"{'' if cfg.bias else ' (biases zeroed and frozen)'}\n"
        f"attention: {args.attention} (attn_implementation={model.config._attn_implementation!r}); precision: "
        f"{cfg.precision}; on spike: {args.on_spike}"
        f"{'' if args.inject_spike_at is None else f'; spike injected at step {args.inject_spike_at}'}\n"
        f"training: {cfg.max_steps} steps x {tokens} tokens (batch {cfg.batch_size} x accumulate {accumulate} x "
        f"{world} device(s)), AdamW lr {cfg.lr:g} (warm-up {cfg.warmup_steps}, cosine to {cfg.min_lr:g}), "
        f"validation every {cfg.val_every} steps"
    )


def write_report(run_dir: Path) -> Path | None:
    """``build_report`` for the run; without matplotlib (a bare GPU image), say how to get it later
    instead of failing at the end of a long run: the CSV and JSONL are what the report is built from."""
    try:
        return build_report(run_dir)
    except ImportError as err:
        print(f"no plots: {err}; the metrics and alerts are saved, build the report later with "
              f"`stable-attn report {run_dir}`")
        return None


def main(argv: Sequence[str] | None = None) -> Path:
    """Run the training job; returns the run directory (metrics.csv, the alerts JSONL, PNGs, report.md)."""
    args = build_parser().parse_args(argv)
    cfg = resolve_preset(args)
    cfg = replace(cfg, precision=resolve_precision(cfg.precision, args.accelerator))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not args.run_dir and not (os.environ.get("LOCAL_RANK", "0") != "0" and _RUN_DIR_ENV in os.environ):
        # DDP re-launches this script once per extra device, a second or more later: the child processes
        # inherit the environment, so they agree with rank zero on the timestamped directory.
        os.environ[_RUN_DIR_ENV] = os.path.join("runs", f"gpt2-{datetime.now():%Y%m%d-%H%M%S}")
    run_dir = Path(args.run_dir or os.environ[_RUN_DIR_ENV])
    L.seed_everything(args.seed, workers=True, verbose=False)
    started = time.perf_counter()

    data = gpt2_data.load_data(args.data, block_size=cfg.seq_len + 1, vocab_size=cfg.vocab_size,
                               cache_dir=args.cache_dir)
    if len(data.train) == 0 or len(data.val) == 0:
        raise ValueError(f"data={args.data!r} is too short for seq_len={cfg.seq_len}: "
                         f"{len(data.train)} train / {len(data.val)} val blocks")
    attention_dtype = resolve_attention_dtype(args.attention_dtype, cfg.precision)
    model = build_model(cfg, data.vocab_size, data.eos_id, args.attention, args.beta, attention_dtype)
    module = GPT2LightningModule(model, cfg, args.inject_spike_at)

    callback = StableAttentionCallback(
        on_spike=args.on_spike,
        log_every_n_steps=cfg.log_every,
        # The model already runs the attention chosen above (the callback would switch sdpa, or the bf16 cast,
        # back to plain "stable_attn"); the callback still attaches and logs the per-layer statistics.
        swap=False,
        rollback_every=max(10, cfg.val_every),
        # from scratch, attention sinks form in the first ~100 steps: learning, not an anomaly
        early_warning_warmup=math.ceil(EARLY_WARNING_WARMUP_STEPS / cfg.log_every),
    )
    # name="" and version="" put metrics.csv (and the callback's alerts file) directly in run_dir.
    logger = CSVLogger(str(run_dir), name="", version="", flush_logs_every_n_steps=max(50, cfg.log_every))
    callbacks: list[L.Callback] = [callback]
    if args.checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=str(run_dir / "checkpoints"),
                                         every_n_train_steps=args.checkpoint_every, save_top_k=1))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=_devices(args.devices),
        strategy=args.strategy,
        precision=cfg.precision,
        max_steps=cfg.max_steps,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=cfg.log_every,
        gradient_clip_val=cfg.grad_clip or None,
        default_root_dir=str(run_dir),
        num_sanity_val_steps=0,
        enable_checkpointing=bool(args.checkpoint_every),
        enable_progress_bar=not args.no_progress_bar,
        enable_model_summary=False,
        check_val_every_n_epoch=None,
        limit_val_batches=cfg.val_batches,
        use_distributed_sampler=True,
    )
    world = _world_size(trainer)
    # The preset's accumulation counts micro-batches over all devices (as nanoGPT divides by the world size).
    # Both are plain Trainer attributes read when fit() starts; the world size is only known once the
    # Trainer has resolved accelerator, devices and strategy.
    accumulate = max(1, cfg.accumulate // world)
    trainer.accumulate_grad_batches = accumulate
    trainer.val_check_interval = cfg.val_every * accumulate  # counted in training batches
    # max_steps ends the run; a matching max_epochs only makes the progress bar read "Epoch 0/1", not "0/-2".
    per_rank = math.ceil(len(data.train) / world) // cfg.batch_size
    steps_per_epoch = max(1, math.ceil(per_rank / accumulate))
    trainer.fit_loop.max_epochs = math.ceil(cfg.max_steps / steps_per_epoch)
    if trainer.is_global_zero:
        print(_describe(cfg, model, args, data, accumulate, world), flush=True)

    train_loader = DataLoader(data.train, batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(data.val, batch_size=cfg.batch_size, shuffle=False)
    with warnings.catch_warnings():
        # The blocks are slices of an in-memory array (or a memmap): worker processes would only add start-up time.
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        # Lightning's own use of a deprecated torch API (torch 2.13); nothing a user of this script can change.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader)

    if trainer.is_global_zero:
        alerts = run_dir / ALERTS_FILE
        if not alerts.exists():
            # The callback writes the file at the first alert; an empty one says "monitored, nothing raised".
            alerts.touch()
        report = write_report(run_dir)
        elapsed = time.perf_counter() - started
        print()
        print(format_summary(summarize(load_run(run_dir))))
        if callback.skipped_steps:
            print(f"skipped updates:  steps {callback.skipped_steps}")
        if callback.rollbacks:
            print("rollbacks:        " + ", ".join(f"step {s} -> state after step {t}" for s, t in callback.rollbacks))
        if callback.stop_checkpoint:
            print(f"stopped early:    checkpoint {callback.stop_checkpoint}")
        print(f"run directory:    {run_dir}  (report: {report or 'not written'}; {elapsed:.0f} s in all)")
    return run_dir


if __name__ == "__main__":
    main()
