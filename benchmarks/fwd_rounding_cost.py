"""CPU cost of the single-rounding ``P-bar`` on the PyTorch path: the forward with ``reference.fma_f32`` against
the same forward with the two-rounding scores (``exp2(fl(fl(x * c) - r))``, the path softcap keeps).

    python benchmarks/fwd_rounding_cost.py [--rounds 7] [--n 512 2048] [--threads 1] [--json out.json]

Both variants run in one process, interleaved round by round on the same inputs (B=4, H=8, D=64, bf16,
causal, ``reference.attention_forward`` without statistics), so load from other jobs hits both alike. Reports
the minimum and the median over the rounds of the process CPU time (``time.process_time``: time spent
waiting for a core does not count) and of the wall time, and the load average at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from stable_attn.kernels import reference
from stable_attn.options import Options

_FUSED = reference.Problem.fused_scale


def _forward(q, k, v, opts: Options, single: bool) -> tuple[float, float]:
    """``(cpu s, wall s)`` of one forward; ``single=False`` takes the two-rounding path."""
    if not single:
        reference.Problem.fused_scale = property(lambda self: False)
    try:
        c0, w0 = time.process_time(), time.perf_counter()
        reference.attention_forward(q, k, v, opts=opts)
        return time.process_time() - c0, time.perf_counter() - w0
    finally:
        reference.Problem.fused_scale = _FUSED


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"torch {torch.__version__}, threads {args.threads}, B=4 H=8 D=64 bf16 causal, {args.rounds} rounds, "
          f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    header = (f"{'N':>6} {'P-bar':<16} {'cpu min ms':>11} {'cpu med ms':>11} {'wall min ms':>12} "
              f"{'wall med ms':>12} {'cpu min vs two':>15}")
    print(header)
    print("-" * len(header))
    rows = []
    for n in args.n:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(4, 8, n, 64, generator=g).to(torch.bfloat16) for _ in range(3))
        opts = Options(causal=True, scale=64**-0.5)
        _forward(q, k, v, opts, True)  # warm-up
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for single in (True, False):
                times[single].append(_forward(q, k, v, opts, single))
        cell = {}
        for single, name in ((False, "two roundings"), (True, "one (fma_f32)")):
            cpu, wall = (1e3 * torch.tensor([t[i] for t in times[single]]) for i in (0, 1))
            cell[single] = dict(N=n, p_bar=name, cpu_min_ms=cpu.min().item(),
                                cpu_median_ms=statistics.median(cpu.tolist()), wall_min_ms=wall.min().item(),
                                wall_median_ms=statistics.median(wall.tolist()))
        for single in (False, True):
            r = cell[single]
            r["cpu_min_vs_two"] = r["cpu_min_ms"] / cell[False]["cpu_min_ms"]
            rows.append(r)
            print(f"{n:>6} {r['p_bar']:<16} {r['cpu_min_ms']:>11.1f} {r['cpu_median_ms']:>11.1f} "
                  f"{r['wall_min_ms']:>12.1f} {r['wall_median_ms']:>12.1f} {r['cpu_min_vs_two']:>15.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(load_average=load, threads=args.threads, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
