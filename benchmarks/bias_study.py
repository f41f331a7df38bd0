"""Controlled study: is the rounding error of ``O = softmax(s) V`` biased, and does the fix remove it?

Inputs (one query row per trial, ``N`` keys, head dim ``D``; scores are the scaled softmax input):

- ``tied-k{1,2,4,8}``: the paper's trigger. ``k`` keys (the first ones, like an attention sink) tie
  exactly at the row max ``m ~ U(-4, 4)``; every other key sits ``3 + Exp(mean 2)`` below it; values
  mostly negative, ``v ~ N(-2, 1)`` (2.3% positive). ``k = 1`` is the no-tie control.
- ``tied-k4-m0``: as ``tied-k4`` with ``m = 0`` exactly, the case the published rule leaves alone.
- ``tied-k4-sym``: as ``tied-k4`` with symmetric values ``v ~ N(0, 1)``.
- ``random``: control, scores ``N(0, 2^2)``, values ``N(0, 1)``, no planted ties.

Each input runs through the arithmetic models of :mod:`stable_attn.numerics.arithmetic` with the fix
off, ours and the paper's, on the same trials (paired), plus the exact answer rounded once to bf16
(the best any bf16 output can do), and a variant a' whose row sum is taken over the bf16-rounded
``P-bar`` for every fix, in one key block (arithmetic.rounded_rowsum_model; our kernel's
``stabilize=True`` does the same blockwise, so a' with fix "ours" cross-checks model (a) with fix
"ours"), and (d): our kernel's forward with ``P-bar V`` as A100 or H100 tensor cores compute it
(arithmetic.tensor_core_model on the bit-level models of stable_attn.numerics.tensor_core; run on the
CPU on every device). Errors are against the float64 oracle, in units of
``2^-8 * rms(O_row)`` (one bf16 rounding at the row's scale); ``t`` is the t-statistic of the mean
over trials; ``|t| >= 3`` counts as biased.

    python benchmarks/bias_study.py                   # CPU, 1 thread, 1000 trials a cell
    python benchmarks/bias_study.py --device cuda     # GPU: Triton kernel and bf16 tensor-core matmuls
    python benchmarks/bias_study.py --pbar e4m3       # FP8: P-bar and V in E4M3 for the product

``--pbar e4m3`` is the FP8 study: model (d) with ``P-bar`` rounded to E4M3 for the
product and ``V`` in E4M3 (as FP8 attention kernels take them), on the H100 model's fp8 path
(``e_fp8_h100``: 32 products a fused block, 13 fraction bits, truncation) and, to separate the two,
with exact products and fp32 round-to-nearest-even in order (``e_fp8_ieee``); ``O`` stays bf16. Our
rule's trigger is E4M3's (arithmetic.rule_constants). Errors are against the oracle on the E4M3
values, so only ``P-bar``'s rounding and the accumulation count.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time

import torch

from stable_attn.kernels import naive
from stable_attn.numerics import arithmetic
from stable_attn.numerics.bias import ErrorStats, error_stats, row_unit

INPUTS = ("tied-k1", "tied-k2", "tied-k4", "tied-k8", "tied-k4-m0", "tied-k4-sym", "random")

# The asymmetric-value study (``--study asym``): value distributions of the tied keys and of the others,
# (mean of tied V, mean of other V); every element has standard deviation ASYM_SD around its mean.
VALUE_DISTS = {"same": (-2.0, -2.0), "tied-closer": (-1.0, -3.0), "tied-farther": (-3.0, -1.0), "sink": (0.0, -3.0)}
ASYM_SD = 0.5
ASYM_KS = (1, 2, 4, 8)
ASYM_BLOCKS = (64, 128)
# other keys sit ASYM_GAP + Exp(mean 2) below the tied max: non-tied mass eps = (N - k) e^-gap / 3, about
# 5e-4 at N = 256 and gap 12, so the tied keys' midpoint is decided by eps's sticky term (the regime of
# O ~ mean V_tied + (eps/k)(mean V_other - mean V_tied)); today's inputs (gap 3) have eps ~ 4
ASYM_GAP = 12.0


def make_inputs(kind: str, trials: int, n: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``[T, N]`` (float32 holding bf16 values) and values ``[T, N, D]`` bf16 for ``kind``."""
    bf16 = torch.bfloat16
    if kind == "random":
        scores = (2.0 * torch.randn(trials, n, generator=gen)).to(bf16).float()
        values = torch.randn(trials, n, d, generator=gen).to(bf16)
        return scores, values
    parts = kind.split("-")
    k = int(parts[1][1:])
    if kind.endswith("-m0"):
        m = torch.zeros(trials, 1)
    else:
        m = (8.0 * torch.rand(trials, 1, generator=gen) - 4.0).to(bf16).float()
    gap = 3.0 + 2.0 * torch.empty(trials, n).exponential_(generator=gen)
    scores = (m - gap).to(bf16).float()
    scores[:, :k] = m  # exact ties at the row max
    mean = 0.0 if kind.endswith("-sym") else -2.0
    values = (mean + torch.randn(trials, n, d, generator=gen)).to(bf16)
    return scores, values


