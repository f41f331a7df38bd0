"""The monitoring modules moved from ``stable_attn.callbacks`` to ``stable_attn.monitor`` (issue 29); the old
import paths still work, as aliases of the new modules, and say at import that they are deprecated."""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = ("engine", "verdict", "layer_watch", "layer_stats", "alerting", "rollback", "grad_norm")


@pytest.mark.parametrize("name", MOVED)
def test_old_path_is_the_new_module_and_warns(name):
    new = importlib.import_module(f"stable_attn.monitor.{name}")
    old_name = f"stable_attn.callbacks.{name}"
    sys.modules.pop(old_name, None)  # import it afresh, so that its warning is raised here
    with pytest.warns(DeprecationWarning, match=f"stable_attn.monitor.{name}"):
        old = importlib.import_module(old_name)
    assert old is new


def test_old_from_imports_work():
    from stable_attn.callbacks.engine import MonitorEngine, Trainables, World
    from stable_attn.callbacks.grad_norm import nonfinite_grads, total_grad_norm
    from stable_attn.callbacks.layer_stats import STAT_NAMES, LayerStats
    from stable_attn.monitor import engine, grad_norm, layer_stats

    assert (MonitorEngine, Trainables, World) == (engine.MonitorEngine, engine.Trainables, engine.World)
    assert (nonfinite_grads, total_grad_norm) == (grad_norm.nonfinite_grads, grad_norm.total_grad_norm)
    assert (STAT_NAMES, LayerStats) == (layer_stats.STAT_NAMES, layer_stats.LayerStats)
