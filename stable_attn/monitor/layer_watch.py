"""The watched attention layers: their statistics as metrics, and the early warnings on them.

Each layer's saturation and max logit go to a :class:`~stable_attn.monitor.SurgeDetector`, and its
attention entropy (where it is collected) to an
:class:`~stable_attn.monitor.detectors.collapse.EntropyCollapseDetector`, on monitored steps, with the step's
training loss (an early warning needs the loss to have stopped improving, except the alarm levels).
Layers are added as the engine finds models; a checkpoint's layer history and detector states are kept
until the layers they belong to exist.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..stats import AttentionStats
from . import names
from .detectors.collapse import EntropyCollapseDetector
from .detectors.events import SpikeEvent
from .detectors.surge import SurgeDetector
from .layer_stats import STAT_NAMES, LayerStats

__all__ = ["LayerWatch"]

_SURGES = (("saturation", SurgeDetector.saturation), ("max_logit", SurgeDetector.max_logit),
           ("entropy", EntropyCollapseDetector))


class LayerWatch:
    """The layers' :class:`LayerStats` and their early-warning detectors (none when ``early_warnings`` is False).

    Args:
        window: monitored steps over which :meth:`most_changed` compares the layers.
        early_warnings: run early-warning detectors on each layer's saturation, max logit and entropy.
        warmup: monitored steps each detector watches before it can fire; None keeps its default.
    """

    def __init__(self, window: int, early_warnings: bool, warmup: int | None) -> None:
        self.window, self.early_warnings, self.warmup = window, early_warnings, warmup
        self.layers: LayerStats | None = None  # None until the engine has looked for models
        self.surge_detectors: dict[str, SurgeDetector | EntropyCollapseDetector] = {}
        self._saved: dict[str, Any] = {}  # a checkpoint's "layers" and "surge" states

    def add(self, stats: Mapping[str, AttentionStats]) -> None:
        """Watch these layers too (the earlier ones stay); the window of layer history starts afresh
        unless a checkpoint holds one."""
        every = {**(self.layers.stats if self.layers is not None else {}), **stats}
        self.layers = LayerStats(every, window=self.window)
        if self._saved:
            self.layers.load_state_dict(self._saved.get("layers", {}))
        if not self.early_warnings:
            return
        kwargs = {} if self.warmup is None else {"warmup": self.warmup}
        for layer in every:
            for stat, make in _SURGES:
                metric = names.layer_metric(stat, layer)
                if metric not in self.surge_detectors:
                    self.surge_detectors[metric] = make(metric, **kwargs)
        self._load_surge(self._saved.get("surge", {}))

    def enable(self, on: bool) -> None:
        if self.layers is not None:
            self.layers.enable(on)

    def observe(self, step: int, all_gather: Callable[[torch.Tensor], torch.Tensor] | None, device: torch.device,
                loss: float | None, judge: bool = True) -> tuple[dict[str, float], list[SpikeEvent]]:
        """This step's statistics reduced over heads, calls and ranks (``all_gather`` is called once,
        on every rank), as metrics by name, and the new early-warning events they raise. ``judge=False``
        (a step whose loss or gradient norm spiked) logs the statistics without feeding the early-warning
        detectors: they are that batch's, not the model's, and the spike is alerted already."""
        metrics: dict[str, float] = {}
        events: list[SpikeEvent] = []
        if self.layers is None or not len(self.layers):
            return metrics, events
        for layer, values in self.layers.collect(step, all_gather, device).items():
            for stat in STAT_NAMES:
                if stat in values:  # the entropy only where it was collected
                    metrics[names.layer_metric(stat, layer)] = values[stat]
            for stat, _ in _SURGES if judge else ():
                detector = self.surge_detectors.get(names.layer_metric(stat, layer))
                if detector is None or stat not in values:  # the entropy only where it was collected
                    continue
                event = detector.update(step, values[stat], loss=loss)  # a NaN loss is ignored by the detector
                if event is not None and event.is_new:
                    events.append(event)
        return metrics, events

    def most_changed(self) -> list[tuple[str, float]]:
        return self.layers.most_changed() if self.layers is not None else []

    def state_dict(self) -> dict[str, Any]:
        """``{"layers": ..., "surge": ...}``: the layer history and every surge detector's state."""
        return {"layers": self.layers.state_dict() if self.layers is not None else {},
                "surge": {metric: det.state_dict() for metric, det in self.surge_detectors.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._saved = {"layers": state.get("layers", {}), "surge": state.get("surge", {})}
        if self.layers is not None:
            self.layers.load_state_dict(self._saved["layers"])
        self._load_surge(self._saved["surge"])

    def _load_surge(self, states: Mapping[str, Any]) -> None:
        for metric, saved in states.items():
            if metric in self.surge_detectors:
                self.surge_detectors[metric].load_state_dict(saved)