def make_asym_inputs(dist: str, k: int, trials: int, n: int, d: int, gen: torch.Generator,
                     gap: float = ASYM_GAP) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``[T, N]`` and bf16 values ``[T, N, D]``: ``k`` keys tie at the max ``m ~ U(-4, 4)``, the others
    ``gap + Exp(mean 2)`` below; tied and other values drawn from :data:`VALUE_DISTS` ``[dist]``."""
    if dist not in VALUE_DISTS:
        raise ValueError(f"dist={dist!r}; accepted values: {tuple(VALUE_DISTS)}")
    if not 1 <= k < n:
        raise ValueError(f"k={k} tied keys must be in [1, n) with n={n}")
    bf16 = torch.bfloat16
    m = (8.0 * torch.rand(trials, 1, generator=gen) - 4.0).to(bf16).float()
    drop = gap + 2.0 * torch.empty(trials, n).exponential_(generator=gen)
    scores = (m - drop).to(bf16).float()
    scores[:, :k] = m
    tied_mean, other_mean = VALUE_DISTS[dist]
    means = torch.full((1, n, 1), other_mean)
    means[:, :k] = tied_mean
    values = (means + ASYM_SD * torch.randn(trials, n, d, generator=gen)).to(bf16)
    return scores, values


def _tc_model(s: torch.Tensor, v: torch.Tensor, fix: str, *, block: int, model: str) -> arithmetic.ModelOutput:
    return arithmetic.tensor_core_model(s, v, fix, block_n=block, model=model)


def asym_models(block: int, tc_models: tuple[str, ...]) -> dict[str, object]:
    """The asymmetric study's models on ``block``-key blocks: (a) fused IEEE, (b) all-bf16, (d) tensor cores."""
    out = {
        "a_kernel": lambda s, v, fix: arithmetic.kernel_model(s, v, fix, block_n=block, backend="torch"),
        "b_blockwise_bf16": lambda s, v, fix: arithmetic.blockwise_bf16_model(s, v, fix, block_n=block),
    }
    for tc in tc_models:
        out[f"d_tensor_core_{tc}"] = functools.partial(_tc_model, block=block, model=tc)
    return out


def predicted_sign(model: str, dist: str, k: int, fix: str) -> int:
    """The sign of the mean error the midpoint analysis predicts (0: no systematic direction).

    Fused (a, d): O = acc / l is rounded once; with k >= 2 tied keys mean V_tied sits on a bf16 midpoint
    in part of the rows and the sticky term delta = (eps/k)(mean V_other - mean V_tied) decides it: sign(delta).
    k = 1: O rounds back to V_1 and loses delta: -sign(delta). The rule does not change acc / l (ours keeps the
    consistent row sum), so it keeps the sign; the paper's rule with FlashAttention-2's unrounded row sum scales
    O by rounded/unrounded P-bar (up to 2^-9, random), which blurs the midpoint (a weaker bias, same sign).
    (b) all-bf16: O-bar = sum V_tied + eps V_other is rounded to bf16 before the division: the sticky term has
    the sign of V_other (the paper's "sign of V"); k = 1 rounds back to V_1: -sign(delta). Any fix makes
    P-bar < 1 for the tied keys, so O-bar is no longer on a midpoint: no tie term (0).
    """
    tied_mean, other_mean = VALUE_DISTS[dist]
    sign_delta = (other_mean > tied_mean) - (other_mean < tied_mean)
    if model.startswith("b_"):
        if k == 1 or fix != "off":
            return -sign_delta if k == 1 else 0
        return (other_mean > 0) - (other_mean < 0)
    return -sign_delta if k == 1 else sign_delta


