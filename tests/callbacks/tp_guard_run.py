"""Tensor parallelism through the engine: two CPU processes (gloo), a tiny Llama served by ``"stable_attn"`` with
torch's ``parallelize_module`` (q/k/v column-wise, o row-wise: each rank computes 4 of the 8 query heads), trained
by a hand-written loop driven by StableAttentionGuard with QK-Clip, next to one unsharded copy driven by its own
single-process guard in the same process (the reference). Both ranks train on the same batches (TP ranks share
the data). At NAN_GRAD one element of rank 1's local shard of a ``q_proj`` gradient turns NaN (the reference's
whole gradient gets the same element): the step is dropped on both ranks, so neither its update nor its QK-Clip
edit is applied.

Run by test_plain_loop.py as ``python tp_guard_run.py OUT_DIR ACTION [ACTION ...]`` in two processes (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set); each rank writes ``OUT_DIR/rank{r}.json`` (per action).
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from distributed_helpers import full, shutdown, write_results

from stable_attn.callbacks import StableAttentionGuard
from stable_attn.monitor.loop import World

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "monitor"))
from tp_run import HEAD_DIM, HEADS, model  # noqa: E402  (the tiny Llama of the unit-level TP test)

STEPS = 8
NAN_GRAD = 3  # a step the clean run clips at (steps 0-3 and 7 clip there)
ACTION_OPTIONS = {"skip": {}, "rollback": {"spike_confirm_steps": 1, "rollback_every": 2}}


def weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()).clone() for n, p in m.named_parameters()}


def tau_between(reference: torch.nn.Module, ids: torch.Tensor) -> float:
    """A QK-Clip threshold between the two large-logit heads and the rest (tp_run's), from one probe forward."""
    from stable_attn.integrations.transformers import attach_stats

    probe = copy.deepcopy(reference)
    stats = attach_stats(probe)
    with torch.no_grad():
        probe(input_ids=ids)
    maxima = torch.stack([s.max_logit for s in stats.values()])
    small = maxima.sort(dim=1).values[:, :-2].max()
    big = maxima.sort(dim=1).values[:, -2:].min()
    return float(small + big) / 2


def run(out: str, action: str) -> dict:
    rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    reference = model()
    sharded = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in sharded.model.layers:
        parallelize_module(layer.self_attn, mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                   "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
    data = [torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
    tau = tau_between(reference, data[0])
    runs = {}
    clean = copy.deepcopy(reference)  # the reference without the fault: which steps QK-Clip edits when none drops
    for name, m, world in (("tp", sharded, None), ("ref", reference, World()), ("clean", clean, World())):
        torch.manual_seed(0)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        guard = StableAttentionGuard(on_spike=action, qk_clip=tau, log_every_n_steps=1, **ACTION_OPTIONS[action])
        guard.setup(m, opt, log_dir=os.path.join(out, f"{action}-{name}-rank{rank}"), world=world)
        seen: dict = {"unchanged": [], "clipped": {}, "metrics": {}}
        for step, ids in enumerate(guard.batches(data)):
            guard.begin_step(step)
            before = weights(m)
            loss = m(input_ids=ids, labels=ids).loss
            guard.add_loss(loss)
            loss.backward()
            if step == NAN_GRAD and name != "clean":
                grad = m.model.layers[0].self_attn.q_proj.weight.grad
                if type(grad).__name__ == "DTensor":
                    if rank == 1:  # rank 1's own rows (global rows HEADS/2 * HEAD_DIM ...)
                        grad.to_local().view(-1)[0] = float("nan")
                else:
                    grad.view(-1)[HEADS // 2 * HEAD_DIM * grad.shape[1]] = float("nan")
            decision = guard.before_optimizer_step()
            if decision.apply:
                opt.step()
            opt.zero_grad()
            end = guard.end_step()
            after = weights(m)
            if all(torch.equal(before[n], after[n]) for n in after):
                seen["unchanged"].append(step)
            metrics = end.metrics or {}
            seen["clipped"][step] = metrics.get("qk_clip/clipped_heads", 0.0)
            seen["metrics"][step] = {k: v for k, v in metrics.items() if k.startswith("stable_attn/")}
        guard.close()
        runs[name] = {"skipped_steps": list(guard.skipped_steps), "rollbacks": [list(r) for r in guard.rollbacks],
                      "alert_kinds": guard.alert_kinds, "weights": weights(m), **seen}
    tp, ref = runs["tp"], runs["ref"]
    result = {
        "tau": tau,
        "dtensor_q": type(sharded.model.layers[0].self_attn.q_proj.weight).__name__ == "DTensor",
        **{f"{k}": [tp[k], ref[k]] for k in ("skipped_steps", "rollbacks", "unchanged", "clipped", "alert_kinds")},
        "metrics": [tp["metrics"], ref["metrics"]],
        "clean_clipped": runs["clean"]["clipped"],
        "max_weight_diff": max(float((tp["weights"][n] - ref["weights"][n]).abs().max()) for n in ref["weights"]),
    }
    return result


def main(out: str, actions: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {action: run(out, action) for action in actions}
    write_results(out, dist.get_rank(), results)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
