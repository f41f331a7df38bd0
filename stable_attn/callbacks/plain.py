"""StableAttentionGuard: the stabilized attention, monitoring, alerts and spike handling for a hand-written
training loop (torchtitan style: FSDP2 ``fully_shard``, DDP, or one process), with no training framework.

The same :class:`~stable_attn.monitor.engine.MonitorEngine` as the Lightning and transformers.Trainer callbacks; the
loop makes the calls a framework's hooks would (docs/DISTRIBUTED.md, "The plain loop", shows the loop)::

    guard = StableAttentionGuard(on_spike="skip")
    guard.setup(model, optimizer, [scheduler], log_dir="runs/1")   # after fully_shard / DDP, before the first step
    for step, batch in enumerate(guard.batches(loader), start=guard.start_step):
        guard.begin_step(step)
        loss = model(batch)
        guard.add_loss(loss)
        loss.backward()
        decision = guard.before_optimizer_step()   # every rank: one all-gather, the same answer everywhere
        if decision.apply:
            optimizer.step()
        optimizer.zero_grad()
        scheduler.step()                           # as after an AMP overflow: the schedule goes on
        end = guard.end_step()                     # rollback / recovery restored here, metrics, the stop path
        if end.stop_checkpoint is not None:
            ...                                    # save there (every rank), then leave the loop
            break
    guard.close()

What makes it right on many ranks: the decision comes from every rank's loss, gradient norm and non-finite flag,
gathered in one packed all-gather per step (plus one scalar all-reduce per device mesh for a DTensor gradient
norm) that every rank issues whatever it saw, and every rank runs every rank's detectors, so all ranks reach the
same :class:`~stable_attn.monitor.loop.Decision`; the loop branches only on it, never on a rank's own values.
A dropped update has its gradients already set to None by the engine, so even an optimizer ``step()`` called by
mistake changes nothing in torch's optimizers; not calling it also spares optimizers that would touch parameters
without gradients.

With ``device_skip=True`` the decision is made on the device: :attr:`GuardDecision.apply` is always True (call
``optimizer.step()``), a dropped update is undone by :meth:`StableAttentionGuard.end_step`, and the step's values
are read at the next step; call :meth:`StableAttentionGuard.state_dict` (it reads the last step) before saving the
optimizer's state.

``on_spike="recover"`` skips batches: the loop must draw them through :meth:`StableAttentionGuard.batches`, which
discards those of a skip window before the loop sees them (checked at the first step).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..monitor.actions.recovery import SkipStream
from ..monitor.config import MonitorConfig
from ..monitor.engine import MonitorEngine, Trainables, World
from ..monitor.loop import Decision, StepEnd

if TYPE_CHECKING:  # PEP 692: names and types of **options for pyright, mypy, PyCharm
    from typing_extensions import Unpack

    from ..monitor.config import MonitorOptions

__all__ = ["GuardDecision", "StableAttentionGuard", "distributed_world"]

log = logging.getLogger("stable_attn")


def distributed_world(device: torch.device | str | None = None, group: Any = None) -> World:
    """The :class:`~stable_attn.monitor.loop.World` of this process: one process, or the initialised
    ``torch.distributed`` group ``group`` (the default group when None), gathering with ``all_gather``.
    The gradient norm is :func:`~stable_attn.monitor.grad_norm.total_grad_norm`, right for one process, DDP and
    DTensor gradients (FSDP2, tensor parallelism)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return World(device=device)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1:
        return World(device=device)

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    return World(rank=rank, size=size, device=device, all_gather=all_gather)


@dataclass(frozen=True)
class GuardDecision:
    """What the step's judgement asks of the loop (the same on every rank)."""

    decision: Decision

    @property
    def apply(self) -> bool:
        """Call ``optimizer.step()``: the update is kept (its gradients are finite and no spike dropped it), or gated
        on the device (``device_skip=True``: :attr:`Decision.gated`)."""
        return not self.decision.drop

    @property
    def drop(self) -> bool:
        return self.decision.drop

    @property
    def action(self) -> str:
        return self.decision.action

    @property
    def stop(self) -> bool:
        """``end_step`` will name a stop checkpoint: save it, then leave the loop."""
        return self.decision.stop