# (d) the kernel's forward with P-bar V on bit-level tensor-core models (run on the CPU on every device)
TC_MODELS = {
    "d_tensor_core_a100": lambda s, v, fix: arithmetic.tensor_core_model(s, v, fix, model="a100"),
    "d_tensor_core_h100": lambda s, v, fix: arithmetic.tensor_core_model(s, v, fix, model="h100"),
}


# (e) FP8: P-bar and V in E4M3 for the product, on the H100 model's fp8 path and on exact fp32 arithmetic
FP8_MODELS = {
    "e_fp8_h100": lambda s, v, fix: arithmetic.tensor_core_model(s, v, fix, model="h100",
                                                                 pbar_dtype=torch.float8_e4m3fn),
    "e_fp8_ieee": lambda s, v, fix: arithmetic.tensor_core_model(s, v, fix, model="ieee",
                                                                 pbar_dtype=torch.float8_e4m3fn),
    "e_fp8_b200": lambda s, v, fix: arithmetic.tensor_core_model(s, v, fix, model="b200",
                                                                 pbar_dtype=torch.float8_e4m3fn),
}


def models_for(device: str, pbar: str = "bf16") -> dict[str, object]:
    """Model name -> ``f(scores, values, fix) -> ModelOutput`` for the device (``pbar="e4m3"``: the FP8 study)."""
    if pbar == "e4m3":
        return dict(FP8_MODELS)
    if device == "cpu":
        return {
            "a_kernel": lambda s, v, fix: arithmetic.kernel_model(s, v, fix, backend="torch"),
            "b_blockwise_bf16": lambda s, v, fix: arithmetic.blockwise_bf16_model(s, v, fix),
            "c_sequential_bf16": arithmetic.sequential_bf16_model,
            "a'_rounded_rowsum": arithmetic.rounded_rowsum_model,
            **TC_MODELS,
        }
    # on a GPU: our Triton kernel (bf16 tl.dot on tensor cores), the PyTorch path for comparison,
    # and the published arithmetic with the device's own bf16 matmul (cuBLAS, tensor cores)
    return {
        "a_kernel_triton": lambda s, v, fix: arithmetic.kernel_model(s, v, fix, backend="triton"),
        "a_kernel_torch": lambda s, v, fix: arithmetic.kernel_model(s, v, fix, backend="torch"),
        "b_blockwise_bf16_native": lambda s, v, fix: arithmetic.blockwise_bf16_model(s, v, fix, native_matmul=True),
        "c_sequential_bf16": arithmetic.sequential_bf16_model,
        **TC_MODELS,
    }


def verdict(off: ErrorStats, on: ErrorStats) -> str:
    if not off.biased:
        return "no bias to remove"
    return "removed" if not on.biased else "NOT removed"


def machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    return f"CPU ({cpu}), {os.cpu_count()} cores visible, {threads} thread(s), torch {torch.__version__}"


