"""Other tiles for the fused backward prototype (triton_backward_fused.py): registers, spills, loop SASS, R.

The fused kernel takes the dK/dV kernel's tiles (``bwd_config``: what benchmarks/kernel_resources.py
compiles for ``bwd_fused``); this compiles it with the query step / key tile / warps / stages given
instead, for sm_90 or sm_80 (TMA on sm_90), and prints one JSON line per tile, with the spill
instructions (LDL/STL) inside the steady-state loop. No GPU is needed; this measures no speed.

    python benchmarks/fused_tiles.py --cc 90 --tiles 64:64:128:8:2 64:32:128:8:2 128:32:128:8:2 128:16:128:8:2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from stable_attn.kernels import triton_aot as aot  # noqa: E402
from stable_attn.kernels.triton_backward_fused import fused_constants  # noqa: E402
from stable_attn.kernels.triton_launch import BwdConfig  # noqa: E402


def describe_tile(d: int, causal: bool, cc: int, m: int, n: int, warps: int, stages: int, cubin_dir: str) -> dict:
    cfg = BwdConfig(m, n, warps, stages, m, n, warps, stages, tma=cc >= 90)

    def constants(v):  # the fused kernel's constants with this tiling instead of bwd_config's
        return fused_constants(v.head_dim, v.dtype, v.cc, causal=v.causal, window=False, softcap=False,
                               dropout=False, kpm=False, config=cfg)

    aot._constants = constants  # this process compiles nothing else
    r = aot.describe(aot.Variant("bwd_fused", torch.bfloat16, d, causal, cc=cc), cubin_dir)
    with open(r["cubin"], "rb") as f:
        ops = aot.loop_opcodes(aot.parse_sass(aot.sass_of(f.read())))
    return dict(cc=cc, d=d, causal=causal, tile=f"{m}x{n}/{warps}w/{stages}s", regs=r["regs"],
                spill_bytes=r["spill_bytes"], loop_spill_instr=ops.get("LDL", 0) + ops.get("STL", 0),
                shared=r["shared"], wgmma=r["wgmma"], loop_sass=r["loop_sass"], mma_clk=r["mma_clk"],
                issue_clk=r["issue_clk"], R=round(r["R"], 3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cc", type=int, default=90, choices=sorted(aot.SHARED_LIMIT))
    p.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    p.add_argument("--tiles", nargs="+", required=True, metavar="D:M:N:WARPS:STAGES")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as cubins:
        for spec in args.tiles:
            d, m, n, warps, stages = (int(x) for x in spec.split(":"))
            print(json.dumps(describe_tile(d, args.causal, args.cc, m, n, warps, stages, cubins)), flush=True)


if __name__ == "__main__":
    main()
