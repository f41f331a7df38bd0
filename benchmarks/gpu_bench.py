"""Speed of stable_attn's Triton kernels against PyTorch SDPA's flash backend, on one CUDA GPU.

Causal bf16 attention with 16k tokens per batch (B = 16384 // N), H * D = 2048, N in {1k, 4k, 16k},
D in {64, 128}. For each shape: SDPA-flash, stable_attn with stabilize=False (plain FA2 in our
kernel), stabilize=True, and stabilize=True with statistics on; forward, backward and forward +
backward, each the median of ``triton.testing.do_bench`` (warm-up excluded). Prints a table and
writes JSON. Targets (issue 3): fwd+bwd >= 0.9x SDPA-flash, stabilize=True <= 3% over False,
stats <= 2% more.

    python benchmarks/gpu_bench.py --json /tmp/gpu_bench.json

Works with torch >= 2.4 / triton >= 3.0 (uses only do_bench(fn, warmup, rep, grad_to_none,
return_mode) and torch.nn.attention.sdpa_kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import stable_attn  # noqa: E402

TOKENS = 16384
WIDTH = 2048


def impls():
    """name -> callable(q, k, v) returning the attention output."""

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def ours(stabilize, with_stats):
        stats = stable_attn.AttentionStats() if with_stats else None

        def run(q, k, v):
            return stable_attn.attention(q, k, v, causal=True, stabilize=stabilize, stats=stats, backend="triton")

        return run

    return {
        "sdpa_flash": sdpa,
        "stable_off": ours(False, False),
        "stable_exact": ours(True, False),
        "stable_exact_stats": ours(True, True),
    }


def bench_one(fn, q, k, v, do, warmup, rep):
    def fwd():
        return fn(q, k, v)

    out = fwd()
    t_fwd = do_bench(fwd, warmup=warmup, rep=rep, return_mode="median")
    t_bwd = do_bench(lambda: out.backward(do, retain_graph=True), warmup=warmup, rep=rep,
                     grad_to_none=[q, k, v], return_mode="median")
    t_all = do_bench(lambda: fwd().backward(do), warmup=warmup, rep=rep, grad_to_none=[q, k, v],
                     return_mode="median")
    return t_fwd, t_bwd, t_all


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--warmup", type=int, default=25, help="ms of warm-up per measurement")
    p.add_argument("--rep", type=int, default=100, help="ms of repetitions per measurement")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "gpu_bench.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py needs a CUDA GPU; on a CPU machine use benchmarks/kernel_resources.py")

    machine = (f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
               f"python {platform.python_version()}")
    print(machine)
    rows = []
    torch.manual_seed(0)
    for d in args.d:
        for n in args.n:
            b, h = TOKENS // n, WIDTH // d
            q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()
            flops_fwd = 4 * b * h * n * n * d / 2  # causal: half the score matrix
            ref = None
            for name, fn in impls().items():
                with torch.no_grad():
                    o = fn(q, k, v).float()
                if ref is None:
                    ref = o
                max_diff = (o - ref).abs().max().item()
                t_fwd, t_bwd, t_all = bench_one(fn, q, k, v, do, args.warmup, args.rep)
                rows.append(dict(impl=name, n=n, d=d, b=b, h=h, fwd_ms=t_fwd, bwd_ms=t_bwd, fwd_bwd_ms=t_all,
                                 fwd_tflops=flops_fwd / t_fwd * 1e-9, fwd_bwd_tflops=3.5 * flops_fwd / t_all * 1e-9,
                                 max_abs_diff_vs_sdpa=max_diff))
                r = rows[-1]
                print(f"{name:>19} N={n:>5} D={d:>3} B={b:>2} H={h:>2}  fwd {t_fwd:7.3f} ms  bwd {t_bwd:7.3f} ms  "
                      f"fwd+bwd {t_all:7.3f} ms  ({r['fwd_bwd_tflops']:.0f} TFLOP/s)  |diff| {max_diff:.2e}",
                      flush=True)
            del q, k, v, do
            torch.cuda.empty_cache()

    print("\n| N | D | sdpa fwd+bwd ms | off | exact | exact+stats | exact/sdpa | exact/off | stats/exact |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by = {(r["impl"], r["n"], r["d"]): r["fwd_bwd_ms"] for r in rows}
    for d in args.d:
        for n in args.n:
            s, off, ex, st = (by[(i, n, d)] for i in ("sdpa_flash", "stable_off", "stable_exact",
                                                      "stable_exact_stats"))
            print(f"| {n} | {d} | {s:.3f} | {off:.3f} | {ex:.3f} | {st:.3f} | {s / ex:.2f}x speed | "
                  f"{100 * (ex / off - 1):+.1f}% | {100 * (st / ex - 1):+.1f}% |")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": machine, "command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