def run_asym(args: argparse.Namespace) -> dict:
    """The asymmetric-value study: every (values, k, block) cell in every model and fix, with its prediction."""
    dists = [x for x in args.dists.split(",") if x]
    ks = [int(x) for x in args.ks.split(",") if x]
    blocks = [int(x) for x in args.blocks.split(",") if x]
    tcs = tuple(x for x in args.tc_models.split(",") if x)
    cells = []
    header = (f"{'values':<13} {'k':>2} {'blk':>4} {'model':<22} {'fix':<6} {'mean':>8} {'t':>8} {'rms':>7} "
              f"{'pred':>5} held")
    print(f"asymmetric-value bias study: {args.trials} trials/cell, N={args.keys}, D={args.head_dim}, gap "
          f"{args.gap:g} + Exp(2), value sd {ASYM_SD}; values (tied mean, other mean): "
          + ", ".join(f"{d} {VALUE_DISTS[d]}" for d in dists))
    print("errors vs float64 oracle in units of 2^-8 * rms(O_row); t = mean / s.e.; biased = |t| >= 3; "
          "pred = predicted sign (0: none); held = the sign of a biased mean, or no bias, as predicted")
    print(header)
    print("-" * len(header))
    for di, dist in enumerate(dists):
        for k in ks:
            gen = torch.Generator().manual_seed(args.seed * 1000 + 10 * di + k)
            scores, values = make_asym_inputs(dist, k, args.trials, args.keys, args.head_dim, gen, args.gap)
            exact = arithmetic.oracle(scores, values)
            unit = row_unit(exact)
            eps = (naive.probabilities(scores)[:, k:].sum(-1) / naive.probabilities(scores)[:, :k].sum(-1) * k)
            base = error_stats(exact.to(torch.bfloat16).double(), exact, unit)
            cells.append({"values": dist, "k": k, "block": None, "model": "exact_rounded_bf16", "fix": "-",
                          "eps_median": float(eps.median()), **base.as_dict()})
            for block in blocks:
                for name, fn in asym_models(block, tcs).items():
                    for fix in arithmetic.FIXES:
                        res = fn(scores, values, fix)
                        st = error_stats(res.out.cpu(), exact, unit)
                        pred = predicted_sign(name, dist, k, fix)
                        got = 0 if not st.biased else (1 if st.mean > 0 else -1)
                        cells.append({"values": dist, "k": k, "block": block, "model": name, "fix": fix,
                                      **st.as_dict(), "fired_per_row": res.fired_rate, "predicted_sign": pred,
                                      "observed_sign": got, "held": got == pred})
                        print(f"{dist:<13} {k:>2} {block:>4} {name:<22} {fix:<6} {st.mean:8.4f} {st.t:8.2f} "
                              f"{st.rms:7.3f} {pred:>5} {'yes' if got == pred else 'NO'}", flush=True)
    return {"cells": cells, "config": {"study": "asym", "values": {d: VALUE_DISTS[d] for d in dists},
                                        "value_sd": ASYM_SD, "ks": ks, "blocks": blocks, "gap": args.gap,
                                        "tc_models": list(tcs)}}


