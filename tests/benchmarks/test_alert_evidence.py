"""benchmarks/alert_evidence.py on its tiny model (a smoke test of the script, not a measurement): one alert
step's evidence is gathered, with the 5 largest gradient norms, and every step's record is timed."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("alert_evidence", os.path.join(ROOT, "benchmarks", "alert_evidence.py"))
ae = importlib.util.module_from_spec(_spec)
sys.modules["alert_evidence"] = ae
_spec.loader.exec_module(ae)


@pytest.mark.usefixtures("one_thread")
def test_the_tiny_model_times_the_evidence_of_an_alert_step():
    r = ae.measure("tiny", repeats=1)
    assert r["tensors"] == 52 and 0.7e6 < r["params"] < 0.9e6
    assert r["fill_ms"] > 0 and r["again_ms"] > 0 and r["record_us"] > 0
