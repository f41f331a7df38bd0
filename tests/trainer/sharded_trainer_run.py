"""transformers.Trainer in 2 CPU processes (torchrun, gloo) under FSDP2 (``fsdp="full_shard"``, accelerate's
FSDP2 plugin, ``fully_shard`` per GPT2Block) or DDP, with faults that only rank 1 sees: a garbled batch at step
BAD (a loss spike), NaN logits at NAN_LOSS (a NaN loss), NaN gradients of its logits at NAN_GRAD (a finite loss,
NaN gradients before the reduction).

Run by test_trainer_sharded.py as ``torchrun --nproc_per_node 2 sharded_trainer_run.py WEIGHTS OUT_DIR
STRATEGY ACTION [ACTION ...]`` (``STRATEGY``: ``fsdp``, ``ddp``, or ``fsdp-asis``: the FSDP arguments without
forcing accelerate's FSDP path, which on the CPU it does not take; each ``ACTION`` an ``on_spike`` value, one
Trainer each, in one launch). Each rank writes ``OUT_DIR/rank{r}.json`` (per action), rank 0
``OUT_DIR/<strategy>-<action>.pt`` (the full weights).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from distributed_helpers import (
    ACTION_OPTIONS,
    BAD,
    NAN_GRAD,
    NAN_LOSS,
    STEPS,
    digest,
    full_state,
    is_dtensor,
    shutdown,
    write_results,
)
from trainer_lm import make_trainer
from transformers import TrainerCallback

from stable_attn.callbacks import StableAttentionTrainerCallback

ACTION_OPTIONS = dict(ACTION_OPTIONS)
# ``<action>-resume``: the run stops (NaN loss at NAN_LOSS), and a second Trainer resumes from its sharded stop
# checkpoint and runs on to the next stop. recover: the budget (max_recoveries=1) is spent at BAD, so NAN_LOSS stops.
ACTION_OPTIONS["stop-resume"] = {}
ACTION_OPTIONS["recover-resume"] = dict(ACTION_OPTIONS["recover"], max_recoveries=1)
# SHARDED_STATE_DICT: the Trainer's checkpoint (a stop's) is then each rank's shards; with FULL_STATE_DICT its
# save_pretrained reads the DTensor parameters on rank 0 alone (a collective on one rank: gloo fails)
FSDP = {"fsdp": "full_shard", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                        "state_dict_type": "SHARDED_STATE_DICT"}}


class RankFaults(TrainerCallback):
    """Rank 1's NaN logits (NAN_LOSS) and NaN logit gradients (NAN_GRAD); full-weight digests around each step.
    Listed before the monitoring callback, so its on_step_begin runs first."""

    def __init__(self, cb: StableAttentionTrainerCallback) -> None:
        self.cb = cb
        self.before: dict[int, str] = {}
        self.after: dict[int, str] = {}
        self.rows: dict[int, list[int]] = {}
        self.indices: dict[int, int | None] = {}
        self.handle = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # this rank's attention rows per layer, counted by the step's forward
        layers = self.cb.engine.layers
        if layers is not None and all(s.rows is not None for s in layers.stats.values()):
            self.rows[state.global_step + 1] = [int(s.rows.sum()) for s in layers.stats.values()]

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        step = state.global_step + 1
        self.before[step] = digest(model)
        if args.process_index == 1 and step == NAN_LOSS:
            self.handle = model.lm_head.register_forward_hook(lambda m, i, out: out * float("nan"))
        elif args.process_index == 1 and step == NAN_GRAD:
            def poison(m, i, out):
                out.register_hook(lambda g: g * float("nan"))
            self.handle = model.lm_head.register_forward_hook(poison)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.after[state.global_step] = digest(model)
        position = self.cb.engine.data_position
        self.indices[state.global_step] = position["batch_index"] if position is not None else None


def force_fsdp(trainer) -> None:
    """On the CPU accelerate ignores the FSDP plugin and runs DDP (it picks FSDP only for accelerator devices):
    take the path it takes on GPUs, its FSDP2 ``prepare`` (``fully_shard`` per GPT2Block, then the root)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    assert state.distributed_type == DistributedType.MULTI_CPU and getattr(state, "fsdp_plugin", None) is None
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True


