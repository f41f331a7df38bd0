"""CPU benchmark: packed documents through ``attention_varlen`` against padding them for ``attention()``.

    python benchmarks/varlen.py [--repeats 3] [--tokens 1024] [--json out.json]

The same documents (the same total tokens, the same q/k/v values) two ways, side by side in one run:
``varlen``: the documents packed into ``[total, H, D]`` with ``cu_seqlens``, one
:func:`stable_attn.attention_varlen` call; ``padded``: each document one batch row padded to the longest,
``[n_docs, H, max_len, D]`` with a ``key_padding_mask``, one :func:`stable_attn.attention` call. Both
causal, H=8, D=64, bf16, on the PyTorch path (the CPU backend). Document lengths come from a fixed
seed in three mixes (equal, uniform, one long document among short ones). Reports the CPU time
(``time.process_time``: on a shared machine it moves less with the load than wall time, which is
printed beside) of the forward, the backward and forward+backward, median of ``--repeats`` rounds
after one warm-up, the two layouts' rounds interleaved; ``--threads`` torch threads (default 1); and
the padded layout's share of padding tokens. Before timing, the two outputs at real tokens are checked to agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_model  # noqa: E402

import stable_attn  # noqa: E402

H, D = 8, 64


def lengths(mix: str, tokens: int, seed: int = 0) -> list[int]:
    """Document lengths summing to ``tokens``."""
    g = torch.Generator().manual_seed(seed)
    if mix == "equal":
        n = 8
        return [tokens // n] * (n - 1) + [tokens - (n - 1) * (tokens // n)]
    if mix == "uniform":  # lengths uniform in [tokens/64, tokens/4]
        out: list[int] = []
        while sum(out) < tokens:
            out.append(int(torch.randint(tokens // 64, tokens // 4 + 1, (), generator=g)))
        out[-1] -= sum(out) - tokens
        return [n for n in out if n > 0]
    if mix == "one_long":  # half the tokens in one document, the rest in documents of tokens/32
        short = tokens // 32
        rest = tokens - tokens // 2
        return [tokens // 2] + [short] * (rest // short) + ([rest % short] if rest % short else [])
    raise ValueError(f"mix={mix!r}: use equal, uniform or one_long")


def _inputs(lens: list[int], seed: int = 1):
    total = sum(lens)
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(total, H, D, generator=g).to(torch.bfloat16) for _ in range(4))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, do, cu


def _pad(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """[total, H, D] -> [n_docs, H, max_len, D], zeros after each document."""
    out = x.new_zeros(len(lens), max(lens), H, D)
    start = 0
    for b, n in enumerate(lens):
        out[b, :n] = x[start:start + n]
        start += n
    return out.transpose(1, 2).contiguous()


def _unpad(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    return torch.cat([x[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)])


def problem(impl: str, lens: list[int]):
    """``(fn, inputs, do)``: fn(*inputs) -> out, with inputs as the implementation takes them."""
    q, k, v, do, cu = _inputs(lens)
    if impl == "varlen":
        m = max(lens)

        def fn(q, k, v):
            return stable_attn.attention_varlen(q, k, v, cu, cu, m, m, causal=True, backend="torch")

        return fn, (q, k, v), do
    if impl == "padded":
        mask = torch.zeros(len(lens), max(lens), dtype=torch.bool)
        for b, n in enumerate(lens):
            mask[b, :n] = True

        def fn(q, k, v):
            return stable_attn.attention(q, k, v, causal=True, key_padding_mask=mask, backend="torch")

        return fn, tuple(_pad(t, lens) for t in (q, k, v)), _pad(do, lens)
    raise ValueError(impl)


def check_agree(lens: list[int]) -> float:
    fv, iv, _ = problem("varlen", lens)
    fp, ip, _ = problem("padded", lens)
    with torch.no_grad():
        a = fv(*iv).float()
        b = _unpad(fp(*ip), lens).float()
    return (a - b).abs().max().item()


def one_round(fn, inputs, do) -> tuple[float, ...]:
    """CPU seconds of a no-grad forward, of the backward after a forward with autograd, of that forward +
    backward, and the wall seconds of the latter."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    c0 = time.process_time()
    with torch.no_grad():
        fn(*leaves)
    c1, w1 = time.process_time(), time.perf_counter()
    out = fn(*leaves)
    c2 = time.process_time()
    out.backward(do)
    c3, w3 = time.process_time(), time.perf_counter()
    return c1 - c0, c3 - c2, c3 - c1, w3 - w1


KEYS = ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_bwd_wall_ms")


def time_cells(lens: list[int], repeats: int) -> dict[str, dict[str, float]]:
    """Both layouts, their rounds interleaved so that a change of machine load hits both alike."""
    problems = {impl: problem(impl, lens) for impl in ("varlen", "padded")}
    times: dict[str, list[tuple[float, ...]]] = {impl: [] for impl in problems}
    for i in range(repeats + 1):
        for impl, (fn, inputs, do) in problems.items():
            t = one_round(fn, inputs, do)
            if i:  # the first round is the warm-up
                times[impl].append(t)
    return {impl: {key: 1e3 * statistics.median(t[j] for t in ts) for j, key in enumerate(KEYS)}
            for impl, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--mixes", nargs="+", default=["equal", "uniform", "one_long"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    print(f"{cpu_model()}, torch {torch.__version__}, threads {torch.get_num_threads()}; "
          f"{args.tokens} tokens, H={H} D={D} bf16 causal, PyTorch path; CPU ms (process time), median of "
          f"{args.repeats} interleaved rounds; wall ms of fwd+bwd beside")
    rows = []
    for mix in args.mixes:
        lens = lengths(mix, args.tokens)
        diff = check_agree(lens)
        if diff > 2.0**-7:  # a few bf16 ulps at |out| ~ 1: both paths round the same values
            raise SystemExit(f"{mix}: varlen and padded outputs differ by {diff:.3g}")
        pad_share = 1 - sum(lens) / (len(lens) * max(lens))
        for impl, cell in time_cells(lens, args.repeats).items():
            rows.append({"mix": mix, "docs": len(lens), "max_len": max(lens), "padding": pad_share, "impl": impl,
                         **cell})
    header = (f"{'mix':<9} {'docs':>5} {'max len':>8} {'padding':>8} {'impl':<7} {'fwd ms':>8} {'bwd ms':>8} "
              f"{'fwd+bwd ms':>11} {'x padded':>9} {'wall ms':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        base = next(x for x in rows if x["mix"] == r["mix"] and x["impl"] == "padded")
        r["time_vs_padded"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"]
        print(f"{r['mix']:<9} {r['docs']:>5} {r['max_len']:>8} {r['padding']:>8.0%} {r['impl']:<7} {r['fwd_ms']:>8.1f} "
              f"{r['bwd_ms']:>8.1f} {r['fwd_bwd_ms']:>11.1f} {r['time_vs_padded']:>9.2f} {r['fwd_bwd_wall_ms']:>8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
