"""Static figures of the decode kernel (stable_attn/kernels/triton_decode.py), no GPU needed.

Two tables:

1. **Compiled for sm_90 and sm_80** (Triton's AOT compiler on the CPU, ``triton_aot``): registers, spill bytes,
   shared memory, and the SASS one warp issues per iteration of the steady-state key loop (the unmasked
   stretch, ``triton_aot.steady_loop``) and the warp-instructions all warps issue per key (``warps * loop_sass /
   keys``: the issue cost of a memory-bound loop), for the constants the launcher passes
   (``triton_decode.decode_constants``:
   the rule's key block, ``G * Nq`` packed rows), with the key padding mask transformers passes.
2. **Bytes of K/V read per generated token**, per layer, against the cache size, from the launch geometry
   (``decode_plan.split_keys``; a model, not a measurement): the decode kernel reads each KV head once per
   split, and the splits are disjoint, so it reads the cache once (times the row blocks when ``G * Nq > 64``),
   plus its fp32 partials (written and read once by the combine); the training kernel's programs, one per
   (batch, query head), each read their KV head whole: ``G`` times the cache.

    python benchmarks/decode_resources.py                 # both tables (compiles 8 variants, a few minutes)
    python benchmarks/decode_resources.py --bytes-only    # table 2 alone (instant)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from stable_attn import rules  # noqa: E402
from stable_attn.kernels import decode_plan  # noqa: E402
from stable_attn.kernels import triton_decode as td  # noqa: E402
from stable_attn.kernels.triton_aot import parse_sass, resource_usage, sass_of, steady_loop  # noqa: E402
from stable_attn.options import BLOCK_N, MODE_NAMES  # noqa: E402

_FP32_PTRS = {"Acc", "Lsum", "Roff", "Mmax"}
_INTS = {"Hq", "G", "Nq", "Nk", "window", "split", "n_splits", "b_first"}


def signature(dtype: torch.dtype, consts: dict) -> tuple[dict, dict]:
    """The decode kernel's argument types, with the alignment hints of contiguous tensors (head dim % 16 == 0)."""
    elem = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    sig, attrs = {}, {}
    for i, name in enumerate(td.attn_decode_kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.startswith("stride"):
            sig[name] = "i32"
            if name != "stride_kpmb":
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _INTS:
            sig[name] = "i32"
        elif name[0].isupper():
            sig[name] = "*u8" if name == "KPM" else "*fp32" if name in _FP32_PTRS else elem
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, attrs


def compile_row(cc: int, d: int, mode: int, causal: bool, groups: int, nq: int, block_n: int) -> dict:
    consts, opts = td.decode_constants(d, torch.bfloat16, cc, groups=groups, nq=nq, causal=causal, window=False,
                                       softcap=False, kpm=True, mode=mode, block_n=block_n)
    sig, attrs = signature(torch.bfloat16, consts)
    kernel = triton.compile(ASTSource(fn=td.attn_decode_kernel, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", cc, 32), options=opts)
    cubin = kernel.asm["cubin"]
    usage = resource_usage(cubin)
    loop = steady_loop(parse_sass(sass_of(cubin)))
    return dict(cc=cc, d=d, mode=MODE_NAMES[mode], causal=causal, rows=consts["BLOCK_M"], block_n=block_n,
                warps=opts["num_warps"], regs=usage["regs"], spill=usage["stack"] + usage["local"],
                shared=kernel.metadata.shared, loop_sass=loop.sass, loop_mma=loop.mma,
                issue_per_key=opts["num_warps"] * loop.sass / block_n)


def bytes_row(B: int, Hq: int, Hkv: int, nk: int, d: int, nq: int = 1, block_n: int = BLOCK_N) -> dict:
    """K/V and partial bytes one decoding step reads per layer (bf16 cache), decode kernel vs training kernel."""
    G = Hq // Hkv
    cache = 2 * B * Hkv * nk * d * 2  # K and V, bf16
    split = decode_plan.split_keys(B, Hkv, nk, block_n)
    S = decode_plan.num_splits(nk, split)
    row_blocks = -(-G * nq // td.MAX_ROWS)
    partials = 2 * B * Hq * nq * S * (d + 3) * 4  # fp32 acc, l, r, m: written, then read by the combine
    return dict(B=B, Hq=Hq, Hkv=Hkv, nk=nk, d=d, splits=S, programs=B * Hkv * S * row_blocks,
                cache_MiB=cache / 2**20, decode_kv=row_blocks, partial_MiB=partials / 2**20,
                decode_total=(row_blocks * cache + partials) / cache, training_kv=G)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes-only", action="store_true")
    ap.add_argument("--block-n", type=int, default=BLOCK_N, help="the rule's key block (default options.BLOCK_N)")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, torch {torch.__version__}; key block {args.block_n}; decode rows: "
          "G=4 query heads x 1 query, key padding mask on\n")
    if not args.bytes_only:
        print("| cc | D | mode | causal | rows x keys | warps | regs | spill B | shared B | loop SASS | HMMA/HGMMA "
              "| warp-instructions per key |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for cc in (90, 80):
            for d in (64, 128):
                for mode in (rules.MODE_EXACT, rules.MODE_OFF):
                    r = compile_row(cc, d, mode, True, 4, 1, args.block_n)
                    print(f"| sm_{r['cc']} | {r['d']} | {r['mode']} | {r['causal']} | {r['rows']} x {r['block_n']} "
                          f"| {r['warps']} | {r['regs']} | {r['spill']} | {r['shared']} | {r['loop_sass']} "
                          f"| {r['loop_mma']} | {r['issue_per_key']:.2f} |", flush=True)
        print()
    print("| B | Hq/Hkv | context | D | splits | programs | K+V cache MiB | decode: K/V reads (x cache) | partials MiB "
          "| decode: all bytes (x cache) | training kernel: K/V reads (x cache) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for B in (1, 32):
        for nk in (4096, 32768):
            r = bytes_row(B, 32, 8, nk, 128, block_n=args.block_n)
            print(f"| {B} | 32/8 | {nk} | 128 | {r['splits']} | {r['programs']} | {r['cache_MiB']:.1f} "
                  f"| {r['decode_kv']} | {r['partial_MiB']:.2f} | {r['decode_total']:.3f} | {r['training_kv']} |")


if __name__ == "__main__":
    main()
