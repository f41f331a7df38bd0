"""Two gloo processes run ring_loop's recovery with only rank 1's ring files damaged, once per case; each rank
writes ``<case>/rank<r>.json`` (rollbacks, whether it stopped, its recovery alerts' messages, a digest of its final
weights). Both ranks see the same data, so they stay replicas.

    python ring_ddp_run.py OUT_DIR "rank 1 bad newest" "rank 1 bad all"
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed_helpers import all_gather, digest, shutdown, write_results

# ring_loop (and so stable_attn) is imported in the ranks only: the parent just spawns them.


def damage_for(case: str):
    from ring_loop import rewrite, truncate, wrong_shape

    def damage(loop) -> None:
        if loop.rank != 1:
            return
        rewrite(loop.file(4), wrong_shape)
        if case == "rank 1 bad all":
            truncate(loop.file(2))
    return damage


def rank_main(rank: int, out: str, cases: list[str]) -> None:
    from ring_loop import RingLoop

    from stable_attn.monitor.engine import World

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank, world_size=2)
    try:
        for case in cases:
            folder = os.path.join(out, case.replace(" ", "_"))
            loop = RingLoop(os.path.join(folder, "logs"), World(rank=rank, size=2, all_gather=all_gather))
            loop.run(damage=damage_for(case))
            result = {"rollbacks": [list(r) for r in loop.engine.rollbacks],
                      "stopped": loop.ends[-1].stop_checkpoint is not None,
                      "alerts": [a.message for a in loop.alerts if a.kind == "recovery"],
                      "final": digest(loop.model)}
            loop.engine.end_run("at the end of the test")
            write_results(folder, rank, result)
        shutdown()  # both ranks done: leave together (gloo's threads torn down at exit could abort a rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1], sys.argv[2:]), nprocs=2, join=True)
