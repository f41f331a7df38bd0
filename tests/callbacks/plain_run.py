"""Two CPU processes (gloo) that train the tiny GPT-2 in a hand-written loop driven by StableAttentionGuard, once
per case, with the faults of sharded_run.py that only rank 1 sees: a corrupted batch at BAD (a loss spike), a NaN
loss at NAN_LOSS, one NaN gradient element at NAN_GRAD (after the gradients were reduced).

A case is ``STRATEGY:ACTION``: ``fsdp`` shards with ``fully_shard`` per GPT-2 block and on the model (FSDP2, a
1-D device mesh over both ranks), ``ddp`` replicates with ``DistributedDataParallel``; ``ACTION`` is an
``on_spike`` value, ``recover-disk`` (the ring in files) or ``stop-resume`` (stop, save the stop checkpoint with
``torch.distributed.checkpoint``, each rank its own shards, then a second loop resumed from it) or
``stop-damaged`` (rank 1's shard file of that checkpoint removed, then every rank tries to load it).

Run by test_plain_loop.py as ``python plain_run.py WEIGHTS OUT_DIR CASE [CASE ...]`` in two processes it starts
itself (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set). Each rank writes ``OUT_DIR/rank{r}.json``
(per case: what it saw and did), rank 0 ``OUT_DIR/<case>.pt`` (the full weights).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from callback_lm import batches_loader, tiny_gpt2

from stable_attn.callbacks import StableAttentionGuard

STEPS = 14
BAD = 5
NAN_LOSS = 8
NAN_GRAD = 11
RANK_OFFSET = 100  # rank r reads batches 100*r .. 100*r + STEPS - 1: different data on each rank
ACTION_OPTIONS = {
    "warn": {},
    "skip": {},
    "rollback": {"spike_confirm_steps": 1, "rollback_every": 2},
    "stop": {},
    "recover": {"spike_confirm_steps": 1, "rollback_steps": 4, "rollback_every": 2, "skip_batches": 2,
                "cooldown_steps": 2, "lr_factor": 0.5, "lr_steps": 3},
}
ACTION_OPTIONS["recover-disk"] = dict(ACTION_OPTIONS["recover"], snapshot_memory_limit=0)
ACTION_OPTIONS["stop-resume"] = {}
ACTION_OPTIONS["stop-damaged"] = {}


class Net(torch.nn.Module):
    """GPT-2 with one trained parameter of a single row (a logit temperature): with two ranks, FSDP2 leaves
    rank 1 an empty shard of it."""

    def __init__(self, weights: str) -> None:
        super().__init__()
        self.gpt = tiny_gpt2()
        self.gpt.load_state_dict(torch.load(weights, weights_only=True))
        self.temperature = torch.nn.Parameter(torch.ones(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(input_ids=ids, use_cache=False).logits[:, :-1] * self.temperature
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full tensor, DDP's ``module.`` prefix removed (a collective under FSDP2)."""
    return {k.removeprefix("module."): (v.full_tensor() if is_dtensor(v) else v).detach().clone()
            for k, v in module.state_dict().items()}


def digest(module: torch.nn.Module) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in full_state(module).values():
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


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
                grad = net.gpt.transformer.wte.weight.grad
                (grad.to_local() if is_dtensor(grad) else grad).view(-1)[0] = float("nan")
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
        torch.save(state, os.path.join(out, case.replace(":", "-") + ".pt"))
    stop = guard.stop_checkpoint
    return {
        "last_step": step,
        "skipped_steps": list(guard.skipped_steps),
        "rollbacks": [list(r) for r in guard.rollbacks],
        "alert_count": guard.alert_count,
        "recoveries": guard.recovery.used if guard.recovery is not None else None,
        "skipped_batches": guard.recovery.skipped_batches if guard.recovery is not None else None,
        "dtensor": all(is_dtensor(p) for p in params),
        "local_elems": {n.removeprefix("module."): (p.to_local() if is_dtensor(p) else p).numel()
                        for n, p in model.named_parameters()},
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
        with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
