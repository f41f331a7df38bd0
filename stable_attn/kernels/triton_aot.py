"""Ahead-of-time compilation of the Triton kernels for a GPU target, without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` runs the whole compiler
(Triton IR -> PTX -> cubin with ptxas) on the CPU, so compile errors, shared-memory overflow and
register spills of every variant are caught on a machine without a GPU (the compile test and
benchmarks/kernel_resources.py use this module). It builds the same signature and compile-time
constants the launchers (``triton_launch.launch_constants``) pass at run time, with the pointer and stride
alignment hints Triton derives for contiguous tensors whose head dim is a multiple of 16.

Static speed model (:func:`describe`). The SASS of the cubin (Triton's bundled ``cuobjdump -sass``)
gives ``loop_sass``, the instructions one warp issues per iteration of the kernel's steady-state
loop (:func:`steady_loop`). Per SM of an H100/H200 the tensor cores do 4096 dense 16-bit FLOP per
clock and four schedulers issue one warp-instruction each per clock, so one iteration needs
``mma_clk = tensor FLOPs / 4096`` on the tensor cores and ``issue_clk = warps * loop_sass / 4`` on
the schedulers; ``R = issue_clk / mma_clk`` above 1 means the tile cannot keep the tensor cores busy
even with perfect overlap. It ignores latency, memory and occupancy: a bound, not a timing.
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
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .. import rules
from ..options import BLOCK_N, MODE_NAMES
from .triton_backward import (
    attn_bwd_dkdv_kernel,
    attn_bwd_dkdv_varlen_kernel,
    attn_bwd_dq_kernel,
    attn_bwd_dq_varlen_kernel,
    attn_bwd_preprocess,
    attn_bwd_preprocess_varlen,
)
from .triton_backward_fused import attn_bwd_fused_kernel, attn_bwd_fused_varlen_kernel, fused_constants
from .triton_decode import attn_decode_kernel, decode_constants
from .triton_forward import attn_fwd_kernel, attn_fwd_varlen_kernel
from .triton_launch import SHARED_LIMIT, head_block, launch_constants

_PTR = {"KPM": "*u8", "Lse": "*fp32", "Delta": "*fp32", "StSat": "*i8", "StFixed": "*i32", "StMax": "*fp32",
        "StSink": "*fp32", "StEnt": "*fp32", "Sinks": "*fp32", "CuQ": "*i32", "CuK": "*i32", "DQP": "*fp32",
        "Acc": "*fp32", "Lsum": "*fp32", "Roff": "*fp32", "Mmax": "*fp32"}
_INTS = {"Hq", "G", "Nq", "Nk", "window", "total_q", "b_first", "n_rows", "split", "n_splits"}
# bwd_fused / bwd_fused_atomic: the fused backward prototype (triton_backward_fused.py)
# decode: the generation step's split-key kernel (triton_decode.py; dense only), compiled for one new token of
# DECODE_GROUPS query heads per KV head (GQA 4, as benchmarks/decode_resources.py)
DECODE_GROUPS = 4
KINDS = ("fwd", "bwd_pre", "bwd_dkdv", "bwd_dq", "bwd_fused", "bwd_fused_atomic", "decode")
_KERNELS = {"fwd": attn_fwd_kernel, "bwd_pre": attn_bwd_preprocess, "bwd_dkdv": attn_bwd_dkdv_kernel,
            "bwd_dq": attn_bwd_dq_kernel, "bwd_fused": attn_bwd_fused_kernel, "bwd_fused_atomic": attn_bwd_fused_kernel,
            "decode": attn_decode_kernel}
_VARLEN_KERNELS = {"fwd": attn_fwd_varlen_kernel, "bwd_pre": attn_bwd_preprocess_varlen,
                   "bwd_dkdv": attn_bwd_dkdv_varlen_kernel, "bwd_dq": attn_bwd_dq_varlen_kernel,
                   "bwd_fused": attn_bwd_fused_varlen_kernel, "bwd_fused_atomic": attn_bwd_fused_varlen_kernel}


@dataclass(frozen=True)
class Variant:
    """One compiled kernel variant: what the launchers would pick for these options."""

    kind: str  # one of KINDS
    dtype: torch.dtype
    head_dim: int
    causal: bool = True
    mode: int = rules.MODE_EXACT
    stats: int = False  # a stats.STATS_* level: False/0 none, True/1 the row statistics, 2 also the entropy
    cc: int = 90
    block_n: int = BLOCK_N
    features: bool = False  # window, softcap, key padding mask (not with varlen) and dropout all on
    varlen: bool = False  # packed sequences (forward_varlen / backward_varlen)
    value_dim: int | None = None  # V's head dim where it differs from head_dim (multi-head latent attention)

    @property
    def mode_name(self) -> str:
        return MODE_NAMES[self.mode]

    @property
    def name(self) -> str:
        mode = self.mode_name
        dt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]
        dims = f"D{self.head_dim}" if self.value_dim in (None, self.head_dim) else f"D{self.head_dim}v{self.value_dim}"
        parts = [self.kind, dt, dims, "causal" if self.causal else "full"]
        if self.kind == "fwd":
            parts += [mode, {0: "nostats", 1: "stats", 2: "stats+entropy"}[int(self.stats)]]
        if self.kind == "decode":
            parts += [mode, f"G{DECODE_GROUPS}"]
        if self.features:
            parts.append("window-softcap-dropout" if self.varlen else "window-softcap-kpm-dropout")
        if self.varlen:
            parts.append("varlen")
        return "-".join(parts) + f"-sm{self.cc}"


def _signature(fn, dtype: torch.dtype, constexprs: dict, descriptors: dict | None = None) -> tuple[dict, dict]:
    """Argument types; ``descriptors`` maps the arguments passed as tensor descriptors to their block shape."""
    elem = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    descriptors = descriptors or {}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in descriptors:
            sig[name] = f"tensordesc<{elem[1:]}[{', '.join(map(str, descriptors[name]))}]>"
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
    consts, opts = _constants(v)
    fn = (_VARLEN_KERNELS if v.varlen else _KERNELS)[v.kind]
    descriptors = {}
    if consts.get("TMA"):  # the launcher's descriptors: a row block of one (batch, head) of [B, H, N, D]
        streams_q = v.kind in ("bwd_dkdv", "bwd_fused", "bwd_fused_atomic")
        names = ("Q", "DO") if streams_q else ("K", "V")  # fwd and bwd_dq stream K and V
        rows = ((consts["BLOCK_M"],) * 2 if streams_q else  # or of one head of [total, H, D]
                (consts.get("TILE_N", consts["BLOCK_N"]), consts["BLOCK_N"]))  # the forward's K: a whole key tile
        # the second stream (dO, V) has the value head dim
        cols = (consts["BLOCK_D"], consts.get("BLOCK_DV", consts["BLOCK_D"]))
        descriptors = {n: (r, 1, c) if v.varlen else (1, 1, r, c) for n, r, c in zip(names, rows, cols)}
    sig, attrs = _signature(fn, v.dtype, consts, descriptors)
    return ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), opts


def _constants(v: Variant) -> tuple[dict, dict]:
    """The compile-time constants and compile options of a variant: the launchers' own
    (``triton_launch.launch_constants``), for TMA-compatible strides on a GPU (no interpreter)."""
    dv = v.value_dim or v.head_dim
    if v.kind == "bwd_pre":  # delta = rowsum(dO * O): over the value head dim
        return dict(HEAD_D=dv, BLOCK_D=head_block(dv), BLOCK_M=64), dict(num_warps=4, num_stages=1)
    f = v.features
    if v.kind == "decode":  # one new token of G query heads per KV head, the key padding mask transformers passes
        if v.varlen:
            raise ValueError("the decode kernel takes no packed sequences (varlen=False)")
        return decode_constants(v.head_dim, v.dtype, v.cc, groups=DECODE_GROUPS, nq=1, causal=v.causal, window=f,
                                softcap=f, kpm=True, mode=v.mode, block_n=v.block_n, value_dim=v.value_dim)
    if v.kind in ("bwd_fused", "bwd_fused_atomic"):
        if dv != v.head_dim:
            raise ValueError("the fused backward has no value head dim of its own (the launchers take the two "
                             "kernels for Dv != D)")
        return fused_constants(v.head_dim, v.dtype, v.cc, atomic=v.kind == "bwd_fused_atomic", causal=v.causal,
                               window=f, softcap=f, dropout=f, kpm=None if v.varlen else f)
    return launch_constants(v.kind, v.head_dim, v.dtype, v.cc, causal=v.causal, window=f, softcap=f, dropout=f,
                            kpm=None if v.varlen else f, mode=v.mode, stats=v.stats, block_n=v.block_n,
                            value_dim=v.value_dim)


def compile_variant(v: Variant):
    """Compile a variant for ``sm_{v.cc}``; returns Triton's CompiledKernel (asm, metadata)."""
    src, opts = source(v)
    return triton.compile(src, target=GPUTarget("cuda", v.cc, 32), options=opts)


