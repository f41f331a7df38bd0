"""StableAttentionTrainerCallback: the stabilized attention, monitoring, alerts and spike handling for a
transformers ``Trainer`` (and the trainers built on it, such as TRL's).

A thin adapter: :class:`~stable_attn.monitor.engine.MonitorEngine` decides everything; this module
only turns the Trainer's hooks into the engine's calls. One optimizer step of the Trainer
(``on_pre_optimizer_step`` exists from transformers 4.45 on, 4.44 lacks it; the project requires
transformers >= 5, whose Trainer also computes the gradient norm on every step):

1. ``on_step_begin`` (first micro-batch): :meth:`~MonitorEngine.begin_step`.
2. ``Trainer.training_step`` returns each micro-batch's loss, already divided for gradient
   accumulation: :meth:`~MonitorEngine.add_loss`.
3. The Trainer computes the gradient norm before clipping (``accelerator.clip_grad_norm_``, with
   ``max_norm=inf`` when ``max_grad_norm`` is 0) and clips; that pre-clip norm is what the detectors see.
4. ``on_pre_optimizer_step`` (gradients complete, clipped, update not done):
   :meth:`~MonitorEngine.before_optimizer_step`. A dropped update has its gradients set to None there, so
   ``optimizer.step()`` leaves every weight and every optimizer state tensor as it was (torch optimizers
   skip parameters without a gradient: no moment update, no step count, no weight decay).
5. ``on_step_end`` (after the LR scheduler step): :meth:`~MonitorEngine.end_step`: statistics, rollback,
   stop. Monitored steps are the Trainer's logging steps; their metrics go into the Trainer's own log
   entry of that step, so ``trainer.state.log_history`` and every ``report_to`` backend get them.

Why the callback reaches into the Trainer: its callbacks receive neither the loss, nor the gradient norm
before clipping, nor a way to add metrics to the step's log (``on_log`` runs after ``log_history`` and
the reporting integrations have their copy). So at ``on_train_begin`` the callback finds the Trainer
that called it (it is ``self`` in the calling frame of ``CallbackHandler``) and wraps four of its
bound methods on that instance only: ``training_step``, ``accelerator.clip_grad_norm_``, ``log`` and
``get_batch_samples`` (the data position of each micro-batch, and the skip window of ``on_spike="recover"``).
``on_train_end`` puts them back; so does a ``train()`` that raises, through a wrapper of ``train`` itself.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

from ..monitor import names
from ..monitor.actions.recovery import SkipStream
from ..monitor.config import MonitorConfig
from ..monitor.engine import MonitorEngine, Trainables, World
from ..monitor.grad_norm import total_grad_norm

__all__ = ["StableAttentionTrainerCallback"]

if TYPE_CHECKING:  # PEP 692: names and types of **options for pyright, mypy, PyCharm
    from typing_extensions import Unpack

    from ..monitor.config import MonitorOptions

log = logging.getLogger("stable_attn")

_NAME = "StableAttentionTrainerCallback"
# The rollback snapshot (weights, optimizer state: tensors) saved next to a single-process checkpoint.
SNAPSHOT_FILE = names.ROLLBACK_SNAPSHOT_FILE
# Constructor arguments that trainer_state.json can hold (plain values, no secrets), and the others (objects,
# callables, the webhook's URL and headers, which often carry a token), never written there: MonitorConfig says.
_JSON_ARGS = MonitorConfig.saved_names()
_OTHER_ARGS = MonitorConfig.unsaved_names()
# The Trainer logs its own loss, gradient norm and learning rate; the callback adds only its own metrics.
_TRAINER_LOGS = frozenset(names.TRAINER_LOGS.values())


def _calling_trainer() -> tuple[Trainer | None, str | None]:
    """The ``transformers.Trainer`` whose training loop is running this hook (a few frames up), and the
    checkpoint that loop resumes from (its ``resume_from_checkpoint``, already resolved to a path), or
    ``(None, None)``."""
    frame = sys._getframe(1)
    for _ in range(12):
        frame = frame.f_back
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            resume = frame.f_locals.get("resume_from_checkpoint")
            return candidate, resume if isinstance(resume, (str, os.PathLike)) else None
    return None, None


def _all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order (``torch.distributed.all_gather``: gloo and NCCL)."""
    import torch.distributed as dist

    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return torch.stack(out)


