"""Two CPU processes (gloo) that train the tiny GPT-2 in a hand-written loop driven by StableAttentionGuard, once
per case, with the faults of sharded_run.py that only rank 1 sees: a corrupted batch at BAD (a loss spike), a NaN
loss at NAN_LOSS, one NaN gradient element at NAN_GRAD (after the gradients were reduced).

A case is ``STRATEGY:ACTION``: ``fsdp`` shards with ``fully_shard`` per GPT-2 block and on the model (FSDP2, a
1-D device mesh over both ranks), ``ddp`` replicates with ``DistributedDataParallel``; ``ACTION`` is an
``on_spike`` value, ``recover-disk`` (the ring in files) or ``stop-resume`` (stop, save the stop checkpoint with
``torch.distributed.checkpoint``, each rank its own shards, then a second loop resumed from it) or
``stop-damaged`` (rank 1's shard file of that checkpoint removed, then every rank tries to load it).

Run by test_plain_loop.py as ``python plain_run.py WEIGHTS OUT_DIR CASE [CASE ...]`` in two processes it starts
itself (distributed_helpers.run_ranks). Each rank writes ``OUT_DIR/rank{r}.json``
(per case: what it saw and did), rank 0 ``OUT_DIR/<case>.pt`` (the full weights).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from callback_lm import TemperatureGPT as Net
from callback_lm import batches_loader
from distributed_helpers import (
    ACTION_OPTIONS,
    BAD,
    NAN_GRAD,
    NAN_LOSS,
    RANK_OFFSET,
    STEPS,
    case_file,
    digest,
    full_state,
    is_dtensor,
    local,
    local_elems,
    shutdown,
    write_results,
)

from stable_attn.callbacks import StableAttentionGuard

ACTION_OPTIONS = dict(ACTION_OPTIONS, recover=dict(ACTION_OPTIONS["recover"], lr_factor=0.5, lr_steps=3))
ACTION_OPTIONS["recover-disk"] = dict(ACTION_OPTIONS["recover"], snapshot_memory_limit=0)
ACTION_OPTIONS["stop-resume"] = {}
ACTION_OPTIONS["stop-damaged"] = {}


def build(strategy: str, weights: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    net = Net(weights)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in net.gpt.transformer.h:
            fully_shard(block, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    return model, net, opt, sched


def save_stop(path: str, model: torch.nn.Module, opt, sched, guard: StableAttentionGuard) -> None:
    """The stop checkpoint: model and optimizer with torch.distributed.checkpoint (each rank writes its own shards),
    the scheduler and the guard's state (the same on every rank) beside them, written by rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    if dist.get_rank() == 0:
        torch.save({"scheduler": sched.state_dict(), "guard": guard.state_dict()}, os.path.join(path, "loop.pt"))
    dist.barrier()


