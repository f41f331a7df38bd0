"""Makespan of the causal grids in three launch orders: a simulation, no GPU.

    python benchmarks/causal_order.py [--sms 132] [--per-sm 1] [--overhead 1.0]

A causal grid's programs do unequal work: the forward's (and dQ's) query block ``m`` walks the key tiles up to
the diagonal, ``ceil((m + 1) * BLOCK_M / BLOCK_N)`` of them; dK/dV's key block ``n`` walks the query tiles from
the diagonal to the end. The GPU's block scheduler hands programs to SMs in launch order (``program_id(0)``
fastest, then 1, then 2) as slots free up, so the order decides how ragged the end of the launch is. Each
program's cost here is its tile count plus ``--overhead`` tiles (loading its Q or K/V block, the epilogue); an SM
runs ``--per-sm`` programs at a time (1: the forward's and backward's sm_90 tiles take most of the shared memory);
the makespan is list scheduling in launch order onto ``--sms`` SMs (132: H100 SXM). Orders:

- ``natural``: query (key) block fastest: within each head, the blocks in index order (what the kernels did);
- ``heavy-first``: the same grid, each head's blocks longest first (the kernels' ``program_id(0)`` reversed: the
  forward and dQ reverse it, dK/dV's natural order already is longest first);
- ``global``: the longest blocks of every head before any shorter one (FlashAttention-3's scheduler; in Triton a
  remap of all three program ids).

Printed: the makespan of each order relative to a perfect split of the total work over the SMs (the lower bound,
1.000), and the loss of ``natural`` against ``heavy-first``. Tiles: sm_90, D = 128 (triton_launch.fwd_config /
bwd_config): forward 128 x 128; dQ 128 queries x 64 keys; dK/dV 128 keys x 32 queries. A model, not a
measurement: real programs differ by more than their tile counts (the diagonal tile is masked, the memory system
is shared).
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys

# (name, rows per program, tile step along the other axis, the program walks keys up to the diagonal (forward,
# dQ) or queries from it (dK/dV))
KERNELS = (("forward", 128, 128, "to"), ("dQ", 128, 64, "to"), ("dK/dV", 128, 32, "from"))
SHAPES = ((1, 16, 16384), (1, 32, 16384), (2, 16, 8192), (4, 16, 4096), (8, 16, 2048), (16, 16, 1024),
          (1, 16, 32768), (4, 32, 8192))  # (batch, heads, N), N queries = N keys


def program_cost(block: int, rows: int, step: int, n: int, walk: str, overhead: float) -> float:
    """Tiles one program walks (plus the fixed overhead): causal, Nq = Nk = n."""
    lo, hi = block * rows, min(n, (block + 1) * rows)
    tiles = math.ceil(hi / step) if walk == "to" else math.ceil((n - lo) / step)
    return tiles + overhead


def orders(batch: int, heads: int, blocks: int, costs: list[float], heavy_index: list[int]) -> dict[str, list]:
    """The programs' costs in each launch order. ``heavy_index``: the block indices longest first."""
    natural = [costs[m] for _ in range(batch * heads) for m in range(blocks)]
    heavy = [costs[m] for _ in range(batch * heads) for m in heavy_index]
    glob = [costs[m] for m in heavy_index for _ in range(batch * heads)]
    return {"natural": natural, "heavy-first": heavy, "global": glob}


def makespan(costs: list[float], slots: int) -> float:
    """List scheduling in launch order: each program starts on the first slot to free up."""
    free = [0.0] * slots
    for c in costs:
        t = heapq.heappop(free)
        heapq.heappush(free, t + c)
    return max(free)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--per-sm", type=int, default=1)
    parser.add_argument("--overhead", type=float, default=1.0)
    args = parser.parse_args(argv)
    slots = args.sms * args.per_sm
    print(f"causal makespan / (total work / SMs): {args.sms} SMs x {args.per_sm} program(s), program cost = tiles "
          f"+ {args.overhead:g}")
    print(f"{'kernel':<8} {'B x H x N':<16} {'programs':>8} {'natural':>8} {'heavy-first':>11} {'global':>7} "
          f"{'natural loses':>13}")
    for name, rows, step, walk in KERNELS:
        for batch, heads, n in SHAPES:
            blocks = math.ceil(n / rows)
            costs = [program_cost(m, rows, step, n, walk, args.overhead) for m in range(blocks)]
            heavy_index = sorted(range(blocks), key=lambda m: -costs[m])
            bound = sum(costs) * batch * heads / slots
            spans = {k: makespan(v, slots) / bound for k, v in orders(batch, heads, blocks, costs, heavy_index).items()}
            loss = spans["natural"] / spans["heavy-first"] - 1
            print(f"{name:<8} {f'{batch} x {heads} x {n}':<16} {blocks * batch * heads:>8} {spans['natural']:>8.3f} "
                  f"{spans['heavy-first']:>11.3f} {spans['global']:>7.3f} {100 * loss:>12.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
