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
   or, when that would take more than ``snapshot_memory_limit`` bytes, as files under ``{log_dir}/recovery``;
   snapshots newer than the one restored belong to the abandoned trajectory and are dropped;
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

import contextlib
import logging
import math
import os
import re
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .. import names
from ..alerts.alert import Alert
from .base import Action, JudgeStates, RunContext, StepDone, Verdict
from .snapshots import (
    Snapshot,
    Trainables,
    restore_snapshot,
    snapshot_from_state,
    snapshot_state,
    take_snapshot,
    tensors_in,
)

__all__ = ["RING_DIR", "LrScale", "Recover", "Recovery", "RingEntry", "SkipStream", "SkipWindow", "SnapshotRing",
           "ring_layout", "snapshot_bytes"]

log = logging.getLogger("stable_attn")


def ring_layout(rollback_steps: int, rollback_every: int) -> tuple[int, int]:
    """``(spacing, length)`` of the snapshot ring: a snapshot every ``spacing`` steps, ``length`` kept."""
    spacing = min(rollback_every, rollback_steps)
    return spacing, math.ceil(rollback_steps / spacing) + 1


def _to_host(value: Any) -> Any:
    """``value``'s tensors on the host; those already there are kept (take_snapshot's copies, not the run's)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_host(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_host(v) for v in value)
    return value


def snapshot_bytes(snapshot: Snapshot) -> int:
    """Bytes of the tensors a snapshot holds (weights, optimizer state, schedulers, precision plugin)."""
    total = 0
    for name in ("model", "optimizers", "schedulers", "precision"):
        for _, t in tensors_in(getattr(snapshot, name), name):
            total += t.numel() * t.element_size()
    return total


#: One snapshot file of the on-disk ring: ``snapshot-step=<step>-rank=<rank>.pt`` under ``{log_dir}/recovery``.
RING_DIR = "recovery"
_RING_FILE = re.compile(r"snapshot-step=(\d+)-rank=(\d+)\.pt")


@dataclass
class RingEntry:
    """One snapshot of the ring, with the loss and gradient-norm detectors as they were then: in host memory
    (``snapshot``) or in a file (``path``, the snapshot dropped from memory)."""

    step: int
    snapshot: Snapshot | None
    detectors: dict[str, list[dict[str, Any]]] | None
    path: str | None = None

    def load(self) -> Snapshot:
        """The snapshot, read back from its file if it is on disk (checked as a resumed one is)."""
        if self.snapshot is not None:
            return self.snapshot
        assert self.path is not None
        return snapshot_from_state(torch.load(self.path, map_location="cpu", weights_only=True))

    def drop(self) -> None:
        """Delete the entry's file (an entry in memory: nothing to do)."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)


