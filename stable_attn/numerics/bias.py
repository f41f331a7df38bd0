"""Is an error biased? Mean signed error, its t-statistic and the RMS error, in sensible units.

A rounding error that averages out over rows is harmless for training; one with a non-zero mean
adds up coherently in the weight updates (the paper's point 4). So the statistic we report is the
mean signed error of many independent samples (rows), with its t-statistic
``mean / (std / sqrt(n))``: ``|t| >= 3`` means the mean is very unlikely to be zero by chance
(two-sided p ~ 0.003 under a normal approximation), i.e. the error is biased.

Errors are divided by a per-row unit (for example ``2^-8 * rms(O_row)``: bf16's unit roundoff at the
row's magnitude), so rows of different scale count alike and "1.0" reads as "one bf16 rounding".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

BF16_UNIT_ROUNDOFF = 2.0**-8  # half the spacing of bf16 numbers in [1, 2)
BIAS_T = 3.0  # |t| at or above this counts as a visible bias


@dataclass(frozen=True)
class ErrorStats:
    """Signed-error statistics over ``n`` independent samples (rows), in units of the row's unit."""

    n: int
    mean: float  # mean signed error: the bias
    t: float  # mean / standard error of the mean
    rms: float  # root-mean-square error over all elements
    max_abs: float

    @property
    def biased(self) -> bool:
        return math.isfinite(self.t) and abs(self.t) >= BIAS_T

    def as_dict(self) -> dict[str, float | int | bool]:
        d = asdict(self)
        d["biased"] = self.biased
        return d


def error_stats(approx: torch.Tensor, exact: torch.Tensor, unit: torch.Tensor) -> ErrorStats:
    """Bias statistics of ``approx - exact``.

    Args:
        approx, exact: ``[rows, D]`` (any float dtype; computed in float64).
        unit: ``[rows]`` positive per-row units the errors are divided by.

    The t-statistic treats rows as independent samples: each row contributes the mean of its
    ``D`` normalised errors (elements of one row share inputs, so they are not independent).
    """
    if approx.shape != exact.shape or approx.dim() != 2:
        raise ValueError(f"approx {tuple(approx.shape)} and exact {tuple(exact.shape)} must both be [rows, D]")
    if unit.shape != approx.shape[:1]:
        raise ValueError(f"unit must have shape [rows] = {tuple(approx.shape[:1])}, got {tuple(unit.shape)}")
    err = (approx.double() - exact.double()) / unit.double().clamp(min=torch.finfo(torch.float64).tiny)[:, None]
    row_mean = err.mean(dim=1)
    n = row_mean.numel()
    mean = row_mean.mean().item()
    sd = row_mean.std(unbiased=True).item() if n > 1 else math.nan
    if n > 1 and sd > 0:
        t = mean / (sd / math.sqrt(n))
    else:
        t = 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return ErrorStats(n=n, mean=mean, t=t, rms=err.pow(2).mean().sqrt().item(), max_abs=err.abs().max().item())


def row_unit(exact: torch.Tensor) -> torch.Tensor:
    """``2^-8 * rms`` of each row of ``exact`` (``[rows, D]`` -> ``[rows]``): one bf16 rounding."""
    return BF16_UNIT_ROUNDOFF * exact.double().pow(2).mean(dim=1).sqrt()
