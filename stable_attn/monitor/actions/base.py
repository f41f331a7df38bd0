"""The Action protocol: what ``on_spike`` does about a step, each action with its own state.

The engine builds one action for the run (:func:`action_for`) and gives it to the
:class:`~stable_attn.monitor.verdict.StepJudge`; it then calls, on every rank:

- ``start(state, judge)`` once training begins (any checkpoint restored): the first snapshot, say;
- the judge calls ``decide(step)`` when a step's update is dropped as this action (a spike that lasted
  ``spike_confirm_steps``, a drift, a NaN), and ``note(verdict)`` for what the step's alerts add to their
  message; ``alerts(step, lr)`` are any alerts the decision raises itself;
- ``after_step(step, state, acted)`` after the optimizer step: restore, snapshot, scale the learning rate;
  it returns a :class:`StepDone`;
- ``state_dict()`` / ``load_state_dict(state)``: its keys of the engine's checkpoint.

``Warn``, ``Skip`` and ``Stop`` keep no state (a stop's checkpoint is the engine's, since the not-training streak
stops too); ``Rollback`` (:mod:`.rollback`) and ``Recover`` (:mod:`.recovery`) hold snapshots.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .. import names

if TYPE_CHECKING:
    import torch

    from ..alerts.alert import Alert
    from .snapshots import Trainables

__all__ = ["Action", "JudgeStates", "RunContext", "Skip", "StepDone", "Stop", "Verdict", "Warn"]


@dataclass(frozen=True)
class Verdict:
    """What is done about one step. At most one of ``skip``, ``rollback``, ``stop`` and ``recover`` is True, and
    one is exactly when the step's update is dropped; ``action`` is the word the step's alerts carry."""

    action: str  # "warn", "skip", "rollback", "stop" or "recover" (or "skip" for a non-finite step under "warn")
    skip: bool = False  # the update is dropped and training goes on
    rollback: bool = False  # the update is dropped and the last snapshot is restored
    stop: bool = False  # the update is dropped and the run stops with a checkpoint
    recover: bool = False  # the update is dropped, the run rolls back further and skips data (actions/recovery.py)
    not_training: bool = False  # the step counts towards the not-training streak (dropped, or a non-finite loss)

    @property
    def drop(self) -> bool:
        """The step's update is dropped."""
        return self.skip or self.rollback or self.stop or self.recover

    @classmethod
    def dropped(cls, word: str) -> Verdict:
        """The update dropped as ``word`` (``"skip"``, ``"rollback"``, ``"stop"`` or ``"recover"``)."""
        return cls(action=word, not_training=True, **{word: True})


@dataclass(frozen=True)
class StepDone:
    """What :meth:`Action.after_step` did: the step a rollback restored (None: none), whether the run must stop
    (a recovery that found no snapshot to restore), the batches a recovery skips, and alerts to deliver."""

    rolled_back_to: int | None = None
    alerts: tuple[Alert, ...] = ()
    stop: bool = False
    skipping: tuple[int, int] | None = None  # the first and last batch index a recovery skips


@dataclass
class RunContext:
    """What an action reads of its run; the engine keeps it current (rank and size at setup, the log
    directory and stop path at start, the step's learning rate after the verdict)."""

    name: str = "StableAttentionCallback"  # starts every log line
    rank: int = 0
    size: int = 1
    log_dir: str | None = None
    stop_path: Callable[[int], str] | None = None  # the checkpoint a stop at this step writes
    lr: float | None = None  # the current step's (first group's) learning rate, for alerts
    position: Callable[[], dict[str, Any] | None] = field(default=lambda: None)  # the step's data position
    skip_lag: int = 0  # batches the adapter's stream has drawn past the current one
    # several ranks: every rank's host tensor, stacked in rank order (the engine's collective); None: one rank
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    def stop_checkpoint(self, step: int) -> str:
        if self.stop_path is not None:
            return self.stop_path(step)
        return os.path.join(self.log_dir or ".", names.stop_checkpoint(step))


class JudgeStates(Protocol):
    """What an action needs of the judge: its detectors' states, to keep with a snapshot and put back."""

    def detector_states(self) -> dict[str, list[dict[str, Any]]]: ...

    def load_detector_states(self, states: dict[str, list[dict[str, Any]]]) -> None: ...


class Action:
    """The protocol, with the behaviour of an action that keeps no state: its verdict is its word."""

    word = "warn"

    def __init__(self, run: RunContext | None = None, word: str | None = None) -> None:
        self.run = run if run is not None else RunContext()
        if word is not None:
            self.word = word

    def start(self, state: Trainables, judge: JudgeStates) -> None:
        """Training begins with ``state`` (any checkpoint restored)."""

    def decide(self, step: int) -> Verdict:
        """The verdict of a step whose update is dropped as this action."""
        return Verdict.dropped(self.word)

    def note(self, verdict: Verdict) -> str:
        """What the step's alerts add to their message (e.g. ``"; update skipped"``)."""
        if verdict.skip:
            return "; update skipped"
        if verdict.stop:
            return "; stopping"
        return ""

    def alerts(self, step: int, lr: float) -> list[Alert]:
        """Alerts the last :meth:`decide` raises itself (delivered after the step's spike alerts)."""
        return []

    @property
    def restores_to(self) -> int | None:
        """The step a rollback decided now goes back to (for the alerts' outcome), None without one."""
        return None

    def after_step(self, step: int, state: Trainables, acted: bool) -> StepDone:
        """After the optimizer step (``acted``: the update was dropped): restore, snapshot, scale the LR."""
        return StepDone()

    def state_dict(self) -> dict[str, Any]:
        """This action's keys of the engine's checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Read this action's keys of a saved engine state."""


class Warn(Action):
    word = "warn"


class Skip(Action):
    word = "skip"


class Stop(Action):
    word = "stop"
