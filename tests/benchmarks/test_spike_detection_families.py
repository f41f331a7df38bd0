"""benchmarks/spike_detection.py's two scale/noise families: the same draws, only the noise's shape differs."""

from __future__ import annotations

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import spike_detection as sd  # noqa: E402


def test_multiplicative_noise_is_log_normal_of_the_same_size():
    rng = np.random.default_rng(0)
    curve = np.full(200_000, 2.0)
    sigma = 0.3 * curve
    noise = rng.standard_normal(curve.size)
    values = curve + sigma * sd.multiplicative(curve, sigma, noise)
    logs = np.log(values / curve)
    assert abs(logs.std() / np.log1p(0.3) - 1.0) < 0.01  # log sigma = log(1 + cv)
    assert abs(((logs - logs.mean()) ** 3).mean() / logs.std() ** 3) < 0.05  # symmetric in log space
    assert np.isfinite(values).all() and (values > 0).all()
    assert abs(np.median(values) / 2.0 - 1.0) < 0.01


def test_the_log_normal_family_shares_the_scale_familys_events_and_clean_steps():
    for seed in range(3):
        gauss, lognormal = sd.make_trace(seed, 1500, "scale"), sd.make_trace(seed, 1500, "scale_lognormal")
        assert [(e.kind, e.onset, e.end) for e in gauss.events] == [(e.kind, e.onset, e.end) for e in lognormal.events]
        assert np.array_equal(gauss.clean, lognormal.clean) and np.array_equal(gauss.hard, lognormal.hard)
        assert not np.allclose(gauss.values[gauss.clean], lognormal.values[lognormal.clean])
