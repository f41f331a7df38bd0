"""MonitorEngine: the stabilized attention, monitoring, alerts and spike handling of a training run,
independent of the training loop.

A training-loop adapter (``callbacks/lightning.py``, ``callbacks/trainer.py``) turns its framework's hooks into
these calls, on every rank, in this order (docs/ARCHITECTURE.md has the table of hooks): :meth:`~MonitorEngine.setup`
(swap the models under the root module, attach statistics; again whenever models may have appeared),
:meth:`~MonitorEngine.start` (the alert channels open on rank zero), :meth:`~MonitorEngine.train_start` once any
checkpoint is restored (the action's first snapshot), then every optimizer step :meth:`~MonitorEngine.begin_step`,
:meth:`~MonitorEngine.add_batch` and :meth:`~MonitorEngine.add_loss` (each micro-batch),
:meth:`~MonitorEngine.before_optimizer_step` (gradients complete and unscaled) and :meth:`~MonitorEngine.end_step`
(after the optimizer and LR-scheduler step); :meth:`~MonitorEngine.end_run` when training ends or raises.

What happens inside one step. ``before_optimizer_step``: one all-gather shares every rank's loss,
gradient norm and non-finite-gradient flag; every rank runs every rank's detectors over them
(:mod:`.verdict`), so all ranks reach the same verdict, and a spike or a non-finite value on any rank
acts on all ranks: for a non-finite value always, and for a spike with ``"skip"``, ``"rollback"``
and ``"stop"``, the gradients are dropped (``set_to_none``), so the optimizer step that follows
changes neither the weights nor the optimizer state (torch optimizers skip parameters without
gradients: no moment update, no step count, no weight decay). The verdict is read on the host before
every update (one small device-to-host copy per step): deciding later would let a NaN update through. With
``device_skip=True`` the device decides instead, and the host reads the step a step later (:mod:`.actions.device_skip`).
``end_step``: layer statistics are reduced across ranks, the early-warning detectors see them, the run's
:class:`~stable_attn.monitor.actions.base.Action` (``on_spike``, owning its state; the judge asked it to decide)
restores or snapshots, and a stop names the checkpoint the adapter writes. Rank zero's
alerts go to the :class:`~stable_attn.monitor.alerts.desk.AlertDesk`, with the evidence of their step
(:mod:`.alerts.evidence`) filled from what the step already holds and a
:class:`~stable_attn.monitor.alerts.evidence.StepFacts` the engine builds; docs/ALERTS.md has the line format.

Every rank issues the same collectives in the same order on every step (one all-gather per step, one
more on monitored steps), whatever it observed, so a spike seen by one rank cannot deadlock the
others. Side effects (log lines, the JSONL file, the webhook) happen on rank zero; logging metrics is
the adapter's (``StepEnd.metrics``).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from . import names
from .actions.base import Action, RunContext, Skip, Stop, Verdict, Warn
from .actions.device_skip import DeviceSkip
from .actions.qk_clip import QKClip
from .actions.recovery import Recover, Recovery
from .actions.replay import diagnose
from .actions.rollback import Rollback
from .actions.snapshots import Trainables
from .alerts.alert import Alert
from .alerts.desk import AlertDesk
from .alerts.evidence import StepFacts
from .config import ACTIONS, MonitorConfig, check_coverage
from .detectors.spikes import SpikeDetector
from .detectors.surge import SurgeDetector
from .grad_norm import nonfinite_grads, total_grad_norm
from .layer_stats import LayerStats
from .layer_watch import LayerWatch
from .loop import Decision, StepEnd, World
from .loop import data_position as _data_position
from .resume_checks import check_resumed_state
from .verdict import ActionCap, NotTrainingStreak, PhaseNotes, RankReading, StepJudge

if TYPE_CHECKING:  # PEP 692: names and types of **options for pyright, mypy, PyCharm
    from typing_extensions import Unpack

    from .config import MonitorOptions

__all__ = ["ACTIONS", "Decision", "MonitorEngine", "StepEnd", "Trainables", "World"]

log = logging.getLogger("stable_attn")


class MonitorEngine:
    """Swap, per-layer statistics, spike detection, the step's action agreed across ranks, alerts,
    rollback snapshots and resume state, for any training loop.

    The arguments are :class:`~stable_attn.monitor.config.MonitorConfig`'s, checked there (see
    :class:`~stable_attn.callbacks.StableAttentionCallback` for what each does); ``name`` starts every log
    line. :meth:`from_config` builds an engine from a MonitorConfig.
    """

    def __init__(self, config: MonitorConfig | None = None, /, *, name: str = "StableAttentionCallback",
                 **options: Unpack[MonitorOptions]) -> None:
        if config is not None and options:
            raise TypeError(f"MonitorEngine takes a MonitorConfig or its arguments, not both (got {sorted(options)})")
        config = config if config is not None else MonitorConfig.from_options(options, owner="MonitorEngine")
        self.config, self.name = config, name
        self.loss_detector = config.loss_detector or SpikeDetector.loss()
        self.grad_norm_detector = config.grad_norm_detector or SpikeDetector.grad_norm()
        self._watch = LayerWatch(config.layer_window, config.early_warnings and config.attention_stats,
                                 config.early_warning_warmup)
        self.world = World()
        self.desk = AlertDesk()  # rank zero's channels, evidence, deferred alerts and delivery counts
        self.alert_count = 0
        self.alert_kinds: dict[str, int] = dict.fromkeys(names.ALERT_KINDS, 0)
        self.skipped_steps: list[int] = []
        self.rollbacks: list[tuple[int, int]] = []  # (spiking step, snapshot step)
        self.unconfirmed_grad_norm_jumps = 0  # gradient-norm jumps without a loss rise: counted, not alerted
        self.stop_checkpoint: str | None = None
        self.log_dir: str | None = None
        self.last: dict[str, float] = {}  # the last step's loss, gradient norm and learning rate
        self._diagnosis: dict[str, Any] | None = None  # diagnose_spikes: the replay of this step's spike
        self._root: torch.nn.Module | None = None
        self.replay_bundles: list[str] = []
        #: What the actions read of the run (monitor/actions/base.py), kept current here.
        self._run = RunContext(name=name, position=lambda: self.data_position)
        # on_spike="recover": the ring, skip window, LR factor and cap live in the Recovery (adapters read it)
        self.recovery = Recovery(rollback_steps=config.rollback_steps, rollback_every=config.rollback_every,
                                 skip_batches=config.skip_batches, lr_factor=config.lr_factor,
                                 lr_steps=config.lr_steps, max_recoveries=config.max_recoveries,
                                 cooldown_steps=config.cooldown_steps,
                                 memory_limit=config.snapshot_memory_limit) if config.recovers else None
        self.action: Action  # what on_spike does, with its state (monitor/actions/)
        if config.rolls_back:
            self.action = Rollback(self._run, config.rollback_every)
        elif self.recovery is not None:
            self.action = Recover(self._run, self.recovery)
        else:
            self.action = {"warn": Warn, "skip": Skip, "stop": Stop}[config.on_spike](self._run)
        self._cap = ActionCap(config.spike_action_cap, config.spike_action_cooldown)
        self._judge = StepJudge(config.on_spike, self.loss_detector, self.grad_norm_detector, self._cap,
                                confirm=config.spike_confirm_steps, action=self.action)
        # device_skip=True: each step's update gated on the device, its values read by the host a step later
        self._device = DeviceSkip(self._judge) if config.device_skip else None
        self._streak = NotTrainingStreak(config.not_training_after, config.not_training_stop_after)
        self._phases = PhaseNotes()
        self._swapped: dict[int, torch.nn.Module] = {}  # the models prepared so far, by id
        self._switch_watch: Any = None  # a SwitchWatch once a run sets up (transformers imported then)
        self._checkpointing_undo: list[Any] = []  # config.use_cache and the dynamo switch, put back by end_run
        self.sdpa_patch: Any = None  # the patch_sdpa() handle while F.scaled_dot_product_attention is patched
        self._every = 1
        self._step = -1
        self._alerts_at_start = 0
        self._monitor_now = False
        self._loss: torch.Tensor | None = None
        self._stepped = False
        self._spiked = False
        self._acted = False  # this step's update was dropped
        self._stopping = False  # this step stops the run (the action's or the not-training streak's)
        self._taken = "warn"  # the step's verdict's word (what its action does, as decided)
        self._resolved: dict[str, Any] | None = None  # what the step's action did, once it ran (the alerts' outcome)
        # QK-Clip (qk_clip=): the weight edits live in qk_clip.py; the engine feeds it each step's max logits
        self._qk = QKClip(config.qk_clip, config.qk_clip_alpha) if config.qk_clip is not None else None
        self._qk_modules: dict[str, torch.nn.Module] = {}
        #: Batches the adapter's data stream has already drawn past the current one when a recovery starts
        #: (Lightning prefetches one): the skip window starts after them.
        self.skip_lag = 0
        # Where the step's last micro-batch sits in the data (add_batch) as (batch, epoch, index); the fingerprint,
        # a host copy of the token ids, is taken only when data_position is read: an alert, a recovery.
        self._position: tuple[Any, int | None, int | None] | None = None
        self._position_read: dict[str, Any] | None = None
        #: The step's micro-batches, as given to add_batch (references, no copies; cleared by begin_step).
        self.step_batches: list[Any] = []

    # help() and IDEs show the arguments (a checked MonitorConfig may come first instead: from_config)
    __init__.__signature__ = MonitorConfig.signature(  # type: ignore[attr-defined]
        inspect.Parameter("name", inspect.Parameter.KEYWORD_ONLY, default="StableAttentionCallback", annotation="str"))

    @classmethod
    def from_config(cls, config: MonitorConfig, *, name: str = "StableAttentionCallback") -> MonitorEngine:
        """The engine of ``config`` (already checked); ``name`` starts every log line."""
        return cls(config, name=name)

    @property
    def layers(self) -> LayerStats | None:
        """The watched attention layers and their recent statistics (None before :meth:`setup`)."""
        return self._watch.layers

    @property
    def surge_detectors(self) -> dict[str, SurgeDetector]:
        """Early-warning detectors by metric name (``stable_attn/saturation/layer0``, ...)."""
        return self._watch.surge_detectors

    @property
    def not_training_streak(self) -> int:
        """Optimizer steps in a row without an applied update (or with a non-finite loss)."""
        return self._streak.streak

    @property
    def dispatcher(self) -> Any:
        """The alert channels while the run is open on rank zero (the desk's), else None."""
        return self.desk.dispatcher

    # ------------------------------------------------------------------ setup
    def setup(self, root: torch.nn.Module, world: World, stage: str = "fit") -> None:
        """Swap the transformers models under ``root`` and attach layer statistics (new models only),
        and patch ``F.scaled_dot_product_attention`` once if ``patch_sdpa``; ``stage`` names the run."""
        self.world = world
        self._run.rank, self._run.size = world.rank, world.size
        self._run.all_gather = world.gather_host if world.size > 1 else None
        self._root = root
        self.desk.evidence.watch(root)
        self._swap_models(root)
        if self._qk is not None:  # every setup: sharding since the last one (configure_model) replaces q/k weights
            self._qk.setup(self._qk_modules)  # raises on a layout it cannot edit, naming the module class
        if self.config.patch_sdpa and self.sdpa_patch is None:
            from ..integrations.sdpa import patch_sdpa

            self.sdpa_patch = patch_sdpa()
            if world.is_zero:
                log.warning("%s: torch.nn.functional.scaled_dot_product_attention now runs stable_attn (backend %s) "
                            "until the end of %s", self.name, world.backend, stage)

    def _swap_models(self, root: torch.nn.Module) -> None:
        # imported here: the engine imports no transformers until a run sets up
        from ..integrations.transformers.swap import SwitchWatch, prepare_models

        if self._switch_watch is None:
            self._switch_watch = SwitchWatch()

        prepared = prepare_models(root, swap=self.config.swap, stats=self.config.attention_stats,
                                  prepared=self._swapped.values())
        if not prepared.models:
            if not self._swapped and not self.config.patch_sdpa:
                log.warning("%s: no transformers PreTrainedModel found in %s; attention is not swapped and no layer "
                            "statistics are logged", self.name, type(root).__name__)
            return
        from ..integrations.transformers.checkpointing import prepare_checkpointed_training

        self._checkpointing_undo.append(
            prepare_checkpointed_training(prepared.models.values(), self.name, self.world.is_zero))
        self._swapped.update((id(model), model) for model in prepared.models.values())
        self._watch.add(prepared.stats)
        self._qk_modules.update(prepared.modules)  # QK-Clip's layers: setup reads their layouts
        self._switch_watch.add(prepared.models)
        if self.world.is_zero:
            found = ", ".join(type(m).__name__ for m in prepared.models.values())
            what = "switched %d transformers model(s) [%s] to 'stable_attn'" if self.config.swap else \
                "monitoring %d transformers model(s) [%s] (attention not switched)"
            log.warning("%s: " + what + ": %d attention layer(s) (%s), backend %s",
                        self.name, len(prepared.models), found, prepared.attention_layers, prepared.implementations(),
                        self.world.backend)

    def start(self, log_dir: str, log_every_n_steps: int, stop_path: Callable[[int], str] | None = None) -> None:
        """The run starts: alert channels open on rank zero, writing the JSONL file in ``log_dir``.

        ``log_every_n_steps`` applies when the constructor's is None (0: no step is monitored);
        ``stop_path(step)`` names the checkpoint a stop writes (default
        ``<log_dir>/stable_attn-stop-step=<step>.ckpt``)."""
        check_coverage(self.config, type(self._root).__name__, models=len(self._swapped),
                       layers=len(self.layers.stats) if self.layers is not None else 0, qk_layers=len(self._qk_modules))
        self.log_dir = self._run.log_dir = log_dir
        self._every = self.config.log_every_n_steps or log_every_n_steps
        self._run.stop_path = stop_path
        self._step = -1
        if self.world.is_zero:
            checked = self.config.checked()
            self.desk.open(log_dir or ".", self.config.alerts_file, checked["on_alert"], self.config.webhook_url,
                           checked["webhook_timeout"], checked["webhook_headers"])

    def train_start(self, state: Trainables) -> None:
        """Training begins with ``state`` (any checkpoint restored): the action's first snapshot."""
        self.action.start(state, self._judge)

    # ------------------------------------------------------------- end of run
    def end_run(self, when: str) -> None:
        """Close the alert channels (within one webhook timeout in all), say what they did not deliver,
        put back ``F.scaled_dot_product_attention`` and switch statistics off. Idempotent."""
        if self._device is not None and self._device.updates.armed:
            self._device.updates.select()  # a run ending inside a gated step: its optimizer step will not come now
        self.settle()
        self.desk.defer = False
        self.desk.flush(self._facts())  # a step that raised after its spike was judged: without its statistics
        self.desk.close(self.config.checked()["webhook_timeout"], when)
        patch, self.sdpa_patch = self.sdpa_patch, None
        if patch is not None:
            try:
                patch.restore()
            except RuntimeError as exc:  # another patch_sdpa was installed on top of ours during the run
                log.warning("%s: torch.nn.functional.scaled_dot_product_attention not restored %s: %s",
                            self.name, when, exc)
        self._watch.enable(False)
        for undo in self._checkpointing_undo:
            undo.restore()
        self._checkpointing_undo = []
        if self.recovery is not None:
            for scale in self.recovery.lr:
                scale.unwrap()
            self.recovery.ring.clear()  # its files, if on disk: a resumed run starts the ring afresh

    def log_summary(self) -> None:
        """The :meth:`summary` line at WARNING, on rank zero."""
        self.settle()
        if self.world.is_zero:
            log.warning("%s: %s", self.name, self.summary())

    def summary(self) -> str:
        """One line: the alerts of the run by kind, the updates skipped, rollbacks and the stop checkpoint."""
        kinds = ", ".join(f"{kind} {n}" for kind, n in self.alert_kinds.items())
        line = f"{self.alert_count} alert(s) ({kinds}); {len(self.skipped_steps)} update(s) skipped"
        if self.skipped_steps:
            shown = ", ".join(map(str, self.skipped_steps[:5])) + (", ..." if len(self.skipped_steps) > 5 else "")
            line += f" (steps {shown})"
        line += f", {len(self.rollbacks)} rollback(s)"
        if self.recovery is not None:
            line += (f", {self.recovery.used} recovery(ies) of {self.recovery.max_recoveries} "
                     f"({self.recovery.skipped_batches} batch(es) skipped)")
        if self.unconfirmed_grad_norm_jumps:
            line += (f"; {self.unconfirmed_grad_norm_jumps} gradient-norm jump(s) the loss did not confirm "
                     "(not alerted)")
        if self.stop_checkpoint is not None:
            line += f"; stopped, checkpoint {self.stop_checkpoint}"
        if self.config.alerts_file is not None and self.alert_count and self.log_dir is not None:
            line += f"; alerts in {os.path.join(self.log_dir, self.config.alerts_file)}"
        return line

    # ------------------------------------------------------------ each step
    def begin_step(self, step: int, monitor: bool | None = None) -> bool:
        """A micro-batch of optimizer step ``step`` starts; True when the step is monitored (layer
        statistics on). Later micro-batches of the same step change nothing.

        ``step`` is the number alerts and metrics carry: Lightning's ``global_step`` before the update
        (monitored when ``(step + 1) % log_every_n_steps == 0``); a loop that numbers a step by the count
        after it passes ``monitor`` to say itself whether the step is monitored."""
        if step == self._step:
            return self._monitor_now
        self._step = step
        self._loss = None
        self._acted = self._stopping = False
        self._resolved = None
        self._taken = "warn"
        self.step_batches = []
        self._diagnosis = None
        self._alerts_at_start = self.alert_count
        self._monitor_now = monitor if monitor is not None else self._every > 0 and (step + 1) % self._every == 0
        self._watch.enable(self._monitor_now)
        if self._monitor_now and self._switch_watch is not None and self.world.is_zero:
            self._switch_watch.warn(self.name)  # a model switched away from stable_attn since setup
        if self._qk is not None:  # QK-Clip reads the max logits of every step; the entropy only when monitored
            for s in (self.layers.stats if self.layers is not None else {}).values():
                s.enabled, s.with_entropy = True, self._monitor_now
        return self._monitor_now

    def add_batch(self, batch: Any, *, epoch: int | None, batch_index: int | None) -> None:
        """One micro-batch of the current step and where it sits in the data (its index in the epoch counts
        the batches the data loader yielded, skipped ones included): sets :attr:`data_position` and appends
        the batch to :attr:`step_batches`."""
        self.step_batches.append(batch)
        self._position, self._position_read = (batch, epoch, batch_index), None

    @property
    def data_position(self) -> dict[str, Any] | None:
        """Where the step's last micro-batch sits in the data: ``{"epoch", "batch_index", "fingerprint"}``, or None
        before the first :meth:`add_batch`. Computed when read (the fingerprint copies the token ids to the host)."""
        if self._position_read is None and self._position is not None:
            self._position_read = _data_position(*self._position)
        return self._position_read

    @data_position.setter
    def data_position(self, value: dict[str, Any] | None) -> None:
        self._position, self._position_read = None, value

    def skips(self, epoch: int, batch_index: int) -> bool:
        """``on_spike="recover"``: the batch at ``batch_index`` of ``epoch`` is in the skip window (the adapters'
        data streams ask before the training loop sees it; a True counts it as skipped)."""
        return self.recovery is not None and self.recovery.skips(epoch, batch_index)

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss, divided by the accumulation steps (the sum is the step's mean loss)."""
        loss = loss.detach().float()
        self._loss = loss if self._loss is None else self._loss + loss

    def before_optimizer_step(self, optimizer: Any, parameters: Iterable[torch.nn.Parameter], *,
                              loss: torch.Tensor | float | None = None, scaler: bool = False,
                              lr: float | None = None) -> Decision:
        """Judge the step from every rank's values and drop its update if it must be (see the module).

        Call it on every rank with the gradients complete and unscaled, before ``optimizer.step()``.
        ``loss`` replaces what :meth:`add_loss` summed; ``scaler``: an fp16 GradScaler is active (its
        inf gradients are not alerts); ``lr`` defaults to the first param group's."""
        if self._step < 0:
            raise RuntimeError(f"{self.name}: before_optimizer_step was called before begin_step; call "
                               "begin_step(step) when each optimizer step's first micro-batch starts")
        self.settle()  # device_skip: the previous step's values, copied to the host a step ago, judged now
        if loss is not None:
            self._loss = torch.as_tensor(loss).detach().float().reshape(())
        params = list(parameters)
        step, device = self._step, self.world.device
        grad_norm = None
        if self.config.monitor_grad_norm:
            grad_norm = (self.world.grad_norm or total_grad_norm)(params)
        # The norm is non-finite exactly when a gradient is (or its sum of squares overflows): no second
        # pass then; without it, a max-abs pass over the local gradients.
        bad_grads = (~torch.isfinite(grad_norm)).float() if grad_norm is not None else nonfinite_grads(params)
        mine = RankReading.to_tensor(self._loss, grad_norm, bad_grads, device)
        # Every rank shares its raw values (one collective per step, issued whatever the values are) and
        # every rank runs the same detectors over all of them, so all ranks reach the same verdict.
        table = self.world.all_gather(mine) if self.world.size > 1 else mine
        if lr is None:
            lr = float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else math.nan
        self._stepped = True
        if self._device is not None:  # device_skip: the factor on the device, the values read at the next step
            return self._device.gate(step, optimizer, params, table, has_norm=grad_norm is not None, scaler=scaler,
                                     lr=lr, act=self.config.on_spike == "skip" and not self._cap.exhausted,
                                     stop=self._stopping, world=self.world, position=self._position)
        verdict = self._conclude(step, RankReading.from_table(table), has_norm=grad_norm is not None, scaler=scaler,
                                 lr=lr, optimizer=optimizer, params=params)
        if verdict.drop:
            optimizer.zero_grad(set_to_none=True)  # no gradients, no update: torch optimizers skip them
        return Decision(step=step, drop=verdict.drop, action=verdict.action, rollback=verdict.rollback,
                        stop=self._stopping)

    def _conclude(self, step: int, rows: list[RankReading], *, has_norm: bool, scaler: bool, lr: float,
                  optimizer: Any, params: list[torch.nn.Parameter], dropped: bool | None = None,
                  position: Any = None) -> Verdict:
        """Judge one step's gathered rows: detectors, alerts, the dropped update's count, the not-training streak.
        ``dropped``: what the device did with the step's update (``device_skip``, read a step late: its alerts go
        out now, with the step's ``position``); None: the host path, whose alerts wait for ``end_step``."""
        judged = self._judge.judge(step, rows, has_norm=has_norm, scaler=scaler, lr=lr)
        verdict = judged.verdict
        self._taken = verdict.action
        self.desk.evidence.record(step, rows, judged, optimizer, params)
        self.last = judged.last
        self._run.lr = self.last.get(names.LR)
        self.unconfirmed_grad_norm_jumps += judged.unconfirmed
        self._spiked = judged.spiked
        watched = [self.loss_detector] + ([self.grad_norm_detector] if self.config.monitor_grad_norm else [])
        for line in self._phases.update(step, watched):
            if self.world.is_zero:
                log.warning("%s: %s", self.name, line)
        if self.config.diagnose_spikes and judged.spikes:
            event = judged.spikes[0][0]
            self._diagnosis = diagnose(self._root, self.step_batches, step=step, metric_name=event.metric,
                                       threshold=event.threshold, world_size=self.world.size,
                                       is_zero=self.world.is_zero, log_dir=self.log_dir, bundles=self.replay_bundles,
                                       name=self.name)
        stop_path = self._run.stop_checkpoint(step) if verdict.stop else None
        # The step's alerts wait for end_step: its attention statistics, and what its action did (a recovery may
        # fall back to an older snapshot or stop), which their outcome tells. A step read late has ended.
        self.desk.defer = dropped is None
        here = self._position, self._position_read, self._resolved
        if dropped is not None:
            self._position, self._position_read = position, None
            self._resolved = {"taken": verdict.action, "rolled_back_to": None, "skipping_batches": None,
                              "stopped": False, "checkpoint": None}
        for event, message in judged.spikes:
            self._emit(Alert.from_event(event, lr=self.last.get(names.LR), layers=self._watch.most_changed(),
                                        action=verdict.action, message=message.lstrip("; "), checkpoint=stop_path,
                                        diagnosis=self._diagnosis if event.step == step and event.kind == "spike"
                                        else None))
        for alert in judged.alerts:
            self._emit(alert)
        if verdict.drop if dropped is None else dropped:
            self._acted = True
            if verdict.skip or dropped:
                self.skipped_steps.append(step)
            self._stopping = verdict.stop
        escalate = self._streak.update(verdict.not_training)
        if escalate is not None:
            self._stopping = self._stopping or self._streak.stops
            self._emit(self._streak.alert(step, escalate, self.last.get(names.LR), self._run.stop_checkpoint(step)))
        if dropped is not None:
            self._position, self._position_read, self._resolved = here
        return verdict

    def settle(self) -> None:
        """``device_skip=True``: read the last gated step's values now and judge them (its alerts, ``skipped_steps``,
        the optimizer's host-side state of a dropped step put back). Done by itself at the next step, at monitored
        steps, at :meth:`state_dict`, :meth:`log_summary` and :meth:`end_run`; call it before saving the optimizer's
        state elsewhere. Nothing to do on the host path."""
        if self._device is not None:
            self._device.settle(self._conclude)

    def end_step(self, state: Trainables) -> StepEnd:
        """After the optimizer and LR-scheduler step (``state.step`` counts it): layer statistics and early
        warnings on monitored steps, QK-Clip, the action's restore or snapshot, a stop the step decided.

        Call it on every rank. Between the micro-batches of one optimizer step it does nothing."""
        step = self._step
        if not self._stepped:
            return StepEnd(step=step)  # accumulating gradients: the optimizer step has not happened yet
        self._stepped = False
        if self._device is not None:
            self._device.updates.select()  # a dropped step's bits back, on the device
            if self._monitor_now:
                self.settle()  # its statistics are read now anyway: the step's values too, for its metrics
        metrics, clipped = None, {}
        if self._qk is not None:
            clipped, alert = self._qk.after_step(step, self.layers.stats if self.layers is not None else {},
                                                 self.world, self._monitor_now, self._acted, self.last.get(names.LR))
            if alert is not None:
                self._emit(alert)
        if self._monitor_now:
            hidden = () if self.config.monitor_grad_norm else (names.GRAD_NORM,)
            metrics = {k: v for k, v in self.last.items() if k not in hidden}
            gather = self.world.all_gather if self.world.size > 1 else None
            # A spiking step's attention statistics are its batch's: logged, not judged by the early warnings.
            layer_metrics, events = self._watch.observe(step, gather, self.world.device, self.last.get(names.LOSS),
                                                        judge=not self._spiked)
            metrics.update(layer_metrics)
            for event in events:
                self._emit(Alert.from_event(event, lr=self.last.get(names.LR), layers=self._watch.most_changed(),
                                            action="warn", message=""))
            metrics[names.ALERT_COUNT] = float(self.alert_count)
        if clipped:
            metrics = {**(metrics or {}), **clipped}
        self._run.skip_lag = self.skip_lag
        done = self.action.after_step(step, state, self._acted)
        if done.rolled_back_to is not None:
            self.rollbacks.append((step, done.rolled_back_to))
        stopping = self._stopping or done.stop
        stop = self._run.stop_checkpoint(step) if stopping else None
        self._resolved = {"taken": "stop" if stopping else self._taken, "rolled_back_to": done.rolled_back_to,
                          "skipping_batches": list(done.skipping) if done.skipping is not None else None,
                          "stopped": stopping, "checkpoint": stop}
        self.desk.defer = False
        self.desk.flush(self._facts())
        for alert in done.alerts:
            self._emit(alert)
        self._stopping = False
        if stop is not None:
            self.stop_checkpoint = stop
            if self.world.is_zero:
                log.warning("%s: stopped training at step %d; checkpoint %s", self.name, step, stop)
        self._watch.enable(False)
        return StepEnd(step=step, metrics=metrics, stop_checkpoint=stop, rolled_back=done.rolled_back_to is not None,
                       alert_count_changed=self.alert_count != self._alerts_at_start)

    def _facts(self) -> StepFacts:
        """What the alerts' evidence needs to know of the step now (read only when rank zero delivers)."""
        return StepFacts(data_position=self.data_position if self.desk.is_open else None, world_size=self.world.size,
                         layers=self.layers, restores_to=self.action.restores_to, stopping=self._stopping,
                         resolved=self._resolved)

    def _emit(self, alert: Alert) -> None:
        """Count the alert on every rank (the count is shown and logged); rank zero's desk delivers it."""
        self.alert_count += 1
        self.alert_kinds[alert.kind] = self.alert_kinds.get(alert.kind, 0) + 1
        if self.desk.is_open:
            self.desk.deliver(alert, self._facts())

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """Plain Python (JSON-serialisable, NaN and inf aside) except the rollback snapshot's tensors,
        which are there only in a single-process run with ``on_spike="rollback"``."""
        self.settle()
        ranks, watch = self._judge.ranks, self._watch.state_dict()
        return {
            "loss_detector": self.loss_detector.state_dict(),
            "other_rank_loss_detectors": ranks[names.LOSS].other_states(),
            "grad_norm_detector": self.grad_norm_detector.state_dict(),
            "other_rank_grad_norm_detectors": ranks[names.GRAD_NORM].other_states(),
            "alert_kinds": dict(self.alert_kinds),
            "not_training_streak": self.not_training_streak,
            "spike_actions": self._cap.state_dict(),
            "surge": watch["surge"],
            "alert_count": self.alert_count,
            "skipped_steps": list(self.skipped_steps),
            "rollbacks": [list(r) for r in self.rollbacks],
            "unconfirmed_grad_norm_jumps": self.unconfirmed_grad_norm_jumps,
            "stop_checkpoint": self.stop_checkpoint,
            "layers": watch["layers"],
            "alert_delivery": self.desk.delivery(),
            **({"qk_clip": self._qk.state_dict()} if self._qk is not None else {}),
            **self.action.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any], where: str = "monitor state") -> None:
        """Restore :meth:`state_dict`'s output (a resume). Every field is checked first
        (:func:`~stable_attn.monitor.resume_checks.check_resumed_state`: a ValueError names the field, its
        value and what is accepted, and nothing is loaded); the rollback snapshot in it is checked against
        the run's own state at :meth:`train_start`. ``where`` names the state in those errors."""
        check_resumed_state(self, state_dict, where)
        self.action.load_state_dict(state_dict)  # checks its own fields (ValueError) before the rest is loaded
        self.desk.load(state_dict.get("alert_delivery", {}))
        self.loss_detector.load_state_dict(state_dict["loss_detector"])
        self.grad_norm_detector.load_state_dict(state_dict["grad_norm_detector"])
        ranks = self._judge.ranks
        ranks[names.LOSS].load_other_states(state_dict.get("other_rank_loss_detectors", []))
        ranks[names.GRAD_NORM].load_other_states(state_dict.get("other_rank_grad_norm_detectors", []))
        self.alert_count = int(state_dict.get("alert_count", 0))
        self.alert_kinds = dict.fromkeys(names.ALERT_KINDS, 0) | dict(state_dict.get("alert_kinds", {}))
        self._streak.streak = int(state_dict.get("not_training_streak", 0))
        self._cap.load_state_dict(state_dict.get("spike_actions", {}))
        self.skipped_steps = list(state_dict.get("skipped_steps", []))
        self.rollbacks = [tuple(r) for r in state_dict.get("rollbacks", [])]
        self.unconfirmed_grad_norm_jumps = int(state_dict.get("unconfirmed_grad_norm_jumps", 0))
        self.stop_checkpoint = state_dict.get("stop_checkpoint")
        self._watch.load_state_dict(state_dict)  # applied to layers found later too
        if self._qk is not None:
            self._qk.load_state_dict(state_dict.get("qk_clip", {}))


MonitorConfig.document(MonitorEngine, log_every="the ``log_every_n_steps`` given to :meth:`MonitorEngine.start`",
                       log_dir="the ``log_dir`` given to :meth:`MonitorEngine.start`")
