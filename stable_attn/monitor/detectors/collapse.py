"""Early warning on attention-entropy collapse: :class:`EntropyCollapseDetector`.

Zhai et al. (2023), "Stabilizing Transformer Training by Preventing Attention Entropy Collapse"
(arXiv 2303.06296), find that the attention entropy of a layer collapsing towards zero comes before the
training instability. Entropy also falls in healthy training (attention sharpens as the model learns),
so like :class:`~stable_attn.monitor.detectors.surge.SurgeDetector` the rule asks for the loss to have stopped
improving as well. One scalar per update (a layer's mean attention entropy in nats, as the callbacks log
it: ``stable_attn/entropy/<layer>``), O(window) pure-Python arithmetic, state in plain floats, ints
and lists (JSON-safe).

The rule (``event.rule == "collapse"``, ``kind="early_warning"``), with the defaults (docs/DETECTORS.md has
the runs behind the numbers): from the 10th update and the 50th loss on, the entropy is below
``fraction`` (0.5) of the median of its last ``window`` (50) accepted values, at least ``min_drop``
(0.1 nats) below it, and the loss has not improved (its fast average is not 1% below its slow one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .events import SpikeEvent
from .robust import (
    EarlyWarning,
    LossProgress,
    as_float,
    check_count,
    check_metric,
    check_positive,
    median,
)

__all__ = ["EntropyCollapseDetector"]


class EntropyCollapseDetector(EarlyWarning):
    """Early warning when a layer's attention entropy falls below a fraction of its running median while
    the loss has stopped improving.

    A value fires (``kind="early_warning"``, ``rule="collapse"``) when all of these hold:

    - **collapse**: it is below ``fraction`` x the median of the last ``window`` accepted values, and at
      least ``min_drop`` nats below that median (an entropy already near zero wanders by ratios, not
      by nats);
    - **no progress**: the loss passed to :meth:`update` has not improved: its fast average (rate
      ``loss_fast_rate``) is not below its slow average (rate ``loss_slow_rate``) by more than
      ``min_improvement`` (relative); progress counts as unknown, and the detector stays silent, until
      ``1 / loss_slow_rate`` losses were seen. Without a loss the collapse decides alone.

    A median is not moved by a few odd steps, and a window of accepted values follows the slow fall of a
    sharpening model, so only a fall much faster than the recent history counts. Flagged values stay out
    of the window; after ``rebaseline_after`` flagged updates in a row the collapsed level is accepted
    (the window restarts from the recent flagged values) and a new episode may fire later. Non-finite
    values are ignored: a NaN entropy comes with a NaN or infinite max logit, which
    :meth:`SurgeDetector.max_logit <stable_attn.monitor.detectors.surge.SurgeDetector.max_logit>` reports as
    ``nonfinite``.

    Args:
        metric: name carried by events (e.g. ``"stable_attn/entropy/layer3"``).
        fraction: the entropy fires below this share of its running median (in (0, 1)).
        min_drop: nats the entropy must be below the median to fire.
        window: accepted values whose median is the baseline.
        min_improvement: relative drop of the loss's fast average below its slow one that counts as
            progress and keeps the detector silent.
        loss_fast_rate, loss_slow_rate: smoothing rates of the two loss averages (fast > slow).
        warmup: finite updates before anything can fire.
        rebaseline_after: consecutive flagged updates after which the new level is accepted.
    """

    _TYPE = "EntropyCollapseDetector"
    _STATE_VERSION = 1

    def __init__(
        self,
        metric: str = "stable_attn/entropy",
        *,
        fraction: float = 0.5,
        alarm_fraction: float = 0.1,
        min_drop: float = 0.02,
        window: int = 50,
        min_improvement: float = 0.01,
        loss_fast_rate: float = 0.1,
        loss_slow_rate: float = 0.02,
        warmup: int = 10,
        rebaseline_after: int = 50,
    ) -> None:
        self.metric = check_metric(metric)
        self.fraction = as_float("fraction", fraction)
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
        self.alarm_fraction = check_positive("alarm_fraction", alarm_fraction, allow_zero=True)
        if not self.alarm_fraction < self.fraction:
            raise ValueError(f"alarm_fraction must be in [0, fraction={fraction!r}) (0: off), got {alarm_fraction!r}")
        self.min_drop = check_positive("min_drop", min_drop, allow_zero=True)
        self.window = check_count("window", window, 1)
        self._loss = LossProgress(min_improvement, loss_fast_rate, loss_slow_rate)
        self.warmup = check_count("warmup", warmup, 0)
        self.rebaseline_after = check_count("rebaseline_after", rebaseline_after, 1)
        self.reset()

    @property
    def baseline(self) -> float | None:
        """The running median of the accepted values (None before the first)."""
        if not self._accepted:
            return None
        return median(self._accepted)

    def update(self, step: int, value: float, loss: float | None = None) -> SpikeEvent | None:
        """Feed one entropy (nats) and optionally the training loss of the same step; return an event on a
        collapse, else None. Non-finite values and losses are ignored."""
        step, value = self._read(step, value, loss)
        if not math.isfinite(value):
            return None
        baseline = self.baseline
        if baseline is None:
            self._accept(value)
            return None
        threshold = min(self.fraction * baseline, baseline - self.min_drop)
        alarm = value < min(self.alarm_fraction * baseline, baseline - self.min_drop)
        if self.ready and (alarm or (value < threshold and not self.loss_improving)):
            return self._flag(
                step, value, baseline,
                min(self.alarm_fraction * baseline, baseline - self.min_drop) if alarm else threshold,
                math.nan,  # no noise scale: the rule is a ratio to the median, not a count of sigmas
                "plunge" if alarm else "collapse",
            )
        self._accept(value)
        return None

    # the baseline: the last ``window`` accepted values (EarlyWarning's hooks)
    def _reset_baseline(self) -> None:
        self._accepted: list[float] = []

    def _absorb(self, value: float) -> None:
        self._accepted.append(value)
        del self._accepted[: -self.window]

    def _rebaseline(self, flagged: list[float]) -> None:
        self._accepted = list(flagged)

    def _config(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "fraction": self.fraction,
            "alarm_fraction": self.alarm_fraction,
            "min_drop": self.min_drop,
            "window": self.window,
            **self._loss.config(),
            "warmup": self.warmup,
            "rebaseline_after": self.rebaseline_after,
        }

    def _baseline_state(self) -> dict[str, Any]:
        return {"accepted": list(self._accepted)}

    def _load_baseline(self, state: Mapping[str, Any]) -> None:
        self._accepted = [float(v) for v in state["accepted"]][-self.window :]

    def __repr__(self) -> str:
        return (
            f"EntropyCollapseDetector({self.metric!r}, fraction={self.fraction!r}, min_drop={self.min_drop!r}, "
            f"window={self.window!r}, warmup={self.warmup!r})"
        )
