"""The constants of stable_attn/rules.py: the exact tie boundary and the shifted offset."""

from __future__ import annotations

import torch

from stable_attn import rules


def test_tie_tolerance_is_the_exact_rounding_boundary():
    for dtype in rules.SUPPORTED_DTYPES:
        tau = rules.tie_tolerance(dtype)
        inside = torch.exp(torch.tensor(-tau * 0.999, dtype=torch.float64)).to(dtype)
        outside = torch.exp(torch.tensor(-tau * 1.001, dtype=torch.float64)).to(dtype)
        assert inside.item() == 1.0 and outside.item() < 1.0, dtype


def test_shifted_offset_is_monotone_bounded_and_the_paper_rule_in_between():
    m = torch.linspace(-200, 200, 40001, dtype=torch.float64)
    for dtype in rules.SUPPORTED_DTYPES:
        _, lo, hi = rules.rule_constants(dtype, rules.MODE_EXACT)
        r = rules.shifted_offset(m, 2.0, lo, hi)
        assert (r[1:] >= r[:-1]).all()
        shift = r - m
        assert (shift >= lo - 1e-12).all() and (shift <= hi + 1e-12).all()
        paper = torch.where(m > 0, 2.0 * m, torch.zeros_like(m))
        mid = ((paper - m) > lo) & ((paper - m) < hi)
        torch.testing.assert_close(r[mid], paper[mid])

