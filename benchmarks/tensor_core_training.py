"""Training under emulated H100 tensor-core arithmetic: does the fix change how far W_q / W_k drift?

Run:  python benchmarks/tensor_core_training.py --steps 3000          (the recorded A/B; see docs/NUMERICS.md)
      python benchmarks/tensor_core_training.py --steps 20 --log-every 5   (a quick look)

Qiu & Yao measure the BF16 failure as a drift of the query/key weights away from a twin run whose
``P-bar V`` is in fp32, concentrated in a few singular directions (a low-rank structure), with growing
max logits, until the loss blows up. This script reproduces that measurement at CPU size: the tiny
pre-LN GPT of ``instability.py`` (bytes of ``pydoc_data.topics``, same data helpers) trained three
times from the same initial weights on the same batches, lock-step, one step of each arm in turn:

- ``off``: attention forward as our kernel runs it with ``stabilize=False`` (FlashAttention-2: fp32 row sum
  of the unrounded ``P-bar``), ``P-bar`` rounded to bf16 and ``P-bar V`` on the emulated H100 tensor cores
  (:func:`stable_attn.numerics.arithmetic.tensor_core_forward`: the kernel's key-block order, ``alpha``
  rescale of the fp32 accumulator, 16-key MMA instructions, each :func:`stable_attn.numerics.tensor_core.mma`);
- ``ours``: the same with ``stabilize=True`` (our rule and the rounded row sum, itself an MMA);
- ``twin``: ``stable_attn.attention(..., stabilize=False, pv_fp32=True)`` on the PyTorch path: ``P-bar`` kept in
  fp32 for an fp32 ``P-bar V``, the reference the drift is measured from.

What is emulated and what is not. Attention takes bf16 ``q, k, v`` (the rest of the model is fp32, so the
arms differ in attention arithmetic only). The scores ``q.k`` are an fp32 product of the bf16 inputs (CPU
matmul, as the PyTorch path and the twin compute them), not an emulated MMA: only ``P-bar V`` (and, for
``ours``, the row sum) runs on the tensor-core model. The backward is the op's own backward
(``reference.attention_backward``: FlashAttention-2's recomputation with ``delta = rowsum(dO * O)``), fed the
emulated forward's ``O`` and ``lse``: so the forward's rounding error reaches ``dQ`` and ``dK`` through
``delta``, the paper's path, but the backward's own products (``dP``, ``dS``, ``dV``, ``dQ``, ``dK``) are fp32
accumulations of bf16-cast operands on the CPU, not emulated tensor cores.

Per logged step and layer: ``||W_q - W_q^twin||_F`` and ``||W_k - W_k^twin||_F``, the share of each
difference's energy in its top singular direction (``sigma_1^2 / sum sigma_i^2``; about ``4 / width`` for
a random Gaussian matrix, printed for comparison), the max scaled attention logit, the loss; on the
logged step's forward, the signed error of each layer's ``O`` against the float64 answer on the same
bf16 inputs (:func:`stable_attn.numerics.bias.error_stats`, bf16 roundings, t), and the share of rows
with two or more ``P-bar`` equal to 1.0 (the paper's trigger). Writes a table
(``benchmarks/results/tensor_core_training.txt`` via ``--table``), JSON traces (``--json``, rewritten at
every log so a cut-short run keeps its prefix) and, with matplotlib, ``docs/images/tensor_core_training.png``.
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

import torch
import torch.nn.functional as F

from stable_attn import attention
from stable_attn.kernels import naive, reference
from stable_attn.numerics import arithmetic
from stable_attn.numerics.bias import error_stats, row_unit
from stable_attn.numerics.paper_attention import PaperStats, paper_attention
from stable_attn.options import BLOCK_N, FIX_NAMES, Options

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/instability.py, machine.py
from bias_study import git_commit  # noqa: E402
from instability import TEXT, TinyGPT  # noqa: E402
from machine import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# arm name -> (arithmetic, fix): "emulated" P-bar V on the tensor-core model; "cpu": the op's PyTorch path
# (bf16 P-bar, fp32 CPU matmul: the control that separates P-bar's rounding from the tensor cores' accumulation);
# "twin": fp32 P-bar V, the reference of every drift
# "paper_bf16": the paper's own all-BF16 flash attention, forward and backward (model b; the positive control)
ARM_KINDS = {"off": ("emulated", "off"), "ours": ("emulated", "ours"), "off_cpu": ("cpu", "off"),
             "ours_cpu": ("cpu", "ours"), "b_off": ("paper_bf16", "off"), "b_paper": ("paper_bf16", "paper"),
             "twin": ("twin", "off")}
ARMS = ("off", "ours", "twin")  # the recorded A/B; --arms chooses others (the twin is always run, last)
PAIRS = (("ours", "off"), ("ours_cpu", "off_cpu"), ("b_paper", "b_off"))
# the positive control (--control): the paper's arithmetic, fix off and the paper's, beside the fused op, fix off
# and ours, on data with a fixed first token (an attention sink)
CONTROL_ARMS = ("b_off", "b_paper", "off_cpu", "ours_cpu")
SINK_TOKEN = 0  # byte 0 never occurs in the text: every sequence starts with it  # arms also compared with each other
_BF16 = torch.bfloat16


def emulated_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fix: str,
                     model: str = "h100") -> tuple[torch.Tensor, torch.Tensor, arithmetic.ModelOutput]:
    """Causal attention of bf16 ``q, k, v`` ``[B, H, N, D]`` with ``P-bar V`` on ``model``'s tensor cores.

    The scores are ``q.k`` in fp32 (exact bf16 products, CPU fp32 sums, as the PyTorch path forms them),
    masked ``-inf`` above the diagonal; every query row then runs through
    :func:`arithmetic.tensor_core_forward` on the key partition the Triton forward walks on that GPU
    (:func:`arithmetic.kernel_key_block`). Returns ``O`` ``[B, H, N, D]`` bf16, ``lse2`` ``[B, H, N]`` (what
    the kernel saves for the backward) and the lab's diagnostics. ``model="fp32_matmul"`` is the PyTorch
    path's arithmetic (the test's cross-check).
    """
    if fix not in ("off", "ours"):
        raise ValueError(f"fix={fix!r}; accepted values: ('off', 'ours')")
    if q.dtype != _BF16 or k.dtype != _BF16 or v.dtype != _BF16:
        raise TypeError(f"q, k, v must be bfloat16; got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, N, D = q.shape
    opts = Options.create(head_dim=D, causal=True, stabilize=FIX_NAMES[fix])
    x = torch.matmul(q.float(), k.float().transpose(-1, -2))
    x = x.masked_fill(~naive.visibility(N, N, causal=True)[0, 0], -math.inf)
    group = torch.arange(B * H).repeat_interleave(N)
    res = arithmetic.tensor_core_forward(
        x.reshape(B * H * N, N), v.reshape(B * H, N, D), fix, qk_scale2=opts.qk_scale2, model=model,
        block_n=arithmetic.kernel_key_block(model, fix, _BF16, D, plain=True), group=group, beta=opts.beta,
        out_dtype=_BF16)
    return res.out.to(_BF16).view(B, H, N, D), res.lse2.float().view(B, H, N), res


class EmulatedAttention(torch.autograd.Function):
    """:func:`emulated_forward` with the op's backward (``reference.attention_backward``) on its ``O``, ``lse``."""

    @staticmethod
    def forward(ctx, q, k, v, fix: str, model: str, sink: list):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse2, res = emulated_forward(q, k, v, fix, model)
        ctx.save_for_backward(q, k, v, out, lse2)
        ctx.opts = Options.create(head_dim=q.shape[-1], causal=True, stabilize=FIX_NAMES[fix], backend="torch")
        sink.append(res)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse2 = ctx.saved_tensors
        dq, dk, dv = reference.attention_backward(do.contiguous(), q, k, v, out, lse2, opts=ctx.opts)
        return dq, dk, dv, None, None, None


