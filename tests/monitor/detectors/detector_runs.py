"""Feeding a detector a whole trace: the helper the detector tests share."""

from __future__ import annotations

from stable_attn.monitor import SpikeDetector, SpikeEvent, SurgeDetector


def run(det: SpikeDetector | SurgeDetector, values, losses=None, start: int = 0) -> list[SpikeEvent]:
    """The events of ``det`` over ``values`` (steps ``start``, ``start + 1``, ...); with ``losses``, each
    update also gets that step's loss (SurgeDetector)."""
    events = []
    for i, x in enumerate(values):
        if losses is None:
            event = det.update(start + i, float(x))
        else:
            event = det.update(start + i, float(x), loss=float(losses[i]))
        if event is not None:
            events.append(event)
    return events
