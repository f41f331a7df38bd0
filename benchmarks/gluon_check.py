"""GPU (sm_90 or sm_100): the Gluon forward (kernels/gluon_forward.py) checked against the PyTorch path, then timed
against the current forward.

    python benchmarks/gluon_check.py [--shapes 4x16x4096x128 ...] [--json PATH]

Gluon kernels do not run under ``TRITON_INTERPRET=1``, so this is where the kernel is first checked. For each shape
(bf16, ``B x H x N x D``, causal and not, the exact mode, the 128-key partition) and three inputs (``randn``; keys
repeated in pairs, so every row max is a tie and the rule fires; logits scaled by 30), both kernels run with the
row statistics and the entropy: the outputs against ``kernels/reference.py`` (same rule) in bf16 ulps of the
largest output, and the Gluon kernel's decisions against the current kernel's (``fixed_blocks``, ``max_logit``,
``saturated``: equal or not; ``lse``, ``sink_mass``, ``entropy``: largest difference). Then
``triton.testing.do_bench`` of both without statistics, interleaved, median ms and TFLOP/s (causal: half the
square). Exit status 1 where an output is more than ``--max-ulps`` from the reference or a decision differs.
The first step of benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from stable_attn.kernels import gluon_forward, reference  # noqa: E402
from stable_attn.kernels import triton_attention as ta  # noqa: E402
from stable_attn.options import Options  # noqa: E402
from stable_attn.stats import STATS_ENTROPY  # noqa: E402

SHAPES = ("2x8x1024x128", "2x8x1000x64")  # checked (the reference walks every block on the GPU)
TIMED = ("4x16x4096x128", "4x16x4096x64")
INPUTS = ("randn", "tied", "huge")


def inputs(kind: str, B: int, H: int, N: int, D: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    if kind == "tied":  # every key twice: each row's max is reached at two keys of one block
        k[:, :, 1::2] = k[:, :, 0::2][:, :, : k[:, :, 1::2].shape[2]]
    elif kind == "huge":
        q = q * 30
    return q, k, v


def check(shape: str, causal: bool, kind: str, max_ulps: float) -> dict:
    B, H, N, D = map(int, shape.split("x"))
    q, k, v = inputs(kind, B, H, N, D)
    opts = Options.create(head_dim=D, causal=causal)
    cur = ta.forward(q, k, v, None, opts, STATS_ENTROPY)
    glu = gluon_forward.forward(q, k, v, opts, STATS_ENTROPY)
    want, want_lse, _ = reference.attention_forward(q, k, v, None, None, opts, STATS_ENTROPY)
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().max()
    row = dict(shape=shape, causal=causal, inputs=kind,
               current_ulps=float((cur[0].float() - want.float()).abs().max() / ulp),
               gluon_ulps=float((glu[0].float() - want.float()).abs().max() / ulp),
               out_equal=bool(torch.equal(cur[0], glu[0])),
               lse_diff=float((cur[1] - glu[1]).abs().max()))
    a, b = cur[2], glu[2]
    for name in ("fixed_blocks", "max_logit", "saturated"):
        row[f"{name}_equal"] = bool(torch.equal(getattr(a, name), getattr(b, name)))
    for name in ("sink_mass", "entropy"):
        row[f"{name}_diff"] = float((getattr(a, name) - getattr(b, name)).abs().max())
    row["fired"] = int(b.fixed_blocks.sum())
    row["ok"] = (row["gluon_ulps"] <= max_ulps and row["fixed_blocks_equal"] and row["max_logit_equal"]
                 and row["saturated_equal"])
    return row


def main(argv: list[str] | None = None) -> int:
    import triton.testing

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--timed", nargs="+", default=list(TIMED))
    p.add_argument("--max-ulps", type=float, default=4.0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    rows, ok = [], True
    print("| B x H x N x D | causal | inputs | current ulps | gluon ulps | out equal | lse diff | fixed/max/sat equal "
          "| sink, entropy diff | blocks fired |")
    print("|---|---|---|---:|---:|---|---:|---|---|---:|")
    for shape in args.shapes:
        for causal in (True, False):
            for kind in INPUTS:
                try:
                    r = check(shape, causal, kind, args.max_ulps)
                except Exception as err:  # noqa: BLE001 - the row says where it stops
                    r = dict(shape=shape, causal=causal, inputs=kind, ok=False, error=f"{type(err).__name__}: {err}")
                    print(f"| {shape} | {causal} | {kind} | does not run: {r['error'][:300]} |||||||")
                    rows.append(r)
                    ok = False
                    continue
                rows.append(r)
                ok = ok and r["ok"]
                print(f"| {shape} | {causal} | {kind} | {r['current_ulps']:.1f} | {r['gluon_ulps']:.1f} | "
                      f"{r['out_equal']} | {r['lse_diff']:.2e} | {r['fixed_blocks_equal']}/{r['max_logit_equal']}/"
                      f"{r['saturated_equal']} | {r['sink_mass_diff']:.1e}, {r['entropy_diff']:.1e} | {r['fired']} |",
                      flush=True)
    print("\n| B x H x N x D | causal | current ms | gluon ms | current TFLOP/s | gluon TFLOP/s |")
    print("|---|---|---:|---:|---:|---:|")
    for shape in args.timed:
        B, H, N, D = map(int, shape.split("x"))
        q, k, v = inputs("randn", B, H, N, D)
        for causal in (True, False):
            opts = Options.create(head_dim=D, causal=causal)
            runs = {"current": lambda q=q, k=k, v=v, opts=opts: ta.forward(q, k, v, None, opts, 0),
                    "gluon": lambda q=q, k=k, v=v, opts=opts: gluon_forward.forward(q, k, v, opts, 0)}
            times = {}
            try:
                for name in ("current", "gluon", "current", "gluon"):  # interleaved; the second round counts
                    times[name] = triton.testing.do_bench(runs[name])
            except Exception as err:  # noqa: BLE001
                print(f"| {shape} | {causal} | does not run: {type(err).__name__}: {str(err)[:300]} ||||")
                ok = False
                continue
            flops = 4 * B * H * N * N * D / (2 if causal else 1)
            rows.append(dict(shape=shape, causal=causal, current_ms=times["current"], gluon_ms=times["gluon"]))
            print(f"| {shape} | {causal} | {times['current']:.3f} | {times['gluon']:.3f} | "
                  f"{flops / times['current'] / 1e9:.0f} | {flops / times['gluon'] / 1e9:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
