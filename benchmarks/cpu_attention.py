"""CPU benchmark: stable_attn's PyTorch path against F.scaled_dot_product_attention, side by side.

    python benchmarks/cpu_attention.py [--repeats 5] [--n 512 2048] [--json out.json]

Measures forward, backward and forward+backward wall time (median of ``--repeats`` after one
warm-up) and the peak extra memory (tracemalloc is blind to torch's allocator, so peak RSS growth is
measured in a fresh subprocess per cell) at B=4, H=8, D=64, bf16, causal. Prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import stable_attn


def _fn(impl: str):
    if impl == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if impl == "stable_attn":
        return lambda q, k, v: stable_attn.attention(q, k, v, causal=True, backend="torch")
    if impl == "stable_attn(off)":
        return lambda q, k, v: stable_attn.attention(q, k, v, causal=True, backend="torch", stabilize=False)
    raise ValueError(impl)


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(4, 8, n, 64, generator=g).to(torch.bfloat16) for _ in range(4))
    return q, k, v, do


def time_cell(impl: str, n: int, repeats: int) -> dict[str, float]:
    fn = _fn(impl)
    q, k, v, do = _inputs(n)
    fwd, bwd, both = [], [], []
    for i in range(repeats + 1):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        t0 = time.perf_counter()
        with torch.no_grad():
            fn(qq, kk, vv)
        t1 = time.perf_counter()
        out = fn(qq, kk, vv)
        t2 = time.perf_counter()
        out.backward(do)
        t3 = time.perf_counter()
        if i:  # the first round is the warm-up
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
            both.append(t3 - t1)
    return {"fwd_ms": 1e3 * statistics.median(fwd), "bwd_ms": 1e3 * statistics.median(bwd),
            "fwd_bwd_ms": 1e3 * statistics.median(both)}


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def peak_memory_child(impl: str, n: int) -> None:
    """Run in a fresh process: peak RSS growth of one fwd+bwd over the inputs already allocated."""
    q, k, v, do = _inputs(n)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    fn = _fn(impl)
    # warm the allocator and libraries on a tiny problem so their one-time costs are not counted
    small = [t[:, :, :16].clone().requires_grad_() for t in (q, k, v)]
    fn(*small).sum().backward()
    base = _rss_kib()
    out = fn(qq, kk, vv)
    out.backward(do)
    print(json.dumps({"peak_extra_mib": (_rss_kib() - base) / 1024}))


def peak_memory(impl: str, n: int) -> float:
    cmd = [sys.executable, __file__, "--child-memory", impl, str(n)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_extra_mib"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--impls", nargs="+", default=["sdpa", "stable_attn", "stable_attn(off)"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--child-memory", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_memory:
        peak_memory_child(args.child_memory[0], int(args.child_memory[1]))
        return 0

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, B=4 H=8 D=64 bf16 causal")
    rows = []
    for n in args.n:
        for impl in args.impls:
            cell = {"impl": impl, "N": n, **time_cell(impl, n, args.repeats), "peak_extra_mib": peak_memory(impl, n)}
            rows.append(cell)
    header = f"{'N':>6} {'impl':<18} {'fwd ms':>9} {'bwd ms':>9} {'fwd+bwd ms':>11} {'peak MiB':>9} {'x sdpa':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        base = next(x for x in rows if x["N"] == r["N"] and x["impl"] == "sdpa")
        ratio = r["fwd_bwd_ms"] / base["fwd_bwd_ms"]
        r["time_vs_sdpa"] = ratio
        r["memory_vs_sdpa"] = r["peak_extra_mib"] / max(base["peak_extra_mib"], 1e-9)
        print(f"{r['N']:>6} {r['impl']:<18} {r['fwd_ms']:>9.1f} {r['bwd_ms']:>9.1f} {r['fwd_bwd_ms']:>11.1f} "
              f"{r['peak_extra_mib']:>9.1f} {ratio:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
