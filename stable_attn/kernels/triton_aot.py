"""Ahead-of-time compilation of the Triton kernels for a GPU target, without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` runs the whole compiler
(Triton IR -> PTX -> cubin with ptxas) on the CPU, so compile errors, shared-memory overflow and
register spills of every variant are caught on a machine without a GPU (the compile test and
benchmarks/kernel_resources.py use this module). It builds the same signature and compile-time
constants the launchers in ``triton_attention.py`` pass at run time, with the pointer and stride
alignment hints Triton derives for contiguous tensors whose head dim is a multiple of 16.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import reference, rules
from .triton_attention import _TL_DTYPE, bwd_config, fwd_config, head_block
from .triton_backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess
from .triton_forward import attn_fwd_kernel

# Shared memory one block may use (bytes): A100 (sm_80) 163 KiB, H100/H200 (sm_90) 227 KiB.
SHARED_LIMIT = {80: 166912, 90: 232448}

_PTR = {"KPM": "*u8", "Lse": "*fp32", "Delta": "*fp32", "StSat": "*i8", "StFixed": "*i32", "StMax": "*fp32",
        "StP0": "*fp32"}
_INTS = {"Hq", "G", "Nq", "Nk", "window"}
KINDS = ("fwd", "bwd_pre", "bwd_dkdv", "bwd_dq")
_KERNELS = {"fwd": attn_fwd_kernel, "bwd_pre": attn_bwd_preprocess, "bwd_dkdv": attn_bwd_dkdv_kernel,
            "bwd_dq": attn_bwd_dq_kernel}


@dataclass(frozen=True)
class Variant:
    """One compiled kernel variant: what the launchers would pick for these options."""

    kind: str  # one of KINDS
    dtype: torch.dtype
    head_dim: int
    causal: bool = True
    mode: int = rules.MODE_EXACT
    stats: bool = False
    cc: int = 90
    block_n: int = reference.BLOCK_N
    features: bool = False  # window, softcap, key padding mask and dropout all on

    @property
    def name(self) -> str:
        mode = {rules.MODE_OFF: "off", rules.MODE_EXACT: "exact", rules.MODE_PAPER: "paper"}[self.mode]
        dt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]
        parts = [self.kind, dt, f"D{self.head_dim}", "causal" if self.causal else "full"]
        if self.kind == "fwd":
            parts += [mode, "stats" if self.stats else "nostats"]
        if self.features:
            parts.append("window-softcap-kpm-dropout")
        return "-".join(parts) + f"-sm{self.cc}"


def _signature(fn, dtype: torch.dtype, constexprs: dict) -> tuple[dict, dict]:
    elem = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.startswith("stride"):
            sig[name] = "i32"
            if name != "stride_kpmb":  # the padding mask's row stride is Nk: no alignment promised
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _INTS:
            sig[name] = "i32"
        elif name == "seed":
            sig[name] = "i64"
        elif name[0].isupper():
            sig[name] = _PTR.get(name, elem)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, attrs


def source(v: Variant) -> tuple[ASTSource, dict]:
    """The ASTSource and compile options (warps, stages) of a variant."""
    block_d = head_block(v.head_dim)
    f = v.features
    common = dict(CAUSAL=v.causal, WINDOW=f, SOFTCAP=f, HAS_KPM=f, DROPOUT=f, HEAD_D=v.head_dim,
                  BLOCK_D=block_d, DTYPE=_TL_DTYPE[v.dtype], UPCAST=False,
                  PREC="ieee" if v.dtype == torch.float32 else "tf32")
    if v.kind == "fwd":
        cfg = fwd_config(block_d, v.block_n, v.dtype, v.cc)
        consts = dict(common, MODE=v.mode, STATS=v.stats, BLOCK_M=cfg.block_m, BLOCK_N=v.block_n)
        opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    elif v.kind == "bwd_pre":
        consts = dict(HEAD_D=v.head_dim, BLOCK_D=block_d, BLOCK_M=64)
        opts = dict(num_warps=4, num_stages=1)
    else:
        c = bwd_config(block_d, v.dtype, v.cc)
        m, n, warps, stages = (c.m1, c.n1, c.warps1, c.stages1) if v.kind == "bwd_dkdv" else (c.m2, c.n2, c.warps2,
                                                                                               c.stages2)
        consts = dict(common, BLOCK_M=m, BLOCK_N=n)
        opts = dict(num_warps=warps, num_stages=stages)
    fn = _KERNELS[v.kind]
    sig, attrs = _signature(fn, v.dtype, consts)
    return ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), opts


def compile_variant(v: Variant):
    """Compile a variant for ``sm_{v.cc}``; returns Triton's CompiledKernel (asm, metadata)."""
    src, opts = source(v)
    return triton.compile(src, target=GPUTarget("cuda", v.cc, 32), options=opts)


_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def describe(v: Variant) -> dict:
    """Compile ``v`` and report shared memory, registers, spills (cubin via cuobjdump) and wgmma use."""
    t0 = time.perf_counter()
    kernel = compile_variant(v)
    seconds = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        dump = subprocess.run([CUOBJDUMP, "--dump-resource-usage", path], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", dump))
    return dict(variant=v.name, shared=kernel.metadata.shared, limit=SHARED_LIMIT[v.cc], regs=int(fields["REG"]),
                stack=int(fields["STACK"]), local=int(fields["LOCAL"]), wgmma="wgmma" in kernel.asm["ptx"],
                cubin_bytes=len(kernel.asm["cubin"]), compile_s=seconds)


def _encode(v: Variant) -> dict:
    d = asdict(v)
    d["dtype"] = {t: n for n, t in _DTYPE_NAMES.items()}[v.dtype]
    return d


def describe_in_subprocess(variants: list[Variant]) -> list[dict]:
    """:func:`describe` in a fresh interpreter without ``TRITON_INTERPRET``.

    Under the interpreter ``@triton.jit`` yields functions that cannot be compiled, and the flag is
    read at import time, so a process that runs the interpreted tests cannot also compile.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "stable_attn.kernels.triton_aot"],
                          input=json.dumps([_encode(v) for v in variants]), env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {[v.name for v in variants]} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _main() -> None:
    variants = [Variant(**dict(d, dtype=_DTYPE_NAMES[d["dtype"]])) for d in json.loads(sys.stdin.read())]
    print(json.dumps([describe(v) for v in variants]))


if __name__ == "__main__":
    _main()
