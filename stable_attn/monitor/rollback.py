"""In-memory snapshots of a run's training state, for rolling back over a spike.

A snapshot holds everything one optimizer step changes: model parameters and buffers, optimizer
state (AdamW moments and step counters, param-group learning rates), learning-rate schedulers, the
precision plugin (the AMP grad scaler), and the torch random number generators. Restoring all of it
makes the run continue exactly as a run that never saw the batches consumed since the snapshot:
same weights, same optimizer moments, same schedule position, and the same random draws (dropout)
for the batches that follow.

Snapshots live in memory on the parameters' own device (a copy is fast, and a spike must be undone
within one step); they cost one extra copy of the model and optimizer state. :func:`snapshot_state`
and :func:`snapshot_from_state` turn one into plain tensors and dicts for a checkpoint and back (the
engine saves the last one with its state, so a resumed run rolls back to the same state as a run
that was never interrupted). A training-loop adapter says what to snapshot with :class:`Trainables`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

__all__ = ["Snapshot", "Trainables", "restore_snapshot", "snapshot_from_state", "snapshot_state", "take_snapshot"]


@dataclass
class Trainables:
    """What one optimizer step changes, as a training loop holds it.

    Attributes:
        step: optimizer steps done so far (the snapshot is "the state at ``step``").
        model: the module whose ``state_dict`` holds every trained parameter and buffer.
        optimizers: their state (moments, step counts, param-group learning rates).
        schedulers: learning-rate schedulers, or anything else with ``state_dict``/``load_state_dict``.
        precision: one more such object, or None: Lightning's precision plugin, or an AMP ``GradScaler``.
    """

    step: int
    model: torch.nn.Module
    optimizers: Sequence[Any]
    schedulers: Sequence[Any] = ()
    precision: Any | None = None


@dataclass
class Snapshot:
    """Training state after ``step`` optimizer steps."""

    step: int
    model: dict[str, torch.Tensor]
    optimizers: list[dict[str, Any]]
    schedulers: list[dict[str, Any]]
    precision: dict[str, Any]
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None


def _clone_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}


def take_snapshot(state: Trainables) -> Snapshot:
    """Copy the training state (every rank keeps its own)."""
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return Snapshot(
        step=int(state.step),
        model=_clone_tensors(state.model.state_dict()),
        # deepcopy clones the tensors: optimizer state is updated in place by the next step.
        optimizers=[copy.deepcopy(opt.state_dict()) for opt in state.optimizers],
        schedulers=[copy.deepcopy(s.state_dict()) for s in state.schedulers],
        precision=copy.deepcopy(state.precision.state_dict()) if state.precision is not None else {},
        cpu_rng=torch.get_rng_state(),
        cuda_rng=cuda_rng,
    )


def restore_snapshot(state: Trainables, snapshot: Snapshot) -> None:
    """Put the state saved in ``snapshot`` back, in place (the optimizer keeps its parameter objects).

    The snapshot stays intact, so it can be restored again: ``Optimizer.load_state_dict`` adopts the
    tensors it is given when device and dtype already match, and the next step would update them in
    place, so it gets copies.
    """
    with torch.no_grad():
        state.model.load_state_dict(snapshot.model, strict=True)
    for opt, saved in zip(state.optimizers, snapshot.optimizers, strict=True):
        opt.load_state_dict(copy.deepcopy(saved))
    for scheduler, saved in zip(state.schedulers, snapshot.schedulers, strict=True):
        scheduler.load_state_dict(copy.deepcopy(saved))
    if snapshot.precision and state.precision is not None:
        state.precision.load_state_dict(copy.deepcopy(snapshot.precision))
    torch.set_rng_state(snapshot.cpu_rng)
    if snapshot.cuda_rng is not None:
        torch.cuda.set_rng_state_all(snapshot.cuda_rng)


def snapshot_state(snapshot: Snapshot) -> dict[str, Any]:
    """The snapshot as a dict of tensors, lists and numbers (what ``torch.load(weights_only=True)`` reads);
    it shares the snapshot's tensors (a checkpoint writes them, nothing changes them)."""
    return {f.name: getattr(snapshot, f.name) for f in fields(Snapshot)}


def snapshot_from_state(state: dict[str, Any]) -> Snapshot:
    """The inverse of :func:`snapshot_state`; ValueError naming what is missing from a damaged state."""
    missing = [f.name for f in fields(Snapshot) if f.name not in state]
    if missing:
        raise ValueError(f"rollback snapshot state lacks {missing}; it was not written by snapshot_state")
    return Snapshot(**{f.name: state[f.name] for f in fields(Snapshot)})
