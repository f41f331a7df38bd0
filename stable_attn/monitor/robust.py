"""What both detectors share: the robust noise scale, argument checks, state checks, episode counts.

:class:`~stable_attn.monitor.spikes.SpikeDetector` and :class:`~stable_attn.monitor.surge.SurgeDetector`
measure a value against a baseline in robust standard deviations of the recent noise; the variance
behind them is updated here (:func:`update_scale`), with the Huber consistency factor that keeps it
unbiased on Gaussian noise (:func:`huber_consistency`). The checks raise the errors both constructors
and ``load_state_dict`` raise. Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MIN_SCALE_SAMPLES",
    "RECENT_FLAGGED",
    "Episodes",
    "as_float",
    "check_count",
    "check_metric",
    "check_positive",
    "check_rate",
    "check_state",
    "huber_consistency",
    "optional_float",
    "update_scale",
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
    ``keys`` (a state without ``"type"`` passes as ``kind``'s). Older versions are upgraded by the
    detector's ``load_state_dict`` before this check."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping from {kind}.state_dict(), got {type(state).__name__}")
    if state.get("type", kind) != kind:
        raise ValueError(f"state is a {state.get('type')!r} state, expected one from {kind}.state_dict()")
    if state.get("version") != version:
        raise ValueError(f"state version {state.get('version')!r} is not supported (expected {version})")
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


def loss_averages(count: int, fast: float | None, slow: float | None, loss: float, fast_rate: float,
                  slow_rate: float) -> tuple[int, float | None, float | None]:
    """One finite ``loss`` folded into the fast and slow averages the early-warning detectors' loss gate
    compares (a non-finite one changes nothing): ``(count, fast, slow)`` after it. Over the first values both
    weigh them equally (rate 1/k), so both averages start from the same data."""
    if not math.isfinite(loss):
        return count, fast, slow
    count += 1
    if fast is None or slow is None:
        return count, loss, loss
    return (count, fast + max(fast_rate, 1.0 / count) * (loss - fast),
            slow + max(slow_rate, 1.0 / count) * (loss - slow))
