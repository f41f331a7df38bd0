"""Kernel tests: every tensor the Triton launchers allocate starts as garbage (NaN, or an impossible
integer), so an element a kernel forgets to write fails the comparison that reads it."""

from __future__ import annotations

import math

import pytest
import torch

from stable_attn.kernels import triton_launch as launch


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    def fill(t):
        if t.is_floating_point():
            return t.fill_(math.nan)
        return t.fill_(2 if t.dtype == torch.int8 else -7)

    monkeypatch.setattr(launch, "empty", lambda shape, dtype, device: fill(torch.empty(shape, dtype=dtype,
                                                                                    device=device)))
    monkeypatch.setattr(launch, "empty_like", lambda x: fill(torch.empty_like(x)))
