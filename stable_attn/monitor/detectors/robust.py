"""What the detectors share: the robust noise scale, argument checks, state checks, episode counts, the
early warnings' loss gate (:class:`LossProgress`) and their common shape (:class:`EarlyWarning`).

:class:`~stable_attn.monitor.detectors.spikes.SpikeDetector` and
:class:`~stable_attn.monitor.detectors.surge.SurgeDetector`
measure a value against a baseline in robust standard deviations of the recent noise; the variance
behind them is updated here (:func:`update_scale`), with the Huber consistency factor that keeps it
unbiased on Gaussian noise (:func:`huber_consistency`). The checks raise the errors both constructors
and ``load_state_dict`` raise. Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from .events import SpikeEvent

__all__ = [
    "MIN_SCALE_SAMPLES",
    "RECENT_FLAGGED",
    "FAST_WINDOW",
    "EarlyWarning",
    "Episodes",
    "LossProgress",
    "as_float",
    "check_count",
    "check_metric",
    "check_positive",
    "check_rate",
    "check_state",
    "diff_scale",
    "huber_consistency",
    "median",
    "optional_float",
    "update_scale",
    "window_noise",
]

# Residual samples needed before the robust scale is trusted enough to clip with it.
MIN_SCALE_SAMPLES = 8
# Flagged values kept to re-seat the level after a persistent shift (median of these).
RECENT_FLAGGED = 8


def huber_consistency(c: float) -> float:
    """E[min(Z^2, c^2)] for Z ~ N(0, 1): divides the clipped squared residual so that the robust
    variance estimate equals the ordinary variance on Gaussian noise."""
    phi = math.exp(-0.5 * c * c) / math.sqrt(2.0 * math.pi)
    tail = math.erfc(c / math.sqrt(2.0))  # P(|Z| > c)
    return (1.0 - tail) - 2.0 * c * phi + c * c * tail


def update_scale(
    var: float | None,
    count: int,
    residual: float,
    last_residual: float | None,
    bound: float,
    trusted: bool,
    rate: float,
    kappa: float,
    rising: bool = False,
) -> tuple[float | None, int]:
    """One step of the robust noise variance; returns (variance, samples folded in).

    The sample is half the squared difference of successive residuals: a persistent bias (a drift,
    or a slow explosion the level is chasing) cancels in it, so it cannot inflate the scale and
    widen its own threshold, while noise that grows shows up at once. Once ``trusted`` it is clipped
    at ``bound`` (Huber's rho) and divided by ``kappa`` to stay unbiased on Gaussian noise. Early
    on, all samples are averaged equally (rate 1/k) so the scale is usable after a few steps.

    ``rising``: only rising differences are samples (on symmetric noise their mean square is the same). A
    detector of rises so does not learn a wide noise from a metric that falls several-fold over its first
    updates, as gradient norms do (docs/DETECTORS.md, "The start of a run").
    """
    if last_residual is None:
        if var is not None:  # first residual after a re-baseline: no difference to take yet
            return var, count
        if rising and residual <= 0.0:
            return var, count
        sample = residual * residual
    else:
        if rising and residual <= last_residual:
            return var, count
        sample = 0.5 * (residual - last_residual) ** 2
    if trusted:
        sample = min(sample, bound * bound) / kappa
    count += 1
    if var is None:
        return sample, count
    return var + max(rate, 1.0 / count) * (sample - var), count


def as_float(name: str, value: Any) -> float:
    """``float(value)``; TypeError naming ``name`` for anything ``float()`` refuses."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number (float, int or 1-element tensor), got {value!r}") from None