def git_commit() -> str | None:
    """The commit the study ran at (with ``+dirty`` when the work tree differs), or None outside git."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=1000, help="independent rows per cell (default 1000)")
    ap.add_argument("--keys", type=int, default=256,
                    help="keys per row N (default 256: 2 blocks of the 128-key partition)")
    ap.add_argument("--head-dim", type=int, default=64, help="value dimension D (default 64)")
    ap.add_argument("--inputs", default=",".join(INPUTS), help=f"comma-separated subset of {','.join(INPUTS)}")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pbar", default="bf16", choices=("bf16", "e4m3"),
                    help="dtype P-bar (for e4m3 also V) is cast to for the product (default bf16; e4m3: FP8)")
    ap.add_argument("--json", default="bias_study.json", help="where to write the results (default bias_study.json)")
    ap.add_argument("--study", default="inputs", choices=("inputs", "asym"),
                    help="inputs: the --inputs kinds (default); asym: the asymmetric-value study")
    ap.add_argument("--dists", default=",".join(VALUE_DISTS), help="asym: value distributions (comma-separated)")
    ap.add_argument("--ks", default=",".join(map(str, ASYM_KS)), help="asym: numbers of tied maxima")
    ap.add_argument("--blocks", default=",".join(map(str, ASYM_BLOCKS)), help="asym: key-block sizes")
    ap.add_argument("--gap", type=float, default=ASYM_GAP, help="asym: other keys sit gap + Exp(2) below the max")
    ap.add_argument("--tc-models", default="a100,h100", help="asym: tensor-core models of (d) (a100, h100, b200)")
    args = ap.parse_args(argv)
    if args.study == "asym":
        torch.set_num_threads(args.threads)
        commit = git_commit()  # before the run: the code it ran
        t0 = time.perf_counter()
        res = run_asym(args)
        elapsed = time.perf_counter() - t0
        held = [c["held"] for c in res["cells"] if "held" in c]
        print(f"\nprediction held in {sum(held)}/{len(held)} cells; {elapsed:.1f} s on {machine('cpu')}")
        res.update({"command": " ".join(["python", "benchmarks/bias_study.py",
                                         *(argv if argv is not None else sys.argv[1:])]),
                    "commit": commit, "machine": machine("cpu"), "seconds": elapsed})
        res["config"].update({"trials": args.trials, "keys": args.keys, "head_dim": args.head_dim, "seed": args.seed,
                              "threads": args.threads, "unit": "2^-8 * rms(O_row)", "bias_t": 3.0})
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")
        return 0
    inputs = [x for x in args.inputs.split(",") if x]
    for x in inputs:
        if x not in INPUTS:
            ap.error(f"--inputs: {x!r} is not one of {INPUTS}")
    if args.trials < 2 or args.keys < 8 or args.head_dim < 1:
        ap.error(f"need --trials >= 2, --keys >= 8, --head-dim >= 1; got {args.trials}, {args.keys}, {args.head_dim}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    torch.set_num_threads(args.threads)
    commit = git_commit()
    models = models_for(args.device, args.pbar)
    t_start = time.perf_counter()
    cells, verdicts = [], []
    header = (f"{'input':<12} {'model':<24} {'fix':<6} {'mean':>8} {'t':>8} {'rms':>7} {'max':>7} "
              f"{'P=1 rows':>8} {'fired':>6} biased")
    print(f"bias study: {args.trials} trials/cell, N={args.keys}, D={args.head_dim}, device={args.device}, "
          f"P-bar {args.pbar}")
    print("errors vs float64 oracle in units of 2^-8 * rms(O_row); t = mean / s.e.; biased = |t| >= 3")
    print(header)
    print("-" * len(header))
    for i, kind in enumerate(inputs):
        gen = torch.Generator().manual_seed(args.seed * 1000 + i)
        scores, values = make_inputs(kind, args.trials, args.keys, args.head_dim, gen)
        if args.pbar == "e4m3":  # the FP8 study's V: the E4M3 values, which the oracle sees too
            values = arithmetic.fp8_values(values)
        exact = arithmetic.oracle(scores, values)
        unit = row_unit(exact)
        base = error_stats(exact.to(torch.bfloat16).double(), exact, unit)
        cells.append({"input": kind, "model": "exact_rounded_bf16", "fix": "-", **base.as_dict()})
        print(f"{kind:<12} {'exact_rounded_bf16':<24} {'-':<6} {base.mean:8.4f} {base.t:8.2f} {base.rms:7.3f} "
              f"{base.max_abs:7.2f} {'':>8} {'':>6} {'yes' if base.biased else 'no'}")
        s_dev, v_dev = scores.to(args.device), values.to(args.device)
        for name, fn in models.items():
            by_fix = {}
            for fix in arithmetic.FIXES:
                res = fn(s_dev, v_dev, fix)
                st = error_stats(res.out.cpu(), exact, unit)
                by_fix[fix] = st
                ones = None if res.pbar_ones is None else (res.pbar_ones >= 2).double().mean().item()
                cells.append({"input": kind, "model": name, "fix": fix, **st.as_dict(),
                              "rows_with_two_pbar_ones": ones, "fired_per_row": res.fired_rate})
                ones_s = "-" if ones is None else f"{100 * ones:7.1f}%"
                print(f"{kind:<12} {name:<24} {fix:<6} {st.mean:8.4f} {st.t:8.2f} {st.rms:7.3f} {st.max_abs:7.2f} "
                      f"{ones_s:>8} {res.fired_rate:6.2f} {'YES' if st.biased else 'no'}")
            for fix in ("ours", "paper"):
                verdicts.append({"input": kind, "model": name, "fix": fix,
                                 "verdict": verdict(by_fix["off"], by_fix[fix]),
                                 "t_off": by_fix["off"].t, "t_on": by_fix[fix].t})
    elapsed = time.perf_counter() - t_start
    print()
    print("does the fix remove the bias? (off biased and on not)")
    for v in verdicts:
        print(f"  {v['input']:<12} {v['model']:<24} {v['fix']:<6} t_off={v['t_off']:8.2f} t_on={v['t_on']:8.2f}  "
              f"{v['verdict']}")
    print(f"\n{len(cells)} cells in {elapsed:.1f} s on {machine(args.device)}")
    result = {
        "command": " ".join(["python", "benchmarks/bias_study.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": commit,
        "machine": machine(args.device),
        "config": {"trials": args.trials, "keys": args.keys, "head_dim": args.head_dim, "device": args.device,
                   "pbar": args.pbar,
                   "seed": args.seed, "threads": args.threads, "unit": "2^-8 * rms(O_row)", "bias_t": 3.0},
        "seconds": elapsed,
        "cells": cells,
        "verdicts": verdicts,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
