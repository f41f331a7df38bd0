"""Online spike detection for a training loss or gradient norm: :class:`SpikeDetector`.

One scalar per update, O(1) pure-Python arithmetic (no torch, no buffer that grows), the state in a few plain
floats, ints and short lists, so :meth:`~SpikeDetector.state_dict` survives ``torch.save``,
``torch.load(weights_only=True)`` and JSON::

    det = SpikeDetector.loss()              # or SpikeDetector.grad_norm()
    event = det.update(step, loss)          # SpikeEvent | None
    if event is not None and event.is_new:  # first update of an anomalous episode: alert once there
        ...                                 # act on every event if skipping steps

docs/DETECTORS.md is the reference: the rules (``event.rule``: ``nonfinite``, ``gross``, ``jump``,
``drift``), when each judges (:attr:`SpikeDetector.phase`), the progress gate on a low, noisy loss, the
design ("The spike detector's design") and the measurements behind every number. The robust statistics
shared with the early-warning detectors are in :mod:`stable_attn.monitor.detectors.robust`.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

from ..names import GRAD_NORM, LOSS
from .events import SpikeEvent
from .robust import (
    MIN_SCALE_SAMPLES,
    RECENT_FLAGGED,
    Episodes,
    as_float,
    check_count,
    check_metric,
    check_positive,
    check_rate,
    check_state,
    huber_consistency,
    median,
    optional_float,
    update_scale,
    window_noise,
)
from .schedule import RESTART, WARMUP_END, ScheduleTracker

__all__ = ["NOISY_RELATIVE_NOISE", "Phase", "SpikeDetector"]

_logger = logging.getLogger("stable_attn")

# While an update is skipped (flagged or non-finite) the trend is extrapolated with this per-update
# decay, so a long anomaly cannot drag the forecast far along a stale slope (total drift <= ~19 slopes).
_GAP_TREND_DECAY = 0.95
# Values at or below zero have no logarithm. Watching rises ("up"), such a value (an exact 0.0: a loss logged
# rounded, a norm of a step without gradients) is no rise and is left out of every estimate: floored and accepted,
# it pulled the level ~7 log units down and the ordinary values after it were flagged as jumps 50 in a row. With
# "both" it is floored here (a huge drop, flagged by the jump rule once calibrated). Either way a warning says
# once that log_space=False suits such a metric.
_LOG_FLOOR = 1e-30
_SCALE_EPS = 1e-12
# Warm-up also waits until an EMA (rate _BIAS_RATE) of clipped standardized residuals is within
# _BIAS_READY of zero; on clean Gaussian noise that EMA has a standard deviation of about 0.16.
_BIAS_RATE = 0.05
_BIAS_READY = 0.5
_CALM_UPDATES = 20
# The gross-jump rule compares a value with the median of this many recently accepted values: a median
# of a few is not moved by one odd value, and over the steep first descent of a loss it lies above the
# current level, so the descent itself can never look like a jump.
_GROSS_WINDOW = 5
# The run's own noise (docs/DETECTORS.md, "The run's own noise"; robust.window_noise): the successive
# differences of the last this many finite values, flagged ones included (a median is not moved by the one or
# two differences of a real spike, and counting flagged values keeps an underestimated noise from hiding
# itself). A fixed gross ratio alone ignores the noise: at a loss of 0.07 nats batch noise exceeds 25% and
# 1.25x flagged 13-24 healthy steps of 200.
_NOISE_WINDOW = 32
# The jump and drift rules measure in the larger of the robust scale and this share of the window noise:
# the robust scale learns from accepted values only, and on a noise it has not learnt it would flag the
# ordinary half of the batches for ever. The share keeps the window's sampling error (about 25% on 31
# differences) from blunting the bar on clean noise.
_WINDOW_NOISE_SHARE = 0.75
# Re-entry: the values of a short flagged episode (at most _REENTRY_RUN updates) that is followed by
# _REENTRY_AFTER accepted values in a row (no sustained change) re-enter the baseline: each one moves
# the level and the noise scale like an accepted value, its residual clipped at ``clip`` sigmas. A
# detector whose noise estimate is too low (its flags were ordinary noise) so learns the real noise
# instead of excluding it for ever; a longer episode (a spike that lasts, a shift) never re-enters.
_REENTRY_RUN = 2
_REENTRY_AFTER = 3
# The run's start, for min_progress_share: the median of this many first finite values.
_FIRST_VALUES = 5
# From this relative noise on (0.05 = 5% per step) a jump or gross rise must also undo
# ``noisy_progress_share`` of the run's progress: a loss that has fallen far below its start and is that
# noisy has healthy batches of a few times its level (docs/DETECTORS.md, "A low, noisy loss").
NOISY_RELATIVE_NOISE = 0.05
# The drift sum divides its increments by sqrt((1 + rho) / (1 - rho)) for the residuals' lag-1
# autocorrelation rho (the long-run standard deviation of an AR(1) in units of its marginal one),
# with rho capped here: beyond it a "noise" is a trend the forecast should follow.
_MAX_RHO = 0.9
# Before calibration, a jump of _PROVISIONAL_Z times the calibrated bar counts once the noise scale
# has _PROVISIONAL_AFTER samples: the forecast may still lag a steep descent, not by that much.
_PROVISIONAL_AFTER = 20
_PROVISIONAL_Z = 2.0
# Each residual adds at most this many sigmas to the drift sum: with the default slack and threshold,
# a cluster of 8 hard batches in a row (each 2-4 sigma) stays below the threshold, a rise that lasts
# 11 updates or more at 1.5 sigma does not.
_DRIFT_CAP = 1.5
# Those moments stop learning while the drift sum is above this share of drift_threshold.
_FREEZE_MOMENTS = 0.25
# After a jump the drift sum waits until this many residuals in a row are back below drift_slack.
_SETTLE_UPDATES = 5
# During the grace a value above this factor times the median of the values since the restart is still a spike:
# the restart families of benchmarks/real_runs.py move the loss by up to 2x at a restart, so this bar leaves them
# silent and catches the larger garbled batches that fall in a grace. It is a floor: the bar is also the gross
# rule's own (its ratio and gross_z sigmas of the run's noise, which a restart does not change), so a grace never
# judges below what the detector judges outside one (a gradient norm's 5x; a norm whose healthy values swing 10-100x
# between points, restarted every 5 points, was flagged at 24 of its 150 points by a 3x bar blind to that noise).
_GRACE_RATIO = 3.0
# After the grace (schedule.ScheduleTracker) the forecast settles onto the new cycle's curve as at the start of a
# run, until it is unbiased for _CALM_UPDATES updates in a row: residuals unclipped (a level moving 0.2 sigma per
# update lagged a loss falling back from a doubling for hundreds of updates, and spikes hid below it), kept out of
# the residual moments (the catching up is a bias, not noise), and no drift sum (the overshoot of a trend learnt on
# the fall back filled it). The jump rule judges throughout, at its calibrated bar.
# The format of state_dict(): load_state_dict reads this version, and the two before it (which held less
# learning-rate state (5: none; 6: no warm-up count): what it lacks is learnt afresh).
_STATE_VERSION = 7
_PREVIOUS_VERSION = 6
Phase = Literal["starting", "gross", "calibrated"]


class SpikeDetector:
    """Online spike detector for a training loss or gradient norm (docs/DETECTORS.md has every rule and why).

    Each update forecasts the next value from a local level and trend (Holt's smoothing, in log space by
    default) and measures the residual in robust sigmas of the recent noise. From the ``gross_warmup``-th
    finite update the **gross** rule flags a value far above the median of the last 5 accepted values; from
    the 21st a provisional **jump** at twice the calibrated bar; once calibrated (``warmup`` updates and a
    forecast unbiased for 20 updates in a row) the **jump** rule (``z_threshold`` sigmas and
    ``min_rel_change`` over the forecast) and the **drift** rule (a one-sided CUSUM of standardized rises
    over ``drift_threshold``). Non-finite values are always flagged. A flagged value does not enter the
    estimates (a short episode re-enters them later); ``rebaseline_after`` flags re-seat the level.

    Time constants count updates, not steps: feeding every N steps makes them N times longer. Steps are
    labels only (they need not be consecutive or increasing, e.g. after a rollback). For a metric that
    legitimately trends up for long stretches, raise ``max_rise`` or set ``drift_threshold=None``.

    Args:
        metric: name carried by events (e.g. ``"train/loss"``, ``"train/grad_norm"``).
        z_threshold: robust sigmas above the forecast that make a jump.
        min_rel_change: the smallest relative rise over the baseline that can be a jump (0.01 = 1%); in
            linear space, relative to ``|baseline|``.
        warmup: finite updates before the calibrated rules (jump, drift) can fire; they also wait until the
            forecast is unbiased (at least 20 more updates).
        gross_ratio: the gross rule's factor over the median of recent values (in linear space, the rise
            ``(gross_ratio - 1) * |median|``); None disables the rule.
        gross_warmup: finite updates before the gross rule can fire (>= 1).
        gross_z: the gross rule's bar is also this many sigmas of the run's own noise; 0: the ratio alone.
        start_ratio: None (default), or from the 2nd finite update until the gross rule judges, a value
            above this factor times every accepted value is flagged (rule ``gross``) and kept out.
        rising_noise: measure the noise from rising differences only (direction ``"up"``): a metric that
            falls several-fold over its first updates (a gradient norm) so keeps its bar at the size of its
            rises, not of its start's fall (docs/DETECTORS.md, "The start of a run").
        level_rate: smoothing rate of the level (larger follows faster, noisier baseline).
        trend_rate: smoothing rate of the trend (Holt's beta, applied to level changes).
        scale_rate: smoothing rate of the robust noise variance.
        clip: residuals are clipped at this many sigmas before they update level and scale.
        rebaseline_after: flagged finite updates (in a row, or among the last ``2 * rebaseline_after``)
            after which the level is re-seated.
        max_rise: largest upward trend the forecast follows, in sigmas per update.
        drift_threshold: CUSUM level (in sigmas) at which the drift rule fires; None disables it.
        drift_slack: sigmas subtracted from each residual in the drift sum (ignore smaller biases).
        direction: ``"up"`` flags rises only (losses, norms); ``"both"`` also flags drops by the jump rule
            (the drift rule watches rises only).
        log_space: detect on ``log(value)`` (positive metrics); False for metrics that can be zero or negative.
        min_progress_share: None (default), or a jump or gross rise must also undo at least this share of
            the run's progress (:meth:`progress_share`) to be flagged; it costs recall on small spikes
            (docs/DETECTORS.md). The drift rule is not gated.
        noisy_progress_share: the same gate, on only while the run's relative noise
            (:meth:`relative_noise`) is at least :data:`NOISY_RELATIVE_NOISE` (5% per update): 0.1 by default
            (:meth:`grad_norm`: None); None switches it off. Where both are set the larger share applies.
        lr_restart_ratio: with the learning rate passed to :meth:`update`, a schedule restart is a rise of the
            learning rate to at least this factor over its lowest value since its last peak, after it had fallen
            below the peak by the same factor (a warm-up or a ramp from the start is not a restart): the detector
            follows the values through the restart's rise and settles on the new cycle's level (docs/DETECTORS.md,
            "The learning-rate schedule"). None ignores the learning rate. The end of a warm-up (the learning rate
            no longer rising after rising from the first update on, at least 5 updates) re-seats a calibrated
            detector's level on the recent values and lets its forecast settle again.
        warmup_drift: the drift rule judges while the learning rate rises in a warm-up (default). False holds it
            there: a loss that rises with a too-hot warm-up and settles back is not alerted, but neither is a slow
            rise of a learning-rate ramp into divergence (docs/DETECTORS.md, "The learning-rate schedule").
    """

    def __init__(
        self,
        metric: str = LOSS,
        *,
        z_threshold: float = 6.0,
        min_rel_change: float = 0.01,
        warmup: int = 100,
        gross_ratio: float | None = 1.25,
        gross_warmup: int = 3,
        gross_z: float = 6.0,
        start_ratio: float | None = None,
        rising_noise: bool = False,
        level_rate: float = 0.1,
        trend_rate: float = 0.1,
        scale_rate: float = 0.03,
        clip: float = 2.0,
        rebaseline_after: int = 50,
        max_rise: float = 0.02,
        drift_threshold: float | None = 12.0,
        drift_slack: float = 0.35,
        direction: Literal["up", "both"] = "up",
        log_space: bool = True,
        min_progress_share: float | None = None,
        noisy_progress_share: float | None = 0.1,
        lr_restart_ratio: float | None = 2.0,
        warmup_drift: bool = True,
    ) -> None:
        self.metric = check_metric(metric)
        if direction not in ("up", "both"):
            raise ValueError(f"direction must be 'up' or 'both', got {direction!r}")
        if not isinstance(log_space, bool):
            raise TypeError(f"log_space must be a bool, got {log_space!r}")
        self.z_threshold = check_positive("z_threshold", z_threshold)
        self.min_rel_change = check_positive("min_rel_change", min_rel_change, allow_zero=True)
        self.warmup = check_count("warmup", warmup, 0)
        if gross_ratio is not None:
            gross_ratio = as_float("gross_ratio", gross_ratio)
            if not (gross_ratio > 1.0 and math.isfinite(gross_ratio)):
                raise ValueError(f"gross_ratio must be a finite number > 1 or None, got {gross_ratio!r}")
        self.gross_ratio = gross_ratio
        self.gross_warmup = check_count("gross_warmup", gross_warmup, 1)
        self.gross_z = check_positive("gross_z", gross_z, allow_zero=True)
        if start_ratio is not None:
            start_ratio = as_float("start_ratio", start_ratio)
            if not (start_ratio > 1.0 and math.isfinite(start_ratio)):
                raise ValueError(f"start_ratio must be a finite number > 1 or None, got {start_ratio!r}")
        self.start_ratio = start_ratio
        if not isinstance(rising_noise, bool):
            raise TypeError(f"rising_noise must be a bool, got {rising_noise!r}")
        self.rising_noise = rising_noise
        self.level_rate = check_rate("level_rate", level_rate)
        self.trend_rate = check_rate("trend_rate", trend_rate)
        self.scale_rate = check_rate("scale_rate", scale_rate)
        self.clip = check_positive("clip", clip)
        self.rebaseline_after = check_count("rebaseline_after", rebaseline_after, 1)
        self.max_rise = check_positive("max_rise", max_rise, allow_zero=True)
        self.drift_threshold = None if drift_threshold is None else check_positive("drift_threshold", drift_threshold)
        self.drift_slack = check_positive("drift_slack", drift_slack, allow_zero=True)
        self.direction = direction
        self.log_space = log_space
        self.min_progress_share = None if min_progress_share is None else check_positive(
            "min_progress_share", min_progress_share, allow_zero=True)
        self.noisy_progress_share = None if noisy_progress_share is None else check_positive(
            "noisy_progress_share", noisy_progress_share, allow_zero=True)
        if not isinstance(warmup_drift, bool):
            raise TypeError(f"warmup_drift must be a bool, got {warmup_drift!r}")
        if not warmup_drift and lr_restart_ratio is None:
            raise ValueError("warmup_drift=False holds the drift rule during a warm-up the learning rate shows, and "
                             "lr_restart_ratio=None ignores the learning rate: set lr_restart_ratio (default 2.0) or "
                             "leave warmup_drift=True")
        self.warmup_drift = warmup_drift
        self._lrs = ScheduleTracker(lr_restart_ratio)
        self.lr_restart_ratio = self._lrs.restart_ratio
        self._kappa = huber_consistency(self.clip)
        # Falls are left out of the noise only where rises are what is judged (direction "up").
        self._rising = rising_noise and direction == "up"
        # The smallest margin a jump must clear in log space (see _sigma for why it also floors the scale).
        self._min_margin = math.log1p(self.min_rel_change) if log_space else 0.0
        self._warned_nonpositive = False
        self.reset()

    @classmethod
    def loss(cls, metric: str = LOSS, **kwargs: Any) -> SpikeDetector:
        """Defaults for a training loss (the constructor's)."""
        return cls(metric, **kwargs)

    @classmethod
    def grad_norm(cls, metric: str = GRAD_NORM, **kwargs: Any) -> SpikeDetector:
        """Defaults for a gradient norm: the gross rule fires at 5x the recent median (early
        gradient norms of healthy runs swing by up to 4x from one step to the next), and at 4 sigmas
        of the norm's own noise where that is wider (the 5x ratio already allows for the usual swings);
        before it, from the 2nd update, a value 8x above every earlier one is flagged; the noise is
        measured on rises only (a run's norm falls 4-20x over its first points, and counted as noise
        that fall raised the gross bar to 7-48x: docs/DETECTORS.md, "The start of a run"); a jump must
        be a rise of at least 3x (``min_rel_change=2``: every labelled gradient-norm spike of the real-runs
        corpus's 42 runs it was chosen on is 4.6x or more, and its one benign jump under that bar was a 2.9x
        single-step norm; of the 44 runs labelled blind later, two labelled spikes are 3.96x and 4.19x the
        median of the 5 values before)."""
        kwargs.setdefault("min_rel_change", 2.0)
        kwargs.setdefault("gross_ratio", 5.0)
        kwargs.setdefault("gross_z", 4.0)
        kwargs.setdefault("start_ratio", 8.0)
        kwargs.setdefault("rising_noise", True)
        kwargs.setdefault("noisy_progress_share", None)  # a norm does not fall from a start as a loss does
        return cls(metric, **kwargs)

    # ----------------------------------------------------------------- state
    def reset(self) -> None:
        """Forget everything learnt (as freshly constructed)."""
        self._n = 0  # finite values accepted into the estimates
        self._armed = False  # warm-up over and forecast calibrated; only a re-baseline unsets it
        self._bias = 0.0  # EMA of clipped standardized residuals, only used to end warm-up
        self._calm = 0  # consecutive updates with |bias| <= _BIAS_READY
        self._cusum = 0.0  # one-sided CUSUM of standardized residuals (drift rule)
        self._settling = 0  # after a jump: updates left until settled (no drift sum meanwhile)
        self._level: float | None = None
        self._trend = 0.0
        self._var: float | None = None
        self._residuals = 0  # residuals folded into _var
        self._last_residual: float | None = None
        # Centered moments of the residuals (mean, variance about it, lag-1 covariance; _rcount samples): the
        # successive-difference scale reads low on autocorrelated noise, this one does not.
        self._rmean = 0.0
        self._rvar: float | None = None
        self._rcov = 0.0
        self._rcount = 0
        self._episodes = Episodes()
        self._recent: list[float] = []
        self._window: list[float] = []  # last accepted values (transformed), for the gross rule
        self._noise: list[float] = []  # last finite values (transformed), flagged too: the gross rule's noise
        self._seen = 0  # finite updates seen (accepted or flagged)
        self._marks: list[int] = []  # _seen of the flagged finite updates among the last 2 * rebaseline_after
        self._episode: list[float] = []  # residuals of the current flagged episode (short ones re-enter)
        self._held: list[float] = []  # residuals of finished short episodes, waiting to re-enter
        self._clean = 0  # accepted values in a row since the last flag
        self._first: list[float] = []  # the first _FIRST_VALUES finite values seen (metric's units): the run's start
        self._lrs.reset()  # the learning-rate schedule: its restarts, a restart's grace and settling

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (ints, floats, str, None, lists) for checkpoints; config under ``"config"``
        is informational: :meth:`load_state_dict` keeps the constructor's settings."""
        state: dict[str, Any] = {"version": _STATE_VERSION, "type": "SpikeDetector", "config": self._config()}
        for key in _STATE:
            value = getattr(self, "_" + key)
            state[key] = list(value) if isinstance(value, list) else value
        state.update(self._lrs.state_dict())
        state.update(run=self._episodes.run, last_kind=self._episodes.last_kind)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (e.g. on resume); a state of another format is
        refused, naming its version."""
        if isinstance(state, Mapping) and state.get("version") in (_PREVIOUS_VERSION - 1, _PREVIOUS_VERSION):
            # a warm-up not seen is over (-1): a run resumed from such a state is past its start
            state = {**ScheduleTracker(None).state_dict(), "warm": -1, **state, "version": _STATE_VERSION}
        check_state(state, "SpikeDetector", tuple(self.state_dict()), _STATE_VERSION)
        for key, read in _STATE.items():
            setattr(self, "_" + key, read(state[key]))
        self._lrs.load_state_dict(state)
        self._episodes.run = int(state["run"])
        self._episodes.last_kind = state["last_kind"]

    def _config(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _CONFIG}

    # ------------------------------------------------------------ properties
    @property
    def ready(self) -> bool:
        """True once the detector is calibrated: the jump and drift rules judge the next update."""
        return self._armed

    @property
    def phase(self) -> Phase:
        """Which rule judges the next finite update: ``"starting"`` (none: only non-finite values are
        flagged), ``"gross"`` (the gross-jump rule) or ``"calibrated"`` (jump and drift). It moves
        forward as values arrive and back to ``"gross"`` after a re-baseline."""
        if self._armed:
            return "calibrated"
        if self.gross_ratio is not None and len(self._window) >= self.gross_warmup:
            return "gross"
        return "starting"

    @property
    def restarts(self) -> int:
        """Schedule restarts seen in the learning rates passed to :meth:`update`."""
        return self._lrs.restarts

    @property
    def baseline(self) -> float | None:
        """The forecast for the next update in the metric's units (None before the first value)."""
        return None if self._level is None else self._to_value(self._level + self._trend)

    # ---------------------------------------------------------------- update
    def update(self, step: int, value: float, lr: float | None = None) -> SpikeEvent | None:
        """Feed one observation (anything ``float()`` accepts: a 1-element tensor too); return a
        :class:`~stable_attn.monitor.detectors.events.SpikeEvent` if it is anomalous, else None. ``step`` is only
        carried into the event; a flagged value does not enter the estimates, nor (log space, direction ``"up"``)
        does a value at or below zero, which returns None.

        ``lr``: the learning rate of this update (None, NaN or a value <= 0: unknown, as without it). A restart
        of the schedule (:attr:`lr_restart_ratio`) starts the restart's grace with this value: see
        ``lr_restart_ratio``; the engine passes the optimizer's first param group's learning rate."""
        value = as_float("value", value)
        step = int(step)
        change = self._lrs.observe(None if lr is None else as_float("lr", lr))
        if change == RESTART:
            self._restart()
        elif change == WARMUP_END and self._armed:
            self._warmup_end()
        if not math.isfinite(value):
            return self._nonfinite(step, value)
        if self.log_space and value <= 0.0 and self.direction == "up":
            self._warn_nonpositive(value)
            return None
        x = self._transform(value)
        self._seen += 1
        if self._seen <= _FIRST_VALUES:
            self._first.append(value)
        self._noise.append(x)
        del self._noise[: -_NOISE_WINDOW - 1]  # the window and x itself
        if self._level is None:
            self._accept(x)
            self._episodes.clear()
            return None
        if self._lrs.in_grace:
            self._lrs.grace_step()
            return self._follow(step, value, x)

        forecast = self._level + self._trend
        rel, absolute = self._window_noise()
        sigma = max(self._sigma(), _WINDOW_NOISE_SHARE * rel)
        # On autocorrelated noise the forecast sits inside the noise's slow wander, and a value can lie
        # sqrt(1 + rho) times further from it than the residual scale says while being ordinary:
        # the jump bar widens by that factor (1 on white noise).
        widen = math.sqrt(1.0 + self._rho())
        margin = max(self._margin(forecast, sigma * widen), self._abs_margin(self.z_threshold * widen, absolute))
        # The drift sum measures rises in the local size of the noise, absolute noise included.
        drift_sigma = max(sigma, _WINDOW_NOISE_SHARE * self._abs_margin(1.0, absolute))
        residual = x - forecast
        # A rise is measured from the forecast, but never from below the lowest recent value: after
        # a fast fall (a learning-rate drop) the trend runs on below a curve that has flattened, and
        # the flattening is not a spike.
        excess = x - max(forecast, min(self._window)) if self.direction == "up" else abs(residual)
        if self.phase == "starting" and self.start_ratio is not None:
            event = self._start(step, value, x)
            if event is not None:
                return event
        if self.phase == "gross":
            event = self._gross(step, value, x)
            if event is not None:
                return event
            provisional = max(_PROVISIONAL_Z * self.z_threshold * sigma, margin,
                              self._abs_margin(_PROVISIONAL_Z * self.z_threshold * widen, absolute))
            if self._calm >= _CALM_UPDATES:
                # The doubled bar allows for a forecast that still lags the steep descent; a forecast
                # unbiased for _CALM_UPDATES updates in a row does not, so the calibrated bar applies
                # (warm-up still keeps the drift rule off).
                provisional = margin
            if self._residuals >= _PROVISIONAL_AFTER and excess > provisional and self._material(value, x - excess):
                # Not calibrated yet, but the noise scale has enough samples: a rise of the provisional
                # bar over the forecast (and over the lowest recent value) is a jump.
                self._settling = _SETTLE_UPDATES
                return self._spike(step, value, x, forecast, margin, residual / sigma, "jump")
        if self.ready:
            z = residual / sigma
            if excess > margin and self._material(value, x - excess):
                # The decaying tail of this spike will sit above the forecast for a while; it must
                # not add up to a second, "drift" alert for the same incident.
                self._settling = _SETTLE_UPDATES
                self._cusum = 0.0
                return self._spike(step, value, x, forecast, margin, z, "jump")
            if self._settling:
                # Settled once the residual has been back near zero for a few updates in a row
                # (one lucky noise draw inside a long tail is not enough).
                self._settling = self._settling - 1 if z <= self.drift_slack else _SETTLE_UPDATES
            if (self.drift_threshold is not None and not self._settling and not self._lrs.settling
                    and (self.warmup_drift or not self._lrs.warming)):
                # One-sided CUSUM of clipped standardized rises: a slow divergence that stays a sigma or so
                # up for tens of steps adds up although no single value is a jump (jump-flagged values stay
                # out: a long spike leaves no drift alarm behind). A rise above where the metric is, not
                # where a falling trend would take it: after a fast fall that gap filled the sum.
                rise = (x - self._level - max(self._trend, 0.0)) / drift_sigma
                self._cusum = max(0.0, self._cusum + min(rise, _DRIFT_CAP) / self._persistence() - self.drift_slack)
                if self._cusum > self.drift_threshold:
                    # Restart the sum (standard CUSUM practice): a rise that goes on alerts again
                    # every few steps, and a drift that stops leaves no trail of alarms.
                    self._cusum = 0.0
                    return self._spike(step, value, x, forecast, margin, z, "drift")
        self._accept(x)
        self._after_accept()
        self._episodes.clear()
        return None

    # --------------------------------------------------------------- helpers
    def _transform(self, value: float) -> float:
        if not self.log_space:
            return value
        if value <= 0.0:
            self._warn_nonpositive(value)
            value = _LOG_FLOOR
        return math.log(value)

    def _warn_nonpositive(self, value: float) -> None:
        if not self._warned_nonpositive:
            self._warned_nonpositive = True
            what = "left out" if self.direction == "up" else "treated as a tiny positive value"
            _logger.warning("SpikeDetector(%r) got %r <= 0 in log space; it is %s. Use log_space=False for metrics "
                            "that can be zero or negative.", self.metric, value, what)

    def _to_value(self, x: float) -> float:
        if not self.log_space:
            return x
        try:
            return math.exp(x)
        except OverflowError:
            return math.inf

    def _sigma(self) -> float:
        """Robust noise sigma, floored at the relative floor's share per sigma: on a perfectly flat
        series (variance 0) the clip bound would otherwise be 0 and the level could never move."""
        if self.log_space:
            floor = self._min_margin / self.z_threshold
        else:
            level = 0.0 if self._level is None else self._level + self._trend
            floor = self.min_rel_change * abs(level) / self.z_threshold
        floor = max(floor, _SCALE_EPS)
        if self._var is None:
            return floor
        return max(math.sqrt(max(self._var, self._rvar or 0.0)), floor)

    def _rho(self) -> float:
        """Lag-1 autocorrelation of the residuals, in [0, _MAX_RHO]."""
        if not self._rvar:
            return 0.0
        return min(max(self._rcov / self._rvar, 0.0), _MAX_RHO)

    def _persistence(self) -> float:
        """How much longer runs above the forecast last than on white noise (>= 1)."""
        rho = self._rho()
        return math.sqrt((1.0 + rho) / (1.0 - rho))

    def _margin(self, forecast: float, sigma: float) -> float:
        floor = self._min_margin if self.log_space else self.min_rel_change * abs(forecast)
        return max(self.z_threshold * sigma, floor)

    def _accept(self, x: float) -> None:
        """Fold a finite, unflagged value into level, trend and scale (Holt + robust variance)."""
        self._n += 1
        self._recent.clear()
        self._window.append(x)
        del self._window[:-_GROSS_WINDOW]
        if self._level is None:
            self._level = x
            return
        residual, bound, trusted = self._smooth(x)
        # The noise scale comes from differences of successive residuals: a persistent bias (a drift
        # or a slow explosion the level is chasing) cancels in them, so it cannot inflate the scale
        # and widen its own threshold, while noise that grows shows up at once.
        self._var, self._residuals = update_scale(
            self._var, self._residuals, residual, self._last_residual, bound, trusted, self.scale_rate, self._kappa,
            self._rising,
        )
        # While a rise is accumulating in the drift sum, it must not widen its own threshold (a slow
        # explosion's residuals look like slowly varying, autocorrelated noise). Nor may the forecast's
        # own catching up: in the first steps of a run (and after a re-baseline) the residuals are
        # the trend converging onto the curve, a bias that is large and varies, and as "noise" it
        # inflated the scale and the autocorrelation for hundreds of updates (a 94-sigma spike at step
        # 51 read as 4.7 sigmas). So the moments learn only while the forecast is unbiased.
        unbiased = (self._armed or self._calm > 0) and not self._lrs.settling
        if unbiased and self._cusum <= _FREEZE_MOMENTS * (self.drift_threshold or math.inf):
            self._update_moments(residual, bound, trusted)
        self._last_residual = residual
        if not self._armed or self._lrs.settling:
            # Warm-up ends after `warmup` values and once the forecast is unbiased: in the steep first
            # descent of a loss the trend is still catching up, and a forecast that runs below the
            # curve would flag every step. The bias EMA passes through zero while an oscillating
            # trend settles, so it must stay small for _CALM_UPDATES updates in a row. Once armed,
            # only a re-baseline disarms: a later bias is what a slow explosion looks like. The
            # settling after a schedule restart ends the same way (or after schedule.RESTART_SETTLE updates).
            z = max(-self.clip, min(self.clip, residual / self._sigma()))
            self._bias += _BIAS_RATE * (z - self._bias)
            self._calm = self._calm + 1 if trusted and abs(self._bias) <= _BIAS_READY else 0
            if self._lrs.settling:
                self._lrs.settle_step(self._calm >= _CALM_UPDATES)
            else:
                self._armed = self._n >= max(self.warmup, 2) and self._calm >= _CALM_UPDATES

    def _update_moments(self, residual: float, bound: float, trusted: bool) -> None:
        self._rcount += 1
        rate = max(self.scale_rate, 1.0 / self._rcount)
        r = min(max(residual, -bound), bound) if trusted else residual
        # Both factors of the lag-1 product are clipped alike, so each sample's influence is bounded
        # as in the variance: with the previous residual raw, one accepted value far below the
        # forecast (an easy batch) moved the covariance several times more than any clipped pair, and
        # on white noise rho reached 0.8-0.9, which widens the jump bar by sqrt(1 + rho) and slows the
        # drift sum by sqrt((1 + rho) / (1 - rho)).
        previous = None
        if self._last_residual is not None:
            last = min(max(self._last_residual, -bound), bound) if trusted else self._last_residual
            previous = last - self._rmean
        self._rmean += rate * (r - self._rmean)
        d = r - self._rmean
        sample = min(d * d, bound * bound) / self._kappa if trusted else d * d
        self._rvar = sample if self._rvar is None else self._rvar + rate * (sample - self._rvar)
        if previous is not None:
            self._rcov += rate * (d * previous - self._rcov)

    def _smooth(self, x: float) -> tuple[float, float, bool]:
        """Holt step of level and trend (residual clipped at ``clip`` sigmas once armed); returns
        (residual, clip bound, whether the scale has enough samples to clip its own update)."""
        assert self._level is not None
        forecast = self._level + self._trend
        residual = x - forecast
        # Clip only once armed: during warm-up (or re-warm-up after a shift) the forecast is still
        # converging, and clipping at a few sigmas would stop it from catching up with the curve.
        trusted = self._residuals >= MIN_SCALE_SAMPLES
        bound = self.clip * self._sigma()
        # Nor while the forecast settles onto a restarted schedule's curve (after its grace).
        clipped = min(max(residual, -bound), bound) if self._armed and not self._lrs.settling else residual
        new_level = forecast + self.level_rate * clipped
        self._trend += self.trend_rate * (new_level - self._level - self._trend)
        # A healthy loss does not climb fast for long; capping the rise the forecast follows makes a
        # slow explosion outrun the baseline instead of being absorbed into it.
        self._trend = min(self._trend, self.max_rise * self._sigma())
        self._level = new_level
        return residual, bound, trusted

    def _advance(self) -> None:
        """An update whose value is not used (flagged or non-finite): extrapolate along a decaying trend."""
        if self._level is not None:
            self._level += self._trend
            self._trend *= _GAP_TREND_DECAY

    def _gross(self, step: int, value: float, x: float) -> SpikeEvent | None:
        """The rule of the uncalibrated phase: far above the median of the recent accepted values."""
        assert self.gross_ratio is not None
        reference = median(self._window)
        margin = math.log(self.gross_ratio) if self.log_space else (self.gross_ratio - 1.0) * abs(reference)
        # ... and gross_z times the run's own noise: the ratio is a floor, the noise sets the bar on a
        # noisy metric (a low loss, a small batch), so the rule's false-alarm rate does not depend on
        # the loss's scale or noise level.
        margin = max(margin, self._noise_margin())
        excess = x - reference if self.direction == "up" else abs(x - reference)
        if not excess > margin or not self._material(value, reference):
            return None
        # Scored in sigmas when a noise estimate exists (informational: the rule does not use it).
        score = (x - reference) / self._sigma() if self._var is not None else math.inf
        return self._spike(step, value, x, reference, margin, score, "gross")

    def _noise_margin(self) -> float:
        """The gross rule's bar from the run's own noise: ``gross_z`` sigmas of it (window and learnt scale)."""
        noise, absolute = self._window_noise()
        if self._var is not None and self._residuals >= MIN_SCALE_SAMPLES:
            noise = max(noise, self._sigma())
        return max(self.gross_z * noise, self._abs_margin(self.gross_z / _WINDOW_NOISE_SHARE, absolute))

    def _start(self, step: int, value: float, x: float) -> SpikeEvent | None:
        """The rule of the first updates, before the gross rule judges: far above every accepted value."""
        assert self.start_ratio is not None
        reference = max(self._window)
        margin = math.log(self.start_ratio) if self.log_space else (self.start_ratio - 1.0) * abs(reference)
        if not x - reference > margin or not self._material(value, reference):
            return None
        return self._spike(step, value, x, reference, margin, math.inf, "gross")

    def progress_share(self, value: float) -> float | None:
        """The share of the run's progress that ``value`` undoes: its rise over the current baseline (the
        forecast, never below the lowest recent value) over the fall from the run's start (the median of
        its first 5 finite values) to that baseline. None before a baseline, or while the metric is not
        below its start. On the tasks of ``benchmarks/healthy_traces.py`` a corrupted batch undid 0.91 to
        3.0 of the progress, healthy batches at most 0.05 (memorisation), 0.29 (text) and 1.05 (batches
        of two short chunks)."""
        if self._level is None:
            return None
        floor = min(self._window) if self._window else -math.inf
        return self._share(value, self._to_value(max(self._level + self._trend, floor)))

    def _share(self, value: float, base: float) -> float | None:
        if len(self._first) < min(_FIRST_VALUES, self.gross_warmup):
            return None
        progress = median(self._first) - base
        return (value - base) / progress if progress > 0.0 else None

    def _material(self, value: float, reference: float) -> bool:
        """A rise to ``value`` from ``reference`` (transformed) undoes at least the share of the run's progress
        :meth:`_required_share` asks for; always True where none is asked for or the share is unknown."""
        required = self._required_share()
        if required is None:
            return True
        base = self._to_value(reference)
        share = self._share(value, base) if value > base else None  # a drop ("both") is not weighed
        return share is None or share >= required

    def _required_share(self) -> float | None:
        """``min_progress_share``, raised to ``noisy_progress_share`` while the run's relative noise is at
        least :data:`NOISY_RELATIVE_NOISE`; None where neither applies."""
        required = self.min_progress_share
        if self.noisy_progress_share is not None and self.relative_noise() >= NOISY_RELATIVE_NOISE:
            required = max(required or 0.0, self.noisy_progress_share)
        return required

    def relative_noise(self) -> float:
        """The run's measured noise per update relative to its level (0.05 = 5%): in log space the scale of
        the successive differences of the last values' logs, in linear space that of the values over the
        magnitude of the recent median; 0 before two values."""
        rel, _ = self._window_noise()
        if self.log_space:
            return rel
        level = abs(median(self._noise[-_GROSS_WINDOW - 1 : -1])) if len(self._noise) > 1 else 0.0
        return rel / level if level > 0.0 else 0.0

    def _window_noise(self) -> tuple[float, float]:
        """The run's measured noise, (relative, absolute), in the window before the value judged."""
        return window_noise(self._noise[-_NOISE_WINDOW - 1 : -1], self.log_space, _GROSS_WINDOW, self._rising)

    def _abs_margin(self, z: float, absolute: float) -> float:
        """The log-space rise of ``z`` absolute-noise sigmas above the level: log(1 + z * noise / level)
        (a rise of fixed size in the metric's units is a large log rise at a low level, a small one at
        a high level; linearising it would make the bar explode at a low level)."""
        return math.log1p(z * _WINDOW_NOISE_SHARE * absolute) if absolute > 0.0 else 0.0

    def _after_accept(self) -> None:
        """An accepted value: a short flagged episode just ended is held, and held values re-enter
        once _REENTRY_AFTER values in a row have been accepted (the flags were not a sustained change)."""
        if self._episode:
            if len(self._episode) <= _REENTRY_RUN:
                self._held.extend(self._episode)
                del self._held[:-RECENT_FLAGGED]
            self._episode = []
        self._clean += 1
        if self._held and self._clean >= _REENTRY_AFTER:
            held, self._held = self._held, []
            for residual in held:
                self._reenter(residual)

    def _reenter(self, residual: float) -> None:
        """Fold a flagged value's residual (from the forecast at its update) into level and scale, clipped."""
        if self._level is None or self._var is None:
            return
        bound = self.clip * self._sigma()
        r = min(max(residual, -bound), bound)
        self._level += self.level_rate * r
        trusted = self._residuals >= MIN_SCALE_SAMPLES
        sample = min(residual * residual, bound * bound) / self._kappa if trusted else residual * residual
        self._var += max(self.scale_rate, 1.0 / (self._residuals + 1)) * (sample - self._var)

    def _spike(
        self, step: int, value: float, x: float, forecast: float, margin: float, score: float, rule: str
    ) -> SpikeEvent:
        run, is_new = self._episodes.flag("spike")
        self._recent.append(x)
        del self._recent[:-RECENT_FLAGGED]
        if self._level is not None:
            self._episode.append(x - (self._level + self._trend))
            del self._episode[:-RECENT_FLAGGED]
        self._clean = 0
        # The re-baseline counts flags among the last 2 * rebaseline_after finite updates: 50 in a row
        # re-baseline, and so do 50 of 100 interleaved with accepted values (a shift whose
        # noise lets some values through would otherwise be flagged for ever).
        self._marks.append(self._seen)
        self._marks = [m for m in self._marks if m > self._seen - 2 * self.rebaseline_after]
        event = SpikeEvent(step=step, metric=self.metric, value=value, baseline=self._to_value(forecast),
                           threshold=self._to_value(forecast + margin), score=score, kind="spike", run_length=run,
                           is_new=is_new, rule=rule)
        self._advance()
        if run >= self.rebaseline_after or len(self._marks) >= self.rebaseline_after:
            self._rebaseline()
        return event

    def _restart(self) -> None:
        # A restart of the learning-rate schedule moves the loss and the gradient norm by design: they jump with
        # the learning rate (through its warm-up, if it has one) and then settle. What was learnt of the level and
        # trend does not forecast that; the noise does not change. So for the restart's grace the detector follows
        # the values instead of judging them (_follow) and the calibrated rules judge from the level they reached,
        # with the noise learnt before; a drift sum or flagged episode of the old cycle is dropped.
        self._window = []
        self._settling = 0
        self._forget_forecast()

    def _warmup_end(self) -> None:
        # The learning rate reached its peak after a warm-up: the trend and bias learnt while it rose do not
        # forecast what follows (a loss or norm that rose with it settles back). The level is re-seated on the
        # recent accepted values and the forecast settles as after a restart's grace.
        if self._window:
            self._level = median(self._window)
        self._settling = 0
        self._forget_forecast()
        self._lrs.start_settling()

    def _follow(self, step: int, value: float, x: float) -> SpikeEvent | None:
        """An update of a restart's grace: the level is the median of the values since the restart (one odd batch
        does not move it); a value above that median by the larger of _GRACE_RATIO and the gross rule's bar (its
        ratio, and its sigmas of the run's noise) is flagged (rule ``gross``) and kept out, and so is a value the
        start rule flags (against every value since the restart) that also clears the noise bar."""
        if self._window:
            reference = median(self._window)
            ratio = max(_GRACE_RATIO, self.gross_ratio or 1.0)
            margin = max(math.log(ratio) if self.log_space else (ratio - 1.0) * abs(reference), self._noise_margin())
            if x - reference > margin:
                return self._spike(step, value, x, reference, margin, math.inf, "gross")
            if self.start_ratio is not None and x - max(self._window) > self._noise_margin():
                event = self._start(step, value, x)
                if event is not None:
                    return event
        self._window.append(x)
        del self._window[:-_GROSS_WINDOW]
        self._level = median(self._window)
        self._episodes.clear()
        return None

    def _rebaseline(self) -> None:
        # A persistent shift, not a spike: re-seat the level on the recent values, drop the stale
        # trend, keep the noise scale, and warm up again (until the forecast is calibrated) so that
        # the transient of settling onto the new level cannot raise alerts of its own.
        # After flags interleaved with accepted values (the re-baseline by share) few flagged values
        # may be at hand: the latest accepted ones, which lie at the new level too, join them.
        recent = self._recent if len(self._recent) >= _GROSS_WINDOW else self._window[-_GROSS_WINDOW:] + self._recent
        self._level = median(recent)
        self._window = recent[-_GROSS_WINDOW:]  # the gross rule judges against the new level
        self._armed = False
        self._forget_forecast()

    def _forget_forecast(self) -> None:
        # what a restart's grace and a re-baseline both start afresh: the trend, the residual memory and
        # the forecast's bias, and the recent values, episodes and held flags judged against the old level
        self._trend = 0.0
        self._last_residual = None
        self._cusum = 0.0
        self._bias = 0.0
        self._calm = 0
        self._recent.clear()
        self._episodes.clear()
        self._marks = []
        self._episode = []
        self._held = []
        self._clean = 0

    def _nonfinite(self, step: int, value: float) -> SpikeEvent:
        run, is_new = self._episodes.flag("nonfinite")
        if self._level is None:
            baseline = threshold = math.nan
        else:
            forecast = self._level + self._trend
            baseline = self._to_value(forecast)
            threshold = self._to_value(forecast + self._margin(forecast, self._sigma()))
        self._advance()
        return SpikeEvent(step=step, metric=self.metric, value=value, baseline=baseline, threshold=threshold,
                          score=math.inf, kind="nonfinite", run_length=run, is_new=is_new, rule="nonfinite")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"SpikeDetector({args})"


def _floats(keep: slice) -> Callable[[Any], list[float]]:
    return lambda values: [float(v) for v in values][keep]


# The state besides the episode count: each key is the attribute "_" + key, read back by the function beside
# it (lists cut to what the detector keeps).
_STATE: dict[str, Callable[[Any], Any]] = {
    "n": int, "armed": bool, "bias": float, "calm": int, "cusum": float, "settling": int,
    "level": optional_float, "trend": float, "var": optional_float, "residuals": int,
    "last_residual": optional_float, "recent": _floats(slice(None)),
    "window": _floats(slice(-_GROSS_WINDOW, None)), "rmean": float, "rvar": optional_float, "rcov": float,
    "rcount": int, "seen": int, "marks": lambda values: [int(v) for v in values],
    "episode": _floats(slice(-RECENT_FLAGGED, None)), "held": _floats(slice(-RECENT_FLAGGED, None)),
    "noise": _floats(slice(-_NOISE_WINDOW - 1, None)), "clean": int, "first": _floats(slice(None, _FIRST_VALUES)),
}
# The settings state_dict()'s "config" reports: the constructor's arguments, each an attribute of that name.
_CONFIG = tuple(inspect.signature(SpikeDetector).parameters)
