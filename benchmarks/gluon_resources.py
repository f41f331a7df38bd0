"""Static figures of the Gluon forward (kernels/gluon_forward.py) beside the current forward, no GPU.

    python benchmarks/gluon_resources.py [--cc 90 100] [--d 64 128] [--modes exact off] [--causal true false]
                                         [--stats 0 1]

Both kernels compiled ahead of time for ``GPUTarget("cuda", cc, 32)`` on the CPU: the current one
(``triton_forward.attn_fwd_kernel``) with the constants its launcher passes for a plain bf16 call
(``triton_launch.launch_constants``), the Gluon one with its own (``gluon_forward.compile_kernel``: 128 x 128 tiles,
8 consumer warps and one loader warp). Per kernel: registers, spill bytes and shared memory (``cuobjdump
--dump-resource-usage`` from Triton's package), the SASS one warp issues per iteration of the steady-state loop
(``triton_aot.steady_loop``; in the Gluon kernel the consumer's loop) and whether the SASS holds the pieces of a
warp-specialized pipeline: ``setmaxnreg`` (``USETMAXREG``, with the register counts it sets), TMA (``UTMALDG``),
Hopper's ``wgmma`` (``HGMMA``), Blackwell's ``tcgen05.mma`` (``UTCHMMA``/``UTCQMMA``), mbarrier waits (``SYNCS``). A
variant that does not compile prints the compiler's error, first and last lines: where it stops (each variant
compiles in a child process: an LLVM error aborts the process it happens in).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from stable_attn.kernels import gluon_forward, triton_aot  # noqa: E402
from stable_attn.kernels.triton_forward import attn_fwd_kernel  # noqa: E402
from stable_attn.kernels.triton_launch import launch_constants  # noqa: E402
from stable_attn.options import MODE_NAMES  # noqa: E402

MODES = {name: mode for mode, name in MODE_NAMES.items()}
MARKERS = {"setmaxnreg": r"\bUSETMAXREG\b", "TMA": r"\bUTMALDG\b", "wgmma": r"\bHGMMA\b",
           "tcgen05": r"\bUTC[HQ]MMA\b", "mbarrier": r"\bSYNCS\b"}


def _compile_current(cc: int, d: int, mode: int, causal: bool, stats: int):
    consts, opts = launch_constants("fwd", d, torch.bfloat16, cc, causal=causal, window=False, softcap=False,
                                    dropout=False, kpm=False, mode=mode, stats=stats)
    descriptors = ({"K": (1, 1, consts["TILE_N"], consts["BLOCK_D"]), "V": (1, 1, consts["BLOCK_N"], consts["BLOCK_D"])}
                   if consts["TMA"] else {})
    sig, attrs = triton_aot._signature(attn_fwd_kernel, torch.bfloat16, consts, descriptors)
    tile = f"{consts['BLOCK_M']} x {consts['TILE_N']}, {opts['num_warps']}"
    return triton.compile(ASTSource(fn=attn_fwd_kernel, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", cc, 32), options=opts), tile


def _compile_gluon(cc: int, d: int, mode: int, causal: bool, stats: int):
    tile = f"{gluon_forward.BLOCK_M} x {gluon_forward.BLOCK_N}, {gluon_forward.NUM_WARPS[90 if cc < 100 else 100]}+1"
    return gluon_forward.compile_kernel(cc, d, causal, mode, stats), tile


KERNELS = {"current": _compile_current, "gluon": _compile_gluon}


def error_line(err: Exception) -> str:
    """The compiler error in one line: its type, first and last non-empty lines."""
    lines = [x.strip() for x in str(err).splitlines() if x.strip()]
    if not lines:
        return type(err).__name__
    return f"{type(err).__name__}: {lines[0]}" + (f" ... {lines[-1]}" if len(lines) > 1 else "")


def describe(compiled) -> dict:
    """Registers, spills, shared memory, steady loop and the pipeline markers of a compiled kernel."""
    cubin = compiled.asm["cubin"]
    usage = triton_aot.resource_usage(cubin)
    sass = triton_aot.sass_of(cubin)
    try:
        loop = triton_aot.steady_loop(triton_aot.parse_sass(sass))
    except ValueError:  # no loop issues matrix instructions
        loop = None
    setmaxnreg = sorted({int(n, 16) for n in re.findall(r"USETMAXREG\.\S+\s+(?:\w+,\s*)?(0x[0-9a-f]+)", sass)})
    return dict(regs=usage["regs"], spill=usage["stack"] + usage["local"],
                shared=compiled.metadata.shared, loop_sass=loop and loop.sass, loop_mma=loop and loop.mma,
                setmaxnreg_values=setmaxnreg,
                **{name: bool(re.search(pattern, sass)) for name, pattern in MARKERS.items()})


def compile_one(kernel: str, cc: int, d: int, mode: int, causal: bool, stats: int) -> dict:
    row = dict(kernel=kernel, cc=cc, d=d, mode=MODE_NAMES[mode], causal=causal, stats=stats, error=None, tile="")
    t0 = time.perf_counter()
    try:
        compiled, row["tile"] = KERNELS[kernel](cc, d, mode, causal, stats)
    except Exception as err:  # noqa: BLE001 - the row reports where the compiler stops
        row["error"] = error_line(err)
        return row
    row["compile_s"] = time.perf_counter() - t0
    row.update(describe(compiled))
    return row


def compile_isolated(kernel: str, cc: int, d: int, mode: int, causal: bool, stats: int) -> dict:
    """:func:`compile_one` in a child process: where the backend aborts (an LLVM error ends the process), the row
    holds the child's last line of stderr instead of ending this table."""
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import gluon_resources as g; print(json.dumps(g.compile_one({kernel!r}, {cc}, {d}, {mode}, {causal}, "
            f"{stats})))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    errs = [x for x in done.stderr.splitlines() if x.strip() and "nanobind" not in x and not x.startswith(" - ")]
    return dict(kernel=kernel, cc=cc, d=d, mode=MODE_NAMES[mode], causal=causal, stats=stats, tile="",
                error=f"process ended ({done.returncode}): {errs[-1].strip() if errs else ''}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cc", type=int, nargs="+", default=[90, 100])
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--modes", nargs="+", default=["exact"], choices=sorted(MODES))
    p.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+", default=[True, False])
    p.add_argument("--stats", type=int, nargs="+", default=[0], help="0 none, 1 row statistics, 2 also entropy")
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    args = p.parse_args(argv)
    print(f"triton {triton.__version__}, torch {torch.__version__}; bf16, no window, softcap, mask or dropout")
    cols = ["kernel", "sm", "D", "mode", "causal", "stats", "tile m x n, warps", "regs", "spill B", "shared B",
            "loop SASS", "loop MMA", *MARKERS, "setmaxnreg values"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for cc in args.cc:
        for d in args.d:
            for mode in args.modes:
                for causal in args.causal:
                    for stats in args.stats:
                        for kernel in args.kernels:
                            r = compile_isolated(kernel, cc, d, MODES[mode], causal, stats)
                            head = [kernel, str(cc), str(d), mode, str(causal), str(stats), r["tile"]]
                            if r["error"]:
                                print("| " + " | ".join(head) + f" | does not compile: {r['error']} |", flush=True)
                                continue
                            marks = ["yes" if r[name] else "no" for name in MARKERS]
                            vals = "/".join(map(str, r["setmaxnreg_values"])) or "-"
                            print("| " + " | ".join(head + [str(r[k]) for k in ("regs", "spill", "shared", "loop_sass",
                                                                                 "loop_mma")] + marks + [vals]) + " |",
                                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
