"""One optimizer step judged from every rank's values: which detectors fired, what is done, what to say.

The engine gathers, per rank, a :class:`RankReading`: the step's loss, gradient norm, whether the rank had a
loss (a skipped backward has none) and whether any of its gradients is NaN or inf. Every rank runs every rank's
detectors over that same table (each rank's values have their own level and noise, so each rank has
its own copy of each detector), so every rank reaches the same verdict without a second collective.

The rules, in one place:

- a spike (loss or gradient norm, on any rank) drops the update unless ``on_spike="warn"``;
- a gradient-norm jump (rules ``gross`` and ``jump``) is a spike only when the loss confirms it: the loss
  is flagged at the same step (any rank), or the rank's loss undoes at least ``GRAD_NORM_CONFIRM_SHARE``
  (half) of the run's progress (:meth:`SpikeDetector.progress_share`). Alone it is counted
  (``Judgement.unconfirmed``, the engine's summary), not alerted or acted on: healthy small-batch runs
  jump 4-30x in one step with an ordinary loss, while every corrupted batch measured raised the loss
  (``benchmarks/healthy_traces.py``, docs/DETECTORS.md). A gradient-norm drift, and a NaN or inf, need no
  confirmation;
- a NaN or inf loss or gradient, on any rank, drops the update whatever ``on_spike`` says (with
  ``"warn"`` the step is skipped); under an fp16 GradScaler inf gradients are the scaler's business;
- ``"rollback"``, ``"stop"`` and ``"recover"`` lose progress, so they wait for a spike that lasts: a loss or
  gradient-norm spike is acted on once ``spike_confirm_steps`` (3) steps in a row have spiked; its earlier
  steps have their update dropped as under ``"skip"``, so the weights a rollback or stop then keeps are the
  same as at once. A drift, and a NaN or inf, act at once. Why: a healthy run's single hard batch (10-22
  sigmas on the real runs of ``benchmarks/healthy_traces.py``) stopped 7 of 18 healthy runs, while a run
  that is lost spikes on step after step;
- the spike action has a cap: after ``spike_action_cap`` updates dropped for spikes in one streak
  (a streak ends after ``spike_action_cooldown`` steps in a row without a spike), one alert says
  the detector may be miscalibrated for this run, and further spikes of the streak are alerted
  only (action ``"warn"``; a non-finite update is still never applied);
- a step counts towards the not-training streak when its update was dropped or its loss is
  non-finite; the streak raises one alert at ``not_training_after`` and stops the run at
  ``not_training_stop_after``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from . import names
from .actions.base import Action, Verdict
from .alerts.alert import Alert
from .config import CONFIRMED_ACTIONS
from .detectors.events import SpikeEvent
from .detectors.spikes import SpikeDetector

if TYPE_CHECKING:
    import torch

__all__ = ["GRAD_NORM_CONFIRM_SHARE", "SPIKE_ACTIONS", "ActionCap", "Judgement", "NotTrainingStreak",
           "PhaseNotes", "RankDetectors", "RankReading", "StepJudge", "confirms_itself"]

#: The share of the run's progress a rank's loss must undo to confirm a gradient-norm jump on its own.
GRAD_NORM_CONFIRM_SHARE = 0.5
#: The metric of the alert that says the spike-action cap was reached.
SPIKE_ACTIONS = "stable_attn/spike_actions"


@dataclass(frozen=True)
class RankReading:
    """One rank's values of one step, as every rank gathers them: the one place that knows the gathered row's
    columns and their order (``to_tensor`` writes them, ``from_row`` reads them)."""

    loss: float  # the step's loss on this rank (NaN without one)
    grad_norm: float  # the global gradient norm (NaN when it is not computed)
    has_loss: bool = True  # the rank ran a backward with a loss this step
    bad_grads: bool = False  # a gradient on this rank is NaN or inf

    WIDTH: ClassVar[int]

    @staticmethod
    def to_tensor(loss: torch.Tensor | None, grad_norm: torch.Tensor | None, bad_grads: torch.Tensor | None,
                  device: torch.device) -> torch.Tensor:
        """This rank's row on ``device`` (float64, no host copy): what the all-gather shares."""
        import torch  # the judge itself runs on host floats, without torch

        nan = torch.full((), math.nan, device=device)
        return torch.stack([
            loss.to(device) if loss is not None else nan,
            grad_norm.float().to(device) if grad_norm is not None else nan,
            torch.full((), float(loss is not None), device=device),
            bad_grads.to(device) if bad_grads is not None else torch.zeros((), device=device),
        ]).double()

    @classmethod
    def from_row(cls, row: Sequence[float]) -> RankReading:
        """The reading of one gathered row (host floats, in :meth:`to_tensor`'s order)."""
        loss, grad_norm, has_loss, bad_grads = row
        return cls(float(loss), float(grad_norm), bool(has_loss), bool(bad_grads))

    @classmethod
    def from_table(cls, table: torch.Tensor) -> list[RankReading]:
        """Every rank's reading from the gathered tensor (stacked or concatenated rows), in rank order."""
        return [cls.from_row(row) for row in table.reshape(-1, cls.WIDTH).cpu().tolist()]


