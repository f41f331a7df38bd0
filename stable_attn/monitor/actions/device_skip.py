"""The skip decided on the device (``device_skip=True``): no host read of a step's values before its update.

The host path reads every step's loss and gradient norm before the optimizer step (one device-to-host copy,
so the host waits for the step's backward). Here the decision for step ``t`` is a 0/1 factor computed on the
device from the step's gathered values and bounds the host prepared from the detectors' states after step
``t - 1``; the host reads step ``t``'s values at step ``t + 1`` (a copy started at step ``t``, by then done)
and runs the same judge over them: detectors, alerts, ``skipped_steps``, the not-training streak. Nothing is
silent, it is one step late.

The bounds (:func:`detector_bounds`): for each rank's detector, the interval ``[lo, hi]`` of values it accepts
at step ``t`` (with step ``t``'s learning rate), and for a gradient norm ``cond``, above which a flag needs the
loss to confirm it (the judge's rule, :func:`~stable_attn.monitor.verdict.confirms_itself`); for the loss,
``share``, from which a loss undoes half the run's progress (the judge's other confirmation). Each is found by
asking a copy of the detector itself (``update`` on a clone), so every rule of the detector is the one rule; the
search runs over the ordered float64 values down to the neighbouring double, so a value on the device is judged
exactly as the host judges it, provided a detector flags an upper set of values (and, with
``direction="both"``, a lower one): the judge's verdict is compared with the device's factor when the host reads
the step, and a difference is logged at WARNING and counted (:attr:`DeviceSkip.mismatches`).

The gate (:class:`UpdateGate`): the optimizer always steps; a dropped step is undone bit for bit. Before the
step the gate copies the parameters that have gradients and their optimizer state; after it, on the device,
``torch.where(keep, new, old)`` puts back the old bits of a dropped step (whatever the optimizer did, NaN
gradients included). State that does not live on the parameter's device (a CPU ``step`` counter of a
non-fused, non-capturable torch Adam on CUDA, a Python number) and state the step created for a parameter that
had none are put back on the host when the step is read, before the next optimizer step. The cost: one copy of
the parameters and optimizer state in device memory, two passes over them per step. OLMo-core's
``SkipStepAdamW`` scales the update by the factor inside its own AdamW instead (no copy, one optimizer only):
with the factor 0 its moments still see a NaN gradient (``0 * NaN``), and ``lerp`` by 0 turns a moment's
``-0.0`` into ``+0.0``; the copy here leaves every bit as the host path's skip does, for any torch optimizer.
"""

from __future__ import annotations

import copy
import logging
import math
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..detectors.events import SpikeEvent
from ..detectors.spikes import NOISY_RELATIVE_NOISE, SpikeDetector
from ..grad_norm import local
from ..loop import Decision, World
from ..names import GRAD_NORM, LOSS
from ..verdict import GRAD_NORM_CONFIRM_SHARE, RankReading, confirms_itself
from .base import Verdict

__all__ = ["COLUMNS", "DeviceSkip", "UpdateGate", "detector_bounds", "keep_factor", "share_bound"]

log = logging.getLogger("stable_attn")

#: The bounds of one rank, in the order of the device's table.
COLUMNS = ("loss_lo", "loss_hi", "share", "grad_norm_lo", "grad_norm_hi", "grad_norm_cond")
_MAX = 1.7976931348623157e308  # the largest float64: a bound at it means "no finite value is flagged"
_SIGN = 1 << 63
_FLAT = (int, float, str, bool, type(None))


def _key(x: float) -> int:
    """The float's place among the float64 values (monotone: ``a < b`` exactly when ``_key(a) < _key(b)``)."""
    bits = struct.unpack("<q", struct.pack("<d", x))[0]
    return bits if bits >= 0 else -(bits & (_SIGN - 1))


def _float(key: int) -> float:
    bits = key if key >= 0 else (-key) | _SIGN
    return struct.unpack("<d", struct.pack("<Q", bits & ((1 << 64) - 1)))[0]


