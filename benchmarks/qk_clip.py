"""QK-Clip on the CPU: tiny GPT-2 and tiny Llama (no QK-norm) at a learning rate where max logits grow.

Run:  python benchmarks/qk_clip.py                      (the recorded configuration, a few minutes on one core)
      python benchmarks/qk_clip.py --steps 60 --families gpt2   (a quick look)

Each family trains twice from the same initial weights on the same batches (bytes of Python's own
documentation, ``pydoc_data.topics``, offline), with ``attn_implementation="stable_attn"`` on the PyTorch
path and AdamW at a high peak learning rate: once plain, once with QK-Clip at ``tau`` (what
``MonitorEngine(qk_clip=tau)`` does after each applied step: every step's per-head max logits from the
attention statistics, then :class:`stable_attn.monitor.actions.qk_clip.QKClip`). After each step the script runs
the step's batch again (no gradient) and records every head's max logit: for the clipped run, after the
clip. It prints, per run, the peak max logit before and after the first clip, whether the clipped run's
re-run max logit stayed <= tau (1 + 1e-3) from its first clip on, per layer, and the loss (mean of the last
50 steps, and up to the step where the plain run's loss first exceeds 2x its best, if it does). It writes
``benchmarks/results/qk_clip.json`` and, with matplotlib, ``docs/images/qk_clip.png`` (max logit per head,
with and without; loss).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import stable_attn.integrations.transformers as st
from stable_attn.monitor.actions.qk_clip import QKClip

ROOT = Path(__file__).resolve().parents[1]


def build(family: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0,
                         resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel._from_config(cfg, attn_implementation="stable_attn")
    else:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          bos_token_id=0, eos_token_id=0)
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="stable_attn")
    st.configure(model, backend="torch")
    return model


def batches(steps: int, batch: int, seq: int) -> list[torch.Tensor]:
    data = torch.tensor(list("".join(topics.values()).encode("utf-8", "replace")))
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, data.numel() - seq - 1, (steps, batch), generator=g)
    return [torch.stack([data[s:s + seq] for s in row.tolist()]) for row in starts]


def max_logits(stats: dict) -> dict[str, list[float]]:
    return {name: s.max_logit.tolist() for name, s in stats.items()}


def train(model: torch.nn.Module, data: list[torch.Tensor], lr: float, warmup: int, tau: float | None) -> dict:
    stats = st.attach_stats(model)
    for s in stats.values():
        s.with_entropy = False  # QK-Clip's statistics level: the max logit, not the entropy
    clip = None
    if tau is not None:
        clip = QKClip(tau)
        clip.setup(dict(zip(stats, (m for _, m in st.attention_modules(model)), strict=True)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    out = {"loss": [], "pre": [], "post": [], "clipped": []}
    for step, batch in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        for s in stats.values():
            s.reset()
            s.enabled = True
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["loss"].append(loss.item())
        out["pre"].append(max_logits(stats))
        record = clip.apply({n: s.max_logit for n, s in stats.items()}) if clip is not None else None
        out["clipped"].append(record.clipped_heads if record is not None else 0)
        for s in stats.values():  # the step's batch again, with the weights as the next step will see them
            s.reset()
        with torch.no_grad():
            model(input_ids=batch)
        out["post"].append(max_logits(stats))
        for s in stats.values():
            s.enabled = False
    return out


def first_blowup(loss: list[float]) -> int | None:
    best = math.inf
    for i, v in enumerate(loss):
        if not math.isfinite(v) or v > 2 * best:
            return i
        best = min(best, v)
    return None


def summarize(family: str, plain: dict, clipped: dict, tau: float) -> dict:
    first_clip = next((i for i, n in enumerate(clipped["clipped"]) if n), None)
    layers = list(plain["post"][0])
    peak = {name: max(max(row[name]) for row in plain["post"]) for name in layers}
    bounded, worst = {}, {}
    for name in layers:
        after = [max(row[name]) for row in clipped["post"][first_clip:]] if first_clip is not None else []
        worst[name] = max(after) if after else None
        bounded[name] = all(v <= tau * (1 + 1e-3) for v in after) if after else None
    blow = first_blowup(plain["loss"])
    upto = blow if blow is not None else len(plain["loss"])
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    return {
        "family": family, "tau": tau, "first_clip_step": first_clip,
        "clip_steps": sum(1 for n in clipped["clipped"] if n),
        "plain_peak_max_logit": peak, "clipped_max_logit_after_first_clip": worst,
        "bounded_after_first_clip": bounded,
        "plain_blowup_step": blow, "loss_plain_mean_to_blowup": mean(plain["loss"][:upto]),
        "loss_clipped_mean_to_blowup": mean(clipped["loss"][:upto]),
        "loss_plain_last50": mean(plain["loss"][-50:]), "loss_clipped_last50": mean(clipped["loss"][-50:]),
    }


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    families = list(results)
    fig, axes = plt.subplots(2, len(families), figsize=(6 * len(families), 7), squeeze=False)
    for j, family in enumerate(families):
        r = results[family]
        tau = r["summary"]["tau"]
        for run, style in (("plain", "-"), ("clipped", "--")):
            for name in r[run]["post"][0]:
                heads = len(r[run]["post"][0][name])
                for h in range(heads):
                    axes[0][j].plot([row[name][h] for row in r[run]["post"]], style, lw=0.7,
                                    label=f"{run} {name} h{h}" if h == 0 else None)
            axes[1][j].plot(r[run]["loss"], style, lw=0.8, label=run)
        axes[0][j].axhline(tau, color="k", lw=0.8, ls=":")
        axes[0][j].set_title(f"{family}: max logit per head on the step's batch (tau {tau:g} dotted)")
        axes[0][j].set_yscale("log")
        axes[0][j].legend(fontsize=6)
        axes[1][j].set_title(f"{family}: training loss")
        axes[1][j].legend()
        axes[1][j].set_xlabel("optimizer step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-2)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--tau", type=float, default=10.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "qk_clip.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "qk_clip.png")
    args = p.parse_args()
    torch.set_num_threads(1)
    data = batches(args.steps, args.batch, args.seq)
    results = {}
    print("| family | tau | plain peak max logit (per layer) | first clip | clipped max logit after it | "
          "<= tau (1 + 1e-3) | plain blow-up step | loss to blow-up plain / clipped | last 50 plain / clipped |")
    print("|---|---:|---|---:|---|---|---:|---|---|")
    for family in args.families:
        t0 = time.time()
        model = build(family, seed=0)
        twin = copy.deepcopy(model)
        plain = train(model, data, args.lr, args.warmup, None)
        clipped = train(twin, data, args.lr, args.warmup, args.tau)
        s = summarize(family, plain, clipped, args.tau)
        results[family] = {"summary": s, "plain": plain, "clipped": clipped, "seconds": time.time() - t0}
        fmt = lambda d: ", ".join(f"{k} {v:.3g}" if v is not None else f"{k} -" for k, v in d.items())  # noqa: E731
        print(f"| {family} | {args.tau:g} | {fmt(s['plain_peak_max_logit'])} | {s['first_clip_step']} | "
              f"{fmt(s['clipped_max_logit_after_first_clip'])} | {s['bounded_after_first_clip']} | "
              f"{s['plain_blowup_step']} | {s['loss_plain_mean_to_blowup']:.4f} / "
              f"{s['loss_clipped_mean_to_blowup']:.4f} | {s['loss_plain_last50']:.4f} / "
              f"{s['loss_clipped_last50']:.4f} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))
    print(f"wrote {args.json}")
    plot(results, args.plot)


if __name__ == "__main__":
    main()