class StableAttentionGuard:
    """Swap in the stabilized attention, monitor, alert and act on spikes from a hand-written training loop.

    The arguments are :class:`~stable_attn.monitor.config.MonitorConfig`'s, the same as
    :class:`~stable_attn.callbacks.StableAttentionCallback`'s (whose docstring says what each does). Call
    :meth:`setup` once the model is wrapped (``fully_shard``, DDP) and any checkpoint loaded, then per optimizer
    step :meth:`begin_step`, :meth:`add_loss` per micro-batch, :meth:`before_optimizer_step`, the optimizer step
    when :attr:`GuardDecision.apply`, and :meth:`end_step`; :meth:`close` at the end (also when the loop raises).
    Every call on every rank, in the same order.
    """

    def __init__(self, **options: Unpack[MonitorOptions]) -> None:
        config = MonitorConfig.from_options(options, owner="StableAttentionGuard")
        self.engine = MonitorEngine.from_config(config, name=type(self).__name__)
        self._model: torch.nn.Module | None = None
        self._optimizer: Any = None
        self._schedulers: Sequence[Any] = ()
        self._scaler: Any = None
        self._step = -1
        #: The step the loop starts at: 0, or the step after the checkpoint's (:meth:`load_state_dict`).
        self.start_step = 0
        self._in_step = False
        self._pending: list[tuple[Any, int, int]] = []  # batches drawn before begin_step: (batch, epoch, index)
        self._streamed = False

    __init__.__signature__ = MonitorConfig.signature()  # type: ignore[attr-defined]  # for help() and IDEs

    def __getattr__(self, name: str) -> Any:
        engine = self.__dict__.get("engine")
        if engine is not None and name in ("alert_count", "alert_kinds", "skipped_steps", "rollbacks", "layers",
                                           "stop_checkpoint", "log_dir", "not_training_streak", "recovery"):
            return getattr(engine, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------ start and end
    def setup(self, model: torch.nn.Module, optimizer: Any, schedulers: Iterable[Any] = (), *, log_dir: str = ".",
              log_every_n_steps: int = 50, world: World | None = None, scaler: Any = None) -> None:
        """Swap the transformers models under ``model``, attach statistics, open the alert channels (rank zero)
        and take the action's first snapshot. Call it on every rank after sharding and after loading any
        checkpoint (:meth:`load_state_dict` first).

        ``optimizer``: the one optimizer of the step (its gradients are dropped, its state snapshot);
        ``schedulers``: LR schedulers (snapshot and restored with a rollback); ``log_every_n_steps``: applies
        when the constructor's is None; ``world``: default :func:`distributed_world` on the model's device;
        ``scaler``: an fp16 ``GradScaler`` (its inf gradients are not alerts; restored with a rollback).
        """
        if world is None:
            first = next(iter(model.parameters()), None)
            world = distributed_world(first.device if first is not None else None)
        self._model, self._optimizer, self._schedulers, self._scaler = model, optimizer, list(schedulers), scaler
        self.engine.setup(model, world)
        self.engine.start(log_dir, log_every_n_steps)
        if world.is_zero:
            log.warning("%s: %s", self.engine.name, self.engine.config.spike_line())
        self.engine.train_start(self._trainables(self.start_step))

    def close(self, when: str = "at the end of training") -> None:
        """Close the alert channels, put back what the setup patched, log the summary line (rank zero)."""
        self.engine.end_run(when)
        self.engine.log_summary()

    def summary(self) -> str:
        """One line: the alerts of the run by kind, the updates skipped, rollbacks and the stop checkpoint."""
        return self.engine.summary()

    def _trainables(self, step: int) -> Trainables:
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__}: call setup(model, optimizer, ...) before the first step")
        return Trainables(step=step, model=self._model, optimizers=[self._optimizer], schedulers=self._schedulers,
                          precision=self._scaler)

    # ------------------------------------------------------------ the data
    def batches(self, data: Iterable[Any], epoch: int = 0, start: int = 0) -> Iterator[Any]:
        """The batches of ``data`` (one epoch), without those a recovery's skip window covers; each one's epoch and
        index in the epoch (counting discarded ones, from ``start`` when ``data`` resumes mid-epoch) go to the
        alerts' evidence and the skip window. Draw every micro-batch through it."""
        self._streamed = True
        stream = SkipStream(iter(data), epoch, self.engine.skips, index=start)
        recovery = self.engine.recovery
        for position, batch in enumerate(stream):
            index = stream.data_index(position)
            if recovery is not None:  # where a checkpoint saved after this batch resumes the epoch's data
                recovery.stream = {"epoch": epoch, "index": index + 1, "given": position + 1}
            if self._in_step:
                self.engine.add_batch(batch, epoch=epoch, batch_index=index)
            else:
                self._pending.append((batch, epoch, index))
            yield batch

    # ------------------------------------------------------------ each step
    def begin_step(self, step: int) -> bool:
        """Optimizer step ``step`` (counted from 0: the updates done before it) starts; True when it is monitored
        (layer statistics on: ``(step + 1) % log_every_n_steps == 0``). Call it before the step's first forward."""
        if self.engine.recovery is not None and not self._streamed:
            raise ValueError(f"{type(self).__name__}(on_spike='recover') skips the batches of a skip window, and this "
                             "loop draws none through guard.batches(loader): iterate over guard.batches(...) instead "
                             "of the loader, or use another on_spike")
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__}: call setup(model, optimizer, ...) before begin_step")
        self._step, self._in_step = step, True
        monitored = self.engine.begin_step(step)
        pending, self._pending = self._pending, []
        for batch, epoch, index in pending:
            self.engine.add_batch(batch, epoch=epoch, batch_index=index)
        return monitored

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss as it is backpropagated (divided by the accumulation steps: the sum is the
        step's loss). Not a collective: each rank's own loss, shared at :meth:`before_optimizer_step`."""
        self.engine.add_loss(loss)

    def before_optimizer_step(self) -> GuardDecision:
        """Judge the step (gradients complete, unscaled, after any clipping's norm was read): one all-gather of
        every rank's values, the same decision on every rank; a dropped update's gradients are set to None here."""
        model = self._model
        if model is None:
            raise RuntimeError(f"{type(self).__name__}: call setup(model, optimizer, ...) before the first step")
        return GuardDecision(self.engine.before_optimizer_step(self._optimizer, model.parameters(),
                                                               scaler=self._scaler is not None))

    def end_step(self) -> StepEnd:
        """After the optimizer and LR-scheduler step: statistics, QK-Clip, the action's restore or snapshot, and
        a stop the step decided (``StepEnd.stop_checkpoint``: save there on every rank, then stop)."""
        self._in_step = False
        return self.engine.end_step(self._trainables(self._step + 1))

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """The engine's state (detectors, recovery budget, skip window, counts) and the next step; plain Python,
        the same on every rank."""
        return {"engine": self.engine.state_dict(), "next_step": self._step + 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output before :meth:`setup`; :attr:`start_step` becomes the saved next step."""
        if not isinstance(state_dict, dict) or "engine" not in state_dict:
            raise ValueError(f"{type(self).__name__}.load_state_dict takes what state_dict() returned (a dict with "
                             f"'engine' and 'next_step'), got {type(state_dict).__name__}")
        self.engine.load_state_dict(state_dict["engine"], f"{type(self).__name__} state")
        self.start_step = int(state_dict.get("next_step", 0))


MonitorConfig.document(StableAttentionGuard, log_every="the ``log_every_n_steps`` given to ``setup``",
                       log_dir="the ``log_dir`` given to ``setup``")