@dataclass
class Arm:
    """One arm's attention (the ``attend`` of instability.Block) and what it records per layer."""

    name: str
    model: str = "h100"
    paper_block: int = 32  # key block of the paper_bf16 arms
    measure: bool = False  # on a logged step: O's error against float64 and the P-bar diagnostics
    max_logit: list[float] = field(default_factory=list)  # per call (= layer) of the current step
    o_error: list[dict] = field(default_factory=list)
    pbar: list[dict] = field(default_factory=list)
    ties: list[dict] = field(default_factory=list)  # per layer: tie-block and fired-block rates (measured steps)

    def reset(self, measure: bool) -> None:
        self.measure, self.max_logit, self.o_error, self.pbar, self.ties = measure, [], [], [], []

    def __call__(self, block, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qb, kb, vb = (t.to(_BF16) for t in (q, k, v))
        D = q.shape[-1]
        with torch.no_grad():
            x = torch.matmul(qb.float(), kb.float().transpose(-1, -2)) * D ** -0.5
            n = x.shape[-1]
            self.max_logit.append(float(x.masked_fill(~naive.visibility(n, n, causal=True)[0, 0], -math.inf).max()))
        kind, fix = ARM_KINDS[self.name]
        if kind == "paper_bf16":
            st = PaperStats()
            out = paper_attention(qb, kb, vb, fix=fix, block_n=self.paper_block, causal=True,
                                  stats=st if self.measure else None)
            if self.measure:
                self.ties.append({"tie_rate": st.tie_rate, "fired_rate": st.fired_rate})
        elif kind == "twin":
            out = attention(qb, kb, vb, causal=True, stabilize=False, pv_fp32=True, backend="torch")
        elif kind == "cpu":
            out = attention(qb, kb, vb, causal=True, stabilize=FIX_NAMES[fix], backend="torch")
        else:
            sink: list = []
            out = EmulatedAttention.apply(qb, kb, vb, fix, self.model, sink)
            if self.measure:
                res = sink[0]
                with torch.no_grad():  # what the tensor cores change: O against the op's own (CPU) arithmetic
                    cpu = attention(qb, kb, vb, causal=True, stabilize=FIX_NAMES[fix], backend="torch")
                self.pbar.append({"rows_two_pbar_ones": float((res.pbar_ones >= 2).double().mean()),
                                  "fired_blocks_per_row": res.fired_rate,
                                  "o_differs_from_cpu_path": float((out != cpu).double().mean())})
        if self.measure and kind != "paper_bf16":
            with torch.no_grad():
                rate = tie_block_rate(x, BLOCK_N)
            # our rule fires exactly on this trigger; fix off and the twin never shift
            self.ties.append({"tie_rate": rate, "fired_rate": rate if fix == "ours" else 0.0})
        if self.measure:
            with torch.no_grad():
                exact = naive.attention(qb, kb, vb, causal=True).reshape(-1, D)
                got = out.detach().double().reshape(-1, D)
                keep = exact.abs().amax(dim=1) > 0
                st = error_stats(got[keep], exact[keep], row_unit(exact[keep]))
                self.o_error.append({"mean": st.mean, "t": st.t, "rms": st.rms})
        return out.float()


def tie_block_rate(x: torch.Tensor, block_n: int) -> float:
    """Share of (row, key block) pairs, causal, where two or more fp32 scaled scores ``x`` ``[..., N, N]`` give a
    ``P-bar`` that rounds to 1.0 in bf16 against the running max (the trigger of our rule, fix or not)."""
    n = x.shape[-1]
    x = x.masked_fill(~naive.visibility(n, n, causal=True)[0, 0], -math.inf)
    m = torch.full(x.shape[:-1], -math.inf)
    hits = seen = 0
    for j0 in range(0, n, block_n):
        s = x[..., j0:j0 + block_n]
        m_blk = s.amax(dim=-1)
        live = m_blk > -math.inf
        m = torch.maximum(m, m_blk)
        ones = (torch.exp(s - m[..., None]).to(_BF16) == 1.0).sum(dim=-1) >= 2
        hits += int((ones & live).sum())
        seen += int(live.sum())
    return hits / seen if seen else 0.0


def qk_weights(model: TinyGPT) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(W_q, W_k)`` of each layer: the first two ``width`` row blocks of the fused ``qkv`` weight."""
    out = []
    for block in model.blocks:
        w = block.qkv.weight.detach()
        width = w.shape[1]
        out.append((w[:width], w[width:2 * width]))
    return out


def drift(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float | None]:
    """``||a - b||_F`` and the top singular direction's share of its energy (None for a zero difference)."""
    sv = torch.linalg.svdvals((a - b).double())
    energy = float(sv.pow(2).sum())
    return math.sqrt(energy), (float(sv[0] ** 2) / energy if energy > 0 else None)


def random_top_share(width: int, trials: int = 20) -> float:
    """Mean ``sigma_1^2 / sum sigma^2`` of Gaussian ``width x width`` matrices: the share with no structure."""
    g = torch.Generator().manual_seed(0)
    shares = [drift(torch.randn(width, width, generator=g, dtype=torch.float64), torch.zeros(width, width))[1]
              for _ in range(trials)]
    return sum(shares) / len(shares)


def batches(steps: int, batch: int, seq: int, seed: int, data: str = "text") -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[steps, batch, seq]``: random windows of instability.TEXT, as instability.train
    draws them; ``data="sinks"``: every input starts with :data:`SINK_TOKEN` (a fixed first token, which
    attention learns to use as a sink), followed by the window."""
    text = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - seq - 1, (steps, batch), generator=gen)
    idx = starts[..., None] + torch.arange(seq + 1)
    window = text[idx]
    if data == "sinks":
        window[..., 0] = SINK_TOKEN
    return window[..., :-1], window[..., 1:]


def arm_names(args: argparse.Namespace) -> tuple[str, ...]:
    """The arms of a run: ``--arms`` in order, the twin last (once)."""
    return (*(a for a in args.arms if a != "twin"), "twin")


def train(args: argparse.Namespace, on_log=None) -> dict:
    """The three arms in lock-step; returns the traces (and calls ``on_log(traces)`` at every log)."""
    names = arm_names(args)
    arms = {name: Arm(name, args.arithmetic, args.paper_block) for name in names}
    pairs = [(a, b) for a, b in PAIRS if a in names and b in names]
    models, opts = {}, {}
    for name in names:
        torch.manual_seed(args.seed)  # the same initial weights in every arm
        models[name] = TinyGPT(args.width, args.heads, args.layers, args.seq, False, attend=arms[name])
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    xs, ys = batches(args.steps, args.batch, args.seq, args.seed, args.data)
    seconds = dict.fromkeys(names, 0.0)
    traces: dict = {"steps": [], "arms": {name: {"loss": [], "max_logit": [], "o_error": [], "pbar": [], "ties": [],
                                                 "drift_q": [], "drift_k": [], "top_share_q": [], "top_share_k": [],
                                                 "loss_every_step": []}
                                          for name in names}}
    for a, b in pairs:  # ||W_a - W_b||_F per layer: how far two arms of one arithmetic are from each other
        traces[f"{a}_vs_{b}_q"], traces[f"{a}_vs_{b}_k"] = [], []

    def log(step: int, losses: dict, measured: bool) -> None:
        traces["steps"].append(step)
        twin = qk_weights(models["twin"])
        for name in names:
            tr = traces["arms"][name]
            tr["loss"].append(losses.get(name))
            tr["max_logit"].append(arms[name].max_logit if measured else None)
            tr["o_error"].append(arms[name].o_error if measured else None)
            tr["pbar"].append(arms[name].pbar if measured else None)
            tr["ties"].append(arms[name].ties if measured else None)
            if name == "twin":
                continue
            layer_pairs = zip(qk_weights(models[name]), twin)
            dq, dk = zip(*[(drift(wq, tq), drift(wk, tk)) for (wq, wk), (tq, tk) in layer_pairs])
            tr["drift_q"].append([d[0] for d in dq])
            tr["top_share_q"].append([d[1] for d in dq])
            tr["drift_k"].append([d[0] for d in dk])
            tr["top_share_k"].append([d[1] for d in dk])
        for a, b in pairs:
            both = list(zip(qk_weights(models[a]), qk_weights(models[b])))
            traces[f"{a}_vs_{b}_q"].append([drift(x[0], y[0])[0] for x, y in both])
            traces[f"{a}_vs_{b}_k"].append([drift(x[1], y[1])[0] for x, y in both])
        traces["seconds"] = dict(seconds)
        if on_log is not None:
            on_log(traces)

    start = 0
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt is not None and ckpt.exists():  # resume: same arguments, so the same batches and arms
        saved = torch.load(ckpt, weights_only=False)
        key = _checkpoint_key(args)
        if {k: saved["key"].get(k) for k in key} != key:
            raise ValueError(f"--checkpoint {ckpt}: written by another configuration ({saved['key']}); remove it")
        for name in names:
            models[name].load_state_dict(saved["models"][name])
            opts[name].load_state_dict(saved["opts"][name])
        traces, start = saved["traces"], saved["step"]
        if start > args.steps:
            raise ValueError(f"--checkpoint {ckpt} is at step {start}, past --steps={args.steps}")
        seconds.update(traces["seconds"])
        print(f"resumed from {ckpt} at step {start}")
    else:
        log(0, {}, False)  # before the first update: every drift is 0
    for step in range(start, args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        measured = (step + 1) % args.log_every == 0 or step + 1 == args.steps
        losses = {}
        for name in names:
            t0 = time.perf_counter()
            arms[name].reset(measured)
            for group in opts[name].param_groups:
                group["lr"] = lr
            loss = F.cross_entropy(models[name](xs[step]).view(-1, 256), ys[step].reshape(-1))
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            opts[name].step()
            losses[name] = float(loss.detach())
            traces["arms"][name]["loss_every_step"].append(losses[name])
            seconds[name] += time.perf_counter() - t0
        if measured:
            log(step + 1, losses, True)
        if ckpt is not None and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"key": _checkpoint_key(args), "step": step + 1, "traces": traces,
                        "models": {n: m.state_dict() for n, m in models.items()},
                        "opts": {n: o.state_dict() for n, o in opts.items()}}, tmp)
            tmp.replace(ckpt)  # atomic: a run killed while saving keeps the previous checkpoint
        if not all(math.isfinite(v) for v in losses.values()):
            break
    if args.save_weights:
        torch.save({name: m.state_dict() for name, m in models.items()}, args.save_weights)
    return traces


def _checkpoint_key(args: argparse.Namespace) -> dict:
    """What a checkpoint must share with the run that resumes it. Not ``--steps``: the first N steps' batches do
    not depend on it (one generator draws them row by row) and the schedule is a warm-up only, so a longer run
    resumes a shorter one's checkpoint and continues it."""
    keys = ("log_every", "lr", "warmup", "width", "heads", "layers", "seq", "batch", "seed", "arithmetic",
            "arms", "data", "paper_block")
    return {k: getattr(args, k) for k in keys}


def agreement(args: argparse.Namespace, weights: str) -> dict[str, list[float]]:
    """Per emulated arm and layer: the share of ``O``'s elements in which the tensor-core arithmetic differs from
    the op's PyTorch path (same bf16 inputs, same fix), on the last step's batch with the arm's saved final weights
    (``--save-weights``)."""
    states = torch.load(weights)
    xs, _ = batches(args.steps, args.batch, args.seq, args.seed, args.data)
    out = {}
    for name, state in states.items():
        if ARM_KINDS[name][0] != "emulated":
            continue
        arm = Arm(name, args.arithmetic)
        model = TinyGPT(args.width, args.heads, args.layers, args.seq, False, attend=arm)
        model.load_state_dict(state)
        arm.reset(True)
        with torch.no_grad():
            model(xs[-1])
        out[name] = [d["o_differs_from_cpu_path"] for d in arm.pbar]
    return out


def mean_last(values: list, frac: float = 0.1) -> float:
    vals = [v for v in values if v is not None]
    tail = vals[-max(1, int(len(vals) * frac)):]
    return sum(tail) / len(tail)


def _layer_mean(row: list) -> float:
    vals = [v for v in row if v is not None]
    return sum(vals) / len(vals) if vals else math.nan


def table(traces: dict, args: argparse.Namespace, share0: float) -> str:
    """The A/B at a few logged steps, a summary over the run, and the run's setup and machine."""
    steps = traces["steps"]
    names = list(traces["arms"])
    drifting = [n for n in names if n != "twin"]
    picks = sorted({i for i in (len(steps) // 8, len(steps) // 4, len(steps) // 2, 3 * len(steps) // 4,
                                len(steps) - 1) if i > 0})
    lines = [f"Tiny GPT: {args.layers} layers, width {args.width}, {args.heads} heads (head dim "
             f"{args.width // args.heads}), seq {args.seq}, batch {args.batch}, byte vocabulary, AdamW (0.9, 0.95), "
             f"lr {args.lr:g}, warm-up {args.warmup}, seed {args.seed}; attention on bf16 q, k, v. Arms: "
             + ", ".join(f"{n} ({ARM_KINDS[n][0]}, fix {ARM_KINDS[n][1]})" for n in names)
             + f"; emulated = P-bar V on the {args.arithmetic} tensor-core model, cpu = the op's PyTorch path "
             "(bf16 P-bar, fp32 matmul), twin = fp32 P-bar V",
             f"steps per arm: {steps[-1]}; wall seconds per arm: "
             + ", ".join(f"{n} {traces['seconds'][n]:.0f}" for n in names),
             f"top-direction share of a random {args.width}x{args.width} Gaussian matrix: {share0:.3f}", ""]
    layers = range(args.layers)
    head = ("| step | arm | loss | max logit (per layer) | ||W_q - W_q^twin||_F | top share | "
            "||W_k - W_k^twin||_F | top share |")
    lines += [head, "|" + "---|" * 8]
    for i in picks:
        for name in names:
            tr = traces["arms"][name]
            ml = tr["max_logit"][i]
            row = f"| {steps[i]} | {name} | {tr['loss'][i]:.3f} | {' / '.join(f'{m:.1f}' for m in ml)} |"
            if name == "twin":
                row += " - | - | - | - |"
            else:
                for key in ("q", "k"):
                    row += (" " + " / ".join(f"{tr['drift_' + key][i][l]:.3g}" for l in layers) + " | "
                            + " / ".join(f"{tr['top_share_' + key][i][l]:.3f}" for l in layers) + " |")
            lines.append(row)
    half = len(steps) // 2
    lines += ["", "Over the run (per layer): drift from the twin at the last step, and the top-direction share "
                  "averaged over the second half of the logged steps",
              "| arm | ||dW_q|| last | ||dW_k|| last | share dW_q, 2nd half | share dW_k, 2nd half |",
              "|---|---|---|---|---|"]
    for name in drifting:
        tr = traces["arms"][name]
        cells = [" / ".join(f"{tr['drift_' + key][-1][l]:.4g}" for l in layers) for key in ("q", "k")]
        cells += [" / ".join(f"{_layer_mean([r[l] for r in tr['top_share_' + key][half:]]):.3f}" for l in layers)
                  for key in ("q", "k")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for a, b in PAIRS:
        if f"{a}_vs_{b}_q" in traces:
            lines.append(f"| {a} vs {b} (not the twin) | "
                         + " | ".join(" / ".join(f"{traces[f'{a}_vs_{b}_{key}'][-1][l]:.4g}" for l in layers)
                                      for key in ("q", "k")) + " | - | - |")
    lines += ["", "Signed error of O against float64 on the same bf16 inputs, bf16 roundings: mean (t), per layer, "
                  "mean over all logged steps; rows with >= 2 P-bar = 1.0 (share), rule-fired blocks per row; share of "
                  "O's elements that differ from the op's PyTorch path on the same inputs (emulated arms; not "
                  "recorded by runs before this column)",
              "| arm | " + " | ".join(f"O error layer {l}" for l in layers) + " | rows with two P-bar ones "
              "| fired blocks per row | O elements unlike the PyTorch path's |", "|" + "---|" * (args.layers + 4)]
    for name in names:
        tr = traces["arms"][name]
        logged = [e for e in tr["o_error"] if e is not None]
        cells = []
        for l in layers:
            means = [e[l]["mean"] for e in logged]
            ts = [e[l]["t"] for e in logged]
            cells.append(f"{sum(means) / len(means):+.4f} (mean t {sum(ts) / len(ts):+.2f}, "
                         f"|t| >= 3 in {sum(abs(t) >= 3 for t in ts)}/{len(ts)})")
        pb = [p for p in tr["pbar"] if p]
        if pb:
            two = sum(sum(d["rows_two_pbar_ones"] for d in p) / len(p) for p in pb) / len(pb)
            fired = sum(sum(d["fired_blocks_per_row"] for d in p) / len(p) for p in pb) / len(pb)
            extra = f"{two:.4f} | {fired:.4f}"
            diff = [d.get("o_differs_from_cpu_path") for p in pb for d in p]
            if all(x is not None for x in diff):
                extra += f" | {sum(diff) / len(diff):.2e}"
        else:
            extra = "- (not recorded on this path) | - | -"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {extra} |")
    final = {n: mean_last(traces["arms"][n]["loss"]) for n in names}
    lines += ["", "loss, mean of the last 10% of logged steps: " + ", ".join(f"{n} {v:.4f}" for n, v in final.items()),
              f"Machine: {cpu_model()}, {os.cpu_count()} cores visible, {torch.get_num_threads()} torch thread(s), "
              f"Python {platform.python_version()}, torch {torch.__version__}"]
    return "\n".join(lines)


def merge(base: dict, other: dict) -> dict:
    """``other``'s arms added to ``base`` (a control run of the same configuration): the twins must agree bit for
    bit (same seed, data and arithmetic), else the drifts would not share a reference."""
    if base["args"]["steps"] != other["args"]["steps"] or base["steps"] != other["steps"]:
        raise ValueError("--from-json: the runs have different steps; merge only runs of one configuration")
    for key in ("lr", "warmup", "width", "heads", "layers", "seq", "batch", "seed", "log_every"):
        if base["args"][key] != other["args"][key]:
            raise ValueError(f"--from-json: {key} differs ({base['args'][key]} vs {other['args'][key]})")
    if base["arms"]["twin"]["loss_every_step"] != other["arms"]["twin"]["loss_every_step"]:
        raise ValueError("--from-json: the twins' losses differ: the runs do not share a reference")
    for name, tr in other["arms"].items():
        if name != "twin":
            base["arms"][name] = tr
            base["seconds"][name] = other["seconds"][name]
    for key, value in other.items():
        if "_vs_" in key:
            base[key] = value
    return base


def _smooth(values: list[float], window: int = 50) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def plot(traces: dict, args: argparse.Namespace, share0: float, path: Path) -> None:
    """Drift from the twin (W_q solid, W_k dashed; per layer), its top-direction share, max logit, loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = traces["steps"]
    colors = {"off": "tab:red", "ours": "tab:blue", "off_cpu": "tab:orange", "ours_cpu": "tab:cyan", "twin": "tab:gray"}
    names = list(traces["arms"])
    widths = [1.4, 0.7]  # layer 0, layer 1, ...
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for name in (n for n in names if n != "twin"):
        tr = traces["arms"][name]
        for l in range(args.layers):
            lw = widths[min(l, len(widths) - 1)]
            for key, ls in (("q", "-"), ("k", "--")):
                axes[0, 0].plot(steps[1:], [row[l] for row in tr["drift_" + key][1:]], color=colors[name], ls=ls,
                                lw=lw, label=f"{name}: W_{key} layer {l}")
                axes[0, 1].plot(steps[1:], [row[l] for row in tr["top_share_" + key][1:]], color=colors[name],
                                ls=ls, lw=lw)
    if "ours_vs_off_q" in traces:
        axes[0, 0].plot(steps[1:], [sum(r) / len(r) for r in traces["ours_vs_off_q"][1:]], color="k", lw=0.8,
                        ls=":", label="||W_q ours - W_q off|| (layer mean)")
    axes[0, 1].axhline(share0, color="k", lw=0.8, ls=":", label=f"random {args.width}x{args.width} matrix")
    axes[0, 0].set_yscale("log")
    axes[0, 0].set_ylabel("||W - W_twin||_F")
    axes[0, 0].legend(fontsize=7, ncol=2)
    axes[0, 1].set_ylabel("sigma_1^2 / sum sigma^2 of W - W_twin")
    axes[0, 1].legend(fontsize=8)
    for name in names:
        tr = traces["arms"][name]
        idx = [i for i, m in enumerate(tr["max_logit"]) if m]
        axes[1, 0].plot([steps[i] for i in idx], [max(tr["max_logit"][i]) for i in idx], color=colors[name], lw=1.0,
                        label=name)
        every = tr.get("loss_every_step") or []
        axes[1, 1].plot(range(1, len(every) + 1), _smooth(every), color=colors[name], lw=0.8, label=name)
    axes[1, 0].set_ylabel("max attention logit (max over layers)")
    axes[1, 0].legend(fontsize=8)
    axes[1, 1].set_ylabel("training loss (nats/byte, 50-step mean)")
    axes[1, 1].legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(f"Tiny GPT, P-bar V on emulated {args.arithmetic} tensor cores: fix off (red) vs ours (blue); "
                 "drift from the fp32 P-bar V twin")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arithmetic", default="h100", choices=("h100", "a100", "b200", "ieee"))
    ap.add_argument("--data", default="text", choices=("text", "sinks"),
                    help="text: windows of the text; sinks: every sequence starts with a fixed token")
    ap.add_argument("--paper-block", type=int, default=32, help="key block of the paper_bf16 arms (default 32)")
    ap.add_argument("--control", action="store_true",
                    help="the positive control: arms " + " ".join(CONTROL_ARMS) + " and the twin, --data sinks, "
                         "the summary table of every --seeds run")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="run these seeds one after the other (each its own --json/--checkpoint, suffixed _seedN)")
    ap.add_argument("--checkpoint", default=None, help="save every --checkpoint-every steps here; resume from it")
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "tensor_core_training.json"))
    ap.add_argument("--table", default=None, help="also write the table here")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "images" / "tensor_core_training.png"))
    ap.add_argument("--save-weights", default=None, help="torch.save the three arms' final state dicts here")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=tuple(ARM_KINDS),
                    help="the arms to train (the twin is always trained, last)")
    ap.add_argument("--agreement", default=None, metavar="WEIGHTS",
                    help="no training: with --save-weights' file of a run (same other arguments), the share of O "
                         "elements per layer where the emulated arms differ from the PyTorch path")
    ap.add_argument("--from-json", nargs="+", default=None,
                    help="no training: the table and plot of recorded --json files (later files' arms merged in)")
    args = ap.parse_args(argv)
    if args.control:
        args.arms = list(CONTROL_ARMS) if args.arms == list(ARMS) else args.arms
        args.data = "sinks"
    for name in ("steps", "log_every", "width", "heads", "layers", "seq", "batch", "warmup", "threads",
                 "paper_block", "checkpoint_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.width % args.heads:
        ap.error(f"--width={args.width} must be a multiple of --heads={args.heads}")
    return args


def spikes(losses: list[float], window: int = 10, rtol: float = 2.0) -> int:
    """Steps whose loss is non-finite or exceeds the mean of the previous ``window`` by ``rtol`` times that mean
    (Lightning's SpikeDetection rule)."""
    n = 0
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            n += 1
        elif i >= window:
            mean = sum(losses[i - window:i]) / window
            n += x - mean > rtol * mean
    return n


def _fmt(values: list, spec: str = ".3g") -> str:
    return " / ".join("-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
                      for v in values)


def control_table(runs: dict[int, dict], args: argparse.Namespace, share0: float) -> str:
    """The positive control over seeds: per arm at fixed step intervals (means over seeds, per layer), then per
    seed the loss at the end, spikes and the first non-finite step."""
    seeds = sorted(runs)
    first = runs[seeds[0]]
    names = list(first["arms"])
    steps = first["steps"]
    every = max(1, (len(steps) - 1) // 6)
    picks = sorted({*range(every, len(steps), every), len(steps) - 1} - {0})
    lines = [f"Positive control: tiny GPT, {args.layers} layers, width {args.width}, {args.heads} heads, "
             f"seq {args.seq} (data: {args.data}), batch {args.batch}, lr {args.lr:g}, warm-up {args.warmup}, "
             f"seeds {seeds}; paper_bf16 key block {args.paper_block}, fused key block {BLOCK_N}. Arms: "
             + ", ".join(f"{n} ({ARM_KINDS[n][0]}, fix {ARM_KINDS[n][1]})" for n in names)
             + "; paper_bf16 = the paper's all-BF16 flash attention forward and backward (model b), cpu = the fused "
             "op's PyTorch path (model a), twin = fp32 P-bar V",
             "wall seconds per arm (seed " + str(seeds[0]) + "): "
             + ", ".join(f"{n} {first['seconds'][n]:.0f}" for n in names),
             f"top-direction share of a random {args.width}x{args.width} Gaussian matrix: {share0:.3f}",
             "tie rate: share of (row, key block) pairs with >= 2 P-bar = 1.0 against the plain running max (bf16 "
             "scores for paper_bf16, fp32 for the others); fired: share where the arm's rule shifted the offset", "",
             "| step | arm | loss | max logit | tie rate | fired | ||W_q - W_q^twin|| | top share q | "
             "||W_k - W_k^twin|| | top share k |", "|" + "---|" * 10]
    layers = range(args.layers)

    def seed_mean(i: int, name: str, key: str, sub: str | None = None) -> list:
        """Per layer, the mean over the seeds that logged step index ``i`` of ``arms[name][key][i][layer]``."""
        out = []
        for l in layers:
            vals = []
            for sd in seeds:
                run = runs[sd]
                row = run["arms"][name][key][i] if i < len(run["steps"]) else None
                if row:
                    vals.append(row[l][sub] if sub else row[l])
            out.append(sum(vals) / len(vals) if vals else None)
        return out

    for i in picks:
        for name in names:
            losses = [runs[sd]["arms"][name]["loss"][i] for sd in seeds if i < len(runs[sd]["steps"])]
            row = (f"| {steps[i]} | {name} | {_fmt(losses, '.3f')} | {_fmt(seed_mean(i, name, 'max_logit'), '.1f')} "
                   f"| {_fmt(seed_mean(i, name, 'ties', 'tie_rate'), '.3f')} "
                   f"| {_fmt(seed_mean(i, name, 'ties', 'fired_rate'), '.3f')} |")
            if name == "twin":
                row += " - | - | - | - |"
            else:
                for key in ("q", "k"):
                    row += (f" {_fmt(seed_mean(i, name, 'drift_' + key), '.3g')} "
                            f"| {_fmt(seed_mean(i, name, 'top_share_' + key), '.3f')} |")
            lines.append(row)
    lines += ["", "| arm | seed | steps run | loss, last 10% of logged steps | spikes (Lightning's rule) | "
                  "first non-finite step |", "|---|---|---|---|---|---|"]
    for name in names:
        for sd in seeds:
            every_step = runs[sd]["arms"][name]["loss_every_step"]
            bad = next((i + 1 for i, x in enumerate(every_step) if not math.isfinite(x)), None)
            lines.append(f"| {name} | {sd} | {len(every_step)} | {mean_last(runs[sd]['arms'][name]['loss']):.4f} | "
                         f"{spikes(every_step)} | {bad if bad is not None else '-'} |")
    lines += ["", f"Machine: {cpu_model()}, {os.cpu_count()} cores visible, {torch.get_num_threads()} torch thread(s), "
                  f"Python {platform.python_version()}, torch {torch.__version__}"]
    return "\n".join(lines)


def _suffixed(path: str | None, seed: int) -> str | None:
    if path is None:
        return None
    p = Path(path)
    return str(p.with_name(f"{p.stem}_seed{seed}{p.suffix}"))


def run_seeds(args: argparse.Namespace) -> dict[int, dict]:
    """``train`` once per ``--seeds`` seed, each with its own JSON and checkpoint."""
    runs = {}
    base_json, base_ckpt = args.json, args.checkpoint
    commit = git_commit()  # the code this run ran (a resumed run's earlier steps may have run at another)
    for seed in args.seeds:
        args.seed, args.json, args.checkpoint = seed, _suffixed(base_json, seed), _suffixed(base_ckpt, seed)
        json_path = Path(args.json)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        runs[seed] = train(args, lambda tr, p=json_path: p.write_text(json.dumps({"args": vars(args), "commit": commit,
                                                                                  **tr})))
        json_path.write_text(json.dumps({"args": vars(args), "commit": commit, **runs[seed]}))
        print(f"seed {seed}: {runs[seed]['steps'][-1]} steps, wrote {json_path}", flush=True)
    args.json, args.checkpoint = base_json, base_ckpt
    return runs


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    if args.control or args.seeds:
        if args.seeds is None:
            args.seeds = [args.seed]
        if args.from_json:
            runs = {}
            for path in args.from_json:
                rec = json.loads(Path(path).read_text())
                runs[rec["args"]["seed"]] = rec
            for key, value in rec["args"].items():
                if key not in ("from_json", "table", "plot", "json", "seed", "seeds"):
                    setattr(args, key, value)
        else:
            runs = run_seeds(args)
        text = control_table(runs, args, random_top_share(args.width))
        print(text)
        if args.table:
            Path(args.table).write_text(text + "\n")
        return 0
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)

    def save(traces: dict) -> None:
        json_path.write_text(json.dumps({"args": vars(args), **traces}))

    if args.agreement:
        for name, shares in agreement(args, args.agreement).items():
            print(f"{name}: O elements differing from the PyTorch path, per layer: "
                  + " / ".join(f"{x:.2e}" for x in shares))
        return 0
    if args.from_json:
        recorded = json.loads(Path(args.from_json[0]).read_text())
        for extra in args.from_json[1:]:
            recorded = merge(recorded, json.loads(Path(extra).read_text()))
        for key, value in recorded.pop("args").items():
            if key not in ("from_json", "table", "plot", "json"):
                setattr(args, key, value)
        traces = recorded
    else:
        traces = train(args, save)
    share0 = random_top_share(args.width)
    text = table(traces, args, share0)
    print(text)
    if args.table:
        Path(args.table).write_text(text + "\n")
    try:
        plot(traces, args, share0, Path(args.plot))
        print(f"plot: {args.plot}")
    except ImportError:
        print("matplotlib not installed: no plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