_ABSENT = object()


def _first_index(frame: Any) -> int:
    """The data index of the first batch an epoch's iterator yields: 0, or in a resumed epoch the number of
    batches the Trainer's ``skip_first_batches`` consumed, which its epoch loop (the caller of
    ``get_batch_samples``) holds as ``step`` (``steps_trained_in_current_epoch - 1``) before its first draw."""
    step = frame.f_locals.get("step") if frame is not None else None
    return step + 1 if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0


class _Taps:
    """The four wrapped methods of one Trainer instance, and what they saw."""

    def __init__(self, trainer: Trainer, on_loss: Callable[[torch.Tensor], None],
                 on_batch: Callable[[Any, int, int], None] | None = None,
                 open_stream: Callable[[Any, int, int], SkipStream] | None = None) -> None:
        self.trainer = trainer
        self.norm: torch.Tensor | None = None  # the Trainer's pre-clip gradient norm of the current step
        self.pending: tuple[int, dict[str, float]] | None = None  # metrics waiting for the Trainer's log
        step_fn, clip_fn, log_fn = trainer.training_step, trainer.accelerator.clip_grad_norm_, trainer.log
        samples_fn = trainer.get_batch_samples
        # What each wrapped name was on the instance itself (someone else's wrapper), to put back as it was.
        self._own = [(owner, name, owner.__dict__.get(name, _ABSENT)) for owner, name in
                     ((trainer, "training_step"), (trainer.accelerator, "clip_grad_norm_"), (trainer, "log"),
                      (trainer, "get_batch_samples"))]
        # The data position of each micro-batch: the epoch's iterator is drawn through a SkipStream, which
        # numbers the batches (and, with on_spike="recover", discards a skip window's before the loop sees them).
        self.stream: SkipStream | None = None
        self._source: Any = None  # the Trainer's epoch iterator the stream draws from
        self._positions: list[int] = []  # data indices of the micro-batches drawn, not yet trained on

        def get_batch_samples(epoch_iterator: Any, num_batches: int, *args: Any, **kwargs: Any) -> Any:
            if epoch_iterator is not self._source or self.stream is None:
                self._source = epoch_iterator
                epoch = math.floor((trainer.state.epoch or 0.0) + 1e-9)
                start = _first_index(sys._getframe(1))
                self.stream = open_stream(epoch_iterator, epoch, start) if open_stream is not None else \
                    SkipStream(epoch_iterator, epoch, lambda e, i: False, index=start)
                self._positions = []
            stream = self.stream
            before = stream.given
            out = samples_fn(stream, num_batches, *args, **kwargs)
            self._positions += [stream.data_index(p) for p in range(before, stream.given)]
            return out

        def training_step(*args: Any, **kwargs: Any) -> torch.Tensor:
            if on_batch is not None and self.stream is not None:
                inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
                index = self._positions.pop(0) if self._positions else None
                on_batch(inputs, self.stream.epoch, index)
            loss = step_fn(*args, **kwargs)
            on_loss(loss)
            return loss

        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            norm = clip_fn(*args, **kwargs)
            if isinstance(norm, (int, float)):  # an accelerator that reports a float
                self.norm = torch.tensor(float(norm))
            else:
                self.norm = norm if isinstance(norm, torch.Tensor) else None
            return norm

        def log_(logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            pending, self.pending = self.pending, None
            if pending is not None and pending[0] == trainer.state.global_step:
                logs.update(pending[1])
            return log_fn(logs, *args, **kwargs)

        trainer.training_step = training_step
        trainer.accelerator.clip_grad_norm_ = clip_grad_norm_
        trainer.log = log_
        trainer.get_batch_samples = get_batch_samples

    def grad_norm(self, parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
        """The Trainer's pre-clip norm of this step; without one (a clip that bypasses the accelerator, such
        as SageMaker's fp16 or gradients on mixed device meshes), the norm of the gradients as they are now."""
        norm, self.norm = self.norm, None
        return norm.detach() if norm is not None else total_grad_norm(parameters)

    def flush(self) -> None:
        """Metrics of a monitored step the Trainer did not log: an entry of their own."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.trainer.log(dict(pending[1]))

    def remove(self) -> None:
        for owner, name, before in self._own:
            if before is _ABSENT:
                owner.__dict__.pop(name, None)  # the class's method again
            else:
                setattr(owner, name, before)


class StableAttentionTrainerCallback(TrainerCallback, ExportableState):
    r"""Swap in the stabilized attention, monitor attention and training health, alert, and act on spikes,
    in a ``transformers.Trainer``::

        trainer = Trainer(model=model, args=args, train_dataset=data,
                          callbacks=[StableAttentionTrainerCallback(on_spike="skip")])

    One per Trainer: ``train()`` with two of them raises ValueError before anything is swapped or wrapped.

    **Swap.** At ``on_train_begin`` the Trainer's model (every outermost ``PreTrainedModel`` inside it) is
    switched to ``attn_implementation="stable_attn"`` and gets per-layer statistics.

    **Monitor.** On the Trainer's logging steps (every ``logging_steps`` with ``logging_strategy="steps"``;
    ``log_every_n_steps`` overrides), the per-layer saturation, fixed-block rate, max logit and sink mass
    (``stable_attn/<stat>/layer<i>``) and the alert count (``stable_attn/alerts``) join the Trainer's own
    log entry of that step (``loss``, ``grad_norm``, ``learning_rate``): ``trainer.state.log_history``,
    ``trainer_state.json`` and every ``report_to`` backend get them.

    **Detect, alert, act.** Every optimizer step's loss (each rank's, summed over the accumulated micro-batches)
    and gradient norm before clipping go to the spike detectors, on every rank, with the same rules, alerts and
    actions as :class:`~stable_attn.callbacks.StableAttentionCallback`: alerts to the ``stable_attn`` logger,
    ``<output_dir>/<alerts_file>`` (JSONL), ``on_alert`` callables and ``webhook_url``; ``on_spike="skip"``
    drops the step's update (weights and optimizer state unchanged; the gradients were already clipped, and are
    dropped with the clipping; the LR scheduler still advances, so the step's learning rate is used up as if the
    update had been applied); ``"rollback"`` drops it and restores the model, optimizer, LR scheduler, grad
    scaler and RNG state kept in memory every ``rollback_every`` steps; ``"stop"`` drops it, saves a checkpoint
    (``<output_dir>/checkpoint-<step>``, the Trainer's own format, whatever ``save_strategy`` says) and stops
    training; ``"recover"`` rolls back ``rollback_steps``, skips the next ``skip_batches`` batches through a
    wrapped ``Trainer.get_batch_samples`` (exact on a resume inside the window), optionally scales the learning
    rate, and stops after ``max_recoveries`` (docs/RECOVERY.md). Those three lose progress, so they wait for a
    spike that lasts ``spike_confirm_steps`` (3) steps in a row, skipping its earlier steps (a spike of one or
    two steps only skips; a drift, a NaN or inf act at once). A NaN or inf loss or gradient never reaches
    the weights. Under DDP every rank shares its values
    each step, so all ranks take the same action. DeepSpeed is refused (ValueError at ``train()``): it applies
    each update inside ``backward()``, before any callback runs, so no update could be dropped.

    **Steps.** Steps are counted as the Trainer counts them: step ``N`` is the ``N``-th optimizer
    update, logged at ``"step": N`` and checkpointed as ``checkpoint-N``; alerts, ``skipped_steps`` and
    ``rollbacks`` use the same numbers.

    **Resume.** The detectors' state is saved in each checkpoint's ``trainer_state.json`` (the Trainer's
    ``ExportableState`` mechanism) and restored by ``trainer.train(resume_from_checkpoint=...)``. With
    ``on_spike="rollback"`` in a single process, the last rollback snapshot is saved beside it
    (``checkpoint-N/stable_attn_rollback.pt``: one more copy of the weights and optimizer state), so a
    resumed run rolls back as one never interrupted; with several ranks a resumed run takes a fresh
    snapshot at its start (the engine says so at WARNING). Leave
    ``TrainingArguments.restore_callback_states_from_checkpoint`` False (the default): with True the
    Trainer rebuilds the callback from the JSON, which cannot hold callables, detector objects or the
    webhook, so the callback refuses it when any of those were given.

    **End of run.** ``on_train_end`` logs the summary line, closes the alert channels (within one
    ``webhook_timeout``), puts back ``F.scaled_dot_product_attention`` if ``patch_sdpa`` replaced it and
    unwraps the Trainer. The Trainer has no hook for a ``train()`` that raises, so the callback wraps the
    Trainer's ``train`` on the instance (``on_init_end``): a ``train()`` that raises or is interrupted ends
    the run the same way before the exception leaves ``train()``. A callback added with ``add_callback``
    after the Trainer was built wraps it at its first ``train()``: a failure of that first one is ended at the
    callback's next ``train()`` or at the interpreter's exit.

    The arguments (``Args:`` below) are :class:`~stable_attn.monitor.config.MonitorConfig`'s, as for
    :class:`~stable_attn.callbacks.StableAttentionCallback`.
    """

    def __init__(self, **options: Unpack[MonitorOptions]) -> None:
        config = MonitorConfig.from_options(options, owner=_NAME)
        self.engine = MonitorEngine.from_config(config, name=_NAME)
        self._args = config.saved()
        self._unsaved = config.unsaved_given()
        self._checkpoint_state: dict[str, Any] | None = None  # set by the Trainer's own restore (see state())
        self._taps: _Taps | None = None
        self._every = 0
        self._running = False

    __init__.__signature__ = MonitorConfig.signature()  # type: ignore[attr-defined]  # for help() and IDEs

    # Results, as the Lightning callback names them.
    @property
    def alert_count(self) -> int:
        return self.engine.alert_count

    @property
    def skipped_steps(self) -> list[int]:
        return self.engine.skipped_steps

    @property
    def rollbacks(self) -> list[tuple[int, int]]:
        return self.engine.rollbacks

    @property
    def stop_checkpoint(self) -> str | None:
        return self.engine.stop_checkpoint

    @property
    def alert_kinds(self) -> dict[str, int]:
        return self.engine.alert_kinds

    @property
    def alert_delivery(self) -> dict[str, dict[str, int]]:
        """Per channel: alerts delivered, failed, dropped and abandoned (closed channels and earlier runs)."""
        return self.engine.desk.delivered

    def summary(self) -> str:
        return self.engine.summary()

    # Given to lightning.Trainer: Lightning reads ``state_key`` from a callback before each of its hooks
    # (``setup`` first, then ``on_exception`` when that raised), so it is where the mistake is named.
    @property
    def state_key(self) -> str:
        raise TypeError(f"{_NAME} is a transformers.Trainer callback; for lightning.Trainer use "
                        "stable_attn.callbacks.StableAttentionCallback")

    def setup(self, *args: Any, **kwargs: Any) -> None:
        self.state_key  # noqa: B018 - raises the TypeError above

    def on_exception(self, *args: Any, **kwargs: Any) -> None:
        self.state_key  # noqa: B018

    # ---------------------------------------------------------------- resume
    def state(self) -> dict[str, Any]:
        """What ``trainer_state.json`` keeps (``ExportableState``): the plain constructor arguments and
        the engine's state, without the rollback snapshot (tensors)."""
        engine = {k: v for k, v in self.engine.state_dict().items() if k != "rollback_snapshot"}
        return {"args": dict(self._args),
                "attributes": {"_checkpoint_state": {"engine": engine, "unsaved_args": list(self._unsaved)}}}

    def _restore(self, args: Any, state: Any, checkpoint: str | None) -> None:
        saved = self._checkpoint_state  # the Trainer rebuilt this callback from the checkpoint
        if saved is None and state.global_step > 0:  # a resumed run: the checkpoint's trainer_state.json
            entry = state.stateful_callbacks.get(_NAME)
            entry = entry[0] if isinstance(entry, list) else entry
            saved = entry.get("attributes", {}).get("_checkpoint_state") if isinstance(entry, dict) else None
        self._checkpoint_state = None
        if saved is None:
            if state.global_step > 0 and state.is_world_process_zero:
                log.warning("%s: the checkpoint at step %d holds no %s state; detectors start afresh", _NAME,
                            state.global_step, _NAME)
            return
        if args.restore_callback_states_from_checkpoint and saved.get("unsaved_args"):
            raise ValueError(
                f"TrainingArguments(restore_callback_states_from_checkpoint=True) rebuilt {_NAME} from "
                f"trainer_state.json, which does not hold its arguments {saved['unsaved_args']}; resume with "
                f"restore_callback_states_from_checkpoint=False: {_NAME} restores its own state either way")
        engine = dict(saved["engine"])
        snapshot = os.path.join(checkpoint, SNAPSHOT_FILE) if checkpoint is not None else None
        if snapshot is not None and self.engine.config.rolls_back and os.path.isfile(snapshot):
            engine["rollback_snapshot"] = torch.load(snapshot, map_location=args.device, weights_only=True)
        # Every field is checked there before any is loaded, the snapshot against the run at train_start.
        self.engine.load_state_dict(engine, f"{_NAME} state in trainer_state.json")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Only a single-process engine keeps its snapshot in its state (one rank's snapshot is not another's).
        snapshot = self.engine.state_dict().get("rollback_snapshot")
        folder = os.path.join(args.output_dir or ".", names.trainer_checkpoint(state.global_step))
        if snapshot is not None and state.is_world_process_zero and os.path.isdir(folder):
            torch.save(snapshot, os.path.join(folder, SNAPSHOT_FILE))

    # ---------------------------------------------------------------- hooks
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer, _ = _calling_trainer()
        if trainer is not None:
            self._guard(trainer)

    def _guard(self, trainer: Trainer) -> None:
        """Wrap ``trainer.train`` on the instance, once: a ``train()`` that raises (KeyboardInterrupt included)
        ends the run before the exception leaves it, since the Trainer has no event for that."""
        if getattr(trainer.__dict__.get("train"), "_stable_attn_guard", None) is self:
            return
        train = trainer.train

        @functools.wraps(train)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return train(*args, **kwargs)
            except BaseException as exc:
                if self._running:
                    self._end(f"after train() raised {type(exc).__name__}")
                raise

        guarded._stable_attn_guard = self  # type: ignore[attr-defined]
        trainer.train = guarded

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self._running:  # the last train() raised: end that run first
            self._end("before a new train()")
        trainer, checkpoint = _calling_trainer()
        if trainer is None:
            raise RuntimeError(f"{_NAME} found no transformers.Trainer running it; it works inside Trainer.train()")
        ours = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StableAttentionTrainerCallback)]
        if len(ours) > 1:
            # before anything is patched or wrapped: each would wrap the Trainer, send every alert and
            # load the same checkpoint entry (trainer_state.json keys callback states by class name)
            raise ValueError(
                f"this transformers.Trainer has {len(ours)} {_NAME}s; use one per Trainer (it swaps the attention, "
                "monitors and alerts for the whole run): remove the others from callbacks= / add_callback(), and "
                "give all the options to one")
        if getattr(trainer, "is_deepspeed_enabled", False):
            # accelerate runs DeepSpeed's engine.step() inside accelerator.backward(), before the Trainer's
            # on_pre_optimizer_step: no update (a NaN one included) could be dropped, whatever on_spike says.
            raise ValueError(
                f"{_NAME} does not support DeepSpeed (TrainingArguments.deepspeed={args.deepspeed!r}): DeepSpeed "
                "applies each update inside backward(), before the callback can drop it (a NaN update included); "
                "for sharded training use FSDP2 (fsdp='full_shard', fsdp_config={'version': 2}), or train without "
                "a DeepSpeed config (single process, DDP): docs/DISTRIBUTED.md")
        self._restore(args, state, checkpoint)
        self._stream_resumed = False
        self._taps = _Taps(trainer, self.engine.add_loss, self._add_batch, self._open_stream)
        try:
            size = args.world_size
            world = World(rank=args.process_index, size=size, device=args.device,
                          all_gather=_all_gather if size > 1 else None, grad_norm=self._taps.grad_norm)
            self.engine.setup(model, world, stage="train")
            steps = args.logging_strategy == "steps"
            self._every = self.engine.config.log_every_n_steps or (state.logging_steps if steps else 0)
            output_dir = args.output_dir or "."
            stop_path = lambda step: os.path.join(output_dir, names.trainer_checkpoint(step))  # the Trainer's save
            self.engine.start(output_dir, self._every, stop_path)
            if world.is_zero:
                log.warning("%s: %s", self.engine.name, self.engine.config.spike_line())
            trainables = self._trainables(state, model, optimizer, lr_scheduler)
            self.engine.train_start(trainables)
        except BaseException:
            # Unwrap the Trainer and put back what setup patched: a later train() must not wrap the wrappers.
            self._end("after the start of train() failed")
            raise
        self._running = True
        # The Trainer has no event for a train() that raises: its train() is wrapped for that (_guard); a
        # callback added after the Trainer was built guards the next train() only, and this one ends at the
        # next train() or the interpreter's exit (channels closed within one webhook timeout).
        self._guard(trainer)
        atexit.register(self._end, "at interpreter exit (train() did not finish)")

    def _add_batch(self, inputs: Any, epoch: int, index: int | None) -> None:
        self.engine.add_batch(inputs, epoch=epoch, batch_index=index)

    def _open_stream(self, epoch_iterator: Any, epoch: int, start: int = 0) -> SkipStream:
        """The stream over one epoch's batches. A resumed epoch starts after the batches the Trainer's
        ``skip_first_batches`` consumed (those it trained on); with ``on_spike="recover"`` the stream then
        discards as many more as the checkpointed run had discarded in that epoch, so it continues at the same
        batch, inside a skip window too (the window's batch indices are the data loader's). ``start``: the data
        index of the iterator's first batch (the batches ``skip_first_batches`` consumed)."""
        recovery = self.engine.recovery
        saved = recovery.stream if recovery is not None else None
        if saved is not None and saved.get("epoch") == epoch and saved.get("given", 0) > 0 \
                and not self._stream_resumed:
            self._stream_resumed = True
            caught_up = int(saved["index"])
            skips = self.engine.skips
            stream = SkipStream(epoch_iterator, epoch, lambda e, i: i < caught_up or skips(e, i),
                                index=int(saved["given"]), given=int(saved["given"]))
        else:
            self._stream_resumed = True
            stream = SkipStream(epoch_iterator, epoch, self.engine.skips, index=start)
        return stream

    def _trainables(self, state: Any, model: Any, optimizer: Any, lr_scheduler: Any) -> Trainables:
        scaler = getattr(self._taps.trainer.accelerator, "scaler", None) if self._taps is not None else None
        return Trainables(step=state.global_step, model=model, optimizers=[optimizer] if optimizer else [],
                          schedulers=[lr_scheduler] if lr_scheduler is not None else [], precision=scaler)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._taps is not None:
            self._taps.flush()
        step = state.global_step + 1  # the Trainer's number of the update this step makes
        self.engine.begin_step(step, monitor=self._every > 0 and step % self._every == 0)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                              **kwargs: Any) -> None:
        scaler = self._taps is not None and getattr(self._taps.trainer.accelerator, "scaler", None) is not None
        self.engine.before_optimizer_step(optimizer, model.parameters(), scaler=scaler)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    lr_scheduler: Any = None, **kwargs: Any) -> None:
        end = self.engine.end_step(self._trainables(state, model, optimizer, lr_scheduler))
        recovery, stream = self.engine.recovery, self._taps.stream if self._taps is not None else None
        if recovery is not None and stream is not None:
            # where the epoch's data stands after this step: a checkpoint saved now resumes there
            recovery.stream = {"epoch": stream.epoch, "index": stream.index, "given": stream.given}
        if end.metrics is not None and self._taps is not None:
            ours = {k: v for k, v in end.metrics.items() if k not in _TRAINER_LOGS}
            self._taps.pending = (state.global_step, ours)
            if not control.should_log:
                self._taps.flush()
        if end.stop_checkpoint is not None:
            control.should_save = True  # the Trainer saves output_dir/checkpoint-<global_step> next
            control.should_training_stop = True
        if control.should_save:
            self.engine.settle()  # device_skip: a dropped step's host-side optimizer state back before the save

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.engine.settle()  # device_skip: save_strategy="epoch" saves after this hook, before any step's

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.engine.settle()  # device_skip: a save for the best metric comes after the evaluation

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._taps is not None:
            self._taps.flush()
        self.engine.log_summary()
        self._end("at the end of train()")

    def _end(self, when: str) -> None:
        atexit.unregister(self._end)
        self.engine.end_run(when)
        if self._taps is not None:
            self._taps.remove()
            self._taps = None
        self._running = False


MonitorConfig.document(StableAttentionTrainerCallback,
                       log_every="the Trainer's ``logging_steps`` (no monitored steps when ``logging_strategy`` is "
                                 "not ``\"steps\"``)",
                       log_dir="``TrainingArguments.output_dir``")
