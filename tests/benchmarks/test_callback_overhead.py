"""benchmarks/callback_overhead.py runs both loops end to end on a tiny model (a smoke test of the
script, not a measurement): each configuration times its steps and the callbacks' hooks."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("callback_overhead",
                                               os.path.join(ROOT, "benchmarks", "callback_overhead.py"))
co = importlib.util.module_from_spec(_spec)
sys.modules["callback_overhead"] = co
_spec.loader.exec_module(co)

TINY = argparse.Namespace(steps=3, warmup=1, layers=1, width=16, heads=2, seq=16, batch=2, accelerator="cpu",
                          precision="32-true")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("loop", ["lightning", "trainer"])
def test_both_loops_time_steps_and_hooks(loop):
    fit = co.trainer_run if loop == "trainer" else co.run
    cls = co.StableAttentionTrainerCallback if loop == "trainer" else co.StableAttentionCallback
    wall, cpu, hooks = fit(TINY, lambda: cls(log_every_n_steps=1))
    assert wall > 0 and cpu > 0 and hooks > 0
    assert fit(TINY, None)[2] == 0.0  # no callback: nothing timed inside hooks