def load_stop(path: str, model: torch.nn.Module, opt, sched, guard: StableAttentionGuard) -> None:
    """Read into copies, then load: ``dcp.load`` reads in place, and a read that fails on any rank (every rank
    raises together) would otherwise leave the shards already read in the live model: a partial restore."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.utils._pytree import tree_map

    copies = tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, get_state_dict(model, opt))
    state = {"model": copies[0], "optim": copies[1]}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rest = torch.load(os.path.join(path, "loop.pt"), weights_only=True)
    sched.load_state_dict(rest["scheduler"])
    guard.load_state_dict(rest["guard"])


def train(case: str, weights: str, out: str, name: str, resume: str | None = None) -> dict:
    strategy, action = case.split(":")
    rank = dist.get_rank()
    model, net, opt, sched = build(strategy, weights)
    guard = StableAttentionGuard(on_spike=action.split("-")[0], log_every_n_steps=1, **ACTION_OPTIONS[action])
    if resume is not None:
        load_stop(resume, model, opt, sched, guard)
    log_dir = os.path.join(out, name)
    guard.setup(model, opt, [sched], log_dir=log_dir)
    first = RANK_OFFSET * rank
    start = guard.start_step
    loader = batches_loader(range(first + start, first + STEPS), corrupt_batches=[first + BAD] if rank == 1 else [])
    seen = {"before": {}, "after": {}, "grad_norm": {}, "rows": {}, "lr": {}, "indices": {}, "scaled": []}
    step = start
    try:
        for step, batch in enumerate(guard.batches(loader, start=start), start=start):
            guard.begin_step(step)
            seen["before"][step] = digest(model)
            loss = model(batch)
            if rank == 1 and step == NAN_LOSS:
                loss = loss * float("nan")
            guard.add_loss(loss)
            loss.backward()
            if rank == 1 and step == NAN_GRAD:  # after the reduction: rank 1's own gradient goes bad
                local(net.gpt.transformer.wte.weight.grad).view(-1)[0] = float("nan")
            layers = guard.layers
            if layers is not None and all(s.rows is not None for s in layers.stats.values()):
                seen["rows"][step] = [int(s.rows.sum()) for s in layers.stats.values()]
            decision = guard.before_optimizer_step()
            if decision.apply:
                seen["lr"][step] = opt.param_groups[0]["lr"]
                if "LrScale" in getattr(opt.step, "__qualname__", ""):  # a recovery's lr_factor scales this step
                    seen["scaled"].append(step)
                opt.step()
            opt.zero_grad()
            sched.step()
            end = guard.end_step()
            seen["indices"][step] = guard.engine.data_position["batch_index"]
            seen["after"][step] = digest(model)
            if end.metrics is not None and "train/grad_norm" in end.metrics:
                seen["grad_norm"][step] = end.metrics["train/grad_norm"]
            if end.stop_checkpoint is not None:
                save_stop(end.stop_checkpoint, model, opt, sched, guard)
                break
    finally:
        guard.close()
    params = list(model.parameters())
    state = full_state(model)  # a collective under FSDP2: every rank
    if rank == 0:
        torch.save(state, os.path.join(out, case_file(case)))
    stop = guard.stop_checkpoint
    return {
        "last_step": step,
        "skipped_steps": list(guard.skipped_steps),
        "rollbacks": [list(r) for r in guard.rollbacks],
        "alert_count": guard.alert_count,
        "recoveries": guard.recovery.used if guard.recovery is not None else None,
        "skipped_batches": guard.recovery.skipped_batches if guard.recovery is not None else None,
        "dtensor": all(is_dtensor(p) for p in params),
        "local_elems": local_elems(model),
        "unchanged": sorted(s for s in seen["after"] if seen["before"].get(s) == seen["after"][s]),
        "grad_norm": seen["grad_norm"],
        "rows": seen["rows"],
        "lr": seen["lr"],
        "scaled": seen["scaled"],
        "indices": seen["indices"],
        "stop": stop,
        "stop_files": sorted(os.listdir(stop)) if stop and os.path.isdir(stop) else None,
        "log_dir": log_dir,
        "final": digest(model),
    }


def damaged_resume(case: str, weights: str, out: str, stop: str) -> dict:
    """Rank 1's shard file of the stop checkpoint is removed; every rank tries to resume from it."""
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(os.path.join(stop, "__1_0.distcp"))
    dist.barrier()
    strategy, action = case.split(":")
    model, _, opt, sched = build(strategy, weights)
    before = digest(model)
    guard = StableAttentionGuard(on_spike="stop")
    try:
        load_stop(stop, model, opt, sched, guard)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; it is the result
        refused = f"{type(exc).__name__}: {exc}"[:500]
    else:
        refused = None
    return {"refused": refused, "model_untouched": digest(model) == before}


def run_case(case: str, weights: str, out: str) -> dict:
    name = case.replace(":", "-")
    result = train(case, weights, out, name)
    if case.endswith("stop-resume"):
        result = {"first": result, **train(case, weights, out, name + "-resumed", resume=result["stop"])}
    elif case.endswith("stop-damaged"):
        result = {"first": result, **damaged_resume(case, weights, out, result["stop"])}
    return result


def main(weights: str, out: str, cases: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for case in cases:
        results[case] = run_case(case, weights, out)
        write_results(out, dist.get_rank(), results)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
