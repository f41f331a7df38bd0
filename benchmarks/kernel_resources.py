"""Shared memory, registers and spills of every Triton kernel variant, compiled for a GPU on any machine.

Each variant is compiled ahead of time for sm_80 (A100) and/or sm_90 (H100/H200) with the block
configuration the launchers would pick (stable_attn/kernels/triton_attention.py), then
``cuobjdump --dump-resource-usage`` (shipped inside Triton's package) reads REG, STACK and LOCAL
from the cubin: non-zero STACK/LOCAL means register spills. ``wgmma`` says whether the sm_90 PTX
uses Hopper's warpgroup matrix instructions. No GPU is needed; this measures no speed.

    python benchmarks/kernel_resources.py                       # bf16, D 64/128/256, sm_80 + sm_90
    python benchmarks/kernel_resources.py --dtype fp16 --cc 90 --d 128 --jobs 4
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from stable_attn.kernels import rules  # noqa: E402
from stable_attn.kernels.triton_aot import SHARED_LIMIT, Variant, describe, describe_in_subprocess  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = {"off": rules.MODE_OFF, "exact": rules.MODE_EXACT, "paper": rules.MODE_PAPER}


def variants(args) -> list[Variant]:
    out = []
    for cc in args.cc:
        for dt in args.dtype:
            for d in args.d:
                for causal in args.causal:
                    for mode in args.modes:
                        out.append(Variant("fwd", DTYPES[dt], d, causal, MODES[mode], False, cc))
                    if "exact" in args.modes and args.stats:
                        out.append(Variant("fwd", DTYPES[dt], d, causal, rules.MODE_EXACT, True, cc))
                    out += [Variant(k, DTYPES[dt], d, causal, cc=cc) for k in ("bwd_dkdv", "bwd_dq")]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cc", type=int, nargs="+", default=[80, 90], choices=sorted(SHARED_LIMIT))
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    p.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+", default=[True])
    p.add_argument("--modes", nargs="+", default=["off", "exact", "paper"], choices=sorted(MODES))
    p.add_argument("--no-stats", dest="stats", action="store_false", help="skip the stats-on forward")
    p.add_argument("--jobs", type=int, default=2, help="parallel compiles")
    args = p.parse_args()

    vs = variants(args)
    print(f"triton {triton.__version__}, torch {torch.__version__}; {len(vs)} variants")
    if os.environ.get("TRITON_INTERPRET") == "1":  # interpreted kernels cannot be compiled here
        rows = describe_in_subprocess(vs)
    else:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(describe, vs))
    header = "| variant | shared B | limit B | regs | stack | local | spills | wgmma | compile s |"
    print(header)
    print("|---|---:|---:|---:|---:|---:|---|---|---:|")
    bad = 0
    for r in rows:
        spills = r["stack"] > 0 or r["local"] > 0
        over = r["shared"] > r["limit"]
        bad += over
        print(f"| {r['variant']} | {r['shared']} | {r['limit']} | {r['regs']} | {r['stack']} | {r['local']} | "
              f"{'YES' if spills else 'no'} | {'yes' if r['wgmma'] else 'no'} | {r['compile_s']:.1f} |")
    if bad:
        print(f"{bad} variant(s) exceed the shared-memory limit")
        sys.exit(1)


if __name__ == "__main__":
    main()
