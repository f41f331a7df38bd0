"""Checks of a monitor state read back from a checkpoint, before any of it is loaded.

A checkpoint is a file: it can be damaged or edited. A detector state with a NaN, an infinite or a
negative variance, or a count that is not an int, would load (or fail deep inside with
``invalid literal for int()``) and then judge every later value wrongly: a loss detector whose
variance is inf never fires. :func:`check_engine_state` refuses such a state at resume with a
ValueError naming the field, its value and what is accepted.
:meth:`~stable_attn.monitor.engine.MonitorEngine.load_state_dict` calls it before it loads anything;
the rollback snapshot in the state is checked by :func:`~stable_attn.monitor.actions.snapshots.snapshot_from_state`
there, and against the run's own state (shapes, finiteness) by
:func:`~stable_attn.monitor.actions.snapshots.check_snapshot` at
:meth:`~stable_attn.monitor.engine.MonitorEngine.train_start`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["check_detector_state", "check_engine_state", "check_resumed_state"]

_FIX = "resume from a checkpoint this run wrote, or start the detectors afresh without it"
# Saved detector fields that hold a variance: a finite number >= 0 (or None before the first estimate).
_VARIANCES = frozenset({"var", "rvar"})
_META = frozenset({"version", "type", "config"})


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _refuse(where: str, value: Any, accepted: str) -> ValueError:
    return ValueError(f"the checkpoint's {where} is {_shown(value)}, expected {accepted}; {_FIX}")


def check_detector_state(state: Any, where: str, template: Mapping[str, Any]) -> None:
    """Raise ValueError naming ``where[key]`` unless each field of ``state`` has the type of the same field
    in ``template`` (a detector's own ``state_dict()``): ints are ints >= 0, floats finite numbers, flags
    bools, lists lists of finite numbers; a field the template holds as None (an estimate not made yet) is
    None or a finite number (``last_kind``: None or a str); variances are None or >= 0. Keys the template
    lacks, and missing keys, are left to the detector's ``load_state_dict`` (older versions)."""
    if not isinstance(state, Mapping):
        raise _refuse(where, state, "a dict from the detector's state_dict()")
    for key, value in state.items():
        if key in _META or key not in template:
            continue
        like, field = template[key], f"{where}[{key!r}]"
        if key in _VARIANCES:
            ok, accepted = value is None or (_number(value) and value >= 0), "None or a finite number >= 0"
        elif key.endswith("kind"):  # the kind of the last event: None or a str
            ok, accepted = value is None or isinstance(value, str), "None or a str"
        elif isinstance(like, bool):
            ok, accepted = isinstance(value, bool), "True or False"
        elif isinstance(like, int):
            ok, accepted = _count(value), "an int >= 0"
        elif isinstance(like, float):
            ok, accepted = _number(value), "a finite number"
        elif isinstance(like, list):
            ok = isinstance(value, list) and all(_number(v) for v in value)
            accepted = "a list of finite numbers"
        elif like is None:  # an estimate not made yet
            ok, accepted = value is None or _number(value), "None or a finite number"
        else:
            ok, accepted = True, ""
        if not ok:
            raise _refuse(field, value, accepted)


def check_engine_state(state: Any, spike_template: Mapping[str, Any], surge_template: Mapping[str, Any] | None,
                       where: str = "monitor state") -> None:
    """Check a :meth:`MonitorEngine.state_dict` read from a checkpoint (see the module docstring):
    its loss and gradient-norm detectors (every rank's) against ``spike_template``, its surge detectors
    against ``surge_template``, and its counts, step lists and delivery counts."""
    if not isinstance(state, Mapping):
        raise _refuse(where, state, "a dict from the callback's state_dict()")
    for key in ("loss_detector", "grad_norm_detector"):
        if key in state:
            check_detector_state(state[key], f"{where}[{key!r}]", spike_template)
    for key in ("other_rank_loss_detectors", "other_rank_grad_norm_detectors"):
        others = state.get(key, [])
        if not isinstance(others, list):
            raise _refuse(f"{where}[{key!r}]", others, "a list of detector states")
        for i, other in enumerate(others):
            check_detector_state(other, f"{where}[{key!r}][{i}]", spike_template)
    saved = state.get("rollback_detectors")
    if saved is not None:
        if not isinstance(saved, Mapping):
            raise _refuse(f"{where}['rollback_detectors']", saved, "a dict of metric names to lists of detector states")
        for metric, states in saved.items():
            if not isinstance(states, list):
                raise _refuse(f"{where}['rollback_detectors'][{metric!r}]", states, "a list of detector states")
            for i, one in enumerate(states):
                check_detector_state(one, f"{where}['rollback_detectors'][{metric!r}][{i}]", spike_template)
    surge = state.get("surge", {})
    if not isinstance(surge, Mapping):
        raise _refuse(f"{where}['surge']", surge, "a dict of metric names to detector states")
    if surge_template is not None:
        for metric, saved in surge.items():
            check_detector_state(saved, f"{where}['surge'][{metric!r}]", surge_template)
    for key in ("alert_count", "not_training_streak", "unconfirmed_grad_norm_jumps"):
        if key in state and not _count(state[key]):
            raise _refuse(f"{where}[{key!r}]", state[key], "an int >= 0")
    kinds = state.get("alert_kinds", {})
    if not isinstance(kinds, Mapping) or not all(isinstance(k, str) and _count(v) for k, v in kinds.items()):
        raise _refuse(f"{where}['alert_kinds']", kinds, "a dict of alert kinds to ints >= 0")
    skipped = state.get("skipped_steps", [])
    if not isinstance(skipped, list) or not all(_count(s) for s in skipped):
        raise _refuse(f"{where}['skipped_steps']", skipped, "a list of steps (ints >= 0)")
    rollbacks = state.get("rollbacks", [])
    if not isinstance(rollbacks, list) or not all(
            isinstance(r, (list, tuple)) and len(r) == 2 and all(_count(s) for s in r) for r in rollbacks):
        raise _refuse(f"{where}['rollbacks']", rollbacks, "a list of [step, snapshot step] pairs of ints >= 0")
    stop = state.get("stop_checkpoint")
    if stop is not None and not isinstance(stop, str):
        raise _refuse(f"{where}['stop_checkpoint']", stop, "None or a path (str)")
    delivery = state.get("alert_delivery", {})
    if not isinstance(delivery, Mapping) or not all(
            isinstance(counts, Mapping) and all(isinstance(k, str) and _count(v) for k, v in counts.items())
            for counts in delivery.values()):
        raise _refuse(f"{where}['alert_delivery']", delivery, "a dict of channels to counts (ints >= 0)")


def check_resumed_state(engine: Any, state: Any, where: str) -> None:
    """:func:`check_engine_state` with ``engine``'s own detectors as templates (an adapter's resume hook)."""
    from .detectors.surge import SurgeDetector

    check_engine_state(state, engine.loss_detector.state_dict(), SurgeDetector.saturation("template").state_dict(),
                       where)