def check_metric(metric: Any) -> str:
    """``metric`` if it is a non-empty str (the name a detector's events carry), else TypeError."""
    if not isinstance(metric, str) or not metric:
        raise TypeError(f"metric must be a non-empty str, got {metric!r}")
    return metric


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    """``value`` as a float if it is finite and > 0 (``allow_zero``: >= 0), else ValueError naming ``name``."""
    value = as_float(name, value)
    ok = value >= 0 if allow_zero else value > 0
    if not (ok and math.isfinite(value)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return value


def check_rate(name: str, value: float) -> float:
    """``value`` as a float if it is a smoothing rate in (0, 1], else ValueError naming ``name``."""
    value = as_float(name, value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
    return value


def check_count(name: str, value: int, minimum: int) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``, else TypeError or ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def optional_float(value: Any) -> float | None:
    """``None`` for None, else ``float(value)``: a saved estimate that may not exist yet."""
    return None if value is None else float(value)


def check_state(state: Mapping[str, Any], kind: str, keys: tuple[str, ...], version: int) -> None:
    """Raise unless ``state`` is a version-``version`` state of detector ``kind`` holding every key of
    ``keys`` (a state without ``"type"`` passes as ``kind``'s)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping from {kind}.state_dict(), got {type(state).__name__}")
    if state.get("type", kind) != kind:
        raise ValueError(f"state is a {state.get('type')!r} state, expected one from {kind}.state_dict()")
    if state.get("version") != version:
        raise ValueError(f"state version {state.get('version')!r} is not supported: {kind} reads version {version}, "
                         "the format its state_dict() writes")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"state is missing keys {missing}; pass the dict returned by {kind}.state_dict()")


class Episodes:
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


def median(values: list[float]) -> float:
    """The median of a non-empty list."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


# With fewer successive differences than this the noise is their root mean square (a median of a handful is
# unreliable; a steep descent only widens the bar), from this many on the centred MAD.
_ROBUST_DIFFS = 8


def diff_scale(values: list[float], rising: bool = False) -> float:
    """A robust Gaussian sigma of ``values``' noise from their successive differences (0 before two values).
    ``rising``: a handful of differences (fewer than 8) counts its rising ones only: one fall of the run's
    start dominates their root mean square, while the median of 8 or more is not moved by it."""
    diffs = [b - a for a, b in zip(values, values[1:])]
    if len(diffs) >= _ROBUST_DIFFS:
        centre = median(diffs)
        # 1.4826 * MAD is a Gaussian sigma; a difference of two values has sqrt(2) times theirs.
        return 1.4826 * median([abs(d - centre) for d in diffs]) / math.sqrt(2.0)
    if rising:
        diffs = [d for d in diffs if d > 0.0]
    if diffs:
        # A handful: their root mean square (a median of a few is unreliable, and dropping the largest
        # read a noisy run's noise low enough to flag its 4th value; a steep descent only widens the bar).
        return math.sqrt(sum(d * d for d in diffs) / (2.0 * len(diffs)))
    return 0.0


# The window noise is also read over the last this many values: a noise that widens shows there within a few
# steps (a median of 32 differences needs half its window), and a median of 8 differences is still not moved
# by the two differences of one spike.
FAST_WINDOW = 9


def window_noise(values: list[float], log_space: bool, level_window: int, rising: bool = False) -> tuple[float, float]:
    """A run's measured noise in ``values`` (a detector's transformed values, flagged ones too): the larger
    :func:`diff_scale` of the whole window and of its last :data:`FAST_WINDOW`, as (relative, absolute). In log
    space relative is the scale of the logs' differences and absolute that of the values' differences over the
    current level (the median of the last ``level_window``): a batch noise of fixed size in nats (a few hard
    tokens per batch) grows relative to a loss that falls, faster than a scale learnt from the past follows.
    In linear space absolute is 0 (the rules there are in the metric's units already). Zeros before two
    values. ``rising`` is :func:`diff_scale`'s."""
    rel, absolute = max(diff_scale(values, rising), diff_scale(values[-FAST_WINDOW:], rising)), 0.0
    if log_space and len(values) >= 2:
        level = math.exp(median(values[-level_window:]))
        linear = [math.exp(min(v, 700.0)) for v in values]
        absolute = max(diff_scale(linear, rising), diff_scale(linear[-FAST_WINDOW:], rising)) / level
    return rel, absolute


class LossProgress:
    """The early-warning detectors' loss gate: whether the training loss is still improving.

    A fast and a slow average of the finite losses added (rates ``loss_fast_rate`` > ``loss_slow_rate``;
    over the first values both weigh them equally, rate 1/k, so both start from the same data). The loss
    improves while the fast average is more than ``min_improvement`` (relative) below the slow one.
    """

    def __init__(self, min_improvement: float, loss_fast_rate: float, loss_slow_rate: float) -> None:
        self.min_improvement = check_positive("min_improvement", min_improvement, allow_zero=True)
        self.loss_fast_rate = check_rate("loss_fast_rate", loss_fast_rate)
        self.loss_slow_rate = check_rate("loss_slow_rate", loss_slow_rate)
        if not self.loss_slow_rate < self.loss_fast_rate:
            raise ValueError(
                f"loss_slow_rate ({loss_slow_rate!r}) must be below loss_fast_rate ({loss_fast_rate!r})"
            )
        self.reset()

    def reset(self) -> None:
        self._fast: float | None = None
        self._slow: float | None = None
        self._count = 0

    def config(self) -> dict[str, float]:
        return {"min_improvement": self.min_improvement, "loss_fast_rate": self.loss_fast_rate,
                "loss_slow_rate": self.loss_slow_rate}

    def add(self, loss: float) -> None:
        """Fold in one loss (a non-finite one changes nothing)."""
        if not math.isfinite(loss):
            return
        self._count += 1
        if self._fast is None or self._slow is None:
            self._fast = self._slow = loss
            return
        self._fast += max(self.loss_fast_rate, 1.0 / self._count) * (loss - self._fast)
        self._slow += max(self.loss_slow_rate, 1.0 / self._count) * (loss - self._slow)

    @property
    def improving(self) -> bool | None:
        """None if no loss was added, True (the benefit of the doubt) until ``1 / loss_slow_rate`` losses
        were added, since the two averages cannot differ before the slow one has its own memory."""
        if self._fast is None or self._slow is None:
            return None
        if self._count < 1.0 / self.loss_slow_rate:
            return True
        return self._fast < self._slow - self.min_improvement * abs(self._slow)

    def state_dict(self) -> dict[str, Any]:
        return {"loss_fast": self._fast, "loss_slow": self._slow, "losses": self._count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._fast = optional_float(state["loss_fast"])
        self._slow = optional_float(state["loss_slow"])
        self._count = int(state["losses"])


class EarlyWarning:
    """The shape :class:`~stable_attn.monitor.detectors.surge.SurgeDetector` and
    :class:`~stable_attn.monitor.detectors.collapse.EntropyCollapseDetector` share: a warm-up of accepted values,
    a baseline that only accepted values move, the loss gate (:class:`LossProgress`), and episodes of flagged
    values (:meth:`_flag`) after ``rebaseline_after`` of which the flagged level becomes the baseline.

    A subclass validates its arguments and sets ``metric``, ``warmup``, ``rebaseline_after`` and ``_loss``, then
    calls :meth:`reset`; it provides its baseline (:attr:`baseline`, :meth:`_reset_baseline`, :meth:`_absorb`,
    :meth:`_rebaseline`), its options in saved order (:meth:`_config`) and its baseline's state
    (:meth:`_baseline_state`, :meth:`_load_baseline`); ``_TYPE`` and ``_STATE_VERSION`` name its state format.
    """

    _TYPE: ClassVar[str]
    _STATE_VERSION: ClassVar[int]
    metric: str
    warmup: int
    rebaseline_after: int
    _loss: LossProgress

    def reset(self) -> None:
        """Forget everything learnt (as freshly constructed)."""
        self._n = 0
        self._reset_baseline()
        self._episodes = Episodes()
        self._recent: list[float] = []
        self._loss.reset()

    @property
    def ready(self) -> bool:
        """True once warm-up is over and a warning can fire."""
        return self._n >= max(self.warmup, 1)

    @property
    def baseline(self) -> float | None:
        raise NotImplementedError

    @property
    def loss_improving(self) -> bool | None:
        """Whether the loss passed to ``update`` is still improving: None if no loss was passed, True (the
        benefit of the doubt) until ``1 / loss_slow_rate`` losses were seen, since the two averages cannot
        differ before the slow one has its own memory."""
        return self._loss.improving

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state for checkpoints (JSON-safe)."""
        return {
            "version": self._STATE_VERSION,
            "type": self._TYPE,
            "config": self._config(),
            "n": self._n,
            **self._baseline_state(),
            "run": self._episodes.run,
            "last_kind": self._episodes.last_kind,
            "recent": list(self._recent),
            **self._loss.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (the configuration stays this instance's)."""
        check_state(state, self._TYPE, tuple(self.state_dict()), self._STATE_VERSION)
        self._n = int(state["n"])
        self._load_baseline(state)
        self._episodes.run = int(state["run"])
        self._episodes.last_kind = state["last_kind"]
        self._recent = [float(v) for v in state["recent"]]
        self._loss.load_state_dict(state)

    def _read(self, step: int, value: float, loss: float | None) -> tuple[int, float]:
        """The step and value of an update, checked, after its loss (if any) was folded into the gate."""
        value = as_float("value", value)
        step = int(step)
        if loss is not None:
            self._loss.add(as_float("loss", loss))
        return step, value

    def _flag(self, step: int, value: float, baseline: float, threshold: float, score: float,
              rule: str) -> SpikeEvent:
        """The early warning for a flagged value (it stays out of the baseline); after ``rebaseline_after``
        flagged values in a row the recent flagged level becomes the baseline."""
        run, is_new = self._episodes.flag("early_warning")
        self._recent.append(value)
        del self._recent[:-RECENT_FLAGGED]
        event = SpikeEvent(step=step, metric=self.metric, value=value, baseline=baseline, threshold=threshold,
                           score=score, kind="early_warning", run_length=run, is_new=is_new, rule=rule)
        if run >= self.rebaseline_after:
            self._rebaseline(self._recent)
            self._recent.clear()
            self._episodes.clear()
        return event

    def _accept(self, value: float) -> None:
        """An unflagged finite value: it counts towards warm-up, ends an episode and moves the baseline."""
        self._n += 1
        self._episodes.clear()
        self._recent.clear()
        self._absorb(value)

    def _reset_baseline(self) -> None:
        raise NotImplementedError

    def _absorb(self, value: float) -> None:
        raise NotImplementedError

    def _rebaseline(self, flagged: list[float]) -> None:
        raise NotImplementedError

    def _config(self) -> dict[str, Any]:
        raise NotImplementedError

    def _baseline_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_baseline(self, state: Mapping[str, Any]) -> None:
        raise NotImplementedError