def _edge(flagged: Callable[[float], bool], inside: float, outside: float, hint: float | None = None) -> float:
    """The last value not flagged on the way from ``inside`` (not flagged) to ``outside`` (flagged), to the
    neighbouring double; ``hint``, a value near the edge, shortens the search: from it the bracket grows 16-fold
    per probe until it holds the edge (a hint n doubles off costs about 1.25 n probes, no worse than bisecting
    the whole range; an exact one about 6)."""
    a, b = _key(inside), _key(outside)
    toward = 1 if b > a else -1
    if hint is not None and math.isfinite(hint) and (_key(hint) - a) * toward > 0 and (b - _key(hint)) * toward > 0:
        h = _key(hint)
        if flagged(_float(h)):
            b, reach = h, 1
            while (b - reach * toward - a) * toward > 0 and flagged(_float(b - reach * toward)):
                b, reach = b - reach * toward, reach * 16
            a = b - reach * toward if (b - reach * toward - a) * toward > 0 else a
        else:
            a, reach = h, 1
            while (b - (a + reach * toward)) * toward > 0 and not flagged(_float(a + reach * toward)):
                a, reach = a + reach * toward, reach * 16
            b = a + reach * toward if (b - (a + reach * toward)) * toward > 0 else b
    while abs(b - a) > 1:
        mid = (a + b) // 2
        if flagged(_float(mid)):
            b = mid
        else:
            a = mid
    return _float(a)


def _clone(detector: SpikeDetector) -> SpikeDetector:
    """A copy to probe: flat lists copied as lists, anything else mutable deep-copied (faster than deepcopy)."""
    new = object.__new__(type(detector))
    new.__dict__ = {k: v if isinstance(v, _FLAT) else list(v) if type(v) is list and all(
        isinstance(i, _FLAT) for i in v) else copy.deepcopy(v) for k, v in detector.__dict__.items()}
    return new


def detector_bounds(detector: SpikeDetector, step: int, lr: float | None,
                    confirms_itself: Callable[[SpikeEvent], bool] | None = None) -> tuple[float, float, float]:
    """``(lo, hi, cond)`` for the detector's next update at ``step`` with learning rate ``lr``: a finite value in
    ``[lo, hi]`` is accepted; one above ``cond`` or below ``lo`` is flagged by a rule for which
    ``confirms_itself(event)`` is False; one in ``(hi, cond]`` by a rule for which it is True (without
    ``confirms_itself``, ``cond`` is ``hi``)."""
    def probe(value: float) -> SpikeEvent | None:
        return _clone(detector).update(step, value, lr=lr)

    anchor = detector.baseline
    if anchor is None:
        return -math.inf, _MAX, _MAX  # the first value is the start of the level: always accepted
    candidates = [anchor, anchor / 2, anchor / 16, anchor * 1e-6] if anchor > 0 else [anchor, anchor - abs(anchor)]
    inside = next((c for c in candidates if math.isfinite(c) and probe(c) is None), None)
    if inside is None:
        return math.inf, -math.inf, -math.inf  # nothing near the forecast is accepted: every value is flagged
    top = probe(_MAX)
    hi = _MAX if top is None else _edge(lambda v: probe(v) is not None, inside, _MAX, _hint(detector, top))
    lo = -math.inf
    if detector.direction != "up":
        bottom = -_MAX if not detector.log_space else 0.0
        if probe(bottom) is not None:
            lo = _edge(lambda v: probe(v) is not None, inside, bottom)
    cond = hi
    if hi < _MAX and confirms_itself is not None:
        above = probe(math.nextafter(hi, math.inf))
        if above is not None and confirms_itself(above):
            conditional = lambda v: (e := probe(v)) is not None and not confirms_itself(e)  # noqa: E731
            cond = _MAX if not conditional(_MAX) else _edge(conditional, math.nextafter(hi, math.inf), _MAX)
    return lo, hi, cond


def _hint(detector: SpikeDetector, event: SpikeEvent) -> float:
    """Where the edge likely is: the event's threshold, or higher where a rise must also undo a share of the run's
    progress (``min_progress_share``; ``noisy_progress_share`` on a noisy run), which the threshold leaves out.
    Only a starting point: the search finds the edge whatever this says."""
    hint = event.threshold
    required = detector.min_progress_share
    if detector.noisy_progress_share is not None and detector.relative_noise() >= NOISY_RELATIVE_NOISE:
        required = max(required or 0.0, detector.noisy_progress_share)
    at0, at1 = detector.progress_share(0.0), detector.progress_share(1.0)
    if required is not None and at0 is not None and at1 is not None and at1 != at0:
        hint = max(hint, (required - at0) / (at1 - at0))  # the share is linear in the value
    return hint


def share_bound(detector: SpikeDetector, share: float) -> float:
    """The smallest loss whose :meth:`~SpikeDetector.progress_share` is at least ``share``; inf where none is."""
    def below(value: float) -> bool:
        got = detector.progress_share(value)
        return got is None or not got >= share

    if below(_MAX):
        return math.inf
    if not below(-_MAX):
        return -math.inf
    # The share is linear in the value: two evaluations place the edge within a few doubles, the search makes it exact.
    at0, at1 = detector.progress_share(0.0), detector.progress_share(1.0)
    hint = (share - at0) / (at1 - at0) if at0 is not None and at1 is not None and at1 != at0 else None
    return math.nextafter(_edge(lambda v: not below(v), -_MAX, _MAX, hint), math.inf)


