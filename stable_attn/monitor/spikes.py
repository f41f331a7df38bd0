"""Online anomaly detectors for training metrics: loss / gradient-norm spikes and attention-stat surges.

Both detectors take one scalar per update, cost O(1) pure-Python arithmetic (no torch, no buffers that
grow), and keep their whole state in a few plain floats and ints, so :meth:`state_dict` survives
``torch.save``, ``torch.load(weights_only=True)`` and JSON unchanged.

Common API::

    det = SpikeDetector("train/loss")
    event = det.update(step, loss)          # SpikeEvent | None
    if event is not None and event.is_new:  # first step of an anomalous episode
        ...                                 # alert; act on every event if skipping steps

Every anomalous update returns an event (so a caller that skips bad steps can skip each one);
``event.is_new`` marks the first update of an episode (or a change of kind, e.g. a spike that turns
into NaN), which is where a caller alerts once instead of on every step of a long spike.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["EventKind", "SpikeDetector", "SpikeEvent", "SurgeDetector"]

_logger = logging.getLogger("stable_attn")

EventKind = Literal["spike", "nonfinite", "early_warning"]

# Residual samples needed before the robust scale is trusted enough to clip with it.
_MIN_SCALE_SAMPLES = 8
# While an update is skipped (flagged or non-finite) the trend is extrapolated with this per-update
# decay, so a long anomaly cannot drag the forecast far along a stale slope (total drift <= ~19 slopes).
_GAP_TREND_DECAY = 0.95
# Flagged values kept to re-seat the level after a persistent shift (median of these).
_RECENT_FLAGGED = 8
# Values at or below zero have no logarithm; they are floored here (a huge downward outlier, which
# the clipped update absorbs) and a warning says once that log_space=False suits such a metric.
_LOG_FLOOR = 1e-30
_SCALE_EPS = 1e-12
# Warm-up also waits until an EMA (rate _BIAS_RATE) of clipped standardized residuals is within
# _BIAS_READY of zero; on clean Gaussian noise that EMA has a standard deviation of about 0.16.
_BIAS_RATE = 0.05
_BIAS_READY = 0.5
_CALM_UPDATES = 20
# After a jump the drift sum waits until this many residuals in a row are back below drift_slack.
_SETTLE_UPDATES = 5
_STATE_VERSION = 1


def _huber_consistency(c: float) -> float:
    """E[min(Z^2, c^2)] for Z ~ N(0, 1): divides the clipped squared residual so that the robust
    variance estimate equals the ordinary variance on Gaussian noise."""
    phi = math.exp(-0.5 * c * c) / math.sqrt(2.0 * math.pi)
    tail = math.erfc(c / math.sqrt(2.0))  # P(|Z| > c)
    return (1.0 - tail) - 2.0 * c * phi + c * c * tail


@dataclass(frozen=True)
class SpikeEvent:
    """One anomalous update reported by a detector.

    Attributes:
        step: the step passed to ``update``.
        metric: the detector's metric name (e.g. ``"train/loss"``).
        value: the observed value, as given (may be NaN/inf for ``kind="nonfinite"``).
        baseline: the value the detector expected at this step, in the metric's units
            (NaN if the detector had no estimate yet).
        threshold: the value above which this update counts as anomalous, in the metric's units
            (NaN if none was defined yet, e.g. a NaN during the first updates).
        score: how far above the baseline the value lies in robust standard deviations of the
            recent noise (``inf`` for non-finite values).
        kind: ``"spike"`` (SpikeDetector), ``"early_warning"`` (SurgeDetector) or ``"nonfinite"``.
        run_length: consecutive anomalous updates up to and including this one.
        is_new: True on the first update of an anomalous episode, or when the kind changed since
            the previous anomalous update; alert on these, act (e.g. skip) on every event.
        rule: which rule fired: ``"jump"`` (this value alone is far above the forecast),
            ``"drift"`` (a sustained rise, see :class:`SpikeDetector`), ``"surge"``
            (:class:`SurgeDetector`) or ``"nonfinite"``.
    """

    step: int
    metric: str
    value: float
    baseline: float
    threshold: float
    score: float
    kind: EventKind
    run_length: int = 1
    is_new: bool = True
    rule: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (floats may be non-finite)."""
        return asdict(self)


