"""Kernel speed of stable_attn's Triton attention against PyTorch SDPA (flash and cuDNN backends), one CUDA GPU.

Shapes: 16k tokens per batch (B = 16384 // N) and H * D = 2048, N in {1k, 4k, 16k}, D in {64, 128},
causal and not, plus one GQA shape (N=4k, D=128, causal, 16 query heads on 4 kv heads); bf16.
Implementations: SDPA with the flash backend, SDPA with the cuDNN backend (where this torch offers
it), and ``stable_attn.attention(backend="triton")`` with ``stabilize=False`` (plain FA2 in our
kernels), ``stabilize=True``, and ``stabilize=True`` with statistics on. Every implementation's
output and gradients are first checked against SDPA-flash (relative max error, :data:`TOLERANCE`);
one that fails is not timed and makes the script exit 1.

Timing: forward, backward (``torch.autograd.grad`` of a saved graph) and forward + backward. Each
measurement is ``iters`` back-to-back calls between two CUDA events (``iters`` calibrated so one
measurement lasts about ``--target-ms``), so a call's launch cost is hidden behind the previous
call's kernels as long as the CPU enqueues faster than the GPU computes. The CPU time to enqueue is
measured too: a measurement where it reaches :data:`LAUNCH_BOUND` of the GPU time is marked
``launch-bound`` (there the GPU time is an upper bound for the kernels). No CUDA graphs: the op
allocates its outputs and the statistics per call. Measurements run in interleaved rounds (every
implementation once per round, in a rotated order), and each cell is the median over rounds, so
clock and thermal drift hit all implementations alike. TFLOP/s count the visible (query, key)
pairs: forward ``4 * pairs * D`` per head, backward 2.5x that, forward + backward 3.5x.

Packed documents: per D, documents of random lengths (64 to 4096 tokens, fixed seed) that
fill the same 16k tokens, causal, bf16, stabilize=True, timed as ``stable_attn.attention_varlen`` on
the packed ``[total, H, D]`` tensors against ``stable_attn.attention`` on the same documents padded to
the longest one (``[docs, H, longest, D]`` with a key padding mask: what a padded batch costs). Both
count the same useful FLOPs (the visible pairs inside the documents); the varlen output and gradients
are first checked against the padded ones at the real tokens.

Decoding: one ``generate()`` step of one layer's attention, one query against a cache of 4k and 32k
keys, B in {1, 32}, 32 query heads on 8 KV heads, D = 128, bf16, no gradient: SDPA-flash (the KV heads repeated
once, outside the timing, as a GQA model's sdpa path hands them), and ``stable_attn.attention`` with
``stabilize=False`` and ``True``, which take the decode kernel (kernels/triton_decode.py: split keys). Reported as
ms per step and tokens/s (``B`` tokens per step; one layer's attention only), checked against SDPA-flash first;
they run after the main table (whose rows come first, also in benchmarks/gpu_check.sh's first step).

    python benchmarks/gpu_bench.py --json /tmp/gpu_bench.json
    python benchmarks/gpu_bench.py --decode-only --json /tmp/gpu_bench_decode.json
    python benchmarks/gpu_bench.py --n 4096 --d 128 --causal true --no-gqa --rounds 5
    python benchmarks/gpu_bench.py --varlen-only --json /tmp/gpu_bench_varlen.json

Needs torch >= 2.4 (torch.nn.attention.sdpa_kernel) and triton >= 3.4 (the backward's tensor
descriptors); the target stack is torch 2.11 / triton 3.6.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

TOKENS = 16384
WIDTH = 2048
IMPLS = ("sdpa_flash", "sdpa_cudnn", "stable_off", "stable_exact", "stable_exact_stats")
BASELINE = "sdpa_flash"
KINDS = ("fwd", "bwd", "fwd_bwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}  # FlashAttention's convention: bwd = 2.5x fwd
# max |x - x_sdpa| / max |x_sdpa| allowed for the output and for the gradients (bf16 inputs)
TOLERANCE = {"out": 2e-2, "grad": 5e-2}
LAUNCH_BOUND = 0.8  # CPU enqueue time / GPU time at which a measurement counts as launch-bound
PACKED_IMPLS = ("stable_padded", "stable_varlen")
DOC_LENGTHS = (64, 4096)  # range of the packed documents' lengths
DECODE_IMPLS = ("sdpa_flash", "stable_off", "stable_exact")


@dataclass(frozen=True)
class Shape:
    """One attention problem: batch, query heads, kv heads, sequence length, head dim, causal."""

    b: int
    hq: int
    hkv: int
    n: int
    d: int
    causal: bool

    @property
    def name(self) -> str:
        gqa = f" G={self.hq // self.hkv}" if self.hq != self.hkv else ""
        return f"N={self.n} D={self.d} {'causal' if self.causal else 'full'}{gqa} (B={self.b} H={self.hq})"


@dataclass(frozen=True)
class Decode:
    """One decoding step: ``b`` sequences, one query each (``nq``), against a cache of ``nk`` keys."""

    b: int
    nk: int
    hq: int = 32
    hkv: int = 8
    d: int = 128
    nq: int = 1

    @property
    def name(self) -> str:
        return f"decode B={self.b} cache={self.nk} Hq/Hkv={self.hq}/{self.hkv} D={self.d}"


def decode_shapes() -> list[Decode]:
    return [Decode(b, nk) for nk in (4096, 32768) for b in (1, 32)]


def shapes(ns: list[int], ds: list[int], causals: list[bool], gqa: bool) -> list[Shape]:
    """The benchmark's shapes at 16k tokens per batch and H * D = 2048, D=128 first."""
    out = [Shape(max(1, TOKENS // n), WIDTH // d, WIDTH // d, n, d, c)
           for d in sorted(ds, reverse=True) for c in sorted(causals, reverse=True) for n in ns]
    if gqa:
        out.append(Shape(TOKENS // 4096, WIDTH // 128, WIDTH // 128 // 4, 4096, 128, True))
    return out


@dataclass(frozen=True)
class Packed:
    """Documents packed into one sequence: their lengths, heads, head dim (causal, bf16)."""

    lengths: tuple[int, ...]
    hq: int
    hkv: int
    d: int
    causal: bool = True

    @property
    def name(self) -> str:
        return (f"{len(self.lengths)} docs, {sum(self.lengths)} tokens (longest {max(self.lengths)}) D={self.d} "
                f"{'causal' if self.causal else 'full'} H={self.hq}")


def doc_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Lengths drawn uniformly from [lo, hi] until they fill ``total`` tokens (the last one is cut to fit)."""
    rng = random.Random(seed)
    out: list[int] = []
    while sum(out) < total:
        out.append(min(rng.randint(lo, hi), total - sum(out)))
    return out


def packed_shapes(ds: list[int], seed: int = 0) -> list[Packed]:
    """One packed batch of :data:`TOKENS` tokens per head dim, H * D = :data:`WIDTH`."""
    return [Packed(tuple(doc_lengths(TOKENS, *DOC_LENGTHS, seed=seed + d)), WIDTH // d, WIDTH // d, d)
            for d in sorted(ds, reverse=True)]


def packed_flops(p: Packed, kind: str) -> float:
    """Useful FLOPs of one call: the visible pairs inside each document (the same for both layouts)."""
    pairs = sum(visible_pairs(n, n, p.causal) for n in p.lengths)
    return FLOP_FACTOR[kind] * 4.0 * p.hq * pairs * p.d


def visible_pairs(nq: int, nk: int, causal: bool) -> int:
    """(query, key) pairs a head computes; causal masks are aligned bottom-right (query i sees keys <= i + nk - nq)."""
    if not causal:
        return nq * nk
    shift = nk - nq
    # row i sees min(max(i + 1 + shift, 0), nk) keys: none before row i0, all from row i1 on
    i0 = min(max(0, -shift), nq)
    i1 = min(max(nk - 1 - shift, i0), nq)
    return sum_range(i0 + 1 + shift, i1 + shift) + (nq - i1) * nk


def sum_range(a: int, b: int) -> int:
    """a + (a+1) + ... + b."""
    return (a + b) * (b - a + 1) // 2 if b >= a else 0


def flops(shape: Shape, kind: str) -> float:
    """FLOPs of one call of ``kind`` (fwd, bwd, fwd_bwd) on ``shape``."""
    fwd = 4.0 * shape.b * shape.hq * visible_pairs(shape.n, shape.n, shape.causal) * shape.d
    return FLOP_FACTOR[kind] * fwd


def rel_error(got, want) -> float:
    """max |got - want| / max |want|, in float64."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


Timer = Callable[[Callable[[], object], int], "tuple[float, float]"]


def measure(fns: dict[str, dict[str, Callable[[], object]]], timer: Timer, iters: dict[tuple[str, str], int],
            rounds: int) -> dict[tuple[str, str], dict]:
    """Interleaved rounds: each round runs every (implementation, kind) once, implementations in an
    order rotated by one per round. ``timer(fn, iters)`` returns ``(gpu_ms, cpu_ms)`` per call.

    Returns, per (implementation, kind), the median GPU and CPU milliseconds over the rounds.
    """
    names = list(fns)
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {(i, k): [] for i in names for k in fns[i]}
    for r in range(rounds):
        for impl in names[r % len(names):] + names[:r % len(names)]:
            for kind, fn in fns[impl].items():
                samples[(impl, kind)].append(timer(fn, iters[(impl, kind)]))
    return {key: dict(ms=statistics.median(g for g, _ in s), cpu_ms=statistics.median(c for _, c in s))
            for key, s in samples.items()}


def rows_for(shape: Shape, timings: dict[tuple[str, str], dict], checks: dict[str, dict]) -> list[dict]:
    """One row per implementation: ms, TFLOP/s and launch-bound flag per kind, the SDPA check, speed ratios."""
    rows = []
    for impl, check in checks.items():
        row = dict(shape=asdict(shape), name=shape.name, impl=impl, **check)
        for kind in KINDS:
            t = timings.get((impl, kind))
            row[f"{kind}_ms"] = t["ms"] if t else None
            row[f"{kind}_tflops"] = flops(shape, kind) / t["ms"] * 1e-9 if t else None
            row[f"{kind}_launch_bound"] = bool(t and t["cpu_ms"] >= LAUNCH_BOUND * t["ms"])
        rows.append(row)
    by = {r["impl"]: r for r in rows}
    for r in rows:
        for base in ("sdpa_flash", "sdpa_cudnn"):
            b = by.get(base)
            for kind in KINDS:
                ok = b and b[f"{kind}_ms"] and r[f"{kind}_ms"]
                r[f"{kind}_speed_vs_{base}"] = b[f"{kind}_ms"] / r[f"{kind}_ms"] if ok else None
    return rows


def packed_rows(p: Packed, timings: dict[tuple[str, str], dict], checks: dict[str, dict]) -> list[dict]:
    """Rows of the packed comparison: ms, useful TFLOP/s, launch-bound flag per kind, varlen vs padded."""
    rows = []
    for impl, check in checks.items():
        row = dict(shape=asdict(p), name=p.name, impl=impl, **check)
        for kind in KINDS:
            t = timings.get((impl, kind))
            row[f"{kind}_ms"] = t["ms"] if t else None
            row[f"{kind}_tflops"] = packed_flops(p, kind) / t["ms"] * 1e-9 if t else None
            row[f"{kind}_launch_bound"] = bool(t and t["cpu_ms"] >= LAUNCH_BOUND * t["ms"])
        rows.append(row)
    base = next((r for r in rows if r["impl"] == "stable_padded"), None)
    for r in rows:
        for kind in KINDS:
            ok = base and base[f"{kind}_ms"] and r[f"{kind}_ms"]
            r[f"{kind}_speed_vs_padded"] = base[f"{kind}_ms"] / r[f"{kind}_ms"] if ok else None
    return rows


def packed_table(rows: list[dict]) -> str:
    """Markdown: per packed batch, padded attention() against attention_varlen (above 1x: varlen faster)."""
    out = ["| packed batch | impl | fwd ms | bwd ms | fwd+bwd ms | useful TFLOP/s fwd+bwd | fwd vs padded | "
           "fwd+bwd vs padded | check |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        flag = " (launch-bound)" if any(r[f"{k}_launch_bound"] for k in KINDS) else ""
        check = "ok" if r["ok"] else f"FAILED: {r['error']}"
        out.append(f"| {r['name']} | {r['impl']}{flag} | {_cell(r['fwd_ms'], '.3f')} | {_cell(r['bwd_ms'], '.3f')} | "
                   f"{_cell(r['fwd_bwd_ms'], '.3f')} | {_cell(r['fwd_bwd_tflops'], '.0f')} | "
                   f"{_cell(r['fwd_speed_vs_padded'], '.2f')}x | {_cell(r['fwd_bwd_speed_vs_padded'], '.2f')}x | "
                   f"{check} |")
    return "\n".join(out)


def _cell(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    """Markdown: per shape and implementation ms and TFLOP/s (fwd, bwd, fwd+bwd), speed vs SDPA-flash
    and cuDNN (fwd+bwd; above 1 is faster), then the cost of the fix and of the statistics."""
    out = ["| shape | impl | fwd ms | bwd ms | fwd+bwd ms | fwd+bwd TFLOP/s | vs flash | vs cuDNN | check |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        flag = " (launch-bound)" if any(r[f"{k}_launch_bound"] for k in KINDS) else ""
        check = "ok" if r["ok"] else f"FAILED: {r['error']}"
        out.append(f"| {r['name']} | {r['impl']}{flag} | {_cell(r['fwd_ms'], '.3f')} | {_cell(r['bwd_ms'], '.3f')} | "
                   f"{_cell(r['fwd_bwd_ms'], '.3f')} | {_cell(r['fwd_bwd_tflops'], '.0f')} | "
                   f"{_cell(r['fwd_bwd_speed_vs_sdpa_flash'], '.2f')}x | "
                   f"{_cell(r['fwd_bwd_speed_vs_sdpa_cudnn'], '.2f')}x | {check} |")
    out += ["", "| shape | fix: exact vs off, fwd+bwd | stats: exact+stats vs exact, fwd+bwd |", "|---|---:|---:|"]
    for name in dict.fromkeys(r["name"] for r in rows):
        t = {r["impl"]: r["fwd_bwd_ms"] for r in rows if r["name"] == name}
        fix = _pct(t.get("stable_exact"), t.get("stable_off"))
        st = _pct(t.get("stable_exact_stats"), t.get("stable_exact"))
        out.append(f"| {name} | {fix} | {st} |")
    return "\n".join(out)


def _pct(a, b) -> str:
    return "n/a" if not a or not b else f"{100 * (a / b - 1):+.1f}%"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--causal", type=_bool, nargs="+", default=[True, False])
    p.add_argument("--no-gqa", dest="gqa", action="store_false", help="skip the GQA shape")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-varlen", dest="varlen", action="store_false", help="skip the packed-documents rows")
    g.add_argument("--varlen-only", action="store_true", help="only the packed-documents rows")
    d = p.add_mutually_exclusive_group()
    d.add_argument("--no-decode", dest="decode", action="store_false", help="skip the decoding rows")
    d.add_argument("--decode-only", action="store_true", help="only the decoding rows")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median over them)")
    p.add_argument("--target-ms", type=float, default=25.0, help="length of one measurement")
    p.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "gpu_bench.json"))
    args = p.parse_args(argv)
    if BASELINE not in args.impls:
        p.error(f"--impls must include {BASELINE} (every result is checked against it)")
    if args.rounds < 1 or args.target_ms <= 0:
        p.error("--rounds must be >= 1 and --target-ms > 0")
    return args


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes"):
        return True
    if s.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


# ---------------------------------------------------------------- GPU part (imports torch lazily)

def cuda_timer(fn: Callable[[], object], iters: int) -> tuple[float, float]:
    """``iters`` back-to-back calls between CUDA events: (GPU ms, CPU enqueue ms) per call."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    cpu = (time.perf_counter() - t0) * 1e3
    end.synchronize()
    return start.elapsed_time(end) / iters, cpu / iters


def implementations(names: list[str]) -> dict[str, Callable]:
    """name -> f(q, k, v, causal) returning the attention output ([B, H, N, D])."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import stable_attn

    def sdpa(backend):
        def run(q, k, v, causal):
            if k.shape[1] != q.shape[1]:  # SDPA gets the kv heads repeated (same FLOPs as MHA)
                k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    def ours(stabilize, with_stats):
        stats = stable_attn.AttentionStats() if with_stats else None

        def run(q, k, v, causal):
            return stable_attn.attention(q, k, v, causal=causal, stabilize=stabilize, stats=stats, backend="triton")
        return run

    table_ = {"sdpa_flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION),
              "sdpa_cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION) if hasattr(SDPBackend, "CUDNN_ATTENTION")
              else None,
              "stable_off": lambda: ours(False, False), "stable_exact": lambda: ours(True, False),
              "stable_exact_stats": lambda: ours(True, True)}
    return {n: table_[n]() for n in names}


def _time(fns: dict, rounds: int, target_ms: float, timer: Timer) -> dict[tuple[str, str], dict]:
    """Calibrate ``iters`` per (implementation, kind) from one call (also the warm-up), then measure."""
    iters = {}
    for name, kinds in fns.items():
        for kind, f in kinds.items():
            once, _ = timer(f, 1)
            iters[(name, kind)] = max(2, min(1000, math.ceil(target_ms / max(once, 1e-3))))
    return measure(fns, timer, iters, rounds)


def run_packed(p: Packed, rounds: int, target_ms: float, *, device: str = "cuda", timer: Timer = cuda_timer
               ) -> list[dict]:
    """attention_varlen on the packed documents against attention() on them padded: check, then time."""
    import torch

    import stable_attn

    torch.manual_seed(0)
    dt, total, nmax, docs = torch.bfloat16, sum(p.lengths), max(p.lengths), len(p.lengths)
    lens = torch.tensor(p.lengths)
    cu = torch.zeros(docs + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    cu = cu.to(device)
    # the padded layout: document b's token i at [b, :, i]; valid[b, i] marks the real tokens
    valid = torch.arange(nmax)[None, :] < lens[:, None]
    where = tuple(w.to(device) for w in valid.nonzero(as_tuple=True))
    leaves = {}
    for name, heads in (("q", p.hq), ("k", p.hkv), ("v", p.hkv)):
        x = torch.randn(total, heads, p.d, device=device, dtype=dt)
        pad = torch.zeros(docs, nmax, heads, p.d, device=device, dtype=dt)
        pad[where] = x
        leaves[name] = x.requires_grad_()
        leaves[name + "_pad"] = pad.transpose(1, 2).contiguous().requires_grad_()
    do = torch.randn(total, p.hq, p.d, device=device, dtype=dt)
    do_pad = torch.zeros(docs, nmax, p.hq, p.d, device=device, dtype=dt)
    do_pad[where] = do
    do_pad = do_pad.transpose(1, 2).contiguous()
    kpm = valid.to(device)

    def padded():
        return stable_attn.attention(leaves["q_pad"], leaves["k_pad"], leaves["v_pad"], causal=p.causal,
                                     key_padding_mask=kpm, backend="triton")

    def varlen():
        return stable_attn.attention_varlen(leaves["q"], leaves["k"], leaves["v"], cu, cu, nmax, nmax,
                                            causal=p.causal, backend="triton")

    runs = {"stable_padded": (padded, ("q_pad", "k_pad", "v_pad"), do_pad),
            "stable_varlen": (varlen, ("q", "k", "v"), do)}
    checks, fns, results = {}, {}, {}
    for name, (fn, args, grad_out) in runs.items():
        try:
            out = fn()
            grads = torch.autograd.grad(out, [leaves[a] for a in args], grad_out)
        except Exception as e:  # noqa: BLE001  reported, not timed
            checks[name] = dict(ok=False, error=str(e).splitlines()[0][:120], out_err=None, grad_err=None)
            continue
        if name == "stable_padded":  # to the packed layout, at the real tokens
            out = out.transpose(1, 2)[where]
            grads = [g.transpose(1, 2)[where] for g in grads]
        results[name] = (out.detach(), grads)
        checks[name] = dict(ok=True, error=None, out_err=None, grad_err=None)
        saved = fn()
        ins = [leaves[a] for a in args]
        fns[name] = {
            "fwd": fn,
            "bwd": lambda saved=saved, ins=ins, g=grad_out: torch.autograd.grad(saved, ins, g, retain_graph=True),
            "fwd_bwd": lambda fn=fn, ins=ins, g=grad_out: torch.autograd.grad(fn(), ins, g),
        }
    if len(results) == 2:  # varlen against padded; padded against itself is 0
        (o_ref, g_ref), (o, g) = results["stable_padded"], results["stable_varlen"]
        out_err, grad_err = rel_error(o, o_ref), max(rel_error(a, b) for a, b in zip(g, g_ref))
        ok = out_err <= TOLERANCE["out"] and grad_err <= TOLERANCE["grad"]
        checks["stable_padded"].update(out_err=0.0, grad_err=0.0)
        checks["stable_varlen"] = dict(ok=ok, error=None if ok else f"vs padded: rel err out {out_err:.2e}, "
                                       f"grads {grad_err:.2e}", out_err=out_err, grad_err=grad_err)
        if not ok:
            del fns["stable_varlen"]
    rows = packed_rows(p, _time(fns, rounds, target_ms, timer), checks)
    fns.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_shape(shape: Shape, impls: dict[str, Callable | None], rounds: int, target_ms: float, *,
              device: str = "cuda", timer: Timer = cuda_timer) -> list[dict]:
    """Check every implementation against SDPA-flash on ``shape``, then time the ones that passed.

    ``device`` and ``timer`` exist for the CPU test of this bookkeeping; the benchmark uses CUDA.
    """
    import torch

    torch.manual_seed(0)
    dev, dt = device, torch.bfloat16
    q = torch.randn(shape.b, shape.hq, shape.n, shape.d, device=dev, dtype=dt, requires_grad=True)
    k, v = (torch.randn(shape.b, shape.hkv, shape.n, shape.d, device=dev, dtype=dt, requires_grad=True)
            for _ in range(2))
    do = torch.randn_like(q)
    checks, fns, ref = {}, {}, None
    for name, fn in impls.items():
        if fn is None:
            checks[name] = dict(ok=False, error="not offered by this torch", out_err=None, grad_err=None)
            continue
        try:
            out = fn(q, k, v, shape.causal)
            grads = torch.autograd.grad(out, (q, k, v), do)
        except Exception as e:  # noqa: BLE001  e.g. a backend that does not take this shape: reported, not timed
            checks[name] = dict(ok=False, error=str(e).splitlines()[0][:120], out_err=None, grad_err=None)
            continue
        if ref is None:  # the baseline runs first
            ref = (out.detach(), grads)
        out_err = rel_error(out, ref[0])
        grad_err = max(rel_error(g, r) for g, r in zip(grads, ref[1]))
        ok = out_err <= TOLERANCE["out"] and grad_err <= TOLERANCE["grad"]
        checks[name] = dict(ok=ok, error=None if ok else f"rel err out {out_err:.2e}, grads {grad_err:.2e}",
                            out_err=out_err, grad_err=grad_err)
        if ok:
            saved = fn(q, k, v, shape.causal)
            fns[name] = {
                "fwd": lambda fn=fn: fn(q, k, v, shape.causal),
                "bwd": lambda saved=saved: torch.autograd.grad(saved, (q, k, v), do, retain_graph=True),
                "fwd_bwd": lambda fn=fn: torch.autograd.grad(fn(q, k, v, shape.causal), (q, k, v), do),
            }
        del out, grads
    rows = rows_for(shape, _time(fns, rounds, target_ms, timer), checks)
    fns.clear()  # the saved graphs, before the next shape allocates
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_decode(shape: Decode, rounds: int, target_ms: float, *, device: str = "cuda", timer: Timer = cuda_timer,
               impls: tuple[str, ...] = DECODE_IMPLS) -> list[dict]:
    """One decoding step (no gradient): each implementation checked against SDPA-flash, then timed."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import stable_attn

    torch.manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(shape.b, shape.hq, shape.nq, shape.d, device=device, dtype=dt)
    k, v = (torch.randn(shape.b, shape.hkv, shape.nk, shape.d, device=device, dtype=dt) for _ in range(2))
    g = shape.hq // shape.hkv
    k_rep, v_rep = (x.repeat_interleave(g, dim=1) for x in (k, v))  # outside the timing

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=False)

    def ours(stabilize):
        return lambda: stable_attn.attention(q, k, v, stabilize=stabilize, backend="triton")

    table_ = {"sdpa_flash": sdpa, "stable_off": ours(False), "stable_exact": ours(True)}
    checks, fns, ref = {}, {}, None
    with torch.no_grad():
        for name in impls:
            try:
                out = table_[name]()
            except Exception as e:  # noqa: BLE001  reported, not timed
                checks[name] = dict(ok=False, error=str(e).splitlines()[0][:120], out_err=None)
                continue
            ref = out if ref is None else ref
            err = rel_error(out, ref)
            ok = err <= TOLERANCE["out"]
            checks[name] = dict(ok=ok, error=None if ok else f"rel err out {err:.2e}", out_err=err)
            if ok:
                fns[name] = {"fwd": table_[name]}
        timings = _time(fns, rounds, target_ms, timer)
    rows = []
    base = timings.get((BASELINE, "fwd"), {}).get("ms")
    for name in impls:
        t = timings.get((name, "fwd"))
        ms = t["ms"] if t else None
        rows.append(dict(name=shape.name, impl=name, **asdict(shape), **checks[name], ms=ms,
                         tokens_per_s=shape.b * shape.nq / (ms / 1e3) if ms else None,
                         speed_vs_sdpa_flash=base / ms if ms and base else None,
                         launch_bound=bool(t and t["cpu_ms"] >= LAUNCH_BOUND * t["ms"])))
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def decode_table(rows: list[dict]) -> str:
    """Markdown: per decoding shape and implementation, ms per step, tokens/s and speed vs SDPA-flash."""
    out = ["| decoding step (one layer) | impl | ms | tokens/s | vs flash | check |", "|---|---|---|---|---|---|"]
    for r in rows:
        flag = " (launch-bound)" if r["launch_bound"] else ""
        out.append(f"| {r['name']} | {r['impl']} | {_cell(r['ms'], '.4f')}{flag} | {_cell(r['tokens_per_s'], '.0f')} "
                   f"| {_cell(r['speed_vs_sdpa_flash'], '.2f')}x | {'ok' if r['ok'] else r['error']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import triton

    if not torch.cuda.is_available():
        print("gpu_bench.py needs a CUDA GPU; on a CPU machine use benchmarks/kernel_resources.py", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    machine = (f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
               f"CUDA {torch.version.cuda} | python {platform.python_version()}")
    print(machine, flush=True)
    rows: list[dict] = []
    packed: list[dict] = []
    decode: list[dict] = []
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)

    def save():
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "command": " ".join(sys.argv), "rows": rows, "packed_rows": packed,
                       "decode_rows": decode}, f, indent=1)

    only_other = args.varlen_only or args.decode_only
    for shape in ([] if only_other else shapes(args.n, args.d, args.causal, args.gqa)):
        t0 = time.perf_counter()
        # fresh per shape: an AttentionStats keeps per-head totals, and the head count changes
        new = run_shape(shape, implementations(args.impls), args.rounds, args.target_ms)
        rows += new
        for r in new:  # progress, so a time-out still leaves every finished shape
            print(f"{r['name']:>40} {r['impl']:>19}  fwd {_cell(r['fwd_ms'], '8.3f')}  bwd {_cell(r['bwd_ms'], '8.3f')}"
                  f"  fwd+bwd {_cell(r['fwd_bwd_ms'], '8.3f')} ms  {_cell(r['fwd_bwd_tflops'], '4.0f')} TFLOP/s  "
                  f"{'ok' if r['ok'] else r['error']}", flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        save()
    for shape in (decode_shapes() if args.decode and not args.varlen_only else []):  # after the table: short rows
        new = run_decode(shape, args.rounds, args.target_ms)
        decode += new
        for r in new:
            print(f"{r['name']:>50} {r['impl']:>14}  {_cell(r['ms'], '8.4f')} ms  {_cell(r['tokens_per_s'], '8.0f')} "
                  f"tokens/s  {'ok' if r['ok'] else r['error']}", flush=True)
        save()
    for p in (packed_shapes(args.d) if args.varlen and not args.decode_only else []):
        t0 = time.perf_counter()
        new = run_packed(p, args.rounds, args.target_ms)
        packed += new
        for r in new:
            print(f"{r['name']:>60} {r['impl']:>14}  fwd {_cell(r['fwd_ms'], '8.3f')}  bwd {_cell(r['bwd_ms'], '8.3f')}"
                  f"  fwd+bwd {_cell(r['fwd_bwd_ms'], '8.3f')} ms  {'ok' if r['ok'] else r['error']}", flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        save()
    print()
    if rows:
        print(table(rows))
    if packed:
        print(packed_table(packed))
    if decode:
        print(decode_table(decode))
    print(f"wrote {args.json}")
    # a failed check is an error; an implementation this torch does not offer is not
    return 1 if any(not r["ok"] and r["error"] != "not offered by this torch" for r in rows + packed + decode) else 0


if __name__ == "__main__":
    sys.exit(main())
