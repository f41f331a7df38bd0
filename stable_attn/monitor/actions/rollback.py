"""``on_spike="rollback"``: a snapshot every ``rollback_every`` steps, restored (with the detectors of its step)
after a spike that lasted; a single-process checkpoint keeps the last snapshot, so a resumed run rolls back to
the same state as one that was never interrupted."""

from __future__ import annotations

import copy
import logging
from typing import Any

from .base import Action, JudgeStates, RunContext, StepDone, Verdict
from .snapshots import (
    Snapshot,
    Trainables,
    check_snapshot,
    restore_snapshot,
    snapshot_from_state,
    snapshot_state,
    take_snapshot,
)

__all__ = ["Rollback"]

log = logging.getLogger("stable_attn")


class Rollback(Action):
    """The last snapshot and its detectors, a rollback pending from :meth:`decide` to :meth:`after_step`, and the
    snapshot a checkpoint brought (checked against the run at :meth:`start`)."""

    word = "rollback"

    def __init__(self, run: RunContext, every: int) -> None:
        super().__init__(run)
        self.every = every
        self.snapshot: Snapshot | None = None
        self.detectors: dict[str, list[dict[str, Any]]] | None = None  # the judge's, as at the snapshot
        self.pending = False
        self._judge: JudgeStates | None = None
        self._in_checkpoint = False
        self._loaded: tuple[Snapshot, Any] | None = None
        self._resumed = False

    def start(self, state: Trainables, judge: JudgeStates) -> None:
        self._judge = judge
        loaded, self._loaded = self._loaded, None
        resumed, self._resumed = self._resumed, False
        if loaded is not None:
            check_snapshot(loaded[0], state)  # shapes and finiteness against this run, before any of it is used
        # A snapshot of one process is the whole state; several ranks (DDP, FSDP) each hold their own, and a
        # checkpoint keeps rank zero's only.
        self._in_checkpoint = self.run.size == 1
        if loaded is not None:
            self.snapshot, self.detectors = loaded
            if self.run.is_zero:
                log.info("%s: rollback snapshot of global_step %d restored from the checkpoint", self.run.name,
                         self.snapshot.step)
            return
        self.take(state)
        if resumed and self.run.is_zero:
            log.warning("%s: rollback history starts afresh at global_step %d: the checkpoint holds no rollback "
                        "snapshot (one is saved only by single-process runs with on_spike='rollback'), so a spike "
                        "rolls back to no earlier state than this one", self.run.name, state.step)

    def take(self, state: Trainables) -> None:
        """The rollback snapshot of ``state``, with the loss and gradient-norm detectors as they are now."""
        assert self._judge is not None
        self.snapshot = take_snapshot(state)
        self.detectors = self._judge.detector_states()

    def decide(self, step: int) -> Verdict:
        self.pending = True
        return super().decide(step)

    def note(self, verdict: Verdict) -> str:
        if verdict.rollback:
            return f"; rolling back to the state at global_step {self.restores_to if self.snapshot else '?'}"
        return super().note(verdict)

    @property
    def restores_to(self) -> int | None:
        return self.snapshot.step if self.snapshot is not None else None

    def after_step(self, step: int, state: Trainables, acted: bool) -> StepDone:
        if not self.pending:
            if not acted and state.step % self.every == 0:
                self.take(state)
            return StepDone()
        self.pending = False
        assert self.snapshot is not None and self._judge is not None
        restore_snapshot(state, self.snapshot)
        if self.detectors is not None:
            # The detectors go back with the weights: judged against the level the run had reached after the
            # restored weights' step, the first losses after a rollback looked like a spike again.
            self._judge.load_detector_states(self.detectors)
        if self.run.is_zero:
            log.warning("%s: rolled back to the state at global_step %d; the batches of steps %d..%d are dropped",
                        self.run.name, self.snapshot.step, self.snapshot.step, step)
        return StepDone(rolled_back_to=self.snapshot.step)

    def state_dict(self) -> dict[str, Any]:
        """The snapshot's tensors, in a single-process run only."""
        if self.snapshot is None or not self._in_checkpoint:
            return {}
        return {"rollback_snapshot": snapshot_state(self.snapshot), "rollback_detectors": copy.deepcopy(self.detectors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed = True
        saved = state.get("rollback_snapshot")
        self._loaded = (snapshot_from_state(saved), state.get("rollback_detectors")) if saved is not None else None
