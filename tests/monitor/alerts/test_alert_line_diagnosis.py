"""The console alert line carries the spike's replay verdict (``diagnose_spikes``), not only the JSONL and report."""

from __future__ import annotations

import logging

import pytest

from stable_attn.monitor.alerts.alert import Alert, LoggingChannel


def _spike(diagnosis):
    return Alert(step=12, kind="spike", metric="train/loss", value=9.0, baseline=3.0, threshold=5.0, score=12.0,
                 action="skip", message="loss spike", diagnosis=diagnosis)


@pytest.mark.parametrize("diagnosis, words", [
    ({"metric": "loss", "verdict": "numerical", "bundle": "replay-step-12"},
     "diagnosis numerical (a replay with another attention arithmetic did not spike), replay bundle replay-step-12"),
    ({"metric": "loss", "verdict": "data"}, "diagnosis data (every replayed attention arithmetic spiked"),
    ({"metric": "loss", "verdict": "unclear"}, "diagnosis unclear"),
    ({"skipped": "not replayed under DDP"}, "diagnosis skipped: not replayed under DDP"),
    ({"error": "RuntimeError: out of memory"}, "diagnosis failed: RuntimeError: out of memory"),
])
def test_the_log_line_says_the_verdict(diagnosis, words, caplog):
    line = _spike(diagnosis).format()
    assert words in line and "\n" not in line
    assert line.index("action skip") < line.index("diagnosis") < line.index("loss spike")
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        LoggingChannel().send(_spike(diagnosis))
    assert any(words in r.getMessage() for r in caplog.records)


def test_no_diagnosis_no_words():
    assert "diagnosis" not in _spike(None).format()