RankReading.WIDTH = len(fields(RankReading))


@dataclass
class Judgement:
    verdict: Verdict
    last: dict[str, float]  # names.LOSS / GRAD_NORM / LR of the step, for logging and alerts
    spikes: list[tuple[SpikeEvent, str]] = field(default_factory=list)  # new events and their alert message
    alerts: list[Alert] = field(default_factory=list)  # alerts with no detector event (non-finite gradients)
    unconfirmed: int = 0  # gradient-norm jumps the loss did not confirm (ranks), neither alerted nor acted on
    spiked: bool = False  # a loss or (confirmed) gradient-norm spike, or a NaN/inf, on any rank
    # For the alerts' evidence (monitor/alerts/evidence.py), by metric (names.LOSS, names.GRAD_NORM) and rank: each
    # detector's forecast before the step's value, and the events the detectors returned (confirmed or not).
    baselines: dict[str, dict[int, float | None]] = field(default_factory=dict)
    events: dict[str, dict[int, SpikeEvent]] = field(default_factory=dict)


def confirms_itself(event: SpikeEvent) -> bool:
    """A gradient-norm event that is a spike without the loss's confirmation: a NaN or inf, or a drift."""
    return event.kind == "nonfinite" or event.rule == "drift"


def worst(values: list[float]) -> float:
    """The value to log for several ranks' gradient norms: a non-finite one if any, else the largest."""
    if not values:
        return math.nan
    return next((v for v in values if not math.isfinite(v)), max(values))


def where(ranks: list[int], world: int) -> str:
    """Which ranks saw it, for an alert message (nothing in a single-process run)."""
    if world == 1 or not ranks:
        return ""
    if len(ranks) == world:
        return f"on all {world} ranks"
    return f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world}"


def phase(detector: SpikeDetector) -> str:
    """Which rule judges the detector's next value: "starting" (NaN/inf only), "gross" or "calibrated"."""
    current = getattr(detector, "phase", None)  # older detectors only know whether they are calibrated
    return current if current is not None else ("calibrated" if detector.ready else "starting")


class RankDetectors:
    """The detectors of one metric for ranks 0..world-1: rank zero's is the one given, the others are
    copies of it made as ranks report (with the state a checkpoint saved for them, if any)."""

    def __init__(self, detector: SpikeDetector) -> None:
        self.detectors = [detector]
        self._pending: dict[int, dict[str, Any]] = {}

    def __getitem__(self, rank: int) -> SpikeDetector:
        while len(self.detectors) <= rank:
            copied = copy.deepcopy(self.detectors[0])
            pending = self._pending.get(len(self.detectors))
            if pending is not None:
                copied.load_state_dict(pending)
            self.detectors.append(copied)
        return self.detectors[rank]

    def other_states(self) -> list[dict[str, Any]]:
        """States of ranks 1..; every rank runs every rank's detector, so rank zero's copies are everyone's.
        Ranks not seen since a resume keep the state loaded for them (a checkpoint before the first step)."""
        states = [d.state_dict() for d in self.detectors[1:]]
        rank = len(self.detectors)
        while rank in self._pending:
            states.append(self._pending[rank])
            rank += 1
        return states

    def load_other_states(self, states: list[dict[str, Any]]) -> None:
        self._pending = dict(enumerate(states, start=1))
        del self.detectors[1:]  # rebuilt from the saved states as ranks report