class SnapshotRing:
    """The last ``length`` snapshots, one every ``spacing`` optimizer steps, in host memory, or on disk when
    they would take more than ``memory_limit`` bytes of it.

    The choice is made at the first snapshot: ``length x`` its bytes against ``memory_limit`` (None: never on
    disk; 0: always). On disk each snapshot is one ``torch.save`` file in ``directory``, written to a temporary
    name and renamed (a run killed while writing leaves no half file under the ring's name), deleted when the
    ring moves past it, when a rollback abandons it and by :meth:`clear`; files of the same rank that an
    earlier run left there are deleted when the ring starts."""

    def __init__(self, spacing: int, length: int, memory_limit: int | None = None, directory: str | None = None,
                 rank: int = 0) -> None:
        self.spacing, self.length = spacing, length
        self.memory_limit, self.directory, self.rank = memory_limit, directory, rank
        self.entries: deque[RingEntry] = deque()
        #: Decided at the first snapshot (None before): whether the snapshots are files.
        self.on_disk: bool | None = None
        #: One snapshot's bytes, measured at the first snapshot.
        self.snapshot_bytes: int | None = None

    def due(self, step: int) -> bool:
        return step % self.spacing == 0 and not (self.entries and self.entries[-1].step == step)

    def _decide(self, snapshot: Snapshot) -> None:
        self.snapshot_bytes = snapshot_bytes(snapshot)
        self.on_disk = self.memory_limit is not None and self.length * self.snapshot_bytes > self.memory_limit
        if self.on_disk:
            if self.directory is None:
                raise ValueError(f"the recovery ring needs {self.length} x {self.snapshot_bytes} bytes, over "
                                 f"snapshot_memory_limit={self.memory_limit}, and has no directory for its files; "
                                 "start the engine with a log_dir")
            os.makedirs(self.directory, exist_ok=True)
            for name in os.listdir(self.directory):  # an earlier run's files of this rank: never read again
                match = _RING_FILE.fullmatch(name)
                if match is not None and int(match.group(2)) == self.rank:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(self.directory, name))

    def take(self, state: Trainables, detectors: dict[str, list[dict[str, Any]]] | None = None) -> None:
        snapshot = take_snapshot(state)
        # Host copies: the ring holds several states and must not take the accelerator's memory.
        for name in ("model", "optimizers", "schedulers", "precision"):
            setattr(snapshot, name, _to_host(getattr(snapshot, name)))
        if self.on_disk is None:
            self._decide(snapshot)
        entry = RingEntry(snapshot.step, snapshot, detectors)
        if self.on_disk:
            assert self.directory is not None
            entry.path = os.path.join(self.directory, f"snapshot-step={snapshot.step}-rank={self.rank}.pt")
            partial = entry.path + ".partial"
            torch.save(snapshot_state(snapshot), partial)
            os.replace(partial, entry.path)
            entry.snapshot = None
        self.entries.append(entry)
        while len(self.entries) > self.length:
            self.entries.popleft().drop()

    def target(self, step: int, back: int) -> RingEntry | None:
        """The newest snapshot taken at least ``back`` steps before ``step`` (else the oldest; None if empty),
        dropping every newer one (they belong to the trajectory being abandoned)."""
        if not self.entries:
            return None
        chosen = next((e for e in reversed(self.entries) if e.step <= step - back), self.entries[0])
        while self.entries[-1] is not chosen:
            self.entries.pop().drop()
        return chosen

    def clear(self) -> None:
        """Drop every snapshot (and its file)."""
        while self.entries:
            self.entries.pop().drop()

    @property
    def steps(self) -> list[int]:
        return [e.step for e in self.entries]


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

    def start(self, state: Trainables, judge: JudgeStates) -> None:
        self._judge = judge
        resumed, self._resumed = self._resumed, False
        r, run = self.recovery, self.run
        ring = r.ring
        ring.clear()
        ring.directory, ring.rank = os.path.join(run.log_dir or ".", RING_DIR), run.rank
        ring.take(state, judge.detector_states())  # the oldest state a recovery can go back to
        if run.is_zero:
            log.info("%s: recovery snapshot ring of %d x %.1f MB %s", run.name, ring.length,
                     (ring.snapshot_bytes or 0) / 1e6, f"on disk in {ring.directory} (over snapshot_memory_limit="
                     f"{ring.memory_limit})" if ring.on_disk else "in host memory")
        if resumed and run.is_zero:
            log.warning("%s: recovery snapshot ring starts afresh at global_step %d (the ring is not saved in "
                        "checkpoints); recoveries used: %d of %d", run.name, state.step, r.used, r.max_recoveries)

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
        # for the next optimizer.step() only: installed now, after this step's optimizer and scheduler steps
        # (Lightning runs the step's closure, and so before_optimizer_step, inside optimizer.step())
        r.scale_lr(step + 1, state.optimizers)
        return done

    def _recover(self, step: int, state: Trainables) -> StepDone:
        """Roll back to the ring's snapshot ``rollback_steps`` back, open the skip window, alert."""
        r = self.recovery
        entry = r.ring.target(step, r.rollback_steps)
        assert entry is not None and self._judge is not None  # start put the first snapshot in the ring
        restore_snapshot(state, entry.load())
        if entry.detectors is not None:
            self._judge.load_detector_states(entry.detectors)
        position = self.run.position() or {}
        epoch, index = position.get("epoch"), position.get("batch_index")
        begun = r.begin(step, entry.step, epoch, index + 1 + self.run.skip_lag if index is not None else None)
        where = f" (after batch {index} of epoch {epoch}, fingerprint {position.get('fingerprint')})" \
            if index is not None else ""
        window = r.window
        skipping = [window.start, window.stop - 1] if window is not None else None
        outcome = {"taken": "recover", "update_applied": False, "rolled_back_to": int(entry.step),
                   "skipping_batches": skipping, "stopped": False, "checkpoint": None}
        alert = Alert(step=step, kind="recovery", metric=names.RECOVERIES, value=r.used, threshold=r.max_recoveries,
                      lr=self.run.lr, action="recover", message=f"spike at step {step}{where}: {r.message(begun)}",
                      outcome=outcome)
        return StepDone(rolled_back_to=entry.step, alerts=(alert,))

    def state_dict(self) -> dict[str, Any]:
        return {"recovery": self.recovery.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recovery.load_state_dict(state.get("recovery", {}))  # checks its own fields (ValueError) first
        self._resumed = True