def _update_scale(
    var: float | None,
    count: int,
    residual: float,
    last_residual: float | None,
    bound: float,
    trusted: bool,
    rate: float,
    kappa: float,
) -> tuple[float | None, int]:
    """One step of the robust noise variance; returns (variance, samples folded in).

    The sample is half the squared difference of successive residuals: a persistent bias (a drift,
    or a slow explosion the level is chasing) cancels in it, so it cannot inflate the scale and
    widen its own threshold, while noise that grows shows up at once. Once ``trusted`` it is clipped
    at ``bound`` (Huber's rho) and divided by ``kappa`` to stay unbiased on Gaussian noise. Early
    on, all samples are averaged equally (rate 1/k) so the scale is usable after a few steps.
    """
    if last_residual is None:
        if var is not None:  # first residual after a re-baseline: no difference to take yet
            return var, count
        sample = residual * residual
    else:
        sample = 0.5 * (residual - last_residual) ** 2
    if trusted:
        sample = min(sample, bound * bound) / kappa
    count += 1
    if var is None:
        return sample, count
    return var + max(rate, 1.0 / count) * (sample - var), count


def _as_float(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number (float, int or 1-element tensor), got {value!r}") from None


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    value = _as_float(name, value)
    ok = value >= 0 if allow_zero else value > 0
    if not (ok and math.isfinite(value)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return value


def _check_rate(name: str, value: float) -> float:
    value = _as_float(name, value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
    return value


def _check_count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return value


class _Episodes:
    """Counts consecutive anomalous updates and says which event starts an episode."""

    def __init__(self) -> None:
        self.run = 0
        self.last_kind: str | None = None

    def flag(self, kind: str) -> tuple[int, bool]:
        self.run += 1
        is_new = self.run == 1 or kind != self.last_kind
        self.last_kind = kind
        return self.run, is_new

    def clear(self) -> None:
        self.run = 0
        self.last_kind = None


class SpikeDetector:
    """Online spike detector for training loss or gradient norm.

    Each update forecasts the next value from a local level and trend and measures the residual in
    robust standard deviations (sigmas) of the recent noise. Two rules flag a value:

    - **jump**: the residual exceeds ``z_threshold`` sigmas and ``min_rel_change`` of the baseline
      (a corrupted batch, a loss spike, the first steps of a fast explosion);
    - **drift**: a one-sided CUSUM of the standardized residuals (each clipped at ``clip``, less
      ``drift_slack``) exceeds ``drift_threshold``: the value sits a sigma or so above the forecast
      for many steps in a row, as in a slow divergence that no single step reveals. The sum restarts
      after it fires, so a continuing rise alerts again every few steps, and it is held at zero
      after a jump until the residuals are back near zero (a spike's decaying tail is not a drift).

    Non-finite values are always flagged (``kind="nonfinite"``), also during warm-up.

    Why this design:

    - **Log space** (default): loss and gradient norm are positive, decay roughly multiplicatively
      (a power law is smooth in log space), their noise grows with their level, and spikes are
      multiplicative. In log space one threshold in sigmas fits the whole run.
    - **Level + trend forecast** (Holt's linear exponential smoothing): a running mean over a
      falling curve lags above it (spikes hide under the lag) and over a rising one lags below it
      (false alarms). The trend term removes that lag. The trend may fall freely but may rise by at
      most ``max_rise`` sigmas per update: a healthy loss does not climb fast for long, and without
      the cap the forecast would follow a slow explosion all the way up.
    - **Robust noise scale that a drift cannot inflate**: the variance is an exponential moving
      average of squared differences of successive residuals, clipped at ``clip`` sigmas (Huber's
      rho, scaled to be unbiased on Gaussian noise, as in the robust exponential smoothing of
      Gelper, Fried and Croux, 2010). A persistent bias cancels in the differences, so a slow
      divergence cannot widen its own threshold, while noise that grows or shrinks over the run is
      followed within ``~1/scale_rate`` updates and one hard batch moves it by a bounded amount.
      (Strongly autocorrelated noise would make this scale read low.)
    - **No poisoning**: a flagged value never enters level, trend or scale (the forecast just
      advances along a decaying trend), and each accepted residual is clipped at ``clip`` sigmas,
      so a hard batch just below the threshold moves the baseline by at most
      ``level_rate * clip`` sigmas.
    - **Calibrated warm-up**: no rule fires before ``warmup`` finite updates, nor before the
      forecast is unbiased (an average of recent standardized residuals within 0.5 for 20 updates
      in a row): in the steep first descent of a loss the trend is still catching up, and a
      forecast below the curve would flag every step. During warm-up residuals are not clipped, so
      the forecast can catch up.
    - **Re-baselining**: ``rebaseline_after`` consecutive flagged updates are a level shift, not a
      spike: the level is re-seated at the median of the recent values, the trend dropped, and the
      detector warms up again (calibration only), instead of flagging every later value.
    - **Why not median/MAD over a window**: O(window) per step, it lags a trend by half a window
      (false alarms whenever the metric rises), and its state is the whole window. Here the state
      is a dozen numbers and an update is a few floating-point operations.
    - **Relative floor** ``min_rel_change``: a rise smaller than 1% of the loss is never actionable,
      and it keeps a very smooth curve (noise near zero) from flagging rounding-level wiggles.

    On synthetic LM loss traces (``benchmarks/spike_detection.py``) the defaults flag spikes of
    8 sigma and more within 2 steps of onset with about 0.05 false alarms per 10,000 clean steps,
    single hard batches of 2-4 sigma included. Defaults suit a loss fed once per optimizer step;
    the time constants count updates, not steps, so feeding every N steps makes them N times
    longer. Steps are labels only (they need not be consecutive or increasing, e.g. after a
    rollback). For a metric that legitimately trends up for long stretches, raise ``max_rise`` or
    set ``drift_threshold=None``.

    Args:
        metric: name carried by events (e.g. ``"train/loss"``, ``"train/grad_norm"``).
        z_threshold: robust sigmas above the forecast that make a jump.
        min_rel_change: the smallest relative rise over the baseline that can be a jump
            (0.01 = 1%); in linear space, relative to ``|baseline|``.
        warmup: finite updates that only train the estimates; no rule fires before (non-finite
            values still do).
        level_rate: smoothing rate of the level (larger follows faster, noisier baseline).
        trend_rate: smoothing rate of the trend (Holt's beta, applied to level changes).
        scale_rate: smoothing rate of the robust noise variance.
        clip: residuals are clipped at this many sigmas before they update level and scale, and
            before they enter the drift sum.
        rebaseline_after: consecutive flagged finite updates after which the level is re-seated.
        max_rise: largest upward trend the forecast follows, in sigmas per update.
        drift_threshold: CUSUM level (in sigmas) at which the drift rule fires; None disables it.
        drift_slack: sigmas subtracted from each residual in the drift sum (ignore smaller biases).
        direction: ``"up"`` flags rises only (losses, norms); ``"both"`` also flags drops by the
            jump rule (the drift rule watches rises only).
        log_space: detect on ``log(value)`` (for positive metrics); False for metrics that can be
            zero or negative.
    """

    def __init__(
        self,
        metric: str = "train/loss",
        *,
        z_threshold: float = 6.0,
        min_rel_change: float = 0.01,
        warmup: int = 100,
        level_rate: float = 0.1,
        trend_rate: float = 0.1,
        scale_rate: float = 0.03,
        clip: float = 2.0,
        rebaseline_after: int = 50,
        max_rise: float = 0.02,
        drift_threshold: float | None = 12.0,
        drift_slack: float = 0.5,
        direction: Literal["up", "both"] = "up",
        log_space: bool = True,
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise TypeError(f"metric must be a non-empty str, got {metric!r}")
        if direction not in ("up", "both"):
            raise ValueError(f"direction must be 'up' or 'both', got {direction!r}")
        if not isinstance(log_space, bool):
            raise TypeError(f"log_space must be a bool, got {log_space!r}")
        self.metric = metric
        self.z_threshold = _check_positive("z_threshold", z_threshold)
        self.min_rel_change = _check_positive("min_rel_change", min_rel_change, allow_zero=True)
        self.warmup = _check_count("warmup", warmup, 0)
        self.level_rate = _check_rate("level_rate", level_rate)
        self.trend_rate = _check_rate("trend_rate", trend_rate)
        self.scale_rate = _check_rate("scale_rate", scale_rate)
        self.clip = _check_positive("clip", clip)
        self.rebaseline_after = _check_count("rebaseline_after", rebaseline_after, 1)
        self.max_rise = _check_positive("max_rise", max_rise, allow_zero=True)
        self.drift_threshold = None if drift_threshold is None else _check_positive("drift_threshold", drift_threshold)
        self.drift_slack = _check_positive("drift_slack", drift_slack, allow_zero=True)
        self.direction = direction
        self.log_space = log_space
        self._kappa = _huber_consistency(self.clip)
        # The smallest margin a jump must clear in log space (see _sigma for why it also floors the scale).
        self._min_margin = math.log1p(self.min_rel_change) if log_space else 0.0
        self._warned_nonpositive = False
        self.reset()

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
        self._episodes = _Episodes()
        self._recent: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (ints, floats, str, None, lists) for checkpoints; config under ``"config"``
        is informational: :meth:`load_state_dict` keeps the constructor's settings."""
        return {
            "version": _STATE_VERSION,
            "type": "SpikeDetector",
            "config": self._config(),
            "n": self._n,
            "armed": self._armed,
            "bias": self._bias,
            "calm": self._calm,
            "cusum": self._cusum,
            "settling": self._settling,
            "level": self._level,
            "trend": self._trend,
            "var": self._var,
            "residuals": self._residuals,
            "last_residual": self._last_residual,
            "run": self._episodes.run,
            "last_kind": self._episodes.last_kind,
            "recent": list(self._recent),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (e.g. on resume)."""
        _check_state(state, "SpikeDetector", tuple(self.state_dict()))
        self._n = int(state["n"])
        self._armed = bool(state["armed"])
        self._bias = float(state["bias"])
        self._calm = int(state["calm"])
        self._cusum = float(state["cusum"])
        self._settling = int(state["settling"])
        self._level = None if state["level"] is None else float(state["level"])
        self._trend = float(state["trend"])
        self._var = None if state["var"] is None else float(state["var"])
        self._residuals = int(state["residuals"])
        self._last_residual = None if state["last_residual"] is None else float(state["last_residual"])
        self._episodes.run = int(state["run"])
        self._episodes.last_kind = state["last_kind"]
        self._recent = [float(v) for v in state["recent"]]

    def _config(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "z_threshold": self.z_threshold,
            "min_rel_change": self.min_rel_change,
            "warmup": self.warmup,
            "level_rate": self.level_rate,
            "trend_rate": self.trend_rate,
            "scale_rate": self.scale_rate,
            "clip": self.clip,
            "rebaseline_after": self.rebaseline_after,
            "max_rise": self.max_rise,
            "drift_threshold": self.drift_threshold,
            "drift_slack": self.drift_slack,
            "direction": self.direction,
            "log_space": self.log_space,
        }

    # ------------------------------------------------------------ properties
    @property
    def ready(self) -> bool:
        """True once warm-up is over and spikes can fire."""
        return self._armed

    @property
    def baseline(self) -> float | None:
        """The forecast for the next update in the metric's units (None before the first value)."""
        if self._level is None:
            return None
        return self._to_value(self._level + self._trend)

    # ---------------------------------------------------------------- update
    def update(self, step: int, value: float) -> SpikeEvent | None:
        """Feed one observation; return a :class:`SpikeEvent` if it is anomalous, else None.

        A flagged value does not enter the estimates. ``value`` may be a float, an int or anything
        ``float()`` accepts (a 1-element tensor); ``step`` is only carried into the event.
        """
        value = _as_float("value", value)
        step = int(step)
        if not math.isfinite(value):
            return self._nonfinite(step, value)
        x = self._transform(value)
        if self._level is None:
            self._accept(x)
            self._episodes.clear()
            return None

        forecast = self._level + self._trend
        sigma = self._sigma()
        margin = self._margin(forecast, sigma)
        residual = x - forecast
        excess = residual if self.direction == "up" else abs(residual)
        if self.ready:
            z = residual / sigma
            if excess > margin:
                # The decaying tail of this spike will sit above the forecast for a while; it must
                # not add up to a second, "drift" alert for the same incident.
                self._settling = _SETTLE_UPDATES
                self._cusum = 0.0
                return self._spike(step, value, x, forecast, margin, z, "jump")
            if self._settling:
                # Settled once the residual has been back near zero for a few updates in a row
                # (one lucky noise draw inside a long tail is not enough).
                self._settling = self._settling - 1 if z <= self.drift_slack else _SETTLE_UPDATES
            if self.drift_threshold is not None and not self._settling:
                # One-sided CUSUM of clipped standardized residuals: a rise that stays a sigma or so
                # above the forecast for tens of steps (a slow divergence the level would otherwise
                # follow) accumulates here although no single value is a jump. Jump-flagged values
                # are left out, so a long spike does not leave a drift alarm behind it.
                self._cusum = max(0.0, self._cusum + min(z, self.clip) - self.drift_slack)
                if self._cusum > self.drift_threshold:
                    # Restart the sum (standard CUSUM practice): a rise that goes on alerts again
                    # every few steps, and a drift that stops leaves no trail of alarms.
                    self._cusum = 0.0
                    return self._spike(step, value, x, forecast, margin, z, "drift")
        self._accept(x)
        self._episodes.clear()
        return None

    # --------------------------------------------------------------- helpers
    def _transform(self, value: float) -> float:
        if not self.log_space:
            return value
        if value <= 0.0:
            if not self._warned_nonpositive:
                self._warned_nonpositive = True
                _logger.warning(
                    "SpikeDetector(%r) got %r <= 0 in log space; it is treated as a tiny positive value. "
                    "Use log_space=False for metrics that can be zero or negative.",
                    self.metric,
                    value,
                )
            value = _LOG_FLOOR
        return math.log(value)

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
        return max(math.sqrt(self._var), floor)

    def _margin(self, forecast: float, sigma: float) -> float:
        if self.log_space:
            floor = self._min_margin
        else:
            floor = self.min_rel_change * abs(forecast)
        return max(self.z_threshold * sigma, floor)

    def _accept(self, x: float) -> None:
        """Fold a finite, unflagged value into level, trend and scale (Holt + robust variance)."""
        self._n += 1
        self._recent.clear()
        if self._level is None:
            self._level = x
            return
        residual, bound, trusted = self._smooth(x)
        # The noise scale comes from differences of successive residuals: a persistent bias (a drift
        # or a slow explosion the level is chasing) cancels in them, so it cannot inflate the scale
        # and widen its own threshold, while noise that grows shows up at once.
        self._var, self._residuals = _update_scale(
            self._var, self._residuals, residual, self._last_residual, bound, trusted, self.scale_rate, self._kappa
        )
        self._last_residual = residual
        if not self._armed:
            # Warm-up ends after `warmup` values and once the forecast is unbiased: in the steep first
            # descent of a loss the trend is still catching up, and a forecast that runs below the
            # curve would flag every step. The bias EMA passes through zero while an oscillating
            # trend settles, so it must stay small for _CALM_UPDATES updates in a row. Once armed,
            # only a re-baseline disarms: a later bias is what a slow explosion looks like.
            z = max(-self.clip, min(self.clip, residual / self._sigma()))
            self._bias += _BIAS_RATE * (z - self._bias)
            self._calm = self._calm + 1 if trusted and abs(self._bias) <= _BIAS_READY else 0
            self._armed = self._n >= max(self.warmup, 2) and self._calm >= _CALM_UPDATES

    def _smooth(self, x: float) -> tuple[float, float, bool]:
        """Holt step of level and trend (residual clipped at ``clip`` sigmas once armed); returns
        (residual, clip bound, whether the scale has enough samples to clip its own update)."""
        assert self._level is not None
        forecast = self._level + self._trend
        residual = x - forecast
        # Clip only once armed: during warm-up (or re-warm-up after a shift) the forecast is still
        # converging, and clipping at a few sigmas would stop it from catching up with the curve.
        trusted = self._residuals >= _MIN_SCALE_SAMPLES
        bound = self.clip * self._sigma()
        clipped = min(max(residual, -bound), bound) if self._armed else residual
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

    def _spike(
        self, step: int, value: float, x: float, forecast: float, margin: float, score: float, rule: str
    ) -> SpikeEvent:
        run, is_new = self._episodes.flag("spike")
        self._recent.append(x)
        del self._recent[:-_RECENT_FLAGGED]
        event = SpikeEvent(
            step=step,
            metric=self.metric,
            value=value,
            baseline=self._to_value(forecast),
            threshold=self._to_value(forecast + margin),
            score=score,
            kind="spike",
            run_length=run,
            is_new=is_new,
            rule=rule,
        )
        self._advance()
        if run >= self.rebaseline_after:
            self._rebaseline()
        return event

    def _rebaseline(self) -> None:
        # A persistent shift, not a spike: re-seat the level on the recent values, drop the stale
        # trend, keep the noise scale, and warm up again (until the forecast is calibrated) so that
        # the transient of settling onto the new level cannot raise alerts of its own.
        ordered = sorted(self._recent)
        mid = len(ordered) // 2
        self._level = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
        self._trend = 0.0
        self._last_residual = None
        self._cusum = 0.0
        self._armed = False
        self._bias = 0.0
        self._calm = 0
        self._recent.clear()
        self._episodes.clear()

    def _nonfinite(self, step: int, value: float) -> SpikeEvent:
        run, is_new = self._episodes.flag("nonfinite")
        if self._level is None:
            baseline = threshold = math.nan
        else:
            forecast = self._level + self._trend
            baseline = self._to_value(forecast)
            threshold = self._to_value(forecast + self._margin(forecast, self._sigma()))
        self._advance()
        return SpikeEvent(
            step=step,
            metric=self.metric,
            value=value,
            baseline=baseline,
            threshold=threshold,
            score=math.inf,
            kind="nonfinite",
            run_length=run,
            is_new=is_new,
            rule="nonfinite",
        )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"SpikeDetector({args})"


class SurgeDetector:
    """Early warning when a per-layer attention statistic rises well above its own recent baseline.

    Meant for saturation rate (fraction of rows with tied maxima), fixed-block rate, or max logit,
    per layer, typically fed every logging interval. The baseline is an exponential moving average
    of accepted values (no trend: a steady climb is itself worth a warning once it outruns the
    average); the noise scale is the same robust clipped-residual variance as in
    :class:`SpikeDetector`. A value fires (``kind="early_warning"``) when it exceeds the baseline by
    all of:

    - ``min_delta`` in absolute units: the floor that keeps noise near zero (a saturation rate
      wandering between 0.000 and 0.003) from ever firing, however small its own scale is;
    - ``ratio``: value >= ratio * baseline (for a positive baseline), i.e. a relative surge;
    - ``z_threshold`` robust sigmas of the recent noise, so a noisy statistic needs a bigger jump.

    NaN and ``+inf`` fire ``kind="nonfinite"``; ``-inf`` means "no observation" (an
    ``AttentionStats.max_logit`` that saw no rows) and is ignored. Flagged values do not enter the
    baseline; after ``rebaseline_after`` consecutive flagged updates the new level is accepted.
    Use :meth:`saturation` or :meth:`max_logit` for defaults per statistic.

    Args:
        metric: name carried by events (e.g. ``"stable_attn/saturation/layer3"``).
        min_delta: absolute rise over the baseline below which nothing fires (required: its scale
            depends on the statistic).
        ratio: relative rise over a positive baseline needed to fire (>= 1).
        z_threshold: robust sigmas of rise needed to fire.
        warmup: finite updates before anything but non-finite values can fire.
        rate: smoothing rate of the baseline.
        scale_rate: smoothing rate of the robust noise variance.
        clip: residuals are clipped at this many sigmas before they update baseline and scale.
        rebaseline_after: consecutive flagged updates after which the new level is accepted.
    """

    def __init__(
        self,
        metric: str,
        *,
        min_delta: float,
        ratio: float = 1.5,
        z_threshold: float = 6.0,
        warmup: int = 10,
        rate: float = 0.05,
        scale_rate: float = 0.05,
        clip: float = 2.0,
        rebaseline_after: int = 20,
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise TypeError(f"metric must be a non-empty str, got {metric!r}")
        self.metric = metric
        self.min_delta = _check_positive("min_delta", min_delta)
        self.ratio = _as_float("ratio", ratio)
        if not (self.ratio >= 1.0 and math.isfinite(self.ratio)):
            raise ValueError(f"ratio must be a finite number >= 1, got {ratio!r}")
        self.z_threshold = _check_positive("z_threshold", z_threshold)
        self.warmup = _check_count("warmup", warmup, 0)
        self.rate = _check_rate("rate", rate)
        self.scale_rate = _check_rate("scale_rate", scale_rate)
        self.clip = _check_positive("clip", clip)
        self.rebaseline_after = _check_count("rebaseline_after", rebaseline_after, 1)
        self._kappa = _huber_consistency(self.clip)
        self.reset()

    @classmethod
    def saturation(cls, metric: str = "stable_attn/saturation", **kwargs: Any) -> SurgeDetector:
        """Defaults for a saturation or fixed-block rate in [0, 1]: fire on a rise of at least
        5 percentage points that also doubles the baseline."""
        kwargs.setdefault("min_delta", 0.05)
        kwargs.setdefault("ratio", 2.0)
        return cls(metric, **kwargs)

    @classmethod
    def max_logit(cls, metric: str = "stable_attn/max_logit", **kwargs: Any) -> SurgeDetector:
        """Defaults for a max attention logit (scaled score, typically 5-30): fire on a rise of at
        least 5 logit units and 25% over the baseline."""
        kwargs.setdefault("min_delta", 5.0)
        kwargs.setdefault("ratio", 1.25)
        return cls(metric, **kwargs)

    def reset(self) -> None:
        """Forget everything learnt (as freshly constructed)."""
        self._n = 0
        self._level: float | None = None
        self._var: float | None = None
        self._residuals = 0
        self._last_residual: float | None = None
        self._episodes = _Episodes()
        self._recent: list[float] = []

    @property
    def ready(self) -> bool:
        """True once warm-up is over and surges can fire."""
        return self._n >= max(self.warmup, 1)

    @property
    def baseline(self) -> float | None:
        """The current baseline (None before the first value)."""
        return self._level

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state for checkpoints (see :meth:`SpikeDetector.state_dict`)."""
        return {
            "version": _STATE_VERSION,
            "type": "SurgeDetector",
            "config": {
                "metric": self.metric,
                "min_delta": self.min_delta,
                "ratio": self.ratio,
                "z_threshold": self.z_threshold,
                "warmup": self.warmup,
                "rate": self.rate,
                "scale_rate": self.scale_rate,
                "clip": self.clip,
                "rebaseline_after": self.rebaseline_after,
            },
            "n": self._n,
            "level": self._level,
            "var": self._var,
            "residuals": self._residuals,
            "last_residual": self._last_residual,
            "run": self._episodes.run,
            "last_kind": self._episodes.last_kind,
            "recent": list(self._recent),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        _check_state(state, "SurgeDetector", tuple(self.state_dict()))
        self._n = int(state["n"])
        self._level = None if state["level"] is None else float(state["level"])
        self._var = None if state["var"] is None else float(state["var"])
        self._residuals = int(state["residuals"])
        self._last_residual = None if state["last_residual"] is None else float(state["last_residual"])
        self._episodes.run = int(state["run"])
        self._episodes.last_kind = state["last_kind"]
        self._recent = [float(v) for v in state["recent"]]

    def update(self, step: int, value: float) -> SpikeEvent | None:
        """Feed one observation; return an event on a surge or a non-finite value, else None."""
        value = _as_float("value", value)
        step = int(step)
        if value == -math.inf:
            return None
        if not math.isfinite(value):
            run, is_new = self._episodes.flag("nonfinite")
            baseline = math.nan if self._level is None else self._level
            threshold = math.nan if self._level is None else self._level + self._margin(self._level)
            return SpikeEvent(
                step, self.metric, value, baseline, threshold, math.inf, "nonfinite", run, is_new, "nonfinite"
            )
        if self._level is None:
            self._accept(value)
            return None
        margin = self._margin(self._level)
        rise = value - self._level
        if self.ready and rise > margin:
            run, is_new = self._episodes.flag("early_warning")
            self._recent.append(value)
            del self._recent[:-_RECENT_FLAGGED]
            event = SpikeEvent(
                step=step,
                metric=self.metric,
                value=value,
                baseline=self._level,
                threshold=self._level + margin,
                score=rise / self._sigma(),
                kind="early_warning",
                run_length=run,
                is_new=is_new,
                rule="surge",
            )
            if run >= self.rebaseline_after:
                ordered = sorted(self._recent)
                self._level = ordered[len(ordered) // 2]
                self._last_residual = None
                self._recent.clear()
                self._episodes.clear()
            return event
        self._accept(value)
        return None

    def _sigma(self) -> float:
        floor = self.min_delta / self.z_threshold
        return floor if self._var is None else max(math.sqrt(self._var), floor)

    def _margin(self, level: float) -> float:
        return max(self.min_delta, self.z_threshold * self._sigma(), (self.ratio - 1.0) * level)

    def _accept(self, value: float) -> None:
        self._n += 1
        self._episodes.clear()
        self._recent.clear()
        if self._level is None:
            self._level = value
            return
        residual = value - self._level
        trusted = self._residuals >= _MIN_SCALE_SAMPLES
        bound = self.clip * self._sigma()
        clipped = min(max(residual, -bound), bound) if self.ready else residual
        self._level += self.rate * clipped
        self._var, self._residuals = _update_scale(
            self._var, self._residuals, residual, self._last_residual, bound, trusted, self.scale_rate, self._kappa
        )
        self._last_residual = residual

    def __repr__(self) -> str:
        return (
            f"SurgeDetector({self.metric!r}, min_delta={self.min_delta!r}, ratio={self.ratio!r}, "
            f"z_threshold={self.z_threshold!r}, warmup={self.warmup!r})"
        )


def _check_state(state: Mapping[str, Any], kind: str, keys: tuple[str, ...]) -> None:
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping from {kind}.state_dict(), got {type(state).__name__}")
    if state.get("type", kind) != kind:
        raise ValueError(f"state is a {state.get('type')!r} state, expected one from {kind}.state_dict()")
    if state.get("version") != _STATE_VERSION:
        raise ValueError(f"state version {state.get('version')!r} is not supported (expected {_STATE_VERSION})")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"state is missing keys {missing}; pass the dict returned by {kind}.state_dict()")
