"""``on_spike="recover"``: the PaLM recipe as one action (Chowdhery et al. 2022, section 5.1: restart from a
checkpoint about 100 steps before the spike and skip about 200-500 data batches).

On a spike the engine drops the step's update, then (this module):

1. **rolls back** to the newest snapshot taken at least ``rollback_steps`` optimizer steps before the spiking
   step, from a :class:`SnapshotRing`. Snapshots are taken every ``spacing = min(rollback_every,
   rollback_steps)`` steps and the ring keeps ``length = ceil(rollback_steps / spacing) + 1`` of them, so the
   snapshot it needs always exists once the run is that old: the rollback goes back between ``rollback_steps``
   and ``rollback_steps + spacing - 1`` steps (to the oldest snapshot, the start of the run or of the resume,
   when the run is younger). The ring holds ``length`` copies of the weights, the optimizer state and the
   schedulers (with AdamW about ``3 x 4 bytes x parameters`` each; 2 copies with the defaults), in host memory,
   or, when that would take more than ``snapshot_memory_limit`` bytes, as files under ``{log_dir}/recovery``
   (:mod:`.ring`). The snapshot is verified before anything of it reaches the model; one that fails (missing,
   unreadable, damaged, not fitting the run; on any rank) is named in the recovery's alert and the next older
   one is tried; with none left the run stops with a checkpoint, nothing restored. Snapshots newer than the one
   restored belong to the abandoned trajectory and are dropped;
2. **skips** the next ``skip_batches`` batches of the epoch (:class:`SkipWindow`: epoch ``E``, batch indices
   ``A..B``, counted as the data loader yields them, skipped batches included). A window ends with its epoch:
   the next epoch reorders the data, so its first batches are not the bad ones. The adapters discard the
   window's batches before the training loop sees them (:class:`SkipStream`), so they make no optimizer step;
3. optionally scales every parameter group's learning rate by ``lr_factor`` for the next ``lr_steps`` optimizer
   steps (:class:`LrScale`: around each ``optimizer.step()`` only, so an LR scheduler never sees the scaled
   value and the schedule is exactly the one without recovery afterwards);
4. counts: at most ``max_recoveries`` per run, at least ``cooldown_steps`` optimizer steps apart. A spike
   within the cool-down has its update skipped (as ``on_spike="skip"``); a spike after the last recovery
   stops the run with a checkpoint (the escalation alert says why).

:meth:`Recovery.state_dict` keeps the recoveries used, the last one's step, the skip window and the LR
scaling (plain values); the ring is not saved: a resumed run starts it afresh (the engine says so).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .. import names
from ..alerts.alert import Alert, checkpoint_name
from .base import Action, JudgeStates, RunContext, StepDone, Verdict
from .ring import RING_DIR, RingChoice, RingEntry, SnapshotRing, ring_file, ring_layout, snapshot_bytes
from .snapshots import Trainables, restore_snapshot

__all__ = ["RING_DIR", "LrScale", "Recover", "Recovery", "RingEntry", "SkipStream", "SkipWindow", "SnapshotRing",
           "ring_layout", "snapshot_bytes"]

log = logging.getLogger("stable_attn")


@dataclass
class SkipWindow:
    """Batches ``start..stop - 1`` of epoch ``epoch`` are skipped."""

    epoch: int
    start: int
    stop: int

    def covers(self, epoch: int, index: int) -> bool:
        return epoch == self.epoch and self.start <= index < self.stop

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start": self.start, "stop": self.stop}


class SkipStream:
    """An iterator over a data loader's batches that discards those a skip window covers.

    ``index`` is the data index of the next batch the inner iterator yields (a resumed Trainer run starts
    there: its own ``skip_first_batches`` has consumed the batches before); ``skip(epoch, index)`` says
    whether to discard it. :attr:`yielded` maps the position of each batch given out (0, 1, ... counted from
    ``given``) to its data index, for the adapter's :meth:`~stable_attn.monitor.engine.MonitorEngine.add_batch`.
    """

    def __init__(self, inner: Iterator[Any], epoch: int, skip: Callable[[int, int], bool], index: int = 0,
                 given: int = 0) -> None:
        self.inner, self.epoch, self._skip = inner, epoch, skip
        self.index, self.given = index, given
        self.offset = 0  # positions given out before this stream, minus their data indices (a Lightning restart)
        self.discarded = 0
        self.yielded: dict[int, int] = {}

    def __iter__(self) -> SkipStream:
        return self

    def __next__(self) -> Any:
        while True:
            item = next(self.inner)
            index, self.index = self.index, self.index + 1
            if self._skip(self.epoch, index):
                self.discarded += 1
                continue
            self.yielded[self.given] = index
            self.given += 1
            return item

    def data_index(self, position: int) -> int:
        """The data index of the batch given out at ``position`` (``position`` itself before any discard)."""
        return self.yielded.pop(position, position - self.offset)


class LrScale:
    """Every parameter group's learning rate times ``factor`` for one ``optimizer.step()`` call.

    :meth:`wrap` puts a wrapper on the optimizer instance that scales the rates, steps, and puts the rates
    back (whatever the step raised), then removes itself: schedulers, which step after the optimizer, see the
    unscaled rates. :meth:`unwrap` removes a wrapper that was not called (a run that ended first)."""

    _ABSENT = object()

    def __init__(self) -> None:
        self._wrapped: tuple[Any, Any] | None = None

    def wrap(self, optimizer: Any, factor: float) -> None:
        self.unwrap()
        before = optimizer.__dict__.get("step", self._ABSENT)
        inner = optimizer.step
        groups = optimizer.param_groups

        def step(*args: Any, **kwargs: Any) -> Any:
            self.unwrap()
            rates = [g["lr"] for g in groups]
            for g in groups:
                g["lr"] = g["lr"] * factor
            try:
                return inner(*args, **kwargs)
            finally:
                for g, lr in zip(groups, rates, strict=True):
                    g["lr"] = lr

        optimizer.step = step
        self._wrapped = (optimizer, before)

    def unwrap(self) -> None:
        wrapped, self._wrapped = self._wrapped, None
        if wrapped is None:
            return
        optimizer, before = wrapped
        if before is self._ABSENT:
            optimizer.__dict__.pop("step", None)
        else:
            optimizer.step = before


class Recovery:
    """The recipe's state: the ring, the skip window, the LR scaling and the count of recoveries."""

    def __init__(self, *, rollback_steps: int, rollback_every: int, skip_batches: int, lr_factor: float,
                 lr_steps: int, max_recoveries: int, cooldown_steps: int, memory_limit: int | None = None) -> None:
        self.rollback_steps, self.skip_batches = rollback_steps, skip_batches
        self.lr_factor, self.lr_steps = lr_factor, lr_steps
        self.max_recoveries, self.cooldown_steps = max_recoveries, cooldown_steps
        self.ring = SnapshotRing(*ring_layout(rollback_steps, rollback_every), memory_limit=memory_limit)
        self.used = 0
        self.last_step: int | None = None
        self.window: SkipWindow | None = None
        self.lr_until: int | None = None  # optimizer steps up to this one (inclusive) run at lr x lr_factor
        self.lr: list[LrScale] = []  # one per optimizer while a scaled step is due
        self.skipped_batches = 0  # over the run, counted by the adapters' streams
        self.history: list[dict[str, Any]] = []  # one entry per recovery (the summary and the benchmark read it)
        #: Where the adapter's data stream stands (epoch, data index, batches given to the loop), kept by each
        #: adapter after every batch so that a resume continues the epoch's stream at the same batch (the
        #: Trainer's: the inner iterator's next index; Lightning's: the index after the step's batch).
        self.stream: dict[str, int] | None = None

    def decide(self, step: int) -> str:
        """What a spike at ``step`` does: ``"recover"``, ``"skip"`` (within the cool-down) or ``"stop"``
        (every recovery used)."""
        if self.used >= self.max_recoveries:
            return "stop"
        if self.last_step is not None and step - self.last_step < self.cooldown_steps:
            return "skip"
        return "recover"

    def begin(self, step: int, target: int, epoch: int | None, start: int | None) -> dict[str, Any]:
        """Record a recovery at ``step`` back to ``target``; the window starts at batch ``start`` of ``epoch``
        (None: the position is unknown and no batch is skipped)."""
        self.used += 1
        self.last_step = step
        self.window = SkipWindow(epoch, start, start + self.skip_batches) if epoch is not None \
            and start is not None and self.skip_batches > 0 else None
        self.lr_until = step + self.lr_steps if self.lr_factor != 1.0 and self.lr_steps > 0 else None
        entry = {"step": step, "rolled_back_to": target,
                 "window": self.window.state_dict() if self.window is not None else None}
        self.history.append(entry)
        return entry

    def skips(self, epoch: int, index: int) -> bool:
        window = self.window
        if window is not None and window.covers(epoch, index):
            self.skipped_batches += 1
            return True
        return False

    def scale_lr(self, step: int, optimizers: Any) -> bool:
        """Scale the learning rate of optimizer step ``step`` (the next ``step()`` call of each optimizer) if a
        recovery asks for it: steps ``recovery + 1 .. recovery + lr_steps``."""
        for scale in self.lr:
            scale.unwrap()
        self.lr = []
        if self.lr_until is None or step > self.lr_until:
            self.lr_until = None
            return False
        self.lr = [LrScale() for _ in optimizers]
        for scale, optimizer in zip(self.lr, optimizers, strict=True):
            scale.wrap(optimizer, self.lr_factor)
        return True

    def message(self, entry: dict[str, Any]) -> str:
        window = entry["window"]
        skip = (f"skipping batches {window['start']}-{window['stop'] - 1} (epoch {window['epoch']})"
                if window is not None else "skipping no batch (the data position is unknown)")
        lr = f", lr x{self.lr_factor:g} for {self.lr_steps} steps" if self.lr_until is not None else ""
        return (f"rolled back to step {entry['rolled_back_to']}, {skip}{lr}, recovery {self.used} of "
                f"{self.max_recoveries}")

    def state_dict(self) -> dict[str, Any]:
        return {"used": self.used, "last_step": self.last_step,
                "window": self.window.state_dict() if self.window is not None else None,
                "lr_until": self.lr_until, "skipped_batches": self.skipped_batches,
                "stream": dict(self.stream) if self.stream is not None else None,
                "history": [dict(e) for e in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def count(key: str, value: Any, none: bool = False) -> Any:
            if value is None and none:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"the checkpoint's recovery[{key!r}] is {value!r}, expected an int >= 0"
                                 + (" or None" if none else "") + "; resume from a checkpoint this run wrote")
            return value

        # every field checked before any is assigned: a damaged state loads nothing
        used = count("used", state.get("used", 0))
        last_step = count("last_step", state.get("last_step"), none=True)
        lr_until = count("lr_until", state.get("lr_until"), none=True)
        skipped = count("skipped_batches", state.get("skipped_batches", 0))
        window = state.get("window")
        if window is not None:
            if not isinstance(window, dict):
                raise ValueError(f"the checkpoint's recovery['window'] is {window!r}, expected None or a dict "
                                 "with epoch, start, stop; resume from a checkpoint this run wrote")
            window = SkipWindow(*(count(f"window.{k}", window.get(k)) for k in ("epoch", "start", "stop")))
        stream = state.get("stream")
        if stream is not None:
            if not isinstance(stream, dict):
                raise ValueError(f"the checkpoint's recovery['stream'] is {stream!r}, expected None or a dict "
                                 "with epoch, index, given; resume from a checkpoint this run wrote")
            stream = {k: count(f"stream.{k}", stream.get(k)) for k in ("epoch", "index", "given")}
        self.used, self.last_step, self.lr_until, self.skipped_batches = used, last_step, lr_until, skipped
        self.window, self.stream = window, stream
        self.history = [dict(e) for e in state.get("history", []) if isinstance(e, dict)]


class Recover(Action):
    """``on_spike="recover"`` as an :class:`~stable_attn.monitor.actions.base.Action` over a :class:`Recovery`:
    :meth:`decide` asks it (recover, skip within the cool-down, stop once all are used), :meth:`after_step`
    carries a recovery out (the ring's snapshot restored with its detectors, the skip window opened, an alert),
    keeps the ring and scales the next step's learning rate."""

    word = "recover"

    def __init__(self, run: RunContext, recovery: Recovery) -> None:
        super().__init__(run)
        self.recovery = recovery
        self.pending = False
        self._judge: JudgeStates | None = None
        self._decided: tuple[int, Verdict, str] | None = None  # (step, verdict, Recovery.decide's word)
        self._resumed = False
        self._pending: list[Alert] = []  # the ring's write failures, delivered with the step's end

    def start(self, state: Trainables, judge: JudgeStates) -> None:
        self._judge = judge
        resumed, self._resumed = self._resumed, False
        r, run = self.recovery, self.run
        ring = r.ring
        ring.start(os.path.join(run.log_dir or ".", RING_DIR), run.rank)
        ring.take(state, judge.detector_states())  # the oldest state a recovery can go back to
        self._read_failures(state.step)
        if run.is_zero:
            log.info("%s: recovery snapshot ring of %d x %.1f MB %s", run.name, ring.length,
                     (ring.snapshot_bytes or 0) / 1e6, f"on disk in {ring.directory} (over snapshot_memory_limit="
                     f"{ring.memory_limit})" if ring.on_disk else "in host memory")
        if resumed and run.is_zero:
            log.warning("%s: recovery snapshot ring starts afresh at global_step %d (the ring is not saved in "
                        "checkpoints); recoveries used: %d of %d", run.name, state.step, r.used, r.max_recoveries)

    def _read_failures(self, step: int) -> None:
        """The ring's write failures: a WARNING each now (on the rank that met it), an alert at the step's end."""
        r = self.recovery
        for path, failure in r.ring.failures:
            log.warning("%s: the recovery snapshot %s %s", self.run.name, path, failure)
            said = f"the recovery snapshot {RING_DIR}/{os.path.basename(path)} {failure}"
            self._pending.append(Alert(step=step, kind="recovery", metric=names.RECOVERIES, value=r.used,
                                       threshold=r.max_recoveries, lr=self.run.lr, action="warn",
                                       message=f"rank {self.run.rank}: {said}" if self.run.size > 1 else said))
        r.ring.failures = []

    def decide(self, step: int) -> Verdict:
        decision = self.recovery.decide(step)
        verdict = Verdict(action=decision, not_training=True, **{decision: True})
        self._decided = (step, verdict, decision)
        self.pending = decision == "recover"
        return verdict

    def note(self, verdict: Verdict) -> str:
        if self._decided is None or verdict is not self._decided[1]:
            return super().note(verdict)
        return {"recover": "; recovering (on_spike='recover')",
                "skip": f"; update skipped (within cooldown_steps={self.recovery.cooldown_steps} of the last "
                        "recovery)",
                "stop": f"; stopping (max_recoveries={self.recovery.max_recoveries} used)"}[self._decided[2]]

    def alerts(self, step: int, lr: float) -> list[Alert]:
        decided, self._decided = self._decided, None
        if decided is None or decided[0] != step or decided[2] != "stop":
            return []
        r = self.recovery
        return [Alert(step=step, kind="recovery", metric=names.RECOVERIES, value=r.used, threshold=r.max_recoveries,
                      lr=lr, action="stop", checkpoint=self.run.stop_checkpoint(step),
                      message=f"the run spiked again after all {r.max_recoveries} recoveries (max_recoveries): "
                              "rolling back and skipping data did not keep it stable, so it stops with a "
                              "checkpoint; look at the data around the spikes and at the learning rate")]

    def after_step(self, step: int, state: Trainables, acted: bool) -> StepDone:
        r = self.recovery
        done = StepDone()
        if self.pending:
            self.pending = False
            done = self._recover(step, state)
        elif not acted and r.ring.due(state.step):
            assert self._judge is not None
            r.ring.take(state, self._judge.detector_states())
            self._read_failures(step)
        # for the next optimizer.step() only: installed now, after this step's optimizer and scheduler steps
        # (Lightning runs the step's closure, and so before_optimizer_step, inside optimizer.step())
        r.scale_lr(step + 1, state.optimizers)
        pending, self._pending = self._pending, []
        return StepDone(rolled_back_to=done.rolled_back_to, stop=done.stop, skipping=done.skipping,
                        alerts=(*pending, *done.alerts))

    def _recover(self, step: int, state: Trainables) -> StepDone:
        """Restore the newest verified snapshot ``rollback_steps`` back (or older), open the skip window, alert;
        with none that passed on every rank, stop (nothing restored)."""
        r = self.recovery
        assert self._judge is not None
        choice = r.ring.choose(step, r.rollback_steps, state, self.run.all_gather)
        for entry, problem in choice.failed:  # this rank's own files, with their full path
            log.warning("%s: recovery snapshot %s (step %d) %s: not restored", self.run.name,
                        entry.path or entry.where, entry.step, problem)
        position = self.run.position() or {}
        epoch, index = position.get("epoch"), position.get("batch_index")
        where = f" (after batch {index} of epoch {epoch}, fingerprint {position.get('fingerprint')})" \
            if index is not None else ""
        passed = self._passed_over(choice)
        if choice.entry is None or choice.snapshot is None:
            checkpoint = self.run.stop_checkpoint(step)
            outcome = {"taken": "stop", "update_applied": False, "rolled_back_to": None, "skipping_batches": None,
                       "stopped": True, "checkpoint": checkpoint_name(checkpoint)}
            alert = Alert(step=step, kind="recovery", metric=names.RECOVERIES, value=r.used,
                          threshold=r.max_recoveries, lr=self.run.lr, action="stop", checkpoint=checkpoint,
                          message=f"spike at step {step}{where}: cannot recover: {passed}; no snapshot passed its "
                                  "check, so nothing was restored and the run stops with a checkpoint (this step's "
                                  "update dropped)", outcome=outcome)
            return StepDone(stop=True, alerts=(alert,))
        entry = choice.entry
        restore_snapshot(state, choice.snapshot)  # verified: every load in it succeeds, the restore is whole
        r.ring.keep_through(entry)
        if entry.detectors is not None:
            self._judge.load_detector_states(entry.detectors)
        begun = r.begin(step, entry.step, epoch, index + 1 + self.run.skip_lag if index is not None else None)
        window = r.window
        skipping = [window.start, window.stop - 1] if window is not None else None
        outcome = {"taken": "recover", "update_applied": False, "rolled_back_to": int(entry.step),
                   "skipping_batches": skipping, "stopped": False, "checkpoint": None}
        fell_back = f"{passed}; fell back to an older snapshot: " if choice.passed_over else ""
        alert = Alert(step=step, kind="recovery", metric=names.RECOVERIES, value=r.used, threshold=r.max_recoveries,
                      lr=self.run.lr, action="recover", outcome=outcome,
                      message=f"spike at step {step}{where}: {fell_back}{r.message(begun)}")
        return StepDone(rolled_back_to=entry.step, alerts=(alert,),
                        skipping=(skipping[0], skipping[1]) if skipping is not None else None)

    def _passed_over(self, choice: RingChoice) -> str:
        """The snapshots a recovery could not use, for its alert: this rank's with their problem, another
        rank's by file name (its own log line says why)."""
        run, own = self.run, {entry.step: (entry, problem) for entry, problem in choice.failed}
        said = []
        for rank, step in choice.passed_over:
            if step is None:
                said.append(f"rank {rank} holds no snapshot (its ring is off)" if run.size > 1 else
                            "the ring holds no snapshot (it was switched off)")
            elif rank == run.rank and step in own:
                entry, problem = own[step]
                said.append(f"{entry.where} (step {step}) {problem}")
            else:
                said.append(f"rank {rank}'s {RING_DIR}/{ring_file(step, rank)} (step {step}) failed its check "
                            f"(rank {rank}'s log says why)")
        return "; ".join(said)

    def state_dict(self) -> dict[str, Any]:
        return {"recovery": self.recovery.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recovery.load_state_dict(state.get("recovery", {}))  # checks its own fields (ValueError) first
        self._resumed = True
