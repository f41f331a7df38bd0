"""Static figures of the warp-specialized forward (kernels/triton_forward_ws.py) beside the current forward, no GPU.

    python benchmarks/forward_ws_resources.py [--cc 90 100] [--d 64 128] [--modes exact off] [--causal true false]

Both kernels compiled ahead of time (``triton.compile`` for ``GPUTarget("cuda", cc, 32)`` on the CPU) with the
constants the launcher passes for a plain bf16 call (``triton_launch.launch_constants``: the 128-key partition,
K and V through tensor descriptors): registers, spill bytes and shared memory (``cuobjdump --dump-resource-usage``
from Triton's package), the SASS one warp issues per iteration of the steady-state loop
(``triton_aot.steady_loop``; in the warp-specialized kernel the consumer partition's loop) and whether the SASS /
PTX hold the warp-specialized pipeline's pieces: ``setmaxnreg`` (the partitions' register budgets: SASS
``USETMAXREG``), TMA (``UTMALDG``), Hopper's ``wgmma`` (``HGMMA``) and Blackwell's ``tcgen05.mma``
(``UTCHMMA``/``UTCQMMA``), mbarrier waits (``SYNCS``). A variant that does not compile prints the compiler's
error, first line: where Triton 3.9 stops.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from stable_attn.kernels import triton_aot  # noqa: E402
from stable_attn.kernels.triton_forward import attn_fwd_kernel  # noqa: E402
from stable_attn.kernels.triton_forward_ws import attn_fwd_ws_kernel  # noqa: E402
from stable_attn.kernels.triton_launch import launch_constants  # noqa: E402
from stable_attn.options import MODE_NAMES  # noqa: E402

KERNELS = {"current": attn_fwd_kernel, "ws": attn_fwd_ws_kernel}
MODES = {name: mode for mode, name in MODE_NAMES.items()}
MARKERS = {"setmaxnreg": r"\bUSETMAXREG\b", "TMA": r"\bUTMALDG\b", "wgmma": r"\bHGMMA\b",
           "tcgen05": r"\bUTC[HQ]MMA\b", "mbarrier": r"\bSYNCS\b"}


def compile_one(kernel: str, cc: int, d: int, mode: int, causal: bool) -> dict:
    consts, opts = launch_constants("fwd", d, torch.bfloat16, cc, causal=causal, window=False, softcap=False,
                                    dropout=False, kpm=False, mode=mode)
    row = dict(kernel=kernel, cc=cc, d=d, mode=MODE_NAMES[mode], causal=causal, tile=f"{consts['BLOCK_M']} x "
               f"{consts['BLOCK_N']}, {opts['num_warps']}", error=None)
    descriptors = ({"K": (1, 1, consts["TILE_N"], consts["BLOCK_D"]), "V": (1, 1, consts["BLOCK_N"], consts["BLOCK_D"])}
                   if consts["TMA"] else {})
    fn = KERNELS[kernel]
    sig, attrs = triton_aot._signature(fn, torch.bfloat16, consts, descriptors)
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", cc, 32), options=opts)
    except Exception as err:  # noqa: BLE001 - the row reports where the compiler stops
        row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
        return row
    row["compile_s"] = time.perf_counter() - t0
    cubin = compiled.asm["cubin"]
    usage = triton_aot.resource_usage(cubin)
    sass = triton_aot.sass_of(cubin)
    try:
        loop = triton_aot.steady_loop(triton_aot.parse_sass(sass))
    except ValueError:  # no loop issues matrix instructions itself (a partition's loop waits on another's)
        loop = None
    row.update(regs=usage["regs"], spill=usage["stack"] + usage["local"],
               shared=compiled.metadata.shared, loop_sass=loop and loop.sass, loop_mma=loop and loop.mma,
               **{name: bool(re.search(pattern, sass)) for name, pattern in MARKERS.items()})
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cc", type=int, nargs="+", default=[90, 100])
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--modes", nargs="+", default=["exact"], choices=sorted(MODES))
    p.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+", default=[True, False])
    args = p.parse_args(argv)
    print(f"triton {triton.__version__}, torch {torch.__version__}; bf16, plain (no window, softcap, mask, dropout, "
          "statistics), K/V through descriptors")
    cols = ["kernel", "sm", "D", "mode", "causal", "tile m x n, warps", "regs", "spill B", "shared B", "loop SASS",
            "loop MMA", *MARKERS]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for cc in args.cc:
        for d in args.d:
            for mode in args.modes:
                for causal in args.causal:
                    for kernel in KERNELS:
                        r = compile_one(kernel, cc, d, MODES[mode], causal)
                        head = [kernel, str(cc), str(d), mode, str(causal), r["tile"]]
                        if r["error"]:
                            print("| " + " | ".join(head) + f" | does not compile: {r['error']} |")
                            continue
                        marks = ["yes" if r[name] else "no" for name in MARKERS]
                        print("| " + " | ".join(head + [str(r[k]) for k in ("regs", "spill", "shared", "loop_sass",
                                                                             "loop_mma")] + marks) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
