"""``on_spike="recover"``: the PaLM recipe as one action (Chowdhery et al. 2022, section 5.1: restart from a
checkpoint about 100 steps before the spike and skip about 200-500 data batches).

On a spike the engine drops the step's update, then (this module):

1. **rolls back** to the newest snapshot taken at least ``rollback_steps`` optimizer steps before the spiking
   step, from a :class:`SnapshotRing`. Snapshots are taken every ``spacing = min(rollback_every,
   rollback_steps)`` steps and the ring keeps ``length = ceil(rollback_steps / spacing) + 1`` of them, so the
   snapshot it needs always exists once the run is that old: the rollback goes back between ``rollback_steps``
   and ``rollback_steps + spacing - 1`` steps (to the oldest snapshot, the start of the run or of the resume,
   when the run is younger). The ring lives in host memory: ``length`` copies of the weights, the optimizer
   state and the schedulers (with AdamW about ``3 x 4 bytes x parameters`` each; 2 copies with the defaults);
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

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .rollback import Snapshot, Trainables, take_snapshot

__all__ = ["LrScale", "Recovery", "RingEntry", "SkipStream", "SkipWindow", "SnapshotRing", "ring_layout"]


def ring_layout(rollback_steps: int, rollback_every: int) -> tuple[int, int]:
    """``(spacing, length)`` of the snapshot ring: a snapshot every ``spacing`` steps, ``length`` kept."""
    spacing = min(rollback_every, rollback_steps)
    return spacing, math.ceil(rollback_steps / spacing) + 1


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_host(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_host(v) for v in value)
    return value


@dataclass
class RingEntry:
    """One snapshot of the ring, with the loss and gradient-norm detectors as they were then."""

    snapshot: Snapshot
    detectors: dict[str, list[dict[str, Any]]] | None


class SnapshotRing:
    """The last ``length`` snapshots, one every ``spacing`` optimizer steps, in host memory."""

    def __init__(self, spacing: int, length: int) -> None:
        self.spacing, self.length = spacing, length
        self.entries: deque[RingEntry] = deque(maxlen=length)

    def due(self, step: int) -> bool:
        return step % self.spacing == 0 and not (self.entries and self.entries[-1].snapshot.step == step)

    def take(self, state: Trainables, detectors: dict[str, list[dict[str, Any]]] | None = None) -> None:
        snapshot = take_snapshot(state)
        # Host copies: the ring holds several states and must not take the accelerator's memory.
        for name in ("model", "optimizers", "schedulers", "precision"):
            setattr(snapshot, name, _to_host(getattr(snapshot, name)))
        self.entries.append(RingEntry(snapshot, detectors))

    def target(self, step: int, back: int) -> RingEntry | None:
        """The newest snapshot taken at least ``back`` steps before ``step`` (else the oldest; None if empty),
        dropping every newer one (they belong to the trajectory being abandoned)."""
        if not self.entries:
            return None
        chosen = next((e for e in reversed(self.entries) if e.snapshot.step <= step - back), self.entries[0])
        while self.entries[-1] is not chosen:
            self.entries.pop()
        return chosen

    @property
    def steps(self) -> list[int]:
        return [e.snapshot.step for e in self.entries]


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
                 lr_steps: int, max_recoveries: int, cooldown_steps: int) -> None:
        self.rollback_steps, self.skip_batches = rollback_steps, skip_batches
        self.lr_factor, self.lr_steps = lr_factor, lr_steps
        self.max_recoveries, self.cooldown_steps = max_recoveries, cooldown_steps
        self.ring = SnapshotRing(*ring_layout(rollback_steps, rollback_every))
        self.used = 0
        self.last_step: int | None = None
        self.window: SkipWindow | None = None
        self.lr_until: int | None = None  # optimizer steps up to this one (inclusive) run at lr x lr_factor
        self.lr: list[LrScale] = []  # one per optimizer while a scaled step is due
        self.skipped_batches = 0  # over the run, counted by the adapters' streams
        self.history: list[dict[str, Any]] = []  # one entry per recovery (the summary and the benchmark read it)
        #: Where the adapter's data stream stands (epoch, next data index, batches given to the loop), kept
        #: by the Trainer adapter so that a resume continues the epoch's stream at the same batch.
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
