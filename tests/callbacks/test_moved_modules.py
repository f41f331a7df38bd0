"""The monitoring modules moved from ``stable_attn.callbacks`` to ``stable_attn.monitor`` (issue 29); the old
import paths still work, as aliases of the new modules, and say at import that they are deprecated."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

MOVED = ("engine", "verdict", "layer_watch", "layer_stats", "alerting", "rollback", "grad_norm")
ALIASES = tuple(name for name in MOVED if name != "grad_norm")  # grad_norm keeps total_grad_norm's strategy


@pytest.mark.parametrize("name", MOVED)
def test_old_path_warns(name):
    sys.modules.pop(f"stable_attn.callbacks.{name}", None)  # import it afresh, so that its warning is raised here
    with pytest.warns(DeprecationWarning, match=f"stable_attn.monitor.{name}"):
        importlib.import_module(f"stable_attn.callbacks.{name}")


@pytest.mark.parametrize("name", ALIASES)
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
    assert nonfinite_grads is grad_norm.nonfinite_grads
    model = torch.nn.Linear(3, 2)
    model(torch.ones(4, 3)).sum().backward()
    assert torch.equal(total_grad_norm(model.parameters()), grad_norm.total_grad_norm(model.parameters()))
    assert torch.equal(total_grad_norm(model.parameters(), strategy=object()),
                       grad_norm.total_grad_norm(model.parameters()))
    assert (STAT_NAMES, LayerStats) == (layer_stats.STAT_NAMES, layer_stats.LayerStats)
