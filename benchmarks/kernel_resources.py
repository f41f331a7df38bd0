"""Shared memory, registers, spills and the static issue/tensor ratio of every Triton kernel variant.

Each variant is compiled ahead of time for sm_80 (A100), sm_90 (H100/H200), sm_100 (B200/B300) and/or
sm_120 (RTX 50-series) with the block configuration the launchers would pick
(stable_attn/kernels/triton_launch.py), then
``cuobjdump --dump-resource-usage`` (shipped inside Triton's package) reads REG, STACK and LOCAL
from the cubin: non-zero STACK/LOCAL means register spills. ``wgmma`` says whether the sm_90 PTX
uses Hopper's warpgroup matrix instructions. ``loop_sass`` counts the SASS instructions one warp
issues per iteration of the steady-state loop (the unmasked stretch; how it is found:
``triton_aot.steady_loop``), and ``R = (warps * loop_sass / 4) / (tensor FLOPs / 4096)`` compares
the schedulers' clocks with the tensor cores' clocks per iteration on an H100/H200 SM (model:
``triton_aot``); R above 1 means the loop is issue-bound. No GPU is needed; this measures no speed.

    python benchmarks/kernel_resources.py                       # bf16, D 64/128/256, sm_80 + sm_90
    python benchmarks/kernel_resources.py --cc 90 --d 64 128 --json /tmp/kr.json --jobs 1
    python benchmarks/kernel_resources.py --dtype fp16 --cc 90 --d 128 --jobs 4
    python benchmarks/kernel_resources.py --kernels bwd_dkdv bwd_dq --features false true --jobs 1
    python benchmarks/kernel_resources.py --cc 90 --d 64 128 --varlen true --jobs 1   # packed sequences
    python benchmarks/kernel_resources.py --cc 80 90 --d 192 --dv 128 --kernels fwd bwd_dkdv bwd_dq decode  # MLA
    python benchmarks/kernel_resources.py --cc 90 --d 64 --kernels fwd --stats-modes off exact paper --opcodes
    python benchmarks/kernel_resources.py --cc 90 80 --d 64 128 --causal true false --kernels bwd_dkdv bwd_dq \
        bwd_fused bwd_fused_atomic --jobs 1                     # the fused backward prototype beside today's
    python benchmarks/kernel_resources.py --cc 80 90 100 120 --d 64 128 256 --modes exact --no-stats \
        --kernels fwd bwd_dkdv bwd_dq decode --varlen false true --generations   # docs/BENCHMARKS.md's GPU table

``--json PATH`` writes one row per variant (fields: kernel, d, mode, stats, cc, regs, spill_bytes,
shared, wgmma, warps, loop_sass, mma_clk, issue_clk, R, cubin, and more) and keeps the cubins in
``PATH`` without ``.json`` plus ``_cubins/``. The backward kernels make no stabilization decision,
so they have one variant for every mode (``mode`` null).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from stable_attn.kernels.triton_aot import (  # noqa: E402
    SHARED_LIMIT,
    Variant,
    describe,
    describe_in_subprocess,
    loop_opcodes,
    parse_sass,
    sass_of,
)
from stable_attn.kernels.triton_launch import GPU_NAMES  # noqa: E402
from stable_attn.options import MODE_NAMES  # noqa: E402
from stable_attn.stats import STATS_ENTROPY  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = {name: mode for mode, name in MODE_NAMES.items()}
# the fused ones and decode (one new token, G = 4: triton_aot.DECODE_GROUPS) only when asked
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq", "bwd_fused", "bwd_fused_atomic", "decode")


def variants(args) -> list[Variant]:
    out = []
    for cc, dt, d, dv, causal, features, varlen in itertools.product(args.cc, args.dtype, args.d, args.dv or [None],
                                                                       args.causal, args.features, args.varlen):
        kw = dict(features=features, varlen=varlen, value_dim=None if dv == d else dv)
        if kw["value_dim"] is not None and any(k.startswith("bwd_fused") for k in args.kernels):
            raise SystemExit("--dv: the fused backward has no value head dim of its own (the launchers take the two "
                             "kernels for Dv != D)")
        if "fwd" in args.kernels:
            out += [Variant("fwd", DTYPES[dt], d, causal, MODES[mode], False, cc, **kw) for mode in args.modes]
            if args.stats:
                out += [Variant("fwd", DTYPES[dt], d, causal, MODES[mode], True, cc, **kw)
                        for mode in args.stats_modes if mode in args.modes]
            if args.entropy:  # the statistics with the entropy (stats.STATS_ENTROPY)
                out += [Variant("fwd", DTYPES[dt], d, causal, MODES[mode], STATS_ENTROPY, cc, **kw)
                        for mode in args.stats_modes if mode in args.modes]
        out += [Variant(k, DTYPES[dt], d, causal, cc=cc, **kw) for k in KERNELS[1:5] if k in args.kernels]
        if "decode" in args.kernels and not varlen:  # the decode kernel takes no packed sequences
            out += [Variant("decode", DTYPES[dt], d, causal, MODES[mode], cc=cc, features=features,
                            value_dim=kw["value_dim"])
                    for mode in args.modes]
    return out


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = ["| variant | tile m x n, warps | shared B | limit B | regs | spill B | wgmma | loop SASS | MMA clk | "
             "issue clk | R | compile s |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['block_m']} x {r['block_n']}, {r['warps']} | {r['shared']} | "
                     f"{r['limit']} | {r['regs']} | {r['spill_bytes']} | {'yes' if r['wgmma'] else 'no'} | "
                     f"{_num(r['loop_sass'], 'd')} | {_num(r['mma_clk'], '.0f')} | {_num(r['issue_clk'], '.0f')} | "
                     f"{_num(r['R'], '.2f')} | {r['compile_s']:.1f} |")
    return "\n".join(lines)


def generations(rows: list[dict]) -> str:
    """One line per kernel variant and head dim, one column per GPU generation: ``regs / spill B / shared KiB /
    loop SASS`` (``-`` where no loop is measured: fp32), ``> limit`` where it exceeds the block's shared memory."""
    ccs = sorted({r["cc"] for r in rows})
    key = lambda r: r["variant"].rsplit("-sm", 1)[0]  # noqa: E731  the variant without its target
    by: dict[str, dict[int, dict]] = {}
    for r in rows:
        by.setdefault(key(r), {})[r["cc"]] = r
    lines = ["| variant | " + " | ".join(GPU_NAMES.get(cc, f"sm_{cc}") for cc in ccs) + " |",
             "|---|" + "---|" * len(ccs)]
    for name, per in by.items():
        cells = []
        for cc in ccs:
            r = per.get(cc)
            if r is None:
                cells.append("")
                continue
            fits = "" if r["shared"] <= r["limit"] else " **> limit**"
            cells.append(f"{r['regs']} / {r['spill_bytes']} / {r['shared'] / 1024:.0f}{fits} / "
                         f"{_num(r['loop_sass'], 'd')} ({r['block_m']}x{r['block_n']}, {r['warps']}w)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_tile(r: dict, rows: int = 128, cols: int = 128) -> tuple[float, float]:
    """``(MMA clk, issue clk)`` of a variant's steady loop scaled to a ``rows x cols`` score tile."""
    reps = rows * cols / (r["block_m"] * r["block_n"])
    return r["mma_clk"] * reps, r["issue_clk"] * reps


def backward_designs(rows: list[dict]) -> str:
    """The two backward designs side by side, per (cc, dtype, D, causal) with dK/dV, dQ and fused rows.

    Per 128 x 128 score tile: tensor and issue clocks of each design's steady loops (two-kernel: the
    dK/dV and dQ loops added), ``R`` = issue / tensor of the design, and ``bound`` = the sum over its
    kernels of max(tensor, issue) clocks; the fused design's bound relative to the two-kernel one.
    Memory traffic (the fused kernel's fp32 dQ partials) is not in it.
    """
    key = lambda r: (r["cc"], r["dtype"], r["d"], r["causal"])  # noqa: E731
    by = {}
    for r in rows:
        if r["R"] is not None and "varlen" not in r["variant"] and "window" not in r["variant"]:
            by.setdefault(key(r), {})[r["kernel"]] = r
    lines = ["| cc | dtype | D | causal | design | tiles | regs | spill B | tensor clk | issue clk | R | bound | "
             "bound vs two-kernel |", "|---|---|---:|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for k, kr in sorted(by.items()):
        if not {"bwd_dkdv", "bwd_dq"} <= kr.keys():
            continue
        two = [kr["bwd_dkdv"], kr["bwd_dq"]]
        designs = [("two-kernel", two)] + [(name, [kr[name]]) for name in ("bwd_fused", "bwd_fused_atomic")
                                           if name in kr]
        base = None
        for name, rs in designs:
            clk = [per_tile(r) for r in rs]
            mma, issue = sum(c[0] for c in clk), sum(c[1] for c in clk)
            bound = sum(max(c) for c in clk)
            base = base or bound
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {name} | "
                         + " + ".join(f"{r['block_m']}x{r['block_n']}/{r['warps']}" for r in rs) + " | "
                         + " / ".join(str(r["regs"]) for r in rs) + " | "
                         + " / ".join(str(r["spill_bytes"]) for r in rs)
                         + f" | {mma:.0f} | {issue:.0f} | {issue / mma:.2f} | {bound:.0f} | {bound / base:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cc", type=int, nargs="+", default=[80, 90], choices=sorted(SHARED_LIMIT))
    p.add_argument("--generations", action="store_true",
                   help="print one line per variant with a column per --cc (regs / spill B / shared KiB / loop SASS)")
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    p.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--dv", type=int, nargs="+", default=None,
                   help="value head dims (multi-head latent attention: each with each --d); default V's = q's")
    p.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+", default=[True])
    p.add_argument("--modes", nargs="+", default=["off", "exact", "paper"], choices=sorted(MODES))
    p.add_argument("--no-stats", dest="stats", action="store_false", help="skip the stats-on forward")
    p.add_argument("--entropy", action="store_true",
                   help="also compile the stats-on forward with the entropy (its own statistics level)")
    p.add_argument("--stats-modes", nargs="+", default=["exact"], choices=sorted(MODES),
                   help="the modes (of --modes) whose stats-on forward is compiled too")
    p.add_argument("--opcodes", action="store_true",
                   help="also print, per variant, the steady-state loop's instructions by operation")
    p.add_argument("--kernels", nargs="+", default=["fwd", "bwd_dkdv", "bwd_dq"], choices=KERNELS)
    p.add_argument("--features", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+", default=[False],
                   help="window, softcap, padding mask and dropout all on (true) or all off (false)")
    p.add_argument("--varlen", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+", default=[False],
                   help="the packed-sequence variants (true), the dense ones (false), or both")
    p.add_argument("--designs", action="store_true",
                   help="also print the backward designs side by side (needs bwd_dkdv, bwd_dq and bwd_fused rows)")
    p.add_argument("--from-json", nargs="+", metavar="JSON",
                   help="read the rows from these --json files instead of compiling (with --designs)")
    p.add_argument("--jobs", type=int, default=2, help="parallel compiles")
    p.add_argument("--json", help="write the rows here (and the cubins next to it)")
    p.add_argument("--cubin-dir", help="keep the cubins here instead (default: next to --json, else a temp dir)")
    args = p.parse_args()

    if args.from_json:
        rows = [r for path in args.from_json for r in json.load(open(path))]
        print(generations(rows) if args.generations else table(rows))
        if args.designs:
            print(backward_designs(rows))
        return
    vs = variants(args)
    print(f"triton {triton.__version__}, torch {torch.__version__}; {len(vs)} variants")
    cubin_dir = args.cubin_dir or ((os.path.splitext(args.json)[0] + "_cubins") if args.json
                                   else tempfile.mkdtemp(prefix="cubins_"))
    os.makedirs(cubin_dir, exist_ok=True)
    if os.environ.get("TRITON_INTERPRET") == "1":  # interpreted kernels cannot be compiled here
        rows = describe_in_subprocess(vs, cubin_dir)
    else:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(describe, vs, [cubin_dir] * len(vs)))
    print(table(rows))
    if args.generations:
        print(generations(rows))
    if args.designs:
        print(backward_designs(rows))
    if args.opcodes:
        for r in rows:
            if r["loop_sass"] is not None:
                with open(r["cubin"], "rb") as f:
                    ops = loop_opcodes(parse_sass(sass_of(f.read())))
                print(f"{r['variant']}: " + ", ".join(f"{op} {n}" for op, n in ops.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json} (cubins in {cubin_dir})")
    bad = sum(r["shared"] > r["limit"] for r in rows)
    if bad:
        print(f"{bad} variant(s) exceed the shared-memory limit")
        sys.exit(1)


if __name__ == "__main__":
    main()
