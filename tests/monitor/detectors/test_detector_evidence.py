"""The detectors' evidence on real training runs (slow: each trains tiny models on the CPU).

These rerun, in small, what ``benchmarks/early_detection.py`` and ``benchmarks/instability.py``
record in docs/BENCHMARKS.md, so a change to a detector default that breaks them fails here.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# As the benchmarks run: one torch thread (faster than two on a shared 2-core machine).
pytestmark = pytest.mark.usefixtures("one_thread")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_garbled_batch_from_step_10_is_caught_on_its_step_and_a_clean_run_is_silent() -> None:
    early = _load("early_detection")
    assert early.detect(early.train(160, 3e-3, None)) == []
    for step in (10, 20, 50, 90, 110, 150):
        alerts = early.detect(early.train(160, 3e-3, step))
        assert [a for a in alerts if a[0] != step] == [], (step, alerts)
        assert any(a[0] == step for a in alerts), (step, alerts)


@pytest.mark.slow
def test_early_warning_comes_50_steps_before_the_loss_spike_and_never_in_a_good_run() -> None:
    bench = _load("instability")
    args = argparse.Namespace(steps=400, warmup=300, width=128, heads=4, layers=2, seq=64, batch=16)
    good = bench.train(bench.RunConfig("good", 3e-3), args)
    assert good.alerts == []
    unstable = bench.summarize(bench.train(bench.RunConfig("unstable", 1.0), args))
    assert unstable["first_early_warning"] is not None and unstable["first_loss_alert"] is not None
    assert unstable["lead_steps"] >= 50
