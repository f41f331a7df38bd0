"""The three adapters spell out the engine's constructor arguments (so IDEs and ``help()`` show them); the
engine's signature is the one source: names, order, kinds, defaults and annotations must agree exactly."""

from __future__ import annotations

import inspect

from stable_attn.callbacks import StableAttentionCallback, StableAttentionGuard, StableAttentionTrainerCallback
from stable_attn.callbacks import trainer as trainer_module
from stable_attn.monitor.engine import MonitorEngine


def _parameters(cls: type) -> list[tuple[str, object, object, object]]:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self
    return [(p.name, p.kind, p.default, p.annotation) for p in params if p.name != "name"]


def test_both_callbacks_take_exactly_the_engines_arguments():
    engine = _parameters(MonitorEngine)
    assert len(engine) == 33  # a new argument: add it to both callbacks (and their docstrings)
    assert _parameters(StableAttentionCallback) == engine
    assert _parameters(StableAttentionTrainerCallback) == engine
    assert _parameters(StableAttentionGuard) == engine


def test_trainer_callback_sorts_every_argument_into_saved_or_unsaved():
    """Every argument is either written to trainer_state.json or named as not saved there, once."""
    names = [p[0] for p in _parameters(MonitorEngine)]
    sorted_args = trainer_module._JSON_ARGS + trainer_module._OTHER_ARGS
    assert sorted(sorted_args) == sorted(names)
    assert len(set(sorted_args)) == len(sorted_args)