def keep_factor(table: torch.Tensor, bounds: torch.Tensor, *, has_norm: bool, scaler: bool, act: bool) -> torch.Tensor:
    """The step's 0-d bool on the device: True keeps the update. ``table``: every rank's
    :class:`~stable_attn.monitor.verdict.RankReading` row ``[world, 4]``; ``bounds``: ``[world, len(COLUMNS)]``;
    ``act``: a spike drops the update (``on_spike="skip"`` below its cap). The judge's rules (verdict.py) on tensors:
    a NaN or inf drops always; a loss flag on any rank is a spike; a gradient-norm flag is one when its rule confirms
    itself, or the loss is flagged on some rank, or the rank's loss undoes half the progress."""
    loss, norm, has_loss, bad = table.reshape(-1, RankReading.WIDTH).unbind(1)
    lo, hi, share, glo, ghi, gcond = bounds.reshape(-1, len(COLUMNS)).unbind(1)
    has_loss = has_loss > 0.5
    finite = torch.isfinite(loss)
    nonfinite_loss = has_loss & ~finite
    drop = nonfinite_loss.any()
    if not scaler:
        drop = drop | (bad > 0.5).any()
    if not act:
        return ~drop
    loss_flags = (has_loss & finite & ((loss < lo) | (loss > hi))) | nonfinite_loss
    spiked = loss_flags.any()
    if has_norm:
        seen = torch.isfinite(norm)
        flagged = seen & ((norm < glo) | (norm > ghi))
        needs = seen & ((norm < glo) | (norm > gcond))
        confirmed = has_loss & finite & (loss >= share)
        spiked = spiked | (flagged & (~needs | spiked | confirmed)).any()
    return ~(drop | spiked)


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory() if torch.cuda.is_available() else tensor


class UpdateGate:
    """Undo a dropped optimizer step on the device, bit for bit (see the module): :meth:`arm` before the step,
    :meth:`select` after it, :meth:`settle` once the host knows whether the step was dropped."""

    def __init__(self) -> None:
        self._keep: torch.Tensor | None = None
        self._device: list[tuple[Any, Any, torch.Tensor]] = []  # (owner, key, saved copy) put back by select
        self._host: list[tuple[Any, Any, Any]] = []  # (owner, key, saved value) put back by settle
        self._fresh: list[Any] = []  # parameters without optimizer state before the step
        self._optimizer: Any = None
        self._armed = False  # between arm and select: the optimizer step may still be to come
        self._deferred: bool | None = None  # a settle that came while armed: done by select, after the step

    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self, optimizer: Any, params: Iterable[torch.nn.Parameter], keep: torch.Tensor) -> None:
        if self._armed:
            raise RuntimeError("device_skip=True gates one optimizer step per training step, and a second one came "
                               "before the step ended (end_step, or the callback's end of the batch): several "
                               "optimizers, or optimizer steps inside one training step, need device_skip=False")
        self._keep, self._optimizer, self._armed, self._deferred = keep, optimizer, True, None
        self._device, self._host, self._fresh = [], [], []
        state = getattr(optimizer, "state", {})
        for p in params:
            if p.grad is None:
                continue  # the optimizer leaves it alone either way
            self._device.append((p, None, p.detach().clone()))
            if p not in state:
                self._fresh.append(p)
                continue
            for key, value in state[p].items():
                if isinstance(value, torch.Tensor) and value.device == p.device:
                    self._device.append((state[p], key, value.detach().clone()))
                else:
                    self._host.append((state[p], key, copy.deepcopy(value)))

    def select(self) -> None:
        """After the optimizer step: a dropped step's parameters and device state get their old bits (no host read)."""
        keep, saved, self._device, self._armed = self._keep, self._device, [], False
        if keep is None:
            return
        with torch.no_grad():
            for owner, key, old in saved:
                now = owner if key is None else owner.get(key)
                if isinstance(now, torch.Tensor) and now.shape == old.shape and now.dtype == old.dtype:
                    local(now).copy_(torch.where(keep.to(local(now).device), local(now), local(old)))
                else:  # replaced by another shape or type: put back on the host once the step is read
                    self._host.append((owner, key, old))
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self.settle(deferred)

    def settle(self, dropped: bool) -> None:
        """The step was read: if it was dropped, put back its host-side state and drop the state it created.
        Read before :meth:`select` (a ``state_dict`` between the optimizer step and the step's end), it waits for
        select: the device bits first, then the host's, whenever the optimizer steps."""
        if self._armed:
            self._deferred = dropped
            return
        host, fresh, self._host, self._fresh = self._host, self._fresh, [], []
        optimizer, self._optimizer, self._keep = self._optimizer, None, None
        if not dropped or optimizer is None:
            return
        for owner, key, old in host:
            now = owner.get(key)
            if isinstance(now, torch.Tensor) and isinstance(old, torch.Tensor) and now.shape == old.shape:
                now.copy_(old)  # in place: a state_dict taken meanwhile holds this tensor
            else:
                owner[key] = old
        for p in fresh:
            optimizer.state.pop(p, None)


