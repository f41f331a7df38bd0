"""StableAttentionCallback: the stabilized attention, monitoring, alerts and spike handling for a
Lightning ``Trainer``.

A thin adapter: :class:`~stable_attn.monitor.engine.MonitorEngine` does the work (swap, statistics,
detection, the step's action agreed across ranks, alerts, rollback snapshots, resume state); this
module maps Lightning's hooks onto it (automatic optimization):

- ``setup`` / ``on_fit_start``: ``engine.setup`` (models built in ``configure_model`` exist only at
  fit start), then ``engine.start`` with the run's log directory; ``on_train_start``, once the
  checkpoint is restored: ``engine.train_start``;
- ``on_train_batch_start`` / ``on_before_backward``: ``begin_step`` / ``add_loss`` (Lightning has
  already divided the loss by ``accumulate_grad_batches``);
- ``on_before_optimizer_step`` (gradients complete, AMP has unscaled them): ``before_optimizer_step``,
  which drops the update itself when it must;
- ``on_train_batch_end`` (after the LR schedulers stepped): ``end_step``; the adapter logs its metrics
  to every logger (rank zero), refreshes the alert count in the progress bar, and saves the stop
  checkpoint (every rank: checkpointing may be collective) and stops the Trainer;
- ``teardown`` and ``on_exception`` (Lightning calls no teardown when ``fit()`` raises): ``end_run``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ..monitor import names
from ..monitor.actions.recovery import SkipStream
from ..monitor.config import MonitorConfig
from ..monitor.engine import MonitorEngine, Trainables, World
from ..monitor.grad_norm import total_grad_norm

__all__ = ["StableAttentionCallback"]

log = logging.getLogger("stable_attn")

if TYPE_CHECKING:  # PEP 692: names and types of **options for pyright, mypy, PyCharm
    from typing_extensions import Unpack

    from ..monitor.config import MonitorOptions

# What the callback shows of its engine, read-only: the run's outcome and state, and (from its config) the arguments.
_ENGINE_ATTRIBUTES = frozenset({
    "alert_count", "alert_kinds", "skipped_steps", "rollbacks", "stop_checkpoint", "layers", "dispatcher",
    "surge_detectors", "log_dir", "not_training_streak", "loss_detector", "grad_norm_detector",
})
_WRONG_TRAINER = ("StableAttentionCallback is a Lightning callback (lightning.Trainer); for transformers.Trainer use "
                  "stable_attn.callbacks.StableAttentionTrainerCallback")


def _world(trainer: Trainer) -> World:
    strategy = trainer.strategy
    several = trainer.world_size > 1
    return World(rank=trainer.global_rank, size=trainer.world_size, device=strategy.root_device,
                 all_gather=strategy.all_gather if several else None,
                 grad_norm=functools.partial(strategy_grad_norm, strategy=strategy))


def strategy_grad_norm(parameters: Iterable[torch.nn.Parameter], strategy: object | None = None) -> torch.Tensor | None:
    """The global gradient norm of ``parameters`` under the Lightning ``strategy`` (``trainer.strategy``):
    :func:`~stable_attn.monitor.grad_norm.total_grad_norm`, except under FSDP1 (``FSDPStrategy``), whose
    ``FullyShardedDataParallel.clip_grad_norm_`` with ``max_norm=inf`` returns the global norm and scales the
    gradients by ``min(inf / norm, 1) = 1.0``, which is exact. A collective under FSDP: every rank calls it."""
    if strategy is not None and type(strategy).__name__ == "FSDPStrategy":
        from torch.distributed.fsdp import FullyShardedDataParallel

        root = getattr(strategy, "model", None)
        if isinstance(root, FullyShardedDataParallel):
            return root.clip_grad_norm_(float("inf")).detach()
    return total_grad_norm(parameters)


def _trainables(trainer: Trainer, pl_module: LightningModule) -> Trainables:
    return Trainables(step=trainer.global_step, model=pl_module, optimizers=trainer.optimizers,
                      schedulers=[cfg.scheduler for cfg in trainer.lr_scheduler_configs],
                      precision=trainer.precision_plugin)


class StableAttentionCallback(Callback):
    r"""Swap in the stabilized attention, monitor attention and training health, alert, and act on spikes.

    **Swap.** At setup, every Hugging Face ``PreTrainedModel`` inside the LightningModule is switched to
    ``attn_implementation="stable_attn"`` and gets per-layer :class:`~stable_attn.AttentionStats`; one
    WARNING line says how many models and attention layers were switched and which kernel backend runs.

    **Monitor.** Every ``log_every_n_steps`` optimizer steps (the Trainer's by default), the per-layer
    saturation rate, fixed-block rate, max logit and sink mass (measured by the kernel during the
    step's own forward passes, reduced over heads, micro-batches and ranks) are logged to every
    logger of the Trainer, with ``train/loss``, ``train/grad_norm`` (before clipping), ``train/lr`` and
    ``stable_attn/alerts``. Statistics are collected only on those steps. The alert count is shown in
    the progress bar.

    **Detect.** The loss and the gradient norm of *every* step, on *every* rank, go to
    :class:`~stable_attn.monitor.SpikeDetector`\ s (one per rank and metric; non-finite values always
    count): NaN and inf from the first step, gross jumps after the first few steps, the calibrated
    rule once the detector has learnt the run's noise (docs/DETECTORS.md has the rules and numbers). Each layer's
    saturation and max logit go to :class:`~stable_attn.monitor.SurgeDetector`\ s on monitored steps
    (``kind="early_warning"``).

    **Alert.** The first step of each anomaly becomes an :class:`~stable_attn.monitor.Alert` (with the
    step, values, baseline, threshold, score, learning rate, and the layers whose saturation or max
    logit changed most over the last ``layer_window`` monitored steps) sent to: the ``stable_attn``
    logger (one WARNING line), ``<log_dir>/<alerts_file>`` (JSONL), each ``on_alert`` callable, and
    ``webhook_url`` (JSON POST from a background thread; failures are logged, never raised).

    **Act.** On every spiking step (loss or gradient norm, on any rank), per ``on_spike``:

    - ``"warn"``: alert only (but a non-finite step is skipped, see below);
    - ``"skip"``: the step's update is dropped (weights and optimizer state unchanged; LR schedulers
      still advance, as with an AMP overflow);
    - ``"rollback"``: the step's update is dropped and the model, optimizer, LR-scheduler, grad-scaler
      and RNG state kept in memory every ``rollback_every`` steps is restored; the batches consumed
      since that snapshot are not replayed, training goes on with the next batch. In a
      single-process run the last snapshot is saved with every checkpoint (in the callback's state),
      so a resumed run rolls back to the same state as one never interrupted; this adds one more copy
      of the weights and optimizer state to the checkpoint (about doubling its size). With several
      ranks it is not saved, and a resumed run says at WARNING that rollback history starts afresh;
    - ``"stop"``: the step's update is dropped, a checkpoint is saved to
      ``<log_dir>/stable_attn-stop-step=<step>.ckpt`` and the Trainer stops.
    - ``"recover"``: the PaLM recipe (docs/RECOVERY.md): the update is dropped, the state of a snapshot
      ``rollback_steps`` steps back is restored from a ring (in host memory, or on disk over
      ``snapshot_memory_limit``), the next ``skip_batches`` batches of the epoch are discarded before the fit
      loop sees them (through the fit loop's data fetcher, undone at teardown; a run resumed mid-epoch
      continues the epoch's data where the checkpoint stood), the learning rate optionally runs at
      ``x lr_factor`` for ``lr_steps``;
      after ``max_recoveries`` (``cooldown_steps`` apart) the next spike stops as for ``"stop"``.

    ``"rollback"``, ``"stop"`` and ``"recover"`` lose progress, so they are taken when a loss or
    gradient-norm spike has lasted ``spike_confirm_steps`` (3) steps in a row; its earlier steps are skipped
    (their updates dropped, so the weights kept are the same), and a spike of one or two steps (a hard batch,
    a corrupted one) only skips. A drift and a NaN or inf act at once.

    Early warnings only alert.

    **Delivery.** Every channel counts its alerts: delivered, failed, dropped (the webhook's queue was
    full) and abandoned (still pending when the run ended, or handed over while the webhook was
    paused after repeated failures); see :data:`~stable_attn.monitor.alerts.alert.DELIVERY_COUNTS`. The
    counts are in :attr:`alert_delivery` and the callback's ``state_dict``, and at the end of ``fit()``
    one line per channel names it (the file path, the webhook's scheme, host and port, never its path
    or query) with its counts: a WARNING for a channel that did not deliver every alert. The JSONL
    file is written synchronously. ``on_alert`` callables run on the training thread, in order;
    one call longer than :data:`~stable_attn.monitor.alerts.alert.SLOW_CALLABLE_S` (0.1 s) logs one
    WARNING naming the callable. The webhook never blocks training (a background thread; see
    :mod:`stable_attn.monitor.alerts.webhook` for the request, the payload and the time limits).

    **End of run.** At the end of ``fit()``, and when ``fit()`` raises (user code, KeyboardInterrupt:
    Lightning's ``on_exception``), the callback closes the channels within one ``webhook_timeout``
    in all (the webhook thread has ended when ``fit()`` returns), puts back
    ``torch.nn.functional.scaled_dot_product_attention`` if ``patch_sdpa`` replaced it, and switches
    the attention statistics off. Models it switched to ``"stable_attn"`` stay switched.

    **Never a non-finite update.** A NaN or inf loss on any rank, or a NaN or inf gradient on any
    rank (seen in the gradient norm, or with ``monitor_grad_norm=False`` by a max-abs check of the
    gradients), drops that step's update whatever ``on_spike`` says: ``"warn"`` skips it, the other
    actions act as for a spike; the alert (``kind="nonfinite"``) says so. Under fp16 AMP the
    GradScaler meets inf gradients by design and skips those steps itself: they are not alerts.

    **Escalation.** When ``not_training_after`` optimizer steps in a row have had their update
    dropped (for any reason) or a non-finite loss, one ``kind="not_training"`` alert says the run is
    not training; when the streak reaches ``not_training_stop_after`` steps, a second one says so
    and the callback stops as for ``"stop"`` (a checkpoint of the last weights that were applied,
    ``<log_dir>/stable_attn-stop-step=<step>.ckpt``). A step that trains ends the streak.

    **What the user sees.** WARNING lines on the ``stable_attn`` logger (Python prints WARNING and
    above even without any logging set up): the swap; what a spike does (``on a spike: warn only, the
    update is applied (on_spike='warn', the default; ...)``, from
    :meth:`~stable_attn.monitor.config.MonitorConfig.spike_line`); for each watched metric, when spike detection
    becomes active (the gross-jump rule, then the calibrated rule); every alert; and at the end of
    ``fit()`` one summary line (alerts by kind, updates skipped, rollbacks, the stop checkpoint).

    The arguments (``Args:`` below) are :class:`~stable_attn.monitor.config.MonitorConfig`'s.
    """

    def __init__(self, **options: Unpack[MonitorOptions]) -> None:
        config = MonitorConfig.from_options(options, owner="StableAttentionCallback")
        self.engine = MonitorEngine.from_config(config, name=type(self).__name__)
        self._stream: tuple[Any, SkipStream] | None = None  # on_spike="recover": (data fetcher, its stream)
        self._resumed_stream: dict[str, int] | None = None  # where a resumed epoch's data stood (load_state_dict)

    __init__.__signature__ = MonitorConfig.signature()  # type: ignore[attr-defined]  # for help() and IDEs

    def __getattr__(self, name: str) -> Any:
        engine = self.__dict__.get("engine")  # absent while unpickling
        if engine is not None and name in _ENGINE_ATTRIBUTES:
            return getattr(engine, name)
        if engine is not None and name in MonitorConfig.names():
            return engine.config.checked()[name]
        if engine is not None and name == "alert_delivery":  # per channel, of the closed channels and earlier runs
            return engine.desk.delivered
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------ start and end
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Lightning's own check (equal state_key) runs only on the constructor's callbacks list
        ours = [cb for cb in trainer.callbacks if isinstance(cb, StableAttentionCallback)]
        if len(ours) > 1:
            raise ValueError(
                f"this lightning.Trainer has {len(ours)} StableAttentionCallbacks; use one per Trainer (it swaps the "
                "attention, monitors and alerts for the whole run): remove the others from trainer.callbacks, and "
                "give all the options to one")
        self.engine.setup(pl_module, _world(trainer), stage)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.engine.setup(pl_module, _world(trainer))  # models built in ``configure_model`` (FSDP) exist now
        # trainer.log_dir broadcasts rank zero's directory: a collective, so every rank calls it here.
        self.engine.start(trainer.log_dir or trainer.default_root_dir, trainer.log_every_n_steps)
        if trainer.is_global_zero:
            log.warning("%s: %s", self.engine.name, self.engine.config.spike_line())

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainables = _trainables(trainer, pl_module)
        self.engine.train_start(trainables)
        saved, self._resumed_stream = self._resumed_stream, None
        if saved is not None and saved["epoch"] == trainer.current_epoch and self.engine.recovery is not None:
            self._resume_stream(trainer, saved)

    def _resume_stream(self, trainer: Trainer, saved: dict[str, int]) -> None:
        """A run resumed in the middle of epoch ``saved["epoch"]`` (on_spike="recover"): continue the epoch's data
        where the checkpointed run stood, after data index ``saved["index"] - 1`` (the step's batch), inside a
        skip window too. Lightning restarts a data loader that keeps no state (no ``state_dict``) at the epoch's
        first batch: the stream discards the batches before ``saved["index"]``, which the checkpointed run had
        trained on or skipped, so the run goes on exactly as if never interrupted wherever the loader's order is
        reproducible (no shuffling, or a seeded sampler). A loader with ``state_dict`` / ``load_state_dict``
        Lightning resumes itself: the stream only numbers its batches from ``saved["index"]``. Installed here,
        after the fit loop made its data iterator and before it draws a batch (a loader without a length has one
        prefetched: it is drawn again through the stream)."""
        from lightning.fabric.utilities.types import _Stateful
        from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher

        fetcher = trainer.fit_loop._data_fetcher
        loader = trainer.fit_loop._combined_loader
        if type(fetcher) is not _PrefetchDataFetcher or fetcher.iterator is None or loader is None:
            return  # _batch_index raises for a dataloader_iter step
        stateful = all(isinstance(dl, _Stateful) for dl in loader.flattened)
        resume_at, skips = saved["index"], self.engine.skips
        buffered = list(fetcher.batches)
        fetcher.batches.clear()
        if stateful:
            stream = SkipStream(fetcher.iterator, saved["epoch"], skips, index=resume_at + len(buffered),
                                given=saved["given"])
            fetcher.batches.extend(buffered)  # drawn past resume_at already: their indices come first
            stream.yielded.update({saved["given"] + i: resume_at + i for i in range(len(buffered))})
            stream.given += len(buffered)
        else:
            stream = SkipStream(fetcher.iterator, saved["epoch"], lambda e, i: i < resume_at or skips(e, i),
                                index=len(buffered), given=saved["given"])
            for _ in buffered:  # what the fetcher prefetched was the restarted epoch's first batch: draw again
                try:
                    fetcher.batches.append(next(stream))
                except StopIteration:
                    fetcher.done = not fetcher.batches
                    break
        stream.offset = saved["given"] - resume_at
        fetcher.iterator = stream
        self._stream = (fetcher, stream)
        self.engine.skip_lag = len(fetcher.batches)
        if self.engine.world.is_zero:
            log.warning("%s: resumed inside epoch %d: its data continues after batch %d%s", self.engine.name,
                        saved["epoch"], resume_at - 1, "" if stateful else f" (the {resume_at} batches before it, "
                        "which Lightning's restart of the epoch yields again, are passed over)")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Lightning calls no teardown hook when fit() raises (KeyboardInterrupt included): end the run here.
        self._unstream()
        self.engine.end_run(f"after fit() raised {type(exception).__name__}")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._unstream()
        self.engine.end_run(f"at the end of {getattr(stage, 'value', stage)}()")

    def _unstream(self) -> None:
        """Give the data fetcher its own iterator back (on_spike="recover")."""
        installed, self._stream = self._stream, None
        if installed is not None and installed[0].iterator is installed[1]:
            installed[0].iterator = installed[1].inner

    def _batch_index(self, trainer: Trainer, batch_idx: int) -> int:
        """The batch's index in the epoch's data. With ``on_spike="recover"`` the fit loop's data fetcher draws
        from a :class:`~stable_attn.monitor.actions.recovery.SkipStream` (installed at each epoch's first batch, over
        the iterator the fetcher made), which discards the batches of a skip window before the loop sees them;
        the fetcher has already drawn the batches it prefetches, so a window starts after those."""
        if self.engine.recovery is None:
            return batch_idx
        from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher

        fetcher = trainer.fit_loop._data_fetcher
        epoch = trainer.current_epoch
        if self._stream is None or self._stream[0] is not fetcher or fetcher.iterator is not self._stream[1] \
                or self._stream[1].epoch != epoch:
            if type(fetcher) is not _PrefetchDataFetcher or fetcher.iterator is None:
                raise ValueError(f"on_spike='recover' skips batches through Lightning's data fetcher, and this fit "
                                 f"loop uses {type(fetcher).__name__} (a training_step that takes dataloader_iter); "
                                 "use a training_step(batch, batch_idx) or another on_spike")
            self._unstream()
            buffered = len(fetcher.batches)
            # The batches drawn so far this epoch: this one and the prefetched; a restarted (resumed) epoch
            # numbers Lightning's batches from where it stopped while its data loader starts again at 0.
            stream = SkipStream(fetcher.iterator, epoch, self.engine.skips, index=1 + buffered,
                                given=batch_idx + 1 + buffered)
            stream.offset = batch_idx
            fetcher.iterator = stream
            self._stream = (fetcher, stream)
            self.engine.skip_lag = buffered
        index = self._stream[1].data_index(batch_idx)
        # where the epoch's data stands after this batch: a checkpoint saved at this step resumes after it
        self.engine.recovery.stream = {"epoch": epoch, "index": index + 1, "given": batch_idx + 1}
        return index

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.engine.log_summary()

    def summary(self) -> str:
        """One line: the alerts of the run by kind, the updates skipped, rollbacks and the stop checkpoint."""
        return self.engine.summary()

    # ------------------------------------------------------------ each step
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.engine.begin_step(trainer.global_step)
        self.engine.add_batch(batch, epoch=trainer.current_epoch, batch_index=self._batch_index(trainer, batch_idx))

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self.engine.add_loss(loss)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
        self.engine.before_optimizer_step(optimizer, pl_module.parameters(), scaler=scaler)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        end = self.engine.end_step(_trainables(trainer, pl_module))
        if end.metrics is not None and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(end.metrics, step=end.step)
        if end.stop_checkpoint is not None:
            trainer.save_checkpoint(end.stop_checkpoint)  # every rank: checkpointing may be collective
            trainer.should_stop = True
        if (end.metrics is not None or end.alert_count_changed) and trainer.progress_bar_callback is not None:
            pl_module.log(names.ALERT_COUNT, float(self.engine.alert_count), prog_bar=True, logger=False,
                          on_step=True, on_epoch=False)

    # ------------------------------------------------- given to the wrong trainer
    def on_init_end(self, *args: Any, **kwargs: Any) -> None:
        """transformers.Trainer calls this from its constructor (Lightning never does): refuse at once."""
        raise TypeError(_WRONG_TRAINER)

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        """transformers.Trainer's first hook for a callback added after construction (Lightning's is
        ``on_train_start``)."""
        raise TypeError(_WRONG_TRAINER)

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Every field is checked there before any is loaded, the snapshot against the run at train_start.
        self.engine.load_state_dict(state_dict, f"{type(self).__name__} state")
        recovery = self.engine.recovery
        self._resumed_stream = dict(recovery.stream) if recovery is not None and recovery.stream else None


MonitorConfig.document(StableAttentionCallback, log_every="the Trainer's ``log_every_n_steps``",
                       log_dir="the run's log directory (``trainer.log_dir``)")