class ActionCap:
    """At most ``cap`` updates dropped for spikes in one streak; a streak ends after ``cooldown`` steps in
    a row without a spike. A guard that drops update after update of a healthy run (a detector whose
    noise estimate is wrong for it) does more harm than none: at the cap it says so once and stops acting.
    It also counts the steps in a row that spiked (``lasted``), which ``spike_confirm_steps`` waits for."""

    def __init__(self, cap: int | None, cooldown: int) -> None:
        self.cap, self.cooldown = cap, cooldown
        self.count = 0  # updates dropped for spikes in the current streak
        self.quiet = 0  # steps in a row without a spike
        self.lasted = 0  # steps in a row with a spike, up to the last one (what spike_confirm_steps counts)

    @property
    def exhausted(self) -> bool:
        """The cap is reached: spikes are alerted, not acted on, until the streak ends."""
        return self.cap is not None and self.count >= self.cap

    def update(self, spiked: bool, acted: bool) -> bool:
        """One step; True when this step's action reached the cap (the one alert is due)."""
        if not spiked:
            self.quiet += 1
            self.lasted = 0
            if self.quiet >= self.cooldown:
                self.count = 0
            return False
        self.quiet = 0
        self.lasted += 1
        if not acted:
            return False
        self.count += 1
        return self.cap is not None and self.count == self.cap

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count, "quiet": self.quiet, "lasted": self.lasted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values = {}
        for key in ("count", "quiet", "lasted"):  # a state without "lasted" starts it at 0
            value = state.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"spike_actions.{key}={value!r} in the saved monitor state is not supported; "
                                 "expected an integer >= 0 (the state a MonitorEngine saved)")
            values[key] = value
        self.count, self.quiet, self.lasted = values["count"], values["quiet"], values["lasted"]

    def alert(self, step: int, action: str, lr: float) -> Alert:
        return Alert(
            step=step, kind="spike", metric=SPIKE_ACTIONS, value=self.count, threshold=self.cap, lr=lr, action=action,
            message=f"{self.count} updates were dropped for spikes (on_spike={action!r}) with fewer than "
                    f"{self.cooldown} spike-free steps between them: the spike detector may be miscalibrated for "
                    f"this run (a noise it has not learnt), so later spikes are alerted only, not acted on, until "
                    f"{self.cooldown} steps in a row pass without a spike; check the loss curve, and raise "
                    "spike_action_cap or set on_spike='warn' if these are false alarms")


