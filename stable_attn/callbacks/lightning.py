"""StableAttentionCallback: the stabilized attention, monitoring, alerts and spike handling for a
Lightning ``Trainer``.

The callback is glue between Trainer hooks and :mod:`stable_attn.monitor`: the detectors decide what
is anomalous, the channels deliver alerts, and this module decides *when* each happens in a step and
how ranks agree. The order inside one optimizer step (automatic optimization):

1. ``on_train_batch_start``: a monitored step switches the layers' AttentionStats on.
2. ``on_before_backward``: the (accumulation-normalised) loss is remembered.
3. ``on_before_optimizer_step``: gradients are complete and unscaled (AMP unscales before this
   hook), the update has not happened yet. The loss and gradient norm go to the spike detectors,
   one all-gather shares every rank's verdict, and a spike on any rank acts on all ranks: for
   ``"skip"``, ``"rollback"`` and ``"stop"`` the gradients are dropped (``set_to_none``), so the
   optimizer step that follows changes neither the weights nor the optimizer state (torch
   optimizers skip parameters without gradients: no moment update, no step count, no weight decay).
4. ``on_train_batch_end`` (after the LR schedulers stepped): layer statistics are reduced across
   ranks and logged, the early-warning detectors see them, a rollback restores the snapshot, a stop
   saves a checkpoint, and a snapshot is taken every ``rollback_every`` steps.

Every rank runs the same collectives in the same order on every step (one all-gather per step, one
more on monitored steps), whatever it observed, so a spike seen by one rank cannot deadlock the
others. Side effects (log lines, the JSONL file, the webhook, logger metrics) happen on rank zero.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ..monitor import (
    Alert,
    AlertDispatcher,
    CallableChannel,
    JsonlChannel,
    LoggingChannel,
    SpikeDetector,
    SpikeEvent,
    SurgeDetector,
    WebhookChannel,
)
from .grad_norm import total_grad_norm
from .layer_stats import STAT_NAMES, LayerStats
from .rollback import Snapshot, restore_snapshot, take_snapshot
from .swap import find_hf_models, swap_attention

__all__ = ["StableAttentionCallback"]

log = logging.getLogger("stable_attn")

SpikeAction = Literal["warn", "skip", "rollback", "stop"]
_ACTIONS = ("warn", "skip", "rollback", "stop")
# What each rank shares every step: loss, gradient norm, whether it had a loss (a skipped backward has none).
_FIELDS = 3


@dataclass
class _StepRecord:
    step: int
    has_norm: bool
    lr: float
    scaler: bool


def _check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        accepted = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"{name}={value!r} is not supported; use {accepted}")


def _backend(trainer: Trainer) -> str:
    return "triton (CUDA)" if trainer.strategy.root_device.type == "cuda" else "torch (CPU)"


class StableAttentionCallback(Callback):
    r"""Swap in the stabilized attention, monitor attention and training health, alert, and act on spikes.

    **Swap.** At setup, every Hugging Face ``PreTrainedModel`` inside the LightningModule is switched to
    ``attn_implementation="stable_attn"`` and gets per-layer :class:`~stable_attn.AttentionStats`; one
    log line says how many models and attention layers were switched and which kernel backend runs.

    **Monitor.** Every ``log_every_n_steps`` optimizer steps (the Trainer's by default), the per-layer
    saturation rate, fixed-block rate, max logit and sink mass (measured by the kernel during the
    step's own forward passes, reduced over heads, micro-batches and ranks) are logged to every
    logger of the Trainer, with ``train/loss``, ``train/grad_norm`` (before clipping), ``train/lr`` and
    ``stable_attn/alerts``. Statistics are collected only on those steps. The alert count is shown in
    the progress bar.

    **Detect.** The loss and the gradient norm of *every* step go to :class:`~stable_attn.monitor.SpikeDetector`\ s
    (non-finite values always count). Each layer's saturation and max logit go to
    :class:`~stable_attn.monitor.SurgeDetector`\ s on monitored steps (``kind="early_warning"``).

    **Alert.** The first step of each anomaly becomes an :class:`~stable_attn.monitor.Alert` (with the
    step, values, baseline, threshold, score, learning rate, and the layers whose saturation or max
    logit changed most over the last ``layer_window`` monitored steps) sent to: the ``stable_attn``
    logger (one WARNING line), ``<log_dir>/<alerts_file>`` (JSONL), each ``on_alert`` callable, and
    ``webhook_url`` (JSON POST from a background thread; failures are logged, never raised).

    **Act.** On every spiking step (loss or gradient norm, on any rank), per ``on_spike``:

    - ``"warn"``: alert only;
    - ``"skip"``: the step's update is dropped (weights and optimizer state unchanged; LR schedulers
      still advance, as with an AMP overflow);
    - ``"rollback"``: the step's update is dropped and the model, optimizer, LR-scheduler, grad-scaler
      and RNG state kept in memory every ``rollback_every`` steps is restored; the batches consumed
      since that snapshot are not replayed, training goes on with the next batch;
    - ``"stop"``: the step's update is dropped, a checkpoint is saved to
      ``<log_dir>/stable_attn-stop-step=<step>.ckpt`` and the Trainer stops.

    Early warnings only alert.

    Args:
        on_spike: ``"warn"``, ``"skip"``, ``"rollback"`` or ``"stop"``.
        log_every_n_steps: optimizer steps between monitored steps; None follows the Trainer's
            ``log_every_n_steps``.
        swap: switch transformers models to ``"stable_attn"`` at setup.
        patch_sdpa: also route ``torch.nn.functional.scaled_dot_product_attention`` to the
            stabilized kernel (for attention modules that are not transformers models); undone at
            teardown.
        loss_detector: detector for the training loss; default ``SpikeDetector("train/loss")``.
        grad_norm_detector: detector for the gradient norm; default
            ``SpikeDetector("train/grad_norm")``; None with ``monitor_grad_norm=False`` skips it.
        monitor_grad_norm: compute the gradient norm every step (one pass over the gradients).
        attention_stats: collect per-layer attention statistics on monitored steps (the kernel
            computes them as side outputs of the forward; on the CPU path they cost a few percent of
            a monitored step).
        early_warnings: run surge detectors on each layer's saturation and max logit.
        early_warning_warmup: monitored steps each surge detector watches before it can fire; None
            keeps :class:`~stable_attn.monitor.SurgeDetector`'s default (10). A model trained from
            scratch forms its attention sinks in its first ~100 steps, which is learning, not an
            anomaly: give such runs a warm-up that covers them.
        rollback_every: optimizer steps between snapshots for ``on_spike="rollback"``.
        on_alert: a callable or callables, each called with every :class:`~stable_attn.monitor.Alert`.
        webhook_url: ``http(s)://`` URL that receives each alert as a JSON POST.
        webhook_timeout: seconds per webhook request.
        alerts_file: file name of the alerts JSONL inside the run's log directory, or None for none.
        layer_window: monitored steps over which layer changes are reported in alerts.
    """

    def __init__(
        self,
        *,
        on_spike: SpikeAction = "warn",
        log_every_n_steps: int | None = None,
        swap: bool = True,
        patch_sdpa: bool = False,
        loss_detector: SpikeDetector | None = None,
        grad_norm_detector: SpikeDetector | None = None,
        monitor_grad_norm: bool = True,
        attention_stats: bool = True,
        early_warnings: bool = True,
        early_warning_warmup: int | None = None,
        rollback_every: int = 100,
        on_alert: Callable[[Alert], Any] | Iterable[Callable[[Alert], Any]] | None = None,
        webhook_url: str | None = None,
        webhook_timeout: float = 2.0,
        alerts_file: str | None = "stable_attn_alerts.jsonl",
        layer_window: int = 10,
    ) -> None:
        if on_spike not in _ACTIONS:
            raise ValueError(f"on_spike={on_spike!r} is not supported; use one of {_ACTIONS}")
        _check_int("log_every_n_steps", log_every_n_steps, 1, allow_none=True)
        _check_int("rollback_every", rollback_every, 1)
        _check_int("layer_window", layer_window, 2)
        _check_int("early_warning_warmup", early_warning_warmup, 0, allow_none=True)
        for name, flag in (("swap", swap), ("patch_sdpa", patch_sdpa), ("monitor_grad_norm", monitor_grad_norm),
                           ("attention_stats", attention_stats), ("early_warnings", early_warnings)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}={flag!r} is not supported; use True or False")
        for name, det in (("loss_detector", loss_detector), ("grad_norm_detector", grad_norm_detector)):
            if det is not None and not isinstance(det, SpikeDetector):
                raise TypeError(f"{name}={det!r} is not supported; use a stable_attn.monitor.SpikeDetector or None")
        if on_alert is None:
            callbacks: list[Callable[[Alert], Any]] = []
        elif callable(on_alert):
            callbacks = [on_alert]
        else:
            try:
                callbacks = list(on_alert)
            except TypeError:
                raise TypeError(f"on_alert={on_alert!r} is not supported; use a callable, a list of callables "
                                "or None") from None
        for fn in callbacks:
            if not callable(fn):
                raise TypeError(f"on_alert holds {fn!r}, which is not callable; each entry receives the Alert")
        if webhook_url is not None:
            WebhookChannel(webhook_url, timeout=webhook_timeout)  # validates url and timeout, starts nothing
        if alerts_file is not None and (not isinstance(alerts_file, str) or not alerts_file
                                        or os.path.basename(alerts_file) != alerts_file):
            raise ValueError(f"alerts_file={alerts_file!r} is not supported; use a plain file name "
                             "(it is written in the run's log directory) or None")

        self.on_spike = on_spike
        self.log_every_n_steps = log_every_n_steps
        self.swap = swap
        self.patch_sdpa = patch_sdpa
        self.monitor_grad_norm = monitor_grad_norm
        self.attention_stats = attention_stats
        self.early_warnings = early_warnings
        self.early_warning_warmup = early_warning_warmup
        self.rollback_every = rollback_every
        self.on_alert = callbacks
        self.webhook_url = webhook_url
        self.webhook_timeout = webhook_timeout
        self.alerts_file = alerts_file
        self.layer_window = layer_window
        self.loss_detector = loss_detector if loss_detector is not None else SpikeDetector("train/loss")
        self.grad_norm_detector = (
            grad_norm_detector if grad_norm_detector is not None else SpikeDetector("train/grad_norm")
        )
        self.surge_detectors: dict[str, SurgeDetector] = {}

        self.alert_count = 0
        self.skipped_steps: list[int] = []
        self.rollbacks: list[tuple[int, int]] = []  # (spiking step, snapshot step)
        self.stop_checkpoint: str | None = None
        self.layers: LayerStats | None = None
        self.dispatcher: AlertDispatcher | None = None
        self.log_dir: str | None = None

        self._swapped: dict[int, str] = {}
        self._sdpa_patch: Any = None
        self._pending_state: dict[str, Any] | None = None
        self._every = 1
        self._step = -1
        self._monitor_now = False
        self._loss: torch.Tensor | None = None
        self._stepped = False
        self._acted = False
        self._pending_rollback = False
        self._pending_stop = False
        self._last: dict[str, float] = {}
        self._deferred: tuple[_StepRecord, torch.Tensor, Any] | None = None
        # loss detectors of ranks 1, 2, ... (rank 0's is ``loss_detector``); made as ranks report
        self._rank_loss_detectors: list[SpikeDetector] = [self.loss_detector]
        self._pending_rank_states: dict[int, dict[str, Any]] = {}
        self._ready_logged: set[str] = set()
        self._snapshot: Snapshot | None = None

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._swap_models(trainer, pl_module)
        if self.patch_sdpa and self._sdpa_patch is None:
            from ..integrations.sdpa import patch_sdpa

            self._sdpa_patch = patch_sdpa()
            if trainer.is_global_zero:
                log.info("StableAttentionCallback: torch.nn.functional.scaled_dot_product_attention now runs "
                         "stable_attn (backend %s) until the end of %s", _backend(trainer), stage)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Models built in ``configure_model`` (FSDP) only exist now.
        self._swap_models(trainer, pl_module)
        # trainer.log_dir broadcasts rank zero's directory: a collective, so every rank calls it here.
        self.log_dir = trainer.log_dir or trainer.default_root_dir
        self._every = self.log_every_n_steps or trainer.log_every_n_steps
        self._step = -1
        self.dispatcher = self._build_dispatcher() if trainer.is_global_zero else None

    def _swap_models(self, trainer: Trainer, pl_module: LightningModule) -> None:
        models = {name: m for name, m in find_hf_models(pl_module).items() if id(m) not in self._swapped}
        if not models:
            if not self._swapped and not self.patch_sdpa:
                log.warning("StableAttentionCallback: no transformers PreTrainedModel found in %s; "
                            "attention is not swapped and no layer statistics are logged",
                            type(pl_module).__name__)
            return
        from ..integrations.transformers import attach_stats, attention_modules

        if self.swap:
            swap_attention(models)
        stats: dict[str, Any] = dict(self.layers.stats) if self.layers is not None else {}
        several = len(models) + len(self._swapped) > 1
        for path, model in models.items():
            self._swapped[id(model)] = path
            if not self.attention_stats:
                continue
            for name, s in attach_stats(model).items():
                stats[f"{path or 'model'}.{name}" if several else name] = s
        self.layers = LayerStats(stats, window=self.layer_window)
        if self._pending_state is not None:
            self.layers.load_state_dict(self._pending_state.get("layers", {}))
        if self.early_warnings and self.attention_stats:
            for name in stats:
                for stat, make in (("saturation", SurgeDetector.saturation), ("max_logit", SurgeDetector.max_logit)):
                    metric = f"stable_attn/{stat}/{name}"
                    if metric not in self.surge_detectors:
                        warmup = {} if self.early_warning_warmup is None else {"warmup": self.early_warning_warmup}
                        self.surge_detectors[metric] = make(metric, **warmup)
            if self._pending_state is not None:
                self._load_surge(self._pending_state.get("surge", {}))
        if trainer.is_global_zero:
            n_attention = sum(len(attention_modules(m)) for m in models.values())
            names = ", ".join(type(m).__name__ for m in models.values())
            what = "switched %d transformers model(s) [%s] to 'stable_attn'" if self.swap else \
                "monitoring %d transformers model(s) [%s] (attention not switched)"
            log.info("StableAttentionCallback: " + what + ": %d attention layer(s), backend %s",
                     len(models), names, n_attention, _backend(trainer))

    def _build_dispatcher(self) -> AlertDispatcher:
        channels: list[Any] = [LoggingChannel()]
        if self.alerts_file is not None:
            channels.append(JsonlChannel(os.path.join(self.log_dir, self.alerts_file)))
        channels.extend(CallableChannel(fn) for fn in self.on_alert)
        if self.webhook_url is not None:
            channels.append(WebhookChannel(self.webhook_url, timeout=self.webhook_timeout))
        return AlertDispatcher(channels)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # A run that dies (e.g. on a NaN raised by user code) still delivers the alerts that explain it.
        if self.dispatcher is not None:
            self.dispatcher.flush(timeout=2 * self.webhook_timeout)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.dispatcher is not None:
            self.dispatcher.close()  # delivers queued webhook alerts (bounded wait)
            self.dispatcher = None
        if self._sdpa_patch is not None:
            self._sdpa_patch.restore()
            self._sdpa_patch = None
        if self.layers is not None:
            self.layers.enable(False)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.on_spike == "rollback":
            self._snapshot = take_snapshot(trainer, pl_module)

    # ------------------------------------------------------------ each step
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._step:
            return  # another micro-batch of the same optimizer step
        self._step = step
        self._loss = None
        self._acted = False
        self._monitor_now = self._every > 0 and (step + 1) % self._every == 0  # Trainer(log_every_n_steps=0): never
        if self.layers is not None:
            self.layers.enable(self._monitor_now)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        # Lightning divides each micro-batch loss by accumulate_grad_batches: the sum is the step's mean loss.
        loss = loss.detach().float()
        self._loss = loss if self._loss is None else self._loss + loss

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        step = trainer.global_step
        device = trainer.strategy.root_device
        grad_norm = total_grad_norm(pl_module.parameters(), trainer.strategy) if self.monitor_grad_norm else None
        nan = torch.full((), math.nan, device=device)
        mine = torch.stack([
            self._loss.to(device) if self._loss is not None else nan,
            grad_norm.float().to(device) if grad_norm is not None else nan,
            torch.full((), float(self._loss is not None), device=device),
        ]).double()
        # Every rank shares its raw values (one collective per step, issued whatever the values are) and
        # every rank runs the same detectors over all of them, so all ranks reach the same verdict.
        table = trainer.strategy.all_gather(mine).reshape(-1, _FIELDS) if trainer.world_size > 1 else mine[None]
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else math.nan
        scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
        record = _StepRecord(step, grad_norm is not None, lr, scaler)

        previous, self._deferred = self._deferred, None
        if previous is not None:
            self._process(trainer, *previous)
        if self.on_spike == "warn" and table.is_cuda and not self._monitor_now:
            # Nothing to decide before the update: read the values one step late, without stalling the
            # device (a blocking read here would stop the host from queueing the next step's kernels).
            host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
            host.copy_(table, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._deferred = (record, host, done)
        elif self._process(trainer, record, table.cpu(), None) and self.on_spike != "warn":
            # No gradients, no update: torch optimizers skip parameters whose .grad is None.
            optimizer.zero_grad(set_to_none=True)
            self._acted = True
            if self.on_spike == "skip":
                self.skipped_steps.append(step)
            elif self.on_spike == "rollback":
                self._pending_rollback = True
            else:
                self._pending_stop = True
        self._stepped = True

    def _process(self, trainer: Trainer, record: _StepRecord, table: torch.Tensor, done: Any) -> bool:
        """Run the detectors on one step's values from every rank; alert; True if the step spiked."""
        if done is not None:
            done.synchronize()
        rows = table.tolist()  # [rank][loss, grad norm, has loss]
        step, world = record.step, len(rows)
        norm = rows[0][1]
        losses = [r[0] for r in rows if r[2] and math.isfinite(r[0])]
        self._last = {
            "train/loss": sum(losses) / len(losses) if losses else (math.nan if not any(r[2] for r in rows) else
                                                                    next(r[0] for r in rows if r[2])),
            "train/grad_norm": norm,
            "train/lr": record.lr,
        }
        self._loss_detector(world - 1)  # every rank's detector exists before any sees this step
        loss_events = []
        for rank, row in enumerate(rows):
            if row[2]:
                event = self._loss_detector(rank).update(step, row[0])
                if event is not None:
                    loss_events.append((rank, event))
        norm_event = None
        # A GradScaler (fp16 AMP) meets inf gradients by design and skips those steps itself.
        if record.has_norm and not (record.scaler and not math.isfinite(norm)):
            norm_event = self.grad_norm_detector.update(step, norm)
        self._note_ready(trainer, step)
        note = self._action_note(step)
        new_loss = [(rank, e) for rank, e in loss_events if e.is_new]
        if new_loss:
            rank, event = new_loss[0]
            self._alert(trainer, event, self.on_spike, (f"on rank {rank} of {world}" if world > 1 else "") + note)
        if norm_event is not None and norm_event.is_new:
            self._alert(trainer, norm_event, self.on_spike, note)
        return bool(loss_events) or norm_event is not None

    def _note_ready(self, trainer: Trainer, step: int) -> None:
        """Say once when each spike detector has calibrated: before that, only non-finite values alert."""
        for detector in (self.loss_detector, self.grad_norm_detector):
            if detector.metric not in self._ready_logged and detector.ready:
                self._ready_logged.add(detector.metric)
                if trainer.is_global_zero:
                    log.info("StableAttentionCallback: %s spike detection active from step %d", detector.metric, step)

    def _loss_detector(self, rank: int) -> SpikeDetector:
        """Rank ``rank``'s loss detector (each rank's loss has its own level and noise)."""
        while len(self._rank_loss_detectors) <= rank:
            detector = copy.deepcopy(self.loss_detector)
            pending = self._pending_rank_states.get(len(self._rank_loss_detectors))
            if pending is not None:
                detector.load_state_dict(pending)
            self._rank_loss_detectors.append(detector)
        return self._rank_loss_detectors[rank]

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        previous, self._deferred = self._deferred, None
        if previous is not None:
            self._process(trainer, *previous)

    def _action_note(self, step: int) -> str:
        if self.on_spike == "skip":
            return "; update skipped"
        if self.on_spike == "rollback":
            at = self._snapshot.step if self._snapshot is not None else "?"
            return f"; rolling back to the state at global_step {at}"
        if self.on_spike == "stop":
            return f"; stopping, checkpoint {self._stop_path(step)}"
        return ""

    def _stop_path(self, step: int) -> str:
        return os.path.join(self.log_dir or ".", f"stable_attn-stop-step={step}.ckpt")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._stepped:
            return  # accumulating gradients: the optimizer step has not happened yet
        self._stepped = False
        step = self._step
        alerts_before = self.alert_count
        if self._monitor_now:
            self._monitor(trainer, step)

        if self._pending_rollback:
            self._pending_rollback = False
            assert self._snapshot is not None
            restore_snapshot(trainer, pl_module, self._snapshot)
            self.rollbacks.append((step, self._snapshot.step))
            if trainer.is_global_zero:
                log.warning("StableAttentionCallback: rolled back to the state at global_step %d; the batches of "
                            "steps %d..%d are dropped", self._snapshot.step, self._snapshot.step, step)
        elif (self.on_spike == "rollback" and not self._acted and trainer.global_step % self.rollback_every == 0):
            self._snapshot = take_snapshot(trainer, pl_module)

        if self._pending_stop:
            self._pending_stop = False
            path = self._stop_path(step)
            trainer.save_checkpoint(path)  # every rank: checkpointing may be collective
            self.stop_checkpoint = path
            trainer.should_stop = True
            if trainer.is_global_zero:
                log.warning("StableAttentionCallback: stopped training at step %d; checkpoint %s", step, path)

        if (self._monitor_now or self.alert_count != alerts_before) and trainer.progress_bar_callback is not None:
            pl_module.log("stable_attn/alerts", float(self.alert_count), prog_bar=True, logger=False,
                          on_step=True, on_epoch=False)
        if self.layers is not None:
            self.layers.enable(False)

    def _monitor(self, trainer: Trainer, step: int) -> None:
        metrics = {k: v for k, v in self._last.items() if not (k == "train/grad_norm" and not self.monitor_grad_norm)}
        if self.layers is not None and len(self.layers):
            gather = trainer.strategy.all_gather if trainer.world_size > 1 else None
            per_layer = self.layers.collect(step, gather, trainer.strategy.root_device)
            for name, values in per_layer.items():
                for stat in STAT_NAMES:
                    metrics[f"stable_attn/{stat}/{name}"] = values[stat]
                for stat in ("saturation", "max_logit"):
                    detector = self.surge_detectors.get(f"stable_attn/{stat}/{name}")
                    event = detector.update(step, values[stat]) if detector is not None else None
                    if event is not None and event.is_new:
                        self._alert(trainer, event, "warn", "")
        metrics["stable_attn/alerts"] = float(self.alert_count)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _alert(self, trainer: Trainer, event: SpikeEvent, action: str, message: str) -> None:
        """Count the alert on every rank (the count is shown and logged), deliver it on rank zero."""
        self.alert_count += 1
        if self.dispatcher is None:
            return
        layers = self.layers.most_changed() if self.layers is not None else []
        self.dispatcher.emit(
            Alert.from_event(event, lr=self._last.get("train/lr"), layers=layers, action=action,
                             message=message.lstrip("; "))
        )

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_detector": self.loss_detector.state_dict(),
            # every rank runs every rank's detector, so rank zero's copy of them is everyone's
            "other_rank_loss_detectors": [d.state_dict() for d in self._rank_loss_detectors[1:]],
            "grad_norm_detector": self.grad_norm_detector.state_dict(),
            "surge": {name: det.state_dict() for name, det in self.surge_detectors.items()},
            "alert_count": self.alert_count,
            "skipped_steps": list(self.skipped_steps),
            "rollbacks": [list(r) for r in self.rollbacks],
            "stop_checkpoint": self.stop_checkpoint,
            "layers": self.layers.state_dict() if self.layers is not None else {},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loss_detector.load_state_dict(state_dict["loss_detector"])
        others = state_dict.get("other_rank_loss_detectors", [])
        self._pending_rank_states = {rank: st for rank, st in enumerate(others, start=1)}
        del self._rank_loss_detectors[1:]  # rebuilt from the saved states as ranks report
        self.grad_norm_detector.load_state_dict(state_dict["grad_norm_detector"])
        self.alert_count = int(state_dict.get("alert_count", 0))
        self.skipped_steps = list(state_dict.get("skipped_steps", []))
        self.rollbacks = [tuple(r) for r in state_dict.get("rollbacks", [])]
        self.stop_checkpoint = state_dict.get("stop_checkpoint")
        # Layer detectors are created when the model is found; keep their state until then.
        self._pending_state = state_dict
        if self.layers is not None:
            self.layers.load_state_dict(state_dict.get("layers", {}))
        self._load_surge(state_dict.get("surge", {}))

    def _load_surge(self, states: dict[str, Any]) -> None:
        for name, state in states.items():
            if name in self.surge_detectors:
                self.surge_detectors[name].load_state_dict(state)
