"""Online spike detection for training loss and gradient norm: :class:`SpikeDetector`.

The detector takes one scalar per update, costs O(1) pure-Python arithmetic (no torch, no buffers that
grow), and keeps its whole state in a few plain floats, ints and short lists, so :meth:`state_dict`
survives ``torch.save``, ``torch.load(weights_only=True)`` and JSON unchanged. So does
:class:`~stable_attn.monitor.surge.SurgeDetector` (per-layer early warnings, in
:mod:`stable_attn.monitor.surge`; importable from here too); the robust noise scale and the checks
both use are in :mod:`stable_attn.monitor.robust`, the event they return in :mod:`stable_attn.monitor.events`.

Common API::

    det = SpikeDetector.loss()              # or SpikeDetector.grad_norm(), SurgeDetector.max_logit(), ...
    event = det.update(step, loss)          # SpikeEvent | None
    if event is not None and event.is_new:  # first step of an anomalous episode
        ...                                 # alert; act on every event if skipping steps

Every anomalous update returns an event (so a caller that skips bad steps can skip each one);
``event.is_new`` marks the first update of an episode (or a change of kind, e.g. a spike that turns
into NaN), which is where a caller alerts once instead of on every step of a long spike.

The rules (``event.rule``) and when each is active, with the defaults (docs/DETECTORS.md has the
measurements behind every number):

- ``"nonfinite"`` (both detectors): NaN or +inf, from the first update on.
- ``"gross"`` (:class:`SpikeDetector`, :attr:`SpikeDetector.phase` ``"gross"``): from the 4th finite
  update until the detector is calibrated: the value exceeds 1.25x (gradient norm: 5x) the median of
  the last 5 accepted values and ``gross_z`` (6; gradient norm: 4) sigmas of the run's measured noise
  (the successive differences of the last 32 finite values, flagged ones included, read as relative
  and as absolute noise; docs/DETECTORS.md, "The run's own noise"). From the 21st update the noise scale
  also counts: a rise of twice the
  calibrated bar (12 robust sigmas) is a ``"jump"`` already, and a rise of the calibrated bar itself
  once the forecast has been unbiased for 20 updates in a row.
- ``"jump"`` and ``"drift"`` (:class:`SpikeDetector`, phase ``"calibrated"``): after ``warmup=100``
  finite updates and once the forecast is unbiased (typically by update 100-130 on a real loss).

While a loss's measured relative noise is 5% per update or more (:data:`NOISY_RELATIVE_NOISE`), a gross
rise or a jump must also undo ``noisy_progress_share`` (0.1) of the run's progress to be flagged: a low,
noisy loss (memorisation, fine-tuning) has healthy batches of a few times its level.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Literal

from .events import EventKind, SpikeEvent
from .names import GRAD_NORM, LOSS
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
    optional_float,
    update_scale,
)
from .surge import SurgeDetector  # re-exported: ``from stable_attn.monitor.spikes import SurgeDetector``

__all__ = ["EventKind", "Phase", "SpikeDetector", "SpikeEvent", "SurgeDetector"]

_logger = logging.getLogger("stable_attn")

# While an update is skipped (flagged or non-finite) the trend is extrapolated with this per-update
# decay, so a long anomaly cannot drag the forecast far along a stale slope (total drift <= ~19 slopes).
_GAP_TREND_DECAY = 0.95
# Values at or below zero have no logarithm; they are floored here (a huge downward outlier, which
# the clipped update absorbs) and a warning says once that log_space=False suits such a metric.
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
# The gross rule's bar is also ``gross_z`` times the run's own noise, measured on the successive
# differences of the last this many finite values, flagged ones included (centred on their median, so
# a steady descent is not read as noise; a median is not moved by the one or two differences a real
# spike makes, and counting flagged values keeps a noise that was underestimated from hiding itself),
# and by the robust scale once it has enough samples. A fixed ratio alone ignores
# the noise: at a loss of 0.07 nats batch noise exceeds 25% and 1.25x flagged 13-24 healthy steps of 200.
_NOISE_WINDOW = 32
# The jump and drift rules measure in the larger of the robust scale and this share of that window
# noise: the robust scale learns from accepted values only, and on a noise it has not learnt (a loss
# whose batches fall in two modes, a noise that widens fast) it would flag the ordinary half of the
# batches for ever, each flag keeping the noise out that would have widened it. A median of the
# differences over all values is not moved by the one or two differences of a real spike. The share
# keeps the window's sampling error (about 25% on 31 differences) from blunting the bar on clean noise.
_WINDOW_NOISE_SHARE = 0.75
_FAST_WINDOW = 9
# With fewer differences than this the noise is their root mean square (a median of a handful is
# unreliable; a steep descent only widens the bar), from this many on the centred MAD.
_ROBUST_DIFFS = 8
# Re-entry: the values of a short flagged episode (at most _REENTRY_RUN updates) that is followed by
# _REENTRY_AFTER accepted values in a row (no sustained change) re-enter the baseline: each one moves
# the level and the noise scale like an accepted value, its residual clipped at ``clip`` sigmas. A
# detector whose noise estimate is too low (its flags were ordinary noise) so learns the real noise
# instead of excluding it for ever; a longer episode (a spike that lasts, a shift) never re-enters.
_REENTRY_RUN = 2
_REENTRY_AFTER = 3
# The run's start, for min_progress_share: the median of this many first finite values.
_FIRST_VALUES = 5
# From this relative noise on (the run's measured noise, as the gross rule reads it: the scale of the
# successive differences of the last values' logs; 0.05 = 5% per step) a jump or gross rise must also
# undo ``noisy_progress_share`` of the run's progress. A loss that has fallen far below its start and is
# that noisy (memorisation, fine-tuning to a low loss) has healthy batches of a few times its level; on
# the synthetic traces, whose noise is 0.3-4% of the loss except the scale/noise family's, the gate
# changed one flag (of a grey-zone bump) in 4.4 million steps (docs/DETECTORS.md, "A low, noisy loss").
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
# State format: version 3 counts the samples of the residual moments apart (they start later);
# version 4 adds the re-entry buffers, the flag marks of the re-baseline rule and the finite-update count;
# version 5 the first finite values (the run's start, for progress_share).
_STATE_VERSION = 5
Phase = Literal["starting", "gross", "calibrated"]


class SpikeDetector:
    """Online spike detector for training loss or gradient norm.

    Each update forecasts the next value from a local level and trend and measures the residual in
    robust standard deviations (sigmas) of the recent noise. Once the detector is calibrated
    (:attr:`phase` ``"calibrated"``, see *Calibrated warm-up* below) two rules flag a value:

    - **jump**: the residual exceeds ``z_threshold`` sigmas and ``min_rel_change`` of the baseline
      (a corrupted batch, a loss spike, the first steps of a fast explosion);
    - **drift**: a one-sided CUSUM of the standardized rises over the level (the forecast, but a
      falling trend is not extrapolated; each rise capped at 1.5, less ``drift_slack``) exceeds
      ``drift_threshold``: the value sits a sigma or so above the forecast for many steps in a row,
      as in a slow divergence that no single step reveals. The sum restarts after it fires, so a
      continuing rise alerts again every few steps, and it is held at zero
      after a jump until the residuals are back near zero (a spike's decaying tail is not a drift).

    Before that, from the ``gross_warmup``-th finite update on (:attr:`phase` ``"gross"``), one rule
    watches alone:

    - **gross**: the value exceeds ``gross_ratio`` times the median of the last 5 accepted values
      (a corrupted batch, a bad initialisation, an early divergence). It needs no noise estimate, so
      it works from the ``gross_warmup``-th value on; its bar is high because the first steps of a
      run are noisy in ways no estimate has seen yet. It also watches again after a re-baseline,
      until the detector is calibrated. The defaults come from real runs
      (``benchmarks/early_detection.py``: the tiny GPT-2 of the callback tests from its random
      initialisation, first 150 steps): a healthy loss rose at most 1.13x over the median of its
      previous 5 values, a batch of garbled bytes at steps 20 to 150 rose 1.36x to 2.24x; so the
      loss default is 1.25x. Gradient norms swing far more early on (up to 3.95x in healthy runs)
      while a garbled batch raised them 6.1x to 19.7x (but only 1.08x at step 20):
      :meth:`grad_norm` uses 5x. From the 21st update the noise scale has enough samples for a
      provisional jump rule: a rise of twice the calibrated bar (``2 * z_threshold`` sigmas) over
      the forecast is a ``"jump"`` already, and once the forecast has been unbiased for 20 updates
      in a row (it no longer lags a steep descent) the calibrated bar itself is.

    Non-finite values are always flagged (``kind="nonfinite"``), from the first update on.

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
      That scale reads low on autocorrelated noise (by ``1 - rho`` in variance for an AR(1)), so
      the scale used is the larger of it and the variance of the residuals about their own moving
      mean (a persistent bias goes into the mean, not the variance); the lag-1 autocorrelation
      ``rho`` of the residuals widens the jump bar by ``sqrt(1 + rho)`` and slows the drift sum by
      ``sqrt((1 + rho) / (1 - rho))`` (runs above the forecast last that much longer on such
      noise). Those moments stop learning while a drift is accumulating, and learn only while the
      forecast is unbiased: its catching up with the first descent (or after a re-baseline) is a
      bias, not noise; until then the successive-difference scale serves alone.
    - **Jumps are measured from the forecast, never from below the lowest of the last 5 values**:
      after a fast fall (a learning-rate drop) the trend runs on below a curve that has flattened.
    - **No poisoning**: a flagged value never enters level, trend or scale (the forecast just
      advances along a decaying trend), and each accepted residual is clipped at ``clip`` sigmas,
      so a hard batch just below the threshold moves the baseline by at most
      ``level_rate * clip`` sigmas.
    - **Calibrated warm-up**: the jump and drift rules do not fire before ``warmup`` finite
      updates, nor before the forecast is unbiased (an average of recent standardized residuals
      within 0.5 for 20 updates in a row): in the steep first descent of a loss the trend is still
      catching up, and a forecast below the curve would flag every step. During warm-up residuals
      are not clipped, so the forecast can catch up; the gross rule keeps gross jumps out of it.
    - **Re-baselining**: ``rebaseline_after`` consecutive flagged updates are a level shift, not a
      spike: the level is re-seated at the median of the recent values, the trend dropped, and the
      detector warms up again (calibration only), instead of flagging every later value.
    - **Why not median/MAD over a window**: O(window) per step, it lags a trend by half a window
      (false alarms whenever the metric rises), and its state is the whole window. Here the state
      is a dozen numbers and an update is a few floating-point operations.
    - **Relative floor** ``min_rel_change``: a rise smaller than 1% of the loss is never actionable,
      and it keeps a very smooth curve (noise near zero) from flagging rounding-level wiggles.

    On synthetic LM loss traces (``benchmarks/spike_detection.py``, docs/BENCHMARKS.md) the defaults
    flag 97.2-97.7% of spikes of 8 sigma and more within 2 steps of onset with 0.08-0.16 false
    alarms per 10,000 clean steps on held-out traces of kinds they were not tuned on
    (autocorrelated noise, clusters of hard batches, learning-rate drops, events in the first 300
    steps). Defaults suit a
    loss fed once per optimizer step; the time constants count updates, not steps, so feeding
    every N steps makes them N times longer. Steps are labels only (they need not be consecutive
    or increasing, e.g. after a rollback). For a metric that legitimately trends up for long
    stretches, raise ``max_rise`` or set ``drift_threshold=None``.

    Args:
        metric: name carried by events (e.g. ``"train/loss"``, ``"train/grad_norm"``).
        z_threshold: robust sigmas above the forecast that make a jump.
        min_rel_change: the smallest relative rise over the baseline that can be a jump
            (0.01 = 1%); in linear space, relative to ``|baseline|``.
        warmup: finite updates before the calibrated rules (jump, drift) can fire; they also wait
            until the forecast is unbiased (at least 20 more updates).
        gross_ratio: the gross rule's factor over the median of recent values (in linear space, the
            rise ``(gross_ratio - 1) * |median|``); None disables the rule.
        gross_warmup: finite updates before the gross rule can fire (>= 1; the median of fewer
            than ``gross_warmup`` values is the reference).
        gross_z: the gross rule's bar is also this many sigmas of the run's own noise (the larger of
            a robust scale of the successive differences of the last 16 accepted values and the
            robust scale); 0 leaves the ratio alone (the rule before version 4 of the state).
        level_rate: smoothing rate of the level (larger follows faster, noisier baseline).
        trend_rate: smoothing rate of the trend (Holt's beta, applied to level changes).
        scale_rate: smoothing rate of the robust noise variance.
        clip: residuals are clipped at this many sigmas before they update level and scale (the
            drift sum caps each residual at 1.5 sigmas: 8 hard batches of 2-4 sigma in a row stay
            below ``drift_threshold``).
        rebaseline_after: consecutive flagged finite updates after which the level is re-seated.
        max_rise: largest upward trend the forecast follows, in sigmas per update.
        drift_threshold: CUSUM level (in sigmas) at which the drift rule fires; None disables it.
        drift_slack: sigmas subtracted from each residual in the drift sum (ignore smaller biases).
        direction: ``"up"`` flags rises only (losses, norms); ``"both"`` also flags drops by the
            jump rule (the drift rule watches rises only).
        log_space: detect on ``log(value)`` (for positive metrics); False for metrics that can be
            zero or negative.
        min_progress_share: None (default), or a jump or gross rise must also undo at least this share
            of the run's progress (:meth:`progress_share`) to be flagged. For a loss that falls far
            below where it started (memorisation, fine-tuning to a low loss): there the healthy loss
            spikes of a few times the level undo a few percent of it, a corrupted batch all of it. It
            costs recall on small spikes: 0.1 took the synthetic benchmark's recall from 0.96-0.98 to
            0.80-0.86 (docs/DETECTORS.md), so it is not on at every noise level by default. The drift
            rule is not gated.
        noisy_progress_share: the same gate, on only while the run's measured relative noise
            (:meth:`relative_noise`) is at least :data:`NOISY_RELATIVE_NOISE` (5% per update): 0.1 by
            default (:meth:`grad_norm`: None). A loss that noisy at a level far below its start has
            healthy batches of a few times its level (memorisation at 0.05-0.3 nats: 2.4-3.4x), and
            there they undo a few percent of the progress; on the synthetic traces, whose noise is
            below 5% except in the scale/noise family, it changed one flag in 4.4 million steps.
            None switches it off.
            Where both are set the larger share applies.
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
        if min_progress_share is not None:
            min_progress_share = check_positive("min_progress_share", min_progress_share, allow_zero=True)
        self.min_progress_share = min_progress_share
        if noisy_progress_share is not None:
            noisy_progress_share = check_positive("noisy_progress_share", noisy_progress_share, allow_zero=True)
        self.noisy_progress_share = noisy_progress_share
        self._kappa = huber_consistency(self.clip)
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
        of the norm's own noise where that is wider (the 5x ratio already allows for the usual swings)."""
        kwargs.setdefault("gross_ratio", 5.0)
        kwargs.setdefault("gross_z", 4.0)
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
        # Centered moments of the residuals (mean, variance about it, lag-1 covariance): the scale
        # from successive differences reads low on autocorrelated noise, this one does not; a
        # persistent bias goes into the mean, not the variance. _rcount: residuals folded in.
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
            "window": list(self._window),
            "rmean": self._rmean,
            "rvar": self._rvar,
            "rcov": self._rcov,
            "rcount": self._rcount,
            "seen": self._seen,
            "marks": list(self._marks),
            "episode": list(self._episode),
            "held": list(self._held),
            "noise": list(self._noise),
            "clean": self._clean,
            "first": list(self._first),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (e.g. on resume; a version-1 state, saved
        before the gross rule existed, loads with an empty gross-rule window; a version-2 one with
        its moments counted as many samples as its scale; a version-3 one with nothing held for
        re-entry, no flag marks, and its gross-rule window as the noise window)."""
        if isinstance(state, Mapping) and state.get("type") == "SpikeDetector":
            if state.get("version") == 1:
                state = {**state, "version": 2, "window": [], "rmean": 0.0, "rvar": None, "rcov": 0.0}
            if state.get("version") == 2 and "residuals" in state:
                # Version 2 folded the moments in from the first residual on: as many samples as the scale.
                state = {**state, "version": 3, "rcount": state["residuals"]}
            if state.get("version") == 3 and "n" in state:
                # Version 3 had no re-entry and re-baselined on consecutive flags only: nothing pending.
                state = {**state, "version": 4, "seen": state["n"], "marks": [], "episode": [],
                         "held": [], "clean": 0, "noise": list(state["window"])}
            if state.get("version") == 4 and "n" in state:
                # Version 4 kept no record of the run's start: progress_share and min_progress_share wait
                # for it (they judge nothing until the state is version 5).
                state = {**state, "version": _STATE_VERSION, "first": []}
        check_state(state, "SpikeDetector", tuple(self.state_dict()), _STATE_VERSION)
        self._n = int(state["n"])
        self._armed = bool(state["armed"])
        self._bias = float(state["bias"])
        self._calm = int(state["calm"])
        self._cusum = float(state["cusum"])
        self._settling = int(state["settling"])
        self._level = optional_float(state["level"])
        self._trend = float(state["trend"])
        self._var = optional_float(state["var"])
        self._residuals = int(state["residuals"])
        self._last_residual = optional_float(state["last_residual"])
        self._episodes.run = int(state["run"])
        self._episodes.last_kind = state["last_kind"]
        self._recent = [float(v) for v in state["recent"]]
        self._window = [float(v) for v in state["window"]][-_GROSS_WINDOW:]
        self._noise = [float(v) for v in state["noise"]][-_NOISE_WINDOW - 1 :]
        self._rmean = float(state["rmean"])
        self._rvar = optional_float(state["rvar"])
        self._rcov = float(state["rcov"])
        self._rcount = int(state["rcount"])
        self._seen = int(state["seen"])
        self._marks = [int(v) for v in state["marks"]]
        self._episode = [float(v) for v in state["episode"]][-RECENT_FLAGGED:]
        self._held = [float(v) for v in state["held"]][-RECENT_FLAGGED:]
        self._clean = int(state["clean"])
        self._first = [float(v) for v in state["first"]][:_FIRST_VALUES]

    def _config(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "z_threshold": self.z_threshold,
            "min_rel_change": self.min_rel_change,
            "warmup": self.warmup,
            "gross_ratio": self.gross_ratio,
            "gross_warmup": self.gross_warmup,
            "gross_z": self.gross_z,
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
            "min_progress_share": self.min_progress_share,
            "noisy_progress_share": self.noisy_progress_share,
        }

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
    def baseline(self) -> float | None:
        """The forecast for the next update in the metric's units (None before the first value)."""
        if self._level is None:
            return None
        return self._to_value(self._level + self._trend)

    # ---------------------------------------------------------------- update
    def update(self, step: int, value: float) -> SpikeEvent | None:
        """Feed one observation; return a :class:`~stable_attn.monitor.events.SpikeEvent` if it is anomalous, else None.

        A flagged value does not enter the estimates. ``value`` may be a float, an int or anything
        ``float()`` accepts (a 1-element tensor); ``step`` is only carried into the event.
        """
        value = as_float("value", value)
        step = int(step)
        if not math.isfinite(value):
            return self._nonfinite(step, value)
        x = self._transform(value)
        self._seen += 1
        if self._seen <= _FIRST_VALUES:  # a state saved before version 5 never learns its start
            self._first.append(value)
        self._noise.append(x)
        del self._noise[: -_NOISE_WINDOW - 1]  # the window and x itself
        if self._level is None:
            self._accept(x)
            self._episodes.clear()
            return None

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
            if self.drift_threshold is not None and not self._settling:
                # One-sided CUSUM of clipped standardized residuals: a rise that stays a sigma or so
                # above the forecast for tens of steps (a slow divergence the level would otherwise
                # follow) accumulates here although no single value is a jump. Jump-flagged values
                # are left out, so a long spike does not leave a drift alarm behind it.
                # A drift is a rise above where the metric is, not above where a falling trend would
                # take it: at the end of a fast fall (a learning-rate drop, a plateau's sudden drop) the
                # trend runs on below a curve that has flattened, and the gap filled this sum.
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
        if self.log_space:
            floor = self._min_margin
        else:
            floor = self.min_rel_change * abs(forecast)
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
            self._var, self._residuals, residual, self._last_residual, bound, trusted, self.scale_rate, self._kappa
        )
        # While a rise is accumulating in the drift sum, it must not widen its own threshold (a slow
        # explosion's residuals look like slowly varying, autocorrelated noise). Nor may the forecast's
        # own catching up: in the first steps of a run (and after a re-baseline) the residuals are
        # the trend converging onto the curve, a bias that is large and varies, and as "noise" it
        # inflated the scale and the autocorrelation for hundreds of updates (a 94-sigma spike at step
        # 51 read as 4.7 sigmas). So the moments learn only while the forecast is unbiased.
        unbiased = self._armed or self._calm > 0
        if unbiased and self._cusum <= _FREEZE_MOMENTS * (self.drift_threshold or math.inf):
            self._update_moments(residual, bound, trusted)
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

    def _gross(self, step: int, value: float, x: float) -> SpikeEvent | None:
        """The rule of the uncalibrated phase: far above the median of the recent accepted values."""
        assert self.gross_ratio is not None
        reference = _median(self._window)
        if self.log_space:
            margin = math.log(self.gross_ratio)
        else:
            margin = (self.gross_ratio - 1.0) * abs(reference)
        # ... and gross_z times the run's own noise: the ratio is a floor, the noise sets the bar on a
        # noisy metric (a low loss, a small batch), so the rule's false-alarm rate does not depend on
        # the loss's scale or noise level.
        noise, absolute = self._window_noise()
        if self._var is not None and self._residuals >= MIN_SCALE_SAMPLES:
            noise = max(noise, self._sigma())
        margin = max(margin, self.gross_z * noise, self._abs_margin(self.gross_z / _WINDOW_NOISE_SHARE, absolute))
        excess = x - reference if self.direction == "up" else abs(x - reference)
        if not excess > margin or not self._material(value, reference):
            return None
        # Scored in sigmas when a noise estimate exists (informational: the rule does not use it).
        score = (x - reference) / self._sigma() if self._var is not None else math.inf
        return self._spike(step, value, x, reference, margin, score, "gross")

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
        progress = _median(self._first) - base
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
        level = abs(_median(self._noise[-_GROSS_WINDOW - 1 : -1])) if len(self._noise) > 1 else 0.0
        return rel / level if level > 0.0 else 0.0

    def _window_noise(self) -> tuple[float, float]:
        """The run's measured noise: a robust scale of the successive differences of the last finite
        values, flagged ones too (centred on their median, so a steady descent is not noise), as
        (relative, absolute). In log space relative is the scale of the logs' differences and absolute
        that of the values' differences over the current level (the median of the last 5): a batch
        noise of fixed size in nats (a few hard tokens per batch) grows relative to a loss that falls,
        faster than a scale learnt from the past follows. In linear space absolute is 0 (the rules
        there are in the metric's units already). Zeros before two values."""
        values = self._noise[-_NOISE_WINDOW - 1 : -1]  # the values before the one judged
        # The whole window, and its last _FAST_WINDOW values: a noise that widens shows in the short
        # one within a few steps (a median of 32 needs half the window), and a median of 8 differences
        # is still not moved by the two differences of one spike.
        rel, absolute = max(_diff_scale(values), _diff_scale(values[-_FAST_WINDOW:])), 0.0
        if self.log_space and len(values) >= 2:
            level = math.exp(_median(values[-_GROSS_WINDOW:]))
            linear = [math.exp(min(v, 700.0)) for v in values]
            absolute = max(_diff_scale(linear), _diff_scale(linear[-_FAST_WINDOW:])) / level
        return rel, absolute

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
        # re-baseline as before, and so do 50 of 100 interleaved with accepted values (a shift whose
        # noise lets some values through would otherwise be flagged for ever).
        self._marks.append(self._seen)
        self._marks = [m for m in self._marks if m > self._seen - 2 * self.rebaseline_after]
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
        if run >= self.rebaseline_after or len(self._marks) >= self.rebaseline_after:
            self._rebaseline()
        return event

    def _rebaseline(self) -> None:
        # A persistent shift, not a spike: re-seat the level on the recent values, drop the stale
        # trend, keep the noise scale, and warm up again (until the forecast is calibrated) so that
        # the transient of settling onto the new level cannot raise alerts of its own.
        # After flags interleaved with accepted values (the re-baseline by share) few flagged values
        # may be at hand: the latest accepted ones, which lie at the new level too, join them.
        recent = self._recent if len(self._recent) >= _GROSS_WINDOW else self._window[-_GROSS_WINDOW:] + self._recent
        self._level = _median(recent)
        self._window = recent[-_GROSS_WINDOW:]  # the gross rule judges against the new level
        self._trend = 0.0
        self._last_residual = None
        self._cusum = 0.0
        self._armed = False
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


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _diff_scale(values: list[float]) -> float:
    """A robust Gaussian sigma of ``values``' noise from their successive differences (0 before two values)."""
    diffs = [b - a for a, b in zip(values, values[1:])]
    if len(diffs) >= _ROBUST_DIFFS:
        centre = _median(diffs)
        # 1.4826 * MAD is a Gaussian sigma; a difference of two values has sqrt(2) times theirs.
        return 1.4826 * _median([abs(d - centre) for d in diffs]) / math.sqrt(2.0)
    if diffs:
        # A handful: their root mean square (a median of a few is unreliable, and dropping the largest
        # read a noisy run's noise low enough to flag its 4th value; a steep descent only widens the bar).
        return math.sqrt(sum(d * d for d in diffs) / (2.0 * len(diffs)))
    return 0.0

