"""Speed of the bit-level tensor-core models (stable_attn.numerics.tensor_core.mma), in multiply-adds per second.

    python benchmarks/tensor_core_speed.py              # 1 thread (the default), one table
    python benchmarks/tensor_core_speed.py --threads 4

Each row: one model and input format, ``D = A B + C`` with ``A`` [M, K], ``B`` [K, N] random normal
inputs; the rate is ``M*N*K / seconds`` (best of ``--repeat`` runs), both per wall-clock second and per
second of this process's CPU time (the two agree on an idle machine; on a shared one the CPU-time
rate is the model's own speed).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from stable_attn.numerics.tensor_core import mma

CASES = [  # model, dtype, M, K, N
    ("a100", torch.bfloat16, 128, 256, 128),
    ("h100", torch.bfloat16, 128, 256, 128),
    ("h100", torch.bfloat16, 64, 1024, 64),
    ("h100", torch.float16, 128, 256, 128),
    ("h100", torch.float8_e4m3fn, 128, 256, 128),
    ("ieee", torch.bfloat16, 128, 256, 128),
]


def rate(model: str, dtype: torch.dtype, m: int, k: int, n: int, repeat: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    c = torch.randn(m, n, generator=g)
    mma(a[:8, :32], b[:32, :8], c[:8, :8], model=model)  # warm-up
    wall = cpu = float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        mma(a, b, c, model=model)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return m * n * k / wall, m * n * k / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} thread(s)")
    print(f"{'model':<6} {'input':<14} {'M x K x N':<16} {'MAC/s (wall)':>14} {'MAC/s (cpu)':>14}")
    for model, dtype, m, k, n in CASES:
        w, c = rate(model, dtype, m, k, n, args.repeat)
        name = str(dtype).replace("torch.", "")
        print(f"{model:<6} {name:<14} {f'{m}x{k}x{n}':<16} {w / 1e6:>12.1f} M {c / 1e6:>12.1f} M")


if __name__ == "__main__":
    main()
