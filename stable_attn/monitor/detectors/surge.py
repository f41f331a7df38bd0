"""Early warnings on per-layer attention statistics: :class:`SurgeDetector`.

Like :class:`~stable_attn.monitor.detectors.spikes.SpikeDetector` it takes one scalar per update (and, optionally,
that step's training loss), costs O(1) pure-Python arithmetic and keeps its state in plain floats, ints
and short lists; it returns a :class:`~stable_attn.monitor.detectors.events.SpikeEvent` for every anomalous
update, ``is_new`` on the first of an episode. Its noise scale is the robust one of
:mod:`stable_attn.monitor.detectors.robust`.

The rules (``event.rule``) and when each is active, with the defaults (docs/DETECTORS.md has the
measurements behind every number):

- ``"nonfinite"``: NaN or +inf, from the first update on (``-inf`` means "no observation").
- ``"surge"`` (``kind="early_warning"``): after 10 updates, and, when the
  caller passes the loss, after 50 losses: the statistic is above an absolute floor, well above its
  own baseline, and the loss has stopped improving.
- ``"level"`` (``kind="early_warning"``): after 10 updates, a value at or
  above ``alarm_level`` (max logit: 1000), whatever the loss does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .events import SpikeEvent
from .robust import (
    MIN_SCALE_SAMPLES,
    EarlyWarning,
    LossProgress,
    as_float,
    check_count,
    check_metric,
    check_positive,
    check_rate,
    huber_consistency,
    optional_float,
    update_scale,
)

__all__ = ["SurgeDetector"]


class SurgeDetector(EarlyWarning):
    """Early warning when a per-layer attention statistic grows well above its own recent baseline
    while the loss has stopped improving.

    Meant for max attention logit, saturation rate (fraction of rows with tied maxima) or
    fixed-block rate, per layer, fed on the steps the caller monitors, together with that step's
    training loss. The baseline is an exponential moving average of accepted values (no trend: a
    steady climb is itself worth a warning once it outruns the average); the noise scale is the same
    robust clipped-residual variance as in :class:`~stable_attn.monitor.detectors.spikes.SpikeDetector`. A value fires
    (``kind="early_warning"``, ``rule="surge"``) when all of these hold:

    - **absolute level**: the value is at least ``min_level`` (a max logit of 7, a saturation of 1%
      is where a healthy model lives, whatever it rose from);
    - **rise**: it exceeds the baseline by ``min_delta`` (absolute units: the floor that keeps a
      statistic wandering near zero from firing), by ``ratio`` (value >= ratio * baseline) and by
      ``z_threshold`` robust sigmas of its recent noise (a noisy statistic needs a bigger jump);
    - **no progress**: when a ``loss`` is passed to :meth:`update`, the loss has not improved: its
      fast average (rate ``loss_fast_rate``) is not below its slow average (rate ``loss_slow_rate``)
      by more than ``min_improvement`` (relative). Attention logits and saturation grow while a model
      learns (sharper attention is what learning looks like); growth that goes on while the loss has
      stalled or turned up is what precedes the attention-logit divergence of Wortsman et al. (2023).
      Progress counts as unknown, and the detector stays silent, until ``1 / loss_slow_rate``
      losses were seen. Without a loss the first two conditions decide alone.

    A second rule (``rule="level"``) fires on any value at or above ``alarm_level``, whatever the
    loss does: a level no healthy run measured reached (for the max logit, 1000: softmax is one-hot
    in every float format, and a BF16 score there is only resolved to steps of 4 or 8).

    Why these defaults (``benchmarks/instability.py`` and the runs in docs/DETECTORS.md, tiny GPTs on
    CPU): in runs that trained well the max logit rose from ~2 to 23-84 while the loss fell; in runs
    that diverged it passed 1000 by step ~30 and reached 10^8 while the loss stalled, and the loss
    exploded 100-200 steps later.

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
        min_level: values below this never fire (absolute units; default: no floor).
        alarm_level: values at or above this fire (``rule="level"``) whatever the loss and the
            baseline (default: never).
        min_improvement: relative drop of the loss's fast average below its slow one that counts as
            progress and keeps the detector silent.
        loss_fast_rate, loss_slow_rate: smoothing rates of the two loss averages (fast > slow).
        warmup: finite updates before anything but non-finite values can fire.
        rate: smoothing rate of the baseline.
        scale_rate: smoothing rate of the robust noise variance.
        clip: residuals are clipped at this many sigmas before they update baseline and scale.
        rebaseline_after: consecutive flagged updates after which the new level is accepted.
    """

    _TYPE = "SurgeDetector"
    # State format: version 2 added the loss averages (a version-1 state loads with no loss history).
    _STATE_VERSION = 2

    def __init__(
        self,
        metric: str,
        *,
        min_delta: float,
        ratio: float = 1.5,
        z_threshold: float = 6.0,
        min_level: float = -math.inf,
        alarm_level: float = math.inf,
        min_improvement: float = 0.01,
        loss_fast_rate: float = 0.1,
        loss_slow_rate: float = 0.02,
        warmup: int = 10,
        rate: float = 0.05,
        scale_rate: float = 0.05,
        clip: float = 2.0,
        rebaseline_after: int = 20,
    ) -> None:
        self.metric = check_metric(metric)
        self.min_delta = check_positive("min_delta", min_delta)
        self.ratio = as_float("ratio", ratio)
        if not (self.ratio >= 1.0 and math.isfinite(self.ratio)):
            raise ValueError(f"ratio must be a finite number >= 1, got {ratio!r}")
        self.z_threshold = check_positive("z_threshold", z_threshold)
        self.min_level = as_float("min_level", min_level)
        if math.isnan(self.min_level) or self.min_level == math.inf:
            raise ValueError(f"min_level must be a number below +inf, got {min_level!r}")
        self.alarm_level = as_float("alarm_level", alarm_level)
        if math.isnan(self.alarm_level) or not self.alarm_level > self.min_level:
            raise ValueError(f"alarm_level must be a number above min_level ({self.min_level!r}), got {alarm_level!r}")
        self._loss = LossProgress(min_improvement, loss_fast_rate, loss_slow_rate)
        self.warmup = check_count("warmup", warmup, 0)
        self.rate = check_rate("rate", rate)
        self.scale_rate = check_rate("scale_rate", scale_rate)
        self.clip = check_positive("clip", clip)
        self.rebaseline_after = check_count("rebaseline_after", rebaseline_after, 1)
        self._kappa = huber_consistency(self.clip)
        self.reset()

    @classmethod
    def saturation(cls, metric: str = "stable_attn/saturation", **kwargs: Any) -> SurgeDetector:
        """Defaults for a saturation or fixed-block rate in [0, 1]: fire on a rise of at least
        5 percentage points that also doubles the baseline, to at least 10% of rows, while the loss
        does not improve."""
        kwargs.setdefault("min_delta", 0.05)
        kwargs.setdefault("ratio", 2.0)
        kwargs.setdefault("min_level", 0.1)
        return cls(metric, **kwargs)

    @classmethod
    def max_logit(cls, metric: str = "stable_attn/max_logit", **kwargs: Any) -> SurgeDetector:
        """Defaults for a max attention logit (scaled score): fire on a rise of at least 5 logit
        units and 25% over the baseline, to at least 50 (``exp(50)``: one key takes all the
        attention in any precision), while the loss does not improve; and at 1000 in any case."""
        kwargs.setdefault("min_delta", 5.0)
        kwargs.setdefault("ratio", 1.25)
        kwargs.setdefault("min_level", 50.0)
        kwargs.setdefault("alarm_level", 1000.0)
        return cls(metric, **kwargs)

    @property
    def baseline(self) -> float | None:
        """The current baseline (None before the first value)."""
        return self._level

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (a version-1 state, saved before the loss
        condition existed, loads with no loss history)."""
        if isinstance(state, Mapping) and state.get("version") == 1 and state.get("type") == "SurgeDetector":
            state = {**state, "version": self._STATE_VERSION, "loss_fast": None, "loss_slow": None, "losses": 0}
        super().load_state_dict(state)

    def update(self, step: int, value: float, loss: float | None = None) -> SpikeEvent | None:
        """Feed one observation (and optionally the training loss of the same step); return an event
        on a surge or a non-finite value, else None. A non-finite loss is ignored here (the loss's
        own :class:`~stable_attn.monitor.detectors.spikes.SpikeDetector` reports it)."""
        step, value = self._read(step, value, loss)
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
        alarm = value >= self.alarm_level
        if self.ready and (alarm or (rise > margin and value >= self.min_level and not self.loss_improving)):
            return self._flag(step, value, self._level,
                              self.alarm_level if alarm else max(self._level + margin, self.min_level),
                              rise / self._sigma(), "level" if alarm else "surge")
        self._accept(value)
        return None

    def _sigma(self) -> float:
        floor = self.min_delta / self.z_threshold
        return floor if self._var is None else max(math.sqrt(self._var), floor)

    def _margin(self, level: float) -> float:
        return max(self.min_delta, self.z_threshold * self._sigma(), (self.ratio - 1.0) * level)

    # the baseline: an exponential moving average and the robust noise variance (EarlyWarning's hooks)
    def _reset_baseline(self) -> None:
        self._level: float | None = None
        self._var: float | None = None
        self._residuals = 0
        self._last_residual: float | None = None

    def _rebaseline(self, flagged: list[float]) -> None:
        ordered = sorted(flagged)
        self._level = ordered[len(ordered) // 2]
        self._last_residual = None

    def _config(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "min_delta": self.min_delta,
            "ratio": self.ratio,
            "z_threshold": self.z_threshold,
            "min_level": self.min_level,
            "alarm_level": self.alarm_level,
            **self._loss.config(),
            "warmup": self.warmup,
            "rate": self.rate,
            "scale_rate": self.scale_rate,
            "clip": self.clip,
            "rebaseline_after": self.rebaseline_after,
        }

    def _baseline_state(self) -> dict[str, Any]:
        return {"level": self._level, "var": self._var, "residuals": self._residuals,
                "last_residual": self._last_residual}

    def _load_baseline(self, state: Mapping[str, Any]) -> None:
        self._level = optional_float(state["level"])
        self._var = optional_float(state["var"])
        self._residuals = int(state["residuals"])
        self._last_residual = optional_float(state["last_residual"])

    def _absorb(self, value: float) -> None:
        if self._level is None:
            self._level = value
            return
        residual = value - self._level
        trusted = self._residuals >= MIN_SCALE_SAMPLES
        bound = self.clip * self._sigma()
        clipped = min(max(residual, -bound), bound) if self.ready else residual
        self._level += self.rate * clipped
        self._var, self._residuals = update_scale(
            self._var, self._residuals, residual, self._last_residual, bound, trusted, self.scale_rate, self._kappa
        )
        self._last_residual = residual

    def __repr__(self) -> str:
        return (
            f"SurgeDetector({self.metric!r}, min_delta={self.min_delta!r}, ratio={self.ratio!r}, "
            f"z_threshold={self.z_threshold!r}, min_level={self.min_level!r}, warmup={self.warmup!r})"
        )
