"""StableAttentionCallback: the stabilized attention, monitoring, alerts and spike handling for a
Lightning ``Trainer``.

The callback is glue between Trainer hooks and :mod:`stable_attn.monitor`: the detectors decide what
is anomalous, the channels deliver alerts, and this module decides *when* each happens in a step and
how ranks agree. The order inside one optimizer step (automatic optimization):

1. ``on_train_batch_start``: a monitored step switches the layers' AttentionStats on.
2. ``on_before_backward``: the (accumulation-normalised) loss is remembered.
3. ``on_before_optimizer_step``: gradients are complete and unscaled (AMP unscales before this
   hook), the update has not happened yet. One all-gather shares every rank's loss, gradient norm
   and non-finite-gradient flag; every rank runs every rank's detectors over them, and a spike or a
   non-finite value on any rank acts on all ranks: for a non-finite value always, and for a spike
   with ``"skip"``, ``"rollback"`` and ``"stop"``, the gradients are dropped (``set_to_none``), so
   the optimizer step that follows changes neither the weights nor the optimizer state (torch
   optimizers skip parameters without gradients: no moment update, no step count, no weight decay).
   The verdict is read on the host before every update (one small device-to-host copy per step):
   deciding later would let a NaN update through.
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ..monitor import (
    ALERT_KINDS,
    Alert,
    AlertDispatcher,
    SpikeDetector,
    SpikeEvent,
    SurgeDetector,
    names,
)
from . import alerting
from .grad_norm import nonfinite_grads, total_grad_norm
from .layer_stats import STAT_NAMES, LayerStats
from .rollback import Snapshot, restore_snapshot, snapshot_from_state, snapshot_state, take_snapshot
from .swap import find_hf_models, swap_attention

__all__ = ["StableAttentionCallback"]

log = logging.getLogger("stable_attn")

SpikeAction = Literal["warn", "skip", "rollback", "stop"]
_ACTIONS = ("warn", "skip", "rollback", "stop")
# What each rank shares every step: loss, gradient norm, whether it had a loss (a skipped backward has none),
# whether any of its gradients is NaN or inf.
_FIELDS = 4


@dataclass
class _Verdict:
    drop: bool  # the step's update is dropped
    action: str  # what the step's alerts say is done: "warn", "skip", "rollback" or "stop"
    not_training: bool  # the step counts towards the not-training streak (dropped, or a non-finite loss)


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


def _worst(values: list[float]) -> float:
    """The value to log for several ranks' gradient norms: a non-finite one if any, else the largest."""
    if not values:
        return math.nan
    return next((v for v in values if not math.isfinite(v)), max(values))


def _where(ranks: list[int], world: int) -> str:
    """Which ranks saw it, for an alert message (nothing in a single-process run)."""
    if world == 1 or not ranks:
        return ""
    if len(ranks) == world:
        return f"on all {world} ranks"
    return f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world}"


