"""A plain loop over a two-layer MLP with ``on_spike="recover"`` and the snapshot ring on disk, for the ring's fault
cases (tests/faults/test_ring_faults.py, in one process, and ring_ddp_run.py, in two gloo processes).

The ring takes a snapshot every 2 steps and keeps 3 (``rollback_steps=3``), so a NaN loss at step 7 (acted on at
once) wants the snapshot of step 4 and may fall back to step 2; ``damage(loop)`` runs just before that step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch

from stable_attn.monitor.actions.ring import RING_DIR, ring_file, write_snapshot
from stable_attn.monitor.actions.snapshots import snapshot_from_state
from stable_attn.monitor.engine import MonitorEngine, Trainables, World

NAN_AT = 7  # the recovery's step; it wants the snapshot of step 4 (3 steps back), then step 2
STEPS = 10


class RingLoop:
    """The model, its AdamW, the engine, and the model's state after every step (``states[n]``: after ``n``
    optimizer steps, as the ring's snapshot of step ``n`` holds it)."""

    def __init__(self, log_dir: str, world: World | None = None, seed: int = 0, **options: Any) -> None:
        torch.manual_seed(seed)
        self.log_dir = log_dir
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.alerts: list[Any] = []
        options = dict(on_spike="recover", alerts_file=None, on_alert=self.alerts.append) | options
        if options["on_spike"] == "recover":  # the ring's arguments (refused under the other actions)
            options = dict(snapshot_memory_limit=0, rollback_steps=3, rollback_every=2, skip_batches=0) | options
        self.engine = MonitorEngine(**options)
        self.rank = world.rank if world is not None else 0
        self.engine.setup(self.model, world or World())
        self.engine.start(log_dir, 1)
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.ends: list[Any] = []
        self.step = 0  # the next step to run
        self.data = torch.Generator().manual_seed(100 + seed)
        self.engine.train_start(self.trainables(0))
        self.states[0] = self.weights()

    def trainables(self, step: int) -> Trainables:
        return Trainables(step=step, model=self.model, optimizers=[self.opt])

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def file(self, step: int) -> str:
        return os.path.join(self.log_dir, RING_DIR, ring_file(step, self.rank))

    def run(self, steps: int = STEPS, nan_at: tuple[int, ...] = (NAN_AT,),
            damage: Callable[[RingLoop], None] | None = None, spike: float = math.nan) -> None:
        """Steps up to ``steps`` (in all: a second call goes on where the first ended); the loss of the steps in
        ``nan_at`` is multiplied by ``spike`` (NaN: acted on at once by every action)."""
        for step in range(self.step, steps):
            self.step = step + 1
            if step == NAN_AT and damage is not None:
                damage(self)
            self.engine.begin_step(step)
            x = torch.randn(8, 4, generator=self.data)
            self.engine.add_batch(x, epoch=0, batch_index=step)
            loss = (self.model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            if step in nan_at:
                loss = loss * spike
            self.engine.add_loss(loss)
            loss.backward()
            self.engine.before_optimizer_step(self.opt, self.model.parameters())
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            end = self.engine.end_step(self.trainables(step + 1))
            self.ends.append(end)
            self.states[step + 1] = self.weights()
            if end.stop_checkpoint is not None:
                return


def rewrite(path: str, change: Callable[[Any], None]) -> None:
    """Read a ring file's snapshot, ``change`` it, and write it back as the ring would (a valid manifest)."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    snapshot = snapshot_from_state(payload["snapshot"])
    change(snapshot)
    write_snapshot(snapshot, path)


def nan_weights(snapshot: Any) -> None:
    snapshot.model["0.weight"] = torch.full_like(snapshot.model["0.weight"], math.nan)


def wrong_shape(snapshot: Any) -> None:
    snapshot.model["2.weight"] = snapshot.model["2.weight"].reshape(8, 1).clone()  # the model's is [1, 8]


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_a_byte(path: str) -> None:
    """Change one stored weight without touching the manifest (a bit rot the checksum must see)."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    payload["snapshot"]["model"]["0.bias"][3] += 1.0
    torch.save(payload, path)


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