class StepJudge:
    """Runs every rank's loss and gradient-norm detectors over one step's gathered rows and decides."""

    def __init__(self, on_spike: str, loss: SpikeDetector, grad_norm: SpikeDetector,
                 cap: ActionCap | None = None, confirm: int = 1, action: Action | None = None) -> None:
        self.on_spike = on_spike
        # decides a step whose update is dropped as on_spike, and words the alerts' note
        self.action = action if action is not None else Action(word=on_spike)
        self.cap = cap if cap is not None else ActionCap(None, 1)
        self.confirm = confirm  # spike_confirm_steps
        self.ranks = {names.LOSS: RankDetectors(loss), names.GRAD_NORM: RankDetectors(grad_norm)}
        self._grads_were_bad = False
        self._unconfirmed_ranks: set[int] = set()  # ranks whose last gradient-norm event went unconfirmed
        self._was_unconfirmed: set[int] = set()  # the same, as of the step before

    def detector_states(self) -> dict[str, list[dict[str, Any]]]:
        """Every rank's loss and gradient-norm detector states, by metric (what a rollback snapshot keeps)."""
        return {metric: [d.state_dict() for d in ranks.detectors] for metric, ranks in self.ranks.items()}

    def load_detector_states(self, states: dict[str, list[dict[str, Any]]]) -> None:
        """Put back :meth:`detector_states`' output (a rollback): ranks it holds no state for start afresh
        from rank zero's."""
        for metric, ranks in self.ranks.items():
            saved = states.get(metric, [])
            if saved:
                ranks.detectors[0].load_state_dict(saved[0])
                ranks.load_other_states(saved[1:])

    def judge(self, step: int, rows: Sequence[RankReading], *, has_norm: bool, scaler: bool, lr: float) -> Judgement:
        """``rows[rank]``: that rank's reading. A step dropped as ``on_spike`` is decided by the action
        (``action.decide``), which also words what the alerts add after their message (``action.note``)."""
        world = len(rows)
        losses = [r.loss for r in rows if r.has_loss]
        norms = [r.grad_norm for r in rows] if has_norm else []
        last = {
            names.LOSS: sum(losses) / len(losses) if losses else math.nan,  # a NaN on any rank shows
            names.GRAD_NORM: worst(norms),
            names.LR: lr,
        }
        loss_det, norm_det = self.ranks[names.LOSS], self.ranks[names.GRAD_NORM]
        # Measured before the loss enters its detector: against the baseline the value is judged by.
        shares = {rank: loss_det[rank].progress_share(r.loss) for rank, r in enumerate(rows)
                  if r.has_loss and math.isfinite(r.loss)}
        baselines = {names.LOSS: {rank: getattr(loss_det[rank], "baseline", None)
                                  for rank, r in enumerate(rows) if r.has_loss}}
        if has_norm:
            baselines[names.GRAD_NORM] = {rank: getattr(norm_det[rank], "baseline", None) for rank in range(world)}
        # The learning rate lets each detector see a schedule restart (SpikeDetector.lr_restart_ratio).
        loss_events = [(rank, loss_det[rank].update(step, r.loss, lr=lr)) for rank, r in enumerate(rows)
                       if r.has_loss]
        norm_events = []
        # A GradScaler (fp16 AMP) meets inf gradients by design and skips those steps itself.
        if has_norm:
            norm_events = [(rank, norm_det[rank].update(step, r.grad_norm, lr=lr)) for rank, r in enumerate(rows)
                           if not (scaler and not math.isfinite(r.grad_norm))]
        loss_events = [(rank, e) for rank, e in loss_events if e is not None]
        norm_events = [(rank, e) for rank, e in norm_events if e is not None]
        flagged = {names.LOSS: dict(loss_events), names.GRAD_NORM: dict(norm_events)}  # before confirmation
        norm_events, unconfirmed = self._confirmed(norm_events, bool(loss_events), shares)
        bad_grad_ranks = [] if scaler else [rank for rank, r in enumerate(rows) if r.bad_grads]
        nonfinite_loss = any(r.has_loss and not math.isfinite(r.loss) for r in rows)
        nonfinite = nonfinite_loss or bool(bad_grad_ranks)
        spiked = bool(loss_events or norm_events)
        capped = spiked and self.on_spike != "warn" and self.cap.exhausted
        # At the cap the spikes of the streak are alerted only: as under "warn" (a NaN is still dropped).
        warn_only = self.on_spike == "warn" or capped
        drop = nonfinite or (spiked and not warn_only)
        # A rollback, stop or recovery waits for a spike that lasts (see the module); until then, a skip.
        lasting = (nonfinite or self.cap.lasted + 1 >= self.confirm
                   or any(e.rule == "drift" for _, e in loss_events + norm_events))
        waits = drop and not warn_only and self.on_spike in CONFIRMED_ACTIONS and not lasting
        escalate = self.cap.update(spiked, acted=spiked and not warn_only)
        dropped_as = "skip" if warn_only or waits else self.on_spike  # what a dropped update means
        if drop and dropped_as in ("rollback", "recover"):
            self.cap.lasted = 0  # the weights are put back: a spike after it is a new one
        if drop and dropped_as == self.on_spike:
            verdict = self.action.decide(step)
        else:
            verdict = Verdict(action=dropped_as if drop or not warn_only else "warn",
                              skip=drop and dropped_as == "skip", not_training=drop or nonfinite_loss)
        action = verdict.action
        said = self.action.note(verdict)
        if nonfinite and warn_only:
            said += " (a non-finite update is never applied, whatever on_spike says)"
        if capped:
            said += f" (not acted on: on_spike={self.on_spike!r} has reached spike_action_cap={self.cap.cap})"
        if waits:
            said += (f" (on_spike={self.on_spike!r} acts when a spike lasts {self.confirm} steps in a row, "
                     f"spike_confirm_steps; {self.cap.lasted} so far)")
        out = Judgement(verdict, last, unconfirmed=unconfirmed, spiked=spiked or nonfinite, baselines=baselines,
                        events=flagged)
        if escalate:
            out.alerts.append(self.cap.alert(step, self.on_spike, lr))
        for events, resumed in ((loss_events, set()), (norm_events, self._was_unconfirmed)):
            new = [(rank, e) for rank, e in events if e.is_new or rank in resumed]
            if new:
                out.spikes.append((new[0][1], where([rank for rank, _ in events], world) + said))
        if bad_grad_ranks and not has_norm and not self._grads_were_bad:
            out.alerts.append(Alert(
                step=step, kind="nonfinite", metric=names.GRADIENTS, value=math.nan, lr=lr, action=action,
                message=("NaN or inf in the gradients " + where(bad_grad_ranks, world) + said).strip()))
        self._grads_were_bad = bool(bad_grad_ranks) and not has_norm
        out.alerts.extend(self.action.alerts(step, lr))
        return out

    def _confirmed(self, events: list[tuple[int, SpikeEvent]], loss_flagged: bool,
                   shares: dict[int, float | None]) -> tuple[list[tuple[int, SpikeEvent]], int]:
        """The gradient-norm events that count as spikes (see the module) and how many did not."""
        kept = []
        for rank, event in events:
            share = shares.get(rank)
            if (loss_flagged or confirms_itself(event)
                    or (share is not None and share >= GRAD_NORM_CONFIRM_SHARE)):
                kept.append((rank, event))
        # A confirmed event after unconfirmed ones of the same episode is the first one alerted.
        self._was_unconfirmed = set(self._unconfirmed_ranks)
        self._unconfirmed_ranks = {rank for rank, e in events if (rank, e) not in kept}
        return kept, len(events) - len(kept)


