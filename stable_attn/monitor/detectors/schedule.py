"""The learning-rate schedule as a spike detector sees it: :class:`ScheduleTracker`.

A restart of the schedule moves the loss and the gradient norm by design. The tracker follows the learning rates
passed to :meth:`~stable_attn.monitor.detectors.spikes.SpikeDetector.update`, says when the schedule restarts,
and counts down what a restart starts: a *grace* (the detector follows the values instead of judging them) and
then a *settling* (the forecast settles onto the new cycle's curve). docs/DETECTORS.md, "The learning-rate
schedule", has the measurements behind every number. Pure Python: a few plain numbers of state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from .robust import as_float, optional_float

__all__ = ["RESTART", "RESTART_GRACE", "RESTART_RISE", "RESTART_SETTLE", "STATE_KEYS", "WARMUP_END", "WARMUP_MIN",
           "Change", "ScheduleTracker"]

# After a restart the detector follows the values for this many updates, plus those (at most RESTART_RISE) during
# which the learning rate still rises: the loss of a restarted schedule rises with the learning rate and peaks a
# few updates after it.
RESTART_GRACE = 10
RESTART_RISE = 50
# Then the forecast settles onto the new cycle's curve, until it is unbiased for the detector's calm count of
# updates in a row (at most this many accepted updates).
RESTART_SETTLE = 200
Change = Literal["restart", "warm-up end"]
RESTART: Change = "restart"
WARMUP_END: Change = "warm-up end"
# A warm-up: the learning rate rising from the first update on, at least this many updates in a row; it ends at
# the first update it does not rise (its peak).
WARMUP_MIN = 5
# The tracker's state, as the keys of the detector's state_dict() (each the attribute "_" + key here).
STATE_KEYS = ("lr_peak", "lr_low", "lr_last", "restarts", "grace", "grace_rising", "settle", "warm")


class ScheduleTracker:
    """Follows a learning-rate schedule's peak and its lowest value since; a rise to ``restart_ratio`` times
    that lowest value, after it had fallen below the peak by the same factor, is a restart (a warm-up or a ramp
    from the start is not). A restart starts a grace of :data:`RESTART_GRACE` updates (not running down while the
    learning rate rises, for at most :data:`RESTART_RISE` updates) and then a settling of at most
    :data:`RESTART_SETTLE` accepted updates. ``restart_ratio=None`` ignores the learning rate."""

    def __init__(self, restart_ratio: float | None) -> None:
        if restart_ratio is not None:
            restart_ratio = as_float("lr_restart_ratio", restart_ratio)
            if not (restart_ratio > 1.0 and math.isfinite(restart_ratio)):
                raise ValueError(f"lr_restart_ratio must be a finite number > 1 or None, got {restart_ratio!r}")
        self.restart_ratio = restart_ratio
        self.reset()

    def reset(self) -> None:
        self._lr_peak: float | None = None  # the schedule's last peak learning rate (None: none given yet)
        self._lr_low: float | None = None  # its lowest learning rate since that peak
        self._lr_last: float | None = None  # the previous update's learning rate
        self._restarts = 0  # restarts seen
        self._grace = 0  # updates left of a restart's grace
        self._grace_rising = 0  # updates of the grace during which the learning rate rose
        self._settle = 0  # after a grace: accepted updates left at most until the forecast is settled
        self._rising = False  # whether the last learning rate rose over the one before
        self._warm = 0  # updates the learning rate rose in the run's warm-up; -1 once it fell or ended

    # ------------------------------------------------------------------ reading
    @property
    def restarts(self) -> int:
        """Restarts seen."""
        return self._restarts

    @property
    def in_grace(self) -> bool:
        """A restart's grace is running: the detector follows the values."""
        return self._grace > 0

    @property
    def warming(self) -> bool:
        """The learning rate rose at the last update, in a warm-up from the run's first update on."""
        return self._rising and self._warm > 0

    @property
    def settling(self) -> bool:
        """After a grace, the forecast is still settling onto the new cycle's curve."""
        return self._settle > 0

    # ----------------------------------------------------------------- updating
    def observe(self, lr: float | None) -> Change | None:
        """Fold in one update's learning rate (None, NaN, inf or <= 0: unknown, nothing changes). Returns
        :data:`RESTART` when it restarts the schedule (the grace and the settling start afresh),
        :data:`WARMUP_END` at the first update after a warm-up of at least :data:`WARMUP_MIN` rising updates that
        does not rise (the detector may then :meth:`start_settling`), else None."""
        self._rising = False
        if self.restart_ratio is None or lr is None or not (lr > 0.0 and math.isfinite(lr)):
            return None  # unknown (the engine passes NaN without param groups), or a schedule at zero
        last = self._lr_last
        self._rising = last is not None and lr > last
        self._lr_last = lr
        if self._warm >= 0 and last is not None:
            if self._rising:
                self._warm += 1
            elif self._warm >= WARMUP_MIN:
                self._warm = -1
                return WARMUP_END
            elif lr < last:
                self._warm = -1  # the schedule starts by falling: no warm-up
        peak, low = self._lr_peak, self._lr_low
        restart = (peak is not None and low is not None and low * self.restart_ratio <= peak
                   and lr >= low * self.restart_ratio)
        if restart or peak is None or low is None or lr > peak:
            # A new peak (a warm-up or a ramp follows its rise) or a restart: the new cycle starts here.
            self._lr_peak = self._lr_low = lr
        else:
            self._lr_low = min(low, lr)
        if restart:
            self._restarts += 1
            self._grace = RESTART_GRACE
            self._grace_rising = 0
            self._settle = RESTART_SETTLE
        return RESTART if restart else None

    def start_settling(self) -> None:
        """Start a settling without a grace (the end of a warm-up)."""
        self._settle = RESTART_SETTLE

    def grace_step(self) -> None:
        """One finite update of the grace: it runs down, unless the learning rate still rises (its warm-up, at
        most RESTART_RISE updates of it)."""
        self._grace -= 0 if self._rising and self._grace_rising < RESTART_RISE else 1
        self._grace_rising += self._rising

    def settle_step(self, settled: bool) -> None:
        """One accepted update of the settling: it ends once ``settled`` (the forecast unbiased), else runs down."""
        self._settle = 0 if settled else self._settle - 1

    # -------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {key: getattr(self, "_" + key) for key in STATE_KEYS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Read the keys of :data:`STATE_KEYS` from ``state`` (the detector checked they are there)."""
        self._lr_peak = optional_float(state["lr_peak"])
        self._lr_low = optional_float(state["lr_low"])
        self._lr_last = optional_float(state["lr_last"])
        self._restarts = int(state["restarts"])
        self._grace = int(state["grace"])
        self._grace_rising = int(state["grace_rising"])
        self._settle = int(state["settle"])
        self._warm = int(state["warm"])
        self._rising = False