def _phase(detector: SpikeDetector) -> str:
    """Which rule judges the detector's next value: "starting" (NaN/inf only), "gross" or "calibrated"."""
    phase = getattr(detector, "phase", None)  # older detectors only know whether they are calibrated
    return phase if phase is not None else ("calibrated" if detector.ready else "starting")


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

    Early warnings only alert.

    **Delivery.** Every channel counts its alerts: delivered, failed, dropped (the webhook's queue was
    full) and abandoned (still pending when the run ended, or handed over while the webhook was
    paused after repeated failures); see :data:`~stable_attn.monitor.alerts.DELIVERY_COUNTS`. The
    counts are in :attr:`alert_delivery` and the callback's ``state_dict``, and at the end of ``fit()``
    one line per channel names it (the file path, the webhook's scheme, host and port, never its path
    or query) with its counts: a WARNING for a channel that did not deliver every alert. The JSONL
    file is written synchronously. ``on_alert`` callables run on the training thread, in order;
    one call longer than :data:`~stable_attn.monitor.alerts.SLOW_CALLABLE_S` (0.1 s) logs one
    WARNING naming the callable. The webhook never blocks training (a background thread; see
    :mod:`stable_attn.monitor.webhook` for the request, the payload and the time limits).

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
    above even without any logging set up): the swap; for each watched metric, when spike detection
    becomes active (the gross-jump rule, then the calibrated rule); every alert; and at the end of
    ``fit()`` one summary line (alerts by kind, updates skipped, rollbacks, the stop checkpoint).

    Args:
        on_spike: ``"warn"``, ``"skip"``, ``"rollback"`` or ``"stop"``.
        log_every_n_steps: optimizer steps between monitored steps; None follows the Trainer's
            ``log_every_n_steps``.
        swap: switch transformers models to ``"stable_attn"`` at setup.
        patch_sdpa: also route ``torch.nn.functional.scaled_dot_product_attention`` to the
            stabilized kernel (for attention modules that are not transformers models); undone at
            teardown.
        loss_detector: detector for the training loss; default ``SpikeDetector.loss()``.
        grad_norm_detector: detector for the gradient norm; default ``SpikeDetector.grad_norm()``
            (a wider gross-jump ratio: a healthy run's early gradient norm swings by several times
            from step to step); None with ``monitor_grad_norm=False`` skips it.
        monitor_grad_norm: compute the gradient norm every step (one pass over the gradients).
        attention_stats: collect per-layer attention statistics on monitored steps (the kernel
            computes them as side outputs of the forward; on the CPU path they cost a few percent of
            a monitored step).
        early_warnings: run surge detectors on each layer's saturation and max logit.
        early_warning_warmup: monitored steps each surge detector watches before it can fire; None
            keeps :class:`~stable_attn.monitor.SurgeDetector`'s default (10). The callback also gives
            each surge detector the step's training loss: an early warning needs the loss to have
            stopped improving (a max logit that grows while the loss falls is learning), so a surge
            detector stays silent until it has seen 50 monitored steps' losses. Its time constants
            count monitored steps: with ``log_every_n_steps=50`` that is 2,500 optimizer steps.
        rollback_every: optimizer steps between snapshots for ``on_spike="rollback"``.
        on_alert: a callable or callables, each called with every :class:`~stable_attn.monitor.Alert`
            on the training thread (keep them fast: see **Delivery**).
        webhook_url: ``http(s)://`` URL that receives each alert as a JSON POST (ASCII, no spaces,
            control characters or ``user:password@``; redirects are not followed).
        webhook_timeout: seconds for each webhook connect and read, in (0, 60]; also the most the
            end of ``fit()`` waits for undelivered webhook alerts.
        webhook_headers: HTTP headers sent with each webhook request, to ``webhook_url``'s host only
            (e.g. ``{"Authorization": "Bearer <token>"}``); never logged.
        alerts_file: file name of the alerts JSONL inside the run's log directory
            (``trainer.log_dir``), or None for none; the default is what ``stable-attn report`` reads.
        layer_window: monitored steps over which layer changes are reported in alerts.
        not_training_after: optimizer steps in a row without an applied update (or with a
            non-finite loss) that raise the ``not_training`` alert.
        not_training_stop_after: steps in a row after which the run is stopped with a checkpoint;
            None never stops.
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
        webhook_headers: Mapping[str, str] | None = None,
        alerts_file: str | None = names.ALERTS_FILE,
        layer_window: int = 10,
        not_training_after: int = 10,
        not_training_stop_after: int | None = 100,
    ) -> None:
        if on_spike not in _ACTIONS:
            raise ValueError(f"on_spike={on_spike!r} is not supported; use one of {_ACTIONS}")
        _check_int("log_every_n_steps", log_every_n_steps, 1, allow_none=True)
        _check_int("rollback_every", rollback_every, 1)
        _check_int("layer_window", layer_window, 2)
        _check_int("early_warning_warmup", early_warning_warmup, 0, allow_none=True)
        _check_int("not_training_after", not_training_after, 1)
        _check_int("not_training_stop_after", not_training_stop_after, not_training_after, allow_none=True)
        for name, flag in (("swap", swap), ("patch_sdpa", patch_sdpa), ("monitor_grad_norm", monitor_grad_norm),
                           ("attention_stats", attention_stats), ("early_warnings", early_warnings)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}={flag!r} is not supported; use True or False")
        for name, det in (("loss_detector", loss_detector), ("grad_norm_detector", grad_norm_detector)):
            if det is not None and not isinstance(det, SpikeDetector):
                raise TypeError(f"{name}={det!r} is not supported; use a stable_attn.monitor.SpikeDetector or None")
        callbacks = alerting.check_on_alert(on_alert)
        webhook_timeout, webhook_headers = alerting.check_webhook(webhook_url, webhook_timeout, webhook_headers)
        alerting.check_alerts_file(alerts_file)

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
        self.webhook_headers = webhook_headers
        self.alerts_file = alerts_file
        self.layer_window = layer_window
        self.not_training_after = not_training_after
        self.not_training_stop_after = not_training_stop_after
        self.loss_detector = loss_detector if loss_detector is not None else SpikeDetector.loss()
        self.grad_norm_detector = grad_norm_detector if grad_norm_detector is not None else SpikeDetector.grad_norm()
        self.surge_detectors: dict[str, SurgeDetector] = {}

        self.alert_count = 0
        self.alert_kinds: dict[str, int] = dict.fromkeys(ALERT_KINDS, 0)
        self.not_training_streak = 0  # optimizer steps in a row without an applied update
        self.skipped_steps: list[int] = []
        self.rollbacks: list[tuple[int, int]] = []  # (spiking step, snapshot step)
        self.stop_checkpoint: str | None = None
        self.layers: LayerStats | None = None
        self.dispatcher: AlertDispatcher | None = None
        # per channel: delivered, failed, dropped, abandoned (closed channels and earlier runs of a resume)
        self.alert_delivery: dict[str, dict[str, int]] = {}
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
        # Each rank's loss and gradient norm have their own detectors (rank 0's are ``loss_detector``
        # and ``grad_norm_detector``; the others are copies, made as ranks report).
        self._rank_detectors: dict[str, list[SpikeDetector]] = {
            names.LOSS: [self.loss_detector], names.GRAD_NORM: [self.grad_norm_detector]}
        self._pending_rank_states: dict[str, dict[int, dict[str, Any]]] = {names.LOSS: {}, names.GRAD_NORM: {}}
        self._phases: dict[str, str] = {}  # metric -> the detector phase last announced
        self._grads_were_bad = False
        self._snapshot: Snapshot | None = None
        self._snapshot_in_checkpoint = False
        self._loaded_snapshot: Snapshot | None = None
        self._resumed = False

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._swap_models(trainer, pl_module)
        if self.patch_sdpa and self._sdpa_patch is None:
            from ..integrations.sdpa import patch_sdpa

            self._sdpa_patch = patch_sdpa()
            if trainer.is_global_zero:
                log.warning("StableAttentionCallback: torch.nn.functional.scaled_dot_product_attention now runs "
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
                    metric = names.layer_metric(stat, name)
                    if metric not in self.surge_detectors:
                        warmup = {} if self.early_warning_warmup is None else {"warmup": self.early_warning_warmup}
                        self.surge_detectors[metric] = make(metric, **warmup)
            if self._pending_state is not None:
                self._load_surge(self._pending_state.get("surge", {}))
        if trainer.is_global_zero:
            n_attention = sum(len(attention_modules(m)) for m in models.values())
            found = ", ".join(type(m).__name__ for m in models.values())
            what = "switched %d transformers model(s) [%s] to 'stable_attn'" if self.swap else \
                "monitoring %d transformers model(s) [%s] (attention not switched)"
            log.warning("StableAttentionCallback: " + what + ": %d attention layer(s), backend %s",
                        len(models), found, n_attention, _backend(trainer))

    def _build_dispatcher(self) -> AlertDispatcher:
        return alerting.build_dispatcher(self.log_dir or ".", self.alerts_file, self.on_alert, self.webhook_url,
                                         self.webhook_timeout, self.webhook_headers)

    # ------------------------------------------------------------- end of run
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Lightning calls no teardown hook when fit() raises (KeyboardInterrupt included): end the run here.
        self._end_run(f"after fit() raised {type(exception).__name__}")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._end_run(f"at the end of {getattr(stage, 'value', stage)}()")

    def _end_run(self, when: str) -> None:
        """Close the alert channels (within one webhook timeout in all), say what they did not deliver,
        put back ``F.scaled_dot_product_attention`` and switch statistics off. Idempotent."""
        dispatcher, self.dispatcher = self.dispatcher, None
        if dispatcher is not None:
            delivered = alerting.close_dispatcher(dispatcher, self.webhook_timeout, when)
            self.alert_delivery = alerting.add_counts(self.alert_delivery, delivered)
        patch, self._sdpa_patch = self._sdpa_patch, None
        if patch is not None:
            try:
                patch.restore()
            except RuntimeError as exc:  # another patch_sdpa was installed on top of ours during the run
                log.warning("StableAttentionCallback: torch.nn.functional.scaled_dot_product_attention not restored "
                            "%s: %s", when, exc)
        if self.layers is not None:
            self.layers.enable(False)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loaded, self._loaded_snapshot = self._loaded_snapshot, None
        resumed, self._resumed = self._resumed, False
        # A snapshot of one process is the whole state; several ranks (DDP, FSDP) each hold their own, and a
        # checkpoint keeps rank zero's only.
        self._snapshot_in_checkpoint = trainer.world_size == 1
        if self.on_spike != "rollback":
            return
        if loaded is not None:
            self._snapshot = loaded
            if trainer.is_global_zero:
                log.info("StableAttentionCallback: rollback snapshot of global_step %d restored from the checkpoint",
                         loaded.step)
            return
        self._snapshot = take_snapshot(trainer, pl_module)
        if resumed and trainer.is_global_zero:
            log.warning("StableAttentionCallback: rollback history starts afresh at global_step %d: the checkpoint "
                        "holds no rollback snapshot (one is saved only by single-process runs with "
                        "on_spike='rollback'), so a spike rolls back to no earlier state than this one",
                        trainer.global_step)

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
        # The norm is non-finite exactly when a gradient is (or its sum of squares overflows): no second
        # pass then; without it, a max-abs pass over the local gradients.
        bad_grads = (~torch.isfinite(grad_norm)).float() if grad_norm is not None else \
            nonfinite_grads(pl_module.parameters())
        nan = torch.full((), math.nan, device=device)
        mine = torch.stack([
            self._loss.to(device) if self._loss is not None else nan,
            grad_norm.float().to(device) if grad_norm is not None else nan,
            torch.full((), float(self._loss is not None), device=device),
            bad_grads.to(device) if bad_grads is not None else torch.zeros((), device=device),
        ]).double()
        # Every rank shares its raw values (one collective per step, issued whatever the values are) and
        # every rank runs the same detectors over all of them, so all ranks reach the same verdict.
        table = trainer.strategy.all_gather(mine).reshape(-1, _FIELDS) if trainer.world_size > 1 else mine[None]
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else math.nan
        scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
        record = _StepRecord(step, grad_norm is not None, lr, scaler)
        verdict = self._process(trainer, record, table.cpu())
        if verdict.drop:
            # No gradients, no update: torch optimizers skip parameters whose .grad is None.
            optimizer.zero_grad(set_to_none=True)
            self._acted = True
            if verdict.action == "skip":
                self.skipped_steps.append(step)
            elif verdict.action == "rollback":
                self._pending_rollback = True
            else:
                self._pending_stop = True
        self._escalate(trainer, step, verdict.not_training)
        self._stepped = True

    def _process(self, trainer: Trainer, record: _StepRecord, table: torch.Tensor) -> _Verdict:
        """Run every rank's detectors on one step's values from every rank, alert, and decide."""
        rows = table.tolist()  # [rank][loss, grad norm, has loss, non-finite gradients]
        step, world = record.step, len(rows)
        losses = [r[0] for r in rows if r[2]]
        norms = [r[1] for r in rows] if record.has_norm else []
        self._last = {
            names.LOSS: sum(losses) / len(losses) if losses else math.nan,  # a NaN on any rank shows
            names.GRAD_NORM: _worst(norms),
            names.LR: record.lr,
        }
        loss_detectors, norm_detectors = self._detectors(names.LOSS, world), self._detectors(names.GRAD_NORM, world)
        loss_events = [(rank, loss_detectors[rank].update(step, r[0])) for rank, r in enumerate(rows) if r[2]]
        norm_events = []
        # A GradScaler (fp16 AMP) meets inf gradients by design and skips those steps itself.
        if record.has_norm:
            norm_events = [(rank, norm_detectors[rank].update(step, r[1])) for rank, r in enumerate(rows)
                           if not (record.scaler and not math.isfinite(r[1]))]
        loss_events = [(rank, e) for rank, e in loss_events if e is not None]
        norm_events = [(rank, e) for rank, e in norm_events if e is not None]
        bad_grad_ranks = [] if record.scaler else [rank for rank, r in enumerate(rows) if r[3]]
        nonfinite_loss = any(r[2] and not math.isfinite(r[0]) for r in rows)
        nonfinite = nonfinite_loss or bool(bad_grad_ranks)
        spiked = bool(loss_events or norm_events)
        drop = nonfinite or (spiked and self.on_spike != "warn")
        action = self.on_spike if self.on_spike != "warn" else ("skip" if drop else "warn")
        note = self._action_note(step, action)
        if nonfinite and self.on_spike == "warn":
            note += " (a non-finite update is never applied, whatever on_spike says)"
        self._note_phases(trainer, step)
        for events in (loss_events, norm_events):
            new = [(rank, e) for rank, e in events if e.is_new]
            if new:
                self._alert(trainer, new[0][1], action, _where([rank for rank, _ in events], world) + note)
        if bad_grad_ranks and not record.has_norm and not self._grads_were_bad:
            self._emit(trainer, Alert(
                step=step, kind="nonfinite", metric=names.GRADIENTS, value=math.nan, lr=record.lr, action=action,
                message=("NaN or inf in the gradients " + _where(bad_grad_ranks, world) + note).strip()))
        self._grads_were_bad = bool(bad_grad_ranks) and not record.has_norm
        return _Verdict(drop=drop, action=action, not_training=drop or nonfinite_loss)

    def _escalate(self, trainer: Trainer, step: int, not_training: bool) -> None:
        """Count the optimizer steps in a row that did not train; alert, then stop, when there are many."""
        self.not_training_streak = self.not_training_streak + 1 if not_training else 0
        streak = self.not_training_streak
        stop = self.not_training_stop_after
        if streak not in (self.not_training_after, stop):
            return
        action = "stop" if streak == stop else "warn"
        if action == "stop":
            self._pending_stop = True
        then = f"; stopping, checkpoint {self._stop_path(step)}" if action == "stop" else (
            f"; the run stops after {stop} such steps" if stop is not None else "")
        self._emit(trainer, Alert(
            step=step, kind="not_training", metric=names.NOT_TRAINING, value=streak,
            threshold=self.not_training_after, lr=self._last.get(names.LR), action=action,
            message=f"the run is not training: {streak} optimizer steps in a row (steps {step - streak + 1}..{step}) "
                    f"had their update dropped or a non-finite loss{then}"))

    def _note_phases(self, trainer: Trainer, step: int) -> None:
        """One WARNING line when the rule that judges a watched metric changes: NaN/inf only at first,
        then gross jumps, then the calibrated rule (see SpikeDetector)."""
        watched = [self.loss_detector] + ([self.grad_norm_detector] if self.monitor_grad_norm else [])
        changed: dict[tuple[str, float | None], list[str]] = {}  # metrics that changed at once share a line
        for detector in watched:
            phase = _phase(detector)
            if self._phases.get(detector.metric) != phase:
                self._phases[detector.metric] = phase
                changed.setdefault((phase, getattr(detector, "gross_ratio", None)), []).append(detector.metric)
        if not trainer.is_global_zero:
            return
        following = step + 1  # the phase judges the values after the one that changed it
        for (phase, ratio), metrics in changed.items():
            which = ", ".join(metrics)
            if phase == "gross":
                rule = f"a value above {ratio:g}x its recent median, or NaN/inf, alerts" if ratio else "NaN/inf alert"
                log.warning("StableAttentionCallback: spike detection active from step %d on %s: %s; the calibrated "
                            "rule takes over once it has learnt the run's noise", following, which, rule)
            elif phase == "calibrated":
                log.warning("StableAttentionCallback: calibrated spike detection active from step %d on %s",
                            following, which)

    def _detectors(self, metric: str, world: int) -> list[SpikeDetector]:
        """The ``metric`` detectors of ranks 0..world-1 (each rank's values have their own level and noise)."""
        detectors = self._rank_detectors[metric]
        while len(detectors) < world:
            detector = copy.deepcopy(detectors[0])
            pending = self._pending_rank_states[metric].get(len(detectors))
            if pending is not None:
                detector.load_state_dict(pending)
            detectors.append(detector)
        return detectors

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            log.warning("StableAttentionCallback: %s", self.summary())

    def summary(self) -> str:
        """One line: the alerts of the run by kind, the updates skipped, rollbacks and the stop checkpoint."""
        kinds = ", ".join(f"{kind} {n}" for kind, n in self.alert_kinds.items())
        line = f"{self.alert_count} alert(s) ({kinds}); {len(self.skipped_steps)} update(s) skipped"
        if self.skipped_steps:
            shown = ", ".join(map(str, self.skipped_steps[:5])) + (", ..." if len(self.skipped_steps) > 5 else "")
            line += f" (steps {shown})"
        line += f", {len(self.rollbacks)} rollback(s)"
        if self.stop_checkpoint is not None:
            line += f"; stopped, checkpoint {self.stop_checkpoint}"
        if self.alerts_file is not None and self.alert_count and self.log_dir is not None:
            line += f"; alerts in {os.path.join(self.log_dir, self.alerts_file)}"
        return line

    def _action_note(self, step: int, action: str) -> str:
        if action == "skip":
            return "; update skipped"
        if action == "rollback":
            at = self._snapshot.step if self._snapshot is not None else "?"
            return f"; rolling back to the state at global_step {at}"
        if action == "stop":
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
            pl_module.log(names.ALERT_COUNT, float(self.alert_count), prog_bar=True, logger=False,
                          on_step=True, on_epoch=False)
        if self.layers is not None:
            self.layers.enable(False)

    def _monitor(self, trainer: Trainer, step: int) -> None:
        metrics = {k: v for k, v in self._last.items() if not (k == names.GRAD_NORM and not self.monitor_grad_norm)}
        if self.layers is not None and len(self.layers):
            gather = trainer.strategy.all_gather if trainer.world_size > 1 else None
            per_layer = self.layers.collect(step, gather, trainer.strategy.root_device)
            for name, values in per_layer.items():
                for stat in STAT_NAMES:
                    metrics[names.layer_metric(stat, name)] = values[stat]
                for stat in ("saturation", "max_logit"):
                    detector = self.surge_detectors.get(names.layer_metric(stat, name))
                    loss = self._last.get(names.LOSS)  # a NaN loss is ignored by the detector
                    event = detector.update(step, values[stat], loss=loss) if detector is not None else None
                    if event is not None and event.is_new:
                        self._alert(trainer, event, "warn", "")
        metrics[names.ALERT_COUNT] = float(self.alert_count)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _alert(self, trainer: Trainer, event: SpikeEvent, action: str, message: str) -> None:
        """An alert from a detector's event, with the step's learning rate and the layers that moved."""
        layers = self.layers.most_changed() if self.layers is not None else []
        self._emit(trainer, Alert.from_event(event, lr=self._last.get(names.LR), layers=layers, action=action,
                                             message=message.lstrip("; ")))

    def _emit(self, trainer: Trainer, alert: Alert) -> None:
        """Count the alert on every rank (the count is shown and logged), deliver it on rank zero."""
        self.alert_count += 1
        self.alert_kinds[alert.kind] = self.alert_kinds.get(alert.kind, 0) + 1
        if self.dispatcher is not None:
            self.dispatcher.emit(alert)

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_detector": self.loss_detector.state_dict(),
            # every rank runs every rank's detector, so rank zero's copy of them is everyone's
            "other_rank_loss_detectors": [d.state_dict() for d in self._rank_detectors[names.LOSS][1:]],
            "grad_norm_detector": self.grad_norm_detector.state_dict(),
            "other_rank_grad_norm_detectors": [d.state_dict() for d in self._rank_detectors[names.GRAD_NORM][1:]],
            "alert_kinds": dict(self.alert_kinds),
            "not_training_streak": self.not_training_streak,
            "surge": {name: det.state_dict() for name, det in self.surge_detectors.items()},
            "alert_count": self.alert_count,
            "skipped_steps": list(self.skipped_steps),
            "rollbacks": [list(r) for r in self.rollbacks],
            "stop_checkpoint": self.stop_checkpoint,
            "layers": self.layers.state_dict() if self.layers is not None else {},
            "alert_delivery": self._delivery(),
            **({"rollback_snapshot": snapshot_state(self._snapshot)} if self._snapshot is not None
               and self._snapshot_in_checkpoint and self.on_spike == "rollback" else {}),
        }

    def _delivery(self) -> dict[str, dict[str, int]]:
        """Per-channel delivery counts so far: closed channels, earlier runs, and the open channels."""
        live = self.dispatcher.delivery() if self.dispatcher is not None else {}
        return alerting.add_counts(self.alert_delivery, {k: v for k, v in live.items() if any(v.values())})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = True
        self.alert_delivery = alerting.add_counts({}, state_dict.get("alert_delivery", {}))
        snapshot = state_dict.get("rollback_snapshot")
        self._loaded_snapshot = snapshot_from_state(snapshot) if snapshot is not None else None
        self.loss_detector.load_state_dict(state_dict["loss_detector"])
        self.grad_norm_detector.load_state_dict(state_dict["grad_norm_detector"])
        for metric, key in ((names.LOSS, "other_rank_loss_detectors"),
                            (names.GRAD_NORM, "other_rank_grad_norm_detectors")):
            self._pending_rank_states[metric] = dict(enumerate(state_dict.get(key, []), start=1))
            del self._rank_detectors[metric][1:]  # rebuilt from the saved states as ranks report
        self.alert_count = int(state_dict.get("alert_count", 0))
        self.alert_kinds = dict.fromkeys(ALERT_KINDS, 0) | dict(state_dict.get("alert_kinds", {}))
        self.not_training_streak = int(state_dict.get("not_training_streak", 0))
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