_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


# Dense 16-bit tensor-core FLOP per clock per SM (H100/H200) and warp-instructions issued per clock.
TENSOR_FLOP_PER_CLK = 4096
ISSUE_PER_CLK = 4
# SASS opcodes of the matrix units: mma.sync (sm_80+, and sm_120), wgmma (sm_90) and tcgen05.mma (sm_100: UTCHMMA)
_MMA_OPS = ("HMMA", "HGMMA", "UTCHMMA")
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.+?)\s*;")
_BRANCH = re.compile(r"^(?:@!?U?P\w+\s+)?BRA(?:\.\S+)?\s+(?:[^;]*?,\s*)?(0x[0-9a-f]+)$")


class Loop(NamedTuple):
    """A loop of the SASS: instructions ``[start, end]`` (byte addresses), ``end`` the backward branch."""

    start: int
    end: int
    sass: int  # instructions in the body, one warp's issue count per iteration
    mma: int  # of which tensor-core instructions


def sass_of(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin (the SASS ptxas produced, as text)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True, text=True, check=True).stdout


def parse_sass(text: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` of the one function in a ``cuobjdump -sass`` listing."""
    if text.count("Function :") != 1:
        raise ValueError(f"expected one kernel in the SASS listing, found {text.count('Function :')}")
    return [(int(a, 16), ins.strip()) for a, ins in _INSTR.findall(text)]


def find_loops(instrs: list[tuple[int, str]]) -> list[Loop]:
    """Every loop: a branch back to a lower address, before the kernel's last ``EXIT``.

    Code after the last ``EXIT`` is out-of-line (ptxas moves slow paths such as barrier-wait retries
    there, and they branch back into the loop they came from): a branch from there is no loop.
    A branch to itself (the trap after the end) is none either.
    """
    exits = [a for a, ins in instrs if _opcode(ins) == "EXIT"]
    last_exit = max(exits) if exits else max(a for a, _ in instrs)
    loops = []
    for addr, ins in instrs:
        m = _BRANCH.match(ins)
        if not m or addr > last_exit:
            continue
        target = int(m.group(1), 16)
        if target < addr:
            body = [i for a, i in instrs if target <= a <= addr]
            loops.append(Loop(target, addr, len(body), sum(_opcode(i) in _MMA_OPS for i in body)))
    return loops


def _opcode(ins: str) -> str:
    """``HGMMA`` of ``@P0 HGMMA.64x64x16.F32.BF16 ...``: the operation without predicate or modifiers."""
    words = ins.split()
    return (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]


def loop_opcodes(instrs: list[tuple[int, str]]) -> dict[str, int]:
    """How many instructions of each operation (``_opcode``) the steady-state loop (``steady_loop``) of a
    parsed listing issues per iteration and warp, most frequent first: where ``loop_sass`` goes."""
    loop = steady_loop(instrs)
    counts: dict[str, int] = {}
    for addr, ins in instrs:
        if loop.start <= addr <= loop.end:
            counts[_opcode(ins)] = counts.get(_opcode(ins), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def steady_loop(instrs: list[tuple[int, str]]) -> Loop:
    """The steady-state inner loop: the shortest loop that issues tensor-core instructions itself.

    Candidates are the loops with matrix instructions (``HMMA``/``HGMMA``) that contain no other such
    loop: so the dK/dV kernel's outer loop over the G query heads drops out (its body holds the key
    loops), and barrier-wait spin loops without matrix instructions never count. Each kernel walks
    its blocks in stretches compiled as separate loops of the same body, with (masked stretches: the
    causal diagonal, the sliding window's edge, the end of the keys) or without the structural mask,
    so the shortest candidate is the unmasked stretch, where a long causal sequence spends nearly all
    its iterations.
    """
    mma = [lp for lp in find_loops(instrs) if lp.mma > 0]
    inner = [lp for lp in mma if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in mma)]
    if not inner:
        raise ValueError("no loop with tensor-core instructions in the SASS")
    return min(inner, key=lambda lp: (lp.sass, lp.start))


def key_loop(instrs: list[tuple[int, str]], chunks: int) -> Loop:
    """The steady-state loop of a kernel that walks Q and K in ``chunks`` column chunks per key block (head dim 512:
    ``triton_forward.chunked_products``): :func:`steady_loop` finds the chunk loop; one key block issues the loop
    around it once and the chunk loop ``chunks`` times. Returned as one ``Loop`` with those counts (its
    ``start``/``end`` the enclosing loop's); the chunk loop itself where ptxas unrolled it (no loop around)."""
    inner = steady_loop(instrs)
    outer = [lp for lp in find_loops(instrs) if lp is not inner and lp.start <= inner.start and inner.end <= lp.end]
    if not outer:
        return inner
    key = min(outer, key=lambda lp: (lp.sass, lp.start))
    return Loop(key.start, key.end, key.sass + (chunks - 1) * inner.sass, key.mma + (chunks - 1) * inner.mma)


def iteration_flops(kind: str, block_m: int, block_n: int, block_d: int, block_dv: int | None = None) -> int:
    """Tensor FLOPs of one loop iteration over a ``block_m x block_n`` score tile at padded head dim ``block_d``
    (``block_dv``: V's, where it differs; the products with V or dO run over it).

    fwd and decode: ``S = Q K^T`` and ``P V``; dK/dV: ``S^T``, ``dP^T = V dO^T``, ``dV += P^T dO``, ``dK += dS^T Q``;
    dQ: ``S``, ``dP = dO V^T``, ``dQ += dS K``; fused (dK/dV's four and ``dQ_j = dS K``): 5. Each product
    is ``2 * m * n * d``.
    """
    # (products over the query's head dim, over V's)
    gemms = {"fwd": (1, 1), "decode": (1, 1), "bwd_dkdv": (2, 2), "bwd_dq": (2, 1), "bwd_fused": (3, 2),
             "bwd_fused_atomic": (3, 2)}[kind]
    return 2 * block_m * block_n * (gemms[0] * block_d + gemms[1] * (block_dv or block_d))


def tiling(v: Variant) -> tuple[int, int, int]:
    """``(block_m, block_n, num_warps)`` the launchers use for a variant (``block_n``: keys per iteration,
    the K tile; two blocks of the partition where ``FwdConfig.tile_n`` says so)."""
    consts, opts = _constants(v)
    return consts["BLOCK_M"], consts.get("TILE_N", consts.get("BLOCK_N", 0)), opts["num_warps"]


def resource_usage(cubin: bytes, path: str | None = None) -> dict[str, int]:
    """``{"regs", "stack", "local"}`` of a compiled kernel, read by ``cuobjdump --dump-resource-usage`` from its
    cubin (written to ``path``, kept there; a temporary file without one)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = path or os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        dump = subprocess.run([CUOBJDUMP, "--dump-resource-usage", path], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", dump))
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "local": int(fields["LOCAL"])}


def describe(v: Variant, cubin_dir: str | None = None) -> dict:
    """Compile ``v`` and report shared memory, registers, spills (cubin via cuobjdump), wgmma use and,
    for the gradient and forward kernels, the steady-state loop and its issue/tensor ratio ``R``.

    ``cubin_dir``: where to keep the cubin (``<variant>.cubin``; ``cubin`` in the result is its path).
    """
    t0 = time.perf_counter()
    kernel = compile_variant(v)
    seconds = time.perf_counter() - t0
    cubin = kernel.asm["cubin"]
    path = os.path.join(cubin_dir, v.name + ".cubin") if cubin_dir else None
    usage = resource_usage(cubin, path)
    block_m, block_n, warps = tiling(v)
    row = dict(variant=v.name, kernel=v.kind, d=v.head_dim, dv=v.value_dim or v.head_dim, dtype=_encode(v)["dtype"],
               causal=v.causal,
               mode=v.mode_name if v.kind in ("fwd", "decode") else None, stats=v.stats, cc=v.cc, block_m=block_m,
               block_n=block_n, warps=warps, shared=kernel.metadata.shared, limit=SHARED_LIMIT[v.cc],
               regs=usage["regs"], stack=usage["stack"], local=usage["local"],
               spill_bytes=usage["stack"] + usage["local"], wgmma="wgmma" in kernel.asm["ptx"],
               cubin_bytes=len(cubin), cubin=os.path.abspath(path) if cubin_dir else None, compile_s=seconds,
               loop_sass=None, loop_mma=None, mma_clk=None, issue_clk=None, R=None)
    looped = ("fwd", "bwd_dkdv", "bwd_dq", "bwd_fused", "bwd_fused_atomic", "decode")
    if v.kind in looped and v.dtype != torch.float32:  # fp32 runs no tensor cores
        consts, _ = _constants(v)
        chunks = -(-consts["HEAD_D"] // consts["BLOCK_D"])  # > 1: Q and K in column chunks (head dim 512)
        instrs = parse_sass(sass_of(cubin))
        loop = key_loop(instrs, chunks) if chunks > 1 else steady_loop(instrs)
        # the products over V's head dim run over this program's V block (split over programs at head dim 512)
        dv_cols = min(head_block(v.value_dim or v.head_dim), consts.get("BLOCK_DV", consts["BLOCK_D"]))
        mma_clk = iteration_flops(v.kind, block_m, block_n, head_block(v.head_dim), dv_cols) / TENSOR_FLOP_PER_CLK
        issue_clk = warps * loop.sass / ISSUE_PER_CLK
        row.update(loop_sass=loop.sass, loop_mma=loop.mma, mma_clk=mma_clk, issue_clk=issue_clk,
                   R=issue_clk / mma_clk)
    return row


def _encode(v: Variant) -> dict:
    d = asdict(v)
    d["dtype"] = {t: n for n, t in _DTYPE_NAMES.items()}[v.dtype]
    return d


def describe_in_subprocess(variants: list[Variant], cubin_dir: str | None = None) -> list[dict]:
    """:func:`describe` in a fresh interpreter without ``TRITON_INTERPRET``.

    Under the interpreter ``@triton.jit`` yields functions that cannot be compiled, and the flag is
    read at import time, so a process that runs the interpreted tests cannot also compile.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "stable_attn.kernels.triton_aot"],
                          input=json.dumps(dict(variants=[_encode(v) for v in variants], cubin_dir=cubin_dir)),
                          env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {[v.name for v in variants]} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _main() -> None:
    job = json.loads(sys.stdin.read())
    variants = [Variant(**dict(d, dtype=_DTYPE_NAMES[d["dtype"]])) for d in job["variants"]]
    print(json.dumps([describe(v, job["cubin_dir"]) for v in variants]))


if __name__ == "__main__":
    _main()