class NotTrainingStreak:
    """Optimizer steps in a row that did not train: one alert at ``after``, a stop at ``stop_after``."""

    def __init__(self, after: int, stop_after: int | None) -> None:
        self.after, self.stop_after = after, stop_after
        self.streak = 0

    def update(self, not_training: bool) -> str | None:
        """The action of the alert this step's streak calls for ("warn", or "stop" when :attr:`stops`), else None."""
        self.streak = self.streak + 1 if not_training else 0
        if self.stops:
            return "stop"
        return "warn" if self.streak == self.after else None

    @property
    def stops(self) -> bool:
        """The streak has just reached ``stop_after``: the run stops."""
        return self.streak == self.stop_after

    def alert(self, step: int, action: str, lr: float | None, stop_path: str) -> Alert:
        streak, stop = self.streak, self.stop_after
        then = "; stopping" if self.stops else (
            f"; the run stops after {stop} such steps" if stop is not None else "")
        return Alert(
            step=step, kind="not_training", metric=names.NOT_TRAINING, value=streak, threshold=self.after, lr=lr,
            action=action,
            message=f"the run is not training: {streak} optimizer steps in a row (steps {step - streak + 1}..{step}) "
                    f"had their update dropped or a non-finite loss{then}",
            checkpoint=stop_path if self.stops else None)


class PhaseNotes:
    """The lines that say when the rule judging a watched metric changes: NaN/inf only at first, then
    gross jumps, then the calibrated rule (see SpikeDetector); one line for metrics that change at once."""

    def __init__(self) -> None:
        self._phases: dict[str, str] = {}  # metric -> the phase last announced

    def update(self, step: int, watched: list[SpikeDetector]) -> list[str]:
        changed: dict[tuple[str, float | None, float | None], list[SpikeDetector]] = {}
        for detector in watched:
            now = phase(detector)
            if self._phases.get(detector.metric) != now:
                self._phases[detector.metric] = now
                key = (now, getattr(detector, "gross_ratio", None), getattr(detector, "gross_z", None))
                changed.setdefault(key, []).append(detector)
        following = step + 1  # the phase judges the values after the one that changed it
        lines = []
        for (now, ratio, _), detectors in changed.items():
            which = ", ".join(d.metric for d in detectors)
            if now == "gross":
                z = getattr(detectors[0], "gross_z", 0.0)
                noise = f" and {z:g} sigmas of its measured noise" if z else ""
                rule = f"a value above {ratio:g}x its recent median{noise}, or NaN/inf, alerts" if ratio else \
                    "NaN/inf alert"
                if which == names.GRAD_NORM and ratio:
                    rule += " when the loss confirms it (a loss spike, or a loss back half way to its start)"
                lines.append(f"spike detection active from step {following} on {which}: {rule}; the calibrated "
                             "rule takes over once it has learnt the run's noise")
            elif now == "calibrated":
                lines.append(f"calibrated spike detection active from step {following} on {which}")
        return lines