@dataclass
class Pending:
    """A gated step whose values the host has not read yet."""

    step: int
    table: torch.Tensor  # the gathered rows and the drop flag, copied towards the host
    event: Any  # a CUDA event recorded after the copy (None on the CPU)
    has_norm: bool
    scaler: bool
    lr: float
    groups: Any  # the optimizer's param groups' learning rates at the step, for the alerts' evidence
    position: Any  # the engine's data position of the step's last micro-batch


class DeviceSkip:
    """A run's device decision: each step's bounds and factor, the gate, and the step read one step later.
    ``judge``: the run's :class:`~stable_attn.monitor.verdict.StepJudge`, whose detectors give the bounds."""

    def __init__(self, judge: Any) -> None:
        self.judge = judge
        self.updates = UpdateGate()
        self.pending: Pending | None = None
        self.mismatches = 0  # steps whose device factor differed from the judge's verdict read later

    def bounds(self, step: int, lr: float, world: int, device: torch.device, has_norm: bool = True) -> torch.Tensor:
        """``[world, len(COLUMNS)]`` float64 on ``device`` (a non-blocking copy from pinned memory on CUDA)."""
        rows = []
        for rank in range(world):
            loss_det, norm_det = self.judge.ranks[LOSS][rank], self.judge.ranks[GRAD_NORM][rank]
            lo, hi, _ = detector_bounds(loss_det, step, lr, None)
            glo, ghi, gcond = detector_bounds(norm_det, step, lr, confirms_itself) if has_norm else (0.0, 0.0, 0.0)
            rows.append([lo, hi, share_bound(loss_det, GRAD_NORM_CONFIRM_SHARE), glo, ghi, gcond])
        host = _pinned(torch.tensor(rows, dtype=torch.float64))
        return host.to(device, non_blocking=True)

    def gate(self, step: int, optimizer: Any, params: list[torch.nn.Parameter], table: torch.Tensor, *,
             has_norm: bool, scaler: bool, lr: float, act: bool, stop: bool, world: World, position: Any) -> Decision:
        """Gate the step's update by its factor and start copying its values to the host. ``act``: a spike drops
        the update; ``stop``: the not-training streak, read a step late, stops the run now (this update is dropped
        on the host: the weights kept are the host path's)."""
        if stop:
            optimizer.zero_grad(set_to_none=True)
            return Decision(step=step, drop=True, action="skip", rollback=False, stop=True)
        table = table.to(world.device)
        bounds = self.bounds(step, lr, world.size, world.device, has_norm)
        keep = keep_factor(table, bounds, has_norm=has_norm, scaler=scaler, act=act)
        self.updates.arm(optimizer, params, keep)
        packed = torch.cat([table.reshape(-1).double(), (~keep).double().reshape(1)])
        event = None
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            packed = host
        groups = SimpleNamespace(param_groups=[{"lr": g.get("lr")} for g in getattr(optimizer, "param_groups", [])])
        self.pending = Pending(step, packed, event, has_norm, scaler, lr, groups, position)
        return Decision(step=step, drop=False, action="skip" if act else "warn", rollback=False, stop=False, gated=True)

    def settle(self, conclude: Callable[..., Verdict]) -> None:
        """Read the pending step (the one host read, of a copy started a step ago) and have ``conclude`` (the
        engine's) judge it as the host path does; the gate then puts back a dropped step's host-side state."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if pending.event is not None:
            pending.event.synchronize()
        values = pending.table.tolist()
        dropped = values[-1] > 0.5
        rows = [RankReading.from_row(values[i:i + RankReading.WIDTH])
                for i in range(0, len(values) - 1, RankReading.WIDTH)]
        verdict = conclude(pending.step, rows, has_norm=pending.has_norm, scaler=pending.scaler, lr=pending.lr,
                           optimizer=pending.groups, params=[], dropped=dropped, position=pending.position)
        self.updates.settle(dropped)
        if verdict.drop != dropped:
            self.mismatches += 1
            log.warning("device_skip: step %d's update was %s on the device, and the judge reading its values says "
                        "%s: a detector whose flagged values are not above (or below) one bound; please report it",
                        pending.step, "dropped" if dropped else "kept", "drop" if verdict.drop else "keep")
