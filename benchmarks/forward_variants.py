"""GPU: the current forward against the warp-specialized one (kernels/triton_forward_ws.py), checked, then timed.

    python benchmarks/forward_variants.py [--shapes 4x16x4096x128 ...] [--json PATH]

For each shape (bf16, ``B x H x N x D``, causal and not, stabilize on, the default 128-key partition), both
variants run through ``triton_attention.forward`` (``STABLE_ATTN_FORWARD=classic`` / ``=ws``): first the check,
the warp-specialized output bit for bit against the current kernel's and both within a few bf16 ulps of
``kernels/reference.py`` (the PyTorch path, same rule); then ``triton.testing.do_bench`` of each, interleaved,
median ms and TFLOP/s (causal: half the square). A variant that does not compile on this GPU prints the error.
The first step of benchmarks/gpu_check.sh: the first lent GPU answers whether the warp-specialized pipeline pays.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from stable_attn.kernels import reference, triton_forward_ws  # noqa: E402
from stable_attn.kernels import triton_attention as ta  # noqa: E402
from stable_attn.options import Options  # noqa: E402

SHAPES = ("4x16x4096x128", "1x16x16384x128", "4x16x4096x64", "16x16x1024x128")


def run(variant: str, q, k, v, opts):
    os.environ["STABLE_ATTN_FORWARD"] = variant
    return ta.forward(q, k, v, None, opts, False)[:2]


def main(argv: list[str] | None = None) -> int:
    import triton.testing

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--json")
    args = p.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| B x H x N x D | causal | ws == current | err vs reference (ulps) | current ms | ws ms | current TFLOP/s | "
          "ws TFLOP/s |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    rows = []
    for shape in args.shapes:
        B, H, N, D = map(int, shape.split("x"))
        for causal in (True, False):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
            opts = Options.create(head_dim=D, causal=causal)
            row = dict(shape=shape, causal=causal)
            try:
                cur = run("classic", q, k, v, opts)
                ws = run("ws", q, k, v, opts)
            except Exception as err:  # noqa: BLE001 - the row says where it stops
                row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
                print(f"| {shape} | {causal} | does not run: {row['error']} |||||")
                rows.append(row)
                continue
            want = reference.attention_forward(q, k, v, None, None, opts)[0].float()
            ulp = torch.finfo(torch.bfloat16).eps * want.abs().max()
            row["bit_equal"] = bool(torch.equal(cur[0], ws[0]) and torch.equal(cur[1], ws[1]))
            row["err_ulps"] = float(max((x[0].float() - want).abs().max() for x in (cur, ws)) / ulp)
            flops = 4 * B * H * N * N * D / (2 if causal else 1)
            times = {}
            for variant in ("classic", "ws", "classic", "ws"):  # interleaved; the second round counts
                times[variant] = triton.testing.do_bench(
                    lambda variant=variant, q=q, k=k, v=v, opts=opts: run(variant, q, k, v, opts))
            row.update(current_ms=times["classic"], ws_ms=times["ws"])
            rows.append(row)
            print(f"| {shape} | {causal} | {row['bit_equal']} | {row['err_ulps']:.1f} | {times['classic']:.3f} | "
                  f"{times['ws']:.3f} | {flops / times['classic'] / 1e9:.0f} | {flops / times['ws'] / 1e9:.0f} |",
                  flush=True)
    os.environ.pop("STABLE_ATTN_FORWARD", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), compiles=dict(
                (str(k[0]), v) for k, v in triton_forward_ws._compiles.items()), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
