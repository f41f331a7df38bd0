"""The event a detector returns for an anomalous update: :class:`SpikeEvent`.

Both :class:`~stable_attn.monitor.detectors.spikes.SpikeDetector` and
:class:`~stable_attn.monitor.detectors.surge.SurgeDetector` return one;
:meth:`stable_attn.monitor.alerts.alert.Alert.from_event` turns one into an alert. Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["EventKind", "SpikeEvent"]

EventKind = Literal["spike", "nonfinite", "early_warning"]


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
        rule: which rule fired: ``"gross"`` (far above the recent values while the detector is not
            calibrated yet), ``"jump"`` (this value alone is far above the forecast), ``"drift"``
            (a sustained rise, see :class:`~stable_attn.monitor.detectors.spikes.SpikeDetector`), ``"surge"`` or
            ``"level"``
            (:class:`~stable_attn.monitor.detectors.surge.SurgeDetector`) or ``"nonfinite"``.
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

