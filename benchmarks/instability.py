"""Does an early warning predict a real training instability? A CPU reproduction of attention-logit growth.

Run:  python benchmarks/instability.py                 (the recorded configuration: 6 runs, ~1 min each on one core)
      python benchmarks/instability.py --unstable-seeds 1 --no-qk-norm-run     (quick look: 3 runs)

Wortsman et al. (2023), "Small-scale proxies for large-scale Transformer training instabilities"
(arXiv 2309.14322), show that small Transformers trained at high learning rates without QK-layernorm
grow their attention logits without bound: the softmax collapses to one-hot, and the loss stops
improving or diverges, while the same model with layernorm on queries and keys trains well at the
same learning rate. Nothing is injected here: the script trains a tiny pre-LN GPT on bytes of
Python's own documentation (``pydoc_data.topics``, offline) with ``stable_attn.attention`` (fp32,
the PyTorch path; its ``AttentionStats`` give each layer's max scaled logit and saturation), and
feeds the run's own statistics to the detectors the Lightning callback uses, with their defaults:

- ``SpikeDetector.loss()`` on the loss and ``SpikeDetector.grad_norm()`` on the gradient norm
  (every step): the "spike" alerts;
- ``SurgeDetector.max_logit()`` and ``SurgeDetector.saturation()`` per layer (every step, with the
  loss, as the callback passes it): the early warnings.

Runs (same data and model, linear warm-up to the peak learning rate over 300 steps; only the
learning rate, the seed or QK-layernorm differ): two learning rates that train well (3e-3, 1e-2),
one that diverges (1.0) with three seeds, and the diverging one with QK-layernorm. For each run the
script prints the first early warning, the first loss alert and the first gradient-norm alert, and
the lead: optimizer steps from the first early warning to the first loss alert (the loss spike);
and the same for the loss-gated surge rule alone (``alarm_level`` off, replayed on the recorded
statistics).
It writes the per-step traces to ``benchmarks/results/instability.json`` and, with matplotlib, the
plot ``docs/images/instability.png`` (seed-0 runs: loss, gradient norm and the warned statistic,
alerts marked).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from torch import nn

from stable_attn import attention
from stable_attn.monitor import SpikeDetector, SurgeDetector
from stable_attn.stats import AttentionStats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/machine.py
from machine import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXT = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


class Block(nn.Module):
    """Pre-LN block without biases; optional LayerNorm on each head's queries and keys.

    ``attend(block, q, k, v)`` (``[B, H, N, D]``, causal) replaces the attention call (None:
    ``stable_attn.attention`` on the PyTorch path with the block's statistics); tensor_core_training.py
    passes its emulated arithmetic here.
    """

    def __init__(self, width: int, heads: int, qk_norm: bool, attend=None) -> None:
        super().__init__()
        self.heads = heads
        self.attend = attend
        self.ln1 = nn.LayerNorm(width, bias=False)
        self.ln2 = nn.LayerNorm(width, bias=False)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.fc = nn.Linear(width, 4 * width, bias=False)
        self.out = nn.Linear(4 * width, width, bias=False)
        self.q_norm = nn.LayerNorm(width // heads, bias=False) if qk_norm else None
        self.k_norm = nn.LayerNorm(width // heads, bias=False) if qk_norm else None
        self.stats = AttentionStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.attend is None:
            a = attention(q, k, v, causal=True, stats=self.stats)
        else:
            a = self.attend(self, q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, width: int, heads: int, layers: int, seq: int, qk_norm: bool, attend=None) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads, qk_norm, attend) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, bias=False)
        self.head = nn.Linear(width, 256, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@dataclass
class RunConfig:
    name: str
    lr: float
    qk_norm: bool = False
    seed: int = 0


@dataclass
class Run:
    config: RunConfig
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    max_logit: list[list[float]] = field(default_factory=list)  # [step][layer]
    saturation: list[list[float]] = field(default_factory=list)
    entropy: list[list[float]] = field(default_factory=list)  # [step][layer], nats: what the callbacks log
    alerts: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def train(config: RunConfig, args: argparse.Namespace) -> Run:
    torch.manual_seed(config.seed)
    model = TinyGPT(args.width, args.heads, args.layers, args.seq, config.qk_norm)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(config.seed)
    loss_det, norm_det = SpikeDetector.loss(), SpikeDetector.grad_norm()
    surges = {(stat, i): make(f"stable_attn/{stat}/layer{i}")
              for i in range(args.layers)
              for stat, make in (("max_logit", SurgeDetector.max_logit), ("saturation", SurgeDetector.saturation))}
    run = Run(config)
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = config.lr * min(1.0, (step + 1) / args.warmup)
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([data[s : s + args.seq] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + args.seq + 1] for s in starts.tolist()])
        for block in model.blocks:
            block.stats.reset()
        loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
        opt.step()
        value = float(loss.detach())
        run.loss.append(value)
        run.grad_norm.append(norm)
        run.max_logit.append([float(b.stats.max_logit.max()) for b in model.blocks])
        run.saturation.append([float(b.stats.saturation.mean()) for b in model.blocks])
        run.entropy.append([b.stats.summary().get("entropy", math.nan) for b in model.blocks])
        events = [loss_det.update(step, value), norm_det.update(step, norm)]
        for (stat, i), det in surges.items():
            stat_value = run.max_logit[-1][i] if stat == "max_logit" else run.saturation[-1][i]
            events.append(det.update(step, stat_value, loss=value))
        for event in events:
            if event is not None and event.is_new:
                run.alerts.append({"step": step, "kind": event.kind, "metric": event.metric, "rule": event.rule,
                                   "value": event.value, "baseline": event.baseline})
        if not math.isfinite(value):
            break
    run.seconds = time.perf_counter() - t0
    return run


def first(run: Run, kinds: tuple[str, ...]) -> dict | None:
    return next((a for a in run.alerts if a["kind"] in kinds), None)


def first_on(run: Run, metric: str) -> dict | None:
    return next((a for a in run.alerts if a["metric"] == metric and a["kind"] != "early_warning"), None)


def first_surge_only(run: Run) -> int | None:
    """The first early warning of the surge rule alone (``alarm_level`` off), replayed on the run's
    recorded statistics: how early the loss-gated rule warns by itself."""
    layers = len(run.max_logit[0])
    detectors = [(i, "max_logit", SurgeDetector.max_logit(alarm_level=math.inf)) for i in range(layers)]
    detectors += [(i, "saturation", SurgeDetector.saturation()) for i in range(layers)]
    for step, loss in enumerate(run.loss):
        for i, stat, det in detectors:
            value = run.max_logit[step][i] if stat == "max_logit" else run.saturation[step][i]
            if det.update(step, value, loss=loss) is not None:
                return step
    return None


def summarize(run: Run) -> dict:
    warn = first(run, ("early_warning",))
    loss_alert = first_on(run, "train/loss")
    surge_only = first_surge_only(run)
    tail = run.loss[-100:]
    return {
        "name": run.config.name, "lr": run.config.lr, "qk_norm": run.config.qk_norm, "seed": run.config.seed,
        "steps": len(run.loss), "final_loss_mean_last_100": sum(tail) / len(tail), "best_loss": min(run.loss),
        "peak_max_logit": max(max(row) for row in run.max_logit), "first_early_warning": warn,
        "first_loss_alert": loss_alert, "first_grad_norm_alert": first_on(run, "train/grad_norm"),
        "alerts": len(run.alerts),
        "lead_steps": (loss_alert["step"] - warn["step"]) if warn and loss_alert else None,
        "first_surge_rule_warning": surge_only,
        "lead_steps_surge_rule": (loss_alert["step"] - surge_only) if surge_only is not None and loss_alert else None,
        "seconds": run.seconds,
    }


def describe(alert: dict | None) -> str:
    """'step 83 (max_logit/layer0)' for a warning, 'step 214 (jump)' for a spike alert."""
    if alert is None:
        return "none"
    if alert["kind"] == "early_warning":
        return f"step {alert['step']} ({alert['metric'].split('/', 1)[1]})"
    return f"step {alert['step']} ({alert['rule']})"


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    palette = ["tab:blue", "tab:cyan", "tab:red", "tab:green", "tab:purple", "tab:orange"]
    for run, c in zip(runs, palette):
        qk = ", QK-layernorm" if run.config.qk_norm else ""
        label = f"{run.config.name} (lr {run.config.lr:g}{qk})"
        steps = range(len(run.loss))
        axes[0].semilogy(steps, run.loss, color=c, lw=0.7, label=label)
        axes[1].semilogy(steps, run.grad_norm, color=c, lw=0.7)
        axes[2].semilogy(steps, [max(row) for row in run.max_logit], color=c, lw=1.0)
        for a in run.alerts:
            if not math.isfinite(a["value"]):
                continue
            ax = axes[2] if a["kind"] == "early_warning" else (axes[1] if "grad_norm" in a["metric"] else axes[0])
            ax.plot([a["step"]], [a["value"]], "^" if a["kind"] == "early_warning" else "x", color=c, ms=7, mew=1.5)
        summary = summarize(run)
        for key, style in (("first_early_warning", ":"), ("first_loss_alert", "--")):
            if summary[key] is not None:
                for ax in axes:
                    ax.axvline(summary[key]["step"], color=c, lw=1.0, ls=style)
    axes[0].set_ylabel("training loss (nats/byte)")
    axes[0].legend(loc="upper left", fontsize=8)
    axes[1].set_ylabel("gradient norm")
    axes[2].set_ylabel("max attention logit (max over layers)")
    axes[2].set_xlabel("optimizer step   (^ early warning, x spike alert; dotted: first early warning, "
                       "dashed: first loss alert)")
    fig.suptitle("Attention-logit growth without QK-layernorm: early warnings and spike alerts")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--good-lr", type=float, nargs="+", default=[3e-3, 1e-2])
    parser.add_argument("--unstable-lr", type=float, default=1.0)
    parser.add_argument("--unstable-seeds", type=int, default=3, help="seeds of the unstable run (0..N-1)")
    parser.add_argument("--warmup", type=int, default=300, help="linear warm-up steps")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-qk-norm-run", action="store_true", help="skip the unstable lr + QK-layernorm run")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "instability.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "images" / "instability.png"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    configs = [RunConfig("good", lr) for lr in args.good_lr]
    configs += [RunConfig("unstable", args.unstable_lr, seed=seed) for seed in range(args.unstable_seeds)]
    if not args.no_qk_norm_run:
        configs.append(RunConfig("unstable", args.unstable_lr, qk_norm=True))
    runs = [train(c, args) for c in configs]
    summaries = [summarize(r) for r in runs]
    print(f"Tiny GPT: {args.layers} layers, width {args.width}, {args.heads} heads, seq {args.seq}, batch "
          f"{args.batch}, byte vocabulary, AdamW (0.9, 0.95), warm-up {args.warmup}, fp32, {args.steps} steps")
    print()
    print("| run | lr | QK-norm | seed | loss, mean of last 100 | best loss | peak max logit "
          "| first early warning | first loss alert | first grad-norm alert | lead (steps) "
          "| surge rule alone: first warning, lead | alerts | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        print(f"| {s['name']} | {s['lr']:g} | {'yes' if s['qk_norm'] else 'no'} | {s['seed']} "
              f"| {s['final_loss_mean_last_100']:.3f} | {s['best_loss']:.3f} | {s['peak_max_logit']:.3g} "
              f"| {describe(s['first_early_warning'])} | {describe(s['first_loss_alert'])} "
              f"| {describe(s['first_grad_norm_alert'])} "
              f"| {s['lead_steps'] if s['lead_steps'] is not None else '-'} "
              f"| {s['first_surge_rule_warning'] if s['first_surge_rule_warning'] is not None else 'none'}, "
              f"{s['lead_steps_surge_rule'] if s['lead_steps_surge_rule'] is not None else '-'} "
              f"| {s['alerts']} | {s['seconds']:.0f} |")
    print()
    for run in runs:
        print(f"{run.config.name}: alerts " + (", ".join(f"{a['step']}:{a['metric']}:{a['rule']}" for a in run.alerts)
                                               or "none"))
    print(f"Machine: {cpu_model()}, {os.cpu_count()} cores visible, {args.threads} torch thread(s), "
          f"Python {platform.python_version()}, torch {torch.__version__}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "summaries": summaries,
                   "runs": [{"config": vars(r.config), "loss": r.loss, "grad_norm": r.grad_norm,
                             "max_logit": r.max_logit, "saturation": r.saturation, "entropy": r.entropy,
                             "alerts": r.alerts}
                            for r in runs]}, f)
    try:
        plot([r for r in runs if r.config.seed == 0], Path(args.plot))
        print(f"plot: {args.plot}")
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