def engine_state(cb: StableAttentionTrainerCallback) -> str:
    """The engine's resume state as JSON (what a resume must bring back), without the alert delivery counts
    (rank zero's channels of each run)."""
    state = {k: v for k, v in cb.engine.state_dict().items() if k != "alert_delivery"}
    return json.dumps(state, sort_keys=True, default=repr)


def run(weights: str, out: str, strategy: str, action: str) -> dict:
    on_spike = action.removesuffix("-resume")
    case_dir = os.path.join(out, f"{strategy}-{action}")
    # max_grad_norm far above the norm: the Trainer still measures the norm (the callback reads it) and scales by
    # exactly 1.0, so FSDP2's and DDP's updates stay bitwise equal (their norms differ in the last bits)
    extra = FSDP if strategy.startswith("fsdp") else {}
    logged: dict[int, float] = {}
    loaded: dict[str, str] = {}

    def train(resume: str | None = None):
        cb = StableAttentionTrainerCallback(on_spike=on_spike, log_every_n_steps=1, **ACTION_OPTIONS[action])
        faults = RankFaults(cb)
        trainer = make_trainer(case_dir, [faults, cb], steps=STEPS, weights=weights, corrupt=[2 * (BAD - 1) + 1],
                               ddp_backend="gloo", max_grad_norm=1e6, logging_steps=1, **extra)

        class Logs(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "grad_norm" in logs:
                    logged[state.global_step] = float(logs["grad_norm"])

            def on_train_begin(self, args, state, control, **kwargs):  # after the callback restored its state
                loaded["state"] = engine_state(cb)

        trainer.add_callback(Logs())
        if strategy == "fsdp":
            force_fsdp(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return cb, faults, trainer

    cb, faults, trainer = train()
    first = None
    if action.endswith("-resume"):
        first = {"stop": cb.stop_checkpoint, "global_step": trainer.state.global_step,
                 "skipped_steps": list(cb.skipped_steps), "rollbacks": [list(r) for r in cb.rollbacks],
                 "alert_count": cb.alert_count, "state": engine_state(cb), "indices": faults.indices,
                 "stop_files": sorted(os.listdir(cb.stop_checkpoint)) if cb.stop_checkpoint else None}
        cb, faults, trainer = train(resume=cb.stop_checkpoint)
        first["loaded"] = loaded["state"]
    model = trainer.model_wrapped
    model = getattr(model, "module", model)  # DDP's wrapper; FSDP2 shards the model in place
    state = full_state(model)
    rank = trainer.args.process_index
    if rank == 0:
        torch.save(state, os.path.join(out, f"{strategy}-{action}.pt"))
    stop = cb.stop_checkpoint
    return {
        "world": trainer.args.world_size,
        "global_step": trainer.state.global_step,
        "skipped_steps": list(cb.skipped_steps),
        "rollbacks": [list(r) for r in cb.rollbacks],
        "alert_count": cb.alert_count,
        "dtensor": all(is_dtensor(p) for p in model.parameters()),
        "unchanged": sorted(s for s in faults.after if faults.before.get(s) == faults.after[s]),
        "grad_norm": logged,
        "rows": faults.rows,
        "indices": faults.indices,
        "recoveries": cb.engine.recovery.used if cb.engine.recovery is not None else None,
        "stop": stop,
        "stop_files": sorted(os.listdir(stop)) if stop and os.path.isdir(stop) else None,
        "alerts_file": os.path.join(case_dir, "stable_attn_alerts.jsonl"),
        "final": digest(model),
        "first": first,
    }


def main(weights: str, out: str, strategy: str, actions: list[str]) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = {}
    for action in actions:
        results[action] = run(weights, out, strategy, action)
        write_results(out, rank, results)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
