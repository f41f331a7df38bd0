"""Two-process check of total_grad_norm on FSDP2-sharded gradients (DTensor), CPU and gloo.

Run by test_grad_norm.py as ``python fsdp_grad_norm_run.py RANK WORLD PORT OUT``. Each rank
computes the gradient norm of a ``fully_shard``-ed model (each rank holds a shard of every gradient)
and, for reference, the norm of the same averaged gradients computed without sharding, from both
ranks' batches, on one unsharded copy.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from distributed_helpers import shutdown, write_results


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 7))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(16, 24, generator=g), torch.randint(0, 7, (16,), generator=g)


def main(out: str) -> None:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: distributed_helpers.run_ranks
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard

    from stable_attn.monitor.grad_norm import total_grad_norm

    sharded = model()
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(sharded)
    x, y = batch(rank)
    torch.nn.functional.cross_entropy(sharded(x), y).backward()
    grads_are_dtensors = all(type(p.grad).__name__ == "DTensor" for p in sharded.parameters())
    local_elems = sum(p.grad.to_local().numel() for p in sharded.parameters())
    norm = float(total_grad_norm(sharded.parameters()))
    # what a norm over the local shards alone would say (each rank sees part of each gradient)
    shard_only = float(torch.linalg.vector_norm(torch.stack([p.grad.to_local().norm() for p in sharded.parameters()])))

    reference = model()  # the same initial weights, unsharded; FSDP averages gradients over ranks
    for r in range(world):
        xr, yr = batch(r)
        (torch.nn.functional.cross_entropy(reference(xr), yr) / world).backward()
    expected = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])))
    full_elems = sum(p.numel() for p in reference.parameters())
    write_results(out, rank, {"norm": norm, "expected": expected, "shard_only": shard_only,
                              "dtensor": grads_are_dtensors, "local_elems": local_elems, "full_elems": full_elems})
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
