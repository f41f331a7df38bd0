"""How close is close enough: the error measures the kernel tests share (imported by the test modules here)."""

from __future__ import annotations

import torch

# One ulp at 1.0 for 16-bit types; for fp32 the comparisons see fp32 summation-order noise instead
# (no rounding point is in fp32 precision), so its unit is 2^-18.
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-18}
FLOOR = 16 * 2.0**-24  # fp32 noise: below this no error ratio is meaningful


def close(got, want, tol_ulps, dtype, what, floor=1e-6):
    """|got - want| <= tol_ulps ulps of the dtype, relative to the magnitude of ``want``, + ``floor``."""
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN pattern differs"
    ok = ~torch.isnan(want)
    scale = want[ok].abs().max().clamp(min=1e-30) if ok.any() else torch.tensor(1.0)
    err = (got[ok] - want[ok]).abs().max() if ok.any() else torch.tensor(0.0)
    # the absolute floor covers gradients that are pure cancellation noise (e.g. dq with one key)
    assert err <= tol_ulps * EPS[dtype] * scale + floor, f"{what}: max err {err:.3g} > {tol_ulps} ulps of {scale:.3g}"


def no_worse_than_reference(got, ref, exact, dtype, what, slack=1.5):
    """The kernel's error against the fp64 oracle is at most ``slack`` x the reference's (+2 ulps)."""
    got, ref = got.double().cpu(), ref.double().cpu()
    scale = exact.abs().max().clamp(min=1e-30)
    e_got = (got - exact).abs().max()
    e_ref = (ref - exact).abs().max()
    assert e_got <= slack * e_ref + 2 * EPS[dtype] * scale, f"{what}: {e_got:.3g} vs reference {e_ref:.3g}"


def rel_rms(a, b):
    """RMS error relative to the truth ``b``, or absolute when the truth is below 1 (e.g. dq = 0 for one key)."""
    return ((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp(min=1.0)).item()


def rel_max(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1.0)).item()
