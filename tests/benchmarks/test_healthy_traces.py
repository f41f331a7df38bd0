"""benchmarks/healthy_traces.py's replay on constructed runs: what the engine alerts, and the excursion table."""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
_spec = importlib.util.spec_from_file_location("healthy_traces", os.path.join(ROOT, "benchmarks", "healthy_traces.py"))
ht = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ht)


def _run(bad: int | None, norm_jump: int | None = None) -> dict:
    loss = [(s, 0.2 + 5.3 * math.exp(-s / 15.0) * (1.0 + 0.02 * (-1) ** s)) for s in range(60)]
    norm = [(s, 1.0 + 0.05 * (-1) ** s) for s in range(60)]
    if bad is not None:
        loss[bad] = (bad, 5.6)
        norm[bad] = (bad, 20.0)
    if norm_jump is not None:
        norm[norm_jump] = (norm_jump, 30.0)  # the loss stays ordinary
    return {"train/loss": loss, "train/grad_norm": norm}


def test_replay_reports_the_engines_alerts_and_the_unconfirmed_gradient_norm_jumps(capsys):
    runs = {"text/0/None": _run(None, norm_jump=45), "text/0/50": _run(50), "text/3/None": _run(None)}
    got, unconfirmed = ht.alerts(runs["text/0/None"])
    assert got == {} and unconfirmed == 1  # a gradient-norm jump alone is counted, not alerted
    got, _ = ht.alerts(runs["text/0/50"])
    assert set(got) == {50} and set(got[50]) == {"loss", "grad_norm"}
    ht.replay(runs)
    out = capsys.readouterr().out
    assert "| text/0/None | looked at | " in out and "| text/0/50 | looked at | - | 50: " in out
    assert "seeds looked at: 0 spike alert(s) on the healthy runs; corrupted batches alerted on their step: 1/1" in out
    assert "seeds held out: 0 spike alert(s) on the healthy runs; corrupted batches alerted on their step: 0/0" in out
    assert "seeds fresh" not in out  # no run of data seed 6 or later
    ht.replay({"text/7/None": _run(None), "text/7/50": _run(50)})
    out = capsys.readouterr().out
    assert "| text/7/50 | fresh | - | 50: " in out and "seeds looked at" not in out
    assert "seeds fresh: 0 spike alert(s) on the healthy runs; corrupted batches alerted on their step: 1/1" in out
    assert "| text |" in out.split("corrupted batches: smallest ratio")[1]


def test_replay_sets_both_signals_of_the_corrupted_batches_beside_the_healthy_ones_as_large(capsys):
    """The overlap table: the corrupted batch's loss and norm ratios, and the healthy batches whose loss ratio is at
    least as large (here one, at step 40, its norm ordinary)."""
    healthy = _run(None)
    healthy["train/loss"][40] = (40, healthy["train/loss"][40][1] * 20.0)
    ht.replay({"text/0/None": healthy, "text/0/50": _run(50)})
    row = capsys.readouterr().out.split("their gradient-norm ratio |")[2].split("\n")[2]
    bad = _run(50)
    loss = 5.6 / statistics.median(v for _, v in bad["train/loss"][45:50])  # over the median of the 5 before
    norm = 20.0 / 0.95  # the norm alternates 1.05 (even steps) and 0.95 (odd): 3 of the 5 before are 0.95
    assert row == f"| text | {loss:.2f}-{loss:.2f} | {norm:.2f}-{norm:.2f} | 1 | {1.05 / 0.95:.2f}-{1.05 / 0.95:.2f} |"


def test_noise_shape_tells_gaussian_noise_from_log_normal_noise():
    import random

    rng = random.Random(0)
    gauss = [1.0 + 0.3 * rng.gauss(0.0, 1.0) for _ in range(600)]
    gauss = [abs(v) + 1e-6 for v in gauss]
    lognormal = [math.exp(math.log1p(0.3) * rng.gauss(0.0, 1.0)) for _ in range(600)]
    lin, log, size = ht.noise_shape(gauss)
    assert abs(lin) < 0.3 and log < -0.8 and 0.2 < size < 0.4
    lin, log, size = ht.noise_shape(lognormal)
    assert lin > 0.5 and abs(log) < 0.3


def test_replay_prints_the_noise_shape_of_the_healthy_runs(capsys):
    long = {"train/loss": [(s, 0.2 + 5.3 * math.exp(-s / 15.0) + 0.01 * (-1) ** s) for s in range(120)],
            "train/grad_norm": [(s, 1.0 + 0.05 * (-1) ** s) for s in range(120)]}  # the shape is read from step 60
    ht.replay({"text/0/None": long, "text/0/50": _run(50), "text/1/None": _run(None)})
    out = capsys.readouterr().out.split("skewness, log space")[1]
    assert "| text | 1 | " in out  # the 60-step run is too short to be read
